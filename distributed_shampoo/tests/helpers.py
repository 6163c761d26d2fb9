"""Helpers shared by several test files: the record's arguments, the plain float64 Shampoo reference and a run of
DistributedShampoo against it, a run whose gradient selection changes, and a stand-in for the background
computation of deferred roots."""

from typing import Any

import torch
from torch import Tensor

from distributed_shampoo import (
    AdamPreconditionerConfig,
    DistributedShampoo,
    RootInvShampooPreconditionerConfig,
    WeightDecayType,
)


def record_config(**overrides: Any) -> dict[str, Any]:
    """The Track 3 record's DistributedShampoo arguments (train_gpt_shampoo.py, build_shampoo), with overrides."""
    config = dict(
        lr=0.0015,
        betas=(0.9, 0.95),
        weight_decay=0.2,
        weight_decay_type=WeightDecayType.DECOUPLED,
        max_preconditioner_dim=8192,
        precondition_frequency=5,
        start_preconditioning_step=-1,
        grafting_config=AdamPreconditionerConfig(beta2=0.95, epsilon=1e-10),
    )
    config.update(overrides)
    return config


# ------------------------------------------------------------------------------- float64 reference of the math


def inverse_root(matrix: Tensor, root: int, epsilon: float) -> Tensor:
    """(A + eps·I)^(-1/root) via eigh, lifting the spectrum when round-off leaves λ_min < eps."""
    eigenvalues, eigenvectors = torch.linalg.eigh(matrix + epsilon * torch.eye(matrix.shape[0], dtype=matrix.dtype))
    if eigenvalues.min() < epsilon:
        eigenvalues = eigenvalues - eigenvalues.min() + epsilon
    return eigenvectors @ torch.diag(eigenvalues ** (-1.0 / root)) @ eigenvectors.T


class ReferenceBlock:
    """Plain Shampoo + Adam grafting + decoupled weight decay for one 1-D or 2-D block, in float64."""

    def __init__(self, shape: tuple[int, ...]) -> None:
        self.factors = [torch.zeros(size, size, dtype=torch.float64) for size in shape]
        self.inverse_roots = [torch.eye(size, dtype=torch.float64) for size in shape]
        self.second_moment = torch.zeros(shape, dtype=torch.float64)
        self.first_moment = torch.zeros(shape, dtype=torch.float64)

    def step(self, weight: Tensor, grad: Tensor, t: int, c: dict[str, Any], deferred: bool = False) -> None:
        """One step; `deferred`: a root step's new inverse roots are computed after its update, so they are first
        used at the next step (`ShampooRuntimeConfig(defer_amortized_computation=True)`)."""
        beta1, beta2 = c["betas"]
        graft_beta2, graft_eps = c["graft_beta2"], c["graft_eps"]
        if grad.dim() == 2:
            self.factors[0] = beta2 * self.factors[0] + (1 - beta2) * grad @ grad.T
            self.factors[1] = beta2 * self.factors[1] + (1 - beta2) * grad.T @ grad
            root = 4
        else:
            self.factors[0] = beta2 * self.factors[0] + (1 - beta2) * torch.outer(grad, grad)
            root = 2
        self.second_moment = graft_beta2 * self.second_moment + (1 - graft_beta2) * grad**2
        root_step = t == c["start"] or (t % c["frequency"] == 0 and t > c["start"])
        if root_step and not deferred:
            self.inverse_roots = [inverse_root(f / (1 - beta2**t), root, c["epsilon"]) for f in self.factors]
        self.first_moment = beta1 * self.first_moment + (1 - beta1) * grad
        m_hat = self.first_moment / (1 - beta1**t)
        adam = m_hat / ((self.second_moment / (1 - graft_beta2**t)).sqrt() + graft_eps)
        if t < c["start"]:
            direction = adam
        else:
            shampoo = self.inverse_roots[0] @ m_hat @ self.inverse_roots[1] if grad.dim() == 2 else self.inverse_roots[0] @ m_hat
            direction = shampoo * adam.norm() / (shampoo.norm() + 1e-16)
        weight -= c["lr"] * (direction + c["weight_decay"] * weight)
        if root_step and deferred:
            self.inverse_roots = [inverse_root(f / (1 - beta2**t), root, c["epsilon"]) for f in self.factors]


# Param shapes and how the reference blocks them with max_preconditioner_dim = 4:
# (5, 3) → blocks rows 0-3 and row 4 (2-D); (7,) → (4,), (3,); (2, 2) → merged to (4,) (1-D); (3, 4) has 12 > 4
# elements, stays 2-D and is cut into columns 0-3 → one (3, 4) block.
REFERENCE_SHAPES = [(5, 3), (7,), (2, 2), (3, 4)]


def reference_blocks(tensor: Tensor) -> list[Tensor]:
    if tensor.shape == (5, 3):
        return [tensor[:4], tensor[4:]]
    if tensor.shape == (7,):
        return [tensor[:4], tensor[4:]]
    if tensor.shape == (2, 2):
        return [tensor.view(4)]
    return [tensor]


def random_problem(num_steps: int, dtype: torch.dtype) -> tuple[list[Tensor], list[list[Tensor]]]:
    generator = torch.Generator().manual_seed(0)
    initial = [torch.randn(shape, generator=generator, dtype=torch.float64).to(dtype) for shape in REFERENCE_SHAPES]
    grads = [
        [torch.randn(shape, generator=generator, dtype=torch.float64).to(dtype) for shape in REFERENCE_SHAPES]
        for _ in range(num_steps)
    ]
    return initial, grads



def compare_with_reference(
    num_steps: int, dtype: torch.dtype, deferred: bool = False, device: str = "cpu", **optimizer_extra: Any
) -> None:
    """DistributedShampoo (Adam grafting, decoupled weight decay, max_preconditioner_dim 4) on `REFERENCE_SHAPES`
    with parameters on `device`, against `ReferenceBlock` in float64 after `num_steps` steps; `deferred`: with
    the reference's deferred root schedule; `optimizer_extra`: further DistributedShampoo arguments."""
    c = dict(lr=0.05, betas=(0.9, 0.95), epsilon=1e-6, weight_decay=0.2, frequency=2, start=3, graft_beta2=0.95, graft_eps=1e-8)
    initial, grads = random_problem(num_steps, dtype)

    params = [torch.nn.Parameter(value.to(device, copy=True)) for value in initial]
    optimizer = DistributedShampoo(
        params,
        lr=c["lr"],
        betas=c["betas"],
        epsilon=c["epsilon"],
        weight_decay=c["weight_decay"],
        max_preconditioner_dim=4,
        precondition_frequency=c["frequency"],
        start_preconditioning_step=c["start"],
        grafting_config=AdamPreconditionerConfig(beta2=c["graft_beta2"], epsilon=c["graft_eps"]),
        preconditioner_config=RootInvShampooPreconditionerConfig(factor_matrix_dtype=dtype, inv_factor_matrix_dtype=dtype),
        **optimizer_extra,
    )
    weights = [value.to(torch.float64).clone() for value in initial]
    blocks = [ReferenceBlock(tuple(b.shape)) for w in weights for b in reference_blocks(w)]
    for t, step_grads in enumerate(grads, start=1):
        for param, grad in zip(params, step_grads, strict=True):
            param.grad = grad.to(device, copy=True)
        optimizer.step()
        weight_blocks = [b for w in weights for b in reference_blocks(w)]
        grad_blocks = [b for g in step_grads for b in reference_blocks(g.to(torch.float64))]
        for block, weight, grad in zip(blocks, weight_blocks, grad_blocks, strict=True):
            block.step(weight, grad, t, c, deferred)

    # Bias corrections are float32 scalars (as in the reference implementation), hence ~1e-7 even in float64.
    tolerance = dict(rtol=1e-6, atol=1e-7) if dtype == torch.float64 else dict(rtol=1e-4, atol=1e-5)
    for param, weight in zip(params, weights, strict=True):
        torch.testing.assert_close(param.detach().cpu().to(torch.float64), weight, **tolerance)


def train_with_a_gradient_missing_at_step_2(device: str = "cpu", **optimizer_extra: Any) -> list[Tensor]:
    """The parameters after 4 record-like steps of a (4, 3) parameter (one block with max_preconditioner_dim 4:
    12 > 4 elements are not merged, and no dim exceeds 4) and a (5,) one (two blocks), the latter without a gradient
    at step 2 (0-based 1), so that the gradient selection changes twice."""
    params = [torch.nn.Parameter(torch.ones(4, 3, device=device)), torch.nn.Parameter(torch.ones(5, device=device))]
    config = record_config(lr=0.1, max_preconditioner_dim=4, precondition_frequency=2)
    optimizer = DistributedShampoo(params, **config, **optimizer_extra)
    for step in range(4):
        generator = torch.Generator().manual_seed(step)
        params[0].grad = torch.randn(4, 3, generator=generator).to(device)
        params[1].grad = None if step == 1 else torch.randn(5, generator=generator).to(device)
        optimizer.step()
    return [p.detach().cpu() for p in params]


# -------------------------------------------------------------------------------------------- deferred roots


class AtTheEndOfTheStep:
    """Stands in for `_BackgroundComputation`: the same function, run at once on the caller's thread and stream."""

    def __init__(self, function: Any, device: torch.device) -> None:
        function()

    def wait(self) -> None:
        pass
