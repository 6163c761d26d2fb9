"""Blocking, bookkeeping, symmetric packing and concurrency helpers used by the preconditioners and distributors."""

import heapq
import math
import os
import threading
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import AbstractContextManager, ExitStack, contextmanager
from dataclasses import dataclass
from functools import lru_cache, partial
from itertools import accumulate, pairwise
from queue import SimpleQueue
from typing import TYPE_CHECKING, Generic, TypeVar

import torch
from torch import Tensor

from distributed_shampoo.utils.load_balancing_utils import DefaultCostModel

if TYPE_CHECKING:  # imported for annotations only: shampoo_types itself imports the cost models
    from distributed_shampoo.shampoo_types import LoadBalancingConfig

T = TypeVar("T")


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


# ------------------------------------------------------------------------------------------ symmetric packing

# Flat positions of the upper triangle (row by row) of a d×d matrix, per (d, device); see `upper_triangular_indices`.
_UPPER_TRIANGULAR_INDICES: dict[tuple[int, torch.device], Tensor] = {}
_UPPER_TRIANGULAR_INDICES_LOCK = threading.Lock()


def packed_size(dimension: int) -> int:
    """Length of the packed upper triangle of a `dimension`×`dimension` matrix: d(d+1)/2."""
    return dimension * (dimension + 1) // 2


def packed_dimension(num_packed: int) -> int:
    """The d whose upper triangle has `num_packed` entries; ValueError if there is none."""
    dimension = (math.isqrt(1 + 8 * num_packed) - 1) // 2
    if packed_size(dimension) != num_packed:
        raise ValueError(f"{num_packed} entries are not the upper triangle of a square matrix (d(d+1)/2 for no d).")
    return dimension


def upper_triangular_indices(dimension: int, device: torch.device) -> Tensor:
    """Flat indices of the entries i <= j of a `dimension`×`dimension` matrix, row by row, cached per device.

    Call it once from the main thread before worker threads use a size: a cached tensor created on one CUDA
    stream and read from another without synchronisation could be read before it is written.
    """
    key = (dimension, torch.device(device))
    indices = _UPPER_TRIANGULAR_INDICES.get(key)  # a dict read is atomic; only creation takes the lock
    if indices is None:
        with _UPPER_TRIANGULAR_INDICES_LOCK:
            indices = _UPPER_TRIANGULAR_INDICES.get(key)
            if indices is None:
                rows, columns = torch.triu_indices(dimension, dimension, device=device)
                indices = rows * dimension + columns
                _UPPER_TRIANGULAR_INDICES[key] = indices
    return indices


def pack_upper_triangular(matrix: Tensor) -> Tensor:
    """The upper triangle of a square matrix, row by row: (0,0), (0,1), …, (0,d-1), (1,1), …, (d-1,d-1).

    A new 1-D tensor of d(d+1)/2 entries; the entry (i, i) sits at offset i·d - i·(i-1)/2.
    """
    if matrix.dim() != 2 or matrix.shape[0] != matrix.shape[1]:
        raise ValueError(f"Only square matrices can be packed, got shape {tuple(matrix.shape)}.")
    return matrix.reshape(-1).index_select(0, upper_triangular_indices(matrix.shape[0], matrix.device))


def unpack_upper_triangular(packed: Tensor, dim: int | None = None) -> Tensor:
    """The symmetric `dim`×`dim` matrix whose upper triangle is `packed` (see `pack_upper_triangular`), as a new
    tensor.

    `dim` is the published signature's size argument; when it is left out, it is the d of d(d+1)/2 entries. A
    `dim` that does not fit the packed length is a ValueError. The lower triangle is an exact mirror: each
    off-diagonal entry is one packed value plus zero.
    """
    if packed.dim() != 1:
        raise ValueError(f"A packed upper triangle is 1-D, got shape {tuple(packed.shape)}.")
    if dim is None:
        dimension = packed_dimension(packed.numel())
    elif dim < 0 or packed_size(dim) != packed.numel():
        raise ValueError(
            f"{dim=} does not fit {packed.numel()} packed entries: the upper triangle of a {dim}×{dim} matrix has "
            f"{packed_size(max(dim, 0))}."
        )
    else:
        dimension = dim
    upper = packed.new_zeros(dimension, dimension)
    upper.view(-1).scatter_(0, upper_triangular_indices(dimension, packed.device), packed)
    matrix = upper + upper.mT  # the diagonal is doubled here and restored below
    matrix.diagonal().copy_(upper.diagonal())
    return matrix


# ------------------------------------------------------------------------------------------------ concurrency


@dataclass(frozen=True)
class ContinueOnCaller(Generic[T]):
    """What a task of `run_on_side_streams` / `run_concurrently` may return to hand the rest of its work to the
    calling thread: `function(*tensors)` runs there (on CUDA: on the caller's stream, after the task's stream has
    produced `tensors`), and its value becomes the task's result. The task's cost stays in flight until it returns.

    Why: torch gives every (thread, CUDA stream) pair that runs a matmul its own cuBLAS workspace (32 MiB on
    Hopper), allocated through the caching allocator and kept for the life of the process. Matmuls finished on the
    caller's thread and stream reuse the caller's workspace instead of adding one per side stream.
    """

    function: Callable[..., T]
    tensors: tuple[Tensor, ...] = ()


def _resolve(result: object) -> object:
    """A task's result, with a `ContinueOnCaller` carried out on the current thread."""
    if isinstance(result, ContinueOnCaller):
        return result.function(*result.tensors)
    return result


# Per process and device: side streams, each driven by one persistent host thread (see `run_on_side_streams`).
_SIDE_STREAM_WORKERS: dict[tuple[int, torch.device], list[tuple["torch.cuda.Stream", ThreadPoolExecutor]]] = {}
_SIDE_STREAM_WORKERS_LOCK = threading.Lock()


def _side_stream_workers(device: torch.device, count: int) -> list[tuple["torch.cuda.Stream", ThreadPoolExecutor]]:
    """`count` (stream, single-thread executor) pairs of `device`, created once per process and reused.

    The same thread always drives the same stream, so each side stream meets one set of the thread-local
    library handles (cuBLAS, cuSOLVER) of torch. New threads at every call would pair the handles, which threads
    inherit from a shared pool in no fixed order, with ever new streams, and torch keeps a cuBLAS workspace per
    (handle, stream) pair forever: up to streams² of them. Keyed by process id: a forked child has no threads.
    """
    key = (os.getpid(), torch.device(device))
    with _SIDE_STREAM_WORKERS_LOCK:
        workers = _SIDE_STREAM_WORKERS.setdefault(key, [])
        while len(workers) < count:
            name = f"shampoo-side-stream-{key[1]}-{len(workers)}"
            workers.append((torch.cuda.Stream(device), ThreadPoolExecutor(max_workers=1, thread_name_prefix=name)))
        return workers[:count]


def run_on_side_streams(
    tasks: Sequence[Callable[[], T | ContinueOnCaller[T]]],
    num_streams: int,
    device: torch.device,
    costs: Sequence[float] | None = None,
    max_cost_in_flight: float = math.inf,
) -> list[T]:
    """Results of `tasks`, in order; on CUDA with `num_streams > 1` they run concurrently on side streams.

    Each side stream is driven by its own persistent host thread (see `_side_stream_workers` and
    `run_concurrently`, which also explains `costs` and `max_cost_in_flight`). The side streams first wait for the
    work already queued on the caller's stream, and the caller's stream waits for all of them before this returns:
    callers see ordinary single-stream ordering. A task returning `ContinueOnCaller` has its continuation run on
    the calling thread and stream. Calls such as `torch.linalg.eigh` on small matrices leave the GPU partly idle
    (launch gaps, host synchronisations), which the other streams fill; every task still runs the same kernels on
    the same inputs, so results are bitwise those of running them in turn. Sequentially (one stream, or off CUDA)
    each task and its continuation run in turn on the calling thread.
    """
    if num_streams < 1:
        raise ValueError(f"{num_streams=} must be at least 1.")
    if num_streams == 1 or device.type != "cuda" or len(tasks) < 2:
        return [_resolve(task()) for task in tasks]  # type: ignore[misc]
    caller = torch.cuda.current_stream(device)
    workers = _side_stream_workers(device, min(num_streams, len(tasks)))
    for stream, _ in workers:
        # Now, from this thread: the continuations this thread queues on the caller later are no task's input.
        stream.wait_stream(caller)

    @contextmanager
    def on_side_stream(stream: "torch.cuda.Stream") -> Iterator[None]:
        with torch.cuda.device(device), torch.cuda.stream(stream):
            yield

    def on_caller_stream(ready: "torch.cuda.Event", continuation: ContinueOnCaller[T]) -> T:
        caller.wait_event(ready)
        for tensor in continuation.tensors:
            tensor.record_stream(caller)  # made on a side stream: not reused there before the caller is done
        return continuation.function(*continuation.tensors)

    def run_task(task: Callable[[], T | ContinueOnCaller[T]]) -> T | ContinueOnCaller[T]:
        result = task()
        if not isinstance(result, ContinueOnCaller):
            return result
        ready = torch.cuda.Event()
        ready.record()  # on this task's side stream
        return ContinueOnCaller(partial(on_caller_stream, ready, result))

    try:
        results = run_concurrently(
            [partial(run_task, task) for task in tasks],
            [partial(on_side_stream, stream) for stream, _ in workers],
            costs,
            max_cost_in_flight,
            executors=[executor for _, executor in workers],
        )
    finally:
        for stream, _ in workers:
            caller.wait_stream(stream)
    for result in results:
        _record_on_stream(result, caller)
    return results


class _TaskQueue:
    """Hands out task indices in list order to worker threads, keeping the running tasks' total cost bounded.

    When the next task would exceed the budget, a later task that fits is handed out instead (so small tasks
    fill the room a large one leaves); a task that exceeds the budget on its own runs when nothing else does.
    A task counts as running from `take` until `finish`.
    """

    def __init__(self, costs: Sequence[float], max_cost_in_flight: float) -> None:
        self._costs = costs
        self._max_cost_in_flight = max_cost_in_flight
        self._pending = list(range(len(costs)))
        self._cost_in_flight = 0.0
        self._num_running = 0
        self._condition = threading.Condition()

    def take(self) -> int | None:
        """The next task index to run, waiting for room if necessary; None when every task has been handed out."""
        with self._condition:
            while self._pending:
                for position, index in enumerate(self._pending):
                    if self._fits(self._costs[index]):
                        del self._pending[position]
                        self._cost_in_flight += self._costs[index]
                        self._num_running += 1
                        return index
                self._condition.wait()  # a running task will finish and notify
            return None

    def _fits(self, cost: float) -> bool:
        return self._num_running == 0 or self._cost_in_flight + cost <= self._max_cost_in_flight

    def finish(self, index: int) -> None:
        with self._condition:
            self._cost_in_flight -= self._costs[index]
            self._num_running -= 1
            self._condition.notify_all()


# A worker's message to the calling thread: (task index, result, exception), or None once it takes no more tasks.
_Message = tuple[int, object, BaseException | None] | None


def run_concurrently(
    tasks: Sequence[Callable[[], T | ContinueOnCaller[T]]],
    worker_contexts: Sequence[Callable[[], AbstractContextManager[object]]],
    costs: Sequence[float] | None = None,
    max_cost_in_flight: float = math.inf,
    executors: Sequence[ThreadPoolExecutor] | None = None,
) -> list[T]:
    """Results of `tasks`, in order, computed by one host thread per worker context.

    Each thread enters its context once, then takes the next task from a shared queue until none is left (so
    a few large tasks and many small ones balance). With `costs` (one per task, e.g. the bytes a task allocates),
    tasks start only while the running ones' costs sum to at most `max_cost_in_flight` (see `_TaskQueue`). A task
    that returns `ContinueOnCaller` has the continuation run on the calling thread, in completion order, and
    counts as running until it returns. Tasks must not share mutable Python state. Threads come from
    `executors` (one per context, e.g. persistent single-thread executors) or from a new pool. Every task runs;
    afterwards the exception of the first failing task (in task order) is raised here.
    """
    if tasks and not worker_contexts:
        raise ValueError("run_concurrently needs at least one worker context when there are tasks.")
    if costs is not None and len(costs) != len(tasks):
        raise ValueError(f"{len(costs)=} must equal {len(tasks)=}.")
    if executors is not None and len(executors) != len(worker_contexts):
        raise ValueError(f"{len(executors)=} must equal {len(worker_contexts)=}.")
    queue = _TaskQueue(costs if costs is not None else [0.0] * len(tasks), max_cost_in_flight)
    messages: SimpleQueue[_Message] = SimpleQueue()

    def drain(worker_context: Callable[[], AbstractContextManager[object]]) -> None:
        try:
            with worker_context():
                while (index := queue.take()) is not None:
                    try:
                        messages.put((index, tasks[index](), None))
                    except BaseException as exception:  # not handled: carried to the calling thread, which raises it
                        messages.put((index, None, exception))
                        if not isinstance(exception, Exception):
                            raise  # KeyboardInterrupt, SystemExit: this worker stops
        finally:
            messages.put(None)

    with ExitStack() as stack:
        if executors is None:
            executors = [stack.enter_context(ThreadPoolExecutor(max_workers=max(1, len(worker_contexts))))] * len(
                worker_contexts
            )
        futures = [executor.submit(drain, context) for executor, context in zip(executors, worker_contexts, strict=True)]
        results, failures = _collect(messages, len(futures), len(tasks), queue)
        for future in futures:
            future.result()  # re-raises what ended a worker outside its tasks (its context, or a BaseException)
    if failures:
        raise failures[min(failures)]
    return results  # type: ignore[return-value]  # every slot was filled, or an exception was raised above


def _collect(
    messages: "SimpleQueue[_Message]", num_workers: int, num_tasks: int, queue: _TaskQueue
) -> tuple[list[object], dict[int, BaseException]]:
    """Results and exceptions by task index, from the workers' messages; continuations run here."""
    results: list[object] = [None] * num_tasks
    failures: dict[int, BaseException] = {}
    while num_workers:
        message = messages.get()
        if message is None:
            num_workers -= 1
            continue
        index, result, exception = message
        del message  # a continuation's tensors must be freed before its cost leaves the budget
        try:
            if exception is None:
                results[index] = _resolve(result)
        except Exception as raised:  # not handled: raised after every task has run
            exception = raised
        finally:
            del result
            queue.finish(index)
        if exception is not None:
            failures[index] = exception
    return results, failures


def _record_on_stream(value: object, stream: "torch.cuda.Stream") -> None:
    """Marks the tensors in `value` (nested tuples/lists) as used by `stream`, so that the caching allocator does
    not hand their memory to the side stream that made them before `stream` has consumed them."""
    if isinstance(value, Tensor):
        value.record_stream(stream)
    elif isinstance(value, (tuple, list)):
        for item in value:
            _record_on_stream(item, stream)
