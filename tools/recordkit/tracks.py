"""What a log says about its track, and the stopping steps its script fixed in advance.

Tracks 1 and 2 log alike (train_time in ms); the published Track 3 scripts log seconds. Track 2 trains GPT-2
medium (350M, width 1024), Tracks 1 and 3 GPT-2 small (124M, width 768), and every log since 2024 embeds the
script that sets the width. So: seconds mean Track 3; this repository's scripts write a `hyperparameters:` line
(both in ms): train_gpt_shampoo.py's settings hold `matrix_optimizer` (Track 3), train_gpt.py's do not (Track 1);
otherwise the width in the embedded code decides. A log without code (console captures, llm.c logs) does not
say, and the commands ask for --track.
"""

from __future__ import annotations

import ast
import re
from collections.abc import Mapping
from typing import Any

from .runs import Environment

WIDTH_TRACKS = {768: 1, 1024: 2}  # model width -> track (timed in ms); 768 in seconds is Track 3
TRACK3_SETTING = "matrix_optimizer"  # a setting only train_gpt_shampoo.py has
_WIDTH = re.compile(r"\b(?:model_dim|n_embd)\s*(?::\s*int\s*)?=\s*(\d+)\b")
_STOP_SETTING = re.compile(r"\b(\w*stop\w*)=(\d+)\b", re.IGNORECASE)


def recognize_track(sources: Mapping[str, str], env: Environment, timed_in_seconds: bool) -> tuple[int | None, str]:
    """The track a run belongs to, and why; (None, why not) when the log does not say."""
    if timed_in_seconds:
        return 3, "train_time in seconds (Track 3 scripts)"
    if env.hyperparameters is not None and TRACK3_SETTING in env.hyperparameters:
        return 3, f"this repository's train_gpt_shampoo.py (a hyperparameters: line with {TRACK3_SETTING})"
    if env.hyperparameters is not None:
        return 1, "this repository's train_gpt.py (a hyperparameters: line)"
    script = next(iter(sources.values()), "")
    if not script:
        return None, "no embedded code to tell GPT-2 small (Track 1) from medium (Track 2)"
    widths = sorted({int(width) for width in _WIDTH.findall(script)})
    if len(widths) == 1 and widths[0] in WIDTH_TRACKS:
        track = WIDTH_TRACKS[widths[0]]
        return track, f"model width {widths[0]} in its code ({'GPT-2 medium' if track == 2 else 'GPT-2 small'})"
    if not widths:
        return None, "its code sets no model_dim/n_embd to tell GPT-2 small (Track 1) from medium (Track 2)"
    return None, f"its code sets several model widths ({', '.join(map(str, widths))})"


def fixed_stop_steps(sources: Mapping[str, str], env: Environment) -> dict[int, str]:
    """Steps at which the script stops by a constant fixed in advance, with where each is fixed.

    A constant assigned to a name containing `stop` (e.g. `STOP_STEP = int(os.environ.get("STOP_STEP", "2720"))`),
    a `Using ...stop...=N` line, or a logged hyperparameter named so. The Track 3 rules allow such a stop: it does not
    depend on the validation loss.
    """
    found: dict[int, str] = {}
    for name, text in sources.items():
        for step, target in _stop_constants(text).items():
            found.setdefault(step, f"{target} in {'its script' if name == '__script__' else name}")
    for key, value in env.settings.items():
        for setting, step in _STOP_SETTING.findall(f"{key}={value}"):
            found.setdefault(int(step), f"`{setting}={step}` in its log")
    for key, value in (env.hyperparameters or {}).items():
        if "stop" in key.lower() and isinstance(value, int) and not isinstance(value, bool):
            found.setdefault(value, f"hyperparameter {key}")
    return found


def _stop_constants(text: str) -> dict[int, str]:
    if "stop" not in text.lower():
        return {}
    try:
        tree = ast.parse(text)
    except (SyntaxError, ValueError):
        return {}
    found: dict[int, str] = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Assign):
            targets, value = node.targets, node.value
        elif isinstance(node, ast.AnnAssign) and node.value is not None:
            targets, value = [node.target], node.value
        else:
            continue
        names = [_target_name(target) for target in targets]
        stop_names = [name for name in names if name and "stop" in name.lower()]
        if not stop_names:
            continue
        for constant in (n for n in ast.walk(value) if isinstance(n, ast.Constant)):
            step = _as_step(constant.value)
            if step is not None:
                found.setdefault(step, stop_names[0])
    return found


def _target_name(target: ast.expr) -> str | None:
    if isinstance(target, ast.Name):
        return target.id
    if isinstance(target, ast.Attribute):
        return target.attr
    return None


def _as_step(value: Any) -> int | None:
    if isinstance(value, bool):
        return None
    if isinstance(value, int) and value > 0:
        return value
    if isinstance(value, str) and value.isdigit() and int(value) > 0:
        return int(value)
    return None
