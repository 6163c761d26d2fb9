"""Where the published records' logs are, and `fetch`: a record's logs downloaded into a cache and checked.

Every history row whose record published logs names, in its `logs_at` column, the folder (or the one file)
of the public speedrun repository that holds them; records/published_logs.csv lists each log file there with
its size and sha256, at the commit PUBLISHED_COMMIT. `fetch` downloads a record's files from SOURCE_URL
(a raw-file server of that commit; RECORDS_SOURCE_URL or --source-url point it elsewhere, e.g. a mirror or a
test server) into the cache: each file is checked (size, sha256, and that it parses as a log) before it is
moved into place, atomically, and a file already there is never overwritten.
"""

from __future__ import annotations

import errno
import hashlib
import http.client
import os
import re
import sys
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import IO

from tqdm import tqdm

from .errors import RecordsError
from .parse import LOG_SUFFIXES, parse_text
from .tables import HistoryRow, history_path, load_history
from .textfiles import csv_rows, is_file, read_utf8

PUBLISHED_REPOSITORY = "KellerJordan/modded-nanogpt"
PUBLISHED_COMMIT = "f411b3d346aa52d3504324ca93c230fd84c6c07f"  # 2026-08-01, the snapshot the paths and checksums describe
DEFAULT_SOURCE_URL = f"https://raw.githubusercontent.com/{PUBLISHED_REPOSITORY}/{PUBLISHED_COMMIT}"
SOURCE_URL_ENV = "RECORDS_SOURCE_URL"
PUBLISHED_LOGS_CSV = "published_logs.csv"
MANIFEST_COLUMNS = ("logs_at", "file", "bytes", "sha256")  # of published_logs.csv
CACHE_SUBDIR = "nanogpt-speedrun-records"
DOWNLOAD_TIMEOUT_S = 60
_CHUNK = 1 << 16
_PARTIAL = re.compile(r"^\.(?P<name>.+)\.(?P<pid>\d+)\.part$")  # a download in progress: .<name>.<pid>.part


@dataclass(frozen=True)
class PublishedLog:
    path: str  # relative to the public repository's root, e.g. records/track_1_short/<folder>/<uuid>.txt
    size: int
    sha256: str


@dataclass(frozen=True)
class PublishedRecord:
    """A history row with published logs, and the files that hold its runs."""

    track: int
    row: HistoryRow
    files: tuple[PublishedLog, ...]

    @property
    def logs_at(self) -> str:
        return self.row.logs_at

    @property
    def name(self) -> str:
        """The published folder's name, e.g. 2026-07-17_FP8DownProjection/this_pr (for a loose log: its file name)."""
        path = PurePosixPath(self.logs_at)
        parts = path.parts
        skip = 3 if parts[:3] == ("records", "track_3_optimization", "results") else 2
        if path.suffix in LOG_SUFFIXES and len(parts) > skip + 1:
            parts = parts[:-1]  # a linked log inside the record's folder: the folder names the record
        return "/".join(parts[skip:])

    @property
    def label(self) -> str:
        return f"Track {self.track} #{self.row.number} ({self.name}, {self.row.date})"


# ----- the data: history rows and published_logs.csv -----


def manifest_path(records_root: Path) -> Path:
    return records_root / PUBLISHED_LOGS_CSV


def load_manifest(records_root: Path) -> dict[str, list[PublishedLog]]:
    """logs_at -> its files, from records/published_logs.csv."""
    path = manifest_path(records_root)
    if not is_file(path):
        return {}
    found: dict[str, list[PublishedLog]] = {}
    text = read_utf8(path, "restore it from git, or rebuild it with `records index CLONE --write`", translate_newlines=False)
    restore = f"git checkout -- {path}, or `records index CLONE --write`"
    for number, row in csv_rows(path, text, MANIFEST_COLUMNS, restore):
        try:
            entry = PublishedLog(row["file"], int(row["bytes"]), row["sha256"])
        except ValueError:
            raise RecordsError(f"{path}: line {number} is malformed (bytes {row['bytes']!r} is not a whole number); "
                               "restore it from git") from None
        found.setdefault(row["logs_at"], []).append(entry)
    return found


def published_records(records_root: Path, track: int) -> list[PublishedRecord]:
    """The history rows of a track that name their logs, in history order, with their files."""
    manifest = load_manifest(records_root)
    return [PublishedRecord(track, row, tuple(manifest.get(row.logs_at, ())))
            for row in load_history(records_root, track) if row.logs_at]


def prior_record(records_root: Path, track: int) -> PublishedRecord:
    """The prior world record of a track: Tracks 1 and 2, the newest row with logs; Track 3, the newest row marked
    (!) (a new best step count) with logs, since its table also lists results that set no record."""
    records = published_records(records_root, track)
    if track == 3:
        records = [record for record in records if "(!)" in record.row.result]
    if not records:
        raise RecordsError(f"{history_path(records_root, track)}: no Track {track} record names its published logs (column logs_at); "
                           "pass --against LOCAL_DIR")
    return records[-1]


def resolve_record(records_root: Path, spec: str, track: int | None) -> PublishedRecord:
    """`TRACK:N` (a row number; the newest row of that number, as #21 was re-timed twice), `latest` (of --track,
    default 1) or NAME (a part of the published folder's name, e.g. FP8DownProjection)."""
    if spec == "latest":
        return prior_record(records_root, track or 1)
    if match := re.fullmatch(r"([123]):(\d+)", spec):
        chosen = int(match.group(1))
        rows = [record for record in published_records(records_root, chosen) if record.row.number == match.group(2)]
        if not rows:
            raise RecordsError(f"{spec}: Track {chosen} has no record #{match.group(2)} with published logs; see records/README.md")
        return rows[-1]
    tracks = [track] if track else [1, 2, 3]
    found = [record for t in tracks for record in published_records(records_root, t) if spec.lower() in record.name.lower()]
    if not found:
        raise RecordsError(f"{spec}: no published record's folder name contains it; pass TRACK:N (e.g. 1:89), a name, or latest")
    if len({record.logs_at for record in found}) > 1:
        names = ", ".join(f"{record.track}:{record.row.number} {record.name}" for record in found[:4])
        raise RecordsError(f"{spec}: names {len(found)} published records ({names}); pass TRACK:N or a longer name")
    return found[-1]


# ----- where to download from, and to -----


def source_url(flag: str | None) -> str:
    """--source-url, else $RECORDS_SOURCE_URL, else the public repository's raw files at PUBLISHED_COMMIT."""
    return (flag or os.environ.get(SOURCE_URL_ENV) or DEFAULT_SOURCE_URL).rstrip("/")


def check_source_url(source: str) -> None:
    """Refuse a source URL that urllib cannot open (no scheme, a bad host or port), in one line; checked only when a file
    is to be downloaded, so that a stale $RECORDS_SOURCE_URL never stops work from the cache or a local folder."""
    why = _url_problem(source)
    if why is not None:
        raise RecordsError(f"source URL {source!r}: {why}; set --source-url (or ${SOURCE_URL_ENV}) to http(s)://HOST[:PORT]/PATH, "
                           f"a raw-file server of {PUBLISHED_REPOSITORY} at {PUBLISHED_COMMIT[:12]}")


def _url_problem(url: str) -> str | None:
    try:
        parts = urllib.parse.urlsplit(url)
        parts.port  # noqa: B018  (reading it checks the port: a number from 0 to 65535)
    except ValueError as exc:  # an unclosed [IPv6] host, a port that is no number or out of range
        return str(exc)
    if not parts.scheme:
        return "no scheme (http:// or https://)"
    if parts.scheme not in ("http", "https", "file"):
        return f"{parts.scheme}:// is not http://, https:// or file://"
    if parts.scheme != "file" and not parts.hostname:
        return "no host"
    if any(char.isspace() or not char.isprintable() for char in url):
        return "a space or control character in it (quote it as %20 and so on)"
    return None


def default_cache_dir() -> Path:
    """The platform's user cache folder: %LOCALAPPDATA% on Windows, ~/Library/Caches on macOS, else
    $XDG_CACHE_HOME or ~/.cache (the XDG base directory rule); then nanogpt-speedrun-records."""
    if sys.platform == "win32" and os.environ.get("LOCALAPPDATA"):
        base = Path(os.environ["LOCALAPPDATA"])
    elif sys.platform == "darwin":
        base = Path.home() / "Library" / "Caches"
    else:
        base = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return base / CACHE_SUBDIR


def cached_path(cache: Path, entry: PublishedLog) -> Path:
    relative = PurePosixPath(entry.path)
    if relative.is_absolute() or ".." in relative.parts:
        raise RecordsError(f"{PUBLISHED_LOGS_CSV}: file {entry.path!r} points outside the cache; restore the file from git")
    return cache.joinpath(*relative.parts)


# ----- fetch -----


@dataclass(frozen=True)
class Fetched:
    record: PublishedRecord
    folder: Path  # the cached copy of logs_at (a folder, or the folder holding the one file)
    files: list[Path]
    downloaded: int
    from_cache: int


def fetch_record(record: PublishedRecord, cache: Path, source: str, progress: IO[str] | None = None) -> Fetched:
    """Every log of the record in the cache: files already there are checked, the others downloaded and checked."""
    if not record.files:
        raise RecordsError(f"{record.label}: no file listed in records/{PUBLISHED_LOGS_CSV}; restore it from git")
    targets = [(entry, cached_path(cache, entry)) for entry in record.files]
    missing = []
    for entry, target in targets:
        _remove_dead_partials(target.parent)
        if target.exists():
            _check_cached(entry, target)
        else:
            missing.append((entry, target))
    if missing:
        check_source_url(source)
        _download_all(missing, source, progress)
    folder = cached_path(cache, PublishedLog(record.logs_at, 0, ""))
    return Fetched(record, folder if folder.is_dir() else folder.parent, [target for _, target in targets],
                   len(missing), len(targets) - len(missing))


def _check_cached(entry: PublishedLog, target: Path) -> None:
    data = target.read_bytes()
    if len(data) != entry.size or hashlib.sha256(data).hexdigest() != entry.sha256:
        raise RecordsError(f"{target}: in the cache but not the published file ({len(data)} bytes, sha256 differs from "
                           f"records/{PUBLISHED_LOGS_CSV}); it is never overwritten: remove it and fetch again")


def _download_all(missing: list[tuple[PublishedLog, Path]], source: str, progress: IO[str] | None) -> None:
    total = sum(entry.size for entry, _ in missing)
    # A bar only when there are several files, and only on a terminal (disable=None asks tqdm to check).
    with tqdm(total=total, unit="B", unit_scale=True, desc=f"fetching {len(missing)} logs", file=progress or sys.stderr,
              disable=True if len(missing) < 2 else None, leave=False) as bar:
        for entry, target in missing:
            _download(entry, target, source, bar)


def _download(entry: PublishedLog, target: Path, source: str, bar: tqdm) -> None:
    url = f"{source}/{urllib.parse.quote(entry.path)}"
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise _cache_error(exc, target.parent) from None
    with _partial_file(target) as (partial, handle):
        digest = hashlib.sha256()
        size = 0
        try:
            with urllib.request.urlopen(url, timeout=DOWNLOAD_TIMEOUT_S) as response:
                while chunk := response.read(_CHUNK):
                    _write_chunk(handle, chunk, partial)
                    digest.update(chunk)
                    size += len(chunk)
                    bar.update(len(chunk))
        except urllib.error.HTTPError as exc:
            raise RecordsError(f"{url}: HTTP {exc.code} {exc.reason}; set --source-url (or ${SOURCE_URL_ENV}) to a server of "
                               f"{PUBLISHED_REPOSITORY} at {PUBLISHED_COMMIT[:12]} (file:///PATH of a clone works), or with diff "
                               "pass --against LOCAL_DIR with the record's logs") from None
        except (urllib.error.URLError, http.client.HTTPException, OSError) as exc:  # refused, unreachable, timed out, cut off
            reason = getattr(exc, "reason", None) or exc
            # `fetch` has no --against: the advice names what each command can do offline.
            raise RecordsError(f"cannot download {url} ({reason}); offline? point --source-url at a mirror (file:///PATH of a clone "
                               f"at {PUBLISHED_COMMIT[:12]} works), or with diff pass --against LOCAL_DIR with the record's logs") from None
        handle.close()
        if size != entry.size or digest.hexdigest() != entry.sha256:
            raise RecordsError(f"{url}: got {size} bytes whose sha256 differs from records/{PUBLISHED_LOGS_CSV} ({entry.size} "
                               "bytes); nothing kept: retry, or check --source-url")
        data = partial.read_bytes()
        try:
            parse_text(data.decode("utf-8", errors="replace"), target, digest.hexdigest())
        except RecordsError as exc:
            raise RecordsError(f"{url}: downloaded, but not a log ({exc}); nothing kept") from None
        _publish(partial, target, entry)


def _cache_error(exc: OSError, path: Path) -> RecordsError:
    """The one line for a cache folder or file that cannot be created or written."""
    where = exc.filename or path
    return RecordsError(f"{where}: cannot write into the cache there ({exc.strerror}); pass --cache-dir DIR, a folder you can write to")


def _write_chunk(handle: IO[bytes], chunk: bytes, partial: Path) -> None:
    try:
        handle.write(chunk)
    except OSError as exc:  # a full disk or quota: the cache's problem, not the download's
        raise _cache_error(exc, partial) from None


@contextmanager
def _partial_file(target: Path) -> Iterator[tuple[Path, IO[bytes]]]:
    """A file beside the target, named after this process, removed unless it was moved into place."""
    partial = target.with_name(f".{target.name}.{os.getpid()}.part")
    try:
        handle = partial.open("xb")
    except OSError as exc:
        raise _cache_error(exc, partial) from None
    try:
        yield partial, handle
    finally:
        handle.close()
        partial.unlink(missing_ok=True)


def _publish(partial: Path, target: Path, entry: PublishedLog) -> None:
    """Move the checked download into place atomically; a file that appeared meanwhile is kept, never overwritten."""
    try:
        os.link(partial, target)  # atomic, and fails if the target exists
    except FileExistsError:
        _check_cached(entry, target)  # another fetch got there first: fine if it is the same file
    except OSError as exc:
        if exc.errno not in (errno.EPERM, errno.EXDEV, errno.ENOTSUP, errno.EOPNOTSUPP):
            raise _cache_error(exc, target) from None
        _rename_into_place(partial, target, entry)


def _rename_into_place(partial: Path, target: Path, entry: PublishedLog) -> None:
    """A file system without hard links: rename the complete, checked partial file into place (atomic: the target is
    never seen half written). A target already there is checked and kept. rename() on POSIX would replace a target that
    appears between the check and the rename; that one could only be another fetch's checked copy of the same published
    file, so nothing that differs is replaced. On Windows rename() refuses an existing target (FileExistsError)."""
    if target.exists():
        _check_cached(entry, target)
        return
    try:
        os.rename(partial, target)
    except FileExistsError:
        _check_cached(entry, target)
    except OSError as exc:
        raise _cache_error(exc, target) from None


def _remove_dead_partials(folder: Path) -> None:
    """Remove what an interrupted download left (.<name>.<pid>.part of a process that no longer runs)."""
    if not folder.is_dir():
        return
    for path in folder.iterdir():
        match = _PARTIAL.match(path.name)
        if match and not _process_alive(int(match.group("pid"))):
            path.unlink(missing_ok=True)


def _process_alive(pid: int) -> bool:
    if pid == os.getpid():
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # someone else's live process
    return True
