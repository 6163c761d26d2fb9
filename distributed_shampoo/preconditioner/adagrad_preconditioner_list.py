"""Diagonal AdaGrad-family preconditioner: AdaGrad, RMSprop and Adam (used mostly for grafting)."""

from typing import Any

import torch
from torch import Tensor

from distributed_shampoo.distributor.shampoo_block_info import BlockInfo, allocate_zeros_like_blocks
from distributed_shampoo.preconditioner.preconditioner_list import SecondMomentPreconditionerList, profile_decorator
from distributed_shampoo.utils.shampoo_utils import compress_list

ADAGRAD = "adagrad"


class AdagradPreconditionerList(SecondMomentPreconditionerList):
    """V ← beta2·V + weighting_factor·G²; direction X / (sqrt(V / (1 - beta2^t)) + epsilon).

    Adam is (beta2, 1 - beta2, bias correction), RMSprop (beta2, 1 - beta2, none), AdaGrad (1, 1, none). The
    state `V` lives under `state[param][block_id]["adagrad"]` in the parameter's dtype.
    """

    def __init__(
        self,
        block_list: tuple[Tensor, ...],
        state: dict[Tensor, Any],
        block_info_list: tuple[BlockInfo, ...],
        beta2: float = 1.0,
        weighting_factor: float = 1.0,
        epsilon: float = 1e-10,
        use_bias_correction: bool = True,
    ) -> None:
        super().__init__(block_list, beta2, weighting_factor, epsilon, use_bias_correction)

        preconditioners = allocate_zeros_like_blocks(ADAGRAD, block_list, block_info_list, state)
        self._local_preconditioner_list: tuple[Tensor, ...] = preconditioners
        self._masked_preconditioner_list = self._local_preconditioner_list

        self._numel_list = tuple(p.numel() for p in preconditioners)
        self._num_bytes_list = tuple(p.numel() * p.element_size() for p in preconditioners)

    @profile_decorator
    def update_preconditioners(
        self, masked_grad_list: tuple[Tensor, ...], step: Tensor | int, perform_amortized_computation: bool = False
    ) -> None:
        if not masked_grad_list:
            return
        if self._beta2 != 1.0:
            torch._foreach_mul_(self._masked_preconditioner_list, self._beta2)
        torch._foreach_addcmul_(
            self._masked_preconditioner_list, masked_grad_list, masked_grad_list, value=self._weighting_factor
        )
        self._update_bias_correction2(step)

    @profile_decorator
    def precondition(self, masked_grad_list: tuple[Tensor, ...]) -> tuple[Tensor, ...]:
        if len(masked_grad_list) != len(self._masked_preconditioner_list):
            raise ValueError(f"{len(masked_grad_list)} gradients for {len(self._masked_preconditioner_list)} masked blocks.")
        return self.precondition_blocks(masked_grad_list, 0)

    def precondition_blocks(self, masked_grad_list: tuple[Tensor, ...], first_block: int) -> tuple[Tensor, ...]:
        if not masked_grad_list:
            return ()
        statistics = self._masked_preconditioner_list[first_block : first_block + len(masked_grad_list)]
        assert len(statistics) == len(masked_grad_list), (
            f"{len(masked_grad_list)} gradients from masked block {first_block} on, but only {len(statistics)} blocks."
        )
        # Without bias correction, or once it has rounded to 1.0, dividing would only copy V.
        if self._bias_correction2 != 1.0:
            denominator = torch._foreach_div(statistics, self._bias_correction2)
            torch._foreach_sqrt_(denominator)
        else:
            denominator = torch._foreach_sqrt(statistics)
        torch._foreach_add_(denominator, self._epsilon)
        return tuple(torch._foreach_div(masked_grad_list, denominator))

    def compress_preconditioner_list(self, local_grad_selector: tuple[bool, ...]) -> None:
        self._masked_preconditioner_list = compress_list(self._local_preconditioner_list, local_grad_selector)
