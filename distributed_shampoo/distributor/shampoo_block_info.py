"""Where a block came from and how its optimizer state is allocated and read."""

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor


def _identity(tensor: Tensor) -> Tensor:
    return tensor


@dataclass
class BlockInfo:
    """A block of parameter `param` identified by `composable_block_ids = (param_index, "block_k")`.

    Every optimizer state tensor of the block is allocated through `allocate_*_tensor` and read through
    `get_tensor`, so a distributor could wrap state (e.g. in DTensors) without the preconditioners knowing.
    """

    param: Tensor
    composable_block_ids: tuple[int, str]
    allocate_zeros_tensor: Callable[..., Tensor] = torch.zeros
    # Factories, so that the functions become instance attributes rather than methods.
    allocate_ones_tensor: Callable[..., Tensor] = field(init=False, default_factory=lambda: torch.ones)
    allocate_eye_tensor: Callable[..., Tensor] = field(init=False, default_factory=lambda: torch.eye)
    get_tensor: Callable[[Any], Tensor] = field(init=False, default_factory=lambda: _identity)


def allocate_zeros_like_blocks(
    key: str, blocks: tuple[Tensor, ...], block_infos: tuple[BlockInfo, ...], state: dict[Tensor, Any]
) -> tuple[Tensor, ...]:
    """A zero state tensor shaped like each block, stored as `state[param][block_id][key]`; returns the local parts."""
    local_tensors = []
    for block, block_info in zip(blocks, block_infos, strict=True):
        block_state = state[block_info.param][block_info.composable_block_ids[1]]
        block_state[key] = block_info.allocate_zeros_tensor(size=block.size(), dtype=block.dtype, device=block.device)
        local_tensors.append(block_info.get_tensor(block_state[key]))
    return tuple(local_tensors)
