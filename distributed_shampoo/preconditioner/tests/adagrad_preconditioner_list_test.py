"""AdaGrad-family diagonal preconditioner: one step gives sign(g) (AdaGrad, Adam) or 10·sign(g) (RMSprop)."""

from typing import Any

import pytest
import torch
from torch import Tensor

from distributed_shampoo.distributor.shampoo_block_info import BlockInfo
from distributed_shampoo.preconditioner.adagrad_preconditioner_list import ADAGRAD, AdagradPreconditionerList

GRADS = (torch.tensor([1.0, 1.0]), torch.tensor([[1.0, 2.0], [3.0, 4.0]]), torch.tensor([[5.0, 6.0]]), torch.tensor(1.0))


def make_list(**kwargs: Any) -> tuple[AdagradPreconditionerList, dict[Tensor, Any]]:
    params = [torch.zeros(2), torch.zeros(3, 2), torch.tensor(0.0)]
    blocks = (params[0], params[1][:2], params[1][2:], params[2])
    ids = ((0, "block_0"), (1, "block_0"), (1, "block_1"), (2, "block_0"))
    infos = tuple(BlockInfo(param=params[i], composable_block_ids=(i, name)) for i, name in ids)
    state: dict[Tensor, Any] = {p: {} for p in params}
    for info in infos:
        state[info.param][info.composable_block_ids[1]] = {}
    return AdagradPreconditionerList(blocks, state, infos, epsilon=1e-10, **kwargs), state


@pytest.mark.parametrize(
    ("kwargs", "scale"),
    [
        (dict(beta2=1.0, weighting_factor=1.0, use_bias_correction=False), 1.0),  # AdaGrad
        (dict(beta2=0.9, weighting_factor=0.1, use_bias_correction=True), 1.0),  # Adam
        (dict(beta2=0.99, weighting_factor=0.01, use_bias_correction=False), 10.0),  # RMSprop
    ],
)
def test_one_step(kwargs: dict[str, Any], scale: float) -> None:
    preconditioner_list, _ = make_list(**kwargs)
    preconditioner_list.update_preconditioners(GRADS, step=1, perform_amortized_computation=False)
    for got, grad in zip(preconditioner_list.precondition(GRADS), GRADS, strict=True):
        torch.testing.assert_close(got, scale * torch.sign(grad))


def test_state_sizes_and_masking() -> None:
    preconditioner_list, state = make_list()
    assert preconditioner_list.numel_list == (2, 4, 2, 1)
    assert preconditioner_list.num_bytes_list == (8, 16, 8, 4)
    assert preconditioner_list.numel() == 9 and preconditioner_list.num_bytes() == 36
    preconditioner_list.compress_preconditioner_list((False, True, False, False))
    preconditioner_list.update_preconditioners((GRADS[1],), step=1, perform_amortized_computation=False)
    first, second = list(state.values())[:2]
    assert torch.equal(second["block_0"][ADAGRAD], GRADS[1] ** 2)
    assert first["block_0"][ADAGRAD].abs().sum() == 0
