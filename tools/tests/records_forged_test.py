"""Logs cannot be edited into a record, and the records tool's bad-day probes (docs/probes.md, `## records tool`):
a second val line for a step, val lines swapped, a final line out of step, a folder that cannot be read, two
`new` racing for one name, and a val line lost to garbage."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import records_fixtures as F
from records_fixtures import root  # noqa: F401  (a fixture)

from recordkit import newrecord
from recordkit.cli import main
from recordkit.errors import RecordsError
from recordkit.newrecord import create_record
from recordkit.parse import find_logs, parse_text

DATE = __import__("datetime").date(2026, 11, 30)
T3_LOSSES = [3.27823, 3.27851, 3.27845, 3.27866]  # mean 3.27846: (3.28 − mean)·√4 = 0.00308, does not pass


def run_cli(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    code = main(argv)
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def final_val_line(text: str) -> str:
    return next(line for line in reversed(text.splitlines()) if " val_loss:" in line)


def track3_folder(directory: Path) -> list[Path]:
    return [F.write(directory / f"seed{i}.txt", F.track3_trials([{4125: loss + 0.0008, 4150: loss}])) for i, loss in enumerate(T3_LOSSES)]


# ----- N33: a second val line for the final step -----


def test_a_second_final_val_line_with_a_lower_loss_is_inconsistent(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    logs = track3_folder(tmp_path / "runs")
    code, out, _ = run_cli(["stats", str(tmp_path / "runs")], capsys)
    assert code == 0 and "passes: no" in out  # the honest runs
    for log in logs:  # each log gets a second line for step 4150, 0.003 lower: the mean would pass
        text = log.read_text()
        final = final_val_line(text)
        log.write_text(text + final.replace(final.split("val_loss:")[1][:7], f"{float(final.split('val_loss:')[1][:7]) - 0.003:.5f}") + "\n")
    code, out, err = run_cli(["stats", str(tmp_path / "runs")], capsys)
    assert code == 2 and "passes: yes" not in out
    assert "no complete run left (seed0.txt: inconsistent: line " in err and "no flag includes an inconsistent log" in err
    assert "a second val line for step 4150 (first at line " in err
    (run,) = parse_text(logs[0].read_text(), logs[0])
    assert not run.complete and run.status.startswith("inconsistent: line ")


def test_an_inconsistent_log_among_good_ones_is_left_out_with_a_note(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    for i in range(3):
        F.write(tmp_path / f"{i}.txt", F.track1_2025(final_loss=3.2780 + i / 1e4, seed=i))
    forged = F.track1_2025(final_loss=3.2790, seed=7)
    F.write(tmp_path / "forged.txt", forged + final_val_line(forged).replace("val_loss:3.2790", "val_loss:3.2700") + "\n")
    code, out, _ = run_cli(["stats", str(tmp_path)], capsys)
    assert code == 0 and "n=3" in out
    assert "note: forged.txt: inconsistent: line " in out and "excluded: a log must hold what its run wrote" in out


# ----- N34: two val lines swapped -----


def test_two_swapped_val_lines_are_inconsistent_not_two_trials(tmp_path: Path) -> None:
    lines = F.track1_2025().splitlines()
    val = [i for i, line in enumerate(lines) if " val_loss:" in line]
    a, b = val[-3], val[-2]  # step 1500 and 1625: swap them
    lines[a], lines[b] = lines[b], lines[a]
    runs = parse_text("\n".join(lines) + "\n", tmp_path / "swapped.txt")
    assert len(runs) == 1  # not split into two trials
    assert f"line {b + 1}: step 1500 after step 1625 (steps out of order)" in runs[0].inconsistencies
    assert "steps out of order" in runs[0].status and not runs[0].complete


def test_a_new_trial_still_starts_where_the_steps_return_to_the_start(tmp_path: Path) -> None:
    runs = parse_text(F.track3_trials(F.SHAMPOO_TRIALS), tmp_path / "trials.txt")
    assert len(runs) == 4 and not any(run.inconsistencies for run in runs)


# ----- a final line that disagrees with the step lines -----


# The final val line of F.track1_2025(), and the train line for the same step that a real log writes before it.
FINAL = "step:1680/1680 val_loss:3.2792 train_time:149775ms step_avg:89.15ms"
TRAIN = "step:1680/1680 train_time:149700ms step_avg:89.11ms"


@pytest.mark.parametrize("edited, why", [
    ("step:1680/1680 val_loss:3.2792 train_time:139775ms step_avg:83.20ms", "below the 144.871 s of an earlier line"),
    ("step:1680/1680 val_loss:3.2792 train_time:149600ms step_avg:89.05ms", "below the 149.7 s of the train line for the same step"),
    ("step:1680/1700 val_loss:3.2792 train_time:149775ms step_avg:89.15ms", "says 1700 steps, the lines before it 1680"),
    ("step:1680/1680 val_loss:3.2792 train_time:149775ms step_avg:80.15ms", "does not follow from its train_time"),
])
def test_a_final_line_out_of_step_with_the_lines_before_it_is_inconsistent(tmp_path: Path, edited: str, why: str) -> None:
    text = F.track1_2025()
    assert final_val_line(text) == FINAL
    (run,) = parse_text(text.replace(FINAL, f"{TRAIN}\n{FINAL}"), tmp_path / "honest.txt")
    assert run.inconsistencies == [] and run.complete
    (run,) = parse_text(text.replace(FINAL, f"{TRAIN}\n{edited}"), tmp_path / "edited.txt")
    assert any(why in problem for problem in run.inconsistencies), run.inconsistencies


def test_a_track3_final_line_with_an_interval_step_avg_that_does_not_fit(tmp_path: Path) -> None:
    text = F.track3_fixed_stop(3.2778)
    final = final_val_line(text)
    faster = final.replace(final.split("train_time:")[1].split("s ")[0], "6000.000")
    (run,) = parse_text(text.replace(final, faster), tmp_path / "t3.txt")
    assert any("step_avg" in problem for problem in run.inconsistencies)



@pytest.mark.parametrize("where", ["final val line", "train line after it"])
def test_a_step_beyond_the_total_is_inconsistent_never_complete(tmp_path: Path, where: str, capsys: pytest.CaptureFixture[str]) -> None:
    text = F.harness(final_loss=3.2790, steps=6, final_ms=900, device="cpu", smi=False)
    final = final_val_line(text)
    assert final.startswith("step:6/6 val_loss:3.2790 ")
    train = "step:7/6 train_time:1050ms step_avg:150.00ms"
    beyond = final.replace("step:6/6", "step:7/6") if where == "final val line" else f"{final}\n{train}"
    log = F.write(tmp_path / "beyond.txt", text.replace(final, beyond))
    (run,) = parse_text(log.read_text(), log)
    number = log.read_text().splitlines().index(beyond.splitlines()[-1]) + 1
    assert run.inconsistencies == [f"line {number}: step 7 beyond the total of 6 steps"] and not run.complete
    code, out, err = run_cli(["stats", str(log), "--track", "1"], capsys)
    assert (code, out) == (2, "") and err.count("\n") == 1
    assert f"no complete run left (beyond.txt: inconsistent: line {number}: step 7 beyond the total of 6 steps; " in err


def test_new_refuses_an_inconsistent_log(root: Path, tmp_path: Path) -> None:
    logs = [F.write(tmp_path / f"{i}.txt", F.harness(final_loss=3.2770 + i / 1e4)) for i in range(3)]
    text = logs[1].read_text()
    logs[1].write_text(text.replace("peak memory", final_val_line(text).replace("val_loss:3.2771", "val_loss:3.2700") + "\npeak memory"))
    with pytest.raises(RecordsError, match=r"1\.txt: inconsistent: line \d+: a second val line for step 1680 .*; `new` files logs only "
                                           r"as their runs wrote them: restore it, or leave it out of --logs"):
        create_record(root / "records", 1, "Forged", logs, date=DATE)
    assert not (root / "records" / "track_1_short" / "2026-11-30_Forged").exists()


# ----- N37: a folder that cannot be read -----


def locked(monkeypatch: pytest.MonkeyPatch, folder: Path) -> None:
    """Make listing `folder` fail as a mode-000 folder does (the tests may run as root, which ignores modes)."""
    real = os.scandir

    def scandir(path: object = ".") -> object:
        if Path(str(path)) == folder:
            raise PermissionError(13, "Permission denied", str(path))
        return real(path)  # type: ignore[arg-type]

    monkeypatch.setattr(os, "scandir", scandir)


def test_an_unreadable_subfolder_is_reported_and_new_refuses(root: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                             capsys: pytest.CaptureFixture[str]) -> None:
    for i in range(3):
        F.write(tmp_path / "runs" / f"{i}.txt", F.harness(final_loss=3.2770 + i / 1e4))
    F.write(tmp_path / "runs" / "more" / "3.txt", F.harness(final_loss=3.2790))
    locked(monkeypatch, tmp_path / "runs" / "more")
    code, out, _ = run_cli(["stats", str(tmp_path / "runs")], capsys)
    assert code == 0 and "n=3" in out
    assert f"note: warning: {tmp_path / 'runs' / 'more'}: cannot be read (Permission denied); its logs were not searched" in out
    with pytest.raises(RecordsError, match=r"more: cannot be read \(Permission denied\); its logs were not searched: fix its "
                                           r"permissions \(chmod u\+rx\) or leave it out"):
        create_record(root / "records", 1, "Partial", [tmp_path / "runs"], date=DATE)
    code, _, err = run_cli(["parse", str(tmp_path / "runs")], capsys)
    assert code == 0 and "warning: " in err and "cannot be read" in err


@pytest.mark.skipif(not hasattr(os, "geteuid") or os.geteuid() == 0, reason="root reads a mode-000 folder")
def test_a_mode_000_folder_for_real(tmp_path: Path) -> None:
    F.write(tmp_path / "a.txt", F.llmc())
    hidden = tmp_path / "locked"
    F.write(hidden / "b.txt", F.llmc())
    hidden.chmod(0)
    try:
        unreadable: list[str] = []
        assert find_logs([tmp_path], unreadable) == [tmp_path / "a.txt"] and len(unreadable) == 1
    finally:
        hidden.chmod(0o755)


# ----- N39: two `new` with one name at once -----


def test_the_loser_of_two_new_with_one_name_gets_one_line(root: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                          capsys: pytest.CaptureFixture[str]) -> None:
    logs = [F.write(tmp_path / f"{i}.txt", F.harness(final_loss=3.2770 + i / 1e4)) for i in range(3)]
    target = root / "records" / "track_1_short" / "2026-11-30_Race"
    real = newrecord.refuse_failing_rule

    def the_other_process_wins(report: dict[str, object], track: int) -> None:
        real(report, track)
        target.mkdir(parents=True)  # the other `new` creates the folder between our check and our mkdir
        (target / "README.md").write_text("theirs\n")

    monkeypatch.setattr(newrecord, "refuse_failing_rule", the_other_process_wins)
    code, out, err = run_cli(["--root", str(root), "new", "--track", "1", "--name", "Race", "--date", "2026-11-30",
                              "--logs", *map(str, logs)], capsys)
    assert code == 2 and out == "" and err.count("\n") == 1
    assert "created by another process meanwhile (two `new` with one name?); nothing written" in err
    assert [p.name for p in target.iterdir()] == ["README.md"] and (target / "README.md").read_text() == "theirs\n"


# ----- O10: a val line lost to garbage -----


def test_a_val_line_lost_to_garbage_is_reported_without_verbose(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    log = F.write(tmp_path / "g.txt", F.with_garbage_before_final_val(F.track1_2025()))
    code, _, err = run_cli(["stats", str(log)], capsys)
    assert code == 2 and err.count("\n") == 1  # one line, without --verbose
    assert "g.txt: damaged: last val 1625/1680, line " in err and "val line behind 4095 characters of other data" in err
