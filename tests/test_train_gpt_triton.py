"""The Triton symmetric-matmul kernels and the Triton Newton-Schulz, run by Triton's CPU interpreter.

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


@pytest.mark.slow
def test_symmetric_kernels_and_newton_schulz_under_the_interpreter():
    env = dict(os.environ, TRITON_INTERPRET="1", OMP_NUM_THREADS="1")
    result = subprocess.run([sys.executable, "-c", CHECKS], capture_output=True, text=True, timeout=300, env=env, cwd=ROOT)
    assert result.returncode == 0, result.stderr[-3000:]
    errors = json.loads(result.stdout.strip().splitlines()[-1])
    assert len(errors) == 9
    for name, error in errors.items():
        tolerance = 2e-2 if "newton" in name else (4e-3 if "float16" in name else 1e-5)
        assert error == error and error < tolerance, f"{name}: relative error {error}"  # NaN never passes
