"""The Triton kernels (symmetric matmuls, Newton-Schulz, the FP8 head's e5m2 cast), run by Triton's CPU interpreter.

TRITON_INTERPRET must be set before the kernels are decorated, i.e. before train_gpt is imported, so the
checks run in a fresh interpreter process. The interpreter's tl.dot mishandles bf16 operands (NumPy has no
bf16), so the same kernels are driven with fp16 and fp32 buffers here; on CUDA they run in bf16.
"""

import json
import os
import subprocess
import sys

import pytest

from conftest import ROOT

pytest.importorskip("triton")

CHECKS = r"""
import json, torch, train_gpt as tg
torch.manual_seed(0)
results = {}
for dtype in (torch.float16, torch.float32):
    for (batch, M, K), cfg in (((2, 48, 80), dict(BLOCK_M=16, BLOCK_N=16, BLOCK_K=16, GROUP_M=2)),
                               ((1, 40, 24), dict(BLOCK_M=32, BLOCK_N=16, BLOCK_K=16, GROUP_M=8))):
        X = (torch.randn(batch, M, K, dtype=torch.float64) / K ** 0.5)
        out = torch.full((batch, M, M), float("nan"), dtype=dtype)
        tg.symmetric_matmul(X.to(dtype), out, config=cfg)
        ref = X @ X.mT
        results[f"xxt {dtype} {M}x{K}"] = ((out.double() - ref).norm() / ref.norm()).item()
        A = ref.to(dtype)
        out2 = torch.full_like(out, float("nan"))
        tg.symmetric_matmul(A, out2, add=A, alpha=2.0315, beta=-4.7750, config=cfg)
        ref2 = 2.0315 * A.double() @ A.double() - 4.7750 * A.double()
        results[f"axpby {dtype} {M}x{K}"] = ((out2.double() - ref2).norm() / ref2.norm()).item()
G = torch.randn(3, 48, 80, dtype=torch.float64)
ns = tg.newton_schulz_triton(G, config=dict(BLOCK_M=16, BLOCK_N=16, BLOCK_K=16, GROUP_M=8), dtype=torch.float16)
ref = tg.newton_schulz_reference(G, torch.float64)
results["newton_schulz fp16"] = ((ns.double() - ref).norm() / ref.norm()).item()
print(json.dumps(results))
"""


def run_under_interpreter(script: str) -> dict:
    """The JSON object that `script` prints last, run in a fresh process with TRITON_INTERPRET=1."""
    env = dict(os.environ, TRITON_INTERPRET="1", OMP_NUM_THREADS="1")
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300, env=env, cwd=ROOT)
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(result.stdout.strip().splitlines()[-1])


@pytest.mark.slow
def test_symmetric_kernels_and_newton_schulz_under_the_interpreter():
    errors = run_under_interpreter(CHECKS)
    assert len(errors) == 9
    for name, error in errors.items():
        tolerance = 2e-2 if "newton" in name else (4e-3 if "float16" in name else 1e-5)
        assert error == error and error < tolerance, f"{name}: relative error {error}"  # NaN never passes


E5M2_CHECKS = r"""
import json, torch, train_gpt as tg
torch.manual_seed(0)
results = {}
for scale in (tg.FP8_GRAD_SCALE, 2.0 ** -9):
    for dtype in (torch.float32, torch.bfloat16):
        for (M, N), (bm, bn) in (((70, 130), (32, 64)), ((64, 128), (64, 128)), ((5, 3), (16, 16))):
            # magnitudes from e5m2 subnormals to beyond its largest finite value, and the special values
            x = (torch.randn(M, N) * torch.logspace(-9, 2.5, N)).to(dtype)
            x[0, :3] = torch.tensor([float("inf"), -float("inf"), 0.0])
            out, out_t = tg.e5m2_in_both_layouts(x, scale, bm, bn)
            want = x.div(scale).to(torch.float8_e5m2).view(torch.uint8)
            results[f"{scale} {dtype} {M}x{N}"] = [
                torch.equal(out.view(torch.uint8), want),
                torch.equal(out_t.view(torch.uint8), want.T.contiguous()),
                out_t.is_contiguous(),
            ]
print(json.dumps(results))
"""


@pytest.mark.slow
def test_e5m2_cast_in_both_layouts_equals_torch_under_the_interpreter():
    checks = run_under_interpreter(E5M2_CHECKS)
    assert len(checks) == 12
    assert all(all(flags) for flags in checks.values()), checks


def test_e5m2_cast_rejects_other_dtypes():
    import train_gpt as tg
    import torch

    with pytest.raises(ValueError, match="x is torch.float16; pass a bfloat16 or float32 tensor"):
        tg.e5m2_in_both_layouts(torch.zeros(2, 2, dtype=torch.float16), 1.0)
