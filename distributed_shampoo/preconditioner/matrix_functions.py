"""Matrix roots, eigendecompositions and orthogonalizations used by the preconditioners.

All routines accept a single matrix; `matrix_inverse_root_from_eigendecomposition` also accepts a batch
(leading dims). `NUMERICAL_FAILURES` lists the exceptions that mean "this matrix could not be handled
accurately"; callers fall back only on those.
"""

import enum
import functools
import inspect
import logging
import threading
from collections.abc import Callable
from fractions import Fraction
from typing import Any, TypeVar

import torch
from torch import Tensor

from distributed_shampoo.preconditioner.matrix_functions_types import (
    CoupledHigherOrderConfig,
    CoupledNewtonConfig,
    DefaultEigendecompositionConfig,
    DefaultEigenConfig,
    DefaultNewtonSchulzOrthogonalizationConfig,
    DefaultPerturbationConfig,
    EigenConfig,
    EigendecompositionConfig,
    EighEigendecompositionConfig,
    MatrixFunctionConfig,
    NewtonSchulzOrthogonalizationConfig,
    OrthogonalizationConfig,
    PerturbationConfig,
    PseudoInverseConfig,
    QREigendecompositionConfig,
    RankDeficientStabilityConfig,
    RootInvConfig,
    SVDOrthogonalizationConfig,
)
from distributed_shampoo.utils.shampoo_utils import ContinueOnCaller

logger: logging.Logger = logging.getLogger(__name__)

FuncT = TypeVar("FuncT", bound=Callable[..., Any])


# The exceptions that report a numerical failure, as opposed to a bug or a runtime problem: torch.linalg raises
# LinAlgError when LAPACK/cuSOLVER report that a decomposition did not converge, and the iterative roots below raise
# ArithmeticError when their result is inaccurate or not finite. Only these trigger the float64 retry of `eigh` and
# the keep-the-previous-root policy of the preconditioners; anything else propagates.
NUMERICAL_FAILURES: tuple[type[Exception], ...] = (torch.linalg.LinAlgError, ArithmeticError)


class NewtonConvergenceFlag(enum.Enum):
    REACHED_MAX_ITERS = 0
    CONVERGED = 1
    EARLY_STOP = 2


def _check_2d_tensor(func: FuncT) -> FuncT:
    """Decorator: the first argument must be a 2-D tensor."""

    @functools.wraps(func)
    def wrapper(A: Tensor, *args: Any, **kwargs: Any) -> Any:
        if A.dim() != 2:
            raise ValueError(f"Matrix is not 2-dimensional! {A.shape=}")
        return func(A, *args, **kwargs)

    return wrapper  # type: ignore[return-value]


def _check_square_matrix(func: FuncT) -> FuncT:
    """Decorator: the first argument must be a square 2-D tensor."""

    @functools.wraps(func)
    @_check_2d_tensor
    def wrapper(A: Tensor, *args: Any, **kwargs: Any) -> Any:
        if A.shape[0] != A.shape[1]:
            raise ValueError(f"Matrix is not square! {A.shape=}")
        return func(A, *args, **kwargs)

    return wrapper  # type: ignore[return-value]


def _matrix_perturbation(A: Tensor, epsilon: float = 0.0, is_eigenvalues: bool = False, in_place: bool = False) -> Tensor:
    """A + epsilon·I (a new tensor, or A itself modified with `in_place`), or eigenvalues + epsilon when
    `is_eigenvalues`."""
    if is_eigenvalues:
        return A + epsilon
    # Adding to the diagonal of a copy gives the same numbers as A + epsilon·eye without a second d×d temporary.
    perturbed = A if in_place else A.clone()
    perturbed.diagonal(dim1=-2, dim2=-1).add_(epsilon)
    return perturbed


def eigh_workspace_elements(dimension: int) -> int:
    """Elements of the work array of a symmetric eigendecomposition with eigenvectors by divide and conquer:
    1 + 6n + 4n², twice the n² term of LAPACK's minimum for `syevd` (1 + 6n + 2n²), because cuSOLVER's is larger:
    `bench/bench_shampoo_step.py` measured one fp32 3072×3072 root computation at 218.0 MiB above the state on
    an H200 (torch 2.11, CUDA 13), 6.06 n² elements, of which the copy, eigenvectors and eigenvalues are 2 n²."""
    return 1 + 6 * dimension + 4 * dimension * dimension


# Upper estimates of the live d×d temporaries of the iterative methods, in units of d² (identity, ridge-regularised
# copy, iterates X and M, the step matrix, matrix_power's intermediates, the residual).
_QR_ITERATION_TEMPORARIES = 7
_COUPLED_ITERATION_TEMPORARIES = 10


def matrix_function_temporary_elements(config: MatrixFunctionConfig, dimension: int) -> int:
    """Estimated peak elements that computing with `config` on a d×d input allocates besides the input itself
    (which may be perturbed in place). An eigendecomposition holds the eigenvectors, the eigenvalues and the
    solver's work array; the iterative methods several d×d iterates."""
    squared = dimension * dimension
    if isinstance(config, EighEigendecompositionConfig):
        return squared + dimension + eigh_workspace_elements(dimension)
    if isinstance(config, QREigendecompositionConfig):
        return _QR_ITERATION_TEMPORARIES * squared
    if isinstance(config, (CoupledNewtonConfig, CoupledHigherOrderConfig)):
        return _COUPLED_ITERATION_TEMPORARIES * squared
    raise NotImplementedError(f"No memory estimate for {type(config).__name__}.")


# Devices on which this process has already made its first linear-algebra call (see `load_linalg_library`).
_LINALG_LOADED: set[torch.device] = set()
_LINALG_LOADED_LOCK = threading.Lock()


def load_linalg_library(device: torch.device) -> None:
    """Make torch load its linear-algebra kernels for `device` now, from the calling thread.

    CUDA builds of torch load the library behind `torch.linalg` lazily, in the first linalg call of the process,
    and that first call is not thread safe: a thread entering it while another one is loading fails with
    `RuntimeError('lazy wrapper should be called at most once')`. Call this before starting threads that
    decompose matrices. One small `eigh` loads every linalg kernel (QR and the others too); later calls return
    at once. No effect off CUDA.
    """
    if device.type != "cuda":
        return
    with _LINALG_LOADED_LOCK:
        if device in _LINALG_LOADED:
            return
        torch.linalg.eigh(torch.eye(2, device=device))
        _LINALG_LOADED.add(device)


def _assign_function_args_from_config(func: Callable[..., Any], config: MatrixFunctionConfig) -> dict[str, Any]:
    """The config fields whose names are parameters of `func`, as keyword arguments."""
    names = inspect.signature(func).parameters
    return {name: getattr(config, name) for name in names if hasattr(config, name)}


# ---------------------------------------------------------------------------------------- eigendecomposition


def _stable_eigenvalues(
    L: Tensor, epsilon: float, rank_deficient_stability_config: RankDeficientStabilityConfig
) -> Tensor:
    """Eigenvalues made safe to raise to a negative power (no host sync)."""
    if isinstance(rank_deficient_stability_config, PerturbationConfig):
        lambda_min = L.amin(dim=-1, keepdim=True)
        if rank_deficient_stability_config.perturb_before_computation:
            # epsilon·I was already added; if round-off still left λ_min < epsilon, lift the spectrum.
            return torch.where(lambda_min < epsilon, L - lambda_min + epsilon, L)
        return L - lambda_min.clamp(max=0.0) + epsilon
    raise NotImplementedError(f"{rank_deficient_stability_config=} is not supported.")


def matrix_inverse_root_from_eigendecomposition(
    L: Tensor,
    Q: Tensor,
    root: Fraction,
    epsilon: float = 0.0,
    rank_deficient_stability_config: RankDeficientStabilityConfig = DefaultPerturbationConfig,
) -> Tensor:
    """Q·diag(L^(-1/root))·Qᵀ with the eigenvalues stabilised by the given policy (batched over leading dims)."""
    exponent = -1.0 / float(root)
    if isinstance(rank_deficient_stability_config, PseudoInverseConfig):
        if epsilon != 0.0:
            raise ValueError(f"{epsilon=} must be 0.0 when using PseudoInverseConfig.")
        rtol = rank_deficient_stability_config.rank_rtol
        if rtol is None:
            rtol = L.shape[-1] * torch.finfo(L.dtype).eps
        threshold = torch.clamp(rtol * L.relu().amax(dim=-1, keepdim=True), min=rank_deficient_stability_config.rank_atol)
        inv_root = torch.where(L <= threshold, torch.zeros_like(L), L.pow(exponent))
    else:
        inv_root = _stable_eigenvalues(L, epsilon, rank_deficient_stability_config).pow(exponent)
    return (Q * inv_root.unsqueeze(-2)) @ Q.mT


def _off_diagonal_small(B: Tensor, tolerance: float) -> bool:
    """True when the off-diagonal Frobenius norm of B is at most tolerance·‖B‖_F (one host sync)."""
    total = torch.linalg.matrix_norm(B)
    off_diagonal = torch.sqrt((total.square() - B.diagonal().square().sum()).clamp(min=0.0))
    return bool(off_diagonal <= tolerance * total)


def _eigh_with_retry(
    A: Tensor, retry_double_precision: bool, eigendecomposition_offload_device: str
) -> tuple[Tensor, Tensor]:
    device = A.device
    work = A.to(eigendecomposition_offload_device) if eigendecomposition_offload_device else A
    try:
        L, Q = torch.linalg.eigh(work)
    except torch.linalg.LinAlgError as exception:  # non-convergence only: other errors are not cured by float64
        if not retry_double_precision or work.dtype == torch.float64:
            raise
        logger.warning(f"Failed to compute eigendecomposition in {work.dtype} precision with {exception=}. Retrying in float64.")
        L, Q = torch.linalg.eigh(work.double())
    return L.to(dtype=A.dtype, device=device), Q.to(dtype=A.dtype, device=device)


def _qr_iterations(A: Tensor, Q: Tensor, tolerance: float, max_iterations: int) -> tuple[Tensor, Tensor]:
    """Orthogonal iterations from the estimate Q; eigenvalues ascending with matching columns."""
    B = Q.T @ A @ Q
    for _ in range(max_iterations):
        if _off_diagonal_small(B, tolerance):
            break
        Qi, Ri = torch.linalg.qr(B)
        B = Ri @ Qi
        Q = Q @ Qi
    L, order = torch.sort(B.diagonal(), stable=True)
    return L, Q[:, order]


@_check_square_matrix
def matrix_eigendecomposition(
    A: Tensor,
    epsilon: float = 0.0,
    eigendecomposition_config: EigendecompositionConfig = DefaultEigendecompositionConfig,
    eigenvectors_estimate: Tensor | None = None,
    *,
    overwrite_input: bool = False,
) -> tuple[Tensor, Tensor]:
    """Eigenvalues (ascending) and eigenvectors of the symmetric matrix A (+ epsilon·I when perturbing first).

    With `overwrite_input` the perturbation is added to A itself instead of a copy (same numbers, one d×d
    temporary less); A's content is then unspecified.
    """
    if not isinstance(eigendecomposition_config, (EighEigendecompositionConfig, QREigendecompositionConfig)):
        raise NotImplementedError(
            f"Eigendecomposition config {type(eigendecomposition_config).__name__} is not implemented."
        )
    stability = eigendecomposition_config.rank_deficient_stability_config
    if isinstance(stability, PseudoInverseConfig) and epsilon != 0.0:
        raise ValueError(f"{epsilon=} must be 0.0 when using PseudoInverseConfig.")
    if isinstance(stability, PerturbationConfig) and stability.perturb_before_computation:
        A = _matrix_perturbation(A, epsilon, in_place=overwrite_input)
    tolerance = eigendecomposition_config.tolerance

    if isinstance(eigendecomposition_config, EighEigendecompositionConfig):
        if tolerance != 0.0:
            if eigenvectors_estimate is None:
                raise ValueError(
                    "An eigenvectors_estimate is required when the eigendecomposition tolerance is non-zero "
                    f"({tolerance=})."
                )
            B = eigenvectors_estimate.T @ A @ eigenvectors_estimate
            if _off_diagonal_small(B, tolerance):
                return B.diagonal(), eigenvectors_estimate
        return _eigh_with_retry(
            A,
            eigendecomposition_config.retry_double_precision,
            eigendecomposition_config.eigendecomposition_offload_device,
        )
    assert eigenvectors_estimate is not None, "QR iterations need an eigenvectors_estimate."
    return _qr_iterations(A, eigenvectors_estimate, tolerance, eigendecomposition_config.max_iterations)


# --------------------------------------------------------------------------------------------- inverse roots


def _coupled_newton_inverse_root(A: Tensor, root: int, epsilon: float, max_iterations: int, tolerance: float) -> Tensor:
    """Coupled Newton iteration: X → A_r^(-1/root) while M = X^root·A_r → I."""
    alpha = -1.0 / root
    identity = torch.eye(A.shape[0], dtype=A.dtype, device=A.device)
    A_ridge = A + epsilon * identity
    z = (root + 1) / (2 * torch.linalg.matrix_norm(A_ridge))
    X = z ** (1 / root) * identity
    M = z * A_ridge
    error = torch.dist(M, identity, p=torch.inf)
    iteration = 0
    while error > tolerance and iteration < max_iterations:
        M_step = (1 - alpha) * identity + alpha * M
        X = X @ M_step
        M = torch.linalg.matrix_power(M_step, root) @ M
        error = torch.dist(M, identity, p=torch.inf)
        iteration += 1
    if error > tolerance:
        logger.warning(f"Newton did not converge and reached maximum number of iterations ({max_iterations}).")
    return X


def _max_abs(matrix: Tensor) -> Tensor:
    return matrix.abs().max()


def _coupled_higher_order_inverse_root(
    A: Tensor,
    root: Fraction,
    rel_epsilon: float,
    abs_epsilon: float,
    max_iterations: int,
    tolerance: float,
    order: int,
    disable_tf32: bool,
) -> Tensor:
    """A^(-1/root) by a coupled iteration of the given order (after Lakić), for root = p/q.

    X converges to A_r^(-1/p) while M = X^p·A_r converges to I; each step multiplies X by the binomial series of
    M^(-1/p) = (I - (I - M))^(-1/p) truncated after `order` terms, and X^q is returned. The iterates are
    polynomials in A_r, so they commute and stay symmetric.
    """
    p, q = root.numerator, root.denominator
    if abs(p) >= 10 and abs(q) >= 10:
        logger.warning(f"{p=} and {q=} are probably too big for good performance.")
    tf32_flag = torch.backends.cuda.matmul.allow_tf32
    if disable_tf32:
        torch.backends.cuda.matmul.allow_tf32 = False
    try:
        identity = torch.eye(A.shape[0], dtype=A.dtype, device=A.device)
        norm_inf = torch.linalg.matrix_norm(A, ord=torch.inf)
        if not torch.isfinite(norm_inf):
            raise ArithmeticError(f"Input matrix has entries close to inf: {norm_inf=}.")
        A_ridge = A + torch.clamp(rel_epsilon * norm_inf, min=abs_epsilon) * identity

        # Start with one coupled Newton step. The Frobenius norm bounds the largest eigenvalue, so z·A_ridge has
        # its spectrum in (0, (p+1)/2], and the Newton step maps any spectrum in (0, p+1) into (0, 1]. From there
        # every eigenvalue of M rises monotonically to 1 under the truncated series (all its terms are positive),
        # so the error below cannot grow except by rounding.
        z = (p + 1) / (2 * torch.linalg.matrix_norm(A_ridge))
        X = z ** (1.0 / p) * identity
        M = z * A_ridge
        newton_step = (1 + 1 / p) * identity - M / p
        X = X @ newton_step
        M = torch.linalg.matrix_power(newton_step, p) @ M
        # Largest entry of I - M: since I - M is positive semi-definite here, it sits on the diagonal and
        # decreases with every step (row sums of a dense matrix can grow while the iteration converges).
        error = _max_abs(M - identity)

        # Coefficients of the binomial series (1 - t)^(-1/p) = Σ_k a_k t^k, up to degree `order - 1`.
        coefficients = [1.0]
        for k in range(1, order):
            coefficients.append(coefficients[-1] * (1.0 / p + k - 1) / k)
        flag = NewtonConvergenceFlag.REACHED_MAX_ITERS
        for _ in range(max_iterations):
            if error <= tolerance:
                flag = NewtonConvergenceFlag.CONVERGED
                break
            T = identity - M
            step = coefficients[-1] * identity
            for coefficient in reversed(coefficients[:-1]):  # Horner
                step = coefficient * identity + T @ step
            X = X @ step
            M = torch.linalg.matrix_power(step, p) @ M
            new_error = _max_abs(M - identity)
            if new_error > 1.2 * error or (new_error == error and error < 1e-3):  # diverging or stagnating
                flag = NewtonConvergenceFlag.EARLY_STOP
                error = new_error
                break
            error = new_error
        else:
            if error <= tolerance:
                flag = NewtonConvergenceFlag.CONVERGED
        if flag == NewtonConvergenceFlag.REACHED_MAX_ITERS:
            logger.warning(
                f"Higher-order iteration did not converge and reached maximum number of iterations ({max_iterations})."
            )
        residual = _max_abs(A_ridge @ torch.linalg.matrix_power(X, p) - identity)
        if residual > 0.1:
            raise ArithmeticError(
                f"Error in matrix inverse root (before powering for fractions) {residual=} exceeds threshold 0.1."
            )
        if q > 1:
            X = torch.linalg.matrix_power(X, q)
        if not torch.isfinite(X).all():
            raise ArithmeticError("NaN/Inf in matrix inverse root (after powering for fractions).")
        return X
    finally:
        torch.backends.cuda.matmul.allow_tf32 = tf32_flag


def changes_global_state(config: MatrixFunctionConfig) -> bool:
    """Whether computing with `config` flips process-wide torch flags (so must not run from several threads)."""
    return isinstance(config, CoupledHigherOrderConfig) and config.disable_tf32  # allow_tf32, see above


@_check_square_matrix
def matrix_inverse_root(
    A: Tensor,
    root: Fraction,
    root_inv_config: RootInvConfig = DefaultEigenConfig,
    epsilon: float = 0.0,
    *,
    overwrite_input: bool = False,
    defer_product: bool = False,
) -> Tensor | ContinueOnCaller[Tensor]:
    """A^(-1/root) for a symmetric positive semi-definite A, by the method `root_inv_config` names.

    With `overwrite_input` the eigh path perturbs A in place (see `matrix_eigendecomposition`). With
    `defer_product` it returns, after the eigendecomposition, the remaining product Q·diag(λ^(-1/root))·Qᵀ as a
    `ContinueOnCaller` (so that a side-stream task leaves its only matmul to the calling thread; the numbers are
    the same); the iterative methods return the root itself.
    """
    root = Fraction(root)
    if isinstance(root_inv_config, EigenConfig):
        if root <= 0:
            raise ValueError(f"Root {root} should be positive!")
        L, Q = matrix_eigendecomposition(
            A, epsilon=epsilon, eigendecomposition_config=root_inv_config, overwrite_input=overwrite_input
        )
        product = functools.partial(
            matrix_inverse_root_from_eigendecomposition,
            root=root,
            epsilon=epsilon,
            rank_deficient_stability_config=root_inv_config.rank_deficient_stability_config,
        )
        return ContinueOnCaller(product, (L, Q)) if defer_product else product(L, Q)
    if isinstance(root_inv_config, CoupledNewtonConfig):
        if root.denominator != 1:
            raise ValueError(f"{root.denominator=} must be equal to 1 to use coupled Newton iteration!")
        return _coupled_newton_inverse_root(
            A, root.numerator, epsilon, **_assign_function_args_from_config(_coupled_newton_inverse_root, root_inv_config)
        )
    if isinstance(root_inv_config, CoupledHigherOrderConfig):
        return _coupled_higher_order_inverse_root(
            A, root, **_assign_function_args_from_config(_coupled_higher_order_inverse_root, root_inv_config)
        )
    raise NotImplementedError(f"Root inverse config is not implemented! {root_inv_config=}")


# ---------------------------------------------------------------------------------------- orthogonalization


def _newton_schulz(A: Tensor, num_iterations: int, coefficients: tuple[float, float, float]) -> Tensor:
    a, b, c = coefficients
    X = A / torch.linalg.matrix_norm(A).clamp(min=1e-8)
    transposed = A.shape[0] < A.shape[1]
    if transposed:
        X = X.T
    for _ in range(num_iterations):
        B = X.T @ X
        B = b * B + c * B @ B
        X = a * X + X @ B
    return X.T if transposed else X


@_check_2d_tensor
def matrix_orthogonalization(
    A: Tensor, orthogonalization_config: OrthogonalizationConfig = DefaultNewtonSchulzOrthogonalizationConfig
) -> Tensor:
    """The orthogonal factor U·Vᵀ of A (exactly by SVD, or approximately by Newton–Schulz), scaled."""
    if not isinstance(orthogonalization_config, (SVDOrthogonalizationConfig, NewtonSchulzOrthogonalizationConfig)):
        raise NotImplementedError(f"Orthogonalization config is not implemented! {orthogonalization_config=}")
    scaling = orthogonalization_config.scale_by_dims_fn(d_in=A.shape[1], d_out=A.shape[0])
    if isinstance(orthogonalization_config, SVDOrthogonalizationConfig):
        U, S, Vh = torch.linalg.svd(A, full_matrices=False)
        result = U @ Vh
        if orthogonalization_config.scale_by_nuclear_norm:
            result = result * S.sum()
        return result * scaling
    return _newton_schulz(A, **_assign_function_args_from_config(_newton_schulz, orthogonalization_config)) * scaling
