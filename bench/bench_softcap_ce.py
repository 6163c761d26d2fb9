"""The FP8 head's fused soft-capped cross-entropy kernel against what it replaces, on one GPU.

On a record-sized micro-step (49,152 tokens x 50,304 padded vocabulary, bf16 logits) this checks the kernel
(`train_gpt.softcap_ce_e5m2`) against its eager reference (loss per row; e5m2 gradient codes in both layouts)
and prints the median time of:
  * the kernel, for a few tile sizes;
  * the path it replaces: the compiled soft-capped CE forward + backward (torch.compile, as the model was
    compiled) giving a bf16 logit gradient, then the division and cast to e5m2 and the transposed copy.

    python bench/bench_softcap_ce.py        # one GPU, about a minute (mostly compilation)
"""

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import train_gpt as tg  # noqa: E402
from bench.gpu_timing import median_ms  # noqa: E402

TOKENS, VOCAB = 49152, 50304
TILES = ((32, 128, 8), (32, 128, 4), (32, 256, 8), (16, 128, 4), (64, 128, 8), (64, 64, 4))  # rows, columns, warps


def main() -> None:
    if not torch.cuda.is_available():
        raise SystemExit("bench_softcap_ce.py: needs a CUDA GPU.")
    torch.manual_seed(0)
    logits = (torch.randn(TOKENS, VOCAB, device="cuda") * 3).bfloat16()
    targets = torch.randint(0, VOCAB, (TOKENS,), device="cuda")
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, logits {TOKENS} x {VOCAB} bf16")

    losses, grad, grad_t = tg.softcap_ce_e5m2(logits, targets, tg.FP8_GRAD_SCALE)
    # the reference on a slice of rows (the eager path materializes several fp32 copies of its input)
    rows = slice(0, 4096)
    want_losses, want_grad, _ = tg.softcap_ce_e5m2_eager(logits[rows], targets[rows], tg.FP8_GRAD_SCALE)
    codes, want_codes = grad[rows].view(torch.uint8).long(), want_grad.view(torch.uint8).long()
    print(f"loss per row vs eager: max relative error {((losses[rows] - want_losses).abs() / want_losses).max().item():.2e}")
    print(f"e5m2 codes vs eager: {(codes != want_codes).float().mean().item():.2e} differ, at most {(codes - want_codes).abs().max().item()} code apart")
    print(f"transposed layout equal: {torch.equal(grad_t.view(torch.uint8), grad.view(torch.uint8).T)}")
    del grad, grad_t, want_grad, codes, want_codes

    def replaced() -> torch.Tensor:
        leaf = logits.detach().requires_grad_()
        compiled_loss(leaf, targets).backward()
        grad_f8 = leaf.grad.div(tg.FP8_GRAD_SCALE).to(torch.float8_e5m2)
        return grad_f8.T.contiguous()

    compiled_loss = torch.compile(lambda l, t: tg.softcapped_cross_entropy(l, t, "sum"), fullgraph=True)
    print(f"replaced path (compiled CE forward + backward, cast, transposed copy): {median_ms(replaced, repeats=10):.2f} ms")
    for tile in TILES:
        ms = median_ms(lambda: tg.softcap_ce_e5m2(logits, targets, tg.FP8_GRAD_SCALE, tile), repeats=10)
        print(f"softcap_ce_e5m2, {tile[0]}x{tile[1]} tiles, {tile[2]} warps: {ms:.2f} ms")


if __name__ == "__main__":
    main()
