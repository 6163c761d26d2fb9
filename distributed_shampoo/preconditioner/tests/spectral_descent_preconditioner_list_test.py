"""Spectral descent: orthogonalised 2-D blocks; other orders are rejected."""

import pytest
import torch

from distributed_shampoo.preconditioner.matrix_functions_types import SVDOrthogonalizationConfig
from distributed_shampoo.preconditioner.spectral_descent_preconditioner_list import SpectralDescentPreconditionerList
from distributed_shampoo.shampoo_types import SpectralDescentPreconditionerConfig


def test_orthogonalises_blocks() -> None:
    grads = (torch.eye(3), 5.0 * torch.eye(2), torch.tensor([[3.0, 0.0, 0.0], [0.0, 2.0, 0.0]]))
    config = SpectralDescentPreconditionerConfig(orthogonalization_config=SVDOrthogonalizationConfig())
    preconditioner_list = SpectralDescentPreconditionerList(grads, config)
    out = preconditioner_list.precondition(grads)
    torch.testing.assert_close(out[0], torch.eye(3))
    torch.testing.assert_close(out[1], torch.eye(2))
    torch.testing.assert_close(out[2], torch.tensor([[1.0, 0.0, 0.0], [0.0, 1.0, 0.0]]))


@pytest.mark.parametrize("shape", [(3,), (2, 2, 2)])
def test_rejects_blocks_that_are_not_matrices(shape: tuple[int, ...]) -> None:
    with pytest.raises(ValueError, match="needs every block to be 2-D.*target_parameter_dimensionality=2"):
        SpectralDescentPreconditionerList((torch.zeros(shape),), SpectralDescentPreconditionerConfig())
