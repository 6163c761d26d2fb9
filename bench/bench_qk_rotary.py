"""The q/k RMS norm + rotary kernel (train_gpt.py, Fast paths) against the compiled formula it replaces, on one GPU.

At the record's micro-step shape (49,152 tokens, 6 heads of 128, YaRN-stretched bf16 tables), two comparisons, each
timed in turn over interleaved rounds (bench/gpu_timing.py) so that a drift of the clock reaches both sides alike:
  * the kernel alone at several tiles (rows per program, warps) against the compiled qk_norm_rotary_eager;
  * a layer's attention inputs as CausalSelfAttention computes them from qkv (q/k norm + rotary and the value
    mixing), compiled, forward and forward + backward: Rotary.norm_and_rotate (the kernel, its backward compiled
    by inductor) against the eager formula compiled whole (train_gpt.py before the kernel).
It prints how many outputs and gradients differ from the compiled formula and by how many bf16 units at most.

    python bench/bench_qk_rotary.py        # one GPU, about a minute
"""

import argparse
import sys
from collections.abc import Callable
from pathlib import Path

import torch
from torch import Tensor

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the repository root (bench/gpu_timing.py)

import train_gpt as tg  # noqa: E402
from bench.gpu_timing import interleaved_median_ms  # noqa: E402

TOKENS, HEADS, HEAD_DIM = 49152, 6, 128
TILES = ((16, 2), (16, 4), (32, 4), (64, 4), (64, 8))


def units_apart(got: Tensor, want: Tensor) -> tuple[int, int]:
    """(elements that differ, the most bf16 units between two of them); signs equal where they differ by little."""
    units = (got.view(torch.int16).int() - want.view(torch.int16).int()).abs()
    return int(units.bool().sum()), int(units.max())


def attention_inputs(fused: bool, rotary: tg.Rotary) -> Callable[[Tensor, Tensor, Tensor], tuple[Tensor, Tensor, Tensor]]:
    def inputs(qkv: Tensor, ve: Tensor, mix: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        qk, v = qkv.split((2 * HEADS, HEADS), dim=-2)  # as CausalSelfAttention.forward
        q, k = rotary.norm_and_rotate(qk) if fused else tg.qk_norm_rotary_eager(qk, rotary.cos, rotary.sin)
        return q, k, mix[0] * v + mix[1] * ve.view_as(v)

    return inputs


def time_kernel_tiles(qk: Tensor, rotary: tg.Rotary, rounds: int) -> None:
    formula = torch.compile(lambda qk: tg.qk_norm_rotary_eager(qk, rotary.cos, rotary.sin), fullgraph=True, dynamic=False)
    want = torch.cat(formula(qk), dim=-2)

    def with_tile(tile: tuple[int, int]) -> Callable[[], object]:
        def call() -> object:
            tg.QK_NORM_ROTARY_BLOCK = tile
            return tg.qk_norm_rotary(qk, rotary.cos, rotary.sin)

        return call

    fns: dict[str, Callable[[], object]] = {"compiled formula": lambda: formula(qk)}
    fns.update({f"kernel {rows} rows x {warps} warps": with_tile((rows, warps)) for rows, warps in TILES})
    committed = tg.QK_NORM_ROTARY_BLOCK
    times = interleaved_median_ms(fns, rounds)
    moved = qk.numel() * 2 * 2  # bf16 q and k read once and written once (the tables and rstd are small)
    for name, ms in times.items():
        line = f"{name}: {ms:.4f} ms, {moved / ms / 1e9:.2f} TB/s"
        if name != "compiled formula":
            differ, most = units_apart(torch.cat(fns[name]()[:2], dim=-2), want)
            line += f"; {differ} of {want.numel()} outputs differ from the compiled formula, by at most {most} bf16 units"
        print(line)
    tg.QK_NORM_ROTARY_BLOCK = committed


def time_layer(rotary: tg.Rotary, rounds: int) -> None:
    qkv = torch.randn(1, TOKENS, 3 * HEADS, HEAD_DIM, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    ve = torch.randn(TOKENS, HEADS * HEAD_DIM, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    mix = torch.tensor([0.5, 0.5], device="cuda", requires_grad=True)
    grads = [torch.randn(1, TOKENS, HEADS, HEAD_DIM, device="cuda", dtype=torch.bfloat16) for _ in range(3)]
    compiled = {name: torch.compile(attention_inputs(fused, rotary), fullgraph=True, dynamic=False) for name, fused in (("formula", False), ("kernel", True))}

    def forward(name: str) -> Callable[[], object]:
        return lambda: compiled[name](qkv.detach(), ve.detach(), mix.detach())

    def forward_backward(name: str) -> Callable[[], tuple[Tensor, ...]]:
        def step() -> tuple[Tensor, ...]:
            outputs = compiled[name](qkv, ve, mix)
            return (*outputs, *torch.autograd.grad(outputs, (qkv, ve, mix), grads))

        return step

    results = {name: [t.detach().clone() for t in forward_backward(name)()] for name in compiled}
    for label, got, want in zip(("q", "k", "v", "dqkv", "dve", "dmix"), results["kernel"], results["formula"]):
        if got.dtype == torch.bfloat16:
            differ, most = units_apart(got, want)
            print(f"  {label}: {differ} of {want.numel()} differ from the compiled formula, by at most {most} bf16 units")
        else:
            print(f"  {label}: largest difference {(got - want).abs().max().item():.3g} (fp32)")
    times = interleaved_median_ms({f"{kind} {name}": fn(name) for name in compiled for kind, fn in (("forward", forward), ("forward + backward", forward_backward))}, rounds)
    for name, ms in times.items():
        print(f"layer {name}: {ms:.4f} ms")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=7, help="interleaved rounds (default 7)")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench_qk_rotary.py: needs a CUDA GPU.")
    torch.manual_seed(0)
    rotary = tg.Rotary(HEAD_DIM, TOKENS, 128, torch.bfloat16).cuda()
    rotary.apply_yarn(3, 11)
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, {TOKENS} tokens, {HEADS} heads x {HEAD_DIM}, {args.rounds} rounds")
    qkv = torch.randn(1, TOKENS, 3 * HEADS, HEAD_DIM, device="cuda", dtype=torch.bfloat16)
    time_kernel_tiles(qkv[:, :, : 2 * HEADS], rotary, args.rounds)
    time_layer(rotary, args.rounds)


if __name__ == "__main__":
    main()
