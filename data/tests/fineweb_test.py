"""Tokenizing local corpora into shards, with a tiny BPE built here (no network)."""

from __future__ import annotations

import base64
import contextlib
import gzip
import json
import lzma
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from fineweb import EOT, LOCK_NAME, InputError, expand_inputs, gpt2_encoding, local_documents, lock_out_dir, main, tokenize_corpus
from shards import read_shard, write_shard

DATA_DIR = Path(__file__).resolve().parents[1]
MERGES = [b"th", b"he", b"the", b" t", b" the", b"in", b"an", b"nd", b" a", b"and"]
DOCUMENTS = [
    "the cat and the hat",
    "Ünïcödé text: naïve café, 東京, emoji 🙂.",
    "Windows line endings\r\nare kept.\r\n",
    "A document that mentions <|endoftext|> as plain text.",
    "",
    "   leading and trailing whitespace \n\n\t",
    "the " * 40,
]


@pytest.fixture
def bpe_file(tmp_path: Path) -> Path:
    """The 256 single bytes plus a few merges, in tiktoken's `base64(token) rank` format."""
    tokens = [bytes([value]) for value in range(256)] + MERGES
    path = tmp_path / "tiny.tiktoken"
    path.write_text("".join(f"{base64.b64encode(token).decode()} {rank}\n" for rank, token in enumerate(tokens)))
    return path


def write_corpus(folder: Path, kind: str, documents: list[str]) -> list[Path]:
    """`documents` stored in the local input format `kind`; returns the files in reading order."""
    folder.mkdir(parents=True, exist_ok=True)
    if kind in ("txt", "gz", "xz"):
        opener = {"txt": open, "gz": gzip.open, "xz": lzma.open}[kind]
        paths = [folder / f"doc{index:02d}.{kind}" for index in range(len(documents))]
        for path, text in zip(paths, documents):
            with opener(path, "wb") as f:
                f.write(text.encode())
        return paths
    if kind in ("jsonl", "jsonl.gz"):
        path = folder / f"docs.{kind}"
        opener = gzip.open if kind.endswith(".gz") else open
        with opener(path, "wt", encoding="utf-8") as f:
            f.writelines(json.dumps({"id": index, "text": text}) + "\n" for index, text in enumerate(documents))
        return [path]
    if kind == "parquet":
        path = folder / "docs.parquet"
        pq.write_table(pa.table({"text": documents, "id": list(range(len(documents)))}), path, row_group_size=3)
        return [path]
    raise AssertionError(kind)


def shard_order(paths: list[Path]) -> list[Path]:
    return sorted(paths, key=lambda path: ("_train_" in path.name, path.name))


def all_tokens(out_dir: Path) -> np.ndarray:
    return np.concatenate([read_shard(path) for path in shard_order(list(out_dir.glob("*.bin")))])


@pytest.mark.parametrize("kind", ["txt", "jsonl", "jsonl.gz", "parquet", "xz", "gz"])
def test_every_local_format_round_trips(tmp_path: Path, bpe_file: Path, kind: str) -> None:
    files = write_corpus(tmp_path / "corpus", kind, DOCUMENTS)
    assert list(local_documents(expand_inputs(files))) == DOCUMENTS
    out = tmp_path / "shards"
    paths = tokenize_corpus(local_documents(files), out, "tiny", shard_size=64, bpe_file=bpe_file, workers=1)
    tokens = all_tokens(out)

    encoding = gpt2_encoding(bpe_file)
    with_text = [text for text in DOCUMENTS if text]  # an empty document adds nothing, not even its EOT
    assert encoding.decode(tokens.tolist()) == "".join("<|endoftext|>" + text for text in with_text)
    # One EOT before every document and nowhere else (the literal "<|endoftext|>" text is not special).
    eot_positions = np.flatnonzero(tokens == EOT)
    assert len(eot_positions) == len(with_text) and eot_positions[0] == 0
    for text, start, end in zip(with_text, eot_positions, [*eot_positions[1:], len(tokens)]):
        assert encoding.decode(tokens[start + 1 : end].tolist()) == text
    assert {256, 258, 260} <= set(tokens.tolist())  # the file's merges were used

    assert [path.name for path in paths] == ["tiny_val_000000.bin"] + [
        f"tiny_train_{index:06d}.bin" for index in range(1, len(paths))
    ]
    sizes = [read_shard(path).size for path in paths]
    assert all(size == 64 for size in sizes[:-1]) and 0 < sizes[-1] <= 64 and len(sizes) >= 3
    assert sorted(out.iterdir()) == sorted([*paths, out / LOCK_NAME])  # no temporary files left


def test_shard_split_is_exact_at_the_boundary(tmp_path: Path, bpe_file: Path) -> None:
    # "ab" -> [EOT, a, b]: four such documents are 12 tokens, exactly two shards of 6.
    out = tmp_path / "shards"
    paths = tokenize_corpus(["ab"] * 4, out, "x", shard_size=6, bpe_file=bpe_file, workers=1)
    assert [path.name for path in paths] == ["x_val_000000.bin", "x_train_000001.bin"]
    a, b = ord("a"), ord("b")
    for path in paths:
        np.testing.assert_array_equal(read_shard(path), [EOT, a, b, EOT, a, b])


def test_documents_continue_across_shards_and_workers_keep_order(tmp_path: Path, bpe_file: Path) -> None:
    documents = [f"document number {index} " + "and the " * (index % 7) for index in range(200)]
    one, two = tmp_path / "one", tmp_path / "two"
    tokenize_corpus(documents, one, "c", shard_size=500, bpe_file=bpe_file, workers=1)
    tokenize_corpus(documents, two, "c", shard_size=500, bpe_file=bpe_file, workers=2)
    tokens = all_tokens(one)
    np.testing.assert_array_equal(tokens, all_tokens(two))
    assert gpt2_encoding(bpe_file).decode(tokens.tolist()) == "".join("<|endoftext|>" + d for d in documents)


def test_existing_shards_are_never_overwritten(tmp_path: Path, bpe_file: Path) -> None:
    out = tmp_path / "shards"
    out.mkdir()
    write_shard(out / "c_val_000000.bin", np.array([1, 2, 3], dtype=np.uint16))
    with pytest.raises(InputError, match="already holds 1 shards named c_"):
        tokenize_corpus(["text"], out, "c", shard_size=10, bpe_file=bpe_file, workers=1)
    np.testing.assert_array_equal(read_shard(out / "c_val_000000.bin"), [1, 2, 3])


def test_a_name_with_glob_characters_still_finds_its_existing_shards(tmp_path: Path, bpe_file: Path) -> None:
    """--name run[1]: unescaped, the check looked for run1_*.bin, and the write then failed with a FileExistsError
    traceback after tokenizing a whole shard's worth of text."""
    out = tmp_path / "shards"
    out.mkdir()
    write_shard(out / "run[1]_val_000000.bin", np.array([1, 2, 3], dtype=np.uint16))
    with pytest.raises(InputError, match=r"already holds 1 shards named run\[1\]_"):
        tokenize_corpus(["text"], out, "run[1]", shard_size=10, bpe_file=bpe_file, workers=1)
    np.testing.assert_array_equal(read_shard(out / "run[1]_val_000000.bin"), [1, 2, 3])


@pytest.mark.parametrize("how", ["named-twice", "file-and-its-folder", "symlink"])
def test_an_input_file_reached_twice_is_refused(tmp_path: Path, capsys: pytest.CaptureFixture[str], how: str) -> None:
    """Tokenized twice, its documents went into the validation shard and again into a training shard."""
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    text = corpus / "a.txt"
    text.write_text("some text")
    inputs = {"named-twice": [text, text], "file-and-its-folder": [corpus, text], "symlink": [text, tmp_path / "link.txt"]}[how]
    (tmp_path / "link.txt").symlink_to(text)
    out = tmp_path / "out"
    assert main(["--input", *map(str, inputs), "--out-dir", str(out), "--workers", "1"]) == 1
    error = capsys.readouterr().err.strip()
    assert error.startswith(f"error: --input {inputs[1]}: this file is given twice") and "pass each file or folder once" in error
    assert "\n" not in error and not out.exists()


def test_a_subfolder_that_cannot_be_listed_is_one_line(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Path.rglob skipped it without a word, so its documents were missing from the shards. No permission is stood in
    for (root may list any folder)."""
    corpus = tmp_path / "corpus"
    for folder in ("a", "b"):
        (corpus / folder).mkdir(parents=True)
        (corpus / folder / "doc.txt").write_text("some text")
    real_scandir = os.scandir

    def scandir_refusing_b(path: object = ".") -> object:
        if Path(os.fsdecode(path)) == corpus / "b":
            raise PermissionError(13, "Permission denied", os.fsdecode(path))
        return real_scandir(path)

    monkeypatch.setattr(os, "scandir", scandir_refusing_b)
    with pytest.raises(InputError, match=f"--input {corpus}: cannot list {corpus / 'b'} \\(Permission denied\\); make it readable"):
        expand_inputs([corpus])


def test_a_shard_size_beyond_the_header_is_refused_before_tokenizing(tmp_path: Path, bpe_file: Path) -> None:
    """The header counts tokens in an int32: a larger --shard-size failed only when the first shard was written."""
    out = tmp_path / "out"
    with pytest.raises(InputError, match=r"--shard-size must lie in \[1, 2147483647\] .* got 2147483648"):
        tokenize_corpus(["text"], out, "c", shard_size=2**31, bpe_file=bpe_file, workers=1)
    assert not out.exists()


def bad_input(tmp_path: Path) -> dict[str, tuple[Path, str]]:
    """Broken inputs and the words their error must contain."""
    cases = {}
    path = tmp_path / "notes.md"
    path.write_text("hello")
    cases["unsupported-suffix"] = (path, "notes.md: unsupported file type")
    path = tmp_path / "missing_text.jsonl"
    path.write_text('{"text": "ok"}\n{"body": "no text here"}\n')
    cases["jsonl-without-text"] = (path, 'missing_text.jsonl:2: no string "text" field')
    path = tmp_path / "broken.jsonl"
    path.write_text('{"text": "ok"\n')
    cases["jsonl-not-json"] = (path, "broken.jsonl:1: not valid JSON")
    path = tmp_path / "latin1.txt"
    path.write_bytes("caf\xe9".encode("latin-1"))
    cases["not-utf8"] = (path, "latin1.txt: not UTF-8 text")
    path = tmp_path / "body.parquet"
    pq.write_table(pa.table({"body": ["x"]}), path)
    cases["parquet-without-text"] = (path, 'body.parquet: no "text" column')
    path = tmp_path / "numbers.parquet"
    pq.write_table(pa.table({"text": [1, 2]}), path)
    cases["parquet-int-text"] = (path, 'numbers.parquet: the "text" column holds int64 values, not strings')
    path = tmp_path / "gaps.parquet"
    pq.write_table(pa.table({"text": ["ok", None]}), path)
    cases["parquet-null-text"] = (path, 'gaps.parquet: a row has no text (null "text" value)')
    path = tmp_path / "fake.parquet"
    path.write_text("not parquet at all")
    cases["not-parquet"] = (path, "fake.parquet: not a readable parquet file")
    path = tmp_path / "truncated.gz"
    compressed = gzip.compress(" ".join(str(n) for n in range(5000)).encode())
    path.write_bytes(compressed[: len(compressed) // 2])
    cases["truncated-gzip"] = (path, "truncated.gz: cannot read it")
    path = tmp_path / "garbage.txt.xz"
    path.write_bytes(os.urandom(64))
    cases["not-xz"] = (path, "garbage.txt.xz: cannot read it")
    path = tmp_path / "flipped.txt.xz"
    compressed = bytearray(lzma.compress(" ".join(str(n) for n in range(5000)).encode()))
    compressed[len(compressed) // 2] ^= 0xFF
    path.write_bytes(bytes(compressed))
    cases["corrupt-xz"] = (path, "flipped.txt.xz: cannot read it")
    cases["missing"] = (tmp_path / "absent.txt", "absent.txt: no such file or directory")
    return cases


@pytest.mark.parametrize(
    "case",
    [
        "unsupported-suffix", "jsonl-without-text", "jsonl-not-json", "not-utf8", "parquet-without-text", "parquet-int-text",
        "parquet-null-text", "not-parquet", "truncated-gzip", "not-xz", "corrupt-xz", "missing",
    ],
)
def test_bad_input_is_one_clear_line(tmp_path: Path, bpe_file: Path, capsys: pytest.CaptureFixture[str], case: str) -> None:
    path, expected = bad_input(tmp_path)[case]
    argv = ["--input", str(path), "--bpe-file", str(bpe_file), "--out-dir", str(tmp_path / "out"), "--workers", "1"]
    assert main(argv) == 1
    error_lines = capsys.readouterr().err.strip().splitlines()
    assert error_lines[-1].startswith("error: ") and expected in error_lines[-1]


def test_error_after_written_shards_says_so(tmp_path: Path, bpe_file: Path) -> None:
    write_corpus(tmp_path / "corpus", "txt", DOCUMENTS * 6)  # several tasks' worth of documents come first
    (tmp_path / "corpus" / "zz_latin1.txt").write_bytes("caf\xe9".encode("latin-1"))
    out = tmp_path / "out"
    with pytest.raises(InputError, match=r"zz_latin1.txt: not UTF-8 .*\(\d+ shards were already written to .*delete them"):
        tokenize_corpus(local_documents(expand_inputs([tmp_path / "corpus"])), out, "c", 16, bpe_file, workers=1)
    assert any(out.iterdir())


def test_interrupt_keeps_the_complete_shards_and_says_so(
    tmp_path: Path, bpe_file: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    import fineweb

    write_corpus(tmp_path / "corpus", "txt", DOCUMENTS * 6)
    original, calls = fineweb.ShardWriter.add, []

    def add_then_interrupt(self: fineweb.ShardWriter, tokens: np.ndarray) -> None:
        calls.append(1)
        if len(calls) == 20:
            raise KeyboardInterrupt  # what Ctrl-C raises in the parent
        original(self, tokens)

    monkeypatch.setattr(fineweb.ShardWriter, "add", add_then_interrupt)
    out = tmp_path / "out"
    status = main(["--input", str(tmp_path / "corpus"), "--bpe-file", str(bpe_file), "--out-dir", str(out), "--shard-size", "16", "--workers", "1"])
    assert status == 130
    last_line = capsys.readouterr().err.splitlines()[-1]  # after tqdm's progress bar
    written = sorted(path for path in out.iterdir() if path.name != LOCK_NAME)
    assert last_line == f"interrupted: {len(written)} complete shards are in {out} (the one being filled was not written); delete them before running again"
    assert len(written) >= 2 and all(read_shard(path).size == 16 for path in written)  # complete shards, no temporary files


def handler_a_worker_must_not_inherit(signum: int, frame: object) -> None:
    raise AssertionError("only the parent installed this handler")


def test_workers_start_fresh_and_ignore_stop_signals(bpe_file: Path) -> None:
    """A forked worker would carry the parent's handlers and the locks of its other threads: SIGUSR1, which nothing in
    fineweb.py touches, shows that the workers are fresh interpreters. Ctrl-C and SIGTERM are the parent's to handle."""
    from fineweb import tokenizer_pool

    previous = signal.signal(signal.SIGUSR1, handler_a_worker_must_not_inherit)
    pool = tokenizer_pool(1, bpe_file)
    try:
        assert pool.apply(signal.getsignal, (signal.SIGUSR1,)) == signal.SIG_DFL
        assert [pool.apply(signal.getsignal, (stop,)) for stop in (signal.SIGINT, signal.SIGTERM)] == [signal.SIG_IGN] * 2
    finally:
        pool.close()
        pool.join()
        signal.signal(signal.SIGUSR1, previous)
    assert signal.getsignal(signal.SIGUSR1) is previous and signal.getsignal(signal.SIGINT) is not signal.SIG_IGN


SLOW_CORPUS_RUN = """
import sys, time
sys.path.insert(0, sys.argv[1])
import fineweb

def slow_documents(paths):  # an endless corpus, a document every millisecond: the run lasts until it is stopped
    while True:
        time.sleep(0.001)
        yield "the cat and the hat " * 20

fineweb.local_documents = slow_documents
sys.exit(fineweb.script_main(["--input", sys.argv[2], "--bpe-file", sys.argv[3], "--out-dir", sys.argv[4], "--shard-size", "500"]))
"""


@pytest.mark.parametrize("stop_signals", [["SIGINT"], ["SIGTERM"], ["SIGINT", "SIGTERM"]])
def test_repeated_stop_signals_to_the_process_group_end_the_run_in_one_line(
    tmp_path: Path, bpe_file: Path, stop_signals: list[str]
) -> None:
    """Ctrl-C pressed again and again in a terminal, or `timeout`, signal the run's whole process group, workers
    included, while the pool shuts down: the first signal stops the run, the later ones must not break into the
    shutdown with a traceback, kill a worker that holds the pool's queue lock (the pool then hangs) or outlive it."""
    corpus = write_corpus(tmp_path / "corpus", "txt", ["unused: the run reads slow_documents"])[0]
    out = tmp_path / "out"
    run = subprocess.Popen([sys.executable, "-c", SLOW_CORPUS_RUN, str(DATA_DIR), str(corpus), str(bpe_file), str(out)],
                           stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)  # fmt: skip
    try:
        deadline = time.monotonic() + 60
        while not list(out.glob("fineweb_train_*.bin")) and run.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)  # until the first training shard is written
        sent = 0
        while run.poll() is None and time.monotonic() < deadline:
            os.killpg(run.pid, getattr(signal, stop_signals[sent % len(stop_signals)]))
            sent += 1
            time.sleep(0.01)
        stdout, stderr = run.communicate(timeout=10)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(run.pid, signal.SIGKILL)  # a hung run must not outlive the test
    assert sent >= 1
    written = sorted(path for path in out.iterdir() if path.name != LOCK_NAME)
    assert [line for line in stderr.splitlines() if line and "tokenizing into" not in line] == [  # only tqdm's bar besides
        f"interrupted: {len(written)} complete shards are in {out} (the one being filled was not written); "
        "delete them before running again"
    ], stderr
    assert run.returncode == 128 + getattr(signal, stop_signals[0])
    assert len(written) >= 2 and all(read_shard(path).size == 500 for path in written)
    deadline = time.monotonic() + 10
    while group_is_alive(run.pid) and time.monotonic() < deadline:
        time.sleep(0.05)  # the resource tracker leaves once the run has exited
    assert not group_is_alive(run.pid), "a worker or helper process outlived the run"


def group_is_alive(process_group: int) -> bool:
    try:
        os.killpg(process_group, 0)
    except ProcessLookupError:
        return False
    return True


def test_a_stop_signal_during_a_shard_write_waits_for_it(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A signal between linking a shard and counting it would make the interrupt message one shard short."""
    import fineweb

    monkeypatch.setattr(signal, "signal", lambda signum, handler: None)  # keeps pytest's own SIGINT and SIGTERM handlers
    monkeypatch.setattr(fineweb, "_stop_signal", None)
    monkeypatch.setattr(fineweb, "_stop_deferred", False)
    original_write_shard = fineweb.write_shard

    def write_then_signal(path: Path, tokens: np.ndarray) -> None:
        original_write_shard(path, tokens)
        fineweb._stop_on_signal(signal.SIGTERM, None)  # as if SIGTERM arrived right after the link

    monkeypatch.setattr(fineweb, "write_shard", write_then_signal)
    writer = fineweb.ShardWriter(tmp_path, "tiny", 4)
    with pytest.raises(KeyboardInterrupt):
        writer.add(np.arange(6, dtype=np.uint16))
    assert writer.paths == [tmp_path / "tiny_val_000000.bin"] and writer.filled == 0


@pytest.mark.parametrize("shard_size", [10_000, 64])  # the stop before any shard is written, and after some
def test_a_stop_signal_inside_the_tokenizing_loop_is_raised_between_results(
    tmp_path: Path, bpe_file: Path, monkeypatch: pytest.MonkeyPatch, shard_size: int
) -> None:
    """The handler's KeyboardInterrupt, raised inside tqdm's update (or the pool's iterator), can leave their locks
    held and hang the pool's join: inside the loop a stop must wait for the next result and end the run there, also
    after a shard write (whose own held block ends inside the loop's)."""
    import fineweb

    monkeypatch.setattr(signal, "signal", lambda signum, handler: None)  # keeps pytest's own SIGINT and SIGTERM handlers
    monkeypatch.setattr(fineweb, "_stop_signal", None)
    monkeypatch.setattr(fineweb, "_stop_deferred", False)
    out = tmp_path / "out"
    out.mkdir()
    updates_finished: list[float | None] = []
    signalled_at: list[int] = []

    class SignalledBar(fineweb.tqdm):
        def update(self, n: float | None = 1) -> bool | None:
            if not signalled_at and (shard_size > 1000 or any(out.glob("*.bin"))):
                signalled_at.append(len(updates_finished))
                fineweb._stop_on_signal(signal.SIGINT, None)  # as if Ctrl-C arrived while tqdm held its lock
            result = super().update(n)
            updates_finished.append(n)
            return result

    monkeypatch.setattr(fineweb, "tqdm", SignalledBar)
    with pytest.raises(fineweb.Interrupted, match="interrupted: [0-9]+ complete shards") as stop:
        fineweb._write_shards(DOCUMENTS[:1] * 200, out, "tiny", shard_size, bpe_file, workers=1)
    assert len(updates_finished) == signalled_at[0] + 1 and fineweb._stop_deferred is False  # that update finished, then the stop
    written = sorted(out.iterdir())
    assert f"interrupted: {len(written)} complete shards" in str(stop.value)
    assert (written == []) == (shard_size > 1000)


def test_an_interrupt_before_tokenizing_is_one_line(tmp_path: Path, bpe_file: Path, capsys: pytest.CaptureFixture[str],
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """A Ctrl-C before the tokenizing loop (here while the inputs are listed) is one line, not a traceback."""
    import fineweb

    def interrupted(paths: object) -> None:
        raise KeyboardInterrupt  # Ctrl-C while the inputs are listed

    monkeypatch.setattr(fineweb, "expand_inputs", interrupted)
    out = tmp_path / "out"
    try:
        status = main(["--input", str(tmp_path), "--bpe-file", str(bpe_file), "--out-dir", str(out)])
    except KeyboardInterrupt:
        pytest.fail("the KeyboardInterrupt escaped main()")
    assert status == 130
    assert capsys.readouterr().err == f"interrupted before tokenizing finished; no partial shard was written to {out}\n"
    assert not out.exists()


def test_hub_source_without_datasets_names_the_install_command(
    tmp_path: Path, bpe_file: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setitem(sys.modules, "datasets", None)  # makes `import datasets` fail, as when it is not installed
    assert main(["--hf-sample", "10BT", "--bpe-file", str(bpe_file), "--out-dir", str(tmp_path / "out")]) == 1
    assert capsys.readouterr().err.strip() == "error: reading HuggingFaceFW/fineweb needs the datasets library: pip install datasets"
    assert not (tmp_path / "out").exists()


def test_bad_bpe_file_is_a_clear_error(tmp_path: Path) -> None:
    path = tmp_path / "bad.tiktoken"
    path.write_text("not-base64!! 0\n")
    with pytest.raises(InputError, match="bad.tiktoken:1: expected `base64-token rank`"):
        gpt2_encoding(path)
    with pytest.raises(InputError, match="cannot read it"):
        gpt2_encoding(tmp_path / "absent.tiktoken")
    path.write_text(f"{base64.b64encode(b'x').decode()} {EOT}\n")
    with pytest.raises(InputError, match="not GPT-2's BPE"):
        gpt2_encoding(path)


def test_script_runs_from_the_command_line(tmp_path: Path, bpe_file: Path) -> None:
    files = write_corpus(tmp_path / "corpus", "txt", DOCUMENTS)
    out = tmp_path / "out"
    result = subprocess.run(
        [sys.executable, str(DATA_DIR / "fineweb.py"), "--input", str(tmp_path / "corpus"), "--bpe-file", str(bpe_file),
         "--out-dir", str(out), "--name", "tiny", "--shard-size", "100", "--workers", str(min(2, len(os.sched_getaffinity(0))))],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert "wrote 3 shards" in result.stdout and "2 training shards" in result.stdout
    text = gpt2_encoding(bpe_file).decode(all_tokens(out).tolist())
    assert text == "".join("<|endoftext|>" + path.read_bytes().decode() for path in files if path.stat().st_size)


# ----- an empty corpus, a second writer, a corpus smaller than one shard, a missing package -----


@pytest.mark.parametrize("documents", [[], ["", ""]])
def test_a_corpus_without_text_writes_nothing(tmp_path: Path, bpe_file: Path, capsys: pytest.CaptureFixture[str],
                                              documents: list[str]) -> None:
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    for index, text in enumerate(documents):
        (corpus / f"empty{index}.txt").write_text(text)
    source = corpus if documents else write_corpus(corpus, "jsonl", [])[0]  # an empty .jsonl: no documents at all
    out = tmp_path / "out"
    assert main(["--input", str(source), "--bpe-file", str(bpe_file), "--out-dir", str(out), "--workers", "1"]) == 1
    what = "its 2 documents are all empty" if documents else "it holds no documents"
    assert capsys.readouterr().err.splitlines()[-1] == (
        f"error: the input has no text ({what}), so no shards were written to {out}; check the --input files")
    assert not out.exists()  # nor its lock file, nor the folder the refused run created

    out.mkdir()
    (out / "notes.txt").write_text("mine")
    assert main(["--input", str(source), "--bpe-file", str(bpe_file), "--out-dir", str(out), "--workers", "1"]) == 1
    assert [path.name for path in out.iterdir()] == ["notes.txt"]  # a folder that was there stays, as it was


def test_a_second_writer_into_the_same_folder_is_refused(tmp_path: Path, bpe_file: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "out"
    files = write_corpus(tmp_path / "corpus", "txt", DOCUMENTS)
    with lock_out_dir(out):  # the first writer, still at work
        args = ["--input", *map(str, files), "--bpe-file", str(bpe_file), "--out-dir", str(out), "--workers", "1"]
        second = subprocess.run([sys.executable, str(DATA_DIR / "fineweb.py"), *args], capture_output=True, text=True, timeout=60)
    assert second.returncode == 1 and second.stdout == ""
    assert second.stderr == (f"error: --out-dir {out}: another data/fineweb.py (pid {os.getpid()}) is writing there; "
                             "wait for it to finish or pass another --out-dir\n")
    assert not list(out.glob("*.bin"))
    assert main(args) == 0  # the lock went with its holder
    assert len(list(out.glob("*.bin"))) == 1


def test_an_unwritable_out_dir_is_one_line(tmp_path: Path, bpe_file: Path, capsys: pytest.CaptureFixture[str]) -> None:
    blocker = tmp_path / "a_file"
    blocker.write_text("")
    assert main(["--input", *map(str, write_corpus(tmp_path / "corpus", "txt", ["text"])), "--bpe-file", str(bpe_file),
                 "--out-dir", str(blocker / "out"), "--workers", "1"]) == 1
    assert capsys.readouterr().err.splitlines()[-1] == f"error: --out-dir {blocker / 'out'}: cannot write there (Not a directory); pass a folder you can write to"


@pytest.mark.parametrize(("documents", "advice"), [
    (["the cat and the hat " * 40] * 40, "delete it and run again with --shard-size {tenth}: the first {tenth:,} tokens validate"),
    (["the cat and the hat"] * 30, "add text: train_gpt.py --preset=smoke needs a validation shard of 1,026 tokens"),
])
def test_a_corpus_smaller_than_one_shard_says_which_shard_size_to_use(
    tmp_path: Path, bpe_file: Path, capsys: pytest.CaptureFixture[str], documents: list[str], advice: str
) -> None:
    """README's case: a few hundred lines and --shard-size 20000."""
    out = tmp_path / "out"
    source = write_corpus(tmp_path / "corpus", "jsonl", documents)[0]
    assert main(["--input", str(source), "--bpe-file", str(bpe_file), "--out-dir", str(out), "--workers", "1", "--shard-size", "20000"]) == 0
    stdout = capsys.readouterr().out.splitlines()
    total = read_shard(out / "fineweb_val_000000.bin").size
    assert stdout[0] == f"wrote 1 shards to {out}: 1 validation shard, 0 training shards"
    assert stdout[1].startswith(f"note: all {total:,} tokens went to the validation shard {out / 'fineweb_val_000000.bin'} "
                                "(--shard-size 20000 is larger than the corpus), so there is nothing to train on; ")
    assert advice.format(tenth=total // 10) in stdout[1]
    if "--shard-size" in advice:  # the suggestion splits the corpus: a tenth validates, the rest trains
        suggested = total // 10
        assert 1026 < suggested < 20000
        again = tmp_path / "again"
        assert main(["--input", str(source), "--bpe-file", str(bpe_file), "--out-dir", str(again), "--workers", "1",
                     "--shard-size", str(suggested)]) == 0
        assert read_shard(again / "fineweb_val_000000.bin").size == suggested and len(list(again.glob("*_train_*.bin"))) == 9


def test_run_outside_the_environment_names_the_missing_package(tmp_path: Path) -> None:
    """python -S: no site-packages, as with a python that is not the one requirements.txt went into."""
    for script, missing in (("fineweb.py", "numpy"), ("cached_fineweb10B.py", "huggingface_hub")):
        result = subprocess.run([sys.executable, "-S", str(DATA_DIR / script), "--help"], capture_output=True, text=True, timeout=60)
        assert result.returncode == 1 and result.stdout == ""
        assert result.stderr == (f"data/{script}: error: cannot import {missing} in {sys.executable}; install the requirements "
                                 f"(pip install -r requirements.txt, README.md#install) or run the Python that has them\n")


IMPORT_WITHOUT = """
import importlib, sys
sys.modules[sys.argv[1]] = None  # its import fails, as for a missing package
sys.path.insert(0, sys.argv[3])
try:
    importlib.import_module(sys.argv[2])
except ImportError as error:
    print("ImportError", error.name)
"""


@pytest.mark.parametrize(("module", "missing"), [("fineweb", "tiktoken"), ("hub_download", "huggingface_hub"),
                                                 ("cached_fineweb10B", "huggingface_hub")])
def test_an_importer_gets_the_import_error(module: str, missing: str) -> None:
    """Imported (by a test, a tool), the data scripts raise the ImportError rather than exit."""
    result = subprocess.run([sys.executable, "-c", IMPORT_WITHOUT, missing, module, str(DATA_DIR)], capture_output=True, text=True, timeout=60)
    assert (result.returncode, result.stdout, result.stderr) == (0, f"ImportError {missing}\n", "")


def test_a_bpe_file_without_every_byte_is_one_line(tmp_path: Path, bpe_file: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A truncated BPE file (here its first 100 ranks) cannot encode every byte: tiktoken panicked in each worker and the
    pool started new ones forever. Now one line before any worker starts, and nothing written."""
    truncated = tmp_path / "head.tiktoken"
    truncated.write_text("".join(bpe_file.read_text().splitlines(keepends=True)[:100]))
    (tmp_path / "a.txt").write_text("some text")
    out = tmp_path / "out"
    assert main(["--input", str(tmp_path / "a.txt"), "--bpe-file", str(truncated), "--out-dir", str(out), "--workers", "1"]) == 1
    assert capsys.readouterr().err.strip().splitlines() == [
        f"error: --bpe-file {truncated}: 156 of the 256 single bytes have no rank, so some text cannot be encoded; pass the complete gpt2.tiktoken"
    ]
    assert not list(out.glob("*.bin"))


@pytest.mark.parametrize(
    ("flag", "fragment"),
    [
        (("--workers", "100000"), "--workers 100000: this machine gives the process"),
        (("--name", "../escape"), "--name '../escape': a file name prefix, without a folder"),
        (("--name", "sub/shards"), "--name 'sub/shards': a file name prefix, without a folder"),
        (("--name", ""), "--name '': a file name prefix"),
    ],
)
def test_workers_beyond_the_cores_and_a_name_with_a_folder_are_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], flag: tuple[str, str], fragment: str
) -> None:
    (tmp_path / "a.txt").write_text("some text")
    with pytest.raises(SystemExit) as exit_info:
        main(["--input", str(tmp_path / "a.txt"), "--out-dir", str(tmp_path / "out"), *flag])
    assert exit_info.value.code == 2
    assert fragment in capsys.readouterr().err.strip().splitlines()[-1]
    assert not (tmp_path / "out").exists() and not list(tmp_path.parent.glob("escape*"))


def test_the_text_column_check_runs_on_a_pyarrow_without_string_views(monkeypatch: pytest.MonkeyPatch) -> None:
    """pyarrow.types.is_string_view came with pyarrow 16; requirements.txt pins no version, and on pyarrow 15 every
    parquet input stopped with an AttributeError."""
    import fineweb

    monkeypatch.delattr(pa.types, "is_string_view", raising=False)
    assert fineweb.holds_strings(pa.string()) and fineweb.holds_strings(pa.dictionary(pa.int32(), pa.large_string()))
    assert not fineweb.holds_strings(pa.int64())


@pytest.mark.parametrize("error", [ConnectionError("no network"), ValueError("hash mismatch")])
def test_tiktokens_failed_download_is_an_input_error(monkeypatch: pytest.MonkeyPatch, error: Exception) -> None:
    import fineweb

    def failing(name: str) -> None:
        raise error

    monkeypatch.setattr(fineweb.tiktoken, "get_encoding", failing)
    with pytest.raises(InputError, match=f"tiktoken could not load its gpt2 encoding \\({type(error).__name__}\\); pass --bpe-file PATH"):
        fineweb.tiktoken_gpt2()


def test_a_fault_in_tiktoken_that_is_not_a_failed_download_keeps_its_type(monkeypatch: pytest.MonkeyPatch) -> None:
    import fineweb

    def failing(name: str) -> None:
        raise KeyError("gpt2")

    monkeypatch.setattr(fineweb.tiktoken, "get_encoding", failing)
    with pytest.raises(KeyError):
        fineweb.tiktoken_gpt2()
