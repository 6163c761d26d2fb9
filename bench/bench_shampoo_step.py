"""Time `DistributedShampoo.step()` on the Track 3 parameter set and compare it with a fused AdamW step.

The parameters are the 72 matrices Shampoo trains in the Track 3 record (12 layers × q, k, v, attention
projection 768×768, MLP fc 3072×768, MLP projection 768×3072; fp32) with the record's optimizer settings.
Gradients are fixed random tensors (identical on every rank), so only the optimizer is measured.

    python bench/bench_shampoo_step.py                               # one GPU, single-device distributor
    torchrun --standalone --nproc_per_node=2 bench/bench_shampoo_step.py   # DDP distributor on 2 GPUs
    python bench/bench_shampoo_step.py --tiny --device cpu           # small sizes, to check the script
    python bench/bench_shampoo_step.py --root-streams 1,2,4,8        # one Shampoo row per stream count
    python bench/bench_shampoo_step.py --symmetric-packing off       # square factor storage (the May layout)

Prints one table: mean ms per step over the measured steps, split into steps that recompute the inverse roots
(every `--precondition-frequency` steps) and the others, the mean step as a multiple of the AdamW step, and per
rank the optimizer state and, on CUDA, the peak memory the optimizer added while stepping (peak allocated minus
the parameters and gradients already there), the part of it that was transient (peak − state), and the bound
issue 14 sets for it: 0.1 × state + the largest single root computation's temporaries (5·d² for the largest
factor, see `shampoo_preconditioner_list._AMORTIZED_COMPUTATION_TEMPORARIES`).
"""

import argparse
import dataclasses
import functools
import gc
import math
import os
import statistics
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any
from unittest import mock

import torch
import torch.distributed as dist
from torch import Tensor

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import train_gpt_shampoo as tgs  # noqa: E402
from distributed_shampoo import DistributedShampoo, RootInvShampooPreconditionerConfig  # noqa: E402
from distributed_shampoo.utils.shampoo_utils import packed_dimension  # noqa: E402

RECORD = tgs.Hyperparameters()


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
        help="store factors and roots as upper triangles (on, the package default) or square (off)",
    )
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


def make_shampoo(
    params: list[torch.nn.Parameter], precondition_frequency: int, root_streams: int, world_size: int, packing: str
) -> torch.optim.Optimizer:
    """The Track 3 record's optimizer, built by train_gpt_shampoo.py itself, with the frequency, the number of
    root-computation streams and (unless "default") the factor storage layout made configurable."""
    hp = dataclasses.replace(
        RECORD, shampoo_precondition_frequency=precondition_frequency, shampoo_root_streams=root_streams
    )
    if packing == "default":
        return tgs.build_shampoo(params, hp, world_size)
    # build_shampoo passes no preconditioner_config, so this only replaces the default one.
    config = RootInvShampooPreconditionerConfig(use_symmetric_packing=packing == "on")
    with mock.patch.object(tgs, "DistributedShampoo", functools.partial(DistributedShampoo, preconditioner_config=config)):
        return tgs.build_shampoo(params, hp, world_size)


def largest_root_computation_bytes(optimizer: torch.optim.Optimizer) -> int:
    """5·d²·4 for the largest factor dimension d among this rank's blocks (fp32 factors)."""
    dims = [
        d
        for param_state in optimizer.state.values()
        for block in param_state.values()
        if isinstance(block, dict) and "shampoo" in block
        for factor in block["shampoo"].factor_matrices
        for d in [factor.shape[0] if factor.dim() == 2 else packed_dimension(factor.numel())]
    ]
    largest = max(dims, default=0)
    return 5 * largest * largest * 4


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


def time_optimizer(
    optimizer: torch.optim.Optimizer,
    params: list[torch.nn.Parameter],
    grads: list[list[Tensor]],
    timer: StepTimer,
    warmup: int,
    steps: int,
) -> list[tuple[int, float]]:
    """(optimizer step number, ms) for each measured step."""
    timings = []
    for step in range(1, warmup + steps + 1):
        for param, grad in zip(params, grads[step % len(grads)], strict=True):
            param.grad = grad
        elapsed = timer(optimizer.step)
        if step > warmup:
            timings.append((step, elapsed))
    return timings


def mean(values: list[float]) -> float:
    return statistics.fmean(values) if values else math.nan


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
    shapes = track3_shapes(args.layers, args.dim)

    frequency = args.precondition_frequency
    cuda = device.type == "cuda"
    shampoo_results = []
    for root_streams in args.root_streams:
        gc.collect()
        if cuda:
            torch.cuda.empty_cache()
        params, grads = make_params(shapes, device, args.gradient_sets)
        for param, grad in zip(params, grads[0], strict=True):
            param.grad = grad
        if cuda:
            torch.cuda.synchronize(device)
            torch.cuda.reset_peak_memory_stats(device)
            before_optimizer = torch.cuda.memory_allocated(device)  # parameters and gradients
        shampoo = make_shampoo(params, frequency, root_streams, world_size, args.symmetric_packing)
        timings = time_optimizer(shampoo, params, grads, timer, args.warmup, args.steps)
        peak = torch.cuda.max_memory_allocated(device) - before_optimizer if cuda else math.nan
        shampoo_results.append((root_streams, timings, state_bytes(shampoo), peak, largest_root_computation_bytes(shampoo)))
        del shampoo, params, grads

    params, grads = make_params(shapes, device, args.gradient_sets)
    adamw = make_adamw(params, device)
    adamw_timings = time_optimizer(adamw, params, grads, timer, args.warmup, args.steps)
    adamw_mean = mean([ms for _, ms in adamw_timings])

    rows = []
    for root_streams, timings, nbytes, peak, largest in shampoo_results:
        root_ms = [ms for step, ms in timings if step % frequency == 0]
        other_ms = [ms for step, ms in timings if step % frequency != 0]
        shampoo_mean = mean([ms for _, ms in timings])
        label = f"Shampoo, {root_streams} stream{'s' if root_streams > 1 else ''}"
        bound = 0.1 * nbytes + largest
        rows.append((label, shampoo_mean, mean(root_ms), mean(other_ms), shampoo_mean / adamw_mean, nbytes, peak, peak - nbytes, bound))
    adamw_label = "AdamW (fused)" if device.type == "cuda" else "AdamW (foreach)"
    rows.append((adamw_label, adamw_mean, math.nan, math.nan, 1.0, state_bytes(adamw), math.nan, math.nan, math.nan))
    per_rank: list[Any] = [None] * world_size
    if distributed:
        dist.all_gather_object(per_rank, rows)
    else:
        per_rank = [rows]
    if rank == 0:
        name = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"
        print(
            f"{len(shapes)} fp32 matrices ({args.layers} layers, dim {args.dim}), {world_size} × {name}, "
            f"torch {torch.__version__}, precondition_frequency={frequency}, {args.steps} measured steps after "
            f"{args.warmup} warm-up steps, {args.gradient_sets} gradient set(s), linalg={args.linalg_library}, "
            f"symmetric packing={args.symmetric_packing}"
        )
        header = (
            f"{'rank':>4}  {'optimizer':<22}{'mean ms/step':>13}{'root steps':>12}{'other steps':>13}{'× AdamW':>9}"
            f"{'state MiB':>11}{'peak MiB':>10}{'transient':>11}{'bound':>8}"
        )
        print(header)
        print("-" * len(header))
        mib = 2**20
        for index, rank_rows in enumerate(per_rank):
            for label, all_ms, roots, others, ratio, nbytes, peak, transient, bound in rank_rows:
                print(
                    f"{index:>4}  {label:<22}{all_ms:>13.2f}{roots:>12.2f}{others:>13.2f}{ratio:>9.2f}"
                    f"{nbytes / mib:>11.1f}{peak / mib:>10.1f}{transient / mib:>11.1f}{bound / mib:>8.1f}"
                )
        print("peak: allocated on top of parameters and gradients while stepping; transient = peak - state; "
              "bound = 0.1 × state + 5·d² fp32 for the largest factor (issue 14: transient within it).")
    if distributed:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
