"""Tests of train_gpt_shampoo.py (the Track 3 Shampoo record script) on CPU with gloo."""

import json
import math
import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
import train_gpt_shampoo as tgs  # noqa: E402

SCRIPT = ROOT / "train_gpt_shampoo.py"
VAL_LINE = re.compile(r"^step:(\d+)/(\d+) val_loss:(\d+\.\d{5}) train_time:(\d+)ms step_avg:(\d+\.\d{2})ms$")
MATRIX_OPTIMIZERS = ["shampoo", "adamw"]


def smoke_run(*args: str) -> tgs.RunResult:
    return tgs.run(["--preset=smoke", *args])


def val_lines(log_path: Path) -> list[str]:
    return [line for line in log_path.read_text().splitlines() if VAL_LINE.match(line)]


# ----- hyperparameters and command line -----


def test_defaults_are_the_record() -> None:
    hp, overrides = tgs.parse_args([])
    assert overrides == {}
    assert (hp.train_steps, hp.cooldown_frac, hp.val_tokens, hp.seq_len, hp.micro_batch_seqs) == (4150, 0.7, 10_485_760, 1024, 64)
    assert (hp.vocab_size, hp.num_layers, hp.model_dim, hp.head_dim) == (50304, 12, 768, 128)
    assert (hp.adam_embed_lr, hp.adam_head_lr, hp.adam_scalar_lr) == (0.3, 1 / 320, 0.01)
    assert (hp.adam_beta1, hp.adam_beta2, hp.adam_eps, hp.adam_weight_decay) == (0.8, 0.95, 1e-10, 0.0)
    assert hp.matrix_optimizer == "shampoo"
    assert (hp.matrix_lr, hp.matrix_beta1, hp.matrix_beta2, hp.matrix_weight_decay) == (0.0015, 0.9, 0.95, 0.2)
    assert (hp.shampoo_max_preconditioner_dim, hp.shampoo_precondition_frequency, hp.shampoo_start_preconditioning_step) == (8192, 5, -1)
    assert (hp.shampoo_grafting_beta2, hp.shampoo_grafting_epsilon) == (0.95, 1e-10)
    assert hp.shampoo_defer_roots is False  # changes the math: never the record's
    assert hp.checkpoint_every == 0 and hp.resume == "" and hp.cycle_train_files is False


def test_overrides_preset_and_explicit_values_win() -> None:
    hp, overrides = tgs.parse_args(["--preset=smoke", "--train_steps=7", "--compile=1", "--cycle_train_files=false"])
    assert hp.train_steps == 7 and hp.compile is True and hp.model_dim == tgs.PRESETS["smoke"]["model_dim"]
    assert overrides == {"preset": "smoke", "train_steps": 7, "compile": True, "cycle_train_files": False}
    assert tgs.Hyperparameters().train_steps == 4150  # defaults untouched


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--no_such_option=1"], "--no_such_option"),
        (["--train_steps=many"], "--train_steps"),
        (["--compile=maybe"], "--compile"),
        (["--matrix_optimizer=sgd"], "--matrix_optimizer"),
        (["--model_dim=100"], "--head_dim"),
        (["--preset=huge"], "--preset"),
        (["4"], "'4'"),
        (["--matrix_beta1=1"], "--matrix_beta1=1.0: must be in [0, 1)"),
        (["--shampoo_start_preconditioning_step=3"], "--shampoo_start_preconditioning_step=3"),
        (["--adam_eps=0"], "--adam_eps=0.0: must be > 0"),
        (["--shampoo_root_streams=0"], "--shampoo_root_streams=0: must be >= 1"),
        (["--shampoo_root_memory_fraction=-1"], "--shampoo_root_memory_fraction=-1.0: must be >= 0"),
        (["--shampoo_root_memory_fraction=nan"], "argument --shampoo_root_memory_fraction: must be a finite number, got 'nan'"),
    ],
)
def test_bad_arguments_give_one_line_errors(argv: list[str], message: str) -> None:
    with pytest.raises(tgs.UserError, match=re.escape(message)) as error:
        tgs.parse_args(argv)
    assert "\n" not in str(error.value)


# ----- model, init, split -----


def test_record_model_inventory_and_split() -> None:
    with torch.device("meta"):
        model = tgs.GPT(50304, 12, 768, 128)
    names = [name for name, _ in model.named_parameters()]
    assert names[:9] == ["embed.weight", "blocks.0.attn.q.weight", "blocks.0.attn.q.bias", "blocks.0.attn.k.weight",
                         "blocks.0.attn.k.bias", "blocks.0.attn.v.weight", "blocks.0.attn.v.bias",
                         "blocks.0.attn.proj.weight", "blocks.0.attn.proj.bias"]
    assert names[-4:] == ["proj.weight", "proj.bias", "norm1.gains", "norm2.gains"]
    assert model.embed.weight.dtype == torch.bfloat16
    groups = tgs.split_parameters(model)
    assert [len(groups[k]) for k in ("embed", "head", "scalars", "matrices")] == [1, 1, 12 * 8 + 3, 72]
    shapes = shape_counts(groups["matrices"])
    assert shapes == {(768, 768): 48, (3072, 768): 12, (768, 3072): 12}
    total = sum(p.numel() for p in model.parameters())
    assert 162_000_000 < total < 163_000_000


def test_record_shampoo_keeps_every_matrix_one_block_with_full_factors() -> None:
    """max_preconditioner_dim 8192: no blocking and no merging, so each matrix gets L (m x m) and R (n x n)."""
    hp, _ = tgs.parse_args([])
    with torch.device("meta"):
        model = tgs.GPT(hp.vocab_size, hp.num_layers, hp.model_dim, hp.head_dim)
    matrices = tgs.split_parameters(model)["matrices"]
    optimizer = tgs.build_shampoo(matrices, hp, world_size=1)
    group = optimizer.param_groups[0]
    assert (group["start_preconditioning_step"], group["beta3"], group["epsilon"]) == (5, 0.9, 1e-12)
    state = optimizer.state_dict()["state"]
    for index, param in enumerate(matrices):
        assert [key for key in state[index] if key.startswith("block")] == ["block_0"]
        factors = state[index]["block_0"]["shampoo"]["factor_matrices"]
        m, n = param.shape
        assert (tuple(factors[0].shape), tuple(factors[1].shape)) == ((m, m), (n, n))


def test_root_stream_settings_reach_the_preconditioner() -> None:
    hp, _ = tgs.parse_args(["--shampoo_root_streams=3", "--shampoo_root_memory_fraction=inf"])
    matrices = [torch.nn.Parameter(torch.zeros(16, 8)), torch.nn.Parameter(torch.zeros(8, 8))]
    shampoo_list = tgs.build_shampoo(matrices, hp, world_size=1)._group_runtimes[0].shampoo
    assert (shampoo_list._num_amortized_computation_streams, shampoo_list._concurrent_memory_fraction) == (3, float("inf"))
    assert shampoo_list.defers_amortized_computation is False


def test_deferred_roots_reach_the_preconditioner() -> None:
    hp, _ = tgs.parse_args(["--shampoo_defer_roots=true"])
    matrices = [torch.nn.Parameter(torch.zeros(16, 8))]
    assert tgs.build_shampoo(matrices, hp, world_size=1)._group_runtimes[0].shampoo.defers_amortized_computation is True


def shape_counts(params: list[torch.Tensor]) -> dict[tuple[int, ...], int]:
    counts: dict[tuple[int, ...], int] = {}
    for p in params:
        counts[tuple(p.shape)] = counts.get(tuple(p.shape), 0) + 1
    return counts


def tiny_model() -> tgs.GPT:
    torch.manual_seed(0)
    model = tgs.GPT(vocab_size=96, num_layers=2, dim=32, head_dim=8)
    tgs.init_parameters(model)
    return model


def test_init_rules_and_zero_head_gives_log_vocab_loss() -> None:
    model = tiny_model()
    block = model.blocks[0]
    for zero in (block.attn.proj.weight, block.mlp.proj.weight, model.proj.weight, block.attn.q.bias, model.proj.bias):
        assert torch.count_nonzero(zero) == 0
    assert torch.all(block.norm1.gains == 1) and torch.all(model.norm2.gains == 1)
    assert abs(block.mlp.fc.weight.std().item() - math.sqrt(0.33 / 32)) < 0.1 * math.sqrt(0.33 / 32)
    assert abs(model.embed.weight.float().std().item() - 1.0) < 0.1
    inputs = torch.randint(0, 96, (2, 16))
    loss = model(inputs, inputs)
    assert loss.dtype == torch.float32
    assert loss.item() == pytest.approx(2 * 16 * math.log(96), rel=1e-6)  # summed, not averaged


def test_softcap_and_rotary() -> None:
    model = tiny_model()
    with torch.no_grad():
        model.proj.bias.fill_(1000.0)  # huge logits saturate at 15, never beyond
        model.proj.bias[0] = 0.0
    inputs = torch.zeros(1, 4, dtype=torch.int64)
    targets = torch.ones(1, 4, dtype=torch.int64)
    # target 1 has logit ~15, all others too except index 0: loss = log(95 e^15 + e^0) - 15 per token
    expected = 4 * (math.log(95 * math.exp(15 * 1000 / math.sqrt(1000**2 + 225)) + 1) - 15 * 1000 / math.sqrt(1000**2 + 225))
    assert model(inputs, targets).item() == pytest.approx(expected, rel=1e-3)
    rotary = tgs.Rotary(8)
    assert torch.equal(rotary.frequencies[2:], torch.zeros(2)) and rotary.frequencies[0] == 1.0
    assert rotary.frequencies[1].item() == pytest.approx(1 / 1024)
    x = torch.randn(1, 5, 2, 8)
    y = rotary(x)
    assert torch.allclose(y[:, 0], x[:, 0])  # position 0 is not rotated
    assert torch.allclose(y.norm(dim=-1), x.norm(dim=-1), atol=1e-5)  # a rotation


def test_split_covers_every_parameter_once() -> None:
    model = tiny_model()
    groups = tgs.split_parameters(model)
    everything = [p for params in groups.values() for p in params]
    assert len(everything) == len(list(model.parameters())) == len({id(p) for p in everything})


def test_coverage_assertion_catches_a_missing_parameter() -> None:
    model = tiny_model()
    model.extra = nn.Parameter(torch.zeros(3, 3))  # 2-D but outside the blocks: no group takes it
    with pytest.raises(RuntimeError, match=r"missing \['extra'\]"):
        tgs.split_parameters(model)


def test_coverage_assertion_catches_a_duplicated_parameter() -> None:
    model = tiny_model()
    model.blocks[0].tied = model.embed.weight  # the embedding also lands among the block matrices
    with pytest.raises(RuntimeError, match=r"in more than one group \['embed.weight'"):
        tgs.split_parameters(model)


def test_coverage_assertion_catches_a_foreign_parameter() -> None:
    model = tiny_model()
    params = list(model.parameters())
    with pytest.raises(RuntimeError, match="1 not in the model"):
        tgs.check_parameter_coverage(model, [params, [nn.Parameter(torch.zeros(2))]])


# ----- schedule -----


def test_lr_schedule_and_validation_cadence_of_the_record() -> None:
    hp = tgs.Hyperparameters()
    assert tgs.lr_multiplier(0, hp) == 1.0 and tgs.lr_multiplier(1244, hp) == 1.0
    assert tgs.lr_multiplier(1245, hp) == pytest.approx(1.0)
    assert tgs.lr_multiplier(4100, hp) == pytest.approx(0.01721, abs=1e-5)
    assert tgs.lr_multiplier(4150, hp) == 0.0
    steps = [s for s in range(hp.train_steps + 1) if tgs.is_validation_step(s, hp)]
    assert steps[:3] == [0, 125, 250]
    assert [s for s in steps if s >= 3500] == [3500, 3625] + list(range(3750, 4151, 25))


# ----- data -----


def write_shard(path: Path, tokens: list[int] | np.ndarray) -> None:
    tgs.write_shard(path, np.asarray(tokens, dtype=np.int64))


def test_loader_slices_ranks_drops_tails_and_resumes(tmp_path: Path) -> None:
    write_shard(tmp_path / "a.bin", np.arange(20) % 100)
    write_shard(tmp_path / "b.bin", 100 + np.arange(20))
    files = [tmp_path / "a.bin", tmp_path / "b.bin"]
    cpu = torch.device("cpu")
    rank1 = tgs.TokenLoader(files, batch_tokens=8, seq_len=2, rank=1, world_size=2, vocab_size=200, device=cpu)
    inputs, targets = rank1.next_batch()
    assert inputs.dtype == torch.int32 and targets.dtype == torch.int64
    assert inputs.tolist() == [[4, 5], [6, 7]] and targets.tolist() == [[5, 6], [7, 8]]
    rank1.next_batch()  # positions 8..16 (+1) fit in 20 tokens
    inputs, _ = rank1.next_batch()  # 16 + 8 + 1 >= 20: the tail of a.bin is dropped
    assert inputs.flatten().tolist() == [104, 105, 106, 107]
    state = rank1.state_dict()
    expected = rank1.next_batch()
    fresh = tgs.TokenLoader(files, batch_tokens=8, seq_len=2, rank=1, world_size=2, vocab_size=200, device=cpu)
    fresh.load_state_dict(state)
    assert all(torch.equal(a, b) for a, b in zip(fresh.next_batch(), expected))
    with pytest.raises(tgs.UserError, match="out of training data.*--cycle_train_files"):
        rank1.next_batch()
    cycling = tgs.TokenLoader(files, batch_tokens=8, seq_len=2, rank=0, world_size=2, vocab_size=200, device=cpu, cycle=True)
    first = cycling.next_batch()[0]
    for _ in range(3):
        cycling.next_batch()
    assert torch.equal(cycling.next_batch()[0], first) and cycling.passes == 1


def test_shard_errors_name_the_file(tmp_path: Path) -> None:
    bad_magic = tmp_path / "magic.bin"
    bad_magic.write_bytes(np.zeros(256 + 10, dtype="<i4").tobytes())
    with pytest.raises(tgs.UserError, match="magic.bin: not a token shard"):
        tgs.read_shard_header(bad_magic)
    truncated = tmp_path / "short.bin"
    write_shard(truncated, range(50))
    truncated.write_bytes(truncated.read_bytes()[:-2])
    with pytest.raises(tgs.UserError, match="short.bin: 1122 bytes, header promises 1124"):
        tgs.read_shard_header(truncated)
    big = tmp_path / "big.bin"
    write_shard(big, [1, 2, 500])
    with pytest.raises(tgs.UserError, match="big.bin: token id 500 >= --vocab_size=100"):
        tgs.read_shard(big, vocab_size=100)
    with pytest.raises(tgs.UserError, match=r"no files match .*nothing_\*\.bin.*cached_fineweb10B\.py 22"):
        tgs.resolve_files(str(tmp_path / "nothing_*.bin"), "train")


# ----- end to end, one process -----


@pytest.mark.parametrize("matrix_optimizer", MATRIX_OPTIMIZERS)
def test_smoke_run_learns_and_logs_in_the_record_format(workdir: Path, matrix_optimizer: str) -> None:
    result = smoke_run(f"--matrix_optimizer={matrix_optimizer}", "--train_steps=8", "--val_every=4")
    lines = val_lines(result.log_path)
    assert [VAL_LINE.match(line).group(1) for line in lines] == ["0", "4", "8"]
    assert re.fullmatch(r"step:0/8 val_loss:6\.2383[23] train_time:0ms step_avg:0\.\d{2}ms", lines[0]), lines[0]
    losses = result.trials[0].val_losses
    assert losses[0] == pytest.approx(math.log(512), abs=1e-5)  # zero head
    assert losses[8] < losses[0] - 0.5
    text = result.log_path.read_text()
    after_header = text.split(tgs.SEPARATOR + "\n", 1)[1]
    for expected in ("Running Python ", "Running PyTorch ", "Running Triton version ", "nvidia-smi: not available",
                     "device: cpu", "world_size: 1", "grad_accum_steps: 8", "git_commit: ",
                     "overrides: {'preset': 'smoke'", "hyperparameters: {", "train_files: 2 files, 65536 tokens",
                     "val_files: 1 files, 8192 tokens", "param_group matrices: "):
        assert expected in after_header
    tail = text.splitlines()
    assert tail[-1] == "peak memory allocated: 0 MiB reserved: 0 MiB"
    assert re.fullmatch(r"warmup_time: \d+\.\ds", [l for l in tail if l.startswith("warmup_time")][0])
    assert not any(line.startswith("step:1/") for line in tail)  # train lines go to the console only


def split_embedded_sources(log_text: str) -> dict[str, str]:
    """The log's program: the text before the first 100-'=' line, split at the package banners."""
    program = log_text.split("\n" + tgs.SEPARATOR + "\n", 1)[0] + "\n"
    files: dict[str, list[str]] = {"train_gpt_shampoo.py": []}
    current = "train_gpt_shampoo.py"
    for line in program.splitlines(keepends=True):
        banner = re.fullmatch(r"# ===== (\S+) =====\n", line)
        if banner:
            current = banner.group(1)
            files[current] = []
        else:
            files[current].append(line)
    return {name: "".join(lines) for name, lines in files.items()}


REPORT_IMPORTS = """
import json, runpy, sys
sys.argv = sys.argv[1:]
try:
    runpy.run_path(sys.argv[0], run_name="__main__")
finally:
    files = {getattr(module, "__file__", None) for name, module in list(sys.modules.items())
             if name.split(".")[0] == "distributed_shampoo"}
    print("imported:", json.dumps(sorted(str(f) for f in files if f)))
"""


def test_log_embeds_the_script_and_exactly_the_modules_the_run_imports(workdir: Path) -> None:
    result = smoke_run("--train_steps=1")
    sources = split_embedded_sources(result.log_path.read_text())
    assert sources.pop("train_gpt_shampoo.py") == SCRIPT.read_text()
    assert "distributed_shampoo/distributed_shampoo.py" in sources and "distributed_shampoo/__init__.py" in sources
    for name, text in sources.items():
        assert text == (ROOT / name).read_text(), name
    # tools/records.py extract rebuilds the files from the log; the rebuilt script runs in a fresh process,
    # which imports exactly the package modules its log embeds
    rebuilt = workdir / "rebuilt"
    done = subprocess.run([sys.executable, str(ROOT / "tools" / "records.py"), "extract", str(result.log_path), "-o",
                           str(rebuilt / "train_gpt_shampoo.py")], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert (rebuilt / "train_gpt_shampoo.py").read_text() == SCRIPT.read_text()
    assert sorted(p.relative_to(rebuilt).as_posix() for p in rebuilt.rglob("*.py")) == sorted(["train_gpt_shampoo.py", *sources])
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_PORT")}
    rerun = subprocess.run([sys.executable, "-c", REPORT_IMPORTS, str(rebuilt / "train_gpt_shampoo.py"), "--preset=smoke",
                            "--train_steps=1"], cwd=rebuilt, env={**env, "OMP_NUM_THREADS": "1"},
                           capture_output=True, text=True, timeout=300)
    assert rerun.returncode == 0, rerun.stderr[-3000:]
    imported = json.loads(re.search(r"^imported: (.*)$", rerun.stdout, re.M).group(1))
    assert sorted(Path(f).resolve().relative_to(rebuilt.resolve()).as_posix() for f in imported) == sorted(sources)
    rerun_log = (rebuilt / re.search(r"log: (\S+)", rerun.stdout).group(1)).read_text()
    assert split_embedded_sources(rerun_log) == {"train_gpt_shampoo.py": SCRIPT.read_text(), **sources}


def test_embedded_modules_follow_the_imports_that_run(tmp_path: Path) -> None:
    """Only what the entry's imports reach: parent packages and imports inside functions count, modules
    imported only for type checking, never imported or test modules do not."""
    files = {
        "run.py": "import pkg\n",
        "pkg/__init__.py": "from pkg.a import f\n",
        "pkg/a.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from pkg import b\n"
                    "def f():\n    from pkg.sub import c\n    return c\n",
        "pkg/b.py": "", "pkg/sub/__init__.py": "", "pkg/sub/c.py": "import os\n", "pkg/unused.py": "",
        "pkg/tests/a_test.py": "import pkg.unused\n",
    }
    for name, text in files.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    found = tgs.imported_package_files(tmp_path / "run.py", tmp_path / "pkg")
    assert [p.relative_to(tmp_path).as_posix() for p in found] == ["pkg/__init__.py", "pkg/a.py", "pkg/sub/__init__.py", "pkg/sub/c.py"]


def test_shampoo_steps_before_preconditioning_equal_the_adamw_ablation(workdir: Path) -> None:
    """Shampoo's steps 1-4 are its grafting Adam alone: the ablation must match them closely."""
    args = ["--train_steps=4", "--val_every=2", "--cooldown_frac=0"]
    shampoo = smoke_run("--matrix_optimizer=shampoo", *args).trials[0].val_losses
    adamw = smoke_run("--matrix_optimizer=adamw", *args).trials[0].val_losses
    assert shampoo.keys() == adamw.keys()
    for step in shampoo:
        assert shampoo[step] == pytest.approx(adamw[step], abs=2e-4), step
    assert shampoo[4] < shampoo[0] - 0.1


# ----- checkpoints -----


@pytest.mark.parametrize("matrix_optimizer", MATRIX_OPTIMIZERS)
def test_resume_equals_the_uninterrupted_run_bit_for_bit(workdir: Path, matrix_optimizer: str) -> None:
    common = [f"--matrix_optimizer={matrix_optimizer}", "--train_steps=6", "--val_every=2", "--late_frac=1",
              "--shampoo_precondition_frequency=2"]
    straight = smoke_run(*common, "--checkpoint_every=3", "--checkpoint_dir=ckpt")
    checkpoint = workdir / "ckpt" / "step000003"
    assert (checkpoint / "manifest.json").is_file() and (checkpoint / "rank0.pt").is_file()
    assert not list((workdir / "ckpt").glob(".*partial*"))
    resumed = smoke_run(*common, f"--resume={checkpoint}")
    assert resumed.log_path != straight.log_path
    assert f"resumed_from: {checkpoint} (run {straight.log_path.stem}) at trial 0 step 3" in resumed.log_path.read_text()
    straight_losses, resumed_losses = straight.trials[0].val_losses, resumed.trials[0].val_losses
    assert sorted(resumed_losses) == [4, 6]
    for step in (4, 6):
        assert resumed_losses[step] == straight_losses[step]  # exact
    for (name, a), (_, b) in zip(straight.model.named_parameters(), resumed.model.named_parameters()):
        assert torch.equal(a, b), name
    # the resumed run's own checkpoints go elsewhere and the original stays as it was (with its final step's)
    assert sorted(p.name for p in (workdir / "ckpt").iterdir()) == [".lock", "step000003", "step000006"]


def test_deferred_roots_change_the_run_from_the_first_preconditioned_step_and_resume_exactly(workdir: Path) -> None:
    """--shampoo_defer_roots, frequency 2 from step 4: steps 1-3 are the grafting Adam alone either way; step 4
    preconditions with its own roots in the record and with the initial ones when deferred (its roots are computed
    in the background and first used by step 5), so the runs agree at step 2 and part at 4. A checkpoint taken right
    after step 4, its roots still computing, resumes bit for bit."""
    common = ["--train_steps=6", "--val_every=2", "--late_frac=1", "--shampoo_precondition_frequency=2",
              "--shampoo_start_preconditioning_step=4"]
    record = smoke_run(*common).trials[0].val_losses
    straight = smoke_run(*common, "--shampoo_defer_roots=true", "--checkpoint_every=4", "--checkpoint_dir=ckpt")
    deferred = straight.trials[0].val_losses
    assert deferred[2] == record[2] and deferred[4] != record[4]
    assert all(math.isfinite(loss) for loss in deferred.values())
    resumed = smoke_run(*common, "--shampoo_defer_roots=true", f"--resume={workdir / 'ckpt' / 'step000004'}")
    assert resumed.trials[0].val_losses[6] == deferred[6]
    for (name, a), (_, b) in zip(straight.model.named_parameters(), resumed.model.named_parameters()):
        assert torch.equal(a, b), name


def test_a_failure_of_deferred_roots_stops_in_one_line_at_a_checkpoint(workdir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The roots step 4 leaves computing fail; the checkpoint after it waits for them and the run stops with
    Shampoo's finding, naming step 4 (a traceback from state_dict() before)."""
    from distributed_shampoo.preconditioner import shampoo_preconditioner_list as shampoo_list

    def fail(self, blocks=None):
        raise tgs.PreconditionerValueError("Encountered nan/inf values in factor matrix 0.block_0.0! To mitigate, check inputs.")

    monkeypatch.setattr(shampoo_list.BaseShampooPreconditionerList, "_amortized_computation", fail)
    with pytest.raises(tgs.RunStopped, match=r"^step 4: Shampoo: Encountered nan/inf values in factor matrix 0\.block_0\.0! \(.+\); stopping$"):
        smoke_run("--train_steps=6", "--val_every=6", "--shampoo_precondition_frequency=2",
                  "--shampoo_start_preconditioning_step=4", "--shampoo_defer_roots=true", "--checkpoint_every=4",
                  "--checkpoint_dir=ckpt")
    assert not (workdir / "ckpt" / "step000004").exists()


def test_checkpointing_does_not_change_the_run(workdir: Path) -> None:
    common = ["--matrix_optimizer=adamw", "--train_steps=4", "--val_every=2"]
    plain = smoke_run(*common).trials[0].val_losses
    with_checkpoints = smoke_run(*common, "--checkpoint_every=1").trials[0].val_losses
    assert plain == with_checkpoints
    assert len(list((workdir / "checkpoints").glob("*/step00000[123]"))) == 3


def test_bad_resume_paths_and_settings_are_refused(workdir: Path) -> None:
    smoke_run("--matrix_optimizer=adamw", "--train_steps=4", "--checkpoint_every=2", "--checkpoint_dir=ckpt")
    good = workdir / "ckpt" / "step000002"
    with pytest.raises(tgs.UserError, match="missing .*manifest.json"):
        smoke_run("--matrix_optimizer=adamw", "--train_steps=4", f"--resume={workdir / 'nowhere'}")
    with pytest.raises(tgs.UserError, match="train_steps=4 there, 5 here"):
        smoke_run("--matrix_optimizer=adamw", "--train_steps=5", f"--resume={good}")
    with pytest.raises(tgs.UserError, match="written by 1 processes"):
        tgs.checkpoint_manifest(str(good), world_size=2)
    interrupted = workdir / "ckpt" / "step000003"  # a save killed before its rename leaves no manifest
    interrupted.mkdir()
    (interrupted / "shared.pt").write_bytes(b"partial")
    with pytest.raises(tgs.UserError, match="no complete checkpoint"):
        smoke_run("--matrix_optimizer=adamw", "--train_steps=4", f"--resume={interrupted}")


def test_existing_checkpoints_are_never_overwritten(workdir: Path) -> None:
    taken = workdir / "ckpt" / "step000002"
    taken.mkdir(parents=True)
    (taken / "keep.txt").write_text("mine")
    with pytest.raises(tgs.UserError, match="step000002 already exists"):
        smoke_run("--matrix_optimizer=adamw", "--train_steps=4", "--checkpoint_every=2", "--checkpoint_dir=ckpt")
    assert (taken / "keep.txt").read_text() == "mine"


# ----- command line errors through main() -----


@pytest.mark.parametrize(
    "args, env, message",
    [
        (["--preset=smoke", "--matrix_optimizer=adamw"], {"WORLD_SIZE": "3"}, "WORLD_SIZE=3: must divide 8"),
        (["--train_files=nothing/*.bin"], {}, "no files match 'nothing/*.bin'"),
        (["--train_steps=x"], {}, "--train_steps: invalid int value"),
        (["--preset=smoke", "--val_tokens=1000"], {}, "--val_tokens = 1000 tokens must split into"),
        (["--preset=smoke", "--val_tokens=8192"], {}, "/data/smoke/v512/smoke_val_*.bin): "),
    ],
)
def test_main_reports_user_errors_in_one_line(workdir: Path, monkeypatch: pytest.MonkeyPatch,
                                              capsys: pytest.CaptureFixture, args: list[str],
                                              env: dict[str, str], message: str) -> None:
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    with pytest.raises(SystemExit) as exit_info:
        tgs.main(args)
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("train_gpt_shampoo.py: error: ") and message in err, err


# ----- two processes -----


@pytest.mark.slow
@pytest.mark.parametrize("matrix_optimizer", MATRIX_OPTIMIZERS)
def test_two_gloo_processes_match_one(workdir: Path, matrix_optimizer: str) -> None:
    args = ["--preset=smoke", f"--matrix_optimizer={matrix_optimizer}", "--train_steps=6", "--val_every=3",
            "--shampoo_precondition_frequency=2"]
    one = tgs.run(args)
    two_log, two_text = torchrun(args, workdir)
    assert "world_size: 2" in two_text and "grad_accum_steps: 4" in two_text
    losses_one = [float(VAL_LINE.match(line).group(3)) for line in val_lines(one.log_path)]
    losses_two = [float(VAL_LINE.match(line).group(3)) for line in val_lines(two_log)]
    assert len(losses_one) == len(losses_two) == 3
    assert losses_two == pytest.approx(losses_one, abs=2e-4)  # same math, another reduction order
    assert losses_one[-1] < losses_one[0] - 0.3


def torchrun(args: list[str], cwd: Path) -> tuple[Path, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_PORT")}
    env["OMP_NUM_THREADS"] = "1"
    done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", "--standalone",
                           str(SCRIPT), *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    log = cwd / re.search(r"log: (\S+)", done.stdout).group(1)
    return log, log.read_text()


@pytest.mark.slow
def test_two_process_shampoo_resume_is_exact(tmp_path: Path) -> None:
    """Under DDP each rank checkpoints its own share of the Shampoo state."""
    args = ["--preset=smoke", "--train_steps=6", "--val_every=3", "--shampoo_precondition_frequency=2"]
    _, straight = torchrun(args + ["--checkpoint_every=4", "--checkpoint_dir=ckpt"], tmp_path)
    checkpoint = tmp_path / "ckpt" / "step000004"
    assert sorted(p.name for p in checkpoint.iterdir()) == ["manifest.json", "rank0.pt", "rank1.pt", "shared.pt"]
    _, resumed = torchrun(args + [f"--resume={checkpoint}"], tmp_path)
    assert "resumed_from: " in resumed and "world_size: 2" in resumed
    last = [line for line in straight.splitlines() if line.startswith("step:6/6 val_loss:")][0]
    resumed_last = [line for line in resumed.splitlines() if line.startswith("step:6/6 val_loss:")][0]
    assert resumed_last.split(" train_time")[0] == last.split(" train_time")[0]


def test_smoke_shards_are_keyed_by_vocabulary_and_a_damaged_one_is_rewritten(workdir: Path, capsys: pytest.CaptureFixture) -> None:
    """Issue 39 O5/N42: after a 0-byte shard, or another vocabulary's shards, a smoke run rewrites or adds its own."""
    small = smoke_run("--matrix_optimizer=adamw", "--train_steps=1")
    folder = workdir / "data" / "smoke" / "v512"
    shard = folder / "smoke_val_000000.bin"
    stamp = shard.stat().st_mtime_ns
    assert smoke_run("--matrix_optimizer=adamw", "--train_steps=1").trials[0].val_losses == small.trials[0].val_losses
    assert shard.stat().st_mtime_ns == stamp  # identical bytes: kept as they were
    shard.write_bytes(b"")
    capsys.readouterr()
    assert smoke_run("--matrix_optimizer=adamw", "--train_steps=1").trials[0].val_losses == small.trials[0].val_losses
    rewritten = f"smoke shards: rewriting {shard.relative_to(workdir)}, whose bytes are not this smoke run's"
    assert rewritten in capsys.readouterr().out.splitlines()
    larger = smoke_run("--matrix_optimizer=adamw", "--train_steps=1", "--vocab_size=1024")
    assert larger.trials[0].val_losses[0] == pytest.approx(math.log(1024), abs=1e-5)
    assert sorted(p.name for p in (workdir / "data" / "smoke").iterdir()) == ["v1024", "v512"]


def test_trials_share_the_log_and_start_fresh(workdir: Path) -> None:
    result = smoke_run("--matrix_optimizer=adamw", "--num_trials=2", "--train_steps=2", "--checkpoint_every=1")
    assert [line.split(" val_loss")[0] for line in val_lines(result.log_path)] == ["step:0/2", "step:2/2"] * 2
    first, second = (trial.val_losses for trial in result.trials)
    assert first[0] == second[0]  # zero head: ln(vocab) whatever the init
    assert first[2] != second[2]  # the second trial draws a new init
    names = sorted(p.name for p in (workdir / "checkpoints").glob("*/*"))
    assert names == [".lock", "trial0_step000001", "trial0_step000002", "trial1_step000001", "trial1_step000002"]


@pytest.mark.parametrize(("status", "expected"), [("", "abc123"), ("M train_gpt_shampoo.py", "abc123 (modified)"),
                                                   (None, "abc123")])
def test_git_commit_marks_modified_tracked_files(monkeypatch: pytest.MonkeyPatch, status: str | None, expected: str) -> None:
    answers = {"rev-parse": "abc123", "status": status}
    monkeypatch.setattr(tgs, "_command_output", lambda command: answers[command[1]])
    assert tgs.git_commit() == expected


def test_val_and_train_lines_of_a_step_agree_on_step_avg(workdir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Both average the training time over every step so far (the val line used to average since the last validation:
    141.68 against 138.75 ms at one step in a probe), and step 0 reads a number, not nan."""
    smoke_run("--matrix_optimizer=adamw", "--train_steps=8", "--val_every=4")
    lines = capsys.readouterr().out.splitlines()
    average = lambda line: float(re.search(r"step_avg:(\S+)ms", line)[1])
    for step in (4, 8):
        train_line = next(line for line in lines if line.startswith(f"step:{step}/8 train_time:"))
        val_line = next(line for line in lines if line.startswith(f"step:{step}/8 val_loss:"))
        assert average(val_line) == pytest.approx(average(train_line), rel=0.05), (train_line, val_line)
    assert re.fullmatch(r"\d+\.\d{2}", re.search(r"step_avg:(\S+)ms", next(l for l in lines if l.startswith("step:0/8 val_loss:")))[1])
