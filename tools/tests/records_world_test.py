"""The records tool on published folders as they are: one test per way it used to give a confident wrong answer
(synthetic logs in each era's format; the numbers are made up unless a comment says otherwise)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import records_fixtures as F
from records_fixtures import root  # noqa: F401  (a fixture)

from recordkit.cli import main
from recordkit.errors import RecordsError
from recordkit.extract import extract_sources
from recordkit.newrecord import create_record
from recordkit.parse import parse_log, parse_text
from recordkit.runsets import load_logs

DATE = __import__("datetime").date(2026, 11, 30)


def run_cli(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    code = main(argv)
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def track2_folder(directory: Path, losses: tuple[float, ...] = (2.91850, 2.91862, 2.91841)) -> Path:
    for i, loss in enumerate(losses):
        F.write(directory / f"{i}.txt", F.track2_2025(final_loss=loss, final_ms=1041071 + 100 * i, seed=i))
    return directory


# ----- tracks are told from the log -----


def test_track2_logs_are_judged_against_2_92(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    folder = track2_folder(tmp_path / "medium", (2.9250, 2.9262, 2.9241))  # below 3.28, above 2.92
    code, out, _ = run_cli(["stats", str(folder)], capsys)
    assert code == 0 and out.startswith("configuration: track 2, code ")
    assert "one-sided t-test H1 mean < 2.92" in out and "passes: no" in out and "passes: yes" not in out
    code, _, err = run_cli(["stats", str(folder), "--track", "1"], capsys)
    assert code == 2 and "no Track 1 runs" in err and "found Track 2 logs" in err and "pass another --track" in err


def test_each_era_tells_its_track(tmp_path: Path) -> None:
    cases = {
        "2024-10/11": (F.track1_2024_leading(), 1),
        "2024-12": (F.track1_2024_12(), 1),
        "2025+": (F.track1_2025(), 1),
        "track2": (F.track2_2025(), 2),
        "harness": (F.harness(), 1),
        "track3": (F.track3_trials(F.SHAMPOO_TRIALS, extra_columns=True), 3),
        "fixed stop": (F.track3_fixed_stop(3.2778), 3),
        "llm.c": (F.llmc(), None),
        "console": (F.track1_2025().split(F.SEP)[-1], None),
    }
    for era, (text, track) in cases.items():
        run = parse_text(text, tmp_path / f"{era}.txt")[0]
        assert run.track == track, (era, run.track_reason)


def test_a_log_that_does_not_say_its_track_asks_for_track(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    log = F.write(tmp_path / "main.log", F.llmc())
    code, _, err = run_cli(["stats", str(log)], capsys)
    assert code == 2 and err.count("\n") == 1
    assert "the track cannot be told from the log (no embedded code" in err and "pass --track 1 or --track 2" in err
    code, out, _ = run_cli(["stats", str(log), "--track", "1"], capsys)
    assert code == 0 and "configuration: track 1 (--track)" in out


def test_allow_mixed_never_pools_two_tracks(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    track2_folder(tmp_path / "logs")
    F.write(tmp_path / "logs" / "small.txt", F.track1_2025())
    code, _, err = run_cli(["stats", str(tmp_path / "logs"), "--allow-mixed"], capsys)
    assert code == 2 and "--allow-mixed pools configurations of one track" in err and "pass --track N" in err
    code, out, _ = run_cli(["stats", str(tmp_path / "logs"), "--allow-mixed", "--track", "2"], capsys)
    assert code == 0 and "n=3" in out


# ----- runs are counted once -----


def test_final_val_loss_files_are_not_runs(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    folder = tmp_path / "trustlight"
    for seed, loss in enumerate([3.27761, 3.27822, 3.27870, 3.27901]):
        text = F.track3_trials([{3100: loss + 0.001, 3125: loss, 3150: loss - 0.0005, 3175: loss - 0.001}], total=3175)
        F.write(folder / f"seed_{seed}" / "stdout.txt", text)
        F.write(folder / f"seed_{seed}" / "final_val_loss.txt", text.splitlines()[-1] + "\n")
    code, out, _ = run_cli(["stats", str(folder)], capsys)
    assert code == 0 and "n=4" in out and "n=8" not in out
    assert out.count("(a copy of part of that run); not a run of its own") == 4


def test_the_same_run_given_twice_counts_once_with_a_note(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    log = F.write(tmp_path / "a" / "run.txt", F.track1_2025())
    F.write(tmp_path / "b" / "copy.txt", log.read_text())
    code, out, _ = run_cli(["stats", str(tmp_path / "a"), str(tmp_path / "b")], capsys)
    assert code == 0 and "n=1" in out and "same val lines (losses and times) as run.txt; counted once" in out


def test_run_ids_seeds_and_log_paths_never_split_a_configuration(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    # Record 2026-02-10 (ShortWindow): 15 logs whose scripts differ only in `run_id: str = "..._<k>"`.
    for i in range(6):
        text = F.track1_2025(final_loss=3.2780 + i / 1e4, seed=i).replace(
            "    val_loss_every: int = 125\n", f'    val_loss_every: int = 125\n    run_id: str = "ShortWindow_{i // 3}_{i % 3}"\n'
        ).replace("def main():\n", f'SEED = {i}\nLOG_DIR = "logs_v{i}"\n\n\ndef main():\n    print("run {i}", LOG_DIR)\n')
        F.write(tmp_path / f"Short-Window_{i}.txt", text)
    loaded = load_logs([tmp_path])
    assert len(loaded.groups) == 1 and len(loaded.groups[0].runs) == 6
    code, out, _ = run_cli(["stats", str(tmp_path)], capsys)
    assert code == 0 and out.startswith("configuration: ") and "n=6" in out


def test_a_split_names_the_flag_and_verbose_says_where(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    F.write(tmp_path / "a.txt", F.track1_2025())
    F.write(tmp_path / "b.txt", F.track1_2025(lr=0.06, final_loss=3.2788))
    code, out, _ = run_cli(["stats", str(tmp_path)], capsys)
    assert code == 0 and "configuration 1 of 2" in out
    assert "note: 2 configurations (they differ in code (" in out and "--allow-mixed pools those of one track, -v says where" in out
    code, out, _ = run_cli(["stats", str(tmp_path), "-v"], capsys)
    assert "code differs from configuration 1 at train script line 9: `    learning_rate: float = 0.05` -> `    learning_rate: float = 0.06`" in out


def test_a_track3_run_that_stops_where_its_script_says_is_complete(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    # Track 3 #45 stopped at 2720 of 2900 by STOP_STEP; the claim was 2720 steps, n = 10.
    losses = [3.27788, 3.27834, 3.27801, 3.27811, 3.27890, 3.27922, 3.27851, 3.27869, 3.27905, 3.27889]
    for seed, loss in enumerate(losses):
        F.write(tmp_path / f"{seed}.txt", F.track3_fixed_stop(final_loss=loss, seed=seed))
    code, out, _ = run_cli(["stats", str(tmp_path)], capsys)
    assert code == 0 and "n=10  val loss at step 2720" in out
    assert "complete: stops at step 2720 of 2900, fixed by STOP_STEP in its script" in out
    assert "claim step: 2720 (first passing step over shared steps: 2720)" in out and "passes: yes" in out
    stopped_by_hand = F.track3_fixed_stop(final_loss=3.2778).replace('"2720"))', '"2900"))')  # the script says 2900
    (run,) = parse_text(stopped_by_hand, tmp_path / "x.txt")
    assert run.status == "truncated: last val 2720/2900"


# ----- new files only records -----


def test_new_refuses_track2_logs_filed_as_track1(root: Path, tmp_path: Path) -> None:
    folder = track2_folder(tmp_path / "medium")
    with pytest.raises(RecordsError, match=r"0\.txt \(and 2 more\): a Track 2 log \(model width 1024 in its code \(GPT-2 medium\)\), "
                                           r"not Track 1; pass --track 2"):
        create_record(root / "records", 1, "Medium", [folder], date=DATE)
    created = create_record(root / "records", 2, "Medium", [folder], date=DATE)
    assert json.loads((created / "results.json").read_text())["summary"]["passes"] is True


def test_new_refuses_a_claim_that_fails_its_rule(root: Path, tmp_path: Path) -> None:
    # Track 1 #13 (2024-11-24): seven logs with p = 0.0415, filed as a record before.
    losses = [3.2733, 3.2745, 3.2790, 3.2760, 3.2801, 3.2833, 3.2776]
    logs = [F.write(tmp_path / f"{i}.txt", F.track1_2024_leading(final_loss=loss, final_ms=279500 + 50 * i)) for i, loss in enumerate(losses)]
    with pytest.raises(RecordsError, match=r"does not pass the Track 1 rule \(p = 0\.\d+ ≥ 0\.01 .*\); pass --not-a-record"):
        create_record(root / "records", 1, "WindowWarmup", logs, date=DATE)
    folder = create_record(root / "records", 1, "WindowWarmup", logs, date=DATE, not_a_record=True)
    assert json.loads((folder / "results.json").read_text())["record"] is False


def test_new_reads_hardware_from_a_table_printed_without_nvidia_smi(root: Path, tmp_path: Path) -> None:
    log = F.write(tmp_path / "m0.txt", F.track2_2025(smi="library"))
    (run,) = parse_log(log)
    assert run.env.hardware == "8× NVIDIA H100 80GB HBM3"
    F.write(tmp_path / "m1.txt", F.track2_2025(smi="library", final_loss=2.91862, seed=1))
    folder = create_record(root / "records", 2, "Library", [tmp_path / "m0.txt", tmp_path / "m1.txt"], date=DATE)
    assert json.loads((folder / "results.json").read_text())["hardware"] == "8× NVIDIA H100 80GB HBM3"
    unknown = [F.write(tmp_path / "none" / f"{i}.txt", F.track2_2025(smi="none", final_loss=2.9185 + i / 1e4, seed=i)) for i in range(2)]
    with pytest.raises(RecordsError, match=r"0\.txt: its log names no GPU .* \(and 1 more\): not a Track 2 record; pass --not-a-record"):
        create_record(root / "records", 2, "Unknown", unknown, date=DATE)


def test_new_refuses_gpus_of_two_kinds(root: Path, tmp_path: Path) -> None:
    mixed = F.track1_2025().replace("|   7  NVIDIA H100 80GB HBM3      ", "|   7  NVIDIA A100-SXM4-80GB      ")
    logs = [F.write(tmp_path / f"{i}.txt", mixed.replace("val_loss:3.2792", f"val_loss:{3.2770 + i / 1e4:.4f}")) for i in range(3)]
    with pytest.raises(RecordsError, match="ran on GPUs of different kinds"):
        create_record(root / "records", 1, "Mixed", logs, date=DATE)


def test_new_readme_says_imported_logs_are_not_this_repositorys(root: Path, tmp_path: Path) -> None:
    folder = create_record(root / "records", 2, "Imported", [track2_folder(tmp_path / "m")], date=DATE)
    readme = (folder / "README.md").read_text()
    assert "this repository's scripts did not write" in readme and "runs of this repository's code" not in readme
    ours = [F.write(tmp_path / "ours" / f"{i}.txt", F.harness(final_loss=3.2770 + i / 1e4)) for i in range(3)]
    readme = (create_record(root / "records", 1, "Ours", ours, date=DATE) / "README.md").read_text()
    assert "runs of this repository's code" in readme


# ----- extract is byte-exact -----


def test_extract_gives_back_each_embedded_file_byte_for_byte(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    script = F.script(1680, 0.05)
    log = F.write(tmp_path / "log.txt", F.track1_2025())
    written = extract_sources(log, tmp_path / "out" / "train_gpt.py").written
    assert [path.read_bytes() for path in written] == [script.encode(), F.KERNELS.encode()]  # no leading blank line
    bad = F.track1_2025().encode().replace(b"A stand-in training script.", b"A stand-in \xff\xfe script\r.")
    F.write(tmp_path / "bad.txt", bad)
    code, out, err = run_cli(["extract", str(tmp_path / "bad.txt"), "-o", str(tmp_path / "b" / "train_gpt.py")], capsys)
    assert code == 0 and out.count("wrote ") == 2
    assert (tmp_path / "b" / "train_gpt.py").read_bytes() == script.encode().replace(b"A stand-in training script.", b"A stand-in \xff\xfe script\r.")
    assert err == (f"warning: {tmp_path / 'bad.txt'}: the embedded code holds 2 byte(s) that are not valid UTF-8, written back "
                   "unchanged; Python will refuse the file until they are fixed\n")


# ----- the validation set: the targets are losses on FineWeb's first 10,485,760 validation tokens -----

PROXY = {"val_files": ".proxy/docs_val_*.bin", "val_tokens": 1572864}
PROXY_LINE = "the validation set is not FineWeb's (val_files '.proxy/docs_val_*.bin', val_tokens 1572864)"


def proxy_track3(directory: Path, losses: tuple[float, ...] = (3.2342, 3.1956), settings: dict[str, object] = PROXY) -> list[Path]:
    return [F.write(directory / f"p{i}.txt", F.harness(final_loss=loss, shampoo=True, seconds=True, settings={**settings, "seed": i}))
            for i, loss in enumerate(losses)]


def test_a_proxy_validation_set_is_not_judged_by_the_record_rule(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    logs = proxy_track3(tmp_path / "proxy")
    code, out, _ = run_cli(["stats", *map(str, logs)], capsys)
    assert code == 0 and f"rule not applied: {PROXY_LINE}; the 3.28 target is a loss on FineWeb's first 10,485,760" in out
    assert "passes:" not in out
    code, out, _ = run_cli(["stats", *map(str, logs), "--json"], capsys)
    (report,) = json.loads(out)["configurations"]
    assert report["passes"] is None and report["rule_not_applied"] == PROXY_LINE
    fineweb = proxy_track3(tmp_path / "fineweb", settings={"val_files": "data/fineweb10B/fineweb_val_*.bin", "val_tokens": 10485760})
    code, out, _ = run_cli(["stats", *map(str, fineweb)], capsys)
    assert "passes: yes" in out and "rule not applied" not in out
    fewer = proxy_track3(tmp_path / "fewer", settings={"val_files": "data/fineweb10B/fineweb_val_*.bin", "val_tokens": 4096})
    assert "rule not applied: the validation set is not FineWeb's (val_files 'data/fineweb10B/fineweb_val_*.bin', val_tokens 4096)" \
        in run_cli(["stats", *map(str, fewer)], capsys)[1]


def test_the_repository_proxy_folder_is_not_judged_by_the_record_rule(capsys: pytest.CaptureFixture[str]) -> None:
    folder = F.REPO / "records/track_3_optimization/results/20261130_h200_docs_proxy_shampoo_150"
    code, out, _ = run_cli(["stats", str(folder)], capsys)
    assert code == 0 and f"rule not applied: {PROXY_LINE}" in out and "passes: yes" not in out


def test_logs_that_name_no_validation_setting_keep_the_rule(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    for i, loss in enumerate([3.2770, 3.2775, 3.2780, 3.2772]):  # published-era logs print no val_files / val_tokens
        F.write(tmp_path / "runs" / f"{i}.txt", F.track1_2025(final_loss=loss, seed=i))
    code, out, _ = run_cli(["stats", str(tmp_path / "runs")], capsys)
    assert code == 0 and "passes: yes (p = " in out and "rule not applied" not in out


def test_diff_of_proxy_logs_against_a_fineweb_record_says_the_losses_are_not_comparable(tmp_path: Path,
                                                                                       capsys: pytest.CaptureFixture[str]) -> None:
    proxy = proxy_track3(tmp_path / "proxy", losses=(3.2600, 3.2610))
    record = [F.write(tmp_path / "record" / f"r{i}.txt", F.harness(final_loss=3.2775 + i / 1e4, shampoo=True, seconds=True,
                                                                    settings={"seed": i})) for i in range(2)]
    code, out, _ = run_cli(["diff", *map(str, proxy), "--against", str(record[0].parent)], capsys)
    assert code == 0 and "significantly better" not in out
    assert f"pairwise: not computed: the losses are not comparable: new runs: {PROXY_LINE}; record: FineWeb's (or not logged)" in out
    assert "(rule not applied: another validation set)" in out
    t1 = [F.write(tmp_path / "t1" / f"{i}.txt", F.harness(final_loss=3.2600 + i / 1e4, settings={**PROXY, "seed": i})) for i in range(2)]
    t1_record = [F.write(tmp_path / "t1r" / f"{i}.txt", F.harness(final_loss=3.2780 + i / 1e4, settings={"seed": i})) for i in range(2)]
    code, out, _ = run_cli(["diff", *map(str, t1), "--against", str(t1_record[0].parent)], capsys)
    assert code == 0 and "Welch" not in out
    assert f"time to 3.28: not compared: the losses are not comparable: new runs: {PROXY_LINE}" in out
    assert "loss rule of the new runs (mean < 3.28, p < 0.01): rule not applied (" in out


def test_compare_of_proxy_logs_with_fineweb_logs_says_not_comparable_instead_of_any_loss_verdict(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    proxy = proxy_track3(tmp_path / "proxy", losses=(3.2600, 3.2610))
    fineweb = [F.write(tmp_path / "fineweb" / f"r{i}.txt", F.harness(final_loss=3.2775 + i / 1e4, shampoo=True, seconds=True,
                                                                      settings={"seed": i})) for i in range(2)]
    code, out, _ = run_cli(["compare", "--baseline", str(fineweb[0].parent), "--candidate", str(proxy[0].parent),
                            "--track", "3"], capsys)
    assert code == 0 and "significant" not in out
    (line,) = [line for line in out.splitlines() if line.startswith("track 3 pairwise")]
    assert line == (f"track 3 pairwise: not computed: the losses are not comparable: candidate: {PROXY_LINE}; "
                    "baseline: FineWeb's (or not logged)")
    (loss_line,) = [line for line in out.splitlines() if line.startswith("loss ")]
    assert loss_line == f"loss  not compared: the losses are not comparable: candidate: {PROXY_LINE}; baseline: FineWeb's (or not logged)"
    assert "val loss at matched steps" not in out and "Welch p" not in loss_line
    code, out, _ = run_cli(["compare", "--baseline", str(fineweb[0].parent), "--candidate", str(proxy[0].parent),
                            "--track", "3", "--json"], capsys)
    (result,) = json.loads(out)["comparisons"]
    assert set(result["loss"]) == {"not_comparable"} and result["matched_steps"] == []
    assert result["track3"]["passes"] is None and result["track3"]["value"] is None
    assert result["track3"]["not_comparable"] == f"the losses are not comparable: candidate: {PROXY_LINE}; baseline: FineWeb's (or not logged)"
    other_proxy = proxy_track3(tmp_path / "proxy2", losses=(3.2605, 3.2615))
    code, out, _ = run_cli(["compare", "--baseline", str(proxy[0].parent), "--candidate", str(other_proxy[0].parent), "--track", "3"],
                           capsys)
    assert code == 0 and "not comparable" not in out and "track 3 pairwise: baseline " in out  # one validation set on both sides


def test_new_refuses_proxy_logs_as_a_record(root: Path, tmp_path: Path) -> None:
    logs = proxy_track3(tmp_path / "proxy")
    with pytest.raises(RecordsError, match=r"p0\.txt: the validation set is not FineWeb's .* \(and 1 more\): not a Track 3 record; "
                                           r"pass --not-a-record"):
        create_record(root / "records", 3, "proxy_run", logs, date=DATE)
    folder = create_record(root / "records", 3, "proxy_run", logs, date=DATE, not_a_record=True)
    results = json.loads((folder / "results.json").read_text())
    assert results["summary"]["passes"] is None and results["summary"]["rule_not_applied"] == PROXY_LINE
    assert f"- rule not applied ({PROXY_LINE};" in (folder / "README.md").read_text()
    assert "**rule not applied**" in (folder / "statistics.md").read_text()


# ----- a run that stopped on an error, and what makes a copy -----

EXHAUSTED = ("error: training data exhausted after 34 batches (1 files from the --train_files pattern); add shards or pass "
             "--cycle_train_files=true for small proxy datasets")


def failed_smoke(final_ms: int = 6000) -> str:
    """A smoke run of train_gpt.py that stopped at step 3 of 6: its step-0 val line, a train line, the script's error line."""
    complete = F.harness(final_loss=3.9, steps=6, final_ms=final_ms)
    kept = [line for line in complete.splitlines() if not line.startswith(("step:3/", "step:6/", "peak memory"))]
    return "\n".join(kept + [EXHAUSTED]) + "\n"


def test_a_run_that_stopped_on_an_error_says_so_and_is_not_a_copy(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    F.write(tmp_path / "smoke" / "ok.txt", F.harness(final_loss=3.9, steps=6, final_ms=6000))
    F.write(tmp_path / "smoke" / "failed.txt", failed_smoke())
    code, out, _ = run_cli(["stats", str(tmp_path / "smoke")], capsys)
    assert code == 0 and "n=1" in out
    assert f"note: failed.txt: stopped: {EXHAUSTED} (last val 0/6); excluded (pass --allow-incomplete to include it)" in out
    assert "a copy of part of that run" not in out
    (run,) = parse_log(tmp_path / "smoke" / "failed.txt")
    assert run.stopped_by == EXHAUSTED and not run.complete
    code, _, err = run_cli(["stats", str(tmp_path / "smoke" / "failed.txt")], capsys)
    assert code == 2 and f"no complete run left (failed.txt: stopped: {EXHAUSTED}" in err


def test_shared_val_lines_make_a_copy_only_within_one_configuration(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    full = F.harness(final_loss=3.2795, lr=0.05)
    F.write(tmp_path / "a" / "full.txt", full)
    head = full[: full.rindex("step:1680/1680 val_loss")]  # the same run cut before its last val line
    F.write(tmp_path / "a" / "cut.txt", head)
    loaded = load_logs([tmp_path / "a"])
    assert any("cut.txt: its 2 val line(s) all appear in full.txt" in note for note in loaded.notes)
    other = F.harness(final_loss=3.2795, lr=0.07)  # another learning rate whose val lines (made up) happen to agree
    F.write(tmp_path / "b" / "full.txt", full)
    F.write(tmp_path / "b" / "other_cut.txt", other[: other.rindex("step:1680/1680 val_loss")])
    loaded = load_logs([tmp_path / "b"])
    assert not any("a copy of part of that run" in note for note in loaded.notes)
    assert len(loaded.groups) == 2


def test_the_folder_table_does_not_call_imported_logs_ours(root: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    create_record(root / "records", 2, "Imported", [track2_folder(tmp_path / "m")], date=DATE)
    code, out, _ = run_cli(["--root", str(root), "tables", "--block", "folders"], capsys)
    row = next(line for line in out.splitlines() if "2026-11-30_Imported" in line)
    assert code == 0 and "| logs in this folder |" in row and "our logs" not in out
