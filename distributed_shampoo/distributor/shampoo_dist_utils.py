"""Small torch.distributed helpers shared by the distributors."""

import contextlib
import functools
from collections.abc import Iterator

import torch
from torch.distributed.device_mesh import DeviceMesh


@contextlib.contextmanager
def shampoo_comm_profiler(name: str) -> Iterator[None]:
    """Profiler record around a communication call, so traces show it under `name`."""
    with torch.profiler.record_function(name):
        yield


@functools.cache
def get_device_mesh(
    device_type: str, mesh: tuple[tuple[int, ...], ...], mesh_dim_names: tuple[str, ...] | None = None
) -> DeviceMesh:
    """A `DeviceMesh` over the given rank layout, built once per distinct arguments (meshes create groups)."""
    return DeviceMesh(device_type, torch.tensor(mesh), mesh_dim_names=mesh_dim_names)
