"""Record folders: names, results.json, and `new` (which never overwrites or renames anything).

Layout (records spec §1): records/track_1_short/<YYYY-MM-DD>_<CamelName>/ and
records/track_3_optimization/results/<YYYYMMDD>_<snake_name>/.
"""

from __future__ import annotations

import datetime as dt
import hashlib
import json
import re
import shlex
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .errors import RecordsError
from .report import render_statistics_md, track_report
from .runsets import RESULTS_JSON, RunSet, load_runset, published_runset, read_results

TRACK_DIRS = {1: Path("track_1_short"), 2: Path("track_2_medium"), 3: Path("track_3_optimization/results")}
NAME_PATTERN = {1: r"[A-Z][A-Za-z0-9]*", 2: r"[A-Z][A-Za-z0-9]*", 3: r"[a-z0-9][a-z0-9_]*"}
DATE_PATTERN = {1: r"\d{4}-\d{2}-\d{2}", 2: r"\d{4}-\d{2}-\d{2}", 3: r"\d{8}"}
TRACK_NAME = {track: re.compile(rf"^({DATE_PATTERN[track]})_({NAME_PATTERN[track]})$") for track in NAME_PATTERN}
NAME_RULES = {1: "CamelCase letters and digits, e.g. MuonCustomSizing", 2: "CamelCase letters and digits",
              3: "lower-case snake_case, e.g. shampoo_1_4_power"}
SUMMARY_KEYS = ("n", "step", "val_loss", "train_time_s", "test", "t_statistic", "df", "p_value", "passes",
                "margin", "z_p_value", "required_n", "first_passing_step")
SCHEMA = 1


@dataclass(frozen=True)
class RecordFolder:
    track: int
    path: Path
    date: dt.date
    name: str

    @property
    def results_path(self) -> Path:
        return self.path / RESULTS_JSON


def track_dir(records_root: Path, track: int) -> Path:
    return records_root / TRACK_DIRS[track]


def folder_name(track: int, date: dt.date, name: str) -> str:
    if not re.fullmatch(NAME_PATTERN[track], name):
        raise RecordsError(f"--name {name!r}: Track {track} names use {NAME_RULES[track]}; pick such a name")
    stamp = date.isoformat() if track in (1, 2) else date.strftime("%Y%m%d")
    return f"{stamp}_{name}"


def parse_folder_name(track: int, folder: str) -> tuple[dt.date, str] | None:
    match = TRACK_NAME[track].match(folder)
    if not match:
        return None
    stamp, name = match.groups()
    try:
        date = dt.date.fromisoformat(stamp) if "-" in stamp else dt.datetime.strptime(stamp, "%Y%m%d").date()
    except ValueError:
        return None
    return date, name


def list_folders(records_root: Path, track: int) -> list[RecordFolder]:
    """Record folders of a track, oldest first (folders not named by the convention are skipped here; check reports them)."""
    base = track_dir(records_root, track)
    if not base.is_dir():
        return []
    found = []
    for path in sorted(p for p in base.iterdir() if p.is_dir()):
        parsed = parse_folder_name(track, path.name)
        if parsed is not None:
            found.append(RecordFolder(track, path, parsed[0], parsed[1]))
    return sorted(found, key=lambda f: (f.date, f.name))


def load_folder_runset(folder: Path, allow_incomplete: bool = False, allow_mixed: bool = False) -> RunSet:
    """The runs of a record folder: its logs as listed in results.json, or its published figures."""
    results = read_results(folder / RESULTS_JSON)
    published = published_runset(folder, results)
    if published is not None:
        return published
    entries = results.get("runs") or []
    logs = sorted({folder / entry["log"] for entry in entries if entry.get("log")})
    return load_runset(logs, allow_incomplete=bool(results.get("allow_incomplete")) or allow_incomplete,
                       allow_mixed=bool(results.get("allow_mixed")) or allow_mixed)


# ----- results.json -----


def summary_of(report: dict[str, Any]) -> dict[str, Any]:
    return {key: report[key] for key in SUMMARY_KEYS if key in report}


def results_from_logs(track: int, date: dt.date, name: str, runset: RunSet, report: dict[str, Any],
                      hardware: str | None, note: str | None, flags: dict[str, bool]) -> dict[str, Any]:
    runs: list[dict[str, Any]] = []
    for fact in runset.runs:
        run = fact.run
        assert run is not None  # runs from logs always carry the parsed run
        runs.append({
            "log": run.path.name,
            "trial": run.trial,
            "source": "log",
            "sha256": run.file_sha256,
            "code_hash": run.code_hash,
            "final_step": fact.final_step,
            "total_steps": fact.total_steps,
            "val_loss": fact.val_loss,
            "train_time_s": fact.train_time_s,
            "step_avg_ms": fact.step_avg_ms,
            "hardware": fact.hardware,
            "gpu_count": fact.gpu_count,
            "torch": run.env.torch,
            "overrides": run.env.overrides,
            "status": fact.status,
        })
    logged_hardware = sorted({r["hardware"] for r in runs if r["hardware"]})
    return {
        "schema": SCHEMA,
        "track": track,
        "date": date.isoformat(),
        "name": name,
        "kind": "ours",
        "hardware": hardware or (", ".join(logged_hardware) if logged_hardware else "unknown"),
        "hardware_from_logs": logged_hardware,
        "note": note,
        **{key: value for key, value in flags.items() if value},
        "runs": runs,
        "summary": summary_of(report),
        "notes": report["notes"],
    }


def sha256_of(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


# ----- new -----


def create_record(records_root: Path, track: int, name: str, logs: list[Path], date: dt.date | None = None,
                  hardware: str | None = None, note: str | None = None, allow_incomplete: bool = False,
                  allow_mixed: bool = False) -> Path:
    """Create a record folder from logs; refuse if the folder or any file in it already exists."""
    date = date or dt.datetime.now(dt.timezone.utc).date()
    target = track_dir(records_root, track) / folder_name(track, date, name)
    if target.exists():
        raise RecordsError(f"{target}: already exists; records are never overwritten; choose another --name or --date")
    runset = load_runset(logs, allow_incomplete=allow_incomplete, allow_mixed=allow_mixed)
    used_logs = sorted({fact.run.path for fact in runset.runs if fact.run is not None})
    _refuse_name_clash(used_logs)
    track_report(runset, track)  # any statistics error surfaces before the folder exists
    target.parent.mkdir(parents=True, exist_ok=True)
    target.mkdir()  # fails if someone created it meanwhile: never merge into an existing folder
    try:
        _fill_folder(target, records_root, track, date, name, used_logs, hardware, note, allow_incomplete, allow_mixed)
    except BaseException:
        shutil.rmtree(target)  # only our own half-written folder, created just above
        raise
    return target


def _fill_folder(target: Path, records_root: Path, track: int, date: dt.date, name: str, logs: list[Path],
                 hardware: str | None, note: str | None, allow_incomplete: bool, allow_mixed: bool) -> None:
    for log in logs:
        _copy_exact(log, target / log.name)
    # Re-read the copies so results.json describes exactly the files in the folder, in the order in which
    # `load_folder_runset` (and so `check`) reads them back: by file name.
    copies = sorted(target / log.name for log in logs)
    copied = load_runset(copies, allow_incomplete=allow_incomplete, allow_mixed=allow_mixed)
    report = track_report(copied, track)
    flags = {"allow_incomplete": allow_incomplete, "allow_mixed": allow_mixed}
    results = results_from_logs(track, date, name, copied, report, hardware, note, flags)
    _write_new(target / RESULTS_JSON, json.dumps(results, indent=1, ensure_ascii=False) + "\n")
    _write_new(target / "statistics.md", render_statistics_md(report, target.name))
    _write_new(target / "README.md", readme_skeleton(results, report, target.relative_to(records_root.parent)))


def _refuse_name_clash(logs: list[Path]) -> None:
    seen: dict[str, Path] = {}
    for log in logs:
        if log.name in seen:
            raise RecordsError(f"{log}: same file name as {seen[log.name]}; rename one copy before `new` (logs are copied by name)")
        seen[log.name] = log


def _copy_exact(source: Path, destination: Path) -> None:
    if destination.exists():
        raise RecordsError(f"{destination}: already exists; not overwritten")
    shutil.copyfile(source, destination)
    if sha256_of(source) != sha256_of(destination):
        raise RecordsError(f"{destination}: copy differs from {source}; check the disk and retry")


def _write_new(path: Path, text: str) -> None:
    with path.open("x", encoding="utf-8") as handle:  # "x": never replace an existing file
        handle.write(text)


def readme_skeleton(results: dict[str, Any], report: dict[str, Any], folder: Path) -> str:
    track, summary = results["track"], results["summary"]
    loss, time = summary["val_loss"], summary["train_time_s"]
    first_log = results["runs"][0]["log"]
    processes = results["runs"][0].get("gpu_count") or 8
    arguments = "".join(f" {shlex.quote(f'--{key}={_cli_value(value)}')}" for key, value in (results["runs"][0].get("overrides") or {}).items())
    lines = [
        f"# {results['name']} (Track {track}, {results['date']})",
        "",
        "Runs of this repository's code, added with `python tools/records.py new`; the logs in this folder are ours.",
        f"Hardware: {results['hardware']}.",
    ]
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
    if track == 3:
        lines.append(f"- (3.28 − mean)·√n = {summary['margin']:.5f} at step {summary['step']}: {'passes' if summary['passes'] else 'does not pass'}")
    else:
        p = summary["p_value"]
        lines.append(f"- one-sided p (H1: mean < {report['target']}) = {'undefined (n < 2)' if p is None else f'{p:.4g}'}: "
                     f"{'passes' if summary['passes'] else 'does not pass'} the p < 0.01 rule")
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
        "",
        "## Draft table row",
        "",
        draft_table_row(results),
        "",
    ]
    return "\n".join(lines)


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
