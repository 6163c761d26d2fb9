"""The record-folder format: folder names, results.json, published figures, generated files.

Names follow the published practice: records/track_1_short/<YYYY-MM-DD>_<CamelName>/ (Tracks 1 and 2)
and records/track_3_optimization/results/<YYYYMMDD>_<snake_name>/ (Track 3). A folder holds its logs
byte for byte, results.json (per-run figures and the summary), statistics.md and a README.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import errno
import hashlib
import json
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .errors import RecordsError
from .runsets import LoadedLogs, RunFacts, RunSet, load_logs, pool, single_configuration
from .textfiles import SAVE_AS_UTF8, folder_entries, is_file, is_folder, read_bytes, read_utf8

RESULTS_JSON = "results.json"
STATISTICS_MD = "statistics.md"
SCHEMA = 1
TRACK_DIRS = {1: Path("track_1_short"), 2: Path("track_2_medium"), 3: Path("track_3_optimization/results")}
NAME_PATTERN = {1: r"[A-Z][A-Za-z0-9]*", 2: r"[A-Z][A-Za-z0-9]*", 3: r"[a-z0-9][a-z0-9_]*"}
DATE_PATTERN = {1: r"\d{4}-\d{2}-\d{2}", 2: r"\d{4}-\d{2}-\d{2}", 3: r"\d{8}"}
TRACK_NAME = {track: re.compile(rf"^({DATE_PATTERN[track]})_({NAME_PATTERN[track]})$") for track in NAME_PATTERN}
NAME_RULES = {1: "CamelCase letters and digits, e.g. MuonCustomSizing", 2: "CamelCase letters and digits",
              3: "lower-case snake_case, e.g. shampoo_1_4_power"}
SUMMARY_KEYS = ("n", "step", "val_loss", "train_time_s", "test", "t_statistic", "df", "p_value", "passes",
                "margin", "z_p_value", "required_n", "first_passing_step", "rule_not_applied")


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
    if not is_folder(base):
        return []
    found = []
    for path in (p for p in folder_entries(base) if p.is_dir()):
        parsed = parse_folder_name(track, path.name)
        if parsed is not None:
            found.append(RecordFolder(track, path, parsed[0], parsed[1]))
    return sorted(found, key=lambda f: (f.date, f.name))


def is_record_folder(path: Path) -> bool:
    return is_folder(path) and is_file(path / RESULTS_JSON)


# ----- results.json -----


def read_results(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(read_utf8(path, f"{SAVE_AS_UTF8}, or regenerate it"))
    except FileNotFoundError:
        raise RecordsError(f"{path}: missing; recreate the record folder with `records new`") from None
    except json.JSONDecodeError as exc:
        raise RecordsError(f"{path}: invalid JSON (line {exc.lineno}: {exc.msg}); fix or regenerate it") from None
    if not isinstance(data, dict):
        raise RecordsError(f"{path}: expected a JSON object; fix or regenerate it")
    return data


def listed_logs(folder: Path, results: dict[str, Any]) -> list[Path]:
    return sorted({folder / entry["log"] for entry in results.get("runs") or [] if entry.get("log")})


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


def published_runset(folder: Path, results: dict[str, Any]) -> RunSet | None:
    """The published runs of a record folder whose results.json lists no logs; None otherwise."""
    entries = results.get("runs") or []
    if not entries or any(entry.get("log") is not None for entry in entries):
        return None
    facts = [facts_from_published(entry, i, folder) for i, entry in enumerate(entries, start=1)]
    return RunSet(facts, ["published figures from results.json (the logs are not in this repository)"], track=results.get("track"),
                  description=f"published figures of {folder.name}")


def load_folder(folder: Path, allow_incomplete: bool = False, metric: str = "val_loss") -> LoadedLogs:
    """A record folder's runs: the logs its results.json lists (with the folder's flags), or its published figures."""
    results = read_results(folder / RESULTS_JSON)
    published = published_runset(folder, results)
    if published is not None:
        return LoadedLogs([published])
    loaded = load_logs(listed_logs(folder, results), bool(results.get("allow_incomplete")) or allow_incomplete, metric)
    if results.get("allow_mixed") and len(loaded.groups) > 1:
        loaded.groups = [pool(loaded.groups)]
    for group in loaded.groups:
        if group.track is None:
            group.track = results.get("track")  # logs that do not say their track (no embedded code) take the folder's
    return loaded


def load_folder_runset(folder: Path, allow_incomplete: bool = False, allow_mixed: bool = False) -> RunSet:
    results = read_results(folder / RESULTS_JSON)
    return single_configuration(load_folder(folder, allow_incomplete), allow_mixed or bool(results.get("allow_mixed")))


def load_paths(paths: list[Path], allow_incomplete: bool = False, metric: str = "val_loss") -> LoadedLogs:
    """What a command line names: one record folder (its listed logs or published figures), or logs and folders of logs."""
    if len(paths) == 1 and is_record_folder(paths[0]):
        return load_folder(paths[0], allow_incomplete, metric)
    return load_logs(paths, allow_incomplete, metric)


def summary_of(report: dict[str, Any]) -> dict[str, Any]:
    return {key: report[key] for key in SUMMARY_KEYS if key in report}


def results_from_logs(track: int, date: dt.date, name: str, runset: RunSet, report: dict[str, Any], hardware: str | None,
                      note: str | None, flags: dict[str, bool], record: bool) -> dict[str, Any]:
    """results.json of a folder filed with its logs (kind "ours", whoever's scripts wrote them: the README says which);
    `record` False marks our own results (`new --not-a-record`)."""
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
        "record": record,
        "hardware": hardware or (", ".join(logged_hardware) if logged_hardware else "unknown"),
        "hardware_from_logs": logged_hardware,
        "note": note,
        **{key: value for key, value in flags.items() if value},
        "runs": runs,
        "summary": summary_of(report),
        "notes": report["notes"],
    }


def sha256_of(path: Path) -> str:
    return hashlib.sha256(read_bytes(path)).hexdigest()


# ----- generated files -----

# Generated markdown ends with this line; a file whose checksum no longer matches was edited by someone
# (or never written by the tool) and is not replaced without --force.
_FOOTER = "<!-- written by python tools/records.py; checksum of the text above: {} -->"
_FOOTER_PATTERN = re.compile(r"^<!-- written by python tools/records\.py; checksum of the text above: ([0-9a-f]{16}) -->$")


def _checksum(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def sign(text: str) -> str:
    """The text with the footer that marks it as generated and unedited."""
    above = (text if text.endswith("\n") else text + "\n") + "\n"  # a blank line, then the footer
    return f"{above}{_FOOTER.format(_checksum(above))}\n"


def written_by_tool(text: str) -> bool:
    """True when the text ends with our footer and nothing above it changed since."""
    body, _, last = text.rstrip("\n").rpartition("\n")
    match = _FOOTER_PATTERN.match(last)
    return match is not None and match.group(1) == _checksum(body + "\n")


def write_generated(path: Path, text: str, force: bool = False, flag: str = "--md FILE") -> str:
    """Write a signed file; an existing file is replaced only if the tool wrote it and nobody edited it, or with force.

    Returns what happened: "wrote", "replaced" or "unchanged". A path that cannot be written is one line naming `flag`.
    """
    signed = sign(text)
    existed = path.exists()
    try:
        if existed:
            old = path.read_text(encoding="utf-8", errors="replace")
            if old == signed:
                return "unchanged"
            if not force and not written_by_tool(old):
                raise RecordsError(f"{path}: exists, and was not written by this tool or was edited since; pass --force to replace it, or another FILE")
    except OSError as exc:
        raise RecordsError(f"{path}: cannot read it ({exc.strerror}); pass another {flag}") from None
    if not path.parent.is_dir():
        blocker = file_in_the_way(path.parent)
        why = f"{blocker} is a file, not a folder" if blocker is not None else "its folder does not exist; create it, or"
        raise RecordsError(f"{path}: {why}; pass another {flag}".replace("or;", "or"))
    kept = f"{path} was kept as it was" if existed else f"nothing was written; or pass another {flag}"
    replace_files({path: signed}, "rerun", kept)  # written beside it, then renamed: never half a file
    return "replaced" if existed else "wrote"


# ----- writing the tool's own files: one line when it cannot, nothing half-written -----


def file_in_the_way(path: Path) -> Path | None:
    """The file that stands where a folder of `path` (or `path` itself, as a folder) should be, if any."""
    for candidate in (path, *path.parents):
        if candidate.exists() and not candidate.is_dir():
            return candidate
    return None


def write_failure(path: Path, exc: OSError, then: str, folder: bool = False) -> RecordsError:
    """One line for a file (or, with folder, a folder) the tool could not write: the path, the reason (strerror) and
    what to do, ending with `then` (what to rerun, and what was left as it was)."""
    verb = "create" if folder else "write"
    blocker = file_in_the_way(path if folder else path.parent)
    if blocker is not None:
        return RecordsError(f"{path}: cannot {verb} it ({os.strerror(errno.ENOTDIR)}); {blocker} is a file, not a folder: "
                            f"move it away or pass another --root, then {then}")
    if exc.errno in (errno.ENOSPC, errno.EDQUOT):
        fix = "free space on that disk"
    elif exc.errno in (errno.EACCES, errno.EPERM, errno.EROFS):
        fix = "make it writable" if path.exists() else f"make {next(p for p in path.parents if p.exists())} writable"
    else:
        fix = "fix that"
    return RecordsError(f"{path}: cannot {verb} it ({exc.strerror or exc}); {fix}, then {then}")


def make_folders(path: Path, then: str, wanted: Path | None = None) -> list[Path]:
    """Create `path` and its missing parents; return the folders created, outermost first (for remove_made_folders).
    A failure names `wanted` (what the folders are for, `path` by default)."""
    missing = []
    candidate = path
    while not candidate.is_dir() and candidate != candidate.parent:
        missing.append(candidate)
        candidate = candidate.parent
    made: list[Path] = []
    for folder in reversed(missing):
        try:
            folder.mkdir()
        except OSError as exc:
            remove_made_folders(made)
            raise write_failure(wanted or path, exc, then, folder=True) from None
        made.append(folder)
    return made


def remove_made_folders(made: list[Path]) -> None:
    """Remove folders make_folders created, innermost first, as long as they are still empty."""
    for folder in reversed(made):
        with contextlib.suppress(OSError):  # not empty (someone else's file) or already gone: left as it is
            folder.rmdir()


def replace_files(texts: dict[Path, str], rerun: str, untouched: str) -> None:
    """Replace each file with its text, all of them or none: each text goes to a temporary file beside its target (one
    folder, so the rename is atomic), and the targets are renamed over only when every text is written. A file that
    cannot be written is refused first (a rename would replace a read-only file). On failure the temporary files are
    removed, and the one error line names the target and the reason, then says `rerun` and (`untouched`)."""
    staged: list[tuple[Path, Path]] = []

    def discard(temporaries: list[tuple[Path, Path]]) -> None:
        for temporary, _ in temporaries:
            with contextlib.suppress(OSError):  # already gone
                temporary.unlink()

    for target, text in texts.items():
        temporary = target.with_name(f".{target.name}.{os.getpid()}.tmp")
        try:
            if target.exists():
                with target.open("r+", encoding="utf-8"):  # a writability check: r+ truncates nothing
                    pass
            with temporary.open("x", encoding="utf-8") as handle:
                staged.append((temporary, target))
                handle.write(text)
                handle.flush()
                os.fsync(handle.fileno())
            if target.exists():
                os.chmod(temporary, target.stat().st_mode & 0o7777)
        except OSError as exc:
            discard(staged)
            raise write_failure(target, exc, f"{rerun} ({untouched})") from None
    for done, (temporary, target) in enumerate(staged):
        try:
            os.replace(temporary, target)
        except OSError as exc:
            discard(staged[done:])
            raise write_failure(target, exc, f"{rerun} ({done} of {len(staged)} files were replaced before it)") from None
