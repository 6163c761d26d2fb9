"""What the training scripts write, on a bad day (issue 39, items 1-3; issue 38, item 7): checkpoints that verify
their files, a checkpoint folder one run at a time, every output checked before the log exists, a full disk in the
middle of a run, and the temporary file of a killed writer. Track 3 runs in this process (fast); Track 1 shares the
helpers (tests/test_shared_helpers.py) and is run where its own code is involved."""

import errno
import json
import os
import re
import resource
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
from conftest import ROOT, free_port, make_shards, tiny_args

QUICK = ("--preset=smoke", "--matrix_optimizer=adamw")


def script_env() -> dict[str, str]:
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "DATA_PATH", "TORCHELASTIC_ERROR_FILE"):
        env.pop(key, None)
    return env


def track3_main(capsys: pytest.CaptureFixture, *args: str) -> tuple[int, list[str]]:
    """Exit status and stderr lines of train_gpt_shampoo.py's main, run in this process."""
    capsys.readouterr()
    with pytest.raises(SystemExit) as exit_info:
        tgs.main(list(args))
    return exit_info.value.code, capsys.readouterr().err.splitlines()


def logs(workdir: Path) -> list[Path]:
    return sorted((workdir / "logs").glob("*.txt"))


def flip_bytes(path: Path, count: int = 64) -> None:
    data = bytearray(path.read_bytes())
    middle = len(data) // 2
    data[middle : middle + count] = bytes(b ^ 0xFF for b in data[middle : middle + count])
    path.write_bytes(bytes(data))


# ----- N3, N2: a corrupt or truncated checkpoint is refused, naming the file and the previous good checkpoint -----


def test_corrupt_and_truncated_checkpoints_are_refused_before_the_log_exists(workdir, capsys):
    tgs.run([*QUICK, "--train_steps=4", "--checkpoint_every=2", "--checkpoint_dir=ckpt"])
    (first_log,) = logs(workdir)
    manifest = tgs.read_manifest(workdir / "ckpt" / "step000004")
    assert sorted(manifest["files"]) == ["rank0.pt", "shared.pt"]
    assert manifest["files"]["shared.pt"]["sha256"] == tgs.file_sha256(workdir / "ckpt" / "step000004" / "shared.pt")

    flip_bytes(workdir / "ckpt" / "step000004" / "shared.pt")  # N3: the run used to resume from it silently
    status, lines = track3_main(capsys, *QUICK, "--train_steps=4", "--resume=ckpt/step000004")
    assert status == 2 and lines == [
        "train_gpt_shampoo.py: error: --resume=ckpt/step000004: shared.pt does not match the SHA-256 manifest.json records "
        "(the file is corrupt); resume from ckpt/step000002, the previous complete checkpoint there"
    ]
    rank0 = workdir / "ckpt" / "step000002" / "rank0.pt"
    size = rank0.stat().st_size
    os.truncate(rank0, size // 2)  # N2: a PytorchStreamReader traceback and a stub log
    status, lines = track3_main(capsys, *QUICK, "--train_steps=4", "--resume=ckpt/step000002")
    assert status == 2 and lines == [
        f"train_gpt_shampoo.py: error: --resume=ckpt/step000002: rank0.pt is {size // 2} bytes, manifest.json records "
        f"{size} (the file is truncated or was replaced); ckpt holds no earlier complete checkpoint"
    ]
    assert logs(workdir) == [first_log]  # no stub log of the refused runs


def test_track1_refuses_a_corrupt_checkpoint_before_the_log_exists(tmp_path, monkeypatch):
    """Track 1's checks run in its own order: the checkpoint before the log (written here by the shared helper)."""
    monkeypatch.setattr(tg, "_last_checkpoint", None)  # write_checkpoint sets it: restored afterwards
    shards = make_shards(tmp_path / "data")
    checkpoint = tmp_path / "ckpt" / "step000004"
    checkpoint.parent.mkdir()
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    try:
        rt = tg.Runtime(0, 1, 0, torch.device("cpu"))
        assert tg.write_checkpoint(checkpoint, "r", rt, {}, [], dict(step=4), dict(adam={}), dict(model={"w": torch.ones(1000)}))
    finally:
        dist.destroy_process_group()
    flip_bytes(checkpoint / "shared.pt")
    result = subprocess.run([sys.executable, str(ROOT / "train_gpt.py"), *tiny_args(*shards, tmp_path / "logs", resume=checkpoint)],
                            capture_output=True, text=True, timeout=300, env=script_env(), cwd=tmp_path)
    assert result.returncode == 2, result.stderr[-2000:]
    assert result.stderr.splitlines() == [f"train_gpt.py: error: --resume={checkpoint}: shared.pt does not match the SHA-256 "
                                          f"manifest.json records (the file is corrupt); {checkpoint.parent} holds no earlier "
                                          f"complete checkpoint"]
    assert not list((tmp_path / "logs").glob("*.txt"))


def edit_manifest(checkpoint: Path, edit) -> None:
    manifest = json.loads((checkpoint / "manifest.json").read_text())
    edit(manifest)
    (checkpoint / "manifest.json").write_text(json.dumps(manifest))


# A field resuming reads, taken out or given another type by hand: each used to be a KeyError, ValueError or
# AttributeError traceback (its bytes are not among the hashes the manifest records).
EDITED_MANIFESTS = [
    (lambda m: m.pop("world_size"), "manifest.json has no 'world_size'"),
    (lambda m: m.pop("hyperparameters"), "manifest.json has no 'hyperparameters'"),
    (lambda m: m.update(step="x"), "manifest.json's 'step' is 'x', not a whole number"),
    (lambda m: m.update(world_size="1"), "manifest.json's 'world_size' is '1', not a whole number"),
    (lambda m: m.update(trial=True), "manifest.json's 'trial' is True, not a whole number"),
    (lambda m: m.update(hyperparameters=None), "manifest.json's 'hyperparameters' is None, not a JSON dict"),
]


def test_an_edited_manifest_is_refused_in_one_line_before_the_log_exists(workdir, capsys):
    tgs.run([*QUICK, "--train_steps=4", "--checkpoint_every=2", "--checkpoint_dir=ckpt"])
    (first_log,) = logs(workdir)
    checkpoint = workdir / "ckpt" / "step000004"
    original = (checkpoint / "manifest.json").read_text()
    for edit, problem in EDITED_MANIFESTS:
        edit_manifest(checkpoint, edit)
        status, lines = track3_main(capsys, *QUICK, "--train_steps=4", "--resume=ckpt/step000004")
        assert status == 2 and lines == [f"train_gpt_shampoo.py: error: --resume=ckpt/step000004: {problem} (the file was "
                                         f"edited or damaged); pass another checkpoint"]
        (checkpoint / "manifest.json").write_text(original)
    # an earlier step: it used to resume silently from shared.pt's step 4 and log "at step 2"
    edit_manifest(checkpoint, lambda m: m.update(step=2))
    status, lines = track3_main(capsys, *QUICK, "--train_steps=4", "--resume=ckpt/step000004")
    assert status == 2 and lines == ["train_gpt_shampoo.py: error: --resume=ckpt/step000004: manifest.json does not match the "
                                     "checkpoint it describes (step=2 there, 4 in shared.pt): it was edited; put back its "
                                     "values or pass another checkpoint"]
    # a damaged checkpoint's sibling with an edited manifest is passed over (a ValueError traceback while looking for
    # the previous complete checkpoint)
    edit_manifest(workdir / "ckpt" / "step000002", lambda m: m.update(step="x"))
    flip_bytes(checkpoint / "shared.pt")
    status, lines = track3_main(capsys, *QUICK, "--train_steps=4", "--resume=ckpt/step000004")
    assert status == 2 and lines[0].endswith("(the file is corrupt); ckpt holds no earlier complete checkpoint")
    assert logs(workdir) == [first_log]


def test_a_checkpoint_of_a_diverged_model_is_refused_before_the_log_exists(workdir, capsys):
    """A NaN weight in a checkpoint whose hashes match (the last update before the save diverged) used to stop the
    resumed run at its first step with a non-finite training loss, after its log and warm-up."""
    tgs.run([*QUICK, "--train_steps=4", "--checkpoint_every=2", "--checkpoint_dir=ckpt"])
    (first_log,) = logs(workdir)
    checkpoint = workdir / "ckpt" / "step000004"
    shared = torch.load(checkpoint / "shared.pt", map_location="cpu", weights_only=True)
    name = next(iter(shared["model"]))
    shared["model"][name].view(-1)[0] = float("nan")
    entry = tgs.atomic_torch_save(shared, checkpoint / "shared.pt")
    edit_manifest(checkpoint, lambda m: m["files"].update({"shared.pt": entry}))
    status, lines = track3_main(capsys, *QUICK, "--train_steps=4", "--resume=ckpt/step000004")
    assert status == 2 and lines == [f"train_gpt_shampoo.py: error: --resume=ckpt/step000004: shared.pt holds non-finite model "
                                     f"weights ({name}): the run had diverged when it was saved; resume from an earlier checkpoint"]
    assert logs(workdir) == [first_log]


@pytest.mark.parametrize("module, other", [(tg, tgs), (tgs, tg)], ids=["track1", "track3"])
def test_a_checkpoint_of_the_other_script_names_the_script_that_resumes_it(module, other, tmp_path):
    (tmp_path / "manifest.json").write_text(json.dumps(dict(format=other.CHECKPOINT_FORMAT, world_size=1)))
    this, writer = (Path(m.__file__).name for m in (module, other))
    with pytest.raises(module.UserError) as refused:
        module.checkpoint_manifest(str(tmp_path), world_size=1)
    assert str(refused.value) == (f"--resume={tmp_path}: a checkpoint of {writer} (format {other.CHECKPOINT_FORMAT!r}), not of "
                                  f"{this}; resume it with {writer}, or pass a checkpoint of {this}")
    older = module.CHECKPOINT_FORMAT.partition("/")[0] + "/1"  # this script's, an earlier version
    (tmp_path / "manifest.json").write_text(json.dumps(dict(format=older)))
    with pytest.raises(module.UserError, match=rf"format '{older}', expected .*; resume it with the version of "
                                               rf"{re.escape(this)} that wrote it, or pass another checkpoint$"):
        module.checkpoint_manifest(str(tmp_path), world_size=1)


# ----- a checkpoint's settings and train shards are its own: an edited manifest.json or other shards are refused -----


def write_own_shards(folder: Path, tokens: dict[str, np.ndarray]) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    for name, values in tokens.items():
        tgs.write_shard(folder / name, values)


def drop_from_shared_pt(checkpoint: Path, *names: str) -> None:
    """shared.pt without those entries, its manifest's hash updated (as a checkpoint of an older version holds it)."""
    shared = torch.load(checkpoint / "shared.pt", map_location="cpu", weights_only=True)
    for name in names:
        shared.pop(name)
    entry = tgs.atomic_torch_save(shared, checkpoint / "shared.pt")
    edit_manifest(checkpoint, lambda m: m["files"].update({"shared.pt": entry}))


def test_track3_refuses_a_manifest_edited_to_other_settings_and_a_shared_pt_without_them(workdir, capsys):
    """manifest.json's settings were the only ones a checkpoint held, outside the hashes it records: edited to match
    another command line, the checkpoint resumed under settings it was not trained with."""
    tgs.run([*QUICK, "--train_steps=4", "--checkpoint_every=2", "--checkpoint_dir=ckpt"])
    (first_log,) = logs(workdir)
    checkpoint = workdir / "ckpt" / "step000004"
    assert torch.load(checkpoint / "shared.pt", weights_only=True)["hyperparameters"] == tgs.read_manifest(checkpoint)["hyperparameters"]
    original = (checkpoint / "manifest.json").read_text()
    edit_manifest(checkpoint, lambda m: m["hyperparameters"].update(matrix_lr=0.003))
    status, lines = track3_main(capsys, *QUICK, "--train_steps=4", "--matrix_lr=0.003", "--resume=ckpt/step000004")
    assert status == 2 and lines == ["train_gpt_shampoo.py: error: --resume=ckpt/step000004: manifest.json's settings are not "
                                     "those the checkpoint was trained with (matrix_lr: 0.0015 in shared.pt, 0.003 in "
                                     "manifest.json): it was edited; put back shared.pt's values and resume with those "
                                     "settings, or start a new run"]
    (checkpoint / "manifest.json").write_text(original)
    drop_from_shared_pt(checkpoint, "hyperparameters", "train_shards")  # written before shared.pt held them
    run_id = json.loads(original)["run_id"]
    status, lines = track3_main(capsys, *QUICK, "--train_steps=4", "--resume=ckpt/step000004")
    assert status == 2 and lines == [f"train_gpt_shampoo.py: error: --resume=ckpt/step000004: shared.pt records no hyperparameters "
                                     f"and no train_shards, which this format holds there: it was written by an older version of train_gpt_shampoo.py than its manifest.json's format "
                                     f"says; resume it with the version that wrote it (the git_commit line of its run's log, "
                                     f"{run_id}.txt, names it), or pass another checkpoint"]
    assert logs(workdir) == [first_log]


def test_a_checkpoint_of_an_older_format_is_not_offered_as_the_previous_complete_one(workdir, capsys):
    tgs.run([*QUICK, "--train_steps=4", "--checkpoint_every=2", "--checkpoint_dir=ckpt"])
    older = workdir / "ckpt" / "step000002"
    edit_manifest(older, lambda m: m.update(format="train_gpt_shampoo/4"))  # as the version before this one wrote it
    flip_bytes(workdir / "ckpt" / "step000004" / "shared.pt")
    status, lines = track3_main(capsys, *QUICK, "--train_steps=4", "--resume=ckpt/step000004")
    assert status == 2 and lines[0].endswith("(the file is corrupt); ckpt holds no earlier complete checkpoint")
    run_id = tgs.read_manifest(workdir / "ckpt" / "step000004")["run_id"]
    status, lines = track3_main(capsys, *QUICK, "--train_steps=4", "--resume=ckpt/step000002")
    assert status == 2 and lines == [f"train_gpt_shampoo.py: error: --resume=ckpt/step000002: not a checkpoint of this script's "
                                     f"version (format 'train_gpt_shampoo/4', expected {tgs.CHECKPOINT_FORMAT!r}); resume it "
                                     f"with the version of train_gpt_shampoo.py that wrote it (the git_commit line of its "
                                     f"run's log, {run_id}.txt, names it), or pass another checkpoint"]


def test_track3_refuses_other_train_shards_and_resumes_from_moved_ones(workdir, monkeypatch, capsys):
    """The loader's position (a shard number and an offset) was restored into whatever shards the pattern matched."""
    tokens = tgs.smoke_tokens(512)
    train = {name: values for name, values in tokens.items() if name.startswith("smoke_train_")}
    write_own_shards(workdir / "data", tokens)
    own = (*QUICK, "--train_files=data/smoke_train_*.bin", "--val_files=data/smoke_val_*.bin", "--train_steps=4")
    tgs.run([*own, "--checkpoint_every=2", "--checkpoint_dir=ckpt"])
    (first_log,) = logs(workdir)
    checkpoint = workdir / "ckpt" / "step000002"
    assert tgs.read_manifest(checkpoint)["train_shards"] == [
        dict(name=name, bytes=4 * tgs.SHARD_HEADER_INTS + 2 * len(values), tokens=len(values)) for name, values in train.items()]
    refusal = ("train_gpt_shampoo.py: error: --resume=ckpt/step000002: the --train_files pattern matches other shards than the "
               "run read: {}; make it match the run's shards (move other files out of the pattern's folder, or restore the run's), or "
               "start a new run")
    second = workdir / "data" / "smoke_train_000002.bin"
    second.unlink()
    tgs.write_shard(second, train["smoke_train_000002.bin"][:16384])  # regenerated shorter
    status, lines = track3_main(capsys, *own, "--resume=ckpt/step000002")
    assert status == 2 and lines == [refusal.format("shard 2 here is smoke_train_000002.bin (16384 tokens, 33792 bytes), the "
                                                    "run's was smoke_train_000002.bin (32768 tokens, 66560 bytes)")]
    second.unlink()
    status, lines = track3_main(capsys, *own, "--resume=ckpt/step000002")
    assert status == 2 and lines == [refusal.format("it matches 1 shard where the run read 2, the first missing being "
                                                    "smoke_train_000002.bin (32768 tokens, 66560 bytes)")]
    assert logs(workdir) == [first_log]
    # a shard added after the run's, without cycling: the run resumes (the loader reaches it only where the run would
    # have stopped for want of data)
    tgs.write_shard(second, train["smoke_train_000002.bin"])
    tgs.write_shard(workdir / "data" / "smoke_train_000003.bin", train["smoke_train_000001.bin"])
    assert sorted(tgs.run([*own, "--resume=ckpt/step000002"]).trials[0].val_losses) == [4]
    (workdir / "data" / "smoke_train_000003.bin").unlink()
    # the same shards in a copy of the folder, run from elsewhere with the same pattern: the run resumes
    moved = workdir / "moved"
    write_own_shards(moved / "data", tokens)
    monkeypatch.chdir(moved)
    resumed = tgs.run([*own, f"--resume={checkpoint}"])
    assert sorted(resumed.trials[0].val_losses) == [4]
    assert f"resumed_from: {checkpoint} (run " in resumed.log_path.read_text()


@pytest.mark.parametrize("module", [tg, tgs])
def test_shards_added_after_the_runs_differ_only_where_the_run_cycles(module):
    shard = lambda name, tokens: dict(name=name, bytes=4 * module.SHARD_HEADER_INTS + 2 * tokens, tokens=tokens)
    saved = [shard("a.bin", 8), shard("b.bin", 8)]
    added = [*saved, shard("c.bin", 4)]
    assert module.first_shard_difference(saved, added, appended_ok=True) is None
    assert module.first_shard_difference(saved, added, appended_ok=False) == (
        f"it matches 3 shards where the run read 2, the first new one being c.bin (4 tokens, {added[2]['bytes']} bytes)")
    assert module.first_shard_difference(saved, saved[:1], appended_ok=True) == (
        f"it matches 1 shard where the run read 2, the first missing being b.bin (8 tokens, {saved[1]['bytes']} bytes)")
    assert module.first_shard_difference(saved, [saved[1], saved[0], added[2]], appended_ok=True).startswith("shard 1 here is b.bin")


@pytest.mark.parametrize("module", [tg, tgs])
def test_a_shard_added_to_a_cycling_run_is_refused_saying_why(module):
    shard = dict(name="a.bin", bytes=4 * module.SHARD_HEADER_INTS + 16, tokens=8)
    added = dict(shard, name="b.bin")
    manifest = dict(train_shards=[shard], hyperparameters=dict(cycle_train_files=True))
    with pytest.raises(module.UserError) as refused:
        module.check_same_train_shards("ck/step000002", manifest, [shard, added])
    assert str(refused.value) == (
        f"--resume=ck/step000002: the --train_files pattern matches other shards than the run read: it matches 2 shards "
        f"where the run read 1, the first new one being b.bin (8 tokens, {shard['bytes']} bytes) (the run cycles through its "
        f"shards, so added ones would change where it starts over); make it match the run's shards (move other files out of "
        f"the pattern's folder, or restore the run's), or start a new run")
    module.check_same_train_shards("ck/step000002", dict(manifest, hyperparameters=dict(cycle_train_files=False)), [shard, added])


def track1(tmp_path: Path, cwd: Path, **extra: object) -> subprocess.CompletedProcess:
    """A 4-step Track 1 run of the tiny configuration on the shards of cwd/data, named by a relative pattern."""
    args = tiny_args("data/tiny_train_*.bin", "data/tiny_val_*.bin", tmp_path / "logs", num_iterations=4, iteration_extension=0, **extra)
    return subprocess.run([sys.executable, str(ROOT / "train_gpt.py"), *args], capture_output=True, text=True, timeout=300,
                          env=script_env(), cwd=cwd)


def test_track1_refuses_edited_settings_and_other_train_shards_and_resumes_from_moved_ones(tmp_path):
    make_shards(tmp_path / "data")
    assert track1(tmp_path, tmp_path, checkpoint_every=2, checkpoint_dir="ckpt").returncode == 0
    (first_log,) = (tmp_path / "logs").glob("*.txt")
    checkpoint = tmp_path / "ckpt" / "step000002"
    original = (checkpoint / "manifest.json").read_text()
    edit_manifest(checkpoint, lambda m: m["hyperparameters"].update(muon_lr=0.1))
    result = track1(tmp_path, tmp_path, muon_lr=0.1, resume=checkpoint)
    assert result.returncode == 2 and result.stderr.splitlines() == [
        f"train_gpt.py: error: --resume={checkpoint}: manifest.json's settings are not those the checkpoint was trained with "
        f"(muon_lr: 0.05 in shared.pt, 0.1 in manifest.json): it was edited; put back shared.pt's values and resume with "
        f"those settings, or start a new run"]
    (checkpoint / "manifest.json").write_text(original)
    (tmp_path / "data" / "tiny_train_000001.bin").rename(tmp_path / "tiny_train_000001.bin")
    result = track1(tmp_path, tmp_path, resume=checkpoint)
    assert result.returncode == 2 and result.stderr.splitlines() == [
        f"train_gpt.py: error: --resume={checkpoint}: the --train_files pattern matches other shards than the run read: it "
        f"matches 1 shard where the run read 2, the first missing being tiny_train_000001.bin (60000 tokens, 121024 bytes); "
        f"make it match the run's shards (move other files out of the pattern's folder, or restore the run's), or start a new run"]
    assert list((tmp_path / "logs").glob("*.txt")) == [first_log]
    # the data folder moved beside a copy of the repository's run folder: the same pattern resumes there
    make_shards(tmp_path / "moved" / "data")
    result = track1(tmp_path, tmp_path / "moved", resume=checkpoint)
    assert result.returncode == 0, result.stderr[-2000:]
    assert f"resumed_from: {checkpoint} (run " in max((tmp_path / "logs").glob("*.txt"), key=os.path.getmtime).read_text()


OPEN_ON_TWO_RANKS = """
import json, sys, torch, torch.distributed as dist
from pathlib import Path
sys.path.insert(0, sys.argv[1])
module, rank, target = __import__(sys.argv[2]), int(sys.argv[3]), Path(sys.argv[5])
dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{sys.argv[4]}", rank=rank, world_size=2)
module._is_master, rt = rank == 0, module.Runtime(rank, 2, rank, torch.device("cpu"))
module.write_checkpoint(target, "r", rt, {}, [], dict(step=4), dict(state=torch.full((1000,), float(rank))), dict(model=torch.ones(1000)))
if rank == 0:  # one byte of rank 1's file flipped
    data = bytearray((target / "rank1.pt").read_bytes())
    data[len(data) // 2] ^= 0xFF
    (target / "rank1.pt").write_bytes(bytes(data))
dist.barrier()
hashed, real = [], module.file_sha256
module.file_sha256 = lambda path: hashed.append(path.name) or real(path)
try:
    module.open_checkpoint(str(target), {}, [], rt)
    outcome = "opened"
except module.UserError as error:
    outcome = str(error)
print(json.dumps(dict(hashed=hashed, outcome=outcome)))
dist.destroy_process_group()
"""


SHARDS_ON_TWO_RANKS = """
import sys, torch, torch.distributed as dist
sys.path.insert(0, sys.argv[1])
module, rank = __import__(sys.argv[2]), int(sys.argv[3])
dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{sys.argv[4]}", rank=rank, world_size=2)
rt = module.Runtime(rank, 2, rank, torch.device("cpu"))
shard = dict(name="a.bin", bytes=1040, tokens=8)
try:
    module.check_ranks_read_the_same_shards([shard, dict(shard, name="b.bin")] if rank == 1 else [shard], rt)
    print("agreed")
except module.UserError as error:
    print(error)
dist.destroy_process_group()
"""


@pytest.mark.parametrize("script", ["train_gpt", "train_gpt_shampoo"])
def test_ranks_whose_patterns_match_other_shards_all_stop_with_one_line(script):
    port = free_port()
    processes = [subprocess.Popen([sys.executable, "-c", SHARDS_ON_TWO_RANKS, str(ROOT), script, str(rank), str(port)],
                                  env=script_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for rank in range(2)]
    results = [process.communicate(timeout=120) for process in processes]
    assert [process.returncode for process in processes] == [0, 0], [stderr[-2000:] for _, stderr in results]
    expected = ("--train_files: rank 1 matches 2 shards and rank 0 1, the first difference at shard 2: b.bin (8 tokens, "
                "1040 bytes) on rank 1, none on rank 0; give every machine the same shard files")
    assert [stdout.strip() for stdout, _ in results] == [expected, expected]


@pytest.mark.parametrize("script", ["train_gpt", "train_gpt_shampoo"])
def test_each_rank_verifies_the_files_it_loads_and_all_agree(script, tmp_path):
    """Each rank hashes shared.pt and its own rank<r>.pt, not the whole checkpoint; a damaged rank1.pt stops rank 0 as
    well, with the same line."""
    target, port = tmp_path / "ckpt" / "step000004", free_port()
    target.parent.mkdir()
    processes = [subprocess.Popen([sys.executable, "-c", OPEN_ON_TWO_RANKS, str(ROOT), script, str(rank), str(port), str(target)],
                                  env=script_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for rank in range(2)]
    results = [process.communicate(timeout=120) for process in processes]
    assert [process.returncode for process in processes] == [0, 0], [stderr[-2000:] for _, stderr in results]
    reports = [json.loads(stdout.splitlines()[-1]) for stdout, _ in results]
    assert [report["hashed"] for report in reports] == [["shared.pt", "rank0.pt"], ["shared.pt", "rank1.pt"]]
    expected = (f"--resume={target}: rank1.pt does not match the SHA-256 manifest.json records (the file is corrupt); "
                f"{target.parent} holds no earlier complete checkpoint")
    assert [report["outcome"] for report in reports] == [expected, expected]


# ----- N24, N25: a checkpoint folder is one run's at a time; a live save is never removed -----

HOLD_FOLDER = """
import fcntl, sys, time
with open(sys.argv[1] + "/.lock", "a+b") as lock:
    fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
    lock.write(b"pid 4242 on elsewhere, since 2026-01-01 00:00:00")
    lock.flush()
    print("held", flush=True)
    time.sleep(600)
"""


def test_a_second_run_is_refused_a_live_runs_checkpoint_folder(workdir, capsys):
    shared = workdir / "shared"
    live_save = shared / ".step000002.partial-other"  # the first run's save in progress
    live_save.mkdir(parents=True)
    (live_save / "rank0.pt").write_bytes(b"being written")
    os.utime(live_save, (time.time() - 3600, time.time() - 3600))  # as old as you like: its run is alive
    first = subprocess.Popen([sys.executable, "-c", HOLD_FOLDER, str(shared)], stdout=subprocess.PIPE, text=True)
    try:
        assert first.stdout.readline() == "held\n"
        status, lines = track3_main(capsys, *QUICK, "--train_steps=4", "--checkpoint_every=3", "--checkpoint_dir=shared")
    finally:
        first.kill()
        first.wait()
    assert status == 2 and lines == [
        "train_gpt_shampoo.py: error: --checkpoint_dir=shared: in use by another run (pid 4242 on elsewhere, since "
        "2026-01-01 00:00:00); pick another --checkpoint_dir (two runs never save into one folder)"
    ]
    assert (live_save / "rank0.pt").read_bytes() == b"being written" and not logs(workdir)

    # its run gone (the lock went with its process), the folder is free and the dead save is removed
    result = tgs.run([*QUICK, "--train_steps=4", "--checkpoint_every=3", "--checkpoint_dir=shared"])
    assert "removed 1 unfinished checkpoint folder(s) of interrupted saves from shared: .step000002.partial-other" in result.log_path.read_text()
    assert sorted(p.name for p in shared.iterdir()) == [".lock", "step000003", "step000004"]


# ----- N9, N10, N13 and friends: every output checked before the log exists, one line each -----


def tree(folder: Path) -> list[tuple[str, bool, int]]:
    """Every path under folder, whether it is a folder, and its size."""
    return sorted((str(path.relative_to(folder)), path.is_dir(), path.stat().st_size if path.is_file() else 0)
                  for path in folder.rglob("*"))


def refuse_for(monkeypatch, module, function, refused_here, error: int, filename: str | None = None):
    """module.function raises OSError(error) for the paths refused_here accepts, and works as usual elsewhere."""
    real = getattr(module, function)

    def refusing(*args, **kwargs):
        if refused_here(*args, **kwargs):
            raise OSError(error, os.strerror(error), filename)
        return real(*args, **kwargs)

    monkeypatch.setattr(module, function, refusing)


REFUSALS = {
    "log_dir is a file": (["--log_dir=a_file"], "--log_dir=a_file: is a file, not a folder; pick another --log_dir"),
    "checkpoint_dir under a file": (["--checkpoint_dir=a_file/ckpt"],
                                    "--checkpoint_dir=a_file/ckpt: a_file is a file, not a folder; pick another --checkpoint_dir"),
    "checkpoint_dir not writable": (["--checkpoint_dir=ckpt"],
                                    "--checkpoint_dir=ckpt: cannot write there (Permission denied); pick a writable --checkpoint_dir"),
    "checkpoint_dir under a folder not writable": (
        ["--checkpoint_dir=ckpt/new"],
        "--checkpoint_dir=ckpt/new: cannot write in ckpt, where it would be created (Permission denied); pick a writable --checkpoint_dir"),
    "checkpoint_dir without file locks": (
        ["--checkpoint_dir=new"], "--checkpoint_dir=new: its file system has no file locks, which keep a second run out of a "
                                  "checkpoint folder; pick a --checkpoint_dir on one that has them (a local disk)"),
    "another user's lock file": (["--checkpoint_dir=ckpt"],
                                 "--checkpoint_dir=ckpt: cannot open ckpt/.lock (Permission denied); pick another --checkpoint_dir"),
    "log_dir not readable": ([], "logs: cannot use it (Permission denied); fix its permissions or pick another --log_dir or --checkpoint_dir"),
    "disk nearly full": ([], r"--checkpoint_dir=checkpoints/[0-9a-f-]{36}: 10 MiB free, this run needs about \d+ MiB there "
                             r"\(its log and one checkpoint, with a margin\); free some space or pick another --checkpoint_dir"),
    "file-size limit": (["--checkpoint_dir=ckpt"], r"--checkpoint_dir=ckpt: this run writes files of up to about \d\.\d MiB "
                                                   r"there, above the file-size limit of 1\.0 MiB \(ulimit -f\); raise the limit"),
    "name too long": (["--checkpoint_dir=" + "x" * 300], r"--checkpoint_dir: the name x{20}\.\.\. is 300 bytes, longer than "
                                                         r"a file name may be \(255\); pick a shorter --checkpoint_dir"),
}
PATTERNS = ("disk nearly full", "file-size limit", "name too long")


@pytest.mark.parametrize("case", REFUSALS)
def test_outputs_are_checked_before_the_log_exists(workdir, tmp_path_factory, capsys, monkeypatch, case):
    """Each refusal is one line, and the working folder is left as it was: no log, no log or checkpoint folder, no
    lock file (the smoke shards, the run's input, go elsewhere here: DATA_PATH)."""
    monkeypatch.setenv("DATA_PATH", str(tmp_path_factory.mktemp("data")))
    (workdir / "a_file").write_text("mine")
    (workdir / "ckpt").mkdir()
    (workdir / "checkpoints").mkdir()  # earlier runs' default folder
    args, expected = REFUSALS[case]
    if case == "another user's lock file":
        (workdir / "ckpt" / ".lock").write_text("pid 4242 on elsewhere, since 2026-01-01 00:00:00\n")
    if case == "log_dir not readable":
        (workdir / "logs").mkdir()
    before = tree(workdir)
    # root writes anywhere: the refusals of other users' files are stood in for
    if case in ("checkpoint_dir not writable", "checkpoint_dir under a folder not writable"):
        refuse_for(monkeypatch, tgs.tempfile, "TemporaryFile", lambda *a, dir=None, **k: Path(dir).name == "ckpt", errno.EACCES)
    if case == "checkpoint_dir without file locks":
        refuse_for(monkeypatch, tgs.fcntl, "flock", lambda *a: True, errno.ENOLCK)
    if case == "another user's lock file":
        monkeypatch.setattr(tgs, "open", open, raising=False)  # the script's own name for it, refused below for .lock
        refuse_for(monkeypatch, tgs, "open", lambda path, *a, **k: Path(path).name == ".lock", errno.EACCES)
    if case == "log_dir not readable":
        refuse_for(monkeypatch, Path, "iterdir", lambda path: path.name == "logs", errno.EACCES, "logs")
    if case == "disk nearly full":
        real_usage = tgs.shutil.disk_usage
        monkeypatch.setattr(tgs.shutil, "disk_usage", lambda path: real_usage(path)._replace(free=10 * 2**20)
                            if "checkpoints" in Path(path).parts else real_usage(path))
    if case == "file-size limit":
        monkeypatch.setattr(tgs.resource, "getrlimit", lambda which: (2**20, tgs.resource.RLIM_INFINITY))
    status, lines = track3_main(capsys, "--preset=smoke", "--train_steps=4", "--checkpoint_every=2", *args)
    assert status == 2 and len(lines) == 1, lines
    assert re.fullmatch("train_gpt_shampoo.py: error: " + (expected if case in PATTERNS else re.escape(expected)), lines[0]), lines[0]
    assert tree(workdir) == before


# ----- a file system without locks, and other users' files in a shared log folder -----


@pytest.mark.parametrize("script", [tg, tgs], ids=["track1", "track3"])
def test_a_file_system_without_locks_still_takes_atomic_writes(script, tmp_path, monkeypatch):
    """NFS or Lustre mounted without locks: flock fails with ENOLCK. A file is written as before, unlocked; a
    temporary file left there is kept, since nothing tells a killed writer's from a live one's."""
    dead = tmp_path / ".shard.bin.4242.0123abcd.tmp"
    dead.write_bytes(b"half")
    os.utime(dead, (time.time() - 60, time.time() - 60))
    refuse_for(monkeypatch, script.fcntl, "flock", lambda *args: True, errno.ENOLCK)
    script.write_atomically(tmp_path / "state.pt", lambda f: f.write(b"saved"))
    assert (tmp_path / "state.pt").read_bytes() == b"saved"
    assert script.remove_dead_temporaries(tmp_path, time.time()) == [
        f"left {dead}, a writer's temporary file: its file system has no locks to tell whether the writer is alive; remove "
        f"it if no run is writing it"]
    assert sorted(path.name for path in tmp_path.iterdir()) == [dead.name, "state.pt"]


def test_a_smoke_run_needs_no_file_locks(workdir, monkeypatch):
    refuse_for(monkeypatch, tgs.fcntl, "flock", lambda *args: True, errno.ENOLCK)
    result = tgs.run([*QUICK, "--train_steps=1"])
    assert "step:1/1 val_loss:" in result.log_path.read_text()


def test_another_users_dead_temporary_file_is_left_with_one_line(workdir, capsys, monkeypatch):
    """A shared logs/: the temporary file of another user's killed writer, in that user's folder, which this process
    may not change."""
    dead = workdir / "logs" / "their-run" / ".state_step000006.pt.4242.0123abcd.tmp"
    dead.parent.mkdir(parents=True)
    dead.write_bytes(b"half")
    os.utime(dead, (time.time() - 60, time.time() - 60))
    refuse_for(monkeypatch, Path, "unlink", lambda path, *args, **kwargs: path == dead.relative_to(workdir), errno.EACCES)
    tgs.run([*QUICK, "--train_steps=1"])
    assert (f"left {dead.relative_to(workdir)}, a writer's temporary file: cannot remove it (Permission denied)"
            in capsys.readouterr().out.splitlines())
    assert dead.exists()


def test_track1_smoke_checks_its_log_dir_before_the_shards_inside_it(workdir, capsys, monkeypatch):
    """Track 1's smoke shards live in a folder of --log_dir: a --log_dir that is a file is named as such, and nothing
    is created."""
    (workdir / "a_file").write_text("mine")
    monkeypatch.setattr(sys, "argv", ["train_gpt.py", "--preset=smoke", "--log_dir=a_file"])
    capsys.readouterr()
    with pytest.raises(SystemExit) as exit_info:
        tg.main()  # main, not run: it also ends the process group, which later tests start afresh
    assert exit_info.value.code == 2
    assert capsys.readouterr().err.splitlines() == ["train_gpt.py: error: --log_dir=a_file: is a file, not a folder; pick another --log_dir"]
    assert sorted(path.name for path in workdir.iterdir()) == ["a_file"]


@pytest.mark.parametrize("error, remedy", [(errno.ENOSPC, "free space there"), (errno.EACCES, "make that folder writable")])
@pytest.mark.parametrize("script", [tg, tgs], ids=["track1", "track3"])
def test_a_failed_smoke_shard_write_names_the_remedy_of_its_error(script, tmp_path, monkeypatch, error, remedy):
    refuse_for(monkeypatch, script, "write_atomically", lambda path, *args, **kwargs: True, error, "shards/a.bin")
    with pytest.raises(script.UserError) as refusal:
        script.refresh_smoke_shards(tmp_path / "shards", lambda: {"a.bin": np.arange(64, dtype=np.uint16)}, time.time())
    assert str(refusal.value) == (f"smoke shards: cannot write shards/a.bin ({os.strerror(error)}); {remedy} or pass "
                                  f"--train_files and --val_files")


# ----- issue 39 item 3: the file-size limit bounds each file, not their sum -----


def test_the_file_size_limit_is_checked_against_the_largest_file(tmp_path):
    """--save_checkpoint writes the end-of-run state beside the log: a limit above each file's estimated size but
    below their sum lets the run start, and the run writes both files."""
    shards = make_shards(tmp_path / "data")
    hp, _ = tg.parse_args(tiny_args(*shards, tmp_path / "logs"))
    source = (ROOT / "train_gpt.py").read_text()
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    try:  # the model and optimizers as the script builds them, for the script's estimates
        model = tg.build_model(hp, tg.Runtime(0, 1, 0, torch.device("cpu")), "reference", False)
        log_estimate = tg.log_bytes(source, 2 * (hp.train_steps + 1))
        state_estimate = len(source.encode()) + tg.tensor_bytes(model.state_dict()) + tg.optimizer_bytes(tg.build_optimizers(model, hp, 0, 1))
    finally:
        dist.destroy_process_group()
    limit = max(log_estimate, state_estimate) + 4096
    assert limit < log_estimate + state_estimate  # the sum of the two was compared with the limit, and refused
    result = subprocess.run([sys.executable, str(ROOT / "train_gpt.py"), *tiny_args(*shards, tmp_path / "logs", save_checkpoint="true")],
                            capture_output=True, text=True, timeout=300, env=script_env(), cwd=tmp_path,
                            preexec_fn=lambda: resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit)))
    assert result.returncode == 0, result.stderr[-2000:]
    (state,) = (tmp_path / "logs").glob("*/state_step000010.pt")
    assert state.stat().st_size <= limit and torch.load(state, weights_only=True)["step"] == 10


# ----- --save_checkpoint: an end-of-run state file that cannot be written is refused before training -----


@pytest.mark.parametrize("case", ["the state file exists", "its folder is a file"])
def test_track1_save_checkpoint_refuses_an_unwritable_state_file_before_training(tmp_path, case):
    """The end-of-run state, <log_dir>/<run_id>/state_step<N>.pt, was found to exist (or its folder to be a file) only
    at the save, after the whole run, which left its log behind: now the run is refused before the log exists, and
    the earlier file is kept as it was."""
    shards, logs = make_shards(tmp_path / "data"), tmp_path / "logs"
    state = logs / "mine" / "state_step000010.pt"  # tiny_args: 8 + 2 steps
    earlier = state if case == "the state file exists" else state.parent
    earlier.parent.mkdir(parents=True)
    earlier.write_bytes(b"an earlier run's")
    before = tree(logs)
    result = subprocess.run([sys.executable, str(ROOT / "train_gpt.py"), *tiny_args(*shards, logs, save_checkpoint="true", run_id="mine")],
                            capture_output=True, text=True, timeout=300, env=script_env(), cwd=tmp_path)
    assert result.returncode == 2
    expected = (f"{state} already exists; choose another --run_id or move the file away (checkpoints are never overwritten)"
                if earlier == state else
                f"{state.parent} is a file, not a folder, and --save_checkpoint writes {state.name} in it; choose another "
                f"--run_id or move the file away")
    assert result.stderr.splitlines() == [f"train_gpt.py: error: {expected}"]
    assert "step:" not in result.stdout  # no training
    assert tree(logs) == before and earlier.read_bytes() == b"an earlier run's"


# ----- N8, N6/N7: a full disk in the middle of a run -----


class FillingDisk:
    """A file whose disk is full after `room` more bytes."""

    def __init__(self, f, room: int):
        self.f, self.room = f, room

    def write(self, data) -> int:
        data = bytes(data)
        if len(data) > self.room:
            self.f.write(data[: self.room])
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        self.room -= len(data)
        return self.f.write(data)

    def flush(self) -> None:
        self.f.flush()


def test_a_disk_that_fills_during_a_save_stops_the_run_in_one_line(workdir, capsys, monkeypatch):
    original = tgs.HashingWriter.__init__

    def on_filling_disk(self, f):
        original(self, FillingDisk(f, room=1000) if "step000004" in f.name else f)

    monkeypatch.setattr(tgs.HashingWriter, "__init__", on_filling_disk)
    status, lines = track3_main(capsys, *QUICK, "--train_steps=6", "--checkpoint_every=2", "--checkpoint_dir=ckpt")
    expected = ("step 4: cannot write checkpoint ckpt/step000004 (No space left on device); the last complete checkpoint is "
                "ckpt/step000002 (--resume=ckpt/step000002 continues from it)")
    assert status == 2 and lines == [f"train_gpt_shampoo.py: error: {expected}"]
    assert sorted(p.name for p in (workdir / "ckpt").iterdir()) == [".lock", "step000002"]  # the partial save is gone
    (log,) = logs(workdir)
    assert log.read_text().endswith(f"\nerror: {expected}\n")


@pytest.mark.skipif(not Path("/proc/self/fd").is_dir(), reason="tells the log's writes apart by Linux's /proc/self/fd")
def test_a_log_that_cannot_be_written_keeps_whole_lines_and_stops_the_run(workdir, capsys, monkeypatch):
    real_write = os.write

    def full_at_step_4(fd, data):
        if os.readlink(f"/proc/self/fd/{fd}").endswith(".txt") and b"step:4/" in bytes(data):
            real_write(fd, bytes(data)[:10])  # the disk takes part of the line, then is full
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return real_write(fd, data)

    monkeypatch.setattr(tgs.os, "write", full_at_step_4)
    status, lines = track3_main(capsys, *QUICK, "--train_steps=8", "--val_every=2", "--checkpoint_every=3", "--checkpoint_dir=ckpt")
    monkeypatch.undo()
    (log,) = logs(workdir)
    assert status == 2 and lines == [f"step 5: cannot write the log {log.relative_to(workdir)} (No space left on device); stopping; "
                                     f"the last complete checkpoint is ckpt/step000005 (--resume=ckpt/step000005 continues from it)"]
    text = log.read_text()
    assert text.endswith("\ncheckpoint: ckpt/step000003\n") and "step:4/" not in text  # whole lines only
    assert (workdir / "ckpt" / "step000005" / "manifest.json").is_file()  # the stop's checkpoint


def test_a_failed_folder_sync_after_the_rename_is_a_warning_not_a_failed_save(workdir, capsys, monkeypatch):
    """Once renamed into place a checkpoint is complete: syncing its folder then failing (EIO) is said in one line, the
    run goes on and names it as the last complete checkpoint."""
    refuse_for(monkeypatch, tgs, "fsync_directory", lambda path: Path(path) == Path("ckpt"), errno.EIO)
    result = tgs.run([*QUICK, "--train_steps=4", "--checkpoint_every=2", "--checkpoint_dir=ckpt"])
    warning = ("warning: checkpoint ckpt/step000002 is complete, but syncing its folder failed (Input/output error): a crash "
               "of this machine may still lose it")
    assert warning in capsys.readouterr().out.splitlines() and warning in result.log_path.read_text().splitlines()
    for step in (2, 4):
        checkpoint = workdir / "ckpt" / f"step{step:06d}"
        assert tgs.checkpoint_problem(checkpoint, tgs.read_manifest(checkpoint), tgs.checkpoint_file_names(1)) is None
    assert tgs._last_checkpoint == Path("ckpt/step000004")


# ----- N44 and issue 38 item 7: the temporary file of a writer killed by SIGKILL is removed at the next start -----

SLOW_WRITER = """
import sys, time
from pathlib import Path
sys.path.insert(0, sys.argv[1])
import train_gpt_shampoo as tgs
def write(f):
    f.write(b"x" * 1000)
    f.flush()
    print("writing", flush=True)
    time.sleep(600)
tgs.write_atomically(Path(sys.argv[2]), write, replace=False)
"""


def test_a_killed_writers_temporary_file_is_removed_at_the_next_start(workdir, capsys):
    state = workdir / "logs" / "earlier-run" / "state_step000006.pt"  # train_gpt.py's end-of-run state
    state.parent.mkdir(parents=True)
    writer = subprocess.Popen([sys.executable, "-c", SLOW_WRITER, str(ROOT), str(state)], stdout=subprocess.PIPE, text=True)
    assert writer.stdout.readline() == "writing\n"
    writer.kill()
    writer.wait()
    (temporary,) = state.parent.iterdir()
    assert tgs.TEMPORARY_NAME.fullmatch(temporary.name)
    os.utime(temporary, (time.time() - 1, time.time() - 1))  # written before the next run starts
    tgs.run([*QUICK, "--train_steps=1"])
    assert f"removed {temporary.relative_to(workdir)}, the temporary file of a killed writer" in capsys.readouterr().out.splitlines()
    assert list(state.parent.iterdir()) == []


# ----- issue 38 item 7: --checkpoint_every also saves the last step -----


@pytest.mark.parametrize("module", [tg, tgs], ids=["track1", "track3"])
def test_checkpoints_are_written_at_the_multiples_and_the_last_step(module):
    hp, _ = module.parse_args(["--preset=smoke", "--train_steps=7", "--checkpoint_every=3"])
    assert module.checkpoint_steps(hp, 0) == [3, 6, 7]
    assert module.checkpoint_steps(hp, 6) == [7] and module.checkpoint_steps(hp, 7) == []


def test_track3_saves_the_last_step(workdir):
    tgs.run([*QUICK, "--train_steps=5", "--checkpoint_every=2", "--checkpoint_dir=ckpt"])
    assert sorted(p.name for p in (workdir / "ckpt").iterdir()) == [".lock", "step000002", "step000004", "step000005"]
