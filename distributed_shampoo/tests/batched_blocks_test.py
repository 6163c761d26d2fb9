"""`ShampooRuntimeConfig(batch_same_shape_blocks=True)` against the per-block path: bitwise the same parameters and
state on the CPU, in float64 and float32, with three batched block shapes among blocks that stay per block, runs
cut by the batch size and by the step's direction parts, and a block without a gradient in the middle of a batch."""

import io
from typing import Any

import pytest
import torch
from torch import Tensor

import distributed_shampoo.distributed_shampoo as distributed_shampoo_module
import distributed_shampoo.preconditioner.shampoo_preconditioner_list as shampoo_list_module
from distributed_shampoo import (
    AdamPreconditionerConfig,
    DistributedShampoo,
    EigenvalueCorrectedShampooPreconditionerConfig,
    RootInvKLShampooPreconditionerConfig,
    RootInvShampooPreconditionerConfig,
    WeightDecayType,
)
from distributed_shampoo.distributor.shampoo_block_info import BlockInfo
from distributed_shampoo.shampoo_types import ShampooRuntimeConfig

# With max_preconditioner_dim 20: (16, 16) stays one block; (24, 16) is cut into (20, 16) and (4, 16), whose side 4
# is below the batched minimum; (16, 40) into two (16, 20); (7,) is one vector block. Batched: 4 × (16, 16),
# 3 × (20, 16), 6 × (16, 20).
SHAPES = [(16, 16), (24, 16), (16, 40), (7,), (16, 16), (24, 16), (16, 40), (16, 16), (24, 16), (16, 40), (16, 16)]
NUM_STEPS = 8
NO_GRADIENT = {(4, 4)}  # (step, parameter): the second (16, 16) skips step 4, splitting its batch's run


def make_optimizer(params: list[torch.nn.Parameter], dtype: torch.dtype, batched: bool, **extra: Any) -> DistributedShampoo:
    preconditioner = extra.pop(
        "preconditioner_config",
        RootInvShampooPreconditionerConfig(use_symmetric_packing=False, factor_matrix_dtype=dtype, inv_factor_matrix_dtype=dtype),
    )
    return DistributedShampoo(
        params,
        lr=0.01,
        betas=(0.9, 0.95),
        epsilon=1e-8,
        weight_decay=0.1,
        weight_decay_type=WeightDecayType.DECOUPLED,
        max_preconditioner_dim=20,
        precondition_frequency=2,
        start_preconditioning_step=2,
        grafting_config=AdamPreconditionerConfig(beta2=0.95, epsilon=1e-10),
        preconditioner_config=preconditioner,
        shampoo_runtime_config=ShampooRuntimeConfig(batch_same_shape_blocks=batched),
        **extra,
    )


def problem(dtype: torch.dtype) -> tuple[list[Tensor], list[list[Tensor]]]:
    generator = torch.Generator().manual_seed(0)
    initial = [torch.randn(shape, generator=generator, dtype=torch.float64).to(dtype) for shape in SHAPES]
    grads = [[torch.randn(shape, generator=generator, dtype=torch.float64).to(dtype) for shape in SHAPES] for _ in range(NUM_STEPS)]
    return initial, grads


def train(dtype: torch.dtype, batched: bool, steps: range = range(1, NUM_STEPS + 1), **extra: Any) -> tuple[list[Tensor], DistributedShampoo]:
    initial, grads = problem(dtype)
    params = [torch.nn.Parameter(value.clone()) for value in initial]
    optimizer = make_optimizer(params, dtype, batched, **extra)
    run_steps(optimizer, params, grads, steps)
    return params, optimizer


def run_steps(optimizer: DistributedShampoo, params: list[torch.nn.Parameter], grads: list[list[Tensor]], steps: range) -> None:
    for step in steps:
        for index, (param, grad) in enumerate(zip(params, grads[step - 1], strict=True)):
            param.grad = None if (step, index) in NO_GRADIENT else grad.clone()
        optimizer.step()


def state_tensors(optimizer: DistributedShampoo) -> list[Tensor]:
    tensors: list[Tensor] = []

    def collect(value: Any) -> None:
        if isinstance(value, Tensor):
            tensors.append(value)
        elif isinstance(value, dict):
            for key in sorted(value, key=str):
                collect(value[key])

    collect(optimizer.state_dict()["state"])
    return tensors


def assert_bitwise(a: list[Tensor], b: list[Tensor]) -> None:
    assert len(a) == len(b)
    for x, y in zip(a, b, strict=True):
        assert x.shape == y.shape and x.dtype == y.dtype
        assert torch.equal(x, y), f"largest difference {(x.double() - y.double()).abs().max().item()}"


@pytest.fixture
def small_runs_and_parts(monkeypatch: pytest.MonkeyPatch) -> None:
    """Batched runs of at most two or three blocks, and direction parts that cut through the batches."""
    monkeypatch.setattr(shampoo_list_module, "_MIN_BATCH_BYTES", 3 * 16 * 20 * 8 * 3)
    monkeypatch.setattr(shampoo_list_module, "_BATCH_STATE_FRACTION", 0.0)
    monkeypatch.setattr(distributed_shampoo_module, "_MIN_DIRECTION_PART_BYTES", 5 * 16 * 20 * 8)
    monkeypatch.setattr(distributed_shampoo_module, "_DIRECTION_PART_STATE_FRACTION", 0.0)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.usefixtures("small_runs_and_parts")
def test_batched_blocks_are_bitwise_the_per_block_path(dtype: torch.dtype, monkeypatch: pytest.MonkeyPatch) -> None:
    per_block_params, per_block = train(dtype, batched=False)

    bmm_calls = []
    original_bmm = torch.bmm

    def counting_bmm(a: Tensor, b: Tensor) -> Tensor:
        bmm_calls.append(a.shape[0])
        return original_bmm(a, b)

    monkeypatch.setattr(torch, "bmm", counting_bmm)
    batched_params, batched = train(dtype, batched=True)
    assert bmm_calls and max(bmm_calls) > 1  # the batched path ran

    # The three shapes live in three sets of stacks (factors and inverse roots), the other blocks in their own tensors.
    blocks = batched._group_runtimes[0].shampoo._local_blocks  # type: ignore[attr-defined]
    shapes = {tuple(b.factor_dims): b.batch for b in blocks if b.batch is not None}
    assert set(shapes) == {(16, 16), (20, 16), (16, 20)}
    assert sorted(stacks.num_blocks for stacks in shapes.values()) == [3, 4, 6]
    assert all(len(stacks.stacks) == 4 for stacks in shapes.values())  # L, R and their inverse roots
    assert sum(b.batch is None for b in blocks) == 3 + 1  # the (4, 16) blocks and the vector

    assert_bitwise([p.detach() for p in batched_params], [p.detach() for p in per_block_params])
    assert_bitwise(state_tensors(batched), state_tensors(per_block))


def test_batched_checkpoints_load_into_either_path() -> None:
    """A batched optimizer's state dict holds the same keys and values as a per-block one's; loaded into either,
    the run continues bitwise as an uninterrupted per-block run."""
    dtype = torch.float64
    uninterrupted, _ = train(dtype, batched=False)
    halfway, batched = train(dtype, batched=True, steps=range(1, 5))
    buffer = io.BytesIO()
    torch.save(batched.state_dict(), buffer)
    _, grads = problem(dtype)
    for resume_batched in (False, True):
        params = [torch.nn.Parameter(p.detach().clone()) for p in halfway]
        resumed = make_optimizer(params, dtype, resume_batched)
        buffer.seek(0)
        resumed.load_state_dict(torch.load(buffer, weights_only=False))
        run_steps(resumed, params, grads, range(5, NUM_STEPS + 1))
        assert_bitwise([p.detach() for p in params], [p.detach() for p in uninterrupted])


@pytest.mark.parametrize(
    ("preconditioner_config", "message"),
    [
        (
            RootInvShampooPreconditionerConfig(),  # packed storage, the package default
            r"batch_same_shape_blocks=True\) needs square factors: pass RootInvShampooPreconditionerConfig\(use_symmetric_packing=False\)",
        ),
        (
            RootInvKLShampooPreconditionerConfig(use_symmetric_packing=False),
            r"batch_same_shape_blocks=True\) does not support RootInvKLShampooPreconditionerConfig, only RootInv",
        ),
        (
            EigenvalueCorrectedShampooPreconditionerConfig(),
            r"batch_same_shape_blocks=True\) does not support EigenvalueCorrectedShampooPreconditionerConfig, only RootInv",
        ),
    ],
    ids=["packed", "KL", "eigenvalue-corrected"],
)
def test_configs_that_cannot_batch_refuse_it(preconditioner_config: Any, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        train(torch.float64, batched=True, steps=range(1, 2), preconditioner_config=preconditioner_config)


def test_batched_allocation_keeps_the_distributors_other_functions() -> None:
    """Only the zeros and identity allocations hand out slices of the stacks (allocated through the distributor's
    zeros allocation); the distributor's ones allocation and get_tensor stay its own."""
    allocated: list[tuple[int, ...]] = []

    def zeros(size: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> Tensor:
        allocated.append(tuple(size))
        return torch.zeros(size, dtype=dtype, device=device)

    def ones(size: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> Tensor:
        return torch.ones(size, dtype=dtype, device=device)

    def local(tensor: Tensor) -> Tensor:
        return tensor

    info = BlockInfo(torch.zeros(3, 3), (0, "block_0"), allocate_zeros_tensor=zeros)
    info.allocate_ones_tensor, info.get_tensor = ones, local
    stacks = shampoo_list_module._BlockStacks(2)
    cpu = torch.device("cpu")
    slices = []
    for index in range(2):  # every block allocates its state in the same order: a factor, then an inverse root
        allocating = stacks.allocating(info, index)
        assert allocating.get_tensor is local and allocating.allocate_ones_tensor is ones
        slices.append((allocating.allocate_zeros_tensor(size=(3, 3), dtype=torch.float64, device=cpu),
                       allocating.allocate_eye_tensor(3, dtype=torch.float64, device=cpu)))
    assert allocated == [(2, 3, 3), (2, 3, 3)]  # one stack per slot, allocated for the first block
    for index, (factor, root) in enumerate(slices):
        assert factor.data_ptr() == stacks.stacks[0][index].data_ptr() and root.data_ptr() == stacks.stacks[1][index].data_ptr()
        assert not factor.any() and torch.equal(root, torch.eye(3, dtype=torch.float64))
    assert info.allocate_zeros_tensor is zeros  # the caller's block info is unchanged
