"""The tables' backward for one training step at one GPU: autograd's, compiled, against train_gpt's TableLookups.

A step of the record at one GPU runs 8 micro-steps of 49,152 tokens, each looking up four 50,304 x 768 bf16 tables
(the token embedding and three value embeddings) and adding their gradients into the tables' .grad. Both versions
run those lookups and their backward in a compiled function, given the lookups' output gradients:
  * autograd: F.embedding, whose compiled backward zeroes an fp32 table, scatter-adds into it and rounds it to
    bf16, then AccumulateGrad adds that into .grad (train_gpt.py before the in-place gradients);
  * in place: train_gpt.TableLookups, whose backward is accumulate_table_grads (one stable sort of the ids, then per
    table a kernel that walks chunks of sorted positions and adds each run of equal ids into its row of the .grad
    buffer, and one that adds the runs crossing chunk edges).
Each is timed as a whole step (8 micro-steps x 4 tables, gradients zeroed between steps), in pairs back to back,
orders alternating; it prints each pair's milliseconds, the median ratio, how many rows a micro-step names, and
how many gradient elements differ between the two (autograd sums a row's fp32 terms with atomics in no fixed order,
so a rounding to bf16 may differ by one place: 2^-8 relative).

    python bench/bench_embedding_grad.py --tokens '.proxy/docs_train_*.bin' [--profile] [--tiles 64x256w2,16x256w1]   # one GPU, a minute
"""

from __future__ import annotations

import argparse
import glob
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the repository root (bench/scripts.py)

import train_gpt  # noqa: E402
from bench.gpu_timing import median_ms  # noqa: E402

TOKENS, ROWS, DIM, TABLES, MICRO_STEPS = 49152, 50304, 768, 4, 8


def token_ids(pattern: str | None, vocab: int) -> list[torch.Tensor]:
    """MICRO_STEPS windows of TOKENS ids: from the first shard matching pattern, else Zipf-distributed."""
    if pattern:
        files = sorted(glob.glob(pattern))
        if not files:
            raise SystemExit(f"bench_embedding_grad.py: no file matches --tokens {pattern!r}; pass a shard pattern such as '.proxy/docs_train_*.bin'")
        tokens = torch.from_numpy(train_gpt.read_shard(files[0], vocab).astype("int32"))
        if tokens.numel() < TOKENS * MICRO_STEPS:
            raise SystemExit(f"bench_embedding_grad.py: {files[0]} holds {tokens.numel()} tokens, fewer than {TOKENS * MICRO_STEPS}; pass a larger shard")
        return [tokens[i * TOKENS : (i + 1) * TOKENS].cuda() for i in range(MICRO_STEPS)]
    weights = 1.0 / torch.arange(1, vocab + 1, dtype=torch.float64)
    return [torch.multinomial(weights, TOKENS, replacement=True).to(torch.int32).cuda() for _ in range(MICRO_STEPS)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", help="a glob of token shards to take the ids from (default: Zipf-distributed ids)")
    parser.add_argument("--pairs", type=int, default=8, help="autograd/in-place pairs, orders alternating")
    parser.add_argument("--repeats", type=int, default=5, help="steps per median")
    parser.add_argument("--profile", action="store_true", help="also list each version's kernels (device ms per step) and its host time per step")
    parser.add_argument(
        "--tiles", default="", help="also time accumulate_table_grads alone per step with these tiles, e.g. '64x256w2,16x256w1' (sorted positions per chunk x columns, warps)"
    )
    args = parser.parse_args()
    tiles = [parse_tile(text) for text in args.tiles.split(",") if text]
    if not torch.cuda.is_available() or train_gpt.triton is None:
        raise SystemExit("bench_embedding_grad.py: needs a CUDA GPU and Triton.")
    torch.manual_seed(0)
    ids = token_ids(args.tokens, 50257)
    grad_outs = [[torch.randn(TOKENS, DIM, device="cuda").bfloat16() for _ in range(TABLES)] for _ in range(MICRO_STEPS)]
    tables = [torch.randn(ROWS, DIM, device="cuda").bfloat16().requires_grad_() for _ in range(TABLES)]
    buffers = [torch.zeros_like(t) for t in tables]
    look_up = torch.compile(lambda i, *ws: [F.embedding(i, w) for w in ws], fullgraph=True, dynamic=False)
    look_up_in_place = torch.compile(lambda i, ws, bs: train_gpt.TableLookups.apply(i, *ws, *bs), fullgraph=True, dynamic=False)

    def autograd_step() -> None:
        for t in tables:
            t.grad = None
        for i, g in zip(ids, grad_outs):
            torch.autograd.backward(look_up(i, *tables), g)

    def in_place_step() -> None:
        for b in buffers:
            b.zero_()
        for i, g in zip(ids, grad_outs):
            torch.autograd.backward(look_up_in_place(i, tables, buffers), g)

    autograd_step()
    in_place_step()
    torch.cuda.synchronize()
    named = [int(torch.unique(i).numel()) for i in ids]
    print(f"rows named per micro-step: {min(named)}-{max(named)} of {ROWS} (median {statistics.median(named):.0f})")
    for index, (t, b) in enumerate(zip(tables, buffers)):
        differ = t.grad.view(torch.int16) != b.view(torch.int16)
        relative = ((t.grad.float() - b.float()).abs() / t.grad.float().abs().clamp_min(2.0**-126)).max().item()
        print(f"table {index}: {int(differ.sum())} of {b.numel()} gradient elements differ (largest relative difference {relative:.2e})")
    ratios = []
    for pair in range(args.pairs):
        order = ((autograd_step, "autograd"), (in_place_step, "in place"))[:: 1 if pair % 2 == 0 else -1]
        ms = {name: median_ms(fn, args.repeats) for fn, name in order}
        ratios.append(ms["in place"] / ms["autograd"])
        print(f"pair {pair + 1}: autograd {ms['autograd']:.3f} ms, in place {ms['in place']:.3f} ms per step (x{ratios[-1]:.3f})")
    print(f"in place / autograd: median x{statistics.median(ratios):.3f} (min {min(ratios):.3f}, max {max(ratios):.3f}, {len(ratios)} pairs)")
    if args.profile:
        for fn, name in ((autograd_step, "autograd"), (in_place_step, "in place")):
            print_profile(fn, name)
    for tile in [train_gpt.TABLE_GRAD_TILE, *tiles]:
        time_tile(tile, ids, grad_outs, tables, args.repeats)


def parse_tile(text: str) -> tuple[int, int, int]:
    """'32x256w1' -> (32, 256, 1)."""
    try:
        sizes, warps = text.split("w")
        chunk, columns = sizes.split("x")
        return int(chunk), int(columns), int(warps)
    except ValueError:
        raise SystemExit(f"bench_embedding_grad.py: --tiles entry {text!r} is not CHUNKxCOLUMNSwWARPS (e.g. 32x256w1)") from None


def time_tile(tile: tuple[int, int, int], ids: list[torch.Tensor], grad_outs: list[list[torch.Tensor]], tables: list[torch.Tensor], repeats: int) -> None:
    """accumulate_table_grads alone over a step's micro-steps with one tile (no autograd, no compile): its
    milliseconds per step and how far its gradients lie from the eager formula's (index_add_'s atomics)."""
    buffers = [torch.zeros_like(t) for t in tables]

    def step() -> None:
        for b in buffers:
            b.zero_()
        for i, g in zip(ids, grad_outs):
            train_gpt.accumulate_table_grads(g, i, buffers, tile)

    ms = median_ms(step, repeats)
    step()
    want = [torch.zeros_like(t) for t in tables]
    for i, g in zip(ids, grad_outs):
        train_gpt.accumulate_table_grads_eager(g, i, want)
    differ = sum(int((b.view(torch.int16) != w.view(torch.int16)).sum()) for b, w in zip(buffers, want))
    print(f"tile {tile}: {ms:.3f} ms per step (kernels alone); {differ} of {sum(b.numel() for b in buffers)} elements differ from the eager formula")


def print_profile(step: Callable[[], None], name: str) -> None:
    """One step under torch.profiler: the kernels by device time, and the host's time to issue the step (if it
    exceeds the kernels' sum, the timing above measured the host, not the GPU)."""
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        start = time.perf_counter()
        step()
        host_ms = 1000 * (time.perf_counter() - start)
        torch.cuda.synchronize()
    kernels = [e for e in prof.key_averages() if e.device_type == torch.autograd.DeviceType.CUDA and e.self_device_time_total > 0]
    total = sum(e.self_device_time_total for e in kernels) / 1000
    print(f"{name}: kernels {total:.3f} ms, host {host_ms:.3f} ms to issue the step (profiled)")
    for e in sorted(kernels, key=lambda e: -e.self_device_time_total)[:8]:
        print(f"    {e.self_device_time_total / 1000:8.3f} ms  x{e.count:<4d} {e.key[:100]}")


if __name__ == "__main__":
    main()
