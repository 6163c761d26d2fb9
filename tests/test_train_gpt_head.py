"""The FP8 head of train_gpt.py: the fused loss op against the head written out op by op, the eager soft-capped
cross-entropy's gradient against autograd's, and the head's choice of formula."""

import pytest
import torch
import torch.nn.functional as F

import train_gpt as tg


# ---- FP8 head and its fused loss (torch._scaled_mm runs on the CPU; on CUDA it needs compute capability >= 8.9) ----
def _head_inputs(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    torch.manual_seed(seed)
    x = tg.rms_norm(torch.randn(64, 768)).bfloat16().requires_grad_()
    w = (torch.randn(256, 768) * 0.05).bfloat16().requires_grad_()
    return x, w, torch.randint(0, 256, (64,))


def _unfused_fp8_head(x: torch.Tensor, w: torch.Tensor, targets: torch.Tensor) -> tuple:
    """The head written out op by op: e4m3 logits, the loss and e5m2 logit gradient of softcap_ce_e5m2_eager,
    and the two backward products."""
    x_f8 = x.detach().div(tg.FP8_X_SCALE).to(torch.float8_e4m3fn)
    w_f8 = w.detach().div(tg.FP8_W_SCALE).to(torch.float8_e4m3fn)
    one = lambda v: torch.tensor(v, dtype=torch.float32)
    logits = torch._scaled_mm(x_f8, w_f8.T, scale_a=one(tg.FP8_X_SCALE), scale_b=one(tg.FP8_W_SCALE), out_dtype=torch.bfloat16, use_fast_accum=True)
    losses, g, g_t = tg.softcap_ce_e5m2_eager(logits, targets, tg.FP8_GRAD_SCALE)
    g_scale = one(tg.FP8_GRAD_SCALE)
    grad_x = torch._scaled_mm(g, w_f8.T.contiguous().T, scale_a=g_scale, scale_b=one(tg.FP8_W_SCALE), out_dtype=torch.bfloat16)
    grad_w = torch._scaled_mm(g_t, x_f8.T.contiguous().T, scale_a=g_scale, scale_b=one(tg.FP8_X_SCALE), out_dtype=torch.float32)
    return losses.sum(), grad_x, grad_w.bfloat16()


def test_fp8_head_loss_equals_the_unfused_head_bitwise():
    """Forward and backward of the fused op against the head written out step by step (loss.backward(): bitwise)."""
    x, w, targets = _head_inputs()
    loss = tg.fp8_head_loss(x, w, targets, tg.FP8_X_SCALE, tg.FP8_W_SCALE, tg.FP8_GRAD_SCALE)[0]
    loss.backward()
    want_loss, want_grad_x, want_grad_w = _unfused_fp8_head(x, w, targets)
    assert torch.equal(loss, want_loss)
    assert x.grad.dtype == torch.bfloat16 and w.grad.dtype == torch.bfloat16 and w.grad.is_contiguous()
    assert torch.equal(x.grad, want_grad_x) and torch.equal(w.grad, want_grad_w)


def test_softcap_ce_eager_gradient_is_autograds():
    """The written-out gradient against autograd of the eager formula, both cast through bf16 to e5m2: equal
    codes except where fp32 rounding puts a value on the other side of a bf16/e5m2 boundary (one code away)."""
    torch.manual_seed(3)
    logits = (torch.randn(96, 200) * 4).bfloat16()
    targets = torch.randint(0, 200, (96,))
    losses, g, g_t = tg.softcap_ce_e5m2_eager(logits, targets, tg.FP8_GRAD_SCALE)
    leaf = logits.clone().requires_grad_()
    want = tg.softcapped_cross_entropy(leaf, targets, "none")
    want.sum().backward()
    torch.testing.assert_close(losses, want.detach(), rtol=1e-6, atol=1e-6)
    codes = g.view(torch.uint8).long()
    want_codes = leaf.grad.div(tg.FP8_GRAD_SCALE).to(torch.float8_e5m2).view(torch.uint8).long()
    assert (codes - want_codes).abs().max() <= 1 and (codes != want_codes).float().mean() < 0.01
    assert (want_codes & 0x7F).gt(0).float().mean() > 0.5  # mostly nonzero gradients: the comparison means something
    assert torch.equal(g_t.view(torch.uint8), g.view(torch.uint8).T)


def test_fp8_head_loss_backward_scales_by_the_incoming_gradient():
    """The incoming gradient rides in _scaled_mm's scale: a power of two scales the gradients exactly."""
    x, w, targets = _head_inputs(1)
    (tg.fp8_head_loss(x, w, targets, tg.FP8_X_SCALE, tg.FP8_W_SCALE, tg.FP8_GRAD_SCALE)[0] * 4.0).backward()
    grad_x, grad_w = x.grad.clone(), w.grad.clone()
    x.grad = w.grad = None
    tg.fp8_head_loss(x, w, targets, tg.FP8_X_SCALE, tg.FP8_W_SCALE, tg.FP8_GRAD_SCALE)[0].backward()
    assert torch.equal(grad_x, 4 * x.grad) and torch.equal(grad_w, 4 * w.grad)
    assert grad_x.abs().sum() > 0


def test_fp8_head_loss_tracks_the_bf16_head():
    """FP8 quantization error stays small against the plain bf16 head with the same loss."""
    x, w, targets = _head_inputs(2)
    loss = tg.fp8_head_loss(x, w, targets, tg.FP8_X_SCALE, tg.FP8_W_SCALE, tg.FP8_GRAD_SCALE)[0]
    loss.backward()
    xr, wr = x.detach().float().requires_grad_(), w.detach().float().requires_grad_()
    reference = tg.softcapped_cross_entropy(xr @ wr.T, targets, "sum")
    reference.backward()
    assert abs(loss.item() - reference.item()) / reference.item() < 0.01
    for got, want in ((x.grad, xr.grad), (w.grad, wr.grad)):
        assert (got.float() - want).norm() / want.norm() < 0.15


def test_lm_head_loss_uses_the_eager_formula_outside_fp8_training():
    head = tg.LMHead(32, 128)
    torch.nn.init.normal_(head.weight)
    x, targets = torch.randn(1, 10, 32), torch.randint(0, 128, (10,))
    for training, reduction in ((True, "sum"), (False, "mean")):
        head.train(training)
        want = F.cross_entropy(30 * torch.sigmoid(F.linear(x, head.weight).float() / 7.5).view(10, 128), targets, reduction=reduction)
        assert torch.equal(head.loss(x, targets), want)


@pytest.mark.filterwarnings("ignore")
def test_fused_head_loss_traces_into_one_graph():
    """Dynamo traces the FP8 head loss op through its fake implementation, as torch.compile(fullgraph=True) does
    on the GPU, inside a graph with other work, and the traced graph runs forward and backward."""
    graphs = []

    def counting_backend(graph_module, example_inputs):
        graphs.append(graph_module)
        return graph_module.forward

    def block(x, w_fc, w_proj, w_head, targets):
        h = tg.rms_norm(x + F.linear(F.relu(x @ w_fc).square(), w_proj))
        return tg.fp8_head_loss(h, w_head, targets, tg.FP8_X_SCALE, tg.FP8_W_SCALE, tg.FP8_GRAD_SCALE)[0]

    torch.manual_seed(5)
    x = torch.randn(64, 768).bfloat16().requires_grad_()
    w_fc = (torch.randn(768, 256) * 0.05).bfloat16().requires_grad_()
    w_proj = (torch.randn(768, 256) * 0.05).bfloat16().requires_grad_()
    w_head = (torch.randn(128, 768) * 0.05).bfloat16().requires_grad_()
    targets = torch.randint(0, 128, (64,))
    loss = torch.compile(block, fullgraph=True, backend=counting_backend)(x, w_fc, w_proj, w_head, targets)
    loss.backward()
    assert len(graphs) == 1 and torch.isfinite(loss)
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in (x, w_fc, w_proj, w_head))
