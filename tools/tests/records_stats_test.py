"""Statistics against values computed by hand in this file (closed forms, no scipy)."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import records_fixtures as F

from recordkit import stats
from recordkit.errors import RecordsError
from recordkit.report import track_report
from recordkit.runsets import load_runset

# The published final losses and times of record 2025-09-23 (MuonCustomSizing), as in its record folder.
LOSSES = [3.2792, 3.2792, 3.2801, 3.2799]
TIMES = [149.686, 149.678, 149.775, 149.623]


def student_t3_cdf(t: float) -> float:
    """CDF of Student's t with 3 degrees of freedom (closed form)."""
    x = t / math.sqrt(3)
    return 0.5 + (x / (1 + x * x) + math.atan(x)) / math.pi


def hand_ttest(values: list[float], target: float) -> tuple[float, float]:
    n = len(values)
    mean = sum(values) / n
    sd = math.sqrt(sum((v - mean) ** 2 for v in values) / (n - 1))
    t = (mean - target) / (sd / math.sqrt(n))
    return t, student_t3_cdf(t)


def test_summary_uses_sample_sd() -> None:
    summary = stats.summarize(TIMES)
    assert summary.mean == pytest.approx(149.6905)
    # deviations -0.0045, -0.0125, 0.0845, -0.0675 → Σd² = 0.011873 → sd = √(0.011873/3)
    assert summary.std == pytest.approx(math.sqrt(0.011873 / 3), rel=1e-9)
    assert (summary.min, summary.max) == (149.623, 149.775)
    assert stats.summarize([1.0]).std is None


def test_one_sided_ttest_matches_closed_form() -> None:
    t_hand, p_hand = hand_ttest(LOSSES, 3.28)
    # mean 3.2796, Σd² = 66e-8, sd = √(22e-8), t = -0.0004 / (sd/2)
    assert t_hand == pytest.approx(-0.0004 / (math.sqrt(22e-8) / 2))
    result = stats.one_sample_less(LOSSES)
    assert result.statistic == pytest.approx(t_hand, rel=1e-9)
    assert result.p == pytest.approx(p_hand, rel=1e-9)
    assert result.p == pytest.approx(0.0932, abs=5e-4)  # does not pass p < 0.01
    passing = [3.2770, 3.2775, 3.2780, 3.2772]
    t2, p2 = hand_ttest(passing, 3.28)
    assert stats.one_sample_less(passing).p == pytest.approx(p2, rel=1e-9) and p2 < 0.01


def test_ttest_undefined_for_one_run_or_zero_sd() -> None:
    assert stats.one_sample_less([3.27]).p is None
    assert "n=1 < 2" in stats.one_sample_less([3.27]).reason
    assert stats.one_sample_less([3.27, 3.27]).p is None


def test_welch_matches_hand_formula() -> None:
    baseline = [150.2, 150.5, 150.4]
    candidate = [149.6, 149.8, 149.7, 149.5]

    def var(xs: list[float]) -> float:
        m = sum(xs) / len(xs)
        return sum((x - m) ** 2 for x in xs) / (len(xs) - 1)

    se2_b, se2_c = var(baseline) / 3, var(candidate) / 4
    t = (sum(candidate) / 4 - sum(baseline) / 3) / math.sqrt(se2_b + se2_c)
    df = (se2_b + se2_c) ** 2 / (se2_b**2 / 2 + se2_c**2 / 3)  # Welch–Satterthwaite
    result = stats.welch_less(candidate, baseline)
    assert result.statistic == pytest.approx(t) and result.df == pytest.approx(df)
    assert result.p < 0.01


def test_paired_ratio() -> None:
    result = stats.paired_less([99.0, 198.0], [100.0, 200.0])
    assert result.geometric_ratio == pytest.approx(0.99)
    assert result.test.p is None  # identical ratios: no spread


def test_paired_test_is_undefined_when_every_difference_is_equal() -> None:
    """Each candidate exactly 1 s faster: the differences have sd 0, so the paired t is undefined (it was -inf, p = 0)."""
    result = stats.paired_less([99.0, 100.0, 101.0], [100.0, 101.0, 102.0])
    assert result.test.statistic is None and result.test.p is None
    assert result.test.reason == "undefined: all differences equal"


def test_track3_margin_rule_and_first_passing_step() -> None:
    table = stats.track3_step_table({s: [t[s] for t in F.SHAMPOO_TRIALS] for s in (4075, 4100, 4125, 4150)})
    means = [row.mean for row in table]
    assert means[0] == pytest.approx(13.11446 / 4) and means[1] == pytest.approx(13.11037 / 4)
    assert table[0].margin == pytest.approx((3.28 - 13.11446 / 4) * 2) and not table[0].passes
    assert table[1].margin == pytest.approx(0.0048150) and table[1].passes
    assert stats.first_passing_step(table) == 4100
    assert stats.track3_passes(stats.track3_margin(3.276, 1))  # n = 1: 3.276 is the edge
    assert stats.track3_required_n(3.279) == 16 and stats.track3_required_n(3.281) is None


def test_track3_pairwise_worked_examples() -> None:
    # Track 3 README: #12 vs #6 = 0.00648 (passes); #13 vs #11 = 0.00167 (fails); #11 vs #9 p ≈ 0.69.
    assert stats.track3_pairwise(3.2788, 20, 3375, 3.2790, 20, 3325).value == pytest.approx(0.00648, abs=1e-5)
    r = stats.track3_pairwise(3.2785, 16, 3225, 3.2785, 10, 3210)
    assert r.value == pytest.approx(0.00167, abs=1e-5) and not r.passes
    assert stats.track3_pairwise(3.2771, 8, 3250, 3.2785, 16, 3225).z_p == pytest.approx(0.69, abs=0.01)


def test_track1_report_from_logs(tmp_path: Path) -> None:
    for i, (loss, seconds) in enumerate(zip(LOSSES, TIMES)):
        F.write(tmp_path / f"run{i}.txt", F.track1_2025(final_loss=loss, final_ms=round(seconds * 1000)))
    report = track_report(load_runset([tmp_path]), track=1)
    assert report["n"] == 4
    assert report["val_loss"]["mean"] == pytest.approx(3.2796)
    assert report["train_time_s"]["mean"] == pytest.approx(149.6905)
    assert report["p_value"] == pytest.approx(hand_ttest(LOSSES, 3.28)[1])
    assert report["passes"] is False


def test_track1_report_one_run_reports_undefined_p(tmp_path: Path) -> None:
    F.write(tmp_path / "run.txt", F.track1_2025())
    report = track_report(load_runset([tmp_path]), track=1)
    assert report["p_value"] is None and report["passes"] is False
    assert any("undefined: n=1" in note for note in report["notes"])


def test_track3_report_multi_trial_log(tmp_path: Path) -> None:
    F.write(tmp_path / "shampoo.txt", F.track3_trials(F.SHAMPOO_TRIALS))
    report = track_report(load_runset([tmp_path]), track=3)
    assert report["n"] == 4 and report["first_passing_step"] == 4100 and report["step"] == 4100
    assert report["val_loss"]["mean"] == pytest.approx(3.2775925)
    assert report["passes"] is True
    assert [row["step"] for row in report["steps"]] == [4075, 4100, 4125, 4150]


def test_truncated_run_excluded_unless_allowed(tmp_path: Path) -> None:
    F.write(tmp_path / "a.txt", F.track1_2025(final_loss=3.2790))
    F.write(tmp_path / "b.txt", F.track1_2025(final_loss=3.2780, with_final=False))
    runset = load_runset([tmp_path])
    assert [r.label for r in runset.runs] == ["a.txt"]
    assert any("b.txt: truncated: last val 1625/1680; excluded" in note for note in runset.notes)
    assert len(load_runset([tmp_path], allow_incomplete=True).runs) == 2


def test_one_configuration_is_required_where_a_single_one_is_used(tmp_path: Path) -> None:
    F.write(tmp_path / "a.txt", F.track1_2025(steps=1680))
    F.write(tmp_path / "b.txt", F.track1_2025(steps=1640))
    with pytest.raises(RecordsError, match=r"2 configurations in these logs \(they differ in code \(\w+ vs \w+\), steps \(1680 vs 1640\)\)"):
        load_runset([tmp_path])
    pooled = load_runset([tmp_path], allow_mixed=True)
    assert len(pooled.runs) == 2 and pooled.notes[0].startswith("pooled 2 configurations (--allow-mixed): ")
    F.write(tmp_path / "c" / "x.txt", F.track1_2025(gpus=8))
    F.write(tmp_path / "c" / "y.txt", F.track1_2025(gpus=4, final_loss=3.27))
    with pytest.raises(RecordsError, match=r"they differ in CPU or GPU count \(8 vs 4\)"):
        load_runset([tmp_path / "c"])


def test_console_capture_of_a_logged_run_counts_once(tmp_path: Path) -> None:
    F.write(tmp_path / "run.txt", F.track3_trials(F.SHAMPOO_TRIALS))
    F.write(tmp_path / "batch_stdout.txt", F.track3_trials(F.SHAMPOO_TRIALS, source=False))
    runset = load_runset([tmp_path])
    assert len(runset.runs) == 4 and all(r.code_hash for r in runset.runs)
    assert sum("counted once" in note for note in runset.notes) == 4


def test_missing_step_is_named(tmp_path: Path) -> None:
    F.write(tmp_path / "a.txt", F.track1_2025())
    with pytest.raises(RecordsError, match=r"step 17: no val line in a\.txt"):
        track_report(load_runset([tmp_path]), track=1, step=17)


def test_different_hyperparameter_lines_are_mixed(tmp_path: Path) -> None:
    F.write(tmp_path / "a.txt", F.harness(final_loss=3.279))
    F.write(tmp_path / "b.txt", F.harness(final_loss=3.278).replace("'seed': 0", "'seed': 1"))  # seeds may differ
    assert len(load_runset([tmp_path]).runs) == 2
    F.write(tmp_path / "c.txt", F.harness(final_loss=3.277).replace("'learning_rate': 0.05", "'learning_rate': 0.04"))
    with pytest.raises(RecordsError, match=r"they differ in hyperparameters \(learning_rate: 0\.05 vs 0\.04\)"):
        load_runset([tmp_path])


def test_run_management_settings_are_not_a_mixed_configuration(tmp_path: Path) -> None:
    F.write(tmp_path / "a.txt", F.harness(final_loss=3.279))
    resumed = "'run_name': 'x', 'checkpoint_every': 500, 'checkpoint_dir': 'ckpt', 'resume': 'ckpt/step000500'"
    F.write(tmp_path / "b.txt", F.harness(final_loss=3.278).replace("'run_name': 'x'", resumed))
    assert len(load_runset([tmp_path]).runs) == 2


def test_track3_claim_on_an_extra_column(tmp_path: Path) -> None:
    F.write(tmp_path / "ema.txt", F.track3_trials(F.SHAMPOO_TRIALS, extra_columns=True))  # val_ema_loss = val_loss − 0.001
    report = track_report(load_runset([tmp_path], metric="val_ema_loss"), track=3)
    assert report["first_passing_step"] == 4075
    assert report["val_loss"]["mean"] == pytest.approx(13.11446 / 4 - 0.001)
    with pytest.raises(RecordsError, match="no val line has a val_avg_loss: column"):
        load_runset([tmp_path], metric="val_avg_loss")
