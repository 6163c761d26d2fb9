"""The q/k RMS norm + rotary through QKNormRotary (train_gpt.py, Fast paths: its backward by formula) against
autograd through the compiled eager formula, on one GPU.

At the record's micro-step shape (49,152 tokens, 6 heads of 128, YaRN-stretched bf16 tables), a layer's attention
inputs as CausalSelfAttention computes them from qkv (q/k norm + rotary and the value mixing), compiled, forward and
forward + backward, timed in turn over interleaved rounds (bench/gpu_timing.py) so that a drift of the clock reaches
both alike. It prints how many outputs and gradients differ from the compiled formula's and by how many bf16 units
at most.

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
FORMS = ("formula", "QKNormRotary")  # the compiled eager formula first: the other is compared with it


def units_apart(got: Tensor, want: Tensor) -> tuple[int, float]:
    """(elements that differ, their largest difference in bf16 units of the larger of the two)."""
    larger = torch.maximum(got.float().abs(), want.float().abs()).clamp_min(1e-30)
    unit = torch.ldexp(torch.ones_like(larger), torch.frexp(larger)[1] - 8)
    return int((got != want).sum()), ((got.float() - want.float()).abs() / unit).max().item()


def norm_and_rotate(form: str, qk: Tensor, rotary: tg.Rotary) -> tuple[Tensor, Tensor]:
    if form == "formula":
        return tg.qk_norm_rotary_eager(qk, rotary.cos, rotary.sin)
    return tg.QKNormRotary.apply(qk, rotary.cos, rotary.sin)


def attention_inputs(form: str, rotary: tg.Rotary) -> Callable[[Tensor, Tensor, Tensor], tuple[Tensor, Tensor, Tensor]]:
    def inputs(qkv: Tensor, ve: Tensor, mix: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        qk, v = qkv.split((2 * HEADS, HEADS), dim=-2)  # as CausalSelfAttention.forward
        q, k = norm_and_rotate(form, qk, rotary)
        return q, k, mix[0] * v + mix[1] * ve.view_as(v)

    return inputs


def time_layer(rotary: tg.Rotary, rounds: int) -> None:
    qkv = torch.randn(1, TOKENS, 3 * HEADS, HEAD_DIM, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    ve = torch.randn(TOKENS, HEADS * HEAD_DIM, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    mix = torch.tensor([0.5, 0.5], device="cuda", requires_grad=True)
    grads = [torch.randn(1, TOKENS, HEADS, HEAD_DIM, device="cuda", dtype=torch.bfloat16) for _ in range(3)]
    compiled = {form: torch.compile(attention_inputs(form, rotary), fullgraph=True, dynamic=False) for form in FORMS}

    def forward(name: str) -> Callable[[], object]:
        return lambda: compiled[name](qkv.detach(), ve.detach(), mix.detach())

    def forward_backward(name: str) -> Callable[[], tuple[Tensor, ...]]:
        def step() -> tuple[Tensor, ...]:
            outputs = compiled[name](qkv, ve, mix)
            return (*outputs, *torch.autograd.grad(outputs, (qkv, ve, mix), grads))

        return step

    results = {name: [t.detach().clone() for t in forward_backward(name)()] for name in compiled}
    for form in FORMS[1:]:
        for label, got, want in zip(("q", "k", "v", "dqkv", "dve", "dmix"), results[form], results["formula"]):
            if got.dtype == torch.bfloat16:
                differ, most = units_apart(got, want)
                print(f"  {form}, {label}: {differ} of {want.numel()} differ from the compiled formula, by at most {most:g} bf16 units")
            else:
                print(f"  {form}, {label}: largest difference {(got - want).abs().max().item():.3g} (fp32)")
    timed = {f"{kind} {name}": fn(name) for name in compiled for kind, fn in (("forward", forward), ("forward + backward", forward_backward))}
    times = interleaved_median_ms(timed, rounds)
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
    time_layer(rotary, args.rounds)


if __name__ == "__main__":
    main()
