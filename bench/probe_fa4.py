"""flash-attn-4's CuTe varlen attention against train_gpt's FlexAttention call at the record's shapes, on one GPU.

Inputs are bench/bench_flex.py's (49,152 tokens, 6 heads of 128, documents of 100-1500 tokens). Per window, the
forward + backward of three calls is timed, interleaved, by CUDA events around 5 back-to-back calls (so the host can
run ahead where the GPU work is longer):
- flex: FlexAttention through torch.compile with train_gpt's token-exact window mask, as in bench_flex.py;
- fa4: `flash_attn.cute.interface.flash_attn_varlen_func`, eager, with the documents' cu_seqlens and their longest
  length as max_seqlen, causal, window (W tokens, 0);
- fa4 op: train_gpt's `fa4` backend (the custom ops `fa4_forward` / `fa4_backward`) through torch.compile, with
  cu_seqlens padded as the loader pads them and max_seqlen 2048 (train_max_seq_len), as training calls it.
Each fa4 result is checked against flex's with bench_flex.py's tolerance. flash-attn-4 and its dependencies may
come from --site, a folder of unpacked wheels, for machines where they are not installed (bench/NOTES.md,
2026-12-06, says which wheels).

    python bench/probe_fa4.py [--site DIR]
"""

import argparse
import sys
import time
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
TRAIN_MAX_SEQ_LEN = 2048  # train_gpt.py's train_max_seq_len: the max_seqlen that training passes


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--site", help="a folder of unpacked wheels to import flash-attn-4 and its dependencies from")
    args = parser.parse_args()
    if args.site:  # nvidia-cutlass-dsl's .pth adds dsl_packages; a plain folder on sys.path does not read it
        sys.path[:0] = [args.site, str(Path(args.site) / "nvidia_cutlass_dsl" / "dsl_packages")]
    sys.path.insert(0, str(ROOT))
    import torch
    from torch.nn.attention.flex_attention import flex_attention

    import train_gpt as tg
    from bench.bench_flex import BLOCK, BOS, TOKENS, WINDOWS, differences, record_inputs
    from bench.gpu_timing import median_ms

    if not torch.cuda.is_available() or not tg.flash_attn_4_installed():
        raise SystemExit("probe_fa4.py: needs a CUDA GPU and flash-attn-4 (installed, or unpacked into --site)")
    started = time.time()
    from flash_attn.cute.interface import flash_attn_varlen_func

    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}; flash_attn.cute imported in {time.time() - started:.1f} s", flush=True)
    ids, docs, q, k, v, grad, scale = record_inputs()
    starts = ids.eq(BOS).nonzero().flatten().to(torch.int32)
    cu_seqlens = torch.cat([starts, torch.tensor([TOKENS], device="cuda", dtype=torch.int32)])
    longest = int(cu_seqlens.diff().max())
    padded = torch.full((tg.max_docs_per_batch(TOKENS),), TOKENS, device="cuda", dtype=torch.int32)
    padded[: cu_seqlens.numel()] = cu_seqlens
    scale_value = float(scale)
    backend = tg.attention_backend("fa4", BLOCK, BOS)
    flex = torch.compile(
        lambda q, k, v, mask: flex_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), score_mod=lambda s, b, h, i, j: s * scale, block_mask=mask, scale=1.0,
        ).transpose(1, 2),
        fullgraph=True,
    )
    fa4_op = torch.compile(lambda q, k, v, inputs: backend(q, k, v, inputs, "short", scale_value), fullgraph=True)

    def fa4_eager(window: int) -> torch.Tensor:
        out = flash_attn_varlen_func(
            q[0], k[0], v[0], cu_seqlens_q=cu_seqlens, cu_seqlens_k=cu_seqlens, max_seqlen_q=longest, max_seqlen_k=longest,
            softmax_scale=scale_value, causal=True, window_size=(window * BLOCK, 0),
        )
        return (out[0] if isinstance(out, tuple) else out).unsqueeze(0)

    def with_grads(forward: Callable[[], torch.Tensor]) -> tuple[torch.Tensor, ...]:
        out = forward()
        return (out.detach(), *torch.autograd.grad(out, (q, k, v), grad))

    for window in sorted({w for pair in WINDOWS for w in pair}):
        mask = tg.flex_window_mask(docs, window, BLOCK)
        inputs = backend.prepare(ids, padded, {"short": window}, TRAIN_MAX_SEQ_LEN)
        forwards = {"flex": lambda: flex(q, k, v, mask), "fa4": lambda: fa4_eager(window), "fa4 op": lambda: fa4_op(q, k, v, inputs)}
        results = {name: with_grads(f) for name, f in forwards.items()}
        checks = []
        for name in ("fa4", "fa4 op"):
            nonfinite, _, excess = differences(results[name], results["flex"])
            checks.append(f"{name} {'ok' if excess <= 0 and not nonfinite else 'WRONG'}")
        times: dict[str, list[float]] = {name: [] for name in forwards}
        for _ in range(3):  # interleaved
            for name, forward in forwards.items():
                times[name].append(median_ms(lambda: with_grads(forward), repeats=10, calls=5))
        with torch.no_grad():
            forward_ms = {name: median_ms(f, repeats=10, calls=5) for name, f in forwards.items()}
        figures = " | ".join(f"{name} {sorted(t)[1]:.3f} ms (forward {forward_ms[name]:.3f})" for name, t in times.items())
        print(f"window {window:>2} blocks: {figures} | vs flex: {', '.join(checks)}", flush=True)


if __name__ == "__main__":
    main()
