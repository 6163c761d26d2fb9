"""SGD preconditioner: identity, no state."""

import torch

from distributed_shampoo.preconditioner.sgd_preconditioner_list import SGDPreconditionerList


def test_identity_and_no_state() -> None:
    grads = (torch.tensor([1.0, -2.0]), torch.ones(2, 3))
    preconditioner_list = SGDPreconditionerList(grads)
    preconditioner_list.update_preconditioners(grads, step=1, perform_amortized_computation=True)
    preconditioner_list.compress_preconditioner_list((True, True))
    assert preconditioner_list.precondition(grads) == grads
    assert preconditioner_list.numel_list == (0, 0) and preconditioner_list.num_bytes() == 0
    assert preconditioner_list.dims_list == (torch.Size([2]), torch.Size([2, 3]))
