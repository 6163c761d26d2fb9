import math
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager, nullcontext

import pytest
import torch

from distributed_shampoo.shampoo_types import LoadBalancingConfig
from distributed_shampoo.utils.load_balancing_utils import PolynomialComputationalCostModel
from distributed_shampoo.utils.shampoo_utils import (
    ContinueOnCaller,
    compress_list,
    distribute_buffer_sizes,
    generate_pairwise_indices,
    get_dtype_size,
    merge_small_dims,
    multi_dim_split,
    pack_upper_triangular,
    packed_dimension,
    run_concurrently,
    run_on_side_streams,
    unpack_upper_triangular,
)

CONV_SHAPE = (32, 3, 64, 64)


@pytest.mark.parametrize(
    ("shape", "threshold", "target", "expected"),
    [
        ((1, 2, 5, 1), 10, 1, (10,)),
        ((1, 2, 5, 1), 1, 1, (2, 5)),
        ((1, 2, 5, 1), 10, math.inf, (1, 2, 5, 1)),
        ((), 10, 1, (1,)),
        ((1, 1, 1), 10, 1, (1,)),
        ((1, 1, 1), math.inf, 1, (1,)),
        ((0,), 10, 1, (0,)),
        ((5, 0, 3), 10, 1, (0,)),
        ((1, 5, 10, 20, 0), 10, 1, (0,)),
        (CONV_SHAPE, 8192, 1, (96, 4096)),
        (CONV_SHAPE, 1024, 2, (32, 192, 64)),
        (CONV_SHAPE, 1_000_000, 1, (393216,)),
        (CONV_SHAPE, 1_000_000, 2, (32, 12288)),
        (CONV_SHAPE, 8192, 3, (32, 3, 4096)),
        (CONV_SHAPE, 8192, 4, CONV_SHAPE),
        (CONV_SHAPE, 8192, math.inf, CONV_SHAPE),
        (CONV_SHAPE, 200, 1, (32, 192, 64)),
        (CONV_SHAPE, 10, 1, CONV_SHAPE),
        ((2, 3, 4), 12, 1, (2, 12)),
        ((4, 3, 2), 12, 1, (4, 6)),
        ((2, 3, 4), math.inf, 1, (24,)),
        ((2, 3, 4), math.inf, 2, (2, 12)),
        ((10, 1, 10), 100, 2, (10, 10)),
        ((768, 768), 8192, 1, (768, 768)),
        ((3072, 768), 8192, 1, (3072, 768)),
    ],
)
def test_merge_small_dims(
    shape: tuple[int, ...], threshold: float, target: float, expected: tuple[int, ...]
) -> None:
    assert merge_small_dims(shape, threshold, target) == expected


def test_merge_small_dims_accepts_torch_size_and_lists() -> None:
    assert merge_small_dims(torch.Size((2, 3, 4)), 12, 1) == (2, 12)
    assert merge_small_dims([2, 3, 4], 12, 1) == (2, 12)


def test_merge_small_dims_rejects_finite_float_target() -> None:
    with pytest.raises(AssertionError):
        merge_small_dims((2, 3), 10, 1.5)
    merge_small_dims((2, 3), 10, 1)  # cached; the float 1.0 below must still be rejected
    with pytest.raises(AssertionError):
        merge_small_dims((2, 3), 10, 1.0)


def _pieces(tensor: torch.Tensor, split_size: float) -> list[list[object]]:
    return [piece.tolist() for piece in multi_dim_split(tensor, split_size)]


def test_multi_dim_split_5x3_by_2() -> None:
    assert _pieces(torch.arange(15).reshape(5, 3), 2) == [
        [[0, 1], [3, 4]],
        [[2], [5]],
        [[6, 7], [9, 10]],
        [[8], [11]],
        [[12, 13]],
        [[14]],
    ]


@pytest.mark.parametrize("split_size", [5, math.inf])
def test_multi_dim_split_large_split_size_gives_one_piece(split_size: float) -> None:
    tensor = torch.arange(15).reshape(5, 3)
    (piece,) = multi_dim_split(tensor, split_size)
    assert torch.equal(piece, tensor)


@pytest.mark.parametrize(
    ("tensor", "split_size", "shapes"),
    [
        (torch.arange(10).reshape(5, 2), 3, [(3, 2), (2, 2)]),
        (torch.zeros(7, 10), 4, [(4, 4), (4, 4), (4, 2), (3, 4), (3, 4), (3, 2)]),
        (torch.tensor(1.0), 2, [()]),
        (torch.zeros(0), 2, [(0,)]),
    ],
)
def test_multi_dim_split_shapes(tensor: torch.Tensor, split_size: int, shapes: list[tuple[int, ...]]) -> None:
    assert [tuple(piece.shape) for piece in multi_dim_split(tensor, split_size)] == shapes


def test_multi_dim_split_returns_views() -> None:
    tensor = torch.zeros(4, 4)
    for piece in multi_dim_split(tensor, 2):
        piece.add_(1.0)
    assert torch.equal(tensor, torch.ones(4, 4))


def test_multi_dim_split_rejects_finite_float() -> None:
    with pytest.raises(AssertionError):
        multi_dim_split(torch.zeros(3), 2.0)


@pytest.mark.parametrize(
    ("complete_list", "selector", "expected"),
    [
        ([1, 2, 3], (True, True, False), (1, 2)),
        ([1, 2, 3], (True, False, True), (1, 3)),
        ((), (), ()),
    ],
)
def test_compress_list(complete_list: list[int], selector: tuple[bool, ...], expected: tuple[int, ...]) -> None:
    assert compress_list(complete_list, selector) == expected


def test_compress_list_length_mismatch_reports_both_lengths() -> None:
    with pytest.raises(AssertionError, match=r"len\(complete_list\)=3.*len\(selector\)=2"):
        compress_list([1, 2, 3], (True, False))


@pytest.mark.parametrize(
    ("dtype", "size"),
    [
        (torch.float64, 8),
        (torch.float32, 4),
        (torch.bfloat16, 2),
        (torch.float16, 2),
        (torch.int64, 8),
        (torch.int16, 2),
        (torch.int8, 1),
        (torch.uint8, 1),
        (torch.float8_e4m3fn, 1),
        (torch.bool, 1),
    ],
)
def test_get_dtype_size(dtype: torch.dtype, size: int) -> None:
    assert get_dtype_size(dtype) == size


@pytest.mark.parametrize(
    ("counts", "expected"),
    [
        ((1, 3, 2), [(0, 1), (1, 4), (4, 6)]),
        ((), []),
        ((0, 2, 0), [(0, 0), (0, 2), (2, 2)]),
        ([2, 3, 1], [(0, 2), (2, 5), (5, 6)]),
    ],
)
def test_generate_pairwise_indices(counts: tuple[int, ...], expected: list[tuple[int, int]]) -> None:
    assert list(generate_pairwise_indices(counts)) == expected


def _meta(sizes: tuple[int, ...], dtype: torch.dtype = torch.bool) -> tuple[torch.Tensor, ...]:
    return tuple(torch.empty(size, dtype=dtype, device="meta") for size in sizes)


@pytest.mark.parametrize(
    ("sizes", "group_size", "expected"),
    [
        ((128, 64, 500, 256), 2, ((128, 1), (64, 1), (512, 0), (256, 1))),
        ((128, 64, 500, 256), 1, ((128, 0), (64, 0), (512, 0), (256, 0))),
        ((128, 64), 4, ((128, 0), (64, 1))),
        ((), 2, ()),
        ((10,) * 5, 2, ((64, 0), (64, 1), (64, 0), (64, 1), (64, 0))),
    ],
)
def test_distribute_buffer_sizes_default_cost_model(
    sizes: tuple[int, ...], group_size: int, expected: tuple[tuple[int, int], ...]
) -> None:
    assert distribute_buffer_sizes(_meta(sizes), group_size, LoadBalancingConfig()) == expected


@pytest.mark.parametrize(
    ("coefficients", "sizes", "expected_ranks"),
    [
        ((0, 0, 1), (256, 128, 384, 256), (1, 1, 0, 1)),  # 384**2 == 256**2 + 256**2 + 128**2
        ((0, 2), (128, 64, 512, 256), (1, 1, 0, 1)),
    ],
)
def test_distribute_buffer_sizes_polynomial_cost_model(
    coefficients: tuple[float, ...], sizes: tuple[int, ...], expected_ranks: tuple[int, ...]
) -> None:
    config = LoadBalancingConfig(cost_model=PolynomialComputationalCostModel(coefficients=coefficients))
    assignment = distribute_buffer_sizes(_meta(sizes), 2, config)
    # Buffer sizes stay the aligned byte counts whatever cost model picks the ranks.
    assert tuple(size for size, _ in assignment) == tuple(-(-size // 64) * 64 for size in sizes)
    assert tuple(rank for _, rank in assignment) == expected_ranks


def test_distribute_buffer_sizes_rejects_empty_group() -> None:
    with pytest.raises(ValueError, match="group_size=0 must be at least 1"):
        distribute_buffer_sizes(_meta((10,)), 0, LoadBalancingConfig())


def test_distribute_buffer_sizes_gpt_like_blocks_on_three_ranks() -> None:
    blocks = tuple(
        torch.empty(shape, dtype=torch.float32, device="meta") for shape in [(768, 768)] * 4 + [(3072, 768)] * 2
    )
    assert distribute_buffer_sizes(blocks, 3, LoadBalancingConfig()) == ((2359296, 2),) * 4 + (
        (9437184, 0),
        (9437184, 1),
    )


def test_distribute_buffer_sizes_record_blocks_on_eight_ranks() -> None:
    """The Track 3 record: 12 layers of q, k, v, attn proj (768x768), MLP fc (3072x768) and proj (768x3072)."""
    layer = [(768, 768)] * 4 + [(3072, 768), (768, 3072)]
    blocks = [torch.empty(shape, device="meta") for _ in range(12) for shape in layer]
    assignment = distribute_buffer_sizes(blocks, 8, LoadBalancingConfig())
    assert [rank for _, rank in assignment[:6]] == [0, 1, 2, 3, 0, 1]
    for rank in range(8):
        owned = [size for size, owner in assignment if owner == rank]
        assert sorted(owned) == [2359296] * 6 + [9437184] * 3
        assert sum(owned) == 42_467_328


# ------------------------------------------------------------------------------------------- concurrent tasks


def test_run_concurrently_returns_results_in_task_order_and_uses_every_worker() -> None:
    entered: list[str] = []
    all_started = threading.Barrier(3)

    @contextmanager
    def worker(name: str):  # type: ignore[no-untyped-def]
        entered.append(name)
        all_started.wait(timeout=10)  # fails (BrokenBarrierError) unless the three workers run at the same time
        yield

    tasks = [lambda i=i: i * i for i in range(20)]
    results = run_concurrently(tasks, [lambda n=n: worker(n) for n in ("a", "b", "c")])
    assert results == [i * i for i in range(20)]
    assert sorted(entered) == ["a", "b", "c"]


def test_run_concurrently_runs_each_task_once() -> None:
    calls = [0] * 50

    def task(i: int) -> int:
        calls[i] += 1
        return i

    assert run_concurrently([lambda i=i: task(i) for i in range(50)], [nullcontext] * 4) == list(range(50))
    assert calls == [1] * 50


def test_run_concurrently_raises_a_task_exception_after_all_workers_finish() -> None:
    finished: list[int] = []

    def task(i: int) -> int:
        if i == 3:
            raise ZeroDivisionError("task 3")
        finished.append(i)
        return i

    with pytest.raises(ZeroDivisionError, match="task 3"):
        run_concurrently([lambda i=i: task(i) for i in range(10)], [nullcontext] * 2)
    assert sorted(finished) == [0, 1, 2, 4, 5, 6, 7, 8, 9]  # the other worker drained the queue


def test_run_concurrently_needs_a_worker_for_tasks() -> None:
    with pytest.raises(ValueError, match="at least one worker context"):
        run_concurrently([lambda: 1], [])
    assert run_concurrently([], []) == []


def test_run_on_side_streams_on_cpu_runs_in_order_on_the_calling_thread() -> None:
    threads: list[int] = []

    def task(i: int) -> int:
        threads.append(threading.get_ident())
        return i

    assert run_on_side_streams([lambda i=i: task(i) for i in range(5)], 4, torch.device("cpu")) == list(range(5))
    assert set(threads) == {threading.get_ident()}


def _track_cost_in_flight(costs: list[float], budget: float, num_workers: int) -> tuple[list[int], float, list[set[int]]]:
    """Run tasks of the given costs on `num_workers` threads; return the results, the largest total cost of tasks
    running at once, and which tasks ran beside each task."""
    lock = threading.Lock()
    running: dict[int, float] = {}
    peak = 0.0
    company: list[set[int]] = [set() for _ in costs]

    def task(i: int) -> int:
        nonlocal peak
        with lock:
            running[i] = costs[i]
            peak = max(peak, sum(running.values()))
            for other in running:
                company[other] |= set(running) - {other}
        time.sleep(0.01)
        with lock:
            del running[i]
        return i

    results = run_concurrently([lambda i=i: task(i) for i in range(len(costs))], [nullcontext] * num_workers, costs, budget)
    return results, peak, company


def test_run_concurrently_keeps_the_cost_in_flight_within_the_budget() -> None:
    costs = [100.0, 100.0, 100.0] + [10.0] * 12  # large tasks first, as the root step orders them
    results, peak, company = _track_cost_in_flight(costs, budget=130.0, num_workers=4)
    assert results == list(range(len(costs)))
    assert peak <= 130.0
    assert not company[0] & {1, 2}  # two large tasks never run together...
    assert any(company[i] & {3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14} for i in range(3))  # ...but small ones join them


def test_run_concurrently_runs_a_task_larger_than_the_budget_alone() -> None:
    results, peak, company = _track_cost_in_flight([500.0, 1.0, 1.0, 1.0], budget=100.0, num_workers=3)
    assert results == [0, 1, 2, 3]
    assert company[0] == set() and peak <= 500.0


def test_run_concurrently_rejects_costs_of_the_wrong_length() -> None:
    with pytest.raises(ValueError, match="len\\(costs\\)=1 must equal len\\(tasks\\)=2"):
        run_concurrently([lambda: 1, lambda: 2], [nullcontext], [1.0], 10.0)


def test_run_on_side_streams_rejects_zero_streams() -> None:
    with pytest.raises(ValueError, match="num_streams=0 must be at least 1"):
        run_on_side_streams([lambda: 1], 0, torch.device("cpu"))


def test_continuations_run_on_the_calling_thread_and_give_the_results() -> None:
    """A task may hand the rest of its work (on CUDA: its matmuls) to the thread that called run_concurrently."""
    caller = threading.get_ident()
    where: dict[str, set[int]] = {"task": set(), "continuation": set()}

    def task(i: int) -> ContinueOnCaller[int]:
        where["task"].add(threading.get_ident())
        return ContinueOnCaller(lambda a, b: (where["continuation"].add(threading.get_ident()), a * 10 + b)[1], (i, 1))  # type: ignore[arg-type]

    assert run_concurrently([lambda i=i: task(i) for i in range(12)], [nullcontext] * 3) == [i * 10 + 1 for i in range(12)]
    assert where["continuation"] == {caller} and caller not in where["task"]


def test_run_on_side_streams_off_cuda_runs_each_continuation_right_after_its_task() -> None:
    events: list[str] = []

    def task(i: int) -> ContinueOnCaller[int]:
        events.append(f"task {i}")
        return ContinueOnCaller(lambda: (events.append(f"continuation {i}"), i)[1])

    assert run_on_side_streams([lambda i=i: task(i) for i in range(3)], 8, torch.device("cpu")) == [0, 1, 2]
    assert events == ["task 0", "continuation 0", "task 1", "continuation 1", "task 2", "continuation 2"]


def test_a_task_costs_until_its_continuation_returns() -> None:
    """The scheduler never starts a task whose cost exceeds the free budget, counting tasks whose continuation has
    not yet run on the calling thread: their tensors are still alive."""
    costs = [100.0] * 3 + [10.0] * 9
    budget = 130.0
    lock = threading.Lock()
    holding: dict[int, float] = {}
    peak = 0.0

    def hold(i: int) -> None:
        nonlocal peak
        with lock:
            holding[i] = costs[i]
            peak = max(peak, sum(holding.values()))

    def release(i: int) -> int:
        time.sleep(0.005)  # the calling thread is slow to get to it: the cost must stay in flight meanwhile
        with lock:
            del holding[i]
        return i

    def task(i: int) -> ContinueOnCaller[int]:
        hold(i)
        time.sleep(0.002)
        return ContinueOnCaller(lambda: release(i))

    results = run_concurrently([lambda i=i: task(i) for i in range(len(costs))], [nullcontext] * 4, costs, budget)
    assert results == list(range(len(costs)))
    assert 100.0 < peak <= budget  # small tasks joined a large one, never a second large one


def test_a_failing_continuation_is_raised_after_every_task_has_run() -> None:
    ran: list[int] = []

    def task(i: int) -> ContinueOnCaller[int]:
        def finish() -> int:
            if i == 2:
                raise ArithmeticError("continuation 2")
            ran.append(i)
            return i

        return ContinueOnCaller(finish)

    with pytest.raises(ArithmeticError, match="continuation 2"):
        run_concurrently([lambda i=i: task(i) for i in range(8)], [nullcontext] * 3, [1.0] * 8, 2.0)
    assert sorted(ran) == [0, 1, 3, 4, 5, 6, 7]


def test_the_first_failing_task_in_task_order_is_raised() -> None:
    def task(i: int) -> int:
        if i in (5, 1):
            time.sleep(0.01 if i == 1 else 0.0)  # task 1 fails after task 5
            raise ValueError(f"task {i}")
        return i

    with pytest.raises(ValueError, match="task 1"):
        run_concurrently([lambda i=i: task(i) for i in range(8)], [nullcontext] * 4)


def test_persistent_executors_run_each_worker_on_the_same_thread_every_time() -> None:
    """Side-stream workers keep one host thread each across root steps (so torch's thread-local cuBLAS handle meets
    one stream, not a new one at every step)."""
    executors = [ThreadPoolExecutor(max_workers=1) for _ in range(3)]
    try:
        seen: list[dict[str, int]] = []
        for _ in range(3):
            threads: dict[str, int] = {}

            def context_of(name: str):  # type: ignore[no-untyped-def]
                @contextmanager
                def context():  # type: ignore[no-untyped-def]
                    threads[name] = threading.get_ident()
                    yield

                return context

            run_concurrently([lambda i=i: i for i in range(9)], [context_of(n) for n in "abc"], executors=executors)
            seen.append(dict(threads))
        assert seen[0] == seen[1] == seen[2] and len(set(seen[0].values())) == 3
    finally:
        for executor in executors:
            executor.shutdown()


def test_run_concurrently_needs_one_executor_per_context() -> None:
    with ThreadPoolExecutor(max_workers=1) as executor:
        with pytest.raises(ValueError, match="len\\(executors\\)=1 must equal len\\(worker_contexts\\)=2"):
            run_concurrently([lambda: 1], [nullcontext] * 2, executors=[executor])


# ------------------------------------------------------------------------------------------ symmetric packing


def test_pack_upper_triangular_layout() -> None:
    matrix = torch.arange(16.0).reshape(4, 4)
    packed = pack_upper_triangular(matrix)
    # (0,0) (0,1) (0,2) (0,3) (1,1) (1,2) (1,3) (2,2) (2,3) (3,3): diagonal entry i at i·d - i·(i-1)/2.
    assert packed.tolist() == [0, 1, 2, 3, 5, 6, 7, 10, 11, 15]
    assert [packed[i * 4 - i * (i - 1) // 2].item() for i in range(4)] == [0, 5, 10, 15]
    assert pack_upper_triangular(torch.tensor([[7.0]])).shape == (1,)


def test_unpack_mirrors_the_upper_triangle_exactly() -> None:
    generator = torch.Generator().manual_seed(0)
    matrix = torch.randn(5, 5, generator=generator, dtype=torch.float64)
    unpacked = unpack_upper_triangular(pack_upper_triangular(matrix))
    upper = torch.ones(5, 5, dtype=torch.bool).triu()
    assert torch.equal(unpacked[upper], matrix[upper])
    assert torch.equal(unpacked, unpacked.T)  # bitwise symmetric: the lower triangle is the upper one plus zero
    symmetric = matrix + matrix.T
    assert torch.equal(unpack_upper_triangular(pack_upper_triangular(symmetric)), symmetric)


def _unpacked_by_loops(packed: list[float], dim: int) -> list[list[float]]:
    """The plain layout: row i holds (i,i), (i,i+1), …, (i,d-1), one row after another."""
    matrix = [[0.0] * dim for _ in range(dim)]
    offset = 0
    for i in range(dim):
        for j in range(i, dim):
            matrix[i][j] = matrix[j][i] = packed[offset]
            offset += 1
    return matrix


@pytest.mark.parametrize("dim", [1, 2, 5])
def test_unpack_with_the_published_dim_argument_matches_a_plain_reference(dim: int) -> None:
    generator = torch.Generator().manual_seed(dim)
    packed = torch.randn(dim * (dim + 1) // 2, generator=generator, dtype=torch.float64)
    expected = torch.tensor(_unpacked_by_loops(packed.tolist(), dim), dtype=torch.float64)
    assert torch.equal(unpack_upper_triangular(packed, dim), expected)  # positional, as the published tests call it
    assert torch.equal(unpack_upper_triangular(packed, dim=dim), expected)
    assert torch.equal(unpack_upper_triangular(packed), expected)  # our inferred size gives the same matrix
    assert unpack_upper_triangular(torch.zeros(0, dtype=torch.float64), 0).shape == (0, 0)


@pytest.mark.parametrize("dim", [2, 4, -1])
def test_unpack_refuses_a_dim_that_does_not_fit_the_packed_length(dim: int) -> None:
    with pytest.raises(ValueError, match=f"dim={dim} does not fit 6 packed entries"):
        unpack_upper_triangular(torch.zeros(6), dim)


@pytest.mark.parametrize(("num_packed", "dimension"), [(1, 1), (3, 2), (6, 3), (4_720_128, 3072)])
def test_packed_dimension(num_packed: int, dimension: int) -> None:
    assert packed_dimension(num_packed) == dimension


def test_bad_packed_shapes_are_rejected() -> None:
    with pytest.raises(ValueError, match="5 entries are not the upper triangle"):
        unpack_upper_triangular(torch.zeros(5))
    with pytest.raises(ValueError, match="packed upper triangle is 1-D"):
        unpack_upper_triangular(torch.zeros(2, 3))
    with pytest.raises(ValueError, match="Only square matrices"):
        pack_upper_triangular(torch.zeros(2, 3))
