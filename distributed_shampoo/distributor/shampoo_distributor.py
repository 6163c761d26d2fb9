"""Blocking of a param group and the single-device distributor.

A distributor owns the mapping between a param group's parameters and the blocks the preconditioners work on:
it merges small dims and splits at `max_preconditioner_dim` once for the params (README.md, "Blocking"), blocks
the gradients of its local blocks identically each step, tracks which blocks received a gradient, and applies the
search directions.
"""

import logging
from abc import ABC, abstractmethod
from typing import Any, ClassVar

import torch
from torch import Tensor

from distributed_shampoo.distributor.shampoo_block_info import BlockInfo
from distributed_shampoo.shampoo_types import (
    DISTRIBUTED_CONFIG,
    MAX_PRECONDITIONER_DIM,
    PARAMS,
    DefaultShampooRuntimeConfig,
    ShampooRuntimeConfig,
)
from distributed_shampoo.utils.shampoo_utils import (
    compress_list,
    generate_pairwise_indices,
    merge_small_dims,
    multi_dim_split,
)

logger: logging.Logger = logging.getLogger(__name__)


def block_tensor(tensor: Tensor, max_preconditioner_dim: int | float, target_dimensionality: int | float) -> tuple[Tensor, ...]:
    """Views of `tensor` reshaped by `merge_small_dims` and cut by `multi_dim_split`."""
    merged_shape = merge_small_dims(tensor.size(), max_preconditioner_dim, target_dimensionality)
    return multi_dim_split(tensor.view(merged_shape), max_preconditioner_dim)


class DistributorInterface(ABC):
    """Blocks of one param group; which of them this process computes; how updates reach the parameters.

    A step hands over its search directions either all at once (`update_params`) or, when the distributor
    `applies_updates_in_parts`, a few consecutive masked blocks at a time (`update_local_params`) followed by one
    `finish_param_updates`, so that it never holds the directions of every block at once.
    """

    applies_updates_in_parts: ClassVar[bool] = False

    def __init__(self, param_group: dict[str, Any], runtime_config: ShampooRuntimeConfig | None = None) -> None:
        self._param_group = param_group
        self._runtime_config = runtime_config or DefaultShampooRuntimeConfig
        self._max_preconditioner_dim = param_group[MAX_PRECONDITIONER_DIM]
        self._target_dimensionality = param_group[DISTRIBUTED_CONFIG].target_parameter_dimensionality

        params: list[Tensor] = param_group[PARAMS]
        for index, param in enumerate(params):
            if not param.is_contiguous():
                raise ValueError(
                    f"Parameter {index} of the group is not contiguous ({param.shape=}, {param.stride()=}); "
                    "Shampoo blocks parameters through views. Make it contiguous before building the optimizer."
                )
        blocked_per_param = [self._block(param.detach()) for param in params]
        self._global_num_blocks_per_param: tuple[int, ...] = tuple(len(blocks) for blocks in blocked_per_param)
        self._global_blocked_params: tuple[Tensor, ...] = tuple(b for blocks in blocked_per_param for b in blocks)
        self._global_block_ids: tuple[tuple[int, str], ...] = tuple(
            (param_index, f"block_{k}")
            for param_index, blocks in enumerate(blocked_per_param)
            for k in range(len(blocks))
        )
        self._global_block_params: tuple[Tensor, ...] = tuple(
            params[param_index] for param_index, _ in self._global_block_ids
        )
        self._global_grad_selector: tuple[bool, ...] = (True,) * len(self._global_blocked_params)

    def _block(self, tensor: Tensor) -> tuple[Tensor, ...]:
        return block_tensor(tensor, self._max_preconditioner_dim, self._target_dimensionality)

    def _select_local_blocks(self, is_local: tuple[bool, ...]) -> None:
        """Fix which blocks this process computes; a subclass calls this once its own state is built."""
        self._is_local = is_local
        # Per parameter, the positions of its local blocks: gradients with no local block are never blocked.
        self._local_block_positions_per_param: tuple[tuple[int, ...], ...] = tuple(
            tuple(k - start for k in range(start, end) if is_local[k])
            for start, end in generate_pairwise_indices(self._global_num_blocks_per_param)
        )
        self._local_blocked_params = compress_list(self._global_blocked_params, is_local)
        self._local_block_info_list = tuple(
            BlockInfo(param=param, composable_block_ids=block_id)
            for param, block_id in compress_list(
                tuple(zip(self._global_block_params, self._global_block_ids, strict=True)), is_local
            )
        )
        self._apply_selector(self._global_grad_selector)

    def _apply_selector(self, global_selector: tuple[bool, ...]) -> None:
        """Record which blocks received a gradient; subclasses extend this to their own masked lists."""
        self._global_grad_selector = global_selector
        self._local_grad_selector = compress_list(global_selector, self._is_local)
        self._local_masked_blocked_params = compress_list(self._local_blocked_params, self._local_grad_selector)

    @property
    def local_block_info_list(self) -> tuple[BlockInfo, ...]:
        return self._local_block_info_list

    @property
    def local_blocked_params(self) -> tuple[Tensor, ...]:
        return self._local_blocked_params

    @property
    def local_grad_selector(self) -> tuple[bool, ...]:
        return self._local_grad_selector

    @property
    def local_masked_blocked_params(self) -> tuple[Tensor, ...]:
        """The local blocks that received a gradient at the last `merge_and_block_gradients`."""
        return self._local_masked_blocked_params

    def merge_and_block_gradients(self) -> tuple[Tensor, ...]:
        """The local blocks' gradients, for the blocks that received one this step."""
        local_grads: list[Tensor] = []
        selector: list[bool] = []
        for param, num_blocks, local_positions in zip(
            self._param_group[PARAMS], self._global_num_blocks_per_param, self._local_block_positions_per_param, strict=True
        ):
            grad = param.grad
            present = grad is not None and grad.numel() > 0
            if present and self._runtime_config.eager_nan_check:
                assert torch.isfinite(grad).all(), f"Encountered nan/inf in the gradient of a {tuple(param.shape)} parameter."
            selector.extend((present,) * num_blocks)
            if present and local_positions:
                blocks = self._block(grad)
                local_grads.extend(blocks[k] for k in local_positions)
        if tuple(selector) != self._global_grad_selector:
            self._apply_selector(tuple(selector))
        return tuple(local_grads)

    @abstractmethod
    def update_params(self, blocked_search_directions: tuple[Tensor, ...], use_masked_tensors: bool = True) -> None:
        """W ← W + P for the local (masked, or all with `use_masked_tensors=False`) blocks, plus communication."""

    def update_local_params(self, blocked_search_directions: tuple[Tensor, ...], first_block: int) -> None:
        """W ← W + P for the local masked blocks `first_block`, `first_block + 1`, … (one per direction); the
        update is complete after `finish_param_updates`. Only where `applies_updates_in_parts`."""
        raise NotImplementedError(f"{type(self).__name__} applies the search directions of a step all at once.")

    def finish_param_updates(self) -> None:
        """Complete the updates given to `update_local_params` this step (communication, if any)."""
        raise NotImplementedError(f"{type(self).__name__} applies the search directions of a step all at once.")


class Distributor(DistributorInterface):
    """Single process: every block is local and there is no communication."""

    def __init__(self, param_group: dict[str, Any], runtime_config: ShampooRuntimeConfig | None = None) -> None:
        super().__init__(param_group, runtime_config)
        self._select_local_blocks((True,) * len(self._global_blocked_params))

    applies_updates_in_parts: ClassVar[bool] = True

    @torch.no_grad()
    def update_params(self, blocked_search_directions: tuple[Tensor, ...], use_masked_tensors: bool = True) -> None:
        params = self._local_masked_blocked_params if use_masked_tensors else self._local_blocked_params
        assert len(params) == len(blocked_search_directions), (
            f"{len(params)=} blocks but {len(blocked_search_directions)=} search directions."
        )
        if params:
            torch._foreach_add_(params, blocked_search_directions)

    @torch.no_grad()
    def update_local_params(self, blocked_search_directions: tuple[Tensor, ...], first_block: int) -> None:
        params = self._local_masked_blocked_params[first_block : first_block + len(blocked_search_directions)]
        assert len(params) == len(blocked_search_directions), (
            f"{len(blocked_search_directions)} search directions from masked block {first_block} on, but only "
            f"{len(params)} blocks."
        )
        if params:
            torch._foreach_add_(params, blocked_search_directions)

    def finish_param_updates(self) -> None:
        return
