"""Identity preconditioner (SGD, and SGD grafting)."""

from torch import Tensor

from distributed_shampoo.preconditioner.preconditioner_list import StatelessPreconditionerList


class SGDPreconditionerList(StatelessPreconditionerList):
    """The direction is the (filtered) gradient itself; no state."""

    def precondition(self, masked_grad_list: tuple[Tensor, ...]) -> tuple[Tensor, ...]:
        return masked_grad_list
