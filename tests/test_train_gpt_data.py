"""Shard format, the BOS-aligned training loader and the validation loader of train_gpt.py."""

import types
from pathlib import Path

import numpy as np
import pytest
import torch

import train_gpt as tg
from conftest import TINY_BOS, TINY_VOCAB

CPU = torch.device("cpu")


def docs_shard(path: Path, lengths: list[int], first_token: int = 1) -> np.ndarray:
    """Documents of the given lengths (BOS included), token values counting up so positions are traceable."""
    tokens = (np.arange(sum(lengths)) % 400 + first_token).astype(np.int64)
    tokens[np.cumsum([0] + lengths[:-1])] = TINY_BOS
    tg.write_shard(path, tokens)
    return tokens


def loader(files, tokens_local=64, max_seq_len=32, rank=0, world_size=1, cycle=False, cu=True):
    sizes = dict(num_tokens_local=tokens_local, max_seq_len=max_seq_len, rank=rank, world_size=world_size)
    return tg.TrainLoader([str(f) for f in files], **sizes, bos_token=TINY_BOS, vocab_size=TINY_VOCAB, cycle=cycle, device=CPU, with_cu_seqlens=cu)


def _take(iterator, n):
    """Up to n items; stops at the loader's end-of-data error."""
    for _ in range(n):
        try:
            yield next(iterator)
        except tg.UserError:
            return


def test_shard_roundtrip_and_header_errors(tmp_path):
    tokens = docs_shard(tmp_path / "ok.bin", [5, 7])
    assert tg.read_shard_header(str(tmp_path / "ok.bin")) == 12
    np.testing.assert_array_equal(tg.read_shard(str(tmp_path / "ok.bin"), TINY_VOCAB), tokens)
    (tmp_path / "tiny.bin").write_bytes(b"\0" * 10)
    raw = bytearray((tmp_path / "ok.bin").read_bytes())
    (tmp_path / "magic.bin").write_bytes(b"\1\2\3\4" + raw[4:])
    (tmp_path / "short.bin").write_bytes(raw[:-2])
    for name, fragment in (("tiny.bin", "too short"), ("magic.bin", "not a token shard"), ("short.bin", "truncated")):
        with pytest.raises(tg.UserError, match=fragment) as info:
            tg.read_shard(str(tmp_path / name), TINY_VOCAB)
        assert name in str(info.value)
    with pytest.raises(tg.UserError, match="vocab_size"):
        tg.read_shard(str(tmp_path / "ok.bin"), 100)
    with pytest.raises(tg.UserError, match="ok.bin exists with other content"):
        tg.write_shard(tmp_path / "ok.bin", tokens[:-1])
    np.testing.assert_array_equal(tg.read_shard(str(tmp_path / "ok.bin"), TINY_VOCAB), tokens)  # never replaced


def test_resolve_files_uses_data_path_and_explains_missing_data(tmp_path, monkeypatch):
    docs_shard(tmp_path / "a_train_000001.bin", [4])
    monkeypatch.setenv("DATA_PATH", str(tmp_path))
    assert tg.resolve_files("a_train_*.bin", "train") == [str(tmp_path / "a_train_000001.bin")]
    with pytest.raises(tg.UserError, match="cached_fineweb10B.py 9") as info:
        tg.resolve_files("b_*.bin", "val")
    assert "b_*.bin" in str(info.value) and "--val_files" in str(info.value)


def test_plan_segments_exact_counts_truncation_and_bos_starts():
    bos = np.array([0, 10, 100, 103, 300, 320, 390])
    rows, cursor = tg.plan_segments(bos, 400, 0, num_tokens_local=50, max_seq_len=32, world_size=2, index_is_complete=True)
    assert rows[0] == [(0, 10), (10, 42), (100, 103), (103, 109)]  # doc 2 truncated at 32, last cut to fit 51
    assert rows[1] == [(300, 320), (320, 351)]  # the next rank starts at the next BOS; cut remainders dropped
    assert [sum(e - s for s, e in row) for row in rows] == [51, 51] and cursor == 6
    assert tg.plan_segments(bos, 400, 0, num_tokens_local=50, max_seq_len=32, world_size=3, index_is_complete=True) is None
    # with a quick (partial) index the last known BOS cannot start a segment: its end is unknown
    quick = dict(num_tokens_local=5, max_seq_len=32, world_size=1, index_is_complete=False)
    assert tg.plan_segments(np.array([0, 10]), 400, 0, **quick) == ([[(0, 6)]], 1)
    assert tg.plan_segments(np.array([0, 10]), 400, 1, **quick) is None


def test_train_batches_shift_targets_and_pad_cu_seqlens(tmp_path):
    tokens = docs_shard(tmp_path / "t_000001.bin", [20, 50, 9, 30, 40, 60, 25, 33, 70, 12] * 3)
    batch = next(loader([tmp_path / "t_000001.bin"]))
    assert batch.inputs.dtype == torch.int32 and batch.targets.dtype == torch.int64 and batch.cu_seqlens.dtype == torch.int32
    assert batch.inputs.shape == batch.targets.shape == (64,)
    # segments: [0,20) [20,52) (doc 2 truncated to 32) [70,79) [79,83) (cut: 20+32+9+4 = 65 = 64 + 1)
    expected = np.concatenate([tokens[0:20], tokens[20:52], tokens[70:79], tokens[79:83]])
    np.testing.assert_array_equal(batch.inputs.numpy(), expected[:-1])
    np.testing.assert_array_equal(batch.targets.numpy(), expected[1:])
    cu = batch.cu_seqlens.numpy()
    assert cu.shape == (128,) and list(cu[:5]) == [0, 20, 52, 61, 64] and (cu[4:] == 64).all()
    assert (batch.inputs.numpy()[cu[:4]] == TINY_BOS).all()


def test_ranks_take_consecutive_rows_of_one_plan(tmp_path):
    docs_shard(tmp_path / "t_000001.bin", [40, 70, 33, 90, 21, 64, 50] * 6)
    files = [tmp_path / "t_000001.bin"]
    single = loader(files, tokens_local=64, world_size=1)
    first, second = next(single), next(single)
    rank0, rank1 = next(loader(files, 64, rank=0, world_size=2)), next(loader(files, 64, rank=1, world_size=2))
    assert torch.equal(rank0.inputs, first.inputs) and torch.equal(rank1.inputs, second.inputs)


def test_shard_switch_exhaustion_and_cycling(tmp_path):
    files = [tmp_path / "t_000001.bin", tmp_path / "t_000002.bin"]
    docs_shard(files[0], [100] * 4, first_token=1)
    docs_shard(files[1], [100] * 4, first_token=100)
    batches = list(_take(loader(files, tokens_local=64, max_seq_len=128, cycle=False), 20))
    assert len(batches) == 8  # one batch per 100-token document, then a clear error
    assert batches[3].inputs[1] == 302 and batches[4].inputs[1] == 101  # second shard after the first
    with pytest.raises(tg.UserError, match="cycle_train_files"):
        list(loader(files, tokens_local=64, max_seq_len=128, cycle=False))
    cycled = list(_take(loader(files, tokens_local=64, max_seq_len=128, cycle=True), 10))
    assert torch.equal(cycled[8].inputs, batches[0].inputs)


def test_quick_bos_index_hands_over_to_the_full_index(tmp_path, monkeypatch):
    path = tmp_path / "t_000001.bin"
    docs_shard(path, [30, 45, 20, 80, 66, 31, 90, 25] * 8)
    reference = list(_take(loader([path], tokens_local=64, max_seq_len=64), 12))
    monkeypatch.setattr(tg, "QUICK_BOS_SCAN_TOKENS", 150)
    quick = list(_take(loader([path], tokens_local=64, max_seq_len=64), 12))
    assert len(quick) == len(reference) == 12
    for a, b in zip(quick, reference):
        assert torch.equal(a.inputs, b.inputs) and torch.equal(a.cu_seqlens, b.cu_seqlens)


@pytest.mark.parametrize("quick_scan_tokens", [tg.QUICK_BOS_SCAN_TOKENS, 100])
def test_shard_without_bos_is_the_middle_of_a_document(tmp_path, monkeypatch, quick_scan_tokens):
    """Such shards are what data/fineweb.py writes when a document is longer than a shard: read as such, the
    next segment starts at the next BOS, two shards later here."""
    monkeypatch.setattr(tg, "QUICK_BOS_SCAN_TOKENS", quick_scan_tokens)  # 100: the first shard uses the quick index
    files = [tmp_path / f"t_00000{i}.bin" for i in (1, 2, 3)]
    docs_shard(files[0], [100] * 2, first_token=1)
    tg.write_shard(files[1], np.full(500, 7))
    docs_shard(files[2], [100] * 2, first_token=100)
    batches = list(_take(loader(files, tokens_local=64, max_seq_len=128), 10))
    assert len(batches) == 4  # one per document
    assert batches[1].inputs[1] == 102 and batches[2].inputs[1] == 101  # doc 2 of shard 1, then doc 1 of shard 3
    assert all(batch.inputs[0] == TINY_BOS for batch in batches)


def test_shards_without_any_bos_give_one_clear_line(tmp_path):
    """No document starts in them: the advice was to add shards (or larger ones), which would not help. Now the line says
    they lack the BOS and were probably not written by this tokenizer."""
    files = [tmp_path / f"t_00000{i}.bin" for i in (1, 2)]
    for path in files:
        tg.write_shard(path, np.full(500, 7))
    tail = (f"({TINY_BOS}, the start of every document), so no batch can start there: probably not written by this tokenizer "
            "(data/fineweb.py puts a BOS before every document); tokenize the text again, or set --bos_token to the id its tokenizer puts there")
    for cycle in (False, True):
        with pytest.raises(tg.UserError) as info:
            next(loader(files[:1], cycle=cycle))
        assert str(info.value) == f"--train_files shard {files[0]} holds no BOS token {tail}"
    with pytest.raises(tg.UserError) as info:
        next(loader(files))
    assert str(info.value) == f"none of the 2 --train_files shards read ({files[0]}, ...) holds a BOS token {tail}"


def test_shards_with_documents_but_too_short_for_a_batch_ask_for_more_or_larger(tmp_path):
    """The cases the add-shards advice is for: a BOS in every shard, but no batch of 65 tokens fits."""
    path = tmp_path / "t_000001.bin"
    docs_shard(path, [20, 20])
    with pytest.raises(tg.UserError, match=r"training data exhausted after 0 batches .*; add shards"):
        next(loader([path]))
    with pytest.raises(tg.UserError, match="no --train_files shard holds 1 x 65 tokens of documents that start with BOS .*; add larger shards"):
        next(loader([path], cycle=True))


@pytest.mark.parametrize("quick_scan_tokens", [tg.QUICK_BOS_SCAN_TOKENS, 150])
@pytest.mark.parametrize("world_size", [1, 2])
def test_loader_position_restores_the_same_batches(tmp_path, monkeypatch, quick_scan_tokens, world_size):
    monkeypatch.setattr(tg, "QUICK_BOS_SCAN_TOKENS", quick_scan_tokens)
    files = [tmp_path / "t_000001.bin", tmp_path / "t_000002.bin"]
    docs_shard(files[0], [30, 45, 20, 80, 66, 31, 90, 25] * 3, first_token=1)
    docs_shard(files[1], [50, 70, 33, 90] * 4, first_token=100)
    for taken in (0, 3, 7):
        original = loader(files, tokens_local=64, max_seq_len=64, world_size=world_size, rank=world_size - 1, cycle=True)
        list(_take(original, taken))
        restored = loader(files, tokens_local=64, max_seq_len=64, world_size=world_size, rank=world_size - 1, cycle=True)
        restored.load_state_dict(original.state_dict())
        for a, b in zip(_take(original, 12), _take(restored, 12)):
            assert torch.equal(a.inputs, b.inputs) and torch.equal(a.cu_seqlens, b.cu_seqlens)


def test_val_loader_windows_and_unaligned_documents(tmp_path):
    tokens = docs_shard(tmp_path / "v_000000.bin", [13, 40, 7, 40, 50, 60, 50])  # 260 tokens, BOS at 0
    files = [str(tmp_path / "v_000000.bin")]
    make = lambda rank: tg.val_loader(
        files, num_tokens_local=64, rank=rank, world_size=2, bos_token=TINY_BOS, vocab_size=TINY_VOCAB, device=CPU, with_cu_seqlens=True
    )
    r0, r1 = make(0), make(1)
    a, b = next(r0), next(r1)
    np.testing.assert_array_equal(a.inputs.numpy(), tokens[0:64])
    np.testing.assert_array_equal(b.targets.numpy(), tokens[65:129])
    assert list(a.cu_seqlens.numpy()[:5]) == [0, 0, 13, 53, 60] and (a.cu_seqlens.numpy()[5:] == 64).all()
    assert list(b.cu_seqlens.numpy()[:3]) == [0, 100 - 64, 64]  # tokens before the first BOS form document 0
    a2 = next(r0)
    np.testing.assert_array_equal(a2.inputs.numpy(), tokens[128:192])
    with pytest.raises(tg.UserError, match="exhausted"):
        next(r0)  # 256 + 1 > 260 tokens needed for a third window


def val_sizes(val_tokens: int, val_batch_size: int, grad_accum_steps: int) -> dict[str, int]:
    return dict(val_tokens=val_tokens, val_batch_size=val_batch_size, grad_accum_steps=grad_accum_steps, vocab_size=TINY_VOCAB)


def one_rank_windows(num_tokens_local: int, cu: bool) -> dict:
    return dict(
        num_tokens_local=num_tokens_local, rank=0, world_size=1, bos_token=TINY_BOS, vocab_size=TINY_VOCAB, device=CPU, with_cu_seqlens=cu
    )


def test_val_data_too_short_is_reported(tmp_path):
    docs_shard(tmp_path / "v_000000.bin", [100] * 10)  # 1000 tokens: reads of 256 + 1 tokens fit 3 times
    assert tg.check_val_data([str(tmp_path / "v_000000.bin")], **val_sizes(512, 512, 2)) == 1000
    with pytest.raises(tg.UserError, match="validation data too short"):
        tg.check_val_data([str(tmp_path / "v_000000.bin")], **val_sizes(1024, 512, 2))
    with pytest.raises(tg.UserError, match="validation data too short"):
        tg.check_val_data([str(tmp_path / "v_000000.bin")], **val_sizes(1000, 1000, 1))  # one read needs 1001 tokens


def test_too_many_documents_for_fixed_cu_seqlens(tmp_path):
    docs_shard(tmp_path / "v_000000.bin", [2] * 200)
    with pytest.raises(tg.UserError, match="documents"):
        next(tg.val_loader([str(tmp_path / "v_000000.bin")], **one_rank_windows(300, cu=True)))
    assert next(tg.val_loader([str(tmp_path / "v_000000.bin")], **one_rank_windows(300, cu=False))).cu_seqlens is None


def test_max_docs_matches_the_record():
    assert tg.max_docs_per_batch(49_152) == 256 and tg.max_docs_per_batch(262_144) == 896


def test_pinned_staging_waits_for_a_buffer_before_refilling_it() -> None:
    """The ring's order on CPU with stand-in events that note what their buffer holds: each copy waits for its
    buffer while it still holds the batch of `slots` copies earlier, fills it, then records. (That the record
    comes after the device copy itself only a GPU shows: tests/test_train_gpt_cuda.py.)"""
    events, log = [], []

    class StandInEvent:
        def __init__(self) -> None:
            self.number = len(events)
            events.append(self)

        def held(self) -> int:
            return next(int(buffer[0]) for ring in staging.rings.values() for buffer, event in ring if event is self)

        def synchronize(self) -> None:
            log.append(("wait", self.number, self.held()))

        def record(self, stream: object = None) -> None:
            log.append(("record", self.number, self.held()))

    staging = tg.PinnedStaging(slots=2, pin=False, new_event=StandInEvent)
    for value in range(5):
        out = staging.to_device(np.full(6, value, dtype=np.uint16), torch.int64, torch.device("cpu"))
        assert out.dtype == torch.int64 and out.tolist() == [value] * 6
    assert [(what, number) for what, number, _ in log] == [(what, n) for n in (0, 1, 0, 1, 0) for what in ("wait", "record")]
    assert [held for what, _, held in log if what == "record"] == [0, 1, 2, 3, 4]
    assert [held for what, _, held in log if what == "wait"][2:] == [0, 1, 2]  # refilled only after the wait
    staging.to_device(np.zeros(7, dtype=np.uint16), torch.int64, torch.device("cpu"))  # another length: its own ring
    assert len(events) == 4 and [(what, number) for what, number, _ in log[-2:]] == [("wait", 2), ("record", 2)]


def test_pinned_staging_casts_exactly_and_refuses_a_narrowing_cast() -> None:
    """uint16 token ids above int16's range arrive unchanged in int32 and int64; an int64 array is not truncated
    into an int32 buffer."""
    staging = tg.PinnedStaging(slots=1, pin=False, new_event=lambda: types.SimpleNamespace(synchronize=lambda: None, record=lambda stream=None: None))
    tokens = np.array([0, 1, 32767, 32768, 50256, 65535], dtype=np.uint16)
    for dtype in (torch.int32, torch.int64):
        assert staging.to_device(tokens, dtype, torch.device("cpu")).tolist() == tokens.tolist()
    with pytest.raises(TypeError):
        staging.to_device(np.array([2**40, 0, 0, 0, 0, 0], dtype=np.int64), torch.int32, torch.device("cpu"))
