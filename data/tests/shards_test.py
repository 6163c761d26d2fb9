from pathlib import Path

import numpy as np
import pytest

from shards import HEADER_BYTES, MAGIC, VERSION, ShardError, read_header, read_shard, write_shard


def raw_shard(magic: int = MAGIC, version: int = VERSION, num_tokens: int = 3, body: bytes | None = None) -> bytes:
    header = np.zeros(256, dtype="<i4")
    header[:3] = (magic, version, num_tokens)
    if body is None:
        body = np.arange(num_tokens, dtype="<u2").tobytes()
    return header.tobytes() + body


def test_round_trip_keeps_every_token(tmp_path: Path) -> None:
    tokens = np.array([50256, 0, 1, 65535, 15496, 995], dtype=np.uint16)
    path = tmp_path / "x_train_000001.bin"
    write_shard(path, tokens)
    assert path.stat().st_size == HEADER_BYTES + 2 * len(tokens)
    assert read_header(path) == len(tokens)
    read = read_shard(path)
    assert read.dtype == np.uint16
    np.testing.assert_array_equal(read, tokens)


def test_header_layout_is_little_endian_int32(tmp_path: Path) -> None:
    path = tmp_path / "s.bin"
    write_shard(path, np.array([7, 8], dtype=np.int64))
    data = path.read_bytes()
    assert data[:12] == (20240520).to_bytes(4, "little") + (1).to_bytes(4, "little") + (2).to_bytes(4, "little")
    assert data[12:HEADER_BYTES] == bytes(HEADER_BYTES - 12)
    assert data[HEADER_BYTES:] == bytes([7, 0, 8, 0])


def test_empty_token_array_is_a_valid_shard(tmp_path: Path) -> None:
    path = tmp_path / "empty.bin"
    write_shard(path, np.array([], dtype=np.uint16))
    assert read_shard(path).size == 0


def test_write_never_replaces_a_file_and_leaves_no_temp_file(tmp_path: Path) -> None:
    path = tmp_path / "s.bin"
    write_shard(path, np.array([1, 2, 3]))
    inode = path.stat().st_ino
    write_shard(path, np.array([1, 2, 3]))  # the same bytes: the file is kept
    assert path.stat().st_ino == inode
    with pytest.raises(FileExistsError, match="s.bin: exists with other content"):
        write_shard(path, np.array([4]))
    np.testing.assert_array_equal(read_shard(path), [1, 2, 3])
    assert [p.name for p in tmp_path.iterdir()] == ["s.bin"]


def test_failed_write_leaves_old_shard_and_no_temp_file(tmp_path: Path) -> None:
    path = tmp_path / "s.bin"
    write_shard(path, np.array([1, 2, 3]))
    with pytest.raises(ValueError, match="fit in uint16"):
        write_shard(path, np.array([1, 70000]))
    np.testing.assert_array_equal(read_shard(path), [1, 2, 3])
    assert [p.name for p in tmp_path.iterdir()] == ["s.bin"]


@pytest.mark.parametrize(
    ("content", "rule"),
    [
        (raw_shard(magic=12345), "not the magic number 20240520"),
        (raw_shard(version=2), "version 2"),
        (raw_shard(num_tokens=10, body=bytes(6)), "promises 10 tokens but the file holds 3"),
        (raw_shard(num_tokens=2, body=bytes(5)), "odd number of bytes"),
        (raw_shard(num_tokens=-1, body=b""), "negative token count"),
        (b"", "fewer than the 1024-byte header"),
        (raw_shard()[:100], "fewer than the 1024-byte header"),
    ],
    ids=["bad-magic", "bad-version", "count-larger-than-file", "odd-byte-count", "negative-count", "empty", "short"],
)
def test_corrupt_shard_raises_error_naming_file_and_rule(tmp_path: Path, content: bytes, rule: str) -> None:
    path = tmp_path / "bad.bin"
    path.write_bytes(content)
    for read in (read_header, read_shard):
        with pytest.raises(ShardError) as error:
            read(path)
        message = str(error.value)
        assert str(path) in message and rule in message
        assert "\n" not in message


def test_missing_file_raises_shard_error(tmp_path: Path) -> None:
    path = tmp_path / "absent.bin"
    with pytest.raises(ShardError, match="absent.bin: no such file"):
        read_shard(path)


def test_shard_error_is_a_value_error() -> None:
    assert issubclass(ShardError, ValueError)


def test_more_tokens_than_the_header_can_count_are_refused(tmp_path: Path) -> None:
    """The header's token count is an int32: 2**31 tokens raised numpy's OverflowError (older numpy wrapped it)."""
    too_many = np.broadcast_to(np.uint16(0), (2**31,))  # a view: no 4 GiB in memory
    with pytest.raises(ValueError, match=r"2147483648 tokens, more than a shard's header can count \(2147483647\)"):
        write_shard(tmp_path / "big.bin", too_many)
    assert list(tmp_path.iterdir()) == []


def test_an_unreadable_file_raises_shard_error(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """No read permission (stood in for: root reads any file) was a PermissionError traceback, e.g. in the downloader."""
    path = tmp_path / "locked.bin"
    path.write_bytes(raw_shard())
    real_open = Path.open

    def open_refusing_locked(self: Path, *args: object, **kwargs: object) -> object:
        if self == path:
            raise PermissionError(13, "Permission denied", str(self))
        return real_open(self, *args, **kwargs)

    monkeypatch.setattr(Path, "open", open_refusing_locked)
    with pytest.raises(ShardError, match=r"locked.bin: cannot read it \(Permission denied\); make it readable"):
        read_header(path)
