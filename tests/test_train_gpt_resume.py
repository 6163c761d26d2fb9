"""train_gpt.py --checkpoint_every / --resume: a resumed run equals the uninterrupted one bit for bit on CPU (one
process and two gloo processes), and Ctrl-C stops at a step boundary after a checkpoint it can resume from."""

import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from conftest import ROOT, make_shards, signal_when, tiny_args

SCRIPT = ROOT / "train_gpt.py"
# 10 steps; YaRN stretches the long window at steps 2, 4, 6 and 8 (windows 3, 5, 7, 9, 11 blocks), so a resume
# at step 4 must rebuild the rotary tables of step 2's update (YaRN updates compound).
SCHEDULE = dict(num_iterations=8, iteration_extension=2, val_loss_every=5, warmup_steps=2, ws_schedule="3,5,7,9,11")


def script_env() -> dict[str, str]:
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "DATA_PATH", "TORCHELASTIC_ERROR_FILE"):
        env.pop(key, None)
    return env


def launch(processes: int) -> list[str]:
    if processes == 1:
        return [sys.executable, str(SCRIPT)]
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={processes}", str(SCRIPT)]


def train(processes: int, shards: tuple[str, str], out: Path, **extra: object) -> subprocess.CompletedProcess:
    args = tiny_args(*shards, out / "logs", **SCHEDULE, save_checkpoint="true", **extra)
    result = subprocess.run(launch(processes) + args, capture_output=True, text=True, timeout=600, env=script_env(), cwd=out)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
    return result


def val_lines(out: Path) -> dict[int, str]:
    """step -> the val line without its timing columns."""
    (log,) = (out / "logs").glob("*.txt")
    found = (re.match(r"^step:(\d+)/\d+ val_loss:\S+", line) for line in log.read_text().splitlines())
    return {int(m[1]): m[0] for m in found if m}


def end_state(out: Path) -> dict:
    (path,) = (out / "logs").glob("*/state_step000010.pt")
    return torch.load(path, map_location="cpu", weights_only=False)


def assert_same_tensors(a: object, b: object, where: str) -> None:
    """Equal structure and bitwise-equal tensors (dtype included)."""
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b), where
    elif isinstance(a, dict):
        assert isinstance(b, dict) and a.keys() == b.keys(), where
        for key in a:
            assert_same_tensors(a[key], b[key], f"{where}.{key}")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b)):
            assert_same_tensors(x, y, f"{where}[{i}]")
    else:
        assert a == b, where


def assert_same_checkpoint(a: Path, b: Path, processes: int) -> None:
    for name in ["shared.pt"] + [f"rank{r}.pt" for r in range(processes)]:
        left, right = (torch.load(folder / name, map_location="cpu", weights_only=True) for folder in (a, b))
        for differs in ("progress", "hyperparameters"):  # the clock, and the runtime-only settings (log_dir, resume)
            left.pop(differs, None), right.pop(differs, None)
        assert_same_tensors(left, right, f"{a.name}/{name}")


@pytest.fixture(scope="module")
def shards(tmp_path_factory) -> tuple[str, str]:
    return make_shards(tmp_path_factory.mktemp("data"))


@pytest.fixture(scope="module")
def straight(tmp_path_factory, shards) -> Path:
    """The uninterrupted one-process run, checkpointing at steps 4 and 8 and at the last step, 10."""
    out = tmp_path_factory.mktemp("straight")
    train(1, shards, out, checkpoint_every=4, checkpoint_dir=out / "ckpt")
    assert sorted(p.name for p in (out / "ckpt").iterdir()) == [".lock", "step000004", "step000008", "step000010"]
    return out


@pytest.mark.slow
@pytest.mark.parametrize("processes", [1, 2])
def test_resumed_run_equals_the_uninterrupted_one_bit_for_bit(processes, shards, straight, tmp_path):
    reference = straight
    if processes > 1:
        reference = tmp_path / "straight"
        reference.mkdir()
        train(processes, shards, reference, checkpoint_every=4, checkpoint_dir=reference / "ckpt")
    resumed = tmp_path / "resumed"
    resumed.mkdir()
    train(processes, shards, resumed, checkpoint_every=4, checkpoint_dir=resumed / "ckpt", resume=reference / "ckpt" / "step000004")
    log = next((resumed / "logs").glob("*.txt")).read_text()
    assert f"resumed_from: {reference / 'ckpt' / 'step000004'} (run " in log and f"world_size: {processes}" in log
    assert val_lines(resumed) == {k: v for k, v in val_lines(reference).items() if k >= 4}
    assert_same_checkpoint(reference / "ckpt" / "step000008", resumed / "ckpt" / "step000008", processes)
    assert_same_tensors(end_state(reference)["model"], end_state(resumed)["model"], "model")
    assert_same_tensors(end_state(reference)["optimizers"], end_state(resumed)["optimizers"], "optimizers")


@pytest.mark.slow
def test_sigint_stops_at_a_step_boundary_and_its_checkpoint_resumes_exactly(shards, straight, tmp_path):
    out, checkpoints = tmp_path / "interrupted", tmp_path / "ckpt"
    out.mkdir()
    args = tiny_args(*shards, out / "logs", **SCHEDULE, checkpoint_every=4, checkpoint_dir=checkpoints)
    process = subprocess.Popen(launch(1) + args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=script_env(), cwd=out)
    stderr = signal_when(process, "step:5/10 train_time", signal.SIGINT, timeout=300)
    assert process.returncode == 130, stderr[-3000:]
    assert "Traceback" not in stderr
    (line,) = stderr.splitlines()
    step = int(re.fullmatch(r"step (\d+): interrupted by SIGINT", line).group(1))
    assert 5 <= step < 10
    (log,) = (out / "logs").glob("*.txt")
    assert log.read_text().splitlines()[-2:] == [f"checkpoint: {checkpoints / f'step{step:06d}'}", line]

    # resume from the interrupt's checkpoint, writing later checkpoints into the same folder
    resumed = tmp_path / "resumed"
    resumed.mkdir()
    train(1, shards, resumed, checkpoint_every=4, checkpoint_dir=checkpoints, resume=checkpoints / f"step{step:06d}")
    assert (checkpoints / "step000008").is_dir() or step >= 8
    assert_same_tensors(end_state(straight)["model"], end_state(resumed)["model"], "model")
    assert_same_tensors(end_state(straight)["optimizers"], end_state(resumed)["optimizers"], "optimizers")
    if step < 8:
        assert_same_checkpoint(straight / "ckpt" / "step000008", checkpoints / "step000008", 1)
