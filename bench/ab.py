"""Paired A/B timing of two versions of train_gpt.py on the same GPUs, in one invocation.

    python bench/ab.py --baseline HEAD --candidate WORKTREE [--nproc N] [--rounds R] -- <train_gpt.py overrides>

A version is a git revision (its train_gpt.py), a .py file, a run log or a record folder (the script the
log embeds, as `tools/records.py extract` writes it), or WORKTREE (the working tree's train_gpt.py).

How it times (why: these machines drift by several percent from call to call, so only an interleaved
comparison in one invocation is a comparison):
  * Each version runs in its own resident process group (torchrun, --nproc processes on the same GPUs),
    compiled and warmed up once. Both groups stay alive; only one trains at a time.
  * Round r trains version A, then version B, over the same full schedule from the same starting point:
    the model re-initialised with seed r (the same seed for A and B), optimizer state reset, a fresh loader.
    With --order abba every second round trains B first, so that an effect of the slot itself (measured
    once: the second slot 0.38% slower with the same code on both sides, bench/NOTES.md) cancels over an
    even number of rounds; the report then estimates that effect from the rounds of each order. When a time
    limit or deadline ends the rounds after an odd number, one more round trained the baseline first: the
    report says so (the ratio's median and mean then carry part of the slot effect) and the JSON records
    abba_rounds (the completed rounds per order) and abba_balanced.
  * The timed segment is steps skip..T (synchronized at both ends; validation inside it is left out),
    so each round gives ms/step for A and for B, and their ratio B/A is paired by round.
  * MFU: each version's model FLOPs per step (6 x the parameters of the matrices multiplied in the forward x tokens
    per step, as bench/bench_train_gpt.py counts them; the worker asks the script's matmul_parameter_count) over the
    median ms/step and --nproc x --peak-tflops. A script that does not give its count: "not reported".
  * The val losses at the end of each round are paired by seed. Their spread over seeds is the noise
    within a process; separate processes of the same code differ by more (about 0.02 at step 120 on the
    proxy data, bench/NOTES.md), so one invocation's paired difference is one draw of that noise.
    A val loss that is not finite (a diverged round; a whole run without a val line) is shown as nan/inf in
    its round, named in a line, and left out of the val loss figures with its round: means, sds and the
    paired difference are over the rounds where both versions' losses are finite (the JSON's val_rounds; its
    val_not_finite lists the others), so that both sides stand on the same seeds.
  * --profile-steps N: afterwards N steps of each version under torch.profiler: kernel time by kind and
    the top kernels, the GPU's idle time between kernels, and how much of it the GPU spent waiting for the
    host (gaps after which the next launch came only after the GPU had gone idle). The profiled steps are
    S+1..S+N with --profile-from S (default: --skip); the window schedule widens attention over the run, so
    the timed segment's first steps are not its typical ones (bench/NOTES.md, 2026-12-06).
  * --time-limit S: on a machine that limits each command to S seconds, a round (or the profile) that the last round's
    duration says would not fit is left out, and the rounds run so far are reported rather than lost.
  * --deadline S: a worker still busy S seconds after the start (hung, or far slower than planned) is
    stopped after writing every thread's Python stack, which is printed; the rounds so far are reported and
    the exit status is 3 (a worker once hung before its first step until the call was killed, and the call's
    output went with it: bench/NOTES.md, 2026-12-02, commit 1c45907). Under such a limit: a little below it.

Track 3 (`--train-script train_gpt_shampoo.py`): the versions are that script (and the distributed_shampoo package of
the same revision, log or working tree), and --baseline-flags / --candidate-flags add overrides to one side only,
so one invocation can also compare two flag sets of one version, e.g. Shampoo against its AdamW ablation:

    python bench/ab.py --train-script train_gpt_shampoo.py --baseline WORKTREE --candidate WORKTREE \
        --baseline-flags=--matrix_optimizer=adamw --rounds 2 -- <train_gpt_shampoo.py overrides>

Its resident workers run the script's own trials: each round is one run_trial() (fresh initialisation with the
round's seed, fresh optimizers and loader, as a trial of the script is), timed over steps skip..T of its
train_step() calls with the validations inside the segment left out. Hence --resume is refused.

A version whose script lacks either structure (e.g. an older record's own script) is timed whole-run: each round is a fresh process with the compile caches of its first (untimed) run,
timed from its own step lines. Results: a table on stdout and a JSON file (--json, default beside the
extracted versions in bench/out/ab/<time>/). The JSON is strict: a value that is not finite (a NaN or inf
val loss, an sd of one round, a second-slot effect without a round of each order) is null, and the report
prints such a figure as "undefined" (a round's own loss as nan or inf). It is never written over a file:
one that appeared at --json during the run is kept, and the results go to a new file in --out, named in the
error. --out is a new or empty folder, or one that holds only this tool's own files of a --dry-run.
"""

from __future__ import annotations

import argparse
import ast
import copy
import dataclasses
import faulthandler
import inspect
import json
import math
import os
import re
import shlex
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable, NoReturn

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))  # the repository root (bench/scripts.py)
from bench.scripts import load_script  # noqa: E402

WORKTREE = "WORKTREE"
LABELS = ("baseline", "candidate")
MOST_COUNT = 1000  # rounds, steps, processes: a bound far above any invocation (a round takes minutes)
RESIDENT_NEEDS = {"run": (), "train": ("raw_model", "adam", "muon", "rt"), "print0": (), "evaluate": ()}
# train_gpt_shampoo.py: main() runs trials, each run_trial() calls train_step() per step and evaluate()
TRIALS_NEEDS = {"main": (), "run_trial": ("trial", "resume"), "train_step": (), "evaluate": ()}
STEP_LINE = re.compile(r"^step:(\d+)/(\d+) ")
TRAIN_TIME = re.compile(r"train_time:([0-9.]+)(ms|s)\b")
VAL_LINE = re.compile(r"^step:(\d+)/(\d+) val_loss:([-+0-9.naife]+)")
PEAK_LINE = re.compile(r"peak memory allocated: (\d+) MiB")
# Track 3: every round trains a trial from a fresh initialisation, so a checkpoint to continue from cannot apply
RESUME_REFUSED = "the Track 3 A/B trains every round from a fresh initialisation; drop --resume (continue a run with the script itself)"
POLL_S = 0.02
STACK_DUMP_WAIT_S = 3.0
HUNG_EXIT_STATUS = 3


class ABError(Exception):
    """A bad version, option or failed worker: printed as one line."""


class WorkerTimeout(ABError):
    """A worker gave no expected signal by the invocation's --deadline: it hangs or is far too slow."""


# =============================================================================================
# Versions: resolve, extract, classify
# =============================================================================================
@dataclass
class Version:
    label: str  # "baseline" / "candidate"
    spec: str  # what the user passed
    origin: str  # where the script came from, in words
    script: Path  # the extracted training script
    mode: str  # "resident", "trials" or "whole-run"
    flags: list[str] = field(default_factory=list)  # overrides of this version only (after the common ones)

    def overrides(self, common: list[str]) -> list[str]:
        return [*common, *self.flags]


def _git(*args: str) -> str:
    result = subprocess.run(["git", *args], cwd=REPO, capture_output=True, text=True)
    if result.returncode != 0:
        raise ABError(f"git {' '.join(args)}: {result.stderr.strip().splitlines()[-1] if result.stderr.strip() else 'failed'}")
    return result.stdout


def _script_from_folder(folder: Path, target: Path) -> tuple[Path, dict[Path, bytes]]:
    """The first run log in the folder and the files it embeds. Every log there must embed the same files: of a folder
    of runs of several versions (e.g. logs/), the first by name would be an arbitrary one."""
    logs = sorted(p for p in folder.glob("*.txt") if p.is_file())
    if not logs:
        raise ABError(f"{folder}: no run logs (*.txt) in this folder; pass a log, a .py file or a git revision")
    files = _script_from_log(logs[0], target)
    for other in logs[1:]:
        if _script_from_log(other, target) != files:
            raise ABError(f"{folder}: its run logs embed different scripts ({logs[0].name} and {other.name}); pass the log of the version to time")
    return logs[0], files


def _script_from_log(log: Path, target: Path) -> dict[Path, bytes]:
    from tools.recordkit.errors import RecordsError
    from tools.recordkit.extract import extraction_plan

    try:
        plan = extraction_plan(log, target)
    except RecordsError as error:
        raise ABError(str(error)) from None
    return {path: text.encode("utf-8") for path, text in plan.items()}


@dataclass
class Extraction:
    """What resolving a version writes into the --out folder (nothing is written until both versions are resolved
    and checked against what the folder holds, see check_fresh)."""
    version: Version
    files: dict[Path, bytes]  # path -> content; the script among them

    def write(self) -> Version:
        for path, content in self.files.items():
            path.parent.mkdir(parents=True, exist_ok=True)
            if not path.is_file() or path.read_bytes() != content:  # an identical earlier copy is left as it is
                path.write_bytes(content)
        self.version.mode = classify(self.version.script, self.version.origin)
        return self.version


def plan_version(label: str, spec: str, folder: Path, script: str = "train_gpt.py", flags: list[str] | None = None) -> Extraction:
    """What the version writes to folder/label/<script>: its script, and a revision's distributed_shampoo package beside
    it when the script uses it (the working tree's stays where it is: the workers import it from the repository).
    Its mode is known once written (Extraction.write)."""
    target = folder / label / script
    path = Path(spec)
    if not spec.strip():  # Path("") is the current folder: the repository root's files would be read as logs
        raise ABError(f"--{label} is empty; pass a git revision, a .py file, a run log or a record folder")
    if spec == WORKTREE:
        if not (REPO / script).is_file():
            raise ABError(f"--train-script={script}: no such file in the working tree {REPO}")
        files = {target: (REPO / script).read_bytes()}
        origin = f"the working tree's {script}"
    elif path.is_dir():
        log, files = _script_from_folder(path, target)
        origin = f"the script embedded in {log}"
    elif path.is_file() and path.suffix == ".py":
        files = {target: read_script(label, path)}
        origin = str(path)
    elif path.is_file():
        files = _script_from_log(path, target)
        origin = f"the script embedded in {path}"
    else:
        commit = _revision(label, spec)
        files = {target: _git("show", f"{commit}:{script}").encode("utf-8")}
        origin = f"{script} at {spec} ({commit})"
        if b"distributed_shampoo" in files[target]:
            files |= _package_files(commit, target.parent)
            origin += " with its distributed_shampoo"
    return Extraction(Version(label, spec, origin, target, "", list(flags or [])), files)


def read_script(label: str, path: Path) -> bytes:
    try:
        return path.read_bytes()
    except OSError as error:
        raise ABError(f"--{label} {path}: cannot read it ({error.strerror}); check its permissions or pass another file") from None


def resolve_version(label: str, spec: str, folder: Path, script: str = "train_gpt.py", flags: list[str] | None = None) -> Version:
    """Writes the version's files (plan_version) and classifies its script."""
    return plan_version(label, spec, folder, script, flags).write()


def _revision(label: str, spec: str) -> str:
    """The commit of a version given as a git revision. A spec that is no revision and no existing path, but is named
    like a file (a .py script, a run log's suffix) or a path (a separator in it: a record folder), was probably meant
    as a file or folder: said so in one line, rather than git's complaint about a revision. 'origin/main' has a
    separator too, hence only when git fails, and in words that fit both."""
    from tools.recordkit.parse import LOG_SUFFIXES

    try:
        return _git("rev-parse", "--short", f"{spec}^{{commit}}").strip()
    except ABError as error:
        path_like = Path(spec).suffix in (".py", *LOG_SUFFIXES) or os.sep in spec or "/" in spec
        if not path_like or os.path.exists(spec):  # (a dangling link does not exist: it is named as missing)
            raise ABError(f"--{label} {spec}: not a git revision ({error}); pass a revision, or a script, run log or record folder") from None
        raise ABError(
            f"--{label} {spec}: no such file or folder, and not a git revision; pass an existing script, run log or "
            "record folder, or a git revision"
        ) from None


def _package_files(commit: str, folder: Path) -> dict[Path, bytes]:
    """The revision's distributed_shampoo/ files, as they go into folder (git archive, read with tarfile)."""
    import io
    import tarfile

    result = subprocess.run(["git", "archive", commit, "distributed_shampoo"], cwd=REPO, capture_output=True)
    if result.returncode != 0:
        raise ABError(f"git archive {commit} distributed_shampoo: {result.stderr.decode(errors='replace').strip() or 'failed'}")
    with tarfile.open(fileobj=io.BytesIO(result.stdout)) as archive:
        return {folder / member.name: archive.extractfile(member).read() for member in archive.getmembers() if member.isfile()}


def classify(script: Path, origin: str | None = None) -> str:
    """resident when the script has train_gpt.py's structure (run, train with the objects a round resets); trials
    when it has train_gpt_shampoo.py's (main, run_trial, train_step, evaluate); whole-run otherwise. origin: what the
    user passed, named in the refusal of a script that is not Python (script is then the copy in --out)."""
    try:  # bytes: ast honours a coding declaration, and bytes it cannot decode are a SyntaxError, not a traceback
        tree = ast.parse(script.read_bytes(), filename=str(script))
    except SyntaxError as error:
        where = f", line {error.lineno}" if error.lineno is not None else ""
        shown = f"{origin} (copied to {script})" if origin is not None else str(script)
        raise ABError(f"{shown}: not valid Python ({error.msg}{where}); pass a script that Python can import") from None
    functions = {node.name: node for node in tree.body if isinstance(node, ast.FunctionDef)}

    def has(needs: dict[str, tuple[str, ...]]) -> bool:
        for name, params in needs.items():
            if name not in functions:
                return False
            names = {arg.arg for arg in functions[name].args.args + functions[name].args.kwonlyargs}
            if not set(params) <= names:
                return False
        return True

    if has(RESIDENT_NEEDS):
        return "resident"
    return "trials" if has(TRIALS_NEEDS) else "whole-run"


def check_version(version: Version, overrides: list[str]) -> dict[str, Any]:
    """Imports the version in a fresh interpreter and parses its overrides with its own parser."""
    cmd = [sys.executable, str(Path(__file__).resolve()), "--check-script", str(version.script), "--", *version.overrides(overrides)]
    result = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO)
    if result.returncode != 0:
        last = (result.stderr.strip() or result.stdout.strip() or "no output").splitlines()[-1]
        raise ABError(f"{version.label} ({version.origin}) does not accept the overrides: {last}")
    check = _check_result(result.stdout)
    if check is None:
        lines = result.stdout.strip().splitlines()
        got = f"its last line was {lines[-1][:80]!r}" if lines else "it printed nothing"
        raise ABError(
            f"{version.label} ({version.origin}): importing {version.script} exited with status 0 before the check's result "
            f"(a JSON line with its training steps was expected; {got}); pass a script that does not exit when imported"
        )
    return check


def _check_result(stdout: str) -> dict[str, Any] | None:
    """The JSON object _check_script_main prints last; None when there is none (the script's import exited first,
    e.g. a sys.exit() at its top level)."""
    lines = stdout.strip().splitlines()
    if not lines:
        return None
    try:
        check = json.loads(lines[-1])
    except json.JSONDecodeError:
        return None
    return check if isinstance(check, dict) and "train_steps" in check else None


def _check_script_main(script: Path, overrides: list[str]) -> None:
    _import_path_for(script)
    module = _load_module(script)
    if hasattr(module, "parse_args"):
        try:
            hp = module.parse_args(overrides)[0]
        except getattr(module, "UserError", ()) as error:  # () catches nothing: a script without UserError says why itself
            raise SystemExit(f"{script}: {error}")
        steps = hp.train_steps if hasattr(hp, "train_steps") else hp.num_iterations + getattr(hp, "iteration_extension", 0)
        print(json.dumps({"train_steps": int(steps), "resume": getattr(hp, "resume", ""), "settings": _setting_names(hp)}))
    else:  # settings None: the script parses no overrides here (flags such as --seed may never reach it)
        print(json.dumps({"train_steps": None, "resume": "", "settings": None}))


def _setting_names(hp: Any) -> list[str]:
    """The parsed hyperparameters' field names (a dataclass's fields, else its attributes): which flags the script
    takes, e.g. whether --seed reaches it."""
    if dataclasses.is_dataclass(hp):
        return sorted(f.name for f in dataclasses.fields(hp))
    return sorted(name for name in getattr(hp, "__dict__", {}) if not name.startswith("_"))


def _import_path_for(script: Path) -> None:
    """Where the script's own imports (distributed_shampoo) come from: a package extracted beside it, else the
    repository's."""
    sys.path.insert(0, str(REPO))
    if (script.parent / "distributed_shampoo").is_dir():
        sys.path.insert(0, str(script.parent.resolve()))


def _load_module(script: Path) -> Any:
    return load_script(script, "train_gpt")  # as the script itself: its custom ops are named train_gpt::...


# =============================================================================================
# Control files: the coordinator and the workers take turns through a folder
# =============================================================================================
class Control:
    def __init__(self, folder: Path, label: str):
        self.folder, self.label = folder, label

    def path(self, what: str) -> Path:
        return self.folder / f"{self.label}.{what}"

    def signal(self, what: str, payload: dict | None = None) -> None:
        temporary = self.path(what + ".tmp")
        temporary.write_text(json.dumps(payload or {}))
        os.replace(temporary, self.path(what))  # readers never see a half-written file

    def wait_first(
        self, whats: tuple[str, ...], alive: Callable[[], bool] = lambda: True, timeout_s: float = 3600.0, deadline: float | None = None
    ) -> str:
        """Blocks until one of the signals exists and returns its name. deadline (time.monotonic()) is the
        invocation's (--deadline): passing it raises WorkerTimeout."""
        give_up = time.monotonic() + timeout_s
        while True:
            for what in whats:
                if self.path(what).exists():
                    return what
            if not alive():
                raise ABError(f"{self.label}: the worker exited before '{whats[0]}'; see {self.path('out')}")
            if deadline is not None and time.monotonic() > deadline:
                raise WorkerTimeout(f"{self.label}: no '{whats[0]}' by the deadline; see {self.path('out')}")
            if time.monotonic() > give_up:
                raise ABError(f"{self.label}: no '{whats[0]}' within {timeout_s:.0f} s; see {self.path('out')}")
            time.sleep(POLL_S)

    def wait(self, what: str, alive: Callable[[], bool] = lambda: True, deadline: float | None = None) -> dict:
        self.wait_first((what,), alive, deadline=deadline)
        return json.loads(self.path(what).read_text())

    def worker_pids(self) -> list[int]:
        """The process ids the worker ranks wrote at their start (see install_stack_dump) that still run this
        worker (a pid of an exited rank may have been given to another process since)."""
        pids = [json.loads(p.read_text())["pid"] for p in sorted(self.folder.glob(f"{self.label}.pid*")) if not p.name.endswith(".tmp")]
        return [pid for pid in pids if _runs_worker(pid, self.label)]


def _runs_worker(pid: int, label: str) -> bool:
    """Whether process pid is this invocation's worker for label (its command line, on Linux; elsewhere trusted)."""
    if not Path("/proc/self/cmdline").exists():
        return True
    try:
        words = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    except (FileNotFoundError, PermissionError):  # exited meanwhile, or not ours to read
        return False
    return b"--worker" in words and label.encode() in words


def install_stack_dump(control: Control, rank: int) -> None:
    """SIGUSR1 makes this process write every thread's Python stack to stderr (its .out file): the coordinator
    sends it to a worker that hangs, so that the report says where (faulthandler works while the main thread is
    stuck in C code, e.g. a CUDA wait). The pid file tells the coordinator whom to signal."""
    faulthandler.register(signal.SIGUSR1, file=sys.stderr, all_threads=True)
    control.signal(f"pid{rank}", dict(pid=os.getpid()))


def dump_stacks(control: Control) -> list[int]:
    """Asks each of the worker's ranks for its stacks; returns the pids signalled (exited ranks are skipped)."""
    return _signal_all(control.worker_pids(), signal.SIGUSR1)


def _signal_all(pids: list[int], signum: int) -> list[int]:
    """Sends signum to each pid; returns those reached (an exited one, or one not ours, is skipped)."""
    reached = []
    for pid in pids:
        try:
            os.kill(pid, signum)
        except (ProcessLookupError, PermissionError):
            continue
        reached.append(pid)
    return reached


# =============================================================================================
# Worker: one version, resident, driven round by round (runs under torchrun)
# =============================================================================================
class _EndRound(Exception):
    """Raised from the step-line hook to end a profiling round early (after its profiled steps)."""


@dataclass
class RoundTimer:
    first_step: int
    marks: dict[int, float] = field(default_factory=dict)  # step -> synchronized time, at the segment's ends
    segment_open: bool = False
    eval_inside_s: float = 0.0
    profile: Any = None
    profile_from: int = 0  # profiling starts after this step (--profile-from)
    profile_steps: int = 0
    profiling: bool = False
    validations_profiled: int = 0  # validation passes that ran while profiling (their kernels land in the table)

    def reset(self) -> None:
        """Before a round: no marks, no evaluation time, the segment closed."""
        self.marks, self.eval_inside_s, self.segment_open = {}, 0.0, False

    def profiler_action(self, steps_done: int) -> str | None:
        """With steps_done training steps done: "start" the profiler at profile_from, "stop" it profile_steps later."""
        if self.profile is None:
            return None
        if steps_done == self.profile_from:
            return "start"
        return "stop" if steps_done == self.profile_from + self.profile_steps else None

    def start_profile(self) -> None:
        self.profile.start()
        self.profiling = True

    def stop_profile(self) -> None:
        synchronize()
        self.profile.stop()
        self.profiling = False


KERNEL_KINDS = [  # first match wins; kernel names as they appear on Hopper with torch 2.11
    # (inductor's fused kernels next to it carry the op's name too, hence the anchor)
    # train_gpt.py's Triton kernel (the older name: backward only) and its epilogues on quack-kernels' GEMMs
    ("MLP matmuls with ReLU² epilogues", r"^_relu2_(backward_)?matmul_kernel|quack.*relu2_(forward|backward)_epilogue"),
    # flex's templates, flash-attn-4's CuTe kernels (FlashAttentionForwardSm90, ...) and the reduction inductor fuses
    # onto either backward (named after flex_attention_backward or train_gpt's fa4_backward), so both count alike
    ("attention (flex templates, flash-attn kernels)", r"flex|attention|triton_tem|fa4_"),
    # the head's three _scaled_mm calls ran as cuBLAS's nvjet_sm90_qqtst/qrtst/qrsss kernels, once per micro-step each,
    # in the profiles of 2026-12-06 (bench/NOTES.md), and the bf16 products' names had no q (before this, they counted as bf16)
    ("fp8 head (scaled_mm, casts, copies)", r"f8|fp8|e4m3|e5m2|softcap|^nvjet_sm\d+_q"),
    # before the GEMMs: an inductor kernel's name lists the ops its code came from, "mm" among them at times (at c03efbb,
    # 2026-12-07: 17.2 ms per step of norm backwards named "..._add_mm_mul_..." were counted as GEMMs)
    ("Triton fused (inductor)", r"^triton_"),
    ("bf16/fp32 GEMM", r"gemm|sm90|cutlass|xmma|cublas|nvjet|mm_"),
    ("Newton-Schulz kernels", r"_symmetric_matmul"),
    ("communication", r"nccl"),
]


def kind_of(kernel: str) -> str:
    for kind, pattern in KERNEL_KINDS:
        if re.search(pattern, kernel, re.IGNORECASE):
            return kind
    return "other"


def _kernel_table(prof: Any, steps: int, top: int = 40) -> list[dict]:
    import torch

    events = [
        e
        for e in prof.key_averages()
        if e.device_type == torch.autograd.DeviceType.CUDA and not getattr(e, "is_user_annotation", False)
    ]
    rows = [
        dict(kernel=e.key[:140], kind=kind_of(e.key), ms_per_step=e.self_device_time_total / steps / 1e3, calls_per_step=e.count / steps)
        for e in events
    ]
    rows.sort(key=lambda row: -row["ms_per_step"])
    kinds: dict[str, float] = {}
    for row in rows:
        kinds[row["kind"]] = kinds.get(row["kind"], 0.0) + row["ms_per_step"]
    summary = [dict(kernel=f"(all {kind})", kind="sum", ms_per_step=ms, calls_per_step=0) for kind, ms in sorted(kinds.items(), key=lambda kv: -kv[1])]
    total = dict(kernel="(all kernels)", kind="sum", ms_per_step=sum(r["ms_per_step"] for r in rows), calls_per_step=0)
    return [total, *summary, *_idle_gaps(prof, steps), *rows[:top]]


def split_idle(kernels: list[tuple[float, float, float | None]]) -> tuple[float, float, int, int]:
    """GPU idle time between kernels (start, end, start of the host call that launched it; None when unknown),
    split by cause: a gap is the host's when the kernel after it was launched after the GPU went idle (the
    GPU waited for the host), the GPU's own otherwise (queued work that started late). Returns (idle, host
    idle, gaps, host gaps), in the inputs' time unit."""
    idle = host_idle = 0.0
    gaps = host_gaps = 0
    busy_until: float | None = None
    for start, end, launched in sorted(kernels, key=lambda k: (k[0], k[1])):
        if busy_until is not None and start > busy_until:
            idle += start - busy_until
            gaps += 1
            if launched is not None and launched > busy_until:
                host_idle += start - busy_until
                host_gaps += 1
        busy_until = end if busy_until is None else max(busy_until, end)
    return idle, host_idle, gaps, host_gaps


def _launch_times(prof: Any) -> list[tuple[float, float, float | None]]:
    """(start, end, launch) in microseconds of every GPU kernel and copy, the launch from the host runtime call
    with the same correlation id (Kineto's raw events)."""
    import torch

    gpu, launches = [], {}
    for e in prof.profiler.kineto_results.events():
        if e.device_type() == torch.autograd.DeviceType.CUDA:
            if not e.is_user_annotation():  # record_function spans on the GPU timeline would cover the gaps
                gpu.append(e)
        elif e.name().startswith("cu") and e.correlation_id():  # cudaLaunchKernel, cuLaunchKernelEx, cudaMemcpyAsync, ...
            launches[e.correlation_id()] = e.start_ns() / 1e3
    return [(e.start_ns() / 1e3, e.end_ns() / 1e3, launches.get(e.correlation_id())) for e in gpu]


def _idle_gaps(prof: Any, steps: int, largest: int = 6) -> list[dict]:
    """Where the GPU sat idle between kernels: the total per step and the largest gaps, named by their neighbours."""
    import torch

    kernels = sorted(
        (e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA and not getattr(e, "is_user_annotation", False)),
        key=lambda e: e.time_range.start,
    )
    gaps, busy_until, previous = [], None, None
    for e in kernels:
        if busy_until is not None and e.time_range.start > busy_until:
            gaps.append((e.time_range.start - busy_until, previous.name[:60], e.name[:60]))
        if busy_until is None or e.time_range.end > busy_until:
            busy_until, previous = e.time_range.end, e
    rows = [dict(kernel="(GPU idle between kernels)", kind="sum", ms_per_step=sum(g[0] for g in gaps) / steps / 1e3, calls_per_step=len(gaps) / steps)]
    timed = _launch_times(prof)
    _, host_idle, _, host_gaps = split_idle(timed)
    matched = sum(launch is not None for _, _, launch in timed)
    rows.append(dict(
        kernel=f"(of which the GPU waited for the host: the next launch came after it went idle; {matched} of {len(timed)} launches traced)",
        kind="sum", ms_per_step=host_idle / steps / 1e3, calls_per_step=host_gaps / steps,
    ))
    for micros, before, after in sorted(gaps, reverse=True)[:largest]:
        # one gap's own length in the ms column (not divided by the profiled steps, unlike the total above)
        rows.append(dict(kernel=f"(one idle gap, its length) after {before} | before {after}", kind="gap", ms_per_step=micros / 1e3, calls_per_step=1))
    return rows


def synchronize() -> None:
    import torch

    if torch.cuda.is_available():
        torch.cuda.synchronize()


def timed_evaluate(original_evaluate: Callable[..., Any], timer: RoundTimer) -> Callable[..., Any]:
    """The script's evaluate, synchronized at both ends, its time inside the timed segment added to the timer's
    (the segment leaves validation out)."""

    def evaluate(*a: Any, **k: Any) -> Any:
        synchronize()
        start = time.perf_counter()
        result = original_evaluate(*a, **k)
        synchronize()
        if timer.segment_open:
            timer.eval_inside_s += time.perf_counter() - start
        if timer.profiling:
            timer.validations_profiled += 1
        return result

    return evaluate


def signal_ready(control: Control, rank: int) -> None:
    import torch

    if rank == 0:
        control.signal("ready", dict(pid=os.getpid(), device=torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"))


def timed_rounds(
    args: argparse.Namespace, control: Control, rank: int, timer: RoundTimer,
    start_round: Callable[[int], None], train: Callable[[], tuple[Any, int, float]], before_any: Any,
    model_flops_per_step: float | None = None,
) -> Any:
    """Each round the coordinator starts: start_round(seed) resets what a round starts from, then train() trains it
    and returns (its result, the segment's last step, the final val loss); ms per step over steps
    timer.first_step..last (validation left out), the val loss, the round's peak memory and the model's FLOPs per
    step (None: not known for this script) go to the coordinator.
    Returns the last round's result (before_any if the coordinator's time limit stopped the worker first)."""
    import torch

    result = before_any
    for index, seed in enumerate(args.seeds):
        if control.wait_first((f"go{index}", "stop")) == "stop":  # the coordinator's time limit
            break
        start_round(seed)
        if torch.cuda.is_available():
            torch.cuda.reset_peak_memory_stats()
        timer.reset()
        result, last, val_loss = train()
        segment_s = timer.marks[last] - timer.marks[timer.first_step] - timer.eval_inside_s
        peak = torch.cuda.max_memory_allocated() if torch.cuda.is_available() else 0
        if rank == 0:
            control.signal(
                f"result{index}",
                dict(seed=seed, ms_per_step=1000 * segment_s / (last - timer.first_step), steps=[timer.first_step, last],
                     val_loss=val_loss, peak_allocated_mib=peak / 2**20, model_flops_per_step=model_flops_per_step),
            )
    return result


def profiled_round(
    args: argparse.Namespace, control: Control, rank: int, timer: RoundTimer, start_round: Callable[[int], None], train: Callable[[], Any]
) -> None:
    """With --profile-steps, when the coordinator asks: the first round's start again, then train() under
    torch.profiler until the step hook ends it (_EndRound) after the profiled steps; the kernel table (and with
    --trace the timeline) goes to the coordinator."""
    import torch

    if not args.profile_steps or control.wait_first(("go_profile", "stop")) != "go_profile":
        return
    start_round(args.seeds[0])
    timer.reset()
    timer.profile = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA])
    timer.profile_from, timer.profile_steps, timer.validations_profiled = args.profile_from, args.profile_steps, 0
    try:
        train()
    except _EndRound:
        pass
    if rank == 0:
        if args.trace is not None:  # the timeline itself, for chrome://tracing or Perfetto
            args.trace.mkdir(parents=True, exist_ok=True)
            timer.profile.export_chrome_trace(str(trace_path(args.trace, args.label)))
        kernels = _kernel_table(timer.profile, args.profile_steps) if torch.cuda.is_available() else []
        if timer.validations_profiled:  # a step the user profiled validates: say so rather than leave it in silently
            kernels.insert(0, dict(kernel=f"{timer.validations_profiled} validation pass(es) ran inside the profiled steps, "
                                   "and their kernels are in these figures; move --profile-from", kind="note", ms_per_step=0.0, calls_per_step=0))
        control.signal("profile", dict(kernels=kernels))


def trace_path(folder: Path, label: str) -> Path:
    """Where --trace puts a version's profiled timeline."""
    return folder / f"{label}.trace.json.gz"


def trace_refusal(folder: Path) -> str | None:
    """Why --trace cannot take this invocation's timelines, or None. Asked before anything runs: the workers write
    them only after every round, and export would replace an earlier timeline."""
    from tools.recordkit.folders import file_in_the_way

    blocked = file_in_the_way(folder)
    if blocked is not None:
        return f"--trace {folder}: {blocked} is a file, not a folder; pass a folder"
    existing = [path for path in (trace_path(folder, label) for label in LABELS) if path.exists()]
    if existing:
        return f"--trace {folder}: {existing[0]} exists, and traces are never overwritten; move it away or pass another folder"
    return None


def json_folder_refusal(path: Path, out: Path | None, own_names: tuple[str, ...] = ()) -> str | None:
    """Why --json's folder cannot take the results, or None. Asked before anything runs: the results are written only
    after every round. --out itself is made (and checked) before anything runs, so it will be there; inside it the
    names the tool gives its own files (tool_entry) are refused, as the results would replace one of them."""
    from tools.recordkit.folders import file_in_the_way

    if out is not None and path.resolve().is_relative_to(out.resolve()) and path.resolve() != out.resolve():
        first = path.resolve().relative_to(out.resolve()).parts[0]
        if tool_entry(first, own_names):
            return f"--json {path}: inside --out, where the tool writes {first} itself; pass another name or folder"
        if path.parent.resolve() == out.resolve():
            return None
    if path.parent.is_dir():
        return unwritable_folder_refusal(path.parent, f"--json {path}")
    blocked = file_in_the_way(path.parent)
    why = f"{blocked} is a file, not a folder" if blocked is not None else f"the folder {path.parent} does not exist"
    return f"--json {path}: {why}, and the results are written there only after the whole run; pass a path in an existing folder"


def round_start_arguments(arguments: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """What a round of train() must start from again, by argument name: the objects whose state is restored (optimizers,
    the loader: anything with load_state_dict but a module, since the model is re-initialised from the round's seed,
    and an older script's compiled wrapper of it must not bring the first round's weights back), and the plain records
    of progress (dataclass instances), copied afresh."""
    import torch

    stateful = {n: v for n, v in arguments.items() if hasattr(v, "load_state_dict") and not isinstance(v, torch.nn.Module)}
    records = {n: v for n, v in arguments.items() if dataclasses.is_dataclass(v) and not isinstance(v, type)}
    return stateful, records


def worker_main(args: argparse.Namespace, overrides: list[str]) -> None:
    control = Control(args.control, args.label)
    rank = int(os.environ.get("RANK", "0"))
    install_stack_dump(control, rank)  # first: a hang in the imports below gets its stacks too

    import torch
    import torch.distributed as dist

    _import_path_for(args.script)
    module = _load_module(args.script)
    if classify(args.script) == "trials":
        trials_worker(module, args, overrides, control, rank)
        return
    original_train, original_print0 = module.train, module.print0
    timer = RoundTimer(args.skip)

    def print0(s: str, console: bool = False) -> None:
        original_print0(s, console)
        match = STEP_LINE.match(s)
        if match is None or "val_loss" in s:
            return
        step, total = int(match[1]), int(match[2])
        if step == timer.first_step or step == total:
            synchronize()
            timer.marks[step] = time.perf_counter()
            timer.segment_open = step == timer.first_step
        action = timer.profiler_action(step)
        if action == "start":
            timer.start_profile()
        elif action == "stop":
            timer.stop_profile()
            raise _EndRound()

    def reinitialise(raw_model: Any, initial: dict[str, Any], seed: int) -> None:
        # the state train() started from first, so that what the script's reset_parameters leaves alone (da5641d's
        # left the learned scalars) cannot carry one round's training into the next; then the round's random draws
        raw_model.load_state_dict(initial)
        torch.manual_seed(seed)
        raw_model.reset_parameters()
        if dist.is_initialized() and dist.get_world_size() > 1:
            for param in raw_model.parameters():
                dist.broadcast(param.detach(), 0)

    def rounds_of_train(*a: Any, **k: Any) -> float:
        bound = inspect.signature(original_train).bind(*a, **k)
        raw_model = bound.arguments["raw_model"]
        stateful, records = round_start_arguments(bound.arguments)
        start_states = {n: copy.deepcopy(v.state_dict()) for n, v in stateful.items()}
        # on the host: a copy on the GPU would add the model's size to every round's peak allocated memory
        initial_model = {name: value.detach().to("cpu", copy=True) for name, value in raw_model.state_dict().items()}
        signal_ready(control, rank)

        def start_round(seed: int) -> None:
            reinitialise(raw_model, initial_model, seed)
            for name, value in stateful.items():
                value.load_state_dict(copy.deepcopy(start_states[name]))
            for name, value in records.items():
                bound.arguments[name] = copy.deepcopy(value)
            raw_model.rotary.reset()

        def train() -> tuple[float, int, float]:
            final = original_train(*bound.args, **bound.kwargs)
            return final, max(timer.marks), float(final)

        flops = model_flops_per_step(module, raw_model, bound.arguments.get("hp"))
        final = timed_rounds(args, control, rank, timer, start_round, train, math.nan, flops)
        profiled_round(args, control, rank, timer, start_round, train)
        return final

    module.train, module.print0, module.evaluate = rounds_of_train, print0, timed_evaluate(module.evaluate, timer)
    module.run(overrides)


def model_flops_per_step(module: Any, raw_model: Any, hp: Any) -> float | None:
    """MFU's FLOPs, as bench/bench_train_gpt.py counts them: 6 x the parameters of the matrices multiplied in the
    forward x tokens per step, all ranks together (attention's score and value products left out). None for a
    script without matmul_parameter_count or train_batch_size."""
    count, batch = getattr(module, "matmul_parameter_count", None), getattr(hp, "train_batch_size", None)
    if count is None or batch is None:
        return None
    return 6.0 * count(raw_model) * batch


def trials_worker(module: Any, args: argparse.Namespace, overrides: list[str], control: Control, rank: int) -> None:
    """A train_gpt_shampoo.py-style version, resident: the script's own main() runs its single trial through this
    worker's run_trial, which trains one trial per round (the round's seed set just before it, so both versions
    start from the same initialisation) and times it through train_step and evaluate."""
    import torch

    original_run_trial, original_train_step = module.run_trial, module.train_step
    timer = RoundTimer(args.skip)
    progress = dict(steps=0, total=0)

    def train_step(*a: Any, **k: Any) -> Any:
        if progress["steps"] == timer.first_step:
            synchronize()
            timer.marks[timer.first_step] = time.perf_counter()
            timer.segment_open = True
        if timer.profiler_action(progress["steps"]) == "start":
            timer.start_profile()
        result = original_train_step(*a, **k)
        progress["steps"] += 1
        if timer.profiler_action(progress["steps"]) == "stop":
            timer.stop_profile()
            raise _EndRound()
        if progress["steps"] == progress["total"]:
            synchronize()
            timer.marks[progress["total"]] = time.perf_counter()
            timer.segment_open = False
        return result

    def rounds_of_trials(launch: Any, trial: int, resume: Any) -> Any:
        if resume is not None:  # the coordinator refuses --resume; this worker is not to be started with one either
            raise ABError(f"--resume={resume.path}: {RESUME_REFUSED}")
        signal_ready(control, rank)

        def start_round(seed: int) -> None:
            torch.manual_seed(seed)
            progress.update(steps=0, total=launch.hp.train_steps)

        def train() -> tuple[Any, int, float]:
            result = original_run_trial(launch, trial, None)
            return result, progress["total"], float(result.val_losses[max(result.val_losses)])

        result = timed_rounds(args, control, rank, timer, start_round, train, module.TrialResult({}))
        profiled_round(args, control, rank, timer, start_round, train)
        return result

    module.run_trial, module.train_step, module.evaluate = rounds_of_trials, train_step, timed_evaluate(module.evaluate, timer)
    module.main([*overrides, "--num_trials=1"])  # one trial of the script's: this worker's rounds


# =============================================================================================
# Coordinator
# =============================================================================================
def start_versions(versions: list, launch: Callable[[Any], Any], start: str, runners: list) -> list:
    """Launches every version's worker into runners (the caller's list, so that a worker that hangs while starting
    can still be stopped) and waits until each is ready (compiled and warmed up). "together" launches all at once
    (the compiles overlap); "in-turn" launches the next only when the previous is ready, so that compile-time
    autotuning (e.g. inductor's max_autotune) benchmarks on a GPU no other version is using."""
    for version in versions:
        runners.append(launch(version))
        if start == "in-turn":
            runners[-1].wait_ready()
    if start == "together":
        for runner in runners:
            runner.wait_ready()
    return runners


@dataclass
class RoundResult:
    seed: int | None
    ms_per_step: float
    val_loss: float
    peak_allocated_mib: float
    model_flops_per_step: float = math.nan  # 6 x matmul parameters x tokens per step; NaN: the script does not say


class ResidentVersion:
    def __init__(self, version: Version, args: argparse.Namespace, overrides: list[str], folder: Path, deadline: float | None = None):
        self.version, self.control, self.deadline = version, Control(folder, version.label), deadline
        self.device: str | None = None  # the GPU's name, as the worker reports it when ready
        self.output = open(self.control.path("out"), "w")
        cmd = [
            sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={args.nproc}",
            str(Path(__file__).resolve()), "--worker", "--script", str(version.script), "--control", str(folder),
            "--label", version.label, "--skip", str(args.skip), "--profile-steps", str(args.profile_steps), "--profile-from", str(args.profile_from),
            "--seeds", ",".join(map(str, args.seeds)), *(["--trace", str(args.trace.resolve())] if args.trace else []), "--", *overrides, f"--log_dir={folder / version.label / 'logs'}",
        ]
        self.process = subprocess.Popen(cmd, cwd=REPO, stdout=self.output, stderr=subprocess.STDOUT)

    def alive(self) -> bool:
        return self.process.poll() is None

    def wait_ready(self) -> None:
        self.device = self.control.wait("ready", self.alive, self.deadline).get("device")

    def run_round(self, index: int) -> RoundResult:
        self.control.signal(f"go{index}")
        r = self.control.wait(f"result{index}", self.alive, self.deadline)
        flops = r.get("model_flops_per_step")
        return RoundResult(r["seed"], r["ms_per_step"], r["val_loss"], r["peak_allocated_mib"], math.nan if flops is None else flops)

    def profile(self) -> list[dict]:
        self.control.signal("go_profile")
        return self.control.wait("profile", self.alive, self.deadline)["kernels"]

    def dump_stacks(self) -> Path | None:
        """Has every live rank write its threads' stacks into the .out file, which it returns (None: no rank left)."""
        return self.control.path("out") if dump_stacks(self.control) else None

    def kill(self) -> None:
        """Starts ending the worker: SIGKILL to each rank (a hung rank may be deaf to SIGTERM: stuck in C code, or
        in train_gpt's training loop, which defers it; torchrun starts each in its own session, so its own
        escalation would come only after 30 s), then SIGTERM to torchrun. reap() waits for it."""
        _signal_all(self.control.worker_pids(), signal.SIGKILL)
        self.process.terminate()

    def reap(self, timeout_s: float = 10.0) -> None:
        try:
            self.process.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
        self.output.close()

    def stop(self) -> None:
        """No more rounds and no profile: the worker returns from its training loop and exits."""
        self.control.signal("stop")

    def finish(self) -> None:
        code = self.process.wait()
        self.output.close()
        if code != 0:
            raise ABError(f"{self.version.label}: worker exited with status {code}; see {self.control.path('out')}")


def train_time_ms(match: re.Match) -> float:
    """A step line's train_time in ms: train_gpt.py writes whole ms, train_gpt_shampoo.py seconds."""
    return float(match[1]) * (1.0 if match[2] == "ms" else 1000.0)


@dataclass
class ValLine:
    step: int
    total: int
    loss: float  # NaN or inf as printed


def last_val_and_peak(text: str) -> tuple[ValLine | None, float]:
    """A whole run's output: its last val line (None: none) and its last peak memory line's MiB (NaN: none). A line
    whose loss float() refuses (the pattern's letters admit words) is not a val line."""
    last = None
    for line in text.splitlines():
        if (match := VAL_LINE.match(line)) is not None:
            try:
                last = ValLine(int(match[1]), int(match[2]), float(match[3]))
            except ValueError:
                continue
    peaks = PEAK_LINE.findall(text)
    return last, float(peaks[-1]) if peaks else math.nan


STOP_GRACE_S = 40.0  # after SIGTERM: torchrun's own 30 s to end its ranks, and some


def stop_processes(processes: list[subprocess.Popen], grace_s: float = STOP_GRACE_S) -> None:
    """SIGTERM to each, which torchrun passes on to its ranks (a SIGKILL would orphan them), then SIGKILL to any still
    running after grace_s, all in parallel (grace_s in all, not each)."""
    for process in processes:
        process.terminate()
    give_up = time.monotonic() + grace_s
    for process in processes:
        try:
            process.wait(timeout=max(0.0, give_up - time.monotonic()))
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


class WholeRunVersion:
    """Each round a fresh run of the script (compile caches kept from its untimed first run)."""

    def __init__(self, version: Version, args: argparse.Namespace, overrides: list[str], folder: Path, deadline: float | None = None):
        self.version, self.args, self.overrides, self.folder, self.deadline = version, args, overrides, folder, deadline
        self.env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=str(folder / "inductor_cache"), TRITON_CACHE_DIR=str(folder / "triton_cache"))
        self.runs = 0

    def _run(self) -> str:
        self.runs += 1
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={self.args.nproc}", str(self.version.script), *self.overrides]
        out = self.folder / f"{self.version.label}.run{self.runs}.out"
        timeout = None if self.deadline is None else max(0.0, self.deadline - time.monotonic())
        with open(out, "w") as handle:
            # in the repository, as the check and the resident workers: relative paths in the overrides (and an older
            # script's own defaults, e.g. data/fineweb10B/...) mean the same files for every version
            process = subprocess.Popen(cmd, cwd=REPO, stdout=handle, stderr=subprocess.STDOUT, env=self.env)
            try:
                code = process.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                stop_processes([process])
                raise WorkerTimeout(f"{self.version.label}: run {self.runs} had not finished by the deadline; see {out}") from None
        if code != 0:
            raise ABError(f"{self.version.label}: run exited with status {code}; see {out}")
        return out.read_text()

    def wait_ready(self) -> None:
        self._run()  # compiles and fills the caches; untimed

    def run_round(self, index: int) -> RoundResult:
        text = self._run()
        times = {int(m[1]): train_time_ms(t) for line in text.splitlines() if (m := STEP_LINE.match(line)) and (t := TRAIN_TIME.search(line))}
        last_val, peak = last_val_and_peak(text)
        last = max(times, default=0)
        if self.args.skip not in times or last <= self.args.skip:
            raise ABError(f"{self.version.label}: no step lines from step {self.args.skip} on in its output; cannot time it")
        ms = (times[last] - times[self.args.skip]) / (last - self.args.skip)
        return RoundResult(None, ms, math.nan if last_val is None else last_val.loss, peak)

    def profile(self) -> list[dict]:
        return []

    def stop(self) -> None:
        pass

    def finish(self) -> None:
        pass

    def dump_stacks(self) -> Path | None:
        return None  # a whole run is not ours to instrument; _run ended it at the deadline

    def kill(self) -> None:
        pass

    def reap(self, timeout_s: float = 10.0) -> None:
        pass


def make_out_folder(folder: Path) -> None:
    """Creates --out and the folders above it, and checks that files can be made there; each failure is one line
    (mkdir raised them as tracebacks)."""
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except (FileExistsError, NotADirectoryError):
        raise ABError(f"--out {folder}: a file is in the way (that path or a folder above it is a file); pass a folder") from None
    except OSError as error:
        raise ABError(f"--out {folder}: cannot create it ({error.strerror}); pass a folder you can write") from None
    if (refusal := unwritable_folder_refusal(folder, "--out")) is not None:
        raise ABError(refusal)


def unwritable_folder_refusal(folder: Path, flag: str) -> str | None:
    """Why no file can be made in folder, or None: a file made there and removed at once, as the tool's own
    writes would be (a permission bit alone does not say it: root, read-only mounts, ACLs)."""
    try:
        with tempfile.TemporaryFile(dir=folder):
            return None
    except OSError as error:
        return f"{flag}: cannot write in {folder} ({error.strerror}); pass a folder you can write"


def tool_entry(name: str, own_names: tuple[str, ...]) -> bool:
    """Whether a top-level entry of --out is one this tool makes: a version's folder or file (<label>, <label>.*)
    or one of own_names (its results file, its check folder)."""
    return name in own_names or any(name == label or name.startswith(f"{label}.") for label in LABELS)


def foreign_entries(folder: Path, own_names: tuple[str, ...]) -> list[str]:
    """The top-level entries of --out that this tool would never make (a record folder, the repository root)."""
    return sorted(entry.name for entry in folder.iterdir() if not tool_entry(entry.name, own_names))


def check_fresh(folder: Path, extractions: list[Extraction], results_name: str = "ab.json", tool_folders: tuple[str, ...] = ()) -> None:
    """Refuses a folder holding an earlier invocation's files, before anything is written: its worker files, whose
    signals and results would be read as this invocation's (a reused --out once reported an earlier call's round and
    stopped a new worker at once), its results file (results_name), and files under <label>/ that this invocation would not write (the
    workers' logs, another version's package; not the bytecode that the check's imports leave). An extracted file
    that this invocation writes again is accepted when its bytes are the same (a --dry-run, then the run; a retry
    after a bad --candidate) and refused, by name, when they differ. A folder holding anything this tool would not
    make (besides the versions' files: results_name and tool_folders, which a --dry-run may leave) is refused too: the
    versions' folders would be written into it."""
    if foreign := foreign_entries(folder, (results_name, *tool_folders)):
        shown = ", ".join(foreign[:3]) + (", ..." if len(foreign) > 3 else "")
        raise ABError(f"--out {folder} holds files that are not this tool's ({shown}); pass a new or empty folder")
    earlier = sorted(p.relative_to(folder).as_posix() for p in earlier_files(folder, extractions, results_name))
    if earlier:
        raise ABError(f"--out {folder} holds an earlier invocation's files ({', '.join(earlier[:3])}{', ...' if len(earlier) > 3 else ''}); pass a new or empty folder")
    for extraction in extractions:
        for path, content in extraction.files.items():
            if path.exists() and not (path.is_file() and path.read_bytes() == content):
                raise ABError(
                    f"--out {folder}: {path.relative_to(folder).as_posix()} is an earlier invocation's and differs from what this "
                    f"one extracts for the {extraction.version.label}; pass a new or empty folder"
                )


def earlier_files(folder: Path, extractions: list[Extraction] = (), results_name: str = "ab.json") -> list[Path]:
    """What an invocation leaves in its folder, less the extracted files this one writes again (check_fresh compares
    those): <label>.* (worker files), <label>/ (the extracted scripts, the workers' logs) and its default results
    file (results_name)."""
    ours = {path for extraction in extractions for path in extraction.files}
    found = [folder / results_name] if (folder / results_name).exists() else []
    for label in LABELS:
        found += folder.glob(f"{label}.*")
        extracted = folder / label
        found += [extracted] if extracted.exists() and not extracted.is_dir() else [
            p for p in extracted.rglob("*") if not p.is_dir() and p not in ours and "__pycache__" not in p.relative_to(extracted).parts
        ]
    return found


# =============================================================================================
# The card's clock while each version trains (nvidia-smi)
# =============================================================================================
SW_POWER_CAP = 0x4  # nvidia-smi's clocks_event_reasons bit: clocks held down to stay under the power limit
CLOCK_QUERY = "clocks.sm,power.draw,clocks_event_reasons.active"


@dataclass
class ClockSample:
    at: float  # time.monotonic() when the line arrived
    sm_mhz: float
    power_w: float
    power_capped: bool


def parse_clock_line(line: str) -> ClockSample | None:
    """One line of `nvidia-smi --query-gpu=CLOCK_QUERY --format=csv,noheader,nounits` (None: not a sample, e.g.
    "[N/A]" fields or a message)."""
    fields = [f.strip() for f in line.split(",")]
    if len(fields) != 3:
        return None
    try:
        return ClockSample(time.monotonic(), float(fields[0]), float(fields[1]), bool(int(fields[2], 16) & SW_POWER_CAP))
    except ValueError:
        return None


class ClockSampler:
    """Samples the SM clock, power and power-cap flag of the GPUs the workers use, every 0.5 s, so that the report
    can say at what clock each version trained. Why: on an H200 both versions train at the 700 W cap, so a
    version that does the same work in less time draws the same power and gets a lower clock (2026-12-02, commit 33c3032:
    029d93e 1,785 MHz, main 1,728, capped in 167 of 168 samples; bench/NOTES.md). Absent nvidia-smi, nothing."""

    def __init__(self, gpus: list[str], interval_ms: int = 500, command: str = "nvidia-smi"):
        self.samples: list[ClockSample] = []
        self.segments: list[tuple[str, float, float]] = []  # (label, start, end) of each version's rounds
        self.process: subprocess.Popen | None = None
        executable = shutil.which(command)
        if executable is None:
            return
        try:
            self.process = subprocess.Popen(
                [executable, f"--query-gpu={CLOCK_QUERY}", "--format=csv,noheader,nounits", "-lms", str(interval_ms), "-i", ",".join(gpus)],
                stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
            )
        except OSError as error:  # a monitoring aid: the A/B goes on without it
            print(f"bench/ab.py: {executable} did not start ({error}); the clocks go unsampled", file=sys.stderr)
            return
        self.reader = threading.Thread(target=self._read, daemon=True)
        self.reader.start()

    def _read(self) -> None:
        for line in self.process.stdout:
            if (sample := parse_clock_line(line)) is not None:
                self.samples.append(sample)

    def segment(self, label: str, start: float, end: float) -> None:
        self.segments.append((label, start, end))

    def stop(self) -> None:
        """Ends nvidia-smi without waiting on it for long: on a wedged GPU it can sit in the driver, deaf to SIGTERM,
        and the report must still come (the reader thread is a daemon and may be left behind)."""
        if self.process is None:
            return
        self.process.terminate()
        try:
            self.process.wait(timeout=5)
        except subprocess.TimeoutExpired:
            self.process.kill()
            try:
                self.process.wait(timeout=5)
            except subprocess.TimeoutExpired:
                return
        self.reader.join(timeout=5)

    def summary(self) -> dict[str, dict[str, float]]:
        """Per version: mean SM clock and power, and the share of samples at the power cap, over its rounds (each
        round whole: its steps before the timed segment and its final validation included); a sample is one GPU's
        line, so N GPUs give N per tick."""
        result = {}
        for label in dict.fromkeys(label for label, _, _ in self.segments):
            inside = [s for s in self.samples if any(l == label and start <= s.at <= end for l, start, end in self.segments)]
            if inside:
                result[label] = dict(
                    samples=len(inside), sm_mhz_mean=statistics.fmean(s.sm_mhz for s in inside),
                    power_w_mean=statistics.fmean(s.power_w for s in inside),
                    power_capped_share=sum(s.power_capped for s in inside) / len(inside),
                )
        return result


def gpus_of_workers(nproc: int) -> list[str]:
    """nvidia-smi's ids of the GPUs the workers' local ranks 0..nproc-1 use (CUDA_VISIBLE_DEVICES, when set, maps
    them; nvidia-smi itself ignores it)."""
    visible = [d.strip() for d in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if d.strip()]
    return visible[:nproc] if visible else [str(i) for i in range(nproc)]


def print_clocks(clocks: dict[str, dict[str, float]]) -> None:
    if not clocks:
        print("SM clock while each version trained: not sampled (no nvidia-smi, or no sample inside a round)")
        return
    parts = [
        f"{label} {c['sm_mhz_mean']:.0f} MHz, {c['power_w_mean']:.0f} W, at the power cap in {100 * c['power_capped_share']:.0f}% of {c['samples']} samples"
        for label, c in clocks.items()
    ]
    print("SM clock while each version trained (nvidia-smi, mean): " + "; ".join(parts))


def fits(elapsed_s: float, estimate_s: float | None, limit_s: float) -> bool:
    """Whether work estimated at estimate_s seconds (None: not known yet, as before the first round) still fits in a
    time limit of limit_s seconds (0: none) after elapsed_s."""
    return limit_s <= 0 or estimate_s is None or elapsed_s + estimate_s <= limit_s


def round_order(index: int, order: str) -> tuple[str, str]:
    """Which version trains first in round `index` (0-based)."""
    if order == "abba" and index % 2 == 1:
        return ("candidate", "baseline")
    return ("baseline", "candidate")


def second_slot_effect(ratios: list[float]) -> float:
    """With abba order, the relative slowdown of whichever version trains second: if the slot costs a factor
    (1 + e), rounds with B second measure r (1 + e) and rounds with B first r / (1 + e). NaN without both kinds
    (one completed round); from an odd number of rounds it is defined, one order's mean resting on one round fewer."""
    b_second, b_first = ratios[0::2], ratios[1::2]
    if not b_second or not b_first:
        return math.nan
    return math.sqrt(statistics.fmean(b_second) / statistics.fmean(b_first)) - 1


def abba_counts(rounds: int) -> dict[str, int]:
    """Completed abba rounds per order: round 1 (index 0) trains the baseline first, round 2 the candidate, ..."""
    return dict(baseline_first=(rounds + 1) // 2, candidate_first=rounds // 2)


def _mean(xs: list[float]) -> float:
    return statistics.fmean(xs) if xs else math.nan  # NaN: undefined, written as null


def _sd(xs: list[float]) -> float:
    # statistics.stdev raises AttributeError (not a ValueError) on a NaN or inf in 3.11: callers pass finite values
    return statistics.stdev(xs) if len(xs) > 1 else math.nan


def _finite_max(xs: list[float]) -> float:
    """max() of the finite values: max() itself keeps or drops a NaN by its position."""
    finite = [x for x in xs if math.isfinite(x)]
    return max(finite) if finite else math.nan


def val_not_finite(baseline: list[RoundResult], candidate: list[RoundResult]) -> list[dict[str, Any]]:
    """Each round's non-finite val loss (a diverged run; a whole run without a val line), its value as text
    ("nan", "inf"), since the JSON holds null in the round itself."""
    return [
        dict(round=i + 1, version=label, value=str(r.val_loss))
        for i, pair in enumerate(zip(baseline, candidate))
        for label, r in zip(LABELS, pair)
        if not math.isfinite(r.val_loss)
    ]


def mfu(rounds: list[RoundResult], peak_flops: float) -> float:
    """The model FLOPs per step over the median ms/step (the report's), over peak_flops (all GPUs of a version
    together). A worker counts its FLOPs once, so its rounds agree; NaN where one is not known (or they differ)."""
    flops = {r.model_flops_per_step for r in rounds}
    if len(flops) != 1 or not all(math.isfinite(f) for f in flops):
        return math.nan
    return flops.pop() / (statistics.median(r.ms_per_step for r in rounds) * 1e-3) / peak_flops


def summarize(baseline: list[RoundResult], candidate: list[RoundResult], peak_flops: float = math.nan) -> dict[str, Any]:
    """The timing and val loss statistics of paired rounds, and each version's MFU over peak_flops (the bf16 rate
    of all its GPUs together). The val loss figures are over the rounds where both
    versions' val losses are finite (val_rounds of them; val_not_finite names the others), so that both means
    and the paired difference stand on the same seeds; NaN (null in the JSON) where no such round, or one for an sd."""
    ratios = [c.ms_per_step / b.ms_per_step for b, c in zip(baseline, candidate)]
    pairs = [(b.val_loss, c.val_loss) for b, c in zip(baseline, candidate) if math.isfinite(b.val_loss) and math.isfinite(c.val_loss)]
    val_a, val_b = [a for a, _ in pairs], [b for _, b in pairs]
    val_diffs = [b - a for a, b in pairs]
    return dict(
        ratio_median=statistics.median(ratios),
        ratio_min=min(ratios),
        ratio_max=max(ratios),
        ratios=ratios,
        baseline_ms_median=statistics.median(r.ms_per_step for r in baseline),
        candidate_ms_median=statistics.median(r.ms_per_step for r in candidate),
        baseline_peak_mib=_finite_max([r.peak_allocated_mib for r in baseline]),
        candidate_peak_mib=_finite_max([r.peak_allocated_mib for r in candidate]),
        baseline_mfu=mfu(baseline, peak_flops),
        candidate_mfu=mfu(candidate, peak_flops),
        val_rounds=len(pairs),
        val_not_finite=val_not_finite(baseline, candidate),
        baseline_val_mean=_mean(val_a),
        baseline_val_sd=_sd(val_a),
        candidate_val_mean=_mean(val_b),
        candidate_val_sd=_sd(val_b),
        val_diff_mean=_mean(val_diffs),
        val_diff_sd=_sd(val_diffs),
    )


def summarize_rounds(baseline: list[RoundResult], candidate: list[RoundResult], order: str, peak_flops: float = math.nan) -> dict[str, Any]:
    """summarize() over the rounds both versions completed ({} if none); with abba order also the second-slot
    effect, the completed rounds per order and whether they balance (a time limit or deadline can end the
    rounds after an odd number: the slot effect then no longer cancels in the ratio's median and mean)."""
    complete = min(len(baseline), len(candidate))
    if not complete:
        return {}
    summary = summarize(baseline[:complete], candidate[:complete], peak_flops)
    if order == "abba":
        summary["second_slot_effect"] = second_slot_effect(summary["ratios"])
        summary["abba_rounds"] = abba_counts(complete)
        summary["abba_balanced"] = complete % 2 == 0
    return summary


def strict_json(value: Any) -> Any:
    """value with every non-finite float (NaN, inf) as None: Python's json writes them as NaN and Infinity, which
    are not JSON (jq, JavaScript and strict parsers refuse the whole file)."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {key: strict_json(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [strict_json(item) for item in value]
    return value


def write_new_results(path: Path, report: dict[str, Any], folder: Path) -> Path:
    """The strict JSON (non-finite values as null) into a new file, and where it went. A file that appeared at path
    since the start (another invocation's) is never replaced, and a path that can no longer be written (its folder
    removed or made read-only during the run) does not lose the results: they go to a new file in the working
    folder instead, and the error says where."""
    # allow_nan=False: a non-finite value that strict_json missed fails here, and in the tests, not in a reader
    text = json.dumps(strict_json(report), indent=2, allow_nan=False)
    try:
        with open(path, "x") as handle:
            handle.write(text)
        return path
    except OSError as error:
        why = "appeared during the run and is kept" if isinstance(error, FileExistsError) else f"could not be written ({error.strerror})"
    spare = folder / f"results-{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}.json"
    with open(spare, "x") as handle:
        handle.write(text)
    raise ABError(f"{path} {why}; the results are in {spare}")


def describe_flags(version: Version) -> str:
    return f" with {' '.join(version.flags)}" if version.flags else ""


def _stat(value: float, spec: str, undefined: str = "undefined") -> str:
    """A summary figure, or a word where it is NaN/inf (no finite values, or one value for an sd): "+nan%" reads as
    a number."""
    return format(value, spec) if math.isfinite(value) else undefined


def _percent(share: float) -> str:
    return f"{100 * share:.1f}%" if math.isfinite(share) else "not reported"  # a script that does not give its FLOPs


def _gib(mib: float) -> str:
    return f"{mib / 1024:.2f} GiB" if math.isfinite(mib) else "not reported"  # no workers' peak: no unit either


def abba_unbalanced_line(counts: dict[str, int]) -> str:
    return (
        f"abba order unbalanced: {counts['baseline_first']} round(s) with the baseline (A) first, {counts['candidate_first']} with "
        "the candidate (B) first (the rounds ended after an odd number), so the ratio B/A's median and mean carry part of the second-slot effect"
    )


def val_not_finite_line(entries: list[dict[str, Any]]) -> str:
    which = ", ".join(f"round {e['round']} {e['version']} {e['value']}" for e in entries)
    return f"val loss not finite: {which} (a diverged run, or a whole run without a val line); those rounds are left out of the final val loss figures"


def print_report(versions: list[Version], baseline: list[RoundResult], candidate: list[RoundResult], summary: dict, profiles: dict,
                 profiled_steps: str = "", peak_tflops: float = math.nan, nproc: int = 1) -> None:
    for v in versions:
        print(f"{v.label}: {v.origin}{describe_flags(v)} [{v.mode}]")
    print(f"{'round':>5} {'seed':>5} {'baseline ms/step':>17} {'candidate ms/step':>18} {'B/A':>7} {'val A':>8} {'val B':>8}")
    for i, (b, c) in enumerate(zip(baseline, candidate)):
        seed = "-" if b.seed is None else str(b.seed)
        print(f"{i + 1:>5} {seed:>5} {b.ms_per_step:>17.2f} {c.ms_per_step:>18.2f} {c.ms_per_step / b.ms_per_step:>7.4f} {b.val_loss:>8.4f} {c.val_loss:>8.4f}")
    s = summary
    print(f"median ms/step: baseline {s['baseline_ms_median']:.2f}, candidate {s['candidate_ms_median']:.2f}")
    print(f"ratio B/A: median {s['ratio_median']:.4f} (min {s['ratio_min']:.4f}, max {s['ratio_max']:.4f}, {len(s['ratios'])} rounds)")
    if "second_slot_effect" in s:
        effect = s["second_slot_effect"]
        print(
            f"second slot effect (abba order): {effect:+.2%} for whichever version trains second" if math.isfinite(effect)
            else "second slot effect (abba order): undefined, it needs a completed round with each version first"
        )
    if s.get("abba_balanced") is False:
        print(abba_unbalanced_line(s["abba_rounds"]))
    print(f"peak allocated: baseline {_gib(s['baseline_peak_mib'])}, candidate {_gib(s['candidate_peak_mib'])}")
    print(
        f"MFU (6 x matmul parameters x tokens per step at the median ms/step, over {nproc} x {peak_tflops:g} TFLOP/s): "
        f"baseline {_percent(s['baseline_mfu'])}, candidate {_percent(s['candidate_mfu'])}"
    )
    if s["val_not_finite"]:
        print(val_not_finite_line(s["val_not_finite"]))
    over = "" if s["val_rounds"] == len(s["ratios"]) else f" (over the {s['val_rounds']} of {len(s['ratios'])} rounds with both finite)"
    print(
        f"final val loss{over}: baseline {_stat(s['baseline_val_mean'], '.4f')} (sd {_stat(s['baseline_val_sd'], '.4f')}), "
        f"candidate {_stat(s['candidate_val_mean'], '.4f')} (sd {_stat(s['candidate_val_sd'], '.4f')}); "
        f"paired difference B-A {_stat(s['val_diff_mean'], '+.4f')} (sd {_stat(s['val_diff_sd'], '.4f')})"
    )
    for label, kernels in profiles.items():
        if not kernels:
            continue
        print(f"profile of {label}: top kernels, ms per training step (sum over its micro-steps{profiled_steps})")
        for row in kernels:
            if row["kind"] == "note":
                print(f"  note: {row['kernel']}")
                continue
            print(f"  {row['ms_per_step']:8.2f} ms  x{row['calls_per_step']:<6.0f} {row['kind'][:22]:<22} {row['kernel'][:100]}")


def profiled_steps_text(args: argparse.Namespace) -> str:
    """The profiled steps as the log numbers them: the ones after step --profile-from."""
    first, last = args.profile_from + 1, args.profile_from + args.profile_steps
    return str(first) if first == last else f"{first}-{last}"


class OneLineParser(argparse.ArgumentParser):
    """argparse's refusals in one line, as the tools' other refusals (no usage line; --help still gives it)."""

    def error(self, message: str) -> NoReturn:
        print(f"{self.prog}: error: {message}", file=sys.stderr)
        sys.exit(2)


def count_refusal(flag: str, value: int, least: int, most: int) -> str | None:
    """Why a count flag's value cannot be taken, or None. The bound above keeps a typo (--rounds 1000000000) from
    planning a billion rounds in memory before anything runs."""
    if least <= value <= most:
        return None
    return f"{flag}={value}: give {least} to {most}"


def add_version_arguments(parser: argparse.ArgumentParser) -> None:
    """The two versions and their own overrides, as every tool that compares versions of a script takes them."""
    parser.add_argument("--baseline-flags", default="", help="overrides for the baseline only, after the common ones (quoted, e.g. --baseline-flags=--matrix_optimizer=adamw)")
    parser.add_argument("--candidate-flags", default="", help="overrides for the candidate only, after the common ones")
    parser.add_argument("--baseline", default="HEAD", help="git revision, .py file, log or record folder (default: HEAD)")
    parser.add_argument("--candidate", default=WORKTREE, help=f"same kinds, or {WORKTREE} (default: the working tree)")


def parse_arguments(argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
    overrides: list[str] = []
    if "--" in argv:
        cut = argv.index("--")
        argv, overrides = argv[:cut], argv[cut + 1 :]
    parser = OneLineParser(
        prog="bench/ab.py", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
        usage="python bench/ab.py [--baseline V] [--candidate V] [--nproc N] [--rounds R] [options] -- <train_gpt.py overrides>",
    )
    parser.add_argument(
        "--train-script", default="train_gpt.py",
        help="the training script the versions are taken from (default train_gpt.py; train_gpt_shampoo.py for Track 3)",
    )
    add_version_arguments(parser)
    parser.add_argument("--nproc", type=int, default=1, help="processes (GPUs) per version: 1, 2, 4 or 8 (default 1)")
    parser.add_argument("--rounds", type=int, default=3, help="timed rounds, each A then B (default 3)")
    parser.add_argument(
        "--order", choices=["alternate", "abba"], default="alternate",
        help="alternate: every round A then B (default); abba: even rounds B then A (use an even --rounds)",
    )
    parser.add_argument(
        "--start", choices=["together", "in-turn"], default="together",
        help="together: both versions compile at once (default); in-turn: the candidate starts once the baseline is ready "
        "(for compile-time autotuning on an idle GPU)",
    )
    parser.add_argument(
        "--time-limit", type=float, default=0.0,
        help="seconds for the whole invocation (default 0: none); a round or the profile that would not fit, estimated "
        "from the last round, is left out and the rounds run so far are reported (for machines that limit each command's time)",
    )
    parser.add_argument(
        "--deadline", type=float, default=0.0,
        help="seconds after which a worker still busy is stopped, its Python stacks printed, the rounds so far reported "
        "(exit status 3; default 0: none); give the call's limit less the report's few seconds",
    )
    parser.add_argument("--skip", type=int, default=10, help="steps before the timed segment (default 10)")
    parser.add_argument(
        "--peak-tflops", type=float, default=784.0,
        help="the bf16 rate per GPU that MFU divides by (default 784 TFLOP/s, the rate of README's MFU figures; bench/NOTES.md of 2026-11-30 measured about 780)",
    )
    parser.add_argument("--profile-steps", type=int, default=0, help="after the rounds, profile this many steps of each version")
    parser.add_argument("--profile-from", type=int, help="profile the steps after this one (default: --skip, the timed segment's first steps; "
                        "the window schedule makes early and late steps differ)")
    parser.add_argument("--trace", type=Path, help="with --profile-steps: write each version's profiled timeline there (<label>.trace.json.gz)")
    parser.add_argument("--out", type=Path, help="working folder (default bench/out/ab/<time>)")
    parser.add_argument("--json", type=Path, help="results file (default <out>/ab.json)")
    parser.add_argument("--dry-run", action="store_true", help="resolve, extract and check both versions, print the plan, run nothing")
    # internal: the per-version worker and the version check
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--check-script", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--script", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--control", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--label", help=argparse.SUPPRESS)
    parser.add_argument("--seeds", type=lambda text: [int(x) for x in text.split(",")], help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if not args.worker and not args.check_script:
        if args.nproc < 1 or 8 % args.nproc:
            parser.error(f"--nproc={args.nproc}: use 1, 2, 4 or 8 (the record batch is split over a divisor of 8)")
        for flag, value, least in (("--rounds", args.rounds, 1), ("--skip", args.skip, 1), ("--profile-steps", args.profile_steps, 0)):
            if refusal := count_refusal(flag, value, least, MOST_COUNT):
                parser.error(refusal)
        for flag, seconds in (("--time-limit", args.time_limit), ("--deadline", args.deadline)):
            if not (math.isfinite(seconds) and seconds >= 0):  # inf passed `>= 0` and went into ab.json as Infinity
                parser.error(f"{flag}={seconds}: give finite seconds >= 0 (0: none)")
        if not (math.isfinite(args.peak_tflops) and args.peak_tflops > 0):
            parser.error(f"--peak-tflops={args.peak_tflops}: give the GPU's bf16 rate in TFLOP/s, a finite number above 0")
        if args.order == "abba" and args.rounds % 2:
            parser.error(f"--order abba needs an even --rounds (got {args.rounds}): the slot effect cancels over pairs of rounds")
        if args.json is not None and args.json.exists():
            parser.error(f"--json {args.json}: the file exists, and results are never overwritten; pass another path")
        if args.json is not None and (refusal := json_folder_refusal(args.json, args.out)):
            parser.error(refusal)
        if args.trace is not None and not args.profile_steps:
            parser.error("--trace writes the profiled steps' timeline: give --profile-steps N too")
        if args.profile_from is not None and not args.profile_steps:
            parser.error("--profile-from says where the profiled steps start: give --profile-steps N too")
        if args.profile_from is not None and args.profile_from < 1:  # as --skip: the step lines begin at step 1
            parser.error(f"--profile-from={args.profile_from}: give a step >= 1 (profiling starts after it)")
        if args.trace is not None and (refusal := trace_refusal(args.trace)):
            parser.error(refusal)
        for name in ("baseline_flags", "candidate_flags"):
            try:
                shlex.split(getattr(args, name))
            except ValueError as error:
                parser.error(f"--{name.replace('_', '-')}: {error}")
        args.seeds = list(range(1, args.rounds + 1))
    args.profile_from_given = args.profile_from is not None
    if args.profile_from is None:
        args.profile_from = args.skip
    return args, overrides


def coordinate(args: argparse.Namespace, overrides: list[str]) -> int:
    started_at = time.monotonic()
    folder = (args.out or REPO / "bench" / "out" / "ab" / time.strftime("%Y%m%d-%H%M%S")).resolve()
    make_out_folder(folder)
    extractions = [
        plan_version("baseline", args.baseline, folder, args.train_script, shlex.split(args.baseline_flags)),
        plan_version("candidate", args.candidate, folder, args.train_script, shlex.split(args.candidate_flags)),
    ]
    check_fresh(folder, extractions)
    versions = [extraction.write() for extraction in extractions]
    checks = {v.label: check_version(v, overrides) for v in versions}
    for v in versions:
        if v.mode == "trials" and checks[v.label]["resume"]:
            raise ABError(f"{v.label}: --resume={checks[v.label]['resume']}: {RESUME_REFUSED}")
    for v in versions:
        if args.profile_steps and v.mode == "whole-run":  # its runs are not instrumented: the profile would be left empty
            raise ABError(
                f"--profile-steps {args.profile_steps}: the {v.label} ({v.origin}) is timed whole-run, which cannot be profiled; "
                "drop --profile-steps, or pass versions with train_gpt.py's or train_gpt_shampoo.py's structure"
            )
    steps = {label: check["train_steps"] for label, check in checks.items()}
    for v in versions:
        print(f"{v.label}: {v.origin}{describe_flags(v)} -> {v.script} [{v.mode}], {steps[v.label] or 'unknown'} training steps")
    known = {s for s in steps.values() if s is not None}
    if len(known) > 1:
        raise ABError(f"the versions train different schedules ({steps}); time the same steps with the same overrides")
    if known and max(known) <= args.skip:
        raise ABError(f"--skip={args.skip} leaves no timed steps in a {max(known)}-step run; lower --skip or raise --num_iterations")
    if args.profile_steps and not known:  # the workers would train past the profile's end and never stop it
        raise ABError(f"--profile-steps {args.profile_steps}: neither version's step count is known, so the profiled steps cannot be "
                      "checked; drop --profile-steps")
    if args.profile_steps and args.profile_from + args.profile_steps > max(known):
        start = f"--profile-from={args.profile_from}" if args.profile_from_given else f"--skip={args.skip} (where profiling starts by default)"
        raise ABError(f"{start} with --profile-steps={args.profile_steps} runs past the {max(known)}-step run; "
                      "lower them or raise --num_iterations")
    order = [f"round {i + 1} (seed {seed}): {', '.join(round_order(i, args.order))}" for i, seed in enumerate(args.seeds)]
    started = "started together" if args.start == "together" else "started in turn"
    limit = f" time limit {args.time_limit:.0f} s;" if args.time_limit else ""
    limit += f" deadline {args.deadline:.0f} s;" if args.deadline else ""
    print(f"plan: {args.nproc} process(es) per version, {started};{limit} timed steps {args.skip}..end of each run; " + "; ".join(order))
    if args.dry_run:
        return 0
    # a worker still busy at the deadline (hung, or far slower than planned) is stopped, its stacks are printed
    # and what was measured is reported: a call's own limit never takes the results along
    deadline = started_at + args.deadline if args.deadline else None
    launch = lambda v: (WholeRunVersion if v.mode == "whole-run" else ResidentVersion)(v, args, v.overrides(overrides), folder, deadline)
    results: dict[str, list[RoundResult]] = {v.label: [] for v in versions}
    runners: list = []
    round_s, left_out, profiles, hung = None, [], {}, None
    sampler = ClockSampler(gpus_of_workers(args.nproc))
    try:
        start_versions(versions, launch, args.start, runners)
        by_label = {runner.version.label: runner for runner in runners}
        for index in range(args.rounds):
            if not fits(time.monotonic() - started_at, round_s, args.time_limit):
                left_out.append(f"rounds {index + 1}-{args.rounds} (about {round_s:.0f} s each)")
                break
            round_started = time.monotonic()
            for label in round_order(index, args.order):
                runner = by_label[label]
                segment_start = time.monotonic()
                result = runner.run_round(index)
                sampler.segment(label, segment_start, time.monotonic())
                results[runner.version.label].append(result)
                print(f"round {index + 1} {runner.version.label}: {result.ms_per_step:.2f} ms/step, val {result.val_loss:.4f}", flush=True)
            round_s = time.monotonic() - round_started
        if args.profile_steps:
            # a profiled run stops after profile_from + profile steps of the round's train_steps
            profiled_until = args.profile_from + args.profile_steps
            profile_s = round_s * min(1.0, profiled_until / (steps["baseline"] or profiled_until))
            if left_out or not fits(time.monotonic() - started_at, profile_s, args.time_limit):
                left_out.append(f"the profile (about {profile_s:.0f} s)")
            else:
                for runner in runners:  # filled one by one: a profile taken before a hang is kept
                    profiles[runner.version.label] = runner.profile()
    except WorkerTimeout as timeout:
        hung = str(timeout)
        left_out.append("everything after that")
        stop_hung_workers(runners, hung, args.deadline)
    except ABError:
        stop_workers(runners)  # a worker failed: the other must not stay resident on the GPUs
        raise
    finally:
        sampler.stop()
    clocks = sampler.summary()
    if hung is None:
        if left_out:
            print(f"time limit {args.time_limit:.0f} s: left out {' and '.join(left_out)}", flush=True)
        for runner in runners:
            if left_out:
                runner.stop()
            runner.finish()
    # rounds with both versions timed
    summary = summarize_rounds(results["baseline"], results["candidate"], args.order, args.peak_tflops * 1e12 * args.nproc)
    if summary:
        print_report(versions, results["baseline"], results["candidate"], summary, profiles,
                     f", steps {profiled_steps_text(args)}" if args.profile_steps else "", args.peak_tflops, args.nproc)
        print_clocks(clocks)
    else:
        print("no round was completed by both versions: nothing to compare")
    report = dict(
        command=sys.argv, overrides=overrides, nproc=args.nproc, skip=args.skip,
        device=next((r.device for r in runners if getattr(r, "device", None)), None) or _device_name(),
        versions=[asdict(v) | dict(script=str(v.script)) for v in versions],
        rounds={label: [asdict(r) for r in rs] for label, rs in results.items()}, summary=summary, profiles=profiles,
        profiled_steps=profiled_steps_text(args) if profiles else None,
        peak_tflops=args.peak_tflops, rounds_planned=args.rounds, order=args.order, time_limit_s=args.time_limit, left_out=left_out, hung=hung, clocks=clocks,
    )
    json_path = write_new_results(args.json or folder / "ab.json", report, folder)
    print(f"json: {json_path}")
    return HUNG_EXIT_STATUS if hung else 0


def stop_hung_workers(runners: list, reason: str, deadline_s: float, stack_lines: int = 60) -> None:
    """At the deadline: each resident worker's stacks (SIGUSR1, see install_stack_dump), their end printed, then
    every worker killed."""
    print(f"bench/ab.py: deadline {deadline_s:.0f} s reached: {reason}; stopping the workers", file=sys.stderr, flush=True)
    dumped = [(runner.version.label, out) for runner in runners if (out := runner.dump_stacks()) is not None]
    if dumped:
        time.sleep(STACK_DUMP_WAIT_S)  # faulthandler writes from a signal handler: give it a moment
    for label, out in dumped:
        tail = out.read_text(errors="replace").splitlines()[-stack_lines:]
        print(f"--- {label}: the last {len(tail)} lines of {out} (its stacks at the deadline) ---", file=sys.stderr)
        print("\n".join(tail), file=sys.stderr, flush=True)
    stop_workers(runners)


def stop_workers(runners: list) -> None:
    """Kills every worker, all at once and then waits for them (the time after a deadline is short)."""
    for runner in runners:
        runner.kill()
    for runner in runners:
        runner.reap()


def _device_name() -> str:
    import torch

    return torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu"


def main() -> None:
    args, overrides = parse_arguments(sys.argv[1:])
    if args.check_script:
        _check_script_main(args.check_script, overrides)
        return
    if args.worker:
        worker_main(args, overrides)
        return
    try:
        sys.exit(coordinate(args, overrides))
    except ABError as error:
        print(f"bench/ab.py: error: {error}", file=sys.stderr)
        sys.exit(2)


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    main()
