"""Attention in train_gpt.py: the FlexAttention block tables against the token rule and from_kv_blocks' tables,
and the backends against the dense reference."""

import pytest
import torch
from torch.nn.attention.flex_attention import BlockMask

import train_gpt as tg
from conftest import TINY_BOS, random_documents


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


# the uncompiled path is the one under test here (no inductor on CPU), so its notice about the unfused path is expected
@pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")
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
