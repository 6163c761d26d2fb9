"""Model structure, attention masks, the FP8 head and the optimizers of train_gpt.py."""

import math

import pytest
import torch
import torch.nn.functional as F
from torch.nn.attention.flex_attention import BlockMask

import train_gpt as tg
from conftest import TINY_BOS, TINY_VOCAB


def record_model(world_size: int = 8) -> tg.GPT:
    """The 124M record model, built on the meta device (no memory, no init cost)."""
    with torch.device("meta"):
        return tg.GPT(50257, 768, 6, 262_144, 128, world_size, tg.attention_backend("reference", 128, 50256))


def tiny_model(backend: str = "reference", dim: int = 64, heads: int = 2, block: int = 16) -> tg.GPT:
    torch.manual_seed(0)
    return tg.GPT(TINY_VOCAB, dim, heads, 256, block, 1, tg.attention_backend(backend, block, TINY_BOS), torch.float32)


def test_record_parameter_inventory():
    model = record_model()
    shapes = {n: tuple(p.shape) for n, p in model.named_parameters()}
    assert shapes["embed.weight"] == (50304, 768) and shapes["lm_head.weight"] == (50304, 768) and shapes["scalars"] == (72,)
    assert (
        shapes["blocks.1.attn.qkvo_w"] == (768, 3072)
        and shapes["blocks.1.mlp.c_fc"] == (768, 3072)
        and shapes["blocks.1.attn.attn_gate.weight"] == (6, 12)
    )
    assert not any(n.startswith("blocks.0.") for n in shapes) and "blocks.7.attn.qkvo_w" not in shapes and "blocks.7.mlp.c_fc" in shapes
    count = lambda tag: sum(p.numel() for p in model.parameters() if p.module_tag == tag)
    assert (count("attn"), count("mlp"), count("attn_gate") + count("smear_gate")) == (23_592_960, 51_904_512, 732)
    assert tg.embedding_parameter_count(model) == 154_533_888
    assert tg.matmul_parameter_count(model) == 23_592_960 + 51_904_512 + 38_633_472
    assert (
        model.embed.weight.lr_mul == 75
        and model.value_embeds[2].weight.lr_mul == 75
        and model.scalars.lr_mul == 5
        and model.lm_head.weight.lr_mul == 1
    )


def test_scalar_views_name_the_record_layout():
    """Checkpoints and DistAdam's shards see one vector: the views must keep its order and initial values."""
    views = tg.Scalars.of(torch.arange(72.0))
    assert views.skip_gates.tolist() == list(range(12))
    assert views.block_lambdas.tolist() == [[12 + 2 * i, 13 + 2 * i] for i in range(12)]
    assert views.value_mixing.tolist() == [[36 + 2 * i, 37 + 2 * i] for i in range(12)]
    assert views.smear_lambda.item() == 60
    initial = tg.Scalars.initial(world_size=1)
    assert initial.tolist() == [-1.5] * 12 + [1.0, 0.0] * 12 + [0.5, 0.5] * 12 + [0.0] * 12
    assert [tg.Scalars.initial(n).numel() for n in (1, 2, 4, 5, 8)] == [72, 72, 72, 75, 72]  # padded to the world size
    assert tg.Scalars.of(initial).block_lambdas.data_ptr() == initial.data_ptr() + 12 * initial.element_size()  # views


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


def test_initial_loss_is_uniform_over_the_padded_vocabulary():
    model = tiny_model().eval()
    ids = torch.randint(0, TINY_VOCAB, (128,), dtype=torch.int32)
    loss = model(ids, ids.long(), None, 1, 3, 128)
    assert loss.item() == pytest.approx(math.log(512), abs=1e-5)
    model.train()
    assert model(ids, ids.long(), None, 1, 3, 128).item() == pytest.approx(128 * math.log(512), rel=1e-5)  # sum in training


def test_every_parameter_gets_a_gradient_path_after_two_updates():
    model = tiny_model()
    ids = torch.randint(0, TINY_VOCAB - 1, (128,), dtype=torch.int32)
    ids[::37] = TINY_BOS
    hp = tg.Hyperparameters(vocab_size=TINY_VOCAB, bos_token=TINY_BOS, model_dim=64, num_heads=2)
    adam, muon = tg.build_optimizers(model, hp, 0, 1)
    for _ in range(2):  # zero-initialized matrices (O, c_proj, head) only pass gradient after a first step
        model(ids, ids.long(), None, 1, 3, 128).backward()
        adam.step()
        muon.step()
    model(ids, ids.long(), None, 1, 3, 128).backward()
    missing = [n for n, p in model.named_parameters() if p.grad is None or not p.grad.abs().sum() > 0]
    assert missing == [], missing
    used = tg.Scalars.of(model.scalars.grad != 0)  # which scalars the forward reads
    assert used.skip_gates.tolist() == [True] * 5 + [False] * 7
    assert used.block_lambdas.tolist() == [[False, False]] + [[True, True]] * 11  # layer 0 never runs
    attention_layers = [layer not in tg.ATTENTION_LAYERS_SKIPPED for layer in range(12)]
    assert used.value_mixing[:, 0].tolist() == attention_layers  # s0 in every attention layer
    assert used.value_mixing[:, 1].tolist() == [ve is not None for ve in tg.VALUE_EMBED_FOR_LAYER]  # s1 with a value embedding
    assert used.smear_lambda and not (model.scalars.grad[61:] != 0).any()


def test_in_place_table_gradients_equal_autograds_through_three_updates():
    """GPT.grads_into_buffers of the tables (as build_model sets it up) against autograd's embedding backward and
    AccumulateGrad: every gradient after three micro-steps and every weight after three Adam + Muon steps, bit for
    bit; the tables' .grad are the buffers, and checkpoints do not see them."""
    plain, in_place = tiny_model(), tiny_model()
    in_place.grads_into_buffers(table.weight for table in in_place.tables)
    assert in_place.state_dict().keys() == plain.state_dict().keys()
    hp = tg.Hyperparameters(vocab_size=TINY_VOCAB, bos_token=TINY_BOS, model_dim=64, num_heads=2)
    optimizers = [tg.build_optimizers(model, hp, 0, 1) for model in (plain, in_place)]
    torch.manual_seed(1)
    for step in range(3):  # zero-initialized matrices pass the tables no gradient before two updates
        for _ in range(3):
            ids = torch.randint(0, TINY_VOCAB - 1, (128,), dtype=torch.int32)
            ids[::37] = TINY_BOS
            for model in (plain, in_place):
                model(ids, ids.long(), None, 1, 3, 128).backward()
        assert all(table.weight.grad is table.weight_grad for table in in_place.tables)
        for (name, p), q in zip(plain.named_parameters(), in_place.parameters()):
            assert torch.equal(p.grad, q.grad), name
        assert step < 2 or all(table.weight.grad.abs().sum() > 0 for table in in_place.tables)
        for (model, (adam, muon)) in zip((plain, in_place), optimizers):
            adam.step()
            muon.step()
            model.zero_grad()
        assert in_place.embed.weight.grad is not None and not in_place.embed.weight.grad.any()
    for (name, p), q in zip(plain.named_parameters(), in_place.parameters()):
        assert torch.equal(p, q), name


def in_cuda_dtypes(model: tg.GPT) -> tg.GPT:
    """build_model's dtypes on CUDA: tables and linears bf16 (so activations are bf16), matrices and scalars fp32."""
    for module in model.modules():
        if isinstance(module, (torch.nn.Embedding, torch.nn.Linear)):
            module.bfloat16()
    return model


@pytest.mark.parametrize("cuda_dtypes", [False, True])
def test_in_place_matrix_gradients_equal_autograds_through_three_updates(cuda_dtypes):
    """GPT.grads_into_buffers of the matrices (tables in place on both sides, as build_model sets them up) against autograd's cast
    backward and AccumulateGrad: every gradient after three micro-steps and every weight after three Adam + Muon
    steps, bit for bit, in fp32 and in CUDA's dtypes (bf16 activations, fp32 matrices); checkpoints do not see the
    buffers."""
    convert = in_cuda_dtypes if cuda_dtypes else (lambda model: model)
    plain, in_place = convert(tiny_model()), convert(tiny_model())
    for model in (plain, in_place):  # the tables' sums as inductor computes them on both sides (not eager bf16's)
        model.grads_into_buffers(table.weight for table in model.tables)
    in_place.grads_into_buffers(in_place.matrices())
    assert in_place.state_dict().keys() == plain.state_dict().keys()
    matrices = in_place.matrices()
    assert len(matrices) == 10 + 11 * 2 and all(m.dtype == torch.float32 for m in matrices)
    hp = tg.Hyperparameters(vocab_size=TINY_VOCAB, bos_token=TINY_BOS, model_dim=64, num_heads=2)
    optimizers = [tg.build_optimizers(model, hp, 0, 1) for model in (plain, in_place)]
    torch.manual_seed(1)
    for step in range(3):
        for _ in range(3):
            ids = torch.randint(0, TINY_VOCAB - 1, (128,), dtype=torch.int32)
            ids[::37] = TINY_BOS
            for model in (plain, in_place):
                model(ids, ids.long(), None, 1, 3, 128).backward()
        assert all(p.grad is buffer for p, buffer in in_place.grad_buffers()) and len(in_place.grad_buffers()) == 4 + 32
        for (name, p), q in zip(plain.named_parameters(), in_place.parameters()):
            assert torch.equal(p.grad, q.grad), name
        assert step < 2 or all(m.grad.abs().sum() > 0 for m in matrices)
        for (model, (adam, muon)) in zip((plain, in_place), optimizers):
            adam.step()
            muon.step()
            model.zero_grad()
        assert all(m.grad is not None and not m.grad.any() for m in matrices)
    for (name, p), q in zip(plain.named_parameters(), in_place.parameters()):
        assert torch.equal(p, q), name


@pytest.mark.parametrize("addend_dtype", [torch.bfloat16, torch.float32])
def test_add_into_grad_is_the_eager_sum(addend_dtype):
    """The CPU path (the eager formula itself); the kernel is checked under the interpreter and on CUDA."""
    grad = torch.randn(33, 70)
    addend = torch.randn(33, 70).to(addend_dtype)
    expected = grad + addend.float()
    tg.add_into_grad(grad, addend)
    assert torch.equal(grad, expected)
    transposed = torch.randn(70, 33).to(addend_dtype).T  # not contiguous: the eager formula
    expected = grad + transposed.float()
    tg.add_into_grad(grad, transposed)
    assert torch.equal(grad, expected)


@pytest.mark.parametrize("grad, addend", [(torch.zeros(4, 8, dtype=torch.bfloat16), torch.zeros(4, 8)), (torch.zeros(4, 8), torch.zeros(8, 4))])
def test_add_into_grad_refuses_other_dtypes_and_shapes(grad, addend):
    with pytest.raises(ValueError, match="add_into_grad: needs an fp32 grad and an addend of its shape"):
        tg.add_into_grad(grad, addend)


@pytest.mark.parametrize("shapes", [((10, 8), (10,), (6,)), ((10, 7), (10,), (6, 8)), ((2, 5, 8), (2, 4), (6, 8))])
def test_table_gradients_refuse_mismatched_shapes(shapes):
    grad_out, ids, grad = (torch.zeros(shape) for shape in shapes)
    with pytest.raises(ValueError, match="accumulate_table_grads: needs grad"):
        tg.accumulate_table_grads([grad_out], ids.long(), [grad])


def test_table_gradients_refuse_a_count_mismatch():
    with pytest.raises(ValueError, match="accumulate_table_grads: 2 lookup gradients for 1 tables"):
        tg.accumulate_table_grads([torch.zeros(4, 8)] * 2, torch.zeros(4, dtype=torch.long), [torch.zeros(6, 8)])


# ---- attention masks ----
def random_documents(T: int, num_bos: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, TINY_BOS, (T,), generator=g)
    ids[torch.randint(0, T, (num_bos,), generator=g)] = TINY_BOS
    return ids


def block_mask_as_dense(mask, docs: torch.Tensor, block: int) -> torch.Tensor:
    """What a block-sparse kernel sees: full blocks wholesale, mask_mod only inside partial blocks."""
    T = docs.numel()
    dense = torch.zeros(T, T, dtype=torch.bool)
    q, k = torch.meshgrid(torch.arange(T), torch.arange(T), indexing="ij")
    token_rule = mask.mask_mod(0, 0, q, k)
    for counts, indices, full in ((mask.kv_num_blocks, mask.kv_indices, False), (mask.full_kv_num_blocks, mask.full_kv_indices, True)):
        for qb in range(T // block):
            for kb in indices[0, 0, qb, : counts[0, 0, qb]].tolist():
                rows, cols = slice(qb * block, (qb + 1) * block), slice(kb * block, (kb + 1) * block)
                dense[rows, cols] = True if full else token_rule[rows, cols]
    return dense


@pytest.mark.parametrize("window_blocks", [1, 2, 3, 5])
@pytest.mark.parametrize("seed", [0, 1])
def test_flex_block_tables_are_token_exact(window_blocks, seed):
    block = 16
    ids = random_documents(192, num_bos=5 + 3 * seed, seed=seed)
    docs = tg.document_ids(ids, TINY_BOS)
    mask = tg.flex_window_mask(docs, torch.tensor(window_blocks, dtype=torch.int32), block)
    expected = tg.dense_window_mask(docs, window_blocks * block)
    assert torch.equal(block_mask_as_dense(mask, docs, block), expected)
    assert expected.sum(-1).max() <= window_blocks * block + 1  # W + 1 keys at most, itself included


def sorted_block_table(selected: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The tables by sorting: selected columns first, from the highest down, the others ascending (a stable sort)."""
    order = torch.where(selected, torch.arange(selected.size(-1)), -1)
    return selected.sum(-1, dtype=torch.int32)[None, None], torch.argsort(order, dim=-1, descending=True, stable=True).to(torch.int32)[None, None]


@pytest.mark.parametrize("window_blocks", [1, 2, 3, 5])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_flex_block_tables_are_the_sorted_tables_and_their_transposes(window_blocks, seed):
    """The kv tables are the sorted ones; the q tables (the backward's) are what BlockMask.from_kv_blocks derives
    from them, bit for bit; and every table stays a permutation of the columns."""
    block = 16
    ids = random_documents(256, num_bos=3 + 4 * seed, seed=seed)
    if seed == 2:
        ids[:40] = TINY_BOS  # a run of one-token documents
    docs = tg.document_ids(ids, TINY_BOS)
    mask = tg.flex_window_mask(docs, torch.tensor(window_blocks, dtype=torch.int32), block)
    dense_partial = torch.zeros(16, 16, dtype=torch.bool)
    dense_full = torch.zeros(16, 16, dtype=torch.bool)
    for dense, counts, indices in ((dense_partial, mask.kv_num_blocks, mask.kv_indices), (dense_full, mask.full_kv_num_blocks, mask.full_kv_indices)):
        for qb in range(16):
            dense[qb, indices[0, 0, qb, : counts[0, 0, qb]].long()] = True
    assert dense_partial.any() and (dense_full.any() or window_blocks == 1 or seed > 0)  # seed 0 has long documents
    by_sorting = BlockMask.from_kv_blocks(*sorted_block_table(dense_partial), *sorted_block_table(dense_full), BLOCK_SIZE=block)
    for name in ("kv_num_blocks", "kv_indices", "full_kv_num_blocks", "full_kv_indices", "q_num_blocks", "q_indices", "full_q_num_blocks", "full_q_indices"):
        ours, theirs = getattr(mask, name), getattr(by_sorting, name)
        assert ours.dtype == theirs.dtype == torch.int32 and ours.is_contiguous(), name
        assert torch.equal(ours, theirs), name
    assert torch.equal(mask.q_indices.sort(-1).values[0, 0], torch.arange(16, dtype=torch.int32).expand(16, 16))
    assert mask.seq_lengths == (256, 256) and mask.BLOCK_SIZE == (block, block)


@pytest.mark.parametrize("shapes", [((4, 4), (4, 5)), ((4, 5), (4, 5)), ((4,), (4,))])
def test_block_tables_refuse_matrices_that_are_not_square_or_differ(shapes):
    partial, full = (torch.zeros(shape, dtype=torch.bool) for shape in shapes)
    with pytest.raises(ValueError, match="block_tables: needs two square block matrices of one shape"):
        tg.block_tables(partial, full)


def test_flex_attention_eager_matches_reference_on_packed_documents():
    torch.manual_seed(0)
    ids = random_documents(256, num_bos=7, seed=3)
    q, k, v = (torch.randn(1, 256, 2, 32) for _ in range(3))
    flex, ref = tg.attention_backend("flex", 32, TINY_BOS), tg.attention_backend("reference", 32, TINY_BOS)
    rotary = tg.Rotary(32, 256, 32, torch.float32)
    rotary.apply_yarn(3, 7)  # a non-default attn_scale, passed to flex as a tensor
    for window in (1, 3, 4):
        flex_window = flex.window_args(window, window, torch.device("cpu"))[0]
        assert isinstance(flex_window, torch.Tensor)
        out_flex = flex(q, k, v, flex.prepare(ids, None, {"short": flex_window}, 256), "short", rotary.softmax_scale(True))
        out_ref = ref(q, k, v, ref.prepare(ids, None, {"short": window}, 256), "short", rotary.softmax_scale(False))
        torch.testing.assert_close(out_flex, out_ref, atol=1e-5, rtol=1e-5)


def test_reference_attention_respects_documents_and_window():
    ids = torch.tensor([TINY_BOS, 1, 2, 3, TINY_BOS, 4, 5, 6])
    mask = tg.dense_window_mask(tg.document_ids(ids, TINY_BOS), window=2)
    assert mask[3].tolist() == [False, True, True, True, False, False, False, False]  # i - j <= 2, same doc
    assert mask[4].tolist() == [False] * 4 + [True] + [False] * 3  # a BOS opens its own document


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


# ---- the whole model traces as one graph (what torch.compile(fullgraph=True) needs on the GPU) ----
@pytest.mark.slow
@pytest.mark.filterwarnings("ignore")
@pytest.mark.parametrize("backend, training", [("reference", True), ("flex", False)])
def test_model_traces_without_graph_breaks(backend, training):
    """Dynamo only (no code generation): fullgraph raises on any graph break. The FP8 head is on in training
    (CPU _scaled_mm); FlexAttention has no CPU backward, so its graph is traced in eval mode. FlexAttention
    takes windows and attn_scale as tensors: a window change plus a YaRN update must not recompile."""
    model = tiny_model(backend).train(training)
    model.lm_head.use_fp8 = training
    graphs = []

    def counting_backend(graph_module, example_inputs):
        graphs.append(graph_module)
        return graph_module.forward

    compiled = torch.compile(model, dynamic=False, fullgraph=True, backend=counting_backend)
    ids = random_documents(128, num_bos=4, seed=5).to(torch.int32)
    with torch.set_grad_enabled(training):
        for short, long in ((1, 3), (3, 7)):
            if long == 7:
                model.rotary.apply_yarn(3, 7)
            loss = compiled(ids, ids.long(), None, *model.attention.window_args(short, long, ids.device), 128)
            if training:
                loss.backward()
            assert torch.isfinite(loss)
    assert len(graphs) == (1 if backend == "flex" else 2)  # ints and a float attn_scale specialize, as in the record


def _unfused_mlp(x: torch.Tensor, c_fc: torch.Tensor, c_proj: torch.Tensor) -> torch.Tensor:
    """MLP.forward before its backward was fused: autograd differentiates every op."""
    return F.linear(F.relu(x @ c_fc.type_as(x)).square(), c_proj.type_as(x))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_mlp_with_the_fused_backward_is_autograd_bitwise(dtype: torch.dtype) -> None:
    """ReLUSquaredProjection's output and the gradients of x and both weights against autograd of the unfused MLP,
    with pre-activations that are exactly 0 (relu's threshold) and a gradient that is not contiguous."""
    torch.manual_seed(4)
    mlp = tg.MLP(64)
    with torch.no_grad():
        mlp.c_fc.copy_(torch.randn(64, 256) * 0.1)
        mlp.c_proj.copy_(torch.randn(64, 256) * 0.1)
        mlp.c_fc[:, :4] = 0.0  # pre = 0 in four columns
    x = torch.randn(1, 96, 64).to(dtype).requires_grad_()
    grad_out = torch.randn(1, 64, 96).to(dtype).transpose(1, 2)  # not contiguous
    out = mlp(x)
    out.backward(grad_out)
    got = (out.detach(), x.grad, mlp.c_fc.grad, mlp.c_proj.grad)
    x_ref = x.detach().clone().requires_grad_()
    c_fc, c_proj = (p.detach().clone().requires_grad_() for p in (mlp.c_fc, mlp.c_proj))
    want_out = _unfused_mlp(x_ref, c_fc, c_proj)
    want_out.backward(grad_out)
    want = (want_out.detach(), x_ref.grad, c_fc.grad, c_proj.grad)
    for name, g, w in zip(("out", "grad x", "grad c_fc", "grad c_proj"), got, want):
        assert g.dtype == w.dtype and g.shape == w.shape and torch.equal(g, w), name
    assert int((x @ mlp.c_fc.type_as(x) <= 0).sum()) > 0 and int((x @ mlp.c_fc.type_as(x) > 0).sum()) > 0


@pytest.mark.parametrize("needs", [(True, True), (True, False), (False, True)])
def test_relu_squared_projection_at_signed_zeros_and_partial_needs(needs: tuple[bool, bool]) -> None:
    """A pre-activation holding 0, -0, NaN and both signs, given directly (x @ W cannot make a -0), against autograd
    of the formula; an input that needs no gradient gets none."""
    torch.manual_seed(5)
    pre = torch.randn(2, 40, 32).bfloat16()
    pre[0, 0, :4] = torch.tensor([0.0, -0.0, float("nan"), -1.0])
    w = (torch.randn(16, 32) * 0.1).bfloat16()
    grad_out = torch.randn(2, 40, 16).bfloat16()
    leaves = [pre.clone().requires_grad_(needs[0]), w.clone().requires_grad_(needs[1])]
    refs = [pre.clone().requires_grad_(needs[0]), w.clone().requires_grad_(needs[1])]
    tg.ReLUSquaredProjection.apply(*leaves).backward(grad_out)
    F.linear(F.relu(refs[0]).square(), refs[1]).backward(grad_out)
    for leaf, ref, needed in zip(leaves, refs, needs):
        assert (leaf.grad is None) == (not needed)
        if needed:
            assert torch.equal(leaf.grad.isnan(), ref.grad.isnan()) and torch.equal(leaf.grad.nan_to_num(), ref.grad.nan_to_num())
            assert torch.equal(leaf.grad.signbit(), ref.grad.signbit())  # -0 and +0 as autograd gives them


def test_relu2_backward_matmul_refuses_mismatched_operands() -> None:
    with pytest.raises(ValueError, match="needs 2-D grad_out"):
        tg.relu2_backward_matmul(torch.zeros(1, 4, 8), torch.zeros(8, 16), torch.zeros(4, 16))
    with pytest.raises(ValueError, match=r"needs grad_out \(M, K\), w \(K, N\), pre \(M, N\) of one dtype"):
        tg.relu2_backward_matmul(torch.zeros(4, 8), torch.zeros(8, 16), torch.zeros(4, 12))
    with pytest.raises(ValueError, match="of one dtype"):
        tg.relu2_backward_matmul(torch.zeros(4, 8), torch.zeros(8, 16), torch.zeros(4, 16, dtype=torch.bfloat16))


def test_mlp_saves_what_the_unfused_mlp_saved() -> None:
    """Peak memory: the fused backward saves the pre-activation and h (bf16 each) where autograd's unfused MLP saves
    relu(pre) and h: the same activation bytes per layer. (Compiled, inductor's partition of the joint graph
    saves the same two in both, which a CPU run of aot_autograd's min-cut partitioner showed (bench/NOTES.md, 2026-12-02, commit b1e22df).)"""
    mlp = tg.MLP(64)
    x = torch.randn(1, 96, 64).bfloat16().requires_grad_()
    saved: list[torch.Tensor] = []

    def pack(t: torch.Tensor) -> torch.Tensor:
        saved.append(t)
        return t

    def activation_bytes(fn) -> int:
        saved.clear()
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            fn()
        hidden = {t.untyped_storage().data_ptr(): t for t in saved if t.numel() == 96 * 256}  # one per storage
        return sum(t.numel() * t.element_size() for t in hidden.values())

    fused = activation_bytes(lambda: mlp(x))
    unfused = activation_bytes(lambda: _unfused_mlp(x, mlp.c_fc, mlp.c_proj))
    assert fused == unfused == 2 * 96 * 256 * 2
