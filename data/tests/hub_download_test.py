"""The downloader against a local HTTP server standing in for the Hub (HF_ENDPOINT / endpoint=)."""

from __future__ import annotations

import hashlib
import os
import socket
import subprocess
import sys
import threading
from collections.abc import Callable, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import numpy as np
import pytest

from hub_download import FINEWEB10B, FINEWEBEDU10B, STAGING_DIR_NAME, DownloadError, connection_errors, download_shards, shard_names
from shards import read_shard, write_shard

DATA_DIR = Path(__file__).resolve().parents[1]
COMMIT = "0123456789abcdef0123456789abcdef01234567"


class FakeHub:
    """Serves HEAD and GET on /datasets/<repo>/resolve/<revision>/<file> the way the Hub does."""

    def __init__(self) -> None:
        self.files: dict[str, bytes] = {}  # "<repo>/<file>" -> content
        self.requests: list[tuple[str, str]] = []  # (method, path)
        hub = self

        class Handler(BaseHTTPRequestHandler):
            def do_HEAD(self) -> None:
                hub.requests.append(("HEAD", self.path))
                self._answer(send_body=False)

            def do_GET(self) -> None:
                hub.requests.append(("GET", self.path))
                self._answer(send_body=True)

            def _answer(self, send_body: bool) -> None:
                prefix = "/datasets/"
                repo_and_file = self.path.removeprefix(prefix).replace("/resolve/main/", "/", 1)
                content = hub.files.get(repo_and_file) if self.path.startswith(prefix) else None
                if content is None:
                    self.send_response(404)
                    self.send_header("X-Error-Code", "EntryNotFound")
                    self.send_header("X-Repo-Commit", COMMIT)
                    self.send_header("Content-Length", "0")
                    self.end_headers()
                    return
                self.send_response(200)
                self.send_header("X-Repo-Commit", COMMIT)
                self.send_header("ETag", f'"{hashlib.sha256(content).hexdigest()}"')
                self.send_header("Content-Length", str(len(content)))
                self.end_headers()
                if send_body:
                    self.wfile.write(content)

            def log_message(self, *args: object) -> None:  # keep test output quiet
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.endpoint = f"http://127.0.0.1:{self.server.server_address[1]}"

    def add_shard(self, repo_id: str, name: str, tokens: np.ndarray, tmp_dir: Path) -> None:
        write_shard(tmp_dir / name, tokens)
        self.files[f"{repo_id}/{name}"] = (tmp_dir / name).read_bytes()

    def fetched(self) -> list[str]:
        return sorted(Path(path).name for method, path in self.requests if method == "GET")


@pytest.fixture
def fake_hub(tmp_path: Path) -> Iterator[FakeHub]:
    hub = FakeHub()
    thread = threading.Thread(target=hub.server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
    thread.start()
    yield hub
    hub.server.shutdown()
    hub.server.server_close()


def shard_tokens(index: int) -> np.ndarray:
    return np.arange(index * 10, index * 10 + 5 + index, dtype=np.uint16)


def serve_repo(hub: FakeHub, repo_id: str, names: list[str], tmp_path: Path) -> None:
    source = tmp_path / "served"
    source.mkdir(exist_ok=True)
    for index, name in enumerate(names):
        hub.add_shard(repo_id, name, shard_tokens(index), source)


def closed_port_endpoint() -> str:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return f"http://127.0.0.1:{sock.getsockname()[1]}"  # nothing listens once the socket closes


def test_shard_names_follow_the_speedrun_convention() -> None:
    assert shard_names(FINEWEB10B, 2) == ["fineweb_val_000000.bin", "fineweb_train_000001.bin", "fineweb_train_000002.bin"]
    assert shard_names(FINEWEBEDU10B, 1) == ["finewebedu_val_000000.bin", "finewebedu_train_000001.bin"]


def test_downloads_val_and_first_n_train_shards_and_validates_them(fake_hub: FakeHub, tmp_path: Path) -> None:
    names = shard_names(FINEWEB10B, 3)
    serve_repo(fake_hub, FINEWEB10B.repo_id, names, tmp_path)
    out = tmp_path / "out"
    downloaded = download_shards(FINEWEB10B, 2, out, endpoint=fake_hub.endpoint)
    assert downloaded == names[:3]
    assert sorted(p.name for p in out.iterdir()) == sorted(names[:3])  # no staging folder left behind
    for index, name in enumerate(names[:3]):
        np.testing.assert_array_equal(read_shard(out / name), shard_tokens(index))


def test_present_valid_shards_are_skipped_without_a_request(fake_hub: FakeHub, tmp_path: Path) -> None:
    names = shard_names(FINEWEB10B, 2)
    serve_repo(fake_hub, FINEWEB10B.repo_id, names, tmp_path)
    out = tmp_path / "out"
    out.mkdir()
    write_shard(out / names[0], np.array([7, 7, 7], dtype=np.uint16))  # valid, so it must stay untouched
    assert download_shards(FINEWEB10B, 2, out, endpoint=fake_hub.endpoint) == names[1:]
    assert fake_hub.fetched() == sorted(names[1:])
    np.testing.assert_array_equal(read_shard(out / names[0]), [7, 7, 7])

    fake_hub.requests.clear()
    assert download_shards(FINEWEB10B, 2, out, endpoint=fake_hub.endpoint) == []
    assert fake_hub.requests == []


def test_present_but_corrupt_shard_is_downloaded_again(
    fake_hub: FakeHub, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    names = shard_names(FINEWEB10B, 1)
    serve_repo(fake_hub, FINEWEB10B.repo_id, names, tmp_path)
    out = tmp_path / "out"
    out.mkdir()
    write_shard(out / names[0], shard_tokens(0))
    (out / names[1]).write_bytes(b"half a shard")
    assert download_shards(FINEWEB10B, 1, out, endpoint=fake_hub.endpoint) == [names[1]]
    np.testing.assert_array_equal(read_shard(out / names[1]), shard_tokens(1))
    assert f"{names[1]} is present but not a valid shard" in capsys.readouterr().out


def test_a_folder_under_a_shard_name_is_refused_before_downloading(fake_hub: FakeHub, tmp_path: Path) -> None:
    """It was reported as an invalid shard, downloaded, and the move onto it ended in an IsADirectoryError traceback."""
    names = shard_names(FINEWEB10B, 1)
    serve_repo(fake_hub, FINEWEB10B.repo_id, names, tmp_path)
    out = tmp_path / "out"
    (out / names[1]).mkdir(parents=True)
    (out / names[1] / "kept.txt").write_text("kept")
    with pytest.raises(DownloadError, match=f"{names[1]}: a folder is in the way of this shard; move it away"):
        download_shards(FINEWEB10B, 1, out, endpoint=fake_hub.endpoint)
    assert fake_hub.fetched() == []
    assert (out / names[1] / "kept.txt").read_text() == "kept"


def test_corrupt_download_is_rejected_and_not_left_under_its_name(fake_hub: FakeHub, tmp_path: Path) -> None:
    names = shard_names(FINEWEB10B, 2)
    serve_repo(fake_hub, FINEWEB10B.repo_id, names, tmp_path)
    key = f"{FINEWEB10B.repo_id}/{names[1]}"
    fake_hub.files[key] = fake_hub.files[key][:-2]  # header promises one token more than the body holds
    out = tmp_path / "out"
    with pytest.raises(DownloadError) as error:
        download_shards(FINEWEB10B, 2, out, endpoint=fake_hub.endpoint)
    message = str(error.value)
    assert names[1] in message and "promises" in message and "run the command again" in message
    assert not (out / names[1]).exists()
    assert not any(p.name == names[1] for p in (out / STAGING_DIR_NAME).rglob("*"))
    assert (out / names[0]).exists() and not (out / names[2]).exists()  # stopped at the bad shard


def test_file_missing_on_the_hub_is_a_clear_error(fake_hub: FakeHub, tmp_path: Path) -> None:
    with pytest.raises(DownloadError, match="answered 404 .*fineweb_val_000000.bin"):
        download_shards(FINEWEB10B, 0, tmp_path / "out", endpoint=fake_hub.endpoint)


def run_script(script: str, *args: str, endpoint: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "HF_ENDPOINT": endpoint, "HF_HUB_DISABLE_PROGRESS_BARS": "1"}
    return subprocess.run(
        [sys.executable, str(DATA_DIR / script), *args], capture_output=True, text=True, env=env, timeout=60
    )


def test_unreachable_hub_exits_nonzero_with_one_sentence(tmp_path: Path) -> None:
    out = tmp_path / "out"
    result = run_script("cached_fineweb10B.py", "1", "--out-dir", str(out), endpoint=closed_port_endpoint())
    assert result.returncode == 1
    error_lines = result.stderr.strip().splitlines()
    assert len(error_lines) == 1, result.stderr
    assert error_lines[0].startswith("error: Cannot reach the Hugging Face Hub")
    assert "python data/fineweb.py --input" in error_lines[0] and "--bpe-file" in error_lines[0]
    assert list(out.iterdir()) == []


@pytest.mark.parametrize("script", ["cached_fineweb10B.py", "cached_fineweb100B.py", "cached_finewebedu10B.py"])
@pytest.mark.parametrize("out", ["file", "file/sub"])
def test_an_out_dir_blocked_by_a_file_is_one_sentence(tmp_path: Path, script: str, out: str) -> None:
    """--out-dir naming a file, or a folder below one: mkdir's FileExistsError or NotADirectoryError was a traceback."""
    (tmp_path / "file").write_text("kept")
    result = run_script(script, "1", "--out-dir", str(tmp_path / out), endpoint=closed_port_endpoint())
    assert result.returncode == 1
    assert result.stderr.strip() == (
        f"error: --out-dir {tmp_path / out}: a file is in the way (that path or a folder above it is a file); pass a folder"
    )
    assert (tmp_path / "file").read_text() == "kept"


def test_entry_script_honours_hf_endpoint(fake_hub: FakeHub, tmp_path: Path) -> None:
    names = shard_names(FINEWEBEDU10B, 1)
    serve_repo(fake_hub, FINEWEBEDU10B.repo_id, names, tmp_path)
    out = tmp_path / "out"
    result = run_script("cached_finewebedu10B.py", "1", "--out-dir", str(out), endpoint=fake_hub.endpoint)
    assert result.returncode == 0, result.stderr
    assert sorted(p.name for p in out.iterdir()) == sorted(names)


def raising(error: BaseException) -> Callable[..., None]:
    def probe(*args: object, **kwargs: object) -> None:
        raise error

    return probe


@pytest.mark.parametrize("client_error", connection_errors())  # OSError (requests, offline mode), each installed httpx's RequestError
def test_a_connection_error_of_the_installed_client_is_one_sentence(monkeypatch: pytest.MonkeyPatch, tmp_path: Path,
                                                                     client_error: type[Exception]) -> None:
    import hub_download

    monkeypatch.setattr(hub_download, "get_hf_file_metadata", raising(client_error("connection refused")))
    with pytest.raises(DownloadError, match=r"^Cannot reach the Hugging Face Hub at .*connection refused"):
        hub_download.check_hub_reachable("kjj0/fineweb10B-gpt2", "fineweb_val_000000.bin", tmp_path, "http://127.0.0.1:9")


def test_a_fault_that_is_not_a_connection_error_is_not_called_one(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """Only the client's connection errors mean "offline"; a bug elsewhere keeps its own traceback."""
    import hub_download

    monkeypatch.setattr(hub_download, "get_hf_file_metadata", raising(KeyError("etag")))
    with pytest.raises(KeyError, match="etag"):
        hub_download.check_hub_reachable("kjj0/fineweb10B-gpt2", "fineweb_val_000000.bin", tmp_path, "http://127.0.0.1:9")
