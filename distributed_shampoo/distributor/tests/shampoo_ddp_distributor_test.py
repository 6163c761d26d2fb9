"""DDP distributor on 2 gloo processes: equal to the single-device optimizer, and checkpoints round-trip."""

import os
import tempfile
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.multiprocessing as mp
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict, set_optimizer_state_dict

from distributed_shampoo import (
    AdamPreconditionerConfig,
    DDPDistributedConfig,
    DistributedShampoo,
    SingleDeviceDistributedConfig,
    WeightDecayType,
)

WORLD_SIZE = 2
# (6,4), (4,), (3,3), (8,2), (2,) with max_preconditioner_dim 3 give 4+2+1+3+1 = 11 blocks: odd, so the
# two ranks cannot own equally many.
SHAPES = [(6, 4), (4,), (3, 3), (8, 2), (2,)]
MAX_PRECONDITIONER_DIM = 3
NUM_STEPS = 7


def make_params(seed: int = 0) -> list[torch.nn.Parameter]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(shape, generator=generator)) for shape in SHAPES]


def gradients(step: int) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(1000 + step)
    grads = [torch.randn(shape, generator=generator) for shape in SHAPES]
    if step == 3:  # a step where one parameter gets no gradient exercises the masking
        grads[2] = None
    return grads


def make_optimizer(params: list[torch.nn.Parameter], distributed_config: Any) -> DistributedShampoo:
    return DistributedShampoo(
        params,
        lr=0.01,
        betas=(0.9, 0.95),
        epsilon=1e-8,
        weight_decay=0.2,
        weight_decay_type=WeightDecayType.DECOUPLED,
        max_preconditioner_dim=MAX_PRECONDITIONER_DIM,
        precondition_frequency=2,
        start_preconditioning_step=-1,
        grafting_config=AdamPreconditionerConfig(beta2=0.95, epsilon=1e-10),
        distributed_config=distributed_config,
    )


def run_steps(optimizer: DistributedShampoo, params: list[torch.nn.Parameter], steps: range) -> None:
    for step in steps:
        for param, grad in zip(params, gradients(step), strict=True):
            param.grad = grad
        optimizer.step()


def single_device_params(num_steps: int) -> list[torch.Tensor]:
    params = make_params()
    run_steps(make_optimizer(params, SingleDeviceDistributedConfig()), params, range(num_steps))
    return [param.detach().clone() for param in params]


def _worker(rank: int, init_file: str, checkpoint_dir: str, results: Any) -> None:
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=WORLD_SIZE)
    try:
        outcome: dict[str, Any] = {}
        for communicate_params in (False, True):
            config = DDPDistributedConfig(communicate_params=communicate_params, num_trainers_per_group=-1)
            params = make_params()
            optimizer = make_optimizer(params, config)
            run_steps(optimizer, params, range(NUM_STEPS))
            outcome[f"params_{communicate_params}"] = [param.detach().clone() for param in params]
            state = optimizer.state_dict()["state"]
            outcome[f"state_keys_{communicate_params}"] = sorted(state)
            outcome[f"owned_{communicate_params}"] = sorted(
                (index, key) for index, entry in state.items() for key in entry if key.startswith("block_")
            )

        # One trainer per group: every rank computes every block itself.
        params = make_params()
        run_steps(make_optimizer(params, DDPDistributedConfig(num_trainers_per_group=1)), params, range(NUM_STEPS))
        outcome["params_one_trainer_per_group"] = [param.detach().clone() for param in params]

        # bfloat16 communication of the search directions only perturbs the update.
        params = make_params()
        run_steps(make_optimizer(params, DDPDistributedConfig(communication_dtype=torch.bfloat16)), params, range(NUM_STEPS))
        outcome["params_bf16"] = [param.detach().clone() for param in params]

        # A single one-block parameter leaves rank 1 without blocks; it still joins every all-gather.
        lone = [torch.nn.Parameter(torch.ones(2, 2))]
        lone_optimizer = DistributedShampoo(lone, lr=0.1, distributed_config=DDPDistributedConfig())
        for step in range(3):
            lone[0].grad = torch.full((2, 2), float(step + 1))
            lone_optimizer.step()
        outcome["lone"] = lone[0].detach().clone()

        # Checkpoint after 4 steps with torch.distributed.checkpoint, resume in a fresh optimizer.
        config = DDPDistributedConfig(communicate_params=True)
        params = make_params()
        optimizer = make_optimizer(params, config)
        run_steps(optimizer, params, range(4))
        dcp.save({"optimizer": optimizer.state_dict(), "params": {str(i): p.detach() for i, p in enumerate(params)}}, checkpoint_id=checkpoint_dir)
        dist.barrier()
        resumed_params = make_params(seed=123)  # different values: everything must come from the checkpoint
        resumed = make_optimizer(resumed_params, config)
        to_load = {"optimizer": resumed.state_dict(), "params": {str(i): p.detach() for i, p in enumerate(resumed_params)}}
        dcp.load(to_load, checkpoint_id=checkpoint_dir)
        resumed.load_state_dict(to_load["optimizer"])
        run_steps(resumed, resumed_params, range(4, NUM_STEPS))
        outcome["resumed_params"] = [param.detach().clone() for param in resumed_params]
        outcome["dcp_state_dict_api"] = {
            flatten: _round_trip_with_state_dict_api(os.path.join(checkpoint_dir, f"api_{flatten}"), flatten)
            for flatten in (False, True)
        }
        results[rank] = outcome
    finally:
        dist.destroy_process_group()


def _make_model_and_optimizer(seed: int) -> tuple[torch.nn.Module, DistributedShampoo]:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.Linear(5, 3))
    return model, make_optimizer(list(model.parameters()), DDPDistributedConfig(communicate_params=True))


def _train_model(model: torch.nn.Module, optimizer: DistributedShampoo, steps: range) -> None:
    for step in steps:
        inputs = torch.randn(4, 6, generator=torch.Generator().manual_seed(100 + step))
        model.zero_grad()
        model(inputs).square().sum().backward()
        optimizer.step()


def _round_trip_with_state_dict_api(checkpoint_dir: str, flatten: bool) -> bool:
    """get/set_optimizer_state_dict (optionally flattened) + dcp.save/load after 3 of 6 steps == 6 steps straight."""
    model, optimizer = _make_model_and_optimizer(0)
    _train_model(model, optimizer, range(6))
    expected = [p.detach().clone() for p in model.parameters()]

    options = StateDictOptions(flatten_optimizer_state_dict=flatten)
    model, optimizer = _make_model_and_optimizer(0)
    _train_model(model, optimizer, range(3))
    dcp.save({"model": model.state_dict(), "optim": get_optimizer_state_dict(model, optimizer, options=options)}, checkpoint_id=checkpoint_dir)
    resumed_model, resumed = _make_model_and_optimizer(1)
    to_load = {"model": resumed_model.state_dict(), "optim": get_optimizer_state_dict(resumed_model, resumed, options=options)}
    dcp.load(to_load, checkpoint_id=checkpoint_dir)
    resumed_model.load_state_dict(to_load["model"])
    set_optimizer_state_dict(resumed_model, resumed, to_load["optim"], options=options)
    _train_model(resumed_model, resumed, range(3, 6))
    return all(torch.equal(a, b) for a, b in zip(expected, resumed_model.parameters(), strict=True))


@pytest.fixture(scope="module")
def ddp_results() -> dict[int, dict[str, Any]]:
    with tempfile.TemporaryDirectory() as directory:
        manager = mp.get_context("spawn").Manager()  # not forked: see start_method below
        results = manager.dict()
        mp.start_processes(
            _worker,
            args=(os.path.join(directory, "init"), os.path.join(directory, "checkpoint"), results),
            nprocs=WORLD_SIZE,
            # Not fork: a child forked after the parent ran an OpenMP parallel region (any earlier test may have)
            # deadlocks in its own first one.
            start_method="spawn",
        )
        return dict(results)


@pytest.mark.slow
@pytest.mark.parametrize("communicate_params", [False, True])
def test_ddp_is_bitwise_equal_to_single_device(ddp_results: dict[int, dict[str, Any]], communicate_params: bool) -> None:
    expected = single_device_params(NUM_STEPS)
    for rank in range(WORLD_SIZE):
        for got, want in zip(ddp_results[rank][f"params_{communicate_params}"], expected, strict=True):
            torch.testing.assert_close(got, want, rtol=0, atol=0)


@pytest.mark.slow
@pytest.mark.parametrize("communicate_params", [False, True])
def test_ddp_ranks_share_state_dict_keys_and_split_the_blocks(
    ddp_results: dict[int, dict[str, Any]], communicate_params: bool
) -> None:
    owned = [set(ddp_results[rank][f"owned_{communicate_params}"]) for rank in range(WORLD_SIZE)]
    assert all(ddp_results[rank][f"state_keys_{communicate_params}"] == list(range(len(SHAPES))) for rank in range(WORLD_SIZE))
    assert not owned[0] & owned[1]
    assert len(owned[0] | owned[1]) == 11
    # Equal aligned costs (64 B each) are dealt alternately in global block order: the load balancer gives each
    # block, heaviest first, to the least loaded rank, ties to the lowest (README.md, "Distribution").
    assert sorted(owned[0]) == [(0, "block_0"), (0, "block_2"), (1, "block_0"), (2, "block_0"), (3, "block_1"), (4, "block_0")]


@pytest.mark.slow
def test_ddp_checkpoint_round_trip_through_torch_distributed_checkpoint(ddp_results: dict[int, dict[str, Any]]) -> None:
    expected = single_device_params(NUM_STEPS)
    for rank in range(WORLD_SIZE):
        for got, want in zip(ddp_results[rank]["resumed_params"], expected, strict=True):
            torch.testing.assert_close(got, want, rtol=0, atol=0)


@pytest.mark.slow
def test_ddp_variants(ddp_results: dict[int, dict[str, Any]]) -> None:
    expected = single_device_params(NUM_STEPS)
    lone = torch.nn.Parameter(torch.ones(2, 2))
    lone_optimizer = DistributedShampoo([lone], lr=0.1)
    for step in range(3):
        lone.grad = torch.full((2, 2), float(step + 1))
        lone_optimizer.step()
    for rank in range(WORLD_SIZE):
        for got, want in zip(ddp_results[rank]["params_one_trainer_per_group"], expected, strict=True):
            torch.testing.assert_close(got, want, rtol=0, atol=0)
        for got, want in zip(ddp_results[rank]["params_bf16"], expected, strict=True):
            torch.testing.assert_close(got, want, rtol=2 * 1.6e-2, atol=2 * 1e-5)
        torch.testing.assert_close(ddp_results[rank]["lone"], lone.detach(), rtol=0, atol=0)
    assert not all(
        torch.equal(got, want) for got, want in zip(ddp_results[0]["params_bf16"], expected, strict=True)
    ), "bf16 communication should round the directions"


@pytest.mark.slow
@pytest.mark.parametrize("flatten", [False, True])
def test_ddp_round_trip_through_get_and_set_optimizer_state_dict(ddp_results: dict[int, dict[str, Any]], flatten: bool) -> None:
    assert all(ddp_results[rank]["dcp_state_dict_api"][flatten] for rank in range(WORLD_SIZE))
