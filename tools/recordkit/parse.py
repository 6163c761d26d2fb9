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
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

from .errors import RecordsError
from .program import program_hash
from .runs import Environment, PeakMemory, Run, TrainPoint, ValPoint
from .textfiles import cannot_read, exists, is_folder
from .tracks import fixed_stop_steps, recognize_track

SEPARATOR = "=" * 100
LOG_SUFFIXES = (".txt", ".log", ".stdout", ".out")

_NUM = r"[0-9.]+(?:[eE][-+]?\d+)?"
# A diverged loss as Python formats it: nan, or inf once it overflows (our scripts then stop on the non-finite value).
_NUM_OR_NAN = rf"(?:nan|inf|{_NUM})"
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
# The line this repository's scripts write last when they stop on a problem they name (`print0(f"error: {error}")`).
STOP_ERROR_LINE = re.compile(r"^error: \S.*$")
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
LIBRARY_GPU_HEADER = re.compile(r"^GPU\s+Name\s+Temp\b")
LIBRARY_GPU_ROW = re.compile(r"^(\d+)\s+([A-Za-z][^|]*?)\s{2,}\d")
KEY_VALUE = re.compile(r"^([a-z][a-z0-9_]*): (.*)$")

# Banners between the files of an embedded source: the 2025+ Track 1 scripts append kernels behind
# `----(40)` / `# name.py` / `----(40)`; our train_gpt_shampoo.py appends its package behind one line.
DASH_BANNER = "-" * 40
DASH_BANNER_NAME = re.compile(r"^# (\S+\.py)\s*$")
SHAMPOO_BANNER = re.compile(r"^# ===== (\S+) =====\s*$")


class NoValLineError(RecordsError):
    """A file with no usable val line; `what` says what it holds instead, without the advice, for callers (check) whose
    file is a log damaged since its run rather than the wrong file passed."""

    def __init__(self, path: Path, what: str, advice: str) -> None:
        super().__init__(f"{path}: {what}; {advice}")
        self.what = what


def parse_log(path: Path) -> list[Run]:
    """Parse one log file into its runs; raise RecordsError if it holds no val line at all."""
    data = read_log_bytes(path)
    text = data.decode("utf-8", errors="replace")
    return parse_text(text, path=path, file_sha256=hashlib.sha256(data).hexdigest())


def log_lines(text: str) -> list[str]:
    """The file's lines, split at newlines only: a form feed or a stray carriage return inside a line (binary
    garbage, a console's progress bar) stays in its line, so line numbers and embedded files are exact."""
    lines = text.split("\n")
    return lines[:-1] if lines and lines[-1] == "" else lines


def parse_text(text: str, path: Path, file_sha256: str = "") -> list[Run]:
    layout = split_layout(log_lines(text))
    sources = split_sources(layout.code_text)
    code_hash = hash_sources(sources) if sources else None
    env = parse_environment(layout.env_lines, layout.step_lines)
    trials = split_trials(layout.step_lines, first_line_number=layout.step_start + 1)
    if not any(trial.val_points for trial in trials):
        raise NoValLineError(path, *_why_no_val_line(layout, trials))
    era = detect_era(layout, env, trials)
    program = program_hash(sources) if sources else None
    seconds = any(p.time_unit == "s" for trial in trials for p in trial.val_points)
    track, track_reason = recognize_track(sources, env, seconds)
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
            track=track,
            track_reason=track_reason,
            inconsistencies=trial.inconsistencies,
            lost_val_lines=trial.warnings,
            fixed_stop=_fixed_stop(trial, sources, env, seconds),
            stopped_by=trial.last_line if STOP_ERROR_LINE.match(trial.last_line) else None,
        )
        for index, trial in enumerate(trials, start=1)
    ]


def _fixed_stop(trial: TrialLines, sources: dict[str, str], env: Environment, seconds: bool) -> tuple[int, str] | None:
    """(step, where it is fixed) when a Track 3 run ends before its total at a step its script fixed in advance."""
    if not seconds or not trial.val_points:
        return None
    final = trial.val_points[-1]
    if final.total_steps is None or final.step >= final.total_steps:
        return None
    where = fixed_stop_steps(sources, env).get(final.step)
    return (final.step, where) if where is not None else None


def _why_no_val_line(layout: Layout, trials: list[TrialLines]) -> tuple[str, str]:
    """(what the file holds instead, what to do)."""
    lost = [warning for trial in trials for warning in trial.warnings]
    if lost:
        return f"no readable val line ({lost[0]})", "not a usable log"
    if layout.code and not any(trial.train_points for trial in trials):
        return "source and environment only, no step line (the run stopped before training)", "not a usable log"
    if any(trial.train_points for trial in trials):
        return "step lines but no val line (the run stopped before its first validation)", "not a usable log"
    return "no val line ('step:N/T val_loss:X train_time:...' or 's:N tel:X')", "pass a training log"


def read_log_bytes(path: Path) -> bytes:
    try:
        return path.read_bytes()
    except FileNotFoundError:
        raise RecordsError(f"{path}: no such file; check the path") from None
    except IsADirectoryError:
        raise RecordsError(f"{path}: is a directory; pass log files (or use a command that accepts folders)") from None
    except OSError as exc:
        raise cannot_read(path, exc) from None


# ----- layout: code / environment / steps -----


@dataclass
class Layout:
    code: list[str]
    env_lines: list[str]
    step_lines: list[str]
    separator_count: int
    leading_separator: bool
    step_start: int = 0  # index of the first step line in the file's lines
    code_start: int = 0  # index of the first code line in the file's lines

    @property
    def code_text(self) -> str:
        """The embedded source as written, up to the separator (each of its lines ended by a newline)."""
        return "".join(line + "\n" for line in self.code)


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
    return Layout(lines[code_start:first], env_lines, lines[last + 1 :], len(separators), leading, last + 1, code_start)


# ----- embedded sources -----


@dataclass
class _Part:
    name: str
    start: int  # index, among the code's lines, of the part's first line
    lines: list[str] = field(default_factory=list)
    after_dash_banner: bool = False  # the logger wrote a blank line after the banner
    before_dash_banner: bool = False  # ... and two newlines before it


def split_sources(code_text: str) -> dict[str, str]:
    """The files embedded before the separator, byte for byte as their writers read them; the script comes first.

    Two writers exist. The Track 1/2 record scripts print their code (print adds one newline) and append each
    kernel file as `code + "\\n\\n" + banner + "\\n\\n" + file`, the banner being 40 dashes, `# name.py`, 40 dashes;
    this repository's train_gpt_shampoo.py writes its text and each module behind a `# ===== path =====` line
    with nothing added. Undoing exactly what the writer added gives back each file as it was.
    """
    if not code_text.strip():
        return {}
    lines = code_text.split("\n")[:-1]  # code_text ends with a newline
    parts = _split_parts(lines)
    printed = not any(SHAMPOO_BANNER.match(line) for line in lines)  # print() added a newline after the last file
    files = {}
    for number, part in enumerate(parts):
        text = "".join(line + "\n" for line in part.lines)
        if part.after_dash_banner:
            text = text.removeprefix("\n")
        if part.before_dash_banner:
            text = text[:-2] if text.endswith("\n\n") else text.removesuffix("\n")
        elif printed and number == len(parts) - 1:
            text = text.removesuffix("\n")
        files[part.name] = text
    return files


def source_first_lines(code_text: str) -> dict[str, int]:
    """Each file of split_sources: the index, among the code's lines, of its first line (so that a line of the file
    can be named by its line in the log)."""
    if not code_text.strip():
        return {}
    parts = _split_parts(code_text.split("\n")[:-1])
    # split_sources drops the blank line the logger wrote after a dash banner.
    return {part.name: part.start + (1 if part.after_dash_banner and part.lines[:1] == [""] else 0) for part in parts}


def _split_parts(lines: list[str]) -> list[_Part]:
    parts = [_Part("__script__", 0)]
    index = 0
    while index < len(lines):
        line = lines[index]
        if shampoo := SHAMPOO_BANNER.match(line):
            parts.append(_Part(shampoo.group(1), index + 1))
            index += 1
            continue
        if (line.rstrip() == DASH_BANNER and index + 2 < len(lines) and DASH_BANNER_NAME.match(lines[index + 1])
                and lines[index + 2].rstrip() == DASH_BANNER):
            parts[-1].before_dash_banner = True
            name = DASH_BANNER_NAME.match(lines[index + 1]).group(1)  # type: ignore[union-attr]
            parts.append(_Part(name, index + 3, after_dash_banner=True))
            index += 3
            continue
        parts[-1].lines.append(line)
        index += 1
    return parts


def hash_sources(sources: dict[str, str]) -> str:
    digest = hashlib.sha256()
    for name, text in sources.items():
        digest.update(name.encode() + b"\0" + text.encode() + b"\0")
    return digest.hexdigest()


# ----- environment -----


def parse_environment(env_lines: Sequence[str], step_lines: Sequence[str] = ()) -> Environment:
    """Environment blocks in full; among step lines, the `Running ...` lines (console captures) and any GPU table
    printed before the first step line."""
    env = Environment()
    library_table = False
    for line in env_lines:
        if not _apply_running_line(env, line):
            library_table = _apply_env_line(env, line, library_table)
    for line in step_lines:
        _apply_running_line(env, line)
    for line in step_lines:
        if _step_point(line.strip()) is not None:
            break
        library_table = _apply_gpu_table_line(env, line, library_table)
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


def _apply_env_line(env: Environment, line: str, library_table: bool) -> bool:
    """Read one environment line; returns whether a library GPU table (`GPU Name  Temp ...`) is being read."""
    if m := USING_LINE.match(line):
        env.settings[m.group(1)] = m.group(2)
    elif _is_gpu_table_line(line, library_table):
        return _apply_gpu_table_line(env, line, library_table)
    elif m := DRIVER.search(line):
        env.driver = m.group(1)
    elif line.strip() == "nvidia-smi: not available":
        env.settings["nvidia-smi"] = "not available"
    elif m := KEY_VALUE.match(line):
        _apply_key_value(env, m.group(1), m.group(2).strip())
    return False


def _is_gpu_table_line(line: str, library_table: bool) -> bool:
    return bool(GPU_ROW.match(line) or LIBRARY_GPU_HEADER.match(line) or (library_table and LIBRARY_GPU_ROW.match(line)))


def _apply_gpu_table_line(env: Environment, line: str, library_table: bool) -> bool:
    """One GPU row of an nvidia-smi table, or of the table some scripts print without nvidia-smi
    (`GPU Name  Temp  Power ...` then `0   NVIDIA H100 80GB HBM3   35 ...`)."""
    if m := GPU_ROW.match(line):
        env.gpu_models.append(m.group(2).strip())
    elif LIBRARY_GPU_HEADER.match(line):
        return True
    elif library_table and (m := LIBRARY_GPU_ROW.match(line)):
        env.gpu_models.append(m.group(2).strip())
        return True
    return False


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
    warnings: list[str] = field(default_factory=list)  # "line N: why", for val lines lost to damage
    inconsistencies: list[str] = field(default_factory=list)  # "line N: why", for lines a run cannot have written
    first_step: int = -1
    last_step: int = -1
    val_lines: dict[int, tuple[int, str]] = field(default_factory=dict)  # step -> (line number, text)
    last_train: tuple[int, TrainPoint] | None = None  # (line number, point)
    last_line: str = ""  # the trial's last line that is not blank

    @property
    def empty(self) -> bool:
        return not self.val_points and not self.train_points


TIME_RESOLUTION_S = 1e-3  # logged times are whole milliseconds (Tracks 1, 2, ours) or seconds to 3 decimals (published Track 3)
# A new trial starts where the step counter returns to the start: step 0 (a val line), 1 (a train line), or the
# first step of the trial before it (console captures that print no step-0 line).
TRIAL_START_STEP = 1


def split_trials(lines: list[str], first_line_number: int = 1) -> list[TrialLines]:
    """Collect step lines; a new trial starts at a `trial:` marker or when the step counter returns to the start
    (TRIAL_START_STEP).

    A run writes its val lines once per step, in step order, up to its total, and its final line agrees with the lines
    before it; lines that break this (two val lines for one step, a step going back, a step beyond the total, a final
    line out of step with the others) are kept as inconsistencies, and the run is reported and left out of statistics.
    """
    trials = [TrialLines()]
    for number, raw in enumerate(lines, start=first_line_number):
        line = raw.strip()
        trial = trials[-1]
        if line:
            trial.last_line = line
        if TRIAL_MARKER.match(line):
            if not trial.empty:
                _check_final_line(trial)
                trials.append(TrialLines())
            continue
        point = _step_point(line)
        if point is None:
            if lost := _lost_val_line(line):
                trial.warnings.append(f"line {number}: {lost}")
            _apply_trailer(trial, line)
            continue
        if point.step < trial.last_step and point.step <= max(TRIAL_START_STEP, trial.first_step):
            _check_final_line(trial)
            trial = TrialLines()
            trials.append(trial)
        if isinstance(point, ValPoint) and trial.val_lines.get(point.step, (0, None))[1] == line:
            trial.notes.append(f"repeated val line collapsed: {line}")  # e.g. a summary that repeats the last lines
            continue
        if point.step < trial.last_step:
            trial.inconsistencies.append(f"line {number}: step {point.step} after step {trial.last_step} (steps out of order)")
        if point.total_steps is not None and point.step > point.total_steps:  # no run steps past its total: not complete
            trial.inconsistencies.append(f"line {number}: step {point.step} beyond the total of {point.total_steps} steps")
        if isinstance(point, ValPoint):
            _add_val_point(trial, point, line, number)
        else:
            trial.train_points.append(point)
            trial.last_train = (number, point)
        trial.first_step = point.step if trial.first_step < 0 else trial.first_step
        trial.last_step = max(trial.last_step, point.step)
    _check_final_line(trials[-1])
    return [trial for trial in trials if not trial.empty] or [TrialLines()]


def _add_val_point(trial: TrialLines, point: ValPoint, line: str, number: int) -> None:
    earlier = trial.val_lines.get(point.step)
    if earlier is not None:
        trial.inconsistencies.append(f"line {number}: a second val line for step {point.step} (first at line {earlier[0]}) "
                                     "with other values")
    trial.val_points.append(point)
    trial.val_lines[point.step] = (number, line)


def _check_final_line(trial: TrialLines) -> None:
    """The final val line must agree with the lines before it: same total step count, a clock that did not go
    back, and the step_avg formula that every earlier val line follows."""
    if len(trial.val_points) < 2:
        return
    final, earlier = trial.val_points[-1], trial.val_points[:-1]
    number = trial.val_lines[final.step][0]
    where = f"line {number}: final val line (step {final.step})"
    totals = {p.total_steps for p in earlier if p.total_steps is not None}
    if final.total_steps is not None and totals and final.total_steps not in totals:
        trial.inconsistencies.append(f"{where} says {final.total_steps} steps, the lines before it {max(totals)}")
    times = [p.train_time_s for p in earlier if p.train_time_s is not None]
    if final.train_time_s is not None and times and final.train_time_s < max(times):
        trial.inconsistencies.append(f"{where} has train_time {final.train_time_s:g} s, below the {max(times):g} s of an earlier line")
    if trial.last_train is not None and final.train_time_s is not None:
        train_number, train = trial.last_train
        if train_number < number and train.step == final.step and train.train_time_s is not None \
                and final.train_time_s < train.train_time_s - TIME_RESOLUTION_S:
            trial.inconsistencies.append(f"{where} has train_time {final.train_time_s:g} s, below the {train.train_time_s:g} s "
                                         f"of the train line for the same step")
    formula = _step_avg_formula(trial.val_points[:-1])
    if formula is not None and not _fits(formula, trial.val_points, len(trial.val_points) - 1):
        trial.inconsistencies.append(f"{where} has step_avg {final.step_avg_ms}ms, which does not follow from its train_time "
                                     f"as on every earlier val line")


# step_avg on val lines: cumulative time / step (Tracks 1/2 since 2025), the same after the 10-step warm-up
# of 2024 logs, or the average over the interval since the previous val line (Track 3).
_STEP_AVG_FORMULAS = ("cumulative", "cumulative_after_10", "interval")


def _expected_step_avg(formula: str, points: list[ValPoint], index: int) -> float | None:
    point = points[index]
    if point.train_time_s is None:
        return None
    if formula == "cumulative":
        return point.train_time_s * 1000 / max(point.step, 1)
    if formula == "cumulative_after_10":
        return point.train_time_s * 1000 / (point.step - 10) if point.step > 10 else None
    previous = points[index - 1] if index > 0 else None
    if previous is None or previous.train_time_s is None or point.step <= previous.step:
        return None
    return (point.train_time_s - previous.train_time_s) * 1000 / (point.step - previous.step)


def _fits(formula: str, points: list[ValPoint], index: int) -> bool:
    logged = points[index].step_avg_ms
    expected = _expected_step_avg(formula, points, index)
    if logged is None or expected is None or not math.isfinite(logged):
        return True  # nothing to compare
    # Logs round times (ms, or s to 3 decimals) and step_avg (2 decimals): allow both roundings.
    step = max(points[index].step - (10 if formula == "cumulative_after_10" else 0), 1)
    span = step if formula != "interval" else max(points[index].step - points[index - 1].step, 1)
    return abs(logged - expected) <= 0.006 + 1.0 / span


def _step_avg_formula(points: list[ValPoint]) -> str | None:
    """The formula that every val line with a checkable step_avg follows (None when none, or too few lines, do)."""
    checkable = [i for i in range(len(points)) if points[i].step_avg_ms is not None and math.isfinite(points[i].step_avg_ms)
                 and points[i].step > 0]
    if len(checkable) < 2:
        return None
    for formula in _STEP_AVG_FORMULAS:
        compared = [i for i in checkable if _expected_step_avg(formula, points, i) is not None]
        if len(compared) >= 2 and all(_fits(formula, points, i) for i in compared):
            return formula
    return None


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
        return "harness"  # this repository's train_gpt.py or train_gpt_shampoo.py (both time in ms)
    if layout.leading_separator:
        return "2024-10/11"
    if any(line.startswith(("Running pytorch", "Running python")) for line in layout.env_lines):
        return "2024-12"
    return "2025+"


def find_logs(paths: list[Path], unreadable: list[str] | None = None) -> list[Path]:
    """Expand folders (recursively) into log files; keep explicit files as given.

    A folder that cannot be listed (no permission) is not skipped silently: its line goes to `unreadable` when the
    caller collects them, and is an error otherwise.
    """
    found: list[Path] = []
    problems: list[str] = []
    for path in paths:
        if is_folder(path):
            found.extend(_logs_under(path, problems))
        elif exists(path):
            found.append(path)
        else:
            raise RecordsError(f"{path}: no such file or folder; check the path")
    if problems and unreadable is None:
        more = f" (+{len(problems) - 1} more)" if len(problems) > 1 else ""
        raise RecordsError(f"{problems[0]}{more}", detail=problems)
    if unreadable is not None:
        unreadable.extend(problems)
    if not found:
        first = f" ({problems[0]})" if problems else ""
        raise RecordsError(f"{', '.join(map(str, paths))}: no log files (*.txt, *.log, *.stdout, *.out) found{first}")
    return found


def _logs_under(folder: Path, problems: list[str]) -> list[Path]:
    def report(error: OSError) -> None:
        problems.append(f"{error.filename}: cannot be read ({error.strerror}); its logs were not searched: "
                        "fix its permissions (chmod u+rx) or leave it out")

    files = []
    for directory, subdirectories, names in os.walk(folder, onerror=report):
        subdirectories.sort()
        files += [Path(directory) / name for name in names if Path(name).suffix in LOG_SUFFIXES]
    return sorted(path for path in files if path.is_file())
