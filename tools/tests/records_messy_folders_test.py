"""Real-world folders: each test rebuilds one situation a submitter met, with synthetic logs, and checks the behaviour.

Situations: published logs whose scripts differ only in a docstring; runs differing in a runtime-only
setting; Track 1 and Track 3 logs sharing logs/; statistics.md written unasked; diverged runs; runs that
failed at start; bytes of garbage in front of a val line; `diff` against a record without logs; `new` fed
a CPU run; verdicts without reasons; subcommands without help.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import records_fixtures as F
from records_fixtures import REPO, root  # noqa: F401  (root: a fixture)

from recordkit.check import check_all
from recordkit.cli import build_parser, main
from recordkit.newrecord import create_record
from recordkit.runsets import load_logs

# Record 2025-09-23 (MuonCustomSizing): its four published final losses and times, and four wordings of one docstring.
MUON_LOSSES = [3.2792, 3.2792, 3.2801, 3.2799]
MUON_TIMES = [149.686, 149.678, 149.775, 149.623]
MUON_DOCS = ["Train GPT-2 124M on FineWeb.", "Train GPT-2 (124M) on FineWeb.", "Trains GPT-2 124M on FineWeb.",
             "Train GPT-2 124M on FineWeb 10B."]
PROXY_150 = REPO / "records" / "track_3_optimization" / "results" / "20261130_h200_docs_proxy_shampoo_150"
F_DATE = __import__("datetime").date(2026, 11, 30)


def muon_folder(directory: Path) -> Path:
    for i, (loss, seconds, doc) in enumerate(zip(MUON_LOSSES, MUON_TIMES, MUON_DOCS)):
        F.write(directory / f"{i}.txt", F.track1_2025(final_loss=loss, final_ms=round(seconds * 1000), seed=i, doc=doc))
    return directory


def shampoo_log(loss: float, streams: int, log_dir: str, **extra: object) -> str:
    """A train_gpt_shampoo.py log on one H200 (Track 3 lines), with its runtime settings in the hyperparameters line."""
    settings = {"train_steps": 150, "shampoo_root_streams": streams, "log_dir": log_dir, **extra}
    return F.harness(final_loss=loss, steps=150, final_ms=213340, gpus=1, device="1x NVIDIA H200", shampoo=True,
                     seconds=True, settings=settings)


def run_cli(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    code = main(argv)
    captured = capsys.readouterr()
    return code, captured.out, captured.err


# ----- same code means same program -----


def test_published_logs_differing_in_a_docstring_are_one_configuration(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    folder = muon_folder(tmp_path / "MuonCustomSizing")
    loaded = load_logs([folder])
    (group,) = loaded.groups
    assert len({fact.code_hash for fact in group.runs}) == 4  # four texts ...
    assert len({fact.run.program_hash for fact in group.runs if fact.run}) == 1  # ... one program
    code, out, err = run_cli(["stats", str(folder), "--track", "1"], capsys)
    assert (code, err) == (0, "")
    assert "val_loss     mean 3.27960" in out and "train_time_s mean 149.690" in out and "p = 0.0933" in out
    assert "note: code differs only in comments, docstrings or per-run literals (4 texts of one program)" in out


def test_a_real_code_change_is_still_another_configuration(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    folder = muon_folder(tmp_path / "runs")
    F.write(folder / "changed.txt", F.track1_2025(lr=0.06))
    code, out, _ = run_cli(["stats", str(folder), "--track", "1"], capsys)
    assert code == 0
    assert out.count("configuration 1 of 2: track 1, code ") == 1 and "configuration 2 of 2: " in out
    assert "n=4" in out and "n=1" in out


def test_runtime_only_settings_do_not_split_a_configuration(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    F.write(tmp_path / "a.txt", shampoo_log(3.23421, streams=8, log_dir="/tmp/runs/shK"))
    F.write(tmp_path / "b.txt", shampoo_log(3.19563, streams=1, log_dir="/tmp/runs/sh1", checkpoint_every=50))
    code, out, _ = run_cli(["stats", str(tmp_path), "--track", "3"], capsys)
    assert code == 0 and out.startswith("configuration: track 3, code ") and "n=2" in out
    # --shampoo_root_memory_fraction=inf is logged as the bare name inf, which must still parse
    F.write(tmp_path / "inf.txt", shampoo_log(3.2, streams=8, log_dir="/tmp/runs/inf", shampoo_root_memory_fraction=float("inf")))
    code, out, _ = run_cli(["stats", str(tmp_path), "--track", "3"], capsys)
    assert code == 0 and out.startswith("configuration: track 3, code ") and "n=3" in out
    (tmp_path / "inf.txt").unlink()
    code, out, _ = run_cli(["compare", "--baseline", str(tmp_path / "a.txt"), "--candidate", str(tmp_path / "b.txt")], capsys)
    assert code == 0 and "track 3: baseline n=1, candidate n=1" in out
    F.write(tmp_path / "c.txt", shampoo_log(3.2, streams=8, log_dir="/tmp/runs/x", matrix_lr=0.002))  # this one does change results
    code, out, _ = run_cli(["stats", str(tmp_path), "--track", "3"], capsys)
    assert code == 0 and "configuration 2 of 2: track 3" in out and "matrix_lr=" in out


def test_our_shampoo_150_folder_is_one_configuration(capsys: pytest.CaptureFixture[str]) -> None:
    logs = sorted(PROXY_150.glob("*.txt"))
    assert len(logs) == 2  # the two runs differ in shampoo_root_streams (8 and 1)
    for argv in (["stats", str(PROXY_150)], ["stats", *map(str, logs), str(PROXY_150 / "console")]):
        code, out, err = run_cli(argv, capsys)
        assert (code, err) == (0, "")
        assert out.startswith("configuration: track 3, code ") and "n=2" in out and "mean 3.21492" in out


# ----- mixed folders are grouped -----


def mixed_logs(directory: Path, run: int = 0) -> Path:
    """What the README's two CPU smoke runs leave in logs/: a Track 1 log (ms) and a Track 3 log (seconds); another
    `run` of the same configurations took a second longer (other bytes: one log on both sides of a compare is refused)."""
    F.write(directory / "t1.txt", F.harness(final_loss=2.93, steps=32, final_ms=145354 + 1000 * run, device="cpu", smi=False))
    F.write(directory / "t3.txt", F.harness(final_loss=4.69931, steps=20, final_ms=27791 + 1000 * run, device="cpu", smi=False,
                                            seconds=True, settings={"matrix_optimizer": "shampoo"}))
    return directory


def test_mixed_logs_folder_gives_one_block_per_configuration(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    logs = mixed_logs(tmp_path / "logs")
    code, out, err = run_cli(["stats", str(logs)], capsys)
    assert (code, err) == (0, "")
    assert "configuration 1 of 2: track 1, code " in out and ", CPU, 1 process, 32 steps" in out
    assert "configuration 2 of 2: track 3, code " in out and ", CPU, 1 process, 20 steps" in out
    code, out, err = run_cli(["stats", str(logs), "--track", "1"], capsys)
    assert (code, err) == (0, "")
    assert out.startswith("configuration: track 1") and "track 1  n=1" in out and "track 3" not in out
    assert "note: 1 configuration(s) of another track not shown (--track 1); drop --track to see them" in out
    code, out, _ = run_cli(["stats", str(logs), "--json"], capsys)
    assert [report["track"] for report in json.loads(out)["configurations"]] == [1, 3]


def test_compare_of_mixed_folders_pairs_configurations_of_one_track(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    base, cand = mixed_logs(tmp_path / "base"), mixed_logs(tmp_path / "cand", run=1)
    code, out, _ = run_cli(["compare", "--baseline", str(base), "--candidate", str(cand), "--json"], capsys)
    assert code == 0
    comparisons = json.loads(out)["comparisons"]
    assert [c["track"] for c in comparisons] == [1, 3]
    assert all(c["baseline"]["configuration"] == c["candidate"]["configuration"] for c in comparisons)
    code, out, _ = run_cli(["compare", "--baseline", str(base), "--candidate", str(cand), "--track", "3"], capsys)
    assert code == 0 and out.startswith("baseline: track 3, code ") and "comparison 2 of" not in out


def test_error_lines_stay_short_and_verbose_gives_the_detail(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    logs = mixed_logs(tmp_path / "logs")
    many = tmp_path / "many"
    for i in range(30):  # 30 configurations (one step count each): the old message listed them all
        F.write(many / f"run_with_a_long_descriptive_name_{i:02d}.txt", F.track1_2025(steps=1500 + i))
    cases = [
        ["--root", str(tmp_path), "new", "--track", "1", "--name", "Mixed", "--logs", str(logs), "--not-a-record"],
        ["--root", str(tmp_path), "new", "--track", "1", "--name", "Many", "--logs", str(many)],
        ["stats", str(tmp_path / "logs" / "t3.txt"), "--track", "1"],
        ["stats", str(many), "--md"],
    ]
    for argv in cases:
        code, _, err = run_cli(argv, capsys)
        assert code == 2 and err.count("\n") == 1 and len(err) < 200, err
    code, _, err = run_cli(["--root", str(tmp_path), "new", "--track", "1", "--name", "Many", "--logs", str(many), "--verbose"], capsys)
    lines = err.splitlines()
    assert code == 2 and lines[0].startswith("records: error: 30 configurations in these logs") and len(lines) == 31
    assert all(line.startswith("  track 1, code ") for line in lines[1:])


# ----- nothing written unasked -----


def test_stats_writes_statistics_md_only_when_asked_and_never_over_a_users_file(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    folder = muon_folder(tmp_path / "runs")
    before = sorted(p.name for p in folder.iterdir())
    assert run_cli(["stats", str(folder)], capsys)[0] == 0
    assert sorted(p.name for p in folder.iterdir()) == before
    md = folder / "statistics.md"
    code, out, _ = run_cli(["stats", str(folder), "--md"], capsys)
    assert code == 0 and out.endswith(f"wrote {md}\n")
    code, out, _ = run_cli(["stats", str(folder), "--md"], capsys)
    assert code == 0 and out.endswith(f"unchanged {md}\n")
    edited = md.read_text() + "\nOur own remark about these runs.\n"
    md.write_text(edited)
    code, _, err = run_cli(["stats", str(folder), "--md"], capsys)
    assert code == 2 and "was not written by this tool or was edited since; pass --force" in err
    assert md.read_text() == edited  # the user's line survives
    code, out, _ = run_cli(["stats", str(folder), "--md", "--force"], capsys)
    assert code == 0 and out.endswith(f"replaced {md}\n") and "Our own remark" not in md.read_text()
    foreign = F.write(tmp_path / "notes.md", "# my notes\n")
    assert run_cli(["stats", str(folder), f"--md={foreign}"], capsys)[0] == 2
    assert foreign.read_text() == "# my notes\n"


@pytest.mark.parametrize("given", ["folder", "files"])
def test_stats_md_force_never_replaces_a_log_it_read(tmp_path: Path, given: str, capsys: pytest.CaptureFixture[str]) -> None:
    """--force lets --md replace a file the tool did not write; a mistyped --md naming a log replaced that log."""
    folder = muon_folder(tmp_path / "runs")
    log = folder / "1.txt"
    before = {path: path.read_bytes() for path in folder.iterdir()}
    inputs = [str(folder)] if given == "folder" else [str(path) for path in sorted(folder.iterdir())]
    code, _, err = run_cli(["stats", *inputs, "--md", str(log), "--force"], capsys)
    assert code == 2 and err == (f"records: error: {log}: one of the logs these statistics were read from; "
                                 "pass another --md FILE (nothing written)\n")
    assert {path: path.read_bytes() for path in folder.iterdir()} == before


# ----- bad logs -----


def test_diverged_run_is_reported_excluded_and_never_crashes(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    folder = muon_folder(tmp_path / "t1")
    F.write(folder / "nan.txt", F.track1_2025(diverge_at=1000))  # other people's scripts keep logging nan to the end
    code, out, _ = run_cli(["stats", str(folder), "--track", "1"], capsys)
    assert code == 0 and "n=4" in out and "mean 3.27960" in out
    assert "note: nan.txt: diverged at step 1000; excluded (pass --allow-incomplete to include it)" in out
    code, out, _ = run_cli(["stats", str(folder), "--track", "1", "--allow-incomplete"], capsys)
    assert code == 0 and "n=5" in out and "nan.txt" in out and "mean nan" not in out
    assert "nan.txt: diverged at step 1000; included at its last usable val line, step 875" in out

    t3 = tmp_path / "t3"
    for i, loss in enumerate([3.2770, 3.2772]):
        F.write(t3 / f"{i}.txt", shampoo_log(loss, streams=8, log_dir="x"))
    F.write(t3 / "nan.txt", F.harness(steps=150, gpus=1, device="1x NVIDIA H200", shampoo=True, seconds=True, diverge_at=75,
                                      settings={"train_steps": 150, "shampoo_root_streams": 8, "log_dir": "x"}))
    code, out, _ = run_cli(["stats", str(t3), "--track", "3"], capsys)
    assert code == 0 and "n=2" in out and "nan.txt: diverged at step 75; excluded" in out
    other = F.write(tmp_path / "t3_other" / "0.txt", shampoo_log(3.2774, streams=8, log_dir="x"))
    code, out, _ = run_cli(["compare", "--baseline", str(t3), "--candidate", str(other)], capsys)
    assert code == 0
    root = tmp_path / "repo"
    code, out, _ = run_cli(["--root", str(root), "new", "--track", "3", "--name", "nan_run", "--date", "2026-11-30", "--logs", str(t3)], capsys)
    assert code == 0 and "left out: nan.txt: diverged at step 75; excluded" in out


def test_an_inf_loss_is_a_divergence_like_nan(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Python formats an overflowed loss as inf, and our scripts log that line before they stop; it was read as a
    damaged line ("cut short or malformed") instead of a divergence."""
    folders = {}
    for word in ("nan", "inf"):
        folders[word] = muon_folder(tmp_path / word)
        F.write(folders[word] / "diverged.txt", F.track1_2025(diverge_at=1000).replace("val_loss:nan", f"val_loss:{word}"))
    reports = []
    for word, folder in folders.items():
        code, out, _ = run_cli(["stats", str(folder), "--track", "1"], capsys)
        assert code == 0
        reports.append(out.replace(str(folder), "FOLDER"))
    assert reports[1] == reports[0]
    assert "note: diverged.txt: diverged at step 1000; excluded (pass --allow-incomplete to include it)" in reports[1]


def test_header_only_and_garbled_logs_are_skipped_or_warned_and_the_rest_used(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    folder = muon_folder(tmp_path / "runs")
    F.write(folder / "failed_at_start.txt", F.header_only(F.track1_2025()))
    F.write(folder / "notes.log", "not a log at all\n")
    code, out, _ = run_cli(["stats", str(folder), "--track", "1"], capsys)
    assert code == 0 and "n=4" in out
    assert (f"note: skipped {folder / 'failed_at_start.txt'}: source and environment only, no step line "
            "(the run stopped before training); not a usable log") in out
    assert f"note: skipped {folder / 'notes.log'}: no val line" in out

    garbled_text = F.track1_2025(final_loss=3.2790)
    garbled = F.write(folder / "garbled.txt", F.with_garbage_before_final_val(garbled_text))
    line = 1 + next(i for i, text in enumerate(garbled_text.splitlines()) if text.startswith("step:1680/1680 val_loss"))
    code, out, _ = run_cli(["stats", str(folder), "--track", "1"], capsys)
    assert code == 0
    warning = next(text for text in out.splitlines() if text.startswith("note: warning:"))
    # the garbage holds no newline, so the val line keeps its line number; some garbage bytes split lines for Python,
    # which would only move it down
    assert warning.startswith(f"note: warning: {garbled}: line ")
    assert int(warning.split("line ")[1].split(":")[0]) >= line
    assert "characters of other data (binary garbage?); not used" in warning
    assert "garbled.txt: damaged: last val 1625/1680, line " in out


# ----- diff and new -----


def test_diff_prefers_a_newer_record_folder_of_ours_and_says_why(root: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    # The published prior record (#89, 07/17/26) is older than this folder: the folder is used, nothing is fetched.
    logs = [F.write(tmp_path / "new" / f"{i}.txt", F.harness(final_loss=3.279, lr=0.06)) for i in range(2)]
    base = [F.write(tmp_path / "base" / f"b{i}.txt", F.harness(final_loss=3.2770 + i / 1e4)) for i in range(3)]
    folder = create_record(root / "records", 1, "Baseline", base, date=F_DATE)
    create_record(root / "records", 1, "OursOnly", [F.write(tmp_path / "o.txt", F.harness(final_loss=3.27))],
                  date=F_DATE.replace(month=12, day=1), not_a_record=True)  # newer, but our own results
    code, out, _ = run_cli(["--root", str(root), "diff", *map(str, logs), "--source-url", "http://127.0.0.1:9"], capsys)
    assert code == 0
    assert out.splitlines()[0] == (f"against {folder}: the newest Track 1 record: a folder of ours with logs, filed on 2026-11-30, "
                                   "newer than the published Track 1 #89 (2026-07-17_FP8DownProjection/this_pr, 07/17/26)")
    assert "  learning_rate: 0.05 -> 0.06" in out


def test_new_refuses_hardware_that_cannot_make_the_record(root: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    cpu = F.write(tmp_path / "smoke.txt", F.harness(device="cpu", smi=False, steps=32, final_loss=2.93))
    two = F.write(tmp_path / "two.txt", F.harness(gpus=2, device="2x NVIDIA H200"))
    base = ["--root", str(root), "new", "--track", "1", "--date", "2026-11-30", "--logs"]
    code, _, err = run_cli([*base, str(cpu), "--name", "Smoke"], capsys)
    assert code == 2 and "smoke.txt: ran on the CPU: not a Track 1 record; pass --not-a-record" in err
    code, _, err = run_cli([*base, str(two), "--name", "Two"], capsys)
    assert code == 2 and "two.txt: ran on 2 GPUs, Track 1 records run on 8: not a Track 1 record; pass --not-a-record" in err
    assert not any((root / "records" / "track_1_short").glob("2026-11-30_*"))
    code, out, _ = run_cli([*base, str(cpu), "--name", "Smoke", "--not-a-record"], capsys)
    assert code == 0 and "(our own results, not a record)" in out
    assert f"updated {root / 'records' / 'README.md'}: folders table (record folders)" in out
    t3 = F.write(tmp_path / "t3.txt", F.harness(device="cpu", smi=False, seconds=True))
    code, _, err = run_cli(["--root", str(root), "new", "--track", "3", "--name", "cpu_t3", "--logs", str(t3)], capsys)
    assert code == 2 and "ran on the CPU: not a Track 3 record" in err


def test_round_trip_new_check_stats_md_with_diverged_and_header_only_logs(root: Path, tmp_path: Path,
                                                                         capsys: pytest.CaptureFixture[str]) -> None:
    logs = tmp_path / "logs"
    for i, loss in enumerate([3.2779, 3.2781, 3.2776]):
        F.write(logs / f"run{i}.txt", F.harness(final_loss=loss, final_ms=150000 + 50 * i))
    F.write(logs / "diverged.txt", F.harness(diverge_at=840))
    F.write(logs / "failed_at_start.txt", F.header_only(F.harness()))
    argv = ["--root", str(root), "new", "--track", "1", "--name", "RoundTrip", "--date", "2026-11-30", "--logs", str(logs)]
    code, out, _ = run_cli(argv, capsys)
    assert code == 0
    folder = root / "records" / "track_1_short" / "2026-11-30_RoundTrip"
    assert sorted(p.name for p in folder.glob("*.txt")) == ["run0.txt", "run1.txt", "run2.txt"]
    assert "left out: diverged.txt: diverged at step 840; excluded" in out and "left out: skipped " in out
    readme = (folder / "README.md").read_text()
    assert "diverged.txt: diverged at step 840" in readme and "failed_at_start.txt: source and environment only" in readme
    assert check_all(root, root / "records") == []
    statistics = (folder / "statistics.md").read_text()
    code, out, _ = run_cli(["stats", str(folder), "--md"], capsys)
    assert code == 0 and out.endswith(f"unchanged {folder / 'statistics.md'}\n")
    assert (folder / "statistics.md").read_text() == statistics
    assert check_all(root, root / "records") == []


# ----- verdicts and help -----


def student_t_cdf(t: float, df: int, steps: int = 200_000) -> float:
    """CDF of Student's t by the midpoint rule on its density (an independent check of scipy)."""
    density = math.gamma((df + 1) / 2) / (math.sqrt(df * math.pi) * math.gamma(df / 2))
    low = -60.0
    width = (t - low) / steps
    return sum(density * (1 + ((low + (i + 0.5) * width) ** 2) / df) ** (-(df + 1) / 2) for i in range(steps)) * width


def test_verdict_says_why_and_how_many_more_runs(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run_cli(["stats", str(REPO / "records" / "track_1_short" / "2025-09-23_MuonCustomSizing")], capsys)
    assert code == 0
    verdict = next(line for line in out.splitlines() if line.startswith("passes:"))
    assert verdict == ("passes: no (p = 0.0933 ≥ 0.01 with n = 4; the rule needs more runs or a lower mean; "
                       "about 7 more runs at this spread would reach p < 0.01)")
    mean, n = sum(MUON_LOSSES) / 4, 4
    sd = math.sqrt(sum((x - mean) ** 2 for x in MUON_LOSSES) / (n - 1))
    p_at = {m: student_t_cdf((mean - 3.28) / (sd / math.sqrt(m)), m - 1) for m in (10, 11)}
    assert p_at[10] >= 0.01 > p_at[11]  # 11 runs = 4 + 7 is the first count that passes
    folder = tmp_path / "high"
    for i, loss in enumerate([3.2805, 3.2810]):
        F.write(folder / f"{i}.txt", F.track1_2025(final_loss=loss, seed=i))
    out = run_cli(["stats", str(folder)], capsys)[1]
    assert "the mean 3.28075 is not below 3.28: more runs cannot pass, the mean must go down" in out
    t3 = tmp_path / "t3"
    F.write(t3 / "log.txt", F.track3_trials([{4150: 3.2785}, {4150: 3.2790}]))
    out = run_cli(["stats", str(t3)], capsys)[1]
    # margin (3.28 − 3.27875)·√2 = 0.00177 < 0.004; ceil((0.004 / 0.00125)²) = ceil(10.24) = 11 runs in all
    assert "passes: no ((3.28 − mean)·√n = 0.00177 < 0.004 at step 4150 with n = 2; about 9 more runs at this mean would pass (n = 11))" in out


def test_every_subcommand_has_a_description_and_an_example() -> None:
    parser = build_parser()
    subparsers = next(action for action in parser._actions if action.dest == "command").choices
    assert set(subparsers) == {"parse", "stats", "compare", "diff", "new", "extract", "fetch", "index", "check", "tables"}
    for name in subparsers:
        help_text = subparsers[name].format_help()  # what `records NAME --help` prints
        description = help_text.split("\n\n")[1]
        assert len(description.split()) >= 25, (name, description)
        assert f"examples:\n  python tools/records.py {name}" in help_text, name



def test_cpu_runs_of_one_and_two_processes_are_two_configurations(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """The reduction order differs with the process count, as with the GPU count: smoke runs are not pooled across it."""
    one = F.harness(final_loss=8.2562, steps=6, final_ms=10000, device="cpu", smi=False, settings={"seed": 0})
    F.write(tmp_path / "one.txt", one)
    F.write(tmp_path / "two.txt", one.replace("world_size: 1", "world_size: 2").replace("val_loss:8.2562", "val_loss:8.2563"))
    code, out, err = run_cli(["stats", str(tmp_path)], capsys)
    assert (code, err) == (0, "")
    assert ", CPU, 1 process, 6 steps" in out and ", CPU, 2 processes, 6 steps" in out and "configuration 2 of 2" in out


def test_identical_seeded_runs_are_called_what_they_are(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Two runs of one seed repeat each other by construction: the note says so instead of guessing."""
    run = F.harness(final_loss=8.2562, steps=6, final_ms=10000, device="cpu", smi=False, settings={"seed": 0})
    F.write(tmp_path / "a.txt", run)
    F.write(tmp_path / "b.txt", run.replace("train_time:10000ms", "train_time:10500ms"))
    code, out, err = run_cli(["stats", str(tmp_path)], capsys)
    assert code == 0
    assert "identical val-loss trajectory to a.txt (both seeded with seed=0" in out and "(same seed?" not in out
