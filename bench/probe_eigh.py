"""Where the Shampoo root steps' time goes: cuSOLVER `eigh` on the Track 3 factor set, run several ways.

The record's factors are 24 matrices of 3072×3072 and 120 of 768×768 (fp32). For each size this prints the
time to decompose all of them one after another, as one batched call, and from 2/4/8 host threads each on its
own CUDA stream (what `ShampooRuntimeConfig(num_amortized_computation_streams=...)` does); then float64 for
one matrix, and a profile of one call that splits its wall time into GPU kernel time and the rest.

    python bench/probe_eigh.py            # one GPU, about a minute

The matrices are random symmetric positive definite (X·Xᵀ/k with X of k = 4n columns), not real factors:
cuSOLVER's divide and conquer runs faster or slower with the spectrum, so real root steps differ somewhat.
"""

import sys
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the repository root (bench/scripts.py)

from distributed_shampoo.utils.shampoo_utils import run_on_side_streams  # noqa: E402

FACTOR_SET = {3072: 24, 768: 120}  # size: count, for the 72 Track 3 matrices
THREAD_COUNTS = (2, 4, 8)


def random_spd(size: int, count: int, seed: int, device: torch.device) -> list[torch.Tensor]:
    generator = torch.Generator(device="cpu").manual_seed(seed)
    matrices = []
    for _ in range(count):
        x = torch.randn(size, 4 * size, generator=generator).to(device)
        matrices.append(x @ x.T / (4 * size))
    return matrices


def best_ms(fn: Callable[[], object], repeats: int = 3) -> float:
    """Fastest of `repeats` timed calls after one untimed call, in ms."""
    fn()
    torch.cuda.synchronize()
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        best = min(best, time.perf_counter() - start)
    return 1e3 * best


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


def main() -> None:
    if not torch.cuda.is_available():
        raise SystemExit("probe_eigh.py: needs a CUDA GPU (it measures cuSOLVER).")
    device = torch.device("cuda")
    print(f"torch {torch.__version__}, {torch.cuda.get_device_name()}")
    for seed, (size, count) in enumerate(FACTOR_SET.items()):
        matrices = random_spd(size, count, seed, device)
        timings = {
            "one after another": best_ms(lambda: [torch.linalg.eigh(m) for m in matrices]),
            "batched": best_ms(lambda: torch.linalg.eigh(torch.stack(matrices))),
        }
        for threads in THREAD_COUNTS:
            timings[f"{threads} threads/streams"] = best_ms(on_threads(matrices, threads))
        print(f"{count} x {size}: " + ", ".join(f"{name} {ms:.1f} ms" for name, ms in timings.items()))
        print(f"1 x {size} float64: {best_ms(lambda: torch.linalg.eigh(matrices[0].double())):.1f} ms")
        wall, busy, events, top = kernel_share(matrices[0])
        print(f"1 x {size} profiled: wall {wall:.1f} ms, GPU kernel+copy time {busy:.1f} ms in {events} device events; "
              "most time in " + ", ".join(f"{name} {ms:.1f} ms" for name, ms in top))


if __name__ == "__main__":
    main()
