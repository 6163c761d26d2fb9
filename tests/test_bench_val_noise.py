"""bench/val_noise.py, final val loss over fresh processes per version: its statistics, parsing, pool and refusals on
CPU, stand-in scripts through the whole tool, and one real (tiny) run."""

import json
import math
import os
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from conftest import import_bench_script, run_bench_script

TINY_RUN = ["--preset=smoke", "--num_iterations=6", "--iteration_extension=0", "--warmup_steps=1", "--val_tokens=2048"]  # as test_bench_ab.py's


def run_val_noise(*args: str, timeout: int = 120) -> subprocess.CompletedProcess:
    return run_bench_script("val_noise.py", *args, timeout=timeout)


@pytest.fixture
def vn(monkeypatch):
    """bench/val_noise.py imported as a module (it is a script, not a package)."""
    return import_bench_script(monkeypatch, "val_noise.py", "bench_val_noise")


def results_of(vn, baseline: dict, candidate: dict, status: str = "finished") -> list:
    """RunResults by seed, interleaved as the pool returns them; a value that is a string is the run's status."""
    results = []
    for seed in sorted(baseline):
        for label, values in (("baseline", baseline), ("candidate", candidate)):
            value = values[seed]
            if isinstance(value, str):
                results.append(vn.RunResult(label, seed, value, f"{label}.seed{seed}.out"))
            else:
                results.append(vn.RunResult(label, seed, status, f"{label}.seed{seed}.out", value, 1024.0 * seed, 0))
    return results


# ---------------------------------------------------------------------------------------------- statistics
def test_the_summary_pairs_by_seed_and_leaves_non_finite_seeds_out(vn):
    """Seed 2's candidate diverged (nan) and seed 5's baseline (inf): both seeds leave both versions' figures. The
    rest checked against numpy and statistics, and the t-test's p against the t distribution's closed form for 2
    degrees of freedom, P(|T| > t) = 1 - t / sqrt(2 + t^2)."""
    baseline = {1: 2.70, 2: 2.65, 3: 2.68, 4: 2.71, 5: math.inf}
    candidate = {1: 2.69, 2: math.nan, 3: 2.70, 4: 2.74, 5: 2.66}
    summary = vn.summarize(results_of(vn, baseline, candidate), [1, 2, 3, 4, 5])
    assert summary["val_seeds"] == [1, 3, 4] and summary["unfinished_seeds"] == []
    assert summary["val_not_finite"] == [dict(seed=2, version="candidate", value="nan"), dict(seed=5, version="baseline", value="inf")]
    a, b = np.array([2.70, 2.68, 2.71]), np.array([2.69, 2.70, 2.74])
    d = b - a
    assert summary["baseline_val_mean"] == pytest.approx(a.mean()) and summary["baseline_val_sd"] == pytest.approx(a.std(ddof=1))
    assert summary["candidate_val_mean"] == pytest.approx(statistics.fmean(b)) and summary["candidate_val_sd"] == pytest.approx(statistics.stdev(b))
    assert summary["val_diffs"] == pytest.approx(list(d))
    assert summary["val_diff_mean"] == pytest.approx(d.mean()) and summary["val_diff_sd"] == pytest.approx(d.std(ddof=1))
    t = d.mean() / (d.std(ddof=1) / math.sqrt(3))
    assert summary["t_statistic"] == pytest.approx(t) and t > 0  # the sign of B-A
    assert summary["p_value"] == pytest.approx(1 - abs(t) / math.sqrt(2 + t * t))
    assert summary["baseline_peak_mib"] == 5 * 1024.0  # the largest of the finished runs', the diverged ones' too


def test_two_pairs_give_the_cauchy_p_value(vn):
    """One degree of freedom: the t distribution is Cauchy's, P(|T| > t) = 1 - 2 atan(t) / pi."""
    summary = vn.summarize(results_of(vn, {1: 3.0, 2: 3.1}, {1: 3.05, 2: 3.12}), [1, 2])
    d = np.array([0.05, 0.02])
    t = d.mean() / (d.std(ddof=1) / math.sqrt(2))
    assert summary["t_statistic"] == pytest.approx(t)
    assert summary["p_value"] == pytest.approx(1 - 2 * math.atan(abs(t)) / math.pi)


def test_equal_losses_give_an_undefined_test_written_as_null(vn, tmp_path):
    """The same code and seed on both sides: every difference 0, so t and p are NaN: 'undefined' in the report, null
    in the strict JSON."""
    results = results_of(vn, {1: 3.0, 2: 3.1}, {1: 3.0, 2: 3.1})
    summary = vn.summarize(results, [1, 2])
    assert summary["val_diff_mean"] == 0.0 and summary["val_diff_sd"] == 0.0
    lines = vn.report_lines(results, [1, 2], summary)
    assert "paired difference B-A: mean +0.0000, sd 0.0000; paired t-test (scipy.stats.ttest_rel) t=undefined, p=undefined" in lines
    vn.ab.write_new_results(tmp_path / "r.json", dict(summary=summary), tmp_path)
    written = json.loads((tmp_path / "r.json").read_text())["summary"]
    assert written["t_statistic"] is None and written["p_value"] is None and written["val_diffs"] == [0.0, 0.0]


def test_the_report_shows_every_seed_and_says_what_was_left_out(vn):
    results = results_of(vn, {1: 2.6836, 2: 2.70, 3: "deadline"}, {1: 2.6840, 2: math.nan, 3: "not started"})
    summary = vn.summarize(results, [1, 2, 3])
    assert summary["val_seeds"] == [1] and summary["unfinished_seeds"] == [3]
    lines = vn.report_lines(results, [1, 2, 3], summary)
    assert lines[:4] == [
        "seed   baseline val   candidate val       B-A",
        "   1         2.6836          2.6840   +0.0004",
        "   2         2.7000             nan         -",
        "   3        stopped         not run         -",
    ]
    assert "val loss not finite: seed 2 candidate nan (a diverged run); those seeds are left out of the figures below" in lines
    assert "not finished by both versions: seed(s) 3; left out of the figures below" in lines
    assert "baseline: mean 2.6836, sd over processes undefined (1 process, seeds 1)" in lines
    assert "peak allocated: baseline 2.00 GiB, candidate 2.00 GiB" in lines
    assert lines[-1].startswith("nothing was timed")


# ---------------------------------------------------------------------------------------------- a run's output
def test_the_last_val_line_and_peak_line_are_read(vn):
    text = (
        "step:0/6 val_loss:10.8258 train_time:0ms step_avg:0.03ms\nstep:6/6 train_time:9256ms step_avg:1542.71ms\n"
        "step:6/6 val_loss:7.7110 train_time:9257ms step_avg:1542.81ms\npeak memory allocated: 2048 MiB reserved: 3000 MiB\n"
    )
    output = vn.parse_output(text)
    assert (output.last_val, output.peak_mib, output.final, output.diverged) == (vn.ab.ValLine(6, 6, 7.7110), 2048.0, True, False)
    output = vn.parse_output("step:6/6 val_loss:nan train_time:1ms\n")
    assert math.isnan(output.last_val.loss) and math.isnan(output.peak_mib) and output.diverged
    assert vn.parse_output("step:6/6 train_time:1ms\nstep:6/6 val_loss:nane train_time:1ms\n").last_val is None  # float() refuses "nane"
    assert not vn.parse_output("step:3/6 val_loss:7.9000 train_time:1ms\n").final
    stopped = vn.parse_output("step:2/6 val_loss:9.1 train_time:1ms\nstep 4: non-finite training loss (inf); stopping\n")
    assert stopped.stop_line == "step 4: non-finite training loss (inf); stopping" and stopped.diverged


def test_a_run_is_finished_or_failed_by_its_exit_and_its_val_line(vn, tmp_path):
    def result(text: str, code: int):
        out = tmp_path / "baseline.seed1.out"
        out.write_text(text)
        return vn.read_result(vn.Run("baseline", 1, [], out, tmp_path / "logs"), code)

    finished = result("step:6/6 val_loss:3.2500 train_time:1ms\n", 0)
    assert (finished.status, finished.val_loss, finished.exit_status) == ("finished", 3.25, 0)
    assert (result("step:6/6 val_loss:3.2500\n", 1).status, result("", 1).problem) == ("failed", "exited with status 1")
    assert result("", -9).problem == "was killed by signal 9"
    silent = result("step:6/6 train_time:1ms\n", 0)
    assert silent.status == "failed" and silent.problem == "exited with status 0 but printed no final val line"
    # a mid-run val line is no final loss
    mid = result("step:3/6 val_loss:7.9000 train_time:1ms\n", 0)
    assert mid.status == "failed" and mid.problem == "exited with status 0 but printed no final val line (its last was step 3/6)"
    assert math.isnan(mid.val_loss)


@pytest.mark.parametrize("text, code, value", [
    # train_gpt.py exits 3 after a non-finite val line (RunStopped), torchrun then 1
    ("step:6/6 val_loss:nan train_time:1ms\nstep 6: non-finite validation loss (nan); stopping\n", 1, "nan"),
    ("step:6/6 val_loss:inf train_time:1ms\n", 3, "inf"),
    ("step:6/6 val_loss:nan train_time:1ms\n", 0, "nan"),
    ("step:2/6 val_loss:nan train_time:1ms\n", 1, "nan"),  # a mid-run validation (--val_loss_every) diverged
    # a non-finite training loss: the stop line and no final val line
    ("step:2/6 val_loss:9.1000 train_time:1ms\nstep 4: non-finite training loss (nan); stopping\n", 1, "nan"),
])
def test_a_diverged_run_is_finished_with_a_non_finite_loss_whatever_its_exit_status(vn, tmp_path, text, code, value):
    out = tmp_path / "candidate.seed2.out"
    out.write_text(text)
    result = vn.read_result(vn.Run("candidate", 2, [], out, tmp_path / "logs"), code)
    assert (result.status, str(result.val_loss), result.exit_status, result.problem) == ("finished", value, code, "")
    assert result.stop_line == (text.splitlines()[-1] if "stopping" in text else "")


def test_runs_are_planned_interleaved_with_the_seed_and_log_folder_last(vn, tmp_path):
    versions = [vn.Version("baseline", "HEAD", "", tmp_path / "b.py", "", []), vn.Version("candidate", "x", "", tmp_path / "c.py", "", ["--x=1"])]
    runs = vn.plan_runs(versions, ["--preset=smoke"], tmp_path, 2)
    assert [(r.label, r.seed) for r in runs] == [("baseline", 1), ("candidate", 1), ("baseline", 2), ("candidate", 2)]
    last = runs[3]
    assert last.cmd[:6] == [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=1", str(tmp_path / "c.py")]
    assert last.cmd[6:] == ["--preset=smoke", "--x=1", "--seed=2", f"--log_dir={tmp_path / 'candidate' / 'seed2' / 'logs'}"]
    assert last.out == tmp_path / "candidate.seed2.out"


# ---------------------------------------------------------------------------------------------- the pool
class FakeProcess:
    """A run that exits with `code` after `duration` seconds (or when stopped), its .out written at its start."""

    def __init__(self, run, duration: float, code: int, events: list):
        self.run, self.duration, self.code, self.events = run, duration, code, events
        self.started, self.returned, self.terminated = time.monotonic(), None, False
        run.out.write_text(f"step:6/6 val_loss:{3 + run.seed / 10:.4f} train_time:1ms\n")
        events.append(("start", run.label, run.seed))

    def poll(self):
        if self.returned is None and time.monotonic() - self.started >= self.duration:
            self.returned = self.code
            self.events.append(("end", self.run.label, self.run.seed))
        return self.returned

    def terminate(self):
        self.terminated, self.returned = True, -15
        self.events.append(("end", self.run.label, self.run.seed))

    def kill(self):
        raise AssertionError("a fake ends at SIGTERM")

    def wait(self, timeout=None):
        return self.returned


def fake_runs(vn, tmp_path, processes: int) -> list:
    versions = [vn.Version(label, "", "", tmp_path / f"{label}.py", "", []) for label in ("baseline", "candidate")]
    return vn.plan_runs(versions, [], tmp_path, processes)


def most_at_once(events: list) -> int:
    running = most = 0
    for kind, *_ in events:
        running += 1 if kind == "start" else -1
        most = max(most, running)
    return most


@pytest.mark.parametrize("concurrent", [1, 2, 3])
def test_the_pool_starts_runs_in_plan_order_at_most_k_at_once(vn, tmp_path, concurrent):
    """Durations vary, so runs end out of order; starts still follow the plan and never exceed K running."""
    runs, events, processes = fake_runs(vn, tmp_path, 3), [], []
    durations = {("baseline", 1): 0.3, ("candidate", 1): 0.1, ("baseline", 2): 0.15, ("candidate", 2): 0.25, ("baseline", 3): 0.1, ("candidate", 3): 0.1}

    def start(run):
        processes.append(FakeProcess(run, durations[(run.label, run.seed)], 0, events))
        return processes[-1]

    results = vn.run_pool(runs, concurrent, None, start=start, poll_s=0.01)
    assert [(label, seed) for kind, label, seed in events if kind == "start"] == [(r.label, r.seed) for r in runs]
    assert most_at_once(events) == concurrent
    assert [(r.label, r.seed, r.status, r.val_loss) for r in results] == [(r.label, r.seed, "finished", pytest.approx(3 + r.seed / 10)) for r in runs]


def test_a_stagger_spaces_the_starts_and_the_results_say_when_each_ran(vn, tmp_path):
    """With room for all four at once, --stagger still starts each run at least S after the one before; each
    result carries its start and end, seconds after the pool began, and a stopped run its stop."""
    runs, events = fake_runs(vn, tmp_path, 2), []
    start_times = []

    def start(run):
        start_times.append(time.monotonic())
        return FakeProcess(run, 30.0 if (run.label, run.seed) == ("candidate", 2) else 0.05, 0, events)

    results = vn.run_pool(runs, 4, time.monotonic() + 1.2, start=start, poll_s=0.01, stagger_s=0.25)
    # the gaps between the pool's own start stamps: start() reads the clock a moment later, by a delay that varies
    # from call to call (0.3 ms short of 0.25 s once on a loaded CI machine); the stamp trails the pool's check of
    # the stagger by two clock reads, hence the 5 ms allowance
    gaps = [later.started_s - earlier.started_s for earlier, later in zip(results, results[1:])]
    assert len(start_times) == 4 and min(gaps) >= 0.25 - 0.005 and max(gaps) < 0.5
    assert [r.status for r in results] == ["finished", "finished", "finished", "deadline"]
    assert [r.started_s for r in results] == sorted(r.started_s for r in results) and results[0].started_s < 0.1
    assert all(r.started_s < r.ended_s for r in results) and results[3].ended_s >= 1.2
    lines = vn.report_lines(results, [1, 2], vn.summarize(results, [1, 2]))
    assert any(line.startswith("runs, seconds after the first start (for planning an invocation): baseline 1 0-") for line in lines)


def test_a_failed_run_stops_the_runs_in_flight_and_starts_no_more(vn, tmp_path):
    runs, events = fake_runs(vn, tmp_path, 3), []
    started = []

    def start(run):
        code = 1 if (run.label, run.seed) == ("candidate", 1) else 0
        started.append(FakeProcess(run, 0.05 if code else 30.0, code, events))
        return started[-1]

    results = vn.run_pool(runs, 2, None, start=start, poll_s=0.01)
    assert [r.status for r in results] == ["cancelled", "failed", "not started", "not started", "not started", "not started"]
    assert started[0].terminated and len(started) == 2
    failed = vn.first_failure(results)
    assert (failed.label, failed.seed, failed.problem) == ("candidate", 1, "exited with status 1")


def test_the_deadline_stops_the_runs_in_flight_and_the_rest_never_start(vn, tmp_path):
    runs, events = fake_runs(vn, tmp_path, 2), []
    start = lambda run: FakeProcess(run, 0.05 if run.seed == 1 else 30.0, 0, events)
    results = vn.run_pool(runs, 1, time.monotonic() + 0.5, start=start, poll_s=0.01)
    assert [r.status for r in results] == ["finished", "finished", "deadline", "not started"]


def test_ctrl_c_stops_the_runs_in_flight_and_reports_what_finished(vn, tmp_path):
    """A KeyboardInterrupt while the pool waits: the runs in flight are stopped (never left running), the finished
    keep their results."""
    runs, events, started = fake_runs(vn, tmp_path, 2), [], []
    interrupt_at = time.monotonic() + 0.3

    class Interrupting(FakeProcess):
        interrupted = False  # one Ctrl-C

        def poll(self):
            if self.duration > 1 and time.monotonic() >= interrupt_at and not Interrupting.interrupted:
                Interrupting.interrupted = True
                raise KeyboardInterrupt
            return super().poll()

    def start(run):
        started.append(Interrupting(run, 0.05 if run.seed == 1 else 30.0, 0, events))
        return started[-1]

    results = vn.run_pool(runs, 1, None, start=start, poll_s=0.01)
    assert [r.status for r in results] == ["finished", "finished", "interrupted", "not started"]
    assert started[2].terminated and len(started) == 3
    assert results[2].started_s < results[2].ended_s and results[3].started_s is None and results[3].ended_s is None


def test_ctrl_c_while_a_run_starts_reports_it_interrupted(vn, tmp_path):
    """A KeyboardInterrupt inside start() itself (the run taken from the queue, no process handed back): the run is
    reported interrupted and the rest not started, not lost from the results."""
    runs, events = fake_runs(vn, tmp_path, 1), []

    def start(run):
        if run.label == "candidate":
            raise KeyboardInterrupt
        return FakeProcess(run, 30.0, 0, events)

    results = vn.run_pool(runs, 2, None, start=start, poll_s=0.01, grace_s=1.0)
    assert [r.status for r in results] == ["interrupted", "interrupted"]


def test_a_run_that_exits_just_before_the_deadline_keeps_its_result(vn, tmp_path):
    """The first poll after the deadline says 'running', the process having exited just after it: the pool polls
    once more before stopping, so the run is finished, not stopped by the deadline."""
    runs, events = fake_runs(vn, tmp_path, 1), []
    deadline = time.monotonic() + 0.3

    class JustInTime(FakeProcess):
        polls_after = 0

        def poll(self):
            if time.monotonic() < deadline:
                return None
            self.polls_after += 1
            return None if self.polls_after == 1 else 0

    results = vn.run_pool(runs, 2, deadline, start=lambda run: JustInTime(run, 0, 0, events), poll_s=0.01)
    assert [r.status for r in results] == ["finished", "finished"]


def test_a_run_deaf_to_sigterm_is_killed_after_the_grace_period(vn, tmp_path):
    """Real processes: torchrun's SIGTERM path, and the SIGKILL after it for one that ignores it."""
    deaf = "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); print('ready', flush=True); time.sleep(60)"
    runs = [vn.Run("baseline", 1, [sys.executable, "-c", deaf], tmp_path / "baseline.seed1.out", tmp_path),
            vn.Run("candidate", 1, [sys.executable, "-c", "import time; time.sleep(60)"], tmp_path / "candidate.seed1.out", tmp_path)]
    begun = time.monotonic()
    results = vn.run_pool(runs, 2, time.monotonic() + 1.5, grace_s=1.0)
    assert [r.status for r in results] == ["deadline", "deadline"]
    assert time.monotonic() - begun < 15


# ---------------------------------------------------------------------------------------------- refusals
def test_help_says_it_times_nothing():
    result = run_val_noise("--help")
    assert result.returncode == 0
    for phrase in ("--processes", "--concurrent", "--deadline", "It times nothing", "ttest_rel", "interleaved"):
        assert phrase in result.stdout


@pytest.mark.parametrize("args, message", [
    (["--processes", "1"], "--processes=1: give 2 to 1000 (an sd over processes needs 2)"),
    (["--processes", "100000000"], "--processes=100000000: give 2 to 1000"),  # its plan was built in memory: 120 s and more
    (["--concurrent", "0"], "--concurrent=0: give 1 to 1000"),
    (["--baseline", "deadbeef"], "--baseline deadbeef: not a git revision"),
    (["--json", "OUT/candidate.seed1.out"], "inside --out, where the tool writes candidate.seed1.out itself"),
    (["--json", "OUT/check/r.json"], "inside --out, where the tool writes check itself"),
    (["--deadline", "-1"], "--deadline=-1.0: give finite seconds >= 0 (0: none)"),
    (["--stagger", "inf"], "--stagger=inf: give finite seconds >= 0 (0: none)"),
    (["--", "--seed=4"], "--seed=4: bench/val_noise.py sets --seed of each run itself (seeds 1..--processes, logs under --out); drop it"),
    (["--candidate-flags=--log_dir=x"], "--log_dir=x: bench/val_noise.py sets --log_dir of each run itself"),
    (["--", "--resume=logs/ckpt"], "--resume=logs/ckpt: bench/val_noise.py starts each process from its seed's fresh model; drop --resume"),
    (["--baseline-flags=--resume"], "--resume: bench/val_noise.py starts each process from its seed's fresh model; drop --resume"),
    (["--", "--no_such_flag=1"], "does not accept the overrides"),
])
def test_bad_input_is_one_line(tmp_path, args, message):
    overrides = [] if "--" in args else ["--", *TINY_RUN]
    args = [arg.replace("OUT", str(tmp_path / "out")) for arg in args]
    result = run_val_noise("--dry-run", "--out", str(tmp_path / "out"), *args, *overrides)
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1 and result.stderr.startswith("bench/val_noise.py: error: ")
    assert message in result.stderr


def test_an_existing_results_file_is_refused(tmp_path):
    (tmp_path / "r.json").write_text("{}")
    result = run_val_noise("--dry-run", "--json", str(tmp_path / "r.json"), "--out", str(tmp_path / "out"), "--", *TINY_RUN)
    assert result.returncode == 2 and result.stderr.strip() == (
        f"bench/val_noise.py: error: --json {tmp_path / 'r.json'}: the file exists, and results are never overwritten; pass another path"
    )


@pytest.mark.parametrize("earlier", ["baseline.seed1.out", "candidate/seed1/logs/run.txt", "val_noise.json"])
def test_an_out_folder_with_an_earlier_invocations_files_is_refused(tmp_path, earlier):
    (tmp_path / earlier).parent.mkdir(parents=True, exist_ok=True)
    (tmp_path / earlier).write_text("earlier")
    result = run_val_noise("--dry-run", "--out", str(tmp_path), "--", *TINY_RUN)
    assert result.returncode == 2 and len(result.stderr.strip().splitlines()) == 1
    assert f"--out {tmp_path} holds an earlier invocation's files ({earlier}); pass a new or empty folder" in result.stderr
    assert not (tmp_path / "baseline").exists()  # refused before anything was written


def test_a_dry_run_plans_interleaved_runs_and_runs_nothing(tmp_path):
    result = run_val_noise("--dry-run", "--baseline", "HEAD", "--processes", "2", "--concurrent", "2", "--out", str(tmp_path), "--", *TINY_RUN)
    assert result.returncode == 0, result.stderr
    assert "baseline: train_gpt.py at HEAD (" in result.stdout and "candidate: the working tree's train_gpt.py" in result.stdout
    assert "at most 2 at once; order baseline 1, candidate 1, baseline 2, candidate 2; nothing is timed" in result.stdout
    assert not list(tmp_path.glob("*.out"))


def test_the_check_refuses_a_version_the_seed_or_log_folder_would_not_reach(vn, tmp_path):
    version = vn.Version("candidate", "old.py", "old.py", tmp_path / "old.py", "", [])
    assert vn.check_refusal(version, dict(train_steps=6, resume="", settings=["log_dir", "seed", "train_steps"])) is None
    assert vn.check_refusal(version, dict(train_steps=None, resume="", settings=None)) == (
        f"candidate (old.py): {tmp_path / 'old.py'} parses no overrides (no parse_args), so --seed and --log_dir would not "
        "reach its runs (unseeded, unpaired runs); pass a version of train_gpt.py that takes --seed and --log_dir"
    )
    assert "has no seed setting, so --seed would not reach its runs" in vn.check_refusal(version, dict(train_steps=6, resume="", settings=["log_dir"]))
    assert vn.check_refusal(version, dict(train_steps=6, resume="ckpt", settings=["log_dir", "seed"])) == (
        "candidate (old.py): its settings resume 'ckpt'; bench/val_noise.py starts each process from its seed's fresh model; drop --resume"
    )


def test_the_default_folder_is_new_and_the_results_file_never_replaced(vn, tmp_path, monkeypatch):
    monkeypatch.setattr(vn, "REPO", tmp_path)
    folder = vn.new_default_folder()
    assert folder.is_dir() and folder.parent == tmp_path / "bench" / "out" / "val_noise" and folder.name.endswith(f"-{os.getpid()}")
    monkeypatch.setattr(vn.time, "strftime", lambda _: folder.name.rsplit("-", 1)[0])  # the same second, the same process
    with pytest.raises(vn.ABError, match="exists already"):
        vn.new_default_folder()
    (folder / "r.json").write_text("another invocation's")
    with pytest.raises(vn.ABError, match=r"appeared during the run and is kept; the results are in (\S+)") as refused:
        vn.ab.write_new_results(folder / "r.json", dict(x=math.nan), folder)
    assert (folder / "r.json").read_text() == "another invocation's"
    spare = Path(re.search(r"the results are in (\S+)", str(refused.value)).group(1))
    assert spare.parent == folder and json.loads(spare.read_text()) == dict(x=None)  # not lost
    assert vn.ab.write_new_results(folder / "s.json", dict(x=math.nan), folder) == folder / "s.json"
    assert json.loads((folder / "s.json").read_text()) == dict(x=None)


# ---------------------------------------------------------------------------------------------- stand-in scripts
# A stand-in for train_gpt.py: its parse_args (which the check calls) and its outputs by seed: a val loss, "sleep",
# "fail" (exit 1), a non-finite val loss (printed, then train_gpt.py's stop line and exit status 3) or "train-nan" (a
# non-finite training loss: the stop line, no val line, exit status 3). Run through torchrun as the tool runs them.
STANDIN = """import dataclasses, math, sys, time

@dataclasses.dataclass
class Hyperparameters:
    train_steps: int = 6
    seed: int = -1
    log_dir: str = "logs"
    resume: str = ""

def parse_args(argv):
    hp = Hyperparameters()
    for word in argv:
        name, value = word[2:].split("=", 1)
        setattr(hp, name, type(getattr(hp, name))(value))  # an unknown setting fails, as train_gpt.py's parser
    return hp, {{}}

if __name__ == "__main__":
    hp = parse_args(sys.argv[1:])[0]
    value = {values}[hp.seed]
    if value == "sleep":
        time.sleep(60)
    if value == "fail":
        sys.exit(1)
    if value == "train-nan":
        print("step:3/6 val_loss:9.1000 train_time:1ms step_avg:1.00ms", flush=True)
        print("step 5: non-finite training loss (nan); stopping", file=sys.stderr, flush=True)
        sys.exit(3)
    print(f"step:6/6 val_loss:{{value}} train_time:1ms step_avg:1.00ms", flush=True)
    if not math.isfinite(float(value)):
        print(f"step 6: non-finite validation loss ({{value}}); stopping", file=sys.stderr, flush=True)
        sys.exit(3)
    print("peak memory allocated: 2048 MiB reserved: 3000 MiB")
"""


def standin(tmp_path, name: str, values: dict) -> str:
    path = tmp_path / f"{name}.py"
    path.write_text(STANDIN.format(values=values))
    return str(path)


@pytest.mark.parametrize("script, message", [
    ("import sys\nif __name__ == '__main__':\n    print('step:6/6 val_loss:3.0')\n", "parses no overrides (no parse_args), so --seed and --log_dir would not reach its runs"),
    ("import argparse\ndef parse_args(argv):\n    return argparse.Namespace(train_steps=6, log_dir='logs'), {}\n", "has no seed setting, so --seed would not reach its runs"),
])
def test_a_version_that_does_not_take_the_seed_is_refused(tmp_path, script, message):
    """Through the tool: bench/ab.py's check reports the parsed settings' names (None without parse_args)."""
    (tmp_path / "old.py").write_text(script)
    result = run_val_noise("--dry-run", "--baseline", standin(tmp_path, "a", {}), "--candidate", str(tmp_path / "old.py"), "--out", str(tmp_path / "out"))
    assert result.returncode == 2 and len(result.stderr.strip().splitlines()) == 1, result.stdout + result.stderr
    assert result.stderr.startswith("bench/val_noise.py: error: candidate (") and message in result.stderr


@pytest.mark.slow
def test_stand_ins_through_the_whole_tool_with_diverged_seeds(tmp_path):
    """Seed 2's candidate prints a nan val line and seed 4's baseline a non-finite training loss's stop line; both
    exit 3 as train_gpt.py does (torchrun then 1), and both are finished runs left out with their seeds."""
    baseline = standin(tmp_path, "a", {1: "3.5000", 2: "3.6000", 3: "3.5500", 4: "train-nan"})
    candidate = standin(tmp_path, "b", {1: "3.5100", 2: "nan", 3: "3.5700", 4: "3.5"})
    out = tmp_path / "out"
    result = run_val_noise("--baseline", baseline, "--candidate", candidate, "--processes", "4", "--concurrent", "4", "--out", str(out))
    assert result.returncode == 0, result.stdout + result.stderr
    assert "   2         3.6000             nan         -" in result.stdout and "   4            nan          3.5000         -" in result.stdout
    assert "baseline: mean 3.5250, sd over processes 0.0354 (2 processes, seeds 1, 3)" in result.stdout
    assert "paired difference B-A: mean +0.0150, sd 0.0071;" in result.stdout
    report = json.loads((out / "val_noise.json").read_text())
    assert [(r["label"], r["seed"], r["status"]) for r in report["runs"]] == [
        (label, seed, "finished") for seed in (1, 2, 3, 4) for label in ("baseline", "candidate")
    ]
    assert report["runs"][3]["val_loss"] is None and report["runs"][3]["exit_status"] != 0
    assert report["runs"][6]["stop_line"] == "step 5: non-finite training loss (nan); stopping"
    assert report["summary"]["val_not_finite"] == [dict(seed=2, version="candidate", value="nan"), dict(seed=4, version="baseline", value="nan")]
    assert report["device"] == "cpu" and report["overrides"] == [] and report["summary"]["baseline_peak_mib"] == 2048.0
    assert all((out / f"{label}.seed{seed}.out").is_file() for seed in (1, 2, 3, 4) for label in ("baseline", "candidate"))


def test_a_failed_run_is_one_line_naming_its_output_and_the_results_of_what_finished(tmp_path):
    baseline = standin(tmp_path, "a", {1: "3.5", 2: "sleep", 3: "3.6"})
    candidate = standin(tmp_path, "b", {1: "3.6", 2: "fail", 3: "3.6"})
    out = tmp_path / "out"
    begun = time.monotonic()
    result = run_val_noise("--baseline", baseline, "--candidate", candidate, "--processes", "3", "--concurrent", "2", "--out", str(out))
    assert result.returncode == 2 and result.stderr.strip() == (
        f"bench/val_noise.py: error: candidate seed 2: the run exited with status 1; see {out.resolve() / 'candidate.seed2.out'}; "
        f"what finished is in {out.resolve() / 'val_noise.json'}"
    ), result.stdout + result.stderr
    assert time.monotonic() - begun < 50  # the baseline's 60-s run was stopped
    assert not (out / "baseline.seed3.out").exists()
    assert "   1         3.5000          3.6000   +0.1000" in result.stdout and "deadline" not in result.stdout
    report = json.loads((out / "val_noise.json").read_text())
    assert [r["status"] for r in report["runs"]] == ["finished", "finished", "cancelled", "failed", "not started", "not started"]
    assert report["runs"][3]["problem"] == "exited with status 1" and report["summary"]["val_seeds"] == [1]


@pytest.mark.slow
def test_the_deadline_reports_what_finished_with_exit_status_3(tmp_path):
    baseline = standin(tmp_path, "a", {1: "3.5", 2: "sleep", 3: "3.5"})
    candidate = standin(tmp_path, "b", {1: "3.6", 2: "sleep", 3: "3.6"})
    out = tmp_path / "out"
    result = run_val_noise("--baseline", baseline, "--candidate", candidate, "--processes", "3", "--concurrent", "2",
                           "--deadline", "15", "--out", str(out))
    assert result.returncode == 3, result.stdout + result.stderr
    assert "   1         3.5000          3.6000   +0.1000" in result.stdout
    assert "   2        stopped         stopped         -" in result.stdout and "   3        not run         not run         -" in result.stdout
    assert "deadline 15 s: stopped baseline seed 2 (deadline), candidate seed 2 (deadline), baseline seed 3 (not started)" in result.stdout
    report = json.loads((out / "val_noise.json").read_text())
    assert [r["status"] for r in report["runs"]] == ["finished", "finished", "deadline", "deadline", "not started", "not started"]
    assert report["summary"]["val_seeds"] == [1] and report["summary"]["baseline_val_sd"] is None


# ---------------------------------------------------------------------------------------------- a real run
@pytest.mark.slow
def test_a_tiny_run_of_the_same_code_pairs_exactly_by_seed_on_cpu(tmp_path):
    """Four fresh processes of train_gpt.py (the working tree on both sides), two at once. On CPU a run is
    deterministic given its seed (checked: two processes of seed 1 gave 7.7110 alike, seed 2 7.7002, unseeded
    7.6453), so each seed's two runs agree exactly and the seeds differ: without --seed reaching the runs, each
    process would start from its own random initialisation and the differences would not be 0."""
    out = tmp_path / "out"
    result = run_val_noise("--baseline", "WORKTREE", "--candidate", "WORKTREE", "--processes", "2", "--concurrent", "2",
                           "--out", str(out), "--", *TINY_RUN, timeout=600)
    print(result.stdout)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    report = json.loads((out / "val_noise.json").read_text())
    runs = report["runs"]
    assert [(r["label"], r["seed"], r["status"], r["exit_status"]) for r in runs] == [
        (label, seed, "finished", 0) for seed in (1, 2) for label in ("baseline", "candidate")
    ]
    for r in runs:
        assert (out / f"{r['label']}.seed{r['seed']}.out").is_file()
        logs = list((out / r["label"] / f"seed{r['seed']}" / "logs").glob("*.txt"))
        assert len(logs) == 1
        assert re.search(r"^overrides: .*'seed': (\d+)", logs[0].read_text(), re.MULTILINE)[1] == str(r["seed"])
    vals = {(r["label"], r["seed"]): r["val_loss"] for r in runs}
    assert vals[("baseline", 1)] == vals[("candidate", 1)] and vals[("baseline", 2)] == vals[("candidate", 2)]
    assert vals[("baseline", 1)] != vals[("baseline", 2)]
    summary = report["summary"]
    assert summary["val_seeds"] == [1, 2] and summary["val_diffs"] == [0.0, 0.0] and summary["val_diff_sd"] == 0.0
    assert summary["baseline_val_sd"] > 0
    assert "paired difference B-A: mean +0.0000, sd 0.0000" in result.stdout and "nothing was timed" in result.stdout
