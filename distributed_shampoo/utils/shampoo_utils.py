"""Blocking, bookkeeping and communication helpers used by the preconditioners and distributors."""

import heapq
import math
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import AbstractContextManager, contextmanager
from functools import lru_cache, partial
from itertools import accumulate, pairwise
from types import TracebackType
from typing import TYPE_CHECKING, Generic, TypeVar

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed.tensor import DTensor

from distributed_shampoo.utils.load_balancing_utils import DefaultCostModel

if TYPE_CHECKING:  # imported for annotations only: shampoo_types itself imports the cost models
    from distributed_shampoo.shampoo_types import LoadBalancingConfig

T = TypeVar("T")
ContextObjectT = TypeVar("ContextObjectT")


def merge_small_dims(
    tensor_shape: Sequence[int], threshold: int | float, target_tensor_dimensionality: int | float = 1
) -> tuple[int, ...]:
    """Reshape plan that squeezes 1s and merges neighbouring dims, last dim first.

    A dim is folded into the (already merged) dim to its right while the merged size stays
    `<= threshold` and the result would otherwise still have more than
    `target_tensor_dimensionality` dims. Fewer, larger dims mean fewer factor matrices per block.

    Special cases: any 0 in the shape gives `(0,)`; a float target must be `math.inf` and returns
    the shape unchanged (not even squeezed); an all-ones or empty shape gives `(1,)`.
    Example: `(32, 3, 64, 64)` with threshold 8192 and target 1 gives `(96, 4096)`.
    """
    return _merge_small_dims(tuple(tensor_shape), threshold, target_tensor_dimensionality)


@lru_cache(maxsize=None, typed=True)  # typed: 1.0 must not hit the cache entry of 1
def _merge_small_dims(
    tensor_shape: tuple[int, ...], threshold: int | float, target_tensor_dimensionality: int | float
) -> tuple[int, ...]:
    if 0 in tensor_shape:
        return (0,)
    if isinstance(target_tensor_dimensionality, float):
        assert target_tensor_dimensionality == math.inf, (
            f"{target_tensor_dimensionality=} must be an integer or math.inf."
        )
        return tensor_shape
    squeezed = [dim for dim in tensor_shape if dim != 1] or [1]
    merged_reversed = [squeezed[-1]]
    for index in range(len(squeezed) - 2, -1, -1):
        dim = squeezed[index]
        # Dims left if this one (and everything before it) stayed separate.
        dims_if_kept_separate = len(merged_reversed) + index + 1
        if dims_if_kept_separate > target_tensor_dimensionality and merged_reversed[-1] * dim <= threshold:
            merged_reversed[-1] *= dim
        else:
            merged_reversed.append(dim)
    return tuple(reversed(merged_reversed))


def multi_dim_split(tensor: Tensor, split_size: int | float) -> tuple[Tensor, ...]:
    """Cut `tensor` into views of at most `split_size` along every dim (dim 0 first, row-major order).

    `split_size` may be `math.inf` (no split); any other float is rejected. A 0-d tensor is returned
    as the only piece.
    """
    if isinstance(split_size, float):
        assert split_size == math.inf, f"{split_size=} must be an integer or math.inf."
        return (tensor,)
    pieces: tuple[Tensor, ...] = (tensor,)
    for dim in range(tensor.dim()):
        pieces = tuple(part for piece in pieces for part in torch.split(piece, split_size, dim=dim))
    return pieces


def compress_list(complete_list: Sequence[T], selector: Sequence[bool]) -> tuple[T, ...]:
    """Keep the elements of `complete_list` whose entry in `selector` is truthy."""
    assert len(complete_list) == len(selector), (
        f"Inconsistent lengths: {len(complete_list)=} but {len(selector)=}."
    )
    return tuple(element for element, keep in zip(complete_list, selector, strict=True) if keep)


def get_dtype_size(dtype: torch.dtype) -> int:
    """Bytes taken by one element of `dtype` (bits rounded up to whole bytes; bool counts 1)."""
    if dtype is torch.bool:
        return 1
    if dtype.is_floating_point:
        bits = torch.finfo(dtype).bits
    elif dtype.is_complex:
        return dtype.itemsize
    else:
        try:
            bits = torch.iinfo(dtype).bits
        except TypeError:  # sub-byte and other exotic dtypes without iinfo
            return dtype.itemsize
    return math.ceil(bits / 8)


def generate_pairwise_indices(input_list: Sequence[int]) -> Iterator[tuple[int, int]]:
    """Turn counts into `(start, end)` ranges of consecutive segments: `(1, 3, 2)` -> `(0,1), (1,4), (4,6)`."""
    return pairwise(accumulate(input_list, initial=0))


class ParameterizeEnterExitContext(Generic[ContextObjectT]):
    """Context manager that calls one method of an object on enter and another on exit.

    The exit call also happens when the body raises; the exception still propagates.
    """

    def __init__(
        self,
        input_with_enter_exit_context: ContextObjectT,
        enter_method_caller: Callable[[ContextObjectT], object],
        exit_method_caller: Callable[[ContextObjectT], object],
    ) -> None:
        self._input = input_with_enter_exit_context
        self._enter_method_caller = enter_method_caller
        self._exit_method_caller = exit_method_caller

    def __enter__(self) -> "ParameterizeEnterExitContext[ContextObjectT]":
        self._enter_method_caller(self._input)
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc_value: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self._exit_method_caller(self._input)


def distribute_buffer_sizes(
    blocked_params: Sequence[Tensor], group_size: int, load_balancing_config: "LoadBalancingConfig"
) -> tuple[tuple[int, int], ...]:
    """Assign every block to a rank; return `(buffer_bytes, rank)` per block, in input order.

    Ranks are chosen greedily by the configured cost model: blocks are visited from the most to
    the least expensive (ties keep input order) and each goes to the rank with the least cost so
    far (ties go to the lowest rank). `buffer_bytes` is always the block's size rounded up to 64
    bytes (the default cost model), because it sizes the all-gather buffer, whatever the
    balancing criterion. Only the blocks' shapes and dtypes are read, so meta tensors work.
    """
    if group_size < 1:
        raise ValueError(f"{group_size=} must be at least 1.")
    buffer_sizes = [int(DefaultCostModel.cost(block)) for block in blocked_params]
    costs = [load_balancing_config.cost_model.cost(block) for block in blocked_params]
    ranks = _assign_greedily(costs, group_size)
    return tuple(zip(buffer_sizes, ranks, strict=True))


def _assign_greedily(costs: Sequence[float], group_size: int) -> list[int]:
    """Longest-processing-time-first assignment of jobs with `costs` to `group_size` workers."""
    loads: list[tuple[float, int]] = [(0.0, rank) for rank in range(group_size)]
    ranks = [0] * len(costs)
    for index in sorted(range(len(costs)), key=lambda i: costs[i], reverse=True):
        load, rank = heapq.heappop(loads)
        ranks[index] = rank
        heapq.heappush(loads, (load + costs[index], rank))
    return ranks


def _local_tensor(tensor: Tensor) -> Tensor:
    """This rank's shard of a `DTensor`, or the tensor itself."""
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def prepare_update_param_buffers(params: Sequence[Tensor], group_size: int) -> list[Tensor]:
    """Receive buffers for `redistribute_and_update_params`: one per param, sized like its local shard.

    The buffers are views of a single zero-filled allocation. Empty buffers pad the list to a
    multiple of `group_size`, so every all-to-all round has one slot per rank.
    """
    local_params = [_local_tensor(param) for param in params]
    dtypes = {local.dtype for local in local_params}
    if len(dtypes) > 1:
        raise NotImplementedError(
            f"Parameters have mixed dtypes {sorted(map(str, dtypes))}; round-robin redistribution needs one dtype."
        )
    if not local_params:
        return []
    numels = [local.numel() for local in local_params]
    padding = -len(numels) % group_size
    flat_buffer = torch.zeros(sum(numels), dtype=local_params[0].dtype, device=local_params[0].device)
    return list(torch.split(flat_buffer, numels + [0] * padding))


def redistribute_and_update_params(
    params: Sequence[Tensor],
    local_full_params: Sequence[Tensor],
    update_param_buffers: Sequence[Tensor],
    dist_group: dist.ProcessGroup | None,
) -> None:
    """Scatter the full params each rank owns back into every rank's dim-0 shard.

    Params are owned round robin (param `i` by rank `i % group_size`); `local_full_params` are
    this rank's owned full params in order. In round `k`, every rank splits its `k`-th owned
    param into `group_size` dim-0 chunks (shard `j` goes to rank `j`, matching `Shard(0)`) and
    receives into `update_param_buffers[k*group_size:(k+1)*group_size]`. Finally each buffer is
    copied into the local shard of its param.
    """
    group_size = dist.get_world_size(dist_group)
    num_rounds = len(update_param_buffers) // group_size
    for round_index in range(num_rounds):
        owned = local_full_params[round_index] if round_index < len(local_full_params) else None
        dist.all_to_all(
            output_tensor_list=list(update_param_buffers[round_index * group_size : (round_index + 1) * group_size]),
            input_tensor_list=_dim0_chunks(owned, group_size, update_param_buffers[0]),
            group=dist_group,
        )
    with torch.no_grad():  # params are leaves that require grad
        for param, buffer in zip(params, update_param_buffers, strict=False):
            _local_tensor(param).view(-1).copy_(buffer)


def _dim0_chunks(full_param: Tensor | None, group_size: int, like: Tensor) -> list[Tensor]:
    """Exactly `group_size` flat dim-0 chunks of `full_param` (empty chunks pad; `None` sends nothing)."""
    if full_param is None:
        return [like.new_empty(0) for _ in range(group_size)]
    chunks = [chunk.contiguous().view(-1) for chunk in torch.chunk(full_param, group_size, dim=0)]
    return chunks + [full_param.new_empty(0) for _ in range(group_size - len(chunks))]


# One set of side streams per device, reused across steps (see `run_on_side_streams`).
_SIDE_STREAMS: dict[torch.device, list["torch.cuda.Stream"]] = {}


def _side_streams(device: torch.device, count: int) -> list["torch.cuda.Stream"]:
    streams = _SIDE_STREAMS.setdefault(device, [])
    while len(streams) < count:
        streams.append(torch.cuda.Stream(device))
    return streams[:count]


def run_on_side_streams(tasks: Sequence[Callable[[], T]], num_streams: int, device: torch.device) -> list[T]:
    """Results of `tasks`, in order; on CUDA with `num_streams > 1` they run concurrently on side streams.

    Each side stream is driven by its own host thread (see `run_concurrently`). The side streams first wait
    for the work already queued on the caller's stream, and the caller's stream waits for all of them before
    this returns: callers see ordinary single-stream ordering. Calls such as `torch.linalg.eigh` on small
    matrices leave the GPU partly idle (launch gaps, host synchronisations), which the other streams fill; every
    task still runs the same kernels on the same inputs, so results are bitwise those of running them in turn.
    """
    if num_streams < 1:
        raise ValueError(f"{num_streams=} must be at least 1.")
    if num_streams == 1 or device.type != "cuda" or len(tasks) < 2:
        return [task() for task in tasks]
    caller = torch.cuda.current_stream(device)
    streams = _side_streams(device, min(num_streams, len(tasks)))

    @contextmanager
    def on_side_stream(stream: "torch.cuda.Stream") -> Iterator[None]:
        stream.wait_stream(caller)
        with torch.cuda.device(device), torch.cuda.stream(stream):
            yield

    try:
        results = run_concurrently(tasks, [partial(on_side_stream, stream) for stream in streams])
    finally:
        for stream in streams:
            caller.wait_stream(stream)
    for result in results:
        _record_on_stream(result, caller)
    return results


def run_concurrently(
    tasks: Sequence[Callable[[], T]], worker_contexts: Sequence[Callable[[], AbstractContextManager[object]]]
) -> list[T]:
    """Results of `tasks`, in order, computed by one host thread per worker context.

    Each thread enters its context once, then takes the next task from a shared queue until none is left (so
    a few large tasks and many small ones balance). Tasks must not share mutable Python state. After every
    thread has finished, the first exception a task raised (in worker order) is raised here.
    """
    if tasks and not worker_contexts:
        raise ValueError("run_concurrently needs at least one worker context when there are tasks.")
    next_task = iter(range(len(tasks)))  # next() on a shared iterator is atomic under the GIL
    results: list[T | None] = [None] * len(tasks)

    def drain(worker_context: Callable[[], AbstractContextManager[object]]) -> None:
        with worker_context():
            for index in next_task:
                results[index] = tasks[index]()

    with ThreadPoolExecutor(max_workers=max(1, len(worker_contexts))) as pool:
        futures = [pool.submit(drain, context) for context in worker_contexts]
    for future in futures:
        future.result()
    return results  # type: ignore[return-value]  # every slot was filled, or future.result() raised


def _record_on_stream(value: object, stream: "torch.cuda.Stream") -> None:
    """Marks the tensors in `value` (nested tuples/lists) as used by `stream`, so that the caching allocator does
    not hand their memory to the side stream that made them before `stream` has consumed them."""
    if isinstance(value, Tensor):
        value.record_stream(stream)
    elif isinstance(value, (tuple, list)):
        for item in value:
            _record_on_stream(item, stream)
