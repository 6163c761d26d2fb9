import pytest
import torch

from distributed_shampoo.utils.load_balancing_utils import (
    AlignedMemoryCostModel,
    CostModel,
    DefaultCostModel,
    PolynomialComputationalCostModel,
)


def test_cost_model_is_abstract() -> None:
    with pytest.raises(TypeError, match="Can't instantiate abstract class CostModel"):
        CostModel()  # type: ignore[abstract]


@pytest.mark.parametrize(
    ("model", "tensor", "expected"),
    [
        (PolynomialComputationalCostModel(coefficients=(1, 2, 3)), torch.zeros(2, 3), 51.0),  # 17 + 34
        (PolynomialComputationalCostModel(coefficients=(0, 0, 0, 1), min_cost=100), torch.zeros(2, 5), 225.0),
        (PolynomialComputationalCostModel(coefficients=(1, 2, 3)), torch.tensor(1.0), 0.0),
    ],
)
def test_polynomial_cost(model: PolynomialComputationalCostModel, tensor: torch.Tensor, expected: float) -> None:
    assert model.cost(tensor) == expected


@pytest.mark.parametrize(
    ("model", "tensor", "expected"),
    [
        (AlignedMemoryCostModel(), torch.zeros(3), 64),
        (AlignedMemoryCostModel(), torch.zeros(16), 64),
        (AlignedMemoryCostModel(), torch.zeros(17), 128),
        (AlignedMemoryCostModel(), torch.zeros(0), 0),
        (AlignedMemoryCostModel(alignment_bytes=1), torch.zeros(5, dtype=torch.float16), 10),
        (AlignedMemoryCostModel(), torch.empty(3072, 768, device="meta"), 9437184),
    ],
)
def test_aligned_memory_cost(model: AlignedMemoryCostModel, tensor: torch.Tensor, expected: int) -> None:
    assert model.cost(tensor) == expected


def test_default_cost_model_is_64_byte_aligned_memory() -> None:
    assert repr(DefaultCostModel) == "AlignedMemoryCostModel(alignment_bytes=64)"
