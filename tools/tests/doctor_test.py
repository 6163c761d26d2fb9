"""tools/doctor.py: the CPU-mode report end to end, and each check's verdict on simulated machines."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import types
from pathlib import Path

import numpy as np
import pytest

TOOLS = Path(__file__).resolve().parents[1]
REPO = TOOLS.parent
sys.path.insert(0, str(TOOLS))

import doctor as dr  # noqa: E402

CPU = dr.Machine(gpus=[], smi_gpu_count=0, driver=None, cuda_runtime=None)
GPU_CHECKS = ("cuda", "gpus", "nccl", "expected")


def gpus(count: int, name: str = "NVIDIA H200", capability: tuple[int, int] = (9, 0), free_gib: float = 139.0,
         driver: str = "580.159.04", runtime: str = "13.0") -> dr.Machine:
    listed = [dr.Gpu(i, name, capability, int(free_gib * 2**30), int(140 * 2**30)) for i in range(count)]
    return dr.Machine(listed, count, driver, runtime)


def plan(*flags: str, track: int = 1, nproc: int = 1, nnodes: int = 1, gpu_mode: bool = True) -> dr.Plan:
    return dr.make_plan(dr.TRACKS[track], nproc, nnodes, list(flags), gpu_mode)


def write_shards(folder: Path, train_tokens: int = 300_000, val_tokens: int = 20_000) -> list[str]:
    """Two GPT-2-vocabulary train shards and one validation shard; the --train_files/--val_files flags."""
    sys.path.insert(0, str(REPO))
    import train_gpt as tg

    folder.mkdir(parents=True, exist_ok=True)
    for i in (1, 2):
        tg.write_shard(folder / f"mine_train_{i:06d}.bin", tg.synthetic_tokens(train_tokens, 50257, 50256, seed=i))
    tg.write_shard(folder / "mine_val_000000.bin", tg.synthetic_tokens(val_tokens, 50257, 50256, seed=9))
    return [f"--train_files={folder}/mine_train_*.bin", f"--val_files={folder}/mine_val_*.bin"]


def run_doctor(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k not in ("DATA_PATH", "NNODES")}
    env["CUDA_VISIBLE_DEVICES"] = ""  # CPU mode even where a GPU exists
    return subprocess.run([sys.executable, str(TOOLS / "doctor.py"), *args], capture_output=True, text=True, cwd=cwd, env=env, timeout=300)


def statuses(stdout: str) -> dict[str, str]:
    """check name -> status, from the report's check lines."""
    found = {}
    for line in stdout.splitlines():
        parts = line.split()
        if len(parts) >= 2 and parts[0] in ("ok", "warn", "fail", "skip"):
            found[parts[1]] = parts[0]
    return found


# ----- end to end, on this CPU machine -----


def test_cpu_mode_reports_the_smoke_run_and_skips_the_gpu_checks(tmp_path):
    result = run_doctor(cwd=tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr
    lines = result.stdout.splitlines()
    assert lines[0] == "doctor: Track 1 (train_gpt.py), 1 process, CPU mode (the smoke run)"
    found = statuses(result.stdout)
    assert list(found) == ["python", "torch", "numpy", "triton", "tiktoken", "huggingface_hub", "cuda", "gpus", "processes",
                           "attention", "mlp", "nccl", "shards", "torchrun", "disk", "expected"]
    assert all(found[name] == "skip" for name in GPU_CHECKS), found
    assert "fail" not in found.values()
    assert "ok    attention  train_gpt.py will use reference: a CPU run (FlexAttention has no CPU backward)" in lines
    assert "ok    mlp        train_gpt.py will use triton: a CPU run, where its wrapper runs the eager formula" in lines
    assert "ok    shards     the smoke preset writes its own synthetic shards (logs/smoke_shards_*/)" in lines
    assert any(line.startswith("doctor: the smoke run would start (") for line in lines)
    assert "  python train_gpt.py --preset=smoke" in result.stdout and "  python train_gpt_shampoo.py --preset=smoke" in result.stdout
    assert not (tmp_path / "logs").exists(), "doctor writes nothing"


def test_cpu_mode_track_3_checks_the_shampoo_package(tmp_path):
    result = run_doctor("--track", "3", "--nproc", "2", "--quick", cwd=tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr
    found = statuses(result.stdout)
    assert found["shampoo"] == "ok" and found["attention"] == "skip" and found["processes"] == "ok"
    assert "ok    processes  2 processes (gloo), 4 micro-steps each per step" in result.stdout.splitlines()


def test_own_shards_pass_and_a_corrupt_one_fails_the_run(tmp_path):
    flags = write_shards(tmp_path / "mine")
    good = run_doctor(*flags, cwd=tmp_path)
    assert good.returncode == 0, good.stdout
    (line,) = [line for line in good.stdout.splitlines() if line.startswith("ok    shards")]
    assert line.endswith("2 train shards, 600,000 tokens, 20,000 validation tokens, valid; "
                         "the run's 48 micro-batches (6 steps) fit in the first 1 (300,000 tokens)")

    corrupt = tmp_path / "mine" / "mine_train_000002.bin"
    corrupt.write_bytes(corrupt.read_bytes()[:-10])  # a half-downloaded file
    bad = run_doctor(*flags, cwd=tmp_path)
    assert bad.returncode == 1
    (line,) = [line for line in bad.stdout.splitlines() if line.startswith("fail  shards")]
    assert str(corrupt) in line and "truncated" in line
    assert "doctor: 1 check failed (shards): the smoke run would not start as it is" in bad.stdout


def test_a_bad_training_flag_is_a_failed_check_and_a_bad_doctor_flag_a_usage_error(tmp_path):
    result = run_doctor("--model_dim=99", cwd=tmp_path)
    assert result.returncode == 1
    assert result.stdout.splitlines() == [
        "fail  settings   train_gpt.py: --model_dim=99 must be a multiple of --num_heads=2 -> python train_gpt.py --help lists the flags",
        "doctor: 1 check failed (settings): the smoke run would not start as it is",
    ]
    assert run_doctor("--track", "2", cwd=tmp_path).returncode == 2
    assert run_doctor("stray", cwd=tmp_path).returncode == 2


# ----- shards and disk for a GPU run (no GPU needed: the plan is the record's) -----


def test_missing_record_shards_name_the_download(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("DATA_PATH", raising=False)
    check = dr.check_shards(plan())
    assert check.status == "fail" and "data/fineweb10B/fineweb_train_*.bin" in check.detail
    assert check.fix == "python data/cached_fineweb10B.py 9"
    assert dr.check_shards(plan(track=3)).fix == "python data/cached_fineweb10B.py 22"
    assert dr.check_shards(plan("--train_steps=5000")).fix == "python data/cached_fineweb10B.py 21"  # 5000 x 393,216 tokens + 1 shard


def test_too_few_training_tokens_fail_unless_the_files_cycle(tmp_path):
    flags = [*write_shards(tmp_path / "mine"), "--preset=smoke"]
    # 600,000 tokens of 20-200-token documents cut at 128 hold 2,575 micro-batches of 128 tokens, not 4,687
    short = dr.check_shards(plan(*flags, "--train_steps=400", gpu_mode=False))
    assert short.status == "fail" and "the run's 3,200 micro-batches (400 steps): the shards hold 2,575" in short.detail
    assert "check --train_files" in short.fix
    cycled = dr.check_shards(plan(*flags, "--train_steps=400", "--cycle_train_files=true", gpu_mode=False))
    assert cycled.status == "warn" and "repeats" in cycled.detail
    assert dr.check_shards(plan(*flags, "--train_steps=300", gpu_mode=False)).status == "ok"
    two_ranks = dr.check_shards(plan(*flags, "--train_steps=400", nproc=2, gpu_mode=False))  # 4 micro-batches of 2 rows a step
    assert "the run's 1,600 micro-batches (400 steps): the shards hold 1,287" in two_ranks.detail


@pytest.mark.parametrize("track", [1, 3])
def test_validation_shards_that_are_training_shards_are_the_scripts_own_message(tmp_path, track):
    train_flag, _ = write_shards(tmp_path / "mine")
    shard = tmp_path / "mine" / "mine_train_000001.bin"
    check = dr.check_shards(plan(train_flag, f"--val_files={shard}", "--preset=smoke", track=track, gpu_mode=False))
    assert check.status == "fail"
    assert check.detail == (f"{shard}: is a --val_files shard and a --train_files shard; validation on training data overstates "
                            f"the model: pass a --val_files pattern that matches only held-out shards")


@pytest.mark.parametrize("cycle", ["false", "true"])
def test_training_shards_without_a_bos_are_named_as_the_loader_names_them(tmp_path, cycle):
    """No document starts in them: doctor advised adding shards (or said they hold 0 micro-batches), which would not
    help. Now it says what train_gpt.py's loader stops the run with."""
    import torch

    tg = dr.training_module(dr.TRACKS[1])
    folder = tmp_path / "other"
    folder.mkdir()
    for i in (1, 2):  # GPT-2 ids but never its BOS (50256), as another tokenizer's shards would be
        tg.write_shard(folder / f"other_train_{i:06d}.bin", np.random.default_rng(i).integers(0, 50256, 300_000))
    tg.write_shard(folder / "other_val_000000.bin", tg.synthetic_tokens(20_000, 50257, 50256, seed=9))
    flags = [f"--train_files={folder}/other_train_*.bin", f"--val_files={folder}/other_val_*.bin"]
    p = plan(*flags, "--preset=smoke", f"--cycle_train_files={cycle}", gpu_mode=False)
    check = dr.check_shards(p)
    files = tg.resolve_files(p.hp.train_files, "train")
    loader = tg.TrainLoader(files, num_tokens_local=p.hp.train_batch_size // 8, max_seq_len=p.hp.train_max_seq_len, rank=0,
                            world_size=1, bos_token=50256, vocab_size=p.hp.vocab_size, cycle=cycle == "true",
                            device=torch.device("cpu"), with_cu_seqlens=False)
    with pytest.raises(tg.UserError) as info:
        next(loader)
    assert check.status == "fail" and check.detail == str(info.value) and check.fix == ""
    assert check.detail.startswith(f"none of the 2 --train_files shards read ({files[0]}, ...) holds a BOS token (50256, ")
    assert "tokenize the text again, or set --bos_token" in check.detail


def test_track3_vocabulary_mismatch_is_the_scripts_own_message(tmp_path):
    flags = write_shards(tmp_path / "mine")
    check = dr.check_shards(plan(*flags, "--preset=smoke", track=3, gpu_mode=False))  # smoke vocabulary 512 < GPT-2 ids
    assert check.status == "fail" and "--vocab_size=50304" in check.detail


def test_track3_short_validation_shard_is_the_scripts_own_message(tmp_path):
    flags = tiny_shards(tmp_path, (9000,))  # a 5,000-token validation shard; the smoke run validates on 4,096 + 2
    check = dr.check_shards(plan(*flags, "--preset=smoke", "--val_tokens=8192", track=3, gpu_mode=False))
    assert check.status == "fail"
    assert check.detail.endswith("t_val_000000.bin holds 5000 tokens, fewer than --val_tokens=8192 + 2; lower --val_tokens")


# ----- several machines: each reads its own copy of the shards, or writes its own smoke shards -----


def test_several_machines_get_a_fingerprint_of_the_shards_to_compare(tmp_path):
    flags = tiny_shards(tmp_path / "a", (3000, 7000))
    copy = tmp_path / "b"
    shutil.copytree(tmp_path / "a", copy)
    copy_flags = [flag.replace(str(tmp_path / "a"), str(copy)) for flag in flags]
    checks = [dr.check_shards(plan(*f, "--preset=smoke", "--bos_token=511", "--train_steps=5", nproc=1, nnodes=2, gpu_mode=False))
              for f in (flags, copy_flags)]
    prints = [check.detail.split("fingerprint ")[1].split(":")[0] for check in checks]
    assert all(check.status == "ok" for check in checks) and prints[0] == prints[1] and len(prints[0]) == 16
    assert checks[0].detail.endswith(": run this check on every machine, the fingerprints must match")
    shard = copy / "t_train_000001.bin"
    data = bytearray(shard.read_bytes())
    data[-1] ^= 1  # one token differs on the second machine
    shard.write_bytes(bytes(data))
    changed = dr.check_shards(plan(*copy_flags, "--preset=smoke", "--bos_token=511", "--train_steps=5", nproc=1, nnodes=2, gpu_mode=False))
    assert changed.status == "ok" and prints[0] not in changed.detail
    assert "fingerprint" not in dr.check_shards(plan(*flags, "--preset=smoke", "--bos_token=511", "--train_steps=5", gpu_mode=False)).detail


@pytest.mark.parametrize("track", [1, 3])
def test_smoke_shards_are_written_on_every_machine_where_the_script_runs(tmp_path, monkeypatch, track):
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("DATA_PATH", raising=False)
    where = "logs/smoke_shards_*/" if track == 1 else "data/smoke/v512/"
    two = dr.check_shards(plan("--preset=smoke", track=track, nnodes=2, gpu_mode=False))
    assert two.status == "ok" and two.detail == f"the smoke preset writes its own synthetic shards ({where}), on each of the 2 machines (the same bytes on each)"
    read_only = tmp_path / "ro"
    read_only.mkdir()
    real_access = os.access
    # a folder this process may not write (simulated: the tests may run as root, who may write anywhere)
    monkeypatch.setattr(dr.os, "access", lambda path, mode: Path(path) != read_only and real_access(path, mode))
    if track == 1:
        blocked = dr.check_shards(plan("--preset=smoke", f"--log_dir={read_only}/logs", track=1, gpu_mode=False))
        fix = "pass a --log_dir you can write to"
    else:
        monkeypatch.setenv("DATA_PATH", str(read_only))
        blocked = dr.check_shards(plan("--preset=smoke", track=3, gpu_mode=False))
        fix = "run from a folder you can write to, or set DATA_PATH"
    assert blocked.status == "fail" and blocked.detail.endswith(f"but {read_only} is not writable") and blocked.fix == fix
    assert dr.check_disk(plan("--preset=smoke", f"--log_dir={read_only}/logs", gpu_mode=False)).status == "fail"


def test_disk_counts_the_checkpoints(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    free = {"bytes": 500 * 2**30}
    monkeypatch.setattr(dr.shutil, "disk_usage", lambda path: types.SimpleNamespace(free=free["bytes"]))
    assert dr.check_disk(plan()).status == "ok" and "checkpoints off" in dr.check_disk(plan()).detail
    many = dr.check_disk(plan("--checkpoint_every=100"))  # 1680 // 100 + 1 = 17 checkpoints of about 3 GiB
    assert many.status == "ok" and "17 checkpoints of about 3.0 GiB" in many.detail
    free["bytes"] = 20 * 2**30
    assert dr.check_disk(plan("--checkpoint_every=100")).status == "warn"
    free["bytes"] = 2**29
    assert dr.check_disk(plan()).status == "warn"


# ----- versions -----


def test_triton_that_torch_was_not_built_for_fails(monkeypatch):
    monkeypatch.setattr(dr, "required_triton", lambda: "3.6.0")
    monkeypatch.setattr(dr, "version_of", lambda package: "3.9.0" if package == "triton" else None)
    check = dr.check_triton(gpus(1))
    assert check.status == "fail" and "3.9.0" in check.detail and check.fix == "pip install triton==3.6.0"
    monkeypatch.setattr(dr, "version_of", lambda package: None)
    assert dr.check_triton(gpus(1)).status == "fail" and dr.check_triton(CPU).status == "ok"


def test_torch_versions(monkeypatch):
    import torch

    for version, machine, expected in [("2.11.0+cu130", gpus(1), "ok"), ("2.13.0+cpu", CPU, "ok"), ("2.13.0+cu130", gpus(1), "warn"),
                                       ("2.10.0+cu128", gpus(1), "fail"), ("2.15.0", CPU, "warn")]:
        monkeypatch.setattr(torch, "__version__", version)
        assert dr.check_torch(machine).status == expected, version


def test_cuda_builds_drivers_and_hidden_gpus(monkeypatch):
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    cpu_build = dr.check_cuda(dr.Machine([], 8, "580.159.04", None))
    assert cpu_build.status == "fail" and "CPU build" in cpu_build.detail and "pip install torch==2.11.0" in cpu_build.fix
    old_driver = dr.check_cuda(gpus(1, driver="570.86.10"))
    assert old_driver.status == "fail" and "needs driver 580.65.06" in old_driver.detail
    assert dr.check_cuda(gpus(1)).status == "ok"
    assert dr.check_cuda(gpus(1, runtime="12.8", driver="570.86.10")).status == "warn"  # works, but not what we test
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    assert dr.check_cuda(dr.Machine([], 8, "580.159.04", "13.0")).status == "skip"


# ----- GPUs, processes, attention, speed on simulated machines -----


def test_gpu_memory_and_counts():
    assert dr.check_gpus(gpus(8), plan(nproc=8)).status == "ok"
    assert dr.check_gpus(gpus(8, free_gib=20), plan(nproc=8)).status == "fail"  # under the measured 31 GiB peak
    assert dr.check_gpus(gpus(8, free_gib=34), plan(nproc=8)).status == "warn"  # under the 35.9 GiB reserved
    assert dr.check_gpus(gpus(8, free_gib=33), plan(track=3, nproc=8)).status == "fail"  # Track 3 peaked at 33.3 GiB
    assert dr.check_gpus(gpus(1, free_gib=5), plan("--preset=smoke")).status == "ok"  # the record's peaks do not apply
    too_many = dr.check_gpus(gpus(2), plan(nproc=4))
    assert too_many.status == "fail" and too_many.fix.startswith("use --nproc 2")
    ampere = dr.check_gpus(gpus(1, name="NVIDIA A100-SXM4-80GB", capability=(8, 0)), plan())
    assert ampere.status == "warn" and "bf16" in ampere.detail  # Track 1's FP8 head needs sm_89
    assert dr.check_gpus(gpus(1, name="NVIDIA A100-SXM4-80GB", capability=(8, 0)), plan(track=3)).status == "ok"


def test_process_counts_must_divide_the_record_batch():
    assert dr.check_processes(plan(nproc=3)).fix == "use --nproc 2"
    two_nodes = dr.check_processes(plan(nproc=4, nnodes=2))
    assert two_nodes.status == "ok" and two_nodes.detail.startswith("2 nodes x 4 = 8 processes (NCCL), 1 micro-step each")
    assert dr.check_processes(plan(nproc=4, nnodes=3)).status == "fail"


def test_attention_backend_and_why(monkeypatch):
    import torch

    tg = dr.training_module(dr.TRACKS[1])
    monkeypatch.setattr(tg, "flash_attn_varlen_func", None)
    monkeypatch.setitem(sys.modules, "flash_attn_interface", None)  # import fails, as where FA3 is not installed
    monkeypatch.setattr(tg, "flash_attn_4_version", lambda: None)
    flex = dr.check_attention(gpus(1), plan(), quick=False)
    assert flex.status == "ok"
    assert flex.detail.startswith("train_gpt.py will use flex (FlexAttention): FlashAttention-3 does not import (")
    assert flex.detail.endswith(") and flash-attn-4 is not installed; our H200 measurements use it too")

    fake_fa3 = types.ModuleType("flash_attn_interface")
    fake_fa3.__file__ = "/opt/fa3/flash_attn_interface.py"
    monkeypatch.setitem(sys.modules, "flash_attn_interface", fake_fa3)
    monkeypatch.setattr(tg, "flash_attn_varlen_func", lambda *args, **kwargs: None)
    monkeypatch.setattr(dr, "_fa3_runs", lambda index: "no kernel image is available for execution on the device")
    broken = dr.check_attention(gpus(1, capability=(8, 0)), plan(), quick=False)
    assert broken.status == "fail" and "will use flash3 (FA3): flash_attn_interface imports (/opt/fa3/" in broken.detail
    assert "no kernel image" in broken.detail and broken.fix.startswith("pass --attention_backend=flex")
    assert dr.check_attention(gpus(1, capability=(8, 0)), plan(), quick=True).status == "warn"  # FA3 on sm_80: not tried
    monkeypatch.setattr(dr, "_fa3_runs", lambda index: None)
    assert dr.check_attention(gpus(1), plan(), quick=False).status == "ok"

    explicit = dr.check_attention(CPU, plan("--attention_backend=flex", gpu_mode=False), quick=True)
    assert explicit.status == "fail" and "FlexAttention has no CPU backward" in explicit.detail
    explicit = dr.check_attention(CPU, plan("--attention_backend=varlen", gpu_mode=False), quick=True)
    assert explicit.status == "fail" and "varlen_attn has no CPU kernel" in explicit.detail
    monkeypatch.setattr(dr, "_varlen_runs", lambda index: None)
    varlen = dr.check_attention(gpus(1), plan("--attention_backend=varlen"), quick=False)
    assert varlen.status == "ok" and varlen.detail.endswith("will use varlen (torch's varlen_attn, FlashAttention-2 kernels): "
                                                            "asked for, and its kernel runs on this GPU")
    assert dr.check_attention(gpus(1), plan("--attention_backend=varlen"), quick=True).detail.endswith("(kernel not tried with --quick)")
    monkeypatch.setattr(dr, "_varlen_runs", lambda index: "FlashAttention only supports Ampere GPUs or newer.")
    broken = dr.check_attention(gpus(1, capability=(8, 6)), plan("--attention_backend=varlen"), quick=False)
    assert broken.status == "fail" and broken.detail.endswith("but its kernel fails on this GPU (sm_86): FlashAttention only "
                                                              "supports Ampere GPUs or newer.")
    monkeypatch.setattr(tg, "flash_attn_4_installed", lambda: True)
    monkeypatch.setattr(tg, "flash_attn_4_version", lambda: tg.FLASH_ATTN_4_TESTED)
    monkeypatch.setattr(tg, "_fa4_interface", lambda: types.ModuleType("flash_attn.cute.interface"))
    monkeypatch.setattr(dr, "_fa4_runs", lambda index: None)
    fa4 = dr.check_attention(gpus(1), plan("--attention_backend=fa4"), quick=False)
    assert fa4.status == "ok" and fa4.detail.endswith("will use fa4 (flash-attn-4's kernels): asked for, and its kernel runs on this GPU")
    monkeypatch.setattr(tg, "flash_attn_4_version", lambda: "4.0.0b41")
    other = dr.check_attention(gpus(1), plan("--attention_backend=fa4"), quick=True)
    assert other.status == "warn" and other.fix.startswith("pass --attention_backend=flex, or (re)install flash-attn-4 4.0.0b40")
    assert other.detail.endswith("asked for; flash-attn-4 4.0.0b41 is installed, and 4.0.0b40 is the version its private functions "
                                 "were tested with (kernel not tried with --quick)")
    monkeypatch.setattr(tg, "flash_attn_4_version", lambda: tg.FLASH_ATTN_4_TESTED)
    assert dr.check_attention(gpus(1), plan("--attention_backend=fa4"), quick=True).detail.endswith("(kernel not tried with --quick)")
    monkeypatch.setattr(dr, "_fa4_runs", lambda index: "Unsupported compute capability")
    broken = dr.check_attention(gpus(1), plan("--attention_backend=fa4"), quick=False)
    assert broken.status == "fail" and broken.detail.endswith("but its kernel fails on this GPU (sm_90): Unsupported compute capability")
    assert broken.fix == f"pass --attention_backend=flex, or (re)install flash-attn-4 {tg.FLASH_ATTN_4_TESTED} (README.md#install)"
    monkeypatch.setattr(tg, "flash_attn_4_version", lambda: None)  # not installed
    missing = dr.check_attention(gpus(1), plan("--attention_backend=fa4"), quick=True)
    assert missing.status == "fail" and "needs flash-attn-4 (4.0.0b40 is the tested version" in missing.detail
    turing = dr.check_attention(gpus(1, capability=(7, 5)), plan("--attention_backend=varlen"), quick=True)
    assert turing.status == "fail" and "needs compute capability 8.0 or newer" in turing.detail
    assert torch.cuda.is_available() or dr.check_attention(CPU, plan(gpu_mode=False), quick=True).status == "ok"


def test_attention_auto_takes_fa4_on_sm90_with_the_tested_version(monkeypatch):
    tg = dr.training_module(dr.TRACKS[1])
    monkeypatch.setattr(tg, "flash_attn_varlen_func", None)
    monkeypatch.setitem(sys.modules, "flash_attn_interface", None)
    version = tg.FLASH_ATTN_4_TESTED
    monkeypatch.setattr(tg, "flash_attn_4_version", lambda: version)
    monkeypatch.setattr(tg, "_fa4_interface", lambda: types.ModuleType("flash_attn.cute.interface"))
    monkeypatch.setattr(dr, "_fa4_runs", lambda index: None)
    auto = dr.check_attention(gpus(1), plan(), quick=False)
    assert auto.status == "ok" and auto.detail == ("train_gpt.py will use fa4 (flash-attn-4's kernels): flash-attn-4 4.0.0b40 is "
                                                   "installed and FA3 is not, on sm_90 (measured faster than flex on an H100), and its kernel runs on this GPU")
    blackwell = dr.check_attention(gpus(1, name="NVIDIA B200", capability=(10, 0)), plan(), quick=True)
    assert blackwell.status == "ok" and blackwell.detail.endswith(
        ") and fa4 is measured on sm_90 only, this GPU is sm_100 (--attention_backend=fa4 takes it anyway); our H200 measurements use it too")
    ada = dr.check_attention(gpus(1, name="NVIDIA L40S", capability=(8, 9)), plan(), quick=True)
    assert ada.detail.endswith(") and flash-attn-4's kernels need sm_90 or newer, this GPU is sm_89; our H200 measurements use it too")
    version = "4.0.0b41"
    other = dr.check_attention(gpus(1), plan(), quick=True)
    assert other.status == "ok" and "will use flex" in other.detail
    assert "and flash-attn-4 4.0.0b41 is not the tested 4.0.0b40 (--attention_backend=fa4 takes it anyway)" in other.detail
    untested = dr.check_expected_speed(gpus(1, name="NVIDIA H100 80GB HBM3"), plan("--attention_backend=fa4"))
    assert untested.status == "skip" and untested.detail.startswith("no measurement for 1 x NVIDIA H100 80GB HBM3 with fa4 4.0.0b41")
    version = tg.FLASH_ATTN_4_TESTED

    def broken_install() -> None:
        raise ImportError("libcute_dsl_runtime.so: cannot open shared object file")

    monkeypatch.setattr(tg, "_fa4_interface", broken_install)
    for requested in ("auto", "fa4"):  # auto would fail the same way: the fix is flex, which runs on every GPU
        refused = dr.check_attention(gpus(1), plan(f"--attention_backend={requested}"), quick=True)
        assert refused.status == "fail" and refused.fix == "pass --attention_backend=flex"
        assert refused.detail.startswith(f"--attention_backend={requested}: flash-attn-4 is installed but does not import (libcute_dsl_runtime.so")
    assert dr.check_expected_speed(gpus(1, name="NVIDIA H100 80GB HBM3"), plan()).detail == "the attention backend or the MLP kernel cannot run here (see attention, mlp)"


def test_mlp_kernel_says_which_and_why_and_refuses_in_one_line(monkeypatch):
    tg = dr.training_module(dr.TRACKS[1])
    installed: str | None = None
    monkeypatch.setattr(tg, "quack_version", lambda: installed)
    monkeypatch.setattr(tg, "_quack_relu2_epilogues", lambda: (None, None))
    triton = dr.check_mlp_kernel(gpus(1), plan())
    assert (triton.status, triton.detail) == ("ok", "train_gpt.py will use triton (the Triton kernel, the same bytes): "
                                                     "quack-kernels is not installed (flash-attn-4 brings it)")
    installed = tg.QUACK_TESTED
    quack = dr.check_mlp_kernel(gpus(1), plan())
    assert (quack.status, quack.detail) == ("ok", "train_gpt.py will use quack (quack-kernels' GEMMs with train_gpt.py's ReLU² epilogues): "
                                                   "quack-kernels 0.6.5 is installed, on sm_90 (measured faster than the Triton kernel on an H100)")
    assert dr.check_mlp_kernel(gpus(1, capability=(10, 0)), plan()).detail.endswith("the quack kernel is measured on sm_90 only, this GPU is sm_100")
    refused = dr.check_mlp_kernel(gpus(1, capability=(10, 0)), plan("--mlp_kernel=quack"))
    assert (refused.status, refused.fix) == ("fail", "pass --mlp_kernel=triton")
    assert refused.detail == "--mlp_kernel=quack needs compute capability 9.x (quack-kernels' Hopper GEMMs); this GPU is sm_100: use auto or triton"
    assert dr.check_expected_speed(gpus(1, capability=(10, 0)), plan("--mlp_kernel=quack")).status == "skip"
    installed = "0.6.6"
    assert dr.check_mlp_kernel(gpus(1), plan()).detail.endswith("quack-kernels 0.6.6 is not the tested 0.6.5")
    assert dr.check_mlp_kernel(gpus(1), plan("--mlp_kernel=triton")).detail.endswith("(the Triton kernel, the same bytes): asked for")
    assert dr.check_mlp_kernel(gpus(1), plan(track=3)) is None  # Track 3 has no --mlp_kernel


def test_expected_speed_only_for_a_measured_gpu_and_the_record_configuration(monkeypatch):
    tg = dr.training_module(dr.TRACKS[1])
    monkeypatch.setattr(tg, "flash_attn_varlen_func", None)
    monkeypatch.setattr(tg, "flash_attn_4_version", lambda: None)
    one = dr.check_expected_speed(gpus(1), plan())
    assert one.status == "ok" and one.detail.startswith("579 ms/step on NVIDIA H200 (1 GPU, 8 micro-steps, FlexAttention; 629e1fa, 2026-12-06), "
                                                        "so 1680 steps take about 16 min")
    assert one.detail.endswith("measured on the docs_proxy shards, torch 2.11.0+cu130, Triton 3.6.0, driver 580.159.04")
    two = dr.check_expected_speed(gpus(2), plan(nproc=2))
    assert two.detail.startswith("284 ms/step") and "0.49x" in two.detail  # 283.6-283.8: one figure once rounded
    h100 = dr.check_expected_speed(gpus(1, name="NVIDIA H100 80GB HBM3"), plan())
    assert h100.status == "ok" and h100.detail.startswith("605-615 ms/step on NVIDIA H100 80GB HBM3 (1 GPU, 8 micro-steps, FlexAttention; 629e1fa")
    monkeypatch.setattr(tg, "flash_attn_4_version", lambda: tg.FLASH_ATTN_4_TESTED)  # auto takes fa4 on sm_90
    monkeypatch.setattr(tg, "_fa4_interface", lambda: types.ModuleType("flash_attn.cute.interface"))
    without_quack = dr.check_expected_speed(gpus(1, name="NVIDIA H100 80GB HBM3"), plan())  # the entry ran with quack's MLP kernel
    assert without_quack.status == "skip" and without_quack.detail.startswith(
        "no measurement for 1 x NVIDIA H100 80GB HBM3 with fa4 with the triton MLP kernel (we have: ")
    monkeypatch.setattr(tg, "quack_version", lambda: tg.QUACK_TESTED)  # flash-attn-4 brings it; auto takes it on sm_90
    monkeypatch.setattr(tg, "_quack_relu2_epilogues", lambda: (None, None))
    fa4 = dr.check_expected_speed(gpus(1, name="NVIDIA H100 80GB HBM3"), plan())
    assert fa4.status == "ok" and fa4.detail.startswith("576-593 ms/step on NVIDIA H100 80GB HBM3 (1 GPU, 8 micro-steps, flash-attn-4 4.0.0b40 and quack-kernels 0.6.5; d54e085")
    flex_with_quack = dr.check_expected_speed(gpus(1, name="NVIDIA H100 80GB HBM3"), plan("--attention_backend=flex"))
    assert flex_with_quack.detail.startswith("no measurement for 1 x NVIDIA H100 80GB HBM3 with flex with the quack MLP kernel")
    flex = dr.check_expected_speed(gpus(1, name="NVIDIA H100 80GB HBM3"), plan("--attention_backend=flex", "--mlp_kernel=triton"))
    assert flex.detail.startswith("605-615 ms/step")
    h200_fa4 = dr.check_expected_speed(gpus(1), plan())
    assert h200_fa4.status == "skip" and h200_fa4.detail.startswith("no measurement for 1 x NVIDIA H200 with fa4 (we have: ")
    monkeypatch.setattr(tg, "flash_attn_4_version", lambda: None)
    monkeypatch.setattr(tg, "quack_version", lambda: None)  # gone with flash-attn-4
    assert dr.check_expected_speed(gpus(1), plan(track=3)).detail.startswith("1,423 ms/step")
    assert dr.check_expected_speed(gpus(2), plan(track=3, nproc=2)).detail.startswith("715 ms/step")
    assert dr.check_expected_speed(gpus(8), plan(nproc=8)).status == "skip"  # not measured
    other = dr.check_expected_speed(gpus(1, name="NVIDIA A100-SXM4-80GB"), plan())
    assert other.status == "skip" and "no measurement for 1 x NVIDIA A100-SXM4-80GB" in other.detail
    changed = dr.check_expected_speed(gpus(1), plan("--model_dim=512", "--num_heads=4"))
    assert changed.status == "skip" and "--model_dim, --num_heads change the work per step" in changed.detail
    assert dr.check_expected_speed(gpus(1), plan("--val_loss_every=50", "--train_steps=200")).status == "ok"
    assert dr.check_expected_speed(gpus(1), plan(nproc=1, nnodes=2)).status == "skip"
    smoke = dr.check_expected_speed(gpus(1), plan("--preset=smoke"))
    assert smoke.status == "skip" and "--preset" in smoke.detail


def test_all_reduce_skips():
    assert dr.check_all_reduce(CPU, plan(gpu_mode=False), quick=False).status == "skip"
    assert dr.check_all_reduce(gpus(1), plan(), quick=False).detail.startswith("1 process per node")
    assert dr.check_all_reduce(gpus(2), plan(nproc=2), quick=True).detail == "--quick"


@pytest.mark.slow
def test_all_reduce_machinery_with_two_gloo_processes():
    """The processes, rendezvous, sums and timing of the NCCL check, run with gloo on the CPU."""
    passed, summary = dr.all_reduce(2, "gloo", numel=1 << 16)
    assert passed, summary
    assert summary.startswith("2 processes, 0 MiB: correct sums, bus bandwidth ")


def test_all_reduce_reports_a_failing_rank():
    passed, summary = dr.all_reduce(2, "no_such_backend", numel=16, timeout_s=60)
    assert not passed and summary.startswith("rank 0 failed: ")


# ----- the data walk counts exactly what the scripts' loaders serve -----


def tiny_shards(folder: Path, sizes: tuple[int, ...], vocab: int = 512) -> list[str]:
    import train_gpt as tg

    folder.mkdir(parents=True, exist_ok=True)
    for i, size in enumerate(sizes, start=1):
        tg.write_shard(folder / f"t_train_{i:06d}.bin", tg.synthetic_tokens(size, vocab, vocab - 1, seed=i))
    tg.write_shard(folder / "t_val_000000.bin", tg.synthetic_tokens(5000, vocab, vocab - 1, seed=0))
    return [f"--train_files={folder}/t_train_*.bin", f"--val_files={folder}/t_val_*.bin", "--vocab_size=512"]


@pytest.mark.parametrize("nproc", [1, 2])
def test_track1_walk_matches_the_loader(tmp_path, nproc):
    import torch
    import train_gpt as tg

    flags = tiny_shards(tmp_path, (3000, 130, 7000, 2500))  # the 130-token shard holds no full batch
    p = plan(*flags, "--preset=smoke", "--bos_token=511", "--train_steps=1000", nproc=nproc, gpu_mode=False)
    files = tg.resolve_files(p.hp.train_files, "train")
    found, shards_read, tokens_read = dr._walk_track1(p, files, needed=10**9)
    local = p.hp.train_batch_size // 8
    sizes = dict(num_tokens_local=local, max_seq_len=p.hp.train_max_seq_len, rank=0, world_size=nproc)
    loader = tg.TrainLoader(files, **sizes, bos_token=511, vocab_size=512, cycle=False, device=torch.device("cpu"), with_cu_seqlens=False)
    served = 0
    with pytest.raises(tg.UserError, match="exhausted"):
        while True:
            next(loader)
            served += 1
    assert found == served > 0 and shards_read == 4 and tokens_read == 3000 + 130 + 7000 + 2500
    assert dr._walk_track1(p, files, needed=3)[:2] == (3, 1)  # stops as soon as it has enough


def test_track3_walk_matches_the_loader(tmp_path):
    import torch
    import train_gpt_shampoo as tgs

    flags = tiny_shards(tmp_path, (5000, 2049, 2050, 9000))  # smoke batches are 2048 tokens (+2 to fit)
    p = plan(*flags, "--preset=smoke", "--train_steps=1000", track=3, gpu_mode=False)
    files = tgs.resolve_files(p.hp.train_files, "train")
    found, shards_read, _ = dr._walk_track3(p, files, needed=10**9)
    loader = tgs.TokenLoader(files, batch_tokens=8 * p.hp.micro_batch_seqs * p.hp.seq_len, seq_len=p.hp.seq_len, rank=0,
                             world_size=1, vocab_size=512, device=torch.device("cpu"))
    served = 0
    with pytest.raises(tgs.UserError, match="out of training data"):
        while True:
            loader.next_batch()
            served += 1
    assert found == served == 2 + 0 + 1 + 4 and shards_read == 4


def test_without_torch_doctor_says_what_to_install(monkeypatch, capsys):
    real_find_spec = dr.importlib.util.find_spec
    monkeypatch.setattr(dr.importlib.util, "find_spec", lambda name: None if name == "torch" else real_find_spec(name))
    monkeypatch.setattr(dr, "gpus_listed", lambda: False)
    assert dr.main([]) == 1
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("ok    python")
    assert lines[1] == ("fail  torch      not installed; the training scripts need it -> pip install torch==2.13.0 "
                        "--index-url https://download.pytorch.org/whl/cpu && pip install -r requirements.txt")
    assert [line.split()[:2] for line in lines[2:6]] == [["ok", "numpy"], ["ok", "triton"], ["ok", "tiktoken"], ["ok", "huggingface_hub"]]
    assert lines[6] == "doctor: 1 check failed (torch): the run would not start as it is"
    monkeypatch.setattr(dr, "gpus_listed", lambda: True)  # a CUDA machine gets the CUDA build's command
    assert dr.main([]) == 1
    assert capsys.readouterr().out.splitlines()[1].endswith("-> pip install torch==2.11.0 -r requirements.txt")


# ----- broken installs: a package that raises on import (issue 39, N40/N41) -----

BROKEN = "raise RuntimeError('broken on purpose')\n"


def run_doctor_with(fakes: dict[str, str], *args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    """doctor with a folder of fake top-level modules first on PYTHONPATH (each raises on import as given)."""
    fake_dir = cwd / "fake_site"
    fake_dir.mkdir(exist_ok=True)
    for name, body in fakes.items():
        (fake_dir / name).mkdir(exist_ok=True)
        (fake_dir / name / "__init__.py").write_text(body)
    env = {k: v for k, v in os.environ.items() if k not in ("DATA_PATH", "NNODES")}
    env.update(CUDA_VISIBLE_DEVICES="", PYTHONPATH=str(fake_dir))
    return subprocess.run([sys.executable, str(TOOLS / "doctor.py"), *args], capture_output=True, text=True, cwd=cwd, env=env, timeout=300)


@pytest.mark.parametrize("name", ["torch", "numpy"])
def test_a_torch_or_numpy_that_raises_on_import_is_one_failed_line(tmp_path, name):
    result = run_doctor_with({name: BROKEN}, cwd=tmp_path)
    assert result.returncode == 1 and result.stderr == "", result.stderr
    lines = result.stdout.splitlines()
    assert f"fail  {name:<10} its import fails: RuntimeError: broken on purpose; the training scripts" in lines[[line.split()[1] for line in lines[:-1]].index(name)]
    assert [line.split()[1] for line in lines[:-1]] == ["python", "torch", "numpy", "triton", "tiktoken", "huggingface_hub"]
    failed = "1 check failed (torch)" if name == "torch" else "2 checks failed (torch, numpy)"  # torch imports numpy
    assert lines[-1] == f"doctor: {failed}: the run would not start as it is"


def test_a_triton_that_raises_on_import_fails_and_one_that_raises_import_error_warns_on_cpu(tmp_path):
    broken = run_doctor_with({"triton": BROKEN}, cwd=tmp_path)
    assert broken.returncode == 1 and broken.stderr == ""
    (line,) = [line for line in broken.stdout.splitlines() if line.split()[1:2] == ["triton"]]
    assert line.startswith("fail  triton     its import fails: RuntimeError: broken on purpose; train_gpt.py imports it at start -> ")

    missing_library = run_doctor_with({"triton": "raise ImportError('libcuda.so.1: cannot open shared object file')\n"}, "--quick", cwd=tmp_path)
    assert missing_library.returncode == 0, missing_library.stdout  # train_gpt.py runs without Triton on CPU
    (line,) = [line for line in missing_library.stdout.splitlines() if line.split()[1:2] == ["triton"]]
    assert line.startswith("warn  triton     its import fails: ImportError: libcuda.so.1: cannot open shared object file; "
                           "the scripts run without it on CPU")


def test_broken_data_packages_warn_and_the_run_still_starts(tmp_path):
    result = run_doctor_with({"tiktoken": BROKEN, "huggingface_hub": "import no_such_dependency\n"}, "--quick", cwd=tmp_path)
    assert result.returncode == 0, result.stdout
    lines = result.stdout.splitlines()
    assert "warn  tiktoken   its import fails: RuntimeError: broken on purpose; data/fineweb.py needs it (training does not) -> pip install torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu && pip install -r requirements.txt" in lines
    assert any(line.startswith("warn  huggingface_hub its import fails: ModuleNotFoundError: No module named 'no_such_dependency'; "
                               "data/cached_fineweb*.py needs it") for line in lines)


def test_an_import_that_kills_the_interpreter_is_reported(tmp_path, monkeypatch):
    fake_dir = tmp_path / "fake_site"
    (fake_dir / "crashing_package").mkdir(parents=True)
    (fake_dir / "crashing_package" / "__init__.py").write_text("import os, signal\nos.kill(os.getpid(), signal.SIGKILL)\n")
    monkeypatch.syspath_prepend(str(fake_dir))  # found here,
    monkeypatch.setenv("PYTHONPATH", str(fake_dir))  # and imported by the child
    errors = dr.import_errors(["json", "no_such_package_at_all", "crashing_package"])
    assert errors == {"no_such_package_at_all": "not installed", "crashing_package": "its import kills the interpreter (exit status -9)"}


def test_versions_and_torchs_triton_pin(monkeypatch):
    assert dr.release("2.11.0+cu130") == (2, 11, 0) and dr.release("580.159.04") > dr.release("580.65.06")
    assert dr.release("unknown") is None
    monkeypatch.setattr(dr.importlib.metadata, "requires", lambda name: [
        "filelock", 'nvidia-nccl-cu13==2.28.3; platform_system == "Linux"', 'triton==3.6.0; platform_system == "Linux"'])
    assert dr.required_triton() == "3.6.0"
    monkeypatch.setattr(dr.importlib.metadata, "requires", lambda name: ["filelock", 'opt-einsum>=3.3; extra == "opt-einsum"'])
    assert dr.required_triton() is None  # a CPU build pins none


@pytest.mark.parametrize("nnodes", ["abc", "-1", "2.5", "0"])  # 0 once got "--nproc and --nnodes must be at least 1"
def test_a_bad_nnodes_variable_is_one_line(tmp_path: Path, nnodes: str) -> None:
    env = {k: v for k, v in os.environ.items() if k != "DATA_PATH"}
    env.update(CUDA_VISIBLE_DEVICES="", NNODES=nnodes)
    result = subprocess.run([sys.executable, str(TOOLS / "doctor.py"), "--quick"], capture_output=True, text=True, cwd=tmp_path, env=env, timeout=300)
    assert result.returncode == 2
    assert result.stderr.strip().splitlines()[-1] == f"tools/doctor.py: error: NNODES={nnodes!r}: give the number of machines in the run, e.g. NNODES=2"
