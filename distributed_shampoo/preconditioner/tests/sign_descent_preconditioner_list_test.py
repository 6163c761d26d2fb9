"""Sign descent: scale_fn(g)·sign(g)."""

import torch

from distributed_shampoo.preconditioner.sign_descent_preconditioner_list import SignDescentPreconditionerList
from distributed_shampoo.shampoo_types import SignDescentPreconditionerConfig


def test_constant_and_norm_scales() -> None:
    grads = (torch.tensor([1.0, -2.0, 0.0]), torch.tensor([[3.0, -4.0]]))
    constant = SignDescentPreconditionerList(grads, SignDescentPreconditionerConfig(scale_fn=lambda g: 2.0))
    for got, grad in zip(constant.precondition(grads), grads, strict=True):
        torch.testing.assert_close(got, 2.0 * torch.sign(grad))
    l1 = SignDescentPreconditionerList(grads, SignDescentPreconditionerConfig(scale_fn=lambda g: g.abs().sum()))
    for got, grad in zip(l1.precondition(grads), grads, strict=True):
        torch.testing.assert_close(got, grad.abs().sum() * torch.sign(grad))
    default = SignDescentPreconditionerList(grads, SignDescentPreconditionerConfig())
    torch.testing.assert_close(default.precondition(grads)[0], torch.tensor([1.0, -1.0, 0.0]))
