"""Published records as data: `index`, `fetch` and `diff` with no flags, against a small published tree served by a
loopback HTTP server (cache miss, cache hit, a download cut short, a corrupt cache entry, the server down)."""

from __future__ import annotations

import csv
import hashlib
import http.server
import io
import socket
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import records_fixtures as F

from recordkit import published
from recordkit.check import check_all
from recordkit.cli import main
from recordkit.index import index_clone, write_manifest
from recordkit.tables import write_tables

T1_RECORD = "records/track_1_short/2026-07-17_SyntheticRecord/this_pr"
T1_OLDER = "records/track_1_short/2026-06-11_OlderRecord"
T2_RECORD = "records/track_2_medium/2025-12-31_SyntheticMedium"
T3_RECORD = "records/track_3_optimization/results/20260611_fixed_stop"
T1_LOSSES = [3.2781, 3.2779, 3.2784, 3.2776]
T3_LOSSES = [3.27788, 3.27834, 3.27801, 3.27811, 3.27890, 3.27922, 3.27851, 3.27869, 3.27905, 3.27889]  # mean 3.27856


def published_tree(tree: Path) -> None:
    """A published repository in miniature, in each era's format: what the real one holds, but synthetic."""
    for i, loss in enumerate(T1_LOSSES):
        F.write(tree / T1_RECORD / f"run{i}.txt", F.track1_2025(final_loss=loss, final_ms=79600 + 40 * i, steps=1390, seed=i))
    F.write(tree / T1_RECORD / "README.md", "# not a log\n")
    F.write(tree / T1_RECORD.replace("this_pr", "baseline") / "base0.txt", F.track1_2025(steps=1400))  # another arm: not fetched
    F.write(tree / T1_OLDER / "old0.txt", F.track1_2025(final_loss=3.2785, final_ms=80500, steps=1400))
    for i, loss in enumerate([2.91850, 2.91862]):
        F.write(tree / T2_RECORD / f"m{i}.txt", F.track2_2025(final_loss=loss, final_ms=1041071 + 100 * i, seed=i))
    for i, loss in enumerate(T3_LOSSES):
        F.write(tree / T3_RECORD / f"seed{i}.txt", F.track3_fixed_stop(final_loss=loss, seed=i))
        F.write(tree / T3_RECORD / f"seed{i}" / "final_val_loss.txt",  # a summary repeating the last line: not a run
                next(line for line in reversed(F.track3_fixed_stop(final_loss=loss, seed=i).splitlines()) if "val_loss" in line) + "\n")


def history(records: Path) -> None:
    rows = {
        "track_1_short": ("record,time,date,description,folder,logs_at",
                          [f"87,1.340 minutes,06/11/26,An older synthetic record,,{T1_OLDER}/old0.txt",
                           "88,1.330 minutes,07/13/26,A record without logs,,",
                           f"89,1.327 minutes,07/17/26,The synthetic prior record,,{T1_RECORD}/run0.txt"]),
        "track_2_medium": ("record,time,date,description,folder,logs_at",
                           [f"18,17.35 minutes,12/31/25,A synthetic medium record,,{T2_RECORD}/m0.txt"]),
        "track_3_optimization": ("result,steps,evidence,date,description,folder,logs_at",
                                 [f"45,2720(!),3.2786 (n=10)✓,2026/06/12,A synthetic fixed-stop result,,{T3_RECORD}",
                                  "46,3000,3.2790 (n=4)✓,2026/06/20,A later result that sets no record,,"]),
    }
    for folder, (header, lines) in rows.items():
        F.write(records / folder / "history.csv", "\n".join([header, *lines]) + "\n")


@dataclass
class Server:
    """A loopback HTTP server over a folder; paths in `cut_short` get half their bytes, then the connection closes."""

    root: Path
    cut_short: set[str] = field(default_factory=set)
    requests: list[str] = field(default_factory=list)

    def start(self) -> str:
        server = self

        class Handler(http.server.SimpleHTTPRequestHandler):
            def __init__(self, *args: object, **kwargs: object) -> None:
                super().__init__(*args, directory=str(server.root), **kwargs)  # type: ignore[arg-type]

            def do_GET(self) -> None:
                server.requests.append(self.path)
                if self.path.lstrip("/") in server.cut_short:
                    data = (server.root / self.path.lstrip("/")).read_bytes()
                    self.send_response(200)
                    self.send_header("Content-Length", str(len(data)))
                    self.end_headers()
                    self.wfile.write(data[: len(data) // 2])
                    self.wfile.flush()
                    self.close_connection = True
                    return
                super().do_GET()

            def log_message(self, format: str, *args: object) -> None:  # noqa: A002 (http.server's name)
                pass

        self.httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()
        return f"http://127.0.0.1:{self.httpd.server_address[1]}"

    def stop(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


@dataclass
class World:
    repo: Path
    tree: Path
    cache: Path
    url: str
    server: Server

    @property
    def records(self) -> Path:
        return self.repo / "records"

    def argv(self, *args: str) -> list[str]:
        return ["--root", str(self.repo), *args[:1], *args[1:], "--cache-dir", str(self.cache), "--source-url", self.url]


@pytest.fixture
def world(tmp_path: Path) -> Iterator[World]:
    tree, repo = tmp_path / "published", tmp_path / "repo"
    published_tree(tree)
    history(repo / "records")
    F.write(repo / "records" / "README.md", F.README)
    write_manifest(repo / "records", index_clone(tree, repo / "records"))
    write_tables(repo, repo / "records")
    server = Server(tree)
    url = server.start()
    yield World(repo, tree, tmp_path / "cache", url, server)
    server.stop()


def run_cli(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    code = main(argv)
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def manifest_rows(records: Path) -> list[dict[str, str]]:
    with (records / "published_logs.csv").open(newline="") as handle:
        return list(csv.DictReader(handle))


# ----- the data -----


def test_index_lists_the_record_runs_only(world: World) -> None:
    rows = manifest_rows(world.records)
    files = {row["file"] for row in rows}
    assert {f"{T1_RECORD}/run{i}.txt" for i in range(4)} <= files
    assert not any("baseline" in name or name.endswith("README.md") for name in files)  # another arm, not a log
    assert not any("final_val_loss" in name for name in files)  # a repeated last line is not a run
    assert {f"{T3_RECORD}/seed{i}.txt" for i in range(10)} <= files
    for row in rows:
        data = (world.tree / row["file"]).read_bytes()
        assert int(row["bytes"]) == len(data) and row["sha256"] == hashlib.sha256(data).hexdigest()
    assert check_all(world.repo, world.records) == []
    (world.records / "published_logs.csv").write_text("logs_at,file,bytes,sha256\n")
    problems = check_all(world.repo, world.records)
    assert any("no file for Track 1 row #89" in p and "records index CLONE --write" in p for p in problems)



def test_index_of_a_missing_or_wrong_clone_names_the_commit(world: World, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    commit = published.PUBLISHED_COMMIT[:12]
    for clone, why in ((tmp_path / "nonexistent", "no such folder"), (F.write(tmp_path / "afile", "x\n"), "a file, not a folder")):
        code, out, err = run_cli(["--root", str(world.repo), "index", str(clone)], capsys)
        assert (code, out) == (2, "")
        assert err == f"records: error: {clone}: {why}; pass a clone of KellerJordan/modded-nanogpt checked out at {commit}\n"
    empty = tmp_path / "empty"
    empty.mkdir()
    code, out, err = run_cli(["--root", str(world.repo), "index", str(empty)], capsys)
    assert (code, out) == (2, "") and err.count("\n") == 1 and "names it, but the clone lacks it" in err
    assert err.endswith(f"; check out the pinned commit: git -C {empty} checkout {commit}\n")
    code, out, err = run_cli(["--root", str(tmp_path / "nonexistent"), "index", str(world.tree), "--write"], capsys)
    assert (code, out) == (2, "") and err == (f"records: error: {tmp_path / 'nonexistent' / 'records'}: no records folder there; "
                                              "pass --root REPO, the checkout that holds records/\n")


def test_index_without_history_rows_writes_nothing(world: World, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A --root whose records/ has no history.csv would have replaced published_logs.csv with its header line."""
    root = tmp_path / "no_history"
    manifest = F.write(root / "records" / "published_logs.csv", "logs_at,file,bytes,sha256\nx,x/run0.txt,1,0\n")
    code, out, err = run_cli(["--root", str(root), "index", str(world.tree), "--write"], capsys)
    assert (code, out) == (2, "") and err.count("\n") == 1
    assert err.startswith(f"records: error: {root / 'records'}: no history row names a published log folder (read ")
    assert err.endswith("(nothing was written)\n")
    assert manifest.read_text() == "logs_at,file,bytes,sha256\nx,x/run0.txt,1,0\n"


def test_index_with_one_history_missing_keeps_the_manifest(world: World, capsys: pytest.CaptureFixture[str]) -> None:
    """Read as empty, a missing Track 1 history.csv had `index --write` drop Track 1's files from published_logs.csv."""
    manifest = world.records / "published_logs.csv"
    before = manifest.read_bytes()
    history = world.records / "track_1_short" / "history.csv"
    history.unlink()
    code, out, err = run_cli(["--root", str(world.repo), "index", str(world.tree), "--write"], capsys)
    assert (code, out) == (2, "") and err == (f"records: error: {history}: missing, and published_logs.csv's Track 1 part would "
                                              f"lose every row; restore it (git checkout -- {history}) or pass --root REPO "
                                              "(nothing was written)\n")
    assert manifest.read_bytes() == before


def test_records_are_named_by_track_and_number_name_or_latest(world: World) -> None:
    assert published.resolve_record(world.records, "1:89", None).logs_at == f"{T1_RECORD}/run0.txt"
    assert published.resolve_record(world.records, "latest", None).row.number == "89"
    assert published.resolve_record(world.records, "latest", 3).row.number == "45"  # the best result, not the newest row
    assert published.resolve_record(world.records, "SyntheticMedium", None).track == 2
    with pytest.raises(published.RecordsError, match="Track 1 has no record #88 with published logs"):
        published.resolve_record(world.records, "1:88", None)


def test_default_cache_dir_follows_the_platform_rule(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setattr(published.sys, "platform", "linux")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert published.default_cache_dir() == tmp_path / "xdg" / "nanogpt-speedrun-records"
    monkeypatch.delenv("XDG_CACHE_HOME")
    assert published.default_cache_dir() == Path.home() / ".cache" / "nanogpt-speedrun-records"
    monkeypatch.setenv(published.SOURCE_URL_ENV, "http://mirror.example/x/")
    assert published.source_url(None) == "http://mirror.example/x" and published.source_url("http://y") == "http://y"


# ----- fetch -----


def test_fetch_cache_miss_then_hit(world: World, capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = run_cli(world.argv("fetch", "1:89"), capsys)
    assert (code, err) == (0, "")
    folder = world.cache / T1_RECORD
    assert out == f"Track 1 #89 (2026-07-17_SyntheticRecord/this_pr, 07/17/26): 4 log(s) in {folder} (4 downloaded, 0 already in the cache)\n"
    for i in range(4):
        assert (folder / f"run{i}.txt").read_bytes() == (world.tree / T1_RECORD / f"run{i}.txt").read_bytes()
    assert not list(folder.glob(".*"))  # no partial file left
    world.server.stop()  # a cache hit needs no server
    code, out, _ = run_cli(world.argv("fetch", "latest"), capsys)
    assert code == 0 and out.endswith("(0 downloaded, 4 already in the cache)\n")
    world.server.start()  # for the fixture's teardown


def test_fetch_with_the_server_down_names_source_url_not_a_diff_flag(world: World, capsys: pytest.CaptureFixture[str]) -> None:
    with socket.socket() as probe:  # a loopback port with nobody listening
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    world.url = f"http://127.0.0.1:{port}"
    code, out, err = run_cli(world.argv("fetch", "1:89"), capsys)
    assert code == 2 and out == "" and err.count("\n") == 1
    # fetch has no --against: the line gives fetch's own way (a mirror, a file:// clone), and --against only as diff's
    assert "Connection refused" in err and "offline? point --source-url at a mirror (file:///PATH of a clone at " in err
    assert "or with diff pass --against LOCAL_DIR" in err
    assert not (world.cache / T1_RECORD).exists() or not list((world.cache / T1_RECORD).iterdir())


def test_a_download_cut_short_keeps_nothing_and_the_next_fetch_completes(world: World, capsys: pytest.CaptureFixture[str]) -> None:
    cut = f"{T1_RECORD}/run2.txt"
    world.server.cut_short.add(cut)
    code, _, err = run_cli(world.argv("fetch", "1:89"), capsys)
    assert code == 2 and err.count("\n") == 1 and "run2.txt" in err and "nothing kept" in err
    folder = world.cache / T1_RECORD
    assert not (folder / "run2.txt").exists() and not list(folder.glob(".*"))  # no partial file, no half log
    world.server.cut_short.clear()
    code, out, _ = run_cli(world.argv("fetch", "1:89"), capsys)
    assert code == 0 and "(2 downloaded, 2 already in the cache)" in out  # run2, and run3 that the cut stopped
    assert (folder / "run2.txt").read_bytes() == (world.tree / cut).read_bytes()


def test_a_partial_file_of_a_dead_download_is_removed(world: World, capsys: pytest.CaptureFixture[str]) -> None:
    folder = world.cache / T1_RECORD
    stale = F.write(folder / ".run0.txt.999999999.part", "half a log")
    assert run_cli(world.argv("fetch", "1:89"), capsys)[0] == 0
    assert not stale.exists()


def test_a_cached_file_that_differs_is_never_overwritten(world: World, capsys: pytest.CaptureFixture[str]) -> None:
    edited = F.write(world.cache / T1_RECORD / "run1.txt", "edited\n")
    code, _, err = run_cli(world.argv("fetch", "1:89"), capsys)
    assert code == 2 and f"{edited}: in the cache but not the published file" in err and "remove it and fetch again" in err
    assert edited.read_text() == "edited\n"


def test_a_served_file_that_differs_from_the_manifest_is_refused(world: World, capsys: pytest.CaptureFixture[str]) -> None:
    served = world.tree / T1_RECORD / "run3.txt"
    served.write_text(served.read_text().replace("val_loss:3.2776", "val_loss:3.2700"))
    code, _, err = run_cli(world.argv("fetch", "1:89"), capsys)
    assert code == 2 and "run3.txt: got" in err and "sha256 differs" in err
    assert not (world.cache / T1_RECORD / "run3.txt").exists()


def test_several_files_show_a_progress_bar_on_a_terminal(world: World) -> None:
    class Terminal(io.StringIO):
        def isatty(self) -> bool:
            return True

    bar = Terminal()
    record = published.resolve_record(world.records, "3:45", None)
    fetched = published.fetch_record(record, world.cache, world.url, progress=bar)
    assert fetched.downloaded == 10 and "fetching 10 logs" in bar.getvalue()
    quiet = Terminal()
    published.fetch_record(published.resolve_record(world.records, "1:87", None), world.cache, world.url, progress=quiet)
    assert quiet.getvalue() == ""  # one file: no bar


# ----- diff with no flags -----


def test_diff_with_no_flags_fetches_the_prior_world_record(world: World, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    logs = [F.write(tmp_path / "new" / f"n{i}.txt", F.track1_2025(final_loss=3.2780 - i / 1e4, final_ms=78900 + 30 * i,
                                                                   steps=1380, lr=0.06, seed=i)) for i in range(3)]
    code, out, err = run_cli(world.argv("diff", *map(str, logs)), capsys)
    assert (code, err) == (0, "")
    lines = out.splitlines()
    assert lines[0] == (f"against Track 1 #89 (2026-07-17_SyntheticRecord/this_pr, 07/17/26), {world.cache / T1_RECORD}: the prior world "
                        "record of Track 1, the newest in its history.csv; 4 log(s) downloaded")
    decision = lines[lines.index("== decision"):lines.index(next(line for line in lines if line.startswith("== code")))]
    assert "steps: new 1380; record 1390" in decision
    assert "  learning_rate: 0.05 -> 0.06" in decision and "  num_iterations: 1390 -> 1380" in decision
    time = next(line for line in decision if line.startswith("time to 3.28:"))
    assert "new 78.930 s (n=3) vs record 79.660 s (n=4)" in time and "one-sided Welch p = " in time
    assert len(lines[: lines.index(next(line for line in lines if line.startswith("== code")))]) <= 40  # the decision fits one screen
    assert "train script: +2 −2 lines: class Hyperparameters +2 −2" in out
    assert "--- record/train script" not in out
    code, out, _ = run_cli(world.argv("diff", *map(str, logs), "--code"), capsys)
    assert code == 0 and "--- record/train script" in out and "(4 log(s) from the cache)" not in out
    assert out.splitlines()[0].endswith("; 4 log(s) from the cache")


def test_diff_of_the_record_own_logs_steps_back_to_the_record_before(world: World, capsys: pytest.CaptureFixture[str]) -> None:
    run_cli(world.argv("fetch", "1:89"), capsys)
    own = sorted((world.cache / T1_RECORD).glob("*.txt"))
    code, out, _ = run_cli(world.argv("diff", *map(str, own)), capsys)
    assert code == 0 and out.startswith("against Track 1 #87 (2026-06-11_OlderRecord, 06/11/26)")
    assert "(the newer one holds these very logs)" in out.splitlines()[0]


def test_diff_track3_compares_steps_to_target(world: World, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    logs = [F.write(tmp_path / "t3" / f"s{i}.txt", F.track3_fixed_stop(final_loss=3.2770 + i / 1e4, seed=i, stop=2700)) for i in range(4)]
    code, out, _ = run_cli(world.argv("diff", *map(str, logs)), capsys)
    assert code == 0 and "the prior best result (fewest steps, marked (!)) of Track 3" in out.splitlines()[0]
    assert "steps to 3.28 (record): 2720 (first passing step), n=10, mean 3.27856" in out
    assert "steps to 3.28 (new): 2690 (first passing step), n=4" in out
    assert "pairwise (loss difference + 0.0045 per 100 steps saved)" in out
    assert "time to" not in out  # Track 3 does not compare wall time


def test_diff_offline_names_against_and_against_a_local_folder_works(world: World, tmp_path: Path,
                                                                     capsys: pytest.CaptureFixture[str]) -> None:
    log = F.write(tmp_path / "n.txt", F.track1_2025(steps=1380))
    world.server.stop()
    code, _, err = run_cli(world.argv("diff", str(log)), capsys)
    assert code == 2 and err.count("\n") == 1 and "with diff pass --against LOCAL_DIR" in err
    code, out, _ = run_cli(world.argv("diff", str(log), "--against", str(world.tree / T1_RECORD)), capsys)
    assert code == 0 and out.startswith(f"against {world.tree / T1_RECORD}: given with --against")
    world.server.start()


def test_diff_of_a_track2_log_takes_the_track2_record(world: World, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    log = F.write(tmp_path / "m.txt", F.track2_2025(final_loss=2.9180, final_ms=1030000))
    code, out, _ = run_cli(world.argv("diff", str(log)), capsys)
    assert code == 0 and out.startswith("against Track 2 #18 (2025-12-31_SyntheticMedium")
    assert "track 2 (time to 2.92 val loss" in out and "time to 2.92: new 1030.000 s" in out


@pytest.mark.parametrize("against", ["2:18", "3:45", "track2-folder"])
def test_diff_against_a_record_of_another_track_is_refused(world: World, tmp_path: Path, against: str,
                                                            capsys: pytest.CaptureFixture[str]) -> None:
    logs = [F.write(tmp_path / "t1" / f"run{i}.txt", F.track1_2025(final_loss=3.2780 - i / 1e4, steps=1380, seed=i)) for i in range(2)]
    if against == "track2-folder":
        against = str(world.tree / T2_RECORD)
    code, out, err = run_cli(world.argv("diff", *map(str, logs), "--against", against), capsys)
    assert (code, out) == (2, "") and err.count("\n") == 1
    assert f"--against {against}: Track " in err and "and the new logs are Track 1" in err and "--against 1:N" in err
    assert "Welch" not in err



@pytest.mark.parametrize("against", ["same-log", "record-folder", "1:89"])
def test_diff_against_a_record_holding_a_new_log_is_refused(world: World, tmp_path: Path, against: str,
                                                             capsys: pytest.CaptureFixture[str]) -> None:
    # A new run's own log on the record's side was compared with itself: rc 0, "+0.000 s", a verdict.
    mine = F.write(tmp_path / "n" / "mine.txt", F.track1_2025(final_loss=3.2770, final_ms=79000, steps=1390, seed=9))
    record_log = world.tree / T1_RECORD / "run0.txt"
    new_logs, value = {"same-log": ([mine], str(mine)), "record-folder": ([mine, record_log], str(world.tree / T1_RECORD)),
                       "1:89": ([record_log], "1:89")}[against]
    code, out, err = run_cli(world.argv("diff", *map(str, new_logs), "--against", value), capsys)
    assert (code, out) == (2, "") and err.count("\n") == 1
    assert f"the same log (same bytes) is among the new runs and in --against {value}" in err
    assert err.startswith(f"records: error: {new_logs[-1]}: ")


@pytest.mark.parametrize("url", ["raw.example.org/modded-nanogpt", "http://[::1/modded-nanogpt", "http://127.0.0.1:99999",
                                 "ftp://mirror.example.org/modded-nanogpt"])
def test_a_malformed_source_url_is_one_line_and_stops_nothing_the_cache_holds(world: World, tmp_path: Path, url: str,
                                                                                monkeypatch: pytest.MonkeyPatch,
                                                                                capsys: pytest.CaptureFixture[str]) -> None:
    good, world.url = world.url, url
    code, out, err = run_cli(world.argv("fetch", "1:89"), capsys)
    assert (code, out) == (2, "") and err.count("\n") == 1
    assert err.startswith(f"records: error: source URL {url!r}: ") and "set --source-url (or $RECORDS_SOURCE_URL) to http(s)://" in err
    assert not (world.cache / T1_RECORD).exists()
    monkeypatch.setenv(published.SOURCE_URL_ENV, url)  # the same from the environment, through diff
    log = F.write(tmp_path / "n.txt", F.track1_2025(steps=1380))
    code, _, err = run_cli(["--root", str(world.repo), "diff", str(log), "--cache-dir", str(world.cache)], capsys)
    assert code == 2 and err.startswith(f"records: error: source URL {url!r}: ") and err.count("\n") == 1
    world.url = good  # once the logs are in the cache, the URL is never used
    assert run_cli(world.argv("fetch", "1:89"), capsys)[0] == 0
    code, out, _ = run_cli(["--root", str(world.repo), "diff", str(log), "--cache-dir", str(world.cache)], capsys)
    assert code == 0 and out.splitlines()[0].endswith("; 4 log(s) from the cache")


# ----- a cache that cannot be written -----


@pytest.mark.parametrize("where", ["under-a-file", "proc"])
def test_an_unusable_cache_dir_is_one_line_naming_the_flag(world: World, tmp_path: Path, where: str,
                                                           capsys: pytest.CaptureFixture[str]) -> None:
    afile = F.write(tmp_path / "afile", "x\n")
    if where == "proc" and not Path("/proc/self").is_dir():
        pytest.skip("no /proc here")
    cache = afile / "sub" if where == "under-a-file" else Path("/proc/nope")
    argv = ["--root", str(world.repo), "fetch", "1:89", "--cache-dir", str(cache), "--source-url", world.url]
    code, out, err = run_cli(argv, capsys)
    assert (code, out) == (2, "") and err.count("\n") == 1
    assert "cannot write into the cache there (" in err and "pass --cache-dir DIR" in err
    assert ("Not a directory" in err and str(afile) in err) if where == "under-a-file" else "/proc/nope" in err
    log = F.write(tmp_path / "n.txt", F.track1_2025(steps=1380))
    code, _, err = run_cli(["--root", str(world.repo), "diff", str(log), "--cache-dir", str(afile), "--source-url", world.url], capsys)
    assert code == 2 and err.count("\n") == 1 and "pass --cache-dir DIR" in err


@pytest.mark.parametrize("meanwhile", ["same", "other"])
def test_without_hard_links_a_download_is_renamed_into_place_and_never_overwrites(world: World, monkeypatch: pytest.MonkeyPatch,
                                                                                  meanwhile: str,
                                                                                  capsys: pytest.CaptureFixture[str]) -> None:
    target = world.cache / T1_RECORD / "run0.txt"
    published_bytes = (world.tree / T1_RECORD / "run0.txt").read_bytes()

    def no_links(source: object, destination: object) -> None:
        if Path(str(destination)) == target:  # another fetch puts the file there just now
            target.write_bytes(published_bytes if meanwhile == "same" else b"another file\n")
        raise PermissionError(published.errno.EPERM, "Operation not permitted")

    monkeypatch.setattr(published.os, "link", no_links)
    code, out, err = run_cli(world.argv("fetch", "1:89"), capsys)
    if meanwhile == "same":
        assert (code, err) == (0, "") and "(4 downloaded, 0 already in the cache)" in out
        for i in range(4):
            assert (world.cache / T1_RECORD / f"run{i}.txt").read_bytes() == (world.tree / T1_RECORD / f"run{i}.txt").read_bytes()
    else:
        assert code == 2 and err.count("\n") == 1 and f"{target}: in the cache but not the published file" in err
        assert target.read_bytes() == b"another file\n"  # kept, never overwritten
    assert not list((world.cache / T1_RECORD).glob(".*.part"))
