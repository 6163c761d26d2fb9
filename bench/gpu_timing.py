"""GPU timing shared by the kernel benchmarks of this folder."""

from collections.abc import Callable

import torch


def median_ms(fn: Callable[[], object], repeats: int) -> float:
    """Median milliseconds of `fn` on the current CUDA stream over `repeats` calls, after one untimed call (which
    compiles, autotunes and allocates); each call is timed by CUDA events and synchronized on its own."""
    fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return sorted(times)[repeats // 2]
