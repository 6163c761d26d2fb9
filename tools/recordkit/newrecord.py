"""`new`: create a record folder from logs; it never overwrites or renames anything.

A folder is a record unless `--not-a-record` files it as our own results, and a record must be one: its logs
are of the track asked for, consistent (as their runs wrote them), from hardware that can make a record of
the track (Tracks 1 and 2: 8 GPUs of one kind; Track 3, which counts steps: GPUs of one kind), and they pass
the track's rule. Anything else is refused in one line naming --not-a-record, or what to change.
"""

from __future__ import annotations

import datetime as dt
import json
import shlex
import shutil
import unicodedata
from collections.abc import Callable
from pathlib import Path
from typing import Any

from .errors import RecordsError
from .folders import (RESULTS_JSON, STATISTICS_MD, folder_name, make_folders, remove_made_folders, results_from_logs, sha256_of, sign,
                      track_dir, write_failure)
from .parse import find_logs
from .report import render_statistics_md, rule_text, track_report
from .runs import Environment, Run
from .runsets import RunSet, group_runs, load_runset, parse_logs, single_configuration

RECORD_GPUS = {1: 8, 2: 8}  # Tracks 1 and 2 are timed on 8 GPUs; Track 3 counts steps on any number
NOT_A_RECORD = "pass --not-a-record to file the folder as our own results"
RERUN_NEW, UNFILED = "rerun `records new`", "nothing was filed"
NOTHING_FILED = f"{RERUN_NEW} ({UNFILED})"


def hardware_problem(env: Environment, track: int) -> str | None:
    """Why a run on this machine cannot be a record of the track, or None."""
    if env.on_cpu:
        return "ran on the CPU"
    models = sorted(set(env.gpu_models)) or ([env.hardware.split("× ", 1)[-1]] if env.device and env.hardware else [])
    if not models:
        return "its log names no GPU (no nvidia-smi table, GPU table or device line)"
    if len(models) > 1:
        return f"ran on GPUs of different kinds ({', '.join(models)})"
    count = env.gpu_count
    needed = RECORD_GPUS.get(track)
    if needed is not None and count != needed:
        return (f"ran on {count} GPU{'s' if count != 1 else ''}" if count else "its log does not say how many GPUs") + \
            f", Track {track} records run on {needed}"
    return None


def refuse_non_record_hardware(runset: RunSet, track: int) -> None:
    problems = [f"{fact.label}: {why}" for fact in runset.runs if fact.run is not None
                if (why := hardware_problem(fact.run.env, track)) is not None]
    if problems:
        more = f" (and {len(problems) - 1} more)" if len(problems) > 1 else ""
        raise RecordsError(f"{problems[0]}{more}: not a Track {track} record; {NOT_A_RECORD}", detail=problems)


def refuse_other_track(runs: list[Run], track: int) -> None:
    other = [run for run in runs if run.track is not None and run.track != track]
    if other:
        run = other[0]
        more = f" (and {len(other) - 1} more)" if len(other) > 1 else ""
        raise RecordsError(f"{run.label}{more}: a Track {run.track} log ({run.track_reason}), not Track {track}; pass --track {run.track}",
                           detail=[f"{r.label}: Track {r.track} ({r.track_reason})" for r in other])


def refuse_inconsistent(runs: list[Run]) -> None:
    bad = [run for run in runs if run.inconsistencies]
    if bad:
        more = f" (and {len(bad) - 1} more)" if len(bad) > 1 else ""
        raise RecordsError(f"{bad[0].path}: {bad[0].status}{more}; `new` files logs only as their runs wrote them: restore "
                           "it, or leave it out of --logs", detail=[f"{run.label}: {run.status}" for run in bad])


def refuse_other_validation_set(runset: RunSet, track: int) -> None:
    """A record's loss is on FineWeb's validation tokens; a proxy dataset's or the smoke preset's is not."""
    problems = [f"{fact.label}: {fact.validation_problem}" for fact in runset.runs if fact.validation_problem]
    if problems:
        more = f" (and {len(problems) - 1} more)" if len(problems) > 1 else ""
        raise RecordsError(f"{problems[0]}{more}: not a Track {track} record; {NOT_A_RECORD}", detail=problems)


def refuse_control_characters(option: str, value: str | None) -> None:
    """--hardware and --note go into a README table cell and a README line, which a newline (or U+2028) would split and an
    escape code garble; a `|` is fine: the tables escape it."""
    bad = next((char for char in value or "" if unicodedata.category(char) in ("Cc", "Zl", "Zp")), None)
    if bad is not None:
        raise RecordsError(f"{option} {value!r}: holds the control character {bad!r}; pass one line of plain text (no newline, tab "
                           "or escape code)")


def refuse_future_date(date: dt.date) -> None:
    """A record is filed on or after the day its runs ended. The latest date anywhere is UTC+14's, so a submitter
    whose today is ahead of this machine's (a UTC machine, a Tokyo morning) is never refused."""
    latest = (dt.datetime.now(dt.timezone.utc) + dt.timedelta(hours=14)).date()
    if date > latest:
        raise RecordsError(f"--date {date.isoformat()}: in the future (no time zone has reached it; the latest today is "
                           f"{latest.isoformat()}); pass the day the runs ended, today or earlier")


def refuse_failing_rule(report: dict[str, Any], track: int) -> None:
    if not report["passes"]:
        raise RecordsError(f"does not pass the Track {track} rule ({report['verdict']}); {NOT_A_RECORD}")


def create_record(records_root: Path, track: int, name: str, logs: list[Path], date: dt.date | None = None,
                  hardware: str | None = None, note: str | None = None, allow_incomplete: bool = False,
                  allow_mixed: bool = False, not_a_record: bool = False, when_filled: Callable[[Path], None] | None = None) -> Path:
    """Create a record folder from logs; refuse if the folder or any file in it already exists.

    `when_filled(folder)` runs once the folder is complete (the CLI updates the README tables there); if it fails, or
    anything before it, the folder and the folders made for it are removed. A file or folder that cannot be written is
    one RecordsError line naming it, the reason and what to do."""
    refuse_control_characters("--hardware", hardware)
    refuse_control_characters("--note", note)
    if date is not None:
        refuse_future_date(date)
    date = date or dt.datetime.now(dt.timezone.utc).date()
    target = track_dir(records_root, track) / folder_name(track, date, name)
    if target.exists():
        raise RecordsError(f"{target}: already exists; records are never overwritten; choose another --name or --date")
    runs, notes = parse_logs(find_logs(logs))  # find_logs without a list: an unreadable folder is refused
    refuse_inconsistent(runs)
    refuse_other_track(runs, track)
    runset = single_configuration(group_runs(runs, allow_incomplete=allow_incomplete, notes=notes), allow_mixed)
    if not not_a_record:
        refuse_other_validation_set(runset, track)
        refuse_non_record_hardware(runset, track)
    used_logs = sorted({fact.run.path for fact in runset.runs if fact.run is not None})
    _refuse_name_clash(used_logs)
    report = track_report(runset, track)  # any statistics error surfaces before the folder exists
    if not not_a_record:
        refuse_failing_rule(report, track)
    made = make_folders(target.parent, NOTHING_FILED, wanted=target)
    try:
        target.mkdir()  # fails if someone created it meanwhile: never merge into an existing folder
    except FileExistsError:
        remove_made_folders(made)
        raise RecordsError(f"{target}: created by another process meanwhile (two `new` with one name?); nothing written, "
                           "choose another --name or --date") from None
    except OSError as exc:
        remove_made_folders(made)
        raise write_failure(target, exc, NOTHING_FILED, folder=True) from None
    try:
        _fill_folder(target, records_root, track, date, name, used_logs, runset.notes, hardware, note,
                     {"allow_incomplete": allow_incomplete, "allow_mixed": allow_mixed}, not not_a_record)
        if when_filled is not None:
            when_filled(target)
    except BaseException:
        shutil.rmtree(target, ignore_errors=True)  # only our own folder, created just above
        remove_made_folders(made)
        raise
    return target


def _fill_folder(target: Path, records_root: Path, track: int, date: dt.date, name: str, logs: list[Path], notes: list[str],
                 hardware: str | None, note: str | None, flags: dict[str, bool], record: bool) -> None:
    for log in logs:
        _copy_exact(log, target / log.name)
    # Re-read the copies so results.json describes exactly the files in the folder, in the order in which
    # `load_folder_runset` (and so `check`) reads them back: by file name.
    copies = sorted(target / log.name for log in logs)
    copied = load_runset(copies, allow_incomplete=flags["allow_incomplete"], allow_mixed=flags["allow_mixed"])
    report = track_report(copied, track)
    results = results_from_logs(track, date, name, copied, report, hardware, note, flags, record)
    left_out = [line for line in notes if line not in copied.notes]  # logs given but not copied, and why
    if left_out:
        results["left_out"] = left_out
    _write_new(target / RESULTS_JSON, json.dumps(results, indent=1, ensure_ascii=False) + "\n")
    _write_new(target / STATISTICS_MD, sign(render_statistics_md(report, target.name)))
    ours = all(fact.run is not None and "git_commit" in fact.run.env.settings for fact in copied.runs)
    _write_new(target / "README.md", readme_skeleton(results, report, target.relative_to(records_root.parent), ours))


def _refuse_name_clash(logs: list[Path]) -> None:
    seen: dict[str, Path] = {}
    for log in logs:
        if log.name in seen:
            raise RecordsError(f"{log}: same file name as {seen[log.name]}; rename one copy before `new` (logs are copied by name)")
        seen[log.name] = log


def _copy_exact(source: Path, destination: Path) -> None:
    if destination.exists():
        raise RecordsError(f"{destination}: already exists; not overwritten")
    try:
        shutil.copyfile(source, destination)
    except OSError as exc:  # the log was read a moment ago: the copy is what failed (a full disk names the source too)
        raise write_failure(destination, exc, NOTHING_FILED) from None
    if sha256_of(source) != sha256_of(destination):
        raise RecordsError(f"{destination}: copy differs from {source}; check the disk and retry")


def _write_new(path: Path, text: str) -> None:
    try:
        with path.open("x", encoding="utf-8") as handle:  # "x": never replace an existing file
            handle.write(text)
    except OSError as exc:
        raise write_failure(path, exc, NOTHING_FILED) from None


def readme_skeleton(results: dict[str, Any], report: dict[str, Any], folder: Path, ours: bool) -> str:
    track, summary = results["track"], results["summary"]
    loss, time = summary["val_loss"], summary["train_time_s"]
    first_log = results["runs"][0]["log"]
    processes = results["runs"][0].get("gpu_count") or 8
    arguments = "".join(f" {shlex.quote(f'--{key}={_cli_value(value)}')}" for key, value in (results["runs"][0].get("overrides") or {}).items())
    what = _origin_sentence(results["record"], ours)
    lines = [f"# {results['name']} (Track {track}, {results['date']})", "", what, f"Hardware: {results['hardware']}."]
    if results.get("note"):
        lines += ["", f"Note: {results['note']}"]
    lines += [
        "",
        "## What changed",
        "",
        "(Describe the change against the prior record in your own words; `python tools/records.py diff` lists it.)",
        "",
        "## Results",
        "",
        f"- n = {summary['n']}; val loss mean {loss['mean']:.4f}" + (f", sd {loss['std']:.4f}" if loss["std"] is not None else ""),
    ]
    if time:
        lines.append(f"- train time mean {time['mean']:.3f} s" + (f", sd {time['std']:.3f} s" if time["std"] is not None else ""))
    lines.append(f"- {rule_text(report)}" + (" (" if summary["passes"] is None else f" the Track {track} rule: ")
                 + report["verdict"] + (")" if summary["passes"] is None else ""))
    if results.get("left_out"):
        lines += ["", "Logs given to `new` but left out of this folder:", ""] + [f"- {line}" for line in results["left_out"]]
    lines += [
        "",
        "Per-run numbers are in `statistics.md`; machine-readable ones in `results.json`.",
        "",
        "## Reproduce",
        "",
        "```",
        f"python tools/records.py extract {folder.as_posix()}/{first_log} -o /tmp/repro/train.py",
        f"torchrun --standalone --nproc_per_node={processes} /tmp/repro/train.py{arguments}",
        "```",
    ]
    if results["record"]:
        lines += ["", "## Draft table row", "", draft_table_row(results)]
    return "\n".join(lines) + "\n"


def _origin_sentence(record: bool, ours: bool) -> str:
    """Who wrote the logs: this repository's scripts log a `git_commit:` line, imported logs do not."""
    kind = "A record candidate" if record else "Our own results, not a record (`new --not-a-record`)"
    if ours:
        return f"{kind}: runs of this repository's code, added with `python tools/records.py new`; the logs in this folder are ours."
    return (f"{kind}: runs of the code embedded in these logs, which this repository's scripts did not write (imported "
            "with `python tools/records.py new`); the logs are copied byte for byte.")


def _cli_value(value: Any) -> str:
    return str(value).lower() if isinstance(value, bool) else str(value)


def draft_table_row(results: dict[str, Any]) -> str:
    summary = results["summary"]
    date = dt.date.fromisoformat(results["date"])
    if results["track"] == 3:
        evidence = f"{summary['val_loss']['mean']:.4f} (n={summary['n']}){'✓' if summary['passes'] else 'Ⓧ'}"
        return f"| ? | {summary['step']} | {evidence} | {results['name']} | {date.strftime('%Y/%m/%d')} | |"
    minutes = summary["train_time_s"]["mean"] / 60 if summary.get("train_time_s") else None
    time_text = f"{minutes:.3f} minutes" if minutes is not None else "?"
    return f"| ? | {time_text} | {results['name']} | {date.strftime('%m/%d/%y')} | |"
