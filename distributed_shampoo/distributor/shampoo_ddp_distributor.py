"""DDP distributor: replicated parameters, each block's Shampoo work done by one rank of its group.

Blocks are assigned to the ranks of a group with the load-balancing cost model (heaviest first onto the least
loaded rank). The owner computes the block's search direction; afterwards one all-gather of a flat buffer
shares either the directions (`communicate_params=False`) or the updated parameters (`True`). With fp32
communication the result is bitwise identical to the single-device optimizer.
"""

import logging
from typing import Any, ClassVar

import torch
import torch.distributed as dist
from torch import Tensor

from distributed_shampoo.distributor.shampoo_dist_utils import shampoo_comm_profiler
from distributed_shampoo.distributor.shampoo_distributor import DistributorInterface
from distributed_shampoo.shampoo_types import DISTRIBUTED_CONFIG, DDPDistributedConfig, ShampooRuntimeConfig
from distributed_shampoo.utils.shampoo_utils import compress_list, distribute_buffer_sizes

logger: logging.Logger = logging.getLogger(__name__)

# torch 2.13 renamed all_gather_into_tensor (now deprecated) to all_gather_single; torch 2.11 has only the former.
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def resolve_group_size(num_trainers_per_group: int, world_size: int) -> int:
    """Ranks that share one copy of the optimizer state (-1: the whole world)."""
    group_size = world_size if num_trainers_per_group == -1 else num_trainers_per_group
    if not 1 <= group_size <= world_size or world_size % group_size != 0:
        raise ValueError(
            f"Invalid {num_trainers_per_group=} for world size {world_size}: use -1 or a divisor of the world size."
        )
    return group_size


class DDPDistributor(DistributorInterface):
    """Spreads the blocks of a replicated param group over the ranks of each group of `num_trainers_per_group`."""

    applies_updates_in_parts: ClassVar[bool] = True

    def __init__(self, param_group: dict[str, Any], runtime_config: ShampooRuntimeConfig | None = None) -> None:
        distributed_config: DDPDistributedConfig = param_group[DISTRIBUTED_CONFIG]
        if not dist.is_initialized():
            raise RuntimeError(
                "DDPDistributedConfig needs an initialized torch.distributed process group "
                "(call dist.init_process_group first); use SingleDeviceDistributedConfig for one process."
            )
        super().__init__(param_group, runtime_config)
        self._communicate_params = distributed_config.communicate_params
        self._communication_dtype = distributed_config.communication_dtype

        world_size = dist.get_world_size()
        group_size = resolve_group_size(distributed_config.num_trainers_per_group, world_size)
        if group_size == world_size:
            self._group = dist.group.WORLD
        else:
            self._group, _ = dist.new_subgroups(group_size)
        self._group_size = group_size
        self._group_rank = dist.get_rank(self._group)

        buffer_sizes_and_ranks = distribute_buffer_sizes(
            tuple(
                torch.empty(block.shape, dtype=self._communication_dtype, device="meta")
                for block in self._global_blocked_params
            ),
            group_size,
            distributed_config.load_balancing_config,
        )
        self._global_block_ranks = tuple(rank for _, rank in buffer_sizes_and_ranks)
        is_local = tuple(rank == self._group_rank for rank in self._global_block_ranks)
        self._build_communication_buffer(buffer_sizes_and_ranks, is_local)
        self._select_local_blocks(is_local)
        if not self._local_blocked_params:
            logger.warning(
                f"Rank {dist.get_rank()} was assigned no blocks and will idle during Shampoo computations; "
                "consider a smaller num_trainers_per_group."
            )

    def _build_communication_buffer(
        self, buffer_sizes_and_ranks: tuple[tuple[int, int], ...], is_local: tuple[bool, ...]
    ) -> None:
        """One int8 buffer with a region per rank; each rank's blocks sit back-to-back in global order."""
        region_bytes = [0] * self._group_size
        offsets = []
        for buffer_bytes, rank in buffer_sizes_and_ranks:
            offsets.append(region_bytes[rank])
            region_bytes[rank] += buffer_bytes
        self._region_bytes = max(region_bytes, default=0)
        device = self._global_blocked_params[0].device if self._global_blocked_params else torch.device("cpu")
        self._global_buffer = torch.zeros(self._group_size * self._region_bytes, dtype=torch.int8, device=device)
        start = self._group_rank * self._region_bytes
        self._local_buffer = self._global_buffer[start : start + self._region_bytes]
        element_size = torch.empty((), dtype=self._communication_dtype).element_size()
        views = []
        for block, (_, rank), offset in zip(self._global_blocked_params, buffer_sizes_and_ranks, offsets, strict=True):
            begin = rank * self._region_bytes + offset
            raw = self._global_buffer[begin : begin + block.numel() * element_size]
            views.append(raw.view(self._communication_dtype).view(block.shape))
        self._global_buffer_views: tuple[Tensor, ...] = tuple(views)
        self._local_buffer_views = compress_list(self._global_buffer_views, is_local)

    def _apply_selector(self, global_selector: tuple[bool, ...]) -> None:
        """Also mask the global params and the buffer views that `update_params` reads and writes."""
        super()._apply_selector(global_selector)
        self._global_masked_params = compress_list(self._global_blocked_params, global_selector)
        self._global_masked_views = compress_list(self._global_buffer_views, global_selector)
        self._local_masked_views = compress_list(self._local_buffer_views, self._local_grad_selector)

    @torch.no_grad()
    def update_params(self, blocked_search_directions: tuple[Tensor, ...], use_masked_tensors: bool = True) -> None:
        if use_masked_tensors:
            local_params, local_views = self._local_masked_blocked_params, self._local_masked_views
            global_params, global_views = self._global_masked_params, self._global_masked_views
        else:
            local_params, local_views = self._local_blocked_params, self._local_buffer_views
            global_params, global_views = self._global_blocked_params, self._global_buffer_views
        assert len(local_params) == len(blocked_search_directions), (
            f"{len(local_params)=} local blocks but {len(blocked_search_directions)=} search directions."
        )
        self._stage_local_updates(local_params, local_views, blocked_search_directions)
        self._gather_and_apply(global_params, global_views)

    @torch.no_grad()
    def update_local_params(self, blocked_search_directions: tuple[Tensor, ...], first_block: int) -> None:
        end = first_block + len(blocked_search_directions)
        local_params = self._local_masked_blocked_params[first_block:end]
        assert len(local_params) == len(blocked_search_directions), (
            f"{len(blocked_search_directions)} search directions from masked block {first_block} on, but only "
            f"{len(local_params)} local blocks."
        )
        self._stage_local_updates(local_params, self._local_masked_views[first_block:end], blocked_search_directions)

    @torch.no_grad()
    def finish_param_updates(self) -> None:
        self._gather_and_apply(self._global_masked_params, self._global_masked_views)

    def _stage_local_updates(
        self, local_params: tuple[Tensor, ...], local_views: tuple[Tensor, ...], blocked_search_directions: tuple[Tensor, ...]
    ) -> None:
        """Apply the directions to the local blocks (or not, with `communicate_params=False`) and copy what the
        other ranks need into this rank's region of the communication buffer."""
        if not local_params:
            return
        if self._communicate_params:
            torch._foreach_add_(local_params, blocked_search_directions)
            torch._foreach_copy_(local_views, local_params)
        else:
            torch._foreach_copy_(local_views, blocked_search_directions)

    def _gather_and_apply(self, global_params: tuple[Tensor, ...], global_views: tuple[Tensor, ...]) -> None:
        """All-gather the buffer and apply every rank's blocks."""
        # Every rank joins the collective, even with nothing local to send.
        with shampoo_comm_profiler("## DDPDistributor:all_gather ##"):
            _all_gather_single(self._global_buffer, self._local_buffer, group=self._group)
        if global_params:
            if self._communicate_params:
                torch._foreach_copy_(global_params, global_views)
            else:
                torch._foreach_add_(global_params, global_views)
