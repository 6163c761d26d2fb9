"""bench/bench_relu2_matmul.py's persistent matmul with the plain and forward ReLU² epilogues, run by Triton's CPU
interpreter (fp16 and fp32 buffers: the interpreter's tl.dot mishandles bf16, see tests/test_train_gpt_triton.py),
so that what the benchmark times on a GPU is known to compute the MLP's formula. The backward it times is
train_gpt.relu2_backward_matmul, tested in tests/test_train_gpt_triton.py."""

import pytest

from conftest import run_under_interpreter

pytest.importorskip("triton", reason="Triton is not installed (CPU-only install): the kernel tests need its interpreter")

CHECKS = r"""
import json, torch
from bench import bench_relu2_matmul as b
torch.manual_seed(0)
results = {}
M, K, N = 300, 48, 96  # 10 row tiles of 32 (the last partial): a whole group of 8, then a group of 2
config = (32, 32, 16, 2, 4, False)
for dtype in (torch.float16, torch.float32):
    x = (torch.randn(M, K) / K ** 0.5).to(dtype)
    w = torch.randn(K, N).to(dtype)
    x[5, 7] = float("nan")  # one NaN row of the product, which ReLU² must keep
    pre = (x.double() @ w.double()).to(dtype)
    plain, none = b.relu2_matmul(x, w, b.PLAIN, config, num_programs=4)
    fwd, relu2 = b.relu2_matmul(x, w, b.FORWARD, config, num_programs=4)
    finite = ~pre.isnan()
    ref = x.double() @ w.double()
    results[str(dtype)] = dict(
        plain_error=((plain.double() - ref)[finite].norm() / ref[finite].norm()).item(),
        forward_out=b.bitwise_equal(fwd, plain),
        forward_relu2=b.bitwise_equal(relu2, b.relu2_eager(plain)),
        plain_has_no_aux=none is None,
        nan_rows_kept=bool(relu2[5].isnan().all()),
        zeros=int((relu2 == 0).sum()),
    )
print(json.dumps(results))
"""


def test_relu2_matmul_epilogues_are_the_unfused_formula_under_the_interpreter():
    """The plain product against float64; the forward epilogue bitwise the PyTorch formula applied to that product, NaN
    rows kept (a relu that dropped NaN would hide a diverged run), a partial row tile and a partial tile group;
    4 persistent programs for 30 tiles, so two programs redo the last tile."""
    results = run_under_interpreter(CHECKS)
    assert set(results) == {"torch.float16", "torch.float32"}
    for dtype, r in results.items():
        assert r["plain_error"] < (2e-3 if "16" in dtype else 1e-6), (dtype, r)
        assert r["forward_out"] and r["forward_relu2"] and r["plain_has_no_aux"] and r["nan_rows_kept"], (dtype, r)
        assert r["zeros"] > 0, (dtype, r)  # the ReLU cut some pre-activations
