"""Configuration dataclasses, enums and string constants of Distributed Shampoo.

The string constants are param-group and state keys: their spelling is part of the checkpoint format.
"""

import enum
import inspect
import math
from collections.abc import Callable
from dataclasses import dataclass, field, make_dataclass
from typing import Any

import torch
from torch import Tensor
from torch.nn import Parameter

from distributed_shampoo.preconditioner.matrix_functions_types import (
    DefaultEigenConfig,
    DefaultEigendecompositionConfig,
    DefaultNewtonSchulzOrthogonalizationConfig,
    EigendecompositionConfig,
    OrthogonalizationConfig,
    PerturbationConfig,
    QREigendecompositionConfig,
    RootInvConfig,
)
from distributed_shampoo.utils.abstract_dataclass import AbstractDataclass
from distributed_shampoo.utils.load_balancing_utils import CostModel, DefaultCostModel

# Optimizer state keys.
FILTERED_GRAD = "filtered_grad"
LR_SUM = "lr_sum"
MOMENTUM_BUFFER = "momentum_buffer"
STEP = "step"
TRAIN_MODE = "train_mode"
WEIGHT_BUFFER = "weight_buffer"

# Param-group keys.
LR = "lr"
BETAS = "betas"
BETA3 = "beta3"
EPSILON = "epsilon"
WEIGHT_DECAY = "weight_decay"
PEAK_LR = "peak_lr"
WEIGHT_DECAY_TYPE = "weight_decay_type"
MAX_PRECONDITIONER_DIM = "max_preconditioner_dim"
PRECONDITION_FREQUENCY = "precondition_frequency"
START_PRECONDITIONING_STEP = "start_preconditioning_step"
USE_BIAS_CORRECTION = "use_bias_correction"
ITERATE_AVERAGING_CONFIG = "iterate_averaging_config"
GRAFTING_CONFIG = "grafting_config"
USE_PIN_MEMORY = "use_pin_memory"
DISTRIBUTED_CONFIG = "distributed_config"
PRECONDITIONER_CONFIG = "preconditioner_config"
PARAMS = "params"


class PreconditionerValueError(ValueError):
    """NaN or Inf found in a factor matrix or in a computed root/eigendecomposition."""


# ---------------------------------------------------------------------------------------------- preconditioners


@dataclass(init=False)
class PreconditionerConfig(AbstractDataclass):
    """Base of every preconditioner (and grafting) configuration."""


@dataclass
class SGDPreconditionerConfig(PreconditionerConfig):
    """Identity preconditioner: the direction is the (filtered) gradient."""


@dataclass(kw_only=True)
class AdaGradPreconditionerConfig(PreconditionerConfig):
    """Diagonal AdaGrad: X / (sqrt(Σ g²) + epsilon)."""

    epsilon: float = 1e-10

    def __post_init__(self) -> None:
        if not self.epsilon > 0.0:
            raise ValueError(f"Invalid epsilon value: {self.epsilon}. Must be > 0.0.")


@dataclass(kw_only=True)
class RMSpropPreconditionerConfig(AdaGradPreconditionerConfig):
    """Diagonal RMSprop: EMA of g² with weight (1 - beta2), no bias correction."""

    beta2: float = 0.99
    drop_weighting_factor_on_gsquare: bool = False

    def __post_init__(self) -> None:
        super().__post_init__()
        if not 0.0 < self.beta2 <= 1.0:
            raise ValueError(f"Invalid grafting beta2 parameter: {self.beta2}. Must be in (0.0, 1.0].")


@dataclass(kw_only=True)
class AdamPreconditionerConfig(RMSpropPreconditionerConfig):
    """Diagonal Adam: RMSprop with bias correction 1 - beta2^t (the record's grafting)."""

    beta2: float = 0.999


@dataclass(init=False, kw_only=True)
class BaseShampooPreconditionerConfig(PreconditionerConfig):
    """Settings shared by every Shampoo variant.

    `amortized_computation_config` is the matrix function run every `precondition_frequency` steps; a failure
    keeps the previous result, and more than `num_tolerated_failed_amortized_computations` consecutive failures
    of one block raise. With `drop_weighting_factor_on_gsquare` the factors accumulate F ← β₂·F + G·Gᵀ (weight 1)
    and are not bias-corrected. `use_symmetric_packing` stores each factor matrix (and each stored inverse root)
    as its upper triangle, d(d+1)/2 numbers instead of d². `use_trace_scaling` divides each factor by
    max(trace, epsilon)^trace_scaling_exponent before its root is taken.

    The fields are listed in the order of the published package's repr.
    """

    amortized_computation_config: Any = field(repr=False, default=None)
    drop_weighting_factor_on_gsquare: bool = False
    factor_matrix_dtype: torch.dtype = torch.float32
    num_tolerated_failed_amortized_computations: int = 3
    use_symmetric_packing: bool = True
    use_trace_scaling: bool = False
    trace_scaling_exponent: float = 0.5

    def __post_init__(self) -> None:
        if self.num_tolerated_failed_amortized_computations < 0:
            raise ValueError(
                "Invalid num_tolerated_failed_amortized_computations value: "
                f"{self.num_tolerated_failed_amortized_computations}. Must be >= 0."
            )
        if self.use_trace_scaling and not 0.0 < self.trace_scaling_exponent <= 1.0:
            raise ValueError(
                f"Invalid trace_scaling_exponent value: {self.trace_scaling_exponent}. "
                "Must be in (0.0, 1.0] when use_trace_scaling=True."
            )


def _check_inverse_exponent_override(override: dict[int, dict[int, float] | float]) -> None:
    """Classic Shampoo exponent overrides: orders >= 0, dims within the order, exponents >= 0."""
    if bad_orders := [order for order in override if order < 0]:
        raise ValueError(f"Invalid orders in {override=}: {bad_orders}. All orders must be >= 0.")
    for order, entry in override.items():
        if isinstance(entry, dict):
            if bad_dims := [d for d in entry if not 0 <= d <= max(order - 1, 0)]:
                raise ValueError(
                    f"Invalid dimensions in override[{order}]={entry}: {bad_dims}. "
                    f"All dimensions must be within [0, {max(order - 1, 0)}]."
                )
            if bad_values := [v for v in entry.values() if v < 0]:
                raise ValueError(
                    f"Invalid exponent values in override[{order}]={entry}: {bad_values}. All values must be >= 0."
                )
        else:
            assert isinstance(entry, float), f"override[{order}]={entry!r} must be a float or a dict."
            if entry < 0:
                raise ValueError(f"Invalid exponent in override[{order}]={entry}. Must be >= 0.")


@dataclass(init=False, kw_only=True)
class ClassicShampooPreconditionerConfig(BaseShampooPreconditionerConfig):
    """Kronecker-factored Shampoo with per-dimension exponents.

    `inverse_exponent_override[order]` is a float (all dims of blocks of that order) or a {dim: exponent} dict;
    exponent 0 leaves that dim unpreconditioned. Default exponent is 1/(2·order): -1/4 per side for matrices.
    """

    inverse_exponent_override: dict[int, dict[int, float] | float] = field(default_factory=dict)

    def __post_init__(self) -> None:
        super().__post_init__()
        _check_inverse_exponent_override(self.inverse_exponent_override)


@dataclass(kw_only=True)
class RootInvShampooPreconditionerConfig(ClassicShampooPreconditionerConfig):
    """Stores the inverse roots of the factor matrices (the record's variant)."""

    amortized_computation_config: RootInvConfig = field(repr=False, default_factory=lambda: DefaultEigenConfig)
    inv_factor_matrix_dtype: torch.dtype = torch.float32


DefaultShampooConfig = RootInvShampooPreconditionerConfig()


@dataclass(kw_only=True)
class EigendecomposedShampooPreconditionerConfig(ClassicShampooPreconditionerConfig):
    """Stores eigenvalues and eigenvectors; the root is formed at every preconditioning."""

    amortized_computation_config: EigendecompositionConfig = field(
        repr=False, default_factory=lambda: DefaultEigendecompositionConfig
    )
    factor_matrix_eigenvectors_dtype: torch.dtype = torch.float32
    factor_matrix_eigenvalues_dtype: torch.dtype = torch.float32


@dataclass(kw_only=True)
class RootInvKLShampooPreconditionerConfig(RootInvShampooPreconditionerConfig):
    """KL-Shampoo: each factor is updated from the gradient preconditioned along the other dims."""


@dataclass(kw_only=True)
class EigendecomposedKLShampooPreconditionerConfig(EigendecomposedShampooPreconditionerConfig):
    """KL-Shampoo with eigendecomposed factors."""


@dataclass(kw_only=True)
class EigenvalueCorrectedShampooPreconditionerConfig(BaseShampooPreconditionerConfig):
    """Adam/AdaGrad in the factor matrices' eigenbasis (SOAP with a QR eigendecomposition).

    `ignored_basis_change_dims[order]` lists dims kept in the standard basis; `inverse_exponent_override[order]`
    is the single exponent applied to the corrected eigenvalues (default 1/2).
    """

    amortized_computation_config: EigendecompositionConfig = field(
        repr=False, default_factory=lambda: DefaultEigendecompositionConfig
    )
    ignored_basis_change_dims: dict[int, list[int]] = field(default_factory=dict)
    inverse_exponent_override: dict[int, float] = field(default_factory=dict)
    factor_matrix_eigenvectors_dtype: torch.dtype = torch.float32
    corrected_eigenvalues_dtype: torch.dtype = torch.float32

    def __post_init__(self) -> None:
        super().__post_init__()
        stability = self.amortized_computation_config.rank_deficient_stability_config
        if not isinstance(stability, PerturbationConfig):
            raise ValueError(
                f"{type(stability).__name__} is not supported by {type(self).__name__}: "
                "use PerturbationConfig as rank_deficient_stability_config."
            )
        ignored = self.ignored_basis_change_dims
        if bad_orders := [order for order in ignored if order < 0]:
            raise ValueError(f"Invalid orders in {ignored=}: {bad_orders}. All orders must be >= 0.")
        for order, dims in ignored.items():
            if bad_dims := [d for d in dims if not 0 <= d <= max(order - 1, 0)]:
                raise ValueError(
                    f"Invalid dimensions in ignored_basis_change_dims[{order}]={dims}: {bad_dims}. "
                    f"All dimensions must be within [0, {max(order - 1, 0)}]."
                )
            if len(set(dims)) != len(dims):
                raise ValueError(f"Duplicate dimensions in ignored_basis_change_dims[{order}]={dims}.")
        override = self.inverse_exponent_override
        if bad_orders := [order for order in override if order < 0]:
            raise ValueError(f"Invalid orders in {override=}: {bad_orders}. All orders must be >= 0.")
        if bad_values := [v for v in override.values() if v <= 0]:
            raise ValueError(f"Invalid exponent values in {override=}: {bad_values}. All values must be > 0.")


DefaultEigenvalueCorrectedShampooConfig = EigenvalueCorrectedShampooPreconditionerConfig()
DefaultSOAPConfig = EigenvalueCorrectedShampooPreconditionerConfig(
    amortized_computation_config=QREigendecompositionConfig()
)


@dataclass(kw_only=True)
class SpectralDescentPreconditionerConfig(PreconditionerConfig):
    """Orthogonalised direction (Muon-like); every block must be 2-D."""

    orthogonalization_config: OrthogonalizationConfig = field(
        default_factory=lambda: DefaultNewtonSchulzOrthogonalizationConfig
    )


DefaultSpectralDescentPreconditionerConfig = SpectralDescentPreconditionerConfig()


def _unit_scale(grad: Tensor) -> float:
    return 1.0


@dataclass(kw_only=True)
class SignDescentPreconditionerConfig(PreconditionerConfig):
    """Direction sign(X)·scale_fn(X) per block."""

    scale_fn: Callable[[Tensor], float | Tensor] = _unit_scale


DefaultSignDescentPreconditionerConfig = SignDescentPreconditionerConfig()


# ------------------------------------------------------------------------------------------ iterate averaging


@dataclass(init=False)
class IterateAveragingConfig(AbstractDataclass):
    """Base of the schemes that transform the step after preconditioning: GPA and Schedule-Free (parameters hold
    y, the state holds z) and classic momentum. Other subclasses are rejected by `DistributedShampoo`."""


@dataclass(kw_only=True)
class GeneralizedPrimalAveragingConfig(IterateAveragingConfig):
    """Generalized primal averaging with constant interpolation coefficients."""

    eval_interp_coeff: float = 0.9
    train_interp_coeff: float = 0.8

    def __post_init__(self) -> None:
        if not 0.0 <= self.eval_interp_coeff < 1.0:
            raise ValueError(f"Invalid eval_interp_coeff={self.eval_interp_coeff}. Must be in [0.0, 1.0).")
        if not 0.0 < self.train_interp_coeff <= 1.0:
            raise ValueError(f"Invalid train_interp_coeff={self.train_interp_coeff}. Must be in (0.0, 1.0].")


@dataclass(kw_only=True)
class ScheduleFreeConfig(IterateAveragingConfig):
    """Schedule-Free: eval coefficient 1 - lr^p / Σ lr^p."""

    train_interp_coeff: float = 0.8
    eval_coeff_lr_power: int = 2

    def __post_init__(self) -> None:
        if not 0.0 < self.train_interp_coeff <= 1.0:
            raise ValueError(f"Invalid train_interp_coeff={self.train_interp_coeff}. Must be in (0.0, 1.0].")


@dataclass(kw_only=True)
class ClassicMomentumConfig(IterateAveragingConfig):
    """Heavy-ball (or Nesterov) momentum on the preconditioned, grafted, weight-decayed direction P.

    M ← momentum·M + (1 - dampening)·P, then the step uses M, or (1 - dampening)·P + momentum·M with
    Nesterov. M starts at zero and is not bias-corrected. Leave `iterate_averaging_config=None` for no momentum.
    """

    momentum: float = 0.5
    dampening: float = 0.0
    use_nesterov: bool = False

    def __post_init__(self) -> None:
        if not 0.0 < self.momentum < 1.0:
            raise ValueError(f"Invalid self.momentum={self.momentum}. Must be within (0.0, 1.0).")
        if not 0.0 <= self.dampening < 1.0:
            raise ValueError(f"Invalid self.dampening={self.dampening}. Must be within [0.0, 1.0).")


# ------------------------------------------------------------------------------------------------ weight decay


@enum.unique
class WeightDecayType(enum.Enum):
    """L2 adds wd·W to the gradient; the others add it to the direction (AdamW style)."""

    L2 = "L2"
    DECOUPLED = "DECOUPLED"  # P + wd·W
    CORRECTED = "CORRECTED"  # P + wd·(lr/peak_lr)·W
    INDEPENDENT = "INDEPENDENT"  # P + (wd/peak_lr)·W


# ----------------------------------------------------------------------------------------------- distribution


@dataclass
class FSDPParameterMetadata:
    """Where an original parameter lives inside an FSDP1 flat parameter."""

    fqn: str
    shape: torch.Size
    numel: int
    start_idx: int
    end_idx: int
    sharding_strategy: Any


@enum.unique
class FSDPParamAssignmentStrategy(enum.Enum):
    DEFAULT = enum.auto()
    REPLICATE = enum.auto()
    ROUND_ROBIN = enum.auto()


@dataclass(kw_only=True)
class LoadBalancingConfig:
    """Cost model used to assign blocks to ranks."""

    cost_model: CostModel = field(default_factory=lambda: DefaultCostModel)


@dataclass(init=False)
class DistributedConfig(AbstractDataclass):
    """Base of the distributed configurations.

    `target_parameter_dimensionality` is the dimensionality small dims are merged down to (1 = merge as much as
    `max_preconditioner_dim` allows; math.inf = never merge).
    """

    target_parameter_dimensionality: int | float = 1

    def __post_init__(self) -> None:
        target = self.target_parameter_dimensionality
        if isinstance(target, float) and target != math.inf:
            raise ValueError(
                f"Invalid {self.target_parameter_dimensionality=}. Must be an integer or math.inf."
            )
        if target < 1:
            raise ValueError(f"Invalid {self.target_parameter_dimensionality=}. Must be >= 1.")


@dataclass
class SingleDeviceDistributedConfig(DistributedConfig):
    """Every block lives on this process; no communication."""


DefaultSingleDeviceDistributedConfig = SingleDeviceDistributedConfig()


@dataclass(kw_only=True)
class DDPDistributedConfig(DistributedConfig):
    """Replicated parameters: blocks are spread over the ranks of each group and results all-gathered.

    `num_trainers_per_group=-1` uses the whole world; `communicate_params=True` all-gathers the updated
    parameters instead of the search directions.
    """

    communication_dtype: torch.dtype = torch.float32
    num_trainers_per_group: int = -1
    communicate_params: bool = False
    load_balancing_config: LoadBalancingConfig = field(default_factory=LoadBalancingConfig)


@dataclass(kw_only=True)
class FSDPDistributedConfig(DistributedConfig):
    """FSDP1 (`use_orig_params=True`); metadata from `compile_fsdp_parameter_metadata(model)`. Not supported here."""

    param_to_metadata: dict[Parameter, FSDPParameterMetadata]


@dataclass(kw_only=True)
class HSDPDistributedConfig(FSDPDistributedConfig, DDPDistributedConfig):
    """FSDP1 HYBRID_SHARD over a 2-D (replicate, shard) mesh. Not supported here."""

    device_mesh: Any


@dataclass(kw_only=True)
class FullyShardDistributedConfig(DistributedConfig):
    """FSDP2 `fully_shard`. Not supported by the optimizer here; the fields are validated as published.

    `num_sub_groups > 1` splits each param group into that many groups (only with the lossless REPLICATE or
    ROUND_ROBIN strategies).
    """

    param_assignment_strategy: FSDPParamAssignmentStrategy = FSDPParamAssignmentStrategy.DEFAULT
    num_sub_groups: int = 1
    load_balancing_config: LoadBalancingConfig = field(default_factory=LoadBalancingConfig)

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.num_sub_groups < 1:
            raise ValueError(f"Invalid num_sub_groups value: {self.num_sub_groups}. Must be >= 1.")
        if self.num_sub_groups > 1 and self.param_assignment_strategy == FSDPParamAssignmentStrategy.DEFAULT:
            raise ValueError(
                f"num_sub_groups={self.num_sub_groups} needs param_assignment_strategy REPLICATE or ROUND_ROBIN "
                "(the DEFAULT strategy cannot split param groups)."
            )


@dataclass(kw_only=True)
class HybridShardDistributedConfig(FullyShardDistributedConfig, DDPDistributedConfig):
    """FSDP2 over a 2-D mesh. Not supported here."""

    device_mesh: Any


# -------------------------------------------------------------------------------------------------- runtime


def _torch_compile_keywords() -> list[tuple[str, Any, Any]]:
    """(name, annotation, field with its default) of each keyword of this torch's `torch.compile`: every parameter
    after the first, which is what to compile."""
    compiled, *keywords = inspect.signature(torch.compile).parameters.values()
    assert compiled.name == "model", f"torch.compile's first parameter is {compiled.name!r}; expected model"
    return [(keyword.name, keyword.annotation, field(default=keyword.default)) for keyword in keywords]


# The fields follow the torch in use (as the published optimizer's do), and `dataclasses.asdict` of an instance is
# splatted into `torch.compile` for the per-group step body.
ShampooPT2CompileConfig = make_dataclass(
    "ShampooPT2CompileConfig",
    _torch_compile_keywords(),
    kw_only=True,
    namespace={
        "__module__": __name__,
        "__doc__": "Keyword arguments of `torch.compile`, with its defaults, for the compiled part of each step.",
    },
)


@dataclass(kw_only=True)
class ConcurrencyConfig:
    """`enable_cuda_stream_for_param_groups`: run each param group's step on its own CUDA stream, so that the
    collectives of one group can overlap the computation of another. Used only when every group's first
    parameter is on a CUDA device; results are unchanged."""

    enable_cuda_stream_for_param_groups: bool = True


DefaultConcurrencyConfig = ConcurrencyConfig()


# Concurrent amortized computations start only while their estimated temporaries total at most the largest
# one's plus this fraction of the preconditioner list's state: by default a root step's peak memory stays within
# 1.1× the state plus one computation.
DEFAULT_CONCURRENT_MEMORY_FRACTION = 0.1


@dataclass(kw_only=True)
class ShampooRuntimeConfig:
    """Settings that change how a step runs, never what it computes.

    `eager_nan_check=True` asserts every present gradient is finite (one host sync per gradient).
    `num_amortized_computation_streams > 1` spreads the root/eigendecomposition recomputations of a step over
    that many CUDA streams, each driven by its own host thread (no effect on CPU): the factors are decomposed
    one by one and concurrently, with results bitwise equal to decomposing them one after another (a package
    extension; the published optimizer has no such field). `CoupledHigherOrderConfig(disable_tf32=True)` stays
    sequential: it flips a process-wide flag.
    `concurrent_memory_fraction` (a package extension too) bounds the concurrent computations' temporaries: they
    start only while their estimated total stays within the largest one's plus this fraction of the
    preconditioner state, so that a root step's peak stays near 1 + fraction times the state plus one
    decomposition; `math.inf` removes the bound (faster root steps, more memory: see the package README).
    `batch_same_shape_blocks=True` (a package extension) keeps the square factors and inverse roots of
    same-shape matrix blocks of `RootInvShampooPreconditionerConfig(use_symmetric_packing=False)` in shared
    stacks and updates and applies them with batched matmuls (a few blocks at a time, within 2% of the state),
    instead of one matmul per block: fewer, larger kernels. Bitwise equal to the per-block path on the CPU
    (tested); on an H100 cuBLAS's batched matmuls round differently from its single ones (`gpu_tests/`), so results
    differ from the published optimizer's at rounding level. Packed storage and the other variants raise a
    ValueError.
    `defer_amortized_computation=True` (a package extension) CHANGES THE MATH, hence off: a root step computes
    its roots from that step's factors after the step, on a host thread and CUDA stream of its own, while the
    caller goes on (with the next forward and backward), and the roots are first used at the next step, whose
    `step()` waits for them; the step itself still uses the previous roots. So every root is one step older than
    in the published optimizer, and nothing else changes (the factors and roots stay bitwise the same). Results
    equal computing the same roots at the end of the step without overlap. RootInv and RootInvKL configs only:
    eigenvalue-corrected Shampoo would update its eigenvalues in the old basis and then use them in the new one, so
    the other variants raise a ValueError, as do configs that flip a process-wide flag
    (`CoupledHigherOrderConfig(disable_tf32=True)`).
    """

    eager_nan_check: bool = False
    num_amortized_computation_streams: int = 1
    concurrent_memory_fraction: float = DEFAULT_CONCURRENT_MEMORY_FRACTION
    batch_same_shape_blocks: bool = False
    defer_amortized_computation: bool = False

    def __post_init__(self) -> None:
        if self.num_amortized_computation_streams < 1:
            raise ValueError(
                f"Invalid num_amortized_computation_streams value: {self.num_amortized_computation_streams}. "
                "Must be >= 1 (1 computes the roots one after another on the current stream)."
            )
        if not self.concurrent_memory_fraction >= 0.0:  # NaN fails too
            raise ValueError(
                f"Invalid concurrent_memory_fraction value: {self.concurrent_memory_fraction}. "
                "Must be >= 0 (a fraction of the preconditioner state; math.inf for no bound)."
            )


DefaultShampooRuntimeConfig = ShampooRuntimeConfig()
