"""Download pre-tokenized GPT-2 FineWeb shards from the Hugging Face Hub.

One implementation behind the thin entry scripts cached_fineweb10B.py, cached_fineweb100B.py and
cached_finewebedu10B.py. Shards already present and valid are skipped; every downloaded shard is
validated before it takes its final name, so a corrupt or partial download never looks like data.
"""

from __future__ import annotations

import argparse
import importlib
import os
import shutil
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

# A missing package raises ImportError here, to the entry scripts (which say so in one line) and to the tests.
from huggingface_hub import constants, get_hf_file_metadata, hf_hub_download, hf_hub_url
from huggingface_hub.errors import HfHubHTTPError, LocalEntryNotFoundError
from tqdm import tqdm

from shards import ShardError, read_header

DATA_DIR = Path(__file__).resolve().parent
STAGING_DIR_NAME = ".incoming"  # downloads land here and are moved out only once they validate
PROBE_TIMEOUT_S = 10.0


@dataclass(frozen=True)
class ShardRepo:
    """A Hub dataset repo of shards named <prefix>_val_000000.bin and <prefix>_train_000001.bin, ..."""

    repo_id: str
    prefix: str
    num_train_shards: int
    default_dir: Path


# The pre-tokenized shards the speedrun has always used (uploaded by Keller Jordan, kjj0).
FINEWEB10B = ShardRepo("kjj0/fineweb10B-gpt2", "fineweb", 103, DATA_DIR / "fineweb10B")
FINEWEB100B = ShardRepo("kjj0/fineweb100B-gpt2", "fineweb", 1030, DATA_DIR / "fineweb100B")
FINEWEBEDU10B = ShardRepo("kjj0/finewebedu10B-gpt2", "finewebedu", 99, DATA_DIR / "finewebedu10B")


class DownloadError(RuntimeError):
    """A download failed or cannot start; the message is one sentence for the user."""


def shard_names(repo: ShardRepo, num_train_shards: int) -> list[str]:
    """The validation shard, then the first `num_train_shards` training shards."""
    train = [f"{repo.prefix}_train_{index:06d}.bin" for index in range(1, num_train_shards + 1)]
    return [f"{repo.prefix}_val_000000.bin", *train]


def needs_download(path: Path) -> bool:
    """True unless `path` already holds a valid shard; says so when a present file is invalid."""
    if not path.exists():
        return True
    if path.is_dir():  # a download could not take its place: refused before any download starts
        raise DownloadError(f"{path}: a folder is in the way of this shard; move it away or pass another --out-dir")
    try:
        read_header(path)
    except ShardError as error:
        print(f"{path.name} is present but not a valid shard ({error.rule}); downloading it again")
        return True
    return False


def offline_route(out_dir: Path) -> str:
    return (
        "to build shards offline instead, run: python data/fineweb.py --input <your text files> "
        f"--bpe-file <path to gpt2.tiktoken> --out-dir {out_dir}"
    )


def one_line(error: BaseException) -> str:
    """An exception as `Type: message` on one line (Hub errors can span several)."""
    return f"{type(error).__name__}: {' '.join(str(error).split())}"


def http_status(error: HfHubHTTPError) -> str:
    return str(error.response.status_code) if error.response is not None else one_line(error)


def connection_errors() -> tuple[type[Exception], ...]:
    """What a request that never got an answer raises, by the HTTP client of the installed huggingface_hub:
    requests' errors (0.x) and OfflineModeIsEnabled are OSErrors; 1.x raises httpx's RequestError, 2.x httpx2's."""
    errors: list[type[Exception]] = [OSError]
    for client in ("httpx", "httpx2"):
        try:
            errors.append(importlib.import_module(client).RequestError)
        except ImportError:  # that client is not installed, so it cannot raise
            continue
    return tuple(errors)


def check_hub_reachable(repo_id: str, filename: str, out_dir: Path, endpoint: str | None) -> None:
    """Ask the Hub for one file's metadata, so that an offline machine fails in seconds.

    hf_hub_download alone would retry for about 25 s and print a warning per retry first.
    """
    url = hf_hub_url(repo_id, filename, repo_type="dataset", endpoint=endpoint)
    try:
        get_hf_file_metadata(url, timeout=PROBE_TIMEOUT_S)
    except HfHubHTTPError as error:
        raise DownloadError(f"The Hub answered {http_status(error)} for {url}; check the repo and file name") from error
    except connection_errors() as error:
        hub = endpoint or constants.ENDPOINT
        raise DownloadError(f"Cannot reach the Hugging Face Hub at {hub} ({one_line(error)}); {offline_route(out_dir)}") from error


def download_shard(repo_id: str, filename: str, out_dir: Path, endpoint: str | None) -> Path:
    """Download one shard, validate it, and only then move it to out_dir/filename."""
    try:
        staged = Path(
            hf_hub_download(
                repo_id=repo_id,
                repo_type="dataset",
                filename=filename,
                local_dir=out_dir / STAGING_DIR_NAME,
                endpoint=endpoint,
            )
        )
    except LocalEntryNotFoundError as error:  # the connection went away after the first check
        raise DownloadError(f"Lost the connection to the Hub while fetching {filename}; {offline_route(out_dir)}") from error
    except HfHubHTTPError as error:
        raise DownloadError(f"The Hub answered {http_status(error)} for {repo_id}/{filename}; check the repo and file name") from error
    try:
        read_header(staged)
    except ShardError as error:
        staged.unlink()
        raise DownloadError(
            f"The download of {repo_id}/{filename} is not a valid shard ({error.rule}), so it was discarded; "
            "run the command again to retry"
        ) from error
    final = out_dir / filename
    os.replace(staged, final)
    return final


def make_out_dir(out_dir: Path) -> None:
    """Creates out_dir and the folders above it; a file in the way is one sentence (mkdir raised it as a traceback)."""
    try:
        out_dir.mkdir(parents=True, exist_ok=True)
    except (FileExistsError, NotADirectoryError):
        raise DownloadError(f"--out-dir {out_dir}: a file is in the way (that path or a folder above it is a file); pass a folder") from None


def download_shards(
    repo: ShardRepo, num_train_shards: int, out_dir: Path, endpoint: str | None = None
) -> list[str]:
    """Make out_dir hold valid copies of the val shard and the first training shards.

    Returns the names it downloaded (those already present and valid are skipped).
    """
    make_out_dir(out_dir)
    names = shard_names(repo, num_train_shards)
    missing = [name for name in names if needs_download(out_dir / name)]
    print(f"{repo.repo_id}: {len(names) - len(missing)} of {len(names)} shards already in {out_dir}")
    if not missing:
        return []
    check_hub_reachable(repo.repo_id, missing[0], out_dir, endpoint)
    for name in tqdm(missing, desc=f"downloading to {out_dir}", unit="shard"):
        download_shard(repo.repo_id, name, out_dir, endpoint)
    shutil.rmtree(out_dir / STAGING_DIR_NAME, ignore_errors=True)  # only download bookkeeping is left there
    return missing


def parse_args(repo: ShardRepo, argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=f"Download GPT-2-tokenized shards from the Hugging Face dataset {repo.repo_id}: "
        f"{repo.prefix}_val_000000.bin and the first N of {repo.num_train_shards} training shards "
        "(100M tokens each).",
    )
    parser.add_argument(
        "num_train_shards",
        nargs="?",
        type=int,
        default=repo.num_train_shards,
        metavar="N",
        help=f"how many training shards to fetch (default: all {repo.num_train_shards})",
    )
    parser.add_argument("--out-dir", type=Path, default=repo.default_dir, help="default: %(default)s")
    args = parser.parse_args(argv)
    if not 0 <= args.num_train_shards <= repo.num_train_shards:
        parser.error(f"N must be between 0 and {repo.num_train_shards}, got {args.num_train_shards}")
    return args


def main(repo: ShardRepo, argv: Sequence[str] | None = None) -> int:
    args = parse_args(repo, argv)
    try:
        download_shards(repo, args.num_train_shards, args.out_dir)
    except DownloadError as error:
        print(f"error: {error}", file=sys.stderr)
        return 1
    return 0
