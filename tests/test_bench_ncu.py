"""bench/ncu_kernels.py on CPU: the summary of Nsight Compute's raw CSV page, and its refusals."""

import csv
import importlib.util
import os
import subprocess
import sys

import pytest

from conftest import ROOT

SCRIPT = ROOT / "bench" / "ncu_kernels.py"


@pytest.fixture(scope="module")
def ncu():
    spec = importlib.util.spec_from_file_location("bench_ncu_kernels", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


STALLS = {f"smsp__average_warps_issue_stalled_{reason}_per_issue_active.ratio": value
          for reason, value in [("math_pipe_throttle", 3.5), ("long_scoreboard", 2.25), ("wait", 1.5), ("barrier", 1.25),
                                ("short_scoreboard", 1.1), ("mio_throttle", 1.05), ("lg_throttle", 1.01), ("no_instruction", 0.5),
                                ("selected", 9.0)]}  # 'selected' counts issued warps: not a stall
METRICS = {
    "gpu__time_duration.sum": ("usecond", "6,123.50"),
    "dram__throughput.avg.pct_of_peak_sustained_elapsed": ("%", "59.10"),
    "sm__warps_active.avg.pct_of_peak_sustained_active": ("%", "47.00"),
    "sm__inst_executed_pipe_xu.avg.pct_of_peak_sustained_active": ("%", "71.20"),
    "sm__inst_executed_pipe_fma.avg.pct_of_peak_sustained_active": ("%", "40.00"),
    "sm__inst_executed_pipe_uniform.avg.pct_of_peak_sustained_active": ("%", "0.40"),  # below SMALL_SHARE
    "sm__pipe_tensor_op_gmma_cycles_active.avg.pct_of_peak_sustained_active": ("%", "n/a"),  # not a number
    "l1tex__data_bank_conflicts_pipe_lsu.sum": ("", "12"),  # matches no summary pattern
    **{name: ("", str(value)) for name, value in STALLS.items()},
}


def write_raw_csv(path, kernels):
    """kernels: (name, {metric: value}) pairs; a metric a kernel leaves out takes its METRICS value."""
    header = ["ID", "Kernel Name", "Grid Size", "Block Size", *METRICS]
    units = ["", "", "", "", *(unit for unit, _ in METRICS.values())]
    with path.open("w", newline="") as f:
        f.write("==PROF== Disconnected from process 123\n")  # ncu's own messages may come first
        writer = csv.writer(f)
        writer.writerow(header)
        writer.writerow(units)
        for index, (name, values) in enumerate(kernels):
            row = [values.get(metric, value) for metric, (_, value) in METRICS.items()]
            writer.writerow([str(index), name, "(1536, 1, 1)", "(256, 1, 1)", *row])


def summary_of(ncu, path, capsys) -> list[list[str]]:
    """The summary's lines, split into words, grouped per kernel."""
    ncu.summarize(path)
    kernels: list[list[str]] = []
    for line in capsys.readouterr().out.splitlines():
        if line.startswith("kernel:"):
            kernels.append([line])
        else:
            kernels[-1].append(line)
    return kernels


def test_summary_keeps_the_key_metrics_of_each_kernel(ncu, tmp_path, capsys):
    path = tmp_path / "raw.csv"
    write_raw_csv(path, [("_softcap_ce_e5m2_kernel", {}), ("triton_tem_fused_0", {})])
    first, second = summary_of(ncu, path, capsys)
    assert first[0] == "kernel: _softcap_ce_e5m2_kernel (grid (1536, 1, 1), block (256, 1, 1))"
    assert second[0] == "kernel: triton_tem_fused_0 (grid (1536, 1, 1), block (256, 1, 1))"
    values = {line.split()[1]: float(line.split()[2]) for line in first[1:]}
    assert values["gpu__time_duration.sum"] == 6123.5  # thousands separator read
    assert values["dram__throughput.avg.pct_of_peak_sustained_elapsed"] == 59.1
    assert values["sm__warps_active.avg.pct_of_peak_sustained_active"] == 47.0
    pipes = [line.split()[1] for line in first if line.split()[0] == "pipes"]
    assert pipes == ["sm__inst_executed_pipe_xu.avg.pct_of_peak_sustained_active", "sm__inst_executed_pipe_fma.avg.pct_of_peak_sustained_active"]
    stalls = [line.split()[1].split("_stalled_")[1].split("_per_")[0] for line in first if line.split()[0] == "stalls"]
    # the six largest, largest first; 'selected' is no stall, however large
    assert stalls == ["math_pipe_throttle", "long_scoreboard", "wait", "barrier", "short_scoreboard", "mio_throttle"]
    assert not any("bank_conflicts" in line or "gmma" in line for kernel in (first, second) for line in kernel)


def test_summary_leaves_out_small_stalls(ncu, tmp_path, capsys):
    """Fewer stalls than the six shown reach SMALL_SHARE: only those are printed."""
    small = {name: "0.9" for name in STALLS if "stalled_wait" not in name and "long_scoreboard" not in name}
    path = tmp_path / "raw.csv"
    write_raw_csv(path, [("_softcap_ce_e5m2_kernel", small)])
    (kernel,) = summary_of(ncu, path, capsys)
    assert [line.split()[1].split("_stalled_")[1].split("_per_")[0] for line in kernel if line.split()[0] == "stalls"] == ["long_scoreboard", "wait"]


def test_summary_refuses_a_file_that_is_not_the_raw_page(ncu, tmp_path):
    path = tmp_path / "details.txt"
    path.write_text("  Section: GPU Speed Of Light Throughput\n")
    with pytest.raises(SystemExit, match="details.txt is not ncu's raw CSV page"):
        ncu.summarize(path)


def test_command_line_errors_are_one_line(tmp_path):
    missing = subprocess.run([sys.executable, str(SCRIPT), "summarize", str(tmp_path / "none.csv")], capture_output=True, text=True)
    assert missing.returncode == 1 and missing.stderr.strip() == f"ncu_kernels.py: {tmp_path / 'none.csv'}: no such file"
    unknown = subprocess.run([sys.executable, str(SCRIPT), "run", "matmul"], capture_output=True, text=True)
    assert unknown.returncode == 2 and "invalid choice: 'matmul'" in unknown.stderr


FAKE_NCU = """#!/usr/bin/env bash
# stands in for Nsight Compute: logs its arguments; profiling exits with $FAKE_NCU_RC, --import prints pages
echo "$*" >> "$FAKE_NCU_LOG"
case "$*" in
    *"--page raw"*) cat "$FAKE_NCU_CSV" ;;
    *"--page details"*) echo "Section: GPU Speed Of Light Throughput" ;;
    *) exit "$FAKE_NCU_RC" ;;
esac
"""


def run_ncu_script(tmp_path, rc: int, *targets: str) -> tuple[subprocess.CompletedProcess, list[str]]:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(parents=True)
    (bin_dir / "ncu").write_text(FAKE_NCU)
    (bin_dir / "ncu").chmod(0o755)
    write_raw_csv(tmp_path / "fake.csv", [("_softcap_ce_e5m2_kernel", {})])
    log = tmp_path / "ncu_calls.log"
    env = dict(os.environ, PATH=f"{bin_dir}:{os.environ['PATH']}", PYTHON=sys.executable, FAKE_NCU_RC=str(rc),
               FAKE_NCU_LOG=str(log), FAKE_NCU_CSV=str(tmp_path / "fake.csv"))
    result = subprocess.run(["bash", str(ROOT / "bench" / "ncu_kernels.sh"), str(tmp_path / "out"), *targets],
                            capture_output=True, text=True, env=env)
    return result, (log.read_text().splitlines() if log.exists() else [])


def test_ncu_script_profiles_the_last_launch_and_summarizes(tmp_path):
    result, calls = run_ncu_script(tmp_path, 0, "softcap_ce", "flex")
    assert result.returncode == 0, result.stdout + result.stderr
    profiled = [call for call in calls if "--set full" in call]
    assert len(profiled) == 2
    # 3 launches of one kernel (softcap_ce) or of forward + backward (flex): the last launch's kernels
    assert "-k regex:_softcap_ce_e5m2_kernel --launch-skip 2 --launch-count 1" in profiled[0]
    assert profiled[0].endswith("bench/ncu_kernels.py run softcap_ce --launches 3")
    assert "-k regex:triton_tem --launch-skip 4 --launch-count 2" in profiled[1]
    assert "--clock-control none" in profiled[0]
    assert result.stdout.count("kernel: _softcap_ce_e5m2_kernel") == 2  # one summary per target
    assert (tmp_path / "out" / "flex.details.txt").read_text().startswith("Section:")


def test_ncu_script_fails_when_a_target_fails(tmp_path):
    result, _ = run_ncu_script(tmp_path / "failing", 1, "softcap_ce")
    assert result.returncode == 1 and "ncu failed" in result.stdout
    unknown, calls = run_ncu_script(tmp_path / "unknown", 0, "softcap_ce", "matmul")
    assert unknown.returncode == 2 and "unknown target 'matmul'" in unknown.stderr and calls == []
