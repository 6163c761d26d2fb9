"""`new`, `check` and the README tables, in a throw-away repository root."""

from __future__ import annotations

import datetime
import hashlib
import json
from pathlib import Path

import pytest
import records_fixtures as F
from records_fixtures import root  # noqa: F401  (a fixture)

from recordkit.check import check_all
from recordkit.cli import main
from recordkit.errors import RecordsError
from recordkit.folders import list_folders
from recordkit.newrecord import create_record
from recordkit.tables import write_tables

REPO = Path(__file__).resolve().parents[2]


def harness_logs(directory: Path, losses: list[float]) -> list[Path]:
    return [F.write(directory / f"run{i}.txt", F.harness(final_loss=loss, final_ms=150000 + 100 * i)) for i, loss in enumerate(losses)]


def test_repository_records_pass_check() -> None:
    assert check_all(REPO, REPO / "records") == []


def test_new_creates_folder_with_exact_copies(root: Path, tmp_path: Path) -> None:
    logs = harness_logs(tmp_path / "logs", [3.2790, 3.2785, 3.2788])
    folder = create_record(root / "records", 1, "H200Repro", logs, date=F_DATE, hardware=None, note="test runs")
    assert folder == root / "records" / "track_1_short" / "2026-11-30_H200Repro"
    for log in logs:
        assert (folder / log.name).read_bytes() == log.read_bytes()
    results = json.loads((folder / "results.json").read_text())
    assert results["kind"] == "ours" and results["note"] == "test runs"
    assert results["hardware"] == "8× NVIDIA H200"  # from the logs' nvidia-smi table
    assert [r["sha256"] for r in results["runs"]] == [hashlib.sha256(p.read_bytes()).hexdigest() for p in logs]
    assert results["summary"]["n"] == 3 and results["summary"]["val_loss"]["mean"] == pytest.approx(3.2787666666)
    assert (folder / "statistics.md").read_text().startswith("# Statistics: 2026-11-30_H200Repro")
    readme = (folder / "README.md").read_text()
    # mean time (150.0 + 150.1 + 150.2) / 3 s = 2.5017 minutes
    assert "the logs in this folder are ours" in readme and "| ? | 2.502 minutes | H200Repro | 11/30/26 | |" in readme
    write_tables(root, root / "records")
    assert check_all(root, root / "records") == []
    assert "2026-11-30_H200Repro" in (root / "records" / "README.md").read_text()


F_DATE = __import__("datetime").date(2026, 11, 30)


def test_new_refuses_to_overwrite(root: Path, tmp_path: Path) -> None:
    logs = harness_logs(tmp_path / "logs", [3.2790, 3.2785])
    folder = create_record(root / "records", 1, "H200Repro", logs, date=F_DATE, not_a_record=True)
    before = {p.name: p.read_bytes() for p in folder.iterdir()}
    other = harness_logs(tmp_path / "other", [3.2700, 3.2701])
    with pytest.raises(RecordsError, match="already exists; records are never overwritten"):
        create_record(root / "records", 1, "H200Repro", other, date=F_DATE, not_a_record=True)
    assert {p.name: p.read_bytes() for p in folder.iterdir()} == before


def test_new_hardware_flag_and_cpu_logs(root: Path, tmp_path: Path) -> None:
    logs = [F.write(tmp_path / f"cpu{i}.txt", F.harness(smi=False, device="cpu", final_loss=3.29 + i / 1000)) for i in range(2)]
    with pytest.raises(RecordsError, match=r"cpu0\.txt: ran on the CPU \(and 1 more\): not a Track 1 record; pass --not-a-record"):
        create_record(root / "records", 1, "CpuSmoke", logs, date=F_DATE)
    assert not (root / "records" / "track_1_short" / "2026-11-30_CpuSmoke").exists()
    folder = create_record(root / "records", 1, "CpuSmoke", logs, date=F_DATE, hardware="2-core CI VM", note="CPU smoke run",
                           not_a_record=True)
    results = json.loads((folder / "results.json").read_text())
    assert results["hardware"] == "2-core CI VM" and results["hardware_from_logs"] == ["cpu"]
    assert results["record"] is False and results["summary"]["passes"] is False
    readme = (folder / "README.md").read_text()
    assert "Our own results, not a record" in readme and "Draft table row" not in readme


def test_new_rejects_bad_name_and_truncated_only(root: Path, tmp_path: Path) -> None:
    logs = harness_logs(tmp_path / "logs", [3.279])
    with pytest.raises(RecordsError, match="CamelCase"):
        create_record(root / "records", 1, "bad_name", logs, date=F_DATE)
    truncated = F.write(tmp_path / "t.txt", F.track1_2025(with_final=False))
    with pytest.raises(RecordsError, match="no complete run left"):
        create_record(root / "records", 1, "Trunc", [truncated], date=F_DATE)
    assert not (root / "records" / "track_1_short" / "2026-11-30_Trunc").exists()


def test_new_track3_multi_trial(root: Path, tmp_path: Path) -> None:
    log = F.write(tmp_path / "shampoo.txt", F.track3_trials(F.SHAMPOO_TRIALS))
    folder = create_record(root / "records", 3, "shampoo_repro", [log], date=F_DATE)
    assert folder.name == "20261130_shampoo_repro"
    results = json.loads((folder / "results.json").read_text())
    assert [r["trial"] for r in results["runs"]] == [1, 2, 3, 4]
    assert results["summary"]["step"] == 4100 and results["summary"]["passes"] is True
    write_tables(root, root / "records")
    assert check_all(root, root / "records") == []


def test_check_finds_edited_log_stale_table_and_bad_published(root: Path, tmp_path: Path) -> None:
    logs = harness_logs(tmp_path / "logs", [3.2790, 3.2785])
    folder = create_record(root / "records", 1, "H200Repro", logs, date=F_DATE, not_a_record=True)
    # The folder is not in the README table until the tables are rewritten.
    problems = check_all(root, root / "records")
    assert len(problems) == 1 and "tables differ" in problems[0] and "tables --write" in problems[0]
    write_tables(root, root / "records")
    with (folder / "run0.txt").open("a") as handle:
        handle.write("tampered\n")
    published = root / "records" / "track_1_short" / "2025-09-23_MuonCustomSizing"
    (published / "README.md").write_text("# stripped\n")
    problems = check_all(root, root / "records")
    assert any("run0.txt: sha256 differs" in p for p in problems)
    assert any("must say its logs are not included" in p for p in problems)


def test_check_compares_history_row_with_folder(root: Path) -> None:
    results_path = root / "records" / "track_3_optimization" / "results" / "20260513_shampoo_1_4_power" / "results.json"
    results = json.loads(results_path.read_text())
    results["runs"][3]["val_losses"]["4100"] = 3.2790  # the claim would no longer hold at 4100
    results_path.write_text(json.dumps(results))
    problems = check_all(root, root / "records")
    assert any("summary" in p and "regenerate" in p for p in problems)


def test_list_folders_oldest_first(root: Path) -> None:
    assert [f.name for f in list_folders(root / "records", 1)] == ["MuonCustomSizing"]
    assert [f.name for f in list_folders(root / "records", 3)] == ["shampoo_1_4_power"]


def test_cli_new_then_check(root: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    logs = harness_logs(tmp_path / "logs", [3.2790, 3.2785])
    argv = ["--root", str(root), "new", "--track", "1", "--name", "CliRun", "--date", "2026-11-30", "--not-a-record", "--logs", *map(str, logs)]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert f"updated {root / 'records' / 'README.md'}: folders table (record folders)\n" in out
    assert main(["--root", str(root), "check"]) == 0
    assert "3 record folder(s), 1 README(s) with tables: ok" in capsys.readouterr().out
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("records: error: ") and err.count("\n") == 1 and "already exists" in err


def test_check_reports_misnamed_folder_and_missing_files(root: Path) -> None:
    (root / "records" / "track_1_short" / "my-run").mkdir()
    broken = root / "records" / "track_1_short" / "2026-01-01_Broken"
    broken.mkdir()
    (broken / "README.md").write_text("# broken\n")
    problems = check_all(root, root / "records")
    assert any("my-run: folder name does not follow the Track 1 convention" in p for p in problems)
    assert any(p.startswith(str(broken / "results.json")) and "missing" in p for p in problems)


def test_stats_on_record_folder_leaves_its_statistics_alone(root: Path, capsys: pytest.CaptureFixture[str]) -> None:
    folder = root / "records" / "track_3_optimization" / "results" / "20260513_shampoo_1_4_power"
    before = (folder / "statistics.md").read_text()
    assert main(["stats", str(folder), "--track", "3", "--step", "4150"]) == 0
    out = capsys.readouterr().out
    assert "first passing step over shared steps: 4100" in out and "margin (3.28 − mean)·√n = 0.00698" in out
    assert (folder / "statistics.md").read_text() == before


def test_tables_cli_prints_linked_rows(root: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--root", str(root), "tables", "--block", "track3"]) == 0
    out = capsys.readouterr().out
    assert "| 21 | 4100 | 3.2776 (n=4)✓ |" in out and "(track_3_optimization/results/20260513_shampoo_1_4_power/)" in out
    assert out.count("](") == 1  # only the row we have a folder for is linked


def test_new_refuses_two_logs_with_one_name(root: Path, tmp_path: Path) -> None:
    harness_logs(tmp_path / "a", [3.2790])
    harness_logs(tmp_path / "b", [3.2785])
    with pytest.raises(RecordsError, match="same file name as"):
        create_record(root / "records", 1, "Twins", [tmp_path / "a", tmp_path / "b"], date=F_DATE)
    assert not (root / "records" / "track_1_short" / "2026-11-30_Twins").exists()


def test_new_orders_runs_by_file_name_so_check_agrees(root: Path, tmp_path: Path) -> None:
    # Paths sort as a/run_b, b/run_a; the folder holds run_a, run_b; check reads the folder by file name.
    logs = [F.write(tmp_path / "b" / "run_a.txt", F.harness(final_loss=3.2790, final_ms=150000)),
            F.write(tmp_path / "a" / "run_b.txt", F.harness(final_loss=3.2700, final_ms=151000))]
    folder = create_record(root / "records", 1, "NameOrder", logs, date=F_DATE, not_a_record=True)
    assert [run["log"] for run in json.loads((folder / "results.json").read_text())["runs"]] == ["run_a.txt", "run_b.txt"]
    write_tables(root, root / "records")
    assert check_all(root, root / "records") == []


def test_check_reports_a_record_folder_whose_runs_cannot_make_a_record(root: Path, tmp_path: Path) -> None:
    cpu = [F.write(tmp_path / "cpu.txt", F.harness(smi=False, device="cpu"))]
    folder = create_record(root / "records", 1, "CpuRun", cpu, date=F_DATE, not_a_record=True)
    write_tables(root, root / "records")
    assert check_all(root, root / "records") == []
    results_path = folder / "results.json"
    results = json.loads(results_path.read_text())
    results["record"] = True  # as if someone relabelled it by hand
    results_path.write_text(json.dumps(results))
    problems = check_all(root, root / "records")
    assert problems == [f"{results_path}: marked as a record, but cpu.txt ran on the CPU; set \"record\": false (our own results)"]


def test_check_reports_a_record_folder_whose_losses_are_on_another_validation_set(root: Path, tmp_path: Path) -> None:
    proxy = {"val_files": ".proxy/docs_val_*.bin", "val_tokens": 1572864}
    logs = [F.write(tmp_path / f"p{i}.txt", F.harness(final_loss=3.2600 + i / 1e4, settings={**proxy, "seed": i})) for i in range(2)]
    folder = create_record(root / "records", 1, "ProxyRun", logs, date=F_DATE, not_a_record=True)
    write_tables(root, root / "records")
    assert check_all(root, root / "records") == []
    results = json.loads((folder / "results.json").read_text())
    results["record"] = True  # as if someone relabelled it by hand
    (folder / "results.json").write_text(json.dumps(results))
    problems = check_all(root, root / "records")
    assert f"{folder / 'results.json'}: marked as a record, but p0.txt logs its loss on another set: the validation set is not " \
           "FineWeb's (val_files '.proxy/docs_val_*.bin', val_tokens 1572864); set \"record\": false (our own results)" in problems


def test_a_root_without_records_is_refused(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    for command in (["check"], ["tables"], ["fetch", "1:89"]):
        assert main(["--root", str(tmp_path / "nonexistent"), *command]) == 2
        err = capsys.readouterr().err
        assert err == f"records: error: {tmp_path / 'nonexistent' / 'records'}: no records folder there; pass --root REPO, the checkout that holds records/\n"


@pytest.mark.parametrize("damage", ["missing", "garbled"])
def test_check_names_a_missing_or_garbled_history_first(root: Path, damage: str, capsys: pytest.CaptureFixture[str]) -> None:
    history = root / "records" / "track_3_optimization" / "history.csv"
    if damage == "missing":
        history.unlink()
    else:
        history.write_text("rslt;steps\n" + history.read_text().split("\n", 1)[1])
    assert main(["--root", str(root), "check"]) == 1
    lines = capsys.readouterr().out.splitlines()
    expected = "missing; restore it from git" if damage == "missing" else "missing column 'result'; restore the header line"
    assert lines[0].startswith(f"{history}: {expected}") and len(lines) == 2


@pytest.mark.parametrize("command", [["tables", "--write"], ["new", "--track", "1", "--name", "NoHistory", "--not-a-record",
                                     "--date", "2026-11-30", "--logs"]])
def test_a_missing_history_never_empties_its_readme_table(root: Path, tmp_path: Path, command: list[str],
                                                          capsys: pytest.CaptureFixture[str]) -> None:
    """Read as empty, a missing history.csv had `tables --write` (and `new`) replace its table with the header alone."""
    logs = [str(path) for path in harness_logs(tmp_path / "logs", [3.2790, 3.2785])] if command[0] == "new" else []
    history = root / "records" / "track_1_short" / "history.csv"
    history.unlink()
    before = files_under(root)
    assert main(["--root", str(root), *command, *logs]) == 2
    out, err = capsys.readouterr()
    assert out == "" and err == (f"records: error: {history}: missing, and the Track 1 table would lose every row; restore it "
                                 f"(git checkout -- {history}) or pass --root REPO (nothing was written)\n")
    assert files_under(root) == before


# What reads each file besides `check`; a README without markers is read by `check` only.
READERS = {"results.json": [["tables", "--write"], ["stats", "FOLDER"]], "README.md": [], "statistics.md": [],
           "history.csv": [["tables", "--write"], ["fetch", "1:89"]], "records README": [["tables", "--write"]],
           "published_logs.csv": [["fetch", "1:89"]]}


@pytest.mark.parametrize("damaged", list(READERS))
def test_a_file_that_is_not_utf8_is_one_line_naming_it(root: Path, tmp_path: Path, damaged: str,
                                                       capsys: pytest.CaptureFixture[str]) -> None:
    folder = create_record(root / "records", 1, "Latin1", harness_logs(tmp_path / "logs", [3.2790, 3.2785]), date=F_DATE,
                           not_a_record=True)
    write_tables(root, root / "records")
    path = {"history.csv": root / "records" / "track_1_short" / "history.csv", "records README": root / "records" / "README.md",
            "published_logs.csv": root / "records" / "published_logs.csv"}.get(damaged, folder / damaged)
    path.write_bytes(path.read_bytes() + "Zürich\n".encode("latin-1"))  # an editor saved it in Latin-1
    before = files_under(root)
    assert main(["--root", str(root), "check"]) == 1
    problems = [line for line in capsys.readouterr().out.splitlines() if line.startswith(f"{path}: not UTF-8 text (byte 0xfc on line ")]
    assert len(problems) == 1  # named once, though several checks read it
    for command in READERS[damaged]:
        argv = [str(folder) if arg == "FOLDER" else arg for arg in command]
        assert main(["--root", str(root), *argv, *(["--cache-dir", str(tmp_path / "cache")] if argv[0] == "fetch" else [])]) == 2
        assert capsys.readouterr().err == f"records: error: {problems[0]}\n"
    assert main(["--root", str(root), "tables", "--write"]) == (2 if ["tables", "--write"] in READERS[damaged] else 0)
    assert files_under(root) == before  # nothing rewritten


def files_under(path: Path) -> dict[str, bytes]:
    return {str(p.relative_to(path)): p.read_bytes() for p in sorted(path.rglob("*")) if p.is_file()}


@pytest.mark.parametrize(("option", "value"), [("--hardware", "8× H100\n| 9 | forged row |"), ("--note", "first line\r\nsecond"),
                                               ("--note", "red \x1b[31mtext"), ("--hardware", "8× H100\u2028SXM")])
def test_new_refuses_a_control_character_in_hardware_or_note(root: Path, tmp_path: Path, option: str, value: str,
                                                             capsys: pytest.CaptureFixture[str]) -> None:
    logs = [str(path) for path in harness_logs(tmp_path / "logs", [3.2790, 3.2785])]
    readme = root / "records" / "README.md"
    before = readme.read_bytes()
    argv = ["--root", str(root), "new", "--track", "1", "--name", "OneLine", "--date", "2026-11-30", "--not-a-record", "--logs", *logs]
    assert main([*argv, option, value]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith(f"records: error: {option} {value!r}: holds the control character ")
    assert not (root / "records" / "track_1_short" / "2026-11-30_OneLine").exists() and readme.read_bytes() == before
    assert main([*argv, "--hardware", "8× H100 | SXM5"]) == 0  # a `|` is escaped in the table, so the row stays one row
    row = next(line for line in readme.read_text().splitlines() if "2026-11-30_OneLine" in line)
    assert row.endswith("| 8× H100 \\| SXM5 |") and row.count(" | ") == 6


@pytest.mark.parametrize("recorded", ["left out", None, "abc"])
def test_check_says_a_missing_log_checksum_is_missing_not_an_edit(root: Path, tmp_path: Path, recorded: str | None) -> None:
    folder = create_record(root / "records", 1, "NoChecksum", harness_logs(tmp_path / "logs", [3.2790, 3.2785]), date=F_DATE,
                           not_a_record=True)
    write_tables(root, root / "records")
    results = json.loads((folder / "results.json").read_text())
    if recorded == "left out":
        del results["runs"][0]["sha256"]
    else:
        results["runs"][0]["sha256"] = recorded
    (folder / "results.json").write_text(json.dumps(results, indent=1, ensure_ascii=False) + "\n")
    what = "sha256 'abc' is not 64 hex digits" if recorded == "abc" else "has no sha256 of its log"
    assert check_all(root, root / "records") == [
        f"{folder / 'results.json'}: run 1 (run0.txt) {what}, so check cannot tell whether the log was edited; restore results.json "
        "from git (`records new` writes each log's sha256)"]


def test_new_refuses_a_date_in_the_future_and_takes_today(root: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    logs = [str(path) for path in harness_logs(tmp_path / "logs", [3.2790, 3.2785])]
    readme = root / "records" / "README.md"
    before = readme.read_bytes()
    argv = ["--root", str(root), "new", "--track", "1", "--name", "Dated", "--not-a-record", "--logs", *logs]
    today = datetime.date.today()
    latest = (datetime.datetime.now(datetime.timezone.utc) + datetime.timedelta(hours=14)).date()  # UTC+14's today
    for too_late in ("2999-01-01", (latest + datetime.timedelta(days=1)).isoformat()):
        assert main([*argv, "--date", too_late]) == 2
        err = capsys.readouterr().err
        assert err == (f"records: error: --date {too_late}: in the future (no time zone has reached it; the latest today is "
                       f"{latest.isoformat()}); pass the day the runs ended, today or earlier\n")
        assert not (root / "records" / "track_1_short" / f"{too_late}_Dated").exists() and readme.read_bytes() == before
    assert main([*argv, "--date", today.isoformat()]) == 0  # today (the system clock's) is allowed
    assert (root / "records" / "track_1_short" / f"{today.isoformat()}_Dated").is_dir()
    eastern = [arg if arg != "Dated" else "Eastern" for arg in argv]
    assert main([*eastern, "--date", latest.isoformat()]) == 0  # and today where it is latest: a submitter east of this machine
    assert (root / "records" / "track_1_short" / f"{latest.isoformat()}_Eastern").is_dir()


@pytest.mark.parametrize("damage", ["cut short", "deleted"])
def test_check_names_a_cut_or_missing_log_and_says_restore_it(root: Path, tmp_path: Path, damage: str) -> None:
    # The summary check parsed the logs again and its error ("no val line …; pass a training log") replaced these lines.
    # One log, as in records/track_1_short/2026-11-30_H200DocsProxy1Gpu: no run is left to compute the summary from.
    folder = create_record(root / "records", 1, "Damaged", harness_logs(tmp_path / "logs", [3.2790]), date=F_DATE,
                           not_a_record=True)
    write_tables(root, root / "records")
    log = folder / "run0.txt"
    if damage == "deleted":
        log.unlink()
    else:
        data = log.read_bytes()
        log.write_bytes(data[: data.index(b" val_loss:")])  # cut in its first val line: no val line left
    expected = (f"{log}: listed in results.json but missing; restore the log" if damage == "deleted"
                else f"{log}: sha256 differs from results.json; the log was edited: restore the original")
    problems = check_all(root, root / "records")
    assert problems[0] == expected and not any("pass a training log" in problem for problem in problems)


@pytest.mark.parametrize("cut, why", [
    ("in its script", "no val line ('step:N/T val_loss:X train_time:...' or 's:N tel:X')"),
    ("in its first val line", "source and environment only, no step line (the run stopped before training)")])
def test_check_names_a_cut_log_without_a_checksum_and_keeps_the_other_lines(root: Path, tmp_path: Path, cut: str, why: str) -> None:
    # With no sha256 to compare, the log was parsed for its values, and its parse error ("no val line …; pass a training
    # log", wrong for a record folder) replaced every line of the folder, the missing checksum's among them.
    folder = create_record(root / "records", 1, "CutNoSum", harness_logs(tmp_path / "logs", [3.2790]), date=F_DATE,
                           not_a_record=True)
    write_tables(root, root / "records")
    results = json.loads((folder / "results.json").read_text())
    del results["runs"][0]["sha256"]
    (folder / "results.json").write_text(json.dumps(results, indent=1, ensure_ascii=False) + "\n")
    log = folder / "run0.txt"
    data = log.read_bytes()
    log.write_bytes(data[:300] if cut == "in its script" else data[: data.index(b" val_loss:")])
    assert check_all(root, root / "records") == [
        f"{folder / 'results.json'}: run 1 (run0.txt) has no sha256 of its log, so check cannot tell whether the log was edited; "
        "restore results.json from git (`records new` writes each log's sha256)",
        f"{log}: the log is damaged or cut ({why}); a record folder holds its logs as their runs wrote them: restore the original"]
