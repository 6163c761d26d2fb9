"""The text files of records/ (results.json, README.md, statistics.md, history.csv, published_logs.csv) are UTF-8.

A byte that is not (a file saved by an editor in another encoding, a stray byte) is one RecordsError line naming the
file, where the byte is and what to do, instead of a UnicodeDecodeError traceback.
"""

from __future__ import annotations

from pathlib import Path

from .errors import RecordsError

SAVE_AS_UTF8 = "save it as UTF-8"


def read_utf8(path: Path, fix: str, translate_newlines: bool = True) -> str:
    """The file's text as `open(encoding="utf-8")` reads it (with `translate_newlines` False: as `newline=""` does, for
    csv); one RecordsError line naming the file, the line of the first byte that is not UTF-8, and `fix`."""
    data = path.read_bytes()
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        line = data.count(b"\n", 0, exc.start) + 1
        raise RecordsError(f"{path}: not UTF-8 text (byte 0x{data[exc.start]:02x} on line {line}); {fix}") from None
    return text.replace("\r\n", "\n").replace("\r", "\n") if translate_newlines else text
