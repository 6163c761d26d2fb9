"""The attention inputs of one layer (q/k RMS norm + rotary, value mixing), compiled, forward + backward, on one GPU.

Inductor fuses the q/k RMS norm and the rotary into one reduction kernel per direction; in the session-4 profile
they ran at about 1.7-2 TB/s (bench/NOTES.md), against about 4.3 for the plain elementwise kernels. This times
ways of writing the same arithmetic (each output element is still x1 cos + x2 sin or x2 cos - x1 sin of the
normed input) at the record's micro-step shape and checks each against the model's own code bitwise.

    python bench/bench_qk_rotary.py        # one GPU, about a minute
"""

import sys
from pathlib import Path

import torch
from torch import Tensor

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import train_gpt as tg  # noqa: E402
from bench.gpu_timing import median_ms  # noqa: E402

TOKENS, HEADS, HEAD_DIM = 49152, 6, 128


def model_code(qkv: Tensor, ve: Tensor, mix: Tensor, rotary: tg.Rotary) -> tuple[Tensor, Tensor, Tensor]:
    q, k, v = qkv.chunk(3, dim=-2)  # as CausalSelfAttention.forward
    q, k = rotary(tg.rms_norm(q)), rotary(tg.rms_norm(k))
    return q, k, mix[0] * v + mix[1] * ve


def joint_qk(qkv: Tensor, ve: Tensor, mix: Tensor, rotary: tg.Rotary) -> tuple[Tensor, Tensor, Tensor]:
    qk, v = qkv.split([2 * HEADS, HEADS], dim=-2)  # one norm + rotary over q and k together
    q, k = rotary(tg.rms_norm(qk)).chunk(2, dim=-2)
    return q, k, mix[0] * v + mix[1] * ve


def rotate_without_cat(x: Tensor, rotary: tg.Rotary) -> Tensor:
    cos = rotary.cos[None, : x.size(1), None, None, :]
    sin = rotary.sin[None, : x.size(1), None, None, :]
    halves = x.to(cos.dtype).unflatten(-1, (2, -1))  # (..., 2, d/2): x1, x2
    signed_sin = torch.cat((sin, -sin), dim=-2)  # x1 cos + x2 sin, x2 cos + x1 (-sin)
    return (halves * cos + halves.flip(-2) * signed_sin).flatten(-2).type_as(x)


def no_cat(qkv: Tensor, ve: Tensor, mix: Tensor, rotary: tg.Rotary) -> tuple[Tensor, Tensor, Tensor]:
    q, k, v = qkv.chunk(3, dim=-2)
    q, k = rotate_without_cat(tg.rms_norm(q), rotary), rotate_without_cat(tg.rms_norm(k), rotary)
    return q, k, mix[0] * v + mix[1] * ve


VARIANTS = {"model code": model_code, "q and k in one call": joint_qk, "rotary without cat": no_cat}


def main() -> None:
    if not torch.cuda.is_available():
        raise SystemExit("bench_qk_rotary.py: needs a CUDA GPU.")
    torch.manual_seed(0)
    rotary = tg.Rotary(HEAD_DIM, TOKENS, 128, torch.bfloat16).cuda()
    rotary.apply_yarn(3, 7)
    qkv = torch.randn(1, TOKENS, 3 * HEADS, HEAD_DIM, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    ve = torch.randn(1, TOKENS, HEADS, HEAD_DIM, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    mix = torch.tensor([0.5, 0.5], device="cuda", requires_grad=True)
    grads = [torch.randn(1, TOKENS, HEADS, HEAD_DIM, device="cuda", dtype=torch.bfloat16) for _ in range(3)]
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, {TOKENS} tokens, {HEADS} heads x {HEAD_DIM}")
    reference = None
    for name, fn in VARIANTS.items():
        compiled = torch.compile(fn, fullgraph=True)

        def step() -> tuple[Tensor, ...]:
            outputs = compiled(qkv, ve, mix, rotary)
            return (*outputs, *torch.autograd.grad(outputs, (qkv, ve, mix), grads))

        results = [t.detach().clone() for t in step()]
        if reference is None:
            reference = results
        equal = [torch.equal(a, b) for a, b in zip(results, reference)]
        forward_ms = median_ms(lambda: compiled(qkv.detach(), ve.detach(), mix.detach(), rotary), repeats=20)
        total_ms = median_ms(step, repeats=20)
        print(f"{name}: forward {forward_ms:.3f} ms, forward + backward {total_ms:.3f} ms; bitwise equal to model code (q, k, v, dqkv, dve, dmix): {equal}")


if __name__ == "__main__":
    main()
