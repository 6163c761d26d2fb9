"""A parsed training run (one trial of a log) and its parts: val and train points, environment, memory."""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any


@dataclass(frozen=True)
class ValPoint:
    """One validation line: `step:S/T val_loss:V ... train_time:X step_avg:Yms`."""

    step: int
    total_steps: int | None
    val_loss: float
    train_time_s: float | None
    step_avg_ms: float | None
    extras: tuple[tuple[str, str], ...] = ()  # extra key:value columns (Track 3 variants)
    time_unit: str | None = None  # "ms" (Tracks 1/2) or "s" (Track 3) as written in the log


@dataclass(frozen=True)
class TrainPoint:
    """One training line (train_loss only in 2024 and llm.c logs)."""

    step: int
    total_steps: int | None
    train_time_s: float | None
    step_avg_ms: float | None
    train_loss: float | None = None


@dataclass(frozen=True)
class PeakMemory:
    allocated_mib: int
    reserved_mib: int | None  # None for the 2024 "peak memory consumption" line


# The validation set every record is judged on: the first 10,485,760 tokens of FineWeb's validation shards.
FINEWEB_VAL_PREFIX = "fineweb_val_"
RECORD_VAL_TOKENS = 10_485_760


@dataclass
class Environment:
    """What the log says about the machine and the software (every field optional)."""

    python: str | None = None
    torch: str | None = None
    cuda: str | None = None
    triton: str | None = None
    driver: str | None = None
    gpu_models: list[str] = field(default_factory=list)  # one entry per nvidia-smi GPU row
    world_size: int | None = None
    device: str | None = None  # the `device:` line our scripts write, or a Track 3 GPU name
    hyperparameters: dict[str, Any] | None = None  # our scripts' `hyperparameters: {...}` line
    overrides: dict[str, Any] | None = None
    settings: dict[str, str] = field(default_factory=dict)  # other `key: value` / `Using k=v` lines

    @property
    def on_cpu(self) -> bool:
        """Our scripts log `device: cpu` when no GPU was used."""
        return (self.device or "").strip().lower() == "cpu"

    @property
    def validation_set_problem(self) -> str | None:
        """Why the run's val loss is not on the records' validation set, from the `val_files` and `val_tokens` settings
        this repository's scripts log (a proxy dataset, the smoke preset's shards, fewer tokens); None when the log names
        FineWeb's set, or names no validation setting at all (published logs: their scripts read FineWeb's)."""
        settings = self.hyperparameters or {}
        files, tokens = settings.get("val_files"), settings.get("val_tokens")
        if files is None and tokens is None:
            return None
        name = str(files).replace("\\", "/").rsplit("/", 1)[-1] if files is not None else FINEWEB_VAL_PREFIX
        if name.startswith(FINEWEB_VAL_PREFIX) and (tokens is None or tokens == RECORD_VAL_TOKENS):
            return None
        return f"the validation set is not FineWeb's (val_files {files!r}, val_tokens {tokens!r})"

    @property
    def gpu_count(self) -> int | None:
        """GPUs the run used: world_size when logged, else the nvidia-smi rows."""
        if self.world_size is not None:
            return self.world_size
        return len(self.gpu_models) or None

    @property
    def hardware(self) -> str | None:
        """A short description such as `8× NVIDIA H100 80GB HBM3`, or None if the log is silent."""
        model = _most_common(self.gpu_models)
        count = self.gpu_count
        if model is None and self.device and self.device.lower() != "cpu":
            model, logged_count = _split_device(self.device)
            count = count or logged_count
        if model is not None:
            return f"{count}× {model}" if count else model
        return self.device


def _split_device(device: str) -> tuple[str, int | None]:
    """`8x NVIDIA H200` or `NVIDIA H200 x 8` (our scripts' `device:` lines) -> model and count."""
    if m := re.fullmatch(r"(\d+)\s*[x×]\s*(.+)", device):
        return m.group(2), int(m.group(1))
    if m := re.fullmatch(r"(.+?)\s+[x×]\s*(\d+)", device):
        return m.group(1), int(m.group(2))
    return device, None


def _most_common(items: list[str]) -> str | None:
    return max(set(items), key=items.count) if items else None


@dataclass
class Run:
    """One training run (one trial of a multi-trial log)."""

    path: Path
    file_sha256: str
    trial: int  # 1-based
    trial_count: int
    era: str
    sources: dict[str, str]  # file name -> text; the script itself is first
    code_hash: str | None  # the embedded text byte for byte
    program_hash: str | None  # the same program with comments, docstrings and layout left out
    env: Environment
    val_points: list[ValPoint]
    train_points: list[TrainPoint]
    peak_memory: PeakMemory | None
    warmup_time_s: float | None
    notes: list[str] = field(default_factory=list)  # repeated lines collapsed, etc.
    warnings: list[str] = field(default_factory=list)  # "<path>: line N: why" for val lines that could not be read
    track: int | None = None  # told from the log itself (tracks.recognize_track); None when it does not say
    track_reason: str = ""
    inconsistencies: list[str] = field(default_factory=list)  # "line N: why": lines the run cannot have written
    lost_val_lines: list[str] = field(default_factory=list)  # "line N: why", without the path
    fixed_stop: tuple[int, str] | None = None  # (step, where): a stop the script fixed in advance (Track 3)
    stopped_by: str | None = None  # the `error: ...` line a script wrote last when it stopped on a named problem

    @property
    def label(self) -> str:
        return self.path.name if self.trial_count == 1 else f"{self.path.name}#trial{self.trial}"

    @property
    def timed_in_seconds(self) -> bool:
        """The published Track 3 scripts log train_time in seconds; Tracks 1 and 2, this repository's scripts and
        llm.c (untimed) do not."""
        return any(point.time_unit == "s" for point in self.val_points)

    @property
    def diverged_at(self) -> int | None:
        """The first step whose val or train loss is not finite (NaN or inf), or None."""
        steps = [p.step for p in self.val_points if not math.isfinite(p.val_loss)]
        steps += [p.step for p in self.train_points if p.train_loss is not None and not math.isfinite(p.train_loss)]
        return min(steps) if steps else None

    @property
    def usable_val_points(self) -> list[ValPoint]:
        """Val points before a divergence: the part of the run that statistics may use."""
        diverged = self.diverged_at
        return [p for p in self.val_points if diverged is None or p.step < diverged]

    @property
    def final(self) -> ValPoint | None:
        return self.val_points[-1] if self.val_points else None

    @property
    def total_steps(self) -> int | None:
        for point in reversed(self.val_points):
            if point.total_steps is not None:
                return point.total_steps
        for train in reversed(self.train_points):
            if train.total_steps is not None:
                return train.total_steps
        return None

    @property
    def complete(self) -> bool:
        """True when the last val line is at the last step, or at a stop its script fixed in advance, and the log is
        consistent with every loss finite (llm.c logs carry no total: trusted)."""
        final = self.final
        if final is None or self.diverged_at is not None or self.inconsistencies:
            return False
        total = self.total_steps
        return total is None or final.step >= total or self.fixed_stop is not None

    @property
    def status(self) -> str:
        final = self.final
        diverged = self.diverged_at
        if self.inconsistencies:
            more = f" (+{len(self.inconsistencies) - 1} more)" if len(self.inconsistencies) > 1 else ""
            return f"inconsistent: {self.inconsistencies[0]}{more}"
        if diverged is not None:
            return f"diverged at step {diverged}"
        if final is None:
            return "truncated: no val line"
        if not self.complete:
            if self.lost_val_lines:
                return f"damaged: last val {final.step}/{self.total_steps}, {self.lost_val_lines[-1]}"
            if self.stopped_by is not None:
                return f"stopped: {self.stopped_by} (last val {final.step}/{self.total_steps})"
            return f"truncated: last val {final.step}/{self.total_steps}"
        if self.fixed_stop is not None:
            return f"complete: stops at step {self.fixed_stop[0]} of {self.total_steps}, fixed by {self.fixed_stop[1]}"
        return "complete"

    def val_at(self, step: int) -> ValPoint | None:
        for point in self.val_points:
            if point.step == step:
                return point
        return None
