"""train_gpt.py's CUDA-only code paths, on a GPU (skipped without one): the fused soft-capped CE kernel's
hardware instructions (casts, reciprocal) against its integer casts and division, which the CPU interpreter tests (tests/test_train_gpt_triton.py)
check against the eager formula, and the kernel against that formula on CUDA.

    python -m pytest -q tests/test_train_gpt_cuda.py      # on a CUDA machine
"""

import pytest
import torch

import train_gpt as tg

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available() or tg.triton is None or torch.cuda.get_device_capability() < (8, 9),
    reason="needs a CUDA GPU with FP8 casts (compute capability 8.9 or newer) and Triton",
)


@pytest.mark.parametrize("tile", [tg.SOFTCAP_CE_TILE, (16, 64, 4)])
def test_softcap_ce_hardware_instructions_equal_the_portable_path(tile: tuple[int, int, int]) -> None:
    torch.manual_seed(0)
    logits = (torch.randn(4096, 50304, device="cuda") * 4).bfloat16()
    logits[0, :6] = torch.tensor([60.0, -60.0, 0.0, 1e-3, -1e-3, 30.0])  # saturated and near-zero soft caps
    logits[1] = 0.0  # a flat row: every gradient is small, many codes subnormal
    targets = torch.randint(0, 50304, (4096,), device="cuda")
    hardware = tg.softcap_ce_e5m2(logits, targets, tg.FP8_GRAD_SCALE, tile, hardware=True)
    integer = tg.softcap_ce_e5m2(logits, targets, tg.FP8_GRAD_SCALE, tile, hardware=False)
    assert torch.equal(hardware[0], integer[0])
    for got, want in zip(hardware[1:], integer[1:]):
        assert torch.equal(got.view(torch.uint8), want.view(torch.uint8))
    assert int((hardware[1].view(torch.uint8) & 0x7F).gt(0).sum()) > 0  # not all zero


def test_softcap_ce_kernel_matches_eager_on_cuda() -> None:
    torch.manual_seed(1)
    logits = (torch.randn(512, 50304, device="cuda") * 3).bfloat16()
    targets = torch.randint(0, 50304, (512,), device="cuda")
    losses, grad, grad_t = tg.softcap_ce_e5m2(logits, targets, tg.FP8_GRAD_SCALE)
    want_losses, want_grad, _ = tg.softcap_ce_e5m2_eager(logits, targets, tg.FP8_GRAD_SCALE)
    assert ((losses - want_losses).abs() / want_losses).max().item() < 1e-5
    got, want = grad.view(torch.uint8).long(), want_grad.view(torch.uint8).long()
    assert (got - want).abs().max().item() <= 1 and (got != want).float().mean().item() < 0.02
    assert torch.equal(grad_t.view(torch.uint8), grad.view(torch.uint8).T.contiguous())
