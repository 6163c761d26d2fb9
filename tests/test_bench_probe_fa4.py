"""bench/probe_fa4.py on a machine it cannot measure on (no CUDA GPU or no flash-attn-4): one line, no traceback; and
bench/gpu_timing: median_ms's refusal of no calls and interleaved_median_ms's order; bench_flex.differences, the tolerance check both use."""

import os
import subprocess
import sys

from conftest import ROOT


def test_probe_fa4_refuses_in_one_line_without_a_gpu_or_the_package(tmp_path):
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="")  # no GPU even where one is, so that it never runs the bench here
    result = subprocess.run([sys.executable, str(ROOT / "bench" / "probe_fa4.py"), "--site", str(tmp_path)], capture_output=True,
                            text=True, cwd=ROOT, timeout=300, env=env)
    assert result.returncode == 1 and result.stdout == ""
    assert result.stderr == "probe_fa4.py: needs a CUDA GPU and flash-attn-4 (installed, or unpacked into --site)\n"


def test_median_ms_refuses_no_calls_before_touching_the_gpu():
    import pytest

    sys.path.insert(0, str(ROOT))
    from bench.gpu_timing import median_ms

    for repeats, calls in ((0, 1), (3, 0)):
        with pytest.raises(ValueError, match=f"median_ms: repeats={repeats} and calls={calls} must both be at least 1"):
            median_ms(lambda: None, repeats, calls)


def test_bench_flex_differences_counts_nonfinite_and_the_tolerance_excess():
    import pytest
    import torch

    sys.path.insert(0, str(ROOT))
    from bench.bench_flex import ATOL, RTOL, differences

    inside = (torch.tensor([1.0, 2.0]),)
    outside = (torch.tensor([1.0, 2.0 + 2 * (ATOL + RTOL * 2.0)]),)
    nonfinite, diff, excess = differences(inside, inside)
    assert (nonfinite, diff) == (0, 0.0) and excess == pytest.approx(-ATOL - RTOL * 1.0, rel=1e-6)  # fp32: |ref| 1 is the tightest
    nonfinite, diff, excess = differences(outside, inside)
    assert nonfinite == 0 and diff > 0 and excess > 0
    assert differences((torch.tensor([float("nan")]),), (torch.tensor([0.0]),)) == (1, float("inf"), float("inf"))


def test_interleaved_median_ms_alternates_the_order_and_takes_each_functions_median(monkeypatch):
    """The GPU timer replaced by a stand-in that records who was timed: the first function goes first in odd rounds
    and last in even ones, and each function's figure is the median of its own rounds."""
    import pytest

    sys.path.insert(0, str(ROOT))
    from bench import gpu_timing

    order, figures = [], {"a": iter([5.0, 1.0, 3.0]), "b": iter([2.0, 9.0, 4.0])}
    monkeypatch.setattr(gpu_timing, "median_ms", lambda fn, repeats: (order.append(fn()), next(figures[fn()]))[1])
    assert gpu_timing.interleaved_median_ms({"a": lambda: "a", "b": lambda: "b"}, rounds=3) == {"a": 3.0, "b": 4.0}
    assert order == ["a", "b", "b", "a", "a", "b"]
    with pytest.raises(ValueError, match="rounds=0 must be at least 1"):
        gpu_timing.interleaved_median_ms({"a": lambda: None}, rounds=0)
