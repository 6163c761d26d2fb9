"""Cost models that estimate how expensive a block is, used to balance blocks across ranks."""

from abc import abstractmethod
from dataclasses import dataclass

from numpy.polynomial import polynomial
from torch import Tensor

from distributed_shampoo.utils.abstract_dataclass import AbstractDataclass


@dataclass(init=False)
class CostModel(AbstractDataclass):
    """Maps a block (only its shape and dtype are read) to a non-negative cost."""

    @abstractmethod
    def cost(self, tensor: Tensor) -> float:
        """Return the estimated cost of owning `tensor`."""


@dataclass
class PolynomialComputationalCostModel(CostModel):
    """Sum over the block's dims of `max(min_cost, p(dim))`.

    `coefficients` are in increasing degree: `(c0, c1, c2)` means `c0 + c1*d + c2*d**2`. With
    `(0, 0, 0, 1)` this approximates the cubic cost of one eigendecomposition per factor matrix.
    A 0-d block has no factor matrices and costs nothing.
    """

    coefficients: tuple[float, ...]
    min_cost: float = 0

    def cost(self, tensor: Tensor) -> float:
        return float(sum(max(self.min_cost, float(polynomial.polyval(dim, self.coefficients))) for dim in tensor.shape))


@dataclass
class AlignedMemoryCostModel(CostModel):
    """The block's size in bytes, rounded up to a multiple of `alignment_bytes`.

    This is also the space a block occupies in the DDP all-gather buffer, so balancing by it
    balances both the optimizer-state memory and the communicated bytes.
    """

    alignment_bytes: int = 64

    def cost(self, tensor: Tensor) -> float:
        num_bytes = tensor.numel() * tensor.element_size()
        return -(-num_bytes // self.alignment_bytes) * self.alignment_bytes  # integer ceil


DefaultCostModel = AlignedMemoryCostModel()
