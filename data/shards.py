"""The .bin token shard format of the NanoGPT speedrun, as the data tools read and write it (docs/shards.md).

A shard is a header of 256 little-endian int32 values, [MAGIC, VERSION, num_tokens, 0, ...],
followed by num_tokens little-endian uint16 GPT-2 token ids (format from llm.c / modded-nanogpt).
Each training script carries its own reader and writer, so that it stays one self-contained file;
tests/test_shared_helpers.py checks that the three write the same bytes and read each other's shards.
"""

from __future__ import annotations

import os
import uuid
from pathlib import Path

import numpy as np

MAGIC = 20240520
VERSION = 1
HEADER_INTS = 256
HEADER_BYTES = HEADER_INTS * 4
TOKEN_BYTES = 2
MAX_TOKEN = 2**16 - 1  # uint16 storage
MAX_SHARD_TOKENS = 2**31 - 1  # the header stores the token count as an int32

HEADER_DTYPE = np.dtype("<i4")
TOKEN_DTYPE = np.dtype("<u2")


class ShardError(ValueError):
    """A file is not a valid token shard; the message names the file, the rule and the fix."""

    def __init__(self, path: Path, rule: str, advice: str) -> None:
        super().__init__(f"{path}: {rule}; {advice}")
        self.path = path
        self.rule = rule


def _shard_error(path: Path, rule: str) -> ShardError:
    return ShardError(path, rule, "this is not a valid token shard, so delete it and download or tokenize it again")


def read_header(path: str | os.PathLike[str]) -> int:
    """Validate the shard at `path` without reading its tokens and return its token count."""
    path = Path(path)
    try:
        file_size = path.stat().st_size
        with path.open("rb") as f:
            header_bytes = f.read(HEADER_BYTES)
    except FileNotFoundError:
        raise ShardError(path, "no such file", "check the path, or download or tokenize the shard first") from None
    except IsADirectoryError:
        raise ShardError(path, "is a directory, not a shard file", "pass the path of a .bin shard") from None
    except OSError as error:  # e.g. no read permission: the same one line instead of a traceback
        raise ShardError(path, f"cannot read it ({error.strerror})", "make it readable, or delete it and download or tokenize it again") from None
    if len(header_bytes) < HEADER_BYTES:
        raise _shard_error(path, f"the file has {file_size} bytes, fewer than the {HEADER_BYTES}-byte header")
    header = np.frombuffer(header_bytes, dtype=HEADER_DTYPE)
    magic, version, num_tokens = (int(v) for v in header[:3])
    if magic != MAGIC:
        raise _shard_error(path, f"the header starts with {magic}, not the magic number {MAGIC}")
    if version != VERSION:
        raise _shard_error(path, f"the header has version {version}, but only version {VERSION} exists")
    if num_tokens < 0:
        raise _shard_error(path, f"the header gives a negative token count ({num_tokens})")
    body_bytes = file_size - HEADER_BYTES
    if body_bytes % TOKEN_BYTES:
        raise _shard_error(path, f"the body has an odd number of bytes ({body_bytes}), but tokens are 2 bytes each")
    if body_bytes // TOKEN_BYTES != num_tokens:
        raise _shard_error(
            path, f"the header promises {num_tokens} tokens but the file holds {body_bytes // TOKEN_BYTES}"
        )
    return num_tokens


def read_shard(path: str | os.PathLike[str]) -> np.ndarray:
    """Validate the shard at `path` and return its tokens as a uint16 array."""
    num_tokens = read_header(path)
    tokens = np.fromfile(path, dtype=TOKEN_DTYPE, count=num_tokens, offset=HEADER_BYTES)
    return tokens.astype(np.uint16, copy=False)


def _header_for(num_tokens: int) -> np.ndarray:
    header = np.zeros(HEADER_INTS, dtype=HEADER_DTYPE)
    header[:3] = (MAGIC, VERSION, num_tokens)
    return header


def write_shard(path: str | os.PathLike[str], tokens: np.ndarray) -> None:
    """Write `tokens` as a shard at `path`, atomically, never replacing a file.

    The data goes to a temporary file in the same directory, which is then hard-linked to `path`: the shard
    appears complete or not at all, and unlike a rename a link fails when `path` exists. An existing file
    with exactly these bytes is kept (writing the same shard twice is harmless); one with other bytes raises
    FileExistsError. The training scripts' own copies of write_shard behave the same way.
    """
    path = Path(path)
    tokens = np.asarray(tokens)
    if tokens.ndim != 1:
        raise ValueError(f"{path}: tokens must be a 1-D array, got shape {tokens.shape}")
    if tokens.size > MAX_SHARD_TOKENS:  # checked first: the header could not hold the count
        raise ValueError(f"{path}: {tokens.size} tokens, more than a shard's header can count ({MAX_SHARD_TOKENS}); write smaller shards")
    if tokens.size and (int(tokens.min()) < 0 or int(tokens.max()) > MAX_TOKEN):
        raise ValueError(
            f"{path}: token ids must lie in [0, {MAX_TOKEN}] to fit in uint16, got "
            f"[{int(tokens.min())}, {int(tokens.max())}]; use a tokenizer with fewer than 65536 tokens"
        )
    content = _header_for(tokens.size).tobytes() + tokens.astype(TOKEN_DTYPE, copy=False).tobytes()
    temp_path = path.with_name(f".{path.name}.{os.getpid()}.{uuid.uuid4().hex[:8]}.tmp")
    try:
        with temp_path.open("xb") as f:
            f.write(content)
            f.flush()
            os.fsync(f.fileno())  # the data must be on disk before the link makes it visible
        os.link(temp_path, path)
    except FileExistsError:
        if not path.is_file() or path.read_bytes() != content:
            raise FileExistsError(
                f"{path}: exists with other content; move it away or write elsewhere (shards are never replaced)"
            ) from None
    finally:
        temp_path.unlink(missing_ok=True)
