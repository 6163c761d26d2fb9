"""Spectral descent: the orthogonalised direction of each 2-D block (Muon-like), no state."""

import math

from torch import Tensor

from distributed_shampoo.preconditioner.matrix_functions import matrix_orthogonalization
from distributed_shampoo.preconditioner.preconditioner_list import StatelessPreconditionerList, profile_decorator
from distributed_shampoo.shampoo_types import SpectralDescentPreconditionerConfig


class SpectralDescentPreconditionerList(StatelessPreconditionerList):
    def __init__(self, block_list: tuple[Tensor, ...], preconditioner_config: SpectralDescentPreconditionerConfig) -> None:
        super().__init__(block_list)
        if bad_shapes := [tuple(block.shape) for block in block_list if block.dim() != 2]:
            raise ValueError(
                f"Spectral descent needs every block to be 2-D, got blocks of shapes {bad_shapes}. "
                f"Use max_preconditioner_dim={math.inf} with a distributed config whose "
                "target_parameter_dimensionality=2, and keep 1-D parameters in another optimizer."
            )
        self._orthogonalization_config = preconditioner_config.orthogonalization_config

    @profile_decorator
    def precondition(self, masked_grad_list: tuple[Tensor, ...]) -> tuple[Tensor, ...]:
        return tuple(matrix_orthogonalization(grad, self._orthogonalization_config) for grad in masked_grad_list)
