import pytest
import torch
from torch import nn

from distributed_shampoo.utils.shampoo_model_utils import CombinedLinear


def _seeded_pair(in_features: int, out_features: int, bias: bool, seed: int) -> tuple[nn.Linear, CombinedLinear]:
    torch.manual_seed(seed)
    linear = nn.Linear(in_features, out_features, bias=bias)
    torch.manual_seed(seed)
    combined = CombinedLinear(in_features, out_features, bias=bias)
    return linear, combined


@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("in_features", [2, 10])
@pytest.mark.parametrize("out_features", [2, 10])
def test_init_forward_and_backward_match_nn_linear(in_features: int, out_features: int, bias: bool, seed: int) -> None:
    linear, combined = _seeded_pair(in_features, out_features, bias, seed)
    weight_part = combined.combined_weight[:, :in_features]
    assert torch.equal(weight_part, linear.weight)
    if bias:
        assert torch.equal(combined.combined_weight[:, -1], linear.bias)
    else:
        assert combined.combined_weight.shape == linear.weight.shape

    x = torch.randn(5, in_features)
    torch.testing.assert_close(combined(x), linear(x))
    combined(x).square().sum().backward()
    linear(x).square().sum().backward()
    weight_grad, bias_grad = linear.weight.grad, linear.bias.grad if bias else None
    assert weight_grad is not None
    expected_grad = weight_grad if bias_grad is None else torch.cat([weight_grad, bias_grad[:, None]], dim=1)
    torch.testing.assert_close(combined.combined_weight.grad, expected_grad)


def test_combined_shapes_for_256_to_128() -> None:
    combined = CombinedLinear(256, 128)
    assert [name for name, _ in combined.named_parameters()] == ["combined_weight"]
    assert combined.combined_weight.shape == (128, 257)
    assert combined.in_features_with_bias == 257 and combined.bias is True
    assert combined(torch.randn(32, 256)).shape == (32, 128)


def test_forward_uses_last_column_as_bias() -> None:
    combined = CombinedLinear(3, 2)
    with torch.no_grad():
        combined.combined_weight.copy_(torch.tensor([[1.0, 0.0, 0.0, 10.0], [0.0, 1.0, 1.0, -1.0]]))
    assert combined(torch.tensor([[1.0, 2.0, 3.0]])).tolist() == [[11.0, 4.0]]


def test_device_and_dtype_are_honoured() -> None:
    combined = CombinedLinear(4, 3, dtype=torch.float64, device="cpu")
    assert combined.combined_weight.dtype == torch.float64
    assert combined.combined_weight.device.type == "cpu"


@pytest.mark.parametrize(("bias", "with_bias"), [(True, 11), (False, 10)])
def test_extra_repr(bias: bool, with_bias: int) -> None:
    assert CombinedLinear(10, 20, bias=bias).extra_repr() == (
        f"self.in_features=10, self.out_features=20, self.in_features_with_bias={with_bias}"
    )
