"""bench/bench_shampoo_step.py and bench/probe_eigh.py on the CPU, with small sizes: the rows and tables they
print, the bitwise comparison of every row with the first, and the published optimizer's row (here a copy of our
package standing in for it, so that its row must equal ours)."""

import importlib.metadata
import os
import shutil
import subprocess
import sys

import pytest

from conftest import ROOT


def run_bench(script: str, *args: str, timeout: int = 600) -> subprocess.CompletedProcess:
    env = dict(os.environ, OMP_NUM_THREADS="1")
    return subprocess.run([sys.executable, str(ROOT / "bench" / script), *args], capture_output=True, text=True,
                          cwd=ROOT, timeout=timeout, env=env)


def test_probe_eigh_prints_its_table_last_on_the_cpu():
    result = run_bench("probe_eigh.py", "--device", "cpu", "--sizes", "24:3,16:2", "--repeats", "1")
    assert result.returncode == 0, result.stderr[-2000:]
    lines = result.stdout.strip().splitlines()
    assert lines[-1].startswith("all: the factor set of one root step")
    rows = [line.split() for line in lines if line.split()[:3] in (["3", "x", "24"], ["2", "x", "16"])]
    table = [row for row in rows if len(row) == 8]  # factors (3 words), library, dtype, 2 times, equality
    assert [(row[3], row[4], row[7]) for row in table] == [
        ("lapack", dtype, "bitwise") for _ in range(2) for dtype in ("float32", "float64")
    ]
    assert sum(line.split()[:1] == ["all"] for line in lines) == 2  # the sum over both sizes, per dtype
    assert sum(line.startswith("whole set largest first, lapack, float32, threads/streams: 1: ") for line in lines) == 1


def test_probe_eigh_refuses_bad_sizes():
    result = run_bench("probe_eigh.py", "--device", "cpu", "--sizes", "24x3")
    assert result.returncode == 2 and "--sizes must be comma-separated size:count pairs" in result.stderr


def test_probe_eigh_dtypes_pick_its_rows_once():
    result = run_bench("probe_eigh.py", "--device", "cpu", "--sizes", "24:3", "--repeats", "1", "--dtypes", "float64,float64")
    assert result.returncode == 0, result.stderr[-2000:]
    table = [line.split() for line in result.stdout.splitlines() if line.split()[:3] == ["3", "x", "24"] and len(line.split()) == 8]
    assert [row[4] for row in table] == ["float64"]


@pytest.mark.parametrize("option", [("--libraries", "cusolver,rocsolver"), ("--dtypes", "bfloat16")])
def test_probe_eigh_refuses_unknown_libraries_and_dtypes(option):
    result = run_bench("probe_eigh.py", "--device", "cpu", "--sizes", "24:3", *option)
    assert result.returncode == 2 and "--libraries takes cusolver,magma and --dtypes float32,float64" in result.stderr
    assert "Traceback" not in result.stderr


@pytest.mark.slow
def test_bench_shampoo_step_rows_equal_the_first_and_the_published_row(tmp_path):
    """Per-block and batched rows, then the "published optimizer" row from a folder given by --upstream (a copy of
    our package: the child process must import it from there, and its parameters must equal row 1's)."""
    published = tmp_path / "published"
    shutil.copytree(ROOT / "distributed_shampoo", published / "distributed_shampoo", ignore=shutil.ignore_patterns("tests", "__pycache__"))
    result = run_bench(
        "bench_shampoo_step.py", "--tiny", "--device", "cpu", "--steps", "2", "--warmup", "4", "--root-streams", "1",
        "--batched", "off,on", "--gradient-sets", "3", "--upstream", str(published),
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert f"published optimizer: from {published}" in result.stdout
    rows = {line[6:36].strip(): line for line in result.stdout.splitlines() if line.startswith("   0  ")}  # rank, label
    assert set(rows) == {"Shampoo, 1 stream", "Shampoo, 1 stream, batched", "published optimizer", "AdamW (foreach)"}
    for label in ("Shampoo, 1 stream", "Shampoo, 1 stream, batched", "published optimizer"):
        assert rows[label].split()[-1] == "yes", rows[label]


def torch_shampoo_installed() -> bool:
    try:
        importlib.metadata.distribution("torch-shampoo")
    except importlib.metadata.PackageNotFoundError:
        return False
    return True


@pytest.mark.slow
@pytest.mark.skipif(
    torch_shampoo_installed(), reason="torch-shampoo is installed here, so the bench times the published optimizer instead"
)
def test_bench_shampoo_step_says_in_one_line_that_the_published_optimizer_is_not_installed():
    result = run_bench("bench_shampoo_step.py", "--tiny", "--device", "cpu", "--steps", "1", "--warmup", "0", "--root-streams", "1")
    assert result.returncode == 0, result.stderr[-3000:]
    lines = [line for line in result.stdout.splitlines() if line.startswith("published optimizer:")]
    assert len(lines) == 1 and "not installed (no torch-shampoo distribution" in lines[0]


def test_bench_shampoo_step_refuses_a_folder_without_the_package(tmp_path):
    result = run_bench("bench_shampoo_step.py", "--tiny", "--device", "cpu", "--upstream", str(tmp_path))
    assert result.returncode == 2 and "no distributed_shampoo/__init__.py in that folder" in result.stderr


def test_bench_shampoo_step_refuses_batching_packed_factors():
    result = run_bench("bench_shampoo_step.py", "--tiny", "--device", "cpu", "--batched", "off,on", "--symmetric-packing", "on")
    assert result.returncode == 2 and "--batched on needs square factors" in result.stderr
    assert "Traceback" not in result.stderr
