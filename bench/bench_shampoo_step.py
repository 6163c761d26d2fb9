"""Time `DistributedShampoo.step()` on the Track 3 parameter set and compare it with a fused AdamW step.

The parameters are the 72 matrices Shampoo trains in the Track 3 record (12 layers × q, k, v, attention
projection 768×768, MLP fc 3072×768, MLP projection 768×3072; fp32) with the record's optimizer settings.
Gradients are fixed random tensors (identical on every rank), so only the optimizer is measured.

    python bench/bench_shampoo_step.py                               # one GPU, single-device distributor
    torchrun --standalone --nproc_per_node=2 bench/bench_shampoo_step.py   # DDP distributor on 2 GPUs
    python bench/bench_shampoo_step.py --tiny --device cpu           # small sizes, to check the script
    python bench/bench_shampoo_step.py --root-streams 1,2,4,8        # one Shampoo row per stream count
    python bench/bench_shampoo_step.py --root-streams 1,8 --memory-fractions 0.1,0.5,inf   # and per memory bound
    python bench/bench_shampoo_step.py --symmetric-packing on        # packed factors (the package default; the record's are square)
    python bench/bench_shampoo_step.py --batched off,on              # per-block and batched same-shape blocks
    python bench/bench_shampoo_step.py --upstream .proxy/upstream    # and the published optimizer from that folder

Every row's parameters after the measured steps are compared with the first row's: "= row 1" says "yes" when they
are bitwise equal, else the largest absolute difference (every row starts from the same parameters and steps
through the same gradients). With the published optimizer installed (distribution `torch-shampoo`, from
facebookresearch/optimizers) or `--upstream PATH` naming a folder that holds its `distributed_shampoo/`, a last
Shampoo row times it (in a child process, where its `distributed_shampoo` is the one imported), with the record's
arguments and no runtime extensions; otherwise one line says it is not installed.

Prints two tables. The first: mean ms per step over the measured steps, split into steps that recompute the
inverse roots (every `--precondition-frequency` steps) and the others, the mean step as a multiple of the AdamW
step, and per rank the optimizer state and, on CUDA, the peak memory the optimizer added while stepping (peak
allocated minus the parameters and gradients already there), the part of it above the state ("transient"), and
the bound issue 14 sets for it: 0.1 × state + the largest single root computation (the package's estimate of one
factor's temporaries, `_amortized_computation_bytes`).

The second (CUDA only) says where the transient memory comes from, every column in MiB above the state unless
marked: "persistent" is what stays allocated after the last step besides the state (the all-gather buffer under
DDP, cuBLAS workspaces, cached index tensors); "other steps" and "root steps" the peaks of the measured steps of
each kind (`torch.cuda.reset_peak_memory_stats` before every step); then, for one extra root step after the
timing (synchronised, untimed), the peaks before, during and after the root computation (`_amortized_computation`)
and its wall time; "1 root" the memory one root computation of the largest factor allocates by itself (measured,
above what was allocated before it; the bound's term) next to its estimate; "budget" the total estimated
temporaries that concurrent root computations may hold (several streams only). distributed_shampoo/README.md
("Root steps: failures, memory and concurrency") derives the figures to expect.
"""

import argparse
import dataclasses
import gc
import importlib.metadata
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any
from unittest import mock

import torch
import torch.distributed as dist
from torch import Tensor

REPO = Path(__file__).resolve().parent.parent
# Set in the child process that times the published optimizer: the folder holding its distributed_shampoo/, which
# must come first on the path so that train_gpt_shampoo.py and this script import it instead of ours.
UPSTREAM_ROOT_VARIABLE = "BENCH_SHAMPOO_UPSTREAM_ROOT"
UPSTREAM_DISTRIBUTION = "torch-shampoo"
sys.path.insert(0, str(REPO))  # the repository root (bench/scripts.py)
if os.environ.get(UPSTREAM_ROOT_VARIABLE):
    sys.path.insert(0, os.environ[UPSTREAM_ROOT_VARIABLE])

import train_gpt_shampoo as tgs  # noqa: E402
from distributed_shampoo import DistributedShampoo  # noqa: E402

RECORD = tgs.Hyperparameters()
RECORD_MEMORY_FRACTION = RECORD.shampoo_root_memory_fraction


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda", choices=["cuda", "cpu"], help="where parameters live")
    parser.add_argument("--tiny", action="store_true", help="model dim 128, 2 layers (for a CPU check)")
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--dim", type=int, default=768)
    parser.add_argument("--steps", type=int, default=50, help="measured steps")
    parser.add_argument("--warmup", type=int, default=10, help="unmeasured steps first (include one root step)")
    parser.add_argument("--precondition-frequency", type=int, default=5)
    parser.add_argument(
        "--root-streams",
        default=str(RECORD.shampoo_root_streams),
        help="comma-separated CUDA stream counts for the root recomputation (train_gpt_shampoo's --shampoo_root_streams)",
    )
    parser.add_argument(
        "--memory-fractions",
        default="0.1",
        help="comma-separated ShampooRuntimeConfig.concurrent_memory_fraction values (inf: unbounded); each "
        "multi-stream count runs once per value",
    )
    parser.add_argument(
        "--gradient-sets",
        type=int,
        default=1,
        help="cycle through this many fixed gradient sets (1: the same gradient every step, so a 3072×768 "
        "matrix's left factor keeps rank 768, which can change eigh's speed; 5 or more make every factor full rank)",
    )
    parser.add_argument(
        "--symmetric-packing",
        default="default",
        choices=["default", "on", "off"],
        help="store factors and roots as upper triangles (on, the package default) or square (off); default: as the "
        "record (square)",
    )
    parser.add_argument(
        "--batched",
        default="off",
        help="comma-separated off/on: ShampooRuntimeConfig.batch_same_shape_blocks (same-shape blocks updated and "
        "applied with batched matmuls); each stream count and memory fraction runs once per value",
    )
    parser.add_argument(
        "--upstream",
        default="auto",
        help="the published optimizer for a last row: auto (the installed torch-shampoo distribution, if any), off, "
        "or a folder holding its distributed_shampoo/",
    )
    parser.add_argument("--upstream-worker", type=Path, help=argparse.SUPPRESS)  # internal: the child's result file
    parser.add_argument(
        "--linalg-library",
        default="default",
        choices=["default", "cusolver", "magma"],
        help="torch.backends.cuda.preferred_linalg_library for eigh",
    )
    args = parser.parse_args()
    if args.tiny:
        # dim·dim must exceed max_preconditioner_dim (8192), or merge_small_dims flattens the matrices.
        args.layers, args.dim = 2, 128
    for name in ("steps", "layers", "dim", "precondition_frequency", "gradient_sets"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if args.warmup < 0:
        parser.error(f"--warmup must be >= 0, got {args.warmup}")
    try:
        args.root_streams = [int(count) for count in args.root_streams.split(",")]
    except ValueError:
        parser.error(f"--root-streams must be comma-separated integers, got {args.root_streams!r}")
    if min(args.root_streams) < 1:
        parser.error(f"--root-streams must all be >= 1, got {args.root_streams}")
    try:
        args.memory_fractions = [float(value) for value in args.memory_fractions.split(",")]
    except ValueError:
        parser.error(f"--memory-fractions must be comma-separated numbers, got {args.memory_fractions!r}")
    if not all(value >= 0 for value in args.memory_fractions):
        parser.error(f"--memory-fractions must all be >= 0 (inf: unbounded), got {args.memory_fractions}")
    choices = {"off": False, "on": True}
    if not all(value in choices for value in args.batched.split(",")):
        parser.error(f"--batched must be comma-separated off/on, got {args.batched!r}")
    args.batched = [choices[value] for value in args.batched.split(",")]
    if True in args.batched and args.symmetric_packing == "on":
        parser.error("--batched on needs square factors (ShampooRuntimeConfig.batch_same_shape_blocks refuses packed "
                     "ones): pass --symmetric-packing off or default")
    if args.upstream not in ("auto", "off") and not (Path(args.upstream) / "distributed_shampoo" / "__init__.py").is_file():
        parser.error(f"--upstream={args.upstream}: no distributed_shampoo/__init__.py in that folder; pass the folder "
                     "that holds the published package (or auto, or off)")
    return args


def track3_shapes(layers: int, dim: int) -> list[tuple[int, int]]:
    """Per layer: q, k, v, attention projection (dim×dim), MLP fc (4·dim×dim), MLP projection (dim×4·dim)."""
    return [shape for _ in range(layers) for shape in [(dim, dim)] * 4 + [(4 * dim, dim), (dim, 4 * dim)]]


def make_params(
    shapes: list[tuple[int, int]], device: torch.device, gradient_sets: int
) -> tuple[list[torch.nn.Parameter], list[list[Tensor]]]:
    """Parameters and `gradient_sets` sets of gradients for them (step t uses set t mod gradient_sets)."""
    generator = torch.Generator(device="cpu").manual_seed(0)
    params = [torch.nn.Parameter((0.02 * torch.randn(s, generator=generator)).to(device)) for s in shapes]
    grads = [[(1e-3 * torch.randn(s, generator=generator)).to(device) for s in shapes] for _ in range(gradient_sets)]
    return params, grads


@dataclasses.dataclass(frozen=True)
class Variant:
    """One Shampoo row's settings besides the record's."""

    root_streams: int = 1
    memory_fraction: float = RECORD_MEMORY_FRACTION
    batched: bool = False
    upstream: bool = False  # the published optimizer (in a child process)


def make_shampoo(
    params: list[torch.nn.Parameter], precondition_frequency: int, variant: Variant, world_size: int, packing: str,
) -> DistributedShampoo:
    """The Track 3 record's optimizer, built by train_gpt_shampoo.py itself, with the frequency, the number of
    root-computation streams, their memory fraction, batching and (unless "default", the record's square storage)
    the factor layout configurable. For the published optimizer, whose ShampooRuntimeConfig has none of our fields,
    the runtime config is its default."""
    hp = dataclasses.replace(
        RECORD, shampoo_precondition_frequency=precondition_frequency, shampoo_root_streams=variant.root_streams,
        shampoo_root_memory_fraction=variant.memory_fraction,
    )
    root_inv_config, runtime_config = tgs.RootInvShampooPreconditionerConfig, tgs.ShampooRuntimeConfig

    def config_with_packing(**kwargs: Any) -> Any:
        # build_shampoo passes use_symmetric_packing itself; a keyword bound by functools.partial would lose to it.
        return root_inv_config(**kwargs if packing == "default" else {**kwargs, "use_symmetric_packing": packing == "on"})

    def runtime_with_batching(**kwargs: Any) -> Any:
        return runtime_config() if variant.upstream else runtime_config(**kwargs, batch_same_shape_blocks=variant.batched)

    with mock.patch.object(tgs, "RootInvShampooPreconditionerConfig", config_with_packing), \
            mock.patch.object(tgs, "ShampooRuntimeConfig", runtime_with_batching):
        return tgs.build_shampoo(params, hp, world_size)


def shampoo_lists(optimizer: DistributedShampoo) -> list[Any]:
    """This rank's Shampoo preconditioner list of every param group (package internals: this is a benchmark)."""
    from distributed_shampoo.preconditioner.shampoo_preconditioner_list import BaseShampooPreconditionerList

    lists = [runtime.shampoo for runtime in optimizer._group_runtimes]
    assert all(isinstance(shampoo, BaseShampooPreconditionerList) for shampoo in lists)
    return lists  # type: ignore[return-value]


def largest_factor(optimizer: DistributedShampoo) -> tuple[Any, Any, int] | None:
    """(list, block, factor index) of this rank's factor with the largest estimated root computation."""
    factors = [(shampoo, block, j) for shampoo in shampoo_lists(optimizer) for block in shampoo._local_blocks for j in range(len(block.factor_dims))]
    return max(factors, key=lambda factor: factor[0]._amortized_computation_bytes(factor[1], factor[2]), default=None)


def largest_root_computation_bytes(optimizer: DistributedShampoo) -> int:
    """The package's estimate of the largest single root computation's temporaries on this rank."""
    factor = largest_factor(optimizer)
    return 0 if factor is None else factor[0]._amortized_computation_bytes(factor[1], factor[2])


def concurrency_budget_bytes(optimizer: DistributedShampoo) -> float:
    """Total estimated temporaries that concurrent root computations may hold (the largest list's budget)."""
    return max(
        (
            max(shampoo._amortized_computation_bytes(block, j) for block in shampoo._local_blocks for j in range(len(block.factor_dims)))
            + shampoo._concurrent_memory_fraction * shampoo._state_bytes
            for shampoo in shampoo_lists(optimizer)
            if shampoo._local_blocks
        ),
        default=0.0,
    )


def make_adamw(params: list[torch.nn.Parameter], device: torch.device) -> torch.optim.AdamW:
    """The record script's AdamW ablation on the matrices (--matrix_optimizer=adamw)."""
    fused = device.type == "cuda"
    return torch.optim.AdamW(
        params, lr=RECORD.matrix_lr, betas=(RECORD.matrix_beta1, RECORD.shampoo_grafting_beta2),
        eps=RECORD.shampoo_grafting_epsilon, weight_decay=RECORD.matrix_weight_decay, fused=fused, foreach=not fused,
    )


def _tensors(value: Any) -> Iterator[Tensor]:
    if isinstance(value, Tensor):
        yield value
    elif isinstance(value, dict):
        for item in value.values():
            yield from _tensors(item)


def state_bytes(optimizer: torch.optim.Optimizer) -> int:
    """Bytes of distinct tensors in this rank's optimizer state (the CPU step counters included)."""
    seen: dict[int, int] = {}
    for tensor in _tensors(optimizer.state_dict()["state"]):
        seen[tensor.untyped_storage().data_ptr()] = tensor.untyped_storage().nbytes()
    return sum(seen.values())


class StepTimer:
    """Wall time of one call in ms, measured with CUDA events on GPU (synchronising only after the call)."""

    def __init__(self, device: torch.device) -> None:
        self._cuda = device.type == "cuda"

    def __call__(self, fn: Callable[[], Any]) -> float:
        if self._cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            torch.cuda.synchronize()
            return start.elapsed_time(end)
        begin = time.perf_counter()
        fn()
        return 1e3 * (time.perf_counter() - begin)


@dataclasses.dataclass
class StepRecord:
    step: int  # the optimizer's step number
    ms: float
    peak: float  # bytes above `baseline` (CUDA; NaN elsewhere)


def set_grads(params: list[torch.nn.Parameter], grads: list[list[Tensor]], step: int) -> None:
    for param, grad in zip(params, grads[step % len(grads)], strict=True):
        param.grad = grad


def time_optimizer(
    optimizer: torch.optim.Optimizer,
    params: list[torch.nn.Parameter],
    grads: list[list[Tensor]],
    timer: StepTimer,
    warmup: int,
    steps: int,
    baseline: int | None = None,
) -> list[StepRecord]:
    """One record per step (warm-up steps first); with a `baseline` (bytes allocated before the optimizer, CUDA)
    each step's peak allocation above it. Resetting the peak statistics does not synchronise: the timer does."""
    device = params[0].device
    records = []
    for step in range(1, warmup + steps + 1):
        set_grads(params, grads, step)
        if baseline is not None:
            torch.cuda.reset_peak_memory_stats(device)
        elapsed = timer(optimizer.step)
        peak = torch.cuda.max_memory_allocated(device) - baseline if baseline is not None else math.nan
        records.append(StepRecord(step, elapsed, peak))
    return records


@dataclasses.dataclass
class RootStepMemory:
    """Peaks (bytes above the baseline) of one root step's phases, and one decomposition by itself."""

    before_roots: float = 0.0  # from the step's start to the root computation (factor and grafting updates)
    roots: float = 0.0  # the root computation (`_amortized_computation` of every group)
    after_roots: float = 0.0  # the rest: first moment, preconditioning, grafting, weight decay, parameter update
    roots_ms: float = 0.0
    one_root: float = math.nan  # recomputing the largest factor alone: peak allocation above what was there


def probe_root_step(
    optimizer: DistributedShampoo,
    params: list[torch.nn.Parameter],
    grads: list[list[Tensor]],
    next_step: int,
    frequency: int,
    baseline: int,
) -> RootStepMemory:
    """Step (untimed) up to and through the next root step, measuring its phases; then one root computation of
    the largest factor alone. Synchronises around every phase."""
    device = params[0].device
    while next_step % frequency != 0:
        set_grads(params, grads, next_step)
        optimizer.step()
        next_step += 1
    memory = RootStepMemory()

    def peak_since_reset() -> float:
        torch.cuda.synchronize(device)
        peak = torch.cuda.max_memory_allocated(device) - baseline
        torch.cuda.reset_peak_memory_stats(device)
        return peak

    def measured(original: Callable[[], None]) -> Callable[[], None]:
        def amortized_computation() -> None:
            memory.before_roots = max(memory.before_roots, peak_since_reset())
            begin = time.perf_counter()
            original()
            memory.roots = max(memory.roots, peak_since_reset())
            memory.roots_ms += 1e3 * (time.perf_counter() - begin)

        return amortized_computation

    lists = shampoo_lists(optimizer)
    for shampoo in lists:  # an instance attribute shadows the method for this one step
        shampoo._amortized_computation = measured(shampoo._amortized_computation)  # type: ignore[method-assign]
    try:
        set_grads(params, grads, next_step)
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        optimizer.step()
        memory.after_roots = peak_since_reset()
    finally:
        for shampoo in lists:
            del shampoo._amortized_computation
    factor = largest_factor(optimizer)
    if factor is not None:
        shampoo, block, j = factor
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        before = torch.cuda.memory_allocated(device)
        shampoo._recompute_factors([(block, j)], 1)
        torch.cuda.synchronize(device)
        memory.one_root = torch.cuda.max_memory_allocated(device) - before
    return memory


def mean(values: list[float]) -> float:
    return statistics.fmean(values) if values else math.nan


@dataclasses.dataclass
class ShampooRun:
    variant: Variant
    label: str
    records: list[StepRecord]
    state: int  # bytes
    persistent: float  # bytes allocated after the last step besides the state (CUDA)
    bound: float  # issue 14's bound on the transient: 0.1 × state + the largest root computation (estimated)
    one_root_estimate: float
    budget: float
    probe: RootStepMemory | None
    final_params: list[Tensor]  # on the CPU, after the measured steps


def row_label(variant: Variant, args: argparse.Namespace) -> str:
    if variant.upstream:
        return "published optimizer"
    label = f"Shampoo, {variant.root_streams} stream{'s' if variant.root_streams > 1 else ''}"
    if variant.root_streams > 1 and args.memory_fractions != [RECORD_MEMORY_FRACTION]:
        label += f", mem {variant.memory_fraction:g}"
    if variant.batched:
        label += ", batched"
    return label


def run_shampoo(args: argparse.Namespace, variant: Variant, shapes: list[tuple[int, int]], device: torch.device,
                world_size: int, timer: StepTimer) -> ShampooRun:
    cuda = device.type == "cuda"
    gc.collect()
    if cuda:
        torch.cuda.empty_cache()
    params, grads = make_params(shapes, device, args.gradient_sets)
    set_grads(params, grads, 0)
    baseline = None
    if cuda:
        torch.cuda.synchronize(device)
        baseline = torch.cuda.memory_allocated(device)  # parameters and gradients
    shampoo = make_shampoo(params, args.precondition_frequency, variant, world_size, args.symmetric_packing)
    records = time_optimizer(shampoo, params, grads, timer, args.warmup, args.steps, baseline)
    final_params = [param.detach().cpu().clone() for param in params]
    nbytes = state_bytes(shampoo)
    persistent, probe, largest, budget = math.nan, None, math.nan, math.nan
    if baseline is not None:
        torch.cuda.synchronize(device)
        persistent = torch.cuda.memory_allocated(device) - baseline - nbytes
    if not variant.upstream:  # the rest reads our package's internals
        if baseline is not None:
            probe = probe_root_step(shampoo, params, grads, args.warmup + args.steps + 1, args.precondition_frequency, baseline)
        largest = largest_root_computation_bytes(shampoo)
        budget = concurrency_budget_bytes(shampoo) if variant.root_streams > 1 else math.nan
    return ShampooRun(variant, row_label(variant, args), records, nbytes, persistent, 0.1 * nbytes + largest, largest,
                      budget, probe, final_params)


def max_or_nan(values: list[float]) -> float:
    return max(values) if values else math.nan


def difference_from(reference: list[Tensor], params: list[Tensor]) -> str:
    """"yes" when every parameter is bitwise equal to the reference's, else the largest absolute difference."""
    if all(torch.equal(a, b) for a, b in zip(reference, params, strict=True)):
        return "yes"
    return f"{max((a.double() - b.double()).abs().max().item() for a, b in zip(reference, params, strict=True)):.1e}"


# ------------------------------------------------------------------------------------------ published optimizer


def find_upstream(choice: str) -> tuple[Path | None, str]:
    """(folder holding the published distributed_shampoo/, or None; a line saying which, or why not)."""
    if choice == "off":
        return None, "published optimizer: not compared (--upstream off)"
    if choice != "auto":
        return Path(choice).resolve(), f"published optimizer: from {Path(choice).resolve()}"
    try:
        distribution = importlib.metadata.distribution(UPSTREAM_DISTRIBUTION)
    except importlib.metadata.PackageNotFoundError:
        return None, (f"published optimizer: not installed (no {UPSTREAM_DISTRIBUTION} distribution; install "
                      "facebookresearch/optimizers, or pass --upstream with a folder holding its distributed_shampoo/)")
    root = Path(str(distribution.locate_file("")))
    if not (root / "distributed_shampoo" / "__init__.py").is_file():
        return None, (f"published optimizer: {UPSTREAM_DISTRIBUTION} {distribution.version} is installed but its "
                      f"distributed_shampoo/ is not in {root}; pass --upstream with the folder holding it")
    return root, f"published optimizer: {UPSTREAM_DISTRIBUTION} {distribution.version} from {root}"


def run_upstream(args: argparse.Namespace, root: Path) -> ShampooRun:
    """Times the published optimizer in a child process (one process only: under torchrun every rank would start
    one, so distributed runs leave it out) and reads its run back."""
    with tempfile.TemporaryDirectory() as folder:
        result = Path(folder) / "upstream.pt"
        command = [sys.executable, str(Path(__file__).resolve()), *sys.argv[1:], "--upstream-worker", str(result)]
        environment = dict(os.environ, **{UPSTREAM_ROOT_VARIABLE: str(root)})
        for name in ("WORLD_SIZE", "RANK", "LOCAL_RANK"):
            environment.pop(name, None)
        completed = subprocess.run(command, env=environment, cwd=REPO, capture_output=True, text=True)
        if completed.returncode != 0:
            last = (completed.stderr.strip() or completed.stdout.strip() or "no output").splitlines()[-1]
            raise SystemExit(f"bench_shampoo_step.py: the published optimizer's run failed: {last}")
        saved = torch.load(result)
    records = [StepRecord(int(step), float(ms), float(peak)) for step, ms, peak in saved["records"].tolist()]
    nan = math.nan
    return ShampooRun(Variant(upstream=True), row_label(Variant(upstream=True), args), records, int(saved["state"]),
                      float(saved["persistent"]), nan, nan, nan, None, list(saved["final_params"]))


def upstream_worker(args: argparse.Namespace, device: torch.device, timer: StepTimer) -> None:
    import distributed_shampoo

    root = Path(os.environ[UPSTREAM_ROOT_VARIABLE]).resolve()
    if root not in Path(distributed_shampoo.__file__).resolve().parents:
        raise SystemExit(f"bench_shampoo_step.py: imported {distributed_shampoo.__file__}, not the package in {root}")
    run = run_shampoo(args, Variant(upstream=True), track3_shapes(args.layers, args.dim), device, 1, timer)
    records = torch.tensor([[record.step, record.ms, record.peak] for record in run.records], dtype=torch.float64)
    torch.save(dict(records=records, state=run.state, persistent=run.persistent, final_params=run.final_params),
               args.upstream_worker)


# ------------------------------------------------------------------------------------------------------- main


def main() -> None:
    args = parse_args()
    distributed = "WORLD_SIZE" in os.environ and int(os.environ["WORLD_SIZE"]) > 1
    if distributed:
        backend = "nccl" if args.device == "cuda" else "gloo"
        dist.init_process_group(backend)
    rank, world_size = (dist.get_rank(), dist.get_world_size()) if distributed else (0, 1)
    if args.device == "cuda":
        if not torch.cuda.is_available():
            raise SystemExit("bench_shampoo_step.py: no CUDA device; pass --device cpu (with --tiny) to run on the CPU.")
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
        if args.linalg_library != "default":
            torch.backends.cuda.preferred_linalg_library(args.linalg_library)
    device = torch.device(args.device, torch.cuda.current_device()) if args.device == "cuda" else torch.device("cpu")
    timer = StepTimer(device)
    if args.upstream_worker is not None:
        upstream_worker(args, device, timer)
        return
    shapes = track3_shapes(args.layers, args.dim)
    frequency = args.precondition_frequency
    variants = [
        Variant(root_streams, fraction, batched)
        for root_streams in args.root_streams
        for fraction in (args.memory_fractions if root_streams > 1 else args.memory_fractions[:1])
        for batched in args.batched
    ]
    runs = [run_shampoo(args, variant, shapes, device, world_size, timer) for variant in variants]
    upstream_root, upstream_line = find_upstream(args.upstream)
    if upstream_root is not None and distributed:
        upstream_root, upstream_line = None, "published optimizer: not compared under torchrun (run one process)"
    if upstream_root is not None:
        runs.append(run_upstream(args, upstream_root))

    params, grads = make_params(shapes, device, args.gradient_sets)
    adamw = make_adamw(params, device)
    adamw_records = time_optimizer(adamw, params, grads, timer, args.warmup, args.steps)[args.warmup :]
    adamw_mean = mean([record.ms for record in adamw_records])

    mib = 2**20
    timing_rows, memory_rows = [], []
    for run in runs:
        measured = run.records[args.warmup :]
        roots = [record for record in measured if record.step % frequency == 0]
        others = [record for record in measured if record.step % frequency != 0]
        shampoo_mean = mean([record.ms for record in measured])
        peak = max_or_nan([record.peak for record in run.records])  # warm-up steps included, as the state is
        timing_rows.append(
            f"{run.label:<30}{shampoo_mean:>13.2f}{mean([r.ms for r in roots]):>12.2f}{mean([r.ms for r in others]):>13.2f}"
            f"{shampoo_mean / adamw_mean:>9.2f}{run.state / mib:>11.1f}{peak / mib:>10.1f}{(peak - run.state) / mib:>11.1f}"
            f"{run.bound / mib:>8.1f}{difference_from(runs[0].final_params, run.final_params):>9}"
        )
        if run.probe is not None:
            above_state = [
                run.persistent,
                max_or_nan([r.peak for r in others]) - run.state,
                max_or_nan([r.peak for r in roots]) - run.state,
                run.probe.before_roots - run.state,
                run.probe.roots - run.state,
                run.probe.after_roots - run.state,
            ]
            memory_rows.append(
                f"{run.label:<30}" + "".join(f"{value / mib:>11.1f}" for value in above_state)
                + f"{run.probe.roots_ms:>10.1f}{run.probe.one_root / mib:>9.1f}{run.one_root_estimate / mib:>10.1f}"
                + f"{run.budget / mib:>9.1f}"
            )
    adamw_label = "AdamW (fused)" if device.type == "cuda" else "AdamW (foreach)"
    nan = math.nan
    timing_rows.append(
        f"{adamw_label:<30}{adamw_mean:>13.2f}{nan:>12.2f}{nan:>13.2f}{1.0:>9.2f}{state_bytes(adamw) / mib:>11.1f}"
        f"{nan:>10.1f}{nan:>11.1f}{nan:>8.1f}{'':>9}"
    )
    per_rank: list[Any] = [None] * world_size
    if distributed:
        dist.all_gather_object(per_rank, (timing_rows, memory_rows))
    else:
        per_rank = [(timing_rows, memory_rows)]
    if rank == 0:
        name = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"
        print(
            f"{len(shapes)} fp32 matrices ({args.layers} layers, dim {args.dim}), {world_size} × {name}, "
            f"torch {torch.__version__}, precondition_frequency={frequency}, {args.steps} measured steps after "
            f"{args.warmup} warm-up steps, {args.gradient_sets} gradient set(s), linalg={args.linalg_library}, "
            f"symmetric packing={args.symmetric_packing}"
        )
        print(upstream_line)
        header = (
            f"{'rank':>4}  {'optimizer':<30}{'mean ms/step':>13}{'root steps':>12}{'other steps':>13}{'× AdamW':>9}"
            f"{'state MiB':>11}{'peak MiB':>10}{'transient':>11}{'bound':>8}{'= row 1':>9}"
        )
        print(header)
        print("-" * len(header))
        for index, (rows, _) in enumerate(per_rank):
            for row in rows:
                print(f"{index:>4}  {row}")
        print("peak: allocated on top of parameters and gradients while stepping; transient = peak - state; "
              "bound = 0.1 × state + the largest root computation's estimated temporaries (issue 14: transient "
              "within it); = row 1: this row's parameters after the measured steps, bitwise equal to the first "
              "row's (yes) or their largest difference.")
        if any(memory for _, memory in per_rank):
            header = (
                f"{'rank':>4}  {'optimizer':<30}{'persistent':>11}{'other steps':>11}{'root steps':>11}"
                f"{'pre-roots':>11}{'roots':>11}{'post-roots':>11}{'roots ms':>10}{'1 root':>9}{'estimate':>10}"
                f"{'budget':>9}"
            )
            print()
            print(header)
            print("-" * len(header))
            for index, (_, rows) in enumerate(per_rank):
                for row in rows:
                    print(f"{index:>4}  {row}")
            print("MiB above the state (persistent, other/root steps: peaks of the measured steps; pre-roots, roots, "
                  "post-roots: the phases of one extra root step); roots ms: that step's root computation; 1 root: "
                  "one root computation of the largest factor alone (measured) and its estimate; budget: estimated "
                  "temporaries concurrent root computations may hold.")
    if distributed:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
