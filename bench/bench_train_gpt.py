"""Benchmark train_gpt.py at the record configuration on the GPUs of this machine.

Measures the bf16 matmul rate of the card (8192^3 products), runs `train_gpt.py` under torchrun for a
given number of steps, reads the run's log and prints one table: world size, ms/step over the timed
region (after the first `--skip` steps), tokens/s, model FLOPs per step, MFU, peak memory and the
untimed compile + warm-up time.

    python bench/bench_train_gpt.py --nproc 1 --steps 200 -- \
        --train_files=.proxy/docs_train_*.bin --val_files=.proxy/docs_val_*.bin \
        --cycle_train_files=true --val_tokens=1572864

Model FLOPs per step = 6 x (parameters of the matrices multiplied in the forward) x tokens per step;
attention's score and value products are reported separately and left out of MFU, as is usual.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))  # the repository root (bench/scripts.py)

from tools.recordkit.errors import RecordsError  # noqa: E402
from tools.recordkit.parse import parse_log as parse_runs  # noqa: E402


@dataclass
class RunFigures:
    world_size: int
    ms_per_step: float
    tokens_per_step: int
    matmul_params: int
    attention_flops_per_token: float
    peak_allocated_mib: int
    peak_reserved_mib: int
    warmup_s: float
    val_points: list[tuple[int, float]]


def measure_matmul_tflops(n: int = 8192, repeats: int = 50) -> float:
    """Median bf16 rate of an n^3 product on random data (never zeros: they run faster)."""
    import torch
    import triton.testing

    a = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    ms = triton.testing.do_bench(lambda: a @ b, warmup=200, rep=repeats * 10, return_mode="median")
    return 2 * n**3 / (ms * 1e-3) / 1e12


def parse_log(path: Path, skip: int) -> RunFigures:
    """The figures of a finished train_gpt.py log, read with the records tool's parser."""
    try:
        run = parse_runs(path)[0]
    except RecordsError as error:
        raise SystemExit(f"bench: {error}") from None
    train, env = run.train_points, run.env
    if len(train) <= skip + 1 or run.peak_memory is None or run.peak_memory.reserved_mib is None:
        raise SystemExit(f"bench: {path} holds {len(train)} train lines (more than --skip + 1 = {skip + 1} needed) "
                         f"and {'a' if run.peak_memory else 'no'} peak memory line; the run failed or --skip is too large")
    first, last = train[skip], train[-1]
    batch = (env.hyperparameters or {}).get("train_batch_size")
    matmul = re.search(r"matmul=(\d+)", env.settings.get("params", ""))
    if first.train_time_s is None or last.train_time_s is None or batch is None or matmul is None:
        raise SystemExit(f"bench: {path} lacks train times, the hyperparameters line or the params line")
    return RunFigures(
        world_size=env.world_size or 0,
        ms_per_step=1e3 * (last.train_time_s - first.train_time_s) / (last.step - first.step),
        tokens_per_step=int(batch),
        matmul_params=int(matmul[1]),
        attention_flops_per_token=float(env.settings.get("attention_flops_per_token", "nan")),
        peak_allocated_mib=run.peak_memory.allocated_mib,
        peak_reserved_mib=run.peak_memory.reserved_mib,
        warmup_s=run.warmup_time_s if run.warmup_time_s is not None else float("nan"),
        val_points=[(point.step, point.val_loss) for point in run.val_points],
    )


def run_training(nproc: int, steps: int, overrides: list[str], log_dir: Path) -> Path:
    log_dir.mkdir(parents=True, exist_ok=True)
    before = set(log_dir.glob("*.txt"))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
           str(REPO / "train_gpt.py"), f"--num_iterations={steps}", f"--log_dir={log_dir}", *overrides]
    print("bench: running", " ".join(cmd), flush=True)
    code = subprocess.run(cmd, cwd=REPO).returncode
    if code != 0:
        raise SystemExit(f"bench: the training run exited with status {code} (its output is above); fix what it names and run again")
    new_logs = sorted(set(log_dir.glob("*.txt")) - before)
    if len(new_logs) != 1:
        raise SystemExit(f"bench: expected one new log in {log_dir}, found {len(new_logs)}")
    return new_logs[0]


def print_table(fig: RunFigures, tflops: float, gpu: str) -> None:
    model_flops = 6 * fig.matmul_params * fig.tokens_per_step
    attn_flops = fig.attention_flops_per_token * 3 * fig.tokens_per_step  # forward + 2x backward
    achieved = model_flops / (fig.ms_per_step * 1e-3) / 1e12
    mfu = achieved / (tflops * fig.world_size)
    rows = [
        ("gpu", gpu),
        ("world size", fig.world_size),
        ("ms/step (timed, after warm-up)", f"{fig.ms_per_step:.1f}"),
        ("tokens/s", f"{fig.tokens_per_step / fig.ms_per_step * 1e3:,.0f}"),
        ("model FLOPs/step (6*N*T)", f"{model_flops:.4g}  (N = {fig.matmul_params:,} matmul params)"),
        ("attention FLOPs/step (not in MFU)", f"{attn_flops:.4g}"),
        ("bf16 matmul rate, measured", f"{tflops:.0f} TFLOP/s per GPU"),
        ("achieved model TFLOP/s", f"{achieved:.0f}"),
        ("MFU", f"{100 * mfu:.1f}%"),
        ("peak allocated / reserved", f"{fig.peak_allocated_mib / 1024:.1f} / {fig.peak_reserved_mib / 1024:.1f} GiB"),
        ("compile + warm-up", f"{fig.warmup_s:.0f} s"),
    ]
    width = max(len(name) for name, _ in rows)
    for name, value in rows:
        print(f"{name:<{width}}  {value}")
    print("val loss: " + ", ".join(f"{s}:{v:.4f}" for s, v in fig.val_points))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--nproc", type=int, default=1, help="GPUs (processes) to train on")
    parser.add_argument("--steps", type=int, default=200, help="num_iterations of the run")
    parser.add_argument("--skip", type=int, default=10, help="first steps left out of ms/step")
    parser.add_argument("--log-dir", type=Path, default=REPO / "logs" / "bench")
    parser.add_argument("--log", type=Path, help="summarise this finished log instead of training")
    parser.add_argument("--matmul-tflops", type=float, help="use this rate instead of measuring it")
    parser.add_argument("overrides", nargs="*", help="train_gpt.py --name=value overrides (after --)")
    args = parser.parse_args()
    if args.matmul_tflops is not None and not args.matmul_tflops > 0:  # 0 once meant "measure it"; MFU divides by it
        parser.error(f"--matmul-tflops {args.matmul_tflops}: give the GPU's bf16 matmul rate, a number above 0")

    import torch

    if args.matmul_tflops is None and not torch.cuda.is_available():
        raise SystemExit("bench: no CUDA GPU to measure the bf16 matmul rate on; pass --matmul-tflops R (e.g. to summarise a --log here)")
    gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "none"
    tflops = args.matmul_tflops if args.matmul_tflops is not None else measure_matmul_tflops()
    print(f"bench: bf16 8192^3 matmul rate {tflops:.0f} TFLOP/s on {gpu}", flush=True)
    log = args.log or run_training(args.nproc, args.steps, args.overrides, args.log_dir)
    print(f"bench: log {log}")
    print_table(parse_log(log, args.skip), tflops, gpu)


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    main()
