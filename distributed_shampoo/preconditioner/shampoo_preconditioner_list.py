"""Kronecker-factored Shampoo preconditioners and their variants.

Every block of order `o` keeps one factor matrix per preconditioned dim `k`, the running statistic of the
gradient's outer product contracted over every other dim (`G·Gᵀ` and `Gᵀ·G` for a matrix). Every
`precondition_frequency` steps an "amortized computation" turns the factors into what preconditioning needs:

* RootInv: the inverse roots F_k^(-exponent_k) (the record: exponent 1/4 on both sides of a matrix);
* Eigendecomposed: eigenvalues and eigenvectors, from which the roots are formed at each step;
* EigenvalueCorrected (SOAP with QR): only the eigenvectors; Adam/AdaGrad then runs in that eigenbasis;
* KL variants: as RootInv/Eigendecomposed, but each factor accumulates the gradient already preconditioned
  along the other dims.

A failed computation keeps the previous result and warns; more than `num_tolerated_failed_amortized_computations`
consecutive failures of one block raise. NaN/Inf in a factor or in a result raise `PreconditionerValueError`.
"""

import logging
import os
import tempfile
from abc import abstractmethod
from dataclasses import dataclass, field, fields
from fractions import Fraction
from functools import partial
from typing import Any

import torch
from torch import Tensor

from distributed_shampoo.distributor.shampoo_block_info import BlockInfo
from distributed_shampoo.preconditioner.matrix_functions import (
    batched_eigen_inverse_root,
    changes_global_state,
    matrix_eigendecomposition,
    matrix_inverse_root,
    matrix_inverse_root_from_eigendecomposition,
)
from distributed_shampoo.preconditioner.matrix_functions_types import EigenConfig
from distributed_shampoo.preconditioner.preconditioner_list import SecondMomentPreconditionerList, profile_decorator
from distributed_shampoo.shampoo_types import (
    BaseShampooPreconditionerConfig,
    ClassicShampooPreconditionerConfig,
    EigendecomposedShampooPreconditionerConfig,
    EigenvalueCorrectedShampooPreconditionerConfig,
    PreconditionerValueError,
    RootInvShampooPreconditionerConfig,
)
from distributed_shampoo.utils.optimizer_modules import OptimizerModule
from distributed_shampoo.utils.shampoo_utils import compress_list, get_dtype_size, run_on_side_streams

logger: logging.Logger = logging.getLogger(__name__)

SHAMPOO = "shampoo"

# Upper bound on the stacked matrices of one batched eigh (the eigenvectors double it).
_MAX_BATCH_BYTES = 1 << 30
# Factors at most this size are decomposed one by one: for batches of small matrices torch switches to an
# iterative (Jacobi) CUDA solver whose rounding differs from the single-matrix one, and DDP ranks batch different
# subsets, so batching them would break the bitwise DDP == single-device property. Small factors are cheap anyway.
_MIN_BATCHED_EIGH_SIZE = 32


def _chunks_within_bytes(items: list[Any], max_bytes: int) -> list[list[Any]]:
    """Consecutive chunks of (block, j, A) items whose matrices A total at most max_bytes (at least one each)."""
    chunks: list[list[Any]] = []
    size = 0
    for item in items:
        nbytes = item[2].numel() * item[2].element_size()
        if not chunks or size + nbytes > max_bytes:
            chunks.append([])
            size = 0
        chunks[-1].append(item)
        size += nbytes
    return chunks


# ------------------------------------------------------------------------------------------ checkpointed state


@dataclass
class BaseShampooKroneckerFactorsState(OptimizerModule):
    """Checkpointed factor state of one block (`factor_matrix_indices` is bookkeeping, not saved)."""

    factor_matrices: tuple[Tensor, ...]
    factor_matrix_indices: tuple[str, ...]


@dataclass
class RootInvShampooKroneckerFactorsState(BaseShampooKroneckerFactorsState):
    inv_factor_matrices: tuple[Tensor, ...]


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

    `preconditioned_dims_selector[d]` says whether block dim `d` has a factor matrix; `roots[j]` is the root
    (1/exponent) of the j-th factor. Only the fields of the block's variant are filled.
    """

    factor_matrices: tuple[Tensor, ...]
    factor_matrix_indices: tuple[str, ...]
    preconditioned_dims_selector: tuple[bool, ...]
    roots: tuple[Fraction, ...]
    inv_factor_matrices: tuple[Tensor, ...] = ()
    factor_matrices_eigenvectors: tuple[Tensor, ...] = ()
    factor_matrices_eigenvalues: tuple[Tensor, ...] = ()
    corrected_eigenvalues: Tensor | None = None
    failed_amortized_computation_counter: int = field(default=0)


def _local_tensors(value: Tensor | tuple[Tensor, ...], block_info: BlockInfo) -> Tensor | tuple[Tensor, ...]:
    """The local part of one state tensor, or of each tensor of a tuple (see `BlockInfo.get_tensor`)."""
    return tuple(map(block_info.get_tensor, value)) if isinstance(value, tuple) else block_info.get_tensor(value)


def _unwrap(
    block_state: BaseShampooKroneckerFactorsState,
    block_info: BlockInfo,
    selector: tuple[bool, ...],
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
        roots=roots,
        **local_tensors,
    )


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


def _identities_like(
    factor_matrices: tuple[Tensor, ...], block_info: BlockInfo, dtype: torch.dtype, device: torch.device
) -> tuple[Tensor, ...]:
    """One identity matrix per factor matrix: the starting inverse roots or eigenvectors."""
    return tuple(block_info.allocate_eye_tensor(f.shape[0], dtype=dtype, device=device) for f in factor_matrices)


def _save_debug_matrix(matrix: Tensor, factor_matrix_index: str) -> None:
    path = os.path.join(tempfile.gettempdir(), f"{factor_matrix_index.replace('.', '_')}.pt")
    try:
        torch.save(matrix.detach().cpu(), path)
    except Exception as exception:
        logger.warning(f"Could not save the failing factor matrix {factor_matrix_index} to {path}: {exception!r}")


def _raise_if_non_finite(matrices: list[Tensor], indices: list[str], describe: str) -> None:
    """One host sync for the whole list; the error names the first offending factor matrix."""
    if not matrices:
        return
    finite = torch.stack([torch.isfinite(matrix).all() for matrix in matrices]).cpu()
    if bool(finite.all()):
        return
    bad = int((~finite).nonzero()[0])
    matrix, index = matrices[bad], indices[bad]
    if describe == "factor":
        raise PreconditionerValueError(
            f"Encountered nan/inf values in factor matrix {index}! To mitigate, check if nan inputs are being "
            "passed into the network or nan gradients are being passed to the optimizer. For debugging purposes, "
            f"factor_matrix {index}: {torch.min(matrix)=}, {torch.max(matrix)=}."
        )
    _save_debug_matrix(matrix, index)
    raise PreconditionerValueError(f"Encountered nan or inf values in the computed {describe} of factor matrix {index}!")


# -------------------------------------------------------------------------------------------------- list base


class BaseShampooPreconditionerList(SecondMomentPreconditionerList):
    """Factor bookkeeping, factor updates, bias correction and the failure policy shared by every variant.

    Subclasses say which dims are preconditioned and with which root (`_roots_of_block`), what state a block
    holds (`_create_block_state`), what the amortized computation produces and where it goes
    (`_amortized_result`, `_result_tensors`, `_store_amortized_result`) and how a gradient is preconditioned
    (`_precondition_block`); `_factor_update_sources` and `_after_factor_update` are optional.
    """

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
    ) -> None:
        super().__init__(block_list, beta2, weighting_factor, epsilon, use_bias_correction)
        self._preconditioner_config = preconditioner_config
        if num_amortized_computation_streams < 1:
            raise ValueError(f"{num_amortized_computation_streams=} must be at least 1.")
        self._num_amortized_computation_streams = num_amortized_computation_streams

        blocks = []
        for block, block_info in zip(block_list, block_info_list, strict=True):
            param_index, block_id = block_info.composable_block_ids
            selector, roots = self._roots_of_block(block.dim())
            factor_dims = [size for size, selected in zip(block.size(), selector) if selected]
            factor_matrices = tuple(
                block_info.allocate_zeros_tensor(
                    size=(size, size), dtype=preconditioner_config.factor_matrix_dtype, device=block.device
                )
                for size in factor_dims
            )
            indices = tuple(f"{param_index}.{block_id}.{j}" for j in range(len(factor_dims)))
            block_state = self._create_block_state(block, block_info, factor_matrices, indices)
            state[block_info.param][block_id][SHAMPOO] = block_state
            blocks.append(_unwrap(block_state, block_info, selector, roots))
        self._local_blocks: tuple[ShampooKroneckerFactorsUnwrapped, ...] = tuple(blocks)
        self._masked_blocks = self._local_blocks

        self._numel_list = tuple(sum(2 * size * size for size in (f.shape[0] for f in b.factor_matrices)) for b in blocks)
        factor_bytes = get_dtype_size(preconditioner_config.factor_matrix_dtype)
        self._num_bytes_list = tuple(
            numel * (factor_bytes + get_dtype_size(block.dtype)) // 2
            for numel, block in zip(self._numel_list, block_list, strict=True)
        )

    # ---- variant hooks

    @abstractmethod
    def _roots_of_block(self, order: int) -> tuple[tuple[bool, ...], tuple[Fraction, ...]]:
        """(which dims of an order-`order` block are preconditioned, root of each preconditioned dim)."""

    @abstractmethod
    def _create_block_state(
        self, block: Tensor, block_info: BlockInfo, factor_matrices: tuple[Tensor, ...], indices: tuple[str, ...]
    ) -> BaseShampooKroneckerFactorsState: ...

    @abstractmethod
    def _amortized_result(self, A: Tensor, block: ShampooKroneckerFactorsUnwrapped, j: int) -> Any:
        """What the amortized computation produces for factor j from its normalised matrix A."""

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

    # ---- shared algorithm

    def compress_preconditioner_list(self, local_grad_selector: tuple[bool, ...]) -> None:
        self._masked_blocks = compress_list(self._local_blocks, local_grad_selector)

    @profile_decorator
    def update_preconditioners(
        self, masked_grad_list: tuple[Tensor, ...], step: Tensor | int, perform_amortized_computation: bool
    ) -> None:
        self._update_factor_matrices(masked_grad_list)
        self._update_bias_correction2(step)
        self._after_factor_update(masked_grad_list)
        if perform_amortized_computation:
            self._amortized_computation()

    def _after_factor_update(self, masked_grad_list: tuple[Tensor, ...]) -> None:
        """Per-step work that needs the fresh factors (eigenvalue correction)."""

    @profile_decorator
    def _update_factor_matrices(self, masked_grad_list: tuple[Tensor, ...]) -> None:
        """F_k ← beta2·F_k + weighting_factor·(outer product of the gradient over every dim but k)."""
        factors: list[Tensor] = []
        outer_products: list[Tensor] = []
        for grad, block in zip(masked_grad_list, self._masked_blocks, strict=True):
            dims = [d for d, selected in enumerate(block.preconditioned_dims_selector) if selected]
            sources = self._factor_update_sources(grad, block)
            for dim, factor, source in zip(dims, block.factor_matrices, sources, strict=True):
                if source.dim() == 2 and source.dtype == factor.dtype:
                    # Matrix blocks (the common case): one fused kernel, F ← beta2·F + w·X·Xᵀ.
                    rows = source if dim == 0 else source.T
                    factor.addmm_(rows, rows.T, beta=self._beta2, alpha=self._weighting_factor)
                else:
                    factors.append(factor)
                    outer_products.append(_outer_product(source, dim))
        self._accumulate(factors, outer_products)

    def _accumulate(self, statistics: list[Tensor], updates: list[Tensor]) -> None:
        """S ← beta2·S + weighting_factor·U for each pair (the multiply is skipped when beta2 == 1)."""
        if not statistics:
            return
        if self._beta2 != 1.0:
            torch._foreach_mul_(statistics, self._beta2)
        torch._foreach_add_(statistics, updates, alpha=self._weighting_factor)

    def _warm_started_eigendecomposition(
        self, A: Tensor, block: ShampooKroneckerFactorsUnwrapped, j: int
    ) -> tuple[Tensor, Tensor]:
        """(eigenvalues, eigenvectors) of A, starting from factor j's current eigenvectors (QR iterations use them)."""
        return matrix_eigendecomposition(
            A,
            epsilon=self._epsilon,
            eigendecomposition_config=self._preconditioner_config.amortized_computation_config,
            eigenvectors_estimate=block.factor_matrices_eigenvectors[j].to(A.dtype),
        )

    def _normalized_factor(self, factor_matrix: Tensor) -> Tensor:
        matrix = factor_matrix / self._bias_correction2
        if self._preconditioner_config.use_trace_scaling:
            matrix = matrix / torch.sqrt(torch.clamp(torch.trace(matrix), min=self._epsilon))
        return matrix

    @profile_decorator
    def _amortized_computation(self) -> None:
        work = [
            (block, j, self._normalized_factor(factor))
            for block in self._masked_blocks
            for j, factor in enumerate(block.factor_matrices)
        ]
        _raise_if_non_finite(
            [A for _, _, A in work], [block.factor_matrix_indices[j] for block, j, _ in work], "factor"
        )

        results, last_exception = self._amortized_results(work)

        checked = [(tensor, block.factor_matrix_indices[j]) for block, j, result in results for tensor in self._result_tensors(result)]
        _raise_if_non_finite([t for t, _ in checked], [i for _, i in checked], "quantity")
        for block, j, result in results:
            self._store_amortized_result(block, j, result)

        tolerance = self._preconditioner_config.num_tolerated_failed_amortized_computations
        for block in self._masked_blocks:
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

    def _amortized_results(
        self, work: list[tuple[ShampooKroneckerFactorsUnwrapped, int, Tensor]]
    ) -> tuple[list[tuple[ShampooKroneckerFactorsUnwrapped, int, Any]], dict[int, Exception]]:
        """Results of the computations that succeeded, and the last exception of each block that had a failure.

        With several streams (CUDA only) the factors are computed concurrently, one matrix per task, largest
        first so that the big eigendecompositions start early; each result is bitwise the sequential one."""
        device = work[0][2].device if work else torch.device("cpu")
        streams = self._num_amortized_computation_streams
        if changes_global_state(self._preconditioner_config.amortized_computation_config):
            streams = 1  # concurrent threads would race on the flag it flips
        order = list(range(len(work)))
        if streams > 1:
            order.sort(key=lambda i: -work[i][2].shape[0])
        computed = run_on_side_streams([partial(self._try_amortized_result, *work[i]) for i in order], streams, device)
        outcomes: list[Any] = [None] * len(work)
        for i, outcome in zip(order, computed, strict=True):
            outcomes[i] = outcome
        results: list[tuple[ShampooKroneckerFactorsUnwrapped, int, Any]] = []
        last_exception: dict[int, Exception] = {}
        for (block, j, _), outcome in zip(work, outcomes, strict=True):
            if isinstance(outcome, Exception):
                last_exception[id(block)] = outcome
            else:
                results.append((block, j, outcome))
        return results, last_exception

    def _try_amortized_result(self, block: ShampooKroneckerFactorsUnwrapped, j: int, A: Tensor) -> Any:
        """The amortized result for factor j, or the exception it raised (logged, its matrix saved for debugging)."""
        try:
            return self._amortized_result(A, block, j)
        except Exception as exception:
            index = block.factor_matrix_indices[j]
            _save_debug_matrix(A, index)
            logger.warning(
                f"Matrix computation failed for factor matrix {index} with {exception=}. "
                "Using previous computed value instead. To mitigate, increase epsilon or use a more "
                "robust amortized computation config."
            )
            return exception

    @profile_decorator
    def precondition(self, masked_grad_list: tuple[Tensor, ...]) -> tuple[Tensor, ...]:
        return tuple(
            self._precondition_block(grad, block)
            for grad, block in zip(masked_grad_list, self._masked_blocks, strict=True)
        )


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

    def _create_block_state(
        self, block: Tensor, block_info: BlockInfo, factor_matrices: tuple[Tensor, ...], indices: tuple[str, ...]
    ) -> RootInvShampooKroneckerFactorsState:
        dtype = self._preconditioner_config.inv_factor_matrix_dtype
        return RootInvShampooKroneckerFactorsState(
            factor_matrices=factor_matrices,
            factor_matrix_indices=indices,
            inv_factor_matrices=_identities_like(factor_matrices, block_info, dtype, block.device),
        )

    def _amortized_results(
        self, work: list[tuple[ShampooKroneckerFactorsUnwrapped, int, Tensor]]
    ) -> tuple[list[tuple[ShampooKroneckerFactorsUnwrapped, int, Any]], dict[int, Exception]]:
        """With an EigenConfig and one stream, factors of equal size and root share one batched eigh (fewer,
        larger kernels); a batch that fails is redone matrix by matrix, with the per-factor failure policy.
        With several CUDA streams the matrices are decomposed concurrently instead (see the base class)."""
        config = self._preconditioner_config.amortized_computation_config
        concurrent = self._num_amortized_computation_streams > 1 and bool(work) and work[0][2].is_cuda
        if concurrent or not isinstance(config, EigenConfig) or config.eigendecomposition_offload_device:
            return super()._amortized_results(work)
        batches: dict[tuple[Any, ...], list[tuple[ShampooKroneckerFactorsUnwrapped, int, Tensor]]] = {}
        unbatched = []
        for item in work:
            block, j, A = item
            if A.shape[0] <= _MIN_BATCHED_EIGH_SIZE:
                unbatched.append(item)
            else:
                batches.setdefault((A.shape, A.dtype, block.roots[j]), []).append(item)
        results, last_exception = super()._amortized_results(unbatched)
        for (_, _, root), items in batches.items():
            for chunk in _chunks_within_bytes(items, _MAX_BATCH_BYTES):
                try:
                    stacked = torch.stack([A for _, _, A in chunk])
                    roots = batched_eigen_inverse_root(stacked, root, config, self._epsilon)
                    results.extend((block, j, result) for (block, j, _), result in zip(chunk, roots, strict=True))
                except Exception:
                    chunk_results, chunk_exceptions = super()._amortized_results(chunk)
                    results.extend(chunk_results)
                    last_exception.update(chunk_exceptions)
        return results, last_exception

    def _amortized_result(self, A: Tensor, block: ShampooKroneckerFactorsUnwrapped, j: int) -> Tensor:
        return matrix_inverse_root(
            A,
            root=block.roots[j],
            root_inv_config=self._preconditioner_config.amortized_computation_config,
            epsilon=self._epsilon,
        )

    def _result_tensors(self, result: Tensor) -> tuple[Tensor, ...]:
        return (result,)

    def _store_amortized_result(self, block: ShampooKroneckerFactorsUnwrapped, j: int, result: Tensor) -> None:
        block.inv_factor_matrices[j].copy_(result)

    def _block_inverse_roots(self, block: ShampooKroneckerFactorsUnwrapped) -> tuple[Tensor, ...]:
        return block.inv_factor_matrices


class EigendecomposedShampooPreconditionerList(ClassicShampooPreconditionerList):
    """Stores eigenvalues/eigenvectors of each factor; the roots are formed whenever a block is preconditioned."""

    _preconditioner_config: EigendecomposedShampooPreconditionerConfig

    def _create_block_state(
        self, block: Tensor, block_info: BlockInfo, factor_matrices: tuple[Tensor, ...], indices: tuple[str, ...]
    ) -> EigendecomposedShampooKroneckerFactorsState:
        config = self._preconditioner_config
        return EigendecomposedShampooKroneckerFactorsState(
            factor_matrices=factor_matrices,
            factor_matrix_indices=indices,
            factor_matrices_eigenvectors=_identities_like(
                factor_matrices, block_info, config.factor_matrix_eigenvectors_dtype, block.device
            ),
            factor_matrices_eigenvalues=tuple(
                block_info.allocate_ones_tensor(size=(f.shape[0],), dtype=config.factor_matrix_eigenvalues_dtype, device=block.device)
                for f in factor_matrices
            ),
        )

    def _amortized_result(self, A: Tensor, block: ShampooKroneckerFactorsUnwrapped, j: int) -> tuple[Tensor, Tensor]:
        return self._warm_started_eigendecomposition(A, block, j)

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


class EigendecomposedKLShampooPreconditionerList(_KLMixin, EigendecomposedShampooPreconditionerList):
    """KL-Shampoo with eigendecomposed factors."""


# ---------------------------------------------------------------------------------- eigenvalue-corrected Shampoo


class EigenvalueCorrectedShampooPreconditionerList(BaseShampooPreconditionerList):
    """Adam/AdaGrad run in the eigenbasis of the factor matrices (SOAP when the eigenbasis comes from QR).

    Every step the gradient is rotated into the current basis and E ← beta2·E + weighting_factor·G̃² is updated;
    the direction is rotate_back(M̃ / ((E / bias_correction2)^exponent + epsilon)).
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
        self, block: Tensor, block_info: BlockInfo, factor_matrices: tuple[Tensor, ...], indices: tuple[str, ...]
    ) -> EigenvalueCorrectedShampooKroneckerFactorsState:
        config = self._preconditioner_config
        return EigenvalueCorrectedShampooKroneckerFactorsState(
            factor_matrices=factor_matrices,
            factor_matrix_indices=indices,
            factor_matrices_eigenvectors=_identities_like(
                factor_matrices, block_info, config.factor_matrix_eigenvectors_dtype, block.device
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

    def _after_factor_update(self, masked_grad_list: tuple[Tensor, ...]) -> None:
        corrected: list[Tensor] = []
        rotated_squares: list[Tensor] = []
        for grad, block in zip(masked_grad_list, self._masked_blocks, strict=True):
            assert block.corrected_eigenvalues is not None
            corrected.append(block.corrected_eigenvalues)
            rotated_squares.append(self._rotate(grad.to(block.corrected_eigenvalues.dtype), block).square())
        self._accumulate(corrected, rotated_squares)

    def _amortized_result(self, A: Tensor, block: ShampooKroneckerFactorsUnwrapped, j: int) -> Tensor:
        _, eigenvectors = self._warm_started_eigendecomposition(A, block, j)
        return eigenvectors

    def _result_tensors(self, result: Tensor) -> tuple[Tensor, ...]:
        return (result,)

    def _store_amortized_result(self, block: ShampooKroneckerFactorsUnwrapped, j: int, result: Tensor) -> None:
        block.factor_matrices_eigenvectors[j].copy_(result)

    def _precondition_block(self, grad: Tensor, block: ShampooKroneckerFactorsUnwrapped) -> Tensor:
        assert block.corrected_eigenvalues is not None
        rotated = self._rotate(grad.to(block.corrected_eigenvalues.dtype), block)
        denominator = (block.corrected_eigenvalues / self._bias_correction2).pow(self._exponent(grad.dim())).add_(self._epsilon)
        return self._rotate(rotated / denominator, block, back=True).to(grad.dtype)
