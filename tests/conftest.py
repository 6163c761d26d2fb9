"""Shared helpers for the train_gpt tests: tiny shards and a tiny configuration of the 12-slot model."""

import json
import os
import signal
import socket
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import train_gpt  # noqa: E402

TINY_VOCAB = 512
TINY_BOS = 511


def record_model(world_size: int = 8) -> train_gpt.GPT:
    """The 124M record model, built on the meta device (no memory, no init cost)."""
    with torch.device("meta"):
        return train_gpt.GPT(50257, 768, 6, 262_144, 128, world_size, train_gpt.attention_backend("reference", 128, 50256))


def tiny_model(backend: str = "reference", dim: int = 64, heads: int = 2, block: int = 16) -> train_gpt.GPT:
    torch.manual_seed(0)
    return train_gpt.GPT(TINY_VOCAB, dim, heads, 256, block, 1, train_gpt.attention_backend(backend, block, TINY_BOS), torch.float32)


def tiny_hyperparameters() -> train_gpt.Hyperparameters:
    """tiny_model's settings for build_optimizers, with DistAdam's update uncompiled (no inductor on CPU)."""
    return train_gpt.Hyperparameters(vocab_size=TINY_VOCAB, bos_token=TINY_BOS, model_dim=64, num_heads=2, compile=False)


def random_documents(T: int, num_bos: int, seed: int) -> torch.Tensor:
    """T token ids below TINY_BOS with num_bos BOS tokens at random places."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, TINY_BOS, (T,), generator=g)
    ids[torch.randint(0, T, (num_bos,), generator=g)] = TINY_BOS
    return ids


def run_bench_script(name: str, *args: str, timeout: int = 300) -> subprocess.CompletedProcess:
    """bench/<name> in a subprocess from the repository root, one thread per process (2-core CI)."""
    env = dict(os.environ, OMP_NUM_THREADS="1")
    return subprocess.run([sys.executable, str(ROOT / "bench" / name), *args], capture_output=True, text=True, cwd=ROOT, timeout=timeout, env=env)


def import_bench_script(monkeypatch: pytest.MonkeyPatch, name: str, module_name: str):
    """bench/<name> imported as a module (the bench scripts are not a package), registered in sys.modules for the
    test, where its dataclasses look their module up."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(module_name, ROOT / "bench" / name)
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, module_name, module)
    spec.loader.exec_module(module)
    return module


def run_under_interpreter(script: str, timeout: int = 300) -> dict:
    """The JSON object that `script` prints last, run in a fresh process with TRITON_INTERPRET=1 (which must be set
    before any kernel is decorated, so never in the test process itself)."""
    env = dict(os.environ, TRITON_INTERPRET="1", OMP_NUM_THREADS="1")
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=timeout, env=env, cwd=ROOT)
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(result.stdout.strip().splitlines()[-1])


def make_shards(folder: Path, train_tokens: int = 60_000, val_tokens: int = 8193, num_train: int = 2) -> tuple[str, str]:
    folder.mkdir(parents=True, exist_ok=True)
    for i in range(num_train):
        train_gpt.write_shard(
            folder / f"tiny_train_{i:06d}.bin", train_gpt.synthetic_tokens(train_tokens, TINY_VOCAB, TINY_BOS, seed=10 + i)
        )
    train_gpt.write_shard(folder / "tiny_val_000000.bin", train_gpt.synthetic_tokens(val_tokens, TINY_VOCAB, TINY_BOS, seed=99))
    return str(folder / "tiny_train_*.bin"), str(folder / "tiny_val_*.bin")


@pytest.fixture
def tiny_shards(tmp_path: Path) -> tuple[str, str]:
    return make_shards(tmp_path / "data")


def tiny_args(train_files: str, val_files: str, log_dir: Path, **extra: object) -> list[str]:
    """The smoke preset with a 512-token vocabulary: fast enough for several runs per test run."""
    values = dict(
        preset="smoke",
        vocab_size=TINY_VOCAB,
        bos_token=TINY_BOS,
        train_files=train_files,
        val_files=val_files,
        log_dir=str(log_dir),
        num_iterations=8,
        iteration_extension=2,
        val_loss_every=5,
        warmup_steps=2,
        seed=0,
    )
    values.update(extra)
    return [f"--{k}={v}" for k, v in values.items()]


def free_port() -> int:
    """A TCP port free on this machine now, for a gloo rendezvous."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(autouse=True)
def one_excepthook():
    """Each init_process_group wraps sys.excepthook in one more "[rank0]: " prefix, and many tests here run the
    scripts in-process: without this, a traceback late in the run carries one prefix per earlier run."""
    hook = sys.excepthook
    yield
    sys.excepthook = hook


@pytest.fixture
def workdir(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Path:
    """A fresh working directory and a one-process torch.distributed environment (the scripts run in-process)."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("DATA_PATH", raising=False)
    monkeypatch.delenv("TORCHELASTIC_ERROR_FILE", raising=False)
    for key, value in dict(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1").items():
        monkeypatch.setenv(key, value)
    monkeypatch.setenv("MASTER_PORT", str(free_port()))
    return tmp_path


def signal_when(process: subprocess.Popen, line_prefix: str, sig: signal.Signals, timeout: float) -> str:
    """Send `sig` to a run once its stdout shows a line starting with `line_prefix`; wait for it and return its
    stderr. A run that shows no such line within `timeout` is killed, so the test fails instead of hanging."""
    timed_out = threading.Event()

    def kill() -> None:
        timed_out.set()
        process.kill()

    watchdog = threading.Timer(timeout, kill)
    watchdog.start()
    try:
        shown = any(line.startswith(line_prefix) for line in process.stdout)
    finally:
        watchdog.cancel()
    if not shown:
        _, stderr = process.communicate(timeout=timeout)
        how = f"killed after {timeout} s" if timed_out.is_set() else f"ended with status {process.returncode}"
        pytest.fail(f"the run showed no line starting with {line_prefix!r} ({how}); its stderr ends: {stderr[-2000:]!r}")
    process.send_signal(sig)
    _, stderr = process.communicate(timeout=timeout)
    return stderr
