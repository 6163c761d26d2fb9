"""Bad input to `python tools/records.py` is one line, exit status 2 (or one line among check's problems): a CSV row of the
wrong length, a file or folder of records/ that cannot be read, a log compared with itself, a folder of unusable logs."""

from __future__ import annotations

import csv
import datetime
import json
import os
from pathlib import Path

import pytest
import records_fixtures as F
from records_fixtures import root  # noqa: F401  (a fixture)

from recordkit.cli import main
from recordkit.newrecord import create_record
from recordkit.tables import write_tables

DATE = datetime.date(2026, 11, 30)
DENIED = "cannot read (Permission denied); check its permissions"


def run_cli(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    code = main(argv)
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def harness_logs(directory: Path, losses: list[float]) -> list[Path]:
    return [F.write(directory / f"run{i}.txt", F.harness(final_loss=loss, final_ms=150000 + 100 * i)) for i, loss in enumerate(losses)]


def files_under(path: Path) -> dict[str, bytes]:
    return {str(p.relative_to(path)): p.read_bytes() for p in sorted(path.rglob("*")) if p.is_file()}


def append_row(path: Path, row: str) -> int:
    """Append a line to a CSV file; return its line number."""
    path.write_text(path.read_text() + row + "\n")
    return len(path.read_text().splitlines())


# ----- a CSV row with too few or too many cells -----


@pytest.mark.parametrize(("history", "row", "cells", "header"), [
    ("track_1_short", "x", 1, 6),
    ("track_1_short", "99,1.5 minutes,01/01/26,a row,,,one cell too many", 7, 6),
    ("track_3_optimization", "99,3000,3.2770 (n=4)✓,2026/01/01,a row", 5, 7)])
def test_a_history_row_of_the_wrong_length_is_one_line_naming_the_file_and_line(root: Path, history: str, row: str, cells: int,
                                                                                  header: int, capsys: pytest.CaptureFixture[str]) -> None:
    # A short row drew a table from None cells (AttributeError in tables._cell); a long one lost its extra cell silently.
    path = root / "records" / history / "history.csv"
    line = append_row(path, row)
    problem = (f"{path}: line {line} has {cells} cell(s), and the header {header}; fix that row, or restore the file "
               f"(git checkout -- {path})")
    before = files_under(root)
    code, out, err = run_cli(["--root", str(root), "check"], capsys)
    assert (code, err) == (1, "") and out.splitlines() == [problem, "check: 2 record folder(s), 1 README(s) with tables: 1 problem(s)"]
    for command in (["tables"], ["tables", "--write"]):
        assert run_cli(["--root", str(root), *command], capsys) == (2, "", f"records: error: {problem}\n")
    assert files_under(root) == before


def test_a_history_cell_over_the_csv_size_limit_is_one_line(root: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = root / "records" / "track_1_short" / "history.csv"
    line = append_row(path, "99,1.5 minutes,01/01/26," + "x" * (csv.field_size_limit() + 1) + ",,")
    code, out, _ = run_cli(["--root", str(root), "check"], capsys)
    assert code == 1 and out.splitlines()[0].startswith(f"{path}: line {line} is not a CSV row (field larger than field limit")


def test_a_short_published_logs_row_is_one_line_naming_its_line(root: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    # Its missing sha256 cell was None: a TypeError in check's sha256 test.
    manifest = root / "records" / "published_logs.csv"
    first = manifest.read_text().splitlines()[1].split(",")
    line = append_row(manifest, ",".join(first[:3]))
    problem = (f"{manifest}: line {line} has 3 cell(s), and the header 4; fix that row, or restore the file "
               f"(git checkout -- {manifest}, or `records index CLONE --write`)")
    code, out, _ = run_cli(["--root", str(root), "check"], capsys)
    assert code == 1 and problem in out.splitlines()
    argv = ["--root", str(root), "fetch", "1:89", "--cache-dir", str(tmp_path / "cache"), "--source-url", "http://127.0.0.1:9"]
    assert run_cli(argv, capsys) == (2, "", f"records: error: {problem}\n")


# ----- a file or folder that cannot be read -----


def deny(monkeypatch: pytest.MonkeyPatch, locked: Path) -> None:
    """Make `locked` behave as mode 000 does for a user other than root (the tests may run as root, which ignores modes):
    reading or listing it, or looking at anything inside it, raises PermissionError."""
    real_stat, real_iterdir, real_read_bytes, real_scandir = Path.stat, Path.iterdir, Path.read_bytes, os.scandir

    def refused(path: Path) -> PermissionError:
        return PermissionError(13, "Permission denied", str(path))

    def stat(self: Path, *, follow_symlinks: bool = True) -> os.stat_result:
        if locked in self.parents:
            raise refused(self)
        return real_stat(self, follow_symlinks=follow_symlinks)

    def iterdir(self: Path) -> object:
        if self == locked or locked in self.parents:
            raise refused(self)
        return real_iterdir(self)

    def read_bytes(self: Path) -> bytes:
        if self == locked or locked in self.parents:
            raise refused(self)
        return real_read_bytes(self)

    def scandir(path: object = ".") -> object:  # os.walk's listing
        if Path(str(path)) == locked or locked in Path(str(path)).parents:
            raise refused(Path(str(path)))
        return real_scandir(path)  # type: ignore[arg-type]

    monkeypatch.setattr(Path, "stat", stat)
    monkeypatch.setattr(os, "scandir", scandir)
    monkeypatch.setattr(Path, "iterdir", iterdir)
    monkeypatch.setattr(Path, "read_bytes", read_bytes)


# What each locked path is, and the commands besides `check` that read it (`tables` reads no log).
TABLES = [["tables"], ["tables", "--write"]]
LOCKED = {"history.csv": ("track_1_short/history.csv", TABLES),
          "record folder": ("track_1_short/2025-09-23_MuonCustomSizing", TABLES),
          "track folder": ("track_3_optimization", TABLES),
          "log of a record folder": ("track_1_short/2026-11-30_Locked/run0.txt", [])}


@pytest.mark.parametrize("what", list(LOCKED))
def test_a_file_or_folder_that_cannot_be_read_is_one_line_naming_it(root: Path, tmp_path: Path, what: str,
                                                                     monkeypatch: pytest.MonkeyPatch,
                                                                     capsys: pytest.CaptureFixture[str]) -> None:
    # check and tables stopped on a PermissionError traceback (textfiles.read_utf8, pathlib's is_file or stat).
    create_record(root / "records", 1, "Locked", harness_logs(tmp_path / "logs", [3.2790, 3.2785]), date=DATE, not_a_record=True)
    write_tables(root, root / "records")
    where, readers = LOCKED[what]
    locked = root / "records" / where
    problem = f"{locked}: {DENIED}"
    before = files_under(root)
    deny(monkeypatch, locked)
    code, out, err = run_cli(["--root", str(root), "check"], capsys)
    assert (code, err) == (1, "") and out.splitlines()[0] == problem and out.count(problem) == 1
    for command in readers:
        assert run_cli(["--root", str(root), *command], capsys) == (2, "", f"records: error: {problem}\n")
    monkeypatch.undo()
    assert files_under(root) == before


@pytest.mark.skipif(not hasattr(os, "geteuid") or os.geteuid() == 0, reason="root reads a mode-000 folder")
def test_a_mode_000_record_folder_for_real(root: Path, capsys: pytest.CaptureFixture[str]) -> None:
    folder = root / "records" / "track_1_short" / "2025-09-23_MuonCustomSizing"
    folder.chmod(0)
    try:
        code, out, _ = run_cli(["--root", str(root), "check"], capsys)
        assert code == 1 and out.splitlines()[0] == f"{folder}: {DENIED}"
        assert run_cli(["--root", str(root), "tables"], capsys) == (2, "", f"records: error: {folder}: {DENIED}\n")
    finally:
        folder.chmod(0o755)


# ----- a run compared with itself -----


def test_compare_refuses_a_log_on_both_sides_as_diff_does(root: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    # `compare --baseline R --candidate R/<log>` exited 0 with a speed ratio of 1.0000x and every delta +0.00000.
    folder = create_record(root / "records", 1, "Itself", harness_logs(tmp_path / "logs", [3.2790, 3.2785]), date=DATE,
                           not_a_record=True)
    copy = F.write(tmp_path / "copy" / "same.txt", (folder / "run0.txt").read_bytes())
    for candidate in (folder / "run0.txt", copy):  # the log itself, or a copy: the same bytes
        for json_flag in ([], ["--json"]):
            code, out, err = run_cli(["compare", "--baseline", str(folder), "--candidate", str(candidate), *json_flag], capsys)
            assert (code, out) == (2, "") and err == (
                f"records: error: {candidate}: the same log (same bytes) is in both --baseline and --candidate; a comparison "
                "needs other runs on each side: pass the baseline's logs and the candidate's\n")
    code, _, err = run_cli(["diff", str(copy), "--against", str(folder)], capsys)  # the one rule, in diff's words
    assert code == 2 and f"records: error: {copy}: the same log (same bytes) is among the new runs and in --against {folder}" in err
    other = harness_logs(tmp_path / "other", [3.2780])
    code, out, _ = run_cli(["compare", "--baseline", str(folder), "--candidate", str(other[0])], capsys)
    assert code == 0 and "speed ratio" in out


# ----- a folder without a usable log -----


def test_parse_of_a_folder_whose_every_log_is_unusable_is_an_error(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    # It printed the skips alone (--json: []) and exited 0, though each log named alone is an error.
    good = F.harness()
    folder = tmp_path / "logs"
    F.write(folder / "cut.txt", good[: good.index(" val_loss:")])
    F.write(folder / "header.txt", F.header_only(good))
    problem = (f"records: error: {folder}: none of its 2 log file(s) is usable (each is skipped above, with the reason); "
               "pass a folder that holds training logs")
    for argv in (["parse", str(folder)], ["parse", str(folder), "--json"]):
        code, out, err = run_cli(argv, capsys)
        assert (code, out) == (2, "") and err.splitlines()[-1] == problem
        assert [line.split(":")[0] for line in err.splitlines()[:-1]] == [f"skipped {folder / 'cut.txt'}", f"skipped {folder / 'header.txt'}"]
    named = F.write(tmp_path / "good.txt", good)
    code, out, err = run_cli(["parse", str(named), str(folder)], capsys)  # a usable log elsewhere does not excuse the folder
    assert (code, out, err.splitlines()[-1]) == (2, "", problem)
    F.write(folder / "good.txt", good)  # one usable log: the others are skipped, as before
    code, out, err = run_cli(["parse", str(folder), "--json"], capsys)
    assert code == 0 and len(json.loads(out)) == 1 and err.count("skipped ") == 2
