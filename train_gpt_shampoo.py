"""Track 3 Shampoo record: GPT-2 small (fixed Track 3 architecture) on FineWeb, DistributedShampoo on the
72 block matrices and AdamW on everything else; the fewest optimizer steps to 3.28 validation loss.

    torchrun --standalone --nproc_per_node=8 train_gpt_shampoo.py      # the record (1, 2, 4 or 8 GPUs)
    python train_gpt_shampoo.py --preset=smoke                         # a tiny run on CPU, < 1 minute
    python train_gpt_shampoo.py --matrix_optimizer=adamw               # ablation: AdamW on the matrices

Recipe: record #21 of the Track 3 optimization benchmark (modded-nanogpt, @kellerjordan0, 2026-05-13), documented
constant by constant in docs/track3_recipe.md.
"""

# ------------------------------------------------------------------------------------------------
# Imports and setup helpers

import argparse
import ast
import dataclasses
import errno
import fcntl
import glob
import hashlib
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
import uuid
from collections import Counter
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO, Callable, NamedTuple, cast

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
except ImportError as missing:  # a Python without the requirements, e.g. outside the virtual environment
    if __name__ != "__main__":
        raise  # an importer (tools/doctor.py, the tests) reports it in its own way
    print(f"{Path(__file__).name}: error: cannot import {missing.name or missing} in {sys.executable}; install the "
          f"requirements (pip install -r requirements.txt, README.md#install) or run the Python that has them", file=sys.stderr)
    sys.exit(2)

# The AdamW ablation must run without the package, hence the guard; the log embeds the package modules this
# script imports (shampoo_source_files).
try:
    import distributed_shampoo
    from distributed_shampoo import (
        AdamPreconditionerConfig,
        DDPDistributedConfig,
        DistributedShampoo,
        RootInvShampooPreconditionerConfig,
        SingleDeviceDistributedConfig,
        WeightDecayType,
    )
    from distributed_shampoo.shampoo_types import PreconditionerValueError, ShampooRuntimeConfig

    SHAMPOO_PACKAGE_DIR: Path | None = Path(distributed_shampoo.__file__).resolve().parent
    SHAMPOO_IMPORT_ERROR: ImportError | None = None
    NON_FINITE_PRECONDITIONER_ERRORS: tuple[type[Exception], ...] = (PreconditionerValueError,)
except ImportError as error:  # reported when --matrix_optimizer=shampoo is asked for
    SHAMPOO_PACKAGE_DIR = None
    SHAMPOO_IMPORT_ERROR = error
    NON_FINITE_PRECONDITIONER_ERRORS = ()  # no Shampoo, nothing to catch

class UserError(Exception):
    """A problem with the command line, the environment, the data or a checkpoint: one line, exit status 2."""


class RunStopped(Exception):
    """Training stopped early (non-finite loss, interrupt): the message is the whole report, one line.

    every_rank: the cause may show on some ranks only (a Shampoo factor lives on one rank), so each rank that
    meets it reports it, not only rank 0."""

    def __init__(self, message: str, exit_status: int, every_rank: bool = False):
        super().__init__(message)
        self.exit_status, self.every_rank = exit_status, every_rank


# ------------------------------------------------------------------------------------------------
# Hyperparameters


HELP_GROUPS = ("data", "model", "optimizer", "schedule", "logging", "runtime")  # --help's sections, in order


def setting(group: str, default: Any, help: str) -> Any:
    """A Hyperparameters field: its default (the record's), and its --help section and text."""
    return dataclasses.field(default=default, metadata=dict(group=group, help=help))


@dataclass
class Hyperparameters:
    # data (glob patterns; DATA_PATH, when set, is prefixed)
    train_files: str = setting("data", "data/fineweb10B/fineweb_train_*.bin", "training shards (glob; DATA_PATH is prefixed)")
    val_files: str = setting("data", "data/fineweb10B/fineweb_val_*.bin", "validation shards (glob; DATA_PATH is prefixed)")
    # 20 x 524,288: the first val tokens, loaded once
    val_tokens: int = setting("data", 10_485_760, "tokens per validation: the first ones of the first validation shard")
    cycle_train_files: bool = setting("data", False, "start the training shards over when they run out (small data sets; never a record)")
    # batch: 8 micro-batches of micro_batch_seqs x seq_len tokens per step (8 x 64 x 1024 = 524,288)
    seq_len: int = setting("data", 1024, "tokens per sequence")
    micro_batch_seqs: int = setting("data", 64, "sequences per micro-batch; a step is 8 micro-batches, all ranks together")
    # architecture (fixed by the Track 3 rules)
    vocab_size: int = setting("model", 50304, "rows of the embedding and the head (GPT-2 shards need at least 50257)")
    num_layers: int = setting("model", 12, "transformer blocks")
    model_dim: int = setting("model", 768, "width of the residual stream")
    head_dim: int = setting("model", 128, "width of an attention head")
    # AdamW: embedding, head and every 1-D parameter
    adam_embed_lr: float = setting("optimizer", 0.3, "AdamW learning rate of the embedding")
    adam_head_lr: float = setting("optimizer", 1 / 320, "AdamW learning rate of the head")
    adam_scalar_lr: float = setting("optimizer", 0.01, "AdamW learning rate of the 1-D parameters")
    adam_beta1: float = setting("optimizer", 0.8, "AdamW beta1")
    adam_beta2: float = setting("optimizer", 0.95, "AdamW beta2")
    adam_eps: float = setting("optimizer", 1e-10, "AdamW epsilon")
    adam_weight_decay: float = setting("optimizer", 0.0, "AdamW decoupled weight decay")
    # the 72 block matrices: "shampoo" (the record) or "adamw" (ablation: Shampoo's grafting Adam alone,
    # i.e. AdamW with lr=matrix_lr, betas=(matrix_beta1, shampoo_grafting_beta2),
    # eps=shampoo_grafting_epsilon, weight_decay=matrix_weight_decay: equal to Shampoo's steps 1-4)
    matrix_optimizer: str = setting("optimizer", "shampoo", "optimizer of the block matrices: shampoo (the record) or adamw (ablation)")
    matrix_lr: float = setting("optimizer", 0.0015, "learning rate of the block matrices")
    matrix_beta1: float = setting("optimizer", 0.9, "momentum of the block matrices")
    matrix_beta2: float = setting("optimizer", 0.95, "EMA of Shampoo's factor matrices")
    matrix_weight_decay: float = setting("optimizer", 0.2, "decoupled weight decay of the block matrices")
    shampoo_max_preconditioner_dim: int = setting("optimizer", 8192, "larger dimensions are split into blocks of this size")
    shampoo_precondition_frequency: int = setting("optimizer", 5, "steps between root (eigendecomposition) updates")
    shampoo_start_preconditioning_step: int = setting("optimizer", -1, "first preconditioned step (-1: the precondition frequency)")
    shampoo_grafting_beta2: float = setting("optimizer", 0.95, "beta2 of the grafting Adam")
    shampoo_grafting_epsilon: float = setting("optimizer", 1e-10, "epsilon of the grafting Adam")
    # CHANGES THE MATH, hence off: the roots of a root step are computed after it, on a background thread and CUDA
    # stream beside the next step's forward and backward, and first used by that next step (so the first
    # preconditioned step uses the initial roots). At the same math the eigendecompositions cannot overlap
    # training (bench/NOTES.md, 2026-12-05)
    shampoo_defer_roots: bool = setting("optimizer", False, "compute each root step's roots beside the next step and use them one step later (CHANGES THE MATH; not the record)")
    # schedule: constant lr, then linear decay to 0 over the last cooldown_frac of the steps
    train_steps: int = setting("schedule", 4150, "optimizer steps; the LR schedule spans them")
    cooldown_frac: float = setting("schedule", 0.7, "fraction of the steps over which the LR decays linearly to 0")
    # logging
    val_every: int = setting("logging", 125, "steps between validations")
    # from late_frac of the run on (the record's claim is at step 4100)
    val_every_late: int = setting("logging", 25, "steps between validations from late_frac of the run on")
    late_frac: float = setting("logging", 0.9, "fraction of the run after which val_every_late applies")
    log_dir: str = setting("logging", "logs", "folder of the run logs, <run id>.txt")
    # run
    num_trials: int = setting("runtime", 1, "trials in one launch (they share the compiled model and the log)")
    seed: int = setting("runtime", -1, "torch seed (-1: unseeded like the record)")
    compile: bool = setting("runtime", True, "torch.compile the model")
    # CUDA streams (one host thread each) over which a step's eigendecompositions run concurrently; changes
    # the speed of the root steps only, not their result (one H200, optimizer alone: root step 2.17 s with 1
    # stream, 1.92 s with 8 at the default memory fraction below)
    shampoo_root_streams: int = setting("runtime", 8, "CUDA streams the root steps' eigendecompositions spread over (speed only)")
    # with several streams, the decompositions in flight may hold at most the largest one's temporaries plus this
    # fraction of the preconditioner state (inf: no bound). One H200, Track 3 optimizer alone, 8 streams: 0.1 ->
    # 409.6 ms/step and 468 MiB above the state, inf -> 376.9 ms/step and 2,280 MiB (distributed_shampoo/README.md)
    shampoo_root_memory_fraction: float = setting(
        "runtime", 0.1, "memory the concurrent eigendecompositions may hold, as a fraction of the preconditioner state (inf: unbounded; speed and memory only)"
    )
    checkpoint_every: int = setting("runtime", 0, "resumable checkpoint every K steps and at an interrupt (0: never)")  # a record run does not pay for it
    checkpoint_dir: str = setting("runtime", "", 'folder of the resumable checkpoints ("": checkpoints/<run id>)')
    resume: str = setting("runtime", "", "a checkpoint folder written by --checkpoint_every: continues that run exactly")


PRESETS: dict[str, dict[str, Any]] = {
    # Same architecture family, tiny widths; shards are generated when no files are given.
    "smoke": dict(
        seq_len=64,
        micro_batch_seqs=4,
        vocab_size=512,
        num_layers=2,
        model_dim=64,
        head_dim=16,
        val_tokens=4096,
        train_steps=20,
        val_every=5,
        val_every_late=2,
        seed=1234,
        compile=False,
        # as in the record, every matrix stays one 2-D block (64 x 64 = 4096 <= 8192 would be merged to a vector)
        shampoo_max_preconditioner_dim=1024,
    ),
}

class _ArgumentParser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # one line instead of usage + message
        raise UserError(f"{message} (see --help)")


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


def _parse_bound(text: str) -> float:
    """A finite number, or inf for no bound."""
    return math.inf if text.strip().lower() in ("inf", "+inf", "infinity") else _parse_float(text)


VALUE_PARSERS: dict[Any, Callable[[str], Any]] = {bool: _parse_bool, int: int, float: _parse_float, str: str}
BOUND_FLAGS = frozenset({"shampoo_root_memory_fraction"})  # float settings that take inf: no bound

# ---- command line: --name=value for every field, grouped in --help the same way in both training scripts ----
FLAG_GROUPS: dict[str, tuple[str, ...]] = {
    group: tuple(f.name for f in dataclasses.fields(Hyperparameters) if f.metadata["group"] == group) for group in HELP_GROUPS
}
FLAG_HELP: dict[str, str] = {f.name: f.metadata["help"] for f in dataclasses.fields(Hyperparameters)}
# train_gpt.py's names for the same settings, accepted here too (its num_iterations is also the schedule's length).
FLAG_ALIASES: dict[str, str] = {"val_loss_every": "val_every", "num_iterations": "train_steps"}


def _build_parser() -> _ArgumentParser:
    parser = _ArgumentParser(prog="train_gpt_shampoo.py", usage="%(prog)s [-h] [--preset=smoke] [--name=value ...]", description=__doc__,
                     allow_abbrev=False,
                     formatter_class=lambda prog: argparse.RawDescriptionHelpFormatter(prog, max_help_position=36))
    parser.add_argument("--preset", choices=sorted(PRESETS), default=argparse.SUPPRESS, help="a named set of overrides (smoke: tiny CPU run)")
    fields = {field.name: field for field in dataclasses.fields(Hyperparameters)}
    grouped = [name for names in FLAG_GROUPS.values() for name in names]
    groups = dict(FLAG_GROUPS, other=tuple(name for name in fields if name not in grouped))  # "other" stays empty (tested)
    for title, names in groups.items():
        group = parser.add_argument_group(title)
        for name in names:
            field = fields[name]
            also = "".join(f"; also --{alias}" for alias, target in FLAG_ALIASES.items() if target == name)
            default = '""' if field.default == "" else field.default
            value_parser = _parse_bound if name in BOUND_FLAGS else VALUE_PARSERS[field.type]
            group.add_argument(f"--{name}", type=value_parser, default=argparse.SUPPRESS,
                               metavar=getattr(field.type, "__name__", "VALUE"),
                               help=f"{FLAG_HELP.get(name, '')} (default: {default}){also}")
    for alias, target in FLAG_ALIASES.items():
        parser.add_argument(f"--{alias}", type=VALUE_PARSERS[fields[target].type], default=argparse.SUPPRESS, help=argparse.SUPPRESS)
    return parser


def parse_args(argv: Sequence[str]) -> tuple[Hyperparameters, dict[str, Any]]:
    """--name=value overrides of the Hyperparameters fields, after the optional --preset's."""
    namespace, unknown = _build_parser().parse_known_args(list(argv))
    if unknown:
        raise UserError(f"unknown argument {unknown[0]!r} (options are --name=value for the Hyperparameters fields)")
    explicit = vars(namespace)
    for alias, target in FLAG_ALIASES.items():  # overrides and the log name the field, whichever spelling was used
        if alias in explicit:
            if target in explicit:
                raise UserError(f"--{alias} and --{target} name the same setting; give one of them")
            explicit[target] = explicit.pop(alias)
    preset = PRESETS[explicit["preset"]] if "preset" in explicit else {}
    fields = {k: v for k, v in explicit.items() if k != "preset"}
    hp = dataclasses.replace(Hyperparameters(), **{**preset, **fields})
    validate_hyperparameters(hp)
    return hp, explicit


def need(condition: bool, message: str) -> None:
    """A check of the command line or the data: a one-line UserError when it fails."""
    if not condition:
        raise UserError(message)


SEED_LIMIT = 2**64 - 1  # torch.manual_seed's largest
NAME_LIMIT = 255  # bytes of one file name (NAME_MAX of Linux's file systems): a longer one fails every file operation
PATH_FLAGS = ("train_files", "val_files", "log_dir", "checkpoint_dir", "resume")


def check_path_names(hp: Hyperparameters) -> None:
    """Every name in the path settings fits a file name."""
    for flag in PATH_FLAGS:
        for name in Path(getattr(hp, flag)).parts:
            size = len(os.fsencode(name))
            need(size <= NAME_LIMIT, f"--{flag}: the name {name[:20]}... is {size} bytes, longer than a file name may be "
                                     f"({NAME_LIMIT}); pick a shorter --{flag}")


def validate_hyperparameters(hp: Hyperparameters) -> None:
    """Every setting's range, at parse time (the float flags' finiteness: _parse_float), each a one-line UserError."""
    check_path_names(hp)
    need(hp.matrix_optimizer in ("shampoo", "adamw"), f"--matrix_optimizer={hp.matrix_optimizer!r}: use shampoo or adamw")
    for name in ("seq_len", "micro_batch_seqs", "vocab_size", "num_layers", "model_dim", "head_dim", "val_tokens",
                 "train_steps", "val_every", "val_every_late", "num_trials"):
        need(getattr(hp, name) >= 1, f"--{name}={getattr(hp, name)}: must be >= 1")
    need(hp.model_dim % hp.head_dim == 0, f"--model_dim={hp.model_dim} must be a multiple of --head_dim={hp.head_dim}")
    need(hp.head_dim % 4 == 0, f"--head_dim={hp.head_dim} must be a multiple of 4 (half-truncated rotary)")
    need(0.0 <= hp.cooldown_frac <= 1.0, f"--cooldown_frac={hp.cooldown_frac}: must be in [0, 1]")
    need(0.0 <= hp.late_frac <= 1.0, f"--late_frac={hp.late_frac}: must be in [0, 1]")
    need(hp.checkpoint_every >= 0, f"--checkpoint_every={hp.checkpoint_every}: must be >= 0 (0 = off)")
    need(-1 <= hp.seed <= SEED_LIMIT, f"--seed={hp.seed}: must be -1 (unseeded) or in [0, {SEED_LIMIT}]")
    for name in ("adam_embed_lr", "adam_head_lr", "adam_scalar_lr", "adam_weight_decay", "matrix_lr", "matrix_weight_decay"):
        need(getattr(hp, name) >= 0, f"--{name}={getattr(hp, name)}: must be >= 0")
    for name in ("adam_beta1", "adam_beta2", "matrix_beta1", "shampoo_grafting_beta2"):
        need(0 <= getattr(hp, name) < 1, f"--{name}={getattr(hp, name)}: must be in [0, 1)")
    need(0 <= hp.matrix_beta2 <= 1, f"--matrix_beta2={hp.matrix_beta2}: must be in [0, 1]")
    for name in ("adam_eps", "shampoo_grafting_epsilon"):
        need(getattr(hp, name) > 0, f"--{name}={getattr(hp, name)}: must be > 0")
    for name in ("shampoo_max_preconditioner_dim", "shampoo_precondition_frequency", "shampoo_root_streams"):
        need(getattr(hp, name) >= 1, f"--{name}={getattr(hp, name)}: must be >= 1")
    need(hp.shampoo_root_memory_fraction >= 0, f"--shampoo_root_memory_fraction={hp.shampoo_root_memory_fraction}: must be >= 0 (inf: no bound)")
    start = hp.shampoo_start_preconditioning_step
    need(start == -1 or start >= hp.shampoo_precondition_frequency,
            f"--shampoo_start_preconditioning_step={start}: must be -1 or >= --shampoo_precondition_frequency")


# ------------------------------------------------------------------------------------------------
# Data: token shards, read by the record's unaligned loader

# ---- shards (the same helpers in train_gpt.py and train_gpt_shampoo.py; tests/test_shared_helpers.py) ----
# A shard: 256 little-endian int32 (magic, version, token count, zeros), then uint16 tokens (docs/shards.md).
SHARD_MAGIC = 20240520
SHARD_VERSION = 1
SHARD_HEADER_INTS = 256
GPT2_VOCAB_SIZE = 50257
DOWNLOAD_HINT = "python data/cached_fineweb10B.py 22"  # the record reads 22 training shards
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


# ---- the record's unaligned loader ----
class TokenLoader:
    """The record's unaligned loader: each step takes the next batch_tokens (+1 for the shifted targets)
    consecutive tokens of the current shard, rank r the r-th slice; a shard's tail shorter than a batch
    is dropped, so is a whole shard shorter than a batch (the last one data/fineweb.py writes may be).
    Documents are neither aligned nor masked. The position is checkpointable."""

    def __init__(self, files: list[str], *, batch_tokens: int, seq_len: int, rank: int, world_size: int,
                 vocab_size: int, device: torch.device, cycle: bool = False):
        self.files, self.batch_tokens, self.seq_len = files, batch_tokens, seq_len
        self.rank, self.local_tokens = rank, batch_tokens // world_size
        self.vocab_size, self.device, self.cycle = vocab_size, device, cycle
        self.file_index, self.position, self.passes = 0, 0, 0
        self.tokens = self._load(0)

    def _load(self, index: int) -> Tensor:
        tokens = torch.from_numpy(read_shard(self.files[index], self.vocab_size))
        return tokens.pin_memory() if self.device.type == "cuda" else tokens

    def _fits(self) -> bool:
        return self.position + self.batch_tokens + 1 < len(self.tokens)

    def _advance_shard(self) -> None:
        next_index = self.file_index + 1
        if next_index == len(self.files):
            if not self.cycle:
                raise UserError(f"out of training data after {len(self.files)} files; add shards "
                                f"(`{DOWNLOAD_HINT}`) or pass --cycle_train_files=true for a proxy dataset")
            next_index, self.passes = 0, self.passes + 1
        self.file_index, self.position = next_index, 0
        self.tokens = self._load(next_index)

    def next_batch(self) -> tuple[Tensor, Tensor]:
        skipped = 0
        while not self._fits():
            if skipped == len(self.files):  # a full pass of shards, each shorter than a batch
                raise UserError(f"{self.batch_tokens + 2} tokens needed for one batch, but no file of the pattern holds "
                                f"that many; use larger shards")
            self._advance_shard()
            skipped += 1
        start = self.position + self.rank * self.local_tokens
        window = self.tokens[start : start + self.local_tokens + 1]
        inputs = window[:-1].to(device=self.device, dtype=torch.int32, non_blocking=True)
        targets = window[1:].to(device=self.device, dtype=torch.int64, non_blocking=True)
        self.position += self.batch_tokens
        return inputs.view(-1, self.seq_len), targets.view(-1, self.seq_len)

    def state_dict(self) -> dict[str, int]:
        return {"file_index": self.file_index, "position": self.position, "passes": self.passes}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.file_index, self.position, self.passes = state["file_index"], state["position"], state["passes"]
        self.tokens = self._load(self.file_index)


def check_batch_geometry(hp: Hyperparameters, world_size: int) -> None:
    for name, tokens in [("the train batch (8 micro-batches)", 8 * hp.micro_batch_seqs * hp.seq_len),
                         ("--val_tokens", hp.val_tokens)]:
        if tokens % (world_size * hp.micro_batch_seqs * hp.seq_len):
            raise UserError(f"{name} = {tokens} tokens must split into {world_size} ranks x micro-batches of "
                            f"{hp.micro_batch_seqs} x {hp.seq_len} tokens")


def load_validation_data(val_files: list[str], hp: Hyperparameters, rt: "Runtime") -> tuple[Tensor, Tensor]:
    """The first val_tokens tokens of the first validation shard (the first batch of a loader with batch size
    val_tokens), loaded once."""
    available = read_shard_header(val_files[0])
    if available < hp.val_tokens + 2:
        raise UserError(f"validation data ({hp.val_files}): {val_files[0]} holds {available} tokens, fewer than "
                        f"--val_tokens={hp.val_tokens} + 2; lower --val_tokens")
    loader = TokenLoader(val_files[:1], batch_tokens=hp.val_tokens, seq_len=hp.seq_len, rank=rt.rank,
                         world_size=rt.world_size, vocab_size=hp.vocab_size, device=rt.device)
    return loader.next_batch()


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


def smoke_tokens(vocab_size: int) -> dict[str, np.ndarray]:
    """Small deterministic shards with learnable structure: each token drawn from four likely successors of the
    previous one (one random table, then the three shards from the same generator, in this order)."""
    rng = np.random.default_rng(0)
    successors = rng.integers(0, vocab_size, size=(vocab_size, 4))
    shards = {}
    for name, num_tokens in [("smoke_train_000001.bin", 32768), ("smoke_train_000002.bin", 32768),
                             ("smoke_val_000000.bin", 8192)]:
        tokens = np.empty(num_tokens, dtype=np.int64)
        tokens[0] = 0
        choices = rng.integers(0, 4, size=num_tokens)
        for i in range(1, num_tokens):
            tokens[i] = successors[tokens[i - 1], choices[i]]
        shards[name] = tokens
    return shards


def smoke_shards(hp: Hyperparameters, rt: "Runtime", started: float) -> tuple[str, str]:
    """The smoke preset's shards of smoke_tokens, in data/smoke/v<vocab_size> (under DATA_PATH when set): their bytes
    depend on the vocabulary size alone."""
    folder = Path(os.environ.get("DATA_PATH", ""), "data", "smoke", f"v{hp.vocab_size}")
    return write_smoke_shards(folder, lambda: smoke_tokens(hp.vocab_size), rt.local_rank, started)


# ------------------------------------------------------------------------------------------------
# Model: the fixed Track 3 architecture


class Linear(nn.Linear):
    """fp32 master weights and bias, cast to the activation dtype (bf16) at use."""

    def forward(self, x: Tensor) -> Tensor:
        return F.linear(x, self.weight.type_as(x), self.bias.type_as(x))


class RMSNorm(nn.Module):
    def __init__(self, dim: int):
        super().__init__()
        self.gains = nn.Parameter(torch.ones(dim))

    def forward(self, x: Tensor) -> Tensor:
        return F.rms_norm(x, (x.size(-1),), weight=self.gains.type_as(x))


class Rotary(nn.Module):
    """Half-truncated RoPE: head_dim/4 frequencies from 1 down to 1/1024, then head_dim/4 zeros."""

    frequencies: Tensor

    def __init__(self, head_dim: int):
        super().__init__()
        quarter = head_dim // 4
        frequencies = (1 / 1024) ** torch.linspace(0, 1, quarter, dtype=torch.float32)
        self.register_buffer("frequencies", torch.cat([frequencies, frequencies.new_zeros(quarter)]), persistent=False)

    def forward(self, x: Tensor) -> Tensor:  # x: (B, T, heads, head_dim)
        positions = torch.arange(x.size(1), device=x.device, dtype=torch.float32)
        angles = torch.outer(positions, self.frequencies)[None, :, None, :]
        cos, sin = angles.cos(), angles.sin()
        x1, x2 = x.float().chunk(2, dim=-1)
        rotated = torch.cat([x1 * cos + x2 * sin, -x1 * sin + x2 * cos], dim=-1)
        return rotated.type_as(x)


class Attention(nn.Module):
    SCALE = 0.12  # not 1/sqrt(head_dim); QK-norm sets the logits' size

    def __init__(self, dim: int, head_dim: int):
        super().__init__()
        self.head_dim = head_dim
        self.q, self.k, self.v, self.proj = (Linear(dim, dim) for _ in range(4))
        self.rotary = Rotary(head_dim)

    def forward(self, x: Tensor) -> Tensor:
        B, T, dim = x.shape
        q, k, v = (layer(x).view(B, T, -1, self.head_dim) for layer in (self.q, self.k, self.v))
        q, k = F.rms_norm(q, (self.head_dim,)), F.rms_norm(k, (self.head_dim,))  # QK-norm without gains
        q, k = self.rotary(q), self.rotary(k)
        y = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                           is_causal=True, scale=self.SCALE)
        return self.proj(y.transpose(1, 2).reshape(B, T, dim))


class MLP(nn.Module):
    def __init__(self, dim: int):
        super().__init__()
        self.fc, self.proj = Linear(dim, 4 * dim), Linear(4 * dim, dim)

    def forward(self, x: Tensor) -> Tensor:
        return self.proj(F.relu(self.fc(x)).square())


class Block(nn.Module):
    def __init__(self, dim: int, head_dim: int):
        super().__init__()
        self.attn, self.mlp = Attention(dim, head_dim), MLP(dim)
        self.norm1, self.norm2 = RMSNorm(dim), RMSNorm(dim)

    def forward(self, x: Tensor) -> Tensor:
        x = x + self.attn(self.norm1(x))
        return x + self.mlp(self.norm2(x))


class GPT(nn.Module):
    SOFTCAP = 15.0

    def __init__(self, vocab_size: int, num_layers: int, dim: int, head_dim: int):
        super().__init__()
        self.embed = nn.Embedding(vocab_size, dim).bfloat16()  # bf16 embedding => bf16 activations
        self.blocks = nn.ModuleList(Block(dim, head_dim) for _ in range(num_layers))
        self.proj = Linear(dim, vocab_size)  # the head, untied
        self.norm1, self.norm2 = RMSNorm(dim), RMSNorm(dim)

    def forward(self, inputs: Tensor, targets: Tensor) -> Tensor:
        """The summed (not averaged) cross-entropy over all tokens."""
        x = self.norm1(self.embed(inputs))
        for block in self.blocks:
            x = block(x)
        logits = self.proj(self.norm2(x)).float()
        logits = self.SOFTCAP * logits / torch.sqrt(logits.square() + self.SOFTCAP**2)  # algebraic soft-cap
        return F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1), reduction="sum")


@torch.no_grad()
def init_parameters(model: nn.Module) -> None:
    """Track 3 init: every weight named *proj* (both projections and the head) zero, embedding N(0, 1),
    other weights N(0, 0.33/fan_in), biases zero, gains one."""
    for name, param in model.named_parameters():
        if name.endswith("weight") and "proj" in name:
            param.zero_()
        elif name.endswith("weight") and "embed" in name:
            param.normal_(0.0, 1.0)
        elif name.endswith("weight"):
            param.normal_(0.0, math.sqrt(0.33) / math.sqrt(param.size(-1)))
        elif name.endswith("bias"):
            param.zero_()
        elif name.endswith("gains"):
            param.fill_(1.0)
        else:
            raise RuntimeError(f"no init rule for parameter {name}")


# ------------------------------------------------------------------------------------------------
# Optimizers: AdamW for the embedding, the head and the 1-D parameters; DistributedShampoo for the 72 block
# matrices. This is the block a matrix-optimizer experiment swaps: build_matrix_optimizer returns any
# torch.optim.Optimizer over the matrices (its param groups' "lr" follow lr_multiplier), and train_step steps
# it after AdamW. --matrix_optimizer=adamw is the ablation: Shampoo's grafting Adam alone.


def split_parameters(model: GPT) -> dict[str, list[Tensor]]:
    groups: dict[str, list[Tensor]] = {
        "embed": [model.embed.weight],
        "head": [model.proj.weight],
        "scalars": [p for p in model.parameters() if p.ndim < 2],
        "matrices": [p for p in model.blocks.parameters() if p.ndim >= 2],
    }
    check_parameter_coverage(model, groups.values())
    return groups


def check_parameter_coverage(model: nn.Module, param_lists: Iterable[Iterable[Tensor]]) -> None:
    """Every model parameter must be optimized exactly once."""
    counts = Counter(id(p) for params in param_lists for p in params)
    named = list(model.named_parameters(remove_duplicate=False))
    missing = [name for name, p in named if counts[id(p)] == 0]
    repeated = [name for name, p in named if counts[id(p)] > 1]
    foreign = len(set(counts) - {id(p) for _, p in named})
    if missing or repeated or foreign:
        raise RuntimeError(f"the optimizers must cover every parameter exactly once: missing {missing}, "
                           f"in more than one group {repeated}, {foreign} not in the model")


def build_optimizers(model: GPT, hp: Hyperparameters, world_size: int, device: torch.device) -> list[torch.optim.Optimizer]:
    """[AdamW, the matrix optimizer], stepped in this order; both cover every parameter exactly once."""
    groups = split_parameters(model)
    adamw = torch.optim.AdamW(
        [dict(params=groups["embed"], lr=hp.adam_embed_lr), dict(params=groups["head"], lr=hp.adam_head_lr),
         dict(params=groups["scalars"], lr=hp.adam_scalar_lr)],
        betas=(hp.adam_beta1, hp.adam_beta2), eps=hp.adam_eps, weight_decay=hp.adam_weight_decay,
        fused=device.type == "cuda",
    )
    optimizers = [adamw, build_matrix_optimizer(groups["matrices"], hp, world_size, device)]
    check_parameter_coverage(model, [group["params"] for opt in optimizers for group in opt.param_groups])
    return optimizers


def build_matrix_optimizer(matrices: list[Tensor], hp: Hyperparameters, world_size: int,
                           device: torch.device) -> torch.optim.Optimizer:
    if hp.matrix_optimizer == "shampoo":
        return build_shampoo(matrices, hp, world_size)
    return torch.optim.AdamW(matrices, lr=hp.matrix_lr, betas=(hp.matrix_beta1, hp.shampoo_grafting_beta2),
                             eps=hp.shampoo_grafting_epsilon, weight_decay=hp.matrix_weight_decay,
                             fused=device.type == "cuda")


def require_shampoo() -> None:
    if SHAMPOO_IMPORT_ERROR is not None:
        raise UserError(f"--matrix_optimizer=shampoo needs the distributed_shampoo package next to this script "
                        f"({SHAMPOO_IMPORT_ERROR}); or pass --matrix_optimizer=adamw")


def start_preconditioning_step(hp: Hyperparameters) -> int:
    """-1 resolved here, as the package would resolve it (the precondition frequency), so that the package has no
    notice to print (it printed one per rank, on stderr); the log's header names the step."""
    start = hp.shampoo_start_preconditioning_step
    return hp.shampoo_precondition_frequency if start == -1 else start


def build_shampoo(matrices: list[Tensor], hp: Hyperparameters, world_size: int) -> torch.optim.Optimizer:
    """The record's arguments (docs/track3_recipe.md#shampoo-arguments)."""
    require_shampoo()
    distributed_config: SingleDeviceDistributedConfig | DDPDistributedConfig
    if world_size == 1:
        distributed_config = SingleDeviceDistributedConfig()
    else:  # each rank preconditions its share of the matrices; updated matrices are all-gathered in fp32
        distributed_config = DDPDistributedConfig(communication_dtype=torch.float32,
                                                  num_trainers_per_group=world_size, communicate_params=True)
    return DistributedShampoo(
        matrices,
        lr=hp.matrix_lr,
        betas=(hp.matrix_beta1, hp.matrix_beta2),
        weight_decay=hp.matrix_weight_decay,
        weight_decay_type=WeightDecayType.DECOUPLED,
        max_preconditioner_dim=hp.shampoo_max_preconditioner_dim,
        precondition_frequency=hp.shampoo_precondition_frequency,
        start_preconditioning_step=start_preconditioning_step(hp),
        grafting_config=AdamPreconditionerConfig(beta2=hp.shampoo_grafting_beta2, epsilon=hp.shampoo_grafting_epsilon),
        # full (unpacked) factors, as the record's package stored them: packing changes float32 rounding
        preconditioner_config=RootInvShampooPreconditionerConfig(use_symmetric_packing=False),
        distributed_config=distributed_config,
        shampoo_runtime_config=ShampooRuntimeConfig(
            num_amortized_computation_streams=hp.shampoo_root_streams, concurrent_memory_fraction=hp.shampoo_root_memory_fraction,
            defer_amortized_computation=hp.shampoo_defer_roots,
        ),
    )


def preconditioner_failure(error: Exception, step: int, matrix_names: list[str]) -> RunStopped:
    """Shampoo's own finding as one line, naming the parameter whose factor matrix went non-finite."""
    text = " ".join(str(error).split())
    finding = re.split(r"(?<=[!.])\s", text, maxsplit=1)[0]
    index = re.search(r"factor matrix (\d+)\.", finding)
    if index and int(index.group(1)) < len(matrix_names):
        finding += f" ({matrix_names[int(index.group(1))]})"
    return RunStopped(f"step {step}: Shampoo: {finding}; stopping", NON_FINITE_EXIT_STATUS, every_rank=True)


def lr_multiplier(step: int, hp: Hyperparameters) -> float:
    """1 for the first (1 - cooldown_frac) of the run, then linear to 0 at train_steps (no floor)."""
    progress = step / hp.train_steps
    if progress < 1 - hp.cooldown_frac:
        return 1.0
    return (1 - progress) / hp.cooldown_frac


# ------------------------------------------------------------------------------------------------
# Distributed setup and logging


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


# ---- this script's log: the program it ran (the script and the package modules it imports) ----
_shared_log_path: Path | None = None  # the log's path on every rank (for a stop that only some ranks meet)


PACKAGE_BANNER = "# ===== {} ====="
SEPARATOR = "=" * 100


def imported_package_files(entry: Path, package_dir: Path) -> list[Path]:
    """The files of the package's modules that running `entry` imports, sorted: its import statements followed
    through the package's own, each module's parent packages included, and an import inside a function too (the
    run may call it). Read from the sources, not from sys.modules, whose content depends on what else the process
    imported (a test runner, say); statements under `if TYPE_CHECKING:` never run and are not followed."""
    package = package_dir.name

    def source(module: str) -> Path:
        path = package_dir.parent.joinpath(*module.split("."))
        return path / "__init__.py" if path.is_dir() else path.with_suffix(".py")

    def imports(nodes: Iterable[ast.AST]) -> Iterator[str]:
        for node in nodes:
            if isinstance(node, ast.If) and isinstance(node.test, ast.Name) and node.test.id == "TYPE_CHECKING":
                yield from imports(node.orelse)
                continue
            if isinstance(node, ast.Import):
                yield from (alias.name for alias in node.names)
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                yield node.module
                yield from (f"{node.module}.{alias.name}" for alias in node.names)  # submodules among the names
            yield from imports(ast.iter_child_nodes(node))

    found: set[Path] = set()
    pending = [entry]
    while pending:
        for name in imports(ast.parse(pending.pop().read_text(encoding="utf-8")).body):
            parts = name.split(".")
            for depth in range(1, len(parts) + 1) if parts[0] == package else ():
                path = source(".".join(parts[:depth]))
                if path.is_file() and path not in found:
                    found.add(path)
                    pending.append(path)
    return sorted(found)


def shampoo_source_files() -> list[Path]:
    """The distributed_shampoo modules this script imports (none when the package is missing)."""
    if SHAMPOO_PACKAGE_DIR is None:
        return []
    return imported_package_files(Path(__file__).resolve(), SHAMPOO_PACKAGE_DIR)


def program_source() -> str:
    """This script's source, then each package module behind a banner naming it: the log alone
    rebuilds the program (tools/records.py extract)."""
    parts = [Path(__file__).read_text(encoding="utf-8")]
    for path in shampoo_source_files():
        assert SHAMPOO_PACKAGE_DIR is not None
        text = path.read_text(encoding="utf-8")
        parts.append(PACKAGE_BANNER.format(path.relative_to(SHAMPOO_PACKAGE_DIR.parent).as_posix()) + "\n")
        parts.append(text if text.endswith("\n") or not text else text + "\n")
    if not parts[0].endswith("\n"):
        parts[0] += "\n"
    return "".join(parts)


def parameter_split_lines(model: GPT, hp: Hyperparameters) -> list[str]:
    names = {id(p): n for n, p in model.named_parameters()}
    optimizer_of = {"embed": "AdamW", "head": "AdamW", "scalars": "AdamW",
                    "matrices": "DistributedShampoo" if hp.matrix_optimizer == "shampoo" else "AdamW (ablation)"}
    return [f"param_group {group}: {optimizer_of[group]}, {len(params)} tensors, "
            f"{sum(p.numel() for p in params):,} parameters, first {names[id(params[0])]}"
            for group, params in split_parameters(model).items()]


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


# ------------------------------------------------------------------------------------------------
# Checkpoints and resume

CHECKPOINT_FORMAT = "train_gpt_shampoo/5"  # /2: the settings moved to manifest.json; /3: the clock in ms; /4: file hashes;
# /5: the train shards in both, the settings in shared.pt too
# Settings that may differ between a checkpointed run and its resumption without changing the trajectory
# (the root streams and their memory fraction change only how fast the same eigendecompositions run).
RUNTIME_ONLY_FIELDS = frozenset(
    {"num_trials", "log_dir", "checkpoint_every", "checkpoint_dir", "resume", "shampoo_root_streams", "shampoo_root_memory_fraction"}
)


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


# ---- Track 3's checkpoints: <checkpoint_dir>/step<N>, or trial<k>_step<N> with several trials ----
@dataclass
class Progress:
    """Where a trial stands; checkpointed so that a resumed run continues its step count and its clock."""

    trial: int
    step: int = 0
    training_time_ms: float = 0.0  # validation and checkpoints excluded


def checkpoint_name(trial: int, step: int, num_trials: int) -> str:
    return f"step{step:06d}" if num_trials == 1 else f"trial{trial}_step{step:06d}"


def checkpoint_steps(hp: Hyperparameters, start_step: int) -> list[int]:
    """The steps after start_step at which --checkpoint_every saves: its multiples, and the last step."""
    every = hp.checkpoint_every
    return [*range((start_step // every + 1) * every, hp.train_steps, every), hp.train_steps] if start_step < hp.train_steps else []


def check_checkpoints_are_new(directory: Path, hp: Hyperparameters, resume: "ResumePoint | None") -> None:
    """The checkpoints this run would write must not exist; earlier ones may (a resumed run keeps writing into the
    folder of the run it continues)."""
    for trial in range(resume.trial if resume else 0, hp.num_trials):
        for step in checkpoint_steps(hp, resume.step if resume and trial == resume.trial else 0):
            path = directory / checkpoint_name(trial, step, hp.num_trials)
            if path.exists():
                raise UserError(f"checkpoint {path} already exists and this run would write it; pick another "
                                f"--checkpoint_dir (checkpoints are never overwritten)")


def prepare_resume(hp: Hyperparameters, settings: dict[str, Any], train_shards: list[dict[str, Any]], rt: Runtime) -> ResumePoint | None:
    """Before the run (collective): the checkpoint --resume names, checked (train_shards: this run's), and the periodic
    checkpoints this run would write must be new (the default folder is new: named by the run id)."""
    resume = open_checkpoint(hp.resume, settings, train_shards, rt) if hp.resume else None
    if resume is not None and resume.trial >= hp.num_trials:
        raise UserError(f"--resume={hp.resume}: checkpoint of trial {resume.trial}, but --num_trials={hp.num_trials}")
    if hp.checkpoint_every and hp.checkpoint_dir:
        check_checkpoints_are_new(Path(hp.checkpoint_dir), hp, resume)
    return resume


def estimate_checkpoint_file_sizes(hp: Hyperparameters, world_size: int) -> list[int]:
    """About the sizes of a checkpoint's files: shared.pt (the model and AdamW's state), then each rank's rank<r>.pt
    (the matrix optimizer's state, every rank's as large as this rank's). The optimizers' state is measured as a trial
    builds it (Shampoo's at once, AdamW's at its first step: optimizer_bytes), on a model and optimizers built on the
    meta device: the same layout, with no memory and no work."""
    with torch.device("meta"):
        model = GPT(hp.vocab_size, hp.num_layers, hp.model_dim, hp.head_dim)
    adamw, matrix_optimizer = build_optimizers(model, hp, world_size, torch.device("meta"))
    return [tensor_bytes(model.state_dict()) + optimizer_bytes([adamw])] + [optimizer_bytes([matrix_optimizer])] * world_size


def save_resumable(target: Path, run_id: str, rt: Runtime, settings: dict[str, Any], train_shards: list[dict[str, Any]],
                   model: GPT, optimizers: list[torch.optim.Optimizer], loader: TokenLoader, progress: Progress) -> bool:
    rank_state = dict(matrix_optimizer=optimizers[1].state_dict())  # each rank's Shampoo blocks
    shared_state = dict(model=model.state_dict(), adamw=optimizers[0].state_dict(), loader=loader.state_dict())
    return write_checkpoint(target, run_id, rt, settings, train_shards, dataclasses.asdict(progress), rank_state, shared_state)


def load_resumable(point: ResumePoint, rt: Runtime, model: GPT, optimizers: list[torch.optim.Optimizer],
                   loader: TokenLoader) -> Progress:
    # weights_only=False: Shampoo's state dict holds its config objects, not only tensors
    shared = torch.load(point.path / "shared.pt", map_location=rt.device, weights_only=False)
    rank_state = torch.load(point.path / f"rank{rt.rank}.pt", map_location=rt.device, weights_only=False)
    model.load_state_dict(shared["model"])
    optimizers[0].load_state_dict(shared["adamw"])
    optimizers[1].load_state_dict(rank_state["matrix_optimizer"])
    loader.load_state_dict(shared["loader"])
    set_rng_state(rank_state["rng"], rt.device)
    return Progress(**shared["progress"])


# ------------------------------------------------------------------------------------------------
# Warmup: compile and run the kernels once, untimed, without touching parameters or optimizer state


def warm_up(model: nn.Module, val_inputs: Tensor, val_targets: Tensor, micro_batch_seqs: int) -> None:
    inputs, targets = val_inputs[:micro_batch_seqs], val_targets[:micro_batch_seqs]
    model(inputs, targets).backward()
    model.zero_grad(set_to_none=True)
    model.eval()
    with torch.no_grad():
        model(inputs, targets)
    model.train()


# ------------------------------------------------------------------------------------------------
# Train and validate


def is_validation_step(step: int, hp: Hyperparameters) -> bool:
    """Step 0, every val_every steps, every val_every_late steps from late_frac of the run on, the last step."""
    if step == 0 or step == hp.train_steps:
        return True
    every = hp.val_every_late if step / hp.train_steps >= hp.late_frac else hp.val_every
    return step % every == 0


@torch.no_grad()
def evaluate(model: nn.Module, val_inputs: Tensor, val_targets: Tensor, micro_batch_seqs: int, val_tokens: int) -> float:
    model.eval()
    total = torch.zeros((), device=val_inputs.device, dtype=torch.float32)
    for start in range(0, len(val_inputs), micro_batch_seqs):
        end = start + micro_batch_seqs
        total += model(val_inputs[start:end], val_targets[start:end])
    dist.all_reduce(total)
    model.train()
    return total.item() / val_tokens


def train_step(model: GPT, forward: nn.Module, optimizers: list[torch.optim.Optimizer], base_lrs: list[list[float]],
               inputs: Tensor, targets: Tensor, lr_scale: float, micro_batch_seqs: int, world_size: int) -> Tensor:
    """One optimizer step; returns this rank's summed loss, on the device (nothing waits for it)."""
    step_loss = torch.zeros((), device=inputs.device)
    for start in range(0, len(inputs), micro_batch_seqs):
        end = start + micro_batch_seqs
        loss = forward(inputs[start:end], targets[start:end])
        loss.backward()
        step_loss += loss.detach()
    for name, param in model.named_parameters():
        if param.grad is None:
            raise RuntimeError(f"{name} got no gradient")
        if world_size > 1:
            dist.all_reduce(param.grad)  # SUM: the gradient of the loss summed over all tokens of the step
    for optimizer, lrs in zip(optimizers, base_lrs):
        for group, lr in zip(optimizer.param_groups, lrs):
            group["lr"] = lr * lr_scale
        optimizer.step()
    model.zero_grad(set_to_none=True)
    return step_loss


def log_validation(progress: Progress, val_loss: float, train_steps: int) -> None:
    """The record's line, timed as train_gpt.py times it: milliseconds, step_avg over the whole run so far."""
    training_time_ms = progress.training_time_ms
    print0(f"step:{progress.step}/{train_steps} val_loss:{val_loss:.5f} train_time:{training_time_ms:.0f}ms "
           f"step_avg:{training_time_ms / max(progress.step, 1):.2f}ms", console=True)


@dataclass
class Launch:
    """What every trial of one launch shares."""

    hp: Hyperparameters
    settings: dict[str, Any]  # what a checkpoint records (before the smoke preset's paths)
    rt: Runtime
    run_id: str
    checkpoint_dir: Path
    model: GPT  # parameters, state dicts
    forward: nn.Module  # the model, compiled unless --compile=false
    val_inputs: Tensor
    val_targets: Tensor
    train_files: list[str]
    train_shards: list[dict[str, Any]]  # what a checkpoint records of train_files (train_shard_record)


@dataclass
class TrialResult:
    val_losses: dict[int, float]


def run_trial(launch: Launch, trial: int, resume: ResumePoint | None) -> TrialResult:
    """Fresh init, optimizers and loader (or a checkpoint's), then train with the clock stopped for
    validation and checkpoints. Stops early, raising RunStopped, on a non-finite loss (or Shampoo's finding of
    one), or at the step boundary after SIGINT/SIGTERM/SIGHUP or a failed write of the log (checkpointing first
    when enabled)."""
    global _step_reached
    hp, rt, model = launch.hp, launch.rt, launch.model
    init_parameters(model)
    optimizers = build_optimizers(model, hp, rt.world_size, rt.device)
    base_lrs = [[group["lr"] for group in opt.param_groups] for opt in optimizers]
    loader = TokenLoader(launch.train_files, batch_tokens=8 * hp.micro_batch_seqs * hp.seq_len, seq_len=hp.seq_len,
                         rank=rt.rank, world_size=rt.world_size, vocab_size=hp.vocab_size, device=rt.device,
                         cycle=hp.cycle_train_files)
    for param in model.parameters():
        dist.broadcast(param.detach(), 0)
    progress = load_resumable(resume, rt, model, optimizers, loader) if resume else Progress(trial)

    val_losses: dict[int, float] = {}
    start_step = _step_reached = progress.step
    stop_if_asked()  # a signal during the previous trial's last validation, or while this one was set up
    saves = frozenset(checkpoint_steps(hp, start_step)) if hp.checkpoint_every > 0 else frozenset()
    health = StepHealth(rt.device, rt.world_size, HEALTH_LAG_CUDA if rt.device.type == "cuda" else 0)
    names = {id(p): n for n, p in model.named_parameters()}
    matrix_names = [names[id(p)] for p in split_parameters(model)["matrices"]]

    def checkpoint_at(step: int) -> None:
        target = launch.checkpoint_dir / checkpoint_name(trial, step, hp.num_trials)
        saved = save_resumable(target, launch.run_id, rt, launch.settings, launch.train_shards, model, optimizers, loader, progress)
        print0(f"checkpoint: {target}" + ("" if saved else " already exists; not replaced"), console=True)

    def stop_clock() -> None:
        finish_deferred_roots(optimizers, step, matrix_names)  # timed, and before any state is saved
        synchronize(rt.device)
        progress.training_time_ms += 1000 * (time.perf_counter() - t0)

    synchronize(rt.device)
    t0 = time.perf_counter()
    for step in range(start_step, hp.train_steps + 1):
        progress.step = _step_reached = step
        last_step = step == hp.train_steps
        if health.poll(keep=0 if last_step else health.lag):  # a rank asked to stop: the trial stops here
            stop_clock()
            if hp.checkpoint_every > 0 and step != start_step:
                checkpoint_at(step)
            stop_if_asked()
        validate = is_validation_step(step, hp)
        checkpoint = step in saves
        if validate or checkpoint:
            stop_clock()
            if validate:
                val_losses[step] = evaluate(launch.forward, launch.val_inputs, launch.val_targets,
                                            hp.micro_batch_seqs, hp.val_tokens)
                log_validation(progress, val_losses[step], hp.train_steps)
                if not math.isfinite(val_losses[step]):
                    raise RunStopped(f"step {step}: non-finite validation loss ({val_losses[step]}); stopping",
                                     NON_FINITE_EXIT_STATUS)
            if checkpoint:
                stop = health.poll(keep=0)  # never checkpoint a diverged model
                checkpoint_at(step)
                if stop:
                    stop_if_asked()
            synchronize(rt.device)
            t0 = time.perf_counter()
        if last_step:
            break
        inputs, targets = loader.next_batch()
        try:
            step_loss = train_step(model, launch.forward, optimizers, base_lrs, inputs, targets,
                                   lr_multiplier(step, hp), hp.micro_batch_seqs, rt.world_size)
        except NON_FINITE_PRECONDITIONER_ERRORS as error:
            raise preconditioner_failure(error, step + 1, matrix_names) from None
        health.push(step, step_loss, stop_requested())
        approx_ms = progress.training_time_ms + 1000 * (time.perf_counter() - t0)  # no synchronize: the record's way
        if _is_master:  # the console only, as in the record
            print(f"step:{step + 1}/{hp.train_steps} train_time:{approx_ms:.0f}ms step_avg:{approx_ms / (step + 1):.2f}ms", flush=True)
    finish_deferred_roots(optimizers, hp.train_steps, matrix_names)  # a last step without validation left some
    stop_if_asked(signals=False)  # the last step's lines did not reach the log (a signal now stops the next trial)
    return TrialResult(val_losses)


def finish_deferred_roots(optimizers: Sequence[torch.optim.Optimizer], step: int, matrix_names: list[str]) -> None:
    """Wait for the roots that step `step` left computing (--shampoo_defer_roots); their non-finite failure stops
    the run in one line, naming that step."""
    for optimizer in optimizers:
        finish = getattr(optimizer, "finish_amortized_computations", None)  # AdamW and the published optimizer: none
        if finish is None:
            continue
        try:
            finish()
        except NON_FINITE_PRECONDITIONER_ERRORS as error:
            raise preconditioner_failure(error, step, matrix_names) from None


# ------------------------------------------------------------------------------------------------
# Main


@dataclass
class RunResult:
    log_path: Path | None
    model: GPT
    trials: list[TrialResult]


def run(argv: Sequence[str]) -> RunResult:
    """The whole run: checks, setup, log header, warmup, trials. Returns what tests inspect. Every check that
    can fail runs before the log file is created: a refused run leaves no log."""
    global _log_path, _shared_log_path, _is_master, _last_checkpoint, _log_error
    run_started, _log_error = time.time(), None
    hp, overrides = parse_args(argv)
    settings = comparable_settings(hp)  # what a checkpoint of this run records (before the smoke preset's paths)
    world_size = read_world_size()
    check_batch_geometry(hp, world_size)
    if hp.matrix_optimizer == "shampoo":
        require_shampoo()
    rt = setup_distributed()
    _is_master = rt.rank == 0
    try:
        if overrides.get("preset") == "smoke" and "train_files" not in overrides and "val_files" not in overrides:
            hp.train_files, hp.val_files = smoke_shards(hp, rt, run_started)
        train_files, val_files = resolve_files(hp.train_files, "train"), resolve_files(hp.val_files, "val")
        check_val_is_held_out(train_files, val_files)
        token_counts = check_train_data(train_files, hp.vocab_size), sum(read_shard_header(path) for path in val_files)
        train_shards = train_shard_record(train_files)
        check_ranks_read_the_same_shards(train_shards, rt)
        resume = prepare_resume(hp, settings, train_shards, rt)  # after the shards: a checkpoint names the ones it read
        _last_checkpoint = resume.path if resume is not None else None
        return train_trials(hp, settings, overrides, rt, train_files, train_shards, val_files, token_counts, resume, run_started)
    except UserError as error:  # e.g. out of data mid-run: the log says why it ends
        print0(f"error: {error}")
        raise
    except RunStopped as stop:
        if stop.every_rank and not _is_master and _shared_log_path is not None:  # rank 0 may never see it
            with open(_shared_log_path, "a", encoding="utf-8") as f:
                f.write(f"{stop}\n")
        print0(str(stop))
        raise
    finally:
        _log_path = _shared_log_path = None
        release_checkpoint_dir()
        dist.destroy_process_group()


def train_trials(hp: Hyperparameters, settings: dict[str, Any], overrides: dict[str, Any], rt: Runtime,
                 train_files: list[str], train_shards: list[dict[str, Any]], val_files: list[str], token_counts: tuple[int, int],
                 resume: ResumePoint | None, run_started: float) -> RunResult:
    global _log_path, _shared_log_path, _defer_stop
    if hp.seed >= 0:
        torch.manual_seed(hp.seed)
    model = GPT(hp.vocab_size, hp.num_layers, hp.model_dim, hp.head_dim).to(rt.device)
    forward = cast(nn.Module, torch.compile(model, dynamic=False)) if hp.compile else model
    val_inputs, val_targets = load_validation_data(val_files, hp, rt)

    run_id = new_run_id("")
    checkpoint_dir = Path(hp.checkpoint_dir or f"checkpoints/{run_id}")
    source = program_source()
    log_dir_file_sizes = [log_bytes(source, 2 * (hp.train_steps + 1) * hp.num_trials)]  # a train and a val line per step
    checkpoint_file_sizes = estimate_checkpoint_file_sizes(hp, rt.world_size) if hp.checkpoint_every else []
    run_on(_is_master, lambda: prepare_outputs(Path(hp.log_dir) / f"{run_id}.txt", log_dir_file_sizes,
                                               checkpoint_dir if hp.checkpoint_every else None, checkpoint_file_sizes, run_started))
    _log_path = run_on(_is_master, lambda: open_log(hp.log_dir, run_id))
    announce_log(Path(hp.log_dir) / f"{run_id}.txt", rt)
    if _is_master:
        write_log(source)
        print0(SEPARATOR)
        track_lines = [f"shampoo_start_preconditioning_step: {start_preconditioning_step(hp)}"] if hp.matrix_optimizer == "shampoo" else []
        environment = environment_lines(rt, hp, overrides, track_lines, train_files, token_counts[0], val_files, token_counts[1])
        for line in environment + parameter_split_lines(model, hp):
            print0(line)
    _shared_log_path = Path(hp.log_dir) / f"{run_id}.txt"
    if resume is not None:
        print0(f"resumed_from: {resume.path} (run {resume.manifest['run_id']}) at trial {resume.trial} step {resume.step}")
    if hp.checkpoint_every:
        remove_stale_partial_checkpoints(checkpoint_dir)
    print0(SEPARATOR)
    raise_if_any_rank_failed(_log_error)

    synchronize(rt.device)
    t_warmup = time.perf_counter()
    warm_up(forward, val_inputs, val_targets, hp.micro_batch_seqs)
    synchronize(rt.device)
    print0(f"warmup_time: {time.perf_counter() - t_warmup:.1f}s", console=True)

    launch = Launch(hp, settings, rt, run_id, checkpoint_dir, model, forward, val_inputs, val_targets, train_files, train_shards)
    first_trial = resume.trial if resume is not None else 0
    _defer_stop = True  # left set when a trial stops: a signal arriving while the stop is reported waits
    trials = [run_trial(launch, trial, resume if resume is not None and trial == resume.trial else None)
              for trial in range(first_trial, hp.num_trials)]
    _defer_stop = False

    on_cuda = rt.device.type == "cuda"
    allocated = torch.cuda.max_memory_allocated(rt.device) // 2**20 if on_cuda else 0  # no statistics on CPU
    reserved = torch.cuda.max_memory_reserved(rt.device) // 2**20 if on_cuda else 0
    print0(f"peak memory allocated: {allocated} MiB reserved: {reserved} MiB", console=True)
    raise_if_any_rank_failed(None if _log_error is None else _log_error + last_checkpoint_note())  # rank 0's, told to all
    return RunResult(_log_path, model, trials)


def main(argv: Sequence[str] | None = None) -> None:
    global _stop_signal, _defer_stop, _log_error
    _stop_signal, _defer_stop, _log_error = None, False, None
    previous = {signum: signal.getsignal(signum) for signum in STOP_SIGNALS}
    install_stop_handlers()
    try:
        run(sys.argv[1:] if argv is None else argv)
    except UserError as error:  # run() has written the log's line
        report_stop(f"train_gpt_shampoo.py: error: {error}")
        raise SystemExit(2) from None
    except RunStopped as stop:
        report_stop(str(stop), stop.every_rank)
        raise SystemExit(stop.exit_status) from None
    except RuntimeError as error:  # only the collectives' errors for a lost process; any other is raised
        line = lost_process_line(error)
        if line is None:
            raise
        report_stop(line, every_rank=True)
        raise SystemExit(LOST_PROCESS_EXIT_STATUS) from None
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)


if __name__ == "__main__":
    main()
