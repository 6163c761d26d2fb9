"""`diff`: new runs against the prior record: the decision first, then the code, environment and detail.

These are what a submission is judged on: the track and its claim (time to the target for Tracks 1 and 2,
steps to 3.28 for Track 3), the changed constants, the loss at equal steps, then the code (every log embeds
its script, so a prior record's code comes from its logs) and the software and GPUs (a new stack alone can
move the loss by a few 1e-4). Without --against the prior record is the prior world record of the log's
track (published.prior_record), fetched into the cache, or a newer record folder of ours with logs.
"""

from __future__ import annotations

import ast
import datetime as dt
import difflib
import os
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

from . import published, stats
from .compare import loss_at_matched_steps
from .errors import RecordsError
from .folders import file_in_the_way, is_record_folder, list_folders, listed_logs, load_folder_runset, read_results
from .report import format_p, rule_text, track_report
from .runs import Environment, Run
from .runsets import (PER_RUN_SETTINGS, RESULT_NEUTRAL_SETTINGS, RunFacts, RunSet, load_logs, load_runset, losses_not_comparable,
                      refuse_shared_logs)
from .tables import load_history

ENV_FIELDS = ("python", "torch", "cuda", "triton", "driver", "hardware", "world_size", "device")
ENV_SKIP_SETTINGS = {"hyperparameters", "overrides"}
LOSS_ROWS = 10  # rows of the loss table on the first screen


@dataclass
class Side:
    """One side of a diff: its runs and a representative parsed log (None for published figures)."""

    name: str
    runset: RunSet
    example: Run | None


def side_from_logs(name: str, paths: list[Path], allow_incomplete: bool, allow_mixed: bool) -> Side:
    runset = load_runset(paths, allow_incomplete=allow_incomplete, allow_mixed=allow_mixed)
    return Side(name, runset, _example(runset))


def side_from_folder(folder: Path) -> Side:
    runset = load_folder_runset(folder, allow_incomplete=True, allow_mixed=True)
    return Side(folder.name, runset, _example(runset))


def _example(runset: RunSet) -> Run | None:
    # Prefer a run whose log embeds its source (a console capture carries none).
    runs = [fact.run for fact in runset.runs if fact.run is not None]
    return next((run for run in runs if run.sources), runs[0] if runs else None)


# ----- which record -----


@dataclass
class Prior:
    side: Side
    where: str  # the folder or log shown on the first line
    why: str


@dataclass(frozen=True)
class Source:
    """Where published logs come from and go to (fetch's --cache-dir and --source-url)."""

    cache: Path
    url: str
    progress: IO[str] | None = None


def choose_prior(records_root: Path, track: int, against: str, new: Side, source: Source,
                 allow_incomplete: bool = False, allow_mixed: bool = False) -> Prior:
    """The record to diff against, and why: --against (a folder, a log, or TRACK:N|NAME of a published record), else
    the prior world record of the track, or a record folder of ours with logs that is newer than it."""
    if against != "auto":
        path = Path(against)
        if path.exists():
            prior = Prior(load_against(path, allow_incomplete, allow_mixed), str(path), "given with --against")
            _refuse_shared_logs(against, prior.side, new)
            return prior
        try:
            record = published.resolve_record(records_root, against, track)
        except RecordsError:
            raise RecordsError(f"--against {against}: no such folder or log, and no published record of that name; pass a "
                               "record folder, logs, TRACK:N (e.g. 1:89) or auto") from None
        prior = _published_prior(record, source, "given with --against")
        _refuse_shared_logs(against, prior.side, new)
        return prior
    new_files = {fact.run.file_sha256 for fact in new.runset.runs if fact.run is not None}
    records = _published_candidates(records_root, track)
    newest = next((record for record in reversed(records) if not new_files & {entry.sha256 for entry in record.files}), None)
    local = _newest_local_record(records_root, track, new_files)
    if local is not None and (newest is None or local[1] > _row_date(newest)):
        folder, date = local
        than = f", newer than the published {newest.label}" if newest is not None else ""
        return Prior(side_from_folder(folder), str(folder), f"the newest Track {track} record: a folder of ours with logs, "
                     f"filed on {date.isoformat()}{than}")
    if newest is None:
        raise RecordsError(f"no Track {track} record with logs to diff against (records/{published.PUBLISHED_LOGS_CSV} lists none); "
                           "pass --against RECORD_DIR|LOG")
    skipped = " (the newer one holds these very logs)" if newest is not (records[-1] if records else None) else ""
    what = "the prior world record" if track != 3 else "the prior best result (fewest steps, marked (!))"
    return _published_prior(newest, source, f"{what} of Track {track}, the newest in its history.csv{skipped}")


def _refuse_shared_logs(against: str, record: Side, new: Side) -> None:
    """The new run's log passed by mistake on the record's side too, or --against naming the new runs' own folder."""
    refuse_shared_logs(new.runset, record.runset, f"among the new runs and in --against {against}",
                       "a diff compares new runs with another record: pass the new runs' logs and the prior record's")


def _published_candidates(records_root: Path, track: int) -> list[published.PublishedRecord]:
    records = published.published_records(records_root, track)
    return [record for record in records if "(!)" in record.row.result] if track == 3 else records


def _published_prior(record: published.PublishedRecord, source: Source, why: str) -> Prior:
    fetched = published.fetch_record(record, source.cache, source.url, source.progress)
    origin = (f"{fetched.downloaded} log(s) downloaded" + (f", {fetched.from_cache} from the cache" if fetched.from_cache else "")
              if fetched.downloaded else f"{fetched.from_cache} log(s) from the cache")
    loaded = load_logs(fetched.files, allow_incomplete=True)
    for group in loaded.groups:
        group.track = group.track or record.track  # a log without code (llm.c) takes its row's track
    group = max(loaded.groups, key=lambda g: len(g.runs))
    group.notes[:0] = loaded.notes
    side = Side(f"#{record.row.number} {record.name}", group, _example(group))
    return Prior(side, f"{record.label}, {fetched.folder}", f"{why}; {origin}")


def _row_date(record: published.PublishedRecord) -> dt.date:
    text = record.row.date
    for form in ("%m/%d/%y", "%Y/%m/%d"):
        try:
            return dt.datetime.strptime(text, form).date()
        except ValueError:
            continue
    return dt.date.min


def _newest_local_record(records_root: Path, track: int, new_files: set[str]) -> tuple[Path, dt.date] | None:
    """Our newest record folder of the track with logs (linked by a history row, or filed by `new` as a record)."""
    linked = {row.folder for row in load_history(records_root, track) if row.folder}
    for folder in reversed(list_folders(records_root, track)):
        if not is_record_folder(folder.path):
            continue
        results = read_results(folder.results_path)
        if folder.path.name not in linked and results.get("record") is not True:
            continue  # our own results: not a record
        if not listed_logs(folder.path, results) or new_files & {entry.get("sha256") for entry in results.get("runs") or []}:
            continue  # published figures only, or the new runs' own folder
        return folder.path, folder.date
    return None


def load_against(path: Path, allow_incomplete: bool, allow_mixed: bool) -> Side:
    if is_record_folder(path):
        return side_from_folder(path)
    return side_from_logs(path.name, [path], allow_incomplete, allow_mixed)


# ----- sections -----


def source_diff(old: Run | None, new: Run | None, context: int = 3) -> list[str]:
    if old is None or not old.sources:
        return ["(the prior record has no log with embedded source here: no code diff)"]
    if new is None or not new.sources:
        return ["(the new log embeds no source, e.g. a console capture: no code diff)"]
    if old.code_hash == new.code_hash:
        return [f"(sources identical, code hash {new.code_hash[:12] if new.code_hash else '?'})"]
    lines: list[str] = []
    if old.program_hash == new.program_hash:
        lines.append("(same program: the code differs only in comments/docstrings; the text diff follows)")
    for name in list(dict.fromkeys([*old.sources, *new.sources])):
        label = "train script" if name == "__script__" else name
        before, after = old.sources.get(name), new.sources.get(name)
        if before == after:
            continue
        if before is None or after is None:
            lines.append(f"(file {label} only in the {'new run' if before is None else 'prior record'})")
            continue
        lines += difflib.unified_diff(before.splitlines(), after.splitlines(), f"record/{label}", f"new/{label}", n=context, lineterm="")
    return lines


def hyperparameters(run: Run | None) -> tuple[dict[str, Any], str] | None:
    """The run's hyperparameters and where they came from: our `hyperparameters:` line, else the source."""
    if run is None:
        return None
    if run.env.hyperparameters is not None:
        return run.env.hyperparameters, "log"
    script = next(iter(run.sources.values()), None)
    values = hyperparameters_from_source(script) if script else None
    return (values, "source") if values is not None else None


def hyperparameters_from_source(source: str) -> dict[str, Any] | None:
    """Field defaults of `class Hyperparameters` (literal values, else their source text); a script without that class
    (the Track 3 scripts) gives its module-level UPPER_CASE constants instead."""
    try:
        tree = ast.parse(source)
    except SyntaxError:
        return None
    for node in ast.walk(tree):
        if isinstance(node, ast.ClassDef) and node.name == "Hyperparameters":
            return _assigned_values(node.body, lambda name: True)
    constants = _assigned_values(tree.body, lambda name: name.isupper() and len(name) > 1)
    return constants or None


def _assigned_values(body: list[ast.stmt], wanted: Any) -> dict[str, Any]:
    values: dict[str, Any] = {}
    for item in body:
        target = item.target if isinstance(item, ast.AnnAssign) else (item.targets[0] if isinstance(item, ast.Assign) and len(item.targets) == 1 else None)
        value = getattr(item, "value", None)
        if isinstance(target, ast.Name) and value is not None and wanted(target.id):
            values[target.id] = _literal_or_text(value)
    return values


def _literal_or_text(node: ast.expr) -> Any:
    try:
        return ast.literal_eval(node)
    except (ValueError, SyntaxError, TypeError):
        return ast.unparse(node)


def mapping_diff(old: dict[str, Any], new: dict[str, Any]) -> list[str]:
    lines = []
    for key in sorted(set(old) | set(new)):
        if key not in old:
            lines.append(f"+ {key} = {_short(new[key])}")
        elif key not in new:
            lines.append(f"- {key} = {_short(old[key])}")
        elif old[key] != new[key]:
            lines.append(f"~ {key}: {_short(old[key])} -> {_short(new[key])}")
    return lines


def _short(value: Any, limit: int = 100) -> str:
    """A value's repr, cut to `limit` characters (a rank's parameter list can run to a thousand)."""
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 1] + "…"


def hyperparameter_diff(old: Run | None, new: Run | None) -> list[str]:
    before, after = hyperparameters(old), hyperparameters(new)
    if before is None or after is None:
        missing = "prior record" if before is None else "new run"
        return [f"(no Hyperparameters found for the {missing}: neither a `hyperparameters:` log line nor a `class Hyperparameters` in its source)"]
    lines = mapping_diff(before[0], after[0])
    origin = f"(record values from its {before[1]}, new values from its {after[1]})"
    return [origin] + (lines or ["(no differences)"])


def environment_of(env: Environment) -> dict[str, Any]:
    values = {name: getattr(env, name) for name in ENV_FIELDS}
    values.update({k: v for k, v in env.settings.items() if k not in ENV_SKIP_SETTINGS})
    return {k: v for k, v in values.items() if v is not None}


def environment_diff(old: Side, new: Side) -> list[str]:
    if old.example is None:
        hardware = sorted({f.hardware for f in old.runset.runs if f.hardware})
        mine = new.example.env.hardware if new.example else None
        return [f"(prior record: published figures only; its hardware: {', '.join(hardware) or 'unknown'}; new: {mine or 'unknown'})"]
    if new.example is None:
        return ["(no parsed log on the new side)"]
    return mapping_diff(environment_of(old.example.env), environment_of(new.example.env)) or ["(no differences)"]


def loss_table(old: list[RunFacts], new: list[RunFacts], limit: int | None = None) -> list[str]:
    """Mean val loss of each side at the steps every run shares; at most `limit` rows (spread out, the last kept)."""
    rows = loss_at_matched_steps(old, new)
    if not rows:
        return ["(no val step shared by every run on both sides)"]
    shown = rows
    if limit is not None and len(rows) > limit:
        picks = sorted({round(i * (len(rows) - 1) / (limit - 1)) for i in range(limit)})
        shown = [rows[i] for i in picks]
    header = f"{'step':>6}  {'record':>9}  {'new':>9}  {'delta':>9}" + (f"   ({len(shown)} of {len(rows)} shared steps)" if shown is not rows else "")
    return [header] + [f"{r['step']:>6}  {r['baseline']:>9.5f}  {r['candidate']:>9.5f}  {r['delta']:>+9.5f}" for r in shown]


def timing_lines(old: list[RunFacts], new: list[RunFacts]) -> list[str]:
    lines = []
    for label, key, unit, digits in (("total train time", "train_time_s", "s", 3), ("final step_avg", "step_avg_ms", "ms", 2)):
        before = [getattr(r, key) for r in old]
        after = [getattr(r, key) for r in new]
        if any(v is None for v in before) or any(v is None for v in after):
            lines.append(f"{label}: not in every run")
            continue
        b, a = stats.mean(before), stats.mean(after)
        lines.append(f"{label}: record {b:.{digits}f} {unit}  new {a:.{digits}f} {unit}  delta {a - b:+.{digits}f} {unit} ({(a - b) / b * 100:+.2f}%)")
    lines.append("(a record's official time may come from a re-timing, not from these logs)")
    return lines


def hardware_warning(old: Side, new: Side) -> list[str]:
    """The warning that wall-time deltas across machines say nothing about a change (every track's timing detail)."""
    if _hardware(old) == _hardware(new):
        return []
    return [f"different hardware (record: {_hardware(old)}; new: {_hardware(new)}): these time differences say nothing about the "
            "change; time the record on your machine and use `compare`"]


# ----- the first screen: the decision -----


def _hardware(side: Side) -> str:
    found = sorted({fact.hardware for fact in side.runset.runs if fact.hardware})
    return ", ".join(found) if found else "unknown"


def _steps(side: Side) -> str:
    totals = sorted({fact.total_steps for fact in side.runset.runs if fact.total_steps})
    finals = sorted({fact.final_step for fact in side.runset.runs if fact.final_step is not None})
    text = "/".join(map(str, totals)) or "?"
    return text if finals == totals or not finals else f"{text} (runs end at {'/'.join(map(str, finals))})"


def hyperparameter_summary(old: Run | None, new: Run | None, width: int = 100, verbose: bool = False) -> list[str]:
    """Every changed hyperparameter, one line each; how many names are on one side only, on one line (the names, wrapped,
    with `verbose`)."""
    before, after = hyperparameters(old), hyperparameters(new)
    if before is None or after is None:
        missing = "prior record" if before is None else "new run"
        return [f"hyperparameters: not found for the {missing} (no `hyperparameters:` line, no `class Hyperparameters`)"]
    changed = [key for key in sorted(set(before[0]) & set(after[0])) if before[0][key] != after[0][key]]
    per_run = [key for key in changed if key in PER_RUN_SETTINGS | RESULT_NEUTRAL_SETTINGS]
    changed = [key for key in changed if key not in per_run]
    aside = f"; {', '.join(per_run)} aside (they name or place a run)" if per_run else ""
    lines = [f"hyperparameters: {len(changed)} changed (record values from its {before[1]}, new values from its {after[1]}{aside})"]
    lines += [f"  {key}: {_short(before[0][key])} -> {_short(after[0][key])}" for key in changed]
    sides = (("only in the new run", sorted(set(after[0]) - set(before[0]))), ("only in the record", sorted(set(before[0]) - set(after[0]))))
    if verbose:
        for label, names in sides:
            if names:
                lines += _wrapped(f"  {label} ({len(names)}): ", names, width)
    elif any(names for _, names in sides):
        counts = "; ".join(f"{len(names)} {label}" for label, names in sides if names)
        lines.append(f"  names on one side only: {counts} (-v lists them)")
    return lines


def _wrapped(head: str, names: list[str], width: int) -> list[str]:
    lines, line = [], head
    for name in names:
        piece = name if line.endswith(": ") else f", {name}"
        if len(line) + len(piece) > width and not line.endswith(": "):
            lines.append(line + ",")
            line = " " * 4 + name
        else:
            line += piece
    return lines + [line]


def not_comparable(old: Side, new: Side) -> str | None:
    """Why the two sides' losses cannot be compared (different validation sets), or None."""
    return losses_not_comparable(("new runs", new.runset), ("record", old.runset))


def claim_lines(old: Side, new: Side, track: int) -> list[str]:
    """Time to the target (Tracks 1, 2) or steps to 3.28 (Track 3), with the statistic, and the new runs' own rule."""
    if track == 3:
        return _steps_to_target(old, new)
    target = stats.TARGETS[track]
    lines = []
    times_old = [f.train_time_s for f in old.runset.runs]
    times_new = [f.train_time_s for f in new.runset.runs]
    apart = not_comparable(old, new)
    if apart is not None:
        lines.append(f"time to {target}: not compared: {apart}")
    elif None in times_old or None in times_new:
        lines.append("time to target: not in every run's log (llm.c logs carry no time)")
    else:
        b, a = stats.mean(times_old), stats.mean(times_new)  # type: ignore[arg-type]
        test = stats.welch_less(times_new, times_old)  # type: ignore[arg-type]
        p = f"one-sided Welch p = {format_p(test.p)}" if test.p is not None else f"Welch p {test.reason}"
        lines.append(f"time to {target}: new {a:.3f} s (n={len(times_new)}) vs record {b:.3f} s (n={len(times_old)}): "
                     f"{a - b:+.3f} s ({(a - b) / b * 100:+.2f}%), {p} (H1: new faster)")
        if _hardware(old) != _hardware(new):
            lines.append("  different hardware: this time difference says nothing about the change; time the record on your machine "
                         "and use `compare`")
    own = track_report(new.runset, track)
    lines.append(f"loss rule of the new runs (mean < {target}, p < 0.01): {rule_text(own)} ({own['verdict']})")
    return lines


def _steps_to_target(old: Side, new: Side) -> list[str]:
    reports = []
    for label, side in (("record", old), ("new", new)):
        try:
            reports.append((label, track_report(side.runset, 3)))
        except RecordsError as exc:
            return [f"steps to 3.28: the {label} side has no step shared by its runs ({exc})"]
    lines = []
    for label, report in reports:
        claim = "first passing step" if report["first_passing_step"] == report["step"] else "no step passes; last shared step"
        verdict = "rule not applied: another validation set" if report["passes"] is None else \
            f"{'passes' if report['passes'] else 'fails'} ≥ 0.004"
        lines.append(f"steps to 3.28 ({label}): {report['step']} ({claim}), n={report['n']}, mean {report['val_loss']['mean']:.5f}, "
                     f"(3.28 − mean)·√n = {report['margin']:.5f} ({verdict})")
    apart = not_comparable(old, new)
    if apart is not None:
        return lines + [f"pairwise: not computed: {apart}"]
    (_, old_report), (_, new_report) = reports
    pair = stats.track3_pairwise(old_report["val_loss"]["mean"], old_report["n"], old_report["step"],
                                 new_report["val_loss"]["mean"], new_report["n"], new_report["step"])
    lines.append(f"pairwise (loss difference + 0.0045 per 100 steps saved)/√(1/n₁ + 1/n₂) = {pair.value:.5f}: "
                 f"{'significantly better' if pair.passes else 'not significantly better'} (needs ≥ 0.004; z p = {format_p(pair.z_p)})")
    return lines


def decision(old: Side, new: Side, track: int, verbose: bool = False) -> list[str]:
    """The answer first (the rule and the claim), then what it rests on: runs, steps, losses, hyperparameters."""
    rule = ("fewest steps to 3.28 val loss: (3.28 − mean)·√n ≥ 0.004" if track == 3 else
            f"time to {stats.TARGETS[track]} val loss on 8 GPUs; mean loss below {stats.TARGETS[track]} at p < 0.01")
    lines = [f"track {track} ({rule})",
             f"runs: new {len(new.runset.runs)} on {_hardware(new)}; record {len(old.runset.runs)} on {_hardware(old)}",
             f"steps: new {_steps(new)}; record {_steps(old)}"]
    lines[1:1] = claim_lines(old, new, track)
    lines.append("val loss at the steps both share (mean over runs):")
    lines += ["  " + line for line in loss_table(old.runset.runs, new.runset.runs, LOSS_ROWS)]
    lines += hyperparameter_summary(old.example, new.example, verbose=verbose)
    return lines


# ----- code: changed lines per section -----


def _sections(text: str) -> list[tuple[int, int, str]]:
    """(first line, last line, name) of each top-level definition; [] when the text is not Python."""
    try:
        tree = ast.parse(text)
    except (SyntaxError, ValueError):
        return []
    found = []
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            kind = "class" if isinstance(node, ast.ClassDef) else "def"
            first = min([node.lineno] + [d.lineno for d in node.decorator_list])
            found.append((first, node.end_lineno or node.lineno, f"{kind} {node.name}"))
    return found


def _section_of(line: int, sections: list[tuple[int, int, str]]) -> str:
    return next((name for first, last, name in sections if first <= line <= last), "module level")


def code_summary(old: Run | None, new: Run | None, limit: int = 6) -> list[str]:
    """Per embedded file: lines added and removed, by top-level definition."""
    if old is None or not old.sources or new is None or not new.sources:
        return source_diff(old, new)
    if old.code_hash == new.code_hash:
        return [f"(sources identical, code hash {new.code_hash[:12] if new.code_hash else '?'})"]
    lines = ["(same program: the code differs only in comments, docstrings or per-run literals)"] if old.program_hash == new.program_hash else []
    unchanged = 0
    for name in dict.fromkeys([*new.sources, *old.sources]):
        label = "train script" if name == "__script__" else name
        before, after = old.sources.get(name), new.sources.get(name)
        if before == after:
            unchanged += 1
            continue
        if before is None or after is None:
            lines.append(f"{label}: only in the {'new run' if before is None else 'record'} ({len((after or before or '').splitlines())} lines)")
            continue
        added, removed = _changed_lines(before, after)
        total_added, total_removed = sum(added.values()), sum(removed.values())
        names = sorted(set(added) | set(removed), key=lambda n: -(added[n] + removed[n]))
        parts = [f"{n} +{added[n]} −{removed[n]}" for n in names[:limit]]
        more = f"; {len(names) - limit} more" if len(names) > limit else ""
        lines.append(f"{label}: +{total_added} −{total_removed} lines: " + "; ".join(parts) + more)
    if unchanged:
        lines.append(f"({unchanged} file(s) unchanged)")
    return lines


def _changed_lines(before: str, after: str) -> tuple[Counter[str], Counter[str]]:
    old_lines, new_lines = before.splitlines(), after.splitlines()
    old_sections, new_sections = _sections(before), _sections(after)
    added: Counter[str] = Counter()
    removed: Counter[str] = Counter()
    for tag, i1, i2, j1, j2 in difflib.SequenceMatcher(None, old_lines, new_lines).get_opcodes():
        if tag == "equal":
            continue
        for i in range(i1, i2):
            removed[_section_of(i + 1, old_sections)] += 1
        for j in range(j1, j2):
            added[_section_of(j + 1, new_sections)] += 1
    return added, removed


def render_diff(old: Side, new: Side, track: int, full_code: bool = False, verbose: bool = False) -> str:
    published = ", published figures" if old.example is None else ""
    sections: list[tuple[str, list[str]]] = [
        (f"new: {len(new.runset.runs)} run(s) [{_labels(new.runset.runs)}]  vs record: {old.name} ({len(old.runset.runs)} run(s){published})", []),
        ("== decision", decision(old, new, track, verbose)),
        ("== code (changed lines per top-level definition; --code prints the full diff)", code_summary(old.example, new.example)),
        ("== environment", environment_diff(old, new)),
        ("== timing detail (means over runs)", timing_lines(old.runset.runs, new.runset.runs) + hardware_warning(old, new)),
    ]
    if full_code:
        sections.append(("== source diff", source_diff(old.example, new.example)))
    out: list[str] = []
    for title, lines in sections:
        out.append(title)
        out += lines
    out += [f"note: {note}" for note in old.runset.notes + new.runset.notes]
    return "\n".join(out)


def _labels(runs: list[RunFacts], limit: int = 4) -> str:
    labels = [fact.label for fact in runs]
    return ", ".join(labels[:limit]) + (f", +{len(labels) - limit} more" if len(labels) > limit else "")


def check_plot_path(path: Path) -> None:
    """Refuse a --plot path the PNG cannot go to; called before anything is loaded, so the error is not the last line
    after a whole diff, and an existing file (or folder) is never overwritten."""
    if path.exists() or path.is_symlink():
        raise RecordsError(f"{path}: already exists; pass another --plot path (never overwritten)")
    folder = path.parent
    blocker = file_in_the_way(folder)
    if blocker is not None:
        raise RecordsError(f"{path}: cannot write it there ({blocker} is a file, not a folder); pass another --plot path")
    if not folder.is_dir():
        raise RecordsError(f"{path}: no folder {folder}; create it or pass another --plot path")
    if not os.access(folder, os.W_OK | os.X_OK):
        raise RecordsError(f"{path}: cannot write it there ({folder} is not writable); pass another --plot path")


def plot_val_curves(old: Side, new: Side, path: Path, target: float = stats.TARGET_LOSS) -> None:
    """Overlay every run's val-loss curve (record in grey, new in colour); written with the Agg backend."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 5), dpi=100)
    finals = []
    for side, color in ((old, "0.5"), (new, "tab:blue")):
        for i, fact in enumerate(side.runset.runs):
            steps = sorted(s for s in fact.val_losses if s > 0)
            if not steps:
                continue
            losses = [fact.val_losses[s] for s in steps]
            finals.append(min(losses))
            ax.plot(steps, losses, color=color, marker="." if len(steps) < 10 else None, lw=1, alpha=0.8,
                    label=f"{side.name}" if i == 0 else None)
    ax.axhline(target, color="tab:red", lw=0.8, ls="--", label=f"{target} target")
    if finals:
        ax.set_ylim(min(finals) - 0.02, min(finals) + 0.8)
    ax.set_xlabel("step")
    ax.set_ylabel("val loss")
    ax.legend()
    ax.grid(alpha=0.3)
    fig.tight_layout()
    try:
        handle = path.open("xb")  # "x": a file that appeared since check_plot_path is never overwritten
    except FileExistsError:
        plt.close(fig)
        raise RecordsError(f"{path}: appeared while plotting; pass another --plot path (never overwritten)") from None
    except OSError as exc:
        plt.close(fig)
        raise RecordsError(f"{path}: cannot write the plot ({exc.strerror}); pick a writable path") from None
    try:
        with handle:
            fig.savefig(handle, format="png")
    except OSError as exc:
        path.unlink(missing_ok=True)  # our own half-written file: it would make the next --plot PATH "already exists"
        raise RecordsError(f"{path}: cannot write the plot ({exc.strerror}); pick a writable path") from None
    finally:
        plt.close(fig)
