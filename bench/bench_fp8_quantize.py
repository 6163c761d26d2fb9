"""The FP8 head's e4m3 quantization of its inputs, eager ops against train_gpt.quantize_e4m3, on one GPU.

At the record's shapes (x: 49,152 x 768 per micro-step, w: 50,304 x 768), median time of
`t.div(scale).to(torch.float8_e4m3fn)` (two eager kernels) and of the one-pass kernel, and whether their bytes
agree (NaN inputs excepted: only their NaN-ness is defined the same way by torch's casts).

    python bench/bench_fp8_quantize.py
"""

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import train_gpt as tg  # noqa: E402
from bench.gpu_timing import median_ms  # noqa: E402


def main() -> None:
    if not torch.cuda.is_available():
        raise SystemExit("bench_fp8_quantize.py: needs a CUDA GPU.")
    torch.manual_seed(0)
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, e4m3 cast saturates: {tg.e4m3_cast_saturates()}")
    for name, rows, scale, spread in (("x", 49152, tg.FP8_X_SCALE, 1.0), ("w", 50304, tg.FP8_W_SCALE, 0.05)):
        t = (torch.randn(rows, 768, device="cuda") * spread).bfloat16()
        eager = lambda: t.div(scale).to(torch.float8_e4m3fn)
        fused = lambda: tg.quantize_e4m3(t, scale)
        same = torch.equal(eager().view(torch.uint8), fused().view(torch.uint8))
        print(f"{name} {rows}x768: eager {median_ms(eager, repeats=50):.3f} ms, kernel {median_ms(fused, repeats=50):.3f} ms, bytes equal: {same}", flush=True)


if __name__ == "__main__":
    main()
