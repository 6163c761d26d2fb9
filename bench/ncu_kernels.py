"""Nsight Compute on train_gpt.py's heaviest non-GEMM kernels, to see which unit limits each before trying variants.

    bash bench/ncu_kernels.sh [OUT_DIR]          # every target under ncu, then a summary of each (on a CUDA machine)
    python bench/ncu_kernels.py run TARGET [--launches N]   # what ncu profiles: TARGET's kernels, N times
    python bench/ncu_kernels.py summarize CSV    # the key metrics of `ncu --import R --page raw --csv` output

Targets (each runs --launches times, default 3; the first launches compile and warm up, so ncu profiles the last):
  softcap_ce   the FP8 head's fused soft-capped CE kernel on one record micro-step (49,152 x 50,304 bf16 logits)
  flex         FlexAttention forward + backward through train_gpt's backend (49,152 tokens, 6 heads of 128), with
               the long window of the schedule's last stage (11 blocks)
  head_matmul  the head's e4m3 logits matmul (torch._scaled_mm), a compute-bound kernel to compare with
The summary prints per kernel: duration, DRAM / SM / L1 / L2 throughput, achieved occupancy, registers, each
pipe's share of its peak and the largest warp stall reasons (metric names as Nsight Compute 2025 on Hopper).
"""

import argparse
import csv
import re
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the repository root (bench/scripts.py)

TARGETS = ("softcap_ce", "flex", "head_matmul")
# (label, metric-name pattern): every metric whose name matches is printed under the label
SUMMARY_METRICS = (
    ("duration", r"gpu__time_duration\.sum"),
    ("throughput", r"(dram|sm|lts|l1tex)__throughput\.avg\.pct_of_peak_sustained_(elapsed|active)"),
    ("occupancy", r"sm__warps_active\.avg\.pct_of_peak_sustained_active|launch__occupancy_limit_\w+|launch__registers_per_thread"),
    ("issue", r"smsp__issue_active\.avg\.pct_of_peak_sustained_active"),
    ("pipes", r"sm__(inst_executed_pipe_\w+|pipe_\w+_cycles_active)\.avg\.pct_of_peak_sustained_active"),
    ("stalls", r"smsp__average_warps?_issue_stalled_(?!selected_)\w+_per_issue_active\.ratio"),  # 'selected' issued
)
SMALL_SHARE = 1.0  # pipe percentages and stall ratios below this are left out of the summary
TOP_STALLS = 6


# =============================================================================================
# Targets (CUDA)
# =============================================================================================
def run_softcap_ce(launches: int) -> None:
    import torch

    import train_gpt as tg

    logits = (torch.randn(49152, 50304, device="cuda") * 3).bfloat16()
    targets = torch.randint(0, 50304, (49152,), device="cuda")
    for _ in range(launches):
        tg.softcap_ce_e5m2(logits, targets, tg.FP8_GRAD_SCALE)


def run_flex(launches: int) -> None:
    import torch

    import train_gpt as tg
    from bench.bench_flex import BLOCK, BOS, record_inputs

    ids, _, q, k, v, grad, scale = record_inputs()
    attention = tg.attention_backend("flex", BLOCK, BOS)
    windows = attention.window_args(5, 11, ids.device)
    inputs = attention.prepare(ids, None, {"short": windows[0], "long": windows[1]}, 0)
    attend = torch.compile(lambda q, k, v: attention(q, k, v, inputs, "long", scale), fullgraph=True)
    for _ in range(launches):
        torch.autograd.grad(attend(q, k, v), (q, k, v), grad)


def run_head_matmul(launches: int) -> None:
    import torch

    import train_gpt as tg

    x = torch.randn(49152, 768, device="cuda").bfloat16().div(tg.FP8_X_SCALE * 8).to(torch.float8_e4m3fn)
    w = (torch.randn(50304, 768, device="cuda") * 0.02).bfloat16().div(tg.FP8_W_SCALE).to(torch.float8_e4m3fn)
    scale = torch.ones((), device="cuda")
    for _ in range(launches):
        torch._scaled_mm(x, w.T, scale_a=scale, scale_b=scale, out_dtype=torch.bfloat16, use_fast_accum=True)


# =============================================================================================
# Summary of ncu's raw CSV page
# =============================================================================================
def parse_number(text: str) -> float | None:
    """ncu's CSV numbers may carry thousands separators; anything else (names, "n/a") is None."""
    try:
        return float(text.replace(",", ""))
    except ValueError:
        return None


def read_raw_csv(path: Path) -> tuple[list[str], list[str], list[dict[str, str]]]:
    """(metric names, units, one dict per profiled kernel) of `ncu --page raw --csv` output; ncu's own
    messages before the header (lines starting with ==) are skipped."""
    lines = [line for line in path.read_text().splitlines() if not line.startswith("==")]
    rows = list(csv.reader(lines))
    if len(rows) < 2 or "Kernel Name" not in rows[0]:
        raise SystemExit(f"ncu_kernels.py: {path} is not ncu's raw CSV page (no 'Kernel Name' column); write it with `ncu --import R --page raw --csv`")
    names, units = rows[0], rows[1]
    return names, units, [dict(zip(names, row)) for row in rows[2:] if len(row) == len(names)]


def summarize_kernel(names: list[str], units: list[str], kernel: dict[str, str]) -> list[str]:
    """The SUMMARY_METRICS of one kernel as lines; small pipe shares and all but the largest stalls left out."""
    unit_of = dict(zip(names, units))
    lines = [f"kernel: {kernel['Kernel Name'][:120]} (grid {kernel.get('Grid Size', '?')}, block {kernel.get('Block Size', '?')})"]
    for label, pattern in SUMMARY_METRICS:
        found = [(name, parse_number(kernel[name])) for name in names if re.fullmatch(pattern, name)]
        found = [(name, value) for name, value in found if value is not None]
        if label in ("pipes", "stalls"):
            found = sorted((item for item in found if item[1] >= SMALL_SHARE), key=lambda item: -item[1])
        if label == "stalls":
            found = found[:TOP_STALLS]
        for name, value in found:
            lines.append(f"  {label:<10} {name:<78} {value:>10.2f} {unit_of.get(name, '')}")
    return lines


def summarize(path: Path) -> None:
    names, units, kernels = read_raw_csv(path)
    if not kernels:
        raise SystemExit(f"ncu_kernels.py: {path} holds no profiled kernel (did the kernel filter match?)")
    for kernel in kernels:
        print("\n".join(summarize_kernel(names, units, kernel)))


class _ArgumentParser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # one line instead of usage + message
        print(f"ncu_kernels.py: {message} (see --help)", file=sys.stderr)
        raise SystemExit(2)


def main() -> None:
    parser = _ArgumentParser(description=__doc__.splitlines()[0])
    commands = parser.add_subparsers(dest="command", required=True)
    run = commands.add_parser("run", help="run a target's kernels (under ncu)")
    run.add_argument("target", choices=TARGETS)
    run.add_argument("--launches", type=int, default=3, help="times to run the target's kernels (default 3)")
    show = commands.add_parser("summarize", help="print the key metrics of ncu's raw CSV page")
    show.add_argument("csv", type=Path)
    args = parser.parse_args()
    if args.command == "summarize":
        if not args.csv.is_file():
            raise SystemExit(f"ncu_kernels.py: {args.csv}: no such file")
        summarize(args.csv)
        return
    if args.launches < 1:
        parser.error(f"--launches={args.launches}: give at least 1")
    import torch

    if not torch.cuda.is_available():
        raise SystemExit("ncu_kernels.py: run needs a CUDA GPU.")
    torch.manual_seed(0)
    {"softcap_ce": run_softcap_ce, "flex": run_flex, "head_matmul": run_head_matmul}[args.target](args.launches)
    torch.cuda.synchronize()


if __name__ == "__main__":
    main()
