"""run.sh: GPU count, NPROC override and the one-sentence failures, with fake nvidia-smi and torchrun."""

from __future__ import annotations

import os
import re
import shutil
import stat
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SHARDS = ["data/fineweb10B/fineweb_train_000001.bin", "data/fineweb10B/fineweb_val_000000.bin"]


def make_executable(path: Path, body: str) -> None:
    path.write_text(f"#!/usr/bin/env bash\n{body}\n")
    path.chmod(path.stat().st_mode | stat.S_IXUSR)


@pytest.fixture
def checkout(tmp_path: Path) -> Path:
    """A folder with run.sh, the default shards, and a bin/ with fake nvidia-smi (4 GPUs) and torchrun."""
    shutil.copy(REPO / "run.sh", tmp_path / "run.sh")
    for shard in SHARDS:
        (tmp_path / shard).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / shard).write_bytes(b"")
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    make_executable(bin_dir / "nvidia-smi", 'for i in 0 1 2 3; do echo "GPU $i: NVIDIA H200 (UUID: GPU-$i)"; done')
    make_executable(bin_dir / "torchrun", 'echo "torchrun $*"')
    return tmp_path


def run(checkout: Path, *args: str, gpus_present: bool = True, **env: str) -> subprocess.CompletedProcess[str]:
    if not gpus_present:  # what nvidia-smi does on a machine without a working GPU
        make_executable(checkout / "bin" / "nvidia-smi", 'echo "No devices were found"; exit 6')
    base_env = {k: v for k, v in os.environ.items() if k not in ("CUDA_VISIBLE_DEVICES", "NPROC")}
    base_env["PATH"] = f"{checkout / 'bin'}:/usr/bin:/bin"
    return subprocess.run(
        ["bash", str(checkout / "run.sh"), *args], capture_output=True, text=True, env={**base_env, **env}, timeout=30
    )


def test_uses_every_visible_gpu_and_passes_arguments_through(checkout: Path) -> None:
    result = run(checkout, "--num_iterations=10")
    assert result.returncode == 0, result.stderr
    assert re.fullmatch(r"torchrun --standalone --nproc_per_node=4 --log-dir=\S+ train_gpt.py --num_iterations=10", result.stdout.strip())


@pytest.mark.parametrize(("visible", "expected"), [("0,2", 2), ("1", 1), ("0,1,2,3,4,5", 4)])
def test_respects_cuda_visible_devices(checkout: Path, visible: str, expected: int) -> None:
    result = run(checkout, CUDA_VISIBLE_DEVICES=visible)
    assert f"--nproc_per_node={expected} " in result.stdout


def test_nproc_overrides_the_count(checkout: Path) -> None:
    assert "--nproc_per_node=8 " in run(checkout, NPROC="8").stdout


@pytest.mark.parametrize("env", [{"CUDA_VISIBLE_DEVICES": ""}, {"CUDA_VISIBLE_DEVICES": "-1"}, {}])
def test_no_gpu_is_one_sentence_pointing_to_the_cpu_smoke_run(checkout: Path, env: dict[str, str]) -> None:
    result = run(checkout, gpus_present=bool(env), **env)
    assert result.returncode == 1 and result.stdout == ""
    assert result.stderr.count("\n") == 1 and "python train_gpt.py --preset=smoke" in result.stderr


def test_bad_nproc_is_rejected(checkout: Path) -> None:
    result = run(checkout, NPROC="two")
    assert result.returncode == 1 and "NPROC must be a positive number" in result.stderr


def test_missing_default_shards_name_the_download_command(checkout: Path) -> None:
    (checkout / SHARDS[0]).unlink()
    result = run(checkout)
    assert result.returncode == 1 and result.stdout == ""
    assert result.stderr.count("\n") == 1
    assert SHARDS[0] in result.stderr and "python data/cached_fineweb10B.py 9" in result.stderr


@pytest.mark.parametrize("flag", ["--train_files=mine/*.bin", "--val_files=mine/val.bin", "--preset=smoke"])
def test_own_data_skips_the_default_shard_check(checkout: Path, flag: str) -> None:
    for shard in SHARDS:
        (checkout / shard).unlink()
    result = run(checkout, flag)
    assert result.returncode == 0 and result.stdout.strip().endswith(f"train_gpt.py {flag}")


def test_data_path_prefixes_the_default_shards(checkout: Path, tmp_path: Path) -> None:
    elsewhere = tmp_path / "elsewhere"
    assert run(checkout, DATA_PATH=str(elsewhere)).returncode == 1
    for shard in SHARDS:
        (elsewhere / shard).parent.mkdir(parents=True, exist_ok=True)
        (elsewhere / shard).write_bytes(b"")
    assert run(checkout, DATA_PATH=str(elsewhere)).returncode == 0


# ----- world size and the workers' own error lines (issue 12) -----


@pytest.mark.parametrize("args", [(), ("--preset=smoke",)])
def test_nproc_that_does_not_divide_8_is_refused_before_launching(checkout: Path, args: tuple[str, ...]) -> None:
    (checkout / SHARDS[0]).unlink()  # the world size is the first complaint, not the shards
    result = run(checkout, *args, NPROC="3")
    assert result.returncode == 1 and result.stdout == ""
    assert result.stderr == "run.sh: NPROC=3: train_gpt.py splits its batch over 1, 2, 4 or 8 processes; set NPROC=2\n"


def test_visible_gpu_count_that_does_not_divide_8_is_refused(checkout: Path) -> None:
    result = run(checkout, CUDA_VISIBLE_DEVICES="0,1,2")
    assert result.returncode == 1 and result.stdout == ""
    assert result.stderr.count("\n") == 1 and "3 GPUs are visible" in result.stderr and "NPROC=2" in result.stderr


LAUNCHER_REPORT = """echo "E0101 00:00:00.000000 1 torch/distributed/elastic/multiprocessing/api.py:1] failed (exitcode: 2) local_rank: 0 (pid: 1) of binary: python" >&2
echo "Traceback (most recent call last):" >&2
echo "torch.distributed.elastic.multiprocessing.errors.ChildFailedError:" >&2
exit 1"""


def failing_torchrun(checkout: Path, worker_reports: bool) -> None:
    """A torchrun whose rank 0 stops on a reported error (stderr line and error file, as train_gpt.py does) or crashes."""
    body = '''log_dir=$(sed -n 's/.*--log-dir=\\([^ ]*\\).*/\\1/p' <<<"$*")''' + "\n"
    if worker_reports:
        body += '''mkdir -p "$log_dir/run_x/attempt_0/0"
echo '{"message": "train_gpt.py: error: --model_dim=100 must be a multiple of --num_heads=6", "timestamp": "1"}' > "$log_dir/run_x/attempt_0/0/error.json"
echo "train_gpt.py: error: --model_dim=100 must be a multiple of --num_heads=6" >&2
'''
    else:
        body += '''echo "Segmentation fault (core dumped)" >&2\n'''
    make_executable(checkout / "bin" / "torchrun", body + LAUNCHER_REPORT)
    (checkout / "bin" / "python3").symlink_to(sys.executable)


def test_a_workers_reported_error_is_the_only_line(checkout: Path) -> None:
    failing_torchrun(checkout, worker_reports=True)
    result = run(checkout)
    assert result.stderr == "train_gpt.py: error: --model_dim=100 must be a multiple of --num_heads=6\n"
    assert result.returncode == 2  # the worker's status, not torchrun's


def test_an_unexplained_worker_failure_keeps_the_launchers_report(checkout: Path) -> None:
    failing_torchrun(checkout, worker_reports=False)
    result = run(checkout)
    assert result.returncode == 1
    assert result.stderr.splitlines()[0] == "Segmentation fault (core dumped)" and "ChildFailedError" in result.stderr


@pytest.mark.slow
def test_real_torchrun_worker_error_is_one_line() -> None:
    """Two CPU processes through the real torchrun: the script's own line, no launcher traceback."""
    env = {k: v for k, v in os.environ.items() if k not in ("CUDA_VISIBLE_DEVICES", "RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_PORT")}
    env.update(NPROC="2", OMP_NUM_THREADS="1", PATH=f"{Path(sys.executable).parent}:{env.get('PATH', '')}")
    result = subprocess.run(["bash", str(REPO / "run.sh"), "--preset=smoke", "--model_dim=100"], capture_output=True, text=True,
                            env=env, timeout=300)
    assert result.stderr == "train_gpt.py: error: head dim 50 must be a multiple of 4 (half-truncated rotary)\n"
    assert result.returncode == 2


# ----- several machines through torchrun's c10d rendezvous; TRACK=3; --check (issue 15) -----

RENDEZVOUS = r"torchrun --nnodes={nnodes} --rdzv-backend=c10d --rdzv-endpoint={endpoint} --rdzv-id={rdzv_id}{host} --nproc_per_node={nproc} --log-dir=\S+ {script}"


def launch_line(nnodes: int, endpoint: str, nproc: int, rdzv_id: str = "nanogpt", host: str = "", script: str = "train_gpt.py") -> str:
    return RENDEZVOUS.format(nnodes=nnodes, endpoint=re.escape(endpoint), rdzv_id=rdzv_id, host=host, nproc=nproc, script=script)


@pytest.mark.parametrize(
    ("env", "expected"),
    [
        ({"NNODES": "2", "NODE_RANK": "0", "MASTER_ADDR": "node0", "MASTER_PORT": "29400"}, launch_line(2, "node0:29400", 4, host=" --rdzv-conf=is_host=1")),
        ({"NNODES": "2", "NODE_RANK": "1", "MASTER_ADDR": "node0"}, launch_line(2, "node0:29500", 4, host=" --rdzv-conf=is_host=0")),
        ({"NNODES": "2", "MASTER_ADDR": "node0", "RDZV_ENDPOINT": "head:1234", "RDZV_ID": "job7"}, launch_line(2, "head:1234", 4, "job7")),
        ({"NNODES": "2", "NPROC": "1", "MASTER_ADDR": "node0", "SLURM_JOB_ID": "991"}, launch_line(2, "node0:29500", 1, "991")),
        ({"NNODES": "1"}, launch_line(1, "127.0.0.1:29500", 4)),
        ({"NNODES": "2", "MASTER_ADDR": "node0", "TRACK": "3"}, launch_line(2, "node0:29500", 4, script="train_gpt_shampoo.py")),
    ],
)
def test_nnodes_launches_through_the_c10d_rendezvous(checkout: Path, env: dict[str, str], expected: str) -> None:
    result = run(checkout, "--seed=1", **env)
    assert result.returncode == 0, result.stderr
    assert re.fullmatch(expected + " --seed=1", result.stdout.strip()), result.stdout


@pytest.mark.parametrize(
    ("env", "fragment"),
    [
        ({"NNODES": "2"}, "NNODES=2: set MASTER_ADDR"),
        ({"NNODES": "two", "MASTER_ADDR": "node0"}, "NNODES must be a positive number"),
        ({"NNODES": "3", "MASTER_ADDR": "node0"}, "NNODES=3 x 4 processes = 12"),
        ({"NNODES": "2", "NODE_RANK": "2", "MASTER_ADDR": "node0"}, "NODE_RANK must be 0 .. 1"),
        ({"TRACK": "2"}, "TRACK must be 1"),
    ],
)
def test_bad_multi_node_settings_are_one_sentence(checkout: Path, env: dict[str, str], fragment: str) -> None:
    result = run(checkout, **env)
    assert result.returncode == 1 and result.stdout == ""
    assert result.stderr.count("\n") == 1 and fragment in result.stderr, result.stderr


def test_track_3_needs_its_own_download(checkout: Path) -> None:
    (checkout / SHARDS[0]).unlink()
    result = run(checkout, TRACK="3")
    assert result.returncode == 1 and "python data/cached_fineweb10B.py 22" in result.stderr


def test_check_hands_the_run_to_doctor(checkout: Path) -> None:
    (checkout / "tools").mkdir()
    (checkout / "tools" / "doctor.py").write_text("import sys\nprint(' '.join(sys.argv[1:]))\nsys.exit(1)\n")
    (checkout / "bin" / "python3").symlink_to(sys.executable)
    result = run(checkout, "--check", "--quick", "--train_steps=5", TRACK="3", NPROC="2", NNODES="2")
    assert result.returncode == 1  # doctor's status
    assert result.stdout.strip() == "--track 3 --nproc 2 --nnodes 2 --quick --train_steps=5"
    result = run(checkout, "--check", gpus_present=False)  # no GPU: doctor still runs (it reports CPU mode)
    assert result.stdout.strip() == "--track 1"


def test_real_check_on_this_cpu_machine() -> None:
    env = {k: v for k, v in os.environ.items() if k not in ("NPROC", "NNODES", "TRACK", "DATA_PATH")}
    env["CUDA_VISIBLE_DEVICES"] = ""
    result = subprocess.run(["bash", str(REPO / "run.sh"), "--check", "--quick"], capture_output=True, text=True, env=env, timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout.startswith("doctor: Track 1 (train_gpt.py), 1 process, CPU mode")
    assert "doctor: the smoke run would start" in result.stdout
