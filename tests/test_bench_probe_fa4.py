"""bench/probe_fa4.py on a machine it cannot measure on (no CUDA GPU or no flash-attn-4): one line, no traceback; and
bench/gpu_timing.median_ms's refusal of no calls."""

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
