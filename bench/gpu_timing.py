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


def interleaved_median_ms(fns: dict[str, Callable[[], object]], rounds: int, repeats: int = 3) -> dict[str, float]:
    """Median milliseconds of each function over `rounds` rounds that time them in turn (the first first in odd
    rounds, last in even ones), each round's figure the median of `repeats` timings: a drift of the GPU's clock
    during the comparison reaches every function alike, as bench/ab.py's rounds do for whole training steps."""
    if rounds < 1:
        raise ValueError(f"interleaved_median_ms: rounds={rounds} must be at least 1")
    names = list(fns)
    times: dict[str, list[float]] = {name: [] for name in names}
    for round_index in range(rounds):
        for name in names if round_index % 2 == 0 else reversed(names):
            times[name].append(median_ms(fns[name], repeats))
    return {name: sorted(values)[rounds // 2] for name, values in times.items()}
