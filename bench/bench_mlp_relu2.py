"""The fused ReLU² MLP op against the compiled eager MLP, forward + backward, on one GPU.

At the record's per-micro-step shape (49,152 tokens, model dim 768, hidden 3,072, bf16) this checks the op
(`train_gpt.relu2_mlp`) against the eager formula (output and the three gradients, relative error) and
prints the median time of one forward + backward of each, plus the Triton matmul alone in both modes
against a cuBLAS matmul of the same shape.

    python bench/bench_mlp_relu2.py        # one GPU, about a minute (compilation and autotuning)
"""

import sys
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import train_gpt as tg  # noqa: E402

TOKENS, DIM = 49152, 768


def median_ms(fn: Callable[[], object], repeats: int = 20) -> float:
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


def main() -> None:
    if not torch.cuda.is_available():
        raise SystemExit("bench_mlp_relu2.py: needs a CUDA GPU.")
    torch.manual_seed(0)
    x = tg.rms_norm(torch.randn(TOKENS, DIM, device="cuda")).bfloat16().requires_grad_()
    bound = 3**0.5 * 0.5 * DIM**-0.5
    w_fc = torch.empty(DIM, 4 * DIM, device="cuda").uniform_(-bound, bound).bfloat16().requires_grad_()
    w_proj = (torch.randn(DIM, 4 * DIM, device="cuda") * 0.02).bfloat16().requires_grad_()
    grad_out = torch.randn(TOKENS, DIM, device="cuda").bfloat16()
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, x {TOKENS} x {DIM}, hidden {4 * DIM}, bf16")

    eager = torch.compile(lambda x, a, b: F.linear(F.relu(x @ a).square(), b), fullgraph=True)

    def run(fn: Callable) -> tuple[torch.Tensor, ...]:
        out = fn(x, w_fc, w_proj)
        return (out, *torch.autograd.grad(out, (x, w_fc, w_proj), grad_out))

    fused = lambda x, a, b: tg.relu2_mlp(x, a, b)[0]
    want, got = run(eager), run(fused)
    for name, g, w in zip(("output", "grad x", "grad w_fc", "grad w_proj"), got, want):
        print(f"{name}: relative error {((g.float() - w.float()).norm() / w.float().norm()).item():.2e}")
    print(f"compiled eager MLP, forward + backward: {median_ms(lambda: run(eager)):.3f} ms")
    print(f"fused relu2_mlp op, forward + backward: {median_ms(lambda: run(fused)):.3f} ms")
    x2, act = x.detach(), got[0]
    act = tg.relu2_matmul(x2, w_fc.detach())
    flops = 2 * TOKENS * DIM * 4 * DIM
    for name, fn in (
        ("cuBLAS x @ w_fc", lambda: x2 @ w_fc.detach()),
        ("relu2_matmul forward", lambda: tg.relu2_matmul(x2, w_fc.detach())),
        ("relu2_matmul backward", lambda: tg.relu2_matmul(grad_out, w_proj.detach(), act)),
    ):
        ms = median_ms(fn)
        print(f"{name}: {ms:.3f} ms ({flops / ms / 1e9:.0f} TFLOP/s)")
    print(f"autotuned configs: {[(k, str(v)) for k, v in tg._relu2_matmul_autotuned.cache.items()]}")


if __name__ == "__main__":
    main()
