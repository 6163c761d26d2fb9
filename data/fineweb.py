"""Tokenize a text corpus with GPT-2 BPE into .bin shards (the speedrun's FineWeb shard layout).

Every document becomes <|endoftext|> followed by its tokens; the token stream is cut into shards of
--shard-size tokens: first <name>_val_000000.bin, then <name>_train_000001.bin, ...

    # online: the FineWeb sample the speedrun uses (needs `pip install datasets`)
    python data/fineweb.py --hf-sample 10BT
    # offline: local files, with the GPT-2 BPE ranks from a local gpt2.tiktoken file
    python data/fineweb.py --input corpus/ --bpe-file path/to/gpt2.tiktoken --out-dir data/mycorpus

Local inputs: .txt (one document per file), .jsonl (one JSON object per line, its "text" field is a
document), .parquet (its "text" column), and .txt or .jsonl compressed as .gz or .xz (a compressed file
not named .jsonl.gz/.jsonl.xz is one text document). Directories are searched recursively for such files.
Empty documents are skipped. One writer at a time per --out-dir (an OS lock on its .fineweb.lock file); existing
shards are never overwritten.
"""

from __future__ import annotations

import argparse
import base64
import binascii
import contextlib
import fcntl
import glob
import gzip
import json
import lzma
import multiprocessing
import multiprocessing.pool
import os
import signal
import sys
import threading
from collections.abc import Callable, Iterable, Iterator, Sequence
from pathlib import Path
from typing import TextIO

try:
    import numpy as np
    import tiktoken
    from tqdm import tqdm
except ImportError as missing:  # a Python without the requirements, e.g. outside the virtual environment
    if __name__ != "__main__":
        raise  # an importer (the tests, train_gpt's tests) reports it in its own way
    sys.exit(f"data/fineweb.py: error: cannot import {missing.name or missing} in {sys.executable}; install the requirements "
             f"(pip install -r requirements.txt, README.md#install) or run the Python that has them")

from shards import MAX_SHARD_TOKENS, MAX_TOKEN, read_header, write_shard

DATA_DIR = Path(__file__).resolve().parent
EOT = 50256  # <|endoftext|> in GPT-2's vocabulary
# GPT-2's pre-tokenization regex, from its encoder.py (what tiktoken's "gpt2" encoding splits with).
GPT2_PATTERN = r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""
HF_DATASET = "HuggingFaceFW/fineweb"
HF_SAMPLES = {"10BT": DATA_DIR / "fineweb10B", "100BT": DATA_DIR / "fineweb100B"}  # sample -> default out dir
DEFAULT_SHARD_SIZE = 100_000_000  # tokens, as in the published shards
DOCUMENTS_PER_TASK = 16  # documents sent to a worker at once: amortizes the inter-process hand-off
SUPPORTED_INPUTS = ".txt, .jsonl, .parquet, .gz, .xz"
LOCK_NAME = ".fineweb.lock"  # in --out-dir: one writer at a time
# train_gpt.py --preset=smoke validates on 1,024 tokens, read in windows that need 2 tokens more
# (train_gpt.py::check_val_data): the smallest validation shard worth suggesting.
SMOKE_VAL_TOKENS = 1026


class InputError(ValueError):
    """Bad user input (file, flag or environment); the message is one line that says what to do."""


class Interrupted(Exception):
    """Ctrl-C or SIGTERM while tokenizing; the message says which shards are complete."""


# ---------------------------------------------------------------------------------------------
# The encoding


def read_bpe_ranks(path: Path) -> dict[bytes, int]:
    """Parse a .tiktoken file: one `base64(token bytes) rank` per line.

    tiktoken's own loader caches files by path under /tmp, which serves stale ranks when a path is
    reused for another file, so we parse the (simple) format ourselves.
    """
    try:
        lines = path.read_bytes().splitlines()
    except OSError as error:
        raise InputError(f"--bpe-file {path}: cannot read it ({error.strerror}); pass the path of gpt2.tiktoken") from None
    ranks: dict[bytes, int] = {}
    for line_number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            token, rank = line.split()
            ranks[base64.b64decode(token, validate=True)] = int(rank)
        except (ValueError, binascii.Error):
            raise InputError(
                f"--bpe-file {path}:{line_number}: expected `base64-token rank`; pass a tiktoken BPE file such as gpt2.tiktoken"
            ) from None
    if not ranks:
        raise InputError(f"--bpe-file {path}: the file is empty; pass a tiktoken BPE file such as gpt2.tiktoken")
    return ranks


def tiktoken_gpt2() -> tiktoken.Encoding:
    try:
        return tiktoken.get_encoding("gpt2")
    except (OSError, ValueError) as error:  # the first use downloads: requests' errors are OSErrors, a bad download's hash check a ValueError
        raise InputError(
            f"tiktoken could not load its gpt2 encoding ({type(error).__name__}); pass --bpe-file PATH "
            "to a local gpt2.tiktoken (README.md, section Data, says where to get one)"
        ) from None


def bpe_file_gpt2(bpe_file: Path) -> tiktoken.Encoding:
    ranks = read_bpe_ranks(bpe_file)
    if max(ranks.values()) >= EOT:
        raise InputError(f"--bpe-file {bpe_file}: has ranks >= {EOT}, so it is not GPT-2's BPE; pass gpt2.tiktoken")
    missing_bytes = sum(bytes([value]) not in ranks for value in range(256))
    if missing_bytes:  # e.g. a truncated file: tiktoken panics (in every worker, again and again) on such a byte
        raise InputError(f"--bpe-file {bpe_file}: {missing_bytes} of the 256 single bytes have no rank, so some text cannot be encoded; pass the complete gpt2.tiktoken")
    return tiktoken.Encoding(
        name=f"gpt2 ({bpe_file})", pat_str=GPT2_PATTERN, mergeable_ranks=ranks, special_tokens={"<|endoftext|>": EOT}
    )


def gpt2_encoding(bpe_file: Path | None) -> tiktoken.Encoding:
    """GPT-2 BPE with <|endoftext|> = 50256, from `bpe_file` or else from tiktoken's own download."""
    encoding = tiktoken_gpt2() if bpe_file is None else bpe_file_gpt2(bpe_file)
    assert encoding.max_token_value <= MAX_TOKEN, f"{encoding.name}: token ids must fit the shards' uint16"
    return encoding


# ---------------------------------------------------------------------------------------------
# Documents


def input_format(path: Path) -> str | None:
    """'text', 'jsonl' or 'parquet' from the file name, or None when the name is not supported."""
    name = path.name.lower()
    if name.endswith(".parquet"):
        return "parquet"
    compressed = name.endswith((".gz", ".xz"))
    inner = name[:-3] if compressed else name
    if inner.endswith(".jsonl"):
        return "jsonl"
    if compressed or inner.endswith(".txt"):
        return "text"
    return None


def expand_inputs(paths: Sequence[Path]) -> list[Path]:
    """The files to read, in order: files as given, directories searched recursively (sorted)."""
    files: list[Path] = []
    for path in paths:
        if path.is_dir():
            found = [p for p in files_under(path) if p.is_file() and input_format(p) is not None]
            if not found:
                raise InputError(f"--input {path}: the directory holds no {SUPPORTED_INPUTS} files")
            files.extend(found)
        elif not path.is_file():
            raise InputError(f"--input {path}: no such file or directory")
        elif input_format(path) is None:
            raise InputError(f"--input {path}: unsupported file type; supported: {SUPPORTED_INPUTS}")
        else:
            files.append(path)
    check_each_file_once(files)
    return files


def files_under(folder: Path) -> list[Path]:
    """Every file below `folder`, sorted. A subfolder that cannot be listed is an error: Path.rglob skips it without a
    word, and its documents would be missing from the shards."""
    def refuse(error: OSError) -> None:
        raise InputError(f"--input {folder}: cannot list {error.filename} ({error.strerror}); make it readable or pass only "
                         "the folders you can read")

    return sorted(Path(root, name) for root, _, names in os.walk(folder, onerror=refuse) for name in names)


def check_each_file_once(files: Sequence[Path]) -> None:
    """A file reached twice (named twice, by a link, or as a file and within its folder) would be tokenized twice, and
    its documents could land in both the validation and a training shard."""
    first_path: dict[Path, Path] = {}
    for path in files:
        target = path.resolve()
        earlier = first_path.get(target)
        if earlier is not None:
            same = "" if earlier == path else f" (also reached as {earlier})"
            raise InputError(f"--input {path}: this file is given twice{same}; pass each file or folder once")
        first_path[target] = path


def open_text(path: Path) -> TextIO:
    """Open a possibly compressed UTF-8 file, keeping its line endings exactly."""
    name = path.name.lower()
    if name.endswith(".gz"):
        return gzip.open(path, "rt", encoding="utf-8", newline="")
    if name.endswith(".xz"):
        return lzma.open(path, "rt", encoding="utf-8", newline="")
    return path.open("r", encoding="utf-8", newline="")


def jsonl_documents(path: Path) -> Iterator[str]:
    with open_text(path) as f:
        for line_number, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as error:
                raise InputError(f"{path}:{line_number}: not valid JSON ({error.msg}); fix or remove the line") from None
            text = record.get("text") if isinstance(record, dict) else None
            if not isinstance(text, str):
                raise InputError(f'{path}:{line_number}: no string "text" field; every line needs one')
            yield text


def parquet_documents(path: Path) -> Iterator[str]:
    import pyarrow as pa  # only needed for parquet inputs
    import pyarrow.parquet as pq

    try:
        parquet = pq.ParquetFile(path)
        columns = parquet.schema_arrow.names
        if "text" not in columns:
            raise InputError(f'{path}: no "text" column (columns: {", ".join(columns)}); name the text column "text"')
        text_type = parquet.schema_arrow.field("text").type
        if not holds_strings(text_type):  # its values would all read as "no text" below
            raise InputError(f'{path}: the "text" column holds {text_type} values, not strings; store the documents as strings')
        for batch in parquet.iter_batches(columns=["text"]):
            for text in batch.column(0).to_pylist():
                if not isinstance(text, str):
                    raise InputError(f'{path}: a row has no text (null "text" value); drop such rows first')
                yield text
    except pa.ArrowException as error:
        raise InputError(f"{path}: not a readable parquet file ({error}); check that the file is complete") from None


def holds_strings(column_type: "pa.DataType") -> bool:
    """Whether a parquet column's values read as str (or None): a string type, dictionary-encoded or not, or the null
    type of a column without a single value (its rows are refused one by one as null)."""
    import pyarrow as pa

    if pa.types.is_dictionary(column_type):
        column_type = column_type.value_type
    is_string_view = getattr(pa.types, "is_string_view", lambda _: False)  # pyarrow 16 and later; requirements.txt pins none
    return any(check(column_type) for check in (pa.types.is_string, pa.types.is_large_string, is_string_view, pa.types.is_null))


def file_documents(path: Path) -> Iterator[str]:
    try:
        kind = input_format(path)
        if kind == "parquet":
            yield from parquet_documents(path)
        elif kind == "jsonl":
            yield from jsonl_documents(path)
        else:
            with open_text(path) as f:
                yield f.read()
    except UnicodeDecodeError as error:
        raise InputError(f"{path}: not UTF-8 text (byte {error.start}: {error.reason}); convert it to UTF-8") from None
    except (OSError, EOFError, lzma.LZMAError) as error:
        raise InputError(f"{path}: cannot read it ({error}); check that the file is complete") from None


def local_documents(files: Iterable[Path]) -> Iterator[str]:
    for path in files:
        yield from file_documents(path)


def until_set(stop: threading.Event, documents: Iterable[str]) -> Iterator[str]:
    """`documents` until `stop` is set (the pool reads them on its own thread)."""
    for text in documents:
        if stop.is_set():
            return
        yield text


class DocumentCount:
    """How many documents the input held; skip_empty passes on those with text (an empty one would add a lone EOT)."""

    def __init__(self) -> None:
        self.seen = 0

    def skip_empty(self, documents: Iterable[str]) -> Iterator[str]:
        for text in documents:
            self.seen += 1
            if text:
                yield text


def hub_documents(sample: str) -> Iterator[str]:
    """The documents of a FineWeb sample, streamed (the import fails here, before any work starts)."""
    try:
        import datasets
    except ImportError:
        raise InputError(f"reading {HF_DATASET} needs the datasets library: pip install datasets") from None
    rows = datasets.load_dataset(HF_DATASET, name=f"sample-{sample}", split="train", streaming=True)
    return (row["text"] for row in rows)


# ---------------------------------------------------------------------------------------------
# Tokenization and sharding

_worker_encoding: tiktoken.Encoding | None = None


def usable_cores() -> int:
    """The cores this process may run on: the default and the most --workers."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def tokenizer_pool(workers: int, bpe_file: Path | None) -> multiprocessing.pool.Pool:
    """`workers` tokenizer processes, started as fresh interpreters ("spawn") that ignore Ctrl-C and SIGTERM.

    Fresh: a forked worker inherits whatever locks the parent's other threads hold at the fork. Deaf to stop signals:
    the parent alone handles a stop and ends the pool by closing it (_write_shards). A worker killed by a signal
    (Pool.terminate, or a terminal's Ctrl-C and `timeout` signalling the whole process group) can die holding the
    result queue's lock and hang the pool's shutdown: a CI run hung there for 600 s. An ignored disposition survives
    exec, so it is set in the parent while the workers start (a stop in that moment is lost; press Ctrl-C again) and
    covers their imports too, where a Ctrl-C printed tracebacks."""
    in_main_thread = threading.current_thread() is threading.main_thread()  # signal.signal works only there
    with stop_signals_handled_by(signal.SIG_IGN) if in_main_thread else contextlib.nullcontext():
        return multiprocessing.get_context("spawn").Pool(workers, initializer=init_worker, initargs=(bpe_file,))


def init_worker(bpe_file: Path | None) -> None:
    for stop in STOP_SIGNALS:  # again, for a worker the pool starts later to replace one that died
        signal.signal(stop, signal.SIG_IGN)
    global _worker_encoding
    _worker_encoding = gpt2_encoding(bpe_file)


def tokenize(document: str) -> np.ndarray:
    """<|endoftext|> followed by the document's tokens (special-token text is treated as plain text)."""
    assert _worker_encoding is not None, "init_worker runs first in every worker"
    ids = _worker_encoding.encode_ordinary(document)
    tokens = np.empty(len(ids) + 1, dtype=np.uint16)
    tokens[0] = EOT
    tokens[1:] = ids
    return tokens


class ShardWriter:
    """Cuts a token stream into shards of exactly `shard_size` tokens (the last one may be shorter).

    Shard 0 is the validation shard; a document may continue from one shard into the next.
    """

    def __init__(self, out_dir: Path, name: str, shard_size: int) -> None:
        self.out_dir = out_dir
        self.name = name
        self.buffer = np.empty(shard_size, dtype=np.uint16)
        self.filled = 0
        self.paths: list[Path] = []

    def shard_path(self, index: int) -> Path:
        split = "val" if index == 0 else "train"
        return self.out_dir / f"{self.name}_{split}_{index:06d}.bin"

    def add(self, tokens: np.ndarray) -> None:
        while tokens.size:
            take = min(tokens.size, self.buffer.size - self.filled)
            self.buffer[self.filled : self.filled + take] = tokens[:take]
            self.filled += take
            tokens = tokens[take:]
            if self.filled == self.buffer.size:
                self._write()

    def close(self) -> list[Path]:
        if self.filled:
            self._write()
        return self.paths

    def _write(self) -> None:
        path = self.shard_path(len(self.paths))
        with stop_signals_held():  # a shard on disk is in self.paths, and no temporary file is left behind
            write_shard(path, self.buffer[: self.filled])
            self.paths.append(path)
            self.filled = 0


@contextlib.contextmanager
def stop_signals_held() -> Iterator[None]:
    """A Ctrl-C or SIGTERM arriving inside the block stops the run when the block is done. (Blocking the signals would
    not do: a signal blocked in one thread is delivered to another, and Python still runs the handler in the main one.)"""
    global _holding_stop, _stop_deferred
    outer, _holding_stop = _holding_stop, True
    try:
        yield
    finally:
        _holding_stop = outer
    if _stop_deferred and not outer:  # a nested block leaves the stop to the outermost one
        _stop_deferred = False
        raise KeyboardInterrupt


def lock_out_dir(out_dir: Path) -> TextIO:
    """Creates out_dir and takes an OS lock on its LOCK_NAME file, held while the returned file stays open: a second
    writer into the same folder is refused. The lock dies with its process, so a killed writer leaves no stale lock
    (the lock file itself stays, harmless)."""
    try:
        out_dir.mkdir(parents=True, exist_ok=True)
        lock = (out_dir / LOCK_NAME).open("a+")
    except OSError as error:
        raise InputError(f"--out-dir {out_dir}: cannot write there ({error.strerror}); pass a folder you can write to") from None
    try:
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        lock.seek(0)
        holder = lock.read().strip() or "another process"
        lock.close()
        raise InputError(
            f"--out-dir {out_dir}: another data/fineweb.py ({holder}) is writing there; wait for it to finish or pass another --out-dir"
        ) from None
    lock.truncate(0)
    lock.write(f"pid {os.getpid()}\n")
    lock.flush()
    return lock


def check_out_dir(out_dir: Path, name: str) -> None:
    existing = sorted(out_dir.glob(f"{glob.escape(name)}_*.bin"))  # escaped: a name such as run[1] is no pattern
    if existing:
        raise InputError(
            f"{out_dir} already holds {len(existing)} shards named {name}_*.bin (e.g. {existing[0].name}); "
            "pass another --out-dir or --name, existing shards are never overwritten"
        )


def tokenize_corpus(
    documents: Iterable[str],
    out_dir: Path,
    name: str = "fineweb",
    shard_size: int = DEFAULT_SHARD_SIZE,
    bpe_file: Path | None = None,
    workers: int | None = None,
) -> list[Path]:
    """Tokenize `documents` in `workers` processes and write the shards; returns their paths. Empty documents are
    skipped; an input without text writes nothing and raises InputError. A refused run (InputError) removes the lock
    file and the folders it created, when they hold nothing else."""
    if not 0 < shard_size <= MAX_SHARD_TOKENS:
        raise InputError(f"--shard-size must lie in [1, {MAX_SHARD_TOKENS}] (the header's token count is an int32), got {shard_size}")
    gpt2_encoding(bpe_file)  # fail here, once, rather than in every worker
    new_folders = [folder for folder in [out_dir, *out_dir.parents] if not folder.exists()]  # innermost first
    new_lock = not (out_dir / LOCK_NAME).exists()
    with lock_out_dir(out_dir):
        try:
            check_out_dir(out_dir, name)
            return _write_shards(documents, out_dir, name, shard_size, bpe_file, workers)
        except InputError:
            remove_what_a_refused_run_created(out_dir / LOCK_NAME if new_lock else None, new_folders)
            raise


def remove_what_a_refused_run_created(lock: Path | None, new_folders: list[Path]) -> None:
    """The lock file a refused run created (None: it was there before), then the folders it created (innermost first)
    as long as they are empty."""
    if lock is not None:
        lock.unlink(missing_ok=True)
    for folder in new_folders:
        if any(folder.iterdir()):
            break
        folder.rmdir()


def _write_shards(
    documents: Iterable[str], out_dir: Path, name: str, shard_size: int, bpe_file: Path | None, workers: int | None
) -> list[Path]:
    writer = ShardWriter(out_dir, name, shard_size)
    count = DocumentCount()
    stop_feeding = threading.Event()
    pool = tokenizer_pool(workers or usable_cores(), bpe_file)
    try:
        # Held: a KeyboardInterrupt raised by the handler inside the pool's iterator or tqdm's update can leave one
        # of their locks held (tqdm's write lock takes two locks in a Python loop; the iterator's condition
        # re-acquires its lock in Python), and the pool's join then waited forever: a test hung once in 12 runs.
        # A stop is noticed between results instead, and raised when the bar is closed.
        with stop_signals_held(), tqdm(desc=f"tokenizing into {out_dir}", unit="tokens", unit_scale=True) as progress:
            documents_until_stopped = until_set(stop_feeding, count.skip_empty(documents))
            for tokens in pool.imap(tokenize, documents_until_stopped, chunksize=DOCUMENTS_PER_TASK):
                writer.add(tokens)
                progress.update(tokens.size)
                if _stop_deferred:
                    break
        paths = writer.close()
    except InputError as error:
        if not writer.paths:
            raise
        raise InputError(
            f"{error} ({len(writer.paths)} shards were already written to {out_dir}; delete them before running again)"
        ) from None
    except KeyboardInterrupt:
        raise Interrupted(
            f"interrupted: {len(writer.paths)} complete shards are in {out_dir} (the one being filled was not written); "
            "delete them before running again"
        ) from None
    finally:  # never Pool.terminate (see tokenizer_pool): the workers finish the documents they hold and exit
        stop_feeding.set()
        pool.close()
        pool.join()
    if not paths:
        what = f"its {count.seen} documents are all empty" if count.seen else "it holds no documents"
        raise InputError(f"the input has no text ({what}), so no shards were written to {out_dir}; check the --input files")
    return paths


def validation_only_note(val_shard: Path, num_tokens: int, shard_size: int) -> str:
    """What to do when the whole corpus fit in the validation shard: a --shard-size that leaves most of it to
    training (a tenth validates), never below what the smoke run validates on."""
    note = (f"note: all {num_tokens:,} tokens went to the validation shard {val_shard} (--shard-size {shard_size} "
            "is larger than the corpus), so there is nothing to train on")
    if num_tokens < 2 * SMOKE_VAL_TOKENS:
        return (f"{note}; add text: train_gpt.py --preset=smoke needs a validation shard of {SMOKE_VAL_TOKENS:,} tokens "
                "and more to train on (README.md, 'Your own text')")
    suggested = max(SMOKE_VAL_TOKENS, num_tokens // 10)
    return (f"{note}; delete it and run again with --shard-size {suggested}: the first {suggested:,} tokens validate, "
            "the rest train (README.md, 'Your own text', says how much a smoke run needs)")


STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)
_stop_signal: signal.Signals | None = None  # the signal that stopped this run, if one did
_holding_stop = False  # inside stop_signals_held()
_stop_deferred = False  # a stop signal arrived there


@contextlib.contextmanager
def stop_signals_handled_by(handler: signal.Handlers | Callable[[int, object], None]) -> Iterator[None]:
    """Ctrl-C and SIGTERM go to `handler` inside the block, then back to what they were."""
    previous = {stop: signal.signal(stop, handler) for stop in STOP_SIGNALS}
    try:
        yield
    finally:
        for stop, previous_handler in previous.items():
            signal.signal(stop, previous_handler)


def _stop_on_signal(signum: int, frame: object) -> None:
    """Ctrl-C and SIGTERM stop tokenizing the same way; later ones do nothing. A second signal (Ctrl-C pressed twice,
    `timeout`, which signals the command and then its process group) would otherwise break into the pool's shutdown
    with a traceback, or kill the process before its semaphores are released (the resource tracker then warns). The
    handler stays installed rather than switching to SIG_IGN, which workers started later would inherit."""
    global _stop_signal, _stop_deferred
    if _stop_signal is not None:
        return
    _stop_signal = signal.Signals(signum)
    if _holding_stop:
        _stop_deferred = True
    else:
        raise KeyboardInterrupt


# ---------------------------------------------------------------------------------------------
# Command line


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--input", type=Path, nargs="+", metavar="PATH", help="local files or directories")
    source.add_argument("--hf-sample", choices=sorted(HF_SAMPLES), help=f"a sample of {HF_DATASET} (online)")
    parser.add_argument("--out-dir", type=Path, help="where the shards go (default for --hf-sample: data/fineweb10B or data/fineweb100B)")
    parser.add_argument("--name", default="fineweb", help="shard file prefix (default: %(default)s)")
    parser.add_argument("--shard-size", type=int, default=DEFAULT_SHARD_SIZE, help="tokens per shard (default: %(default)s)")
    parser.add_argument("--bpe-file", type=Path, help="a local gpt2.tiktoken, for machines where tiktoken cannot download it")
    parser.add_argument("--workers", type=int, help="tokenizer processes, at most one per usable core (default: one per usable core)")
    args = parser.parse_args(argv)
    if args.out_dir is None:
        if args.input:
            parser.error("--out-dir is required with --input")
        args.out_dir = HF_SAMPLES[args.hf_sample]
    cores = usable_cores()
    if args.workers is None:
        args.workers = cores
    if args.workers < 1:
        parser.error(f"--workers must be at least 1, got {args.workers}")
    if args.workers > cores:  # each worker holds a tokenizer: more only take memory
        parser.error(f"--workers {args.workers}: this machine gives the process {cores} cores; use at most {cores}")
    if not args.name or Path(args.name).name != args.name or args.name in (".", ".."):
        parser.error(f"--name {args.name!r}: a file name prefix, without a folder; pass the folder as --out-dir")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    global _stop_signal, _stop_deferred
    _stop_signal, _stop_deferred = None, False
    try:
        with stop_signals_handled_by(_stop_on_signal):
            documents = local_documents(expand_inputs(args.input)) if args.input else hub_documents(args.hf_sample)
            paths = tokenize_corpus(documents, args.out_dir, args.name, args.shard_size, args.bpe_file, args.workers)
    except InputError as error:
        print(f"error: {error}", file=sys.stderr)
        return 1
    except Interrupted as stop:
        print(stop, file=sys.stderr)
        return 128 + (_stop_signal or signal.SIGINT)
    except KeyboardInterrupt:  # outside the tokenizing loop: while listing the inputs, or around the lock
        print(f"interrupted before tokenizing finished; no partial shard was written to {args.out_dir}", file=sys.stderr)
        return 128 + (_stop_signal or signal.SIGINT)
    print(f"wrote {len(paths)} shards to {args.out_dir}: 1 validation shard, {len(paths) - 1} training shards")
    if len(paths) == 1:
        print(validation_only_note(paths[0], read_header(paths[0]), args.shard_size))
    return 0


def script_main(argv: Sequence[str] | None = None) -> int:
    """main() for `python data/fineweb.py`. A stopped run exits right after main(), whose pool is closed and joined and
    whose shards are on disk: the interpreter's shutdown puts the default handlers back, and a signal still arriving
    then (Ctrl-C held down, `timeout` signalling the group) would kill the process instead of its exit status 130/143."""
    for stop in STOP_SIGNALS:
        signal.signal(stop, _stop_on_signal)
    status = main(argv)
    if _stop_signal is not None:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(status)
    return status


if __name__ == "__main__":
    sys.exit(script_main())
