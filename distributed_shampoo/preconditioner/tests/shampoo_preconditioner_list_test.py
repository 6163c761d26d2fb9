"""Shampoo preconditioner lists on hand-made blocks whose factor matrices come out as identities."""

import logging
import math
from fractions import Fraction
from typing import Any
from unittest import mock

import pytest
import torch
from torch import Tensor

from distributed_shampoo.distributor.shampoo_block_info import BlockInfo
from distributed_shampoo.preconditioner import shampoo_preconditioner_list as module
from distributed_shampoo.preconditioner.matrix_functions_types import (
    CoupledHigherOrderConfig,
    EigenConfig,
    EighEigendecompositionConfig,
    QREigendecompositionConfig,
)
from distributed_shampoo.preconditioner.shampoo_preconditioner_list import (
    BaseShampooPreconditionerList,
    EigendecomposedKLShampooPreconditionerList,
    EigendecomposedShampooPreconditionerList,
    EigenvalueCorrectedShampooPreconditionerList,
    RootInvKLShampooPreconditionerList,
    RootInvShampooPreconditionerList,
    _precondition_grad,
)
from distributed_shampoo.shampoo_types import (
    EigendecomposedShampooPreconditionerConfig,
    EigenvalueCorrectedShampooPreconditionerConfig,
    PreconditionerValueError,
    RootInvShampooPreconditionerConfig,
)

F64 = torch.float64


def make_blocks() -> tuple[tuple[Tensor, ...], tuple[BlockInfo, ...], dict[Tensor, Any]]:
    """Param 0 = [1, 2] → block (2,); param 1 = arange(6) as 3×2 cut by 2 rows → (2, 2), (1, 2); param 2 = 0-d."""
    params = [torch.tensor([1.0, 2.0]), torch.arange(6.0).reshape(3, 2), torch.tensor(3.0)]
    blocks = (params[0], params[1][:2], params[1][2:], params[2])
    ids = ((0, "block_0"), (1, "block_0"), (1, "block_1"), (2, "block_0"))
    infos = tuple(BlockInfo(param=params[i], composable_block_ids=(i, name)) for i, name in ids)
    state: dict[Tensor, Any] = {param: {} for param in params}
    for info in infos:
        state[info.param][info.composable_block_ids[1]] = {}
    return blocks, infos, state


def make_list(list_class: type, config: Any, **kwargs: Any) -> BaseShampooPreconditionerList:
    blocks, infos, state = make_blocks()
    return list_class(blocks, state, infos, config, **kwargs)


S = 1 / math.sqrt(2)
# Two steps of gradients after which every factor matrix is the identity (or [[2]] for the 1×2 block's rows).
FIRST_GRADS = (torch.tensor([1.0, 0.0]), torch.tensor([[S, 0.0], [0.0, S]]), torch.tensor([[1.0, 0.0]]), torch.tensor(1.0))
SECOND_GRADS = (torch.tensor([0.0, 1.0]), torch.tensor([[S, 0.0], [0.0, S]]), torch.tensor([[0.0, 1.0]]), torch.tensor(1.0))


def two_steps(preconditioner_list: BaseShampooPreconditionerList) -> tuple[Tensor, ...]:
    preconditioner_list.update_preconditioners(FIRST_GRADS, step=1, perform_amortized_computation=False)
    preconditioner_list.update_preconditioners(SECOND_GRADS, step=2, perform_amortized_computation=True)
    return preconditioner_list.precondition(SECOND_GRADS)


def assert_outputs(got: tuple[Tensor, ...], expected: tuple[Any, ...]) -> None:
    for g, e in zip(got, expected, strict=True):
        torch.testing.assert_close(g, torch.as_tensor(e, dtype=g.dtype), atol=1e-5, rtol=1e-5)


ROOT_INV = RootInvShampooPreconditionerConfig(factor_matrix_dtype=F64, inv_factor_matrix_dtype=F64)
EIGENDECOMPOSED = EigendecomposedShampooPreconditionerConfig(factor_matrix_dtype=F64, factor_matrix_eigenvectors_dtype=F64, factor_matrix_eigenvalues_dtype=F64)
CLASSIC_LISTS = [(RootInvShampooPreconditionerList, ROOT_INV), (EigendecomposedShampooPreconditionerList, EIGENDECOMPOSED)]
IDENTITY_CASE = ([0.0, 1.0], [[S, 0.0], [0.0, S]], [[0.0, 2 ** -0.25]], 1.0)


@pytest.mark.parametrize(("list_class", "config"), CLASSIC_LISTS)
def test_identity_factors_leave_gradients_unchanged(list_class: type, config: Any) -> None:
    assert_outputs(two_steps(make_list(list_class, config)), IDENTITY_CASE)


@pytest.mark.parametrize(("list_class", "config"), CLASSIC_LISTS)
def test_ema_with_bias_correction_gives_the_same_factors(list_class: type, config: Any) -> None:
    """beta2 = 0.5, weight 1: F = 0.5·g1g1ᵀ + g2g2ᵀ ... scaled grads make F/(1 - 0.25) the identity again."""
    preconditioner_list = make_list(list_class, config, beta2=0.5, weighting_factor=0.5, use_bias_correction=True)
    # F2 = 0.25·g1g1ᵀ + 0.5·g2g2ᵀ; with g1 = √3·e1-type and g2 = √1.5·e2-type, F2 / 0.75 = E1 + E2.
    first = tuple(g * math.sqrt(3.0) for g in FIRST_GRADS)
    second = tuple(g * math.sqrt(1.5) for g in SECOND_GRADS)
    preconditioner_list.update_preconditioners(first, step=1, perform_amortized_computation=False)
    preconditioner_list.update_preconditioners(second, step=2, perform_amortized_computation=True)
    assert_outputs(preconditioner_list.precondition(SECOND_GRADS), IDENTITY_CASE)


@pytest.mark.parametrize(("list_class", "config"), CLASSIC_LISTS)
def test_epsilon_regularisation(list_class: type, config: Any) -> None:
    expected = ([0.0, 1 / 9], [[S / 9, 0.0], [0.0, S / 9]], [[0.0, (1 / 3) * 82**-0.25]], 1.0)
    assert_outputs(two_steps(make_list(list_class, config, epsilon=80.0)), expected)


def test_trace_scaling() -> None:
    config = RootInvShampooPreconditionerConfig(factor_matrix_dtype=F64, inv_factor_matrix_dtype=F64, use_trace_scaling=True)
    expected = ([0.0, 2**0.25], [[S * 2**0.25, 0.0], [0.0, S * 2**0.25]], [[0.0, 1.0]], 1.0)
    assert_outputs(two_steps(make_list(RootInvShampooPreconditionerList, config)), expected)


def test_inverse_exponent_overrides() -> None:
    skip_vectors = RootInvShampooPreconditionerConfig(factor_matrix_dtype=F64, inv_factor_matrix_dtype=F64, inverse_exponent_override={1: 0.0})
    skipped = make_list(RootInvShampooPreconditionerList, skip_vectors)
    assert skipped.numel_list == (0, 16, 10, 0)
    assert_outputs(two_steps(skipped), IDENTITY_CASE)

    full_inverse = RootInvShampooPreconditionerConfig(
        factor_matrix_dtype=F64, inv_factor_matrix_dtype=F64, inverse_exponent_override={1: {0: 1.0}, 2: 1.0}
    )
    assert_outputs(two_steps(make_list(RootInvShampooPreconditionerList, full_inverse)), ([0.0, 1.0], [[S, 0.0], [0.0, S]], [[0.0, 0.5]], 1.0))

    only_columns = RootInvShampooPreconditionerConfig(factor_matrix_dtype=F64, inv_factor_matrix_dtype=F64, inverse_exponent_override={2: {0: 0.0}})
    preconditioner_list = make_list(RootInvShampooPreconditionerList, only_columns)
    assert [len(b.factor_matrices) for b in preconditioner_list._local_blocks] == [1, 1, 1, 0]
    assert [b.roots for b in preconditioner_list._local_blocks] == [(Fraction(2),), (Fraction(4),), (Fraction(4),), ()]


def test_eigenvalue_corrected_identity_basis_is_adagrad() -> None:
    config = EigenvalueCorrectedShampooPreconditionerConfig(factor_matrix_dtype=F64, factor_matrix_eigenvectors_dtype=F64, corrected_eigenvalues_dtype=F64)
    preconditioner_list = make_list(EigenvalueCorrectedShampooPreconditionerList, config, epsilon=1e-12)
    out = two_steps(preconditioner_list)
    # Identity factors keep the basis (up to signs), so this is AdaGrad: g2 / sqrt(g1² + g2²).
    expected = tuple(torch.nan_to_num(g2 / torch.sqrt(g1**2 + g2**2)) for g1, g2 in zip(FIRST_GRADS, SECOND_GRADS))
    for got, want in zip(out, expected, strict=True):
        torch.testing.assert_close(got.abs(), want.abs().to(got.dtype), atol=1e-5, rtol=1e-5)


def test_numel_and_bytes() -> None:
    preconditioner_list = make_list(RootInvShampooPreconditionerList, ROOT_INV)
    assert preconditioner_list.numel_list == (8, 16, 10, 0)
    assert preconditioner_list.num_bytes_list == (48, 96, 60, 0)
    assert preconditioner_list.dims_list == (torch.Size([2]), torch.Size([2, 2]), torch.Size([1, 2]), torch.Size([]))
    assert preconditioner_list.numel() == 34 and preconditioner_list.num_bytes() == 204


def test_masking_skips_unselected_blocks() -> None:
    preconditioner_list = make_list(RootInvShampooPreconditionerList, ROOT_INV)
    preconditioner_list.compress_preconditioner_list((True, False, True, False))
    preconditioner_list.update_preconditioners((FIRST_GRADS[0], FIRST_GRADS[2]), step=1, perform_amortized_computation=False)
    factors = [b.factor_matrices for b in preconditioner_list._local_blocks]
    assert factors[1][0].abs().sum() == 0 and factors[0][0].abs().sum() > 0


def test_precondition_grad_with_selector_equals_identity_on_unselected_dims() -> None:
    generator = torch.Generator().manual_seed(0)
    grad = torch.randn(2, 3, 2, 1, 3, 2, generator=generator, dtype=F64)
    selector = (True, False, True, True, False, False)
    matrices = [torch.randn(size, size, generator=generator, dtype=F64) for size, selected in zip(grad.shape, selector) if selected]
    full = [next(iter_m) if selected else torch.eye(size, dtype=F64) for size, selected, iter_m in zip(grad.shape, selector, [iter(matrices)] * 6)]
    torch.testing.assert_close(_precondition_grad(grad, selector, tuple(matrices)), _precondition_grad(grad, (True,) * 6, tuple(full)))


def test_nan_in_factor_matrix_raises() -> None:
    preconditioner_list = make_list(RootInvShampooPreconditionerList, ROOT_INV)
    bad = (torch.tensor([float("nan"), 0.0]),) + FIRST_GRADS[1:]
    preconditioner_list.update_preconditioners(bad, step=1, perform_amortized_computation=False)
    with pytest.raises(PreconditionerValueError, match="Encountered nan/inf values in factor matrix 0.block_0.0"):
        preconditioner_list.update_preconditioners(FIRST_GRADS, step=2, perform_amortized_computation=True)


def test_nan_in_computed_root_raises() -> None:
    preconditioner_list = make_list(RootInvShampooPreconditionerList, ROOT_INV)
    with mock.patch.object(module, "matrix_inverse_root", return_value=torch.full((2, 2), float("nan"), dtype=F64)):
        with pytest.raises(PreconditionerValueError, match="computed quantity of factor matrix 0.block_0.0"):
            two_steps(preconditioner_list)


def test_a_debug_dump_that_cannot_be_written_only_warns(caplog: pytest.LogCaptureFixture) -> None:
    preconditioner_list = make_list(RootInvShampooPreconditionerList, ROOT_INV)
    with mock.patch.object(module, "matrix_inverse_root", return_value=torch.full((2, 2), float("nan"), dtype=F64)):
        with mock.patch.object(torch, "save", side_effect=OSError("disk full")), caplog.at_level(logging.WARNING):
            with pytest.raises(PreconditionerValueError, match="computed quantity of factor matrix 0.block_0.0"):
                two_steps(preconditioner_list)
    saves = [r.getMessage() for r in caplog.records if "Could not save" in r.getMessage()]
    assert len(saves) == 1 and "OSError('disk full')" in saves[0]


def test_failed_computations_warn_then_raise_after_the_tolerance(caplog: pytest.LogCaptureFixture) -> None:
    preconditioner_list = make_list(RootInvShampooPreconditionerList, ROOT_INV)
    with mock.patch.object(module, "matrix_inverse_root", side_effect=ZeroDivisionError()):
        with caplog.at_level(logging.WARNING, logger=module.__name__):
            preconditioner_list.update_preconditioners(FIRST_GRADS, step=1, perform_amortized_computation=True)
        failures = [r.getMessage().split(". ")[0] for r in caplog.records if "Matrix computation failed" in r.getMessage()]
        assert failures == [
            f"Matrix computation failed for factor matrix {index} with exception=ZeroDivisionError()"
            for index in ("0.block_0.0", "1.block_0.0", "1.block_0.1", "1.block_1.0", "1.block_1.1")
        ]
        # The identity initialisation is kept.
        assert torch.equal(preconditioner_list._square(preconditioner_list._local_blocks[0].inv_factor_matrices[0]), torch.eye(2, dtype=F64))
        for step in (2, 3):
            preconditioner_list.update_preconditioners(FIRST_GRADS, step=step, perform_amortized_computation=True)
        with pytest.raises(ValueError, match=r"Exceeded tolerance \(3\).*\('0.block_0.0',\)") as error:
            preconditioner_list.update_preconditioners(FIRST_GRADS, step=4, perform_amortized_computation=True)
        assert isinstance(error.value.__cause__, ZeroDivisionError)


def test_a_success_resets_the_failure_count() -> None:
    preconditioner_list = make_list(RootInvShampooPreconditionerList, ROOT_INV)
    real = module.matrix_inverse_root
    for step in range(1, 4):
        with mock.patch.object(module, "matrix_inverse_root", side_effect=ZeroDivisionError()):
            preconditioner_list.update_preconditioners(FIRST_GRADS, step=step, perform_amortized_computation=True)
    with mock.patch.object(module, "matrix_inverse_root", side_effect=real):
        preconditioner_list.update_preconditioners(FIRST_GRADS, step=4, perform_amortized_computation=True)
    with mock.patch.object(module, "matrix_inverse_root", side_effect=ZeroDivisionError()):
        for step in range(5, 8):
            preconditioner_list.update_preconditioners(FIRST_GRADS, step=step, perform_amortized_computation=True)


def test_adaptive_eigendecomposition_skips_converged_factors() -> None:
    config = EigendecomposedShampooPreconditionerConfig(
        factor_matrix_dtype=F64,
        factor_matrix_eigenvectors_dtype=F64,
        factor_matrix_eigenvalues_dtype=F64,
        amortized_computation_config=EighEigendecompositionConfig(tolerance=0.01),
    )
    preconditioner_list = make_list(EigendecomposedShampooPreconditionerList, config)
    preconditioner_list.update_preconditioners(FIRST_GRADS, step=1, perform_amortized_computation=False)
    # After one step only the diagonal factors are already diagonal in the identity basis... all of them here.
    with mock.patch.object(torch.linalg, "eigh", wraps=torch.linalg.eigh) as eigh:
        preconditioner_list.update_preconditioners(SECOND_GRADS, step=2, perform_amortized_computation=True)
    assert eigh.call_count == 0
    rotated = (torch.tensor([1.0, 1.0]), FIRST_GRADS[1], FIRST_GRADS[2], FIRST_GRADS[3])
    with mock.patch.object(torch.linalg, "eigh", wraps=torch.linalg.eigh) as eigh:
        preconditioner_list.update_preconditioners(rotated, step=3, perform_amortized_computation=True)
    assert eigh.call_count == 1  # only the (2,) block's factor stopped being diagonal


def test_soap_qr_and_kl_variants_run_and_stay_finite() -> None:
    soap = EigenvalueCorrectedShampooPreconditionerConfig(
        amortized_computation_config=QREigendecompositionConfig(), factor_matrix_dtype=F64, factor_matrix_eigenvectors_dtype=F64, corrected_eigenvalues_dtype=F64
    )
    for list_class, config in [
        (EigenvalueCorrectedShampooPreconditionerList, soap),
        (RootInvKLShampooPreconditionerList, ROOT_INV),
        (EigendecomposedKLShampooPreconditionerList, EIGENDECOMPOSED),
    ]:
        out = two_steps(make_list(list_class, config))
        assert all(torch.isfinite(o).all() for o in out)


def test_kl_factor_uses_the_other_sides_inverse_root() -> None:
    """For a matrix block: L += (G·R̃)(G·R̃)ᵀ with R̃ the current inverse root of R."""
    generator = torch.Generator().manual_seed(1)
    param = torch.zeros(3, 2, dtype=F64)
    info = BlockInfo(param=param, composable_block_ids=(0, "block_0"))
    state: dict[Tensor, Any] = {param: {"block_0": {}}}
    kl = RootInvKLShampooPreconditionerList((param,), state, (info,), ROOT_INV, epsilon=1e-10)
    g1, g2 = torch.randn(3, 2, generator=generator, dtype=F64), torch.randn(3, 2, generator=generator, dtype=F64)
    kl.update_preconditioners((g1,), step=1, perform_amortized_computation=True)
    L1, R1 = g1 @ g1.T, g1.T @ g1
    block = kl._local_blocks[0]
    # Step 1 used identity roots: plain Shampoo statistics.
    torch.testing.assert_close(kl._square(block.factor_matrices[0]), L1)
    torch.testing.assert_close(kl._square(block.factor_matrices[1]), R1)
    L_root, R_root = kl._block_inverse_roots(block)
    kl.update_preconditioners((g2,), step=2, perform_amortized_computation=False)
    torch.testing.assert_close(kl._square(block.factor_matrices[0]), L1 + (g2 @ R_root) @ (g2 @ R_root).T)
    torch.testing.assert_close(kl._square(block.factor_matrices[1]), R1 + (L_root @ g2).T @ (L_root @ g2))


@pytest.mark.parametrize(
    ("amortized_config", "expected_streams"),
    [
        (EigenConfig(), 4),
        (CoupledHigherOrderConfig(rel_epsilon=0.0, abs_epsilon=0.0, disable_tf32=False), 4),
        # flips torch.backends.cuda.matmul.allow_tf32 for the whole process: never run from several threads
        (CoupledHigherOrderConfig(rel_epsilon=0.0, abs_epsilon=0.0, disable_tf32=True), 1),
    ],
)
def test_concurrent_streams_are_skipped_for_configs_that_change_global_state(
    amortized_config: Any, expected_streams: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    requested: list[int] = []
    run_on_side_streams = module.run_on_side_streams

    def spy(tasks: Any, num_streams: int, device: torch.device, *args: Any) -> Any:
        requested.append(num_streams)
        return run_on_side_streams(tasks, num_streams, device, *args)

    monkeypatch.setattr(module, "run_on_side_streams", spy)
    config = RootInvShampooPreconditionerConfig(
        factor_matrix_dtype=F64, inv_factor_matrix_dtype=F64, amortized_computation_config=amortized_config
    )
    two_steps(make_list(RootInvShampooPreconditionerList, config, num_amortized_computation_streams=4))
    assert requested == [expected_streams]


def test_streams_must_be_positive() -> None:
    with pytest.raises(ValueError, match="num_amortized_computation_streams=0 must be at least 1"):
        make_list(RootInvShampooPreconditionerList, ROOT_INV, num_amortized_computation_streams=0)
