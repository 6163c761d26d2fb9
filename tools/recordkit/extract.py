"""`extract`: write the script embedded in a log (and the files appended after it) back to disk, byte for byte.

The extra files land next to the script at their logged relative paths, e.g.
`distributed_shampoo/shampoo.py` beside `train_gpt_shampoo.py`, so the extracted script runs as is. Bytes
that are not valid UTF-8 are written back unchanged (decoded and encoded with `surrogateescape`), and counted.
"""

from __future__ import annotations

import hashlib
import io
import os
import re
import sys
import tokenize
import warnings
from dataclasses import dataclass
from pathlib import Path, PurePosixPath

from .errors import RecordsError
from .folders import file_in_the_way
from .parse import Layout, log_lines, parse_environment, parse_text, read_log_bytes, source_first_lines, split_layout, split_sources

# surrogateescape maps each byte that is not valid UTF-8 to one code point in this range, and back.
_ESCAPED_BYTES = range(0xDC80, 0xDD00)


@dataclass(frozen=True)
class Extraction:
    written: list[Path]
    invalid_bytes: int  # bytes that are not valid UTF-8, kept as they were
    python_unchecked: str | None = None  # the log's Python where it is newer than this one: its code was not compiled


def extraction_plan(log: Path, output: Path) -> dict[Path, str]:
    """Each embedded file's path and text (bytes that are not UTF-8 shown as U+FFFD); bench/ab.py writes these."""
    return {path: content.decode("utf-8", errors="replace") for path, content in file_plan(log, output).items()}


def file_plan(log: Path, output: Path) -> dict[Path, bytes]:
    """Each embedded file's path and exact bytes."""
    data = read_log_bytes(log)
    text = data.decode("utf-8", errors="surrogateescape")
    parse_text(data.decode("utf-8", errors="replace"), log, hashlib.sha256(data).hexdigest())  # refuses a file that is no log
    sources = split_sources(split_layout(log_lines(text)).code_text)
    if not sources:
        raise RecordsError(f"{log}: no embedded source (a console capture or an llm.c log?); extract from the run's log file instead")
    plan: dict[Path, bytes] = {}
    for name, source in sources.items():
        content = source.encode("utf-8", errors="surrogateescape")
        if name == "__script__":
            plan[output] = content
            continue
        relative = PurePosixPath(name)
        if relative.is_absolute() or ".." in relative.parts:
            raise RecordsError(f"{log}: embedded file name {name!r} points outside the output folder; not extracted")
        plan[output.parent / Path(*relative.parts)] = content
    return plan


def script_path(text: str) -> Path:
    """-o as typed: Path() drops a trailing slash, and `-o out/` would write the script as the file `out` and its appended
    files into the folder above; an empty -o would be the current folder."""
    if not text:
        raise RecordsError("-o '': empty; pass -o FILE, the path the script is written to (e.g. -o repro/train_gpt.py)")
    path = Path(text)
    if text.endswith(("/", os.sep)) or path.is_dir():
        raise RecordsError(f"-o {text}: names a folder; pass -o {text.rstrip('/' + os.sep)}/train_gpt.py, the path the "
                           "script is written to (its appended files go next to it; nothing was written)")
    return path


def invalid_byte_count(content: bytes) -> int:
    return sum(1 for char in content.decode("utf-8", errors="surrogateescape") if ord(char) in _ESCAPED_BYTES)


def extract_sources(log: Path, output: Path) -> Extraction:
    """Write every embedded file; refuse before writing anything if one of them already exists, or a file stands where
    one of their folders should be."""
    plan = file_plan(log, output)
    unchecked = _refuse_broken_python(log, output)
    _refuse_blocked(plan)
    for path, content in plan.items():
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise _cannot_write(path, exc) from None
        try:
            with path.open("xb") as handle:
                handle.write(content)
        except FileExistsError:  # created since the check above
            raise RecordsError(f"{path}: appeared while extracting; extract into an empty folder") from None
        except OSError as exc:
            raise _cannot_write(path, exc) from None
    return Extraction(list(plan), sum(invalid_byte_count(content) for content in plan.values()), unchecked)


def logged_python(layout: Layout) -> tuple[int, int] | None:
    """The (major, minor) of the `Running Python X.Y...` line, if the log has one."""
    match = re.match(r"(\d+)\.(\d+)", parse_environment(layout.env_lines, layout.step_lines).python or "")
    return (int(match[1]), int(match[2])) if match else None


def _refuse_broken_python(log: Path, output: Path) -> str | None:
    """Refuse a log whose embedded script (or an appended .py file) does not compile: its code section was cut short or
    damaged while the rest of the log followed, and the file written would not run, so it reproduces nothing. Code of a
    newer Python than this one may use syntax this one lacks (3.12's f-strings in 3.11): there only what looks like a
    cut (looks_cut) is refused, and the log's Python is returned when an error was let through."""
    data = read_log_bytes(log)
    layout = split_layout(log_lines(data.decode("utf-8", errors="replace")))
    python = logged_python(layout)
    newer = python is not None and python > sys.version_info[:2]
    starts = source_first_lines(layout.code_text)
    unchecked = None
    for name, source in split_sources(layout.code_text).items():
        if name != "__script__" and not name.endswith(".py"):
            continue
        problem = _compile_problem(source, output if name == "__script__" else output.parent / name)
        if problem is None:
            continue
        message, line_in_file = problem
        lines_in_file = line_count(source)
        if newer and message != NUL_PROBLEM and not looks_cut(message, line_in_file, lines_in_file):
            cut = cut_in_tokens(source)  # compile() names only the first error: newer syntax can hide a cut after it
            if cut is None:
                unchecked = ".".join(map(str, python))
                continue
            message, line_in_file = cut
        line = layout.code_start + starts[name] + min(max(line_in_file, 1), lines_in_file)  # 1-based, in the log
        what = "the embedded script" if name == "__script__" else f"the embedded file {name}"
        raise RecordsError(f"{log}: {what} breaks at line {line} of the log ({message}): cut short or damaged, it would not run; "
                           "extract from an intact log of the run (nothing was written)")
    return unchecked


def line_count(source: str) -> int:
    """Lines in the source, a last one without a newline included (at least 1: compile() names line 1 of an empty file)."""
    return max(source.count("\n") + (not source.endswith("\n")), 1)


NUL_PROBLEM = "a NUL byte"  # no Python takes one in source


def looks_cut(message: str, line_in_file: int, lines_in_file: int) -> bool:
    """A compile error that a file cut short gives, in any Python: at its last line, or a bracket or string left open."""
    return line_in_file >= lines_in_file or any(sign in message for sign in ("never closed", "unterminated", "unexpected EOF"))


def cut_in_tokens(source: str) -> tuple[str, int] | None:
    """A cut that this Python's tokenizer sees through syntax it cannot compile (it reads 3.12's f-strings as strings):
    a bracket or string still open at the end, or a last line that opens a block; with the file's last line."""
    last = line_count(source)
    try:
        for _ in tokenize.generate_tokens(io.StringIO(source).readline):
            pass
    except tokenize.TokenError as error:  # "EOF in multi-line statement" / "... string"
        return str(error.args[0]), last
    except SyntaxError:  # an indentation or character this Python rejects: newer syntax or damage, not told apart here
        return None
    lines = [line for line in source.splitlines() if line.strip() and not line.lstrip().startswith("#")]
    if lines and lines[-1].rstrip().endswith(":"):
        return "a block opened on the last line", last
    return None


def _compile_problem(source: str, path: Path) -> tuple[str, int] | None:
    """Why the source does not compile and on which of its lines (1-based), or None."""
    if "\0" in source:  # compile() refuses NUL bytes with a ValueError (3.10) or a SyntaxError without a line (3.11)
        return NUL_PROBLEM, source.count("\n", 0, source.index("\0")) + 1
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # SyntaxWarnings (an invalid escape) are the script's business, not extract's
        try:
            compile(source, str(path), "exec")
        except SyntaxError as error:
            return error.msg, error.lineno or 1
    return None


def _refuse_blocked(plan: dict[Path, bytes]) -> None:
    existing = [path for path in plan if path.exists()]
    if existing:
        raise RecordsError(f"{existing[0]}: already exists; extract into an empty folder (nothing was written)")
    for path in plan:
        blocker = file_in_the_way(path.parent)  # -o FILE/t.py: mkdir would fail with FileExistsError, not a missing folder
        if blocker is not None:
            raise RecordsError(f"{path.parent}: cannot write {path.name} there ({blocker} is a file, not a folder); pass -o FILE in a "
                               "folder you can write to (nothing was written)")


def _cannot_write(path: Path, exc: OSError) -> RecordsError:
    where = exc.filename or path
    return RecordsError(f"{where}: cannot write {path.name} there ({exc.strerror}); pass -o FILE in a folder you can write to")
