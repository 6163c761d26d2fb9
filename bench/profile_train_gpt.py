"""Profile a few training steps of train_gpt.py on one GPU and print where the GPU time goes.

Builds the record model and optimizers from train_gpt.py's own pieces, compiles, runs WARMUP_STEPS steps,
then records PROFILED_STEPS steps with torch.profiler and prints the top kernels by GPU time and a summary
by kind (attention, FP8 head, GEMMs, Newton-Schulz, communication, Triton elementwise). The arguments are
train_gpt.py's --name=value overrides; PROFILE_TOP=N lists N kernels (default 25).

    python bench/profile_train_gpt.py --train_files=.proxy/docs_train_*.bin --val_files=.proxy/docs_val_*.bin
"""

from __future__ import annotations

import os
import sys
from collections import defaultdict
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the repository root (bench/scripts.py)
import train_gpt as tg  # noqa: E402
from bench.ab import kind_of  # noqa: E402  (the kernel kinds of the A/B runner's profiles)

WARMUP_STEPS = 4  # compile and autotune outside the profile
PROFILED_STEPS = 2


def kernels_to_list() -> int:
    text = os.environ.get("PROFILE_TOP", "25")
    if not text.isdigit():
        sys.exit(f"profile_train_gpt.py: PROFILE_TOP={text!r}: give a whole number of kernels to list, e.g. PROFILE_TOP=100")
    return int(text)

def main() -> None:
    top = kernels_to_list()
    try:
        hp, _ = tg.parse_args(sys.argv[1:])
        if not torch.cuda.is_available():  # it profiles CUDA kernels; without a GPU it failed at its first synchronize
            sys.exit("profile_train_gpt.py: no CUDA GPU here; run it on a machine with one")
        profile_steps(hp, top)
    except tg.UserError as error:  # a bad override or missing shards: train_gpt.py's own one line, not a traceback
        sys.exit(f"profile_train_gpt.py: error: {error}")


def profile_steps(hp: tg.Hyperparameters, top: int) -> None:
    rt = tg.setup_distributed()
    tg.configure_torch(rt.device)
    backend = tg.choose_attention_backend(hp.attention_backend, rt.device, tg.device_capability(rt.device))
    tokens_local = hp.train_batch_size // (rt.grad_accum_steps * rt.world_size)
    fp8 = tg.fp8_head_available(rt.device) and not hp.disable_fp8
    mlp_kernel = tg.choose_mlp_kernel(hp.mlp_kernel, rt.device, tg.device_capability(rt.device))
    model = tg.build_model(hp, rt, backend, fp8, mlp_kernel)  # compiled in place
    adam, muon = tg.build_optimizers(model, hp, rt.rank, rt.world_size)
    loader = tg.TrainLoader(tg.resolve_files(hp.train_files, "train"), num_tokens_local=tokens_local,
                            max_seq_len=hp.train_max_seq_len, rank=rt.rank, world_size=rt.world_size, bos_token=hp.bos_token,
                            vocab_size=hp.vocab_size, cycle=True, device=rt.device,
                            with_cu_seqlens=tg.ATTENTION_BACKEND_CLASSES[backend].takes_cu_seqlens)
    ws_short, ws_long = model.attention.window_args(*tg.window_blocks(0, hp), rt.device)

    def step() -> None:
        for _ in range(rt.grad_accum_steps):
            batch = next(loader)
            model(batch.inputs, batch.targets, batch.cu_seqlens, ws_short, ws_long, hp.train_max_seq_len).backward()
        adam.step()
        muon.step()
        model.zero_grad(set_to_none=True)

    for _ in range(WARMUP_STEPS):
        step()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(PROFILED_STEPS):
            step()
        torch.cuda.synchronize()
    # GPU-side kernels only; user annotations (Optimizer.step#...) span kernels and would count them twice
    events = [e for e in prof.key_averages()
              if e.device_type == torch.autograd.DeviceType.CUDA and not getattr(e, "is_user_annotation", False)]
    total_us = sum(e.self_device_time_total for e in events)
    by_kind: dict[str, float] = defaultdict(float)
    for e in events:
        by_kind[kind_of(e.key)] += e.self_device_time_total
    print(f"GPU time per step: {total_us / PROFILED_STEPS / 1e3:.1f} ms (sum of kernel times)")
    for kind, us in sorted(by_kind.items(), key=lambda kv: -kv[1]):
        print(f"  {kind:<26} {us / PROFILED_STEPS / 1e3:8.1f} ms  {100 * us / total_us:5.1f}%")
    print("top kernels:")
    for e in sorted(events, key=lambda e: -e.self_device_time_total)[:top]:
        print(f"  {e.self_device_time_total / PROFILED_STEPS / 1e3:8.2f} ms  x{e.count // PROFILED_STEPS:<4} {e.key[:170]}")
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    main()
