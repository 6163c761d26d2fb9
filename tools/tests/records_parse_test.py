"""Parser tests on synthetic logs of every era."""

from __future__ import annotations

from pathlib import Path

import pytest
import records_fixtures as F

from recordkit.errors import RecordsError
from recordkit.parse import find_logs, parse_log, parse_text, split_layout


def parse(text: str, name: str = "log.txt") -> list:
    return parse_text(text, Path(name))


def test_2025_log_with_appended_kernels_and_smi_table() -> None:
    (run,) = parse(F.track1_2025(final_loss=3.2799, final_ms=149623))
    assert run.era == "2025+"
    assert list(run.sources) == ["__script__", "triton_kernels.py"]
    assert "class Hyperparameters" in run.sources["__script__"]
    assert run.sources["triton_kernels.py"] == F.KERNELS
    assert run.env.python.startswith("3.12.7 | packaged by conda-forge |")  # pipes kept
    assert (run.env.torch, run.env.cuda, run.env.triton) == ("2.9.0.dev20250726+cu126", "12.6", "3.4.0")
    assert run.env.gpu_models == ["NVIDIA H100 80GB HBM3"] * 8
    assert run.env.driver == "570.148.08"
    assert run.env.hardware == "8× NVIDIA H100 80GB HBM3"
    assert run.final.step == 1680 and run.final.total_steps == 1680
    assert run.final.val_loss == 3.2799
    assert run.final.train_time_s == pytest.approx(149.623)
    assert run.final.step_avg_ms == 89.06
    assert run.complete and run.status == "complete"
    assert (run.peak_memory.allocated_mib, run.peak_memory.reserved_mib) == (30760, 45554)
    assert len(run.train_points) == 14 and run.train_points[0].step == 1


def test_smi_equals_rows_are_not_separators() -> None:
    lines = F.track1_2025().splitlines()
    layout = split_layout(lines)
    assert layout.separator_count == 2
    assert any(line.startswith("|====") for line in layout.env_lines)


def test_2024_leading_separator_with_dataloader_block() -> None:
    (run,) = parse(F.track1_2024_leading())
    assert run.era == "2024-10/11"
    assert "class Hyperparameters" in run.sources["__script__"]
    assert run.env.torch == "2.5.1+cu124" and run.env.gpu_count == 8
    assert run.train_points[0].train_loss == pytest.approx(10.8259)
    assert run.train_points[0].step_avg_ms != run.train_points[0].step_avg_ms  # nan until step 13
    assert run.final.val_loss == 3.2785 and run.final.train_time_s == 264.0
    assert run.peak_memory is None


def test_2024_12_code_first_lowercase_labels_and_old_memory_line() -> None:
    (run,) = parse(F.track1_2024_12())
    assert run.era == "2024-12"
    assert run.env.python.startswith("3.12.7 (main")
    assert run.peak_memory.allocated_mib == 37001 and run.peak_memory.reserved_mib is None
    assert [p.step for p in run.val_points] == [0, 1530]  # debug prints skipped


def test_llmc_log_has_losses_only() -> None:
    (run,) = parse(F.llmc(final_loss=3.2847))
    assert run.era == "llm.c" and run.sources == {} and run.code_hash is None
    assert run.final.val_loss == 3.2847 and run.final.train_time_s is None
    assert run.total_steps is None and run.complete
    assert run.train_points[-1].train_loss == pytest.approx(6.0)


def test_track3_multi_trial_split_at_step_reset() -> None:
    runs = parse(F.track3_trials(F.SHAMPOO_TRIALS))
    assert len(runs) == 4 and [r.trial for r in runs] == [1, 2, 3, 4]
    assert {r.trial_count for r in runs} == {4}
    assert runs[2].label == "log.txt#trial3"
    assert runs[1].val_at(4100).val_loss == 3.27792
    assert runs[0].final.train_time_s == pytest.approx(4150 * 0.2185, abs=1e-3)
    assert runs[0].env.hardware == "8× NVIDIA H100 80GB HBM3" and runs[0].env.world_size == 8
    assert all(r.era == "track3" and r.complete for r in runs)
    assert len({r.code_hash for r in runs}) == 1


def test_track3_trial_markers_and_extra_columns() -> None:
    runs = parse(F.track3_trials(F.SHAMPOO_TRIALS, markers=True, extra_columns=True))
    assert len(runs) == 4
    point = runs[3].val_at(4150)
    assert point.val_loss == 3.27915
    assert dict(point.extras) == {"val_ema_loss": "3.27815", "ema_beta": "0.9", "ref_step": "2375"}


def test_console_capture_without_source() -> None:
    runs = parse(F.track3_trials(F.SHAMPOO_TRIALS[:2], source=False, console_train_lines=True), "seed0.stdout")
    assert len(runs) == 2
    assert runs[0].era == "console-track3" and runs[0].sources == {} and runs[0].code_hash is None
    assert runs[0].train_points and runs[0].final.val_loss == 3.27611


def test_repeated_final_lines_are_collapsed() -> None:
    (run,) = parse(F.track1_2025(repeat_final=3))
    assert [p.step for p in run.val_points].count(1680) == 1
    assert len(run.notes) == 2 and "repeated val line" in run.notes[0]


def test_missing_final_line_is_a_truncated_run() -> None:
    (run,) = parse(F.track1_2025(with_final=False))
    assert not run.complete
    assert run.status == "truncated: last val 1625/1680"
    assert run.peak_memory is None


def test_harness_log_with_shampoo_package_and_key_values() -> None:
    (run,) = parse(F.harness(shampoo=True))
    assert run.era == "harness"
    assert list(run.sources) == ["__script__", "distributed_shampoo/__init__.py", "distributed_shampoo/shampoo.py"]
    assert run.sources["distributed_shampoo/shampoo.py"] == F.SHAMPOO_FILE
    assert run.env.hyperparameters == {"num_iterations": 1680, "learning_rate": 0.05, "seed": 0, "run_name": "x"}
    assert run.env.overrides == {}
    assert run.env.device == "8x NVIDIA H200" and run.env.world_size == 8
    assert run.env.settings["git_commit"] == "0123456789abcdef"
    assert run.env.settings["attention_backend"] == "flex"
    assert run.env.hardware == "8× NVIDIA H200"
    assert run.warmup_time_s == 412.3
    assert "warmup_time" not in run.env.settings  # key: value lines count only before the last separator
    assert run.env.settings["train_files"] == "8 files, 800000000 tokens"


def test_harness_cpu_log_without_nvidia_smi() -> None:
    (run,) = parse(F.harness(smi=False, device="cpu"))
    assert run.env.gpu_models == [] and run.env.settings["nvidia-smi"] == "not available"
    assert run.env.hardware == "cpu" and run.env.gpu_count == 1


def test_log_without_val_line_is_an_error(tmp_path: Path) -> None:
    path = F.write(tmp_path / "bad.txt", "hello\nstep:1/10 train_time:5ms step_avg:5.00ms\n")
    with pytest.raises(RecordsError, match=r"bad\.txt: step lines but no val line \(the run stopped before its first validation\)"):
        parse_log(path)
    notes = F.write(tmp_path / "notes.txt", "just some text\n")
    with pytest.raises(RecordsError, match=r"notes\.txt: no val line \('step:N/T val_loss:X train_time:\.\.\.' or 's:N tel:X'\); pass a training log"):
        parse_log(notes)


def test_missing_file_is_an_error(tmp_path: Path) -> None:
    with pytest.raises(RecordsError, match="no such file"):
        parse_log(tmp_path / "nope.txt")


def test_find_logs_recurses_and_skips_markdown(tmp_path: Path) -> None:
    F.write(tmp_path / "a" / "x.txt", F.llmc())
    F.write(tmp_path / "a" / "y.stdout", F.llmc())
    F.write(tmp_path / "README.md", "# no")
    assert [p.name for p in find_logs([tmp_path])] == ["x.txt", "y.stdout"]
    (tmp_path / "empty").mkdir()
    with pytest.raises(RecordsError, match="no log files"):
        find_logs([tmp_path / "empty"])


def test_nan_losses_make_a_diverged_run() -> None:
    (run,) = parse(F.track1_2025(diverge_at=1000))
    assert run.diverged_at == 1000 and run.status == "diverged at step 1000" and not run.complete
    assert run.usable_val_points[-1].step == 875 and run.final.step == 1680  # parsed as logged, used up to 875
    (ours,) = parse(F.harness(diverge_at=840))  # our scripts stop at the first non-finite loss
    assert ours.status == "diverged at step 840" and [p.step for p in ours.usable_val_points] == [0]
    text = F.track1_2024_leading().replace("step:13/3000 train_loss:7.9000", "step:13/3000 train_loss:nan")
    (old,) = parse(text)  # 2024 logs carry train losses: a NaN there is a divergence too
    assert old.diverged_at == 13 and [p.step for p in old.usable_val_points] == [0]


def test_header_only_log_says_the_run_stopped_before_training(tmp_path: Path) -> None:
    path = F.write(tmp_path / "h.txt", F.header_only(F.harness()))
    with pytest.raises(RecordsError, match=r"h\.txt: source and environment only, no step line \(the run stopped before training\)"):
        parse_log(path)


def test_val_line_behind_garbage_is_a_warning_naming_the_line() -> None:
    text = F.track1_2025().replace("step:1680/1680 val_loss", "\0\0\0\0step:1680/1680 val_loss")
    (run,) = parse(text, "g.txt")
    number = 1 + text.splitlines().index(next(line for line in text.splitlines() if line.startswith("\0\0\0\0step:")))
    assert run.warnings == [f"g.txt: line {number}: val line behind 4 characters of other data (binary garbage?); not used"]
    assert run.status == f"damaged: last val 1625/1680, line {number}: val line behind 4 characters of other data (binary garbage?); not used"
    cut = F.track1_2025().replace("step:1680/1680 val_loss:3.2792 train_time:149775ms step_avg:89.15ms", "step:1680/1680 val_loss:3.27")
    (run,) = parse(cut, "c.txt")
    assert run.warnings and run.warnings[0].endswith("val line cut short or malformed; not used")
    side = F.track1_2025().replace("peak memory", "readout step:1680 alpha:0.5 val_loss:3.2700\npeak memory")
    assert parse(side)[0].warnings == []  # side evaluations are not val lines


def test_this_repositorys_track3_script_is_told_by_its_settings_not_its_time_unit(tmp_path: Path) -> None:
    """train_gpt_shampoo.py logs milliseconds, as train_gpt.py does: its matrix_optimizer setting says Track 3."""
    shampoo = F.write(tmp_path / "t3.txt", F.harness(steps=150, gpus=1, device="1x NVIDIA H200", shampoo=True,
                                                     settings={"matrix_optimizer": "shampoo"}))
    track1 = F.write(tmp_path / "t1.txt", F.harness(steps=150, gpus=1, device="1x NVIDIA H200"))
    (run3,), (run1,) = parse_log(shampoo), parse_log(track1)
    assert run3.track == 3 and "train_gpt_shampoo.py" in run3.track_reason and not run3.timed_in_seconds
    assert run1.track == 1 and "train_gpt.py" in run1.track_reason
