"""FlexAttention at the record's shapes, forward + backward, under several kernel options, on one GPU.

One attention call of train_gpt.py's FlexAttention path (49,152 tokens, 6 heads of 128, bf16 in the model's
(tokens, heads, head_dim) memory layout seen through a transpose, random document lengths of 100-1500 tokens,
the token-exact window block mask of `train_gpt.flex_window_mask`, the softmax scale as a score_mod; before
bench/NOTES.md of 2026-12-01 (commit a440791) the bench used contiguous (heads, tokens, head_dim) tensors, unlike the model) is
compiled once per kernel-options variant; the median time of forward + backward is printed for the short and
the long window of each schedule stage, with each variant's output and input gradients checked against the
default options' (count of non-finite values, largest absolute difference). A variant that changes the numbers
is marked WRONG.

ROWS_GUARANTEED_SAFE alone is kept as a variant to show why train_gpt.py does not use it: the forward drops
its masked-row guard per key tile; each query block visits its diagonal block first (train_gpt.block_tables_eager),
but with the default 64-key tiles, rows after a document start in the block's second half meet an all-masked
first tile and turn NaN although every query sees itself. With 128-key tiles the first tile holds the row itself.

The last row times PyTorch's own varlen attention (`torch.nn.attention.varlen.varlen_attn`, ATen's bundled
FlashAttention-2 kernels) on the same call, through train_gpt's varlen backend: document starts as cu_seqlens,
the window as FA3's (W tokens, 0). It is a different kernel, so its numbers differ from FlexAttention's by
rounding; the row is checked with the same tolerance.

    python bench/bench_flex.py [VARIANT ...]   # one GPU; a few minutes (one compilation per variant); default: all
"""

import argparse
import sys
from pathlib import Path

import torch
import torch._dynamo.exc
import torch._inductor.exc
from torch.nn.attention.flex_attention import flex_attention

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the repository root (bench/scripts.py)

import train_gpt as tg  # noqa: E402
from bench.gpu_timing import median_ms  # noqa: E402

TOKENS, HEADS, HEAD_DIM, BLOCK, BOS = 49152, 6, 128, 128, 50256
VARIANTS: dict[str, dict] = {
    "default": {},
    "rows guaranteed safe": dict(ROWS_GUARANTEED_SAFE=True),
    "bwd 64x128/128x64": dict(BLOCK_M1=64, BLOCK_N1=128, BLOCK_M2=128, BLOCK_N2=64),
    "fwd 128x128 w8 s2": dict(BLOCK_M=128, BLOCK_N=128, num_warps=8, num_stages=2),
    "safe + fwd 128x128 w8 s2": dict(ROWS_GUARANTEED_SAFE=True, BLOCK_M=128, BLOCK_N=128, num_warps=8, num_stages=2),
    # fwd_/bwd_ prefixes reach one kernel only (unprefixed num_warps/num_stages reach both)
    "fwd_ 128x128 w8 s2": dict(fwd_BLOCK_M=128, fwd_BLOCK_N=128, fwd_num_warps=8, fwd_num_stages=2),
    "safe + fwd_ 128x128 w8 s2": dict(ROWS_GUARANTEED_SAFE=True, fwd_BLOCK_M=128, fwd_BLOCK_N=128, fwd_num_warps=8, fwd_num_stages=2),
    "TMA": dict(USE_TMA=True),
    # backward-only tiles (BLOCK_M1 x BLOCK_N1 for dK/dV, BLOCK_M2 x BLOCK_N2 for dQ), warps, stages; torch's
    # sm90 default for head_dim 128 is 64x128 / 128x64, 8 warps, 3 stages
    "bwd_ 64x128 w8 s2": dict(bwd_BLOCK_M1=64, bwd_BLOCK_N1=128, bwd_BLOCK_M2=128, bwd_BLOCK_N2=64, bwd_num_warps=8, bwd_num_stages=2),
    "bwd_ 64x128 w8 s4": dict(bwd_BLOCK_M1=64, bwd_BLOCK_N1=128, bwd_BLOCK_M2=128, bwd_BLOCK_N2=64, bwd_num_warps=8, bwd_num_stages=4),
    "bwd_ 64x128 w4 s3": dict(bwd_BLOCK_M1=64, bwd_BLOCK_N1=128, bwd_BLOCK_M2=128, bwd_BLOCK_N2=64, bwd_num_warps=4, bwd_num_stages=3),
    "bwd_ 64x64 w4 s3": dict(bwd_BLOCK_M1=64, bwd_BLOCK_N1=64, bwd_BLOCK_M2=64, bwd_BLOCK_N2=64, bwd_num_warps=4, bwd_num_stages=3),
    "bwd_ 32x128 w4 s3": dict(bwd_BLOCK_M1=32, bwd_BLOCK_N1=128, bwd_BLOCK_M2=128, bwd_BLOCK_N2=32, bwd_num_warps=4, bwd_num_stages=3),
    "bwd_ 128x128 w8 s2": dict(bwd_BLOCK_M1=128, bwd_BLOCK_N1=128, bwd_BLOCK_M2=128, bwd_BLOCK_N2=128, bwd_num_warps=8, bwd_num_stages=2),
    "varlen FA2": {},  # not FlexAttention: torch's varlen_attn (see the docstring)
}
# |variant - default| <= ATOL + RTOL * |default|: a few bf16 rounding steps (one step is 2^-8 relative); other
# tile orders differ by rounding only
ATOL, RTOL = 0.02, 0.02
WINDOWS = ((1, 3), (3, 7), (5, 11))  # (short, long) in blocks at the three schedule stages


def differences(results: tuple[torch.Tensor, ...], references: tuple[torch.Tensor, ...]) -> tuple[int, float, float]:
    """(non-finite values in results, largest |result - reference|, largest excess of that over ATOL + RTOL |reference|,
    > 0 meaning outside the tolerance), over the pairs of tensors; a NaN difference counts as infinite."""
    nonfinite, worst_diff, worst_excess = sum(int((~t.isfinite()).sum()) for t in results), 0.0, -1.0
    for t, r in zip(results, references):
        diff = (t.float() - r.float()).abs().nan_to_num(float("inf"))
        worst_diff = max(worst_diff, float(diff.max()))
        worst_excess = max(worst_excess, float((diff - ATOL - RTOL * r.float().abs()).max()))
    return nonfinite, worst_diff, worst_excess


def record_inputs() -> tuple[torch.Tensor, ...]:
    """One attention call's inputs at the record's shapes on the GPU: document ids (lengths 100-1500), q, k, v
    bf16 needing gradients in the model's memory layout (1, tokens, heads, head_dim), which FlexAttentionBackend
    hands to flex_attention through a transpose, an output gradient like them and the softmax scale (a tensor)."""
    torch.manual_seed(0)
    ids = torch.randint(0, BOS, (TOKENS,), device="cuda", dtype=torch.int32)
    starts = torch.cumsum(torch.randint(100, 1500, (TOKENS // 100,), device="cuda"), 0)  # document lengths 100-1500
    ids[0] = BOS
    ids[starts[starts < TOKENS]] = BOS
    q, k, v = (torch.randn(1, TOKENS, HEADS, HEAD_DIM, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
    return ids, tg.document_ids(ids, BOS), q, k, v, torch.randn_like(q), torch.tensor(0.12, device="cuda")


def varlen_fa2(ids: torch.Tensor, cu_seqlens: torch.Tensor, max_seqlen: int, scale: torch.Tensor):
    """attend(q, k, v, window_blocks) through train_gpt's varlen backend (torch's varlen_attn), as the model calls it."""
    backend = tg.attention_backend("varlen", BLOCK, BOS)
    scale_value = float(scale)  # once, outside the timed calls (a device-to-host copy)

    def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, window: int) -> torch.Tensor:
        inputs = backend.prepare(ids, cu_seqlens, {"short": window}, max_seqlen)
        return backend(q, k, v, inputs, "short", scale_value)

    return attend


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("variants", nargs="*", help=f"variants to run (the default options always run first): {', '.join(map(repr, VARIANTS))}")
    chosen = parser.parse_args().variants
    if unknown := [name for name in chosen if name not in VARIANTS]:
        parser.error(f"unknown variant {unknown[0]!r}; choose from {', '.join(map(repr, VARIANTS))}")
    variants = {name: options for name, options in VARIANTS.items() if name == "default" or not chosen or name in chosen}
    if not torch.cuda.is_available():
        raise SystemExit("bench_flex.py: needs a CUDA GPU.")
    ids, docs, q, k, v, grad, scale = record_inputs()
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, {TOKENS} tokens, {HEADS} heads x {HEAD_DIM}, {int(ids.eq(BOS).sum())} documents")
    references: dict[int, tuple[torch.Tensor, ...]] = {}
    starts = ids.eq(BOS).nonzero().flatten().to(torch.int32)
    cu_seqlens = torch.cat([starts, torch.tensor([TOKENS], device="cuda", dtype=torch.int32)])
    max_seqlen = int(cu_seqlens.diff().max())
    for name, options in variants.items():
        attend = varlen_fa2(ids, cu_seqlens, max_seqlen, scale) if name == "varlen FA2" else torch.compile(
            lambda q, k, v, mask: flex_attention(
                q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), score_mod=lambda s, b, h, i, j: s * scale, block_mask=mask,
                scale=1.0, kernel_options=options,
            ).transpose(1, 2),
            fullgraph=True,
        )
        figures, worst_nonfinite, worst_diff, worst_excess, checked = [], 0, 0.0, -1.0, False
        try:
            for short, long in WINDOWS:
                for window in (short, long):
                    mask = window if name == "varlen FA2" else tg.flex_window_mask(docs, window, BLOCK)

                    def step() -> tuple[torch.Tensor, ...]:
                        out = attend(q, k, v, mask)
                        return (out.detach(), *torch.autograd.grad(out, (q, k, v), grad))

                    results = step()
                    if name == "default":
                        references[window] = results
                    nonfinite, diff, excess = differences(results, references[window])
                    worst_nonfinite, worst_diff, worst_excess = max(worst_nonfinite, nonfinite), max(worst_diff, diff), max(worst_excess, excess)
                    figures.append(f"{window:>2} blocks {median_ms(step, repeats=20):6.2f} ms")
            checked = True  # every window ran
        except (torch._dynamo.exc.BackendCompilerFailed, torch._inductor.exc.InductorError) as error:
            # a variant the installed torch cannot compile is reported, the others still run
            figures.append(f"failed: {type(error).__name__}: {str(error).splitlines()[0][:120]}")
            if name == "default":
                raise SystemExit("bench_flex.py: the default options did not compile, so no variant can be checked") from error
        if not checked:
            check = "not checked"
        else:
            verdict = "WRONG" if worst_nonfinite or worst_excess > 0 else "ok"
            check = f"{verdict}: {worst_nonfinite} non-finite, max |diff| vs default {worst_diff:.3g}"
        print(f"{name:<22} " + " | ".join(figures) + f" | {check}", flush=True)


if __name__ == "__main__":
    main()
