"""Kronecker-factored Shampoo preconditioners and their variants.

Every block of order `o` keeps one factor matrix per preconditioned dim `k`, the running statistic of the
gradient's outer product contracted over every other dim (`G·Gᵀ` and `Gᵀ·G` for a matrix). Every
`precondition_frequency` steps an "amortized computation" turns the factors into what preconditioning needs:

* RootInv: the inverse roots F_k^(-exponent_k) (the record: exponent 1/4 on both sides of a matrix);
* Eigendecomposed: eigenvalues and eigenvectors, from which the roots are formed at each step;
* EigenvalueCorrected (SOAP with QR): only the eigenvectors; Adam/AdaGrad then runs in that eigenbasis;
* KL variants: as RootInv/Eigendecomposed, but each factor accumulates the gradient already preconditioned
  along the other dims.

With `use_symmetric_packing` (the default) the factor matrices and the stored inverse roots are kept as their
upper triangles (`utils.shampoo_utils.pack_upper_triangular`) and unpacked into square matrices only while one
is used. The amortized computation handles one factor at a time (optionally several concurrently, within a
memory budget), so it never holds more than a few d×d temporaries.

With `batch_same_shape_blocks` (RootInv with square storage), the factors and inverse roots of matrix blocks of one
shape are slices of shared stacks, and each step updates and applies a few of them at a time with one batched
matmul per factor (`torch.bmm`) instead of one matmul per block. The batched path runs the operations of the
per-block one in the same order (outer products by matmul, then β₂·F + w·(G·Gᵀ) elementwise; Gᵀ·L then ·R), so on
the CPU it gives bitwise the same numbers.

A numerical failure (`matrix_functions.NUMERICAL_FAILURES`) keeps the previous result and warns; more than
`num_tolerated_failed_amortized_computations` consecutive failures of one block raise. NaN/Inf in a factor or in
a result raise `PreconditionerValueError`; any other exception propagates.
"""

import copy
import itertools
import logging
import math
import os
import tempfile
import threading
from abc import abstractmethod
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, fields
from fractions import Fraction
from functools import partial
from typing import Any, ClassVar

import torch
from torch import Tensor

from distributed_shampoo.distributor.shampoo_block_info import BlockInfo
from distributed_shampoo.preconditioner.matrix_functions import (
    NUMERICAL_FAILURES,
    changes_global_state,
    load_linalg_library,
    matrix_eigendecomposition,
    matrix_function_temporary_elements,
    matrix_inverse_root,
    matrix_inverse_root_from_eigendecomposition,
)
from distributed_shampoo.preconditioner.preconditioner_list import SecondMomentPreconditionerList, profile_decorator
from distributed_shampoo.shampoo_types import (
    DEFAULT_CONCURRENT_MEMORY_FRACTION,
    BaseShampooPreconditionerConfig,
    ClassicShampooPreconditionerConfig,
    EigendecomposedShampooPreconditionerConfig,
    EigenvalueCorrectedShampooPreconditionerConfig,
    PreconditionerValueError,
    RootInvShampooPreconditionerConfig,
)
from distributed_shampoo.utils.optimizer_modules import OptimizerModule
from distributed_shampoo.utils.shampoo_utils import (
    ContinueOnCaller,
    compress_list,
    get_dtype_size,
    pack_upper_triangular,
    packed_size,
    run_on_side_streams,
    unpack_upper_triangular,
    upper_triangular_indices,
)

logger: logging.Logger = logging.getLogger(__name__)

SHAMPOO = "shampoo"

# Batched blocks are updated and applied a few at a time: the stacked inputs and results of one batched matmul
# stay within this fraction of the list's state (and at most `_MIN_BATCH_BYTES` when that is larger), like the
# step's direction parts.
_BATCH_STATE_FRACTION = 0.02
_MIN_BATCH_BYTES = 16 * 2**20
# Blocks with a smaller side stay per block: every matmul of an 8×8 block has at least 512 multiply-adds, and
# below 400 torch's CPU bmm computes with its own loop, which rounds differently from mm.
_MIN_BATCHED_DIM = 8

# ------------------------------------------------------------------------------------------ checkpointed state


def _symmetric_layout_like(current: Tensor, incoming: Any, name: str) -> Any:
    """`incoming` converted to the layout (packed upper triangle or square) of the state tensor `current`.

    Checkpoints of the published optimizer are packed by default, and ours before packing existed were square;
    both load into either layout.
    """
    if not isinstance(incoming, Tensor) or incoming.shape == current.shape:
        return incoming
    if current.dim() == 1 and incoming.dim() == 2 and incoming.shape[0] == incoming.shape[1]:
        if packed_size(incoming.shape[0]) == current.numel():
            return pack_upper_triangular(incoming.to(current.device))
    if current.dim() == 2 and incoming.dim() == 1 and incoming.numel() == packed_size(current.shape[0]):
        return unpack_upper_triangular(incoming.to(current.device))
    raise ValueError(
        f"Cannot load {name}: the checkpoint holds shape {tuple(incoming.shape)} where this optimizer keeps "
        f"{tuple(current.shape)}; it fits neither the square nor the packed layout of the same factor. Check that "
        "the checkpoint comes from the same model, blocking and max_preconditioner_dim."
    )


@dataclass
class BaseShampooKroneckerFactorsState(OptimizerModule):
    """Checkpointed factor state of one block (`factor_matrix_indices` is bookkeeping, not saved)."""

    factor_matrices: tuple[Tensor, ...]
    factor_matrix_indices: tuple[str, ...]

    # Fields holding symmetric matrices, stored packed or square; loading converts between the two layouts.
    SYMMETRIC_FIELDS: ClassVar[tuple[str, ...]] = ("factor_matrices",)

    def load_state_dict(self, state_dict: Mapping[Any, Any], store_non_tensors: bool = False) -> None:
        converted = dict(state_dict)
        for name in self.SYMMETRIC_FIELDS:
            incoming = converted.get(name)
            if not isinstance(incoming, Mapping):
                continue
            current = getattr(self, name)
            converted[name] = {
                position: _symmetric_layout_like(current[int(position)], value, f"{name}[{position}]")
                if str(position).isdigit() and int(position) < len(current)
                else value
                for position, value in incoming.items()
            }
        super().load_state_dict(converted, store_non_tensors)


@dataclass
class RootInvShampooKroneckerFactorsState(BaseShampooKroneckerFactorsState):
    inv_factor_matrices: tuple[Tensor, ...]

    SYMMETRIC_FIELDS: ClassVar[tuple[str, ...]] = ("factor_matrices", "inv_factor_matrices")


@dataclass
class EigendecomposedShampooKroneckerFactorsState(BaseShampooKroneckerFactorsState):
    factor_matrices_eigenvectors: tuple[Tensor, ...]
    factor_matrices_eigenvalues: tuple[Tensor, ...]


@dataclass
class EigenvalueCorrectedShampooKroneckerFactorsState(BaseShampooKroneckerFactorsState):
    factor_matrices_eigenvectors: tuple[Tensor, ...]
    corrected_eigenvalues: Tensor


# ------------------------------------------------------------------------------------ runtime view of a block


@dataclass
class ShampooKroneckerFactorsUnwrapped:
    """Local tensors of one block plus what the computations need.

    `preconditioned_dims_selector[d]` says whether block dim `d` has a factor matrix; `factor_dims[j]` is the
    size d of the j-th factor (stored as d×d, or packed as d(d+1)/2 numbers); `roots[j]` is its root
    (1/exponent). Only the fields of the block's variant are filled.
    """

    factor_matrices: tuple[Tensor, ...]
    factor_matrix_indices: tuple[str, ...]
    preconditioned_dims_selector: tuple[bool, ...]
    factor_dims: tuple[int, ...]
    roots: tuple[Fraction, ...]
    inv_factor_matrices: tuple[Tensor, ...] = ()
    factor_matrices_eigenvectors: tuple[Tensor, ...] = ()
    factor_matrices_eigenvalues: tuple[Tensor, ...] = ()
    corrected_eigenvalues: Tensor | None = None
    failed_amortized_computation_counter: int = field(default=0)
    batch: "_BlockStacks | None" = None  # with `batch_same_shape_blocks`: the stacks holding this block's state
    batch_index: int = 0  # its slice of them


def _local_tensors(value: Tensor | tuple[Tensor, ...], block_info: BlockInfo) -> Tensor | tuple[Tensor, ...]:
    """The local part of one state tensor, or of each tensor of a tuple (see `BlockInfo.get_tensor`)."""
    return tuple(map(block_info.get_tensor, value)) if isinstance(value, tuple) else block_info.get_tensor(value)


def _unwrap(
    block_state: BaseShampooKroneckerFactorsState,
    block_info: BlockInfo,
    selector: tuple[bool, ...],
    factor_dims: tuple[int, ...],
    roots: tuple[Fraction, ...],
) -> ShampooKroneckerFactorsUnwrapped:
    """The block's local tensors: each tensor field of a variant's state has the same name in the view."""
    local_tensors: dict[str, Any] = {
        state_field.name: _local_tensors(getattr(block_state, state_field.name), block_info)
        for state_field in fields(block_state)
        if state_field.name != "factor_matrix_indices"
    }
    return ShampooKroneckerFactorsUnwrapped(
        factor_matrix_indices=block_state.factor_matrix_indices,
        preconditioned_dims_selector=selector,
        factor_dims=factor_dims,
        roots=roots,
        **local_tensors,
    )


class _BlockStacks:
    """The state tensors of a batch of same-shape blocks, stacked: the c-th tensor that block i of the batch
    allocates is slice i of the c-th stack, so that a run of consecutive blocks is one slice of every stack."""

    def __init__(self, num_blocks: int) -> None:
        self.num_blocks = num_blocks
        self.stacks: list[Tensor] = []

    def allocating(self, block_info: BlockInfo, index: int) -> BlockInfo:
        """A copy of `block_info` whose zeros and identity allocations hand out block `index`'s slices of the stacks
        (the stacks themselves come from `block_info`'s zeros allocation); its other functions stay the caller's."""
        slots = itertools.count()

        def zeros(size: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> Tensor:
            return self._slice(next(slots), index, tuple(size), dtype, device, block_info)

        def eye(dimension: int, dtype: torch.dtype, device: torch.device) -> Tensor:
            identity = self._slice(next(slots), index, (dimension, dimension), dtype, device, block_info)
            identity.diagonal().fill_(1.0)
            return identity

        allocating = copy.copy(block_info)
        allocating.allocate_zeros_tensor, allocating.allocate_eye_tensor = zeros, eye
        return allocating

    def _slice(
        self, slot: int, index: int, size: tuple[int, ...], dtype: torch.dtype, device: torch.device, block_info: BlockInfo
    ) -> Tensor:
        if slot == len(self.stacks):  # the batch's first block allocates the stacks, in its allocation order
            assert index == 0, "the first block of a batch allocates its stacks"
            self.stacks.append(block_info.allocate_zeros_tensor(size=(self.num_blocks, *size), dtype=dtype, device=device))
        stack = self.stacks[slot]
        assert stack.shape[1:] == size and stack.dtype == dtype, "every block of a batch allocates the same state"
        return stack[index]

    def stack_of(self, tensor: Tensor) -> Tensor:
        """The stack that `tensor`, a slice of one, belongs to."""
        pointer = tensor.untyped_storage().data_ptr()
        return next(stack for stack in self.stacks if stack.untyped_storage().data_ptr() == pointer)


def _precondition_grad(
    grad: Tensor, preconditioned_dims_selector: tuple[bool, ...], preconditioner_list: tuple[Tensor, ...]
) -> Tensor:
    """Contract every selected dim of `grad` with its (symmetric or basis) matrix.

    Contracting dim 0 moves it to the end, so after one pass over the dims their order is restored;
    unselected dims are only rotated. For a matrix with both dims selected this is `P0ᵀ·grad·P1`.
    """
    preconditioners = iter(preconditioner_list)
    result = grad
    for selected in preconditioned_dims_selector:
        result = torch.tensordot(result, next(preconditioners), dims=([0], [0])) if selected else result.movedim(0, -1)
    return result


def _outer_product(grad: Tensor, dim: int) -> Tensor:
    """Contraction of `grad` with itself over every dim but `dim` (G·Gᵀ for dim 0 of a matrix)."""
    other_dims = [d for d in range(grad.dim()) if d != dim]
    return torch.tensordot(grad, grad, dims=(other_dims, other_dims))


def _save_debug_matrix(matrix: Tensor, factor_matrix_index: str) -> None:
    path = os.path.join(tempfile.gettempdir(), f"{factor_matrix_index.replace('.', '_')}.pt")
    try:
        torch.save(matrix.detach().cpu(), path)
    except (OSError, RuntimeError) as exception:  # torch.save reports an unwritable path as RuntimeError
        logger.warning(f"Could not save the failing factor matrix {factor_matrix_index} to {path}: {exception!r}")


def _is_finite(tensors: tuple[Tensor, ...]) -> bool:
    """Whether no entry is NaN or ±inf, from each tensor's largest absolute value (NaN propagates through the
    reduction): unlike `torch.isfinite(t).all()`, which forms |t| and three boolean masks, it allocates no
    temporaries of the tensor's size. One host synchronisation per tensor."""
    return all(
        tensor.numel() == 0 or bool(torch.isfinite(torch.linalg.vector_norm(tensor, ord=math.inf))) for tensor in tensors
    )


def _check_one_gradient_per_block(masked_grad_list: tuple[Tensor, ...], masked_blocks: tuple[Any, ...]) -> None:
    if len(masked_grad_list) != len(masked_blocks):
        raise ValueError(f"{len(masked_grad_list)} gradients for {len(masked_blocks)} masked blocks.")


def _only(tensor: Tensor) -> Tensor:
    """Continuation of a computation that finished on its side stream with one tensor."""
    return tensor


def _all(*tensors: Tensor) -> tuple[Tensor, ...]:
    """Continuation of a computation that finished on its side stream with several tensors."""
    return tensors


# -------------------------------------------------------------------------------------------------- list base


class BaseShampooPreconditionerList(SecondMomentPreconditionerList):
    """Factor bookkeeping, factor updates, bias correction and the failure policy shared by every variant.

    Subclasses say which dims are preconditioned and with which root (`_roots_of_block`), what state a block
    holds (`_create_block_state`), what the amortized computation produces and where it goes
    (`_amortized_result`, `_result_tensors`, `_store_amortized_result`) and how a gradient is preconditioned
    (`_precondition_block`); `_factor_update_sources` and `_after_amortized_computation` are optional. A variant
    that sets `_batches_blocks` also preconditions a run of batched blocks at once (`_precondition_batch`).
    """

    # Whether `batch_same_shape_blocks` applies: the variant keeps only square matrices per factor and
    # implements `_precondition_batch`.
    _batches_blocks: ClassVar[bool] = False
    # Whether `defer_amortized_computation` applies: the variant uses its amortized results only to precondition
    # (and, KL, to feed the next factor updates), so computing them after the step makes each one a step older and
    # changes nothing else. Eigenvalue correction would instead update its eigenvalues in the old basis and use them
    # in the new one.
    _defers_amortized_computation: ClassVar[bool] = False

    def __init__(
        self,
        block_list: tuple[Tensor, ...],
        state: dict[Tensor, Any],
        block_info_list: tuple[BlockInfo, ...],
        preconditioner_config: BaseShampooPreconditionerConfig,
        beta2: float = 1.0,
        weighting_factor: float = 1.0,
        epsilon: float = 1e-12,
        use_bias_correction: bool = True,
        *,
        num_amortized_computation_streams: int = 1,
        concurrent_memory_fraction: float = DEFAULT_CONCURRENT_MEMORY_FRACTION,
        batch_same_shape_blocks: bool = False,
        defer_amortized_computation: bool = False,
    ) -> None:
        super().__init__(block_list, beta2, weighting_factor, epsilon, use_bias_correction)
        self._preconditioner_config = preconditioner_config
        self._packed = preconditioner_config.use_symmetric_packing
        if defer_amortized_computation:
            self._check_deferrable(preconditioner_config)
        if batch_same_shape_blocks:
            self._check_batchable(preconditioner_config)
        self.defers_amortized_computation = defer_amortized_computation
        self._in_background: _BackgroundComputation | None = None
        if num_amortized_computation_streams < 1:
            raise ValueError(f"{num_amortized_computation_streams=} must be at least 1.")
        self._num_amortized_computation_streams = num_amortized_computation_streams
        if not concurrent_memory_fraction >= 0.0:  # NaN fails too
            raise ValueError(f"{concurrent_memory_fraction=} must be >= 0 (math.inf for no bound).")
        self._concurrent_memory_fraction = concurrent_memory_fraction

        batches = self._plan_batches(block_list) if batch_same_shape_blocks else {}
        blocks = []
        for position, (block, block_info) in enumerate(zip(block_list, block_info_list, strict=True)):
            param_index, block_id = block_info.composable_block_ids
            selector, roots = self._roots_of_block(block.dim())
            factor_dims = tuple(size for size, selected in zip(block.size(), selector) if selected)
            batch, batch_index = batches.get(position, (None, 0))
            allocating = block_info if batch is None else batch.allocating(block_info, batch_index)
            factor_matrices = tuple(
                allocating.allocate_zeros_tensor(
                    size=self._symmetric_shape(size), dtype=preconditioner_config.factor_matrix_dtype, device=block.device
                )
                for size in factor_dims
            )
            if self._packed:  # built here, on the main thread, before any worker thread reads them
                for size in factor_dims:
                    upper_triangular_indices(size, block.device)
            indices = tuple(f"{param_index}.{block_id}.{j}" for j in range(len(factor_dims)))
            block_state = self._create_block_state(block, allocating, factor_matrices, factor_dims, indices)
            state[block_info.param][block_id][SHAMPOO] = block_state
            unwrapped = _unwrap(block_state, block_info, selector, factor_dims, roots)
            unwrapped.batch, unwrapped.batch_index = batch, batch_index
            blocks.append(unwrapped)
        self._local_blocks: tuple[ShampooKroneckerFactorsUnwrapped, ...] = tuple(blocks)
        self._masked_blocks = self._local_blocks

        # Reported as if square (2·d² per factor), like the published optimizer, whatever the storage layout.
        self._numel_list = tuple(sum(2 * size * size for size in b.factor_dims) for b in blocks)
        factor_bytes = get_dtype_size(preconditioner_config.factor_matrix_dtype)
        self._num_bytes_list = tuple(
            numel * (factor_bytes + get_dtype_size(block.dtype)) // 2
            for numel, block in zip(self._numel_list, block_list, strict=True)
        )
        self._state_bytes = sum(
            tensor.numel() * tensor.element_size()
            for b in blocks
            for state_field in fields(b)
            for tensor in _tensors_of(getattr(b, state_field.name))
        )
        self._batch_bytes = max(_BATCH_STATE_FRACTION * self._state_bytes, _MIN_BATCH_BYTES)

    def _check_deferrable(self, config: BaseShampooPreconditionerConfig) -> None:
        name = type(config).__name__
        if not self._defers_amortized_computation:
            raise ValueError(
                f"ShampooRuntimeConfig(defer_amortized_computation=True) does not support {name}, only "
                "RootInvShampooPreconditionerConfig and RootInvKLShampooPreconditionerConfig: set "
                "defer_amortized_computation=False."
            )
        amortized = config.amortized_computation_config
        if changes_global_state(amortized):  # from a background thread it would change the caller's matmuls too
            raise ValueError(
                f"ShampooRuntimeConfig(defer_amortized_computation=True) cannot run {type(amortized).__name__}"
                "(disable_tf32=True) in the background: it flips torch's process-wide TF32 flag; set disable_tf32=False "
                "or defer_amortized_computation=False."
            )

    def _check_batchable(self, config: BaseShampooPreconditionerConfig) -> None:
        name = type(config).__name__
        if not self._batches_blocks:
            raise ValueError(
                f"ShampooRuntimeConfig(batch_same_shape_blocks=True) does not support {name}, only "
                "RootInvShampooPreconditionerConfig: set batch_same_shape_blocks=False."
            )
        if self._packed:
            raise ValueError(
                f"ShampooRuntimeConfig(batch_same_shape_blocks=True) needs square factors: pass {name}("
                "use_symmetric_packing=False) or set batch_same_shape_blocks=False."
            )

    def _plan_batches(self, block_list: tuple[Tensor, ...]) -> dict[int, tuple[_BlockStacks, int]]:
        """(stacks, index in them) of each block that shares stacks with the other blocks of its shape: matrix
        blocks with both dims preconditioned, sides of at least `_MIN_BATCHED_DIM`, two or more of a shape (dtype
        and device included)."""
        shapes: dict[tuple[Any, ...], list[int]] = {}
        for position, block in enumerate(block_list):
            selector, _ = self._roots_of_block(block.dim())
            if block.dim() == 2 and all(selector) and min(block.shape) >= _MIN_BATCHED_DIM:
                shapes.setdefault((tuple(block.shape), block.dtype, block.device), []).append(position)
        plan: dict[int, tuple[_BlockStacks, int]] = {}
        for positions in shapes.values():
            if len(positions) > 1:
                stacks = _BlockStacks(len(positions))
                plan.update((position, (stacks, index)) for index, position in enumerate(positions))
        return plan

    # ---- variant hooks

    @abstractmethod
    def _roots_of_block(self, order: int) -> tuple[tuple[bool, ...], tuple[Fraction, ...]]:
        """(which dims of an order-`order` block are preconditioned, root of each preconditioned dim)."""

    @abstractmethod
    def _create_block_state(
        self,
        block: Tensor,
        block_info: BlockInfo,
        factor_matrices: tuple[Tensor, ...],
        factor_dims: tuple[int, ...],
        indices: tuple[str, ...],
    ) -> BaseShampooKroneckerFactorsState: ...

    @abstractmethod
    def _amortized_result(self, A: Tensor, block: ShampooKroneckerFactorsUnwrapped, j: int) -> ContinueOnCaller[Any]:
        """What the amortized computation produces for factor j from its normalised square matrix A (which it may
        overwrite), as a continuation: the solver runs here (on a side stream when concurrent), and whatever
        follows it that needs a matmul runs in the continuation, on the calling thread and stream."""

    @abstractmethod
    def _result_tensors(self, result: Any) -> tuple[Tensor, ...]:
        """Tensors of a result to check for NaN/Inf."""

    @abstractmethod
    def _store_amortized_result(self, block: ShampooKroneckerFactorsUnwrapped, j: int, result: Any) -> None: ...

    @abstractmethod
    def _precondition_block(self, grad: Tensor, block: ShampooKroneckerFactorsUnwrapped) -> Tensor: ...

    def _factor_update_sources(self, grad: Tensor, block: ShampooKroneckerFactorsUnwrapped) -> tuple[Tensor, ...]:
        """Per factor matrix, the tensor whose outer product feeds it (KL variants precondition the gradient first)."""
        return (grad,) * len(block.factor_matrices)

    def _after_amortized_computation(self, masked_grad_list: tuple[Tensor, ...]) -> None:
        """Per-step work that needs this step's factors and eigenbasis (eigenvalue correction)."""

    def _precondition_batch(
        self, stacks: _BlockStacks, first: int, grads: list[Tensor], block: ShampooKroneckerFactorsUnwrapped
    ) -> tuple[Tensor, ...]:
        """The directions of the batched blocks `first`, `first + 1`, … of `stacks` (`block` is the first of them),
        bitwise those of `_precondition_block`."""
        raise NotImplementedError(f"{type(self).__name__} does not precondition batched blocks.")

    # ---- symmetric storage

    def _symmetric_shape(self, dimension: int) -> tuple[int, ...]:
        return (packed_size(dimension),) if self._packed else (dimension, dimension)

    def _square(self, stored: Tensor) -> Tensor:
        """A stored symmetric matrix as a square matrix (a new tensor when packed, the stored one otherwise)."""
        return unpack_upper_triangular(stored) if self._packed else stored

    def _store_symmetric(self, destination: Tensor, matrix: Tensor) -> None:
        destination.copy_(pack_upper_triangular(matrix) if self._packed else matrix)

    def _identities(
        self, factor_dims: tuple[int, ...], block_info: BlockInfo, dtype: torch.dtype, device: torch.device, symmetric: bool
    ) -> tuple[Tensor, ...]:
        """One identity per factor: the starting inverse roots (`symmetric`, so maybe packed) or eigenvectors."""
        identities = []
        for size in factor_dims:
            if symmetric and self._packed:
                identity = block_info.allocate_zeros_tensor(size=(packed_size(size),), dtype=dtype, device=device)
                rows = torch.arange(size, device=device)
                block_info.get_tensor(identity)[rows * size - rows * (rows - 1) // 2] = 1.0
            else:
                identity = block_info.allocate_eye_tensor(size, dtype=dtype, device=device)
            identities.append(identity)
        return tuple(identities)

    # ---- shared algorithm

    def compress_preconditioner_list(self, local_grad_selector: tuple[bool, ...]) -> None:
        self._masked_blocks = compress_list(self._local_blocks, local_grad_selector)

    @profile_decorator
    def update_preconditioners(
        self, masked_grad_list: tuple[Tensor, ...], step: Tensor | int, perform_amortized_computation: bool
    ) -> None:
        self._update_factor_matrices(masked_grad_list)
        self._update_bias_correction2(step)
        if perform_amortized_computation:
            self._amortized_computation()
        self._after_amortized_computation(masked_grad_list)

    @profile_decorator
    def _update_factor_matrices(self, masked_grad_list: tuple[Tensor, ...]) -> None:
        """F_k ← beta2·F_k + weighting_factor·(outer product of the gradient over every dim but k), as the published
        optimizer forms it: the outer product by a matmul, then the two elementwise operations.

        One factor at a time, so that at most one outer product is alive; batched blocks a run at a time.
        """
        runs, single = self._batched_runs(self._masked_blocks, self._factor_update_bytes)
        for stacks, first, positions in runs:
            grads = torch.stack([masked_grad_list[position] for position in positions])
            end = first + len(positions)
            for dim, factor in enumerate(self._masked_blocks[positions[0]].factor_matrices):
                outer_products = torch.bmm(grads, grads.mT) if dim == 0 else torch.bmm(grads.mT, grads)
                self._accumulate(stacks.stack_of(factor)[first:end], outer_products)
                del outer_products
        for position in single:
            grad, block = masked_grad_list[position], self._masked_blocks[position]
            dims = [d for d, selected in enumerate(block.preconditioned_dims_selector) if selected]
            sources = self._factor_update_sources(grad, block)
            for dim, factor, source in zip(dims, block.factor_matrices, sources, strict=True):
                outer_product = _outer_product(source, dim)
                self._accumulate(factor, pack_upper_triangular(outer_product) if self._packed else outer_product)

    @staticmethod
    def _factor_update_bytes(block: ShampooKroneckerFactorsUnwrapped) -> int:
        """Temporaries of a batched block's factor update: its stacked gradient and its largest outer product."""
        rows, columns = block.factor_dims
        return (rows * columns + max(rows, columns) ** 2) * block.factor_matrices[0].element_size()

    def _batched_runs(
        self, blocks: Sequence[ShampooKroneckerFactorsUnwrapped], bytes_per_block: Callable[[ShampooKroneckerFactorsUnwrapped], int]
    ) -> tuple[list[tuple[_BlockStacks, int, list[int]]], list[int]]:
        """The positions in `blocks` split into runs of consecutive slices of one batch's stacks, as (stacks, first
        slice, positions), and the positions left to the per-block path (unbatched blocks, and runs of one).

        A run holds at most `_batch_bytes` of temporaries (`bytes_per_block` each); the slices of a batch's blocks
        that received a gradient are consecutive unless a block between them did not.
        """
        members: dict[int, tuple[_BlockStacks, list[tuple[int, int]]]] = {}
        single = []
        for position, block in enumerate(blocks):
            if block.batch is None:
                single.append(position)
            else:
                members.setdefault(id(block.batch), (block.batch, []))[1].append((block.batch_index, position))
        runs: list[tuple[_BlockStacks, int, list[int]]] = []

        def close(stacks: _BlockStacks, first: int, positions: list[int]) -> None:
            if len(positions) > 1:
                runs.append((stacks, first, positions))
            else:
                single.extend(positions)

        for stacks, indexed in members.values():
            limit = max(1, int(self._batch_bytes // bytes_per_block(blocks[indexed[0][1]])))
            first, positions = indexed[0][0], []
            for index, position in indexed:
                if positions and (index != first + len(positions) or len(positions) == limit):
                    close(stacks, first, positions)
                    first, positions = index, []
                positions.append(position)
            close(stacks, first, positions)
        single.sort()
        return runs, single

    def _accumulate(self, statistic: Tensor, update: Tensor) -> None:
        """S ← beta2·S + weighting_factor·U (the multiply is skipped when beta2 == 1)."""
        if self._beta2 != 1.0:
            statistic.mul_(self._beta2)
        statistic.add_(update, alpha=self._weighting_factor)

    def _warm_started_eigendecomposition(
        self, A: Tensor, block: ShampooKroneckerFactorsUnwrapped, j: int
    ) -> tuple[Tensor, Tensor]:
        """(eigenvalues, eigenvectors) of A, starting from factor j's current eigenvectors (QR iterations use them).
        A is overwritten."""
        return matrix_eigendecomposition(
            A,
            epsilon=self._epsilon,
            eigendecomposition_config=self._preconditioner_config.amortized_computation_config,
            eigenvectors_estimate=block.factor_matrices_eigenvectors[j].to(A.dtype),
            overwrite_input=True,
        )

    def _normalized_factor(self, stored: Tensor) -> Tensor:
        """The bias-corrected (and trace-scaled) factor as a new square matrix."""
        matrix = self._square(stored / self._bias_correction2)
        config = self._preconditioner_config
        if config.use_trace_scaling:
            matrix.mul_(torch.clamp(torch.trace(matrix), min=self._epsilon).pow(-config.trace_scaling_exponent))
        return matrix

    def _amortized_computation_bytes(self, block: ShampooKroneckerFactorsUnwrapped, j: int) -> int:
        """Estimated peak temporaries of recomputing factor j: its normalised square copy (perturbed in place) plus
        what the matrix function allocates (for `eigh`: eigenvectors, eigenvalues and the solver's work array,
        `eigh_workspace_elements`), or the caller's part if that is larger (`_amortized_result_temporary_elements`).
        With packed storage the unpacking (2.5·d² at most) and packing stay below this. In the factor's dtype."""
        dimension = block.factor_dims[j]
        config = self._preconditioner_config.amortized_computation_config
        decomposition = dimension * dimension + matrix_function_temporary_elements(config, dimension)
        elements = max(decomposition, self._amortized_result_temporary_elements(dimension))
        return elements * block.factor_matrices[j].element_size()

    def _amortized_result_temporary_elements(self, dimension: int) -> int:
        """Peak elements the caller's part of a d×d factor's computation holds (the continuation of
        `_amortized_result`, the checks and the store); by default at most the eigenvectors and eigenvalues, which
        are stored by copying (bounded by 2·d²)."""
        return 2 * dimension * dimension

    def start_amortized_computation(self) -> None:
        """The amortized computation of the masked blocks, from their factors as they are now, on a host thread and
        (on CUDA) a stream of its own, which waits for the work queued so far; `finish_amortized_computation` waits
        for it. The caller must not change the factors or read the results before then."""
        assert self.defers_amortized_computation, "start_amortized_computation needs defer_amortized_computation"
        self.finish_amortized_computation()
        blocks = self._masked_blocks
        if not blocks:
            return
        device = blocks[0].factor_matrices[0].device if blocks[0].factor_matrices else torch.device("cpu")
        load_linalg_library(device)  # its lazy first call is not thread safe: make it here, on the caller's thread
        self._in_background = _BackgroundComputation(partial(self._amortized_computation, blocks), device)

    def finish_amortized_computation(self) -> None:
        if self._in_background is not None:
            in_background, self._in_background = self._in_background, None
            in_background.wait()

    @profile_decorator
    def _amortized_computation(self, blocks: tuple[ShampooKroneckerFactorsUnwrapped, ...] | None = None) -> None:
        """Recompute every factor's result of `blocks` (default: the masked blocks), one factor per task; then
        update the failure counters.

        With several streams (CUDA only) the tasks run concurrently, largest first so that the big
        decompositions start early, while their estimated temporaries stay within the largest one's plus
        the concurrent memory fraction of the state; each result is bitwise the sequential one.
        """
        blocks = self._masked_blocks if blocks is None else blocks
        work = [(block, j) for block in blocks for j in range(len(block.factor_matrices))]
        if not work:
            return
        streams = self._num_amortized_computation_streams
        if changes_global_state(self._preconditioner_config.amortized_computation_config):
            streams = 1  # concurrent threads would race on the flag it flips
        outcomes = self._recompute_factors(work, streams)

        last_exception = {id(block): outcome for (block, _), outcome in zip(work, outcomes, strict=True) if outcome is not None}
        tolerance = self._preconditioner_config.num_tolerated_failed_amortized_computations
        for block in blocks:
            if id(block) not in last_exception:
                block.failed_amortized_computation_counter = 0
                continue
            block.failed_amortized_computation_counter += 1
            if block.failed_amortized_computation_counter > tolerance:
                exception = last_exception[id(block)]
                raise ValueError(
                    f"Exceeded tolerance ({tolerance}) for number of failed amortized computations for factor "
                    f"matrices {block.factor_matrix_indices}. Last exception: {exception!r}"
                ) from exception

    def _recompute_factors(
        self, work: list[tuple[ShampooKroneckerFactorsUnwrapped, int]], streams: int
    ) -> list[Exception | None]:
        """Per (block, factor) of `work`, the numerical failure that kept its previous result, or None.

        Each factor is one task of `run_on_side_streams`: normalise, decompose (on a side stream when concurrent),
        then form the result, check and store it on the calling thread and stream (`_finish_factor`).
        """
        device = work[0][0].factor_matrices[work[0][1]].device
        order = list(range(len(work)))
        if streams > 1 and device.type == "cuda" and len(work) > 1:
            order.sort(key=lambda task: -work[task][0].factor_dims[work[task][1]])  # largest first
            load_linalg_library(device)  # its lazy first call is not thread safe
        costs = [self._amortized_computation_bytes(*work[task]) for task in order]
        budget = max(costs) + self._concurrent_memory_fraction * self._state_bytes
        outcomes = run_on_side_streams(
            [partial(self._recompute_factor, *work[task]) for task in order], streams, device, costs, budget
        )
        in_work_order: list[Exception | None] = [None] * len(work)
        for task, outcome in zip(order, outcomes, strict=True):
            in_work_order[task] = outcome
        return in_work_order

    def _recompute_factor(
        self, block: ShampooKroneckerFactorsUnwrapped, j: int
    ) -> Exception | ContinueOnCaller[Exception | None]:
        """Normalise and decompose factor j; the rest (`_finish_factor`) continues on the calling thread.

        Returns the numerical failure that keeps the old result instead, if any. NaN/Inf in the factor raise
        `PreconditionerValueError`; other exceptions propagate.
        """
        index = block.factor_matrix_indices[j]
        A = self._normalized_factor(block.factor_matrices[j])
        if not _is_finite((A,)):
            raise PreconditionerValueError(
                f"Encountered nan/inf values in factor matrix {index}! To mitigate, check if nan inputs are being "
                "passed into the network or nan gradients are being passed to the optimizer. For debugging purposes, "
                f"factor_matrix {index}: {torch.min(A)=}, {torch.max(A)=}."
            )
        try:
            partial_result = self._amortized_result(A, block, j)
        except NUMERICAL_FAILURES as exception:
            del A
            return self._keep_previous_result(block, j, exception)
        del A  # freed before the caller's part, which may form larger temporaries
        return ContinueOnCaller(partial(self._finish_factor, block, j, partial_result.function), partial_result.tensors)

    def _finish_factor(
        self, block: ShampooKroneckerFactorsUnwrapped, j: int, finish: Callable[..., Any], *tensors: Tensor
    ) -> Exception | None:
        """Complete (`finish(*tensors)`), check and store factor j's result; return the numerical failure that kept
        the previous result, if any. NaN/Inf in the result raise `PreconditionerValueError`."""
        try:
            result = finish(*tensors)
        except NUMERICAL_FAILURES as exception:
            return self._keep_previous_result(block, j, exception)
        if not _is_finite(self._result_tensors(result)):
            self._save_debug_factor(block, j)
            raise PreconditionerValueError(
                f"Encountered nan or inf values in the computed quantity of factor matrix {block.factor_matrix_indices[j]}!"
            )
        self._store_amortized_result(block, j, result)
        return None

    def _keep_previous_result(self, block: ShampooKroneckerFactorsUnwrapped, j: int, exception: Exception) -> Exception:
        self._save_debug_factor(block, j)
        logger.warning(
            f"Matrix computation failed for factor matrix {block.factor_matrix_indices[j]} with {exception=}. "
            "Using previous computed value instead. To mitigate, increase epsilon or use a more "
            "robust amortized computation config."
        )
        return exception

    def _save_debug_factor(self, block: ShampooKroneckerFactorsUnwrapped, j: int) -> None:
        """Save factor j's normalised matrix (formed again: the computation may have overwritten its copy)."""
        _save_debug_matrix(self._normalized_factor(block.factor_matrices[j]), block.factor_matrix_indices[j])

    @profile_decorator
    def precondition(self, masked_grad_list: tuple[Tensor, ...]) -> tuple[Tensor, ...]:
        _check_one_gradient_per_block(masked_grad_list, self._masked_blocks)
        return self.precondition_blocks(masked_grad_list, 0)

    def precondition_blocks(self, masked_grad_list: tuple[Tensor, ...], first_block: int) -> tuple[Tensor, ...]:
        blocks = self._masked_blocks[first_block : first_block + len(masked_grad_list)]
        assert len(blocks) == len(masked_grad_list), f"{len(masked_grad_list)} gradients for {len(blocks)} blocks."
        runs, single = self._batched_runs(blocks, self._precondition_bytes)
        directions: list[Tensor | None] = [None] * len(blocks)
        for position in single:
            directions[position] = self._precondition_block(masked_grad_list[position], blocks[position])
        for stacks, first, positions in runs:
            batch = self._precondition_batch(stacks, first, [masked_grad_list[p] for p in positions], blocks[positions[0]])
            for position, direction in zip(positions, batch, strict=True):
                directions[position] = direction
        return tuple(directions)  # type: ignore[arg-type]  # every position was filled

    @staticmethod
    def _precondition_bytes(block: ShampooKroneckerFactorsUnwrapped) -> int:
        """Temporaries of preconditioning a batched block: its stacked gradient, the half-way product and the result."""
        rows, columns = block.factor_dims
        return 3 * rows * columns * block.factor_matrices[0].element_size()


# Per process and device: the CUDA stream (None off CUDA) and the host thread that deferred root computations run
# on. Persistent, as the side streams of `run_on_side_streams` are: the caching allocator keeps freed memory per
# stream, and torch keeps a cuBLAS workspace per (thread's handle, stream) pair, so new ones at every root step
# would hold ever more memory.
_BACKGROUND_WORKERS: dict[tuple[int, torch.device], tuple["torch.cuda.Stream | None", ThreadPoolExecutor]] = {}
_BACKGROUND_WORKERS_LOCK = threading.Lock()


def _background_worker(device: torch.device) -> tuple["torch.cuda.Stream | None", ThreadPoolExecutor]:
    key = (os.getpid(), torch.device(device))
    with _BACKGROUND_WORKERS_LOCK:
        if key not in _BACKGROUND_WORKERS:
            stream = torch.cuda.Stream(device) if device.type == "cuda" else None
            _BACKGROUND_WORKERS[key] = (stream, ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"shampoo-deferred-{device}"))
        return _BACKGROUND_WORKERS[key]


class _BackgroundComputation:
    """`function()` on the device's background thread and (on CUDA) stream, which first waits for the work queued
    on the caller's stream. `wait()` waits for the function, makes the caller's stream wait for the background
    stream, and raises what the function raised."""

    def __init__(self, function: Callable[[], None], device: torch.device) -> None:
        self._device = device
        self._stream, executor = _background_worker(device)
        if self._stream is not None:
            self._stream.wait_stream(torch.cuda.current_stream(device))
        self._future = executor.submit(self._run, function)

    @torch.no_grad()  # grad mode is per thread; the step's no_grad does not reach this one
    def _run(self, function: Callable[[], None]) -> None:
        if self._stream is None:
            function()
            return
        with torch.cuda.device(self._device), torch.cuda.stream(self._stream):
            function()

    def wait(self) -> None:
        try:
            self._future.result()
        finally:
            if self._stream is not None:
                torch.cuda.current_stream(self._device).wait_stream(self._stream)


def _tensors_of(value: Any) -> tuple[Tensor, ...]:
    if isinstance(value, Tensor):
        return (value,)
    if isinstance(value, tuple):
        return tuple(item for item in value if isinstance(item, Tensor))
    return ()


# ----------------------------------------------------------------------------------------------- classic Shampoo


class ClassicShampooPreconditionerList(BaseShampooPreconditionerList):
    """Shampoo with per-dim exponents: default 1/(2·order), overridable per order (and per dim)."""

    _preconditioner_config: ClassicShampooPreconditionerConfig

    def _roots_of_block(self, order: int) -> tuple[tuple[bool, ...], tuple[Fraction, ...]]:
        default_exponent = 1.0 / (2 * max(order, 1))
        override = self._preconditioner_config.inverse_exponent_override.get(order, {})
        exponents = [
            override.get(d, default_exponent) if isinstance(override, dict) else override for d in range(order)
        ]
        selector = tuple(exponent != 0.0 for exponent in exponents)
        roots = tuple(Fraction(1.0 / exponent) for exponent in exponents if exponent != 0.0)
        return selector, roots

    def _block_inverse_roots(self, block: ShampooKroneckerFactorsUnwrapped) -> tuple[Tensor, ...]:
        """The matrices that precondition the block: F_k^(-1/root_k)."""
        raise NotImplementedError

    def _precondition_block(self, grad: Tensor, block: ShampooKroneckerFactorsUnwrapped) -> Tensor:
        inverse_roots = self._block_inverse_roots(block)
        if not inverse_roots:
            return grad
        dtype = inverse_roots[0].dtype
        assert all(root.dtype == dtype for root in inverse_roots), "All preconditioners of a block must share a dtype."
        return _precondition_grad(grad.to(dtype), block.preconditioned_dims_selector, inverse_roots).to(grad.dtype)


class RootInvShampooPreconditionerList(ClassicShampooPreconditionerList):
    """Stores F_k^(-1/root_k), recomputed by `matrix_inverse_root` (eigh by default)."""

    _preconditioner_config: RootInvShampooPreconditionerConfig
    _batches_blocks: ClassVar[bool] = True
    _defers_amortized_computation: ClassVar[bool] = True

    def _create_block_state(
        self,
        block: Tensor,
        block_info: BlockInfo,
        factor_matrices: tuple[Tensor, ...],
        factor_dims: tuple[int, ...],
        indices: tuple[str, ...],
    ) -> RootInvShampooKroneckerFactorsState:
        dtype = self._preconditioner_config.inv_factor_matrix_dtype
        return RootInvShampooKroneckerFactorsState(
            factor_matrices=factor_matrices,
            factor_matrix_indices=indices,
            inv_factor_matrices=self._identities(factor_dims, block_info, dtype, block.device, symmetric=True),
        )

    def _amortized_result(self, A: Tensor, block: ShampooKroneckerFactorsUnwrapped, j: int) -> ContinueOnCaller[Tensor]:
        root = matrix_inverse_root(
            A,
            root=block.roots[j],
            root_inv_config=self._preconditioner_config.amortized_computation_config,
            epsilon=self._epsilon,
            overwrite_input=True,
            defer_product=True,  # eigh: Q·diag(λ^(-1/r))·Qᵀ in the continuation
        )
        return root if isinstance(root, ContinueOnCaller) else ContinueOnCaller(_only, (root,))

    def _amortized_result_temporary_elements(self, dimension: int) -> int:
        # Eigenvalues and eigenvectors, Q·diag(λ^(-1/r)) and the root (its packed copy comes after the product).
        return 3 * dimension * dimension + dimension

    def _result_tensors(self, result: Tensor) -> tuple[Tensor, ...]:
        return (result,)

    def _store_amortized_result(self, block: ShampooKroneckerFactorsUnwrapped, j: int, result: Tensor) -> None:
        self._store_symmetric(block.inv_factor_matrices[j], result)

    def _block_inverse_roots(self, block: ShampooKroneckerFactorsUnwrapped) -> tuple[Tensor, ...]:
        return tuple(map(self._square, block.inv_factor_matrices))

    def _precondition_batch(
        self, stacks: _BlockStacks, first: int, grads: list[Tensor], block: ShampooKroneckerFactorsUnwrapped
    ) -> tuple[Tensor, ...]:
        # L·G·R as `_precondition_grad` forms it for each block: Gᵀ·L (contracting the rows), then its rows with R.
        end = first + len(grads)
        inverse_roots = [stacks.stack_of(root)[first:end] for root in block.inv_factor_matrices]
        result = torch.stack(grads).to(inverse_roots[0].dtype)
        for inverse_root in inverse_roots:
            result = torch.bmm(result.mT, inverse_root)
        return result.to(grads[0].dtype).unbind(0)


class EigendecomposedShampooPreconditionerList(ClassicShampooPreconditionerList):
    """Stores eigenvalues/eigenvectors of each factor; the roots are formed whenever a block is preconditioned."""

    _preconditioner_config: EigendecomposedShampooPreconditionerConfig

    def _create_block_state(
        self,
        block: Tensor,
        block_info: BlockInfo,
        factor_matrices: tuple[Tensor, ...],
        factor_dims: tuple[int, ...],
        indices: tuple[str, ...],
    ) -> EigendecomposedShampooKroneckerFactorsState:
        config = self._preconditioner_config
        return EigendecomposedShampooKroneckerFactorsState(
            factor_matrices=factor_matrices,
            factor_matrix_indices=indices,
            factor_matrices_eigenvectors=self._identities(
                factor_dims, block_info, config.factor_matrix_eigenvectors_dtype, block.device, symmetric=False
            ),
            factor_matrices_eigenvalues=tuple(
                block_info.allocate_ones_tensor(size=(size,), dtype=config.factor_matrix_eigenvalues_dtype, device=block.device)
                for size in factor_dims
            ),
        )

    def _amortized_result(
        self, A: Tensor, block: ShampooKroneckerFactorsUnwrapped, j: int
    ) -> ContinueOnCaller[tuple[Tensor, ...]]:
        return ContinueOnCaller(_all, self._warm_started_eigendecomposition(A, block, j))  # (eigenvalues, eigenvectors)

    def _result_tensors(self, result: tuple[Tensor, Tensor]) -> tuple[Tensor, ...]:
        return result

    def _store_amortized_result(self, block: ShampooKroneckerFactorsUnwrapped, j: int, result: tuple[Tensor, Tensor]) -> None:
        eigenvalues, eigenvectors = result
        block.factor_matrices_eigenvalues[j].copy_(eigenvalues)
        block.factor_matrices_eigenvectors[j].copy_(eigenvectors)

    def _block_inverse_roots(self, block: ShampooKroneckerFactorsUnwrapped) -> tuple[Tensor, ...]:
        stability = self._preconditioner_config.amortized_computation_config.rank_deficient_stability_config
        return tuple(
            matrix_inverse_root_from_eigendecomposition(
                eigenvalues, eigenvectors, root, self._epsilon, stability
            )
            for eigenvalues, eigenvectors, root in zip(
                block.factor_matrices_eigenvalues, block.factor_matrices_eigenvectors, block.roots, strict=True
            )
        )


class _KLMixin:
    """KL-Shampoo: factor k accumulates the gradient preconditioned along every other preconditioned dim."""

    def _factor_update_sources(self, grad: Tensor, block: ShampooKroneckerFactorsUnwrapped) -> tuple[Tensor, ...]:
        # Once per block, not per factor: the eigendecomposed variant forms the roots with matmuls.
        inverse_roots = self._block_inverse_roots(block)  # type: ignore[attr-defined]
        selector = block.preconditioned_dims_selector
        preconditioned_dims = [d for d, selected in enumerate(selector) if selected]
        sources = []
        for dim in preconditioned_dims:
            others_selector = tuple(selected and d != dim for d, selected in enumerate(selector))
            others = tuple(root for d, root in zip(preconditioned_dims, inverse_roots) if d != dim)
            if others:
                sources.append(_precondition_grad(grad.to(others[0].dtype), others_selector, others).to(grad.dtype))
            else:
                sources.append(grad)
        return tuple(sources)


class RootInvKLShampooPreconditionerList(_KLMixin, RootInvShampooPreconditionerList):
    """KL-Shampoo with stored inverse roots."""

    _batches_blocks: ClassVar[bool] = False  # its factors accumulate a preconditioned gradient


class EigendecomposedKLShampooPreconditionerList(_KLMixin, EigendecomposedShampooPreconditionerList):
    """KL-Shampoo with eigendecomposed factors."""


# ---------------------------------------------------------------------------------- eigenvalue-corrected Shampoo


class EigenvalueCorrectedShampooPreconditionerList(BaseShampooPreconditionerList):
    """Adam/AdaGrad run in the eigenbasis of the factor matrices (SOAP when the eigenbasis comes from QR).

    Every step, after the amortized computation (if any) has refreshed the basis, the gradient is rotated into it
    and E ← beta2·E + weighting_factor·G̃² is updated; the direction is
    rotate_back(M̃ / ((E / bias_correction2)^exponent + epsilon)).
    """

    _preconditioner_config: EigenvalueCorrectedShampooPreconditionerConfig

    def _exponent(self, order: int) -> float:
        """Power of the corrected eigenvalues in the denominator (1/2 unless overridden for this order)."""
        return self._preconditioner_config.inverse_exponent_override.get(order, 1 / 2)

    def _roots_of_block(self, order: int) -> tuple[tuple[bool, ...], tuple[Fraction, ...]]:
        ignored = self._preconditioner_config.ignored_basis_change_dims.get(order, [])
        selector = tuple(d not in ignored for d in range(order))
        return selector, tuple(Fraction(1.0 / self._exponent(order)) for _ in range(sum(selector)))

    def _create_block_state(
        self,
        block: Tensor,
        block_info: BlockInfo,
        factor_matrices: tuple[Tensor, ...],
        factor_dims: tuple[int, ...],
        indices: tuple[str, ...],
    ) -> EigenvalueCorrectedShampooKroneckerFactorsState:
        config = self._preconditioner_config
        return EigenvalueCorrectedShampooKroneckerFactorsState(
            factor_matrices=factor_matrices,
            factor_matrix_indices=indices,
            factor_matrices_eigenvectors=self._identities(
                factor_dims, block_info, config.factor_matrix_eigenvectors_dtype, block.device, symmetric=False
            ),
            corrected_eigenvalues=block_info.allocate_zeros_tensor(
                size=block.size(), dtype=config.corrected_eigenvalues_dtype, device=block.device
            ),
        )

    def _rotate(self, tensor: Tensor, block: ShampooKroneckerFactorsUnwrapped, back: bool = False) -> Tensor:
        bases = block.factor_matrices_eigenvectors
        if back:
            bases = tuple(basis.T for basis in bases)
        return _precondition_grad(tensor, block.preconditioned_dims_selector, bases)

    def _after_amortized_computation(self, masked_grad_list: tuple[Tensor, ...]) -> None:
        """E ← beta2·E + weighting_factor·G̃², with G̃ the gradient in the eigenbasis just recomputed (if this is an
        amortized step): the basis first, then the eigenvalues measured in it, as in the published optimizer."""
        for grad, block in zip(masked_grad_list, self._masked_blocks, strict=True):
            assert block.corrected_eigenvalues is not None
            rotated = self._rotate(grad.to(block.corrected_eigenvalues.dtype), block)
            self._accumulate(block.corrected_eigenvalues, rotated.square())  # rotated may be a view of grad

    def _amortized_result(self, A: Tensor, block: ShampooKroneckerFactorsUnwrapped, j: int) -> ContinueOnCaller[Tensor]:
        _, eigenvectors = self._warm_started_eigendecomposition(A, block, j)
        return ContinueOnCaller(_only, (eigenvectors,))

    def _result_tensors(self, result: Tensor) -> tuple[Tensor, ...]:
        return (result,)

    def _store_amortized_result(self, block: ShampooKroneckerFactorsUnwrapped, j: int, result: Tensor) -> None:
        block.factor_matrices_eigenvectors[j].copy_(result)

    def _precondition_block(self, grad: Tensor, block: ShampooKroneckerFactorsUnwrapped) -> Tensor:
        assert block.corrected_eigenvalues is not None
        rotated = self._rotate(grad.to(block.corrected_eigenvalues.dtype), block)
        denominator = (block.corrected_eigenvalues / self._bias_correction2).pow(self._exponent(grad.dim())).add_(self._epsilon)
        return self._rotate(rotated / denominator, block, back=True).to(grad.dtype)
