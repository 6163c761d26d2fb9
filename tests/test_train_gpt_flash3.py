"""The FlashAttention-3 backend (the one record runs use), the flash-attn-4 backend and torch's varlen
backend against the reference backend, on CPU.

Stand-ins are installed before train_gpt is imported: a `flash_attn_interface` module whose plain-PyTorch
`flash_attn_varlen_func` has FA3's signature and semantics (packed (total, heads, dim) tensors, cu_seqlens
of sequence starts padded with the total length, causal, window_size=(left, 0): key j is visible to query
i of the same sequence iff i - left <= j <= i), a `flash_attn.cute.interface` module whose `_flash_attn_fwd` and
`_flash_attn_bwd` compute the same attention, its log-sum-exp and FlashAttention's backward in float64, and
train_gpt's `varlen_attn` is replaced by the same function behind torch's signature (torch's has no CPU kernel).
The tiny model then runs once with the `flash3`, `fa4` or `varlen` backend (cu_seqlens from the loaders' own
helper) and once with the `reference` backend (dense masks from the BOS tokens); losses and every parameter's
gradient must agree. The fa4 custom ops also pass torch.library.opcheck and compile.
"""

import json
import os
import subprocess
import sys

import pytest

from conftest import ROOT, TINY_BOS

CHECKS = r"""
import importlib.machinery, json, sys, types
import numpy as np
import torch

def plain_varlen(q, k, v, cu_seqlens, max_seqlen, scale, left):
    # packed (total, heads, dim) tensors, cu_seqlens of sequence starts padded with the total length: key j is
    # visible to query i of the same sequence iff i - left <= j <= i
    assert q.dim() == 3 and q.shape == k.shape == v.shape and cu_seqlens.dtype == torch.int32
    bounds = cu_seqlens.tolist()
    assert bounds == sorted(bounds) and bounds[-1] == q.size(0), bounds
    pieces = []
    for start, end in zip(bounds[:-1], bounds[1:]):
        if end == start:  # the padding at the end of cu_seqlens: empty sequences
            continue
        assert end - start <= max_seqlen
        scores = torch.einsum("qhd,khd->hqk", q[start:end].float(), k[start:end].float()) * scale
        i, j = torch.arange(end - start)[:, None], torch.arange(end - start)[None, :]
        visible = (j <= i) & (i - j <= left)
        probs = scores.masked_fill(~visible, float("-inf")).softmax(dim=-1)
        pieces.append(torch.einsum("hqk,khd->qhd", probs, v[start:end].float()).to(q.dtype))
    return torch.cat(pieces)

def flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale=None,
                           causal=False, window_size=(-1, -1), **unused):
    assert causal and window_size[1] == 0 and torch.equal(cu_seqlens_q, cu_seqlens_k) and max_seqlen_q == max_seqlen_k
    out = plain_varlen(q, k, v, cu_seqlens_q, max_seqlen_q, softmax_scale, window_size[0])
    return (out, None) if RETURN_LSE else out  # FA3 builds differ: some also return the log-sum-exp

def varlen_attn(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, *, scale=None, window_size=(-1, -1)):
    # torch.nn.attention.varlen.varlen_attn as torch 2.11 declares it; its window (left, 0) is FA3's
    assert isinstance(scale, float) and window_size[0] >= 0 and window_size[1] == 0
    assert torch.equal(cu_seq_q, cu_seq_k) and max_q == max_k
    return plain_varlen(query, key, value, cu_seq_q, max_q, scale, window_size[0])

def fa4_pieces(q, k, cu_seqlens, max_seqlen, scale, left):
    # per sequence: (start, end, scaled scores with the hidden keys at -inf), the padding's empty sequences skipped
    bounds = cu_seqlens.tolist()
    for start, end in zip(bounds[:-1], bounds[1:]):
        if end > start:
            assert end - start <= max_seqlen
            scores = torch.einsum("qhd,khd->hqk", q[start:end].double(), k[start:end].double()) * scale
            i, j = torch.arange(end - start)[:, None], torch.arange(end - start)[None, :]
            yield start, end, scores.masked_fill(~((j <= i) & (i - j <= left)), float("-inf"))

def fa4_forward(q, k, v, cu_seqlens_q=None, cu_seqlens_k=None, max_seqlen_q=None, max_seqlen_k=None, softmax_scale=None,
                causal=False, window_size_left=None, window_size_right=None, return_lse=False):
    # flash-attn-4's _flash_attn_fwd: (out, lse, ...), lse (heads, total) of the scaled scores for packed inputs
    assert causal and window_size_right == 0 and return_lse and isinstance(softmax_scale, float) and isinstance(window_size_left, int)
    assert torch.equal(cu_seqlens_q, cu_seqlens_k) and max_seqlen_q == max_seqlen_k
    out = plain_varlen(q, k, v, cu_seqlens_q, max_seqlen_q, softmax_scale, window_size_left)
    lse = torch.zeros(q.size(1), q.size(0))
    for start, end, scores in fa4_pieces(q, k, cu_seqlens_q, max_seqlen_q, softmax_scale, window_size_left):
        lse[:, start:end] = scores.logsumexp(-1).float()
    return out, lse, None, None, None

def fa4_backward(q, k, v, out, dout, lse, softmax_scale=None, causal=False, softcap=0.0, window_size_left=None,
                 window_size_right=None, cu_seqlens_q=None, cu_seqlens_k=None, max_seqlen_q=None, max_seqlen_k=None):
    # flash-attn-4's _flash_attn_bwd: (dq, dk, dv) from the saved out and lse, FlashAttention's backward in float64
    assert causal and softcap == 0.0 and window_size_right == 0 and lse.shape == (q.size(1), q.size(0))
    assert out.shape == dout.shape == q.shape and dout.is_contiguous()
    dq, dk, dv = (torch.zeros_like(t, dtype=torch.float64) for t in (q, k, v))
    for start, end, scores in fa4_pieces(q, k, cu_seqlens_q, max_seqlen_q, softmax_scale, window_size_left):
        probs = (scores - lse[:, start:end, None].double()).exp()
        d_out = dout[start:end].double()
        delta = (d_out * out[start:end].double()).sum(-1).T[:, :, None]  # (heads, queries, 1)
        d_probs = torch.einsum("qhd,khd->hqk", d_out, v[start:end].double())
        d_scores = probs * (d_probs - delta) * softmax_scale
        dv[start:end] = torch.einsum("hqk,qhd->khd", probs, d_out)
        dq[start:end] = torch.einsum("hqk,khd->qhd", d_scores, k[start:end].double())
        dk[start:end] = torch.einsum("hqk,qhd->khd", d_scores, q[start:end].double())
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)

def package(name, **attributes):
    module = types.ModuleType(name)
    module.__spec__ = importlib.machinery.ModuleSpec(name, None)
    module.__dict__.update(attributes)
    sys.modules[name] = module
    return module

interface = package("flash_attn.cute.interface", _flash_attn_fwd=fa4_forward, _flash_attn_bwd=fa4_backward)
package("flash_attn", cute=package("flash_attn.cute", interface=interface))

stand_in = types.ModuleType("flash_attn_interface")
stand_in.flash_attn_varlen_func = flash_attn_varlen_func
sys.modules["flash_attn_interface"] = stand_in
import train_gpt as tg
tg.varlen_attn = varlen_attn  # torch's has no CPU kernel
BACKEND = "%(backend)s"

BOS, VOCAB, BLOCK, T = %(bos)d, %(vocab)d, 16, 128
results = {"auto_on_cuda": tg.choose_attention_backend("auto", torch.device("cuda"), (9, 0))}
if BACKEND == "fa4":  # auto takes it on sm_90 without FA3, the tested version installed
    tg.flash_attn_varlen_func = None
    tg.flash_attn_4_version = lambda: tg.FLASH_ATTN_4_TESTED  # the stand-in has no distribution metadata
    results["auto_on_cuda"] = [tg.choose_attention_backend("auto", torch.device("cuda"), c) for c in ((9, 0), (10, 0))]
    results["fa4_on_cuda"] = tg.choose_attention_backend("fa4", torch.device("cuda"), (9, 0))
RETURN_LSE = False

def model(backend):
    torch.manual_seed(0)
    m = tg.GPT(VOCAB, 64, 2, 256, BLOCK, 1, tg.attention_backend(backend, BLOCK, BOS), torch.float32)
    with torch.no_grad():  # the zero-initialized output projections, gates and head would hide attention entirely
        for p in m.parameters():
            if p.abs().sum() == 0:
                p.normal_(0, 0.05)
        for block in m.blocks:
            if block.attn is not None:
                block.attn.qkvo_w.view(4, 64, 64)[3].normal_(0, 0.05)
    return m

def tokens(doc_lengths, start_mid_document):
    rng = np.random.default_rng(sum(doc_lengths))
    ids = rng.integers(0, BOS, size=T + 1)
    starts = np.cumsum([0] + doc_lengths[:-1]) + (7 if start_mid_document else 0)
    ids[starts[starts <= T]] = BOS
    return ids

layouts = {
    "long documents (> windows)": ([100, 29], False),
    "documents shorter than a block": ([5, 3, 11, 2, 60, 48], False),
    "batch starting mid-document": ([40, 9, 80], True),
}
for RETURN_LSE in ((False, True) if BACKEND == "flash3" else (False,)):
    for name, (lengths, mid) in layouts.items():
        buffer = tokens(lengths, mid)
        # as the loaders compute them: train batches start at a BOS, validation windows anywhere
        doc_starts = np.concatenate([[0], tg.bos_positions(buffer[:-1], BOS)]) if mid else tg.bos_positions(buffer[:-1], BOS)
        batch = tg._batch(buffer, doc_starts, tg.max_docs_per_batch(T), "test", torch.device("cpu"))
        for short, long in ((1, 3), (2, 5), (3, 11)):
            losses, grads = {}, {}
            for backend in (BACKEND, "reference"):
                m = model(backend)
                window_short, window_long = m.attention.window_args(short, long, torch.device("cpu"))
                loss = m(batch.inputs, batch.targets, batch.cu_seqlens if backend == BACKEND else None, window_short, window_long, T)
                loss.backward()
                losses[backend] = loss.item()
                grads[backend] = {n: p.grad.clone() for n, p in m.named_parameters() if p.grad is not None}
            worst = max(((grads[BACKEND][n] - g).norm() / g.norm().clamp_min(1e-30)).item() for n, g in grads["reference"].items())
            results[f"{name}, windows {short}/{long} blocks, lse {RETURN_LSE}"] = dict(
                loss_backend=losses[BACKEND], loss_reference=losses["reference"], worst_grad_error=worst,
                same_grads=sorted(grads[BACKEND]) == sorted(grads["reference"]),
                documents=int((batch.cu_seqlens < T).sum()),
            )
print(json.dumps(results))
"""


@pytest.mark.parametrize("backend, cases", [("flash3", 18), ("fa4", 9), ("varlen", 9)])
def test_varlen_backends_equal_the_reference_backend(backend: str, cases: int):
    env = dict(os.environ, OMP_NUM_THREADS="1")
    script = CHECKS % dict(bos=TINY_BOS, vocab=TINY_BOS + 1, backend=backend)
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=600, env=env, cwd=ROOT)
    assert result.returncode == 0, result.stderr[-3000:]
    results = json.loads(result.stdout.strip().splitlines()[-1])
    assert results.pop("auto_on_cuda") == (["fa4", "flex"] if backend == "fa4" else "flash3")
    if backend == "fa4":
        assert results.pop("fa4_on_cuda") == "fa4"
    assert len(results) == cases
    for case, r in results.items():
        assert abs(r["loss_backend"] - r["loss_reference"]) < 1e-5 * r["loss_reference"], (case, r)
        assert r["same_grads"] and r["worst_grad_error"] < 1e-4, (case, r)
    # the layouts really differ: many documents in one, a mid-document start (an extra leading piece) in another
    assert results["documents shorter than a block, windows 1/3 blocks, lse False"]["documents"] == 6
    assert results["batch starting mid-document, windows 1/3 blocks, lse False"]["documents"] == 4


# the stand-ins above, then train_gpt's fa4 custom ops checked by torch.library.opcheck (schema, fake kernels
# against the real ones' shapes and strides, autograd registration) and compiled (aot_eager: no C compiler)
OPS_CHECKS = CHECKS[: CHECKS.index("import train_gpt as tg")] + r"""
import train_gpt as tg
torch.manual_seed(0)
T, H, D, WINDOW = 96, 2, 16, 20
cu_seqlens = torch.tensor([0, 30, 75, T, T, T], dtype=torch.int32)  # padded as the loader pads
q, k, v = (torch.randn(T, H, D, requires_grad=True) for _ in range(3))
args = (q, k, v, cu_seqlens, 64, 0.25, WINDOW)
torch.library.opcheck(tg.fa4_forward, args)
out, lse = tg.fa4_forward(*args)
grad = torch.randn_like(out)
torch.library.opcheck(tg.fa4_backward, (grad, q.detach(), k.detach(), v.detach(), out.detach(), lse, cu_seqlens, 64, 0.25, WINDOW))
transposed = q.detach().transpose(0, 1).contiguous().transpose(0, 1)  # (T, H, D) with H outermost in memory
torch.library.opcheck(tg.fa4_backward, (grad, transposed, k.detach(), v.detach(), out.detach(), lse, cu_seqlens, 64, 0.25, WINDOW))

backend = tg.attention_backend("fa4", 10, 0)
inputs = backend.prepare(None, cu_seqlens, {"short": 2}, 64)
attend = lambda q, k, v: backend(q[None], k[None], v[None], inputs, "short", 0.25)[0]
eager = torch.autograd.grad((attend(q, k, v) * grad).sum(), (q, k, v))
compiled = torch.compile(attend, backend="aot_eager", fullgraph=True)
traced = torch.autograd.grad((compiled(q, k, v) * grad).sum(), (q, k, v))
print(json.dumps(dict(same_grads=all(torch.equal(a, b) for a, b in zip(eager, traced)), lse_shape=list(lse.shape),
                      lse_requires_grad=lse.requires_grad, window_tokens=inputs.windows["short"] * backend.block_size)))
"""


def test_fa4_custom_ops_pass_opcheck_and_compile():
    env = dict(os.environ, OMP_NUM_THREADS="1")
    script = OPS_CHECKS % dict(bos=TINY_BOS, vocab=TINY_BOS + 1, backend="fa4")
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=600, env=env, cwd=ROOT)
    assert result.returncode == 0, result.stderr[-3000:]
    assert json.loads(result.stdout.strip().splitlines()[-1]) == dict(same_grads=True, lse_shape=[2, 96], lse_requires_grad=False, window_tokens=20)
