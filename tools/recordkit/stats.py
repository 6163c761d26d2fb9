"""Statistics of the speedrun rules, on plain lists of numbers (docs/records.md states the rules).

Tracks 1 and 2: a one-sided one-sample t-test of the final val losses against the target
(H1: mean < target) must give p < 0.01; every published record computes it with
`scipy.stats.ttest_1samp(..., alternative='less')`. Track 3: (3.28 − mean)·√n ≥ 0.004, which is a
one-sided z-test with an assumed σ = 0.0013 at p < 0.001 (3.09 σ ≈ 0.004), and its pairwise form, which
converts saved steps to loss at 0.0045 per 100 steps.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import numpy as np
from scipy import stats as sps

TARGET_LOSS = 3.28  # GPT-2 124M on FineWeb: Tracks 1 and 3
TRACK2_TARGET_LOSS = 2.92  # GPT-2 350M
TARGETS = {1: TARGET_LOSS, 2: TRACK2_TARGET_LOSS, 3: TARGET_LOSS}
TRACK1_P_THRESHOLD = 0.01
TRACK3_MARGIN = 0.004
TRACK3_SIGMA = 0.0013
TRACK3_LOSS_PER_100_STEPS = 0.0045  # Track 3 README: #12 cut by 200 steps lost 0.0091
_EPS = 1e-12  # margins are compared after float arithmetic on 4-5 decimal losses


@contextmanager
def _quiet_precision_warnings() -> Iterator[None]:
    # scipy warns about "catastrophic cancellation" when two arms are (nearly) identical; the p-value
    # it returns is still right (≈ 1), and a warning on stderr would only clutter the CLI output.
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="Precision loss occurred", category=RuntimeWarning)
        yield


def mean(values: list[float]) -> float:
    return float(np.mean(values))


@dataclass(frozen=True)
class Summary:
    n: int
    mean: float
    std: float | None  # sample sd (n − 1); None when n < 2
    min: float
    max: float

    def as_dict(self) -> dict[str, float | int | None]:
        return {"n": self.n, "mean": self.mean, "std": self.std, "min": self.min, "max": self.max}


def summarize(values: list[float]) -> Summary:
    if not values:
        raise ValueError("summarize() needs at least one value")
    array = np.asarray(values, dtype=float)
    std = float(array.std(ddof=1)) if len(values) >= 2 else None
    return Summary(len(values), float(array.mean()), std, float(array.min()), float(array.max()))


def runs_needed_for_ttest(mean: float, sd: float, target: float = TARGET_LOSS, threshold: float = TRACK1_P_THRESHOLD,
                          limit: int = 100_000) -> int | None:
    """Smallest n at which runs with this mean and sd would give p < threshold; None if the mean is not below
    target or more than `limit` runs would be needed."""
    if mean >= target or sd <= 0:
        return None
    n = np.arange(2, limit + 1)
    p = sps.t.cdf((mean - target) / (sd / np.sqrt(n)), n - 1)
    passing = np.flatnonzero(p < threshold)
    return int(n[passing[0]]) if passing.size else None


@dataclass(frozen=True)
class TTest:
    """A one-sided test result; `p` is None (undefined) when the test cannot be computed."""

    statistic: float | None
    df: float | None
    p: float | None
    reason: str | None = None  # why p is undefined


def one_sample_less(values: list[float], target: float = TARGET_LOSS) -> TTest:
    """One-sided one-sample t-test, H1: mean < target."""
    if len(values) < 2:
        return TTest(None, None, None, f"undefined: n={len(values)} < 2")
    if float(np.std(values)) == 0.0:
        return TTest(None, len(values) - 1, None, "undefined: all values are equal (sd = 0)")
    with _quiet_precision_warnings():
        result = sps.ttest_1samp(values, target, alternative="less")
    return TTest(float(result.statistic), float(len(values) - 1), float(result.pvalue))


def welch(candidate: list[float], baseline: list[float], alternative: str = "two-sided") -> TTest:
    """Welch's unequal-variance t-test; alternative "less" means H1: mean(candidate) < mean(baseline)."""
    if len(candidate) < 2 or len(baseline) < 2:
        return TTest(None, None, None, f"undefined: n={len(candidate)} and {len(baseline)} (need ≥ 2 each)")
    if float(np.std(candidate)) == 0.0 and float(np.std(baseline)) == 0.0:
        return TTest(None, None, None, "undefined: both arms have sd = 0")
    with _quiet_precision_warnings():
        result = sps.ttest_ind(candidate, baseline, equal_var=False, alternative=alternative)
    return TTest(float(result.statistic), float(result.df), float(result.pvalue))


def welch_less(candidate: list[float], baseline: list[float]) -> TTest:
    """One-sided Welch test, H1: mean(candidate) < mean(baseline)."""
    return welch(candidate, baseline, "less")


def welch_two_sided(a: list[float], b: list[float]) -> TTest:
    return welch(a, b)


@dataclass(frozen=True)
class PairedRatio:
    """Paired comparison of interleaved runs: candidate/baseline time ratios."""

    n: int
    test: TTest  # one-sided paired t-test, H1: candidate faster
    geometric_ratio: float  # geometric mean of candidate/baseline
    ci95: tuple[float, float] | None


def paired_less(candidate: list[float], baseline: list[float]) -> PairedRatio:
    if len(candidate) != len(baseline):
        raise ValueError("paired comparison needs the same number of runs in both arms")
    n = len(candidate)
    log_ratios = np.log(np.asarray(candidate, dtype=float) / np.asarray(baseline, dtype=float))
    geometric = float(np.exp(log_ratios.mean()))
    if n < 2:
        return PairedRatio(n, TTest(None, None, None, f"undefined: n={n} < 2"), geometric, None)
    if float(log_ratios.std()) == 0.0:
        return PairedRatio(n, TTest(None, n - 1, None, "undefined: all time ratios equal"), geometric, None)
    # The t-test is on the differences: with no spread in them its t is infinite and its p a meaningless 0.
    if float(np.std(np.asarray(candidate, dtype=float) - np.asarray(baseline, dtype=float))) == 0.0:
        return PairedRatio(n, TTest(None, n - 1, None, "undefined: all differences equal"), geometric, None)
    with _quiet_precision_warnings():
        result = sps.ttest_rel(candidate, baseline, alternative="less")
    half = float(sps.t.ppf(0.975, n - 1) * log_ratios.std(ddof=1) / math.sqrt(n))
    ci = (float(np.exp(log_ratios.mean() - half)), float(np.exp(log_ratios.mean() + half)))
    return PairedRatio(n, TTest(float(result.statistic), float(n - 1), float(result.pvalue)), geometric, ci)


# ----- Track 3 -----


def track3_margin(mean: float, n: int, target: float = TARGET_LOSS) -> float:
    """(target − mean)·√n; the result passes when this is ≥ 0.004."""
    return (target - mean) * math.sqrt(n)


def track3_passes(margin: float) -> bool:
    return margin >= TRACK3_MARGIN - _EPS


def track3_z_p(margin: float) -> float:
    """The z-test p-value behind the margin rule (σ = 0.0013)."""
    return float(sps.norm.cdf(-margin / TRACK3_SIGMA))


def track3_required_n(mean: float, target: float = TARGET_LOSS) -> int | None:
    """Runs needed for the margin rule at this mean; None when the mean is not below target."""
    gap = target - mean
    if gap <= 0:
        return None
    return math.ceil(round((TRACK3_MARGIN / gap) ** 2, 6))  # round: 3.28 − 3.279 is not exactly 0.001


@dataclass(frozen=True)
class StepRow:
    step: int
    losses: tuple[float, ...]
    mean: float
    margin: float
    passes: bool


def track3_step_table(losses_by_step: dict[int, list[float]]) -> list[StepRow]:
    """The margin at every step (callers pass only steps every run shares), in step order."""
    rows = []
    for step in sorted(losses_by_step):
        losses = losses_by_step[step]
        mean = float(np.mean(losses))
        margin = track3_margin(mean, len(losses))
        rows.append(StepRow(step, tuple(losses), mean, margin, track3_passes(margin)))
    return rows


def first_passing_step(rows: list[StepRow]) -> int | None:
    return next((row.step for row in rows if row.passes), None)


@dataclass(frozen=True)
class Pairwise:
    value: float  # (loss diff + step-based diff) / √(1/n1 + 1/n2)
    passes: bool
    z_p: float


def track3_pairwise(old_mean: float, old_n: int, old_steps: int, new_mean: float, new_n: int, new_steps: int) -> Pairwise:
    """Track 3 README "pairwise statistical significance" of a new result against an old one."""
    loss_diff = old_mean - new_mean
    step_diff = (old_steps - new_steps) / 100 * TRACK3_LOSS_PER_100_STEPS
    value = (loss_diff + step_diff) / math.sqrt(1 / old_n + 1 / new_n)
    return Pairwise(value, value >= TRACK3_MARGIN - _EPS, track3_z_p(value))
