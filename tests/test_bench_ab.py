"""bench/ab.py, the paired A/B timing runner: its plan and version handling on CPU, and one real (tiny) run."""

import argparse
import dataclasses
import gzip
import json
import math
import os
import re
import shutil
import statistics
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

from conftest import ROOT, import_bench_script, run_bench_script

TINY_RUN = ["--preset=smoke", "--num_iterations=6", "--iteration_extension=0", "--warmup_steps=1", "--val_tokens=2048"]
TRACK3 = ["--train-script", "train_gpt_shampoo.py"]
TINY_TRACK3_RUN = ["--preset=smoke", "--train_steps=6"]
SCALARS_RESET = "        self.scalars.copy_(Scalars.initial(self.world_size))\n"  # train_gpt.GPT.reset_parameters' line


def run_ab(*args: str, timeout: int = 120) -> subprocess.CompletedProcess:
    return run_bench_script("ab.py", *args, timeout=timeout)


@pytest.fixture
def ab(monkeypatch):
    """bench/ab.py imported as a module (it is a script, not a package)."""
    return import_bench_script(monkeypatch, "ab.py", "bench_ab")


def test_help_describes_the_method():
    result = run_ab("--help")
    assert result.returncode == 0
    for phrase in ("--baseline", "--candidate", "--nproc", "--rounds", "--dry-run", "interleaved"):
        assert phrase in result.stdout


def test_dry_run_resolves_a_revision_and_the_working_tree(tmp_path):
    result = run_ab("--dry-run", "--skip", "2", "--baseline", "HEAD", "--rounds", "2", "--out", str(tmp_path), "--", *TINY_RUN)
    assert result.returncode == 0, result.stderr
    assert "baseline: train_gpt.py at HEAD (" in result.stdout and "[resident], 6 training steps" in result.stdout
    assert "candidate: the working tree's train_gpt.py" in result.stdout
    assert "round 1 (seed 1): baseline, candidate; round 2 (seed 2): baseline, candidate" in result.stdout
    assert (tmp_path / "baseline" / "train_gpt.py").read_text() == subprocess.run(
        ["git", "show", "HEAD:train_gpt.py"], capture_output=True, text=True, cwd=ROOT
    ).stdout
    assert not list(tmp_path.glob("*.ready"))  # nothing ran


def test_dry_run_takes_a_record_folder_and_a_log(tmp_path):
    folder = ROOT / "records" / "track_1_short" / "2026-11-30_H200DocsProxy1GpuE5m2Cast"
    log = sorted(folder.glob("*.txt"))[0]
    result = run_ab("--dry-run", "--skip", "2", "--baseline", str(folder), "--candidate", str(log), "--out", str(tmp_path), "--", *TINY_RUN)
    assert result.returncode == 0, result.stderr
    assert f"baseline: the script embedded in {log}" in result.stdout
    baseline, candidate = (tmp_path / label / "train_gpt.py" for label in ("baseline", "candidate"))
    assert baseline.read_text() == candidate.read_text() and "class Hyperparameters" in baseline.read_text()


def test_a_script_without_run_and_train_is_timed_whole_run(tmp_path):
    script = tmp_path / "other.py"
    script.write_text("print('step:1/2 train_time:5ms')\n")
    result = run_ab("--dry-run", "--skip", "2", "--baseline", str(script), "--out", str(tmp_path / "out"), "--", *TINY_RUN)
    assert result.returncode == 0, result.stderr
    assert "[whole-run], unknown training steps" in result.stdout


@pytest.mark.parametrize("source, got", [
    ("import sys\nsys.exit(0)\n", "it printed nothing"),
    ("print('hello')\nraise SystemExit(0)\n", "its last line was 'hello'"),
], ids=["silent", "other-output"])
def test_a_script_that_exits_when_imported_is_one_line(tmp_path, source, got):
    """Its check printed no JSON line: an IndexError (or JSONDecodeError) traceback before."""
    script = tmp_path / "exits.py"
    script.write_text(source)
    out = tmp_path / "out"
    result = run_ab("--dry-run", "--skip", "2", "--baseline", str(script), "--out", str(out), "--", *TINY_RUN)
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert result.stderr.strip() == (
        f"bench/ab.py: error: baseline ({script}): importing {out.resolve() / 'baseline' / 'train_gpt.py'} exited with status 0 "
        f"before the check's result (a JSON line with its training steps was expected; {got}); pass a script that does not "
        "exit when imported"
    )


@pytest.mark.parametrize("flag, name", [
    ("--baseline", "{tmp}/gone.py"), ("--candidate", "{tmp}/gone.txt"), ("--baseline", "gone.log"), ("--candidate", "gone.out"),
    ("--baseline", "gone.stdout"), ("--candidate", "gone.py"), ("--baseline", "{tmp}/records/track_1_short/2026-11-30_Missing"),
    ("--candidate", "records/track_1_short/2026-11-30_Missing"),
])
def test_a_missing_script_or_log_is_named_as_a_missing_file(tmp_path, flag, name):
    """It was taken for a git revision: 'git rev-parse --short .../gone.py^{commit}: fatal: Needed a single revision';
    until now a .py or .txt name only, not a log's other suffixes or a folder's path."""
    missing = name.format(tmp=tmp_path)
    assert not (ROOT / missing).exists()
    result = run_ab("--dry-run", "--skip", "2", flag, missing, "--out", str(tmp_path / "out"), "--", *TINY_RUN)
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert result.stderr.strip() == (
        f"bench/ab.py: error: {flag} {missing}: no such file or folder, and not a git revision; pass an existing script, "
        "run log or record folder, or a git revision"
    )


@pytest.mark.parametrize("revision", ["HEAD~0", "refs/ab-test/{id}"])
def test_git_revisions_with_a_tilde_or_a_separator_are_still_revisions(tmp_path, revision):
    """Revisions that exist in any clone, shallow or detached: a ref with separators is made for the test and removed."""
    revision = revision.format(id=uuid.uuid4().hex[:8])
    made = revision.startswith("refs/")
    if made:
        subprocess.run(["git", "-C", str(ROOT), "update-ref", revision, "HEAD"], check=True)
    try:
        result = run_ab("--dry-run", "--skip", "2", "--baseline", revision, "--out", str(tmp_path), "--", *TINY_RUN)
    finally:
        if made:
            subprocess.run(["git", "-C", str(ROOT), "update-ref", "-d", revision], check=True)
    assert result.returncode == 0, result.stderr
    assert f"baseline: train_gpt.py at {revision} (" in result.stdout


def test_a_dangling_link_is_named_as_a_missing_file(tmp_path):
    """A .py link to a deleted file got git's complaint about a revision."""
    (tmp_path / "dangling.py").symlink_to(tmp_path / "deleted.py")
    result = run_ab("--dry-run", "--skip", "2", "--baseline", str(tmp_path / "dangling.py"), "--out", str(tmp_path / "out"), "--", *TINY_RUN)
    assert result.returncode == 2 and result.stderr.strip() == (
        f"bench/ab.py: error: --baseline {tmp_path / 'dangling.py'}: no such file or folder, and not a git revision; pass an "
        "existing script, run log or record folder, or a git revision"
    )


def test_a_results_file_in_the_out_folder_this_call_makes_is_accepted(tmp_path):
    """--out is made before anything runs, so --json inside it is no missing folder."""
    result = run_ab("--dry-run", "--skip", "2", "--out", str(tmp_path / "new"), "--json", str(tmp_path / "new" / "r.json"), "--", *TINY_RUN)
    assert result.returncode == 0, result.stderr


@pytest.mark.parametrize(
    "args, message",
    [
        (["--baseline", "no-such-revision"], "git rev-parse"),
        (["--nproc", "3"], "--nproc=3: use 1, 2, 4 or 8"),
        (["--skip", "6"], "--skip=6 leaves no timed steps in a 6-step run"),
        (["--", "--no_such_flag=1"], "does not accept the overrides"),
        (["--trace", "traces"], "give --profile-steps N too"),
        (["--profile-from", "3"], "--profile-from says where the profiled steps start: give --profile-steps N too"),
        (["--profile-from", "0", "--profile-steps", "1"], "--profile-from=0: give a step >= 1 (profiling starts after it)"),
        (["--profile-from", "5", "--profile-steps", "2"], "--profile-from=5 with --profile-steps=2 runs past the 6-step run; lower them"),
        (["--profile-steps", "5"], "--skip=2 (where profiling starts by default) with --profile-steps=5 runs past the 6-step run"),
        (["--time-limit", "inf"], "--time-limit=inf: give finite seconds >= 0"),
        (["--deadline", "-1"], "--deadline=-1.0: give finite seconds >= 0"),
        (["--peak-tflops", "0"], "--peak-tflops=0.0: give the GPU's bf16 rate in TFLOP/s, a finite number above 0"),
        (["--peak-tflops", "nan"], "--peak-tflops=nan: give the GPU's bf16 rate in TFLOP/s, a finite number above 0"),
        (["--rounds", "0"], "--rounds=0: give 1 to 1000"),
        (["--rounds", "1000000000"], "--rounds=1000000000: give 1 to 1000"),  # planned in memory before: killed for it
        (["--skip", "0"], "--skip=0: give 1 to 1000"),
        (["--profile-steps", "-1"], "--profile-steps=-1: give 0 to 1000"),
        (["--rounds", "x"], "argument --rounds: invalid int value: 'x'"),
        (["--baseline", ""], "--baseline is empty; pass a git revision"),
        (["--baseline", "deadbeef"], "--baseline deadbeef: not a git revision (git rev-parse"),
    ],
)
def test_bad_input_is_one_line(tmp_path, args, message):
    overrides = [] if "--" in args else ["--", *TINY_RUN]
    skip = [] if "--skip" in args else ["--skip", "2"]
    result = run_ab("--dry-run", "--out", str(tmp_path), *skip, *args, *overrides)
    assert result.returncode == 2
    assert message in result.stderr and "Traceback" not in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1, result.stderr


def test_an_unreadable_script_or_out_folder_is_one_line(ab, tmp_path):
    """As root, permission bits are no refusal; the OSErrors the tool meets are raised here instead."""
    script = tmp_path / "train_gpt_x.py"
    script.write_text("x = 1\n")
    real_read_bytes = Path.read_bytes

    def denied(path: Path) -> bytes:
        if path == script:
            raise PermissionError(13, "Permission denied", str(path))
        return real_read_bytes(path)

    def refused(*a, **k):
        raise PermissionError(13, "Permission denied")

    def read_only(*a, **k):
        raise OSError(30, "Read-only file system")

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(Path, "read_bytes", denied)
        with pytest.raises(ab.ABError, match=r"--baseline .*train_gpt_x.py: cannot read it \(Permission denied\); check its permissions"):
            ab.plan_version("baseline", str(script), tmp_path / "out")
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(Path, "mkdir", refused)
        with pytest.raises(ab.ABError, match=r"--out .*ro/o: cannot create it \(Permission denied\); pass a folder you can write"):
            ab.make_out_folder(tmp_path / "ro" / "o")
    (tmp_path / "ro").mkdir()
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(ab.tempfile, "TemporaryFile", read_only)
        with pytest.raises(ab.ABError, match=r"--out: cannot write in .*ro \(Read-only file system\)"):
            ab.make_out_folder(tmp_path / "ro")
        assert ab.json_folder_refusal(tmp_path / "ro" / "r.json", None) == (
            f"--json {tmp_path / 'ro' / 'r.json'}: cannot write in {tmp_path / 'ro'} (Read-only file system); pass a folder you can write"
        )


def test_a_script_that_is_not_python_is_named_as_passed(tmp_path):
    bad = tmp_path / "broken.py"
    bad.write_text("def (:\n")
    result = run_ab("--dry-run", "--out", str(tmp_path / "out"), "--baseline", str(bad), "--skip", "2", "--", *TINY_RUN)
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert f"{bad} (copied to " in result.stderr and "not valid Python" in result.stderr


@pytest.mark.parametrize("tool_file", ["baseline.out", "candidate", "baseline/seed1/logs/r.txt"])
def test_results_never_go_where_the_tool_writes_its_own_files(tmp_path, tool_file):
    """--json inside --out under a name the tool gives its own files would replace one of them at the end."""
    result = run_ab("--dry-run", "--out", str(tmp_path / "out"), "--json", str(tmp_path / "out" / tool_file), "--skip", "2", "--", *TINY_RUN)
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert f"--json {tmp_path / 'out' / tool_file}: inside --out, where the tool writes {tool_file.split('/')[0]} itself" in result.stderr


def test_an_out_folder_with_files_not_the_tools_is_refused_untouched(tmp_path):
    """A record folder, or the repository root, passed as --out once got baseline/ and candidate/ written into it."""
    record = tmp_path / "record"
    record.mkdir()
    (record / "README.md").write_text("a record")
    result = run_ab("--dry-run", "--out", str(record), "--skip", "2", "--", *TINY_RUN)
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert f"--out {record} holds files that are not this tool's (README.md); pass a new or empty folder" in result.stderr
    assert sorted(p.name for p in record.iterdir()) == ["README.md"]


def test_results_that_cannot_go_where_asked_go_to_a_new_file_in_the_out_folder(ab, tmp_path):
    (tmp_path / "gone").mkdir()
    (tmp_path / "gone").rmdir()  # the --json folder removed during the run
    with pytest.raises(ab.ABError, match=r"could not be written \(No such file or directory\); the results are in (\S+)") as refused:
        ab.write_new_results(tmp_path / "gone" / "r.json", dict(x=1.5), tmp_path)
    spare = Path(re.search(r"the results are in (\S+)", str(refused.value)).group(1))
    assert spare.parent == tmp_path and json.loads(spare.read_text()) == dict(x=1.5)


@pytest.mark.slow
def test_a_tiny_run_times_both_versions_in_turn_on_cpu(tmp_path):
    """Two resident workers (one gloo process each), two rounds, then one profiled step each written as a trace.
    The same computation on both sides: the val losses of a round are equal bitwise (same seed) and differ between
    rounds (seeds 1 and 2). The baseline's reset_parameters leaves the learned scalars alone, as da5641d's did: each
    round must still start from a fresh model, so the profiled run (seed 1 again, after round 2) replays round 1."""
    forgetful = tmp_path / "train_gpt_forgetful_reset.py"
    source = (ROOT / "train_gpt.py").read_text()
    assert source.count(SCALARS_RESET) == 1
    forgetful.write_text(source.replace(SCALARS_RESET, ""))
    result = run_ab(
        "--baseline", str(forgetful), "--candidate", "train_gpt.py", "--rounds", "2", "--skip", "2", "--profile-steps", "1",
        "--profile-from", "4", "--trace", str(tmp_path / "trace"), "--out", str(tmp_path / "out"), "--peak-tflops", "392",
        "--", *TINY_RUN, "--val_loss_every=4",
        timeout=600,
    )
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    for label in ("baseline", "candidate"):  # --trace: each version's profiled step as a Chrome trace
        with gzip.open(tmp_path / "trace" / f"{label}.trace.json.gz", "rt") as trace:
            assert any(event.get("name", "").startswith("aten::") for event in json.load(trace)["traceEvents"])
    report = json.loads((tmp_path / "out" / "ab.json").read_text())
    assert report["profiled_steps"] == "5"
    for label in ("baseline", "candidate"):  # the profiled run, the log's last, stopped after step 5 (--profile-from 4)
        log = next((tmp_path / "out" / label / "logs").glob("*.txt")).read_text()
        assert re.findall(r"^step:(\d+)/6 train_time", log, re.MULTILINE)[-1] == "5"
        round_1, round_2, profiled = re.findall(r"^step:4/6 val_loss:(\S+)", log, re.MULTILINE)
        assert profiled == round_1 != round_2
    # step 4's validation (--val_loss_every=4) runs after step 4's line, inside the profile, and the report says so
    assert result.stdout.count("note: 1 validation pass(es) ran inside the profiled steps") == 2
    baseline, candidate = report["rounds"]["baseline"], report["rounds"]["candidate"]
    assert [r["seed"] for r in baseline] == [r["seed"] for r in candidate] == [1, 2]
    for b, c in zip(baseline, candidate):
        assert b["ms_per_step"] > 0 and c["ms_per_step"] > 0
        assert b["val_loss"] == c["val_loss"]
    assert baseline[0]["val_loss"] != baseline[1]["val_loss"]
    assert len(report["summary"]["ratios"]) == 2
    assert "ratio B/A: median" in result.stdout and "paired difference B-A +0.0000" in result.stdout
    # MFU's FLOPs per step: 6 x the log's matmul parameters x the smoke preset's tokens per step
    matmul = int(re.search(r"^params: total=\d+ matmul=(\d+)", log, re.MULTILINE)[1])
    tokens = int(re.search(r"^hyperparameters: .*'train_batch_size': (\d+)", log, re.MULTILINE)[1])
    assert tokens == 8 * 128  # the smoke preset's batch
    for r in baseline + candidate:
        assert r["model_flops_per_step"] == 6 * matmul * tokens
    summary = report["summary"]
    for label, rounds in (("baseline", baseline), ("candidate", candidate)):  # over one GPU's --peak-tflops
        ms = statistics.median(r["ms_per_step"] for r in rounds)
        assert summary[f"{label}_mfu"] == pytest.approx(6 * matmul * tokens / (ms * 1e-3) / 392e12, rel=1e-12)
    assert re.search(r"^MFU \(6 x matmul parameters x tokens per step at the median ms/step, over 1 x 392 TFLOP/s\): "
                     r"baseline \d+\.\d%, candidate \d+\.\d%$", result.stdout, re.MULTILINE)
    if shutil.which("nvidia-smi") is None:  # CI: nothing to sample, and the report says so
        assert report["clocks"] == {} and "SM clock while each version trained: not sampled" in result.stdout


def test_abba_order_plans_every_second_round_candidate_first(tmp_path):
    result = run_ab("--dry-run", "--order", "abba", "--rounds", "4", "--skip", "2", "--out", str(tmp_path), "--", *TINY_RUN)
    assert result.returncode == 0, result.stderr
    assert (
        "round 1 (seed 1): baseline, candidate; round 2 (seed 2): candidate, baseline; "
        "round 3 (seed 3): baseline, candidate; round 4 (seed 4): candidate, baseline"
    ) in result.stdout


def test_second_slot_effect_is_recovered_from_abba_ratios(ab):
    true_ratio, slot = 0.9, 0.004  # B is 10% faster; whoever trains second loses 0.4%
    ratios = [true_ratio * (1 + slot), true_ratio / (1 + slot)] * 2  # abba: B second, B first, ...
    assert ab.second_slot_effect(ratios) == pytest.approx(slot, rel=1e-9)
    assert ab.second_slot_effect(ratios[:1]) != ab.second_slot_effect(ratios[:1])  # NaN without both orders
    assert ab.round_order(0, "abba") == ("baseline", "candidate") and ab.round_order(1, "abba") == ("candidate", "baseline")
    assert ab.round_order(1, "alternate") == ("baseline", "candidate")


def test_idle_time_is_split_into_host_waits_and_queued_gaps(ab):
    kernels = [  # (start, end, launched)
        (0.0, 10.0, -50.0),
        (12.0, 20.0, -40.0),  # gap 2, launched long before: the GPU's own gap
        (20.0, 25.0, -30.0),  # back to back: no gap
        (22.0, 24.0, -29.0),  # inside the busy span (another stream): no gap
        (35.0, 40.0, 33.0),  # gap 10, launched at 33 > 25: the GPU waited for the host
        (41.0, 42.0, None),  # gap 1, launch unknown: counted as the GPU's
    ]
    idle, host_idle, gaps, host_gaps = ab.split_idle(list(reversed(kernels)))  # order of the input does not matter
    assert (idle, host_idle, gaps, host_gaps) == (13.0, 10.0, 3, 1)
    assert ab.split_idle([]) == (0.0, 0.0, 0, 0)


def rounds_of(ab, ms_and_vals: list[tuple[float, float, float, float]]) -> tuple[list, list]:
    """Synthetic paired rounds, as the workers report them: (baseline ms, candidate ms, baseline val, candidate val)."""
    baseline = [ab.RoundResult(i + 1, bms, bval, 1024.0) for i, (bms, _, bval, _) in enumerate(ms_and_vals)]
    candidate = [ab.RoundResult(i + 1, cms, cval, 1024.0) for i, (_, cms, _, cval) in enumerate(ms_and_vals)]
    return baseline, candidate


def report_of(ab, tmp_path, baseline, candidate, order: str) -> str:
    """Prints the report and returns ab.json's text, both built as coordinate() builds them (no GPU, no workers)."""
    versions = [ab.Version(label, "x.py", "x.py", tmp_path / "x.py", "resident") for label in ab.LABELS]
    summary = ab.summarize_rounds(baseline, candidate, order)
    ab.print_report(versions, baseline, candidate, summary, {})
    rounds = {"baseline": [ab.asdict(r) for r in baseline], "candidate": [ab.asdict(r) for r in candidate]}
    ab.write_new_results(tmp_path / "ab.json", dict(rounds=rounds, summary=summary, order=order, clocks={}, profiles={}), tmp_path)
    return (tmp_path / "ab.json").read_text()


def strict_loads(text: str):
    """json.loads that refuses NaN and Infinity, as jq and JavaScript do."""
    def refuse(constant: str):
        raise ValueError(f"not JSON: {constant}")
    return json.loads(text, parse_constant=refuse)


def test_a_diverged_round_is_named_left_out_of_the_val_figures_and_null_in_strict_json(ab, tmp_path, capsys):
    """A candidate round that diverged (val loss nan): statistics.stdev raised AttributeError over it, after every
    round had run, and no ab.json was written; with one round, ab.json held NaN, which is not JSON."""
    baseline, candidate = rounds_of(ab, [(100.0, 90.0, 3.50, 3.51), (100.0, 90.0, 3.52, math.nan), (100.0, 90.0, 3.54, 3.57)])
    text = report_of(ab, tmp_path, baseline, candidate, "alternate")
    out = capsys.readouterr().out
    report = strict_loads(text)
    assert report["rounds"]["candidate"][1]["val_loss"] is None and report["rounds"]["candidate"][0]["val_loss"] == 3.51
    summary = report["summary"]
    assert summary["val_rounds"] == 2 and summary["val_not_finite"] == [dict(round=2, version="candidate", value="nan")]
    assert summary["baseline_val_mean"] == pytest.approx(3.52) and summary["candidate_val_mean"] == pytest.approx(3.54)
    assert summary["val_diff_mean"] == pytest.approx(0.02)  # rounds 1 and 3, paired by seed
    assert "val loss not finite: round 2 candidate nan (a diverged run" in out
    assert "final val loss (over the 2 of 3 rounds with both finite): baseline 3.5200" in out
    assert re.search(r"^\s+2\s+2\s+100\.00\s+90\.00\s+0\.9000\s+3\.5200\s+nan$", out, re.M)  # the round itself: nan


def test_one_round_or_none_finite_gives_undefined_figures_and_nulls(ab, tmp_path, capsys):
    baseline, candidate = rounds_of(ab, [(100.0, 90.0, math.inf, 3.5)])
    text = report_of(ab, tmp_path, baseline, candidate, "alternate")
    out = capsys.readouterr().out
    summary = strict_loads(text)["summary"]
    assert summary["val_rounds"] == 0 and summary["val_not_finite"] == [dict(round=1, version="baseline", value="inf")]
    for key in ("baseline_val_mean", "baseline_val_sd", "candidate_val_mean", "val_diff_mean", "val_diff_sd"):
        assert summary[key] is None, key
    assert summary["ratio_median"] == pytest.approx(0.9)
    assert "final val loss (over the 0 of 1 rounds with both finite): baseline undefined (sd undefined)" in out
    assert "peak allocated: baseline 1.00 GiB, candidate 1.00 GiB" in out
    assert "nan" not in out.splitlines()[-1]


def test_a_peak_no_round_reported_is_not_reported_without_a_unit(ab, tmp_path, capsys):
    baseline, candidate = rounds_of(ab, [(100.0, 90.0, 3.5, 3.5)])
    candidate = [ab.RoundResult(r.seed, r.ms_per_step, r.val_loss, math.nan) for r in candidate]
    report_of(ab, tmp_path, baseline, candidate, "alternate")
    assert "peak allocated: baseline 1.00 GiB, candidate not reported\n" in capsys.readouterr().out


def test_mfu_is_the_median_rounds_flops_rate_over_the_peak_and_not_reported_without_flops(ab, tmp_path, capsys):
    """Two GPUs of 784 TFLOP/s; the baseline's rounds at 600, 500 and 520 ms/step (median 520, mean 540, and MFU's
    median 1/520 against the mean of 1/ms) for 1e15 FLOPs per step: MFU is the report's median ms/step's."""
    baseline, candidate = rounds_of(ab, [(600.0, 90.0, 3.5, 3.5), (500.0, 90.0, 3.5, 3.5), (520.0, 90.0, 3.5, 3.5)])
    baseline = [dataclasses.replace(r, model_flops_per_step=1e15) for r in baseline]  # the candidate's: not given
    summary = ab.summarize_rounds(baseline, candidate, "alternate", 2 * 784e12)
    assert summary["baseline_mfu"] == pytest.approx(1e15 / 0.52 / (2 * 784e12), rel=1e-12)
    assert math.isnan(summary["candidate_mfu"])
    versions = [ab.Version(label, "x.py", "x.py", tmp_path / "x.py", "resident") for label in ab.LABELS]
    ab.print_report(versions, baseline, candidate, summary, {}, "", 784.0, 2)
    assert ("MFU (6 x matmul parameters x tokens per step at the median ms/step, over 2 x 784 TFLOP/s): baseline 122.6%, "
            "candidate not reported\n") in capsys.readouterr().out
    ab.write_new_results(tmp_path / "ab.json", dict(summary=summary), tmp_path)
    assert strict_loads((tmp_path / "ab.json").read_text())["summary"]["candidate_mfu"] is None
    # a round without FLOPs among rounds with them (NaN sorts anywhere in a median): not reported either
    for where in range(3):
        mixed = [dataclasses.replace(r, model_flops_per_step=math.nan) if i == where else r for i, r in enumerate(baseline)]
        assert math.isnan(ab.summarize_rounds(mixed, candidate, "alternate", 2 * 784e12)["baseline_mfu"])


def test_results_are_strict_json_with_every_non_finite_value_null(ab, tmp_path):
    ab.write_new_results(tmp_path / "r.json", dict(a=[math.inf, dict(b=math.nan, c=-math.inf)], d=(1.5, 2), e="nan", f=None), tmp_path)
    assert strict_loads((tmp_path / "r.json").read_text()) == dict(a=[None, dict(b=None, c=None)], d=[1.5, 2], e="nan", f=None)


@pytest.mark.parametrize("rounds", [1, 2, 3, 4])
def test_an_odd_number_of_abba_rounds_is_flagged_in_one_line_and_recorded(ab, tmp_path, capsys, rounds):
    """A time limit or deadline that leaves 3 of 4 abba rounds: two trained the baseline first, one the candidate,
    so the ratio's median (0.9036 here, the true ratio 0.9) carries the slot effect, and nothing said so."""
    ratio, slot = 0.9, 0.004
    ratios = [ratio * (1 + slot), ratio / (1 + slot)] * 2  # B second, B first, ...
    baseline, candidate = rounds_of(ab, [(100.0, 100.0 * r, 3.5, 3.5) for r in ratios[:rounds]])
    text = report_of(ab, tmp_path, baseline, candidate, "abba")
    out = capsys.readouterr().out
    summary = strict_loads(text)["summary"]
    flags = [line for line in out.splitlines() if line.startswith("abba order unbalanced")]
    assert summary["abba_rounds"] == dict(baseline_first=(rounds + 1) // 2, candidate_first=rounds // 2)
    assert summary["abba_balanced"] is (rounds % 2 == 0)
    if rounds % 2:
        assert flags == [
            f"abba order unbalanced: {(rounds + 1) // 2} round(s) with the baseline (A) first, {rounds // 2} with the candidate (B) "
            "first (the rounds ended after an odd number), so the ratio B/A's median and mean carry part of the second-slot effect"
        ]
    else:
        assert flags == []
    if rounds == 1:  # no round with B first: the effect is undefined, said in words and null in the JSON
        assert summary["second_slot_effect"] is None
        assert "second slot effect (abba order): undefined, it needs a completed round with each version first" in out
    else:
        assert summary["second_slot_effect"] == pytest.approx(slot, rel=1e-9)
        assert "second slot effect (abba order): +0.40% for whichever version trains second" in out


def test_alternate_order_has_no_abba_fields(ab, tmp_path, capsys):
    baseline, candidate = rounds_of(ab, [(100.0, 90.0, 3.5, 3.5)] * 3)
    text = report_of(ab, tmp_path, baseline, candidate, "alternate")
    assert "abba" not in capsys.readouterr().out and "abba_balanced" not in strict_loads(text)["summary"]


@pytest.mark.parametrize("start, events", [
    ("together", ["launch baseline", "launch candidate", "ready baseline", "ready candidate"]),
    ("in-turn", ["launch baseline", "ready baseline", "launch candidate", "ready candidate"]),
])
def test_versions_start_together_or_in_turn(ab, start, events):
    """In turn, the candidate's worker is not launched before the baseline is ready; each waits for ready once
    (a whole-run version's wait_ready is its untimed first run)."""
    log = []

    class FakeRunner:
        def __init__(self, label):
            self.label = label
            log.append(f"launch {label}")

        def wait_ready(self):
            log.append(f"ready {self.label}")

    runners = []
    assert ab.start_versions(["baseline", "candidate"], FakeRunner, start, runners) is runners
    assert log == events and [r.label for r in runners] == ["baseline", "candidate"]


def test_dry_run_names_how_the_versions_start(tmp_path):
    result = run_ab("--dry-run", "--start", "in-turn", "--rounds", "1", "--skip", "2", "--out", str(tmp_path), "--", *TINY_RUN)
    assert result.returncode == 0, result.stderr
    assert "1 process(es) per version, started in turn;" in result.stdout


def test_work_fits_the_time_limit_by_the_last_estimate(ab):
    assert ab.fits(elapsed_s=100.0, estimate_s=None, limit_s=50.0)  # nothing known yet (the first round): it runs
    assert ab.fits(100.0, 200.0, 0.0)  # no limit
    assert ab.fits(100.0, 200.0, 300.0) and not ab.fits(100.0, 200.5, 300.0)


@pytest.mark.slow
def test_a_time_limit_leaves_out_what_does_not_fit_and_reports_the_rest(tmp_path):
    """A limit that the first round already exceeds: round 1 runs (nothing is known before it), rounds 2-3 and the
    profile are left out, the workers are told to stop, and the report and JSON hold the one round."""
    result = run_ab(
        "--baseline", "train_gpt.py", "--candidate", "train_gpt.py", "--rounds", "3", "--skip", "2", "--profile-steps", "1",
        "--time-limit", "1", "--out", str(tmp_path), "--", *TINY_RUN, timeout=600,
    )
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    assert "time limit 1 s; timed steps" in result.stdout
    assert "time limit 1 s: left out rounds 2-3 (about" in result.stdout and "s each) and the profile (about" in result.stdout
    report = json.loads((tmp_path / "ab.json").read_text())
    assert [len(report["rounds"][label]) for label in ("baseline", "candidate")] == [1, 1]
    assert report["rounds_planned"] == 3 and len(report["left_out"]) == 2 and report["profiles"] == {}
    assert "ratio B/A: median" in result.stdout and "profile of" not in result.stdout


def test_an_out_folder_with_an_earlier_invocations_files_is_refused(tmp_path):
    """A reused --out once fed a new invocation the earlier one's 'result0' and 'stop' files."""
    (tmp_path / "baseline.result0").write_text('{"ms_per_step": 1.0}')
    result = run_ab("--dry-run", "--skip", "2", "--out", str(tmp_path), "--", *TINY_RUN)
    assert result.returncode != 0
    assert "holds an earlier invocation's files (baseline.result0)" in result.stderr and "new or empty folder" in result.stderr
    assert "Traceback" not in result.stderr
    assert (tmp_path / "baseline.result0").read_text() == '{"ms_per_step": 1.0}' and not (tmp_path / "baseline").exists()


@pytest.mark.parametrize("earlier", ["ab.json", "baseline/logs/run.txt"])
def test_an_out_folder_with_earlier_results_or_scripts_is_refused(tmp_path, earlier):
    """A reused --out: a run wrote its ab.json over the earlier results. Now refused by name before anything is
    extracted, as is a file under baseline/ that this invocation does not extract (a worker's log); the folder is left
    as it was."""
    (tmp_path / earlier).parent.mkdir(parents=True, exist_ok=True)
    (tmp_path / earlier).write_text("kept")
    before = sorted(tmp_path.rglob("*"))
    result = run_ab("--dry-run", "--skip", "2", "--out", str(tmp_path), "--", *TINY_RUN)
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert result.stderr.strip() == (
        f"bench/ab.py: error: --out {tmp_path.resolve()} holds an earlier invocation's files ({earlier}); pass a new or empty folder"
    )
    assert (tmp_path / earlier).read_text() == "kept" and sorted(tmp_path.rglob("*")) == before


def test_an_earlier_extracted_script_that_differs_is_refused_by_name_before_anything_is_written(tmp_path):
    """A dry run wrote its baseline/train_gpt.py over an earlier, different copy. Now refused naming it, and nothing is
    written (not even the candidate, which the folder does not hold)."""
    (tmp_path / "baseline").mkdir()
    (tmp_path / "baseline" / "train_gpt.py").write_text("kept")
    result = run_ab("--dry-run", "--skip", "2", "--out", str(tmp_path), "--", *TINY_RUN)
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert result.stderr.strip() == (
        f"bench/ab.py: error: --out {tmp_path.resolve()}: baseline/train_gpt.py is an earlier invocation's and differs from "
        "what this one extracts for the baseline; pass a new or empty folder"
    )
    assert (tmp_path / "baseline" / "train_gpt.py").read_text() == "kept" and not (tmp_path / "candidate").exists()


@pytest.mark.parametrize("track", ["track1", "track3"])
def test_a_dry_run_then_the_same_call_in_the_same_out_folder_is_accepted(tmp_path, monkeypatch, track):
    """The second call found the first's baseline/ and candidate/ copies and was refused; byte-identical copies are the
    same extraction. Track 3 brings a revision's distributed_shampoo, and the check's imports leave bytecode there."""
    monkeypatch.delenv("PYTHONDONTWRITEBYTECODE", raising=False)
    args = [*TRACK3, "--candidate", "HEAD"] if track == "track3" else ["--baseline", "HEAD"]
    tiny = TINY_TRACK3_RUN if track == "track3" else TINY_RUN
    call = ["--dry-run", *args, "--skip", "2", "--out", str(tmp_path), "--", *tiny]
    first = run_ab(*call)
    assert first.returncode == 0, first.stderr
    copies = {p: p.read_bytes() for p in tmp_path.rglob("*.py")}
    assert len(copies) >= 2 and (track == "track1" or (tmp_path / "candidate" / "distributed_shampoo").is_dir())
    again = run_ab(*call)
    assert again.returncode == 0, again.stderr
    assert again.stdout == first.stdout and {p: p.read_bytes() for p in tmp_path.rglob("*.py")} == copies


def test_a_retry_after_a_missing_candidate_in_the_same_out_folder_is_accepted(tmp_path):
    """The stopped call had already written baseline/train_gpt.py, and the corrected retry was refused for it."""
    missing = tmp_path / "gone.py"
    out = tmp_path / "out"
    stopped = run_ab("--dry-run", "--baseline", "HEAD", "--candidate", str(missing), "--skip", "2", "--out", str(out), "--", *TINY_RUN)
    assert stopped.returncode == 2 and f"--candidate {missing}: no such file" in stopped.stderr
    retry = run_ab("--dry-run", "--baseline", "HEAD", "--skip", "2", "--out", str(out), "--", *TINY_RUN)
    assert retry.returncode == 0, retry.stderr
    assert "baseline: train_gpt.py at HEAD (" in retry.stdout and (out / "candidate" / "train_gpt.py").is_file()


@pytest.mark.parametrize("out", ["file", "file/sub"])
def test_an_out_path_blocked_by_a_file_is_one_line(tmp_path, out):
    """--out naming a file, or a folder below one: mkdir's FileExistsError or NotADirectoryError was a traceback."""
    (tmp_path / "file").write_text("kept")
    result = run_ab("--dry-run", "--skip", "2", "--out", str(tmp_path / out), "--", *TINY_RUN)
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert result.stderr.strip() == (
        f"bench/ab.py: error: --out {(tmp_path / out).resolve()}: a file is in the way (that path or a folder above it is a file); pass a folder"
    )
    assert (tmp_path / "file").read_text() == "kept"


def test_a_wait_past_the_deadline_names_the_worker_and_its_signal(ab, tmp_path):
    control = ab.Control(tmp_path, "candidate")
    with pytest.raises(ab.WorkerTimeout, match=r"candidate: no 'result0' by the deadline; see .*candidate\.out"):
        control.wait("result0", deadline=0.0)  # time.monotonic() is past 0 at once
    (tmp_path / "candidate.result0").write_text('{"ms_per_step": 2.0}')
    assert control.wait("result0", deadline=0.0) == {"ms_per_step": 2.0}  # a signal already there is read


def test_a_signalled_worker_writes_its_stacks(ab, tmp_path):
    """The worker side (install_stack_dump) in a child process stuck in a sleep, the coordinator side (dump_stacks)
    here: the child's stderr gets the stuck function's frame."""
    child = f"""
import importlib.util, sys, time
spec = importlib.util.spec_from_file_location("bench_ab", {str(ROOT / "bench" / "ab.py")!r})
ab = importlib.util.module_from_spec(spec); sys.modules["bench_ab"] = ab; spec.loader.exec_module(ab)
ab.install_stack_dump(ab.Control(__import__("pathlib").Path({str(tmp_path)!r}), "candidate"), 0)
def stuck_here():
    time.sleep(60)
stuck_here()
"""
    with open(tmp_path / "candidate.out", "w") as out:
        process = subprocess.Popen([sys.executable, "-c", child, "--worker", "--label", "candidate"], stderr=out)  # a worker's words
        try:
            control = ab.Control(tmp_path, "candidate")
            control.wait_first(("pid0",), alive=lambda: process.poll() is None, timeout_s=60)
            assert ab.dump_stacks(control) == [process.pid]
            for _ in range(100):
                text = (tmp_path / "candidate.out").read_text()
                if "stuck_here" in text:
                    break
                __import__("time").sleep(0.1)
            assert "in stuck_here" in text and "Current thread" in text, text
        finally:
            process.kill()
            process.wait()
    assert ab.dump_stacks(control) == []  # an exited worker is skipped, not an error


def test_a_pid_that_is_not_the_workers_is_not_signalled(ab, tmp_path):
    """A pid file whose process is not (or no longer) this worker: e.g. the pid reused by another process."""
    stranger = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        control = ab.Control(tmp_path, "candidate")
        control.signal("pid0", dict(pid=stranger.pid))
        assert control.worker_pids() == [] and ab.dump_stacks(control) == []
        assert stranger.poll() is None  # SIGUSR1 would have killed it (no handler)
    finally:
        stranger.kill()
        stranger.wait()


@pytest.mark.slow
def test_a_worker_that_hangs_is_stopped_at_the_deadline_with_its_stacks(tmp_path):
    """The candidate hangs before it is ready (a sleep at the top of its run()): at --deadline both workers print
    their stacks, are killed, the report says no round was completed, the JSON names the hang, exit status 3."""
    source = (ROOT / "train_gpt.py").read_text()
    marker = "def run(argv: list[str]) -> float:\n"
    assert source.count(marker) == 1
    hanging = tmp_path / "hanging_train_gpt.py"
    hanging.write_text(source.replace(marker, marker + "    time.sleep(3600)  # this test's hang\n"))
    out = tmp_path / "out"
    result = run_ab(
        "--baseline", "train_gpt.py", "--candidate", str(hanging), "--rounds", "1", "--skip", "2", "--deadline", "60",
        "--out", str(out), "--", *TINY_RUN, timeout=300,
    )
    assert result.returncode == 3, result.stdout[-2000:] + result.stderr[-2000:]
    assert "deadline 60 s reached: candidate: no 'ready' by the deadline" in result.stderr
    assert "--- candidate: the last" in result.stderr
    frames = result.stderr.split("--- candidate: the last", 1)[1]
    assert re.search(r'candidate/train_gpt\.py", line \d+ in run\n', frames), frames  # its run(), where it sleeps
    assert "no round was completed by both versions" in result.stdout
    report = json.loads((out / "ab.json").read_text())
    assert report["hung"].startswith("candidate: no 'ready'") and report["rounds"] == {"baseline": [], "candidate": []}
    pids = [json.loads(p.read_text())["pid"] for p in out.glob("*.pid*")]
    assert len(pids) == 2  # one rank per version
    for pid in pids:  # no rank outlives the invocation
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)


def test_a_clock_line_is_parsed_and_anything_else_skipped(ab):
    sample = ab.parse_clock_line("1785, 690.52, 0x0000000000000004\n")
    assert (sample.sm_mhz, sample.power_w, sample.power_capped) == (1785.0, 690.52, True)
    assert ab.parse_clock_line("1980, 122.1, 0x0000000000000000").power_capped is False
    for line in ("[N/A], [N/A], [N/A]", "No devices were found", "1785, 690.5", ""):
        assert ab.parse_clock_line(line) is None


FAKE_NVIDIA_SMI = """#!{python}
import sys, time
open({argv_file!r}, "w").write(" ".join(sys.argv[1:]))
print("[N/A], [N/A], [N/A]", flush=True)
while True:
    print("1700, 695.0, 0x0000000000000004", flush=True)
    time.sleep(0.02)
"""


def test_the_sampler_attributes_samples_to_the_version_that_trained(ab, tmp_path):
    """A stand-in nvidia-smi prints capped samples: those inside a version's segment count for it, none outside;
    the command asks for the workers' GPUs only."""
    fake = tmp_path / "nvidia-smi"
    fake.write_text(FAKE_NVIDIA_SMI.format(python=sys.executable, argv_file=str(tmp_path / "argv")))
    fake.chmod(0o755)
    sampler = ab.ClockSampler(["2", "3"], interval_ms=20, command=str(fake))
    try:
        time.sleep(0.5)
        start = time.monotonic()
        time.sleep(0.3)
        sampler.segment("candidate", start, time.monotonic())
        time.sleep(0.2)
    finally:
        sampler.stop()
    clocks = sampler.summary()
    assert set(clocks) == {"candidate"}
    c = clocks["candidate"]
    assert 0 < c["samples"] < len(sampler.samples)  # the samples before and after the segment are not its
    assert (c["sm_mhz_mean"], c["power_w_mean"], c["power_capped_share"]) == (1700.0, 695.0, 1.0)
    argv = (tmp_path / "argv").read_text()
    assert "--query-gpu=clocks.sm,power.draw,clocks_event_reasons.active" in argv and argv.endswith("-i 2,3")


def test_without_nvidia_smi_nothing_is_sampled(ab, capsys):
    sampler = ab.ClockSampler(["0"], command="no-such-nvidia-smi-here")
    sampler.segment("baseline", 0.0, 1e12)
    sampler.stop()
    assert sampler.summary() == {}
    ab.print_clocks({})
    assert "not sampled" in capsys.readouterr().out


def test_the_workers_gpus_follow_cuda_visible_devices(ab, monkeypatch):
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    assert ab.gpus_of_workers(2) == ["0", "1"]
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "4,5,6")
    assert ab.gpus_of_workers(2) == ["4", "5"]


def test_a_sampler_deaf_to_sigterm_is_killed_not_waited_for(ab, tmp_path):
    """nvidia-smi stuck in a wedged driver ignores SIGTERM; stop() must still return (then the report comes)."""
    fake = tmp_path / "nvidia-smi"
    fake.write_text(f"#!{sys.executable}\nimport signal, time\nsignal.signal(signal.SIGTERM, signal.SIG_IGN)\nprint('1700, 695.0, 0x4', flush=True)\ntime.sleep(600)\n")
    fake.chmod(0o755)
    sampler = ab.ClockSampler(["0"], command=str(fake))
    time.sleep(0.5)
    started = time.monotonic()
    sampler.stop()
    assert time.monotonic() - started < 15
    assert sampler.process.poll() is not None  # killed


def test_a_profile_that_ends_at_the_last_step_is_accepted(tmp_path):
    result = run_ab("--dry-run", "--skip", "2", "--profile-from", "4", "--profile-steps", "2", "--out", str(tmp_path), "--", *TINY_RUN)
    assert result.returncode == 0, result.stderr


def test_the_profiler_starts_after_profile_from_and_stops_profile_steps_later(ab) -> None:
    timer = ab.RoundTimer(first_step=10)
    assert [timer.profiler_action(step) for step in (10, 40, 42)] == [None, None, None]  # no profile this round
    timer.profile, timer.profile_from, timer.profile_steps = object(), 40, 2
    actions = {step: timer.profiler_action(step) for step in range(0, 60)}
    assert {step: a for step, a in actions.items() if a} == {40: "start", 42: "stop"}  # not at the timed segment's start
    assert ab.profiled_steps_text(argparse.Namespace(profile_from=40, profile_steps=2)) == "41-42"
    assert ab.profiled_steps_text(argparse.Namespace(profile_from=10, profile_steps=1)) == "11"


def test_kernel_kinds_of_the_profiles(ab) -> None:
    """Names seen in the profiles of 2026-12-02 (commit b1e22df), 2026-12-06 and 2026-12-07: the MLP's fused kernels are their own kind, the inductor kernels that carry
    its op's name or "mm" stay inductor's, and the cuBLAS and FP8 head kernels keep theirs."""
    mlp = "MLP matmuls with ReLU² epilogues"
    assert ab.kind_of("_relu2_backward_matmul_kernel") == ab.kind_of("_relu2_matmul_kernel") == mlp  # both directions since fd230c0
    for quack in ("kernel_cutlass_kernel_quackepiloguefrontendGemmMod_relu2_backward_epilogue_fccd08d0f2377a83__c_sm9_o",
                  "kernel_cutlass_kernel_quackepiloguefrontendGemmMod_relu2_forward_epilogue_75983e62e103319f__none_sm9"):  # 2026-12-07
        assert ab.kind_of(quack) == mlp
    assert ab.kind_of("triton_red_fused__fused_rms_norm__fused_rms_norm_backward_add_mul_relu2_backward_matmul_slice_backwa") == "Triton fused (inductor)"
    for with_mm in ("triton_red_fused__fused_rms_norm__fused_rms_norm_backward_add_mm_mul_relu2_backward_matmul_slice_bac",
                    "triton_red_fused__fused_rms_norm__fused_rms_norm_backward_add_mm_mul_slice_backward_sum_unsqueeze_view_22"):
        assert ab.kind_of(with_mm) == "Triton fused (inductor)"  # names from the profile of 2026-12-07, c03efbb
    assert ab.kind_of("nvjet_sm90_tst_256x128_64x4_1x2_h_bz_coopA_NNT") == "bf16/fp32 GEMM"
    assert ab.kind_of("_softcap_ce_e5m2_kernel") == "fp8 head (scaled_mm, casts, copies)"
    for fp8_product in ("nvjet_sm90_qqtst_192x192_128x4_1x2_h_bz_coopB_TNN", "nvjet_sm90_qrtst_128x160_128x5_2x1_v_bz_coopA_algo2_TNT",
                        "nvjet_sm90_qrsss_128x160_128x5_1x2_h_bz_coopA_algo2_TNT"):  # the head's three, 2026-12-06
        assert ab.kind_of(fp8_product) == "fp8 head (scaled_mm, casts, copies)"
    assert ab.kind_of("nvjet_sm90_tst_192x192_64x3_2x1_v_bz_coopB_splitK_NTN") == "bf16/fp32 GEMM"
    assert ab.kind_of("void at::native::vectorized_elementwise_kernel<8, at::native::CUDAFunctor_add<c10::BFloat16>") == "other"
    attention = "attention (flex templates, flash-attn kernels)"  # names from the profiles of 2026-12-06 (bench/NOTES.md)
    for kernel in ("triton_tem_fused__unsafe_view_flex_attention_backward_mul_sigmoid_transpose_unsqueeze_view_4",
                   "triton_per_fused__unsafe_view_flex_attention_backward_mul_sigmoid_sigmoid_backward_squeeze_sum_transpose_unsqu",
                   "kernel_cutlass_kernel_flash_attncuteflash_bwd_sm90FlashAttentionBackwardSm90_object_at__tensor000o111012",
                   "kernel_cutlass_kernel_flash_attncuteflash_bwd_preprocessFlashAttentionBackwardPreprocess_object_at__tensorp",
                   "triton_per_fused__unsafe_view_fa4_backward_mul_sigmoid_sigmoid_backward_squeeze_sum_unsqueeze_view_3"):
        assert ab.kind_of(kernel) == attention, kernel


# ---------------------------------------------------------------------------------------------- Track 3 mode



def test_track3_dry_run_takes_flag_sets_per_version(tmp_path):
    """Shampoo against its AdamW ablation: one script, the baseline's own flag; a revision brings its package."""
    result = run_ab(
        "--dry-run", *TRACK3, "--baseline", "WORKTREE", "--candidate", "HEAD", "--baseline-flags=--matrix_optimizer=adamw",
        "--skip", "2", "--out", str(tmp_path), "--", *TINY_TRACK3_RUN,
    )
    assert result.returncode == 0, result.stderr
    assert "baseline: the working tree's train_gpt_shampoo.py with --matrix_optimizer=adamw ->" in result.stdout
    assert "candidate: train_gpt_shampoo.py at HEAD (" in result.stdout and "with its distributed_shampoo ->" in result.stdout
    assert result.stdout.count("[trials], 6 training steps") == 2
    package = tmp_path / "candidate" / "distributed_shampoo"
    assert (package / "distributed_shampoo.py").read_text() == subprocess.run(
        ["git", "show", "HEAD:distributed_shampoo/distributed_shampoo.py"], capture_output=True, text=True, cwd=ROOT
    ).stdout


def test_track3_a_flag_one_version_refuses_is_one_line(tmp_path):
    result = run_ab(
        "--dry-run", *TRACK3, "--baseline", "WORKTREE", "--candidate-flags=--matrix_optimizer=sgd", "--skip", "2",
        "--out", str(tmp_path), "--", *TINY_TRACK3_RUN,
    )
    assert result.returncode == 2
    assert "candidate (the working tree's train_gpt_shampoo.py) does not accept the overrides" in result.stderr
    assert "--matrix_optimizer='sgd': use shampoo or adamw" in result.stderr and "Traceback" not in result.stderr


@pytest.mark.parametrize("where", ["common", "candidate"])
def test_track3_refuses_resume_in_one_line(tmp_path, where):
    """Every round trains from a fresh initialisation: a --resume the rounds would ignore is refused by name."""
    resume = f"--resume={tmp_path / 'checkpoint'}"
    flags, overrides = ([], [resume]) if where == "common" else ([f"--candidate-flags={resume}"], [])
    result = run_ab(
        "--dry-run", *TRACK3, "--baseline", "WORKTREE", *flags, "--skip", "2", "--out", str(tmp_path / "out"), "--", *TINY_TRACK3_RUN, *overrides,
    )
    assert result.returncode == 2 and "Traceback" not in result.stderr
    label = "baseline" if where == "common" else "candidate"
    assert result.stderr.strip() == (
        f"bench/ab.py: error: {label}: {resume}: the Track 3 A/B trains every round from a fresh initialisation; drop "
        "--resume (continue a run with the script itself)"
    )


def test_step_lines_in_seconds_or_milliseconds(ab):
    seconds = ab.TRAIN_TIME.search("step:12/60 train_time:1.250s step_avg:104.17ms")
    milliseconds = ab.TRAIN_TIME.search("step:12/60 train_time:1250ms step_avg:104.17ms")
    assert ab.train_time_ms(seconds) == ab.train_time_ms(milliseconds) == 1250.0


@pytest.mark.slow
def test_a_tiny_track3_run_pairs_the_script_trials_by_seed(tmp_path):
    """Resident train_gpt_shampoo.py workers, the candidate with a flag that changes the speed only
    (--shampoo_root_streams=2; on the CPU nothing at all): each round's val losses are bitwise equal (same seed, same
    initialisation and data), the rounds' differ (seeds 1 and 2), and only the candidate's log has the flag."""
    result = run_ab(
        *TRACK3, "--baseline", "WORKTREE", "--candidate", "WORKTREE", "--candidate-flags=--shampoo_root_streams=2",
        "--rounds", "2", "--skip", "2", "--out", str(tmp_path), "--", *TINY_TRACK3_RUN, timeout=600,
    )
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    report = json.loads((tmp_path / "ab.json").read_text())
    baseline, candidate = report["rounds"]["baseline"], report["rounds"]["candidate"]
    assert [r["seed"] for r in baseline] == [r["seed"] for r in candidate] == [1, 2]
    for b, c in zip(baseline, candidate):
        assert b["ms_per_step"] > 0 and c["ms_per_step"] > 0
        assert b["val_loss"] == c["val_loss"]
    assert baseline[0]["val_loss"] != baseline[1]["val_loss"]
    assert "paired difference B-A +0.0000" in result.stdout
    assert [v["flags"] for v in report["versions"]] == [[], ["--shampoo_root_streams=2"]]
    logs = {label: "".join(p.read_text() for p in (tmp_path / label / "logs").glob("*.txt")) for label in ("baseline", "candidate")}
    overrides = {label: re.search(r"^overrides: (.*)$", log, re.MULTILINE)[1] for label, log in logs.items()}
    assert "'shampoo_root_streams': 2" in overrides["candidate"] and "shampoo_root_streams" not in overrides["baseline"]
    assert logs["baseline"].count("step:6/6 val_loss:") == 2  # one trial per round


def test_a_round_restores_optimizers_and_loaders_but_never_a_module(ab):
    """train(model, raw_model, adam, ...) of scripts before 82bc944 passes the compiled wrapper too: restoring its state
    would bring the first round's weights back over the round's seed (a review found baseline rounds that all ended
    alike). Modules are re-initialised, not restored; dataclass records are copied afresh."""
    import dataclasses

    import torch

    @dataclasses.dataclass
    class Progress:
        step: int = 0

    raw_model = torch.nn.Linear(2, 2)
    wrapper = torch.nn.Sequential(raw_model)  # stands in for torch.compile's OptimizedModule
    optimizer = torch.optim.SGD(raw_model.parameters(), lr=0.1)
    arguments = dict(model=wrapper, raw_model=raw_model, adam=optimizer, progress=Progress(), hp=object())
    stateful, records = ab.round_start_arguments(arguments)
    assert set(stateful) == {"adam"} and set(records) == {"progress"}


def test_an_odd_abba_plan_and_an_existing_results_file_are_refused(tmp_path):
    odd = run_ab("--dry-run", "--order", "abba", "--rounds", "3", "--out", str(tmp_path / "a"), "--", *TINY_RUN)
    assert odd.returncode == 2 and "--order abba needs an even --rounds (got 3)" in odd.stderr.strip().splitlines()[-1]
    earlier = tmp_path / "earlier.json"
    earlier.write_text('{"kept": true}')
    taken = run_ab("--dry-run", "--json", str(earlier), "--out", str(tmp_path / "b"), "--", *TINY_RUN)
    assert taken.returncode == 2 and f"--json {earlier}: the file exists" in taken.stderr.strip().splitlines()[-1]
    assert earlier.read_text() == '{"kept": true}'


@pytest.mark.parametrize("label", ["baseline", "candidate"])
def test_a_trace_folder_with_an_earlier_timeline_is_refused_before_anything_runs(tmp_path, label):
    """The worker exported its timeline over an earlier invocation's <label>.trace.json.gz, after the whole run."""
    traces = tmp_path / "traces"
    traces.mkdir()
    earlier = traces / f"{label}.trace.json.gz"
    earlier.write_bytes(b"kept")
    result = run_ab("--dry-run", "--skip", "2", "--profile-steps", "1", "--trace", str(traces), "--out", str(tmp_path / "out"), "--", *TINY_RUN)
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert result.stderr.strip().splitlines()[-1] == (
        f"bench/ab.py: error: --trace {traces}: {earlier} exists, and traces are never overwritten; move it away or pass another folder"
    )
    assert earlier.read_bytes() == b"kept" and not (tmp_path / "out").exists()  # refused before anything was extracted


def test_a_trace_folder_blocked_by_a_file_is_refused_before_anything_runs(tmp_path):
    """The worker's mkdir failed only after every round had run, and the profile with it."""
    (tmp_path / "file").write_text("kept")
    result = run_ab("--dry-run", "--skip", "2", "--profile-steps", "1", "--trace", str(tmp_path / "file" / "traces"), "--out", str(tmp_path / "out"), "--", *TINY_RUN)
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert result.stderr.strip().splitlines()[-1] == (
        f"bench/ab.py: error: --trace {tmp_path / 'file' / 'traces'}: {tmp_path / 'file'} is a file, not a folder; pass a folder"
    )
    assert (tmp_path / "file").read_text() == "kept" and not (tmp_path / "out").exists()


@pytest.mark.parametrize("where, why", [
    ("missing/ab.json", "the folder {tmp}/missing does not exist"),
    ("file/ab.json", "{tmp}/file is a file, not a folder"),
    ("file/sub/ab.json", "{tmp}/file is a file, not a folder"),
], ids=["no-folder", "a-file", "below-a-file"])
def test_a_results_file_without_a_folder_is_refused_before_anything_runs(tmp_path, where, why):
    """The results are written after every round: a --json in no folder failed then, with a traceback, and took them along."""
    (tmp_path / "file").write_text("kept")
    result = run_ab("--dry-run", "--skip", "2", "--json", str(tmp_path / where), "--out", str(tmp_path / "out"), "--", *TINY_RUN)
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert result.stderr.strip().splitlines()[-1] == (
        f"bench/ab.py: error: --json {tmp_path / where}: {why.format(tmp=tmp_path)}, and the results are written there only "
        "after the whole run; pass a path in an existing folder"
    )
    assert (tmp_path / "file").read_text() == "kept" and not (tmp_path / "out").exists() and not (tmp_path / "missing").exists()


# ---------------------------------------------------------------------------------------------- versions and whole runs
@pytest.mark.parametrize("source, why", [
    (b'x = "\xe9"\n', "(unicode error) 'utf-8' codec can't decode byte 0xe9 in position 0: unexpected end of data, line 1"),
    (b"x = 1\x00\n", "source code string cannot contain null bytes"),
], ids=["not-utf8", "null-byte"])
def test_a_script_python_cannot_read_is_one_line(tmp_path, source, why):
    """Bytes that are not UTF-8 were a UnicodeDecodeError traceback; a null byte's line read 'line None'."""
    script = tmp_path / "bad.py"
    script.write_bytes(source)
    out = tmp_path / "out"
    result = run_ab("--dry-run", "--skip", "2", "--baseline", str(script), "--out", str(out), "--", *TINY_RUN)
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert result.stderr.strip() == (
        f"bench/ab.py: error: {script} (copied to {out.resolve() / 'baseline' / 'train_gpt.py'}): not valid Python ({why}); "
        "pass a script that Python can import"
    )


def test_a_script_with_a_coding_declaration_is_read_in_it(ab, tmp_path):
    script = tmp_path / "latin.py"
    script.write_bytes(b'# -*- coding: latin-1 -*-\nx = "\xe9"\n')
    assert ab.classify(script) == "whole-run"


def test_a_parse_args_without_user_error_keeps_the_scripts_own_message(tmp_path):
    """The check's `except module.UserError` raised AttributeError for a script without UserError, which hid its message."""
    script = tmp_path / "other.py"
    script.write_text('def parse_args(argv):\n    raise SystemExit("other.py: unknown flag " + argv[0])\n')
    result = run_ab("--dry-run", "--skip", "2", "--baseline", str(script), "--out", str(tmp_path / "out"), "--", *TINY_RUN)
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert result.stderr.strip() == (
        f"bench/ab.py: error: baseline ({script}) does not accept the overrides: other.py: unknown flag {TINY_RUN[0]}"
    )


def test_a_folder_whose_logs_embed_different_scripts_is_refused(tmp_path):
    """The first log by name was taken: of a folder of several versions' runs, an arbitrary one."""
    folder = tmp_path / "runs"
    folder.mkdir()
    for record in ("2026-11-30_H200DocsProxy1Gpu", "2026-11-30_H200DocsProxy1GpuE5m2Cast"):
        for log in (ROOT / "records" / "track_1_short" / record).glob("*.txt"):
            shutil.copy(log, folder)
    first, second = sorted(p.name for p in folder.glob("*.txt"))
    out = tmp_path / "out"
    result = run_ab("--dry-run", "--skip", "2", "--baseline", str(folder), "--out", str(out), "--", *TINY_RUN)
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert result.stderr.strip() == (
        f"bench/ab.py: error: {folder}: its run logs embed different scripts ({first} and {second}); pass the log of the version to time"
    )
    assert not (out / "baseline").exists()


def test_a_folder_whose_logs_embed_one_script_is_that_script(tmp_path):
    log = sorted((ROOT / "records" / "track_1_short" / "2026-11-30_H200DocsProxy1Gpu").glob("*.txt"))[0]
    folder = tmp_path / "runs"
    folder.mkdir()
    shutil.copy(log, folder / "a.txt")
    shutil.copy(log, folder / "b.txt")
    result = run_ab("--dry-run", "--skip", "2", "--baseline", str(folder), "--out", str(tmp_path / "out"), "--", *TINY_RUN)
    assert result.returncode == 0, result.stderr
    assert f"baseline: the script embedded in {folder / 'a.txt'}" in result.stdout


def test_profile_steps_with_a_whole_run_version_is_refused(tmp_path):
    """A whole run is not instrumented: its profile was an empty list, and the report left it out without a word."""
    script = tmp_path / "other.py"
    script.write_text("print('step:1/2 train_time:5ms')\n")
    result = run_ab(
        "--dry-run", "--skip", "2", "--profile-steps", "1", "--candidate", str(script), "--out", str(tmp_path / "out"), "--", *TINY_RUN
    )
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert result.stderr.strip() == (
        f"bench/ab.py: error: --profile-steps 1: the candidate ({script}) is timed whole-run, which cannot be profiled; drop "
        "--profile-steps, or pass versions with train_gpt.py's or train_gpt_shampoo.py's structure"
    )


WHOLE_RUN_STANDIN = """import sys
from pathlib import Path
if __name__ == "__main__":
    data = [a.split("=", 1)[1] for a in sys.argv[1:] if a.startswith("--data=")][0]
    if not Path(data).is_file():
        sys.exit(f"no file {data}")
    for step in range(7):
        print(f"step:{step}/6 train_time:{5 * step}ms step_avg:5.00ms")
    print("step:6/6 val_loss:4.5000 train_time:30ms")
"""


def test_a_whole_run_reads_relative_override_paths_from_the_repository(tmp_path):
    """It ran in <out>/<label>/, where a relative path the check and the resident workers read from the repository (and an
    older script's own data defaults) named nothing: the first run failed."""
    script = tmp_path / "whole_run.py"
    script.write_text(WHOLE_RUN_STANDIN)
    out = tmp_path / "out"
    result = run_ab(
        "--baseline", str(script), "--candidate", str(script), "--rounds", "1", "--skip", "2", "--out", str(out), "--",
        "--data=tests/conftest.py",
    )
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    report = json.loads((out / "ab.json").read_text())
    assert report["summary"]["ratios"] == [1.0] and report["summary"]["baseline_ms_median"] == 5.0


# ---------------------------------------------------------------------------------------------- bench_train_gpt.py, profile_train_gpt.py
RECORD_LOG = sorted((ROOT / "records" / "track_1_short" / "2026-11-30_H200DocsProxy1Gpu").glob("*.txt"))[0]


def test_bench_a_failed_training_run_is_one_line(tmp_path):
    """subprocess.run(check=True): a CalledProcessError traceback after the run's own output."""
    result = run_bench_script("bench_train_gpt.py", "--matmul-tflops", "100", "--steps", "2", "--log-dir", str(tmp_path), "--", "--no_such_flag=1")
    assert result.returncode == 1 and "CalledProcessError" not in result.stderr
    assert result.stderr.strip().splitlines()[-1] == (
        "bench: the training run exited with status 1 (its output is above); fix what it names and run again"
    )


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="the rate is measured where there is a GPU")
def test_bench_without_a_gpu_or_a_rate_is_one_line():
    """The measurement's first CUDA tensor: an AssertionError traceback (Torch not compiled with CUDA enabled)."""
    result = run_bench_script("bench_train_gpt.py", "--log", str(RECORD_LOG))
    assert result.returncode == 1 and "Traceback" not in result.stderr
    assert result.stderr.strip() == (
        "bench: no CUDA GPU to measure the bf16 matmul rate on; pass --matmul-tflops R (e.g. to summarise a --log here)"
    )


def test_bench_a_matmul_rate_of_zero_is_refused():
    """0 was taken as 'not given' (the rate was measured instead); a negative rate gave a negative MFU."""
    for rate in ("0", "-5"):
        result = run_bench_script("bench_train_gpt.py", "--matmul-tflops", rate, "--log", str(RECORD_LOG))
        assert result.returncode == 2 and "Traceback" not in result.stderr
        assert result.stderr.strip().splitlines()[-1] == (
            f"bench_train_gpt.py: error: --matmul-tflops {float(rate)}: give the GPU's bf16 matmul rate, a number above 0"
        )


def test_profile_a_bad_override_is_train_gpts_one_line():
    """train_gpt.UserError from its parse_args was a traceback."""
    result = run_bench_script("profile_train_gpt.py", "--no_such_flag=1")
    assert result.returncode == 1 and "Traceback" not in result.stderr
    assert result.stderr.strip() == "profile_train_gpt.py: error: unrecognized arguments: --no_such_flag=1 (see --help)"


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="it profiles where there is a GPU")
def test_profile_without_a_gpu_is_one_line():
    result = run_bench_script("profile_train_gpt.py", "--preset=smoke")
    assert result.returncode == 1 and "Traceback" not in result.stderr
    assert result.stderr.strip() == "profile_train_gpt.py: no CUDA GPU here; run it on a machine with one"
