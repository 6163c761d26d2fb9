"""Single-device distributor: blocking, block ids, gradient selection and parameter updates."""

from typing import Any
from unittest import mock

import pytest
import torch
from torch import nn

from distributed_shampoo.distributor.shampoo_distributor import Distributor
from distributed_shampoo.shampoo_types import ShampooRuntimeConfig, SingleDeviceDistributedConfig

DIM = 4


def make_group(weight_shape: tuple[int, ...] = (DIM, 2 * DIM)) -> dict[str, Any]:
    scalar = nn.Parameter(torch.tensor(1.0))
    weight = nn.Parameter(torch.ones(weight_shape))
    bias = nn.Parameter(torch.ones(weight_shape[0]))
    return {
        "params": [scalar, weight, bias],
        "max_preconditioner_dim": DIM,
        "distributed_config": SingleDeviceDistributedConfig(),
    }


def test_blocking_and_block_ids() -> None:
    distributor = Distributor(make_group())
    assert [tuple(b.shape) for b in distributor.local_blocked_params] == [(1,), (DIM, DIM), (DIM, DIM), (DIM,)]
    assert [info.composable_block_ids for info in distributor.local_block_info_list] == [
        (0, "block_0"),
        (1, "block_0"),
        (1, "block_1"),
        (2, "block_0"),
    ]
    assert distributor.local_grad_selector == (True,) * 4


def test_missing_gradients_are_masked() -> None:
    group = make_group()
    scalar, weight, bias = group["params"]
    distributor = Distributor(group)
    weight.grad = torch.arange(2.0 * DIM * DIM).reshape(DIM, 2 * DIM)
    grads = distributor.merge_and_block_gradients()
    assert distributor.local_grad_selector == (False, True, True, False)
    torch.testing.assert_close(grads[0], weight.grad[:, :DIM])
    torch.testing.assert_close(grads[1], weight.grad[:, DIM:])
    distributor.update_params((torch.ones(DIM, DIM), 2 * torch.ones(DIM, DIM)))
    assert scalar.item() == 1.0 and torch.equal(bias.detach(), torch.ones(DIM))
    torch.testing.assert_close(weight.detach(), torch.cat([2 * torch.ones(DIM, DIM), 3 * torch.ones(DIM, DIM)], dim=1))
    with pytest.raises(AssertionError, match="search directions"):
        distributor.update_params((torch.ones(DIM, DIM),))
    distributor.update_params(tuple(torch.ones_like(b) for b in distributor.local_blocked_params), use_masked_tensors=False)
    assert scalar.item() == 2.0


@pytest.mark.parametrize(("eager_nan_check", "expected_calls"), [(True, 2), (False, 0)])
def test_eager_nan_check(eager_nan_check: bool, expected_calls: int) -> None:
    group = make_group()
    _, weight, bias = group["params"]
    weight.grad, bias.grad = torch.ones_like(weight), torch.ones_like(bias)
    distributor = Distributor(group, ShampooRuntimeConfig(eager_nan_check=eager_nan_check))
    with mock.patch.object(torch, "isfinite", wraps=torch.isfinite) as isfinite:
        distributor.merge_and_block_gradients()
    assert isfinite.call_count == expected_calls
    bias.grad = torch.tensor([float("nan")] * DIM)
    if eager_nan_check:
        with pytest.raises(AssertionError, match="nan/inf"):
            distributor.merge_and_block_gradients()


def test_empty_parameter_is_never_selected() -> None:
    scalar, empty = nn.Parameter(torch.tensor(1.0)), nn.Parameter(torch.ones(0, 3))
    distributor = Distributor({"params": [scalar, empty], "max_preconditioner_dim": DIM, "distributed_config": SingleDeviceDistributedConfig()})
    assert [tuple(b.shape) for b in distributor.local_blocked_params] == [(1,), (0,)]
    scalar.grad, empty.grad = torch.tensor(1.0), torch.ones(0, 3)
    grads = distributor.merge_and_block_gradients()
    assert distributor.local_grad_selector == (True, False) and len(grads) == 1
    distributor.update_params((torch.ones(1),))
    assert scalar.item() == 2.0


def test_non_contiguous_parameter_is_rejected() -> None:
    weight = nn.Parameter(torch.ones(3, 4).T)
    with pytest.raises(ValueError, match="not contiguous"):
        Distributor({"params": [weight], "max_preconditioner_dim": DIM, "distributed_config": SingleDeviceDistributedConfig()})


def test_ddp_configuration_errors() -> None:
    from distributed_shampoo import DDPDistributedConfig, DistributedShampoo
    from distributed_shampoo.distributor.shampoo_ddp_distributor import resolve_group_size

    with pytest.raises(RuntimeError, match="needs an initialized torch.distributed process group"):
        DistributedShampoo([nn.Parameter(torch.zeros(2))], distributed_config=DDPDistributedConfig())
    assert resolve_group_size(-1, 8) == 8 and resolve_group_size(2, 8) == 2
    for bad in (0, 3, 16, -2):
        with pytest.raises(ValueError, match=f"Invalid num_trainers_per_group={bad} for world size 8"):
            resolve_group_size(bad, 8)
