"""Small torch.distributed helpers shared by the distributors."""

import contextlib
from collections.abc import Iterator

import torch


@contextlib.contextmanager
def shampoo_comm_profiler(name: str) -> Iterator[None]:
    """Profiler record around a communication call, so traces show it under `name`."""
    with torch.profiler.record_function(name):
        yield
