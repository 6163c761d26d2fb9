"""Parse speedrun logs of every era into `Run`s (one per trial).

Every log family since 2024 writes the embedded source, a line of exactly 100 `=`, environment blocks
(2024 logs add more separators around their DataLoader lines), a last separator, then step lines; some
2024 logs also open with a separator, and console captures and llm.c logs have none. So: the code is
what precedes the first separator that follows text, and the step lines are what follows the last one
(docs/records.md describes each era's lines).
"""

from __future__ import annotations

import ast
import hashlib
import math
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

from .errors import RecordsError
from .program import program_hash
from .runs import Environment, PeakMemory, Run, TrainPoint, ValPoint

SEPARATOR = "=" * 100
LOG_SUFFIXES = (".txt", ".log", ".stdout", ".out")

_NUM = r"[0-9.]+(?:[eE][-+]?\d+)?"
_NUM_OR_NAN = rf"(?:nan|{_NUM})"
_COLUMNS = r"(?:\s+[a-z_]+:\S+)*"
VAL_LINE = re.compile(
    rf"^step:(?P<step>\d+)/(?P<total>\d+)\s+val_loss:(?P<loss>{_NUM_OR_NAN})(?P<pre>{_COLUMNS})"
    rf"\s+train_time:(?P<time>{_NUM})(?P<unit>ms|s)\s+step_avg:(?P<avg>{_NUM_OR_NAN})ms(?P<post>{_COLUMNS})\s*$"
)
TRAIN_LINE = re.compile(
    rf"^step:(?P<step>\d+)/(?P<total>\d+)(?:\s+train_loss:(?P<loss>{_NUM_OR_NAN}))?"
    rf"\s+train_time:(?P<time>{_NUM})(?P<unit>ms|s)\s+step_avg:(?P<avg>{_NUM_OR_NAN})ms{_COLUMNS}\s*$"
)
LLMC_VAL_LINE = re.compile(rf"^s:(?P<step>\d+) tel:(?P<loss>{_NUM_OR_NAN})\s*$")
LLMC_TRAIN_LINE = re.compile(rf"^s:(?P<step>\d+) trl:(?P<loss>{_NUM_OR_NAN})(?: lr:{_NUM} norm:{_NUM_OR_NAN})?\s*$")
TRIAL_MARKER = re.compile(r"^trial:(\d+)/(\d+) seed:(\d+)\s*$")
PEAK_MEMORY = re.compile(r"^peak memory allocated: (\d+) MiB reserved: (\d+) MiB\s*$")
PEAK_MEMORY_2024 = re.compile(r"^peak memory consumption: (\d+) MiB\s*$")
WARMUP_TIME = re.compile(rf"^warmup_time: ({_NUM})s\s*$")
# A val line that does not start its line (e.g. behind bytes a crash left in the file) is lost: reported.
EMBEDDED_VAL_LINE = re.compile(r"step:\d+/\d+\s+val_loss:")

PYTHON_LINE = re.compile(r"^Running [Pp]ython (.+?)\s*$")
TORCH_LINE = re.compile(r"^Running [Pp]y[Tt]orch (\S+) compiled for CUDA (\S+)(?: on (.+) with world_size (\d+))?\s*$")
TRITON_LINE = re.compile(r"^Running Triton version (.+?)\s*$")
DEVICE_NAME_LINE = re.compile(r"^Running on device_name=(.+) with world_size=(\d+)\s*$")
USING_LINE = re.compile(r"^Using (\w+)=(.*)$")
DRIVER = re.compile(r"Driver Version: (\S+)")
GPU_ROW = re.compile(r"^\|\s*(\d+)\s+([A-Za-z][^|]*?)\s+(?:On|Off)\s+\|")
KEY_VALUE = re.compile(r"^([a-z][a-z0-9_]*): (.*)$")

# Banners between the files of an embedded source: the 2025+ Track 1 scripts append kernels behind
# `----(40)` / `# name.py` / `----(40)`; our train_gpt_shampoo.py appends its package behind one line.
DASH_BANNER = "-" * 40
DASH_BANNER_NAME = re.compile(r"^# (\S+\.py)\s*$")
SHAMPOO_BANNER = re.compile(r"^# ===== (\S+) =====\s*$")


def parse_log(path: Path) -> list[Run]:
    """Parse one log file into its runs; raise RecordsError if it holds no val line at all."""
    data = _read_bytes(path)
    text = data.decode("utf-8", errors="replace")
    return parse_text(text, path=path, file_sha256=hashlib.sha256(data).hexdigest())


def parse_text(text: str, path: Path, file_sha256: str = "") -> list[Run]:
    layout = split_layout(text.splitlines())
    sources = split_sources(layout.code)
    code_hash = hash_sources(sources) if sources else None
    env = parse_environment(layout.env_lines, layout.step_lines)
    trials = split_trials(layout.step_lines, first_line_number=layout.step_start + 1)
    if not any(trial.val_points for trial in trials):
        raise RecordsError(f"{path}: {_why_no_val_line(layout, trials)}")
    era = detect_era(layout, env, trials)
    program = program_hash(sources) if sources else None
    return [
        Run(
            path=path,
            file_sha256=file_sha256,
            trial=index,
            trial_count=len(trials),
            era=era,
            sources=sources,
            code_hash=code_hash,
            program_hash=program,
            env=env,
            val_points=trial.val_points,
            train_points=trial.train_points,
            peak_memory=trial.peak_memory,
            warmup_time_s=trial.warmup_time_s,
            notes=trial.notes,
            warnings=[f"{path}: {warning}" for warning in trial.warnings],
        )
        for index, trial in enumerate(trials, start=1)
    ]


def _why_no_val_line(layout: Layout, trials: list[TrialLines]) -> str:
    lost = [warning for trial in trials for warning in trial.warnings]
    if lost:
        return f"no readable val line ({lost[0]}); not a usable log"
    if layout.code and not any(trial.train_points for trial in trials):
        return "source and environment only, no step line (the run stopped before training); not a usable log"
    if any(trial.train_points for trial in trials):
        return "step lines but no val line (the run stopped before its first validation); not a usable log"
    return "no val line ('step:N/T val_loss:X train_time:...' or 's:N tel:X'); pass a training log"


def _read_bytes(path: Path) -> bytes:
    try:
        return path.read_bytes()
    except FileNotFoundError:
        raise RecordsError(f"{path}: no such file; check the path") from None
    except IsADirectoryError:
        raise RecordsError(f"{path}: is a directory; pass log files (or use a command that accepts folders)") from None
    except OSError as exc:
        raise RecordsError(f"{path}: cannot read ({exc.strerror}); check permissions") from None


# ----- layout: code / environment / steps -----


@dataclass
class Layout:
    code: list[str]
    env_lines: list[str]
    step_lines: list[str]
    separator_count: int
    leading_separator: bool
    step_start: int = 0  # index of the first step line in the file's lines


def is_separator(line: str) -> bool:
    # nvidia-smi's own `|====|` rows carry pipes, so they never match.
    return line.rstrip() == SEPARATOR


def split_layout(lines: list[str]) -> Layout:
    separators = [i for i, line in enumerate(lines) if is_separator(line)]
    leading = bool(separators) and not any(line.strip() for line in lines[: separators[0]])
    body_separators = separators[1:] if leading else separators
    if not body_separators:
        start = separators[0] + 1 if leading else 0
        return Layout([], [], lines[start:], len(separators), leading, start)
    code_start = separators[0] + 1 if leading else 0
    first, last = body_separators[0], body_separators[-1]
    env_lines = [line for line in lines[first + 1 : last] if not is_separator(line)]
    return Layout(lines[code_start:first], env_lines, lines[last + 1 :], len(separators), leading, last + 1)


# ----- embedded sources -----


def split_sources(code_lines: list[str]) -> dict[str, str]:
    """Split the embedded source at file banners; the first entry is the training script itself."""
    if not any(line.strip() for line in code_lines):
        return {}
    files: dict[str, list[str]] = {}
    current = "__script__"
    files[current] = []
    i = 0
    while i < len(code_lines):
        line = code_lines[i]
        shampoo = SHAMPOO_BANNER.match(line)
        if shampoo:
            current = shampoo.group(1)
            files[current] = []
            i += 1
            continue
        if (
            line.rstrip() == DASH_BANNER
            and i + 2 < len(code_lines)
            and DASH_BANNER_NAME.match(code_lines[i + 1])
            and code_lines[i + 2].rstrip() == DASH_BANNER
        ):
            current = DASH_BANNER_NAME.match(code_lines[i + 1]).group(1)  # type: ignore[union-attr]
            files[current] = []
            i += 3
            continue
        files[current].append(line)
        i += 1
    return {name: _join_file(lines) for name, lines in files.items()}


def _join_file(lines: list[str]) -> str:
    # The logger adds one newline after the file text; a file that ended in a newline therefore
    # shows one blank line before the next banner. Keep exactly one trailing newline.
    while lines and not lines[-1].strip():
        lines = lines[:-1]
    return "\n".join(lines) + "\n" if lines else ""


def hash_sources(sources: dict[str, str]) -> str:
    digest = hashlib.sha256()
    for name, text in sources.items():
        digest.update(name.encode() + b"\0" + text.encode() + b"\0")
    return digest.hexdigest()


# ----- environment -----


def parse_environment(env_lines: Sequence[str], step_lines: Sequence[str] = ()) -> Environment:
    """Environment blocks in full; among step lines (console captures) only the `Running ...` lines."""
    env = Environment()
    for line in env_lines:
        if not _apply_running_line(env, line):
            _apply_env_line(env, line)
    for line in step_lines:
        _apply_running_line(env, line)
    return env


def _apply_running_line(env: Environment, line: str) -> bool:
    if m := PYTHON_LINE.match(line):
        env.python = m.group(1)
    elif m := TORCH_LINE.match(line):
        env.torch, env.cuda = m.group(1), m.group(2)
        if m.group(3):
            env.device, env.world_size = m.group(3).strip(), int(m.group(4))
    elif m := TRITON_LINE.match(line):
        env.triton = m.group(1)
    elif m := DEVICE_NAME_LINE.match(line):
        env.device, env.world_size = m.group(1).strip(), int(m.group(2))
    else:
        return False
    return True


def _apply_env_line(env: Environment, line: str) -> None:
    if m := USING_LINE.match(line):
        env.settings[m.group(1)] = m.group(2)
    elif m := GPU_ROW.match(line):
        env.gpu_models.append(m.group(2).strip())
    elif m := DRIVER.search(line):
        env.driver = m.group(1)
    elif line.strip() == "nvidia-smi: not available":
        env.settings["nvidia-smi"] = "not available"
    elif m := KEY_VALUE.match(line):
        _apply_key_value(env, m.group(1), m.group(2).strip())


def _apply_key_value(env: Environment, key: str, value: str) -> None:
    if key == "device":
        env.device = value
    elif key == "world_size" and value.isdigit():
        env.world_size = int(value)
    elif key in ("hyperparameters", "overrides"):
        parsed = _literal_dict(value)
        if parsed is None:
            env.settings[key] = value
        elif key == "hyperparameters":
            env.hyperparameters = parsed
        else:
            env.overrides = parsed
    else:
        env.settings[key] = value


class _NonFiniteFloats(ast.NodeTransformer):
    """repr() writes float("inf") and float("nan") as the bare names inf and nan, which literal_eval rejects."""

    VALUES = {"inf": math.inf, "nan": math.nan}

    def visit_Name(self, node: ast.Name) -> ast.AST:
        if node.id in self.VALUES:
            return ast.copy_location(ast.Constant(self.VALUES[node.id]), node)
        return node


def _literal_dict(text: str) -> dict[str, Any] | None:
    try:
        value = ast.literal_eval(_NonFiniteFloats().visit(ast.parse(text.strip(), mode="eval")))
    except (ValueError, SyntaxError, MemoryError, RecursionError):
        return None
    return value if isinstance(value, dict) else None


# ----- step lines and trials -----


@dataclass
class TrialLines:
    val_points: list[ValPoint] = field(default_factory=list)
    train_points: list[TrainPoint] = field(default_factory=list)
    peak_memory: PeakMemory | None = None
    warmup_time_s: float | None = None
    notes: list[str] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)  # "line N: why", for lines lost to damage
    last_step: int = -1
    last_val_line: str | None = None

    @property
    def empty(self) -> bool:
        return not self.val_points and not self.train_points


def split_trials(lines: list[str], first_line_number: int = 1) -> list[TrialLines]:
    """Collect step lines; a new trial starts at a `trial:` marker or when the step counter goes back."""
    trials = [TrialLines()]
    for number, raw in enumerate(lines, start=first_line_number):
        line = raw.strip()
        trial = trials[-1]
        if TRIAL_MARKER.match(line):
            if not trial.empty:
                trials.append(TrialLines())
            continue
        point = _step_point(line)
        if point is None:
            if lost := _lost_val_line(line):
                trial.warnings.append(f"line {number}: {lost}")
            _apply_trailer(trial, line)
            continue
        if point.step < trial.last_step:
            trial = TrialLines()
            trials.append(trial)
        if isinstance(point, ValPoint):
            if line == trial.last_val_line:
                trial.notes.append(f"repeated val line collapsed: {line}")
                continue
            trial.val_points.append(point)
            trial.last_val_line = line
        else:
            trial.train_points.append(point)
        trial.last_step = point.step
    return [trial for trial in trials if not trial.empty] or [TrialLines()]


def _step_point(line: str) -> ValPoint | TrainPoint | None:
    if m := VAL_LINE.match(line):
        scale = 1e-3 if m.group("unit") == "ms" else 1.0
        extras = _columns(m.group("pre")) + _columns(m.group("post"))
        return ValPoint(
            step=int(m.group("step")),
            total_steps=int(m.group("total")),
            val_loss=float(m.group("loss")),
            train_time_s=float(m.group("time")) * scale,
            step_avg_ms=float(m.group("avg")),
            extras=extras,
            time_unit=m.group("unit"),
        )
    if m := TRAIN_LINE.match(line):
        scale = 1e-3 if m.group("unit") == "ms" else 1.0
        loss = m.group("loss")
        return TrainPoint(
            step=int(m.group("step")),
            total_steps=int(m.group("total")),
            train_time_s=float(m.group("time")) * scale,
            step_avg_ms=float(m.group("avg")),
            train_loss=float(loss) if loss is not None else None,
        )
    if m := LLMC_VAL_LINE.match(line):
        return ValPoint(int(m.group("step")), None, float(m.group("loss")), None, None)
    if m := LLMC_TRAIN_LINE.match(line):
        return TrainPoint(int(m.group("step")), None, None, None, float(m.group("loss")))
    return None


def _lost_val_line(line: str) -> str | None:
    """Why a line holding `step:N/T val_loss:` could not be read, or None if it holds none."""
    found = EMBEDDED_VAL_LINE.search(line)
    if found is None:
        return None
    if found.start() > 0:
        return f"val line behind {found.start()} characters of other data (binary garbage?); not used"
    return "val line cut short or malformed; not used"


def _columns(text: str | None) -> tuple[tuple[str, str], ...]:
    if not text:
        return ()
    return tuple(tuple(item.split(":", 1)) for item in text.split())  # type: ignore[misc]


def _apply_trailer(trial: TrialLines, line: str) -> None:
    if m := PEAK_MEMORY.match(line):
        trial.peak_memory = PeakMemory(int(m.group(1)), int(m.group(2)))
    elif m := PEAK_MEMORY_2024.match(line):
        trial.peak_memory = PeakMemory(int(m.group(1)), None)
    elif m := WARMUP_TIME.match(line):
        trial.warmup_time_s = float(m.group(1))
    # Anything else (debug prints, torchrun warnings, side evaluations) is noise: skipped.


# ----- era -----


def detect_era(layout: Layout, env: Environment, trials: list[TrialLines]) -> str:
    """A short label for the log family, shown in reports."""
    points = [p for t in trials for p in t.val_points]
    if points and points[0].total_steps is None:
        return "llm.c"
    seconds = any(p.time_unit == "s" for p in points)
    if not layout.code and layout.separator_count == 0:
        return "console-track3" if seconds else "console"
    if seconds:
        return "track3"
    if env.hyperparameters is not None:
        return "harness"  # our train_gpt.py (train_gpt_shampoo.py times in seconds: "track3" above)
    if layout.leading_separator:
        return "2024-10/11"
    if any(line.startswith(("Running pytorch", "Running python")) for line in layout.env_lines):
        return "2024-12"
    return "2025+"


def find_logs(paths: list[Path]) -> list[Path]:
    """Expand folders (recursively) into log files; keep explicit files as given."""
    found: list[Path] = []
    for path in paths:
        if path.is_dir():
            found.extend(sorted(p for p in path.rglob("*") if p.is_file() and p.suffix in LOG_SUFFIXES))
        elif path.exists():
            found.append(path)
        else:
            raise RecordsError(f"{path}: no such file or folder; check the path")
    if not found:
        raise RecordsError(f"{', '.join(map(str, paths))}: no log files (*.txt, *.log, *.stdout, *.out) found")
    return found
