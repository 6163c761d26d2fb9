"""Common interface of the per-block preconditioners (Shampoo, AdaGrad-family, SGD, sign and spectral descent)."""

import functools
from abc import ABC, abstractmethod
from collections.abc import Callable
from typing import Any, TypeVar

import torch
from torch import Tensor

FuncT = TypeVar("FuncT", bound=Callable[..., Any])


def profile_decorator(method: FuncT) -> FuncT:
    """Wrap a method in a profiler record named "## {Class}:{method} ##"."""

    @functools.wraps(method)
    def wrapper(self: Any, *args: Any, **kwargs: Any) -> Any:
        with torch.profiler.record_function(f"## {type(self).__name__}:{method.__name__} ##"):
            return method(self, *args, **kwargs)

    return wrapper  # type: ignore[return-value]


class PreconditionerList(ABC):
    """Preconditioners of a list of blocks.

    The `masked_*` arguments hold only the blocks that received a gradient this step; the list keeps a matching
    masked view of its own state, refreshed by `compress_preconditioner_list(local_grad_selector)`.
    """

    def __init__(self, block_list: tuple[Tensor, ...]) -> None:
        self._numel_list: tuple[int, ...] = (0,) * len(block_list)
        self._dims_list: tuple[torch.Size, ...] = tuple(block.size() for block in block_list)
        self._num_bytes_list: tuple[int, ...] = (0,) * len(block_list)

    @abstractmethod
    def update_preconditioners(
        self, masked_grad_list: tuple[Tensor, ...], step: Tensor | int, perform_amortized_computation: bool
    ) -> None: ...

    @abstractmethod
    def precondition(self, masked_grad_list: tuple[Tensor, ...]) -> tuple[Tensor, ...]: ...

    def precondition_blocks(self, masked_grad_list: tuple[Tensor, ...], first_block: int) -> tuple[Tensor, ...]:
        """`precondition` for the consecutive masked blocks `first_block`, `first_block + 1`, … (one per gradient),
        so that a step can form its directions a few blocks at a time. This default suits lists whose direction
        depends on the gradient alone; lists with per-block state override it."""
        return self.precondition(masked_grad_list)

    @abstractmethod
    def compress_preconditioner_list(self, local_grad_selector: tuple[bool, ...]) -> None: ...

    # Lists whose amortized computation can run after its step, in the background (Shampoo's root computations).
    defers_amortized_computation: bool = False

    def start_amortized_computation(self) -> None:
        """Start the amortized computation in the background (only where `defers_amortized_computation`)."""
        raise NotImplementedError(f"{type(self).__name__} has no amortized computation to defer.")

    def finish_amortized_computation(self) -> None:
        """Wait for a background amortized computation and store its results (nothing to wait for by default)."""

    @property
    def numel_list(self) -> tuple[int, ...]:
        return self._numel_list

    @property
    def dims_list(self) -> tuple[torch.Size, ...]:
        return self._dims_list

    @property
    def num_bytes_list(self) -> tuple[int, ...]:
        return self._num_bytes_list

    def numel(self) -> int:
        return sum(self._numel_list)

    def num_bytes(self) -> int:
        return sum(self._num_bytes_list)


class StatelessPreconditionerList(PreconditionerList):
    """A preconditioner that keeps no state: the direction is a function of the current gradient alone."""

    def update_preconditioners(
        self, masked_grad_list: tuple[Tensor, ...], step: Tensor | int, perform_amortized_computation: bool
    ) -> None:
        return

    def compress_preconditioner_list(self, local_grad_selector: tuple[bool, ...]) -> None:
        return


class SecondMomentPreconditionerList(PreconditionerList):
    """A list whose state S accumulates squared gradients, S ← beta2·S + weighting_factor·(G², G·Gᵀ, ...).

    Holds the shared hyperparameters and S's bias correction 1 - beta2^t (1.0 without correction or at beta2 = 1).
    """

    def __init__(
        self,
        block_list: tuple[Tensor, ...],
        beta2: float,
        weighting_factor: float,
        epsilon: float,
        use_bias_correction: bool,
    ) -> None:
        super().__init__(block_list)
        self._beta2 = beta2
        self._weighting_factor = weighting_factor
        self._epsilon = epsilon
        self._use_bias_correction = use_bias_correction
        self._bias_correction2 = 1.0

    def _update_bias_correction2(self, step: Tensor | int) -> None:
        if self._use_bias_correction and self._beta2 < 1.0:
            self._bias_correction2 = bias_correction(self._beta2, int(step))


def bias_correction(beta: float, step: int, scale: float = 1.0) -> float:
    """1 - scale·beta^step, evaluated in float32 on the CPU like the reference implementation.

    Matching its rounding keeps trajectories comparable digit for digit even where Shampoo amplifies tiny
    differences (nearly singular factors). Returns a Python number, so device kernels need no host sync.
    """
    return float(1.0 - scale * beta ** torch.tensor(step, dtype=torch.int64))
