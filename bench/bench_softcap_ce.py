"""The FP8 head's fused soft-capped cross-entropy kernel against what it replaces, on one GPU.

On a record-sized micro-step (49,152 tokens x 50,304 padded vocabulary, bf16 logits) this checks the kernel
(`train_gpt.softcap_ce_e5m2`):
  * its hardware instructions (casts, reciprocal) against its integer casts and division (the path the interpreter
    tests): loss and both e5m2 layouts must be bitwise equal over the whole micro-step;
  * against its eager reference on a slice of rows (loss per row; e5m2 codes);
and prints the median time of:
  * the kernel, for a few tile sizes and warp counts, and with the integer casts;
  * with --compare FILE, another train_gpt.py's kernel on the same input (e.g. `git show 029d93e:train_gpt.py`),
    timed in turn with this one over interleaved rounds, and how many of the two kernels' losses and codes differ;
  * the path it replaces: the compiled soft-capped CE forward + backward (torch.compile, as the model was
    compiled) giving a bf16 logit gradient, then the division and cast to e5m2 and the transposed copy.

    python bench/bench_softcap_ce.py [--compare OTHER_TRAIN_GPT.py]     # one GPU, about a minute
"""

import argparse
import sys
import types
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the repository root (bench/scripts.py)

import train_gpt as tg  # noqa: E402
from bench.gpu_timing import interleaved_median_ms, median_ms  # noqa: E402
from bench.scripts import load_script  # noqa: E402

TOKENS, VOCAB = 49152, 50304
# rows, columns, warps[, pipeline stages]
TILES = ((128, 128, 16), (128, 128, 32), (64, 128, 8), (32, 128, 8), (32, 128, 4), (256, 128, 16))


def load_module(path: str) -> types.ModuleType:
    try:
        return load_script(Path(path), "compared_train_gpt")
    except ValueError as error:
        raise SystemExit(f"bench_softcap_ce.py: --compare {error}") from None


def codes(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--compare", help="another train_gpt.py whose softcap_ce_e5m2 to time on the same input")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench_softcap_ce.py: needs a CUDA GPU.")
    torch.manual_seed(0)
    logits = (torch.randn(TOKENS, VOCAB, device="cuda") * 3).bfloat16()
    logits[0, :4] = torch.tensor([60.0, -60.0, 1e-3, -1e-3])  # saturated and near-zero soft caps
    targets = torch.randint(0, VOCAB, (TOKENS,), device="cuda")
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, logits {TOKENS} x {VOCAB} bf16")

    losses, grad, grad_t = tg.softcap_ce_e5m2(logits, targets, tg.FP8_GRAD_SCALE)
    int_losses, int_grad, int_grad_t = tg.softcap_ce_e5m2(logits, targets, tg.FP8_GRAD_SCALE, hardware=False)
    print(
        "hardware instructions vs integer casts and division, whole micro-step: "
        f"losses equal {torch.equal(losses, int_losses)}, gradient codes differ in {int((codes(grad) != codes(int_grad)).sum())}, "
        f"transposed codes differ in {int((codes(grad_t) != codes(int_grad_t)).sum())}"
    )
    del int_losses, int_grad, int_grad_t
    # the reference on a slice of rows (the eager path materializes several fp32 copies of its input)
    rows = slice(0, 4096)
    want_losses, want_grad, _ = tg.softcap_ce_e5m2_eager(logits[rows], targets[rows], tg.FP8_GRAD_SCALE)
    got, want = codes(grad[rows]).long(), codes(want_grad).long()
    print(f"loss per row vs eager: max relative error {((losses[rows] - want_losses).abs() / want_losses).max().item():.2e}")
    print(f"e5m2 codes vs eager: {(got != want).float().mean().item():.2e} differ, at most {(got - want).abs().max().item()} code apart")
    print(f"transposed layout equal: {torch.equal(codes(grad_t), codes(grad).T)}")
    if args.compare:
        other = load_module(args.compare)
        other_losses, other_grad, other_grad_t = other.softcap_ce_e5m2(logits, targets, tg.FP8_GRAD_SCALE)
        print(
            f"{args.compare}: losses differ in {int((losses != other_losses).sum())} rows (max relative difference "
            f"{((losses - other_losses).abs() / other_losses).max().item():.2e}), gradient codes in "
            f"{int((codes(grad) != codes(other_grad)).sum())}, transposed codes in {int((codes(grad_t) != codes(other_grad_t)).sum())}"
        )
        del other_grad, other_grad_t
    del grad, grad_t, got, want

    def replaced() -> torch.Tensor:
        leaf = logits.detach().requires_grad_()
        compiled_loss(leaf, targets).backward()
        grad_f8 = leaf.grad.div(tg.FP8_GRAD_SCALE).to(torch.float8_e5m2)
        return grad_f8.T.contiguous()

    compiled_loss = torch.compile(lambda l, t: tg.softcapped_cross_entropy(l, t, "sum"), fullgraph=True)
    print(f"replaced path (compiled CE forward + backward, cast, transposed copy): {median_ms(replaced, repeats=10):.2f} ms")
    if args.compare:
        both = interleaved_median_ms(
            {"this": lambda: tg.softcap_ce_e5m2(logits, targets, tg.FP8_GRAD_SCALE),
             "other": lambda: other.softcap_ce_e5m2(logits, targets, tg.FP8_GRAD_SCALE)},
            rounds=11,
        )
        print(f"this kernel against {args.compare}, 11 interleaved rounds: {both['this']:.3f} against {both['other']:.3f} ms, "
              f"ratio {both['this'] / both['other']:.4f}")
    for tile in TILES:
        ms = median_ms(lambda: tg.softcap_ce_e5m2(logits, targets, tg.FP8_GRAD_SCALE, tile), repeats=10)
        stages = f", {tile[3]} stages" if len(tile) > 3 else ""
        print(f"softcap_ce_e5m2, {tile[0]}x{tile[1]} tiles, {tile[2]} warps{stages}: {ms:.2f} ms")
    ms = median_ms(lambda: tg.softcap_ce_e5m2(logits, targets, tg.FP8_GRAD_SCALE, hardware=False), repeats=10)
    print(f"softcap_ce_e5m2, default tiles, integer casts: {ms:.2f} ms")


if __name__ == "__main__":
    main()
