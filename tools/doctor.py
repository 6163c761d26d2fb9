#!/usr/bin/env python3
"""Pre-flight check of this machine for a training run: one line per check, with the fix when it is not ok.

    python tools/doctor.py [--track 1|3] [--nproc N] [--nnodes N] [--quick] [--name=value ...]
    ./run.sh --check [...]             # the same, for the run that ./run.sh would start

Checks that torch, numpy, Triton, tiktoken and huggingface_hub import (each in a fresh interpreter, so a
broken install is a failed check, not a crash); Python, torch, Triton, the CUDA runtime and driver against
the versions we test; the GPUs (model, count, compute capability, free memory); the attention backend
train_gpt.py will use and why; an all-reduce over the run's processes (NCCL; not with --quick); the shards
the run reads (present, valid, enough tokens; on several machines a fingerprint to compare between them);
torchrun; free disk for logs and checkpoints; and, when we have measured this GPU, the ms/step to expect.
Training flags (--name=value) are parsed by the track's script, and the shards are walked by its own
functions and loader, so the check is of that exact run.

On a machine without a CUDA GPU it checks the CPU smoke run instead (unless --flags-as-given, which
./run.sh --check passes) and prints the smoke commands.
Exit status: 0 when the run would start (no check failed), 1 when a check failed, 2 for a bad command line.
"""

from __future__ import annotations

import argparse
import glob
import hashlib
import importlib
import importlib.metadata
import importlib.util
import json
import math
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Literal, NamedTuple, Sequence

REPO = Path(__file__).resolve().parents[1]

Status = Literal["ok", "warn", "fail", "skip"]

# ---- what we test ----
MIN_PYTHON = (3, 10)
CI_PYTHON = "3.11"
GPU_TORCH = "2.11"  # the H200 runs (CUDA 13.0 build)
CPU_TORCH = "2.13"  # CI (CPU build)
MIN_TORCH = "2.11"
MAX_TORCH = "2.13.0"  # the newest release requirements.txt admits
TRITON = "3.6.0"
TESTED_CUDA = "13.0"
TESTED_DRIVER = "580.159.04"
# The oldest Linux driver of each CUDA major release (within a major, newer runtimes run on it by CUDA's
# minor-version compatibility).
MIN_DRIVER_FOR_CUDA_MAJOR = {12: "525.60.13", 13: "580.65.06"}
FP8_CAPABILITY = (8, 9)  # train_gpt.py's FP8 head needs it; below, the head runs in bf16
BF16_CAPABILITY = (8, 0)
FA3_CAPABILITY = (9, 0)  # FlashAttention-3 kernels are built for Hopper
# README "Install": PyPI's torch 2.11.0 is the CUDA 13.0 build that pins triton 3.6.0; the CPU build of 2.13.0 comes
# from PyTorch's own index, and requirements.txt then keeps it.
CUDA_INSTALL = f"pip install torch=={GPU_TORCH}.0 -r requirements.txt"
CPU_INSTALL = f"pip install torch=={MAX_TORCH} --index-url https://download.pytorch.org/whl/cpu && pip install -r requirements.txt"
# What each package that doctor imports is for; torch and numpy are needed by everything.
PACKAGES = {
    "torch": "the training scripts",
    "numpy": "the training scripts and data tools",
    "triton": "torch.compile and the Triton kernels",
    "tiktoken": "data/fineweb.py",
    "huggingface_hub": "data/cached_fineweb*.py",
}
NOT_INSTALLED = "not installed"
IMPORT_TIMEOUT_S = 120
SHARD_TOKENS = 100_000_000  # one Hub shard of data/cached_fineweb10B.py


@dataclass(frozen=True)
class Track:
    number: int
    script: str
    module: str
    hub_shards: int  # what README's download command fetches for the record run
    # Largest peak memory per GPU measured at the record configuration (bench runs of 2026-11-30 on H200s, 1 and 2 GPUs).
    peak_allocated_mib: int
    peak_reserved_mib: int
    params: int  # of the record model (Track 1: its log's params line; Track 3: the Track 3 GPT)


TRACKS = {
    1: Track(1, "train_gpt.py", "train_gpt", 9, 31_711, 36_740, 268_665_636),
    3: Track(3, "train_gpt_shampoo.py", "train_gpt_shampoo", 22, 34_101, 40_400, 162_354_816),
}

# Expected ms/step at the record configuration, as measured. Conditions: NVIDIA H200 or H100 80GB HBM3,
# torch 2.11.0+cu130, Triton 3.6.0, driver 580.159.04, no FA3, on the docs_proxy shards (Debian documentation in
# the FineWeb format: the same tokens per step, but other document lengths, which change attention's block
# sparsity a little). Each entry says when and at which commit (README Performance); it is the span of the rounds
# of the invocations it names, and calls on other machines of one model differ by a few percent.
# Key: (GPU model as torch names it, track, GPUs, attention backend: Track 1's choice, "sdpa" for Track 3)
# -> (low, high, how it was measured).
MEASURED_ON = "measured on the docs_proxy shards, torch 2.11.0+cu130, Triton 3.6.0, driver 580.159.04"
MEASURED_MS_PER_STEP: dict[tuple[str, int, int, str], tuple[float, float, str]] = {
    ("NVIDIA H200", 1, 1, "flex"): (578.7, 579.1, "1 GPU, 8 micro-steps, FlexAttention; 629e1fa, 2026-12-06"),
    ("NVIDIA H200", 1, 2, "flex"): (0.49 * 578.7, 0.49 * 579.1, "2 GPUs, FlexAttention: 0.49x the 1-GPU time, a ratio measured on 2026-11-30, before the speed work"),
    ("NVIDIA H100 80GB HBM3", 1, 1, "flex"): (605.0, 615.2, "1 GPU, 8 micro-steps, FlexAttention; 629e1fa, 7fb9d5d and 853a9e0, 2026-12-06, six invocations"),
    # flash-attn-4 4.0.0b40 installs quack-kernels 0.6.5, so auto runs the MLP on quack too (--mlp_kernel)
    ("NVIDIA H100 80GB HBM3", 1, 1, "fa4"): (575.8, 592.6, "1 GPU, 8 micro-steps, flash-attn-4 4.0.0b40 and quack-kernels 0.6.5; d54e085, 2026-12-07, three calls"),
    ("NVIDIA H200", 3, 1, "sdpa"): (1422.9, 1422.9, "1 GPU, Shampoo roots on 8 streams, steps 11-150; 2026-11-30"),
    ("NVIDIA H200", 3, 2, "sdpa"): (714.8, 714.8, "2 GPUs, 30 steps; 2026-11-30"),
}
# The MLP kernel each Track 1 entry ran with (--mlp_kernel): quack-kernels comes with flash-attn-4
MEASURED_MLP_KERNEL = {"fa4": "quack"}
# Overrides that leave the work of a step unchanged (paths, logging, how long, checkpoints).
STEP_NEUTRAL_FLAGS = frozenset({
    "train_files", "val_files", "cycle_train_files", "log_dir", "run_id", "seed", "save_checkpoint",
    "checkpoint_every", "checkpoint_dir", "resume", "val_loss_every", "val_every", "val_every_late", "late_frac",
    "num_iterations", "iteration_extension", "train_steps", "warmup_steps", "num_trials", "val_tokens", "val_batch_size",
    "attention_backend", "mlp_kernel",  # the measurements are keyed by the backend and MLP kernel the run will use
})
# `time python <script> --preset=smoke` on this project's 2-core machines (shared with other work), the fastest of
# several runs, 2026-12-04 (README "First 10 minutes").
SMOKE_SECONDS_ON_2_CORES = {1: 15, 3: 6}
NCCL_TIMEOUT_S = 120
NCCL_TENSOR_BYTES = 256 * 2**20


@dataclass(frozen=True)
class Check:
    name: str
    status: Status
    detail: str
    fix: str = ""

    def line(self) -> str:
        text = f"{self.status:<5} {self.name:<10} {self.detail}"
        return f"{text} -> {self.fix}" if self.fix else text


@dataclass(frozen=True)
class Gpu:
    index: int
    name: str
    capability: tuple[int, int]
    free_bytes: int
    total_bytes: int


@dataclass(frozen=True)
class Machine:
    gpus: list[Gpu]  # the CUDA GPUs torch sees (after CUDA_VISIBLE_DEVICES)
    smi_gpu_count: int  # what nvidia-smi lists (0 without nvidia-smi), whatever CUDA_VISIBLE_DEVICES says
    driver: str | None
    cuda_runtime: str | None  # torch.version.cuda: None for a CPU build

    @property
    def gpu_mode(self) -> bool:
        return bool(self.gpus)


@dataclass(frozen=True)
class Plan:
    """The run being checked."""

    track: Track
    nproc: int
    nnodes: int
    hp: Any  # the script's Hyperparameters
    overrides: dict[str, Any]
    gpu_mode: bool

    @property
    def world_size(self) -> int:
        return self.nproc * self.nnodes


def gib(num_bytes: float) -> str:
    return f"{num_bytes / 2**30:.1f} GiB"


def version_of(package: str) -> str | None:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return None


def release(text: str) -> tuple[int, ...] | None:
    """The numeric release of a version string, (2, 11, 0) of 2.11.0+cu130 or (580, 159, 4) of a driver's
    580.159.04; None when it does not start with a number. (Doctor needs nothing beyond the standard library
    and torch, so that it runs before `pip install -r requirements.txt`.)"""
    match = re.match(r"\s*(\d+(?:\.\d+)*)", text)
    return tuple(int(part) for part in match.group(1).split(".")) if match else None


def same_minor(version: tuple[int, ...], tested: str) -> bool:
    return version[:2] == release(tested)


def install_hint(gpu_machine: bool) -> str:
    return CUDA_INSTALL if gpu_machine else CPU_INSTALL


# ---- packages: each imported in a fresh interpreter ----
def import_errors(names: Sequence[str]) -> dict[str, str]:
    """name -> why it does not import, for each package that does not. Each is imported in its own interpreter
    (all at once, from the repository root as the scripts run), so a broken install, which may raise anything or
    kill the interpreter, is reported instead of taking doctor down."""
    errors = {name: NOT_INSTALLED for name in names if importlib.util.find_spec(name) is None}
    children = {
        name: subprocess.Popen([sys.executable, "-c", f"import {name}"], cwd=REPO, stdout=subprocess.DEVNULL,
                               stderr=subprocess.PIPE, text=True)
        for name in names if name not in errors
    }
    for name, child in children.items():
        try:
            _, stderr = child.communicate(timeout=IMPORT_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            child.kill()
            child.wait()
            errors[name] = f"its import hangs (no result after {IMPORT_TIMEOUT_S} s)"
            continue
        if child.returncode != 0:
            lines = [line.strip() for line in stderr.splitlines() if line.strip()]
            errors[name] = f"its import fails: {lines[-1]}" if lines else f"its import kills the interpreter (exit status {child.returncode})"
    return errors


def is_import_error(error: str) -> bool:
    """True when the import raised ImportError (or ModuleNotFoundError), which the scripts treat as 'no Triton'."""
    return error == NOT_INSTALLED or re.match(r"its import fails: (ImportError|ModuleNotFoundError)\b", error) is not None


def stops_doctor(name: str, error: str) -> bool:
    """Whether the training scripts (which doctor imports) cannot even be imported with this package as it is."""
    return name in ("torch", "numpy") or (name == "triton" and not is_import_error(error))


def check_broken_package(name: str, error: str, gpu_machine: bool) -> Check:
    """The line of a package that does not import."""
    install = install_hint(gpu_machine)
    if name in ("torch", "numpy"):
        return Check(name, "fail", f"{error}; {PACKAGES[name]} need it", install)
    if name == "triton":
        reinstall = f"pip install --force-reinstall triton=={required_triton() or TRITON}"
        if error == NOT_INSTALLED and not gpu_machine:
            return Check(name, "ok", "not installed (not needed on CPU)")
        if gpu_machine:
            return Check(name, "fail", f"{error}; {PACKAGES[name]} need it on GPUs", reinstall)
        if not is_import_error(error):
            return Check(name, "fail", f"{error}; train_gpt.py imports it at start", f"{reinstall}, or pip uninstall triton (not needed on CPU)")
        return Check(name, "warn", f"{error}; the scripts run without it on CPU", f"{reinstall}, or pip uninstall triton")
    return Check(name, "warn", f"{error}; {PACKAGES[name]} needs it (training does not)", install)


def check_data_package(name: str, errors: dict[str, str], gpu_machine: bool) -> Check:
    if name in errors:
        return check_broken_package(name, errors[name], gpu_machine)
    return Check(name, "ok", f"{version_of(name) or 'version unknown'} ({PACKAGES[name]})")


def gpus_listed() -> bool:
    """nvidia-smi lists a GPU: whether this is a CUDA machine, known before torch imports."""
    return any(line.startswith("GPU ") for line in (_command_output(["nvidia-smi", "-L"]) or "").splitlines())


# ---- machine facts ----
def _command_output(args: list[str]) -> str | None:
    if shutil.which(args[0]) is None:
        return None
    try:
        result = subprocess.run(args, capture_output=True, text=True, timeout=30)
    except subprocess.TimeoutExpired:
        return None
    return result.stdout if result.returncode == 0 else None


def read_machine() -> Machine:
    import torch

    listing = _command_output(["nvidia-smi", "-L"]) or ""
    driver = (_command_output(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"]) or "").strip()
    gpus = []
    if torch.cuda.is_available():
        for index in range(torch.cuda.device_count()):
            props = torch.cuda.get_device_properties(index)
            free, total = torch.cuda.mem_get_info(index)
            gpus.append(Gpu(index, props.name, (props.major, props.minor), free, total))
    smi_count = sum(1 for line in listing.splitlines() if line.startswith("GPU "))
    return Machine(gpus, smi_count, driver.splitlines()[0] if driver else None, torch.version.cuda)


def largest_usable(count: int) -> int:
    """The largest process count that divides the record batch (1, 2, 4 or 8) and is at most count."""
    return max((n for n in (1, 2, 4, 8) if n <= count), default=1)


# ---- the plan: the track's own parser reads the training flags ----
class PlanError(Exception):
    """The training flags or the process counts do not describe a run the script accepts."""


def training_module(track: Track) -> Any:
    if str(REPO) not in sys.path:
        sys.path.insert(0, str(REPO))
    return importlib.import_module(track.module)


def make_plan(track: Track, nproc: int, nnodes: int, flags: list[str], gpu_mode: bool, flags_as_given: bool = False) -> Plan:
    module = training_module(track)
    argv = list(flags)
    if not gpu_mode and not flags_as_given and not any(flag.startswith("--preset") for flag in argv):
        argv.insert(0, "--preset=smoke")  # on CPU the run that can start is the smoke run
    try:
        hp, overrides = module.parse_args(argv)
    except module.UserError as error:
        raise PlanError(f"{track.script}: {error}") from None
    return Plan(track, nproc, nnodes, hp, overrides, gpu_mode)


# ---- checks ----
def is_smoke_run(plan: Plan) -> bool:
    return plan.overrides.get("preset") == "smoke"


def check_python() -> Check:
    version = ".".join(map(str, sys.version_info[:3]))
    if sys.version_info[:2] < MIN_PYTHON:
        return Check("python", "fail", f"{version}: the scripts need Python {'.'.join(map(str, MIN_PYTHON))} or newer",
                     f"use Python {CI_PYTHON} (what CI tests)")
    return Check("python", "ok", f"{version} (CI tests {CI_PYTHON})")


def check_torch(machine: Machine) -> Check:
    import torch

    text = torch.__version__
    version = release(text)
    tested = GPU_TORCH if machine.gpu_mode else CPU_TORCH
    where = "GPU runs" if machine.gpu_mode else "CPU runs and CI"
    install = install_hint(machine.gpu_mode)
    if version is None or version < release(MIN_TORCH):
        return Check("torch", "fail", f"{text}: the scripts need torch {MIN_TORCH} or newer (FlexAttention, torch.compile)", install)
    if not same_minor(version, tested) or version > release(MAX_TORCH):
        return Check("torch", "warn", f"{text}: untested for {where} (we use {tested})", install)
    return Check("torch", "ok", f"{text} (we use {tested} for {where})")


def required_triton() -> str | None:
    """The Triton version the installed torch wheel pins (CUDA builds do; CPU builds need none)."""
    try:
        requires = importlib.metadata.requires("torch") or []
    except importlib.metadata.PackageNotFoundError:  # a torch built from source without metadata
        return None
    for text in requires:  # e.g. 'triton==3.6.0; platform_system == "Linux"' (met wherever CUDA torch runs)
        match = re.match(r"\s*(?:pytorch-)?triton\s*==\s*([0-9][^\s;,]*)\s*(;.*)?$", text)
        if match and "extra" not in (match.group(2) or ""):
            return match.group(1)
    return None


def check_triton(machine: Machine, import_error: str | None = None) -> Check:
    import torch

    if import_error is not None and import_error != NOT_INSTALLED:
        return check_broken_package("triton", import_error, machine.gpu_mode)
    installed = version_of("triton") or version_of("pytorch-triton")
    pinned = required_triton()
    fix = f"pip install triton=={pinned or TRITON}"
    if installed is None:
        if machine.gpu_mode:
            return Check("triton", "fail", "not installed: torch.compile and the Newton-Schulz kernels need it", fix)
        return Check("triton", "ok", "not installed (not needed on CPU)")
    if pinned is not None and release(installed) != release(pinned):
        return Check("triton", "fail", f"{installed}, but torch {torch.__version__} was built for {pinned}", fix)
    if installed != TRITON:
        return Check("triton", "warn", f"{installed}: we test {TRITON}", f"pip install triton=={TRITON}")
    return Check("triton", "ok", f"{installed} (we test {TRITON})")


def check_cuda(machine: Machine) -> Check:
    import torch

    hidden = os.environ.get("CUDA_VISIBLE_DEVICES", None) in ("", "-1")
    if not machine.gpu_mode:
        if machine.smi_gpu_count and not hidden:
            if machine.cuda_runtime is None:
                return Check("cuda", "fail", f"nvidia-smi lists {machine.smi_gpu_count} GPUs, but torch {torch.__version__} is a CPU build",
                             f"install the CUDA build: {CUDA_INSTALL}")
            return Check("cuda", "fail", f"nvidia-smi lists {machine.smi_gpu_count} GPUs, but torch (CUDA {machine.cuda_runtime}) finds none; "
                         f"driver {machine.driver or 'unknown'}", "a driver too old for this CUDA runtime? install a torch build for your driver's CUDA")
        hidden_note = f" (CUDA_VISIBLE_DEVICES hides the {machine.smi_gpu_count} GPUs)" if hidden and machine.smi_gpu_count else ""
        return Check("cuda", "skip", f"no CUDA GPU visible: CPU mode{hidden_note}")
    detail = f"runtime {machine.cuda_runtime}, driver {machine.driver or 'unknown (no nvidia-smi)'}"
    runtime, driver = release(machine.cuda_runtime or ""), release(machine.driver or "")
    minimum = MIN_DRIVER_FOR_CUDA_MAJOR.get(runtime[0]) if runtime else None
    if driver and minimum and driver < release(minimum):
        return Check("cuda", "fail", f"{detail}: CUDA {runtime[0]}.x needs driver {minimum} or newer",
                     "update the driver, or install a torch build for an older CUDA")
    tested = f"we test CUDA {TESTED_CUDA} with driver {TESTED_DRIVER}"
    if machine.cuda_runtime != TESTED_CUDA:
        return Check("cuda", "warn", f"{detail} ({tested})")
    return Check("cuda", "ok", f"{detail} ({tested})")


def check_processes(plan: Plan) -> Check:
    world = f"{plan.nnodes} nodes x {plan.nproc} = {plan.world_size}" if plan.nnodes > 1 else str(plan.nproc)
    if plan.world_size not in (1, 2, 4, 8):
        per_node = [n for n in (1, 2, 4, 8) if n % plan.nnodes == 0 and n // plan.nnodes <= plan.nproc]
        fix = f"use --nproc {per_node[-1] // plan.nnodes}" if per_node else "use 1, 2, 4 or 8 processes in all"
        return Check("processes", "fail", f"{world} processes: the record batch splits over 1, 2, 4 or 8", fix)
    backend = "NCCL" if plan.gpu_mode else "gloo"
    accumulation = 8 // plan.world_size
    return Check("processes", "ok", f"{world} process{'es' if plan.world_size > 1 else ''} ({backend}), "
                 f"{accumulation} micro-step{'s' if accumulation > 1 else ''} each per step")


def check_gpus(machine: Machine, plan: Plan) -> Check:
    if not machine.gpu_mode:
        return Check("gpus", "skip", "none visible: CPU mode")
    gpus = machine.gpus
    names = sorted({gpu.name for gpu in gpus})
    lowest = min(gpus, key=lambda gpu: gpu.capability).capability
    free = min(gpu.free_bytes for gpu in gpus[: plan.nproc])
    detail = f"{len(gpus)} x {' + '.join(names)}, sm_{lowest[0]}{lowest[1]}, least free {gib(free)} of {gib(gpus[0].total_bytes)}"
    if plan.nproc > len(gpus):
        return Check("gpus", "fail", f"{detail}: --nproc {plan.nproc} is more than the {len(gpus)} visible",
                     f"use --nproc {largest_usable(len(gpus))} (or make more GPUs visible)")
    peak, reserved = plan.track.peak_allocated_mib * 2**20, plan.track.peak_reserved_mib * 2**20
    if work_changing_flags(plan):  # the measured peaks are the record configuration's
        peak = reserved = 0
    if free < peak:
        return Check("gpus", "fail", f"{detail}: the record configuration peaked at {gib(peak)} allocated",
                     "free the GPUs (nvidia-smi shows who holds them) or use bigger ones")
    if lowest < BF16_CAPABILITY:
        return Check("gpus", "warn", f"{detail}: below sm_80 (no bf16 tensor cores): untested and slow")
    if len(names) > 1:
        return Check("gpus", "warn", f"{detail}: mixed models; the slowest sets the pace", "CUDA_VISIBLE_DEVICES=<same model>")
    if free < reserved:
        return Check("gpus", "warn", f"{detail}: the record configuration reserved up to {gib(reserved)}: tight")
    if plan.track.number == 1 and lowest < FP8_CAPABILITY:
        return Check("gpus", "warn", f"{detail}: below sm_89, so train_gpt.py's head runs in bf16, not the record's FP8")
    return Check("gpus", "ok", detail)


def _fa3_import_error() -> str | None:
    """Why flash_attn_interface does not import, or None when it does."""
    try:
        importlib.import_module("flash_attn_interface")
    except ImportError as error:
        return str(error) or type(error).__name__
    return None


def _tiny_windowed_call_fails(device_index: int, attend: Callable[..., object], also: tuple[type[Exception], ...] = ()) -> str | None:
    """Runs attend(q, k, v, cu_seqlens) once on two 128-token documents of this GPU; the error's first line when
    it cannot (a RuntimeError or TypeError, or one of `also`)."""
    import torch

    device = torch.device("cuda", device_index)
    q, k, v = (torch.randn(256, 2, 64, device=device, dtype=torch.bfloat16) for _ in range(3))
    cu_seqlens = torch.tensor([0, 128, 256], device=device, dtype=torch.int32)
    try:
        attend(q, k, v, cu_seqlens)
        torch.cuda.synchronize(device)
    except (RuntimeError, TypeError, *also) as error:  # "no kernel image", an architecture check; another signature
        return (str(error).strip().splitlines() or [type(error).__name__])[0]
    return None


def _fa3_runs(device_index: int) -> str | None:
    """FA3's varlen kernel on a tiny input (_tiny_windowed_call_fails)."""
    from flash_attn_interface import flash_attn_varlen_func

    return _tiny_windowed_call_fails(device_index, lambda q, k, v, cu: flash_attn_varlen_func(
        q, k, v, cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=128, max_seqlen_k=128, causal=True, window_size=(64, 0)))


def _varlen_runs(device_index: int) -> str | None:
    """torch's varlen_attn with a window on a tiny input (_tiny_windowed_call_fails); a torch without window_size fails."""
    from torch.nn.attention.varlen import varlen_attn

    return _tiny_windowed_call_fails(device_index, lambda q, k, v, cu: varlen_attn(q, k, v, cu, cu, 128, 128, window_size=(64, 0)))


def _fa4_runs(device_index: int) -> str | None:
    """train_gpt.py's fa4_forward (flash-attn-4's kernels) on a tiny input (_tiny_windowed_call_fails)."""
    tg = training_module(TRACKS[1])
    # flash-attn-4 checks the architecture and head sizes with assert; its kernels compile on the first call
    return _tiny_windowed_call_fails(device_index, lambda q, k, v, cu: tg.fa4_forward(q, k, v, cu, 128, 0.125, 64), also=(AssertionError,))


class TriedKernel(NamedTuple):
    """A backend other than FA3 and flex whose kernel doctor tries on a tiny input: what runs it, the trial (looked up
    when called, so that tests can stand in for it) and the fix when that fails ({tested}: train_gpt.FLASH_ATTN_4_TESTED)."""

    kernels: str
    runs: Callable[[int], str | None]
    fix: str


TRIED_KERNELS = {
    "varlen": TriedKernel("torch's varlen_attn, FlashAttention-2 kernels", lambda index: _varlen_runs(index), "pass --attention_backend=flex"),
    "fa4": TriedKernel("flash-attn-4's kernels", lambda index: _fa4_runs(index),
                       "pass --attention_backend=flex, or (re)install flash-attn-4 {tested} (README.md#install)"),
}


def _why_not_fa4(tg: Any, capability: tuple[int, int]) -> str:
    """Why auto did not take fa4 (train_gpt.choose_attention_backend's rule)."""
    version = tg.flash_attn_4_version()
    if version is None:
        return "flash-attn-4 is not installed"
    if capability < (9, 0):
        return f"flash-attn-4's kernels need sm_90 or newer, this GPU is sm_{capability[0]}{capability[1]}"
    if version != tg.FLASH_ATTN_4_TESTED:
        return f"flash-attn-4 {version} is not the tested {tg.FLASH_ATTN_4_TESTED} (--attention_backend=fa4 takes it anyway)"
    return f"fa4 is measured on sm_90 only, this GPU is sm_{capability[0]}{capability[1]} (--attention_backend=fa4 takes it anyway)"


def first_device(machine: Machine) -> tuple[Any, tuple[int, int] | None]:
    """The device train_gpt.py's rank 0 trains on and its compute capability (None on CPU), for its choose functions."""
    import torch

    return (torch.device("cuda", 0), machine.gpus[0].capability) if machine.gpu_mode else (torch.device("cpu"), None)


def check_attention(machine: Machine, plan: Plan, quick: bool) -> Check:
    if plan.track.number != 1:
        return Check("attention", "skip", "Track 3 uses PyTorch's scaled_dot_product_attention")
    tg = training_module(plan.track)
    requested = plan.hp.attention_backend
    device, capability = first_device(machine)
    try:
        backend = tg.choose_attention_backend(requested, device, capability)  # train_gpt.py's own decision
    except tg.UserError as error:  # its line says what to install; flex runs on every GPU (auto may take a broken fa4)
        return Check("attention", "fail", str(error), "pass --attention_backend=" + ("flex" if machine.gpu_mode else "auto"))
    chosen = f"train_gpt.py will use {backend}"
    if not machine.gpu_mode:
        return Check("attention", "ok", f"{chosen}: a CPU run (FlexAttention has no CPU backward)")
    if backend == "flex":
        why = "asked for" if requested == "flex" else f"FlashAttention-3 does not import ({_fa3_import_error()}) and {_why_not_fa4(tg, capability)}"
        return Check("attention", "ok", f"{chosen} (FlexAttention): {why}; our H200 measurements use it too")
    if backend in TRIED_KERNELS:  # tried on a tiny input unless --quick
        tried = TRIED_KERNELS[backend]
        fix = tried.fix.format(tested=tg.FLASH_ATTN_4_TESTED)
        why = "asked for" if requested == backend else f"flash-attn-4 {tg.FLASH_ATTN_4_TESTED} is installed and FA3 is not, on sm_90 (measured faster than flex on an H100)"
        chosen += f" ({tried.kernels}): {why}"
        status: Status = "ok"
        if backend == "fa4" and (version := tg.flash_attn_4_version()) != tg.FLASH_ATTN_4_TESTED:
            chosen += f"; flash-attn-4 {version} is installed, and {tg.FLASH_ATTN_4_TESTED} is the version its private functions were tested with"
            status = "warn"
        if quick:
            return Check("attention", status, f"{chosen} (kernel not tried with --quick)", fix if status == "warn" else "")
        failure = tried.runs(0)
        if failure is not None:
            return Check("attention", "fail", f"{chosen}, but its kernel fails on this GPU (sm_{capability[0]}{capability[1]}): {failure}", fix)
        return Check("attention", status, f"{chosen}, and its kernel runs on this GPU", fix if status == "warn" else "")
    if backend == "reference":
        return Check("attention", "warn", f"{chosen}: asked for; a dense mask, far slower than flex", "drop --attention_backend")
    origin = getattr(sys.modules.get("flash_attn_interface"), "__file__", "?")
    why = f"flash_attn_interface imports ({origin})" if requested == "auto" else "asked for"
    if quick:
        if capability != FA3_CAPABILITY:
            return Check("attention", "warn", f"{chosen} (FA3): {why}, but FA3 is built for sm_90 and this GPU is "
                         f"sm_{capability[0]}{capability[1]} (kernel not tried with --quick)", "pass --attention_backend=flex")
        return Check("attention", "ok", f"{chosen} (FA3): {why}, sm_90 (kernel not tried with --quick)")
    failure = _fa3_runs(0)
    if failure is not None:
        return Check("attention", "fail", f"{chosen} (FA3): {why}, but its kernel fails on this GPU "
                     f"(sm_{capability[0]}{capability[1]}): {failure}", "pass --attention_backend=flex, or install an FA3 built for this GPU")
    return Check("attention", "ok", f"{chosen} (FA3): {why}, and its kernel runs on this GPU")


def _why_not_quack(tg: Any, capability: tuple[int, int]) -> str:
    """Why auto did not take the quack MLP kernel (train_gpt.choose_mlp_kernel's rule)."""
    version = tg.quack_version()
    if version is None:
        return "quack-kernels is not installed (flash-attn-4 brings it)"
    if version != tg.QUACK_TESTED:
        return f"quack-kernels {version} is not the tested {tg.QUACK_TESTED}"
    return f"the quack kernel is measured on sm_90 only, this GPU is sm_{capability[0]}{capability[1]}"


def check_mlp_kernel(machine: Machine, plan: Plan) -> Check | None:
    """Track 1's --mlp_kernel as train_gpt.py resolves it here (its refusals are one line each)."""
    if plan.track.number != 1:
        return None
    tg = training_module(plan.track)
    requested = plan.hp.mlp_kernel
    device, capability = first_device(machine)
    try:
        kernel = tg.choose_mlp_kernel(requested, device, capability)  # train_gpt.py's own decision
    except tg.UserError as error:
        return Check("mlp", "fail", str(error), "pass --mlp_kernel=triton" if machine.gpu_mode else "drop --mlp_kernel")
    chosen = f"train_gpt.py will use {kernel}"
    if not machine.gpu_mode:
        return Check("mlp", "ok", f"{chosen}: a CPU run, where its wrapper runs the eager formula")
    if kernel == "quack":
        why = "asked for" if requested == "quack" else f"quack-kernels {tg.QUACK_TESTED} is installed, on sm_90 (measured faster than the Triton kernel on an H100)"
        return Check("mlp", "ok", f"{chosen} (quack-kernels' GEMMs with train_gpt.py's ReLU² epilogues): {why}")
    why = "asked for" if requested == "triton" else _why_not_quack(tg, capability)
    return Check("mlp", "ok", f"{chosen} (the Triton kernel, the same bytes): {why}")


def check_shampoo(plan: Plan) -> Check | None:
    if plan.track.number != 3:
        return None
    if plan.hp.matrix_optimizer != "shampoo":
        return Check("shampoo", "skip", f"--matrix_optimizer={plan.hp.matrix_optimizer}: not used")
    tgs = training_module(plan.track)
    if tgs.SHAMPOO_IMPORT_ERROR is not None:
        return Check("shampoo", "fail", f"distributed_shampoo does not import: {tgs.SHAMPOO_IMPORT_ERROR}",
                     "run from the repository root, which holds distributed_shampoo/")
    return Check("shampoo", "ok", f"distributed_shampoo from {tgs.SHAMPOO_PACKAGE_DIR}")


# ---- all-reduce over the run's processes ----
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def all_reduce_worker(rank: int, world_size: int, port: int, backend: str, numel: int) -> None:
    """One process of the all-reduce check: prints a JSON line with its result (run by all_reduce)."""
    from datetime import timedelta

    import torch
    import torch.distributed as dist

    device = torch.device("cuda", rank) if backend == "nccl" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size,
                            timeout=timedelta(seconds=NCCL_TIMEOUT_S), **({"device_id": device} if device.type == "cuda" else {}))
    tensor = torch.full((numel,), float(rank + 1), device=device)
    dist.all_reduce(tensor)  # also the warm-up: NCCL sets up its channels here
    expected = world_size * (world_size + 1) / 2
    correct = bool((tensor == expected).all().item())
    repeats = 5
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    dist.barrier()
    start = time.perf_counter()
    for _ in range(repeats):
        dist.all_reduce(tensor)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    seconds = (time.perf_counter() - start) / repeats
    dist.destroy_process_group()
    bus_bytes = 2 * (world_size - 1) / world_size * tensor.numel() * tensor.element_size()  # the ring's traffic per rank
    print(json.dumps({"rank": rank, "correct": correct, "bus_gb_per_s": bus_bytes / seconds / 1e9}), flush=True)


def all_reduce(world_size: int, backend: str, numel: int, timeout_s: float = NCCL_TIMEOUT_S) -> tuple[bool, str]:
    """Starts world_size worker processes on this machine; (passed, one-line summary)."""
    port = _free_port()
    workers = [
        subprocess.Popen([sys.executable, str(Path(__file__).resolve()), "--all-reduce-worker", f"{rank},{world_size},{port},{backend},{numel}"],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        for rank in range(world_size)
    ]
    deadline = time.monotonic() + timeout_s
    outputs = []
    try:
        for worker in workers:
            outputs.append(worker.communicate(timeout=max(deadline - time.monotonic(), 0.1)))
    except subprocess.TimeoutExpired:
        for worker in workers:
            worker.kill()
            worker.wait()
        return False, f"no result after {timeout_s:.0f} s (a hang: a peer-to-peer path or network interface that does not work)"
    results = []
    for worker, (stdout, stderr) in zip(workers, outputs):
        if worker.returncode != 0:
            last = [line for line in stderr.strip().splitlines() if line.strip()] or [f"exit status {worker.returncode}"]
            return False, f"rank {workers.index(worker)} failed: {last[-1].strip()}"
        results.append(json.loads(stdout.strip().splitlines()[-1]))
    if not all(result["correct"] for result in results):
        return False, "wrong sums: the processes disagree"
    slowest = min(result["bus_gb_per_s"] for result in results)
    return True, f"{world_size} processes, {numel * 4 / 2**20:.0f} MiB: correct sums, bus bandwidth {slowest:.0f} GB/s"


def check_all_reduce(machine: Machine, plan: Plan, quick: bool) -> Check:
    if not machine.gpu_mode:
        return Check("nccl", "skip", "CPU mode (the smoke runs use gloo)")
    if plan.nproc < 2:
        return Check("nccl", "skip", "1 process per node: nothing to reduce on this machine")
    if quick:
        return Check("nccl", "skip", "--quick")
    passed, outcome = all_reduce(plan.nproc, "nccl", NCCL_TENSOR_BYTES // 4)
    if not passed:
        return Check("nccl", "fail", f"all-reduce on GPUs 0-{plan.nproc - 1}: {outcome}",
                     "rerun with NCCL_DEBUG=INFO for NCCL's own log; nvidia-smi topo -m shows the links; NCCL_P2P_DISABLE=1 tells if P2P is the cause")
    return Check("nccl", "ok", f"all-reduce on GPUs 0-{plan.nproc - 1}: {outcome}")


def check_torchrun(plan: Plan) -> Check:
    path = shutil.which("torchrun")
    if path is not None:
        return Check("torchrun", "ok", path)
    fix = "activate the environment torch is installed in (its bin/ holds torchrun), or launch with python -m torch.distributed.run"
    if plan.gpu_mode or plan.world_size > 1:
        return Check("torchrun", "fail", "not on PATH; run.sh launches it", fix)
    return Check("torchrun", "warn", "not on PATH (the 1-process smoke run does not need it)", fix)


# ---- data ----
@dataclass(frozen=True)
class DataPlan:
    """What the run's loader gets out of the training shards, walked the way the script's loader walks them."""

    files: list[Any]
    tokens: int  # in all training shards (headers)
    val_tokens: int
    batches_needed: int  # loader batches the run draws
    batches_found: int  # up to batches_needed
    shards_read: int  # shards the walk went through to find them
    tokens_read: int  # tokens of those shards


def loader_batches_needed(plan: Plan) -> int:
    """Track 1 draws one batch per micro-step (8 / world size per step); Track 3 one per step (every trial
    starts again at the first shard, so trials need no more)."""
    if plan.track.number == 1:
        return plan.hp.train_steps * (8 // plan.world_size)
    return plan.hp.train_steps


def nominal_tokens(plan: Plan) -> int:
    hp = plan.hp
    return hp.train_steps * (hp.train_batch_size if plan.track.number == 1 else 8 * hp.micro_batch_seqs * hp.seq_len)


def _walk_track1(plan: Plan, files: list[str], needed: int) -> tuple[int, int, int]:
    """train_gpt.py's BOS-aligned planning over each shard in turn (documents cut at train_max_seq_len, each
    row's remainder dropped, a shard's leftover documents skipped), until `needed` batches are found."""
    tg, hp = training_module(plan.track), plan.hp
    local = hp.train_batch_size // ((8 // plan.world_size) * plan.world_size)
    found = tokens_read = 0
    for number, path in enumerate(files, start=1):
        tokens = tg.read_shard(path, hp.vocab_size)  # also checks every token id, as the loader will
        bos, cursor = tg.bos_positions(tokens, hp.bos_token), 0
        tokens_read += tokens.size
        sizes = dict(num_tokens_local=local, max_seq_len=hp.train_max_seq_len, world_size=plan.world_size, index_is_complete=True)
        while found < needed and (planned := tg.plan_segments(bos, tokens.size, cursor, **sizes)):
            cursor, found = planned[1], found + 1
        if found >= needed:
            return found, number, tokens_read
    return found, len(files), tokens_read


def _walk_track3(plan: Plan, files: list[Any], needed: int) -> tuple[int, int, int]:
    """train_gpt_shampoo.py's own TokenLoader, over one shard at a time: the loader starts each shard at its first
    token and leaves its tail, so a shard's batches do not depend on the shards before it. The loader also checks
    every token id of the shards it reads, as the run's will."""
    import torch

    tgs, hp = training_module(plan.track), plan.hp
    batch_tokens = 8 * hp.micro_batch_seqs * hp.seq_len  # as run_trial builds the training loader
    found = tokens_read = 0
    for number, path in enumerate(files, start=1):
        loader = tgs.TokenLoader([path], batch_tokens=batch_tokens, seq_len=hp.seq_len, rank=0, world_size=plan.world_size,
                                 vocab_size=hp.vocab_size, device=torch.device("cpu"))
        tokens_read += len(loader.tokens)
        while found < needed:
            try:
                loader.next_batch()
            except tgs.UserError:  # a one-shard loader that does not cycle: this shard holds no further batch
                break
            found += 1
        if found >= needed:
            return found, number, tokens_read
    return found, len(files), tokens_read


def _holds_bos(plan: Plan, path: str) -> bool:
    """Whether a Track 1 training shard holds a BOS token (read again: asked only when the walk found no batch)."""
    tg = training_module(plan.track)
    return bool(tg.bos_positions(tg.read_shard(path, plan.hp.vocab_size), plan.hp.bos_token).size)


def _validate_data(plan: Plan) -> DataPlan:
    """The checks the script makes before it starts, then the loader's walk; raises the script's UserError."""
    module, hp = training_module(plan.track), plan.hp
    needed = loader_batches_needed(plan)
    if plan.track.number == 1:
        train_files = module.resolve_files(hp.train_files, "train")
        val_files = module.resolve_files(hp.val_files, "val")
        module.check_val_is_held_out(train_files, val_files)
        train_tokens = module.check_train_data(train_files, hp.vocab_size)
        val_tokens = module.check_val_data(val_files, val_tokens=hp.val_tokens, val_batch_size=hp.val_batch_size,
                                           grad_accum_steps=8 // plan.world_size, vocab_size=hp.vocab_size)
        return DataPlan(train_files, train_tokens, val_tokens, needed, *_walk_track1(plan, train_files, needed))
    import torch

    module.check_batch_geometry(hp, plan.world_size)
    train_files, val_files = module.resolve_files(hp.train_files, "train"), module.resolve_files(hp.val_files, "val")
    module.check_val_is_held_out(train_files, val_files)
    train_tokens = module.check_train_data(train_files, hp.vocab_size)
    module.load_validation_data(val_files, hp, module.Runtime(0, plan.world_size, 0, torch.device("cpu")))
    val_tokens = sum(module.read_shard_header(path) for path in val_files)
    return DataPlan(train_files, train_tokens, val_tokens, needed, *_walk_track3(plan, train_files, needed))


def shards_to_download(plan: Plan, data: DataPlan | None) -> int:
    """Hub shards (100M tokens each) that hold the run: from the walk's tokens per batch when there is one, else
    from the nominal tokens (Track 1 adds a shard for what BOS alignment drops; Track 3's loader drops less than a
    batch per shard)."""
    spare = 1 if plan.track.number == 1 else 0
    if data is not None and data.batches_found:
        count = math.ceil(data.batches_needed * data.tokens_read / data.batches_found / SHARD_TOKENS) + spare
    else:
        count = math.ceil(nominal_tokens(plan) / SHARD_TOKENS) + spare
    return max(plan.track.hub_shards, count)


def _download_fix(plan: Plan, data: DataPlan | None) -> str:
    if "train_files" in plan.overrides or "val_files" in plan.overrides or os.environ.get("DATA_PATH"):
        return "add shards (or check --train_files and DATA_PATH); --cycle_train_files=true repeats them (never a record)"
    return f"python data/cached_fineweb10B.py {shards_to_download(plan, data)}"


def _with_data_path(pattern: str) -> str:
    return os.path.join(os.environ["DATA_PATH"], pattern) if os.environ.get("DATA_PATH") else pattern


def _matches(pattern: str) -> bool:
    return bool(glob.glob(_with_data_path(pattern)))


def fingerprint(paths: Sequence[str]) -> str:
    """A digest of the files' names and bytes: equal on two machines exactly when they hold the same shards."""
    digest = hashlib.sha256()
    for path in paths:
        digest.update(os.path.basename(path).encode() + b"\0")
        with open(path, "rb") as f:
            for block in iter(lambda: f.read(1 << 24), b""):
                digest.update(block)
    return digest.hexdigest()[:16]


def _writable(folder: Path) -> Path | None:
    """The folder's nearest existing ancestor when this process cannot create files there, else None."""
    existing = _existing_ancestor(folder)
    return None if os.access(existing, os.W_OK | os.X_OK) else existing


def check_smoke_shards(plan: Plan) -> Check:
    """The smoke presets write their shards where the script runs: train_gpt.py into --log_dir, train_gpt_shampoo.py
    into DATA_PATH/data/smoke/v<vocab_size>. With several machines each machine writes its own copy (deterministic, so the same
    bytes everywhere); nothing needs copying between them."""
    if plan.track.number == 1:
        folder, where = Path(plan.hp.log_dir), f"{plan.hp.log_dir}/smoke_shards_*/"
    else:
        folder = Path(os.environ.get("DATA_PATH", ""), "data", "smoke", f"v{plan.hp.vocab_size}")
        where = f"{folder}/"
    blocked = _writable(folder)
    if blocked is not None:
        fix = "pass a --log_dir you can write to" if plan.track.number == 1 else "run from a folder you can write to, or set DATA_PATH"
        return Check("shards", "fail", f"the smoke preset writes its shards into {where}, but {blocked} is not writable", fix)
    machines = f", on each of the {plan.nnodes} machines (the same bytes on each)" if plan.nnodes > 1 else ""
    return Check("shards", "ok", f"the smoke preset writes its own synthetic shards ({where}){machines}")


def check_shards(plan: Plan) -> Check:
    if is_smoke_run(plan) and "train_files" not in plan.overrides and "val_files" not in plan.overrides:
        return check_smoke_shards(plan)
    module = training_module(plan.track)
    missing = [pattern for pattern in (plan.hp.train_files, plan.hp.val_files) if not _matches(pattern)]
    if missing:
        return Check("shards", "fail", f"no files match {', '.join(repr(_with_data_path(p)) for p in missing)}", _download_fix(plan, None))
    try:
        data = _validate_data(plan)
    except module.UserError as error:  # the script's own words: the file, the rule, the fix
        return Check("shards", "fail", str(error))
    unit = "micro-batches" if plan.track.number == 1 else "batches"
    detail = (f"{len(data.files)} train shards, {data.tokens:,} tokens, {data.val_tokens:,} validation tokens, valid; "
              f"the run's {data.batches_needed:,} {unit} ({plan.hp.train_steps} steps)")
    compare = ""
    if plan.nnodes > 1:  # every machine reads its own copy: they must be the same files
        read = [*data.files[: data.shards_read], *module.resolve_files(plan.hp.val_files, "val")]
        compare = f"; fingerprint {fingerprint(read)}: run this check on every machine, the fingerprints must match"
    if data.batches_found >= data.batches_needed:
        return Check("shards", "ok", f"{detail} fit in the first {data.shards_read} ({data.tokens_read:,} tokens){compare}")
    why = ("documents are cut at --train_max_seq_len and the rest of a batch's last one is dropped"
           if plan.track.number == 1 else "a shard's tail shorter than a batch is skipped")
    short = f"{detail}: the shards hold {data.batches_found:,} ({why})"
    read = data.files[: data.shards_read]
    if plan.track.number == 1 and not data.batches_found and not any(_holds_bos(plan, path) for path in read):
        # the run's loader stops with this line: no document starts in these shards, so more of them would not help
        return Check("shards", "fail", module.no_bos_message(read, plan.hp.bos_token))
    if plan.hp.cycle_train_files and data.batches_found > 0:
        return Check("shards", "warn", f"{short}; cycle_train_files repeats them (never a record){compare}")
    return Check("shards", "fail", short, _download_fix(plan, data))


# ---- disk ----
def _existing_ancestor(path: Path) -> Path:
    path = path.resolve()
    while not path.exists():
        path = path.parent
    return path


def checkpoint_bytes(plan: Plan) -> int:
    """Estimated size of one checkpoint of the record model: fp32 weights and two optimizer moments per
    parameter; Track 3 adds Shampoo's factor matrices and their roots (two of each side's size per block matrix)."""
    size = 12 * plan.track.params
    if plan.track.number == 3:
        dim, layers = 768, 12
        per_layer = 4 * 2 * (dim * dim + dim * dim) + 2 * 2 * (dim * dim + (4 * dim) ** 2)  # attention q, k, v, proj; MLP fc, proj
        size += 4 * layers * per_layer
    return size


def check_disk(plan: Plan) -> Check:
    hp = plan.hp
    for flag, folder in (("--log_dir", hp.log_dir), ("--checkpoint_dir", getattr(hp, "checkpoint_dir", "") or "checkpoints")):
        if flag == "--checkpoint_dir" and not hp.checkpoint_every:
            continue
        blocked = _writable(Path(folder))
        if blocked is not None:
            return Check("disk", "fail", f"{flag}={folder}: {blocked} is not writable", f"pass a {flag} you can write to")
    log_root = _existing_ancestor(Path(hp.log_dir))  # relative paths are the script's: from the working directory
    free = shutil.disk_usage(log_root).free
    count = 0
    if hp.checkpoint_every:
        count = hp.train_steps // hp.checkpoint_every * getattr(hp, "num_trials", 1) + 1  # and one at an interrupt
    if getattr(hp, "save_checkpoint", False):
        count += 1
    if count == 0:
        if free < 2**30:
            return Check("disk", "warn", f"{gib(free)} free at {log_root}: little room for logs", "free some disk")
        return Check("disk", "ok", f"{gib(free)} free at {log_root} (a log takes under 1 MB; checkpoints off)")
    where = _existing_ancestor(Path(getattr(hp, "checkpoint_dir", "") or "checkpoints"))
    free = shutil.disk_usage(where).free
    needed = count * checkpoint_bytes(plan)
    detail = f"{gib(free)} free at {where}; {count} checkpoints of about {gib(checkpoint_bytes(plan))} each (estimate)"
    if free < needed:
        return Check("disk", "warn", f"{detail}: not enough for all of them", "raise --checkpoint_every or free some disk")
    return Check("disk", "ok", detail)


# ---- speed ----
def work_changing_flags(plan: Plan) -> list[str]:
    """The overrides that change a step's work (or memory) from the record configuration's."""
    return sorted(set(plan.overrides) - STEP_NEUTRAL_FLAGS)


def attention_measured_as(machine: Machine, plan: Plan) -> str | None:
    """MEASURED_MS_PER_STEP's attention key for this run on GPU 0: Track 1's backend as train_gpt.py chooses it
    (None when it refuses it or the MLP kernel; fa4 with its version when that is not the tested one; the backend
    with the MLP kernel when that is not the one its entry ran with), "sdpa" for Track 3."""
    if plan.track.number != 1:
        return "sdpa"
    tg = training_module(plan.track)
    device, capability = first_device(machine)
    try:
        backend = tg.choose_attention_backend(plan.hp.attention_backend, device, capability)
    except tg.UserError:  # check_attention reports it
        return None
    if backend == "fa4" and (version := tg.flash_attn_4_version()) != tg.FLASH_ATTN_4_TESTED:
        return f"fa4 {version}"  # measured with the tested version only
    try:
        mlp_kernel = tg.choose_mlp_kernel(plan.hp.mlp_kernel, device, capability)
    except tg.UserError:  # check_mlp_kernel reports it
        return None
    if mlp_kernel != MEASURED_MLP_KERNEL.get(backend, "triton"):
        return f"{backend} with the {mlp_kernel} MLP kernel"
    return backend


def check_expected_speed(machine: Machine, plan: Plan) -> Check:
    if not machine.gpu_mode:
        if not is_smoke_run(plan):
            return Check("expected", "skip", "CPU mode: measured for the smoke preset only")
        return Check("expected", "skip", f"CPU mode: the smoke run took about {SMOKE_SECONDS_ON_2_CORES[plan.track.number]} s on 2 shared cores")
    name = machine.gpus[0].name
    attention = attention_measured_as(machine, plan)
    if attention is None:
        return Check("expected", "skip", "the attention backend or the MLP kernel cannot run here (see attention, mlp)")
    measured = MEASURED_MS_PER_STEP.get((name, plan.track.number, plan.world_size, attention))
    if measured is None or plan.nnodes > 1:
        known = sorted({f"{gpu} x{n} {backend}" for gpu, track, n, backend in MEASURED_MS_PER_STEP if track == plan.track.number})
        return Check("expected", "skip", f"no measurement for {plan.world_size} x {name} with {attention}"
                     + (f" over {plan.nnodes} nodes" if plan.nnodes > 1 else "") + f" (we have: {', '.join(known)})")
    changed = work_changing_flags(plan)
    low, high, how = measured
    if changed:
        return Check("expected", "skip", f"measured at the record configuration only; --{', --'.join(changed)} change the work per step")
    low_text, high_text = f"{low:,.0f}", f"{high:,.0f}"
    span = low_text if low_text == high_text else f"{low_text}-{high_text}"
    steps = plan.hp.train_steps
    return Check("expected", "ok", f"{span} ms/step on {name} ({how}), so {steps} steps take about "
                 f"{steps * high / 60000:.0f} min plus compilation; {MEASURED_ON}")


# ---- report ----
SMOKE_COMMANDS = """CPU mode: no CUDA GPU is visible, so this checked the CPU smoke run. Smoke commands:
  python train_gpt.py --preset=smoke                # Track 1's whole pipeline, tiny model (shards in logs/smoke_shards_*/)
  python train_gpt_shampoo.py --preset=smoke        # Track 3's (shards in data/smoke/v512/)
  torchrun --standalone --nproc_per_node=2 train_gpt.py --preset=smoke   # 2 gloo processes
  python -m pytest -q                               # the tests"""


def run_checks(machine: Machine, plan: Plan, quick: bool, report: Callable[[Check], None] = lambda check: None,
               import_failures: dict[str, str] | None = None) -> list[Check]:
    """Every check in screen order; report sees each as soon as it is done (the all-reduce takes a while).
    import_failures: what import_errors found (torch and numpy import, or doctor would not get here)."""
    failures = import_failures or {}
    steps: list[Callable[[], Check | None]] = [
        check_python, lambda: check_torch(machine), lambda: check_data_package("numpy", failures, machine.gpu_mode),
        lambda: check_triton(machine, failures.get("triton")), lambda: check_data_package("tiktoken", failures, machine.gpu_mode),
        lambda: check_data_package("huggingface_hub", failures, machine.gpu_mode), lambda: check_cuda(machine),
        lambda: check_gpus(machine, plan), lambda: check_processes(plan), lambda: check_attention(machine, plan, quick),
        lambda: check_mlp_kernel(machine, plan),
        lambda: check_shampoo(plan), lambda: check_all_reduce(machine, plan, quick), lambda: check_shards(plan),
        lambda: check_torchrun(plan), lambda: check_disk(plan), lambda: check_expected_speed(machine, plan),
    ]
    checks = []
    for step in steps:
        check = step()
        if check is not None:
            report(check)
            checks.append(check)
    return checks


def run_name(plan: Plan) -> str:
    return "the smoke run" if is_smoke_run(plan) and not plan.gpu_mode else "the run"


def header(machine: Machine, plan: Plan) -> str:
    mode = "GPU mode" if machine.gpu_mode else f"CPU mode ({run_name(plan)})"
    nodes = f" on each of {plan.nnodes} nodes" if plan.nnodes > 1 else ""
    return f"doctor: Track {plan.track.number} ({plan.track.script}), {plan.nproc} process{'es' if plan.nproc > 1 else ''}{nodes}, {mode}"


def summary(checks: list[Check], run: str = "the run") -> str:
    failed = [check.name for check in checks if check.status == "fail"]
    warned = sum(check.status == "warn" for check in checks)
    if failed:
        return f"doctor: {len(failed)} check{'s' if len(failed) > 1 else ''} failed ({', '.join(failed)}): {run} would not start as it is"
    return f"doctor: {run} would start ({warned} warning{'s' if warned != 1 else ''})"


def parse_command_line(argv: Sequence[str]) -> tuple[argparse.Namespace, list[str]]:
    parser = argparse.ArgumentParser(prog="tools/doctor.py", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
                                     allow_abbrev=False)
    parser.add_argument("--track", type=int, choices=sorted(TRACKS), default=1, help="1: train_gpt.py (default), 3: train_gpt_shampoo.py")
    parser.add_argument("--nproc", type=int, default=None, help="processes on this machine (default: the visible GPUs, as run.sh counts; 1 on CPU)")
    parser.add_argument("--nnodes", type=int, help="machines in the run (default: NNODES or 1)")
    parser.add_argument("--quick", action="store_true", help="skip the all-reduce and the attention kernel's trial run (seconds instead of tens of seconds)")
    parser.add_argument("--flags-as-given", action="store_true",
                        help="check the training flags as they are, also on CPU (where doctor otherwise checks the smoke run); ./run.sh --check passes it")
    parser.add_argument("--all-reduce-worker", help=argparse.SUPPRESS)
    args, training_flags = parser.parse_known_args(list(argv))
    bad = [flag for flag in training_flags if not flag.startswith("--")]
    if bad:
        parser.error(f"unexpected argument {bad[0]!r}: training flags are --name=value")
    if args.nnodes is None:
        nnodes = os.environ.get("NNODES", "") or "1"
        if not nnodes.isdigit() or int(nnodes) < 1:
            parser.error(f"NNODES={nnodes!r}: give the number of machines in the run, e.g. NNODES=2")
        args.nnodes = int(nnodes)
    if args.nproc is not None and args.nproc < 1:
        parser.error(f"--nproc={args.nproc}: give at least 1 process per machine")
    if args.nnodes < 1:
        parser.error(f"--nnodes={args.nnodes}: give at least 1 machine")
    return args, training_flags


def main(argv: Sequence[str] | None = None) -> int:
    args, training_flags = parse_command_line(sys.argv[1:] if argv is None else argv)
    if args.all_reduce_worker:
        rank, world_size, port, backend, numel = args.all_reduce_worker.split(",")
        all_reduce_worker(int(rank), int(world_size), int(port), backend, int(numel))
        return 0
    failures = import_errors(list(PACKAGES))
    if any(stops_doctor(name, error) for name, error in failures.items()):  # the scripts cannot even be imported
        gpu_machine = gpus_listed()
        checks = [check_python()]
        for name in PACKAGES:
            if name in failures:
                checks.append(check_broken_package(name, failures[name], gpu_machine))
            else:
                checks.append(Check(name, "ok", version_of(name) or "version unknown"))
        for check in checks:
            print(check.line())
        print(summary(checks))
        return 1
    machine = read_machine()
    nproc = args.nproc or (len(machine.gpus) if machine.gpu_mode else 1)  # run.sh's count
    smoke_by_default = not machine.gpu_mode and not args.flags_as_given
    try:
        plan = make_plan(TRACKS[args.track], nproc, args.nnodes, training_flags, machine.gpu_mode, args.flags_as_given)
    except PlanError as error:
        failed = Check("settings", "fail", str(error), f"python {TRACKS[args.track].script} --help lists the flags")
        print(failed.line())
        print(summary([failed], "the smoke run" if smoke_by_default else "the run"))
        return 1
    print(header(machine, plan), flush=True)
    checks = run_checks(machine, plan, args.quick, report=lambda check: print(check.line(), flush=True), import_failures=failures)
    print(summary(checks, run_name(plan)))
    if not machine.gpu_mode:
        print(SMOKE_COMMANDS)
    return 1 if any(check.status == "fail" for check in checks) else 0


if __name__ == "__main__":
    if hasattr(signal, "SIGPIPE"):
        signal.signal(signal.SIGPIPE, signal.SIG_DFL)  # `doctor.py | head` ends quietly
    sys.exit(main())
