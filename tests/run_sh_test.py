"""run.sh: GPU count, NPROC override and the one-sentence failures, with fake nvidia-smi and torchrun; --check
against the run; signals, the rendezvous and the log's path with the real torchrun and a stand-in worker."""

from __future__ import annotations

import os
import re
import shutil
import signal
import socket
import stat
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SHARDS = ["data/fineweb10B/fineweb_train_000001.bin", "data/fineweb10B/fineweb_val_000000.bin"]


def make_executable(path: Path, body: str) -> None:
    path.write_text(f"#!/usr/bin/env bash\n{body}\n")
    path.chmod(path.stat().st_mode | stat.S_IXUSR)


@pytest.fixture
def listening_port():
    """A port on 127.0.0.1 that accepts connections (where a rendezvous would be)."""
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen(8)
        yield server.getsockname()[1]


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


@pytest.mark.parametrize(
    ("env", "nproc", "expected"),
    [
        ({}, 4, "1"),  # torchrun's own choice for several processes, set by run.sh so that torchrun prints no notice
        ({"NPROC": "1"}, 1, "unset"),  # one process on a GPU: torchrun sets nothing either
        ({"OMP_NUM_THREADS": "3"}, 4, "3"),
        ({"CUDA_VISIBLE_DEVICES": "", "NPROC": "1"}, 1, "rule"),
        ({"CUDA_VISIBLE_DEVICES": "", "NPROC": "2"}, 2, "rule"),
        ({"CUDA_VISIBLE_DEVICES": "", "NPROC": "2", "OMP_NUM_THREADS": "5"}, 2, "5"),
    ],
)
def test_openmp_threads_per_worker(checkout: Path, monkeypatch: pytest.MonkeyPatch, env: dict[str, str], nproc: int, expected: str) -> None:
    """On CPU the workers get the scripts' own rule (cpu_threads), not torchrun's 1; on GPUs torchrun's 1 for several."""
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    make_executable(checkout / "bin" / "torchrun", 'echo "threads ${OMP_NUM_THREADS-unset}"')
    result = run(checkout, "--preset=smoke", **env)
    assert result.returncode == 0, result.stderr
    rule = max(1, len(os.sched_getaffinity(0)) // (2 * nproc))  # train_gpt.cpu_threads
    assert result.stdout.strip() == f"threads {rule if expected == 'rule' else expected}"


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


def launcher_report(exitcode: int, rank: int) -> str:
    """What torchrun prints when a worker fails (its log line, traceback and failure table), as a fake torchrun's body."""
    lines = [
        f"E0101 00:00:00.000000 1 torch/distributed/elastic/multiprocessing/api.py:1] failed (exitcode: {exitcode}) local_rank: {rank} (pid: 7) of binary: python",
        "Traceback (most recent call last):",
        '  File "/usr/bin/torchrun", line 8, in <module>',
        "torch.distributed.elastic.multiprocessing.errors.ChildFailedError: ",
        "Root Cause (first observed failure):",
        "[0]:",
        "  time      : 2026-12-04_21:06:49",
        "  host      : node1",
        f"  rank      : {rank} (local_rank: {rank})",
        f"  exitcode  : {exitcode} (pid: 7)",
        "  error_file: <N/A>",
        "==========",
    ]
    return "\n".join(f"echo '{line}' >&2" for line in lines) + "\nexit 1"


LAUNCHER_REPORT = launcher_report(2, 0)
# What torchrun does before it starts the workers: their log folder under --log-dir (run.sh takes what comes on
# stderr before it for torchrun's own report).
STARTS_WORKERS = '''log_dir=$(sed -n 's/.*--log-dir=\\([^ ]*\\).*/\\1/p' <<<"$*")
mkdir -p "$log_dir/run_x/attempt_0/0"
'''


def failing_torchrun(checkout: Path, worker_reports: bool) -> None:
    """A torchrun whose rank 0 stops on a reported error (stderr line and error file, as train_gpt.py does) or crashes."""
    body = STARTS_WORKERS
    if worker_reports:
        body += '''echo '{"message": "train_gpt.py: error: --model_dim=100 must be a multiple of --num_heads=6", "timestamp": "1"}' > "$log_dir/run_x/attempt_0/0/error.json"
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


def test_an_unexplained_worker_failure_is_the_workers_output_and_one_line(checkout: Path) -> None:
    failing_torchrun(checkout, worker_reports=False)
    result = run(checkout)
    assert result.returncode == 2
    assert result.stderr.splitlines() == [
        "Segmentation fault (core dumped)",  # the worker's own output passes through
        "run.sh: rank 0 (local rank 0) on node1 exited with status 2 (its own output, if any, is above); torchrun stopped the others",
    ]


def test_a_killed_rank_is_one_line_and_128_plus_the_signal(checkout: Path) -> None:
    """Issue 39, N32: a rank killed under torchrun; the survivors' own line is the scripts' (none here)."""
    make_executable(checkout / "bin" / "torchrun", launcher_report(-9, 1))
    result = run(checkout)
    assert result.stderr == "run.sh: rank 1 (local rank 1) on node1 was killed by SIGKILL; torchrun stopped the others\n"
    assert result.returncode == 137


def test_torchruns_own_failure_is_its_last_line(checkout: Path) -> None:
    lines = ["[W1205 00:38:20.607047048 TCPStore.cpp:340] [c10d] a C++ warning before the workers start",
             "Traceback (most recent call last):", '  File "/opt/venv/bin/torchrun", line 8, in <module>', "    sys.exit(main())",
             "torch.distributed.elastic.rendezvous.api.RendezvousError: The node x attempted to join the next round."]
    make_executable(checkout / "bin" / "torchrun", "\n".join(f"echo '{line}' >&2" for line in lines) + "\nexit 1")
    result = run(checkout, NNODES="2", MASTER_ADDR="node0")
    assert result.returncode == 1
    assert result.stderr.splitlines()[1:] == [
        "run.sh: torchrun stopped: torch.distributed.elastic.rendezvous.api.RendezvousError: The node x attempted to join the next round."]


def test_a_workers_traceback_passes_through(checkout: Path) -> None:
    lines = ["Traceback (most recent call last):", '  File "/repo/train_gpt.py", line 3, in <module>', "ZeroDivisionError: division by zero"]
    make_executable(checkout / "bin" / "torchrun", STARTS_WORKERS + "\n".join(f"echo '{line}' >&2" for line in lines) + "\n" + launcher_report(1, 0))
    result = run(checkout)
    assert result.stderr.splitlines()[:3] == lines and len(result.stderr.splitlines()) == 4 and result.returncode == 1


@pytest.mark.parametrize(("args", "env", "expected"), [
    ((), {}, "run.sh: log: logs/abc.txt"),  # the machine of global rank 0 repeats the script's line last
    (("--log_dir=runs",), {"NNODES": "2", "MASTER_ADDR": "node0"}, "run.sh: log: logs/abc.txt"),
])
def test_the_log_path_is_the_last_line(checkout: Path, args: tuple[str, ...], env: dict[str, str], expected: str) -> None:
    make_executable(checkout / "bin" / "torchrun", 'echo "log: logs/abc.txt"; echo "step:1/1 val_loss:1.0"')
    result = run(checkout, *args, **env)
    assert result.returncode == 0 and result.stdout == "log: logs/abc.txt\nstep:1/1 val_loss:1.0\n"
    assert result.stderr.splitlines()[-1] == expected


def test_the_other_machines_say_where_the_log_is(checkout: Path, listening_port: int) -> None:
    make_executable(checkout / "bin" / "torchrun", 'echo "step:1/1 val_loss:1.0"')
    result = run(checkout, "--log_dir=runs", NNODES="2", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(listening_port), NODE_RANK="1")
    assert result.returncode == 0
    assert result.stderr.splitlines() == [
        f"run.sh: waiting for the machine with NODE_RANK=0 to open the rendezvous at 127.0.0.1:{listening_port} (id nanogpt), then there for 1 more machine to start ./run.sh with NNODES=2 and this address; each wait gives up after 600 s, and run.sh stops torchrun if the workers have not started 1210 s after it",
        "run.sh: the log is runs/<run id>.txt under the folder of ./run.sh on the machine that ran global rank 0 (its ./run.sh printed the full path), not on this one",
    ]


@pytest.mark.slow
def test_real_torchrun_worker_error_is_one_line() -> None:
    """Two CPU processes through the real torchrun: the script's own line, no launcher traceback, no log line (the
    run was refused before its log existed)."""
    env = {k: v for k, v in os.environ.items() if k not in ("CUDA_VISIBLE_DEVICES", "RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_PORT")}
    env.update(NPROC="2", OMP_NUM_THREADS="1", PATH=f"{Path(sys.executable).parent}:{env.get('PATH', '')}")
    result = subprocess.run(["bash", str(REPO / "run.sh"), "--preset=smoke", "--model_dim=100"], capture_output=True, text=True,
                            env=env, timeout=300)
    assert result.stderr == "train_gpt.py: error: head dim 50 must be a multiple of 4 (half-truncated rotary)\n"
    assert result.returncode == 2


# ----- several machines through torchrun's c10d rendezvous; TRACK=3; --check (issue 15) -----

RENDEZVOUS = r"torchrun --nnodes={nnodes} --rdzv-backend=c10d --rdzv-endpoint={endpoint} --rdzv-id={rdzv_id} --rdzv-conf=join_timeout={timeout},read_timeout={timeout}{host} --nproc_per_node={nproc} --log-dir=\S+ {script}"


def launch_line(nnodes: int, endpoint: str, nproc: int, rdzv_id: str = "nanogpt", host: str = "", script: str = "train_gpt.py",
                timeout: int = 600) -> str:
    return RENDEZVOUS.format(nnodes=nnodes, endpoint=re.escape(endpoint), rdzv_id=rdzv_id, host=host, nproc=nproc, script=script,
                             timeout=timeout)


@pytest.mark.parametrize(
    ("env", "expected"),
    [
        ({"NNODES": "2", "NODE_RANK": "0", "MASTER_ADDR": "node0", "MASTER_PORT": "29400"}, launch_line(2, "node0:29400", 4, host=",is_host=1")),
        ({"NNODES": "2", "NODE_RANK": "1", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "{port}", "RDZV_TIMEOUT": "30"},
         launch_line(2, "127.0.0.1:{port}", 4, host=",is_host=0", timeout=30)),  # {port}: a port that accepts
        ({"NNODES": "2", "MASTER_ADDR": "node0", "RDZV_ENDPOINT": "head:1234", "RDZV_ID": "job7"}, launch_line(2, "head:1234", 4, "job7")),
        ({"NNODES": "2", "NPROC": "1", "MASTER_ADDR": "node0", "SLURM_JOB_ID": "991"}, launch_line(2, "node0:29500", 1, "991")),
        ({"NNODES": "1"}, launch_line(1, "127.0.0.1:29500", 4)),
        ({"NNODES": "2", "MASTER_ADDR": "node0", "TRACK": "3"}, launch_line(2, "node0:29500", 4, script="train_gpt_shampoo.py")),
    ],
)
def test_nnodes_launches_through_the_c10d_rendezvous(checkout: Path, listening_port: int, env: dict[str, str], expected: str) -> None:
    env = {name: value.replace("{port}", str(listening_port)) for name, value in env.items()}
    expected = expected.replace("\\{port\\}", str(listening_port))
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
        ({"NNODES": "2", "MASTER_ADDR": "node0", "RDZV_TIMEOUT": "soon"}, "RDZV_TIMEOUT must be a positive number of seconds"),
        ({"NNODES": "2", "MASTER_ADDR": "node0", "MASTER_PORT": "70000"}, "MASTER_PORT must be a port number, 1 .. 65535"),
        ({"TRACK": "2"}, "TRACK must be 1"),
    ],
)
def test_bad_multi_node_settings_are_one_sentence(checkout: Path, env: dict[str, str], fragment: str) -> None:
    result = run(checkout, **env)
    assert result.returncode == 1 and result.stdout == ""
    assert result.stderr.count("\n") == 1 and fragment in result.stderr, result.stderr


def test_torchrun_missing_is_one_sentence_for_the_run_and_the_check(checkout: Path) -> None:
    (checkout / "bin" / "torchrun").unlink()
    fake_doctor(checkout, status=0)
    for args in ((), ("--check",)):
        result = run(checkout, *args)
        assert result.returncode == 1 and result.stdout == ""
        assert result.stderr == "run.sh: torchrun is not on PATH; activate the environment torch is installed in (its bin/ holds torchrun)\n"


def test_track_3_needs_its_own_download(checkout: Path) -> None:
    (checkout / SHARDS[0]).unlink()
    result = run(checkout, TRACK="3")
    assert result.returncode == 1 and "python data/cached_fineweb10B.py 22" in result.stderr


def fake_doctor(checkout: Path, status: int = 1) -> None:
    (checkout / "tools").mkdir(exist_ok=True)
    (checkout / "tools" / "doctor.py").write_text(f"import sys\nprint(' '.join(sys.argv[1:]))\nsys.exit({status})\n")
    if not (checkout / "bin" / "python3").exists():
        (checkout / "bin" / "python3").symlink_to(sys.executable)


def test_check_hands_the_run_to_doctor(checkout: Path) -> None:
    fake_doctor(checkout)
    result = run(checkout, "--check", "--quick", "--train_steps=5", TRACK="3", NPROC="2", NNODES="2", MASTER_ADDR="node0")
    assert result.returncode == 1  # doctor's status
    assert result.stdout.strip() == "--track 3 --nproc 2 --nnodes 2 --flags-as-given --quick --train_steps=5"
    assert run(checkout, "--check").stdout.strip() == "--track 1 --nproc 4 --nnodes 1 --flags-as-given"  # run.sh's GPU count


@pytest.mark.parametrize(("args", "env", "gpus_present"), [
    ((), {}, False),  # a CPU-only machine (issue 38: --check said "would start", the run said "no CUDA GPU")
    (("--preset=smoke",), {}, False),
    (("--preset=smoke",), {"NPROC": "1"}, False),  # a CPU run: it starts
    (("--preset=smoke",), {"NNODES": "2", "NPROC": "1"}, False),  # NNODES without MASTER_ADDR (issue 38)
    (("--preset=smoke",), {"NNODES": "2", "NPROC": "1", "MASTER_ADDR": "127.0.0.1"}, False),
    ((), {"NPROC": "3"}, True),
    ((), {"CUDA_VISIBLE_DEVICES": "0,1,2"}, True),
    ((), {"TRACK": "2"}, True),
    ((), {"NNODES": "2", "NODE_RANK": "5", "MASTER_ADDR": "node0"}, True),
    (("--train_files=mine/*.bin",), {}, True),
    ((), {"DATA_PATH": "/nonexistent"}, True),  # the default shards are missing
    ((), {}, True),
])
def test_check_exits_0_exactly_when_the_run_would_start(checkout: Path, args: tuple[str, ...], env: dict[str, str], gpus_present: bool) -> None:
    """run.sh --check (doctor passing) against run.sh with the same settings (torchrun succeeding): the same status,
    and where run.sh refuses, the same line."""
    fake_doctor(checkout, status=0)
    started = run(checkout, *args, gpus_present=gpus_present, **env)
    checked = run(checkout, "--check", *args, gpus_present=gpus_present, **env)
    assert checked.returncode == started.returncode
    if started.returncode:
        assert checked.stderr == started.stderr and started.stderr.startswith("run.sh: ") and started.stderr.count("\n") == 1
        # only where the default shards are missing does doctor still check the rest of the machine
        assert (checked.stdout != "") is ("is missing; download" in started.stderr)
    else:
        assert started.stdout.startswith("torchrun ") and checked.stdout.startswith("--track ")


def cpu_environment(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items()
           if k not in ("NPROC", "NNODES", "TRACK", "DATA_PATH", "MASTER_ADDR", "MASTER_PORT", "NODE_RANK", "RDZV_ID", "RDZV_ENDPOINT")}
    env.update(CUDA_VISIBLE_DEVICES="", OMP_NUM_THREADS="1", PATH=f"{Path(sys.executable).parent}:{env.get('PATH', '')}", **extra)
    return env


def test_real_check_on_this_cpu_machine(tmp_path: Path) -> None:
    def check(*args: str, **env: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(["bash", str(REPO / "run.sh"), "--check", "--quick", *args], capture_output=True, text=True,
                              env=cpu_environment(**env), timeout=120, cwd=tmp_path)

    smoke = check("--preset=smoke", NPROC="1")
    assert smoke.returncode == 0, smoke.stdout + smoke.stderr
    assert smoke.stdout.startswith("doctor: Track 1 (train_gpt.py), 1 process, CPU mode (the smoke run)")
    assert "doctor: the smoke run would start" in smoke.stdout
    no_nproc = check()
    assert no_nproc.returncode == 1 and no_nproc.stdout == "" and "no CUDA GPU is visible" in no_nproc.stderr
    two_machines = check("--preset=smoke", NPROC="1", NNODES="2")
    assert two_machines.returncode == 1 and "NNODES=2: set MASTER_ADDR" in two_machines.stderr


# ----- the real torchrun with a stand-in worker: signals, the rendezvous (issue 39 N30, issue 38) -----

STAND_IN_WORKER = """import json, os, signal, sys, time
# Stands in for train_gpt.py: stops on SIGINT, SIGTERM or SIGHUP as the scripts do (one line, the error file, 128 + signal)
def stop(signum, frame):
    with open(os.path.join(os.environ["MARKS"], f"rank{os.environ['RANK']}.{signal.Signals(signum).name}"), "a") as f:
        f.write("x")
    line = f"step 1: interrupted by {signal.Signals(signum).name}"
    if os.environ["RANK"] == "0":
        print(line, file=sys.stderr, flush=True)
    with open(os.environ["TORCHELASTIC_ERROR_FILE"], "w") as f:
        json.dump({"message": line, "timestamp": "0"}, f)
    time.sleep(0.5)  # as a checkpoint being written
    sys.exit(128 + signum)
for signum in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
    signal.signal(signum, stop)
open(os.path.join(os.environ["MARKS"], f"started{os.environ['RANK']}"), "w").close()
if os.environ["RANK"] == "0":
    print("log: logs/stand_in.txt", flush=True)
time.sleep(float(os.environ.get("WORK_S", "60")))
"""


def stand_in_checkout(tmp_path: Path) -> Path:
    folder = tmp_path / "checkout"
    folder.mkdir()
    shutil.copy(REPO / "run.sh", folder / "run.sh")
    (folder / "train_gpt.py").write_text(STAND_IN_WORKER)
    (folder / "marks").mkdir()
    return folder


def wait_for(condition, timeout_s: float = 60) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.1)


@pytest.mark.slow
@pytest.mark.parametrize(("signum", "whole_group"), [(signal.SIGINT, True), (signal.SIGINT, False), (signal.SIGHUP, False)])
def test_a_signal_reaches_every_worker_once_and_run_sh_returns_their_status(tmp_path: Path, signum: int, whole_group: bool) -> None:
    """whole_group: Ctrl-C in a terminal (the whole foreground process group); else the signal to run.sh alone."""
    folder = stand_in_checkout(tmp_path)
    marks = folder / "marks"
    launcher = subprocess.Popen(["bash", str(folder / "run.sh"), "--preset=smoke"], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                text=True, env=cpu_environment(NPROC="2", MARKS=str(marks)), start_new_session=True)
    try:
        wait_for(lambda: (marks / "started0").exists() and (marks / "started1").exists())
        os.killpg(launcher.pid, signum) if whole_group else os.kill(launcher.pid, signum)
        stdout, stderr = launcher.communicate(timeout=60)
    finally:
        if launcher.poll() is None:
            os.killpg(launcher.pid, signal.SIGKILL)
    name = signal.Signals(signum).name
    assert launcher.returncode == 128 + signum, stderr
    assert sorted(path.name for path in marks.glob("rank*")) == [f"rank0.{name}", f"rank1.{name}"]
    assert all(path.read_text() == "x" for path in marks.glob("rank*"))  # one signal each
    assert stderr.splitlines() == [f"step 1: interrupted by {name}", "run.sh: log: logs/stand_in.txt"]
    assert stdout == "log: logs/stand_in.txt\n"


@pytest.mark.slow
def test_a_launcher_whose_peer_never_comes_says_whom_it_waits_for_and_gives_up_in_one_line(tmp_path: Path) -> None:
    from conftest import free_port

    folder = stand_in_checkout(tmp_path)
    port = free_port()
    env = cpu_environment(NNODES="2", NPROC="1", NODE_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RDZV_TIMEOUT="3",
                          RDZV_ID=uuid.uuid4().hex[:8], MARKS=str(folder / "marks"))
    result = subprocess.run(["bash", str(folder / "run.sh"), "--preset=smoke"], capture_output=True, text=True, env=env, timeout=120)
    rdzv_id = env["RDZV_ID"]
    assert result.returncode == 1 and result.stdout == ""
    assert result.stderr.splitlines() == [
        f"run.sh: waiting at the rendezvous 127.0.0.1:{port} (id {rdzv_id}) for 1 more machine to start ./run.sh with NNODES=2 and this address; torchrun gives up after 3 s, and run.sh stops it if the workers have not started 16 s after it",
        f"run.sh: no rendezvous at 127.0.0.1:{port} (id {rdzv_id}) within 3 s: start ./run.sh with NNODES=2, the same address and RDZV_ID on every machine (RDZV_TIMEOUT waits longer)",
    ]


# ----- the rendezvous's address (issue 38): a machine that starts before the host, a port in use, the log's path -----


def waiting_for_the_host(port: int, timeout: int) -> str:
    return (f"run.sh: waiting for the machine with NODE_RANK=0 to open the rendezvous at 127.0.0.1:{port} (id nanogpt), then there for "
            f"1 more machine to start ./run.sh with NNODES=2 and this address; each wait gives up after {timeout} s, and run.sh stops "
            f"torchrun if the workers have not started {2 * timeout + 10} s after it")


def test_a_machine_started_before_the_host_gives_up_after_rdzv_timeout_in_one_line(checkout: Path) -> None:
    """At main it waited 60 s plus a random retry delay whatever RDZV_TIMEOUT said, then printed 47 lines of C++ and
    Python tracebacks and a line that named no fix. torchrun is not started (the fake one would print its arguments)."""
    from conftest import free_port

    port = free_port()
    start = time.monotonic()
    result = run(checkout, "--preset=smoke", NNODES="2", NPROC="1", NODE_RANK="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
                 RDZV_TIMEOUT="2")
    elapsed = time.monotonic() - start
    assert result.returncode == 1 and result.stdout == ""
    assert result.stderr.splitlines() == [
        waiting_for_the_host(port, 2),
        f"run.sh: nothing listens at 127.0.0.1:{port} (connection refused for 2 s): start ./run.sh with NODE_RANK=0 first on the machine at 127.0.0.1 (it hosts the rendezvous), or check MASTER_ADDR=127.0.0.1 and MASTER_PORT={port} (RDZV_TIMEOUT waits longer)",
    ]
    assert 2 <= elapsed < 5, elapsed


def test_a_machine_started_before_the_host_goes_on_once_the_host_listens(checkout: Path) -> None:
    from conftest import free_port

    port = free_port()
    host = socket.socket()
    opened = threading.Timer(1.5, lambda: (host.bind(("127.0.0.1", port)), host.listen(8)))
    opened.start()
    try:
        start = time.monotonic()
        result = run(checkout, "--preset=smoke", NNODES="2", NPROC="1", NODE_RANK="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
                     RDZV_TIMEOUT="20")
        elapsed = time.monotonic() - start
    finally:
        opened.join()
        host.close()
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith(f"torchrun --nnodes=2 --rdzv-backend=c10d --rdzv-endpoint=127.0.0.1:{port} ")
    assert result.stderr.splitlines()[0] == waiting_for_the_host(port, 20)
    assert 1.5 <= elapsed < 10, elapsed


def test_the_hosts_port_in_use_is_one_line_with_the_real_torchrun(tmp_path: Path) -> None:
    """At main: an 8-line EADDRINUSE traceback and `torchrun stopped: ...RendezvousConnectionError: The connection to
    the C10d store has failed. See inner exception for details.`"""
    folder = stand_in_checkout(tmp_path)
    with socket.create_server(("", 0)) as holder:  # another program listening on the port
        port = holder.getsockname()[1]
        env = cpu_environment(NNODES="2", NPROC="1", NODE_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RDZV_TIMEOUT="5",
                              MARKS=str(folder / "marks"))
        result = subprocess.run(["bash", str(folder / "run.sh"), "--preset=smoke"], capture_output=True, text=True, env=env, timeout=120)
    assert result.returncode == 1 and result.stdout == ""
    assert result.stderr.splitlines() == [
        f"run.sh: waiting at the rendezvous 127.0.0.1:{port} (id nanogpt) for 1 more machine to start ./run.sh with NNODES=2 and this address; torchrun gives up after 5 s, and run.sh stops it if the workers have not started 20 s after it",
        f"run.sh: cannot host the rendezvous at 127.0.0.1:{port}: port {port} is already in use on this machine; pick another MASTER_PORT (the same on every machine), or stop what holds it",
    ]
    assert not list((folder / "marks").iterdir())  # no worker started


ANNOUNCER = """import importlib.util, os
from pathlib import Path
# Stands in for train_gpt.py: the real script's process group and announce_log, and a log that rank 0 writes
spec = importlib.util.spec_from_file_location("real_train_gpt", os.environ["REAL_SCRIPT"])
real = importlib.util.module_from_spec(spec)
spec.loader.exec_module(real)
rt = real.setup_distributed()
path = Path("logs") / "stand_in.txt"
if rt.rank == 0:
    path.parent.mkdir(exist_ok=True)
    path.write_text("the log\\n")
real.announce_log(path, rt)
real.dist.destroy_process_group()
"""


def test_two_clones_on_one_host_the_other_names_rank_0s_absolute_log_path(tmp_path: Path) -> None:
    """Two launchers on this host, each in a clone of its own, the joining one started first: the one without rank 0
    names the log by rank 0's absolute path (at main, `logs/<id>.txt`, which does not exist in its own clone)."""
    from conftest import free_port

    clones = [tmp_path / "clone0", tmp_path / "clone1"]
    for clone in clones:
        clone.mkdir()
        shutil.copy(REPO / "run.sh", clone / "run.sh")
        (clone / "train_gpt.py").write_text(ANNOUNCER)
    port = free_port()
    common = dict(NNODES="2", NPROC="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RDZV_TIMEOUT="60", REAL_SCRIPT=str(REPO / "train_gpt.py"))
    launchers = []
    try:
        for node_rank in (1, 0):  # the joining machine first: it waits for the host
            launchers.append(subprocess.Popen(["bash", str(clones[node_rank] / "run.sh"), "--preset=smoke"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                              env=cpu_environment(NODE_RANK=str(node_rank), **common)))
            time.sleep(1)
        outputs = [launcher.communicate(timeout=120) for launcher in launchers]
    finally:
        for launcher in launchers:
            if launcher.poll() is None:
                launcher.kill()
                launcher.wait()
    for launcher, (_, stderr) in zip(launchers, outputs):
        assert launcher.returncode == 0, stderr
    (log,) = [clone / "logs" / "stand_in.txt" for clone in clones if (clone / "logs").exists()]  # rank 0's clone, either one
    relative, absolute = sorted(outputs, key=lambda output: "(on " in output[0])
    assert relative[0] == "log: logs/stand_in.txt\n" and relative[1].splitlines()[-1] == "run.sh: log: logs/stand_in.txt"
    line = f"log: {log} (on {socket.gethostname()}, the machine of rank 0, which writes it)"
    assert absolute[0] == line + "\n" and absolute[1].splitlines()[-1] == f"run.sh: {line}"
    assert Path(absolute[0].split()[1]).read_text() == "the log\n"


def connection_failure(inner: str) -> str:
    """torchrun's output when it cannot connect to the rendezvous store (C++ lines, then the chained tracebacks), as a
    fake torchrun's body."""
    lines = [f"[E1205 00:38:20.606582616 socket.cpp:1028] [c10d] {inner}", "frame #0: c10::Error::Error(...) + 0x9d (0x7f06f1379b8d in libc10.so)",
             "", "Traceback (most recent call last):",
             '  File "/venv/lib/python3.11/site-packages/torch/distributed/elastic/rendezvous/c10d_rendezvous_backend.py", line 156, in _create_tcp_store',
             f"torch.distributed.DistNetworkError: {inner}", "", "The above exception was the direct cause of the following exception:", "",
             "Traceback (most recent call last):", '  File "/venv/bin/torchrun", line 8, in <module>',
             "torch.distributed.elastic.rendezvous.api.RendezvousConnectionError: The connection to the C10d store has failed. See inner exception for details."]
    return "\n".join(f"echo '{line}' >&2" for line in lines) + "\nexit 1"


@pytest.mark.parametrize(("inner", "expected"), [
    ("The client socket has timed out after 2000ms while trying to connect to (127.0.0.1, {port}).",
     "run.sh: nothing listens at 127.0.0.1:{port} (connection refused for 2 s): start ./run.sh with NODE_RANK=0 first on the machine at 127.0.0.1 (it hosts the rendezvous), or check MASTER_ADDR=127.0.0.1 and MASTER_PORT={port} (RDZV_TIMEOUT waits longer)"),
    ("Ping failed, invalid value returned from server. Expected: 26335, Got: 1347703880",
     "run.sh: 127.0.0.1:{port} answers, but not as a rendezvous (another program holds port {port} there?): check MASTER_ADDR=127.0.0.1 and MASTER_PORT={port} against the NODE_RANK=0 machine's, or pick another MASTER_PORT on every machine"),
])
def test_torchruns_failed_connect_is_one_line_that_says_why(checkout: Path, inner: str, expected: str) -> None:
    """Without NODE_RANK, torchrun itself connects (or hosts): its tracebacks become one line; a port that refuses is
    asked again to tell "nothing listens" from "unreachable"."""
    from conftest import free_port

    port = free_port()
    make_executable(checkout / "bin" / "torchrun", connection_failure(inner.format(port=port)))
    result = run(checkout, NNODES="2", NPROC="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RDZV_TIMEOUT="2")
    assert result.returncode == 1 and result.stdout == ""
    assert result.stderr.splitlines()[1:] == [expected.format(port=port)]


# ----- a port that accepts connections but never answers as a rendezvous: the watchdog -----


def held_by_a_silent_program(listening_port: int, tmp_path: Path, **env: str) -> tuple[subprocess.Popen[str], Path, dict[str, str]]:
    """run.sh with the real torchrun against listening_port, which accepts connections (its backlog) and never replies:
    torch's store client waits there forever, signals or not."""
    folder = stand_in_checkout(tmp_path)
    settings = cpu_environment(NNODES="2", NPROC="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(listening_port),
                               RDZV_ID=uuid.uuid4().hex[:8], MARKS=str(folder / "marks"), **env)
    launcher = subprocess.Popen(["bash", str(folder / "run.sh"), "--preset=smoke"], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                text=True, env=settings, start_new_session=True)
    return launcher, folder, settings


def torchruns_of(rdzv_id: str) -> str:
    return subprocess.run(["pgrep", "-f", f"rdzv-id={rdzv_id}"], capture_output=True, text=True).stdout


@pytest.mark.parametrize(("node_rank", "within"), [("1", 12), ("", 13)])  # RDZV_TIMEOUT=1: 2 x 1 + 10 s, without NODE_RANK 3 x 1 + 10 s
def test_a_port_held_by_a_program_that_never_answers_stops_torchrun_in_one_line(listening_port: int, tmp_path: Path, node_rank: str,
                                                                                within: int) -> None:
    """At main: run.sh waited forever (654 s until killed in the probe; SIGINT did not end it either)."""
    extra = {"NODE_RANK": node_rank} if node_rank else {}
    launcher, folder, env = held_by_a_silent_program(listening_port, tmp_path, RDZV_TIMEOUT="1", **extra)
    start = time.monotonic()
    try:
        stdout, stderr = launcher.communicate(timeout=60)
    finally:
        if launcher.poll() is None:
            os.killpg(launcher.pid, signal.SIGKILL)
    elapsed = time.monotonic() - start
    endpoint = f"127.0.0.1:{listening_port}"
    assert launcher.returncode == 1 and stdout == ""
    assert stderr.splitlines()[1:] == [
        f"run.sh: torchrun did not start the workers within {within} s and was stopped: something answers at {endpoint} but is not the "
        f"rendezvous (another program holds port {listening_port} there?): check MASTER_ADDR=127.0.0.1 and MASTER_PORT={listening_port} "
        "against the NODE_RANK=0 machine's, or pick another MASTER_PORT on every machine"]
    assert f"run.sh stops torchrun if the workers have not started {within} s after it" in stderr.splitlines()[0] or \
        f"run.sh stops it if the workers have not started {within} s after it" in stderr.splitlines()[0]
    # bash's SECONDS follows the wall clock, which time synchronisation may step while time.monotonic() runs on: a run
    # measured 11.88 s against 12 here, so the lower bound allows one second
    assert within - 1 <= elapsed < within + 10, elapsed
    assert torchruns_of(env["RDZV_ID"]) == ""  # torchrun's process group is gone
    assert not list((folder / "marks").iterdir())  # no worker started


@pytest.mark.parametrize("whole_group", [True, False])
def test_ctrl_c_while_torchrun_is_held_at_such_a_port_ends_the_run(listening_port: int, tmp_path: Path, whole_group: bool) -> None:
    """torchrun does not act on the signal run.sh passes on while its store client waits: run.sh stops its process group a few
    seconds later (at main it waited forever)."""
    launcher, _, env = held_by_a_silent_program(listening_port, tmp_path, RDZV_TIMEOUT="30", NODE_RANK="1")
    try:
        wait_for(lambda: torchruns_of(env["RDZV_ID"]) != "")
        time.sleep(1)  # torchrun in its store client
        os.killpg(launcher.pid, signal.SIGINT) if whole_group else os.kill(launcher.pid, signal.SIGINT)
        start = time.monotonic()
        stdout, stderr = launcher.communicate(timeout=30)
    finally:
        if launcher.poll() is None:
            os.killpg(launcher.pid, signal.SIGKILL)
    assert launcher.returncode == 130 and stdout == ""
    assert len(stderr.splitlines()) == 1 and stderr.startswith("run.sh: waiting for the machine with NODE_RANK=0")
    assert time.monotonic() - start < 10
    assert torchruns_of(env["RDZV_ID"]) == ""
