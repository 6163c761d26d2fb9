"""`check`: record folders against their logs, history.csv against the folders, READMEs against the tables.

Every problem is one line naming the file and what to do. Published folders (runs with `"log": null`,
`"source": "published"`) are checked for consistency of their figures only; nothing is parsed for them.
"""

from __future__ import annotations

import math
import re
from pathlib import Path, PurePosixPath
from typing import Any

from .errors import RecordsError
from .folders import (RESULTS_JSON, STATISTICS_MD, SUMMARY_KEYS, TRACK_DIRS, RecordFolder, list_folders, load_folder_runset,
                      parse_folder_name, read_results, sha256_of, sign, summary_of, track_dir)
from .newrecord import hardware_problem
from .parse import LOG_SUFFIXES, NoValLineError, parse_log
from .published import load_manifest, manifest_path
from .report import render_statistics_md, track_report
from .tables import find_marked_readmes, history_path, load_history, read_readme, replace_blocks
from .textfiles import SAVE_AS_UTF8, folder_entries, is_file, is_folder, read_utf8

PUBLISHED_README_PHRASE = "not included"
SHA256 = re.compile(r"[0-9a-f]{64}")


def check_all(repo_root: Path, records_root: Path) -> list[str]:
    problems = check_history_files(records_root)  # first: the other checks read them
    history_usable = not problems
    for track in TRACK_DIRS:
        try:
            problems += check_track_dir(records_root, track)
            for folder in list_folders(records_root, track):
                problems += check_folder(folder)
        except RecordsError as exc:  # the track's folder cannot be listed: one line, and the other tracks still checked
            problems.append(str(exc))
    if history_usable:  # otherwise every table and row check would only repeat the line above
        problems += check_history(records_root)
        problems += check_published_logs(records_root)
        problems += check_readmes(repo_root, records_root)
    return list(dict.fromkeys(problems))  # a file that several checks read (a broken results.json) is named once


def folder_count(records_root: Path) -> int:
    """The record folders check_all looked at; a track folder that cannot be listed adds none (check_all names it)."""
    count = 0
    for track in TRACK_DIRS:
        try:
            count += len(list_folders(records_root, track))
        except RecordsError:
            continue
    return count


def check_history_files(records_root: Path) -> list[str]:
    """Each track's history.csv is there and has the columns the tables and `diff` read."""
    problems = []
    for track in (1, 2, 3):
        path = history_path(records_root, track)
        try:
            if not is_file(path):
                problems.append(f"{path}: missing; restore it from git (git checkout -- {path})")
                continue
            load_history(records_root, track)
        except RecordsError as exc:
            problems.append(str(exc))
    return problems


def check_track_dir(records_root: Path, track: int) -> list[str]:
    base = track_dir(records_root, track)
    if not is_folder(base):
        return []
    return [
        f"{path}: folder name does not follow the Track {track} convention; rename it (see records/README.md)"
        for path in folder_entries(base)
        if path.is_dir() and parse_folder_name(track, path.name) is None
    ]


def check_folder(folder: RecordFolder) -> list[str]:
    try:
        for required in ("README.md", RESULTS_JSON, STATISTICS_MD):
            if not is_file(folder.path / required):
                return [f"{folder.path / required}: missing; recreate the folder with `records new` or add the file"]
        readme = read_utf8(folder.path / "README.md", f"{SAVE_AS_UTF8}, or restore it from git")
        results = read_results(folder.results_path)
        problems = _check_header(folder, results)
        runs = results.get("runs")
        if not isinstance(runs, list) or not runs or not all(isinstance(run, dict) for run in runs):
            return problems + [f"{folder.results_path}: `runs` must be a non-empty list of objects; regenerate it with `records new`"]
        published = [run for run in runs if run.get("log") is None]
        if published and len(published) != len(runs):
            return problems + [f"{folder.results_path}: mixes published runs and logs; keep one kind per folder"]
        if published:
            problems += _check_published(folder, results, readme)
            problems += _check_summary(folder, results)
        else:
            logged = _check_logged(folder, results)
            problems += logged + _summary_unless_logs_broken(folder, results, bool(logged))
    except RecordsError as exc:
        return [str(exc)]
    return problems


def _summary_unless_logs_broken(folder: RecordFolder, results: dict[str, Any], logs_reported: bool) -> list[str]:
    """The summary is computed from the logs again: a missing or cut log fails that with a parse error ("pass a training
    log"), which would replace the lines above that already name the log and say to restore it."""
    try:
        return _check_summary(folder, results)
    except RecordsError as exc:
        return [] if logs_reported else [str(exc)]


def _check_header(folder: RecordFolder, results: dict[str, Any]) -> list[str]:
    where = folder.results_path
    problems = []
    if results.get("track") != folder.track:
        problems.append(f"{where}: track {results.get('track')!r} but the folder is under Track {folder.track}; fix `track`")
    if results.get("date") != folder.date.isoformat():
        problems.append(f"{where}: date {results.get('date')!r} differs from the folder name ({folder.date}); fix one of them")
    if results.get("name") != folder.name:
        problems.append(f"{where}: name {results.get('name')!r} differs from the folder name ({folder.name}); fix one of them")
    if results.get("kind") not in ("published", "ours"):
        problems.append(f"{where}: kind must be 'published' or 'ours'; fix it")
    return problems


def _check_published(folder: RecordFolder, results: dict[str, Any], readme: str) -> list[str]:
    problems = []
    for index, run in enumerate(results["runs"], start=1):
        if run.get("source") != "published":
            problems.append(f"{folder.results_path}: run {index} has no log but source {run.get('source')!r}; mark it \"published\" or add its log")
    if results.get("kind") != "published":
        problems.append(f"{folder.results_path}: runs without logs need kind 'published'; fix it")
    if PUBLISHED_README_PHRASE not in readme:
        problems.append(f"{folder.path / 'README.md'}: a folder of published figures must say its logs are {PUBLISHED_README_PHRASE}; add that sentence")
    stray = [p.name for p in folder_entries(folder.path) if p.suffix in LOG_SUFFIXES]
    if stray:
        problems.append(f"{folder.path}: logs {', '.join(stray)} are not listed in results.json; add them with `records new` in a new folder")
    return problems


def _check_logged(folder: RecordFolder, results: dict[str, Any]) -> list[str]:
    problems = []
    listed = set()
    for index, entry in enumerate(results["runs"], start=1):
        log = folder.path / str(entry.get("log"))
        listed.add(log.name)
        if not log.is_file():
            problems.append(f"{log}: listed in results.json but missing; restore the log")
            continue
        if entry.get("source") != "log":
            problems.append(f"{folder.results_path}: run {index} has a log but source {entry.get('source')!r}; set it to \"log\"")
        recorded = entry.get("sha256")
        if not isinstance(recorded, str) or not SHA256.fullmatch(recorded):
            # Nothing to compare with: the log may be intact, so say what is missing rather than accuse an edit.
            problems.append(_checksum_missing(folder, index, log.name, recorded))
        elif sha256_of(log) != recorded:
            problems.append(f"{log}: sha256 differs from results.json; the log was edited: restore the original")
            continue
        problems += _check_run_values(folder, log, entry, results.get("record") is True)
    stray = [p.name for p in folder_entries(folder.path) if p.suffix in LOG_SUFFIXES and p.name not in listed]
    if stray:
        problems.append(f"{folder.path}: logs {', '.join(stray)} are not listed in results.json; remove them or recreate the folder")
    if results.get("kind") != "ours":
        problems.append(f"{folder.results_path}: a folder with logs needs kind 'ours'; fix it")
    return problems


def _checksum_missing(folder: RecordFolder, index: int, log_name: str, recorded: Any) -> str:
    what = "has no sha256 of its log" if recorded is None else f"sha256 {recorded!r} is not 64 hex digits"
    return (f"{folder.results_path}: run {index} ({log_name}) {what}, so check cannot tell whether the log was edited; restore "
            "results.json from git (`records new` writes each log's sha256)")


def _check_run_values(folder: RecordFolder, log: Path, entry: dict[str, Any], record: bool) -> list[str]:
    try:
        runs = {run.trial: run for run in parse_log(log)}
    except NoValLineError as exc:
        # Reached only without a sha256 to compare (else the log is reported as edited): the parse error's advice ("pass a
        # training log") is wrong for a log filed here, and raised, it would replace the folder's other lines.
        return [f"{log}: the log is damaged or cut ({exc.what}); a record folder holds its logs as their runs wrote them: "
                "restore the original"]
    except RecordsError as exc:  # unreadable (permissions): one line of its own, the other checks' lines kept
        return [str(exc)]
    run = runs.get(entry.get("trial", 1))
    if run is None or not run.usable_val_points:
        return [f"{log}: trial {entry.get('trial')} not found in the log; regenerate results.json"]
    last = run.usable_val_points[-1]  # the final val line, or the last one before a divergence
    parsed = {"val_loss": last.val_loss, "train_time_s": last.train_time_s, "final_step": last.step,
              "total_steps": run.total_steps, "code_hash": run.code_hash}
    problems = [
        f"{folder.results_path}: {run.label} {key} is {entry.get(key)!r} but the log says {value!r}; regenerate results.json"
        for key, value in parsed.items()
        if not _same(entry.get(key), value)
    ]
    if run.track is not None and run.track != folder.track:
        problems.append(f"{log}: a Track {run.track} log ({run.track_reason}) in a Track {folder.track} folder; file it again with "
                        f"`records new --track {run.track}`")
    if run.inconsistencies:
        problems.append(f"{log}: {run.status}; a record folder holds logs as their runs wrote them: restore the original")
    other_set = run.env.validation_set_problem
    why = (f"logs its loss on another set: {other_set}" if other_set else hardware_problem(run.env, folder.track)) if record else None
    if why is not None:
        problems.append(f"{folder.results_path}: marked as a record, but {run.label} {why}; set \"record\": false (our own results)")
    return problems


def _check_summary(folder: RecordFolder, results: dict[str, Any]) -> list[str]:
    runset = load_folder_runset(folder.path)
    report = track_report(runset, folder.track)
    expected = summary_of(report)
    stored = results.get("summary") or {}
    problems = [
        f"{folder.results_path}: summary {key} is {stored.get(key)!r} but the runs give {expected.get(key)!r}; regenerate it"
        for key in SUMMARY_KEYS
        if key in expected and not _same(stored.get(key), expected.get(key))
    ]
    statistics = read_utf8(folder.path / STATISTICS_MD, f"regenerate it with `records stats {folder.path} --md --force`")
    if statistics != sign(render_statistics_md(report, folder.path.name)):
        problems.append(f"{folder.path / STATISTICS_MD}: differs from the statistics of the runs; regenerate it with "
                        f"`records stats {folder.path} --md --force`")
    return problems


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, bool) or isinstance(b, bool):
        return bool(a == b)
    if isinstance(a, (int, float)) and isinstance(b, (int, float)):
        return math.isclose(a, b, rel_tol=1e-9, abs_tol=1e-12)
    return bool(a == b)


def check_history(records_root: Path) -> list[str]:
    problems = []
    for track in (1, 2, 3):
        for row in load_history(records_root, track):
            if not row.folder:
                continue
            path = track_dir(records_root, track) / row.folder
            try:
                if parse_folder_name(track, row.folder) is None or not is_file(path / RESULTS_JSON):
                    problems.append(f"{records_root}: history row #{row.number} (Track {track}) links {row.folder}, which is not a record folder; fix the folder column")
                    continue
                summary = read_results(path / RESULTS_JSON).get("summary") or {}
            except RecordsError:
                continue  # check_folder reports the file or the folder that cannot be read
            problems += _row_against_summary(track, row.number, row.result, row.evidence, summary, path)
    return problems


def _row_against_summary(track: int, number: str, result: str, evidence: str, summary: dict[str, Any], path: Path) -> list[str]:
    if track in (1, 2):
        minutes = result.split()[0]
        decimals = len(minutes.partition(".")[2])
        time = (summary.get("train_time_s") or {}).get("mean")
        if time is None or f"{time / 60:.{decimals}f}" != minutes:
            return [f"{path}: Track {track} history row #{number} says {result} but results.json gives a mean of {time} s; fix one of them"]
        return []
    steps = result.replace("(!)", "")
    mean = (summary.get("val_loss") or {}).get("mean")
    mark = "✓" if summary.get("passes") else "Ⓧ"
    expected = f"{mean:.4f} (n={summary.get('n')}){mark}" if mean is not None else "?"
    problems = []
    if str(summary.get("step")) != steps:
        problems.append(f"{path}: Track 3 history row #{number} claims {steps} steps but results.json is at step {summary.get('step')}; fix one of them")
    if evidence != expected:
        problems.append(f"{path}: Track 3 history row #{number} evidence {evidence!r} but results.json gives {expected!r}; fix one of them")
    return problems


def check_published_logs(records_root: Path) -> list[str]:
    """Every history row that names its published logs has files in published_logs.csv, under that path, and
    every file listed there belongs to such a row."""
    try:
        manifest = load_manifest(records_root)
    except RecordsError as exc:
        return [str(exc)]
    where = manifest_path(records_root)
    problems = []
    named = set()
    for track in (1, 2, 3):
        for row in load_history(records_root, track):
            if not row.logs_at:
                continue
            named.add(row.logs_at)
            if row.logs_at not in manifest:
                problems.append(f"{where}: no file for Track {track} row #{row.number} ({row.logs_at}); run `records index CLONE --write`")
    for logs_at, entries in manifest.items():
        if logs_at not in named:
            problems.append(f"{where}: lists files of {logs_at}, which no history row names; run `records index CLONE --write`")
        base = PurePosixPath(logs_at)
        for entry in entries:
            path = PurePosixPath(entry.path)
            inside = path == base or base in path.parents or (base.suffix and base.parent in path.parents)
            if not inside or entry.size <= 0 or not SHA256.fullmatch(entry.sha256):
                problems.append(f"{where}: {entry.path} is not a file of {logs_at} with a size and a sha256; run `records index CLONE --write`")
    return problems


def check_readmes(repo_root: Path, records_root: Path) -> list[str]:
    problems: list[str] = []
    for readme in find_marked_readmes(repo_root, problems):
        try:
            text = read_readme(readme)
            if replace_blocks(text, readme, records_root) != text:
                problems.append(f"{readme}: tables differ from history.csv and the record folders; run `python tools/records.py tables --write`")
        except RecordsError as exc:
            problems.append(str(exc))
    return problems
