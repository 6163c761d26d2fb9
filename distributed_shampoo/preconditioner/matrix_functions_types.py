"""Configuration dataclasses for the matrix functions in `matrix_functions.py`.

Field names match the parameter names of the worker routines: the routines receive a config's fields as
keyword arguments (see `matrix_functions._assign_function_args_from_config`). `Default…` names are shared
module-level instances.
"""

from dataclasses import dataclass, field
from typing import Protocol

from distributed_shampoo.utils.abstract_dataclass import AbstractDataclass


@dataclass(init=False)
class RankDeficientStabilityConfig(AbstractDataclass):
    """How a (possibly rank-deficient) symmetric matrix is made safe to invert."""


@dataclass(kw_only=True)
class PerturbationConfig(RankDeficientStabilityConfig):
    """Add epsilon·I before the eigendecomposition (`True`) or shift the eigenvalues afterwards (`False`)."""

    perturb_before_computation: bool = True


DefaultPerturbationConfig = PerturbationConfig()


@dataclass(kw_only=True)
class PseudoInverseConfig(RankDeficientStabilityConfig):
    """Invert only eigenvalues above max(rank_atol, rank_rtol·λ_max); the rest map to zero.

    `rank_rtol=None` means numel·machine-epsilon of the dtype. Requires epsilon == 0.
    """

    rank_atol: float = 0.0
    rank_rtol: float | None = 0.0


@dataclass(init=False)
class MatrixFunctionConfig(AbstractDataclass):
    """Base of every matrix-function configuration."""


@dataclass(init=False, kw_only=True)
class EigendecompositionConfig(MatrixFunctionConfig):
    """Symmetric eigendecomposition settings.

    `tolerance` in [0, 1]: when non-zero and an eigenvector estimate is given, the decomposition is skipped
    while the estimate still diagonalises the matrix to that relative off-diagonal norm.
    """

    rank_deficient_stability_config: RankDeficientStabilityConfig = field(
        default_factory=lambda: DefaultPerturbationConfig
    )
    tolerance: float = 0.0

    def __post_init__(self) -> None:
        if not 0.0 <= self.tolerance <= 1.0:
            raise ValueError(f"Invalid tolerance value: {self.tolerance}. Must be in the interval [0.0, 1.0].")


@dataclass(kw_only=True)
class EighEigendecompositionConfig(EigendecompositionConfig):
    """`torch.linalg.eigh`, retried in float64 if it fails; optionally run on another device."""

    retry_double_precision: bool = True
    eigendecomposition_offload_device: str = ""


DefaultEigendecompositionConfig = EighEigendecompositionConfig()


@dataclass(kw_only=True)
class QREigendecompositionConfig(EigendecompositionConfig):
    """Orthogonal (QR) iterations warm-started from the previous eigenvectors."""

    max_iterations: int = 1


@dataclass(init=False)
class RootInvConfig(MatrixFunctionConfig):
    """Base of the methods that compute A^(-1/root) directly."""


@dataclass(kw_only=True)
class EigenConfig(RootInvConfig, EighEigendecompositionConfig):
    """Root inverse through a full symmetric eigendecomposition (the record's method)."""

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.tolerance != 0.0:
            raise ValueError(
                f"{type(self).__name__} does not support a non-zero tolerance (got {self.tolerance}); "
                "it always recomputes the eigendecomposition."
            )


DefaultEigenConfig = EigenConfig()


@dataclass(kw_only=True)
class CoupledNewtonConfig(RootInvConfig):
    """Coupled Newton iteration for A^(-1/root); the root must be an integer."""

    max_iterations: int = 100
    tolerance: float = 1e-6


@dataclass(kw_only=True)
class CoupledHigherOrderConfig(RootInvConfig):
    """Higher-order coupled iteration for A^(-p/q) on A regularised by max(rel_epsilon·‖A‖∞, abs_epsilon)."""

    rel_epsilon: float
    abs_epsilon: float
    max_iterations: int = 100
    tolerance: float = 1e-8
    order: int = 3
    disable_tf32: bool = True


class ScaleByDimsFn(Protocol):
    """Scale of an orthogonalised (d_out × d_in) update; called with keyword arguments."""

    def __call__(self, d_in: int, d_out: int) -> float: ...


def _unit_scale(d_in: int, d_out: int) -> float:
    return 1.0


@dataclass(init=False, kw_only=True)
class OrthogonalizationConfig(MatrixFunctionConfig):
    """Base of the orthogonalization methods; the result is multiplied by scale_by_dims_fn(d_in, d_out)."""

    scale_by_dims_fn: ScaleByDimsFn = _unit_scale


@dataclass(kw_only=True)
class SVDOrthogonalizationConfig(OrthogonalizationConfig):
    """Exact U·Vᵀ from a reduced SVD, optionally times the nuclear norm."""

    scale_by_nuclear_norm: bool = False


@dataclass(kw_only=True)
class NewtonSchulzOrthogonalizationConfig(OrthogonalizationConfig):
    """Quintic Newton–Schulz iteration (coefficients from Keller Jordan's Muon)."""

    num_iterations: int = 5
    coefficients: tuple[float, float, float] = (3.4445, -4.7750, 2.0315)


DefaultNewtonSchulzOrthogonalizationConfig = NewtonSchulzOrthogonalizationConfig()
