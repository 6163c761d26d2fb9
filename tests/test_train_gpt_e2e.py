"""End-to-end runs of train_gpt.py on tiny generated shards: one process, and two gloo processes."""

import math
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from conftest import ROOT, tiny_args

SCRIPT = ROOT / "train_gpt.py"
VAL_LINE = re.compile(r"^step:(\d+)/(\d+) val_loss:(\d+\.\d{4}) train_time:(\d+)ms step_avg:(\d+\.\d{2})ms$")
TRAIN_LINE = re.compile(r"^step:(\d+)/(\d+) train_time:(\d+)ms step_avg:(\d+\.\d{2})ms$")


def _env() -> dict[str, str]:
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "DATA_PATH"):
        env.pop(key, None)
    return env


def _run(command: list[str], timeout: int = 240) -> subprocess.CompletedProcess:
    result = subprocess.run(command, capture_output=True, text=True, timeout=timeout, env=_env(), cwd=ROOT)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return result


def _single_log(log_dir: Path) -> Path:
    logs = list(log_dir.glob("*.txt"))
    assert len(logs) == 1, logs
    return logs[0]


def _step_lines(log: Path) -> tuple[list[re.Match], list[re.Match]]:
    body = log.read_text()[len(SCRIPT.read_text()) :].splitlines()
    separators = [i for i, line in enumerate(body) if line == "=" * 100]
    assert len(separators) == 2, "expected the two 100-'=' separator lines"
    tail = body[separators[1] + 1 :]
    val = [m for line in tail if (m := VAL_LINE.match(line))]
    train = [m for line in tail if (m := TRAIN_LINE.match(line))]
    return val, train


def _checkpoint(log_dir: Path) -> dict:
    (path,) = list(log_dir.glob("*/state_step*.pt"))
    return torch.load(path, map_location="cpu", weights_only=False)


@pytest.mark.slow
def test_single_process_run_trains_and_logs_exactly(tiny_shards, tmp_path):
    train_files, val_files = tiny_shards
    log_dir = tmp_path / "logs"
    result = _run([sys.executable, str(SCRIPT), *tiny_args(train_files, val_files, log_dir, save_checkpoint="true")])
    log = _single_log(log_dir)
    assert f"log: {log}" in result.stdout
    text = log.read_text()
    assert text.startswith(SCRIPT.read_text()), "the log must begin with the script's exact source"
    val, train = _step_lines(log)
    assert [int(m[1]) for m in val] == [0, 5, 10]
    assert [int(m[1]) for m in train] == list(range(1, 11))
    assert all(int(m[2]) == 10 for m in val + train)
    losses = [float(m[3]) for m in val]
    assert losses[0] == pytest.approx(math.log(512), abs=1e-4)  # zero head: uniform over the 512-token vocabulary
    assert losses[-1] < losses[1] < losses[0] - 1.0, losses
    lines = text.splitlines()
    for key in (
        "world_size: 1",
        "grad_accum_steps: 8",
        "attention_backend: reference",
        "mlp_kernel: triton",
        "fp8_head: off",
        "muon_group_sizes: [1, 10, 16, 16]",
    ):
        assert key in lines, key
    assert re.search(r"^params: total=\d+ matmul=\d+ embed=\d+$", text, re.M)
    assert re.search(r"^warmup_time: \d+\.\ds$", text, re.M)
    assert lines[-1] == "peak memory allocated: 0 MiB reserved: 0 MiB"
    assert _checkpoint(log_dir)["step"] == 10


@pytest.mark.slow
def test_two_gloo_processes_match_one_process(tiny_shards, tmp_path):
    train_files, val_files = tiny_shards
    common = dict(save_checkpoint="true", num_iterations=4, iteration_extension=0, val_loss_every=0, warmup_steps=0)
    one, two = tmp_path / "one", tmp_path / "two"
    _run([sys.executable, str(SCRIPT), *tiny_args(train_files, val_files, one, **common)])
    _run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc_per_node=2",
            str(SCRIPT),
            *tiny_args(train_files, val_files, two, **common),
        ]
    )
    assert "world_size: 2" in _single_log(two).read_text().splitlines()
    loss_one = float(_step_lines(_single_log(one))[0][-1][3])
    loss_two = float(_step_lines(_single_log(two))[0][-1][3])
    assert loss_two == pytest.approx(loss_one, abs=2e-3)
    state_one, state_two = _checkpoint(one)["model"], _checkpoint(two)["model"]
    assert state_one.keys() == state_two.keys()
    # Per tensor relative norm, not elementwise: Adam turns near-zero gradients (whose sign depends on the
    # summation order, and whose size halves at 2 ranks: loss sums, optimizers average) into full-size steps.
    for name in state_one:
        a, b = state_two[name].double(), state_one[name].double()
        assert not a.isnan().any()
        assert (a - b).norm() <= 5e-3 * b.norm() + 1e-6, f"{name}: relative difference {((a - b).norm() / b.norm()).item():.2e}"
