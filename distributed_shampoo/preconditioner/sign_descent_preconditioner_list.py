"""Sign descent: direction sign(X)·scale_fn(X) per block, no state."""

import torch
from torch import Tensor

from distributed_shampoo.preconditioner.preconditioner_list import StatelessPreconditionerList, profile_decorator
from distributed_shampoo.shampoo_types import SignDescentPreconditionerConfig


class SignDescentPreconditionerList(StatelessPreconditionerList):
    def __init__(self, block_list: tuple[Tensor, ...], preconditioner_config: SignDescentPreconditionerConfig) -> None:
        super().__init__(block_list)
        self._scale_fn = preconditioner_config.scale_fn

    @profile_decorator
    def precondition(self, masked_grad_list: tuple[Tensor, ...]) -> tuple[Tensor, ...]:
        return tuple(torch.sign(grad) * self._scale_fn(grad) for grad in masked_grad_list)
