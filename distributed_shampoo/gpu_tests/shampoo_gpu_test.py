"""CUDA checks (not collected by CI): the record configuration on a GPU equals the CPU run, roots computed
concurrently on several streams equal the sequential ones bitwise, and the DDP distributor over NCCL equals
one process bitwise.

    python -m pytest -q distributed_shampoo/gpu_tests            # needs 1 GPU (2 for the NCCL test)
"""

import os
import tempfile
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from distributed_shampoo import DDPDistributedConfig, DistributedShampoo, SingleDeviceDistributedConfig
from distributed_shampoo.shampoo_types import ShampooRuntimeConfig
from distributed_shampoo.tests.distributed_shampoo_test import record_config

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

# 96·96 > 8192: the matrices stay 2-D, one block each. Every factor is full rank by the first root step (5 grads
# of rank 96 ≥ 256): with the record's epsilon 1e-12 a rank-deficient factor's null space would turn solver
# round-off into O(1) differences between cuSOLVER and LAPACK.
SHAPES = [(96, 96), (256, 96), (96, 256)]
NUM_STEPS = 12


def run(device: str, distributed_config: Any = None, streams: int = 1, shapes: list[tuple[int, int]] = SHAPES) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(shape, generator=generator).to(device)) for shape in shapes]
    optimizer = DistributedShampoo(
        params,
        **record_config(distributed_config=distributed_config or SingleDeviceDistributedConfig()),
        shampoo_runtime_config=ShampooRuntimeConfig(num_amortized_computation_streams=streams),
    )
    for _ in range(NUM_STEPS):
        for param in params:
            param.grad = torch.randn(param.shape, generator=generator).to(device)
        optimizer.step()
    return [param.detach().cpu() for param in params]


def test_cuda_equals_cpu() -> None:
    previous = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False  # compare fp32 against fp32
    try:
        cuda = run("cuda")
    finally:
        torch.backends.cuda.matmul.allow_tf32 = previous
    for got, want in zip(cuda, run("cpu"), strict=True):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)


def test_concurrent_roots_equal_sequential_roots_bitwise() -> None:
    # Several blocks of each size, so that every stream gets work and the sequential run batches its eigh calls.
    shapes = SHAPES * 3
    sequential = run("cuda", shapes=shapes)
    for streams in (2, 4):
        for got, want in zip(run("cuda", streams=streams, shapes=shapes), sequential, strict=True):
            torch.testing.assert_close(got, want, rtol=0, atol=0)


def _nccl_worker(rank: int, init_file: str, communicate_params: bool, results: Any) -> None:
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", init_method=f"file://{init_file}", rank=rank, world_size=2)
    try:
        config = DDPDistributedConfig(communication_dtype=torch.float32, num_trainers_per_group=2, communicate_params=communicate_params)
        results[rank] = run(f"cuda:{rank}", config)
    finally:
        dist.destroy_process_group()


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
@pytest.mark.parametrize("communicate_params", [True, False])
def test_ddp_over_nccl_equals_one_process(communicate_params: bool) -> None:
    with tempfile.TemporaryDirectory() as directory:
        results = mp.Manager().dict()
        mp.start_processes(_nccl_worker, args=(os.path.join(directory, "init"), communicate_params, results), nprocs=2, start_method="spawn")
        expected = run("cuda:0")
        for rank in range(2):
            for got, want in zip(results[rank], expected, strict=True):
                torch.testing.assert_close(got, want, rtol=0, atol=0)
