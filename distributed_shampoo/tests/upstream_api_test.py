"""The published optimizer's API and semantics of 2026-08 (README.md, "Compatibility"): classic momentum, weight
decay under iterate averaging, trace-scaling exponent, dropping the weighting factor, per-group scalars, symmetric
packing and its checkpoints, the concurrency and sub-group configs.

The expected trajectories are worked by hand in each test: one-element parameters, lr 0.1, betas (0, 1) and the
SGD preconditioner make every step a line of arithmetic.
"""

import io
import logging
import math
from typing import Any

import numpy as np
import pytest
import torch
from torch import Tensor

from distributed_shampoo import (
    AdamPreconditionerConfig,
    BaseShampooPreconditionerConfig,
    DDPDistributedConfig,
    DistributedShampoo,
    EigendecomposedShampooPreconditionerConfig,
    EigenvalueCorrectedShampooPreconditionerConfig,
    FSDPParamAssignmentStrategy,
    FullyShardDistributedConfig,
    GeneralizedPrimalAveragingConfig,
    HybridShardDistributedConfig,
    IterateAveragingConfig,
    RootInvKLShampooPreconditionerConfig,
    RootInvShampooPreconditionerConfig,
    ScheduleFreeConfig,
    SGDPreconditionerConfig,
    SingleDeviceDistributedConfig,
    WeightDecayType,
)
from distributed_shampoo.distributor.shampoo_distributor import Distributor
from distributed_shampoo.shampoo_types import ClassicMomentumConfig, ConcurrencyConfig, DefaultConcurrencyConfig

SGD_STEPS = dict(lr=0.1, betas=(0.0, 1.0), preconditioner_config=SGDPreconditionerConfig())


def one_element_trajectory(grads: list[float], **config: Any) -> tuple[list[float], DistributedShampoo, torch.nn.Parameter]:
    weight = torch.nn.Parameter(torch.ones(1))
    optimizer = DistributedShampoo([weight], **config)
    trajectory = []
    for grad in grads:
        weight.grad = torch.tensor([grad])
        optimizer.step()
        trajectory.append(weight.item())
    return trajectory, optimizer, weight


# ---------------------------------------------------------------------------------------------- classic momentum


@pytest.mark.parametrize(
    ("momentum_config", "weight_decay", "expected"),
    [
        # M = 1, 2.5, 2.25 (M ← 0.5·M + P); W ← W - 0.1·M.
        (ClassicMomentumConfig(momentum=0.5), 0.0, [0.9, 0.65, 0.425]),
        # Nesterov steps with P + 0.5·M: 1.5, 3.25, 2.125.
        (ClassicMomentumConfig(momentum=0.5, use_nesterov=True), 0.0, [0.85, 0.525, 0.3125]),
        # Dampening 0.5: M = 0.5, 1.25, 1.125.
        (ClassicMomentumConfig(momentum=0.5, dampening=0.5), 0.0, [0.95, 0.825, 0.7125]),
        # Decoupled weight decay enters P before the momentum: P = g + 0.1·W.
        (ClassicMomentumConfig(momentum=0.5), 0.1, [0.89, 0.6261, 0.387889]),
    ],
)
def test_classic_momentum_examples(momentum_config: ClassicMomentumConfig, weight_decay: float, expected: list[float]) -> None:
    trajectory, optimizer, _ = one_element_trajectory(
        [1.0, 2.0, 1.0], **SGD_STEPS, weight_decay=weight_decay, iterate_averaging_config=momentum_config
    )
    assert trajectory == pytest.approx(expected, abs=1e-6)


def test_classic_momentum_state_and_modes() -> None:
    _, optimizer, weight = one_element_trajectory([1.0, 2.0, 1.0], **SGD_STEPS, iterate_averaging_config=ClassicMomentumConfig(momentum=0.5))
    state = optimizer.state_dict()["state"][0]
    assert list(state) == ["block_0", "step"]  # no weight_buffer, lr_sum or train_mode
    assert list(state["block_0"]) == ["momentum_buffer"]  # the SGD preconditioner keeps no state of its own
    assert state["block_0"]["momentum_buffer"].item() == pytest.approx(2.25)
    before = weight.item()
    optimizer.eval()  # a no-op for momentum groups, and step() does not need train mode
    assert weight.item() == before
    weight.grad = torch.ones(1)
    optimizer.step()
    assert weight.item() == pytest.approx(before - 0.1 * (0.5 * 2.25 + 1.0))


@pytest.mark.parametrize(
    ("arguments", "message"),
    [
        (dict(momentum=0.0), r"Invalid self.momentum=0.0. Must be within \(0.0, 1.0\)."),
        (dict(momentum=1.0), r"Invalid self.momentum=1.0. Must be within \(0.0, 1.0\)."),
        (dict(dampening=-0.1), r"Invalid self.dampening=-0.1. Must be within \[0.0, 1.0\)."),
        (dict(dampening=1.0), r"Invalid self.dampening=1.0. Must be within \[0.0, 1.0\)."),
    ],
)
def test_classic_momentum_validation(arguments: dict[str, float], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        ClassicMomentumConfig(**arguments)


def test_other_iterate_averaging_configs_are_rejected() -> None:
    from dataclasses import dataclass

    @dataclass
    class LookaheadConfig(IterateAveragingConfig):
        pass

    with pytest.raises(NotImplementedError, match="LookaheadConfig is not supported: use ClassicMomentumConfig"):
        DistributedShampoo([torch.nn.Parameter(torch.zeros(2))], iterate_averaging_config=LookaheadConfig())


# ---------------------------------------------------------------------------------- weight decay with averaging


def test_gpa_weight_decay_shrinks_z() -> None:
    """z ← (1 - lr·wd)·z before z's step; y moves by 0.5·(-lr·g) + 0.5·(z_shrunk - y).

    Step 1: z 1 → 0.99 → 0.89, y 1 + 0.5·(-0.1) + 0.5·(-0.01) = 0.945. z follows plain SGD with weight decay:
    0.89, 0.89·0.99 - 0.2 = 0.6811, 0.6811·0.99 - 0.1 = 0.574289."""
    config = GeneralizedPrimalAveragingConfig(eval_interp_coeff=0.5, train_interp_coeff=1.0)
    trajectory, optimizer, _ = one_element_trajectory([1.0, 2.0, 1.0], **SGD_STEPS, weight_decay=0.1, iterate_averaging_config=config)
    assert trajectory == pytest.approx([0.945, 0.81305, 0.693669], abs=1e-6)
    assert optimizer.state_dict()["state"][0]["block_0"]["weight_buffer"].item() == pytest.approx(0.574289, abs=1e-6)


def test_schedule_free_weight_decay_shrinks_z() -> None:
    config = ScheduleFreeConfig(train_interp_coeff=0.5)
    trajectory, optimizer, weight = one_element_trajectory([1.0, 2.0, 1.0], **SGD_STEPS, weight_decay=0.1, iterate_averaging_config=config)
    assert trajectory == pytest.approx([0.89, 0.73555, 0.648463], abs=1e-6)
    optimizer.eval()
    assert weight.item() == pytest.approx(0.722637, abs=1e-6)


def _f32(value: float) -> float:
    """`value` rounded to IEEE single precision (numpy, independently of torch)."""
    return float(np.float32(value))


def averaging_reference(
    averaging: GeneralizedPrimalAveragingConfig | ScheduleFreeConfig, weight_decay_type: WeightDecayType,
    y: list[float], grads: list[list[float]], lr: float, peak_lr: float, weight_decay: float, float32_lr: bool = True,
) -> list[float]:
    """Float64 GPA/Schedule-Free with the SGD preconditioner and betas (0, 1), element by element. As published,
    the learning rate is a float32 tensor: the step is -lr₃₂·g, z's decay factor is 1 - lr₃₂·α worked out in
    float32, and so are Schedule-Free's lr₃₂², Σ and μx and the coefficients 1 - μx·μy and 1 - μx. float32_lr=False
    gives the same arithmetic with the float64 learning rate and decay factor, for contrast."""
    lr32 = _f32(lr) if float32_lr else lr
    alpha = {
        WeightDecayType.DECOUPLED: weight_decay,
        WeightDecayType.CORRECTED: weight_decay * lr32 / peak_lr,
        WeightDecayType.INDEPENDENT: weight_decay / peak_lr,
    }[weight_decay_type]
    decay = _f32(np.float32(1.0) - np.float32(lr32) * np.float32(alpha)) if float32_lr else 1.0 - lr * alpha
    z, mu_y, lr_sum = list(y), _f32(averaging.train_interp_coeff), np.float32(0.0)
    for grad in grads:
        if isinstance(averaging, ScheduleFreeConfig):
            lr_power = np.float32(lr32) * np.float32(lr32)  # eval_coeff_lr_power 2
            lr_sum = np.float32(lr_sum + lr_power)
            mu_x = _f32(np.float32(1.0) - lr_power / lr_sum)
        else:
            mu_x = _f32(averaging.eval_interp_coeff)
        c_step, c_pull = _f32(np.float32(1.0) - np.float32(mu_x) * np.float32(mu_y)), _f32(np.float32(1.0) - np.float32(mu_x))
        for i, g in enumerate(grad):
            shrunk = z[i] * decay
            step = g * -lr32
            pull = shrunk - y[i]
            z[i] = shrunk + step
            y[i] = y[i] + (step * c_step + pull * c_pull)
    return y


@pytest.mark.parametrize("weight_decay_type", [WeightDecayType.DECOUPLED, WeightDecayType.CORRECTED, WeightDecayType.INDEPENDENT])
@pytest.mark.parametrize(
    "averaging",
    [GeneralizedPrimalAveragingConfig(eval_interp_coeff=0.7, train_interp_coeff=0.3), ScheduleFreeConfig(train_interp_coeff=0.9)],
    ids=["GPA", "Schedule-Free"],
)
def test_averaging_weight_decay_in_float64_follows_the_float32_learning_rate(
    averaging: GeneralizedPrimalAveragingConfig | ScheduleFreeConfig, weight_decay_type: WeightDecayType
) -> None:
    """Float64 parameters: z's decay factor and the step come from the float32 learning rate, as published (our
    float64 factor differed by up to 8.8e-7). lr 0.1 and α are not float32 numbers, so the contrast differs."""
    generator = torch.Generator().manual_seed(3)
    initial = torch.randn(6, generator=generator, dtype=torch.float64)
    grads = torch.randn(9, 6, generator=generator, dtype=torch.float64)
    weight = torch.nn.Parameter(initial.clone())
    lr, peak_lr, weight_decay = 0.1, 0.3, 0.7
    optimizer = DistributedShampoo(
        [dict(params=[weight], peak_lr=peak_lr)], lr=lr, betas=(0.0, 1.0), preconditioner_config=SGDPreconditionerConfig(),
        weight_decay=weight_decay, weight_decay_type=weight_decay_type, iterate_averaging_config=averaging,
    )
    for grad in grads:
        weight.grad = grad.clone()
        optimizer.step()
    arguments = (averaging, weight_decay_type, initial.tolist(), grads.tolist(), lr, peak_lr, weight_decay)
    assert weight.detach().tolist() == averaging_reference(*arguments)
    assert weight.detach().tolist() != averaging_reference(*arguments, float32_lr=False)


def test_interpolation_coefficients_are_float32_tensors_on_the_parameter_device() -> None:
    _, optimizer, _ = one_element_trajectory([1.0], **SGD_STEPS, iterate_averaging_config=ScheduleFreeConfig(train_interp_coeff=0.5))
    runtime = optimizer._group_runtimes[0]
    for coefficient in (runtime.eval_interp_coeff, runtime.train_interp_coeff):
        assert isinstance(coefficient, Tensor) and coefficient.dtype == torch.float32 and coefficient.dim() == 0
    assert runtime.eval_interp_coeff.item() == 0.0  # Schedule-Free step 1: 1 - lr²/Σlr² = 0


# ------------------------------------------------------------------------------ trace scaling and the gsquare weight


@pytest.mark.parametrize(
    ("exponent", "expected"),
    # One element: F = 0.1·g², bias-corrected A = 4 then 2.8/0.19 ... A·A^(-e) = A^(1-e); the root is (·)^(-1/2).
    [(0.5, [-0.414214, -1.21589]), (1.0, [-1.0, -2.0]), (0.25, [-0.189207, -0.906999])],
)
def test_trace_scaling_exponent_examples(exponent: float, expected: list[float]) -> None:
    config = RootInvShampooPreconditionerConfig(use_trace_scaling=True, trace_scaling_exponent=exponent)
    trajectory, _, _ = one_element_trajectory([2.0, 1.0], lr=1.0, betas=(0.0, 0.9), preconditioner_config=config)
    assert trajectory == pytest.approx(expected, abs=1e-5)


@pytest.mark.parametrize("exponent", [0.0, -0.5, 1.5])
def test_trace_scaling_exponent_must_be_in_the_unit_interval(exponent: float) -> None:
    with pytest.raises(ValueError, match=rf"Invalid trace_scaling_exponent value: {exponent}. Must be in \(0.0, 1.0\] when use_trace_scaling=True."):
        RootInvShampooPreconditionerConfig(use_trace_scaling=True, trace_scaling_exponent=exponent)
    RootInvShampooPreconditionerConfig(use_trace_scaling=False, trace_scaling_exponent=exponent)  # checked only when used


def test_dropping_the_weighting_factor_also_drops_the_bias_correction() -> None:
    """F = g² summed with weight 1 and not divided by 1 - β₂ᵗ: F = 4, then 0.9·4 + 1 = 4.6; W -= F^(-1/2)·g."""
    drop = RootInvShampooPreconditionerConfig(drop_weighting_factor_on_gsquare=True)
    trajectory, _, _ = one_element_trajectory([2.0, 1.0], lr=1.0, betas=(0.0, 0.9), preconditioner_config=drop)
    assert trajectory == pytest.approx([0.0, -0.466252], abs=1e-6)
    keep, _, _ = one_element_trajectory([2.0, 1.0], lr=1.0, betas=(0.0, 0.9))
    assert keep == pytest.approx([0.0, -0.642685], abs=1e-6)


def test_base_shampoo_config_fields_in_the_published_repr_order() -> None:
    names = [name for name, f in BaseShampooPreconditionerConfig.__dataclass_fields__.items() if f.repr]
    assert names == [
        "drop_weighting_factor_on_gsquare",
        "factor_matrix_dtype",
        "num_tolerated_failed_amortized_computations",
        "use_symmetric_packing",
        "use_trace_scaling",
        "trace_scaling_exponent",
    ]
    defaults = RootInvShampooPreconditionerConfig()
    assert defaults.use_symmetric_packing is True and defaults.trace_scaling_exponent == 0.5


# ------------------------------------------------------------------------------------------- per-group scalars


def test_step_lr_sum_and_train_mode_are_one_tensor_under_every_parameter() -> None:
    params = [torch.nn.Parameter(torch.ones(3)), torch.nn.Parameter(torch.ones(2, 2))]
    optimizer = DistributedShampoo(params, lr=0.1, iterate_averaging_config=ScheduleFreeConfig())
    for param in params:
        param.grad = torch.ones_like(param)
    optimizer.step()
    state = optimizer.state_dict()["state"]
    for key in ("step", "train_mode", "lr_sum"):
        assert state[0][key] is state[1][key]
    assert list(state[0]) == ["block_0", "step", "train_mode", "lr_sum"]
    assert state[1]["step"].item() == 1 and state[1]["step"].dtype == torch.int64
    assert state[1]["train_mode"].dtype == torch.bool and state[1]["lr_sum"].dtype == torch.float32


def test_loading_conflicting_per_group_scalars_is_refused() -> None:
    params = [torch.nn.Parameter(torch.ones(3)), torch.nn.Parameter(torch.ones(2))]
    optimizer = DistributedShampoo(params, lr=0.1)
    state_dict = optimizer.state_dict()
    state_dict["state"][1] = dict(state_dict["state"][1], step=torch.tensor(7))
    with pytest.raises(ValueError, match="per-group scalar 'step' is aliased across parameters"):
        optimizer.load_state_dict(state_dict)


# ----------------------------------------------------------------------------------------- symmetric packing


def train(optimizer: DistributedShampoo, params: list[torch.nn.Parameter], steps: range) -> None:
    for step in steps:
        generator = torch.Generator().manual_seed(step)
        for param in params:
            param.grad = torch.randn(param.shape, generator=generator, dtype=param.dtype)
        optimizer.step()


F64 = torch.float64
# float64 state and epsilon 1e-4: the roots of nearly singular factors (few steps, epsilon 1e-12) would amplify the
# rounding differences between the two storage paths (the square one fuses the factor update into one matmul)
# far beyond rounding level.
F64_STATE = {
    RootInvShampooPreconditionerConfig: dict(factor_matrix_dtype=F64, inv_factor_matrix_dtype=F64),
    RootInvKLShampooPreconditionerConfig: dict(factor_matrix_dtype=F64, inv_factor_matrix_dtype=F64),
    EigendecomposedShampooPreconditionerConfig: dict(
        factor_matrix_dtype=F64, factor_matrix_eigenvectors_dtype=F64, factor_matrix_eigenvalues_dtype=F64
    ),
    EigenvalueCorrectedShampooPreconditionerConfig: dict(
        factor_matrix_dtype=F64, factor_matrix_eigenvectors_dtype=F64, corrected_eigenvalues_dtype=F64
    ),
}


MIXED_SHAPES = [(6, 5), (7,), (3, 2, 2)]  # with max_preconditioner_dim 4: 2-D, 1-D and 3-D blocks, some factors rank-deficient
# Factors of full rank at the first root step: eigenvalue correction measures E in the eigenbasis, which is
# arbitrary (rounding decides it) inside the null space of a rank-deficient factor.
FULL_RANK_SHAPES = [(4, 4), (3, 4), (4, 3)]


def make(
    seed: int, use_symmetric_packing: bool, config_class: type = RootInvShampooPreconditionerConfig, shapes: list[tuple[int, ...]] = MIXED_SHAPES
) -> tuple[list[torch.nn.Parameter], DistributedShampoo]:
    generator = torch.Generator().manual_seed(seed)
    params = [torch.nn.Parameter(torch.randn(shape, generator=generator, dtype=F64)) for shape in shapes]
    optimizer = DistributedShampoo(
        params,
        lr=0.01,
        betas=(0.9, 0.95),
        epsilon=1e-4,
        max_preconditioner_dim=4,
        precondition_frequency=2,
        grafting_config=AdamPreconditionerConfig(beta2=0.95, epsilon=1e-10),
        preconditioner_config=config_class(use_symmetric_packing=use_symmetric_packing, **F64_STATE[config_class]),
    )
    return params, optimizer


def round_trip(state_dict: dict[str, Any]) -> dict[str, Any]:
    buffer = io.BytesIO()
    torch.save(state_dict, buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=False)


@pytest.mark.parametrize("config_class", [RootInvShampooPreconditionerConfig, RootInvKLShampooPreconditionerConfig, EigendecomposedShampooPreconditionerConfig, EigenvalueCorrectedShampooPreconditionerConfig])
def test_packed_and_square_storage_give_the_same_steps(config_class: type) -> None:
    """Packing stores the upper triangle; the mirrored matrices are exactly symmetric, so results agree to rounding."""
    shapes = FULL_RANK_SHAPES if config_class is EigenvalueCorrectedShampooPreconditionerConfig else MIXED_SHAPES
    trajectories = []
    for use_symmetric_packing in (True, False):
        params, optimizer = make(0, use_symmetric_packing, config_class, shapes)
        train(optimizer, params, range(7))
        trajectories.append([param.detach().clone() for param in params])
    for packed, square in zip(*trajectories, strict=True):
        torch.testing.assert_close(packed, square, rtol=1e-10, atol=1e-12)


def test_packed_factors_hold_the_upper_triangle_of_the_square_ones() -> None:
    results = {}
    for use_symmetric_packing in (True, False):
        params, optimizer = make(0, use_symmetric_packing)
        train(optimizer, params, range(3))
        results[use_symmetric_packing] = optimizer.state_dict()["state"][0]["block_0"]["shampoo"]
    upper = torch.ones(4, 4, dtype=torch.bool).triu()
    for key in ("factor_matrices", "inv_factor_matrices"):
        packed, square = results[True][key][0], results[False][key][0]
        assert packed.shape == (10,) and square.shape == (4, 4)
        torch.testing.assert_close(packed, square[upper], rtol=1e-12, atol=1e-14)


@pytest.mark.parametrize(("saved_packed", "loaded_packed"), [(True, True), (False, True), (True, False), (False, False)])
def test_checkpoints_load_across_storage_layouts(saved_packed: bool, loaded_packed: bool) -> None:
    """Today's published checkpoints are packed, ours from before were square: each resumes in either layout."""
    uninterrupted_params, uninterrupted = make(0, loaded_packed)
    train(uninterrupted, uninterrupted_params, range(8))

    params, optimizer = make(0, saved_packed)
    train(optimizer, params, range(5))
    checkpoint = round_trip({"params": [p.detach() for p in params], "optimizer": optimizer.state_dict()})
    resumed_params, resumed = make(1, loaded_packed)
    with torch.no_grad():
        for param, saved in zip(resumed_params, checkpoint["params"], strict=True):
            param.copy_(saved)
    resumed.load_state_dict(checkpoint["optimizer"])
    train(resumed, resumed_params, range(5, 8))
    # Across layouts the lower triangle becomes the mirrored upper one: equal up to rounding, not bitwise.
    tolerance = dict(rtol=0.0, atol=0.0) if saved_packed == loaded_packed else dict(rtol=1e-10, atol=1e-12)
    for got, want in zip(resumed_params, uninterrupted_params, strict=True):
        torch.testing.assert_close(got, want, **tolerance)


def test_an_old_checkpoint_with_the_step_under_the_first_parameter_only_loads_with_warnings(caplog: pytest.LogCaptureFixture) -> None:
    """Our checkpoints before this change (and May's published ones) stored the scalars under one parameter."""
    uninterrupted_params, uninterrupted = make(0, False)
    train(uninterrupted, uninterrupted_params, range(8))
    params, optimizer = make(0, False)
    train(optimizer, params, range(5))
    state_dict = round_trip(optimizer.state_dict())
    for index in (1, 2):
        del state_dict["state"][index]["step"]
    resumed_params, resumed = make(0, True)  # and into today's packed default
    with torch.no_grad():
        for param, saved in zip(resumed_params, params, strict=True):
            param.copy_(saved)
    with caplog.at_level(logging.WARNING):
        resumed.load_state_dict(state_dict)
    assert caplog.text.count("Key step not found in state dict to load.") == 2
    assert all(resumed.state[param]["step"].item() == 5 for param in resumed_params)
    train(resumed, resumed_params, range(5, 8))
    for got, want in zip(resumed_params, uninterrupted_params, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12)


def test_a_factor_of_another_size_is_a_clear_error() -> None:
    _, optimizer = make(0, True)
    state_dict = optimizer.state_dict()
    state_dict["state"][0]["block_0"]["shampoo"]["factor_matrices"][0] = torch.zeros(5, 5)
    with pytest.raises(ValueError, match=r"Cannot load factor_matrices\[0\]: the checkpoint holds shape \(5, 5\) where this optimizer keeps \(10,\)"):
        optimizer.load_state_dict(state_dict)


# ---------------------------------------------------------------------------------- concurrency and distribution


def test_concurrency_config() -> None:
    assert DefaultConcurrencyConfig.enable_cuda_stream_for_param_groups is True
    with pytest.raises(TypeError):
        ConcurrencyConfig(False)  # type: ignore[misc]  # keyword-only
    # On the CPU the per-group streams stay off whatever the flag says; results are those of the plain loop.
    results = []
    for config in (ConcurrencyConfig(enable_cuda_stream_for_param_groups=True), ConcurrencyConfig(enable_cuda_stream_for_param_groups=False)):
        params = [torch.nn.Parameter(torch.ones(3)), torch.nn.Parameter(torch.ones(2))]
        optimizer = DistributedShampoo([{"params": params[:1]}, {"params": params[1:], "lr": 0.5}], lr=0.1, concurrency_config=config)
        assert optimizer._group_streams is None
        train(optimizer, params, range(3))
        results.append([p.detach().clone() for p in params])
    for a, b in zip(*results, strict=True):
        assert torch.equal(a, b)


@pytest.mark.parametrize(
    ("arguments", "message"),
    [
        (dict(num_sub_groups=0), "Invalid num_sub_groups value: 0. Must be >= 1."),
        (dict(num_sub_groups=2), "num_sub_groups=2 needs param_assignment_strategy REPLICATE or ROUND_ROBIN"),
    ],
)
def test_num_sub_groups_validation(arguments: dict[str, int], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        FullyShardDistributedConfig(**arguments)
    with pytest.raises(ValueError, match=message):
        HybridShardDistributedConfig(device_mesh=None, **arguments)


def test_num_sub_groups_is_accepted_but_fully_shard_is_not_supported() -> None:
    config = FullyShardDistributedConfig(num_sub_groups=2, param_assignment_strategy=FSDPParamAssignmentStrategy.ROUND_ROBIN)
    assert config.load_balancing_config.cost_model.alignment_bytes == 64
    with pytest.raises(NotImplementedError, match="FullyShardDistributedConfig is not supported.*DDPDistributedConfig"):
        DistributedShampoo([torch.nn.Parameter(torch.zeros(2))], distributed_config=config)


def test_select_distributor_class_is_an_overridable_hook() -> None:
    from dataclasses import dataclass

    from distributed_shampoo import DistributedConfig

    chosen: list[Any] = []

    class Recording(DistributedShampoo):
        def _select_distributor_class(self, distributed_config: Any) -> type:
            chosen.append(distributed_config)
            return super()._select_distributor_class(distributed_config)

    config = SingleDeviceDistributedConfig()
    optimizer = Recording([torch.nn.Parameter(torch.zeros(2))], distributed_config=config)
    assert chosen == [config] and isinstance(optimizer._group_runtimes[0].distributor, Distributor)
    assert DistributedShampoo._select_distributor_class(optimizer, DDPDistributedConfig()).__name__ == "DDPDistributor"

    @dataclass
    class UnknownDistributedConfig(DistributedConfig):
        pass

    with pytest.raises(NotImplementedError, match=r"distributed_config=.*UnknownDistributedConfig.* not supported!"):
        DistributedShampoo([torch.nn.Parameter(torch.zeros(2))], distributed_config=UnknownDistributedConfig())


def test_corrected_and_independent_weight_decay_shrink_z_too() -> None:
    """α = wd·lr/peak_lr (CORRECTED) or wd/peak_lr (INDEPENDENT): with lr = peak_lr = 0.1 CORRECTED equals
    DECOUPLED, and INDEPENDENT with wd = 0.01 is DECOUPLED with 0.1."""
    config = GeneralizedPrimalAveragingConfig(eval_interp_coeff=0.5, train_interp_coeff=1.0)
    decoupled, _, _ = one_element_trajectory([1.0, 2.0, 1.0], **SGD_STEPS, weight_decay=0.1, iterate_averaging_config=config)
    corrected, _, _ = one_element_trajectory(
        [1.0, 2.0, 1.0], **SGD_STEPS, weight_decay=0.1, weight_decay_type=WeightDecayType.CORRECTED, iterate_averaging_config=config
    )
    independent, _, _ = one_element_trajectory(
        [1.0, 2.0, 1.0], **SGD_STEPS, weight_decay=0.01, weight_decay_type=WeightDecayType.INDEPENDENT, iterate_averaging_config=config
    )
    assert corrected == pytest.approx(decoupled, abs=1e-7) and independent == pytest.approx(decoupled, abs=1e-7)
    assert not math.isclose(decoupled[1], 0.812775, abs_tol=1e-5)  # the May semantics (α·y in the direction)
