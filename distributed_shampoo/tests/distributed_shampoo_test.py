"""DistributedShampoo on one process: equality with plain float64 references, trajectories printed by the
published optimizer, torch-optimizer equivalences, argument validation and checkpoint round trips."""

import dataclasses
import io
import logging
import math
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import Tensor

from distributed_shampoo import (
    AdaGradPreconditionerConfig,
    AdamPreconditionerConfig,
    DistributedShampoo,
    EigenvalueCorrectedShampooPreconditionerConfig,
    FSDPDistributedConfig,
    FullyShardDistributedConfig,
    GeneralizedPrimalAveragingConfig,
    PreconditionerConfig,
    PseudoInverseConfig,
    RMSpropPreconditionerConfig,
    RootInvShampooPreconditionerConfig,
    ScheduleFreeConfig,
    SGDPreconditionerConfig,
    ShampooPT2CompileConfig,
    SingleDeviceDistributedConfig,
    WeightDecayType,
)
from distributed_shampoo.preconditioner.matrix_functions_types import EigenConfig
from distributed_shampoo.tests.helpers import (
    ReferenceBlock,
    compare_with_reference,
    random_problem,
    record_config,
    train_with_a_gradient_missing_at_step_2,
)

RECORD_GRADS = [[[1, 2], [3, 4]], [[0, 1], [-1, 2]], [[2, -1], [1, 1]], [[1, 1], [0, -2]]]


def run_2x2(initial: float, num_steps: int = 4, **config: Any) -> list[list[list[float]]]:
    weight = torch.nn.Parameter(torch.full((2, 2), initial))
    optimizer = DistributedShampoo([weight], **config)
    trajectory = []
    for grad in RECORD_GRADS[:num_steps]:
        weight.grad = torch.tensor(grad, dtype=torch.float32)
        optimizer.step()
        trajectory.append(weight.detach().tolist())
    return trajectory


# ------------------------------------------------------------------------ against the float64 reference


@pytest.mark.parametrize("num_steps", [1, 7])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_matches_plain_float64_reference(num_steps: int, dtype: torch.dtype) -> None:
    compare_with_reference(num_steps, dtype)


# torch.compile's keywords and defaults in torch 2.13, written out: ShampooPT2CompileConfig's fields there.
TORCH_2_13_COMPILE_KEYWORDS = {
    "fullgraph": False,
    "dynamic": None,
    "backend": None,
    "mode": None,
    "options": None,
    "name": None,
    "disable": False,
    "recompile_limit": None,
    "isolate_recompiles": False,
    "shapes_spec": None,
}


@pytest.mark.skipif(
    torch.__version__.split("+")[0].split(".")[:2] != ["2", "13"],
    reason=f"the fields written out are torch 2.13's torch.compile keywords; this is torch {torch.__version__}",
)
def test_compile_config_has_the_keywords_and_defaults_of_torch_compile() -> None:
    """As published: one keyword-only field per torch.compile parameter but `model`, with its default."""
    fields = dataclasses.fields(ShampooPT2CompileConfig)
    assert {f.name: f.default for f in fields} == TORCH_2_13_COMPILE_KEYWORDS
    assert [f.name for f in fields] == list(TORCH_2_13_COMPILE_KEYWORDS)
    with pytest.raises(TypeError, match="positional"):
        ShampooPT2CompileConfig(True)  # type: ignore[misc]  # keyword-only


def compile_nothing(calls: list[dict[str, Any]]) -> Callable[..., Any]:
    """Stands in for torch.compile in CPU tests (which do not compile; gpu_tests/ compiles on CUDA): records its
    keywords and returns the function as it is."""

    def compile_(function: Callable[..., Any], **keywords: Any) -> Callable[..., Any]:
        calls.append(keywords)
        return function

    return compile_


def test_compile_config_reaches_torch_compile_and_the_compiled_path_matches_the_float64_reference(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    calls: list[dict[str, Any]] = []
    monkeypatch.setattr(torch, "compile", compile_nothing(calls))
    config = ShampooPT2CompileConfig(fullgraph=True, mode="max-autotune-no-cudagraphs")
    compare_with_reference(7, torch.float64, shampoo_pt2_compile_config=config)
    assert calls == [dataclasses.asdict(config)] and calls[0]["fullgraph"] is True


# ------------------------------------------------ trajectories printed by the published optimizer (May 2026 copy)


def test_muon_equivalence_without_momentum_and_statistics() -> None:
    """betas (0, 0), one 2×2 block, lr 1: L^(-1/4)·G·R^(-1/4) = U·Vᵀ, so W1 = -U·Vᵀ."""
    (weight,) = run_2x2(0.0, num_steps=1, lr=1.0, betas=(0.0, 0.0), max_preconditioner_dim=2)
    torch.testing.assert_close(torch.tensor(weight), torch.tensor([[0.514496, -0.857493], [-0.857493, -0.514496]]), atol=1e-5, rtol=0)


def test_record_like_trajectory_and_state() -> None:
    weight = torch.nn.Parameter(torch.ones(2, 2))
    optimizer = DistributedShampoo([weight], **record_config(lr=0.1, max_preconditioner_dim=2, precondition_frequency=2))
    expected = [
        [[0.88, 0.88], [0.88, 0.88]],
        [[0.844086, 0.779978], [0.843150, 0.734391]],
        [[0.727562, 0.790406], [0.829396, 0.635519]],
        [[0.624003, 0.737646], [0.782426, 0.569363]],
    ]
    for grad, want in zip(RECORD_GRADS, expected, strict=True):
        weight.grad = torch.tensor(grad, dtype=torch.float32)
        optimizer.step()
        torch.testing.assert_close(weight.detach(), torch.tensor(want), atol=1e-5, rtol=0)

    block = optimizer.state_dict()["state"][0]["block_0"]
    close = lambda got, want: torch.testing.assert_close(got, torch.tensor(want), atol=1e-5, rtol=0)  # noqa: E731
    # Stored as packed upper triangles (the default use_symmetric_packing=True).
    close(block["shampoo"]["factor_matrices"][0], [0.596969, 0.509306, 1.592344])
    close(block["shampoo"]["factor_matrices"][1], [0.761312, 0.512412, 1.428000])
    close(block["shampoo"]["inv_factor_matrices"][0], [0.794056, -0.095987, 0.606463])
    close(block["shampoo"]["inv_factor_matrices"][1], [0.738685, -0.089204, 0.622624])
    close(block["adagrad"], [[0.282869, 0.314100], [0.478444, 1.113900]])
    close(block["filtered_grad"], [[0.3529, 0.2368], [0.2277, 0.3436]])


def test_record_like_trajectory_without_grafting() -> None:
    trajectory = run_2x2(1.0, **record_config(lr=0.1, max_preconditioner_dim=2, precondition_frequency=2, grafting_config=None))
    torch.testing.assert_close(torch.tensor(trajectory[0]), torch.tensor([[0.88, 0.78], [0.68, 0.58]]), atol=1e-5, rtol=0)
    torch.testing.assert_close(torch.tensor(trajectory[1]), torch.tensor([[0.851822, 0.716792], [0.655281, 0.494461]]), atol=1e-5, rtol=0)
    torch.testing.assert_close(torch.tensor(trajectory[3]), torch.tensor([[0.684845, 0.688397], [0.614313, 0.374887]]), atol=1e-5, rtol=0)


def test_l2_weight_decay_with_sgd_grafting_trajectory() -> None:
    trajectory = run_2x2(
        1.0,
        lr=0.1,
        betas=(0.0, 1.0),
        weight_decay=0.1,
        weight_decay_type=WeightDecayType.L2,
        max_preconditioner_dim=2,
        precondition_frequency=2,
        start_preconditioning_step=4,
        grafting_config=SGDPreconditionerConfig(),
    )
    expected = [
        [[0.89, 0.79], [0.69, 0.59]],
        [[0.8811, 0.6821], [0.7831, 0.3841]],
        [[0.672289, 0.775279], [0.675269, 0.280259]],
        [[0.558782, 0.646168], [0.658556, 0.459424]],
    ]
    torch.testing.assert_close(torch.tensor(trajectory), torch.tensor(expected), atol=1e-5, rtol=0)


def _compare_with_torch_optimizer(
    shampoo_config: dict[str, Any], make_torch_optimizer: Callable[[list[Tensor]], torch.optim.Optimizer], num_steps: int, atol: float = 1e-6
) -> None:
    generator = torch.Generator().manual_seed(3)
    initial = torch.randn(8, 6, generator=generator)
    grads = [torch.randn(8, 6, generator=generator) for _ in range(num_steps)]
    ours, theirs = torch.nn.Parameter(initial.clone()), torch.nn.Parameter(initial.clone())
    shampoo, reference = DistributedShampoo([ours], **shampoo_config), make_torch_optimizer([theirs])
    for grad in grads:
        ours.grad, theirs.grad = grad.clone(), grad.clone()
        shampoo.step()
        reference.step()
        torch.testing.assert_close(ours.detach(), theirs.detach(), atol=atol, rtol=0)


def test_record_config_equals_adamw_before_preconditioning_starts() -> None:
    adamw = lambda params: torch.optim.AdamW(params, lr=0.0015, betas=(0.9, 0.95), eps=1e-10, weight_decay=0.2)  # noqa: E731
    _compare_with_torch_optimizer(record_config(), adamw, num_steps=4)
    _compare_with_torch_optimizer(record_config(start_preconditioning_step=math.inf), adamw, num_steps=12)


@pytest.mark.parametrize(
    ("weight_decay_type", "torch_weight_decay"),
    [(WeightDecayType.DECOUPLED, 0.3), (WeightDecayType.CORRECTED, 0.3), (WeightDecayType.INDEPENDENT, 0.3 / 0.01)],
)
def test_decoupled_weight_decay_types_equal_adamw(weight_decay_type: WeightDecayType, torch_weight_decay: float) -> None:
    config = record_config(lr=0.01, weight_decay=0.3, weight_decay_type=weight_decay_type, start_preconditioning_step=math.inf)
    adamw = lambda params: torch.optim.AdamW(params, lr=0.01, betas=(0.9, 0.95), eps=1e-10, weight_decay=torch_weight_decay)  # noqa: E731
    _compare_with_torch_optimizer(config, adamw, num_steps=5)


def test_l2_weight_decay_equals_adam() -> None:
    config = record_config(lr=0.01, weight_decay=0.3, weight_decay_type=WeightDecayType.L2, start_preconditioning_step=math.inf)
    adam = lambda params: torch.optim.Adam(params, lr=0.01, betas=(0.9, 0.95), eps=1e-10, weight_decay=0.3)  # noqa: E731
    _compare_with_torch_optimizer(config, adam, num_steps=5)


def test_other_grafting_types_equal_torch_optimizers() -> None:
    never = dict(start_preconditioning_step=math.inf, lr=0.01)
    _compare_with_torch_optimizer(
        dict(never, betas=(0.0, 1.0), grafting_config=AdaGradPreconditionerConfig(epsilon=1e-10)),
        lambda params: torch.optim.Adagrad(params, lr=0.01, eps=1e-10),
        num_steps=5,
    )
    _compare_with_torch_optimizer(
        dict(never, betas=(0.0, 1.0), grafting_config=RMSpropPreconditionerConfig(beta2=0.99, epsilon=1e-8)),
        lambda params: torch.optim.RMSprop(params, lr=0.01, alpha=0.99, eps=1e-8),
        num_steps=5,
        atol=1e-5,
    )
    _compare_with_torch_optimizer(
        dict(never, betas=(0.0, 1.0), grafting_config=SGDPreconditionerConfig()),
        lambda params: torch.optim.SGD(params, lr=0.01),
        num_steps=5,
    )


def test_roots_are_recomputed_only_at_multiples_of_the_frequency() -> None:
    weight = torch.nn.Parameter(torch.zeros(6, 5))
    optimizer = DistributedShampoo([weight], **record_config(max_preconditioner_dim=8))
    inverse_roots = optimizer.state[weight]["block_0"]["shampoo"].inv_factor_matrices
    generator = torch.Generator().manual_seed(0)
    changed_at = []
    for step in range(1, 16):
        before = [root.clone() for root in inverse_roots]
        weight.grad = torch.randn(6, 5, generator=generator)
        optimizer.step()
        if any(not torch.equal(b, a) for b, a in zip(before, inverse_roots)):
            changed_at.append(step)
    assert changed_at == [5, 10, 15]


def test_runtime_config_streams_reach_the_root_computation(monkeypatch: pytest.MonkeyPatch) -> None:
    from distributed_shampoo.preconditioner import shampoo_preconditioner_list
    from distributed_shampoo.shampoo_types import ShampooRuntimeConfig

    requested = []
    run_on_side_streams = shampoo_preconditioner_list.run_on_side_streams

    def spy(tasks: Any, num_streams: int, device: torch.device, *args: Any) -> Any:
        requested.append((len(tasks), num_streams, device.type))
        return run_on_side_streams(tasks, num_streams, device, *args)

    monkeypatch.setattr(shampoo_preconditioner_list, "run_on_side_streams", spy)
    weights = [torch.nn.Parameter(torch.zeros(6, 5)), torch.nn.Parameter(torch.zeros(3, 4))]
    runtime = ShampooRuntimeConfig(num_amortized_computation_streams=3)
    optimizer = DistributedShampoo(weights, **record_config(max_preconditioner_dim=8), shampoo_runtime_config=runtime)
    plain = DistributedShampoo([torch.nn.Parameter(torch.zeros_like(w)) for w in weights], **record_config(max_preconditioner_dim=8))
    generator = torch.Generator().manual_seed(0)
    for _ in range(5):
        grads = [torch.randn(w.shape, generator=generator) for w in weights]
        for optimizer_, params in ((optimizer, weights), (plain, plain.param_groups[0]["params"])):
            for param, grad in zip(params, grads, strict=True):
                param.grad = grad.clone()
            optimizer_.step()
    # One root step each (both factors of both blocks); on the CPU both run sequentially.
    assert requested == [(4, 3, "cpu"), (4, 1, "cpu")]
    for got, want in zip(weights, plain.param_groups[0]["params"], strict=True):
        assert torch.equal(got, want)


# ---------------------------------------------------------------------------------------------- iterate averaging


@pytest.mark.parametrize(
    ("config", "expected_params", "expected_eval"),
    [
        (GeneralizedPrimalAveragingConfig(eval_interp_coeff=0.5, train_interp_coeff=1.0), [0.95, 0.825, 0.7125], 0.7125),
        (GeneralizedPrimalAveragingConfig(eval_interp_coeff=0.5, train_interp_coeff=0.5), [0.925, 0.7625, 0.65625], 0.7125),
        (ScheduleFreeConfig(train_interp_coeff=0.5), [0.9, 0.75, 0.666667], 0.733333),
    ],
)
def test_iterate_averaging_examples(config: Any, expected_params: list[float], expected_eval: float) -> None:
    weight = torch.nn.Parameter(torch.ones(1))
    optimizer = DistributedShampoo(
        [weight], lr=0.1, betas=(0.0, 1.0), iterate_averaging_config=config, preconditioner_config=SGDPreconditionerConfig()
    )
    for grad, want in zip([1.0, 2.0, 1.0], expected_params, strict=True):
        weight.grad = torch.tensor([grad])
        optimizer.step()
        assert weight.item() == pytest.approx(want, abs=1e-6)
    train_value = weight.item()
    optimizer.eval()
    assert weight.item() == pytest.approx(expected_eval, abs=1e-6)
    with pytest.raises(RuntimeError, match="call optimizer.train"):
        optimizer.step()
    optimizer.train()
    assert weight.item() == pytest.approx(train_value, abs=1e-6)


# ------------------------------------------------------------------------------------------------- validation


VALIDATION_CASES = [
    (dict(lr=-0.1), r"Invalid param_group\[LR\]=-0.1. Must be >= 0.0."),
    (dict(betas=(1.0, 0.9)), r"Invalid param_group\[BETAS\]\[0\]=1.0. Must be in \[0.0, 1.0\)."),
    (dict(betas=(0.9, 1.1)), r"Invalid param_group\[BETAS\]\[1\]=1.1. Must be in \[0.0, 1.0\]."),
    (dict(beta3=1.0), r"Invalid param_group\[BETA3\]=1.0. Must be in \[0.0, 1.0\)."),
    (dict(epsilon=0.0), r"Invalid param_group\[EPSILON\]=0.0. Must be > 0.0."),
    (
        dict(epsilon=1e-12, preconditioner_config=RootInvShampooPreconditionerConfig(amortized_computation_config=EigenConfig(rank_deficient_stability_config=PseudoInverseConfig()))),
        r"Invalid param_group\[EPSILON\]=1e-12. Must be 0.0 when using PseudoInverseConfig.",
    ),
    (dict(weight_decay=-0.1), r"Invalid param_group\[WEIGHT_DECAY\]=-0.1. Must be >= 0.0."),
    (dict(peak_lr=0.0, weight_decay_type=WeightDecayType.CORRECTED), r"Invalid param_group\[PEAK_LR\]=0.0. Must be > 0.0 with WeightDecayType.CORRECTED or WeightDecayType.INDEPENDENT."),
    (dict(max_preconditioner_dim=2.5), r"Invalid param_group\[MAX_PRECONDITIONER_DIM\]=2.5. Must be an integer or math.inf."),
    (dict(max_preconditioner_dim=0), r"Invalid param_group\[MAX_PRECONDITIONER_DIM\]=0. Must be >= 1."),
    (dict(precondition_frequency=0), r"Invalid param_group\[PRECONDITION_FREQUENCY\]=0. Must be >= 1."),
    (dict(start_preconditioning_step=-2), r"Invalid param_group\[START_PRECONDITIONING_STEP\]=-2. Must be >= -1."),
    (dict(precondition_frequency=5, start_preconditioning_step=3), r"Invalid start_preconditioning_step value: 3. Must be >= .*precondition_frequency.*=5"),
]


@pytest.mark.parametrize(("bad_arguments", "message"), VALIDATION_CASES)
def test_invalid_arguments_raise_clear_errors(bad_arguments: dict[str, Any], message: str, caplog: pytest.LogCaptureFixture) -> None:
    constructor_arguments = {key: value for key, value in bad_arguments.items() if key != "peak_lr"}
    if "peak_lr" not in bad_arguments:
        with pytest.raises(ValueError, match=message):
            DistributedShampoo([torch.nn.Parameter(torch.zeros(2))], **constructor_arguments)

    # The same value inside the second of three groups: groups 0 and 1 are checked (and logged), group 2 is not.
    groups = [{"params": [torch.nn.Parameter(torch.zeros(2))]} for _ in range(3)]
    groups[1].update(bad_arguments)
    with caplog.at_level(logging.INFO, logger="distributed_shampoo.distributed_shampoo"):
        with pytest.raises(ValueError, match=message):
            DistributedShampoo(groups)
    checked = [record.getMessage() for record in caplog.records if record.getMessage().startswith("Checking param_group")]
    assert checked == ["Checking param_group 0", "Checking param_group 1"]


def test_unknown_configs_and_unsupported_distributors_raise() -> None:
    class UnknownConfig(PreconditionerConfig):
        def __init__(self) -> None:
            pass

    with pytest.raises(NotImplementedError, match="not supported"):
        DistributedShampoo([torch.nn.Parameter(torch.zeros(2))], preconditioner_config=UnknownConfig())
    with pytest.raises(NotImplementedError, match="FSDPDistributedConfig is not supported.*use DDPDistributedConfig"):
        DistributedShampoo([torch.nn.Parameter(torch.zeros(2))], distributed_config=FSDPDistributedConfig(param_to_metadata={}))
    with pytest.raises(NotImplementedError, match="FullyShardDistributedConfig is not supported"):
        DistributedShampoo([torch.nn.Parameter(torch.zeros(2))], distributed_config=FullyShardDistributedConfig())
    with pytest.raises(TypeError, match="use_decoupled_weight_decay"):
        DistributedShampoo([torch.nn.Parameter(torch.zeros(2))], use_decoupled_weight_decay=True)  # type: ignore[call-arg]
    with pytest.raises(ValueError, match="no parameters"):
        DistributedShampoo([{"params": [torch.nn.Parameter(torch.zeros(2))]}, {"params": []}])


def test_resolved_defaults_are_stored_in_the_group() -> None:
    optimizer = DistributedShampoo([{"params": [torch.nn.Parameter(torch.zeros(2))], "lr": 0.5}], lr=0.01, precondition_frequency=3)
    group = optimizer.param_groups[0]
    assert (group["beta3"], group["start_preconditioning_step"], group["peak_lr"], group["lr"]) == (0.9, 3, 0.01, 0.5)


# ---------------------------------------------------------------------------------------- step and checkpointing


def test_step_returns_closure_value_and_releases_gradients() -> None:
    weight = torch.nn.Parameter(torch.ones(3, 3))
    optimizer = DistributedShampoo([weight])

    def closure() -> Tensor:
        loss = (weight**2).sum()
        loss.backward()
        return loss

    assert optimizer.step(closure).item() == 9.0
    weight.grad = torch.ones(3, 3)
    assert optimizer.step() is None
    optimizer.zero_grad(set_to_none=True)
    assert weight.grad is None


def test_parameters_without_gradient_are_skipped() -> None:
    used, unused = torch.nn.Parameter(torch.ones(4, 3)), torch.nn.Parameter(torch.ones(5))
    optimizer = DistributedShampoo([used, unused], lr=0.1)
    used.grad = torch.ones(4, 3)
    optimizer.step()
    assert torch.equal(unused.detach(), torch.ones(5))
    assert not torch.equal(used.detach(), torch.ones(4, 3))
    assert optimizer.state_dict()["state"][0]["step"].item() == 1


@pytest.mark.parametrize("use_symmetric_packing", [True, False])
def test_state_dict_layout(use_symmetric_packing: bool) -> None:
    linear = torch.nn.Linear(5, 10)
    optimizer = DistributedShampoo(
        linear.parameters(),
        max_preconditioner_dim=5,
        grafting_config=AdaGradPreconditionerConfig(),
        betas=(0.9, 1.0),
        preconditioner_config=RootInvShampooPreconditionerConfig(use_symmetric_packing=use_symmetric_packing),
    )
    state_dict = optimizer.state_dict()
    weight_state = state_dict["state"][0]
    assert list(weight_state) == ["block_0", "block_1", "step"]
    block = weight_state["block_0"]
    assert list(block) == ["shampoo", "adagrad", "filtered_grad"]
    assert list(block["shampoo"]) == ["factor_matrices", "inv_factor_matrices"]
    if use_symmetric_packing:  # upper triangle, row by row: 5·6/2 entries; the identity has ones at 0, 5, 9, 12, 14
        assert block["shampoo"]["factor_matrices"][0].shape == (15,)
        assert block["shampoo"]["inv_factor_matrices"][1].nonzero().flatten().tolist() == [0, 5, 9, 12, 14]
        assert block["shampoo"]["inv_factor_matrices"][1].sum() == 5
    else:
        assert block["shampoo"]["factor_matrices"][0].shape == (5, 5)
        assert torch.equal(block["shampoo"]["inv_factor_matrices"][1], torch.eye(5))
    assert weight_state["step"].dtype == torch.int64
    # The bias (10,) is split into two (5,) blocks; the group's step counter is one tensor under every parameter.
    assert list(state_dict["state"][1]) == ["block_0", "block_1", "step"]
    assert state_dict["state"][1]["step"] is weight_state["step"]
    group = state_dict["param_groups"][0]
    assert group["params"] == [0, 1] and group["beta3"] == 0.9 and group["start_preconditioning_step"] == 1


def _train(optimizer: DistributedShampoo, params: list[torch.nn.Parameter], steps: range) -> None:
    for step in steps:
        generator = torch.Generator().manual_seed(step)
        for param in params:
            param.grad = torch.randn(param.shape, generator=generator)
        optimizer.step()


@pytest.mark.parametrize(
    "preconditioner_config", [RootInvShampooPreconditionerConfig(), EigenvalueCorrectedShampooPreconditionerConfig()]
)
def test_checkpoint_round_trip_equals_uninterrupted_run(preconditioner_config: PreconditionerConfig) -> None:
    def make(seed: int) -> tuple[list[torch.nn.Parameter], DistributedShampoo]:
        generator = torch.Generator().manual_seed(seed)
        params = [torch.nn.Parameter(torch.randn(shape, generator=generator)) for shape in [(6, 5), (7,), (3, 2, 2)]]
        config = record_config(lr=0.01, max_preconditioner_dim=4, precondition_frequency=2, preconditioner_config=preconditioner_config)
        return params, DistributedShampoo(params, **config)

    uninterrupted_params, uninterrupted = make(0)
    _train(uninterrupted, uninterrupted_params, range(9))

    params, optimizer = make(0)
    _train(optimizer, params, range(5))
    buffer = io.BytesIO()
    torch.save({"params": [p.detach() for p in params], "optimizer": optimizer.state_dict()}, buffer)
    buffer.seek(0)
    checkpoint = torch.load(buffer, weights_only=False)

    resumed_params, resumed = make(1)
    with torch.no_grad():
        for param, saved in zip(resumed_params, checkpoint["params"], strict=True):
            param.copy_(saved)
    resumed.load_state_dict(checkpoint["optimizer"])
    _train(resumed, resumed_params, range(5, 9))
    for got, want in zip(resumed_params, uninterrupted_params, strict=True):
        torch.testing.assert_close(got, want, rtol=0, atol=0)


def test_single_device_config_is_the_default() -> None:
    optimizer = DistributedShampoo([torch.nn.Parameter(torch.zeros(2))], distributed_config=SingleDeviceDistributedConfig())
    assert isinstance(optimizer.param_groups[0]["distributed_config"], SingleDeviceDistributedConfig)


# ----------------------------------------------------------------------------------- variants and special cases


def test_eigenvalue_corrected_shampoo_before_start_is_adamw() -> None:
    config = dict(
        lr=0.01,
        betas=(0.9, 0.999),
        epsilon=1e-8,
        weight_decay=0.1,
        start_preconditioning_step=math.inf,
        preconditioner_config=EigenvalueCorrectedShampooPreconditionerConfig(),
    )
    adamw = lambda params: torch.optim.AdamW(params, lr=0.01, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.1)  # noqa: E731
    _compare_with_torch_optimizer(config, adamw, num_steps=5, atol=1e-5)


def test_the_compiled_path_warns_when_the_gradient_selection_changes(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """With torch.compile stubbed: the (5,) parameter's two blocks leave the selection at step 2 and come back at
    step 3, and each change warns that PT2 will recompile; the compiled path (whole lists) gives the eager numbers."""
    eager = train_with_a_gradient_missing_at_step_2()
    monkeypatch.setattr(torch, "compile", compile_nothing([]))
    with caplog.at_level(logging.WARNING, logger="distributed_shampoo.distributed_shampoo"):
        compiled = train_with_a_gradient_missing_at_step_2(shampoo_pt2_compile_config=ShampooPT2CompileConfig())
    for a, b in zip(eager, compiled, strict=True):
        torch.testing.assert_close(a, b)
    warnings = [r.getMessage() for r in caplog.records if "PT2 will recompile" in r.getMessage()]
    assert len(warnings) == 2 and warnings[0].endswith("[1, 2]")


def test_function_valued_configs_warn_about_pickling(caplog: pytest.LogCaptureFixture) -> None:
    from distributed_shampoo import SignDescentPreconditionerConfig

    optimizer = DistributedShampoo([torch.nn.Parameter(torch.zeros(2))], preconditioner_config=SignDescentPreconditionerConfig(scale_fn=lambda g: 2.0))
    with caplog.at_level(logging.WARNING, logger="distributed_shampoo.distributed_shampoo"):
        optimizer.state_dict()
    assert "lambdas cannot be pickled" in caplog.text and "preconditioner_config" in caplog.text


@pytest.mark.parametrize("save_in_eval", [False, True])
@pytest.mark.parametrize("load_in_eval", [False, True])
def test_loading_keeps_the_callers_train_or_eval_mode(save_in_eval: bool, load_in_eval: bool) -> None:
    def make() -> tuple[torch.nn.Parameter, DistributedShampoo]:
        weight = torch.nn.Parameter(torch.ones(3))
        averaging = GeneralizedPrimalAveragingConfig(eval_interp_coeff=0.5, train_interp_coeff=0.5)
        return weight, DistributedShampoo([weight], lr=0.1, iterate_averaging_config=averaging)

    weight, optimizer = make()
    for value in (1.0, 2.0):
        weight.grad = torch.full((3,), value)
        optimizer.step()
    if save_in_eval:
        optimizer.eval()
    state_dict = optimizer.state_dict()
    assert sum("train_mode" in entry for entry in state_dict["state"].values()) == 1
    assert sorted(state_dict["state"][0]["block_0"]) == ["filtered_grad", "shampoo", "weight_buffer"]

    _, fresh = make()
    if load_in_eval:
        fresh.eval()
    fresh.load_state_dict(state_dict)
    assert bool(fresh.state_dict()["state"][0]["train_mode"]) is (not load_in_eval)


def test_train_and_eval_are_no_ops_without_averaging() -> None:
    weight = torch.nn.Parameter(torch.ones(3))
    optimizer = DistributedShampoo([weight])
    optimizer.eval()
    optimizer.train()
    assert torch.equal(weight.detach(), torch.ones(3))


def test_add_param_group_is_not_supported() -> None:
    optimizer = DistributedShampoo([torch.nn.Parameter(torch.zeros(2))])
    optimizer.add_param_group({"params": [torch.nn.Parameter(torch.zeros(2))]})
    with pytest.raises(ValueError):
        optimizer.step()


@pytest.mark.parametrize("use_bias_correction", [True, False])
def test_beta3_lookahead_of_the_first_moment(use_bias_correction: bool) -> None:
    """M̄ = beta3·M_old + (1 - beta3)·G, corrected by 1 - beta3·beta1^(t-1); M itself keeps beta1."""
    generator = torch.Generator().manual_seed(5)
    grads = [torch.randn(4, dtype=torch.float64, generator=generator) for _ in range(4)]
    weight = torch.nn.Parameter(torch.zeros(4, dtype=torch.float64))
    optimizer = DistributedShampoo(
        [weight], lr=0.1, betas=(0.9, 1.0), beta3=0.5, use_bias_correction=use_bias_correction, preconditioner_config=SGDPreconditionerConfig()
    )
    expected, moment = torch.zeros(4, dtype=torch.float64), torch.zeros(4, dtype=torch.float64)
    for t, grad in enumerate(grads, start=1):
        weight.grad = grad.clone()
        optimizer.step()
        lookahead = 0.5 * moment + 0.5 * grad
        moment = 0.9 * moment + 0.1 * grad
        if use_bias_correction:
            lookahead = lookahead / (1 - 0.5 * 0.9 ** (t - 1))
        expected -= 0.1 * lookahead
        torch.testing.assert_close(weight.detach(), expected, rtol=1e-6, atol=1e-8)


def test_eigendecomposed_shampoo_equals_root_inverse_shampoo() -> None:
    from distributed_shampoo import EigendecomposedShampooPreconditionerConfig

    f64 = torch.float64

    def run(preconditioner_config: PreconditionerConfig) -> list[Tensor]:
        initial, grads = random_problem(7, f64)
        params = [torch.nn.Parameter(value.clone()) for value in initial]
        optimizer = DistributedShampoo(params, **record_config(lr=0.05, epsilon=1e-6, max_preconditioner_dim=4, precondition_frequency=2, preconditioner_config=preconditioner_config))
        for step_grads in grads:
            for param, grad in zip(params, step_grads, strict=True):
                param.grad = grad.clone()
            optimizer.step()
        return [p.detach() for p in params]

    root_inverse = run(RootInvShampooPreconditionerConfig(factor_matrix_dtype=f64, inv_factor_matrix_dtype=f64))
    eigendecomposed = run(
        EigendecomposedShampooPreconditionerConfig(factor_matrix_dtype=f64, factor_matrix_eigenvectors_dtype=f64, factor_matrix_eigenvalues_dtype=f64)
    )
    for a, b in zip(root_inverse, eigendecomposed, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-9)


def test_sign_and_spectral_descent_warn_about_unused_settings(caplog: pytest.LogCaptureFixture) -> None:
    from distributed_shampoo import DefaultSingleDeviceDistributedConfig, SignDescentPreconditionerConfig, SpectralDescentPreconditionerConfig

    with caplog.at_level(logging.WARNING, logger="distributed_shampoo.distributed_shampoo"):
        sign = DistributedShampoo([torch.nn.Parameter(torch.zeros(3))], precondition_frequency=4, preconditioner_config=SignDescentPreconditionerConfig())
    messages = [r.getMessage() for r in caplog.records]
    assert sum("does not have any effect" in m for m in messages) == 3
    assert sign.param_groups[0]["precondition_frequency"] == 1

    caplog.clear()
    weight = torch.nn.Parameter(torch.ones(6, 4))
    with caplog.at_level(logging.WARNING, logger="distributed_shampoo.distributed_shampoo"):
        spectral = DistributedShampoo([weight], lr=0.1, betas=(0.0, 1.0), preconditioner_config=SpectralDescentPreconditionerConfig())
    assert "Setting target_parameter_dimensionality to 2" in caplog.text
    assert spectral.param_groups[0]["distributed_config"].target_parameter_dimensionality == 2
    assert DefaultSingleDeviceDistributedConfig.target_parameter_dimensionality == 1  # the shared default is untouched
    weight.grad = torch.randn(6, 4, generator=torch.Generator().manual_seed(0))
    spectral.step()
    step = (torch.ones(6, 4) - weight.detach()) / 0.1
    singular_values = torch.linalg.svdvals(step)
    assert ((singular_values > 0.6) & (singular_values < 1.25)).all()  # Newton–Schulz: approximately orthogonal


# ----------------------------------------------------------------------------- eigenvalue-corrected Shampoo (SOAP)


class ReferenceEigenvalueCorrectedBlock:
    """Plain eigenvalue-corrected Shampoo (SOAP with eigh) for one 2-D block, in float64, no grafting.

    Per step: L, R ← EMA of G·Gᵀ, Gᵀ·G; at a root step the bases become the eigenvectors of the bias-corrected,
    epsilon-damped factors; only then E ← β₂·E + (1 - β₂)·(Q_Lᵀ·G·Q_R)², measured in the new basis; the direction is
    Q_L·[(Q_Lᵀ·M̄·Q_R) / ((E / (1 - β₂ᵗ))^(1/2) + ε)]·Q_Rᵀ.
    """

    def __init__(self, shape: tuple[int, int]) -> None:
        self.factors = [torch.zeros(size, size, dtype=torch.float64) for size in shape]
        self.bases = [torch.eye(size, dtype=torch.float64) for size in shape]
        self.corrected_eigenvalues = torch.zeros(shape, dtype=torch.float64)
        self.first_moment = torch.zeros(shape, dtype=torch.float64)

    def step(self, weight: Tensor, grad: Tensor, t: int, c: dict[str, Any]) -> None:
        beta1, beta2 = c["betas"]
        self.factors[0] = beta2 * self.factors[0] + (1 - beta2) * grad @ grad.T
        self.factors[1] = beta2 * self.factors[1] + (1 - beta2) * grad.T @ grad
        if t == c["start"] or (t % c["frequency"] == 0 and t > c["start"]):
            for k, factor in enumerate(self.factors):
                damped = factor / (1 - beta2**t) + c["epsilon"] * torch.eye(factor.shape[0], dtype=torch.float64)
                self.bases[k] = torch.linalg.eigh(damped).eigenvectors
        left, right = self.bases
        self.corrected_eigenvalues = beta2 * self.corrected_eigenvalues + (1 - beta2) * (left.T @ grad @ right) ** 2
        self.first_moment = beta1 * self.first_moment + (1 - beta1) * grad
        m_hat = self.first_moment / (1 - beta1**t)
        denominator = (self.corrected_eigenvalues / (1 - beta2**t)).sqrt() + c["epsilon"]
        direction = left @ ((left.T @ m_hat @ right) / denominator) @ right.T
        weight -= c["lr"] * (direction + c["weight_decay"] * weight)


def test_eigenvalue_corrected_shampoo_matches_a_plain_float64_reference() -> None:
    """The basis is recomputed before the corrected eigenvalues are updated at a root step (so E is measured in the
    new basis), as in the published optimizer; the opposite order differs by ~1e-2 after 20 steps even in float64."""
    c = dict(lr=0.05, betas=(0.9, 0.95), epsilon=1e-8, weight_decay=0.1, frequency=3, start=3)
    f64 = torch.float64
    shapes = [(3, 2), (4, 3)]  # max_preconditioner_dim 4: each stays one 2-D block, full-rank factors by step 3
    generator = torch.Generator().manual_seed(7)
    params = [torch.nn.Parameter(torch.randn(shape, generator=generator, dtype=f64)) for shape in shapes]
    weights = [param.detach().clone() for param in params]
    optimizer = DistributedShampoo(
        params,
        lr=c["lr"],
        betas=c["betas"],
        epsilon=c["epsilon"],
        weight_decay=c["weight_decay"],
        max_preconditioner_dim=4,
        precondition_frequency=c["frequency"],
        start_preconditioning_step=c["start"],
        preconditioner_config=EigenvalueCorrectedShampooPreconditionerConfig(
            factor_matrix_dtype=f64, factor_matrix_eigenvectors_dtype=f64, corrected_eigenvalues_dtype=f64
        ),
    )
    references = [ReferenceEigenvalueCorrectedBlock(shape) for shape in shapes]
    for t in range(1, 21):
        grads = [torch.randn(shape, generator=generator, dtype=f64) for shape in shapes]
        for param, grad in zip(params, grads, strict=True):
            param.grad = grad.clone()
        optimizer.step()
        for reference, weight, grad in zip(references, weights, grads, strict=True):
            reference.step(weight, grad, t, c)
    # Bias corrections are float32 scalars (as in the published optimizer), hence ~1e-7 rather than 1e-15.
    for param, weight in zip(params, weights, strict=True):
        torch.testing.assert_close(param.detach(), weight, rtol=1e-6, atol=1e-7)


# ------------------------------------------------------------------------------- coupled higher-order inverse root


def test_coupled_higher_order_roots_match_the_plain_float64_reference() -> None:
    """RootInv Shampoo with CoupledHigherOrderConfig (ridge abs_epsilon = the group's epsilon) follows the same
    float64 reference as with eigh: (A + ε·I)^(-1/4) for both factors of each matrix block. The 24×20 blocks have
    dense, well-conditioned factors, where the iteration used to stop early and keep the previous root."""
    from distributed_shampoo import CoupledHigherOrderConfig

    c = dict(lr=0.05, betas=(0.9, 0.95), epsilon=1e-3, weight_decay=0.2, frequency=2, start=2, graft_beta2=0.95, graft_eps=1e-8)
    generator = torch.Generator().manual_seed(11)
    shapes = [(24, 20), (20, 24)]  # max_preconditioner_dim 24: one 2-D block each
    initial = [torch.randn(shape, generator=generator, dtype=torch.float64) for shape in shapes]
    grads = [[torch.randn(shape, generator=generator, dtype=torch.float64) for shape in shapes] for _ in range(6)]
    params = [torch.nn.Parameter(value.clone()) for value in initial]
    higher_order = CoupledHigherOrderConfig(rel_epsilon=0.0, abs_epsilon=c["epsilon"], disable_tf32=False)
    optimizer = DistributedShampoo(
        params,
        lr=c["lr"],
        betas=c["betas"],
        epsilon=c["epsilon"],
        weight_decay=c["weight_decay"],
        max_preconditioner_dim=24,
        precondition_frequency=c["frequency"],
        start_preconditioning_step=c["start"],
        grafting_config=AdamPreconditionerConfig(beta2=c["graft_beta2"], epsilon=c["graft_eps"]),
        preconditioner_config=RootInvShampooPreconditionerConfig(
            factor_matrix_dtype=torch.float64, inv_factor_matrix_dtype=torch.float64, amortized_computation_config=higher_order
        ),
    )
    # The iteration adds abs_epsilon itself; the reference adds the group epsilon: the same damping.
    weights = [value.clone() for value in initial]
    blocks = [ReferenceBlock(shape) for shape in shapes]
    for t, step_grads in enumerate(grads, start=1):
        for param, grad in zip(params, step_grads, strict=True):
            param.grad = grad.clone()
        optimizer.step()
        for block, weight, grad in zip(blocks, weights, step_grads, strict=True):
            block.step(weight, grad, t, c)
    for param, weight in zip(params, weights, strict=True):
        torch.testing.assert_close(param.detach(), weight, rtol=1e-6, atol=1e-7)
