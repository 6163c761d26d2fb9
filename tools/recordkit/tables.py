"""README tables generated from records/<track>/history.csv and the record folders.

Blocks live between marker comments, e.g. `<!-- records:track1:start -->` … `<!-- records:track1:end -->`,
in any README.md of the repository; `tables --write` fills them and `check` compares them.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from .errors import RecordsError
from .folders import RESULTS_JSON, list_folders, read_results, replace_files, track_dir
from .textfiles import SAVE_AS_UTF8, csv_rows, is_file, read_bytes, read_utf8

HISTORY_CSV = "history.csv"
HISTORY_DIRS = {1: Path("track_1_short"), 2: Path("track_2_medium"), 3: Path("track_3_optimization")}
HISTORY_COLUMNS = {1: ("record", "time", "date", "description", "folder", "logs_at"),
                   2: ("record", "time", "date", "description", "folder", "logs_at"),
                   3: ("result", "steps", "evidence", "date", "description", "folder", "logs_at")}
BLOCKS = ("track1", "track2", "track3", "folders")
SKIP_DIRS = {".git", "logs", "checkpoints", "node_modules", "__pycache__", ".proxy", ".whl", "data"}


def start_marker(block: str) -> str:
    return f"<!-- records:{block}:start -->"


def end_marker(block: str) -> str:
    return f"<!-- records:{block}:end -->"


@dataclass(frozen=True)
class HistoryRow:
    """One row of a history.csv: published facts, our description, and our folder if we have one."""

    number: str
    result: str  # Tracks 1, 2: "2.495 minutes"; Track 3: "4100" or "3600(!)"
    evidence: str  # Track 3 only: "3.2776 (n=4)✓"
    date: str  # as published: MM/DD/YY (Tracks 1, 2), YYYY/MM/DD (Track 3)
    description: str
    folder: str  # folder name inside the track's record directory, or ""
    logs_at: str = ""  # where the public speedrun repository keeps its logs (a folder or one file), or ""


def history_path(records_root: Path, track: int) -> Path:
    return records_root / HISTORY_DIRS[track] / HISTORY_CSV


def required_history(records_root: Path, track: int, lost: str) -> Path:
    """The track's history.csv; a missing one is a RecordsError, because a writer that read it as empty would drop `lost`."""
    path = history_path(records_root, track)
    if not is_file(path):
        raise RecordsError(f"{path}: missing, and {lost} would lose every row; restore it (git checkout -- {path}) "
                           "or pass --root REPO (nothing was written)")
    return path


def load_history(records_root: Path, track: int) -> list[HistoryRow]:
    path = history_path(records_root, track)
    if not is_file(path):
        return []
    text = read_utf8(path, f"{SAVE_AS_UTF8}, or restore it from git (git checkout -- {path})", translate_newlines=False)
    rows = [row for _, row in csv_rows(path, text, HISTORY_COLUMNS[track], f"git checkout -- {path}")]
    if track in (1, 2):
        return [HistoryRow(r["record"], r["time"], "", r["date"], r["description"], r["folder"], r["logs_at"]) for r in rows]
    return [HistoryRow(r["result"], r["steps"], r["evidence"], r["date"], r["description"], r["folder"], r["logs_at"]) for r in rows]


def _cell(text: str) -> str:
    return text.replace("|", "\\|")


def _folder_link(records_root: Path, track: int, folder: str, readme_dir: Path) -> str:
    if not folder:
        return ""
    target = track_dir(records_root, track) / folder
    relative = Path(os.path.relpath(target, readme_dir)).as_posix()
    return f"[{folder}]({relative}/)"


def render_timed(track: int, records_root: Path, readme_dir: Path) -> str:
    """Tracks 1 and 2: record time, description, date, our folder."""
    lines = ["| # | Record time | Description | Date | Folder here |", "|---|---|---|---|---|"]
    required_history(records_root, track, f"the Track {track} table")
    for row in load_history(records_root, track):
        link = _folder_link(records_root, track, row.folder, readme_dir)
        lines.append(f"| {row.number} | {row.result} | {_cell(row.description)} | {row.date} | {link} |")
    return "\n".join(lines)


def render_track3(records_root: Path, readme_dir: Path) -> str:
    lines = ["| # | Steps to 3.28 | Evidence | Description | Date | Folder here |", "|---|---|---|---|---|---|"]
    required_history(records_root, 3, "the Track 3 table")
    for row in load_history(records_root, 3):
        link = _folder_link(records_root, 3, row.folder, readme_dir)
        lines.append(f"| {row.number} | {row.result} | {row.evidence} | {_cell(row.description)} | {row.date} | {link} |")
    return "\n".join(lines)


def render_folders(records_root: Path, readme_dir: Path) -> str:
    lines = [
        "| Track | Folder | Runs from | n | Mean val loss | Mean train time (s) | Hardware |",
        "|---|---|---|---|---|---|---|",
    ]
    for track in (1, 2, 3):
        for folder in list_folders(records_root, track):
            if not is_file(folder.path / RESULTS_JSON):
                continue  # check reports it
            results = read_results(folder.path / RESULTS_JSON)
            summary = results.get("summary") or {}
            loss = (summary.get("val_loss") or {}).get("mean")
            time = (summary.get("train_time_s") or {}).get("mean")
            # kind "ours": filed here with `new`, its logs in the folder (written by this repository's scripts or imported)
            origin = "published figures (logs not included)" if results.get("kind") == "published" else "logs in this folder"
            step = f" at step {summary['step']}" if summary.get("step") is not None else ""
            link = _folder_link(records_root, track, folder.path.name, readme_dir)
            lines.append(
                f"| {track} | {link} | {origin} | {summary.get('n', '?')} | "
                f"{'—' if loss is None else f'{loss:.4f}'}{step} | {'—' if time is None else f'{time:.3f}'} | "
                f"{_cell(str(results.get('hardware', '?')))} |"
            )
    return "\n".join(lines)


def render_block(block: str, records_root: Path, readme_dir: Path) -> str:
    if block in ("track1", "track2"):
        return render_timed(int(block[-1]), records_root, readme_dir)
    if block == "track3":
        return render_track3(records_root, readme_dir)
    return render_folders(records_root, readme_dir)


def marked_blocks(text: str) -> list[str]:
    return [block for block in BLOCKS if start_marker(block) in text]


def read_readme(readme: Path) -> str:
    return read_utf8(readme, f"{SAVE_AS_UTF8}, or restore it from git")


def _holds_markers(readme: Path) -> bool:
    """Whether the file holds a start marker; read as bytes, so that a README without markers is never decoded: its
    encoding is not ours to judge (the markers are ASCII)."""
    data = read_bytes(readme)
    return any(start_marker(block).encode() in data for block in BLOCKS)


def replace_blocks(text: str, readme: Path, records_root: Path) -> str:
    """The README text with every marked block regenerated (text outside the markers untouched)."""
    for block in marked_blocks(text):
        start, end = start_marker(block), end_marker(block)
        head, _, rest = text.partition(start)
        if end not in rest:
            raise RecordsError(f"{readme}: {start} has no matching {end}; add the end marker")
        _, _, tail = rest.partition(end)
        body = render_block(block, records_root, readme.parent)
        text = f"{head}{start}\n{body}\n{end}{tail}"
    return text


def find_marked_readmes(repo_root: Path, unreadable: list[str] | None = None) -> list[Path]:
    """The README.md files that hold markers. One that cannot be read may hold some: its line is an error, or, when the
    caller collects them in `unreadable` (check, among its problems), goes there (as parse.find_logs does)."""
    found = []
    for directory, subdirs, files in os.walk(repo_root):
        subdirs[:] = sorted(d for d in subdirs if d not in SKIP_DIRS and not d.startswith("."))
        readme = Path(directory) / "README.md"
        try:
            if "README.md" in files and _holds_markers(readme):
                found.append(readme)
        except RecordsError as exc:
            if unreadable is None:
                raise
            unreadable.append(str(exc))
    return sorted(found)


def changed_blocks(old: str, new: str) -> list[str]:
    """The marked blocks whose text differs between two versions of a README."""
    def body(text: str, block: str) -> str:
        return text.partition(start_marker(block))[2].partition(end_marker(block))[0]
    return [block for block in marked_blocks(new) if body(old, block) != body(new, block)]


def write_tables(repo_root: Path, records_root: Path, rerun: str = "rerun `records tables --write`",
                 untouched: str = "no README was changed") -> list[tuple[Path, list[str]]]:
    """Regenerate the marked blocks of every README; return each changed file with the blocks that changed.

    The READMEs are replaced all together or not at all (folders.replace_files); a README that cannot be written is a
    RecordsError naming it and the reason, then saying `rerun` and (`untouched`)."""
    changed, texts = [], {}
    for readme in find_marked_readmes(repo_root):
        old = read_readme(readme)
        new = replace_blocks(old, readme, records_root)
        if new != old:
            texts[readme] = new
            changed.append((readme, changed_blocks(old, new)))
    replace_files(texts, rerun, untouched)
    return changed
