"""The attention inputs of one layer (q/k RMS norm + rotary, value mixing), compiled, forward + backward, on one GPU.

Inductor fuses the q/k RMS norm and the rotary into one reduction kernel per direction; in the profile of 2026-12-01 (bench/NOTES.md, commit 80f0683)
they ran at about 1.7-2 TB/s (bench/NOTES.md), against about 4.3 for the plain elementwise kernels. This times
ways of writing the same arithmetic (each output element is still x1 cos + x2 sin or x2 cos - x1 sin of the
normed input) at the record's micro-step shape: the record's cat form (the first row, which the others are
checked against bitwise), the same in one call for q and k, and train_gpt.py's Rotary as it is now.

    python bench/bench_qk_rotary.py        # one GPU, about a minute
"""

import argparse
import sys
from pathlib import Path

import torch
from torch import Tensor

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the repository root (bench/scripts.py)

import train_gpt as tg  # noqa: E402
from bench.gpu_timing import median_ms  # noqa: E402

TOKENS, HEADS, HEAD_DIM = 49152, 6, 128


def rotate_with_cat(x: Tensor, rotary: tg.Rotary) -> Tensor:
    """The rotary as the record (and train_gpt.py before 4355cff) writes it: the two halves rotated, then a cat."""
    cos = rotary.cos[None, : x.size(1), None, :]
    sin = rotary.sin[None, : x.size(1), None, :]
    x1, x2 = x.to(cos.dtype).chunk(2, dim=-1)
    return torch.cat((x1 * cos + x2 * sin, x2 * cos - x1 * sin), dim=-1).type_as(x)


def cat_form(qkv: Tensor, ve: Tensor, mix: Tensor, rotary: tg.Rotary) -> tuple[Tensor, Tensor, Tensor]:
    q, k, v = qkv.chunk(3, dim=-2)  # as CausalSelfAttention.forward
    q, k = rotate_with_cat(tg.rms_norm(q), rotary), rotate_with_cat(tg.rms_norm(k), rotary)
    return q, k, mix[0] * v + mix[1] * ve


def joint_qk_cat_form(qkv: Tensor, ve: Tensor, mix: Tensor, rotary: tg.Rotary) -> tuple[Tensor, Tensor, Tensor]:
    qk, v = qkv.split([2 * HEADS, HEADS], dim=-2)  # one norm + rotary over q and k together
    q, k = rotate_with_cat(tg.rms_norm(qk), rotary).chunk(2, dim=-2)
    return q, k, mix[0] * v + mix[1] * ve


def model_code(qkv: Tensor, ve: Tensor, mix: Tensor, rotary: tg.Rotary) -> tuple[Tensor, Tensor, Tensor]:
    q, k, v = qkv.chunk(3, dim=-2)  # train_gpt.py's Rotary as it is now
    q, k = rotary(tg.rms_norm(q)), rotary(tg.rms_norm(k))
    return q, k, mix[0] * v + mix[1] * ve


VARIANTS = {"cat form": cat_form, "cat form, q and k in one call": joint_qk_cat_form, "model code": model_code}


def main() -> None:
    argparse.ArgumentParser(description=__doc__.splitlines()[0]).parse_args()
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
        print(f"{name}: forward {forward_ms:.3f} ms, forward + backward {total_ms:.3f} ms; bitwise equal to the cat form (q, k, v, dqkv, dve, dmix): {equal}")


if __name__ == "__main__":
    main()
