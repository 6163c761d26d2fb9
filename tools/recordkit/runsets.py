"""Turn logs (or a record folder's results.json) into a checked set of runs for statistics.

Rules (records spec §6): truncated runs are reported and left out unless --allow-incomplete;
runs that differ in code hash, step count or GPU count are refused unless --allow-mixed; twin files
and console captures of a run that is also logged are counted once.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .errors import RecordsError
from .model import Run
from .parse import find_logs, parse_log

RESULTS_JSON = "results.json"


@dataclass
class RunFacts:
    """The per-run numbers the statistics need, from a parsed log or from published figures."""

    label: str
    source: str  # "log" or "published"
    final_step: int | None
    total_steps: int | None
    val_loss: float  # at the final val line
    train_time_s: float | None
    step_avg_ms: float | None
    val_losses: dict[int, float]  # step -> val loss (published folders may list only a few steps)
    complete: bool
    status: str
    code_hash: str | None = None
    hardware: str | None = None
    gpu_count: int | None = None
    era: str | None = None
    run: Run | None = None

    def loss_at(self, step: int | None) -> float | None:
        return self.val_loss if step is None else self.val_losses.get(step)


def metric_losses(run: Run, metric: str) -> dict[int, float]:
    """step -> loss from the val lines; `metric` picks an extra column such as `val_ema_loss` (Track 3)."""
    if metric == "val_loss":
        return {p.step: p.val_loss for p in run.val_points}
    losses = {}
    for point in run.val_points:
        value = dict(point.extras).get(metric)
        if value is not None:
            try:
                losses[point.step] = float(value)
            except ValueError:
                raise RecordsError(f"{run.label}: {metric}:{value} at step {point.step} is not a number; pick another --metric") from None
    if not losses:
        raise RecordsError(f"{run.label}: no val line has a {metric}: column; use --metric val_loss or a column the log has")
    return losses


def facts_from_run(run: Run, metric: str = "val_loss") -> RunFacts:
    final = run.final
    if final is None:
        raise RecordsError(f"{run.label}: truncated before its first val line; nothing to use")
    losses = metric_losses(run, metric)
    return RunFacts(
        label=run.label,
        source="log",
        final_step=final.step,
        total_steps=run.total_steps,
        val_loss=losses[max(losses)],
        train_time_s=final.train_time_s,
        step_avg_ms=final.step_avg_ms,
        val_losses=losses,
        complete=run.complete,
        status=run.status,
        code_hash=run.code_hash,
        hardware=run.env.hardware,
        gpu_count=run.env.gpu_count,
        era=run.era,
        run=run,
    )


def facts_from_published(entry: dict[str, Any], index: int, where: Path) -> RunFacts:
    try:
        val_losses = {int(step): float(loss) for step, loss in (entry.get("val_losses") or {}).items()}
        final_step = entry.get("final_step")
        if final_step is not None:
            val_losses.setdefault(int(final_step), float(entry["val_loss"]))
        return RunFacts(
            label=str(entry.get("label") or f"published run {index}"),
            source="published",
            final_step=final_step,
            total_steps=entry.get("total_steps"),
            val_loss=float(entry["val_loss"]),
            train_time_s=entry.get("train_time_s"),
            step_avg_ms=entry.get("step_avg_ms"),
            val_losses=val_losses,
            complete=True,
            status="published",
            code_hash=entry.get("code_hash"),
            hardware=entry.get("hardware"),
        )
    except (KeyError, TypeError, ValueError) as exc:
        raise RecordsError(f"{where}: run {index} is malformed ({exc}); fix results.json or recreate it with `new`") from None


@dataclass
class RunSet:
    runs: list[RunFacts]
    notes: list[str] = field(default_factory=list)  # one-line reports (excluded runs, duplicates)


def load_runset(paths: list[Path], allow_incomplete: bool = False, allow_mixed: bool = False, metric: str = "val_loss") -> RunSet:
    """Runs from log files/folders; a record folder without logs yields its published runs."""
    published = _published_only_folder(paths)
    if published is not None:
        return published
    runs = [run for log in find_logs(paths) for run in parse_log(log)]
    return select_runs(runs, allow_incomplete=allow_incomplete, allow_mixed=allow_mixed, metric=metric)


def _published_only_folder(paths: list[Path]) -> RunSet | None:
    if len(paths) != 1 or not (paths[0] / RESULTS_JSON).is_file():
        return None
    return published_runset(paths[0], read_results(paths[0] / RESULTS_JSON))


def published_runset(folder: Path, results: dict[str, Any]) -> RunSet | None:
    """The published runs of a record folder whose results.json lists no logs; None otherwise."""
    entries = results.get("runs") or []
    if not entries or any(entry.get("log") is not None for entry in entries):
        return None
    facts = [facts_from_published(entry, i, folder) for i, entry in enumerate(entries, start=1)]
    return RunSet(facts, ["published figures from results.json (the logs are not in this repository)"])


def read_results(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        raise RecordsError(f"{path}: missing; recreate the record folder with `records new`") from None
    except json.JSONDecodeError as exc:
        raise RecordsError(f"{path}: invalid JSON (line {exc.lineno}: {exc.msg}); fix or regenerate it") from None
    if not isinstance(data, dict):
        raise RecordsError(f"{path}: expected a JSON object; fix or regenerate it")
    return data


def select_runs(runs: list[Run], allow_incomplete: bool, allow_mixed: bool, metric: str = "val_loss") -> RunSet:
    notes: list[str] = []
    runs = _drop_duplicates(runs, notes)
    kept: list[Run] = []
    for run in runs:
        if run.final is None:
            notes.append(f"{run.label}: truncated before its first val line; excluded")
        elif not run.complete and not allow_incomplete:
            notes.append(f"{run.label}: {run.status}; excluded (pass --allow-incomplete to include it)")
        else:
            kept.append(run)
    if not kept:
        reasons = "; ".join(note.removesuffix(" (pass --allow-incomplete to include it)") for note in notes)
        raise RecordsError(f"no complete run left ({reasons}); pass --allow-incomplete to use truncated runs")
    facts = [facts_from_run(run, metric) for run in kept]
    _flag_same_trajectories(facts, notes)
    if not allow_mixed:
        _refuse_mixed(facts)
    return RunSet(facts, notes)


def _drop_duplicates(runs: list[Run], notes: list[str]) -> list[Run]:
    """Count a run once: twin files, or a console capture of a run whose log is also given."""
    kept: list[Run] = []
    seen: dict[tuple[Any, ...], Run] = {}
    for run in runs:
        key = tuple((p.step, p.val_loss, p.train_time_s) for p in run.val_points)
        twin = seen.get(key)
        if twin is None or not key:
            seen[key] = run
            kept.append(run)
            continue
        keep, drop = (run, twin) if twin.code_hash is None and run.code_hash is not None else (twin, run)
        notes.append(f"{drop.label}: same val lines (losses and times) as {keep.label}; counted once, as {keep.label}")
        if keep is run:  # prefer the copy that embeds the source
            kept[kept.index(twin)] = run
            seen[key] = run
    return kept


def _flag_same_trajectories(facts: list[RunFacts], notes: list[str]) -> None:
    by_losses: dict[tuple[tuple[int, float], ...], str] = {}
    for fact in facts:
        key = tuple(sorted(fact.val_losses.items()))
        if len(key) > 1 and key in by_losses:
            notes.append(f"{fact.label}: identical val-loss trajectory to {by_losses[key]} (same seed?); runs must be independent")
        by_losses.setdefault(key, fact.label)


def _config_keys(fact: RunFacts) -> dict[str, Any]:
    """What must agree between runs of one claim (None: unknown, e.g. a console capture has no source)."""
    return {
        "code hash": fact.code_hash[:12] if fact.code_hash else None,
        "total steps": fact.total_steps,
        "GPU count": fact.gpu_count,
    }


# Hyperparameters that differ between the runs of one configuration by design: train_gpt.py's run
# management, and train_gpt_shampoo.py's RUN_MANAGEMENT_FIELDS (a resumed run continues the same one).
PER_RUN_HYPERPARAMETERS = frozenset({"run_id", "seed", "log_dir", "save_checkpoint",
                                     "num_trials", "checkpoint_every", "checkpoint_dir", "resume"})


def _hyperparameter_conflicts(facts: list[RunFacts]) -> list[str]:
    """`name: a vs b` for every hyperparameter (from our logs' `hyperparameters:` line) that differs."""
    logged = [f.run.env.hyperparameters for f in facts if f.run is not None and f.run.env.hyperparameters is not None]
    if len(logged) < 2:
        return []
    keys = sorted(set().union(*logged) - PER_RUN_HYPERPARAMETERS)
    conflicts = []
    for key in keys:
        values = list(dict.fromkeys(repr(h.get(key, "<missing>")) for h in logged))
        if len(values) > 1:
            conflicts.append(f"{key}: {' vs '.join(values[:3])}")
    return conflicts


def _refuse_mixed(facts: list[RunFacts]) -> None:
    conflicts = _hyperparameter_conflicts(facts)
    if conflicts:
        raise RecordsError(f"mixed configurations (hyperparameters differ: {'; '.join(conflicts)}); split the logs or pass --allow-mixed")
    for what in ("code hash", "total steps", "GPU count"):
        groups: dict[Any, list[str]] = {}
        for fact in facts:
            groups.setdefault(_config_keys(fact)[what], []).append(fact.label)
        known = {k: v for k, v in groups.items() if k is not None}
        if len(known) > 1:
            detail = "; ".join(f"{k}: {', '.join(v[:3])}{' …' if len(v) > 3 else ''}" for k, v in known.items())
            raise RecordsError(f"mixed configurations ({what} differs: {detail}); split the logs or pass --allow-mixed")
