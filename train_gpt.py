"""Track 1 record script: GPT-2 (124M) on FineWeb to 3.28 validation loss.

Implements the 2025-09-23 "MuonCustomSizing" record recipe (modded-nanogpt track 1), documented constant by
constant in docs/track1_recipe.md:
12 block slots with U-net skips, value embeddings, smear and attention gates, YaRN rotary, sliding-window
document attention (FlashAttention-3 varlen, FlexAttention, flash-attn-4, torch's varlen_attn, or a plain
reference), an FP8 head, Muon with custom parameter groups, and a sharded Adam.

    torchrun --standalone --nproc_per_node=8 train_gpt.py              # the record run
    python train_gpt.py --preset=smoke                                  # tiny CPU run of the whole pipeline

Read top to bottom: Hyperparameters, Model, Optimizers, Data, Setup (processes, log, checkpoints), Warm-up,
Train and validate, Main. The Fast paths appendix at the end holds the Triton kernels and custom ops that
make the same math fast on the GPU; each names the eager formula it replaces, which is what the sections
above read as (and what runs on CPU).
"""

import argparse
import copy
import dataclasses
import errno
import fcntl
import functools
import gc
import glob
import hashlib
import importlib.metadata
import json
import math
import os
import re
import resource
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import types
import uuid
import warnings
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO, Callable, Iterable, Iterator, NamedTuple, Sequence

try:
    import numpy as np
    import torch
    # torch._dynamo before any process group exists: imported later (torch.optim and torch.compile do), it keeps
    # references to the group past destroy_process_group, whose gloo threads then race the interpreter's exit and
    # abort a finished CPU run now and then (SIGABRT in 1 of about 100 two-process smoke runs)
    import torch._dynamo  # noqa: F401
    import torch.distributed as dist
    import torch.nn.functional as F
    from torch import Tensor, nn
    from torch.nn.attention.flex_attention import BlockMask, flex_attention
    from torch.nn.attention.varlen import varlen_attn  # its window_size is torch 2.11's (requirements.txt asks >= 2.11)
except ImportError as missing:  # a Python without the requirements, e.g. outside the virtual environment
    if __name__ != "__main__":
        raise  # an importer (tools/doctor.py, the tests) reports it in its own way
    print(f"{Path(__file__).name}: error: cannot import {missing.name or missing} in {sys.executable}; install the "
          f"requirements (pip install -r requirements.txt, README.md#install) or run the Python that has them", file=sys.stderr)
    sys.exit(2)

try:
    import triton
    import triton.language as tl
    from triton.tools.tensor_descriptor import TensorDescriptor
except ImportError:  # CPU-only installs without Triton run the eager formulas
    triton = None
    tl = None

try:
    from flash_attn_interface import flash_attn_varlen_func  # FlashAttention-3 (Hopper); optional
except ImportError:
    flash_attn_varlen_func = None


FLASH_ATTN_4_TESTED = "4.0.0b40"  # the fa4 backend calls its private _flash_attn_fwd / _flash_attn_bwd
FA4_MEASURED_CAPABILITY = (9, 0)  # Hopper: fa4 was measured faster than flex on an H100, so auto takes it on sm_90


def flash_attn_4_version() -> str | None:
    """The installed flash-attn-4 distribution's version, None without it (its metadata: importing flash_attn.cute
    would load the CuTe DSL compiler, seconds, and flash-attn 2 owns a package of the same name)."""
    try:
        return importlib.metadata.version("flash-attn-4")
    except importlib.metadata.PackageNotFoundError:
        return None


def flash_attn_4_installed() -> bool:
    return flash_attn_4_version() is not None


QUACK_TESTED = "0.6.5"  # the quack MLP kernel writes its epilogues for quack-kernels' epilogue frontend, which is young
QUACK_MEASURED_CAPABILITY = (9, 0)  # Hopper: measured faster than the Triton kernel on an H100, so auto takes it on sm_90


def quack_version() -> str | None:
    """The installed quack-kernels distribution's version (flash-attn-4 installs it), None without it (from its
    metadata: importing quack loads the CuTe DSL compiler, seconds)."""
    try:
        return importlib.metadata.version("quack-kernels")
    except importlib.metadata.PackageNotFoundError:
        return None


class UserError(Exception):
    """A problem with the command line, the environment, the data or a checkpoint: one line, exit status 2."""


class RunStopped(Exception):
    """Training stopped early (non-finite loss, interrupt): the message is the whole report, one line.

    every_rank: the cause may show on some ranks only (a Shampoo factor lives on one rank), so each rank that
    meets it reports it, not only rank 0."""

    def __init__(self, message: str, exit_status: int, every_rank: bool = False):
        super().__init__(message)
        self.exit_status, self.every_rank = exit_status, every_rank


def ceil_to(value: int, multiple: int) -> int:
    return -(-value // multiple) * multiple


# =============================================================================================
# Hyperparameters
# =============================================================================================
HELP_GROUPS = ("data", "model", "optimizer", "schedule", "logging", "runtime")  # --help's sections, in order


def setting(group: str, default: Any, help: str) -> Any:
    """A Hyperparameters field: its default (the record's), and its --help section and text."""
    return dataclasses.field(default=default, metadata=dict(group=group, help=help))


@dataclass
class Hyperparameters:
    # data (DATA_PATH, when set, is prefixed to both patterns)
    train_files: str = setting("data", "data/fineweb10B/fineweb_train_*.bin", "training shards (glob; DATA_PATH is prefixed)")
    val_files: str = setting("data", "data/fineweb10B/fineweb_val_*.bin", "validation shards (glob; DATA_PATH is prefixed)")
    val_tokens: int = setting("data", 10_485_760, "tokens per validation")  # fixed for comparability with every record
    train_batch_size: int = setting("data", 2048 * 24 * 8, "tokens per optimizer step, all ranks together")
    train_max_seq_len: int = setting("data", 128 * 16, "documents are truncated to this many tokens")
    val_batch_size: int = setting("data", 4 * 64 * 1024 * 8, "tokens per validation step, all ranks together")
    cycle_train_files: bool = setting("data", False, "start the training shards over when they run out (small data sets; never a record)")
    # model (the record's constants; overridable for tiny test and smoke models)
    vocab_size: int = setting("model", 50257, "token ids must lie below it")
    bos_token: int = setting("model", 50256, "the token that opens every document")  # GPT-2 <|endoftext|>
    model_dim: int = setting("model", 768, "width of the residual stream")
    num_heads: int = setting("model", 6, "attention heads")
    block_size: int = setting("model", 128, "tokens per attention block (windows are counted in blocks)")
    disable_fp8: bool = setting("model", False, "bf16 head instead of FP8")
    # optimizers
    adam_lr: float = setting("optimizer", 0.008, "Adam learning rate (embeddings, head, scalars)")
    adam_beta1: float = setting("optimizer", 0.8, "Adam beta1")
    adam_beta2: float = setting("optimizer", 0.95, "Adam beta2")
    adam_eps: float = setting("optimizer", 1e-8, "Adam epsilon")
    muon_lr: float = setting("optimizer", 0.05, "Muon learning rate (block matrices)")
    muon_momentum: float = setting("optimizer", 0.95, "Muon momentum after its warm-up")
    muon_momentum_start: float = setting("optimizer", 0.85, "Muon momentum at step 0")
    muon_momentum_warmup_steps: int = setting("optimizer", 300, "steps of the Muon momentum warm-up")
    weight_decay: float = setting("optimizer", 0.0, "decoupled weight decay of Adam and Muon")
    # schedule: the LR and the attention windows follow num_iterations (docs/track1_recipe.md#schedules)
    num_iterations: int = setting(
        "schedule", 1640, "steps the LR and window schedules span; --train_steps=N (the total, as train_gpt_shampoo.py counts) sets it to N - iteration_extension"
    )
    iteration_extension: int = setting("schedule", 40, "extra steps at the final LR and windows")
    cooldown_frac: float = setting("schedule", 0.5, "fraction of num_iterations over which the LR decays linearly to 0.1x")
    ws_schedule: tuple[int, ...] = setting("schedule", (3, 7, 11), "long attention windows in blocks, over equal parts of the schedule")
    ws_validate: int = setting(
        "schedule", 13, "the last step's long window (YaRN extends to it); the final validation's short-window layers see ws_validate // 2 blocks"
    )
    ws_long_validate: int = setting("schedule", 20, "blocks the final validation's long-window layers see")
    # logging
    val_loss_every: int = setting("logging", 125, "steps between validations (0: only at the end)")
    log_dir: str = setting("logging", "logs", "folder of the run logs, <run_id>.txt")
    run_id: str = setting("logging", "", "name of the log (empty: a fresh uuid4)")
    # runtime
    seed: int = setting("runtime", -1, "torch seed (-1: unseeded like the record; parameters are broadcast from rank 0 anyway)")
    compile: bool = setting("runtime", True, "torch.compile the model")
    attention_backend: str = setting(
        "runtime", "auto", "auto | flash3 | fa4 | varlen | flex | reference (auto: flash3 when FlashAttention-3 imports, "
        f"else fa4 on sm_90 with flash-attn-4 {FLASH_ATTN_4_TESTED} installed, else flex; reference on CPU)",
    )
    mlp_kernel: str = setting(
        "runtime", "auto", f"auto | quack | triton: the MLP's matmuls with ReLU² epilogues (auto: quack on sm_90 with quack-kernels "
        f"{QUACK_TESTED} installed, else triton; both give the same bytes, and the eager formula runs where neither kernel can)",
    )
    warmup_steps: int = setting("runtime", 30, "untimed kernel warm-up steps (state restored afterwards)")
    save_checkpoint: bool = setting("runtime", False, "write the end-of-run state file, <log_dir>/<run_id>/state_step<N>.pt")
    checkpoint_every: int = setting("runtime", 0, "resumable checkpoint every K steps and at an interrupt (0: never)")
    checkpoint_dir: str = setting("runtime", "", "folder of the resumable checkpoints (empty: checkpoints/<run_id>)")
    resume: str = setting("runtime", "", "a checkpoint folder written by --checkpoint_every: continues that run exactly")

    @property
    def train_steps(self) -> int:
        return self.num_iterations + self.iteration_extension


ATTENTION_BACKENDS = ("auto", "flash3", "fa4", "varlen", "flex", "reference")
MLP_KERNELS = ("auto", "quack", "triton")
NUM_LAYERS = 12  # block slots 0-11; the topology below is fixed for every preset
GATE_INPUT_DIMS = 12  # smear and attention gates read the first 12 channels

# Tiny configuration of the same 12-slot topology: the whole pipeline in about half a minute on two CPU cores.
# Real GPT-2 vocabulary, so real shards work; per-rank micro-batches of 128 tokens at any world size. The
# 50,257-way head dominates a CPU step (about 3 s on two cores), hence 6 steps (all three windows, the cooldown,
# the extension) and validations at the first and last step only.
PRESETS: dict[str, dict[str, Any]] = {
    "smoke": dict(
        model_dim=64,
        num_heads=2,
        train_batch_size=8 * 128,
        train_max_seq_len=128,
        val_batch_size=8 * 128,
        val_tokens=8 * 128,
        num_iterations=5,
        iteration_extension=1,
        val_loss_every=6,
        warmup_steps=1,
        block_size=16,
        compile=False,
    ),
}


def _parse_bool(text: str) -> bool:
    value = {"true": True, "1": True, "false": False, "0": False}.get(text.strip().lower())
    if value is None:
        raise argparse.ArgumentTypeError(f"expected true/false/1/0, got {text!r}")
    return value


def _parse_float(text: str) -> float:
    """A finite number: nan or inf in a setting would only show later, as a run that diverges or never learns."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"must be a finite number, got {text!r}")
    return value


def _parse_int_tuple(text: str) -> tuple[int, ...]:
    """Comma-separated whole numbers, optionally in parentheses as Python prints a tuple: 3,7,11, (3, 7, 11) or (7,).
    Any other empty item (3,,7, a trailing comma without parentheses, nothing at all) is refused, never dropped: the
    schedule would quietly lose a window."""
    stripped = text.strip()
    parenthesized = stripped.startswith("(") and stripped.endswith(")")
    items = (stripped[1:-1] if parenthesized else stripped).split(",")
    if parenthesized and len(items) > 1 and not items[-1].strip():
        items.pop()  # (7,): the one trailing comma of Python's tuple syntax, which the log's hyperparameters print
    try:
        return tuple(int(item) for item in items)
    except ValueError:  # argparse names the flag: "argument --ws_schedule: expected ..."
        raise argparse.ArgumentTypeError(f"expected comma-separated whole numbers such as 3,7,11 (no empty items), got {text!r}") from None


def _value_parser(field_type: Any) -> Callable[[str], Any]:
    if field_type is bool:
        return _parse_bool
    if field_type is float:
        return _parse_float
    if field_type in (int, str):
        return field_type
    return _parse_int_tuple  # the only other field type is tuple[int, ...]


# ---- command line: --name=value for every field, grouped in --help the same way in both training scripts ----
FLAG_GROUPS: dict[str, tuple[str, ...]] = {
    group: tuple(f.name for f in dataclasses.fields(Hyperparameters) if f.metadata["group"] == group) for group in HELP_GROUPS
}
FLAG_HELP: dict[str, str] = {f.name: f.metadata["help"] for f in dataclasses.fields(Hyperparameters)}
# The other training script's names for the same settings, accepted here too.
FLAG_ALIASES: dict[str, str] = {"val_every": "val_loss_every"}
TOTAL_STEPS_FLAG = "train_steps"  # the other script's step count: here num_iterations + iteration_extension


class _ArgumentParser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # one line instead of usage + message
        raise UserError(f"{message} (see --help)")


def _build_parser() -> _ArgumentParser:
    parser = _ArgumentParser(
        prog="train_gpt.py",
        usage="%(prog)s [-h] [--preset=smoke] [--name=value ...]",
        description=__doc__,
        formatter_class=lambda prog: argparse.RawDescriptionHelpFormatter(prog, max_help_position=36),
        allow_abbrev=False,
    )
    parser.add_argument("--preset", choices=sorted(PRESETS), default=argparse.SUPPRESS, help="a named set of overrides (smoke: tiny CPU run)")
    fields = {f.name: f for f in dataclasses.fields(Hyperparameters)}
    aliases_of = {name: [alias for alias, target in FLAG_ALIASES.items() if target == name] for name in fields}
    grouped = [name for names in FLAG_GROUPS.values() for name in names]
    groups = dict(FLAG_GROUPS, other=tuple(name for name in fields if name not in grouped))  # "other" stays empty (tested)
    for title, names in groups.items():
        group = parser.add_argument_group(title)
        for name in names:
            f = fields[name]
            metavar = f.type.__name__ if isinstance(f.type, type) else "INTS"
            also = "".join(f"; also --{alias}" for alias in aliases_of[name])
            default = '""' if f.default == "" else ",".join(map(str, f.default)) if isinstance(f.default, tuple) else f.default
            group.add_argument(
                f"--{name}",
                type=_value_parser(f.type),
                default=argparse.SUPPRESS,
                metavar=metavar,
                help=f"{FLAG_HELP.get(name, '')} (default: {default}){also}",
            )
    for alias, target in FLAG_ALIASES.items():
        parser.add_argument(f"--{alias}", type=_value_parser(fields[target].type), default=argparse.SUPPRESS, help=argparse.SUPPRESS)
    parser.add_argument(f"--{TOTAL_STEPS_FLAG}", type=int, default=argparse.SUPPRESS, help=argparse.SUPPRESS)
    return parser


def _resolve_aliases(explicit: dict[str, Any], preset: dict[str, Any]) -> dict[str, Any]:
    """Field names only: an alias becomes its field; --train_steps=N becomes num_iterations = N - iteration_extension."""
    resolved = dict(explicit)
    for alias, target in FLAG_ALIASES.items():
        if alias in resolved:
            if target in resolved:
                raise UserError(f"--{alias} and --{target} name the same setting; give one of them")
            resolved[target] = resolved.pop(alias)
    if TOTAL_STEPS_FLAG in resolved:
        total = resolved.pop(TOTAL_STEPS_FLAG)
        if "num_iterations" in resolved:
            raise UserError(f"--{TOTAL_STEPS_FLAG} sets num_iterations (= {TOTAL_STEPS_FLAG} - iteration_extension); give one of them")
        extension = resolved.get("iteration_extension", preset.get("iteration_extension", Hyperparameters.iteration_extension))
        if total <= extension:
            raise UserError(f"--{TOTAL_STEPS_FLAG}={total} must exceed --iteration_extension={extension} (the steps after the schedule)")
        resolved["num_iterations"] = total - extension
    return resolved


def parse_args(argv: list[str]) -> tuple[Hyperparameters, dict[str, Any]]:
    """Defaults are the record; --preset applies a named override set; explicit --name=value wins."""
    explicit = vars(_build_parser().parse_args(argv))
    preset = explicit.pop("preset", None)
    values = dict(PRESETS[preset]) if preset else {}
    explicit = _resolve_aliases(explicit, values)
    values.update(explicit)
    hp = Hyperparameters(**values)
    validate_hyperparameters(hp)
    overrides = ({"preset": preset} if preset else {}) | explicit
    return hp, overrides


def need(condition: bool, message: str) -> None:
    """A check of the command line or the data: a one-line UserError when it fails."""
    if not condition:
        raise UserError(message)


SEED_LIMIT = 2**64 - 1  # torch.manual_seed's largest
NAME_LIMIT = 255  # bytes of one file name (NAME_MAX of Linux's file systems): a longer one fails every file operation
PATH_FLAGS = ("train_files", "val_files", "log_dir", "checkpoint_dir", "resume")
RUN_ID_LIMIT = 200  # bytes of --run_id: <run_id>.txt and the end-of-run state's folder fit a file name


def check_path_names(hp: Hyperparameters) -> None:
    """Every name in the path settings fits a file name."""
    for flag in PATH_FLAGS:
        for name in Path(getattr(hp, flag)).parts:
            size = len(os.fsencode(name))
            need(size <= NAME_LIMIT, f"--{flag}: the name {name[:20]}... is {size} bytes, longer than a file name may be "
                                     f"({NAME_LIMIT}); pick a shorter --{flag}")


def is_plain_file_name(name: str, limit: int) -> bool:
    """name names a file in the folder it is joined to: no folder part, not . or .., at most `limit` bytes."""
    return name == Path(name).name and name not in (".", "..") and len(os.fsencode(name)) <= limit


def validate_hyperparameters(hp: Hyperparameters) -> None:
    """Every setting's range, at parse time (the float flags' finiteness: _parse_float), each a one-line UserError."""
    check_path_names(hp)
    need(
        hp.attention_backend in ATTENTION_BACKENDS,
        f"--attention_backend={hp.attention_backend!r}: choose one of {', '.join(ATTENTION_BACKENDS)}",
    )
    need(hp.mlp_kernel in MLP_KERNELS, f"--mlp_kernel={hp.mlp_kernel!r}: choose one of {', '.join(MLP_KERNELS)}")
    need(hp.num_heads >= 1, f"--num_heads={hp.num_heads} must be >= 1")
    need(hp.model_dim % hp.num_heads == 0, f"--model_dim={hp.model_dim} must be a multiple of --num_heads={hp.num_heads}")
    need(
        (hp.model_dim // hp.num_heads) % 4 == 0, f"head dim {hp.model_dim // hp.num_heads} must be a multiple of 4 (half-truncated rotary)"
    )
    need(hp.model_dim >= GATE_INPUT_DIMS, f"--model_dim={hp.model_dim} must be at least {GATE_INPUT_DIMS} (the gates read 12 channels)")
    need(hp.vocab_size >= 2, f"--vocab_size={hp.vocab_size} must be >= 2 (the BOS token and another)")
    need(0 <= hp.bos_token < hp.vocab_size, f"--bos_token={hp.bos_token} must lie in [0, vocab_size={hp.vocab_size})")
    need(hp.block_size > 0 and hp.block_size % 16 == 0, f"--block_size={hp.block_size} must be a positive multiple of 16")
    need(len(hp.ws_schedule) > 0 and min(hp.ws_schedule) >= 1, f"--ws_schedule={hp.ws_schedule} needs at least one window of >= 1 block")
    for name in ("train_batch_size", "val_batch_size"):
        tokens = getattr(hp, name)
        need(
            tokens > 0 and tokens % (8 * hp.block_size) == 0,
            f"--{name}={tokens} must be a positive multiple of 8 x block_size = {8 * hp.block_size}",
        )
    need(
        hp.val_tokens > 0 and hp.val_tokens % hp.val_batch_size == 0,
        f"--val_tokens={hp.val_tokens} must be a positive multiple of --val_batch_size={hp.val_batch_size}",
    )
    need(hp.train_max_seq_len > 0, f"--train_max_seq_len={hp.train_max_seq_len} must be positive")
    need(hp.num_iterations > 0 and hp.iteration_extension >= 0, "--num_iterations must be positive and --iteration_extension >= 0")
    need(0.0 <= hp.cooldown_frac <= 1.0, f"--cooldown_frac={hp.cooldown_frac} must lie in [0, 1]")
    need(hp.val_loss_every >= 0 and hp.warmup_steps >= 0, "--val_loss_every and --warmup_steps must be >= 0")
    need(hp.checkpoint_every >= 0, f"--checkpoint_every={hp.checkpoint_every} must be >= 0 (0: no checkpoints)")
    need(hp.ws_validate >= 2, f"--ws_validate={hp.ws_validate} must be >= 2 (the final validation's short windows are ws_validate // 2 blocks)")
    need(hp.ws_long_validate >= 1, f"--ws_long_validate={hp.ws_long_validate} must be >= 1")
    need(hp.muon_momentum_warmup_steps >= 0, f"--muon_momentum_warmup_steps={hp.muon_momentum_warmup_steps} must be >= 0")
    need(-1 <= hp.seed <= SEED_LIMIT, f"--seed={hp.seed} must be -1 (unseeded) or in [0, {SEED_LIMIT}]")
    for name in ("adam_lr", "muon_lr", "weight_decay"):
        need(getattr(hp, name) >= 0, f"--{name}={getattr(hp, name)} must be >= 0")
    for name in ("adam_beta1", "adam_beta2", "muon_momentum", "muon_momentum_start"):
        need(0 <= getattr(hp, name) < 1, f"--{name}={getattr(hp, name)} must lie in [0, 1)")
    need(hp.adam_eps > 0, f"--adam_eps={hp.adam_eps} must be > 0")
    need(
        hp.run_id == "" or is_plain_file_name(hp.run_id, RUN_ID_LIMIT),
        f"--run_id={hp.run_id[:40]!r}{'...' if len(hp.run_id) > 40 else ''} must be a plain file name of at most {RUN_ID_LIMIT} bytes "
        f"(no '/'): the log is <log_dir>/<run_id>.txt",
    )


# ---- schedules (step → value); the boundary steps of docs/track1_recipe.md#schedules are tested ----
def window_blocks(step: int, hp: Hyperparameters) -> tuple[int, int]:
    """(short, long) attention windows in blocks. Denominator num_iterations + 1 is the record's (1641)."""
    if step == hp.train_steps:
        return hp.ws_validate // 2, hp.ws_validate
    progress = min(step / (hp.num_iterations + 1), 0.9999)
    long_window = hp.ws_schedule[int(len(hp.ws_schedule) * progress)]
    return long_window // 2, long_window


def lr_multiplier(step: int, hp: Hyperparameters) -> float:
    """Constant, then a linear cooldown to 0.1 over the last cooldown_frac of num_iterations."""
    progress = min(0.9999, step / hp.num_iterations)
    if progress < 1 - hp.cooldown_frac:
        return 1.0
    w = (1 - progress) / hp.cooldown_frac
    return w * 1.0 + (1 - w) * 0.1


def muon_momentum(step: int, hp: Hyperparameters) -> float:
    frac = min(step / hp.muon_momentum_warmup_steps, 1.0) if hp.muon_momentum_warmup_steps > 0 else 1.0
    return hp.muon_momentum_start * (1 - frac) + hp.muon_momentum * frac


# =============================================================================================
# Model
# =============================================================================================
# Attention and MLP matrices are raw fp32 Parameters of one shared stored shape (D, 4D) so Muon can batch
# them; every parameter carries `module_tag` (Muon grouping), `lr_mul` and `wd_mul` (optimizer scaling),
# and `label` (its name, for the log).
ATTENTION_LAYERS_SKIPPED = (0, 7)
VALUE_EMBED_FOR_LAYER = (None, 1, 2, None, None, None, None, None, None, 0, 1, 2)  # 0-1-2 ... 0-1-2
LONG_WINDOW_LAYERS = (4, 11)  # every other attention layer uses the short window
UNET_SKIP_PAIRS = 5  # pushes after layers 1-5, pops (LIFO) before layers 6-10


def tag(param: nn.Parameter, module_tag: str | None = None, lr_mul: float = 1.0, wd_mul: float = 1.0) -> nn.Parameter:
    param.module_tag, param.lr_mul, param.wd_mul = module_tag, lr_mul, wd_mul
    return param


def rms_norm(x: Tensor) -> Tensor:
    return F.rms_norm(x, (x.size(-1),))  # PyTorch's default eps, no weight anywhere in Track 1


class CastedLinear(nn.Linear):
    """Bias-free linear whose weight is cast to the activation dtype at use."""

    def __init__(self, in_features: int, out_features: int):
        super().__init__(in_features, out_features, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        return F.linear(x, self.weight.type_as(x))


# ---- the head: soft-capped cross-entropy; FP8 in training ----
# Training loss = sum over tokens of CE(30 sigmoid(logits / 7.5)) (docs/track1_recipe.md#fp8-head); the eager formula:
#     logits = (x @ w.T).float(); loss = F.cross_entropy(30 * torch.sigmoid(logits / 7.5), targets, reduction="sum")
# In training, where the GPU has FP8 (fp8_head_available), the logits come from torch._scaled_mm in e4m3 with the
# static scales below, and one custom op computes them, the loss and the logits' gradient (fp8_head_loss, Fast paths).
FP8_X_SCALE = math.sqrt(768) / 448  # |RMS-normed x| <= sqrt(768); 448 = largest e4m3 value
FP8_W_SCALE = 2.0**-9
FP8_GRAD_SCALE = 1.0 / 448
SOFTCAP = 30.0  # logits are soft-capped into (0, SOFTCAP) ...
SOFTCAP_DIVISOR = 7.5  # ... as SOFTCAP * sigmoid(logits / SOFTCAP_DIVISOR)


def softcapped_cross_entropy(logits: Tensor, targets: Tensor, reduction: str) -> Tensor:
    """The eager formula: fp32 soft cap, then cross-entropy over every (padded) vocabulary column."""
    capped = SOFTCAP * torch.sigmoid(logits.float() / SOFTCAP_DIVISOR)
    return F.cross_entropy(capped.view(-1, capped.size(-1)), targets, reduction=reduction)


class LMHead(CastedLinear):
    """Vocabulary projection and loss: FP8 with the fused loss in training when enabled, the eager formula otherwise."""

    def __init__(self, dim: int, vocab: int):
        super().__init__(dim, vocab)
        self.use_fp8 = False

    def loss(self, x: Tensor, targets: Tensor) -> Tensor:
        """Sum of token losses in training, mean in eval."""
        if self.training and self.use_fp8:
            return fp8_head_loss(x.flatten(0, -2), self.weight, targets, FP8_X_SCALE, FP8_W_SCALE, FP8_GRAD_SCALE)[0]
        return softcapped_cross_entropy(self(x), targets, "sum" if self.training else "mean")


# ---- rotary embedding with YaRN ----
BASE_ATTN_SCALE = 0.1  # softmax scale before any YaRN update


class Rotary(nn.Module):
    """Half-truncated rotary: head_dim/4 frequencies log-spaced from 1 to 1/1024, then head_dim/4 zeros.

    Positions are indices into the rank's packed buffer. YaRN updates compound on the current frequencies.
    """

    def __init__(self, head_dim: int, max_seq_len: int, block_size: int, table_dtype: torch.dtype):
        super().__init__()
        quarter = head_dim // 4
        base = torch.cat([(1 / 1024) ** torch.linspace(0, 1, quarter, dtype=torch.float32), torch.zeros(quarter)])
        self.register_buffer("base_freqs", base, persistent=False)
        self.register_buffer("freqs", base.clone(), persistent=False)
        self.register_buffer("cos", torch.empty(max_seq_len, head_dim // 2, dtype=table_dtype), persistent=False)
        self.register_buffer("sin", torch.empty(max_seq_len, head_dim // 2, dtype=table_dtype), persistent=False)
        # attn_scale as a float (FA3, reference) and as a 0-dim tensor updated in place (FlexAttention's
        # score_mod), so YaRN updates do not recompile the FlexAttention graph; see softmax_scale
        self.register_buffer("attn_scale_tensor", torch.tensor(BASE_ATTN_SCALE), persistent=False)
        self.block_size = block_size
        self.attn_scale = BASE_ATTN_SCALE
        self.window: int | None = None  # the long window (blocks) the tables serve; None: the base tables, unused yet
        self.reset()

    @torch.no_grad()
    def _refresh_tables(self) -> None:
        theta = torch.outer(torch.arange(self.cos.size(0), dtype=torch.float32, device=self.freqs.device), self.freqs)
        self.cos.copy_(theta.cos())
        self.sin.copy_(theta.sin())

    @torch.no_grad()
    def reset(self) -> None:
        self.freqs.copy_(self.base_freqs)
        self.attn_scale = BASE_ATTN_SCALE
        self.attn_scale_tensor.fill_(self.attn_scale)
        self._refresh_tables()
        self.window = None

    def set_window(self, window: int) -> None:
        """The tables for a long window of `window` blocks: the one rule of training, warm-up and resume. The base
        tables serve the first window after a reset; a longer window stretches the current tables (apply_yarn,
        compounding as in the record); a shorter one starts over from the base tables, which then serve it."""
        if self.window is not None and window > self.window:
            self.apply_yarn(self.window, window)
        elif self.window is not None and window < self.window:
            self.reset()
        self.window = window

    @torch.no_grad()
    def apply_yarn(self, old_window: int, new_window: int, alpha: float = 1.0, beta: float = 32.0) -> None:
        """Stretch the long context from old_window to new_window blocks (YaRN, 2025-09-10 record)."""
        rotations = self.block_size * old_window * self.freqs / (2 * math.pi)
        ratio = old_window / new_window
        ramp = ((rotations - alpha) / (beta - alpha)).clamp(0, 1)
        self.freqs.mul_(ratio + ramp * (1 - ratio))
        self._refresh_tables()
        self.attn_scale *= 0.2 * math.log(new_window / old_window) + 1
        self.attn_scale_tensor.fill_(self.attn_scale)

    def softmax_scale(self, as_tensor: bool) -> float | Tensor:
        """attn_scale as the attention backend takes it (AttentionBackend.takes_tensors); only that form is read, so a
        compiled graph is specialized on the float only where the float is used."""
        return self.attn_scale_tensor if as_tensor else self.attn_scale

    def forward(self, x: Tensor) -> Tensor:  # x: (1, T, H, d)
        cos = self.cos[None, : x.size(1), None, None, :]
        sin = self.sin[None, : x.size(1), None, None, :]
        halves = x.to(cos.dtype).unflatten(-1, (2, -1))  # (..., 2, d/2): x1, x2
        # (x1 cos + x2 sin, x2 cos + x1 (-sin)) without a cat of the halves, which inductor fuses into cheaper q/k
        # norm + rotary kernels (bench/NOTES.md, 2026-12-01)
        return (halves * cos + halves.flip(-2) * torch.cat((sin, -sin), dim=-2)).flatten(-2).type_as(x)


# ---- attention backends ----
# Key j is visible to query i iff same document, j <= i and i - j <= W tokens (FA3's window (W, 0)).
def document_ids(ids: Tensor, bos_token: int) -> Tensor:
    """Inclusive prefix count of BOS tokens: a BOS belongs to the document it opens."""
    return (ids == bos_token).cumsum(0, dtype=torch.int32)


def dense_window_mask(docs: Tensor, window: int) -> Tensor:
    pos = torch.arange(docs.numel(), device=docs.device)
    offset = pos[:, None] - pos[None, :]
    return (offset >= 0) & (offset <= window) & (docs[:, None] == docs[None, :])


def reference_attention(q: Tensor, k: Tensor, v: Tensor, mask: Tensor, scale: float) -> Tensor:
    """Plain masked softmax attention on (1, T, H, d) tensors: the CPU path and the tests' oracle."""
    scores = torch.einsum("bqhd,bkhd->bhqk", q.float(), k.float()) * scale
    probs = scores.masked_fill(~mask, float("-inf")).softmax(dim=-1)
    return torch.einsum("bhqk,bkhd->bqhd", probs, v.float()).type_as(q)


# ---- the FlexAttention window mask and the attention backends ----
Window = int | Tensor  # in blocks; a 0-dim int32 device tensor on the FlexAttention path (see window_args)


def window_block_matrices(docs: Tensor, window_blocks: Window, block_size: int) -> tuple[Tensor, Tensor]:
    """(partial, full): boolean (query block, key block) matrices of the document-causal window. With d = query
    block - key block: blocks with d in [1, W-1] inside one document are fully visible; the diagonal,
    document-cut blocks and the band d = W are partial (token rule applied); d > W is empty."""
    num_blocks = docs.numel() // block_size
    per_block = docs.view(num_blocks, block_size)
    first, last = per_block[:, 0], per_block[:, -1]
    blk = torch.arange(num_blocks, device=docs.device)
    distance = blk[:, None] - blk[None, :]
    may_overlap = (distance >= 0) & (first[:, None] <= last[None, :]) & (last[:, None] >= first[None, :])
    one_document = (first[:, None] == last[None, :]) & (last[:, None] == first[None, :])
    full = one_document & (distance >= 1) & (distance <= window_blocks - 1)
    partial = may_overlap & (distance <= window_blocks) & ~full
    return partial, full


def flex_window_mask(docs: Tensor, window_blocks: Window, block_size: int) -> BlockMask:
    """Token-exact document-causal sliding-window BlockMask: the window is written into the dense block tables
    (window_block_matrices), so the mask equals FlashAttention-3's window exactly
    (docs/track1_recipe.md#attention-backends). Each query block lists its key blocks from the diagonal back; each
    key block lists its query blocks in ascending order, the tables BlockMask.from_kv_blocks would derive
    (tests/test_train_gpt_attention.py)."""
    partial, full = window_block_matrices(docs, window_blocks, block_size)
    window = window_blocks * block_size

    def visible(b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
        return (q_idx >= kv_idx) & (q_idx - kv_idx <= window) & (docs[q_idx] == docs[kv_idx])

    counts, indices = block_tables_op(partial, full)
    counts, indices = counts[:, None, None], indices[:, None, None]  # (1, 1, n) and (1, 1, n, n) per table
    length = partial.size(0) * block_size
    return BlockMask(
        seq_lengths=(length, length), kv_num_blocks=counts[0], kv_indices=indices[0],
        full_kv_num_blocks=counts[1], full_kv_indices=indices[1], q_num_blocks=counts[2], q_indices=indices[2],
        full_q_num_blocks=counts[3], full_q_indices=indices[3], BLOCK_SIZE=(block_size, block_size), mask_mod=visible,
    )


class AttentionInputs(NamedTuple):
    """What every attention layer of one forward needs; masks are built once per forward and window."""

    windows: dict[str, Window]  # "short" / "long" → window in blocks
    masks: dict[str, Any]  # "short" / "long" → BlockMask (flex) or dense bool mask (reference)
    cu_seqlens: Tensor | None
    max_seqlen: int


class AttentionBackend:
    """Document-causal sliding-window attention on (1, T, H, d) tensors, one subclass per backend; the backend is
    chosen once per run by name (choose_attention_backend), built by attention_backend(name, ...) and logged.

    Per forward, prepare() builds what every layer needs (masks or cu_seqlens); per layer, the call attends with
    the window "short" or "long" and the softmax scale. Windows and scale are Python numbers, except where the
    backend takes_tensors (FlexAttention): then 0-dim device tensors (see window_args), so that a schedule's
    changes do not recompile. FA3 takes numbers, so (as in the record) each (window, scale) pair compiles its
    own graph: 3 in training, a few more in eval.
    """

    name: str  # as in --attention_backend and the log
    takes_tensors = False
    takes_cu_seqlens = False  # the loaders then give each batch its document starts (varlen kernels)

    def __init__(self, block_size: int, bos_token: int):
        self.block_size, self.bos_token = block_size, bos_token

    def window_args(self, ws_short: int, ws_long: int, device: torch.device) -> tuple[Window, Window]:
        """The forward's window arguments, in blocks."""
        return ws_short, ws_long

    def prepare(self, ids: Tensor, cu_seqlens: Tensor | None, windows: dict[str, Window], max_seqlen: int) -> AttentionInputs:
        raise NotImplementedError

    def __call__(self, q: Tensor, k: Tensor, v: Tensor, inputs: AttentionInputs, window: str, scale: float | Tensor) -> Tensor:
        raise NotImplementedError


class FlashAttention3(AttentionBackend):
    """The record's varlen call, with the loader's cu_seqlens. Tested against a plain-PyTorch stand-in with FA3's
    semantics (tests/test_train_gpt_flash3.py); no real FA3 build has run it on our machines."""

    name = "flash3"
    takes_cu_seqlens = True

    def prepare(self, ids: Tensor, cu_seqlens: Tensor | None, windows: dict[str, Window], max_seqlen: int) -> AttentionInputs:
        return AttentionInputs(windows, {}, cu_seqlens, max_seqlen)

    def __call__(self, q: Tensor, k: Tensor, v: Tensor, inputs: AttentionInputs, window: str, scale: float | Tensor) -> Tensor:
        y = flash_attn_varlen_func(
            q[0],
            k[0],
            v[0],
            cu_seqlens_q=inputs.cu_seqlens,
            cu_seqlens_k=inputs.cu_seqlens,
            max_seqlen_q=inputs.max_seqlen,
            max_seqlen_k=inputs.max_seqlen,
            softmax_scale=scale,
            causal=True,
            window_size=(inputs.windows[window] * self.block_size, 0),
        )
        return (y[0] if isinstance(y, tuple) else y).unsqueeze(0)  # some FA3 builds also return the LSE


class TorchVarlenAttention(AttentionBackend):
    """torch.nn.attention.varlen.varlen_attn (ATen's bundled FlashAttention-2 kernels, sm_80 or newer) with the
    loader's cu_seqlens and FA3's window (W tokens, 0): the record's call on a kernel every CUDA build of torch has.
    Its roundings are FlashAttention-2's, not FlexAttention's; it is 1.17-1.40x slower than flex at the record's
    shapes (bench/bench_flex.py, bench/NOTES.md 2026-12-05), so auto never picks it."""

    name = "varlen"
    takes_cu_seqlens = True
    prepare = FlashAttention3.prepare

    def __call__(self, q: Tensor, k: Tensor, v: Tensor, inputs: AttentionInputs, window: str, scale: float | Tensor) -> Tensor:
        y = varlen_attn(
            q[0], k[0], v[0], inputs.cu_seqlens, inputs.cu_seqlens, inputs.max_seqlen, inputs.max_seqlen,
            scale=scale, window_size=(inputs.windows[window] * self.block_size, 0),
        )
        return y.unsqueeze(0)


# ---- FlashAttention-4 (flash-attn-4's CuTe kernels) ----
# The record's varlen call on flash-attn-4's Hopper and Blackwell kernels, for machines without FA3. Its
# autograd.Function cannot be traced by torch.compile, so forward and backward are two custom ops that the compiled
# graphs call. auto takes it on sm_90 when the tested version is installed: there the whole step trained at 0.9686
# of flex's ms/step (one H100, bench/ab.py, 2 rounds, bench/NOTES.md 2026-12-06), its attention kernels 67.8 ms per
# step against flex's 78.6. Other versions and other GPUs (Blackwell's kernels are others) only when asked for.
def _fa4_interface() -> types.ModuleType:
    """flash_attn.cute.interface, imported on first use (it loads the CuTe DSL compiler, seconds)."""
    from flash_attn.cute import interface

    return interface


@torch.library.custom_op("train_gpt::fa4_forward", mutates_args=())
def fa4_forward(q: Tensor, k: Tensor, v: Tensor, cu_seqlens: Tensor, max_seqlen: int, scale: float, window: int) -> tuple[Tensor, Tensor]:
    """Attention output (T, H, d) and log-sum-exp (H, T) of document-causal attention with FA3's window (window, 0)."""
    out, lse = _fa4_interface()._flash_attn_fwd(
        q, k, v, cu_seqlens_q=cu_seqlens, cu_seqlens_k=cu_seqlens, max_seqlen_q=max_seqlen, max_seqlen_k=max_seqlen,
        softmax_scale=scale, causal=True, window_size_left=window, window_size_right=0, return_lse=True,
    )[:2]
    return out, lse


@fa4_forward.register_fake
def _(q: Tensor, k: Tensor, v: Tensor, cu_seqlens: Tensor, max_seqlen: int, scale: float, window: int) -> tuple[Tensor, Tensor]:
    return q.new_empty(q.shape), q.new_empty((q.size(1), q.size(0)), dtype=torch.float32)


@torch.library.custom_op("train_gpt::fa4_backward", mutates_args=())
def fa4_backward(
    grad_out: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, cu_seqlens: Tensor, max_seqlen: int, scale: float, window: int
) -> tuple[Tensor, Tensor, Tensor]:
    """Gradients (dq, dk, dv) of fa4_forward's output from its output, log-sum-exp and the output's gradient."""
    dq, dk, dv = _fa4_interface()._flash_attn_bwd(
        q, k, v, out, grad_out.contiguous(), lse, scale, True, 0.0, window_size_left=window, window_size_right=0,
        cu_seqlens_q=cu_seqlens, cu_seqlens_k=cu_seqlens, max_seqlen_q=max_seqlen, max_seqlen_k=max_seqlen,
    )[:3]
    return dq, dk, dv


@fa4_backward.register_fake
def _(grad_out: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, cu_seqlens: Tensor, max_seqlen: int, scale: float, window: int) -> tuple[Tensor, Tensor, Tensor]:
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)  # flash-attn-4 allocates them so


def _fa4_setup_context(ctx: Any, inputs: tuple[Any, ...], output: tuple[Tensor, Tensor]) -> None:
    q, k, v, cu_seqlens, max_seqlen, scale, window = inputs
    ctx.save_for_backward(q, k, v, output[0], output[1], cu_seqlens)
    ctx.mark_non_differentiable(output[1])  # the log-sum-exp is for the backward only
    ctx.scalars = (max_seqlen, scale, window)


def _fa4_backward(ctx: Any, grad_out: Tensor, _grad_lse: Tensor | None) -> tuple[Tensor | None, ...]:
    q, k, v, out, lse, cu_seqlens = ctx.saved_tensors
    return (*fa4_backward(grad_out, q, k, v, out, lse, cu_seqlens, *ctx.scalars), None, None, None, None)


fa4_forward.register_autograd(_fa4_backward, setup_context=_fa4_setup_context)


class FlashAttention4(AttentionBackend):
    """fa4_forward with the loader's cu_seqlens and FA3's window (W tokens, 0): the record's call on flash-attn-4's
    CuTe kernels. Its roundings are FlashAttention's, not FlexAttention's."""

    name = "fa4"
    takes_cu_seqlens = True
    prepare = FlashAttention3.prepare

    def __call__(self, q: Tensor, k: Tensor, v: Tensor, inputs: AttentionInputs, window: str, scale: float | Tensor) -> Tensor:
        y, _ = fa4_forward(q[0], k[0], v[0], inputs.cu_seqlens, inputs.max_seqlen, float(scale), inputs.windows[window] * self.block_size)
        return y.unsqueeze(0)


class FlexAttentionBackend(AttentionBackend):
    """flex_attention with a token-exact block mask per window (flex_window_mask): one training graph and one eval
    graph serve the whole schedule (windows memoized per value, the scale a buffer updated in place)."""

    name = "flex"
    takes_tensors = True

    def __init__(self, block_size: int, bos_token: int):
        super().__init__(block_size, bos_token)
        self._window_tensors: dict[tuple[int, torch.device], Tensor] = {}

    def window_args(self, ws_short: int, ws_long: int, device: torch.device) -> tuple[Window, Window]:
        for ws in (ws_short, ws_long):
            if (ws, device) not in self._window_tensors:
                self._window_tensors[ws, device] = torch.tensor(ws, dtype=torch.int32, device=device)
        return self._window_tensors[ws_short, device], self._window_tensors[ws_long, device]

    def prepare(self, ids: Tensor, cu_seqlens: Tensor | None, windows: dict[str, Window], max_seqlen: int) -> AttentionInputs:
        docs = document_ids(ids, self.bos_token)
        return AttentionInputs(windows, {key: flex_window_mask(docs, w, self.block_size) for key, w in windows.items()}, None, max_seqlen)

    def __call__(self, q: Tensor, k: Tensor, v: Tensor, inputs: AttentionInputs, window: str, scale: float | Tensor) -> Tensor:
        def scaled(score: Tensor, b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
            return score * scale  # fp32 inside the kernel, like FA3's softmax_scale

        y = flex_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), score_mod=scaled, block_mask=inputs.masks[window], scale=1.0,
        )
        return y.transpose(1, 2)


class ReferenceAttention(AttentionBackend):
    """Dense masked softmax (reference_attention): the CPU path and the tests' oracle."""

    name = "reference"

    def prepare(self, ids: Tensor, cu_seqlens: Tensor | None, windows: dict[str, Window], max_seqlen: int) -> AttentionInputs:
        docs = document_ids(ids, self.bos_token)
        return AttentionInputs(windows, {key: dense_window_mask(docs, w * self.block_size) for key, w in windows.items()}, None, max_seqlen)

    def __call__(self, q: Tensor, k: Tensor, v: Tensor, inputs: AttentionInputs, window: str, scale: float | Tensor) -> Tensor:
        return reference_attention(q, k, v, inputs.masks[window], scale)


ATTENTION_BACKEND_CLASSES: dict[str, type[AttentionBackend]] = {
    cls.name: cls for cls in (FlashAttention3, FlashAttention4, TorchVarlenAttention, FlexAttentionBackend, ReferenceAttention)
}


def attention_backend(name: str, block_size: int, bos_token: int) -> AttentionBackend:
    """The backend of that name (flash3, fa4, varlen, flex or reference; choose_attention_backend resolves auto)."""
    return ATTENTION_BACKEND_CLASSES[name](block_size, bos_token)


class KernelPackage(NamedTuple):
    """An optional package of GPU kernels that a flag's value names (fa4, quack), where it runs, and the words of
    check_kernel_package's refusals."""

    flag: str  # the flag that names it, without dashes
    package: str  # the distribution's name
    owner: str  # the package's name as a possessive: "flash-attn-4's"
    kind: str  # what its kernels are: "kernels", "GEMMs"
    gpus: str  # the GPUs it is used on: "Hopper and Blackwell"
    newest_major: int | None  # the newest compute capability major it runs on (None: any from 9.0 on)
    tested: str  # the version auto takes
    only_tested: bool  # other versions are refused even when asked for
    installed_by: str  # "" or "; <other package> installs it"
    fallback: str  # the value to pass instead on a GPU
    cpu_fallback: str  # and on CPU
    version: Callable[[], str | None]  # the installed version, None without it
    load: Callable[[], object]  # imports it (ImportError or OSError when the install is broken)


def check_kernel_package(kernels: KernelPackage, device: torch.device, capability: tuple[int, int] | None, requested: str) -> None:
    """One UserError line for what the package (asked for, or auto's choice) lacks here: CUDA, sm_90, the package, or its import."""
    flag = f"--{kernels.flag}={requested}"
    if device.type != "cuda":
        raise UserError(f"{flag} cannot train on CPU ({kernels.owner} {kernels.kind} are CUDA only); use auto or {kernels.cpu_fallback}")
    newest = kernels.newest_major
    if capability is not None and (capability < (9, 0) or (newest is not None and capability[0] > newest)):
        needed = "9.0 or newer" if newest is None else ("9.x" if newest == 9 else f"9.0 to {newest}.x")
        raise UserError(f"{flag} needs compute capability {needed} ({kernels.owner} {kernels.gpus} {kernels.kind}); "
                        f"this GPU is sm_{capability[0]}{capability[1]}: use auto or {kernels.fallback}")
    installed = kernels.version()
    if installed is None:
        raise UserError(f"{flag} needs {kernels.package} ({kernels.tested} is the tested version{kernels.installed_by}, README.md#install); "
                        f"use auto or {kernels.fallback}")
    if kernels.only_tested and installed != kernels.tested:
        raise UserError(f"{flag} needs {kernels.package} {kernels.tested}, the tested version ({installed} is installed): "
                        f"pip install {kernels.package}=={kernels.tested}, or pass --{kernels.flag}={kernels.fallback}")
    try:
        kernels.load()
    except (ImportError, OSError) as error:  # a missing dependency or shared library of an installed package
        first_line = (str(error).strip().splitlines() or [type(error).__name__])[0]
        raise UserError(f"{flag}: {kernels.package} is installed but does not import ({first_line}); "
                        f"reinstall it (README.md#install) or pass --{kernels.flag}={kernels.fallback}") from None


# Lambdas, so that the functions are looked up at the call (the tests replace them). quack: Hopper and the tested
# version only, as train_gpt.py's epilogues are written for 0.6.5's frontend on SM90, which passes them one fp32 value
# at a time (its SM100 GEMMs pass pairs), and that frontend is young.
FA4_KERNELS = KernelPackage("attention_backend", "flash-attn-4", "flash-attn-4's", "kernels", "Hopper and Blackwell", None,
                            FLASH_ATTN_4_TESTED, False, "", "flex", "reference", lambda: flash_attn_4_version(), lambda: _fa4_interface())
QUACK_KERNELS = KernelPackage("mlp_kernel", "quack-kernels", "quack-kernels'", "GEMMs", "Hopper", 9, QUACK_TESTED, True,
                              "; flash-attn-4 installs it", "triton", "triton", lambda: quack_version(), lambda: _quack_relu2_epilogues())


def choose_attention_backend(requested: str, device: torch.device, capability: tuple[int, int] | None) -> str:
    """The backend's name for --attention_backend=requested on device (capability: the GPU's, None on CPU)."""
    if requested == "flash3" and (flash_attn_varlen_func is None or device.type != "cuda"):
        raise UserError("--attention_backend=flash3 needs CUDA and flash_attn_interface (FlashAttention-3); use auto, flex or reference")
    if requested == "fa4":
        check_kernel_package(FA4_KERNELS, device, capability, requested)
    if requested in ("flex", "varlen") and device.type != "cuda":
        why = "FlexAttention has no CPU backward" if requested == "flex" else "torch's varlen_attn has no CPU kernel"
        raise UserError(f"--attention_backend={requested} cannot train on CPU ({why}); use auto or reference")
    if requested == "varlen" and capability is not None and capability < (8, 0):
        raise UserError(f"--attention_backend=varlen needs compute capability 8.0 or newer (FlashAttention-2's kernels); this GPU "
                        f"is sm_{capability[0]}{capability[1]}: use auto or flex")
    if requested != "auto":
        return requested
    if device.type != "cuda":
        return "reference"
    if flash_attn_varlen_func is not None:
        return "flash3"
    if capability == FA4_MEASURED_CAPABILITY and flash_attn_4_version() == FLASH_ATTN_4_TESTED:
        check_kernel_package(FA4_KERNELS, device, capability, requested)  # installed but broken: one line, not a silent flex
        return "fa4"
    return "flex"


def attention_backend_line(backend: str) -> str:
    """The log's attention_backend line; fa4's names the installed flash-attn-4, on whose version auto's choice depends."""
    return f"attention_backend: {backend}" + (f" (flash-attn-4 {flash_attn_4_version()})" if backend == "fa4" else "")


def choose_mlp_kernel(requested: str, device: torch.device, capability: tuple[int, int] | None) -> str:
    """The MLP kernel's name for --mlp_kernel=requested on device (capability: the GPU's, None on CPU): quack or triton.
    Either runs the eager formula where its kernel cannot (triton on CPU, for one); auto takes quack only on the GPU
    and version it was measured on."""
    if requested == "quack" or (requested == "auto" and capability == QUACK_MEASURED_CAPABILITY and quack_version() == QUACK_TESTED):
        check_kernel_package(QUACK_KERNELS, device, capability, requested)  # installed but broken: one line, not a silent triton
        return "quack"
    return "triton"


def mlp_kernel_line(kernel: str) -> str:
    """The log's mlp_kernel line; quack's names the installed quack-kernels, on whose version auto's choice depends."""
    return f"mlp_kernel: {kernel}" + (f" (quack-kernels {quack_version()})" if kernel == "quack" else "")


def device_capability(device: torch.device) -> tuple[int, int] | None:
    """The GPU's compute capability (choose_attention_backend's), None on CPU."""
    return torch.cuda.get_device_capability(device) if device.type == "cuda" else None


# ---- gradients into fixed buffers ----
# The tables' and the matrices' gradients skip autograd's AccumulateGrad: their backward adds straight into a fixed
# buffer, `<name>_grad` on the parameter's module, which is also the parameter's .grad (GPT.grads_into_buffers). The
# tables go through TableLookups, the matrices through CastIntoGrad (Fast paths, with the eager formulas and the
# measured reasons). Every zero_grad of the model or of its optimizers zeroes the buffers in place and leaves them
# attached (reattach_grad_buffers): dropped, the next backward would add into a buffer no optimizer reads.
def grad_buffer(param: nn.Parameter) -> Tensor | None:
    """The parameter's gradient buffer, read from its module each time (a move of the module replaces it), or None."""
    owner = getattr(param, "grad_buffer_owner", None)
    return None if owner is None else getattr(owner[0], owner[1])


def reattach_grad_buffers(params: Iterable[nn.Parameter]) -> None:
    """Each parameter that has a gradient buffer: the buffer zeroed, and set as its .grad again."""
    for param in params:
        buffer = grad_buffer(param)
        if buffer is not None:
            buffer.zero_()
            param.grad = buffer


def cast_matrix(module: nn.Module, name: str, like: Tensor) -> Tensor:
    """module's matrix `name` in like's dtype; through CastIntoGrad once the module holds its gradient buffer."""
    matrix = getattr(module, name)
    buffer = getattr(module, f"{name}_grad", None)
    if buffer is None:
        return matrix.type_as(like)
    return CastIntoGrad.apply(matrix, buffer, like.dtype)


# ---- blocks ----
class CausalSelfAttention(nn.Module):
    def __init__(self, dim: int, num_heads: int):
        super().__init__()
        self.num_heads, self.head_dim = num_heads, dim // num_heads
        # (D, 4D) storage reinterpreted as (4, D, D) = W_Q, W_K, W_V, W_O in (out, in) convention.
        self.qkvo_w = tag(nn.Parameter(torch.empty(dim, 4 * dim)), "attn")
        self.attn_gate = CastedLinear(GATE_INPUT_DIMS, num_heads)
        tag(self.attn_gate.weight, "attn_gate")

    def forward(
        self,
        x: Tensor,
        value_embed: Tensor | None,
        mix: Tensor,
        rotary: Rotary,
        attention: AttentionBackend,
        inputs: AttentionInputs,
        window: str,
        scale: float | Tensor,
    ) -> Tensor:
        T, D = x.size(1), x.size(2)
        weights = cast_matrix(self, "qkvo_w", x).view(4, D, D)
        qkv = F.linear(x, weights[:3].flatten(0, 1)).view(1, T, 3 * self.num_heads, self.head_dim)
        q, k, v = qkv.chunk(3, dim=-2)
        q, k = rotary(rms_norm(q)), rotary(rms_norm(k))
        v = mix[0] * v + mix[1] * value_embed.view_as(v) if value_embed is not None else mix[0] * v
        y = attention(q, k, v, inputs, window, scale)
        y = y * torch.sigmoid(self.attn_gate(x[..., :GATE_INPUT_DIMS])).unsqueeze(-1)  # sparse per-head gate
        return F.linear(y.reshape(1, T, D), weights[3])


class MLP(nn.Module):
    def __init__(self, dim: int, kernel: str = "triton"):
        super().__init__()
        self.c_fc = tag(nn.Parameter(torch.empty(dim, 4 * dim)), "mlp")  # used as h @ c_fc
        self.c_proj = tag(nn.Parameter(torch.empty(dim, 4 * dim)), "mlp")  # used as a @ c_proj^T
        self.kernel = kernel  # quack or triton (choose_mlp_kernel): the same bytes either way

    def forward(self, x: Tensor) -> Tensor:  # F.linear(F.relu(x @ c_fc).square(), c_proj), ReLU² fused both ways
        return ReLUSquaredMLP.apply(x, cast_matrix(self, "c_fc", x), cast_matrix(self, "c_proj", x), self.kernel)


MATRIX_NAMES: dict[type, tuple[str, ...]] = {CausalSelfAttention: ("qkvo_w",), MLP: ("c_fc", "c_proj")}


class Block(nn.Module):
    def __init__(self, layer: int, dim: int, num_heads: int, mlp_kernel: str = "triton"):
        super().__init__()
        self.attn = CausalSelfAttention(dim, num_heads) if layer not in ATTENTION_LAYERS_SKIPPED else None
        self.mlp = MLP(dim, mlp_kernel) if layer != 0 else None


class Scalars(NamedTuple):
    """Named views into GPT.scalars, the one fp32 vector that holds every learned scalar (one Parameter, so that
    DistAdam shards it along dim 0 and checkpoints store it as one tensor; docs/track1_recipe.md#scalars)."""

    skip_gates: Tensor  # (L,): U-net skip k is added with weight sigmoid(skip_gates[k]); 0 .. UNET_SKIP_PAIRS-1 used
    block_lambdas: Tensor  # (L, 2): layer i starts with x <- a x + b x0, (a, b) = block_lambdas[i]
    value_mixing: Tensor  # (L, 2): attention layer i mixes v <- s0 v + s1 ve, (s0, s1) = value_mixing[i]
    smear_lambda: Tensor  # (): weight of the previous token in the smear gate

    @staticmethod
    def initial(world_size: int) -> Tensor:
        """The vector in the order of the fields: 6 L values, then padding to a multiple of world_size."""
        L = NUM_LAYERS
        return torch.cat(
            [
                torch.full((L,), -1.5),  # skip_gates
                torch.tensor([1.0, 0.0]).repeat(L),  # block_lambdas
                torch.tensor([0.5, 0.5]).repeat(L),  # value_mixing
                torch.zeros(L),  # smear_lambda, then L - 1 unused entries
                torch.ones((-6 * L) % world_size),  # padding (unused)
            ]
        )

    @staticmethod
    def of(vector: Tensor) -> "Scalars":
        L = NUM_LAYERS
        skip_gates, block_lambdas, value_mixing, smear = vector[: 6 * L].split([L, 2 * L, 2 * L, L])
        return Scalars(skip_gates, block_lambdas.view(L, 2), value_mixing.view(L, 2), smear[0])


class GPT(nn.Module):
    def __init__(
        self,
        vocab_size: int,
        dim: int,
        num_heads: int,
        max_seq_len: int,
        block_size: int,
        world_size: int,
        attention: AttentionBackend,
        table_dtype: torch.dtype = torch.bfloat16,
        mlp_kernel: str = "triton",
    ):
        super().__init__()
        padded_vocab = ceil_to(vocab_size, 128)  # padding rows train normally and are never targets
        self.attention = attention
        self.embed = nn.Embedding(padded_vocab, dim)
        self.value_embeds = nn.ModuleList(nn.Embedding(padded_vocab, dim) for _ in range(3))
        self.smear_gate = CastedLinear(GATE_INPUT_DIMS, 1)
        self.blocks = nn.ModuleList(Block(layer, dim, num_heads, mlp_kernel) for layer in range(NUM_LAYERS))
        self.rotary = Rotary(dim // num_heads, max_seq_len, block_size, table_dtype)
        self.lm_head = LMHead(dim, padded_vocab)
        self.world_size = world_size  # the scalars' padding (Scalars.initial)
        self.scalars = nn.Parameter(Scalars.initial(world_size))  # read through Scalars.of
        for table in (self.embed, *self.value_embeds):
            tag(table.weight, lr_mul=75.0)
        tag(self.smear_gate.weight, "smear_gate")
        tag(self.lm_head.weight, lr_mul=1.0)
        tag(self.scalars, lr_mul=5.0)
        for name, param in self.named_parameters():
            param.label = name
        self.reset_parameters()

    @property
    def tables(self) -> tuple[nn.Embedding, ...]:
        return (self.embed, *self.value_embeds)

    def matrices(self) -> list[nn.Parameter]:
        """Every fp32 matrix cast to bf16 at use: attention qkvo, MLP c_fc and c_proj."""
        return [getattr(module, name) for module in self.modules() for name in MATRIX_NAMES.get(type(module), ())]

    def grads_into_buffers(self, params: Iterable[nn.Parameter]) -> None:
        """From here on each of these parameters (tables or matrices) has a fixed gradient buffer, `<name>_grad` on
        its module, which every backward adds into and which is its .grad (see reattach_grad_buffers). Call after
        the last dtype or device change (build_model does)."""
        owners = {id(param): (module, name) for module in self.modules() for name, param in module.named_parameters(recurse=False)}
        for param in params:
            module, name = owners[id(param)]
            module.register_buffer(f"{name}_grad", torch.zeros_like(param), persistent=False)
            param.grad_buffer_owner = (module, f"{name}_grad")  # where grad_buffer finds it
        self.zero_grad()

    def zero_grad(self, set_to_none: bool = True) -> None:
        super().zero_grad(set_to_none)
        reattach_grad_buffers(self.parameters())

    def look_up_tables(self, ids: Tensor) -> list[Tensor]:
        """Every table's rows for ids: through TableLookups once the tables' gradients go into buffers."""
        buffers = [getattr(table, "weight_grad", None) for table in self.tables]
        if any(buffer is None for buffer in buffers):
            return [table(ids) for table in self.tables]
        return list(TableLookups.apply(ids, *(table.weight for table in self.tables), *buffers))

    @torch.no_grad()
    def reset_parameters(self) -> None:
        """Every parameter as a fresh model has it, the random ones drawn from torch's generator: so that any model
        reset after the same seed is the same model (bench/ab.py starts each round this way)."""
        dim = self.embed.embedding_dim
        self.scalars.copy_(Scalars.initial(self.world_size))
        bound = math.sqrt(3) * 0.5 * dim**-0.5  # uniform with std 0.5/sqrt(dim): 1/32 at dim 768
        for table in (self.embed, *self.value_embeds):
            nn.init.normal_(table.weight)
        for zeroed in (self.smear_gate.weight, self.lm_head.weight):
            zeroed.zero_()
        for block in self.blocks:
            if block.attn is not None:
                qkvo = block.attn.qkvo_w.view(4, dim, dim)
                qkvo[:3].uniform_(-bound, bound)
                qkvo[3].zero_()
                block.attn.attn_gate.weight.zero_()
            if block.mlp is not None:
                block.mlp.c_fc.uniform_(-bound, bound)
                block.mlp.c_proj.zero_()

    def forward(
        self, ids: Tensor, targets: Tensor, cu_seqlens: Tensor | None, ws_short: Window, ws_long: Window, max_seqlen: int
    ) -> Tensor:
        """Sum of token losses in training, mean in eval. Windows in blocks (see AttentionBackend.window_args)."""
        scalars = Scalars.of(self.scalars)
        inputs = self.attention.prepare(ids, cu_seqlens, {"short": ws_short, "long": ws_long}, max_seqlen)
        scale = self.rotary.softmax_scale(self.attention.takes_tensors)
        x, *value_embeds = self.look_up_tables(ids)
        value_embeds = [value_embed[None] for value_embed in value_embeds]
        # smear: mix the previous token's embedding into each position, gated by the current token
        gate = torch.sigmoid(self.smear_gate(x[1:, :GATE_INPUT_DIMS]))
        x = torch.cat([x[:1], x[1:] + scalars.smear_lambda * gate * x[:-1]])
        x = x0 = rms_norm(x)[None]
        skips = []
        for layer in range(1, NUM_LAYERS):  # block 0 holds nothing and never runs
            if NUM_LAYERS // 2 <= layer < NUM_LAYERS // 2 + UNET_SKIP_PAIRS:
                x = x + torch.sigmoid(scalars.skip_gates[layer - NUM_LAYERS // 2]) * skips.pop()
            block = self.blocks[layer]
            x = scalars.block_lambdas[layer, 0] * x + scalars.block_lambdas[layer, 1] * x0
            if block.attn is not None:
                ve_index = VALUE_EMBED_FOR_LAYER[layer]
                window = "long" if layer in LONG_WINDOW_LAYERS else "short"
                value_embed = value_embeds[ve_index] if ve_index is not None else None
                mix = scalars.value_mixing[layer]
                x = x + block.attn(rms_norm(x), value_embed, mix, self.rotary, self.attention, inputs, window, scale)
            x = x + block.mlp(rms_norm(x))
            if layer <= UNET_SKIP_PAIRS:
                skips.append(x)
        return self.lm_head.loss(rms_norm(x), targets)


def matmul_parameter_count(model: GPT) -> int:
    """Parameters of the matrices multiplied in the forward: attention qkvo, MLP, lm_head."""
    return sum(p.numel() for p in model.parameters() if p.module_tag in ("attn", "mlp")) + model.lm_head.weight.numel()


def embedding_parameter_count(model: GPT) -> int:
    return sum(t.weight.numel() for t in (model.embed, *model.value_embeds))


def attention_flops_per_token(hp: Hyperparameters) -> int:
    """Forward attention FLOPs per token averaged over the training schedule, window-limited upper bound:
    sum over attention layers of 4 * model_dim * (W + 1) (QK^T and PV, 2 FLOPs per multiply-add, W + 1 keys
    per query); document starts, which shorten the reach, are ignored."""
    total = 0
    for step in range(hp.train_steps):
        ws_short, ws_long = window_blocks(step, hp)
        for layer in range(NUM_LAYERS):
            if layer not in ATTENTION_LAYERS_SKIPPED:
                window = (ws_long if layer in LONG_WINDOW_LAYERS else ws_short) * hp.block_size
                total += 4 * hp.model_dim * (min(window, hp.train_max_seq_len - 1) + 1)
    return round(total / hp.train_steps)


# =============================================================================================
# Optimizers
# =============================================================================================
class _Finished:
    """Stands in for a distributed Work handle when there is nothing to communicate (one process)."""

    def wait(self) -> None:
        pass


def reduce_scatter_avg(out: Tensor, stacked: Tensor, world_size: int) -> Any:
    """Async: rank r receives the cross-rank average of stacked's r-th slice along dim 0."""
    if world_size == 1:
        if out.data_ptr() != stacked.data_ptr():
            out.copy_(stacked)
        return _Finished()
    return dist.reduce_scatter_tensor(out, stacked, op=dist.ReduceOp.AVG, async_op=True)


def all_gather_into(out: Tensor, local: Tensor, world_size: int) -> Any:
    if world_size == 1:
        if out.data_ptr() != local.data_ptr():
            out.copy_(local)
        return _Finished()
    return dist.all_gather_into_tensor(out, local, async_op=True)


# ---- Newton-Schulz orthogonalization ----
NS_COEFFICIENTS = (3.4445, -4.7750, 2.0315)  # quintic iteration (a, b, c), Muon (K. Jordan, 2024)
NS_STEPS = 5


def _ns_normalize(G: Tensor, dtype: torch.dtype) -> tuple[Tensor, bool]:
    X = G.to(dtype)
    transposed = X.size(-2) > X.size(-1)
    if transposed:
        X = X.mT
    return X / (X.norm(dim=(-2, -1), keepdim=True) + 1e-7), transposed


def newton_schulz_reference(G: Tensor, dtype: torch.dtype = torch.bfloat16) -> Tensor:
    """Batched 5-step Newton-Schulz in plain PyTorch: X <- aX + (bA + cA^2)X with A = XX^T."""
    X, transposed = _ns_normalize(G, dtype)
    a, b, c = NS_COEFFICIENTS
    for _ in range(NS_STEPS):
        A = X @ X.mT
        X = a * X + (b * A + c * A @ A) @ X
    return X.mT if transposed else X


def orthogonalize(G: Tensor) -> Tensor:
    """newton_schulz_triton (Fast paths) on CUDA for matrices big enough to tile; the reference elsewhere (bf16;
    fp32 on CPU)."""
    if triton_runs(G, interpreted=False) and min(G.shape[-2:]) >= 64:
        return newton_schulz_triton(G)
    return newton_schulz_reference(G, torch.bfloat16 if G.device.type == "cuda" else torch.float32)


# ---- Muon with custom parameter groups ----
MUON_MODULE_ORDER = {"smear_gate": 0, "attn_gate": 1, "attn": 2, "mlp": 3}  # small groups first
MUON_MAX_GROUP = 16  # two matrices per rank at 8 GPUs; attn and mlp share the stored shape
MUON_MATRIX_TAGS = ("attn", "mlp")


class MuonGroup(NamedTuple):
    params: list[nn.Parameter]
    padded: int  # group size rounded up to a multiple of world_size (zero padding)
    chunk: int  # entries per rank

    def owned(self, rank: int) -> list[nn.Parameter]:
        return self.params[rank * self.chunk : (rank + 1) * self.chunk]


def muon_groups(params: list[nn.Parameter], world_size: int) -> list[MuonGroup]:
    """Sorts by module tag (stable) and cuts runs of one kind and shape into groups of <= MUON_MAX_GROUP.

    For the 124M model this gives [1, 10, 16, 16]: smear_gate | attn_gate | 10 attn + 6 mlp | 16 mlp; at
    8 ranks (chunk 2) no rank's chunk mixes attn and mlp. Membership does not depend on world_size; only
    the padding does, and the Q/K/V/O reshape is chosen per parameter, so every world size does the same math.
    """
    ordered = sorted(params, key=lambda p: MUON_MODULE_ORDER[p.module_tag])
    kind = lambda p: ("matrix" if p.module_tag in MUON_MATRIX_TAGS else p.module_tag, tuple(p.shape))
    runs: list[list[nn.Parameter]] = []
    for p in ordered:
        if runs and kind(runs[-1][0]) == kind(p) and len(runs[-1]) < MUON_MAX_GROUP:
            runs[-1].append(p)
        else:
            runs.append([p])
    return [MuonGroup(run, ceil_to(len(run), world_size), ceil_to(len(run), world_size) // world_size) for run in runs]


def _orthogonalize_chunk(updates: Tensor, owned: list[nn.Parameter]) -> Tensor:
    """NS per entry; attn matrices as four (D, D) pieces (Q, K, V, O), zero for padding entries.

    The attn entries come first (muon_groups sorts by tag), so both kinds are slices. Indexing a CUDA tensor
    with a Python list copies the list to the GPU and waits for all queued work (bench/sync_check.py), after which
    the host's own work shows as GPU idle time (bench/NOTES.md, 2026-12-01, commit 256da49)."""
    dtype = torch.bfloat16 if updates.device.type == "cuda" else torch.float32
    num_attn = sum(p.module_tag == "attn" for p in owned)
    assert all(p.module_tag == "attn" for p in owned[:num_attn]), "attn entries lead their group (muon_groups)"
    parts = []
    if num_attn:
        rows = updates.size(1)
        stacked = updates[:num_attn].reshape(num_attn * 4, rows, -1)
        parts.append(orthogonalize(stacked).reshape(num_attn, *updates.shape[1:]).to(dtype))
    if len(owned) > num_attn:
        parts.append(orthogonalize(updates[num_attn : len(owned)]).to(dtype))
    if len(owned) < len(updates):
        parts.append(updates.new_zeros(len(updates) - len(owned), *updates.shape[1:], dtype=dtype))
    return parts[0] if len(parts) == 1 else torch.cat(parts)  # one kind and no padding (most chunks): no copy


class KeepsGradBuffers:
    """An optimizer whose zero_grad leaves the model's gradient buffers attached, zeroed (reattach_grad_buffers)."""

    param_groups: list[dict[str, Any]]

    def zero_grad(self, set_to_none: bool = True) -> None:
        super().zero_grad(set_to_none)  # type: ignore[misc]
        reattach_grad_buffers(p for group in self.param_groups for p in group["params"])


class Muon(KeepsGradBuffers, torch.optim.Optimizer):
    """MomentUm Orthogonalized by Newton-Schulz, sharded: each rank orthogonalizes its chunk of each group.

    Pass 1 launches every group's reduce-scatter; pass 2 waits per group, applies Nesterov momentum, weight
    decay and Newton-Schulz to the local chunk and launches its all-gather; pass 3 copies the results back.
    """

    def __init__(self, params: list[nn.Parameter], lr: float, momentum: float, weight_decay: float, rank: int, world_size: int):
        self.rank, self.world_size = rank, world_size
        self._reductions: list[tuple] = []  # filled by launch_reductions, emptied by step
        self.layout = muon_groups(params, world_size)
        super().__init__([dict(params=g.params) for g in self.layout], dict(lr=lr, momentum=momentum, weight_decay=weight_decay))

    @torch.no_grad()
    def launch_reductions(self) -> None:
        """Pass 1 (also called early by the training loop, so both optimizers' reductions overlap)."""
        self._reductions = []
        for group, layout in zip(self.param_groups, self.layout):
            grads = [p.grad for p in layout.params]
            grads += [torch.zeros_like(grads[0])] * (layout.padded - len(grads))
            stacked = torch.stack(grads)
            local = stacked if self.world_size == 1 else grads[0].new_empty(layout.chunk, *grads[0].shape)  # one rank: its own average
            self._reductions.append((group, layout, local, reduce_scatter_avg(local, stacked, self.world_size)))

    @torch.no_grad()
    def step(self) -> None:
        if not self._reductions:
            self.launch_reductions()
        reductions, self._reductions = self._reductions, []
        gathers = []
        for group, layout, grad, work in reductions:
            work.wait()
            owned = layout.owned(self.rank)
            first = layout.params[0]
            state = self.state[first]
            if "momentum_buffer" not in state:
                state["momentum_buffer"] = torch.zeros_like(grad)
            momentum = state["momentum_buffer"]
            mu = group["momentum"]
            momentum.lerp_(grad, 1 - mu)
            update = grad.lerp_(momentum, mu)  # Nesterov: (1 - mu) g + mu m, with the updated m
            rows, cols = first.shape[-2:]
            eff_lr = group["lr"] * max(1.0, rows / cols) ** 0.5 * first.lr_mul
            eff_wd = group["lr"] * group["weight_decay"] * first.wd_mul
            if len(owned) == layout.chunk:  # a full chunk (always at one rank): the stack itself, no zero fill and copy
                slots = torch.stack(owned)
            else:
                slots = torch.zeros(layout.chunk, *first.shape, dtype=first.dtype, device=first.device)  # padding stays 0
                if owned:
                    slots[: len(owned)] = torch.stack(owned)
            if owned:
                if eff_wd:
                    slots.mul_(1 - eff_wd)
                slots.add_(_orthogonalize_chunk(update, owned), alpha=-eff_lr)
            gathered = slots if self.world_size == 1 else slots.new_empty(layout.padded, *first.shape)
            gathers.append((layout, gathered, all_gather_into(gathered, slots, self.world_size)))
        for layout, gathered, work in gathers:
            work.wait()
            torch._foreach_copy_(layout.params, list(gathered[: len(layout.params)]))  # one launch per group


# ---- DistAdam ----
def adam_update_(
    shard: Tensor, grad: Tensor, exp_avg: Tensor, exp_avg_sq: Tensor, step: Tensor, lr: Tensor, beta1: float, beta2: float, eps: float, decay: float
) -> None:
    """One Adam update of shard in place (step: the update's number, already incremented; lr a 0-dim tensor so
    that the compiled version serves every step of the schedule). eps is added to the uncorrected sqrt(v)
    and the bias corrections fold into the step size."""
    if decay:
        shard.mul_(1 - lr * decay)
    exp_avg.mul_(beta1).add_(grad, alpha=1 - beta1)
    exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)  # one rounding of g^2 (1 - beta2), as the record
    step_size = lr * ((1 - beta2**step).sqrt() / (1 - beta1**step))  # the bias corrections grouped as the record's
    shard.sub_(exp_avg / (exp_avg_sq.sqrt() + eps) * step_size)


class DistAdam(KeepsGradBuffers, torch.optim.Optimizer):
    """Adam sharded along dim 0: reduce-scatter (AVG) the gradient, update the rank's rows, all-gather.

    Moments are bf16. With compile=True the update is one fused kernel per parameter shape (the record
    compiles it too) instead of a dozen elementwise passes over each embedding-sized tensor.
    """

    def __init__(
        self,
        params: list[nn.Parameter],
        lr: float,
        betas: tuple[float, float],
        eps: float,
        weight_decay: float,
        rank: int,
        world_size: int,
        compile: bool = False,
    ):
        self.rank, self.world_size = rank, world_size
        self._reductions: list[tuple] = []  # filled by launch_reductions, emptied by step
        self._update = torch.compile(adam_update_, fullgraph=True, dynamic=False) if compile else adam_update_
        self._lr: dict[int, Tensor] = {}  # per parameter: its learning rate as a 0-dim device tensor
        shapes = list(dict.fromkeys(tuple(p.shape) for p in params))
        groups = [dict(params=[p for p in params if tuple(p.shape) == shape]) for shape in shapes]
        super().__init__(groups, dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay))

    @torch.no_grad()
    def launch_reductions(self) -> None:
        """First half of step(); the training loop launches both optimizers' reductions before either updates."""
        self._reductions = []
        for group in self.param_groups:
            for p in group["params"]:
                if self.world_size == 1:  # the gradient is its own average: no copy
                    self._reductions.append((group, p, p.grad, _Finished()))
                    continue
                local = p.grad.new_empty(p.size(0) // self.world_size, *p.shape[1:])
                self._reductions.append((group, p, local, reduce_scatter_avg(local, p.grad, self.world_size)))

    @torch.no_grad()
    def step(self) -> None:
        if not self._reductions:
            self.launch_reductions()
        reductions, self._reductions = self._reductions, []
        gathers = []
        for group, p, grad, work in reductions:
            work.wait()
            rows = grad.size(0)
            shard = p[self.rank * rows : (self.rank + 1) * rows]
            state = self.state[p]
            if not state:
                state["step"] = torch.zeros((), dtype=torch.int64, device=p.device)
                state["exp_avg"] = torch.zeros_like(shard, dtype=torch.bfloat16)
                state["exp_avg_sq"] = torch.zeros_like(shard, dtype=torch.bfloat16)
            if id(p) not in self._lr:
                self._lr[id(p)] = torch.zeros((), dtype=torch.float32, device=p.device)
            lr = self._lr[id(p)].fill_(group["lr"] * p.lr_mul)  # a fill kernel: no host-device sync
            state["step"] += 1
            beta1, beta2 = group["betas"]
            decay = group["weight_decay"] * p.wd_mul
            self._update(shard, grad, state["exp_avg"], state["exp_avg_sq"], state["step"], lr, beta1, beta2, group["eps"], decay)
            gathers.append(all_gather_into(p, shard, self.world_size))
        for work in gathers:
            work.wait()


def muon_parameters(model: GPT) -> list[nn.Parameter]:
    """Hidden matrices, then gates: the record's input order (muon_groups then sorts them stably by tag)."""
    hidden = [p for n, p in model.blocks.named_parameters() if p.ndim >= 2 and "gate" not in n]
    gates = [p for n, p in model.named_parameters() if "gate" in n]
    return hidden + gates


def build_optimizers(model: GPT, hp: Hyperparameters, rank: int, world_size: int) -> tuple[DistAdam, Muon]:
    """Adam: scalars, head, embeddings. Muon: muon_parameters."""
    embeddings = [table.weight for table in (model.embed, *model.value_embeds)]
    adam = DistAdam(
        [model.scalars, model.lm_head.weight, *embeddings],
        hp.adam_lr,
        (hp.adam_beta1, hp.adam_beta2),
        hp.adam_eps,
        hp.weight_decay,
        rank,
        world_size,
        compile=hp.compile,
    )
    muon = Muon(muon_parameters(model), hp.muon_lr, hp.muon_momentum, hp.weight_decay, rank, world_size)
    for opt in (adam, muon):
        for group in opt.param_groups:
            group["initial_lr"] = group["lr"]
    covered = {id(p) for opt in (adam, muon) for g in opt.param_groups for p in g["params"]}
    assert covered == {id(p) for p in model.parameters()}, "every parameter belongs to exactly one optimizer"
    return adam, muon


# =============================================================================================
# Data
# =============================================================================================
QUICK_BOS_SCAN_TOKENS = 4_000_000  # the first shard's BOS index is built from this prefix first...
QUICK_INDEX_BATCHES = 5  # ...and replaced by the full (background-built) index after this many batches


class Batch(NamedTuple):
    inputs: Tensor  # (T,) int32
    targets: Tensor  # (T,) int64
    cu_seqlens: Tensor | None  # (max_num_docs,) int32, document starts padded with T; for the varlen backends (takes_cu_seqlens)


# ---- shards (the same helpers in train_gpt.py and train_gpt_shampoo.py; tests/test_shared_helpers.py) ----
# A shard: 256 little-endian int32 (magic, version, token count, zeros), then uint16 tokens (docs/shards.md).
SHARD_MAGIC = 20240520
SHARD_VERSION = 1
SHARD_HEADER_INTS = 256
GPT2_VOCAB_SIZE = 50257
DOWNLOAD_HINT = "python data/cached_fineweb10B.py 9"
HUB_SHARD_SCRIPTS = {"fineweb10B": "cached_fineweb10B.py", "fineweb100B": "cached_fineweb100B.py",
                     "finewebedu10B": "cached_finewebedu10B.py"}


def resolve_files(pattern: str, what: str) -> list[str]:
    """The files of the --train_files or --val_files pattern (what: "train" or "val"), sorted; DATA_PATH, when
    set, is prefixed."""
    full_pattern = os.path.join(os.environ.get("DATA_PATH", ""), pattern)
    files = sorted(glob.glob(full_pattern))
    if not files:
        raise UserError(f"no files match {full_pattern!r} (--{what}_files): download FineWeb shards with "
                        f"`{DOWNLOAD_HINT}` or pass --{what}_files=<glob>")
    return files


def shard_fix(path: str | Path) -> str:
    """The real fix for a broken shard: where the download scripts put theirs, download again; the smoke
    presets' shards are written again by the next smoke run; any other shard came from data/fineweb.py."""
    path = Path(path)
    if path.parent.name in HUB_SHARD_SCRIPTS:
        digits = "".join(ch for ch in path.stem.rsplit("_", 1)[-1] if ch.isdigit())
        count = max(1, int(digits)) if digits else 1
        return f"delete it and run `python data/{HUB_SHARD_SCRIPTS[path.parent.name]} {count}` again"
    if path.name.startswith("smoke_"):
        return "delete it; the next smoke run writes it again"
    return "regenerate it with data/fineweb.py"


def read_shard_header(path: str | Path) -> int:
    """The shard's token count, after checking its magic, version and byte size."""
    if os.path.isdir(path):
        raise UserError(f"{path}: is a directory, not a token shard; move it away or pass a --train_files/--val_files "
                        f"pattern that matches only shard files")
    try:
        size = os.path.getsize(path)
        header = np.fromfile(path, dtype="<i4", count=SHARD_HEADER_INTS)
    except OSError as error:
        raise UserError(f"{path}: cannot read it ({error.strerror}); check that it exists and is readable") from None
    if size < 4 * SHARD_HEADER_INTS:
        raise UserError(f"{path}: {size} bytes is too short for a shard header; {shard_fix(path)}")
    if header[0] != SHARD_MAGIC or header[1] != SHARD_VERSION:
        raise UserError(f"{path}: not a token shard (magic {header[0]}, version {header[1]}; expected {SHARD_MAGIC}, "
                        f"{SHARD_VERSION}); {shard_fix(path)}")
    num_tokens = int(header[2])
    expected_bytes = 4 * SHARD_HEADER_INTS + 2 * num_tokens
    if size != expected_bytes:
        raise UserError(f"{path}: {size} bytes, header promises {expected_bytes} ({num_tokens} tokens); the shard is "
                        f"truncated or corrupt: {shard_fix(path)}")
    return num_tokens


def read_shard(path: str | Path, vocab_size: int) -> np.ndarray:
    """The shard's tokens (uint16), every one checked against the vocabulary."""
    num_tokens = read_shard_header(path)
    tokens = np.fromfile(path, dtype="<u2", count=num_tokens, offset=4 * SHARD_HEADER_INTS)
    if tokens.size and int(tokens.max()) >= vocab_size:
        largest = int(tokens.max())
        fix = (f"pass --vocab_size={Hyperparameters.vocab_size} for GPT-2 shards (the record's), or at least "
               f"{largest + 1}" if largest < GPT2_VOCAB_SIZE else f"pass --vocab_size={largest + 1} or more")
        raise UserError(f"{path}: token id {largest} >= --vocab_size={vocab_size}; {fix}")
    return tokens


def check_train_data(files: list[str], vocab_size: int) -> int:
    """Every shard's header and the first shard's tokens, before the run starts (the loader checks the other
    shards' tokens as it reaches them). Returns the total token count."""
    total = sum(read_shard_header(path) for path in files)
    read_shard(files[0], vocab_size)
    return total


def check_val_is_held_out(train_files: list[str], val_files: list[str]) -> None:
    """No --val_files shard is also a --train_files shard (the same file, by any path, link or hard link): a val loss
    on training data looks better than the model is."""
    def identity(path: str) -> tuple[int, int] | str:
        try:
            status = os.stat(path)
        except OSError:  # unreadable or a dangling link: the shard checks name it; compare the resolved path
            return os.path.realpath(path)
        return status.st_dev, status.st_ino

    train = {identity(path): path for path in train_files}
    for path in val_files:
        same = train.get(identity(path))
        if same is not None:
            also = "" if same == path else f" (the same file as {same})"
            raise UserError(f"{path}: is a --val_files shard and a --train_files shard{also}; validation on training data "
                            f"overstates the model: pass a --val_files pattern that matches only held-out shards")


def shard_bytes(tokens: np.ndarray) -> bytes:
    header = np.zeros(SHARD_HEADER_INTS, dtype="<i4")
    header[:3] = (SHARD_MAGIC, SHARD_VERSION, tokens.size)
    return header.tobytes() + tokens.astype("<u2").tobytes()


TEMPORARY_NAME = re.compile(r"\..+\.\d+\.[0-9a-f]{8}\.tmp")  # write_atomically's: .<name>.<pid>.<random>.tmp
NO_LOCK_ERRNOS = frozenset({errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS})  # flock's, where a file system has no locks


def flock_if_supported(f: BinaryIO, operation: int) -> bool:
    """fcntl.flock(f, operation); False, and no lock taken, where the file system has no locks."""
    try:
        fcntl.flock(f, operation)
    except OSError as error:
        if error.errno not in NO_LOCK_ERRNOS:
            raise
        return False
    return True


def write_atomically(path: Path, write: Callable[[BinaryIO], object], replace: bool = True) -> None:
    """write(f) fills a temporary file in the same folder, which is then published under path: a crash never
    leaves a partial file under the final name. replace=False never replaces an existing path (FileExistsError).
    The writer holds an OS lock on its temporary file until it is published: remove_dead_temporaries tells the
    file of a killed writer from a live one's by it. Where the file system has no locks the file is written all the
    same, unlocked."""
    temporary = path.with_name(f".{path.name}.{os.getpid()}.{uuid.uuid4().hex[:8]}.tmp")
    try:
        with open(temporary, "xb") as f:
            flock_if_supported(f, fcntl.LOCK_EX)
            write(f)
            f.flush()
            os.fsync(f.fileno())
            if replace:
                os.replace(temporary, path)
            else:
                os.link(temporary, path)  # unlike a rename, fails when path exists
    finally:
        temporary.unlink(missing_ok=True)


def remove_dead_temporaries(folder: Path, started: float) -> list[str]:
    """Removes the temporary files of writers that were killed (write_atomically's, in folder): older than this run
    (started, a time.time()) and locked by no process. A live writer locks its file just after creating it and holds
    the lock until the file is published; the age leaves alone a file created a moment ago, not yet locked. A file
    that cannot be locked (no locks on its file system: its writer may be alive) or that this process may not remove
    (another user's) stays where it is. Returns one line per file removed or left."""
    lines = []
    for path in sorted(folder.glob(".*.tmp")):
        if not TEMPORARY_NAME.fullmatch(path.name):
            continue
        try:
            with open(path, "rb") as f:
                if os.fstat(f.fileno()).st_mtime >= started:
                    continue
                if not flock_if_supported(f, fcntl.LOCK_EX | fcntl.LOCK_NB):
                    lines.append(f"left {path}, a writer's temporary file: its file system has no locks to tell whether the "
                                 f"writer is alive; remove it if no run is writing it")
                    continue
                path.unlink()
        except (BlockingIOError, FileNotFoundError):  # a live writer's, or published or removed meanwhile
            continue
        except OSError as error:  # another user's file or folder, a read-only mount
            lines.append(f"left {path}, a writer's temporary file: cannot remove it ({error.strerror})")
            continue
        lines.append(f"removed {path}, the temporary file of a killed writer")
    return lines


def write_shard(path: str | Path, tokens: np.ndarray) -> None:
    """Writes a shard atomically and never replaces a file: an existing file with the same bytes is kept (so
    processes that write the same shard at once agree), one with other bytes is an error."""
    path, data = Path(path), shard_bytes(tokens)
    try:
        write_atomically(path, lambda f: f.write(data), replace=False)
    except FileExistsError:
        if not path.is_file() or path.read_bytes() != data:
            raise UserError(f"{path} exists with other content; move it away (shards are never overwritten)") from None


# ---- batches: BOS-aligned training rows, contiguous validation windows ----
def bos_positions(tokens: np.ndarray, bos_token: int) -> np.ndarray:
    return np.flatnonzero(tokens == bos_token).astype(np.int64)


class PinnedStaging:
    """Page-locked host buffers for the batches' host-to-device copies: `slots` per (dtype, length), made at the
    first copy of that kind (the warm-up's, for training batches) and then filled in turn. A buffer is refilled
    only after the copy out of it, `slots` copies of its kind earlier, has run (its event); a host more than that
    ahead waits there, with that many micro-batches still queued on the GPU. 16 slots: about 12 MiB for the record's
    training batches and 48 MiB for its validation batches, per process. Why: with a fresh tensor.pin_memory() per
    copy, 2-10 of a step's batch copies took 7-15 ms each on an H200 host, and a profile had the GPU idle for
    11.9 ms between two copies of one batch (bench/host_pauses.py, bench/NOTES.md, 2026-12-02, commit 7e9fd34). On a CPU device
    the returned tensor is the buffer itself, valid until its turn comes again (tests only; _to_device does not
    stage CPU batches).
    The cast from the shard's uint16 into a buffer is numpy's, on this thread, not torch's copy_ (which may hand it
    to torch's intra-op thread pool): in a profile of main at a740140 on one H100, copy_ took 2.8-6.4 ms of host
    time for each micro-step's inputs and targets, against at most 0.94 ms at da5641d in the same A/B; why was not
    found (bench/NOTES.md, 2026-12-07). An array that does not cast safely (int64 into an int32 buffer, say) is
    refused (TypeError) rather than truncated."""

    def __init__(self, slots: int = 16, pin: bool = True, new_event: Callable[[], Any] | None = None):
        self.slots, self.pin = slots, pin
        self.new_event = new_event or torch.cuda.Event
        self.rings: dict[tuple[torch.dtype, int], list[tuple[Tensor, Any]]] = {}
        self.turns: dict[tuple[torch.dtype, int], int] = {}

    def to_device(self, array: np.ndarray, dtype: torch.dtype, device: torch.device) -> Tensor:
        key = (dtype, array.size)
        if key not in self.rings:
            self.rings[key] = [(torch.empty(array.size, dtype=dtype, pin_memory=self.pin), self.new_event()) for _ in range(self.slots)]
            self.turns[key] = 0
        turn = self.turns[key]
        buffer, copied = self.rings[key][turn]
        copied.synchronize()  # its last copy has left (an event never recorded counts as done)
        np.copyto(buffer.numpy(), array, casting="safe")
        on_device = buffer.to(device, non_blocking=True)
        copied.record(torch.cuda.current_stream(device) if device.type == "cuda" else None)  # the copy's stream
        self.turns[key] = (turn + 1) % self.slots
        return on_device


_pinned_staging: PinnedStaging | None = None  # made at the first CUDA batch: one per process, shared by every loader


def _to_device(array: np.ndarray, dtype: torch.dtype, device: torch.device) -> Tensor:
    global _pinned_staging
    if device.type != "cuda":
        return torch.from_numpy(array).to(dtype)
    if _pinned_staging is None:
        _pinned_staging = PinnedStaging()
    return _pinned_staging.to_device(array, dtype, device)


def max_docs_per_batch(num_tokens_local: int) -> int:
    """Fixed cu_seqlens length (static shapes): next multiple of 128 of tokens/300 (256 train, 896 val)."""
    return max(128, ceil_to(num_tokens_local // 300, 128))


def _cu_seqlens(starts: np.ndarray, num_tokens_local: int, max_num_docs: int, where: str) -> np.ndarray:
    if starts.size + 1 > max_num_docs:
        raise UserError(
            f"{where}: {starts.size} documents in one {num_tokens_local}-token micro-batch exceed the fixed limit {max_num_docs - 1}; the data has unusually short documents"
        )
    cu = np.full(max_num_docs, num_tokens_local, dtype=np.int32)
    cu[: starts.size] = starts
    return cu


def _batch(buffer: np.ndarray, doc_starts: np.ndarray | None, max_num_docs: int, where: str, device: torch.device) -> Batch:
    """Inputs buffer[:-1], targets buffer[1:], and cu_seqlens when document starts (in the buffer) are given."""
    num_tokens_local = buffer.size - 1
    cu = None if doc_starts is None else _to_device(_cu_seqlens(doc_starts, num_tokens_local, max_num_docs, where), torch.int32, device)
    return Batch(_to_device(buffer[:-1], torch.int32, device), _to_device(buffer[1:], torch.int64, device), cu)


def plan_segments(
    bos: np.ndarray, shard_len: int, cursor: int, *, num_tokens_local: int, max_seq_len: int, world_size: int, index_is_complete: bool
) -> tuple[list[list[tuple[int, int]]], int] | None:
    """Cuts the next world_size rows of BOS-aligned segments (each row num_tokens_local + 1 tokens).

    Every segment starts at a BOS; a document is cut at max_seq_len and each row's last segment is cut to
    fit (remainders are dropped). Returns None when the BOS index runs out (the caller swaps shards).
    With an incomplete (quick) index the last known BOS cannot start a segment: its end is unknown.
    """
    rows = []
    usable = len(bos) if index_is_complete else len(bos) - 1
    for _ in range(world_size):
        segments, length = [], 0
        while length <= num_tokens_local:
            if cursor >= usable:
                return None
            start = int(bos[cursor])
            next_start = int(bos[cursor + 1]) if cursor + 1 < len(bos) else shard_len
            end = min(next_start, start + max_seq_len, start + num_tokens_local - length + 1)
            segments.append((start, end))
            length += end - start
            cursor += 1
        assert length == num_tokens_local + 1
        rows.append(segments)
    return rows, cursor


def no_bos_message(paths: list[str], bos_token: int) -> str:
    """Every training shard read lacks a BOS, which a shard of this tokenizer's text does only inside a document longer
    than a shard: advice to add shards, or larger ones, would mislead. (tools/doctor.py says the same.)"""
    if len(paths) == 1:
        what = f"--train_files shard {paths[0]} holds no BOS token"
    else:
        what = f"none of the {len(paths)} --train_files shards read ({paths[0]}, ...) holds a BOS token"
    return (
        f"{what} ({bos_token}, the start of every document), so no batch can start there: probably not written by "
        "this tokenizer (data/fineweb.py puts a BOS before every document); tokenize the text again, or set --bos_token "
        "to the id its tokenizer puts there"
    )


class TrainLoader:
    """BOS-aligned training batches for this rank, an iterator; lazy (the first shard is read at the first batch).

    Shards are used in order (repeated with cycle=True); the next one is loaded and indexed in a background
    thread while the current one is planned. When a shard's BOS positions run out, planning restarts at the
    first BOS of the next shard, in the shard after it if need be: a shard without a BOS is the middle of a
    document longer than a shard and starts no segment. state_dict() is where the next batch starts.
    """

    def __init__(
        self,
        files: list[str],
        *,
        num_tokens_local: int,
        max_seq_len: int,
        rank: int,
        world_size: int,
        bos_token: int,
        vocab_size: int,
        cycle: bool,
        device: torch.device,
        with_cu_seqlens: bool,
    ):
        self.files, self.num_tokens_local, self.max_seq_len = files, num_tokens_local, max_seq_len
        self.rank, self.world_size, self.bos_token, self.vocab_size = rank, world_size, bos_token, vocab_size
        self.cycle, self.device, self.with_cu_seqlens = cycle, device, with_cu_seqlens
        self.max_num_docs = max_docs_per_batch(num_tokens_local)
        self.shard_number = 0  # index into the sequence of shards (files repeated when cycling)
        self.cursor = 0  # index into the shard's BOS positions of the next segment's start
        self.served = 0
        self._pool = ThreadPoolExecutor(max_workers=1)
        self._tokens: np.ndarray | None = None  # the current shard, once the first batch is asked for
        self._bos = np.empty(0, dtype=np.int64)
        self._full_index: Future | None = None  # pending complete BOS index while the quick one is used
        self._upcoming: Future | None = None  # the next shard and its BOS index
        self._without_bos: dict[str, None] | None = {}  # the shards read, while none of them had a BOS (then None)

    def state_dict(self) -> dict[str, int]:
        return {"shard_number": self.shard_number, "cursor": self.cursor}

    def load_state_dict(self, state: dict[str, int]) -> None:
        """The next batch reopens that shard and continues at that BOS (also after batches were drawn)."""
        self.shard_number, self.cursor, self.served = int(state["shard_number"]), int(state["cursor"]), 0
        self._tokens, self._bos, self._full_index, self._upcoming = None, np.empty(0, dtype=np.int64), None, None
        self._without_bos = {}

    def _path(self, number: int) -> str | None:
        if number >= len(self.files) and not self.cycle:
            return None
        return self.files[number % len(self.files)]

    def _load(self, path: str) -> tuple[np.ndarray, np.ndarray]:
        tokens = read_shard(path, self.vocab_size)
        return tokens, bos_positions(tokens, self.bos_token)

    def _preload(self, number: int) -> None:
        path = self._path(number)
        self._upcoming = self._pool.submit(self._load, path) if path is not None else None

    def _open_first(self) -> None:
        """The record's quickload: index a prefix now, the whole shard in the background (the quick index is a
        prefix of the full one, so the cursor carries over)."""
        path = self._path(self.shard_number)
        if path is None:
            raise UserError(f"--resume: the checkpoint's training position is past the last of {len(self.files)} --train_files shards")
        self._tokens = read_shard(path, self.vocab_size)
        if self._tokens.size <= QUICK_BOS_SCAN_TOKENS:
            self._bos = bos_positions(self._tokens, self.bos_token)
        else:
            self._bos = bos_positions(self._tokens[:QUICK_BOS_SCAN_TOKENS], self.bos_token)
            self._full_index = self._pool.submit(bos_positions, self._tokens, self.bos_token)
        self._preload(self.shard_number + 1)

    def _use_full_index(self) -> None:
        self._bos, self._full_index = self._full_index.result(), None

    def _next_shard(self, swaps_without_a_batch: int) -> None:
        self._note_bos()
        if self._without_bos is not None and (self._upcoming is None or swaps_without_a_batch > len(self.files)):
            raise UserError(no_bos_message(list(self._without_bos), self.bos_token))
        if self._upcoming is None:
            raise UserError(
                f"training data exhausted after {self.served} batches ({len(self.files)} files from the --train_files pattern); add shards or pass --cycle_train_files=true for small proxy datasets"
            )
        if swaps_without_a_batch > len(self.files):  # cycling through shards that never fit a batch
            raise UserError(
                f"no --train_files shard holds {self.world_size} x {self.num_tokens_local + 1} tokens of documents that start with BOS ({self.bos_token}); add larger shards"
            )
        self._tokens, self._bos = self._upcoming.result()
        self.shard_number, self.cursor = self.shard_number + 1, 0
        self._preload(self.shard_number + 1)

    def _note_bos(self) -> None:
        """Before a swap (the current shard's index is complete then): whether its shard is one more without a BOS."""
        if self._without_bos is not None:
            self._without_bos = None if self._bos.size else self._without_bos | {self._path(self.shard_number): None}

    def __iter__(self) -> "TrainLoader":
        return self

    def __next__(self) -> Batch:
        if self._tokens is None:
            self._open_first()
        swaps = 0
        while True:
            if self._full_index is not None and self.served >= QUICK_INDEX_BATCHES:
                self._use_full_index()
            plan = plan_segments(
                self._bos,
                self._tokens.size,
                self.cursor,
                num_tokens_local=self.num_tokens_local,
                max_seq_len=self.max_seq_len,
                world_size=self.world_size,
                index_is_complete=self._full_index is None,
            )
            if plan is not None:
                break
            if self._full_index is not None:  # quick index exhausted early: switch to the full one and replan
                self._use_full_index()
                continue
            swaps += 1
            self._next_shard(swaps)
        rows, self.cursor = plan
        segments = rows[self.rank]
        buffer = np.concatenate([self._tokens[start:end] for start, end in segments])
        doc_starts = np.cumsum([0] + [end - start for start, end in segments[:-1]]) if self.with_cu_seqlens else None
        self.served += 1
        return _batch(buffer, doc_starts, self.max_num_docs, self._path(self.shard_number), self.device)


def check_val_data(files: list[str], *, val_tokens: int, val_batch_size: int, grad_accum_steps: int, vocab_size: int) -> int:
    """Counts the tokens the windowed reader can use (a read of R = val_batch_size / grad_accum_steps tokens
    needs R + 2 left in its shard, see val_loader); clear error when too short. Also checks the tokens of the
    shards the evaluations read. Returns the total token count."""
    tokens_per_read = val_batch_size // grad_accum_steps
    counts = [read_shard_header(path) for path in files]
    usable = [max(count - 2, 0) // tokens_per_read * tokens_per_read for count in counts]
    if sum(usable) < val_tokens:
        raise UserError(
            f"validation data too short: {sum(usable)} usable tokens in {len(files)} files, --val_tokens={val_tokens} needed; add validation shards or lower --val_tokens (and --val_batch_size)"
        )
    needed = val_tokens
    for path, count in zip(files, usable):
        if needed <= 0:
            break
        read_shard(path, vocab_size)
        needed -= count
    return sum(counts)


def val_loader(
    files: list[str],
    *,
    num_tokens_local: int,
    rank: int,
    world_size: int,
    bos_token: int,
    vocab_size: int,
    device: torch.device,
    with_cu_seqlens: bool,
) -> Iterator[Batch]:
    """Contiguous, unaligned validation windows; every evaluation sees the same first tokens."""
    max_num_docs = max_docs_per_batch(num_tokens_local)
    num_tokens = num_tokens_local * world_size
    paths = iter(files)
    path = next(paths)
    tokens, pos = read_shard(path, vocab_size), 0
    while True:
        if pos + num_tokens + 1 >= tokens.size:  # the record's rule (it keeps one token spare)
            path = next(paths, None)
            if path is None:
                raise UserError("validation data exhausted; add validation shards or lower --val_tokens")
            tokens, pos = read_shard(path, vocab_size), 0
            continue
        start = pos + rank * num_tokens_local
        buffer = tokens[start : start + num_tokens_local + 1]
        # tokens before the first BOS form document 0 (a BOS at 0 makes it empty)
        doc_starts = np.concatenate([[0], bos_positions(buffer[:-1], bos_token)]) if with_cu_seqlens else None
        pos += num_tokens
        yield _batch(buffer, doc_starts, max_num_docs, path, device)


def synthetic_tokens(num_tokens: int, vocab_size: int, bos_token: int, seed: int) -> np.ndarray:
    """Learnable toy text: documents of 20-200 tokens, each a random walk over 256 token ids after a BOS."""
    rng = np.random.default_rng(seed)
    alphabet = min(256, vocab_size - 1)
    steps = rng.choice([1, 1, 1, 2, 3, -1, 5], size=num_tokens)
    tokens = (np.cumsum(steps) % alphabet).astype(np.int64)
    tokens = np.where(tokens >= bos_token, tokens + 1, tokens)  # keep the BOS id for document starts
    doc_starts = np.cumsum(rng.integers(20, 200, size=num_tokens // 20 + 1))
    tokens[np.concatenate([[0], doc_starts[doc_starts < num_tokens]])] = bos_token
    return tokens


# ---- smoke shards (the same writer in train_gpt.py and train_gpt_shampoo.py; each track its own sizes and tokens) ----
def write_smoke_shards(folder: Path, make_shards: Callable[[], dict[str, np.ndarray]], local_rank: int, started: float) -> tuple[str, str]:
    """Makes folder hold exactly the shards make_shards() returns (file name -> tokens), on every machine: each
    machine's first process refreshes them (refresh_smoke_shards), then every process waits for all machines
    (collective; a failure stops every rank). The bytes follow from the settings alone, so every rank reads identical
    shards, and machines sharing a file system write identical files. Returns the train and val patterns, absolute
    (resolve_files's DATA_PATH prefix leaves them)."""
    run_on(local_rank == 0, lambda: refresh_smoke_shards(folder, make_shards, started))
    return str(folder.absolute() / "smoke_train_*.bin"), str(folder.absolute() / "smoke_val_*.bin")


def refresh_smoke_shards(folder: Path, make_shards: Callable[[], dict[str, np.ndarray]], started: float) -> None:
    """Keeps a file of folder whose bytes are already make_shards()'s, writes any other afresh (atomically; a
    missing, damaged or stale file: the folder is the smoke preset's own, one line announces a rewrite) and removes
    the temporary files of killed writers. A failed write is a one-line UserError."""
    try:
        folder.mkdir(parents=True, exist_ok=True)
        for line in remove_dead_temporaries(folder, started):
            print(f"smoke shards: {line}", flush=True)
        for name, tokens in make_shards().items():
            path, data = folder / name, shard_bytes(tokens)
            if path.is_dir():
                raise UserError(f"{path}: is a directory, not a token shard; move it away")
            if path.is_file() and path.stat().st_size == len(data) and path.read_bytes() == data:
                continue
            if path.exists():
                print(f"smoke shards: rewriting {path}, whose bytes are not this smoke run's", flush=True)
            write_atomically(path, lambda f: f.write(data))
    except OSError as failure:
        remedy = "free space there" if failure.errno in (errno.ENOSPC, errno.EDQUOT) else "make that folder writable"
        raise UserError(f"smoke shards: cannot write {failure.filename or folder} ({failure.strerror}); {remedy} "
                        f"or pass --train_files and --val_files") from None


def smoke_shards(hp: Hyperparameters, rt: "Runtime", started: float) -> tuple[str, str]:
    """The smoke preset's shards of synthetic_tokens, in a folder of log_dir named by the settings that decide their
    bytes: two train shards, each alone twice the run's tokens (BOS alignment drops the cut remainders of documents),
    and a val shard."""
    folder = Path(hp.log_dir) / (
        f"smoke_shards_v{hp.vocab_size}_bos{hp.bos_token}_b{hp.train_batch_size}_n{hp.train_steps}_w{hp.warmup_steps}_val{hp.val_tokens}"
    )
    train_tokens = 2 * hp.train_batch_size * (hp.train_steps + hp.warmup_steps + 1)
    run_on(rt.local_rank == 0, lambda: check_output_folder(Path(hp.log_dir), "log_dir"))  # before a folder inside it
    return write_smoke_shards(folder, lambda: {
        "smoke_train_000001.bin": synthetic_tokens(train_tokens, hp.vocab_size, hp.bos_token, seed=1),
        "smoke_train_000002.bin": synthetic_tokens(train_tokens, hp.vocab_size, hp.bos_token, seed=2),
        "smoke_val_000000.bin": synthetic_tokens(hp.val_tokens + 2, hp.vocab_size, hp.bos_token, seed=3),
    }, rt.local_rank, started)


# =============================================================================================
# Setup: processes, log, checkpoints
# =============================================================================================
# ---- processes, log and stopping (the same helpers in train_gpt.py and train_gpt_shampoo.py) ----
class Runtime(NamedTuple):
    """This process's place in the run."""

    rank: int
    world_size: int
    local_rank: int
    device: torch.device

    @property
    def grad_accum_steps(self) -> int:
        return 8 // self.world_size  # the record's 8 micro-batches per step, split over the ranks


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def read_world_size() -> int:
    text = os.environ.get("WORLD_SIZE", "1")
    if text not in ("1", "2", "4", "8"):
        raise UserError(f"WORLD_SIZE={text}: must divide 8 (1, 2, 4 or 8 processes), the record's micro-batches per step")
    return int(text)


def cpu_threads(local_processes: int) -> int:
    """Threads of one CPU process: half the cores it may use, shared by this machine's processes, at least 1.
    More make OpenMP spin-wait against the other ranks (or anything else on the machine): on 2 shared cores the
    Shampoo smoke run took 81 s with 2 threads and 12 s with 1. OMP_NUM_THREADS, when set, is used instead."""
    usable = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return max(1, usable // (2 * local_processes))


def setup_distributed() -> Runtime:
    """torchrun's environment, or a one-process group when the script runs as plain `python`; NCCL with one GPU
    per rank, else gloo on CPU."""
    if "WORLD_SIZE" not in os.environ:
        os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", str(_free_port()))
    world_size = read_world_size()
    rank, local_rank = int(os.environ["RANK"]), int(os.environ["LOCAL_RANK"])
    if torch.cuda.is_available():
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
        dist.init_process_group("nccl", device_id=device)
    else:
        device = torch.device("cpu")
        if "OMP_NUM_THREADS" not in os.environ:
            torch.set_num_threads(cpu_threads(int(os.environ.get("LOCAL_WORLD_SIZE", world_size))))
        dist.init_process_group("gloo")
    dist.barrier()
    return Runtime(rank, world_size, local_rank, device)


def synchronize(device: torch.device) -> None:
    """Waits until the GPU has finished the work queued so far (for the clock); not a barrier between ranks."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def raise_if_any_rank_failed(error: str | None) -> None:
    """Collective: every rank passes its error (None: none) and all raise the first one as a UserError, so that a
    check only some ranks make (rank 0's folders, each machine's smoke shards) stops every rank at the same point."""
    errors: list[str | None] = [None] * dist.get_world_size()
    dist.all_gather_object(errors, error)
    first = next((e for e in errors if e is not None), None)
    if first is not None:
        raise UserError(first)


def run_on(here: bool, action: Callable[[], Any]) -> Any:
    """Collective: action runs where `here` is true (rank 0, or each machine's first process) and its result is
    returned there (None elsewhere); a UserError it raises stops every rank at this point with its line."""
    result, error = None, None
    if here:
        try:
            result = action()
        except UserError as failure:
            error = str(failure)
    raise_if_any_rank_failed(error)
    return result


def announce_log(path: Path, rt: Runtime) -> None:
    """The log's path, printed by the first process of every machine (collective): rank 0 writes the log, on its own
    machine, which the others name with rank 0's absolute path (their working folder may be another clone; run.sh
    repeats the line last)."""
    where = [socket.gethostname(), os.path.abspath(path)]
    dist.broadcast_object_list(where, 0)
    if rt.rank == 0:
        print(f"log: {path}", flush=True)
    elif rt.local_rank == 0:
        print(f"log: {where[1]} (on {where[0]}, the machine of rank 0, which writes it)", flush=True)


def new_run_id(requested: str) -> str:
    """The run's id on every rank: the requested one, or rank 0's fresh uuid4 (collective)."""
    run_id = [requested or str(uuid.uuid4())]
    dist.broadcast_object_list(run_id, 0)
    return run_id[0]


_log_path: Path | None = None  # rank 0's log, once created
_log_error: str | None = None  # why rank 0 could not write its log: the run stops at its next check (stop_requested)
_is_master = True


def append_to_log(path: Path, text: str) -> None:
    """Appends text (whole lines); a write that fails (ENOSPC, EFBIG) is undone, so the log never ends mid-line."""
    fd = os.open(path, os.O_WRONLY | os.O_APPEND)
    try:
        size = os.fstat(fd).st_size
        data = memoryview(text.encode())
        try:
            while data:
                data = data[os.write(fd, data):]
        except OSError:
            os.ftruncate(fd, size)
            raise
    finally:
        os.close(fd)


def write_log(text: str) -> None:
    """Rank 0 appends text to the run log. A failed write is recorded in _log_error (nothing more is written): the
    run stops at its next check, after the header, at a step boundary or at the end, with one line."""
    global _log_error
    if not _is_master or _log_path is None or _log_error is not None:
        return
    try:
        append_to_log(_log_path, text)
    except OSError as error:
        _log_error = f"cannot write the log {_log_path} ({error.strerror})"


def print0(s: str, console: bool = False) -> None:
    """Rank 0 appends s to the run log (flushed at once) and, with console=True, prints it."""
    if not _is_master:
        return
    if console:
        try:
            print(s, flush=True)
        except OSError:  # the terminal is gone (SIGHUP from a dropped session): the log still gets the line
            pass
    write_log(s + "\n")


def open_log(log_dir: str, run_id: str) -> Path:
    """Creates <log_dir>/<run_id>.txt, and its folder when missing (prepare_outputs checked that it may), never
    overwriting a file."""
    path = Path(log_dir) / f"{run_id}.txt"
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(path, "x", encoding="utf-8"):
            return path
    except FileExistsError:
        raise UserError(f"{path} already exists; choose another --run_id (logs are never overwritten)") from None
    except OSError as error:
        raise UserError(f"cannot create the log {path} ({error.strerror}); pick a writable --log_dir") from None


def _command_output(args: list[str]) -> str | None:
    """The command's standard output, run in this script's folder; None when it fails."""
    try:
        result = subprocess.run(args, capture_output=True, text=True, timeout=30,
                                cwd=os.path.dirname(os.path.abspath(__file__)))
    except (OSError, subprocess.TimeoutExpired):
        return None
    return result.stdout if result.returncode == 0 else None


def git_commit() -> str:
    """HEAD, marked when tracked files differ from it (the source embedded above is then what ran)."""
    commit = (_command_output(["git", "rev-parse", "HEAD"]) or "unknown").strip()
    if (_command_output(["git", "status", "--porcelain", "--untracked-files=no"]) or "").strip():
        commit += " (modified)"
    return commit


_stop_signal: int | None = None  # the first SIGINT, SIGTERM or SIGHUP received
_defer_stop = False  # while training: a signal is honoured at the next step boundary (see StepHealth)
_step_reached = 0  # steps completed, for the interrupt message
NON_FINITE_EXIT_STATUS = 3
LOST_PROCESS_EXIT_STATUS = 4
HEALTH_LAG_CUDA = 2  # steps between a training loss and its check: the GPU finished that step long ago
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)  # SIGHUP: a dropped SSH session


def stop_requested() -> bool:
    """This process asks every rank to stop at the next step boundary: a signal arrived, or the log is unwritable."""
    return _stop_signal is not None or _log_error is not None


def interrupted(signum: int) -> RunStopped:
    return RunStopped(f"step {_step_reached}: interrupted by {signal.Signals(signum).name}", 128 + signum)


def stop_if_asked(signals: bool = True) -> None:
    """Collective, where every rank looks (a step boundary, the end of training, a trial's start): when a rank asked to
    stop (stop_requested), every rank raises the same RunStopped, so that all report one cause with one exit status:
    rank 0's unwritable log, else, with signals, the signal of the first rank that received one."""
    requests: list[tuple[str | None, int | None]] = [(None, None)] * dist.get_world_size()
    dist.all_gather_object(requests, (_log_error, _stop_signal if signals else None))
    log_error = next((error for error, _ in requests if error is not None), None)
    if log_error is not None:
        raise RunStopped(f"step {_step_reached}: {log_error}; stopping{last_checkpoint_note()}", 2)
    signum = next((signum for _, signum in requests if signum is not None), None)
    if signum is not None:
        raise interrupted(signum)


def _on_stop_signal(signum: int, frame: Any) -> None:
    """Training stops at the next step boundary (after a checkpoint with --checkpoint_every); outside training,
    or on a second Ctrl-C, at once."""
    global _stop_signal
    repeated = _stop_signal is not None
    if not repeated:
        _stop_signal = signum
    if not _defer_stop or (repeated and signum == signal.SIGINT):
        raise interrupted(signum)


def install_stop_handlers() -> None:
    for signum in STOP_SIGNALS:
        signal.signal(signum, _on_stop_signal)


# What a collective raises when another process of the run is gone (killed, or its machine lost): gloo's
# RuntimeError and torch.distributed's DistError carry these words of the transport.
LOST_PROCESS_SIGNS = ("Connection closed by peer", "Connection reset by peer", "Broken pipe", "failed to recv, got 0 bytes",
                      "remote process exited", "communicator was aborted")


def lost_process_line(error: RuntimeError) -> str | None:
    """The one line for a collective's error that says another process of the run is gone; None for any other."""
    text = " ".join(str(error).split())
    sign = next((sign for sign in LOST_PROCESS_SIGNS if sign in text), None)
    if sign is None or not (isinstance(error, dist.DistError) or "gloo" in text):
        return None
    return (f"rank {os.environ.get('RANK', '0')}: step {_step_reached}: another process of this run is gone ({sign}); "
            f"stopping (its own output says why)")


class StepHealth:
    """Each training step's summed losses and a stop-request flag, summed over ranks on the device and copied
    without blocking into pinned host memory, then read `lag` steps later: the check adds no host sync to a
    step. All ranks read the same sums at the same step, so they stop at the same boundary."""

    def __init__(self, device: torch.device, world_size: int, lag: int):
        self.world_size, self.lag = world_size, lag
        self.host = torch.zeros(lag + 1, 2, pin_memory=device.type == "cuda")
        self.events = [torch.cuda.Event() for _ in range(lag + 1)] if device.type == "cuda" else None
        self.pending: list[tuple[int, int]] = []  # (step, slot), oldest first

    def push(self, step: int, loss_sum: Tensor, stop_requested: bool) -> None:
        values = torch.stack([loss_sum.float(), torch.full((), float(stop_requested), device=loss_sum.device)])
        if self.world_size > 1:
            dist.all_reduce(values)
        slot = step % (self.lag + 1)
        self.host[slot].copy_(values, non_blocking=True)
        if self.events is not None:
            self.events[slot].record()
        self.pending.append((step, slot))

    def poll(self, keep: int) -> bool:
        """Reads all but the newest `keep` steps: raises RunStopped on a non-finite loss; True when a rank asked
        to stop."""
        stop = False
        while len(self.pending) > keep:
            step, slot = self.pending.pop(0)
            if self.events is not None:
                self.events[slot].synchronize()
            loss, flag = self.host[slot].tolist()
            if not math.isfinite(loss):
                raise RunStopped(f"step {step + 1}: non-finite training loss ({loss}); stopping", NON_FINITE_EXIT_STATUS)
            stop = stop or flag > 0
        return stop


def report_stop(line: str, every_rank: bool = False) -> None:
    """The one line on stderr (rank 0, or every rank that met the cause) and in torchrun's per-rank error file
    (its documented format), from which run.sh knows the line was printed and leaves out the launcher's report."""
    if os.environ.get("RANK", "0") == "0" or every_rank:
        print(line, file=sys.stderr, flush=True)
    error_file = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if error_file:
        message = json.dumps({"message": line, "timestamp": str(int(time.time()))}).encode()
        try:
            Path(error_file).parent.mkdir(parents=True, exist_ok=True)
            write_atomically(Path(error_file), lambda f: f.write(message))
        except OSError:  # a full disk: the line is on stderr, the launcher adds its own report
            pass


def environment_lines(rt: Runtime, hp: Hyperparameters, overrides: dict[str, Any], track_lines: list[str],
                      train_files: list[str], train_token_count: int, val_files: list[str], val_token_count: int) -> list[str]:
    """The log's environment block (docs/log_format.md): versions, GPUs, world size, the track's own lines, commit,
    settings and data."""
    try:
        import triton as triton_module  # optional: CPU-only installs run without it

        triton_version = triton_module.__version__
    except ImportError:
        triton_version = "not installed"
    smi = _command_output(["nvidia-smi"])
    if rt.device.type == "cuda":
        names = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
        device = f"device: {len(names)}x {names[0] if len(set(names)) == 1 else names}"
    else:
        device = "device: cpu"
    return [
        f"Running Python {sys.version}",
        f"Running PyTorch {torch.__version__} compiled for CUDA {torch.version.cuda}",
        f"Running Triton version {triton_version}",
        smi.rstrip("\n") if smi is not None else "nvidia-smi: not available",
        device,
        f"world_size: {rt.world_size}",
        f"grad_accum_steps: {rt.grad_accum_steps}",
        *track_lines,
        f"git_commit: {git_commit()}",
        f"overrides: {overrides!r}",
        f"hyperparameters: {dataclasses.asdict(hp)!r}",
        f"train_files: {len(train_files)} files, {train_token_count} tokens",
        f"val_files: {len(val_files)} files, {val_token_count} tokens",
    ]


# ---- Track 1's own log lines ----
def log_model_and_muon(model: GPT, muon: Muon, hp: Hyperparameters, rt: Runtime) -> None:
    total = sum(p.numel() for p in model.parameters())
    print0(f"params: total={total} matmul={matmul_parameter_count(model)} embed={embedding_parameter_count(model)}")
    print0(f"attention_flops_per_token: {attention_flops_per_token(hp)}")
    print0(f"muon_group_sizes: {[len(g.params) for g in muon.layout]}")
    print0(f"muon_group_padded: {[g.padded for g in muon.layout]}")
    for rank in range(rt.world_size):
        owned = [[p.label for p in g.owned(rank)] for g in muon.layout]
        print0(f"muon_rank{rank}_owns: {owned}")


# ---- what a run writes, checked before its log exists (the same helpers in train_gpt.py and train_gpt_shampoo.py) ----
FREE_SPACE_MARGIN = 64 * 2**20  # bytes beyond a run's estimated needs
LOG_HEADER_BYTES = 64 * 2**10  # a log's environment block, at most (nvidia-smi's table is its longest part)
CHECKPOINT_DIR_LOCK = ".lock"  # in a checkpoint folder: held (an OS lock) by the run that saves there
_checkpoint_dir_lock: BinaryIO | None = None


def tensor_bytes(state: Any) -> int:
    """The bytes of the tensors in a (nested) state dict."""
    if isinstance(state, Tensor):
        return state.nbytes
    if isinstance(state, dict):
        return sum(tensor_bytes(value) for value in state.values())
    if isinstance(state, (list, tuple)):
        return sum(tensor_bytes(value) for value in state)
    return 0


def optimizer_bytes(optimizers: Sequence[torch.optim.Optimizer]) -> int:
    """About the bytes of the optimizers' state on this rank, as a checkpoint saves it: an optimizer whose state
    appears at its first step, like Adam's moments, counts two values per parameter."""
    total = 0
    for optimizer in optimizers:
        state = tensor_bytes(optimizer.state_dict()["state"])
        total += state or 2 * sum(p.nbytes for group in optimizer.param_groups for p in group["params"])
    return total


def log_bytes(source: str, lines: int) -> int:
    """About the size of a run's log: the program, the environment block and `lines` lines of at most 200 bytes."""
    return len(source.encode()) + LOG_HEADER_BYTES + 200 * lines


def nearest_existing(path: Path) -> Path:
    """path, or its nearest ancestor that exists: where creating path would begin."""
    while not os.path.exists(path) and path != path.parent:
        path = path.parent
    return path


def check_output_folder(folder: Path, flag: str, needs_locks: bool = False) -> None:
    """The folder --flag names takes a new file, and an OS lock where needs_locks (claim_checkpoint_dir's): tried in
    the folder, or in its nearest existing ancestor when it does not exist yet, creating nothing. A one-line
    UserError otherwise."""
    where, existing = f"--{flag}={folder}", nearest_existing(folder)
    if not existing.is_dir():
        raise UserError(f"{where}: {'' if existing == folder else f'{existing} '}is a file, not a folder; pick another --{flag}")
    try:
        probe = tempfile.TemporaryFile(dir=existing)
    except OSError as error:
        place = "there" if existing == folder else f"in {existing}, where it would be created"
        raise UserError(f"{where}: cannot write {place} ({error.strerror}); pick a writable --{flag}") from None
    with probe:
        if needs_locks and not flock_if_supported(probe, fcntl.LOCK_EX | fcntl.LOCK_NB):
            raise UserError(f"{where}: its file system has no file locks, which keep a second run out of a checkpoint "
                            f"folder; pick a --{flag} on one that has them (a local disk)")


def check_room(needs: Sequence[tuple[str, Path, Sequence[int]]]) -> None:
    """Each (flag, folder, the sizes of the files the run writes there): the file system holds all that its folders
    need, plus FREE_SPACE_MARGIN, and no file would pass the file-size limit (ulimit -f). A folder not created yet
    is measured where it would be (nearest_existing)."""
    size_limit = resource.getrlimit(resource.RLIMIT_FSIZE)[0]
    measured = [(flag, folder, files, nearest_existing(folder)) for flag, folder, files in needs]
    device = {flag: existing.stat().st_dev for flag, _, _, existing in measured}
    per_device: dict[int, int] = {}
    for flag, _, files, _ in measured:
        per_device[device[flag]] = per_device.get(device[flag], 0) + sum(files)
    for flag, folder, files, existing in measured:
        needed, free = per_device[device[flag]] + FREE_SPACE_MARGIN, shutil.disk_usage(existing).free
        if free < needed:
            raise UserError(f"--{flag}={folder}: {free / 2**20:.0f} MiB free, this run needs about {needed / 2**20:.0f} MiB "
                            f"there (its log and one checkpoint, with a margin); free some space or pick another --{flag}")
        largest = max(files, default=0)
        if size_limit != resource.RLIM_INFINITY and largest > size_limit:
            raise UserError(f"--{flag}={folder}: this run writes files of up to about {largest / 2**20:.1f} MiB there, "
                            f"above the file-size limit of {size_limit / 2**20:.1f} MiB (ulimit -f); raise the limit")


def claim_checkpoint_dir(directory: Path) -> None:
    """Creates the folder when missing and holds an OS lock on <directory>/.lock for the rest of the process
    (release_checkpoint_dir ends it sooner): one run at a time saves into a folder, and staging folders found there
    are of saves that died with their run. A folder another live run holds is a one-line UserError naming that run;
    a lock file that cannot be opened or locked, one naming it."""
    global _checkpoint_dir_lock
    where, lock_path = f"--checkpoint_dir={directory}", directory / CHECKPOINT_DIR_LOCK
    try:
        directory.mkdir(parents=True, exist_ok=True)
        lock = open(lock_path, "a+b")
    except OSError as error:
        raise UserError(f"{where}: cannot open {lock_path} ({error.strerror}); pick another --checkpoint_dir") from None
    try:
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        lock.truncate(0)
        lock.write(f"pid {os.getpid()} on {socket.gethostname()}, since {time.strftime('%Y-%m-%d %H:%M:%S')}\n".encode())
        lock.flush()
    except BlockingIOError:
        lock.seek(0)
        owner = lock.read().decode(errors="replace").strip() or "another process"
        lock.close()
        raise UserError(f"{where}: in use by another run ({owner}); pick another --checkpoint_dir (two runs never save "
                        f"into one folder)") from None
    except OSError as error:  # no locks there (check_output_folder tried one on another file), a full disk
        lock.close()
        raise UserError(f"{where}: cannot lock {lock_path} ({error.strerror}); pick another --checkpoint_dir") from None
    _checkpoint_dir_lock = lock


def release_checkpoint_dir() -> None:
    global _checkpoint_dir_lock
    if _checkpoint_dir_lock is not None:
        _checkpoint_dir_lock.close()
        _checkpoint_dir_lock = None


def prepare_outputs(log_path: Path, log_dir_file_sizes: Sequence[int], checkpoint_dir: Path | None, checkpoint_file_sizes: Sequence[int],
                    started: float) -> None:
    """Rank 0, before the log exists (run_on stops every rank at a failure): checks that the log is new and that its
    folder and the checkpoint folder (None: no checkpoints) take new files (check_output_folder) and hold the files
    the run writes there (their sizes: log_dir_file_sizes, checkpoint_file_sizes) with a margin (check_room); removes the
    temporary files of killed writers in the log's folder and its folders (end-of-run states, smoke shards); then,
    every check passed, creates and claims the checkpoint folder (claim_checkpoint_dir). Until then nothing is
    created: a refused run leaves the folders as they were. Each failure, an OSError's too, is a one-line UserError."""
    log_dir = log_path.parent
    needs = [("log_dir", log_dir, log_dir_file_sizes)]
    if checkpoint_dir is not None:
        needs.append(("checkpoint_dir", checkpoint_dir, checkpoint_file_sizes))
    try:
        for flag, folder, _ in needs:
            check_output_folder(folder, flag, needs_locks=flag == "checkpoint_dir")
        if log_path.exists():
            raise UserError(f"{log_path} already exists; choose another --run_id (logs are never overwritten)")
        check_room(needs)
        folders = [log_dir, *sorted(path for path in log_dir.iterdir() if path.is_dir())] if log_dir.is_dir() else []
        for folder in folders:
            for line in remove_dead_temporaries(folder, started):
                print(line, flush=True)
    except OSError as error:  # a folder this process may not read, say another user's
        raise UserError(f"{error.filename or log_dir}: cannot use it ({error.strerror}); fix its permissions or pick another "
                        f"--log_dir or --checkpoint_dir") from None
    if checkpoint_dir is not None:
        claim_checkpoint_dir(checkpoint_dir)


# ---- checkpoints and resume ----
CHECKPOINT_FORMAT = "train_gpt/3"  # /2: the manifest records each file's size and SHA-256; /3: and the train shards,
# and shared.pt holds the settings and the train shards too
# Settings that may differ between a checkpointed run and its resumption (the trajectory does not depend on them).
RUNTIME_ONLY_FIELDS = frozenset({"log_dir", "run_id", "save_checkpoint", "checkpoint_every", "checkpoint_dir", "resume", "mlp_kernel"})


# ---- checkpoint files (the same helpers in train_gpt.py and train_gpt_shampoo.py) ----
# A resumable checkpoint is a folder: rank<r>.pt from every rank (its optimizer state, RNG), shared.pt from rank 0
# (model, loader position, progress, settings, train shards) and manifest.json (format, run id, world size, progress,
# settings, train shards, and each file's size and SHA-256, computed while writing and checked before anything is
# loaded; what it repeats of shared.pt is checked against shared.pt, whose hash it holds), staged in a hidden
# .<name>.partial-<run id> folder that rank 0 renames into place: a save is all or nothing, and an existing
# checkpoint is never replaced.
PARTIAL_MARKER = ".partial-"
_last_checkpoint: Path | None = None  # this run's newest complete checkpoint, or the one it resumed from


def last_checkpoint_note() -> str:
    """Where a stopped run can continue from, for its last line."""
    if _last_checkpoint is None:
        return ""
    return f"; the last complete checkpoint is {_last_checkpoint} (--resume={_last_checkpoint} continues from it)"


def remove_stale_partial_checkpoints(directory: Path) -> None:
    """Rank 0 removes the staging folders of saves that never finished, and logs one line naming them. This run
    holds the folder (claim_checkpoint_dir) and has not saved yet: every such folder is a dead run's."""
    if not _is_master or not directory.is_dir():
        return
    stale = sorted(p for p in directory.glob(f".*{PARTIAL_MARKER}*") if p.is_dir())
    for path in stale:
        shutil.rmtree(path)
    if stale:
        print0(f"removed {len(stale)} unfinished checkpoint folder(s) of interrupted saves from {directory}: "
               f"{', '.join(path.name for path in stale)}", console=True)


class HashingWriter:
    """A binary file that counts and hashes (SHA-256) the bytes written through it, and keeps the file system's
    error (ENOSPC, EFBIG), which torch.save reports only as a RuntimeError of its own."""

    def __init__(self, f: BinaryIO):
        self.f, self.size, self.sha256 = f, 0, hashlib.sha256()
        self.error: OSError | None = None

    def write(self, data: Any) -> int:
        try:
            written = self.f.write(data)
        except OSError as error:
            self.error = error
            raise
        self.sha256.update(data)
        self.size += memoryview(data).nbytes
        return written

    def flush(self) -> None:
        self.f.flush()


def atomic_torch_save(obj: Any, path: Path, replace: bool = True) -> dict[str, Any]:
    """torch.save through write_atomically; returns the file's manifest entry (size, SHA-256). A failed write raises
    its OSError."""
    entry: dict[str, Any] = {}

    def save(f: BinaryIO) -> None:
        hashing = HashingWriter(f)
        try:
            torch.save(obj, hashing)
        except RuntimeError:
            if hashing.error is None:
                raise
            raise hashing.error from None
        entry.update(bytes=hashing.size, sha256=hashing.sha256.hexdigest())

    write_atomically(path, save, replace)
    return entry


def fsync_directory(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def rng_state(device: torch.device) -> dict[str, Tensor]:
    state = {"torch": torch.get_rng_state()}
    if device.type == "cuda":
        state["cuda"] = torch.cuda.get_rng_state(device)
    return state


def set_rng_state(state: dict[str, Tensor], device: torch.device) -> None:
    torch.set_rng_state(state["torch"].cpu())
    if device.type == "cuda":
        torch.cuda.set_rng_state(state["cuda"].cpu(), device)


def comparable_settings(hp: Hyperparameters) -> dict[str, Any]:
    """The settings as the manifest stores them (JSON: tuples become lists)."""
    return json.loads(json.dumps(dataclasses.asdict(hp)))


def write_checkpoint(target: Path, run_id: str, rt: Runtime, settings: dict[str, Any], train_shards: list[dict[str, Any]],
                     progress: dict[str, Any], rank_state: dict[str, Any], shared_state: dict[str, Any]) -> bool:
    """Writes the checkpoint folder `target` (collective); False, and nothing written, when it already exists. The
    files are staged in a hidden folder (stage_checkpoint_files), which rank 0 publishes as target with their
    manifest (publish_checkpoint). A write that fails on any rank (a full disk) removes the staging folder and stops
    every rank with one line that names the last complete checkpoint. The settings and the train shards
    (train_shard_record) go into shared.pt as well as the manifest: shared.pt's hash makes them the trusted copy."""
    global _last_checkpoint
    exists = [target.exists()]
    dist.broadcast_object_list(exists, 0)  # every rank takes the same branch
    if exists[0]:
        return False
    staging = target.with_name(f".{target.name}{PARTIAL_MARKER}{run_id}")
    shared_state = dict(shared_state, hyperparameters=settings, train_shards=train_shards)
    files = stage_checkpoint_files(staging, target, rt, progress, rank_state, shared_state)
    manifest = dict(format=CHECKPOINT_FORMAT, run_id=run_id, world_size=rt.world_size, **progress,
                    hyperparameters=settings, train_shards=train_shards, files=dict(sorted(files.items())))
    publish_checkpoint(staging, target, manifest)
    _last_checkpoint = target
    return True


def agree_on_checkpoint_write(error: OSError | None, files: dict[str, Any], staging: Path, target: Path, step: int) -> dict[str, Any]:
    """Collective: every rank's files' manifest entries (name -> size and SHA-256); when a rank's write failed (error),
    rank 0 removes the staging folder (the space of the partial save) and every rank stops with one line."""
    outcomes: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(outcomes, (None if error is None else error.strerror or str(error), files))
    failed = next((reason for reason, _ in outcomes if reason is not None), None)
    if failed is not None:
        if _is_master:
            shutil.rmtree(staging, ignore_errors=True)
        raise UserError(f"step {step}: cannot write checkpoint {target} ({failed}){last_checkpoint_note()}")
    return {name: entry for _, entries in outcomes for name, entry in entries.items()}


def stage_checkpoint_files(staging: Path, target: Path, rt: Runtime, progress: dict[str, Any], rank_state: dict[str, Any],
                           shared_state: dict[str, Any]) -> dict[str, Any]:
    """Collective: rank 0 creates the staging folder; then each rank writes its rank<r>.pt into it (its state and RNG),
    and rank 0 shared.pt (the shared state and the progress). Returns every file's manifest entry."""
    error, files = None, {}
    if rt.rank == 0:
        try:
            staging.mkdir(parents=True, exist_ok=True)
        except OSError as failure:
            error = failure
    agree_on_checkpoint_write(error, {}, staging, target, progress["step"])
    try:
        files[f"rank{rt.rank}.pt"] = atomic_torch_save(dict(rank_state, rng=rng_state(rt.device)), staging / f"rank{rt.rank}.pt")
        if rt.rank == 0:
            files["shared.pt"] = atomic_torch_save(dict(shared_state, progress=progress), staging / "shared.pt")
    except OSError as failure:
        error = failure
    return agree_on_checkpoint_write(error, files, staging, target, progress["step"])


def publish_checkpoint(staging: Path, target: Path, manifest: dict[str, Any]) -> None:
    """Collective: rank 0 writes manifest.json into the staging folder and renames the folder to target, after which
    the checkpoint is complete: a failed sync of target's folder then is a warning, not a failed save."""
    error = None
    if _is_master:
        try:
            text = json.dumps(manifest, indent=1) + "\n"
            write_atomically(staging / "manifest.json", lambda f: f.write(text.encode()))
            fsync_directory(staging)
            os.rename(staging, target)  # target was checked above; a rename never merges into an existing folder
        except OSError as failure:
            error = failure
    agree_on_checkpoint_write(error, {}, staging, target, manifest["step"])
    if _is_master:
        try:
            fsync_directory(target.parent)
        except OSError as failure:
            print0(f"warning: checkpoint {target} is complete, but syncing its folder failed ({failure.strerror}): a "
                   f"crash of this machine may still lose it", console=True)


class ResumePoint(NamedTuple):
    path: Path
    manifest: dict[str, Any]

    @property
    def step(self) -> int:
        return int(self.manifest["step"])

    @property
    def trial(self) -> int:
        return int(self.manifest.get("trial", 0))  # a launch of train_gpt_shampoo.py may run several trials


def read_manifest(path: Path) -> dict[str, Any] | None:
    """A checkpoint folder's manifest.json, when it is one of this script's version."""
    try:
        manifest = json.loads((path / "manifest.json").read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(manifest, dict) or manifest.get("format") != CHECKPOINT_FORMAT:
        return None
    return manifest if manifest_problem(manifest) is None else None


# The manifest's fields that resuming reads, and their types; "trial" only where the script records trials.
MANIFEST_FIELDS: dict[str, type] = {"run_id": str, "world_size": int, "step": int, "hyperparameters": dict,
                                     "train_shards": list, "files": dict}


def manifest_problem(manifest: dict[str, Any]) -> str | None:
    """Which field resuming reads is missing from a manifest or of another type (None: none), as one phrase."""
    expected = dict(MANIFEST_FIELDS, trial=int) if "trial" in manifest else MANIFEST_FIELDS
    for name, kind in expected.items():
        if name not in manifest:
            return f"manifest.json has no {name!r}"
        value = manifest[name]
        if not isinstance(value, kind) or isinstance(value, bool):  # json's true is a Python int too
            return f"manifest.json's {name!r} is {value!r}, not {'a whole number' if kind is int else f'a JSON {kind.__name__}'}"
    return None


def file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 24):
            digest.update(chunk)
    return digest.hexdigest()


def checkpoint_problem(path: Path, manifest: dict[str, Any], names: Sequence[str]) -> str | None:
    """What is wrong with the named files of a checkpoint, against the sizes and SHA-256 hashes its manifest records
    (None: nothing): the first missing, truncated, corrupt or unreadable file, named."""
    recorded = manifest.get("files") or {}
    for name in names:
        entry, file = recorded.get(name), path / name
        if not isinstance(entry, dict):
            return f"manifest.json records no size and hash of {name}"
        try:
            if not file.is_file():
                return f"{name} is missing"
            size = file.stat().st_size
            if size != entry.get("bytes"):
                return f"{name} is {size} bytes, manifest.json records {entry.get('bytes')} (the file is truncated or was replaced)"
            if file_sha256(file) != entry.get("sha256"):
                return f"{name} does not match the SHA-256 manifest.json records (the file is corrupt)"
        except OSError as error:
            return f"cannot read {error.filename} ({error.strerror})"
    return None


def checkpoint_file_names(world_size: int) -> list[str]:
    return ["shared.pt"] + [f"rank{r}.pt" for r in range(world_size)]


def previous_complete_checkpoint(path: Path, manifest: dict[str, Any], world_size: int) -> Path | None:
    """The newest checkpoint of path's folder before path whose files match their manifest."""
    position = lambda m: (int(m.get("trial", 0)), int(m.get("step", 0)))
    earlier = []
    for folder in path.parent.iterdir():
        other = read_manifest(folder) if folder.is_dir() and not folder.name.startswith(".") and folder != path else None
        if other is not None and other.get("world_size") == world_size and position(other) < position(manifest):
            earlier.append((position(other), folder, other))
    for _, folder, other in sorted(earlier, key=lambda item: item[0], reverse=True):
        if checkpoint_problem(folder, other, checkpoint_file_names(world_size)) is None:
            return folder
    return None


def checkpoint_manifest(path_text: str, world_size: int) -> dict[str, Any]:
    """The manifest of the checkpoint --resume names, when the checkpoint is complete and of this script's version and
    world size; a one-line UserError otherwise."""
    manifest_path = Path(path_text) / "manifest.json"
    if not manifest_path.is_file():
        raise UserError(f"--resume={path_text}: no complete checkpoint there (missing {manifest_path}); pass a folder "
                        f"written by --checkpoint_every")
    try:
        manifest = json.loads(manifest_path.read_text())
    except (OSError, ValueError) as error:
        raise UserError(f"--resume={path_text}: unreadable manifest.json ({error}); pass another checkpoint") from None
    found = manifest.get("format") if isinstance(manifest, dict) else None
    if found != CHECKPOINT_FORMAT:
        writer, this = str(found).partition("/")[0], CHECKPOINT_FORMAT.partition("/")[0]
        if writer in ("train_gpt", "train_gpt_shampoo") and writer != this:
            raise UserError(f"--resume={path_text}: a checkpoint of {writer}.py (format {found!r}), not of {this}.py; resume "
                            f"it with {writer}.py, or pass a checkpoint of {this}.py")
        raise UserError(f"--resume={path_text}: not a checkpoint of this script's version (format {found!r}, expected "
                        f"{CHECKPOINT_FORMAT!r}); resume it with the version of {this}.py that wrote it"
                        f"{writer_commit_note(manifest)}, or pass another checkpoint")
    problem = manifest_problem(manifest)
    if problem is not None:
        raise UserError(f"--resume={path_text}: {problem} (the file was edited or damaged); pass another checkpoint")
    if manifest["world_size"] != world_size:
        raise UserError(f"--resume={path_text}: written by {manifest['world_size']} processes; resume with the same "
                        f"number (this run has {world_size})")
    return manifest


def check_same_settings(path_text: str, manifest: dict[str, Any], settings: dict[str, Any]) -> None:
    """The checkpoint continues a run of these settings (those in RUNTIME_ONLY_FIELDS may differ)."""
    saved = manifest["hyperparameters"]
    differing = [f"{name}={saved.get(name)!r} there, {value!r} here" for name, value in settings.items()
                 if name not in RUNTIME_ONLY_FIELDS and saved.get(name) != value]
    if differing:
        raise UserError(f"--resume={path_text}: the checkpoint was written with other settings: {'; '.join(differing)}")


def train_shard_record(files: Sequence[str]) -> list[dict[str, Any]]:
    """What a checkpoint records of the train shards, in the loader's order: each file's name (the base name, which
    moving the repository or the data folder keeps), size and token count (its header, checked by read_shard_header).
    The loader's position (a shard number and an offset) means something only in these files."""
    return [dict(name=os.path.basename(path), bytes=os.path.getsize(path), tokens=read_shard_header(path)) for path in files]


def check_ranks_read_the_same_shards(train_shards: list[dict[str, Any]], rt: Runtime) -> None:
    """Collective: every rank's --train_files matches the shards rank 0's does. Each rank resolves the pattern itself,
    so machines without a shared file system can hold different copies; ranks reading different shards would train,
    and a resumed run continue, on data that no log or checkpoint records."""
    everyone: list[Any] = [None] * rt.world_size
    dist.all_gather_object(everyone, train_shards)
    reference = everyone[0]
    show = lambda shards, index: shard_text(shards[index]) if index < len(shards) else "none"
    for rank, shards in enumerate(everyone):
        if shards != reference:
            first = next((i for i, (a, b) in enumerate(zip(reference, shards)) if a != b), min(len(reference), len(shards)))
            raise UserError(f"--train_files: rank {rank} matches {len(shards)} shards and rank 0 {len(reference)}, the first "
                            f"difference at shard {first + 1}: {show(shards, first)} on rank {rank}, {show(reference, first)} "
                            f"on rank 0; give every machine the same shard files")


def shard_text(shard: dict[str, Any]) -> str:
    """One entry of train_shard_record as the refusals name it."""
    return f"{shard['name']} ({shard['tokens']} tokens, {shard['bytes']} bytes)"


def first_shard_difference(saved: list[dict[str, Any]], found: list[dict[str, Any]], appended_ok: bool) -> str | None:
    """The first difference between the run's train shards and those the pattern matches now, as a phrase; with
    appended_ok, shards after the run's are none."""
    for number, (then, now) in enumerate(zip(saved, found), 1):
        if then != now:
            return f"shard {number} here is {shard_text(now)}, the run's was {shard_text(then)}"
    counts = f"it matches {len(found)} shard{'s' if len(found) != 1 else ''} where the run read {len(saved)}"
    if len(found) < len(saved):
        return f"{counts}, the first missing being {shard_text(saved[len(found)])}"
    if len(found) > len(saved) and not appended_ok:
        return f"{counts}, the first new one being {shard_text(found[len(saved)])}"
    return None


def check_same_train_shards(path_text: str, manifest: dict[str, Any], train_shards: list[dict[str, Any]]) -> None:
    """The --train_files pattern matches the shards the checkpoint's run read, in its order (the manifest's record,
    which check_shared_state found equal to shared.pt's): a resumed loader's position in other shards would
    silently train on other data. Shards added after the run's are allowed without cycling (the loader reaches them
    only where the run stopped for want of data, which is what adding shards is for); with cycling they would change
    where it starts over."""
    saved = manifest["train_shards"]
    difference = first_shard_difference(saved, train_shards, appended_ok=not manifest["hyperparameters"].get("cycle_train_files"))
    if difference is not None:
        added = len(train_shards) > len(saved) and train_shards[: len(saved)] == saved  # refused only because it cycles
        why = " (the run cycles through its shards, so added ones would change where it starts over)" if added else ""
        raise UserError(f"--resume={path_text}: the --train_files pattern matches other shards than the run read: "
                        f"{difference}{why}; make it match the run's shards (move other files out of the pattern's folder, "
                        f"or restore the run's), or start a new run")


def writer_commit_note(manifest: Any) -> str:
    """Where the commit that wrote a checkpoint is named, for a refusal that sends the user to that version: the
    git_commit line of its run's log (the manifest's run id names the log, <log_dir>/<run_id>.txt)."""
    run_id = manifest.get("run_id") if isinstance(manifest, dict) else None
    return f" (the git_commit line of its run's log, {run_id}.txt, names it)" if isinstance(run_id, str) and run_id else ""


def first_setting_difference(saved: dict[str, Any], found: dict[str, Any]) -> str | None:
    """The first setting whose value differs between two settings dicts (a missing one counts), as a phrase."""
    missing = object()
    for name in [*saved, *(name for name in found if name not in saved)]:
        then, now = saved.get(name, missing), found.get(name, missing)
        if then != now:
            show = lambda value: "absent" if value is missing else repr(value)
            return f"{name}: {show(then)} in shared.pt, {show(now)} in manifest.json"
    return None


def check_shared_state(path_text: str, manifest: dict[str, Any]) -> None:
    """shared.pt's progress, settings and train shards are the manifest's (the manifest is not covered by the hashes
    it records: its step names the checkpoints still to come and the resumed_from line, and its settings are what
    check_same_settings compares), and its model weights are finite: a model that diverged in the last update before
    a save would otherwise stop the resumed run at its first step, blaming training. A shared.pt without settings was
    written before shared.pt held them. shared.pt is opened with mmap: only what is checked is read."""
    shared = torch.load(Path(path_text) / "shared.pt", map_location="cpu", weights_only=True, mmap=True)
    differing = [f"{name}={manifest.get(name)!r} there, {value!r} in shared.pt" for name, value in shared["progress"].items()
                 if manifest.get(name) != value]
    if differing:
        raise UserError(f"--resume={path_text}: manifest.json does not match the checkpoint it describes ({'; '.join(differing)}): "
                        f"it was edited; put back its values or pass another checkpoint")
    this = CHECKPOINT_FORMAT.partition("/")[0]
    missing = [key for key in ("hyperparameters", "train_shards") if key not in shared]
    if missing:
        raise UserError(f"--resume={path_text}: shared.pt records no {' and no '.join(missing)}, which this format holds there: it "
                        f"was written by an older version of {this}.py than its manifest.json's format says; resume it with the version that wrote it"
                        f"{writer_commit_note(manifest)}, or pass another checkpoint")
    difference = first_setting_difference(shared["hyperparameters"], manifest["hyperparameters"])
    if difference is not None:
        raise UserError(f"--resume={path_text}: manifest.json's settings are not those the checkpoint was trained with "
                        f"({difference}): it was edited; put back shared.pt's values and resume with those settings, or "
                        f"start a new run")
    if shared["train_shards"] != manifest["train_shards"]:
        raise UserError(f"--resume={path_text}: manifest.json's train_shards are not those shared.pt records: it was edited; "
                        f"put back its values or pass another checkpoint")
    for name, weight in shared["model"].items():
        if weight.is_floating_point() and not bool(torch.isfinite(weight.float()).all()):
            raise UserError(f"--resume={path_text}: shared.pt holds non-finite model weights ({name}): the run had diverged "
                            f"when it was saved; resume from an earlier checkpoint")


def open_checkpoint(path_text: str, settings: dict[str, Any], train_shards: list[dict[str, Any]], rt: Runtime) -> ResumePoint:
    """Checks, before the run starts (collective), the checkpoint's manifest (checkpoint_manifest), that the files are
    the ones it records (sizes and SHA-256; each rank checks those it loads, shared.pt and its own rank<r>.pt), that
    shared.pt agrees with the manifest and holds a finite model (check_shared_state), that it continues these
    settings, and that the train shards (train_shard_record of this run's --train_files) are the run's. At the first
    problem a rank finds, every rank stops with one line; a damaged file's names the previous complete checkpoint
    (rank 0 looks for it)."""
    path = Path(path_text)
    manifest = run_on(True, lambda: checkpoint_manifest(path_text, rt.world_size))
    problems: list[str | None] = [None] * rt.world_size
    dist.all_gather_object(problems, checkpoint_problem(path, manifest, ["shared.pt", f"rank{rt.rank}.pt"]))
    problem = next((problem for problem in problems if problem is not None), None)
    if problem is not None:
        previous = [previous_complete_checkpoint(path, manifest, rt.world_size) if rt.rank == 0 else None]
        dist.broadcast_object_list(previous, 0)
        advice = (f"resume from {previous[0]}, the previous complete checkpoint there" if previous[0] is not None
                  else f"{path.parent} holds no earlier complete checkpoint")
        raise UserError(f"--resume={path_text}: {problem}; {advice}")
    run_on(rt.rank == 0, lambda: check_shared_state(path_text, manifest))
    run_on(True, lambda: check_same_settings(path_text, manifest, settings))
    run_on(True, lambda: check_same_train_shards(path_text, manifest, train_shards))
    return ResumePoint(path, manifest)


# ---- Track 1's checkpoints: <checkpoint_dir>/step<N> ----
@dataclass
class Progress:
    """Where training stands; checkpointed so that a resumed run continues the step count and the clock."""

    step: int = 0
    training_time_ms: float = 0.0


def checkpoint_path(directory: Path, step: int) -> Path:
    return directory / f"step{step:06d}"


def checkpoint_steps(hp: Hyperparameters, start_step: int) -> list[int]:
    """The steps after start_step at which --checkpoint_every saves: its multiples, and the last step."""
    every = hp.checkpoint_every
    return [*range((start_step // every + 1) * every, hp.train_steps, every), hp.train_steps] if start_step < hp.train_steps else []


def check_checkpoints_are_new(directory: Path, hp: Hyperparameters, start_step: int) -> None:
    """The checkpoints this run would write must not exist; earlier steps may (a resumed run keeps writing into the
    folder of the run it continues)."""
    for step in checkpoint_steps(hp, start_step):
        if checkpoint_path(directory, step).exists():
            raise UserError(
                f"checkpoint {checkpoint_path(directory, step)} already exists and this run would write it; pick another --checkpoint_dir (checkpoints are never overwritten)"
            )


def save_resumable(
    target: Path, run_id: str, rt: Runtime, settings: dict[str, Any], train_shards: list[dict[str, Any]], raw_model: GPT,
    adam: DistAdam, muon: Muon, loader: TrainLoader, progress: Progress
) -> bool:
    rank_state = dict(adam=adam.state_dict(), muon=muon.state_dict())  # each rank's DistAdam and Muon shards
    shared_state = dict(model=raw_model.state_dict(), loader=loader.state_dict())
    return write_checkpoint(target, run_id, rt, settings, train_shards, dataclasses.asdict(progress), rank_state, shared_state)


def state_file(log_dir: Path, run_id: str, step: int) -> Path:
    """Where --save_checkpoint writes the end-of-run state: <log_dir>/<run_id>/state_step<N>.pt."""
    return log_dir / run_id / f"state_step{step:06d}.pt"


def state_file_problem(path: Path) -> str | None:
    """Why the end-of-run state file cannot be written at path, as one line: it exists, or its folder is a file."""
    if os.path.lexists(path):
        return f"{path} already exists; choose another --run_id or move the file away (checkpoints are never overwritten)"
    if os.path.lexists(path.parent) and not os.path.isdir(path.parent):
        return f"{path.parent} is a file, not a folder, and --save_checkpoint writes {path.name} in it; choose another --run_id or move the file away"
    return None


def check_state_file_is_new(log_dir: Path, run_id: str, step: int) -> None:
    """Rank 0, before the log exists: the end-of-run state file this run would write is new and its folder is one (or
    is still to be created). Found only at the save, after training, either would cost the whole run."""
    problem = state_file_problem(state_file(log_dir, run_id, step))
    if problem is not None:
        raise UserError(problem)


def save_checkpoint(log_path: Path, run_id: str, step: int, raw_model: GPT, adam: DistAdam, muon: Muon) -> Path:
    """The record's end-of-run state file (rank 0's view; not resumable), written atomically; never overwrites
    (check_state_file_is_new refused an existing one before the run)."""
    path = state_file(log_path.parent, run_id, step)
    state = dict(step=step, code=Path(__file__).read_text(), model=raw_model.state_dict(), optimizers=[adam.state_dict(), muon.state_dict()])
    try:
        path.parent.mkdir(exist_ok=True)
        atomic_torch_save(state, path, replace=False)
    except FileExistsError:  # made since the check
        raise UserError(state_file_problem(path) or f"{path} already exists; checkpoints are never overwritten") from None
    except OSError as error:  # a full disk: the temporary file is gone, the log names what survives
        raise UserError(f"cannot write {path} ({error.strerror}){last_checkpoint_note()}") from None
    return path


def load_optimizer_state(optimizer: torch.optim.Optimizer, state: dict[str, Any]) -> None:
    """Optimizer.load_state_dict casts floating state to its parameter's dtype, but DistAdam keeps bf16 moments
    of fp32 parameters: the saved dtypes are put back (exactly: bf16 -> fp32 -> bf16 loses nothing)."""
    optimizer.load_state_dict(state)
    params = [p for group in optimizer.param_groups for p in group["params"]]
    for index, saved in state["state"].items():
        live = optimizer.state[params[index]]
        for key, value in saved.items():
            if isinstance(value, Tensor) and live[key].dtype != value.dtype:
                live[key] = live[key].to(value.dtype)


def load_resumable(point: ResumePoint, rt: Runtime, raw_model: GPT, adam: DistAdam, muon: Muon, loader: TrainLoader) -> Progress:
    shared = torch.load(point.path / "shared.pt", map_location=rt.device, weights_only=True)
    own = torch.load(point.path / f"rank{rt.rank}.pt", map_location=rt.device, weights_only=True)
    raw_model.load_state_dict(shared["model"])
    load_optimizer_state(adam, own["adam"])
    load_optimizer_state(muon, own["muon"])
    loader.load_state_dict(shared["loader"])
    set_rng_state(own["rng"], rt.device)
    return Progress(**shared["progress"])


# =============================================================================================
# Warmup (untimed; model and optimizer state restored afterwards)
# =============================================================================================
def set_schedules(step: int, hp: Hyperparameters, adam: DistAdam, muon: Muon) -> None:
    for opt in (adam, muon):
        for group in opt.param_groups:
            group["lr"] = group["initial_lr"] * lr_multiplier(step, hp)
    for group in muon.param_groups:
        group["momentum"] = muon_momentum(step, hp)


def warmup_kernels(raw_model: GPT, adam: DistAdam, muon: Muon, hp: Hyperparameters, make_train_loader: Callable[[], Iterator[Batch]]) -> None:
    """Compiles the graph of every training window (and autotunes the kernels) on real batches."""
    saved = copy.deepcopy(dict(model=raw_model.state_dict(), adam=adam.state_dict(), muon=muon.state_dict()))
    for opt in (adam, muon):  # initial LR, momentum hp.muon_momentum (the group defaults; restored below anyway)
        for group in opt.param_groups:
            group["lr"] = group["initial_lr"]
    for group in muon.param_groups:
        group["momentum"] = hp.muon_momentum
    loader = make_train_loader()
    raw_model.rotary.reset()
    for step in range(hp.warmup_steps):
        ws_long = hp.ws_schedule[step % len(hp.ws_schedule)]
        raw_model.rotary.set_window(ws_long)
        batch = next(loader)
        windows = raw_model.attention.window_args(ws_long // 2, ws_long, batch.inputs.device)
        raw_model(batch.inputs, batch.targets, batch.cu_seqlens, *windows, hp.train_max_seq_len).backward()
        adam.step()
        muon.step()
        raw_model.zero_grad()
    raw_model.rotary.reset()
    raw_model.load_state_dict(saved["model"])
    adam.load_state_dict(saved["adam"])
    muon.load_state_dict(saved["muon"])


# =============================================================================================
# Train / validate loop
# =============================================================================================
@torch.no_grad()
def evaluate(
    model: GPT, hp: Hyperparameters, rt: Runtime, make_val_loader: Callable[[], Iterator[Batch]], windows: tuple[Window, Window]
) -> Tensor:
    """Mean loss over val_tokens: sum of per-micro-step means / steps, then averaged across ranks."""
    model.eval()
    val_steps = rt.grad_accum_steps * hp.val_tokens // hp.val_batch_size
    loader = make_val_loader()
    max_seqlen = hp.val_batch_size // (rt.grad_accum_steps * rt.world_size)
    total = torch.zeros((), device=rt.device)
    for _ in range(val_steps):
        batch = next(loader)
        total += model(batch.inputs, batch.targets, batch.cu_seqlens, *windows, max_seqlen)
    total /= val_steps
    if rt.world_size > 1:
        dist.all_reduce(total, op=dist.ReduceOp.AVG)
    model.train()
    return total


def train(
    raw_model: GPT,
    adam: DistAdam,
    muon: Muon,
    hp: Hyperparameters,
    rt: Runtime,
    loader: TrainLoader,
    make_val_loader: Callable[[], Iterator[Batch]],
    progress: Progress,
    save_resumable_at: Callable[[Progress], None] | None,
) -> float:
    """The timed run (docs/track1_recipe.md#training-loop-and-timing): validation and checkpointing are outside
    the clock. Returns the final val loss.

    Starts at progress.step (0, or a checkpoint's). Stops early, raising RunStopped, on a non-finite training
    or validation loss, or at the step boundary after SIGINT/SIGTERM/SIGHUP or a failed write of the log
    (checkpointing first when enabled; every rank with the same line, stop_if_asked). A stopped run leaves
    _defer_stop set: a signal that arrives while it reports (torchrun's SIGTERM to the other ranks) cannot cut the
    report short."""
    global _defer_stop, _step_reached
    train_steps, start = hp.train_steps, progress.step
    saves = frozenset(checkpoint_steps(hp, start)) if save_resumable_at is not None else frozenset()
    raw_model.rotary.reset()
    for past in range(start):  # a resumed run: the rotary tables as training left them, by the same updates
        raw_model.rotary.set_window(window_blocks(past, hp)[1])
    health = StepHealth(rt.device, rt.world_size, HEALTH_LAG_CUDA if rt.device.type == "cuda" else 0)
    final_loss = float("nan")
    _defer_stop = True
    synchronize(rt.device)
    t0 = time.perf_counter()

    def stop_clock() -> None:
        synchronize(rt.device)
        progress.training_time_ms += 1000 * (time.perf_counter() - t0)

    for step in range(start, train_steps + 1):
        progress.step = _step_reached = step
        last_step = step == train_steps
        if health.poll(keep=0 if last_step else health.lag):  # a rank asked to stop
            if save_resumable_at is not None and step != start:
                stop_clock()
                save_resumable_at(progress)
            stop_if_asked()
        ws_short, ws_long = window_blocks(step, hp)
        raw_model.rotary.set_window(ws_long)
        validate = last_step or (hp.val_loss_every > 0 and step % hp.val_loss_every == 0)
        checkpoint = step in saves
        if validate or checkpoint:
            stop_clock()
            if validate:
                eval_short, eval_long = (hp.ws_validate // 2, hp.ws_long_validate) if last_step else (ws_short, ws_long)
                eval_windows = raw_model.attention.window_args(eval_short, eval_long, rt.device)
                final_loss = evaluate(raw_model, hp, rt, make_val_loader, eval_windows).item()
                training_time_ms = progress.training_time_ms
                print0(
                    f"step:{step}/{train_steps} val_loss:{final_loss:.4f} train_time:{training_time_ms:.0f}ms step_avg:{training_time_ms / max(step, 1):.2f}ms",
                    console=True,
                )
                if not math.isfinite(final_loss):
                    raise RunStopped(f"step {step}: non-finite validation loss ({final_loss}); stopping", NON_FINITE_EXIT_STATUS)
            if checkpoint:
                stop = health.poll(keep=0)  # never checkpoint a diverged model
                save_resumable_at(progress)
                if stop:
                    stop_if_asked()
            synchronize(rt.device)
            t0 = time.perf_counter()
        if last_step:
            break
        windows = raw_model.attention.window_args(ws_short, ws_long, rt.device)
        step_loss = torch.zeros((), device=rt.device)
        for _ in range(rt.grad_accum_steps):
            batch = next(loader)
            loss = raw_model(batch.inputs, batch.targets, batch.cu_seqlens, *windows, hp.train_max_seq_len)
            loss.backward()
            step_loss += loss.detach()
        set_schedules(step, hp, adam, muon)
        adam.launch_reductions()
        muon.launch_reductions()  # in flight while Adam updates
        adam.step()
        muon.step()
        raw_model.zero_grad()  # keeps the tables' and matrices' gradient buffers, zeroed
        health.push(step, step_loss, stop_requested())
        approx_ms = progress.training_time_ms + 1000 * (time.perf_counter() - t0)  # no synchronize: the record's way
        print0(f"step:{step + 1}/{train_steps} train_time:{approx_ms:.0f}ms step_avg:{approx_ms / (step + 1):.2f}ms", console=True)
    stop_if_asked(signals=False)  # the last step's lines did not reach the log; a signal now lets the run end as usual
    _defer_stop = False
    return final_loss


# =============================================================================================
# Main
# =============================================================================================
def configure_torch(device: torch.device) -> None:
    warnings.filterwarnings("ignore", category=FutureWarning, module="torch.distributed")  # *_tensor collectives renamed in 2.13
    dynamo_config = torch._dynamo.config
    for name in ("recompile_limit", "cache_size_limit"):  # FA3: one graph per (window, attn_scale), see AttentionBackend
        if hasattr(dynamo_config, name):
            setattr(dynamo_config, name, 64)
    if device.type == "cuda":
        torch.empty(1, device=device, requires_grad=True).backward()  # early autograd/driver init (record practice)


def build_model(hp: Hyperparameters, rt: Runtime, backend: str, fp8: bool, mlp_kernel: str = "triton") -> GPT:
    """The record model on this rank's device, every parameter broadcast from rank 0: on CUDA the embeddings and
    linears (head, gates) in bf16, the raw matrices and scalars fp32, and the FP8 head in training when fp8; the
    tables' and matrices' gradients added into fixed buffers (GPT.grads_into_buffers); compiled in place when
    hp.compile (so that every zero_grad is the model's own)."""
    on_cuda = rt.device.type == "cuda"
    rotary_positions = max(hp.train_batch_size, hp.val_batch_size) // (rt.grad_accum_steps * rt.world_size)
    attention = attention_backend(backend, hp.block_size, hp.bos_token)
    table_dtype = torch.bfloat16 if on_cuda else torch.float32
    raw_model = GPT(hp.vocab_size, hp.model_dim, hp.num_heads, rotary_positions, hp.block_size, rt.world_size, attention, table_dtype, mlp_kernel)
    raw_model.to(rt.device)
    if on_cuda:
        for module in raw_model.modules():
            if isinstance(module, (nn.Embedding, nn.Linear)):
                module.bfloat16()
    raw_model.lm_head.use_fp8 = fp8
    for param in raw_model.parameters():
        dist.broadcast(param.detach(), 0)
    raw_model.grads_into_buffers([*(table.weight for table in raw_model.tables), *raw_model.matrices()])
    if hp.compile:
        raw_model.compile(dynamic=False, fullgraph=True)
    return raw_model


def open_run_log(hp: Hyperparameters, run_id: str, rt: Runtime) -> None:
    """Rank 0 creates the log and writes this script's source into it (collective: a failure stops every rank)."""
    global _log_path
    _log_path = run_on(_is_master, lambda: open_log(hp.log_dir, run_id))
    announce_log(Path(hp.log_dir) / f"{run_id}.txt", rt)
    print0(Path(__file__).read_text())


def run(argv: list[str]) -> float:
    """Every check that can fail runs before the log file is created: a refused run leaves no log."""
    global _is_master, _last_checkpoint, _log_error
    run_started, _log_error = time.time(), None
    hp, overrides = parse_args(argv)
    settings = comparable_settings(hp)  # what a checkpoint of this run records (before the smoke preset's paths)
    os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")  # read at CUDA's first allocation
    rt = setup_distributed()
    _is_master = rt.rank == 0
    configure_torch(rt.device)
    if hp.seed >= 0:
        torch.manual_seed(hp.seed)
    if "train_files" not in overrides and "val_files" not in overrides and overrides.get("preset") == "smoke":
        smoke_train, smoke_val = smoke_shards(hp, rt, run_started)
        hp = dataclasses.replace(hp, train_files=smoke_train, val_files=smoke_val)
    train_files = resolve_files(hp.train_files, "train")
    val_files = resolve_files(hp.val_files, "val")
    check_val_is_held_out(train_files, val_files)
    train_token_count = check_train_data(train_files, hp.vocab_size)
    val_token_count = check_val_data(
        val_files, val_tokens=hp.val_tokens, val_batch_size=hp.val_batch_size, grad_accum_steps=rt.grad_accum_steps, vocab_size=hp.vocab_size
    )
    train_shards = train_shard_record(train_files)  # what a checkpoint records of the shards the loader reads
    check_ranks_read_the_same_shards(train_shards, rt)
    resume = open_checkpoint(hp.resume, settings, train_shards, rt) if hp.resume else None
    if hp.checkpoint_every and hp.checkpoint_dir:  # the default folder is new: named by the run id
        check_checkpoints_are_new(Path(hp.checkpoint_dir), hp, resume.step if resume else 0)
    _last_checkpoint = resume.path if resume is not None else None

    backend = choose_attention_backend(hp.attention_backend, rt.device, device_capability(rt.device))
    fp8 = fp8_head_available(rt.device) and not hp.disable_fp8
    mlp_kernel = choose_mlp_kernel(hp.mlp_kernel, rt.device, device_capability(rt.device))
    raw_model = build_model(hp, rt, backend, fp8, mlp_kernel)
    adam, muon = build_optimizers(raw_model, hp, rt.rank, rt.world_size)

    run_id = new_run_id(hp.run_id)
    checkpoint_dir = Path(hp.checkpoint_dir or f"checkpoints/{run_id}")
    source = Path(__file__).read_text()
    model_bytes, optimizer_state_bytes = tensor_bytes(raw_model.state_dict()), optimizer_bytes([adam, muon])
    log_dir_file_sizes = [log_bytes(source, 2 * (hp.train_steps + 1))]  # the log: a train and a val line per step, at most
    if hp.save_checkpoint:  # the end-of-run state, <log_dir>/<run_id>/state_step<N>.pt: the source, model and optimizers
        log_dir_file_sizes.append(len(source.encode()) + model_bytes + optimizer_state_bytes)
    checkpoint_file_sizes = [model_bytes] + [optimizer_state_bytes] * rt.world_size  # shared.pt, each rank's rank<r>.pt
    if hp.save_checkpoint:
        run_on(_is_master, lambda: check_state_file_is_new(Path(hp.log_dir), run_id, hp.train_steps))
    run_on(_is_master, lambda: prepare_outputs(Path(hp.log_dir) / f"{run_id}.txt", log_dir_file_sizes,
                                               checkpoint_dir if hp.checkpoint_every else None, checkpoint_file_sizes, run_started))
    open_run_log(hp, run_id, rt)
    print0("=" * 100)
    track_lines = [attention_backend_line(backend), mlp_kernel_line(mlp_kernel), f"fp8_head: {'on' if fp8 else 'off'}"]
    for line in environment_lines(rt, hp, overrides, track_lines, train_files, train_token_count, val_files, val_token_count):
        print0(line)
    log_model_and_muon(raw_model, muon, hp, rt)
    if resume is not None:
        print0(f"resumed_from: {resume.path} (run {resume.manifest['run_id']}) at step {resume.step}")
    if hp.checkpoint_every:
        remove_stale_partial_checkpoints(checkpoint_dir)
    print0("=" * 100)
    raise_if_any_rank_failed(_log_error)

    micro_batches = rt.grad_accum_steps * rt.world_size  # per step, all ranks together
    both_loaders = dict(
        rank=rt.rank, world_size=rt.world_size, bos_token=hp.bos_token, vocab_size=hp.vocab_size, device=rt.device, with_cu_seqlens=ATTENTION_BACKEND_CLASSES[backend].takes_cu_seqlens
    )
    make_train_loader = lambda: TrainLoader(
        train_files,
        num_tokens_local=hp.train_batch_size // micro_batches,
        max_seq_len=hp.train_max_seq_len,
        cycle=hp.cycle_train_files,
        **both_loaders,
    )
    make_val_loader = lambda: val_loader(val_files, num_tokens_local=hp.val_batch_size // micro_batches, **both_loaders)
    warmup_start = time.perf_counter()
    warmup_kernels(raw_model, adam, muon, hp, make_train_loader)
    synchronize(rt.device)
    print0(f"warmup_time: {time.perf_counter() - warmup_start:.1f}s", console=True)
    # Compiling leaves hundreds of thousands of Python objects that live to the end (750,000 for a small model on
    # CPU, whose full collection then took 250-600 ms there). Frozen, the collections in the timed loop no longer
    # walk them, so none of them holds the host up for long while the GPU runs out of queued work.
    gc.collect()
    gc.freeze()

    loader = make_train_loader()
    progress = load_resumable(resume, rt, raw_model, adam, muon, loader) if resume is not None else Progress()

    def save_resumable_at(progress: Progress) -> None:
        target = checkpoint_path(checkpoint_dir, progress.step)
        if save_resumable(target, run_id, rt, settings, train_shards, raw_model, adam, muon, loader, progress):
            print0(f"checkpoint: {target}", console=True)
        else:
            print0(f"checkpoint: {target} already exists; not replaced", console=True)

    final_loss = train(raw_model, adam, muon, hp, rt, loader, make_val_loader, progress, save_resumable_at if hp.checkpoint_every else None)
    if hp.save_checkpoint:  # rank 0 writes it; a failed write stops every rank
        state_path = run_on(_is_master, lambda: save_checkpoint(_log_path, run_id, hp.train_steps, raw_model, adam, muon))
        print0(f"checkpoint: {state_path}", console=True)
    on_cuda = rt.device.type == "cuda"
    allocated = torch.cuda.max_memory_allocated(rt.device) // 2**20 if on_cuda else 0
    reserved = torch.cuda.max_memory_reserved(rt.device) // 2**20 if on_cuda else 0
    print0(f"peak memory allocated: {allocated} MiB reserved: {reserved} MiB", console=True)
    raise_if_any_rank_failed(None if _log_error is None else _log_error + last_checkpoint_note())  # rank 0's, told to all
    release_checkpoint_dir()
    dist.destroy_process_group()
    return final_loss


def main() -> None:
    install_stop_handlers()
    try:
        run(sys.argv[1:])
    except UserError as error:
        print0(f"error: {error}")
        report_stop(f"train_gpt.py: error: {error}")
        status = 2
    except RunStopped as stop:
        print0(str(stop))
        report_stop(str(stop), stop.every_rank)
        status = stop.exit_status
    except RuntimeError as error:  # only the collectives' errors for a lost process; any other is raised
        line = lost_process_line(error)
        if line is None:
            raise
        print0(line)
        report_stop(line, every_rank=True)
        status = LOST_PROCESS_EXIT_STATUS
    else:
        return
    release_checkpoint_dir()
    if dist.is_initialized():
        dist.destroy_process_group()
    sys.exit(status)


# =============================================================================================
# Fast paths (appendix): the same math as the sections above, fast on the GPU
# =============================================================================================
# Each family: the eager formula it replaces (what the model reads as, the CPU path and the tests' reference), its
# Triton kernels, a wrapper that runs them where triton_runs says so and the eager formula elsewhere, and the custom
# op or autograd Function through which the compiled model calls it. tests/test_train_gpt_triton.py runs every kernel
# under TRITON_INTERPRET against its eager formula; tests/test_train_gpt_cuda.py on a GPU.
def _interpreting_triton() -> bool:
    return os.environ.get("TRITON_INTERPRET") == "1"


def triton_runs(
    t: Tensor,
    *,
    dtypes: tuple[torch.dtype, ...] | None = None,
    cuda_dtypes: tuple[torch.dtype, ...] | None = None,
    capability: tuple[int, int] = (0, 0),
    majors: tuple[int, ...] | None = None,
    interpreted: bool = True,
) -> bool:
    """Whether a fast path's Triton kernels run for tensor t, the one rule of every family: on a CUDA tensor of
    cuda_dtypes, on a GPU of at least compute `capability` and of one of the architecture `majors`; on a CPU tensor
    under TRITON_INTERPRET=1 when `interpreted` (the CPU tests); in both, only for tensors of `dtypes`. (None: any.)"""
    if triton is None or (dtypes is not None and t.dtype not in dtypes):
        return False
    if not t.is_cuda:
        return interpreted and _interpreting_triton()
    if _interpreting_triton():
        return interpreted
    if cuda_dtypes is not None and t.dtype not in cuda_dtypes:
        return False
    if capability == (0, 0) and majors is None:  # no device query: some entry points run 32 times a micro-step
        return True
    found = torch.cuda.get_device_capability(t.device)
    return found >= capability and (majors is None or found[0] in majors)


# ---- FP8 head: the soft-capped cross-entropy and its gradient in one pass, e5m2 operand transposes ----
# In training one custom op (fp8_head_loss) does the head's matmul in e4m3, the loss and the logits' gradient: the
# loss is the graph's output, so its gradient is known up to the scalar that backward passes in (1 for
# loss.backward()), and one Triton pass per block of rows (softcap_ce_e5m2) writes the gradient as e5m2 in the two
# layouts the backward _scaled_mm calls take. It replaces inductor's log-sum-exp pass over the bf16 logits, its
# backward pass (read the logits again, write a bf16 gradient) and a cast pass over that gradient (read it, write
# both layouts): per micro-step of the record (49,152 x 50,304 logits) that is 4.9 GB of gradient written and read
# again that no longer exist. The rounding is the eager chain's: the fp32 gradient goes to bf16 (autograd's dtype for
# the bf16 logits), is divided by the gradient scale in bf16, then cast to e5m2. The e5m2 casts and _scaled_mm need
# compute capability 8.9 (FP8_CAPABILITY).
FP8_CAPABILITY = (8, 9)


def fp8_head_available(device: torch.device) -> bool:
    """Whether the FP8 head can train on this device (the run's choice, logged as fp8_head: on/off)."""
    return device.type == "cuda" and torch.cuda.get_device_capability(device) >= FP8_CAPABILITY


def _scale(value: float, like: Tensor) -> Tensor:
    return torch.full((), value, dtype=torch.float32, device=like.device)  # a fill kernel: no host copy, no sync


def softcap_ce_e5m2_eager(logits: Tensor, targets: Tensor, grad_scale: float) -> tuple[Tensor, Tensor, Tensor]:
    """What softcap_ce_e5m2 computes, in PyTorch ops (the CPU path and the kernel's reference): the gradient of
    softcapped_cross_entropy written out, as a custom op's body cannot run autograd."""
    logits = logits.float()
    sig = torch.sigmoid(logits / SOFTCAP_DIVISOR)
    capped = SOFTCAP * sig
    log_sum_exp = torch.logsumexp(capped, dim=-1, keepdim=True)
    losses = (log_sum_exp - capped.gather(-1, targets[:, None]))[:, 0]
    grad_capped = torch.exp(capped - log_sum_exp) - F.one_hot(targets, logits.size(-1))
    grad = (grad_capped * SOFTCAP * (1 - sig) * sig / SOFTCAP_DIVISOR).bfloat16()
    grad_f8 = grad.div(grad_scale).to(torch.float8_e5m2)
    return losses, grad_f8, grad_f8.T.contiguous()


if triton is not None:

    @triton.jit
    def _round_to_bf16(x):
        """fp32 -> nearest-even bf16, returned as fp32 (integer arithmetic, exact under the interpreter too). NaN stays
        NaN: the carry would turn CUDA's 0x7FFFFFFF into -0."""
        bits = x.to(tl.uint32, bitcast=True)
        bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
        return tl.where(x != x, x, bits.to(tl.float32, bitcast=True))

    @triton.jit
    def _e5m2_byte(x):
        """fp32 -> e5m2 byte as torch's cast does it: nearest even, inf beyond the range (NaN becomes inf).
        Integer rounding because the interpreter's own fp8 conversion differs from CUDA's."""
        bits = x.to(tl.uint32, bitcast=True)
        magnitude = bits & 0x7FFFFFFF
        # normals (>= 2^-14): rebias the exponent (127 -> 15) and round away 21 of the 23 mantissa bits
        normal = (magnitude - (112 << 23) + 0xFFFFF + ((magnitude >> 21) & 1)) >> 21
        # below 2^-14 the values are multiples of 2^-16: round |x|·2^16 with the exact 1.5·2^23 addition trick
        scaled = tl.minimum(magnitude.to(tl.float32, bitcast=True) * 65536.0, 4.0)  # (only used below 4)
        subnormal = ((scaled + 12582912.0) - 12582912.0).to(tl.uint32)
        code = tl.minimum(tl.where(magnitude >= (113 << 23), normal, subnormal), 0x7C)
        return (((bits >> 24) & 0x80) | code).to(tl.uint8)

    @triton.jit
    def _scaled_e5m2_codes_ptx(grad, inv_scale):
        """e5m2(bf16(fp32(bf16(grad)) * inv_scale)) of 4 fp32 values as 4 bytes: the eager chain, each cast a CUDA
        instruction converting two values at once (the one-value bf16 cast runs on the XU pipe that the kernel's
        exp2 and reciprocals load). inv_scale is one value for all four: the asm reads the first of its registers."""
        return tl.inline_asm_elementwise(
            """{
            .reg .b32 p0, p1, f0, f1, f2, f3;
            .reg .b16 e0, e1;
            cvt.rn.bf16x2.f32 p0, $2, $1;
            cvt.rn.bf16x2.f32 p1, $4, $3;
            shl.b32 f0, p0, 16;
            and.b32 f1, p0, 0xFFFF0000;
            shl.b32 f2, p1, 16;
            and.b32 f3, p1, 0xFFFF0000;
            mul.rn.f32 f0, f0, $5;
            mul.rn.f32 f1, f1, $5;
            mul.rn.f32 f2, f2, $5;
            mul.rn.f32 f3, f3, $5;
            cvt.rn.bf16x2.f32 p0, f1, f0;
            cvt.rn.bf16x2.f32 p1, f3, f2;
            shl.b32 f0, p0, 16;
            and.b32 f1, p0, 0xFFFF0000;
            shl.b32 f2, p1, 16;
            and.b32 f3, p1, 0xFFFF0000;
            cvt.rn.satfinite.e5m2x2.f32 e0, f1, f0;
            cvt.rn.satfinite.e5m2x2.f32 e1, f3, f2;
            mov.b32 $0, {e0, e1};
            }""",
            "=r,r,r,r,r,r,r,r,r", [grad, inv_scale], dtype=tl.uint8, is_pure=True, pack=4,
        )

    @triton.jit
    def _scaled_e5m2_codes(grad, inv_scale, HARDWARE: tl.constexpr):
        """e5m2 byte of bf16(bf16(grad) * inv_scale), the product in fp32 (|result| < 57344: the saturating and the
        overflowing casts agree)."""
        if HARDWARE:
            return _scaled_e5m2_codes_ptx(grad, inv_scale)
        return _e5m2_byte(_round_to_bf16(_round_to_bf16(grad) * inv_scale))

    @triton.jit
    def _cap_sigmoid(logits, CAP_DIVISOR: tl.constexpr, HARDWARE: tl.constexpr):
        """sigmoid(logits / CAP_DIVISOR) as 1 / (1 + 2^(logits * -log2(e) / CAP_DIVISOR)) with an approximate reciprocal: the correctly
        rounded division is several times the instructions, and this kernel is bound by its arithmetic. On CUDA the
        bare MUFU reciprocal; otherwise the approximate division, which on CUDA gives the same bits here (its range
        guard only acts above 2^126) and which the interpreter runs (there as an exact division)."""
        denominator = 1.0 + tl.exp2(logits * (-1.4426950408889634 / CAP_DIVISOR))
        if HARDWARE:
            return tl.inline_asm_elementwise("rcp.approx.ftz.f32 $0, $1;", "=r,r", [denominator], dtype=tl.float32, is_pure=True, pack=1)
        return tl.fdiv(1.0, denominator, ieee_rounding=False)

    @triton.jit
    def _exp2_on_fma_pipe(x):
        """2^x for x in [-126, 127] (the softmax's exponents lie in [-60, 44]) in FMA-pipe arithmetic; NaN stays NaN.
        The first pass's sigmoid already issues two MUFU instructions (exp2, reciprocal) per logit, and the MUFU pipe
        runs at an eighth of the FMA pipe's rate. x is split as n + f with n the nearest integer (the 1.5 * 2^23
        addition), 2^f comes from a degree-6 polynomial on [-1/2, 1/2] fitted for relative error, and 2^n from the
        exponent bits. tests/test_train_gpt_triton.py bounds the whole function within 1.2 ulp of 2^x under the
        interpreter (which rounds each fma twice; 0.94 ulp with fused operations by a NumPy model); PTX documents
        ex2.approx, the instruction it replaces, within 2."""
        shifted = x + 12582912.0
        f = x - (shifted - 12582912.0)
        p = tl.fma(f, 0.0001534728, 0.0013399944)
        p = tl.fma(p, f, 0.0096184835)
        p = tl.fma(p, f, 0.055503286)
        p = tl.fma(p, f, 0.24022646)
        p = tl.fma(p, f, 0.6931472)
        p = tl.fma(p, f, 1.0)
        return p * ((shifted.to(tl.int32, bitcast=True) - (0x4B400000 - 127)) << 23).to(tl.float32, bitcast=True)

    @triton.jit
    def _softcap_ce_e5m2_kernel(
        logits_ptr, targets_ptr, loss_ptr, grad_ptr, grad_t_ptr, M, N: tl.constexpr, grad_inv_scale,
        CAP: tl.constexpr, CAP_DIVISOR: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, HARDWARE: tl.constexpr,
    ):
        # Rows of logits (M, N) bf16 -> loss per row (fp32) and the e5m2 gradient in grad (M, N) and grad_t (N, M),
        # for the soft cap CAP * sigmoid(logits / CAP_DIVISOR) (SOFTCAP, SOFTCAP_DIVISOR; the comments say 30 and 7.5).
        # Two passes over the row block: the log-sum-exp, then the gradient (columns in reverse). The capped logits lie
        # in (0, 30), so exp() cannot overflow and needs no running maximum. Nsight Compute on an H200 (bench/ncu_kernels.sh,
        # bench/NOTES.md, 2026-12-01, commit f4e4aca) found the XU pipe (exp2, reciprocals, one-value casts) 76% busy and loads
        # waiting on memory the largest stall, hence: exponentials as exp2 with the constants folded in, the
        # bare reciprocal and the two-value casts (HARDWARE), each tile's load issued one tile ahead, the target
        # column's "- 1" of the softmax gradient written once per row after the loop instead of a compare per
        # element, one 64-bit base per tile and 32-bit offsets inside it (M * N exceeds 2^31, a row block does not),
        # and no column masks (N is a multiple of BLOCK_N; the wrapper checks); the first pass's exponential on the
        # FMA pipe (_exp2_on_fma_pipe: 5.59 against 5.81 ms on one H100, bench/NOTES.md, 2026-12-07). HARDWARE=False
        # does the casts in integer arithmetic, as the interpreter's differ from CUDA's, and the reciprocal as a
        # division; on an H200 the two paths give bitwise the same bytes (bench/bench_softcap_ce.py,
        # tests/test_train_gpt_cuda.py).
        CAP_LOG2E: tl.constexpr = CAP * 1.4426950408889634  # e^(30 s) = 2^(s * this)
        row0 = tl.program_id(0) * BLOCK_M
        local_rows = tl.arange(0, BLOCK_M)
        local_cols = tl.arange(0, BLOCK_N)
        row_ok = (row0 + local_rows) < M
        tile_mask = row_ok[:, None]
        tile_offsets = local_rows[:, None] * N + local_cols[None, :]  # < BLOCK_M * N
        tile_offsets_t = local_cols[:, None] * M + local_rows[None, :]  # < BLOCK_N * M
        block_logits = logits_ptr + row0.to(tl.int64) * N
        partial_sums = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)  # summed across columns once, after the loop
        ahead = tl.load(block_logits + tile_offsets, mask=tile_mask, other=0.0)
        for col0 in range(0, N, BLOCK_N):
            logits = ahead.to(tl.float32)  # the next tile's load goes out before this one's arithmetic (the last reloads itself)
            ahead = tl.load(block_logits + tl.minimum(col0 + BLOCK_N, N - BLOCK_N) + tile_offsets, mask=tile_mask, other=0.0)
            partial_sums += _exp2_on_fma_pipe(_cap_sigmoid(logits, CAP_DIVISOR, HARDWARE) * CAP_LOG2E)
        sum_exp = tl.sum(partial_sums, axis=1)
        log2_sum_exp = tl.log2(sum_exp)
        targets = tl.load(targets_ptr + row0 + local_rows, mask=row_ok, other=0).to(tl.int32)
        target_logit = tl.load(block_logits + local_rows * N + targets, mask=row_ok, other=0.0).to(tl.float32)
        target_sig = _cap_sigmoid(target_logit, CAP_DIVISOR, HARDWARE)
        tl.store(loss_ptr + row0 + local_rows, tl.fma(target_sig, -CAP, tl.log(sum_exp)), mask=row_ok)
        # d(30 s)/dx = 30 s (1 - s) / 7.5 = 4 (s - s^2); the 4 rides in the scale (exact: a power of two before and
        # after each rounding, which the wrapper checks); then autograd's bf16 gradient, the division by the gradient
        # scale in bf16 (torch multiplies by the fp32 reciprocal) and the e5m2 cast
        inv_scale_times_cap_ratio = grad_inv_scale * (CAP / CAP_DIVISOR)
        # The gradient pass walks the columns backwards, from the tiles the first pass read last: those may still be
        # in L2 (each element's bytes are the same in either order).
        last_col0: tl.constexpr = N - BLOCK_N
        block_grad = grad_ptr + row0.to(tl.int64) * N
        block_grad_t = grad_t_ptr + row0 + tl.full((), last_col0, tl.int64) * M  # moved back BLOCK_N rows of grad_t per tile
        ahead = tl.load(block_logits + last_col0 + tile_offsets, mask=tile_mask, other=0.0)
        for col_back in range(0, N, BLOCK_N):
            col0 = last_col0 - col_back
            logits = ahead.to(tl.float32)
            ahead = tl.load(block_logits + tl.maximum(col0 - BLOCK_N, 0) + tile_offsets, mask=tile_mask, other=0.0)
            sig = _cap_sigmoid(logits, CAP_DIVISOR, HARDWARE)
            prob = tl.exp2(sig * CAP_LOG2E - log2_sum_exp[:, None])  # the softmax; the target's "- 1" comes below
            code = _scaled_e5m2_codes(prob * (sig - sig * sig), inv_scale_times_cap_ratio, HARDWARE)
            tl.store(block_grad + col0 + tile_offsets, code, mask=tile_mask)
            tl.store(block_grad_t + tile_offsets_t, tl.trans(code), mask=tl.trans(tile_mask))
            block_grad_t -= BLOCK_N * M
        # the target columns again, softmax - 1, over the loop's bytes: the barrier orders this block's stores
        tl.debug_barrier()
        target_prob = tl.exp2(target_sig * CAP_LOG2E - log2_sum_exp)
        target_code = _scaled_e5m2_codes((target_prob - 1.0) * (target_sig - target_sig * target_sig), inv_scale_times_cap_ratio, HARDWARE)
        rows = row0 + local_rows
        tl.store(grad_ptr + rows.to(tl.int64) * N + targets, target_code, mask=row_ok)
        tl.store(grad_t_ptr + targets.to(tl.int64) * M + rows, target_code, mask=row_ok)

# rows x columns per tile, warps. 128 rows store the transposed gradient in 128-byte runs, whole cache lines: on one
# H100, timed in turn with the earlier 32 x 128 x 8 over 7 rounds on a record micro-step, 5.73 against 6.76 ms
# (256 rows: 7.33), every byte the same (bench/NOTES.md, 2026-12-07). On an H200 64 rows were 0.29 ms slower than
# 32 on 2026-12-01 and 0.11 ms faster on 2026-12-02 (one call each); 128 rows were not tried there.
SOFTCAP_CE_TILE = (128, 128, 16)


def softcap_ce_e5m2(
    logits: Tensor, targets: Tensor, grad_scale: float, tile: tuple[int, ...] = SOFTCAP_CE_TILE, hardware: bool | None = None,
) -> tuple[Tensor, Tensor, Tensor]:
    """Per-row loss of softcapped_cross_entropy and its gradient w.r.t. the bf16 logits, divided by grad_scale, in
    e5m2: row-major (M, N) and transposed (N, M), both contiguous. The Triton kernel on CUDA (and under
    TRITON_INTERPRET); softcap_ce_e5m2_eager elsewhere. The columns must be a multiple of the tile's (the padded
    vocabulary is a multiple of 128) and the targets in [0, columns) (token ids are: the kernel writes there).
    hardware (default: on CUDA, not under the interpreter, which runs no PTX and whose casts round differently)
    picks CUDA's cast and reciprocal instructions; False gives the integer casts and the division that the
    interpreter tests. tile: (rows, columns, warps) or (rows, columns, warps, pipeline stages)."""
    if not triton_runs(logits, capability=FP8_CAPABILITY):
        return softcap_ce_e5m2_eager(logits, targets, grad_scale)
    if math.frexp(SOFTCAP / SOFTCAP_DIVISOR)[0] != 0.5:
        raise ValueError(f"softcap_ce_e5m2: SOFTCAP / SOFTCAP_DIVISOR = {SOFTCAP / SOFTCAP_DIVISOR} is not a power of two, which the kernel's scale needs to round as the eager formula does; use the eager formula")
    interpreted = _interpreting_triton()
    if hardware is None:
        hardware = not interpreted
    if hardware and interpreted:
        raise ValueError("softcap_ce_e5m2: hardware=True under TRITON_INTERPRET cannot run (the interpreter runs no PTX, and its casts differ from CUDA's); leave it unset")
    M, N = logits.shape
    block_m, block_n, warps = tile[:3]
    stages = dict(num_stages=tile[3]) if len(tile) > 3 else {}
    if N % block_n:
        raise ValueError(f"softcap_ce_e5m2: {N} columns are not a multiple of the tile's {block_n}; pad the vocabulary or pick a tile that divides it")
    if block_n * M >= 2**31 or block_m * N >= 2**31:
        raise ValueError(f"softcap_ce_e5m2: {M} x {N} logits with {block_m} x {block_n} tiles overflow the kernel's 32-bit offsets inside a tile; use fewer rows per call")
    losses = logits.new_empty(M, dtype=torch.float32)
    grad = logits.new_empty((M, N), dtype=torch.float8_e5m2)
    grad_t = logits.new_empty((N, M), dtype=torch.float8_e5m2)
    inv_scale = (torch.ones((), dtype=torch.float32) / grad_scale).item()  # the fp32 reciprocal, as torch computes it
    _softcap_ce_e5m2_kernel[(triton.cdiv(M, block_m),)](
        logits, targets, losses, grad.view(torch.uint8), grad_t.view(torch.uint8), M, N, inv_scale, CAP=SOFTCAP,
        CAP_DIVISOR=SOFTCAP_DIVISOR, BLOCK_M=block_m, BLOCK_N=block_n, HARDWARE=hardware, num_warps=warps, **stages,
    )
    return losses, grad, grad_t


# ---- FP8 operand transpose ----
# Replaces t.T.contiguous() on the head's e4m3 x (49,152 x 768) and w (50,304 x 768), which the backward's
# _scaled_mm calls take column-major: ATen copies a transposed 1-byte tensor element by element, 243-256 µs per
# call on an H200 (two calls per micro-step, 4.0 ms per step in a trace; bench/NOTES.md, 2026-12-02, commit 7e9fd34).
# A tile is read row-major and written transposed, both in whole rows of bytes. It only moves bytes, so it is
# the eager copy bit for bit (tests/test_train_gpt_triton.py under the interpreter, tests/test_train_gpt_cuda.py).
# rows, columns, warps: the fastest of bench/bench_fp8_head.py's tiles on an H200, 0.063 / 0.051 ms for x / w against
# 0.256 / 0.267 for the eager copy (bench/NOTES.md, 2026-12-02, commit 7e9fd34)
FP8_TRANSPOSE_TILE = (64, 128, 4)

if triton is not None:

    @triton.jit
    def _transpose_bytes_kernel(src_ptr, dst_ptr, rows, cols, col_blocks, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr):
        """dst (cols, rows) = src (rows, cols).T, both contiguous uint8; one BLOCK_R x BLOCK_C tile per program."""
        block = tl.program_id(0)
        r = (block // col_blocks) * BLOCK_R + tl.arange(0, BLOCK_R)
        c = (block % col_blocks) * BLOCK_C + tl.arange(0, BLOCK_C)
        inside = (r[:, None] < rows) & (c[None, :] < cols)
        tile = tl.load(src_ptr + r[:, None].to(tl.int64) * cols + c[None, :], mask=inside)
        tl.store(dst_ptr + c[:, None].to(tl.int64) * rows + r[None, :], tl.trans(tile), mask=tl.trans(inside))


def transpose_fp8(t: Tensor, tile: tuple[int, int, int] = FP8_TRANSPOSE_TILE) -> Tensor:
    """t.T.contiguous() of a contiguous 2-D tensor of 1-byte elements (the FP8 dtypes): the Triton kernel on CUDA
    and under TRITON_INTERPRET, the eager copy elsewhere."""
    if not triton_runs(t, capability=FP8_CAPABILITY):
        return t.T.contiguous()
    if t.dim() != 2 or t.element_size() != 1 or not t.is_contiguous():
        raise ValueError(f"transpose_fp8: needs a contiguous 2-D tensor of 1-byte elements, got {tuple(t.shape)} {t.dtype} (contiguous: {t.is_contiguous()})")
    rows, cols = t.shape
    out = t.new_empty((cols, rows))
    block_r, block_c, warps = tile
    col_blocks = triton.cdiv(cols, block_c)
    if out.numel():
        _transpose_bytes_kernel[(triton.cdiv(rows, block_r) * col_blocks,)](
            t.view(torch.uint8), out.view(torch.uint8), rows, cols, col_blocks, BLOCK_R=block_r, BLOCK_C=block_c, num_warps=warps,
        )
    return out


@torch.library.custom_op("train_gpt::fp8_head_loss", mutates_args=())
def fp8_head_loss(
    x: Tensor, w: Tensor, targets: Tensor, x_s: float, w_s: float, grad_s: float
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """Summed soft-capped CE of the e4m3 logits (x/x_s)(w/w_s)^T (fast accumulation, bf16 out); also returns
    the FP8 copies of x and w and the e5m2 logit gradient in both layouts, all saved for the backward."""
    # eager quantization, as in the record: inductor's fusion of it rounds differently, and the fastest bitwise
    # replacement measured so far was slower (bench/NOTES.md, 2026-12-01, commit a440791)
    x_f8 = x.div(x_s).to(torch.float8_e4m3fn)
    w_f8 = w.div(w_s).to(torch.float8_e4m3fn)
    logits = torch._scaled_mm(x_f8, w_f8.T, scale_a=_scale(x_s, x), scale_b=_scale(w_s, x), out_dtype=torch.bfloat16, use_fast_accum=True)
    losses, grad_f8, grad_f8_t = softcap_ce_e5m2(logits, targets, grad_s)
    return losses.sum(), x_f8, w_f8, grad_f8, grad_f8_t


@fp8_head_loss.register_fake
def _(x: Tensor, w: Tensor, targets: Tensor, x_s: float, w_s: float, grad_s: float) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    M, V = x.size(0), w.size(0)
    return (
        x.new_empty((), dtype=torch.float32),
        torch.empty_like(x, dtype=torch.float8_e4m3fn),
        torch.empty_like(w, dtype=torch.float8_e4m3fn),
        x.new_empty((M, V), dtype=torch.float8_e5m2),
        x.new_empty((V, M), dtype=torch.float8_e5m2),
    )


@torch.library.custom_op("train_gpt::fp8_head_backward", mutates_args=())
def fp8_head_backward(
    grad_loss: Tensor, grad_f8: Tensor, grad_f8_t: Tensor, x_f8: Tensor, w_f8: Tensor, x_s: float, w_s: float, grad_s: float
) -> tuple[Tensor, Tensor]:
    """grad_x = g (w/w_s) in bf16, grad_w = g^T (x/x_s) in fp32, g = grad_loss * grad_s * (e5m2 gradient), no fast
    accumulation. grad_loss rides in _scaled_mm's scale (one fp32 multiply: exact for loss.backward()'s 1)."""
    grad_scale = grad_loss.float() * grad_s
    column_major = lambda t: transpose_fp8(t).T  # _scaled_mm wants its second operand column-major
    grad_x = torch._scaled_mm(grad_f8, column_major(w_f8), scale_a=grad_scale, scale_b=_scale(w_s, x_f8), out_dtype=torch.bfloat16, use_fast_accum=False)
    # g^T (x/x_s) directly in the weight's (V, D) layout, so that the gradient comes out contiguous for the
    # optimizer's reduce-scatter. In fp32, cast by autograd: for out_dtype=bf16 cuBLAS picks a slower kernel
    # (bench/bench_fp8_head.py; bench/NOTES.md, 2026-12-02, commit 7e9fd34)
    grad_w = torch._scaled_mm(grad_f8_t, column_major(x_f8), scale_a=grad_scale, scale_b=_scale(x_s, x_f8), out_dtype=torch.float32, use_fast_accum=False)
    return grad_x, grad_w


@fp8_head_backward.register_fake
def _(grad_loss: Tensor, grad_f8: Tensor, grad_f8_t: Tensor, x_f8: Tensor, w_f8: Tensor, x_s: float, w_s: float, grad_s: float) -> tuple[Tensor, Tensor]:
    return x_f8.new_empty(x_f8.shape, dtype=torch.bfloat16), w_f8.new_empty(w_f8.shape, dtype=torch.float32)


def _fp8_head_loss_setup_context(ctx: Any, inputs: tuple, output: tuple) -> None:
    _, _, _, x_s, w_s, grad_s = inputs
    _, x_f8, w_f8, grad_f8, grad_f8_t = output
    ctx.save_for_backward(grad_f8, grad_f8_t, x_f8, w_f8)  # FP8 copies only: no bf16 logits survive the forward
    ctx.scales = (x_s, w_s, grad_s)


def _fp8_head_loss_backward(ctx: Any, grad_loss: Tensor, *_unused: Any) -> tuple:
    grad_x, grad_w = fp8_head_backward(grad_loss, *ctx.saved_tensors, *ctx.scales)
    return grad_x, grad_w, None, None, None, None  # autograd casts grad_w to the bf16 weight dtype


fp8_head_loss.register_autograd(_fp8_head_loss_backward, setup_context=_fp8_head_loss_setup_context)


# ---- FlexAttention block tables without a sort ----
# block_tables_eager computes, without a sort, the tables that sorting would give: for the kv tables each row's
# selected columns from the highest down, as a stable argsort(where(selected, column, -1), descending) lists them,
# for the q tables what BlockMask.from_kv_blocks derives (its stable argsort of the transposed matrix);
# tests/test_train_gpt_attention.py checks them against those sorts.
def block_tables_eager(partial: Tensor, full: Tensor) -> tuple[Tensor, Tensor]:
    """The four block tables of a window from its two square boolean (n, n) block matrices: counts (4, n) and indices
    (4, n, n), int32, in the order partial kv, full kv, partial q, full q. A kv table lists each query block's
    key blocks from the highest down, a q table (from the transposed matrix) each key block's query blocks
    ascending; the blocks not selected follow, ascending. Without a sort: each column's place is a count of the
    selected columns up to it, and the columns are scattered there."""
    counts, indices = [], []
    for selected, descending in ((partial, True), (full, True), (partial.T, False), (full.T, False)):
        chosen = selected.to(torch.int32)
        count = chosen.sum(dim=-1, keepdim=True, dtype=torch.int32)
        chosen_up_to = chosen.cumsum(dim=-1, dtype=torch.int32)  # selected columns <= this one
        cols = torch.arange(selected.size(-1), dtype=torch.int32, device=selected.device).expand_as(chosen)
        place_if_chosen = count - chosen_up_to if descending else chosen_up_to - 1
        place = torch.where(selected, place_if_chosen, count + cols - chosen_up_to)  # the others after them, ascending
        counts.append(count[:, 0])
        indices.append(torch.empty_like(cols).scatter_(-1, place.long(), cols))
    return torch.stack(counts), torch.stack(indices)


if triton is not None:

    @triton.jit
    def _block_tables_kernel(matrices_ptr, counts_ptr, indices_ptr, n_blocks, BLOCK: tl.constexpr):
        # block_tables_eager for one row of one table: tables 0/1 the rows of matrices 0/1 (partial, full), tables
        # 2/3 their columns
        row = tl.program_id(0)
        table = tl.program_id(1)
        cols = tl.arange(0, BLOCK)
        inside = cols < n_blocks
        offsets = (table % 2) * n_blocks * n_blocks + tl.where(table < 2, row * n_blocks + cols, cols * n_blocks + row)
        chosen = (tl.load(matrices_ptr + offsets, mask=inside, other=0) != 0).to(tl.int32)
        chosen_up_to = tl.cumsum(chosen, axis=0)
        count = tl.sum(chosen, axis=0)
        place_if_chosen = tl.where(table < 2, count - chosen_up_to, chosen_up_to - 1)
        place = tl.where(chosen != 0, place_if_chosen, count + cols - chosen_up_to)
        out_row = (table * n_blocks + row).to(tl.int64)
        tl.store(indices_ptr + out_row * n_blocks + place, cols, mask=inside)
        tl.store(counts_ptr + out_row, count)


def block_tables(partial: Tensor, full: Tensor) -> tuple[Tensor, Tensor]:
    """block_tables_eager for square matrices: one Triton launch for the four tables on CUDA and under
    TRITON_INTERPRET, the eager formula otherwise."""
    if partial.shape != full.shape or partial.dim() != 2 or partial.size(0) != partial.size(1):
        raise ValueError(f"block_tables: needs two square block matrices of one shape; got {tuple(partial.shape)} and {tuple(full.shape)}")
    if 2 * partial.size(0) ** 2 >= 2**31:
        raise ValueError(f"block_tables: {partial.size(0)} blocks per sequence overflow the kernel's 32-bit offsets; use fewer tokens per sequence or larger blocks")
    if not triton_runs(partial):
        return block_tables_eager(partial, full)
    n = partial.size(0)
    counts = partial.new_empty((4, n), dtype=torch.int32)
    indices = partial.new_empty((4, n, n), dtype=torch.int32)
    if n:
        matrices = torch.stack([partial, full]).to(torch.uint8)
        _block_tables_kernel[(n, 4)](matrices, counts, indices, n, BLOCK=triton.next_power_of_2(n), num_warps=4)
    return counts, indices


# an opaque op: inductor's own code for block_tables_eager does not compile for CUDA (torch 2.11: an InductorError in
# its Triton code generation; bench/NOTES.md, 2026-12-04, commit dff932c)
@torch.library.custom_op("train_gpt::block_tables", mutates_args=())
def block_tables_op(partial: Tensor, full: Tensor) -> tuple[Tensor, Tensor]:
    return block_tables(partial, full)


@block_tables_op.register_fake
def _(partial: Tensor, full: Tensor) -> tuple[Tensor, Tensor]:
    n = partial.size(0)
    return partial.new_empty((4, n), dtype=torch.int32), partial.new_empty((4, n, n), dtype=torch.int32)


# ---- MLP: ReLU² in the epilogues of its first matmul and of the backward's grad_h matmul ----
# The MLP is out = relu(pre)^2 @ W_proj^T with pre = x @ W_fc. Unfused, the forward runs cuBLAS's x @ W_fc and then
# a memory-bound kernel that reads pre back to write h = relu(pre)^2; the backward runs grad_h = grad_out @ W_proj
# (cuBLAS) and then a memory-bound kernel for the eager formula
#     grad_pre = threshold_backward(grad_h * (2 * relu(pre)), relu(pre), 0)
# which reads grad_h back (per record micro-step 49,152 x 3,072 bf16, 302 MB a tensor, 88 calls of each per step).
# One persistent Triton matmul serves both, its epilogue chosen at compile time: FORWARD writes pre and h, so pre
# is not read back; the backward reads pre and writes grad_pre, so grad_h never reaches memory. Its product is
# cuBLAS's bit for bit on the record's shapes (bf16, K = 768: bench/bench_relu2_matmul.py,
# tests/test_train_gpt_cuda.py) and each epilogue rounds where the unfused kernels round, so training's numbers stay
# the same. One H100, paired (bench/NOTES.md, 2026-12-06): forward 0.460 against 0.564 ms per call for cuBLAS + the
# compiled formula, backward 0.515 against 0.679.
def relu2_forward_eager(x: Tensor, w: Tensor) -> tuple[Tensor, Tensor]:
    """pre = x @ w and h = relu(pre)^2, as the unfused MLP computes them. The CPU path and the kernel's reference."""
    pre = x @ w
    return pre, F.relu(pre).square()


def relu2_backward_eager(grad_out: Tensor, w: Tensor, pre: Tensor) -> Tensor:
    """Autograd's gradient with respect to pre of F.linear(F.relu(pre).square(), w.T), given its output's gradient:
    grad_h = grad_out @ w, square's grad_h * 2 r, then relu's threshold (0 where r = relu(pre) <= 0). The CPU path
    and the kernel's reference."""
    r = F.relu(pre)
    return torch.ops.aten.threshold_backward((grad_out @ w) * (2 * r), r, 0)


if triton is not None:

    @triton.jit
    def _relu2_matmul_kernel(
        a_desc, w_desc, pre_ptr, out_ptr, M, N,
        TILES_PER_PROGRAM: tl.constexpr, K_STEPS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
        BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr, NUM_PROGRAMS: tl.constexpr, FORWARD: tl.constexpr,
    ):
        # p = a @ w rounded to the output dtype, as cuBLAS rounds its output; a (M, K), w (K, N), pre and out (M, N),
        # all row-major. FORWARD: pre = p and out = relu(p)^2; else out = threshold_backward(p * 2 relu(pre), relu(pre), 0)
        # with pre read. The operands come through TMA descriptors, which zero-fill reads past the edges; pre and
        # out through pointers, masked at the edges: their TMA staging tiles left no room for 128 x 256 tiles
        # with more than 2 stages, and those take 0.89-0.91 of the time of 128 x 128 tiles with a TMA epilogue
        # (bench/NOTES.md, 2026-12-06). Persistent: NUM_PROGRAMS programs walk the tiles GROUP_M row tiles at a
        # time, so that neighbours share a's rows in L2. Every program runs the same trip count (compile-time, as
        # the interpreter needs); one past the end redoes the last tile and stores the same values.
        tiles_m, tiles_n = tl.cdiv(M, BLOCK_M), tl.cdiv(N, BLOCK_N)
        for i in tl.range(0, TILES_PER_PROGRAM, flatten=True):
            tile = tl.minimum(tl.program_id(0) + i * NUM_PROGRAMS, tiles_m * tiles_n - 1)
            group_first_m = (tile // (GROUP_M * tiles_n)) * GROUP_M
            group_rows = tl.minimum(tiles_m - group_first_m, GROUP_M)
            m = (group_first_m + tile % group_rows) * BLOCK_M
            n = (tile % (GROUP_M * tiles_n)) // group_rows * BLOCK_N
            acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
            for kk in range(K_STEPS):
                acc = tl.dot(a_desc.load([m, kk * BLOCK_K]), w_desc.load([kk * BLOCK_K, n]), acc)
            product = acc.to(out_ptr.dtype.element_ty)
            rows, cols = m + tl.arange(0, BLOCK_M), n + tl.arange(0, BLOCK_N)
            offsets = rows[:, None].to(tl.int64) * N + cols[None, :]
            inside = (rows[:, None] < M) & (cols[None, :] < N)
            if FORWARD:
                tl.store(pre_ptr + offsets, product, mask=inside)
                r = product.to(tl.float32)
            else:
                r = tl.load(pre_ptr + offsets, mask=inside).to(tl.float32)
            r = tl.where(r < 0, 0.0, r)  # relu that keeps NaN, as torch's does
            if FORWARD:
                out = r * r  # square's one rounding is the store's
            else:
                grad = product.to(tl.float32) * (2.0 * r)  # exact in fp32 (two 8-bit significands): the one rounding is the store's
                out = tl.where(r <= 0, 0.0, grad)
            tl.store(out_ptr + offsets, out.to(out_ptr.dtype.element_ty), mask=inside)


# (BLOCK_M, BLOCK_N, BLOCK_K, pipeline stages, warps): on one H100 the best of bench/bench_relu2_matmul.py's tiles for
# the forward epilogue; for the backward within the noise of 3 stages (0.499 against 0.480 ms per call in one run,
# 0.515 against 0.522 in another: bench/NOTES.md, 2026-12-06)
RELU2_MATMUL_TILE = (128, 256, 64, 4, 8)


def _relu2_kernel_takes(a: Tensor, w: Tensor, *others: Tensor) -> bool:
    """Whether the Triton kernel can run on these operands: triton_runs says so (bf16/fp16 on Hopper or Blackwell
    data-centre GPUs, whose TMA and about 228 KB of shared memory per SM it needs; fp32 would run its dot in TF32 and
    overflow shared memory; the interpreter takes any dtype, and the tests use fp16 and fp32, where its dot is exact),
    every size is non-zero, and a TMA descriptor can take a and w (rows and base addresses on 16 bytes)."""
    if not triton_runs(a, cuda_dtypes=(torch.bfloat16, torch.float16), majors=(9, 10)) or min(*a.shape, w.size(1)) == 0:
        return False
    return not any((t.size(1) * t.element_size()) % 16 or t.data_ptr() % 16 for t in (a, w, *others))


def _relu2_matmul(a: Tensor, w: Tensor, pre: Tensor, out: Tensor, forward: bool, tile: tuple[int, ...], programs: int | None) -> None:
    """Runs _relu2_matmul_kernel on contiguous operands. programs: persistent programs (default: one per SM; 4 interpreted)."""
    M, K = a.shape
    N = w.size(1)
    block_m, block_n, block_k, stages, warps = tile
    if programs is None:
        programs = 4 if _interpreting_triton() else torch.cuda.get_device_properties(a.device).multi_processor_count
    tiles = triton.cdiv(M, block_m) * triton.cdiv(N, block_n)
    programs = min(programs, tiles)
    _relu2_matmul_kernel[(programs,)](
        TensorDescriptor.from_tensor(a, [block_m, block_k]), TensorDescriptor.from_tensor(w, [block_k, block_n]),
        pre, out, M, N, TILES_PER_PROGRAM=triton.cdiv(tiles, programs), K_STEPS=triton.cdiv(K, block_k), BLOCK_M=block_m,
        BLOCK_N=block_n, BLOCK_K=block_k, GROUP_M=8, NUM_PROGRAMS=programs, FORWARD=forward, num_stages=stages, num_warps=warps,
    )


def relu2_forward_operands(x: Tensor, w: Tensor, caller: str) -> tuple[Tensor, Tensor]:
    """x and w contiguous (no-ops in training), or a ValueError naming caller unless they are 2-D x (M, K) and w (K, N)
    of one dtype."""
    shapes = f"{tuple(x.shape)} {x.dtype}, {tuple(w.shape)} {w.dtype}"
    if not x.dim() == w.dim() == 2:
        raise ValueError(f"{caller}: needs 2-D x (M, K) and w (K, N), got {shapes}: flatten the leading dimensions")
    if x.size(1) != w.size(0) or x.dtype != w.dtype:
        raise ValueError(f"{caller}: needs x (M, K) and w (K, N) of one dtype, got {shapes}")
    return x.contiguous(), w.contiguous()


def relu2_backward_operands(grad_out: Tensor, w: Tensor, pre: Tensor, caller: str) -> tuple[Tensor, Tensor, Tensor]:
    """grad_out, w and pre contiguous (no-ops in training), or a ValueError naming caller unless they are 2-D
    grad_out (M, K), w (K, N) and pre (M, N) of one dtype."""
    shapes = f"{tuple(grad_out.shape)} {grad_out.dtype}, {tuple(w.shape)} {w.dtype}, {tuple(pre.shape)} {pre.dtype}"
    if not grad_out.dim() == w.dim() == pre.dim() == 2:
        raise ValueError(f"{caller}: needs 2-D grad_out (M, K), w (K, N), pre (M, N); got {shapes}: flatten the leading dimensions")
    M, K = grad_out.shape
    N = w.size(1)
    if w.shape != (K, N) or pre.shape != (M, N) or not (grad_out.dtype == w.dtype == pre.dtype):
        raise ValueError(f"{caller}: needs grad_out (M, K), w (K, N), pre (M, N) of one dtype, got {shapes}")
    return grad_out.contiguous(), w.contiguous(), pre.contiguous()


def relu2_forward_matmul(x: Tensor, w: Tensor, tile: tuple[int, ...] = RELU2_MATMUL_TILE, programs: int | None = None) -> tuple[Tensor, Tensor]:
    """relu2_forward_eager(x, w) for 2-D x (M, K) and w (K, N) of one dtype: the Triton kernel where
    _relu2_kernel_takes says so, the eager formula elsewhere. tile and programs: see _relu2_matmul."""
    x, w = relu2_forward_operands(x, w, "relu2_forward_matmul")
    if not _relu2_kernel_takes(x, w):
        return relu2_forward_eager(x, w)
    pre = x.new_empty((x.size(0), w.size(1)))
    h = torch.empty_like(pre)
    _relu2_matmul(x, w, pre, h, True, tile, programs)
    return pre, h


def relu2_backward_matmul(grad_out: Tensor, w: Tensor, pre: Tensor, tile: tuple[int, ...] = RELU2_MATMUL_TILE, programs: int | None = None) -> Tensor:
    """relu2_backward_eager(grad_out, w, pre) for 2-D grad_out (M, K), w (K, N), pre (M, N) of one dtype: the Triton
    kernel where _relu2_kernel_takes says so, the eager formula elsewhere. tile and programs: see _relu2_matmul."""
    grad_out, w, pre = relu2_backward_operands(grad_out, w, pre, "relu2_backward_matmul")
    if not _relu2_kernel_takes(grad_out, w, pre):
        return relu2_backward_eager(grad_out, w, pre)
    out = torch.empty_like(pre)
    _relu2_matmul(grad_out, w, pre, out, False, tile, programs)
    return out


# ---- the same two epilogues on quack-kernels' GEMMs (--mlp_kernel=quack) ----
# Triton 3.6 runs the epilogue above after a tile's last product, while the tensor cores wait; quack-kernels' SM90
# GEMMs run the epilogue in warps of its own, so one tile's stores overlap the next tile's products. The two
# epilogue functions below are written for its epilogue frontend (quack.epilogue.frontend: a Python function of one
# fp32 accumulator element, traced into the kernel) and round where the Triton kernel rounds: the same bytes. One
# H100, record shapes (bench/bench_relu2_matmul.py, bench/NOTES.md 2026-12-07): forward 0.371 against the Triton
# kernel's 0.459 ms per call, backward 0.424 against 0.494; in training 0.9795 of the Triton kernel's ms/step.
@functools.cache
def _quack_relu2_epilogues() -> tuple[Any, Any]:
    """The forward and backward epilogues as quack EpiMods, built on first use (importing quack loads the CuTe DSL
    compiler, seconds). Each is called as epilogue(a, w[, pre], ...) and returns a dict of its outputs, "D" first."""
    import cutlass
    from cutlass import BFloat16, Float32
    from quack.epilogue.frontend import gemm_epilogue

    def stored(acc: Any) -> Any:  # the product as an unfused matmul stores it: rounded to bf16 (nearest even), widened
        return Float32(BFloat16(acc))

    def relu(value: Any) -> Any:  # keeps NaN, as torch's relu does (maxnum would make it 0)
        return Float32(cutlass.select_(value < Float32(0.0), Float32(0.0), value))

    @gemm_epilogue(outputs=("h",))
    def relu2_forward_epilogue(acc: Any) -> dict[str, Any]:
        pre = stored(acc)
        r = relu(pre)
        return {"D": pre, "h": r * r}  # square's one rounding is the store's

    @gemm_epilogue()
    def relu2_backward_epilogue(acc: Any, c: Any) -> dict[str, Any]:  # c: pre, loaded by the epilogue
        r = relu(c)
        grad = stored(acc) * (Float32(2.0) * r)  # exact in fp32: the one rounding is the store's
        return {"D": Float32(cutlass.select_(r <= Float32(0.0), Float32(0.0), grad))}

    return relu2_forward_epilogue, relu2_backward_epilogue


def _quack_takes(*tensors: Tensor) -> bool:
    """Whether the quack epilogues can take these operands: CUDA bf16 (they round the product to bf16, training's
    dtype), non-empty, rows and base addresses on 16 bytes (its TMA's)."""
    return all(
        t.is_cuda and t.dtype == torch.bfloat16 and t.numel() > 0 and (t.size(1) * t.element_size()) % 16 == 0 and t.data_ptr() % 16 == 0
        for t in tensors
    )


def quack_relu2_forward_matmul(x: Tensor, w: Tensor) -> tuple[Tensor, Tensor]:
    """relu2_forward_eager(x, w) on quack's GEMM where _quack_takes says so, the eager formula elsewhere."""
    x, w = relu2_forward_operands(x, w, "quack_relu2_forward_matmul")
    if not _quack_takes(x, w):
        return relu2_forward_eager(x, w)
    forward, _ = _quack_relu2_epilogues()
    h = x.new_empty((x.size(0), w.size(1)))
    outputs = forward(x, w, out={"h": h}, out_dtype=x.dtype, tuned=False)  # untuned: quack's fixed default tile
    return outputs["D"], outputs["h"]


def quack_relu2_backward_matmul(grad_out: Tensor, w: Tensor, pre: Tensor) -> Tensor:
    """relu2_backward_eager(grad_out, w, pre) on quack's GEMM where _quack_takes says so, the eager formula elsewhere."""
    grad_out, w, pre = relu2_backward_operands(grad_out, w, pre, "quack_relu2_backward_matmul")
    if not _quack_takes(grad_out, w, pre):
        return relu2_backward_eager(grad_out, w, pre)
    _, backward = _quack_relu2_epilogues()
    return backward(grad_out, w, pre, out_dtype=grad_out.dtype, tuned=False)["D"]


RELU2_MATMULS: dict[str, tuple[Callable[..., tuple[Tensor, Tensor]], Callable[..., Tensor]]] = {
    "triton": (relu2_forward_matmul, relu2_backward_matmul),
    "quack": (quack_relu2_forward_matmul, quack_relu2_backward_matmul),
}


@torch.library.custom_op("train_gpt::relu2_forward_matmul", mutates_args=())
def relu2_forward_matmul_op(x: Tensor, w: Tensor, kernel: str) -> tuple[Tensor, Tensor]:
    """The forward of RELU2_MATMULS[kernel] as one opaque op, so that inductor calls the kernel from the compiled forward."""
    return RELU2_MATMULS[kernel][0](x, w)


@relu2_forward_matmul_op.register_fake
def _(x: Tensor, w: Tensor, kernel: str) -> tuple[Tensor, Tensor]:
    shape = (x.size(0), w.size(1))
    return x.new_empty(shape), x.new_empty(shape)


@torch.library.custom_op("train_gpt::relu2_backward_matmul", mutates_args=())
def relu2_backward_matmul_op(grad_out: Tensor, w: Tensor, pre: Tensor, kernel: str) -> Tensor:
    """The backward of RELU2_MATMULS[kernel] as one opaque op, so that inductor calls the kernel from the compiled backward."""
    return RELU2_MATMULS[kernel][1](grad_out, w, pre)


@relu2_backward_matmul_op.register_fake
def _(grad_out: Tensor, w: Tensor, pre: Tensor, kernel: str) -> Tensor:
    return torch.empty_like(pre, memory_format=torch.contiguous_format)


class ReLUSquaredMLP(torch.autograd.Function):
    """F.linear(F.relu(x @ w_fc).square(), w_proj) for x (..., D), w_fc (D, N) and w_proj (D, N), with autograd's
    gradients, on RELU2_MATMULS[kernel]: pre and h from its forward, grad_pre from its backward, and the gradients of x and
    both weights as autograd's matmul and linear compute them (the same mm calls). Saves x, pre and h, which autograd
    saves for the unfused MLP too (as relu(pre) in place of pre: the same bytes)."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, w_fc: Tensor, w_proj: Tensor, kernel: str) -> Tensor:
        rows = x.reshape(-1, x.size(-1))
        pre, h = relu2_forward_matmul_op(rows, w_fc, kernel)
        ctx.save_for_backward(rows, pre, h, w_fc, w_proj)
        ctx.input_shape, ctx.kernel = x.shape, kernel
        return F.linear(h, w_proj).view(*x.shape[:-1], w_proj.size(0))

    @staticmethod
    def backward(ctx: Any, grad_out: Tensor) -> tuple[Tensor | None, Tensor | None, Tensor | None, None]:
        rows, pre, h, w_fc, w_proj = ctx.saved_tensors
        grad_rows = grad_out.reshape(-1, grad_out.size(-1))
        grad_x = grad_w_fc = grad_w_proj = None
        if ctx.needs_input_grad[0] or ctx.needs_input_grad[1]:
            grad_pre = relu2_backward_matmul_op(grad_rows, w_proj, pre, ctx.kernel)
            if ctx.needs_input_grad[0]:
                grad_x = grad_pre.mm(w_fc.t()).view(ctx.input_shape)
            if ctx.needs_input_grad[1]:
                grad_w_fc = rows.t().mm(grad_pre)
        if ctx.needs_input_grad[2]:
            grad_w_proj = grad_rows.t().mm(h)
        return grad_x, grad_w_fc, grad_w_proj, None


# ---- gradients into fixed buffers: the tables' (summed over sorted ids) and the matrices' ----
# Both families add a micro-step's gradient into the parameter's fixed gradient buffer (GPT.grads_into_buffers) in
# their backward and give autograd no gradient for the parameter, so no AccumulateGrad runs; both add through the one
# helper _add_into_grad_elements.
if triton is not None:

    @triton.jit
    def _add_into_grad_elements(grad_ptr, offsets, mask, summed, ROUND_TO_BF16: tl.constexpr):
        # grad += summed (fp32) as the eager formulas round it: for a bf16 grad summed.bfloat16(), then bf16 + bf16
        # computed in fp32 and rounded; for an fp32 grad one fp32 add
        old = tl.load(grad_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
        if ROUND_TO_BF16:
            new = _round_to_bf16(old + _round_to_bf16(summed))
        else:
            new = old + summed
        tl.store(grad_ptr + offsets, new.to(grad_ptr.dtype.element_ty), mask=mask)


# The tables. Autograd's gradient of a bf16 table as inductor compiles it, written as an eager formula:
#     summed = zeros(rows, dim, fp32).index_add_(0, ids, grad_out.float()); table.grad += summed.bfloat16()
# (a zeroed fp32 table, an atomic scatter-add, a rounding pass, AccumulateGrad's add from the second micro-step on)
# moves each whole 50,304-row table about four times per micro-step, although a micro-step's 49,152 tokens name
# about 6,300 of its rows: 8.5 ms of kernels per step at one GPU for the four tables (bench/NOTES.md, 2026-12-03, commit ae6041e).
# accumulate_table_grads sorts the ids once for the four tables (stably, so a row's terms keep the ids' order) and
# reads each lookup gradient once. A program walks a chunk of sorted positions and sums its runs of equal ids; a run
# inside the chunk is added into its row of the gradient at once; the parts of a run that crosses chunk edges are
# summed in a small buffer (fp32 atomics: autograd's scatter sums every term so) and a second kernel adds each such
# sum into its row. Each row of the gradient is written by one program. The roundings are the formula's: fp32 sums,
# one rounding to bf16, the add in fp32 rounded to bf16. The lookups' gradient reaches the op as a bf16 tensor, as in
# eager autograd; where inductor fused its producer into the scatter it summed the unrounded fp32 values instead
# (found on CPU; bench/NOTES.md, 2026-12-04, commit b67afb9), a difference of one bf16 rounding per term.
TABLE_GRAD_TILE = (32, 256, 1)  # (sorted positions per chunk, columns per program, warps): bench/bench_embedding_grad.py

if triton is not None:

    @triton.jit
    def _table_grad_runs_kernel(
        sorted_ids_ptr, order_ptr, chunk_run_starts_ptr, grad_out_ptr, grad_ptr, parts_ptr, n_ids, n_rows,
        DIM: tl.constexpr, CHUNK: tl.constexpr, BLOCK_D: tl.constexpr, ROUND_TO_BF16: tl.constexpr,
    ):
        # Chunk c of the sorted positions, one tile of columns, walked position by position (a row's terms summed in
        # sorted order). A run that begins and ends in the chunk goes into grad. A run that crosses the chunk's
        # edges is summed in parts[b], b the chunk where it begins: each chunk it touches adds its part with an
        # atomic (a part per chunk, so a frequent id's dozens of chunks never wait on each other). A segmented scan
        # over the chunk as one tile ran 2-2.5 times slower on an H200 (its shared-memory passes), and summing the
        # crossing parts by walking from the first chunk took 27-42 µs per call (bench/NOTES.md, 2026-12-04, commit b67afb9).
        chunk = tl.program_id(0)
        cols = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
        col_ok = cols < DIM
        first = chunk * CHUNK
        stop = tl.minimum(first + CHUNK, n_ids)
        row = tl.load(sorted_ids_ptr + first)
        begun_here = tl.load(sorted_ids_ptr + first - 1, mask=first > 0, other=-1) != row
        begin = tl.load(chunk_run_starts_ptr + chunk) // CHUNK  # the chunk where the chunk's first run begins
        total = tl.zeros((BLOCK_D,), tl.float32)
        # two rows in flight: this position's and the next one's, and the source of the one after
        terms = tl.load(grad_out_ptr + tl.load(order_ptr + first).to(tl.int64) * DIM + cols, mask=col_ok, other=0.0)
        source = tl.load(order_ptr + first + 1, mask=first + 1 < stop, other=0).to(tl.int64)
        next_terms = tl.load(grad_out_ptr + source * DIM + cols, mask=col_ok & (first + 1 < stop), other=0.0)
        source = tl.load(order_ptr + first + 2, mask=first + 2 < stop, other=0).to(tl.int64)
        for step in range(CHUNK):  # a fixed trip count: the interpreter takes no tensor bounds
            position = first + step
            if position < stop:
                third_terms = tl.load(grad_out_ptr + source * DIM + cols, mask=col_ok & (position + 2 < stop), other=0.0)
                source = tl.load(order_ptr + position + 3, mask=position + 3 < stop, other=0).to(tl.int64)
                next_row = tl.load(sorted_ids_ptr + position + 1, mask=position + 1 < n_ids, other=-1)
                total += terms.to(tl.float32)
                if next_row != row:  # the run ends here
                    if begun_here:
                        if (row >= 0) & (row < n_rows):
                            _add_into_grad_elements(grad_ptr, row.to(tl.int64) * DIM + cols, col_ok, total, ROUND_TO_BF16)
                    else:  # the last part of a run that began in chunk `begin`
                        tl.atomic_add(parts_ptr + begin * DIM + cols, total, mask=col_ok, sem="relaxed")
                    total = tl.zeros((BLOCK_D,), tl.float32)
                    begun_here = True
                row = next_row
                terms = next_terms
                next_terms = third_terms
        if tl.load(sorted_ids_ptr + stop, mask=stop < n_ids, other=-1) == tl.load(sorted_ids_ptr + stop - 1):  # goes on
            owner = tl.where(begun_here, chunk, begin)  # not begun here: the run spans the chunk
            tl.atomic_add(parts_ptr + owner * DIM + cols, total, mask=col_ok, sem="relaxed")

    @triton.jit
    def _table_grad_crossing_kernel(
        sorted_ids_ptr, grad_ptr, parts_ptr, n_ids, n_rows,
        DIM: tl.constexpr, CHUNK: tl.constexpr, BLOCK_D: tl.constexpr, ROUND_TO_BF16: tl.constexpr,
    ):
        # The run that goes on past chunk c's end, if it began in chunk c: its summed parts added into grad
        chunk = tl.program_id(0)
        cols = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
        col_ok = cols < DIM
        first = chunk * CHUNK
        last = tl.minimum(first + CHUNK, n_ids) - 1
        row = tl.load(sorted_ids_ptr + last)
        goes_on = tl.load(sorted_ids_ptr + last + 1, mask=last + 1 < n_ids, other=-1) == row
        began_here = tl.load(sorted_ids_ptr + first - 1, mask=first > 0, other=-1) != row
        if goes_on & began_here & (row >= 0) & (row < n_rows):
            total = tl.load(parts_ptr + chunk * DIM + cols, mask=col_ok, other=0.0)
            _add_into_grad_elements(grad_ptr, row.to(tl.int64) * DIM + cols, col_ok, total, ROUND_TO_BF16)


def accumulate_table_grads_eager(grad_outs: Sequence[Tensor], ids: Tensor, grads: Sequence[Tensor]) -> None:
    """grads[i] += the gradient of F.embedding(ids, table i) given grad_outs[i], summed in fp32 and rounded to the
    gradient's dtype once (the formula above). The CPU path and the kernels' reference."""
    for grad_out, grad in zip(grad_outs, grads, strict=True):
        summed = torch.zeros(grad.shape, dtype=torch.float32, device=grad.device)
        summed.index_add_(0, ids.reshape(-1), grad_out.reshape(-1, grad.size(1)).float())  # on CPU in the ids' order
        grad.add_(summed.to(grad.dtype))


def accumulate_table_grads(grad_outs: Sequence[Tensor], ids: Tensor, grads: Sequence[Tensor], tile: tuple[int, int, int] = TABLE_GRAD_TILE) -> None:
    """accumulate_table_grads_eager(grad_outs, ids, grads) for 2-D gradients (rows, dim) and grad_outs (*ids.shape,
    dim), ids in [0, rows): the two Triton kernels per table on CUDA and under TRITON_INTERPRET for contiguous bf16
    or fp32 gradients, the eager formula otherwise. chunk and columns of the tile: powers of two."""
    if len(grad_outs) != len(grads):
        raise ValueError(f"accumulate_table_grads: {len(grad_outs)} lookup gradients for {len(grads)} tables")
    for grad_out, grad in zip(grad_outs, grads):
        if grad.dim() != 2 or grad_out.shape != (*ids.shape, grad.size(1)):
            shapes = f"grad_out {tuple(grad_out.shape)}, ids {tuple(ids.shape)}, grad {tuple(grad.shape)}"
            raise ValueError(f"accumulate_table_grads: needs grad (rows, dim) and grad_out (*ids.shape, dim); got {shapes}")
    kernels = [triton_runs(g, dtypes=(torch.bfloat16, torch.float32)) and g.is_contiguous() for g in grads]
    if not all(kernels) or ids.numel() == 0:
        accumulate_table_grads_eager(grad_outs, ids, grads)
        return
    sorted_ids, order = torch.sort(ids.reshape(-1), stable=True)
    chunk, block_d, warps = tile
    n_ids, n_chunks = sorted_ids.numel(), triton.cdiv(sorted_ids.numel(), chunk)
    # where the run at each chunk's first position begins: a binary search per chunk (a cummax over every position
    # took 0.16 ms per micro-step on an H200, ATen's scan with indices; bench/NOTES.md, 2026-12-04, commit dff932c)
    chunk_run_starts = torch.searchsorted(sorted_ids, sorted_ids[::chunk].contiguous(), side="left")
    for grad_out, grad in zip(grad_outs, grads):
        n_rows, dim = grad.shape
        parts = torch.zeros((n_chunks, dim), dtype=torch.float32, device=grad.device)  # the crossing runs' sums
        shape = dict(DIM=dim, CHUNK=chunk, BLOCK_D=min(block_d, triton.next_power_of_2(dim)), ROUND_TO_BF16=grad.dtype == torch.bfloat16, num_warps=warps)
        grid = (n_chunks, triton.cdiv(dim, shape["BLOCK_D"]))
        _table_grad_runs_kernel[grid](sorted_ids, order, chunk_run_starts, grad_out.reshape(n_ids, dim).contiguous(), grad, parts, n_ids, n_rows, **shape)
        _table_grad_crossing_kernel[grid](sorted_ids, grad, parts, n_ids, n_rows, **shape)


@torch.library.custom_op("train_gpt::accumulate_table_grads", mutates_args=("grads",))
def accumulate_table_grads_op(grad_outs: list[Tensor], ids: Tensor, grads: list[Tensor]) -> None:
    """accumulate_table_grads as one opaque op: the compiled backward calls it and adds into grads in place."""
    accumulate_table_grads(grad_outs, ids, grads)


@accumulate_table_grads_op.register_fake
def _(grad_outs: list[Tensor], ids: Tensor, grads: list[Tensor]) -> None:
    return None


class TableLookups(torch.autograd.Function):
    """TableLookups.apply(ids, *weights, *grad_buffers) = [F.embedding(ids, w) for w in weights]; its backward adds each
    table's gradient into its buffer (accumulate_table_grads; the mechanism: GPT.grads_into_buffers)."""

    @staticmethod
    def forward(ctx: Any, ids: Tensor, *weights_and_buffers: Tensor) -> tuple[Tensor, ...]:
        count = len(weights_and_buffers) // 2
        ctx.save_for_backward(ids, *weights_and_buffers[count:])
        return tuple(F.embedding(ids, weight) for weight in weights_and_buffers[:count])

    @staticmethod
    def backward(ctx: Any, *grad_outs: Tensor) -> tuple[None, ...]:
        ids, *buffers = ctx.saved_tensors
        accumulate_table_grads_op(list(grad_outs), ids, buffers)
        return (None,) * (1 + 2 * len(buffers))


# The matrices. The attention and MLP matrices are fp32 parameters cast to bf16 at use. Autograd's gradient for such a matrix,
# as an eager formula:
#     grad_fp32 = grad_bf16.float(); matrix.grad = grad_fp32 (first micro-step) or matrix.grad += grad_fp32
# inductor writes the fp32 copy (4 bytes per element) and AccumulateGrad reads it back beside .grad: 18 bytes moved
# per element and micro-step, 2.7 ms per step at one GPU for the 32 matrices (bench/NOTES.md, 2026-12-04, commit dff932c, the
# `_to_copy` and `CUDAFunctor_add<float>` kernels). add_into_grad does .grad += grad_bf16 in one pass (10 bytes):
# the same sum, as bf16 -> fp32 is exact and the add is one fp32 rounding either way. The buffers start each step at
# 0, so the one difference from autograd's values is that an exactly zero gradient is +0 where autograd kept a -0.
ADD_INTO_GRAD_BLOCK = 2048  # elements per program

if triton is not None:

    @triton.jit
    def _add_into_grad_kernel(grad_ptr, addend_ptr, n, BLOCK: tl.constexpr):
        offsets = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        inside = offsets < n
        _add_into_grad_elements(grad_ptr, offsets, inside, tl.load(addend_ptr + offsets, mask=inside).to(tl.float32), ROUND_TO_BF16=False)


def add_into_grad(grad: Tensor, addend: Tensor) -> None:
    """grad += addend for an fp32 grad and an addend of its shape, computed in fp32 (eager: grad.add_(addend.float())).
    One Triton pass on CUDA and under TRITON_INTERPRET when both are contiguous; the eager formula otherwise."""
    if grad.dtype != torch.float32 or addend.shape != grad.shape:
        raise ValueError(f"add_into_grad: needs an fp32 grad and an addend of its shape; got grad {tuple(grad.shape)} {grad.dtype}, addend {tuple(addend.shape)} {addend.dtype}")
    if not (triton_runs(grad) and grad.is_contiguous() and addend.is_contiguous()):
        grad.add_(addend.float())
        return
    n = grad.numel()
    if n:
        _add_into_grad_kernel[(triton.cdiv(n, ADD_INTO_GRAD_BLOCK),)](grad, addend, n, BLOCK=ADD_INTO_GRAD_BLOCK, num_warps=4)


@torch.library.custom_op("train_gpt::add_into_grad", mutates_args=("grad",))
def add_into_grad_op(grad: Tensor, addend: Tensor) -> None:
    """add_into_grad as one opaque op: the compiled backward calls it and adds into grad in place."""
    add_into_grad(grad, addend)


@add_into_grad_op.register_fake
def _(grad: Tensor, addend: Tensor) -> None:
    return None


class CastIntoGrad(torch.autograd.Function):
    """CastIntoGrad.apply(matrix, buffer, dtype) = matrix.to(dtype), a copy; its backward adds the gradient into buffer
    (add_into_grad; the mechanism: GPT.grads_into_buffers)."""

    @staticmethod
    def forward(ctx: Any, matrix: Tensor, buffer: Tensor, dtype: torch.dtype) -> Tensor:
        ctx.save_for_backward(buffer)
        return matrix.to(dtype, copy=True)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[None, None, None]:
        (buffer,) = ctx.saved_tensors
        add_into_grad_op(buffer, grad)
        return None, None, None


# ---- Newton-Schulz: X X^T and bA + cA^2 in a kernel that computes only one triangle ----
if triton is not None:

    @triton.jit
    def _symmetric_matmul_kernel(
        src_ptr,
        add_ptr,
        out_ptr,
        M,
        K: tl.constexpr,
        stride_sb,
        stride_sm,
        stride_sk,
        stride_ab,
        stride_am,
        stride_an,
        stride_ob,
        stride_om,
        stride_on,
        alpha,
        beta,
        HAS_ADD: tl.constexpr,
        BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr,
        BLOCK_K: tl.constexpr,
        GROUP_M: tl.constexpr,
    ):
        """out[b] = S S^T (or alpha S S^T + beta A) for S = src[b] of shape (M, K).

        The output is symmetric, so tiles lying wholly above the diagonal exit at once; every computed
        tile is stored twice, at its place and mirrored. Grid: (tiles, batch). K is a compile-time constant
        (a fixed loop trip count; the few matrix shapes of a run each compile once).
        """
        pid = tl.program_id(0)
        batch = tl.program_id(1)
        tiles_m = tl.cdiv(M, BLOCK_M)
        tiles_n = tl.cdiv(M, BLOCK_N)
        tiles_per_band = GROUP_M * tiles_n  # bands of GROUP_M tile rows share column strips in cache
        band = pid // tiles_per_band
        first_m = band * GROUP_M
        band_rows = min(tiles_m - first_m, GROUP_M)
        pid_m = first_m + (pid % tiles_per_band) % band_rows
        pid_n = (pid % tiles_per_band) // band_rows
        row0 = pid_m * BLOCK_M
        col0 = pid_n * BLOCK_N
        if row0 + BLOCK_M <= col0:
            return
        rows = row0 + tl.arange(0, BLOCK_M)
        cols = col0 + tl.arange(0, BLOCK_N)
        ks = tl.arange(0, BLOCK_K)
        src = src_ptr + batch * stride_sb
        left = src + (rows % M)[:, None] * stride_sm + ks[None, :] * stride_sk  # indices wrap: loads stay in bounds
        right = src + (cols % M)[None, :] * stride_sm + ks[:, None] * stride_sk  # the column strip, read transposed
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            a = tl.load(left, mask=ks[None, :] < K - k0, other=0.0)
            b = tl.load(right, mask=ks[:, None] < K - k0, other=0.0)
            acc = tl.dot(a, b, acc)
            left += BLOCK_K * stride_sk
            right += BLOCK_K * stride_sk
        if HAS_ADD:
            addend = tl.load(add_ptr + batch * stride_ab + (rows % M)[:, None] * stride_am + (cols % M)[None, :] * stride_an)
            acc = alpha * acc + beta * addend.to(tl.float32)
        result = acc.to(out_ptr.dtype.element_ty)
        inside = (rows[:, None] < M) & (cols[None, :] < M)
        out = out_ptr + batch * stride_ob
        tl.store(out + rows[:, None] * stride_om + cols[None, :] * stride_on, result, mask=inside)
        tl.store(out + cols[None, :] * stride_om + rows[:, None] * stride_on, result, mask=inside)

    def _symmetric_matmul_configs() -> list:
        return [
            triton.Config({"BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": bk, "GROUP_M": 8}, num_stages=stages, num_warps=warps)
            for bm in (64, 128)
            for bn in (64, 128, 256)
            for bk in (64, 128)
            for stages, warps in ((3, 4), (3, 8), (4, 4))
            if max(bm, bn) <= 2 * min(bm, bn)
        ]

    _symmetric_matmul_autotuned = triton.autotune(configs=_symmetric_matmul_configs(), key=["M", "K", "stride_sm", "stride_sk"])(
        _symmetric_matmul_kernel
    )


def symmetric_matmul(
    src: Tensor, out: Tensor, add: Tensor | None = None, alpha: float = 1.0, beta: float = 0.0, config: dict[str, int] | None = None
) -> Tensor:
    """out = src src^T, or alpha src src^T + beta add (add symmetric, same shape as out); batched (B, M, K).

    config=None autotunes (CUDA); an explicit {BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M} runs the plain kernel
    (used by the TRITON_INTERPRET tests on CPU)."""
    batch, M, K = src.shape
    addend = add if add is not None else out
    args = (src, addend, out, M, K, *src.stride(), *addend.stride(), *out.stride(), alpha, beta)
    if config is None:
        grid = lambda meta: (triton.cdiv(M, meta["BLOCK_M"]) * triton.cdiv(M, meta["BLOCK_N"]), batch)
        _symmetric_matmul_autotuned[grid](*args, HAS_ADD=add is not None)
    else:
        grid = (triton.cdiv(M, config["BLOCK_M"]) * triton.cdiv(M, config["BLOCK_N"]), batch)
        _symmetric_matmul_kernel[grid](*args, HAS_ADD=add is not None, **config)
    return out


def newton_schulz_triton(G: Tensor, config: dict[str, int] | None = None, dtype: torch.dtype = torch.bfloat16) -> Tensor:
    """Same iteration as newton_schulz_reference; X X^T and bA + cA^2 computed by the symmetric kernel."""
    X, transposed = _ns_normalize(G, dtype)
    X = X.contiguous()
    squeeze = X.dim() == 2
    if squeeze:
        X = X[None]
    batch, M, K = X.shape
    A = X.new_empty(batch, M, M)
    B = torch.empty_like(A)
    spare = torch.empty_like(X)
    a, b, c = NS_COEFFICIENTS
    for _ in range(NS_STEPS):
        symmetric_matmul(X, A, config=config)
        symmetric_matmul(A, B, add=A, alpha=c, beta=b, config=config)  # A A^T = A^2 since A is symmetric
        torch.baddbmm(X, B, X, beta=a, alpha=1.0, out=spare)
        X, spare = spare, X
    X = X[0] if squeeze else X
    return X.mT if transposed else X


if __name__ == "__main__":
    main()
