"""Validation of the matrix-function configs."""

import pytest

from distributed_shampoo.preconditioner.matrix_functions_types import (
    DefaultEigenConfig,
    DefaultPerturbationConfig,
    EigenConfig,
    EigendecompositionConfig,
    EighEigendecompositionConfig,
    MatrixFunctionConfig,
    RankDeficientStabilityConfig,
    QREigendecompositionConfig,
    RootInvConfig,
)


@pytest.mark.parametrize("tolerance", [-0.1, 1.1])
def test_tolerance_outside_unit_interval_is_rejected(tolerance: float) -> None:
    config_classes = [EighEigendecompositionConfig, QREigendecompositionConfig, EigenConfig]  # every concrete subclass
    assert {c for c in config_classes if issubclass(c, EigendecompositionConfig)} == set(config_classes)
    for config_class in config_classes:
        with pytest.raises(ValueError, match=rf"Invalid tolerance value: {tolerance}. Must be in the interval \[0.0, 1.0\]."):
            config_class(tolerance=tolerance)


def test_eigen_config_needs_zero_tolerance() -> None:
    with pytest.raises(ValueError, match="EigenConfig does not support a non-zero tolerance"):
        EigenConfig(tolerance=0.01)


def test_abstract_configs_cannot_be_instantiated_and_defaults_are_shared() -> None:
    for abstract in (RankDeficientStabilityConfig, MatrixFunctionConfig, EigendecompositionConfig, RootInvConfig):
        with pytest.raises(TypeError, match="Can't instantiate abstract class"):
            abstract()
    assert DefaultEigenConfig.rank_deficient_stability_config is DefaultPerturbationConfig
