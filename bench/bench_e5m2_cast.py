"""The FP8 head's e5m2 gradient cast: the one-pass Triton kernel against the eager cast + transpose copy.

On the record's per-micro-step logit gradient (49,152 tokens × 50,304 vocabulary, bf16) this checks that
`train_gpt.e5m2_in_both_layouts` gives bitwise the bytes of `g.div(FP8_GRAD_SCALE).to(float8_e5m2)` and of its
`.T.contiguous()`, then prints the median time of both ways and of a few tile sizes.

    python bench/bench_e5m2_cast.py        # one GPU, a few seconds
"""

import sys
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import train_gpt as tg  # noqa: E402

TOKENS, VOCAB = 49152, 50304
TILES = ((64, 128), (128, 64), (64, 64), (32, 128), (128, 128), (256, 64))


def median_ms(fn: Callable[[], object], repeats: int = 10) -> float:
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
        raise SystemExit("bench_e5m2_cast.py: needs a CUDA GPU.")
    torch.manual_seed(0)
    scale = tg.FP8_GRAD_SCALE
    # magnitudes from e5m2 subnormals to the top of its range after scaling
    grad = (torch.randn(TOKENS, VOCAB, device="cuda") * torch.logspace(-8, -2, VOCAB, device="cuda")).bfloat16()

    def eager() -> tuple[torch.Tensor, torch.Tensor]:
        grad_f8 = grad.div(scale).to(torch.float8_e5m2)
        return grad_f8, grad_f8.T.contiguous()

    want, want_t = eager()
    got, got_t = tg.e5m2_in_both_layouts(grad, scale)
    same = torch.equal(got.view(torch.uint8), want.view(torch.uint8))
    same_t = torch.equal(got_t.view(torch.uint8), want_t.view(torch.uint8))
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, gradient {TOKENS} x {VOCAB} bf16")
    print(f"bitwise equal to the eager cast: row-major {same}, transposed {same_t}")
    del want, want_t, got, got_t
    print(f"eager div + cast + transpose copy: {median_ms(eager):.2f} ms")
    for block_m, block_n in TILES:
        ms = median_ms(lambda: tg.e5m2_in_both_layouts(grad, scale, block_m, block_n))
        print(f"e5m2_in_both_layouts, {block_m}x{block_n} tiles: {ms:.2f} ms")


if __name__ == "__main__":
    main()
