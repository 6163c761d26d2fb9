"""Model helpers for Shampoo: a linear layer whose bias is stored as an extra weight column."""

import math

import torch
from torch import Tensor, nn
from torch.nn import functional as F


class CombinedLinear(nn.Module):
    """`nn.Linear` with weight and bias in one `(out, in + 1)` parameter `combined_weight`.

    Shampoo then preconditions weight and bias together with one pair of Kronecker factors,
    instead of treating the bias as a separate 1-D parameter. Without a bias the parameter is
    `(out, in)`. Initialisation draws from the RNG in the same order as `nn.Linear`, so with the
    same seed `combined_weight[:, :-1]` equals `nn.Linear.weight` and `combined_weight[:, -1]`
    equals `nn.Linear.bias`.
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = True,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        self.in_features = in_features
        self.out_features = out_features
        self.bias = bias
        self.in_features_with_bias = in_features + int(bias)
        self.combined_weight = nn.Parameter(
            torch.empty(out_features, self.in_features_with_bias, device=device, dtype=dtype)
        )
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """Initialise like `nn.Linear`: weight kaiming-uniform(a=√5), bias uniform(±1/√in)."""
        # Draw into separate tensors shaped like nn.Linear's so the random stream is consumed identically.
        weight = torch.empty_like(self.combined_weight[:, : self.in_features])
        nn.init.kaiming_uniform_(weight, a=math.sqrt(5))
        with torch.no_grad():
            self.combined_weight[:, : self.in_features].copy_(weight)
            if self.bias:
                bound = 1 / math.sqrt(self.in_features) if self.in_features > 0 else 0.0
                bias = torch.empty_like(self.combined_weight[:, -1])
                self.combined_weight[:, -1].copy_(nn.init.uniform_(bias, -bound, bound))

    def forward(self, x: Tensor) -> Tensor:
        if self.bias:
            return F.linear(x, self.combined_weight[:, :-1], self.combined_weight[:, -1])
        return F.linear(x, self.combined_weight)

    def extra_repr(self) -> str:
        return f"{self.in_features=}, {self.out_features=}, {self.in_features_with_bias=}"
