"""The Shampoo root step's floor, the eigensolver: `torch.linalg.eigh` on the Track 3 factor set, run several ways.

A root step of the Track 3 record decomposes every factor of the 72 matrices once: per layer the q, k, v and
attention projections (768×768: two 768 factors each), the MLP fc (3072×768) and projection (768×3072): one 3072
and one 768 factor each. 12 layers: 120 of 768×768 and 24 of 3072×3072, fp32. For each size this prints the time
to decompose all of them

  * one call per matrix and as one batched call (`torch.linalg.eigh` of the stacked matrices), and whether the
    batched results are bitwise those of the single calls (then the optimizer could batch them at the same math);
  * with cuSOLVER and with MAGMA (`torch.backends.cuda.preferred_linalg_library`);
  * in float32 (the record's factors) and in float64 (the matrices cast up, results cast back, as
    `EighEigendecompositionConfig(retry_double_precision=True)` retries);

then, with cuSOLVER in float32, from 2/4/8 host threads each on its own CUDA stream (what
`ShampooRuntimeConfig(num_amortized_computation_streams=...)` does) and a profile of one 3072 call that splits its
wall time into GPU kernel time and the rest. With several sizes, the whole set then runs from 1/2/4/8 threads
largest first, as the optimizer orders a root step's factors (on the CPU: one thread, LAPACK). The streams and the
whole set use cuSOLVER in float32 whatever --libraries and --dtypes say: they measure today's path. The table
comes last, with the sum over both sizes: a root step's eigendecompositions alone, one after another.

    python bench/probe_eigh.py                               # one GPU, a few minutes
    python bench/probe_eigh.py --sizes 3072:24               # one size only (e.g. to split the call)
    python bench/probe_eigh.py --libraries cusolver --dtypes float32   # today's path only (MAGMA's rows take minutes)
    python bench/probe_eigh.py --device cpu --sizes 64:3,32:4 --repeats 1   # small, to check the script

The matrices are random symmetric positive definite (X·Xᵀ/k with X of k = 4n columns), not real factors:
cuSOLVER's divide and conquer runs faster or slower with the spectrum, so real root steps differ somewhat. Times
are the fastest of --repeats calls after one untimed call.
"""

import argparse
import math
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import TypeVar

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the repository root (bench/scripts.py)

from distributed_shampoo.utils.shampoo_utils import run_on_side_streams  # noqa: E402

T = TypeVar("T")

FACTOR_SET = {3072: 24, 768: 120}  # size: count, for the 72 Track 3 matrices
THREAD_COUNTS = (2, 4, 8)


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    parser.add_argument("--sizes", default=",".join(f"{size}:{count}" for size, count in FACTOR_SET.items()),
                        help="comma-separated size:count of the factor set (default: the Track 3 record's)")
    parser.add_argument("--repeats", type=int, default=1, help="timed calls per measurement, after an untimed one (the fastest counts)")
    parser.add_argument("--libraries", default="cusolver,magma", help="comma-separated: cusolver, magma (CUDA only)")
    parser.add_argument("--dtypes", default="float32,float64", help="comma-separated: float32, float64")
    args = parser.parse_args()
    args.libraries = list(dict.fromkeys(args.libraries.split(",")))  # a repeated name would repeat its rows
    args.dtypes = list(dict.fromkeys(args.dtypes.split(",")))
    if not set(args.libraries) <= {"cusolver", "magma"} or not set(args.dtypes) <= {"float32", "float64"}:
        parser.error(f"--libraries takes cusolver,magma and --dtypes float32,float64; got {args.libraries} and {args.dtypes}")
    try:
        args.sizes = {int(size): int(count) for size, count in (item.split(":") for item in args.sizes.split(","))}
    except ValueError:
        parser.error(f"--sizes must be comma-separated size:count pairs, got {args.sizes!r}")
    if not args.sizes or min(args.sizes) < 1 or min(args.sizes.values()) < 1 or args.repeats < 1:
        parser.error("--sizes needs positive sizes and counts, --repeats at least 1")
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("no CUDA device: the probe measures cuSOLVER and MAGMA (pass --device cpu for a small check)")
    return args


def random_spd(size: int, count: int, seed: int, device: torch.device) -> list[torch.Tensor]:
    generator = torch.Generator(device="cpu").manual_seed(seed)
    matrices = []
    for _ in range(count):
        x = torch.randn(size, 4 * size, generator=generator).to(device)
        matrices.append(x @ x.T / (4 * size))
    return matrices


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def best_ms(fn: Callable[[], T], device: torch.device, repeats: int) -> tuple[float, T]:
    """(fastest of `repeats` timed calls after one untimed call, in ms; the untimed call's result)."""
    result = fn()
    synchronize(device)
    best = math.inf
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        synchronize(device)
        best = min(best, time.perf_counter() - start)
    return 1e3 * best, result


def eigh_in(dtype: torch.dtype, matrix: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """eigh of `matrix` computed in `dtype`, returned in the matrix's dtype."""
    eigenvalues, eigenvectors = torch.linalg.eigh(matrix.to(dtype))
    return eigenvalues.to(matrix.dtype), eigenvectors.to(matrix.dtype)


def one_by_one(matrices: list[torch.Tensor], dtype: torch.dtype) -> list[tuple[torch.Tensor, torch.Tensor]]:
    return [eigh_in(dtype, matrix) for matrix in matrices]


def batched(matrices: list[torch.Tensor], dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    return eigh_in(dtype, torch.stack(matrices))


def bitwise_equal(single: list[tuple[torch.Tensor, torch.Tensor]], stacked: tuple[torch.Tensor, torch.Tensor]) -> bool:
    return all(
        torch.equal(values, stacked[0][index]) and torch.equal(vectors, stacked[1][index])
        for index, (values, vectors) in enumerate(single)
    )


@dataclass
class Row:
    size: int
    count: int
    library: str
    dtype: str
    one_by_one_ms: float
    batched_ms: float
    batched_equal: bool


def measure(matrices: list[torch.Tensor], library: str, dtype: torch.dtype, device: torch.device, repeats: int) -> Row:
    if device.type == "cuda":
        torch.backends.cuda.preferred_linalg_library(library)
    single_ms, single = best_ms(lambda: one_by_one(matrices, dtype), device, repeats)
    batched_ms, stacked = best_ms(lambda: batched(matrices, dtype), device, repeats)
    equal = bitwise_equal(single, stacked)
    name = str(dtype).removeprefix("torch.")
    return Row(matrices[0].shape[0], len(matrices), library, name, single_ms, batched_ms, equal)


def on_threads(matrices: list[torch.Tensor], threads: int) -> Callable[[], None]:
    """All the decompositions through the package's own concurrent runner (what the optimizer does)."""
    tasks = [partial(torch.linalg.eigh, matrix) for matrix in matrices]
    return lambda: run_on_side_streams(tasks, threads, matrices[0].device)


def kernel_share(matrix: torch.Tensor) -> tuple[float, float, int, list[tuple[str, float]]]:
    """(wall ms, GPU kernel + copy ms, number of device events, the 3 kernels with most time and their ms) of
    one eigh call."""
    torch.linalg.eigh(matrix)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        start = time.perf_counter()
        torch.linalg.eigh(matrix)
        torch.cuda.synchronize()
        wall = 1e3 * (time.perf_counter() - start)
    events = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    per_kernel: dict[str, float] = {}
    for event in events:
        name = event.name.split("<")[0]  # template arguments differ per tile size; group by kernel
        per_kernel[name] = per_kernel.get(name, 0.0) + event.device_time / 1e3
    top = sorted(per_kernel.items(), key=lambda item: -item[1])[:3]
    return wall, sum(e.device_time for e in events) / 1e3, len(events), top


def print_table(rows: list[Row]) -> None:
    header = f"{'factors':>12} {'library':>9} {'dtype':>8} {'one call each ms':>17} {'batched ms':>11} {'batched = one each':>19}"
    print(header)
    print("-" * len(header))
    for row in rows:
        equal = "bitwise" if row.batched_equal else "differs"
        print(f"{f'{row.count} x {row.size}':>12} {row.library:>9} {row.dtype:>8} {row.one_by_one_ms:>17.1f} "
              f"{row.batched_ms:>11.1f} {equal:>19}")
    sizes = sorted({row.size for row in rows})
    for library, dtype in dict.fromkeys((row.library, row.dtype) for row in rows):
        chosen = [row for row in rows if (row.library, row.dtype) == (library, dtype)]
        if len(chosen) == len(sizes):
            print(f"{'all':>12} {library:>9} {dtype:>8} {sum(r.one_by_one_ms for r in chosen):>17.1f} "
                  f"{sum(r.batched_ms for r in chosen):>11.1f} {'':>19}")
    print("all: the factor set of one root step, decomposed one after another (no streams).")


def main() -> None:
    args = parse_args()
    device = torch.device(args.device)
    cuda = device.type == "cuda"
    device_name = torch.cuda.get_device_name() if cuda else "CPU"
    print(f"torch {torch.__version__}, {device_name}, factor set {', '.join(f'{c} x {s}' for s, c in args.sizes.items())}")
    libraries = args.libraries if cuda else ["lapack"]
    dtypes = [getattr(torch, name) for name in args.dtypes]
    rows: list[Row] = []
    whole_set: list[torch.Tensor] = []
    for seed, (size, count) in enumerate(args.sizes.items()):
        matrices = random_spd(size, count, seed, device)
        for library in libraries:
            for dtype in dtypes:
                rows.append(measure(matrices, library, dtype, device, args.repeats))
                print(f"{count} x {size}, {library}, {rows[-1].dtype}: one call each {rows[-1].one_by_one_ms:.1f} ms, "
                      f"batched {rows[-1].batched_ms:.1f} ms", flush=True)
        if cuda:
            torch.backends.cuda.preferred_linalg_library("cusolver")
            threads = {t: best_ms(on_threads(matrices, t), device, args.repeats)[0] for t in THREAD_COUNTS}
            print(f"{count} x {size}, cusolver, float32, threads/streams: "
                  + ", ".join(f"{t}: {ms:.1f} ms" for t, ms in threads.items()), flush=True)
            wall, busy, events, top = kernel_share(matrices[0])
            print(f"1 x {size} profiled: wall {wall:.1f} ms, GPU kernel+copy time {busy:.1f} ms in {events} device "
                  "events; most time in " + ", ".join(f"{kernel} {ms:.1f} ms" for kernel, ms in top), flush=True)
        whole_set += matrices  # kept for the whole-set timing below
    if len(args.sizes) > 1:
        whole_set.sort(key=lambda matrix: -matrix.shape[0])  # largest first, as the optimizer's root step
        threads = {t: best_ms(on_threads(whole_set, t), device, args.repeats)[0] for t in ((1, *THREAD_COUNTS) if cuda else (1,))}
        print(f"whole set largest first, {'cusolver' if cuda else 'lapack'}, float32, threads/streams: "
              + ", ".join(f"{t}: {ms:.1f} ms" for t, ms in threads.items()), flush=True)
    if cuda:
        torch.backends.cuda.preferred_linalg_library("default")
    print()
    print_table(rows)


if __name__ == "__main__":
    main()
