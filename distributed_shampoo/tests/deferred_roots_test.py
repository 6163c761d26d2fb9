"""`ShampooRuntimeConfig(defer_amortized_computation=True)`: a root step's roots are computed after the step, in
the background, and first used at the next step. It changes the math (so it is off by default): checked against
the float64 reference with that schedule. Overlapping the computation with the caller's work gives bitwise the
results of running it at the end of the step without overlap; state dicts and failures wait for it."""

from typing import Any

import pytest
import torch
from torch import Tensor

import distributed_shampoo.preconditioner.shampoo_preconditioner_list as shampoo_list_module
from distributed_shampoo import (
    AdamPreconditionerConfig,
    CoupledHigherOrderConfig,
    DistributedShampoo,
    EigendecomposedKLShampooPreconditionerConfig,
    EigendecomposedShampooPreconditionerConfig,
    EigenvalueCorrectedShampooPreconditionerConfig,
    RootInvKLShampooPreconditionerConfig,
    RootInvShampooPreconditionerConfig,
)
from distributed_shampoo.shampoo_types import PreconditionerValueError, ShampooRuntimeConfig
from distributed_shampoo.tests.helpers import AtTheEndOfTheStep, compare_with_reference

SHAPES = [(12, 10), (10, 12), (7,), (12, 10)]
NUM_STEPS = 9


def make_optimizer(params: list[torch.nn.Parameter], deferred: bool, **extra: Any) -> DistributedShampoo:
    return DistributedShampoo(
        params,
        lr=0.01,
        betas=(0.9, 0.95),
        epsilon=1e-8,
        weight_decay=0.1,
        max_preconditioner_dim=64,
        precondition_frequency=2,
        start_preconditioning_step=2,
        grafting_config=AdamPreconditionerConfig(beta2=0.95, epsilon=1e-10),
        shampoo_runtime_config=ShampooRuntimeConfig(defer_amortized_computation=deferred),
        **extra,
    )


def train(deferred: bool, between_steps: Any = None, **extra: Any) -> tuple[list[Tensor], DistributedShampoo]:
    generator = torch.Generator().manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(shape, generator=generator, dtype=torch.float64)) for shape in SHAPES]
    optimizer = make_optimizer(params, deferred, **extra)
    for step in range(1, NUM_STEPS + 1):
        for param in params:
            param.grad = torch.randn(param.shape, generator=generator, dtype=torch.float64)
        optimizer.step()
        if between_steps is not None:
            between_steps(step, optimizer)
    optimizer.finish_amortized_computations()
    return [param.detach().clone() for param in params], optimizer


def busy_caller(step: int, optimizer: DistributedShampoo) -> None:
    """What a training loop does meanwhile: some work of its own on the caller's thread."""
    a = torch.randn(256, 256, dtype=torch.float64)
    for _ in range(5):
        a = torch.tanh(a @ a.T / 256)


def test_deferred_roots_match_the_float64_reference_with_roots_one_step_later() -> None:
    compare_with_reference(7, torch.float64, deferred=True, shampoo_runtime_config=ShampooRuntimeConfig(defer_amortized_computation=True))


def test_deferred_roots_change_the_math() -> None:
    deferred, _ = train(deferred=True)
    default, _ = train(deferred=False)
    assert any(not torch.equal(a, b) for a, b in zip(deferred, default, strict=True))


def test_overlapped_roots_equal_roots_computed_at_the_end_of_the_step(monkeypatch: pytest.MonkeyPatch) -> None:
    calls = []
    original = shampoo_list_module._BackgroundComputation

    def counting(*args: Any) -> Any:
        calls.append(1)
        return original(*args)

    monkeypatch.setattr(shampoo_list_module, "_BackgroundComputation", counting)
    overlapped, _ = train(deferred=True, between_steps=busy_caller)
    assert len(calls) == 4  # root steps 2, 4, 6, 8
    monkeypatch.setattr(shampoo_list_module, "_BackgroundComputation", AtTheEndOfTheStep)
    sequential, _ = train(deferred=True, between_steps=busy_caller)
    for a, b in zip(overlapped, sequential, strict=True):
        assert torch.equal(a, b)


def test_a_state_dict_waits_for_the_roots_in_flight(monkeypatch: pytest.MonkeyPatch) -> None:
    """Taken right after a root step, while its roots may still be computed, a state dict holds the new roots."""
    dicts: dict[str, list[dict[str, Any]]] = {"overlapped": [], "sequential": []}

    def keep_state(name: str) -> Any:
        def after_step(step: int, optimizer: DistributedShampoo) -> None:
            if step % 2 == 0:
                roots = optimizer.state_dict()["state"][0]["block_0"]["shampoo"]["inv_factor_matrices"]
                dicts[name].append({key: root.clone() for key, root in roots.items()})  # the state's own tensors change
        return after_step

    train(deferred=True, between_steps=keep_state("overlapped"))
    monkeypatch.setattr(shampoo_list_module, "_BackgroundComputation", AtTheEndOfTheStep)
    train(deferred=True, between_steps=keep_state("sequential"))
    assert len(dicts["overlapped"]) == 4
    for overlapped, sequential in zip(dicts["overlapped"], dicts["sequential"], strict=True):
        assert all(torch.equal(overlapped[k], sequential[k]) for k in sequential)
    assert not torch.equal(dicts["overlapped"][0][0], dicts["overlapped"][1][0])  # each root step stored new roots


def test_a_failure_in_the_background_is_raised_by_the_next_step() -> None:
    params = [torch.nn.Parameter(torch.ones(12, 10, dtype=torch.float64))]
    optimizer = make_optimizer(params, deferred=True)
    params[0].grad = torch.ones(12, 10, dtype=torch.float64)
    optimizer.step()
    params[0].grad = torch.full((12, 10), float("nan"), dtype=torch.float64)
    optimizer.step()  # root step 2: its roots are computed after it, from a NaN factor
    params[0].grad = torch.ones(12, 10, dtype=torch.float64)
    with pytest.raises(PreconditionerValueError, match="Encountered nan/inf values in factor matrix"):
        optimizer.step()


def shampoo_state(optimizer: DistributedShampoo) -> list[Tensor]:
    """Every factor and inverse root of every block, in a fixed order."""
    state = optimizer.state_dict()["state"]
    return [
        tensor
        for param in sorted(state)
        for block in sorted(key for key in state[param] if key.startswith("block_"))
        for name in ("factor_matrices", "inv_factor_matrices")
        for _, tensor in sorted(state[param][block]["shampoo"][name].items())
    ]


@pytest.mark.parametrize(
    "preconditioner_config",
    [RootInvShampooPreconditionerConfig(), RootInvKLShampooPreconditionerConfig()],
    ids=["RootInv", "RootInvKL"],
)
def test_deferral_changes_only_when_the_roots_are_used(preconditioner_config: Any) -> None:
    """The factors and roots are bitwise those of the default schedule, KL's factors too (they are fed the roots of
    the previous root step either way); only the parameters, preconditioned with older roots, differ."""
    deferred_params, deferred = train(deferred=True, preconditioner_config=preconditioner_config)
    default_params, default = train(deferred=False, preconditioner_config=preconditioner_config)
    deferred_state, default_state = shampoo_state(deferred), shampoo_state(default)
    assert len(deferred_state) == len(default_state) == 2 * (3 * 2 + 1)  # factors and roots: 3 matrices, 1 vector
    for a, b in zip(deferred_state, default_state, strict=True):
        assert torch.equal(a, b)
    assert any(not torch.equal(a, b) for a, b in zip(deferred_params, default_params, strict=True))


@pytest.mark.parametrize(
    "preconditioner_config",
    [
        EigendecomposedShampooPreconditionerConfig(),
        EigendecomposedKLShampooPreconditionerConfig(),
        EigenvalueCorrectedShampooPreconditionerConfig(),
    ],
    ids=lambda config: type(config).__name__,
)
def test_other_variants_refuse_deferral(preconditioner_config: Any) -> None:
    name = type(preconditioner_config).__name__
    with pytest.raises(ValueError, match=rf"defer_amortized_computation=True\) does not support {name}, only RootInv"):
        train(deferred=True, preconditioner_config=preconditioner_config)


def test_configs_that_flip_a_global_flag_refuse_deferral() -> None:
    config = RootInvShampooPreconditionerConfig(
        amortized_computation_config=CoupledHigherOrderConfig(rel_epsilon=0.0, abs_epsilon=1e-8, disable_tf32=True)
    )
    with pytest.raises(ValueError, match=r"cannot run CoupledHigherOrderConfig\(disable_tf32=True\) in the background"):
        train(deferred=True, preconditioner_config=config)
