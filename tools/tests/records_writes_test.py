"""`tables --write` and `new` when their own files cannot be written: a full disk, a file where a folder should be.

Each case is one error line naming the path, the reason and what to do, and leaves nothing half-written behind.
"""

from __future__ import annotations

import errno
import os
from pathlib import Path
from typing import Any

import pytest
import records_fixtures as F
from records_fixtures import root  # noqa: F401  (a fixture)

from recordkit.cli import main

NOSPACE = os.strerror(errno.ENOSPC)


def run_cli(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    code = main(argv)
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def disk_fills_while_writing(monkeypatch: pytest.MonkeyPatch, doomed: Any) -> list[Path]:
    """Writes opened through pathlib to a path for which doomed(path) is true put down half their text, then fail as a
    full disk does. Returns the paths it failed, in order."""
    real_open = Path.open
    failed: list[Path] = []

    class HalfWritten:
        def __init__(self, handle: Any, path: Path) -> None:
            self.handle, self.path = handle, path

        def write(self, text: str) -> int:
            self.handle.write(text[: len(text) // 2])
            self.handle.flush()
            failed.append(self.path)
            raise OSError(errno.ENOSPC, NOSPACE, str(self.path))

        def __getattr__(self, name: str) -> Any:
            return getattr(self.handle, name)

        def __enter__(self) -> HalfWritten:
            return self

        def __exit__(self, *exc: object) -> None:
            self.handle.close()

    def open_(self: Path, mode: str = "r", *args: Any, **kwargs: Any) -> Any:
        handle = real_open(self, mode, *args, **kwargs)
        return HalfWritten(handle, self) if ("w" in mode or "x" in mode) and doomed(self) else handle

    monkeypatch.setattr(Path, "open", open_)
    return failed


def files_under(path: Path) -> dict[str, bytes]:
    return {str(p.relative_to(path)): p.read_bytes() for p in sorted(path.rglob("*")) if p.is_file()}


def logs(directory: Path) -> list[str]:
    return [str(F.write(directory / f"{i}.txt", F.harness(final_loss=3.2790 - i / 1e4, settings={"seed": i}))) for i in range(2)]


def new_argv(root: Path, name: str, log_paths: list[str]) -> list[str]:
    return ["--root", str(root), "new", "--track", "1", "--name", name, "--date", "2026-11-30", "--not-a-record", "--logs", *log_paths]


# ----- tables --write -----


def test_tables_write_on_a_full_disk_is_one_line_and_leaves_the_readme_as_it_was(root: Path, tmp_path: Path,
                                                                                   monkeypatch: pytest.MonkeyPatch,
                                                                                   capsys: pytest.CaptureFixture[str]) -> None:
    readme = root / "records" / "README.md"
    readme.write_text(F.README)  # empty tables: --write has something to do
    before = files_under(root)
    failed = disk_fills_while_writing(monkeypatch, lambda path: path.parent == readme.parent)
    code, out, err = run_cli(["--root", str(root), "tables", "--write"], capsys)
    assert failed and code == 2 and out == "" and err.count("\n") == 1
    assert err == (f"records: error: {readme}: cannot write it ({NOSPACE}); free space on that disk, then rerun "
                   "`records tables --write` (no README was changed)\n")
    assert files_under(root) == before  # the README whole, no temporary file left beside it
    monkeypatch.undo()
    code, out, _ = run_cli(["--root", str(root), "tables", "--write"], capsys)
    assert code == 0 and f"updated {readme}" in out and readme.read_text() != F.README


def test_tables_write_keeps_the_readme_mode(root: Path, capsys: pytest.CaptureFixture[str]) -> None:
    readme = root / "records" / "README.md"
    readme.write_text(F.README)
    readme.chmod(0o640)
    assert run_cli(["--root", str(root), "tables", "--write"], capsys)[0] == 0
    assert readme.stat().st_mode & 0o777 == 0o640 and readme.read_text() != F.README
    assert [p.name for p in readme.parent.iterdir() if p.name.startswith(".")] == []


# ----- new -----


def test_new_on_a_full_disk_is_one_line_and_files_nothing(root: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                          capsys: pytest.CaptureFixture[str]) -> None:
    given = logs(tmp_path / "logs")
    before = files_under(root)
    folder = root / "records" / "track_1_short" / "2026-11-30_Full"
    failed = disk_fills_while_writing(monkeypatch, lambda path: path.name == "results.json")
    code, out, err = run_cli(new_argv(root, "Full", given), capsys)
    assert failed == [folder / "results.json"] and code == 2 and out == "" and err.count("\n") == 1
    assert err == (f"records: error: {folder / 'results.json'}: cannot write it ({NOSPACE}); free space on that disk, then "
                   "rerun `records new` (nothing was filed)\n")
    assert not folder.exists() and files_under(root) == before


def test_new_whose_readme_tables_cannot_be_written_files_nothing(root: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                                  capsys: pytest.CaptureFixture[str]) -> None:
    given = logs(tmp_path / "logs")
    before = files_under(root)
    readme = root / "records" / "README.md"
    disk_fills_while_writing(monkeypatch, lambda path: path.parent == readme.parent)
    code, out, err = run_cli(new_argv(root, "Tables", given), capsys)
    assert code == 2 and out == "" and err.count("\n") == 1
    assert err == (f"records: error: {readme}: cannot write it ({NOSPACE}); free space on that disk, then rerun "
                   "`records new` (nothing was filed)\n")
    assert files_under(root) == before and not (root / "records" / "track_1_short" / "2026-11-30_Tables").exists()


def test_new_through_a_file_where_the_track_folder_should_be_is_one_line(tmp_path: Path,
                                                                         capsys: pytest.CaptureFixture[str]) -> None:
    given = logs(tmp_path / "logs")
    fresh = tmp_path / "fresh"
    F.write(fresh / "records" / "track_1_short", "not a folder\n")
    code, out, err = run_cli(new_argv(fresh, "Blocked", given), capsys)
    folder = fresh / "records" / "track_1_short" / "2026-11-30_Blocked"
    assert code == 2 and out == "" and err.count("\n") == 1
    assert err == (f"records: error: {folder}: cannot create it (Not a directory); {fresh / 'records' / 'track_1_short'} is a file, not a folder: move it away or pass another --root, "
                        "then rerun `records new` (nothing was filed)\n")
    assert files_under(fresh) == {"records/track_1_short": b"not a folder\n"}


def test_new_in_a_root_that_is_a_file_is_one_line_and_creates_nothing(tmp_path: Path,
                                                                      capsys: pytest.CaptureFixture[str]) -> None:
    given = logs(tmp_path / "logs")
    blocker = F.write(tmp_path / "notaroot", "a file\n")
    code, out, err = run_cli(new_argv(blocker, "Blocked", given), capsys)
    assert code == 2 and out == "" and err.count("\n") == 1
    assert f"{blocker} is a file, not a folder: move it away or pass another --root" in err
    assert blocker.read_text() == "a file\n"


def test_new_in_a_fresh_root_that_fails_removes_the_folders_it_made(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                                   capsys: pytest.CaptureFixture[str]) -> None:
    given = logs(tmp_path / "logs")
    fresh = tmp_path / "fresh"
    fresh.mkdir()
    disk_fills_while_writing(monkeypatch, lambda path: path.name == "statistics.md")
    code, _, err = run_cli(new_argv(fresh, "Fresh", given), capsys)
    assert code == 2 and "statistics.md: cannot write it (" in err
    assert list(fresh.iterdir()) == []  # records/ and records/track_1_short/ were made by this `new`: gone with it


def test_stats_md_on_a_full_disk_keeps_the_old_file_whole(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                          capsys: pytest.CaptureFixture[str]) -> None:
    """`stats --md` replaces statistics.md through a temporary file beside it: a disk that fills meanwhile leaves the
    old file as it was and no temporary file."""
    runs = tmp_path / "runs"
    for seed in range(2):
        F.write(runs / f"r{seed}.txt", F.harness(final_loss=3.2775 + seed / 1e4, settings={"seed": seed}))
    assert run_cli(["stats", str(runs), "--md"], capsys)[0] == 0
    before = (runs / "statistics.md").read_text()
    F.write(runs / "r2.txt", F.harness(final_loss=3.2700, settings={"seed": 2}))  # new statistics to write
    failed = disk_fills_while_writing(monkeypatch, lambda path: path.parent == runs)
    code, _, err = run_cli(["stats", str(runs), "--md"], capsys)
    assert code == 2 and failed and err.count("\n") == 1
    assert err.startswith(f"records: error: {runs / 'statistics.md'}: cannot write it ({NOSPACE}); free space on that disk, then rerun")
    assert (runs / "statistics.md").read_text() == before
    assert sorted(path.name for path in runs.iterdir()) == ["r0.txt", "r1.txt", "r2.txt", "statistics.md"]
