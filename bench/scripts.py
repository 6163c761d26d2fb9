"""Another version of a training script, loaded from its file (an A/B's baseline, a script a log embeds).

Every bench script reaches the repository the same way: its first lines put the repository root on sys.path, then it
imports the training scripts (`import train_gpt as tg`), the packages (`distributed_shampoo`, `tools.recordkit`) and
its siblings (`from bench.gpu_timing import median_ms`) by name. A version of a training script that is not the
checkout's own comes from load_script.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType


def load_script(path: Path, name: str) -> ModuleType:
    """The module of the script at `path`, registered in sys.modules as `name` (its dataclasses and torch.library
    registrations look their module up there)."""
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        raise ValueError(f"{path}: not a Python file")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module
