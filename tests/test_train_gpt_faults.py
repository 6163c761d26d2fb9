"""Faults and bad input in train_gpt.py (Track 1) and train_gpt_shampoo.py (Track 3), issue 12: one test per
reported case (named after it), plus the non-finite check's lag and Track 3's validation check."""

import base64
import dataclasses
import math
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.distributed as dist

import train_gpt as tg
import train_gpt_shampoo as tgs
from conftest import ROOT, free_port, make_shards, signal_when, tiny_args

SCRIPT = ROOT / "train_gpt.py"
NON_FINITE_TRAIN = re.compile(r"step (\d+): non-finite training loss \((nan|inf|-inf)\); stopping")


def script_env() -> dict[str, str]:
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "DATA_PATH", "TORCHELASTIC_ERROR_FILE"):
        env.pop(key, None)
    return env


def run_track1(args: list[str], timeout: int = 300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True, timeout=timeout, env=script_env(), cwd=ROOT)


def only_log(log_dir: Path) -> Path:
    (log,) = list(log_dir.glob("*.txt"))
    return log


@pytest.fixture
def one_process_group():
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def track3_main(capsys: pytest.CaptureFixture, *args: str) -> tuple[int, list[str]]:
    """Exit status and stderr lines of train_gpt_shampoo.py's main, run in this process."""
    with pytest.raises(SystemExit) as exit_info:
        tgs.main(list(args))
    return exit_info.value.code, capsys.readouterr().err.splitlines()


HUGE_TRACK3_LRS = [f"--{name}=1e6" for name in ("adam_embed_lr", "adam_head_lr", "adam_scalar_lr", "matrix_lr")]


# ----- row 1: learning rates of 1e6 in train_gpt.py --preset=smoke -----


def test_track1_diverging_run_stops_with_one_line_and_status_3(tiny_shards, tmp_path):
    train_files, val_files = tiny_shards
    args = tiny_args(train_files, val_files, tmp_path / "logs", adam_lr=1e6, muon_lr=1e6, warmup_steps=0, val_loss_every=0)
    result = run_track1(args)
    assert result.returncode == 3, result.stderr[-2000:]
    lines = result.stderr.splitlines()
    assert len(lines) == 1 and NON_FINITE_TRAIN.fullmatch(lines[0]), result.stderr
    assert only_log(tmp_path / "logs").read_text().splitlines()[-1] == lines[0]


# ----- rows 2 and 3: the same in train_gpt_shampoo.py, with the AdamW ablation and with Shampoo -----


def test_track3_adamw_diverging_run_stops_with_one_line_and_status_3(workdir, capsys):
    status, lines = track3_main(capsys, "--preset=smoke", "--matrix_optimizer=adamw", "--train_steps=8", *HUGE_TRACK3_LRS)
    assert status == 3 and len(lines) == 1 and NON_FINITE_TRAIN.fullmatch(lines[0]), lines
    (log,) = (workdir / "logs").glob("*.txt")
    assert log.read_text().splitlines()[-1] == lines[0]


def test_track3_shampoo_diverging_run_stops_with_one_line_and_status_3(workdir, capsys):
    status, lines = track3_main(capsys, "--preset=smoke", "--train_steps=8", *HUGE_TRACK3_LRS)
    assert status == 3 and len(lines) == 1, lines
    assert re.fullmatch(r"step \d+: (non-finite training loss \((nan|inf|-inf)\)|Shampoo: .+); stopping", lines[0]), lines
    (log,) = (workdir / "logs").glob("*.txt")
    assert log.read_text().splitlines()[-1] == lines[0]


def test_track3_shampoo_finding_is_reported_at_script_level(workdir, capsys, monkeypatch):
    """Shampoo's PreconditionerValueError (here raised at its second step) names the step and the parameter."""
    from distributed_shampoo.shampoo_types import PreconditionerValueError

    original_step, calls = tgs.DistributedShampoo.step, []

    def failing_step(self, *args, **kwargs):
        calls.append(1)
        if len(calls) == 2:
            raise PreconditionerValueError(
                "Encountered nan/inf values in factor matrix 3.block_0.0! To mitigate, check if nan inputs are being passed.\n"
                "For debugging purposes, factor_matrix 3.block_0.0: torch.min(matrix)=tensor(nan)"
            )
        return original_step(self, *args, **kwargs)

    monkeypatch.setattr(tgs.DistributedShampoo, "step", failing_step)
    status, lines = track3_main(capsys, "--preset=smoke", "--train_steps=4")
    assert status == 3
    expected = "step 2: Shampoo: Encountered nan/inf values in factor matrix 3.block_0.0! (blocks.0.attn.proj.weight); stopping"
    assert lines == [expected]
    (log,) = (workdir / "logs").glob("*.txt")
    assert log.read_text().splitlines()[-1] == expected


def test_track3_non_finite_validation_loss_stops(workdir, capsys, monkeypatch):
    original, calls = tgs.evaluate, []

    def evaluate_then_nan(*args):
        calls.append(1)
        return original(*args) if len(calls) == 1 else math.nan

    monkeypatch.setattr(tgs, "evaluate", evaluate_then_nan)
    status, lines = track3_main(capsys, "--preset=smoke", "--matrix_optimizer=adamw", "--train_steps=4", "--val_every=2")
    assert status == 3 and lines == ["step 2: non-finite validation loss (nan); stopping"]


@pytest.mark.parametrize("module", [tg, tgs], ids=["track1", "track3"])
def test_loss_check_reads_each_step_lag_steps_late_and_agrees_on_stops(module):
    health = module.StepHealth(torch.device("cpu"), world_size=1, lag=2)
    losses = [1.0, 2.0, 3.0, math.inf, 5.0]
    for step, loss in enumerate(losses[:3]):
        health.push(step, torch.tensor(loss), stop_requested=step == 2)
        assert health.poll(keep=2) is False  # steps 0 and 1 are read once two newer ones exist
    assert health.poll(keep=0) is True  # draining reads step 2 and its stop request
    health.push(3, torch.tensor(losses[3]), False)
    health.push(4, torch.tensor(losses[4]), False)
    assert health.poll(keep=2) is False
    health.push(5, torch.tensor(6.0), False)
    with pytest.raises(module.RunStopped, match=r"^step 4: non-finite training loss \(inf\); stopping$"):
        health.poll(keep=2)


# ----- row 4: data/fineweb.py --shard-size 8192 on a small corpus -----


def tokenize_small_corpus(tmp_path: Path) -> list[Path]:
    """Documents of 1000, 20000 and 40 x 150 single-byte tokens (plus EOT each) in 8192-token shards: the first
    train shard lies inside the long document (no BOS) and the last one is short."""
    from fineweb import tokenize_corpus

    bpe = tmp_path / "bytes.tiktoken"  # single-byte tokens only: one token per character
    bpe.write_text("".join(f"{base64.b64encode(bytes([value])).decode()} {value}\n" for value in range(256)))
    rng = np.random.default_rng(0)
    documents = ["".join(rng.choice(list("xyzqkvw"), size)) for size in [1000, 20000] + [150] * 40]
    paths = tokenize_corpus(documents, tmp_path / "shards", "small", shard_size=8192, bpe_file=bpe, workers=1)
    return sorted(path for path in paths if "_train_" in path.name)


def test_every_shard_fineweb_py_writes_is_read_by_both_scripts(tmp_path):
    train = tokenize_small_corpus(tmp_path)
    tokens = [tg.read_shard(str(path), tg.GPT2_VOCAB_SIZE) for path in train]
    assert not (tokens[0] == 50256).any() and (tokens[-1] == 50256).any()  # the case as reported
    assert tokens[-1].size < 4096 + 2  # shorter than the Track 3 batch below

    track1 = tg.TrainLoader(
        [str(p) for p in train], num_tokens_local=256, max_seq_len=128, rank=0, world_size=1, bos_token=50256,
        vocab_size=tg.GPT2_VOCAB_SIZE, cycle=False, device=torch.device("cpu"), with_cu_seqlens=True,
    )
    batches = []
    with pytest.raises(tg.UserError, match="training data exhausted"):
        while True:
            batches.append(next(track1))
    assert len(batches) >= 4 and all(batch.inputs[0] == 50256 for batch in batches)

    track3 = tgs.TokenLoader(train, batch_tokens=4096, seq_len=64, rank=0, world_size=1, vocab_size=50304, device=torch.device("cpu"))
    served = []
    with pytest.raises(tgs.UserError, match="out of training data"):
        while True:
            served.append(track3.next_batch()[0])
    assert len(served) == 2  # one from each full train shard, none from the short last one


# ----- row 5: SIGKILL while train_gpt.py writes its smoke shards; two smoke runs at once (and issue 38 item 7) -----
ONE_CPU_PROCESS = tg.Runtime(rank=0, world_size=1, local_rank=0, device=torch.device("cpu"))


def smoke_hp(log_dir: Path) -> tg.Hyperparameters:
    hp, _ = tg.parse_args(["--preset=smoke", f"--log_dir={log_dir}"])
    return hp


def test_smoke_shards_survive_a_killed_writer_and_a_concurrent_run(tmp_path, one_process_group, monkeypatch, capsys):
    hp = smoke_hp(tmp_path / "logs")
    train_pattern, _ = tg.smoke_shards(hp, ONE_CPU_PROCESS, time.time())
    folder = Path(train_pattern).parent
    (folder / "smoke_train_000002.bin").write_bytes(b"")  # what a writer killed by SIGKILL used to leave
    dead = folder / ".smoke_val_000000.bin.4242.0123abcd.tmp"  # what a writer killed by SIGKILL leaves now
    live = folder / ".smoke_val_000000.bin.4343.4567cdef.tmp"  # a live writer's: it holds the lock
    dead.write_bytes(b"half")
    live.write_bytes(b"half")
    for path in (dead, live):
        os.utime(path, (time.time() - 60, time.time() - 60))
    with open(live, "rb") as held:
        tg.fcntl.flock(held, tg.fcntl.LOCK_EX)
        train_pattern, val_pattern = tg.smoke_shards(hp, ONE_CPU_PROCESS, time.time())
    files = tg.resolve_files(train_pattern, "train")
    assert all(tg.read_shard(path, hp.vocab_size).size > 0 for path in files)
    out = capsys.readouterr().out.splitlines()
    assert f"smoke shards: rewriting {folder / 'smoke_train_000002.bin'}, whose bytes are not this smoke run's" in out
    assert f"smoke shards: removed {dead}, the temporary file of a killed writer" in out
    assert not dead.exists() and live.exists()
    live.unlink()

    # a second run writes the same shard between this run's check and its write
    other = smoke_hp(tmp_path / "race")
    original, interleaved = tg.synthetic_tokens, []

    def racing_tokens(*args, **kwargs):
        if not interleaved:
            interleaved.append(1)
            tg.smoke_shards(other, ONE_CPU_PROCESS, time.time())
        return original(*args, **kwargs)

    monkeypatch.setattr(tg, "synthetic_tokens", racing_tokens)
    train_pattern, val_pattern = tg.smoke_shards(other, ONE_CPU_PROCESS, time.time())
    assert interleaved and len(tg.resolve_files(train_pattern, "train")) == 2
    for path in tg.resolve_files(train_pattern, "train") + tg.resolve_files(val_pattern, "val"):
        tg.read_shard(path, hp.vocab_size)
    assert not [p for p in Path(train_pattern).parent.iterdir() if p.name.startswith(".")]  # no temporary files left


# ----- row 6: a bad training shard leaves a header-only log -----


def test_track1_bad_training_shard_is_refused_before_the_log_exists(tmp_path):
    train_files, val_files = make_shards(tmp_path / "data")
    bad = sorted(Path(p) for p in tg.resolve_files(train_files, "train"))[1]
    bad.write_bytes(bad.read_bytes()[:-100])
    result = run_track1(tiny_args(train_files, val_files, tmp_path / "logs"))
    assert not list((tmp_path / "logs").glob("*.txt"))
    assert result.returncode == 2
    assert result.stderr.splitlines() == [result.stderr.strip()] and str(bad) in result.stderr
    assert "regenerate it with data/fineweb.py" in result.stderr


def test_track3_bad_training_shard_is_refused_before_the_log_exists(workdir, capsys):
    folder = workdir / "data" / "smoke"
    folder.mkdir(parents=True)
    for name, tokens in tgs.smoke_tokens(512).items():
        tgs.write_shard(folder / name, tokens)
    bad = folder / "smoke_train_000002.bin"
    bad.write_bytes(bad.read_bytes()[:-100])
    status, lines = track3_main(capsys, "--preset=smoke", "--matrix_optimizer=adamw",
                                "--train_files=data/smoke/smoke_train_*.bin", "--val_files=data/smoke/smoke_val_*.bin")
    assert not (workdir / "logs").exists() or not list((workdir / "logs").glob("*.txt"))
    assert status == 2 and len(lines) == 1 and str(bad.relative_to(workdir)) in lines[0]


# ----- validation shards that are training shards: the val loss would flatter the model -----

HELD_OUT_FIX = "validation on training data overstates the model: pass a --val_files pattern that matches only held-out shards"


@pytest.mark.parametrize("module", [tg, tgs], ids=["track1", "track3"])
def test_a_validation_shard_that_is_a_training_shard_is_refused(module, tmp_path):
    train_pattern, val_pattern = make_shards(tmp_path / "data")
    first, second = sorted(tmp_path.glob("data/tiny_train_*.bin"))
    (tmp_path / "data" / "link.bin").symlink_to(second.name)
    os.link(first, tmp_path / "data" / "hard.bin")
    train = module.resolve_files(train_pattern, "train")
    module.check_val_is_held_out(train, module.resolve_files(val_pattern, "val"))  # held-out shards pass
    for val, named, same in [(str(first), first, ""), (str(tmp_path / "data" / "tiny_*.bin"), first, ""),
                             (str(tmp_path / "data" / "link.bin"), tmp_path / "data" / "link.bin", f" (the same file as {second})"),
                             (str(tmp_path / "data" / "hard.bin"), tmp_path / "data" / "hard.bin", f" (the same file as {first})")]:
        with pytest.raises(module.UserError) as info:
            module.check_val_is_held_out(train, module.resolve_files(val, "val"))
        assert str(info.value) == f"{named}: is a --val_files shard and a --train_files shard{same}; {HELD_OUT_FIX}"


def test_track1_refuses_training_shards_as_validation_before_the_log_exists(tmp_path):
    train_files, _ = make_shards(tmp_path / "data")
    first = sorted(tmp_path.glob("data/tiny_train_*.bin"))[0]
    result = run_track1(tiny_args(train_files, str(first), tmp_path / "logs"))
    assert result.returncode == 2
    assert result.stderr.splitlines() == [f"train_gpt.py: error: {first}: is a --val_files shard and a --train_files shard; {HELD_OUT_FIX}"]
    assert not (tmp_path / "logs").exists()


def test_track3_refuses_training_shards_as_validation_before_the_log_exists(workdir, capsys):
    make_shards(workdir / "data")
    status, lines = track3_main(capsys, "--preset=smoke", "--matrix_optimizer=adamw", "--train_files=data/tiny_train_*.bin",
                                "--val_files=data/tiny_train_000001.bin")
    assert status == 2
    assert lines == [f"train_gpt_shampoo.py: error: data/tiny_train_000001.bin: is a --val_files shard and a --train_files shard; {HELD_OUT_FIX}"]
    assert not (workdir / "logs").exists()


# ----- row 7: a directory where a shard should be -----


def test_directory_in_place_of_a_shard_is_one_clear_line(tmp_path):
    folder = tmp_path / "fineweb_train_000001.bin"
    folder.mkdir()
    with pytest.raises(tg.UserError, match="is a directory, not a token shard") as track1:
        tg.read_shard_header(tg.resolve_files(str(tmp_path / "fineweb_train_*.bin"), "train")[0])
    with pytest.raises(tgs.UserError, match="is a directory, not a token shard") as track3:
        tgs.read_shard_header(folder)
    for error in (track1, track3):
        assert str(folder) in str(error.value) and "\n" not in str(error.value)


# ----- row 8: Ctrl-C / SIGTERM during training (Track 1 in test_train_gpt_resume.py, with resume) -----


@pytest.mark.slow
def test_track3_sigterm_stops_at_a_step_boundary_after_a_checkpoint(tmp_path):
    env = script_env()
    process = subprocess.Popen(
        [sys.executable, str(ROOT / "train_gpt_shampoo.py"), "--preset=smoke", "--matrix_optimizer=adamw", "--train_steps=400",
         "--val_every=100", "--cycle_train_files=true", "--checkpoint_every=1000", "--checkpoint_dir=ckpt"],
        cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )
    stderr = signal_when(process, "step:3/400 ", signal.SIGTERM, timeout=120)
    assert process.returncode == 143, stderr[-2000:]
    (line,) = stderr.splitlines()
    step = int(re.fullmatch(r"step (\d+): interrupted by SIGTERM", line).group(1))
    (log,) = (tmp_path / "logs").glob("*.txt")
    assert log.read_text().splitlines()[-2:] == [f"checkpoint: ckpt/step{step:06d}", line]
    assert (tmp_path / "ckpt" / f"step{step:06d}" / "manifest.json").is_file()


# ----- row 10: Track 3 resume into the same folder, a runtime-only change, stale partial saves -----


def test_track3_resume_may_keep_writing_into_the_checkpoint_folder(workdir):
    common = ["--matrix_optimizer=adamw", "--train_steps=6", "--checkpoint_every=2", "--checkpoint_dir=ckpt"]
    straight = tgs.run(["--preset=smoke", *common]).trials[0].val_losses
    step4 = workdir / "ckpt" / "step000004"
    expected = {name: torch.load(step4 / name, weights_only=False) for name in ("shared.pt", "rank0.pt")}
    for later in (step4, workdir / "ckpt" / "step000006"):  # as if the run had been killed before step 4
        shutil.rmtree(later)
    resumed = tgs.run(["--preset=smoke", *common, f"--resume={workdir / 'ckpt' / 'step000002'}"]).trials[0].val_losses
    assert resumed[6] == straight[6]
    rewritten = torch.load(step4 / "shared.pt", weights_only=False)["model"]
    assert all(torch.equal(rewritten[name], value) for name, value in expected["shared.pt"]["model"].items())
    assert sorted(p.name for p in (workdir / "ckpt").iterdir()) == [".lock", "step000002", "step000004", "step000006"]


def test_track3_runtime_only_settings_may_change_on_resume(workdir):
    tgs.run(["--preset=smoke", "--train_steps=4", "--checkpoint_every=2", "--checkpoint_dir=ckpt"])
    resumed = tgs.run(["--preset=smoke", "--train_steps=4", "--shampoo_root_streams=2", "--resume=ckpt/step000002"])
    assert sorted(resumed.trials[0].val_losses) == [4] and "resumed_from: ckpt/step000002" in resumed.log_path.read_text()


def test_track3_stale_partial_checkpoints_are_removed_with_one_line(workdir, capsys):
    stale = workdir / "ckpt" / ".step000002.partial-0123"
    stale.mkdir(parents=True)
    (stale / "rank0.pt").write_bytes(b"half")
    os.utime(stale, (time.time() - 3600, time.time() - 3600))
    result = tgs.run(["--preset=smoke", "--matrix_optimizer=adamw", "--train_steps=4", "--checkpoint_every=2", "--checkpoint_dir=ckpt"])
    line = "removed 1 unfinished checkpoint folder(s) of interrupted saves from ckpt: .step000002.partial-0123"
    assert line in capsys.readouterr().out.splitlines() and line in result.log_path.read_text().splitlines()
    assert sorted(p.name for p in (workdir / "ckpt").iterdir()) == [".lock", "step000002", "step000004"]


# ----- row 11: train_gpt.py's end-of-run checkpoint was written straight to its final name (resume: test_train_gpt_resume.py) -----


def test_track1_end_of_run_checkpoint_is_written_atomically(tmp_path, monkeypatch):
    model = torch.nn.Linear(2, 2)
    adam = muon = torch.optim.SGD(model.parameters(), lr=0.1)
    log_path = tmp_path / "run.txt"

    def broken_save(obj, f):
        f.write(b"partial bytes")
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(torch, "save", broken_save)
    monkeypatch.setattr(tg, "_last_checkpoint", None)  # this process saved no resumable checkpoint
    with pytest.raises(tg.UserError, match=r"^cannot write .*state_step000010\.pt \(No space left on device\)$"):
        tg.save_checkpoint(log_path, "run", 10, model, adam, muon)
    assert list((tmp_path / "run").iterdir()) == []  # neither the final name nor a temporary file
    monkeypatch.undo()
    path = tg.save_checkpoint(log_path, "run", 10, model, adam, muon)
    assert torch.load(path, weights_only=False)["step"] == 10 and list((tmp_path / "run").iterdir()) == [path]


# ----- row 12: the Shampoo script on GPT-2 tokens with the smoke vocabulary -----


def test_track3_vocabulary_error_names_the_vocab_fix(workdir, capsys):
    gpt2 = workdir / "gpt2"
    gpt2.mkdir()
    tokens = np.where(np.arange(20000) % 100 == 0, 50256, np.arange(20000) % 300)
    for name in ("g_train_000001.bin", "g_val_000000.bin"):
        tgs.write_shard(gpt2 / name, tokens)
    status, lines = track3_main(capsys, "--preset=smoke", "--train_files=gpt2/g_train_*.bin", "--val_files=gpt2/g_val_*.bin")
    assert status == 2 and len(lines) == 1
    assert "token id 50256 >= --vocab_size=512; pass --vocab_size=50304 for GPT-2 shards" in lines[0]
    assert "--val_tokens" not in lines[0]


# ----- item 8: broken local shards are regenerated, downloaded ones downloaded again -----


def test_broken_shard_messages_name_the_real_fix(tmp_path):
    hub = tmp_path / "fineweb10B"
    hub.mkdir()
    for folder in (tmp_path, hub):
        tg.write_shard(folder / "fineweb_train_000007.bin", np.arange(50))
        path = folder / "fineweb_train_000007.bin"
        path.write_bytes(path.read_bytes()[:-2])
    for read in (lambda p: tg.read_shard_header(str(p)), tgs.read_shard_header):
        with pytest.raises((tg.UserError, tgs.UserError), match="regenerate it with data/fineweb.py"):
            read(tmp_path / "fineweb_train_000007.bin")
        with pytest.raises((tg.UserError, tgs.UserError), match=r"run `python data/cached_fineweb10B.py 7` again"):
            read(hub / "fineweb_train_000007.bin")


# ----- issue 39 N27: SIGHUP (a dropped SSH session) is handled like SIGTERM -----


@pytest.mark.slow
def test_track3_sighup_stops_at_a_step_boundary_after_a_checkpoint(tmp_path):
    process = subprocess.Popen(
        [sys.executable, str(ROOT / "train_gpt_shampoo.py"), "--preset=smoke", "--matrix_optimizer=adamw", "--train_steps=400",
         "--val_every=100", "--cycle_train_files=true", "--checkpoint_every=1000", "--checkpoint_dir=ckpt"],
        cwd=tmp_path, env=script_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )
    stderr = signal_when(process, "step:3/400 ", signal.SIGHUP, timeout=120)
    assert process.returncode == 129, stderr[-2000:]
    (line,) = stderr.splitlines()
    step = int(re.fullmatch(r"step (\d+): interrupted by SIGHUP", line).group(1))
    (log,) = (tmp_path / "logs").glob("*.txt")
    assert log.read_text().splitlines()[-2:] == [f"checkpoint: ckpt/step{step:06d}", line]
    assert (tmp_path / "ckpt" / f"step{step:06d}" / "manifest.json").is_file()


# ----- issue 39 N32: a rank killed under torchrun; the survivor says so in one line -----


def test_a_lost_process_is_told_from_other_errors(monkeypatch):
    gloo = RuntimeError("[/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:553] Connection closed by peer "
                        "[127.0.0.1]:20390. This is typically caused by a remote worker crashing.")
    nccl = dist.DistBackendError("NCCL error in: ProcessGroupNCCL.cpp:1234, remote process exited or there was a network error")
    for module in (tg, tgs):
        monkeypatch.setattr(module, "_step_reached", 0)
        assert module.lost_process_line(gloo) == (
            "rank 0: step 0: another process of this run is gone (Connection closed by peer); stopping (its own output says why)")
        assert "(remote process exited)" in module.lost_process_line(nccl)
        assert module.lost_process_line(RuntimeError("Connection closed by peer")) is None  # not from a collective
        assert module.lost_process_line(RuntimeError("mat1 and mat2 shapes cannot be multiplied")) is None


def torchrun_children(launcher: subprocess.Popen) -> dict[int, int]:
    """LOCAL_RANK -> pid of the workers torchrun started (Linux /proc)."""
    workers = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            parent = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            environ = dict(item.split("=", 1) for item in (entry / "environ").read_text().split("\0") if "=" in item)
        except (OSError, IndexError, ValueError):
            continue
        if parent == launcher.pid and "LOCAL_RANK" in environ:
            workers[int(environ["LOCAL_RANK"])] = int(entry.name)
    return workers


@pytest.mark.slow
@pytest.mark.skipif(not Path("/proc/self/environ").exists(), reason="finds torchrun's workers in Linux's /proc")
def test_the_survivor_of_a_killed_rank_prints_one_line(tmp_path):
    logs = tmp_path / "torchrun"
    launcher = subprocess.Popen(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", f"--log-dir={logs}",
         "--redirects=3", str(ROOT / "train_gpt_shampoo.py"), "--preset=smoke", "--matrix_optimizer=adamw",
         "--train_steps=400", "--val_every=1000", "--cycle_train_files=true"],
        cwd=tmp_path, env=script_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )
    try:
        deadline = time.time() + 120
        while time.time() < deadline and not any("step:3/400" in p.read_text() for p in logs.glob("*/attempt_0/0/stdout.log")):
            time.sleep(0.2)
        os.kill(torchrun_children(launcher)[1], signal.SIGKILL)
        launcher.communicate(timeout=120)
    finally:
        if launcher.poll() is None:
            launcher.kill()
            launcher.wait()
    (survivor,) = logs.glob("*/attempt_0/0/stderr.log")
    lines = survivor.read_text().splitlines()
    assert len(lines) == 1 and re.fullmatch(r"rank 0: step \d+: another process of this run is gone \((Connection closed by peer|"
                                            r"Connection reset by peer|Broken pipe)\); stopping \(its own output says why\)", lines[0]), lines


# ----- a log that cannot be written, on two ranks: every rank stops with the same line and status -----

LOG_FULL_AT = """
import os, runpy, sys
marker, real_write = sys.argv[1].encode(), os.write
def full_at_marker(fd, data):  # rank 0's log: the disk is full from the line holding marker on
    if os.environ["RANK"] == "0" and os.readlink(f"/proc/self/fd/{fd}").endswith(".txt") and marker in bytes(data):
        raise OSError(28, os.strerror(28))
    return real_write(fd, data)
os.write = full_at_marker
sys.argv = sys.argv[2:]
runpy.run_path(sys.argv[0], run_name="__main__")
"""


@pytest.mark.slow
@pytest.mark.skipif(not Path("/proc/self/fd").is_dir(), reason="tells the log's writes apart by Linux's /proc/self/fd")
@pytest.mark.parametrize("marker", ["step:4/10 train", "step:10/10 val_loss"], ids=["mid-run", "last step"])
def test_track1_ranks_agree_to_stop_when_the_log_cannot_be_written(tiny_shards, tmp_path, marker):
    """Only rank 0 writes the log, so only it sees the failure: the other rank used to stop with status 143
    ("interrupted by SIGTERM") mid-run, or end with status 0 after the last step."""
    port = free_port()
    processes = [subprocess.Popen(
        [sys.executable, "-c", LOG_FULL_AT, marker, str(SCRIPT), *tiny_args(*tiny_shards, tmp_path / "logs")],
        env=dict(script_env(), RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE="2", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port)),
        cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for rank in range(2)]
    stderrs = [process.communicate(timeout=300)[1] for process in processes]
    assert [process.returncode for process in processes] == [2, 2], stderrs
    log = only_log(tmp_path / "logs")
    (line,) = stderrs[0].splitlines()
    assert re.fullmatch(rf"step \d+: cannot write the log {re.escape(str(log))} \(No space left on device\); stopping", line), line
    assert stderrs[1] == ""  # rank 0 tells it
    assert marker not in log.read_text()


# ----- issue 39 N15, N17: every float flag refuses nan and ±inf, every int flag its out-of-range values -----

# one out-of-range value of every int setting (each must be refused in one line naming it)
BAD_INTS = {
    tg: dict(val_tokens=0, train_batch_size=-1024, train_max_seq_len=0, val_batch_size=0, vocab_size=0, bos_token=-1,
             model_dim=-64, num_heads=0, block_size=8, muon_momentum_warmup_steps=-1, num_iterations=0, iteration_extension=-1,
             ws_validate=1, ws_long_validate=0, val_loss_every=-1, seed=-2, warmup_steps=-1, checkpoint_every=-1),
    tgs: dict(val_tokens=0, seq_len=0, micro_batch_seqs=0, vocab_size=0, num_layers=0, model_dim=0, head_dim=0,
              shampoo_max_preconditioner_dim=0, shampoo_precondition_frequency=0, shampoo_start_preconditioning_step=2,
              train_steps=0, val_every=0, val_every_late=0, num_trials=0, seed=2**64, shampoo_root_streams=0,
              checkpoint_every=-1),
}
FIELDS_OF = {module: {f.name: f.type for f in dataclasses.fields(module.Hyperparameters)} for module in (tg, tgs)}


@pytest.mark.parametrize("module", [tg, tgs], ids=["track1", "track3"])
def test_every_int_setting_has_its_out_of_range_case(module):
    assert sorted(BAD_INTS[module]) == sorted(name for name, kind in FIELDS_OF[module].items() if kind is int)


@pytest.mark.parametrize("module, name, value", [(module, name, value) for module in (tg, tgs) for name, value in BAD_INTS[module].items()],
                         ids=lambda item: getattr(item, "__name__", str(item)))
def test_out_of_range_int_flags_are_one_line_errors(module, name, value):
    with pytest.raises(module.UserError) as info:
        module.parse_args([f"--{name}={value}"])
    assert f"--{name}" in str(info.value) and "\n" not in str(info.value)


@pytest.mark.parametrize("module, name", [(module, name) for module in (tg, tgs) for name, kind in FIELDS_OF[module].items() if kind is float],
                         ids=lambda item: getattr(item, "__name__", str(item)))
def test_float_flags_refuse_nan_and_infinities(module, name):
    bound = name in getattr(module, "BOUND_FLAGS", ())  # a bound that inf lifts
    for text in ("nan", "-inf") if bound else ("nan", "inf", "-inf"):
        with pytest.raises(module.UserError, match=f"^argument --{name}: must be a finite number, got '{text}' \\(see --help\\)$"):
            module.parse_args([f"--{name}={text}"])
    if bound:
        assert getattr(module.parse_args([f"--{name}=inf"])[0], name) == math.inf


@pytest.mark.parametrize("run_id", ["../x", "/tmp/elsewhere", "a/b", "..", "y" * 300])
def test_track1_run_id_cannot_leave_the_log_dir(run_id):
    with pytest.raises(tg.UserError, match=r"^--run_id=.* must be a plain file name of at most 200 bytes"):
        tg.parse_args([f"--run_id={run_id}"])


# ----- issue 39 N41: run with a Python that lacks a requirement -----

WITHOUT_MODULE = """
import runpy, sys
sys.modules[sys.argv[1]] = None  # import fails as for a missing package
sys.argv = sys.argv[2:]
runpy.run_path(sys.argv[0], run_name="__main__")
"""


@pytest.mark.parametrize("script", ["train_gpt.py", "train_gpt_shampoo.py"])
@pytest.mark.parametrize("missing", ["numpy", "torch"])
def test_a_missing_package_is_one_line_with_the_install_command(script, missing):
    result = subprocess.run([sys.executable, "-c", WITHOUT_MODULE, missing, str(ROOT / script), "--preset=smoke"],
                            capture_output=True, text=True, timeout=120, env=script_env(), cwd=ROOT)
    assert result.returncode == 2
    assert result.stderr.splitlines() == [f"{script}: error: cannot import {missing} in {sys.executable}; install the requirements "
                                          f"(pip install -r requirements.txt, README.md#install) or run the Python that has them"]


# ----- issue 38 item 6: Shampoo's start step is the script's, told once in the log -----


def test_shampoo_start_step_is_resolved_without_the_packages_notice(workdir, caplog):
    caplog.set_level("WARNING")
    result = tgs.run(["--preset=smoke", "--train_steps=1"])
    assert not [record for record in caplog.records if "start_preconditioning_step" in record.getMessage()]
    header = result.log_path.read_text().split(tgs.SEPARATOR)[1].splitlines()
    assert header.count("shampoo_start_preconditioning_step: 5") == 1
