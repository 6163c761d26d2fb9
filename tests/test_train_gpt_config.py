"""Command line, schedules (the boundary steps of docs/track1_recipe.md#schedules and
docs/track1_recipe.md#attention-windows), YaRN and bad-input errors of train_gpt.py."""

import dataclasses
import importlib.metadata
import math
import subprocess
import sys

import pytest
import torch

import train_gpt as tg
import train_gpt_shampoo as tgs
from conftest import ROOT


def test_defaults_are_the_record():
    hp, overrides = tg.parse_args([])
    assert overrides == {}
    assert (hp.train_batch_size, hp.val_batch_size, hp.val_tokens, hp.train_max_seq_len) == (393_216, 2_097_152, 10_485_760, 2048)
    assert (hp.num_iterations, hp.iteration_extension, hp.cooldown_frac, hp.val_loss_every) == (1640, 40, 0.5, 125)
    assert (hp.ws_schedule, hp.ws_validate, hp.ws_long_validate, hp.block_size) == ((3, 7, 11), 13, 20, 128)
    assert (hp.adam_lr, hp.muon_lr, hp.adam_beta1, hp.adam_beta2, hp.adam_eps) == (0.008, 0.05, 0.8, 0.95, 1e-8)
    assert hp.train_files == "data/fineweb10B/fineweb_train_*.bin" and hp.compile and not hp.save_checkpoint


def test_preset_and_explicit_overrides():
    hp, overrides = tg.parse_args(["--preset=smoke", "--model_dim=96", "--compile=1", "--ws_schedule=2,4", "--disable_fp8=TRUE"])
    assert hp.model_dim == 96 and hp.num_heads == tg.PRESETS["smoke"]["num_heads"]  # explicit wins, preset fills
    assert hp.compile is True and hp.disable_fp8 is True and hp.ws_schedule == (2, 4)
    assert overrides == {"preset": "smoke", "model_dim": 96, "compile": True, "ws_schedule": (2, 4), "disable_fp8": True}


@pytest.mark.parametrize(
    "argv, fragment",
    [
        (["--no_such_option=1"], "--no_such_option"),
        (["--num_iterations=abc"], "--num_iterations"),
        (["--compile=maybe"], "--compile"),
        (["--preset=huge"], "--preset"),
        (["--attention_backend=fa2"], "--attention_backend"),
        (["--mlp_kernel=cublas"], "--mlp_kernel"),
        (["--val_tokens=1000"], "--val_tokens"),
        (["--train_batch_size=1000"], "--train_batch_size"),
        (["--model_dim=100"], "--model_dim"),
        (["--bos_token=60000"], "--bos_token"),
    ],
)
def test_bad_command_line_values_name_the_option(argv, fragment):
    with pytest.raises(tg.UserError) as info:
        tg.parse_args(argv)
    message = str(info.value)
    assert fragment in message and "\n" not in message


# every int-tuple setting of both scripts (train_gpt_shampoo.py has none: bool, int, float and str only)
INT_TUPLE_FLAGS = [f.name for f in dataclasses.fields(tg.Hyperparameters) if f.type == tuple[int, ...]]


@pytest.mark.parametrize("value", ["3,,7", "3,7,", ",3", "", "3,x", "(3,,7)", "(,)", "(7,,)"])
def test_int_tuple_flags_refuse_empty_and_non_integer_items_naming_the_flag(value):
    """3,,7 was read as (3, 7) without a word; 3,x was refused as an "invalid _parse_int_tuple value"."""
    assert INT_TUPLE_FLAGS == ["ws_schedule"]
    assert {f.type for f in dataclasses.fields(tgs.Hyperparameters)} == {bool, int, float, str}
    for name in INT_TUPLE_FLAGS:
        with pytest.raises(tg.UserError) as info:
            tg.parse_args([f"--{name}={value}"])
        assert str(info.value) == (f"argument --{name}: expected comma-separated whole numbers such as 3,7,11 (no empty items), "
                                   f"got {value!r} (see --help)")


def test_int_tuple_flags_take_parentheses_and_spaces():
    """Python's tuple syntax too, as the log's hyperparameters print it: (7,) is one window."""
    texts = ("(3, 7, 11)", " 2 , 4 ", "5", "(7,)", "(3, 7,)", str((3, 7, 11)), str((7,)))
    assert [tg.parse_args([f"--ws_schedule={text}"])[0].ws_schedule for text in texts] == [(3, 7, 11), (2, 4), (5,), (7,), (3, 7), (3, 7, 11), (7,)]


def test_bad_world_size_is_a_one_line_error(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "3")
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("LOCAL_RANK", "0")
    with pytest.raises(tg.UserError, match="WORLD_SIZE=3"):
        tg.setup_distributed()


def test_main_reports_user_errors_in_one_line(tmp_path):
    result = subprocess.run(
        [sys.executable, str(ROOT / "train_gpt.py"), f"--train_files={tmp_path}/nothing_*.bin", f"--log_dir={tmp_path}"],
        capture_output=True,
        text=True,
        timeout=120,
        env={"PATH": "/usr/bin:/bin", "OMP_NUM_THREADS": "1"},
        cwd=tmp_path,
    )
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "nothing_*.bin" in lines[0] and "python data/cached_fineweb10B.py 9" in lines[0], result.stderr
    assert list(tmp_path.iterdir()) == [], "no log is created for a run that cannot start"


@pytest.mark.parametrize(
    "step, expected",
    [(0, (1, 3)), (546, (1, 3)), (547, (3, 7)), (1093, (3, 7)), (1094, (5, 11)), (1639, (5, 11)), (1679, (5, 11)), (1680, (6, 13))],
)
def test_window_schedule_boundaries(step, expected):
    assert tg.window_blocks(step, tg.Hyperparameters()) == expected


@pytest.mark.parametrize(
    "step, expected", [(0, 1.0), (820, 1.0), (821, 0.998902), (1230, 0.55), (1639, 0.101098), (1640, 0.10018), (1679, 0.10018)]
)
def test_lr_schedule_boundaries(step, expected):
    assert tg.lr_multiplier(step, tg.Hyperparameters()) == pytest.approx(expected, abs=1e-6)


def test_muon_momentum_warmup():
    hp = tg.Hyperparameters()
    assert [tg.muon_momentum(s, hp) for s in (0, 150, 300, 1000)] == pytest.approx([0.85, 0.90, 0.95, 0.95])


def test_yarn_updates_match_the_record_table():
    rotary = tg.Rotary(head_dim=128, max_seq_len=4096, block_size=128, table_dtype=torch.bfloat16)
    base = rotary.freqs.clone()
    assert base[:32] == pytest.approx([(1 / 1024) ** (j / 31) for j in range(32)], rel=1e-6) and (base[32:] == 0).all()
    for old, new, scale in ((3, 7, 0.11694596), (7, 11, 0.12751752), (11, 13, 0.13177799)):
        rotary.apply_yarn(old, new)
        assert rotary.attn_scale == pytest.approx(scale, abs=1e-8)
    # after 3→7: pairs with 384·ω/2π >= 32 rotations keep their frequency, those <= 1 are scaled by 3/7
    rotary.reset()
    rotary.apply_yarn(3, 7)
    rotations = 128 * 3 * base / (2 * math.pi)
    fast, slow = rotations >= 32, (rotations <= 1) & (base > 0)
    assert fast.any() and slow.any()
    torch.testing.assert_close(rotary.freqs[fast], base[fast])
    torch.testing.assert_close(rotary.freqs[slow], base[slow] * 3 / 7)
    assert (rotary.freqs[32:] == 0).all()
    assert rotary.cos.dtype == torch.bfloat16
    torch.testing.assert_close(rotary.cos[1000].float(), torch.cos(1000 * rotary.freqs), atol=8e-3, rtol=0)
    rotary.reset()
    assert rotary.attn_scale == 0.1 and torch.equal(rotary.freqs, base)


def test_rotary_rotates_half_pairs_with_the_record_sign():
    rotary = tg.Rotary(head_dim=8, max_seq_len=16, block_size=16, table_dtype=torch.float32)
    x = torch.randn(1, 16, 1, 8)
    y = rotary(x)
    theta = torch.arange(16.0)[:, None] * rotary.freqs[None]
    x1, x2 = x[0, :, 0, :4], x[0, :, 0, 4:]
    torch.testing.assert_close(y[0, :, 0, :4], x1 * theta.cos() + x2 * theta.sin())
    torch.testing.assert_close(y[0, :, 0, 4:], -x1 * theta.sin() + x2 * theta.cos())
    torch.testing.assert_close(y[..., [2, 3, 6, 7]], x[..., [2, 3, 6, 7]])  # the zero-frequency half is untouched


@pytest.mark.parametrize("table_dtype, x_dtype", [(torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16)])
def test_rotary_is_bitwise_the_record_cat_form(table_dtype, x_dtype):
    """Rotary.forward avoids a cat of the two halves (faster under inductor) but computes each element with the
    record's operations: cat(x1 cos + x2 sin, x2 cos - x1 sin) in the table's dtype."""
    rotary = tg.Rotary(head_dim=64, max_seq_len=96, block_size=16, table_dtype=table_dtype)
    rotary.apply_yarn(1, 3)
    x = (torch.randn(1, 96, 3, 64) * 3).to(x_dtype)
    cos, sin = rotary.cos[None, :, None, :], rotary.sin[None, :, None, :]
    x1, x2 = x.to(table_dtype).chunk(2, dim=-1)
    record = torch.cat((x1 * cos + x2 * sin, x2 * cos - x1 * sin), dim=-1).type_as(x)
    assert torch.equal(rotary(x), record)


def test_open_log_never_overwrites(tmp_path):
    path = tg.open_log(str(tmp_path), "run")
    assert path.exists() and path.name == "run.txt"
    path.write_text("precious")
    with pytest.raises(tg.UserError, match="already exists"):
        tg.open_log(str(tmp_path), "run")
    assert path.read_text() == "precious"


def test_attention_backend_choice_and_errors(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setattr(tg, "flash_attn_4_version", lambda: None)  # auto's fa4 case: the test below
    cpu, cuda, hopper = torch.device("cpu"), torch.device("cuda", 0), (9, 0)
    assert tg.choose_attention_backend("auto", cpu, None) == "reference"
    assert tg.choose_attention_backend("auto", cuda, hopper) == ("flex" if tg.flash_attn_varlen_func is None else "flash3")
    assert tg.choose_attention_backend("reference", cuda, hopper) == "reference"
    assert tg.choose_attention_backend("varlen", cuda, hopper) == tg.choose_attention_backend("varlen", cuda, (8, 0)) == "varlen"
    with pytest.raises(tg.UserError, match="flex"):
        tg.choose_attention_backend("flex", cpu, None)
    with pytest.raises(tg.UserError, match="flash3"):
        tg.choose_attention_backend("flash3", cpu, None)
    with pytest.raises(tg.UserError) as turing:  # FlashAttention-2's kernels start at sm_80
        tg.choose_attention_backend("varlen", cuda, (7, 5))
    assert str(turing.value) == ("--attention_backend=varlen needs compute capability 8.0 or newer (FlashAttention-2's kernels); "
                                 "this GPU is sm_75: use auto or flex")
    assert tg.device_capability(cpu) is None
    for name, backend in (("flash3", tg.FlashAttention3), ("fa4", tg.FlashAttention4), ("flex", tg.FlexAttentionBackend), ("reference", tg.ReferenceAttention)):
        attention = tg.attention_backend(name, 16, 1)
        assert type(attention) is backend and attention.name == name and attention.takes_tensors == (name == "flex")


def test_fa4_is_refused_in_one_line_where_it_cannot_run_and_auto_takes_it_on_sm90(monkeypatch: pytest.MonkeyPatch):
    cpu, cuda = torch.device("cpu"), torch.device("cuda", 0)
    monkeypatch.setattr(tg, "flash_attn_varlen_func", None)
    installed: str | None = None
    monkeypatch.setattr(tg, "flash_attn_4_version", lambda: installed)

    def refusal(device: torch.device, capability: tuple[int, int] | None, requested: str = "fa4") -> str:
        with pytest.raises(tg.UserError) as error:
            tg.choose_attention_backend(requested, device, capability)
        return str(error.value)

    assert refusal(cuda, (9, 0)) == "--attention_backend=fa4 needs flash-attn-4 (4.0.0b40 is the tested version, README.md#install); use auto or flex"
    assert refusal(cpu, None) == "--attention_backend=fa4 cannot train on CPU (flash-attn-4's kernels are CUDA only); use auto or reference"
    assert refusal(cuda, (8, 0)) == ("--attention_backend=fa4 needs compute capability 9.0 or newer (flash-attn-4's Hopper and Blackwell "
                                     "kernels); this GPU is sm_80: use auto or flex")
    assert tg.choose_attention_backend("auto", cuda, (9, 0)) == "flex"  # not installed
    installed = tg.FLASH_ATTN_4_TESTED

    def broken_install() -> None:
        raise ImportError("libtvm_ffi_testing.so: cannot open shared object file: No such file or directory\nmore")

    monkeypatch.setattr(tg, "_fa4_interface", broken_install)
    for requested in ("fa4", "auto"):  # auto would take it here, so a broken install is refused, not silently replaced
        assert refusal(cuda, (9, 0), requested) == (
            f"--attention_backend={requested}: flash-attn-4 is installed but does not import (libtvm_ffi_testing.so: "
            "cannot open shared object file: No such file or directory); reinstall it (README.md#install) or pass --attention_backend=flex")
    assert tg.choose_attention_backend("auto", cuda, (10, 0)) == "flex"  # not measured there: fa4 is not imported
    monkeypatch.setattr(tg, "_fa4_interface", lambda: tg.types.ModuleType("flash_attn.cute.interface"))
    assert tg.choose_attention_backend("fa4", cuda, (9, 0)) == tg.choose_attention_backend("fa4", cuda, (10, 0)) == "fa4"
    assert tg.choose_attention_backend("auto", cuda, (9, 0)) == "fa4"  # the measured GPU and version
    assert tg.choose_attention_backend("auto", cuda, (10, 0)) == "flex"  # Blackwell: other kernels, not measured
    assert tg.choose_attention_backend("auto", cpu, None) == "reference"
    installed = "4.0.0b41"  # its private functions may differ: only when asked for
    assert tg.choose_attention_backend("auto", cuda, (9, 0)) == "flex"
    assert tg.choose_attention_backend("fa4", cuda, (9, 0)) == "fa4"
    monkeypatch.setattr(tg, "flash_attn_varlen_func", lambda *args, **kwargs: None)  # FA3 imports: the record's kernel first
    installed = tg.FLASH_ATTN_4_TESTED
    assert tg.choose_attention_backend("auto", cuda, (9, 0)) == "flash3"
    assert tg.attention_backend_line("fa4") == "attention_backend: fa4 (flash-attn-4 4.0.0b40)"
    assert tg.attention_backend_line("flex") == "attention_backend: flex"


def test_flash_attn_4_installed_reads_the_distribution_metadata(monkeypatch: pytest.MonkeyPatch):
    asked = []

    def version(name: str) -> str:
        asked.append(name)
        if installed is None:
            raise importlib.metadata.PackageNotFoundError(name)
        return installed

    monkeypatch.setattr(tg.importlib.metadata, "version", version)
    for installed, expected in ((tg.FLASH_ATTN_4_TESTED, True), ("4.0.0b41", True), (None, False)):
        assert tg.flash_attn_4_installed() is expected and tg.flash_attn_4_version() == installed
    assert asked == ["flash-attn-4"] * 6


@pytest.mark.parametrize("flag, value, fallback, cpu_fallback, words, choose, version_function, loader", [
    ("attention_backend", "fa4", "flex", "reference", ("flash-attn-4", "flash-attn-4's", "Hopper and Blackwell kernels", "4.0.0b40", ""),
     "choose_attention_backend", "flash_attn_4_version", "_fa4_interface"),
    ("mlp_kernel", "quack", "triton", "triton", ("quack-kernels", "quack-kernels'", "Hopper GEMMs", "0.6.5", "; flash-attn-4 installs it"),
     "choose_mlp_kernel", "quack_version", "_quack_relu2_epilogues"),
])
def test_each_kernel_package_is_refused_in_one_line_where_it_cannot_run(
    monkeypatch: pytest.MonkeyPatch, flag: str, value: str, fallback: str, cpu_fallback: str, words: tuple[str, ...], choose: str,
    version_function: str, loader: str,
):
    """check_kernel_package's refusals, through the choose function that calls it, for both packages."""
    package, owner, gpus_kind, tested, installed_by = words
    kind = gpus_kind.split()[-1]
    monkeypatch.setattr(tg, "flash_attn_varlen_func", None)
    installed: str | None = None
    monkeypatch.setattr(tg, version_function, lambda: installed)
    cpu, cuda = torch.device("cpu"), torch.device("cuda", 0)

    def refusal(device: torch.device, capability: tuple[int, int] | None, requested: str = value) -> str:
        with pytest.raises(tg.UserError) as error:
            getattr(tg, choose)(requested, device, capability)
        return str(error.value)

    assert refusal(cuda, (9, 0)) == (f"--{flag}={value} needs {package} ({tested} is the tested version{installed_by}, README.md#install); "
                                     f"use auto or {fallback}")
    assert refusal(cpu, None) == f"--{flag}={value} cannot train on CPU ({owner} {kind} are CUDA only); use auto or {cpu_fallback}"
    needed = "9.0 or newer" if value == "fa4" else "9.x"
    assert refusal(cuda, (8, 0)) == f"--{flag}={value} needs compute capability {needed} ({owner} {gpus_kind}); this GPU is sm_80: use auto or {fallback}"
    if value == "quack":  # its epilogues are written for SM90's one value at a time
        assert refusal(cuda, (10, 0)) == f"--{flag}={value} needs compute capability 9.x ({owner} {gpus_kind}); this GPU is sm_100: use auto or {fallback}"
        installed = "0.6.6"  # its epilogue frontend may differ
        assert refusal(cuda, (9, 0)) == (f"--{flag}={value} needs {package} {tested}, the tested version (0.6.6 is installed): "
                                         f"pip install {package}=={tested}, or pass --{flag}={fallback}")
    installed = tested

    def broken_install() -> None:
        raise ImportError("libcute_dsl_runtime.so: cannot open shared object file\nmore")

    monkeypatch.setattr(tg, loader, broken_install)
    for requested in (value, "auto"):  # auto would take it here, so a broken install is refused, not silently replaced
        assert refusal(cuda, (9, 0), requested) == (
            f"--{flag}={requested}: {package} is installed but does not import (libcute_dsl_runtime.so: cannot open shared object "
            f"file); reinstall it (README.md#install) or pass --{flag}={fallback}")


def test_auto_takes_the_quack_mlp_kernel_on_sm90_with_its_tested_version(monkeypatch: pytest.MonkeyPatch):
    cpu, cuda = torch.device("cpu"), torch.device("cuda", 0)
    installed: str | None = None
    monkeypatch.setattr(tg, "quack_version", lambda: installed)
    monkeypatch.setattr(tg, "_quack_relu2_epilogues", lambda: (None, None))
    assert tg.choose_mlp_kernel("auto", cuda, (9, 0)) == "triton"  # not installed
    installed = tg.QUACK_TESTED
    assert tg.choose_mlp_kernel("quack", cuda, (9, 0)) == "quack"
    assert tg.choose_mlp_kernel("auto", cuda, (9, 0)) == "quack"  # the measured GPU and version
    assert tg.choose_mlp_kernel("auto", cuda, (10, 0)) == "triton"  # Blackwell's GEMMs pass the epilogues pairs
    assert tg.choose_mlp_kernel("auto", cpu, None) == "triton"  # whose wrapper runs the eager formula there
    assert tg.choose_mlp_kernel("triton", cuda, (9, 0)) == "triton"
    installed = "0.6.6"  # its epilogue frontend may differ: refused when asked for (the refusal test), not taken by auto
    assert tg.choose_mlp_kernel("auto", cuda, (9, 0)) == "triton"
    assert tg.mlp_kernel_line("quack") == "mlp_kernel: quack (quack-kernels 0.6.6)"
    assert tg.mlp_kernel_line("triton") == "mlp_kernel: triton"


def test_quack_version_reads_the_distribution_metadata(monkeypatch: pytest.MonkeyPatch):
    def version(name: str) -> str:
        assert name == "quack-kernels"
        if installed is None:
            raise importlib.metadata.PackageNotFoundError(name)
        return installed

    monkeypatch.setattr(tg.importlib.metadata, "version", version)
    for installed in (tg.QUACK_TESTED, None):
        assert tg.quack_version() == installed


@pytest.mark.parametrize(
    ("status", "expected"), [("", "abc123"), (" M train_gpt.py\n", "abc123 (modified)")]
)
def test_git_commit_marks_modified_tracked_files(monkeypatch: pytest.MonkeyPatch, status: str, expected: str) -> None:
    answers = {"rev-parse": "abc123\n", "status": status}
    monkeypatch.setattr(tg, "_command_output", lambda args: answers[args[1]])
    assert tg.git_commit() == expected


def _yarn_events(rotary: "tg.Rotary", windows: list[int]) -> list[tuple]:
    """The apply_yarn and reset calls that set_window makes for this sequence of long windows, from a reset."""
    events: list[tuple] = []
    apply_yarn, reset = rotary.apply_yarn, rotary.reset
    rotary.reset()
    rotary.apply_yarn = lambda old, new: (events.append(("yarn", old, new)), apply_yarn(old, new))[1]
    rotary.reset = lambda: (events.append(("reset",)), reset())[1]
    for window in windows:
        rotary.set_window(window)
    return events


def test_set_window_is_the_records_yarn_schedule_in_training_warmup_and_resume():
    """Training: YaRN 3 -> 7 at step 547, 7 -> 11 at 1094, 11 -> 13 at 1680 and nothing else; the warm-up's cycle
    3, 7, 11, 3, ... stretches twice per cycle and resets at each drop; a resumed run's replay ends in the tables of
    the uninterrupted run, bit for bit."""
    hp = tg.Hyperparameters()
    rotary = tg.Rotary(128, 4096, hp.block_size, torch.float32)
    schedule = [tg.window_blocks(step, hp)[1] for step in range(hp.train_steps + 1)]
    assert _yarn_events(rotary, schedule) == [("yarn", 3, 7), ("yarn", 7, 11), ("yarn", 11, 13)]
    assert [schedule.index(7), schedule.index(11), schedule.index(13)] == [547, 1094, 1680]
    cycle = [hp.ws_schedule[step % 3] for step in range(hp.warmup_steps)]
    assert _yarn_events(tg.Rotary(128, 4096, hp.block_size, torch.float32), cycle) == [("yarn", 3, 7), ("yarn", 7, 11), ("reset",)] * 9 + [
        ("yarn", 3, 7), ("yarn", 7, 11)]
    straight, resumed = (tg.Rotary(128, 4096, hp.block_size, torch.float32) for _ in range(2))
    for step in range(1200):
        straight.set_window(schedule[step])
    resumed.set_window(11)  # a fresh process's tables, then the replay of training's steps before the checkpoint
    resumed.reset()
    for step in range(1200):
        resumed.set_window(schedule[step])
    assert torch.equal(straight.freqs, resumed.freqs) and torch.equal(straight.cos, resumed.cos)
    assert straight.attn_scale == resumed.attn_scale
