"""GPU timing shared by the kernel benchmarks of this folder."""

from collections.abc import Callable

import torch


def median_ms(fn: Callable[[], object], repeats: int, calls: int = 1) -> float:
    """Median milliseconds of `fn` on the current CUDA stream over `repeats` timings, after one untimed call (which
    compiles, autotunes and allocates). Each timing is `calls` back-to-back calls between two CUDA events, then
    synchronized, divided by `calls`: with more than one, the host can run ahead of the GPU, so a call whose Python
    work outlasts its kernels shows that as a time that no longer grows with the work (bench/probe_fa4.py)."""
    if repeats < 1 or calls < 1:
        raise ValueError(f"median_ms: repeats={repeats} and calls={calls} must both be at least 1")
    fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(calls):
            fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) / calls)
    return sorted(times)[repeats // 2]
