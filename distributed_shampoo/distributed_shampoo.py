"""`DistributedShampoo`: Shampoo with grafting, momentum, weight decay and block distribution.

Per param group and step: block the gradients; update the Shampoo factor matrices and the grafting statistics
from the raw gradient; every `precondition_frequency` steps recompute the inverse roots; form the bias-corrected
first moment M̄; precondition it with Shampoo and rescale each block to the Frobenius norm of the grafting
direction (before `start_preconditioning_step`, use the grafting direction alone); add weight decay; optionally
apply classic momentum or iterate averaging; apply `W ← W - lr·P` through the distributor (which may all-gather
across ranks). README.md describes each step and the published optimizer's semantics followed here.

Nothing in `step()` reads device values on the host except the amortized computations (NaN/Inf checks and
`eigh`), which happen once every `precondition_frequency` steps, and the opt-in `eager_nan_check`.
"""

import dataclasses
import logging
import math
import types
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from distributed_shampoo.distributor.shampoo_block_info import BlockInfo, allocate_zeros_like_blocks
from distributed_shampoo.distributor.shampoo_ddp_distributor import DDPDistributor
from distributed_shampoo.distributor.shampoo_distributor import Distributor, DistributorInterface
from distributed_shampoo.preconditioner.adagrad_preconditioner_list import AdagradPreconditionerList
from distributed_shampoo.preconditioner.matrix_functions_types import (
    EigendecompositionConfig,
    PseudoInverseConfig,
)
from distributed_shampoo.preconditioner.preconditioner_list import PreconditionerList, bias_correction
from distributed_shampoo.preconditioner.sgd_preconditioner_list import SGDPreconditionerList
from distributed_shampoo.preconditioner.shampoo_preconditioner_list import (
    EigendecomposedKLShampooPreconditionerList,
    EigendecomposedShampooPreconditionerList,
    EigenvalueCorrectedShampooPreconditionerList,
    RootInvKLShampooPreconditionerList,
    RootInvShampooPreconditionerList,
)
from distributed_shampoo.preconditioner.sign_descent_preconditioner_list import SignDescentPreconditionerList
from distributed_shampoo.preconditioner.spectral_descent_preconditioner_list import SpectralDescentPreconditionerList
from distributed_shampoo.shampoo_types import (
    BETA3,
    BETAS,
    DISTRIBUTED_CONFIG,
    EPSILON,
    FILTERED_GRAD,
    GRAFTING_CONFIG,
    ITERATE_AVERAGING_CONFIG,
    LR,
    LR_SUM,
    MAX_PRECONDITIONER_DIM,
    MOMENTUM_BUFFER,
    PARAMS,
    PEAK_LR,
    PRECONDITION_FREQUENCY,
    PRECONDITIONER_CONFIG,
    START_PRECONDITIONING_STEP,
    STEP,
    TRAIN_MODE,
    USE_BIAS_CORRECTION,
    USE_PIN_MEMORY,
    WEIGHT_BUFFER,
    WEIGHT_DECAY,
    WEIGHT_DECAY_TYPE,
    AdaGradPreconditionerConfig,
    AdamPreconditionerConfig,
    BaseShampooPreconditionerConfig,
    ClassicMomentumConfig,
    ConcurrencyConfig,
    DDPDistributedConfig,
    DefaultConcurrencyConfig,
    DefaultShampooConfig,
    DefaultShampooRuntimeConfig,
    DefaultSingleDeviceDistributedConfig,
    DistributedConfig,
    EigendecomposedKLShampooPreconditionerConfig,
    EigendecomposedShampooPreconditionerConfig,
    EigenvalueCorrectedShampooPreconditionerConfig,
    FSDPDistributedConfig,
    FullyShardDistributedConfig,
    GeneralizedPrimalAveragingConfig,
    HSDPDistributedConfig,
    HybridShardDistributedConfig,
    IterateAveragingConfig,
    PreconditionerConfig,
    RMSpropPreconditionerConfig,
    RootInvKLShampooPreconditionerConfig,
    RootInvShampooPreconditionerConfig,
    ScheduleFreeConfig,
    SGDPreconditionerConfig,
    ShampooPT2CompileConfig,
    ShampooRuntimeConfig,
    SignDescentPreconditionerConfig,
    SingleDeviceDistributedConfig,
    SpectralDescentPreconditionerConfig,
    WeightDecayType,
)
from distributed_shampoo.utils.optimizer_modules import OptimizerModule
from distributed_shampoo.utils.shampoo_state_dict_utils import (
    extract_state_dict_content,
    update_param_state_dict_object,
)
from distributed_shampoo.utils.shampoo_utils import compress_list

logger: logging.Logger = logging.getLogger(__name__)

# Guards the grafting rescale against an all-zero Shampoo direction.
_GRAFTING_NORM_GUARD = 1e-16

# The search directions of a step are formed and applied a part of the blocks at a time, each part holding at most
# this fraction of the group's local state in gradient bytes (at least `_MIN_DIRECTION_PART_BYTES`, at least one
# block): forming a part's direction takes about four temporaries of its size (the first moment, the Shampoo
# direction, the grafting denominator and direction), so they stay within 0.08 × the state instead of four times
# every parameter.
_DIRECTION_PART_STATE_FRACTION = 0.02
_MIN_DIRECTION_PART_BYTES = 16 * 2**20

_SUPPORTED_ITERATE_AVERAGING = (ClassicMomentumConfig, GeneralizedPrimalAveragingConfig, ScheduleFreeConfig)


# --------------------------------------------------------------------------------------------------- validation


def _invalid(key: str, value: Any, constraint: str) -> ValueError:
    return ValueError(f"Invalid param_group[{key}]={value}. Must be {constraint}.")


def _uses_pseudo_inverse(preconditioner_config: PreconditionerConfig) -> bool:
    if not isinstance(preconditioner_config, BaseShampooPreconditionerConfig):
        return False
    amortized = preconditioner_config.amortized_computation_config
    return isinstance(amortized, EigendecompositionConfig) and isinstance(
        amortized.rank_deficient_stability_config, PseudoInverseConfig
    )


def _validate_and_resolve_param_group(group: dict[str, Any]) -> None:
    """Check a param group's hyperparameters in the published optimizer's order (its error messages too) and
    resolve beta3 and the start step."""
    if not group[LR] >= 0.0:
        raise _invalid("LR", group[LR], ">= 0.0")
    betas = group[BETAS]
    if not 0.0 <= betas[0] < 1.0:
        raise _invalid("BETAS][0", betas[0], "in [0.0, 1.0)")
    if not 0.0 <= betas[1] <= 1.0:
        raise _invalid("BETAS][1", betas[1], "in [0.0, 1.0]")
    if group[BETA3] == -1.0:
        group[BETA3] = betas[0]
    elif not 0.0 <= group[BETA3] < 1.0:
        raise _invalid("BETA3", group[BETA3], "in [0.0, 1.0)")
    preconditioner_config = group[PRECONDITIONER_CONFIG]
    if _uses_pseudo_inverse(preconditioner_config):
        if group[EPSILON] != 0.0:
            raise _invalid("EPSILON", group[EPSILON], "0.0 when using PseudoInverseConfig")
    elif not group[EPSILON] > 0.0:
        raise _invalid("EPSILON", group[EPSILON], "> 0.0")
    if not group[WEIGHT_DECAY] >= 0.0:
        raise _invalid("WEIGHT_DECAY", group[WEIGHT_DECAY], ">= 0.0")
    if group[WEIGHT_DECAY_TYPE] in (WeightDecayType.CORRECTED, WeightDecayType.INDEPENDENT) and not group[PEAK_LR] > 0.0:
        raise _invalid("PEAK_LR", group[PEAK_LR], "> 0.0 with WeightDecayType.CORRECTED or WeightDecayType.INDEPENDENT")
    max_dim = group[MAX_PRECONDITIONER_DIM]
    if isinstance(max_dim, float) and max_dim != math.inf:
        raise _invalid("MAX_PRECONDITIONER_DIM", max_dim, "an integer or math.inf")
    if not max_dim >= 1:
        raise _invalid("MAX_PRECONDITIONER_DIM", max_dim, ">= 1")
    if not group[PRECONDITION_FREQUENCY] >= 1:
        raise _invalid("PRECONDITION_FREQUENCY", group[PRECONDITION_FREQUENCY], ">= 1")
    if not group[START_PRECONDITIONING_STEP] >= -1:
        raise _invalid("START_PRECONDITIONING_STEP", group[START_PRECONDITIONING_STEP], ">= -1")
    averaging = group[ITERATE_AVERAGING_CONFIG]
    if averaging is not None and not isinstance(averaging, _SUPPORTED_ITERATE_AVERAGING):
        raise NotImplementedError(
            f"{type(averaging).__name__} is not supported: use ClassicMomentumConfig, GeneralizedPrimalAveragingConfig "
            "or ScheduleFreeConfig (or None)."
        )

    if isinstance(preconditioner_config, (SignDescentPreconditionerConfig, SpectralDescentPreconditionerConfig)):
        name = type(preconditioner_config).__name__
        logger.warning(f"{BETAS}[1]={betas[1]} does not have any effect when {name} is used.")
        logger.warning(f"{EPSILON}={group[EPSILON]} does not have any effect when {name} is used.")
        logger.warning(
            f"{PRECONDITION_FREQUENCY}={group[PRECONDITION_FREQUENCY]} does not have any effect when {name} is "
            "used. Setting precondition_frequency to 1..."
        )
        group[PRECONDITION_FREQUENCY] = 1
    if isinstance(preconditioner_config, SpectralDescentPreconditionerConfig):
        distributed_config = group[DISTRIBUTED_CONFIG]
        if distributed_config.target_parameter_dimensionality != 2:
            logger.warning(
                f"{distributed_config.target_parameter_dimensionality=} is not 2 while spectral descent needs "
                "2-D blocks. Setting target_parameter_dimensionality to 2 for this group..."
            )
            # A modified copy: the caller's object may be the shared default, used by other optimizers too.
            group[DISTRIBUTED_CONFIG] = dataclasses.replace(distributed_config, target_parameter_dimensionality=2)

    if group[START_PRECONDITIONING_STEP] == -1:
        group[START_PRECONDITIONING_STEP] = group[PRECONDITION_FREQUENCY]
        logger.warning(
            "start_preconditioning_step set to -1. Setting start_preconditioning_step equal to "
            f"precondition frequency {group[PRECONDITION_FREQUENCY]} by default."
        )
    if group[START_PRECONDITIONING_STEP] < group[PRECONDITION_FREQUENCY]:
        raise ValueError(
            f"Invalid start_preconditioning_step value: {group[START_PRECONDITIONING_STEP]}. Must be >= "
            f"precondition_frequency={group[PRECONDITION_FREQUENCY]}."
        )


def _contains_function(value: Any) -> bool:
    """True for a Python function, or a dataclass (recursively) holding one."""
    if isinstance(value, (types.FunctionType, types.LambdaType)):
        return True
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return any(_contains_function(getattr(value, f.name)) for f in dataclasses.fields(value))
    return False


# -------------------------------------------------------------------------------------------- component factory


_SHAMPOO_LIST_CLASSES: tuple[tuple[type, type], ...] = (
    # Subclasses first: the first isinstance match wins.
    (RootInvKLShampooPreconditionerConfig, RootInvKLShampooPreconditionerList),
    (EigendecomposedKLShampooPreconditionerConfig, EigendecomposedKLShampooPreconditionerList),
    (RootInvShampooPreconditionerConfig, RootInvShampooPreconditionerList),
    (EigendecomposedShampooPreconditionerConfig, EigendecomposedShampooPreconditionerList),
    (EigenvalueCorrectedShampooPreconditionerConfig, EigenvalueCorrectedShampooPreconditionerList),
)


def _make_preconditioner_list(
    config: PreconditionerConfig,
    group: dict[str, Any],
    distributor: DistributorInterface,
    state: dict[Tensor, Any],
    runtime_config: ShampooRuntimeConfig = DefaultShampooRuntimeConfig,
) -> PreconditionerList:
    """The preconditioner list a config names, over the distributor's local blocks (also used for grafting)."""
    blocks = distributor.local_blocked_params
    block_infos = distributor.local_block_info_list
    if isinstance(config, SGDPreconditionerConfig):
        return SGDPreconditionerList(blocks)
    if isinstance(config, AdaGradPreconditionerConfig):
        if isinstance(config, RMSpropPreconditionerConfig):
            weighting_factor = 1.0 if config.drop_weighting_factor_on_gsquare else 1.0 - config.beta2
            use_bias_correction = isinstance(config, AdamPreconditionerConfig) and not config.drop_weighting_factor_on_gsquare
            beta2 = config.beta2
        else:
            beta2, weighting_factor, use_bias_correction = 1.0, 1.0, False
        return AdagradPreconditionerList(
            blocks, state, block_infos, beta2, weighting_factor, config.epsilon, use_bias_correction
        )
    if isinstance(config, SignDescentPreconditionerConfig):
        return SignDescentPreconditionerList(blocks, config)
    if isinstance(config, SpectralDescentPreconditionerConfig):
        assert group[DISTRIBUTED_CONFIG].target_parameter_dimensionality == 2
        return SpectralDescentPreconditionerList(blocks, config)
    for config_class, list_class in _SHAMPOO_LIST_CLASSES:
        if isinstance(config, config_class):
            assert isinstance(config, BaseShampooPreconditionerConfig)
            beta2 = group[BETAS][1]
            drop = config.drop_weighting_factor_on_gsquare
            return list_class(
                blocks,
                state,
                block_infos,
                config,
                beta2=beta2,
                # Dropping the weight (1 - beta2) on G·Gᵀ also drops the bias correction 1 - beta2^t, which
                # assumes that weight.
                weighting_factor=1.0 if (drop or beta2 == 1.0) else 1.0 - beta2,
                epsilon=group[EPSILON],
                use_bias_correction=group[USE_BIAS_CORRECTION] and not drop,
                num_amortized_computation_streams=runtime_config.num_amortized_computation_streams,
                concurrent_memory_fraction=runtime_config.concurrent_memory_fraction,
                batch_same_shape_blocks=runtime_config.batch_same_shape_blocks,
                defer_amortized_computation=runtime_config.defer_amortized_computation,
            )
    raise NotImplementedError(f"{config=} not supported!")


# ----------------------------------------------------------------------------------------------- group runtime


@dataclass
class _GroupRuntime:
    """Per-group objects and per-block lists that live outside the checkpointed state.

    `masked_*` lists hold the blocks that received a gradient this step (see `DistributorInterface`).
    `averaging_buffers` are the blocks' z (GPA/Schedule-Free `weight_buffer`) or classic `momentum_buffer`.
    `eval_interp_coeff`/`train_interp_coeff` are GPA/Schedule-Free's μx and μy as float32 0-d tensors on the
    parameters' device, as in the published optimizer (Schedule-Free recomputes μx every step); `lr` is the
    group's learning rate in such a tensor, set every step, from which those groups compute z's weight decay factor
    and Schedule-Free's μx in float32 as the published optimizer does.
    """

    distributor: DistributorInterface
    shampoo: PreconditionerList
    grafting: PreconditionerList | None
    step: Tensor
    filtered_grads: tuple[Tensor, ...]
    averaging_buffers: tuple[Tensor, ...]
    lr_sum: Tensor | None
    train_mode: Tensor | None
    eval_interp_coeff: Tensor | None
    train_interp_coeff: Tensor | None
    lr: Tensor | None
    previous_grad_selector: tuple[bool, ...]
    direction_part_bytes: float = math.inf
    masked_filtered_grads: tuple[Tensor, ...] = field(default=())
    masked_averaging_buffers: tuple[Tensor, ...] = field(default=())

    def apply_selector(self, selector: tuple[bool, ...]) -> None:
        self.previous_grad_selector = selector
        self.shampoo.compress_preconditioner_list(selector)
        if self.grafting is not None:
            self.grafting.compress_preconditioner_list(selector)
        self.masked_filtered_grads = compress_list(self.filtered_grads, selector) if self.filtered_grads else ()
        self.masked_averaging_buffers = compress_list(self.averaging_buffers, selector) if self.averaging_buffers else ()

    def shared_scalars(self) -> dict[str, Tensor]:
        """The per-group tensors stored (aliased) under every parameter of the group, by state key."""
        scalars = {STEP: self.step}
        if self.train_mode is not None and self.lr_sum is not None:
            scalars[TRAIN_MODE] = self.train_mode
            scalars[LR_SUM] = self.lr_sum
        return scalars


# ------------------------------------------------------------------------------------------------- optimizer


class DistributedShampoo(torch.optim.Optimizer):
    """Shampoo (Gupta, Koren & Singer 2018) as in Distributed Shampoo (Shi et al. 2023); see the package README.

    Args (defaults in the signature; every one except the last three can be overridden per param group):
        params: parameters or param-group dicts.
        lr: learning rate (also stored as the group's `peak_lr` unless the group sets one).
        betas: (beta1 for the first moment, beta2 for the factor-matrix EMA; 1.0 means a running sum).
        beta3: EMA coefficient of the preconditioned first moment (-1: equal to beta1).
        epsilon: damping added to the factor matrices before taking roots.
        weight_decay, weight_decay_type: L2 (added to the gradient) or DECOUPLED/CORRECTED/INDEPENDENT.
        max_preconditioner_dim: block size; dims are merged up to and split at this size.
        precondition_frequency: steps between root recomputations.
        start_preconditioning_step: first step using Shampoo (-1: precondition_frequency); grafting before.
        use_bias_correction: bias-correct the first moment and the factor matrices.
        iterate_averaging_config: ClassicMomentumConfig, GeneralizedPrimalAveragingConfig or ScheduleFreeConfig.
        grafting_config: per-block norm source (SGD/AdaGrad/RMSprop/Adam preconditioner config) or None.
        use_pin_memory: accepted for compatibility (lr is passed as a Python number here).
        shampoo_pt2_compile_config: compile the elementwise part of the step with torch.compile.
        distributed_config: SingleDeviceDistributedConfig or DDPDistributedConfig.
        preconditioner_config: Shampoo variant (or SGD/AdaGrad-family/sign/spectral descent).
        shampoo_runtime_config: ShampooRuntimeConfig(eager_nan_check=..., num_amortized_computation_streams=...).
        concurrency_config: ConcurrencyConfig(enable_cuda_stream_for_param_groups=...): one CUDA stream per group.
    """

    def __init__(
        self,
        params: Iterable[Tensor] | Iterable[dict[str, Any]],
        lr: float = 1e-2,
        betas: tuple[float, float] = (0.9, 1.0),
        beta3: float = -1.0,
        epsilon: float = 1e-12,
        weight_decay: float = 0.0,
        weight_decay_type: WeightDecayType = WeightDecayType.DECOUPLED,
        max_preconditioner_dim: int | float = 1024,
        precondition_frequency: int = 1,
        start_preconditioning_step: int | float = -1,
        use_bias_correction: bool = True,
        iterate_averaging_config: IterateAveragingConfig | None = None,
        grafting_config: PreconditionerConfig | None = None,
        use_pin_memory: bool = False,
        shampoo_pt2_compile_config: ShampooPT2CompileConfig | None = None,
        distributed_config: DistributedConfig = DefaultSingleDeviceDistributedConfig,
        preconditioner_config: PreconditionerConfig = DefaultShampooConfig,
        shampoo_runtime_config: ShampooRuntimeConfig = DefaultShampooRuntimeConfig,
        concurrency_config: ConcurrencyConfig = DefaultConcurrencyConfig,
    ) -> None:
        defaults = {
            LR: lr,
            PEAK_LR: lr,
            BETAS: betas,
            BETA3: beta3,
            EPSILON: epsilon,
            WEIGHT_DECAY: weight_decay,
            WEIGHT_DECAY_TYPE: weight_decay_type,
            MAX_PRECONDITIONER_DIM: max_preconditioner_dim,
            PRECONDITION_FREQUENCY: precondition_frequency,
            START_PRECONDITIONING_STEP: start_preconditioning_step,
            USE_BIAS_CORRECTION: use_bias_correction,
            ITERATE_AVERAGING_CONFIG: iterate_averaging_config,
            GRAFTING_CONFIG: grafting_config,
            USE_PIN_MEMORY: use_pin_memory,
            DISTRIBUTED_CONFIG: distributed_config,
            PRECONDITIONER_CONFIG: preconditioner_config,
        }
        super().__init__(params, defaults)
        self._shampoo_pt2_compile_config = shampoo_pt2_compile_config
        self._runtime_config = shampoo_runtime_config
        self._mode_before_load: bool | None = None  # train/eval mode to restore after load_state_dict

        self.register_state_dict_pre_hook(DistributedShampoo._pre_state_dict_hook)
        self.register_state_dict_post_hook(DistributedShampoo._post_state_dict_hook)
        self.register_load_state_dict_pre_hook(DistributedShampoo._pre_load_state_dict_hook)
        self.register_load_state_dict_post_hook(DistributedShampoo._post_load_state_dict_hook)

        for index, group in enumerate(self.param_groups):
            logger.info(f"Checking param_group {index}")
            _validate_and_resolve_param_group(group)
        self._group_runtimes: list[_GroupRuntime] = [self._build_group_runtime(group) for group in self.param_groups]
        self._group_streams = self._make_group_streams(concurrency_config)
        self._compiled_direction: Callable[..., tuple[Tensor, ...]] | None = None
        if shampoo_pt2_compile_config is not None:
            self._compiled_direction = torch.compile(_direction, **dataclasses.asdict(shampoo_pt2_compile_config))

    # ---- construction

    def _select_distributor_class(self, distributed_config: DistributedConfig) -> type[DistributorInterface]:
        """The distributor for a group's config; a subclass may override this to plug in its own."""
        sharded = (HSDPDistributedConfig, HybridShardDistributedConfig, FSDPDistributedConfig, FullyShardDistributedConfig)
        if isinstance(distributed_config, sharded):
            raise NotImplementedError(
                f"{type(distributed_config).__name__} is not supported by this distributed_shampoo. Keep parameters "
                "replicated and use DDPDistributedConfig (or SingleDeviceDistributedConfig for one process)."
            )
        if isinstance(distributed_config, SingleDeviceDistributedConfig):
            return Distributor
        if isinstance(distributed_config, DDPDistributedConfig):
            return DDPDistributor
        raise NotImplementedError(f"{distributed_config=} not supported!")

    def _build_group_runtime(self, group: dict[str, Any]) -> _GroupRuntime:
        params: list[Tensor] = group[PARAMS]
        if not params:
            raise ValueError("A param group has no parameters; remove the empty group.")
        distributor = self._select_distributor_class(group[DISTRIBUTED_CONFIG])(group, self._runtime_config)
        for block_info in distributor.local_block_info_list:
            self.state[block_info.param][block_info.composable_block_ids[1]] = {}
        shampoo = _make_preconditioner_list(
            group[PRECONDITIONER_CONFIG], group, distributor, self.state, self._runtime_config
        )
        grafting = (
            None
            if group[GRAFTING_CONFIG] is None
            else _make_preconditioner_list(group[GRAFTING_CONFIG], group, distributor, self.state, self._runtime_config)
        )

        blocks, block_infos = distributor.local_blocked_params, distributor.local_block_info_list
        filtered_grads: tuple[Tensor, ...] = ()
        if group[BETAS][0] != 0.0:
            filtered_grads = allocate_zeros_like_blocks(FILTERED_GRAD, blocks, block_infos, self.state)
        averaging = group[ITERATE_AVERAGING_CONFIG]
        averaging_buffers: tuple[Tensor, ...] = ()
        lr_sum = train_mode = eval_interp_coeff = train_interp_coeff = lr = None
        device = params[0].device
        if isinstance(averaging, ClassicMomentumConfig):
            averaging_buffers = allocate_zeros_like_blocks(MOMENTUM_BUFFER, blocks, block_infos, self.state)
        elif averaging is not None:
            averaging_buffers = allocate_zeros_like_blocks(WEIGHT_BUFFER, blocks, block_infos, self.state)
            for weight_buffer, block in zip(averaging_buffers, blocks, strict=True):
                weight_buffer.copy_(block)
            lr_sum = torch.zeros((), dtype=torch.float32, device=device)
            train_mode = torch.tensor(True)
            eval_coefficient = averaging.eval_interp_coeff if isinstance(averaging, GeneralizedPrimalAveragingConfig) else 0.0
            eval_interp_coeff = torch.tensor(eval_coefficient, dtype=torch.float32, device=device)
            train_interp_coeff = torch.tensor(averaging.train_interp_coeff, dtype=torch.float32, device=device)
            lr = torch.zeros((), dtype=torch.float32, device=device)

        runtime = _GroupRuntime(
            distributor=distributor,
            shampoo=shampoo,
            grafting=grafting,
            step=torch.tensor(0, dtype=torch.int64),
            filtered_grads=filtered_grads,
            averaging_buffers=averaging_buffers,
            lr_sum=lr_sum,
            train_mode=train_mode,
            eval_interp_coeff=eval_interp_coeff,
            train_interp_coeff=train_interp_coeff,
            lr=lr,
            previous_grad_selector=distributor.local_grad_selector,
            direction_part_bytes=max(
                _DIRECTION_PART_STATE_FRACTION * _local_state_bytes(self.state, block_infos), _MIN_DIRECTION_PART_BYTES
            ),
        )
        # One tensor per scalar, stored under every parameter (after its blocks), even one without local blocks.
        for param in params:
            self.state[param].update(runtime.shared_scalars())
        runtime.apply_selector(distributor.local_grad_selector)
        return runtime

    def _make_group_streams(self, concurrency_config: ConcurrencyConfig) -> list["torch.cuda.Stream"] | None:
        """One new CUDA stream per param group, when enabled and every group's first parameter is on CUDA."""
        first_params = [group[PARAMS][0] for group in self.param_groups]
        if not concurrency_config.enable_cuda_stream_for_param_groups or not all(p.is_cuda for p in first_params):
            return None
        streams = [torch.cuda.Stream(param.device) for param in first_params]
        for index, stream in enumerate(streams):
            logger.info(f"Param group {index} runs its step on CUDA stream {stream.stream_id} of {stream.device}.")
        return streams

    # ---- step

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:  # type: ignore[override]
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        if len(self.param_groups) != len(self._group_runtimes):
            raise ValueError(
                "DistributedShampoo does not support add_param_group: pass every param group to the constructor."
            )
        if self._group_streams is None:
            for group, runtime in zip(self.param_groups, self._group_runtimes, strict=True):
                self._step_group(group, runtime)
            return loss
        # Each group's whole step (collectives included) is queued on its own stream, after the work already on
        # the current stream; the current streams then wait for every group, without a host synchronisation.
        for group, runtime, stream in zip(self.param_groups, self._group_runtimes, self._group_streams, strict=True):
            stream.wait_stream(torch.cuda.current_stream(stream.device))
            with torch.cuda.stream(stream):
                self._step_group(group, runtime)
        for device in {stream.device for stream in self._group_streams}:
            current = torch.cuda.current_stream(device)
            for stream in self._group_streams:
                current.wait_stream(stream)
        return loss

    def _step_group(self, group: dict[str, Any], runtime: _GroupRuntime) -> None:
        runtime.shampoo.finish_amortized_computation()  # the previous step's deferred roots, if any
        distributor = runtime.distributor
        masked_grads = distributor.merge_and_block_gradients()
        if distributor.local_grad_selector != runtime.previous_grad_selector:
            if self._compiled_direction is not None and int(runtime.step) > 0:
                changed = [
                    i
                    for i, (old, new) in enumerate(zip(runtime.previous_grad_selector, distributor.local_grad_selector))
                    if old != new
                ]
                logger.warning(
                    f"PT2 will recompile because the gradient selection of model parameters have changed from the "
                    f"previous step. Changed selector indices: {changed}"
                )
            runtime.apply_selector(distributor.local_grad_selector)
        if runtime.train_mode is not None and not bool(runtime.train_mode):
            raise RuntimeError("The optimizer is in eval mode: call optimizer.train() before optimizer.step().")

        runtime.step.add_(1)
        step = int(runtime.step)
        frequency, start = group[PRECONDITION_FREQUENCY], group[START_PRECONDITIONING_STEP]
        perform_amortized_computation = (step % frequency == 0 and step > start) or step == start
        use_grafting_method = step < start and runtime.grafting is not None

        if not masked_grads:
            distributor.update_params(())
            return
        masked_params = distributor.local_masked_blocked_params
        weight_decay, weight_decay_type = group[WEIGHT_DECAY], group[WEIGHT_DECAY_TYPE]
        if weight_decay != 0.0 and weight_decay_type == WeightDecayType.L2:
            torch._foreach_add_(masked_grads, masked_params, alpha=weight_decay)

        defer = perform_amortized_computation and runtime.shampoo.defers_amortized_computation
        runtime.shampoo.update_preconditioners(masked_grads, step, perform_amortized_computation and not defer)
        if runtime.grafting is not None:
            runtime.grafting.update_preconditioners(masked_grads, step, False)

        if runtime.lr is not None:
            runtime.lr.fill_(group[LR])
        if isinstance(group[ITERATE_AVERAGING_CONFIG], ScheduleFreeConfig):
            _update_schedule_free_coefficient(group, runtime)
        parts = self._direction_parts(runtime, masked_grads, masked_params)
        if len(parts) == 1 or not distributor.applies_updates_in_parts:
            distributor.update_params(
                self._search_directions(group, runtime, step, use_grafting_method, masked_grads, masked_params, 0)
            )
        else:
            for first, end in parts:
                search_directions = self._search_directions(
                    group, runtime, step, use_grafting_method, masked_grads[first:end], masked_params[first:end], first
                )
                distributor.update_local_params(search_directions, first)
                del search_directions  # before the next part allocates its own
            distributor.finish_param_updates()
        if defer:  # this step's roots, from this step's factors, for the next step
            runtime.shampoo.start_amortized_computation()

    def _direction_parts(
        self, runtime: _GroupRuntime, masked_grads: tuple[Tensor, ...], masked_params: tuple[Tensor, ...]
    ) -> list[tuple[int, int]]:
        """(first, end) ranges of consecutive masked blocks whose directions are formed together: about
        `runtime.direction_part_bytes` of gradients each, or everything at once where parts could change results.

        CUDA foreach kernels use their fast path only when every tensor of the lists is dense, of one dtype and on
        one device, and otherwise fall back to per-tensor operations that round some operations differently (a
        division by a scalar becomes a multiplication by its reciprocal). Any part of lists that qualify qualifies
        too, and the fast kernels compute every element (and each tensor's norm) the same way whatever the other
        tensors of the list, so parts change nothing; lists that do not qualify are kept whole. The compiled
        direction is traced for whole lists.
        """
        whole = [(0, len(masked_grads))]
        if self._compiled_direction is not None or not runtime.distributor.applies_updates_in_parts:
            return whole
        tensors = (*masked_grads, *masked_params)
        if len({(t.dtype, t.device) for t in tensors}) > 1 or not all(t.is_contiguous() for t in tensors):
            return whole
        parts, first, part_bytes = [], 0, 0
        for index, grad in enumerate(masked_grads):
            grad_bytes = grad.numel() * grad.element_size()
            if index > first and part_bytes + grad_bytes > runtime.direction_part_bytes:
                parts.append((first, index))
                first, part_bytes = index, 0
            part_bytes += grad_bytes
        parts.append((first, len(masked_grads)))
        return parts

    def _search_directions(
        self,
        group: dict[str, Any],
        runtime: _GroupRuntime,
        step: int,
        use_grafting_method: bool,
        grads: tuple[Tensor, ...],
        params: tuple[Tensor, ...],
        first_block: int,
    ) -> tuple[Tensor, ...]:
        """The step −lr·(P + weight decay), after momentum or iterate averaging, of the consecutive masked blocks
        `first_block`, … (`grads` and `params` are theirs)."""
        end = first_block + len(grads)
        direction_fn = self._compiled_direction or _direction
        directions = direction_fn(
            grads,
            runtime.masked_filtered_grads[first_block:end],
            runtime.shampoo,
            runtime.grafting,
            use_grafting_method,
            step,
            group[BETAS][0],
            group[BETA3],
            group[USE_BIAS_CORRECTION],
            first_block,
        )
        averaging = group[ITERATE_AVERAGING_CONFIG]
        averaging_buffers = runtime.masked_averaging_buffers[first_block:end]
        weight_decay_coefficient = _decoupled_weight_decay_coefficient(group)
        if isinstance(averaging, (GeneralizedPrimalAveragingConfig, ScheduleFreeConfig)):
            assert runtime.eval_interp_coeff is not None and runtime.train_interp_coeff is not None
            assert runtime.lr is not None
            return _average_iterates(
                runtime.lr,
                runtime.eval_interp_coeff,
                runtime.train_interp_coeff,
                params,
                averaging_buffers,
                directions,
                weight_decay_coefficient,
            )
        lr = _float32(group[LR])
        # The direction may alias the state (identity preconditioners), so the first write is out of place.
        if weight_decay_coefficient != 0.0:
            directions = tuple(torch._foreach_add(directions, params, alpha=weight_decay_coefficient))
            if isinstance(averaging, ClassicMomentumConfig):
                directions = _classic_momentum(averaging, averaging_buffers, directions)
            torch._foreach_mul_(directions, -lr)
            return directions
        if isinstance(averaging, ClassicMomentumConfig):
            directions = _classic_momentum(averaging, averaging_buffers, directions)
        return tuple(torch._foreach_mul(directions, -lr))

    # ---- iterate-averaging modes

    @torch.no_grad()
    def _interpolate_towards_weight_buffer(self, coefficient_of: Callable[[Tensor], Tensor], train_mode: bool) -> None:
        for runtime in self._group_runtimes:
            # train_mode exists exactly for the GPA/Schedule-Free groups.
            if runtime.train_mode is None or bool(runtime.train_mode) == train_mode:
                continue
            assert runtime.train_interp_coeff is not None
            coefficient = coefficient_of(runtime.train_interp_coeff)
            params = runtime.distributor.local_blocked_params
            directions = torch._foreach_sub(runtime.averaging_buffers, params)
            torch._foreach_mul_(directions, coefficient)
            runtime.distributor.update_params(tuple(directions), use_masked_tensors=False)
            runtime.train_mode.fill_(train_mode)

    def eval(self) -> None:
        """Move the parameters of GPA/Schedule-Free groups from y (where gradients are taken) to the averaged x."""
        self._interpolate_towards_weight_buffer(lambda mu_y: 1.0 - 1.0 / mu_y, train_mode=False)

    def train(self) -> None:
        """Move the parameters of GPA/Schedule-Free groups back from x to y."""
        self._interpolate_towards_weight_buffer(lambda mu_y: 1.0 - mu_y, train_mode=True)

    # ---- checkpointing

    def finish_amortized_computations(self) -> None:
        """Wait for root computations still running after their step (`defer_amortized_computation`) and store their
        results; a no-op otherwise. `step()`, `state_dict()` and `load_state_dict()` call it first."""
        for runtime in self._group_runtimes:
            runtime.shampoo.finish_amortized_computation()

    @staticmethod
    def _pre_state_dict_hook(optimizer: torch.optim.Optimizer) -> None:
        assert isinstance(optimizer, DistributedShampoo)
        optimizer.finish_amortized_computations()

    @staticmethod
    def _post_state_dict_hook(optimizer: torch.optim.Optimizer, state_dict: dict[str, Any]) -> dict[str, Any]:
        state = state_dict["state"]
        for index, param_state in state.items():
            state[index] = extract_state_dict_content(param_state)
        for group in state_dict["param_groups"]:
            for index in group[PARAMS]:
                state.setdefault(index, {})
            for key, value in group.items():
                if _contains_function(value):
                    logger.warning(
                        f"Param group key {key} holds {value}, which contains a function: lambdas cannot be "
                        "pickled, so torch.save of this state dict may fail."
                    )
        return state_dict

    @staticmethod
    def _pre_load_state_dict_hook(optimizer: torch.optim.Optimizer, state_dict: dict[str, Any]) -> None:
        assert isinstance(optimizer, DistributedShampoo)
        optimizer.finish_amortized_computations()  # nothing may write into the state being replaced
        modes = {bool(runtime.train_mode) for runtime in optimizer._group_runtimes if runtime.train_mode is not None}
        assert len(modes) <= 1, "All iterate-averaging param groups must be in the same train/eval mode."
        optimizer._mode_before_load = modes.pop() if modes else None

    @staticmethod
    def _post_load_state_dict_hook(optimizer: torch.optim.Optimizer) -> None:
        assert isinstance(optimizer, DistributedShampoo)
        mode = optimizer._mode_before_load
        if mode is None:
            return
        modes = {bool(runtime.train_mode) for runtime in optimizer._group_runtimes if runtime.train_mode is not None}
        assert len(modes) <= 1, "All iterate-averaging param groups of the checkpoint must share a train/eval mode."
        # The loaded train_mode describes the checkpoint's parameters; flip to the mode the caller was in.
        if mode:
            optimizer.train()
        else:
            optimizer.eval()

    def __setstate__(self, state: dict[str, Any]) -> None:
        incoming = state.pop("state", {})
        self._check_shared_scalars_agree(incoming)
        for param, param_state in incoming.items():
            if param in self.state:
                update_param_state_dict_object(self.state[param], param_state, enable_missing_key_check=False)
            elif param_state:
                logger.warning(f"Loading state for a parameter of shape {tuple(param.shape)} that had no state here.")
                self.state[param] = param_state
        super().__setstate__(state)

    def _check_shared_scalars_agree(self, incoming: dict[Any, Any]) -> None:
        """A per-group scalar is one tensor under every parameter, so a checkpoint must give it one value."""
        for group_index, (group, runtime) in enumerate(zip(self.param_groups, self._group_runtimes, strict=True)):
            for key in runtime.shared_scalars():
                values = [
                    incoming[param][key] for param in group[PARAMS] if key in incoming.get(param, {})
                ]
                if not values:
                    continue
                reference = torch.as_tensor(values[0])
                for value in values[1:]:
                    value = torch.as_tensor(value)
                    if key == LR_SUM:
                        agree = torch.allclose(value.double().cpu(), reference.double().cpu(), rtol=1e-6, atol=0.0, equal_nan=True)
                    else:
                        agree = torch.equal(value.cpu(), reference.cpu())
                    if not agree:
                        raise ValueError(
                            f"Cannot load optimizer state: the per-group scalar '{key}' is aliased across parameters "
                            f"(one tensor for param group {group_index}), but the checkpoint gives it different "
                            f"values ({reference.item()} and {value.item()}). The checkpoint was edited or mixes groups."
                        )


def _local_state_bytes(state: dict[Tensor, Any], block_infos: Iterable[BlockInfo]) -> int:
    """Bytes of the distinct storages of the state of the given blocks."""
    storages: dict[int, int] = {}
    for block_info in block_infos:
        for tensor in _state_tensors(state[block_info.param][block_info.composable_block_ids[1]]):
            storage = tensor.untyped_storage()
            storages[storage.data_ptr()] = storage.nbytes()
    return sum(storages.values())


def _state_tensors(value: Any) -> Iterator[Tensor]:
    if isinstance(value, Tensor):
        yield value
    elif isinstance(value, OptimizerModule):
        yield from _state_tensors(vars(value))
    elif isinstance(value, Mapping):
        for item in value.values():
            yield from _state_tensors(item)
    elif isinstance(value, (tuple, list)):
        for item in value:
            yield from _state_tensors(item)


def _float32(value: float) -> float:
    """`value` rounded to float32, as a Python number."""
    return float(torch.tensor(value, dtype=torch.float32))


def _decoupled_weight_decay_coefficient(group: dict[str, Any]) -> float:
    """Coefficient α of the decoupled weight decay (0 for L2, which acts on the gradient instead).

    CORRECTED scales by the learning rate rounded to float32, the value of the published optimizer's lr tensor.
    """
    weight_decay, weight_decay_type = group[WEIGHT_DECAY], group[WEIGHT_DECAY_TYPE]
    if weight_decay == 0.0 or weight_decay_type == WeightDecayType.L2:
        return 0.0
    if weight_decay_type == WeightDecayType.CORRECTED:
        return weight_decay * _float32(group[LR]) / group[PEAK_LR]
    if weight_decay_type == WeightDecayType.INDEPENDENT:
        return weight_decay / group[PEAK_LR]
    return weight_decay


def _direction(
    grads: tuple[Tensor, ...],
    filtered_grads: tuple[Tensor, ...],
    shampoo: PreconditionerList,
    grafting: PreconditionerList | None,
    use_grafting_method: bool,
    step: int,
    beta1: float,
    beta3: float,
    use_bias_correction: bool,
    first_block: int = 0,
) -> tuple[Tensor, ...]:
    """The preconditioned (and grafted) direction of each block, from the bias-corrected first moment M̄, for the
    consecutive masked blocks `first_block`, … (`grads` and `filtered_grads` are theirs).

    May alias optimizer state (identity preconditioners return their input): callers must not write into it.
    """
    if beta1 != 0.0:
        filtered_bar = torch._foreach_lerp(filtered_grads, grads, 1.0 - beta3) if beta3 != beta1 else None
        torch._foreach_lerp_(filtered_grads, grads, 1.0 - beta1)
        moment: tuple[Tensor, ...] = tuple(filtered_bar) if filtered_bar is not None else filtered_grads
        correction = bias_correction(beta1, step - 1, scale=beta3) if use_bias_correction else 1.0
        if correction != 1.0:  # it rounds to 1.0 after a few hundred steps; dividing then would only copy
            moment = tuple(torch._foreach_div(moment, correction))
    else:
        moment = grads

    if use_grafting_method:
        assert grafting is not None
        return grafting.precondition_blocks(moment, first_block)
    direction = shampoo.precondition_blocks(moment, first_block)
    if grafting is not None:
        graft_norms = torch._foreach_norm(grafting.precondition_blocks(moment, first_block))
        shampoo_norms = torch._foreach_norm(direction)
        torch._foreach_add_(shampoo_norms, _GRAFTING_NORM_GUARD)
        direction = tuple(torch._foreach_mul(direction, torch._foreach_div(graft_norms, shampoo_norms)))
    return direction


def _classic_momentum(
    config: ClassicMomentumConfig, momentum_buffers: tuple[Tensor, ...], directions: tuple[Tensor, ...]
) -> tuple[Tensor, ...]:
    """M ← μ·M + (1 - d)·P; the new direction is M, or (1 - d)·P + μ·M with Nesterov (a new tensor either way)."""
    torch._foreach_mul_(momentum_buffers, config.momentum)
    torch._foreach_add_(momentum_buffers, directions, alpha=1.0 - config.dampening)
    if config.use_nesterov:
        result = torch._foreach_mul(directions, 1.0 - config.dampening)
        torch._foreach_add_(result, momentum_buffers, alpha=config.momentum)
        return tuple(result)
    return tuple(torch._foreach_mul(momentum_buffers, 1.0))


def _update_schedule_free_coefficient(group: dict[str, Any], runtime: _GroupRuntime) -> None:
    """Schedule-Free's μx = 1 - lr^power / Σ lr^power (the sum over every step so far), once per step, in float32
    from the group's lr tensor (as the published optimizer computes it)."""
    config = group[ITERATE_AVERAGING_CONFIG]
    assert runtime.lr_sum is not None and runtime.eval_interp_coeff is not None and runtime.lr is not None
    lr_power = torch.pow(runtime.lr, config.eval_coeff_lr_power)
    runtime.lr_sum.add_(lr_power)
    runtime.eval_interp_coeff.copy_(1.0 - lr_power / runtime.lr_sum)


def _average_iterates(
    lr: Tensor,
    mu_x: Tensor,
    mu_y: Tensor,
    params: tuple[Tensor, ...],
    z: tuple[Tensor, ...],
    directions: tuple[Tensor, ...],
    weight_decay_coefficient: float,
) -> tuple[Tensor, ...]:
    """GPA/Schedule-Free: parameters hold y, the weight buffers z; return y's step.

    Weight decay shrinks z itself (z ← (1 - lr·α)·z, AdamW-style on the base sequence) instead of entering the
    direction; then z ← z - lr·P and y moves by (1 - μx·μy)·(-lr·P) + (1 - μx)·(z_shrunk - y). `lr` is the group's
    float32 0-d lr tensor: the factor 1 - lr·α is computed in float32 from it, as in the published optimizer.
    """
    if weight_decay_coefficient != 0.0:
        torch._foreach_mul_(z, 1 - lr * weight_decay_coefficient)
    step = torch._foreach_mul(directions, -lr)
    z_minus_y = torch._foreach_sub(z, params)
    torch._foreach_add_(z, step)
    torch._foreach_mul_(step, 1.0 - mu_x * mu_y)
    torch._foreach_mul_(z_minus_y, 1.0 - mu_x)
    torch._foreach_add_(step, z_minus_y)
    return tuple(step)
