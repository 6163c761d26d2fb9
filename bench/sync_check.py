"""Where train_gpt.py's training steps make the host wait for the GPU, on one GPU.

A training step is meant to queue its work and return: the host then runs ahead of the GPU, preparing the next
batch while the GPU computes. An operation that synchronizes (a blocking host-to-device copy of a Python list
used as an index, `.item()`, `.cpu()`) drains that lead, and the host's own work that follows shows up as GPU
idle time. This runs `train_gpt.run` with `torch.cuda.set_sync_debug_mode("warn")` switched on inside the
training loop only (validation and the loop's deliberate clock synchronizations excluded) and prints every
synchronizing call site, by its Python stack, with how often it ran per step.

    python bench/sync_check.py [--script=PATH] <train_gpt.py overrides>   # default: this checkout's train_gpt.py; e.g.:
    python bench/sync_check.py --compile=false --train_batch_size=32768 --num_iterations=6 --iteration_extension=0 \\
        --warmup_steps=1 --train_files=... --val_files=... --val_tokens=262144 --val_batch_size=262144
"""

from __future__ import annotations

import inspect
import sys
import traceback
import warnings
from collections import Counter
from pathlib import Path
from typing import Any

import torch

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))  # the repository root (bench/scripts.py)
from bench.scripts import load_script  # noqa: E402

STACK_DEPTH = 6  # frames shown per call site, innermost last


def call_site(limit: int = STACK_DEPTH) -> str:
    frames = [f for f in traceback.extract_stack()[:-2] if "warnings" not in f.filename][-limit:]
    return "\n".join(f"    {Path(f.filename).name}:{f.lineno} {f.name}: {f.line}" for f in frames)


def script_and_overrides(argv: list[str]) -> tuple[Any, list[str]]:
    """train_gpt.py of this checkout, or the one named by a leading --script=PATH; returns it and the overrides."""
    path = REPO / "train_gpt.py"
    if argv and argv[0].startswith("--script="):
        path, argv = Path(argv[0].split("=", 1)[1]), argv[1:]
    if not path.is_file():
        raise SystemExit(f"bench/sync_check.py: --script={path}: no such file; give a train_gpt.py")
    return load_script(path, "train_gpt_checked"), argv


def main() -> None:
    tg, overrides = script_and_overrides(sys.argv[1:])
    if not torch.cuda.is_available():
        raise SystemExit("bench/sync_check.py: needs a CUDA GPU")
    sites: Counter[str] = Counter()
    original_train, original_evaluate, original_synchronize = tg.train, tg.evaluate, tg.synchronize
    steps = [0]

    shown = warnings.showwarning

    def record(message: Any, category: Any, filename: str, lineno: int, file: Any = None, line: Any = None) -> None:
        if "synchroniz" in str(message):
            sites[call_site()] += 1
        else:
            shown(message, category, filename, lineno, file, line)

    def unwatched(function: Any) -> Any:
        def call(*args: Any, **kwargs: Any) -> Any:
            mode = torch.cuda.get_sync_debug_mode()
            torch.cuda.set_sync_debug_mode(0)
            try:
                return function(*args, **kwargs)
            finally:
                torch.cuda.set_sync_debug_mode(mode)
        return call

    def watched_train(*args: Any, **kwargs: Any) -> float:
        hp = inspect.signature(original_train).bind(*args, **kwargs).arguments["hp"]
        steps[0] = hp.train_steps
        warnings.simplefilter("always")
        warnings.showwarning = record
        torch.cuda.set_sync_debug_mode("warn")
        try:
            return original_train(*args, **kwargs)
        finally:
            torch.cuda.set_sync_debug_mode(0)

    tg.train, tg.evaluate, tg.synchronize = watched_train, unwatched(original_evaluate), unwatched(original_synchronize)
    tg.run(overrides)
    total = sum(sites.values())
    print(f"synchronizing calls inside the training loop: {total} in {steps[0]} steps ({total / max(steps[0], 1):.1f} per step)")
    for site, count in sites.most_common():
        print(f"{count / max(steps[0], 1):6.1f} per step:\n{site}")


if __name__ == "__main__":
    main()
