"""Turn parsed logs into sets of runs of one configuration, ready for statistics.

A claim is a statistic over independent runs of one program, so runs are grouped by configuration: the
track (told from the log, tracks.recognize_track), the program (embedded source with comments, docstrings,
layout and per-run literals left out), the GPU count, the step count and the logged hyperparameters (minus
the settings in RESULT_NEUTRAL_SETTINGS and PER_RUN_SETTINGS). A run counts once: twin files, a console
capture of a logged run, or a file repeating part of another run (a final_val_loss.txt) are not runs of
their own, and console captures without code join the one configuration with code that they match.
Within a configuration, truncated, damaged and diverged runs are reported and left out unless allowed,
inconsistent logs are always left out, and identical trajectories are flagged.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .errors import RecordsError
from .parse import find_logs, parse_log
from .runs import Run

# Settings that change how a run is executed or where it writes, never what it computes: the root
# computation's CUDA streams and their memory bound (same eigendecompositions, run concurrently), log and
# checkpoint locations, checkpointing and resumption (a resumed run continues the same trajectory), trials per launch.
RESULT_NEUTRAL_SETTINGS = frozenset({"shampoo_root_streams", "shampoo_root_memory_fraction", "log_dir", "save_checkpoint",
                                     "checkpoint_every", "checkpoint_dir", "resume", "num_trials"})
# Settings that differ between the runs of one configuration by design: every run has its own id and seed.
PER_RUN_SETTINGS = frozenset({"run_id", "seed"})


@dataclass
class RunFacts:
    """The per-run numbers the statistics need, from a parsed log or from published figures."""

    label: str
    source: str  # "log" or "published"
    final_step: int | None
    total_steps: int | None
    val_loss: float  # at the final usable val line
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
    validation_problem: str | None = None  # why its loss is not on the records' validation set (runs.Environment)

    def loss_at(self, step: int | None) -> float | None:
        return self.val_loss if step is None else self.val_losses.get(step)


@dataclass
class RunSet:
    """The runs of one configuration (or of several pooled by --allow-mixed) and one-line notes about them."""

    runs: list[RunFacts]
    notes: list[str] = field(default_factory=list)  # excluded runs, duplicates, pooled configurations
    track: int | None = None  # a record folder's track; for logs, what tracks.recognize_track tells
    description: str = ""  # what the runs share: track, code, GPUs, steps (see describe_configurations)
    key: tuple[Any, ...] | None = None  # configuration_key of its runs; None for pooled or published runs
    distinct: list[str] = field(default_factory=list)  # `name=value` of the hyperparameters that set it apart


@dataclass
class LoadedLogs:
    """Logs read from files and folders, grouped by configuration."""

    groups: list[RunSet]
    notes: list[str] = field(default_factory=list)  # skipped files and damaged lines, not tied to a group


def metric_losses(run: Run, metric: str) -> dict[int, float]:
    """step -> loss over the usable val lines; `metric` picks an extra column such as `val_ema_loss` (Track 3)."""
    if metric == "val_loss":
        return {p.step: p.val_loss for p in run.usable_val_points}
    if not any(metric in dict(p.extras) for p in run.val_points):
        raise RecordsError(f"{run.label}: no val line has a {metric}: column; use --metric val_loss or a column the log has")
    losses = {}
    for point in run.usable_val_points:
        value = dict(point.extras).get(metric)
        if value is None:
            continue
        try:
            losses[point.step] = float(value)
        except ValueError:
            raise RecordsError(f"{run.label}: {metric}:{value} at step {point.step} is not a number; pick another --metric") from None
        if not math.isfinite(losses[point.step]):
            raise RecordsError(f"{run.label}: {metric} is {value} at step {point.step} (diverged in that column); use --metric val_loss")
    return losses


def facts_from_run(run: Run, metric: str = "val_loss") -> RunFacts:
    """The run's numbers at its last usable val line (before a divergence, if any)."""
    losses = metric_losses(run, metric)
    if not losses:
        raise RecordsError(f"{run.label}: {run.status} before any usable val line; nothing to use")
    final_step = max(losses)
    point = run.val_at(final_step)
    return RunFacts(
        label=run.label,
        source="log",
        final_step=final_step,
        total_steps=run.total_steps,
        val_loss=losses[final_step],
        train_time_s=point.train_time_s if point else None,
        step_avg_ms=point.step_avg_ms if point else None,
        val_losses=losses,
        complete=run.complete,
        status=run.status,
        code_hash=run.code_hash,
        hardware=run.env.hardware,
        gpu_count=run.env.gpu_count,
        era=run.era,
        run=run,
        validation_problem=run.env.validation_set_problem,
    )


# ----- the validation set: losses on different sets are not compared -----

UNLOGGED_OR_FINEWEB = "FineWeb's (or not logged)"


def validation_problems(runs: list[RunFacts]) -> list[str]:
    """Each distinct reason, in order, why some of these runs' losses are not on the records' validation set."""
    return list(dict.fromkeys(fact.validation_problem for fact in runs if fact.validation_problem))


def validation_set(runset: RunSet) -> str:
    """The validation set of a run set's losses: FineWeb's (or not logged, as in published logs), or why not."""
    return "; ".join(validation_problems(runset.runs)) or UNLOGGED_OR_FINEWEB


def losses_not_comparable(first: tuple[str, RunSet], second: tuple[str, RunSet]) -> str | None:
    """Why the losses of two named run sets cannot be compared with each other (they are on different validation
    sets), or None. `diff` and `compare` ask this before any verdict that sets one side's losses against the other's."""
    (first_name, first_set), (second_name, second_set) = first, second
    a, b = validation_set(first_set), validation_set(second_set)
    if a == b:
        return None
    return f"the losses are not comparable: {first_name}: {a}; {second_name}: {b}"


# ----- loading and grouping -----


def parse_logs(paths: list[Path]) -> tuple[list[Run], list[str]]:
    """Every run in the logs under `paths`; logs that cannot be used are skipped with a note (all of them: an error)."""
    runs: list[Run] = []
    skipped: list[str] = []
    unreadable: list[str] = []
    files = find_logs(paths, unreadable)
    for log in files:
        try:
            runs += parse_log(log)
        except RecordsError as exc:
            skipped.append(str(exc))
    if not runs:
        if len(skipped) == 1:
            raise RecordsError(skipped[0])
        raise RecordsError(f"none of the {len(files)} log files is usable (first: {skipped[0]})", detail=skipped)
    notes = [f"warning: {problem}" for problem in unreadable] + [f"skipped {reason}" for reason in skipped]
    notes += [f"warning: {warning}" for run in runs for warning in run.warnings]
    return runs, notes


def load_logs(paths: list[Path], allow_incomplete: bool = False, metric: str = "val_loss") -> LoadedLogs:
    """Runs from log files/folders, one RunSet per configuration."""
    runs, notes = parse_logs(paths)
    return group_runs(runs, allow_incomplete=allow_incomplete, metric=metric, notes=notes)


def load_runset(paths: list[Path], allow_incomplete: bool = False, allow_mixed: bool = False, metric: str = "val_loss") -> RunSet:
    """The runs of one configuration (what `new` and `diff` need); several configurations are refused unless pooled."""
    return single_configuration(load_logs(paths, allow_incomplete, metric), allow_mixed)


def single_configuration(loaded: LoadedLogs, allow_mixed: bool) -> RunSet:
    groups = loaded.groups
    if len(groups) > 1 and not allow_mixed:
        raise RecordsError(f"{len(groups)} configurations in these logs (they differ in {', '.join(differing_parts(groups))}); "
                           "pass the logs of one, or --allow-mixed to pool them", detail=[g.description for g in groups])
    runset = pool(groups) if len(groups) > 1 else groups[0]
    if not runset.runs:
        raise no_run_left(runset.notes + loaded.notes)
    runset.notes[:0] = loaded.notes
    return runset


def refuse_shared_logs(runs: RunSet, other: RunSet, where: str, fix: str) -> None:
    """A log on both sides of a comparison would be compared with itself (+0.000 s, a speed ratio of 1.0000x, a verdict on
    half-copied runs): refused, naming the first such log of `runs`, `where` the same bytes are (both sides), and `fix`."""
    mine = _log_hashes(runs)
    shared = mine.keys() & _log_hashes(other).keys()
    if shared:
        more = f" (and {len(shared) - 1} more)" if len(shared) > 1 else ""
        raise RecordsError(f"{mine[min(shared)]}{more}: the same log (same bytes) is {where}; {fix}")


def _log_hashes(runset: RunSet) -> dict[str, Path]:
    return {fact.run.file_sha256: fact.run.path for fact in runset.runs if fact.run is not None and fact.run.file_sha256}


def no_run_left(notes: list[str]) -> RecordsError:
    """The error when every run was left out: the first reason, and the flag that would change it, if one would."""
    reasons = [note.removesuffix(EXCLUDED_HINT) for note in notes]
    excluded = [note for note in notes if note.endswith(EXCLUDED_HINT)]  # truncated, damaged, diverged: a flag includes them
    first = (excluded or reasons or ["no run"])[0].removesuffix(EXCLUDED_HINT)
    more = f" (+{len(reasons) - 1} more)" if len(reasons) > 1 else ""
    hint = ("pass --allow-incomplete to use truncated, damaged or diverged runs" if excluded else
            "no flag includes an inconsistent log" if any(INCONSISTENT_NOTE in note for note in notes) else "check the logs")
    return RecordsError(f"no complete run left ({first}{more}); {hint}", detail=reasons)


def group_runs(runs: list[Run], allow_incomplete: bool = False, metric: str = "val_loss", notes: list[str] | None = None) -> LoadedLogs:
    runs = _drop_duplicates(runs, notes := list(notes or []))
    by_key: dict[tuple[Any, ...], list[Run]] = {}
    for run in runs:
        by_key.setdefault(configuration_key(run), []).append(run)
    _merge_captures_without_code(by_key, notes)
    groups = [_select(group, allow_incomplete, metric, key) for key, group in by_key.items()]
    describe_configurations(groups)
    return LoadedLogs(groups, notes)


def _merge_captures_without_code(by_key: dict[tuple[Any, ...], list[Run]], notes: list[str]) -> None:
    """Runs without embedded code (console captures) join the one configuration with code of the same track, step
    count and GPU count (a count the capture does not give matches any): a folder often holds the logs of some
    seeds and the console output of others."""
    for key in [key for key in by_key if key[1] is None and key[4] is None]:
        track, _, devices, steps, _ = key
        matches = [other for other in by_key if other[1] is not None and other[3] == steps
                   and (track is None or other[0] == track) and (devices is None or other[2] == devices)]
        if len(matches) != 1:
            continue
        runs = by_key.pop(key)
        by_key[matches[0]].extend(runs)
        notes.append(f"{len(runs)} run(s) without embedded code ({_labels(runs)}) counted with the configuration of "
                     f"{by_key[matches[0]][0].label} (same track and {steps} steps); pass them apart to see them alone")


def _labels(runs: list[Run], limit: int = 3) -> str:
    labels = [run.label for run in runs]
    return ", ".join(labels[:limit]) + (f" +{len(labels) - limit} more" if len(labels) > limit else "")


EXCLUDED_HINT = " (pass --allow-incomplete to include it)"


def _select(runs: list[Run], allow_incomplete: bool, metric: str, key: tuple[Any, ...]) -> RunSet:
    notes: list[str] = []
    kept: list[RunFacts] = []
    for run in runs:
        if run.inconsistencies:
            notes.append(f"{run.label}: {run.status}; {INCONSISTENT_NOTE}")
        elif not run.usable_val_points:
            notes.append(f"{run.label}: {run.status} before its first val line; excluded")
        elif not run.complete and not allow_incomplete:
            notes.append(f"{run.label}: {run.status}; excluded{EXCLUDED_HINT}")
        else:
            fact = facts_from_run(run, metric)
            if not run.complete:
                notes.append(f"{run.label}: {run.status}; included at its last usable val line, step {fact.final_step} (--allow-incomplete)")
            kept.append(fact)
    _flag_same_trajectories(kept, notes)
    return RunSet(kept, notes, track=key[0], key=key)


INCONSISTENT_NOTE = "excluded: a log must hold what its run wrote; restore the original"


def configuration_key(run: Run) -> tuple[Any, ...]:
    """What must agree between the runs of one claim; None means the log does not say."""
    hyperparameters = run.env.hyperparameters
    settings = None
    if hyperparameters is not None:
        settings = tuple(sorted((k, repr(v)) for k, v in hyperparameters.items() if k not in RESULT_NEUTRAL_SETTINGS | PER_RUN_SETTINGS))
    # CPU runs split by their process count, as GPU runs by their GPU count (the reduction order differs)
    devices = _cpu_text(run.env.world_size) if run.env.on_cpu else run.env.gpu_count
    return (run.track, run.program_hash, devices, run.total_steps, settings)


KEY_PARTS = ("track", "code", "CPU or GPU count", "steps", "hyperparameters")


def differing_parts(groups: list[RunSet]) -> list[str]:
    """What tells the groups apart, with the first values: `steps (1680 vs 1640)`."""
    keys = [group.key for group in groups if group.key is not None]
    parts = []
    for index, name in enumerate(KEY_PARTS):
        values = list(dict.fromkeys(key[index] for key in keys))
        if len(values) < 2:
            continue
        if name == "hyperparameters":
            if parts:
                continue  # groups of different programs or step counts: their hyperparameters differ as a consequence
            by_name: dict[str, list[str]] = {}
            for setting in (setting for group in groups for setting in group.distinct):
                key, _, value = setting.partition("=")
                by_name.setdefault(key, [])
                if value not in by_name[key]:
                    by_name[key].append(value)
            shown = [f"{key}: {' vs '.join(seen[:2])}{' …' if len(seen) > 2 else ''}" for key, seen in list(by_name.items())[:2]]
            more = f"; +{len(by_name) - 2} more" if len(by_name) > 2 else ""
            parts.append(f"hyperparameters ({'; '.join(shown) or 'logged in some logs only'}{more})")
        elif name == "code":
            by_program = {}
            for group in groups:
                by_program.setdefault(group.key[1] if group.key else None, group)
            shown = [_code_text(group).removeprefix("code ")[:8] for group in list(by_program.values())[:2]]
            parts.append(f"code ({' vs '.join(shown)}{' …' if len(values) > 2 else ''})")
        else:
            shown = [str(v) if v is not None else "unknown" for v in values[:2]]
            parts.append(f"{name} ({' vs '.join(shown)}{' …' if len(values) > 2 else ''})")
    return (parts[:2] + ["…"] if len(parts) > 2 else parts) or ["published figures vs logs"]


def describe_configurations(groups: list[RunSet]) -> None:
    """Set each group's one-line description; hyperparameters are named only where they alone tell groups apart
    (groups of different programs have different Hyperparameters classes: naming them all would say nothing)."""
    for group in groups:
        assert group.key is not None  # groups of parsed logs always have one
        track, _program, devices, steps, settings = group.key
        varying = _varying_settings([g.key for g in groups if g.key is not None and g.key[:4] == group.key[:4]])
        parts = [track_text(track), _code_text(group), _devices_text(devices), f"{steps if steps is not None else '?'} steps"]
        if settings is not None and varying:
            values = dict(settings)
            group.distinct = [f"{name}={values.get(name, '<missing>')}" for name in sorted(varying)]
            more = f" (+{len(group.distinct) - 3} more)" if len(group.distinct) > 3 else ""
            parts.append(", ".join(group.distinct[:3]) + more)
        group.description = ", ".join(parts)
        raw_hashes = {fact.code_hash for fact in group.runs if fact.code_hash}
        if len(raw_hashes) > 1:
            group.notes.append(f"code differs only in comments, docstrings or per-run literals ({len(raw_hashes)} texts of one program)")


def track_text(track: int | None) -> str:
    return f"track {track}" if track is not None else "track unknown"


def first_code_difference(a: Run | None, b: Run | None) -> str | None:
    """Where the embedded code of two runs first differs, as `<file> line N: `old` -> `new``; None if it does not."""
    if a is None or b is None or a.program_hash == b.program_hash:
        return None
    if not a.sources or not b.sources:
        return "one of them embeds no code"
    for name in dict.fromkeys([*a.sources, *b.sources]):
        label = "train script" if name == "__script__" else name
        old, new = a.sources.get(name), b.sources.get(name)
        if old is None or new is None:
            return f"{label} is only in one of them"
        old_lines, new_lines = old.splitlines(), new.splitlines()
        for number, (before, after) in enumerate(zip(old_lines, new_lines), start=1):
            if before != after:
                return f"{label} line {number}: `{before[:80]}` -> `{after[:80]}`"
        if len(old_lines) != len(new_lines):
            return f"{label} line {min(len(old_lines), len(new_lines)) + 1}: one of them ends there"
    return "comments, docstrings or layout only"


def _code_text(group: RunSet) -> str:
    """The code hash as `parse` and results.json show it (the text's, stable across Python versions)."""
    hashes = list(dict.fromkeys(fact.code_hash for fact in group.runs if fact.code_hash))
    if not hashes:
        return "code not embedded" if group.runs else "code unknown (no usable run)"
    return f"code {hashes[0][:12]}" + (f" +{len(hashes) - 1} text variant{'s' if len(hashes) > 2 else ''}" if len(hashes) > 1 else "")


def _cpu_text(processes: int | None) -> str:
    return "CPU" if processes is None else f"CPU, {processes} process{'es' if processes != 1 else ''}"


def _devices_text(devices: int | str | None) -> str:
    if devices is None:
        return "GPUs unknown"
    return devices if isinstance(devices, str) else f"{devices} GPU{'s' if devices != 1 else ''}"


def _varying_settings(keys: list[tuple[Any, ...]]) -> set[str]:
    logged = [dict(key[4]) for key in keys if key[4] is not None]
    if len(logged) < 2:
        return set()
    names = set().union(*logged)
    return {name for name in names if len({entry.get(name) for entry in logged}) > 1}


def select_track(groups: list[RunSet], track: int) -> list[RunSet]:
    """The groups a `--track` asks for: those of that track, and those whose logs do not say (given that track)."""
    chosen = [group for group in groups if group.track in (track, None)]
    for group in chosen:
        if group.track is None:
            group.track = track
            group.description = group.description.replace(track_text(None), f"{track_text(track)} (--track)", 1)
    return chosen


def pool(groups: list[RunSet]) -> RunSet:
    """One RunSet over several configurations of one track (--allow-mixed), noting what differs."""
    tracks = sorted({group.track for group in groups}, key=str)
    if len(tracks) > 1:
        raise RecordsError(f"--allow-mixed pools configurations of one track, and these logs hold "
                           f"{' and '.join(track_text(t) for t in tracks)}; pass --track N to take one (never pooled)")
    runs = [fact for group in groups for fact in group.runs]
    notes = [f"pooled {len(groups)} configurations (--allow-mixed): " + " | ".join(g.description for g in groups)]
    notes += [note for group in groups for note in group.notes]
    return RunSet(runs, notes, track=tracks[0], description="pooled: " + "; ".join(g.description for g in groups))


def _drop_duplicates(runs: list[Run], notes: list[str]) -> list[Run]:
    """Count a run once: twin files, a console capture of a run whose log is also given, or a file whose val lines
    all appear in another run (a copy of part of it, e.g. a final_val_loss.txt repeating the last line)."""
    points = [frozenset((p.step, p.val_loss, p.train_time_s) for p in run.val_points) for run in runs]
    # The fullest version of a run first, and among equals the one that embeds its source.
    order = sorted(range(len(runs)), key=lambda i: (-len(points[i]), runs[i].code_hash is None, i))
    kept: list[int] = []
    for i in order:
        # Step 0 is the same for every run of a configuration (same initialization, no training yet): a file whose
        # only val lines are at step 0 repeats no run, and a run of another configuration is never a copy.
        twin = next((j for j in kept if any(step > 0 for step, _, _ in points[i]) and points[i] <= points[j]
                     and _same_configuration(runs[i], runs[j])), None)
        if twin is None:
            kept.append(i)
        elif points[i] == points[twin]:
            notes.append(f"{_named(runs[i], runs)}: same val lines (losses and times) as {_named(runs[twin], runs)}; counted once, "
                         f"as {_named(runs[twin], runs)}")
        else:
            notes.append(f"{_named(runs[i], runs)}: its {len(points[i])} val line(s) all appear in {_named(runs[twin], runs)} "
                         "(a copy of part of that run); not a run of its own")
    return [runs[i] for i in sorted(kept)]


def _same_configuration(a: Run, b: Run) -> bool:
    """Whether two logs can hold one run: the same configuration, or one of them says none (a console capture or a
    final_val_loss.txt has neither code nor a hyperparameters: line)."""
    if any(run.program_hash is None and run.env.hyperparameters is None for run in (a, b)):
        return a.track is None or b.track is None or a.track == b.track
    return configuration_key(a) == configuration_key(b)


def _named(run: Run, runs: list[Run]) -> str:
    """The run's label, with its folder when another input has the same file name (seed_0/stdout.txt)."""
    if sum(1 for other in runs if other.path.name == run.path.name) > 1:
        return f"{run.path.parent.name}/{run.label}"
    return run.label


def _flag_same_trajectories(facts: list[RunFacts], notes: list[str]) -> None:
    by_losses: dict[tuple[tuple[int, float], ...], RunFacts] = {}
    for fact in facts:
        key = tuple(sorted(fact.val_losses.items()))
        twin = by_losses.get(key)
        if len(key) > 1 and twin is not None:
            seed = _logged_seed(fact)
            if seed is not None and seed == _logged_seed(twin):
                why = f"both seeded with seed={seed}, so deterministic code repeats it; fine for a smoke test, but a record needs independent runs (distinct seeds or none)"
            else:
                why = "same seed?; a record needs independent runs"
            notes.append(f"{fact.label}: identical val-loss trajectory to {twin.label} ({why})")
        by_losses.setdefault(key, fact)


def _logged_seed(fact: RunFacts) -> int | None:
    """The seed a run's log names (this repository's scripts log it; -1 means unseeded), or None."""
    settings = fact.run.env.hyperparameters if fact.run is not None else None
    seed = (settings or {}).get("seed")
    return seed if isinstance(seed, int) and not isinstance(seed, bool) and seed >= 0 else None
