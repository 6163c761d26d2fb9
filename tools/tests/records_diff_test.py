"""`diff`, `compare`, `extract` and the CLI's error line."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.image as mpimg  # noqa: E402
import pytest  # noqa: E402
import records_fixtures as F  # noqa: E402

from recordkit import compare, diff  # noqa: E402
from recordkit.cli import main  # noqa: E402
from recordkit.errors import RecordsError  # noqa: E402
from recordkit.extract import extract_sources  # noqa: E402
from recordkit.runsets import load_runset  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def test_diff_two_logs_differing_in_one_hyperparameter(tmp_path: Path) -> None:
    old = diff.load_against(F.write(tmp_path / "old.txt", F.track1_2025(lr=0.05, final_ms=150000)), False, False)
    new = diff.side_from_logs("new", [F.write(tmp_path / "new.txt", F.track1_2025(lr=0.06, final_ms=149000))], False, False)
    text = diff.render_diff(old, new, track=1)
    source = diff.source_diff(old.example, new.example)
    assert [line for line in source if line.startswith(("+ ", "- ", "+\t", "-\t")) or (line[:1] in "+-" and not line.startswith(("+++", "---")))] == [
        "-    learning_rate: float = 0.05",
        "+    learning_rate: float = 0.06",
    ]
    assert diff.hyperparameter_diff(old.example, new.example) == ["(record values from its source, new values from its source)",
                                                                   "~ learning_rate: 0.05 -> 0.06"]
    assert "== environment\n(no differences)" in text
    assert "total train time: record 150.000 s  new 149.000 s  delta -1.000 s (-0.67%)" in text
    assert "hyperparameters: 1 changed (record values from its source, new values from its source)\n  learning_rate: 0.05 -> 0.06" in text
    assert "train script: +1 −1 lines: class Hyperparameters +1 −1\n(1 file(s) unchanged)" in text


def test_hyperparameters_from_source_keeps_non_literals_as_text() -> None:
    values = diff.hyperparameters_from_source(F.script(10, 0.1))
    assert values == {"num_iterations": 10, "learning_rate": 0.1, "batch_size": "8 * 64 * 1024", "val_loss_every": 125}


def test_environment_diff_of_harness_logs(tmp_path: Path) -> None:
    old = diff.load_against(F.write(tmp_path / "a.txt", F.harness()), False, False)
    new = diff.side_from_logs("new", [F.write(tmp_path / "b.txt", F.harness(smi=False, device="cpu"))], False, False)
    lines = diff.environment_diff(old, new)
    assert "~ hardware: '8× NVIDIA H200' -> 'cpu'" in lines
    assert "~ world_size: 8 -> 1" in lines


def test_diff_against_a_log_plots_png_and_never_overwrites(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    old = F.write(tmp_path / "old.txt", F.harness(final_loss=3.2796, lr=0.05))
    logs = [F.write(tmp_path / f"r{i}.txt", F.harness(final_loss=3.279 + i / 1e4, lr=0.06)) for i in range(2)]
    plot = tmp_path / "curves.png"
    assert main(["diff", *map(str, logs), "--against", str(old), "--plot", str(plot)]) == 0
    out = capsys.readouterr().out
    assert out.startswith(f"against {old}: given with --against\n")
    assert "  learning_rate: 0.05 -> 0.06" in out
    assert "    1680    3.27960    3.27905   -0.00055" in out
    data = plot.read_bytes()
    assert data[:8] == PNG_SIGNATURE
    image = mpimg.imread(plot)
    assert image.shape[0] > 100 and image.shape[1] > 100
    assert main(["diff", *map(str, logs), "--against", str(old), "--plot", str(plot)]) == 2  # never overwritten
    assert "already exists" in capsys.readouterr().err


def test_compare_welch_and_paired(tmp_path: Path) -> None:
    base = [F.write(tmp_path / "b" / f"{i}.txt", F.track1_2025(final_ms=ms, seed=i)) for i, ms in enumerate([150200, 150500, 150400])]
    cand = [F.write(tmp_path / "c" / f"{i}.txt", F.track1_2025(final_ms=ms, seed=i, lr=0.06)) for i, ms in enumerate([149600, 149800, 149700])]
    result = compare.compare_runsets(load_runset(base), load_runset(cand), track=1, paired=True)
    time = result["time"]
    assert time["delta_s"] == pytest.approx(149.7 - 150.366666, abs=1e-6)
    assert time["speed_ratio"] == pytest.approx(150.3666666 / 149.7)
    assert time["welch_less"]["p_value"] < 0.01
    assert time["paired"]["geometric_ratio"] == pytest.approx(((149.6 / 150.2) * (149.8 / 150.5) * (149.7 / 150.4)) ** (1 / 3))
    assert [row["step"] for row in result["matched_steps"]][-1] == 1680
    text = compare.render_compare_text(result)
    assert "speed ratio 1.0045x" in text and "paired (n=3)" in text


def test_compare_track3_pairwise(tmp_path: Path) -> None:
    old = load_runset([F.write(tmp_path / "old.txt", F.track3_trials(F.SHAMPOO_TRIALS))])
    shifted = [{step: loss - 0.002 for step, loss in trial.items()} for trial in F.SHAMPOO_TRIALS]
    new = load_runset([F.write(tmp_path / "new.txt", F.track3_trials(shifted, markers=True))])
    result = compare.compare_runsets(old, new, track=3)["track3"]
    assert result["baseline"]["step"] == 4100 and result["candidate"]["step"] == 4075
    # old 3.2775925 @ 4100, new 3.276615 @ 4075: (0.0009775 + 25 steps saved · 0.0045/100) / √(1/4 + 1/4)
    assert result["value"] == pytest.approx((3.2775925 - 3.276615 + 0.001125) / 0.5**0.5)
    assert result["passes"] is False


def test_extract_rebuilds_shampoo_package_and_runs(tmp_path: Path) -> None:
    log = F.write(tmp_path / "log.txt", F.harness(shampoo=True))
    out = tmp_path / "repro" / "train_gpt_shampoo.py"
    written = extract_sources(log, out).written
    assert written == [out, tmp_path / "repro" / "distributed_shampoo" / "__init__.py", tmp_path / "repro" / "distributed_shampoo" / "shampoo.py"]
    assert out.read_text() == F.script(1680, 0.05)
    result = subprocess.run([sys.executable, str(out)], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0 and "Hyperparameters(num_iterations=1680" in result.stdout
    with pytest.raises(RecordsError, match="already exists; extract into an empty folder"):
        extract_sources(log, out)


def test_extract_appended_kernels_and_refuses_console_capture(tmp_path: Path) -> None:
    log = F.write(tmp_path / "log.txt", F.track1_2025())
    written = extract_sources(log, tmp_path / "x" / "train_gpt.py").written
    assert (tmp_path / "x" / "triton_kernels.py").read_text() == F.KERNELS and len(written) == 2
    console = F.write(tmp_path / "c.stdout", F.track3_trials(F.SHAMPOO_TRIALS, source=False))
    with pytest.raises(RecordsError, match="no embedded source"):
        extract_sources(console, tmp_path / "y.py")


def test_cli_error_is_one_line_exit_2(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    bad = F.write(tmp_path / "notes.txt", "just some text\n")
    assert main(["stats", str(bad), "--track", "1"]) == 2
    err = capsys.readouterr().err
    assert err == f"records: error: {bad}: no val line ('step:N/T val_loss:X train_time:...' or 's:N tel:X'); pass a training log\n"


def test_cli_stats_json_and_statistics_md(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    import json

    for i, loss in enumerate([3.2770, 3.2775, 3.2780, 3.2772]):
        F.write(tmp_path / "runs" / f"{i}.txt", F.track1_2025(final_loss=loss, seed=i))
    assert main(["stats", str(tmp_path / "runs"), "--track", "1", "--json"]) == 0
    (report,) = json.loads(capsys.readouterr().out)["configurations"]
    assert report["n"] == 4 and report["passes"] is True and 0 < report["p_value"] < 0.01
    assert set(report["val_loss"]) >= {"mean", "std", "min", "max"} and set(report["train_time_s"]) >= {"mean", "std"}
    assert report["verdict"] == f"p = {report['p_value']:.4f} < 0.01 with n = 4"
    assert not (tmp_path / "runs" / "statistics.md").exists()  # written only with --md
    assert main(["stats", str(tmp_path / "runs"), "--track", "1", "--md"]) == 0
    assert capsys.readouterr().out.endswith(f"wrote {tmp_path / 'runs' / 'statistics.md'}\n")
    assert (tmp_path / "runs" / "statistics.md").read_text().startswith("# Statistics: runs")


def test_diff_puts_the_verdict_first_even_with_a_hundred_names_on_one_side(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    only_new = {f"new_setting_{k:03d}": k for k in range(110)}
    only_old = {f"old_setting_{k:02d}": k for k in range(41)}
    old = [F.write(tmp_path / "old" / f"o{i}.txt", F.harness(final_loss=3.2770 + i / 1e4, shampoo=True, seconds=True,
                                                              settings={**only_old, "seed": i})) for i in range(2)]
    new = [F.write(tmp_path / "new" / f"n{i}.txt", F.harness(final_loss=3.2760 + i / 1e4, shampoo=True, seconds=True, lr=0.06,
                                                              settings={**only_new, "seed": i})) for i in range(2)]
    assert main(["diff", *map(str, new), "--against", str(tmp_path / "old")]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[3].startswith("track 3 (")
    assert any(line.startswith("pairwise (loss difference") for line in lines[:8])  # the verdict, before any name list
    assert "  names on one side only: 110 only in the new run; 41 only in the record (-v lists them)" in lines
    assert not any("new_setting_000" in line for line in lines)
    assert main(["diff", *map(str, new), "--against", str(old[0].parent), "-v"]) == 0
    verbose = capsys.readouterr().out
    assert "  only in the new run (110): new_setting_000, new_setting_001" in verbose and "  only in the record (41): old_setting_00" in verbose


@pytest.mark.parametrize("where", ["under-a-file", "proc"])
def test_extract_and_stats_md_to_an_unusable_path_are_one_line(tmp_path: Path, where: str, capsys: pytest.CaptureFixture[str]) -> None:
    if where == "proc" and not Path("/proc/self").is_dir():
        pytest.skip("no /proc here")
    log = F.write(tmp_path / "runs" / "log.txt", F.track1_2025())
    afile = F.write(tmp_path / "afile", "x\n")
    base = afile if where == "under-a-file" else Path("/proc")
    assert main(["extract", str(log), "-o", str(base / "x" / "train.py")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"{base / 'x'}: cannot write train.py there (" in err and "pass -o FILE" in err
    assert main(["stats", str(tmp_path / "runs"), "--md", str(base / "x.md")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"{base / 'x.md'}: " in err and "pass another --md FILE" in err



def test_extract_below_a_regular_file_is_one_line_naming_it_and_writes_nothing(tmp_path: Path,
                                                                             capsys: pytest.CaptureFixture[str]) -> None:
    log = F.write(tmp_path / "log.txt", F.harness(shampoo=True, seconds=True))
    afile = F.write(tmp_path / "afile", "x\n")
    assert main(["extract", str(log), "-o", str(afile / "train.py")]) == 2
    assert capsys.readouterr().err == (f"records: error: {afile}: cannot write train.py there ({afile} is a file, not a folder); "
                                       "pass -o FILE in a folder you can write to (nothing was written)\n")
    package = F.write(tmp_path / "out" / "distributed_shampoo", "a file where the package folder goes\n")
    assert main(["extract", str(log), "-o", str(tmp_path / "out" / "train.py")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith(f"records: error: {package}: cannot write __init__.py there ({package} is a file, ")
    assert afile.read_text() == "x\n" and sorted(p.name for p in (tmp_path / "out").iterdir()) == ["distributed_shampoo"]


def test_track3_timing_detail_warns_about_different_hardware(tmp_path: Path) -> None:
    old = diff.load_against(F.write(tmp_path / "gpu.txt", F.harness(shampoo=True, seconds=True)), False, False)
    new = diff.side_from_logs("new", [F.write(tmp_path / "cpu.txt", F.harness(shampoo=True, seconds=True, device="cpu", smi=False))],
                              False, False)
    text = diff.render_diff(old, new, track=3)
    timing = text[text.index("== timing detail"):]
    assert "different hardware (record: 8× NVIDIA H200; new: cpu): these time differences say nothing about the change" in timing
    same = diff.render_diff(old, old, track=3)
    assert "different hardware" not in same


@pytest.mark.parametrize("output", ["new/", "existing", ""])
def test_extract_to_a_folder_is_one_line_and_writes_nothing(tmp_path: Path, output: str, monkeypatch: pytest.MonkeyPatch,
                                                            capsys: pytest.CaptureFixture[str]) -> None:
    # `-o new/` wrote the script as the file `new` and triton_kernels.py into the folder above; `-o existing` (a folder)
    # said "already exists; extract into an empty folder" of an empty folder; `-o ''` meant the current folder.
    log = F.write(tmp_path / "log.txt", F.track1_2025())
    (tmp_path / "existing").mkdir()
    monkeypatch.chdir(tmp_path)
    assert main(["extract", str(log), "-o", output]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith(f"records: error: -o {output or repr('')}: ")
    if output:
        assert f"names a folder; pass -o {output.rstrip('/')}/train_gpt.py" in err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["existing", "log.txt"] and not any((tmp_path / "existing").iterdir())


@pytest.mark.parametrize("cut", ["script", "kernels"])
def test_extract_of_a_log_whose_code_is_cut_short_is_refused_naming_the_line(tmp_path: Path, cut: str,
                                                                             capsys: pytest.CaptureFixture[str]) -> None:
    # The code section ends early but the environment and step lines follow: extract wrote a script (or kernels file)
    # that does not compile, rc 0 and no warning.
    text = F.harness() if cut == "script" else F.track1_2025()
    end = "    model = GPT(vocab" if cut == "script" else "def kernel_grid(n):"
    code_end = text.index(end) + len(end)
    log = F.write(tmp_path / "cut.txt", text[:code_end] + "\n" + text[text.index("=" * 100):])
    assert log.read_text().split("\n")[19 if cut == "script" else 34] == end  # the line the error names
    assert main(["extract", str(log), "-o", str(tmp_path / "out" / "train_gpt.py")]) == 2
    what = ("the embedded script breaks at line 20 of the log ('(' was never closed)" if cut == "script" else
            "the embedded file triton_kernels.py breaks at line 35 of the log (expected an indented block after function "
            "definition on line 4)")
    assert capsys.readouterr().err == (f"records: error: {log}: {what}: cut short or damaged, it would not run; extract from an "
                                       "intact log of the run (nothing was written)\n")
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("where", ["existing file", "existing folder", "missing folder", "below a file", "unwritable folder"])
def test_diff_plot_to_an_unusable_path_is_refused_before_the_diff(tmp_path: Path, where: str, monkeypatch: pytest.MonkeyPatch,
                                                                  capsys: pytest.CaptureFixture[str]) -> None:
    # The error came only after the whole diff was printed (and a missing folder was a 'cannot write the plot' line).
    old = F.write(tmp_path / "old.txt", F.harness(final_loss=3.2796, lr=0.05))
    new = F.write(tmp_path / "new.txt", F.harness(final_loss=3.2790, lr=0.06))
    afile = F.write(tmp_path / "afile", "kept\n")
    (tmp_path / "adir").mkdir()
    plot, expected = {
        "existing file": (afile, f"{afile}: already exists; pass another --plot path (never overwritten)"),
        "existing folder": (tmp_path / "adir", f"{tmp_path / 'adir'}: already exists; pass another --plot path (never overwritten)"),
        "missing folder": (tmp_path / "nodir" / "c.png", f"{tmp_path / 'nodir' / 'c.png'}: no folder {tmp_path / 'nodir'}; create "
                                                          "it or pass another --plot path"),
        "below a file": (afile / "c.png", f"{afile / 'c.png'}: cannot write it there ({afile} is a file, not a folder); pass "
                                          "another --plot path"),
        "unwritable folder": (tmp_path / "adir" / "c.png", f"{tmp_path / 'adir' / 'c.png'}: cannot write it there ({tmp_path / 'adir'} "
                                                           "is not writable); pass another --plot path"),
    }[where]
    if where == "unwritable folder":  # stood in for: root may write anywhere
        monkeypatch.setattr("os.access", lambda path, mode: Path(path) != tmp_path / "adir")
    assert main(["diff", str(new), "--against", str(old), "--plot", str(plot)]) == 2
    out, err = capsys.readouterr()
    assert out == "" and err == f"records: error: {expected}\n"
    assert afile.read_text() == "kept\n" and not any((tmp_path / "adir").iterdir())


EMPTY_PATH_ARGUMENTS = {  # every path option of records.py, given '' (the value LOG is a usable log)
    "parse LOG|DIR": ["parse", ""],
    "stats LOG|DIR": ["stats", ""],
    "stats --md": ["stats", "LOG", "--md="],
    "compare --baseline": ["compare", "--baseline", "", "--candidate", "LOG"],
    "compare --candidate": ["compare", "--baseline", "LOG", "--candidate", ""],
    "diff NEW_LOG": ["diff", ""],
    "diff --against": ["diff", "LOG", "--against", ""],
    "diff --plot": ["diff", "LOG", "--against", "LOG", "--plot", ""],
    "diff --cache-dir": ["diff", "LOG", "--cache-dir", ""],
    "fetch --cache-dir": ["fetch", "1:89", "--cache-dir", ""],
    "new --logs": ["new", "--track", "1", "--name", "Empty", "--logs", ""],
    "extract log": ["extract", "", "-o", "x/train_gpt.py"],
    "index CLONE_DIR": ["index", ""],
    "--root": ["--root", "", "check"],
}


@pytest.mark.parametrize("case", EMPTY_PATH_ARGUMENTS)
def test_an_empty_path_argument_is_one_line_never_the_current_folder(tmp_path: Path, case: str, monkeypatch: pytest.MonkeyPatch,
                                                                     capsys: pytest.CaptureFixture[str]) -> None:
    # Path('') is '.': `fetch --cache-dir ''` filled the current folder, `diff --against ''` was a confusing error.
    log = F.write(tmp_path / "runs" / "log.txt", F.harness())
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("RECORDS_SOURCE_URL", "http://127.0.0.1:9")  # never the network
    argv = [str(log) if arg == "LOG" else arg for arg in EMPTY_PATH_ARGUMENTS[case]]
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    command, _, option = case.rpartition(" ")  # the option as argparse names it (a positional by its metavar)
    prog = f"records {command}" if command else "records"
    assert exit_info.value.code == 2
    assert capsys.readouterr().err == (f"{prog}: error: argument {option}: '' is empty, which would be read as the current folder; "
                                       f"pass a path; see `{prog} --help`\n")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["runs"]


def test_extract_lets_through_a_newer_pythons_syntax_and_says_so(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    # 2025-04 Track 2 logs ran Python 3.12, whose f-strings 3.11 cannot compile: they were refused as cut short.
    text = F.track1_2025().replace("Running Python 3.12.7", "Running Python 3.99.0")
    middle = "def kernel_grid(n):"  # a line in the middle of the appended kernels: syntax no Python has yet, then the rest
    log = F.write(tmp_path / "newer.txt", text.replace(middle, "match n with grid:\n    pass\n" + middle, 1))
    out_dir = tmp_path / "out"
    assert main(["extract", str(log), "-o", str(out_dir / "train_gpt.py")]) == 0
    err = capsys.readouterr().err
    assert err == (f"note: {log}: the run used Python 3.99, and its code does not compile in this Python {sys.version_info[0]}."
                   f"{sys.version_info[1]}, for a reason other than a cut (newer syntax?); run it with Python 3.99\n")
    assert "match n with grid:" in (out_dir / "triton_kernels.py").read_text()


@pytest.mark.parametrize("python", ["3.12.7", "3.99.0"])
def test_extract_refuses_a_nul_byte_in_the_code_whatever_the_python(tmp_path: Path, python: str,
                                                                     capsys: pytest.CaptureFixture[str]) -> None:
    # compile() raised ValueError on 3.10 (a traceback) and a SyntaxError without a line on 3.11 ("line 1 of the log")
    text = F.track1_2025().replace("Running Python 3.12.7", f"Running Python {python}")
    line = text.split("\n").index("def kernel_grid(n):") + 1
    log = F.write(tmp_path / "nul.txt", text.replace("def kernel_grid(n):", "def kernel_\0grid(n):", 1))
    assert main(["extract", str(log), "-o", str(tmp_path / "out" / "train_gpt.py")]) == 2
    assert capsys.readouterr().err == (f"records: error: {log}: the embedded file triton_kernels.py breaks at line {line} of the log "
                                       "(a NUL byte): cut short or damaged, it would not run; extract from an intact log of the "
                                       "run (nothing was written)\n")
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("cut", ["def kernel_grid(n):", "def kernel_grid(n"])
def test_extract_of_a_newer_pythons_log_cut_after_newer_syntax_is_refused(tmp_path: Path, cut: str,
                                                                           capsys: pytest.CaptureFixture[str]) -> None:
    # compile() names only the first error, the newer syntax, so a cut after it passed as "newer syntax?"
    text = F.track1_2025().replace("Running Python 3.12.7", "Running Python 3.99.0")
    text = text.replace("def kernel_grid(n):", "match n with grid:\n    pass\ndef kernel_grid(n):", 1)
    code_end = text.index("def kernel_grid(n):") + len(cut)
    log = F.write(tmp_path / "cut.txt", text[:code_end] + "\n" + text[text.index("=" * 100):])
    assert main(["extract", str(log), "-o", str(tmp_path / "out" / "train_gpt.py")]) == 2
    err = capsys.readouterr().err
    reason = "a block opened on the last line" if cut.endswith(":") else "('EOF in multi-line statement'"
    assert err.startswith(f"records: error: {log}: the embedded file triton_kernels.py breaks at line ") and reason.strip("('") in err
    assert not (tmp_path / "out").exists()
