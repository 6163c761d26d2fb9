"""Synthetic logs of every era, written by us in each era's format (docs/records.md describes the formats).

Each builder returns the text of one log file. The numbers are made up unless a test passes published
figures; no log of anyone else is copied here.
"""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

import pytest

TOOLS_DIR = Path(__file__).resolve().parents[1]
if str(TOOLS_DIR) not in sys.path:
    sys.path.insert(0, str(TOOLS_DIR))

from recordkit.tables import end_marker, start_marker, write_tables  # noqa: E402

REPO = TOOLS_DIR.parent
# The published seed folders (figures only): folders of our own runs come and go, so tests copy only these.
SEED_FOLDERS = ("track_1_short/2025-09-23_MuonCustomSizing", "track_3_optimization/results/20260513_shampoo_1_4_power")
README = "\n\n".join(
    ["# Records", start_marker("track1"), end_marker("track1"), start_marker("track2"), end_marker("track2"),
     start_marker("track3"), end_marker("track3"), start_marker("folders"), end_marker("folders"), ""]
)


@pytest.fixture
def root(tmp_path: Path) -> Path:
    """A repository root whose records/ holds the two published seed folders and a README with markers.

    Test modules import it (`from records_fixtures import root`): a conftest.py here would shadow the
    `conftest` module that tests/ imports by name.
    """
    records = tmp_path / "repo" / "records"
    for seed in SEED_FOLDERS:
        shutil.copytree(REPO / "records" / seed, records / seed)
    for data in ("track_1_short/history.csv", "track_2_medium/history.csv", "track_3_optimization/history.csv", "published_logs.csv"):
        (records / data).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(REPO / "records" / data, records / data)
    (records / "README.md").write_text(README)
    write_tables(tmp_path / "repo", records)
    return tmp_path / "repo"

SEP = "=" * 100

# A small stand-in for a training script, with a Hyperparameters dataclass that `diff` can read.
SCRIPT = '''"""{doc}"""
import os
from dataclasses import dataclass


@dataclass
class Hyperparameters:
    num_iterations: int = {steps}
    learning_rate: float = {lr}
    batch_size: int = 8 * 64 * 1024
    val_loss_every: int = 125


def GPT(**shape):
    return shape


def main():
    args = Hyperparameters()
    model = GPT(vocab_size=50304, num_layers={layers}, num_heads={heads}, model_dim={width})
    print(args, model)


if __name__ == "__main__":
    main()
'''

DOC = "A stand-in training script."


# Model shapes by track: GPT-2 small (Tracks 1 and 3) and GPT-2 medium (Track 2); the width tells them apart.
SMALL = {"layers": 12, "heads": 6, "width": 768}
MEDIUM = {"layers": 16, "heads": 8, "width": 1024}


def script(steps: int, lr: float, doc: str = DOC, model: dict[str, int] = SMALL) -> str:
    return SCRIPT.format(steps=steps, lr=lr, doc=doc, **model)


KERNELS = '''import triton


def kernel_grid(n):
    return (n + 127) // 128,
'''


def nvidia_smi(gpus: int = 8, model: str = "NVIDIA H100 80GB HBM3") -> str:
    """An nvidia-smi table with its own `|===|` rows (which must not count as separators)."""
    bar = "+-----------------------------------------+------------------------+----------------------+"
    rows = [
        "Tue Sep 23 10:11:12 2025",
        "+-----------------------------------------------------------------------------------------+",
        "| NVIDIA-SMI 570.148.08             Driver Version: 570.148.08     CUDA Version: 12.8     |",
        bar,
        "| GPU  Name                 Persistence-M | Bus-Id          Disp.A | Volatile Uncorr. ECC |",
        "| Fan  Temp   Perf          Pwr:Usage/Cap |           Memory-Usage | GPU-Util  Compute M. |",
        "|=========================================+========================+======================|",
    ]
    for index in range(gpus):
        rows += [
            f"|   {index}  {model:<30}On  |   00000000:{index:02X}:00.0 Off |                    0 |",
            "| N/A   33C    P0            118W /  700W |    1234MiB /  81559MiB |      0%      Default |",
            bar,
        ]
    rows += [
        "",
        "+-----------------------------------------------------------------------------------------+",
        "| Processes:                                                                              |",
        "|  GPU   GI   CI              PID   Type   Process name                        GPU Memory |",
        "|=========================================================================================|",
        "|    0   N/A  N/A           12345      C   /usr/bin/python3                         1224MiB |",
        "+-----------------------------------------------------------------------------------------+",
        "",
    ]
    return "\n".join(rows)


def _ms_val(step: int, total: int, loss: float, ms: int, decimals: int = 4) -> str:
    avg = ms / max(step, 1)
    return f"step:{step}/{total} val_loss:{loss:.{decimals}f} train_time:{ms}ms step_avg:{avg:.2f}ms"


def track1_2025(
    final_loss: float = 3.2792,
    final_ms: int = 149775,
    steps: int = 1680,
    lr: float = 0.05,
    with_final: bool = True,
    repeat_final: int = 1,
    kernels: bool = True,
    gpus: int = 8,
    seed: int = 0,
    doc: str = DOC,
    diverge_at: int | None = None,
) -> str:
    """Era C (2025-01 onward): code (+ appended kernels), separator, env, separator, steps.

    `diverge_at`: every loss from that step on is written as `nan`, as a diverged run's script writes it.
    """
    code = script(steps, lr, doc)
    if kernels:  # as the 2025 record scripts append them: two newlines, the banner, two newlines, the file
        code += "\n\n" + "-" * 40 + "\n# triton_kernels.py\n" + "-" * 40 + "\n\n" + KERNELS
    lines = [
        code,
        SEP,
        "Running Python 3.12.7 | packaged by conda-forge | (main, Oct  4 2024, 16:05:46) [GCC 13.3.0]",
        "Running PyTorch 2.9.0.dev20250726+cu126 compiled for CUDA 12.6",
        "Running Triton version 3.4.0",
        nvidia_smi(gpus),
        SEP,
        "Compiling model and warming up kernels (~7 minutes on first execution)",
        "Resetting Model",
    ]
    checkpoints = list(range(0, steps, 125))
    nan = float("nan")
    for step in checkpoints:
        ms = int(final_ms * step / steps)
        loss = 10.8258 if step == 0 else final_loss + 2.0 * (1 - step / steps) ** 2 + 0.0001 * seed
        lines.append(_ms_val(step, steps, nan if diverge_at is not None and step >= diverge_at else loss, ms))
        lines.append(f"step:{step + 1}/{steps} train_time:{ms + 89}ms step_avg:{(ms + 89) / (step + 1):.2f}ms")
    if with_final:
        for _ in range(repeat_final):
            lines.append(_ms_val(steps, steps, nan if diverge_at is not None else final_loss, final_ms))
        lines.append("peak memory allocated: 30760 MiB reserved: 45554 MiB")
    return "\n".join(lines) + "\n"


def track1_2024_leading(final_loss: float = 3.2785, final_ms: int = 264000, steps: int = 3000) -> str:
    """Era A (2024-11): leading separator, code, env (lower-case labels), DataLoader block, steps with train_loss."""
    lines = [
        SEP,
        script(steps, 0.0036),
        SEP,
        "Running pytorch 2.5.1+cu124 compiled for CUDA 12.4",
        "nvidia-smi:",
        nvidia_smi(8),
        SEP,
        "Training DataLoader: total number of tokens: 1000000000 across 10 files",
        "Validation DataLoader: total number of tokens: 100000000 across 1 files",
        SEP,
        "step:0/3000 val_loss:10.8258 train_time:0ms step_avg:nanms",
        "step:1/3000 train_loss:10.8259 train_time:25000ms step_avg:nanms",
        "step:11/3000 train_loss:8.1234 train_time:0ms step_avg:nanms",
        "step:13/3000 train_loss:7.9000 train_time:180ms step_avg:90.00ms",
        f"step:1500/3000 val_loss:3.6000 train_time:{final_ms // 2}ms step_avg:88.00ms",
        f"step:3000/3000 val_loss:{final_loss:.4f} train_time:{final_ms}ms step_avg:88.00ms",
    ]
    return "\n".join(lines) + "\n"


def track1_2024_12(final_loss: float = 3.2791, final_ms: int = 228000, steps: int = 1530) -> str:
    """Era B (2024-12): code first, `Running python`, DataLoader block, no train_loss, old memory line."""
    lines = [
        script(steps, 0.05),
        SEP,
        "Running python 3.12.7 (main, Oct  4 2024, 16:05:46) [GCC 13.3.0]",
        "Running pytorch 2.6.0.dev20241203+cu124 compiled for CUDA 12.4",
        "nvidia-smi:",
        nvidia_smi(8),
        SEP,
        "Training DataLoader: total number of tokens: 900000000 across 9 files",
        "Validation DataLoader: total number of tokens: 10485760 across 1 files",
        SEP,
        "step:0/1530 val_loss:10.8258 train_time:0ms step_avg:nanms",
        "step:1/1530 train_time:30000ms step_avg:nanms",
        "Parameter containing:",
        "tensor([1., 2.], device='cuda:0')",
        f"step:1530/1530 val_loss:{final_loss:.4f} train_time:{final_ms}ms step_avg:149.02ms",
        "peak memory consumption: 37001 MiB",
    ]
    return "\n".join(lines) + "\n"


def library_gpu_table(gpus: int = 8, model: str = "NVIDIA H100 80GB HBM3") -> str:
    """What some 2025 Track 2 scripts print when nvidia-smi is missing: their own table, after a line saying so."""
    rows = ["nvidia-smi not found. Using library functions instead.",
            "GPU Name                      Temp  Power      Mem Used        Mem Total       Util  "]
    rows += [f"{index:<3} {model:<25} {35 + index:<5} {117 + index:<10} {2029:<15} {81559:<15} 0     %" for index in range(gpus)]
    return "\n".join(rows + ["None"])


def track2_2025(final_loss: float = 2.91855, final_ms: int = 1041071, steps: int = 4740, seed: int = 0,
                smi: str = "nvidia-smi") -> str:
    """Track 2 (GPT-2 medium, width 1024, target 2.92): the 2025 layout, 6-decimal losses as in 2025 Track 2 logs.

    `smi`: "nvidia-smi" (its table), "library" (the table printed without nvidia-smi) or "none".
    """
    hardware = {"nvidia-smi": nvidia_smi(8), "library": library_gpu_table(8), "none": ""}[smi]
    lines = [
        script(steps, 0.008, model=MEDIUM),
        SEP,
        "Running Python 3.10.18 | packaged by conda-forge | (main, Jun  4 2025, 14:45:41) [GCC 13.3.0]",
        "Running PyTorch 2.10.0.dev20251210+cu126 compiled for CUDA 12.6",
        *([hardware] if hardware else []),
        SEP,
    ]
    for step in range(0, steps, 250):
        ms = int(final_ms * step / steps)
        loss = 10.82584 if step == 0 else final_loss + 1.5 * (1 - step / steps) ** 2 + 0.00001 * seed
        lines.append(_ms_val(step, steps, loss, ms, decimals=6))
        lines.append(f"step:{step + 1}/{steps} train_time:{ms + 220}ms step_avg:{(ms + 220) / (step + 1):.2f}ms")
    lines.append(_ms_val(steps, steps, final_loss, final_ms, decimals=6))
    lines.append("peak memory allocated: 61234 MiB reserved: 70112 MiB")
    return "\n".join(lines) + "\n"


def llmc(final_loss: float = 3.2847) -> str:
    """llm.c baseline: no code, no environment, `s:` lines only."""
    lines = []
    for step in range(0, 101, 25):
        lines.append(f"s:{step} trl:{11.0 - step / 20:.4f} lr:0.0006 norm:1.2345")
        lines.append(f"s:{step} tel:{(final_loss if step == 100 else 11.0 - step / 20):.4f}")
    return "\n".join(lines) + "\n"


T3_ENV = "Running PyTorch 2.11.0+cu128 compiled for CUDA 12.8 on NVIDIA H100 80GB HBM3 with world_size 8"


def _t3_val(step: int, total: int, loss: float, seconds: float, extra_pre: str = "", extra_post: str = "") -> str:
    avg = "nan" if step == 0 else f"{seconds * 1000 / step:.2f}"
    return f"step:{step}/{total} val_loss:{loss:.5f}{extra_pre} train_time:{seconds:.3f}s step_avg:{avg}ms{extra_post}"


def track3_trials(
    trials: list[dict[int, float]],
    total: int = 4150,
    markers: bool = False,
    extra_columns: bool = False,
    source: bool = True,
    console_train_lines: bool = False,
) -> str:
    """Track 3: seconds, 5-decimal losses, one log holding several trials (reset to step:0, or markers)."""
    lines: list[str] = []
    if source:
        lines += [script(total, 0.0015), SEP, T3_ENV, SEP]
    for index, losses in enumerate(trials):
        if markers:
            lines.append(f"trial:{index + 1}/{len(trials)} seed:{index}")
        lines.append(_t3_val(0, total, 10.82584, 0.0))
        for step in sorted(losses):
            seconds = step * 0.2185
            if console_train_lines:
                lines.append(f"step:{step - 1}/{total} train_time:{seconds - 0.2:.3f}s step_avg:218.50ms")
            pre = f" val_ema_loss:{losses[step] - 0.001:.5f}" if extra_columns else ""
            post = " ema_beta:0.9 ref_step:2375" if extra_columns else ""
            lines.append(_t3_val(step, total, losses[step], seconds, pre, post))
    return "\n".join(lines) + "\n"


T3_FIXED_STOP_SCRIPT = '''"""A stand-in Track 3 script that stops at a step fixed in advance."""
import os

SEED = {seed}
TRAIN_STEPS = {total}  # the schedule spans these steps
STOP_STEP = int(os.environ.get("STOP_STEP", "{stop}"))  # stop right after the claimed validation


def main():
    for step in range(STOP_STEP + 1):
        pass


if __name__ == "__main__":
    main()
'''


def track3_fixed_stop(final_loss: float, seed: int = 0, total: int = 2900, stop: int = 2720) -> str:
    """A Track 3 run whose script stops at STOP_STEP < its total steps (Track 3 #45 did so at 2720 of 2900);
    val every 125 steps, then every 5 steps from stop − 20; interval step_avg, as the Track 3 scripts write it."""
    lines = [T3_FIXED_STOP_SCRIPT.format(seed=seed, total=total, stop=stop), SEP,
             "Running PyTorch 2.9.1+cu128 compiled for CUDA 12.8",
             "Running on device_name=NVIDIA GH200 480GB with world_size=1", f"Using seed={seed}", SEP]
    steps = sorted(set(range(0, stop - 20, 125)) | set(range(stop - 20, stop + 1, 5)))
    previous = (0, 0.0)
    for step in steps:
        seconds = step * 2.2155 + 0.001 * seed
        loss = 10.82584 if step == 0 else final_loss + 1.2 * (1 - step / total) ** 2 - 1.2 * (1 - stop / total) ** 2
        avg = "nan" if step == 0 else f"{(seconds - previous[1]) * 1000 / (step - previous[0]):.2f}"
        lines.append(f"step:{step}/{total} val_loss:{loss:.5f} train_time:{seconds:.3f}s step_avg:{avg}ms")
        previous = (step, seconds)
    return "\n".join(lines) + "\n"


# The published per-trial val losses of Track 3 record #21 (2026-05-13, shampoo_1_4_power).
SHAMPOO_TRIALS = [
    {4075: 3.27819, 4100: 3.27717, 4125: 3.27642, 4150: 3.27611},
    {4075: 3.27896, 4100: 3.27792, 4125: 3.27720, 4150: 3.27686},
    {4075: 3.27606, 4100: 3.27503, 4125: 3.27426, 4150: 3.27392},
    {4075: 3.28125, 4100: 3.28025, 4125: 3.27949, 4150: 3.27915},
]

SHAMPOO_FILE = '''import torch


class DistributedShampoo(torch.optim.Optimizer):
    pass
'''


def harness(
    final_loss: float = 3.2795,
    final_ms: int = 150100,
    steps: int = 1680,
    lr: float = 0.05,
    device: str = "8x NVIDIA H200",
    shampoo: bool = False,
    smi: bool = True,
    gpus: int = 8,
    seconds: bool = False,
    settings: dict[str, object] | None = None,
    diverge_at: int | None = None,
    doc: str = DOC,
) -> str:
    """Our train_gpt.py (ms) or train_gpt_shampoo.py (`seconds`: Track 3 lines): `key: value` environment lines.

    `settings` are extra hyperparameters, logged in both the `overrides:` and the `hyperparameters:` line;
    `diverge_at`: the run logs `nan` losses from that step on and stops there, as our scripts do.
    """
    code = script(steps, lr, doc)
    if shampoo:  # train_gpt_shampoo.py writes each module behind a banner line and adds no newline before the separator
        code += "# ===== distributed_shampoo/__init__.py =====\nfrom .shampoo import DistributedShampoo\n"
        code += "# ===== distributed_shampoo/shampoo.py =====\n" + SHAMPOO_FILE.removesuffix("\n")
    overrides = dict(settings or {})
    hyper = {"num_iterations": steps, "learning_rate": lr, "seed": 0, "run_name": "x", **overrides}
    lines = [
        code,
        SEP,
        "Running Python 3.11.9 (main, Apr  2 2024, 08:25:04) [GCC 12.2.0]",
        "Running PyTorch 2.11.0+cu128 compiled for CUDA 12.8" if device != "cpu" else "Running PyTorch 2.13.0+cpu compiled for CUDA None",
        "Running Triton version 3.6.0",
        nvidia_smi(gpus, "NVIDIA H200") if smi else "nvidia-smi: not available",
        f"device: {device}",
        f"world_size: {gpus}" if smi else "world_size: 1",
        "grad_accum_steps: 1" if smi else "grad_accum_steps: 8",
        "attention_backend: flex",
        "fp8_head: on",
        "git_commit: 0123456789abcdef",
        f"overrides: {overrides!r}",
        f"hyperparameters: {hyper!r}",
        "train_files: 8 files, 800000000 tokens",
        "val_files: 1 files, 100000000 tokens",
        "muon groups: 4 (attn 3x768x768, mlp 768x3072)",
        SEP,
        "warmup_time: 412.3s",
    ]
    points = [(0, 10.8258, 0), (steps // 2, 3.7, final_ms // 2), (steps, final_loss, final_ms)]
    for step, loss, ms in points:
        if diverge_at is not None and step >= diverge_at:
            lines.append(_harness_val(diverge_at, steps, float("nan"), ms, seconds))
            lines.append("Traceback (most recent call last):")  # the script stops on a non-finite loss
            lines.append(f"FloatingPointError: val loss is nan at step {diverge_at}")
            break
        lines.append(_harness_val(step, steps, loss, ms, seconds))
        if step == 0:
            lines.append(f"step:1/{steps} train_time:{'0.155s' if seconds else '155ms'} step_avg:154.61ms")
    else:
        lines.append("peak memory allocated: 30761 MiB reserved: 45600 MiB")
    return "\n".join(lines) + "\n"


def _harness_val(step: int, total: int, loss: float, ms: int, seconds: bool) -> str:
    if seconds:
        return _t3_val(step, total, loss, ms / 1000)
    return _ms_val(step, total, loss, ms)


def header_only(log_text: str) -> str:
    """What a run that failed at start leaves: its source and environment, up to the last separator."""
    return log_text[: log_text.rindex(SEP) + len(SEP)] + "\n"


def with_garbage_before_final_val(log_text: str, size: int = 4096) -> bytes:
    """The log with `size` bytes of binary garbage (no newline) glued in front of its last val line."""
    lines = log_text.splitlines(keepends=True)
    index = max(i for i, line in enumerate(lines) if " val_loss:" in line)
    garbage = bytes((i * 37 + 11) % 256 for i in range(size)).replace(b"\n", b"\0").replace(b"\r", b"\0")
    head, tail = "".join(lines[:index]).encode(), "".join(lines[index:]).encode()
    return head + garbage + tail


def write(path: Path, text: str | bytes) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    if isinstance(text, bytes):
        path.write_bytes(text)
    else:
        path.write_text(text)
    return path
