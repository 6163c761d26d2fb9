"""Matrix roots, eigendecompositions and orthogonalizations against closed forms and eigh in float64."""

import logging
from fractions import Fraction
from unittest import mock

import pytest
import torch

from distributed_shampoo.preconditioner.matrix_functions import (
    _matrix_perturbation,
    matrix_eigendecomposition,
    matrix_inverse_root,
    matrix_inverse_root_from_eigendecomposition,
    matrix_orthogonalization,
)
from distributed_shampoo.preconditioner.matrix_functions_types import (
    CoupledHigherOrderConfig,
    CoupledNewtonConfig,
    EigenConfig,
    EighEigendecompositionConfig,
    NewtonSchulzOrthogonalizationConfig,
    PerturbationConfig,
    PseudoInverseConfig,
    QREigendecompositionConfig,
    RootInvConfig,
    SVDOrthogonalizationConfig,
)

ILL_CONDITIONED = torch.tensor([[1195.0, -944.0, -224.0], [-944.0, 746.0, 177.0], [-224.0, 177.0, 42.0]], dtype=torch.float64)


def eigh_power(A: torch.Tensor, exponent: float) -> torch.Tensor:
    L, Q = torch.linalg.eigh(A)
    return Q @ torch.diag(L**exponent) @ Q.T


def test_shape_checks() -> None:
    with pytest.raises(ValueError, match="not 2-dimensional"):
        matrix_inverse_root(torch.ones(3), Fraction(2))
    with pytest.raises(ValueError, match="not square"):
        matrix_inverse_root(torch.ones(2, 3), Fraction(2))
    with pytest.raises(ValueError, match="not square"):
        matrix_eigendecomposition(torch.ones(2, 3))
    with pytest.raises(ValueError, match="not 2-dimensional"):
        matrix_orthogonalization(torch.ones(2, 2, 2))


def test_matrix_perturbation() -> None:
    torch.testing.assert_close(_matrix_perturbation(torch.eye(2), epsilon=0.1), 1.1 * torch.eye(2))
    torch.testing.assert_close(_matrix_perturbation(torch.ones(3), epsilon=0.1, is_eigenvalues=True), torch.full((3,), 1.1))


def test_inverse_root_from_eigendecomposition_examples() -> None:
    L, Q = torch.tensor([0.1, 3.1]), torch.eye(2)
    result = matrix_inverse_root_from_eigendecomposition(L, Q, Fraction(2), 1.0, PerturbationConfig(perturb_before_computation=True))
    torch.testing.assert_close(result, torch.diag(torch.tensor([1.0, 0.5])))
    # Perturbing afterwards: L - min(λ_min, 0) + eps = [1.1, 4.1].
    result = matrix_inverse_root_from_eigendecomposition(L, Q, Fraction(2), 1.0, PerturbationConfig(perturb_before_computation=False))
    torch.testing.assert_close(result, torch.diag(torch.tensor([1.1, 4.1]) ** -0.5))
    pseudo = matrix_inverse_root_from_eigendecomposition(torch.tensor([1.0, 4.0, 0.0]), torch.eye(3), Fraction(2), 0.0, PseudoInverseConfig(rank_rtol=None))
    torch.testing.assert_close(pseudo, torch.diag(torch.tensor([1.0, 0.5, 0.0])))
    large = matrix_inverse_root_from_eigendecomposition(torch.tensor([1e30, 1e35]), torch.eye(2), Fraction(4), 1e-12)
    assert torch.isfinite(large).all()
    with pytest.raises(ValueError, match="must be 0.0 when using PseudoInverseConfig"):
        matrix_inverse_root_from_eigendecomposition(L, Q, Fraction(2), 0.1, PseudoInverseConfig())
    with pytest.raises(NotImplementedError):
        matrix_inverse_root_from_eigendecomposition(L, Q, Fraction(2), 0.1, object())  # type: ignore[arg-type]


ROOT_CONFIGS = [
    EigenConfig(),
    EigenConfig(rank_deficient_stability_config=PerturbationConfig(perturb_before_computation=False)),
    EigenConfig(retry_double_precision=False),
    CoupledNewtonConfig(max_iterations=1000, tolerance=1e-12),
    *[CoupledHigherOrderConfig(rel_epsilon=0.0, abs_epsilon=0.0, order=order, tolerance=1e-12) for order in range(2, 7)],
]


@pytest.mark.parametrize("config", ROOT_CONFIGS, ids=repr)
@pytest.mark.parametrize("exponent", [1, 2])
@pytest.mark.parametrize("A", [torch.diag(torch.tensor([1.0, 4.0], dtype=torch.float64)), ILL_CONDITIONED], ids=["diag", "3x3"])
def test_matrix_inverse_root_methods(config: RootInvConfig, exponent: int, A: torch.Tensor) -> None:
    """X = A^(-1/root) with root = 2/exponent, so X^exponent is A^(-1/2)^... checked as X^(2/exponent)·A = I."""
    root = Fraction(2, exponent)
    if isinstance(config, CoupledNewtonConfig) and root.denominator != 1:
        pytest.skip("coupled Newton needs an integer root")
    X = matrix_inverse_root(A, root, config, epsilon=0.0)
    torch.testing.assert_close(X, eigh_power(A, -float(1 / root)), atol=0.05, rtol=1e-2)


@pytest.mark.parametrize("n", [10, 100])
@pytest.mark.parametrize("root", [1, 2, 4, 8])
def test_eigen_root_of_identity_and_tridiagonal(n: int, root: int) -> None:
    identity = torch.eye(n, dtype=torch.float64)
    torch.testing.assert_close(matrix_inverse_root(identity, Fraction(root)), identity)
    tridiagonal = 2 * identity - torch.diag(torch.ones(n - 1, dtype=torch.float64), 1) - torch.diag(torch.ones(n - 1, dtype=torch.float64), -1)
    tridiagonal += 0.5 * identity
    X = matrix_inverse_root(tridiagonal, Fraction(root))
    expected = eigh_power(tridiagonal, -1.0 / root)
    assert (torch.linalg.norm(X - expected) / torch.linalg.norm(expected)) <= 1e-4


def test_rank_deficient_matrices() -> None:
    A = torch.tensor([[1.0, 0.0], [0.0, 0.0]], dtype=torch.float64)
    assert torch.isinf(matrix_inverse_root(A, Fraction(2), EigenConfig(), epsilon=0.0)).any()
    pseudo = EigenConfig(rank_deficient_stability_config=PseudoInverseConfig())
    torch.testing.assert_close(matrix_inverse_root(A, Fraction(2), pseudo, epsilon=0.0), A)


def test_argument_errors() -> None:
    with pytest.raises(ValueError, match="should be positive"):
        matrix_inverse_root(torch.eye(2), Fraction(-1))
    with pytest.raises(ValueError, match="denominator=2 must be equal to 1"):
        matrix_inverse_root(torch.eye(2), Fraction(1, 2), CoupledNewtonConfig())
    with pytest.raises(NotImplementedError, match="Root inverse config is not implemented"):
        matrix_inverse_root(torch.eye(2), Fraction(2), object())  # type: ignore[arg-type]
    with pytest.raises(NotImplementedError, match="not implemented"):
        matrix_eigendecomposition(torch.eye(2), eigendecomposition_config=object())  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="eigenvectors_estimate is required"):
        matrix_eigendecomposition(torch.eye(2), eigendecomposition_config=EighEigendecompositionConfig(tolerance=0.1))
    with pytest.raises(NotImplementedError, match="not implemented"):
        matrix_orthogonalization(torch.eye(2), object())  # type: ignore[arg-type]


def test_higher_order_errors_and_tf32_flag_restored() -> None:
    previous = torch.backends.cuda.matmul.allow_tf32
    with pytest.raises(ArithmeticError, match="close to inf"):
        matrix_inverse_root(torch.tensor([[float("inf"), 0.0], [0.0, 1.0]]), Fraction(2), CoupledHigherOrderConfig(rel_epsilon=0.0, abs_epsilon=0.0))
    assert torch.backends.cuda.matmul.allow_tf32 == previous
    with pytest.raises(ArithmeticError, match="exceeds threshold"):
        # One iteration from a badly scaled start cannot reach the 0.1 residual.
        matrix_inverse_root(ILL_CONDITIONED, Fraction(2), CoupledHigherOrderConfig(rel_epsilon=0.0, abs_epsilon=0.0, max_iterations=1))
    assert torch.backends.cuda.matmul.allow_tf32 == previous


@pytest.mark.parametrize("root", [Fraction(1), Fraction(2), Fraction(4), Fraction(4, 3)])
@pytest.mark.parametrize("order", [2, 3, 6])
def test_coupled_higher_order_is_accurate_on_a_well_conditioned_dense_matrix(root: Fraction, order: int) -> None:
    """Condition number 12, 50×50, eigenvectors a random rotation: A^(-1/root) to 1e-8 of its largest entry.

    Measuring convergence by row sums of M - I (which grow while a dense M converges) stopped this iteration
    early with a residual of about 2."""
    generator = torch.Generator().manual_seed(0)
    rotation, _ = torch.linalg.qr(torch.randn(50, 50, generator=generator, dtype=torch.float64))
    eigenvalues = torch.linspace(1.0, 12.0, 50, dtype=torch.float64)
    A = rotation @ torch.diag(eigenvalues) @ rotation.T
    expected = rotation @ torch.diag(eigenvalues ** (-1.0 / float(root))) @ rotation.T
    got = matrix_inverse_root(A, root, CoupledHigherOrderConfig(rel_epsilon=0.0, abs_epsilon=0.0, order=order))
    assert (got - expected).abs().max() <= 1e-8 * expected.abs().max()


def test_iteration_limits_warn(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING):
        matrix_inverse_root(ILL_CONDITIONED, Fraction(2), CoupledNewtonConfig(max_iterations=2))
    assert "Newton did not converge" in caplog.text
    caplog.clear()
    with caplog.at_level(logging.WARNING):
        matrix_inverse_root(torch.eye(2, dtype=torch.float64), Fraction(13, 15), CoupledHigherOrderConfig(rel_epsilon=0.0, abs_epsilon=0.0))
    assert "p=13 and q=15" in caplog.text


def _not_converged() -> torch.linalg.LinAlgError:
    return torch.linalg.LinAlgError("linalg.eigh: The algorithm failed to converge because the input matrix is ill-conditioned")


def test_eigh_retry_in_double_precision(caplog: pytest.LogCaptureFixture) -> None:
    real_eigh = torch.linalg.eigh
    with mock.patch.object(torch.linalg, "eigh", side_effect=_not_converged()) as patched:
        with pytest.raises(torch.linalg.LinAlgError):
            matrix_inverse_root(torch.eye(2), Fraction(2), EigenConfig(retry_double_precision=False))
        assert patched.call_count == 1
    with mock.patch.object(torch.linalg, "eigh", side_effect=_not_converged()) as patched:
        with pytest.raises(torch.linalg.LinAlgError):
            matrix_inverse_root(torch.eye(2), Fraction(2), EigenConfig())
        assert patched.call_count == 2
    with caplog.at_level(logging.WARNING):
        with mock.patch.object(torch.linalg, "eigh", side_effect=[_not_converged(), real_eigh(torch.eye(2, dtype=torch.float64))]):
            result = matrix_inverse_root(torch.eye(2), Fraction(2), EigenConfig())
    assert result.dtype == torch.float32
    torch.testing.assert_close(result, torch.eye(2))
    assert "Retrying in float64" in caplog.text


def test_a_runtime_error_is_not_retried_in_double_precision(caplog: pytest.LogCaptureFixture) -> None:
    """What a race in torch's lazy CUDA linalg loading raised: not a numerical failure, so it must propagate."""
    lazy_loading_race = RuntimeError("lazy wrapper should be called at most once")
    with caplog.at_level(logging.WARNING):
        with mock.patch.object(torch.linalg, "eigh", side_effect=[lazy_loading_race, torch.linalg.eigh(torch.eye(2))]) as patched:
            with pytest.raises(RuntimeError, match="lazy wrapper"):
                matrix_inverse_root(torch.eye(2), Fraction(2), EigenConfig())
    assert patched.call_count == 1
    assert "Retrying in float64" not in caplog.text


def test_eigendecomposition_methods() -> None:
    L, Q = matrix_eigendecomposition(ILL_CONDITIONED)
    # The published optimizer's values (≈ 2.9009e-3, 1.7424e-1, 1.98282e3) came from float32; the smallest is ill-conditioned.
    torch.testing.assert_close(L, torch.tensor([2.9009e-3, 1.7424e-1, 1.98282e3], dtype=torch.float64), rtol=2e-3, atol=0)
    torch.testing.assert_close(Q @ torch.diag(L) @ Q.T, ILL_CONDITIONED)
    L_offloaded, _ = matrix_eigendecomposition(ILL_CONDITIONED, eigendecomposition_config=EighEigendecompositionConfig(eigendecomposition_offload_device="cpu"))
    torch.testing.assert_close(L_offloaded, L)
    L_perturbed, _ = matrix_eigendecomposition(ILL_CONDITIONED, epsilon=1.0)
    torch.testing.assert_close(L_perturbed, L + 1.0)
    L_not_perturbed, _ = matrix_eigendecomposition(
        ILL_CONDITIONED, epsilon=1.0, eigendecomposition_config=EighEigendecompositionConfig(rank_deficient_stability_config=PerturbationConfig(perturb_before_computation=False))
    )
    torch.testing.assert_close(L_not_perturbed, L)

    # With a tolerance and a good estimate, eigh is skipped.
    with mock.patch.object(torch.linalg, "eigh") as patched:
        L_estimate, Q_estimate = matrix_eigendecomposition(
            ILL_CONDITIONED, eigendecomposition_config=EighEigendecompositionConfig(tolerance=1e-6), eigenvectors_estimate=Q
        )
        patched.assert_not_called()
    torch.testing.assert_close(L_estimate, L)
    assert Q_estimate is Q

    # QR iterations converge from the identity.
    L_qr, Q_qr = matrix_eigendecomposition(
        ILL_CONDITIONED, eigendecomposition_config=QREigendecompositionConfig(max_iterations=10_000), eigenvectors_estimate=torch.eye(3, dtype=torch.float64)
    )
    torch.testing.assert_close(L_qr, L, rtol=1e-6, atol=1e-9)
    torch.testing.assert_close((Q_qr * Q).sum(0).abs(), torch.ones(3, dtype=torch.float64))


def test_orthogonalization() -> None:
    A = torch.diag(torch.tensor([1.0, 4.0]))
    torch.testing.assert_close(matrix_orthogonalization(A, SVDOrthogonalizationConfig()), torch.eye(2))
    torch.testing.assert_close(matrix_orthogonalization(A, SVDOrthogonalizationConfig(scale_by_nuclear_norm=True)), 5 * torch.eye(2))
    scaled = SVDOrthogonalizationConfig(scale_by_dims_fn=lambda d_in, d_out: (d_out / d_in) ** 0.5 * 3)
    torch.testing.assert_close(matrix_orthogonalization(A, scaled), 3 * torch.eye(2))
    torch.testing.assert_close(matrix_orthogonalization(A, NewtonSchulzOrthogonalizationConfig()), torch.eye(2), atol=0.3, rtol=0)
    wide = torch.randn(3, 7, generator=torch.Generator().manual_seed(0))
    exact = matrix_orthogonalization(wide, SVDOrthogonalizationConfig())
    assert exact.shape == (3, 7)
    torch.testing.assert_close(exact @ exact.T, torch.eye(3))
    # Five quintic Newton–Schulz steps only push singular values into roughly [0.7, 1.2], with U·Vᵀ's singular vectors.
    approximate = matrix_orthogonalization(wide, NewtonSchulzOrthogonalizationConfig())
    assert approximate.shape == (3, 7)
    singular_values = torch.linalg.svdvals(approximate)
    assert ((singular_values > 0.6) & (singular_values < 1.25)).all(), singular_values
    assert torch.linalg.norm(approximate - exact) < 0.5 * torch.linalg.norm(exact)


# ----------------------------------------------------------------------------------------- memory-saving options


def random_spd(n: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    x = torch.randn(n, 2 * n, generator=torch.Generator().manual_seed(n), dtype=dtype)
    return x @ x.T / (2 * n)


@pytest.mark.parametrize(
    "config",
    [EighEigendecompositionConfig(), EigenConfig(), QREigendecompositionConfig(max_iterations=3)],
    ids=["eigh", "eigen", "qr"],
)
def test_overwriting_the_input_gives_the_same_decomposition(config: EighEigendecompositionConfig) -> None:
    A = random_spd(24)
    estimate = torch.eye(24)
    expected = matrix_eigendecomposition(A, epsilon=1e-3, eigendecomposition_config=config, eigenvectors_estimate=estimate)
    scratch = A.clone()
    got = matrix_eigendecomposition(
        scratch, epsilon=1e-3, eigendecomposition_config=config, eigenvectors_estimate=estimate, overwrite_input=True
    )
    for g, e in zip(got, expected, strict=True):
        torch.testing.assert_close(g, e, rtol=0, atol=0)
    torch.testing.assert_close(scratch, _matrix_perturbation(A, 1e-3), rtol=0, atol=0)  # perturbed in place
    untouched = A.clone()
    matrix_eigendecomposition(untouched, epsilon=1e-3, eigendecomposition_config=config, eigenvectors_estimate=estimate)
    assert torch.equal(untouched, A)


def test_a_deferred_product_gives_the_same_root() -> None:
    from distributed_shampoo.utils.shampoo_utils import ContinueOnCaller

    A = random_spd(32)
    expected = matrix_inverse_root(A, Fraction(4), EigenConfig(), epsilon=1e-6)
    deferred = matrix_inverse_root(A.clone(), Fraction(4), EigenConfig(), epsilon=1e-6, overwrite_input=True, defer_product=True)
    assert isinstance(deferred, ContinueOnCaller) and len(deferred.tensors) == 2  # eigenvalues, eigenvectors
    torch.testing.assert_close(deferred.function(*deferred.tensors), expected, rtol=0, atol=0)
    # The iterative methods have no product to defer.
    newton = matrix_inverse_root(A.double(), Fraction(2), CoupledNewtonConfig(), epsilon=1e-6, defer_product=True)
    assert isinstance(newton, torch.Tensor)


def test_eigh_workspace_and_temporary_estimates() -> None:
    from distributed_shampoo.preconditioner.matrix_functions import (
        eigh_workspace_elements,
        matrix_function_temporary_elements,
    )

    assert eigh_workspace_elements(3072) == 1 + 6 * 3072 + 4 * 3072**2 == 37_767_169  # LAPACK's syevd minimum with 4n², as cuSOLVER measured
    assert matrix_function_temporary_elements(EigenConfig(), 768) == 768**2 + 768 + eigh_workspace_elements(768)
    assert matrix_function_temporary_elements(CoupledHigherOrderConfig(rel_epsilon=0.0, abs_epsilon=0.0), 10) == 1000
    with pytest.raises(NotImplementedError, match="No memory estimate for SVDOrthogonalizationConfig"):
        matrix_function_temporary_elements(SVDOrthogonalizationConfig(), 10)
