"""Validation rules of the configuration dataclasses."""

import math

import pytest
import torch

from distributed_shampoo.preconditioner.matrix_functions_types import EigenConfig, EighEigendecompositionConfig, PseudoInverseConfig
from distributed_shampoo.shampoo_types import (
    AdaGradPreconditionerConfig,
    AdamPreconditionerConfig,
    BaseShampooPreconditionerConfig,
    ClassicShampooPreconditionerConfig,
    DDPDistributedConfig,
    DistributedConfig,
    EigenvalueCorrectedShampooPreconditionerConfig,
    GeneralizedPrimalAveragingConfig,
    RMSpropPreconditionerConfig,
    ScheduleFreeConfig,
    ShampooRuntimeConfig,
    SignDescentPreconditionerConfig,
    SingleDeviceDistributedConfig,
    WeightDecayType,
)


@pytest.mark.parametrize("config_class", [AdaGradPreconditionerConfig, RMSpropPreconditionerConfig, AdamPreconditionerConfig])
@pytest.mark.parametrize("epsilon", [0.0, -1e-10])
def test_grafting_epsilon_must_be_positive(config_class: type, epsilon: float) -> None:
    with pytest.raises(ValueError, match=rf"Invalid epsilon value: {epsilon}. Must be > 0.0."):
        config_class(epsilon=epsilon)


@pytest.mark.parametrize("config_class", [RMSpropPreconditionerConfig, AdamPreconditionerConfig])
@pytest.mark.parametrize("beta2", [-1.0, 0.0, 1.3])
def test_grafting_beta2_range(config_class: type, beta2: float) -> None:
    with pytest.raises(ValueError, match=rf"Invalid grafting beta2 parameter: {beta2}. Must be in \(0.0, 1.0\]."):
        config_class(beta2=beta2)


def concrete_subclasses(cls: type) -> list[type]:
    """`cls` and its transitive subclasses that can be instantiated, each once."""
    found = [cls]
    for current in found:
        found.extend(sub for sub in current.__subclasses__() if sub not in found)
    return [c for c in found if not getattr(c, "__abstractmethods__", None)]


SHAMPOO_CONFIGS = concrete_subclasses(BaseShampooPreconditionerConfig)
CLASSIC_CONFIGS = concrete_subclasses(ClassicShampooPreconditionerConfig)


def test_all_shampoo_variants_are_found() -> None:
    assert len(SHAMPOO_CONFIGS) == 5 and len(CLASSIC_CONFIGS) == 4


@pytest.mark.parametrize("config_class", SHAMPOO_CONFIGS)
def test_negative_failure_tolerance_is_rejected(config_class: type) -> None:
    with pytest.raises(ValueError, match="num_tolerated_failed_amortized_computations value: -1. Must be >= 0."):
        config_class(num_tolerated_failed_amortized_computations=-1)


@pytest.mark.parametrize("config_class", CLASSIC_CONFIGS)
def test_inverse_exponent_override_rules(config_class: type) -> None:
    with pytest.raises(ValueError, match=r"Invalid orders .*: \[-1, -2\]"):
        config_class(inverse_exponent_override={-1: 0.5, -2: 0.5, 1: 0.5})
    with pytest.raises(ValueError, match=r"Invalid dimensions in override\[2\]=.*: \[2, -1\]"):
        config_class(inverse_exponent_override={2: {2: 0.5, -1: 0.5, 0: 0.5}})
    with pytest.raises(ValueError, match=r"Invalid exponent values in override\[2\]=.*: \[-0.5\]"):
        config_class(inverse_exponent_override={2: {0: -0.5}})
    with pytest.raises(ValueError, match=r"Invalid exponent in override\[1\]=-0.5"):
        config_class(inverse_exponent_override={1: -0.5})
    with pytest.raises(AssertionError):
        config_class(inverse_exponent_override={2: 1})
    config_class(inverse_exponent_override={0: {0: 1.0}, 1: 0.0, 2: {1: 0.25}})


def test_eigenvalue_corrected_rules() -> None:
    config_class = EigenvalueCorrectedShampooPreconditionerConfig
    with pytest.raises(ValueError, match="PseudoInverseConfig is not supported by EigenvalueCorrected.*use PerturbationConfig"):
        config_class(amortized_computation_config=EighEigendecompositionConfig(rank_deficient_stability_config=PseudoInverseConfig()))
    with pytest.raises(ValueError, match=r"Invalid orders .*: \[-1\]"):
        config_class(ignored_basis_change_dims={-1: [0]})
    with pytest.raises(ValueError, match=r"ignored_basis_change_dims\[2\]=\[0, 2\]: \[2\]"):
        config_class(ignored_basis_change_dims={2: [0, 2]})
    with pytest.raises(ValueError, match="Duplicate dimensions"):
        config_class(ignored_basis_change_dims={2: [1, 1]})
    with pytest.raises(ValueError, match=r"Invalid orders .*: \[-1\]"):
        config_class(inverse_exponent_override={-1: 0.5})
    with pytest.raises(ValueError, match=r"must be > 0"):
        config_class(inverse_exponent_override={2: 0.0})
    config_class(ignored_basis_change_dims={0: [0], 2: [1]}, inverse_exponent_override={2: 1.0})


def test_sign_descent_scale_function() -> None:
    assert SignDescentPreconditionerConfig().scale_fn(torch.ones(3)) == 1.0
    assert SignDescentPreconditionerConfig(scale_fn=lambda g: 3.0).scale_fn(torch.ones(3)) == 3.0


@pytest.mark.parametrize("train", [-0.1, 0.0, 1.5])
def test_train_interp_coefficient_range(train: float) -> None:
    for config_class in (GeneralizedPrimalAveragingConfig, ScheduleFreeConfig):
        with pytest.raises(ValueError, match=rf"train_interp_coeff={train}. Must be in \(0.0, 1.0\]"):
            config_class(train_interp_coeff=train)


@pytest.mark.parametrize("evaluation", [-0.1, 1.0, 1.5])
def test_eval_interp_coefficient_range(evaluation: float) -> None:
    with pytest.raises(ValueError, match=rf"eval_interp_coeff={evaluation}. Must be in \[0.0, 1.0\)"):
        GeneralizedPrimalAveragingConfig(eval_interp_coeff=evaluation)


def test_boundary_values_are_accepted() -> None:
    GeneralizedPrimalAveragingConfig(eval_interp_coeff=0.0, train_interp_coeff=1.0)
    ScheduleFreeConfig(train_interp_coeff=1.0)
    AdamPreconditionerConfig(beta2=1.0)
    EigenConfig(tolerance=0.0)


@pytest.mark.parametrize("config_class", concrete_subclasses(DistributedConfig))
@pytest.mark.parametrize("target", [-1, 0, 0.1])
def test_target_parameter_dimensionality(config_class: type, target: float) -> None:
    required = {"param_to_metadata": {}, "device_mesh": None}
    fields = {name: value for name, value in required.items() if name in config_class.__dataclass_fields__}
    expected = "Must be an integer or math.inf" if isinstance(target, float) else "Must be >= 1"
    with pytest.raises(ValueError, match=expected):
        config_class(target_parameter_dimensionality=target, **fields)
    config_class(target_parameter_dimensionality=math.inf, **fields)


def test_defaults_and_enum() -> None:
    assert DDPDistributedConfig().communication_dtype == torch.float32
    assert DDPDistributedConfig().num_trainers_per_group == -1 and not DDPDistributedConfig().communicate_params
    assert SingleDeviceDistributedConfig().target_parameter_dimensionality == 1
    assert [t.value for t in WeightDecayType] == ["L2", "DECOUPLED", "CORRECTED", "INDEPENDENT"]
    with pytest.raises(TypeError, match="Can't instantiate abstract class"):
        DistributedConfig()


@pytest.mark.parametrize("streams", [0, -2])
def test_amortized_computation_streams_must_be_positive(streams: int) -> None:
    with pytest.raises(ValueError, match=rf"Invalid num_amortized_computation_streams value: {streams}. Must be >= 1"):
        ShampooRuntimeConfig(num_amortized_computation_streams=streams)
    assert ShampooRuntimeConfig().num_amortized_computation_streams == 1


@pytest.mark.parametrize("fraction", [-0.1, float("nan")])
def test_concurrent_memory_fraction_must_be_a_non_negative_number(fraction: float) -> None:
    with pytest.raises(ValueError, match=r"Invalid concurrent_memory_fraction value: .*Must be >= 0"):
        ShampooRuntimeConfig(concurrent_memory_fraction=fraction)
    assert ShampooRuntimeConfig().concurrent_memory_fraction == 0.1
    assert ShampooRuntimeConfig(concurrent_memory_fraction=float("inf")).concurrent_memory_fraction == float("inf")
