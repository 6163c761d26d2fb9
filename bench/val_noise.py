"""Final val loss of two versions of train_gpt.py over N fresh processes each, in one invocation.

    python bench/val_noise.py --baseline REV_OR_PY --candidate WORKTREE --processes 3 [--concurrent 2] [--stagger S]
        [--out DIR] [--json PATH] [--deadline S] -- <train_gpt.py overrides>

Why: "the candidate's val loss is within main's run-to-run noise" needs that noise measured across processes.
bench/ab.py cannot give it: each of its versions trains in one resident process, so its rounds differ by seed only,
and separate processes of the same code differ by more (about 0.02 val loss at step 120 on the proxy data,
bench/NOTES.md). Here every run is a fresh process, and both versions' noise is measured in the same invocation.

  * Versions are what bench/ab.py takes (a git revision's train_gpt.py, a .py file, a run log or record folder, or
    WORKTREE), resolved, extracted into --out and checked by ab.py's own functions. --baseline-flags and
    --candidate-flags add overrides to one side only.
  * For each seed s in 1..N and each version, one fresh process, run from the repository root:
        python -m torch.distributed.run --standalone --nproc_per_node=1 <script> <overrides> --seed=s
            --log_dir=<out>/<label>/seed<s>/logs
    its stdout and stderr in <out>/<label>.seed<s>.out. Both versions get the same seeds, so their losses pair by seed.
  * The runs start interleaved (baseline seed 1, candidate seed 1, baseline seed 2, ...), at most --concurrent at
    once, all with the default inductor and Triton caches: each version's first run compiles cold, and so does any
    run started before an earlier run of its version had filled the caches (with --concurrent 2 or more, several
    may). Two at once can hide one run's mostly-CPU start-up behind the other's training, but only if they do not
    start together: six 120-step runs of the record batch, two at once and started in pairs, took more than 583 s
    on one H100 (bench/NOTES.md, 2026-12-06). --stagger S starts each run at least S seconds after the one before,
    so that later runs start while another trains. The report gives each run's start and end (also in the JSON).
  * From each run: the loss of its final val line (step N/N) and its peak memory line. The report gives both losses
    and B-A per seed, each version's mean and sd over processes, the paired difference's mean and sd, and a paired
    t-test (scipy.stats.ttest_rel). A diverged run is a finished run with a loss that is not finite, whatever its
    exit status (train_gpt.py exits 3 after it, torchrun then 1): its last val line is nan/inf, or it printed
    train_gpt.py's "step K: non-finite training loss (...); stopping" (its loss is then nan). It is shown as nan/inf
    and left out of the figures with its seed (both versions' runs of it), as bench/ab.py does, so both sides stand
    on the same seeds.

It times nothing: concurrent runs share the GPU and each run's start-up is part of it. Time with bench/ab.py.

A run that did not diverge and exits with a non-zero status or prints no final val line is an error naming its
.out file (exit status 2): the runs still going are stopped, no further one starts, and what finished is reported
and written to the JSON file first (the error line names it). --deadline S: runs still going S seconds after the
start are stopped (SIGTERM to torchrun, then SIGKILL after a 40-s grace period), those not started never start,
and what finished is reported (exit status 3). Results: the report on stdout and a strict JSON file (non-finite
values as null), --json or <out>/val_noise.json, never written over an existing file. --resume is refused: each
process starts from its seed's fresh model.
"""

from __future__ import annotations

import argparse
import math
import os
import re
import shlex
import shutil
import subprocess
import sys
import time
import warnings
from collections import deque
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Callable, Protocol

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))  # the repository root (bench/ab.py)
from bench import ab  # noqa: E402
from bench.ab import LABELS, ABError, Version  # noqa: E402

PROG = "bench/val_noise.py"
JSON_NAME = "val_noise.json"
CHECK_FOLDER = "check"  # in --out: the version check's run logs
DEADLINE_EXIT_STATUS = ab.HUNG_EXIT_STATUS
INTERRUPTED_EXIT_STATUS = 128 + 2  # SIGINT's, as train_gpt.py exits after one
GRACE_S = ab.STOP_GRACE_S  # after SIGTERM: torchrun's own 30 s to end its ranks, and some (as bench/ab.py's whole runs)
POLL_S = 0.05
TOOL_FLAGS = ("seed", "log_dir")  # set per run by this tool
RESUME_REFUSED = f"{PROG} starts each process from its seed's fresh model; drop --resume"
# train_gpt.py's line (stderr) when a non-finite loss stops the run (RunStopped, exit status 3)
STOP_LINE = re.compile(r"^step (\d+): non-finite (training|validation) loss \(([^)]*)\); stopping$", re.MULTILINE)


@dataclass
class Run:
    label: str
    seed: int
    cmd: list[str]
    out: Path  # the run's stdout and stderr
    log_dir: Path


@dataclass
class RunResult:
    label: str
    seed: int
    # finished (a diverged run too: its val loss not finite), failed (non-zero exit or no final val line, not
    # diverged), deadline (stopped by it), cancelled (stopped after another run failed), interrupted (stopped
    # by Ctrl-C), not started
    status: str
    out: str
    val_loss: float = math.nan
    peak_allocated_mib: float = math.nan
    exit_status: int | None = None
    problem: str = ""  # why it failed, in words
    stop_line: str = ""  # a diverged run's stop line from train_gpt.py, when it printed one
    started_s: float | None = None  # seconds after the pool began: when it started (None: never) and ended
    ended_s: float | None = None


class Process(Protocol):
    """What the pool needs of a started run (subprocess.Popen; a stand-in in the tests)."""

    def poll(self) -> int | None: ...
    def terminate(self) -> None: ...
    def kill(self) -> None: ...
    def wait(self, timeout: float | None = None) -> int: ...


# =============================================================================================
# Runs: their commands, their order, and what a run's output says
# =============================================================================================
def run_command(script: Path, overrides: list[str], seed: int, log_dir: Path) -> list[str]:
    """One fresh single-GPU process of the script, as bench/ab.py starts a whole run; the seed and log folder last."""
    return [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=1", str(script),
        *overrides, f"--seed={seed}", f"--log_dir={log_dir}",
    ]


def plan_runs(versions: list[Version], overrides: list[str], folder: Path, processes: int) -> list[Run]:
    """Seeds 1..processes, interleaved (baseline seed 1, candidate seed 1, baseline seed 2, ...): with --concurrent 2
    the two runs of a seed train side by side, under the same conditions."""
    runs = []
    for seed in range(1, processes + 1):
        for version in versions:
            log_dir = folder / version.label / f"seed{seed}" / "logs"
            out = folder / f"{version.label}.seed{seed}.out"
            runs.append(Run(version.label, seed, run_command(version.script, version.overrides(overrides), seed, log_dir), out, log_dir))
    return runs


@dataclass
class Output:
    """What a run's output says: its last val line (bench/ab.py's pattern; None: none), its last peak memory line's
    MiB (NaN: none) and train_gpt.py's non-finite stop line (empty: none)."""

    last_val: ab.ValLine | None
    peak_mib: float
    stop_line: str = ""

    @property
    def diverged(self) -> bool:
        """A non-finite loss ended the run: its last val line is not finite, or train_gpt.py said it stopped for one."""
        return bool(self.stop_line) or (self.last_val is not None and not math.isfinite(self.last_val.loss))

    @property
    def final(self) -> bool:
        """The last val line is the final step's (step N/N): a run stopped earlier printed only mid-run ones."""
        return self.last_val is not None and self.last_val.step == self.last_val.total


def parse_output(text: str) -> Output:
    last_val, peak = ab.last_val_and_peak(text)
    stops = STOP_LINE.findall(text)
    stop_line = f"step {stops[-1][0]}: non-finite {stops[-1][1]} loss ({stops[-1][2]}); stopping" if stops else ""
    return Output(last_val, peak, stop_line)


def exit_words(code: int) -> str:
    return f"was killed by signal {-code}" if code < 0 else f"exited with status {code}"


def read_result(run: Run, code: int) -> RunResult:
    """A run that exited: finished with its final val loss; finished with a non-finite loss when it diverged, whatever
    its exit status (train_gpt.py exits 3, torchrun then 1); else failed (a non-zero exit, or no final val line)
    with why."""
    text = run.out.read_text(errors="replace") if run.out.is_file() else ""
    output = parse_output(text)
    result = RunResult(run.label, run.seed, "finished", str(run.out), peak_allocated_mib=output.peak_mib, exit_status=code)
    if output.diverged:
        last = output.last_val
        result.val_loss = last.loss if last is not None and not math.isfinite(last.loss) else math.nan
        result.stop_line = output.stop_line
    elif code != 0:
        result.status, result.problem = "failed", exit_words(code)
    elif not output.final:
        last = "" if output.last_val is None else f" (its last was step {output.last_val.step}/{output.last_val.total})"
        result.status, result.problem = "failed", f"exited with status 0 but printed no final val line{last}"
    else:
        result.val_loss = output.last_val.loss
    return result


# =============================================================================================
# The pool
# =============================================================================================
def start_run(run: Run) -> subprocess.Popen:
    """Starts the run from the repository root (relative paths in the overrides mean the same files for every
    version, as in bench/ab.py), its output into its .out file, with this environment (the default compile caches)."""
    with open(run.out, "w") as handle:  # the child keeps its own descriptor
        return subprocess.Popen(run.cmd, cwd=REPO, stdout=handle, stderr=subprocess.STDOUT)


def run_pool(
    runs: list[Run], concurrent: int, deadline: float | None, start: Callable[[Run], Process] = start_run,
    grace_s: float = GRACE_S, poll_s: float = POLL_S, stagger_s: float = 0.0,
) -> list[RunResult]:
    """Starts the runs in their order, at most `concurrent` at once and each at least `stagger_s` after the one before,
    and returns their results in that order. One thread polls them all, so the start order is the plan's. At the
    deadline (time.monotonic()) or after a failed run the runs in flight are stopped and the rest never start: a
    failure ends the invocation, and its GPU time is better spent on the fix. Before stopping, the runs in flight are
    polled once more: one that exited since its last poll keeps its result."""
    pending = deque(enumerate(runs))
    active: dict[int, tuple[Run, Process]] = {}
    results: dict[int, RunResult] = {}
    started: dict[int, float] = {}
    stopping: str | None = None
    began = time.monotonic()
    last_start = -math.inf

    def since_began() -> float:
        return time.monotonic() - began

    def poll_all() -> bool:
        """Reads the runs that exited; True when one failed."""
        failed = False
        for index, (run, process) in list(active.items()):
            if (code := process.poll()) is not None:
                results[index] = read_result(run, code)
                results[index].started_s, results[index].ended_s = started[index], since_began()
                del active[index]
                failed = failed or results[index].status == "failed"
        return failed

    while pending or active:
        try:
            if poll_all():
                stopping = "cancelled"
            if stopping is None and deadline is not None and time.monotonic() >= deadline:
                stopping = "deadline"
            if stopping is None:
                while pending and len(active) < concurrent and time.monotonic() - last_start >= stagger_s:
                    index, run = pending.popleft()
                    last_start, started[index] = time.monotonic(), since_began()
                    active[index] = (run, start(run))
                time.sleep(poll_s)
                continue
        except KeyboardInterrupt:  # Ctrl-C: the runs in flight are stopped as at the deadline, not left running
            stopping = "interrupted"
        poll_all()  # a run that exited between its poll and the stop finished
        ab.stop_processes([process for _, process in active.values()], grace_s)
        for index in started.keys() - results.keys():  # those in flight, and one a Ctrl-C caught inside start()
            run = runs[index]
            results[index] = RunResult(run.label, run.seed, stopping, str(run.out), started_s=started[index], ended_s=since_began())
        results |= {index: RunResult(run.label, run.seed, "not started", str(run.out)) for index, run in pending}
        break
    return [results[index] for index in range(len(runs))]


def first_failure(results: list[RunResult]) -> RunResult | None:
    return next((r for r in results if r.status == "failed"), None)


# =============================================================================================
# Statistics and the report
# =============================================================================================
def paired_t_test(candidate: list[float], baseline: list[float]) -> tuple[float, float]:
    """scipy.stats.ttest_rel of candidate against baseline (t has the sign of B-A); NaN for fewer than 2 pairs, and
    scipy's NaN or inf where the differences do not vary."""
    if len(candidate) < 2:
        return math.nan, math.nan
    from scipy import stats

    with warnings.catch_warnings():  # identical differences: a precision warning; the result says it (NaN or inf)
        warnings.simplefilter("ignore", RuntimeWarning)
        result = stats.ttest_rel(candidate, baseline)
    return float(result.statistic), float(result.pvalue)


def summarize(results: list[RunResult], seeds: list[int]) -> dict[str, Any]:
    """Each version's mean and sd over processes, the paired differences and their t-test, all over the seeds where
    both versions finished with a finite val loss (val_seeds): both sides stand on the same seeds. val_not_finite
    names the finished runs left out for their loss, unfinished_seeds those a run of which did not finish. Peak memory
    is the largest over each version's finished runs."""
    by = {(r.label, r.seed): r for r in results}

    def finished(label: str, seed: int) -> bool:
        return (label, seed) in by and by[(label, seed)].status == "finished"

    both = [s for s in seeds if all(finished(label, s) for label in LABELS)]
    not_finite = [
        dict(seed=s, version=label, value=str(by[(label, s)].val_loss))
        for s in both for label in LABELS if not math.isfinite(by[(label, s)].val_loss)
    ]
    used = [s for s in both if all(math.isfinite(by[(label, s)].val_loss) for label in LABELS)]
    val_a = [by[("baseline", s)].val_loss for s in used]
    val_b = [by[("candidate", s)].val_loss for s in used]
    diffs = [b - a for a, b in zip(val_a, val_b)]
    t, p = paired_t_test(val_b, val_a)
    peaks = {label: ab._finite_max([r.peak_allocated_mib for r in results if r.label == label and r.status == "finished"]) for label in LABELS}
    return dict(
        val_seeds=used, val_not_finite=not_finite, unfinished_seeds=[s for s in seeds if s not in both],
        baseline_val_mean=ab._mean(val_a), baseline_val_sd=ab._sd(val_a),
        candidate_val_mean=ab._mean(val_b), candidate_val_sd=ab._sd(val_b),
        val_diff_mean=ab._mean(diffs), val_diff_sd=ab._sd(diffs), val_diffs=diffs,
        t_statistic=t, p_value=p, test="scipy.stats.ttest_rel(candidate, baseline)",
        baseline_peak_mib=peaks["baseline"], candidate_peak_mib=peaks["candidate"],
    )


def cell(result: RunResult | None) -> str:
    """A run's val loss as the table shows it: the loss, nan/inf, or what became of an unfinished run."""
    if result is None or result.status == "not started":
        return "not run"
    if result.status != "finished":
        return "stopped" if result.status in ("deadline", "cancelled", "interrupted") else result.status
    return f"{result.val_loss:.4f}" if math.isfinite(result.val_loss) else str(result.val_loss)


def report_lines(results: list[RunResult], seeds: list[int], summary: dict[str, Any]) -> list[str]:
    by = {(r.label, r.seed): r for r in results}
    lines = [f"{'seed':>4} {'baseline val':>14} {'candidate val':>15} {'B-A':>9}"]
    for seed in seeds:
        a, b = by.get(("baseline", seed)), by.get(("candidate", seed))
        diff = "-"
        if seed in summary["val_seeds"]:
            diff = f"{b.val_loss - a.val_loss:+.4f}"
        lines.append(f"{seed:>4} {cell(a):>14} {cell(b):>15} {diff:>9}")
    s, n = summary, len(summary["val_seeds"])
    if s["val_not_finite"]:
        which = ", ".join(f"seed {e['seed']} {e['version']} {e['value']}" for e in s["val_not_finite"])
        lines.append(f"val loss not finite: {which} (a diverged run); those seeds are left out of the figures below")
    if s["unfinished_seeds"]:
        lines.append(f"not finished by both versions: seed(s) {', '.join(map(str, s['unfinished_seeds']))}; left out of the figures below")
    over = "" if n == len(seeds) else f", seeds {', '.join(map(str, s['val_seeds'])) or 'none'}"
    for label in LABELS:
        lines.append(f"{label}: mean {ab._stat(s[f'{label}_val_mean'], '.4f')}, sd over processes {ab._stat(s[f'{label}_val_sd'], '.4f')} ({n} process{'es' * (n != 1)}{over})")
    lines.append(
        f"paired difference B-A: mean {ab._stat(s['val_diff_mean'], '+.4f')}, sd {ab._stat(s['val_diff_sd'], '.4f')}; "
        f"paired t-test (scipy.stats.ttest_rel) t={ab._stat(s['t_statistic'], '+.3f')}, p={ab._stat(s['p_value'], '.3g')}"
    )
    lines.append(f"peak allocated: baseline {ab._gib(s['baseline_peak_mib'])}, candidate {ab._gib(s['candidate_peak_mib'])}")
    spans = [f"{r.label} {r.seed} {r.started_s:.0f}-{r.ended_s:.0f}" for r in results if r.started_s is not None]
    lines.append(f"runs, seconds after the first start (for planning an invocation): {', '.join(spans) or 'none started'}")
    lines.append("nothing was timed: concurrent runs share the GPU and each run's start-up is part of it (time with bench/ab.py)")
    return lines


def device_name() -> str:
    """The GPU the runs use, named by nvidia-smi: this process never initialises CUDA itself, whose context would take
    memory from the runs. "cpu" without nvidia-smi, "unknown" when it fails."""
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return "cpu"
    try:
        result = subprocess.run([smi, "--query-gpu=name", "--format=csv,noheader", "-i", ab.gpus_of_workers(1)[0]],
                                capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return "unknown"
    names = result.stdout.strip().splitlines()
    return names[0].strip() if result.returncode == 0 and names else "unknown"


# =============================================================================================
# Command line
# =============================================================================================
def tool_flag_refusal(overrides: list[str]) -> str | None:
    """Why the overrides cannot be taken, or None: this tool sets --seed (the pairing) and --log_dir (one folder per
    run) itself, and train_gpt.py would take whichever comes last."""
    for word in overrides:
        for name in TOOL_FLAGS:
            if word == f"--{name}" or word.startswith(f"--{name}="):
                return f"{word}: {PROG} sets --{name} of each run itself (seeds 1..--processes, logs under --out); drop it"
        if word == "--resume" or word.startswith("--resume="):
            return f"{word}: {RESUME_REFUSED}"
    return None


def parse_arguments(argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
    overrides: list[str] = []
    if "--" in argv:
        cut = argv.index("--")
        argv, overrides = argv[:cut], argv[cut + 1 :]
    parser = ab.OneLineParser(
        prog=PROG, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
        usage=f"python {PROG} [--baseline V] [--candidate V] [--processes N] [--concurrent K] [options] -- <train_gpt.py overrides>",
    )
    ab.add_version_arguments(parser)
    parser.add_argument("--processes", type=int, default=3, help="fresh processes per version, seeds 1..N (default 3; at least 2)")
    parser.add_argument(
        "--concurrent", type=int, default=1,
        help="runs at once, sharing the GPU (default 1); 2 hides one run's start-up behind another's training. "
        "Nothing is timed, so sharing is harmless to the val losses compared",
    )
    parser.add_argument(
        "--stagger", type=float, default=0.0, metavar="S",
        help="start each run at least S seconds after the one before (default 0). Runs started together spend their "
        "start-up together, with the GPU idle; staggered by about one start-up, one compiles while another trains",
    )
    parser.add_argument(
        "--deadline", type=float, default=0.0,
        help="seconds after the start at which the runs still going are stopped and what finished is reported (exit "
        "status 3; default 0: none); give the call's limit less about 90 s (a stopped run gets up to 40 s to end, "
        "then the report and JSON follow)",
    )
    parser.add_argument("--out", type=Path, help="working folder (default bench/out/val_noise/<time>-<pid>, created new)")
    parser.add_argument("--json", type=Path, help=f"results file (default <out>/{JSON_NAME})")
    parser.add_argument("--dry-run", action="store_true", help="resolve, extract and check both versions, print the plan, run nothing")
    args = parser.parse_args(argv)
    if refusal := ab.count_refusal("--processes", args.processes, 2, ab.MOST_COUNT):
        parser.error(f"{refusal} (an sd over processes needs 2)")
    if refusal := ab.count_refusal("--concurrent", args.concurrent, 1, ab.MOST_COUNT):
        parser.error(refusal)
    if not (math.isfinite(args.stagger) and args.stagger >= 0):
        parser.error(f"--stagger={args.stagger}: give finite seconds >= 0 (0: none)")
    if not (math.isfinite(args.deadline) and args.deadline >= 0):
        parser.error(f"--deadline={args.deadline}: give finite seconds >= 0 (0: none)")
    if args.json is not None and args.json.exists():
        parser.error(f"--json {args.json}: the file exists, and results are never overwritten; pass another path")
    if args.json is not None and (refusal := ab.json_folder_refusal(args.json, args.out, own_names=(CHECK_FOLDER,))):
        parser.error(refusal)
    for name in ("baseline_flags", "candidate_flags"):
        try:
            words = shlex.split(getattr(args, name))
        except ValueError as error:
            parser.error(f"--{name.replace('_', '-')}: {error}")
        if refusal := tool_flag_refusal(words):
            parser.error(refusal)
    if refusal := tool_flag_refusal(overrides):
        parser.error(refusal)
    return args, overrides


def prepare_versions(args: argparse.Namespace, overrides: list[str], folder: Path) -> tuple[list[Version], dict[str, Any]]:
    """bench/ab.py's resolution: plan both versions, refuse a folder with an earlier invocation's files (or results),
    write them, then check that each accepts the overrides with a seed and a log folder as the runs pass them."""
    ab.make_out_folder(folder)
    extractions = [
        ab.plan_version("baseline", args.baseline, folder, flags=shlex.split(args.baseline_flags)),
        ab.plan_version("candidate", args.candidate, folder, flags=shlex.split(args.candidate_flags)),
    ]
    ab.check_fresh(folder, extractions, results_name=JSON_NAME, tool_folders=(CHECK_FOLDER,))
    versions = [extraction.write() for extraction in extractions]
    tool_flags = [f"--seed={args.processes}", f"--log_dir={folder / CHECK_FOLDER / 'logs'}"]
    checks = {v.label: ab.check_version(v, [*overrides, *tool_flags]) for v in versions}
    for v in versions:
        if refusal := check_refusal(v, checks[v.label]):
            raise ABError(refusal)
    return versions, checks


def check_refusal(version: Version, check: dict[str, Any]) -> str | None:
    """Why a checked version cannot be run here, or None: a script whose parsed settings lack seed or log_dir (or
    that parses no overrides at all) would run unseeded, into the repository's logs/, while the report pairs by
    seed; and one that resumes a checkpoint (a preset's --resume) would not start from its seed's fresh model."""
    settings = check.get("settings")
    missing = [f"--{name}" for name in TOOL_FLAGS if settings is None or name not in settings]
    if missing:
        how = "parses no overrides (no parse_args)" if settings is None else f"has no {' or '.join(n[2:] for n in missing)} setting"
        return (f"{version.label} ({version.origin}): {version.script} {how}, so {' and '.join(missing)} would not reach its runs "
                f"(unseeded, unpaired runs); pass a version of train_gpt.py that takes --seed and --log_dir")
    if check.get("resume"):
        return f"{version.label} ({version.origin}): its settings resume {check['resume']!r}; {RESUME_REFUSED}"
    return None


def version_record(version: Version) -> dict[str, Any]:
    """A version as the JSON holds it; without bench/ab.py's timing mode, which means nothing here (every run is a
    fresh process of the script)."""
    record = asdict(version) | dict(script=str(version.script))
    del record["mode"]
    return record


def run_invocation(args: argparse.Namespace, overrides: list[str]) -> int:
    started_at = time.monotonic()
    folder = (args.out or new_default_folder()).resolve()
    versions, checks = prepare_versions(args, overrides, folder)
    for v in versions:
        print(f"{v.label}: {v.origin}{ab.describe_flags(v)} -> {v.script}, {checks[v.label]['train_steps'] or 'unknown'} training steps")
    seeds = list(range(1, args.processes + 1))
    runs = plan_runs(versions, overrides, folder, args.processes)
    deadline = f"; deadline {args.deadline:.0f} s" if args.deadline else ""
    stagger = f", each at least {args.stagger:.0f} s after the one before" if args.stagger else ""
    print(f"plan: {len(runs)} fresh processes, seeds 1..{args.processes} per version, at most {args.concurrent} at once{stagger}{deadline}; "
          f"order {', '.join(f'{r.label} {r.seed}' for r in runs)}; nothing is timed", flush=True)
    if args.dry_run:
        return 0
    device = device_name()  # before the runs: nothing slow follows the deadline
    results = run_pool(runs, args.concurrent, started_at + args.deadline if args.deadline else None, stagger_s=args.stagger)
    summary = summarize(results, seeds)
    print("\n".join(report_lines(results, seeds, summary)))
    failed = first_failure(results)
    stopped = [] if failed else [r for r in results if r.status in ("deadline", "interrupted", "not started")]  # else the failure stopped them
    interrupted = any(r.status == "interrupted" for r in results)
    if stopped:
        cause = "interrupted (Ctrl-C)" if interrupted else f"deadline {args.deadline:.0f} s"
        print(f"{cause}: stopped {', '.join(f'{r.label} seed {r.seed} ({r.status})' for r in stopped)}", flush=True)
    report = dict(
        command=sys.argv, overrides=overrides, device=device, processes=args.processes, concurrent=args.concurrent,
        stagger_s=args.stagger, deadline_s=args.deadline, elapsed_s=time.monotonic() - started_at,  # wall time with start-ups: for planning, not a timing
        versions=[version_record(v) for v in versions],
        runs=[asdict(r) for r in results], summary=summary,
    )
    json_path = ab.write_new_results(args.json or folder / JSON_NAME, report, folder)  # a failure's too: the finished runs' results are never lost
    if failed is not None:
        raise ABError(f"{failed.label} seed {failed.seed}: the run {failed.problem}; see {failed.out}; what finished is in {json_path}")
    print(f"json: {json_path}")
    return INTERRUPTED_EXIT_STATUS if interrupted else DEADLINE_EXIT_STATUS if stopped else 0


def new_default_folder() -> Path:
    """bench/out/val_noise/<time>-<pid>, created here and new: two invocations started in the same second get
    folders of their own (mkdir refuses one that exists)."""
    folder = REPO / "bench" / "out" / "val_noise" / f"{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}"
    folder.parent.mkdir(parents=True, exist_ok=True)
    try:
        folder.mkdir()
    except FileExistsError:
        raise ABError(f"{folder} exists already (another invocation's); pass --out") from None
    return folder


def main() -> None:
    args, overrides = parse_arguments(sys.argv[1:])
    try:
        sys.exit(run_invocation(args, overrides))
    except ABError as error:
        print(f"{PROG}: error: {error}", file=sys.stderr)
        sys.exit(2)


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")  # the runs inherit it: a stopped run's .out keeps its last lines
    main()
