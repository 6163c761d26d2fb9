"""A step forms and applies its search directions a part of the blocks at a time (`_direction_parts`): the same
numbers as whole lists, with temporaries the size of a part instead of four times every parameter."""

import math
import os
import tempfile
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import distributed_shampoo.distributed_shampoo as module
from distributed_shampoo import (
    AdamPreconditionerConfig,
    DDPDistributedConfig,
    DistributedShampoo,
    EigenvalueCorrectedShampooPreconditionerConfig,
    GeneralizedPrimalAveragingConfig,
    RootInvShampooPreconditionerConfig,
    ScheduleFreeConfig,
    SGDPreconditionerConfig,
    SingleDeviceDistributedConfig,
    WeightDecayType,
)
from distributed_shampoo.distributor.shampoo_distributor import Distributor
from distributed_shampoo.shampoo_types import ClassicMomentumConfig
from distributed_shampoo.tests.root_step_test import LiveStorageBytes

# max_preconditioner_dim 32 cuts nothing: every block is a whole, contiguous parameter.
SHAPES = [(24, 16), (16, 24), (20, 20), (12,), (24, 16), (8, 30)]
FREQUENCY = 3
NUM_STEPS = 9


def config(**overrides: Any) -> dict[str, Any]:
    arguments: dict[str, Any] = dict(
        lr=0.01,
        betas=(0.9, 0.95),
        epsilon=1e-8,
        weight_decay=0.1,
        max_preconditioner_dim=32,
        precondition_frequency=FREQUENCY,
        start_preconditioning_step=2 * FREQUENCY,  # steps 1-5 use the grafting method alone
        grafting_config=AdamPreconditionerConfig(beta2=0.95, epsilon=1e-10),
    )
    arguments.update(overrides)
    return arguments


def make_params(seed: int = 0) -> list[torch.nn.Parameter]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(shape, generator=generator)) for shape in SHAPES]


def run(optimizer_arguments: dict[str, Any], distributed_config: Any = None) -> list[torch.Tensor]:
    """Parameters and optimizer state after NUM_STEPS steps; parameter 2 gets no gradient at step 4 (masking)."""
    params = make_params()
    optimizer = DistributedShampoo(
        params, **optimizer_arguments, distributed_config=distributed_config or SingleDeviceDistributedConfig()
    )
    generator = torch.Generator().manual_seed(1)
    for step in range(1, NUM_STEPS + 1):
        for index, param in enumerate(params):
            grad = torch.randn(param.shape, generator=generator)
            param.grad = None if (step == 4 and index == 2) else grad
        optimizer.step()
    state = optimizer.state_dict()["state"]
    tensors = [value for value in torch.utils._pytree.tree_leaves(state) if isinstance(value, torch.Tensor)]
    return [param.detach().clone() for param in params] + tensors


def set_part_bytes(monkeypatch: pytest.MonkeyPatch, part_bytes: float) -> list[int]:
    """Parts of at most `part_bytes` of gradients (at least one block each); returns the number of parts per step."""
    monkeypatch.setattr(module, "_DIRECTION_PART_STATE_FRACTION", 0.0)
    monkeypatch.setattr(module, "_MIN_DIRECTION_PART_BYTES", part_bytes)
    counts: list[int] = []
    original = DistributedShampoo._direction_parts

    def spy(self: DistributedShampoo, *args: Any) -> list[tuple[int, int]]:
        parts = original(self, *args)
        counts.append(len(parts))
        return parts

    monkeypatch.setattr(DistributedShampoo, "_direction_parts", spy)
    return counts


CONFIGS = {
    "record": config(preconditioner_config=RootInvShampooPreconditionerConfig(use_symmetric_packing=False)),
    "packed": config(),
    "nesterov momentum": config(iterate_averaging_config=ClassicMomentumConfig(momentum=0.9, dampening=0.1, use_nesterov=True)),
    "momentum, no weight decay": config(weight_decay=0.0, iterate_averaging_config=ClassicMomentumConfig(momentum=0.5)),
    "GPA": config(iterate_averaging_config=GeneralizedPrimalAveragingConfig(eval_interp_coeff=0.5, train_interp_coeff=0.7)),
    "Schedule-Free": config(iterate_averaging_config=ScheduleFreeConfig(train_interp_coeff=0.5)),
    "L2, SGD grafting": config(weight_decay_type=WeightDecayType.L2, grafting_config=SGDPreconditionerConfig()),
    "no grafting": config(grafting_config=None, start_preconditioning_step=FREQUENCY),
    "eigenvalue-corrected": config(preconditioner_config=EigenvalueCorrectedShampooPreconditionerConfig()),
    "beta3": config(beta3=0.5),
}


@pytest.mark.parametrize("name", list(CONFIGS))
def test_parts_give_the_numbers_of_whole_lists(name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    counts = set_part_bytes(monkeypatch, math.inf)
    whole = run(CONFIGS[name])
    assert set(counts) == {1}
    counts.clear()
    monkeypatch.setattr(module, "_MIN_DIRECTION_PART_BYTES", 0)  # one block per part
    parts = run(CONFIGS[name])
    assert max(counts) == len(SHAPES)
    for got, want in zip(parts, whole, strict=True):
        torch.testing.assert_close(got, want, rtol=0, atol=0)


def test_parts_hold_about_their_part_size_of_gradient_bytes(monkeypatch: pytest.MonkeyPatch) -> None:
    set_part_bytes(monkeypatch, 2000)
    params = [torch.nn.Parameter(torch.zeros(shape)) for shape in [(10, 10), (10, 10), (30, 30), (5,), (5,), (10, 10)]]
    optimizer = DistributedShampoo(params, **config())
    grads = tuple(torch.zeros(param.shape) for param in params)  # 400, 400, 3600, 20, 20 and 400 bytes
    runtime = optimizer._group_runtimes[0]
    blocks = runtime.distributor.local_masked_blocked_params
    assert optimizer._direction_parts(runtime, grads, blocks) == [(0, 2), (2, 3), (3, 6)]


@pytest.mark.parametrize(
    "reason", ["a non-contiguous block", "two dtypes", "a compiled direction", "a distributor without parts"]
)
def test_lists_stay_whole_where_parts_could_change_the_numbers(reason: str, monkeypatch: pytest.MonkeyPatch) -> None:
    set_part_bytes(monkeypatch, 0)
    params = [torch.nn.Parameter(torch.zeros(shape)) for shape in [(10, 10), (10, 10), (10, 10)]]
    optimizer = DistributedShampoo(params, **config())
    runtime = optimizer._group_runtimes[0]
    grads = tuple(torch.zeros(param.shape) for param in params)
    blocks = runtime.distributor.local_masked_blocked_params
    assert len(optimizer._direction_parts(runtime, grads, blocks)) == 3
    if reason == "a non-contiguous block":
        grads = (grads[0], torch.zeros(10, 10).T, grads[2])
    elif reason == "two dtypes":
        grads = (grads[0], grads[1].double(), grads[2])
    elif reason == "a compiled direction":
        optimizer._compiled_direction = module._direction
    else:
        monkeypatch.setattr(Distributor, "applies_updates_in_parts", False)
    assert optimizer._direction_parts(runtime, grads, blocks) == [(0, 3)]


def test_a_distributor_that_applies_whole_updates_gets_them_whole(monkeypatch: pytest.MonkeyPatch) -> None:
    """`_select_distributor_class` may return a distributor that implements only `update_params`."""

    class WholeUpdates(Distributor):
        applies_updates_in_parts = False

        def update_local_params(self, *args: Any) -> None:
            raise AssertionError("not used")

    expected = run(CONFIGS["record"])
    set_part_bytes(monkeypatch, 0)
    monkeypatch.setattr(DistributedShampoo, "_select_distributor_class", lambda self, config: WholeUpdates)
    for got, want in zip(run(CONFIGS["record"]), expected, strict=True):
        torch.testing.assert_close(got, want, rtol=0, atol=0)


def non_root_step_peak(monkeypatch: pytest.MonkeyPatch, part_bytes: float) -> tuple[int, int]:
    """(peak bytes of temporaries, gradient bytes) of a Shampoo step without root computation: 12 blocks of 64×64."""
    set_part_bytes(monkeypatch, part_bytes)
    params = [torch.nn.Parameter(torch.zeros(64, 64)) for _ in range(12)]
    arguments = config(max_preconditioner_dim=64, start_preconditioning_step=FREQUENCY)
    arguments["preconditioner_config"] = RootInvShampooPreconditionerConfig(use_symmetric_packing=False)
    optimizer = DistributedShampoo(params, **arguments)
    generator = torch.Generator().manual_seed(0)
    for step in range(1, FREQUENCY + 2):
        for param in params:
            param.grad = torch.randn(param.shape, generator=generator)
        if step < FREQUENCY + 1:
            optimizer.step()
    with LiveStorageBytes() as tracker:
        optimizer.step()  # step 4: Shampoo directions, no root computation
    return tracker.peak, sum(param.numel() * 4 for param in params)


def test_a_step_holds_four_parts_of_temporaries_instead_of_four_copies_of_every_parameter(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The first moment, the Shampoo direction, the grafting denominator and direction are alive together; with
    parts of 3 blocks (48 KiB) that is 4 × 48 KiB plus one block's intermediate product, not 4 × 192 KiB."""
    block = 64 * 64 * 4
    whole_peak, total = non_root_step_peak(monkeypatch, math.inf)
    assert whole_peak >= 4 * total
    parts_peak, _ = non_root_step_peak(monkeypatch, 3 * block)
    assert parts_peak <= 4 * 3 * block + block + 1024, (parts_peak, whole_peak)


# ------------------------------------------------------------------------------------------------------ DDP


def _ddp_worker(rank: int, init_file: str, results: Any) -> None:
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=2)
    try:
        module._DIRECTION_PART_STATE_FRACTION = 0.0
        module._MIN_DIRECTION_PART_BYTES = 0  # one block per part
        results[rank] = {
            communicate_params: run(
                CONFIGS["record"], DDPDistributedConfig(communicate_params=communicate_params, num_trainers_per_group=-1)
            )[: len(SHAPES)]
            for communicate_params in (False, True)
        }
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
def test_ddp_with_parts_equals_one_process() -> None:
    with tempfile.TemporaryDirectory() as directory:
        results = mp.get_context("spawn").Manager().dict()  # not forked from a parent with threads
        # spawn: a child forked after the parent ran an OpenMP parallel region deadlocks in its own first one.
        mp.start_processes(_ddp_worker, args=(os.path.join(directory, "init"), results), nprocs=2, start_method="spawn")
        expected = run(CONFIGS["record"])[: len(SHAPES)]
        for rank in range(2):
            for communicate_params in (False, True):
                for got, want in zip(results[rank][communicate_params], expected, strict=True):
                    torch.testing.assert_close(got, want, rtol=0, atol=0)
