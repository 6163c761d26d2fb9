"""Identity preconditioner (SGD, and SGD grafting)."""

from torch import Tensor

from distributed_shampoo.preconditioner.preconditioner_list import PreconditionerList


class SGDPreconditionerList(PreconditionerList):
    """The direction is the (filtered) gradient itself; no state."""

    def update_preconditioners(
        self, masked_grad_list: tuple[Tensor, ...], step: Tensor | int, perform_amortized_computation: bool
    ) -> None:
        return

    def precondition(self, masked_grad_list: tuple[Tensor, ...]) -> tuple[Tensor, ...]:
        return masked_grad_list

    def compress_preconditioner_list(self, local_grad_selector: tuple[bool, ...]) -> None:
        return
