"""`index`: rebuild records/published_logs.csv from a local clone of the public speedrun repository.

For each history row's `logs_at`: a folder stands for the log files under it; a file, for the log files in its
folder (only the file itself when that folder is a track's top folder or holds another row's logs too). Of
those, the files that hold the record's runs are kept: the configuration of the linked file, or for a folder
the largest one, with copies of runs (console captures, final-line summaries) left out as `stats` leaves
them out. Each kept file is listed with its size and sha256.
"""

from __future__ import annotations

import csv
import hashlib
import io
from collections import Counter
from dataclasses import dataclass
from pathlib import Path, PurePosixPath

from .errors import RecordsError
from .parse import find_logs
from .published import MANIFEST_COLUMNS, PUBLISHED_COMMIT, PUBLISHED_REPOSITORY, PublishedLog, manifest_path
from .runsets import RunSet, group_runs, parse_logs
from .tables import history_path, load_history, required_history

TRACK_ROOTS = {PurePosixPath("records/track_1_short"), PurePosixPath("records/track_2_medium"),
               PurePosixPath("records/track_3_optimization/results")}


@dataclass(frozen=True)
class IndexedRecord:
    track: int
    number: str
    logs_at: str
    files: list[PublishedLog]
    runs: int


def index_clone(clone: Path, records_root: Path) -> list[IndexedRecord]:
    if not clone.is_dir():
        what = "a file, not a folder" if clone.exists() else "no such folder"
        raise RecordsError(f"{clone}: {what}; pass a clone of {PUBLISHED_REPOSITORY} checked out at {PUBLISHED_COMMIT[:12]}")
    rows = [(track, row) for track in (1, 2, 3) for row in load_history(records_root, track) if row.logs_at]
    if not rows:  # an index of nothing would replace published_logs.csv with its header line
        histories = ", ".join(str(history_path(records_root, track)) for track in (1, 2, 3))
        raise RecordsError(f"{records_root}: no history row names a published log folder (read {histories}); "
                           "pass --root REPO, the checkout whose records/ holds them (nothing was written)")
    for track in (1, 2, 3):
        required_history(records_root, track, f"published_logs.csv's Track {track} part")
    parents = Counter(PurePosixPath(row.logs_at).parent for _, row in rows if (clone / row.logs_at).is_file())
    indexed = []
    for track, row in rows:
        target = clone / row.logs_at
        if not target.exists():
            raise RecordsError(f"{target}: history row #{row.number} (Track {track}) names it, but the clone lacks it; check out "
                               f"the pinned commit: git -C {clone} checkout {PUBLISHED_COMMIT[:12]}")
        parent = PurePosixPath(row.logs_at).parent
        alone = target.is_file() and (parent in TRACK_ROOTS or parents[parent] > 1)
        candidates = [target] if alone else find_logs([target if target.is_dir() else target.parent])
        runs, _ = parse_logs(candidates)
        groups = group_runs(runs, allow_incomplete=True).groups
        group = _record_group(groups, target if target.is_file() else None)
        files = sorted({fact.run.path for fact in group.runs if fact.run is not None})
        indexed.append(IndexedRecord(track, row.number, row.logs_at, [_entry(clone, path) for path in files], len(group.runs)))
    return indexed


def _record_group(groups: list[RunSet], linked: Path | None) -> RunSet:
    if linked is not None:
        for group in groups:
            if any(fact.run is not None and fact.run.path == linked for fact in group.runs):
                return group
    return max(groups, key=lambda group: len(group.runs))


def _entry(clone: Path, path: Path) -> PublishedLog:
    data = path.read_bytes()
    return PublishedLog(path.relative_to(clone).as_posix(), len(data), hashlib.sha256(data).hexdigest())


def render_manifest(indexed: list[IndexedRecord]) -> str:
    out = io.StringIO()
    writer = csv.writer(out, lineterminator="\n")
    writer.writerow(MANIFEST_COLUMNS)
    for record in indexed:
        for entry in record.files:
            writer.writerow([record.logs_at, entry.path, entry.size, entry.sha256])
    return out.getvalue()


def write_manifest(records_root: Path, indexed: list[IndexedRecord]) -> str:
    """Write records/published_logs.csv; returns "wrote", "replaced" or "unchanged"."""
    path = manifest_path(records_root)
    text = render_manifest(indexed)
    if path.is_file() and path.read_text(encoding="utf-8", errors="replace") == text:  # an old file that is not UTF-8 differs
        return "unchanged"
    what = "replaced" if path.exists() else "wrote"
    path.write_text(text, encoding="utf-8")
    return what
