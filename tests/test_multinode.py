"""run.sh through torchrun's c10d rendezvous on CPU (gloo): one "node" of 2 processes, and 2 "nodes" of
1 process each on localhost, against the same run in one process (the e2e test's comparison)."""

import os
import re
import shutil
import subprocess
import sys
import uuid
from pathlib import Path

import pytest
import torch

from conftest import ROOT, free_port, tiny_args

# Short: 4 steps, one validation at the end, no warm-up.
SHORT = dict(save_checkpoint="true", num_iterations=4, iteration_extension=0, val_loss_every=0, warmup_steps=0)
TIMEOUT_S = 300


def environment(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "DATA_PATH", "CUDA_VISIBLE_DEVICES",
                        "NNODES", "NODE_RANK", "RDZV_ENDPOINT", "RDZV_ID", "NPROC", "TRACK", "SLURM_JOB_ID")}
    env.update(OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", PATH=f"{Path(sys.executable).parent}:{env.get('PATH', '')}", **extra)
    return env


def final_state(log_dir: Path) -> tuple[str, dict[str, torch.Tensor]]:
    (log,) = log_dir.glob("*.txt")
    (checkpoint,) = log_dir.glob("*/state_step*.pt")
    return log.read_text(), torch.load(checkpoint, map_location="cpu", weights_only=False)["model"]


def final_val_loss(log_text: str) -> float:
    return float([line for line in log_text.splitlines() if " val_loss:" in line][-1].split("val_loss:")[1].split()[0])


@pytest.fixture(scope="module")
def one_process(tmp_path_factory: pytest.TempPathFactory) -> tuple[list[str], str, dict[str, torch.Tensor]]:
    """The shards and the reference: the same short run as a single process."""
    from conftest import make_shards

    folder = tmp_path_factory.mktemp("multinode")
    train_files, val_files = make_shards(folder / "data")
    reference = folder / "one"
    result = subprocess.run([sys.executable, str(ROOT / "train_gpt.py"), *tiny_args(train_files, val_files, reference, **SHORT)],
                            capture_output=True, text=True, timeout=TIMEOUT_S, env=environment(), cwd=ROOT)
    assert result.returncode == 0, result.stderr[-3000:]
    return [train_files, val_files], *final_state(reference)


def assert_matches_one_process(log_dir: Path, one_process: tuple[list[str], str, dict[str, torch.Tensor]]) -> None:
    _, reference_log, reference_model = one_process
    log_text, model = final_state(log_dir)
    assert "world_size: 2" in log_text.splitlines()
    assert final_val_loss(log_text) == pytest.approx(final_val_loss(reference_log), abs=2e-3)
    for name, expected in reference_model.items():  # per-tensor relative norm, as in the e2e test (Adam amplifies tiny sign flips)
        a, b = model[name].double(), expected.double()
        assert (a - b).norm() <= 5e-3 * b.norm() + 1e-6, f"{name}: relative difference {((a - b).norm() / b.norm()).item():.2e}"


@pytest.mark.slow
def test_one_node_of_two_processes_through_c10d(one_process, tmp_path):
    (train_files, val_files), *_ = one_process
    log_dir = tmp_path / "c10d"
    env = environment(NNODES="1", NPROC="2", MASTER_PORT=str(free_port()), RDZV_ID=uuid.uuid4().hex)
    result = subprocess.run(["bash", str(ROOT / "run.sh"), *tiny_args(train_files, val_files, log_dir, **SHORT)],
                            capture_output=True, text=True, timeout=TIMEOUT_S, env=env)
    assert result.returncode == 0, result.stderr[-3000:]
    assert_matches_one_process(log_dir, one_process)


@pytest.mark.slow
def test_two_nodes_of_one_process_on_localhost(one_process, tmp_path):
    """Two run.sh launchers, as two machines would start them: NODE_RANK 0 hosts the rendezvous."""
    (train_files, val_files), *_ = one_process
    log_dir = tmp_path / "two_nodes"
    common = dict(NNODES="2", NPROC="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), RDZV_ID=uuid.uuid4().hex)
    nodes = [
        subprocess.Popen(["bash", str(ROOT / "run.sh"), *tiny_args(train_files, val_files, log_dir, **SHORT)],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=environment(NODE_RANK=str(rank), **common))
        for rank in (1, 0)  # the joining node first: it waits for the host
    ]
    try:
        outputs = [node.communicate(timeout=TIMEOUT_S) for node in nodes]
    finally:
        for node in nodes:
            if node.poll() is None:
                node.kill()
                node.wait()
    for node, (_, stderr) in zip(nodes, outputs):
        assert node.returncode == 0, stderr[-3000:]
    assert_matches_one_process(log_dir, one_process)


# ----- issue 38 item 2: several machines, one clone each: every machine writes the smoke shards its ranks read -----


@pytest.mark.slow
@pytest.mark.parametrize("script, args, shards", [
    ("train_gpt.py", ["--preset=smoke", "--train_steps=2"], "logs/smoke_shards_*/*.bin"),
    ("train_gpt_shampoo.py", ["--preset=smoke", "--train_steps=4"], "data/smoke/v512/*.bin"),
])
def test_two_machines_with_a_clone_each_run_the_smoke_preset(tmp_path, script, args, shards):
    """Two torchrun launchers on localhost, each in its own copy of the scripts (two machines with a clone each),
    meeting through a c10d rendezvous."""
    clones = [tmp_path / "machine0", tmp_path / "machine1"]
    for clone in clones:
        clone.mkdir()
        for name in ("train_gpt.py", "train_gpt_shampoo.py"):
            shutil.copy(ROOT / name, clone / name)
        shutil.copytree(ROOT / "distributed_shampoo", clone / "distributed_shampoo", ignore=shutil.ignore_patterns("tests", "__pycache__"))
    rendezvous = ["--nnodes=2", "--nproc_per_node=1", "--rdzv_backend=c10d", f"--rdzv_endpoint=127.0.0.1:{free_port()}",
                  f"--rdzv_id={uuid.uuid4().hex}"]
    machines = [subprocess.Popen([sys.executable, "-m", "torch.distributed.run", *rendezvous, script, *args], cwd=clone,
                                 stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=environment())
                for clone in clones]
    try:
        outputs = [machine.communicate(timeout=TIMEOUT_S) for machine in machines]
    finally:
        for machine in machines:
            if machine.poll() is None:
                machine.kill()
                machine.wait()
    for machine, (_, stderr) in zip(machines, outputs):
        assert machine.returncode == 0, stderr[-3000:]
    (log,) = [log for clone in clones for log in clone.glob("logs/*.txt")]  # global rank 0's machine writes the log
    announced = [[line for line in stdout.splitlines() if line.startswith("log: ")] for stdout, _ in outputs]
    assert sorted(len(lines) for lines in announced) == [1, 1]  # each machine says where the log is
    # rank 0's machine names the log relative to its folder, the other by rank 0's absolute path (its own folder is another clone)
    assert sorted(lines[0].split()[1] for lines in announced) == sorted([f"logs/{log.name}", str(log)])
    assert sum("(on " in lines[0] for lines in announced) == 1  # the other machine names rank 0's
    assert "world_size: 2" in log.read_text().splitlines() and re.search(r"^step:\d+/\d+ val_loss:", log.read_text(), re.M)
    written = [{path.name: path.read_bytes() for path in clone.glob(shards)} for clone in clones]
    assert len(written[0]) == 3 and written[0] == written[1]  # each machine its own shards, the same bytes
