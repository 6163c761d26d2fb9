"""Reading the files of records/; the text files (results.json, README.md, statistics.md, history.csv, published_logs.csv)
are UTF-8.

Each way such a file can be bad is one RecordsError line naming the file, what is wrong and what to do, never a
traceback: a byte that is not UTF-8 (a file saved by an editor in another encoding, a stray byte), a file or a folder on
its path that the tool may not read (mode 000), a CSV row with more or fewer cells than its header.
"""

from __future__ import annotations

import csv
import io
import stat
from pathlib import Path

from .errors import RecordsError

SAVE_AS_UTF8 = "save it as UTF-8"


def cannot_read(path: Path, exc: OSError) -> RecordsError:
    """The one line for a file or folder that is there but cannot be read (no permission, an I/O error)."""
    return RecordsError(f"{path}: cannot read ({exc.strerror or exc}); check its permissions")


def read_bytes(path: Path) -> bytes:
    """The file's bytes; a file that is there but cannot be read is cannot_read's line. A missing file still raises
    FileNotFoundError: each caller says what its absence means (read_results: recreate the folder)."""
    try:
        return path.read_bytes()
    except FileNotFoundError:
        raise
    except OSError as exc:
        raise cannot_read(path, exc) from None


def is_file(path: Path) -> bool:
    """Whether `path` is a file, as Path.is_file tells, except that a folder on its path that may not be searched (mode
    000) is cannot_read's line naming that folder: pathlib raises PermissionError there (Python 3.11) or answers False,
    which would report a file as missing that is only hidden."""
    mode = _mode(path)
    return mode is not None and stat.S_ISREG(mode)


def is_folder(path: Path) -> bool:
    """Whether `path` is a folder, as Path.is_dir tells; a folder on its path that may not be searched as for is_file."""
    mode = _mode(path)
    return mode is not None and stat.S_ISDIR(mode)


def exists(path: Path) -> bool:
    """Whether anything is at `path`, as Path.exists tells; a folder on its path that may not be searched as for is_file."""
    return _mode(path) is not None


def _mode(path: Path) -> int | None:
    try:
        return path.stat().st_mode
    except (FileNotFoundError, NotADirectoryError):
        return None
    except PermissionError as exc:  # stat needs no permission on the path itself: its folder is the one to fix
        raise cannot_read(path.parent, exc) from None


def folder_entries(folder: Path) -> list[Path]:
    """The folder's entries, sorted; a folder that cannot be listed (mode 000) is cannot_read's line."""
    try:
        return sorted(folder.iterdir())
    except OSError as exc:
        raise cannot_read(folder, exc) from None


def read_utf8(path: Path, fix: str, translate_newlines: bool = True) -> str:
    """The file's text as `open(encoding="utf-8")` reads it (with `translate_newlines` False: as `newline=""` does, for
    csv); one RecordsError line naming the file, the line of the first byte that is not UTF-8, and `fix`."""
    data = read_bytes(path)
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        line = data.count(b"\n", 0, exc.start) + 1
        raise RecordsError(f"{path}: not UTF-8 text (byte 0x{data[exc.start]:02x} on line {line}); {fix}") from None
    return text.replace("\r\n", "\n").replace("\r", "\n") if translate_newlines else text


def csv_rows(path: Path, text: str, columns: tuple[str, ...], restore: str) -> list[tuple[int, dict[str, str]]]:
    """The rows of a CSV file's `text` (blank lines skipped) with the line each ends on, each cell under its header's name;
    the header must name `columns`. A row with more or fewer cells than the header is one line naming it (csv.DictReader
    fills missing cells with None, a traceback further on, and drops extra ones without a word); `restore` is the command
    that brings the file back."""
    reader = csv.reader(io.StringIO(text, newline=""))
    try:
        header = next(reader, [])
        missing = [column for column in columns if column not in header]
        if missing:
            raise RecordsError(f"{path}: missing column {missing[0]!r}; restore the header line ({restore})")
        rows = []
        for cells in reader:
            if cells and len(cells) != len(header):
                raise RecordsError(f"{path}: line {reader.line_num} has {len(cells)} cell(s), and the header {len(header)}; "
                                   f"fix that row, or restore the file ({restore})")
            if cells:
                rows.append((reader.line_num, dict(zip(header, cells))))
    except csv.Error as exc:  # a cell over csv's field size limit
        raise RecordsError(f"{path}: line {reader.line_num} is not a CSV row ({exc}); fix it, or restore the file ({restore})") from None
    return rows
