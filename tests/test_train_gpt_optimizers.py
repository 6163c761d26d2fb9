"""The optimizers of train_gpt.py: Muon's groups and step, Newton-Schulz, DistAdam against plain references."""

import math

import pytest
import torch

import train_gpt as tg
from conftest import record_model, tiny_model


@pytest.mark.parametrize("world_size", [1, 2, 4, 8])
def test_muon_groups_of_the_record_model(world_size):
    groups = tg.muon_groups(tg.muon_parameters(record_model(world_size)), world_size)
    assert [len(g.params) for g in groups] == [1, 10, 16, 16]
    assert [g.padded for g in groups] == [math.ceil(n / world_size) * world_size for n in (1, 10, 16, 16)]
    assert [g.params[0].module_tag for g in groups] == ["smear_gate", "attn_gate", "attn", "mlp"]
    assert [p.module_tag for p in groups[2].params] == ["attn"] * 10 + ["mlp"] * 6
    owned = [p for g in groups for r in range(world_size) for p in g.owned(r)]
    assert len(owned) == 43 == len({id(p) for p in owned}), "every Muon matrix is owned by exactly one rank"
    for group in groups:  # _orthogonalize_chunk slices (no list index, no host sync): attn entries lead each chunk
        for rank in range(world_size):
            tags = [p.module_tag for p in group.owned(rank)]
            assert tags == sorted(tags, key=lambda tag: tag != "attn"), (rank, tags)


def test_muon_layout_at_eight_ranks_never_mixes_attn_and_mlp():
    groups = tg.muon_groups(tg.muon_parameters(record_model()), 8)
    labels = lambda group, rank: [p.label for p in groups[group].owned(rank)]
    assert labels(0, 0) == ["smear_gate.weight"] and all(labels(0, r) == [] for r in range(1, 8))
    assert [len(labels(1, r)) for r in range(8)] == [2, 2, 2, 2, 2, 0, 0, 0]
    attn_layers = [[int(l.split(".")[1]) for l in labels(2, r)] for r in range(5)]
    assert attn_layers == [[1, 2], [3, 4], [5, 6], [8, 9], [10, 11]]
    assert [labels(2, r) for r in range(5, 8)] == [[f"blocks.{i}.mlp.c_fc", f"blocks.{i}.mlp.c_proj"] for i in (1, 2, 3)]
    assert [labels(3, r) for r in range(8)] == [[f"blocks.{i}.mlp.c_fc", f"blocks.{i}.mlp.c_proj"] for i in range(4, 12)]
    for group in groups:
        for rank in range(8):
            assert len({p.module_tag for p in group.owned(rank)}) <= 1



# ---- optimizers ----
def plain_adam_reference(param: torch.Tensor, grads: list[torch.Tensor], lr: float, betas=(0.8, 0.95), eps=1e-8) -> torch.Tensor:
    """DistAdam's update (docs/track1_recipe.md#distadam) in float64, with moments rounded to bf16 after each update as DistAdam stores them."""
    p = param.double().clone()
    m = torch.zeros_like(p)
    v = torch.zeros_like(p)
    for t, g in enumerate(grads, start=1):
        g = g.double()
        m = (betas[0] * m + (1 - betas[0]) * g).bfloat16().double()
        v = (betas[1] * v + (1 - betas[1]) * g * g).bfloat16().double()
        p = p - lr * math.sqrt(1 - betas[1] ** t) / (1 - betas[0] ** t) * m / (v.sqrt() + eps)
    return p


def test_dist_adam_matches_a_plain_adam_reference():
    torch.manual_seed(0)
    a = torch.nn.Parameter(torch.randn(16, 8))
    b = torch.nn.Parameter(torch.randn(24))
    tg.tag(a, lr_mul=75.0)
    tg.tag(b, lr_mul=5.0)
    start_a, start_b = a.detach().clone(), b.detach().clone()
    opt = tg.DistAdam([a, b], lr=0.008, betas=(0.8, 0.95), eps=1e-8, weight_decay=0.0, rank=0, world_size=1)
    grads = [(torch.randn(16, 8), torch.randn(24)) for _ in range(4)]
    for ga, gb in grads:
        a.grad, b.grad = ga.clone(), gb.clone()
        opt.step()
    # bf16 moments and a bf16 ratio m / (sqrt(v) + eps) carry ~2^-8 relative error per step; a wrong bias
    # correction (e.g. none: the first step's factor is sqrt(0.05) / 0.2 = 1.12) would be 10x outside this.
    for param, start, lr, index in ((a, start_a, 0.008 * 75, 0), (b, start_b, 0.008 * 5, 1)):
        expected = plain_adam_reference(start, [g[index] for g in grads], lr)
        assert (param.detach().double() - expected).abs().max() < 0.01 * lr * len(grads)
        assert (param.detach().double() - start.double()).abs().max() > 0.5 * lr  # it did move
    assert opt.state[a]["exp_avg"].dtype == torch.bfloat16 and int(opt.state[a]["step"]) == 4


def record_adam_steps(param: torch.Tensor, grads: list[torch.Tensor], lr: float, betas=(0.8, 0.95), eps=1e-8) -> torch.Tensor:
    """The record's DistAdam update on one shard, written out in eager ops in the parameter's dtype (the step count a
    tensor, as the record keeps it): bf16 moments, v updated by one addcmul_, the step size lr * (sqrt(1 - b2^t) /
    (1 - b1^t)), eps added to the uncorrected sqrt(v) (docs/track1_recipe.md#distadam)."""
    p = param.detach().clone()
    m = torch.zeros_like(p, dtype=torch.bfloat16)
    v = torch.zeros_like(p, dtype=torch.bfloat16)
    t = torch.zeros((), dtype=torch.int64)
    lr_tensor = torch.tensor(lr, dtype=torch.float32)
    for g in grads:
        t += 1
        m.mul_(betas[0]).add_(g, alpha=1 - betas[0])
        v.mul_(betas[1]).addcmul_(g, g, value=1 - betas[1])
        step_size = lr_tensor * ((1 - betas[1] ** t).sqrt() / (1 - betas[0] ** t))
        p.sub_(m / (v.sqrt() + eps) * step_size)
    return p


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_dist_adam_is_the_records_formula_bitwise(dtype: torch.dtype) -> None:
    """Eight steps of DistAdam (eager, one process) against the record's formula, bit for bit, on 2^17 entries (the
    grouping lr * sqrt(b2) / b1 and a v updated by adding the rounded g^2 each failed this: in fp32 a few entries at
    some steps, in bf16 many)."""
    torch.manual_seed(2)
    param = torch.nn.Parameter(torch.randn(256, 512).to(dtype))
    tg.tag(param, lr_mul=75.0)
    start = param.detach().clone()
    opt = tg.DistAdam([param], lr=0.008, betas=(0.8, 0.95), eps=1e-8, weight_decay=0.0, rank=0, world_size=1)
    grads = [torch.randn(256, 512).mul(torch.rand(256, 512) * 10.0 ** -(k % 3)).to(dtype) for k in range(8)]
    for g in grads:
        param.grad = g.clone()
        opt.step()
    expected = record_adam_steps(start, grads, lr=0.008 * 75.0)
    assert param.dtype == dtype and torch.equal(param.detach(), expected)


@pytest.mark.parametrize("lr", [0.008 * 75, 0.008 * 5, 0.008])  # the embeddings', the scalars' and the head's
def test_adam_update_groups_the_bias_corrections_as_the_record(lr: float) -> None:
    """adam_update_ with fp32 moments, so that its step size reaches the update unrounded: 40 steps bitwise the record's
    formula (in fp32 the grouping lr * sqrt(b2) / b1 gives another step size at about a third of the steps)."""
    torch.manual_seed(3)
    shard = torch.randn(4096)
    expected = shard.clone()
    exp_avg, exp_avg_sq = torch.zeros(4096), torch.zeros(4096)
    m, v = torch.zeros(4096), torch.zeros(4096)
    step, lr_tensor = torch.zeros((), dtype=torch.int64), torch.tensor(lr)
    for _ in range(40):
        grad = torch.randn(4096)
        step += 1
        tg.adam_update_(shard, grad, exp_avg, exp_avg_sq, step, lr_tensor, 0.8, 0.95, 1e-8, 0.0)
        m.mul_(0.8).add_(grad, alpha=1 - 0.8)
        v.mul_(0.95).addcmul_(grad, grad, value=1 - 0.95)
        expected.sub_(m / (v.sqrt() + 1e-8) * (lr_tensor * ((1 - 0.95**step).sqrt() / (1 - 0.8**step))))
        assert torch.equal(shard, expected), int(step)


def test_muon_step_is_nesterov_momentum_then_newton_schulz_per_qkvo_slice():
    model = tiny_model(dim=32)
    params = tg.muon_parameters(model)
    torch.manual_seed(1)
    grads = [torch.randn_like(p) for p in params]
    before = [p.detach().clone() for p in params]
    opt = tg.Muon(params, lr=0.05, momentum=0.9, weight_decay=0.0, rank=0, world_size=1)
    for p, g in zip(params, grads):
        p.grad = g.clone()
    opt.step()
    for p, g, p0 in zip(params, grads, before):
        update = 0.1 * g + 0.9 * (0.1 * g)  # first step: m = (1 - mu) g; u = (1 - mu) g + mu m
        if p.module_tag == "attn":
            ortho = tg.newton_schulz_reference(update.view(4, 32, 32), torch.float32).reshape(p.shape)
        else:
            ortho = tg.newton_schulz_reference(update, torch.float32)
        torch.testing.assert_close(p.detach(), p0 - 0.05 * ortho, atol=1e-5, rtol=1e-5, msg=p.label)


@pytest.mark.parametrize("world_size", [1, 2, 4, 8])
def test_muon_chunk_orthogonalizes_each_owned_entry_and_zeroes_padding(world_size):
    """Every rank's chunk at every world size (slices, not index lists): attn entries as four (D, D) pieces, the
    others whole, padding rows zero."""
    model = tiny_model(dim=32)
    torch.manual_seed(2)
    for group in tg.muon_groups(tg.muon_parameters(model), world_size):
        for rank in range(world_size):
            owned = group.owned(rank)
            updates = torch.randn(group.chunk, *group.params[0].shape)
            result = tg._orthogonalize_chunk(updates, owned)
            for i in range(group.chunk):
                if i >= len(owned):
                    assert not result[i].any(), (rank, i)
                    continue
                pieces = updates[i].view(4, 32, 32) if owned[i].module_tag == "attn" else updates[i]
                want = tg.newton_schulz_reference(pieces, torch.float32).reshape(updates[i].shape)
                torch.testing.assert_close(result[i], want, atol=1e-5, rtol=1e-5, msg=f"{owned[i].label} at rank {rank}")


def test_newton_schulz_reference_orthogonalizes():
    torch.manual_seed(0)
    G = torch.randn(3, 48, 96, dtype=torch.float64)
    X = tg.newton_schulz_reference(G, torch.float64)
    singular = torch.linalg.svdvals(X)
    assert ((singular > 0.6) & (singular < 1.25)).all()  # the quintic's band around 1
    U, _, Vh = torch.linalg.svd(G, full_matrices=False)
    assert torch.nn.functional.cosine_similarity(X.flatten(1), (U @ Vh).flatten(1)).min() > 0.95
    assert tg.newton_schulz_reference(G.mT, torch.float64).shape == (3, 96, 48)  # tall input: transposed inside
