"""The FP8 head's backward products against the eager ops they replaced, on one GPU, at the record's shapes.

On one record micro-step (x 49,152 x 768 and w 50,304 x 768 in e4m3, the e5m2 logit gradient of
`train_gpt.softcap_ce_e5m2` on the head's own logits) this checks and times:
  * `train_gpt.transpose_fp8` against `t.T.contiguous()` (the column-major operand of each backward product),
    bytes compared, for a few tiles;
  * grad_w = g^T (x/x_s) rounded to bf16 in the matmul (`out_dtype=torch.bfloat16`) against the fp32 product
    cast to bf16 afterwards (what autograd does with the fp32 gradient of the bf16 weight): elements that differ,
    and the time of each;
  * the whole `train_gpt.fp8_head_backward` (its own scale fills included) against the same two products with the
    eager copies and precomputed scales.

    python bench/bench_fp8_head.py      # one GPU with FP8 matmuls (compute capability 8.9+), under a minute
"""

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the repository root (bench/scripts.py)

import train_gpt as tg  # noqa: E402
from bench.gpu_timing import median_ms  # noqa: E402

TOKENS, VOCAB, DIM = 49152, 50304, 768
TILES = ((64, 128, 4), (32, 128, 4), (128, 128, 8), (64, 64, 4), (128, 64, 4), (64, 256, 8))


def bytes_of(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8)


def eager_backward(grad_f8, grad_f8_t, x_f8, w_f8, grad_scale, w_scale, x_scale):
    """fp8_head_backward with ATen's transposed copies."""
    grad_x = torch._scaled_mm(grad_f8, w_f8.T.contiguous().T, scale_a=grad_scale, scale_b=w_scale, out_dtype=torch.bfloat16, use_fast_accum=False)
    grad_w = torch._scaled_mm(grad_f8_t, x_f8.T.contiguous().T, scale_a=grad_scale, scale_b=x_scale, out_dtype=torch.float32, use_fast_accum=False)
    return grad_x, grad_w


def main() -> None:
    if not torch.cuda.is_available() or tg.triton is None or torch.cuda.get_device_capability() < (8, 9):
        raise SystemExit("bench_fp8_head.py: needs a CUDA GPU with FP8 matmuls (compute capability 8.9 or newer) and Triton.")
    torch.manual_seed(0)
    x = tg.rms_norm(torch.randn(TOKENS, DIM, device="cuda")).bfloat16()
    w = (torch.randn(VOCAB, DIM, device="cuda") * 0.02).bfloat16()
    x_f8 = x.div(tg.FP8_X_SCALE).to(torch.float8_e4m3fn)
    w_f8 = w.div(tg.FP8_W_SCALE).to(torch.float8_e4m3fn)
    scale = lambda v: torch.full((), v, dtype=torch.float32, device="cuda")
    x_scale, w_scale = scale(tg.FP8_X_SCALE), scale(tg.FP8_W_SCALE)
    logits = torch._scaled_mm(x_f8, w_f8.T, scale_a=x_scale, scale_b=w_scale, out_dtype=torch.bfloat16, use_fast_accum=True)
    targets = torch.randint(0, VOCAB, (TOKENS,), device="cuda")
    _, grad_f8, grad_f8_t = tg.softcap_ce_e5m2(logits, targets, tg.FP8_GRAD_SCALE)
    del logits
    grad_scale = scale(1.0) * tg.FP8_GRAD_SCALE
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}; x {TOKENS} x {DIM}, w {VOCAB} x {DIM} e4m3, gradient {TOKENS} x {VOCAB} e5m2")

    for name, t in (("x", x_f8), ("w", w_f8)):
        eager = median_ms(lambda: t.T.contiguous(), repeats=20)
        print(f"transpose {name}: eager t.T.contiguous() {eager:.3f} ms")
        want = bytes_of(t.T.contiguous())
        for tile in TILES:
            equal = torch.equal(bytes_of(tg.transpose_fp8(t, tile)), want)
            ms = median_ms(lambda: tg.transpose_fp8(t, tile), repeats=20)
            print(f"  transpose_fp8 {tile[0]}x{tile[1]} tiles, {tile[2]} warps: {ms:.3f} ms, bytes equal {equal}")

    x_column_major = x_f8.T.contiguous().T
    as_fp32 = lambda: torch._scaled_mm(grad_f8_t, x_column_major, scale_a=grad_scale, scale_b=x_scale, out_dtype=torch.float32, use_fast_accum=False).bfloat16()
    as_bf16 = lambda: torch._scaled_mm(grad_f8_t, x_column_major, scale_a=grad_scale, scale_b=x_scale, out_dtype=torch.bfloat16, use_fast_accum=False)
    got, want = as_bf16(), as_fp32()
    print(
        f"grad_w rounded to bf16 in the matmul vs fp32 then cast: {int((got.view(torch.int16) != want.view(torch.int16)).sum())} of "
        f"{got.numel()} elements differ (bit patterns), {int(want.ne(0).sum())} nonzero"
    )
    print(f"  fp32 out + cast {median_ms(as_fp32, repeats=10):.3f} ms, bf16 out {median_ms(as_bf16, repeats=10):.3f} ms")

    new = tg.fp8_head_backward(scale(1.0), grad_f8, grad_f8_t, x_f8, w_f8, tg.FP8_X_SCALE, tg.FP8_W_SCALE, tg.FP8_GRAD_SCALE)
    old = eager_backward(grad_f8, grad_f8_t, x_f8, w_f8, grad_scale, w_scale, x_scale)
    same = [torch.equal(a, b) for a, b in zip(new, old)]
    print(f"fp8_head_backward vs the eager copies: grad_x bitwise {same[0]}, grad_w bitwise {same[1]}")
    ms_new = median_ms(lambda: tg.fp8_head_backward(scale(1.0), grad_f8, grad_f8_t, x_f8, w_f8, tg.FP8_X_SCALE, tg.FP8_W_SCALE, tg.FP8_GRAD_SCALE), repeats=10)
    ms_old = median_ms(lambda: eager_backward(grad_f8, grad_f8_t, x_f8, w_f8, grad_scale, w_scale, x_scale), repeats=10)
    print(f"  per micro-step: fp8_head_backward {ms_new:.3f} ms, with the eager copies {ms_old:.3f} ms")


if __name__ == "__main__":
    main()
