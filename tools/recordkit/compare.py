"""`compare`: a candidate run set against a baseline run set timed on the same hardware.

Time claims compare the mean final train_time of both arms, measured on one machine (providers differ by
most of a second), with a one-sided Welch test, or a paired test when the runs were interleaved; losses
are compared at the final step and at every step both arms validated at; Track 3 adds the pairwise rule.
"""

from __future__ import annotations

from typing import Any

from . import stats
from .errors import RecordsError
from .report import format_p, shared_steps, track_report
from .runsets import RunFacts, RunSet, losses_not_comparable, refuse_shared_logs


def _times(runs: list[RunFacts]) -> list[float] | None:
    times = [r.train_time_s for r in runs]
    return None if any(t is None for t in times) else times  # type: ignore[return-value]


def _test_dict(test: stats.TTest) -> dict[str, Any]:
    return {"statistic": test.statistic, "df": test.df, "p_value": test.p, "undefined": test.reason}


def compare_runsets(baseline: RunSet, candidate: RunSet, track: int, paired: bool = False) -> dict[str, Any]:
    for side, runset in (("baseline", baseline), ("candidate", candidate)):
        if not runset.runs:
            raise RecordsError(f"{side} ({runset.description}): no usable run ({'; '.join(runset.notes) or 'none given'})")
    refuse_shared_logs(candidate, baseline, "in both --baseline and --candidate",
                       "a comparison needs other runs on each side: pass the baseline's logs and the candidate's")
    result: dict[str, Any] = {
        "track": track,
        "baseline": {"n": len(baseline.runs), "labels": [r.label for r in baseline.runs], "configuration": baseline.description},
        "candidate": {"n": len(candidate.runs), "labels": [r.label for r in candidate.runs], "configuration": candidate.description},
        "notes": baseline.notes + candidate.notes,
    }
    result["time"] = compare_times(baseline.runs, candidate.runs, paired, result["notes"])
    apart = losses_not_comparable(("candidate", candidate), ("baseline", baseline))
    if apart is None:
        result["loss"] = compare_final_losses(baseline.runs, candidate.runs, stats.TARGETS[track])
        result["matched_steps"] = loss_at_matched_steps(baseline.runs, candidate.runs)
    else:  # no difference, test or target across validation sets
        result["loss"], result["matched_steps"] = {"not_comparable": apart}, []
    result["step_avg_ms"] = _step_avg(baseline.runs, candidate.runs)
    if track == 3:
        result["track3"] = track3_pairwise(baseline, candidate)
    return result


def compare_times(base: list[RunFacts], cand: list[RunFacts], paired: bool, notes: list[str]) -> dict[str, Any] | None:
    base_times, cand_times = _times(base), _times(cand)
    if base_times is None or cand_times is None:
        notes.append("train times missing in some runs (llm.c logs or published losses only): no time comparison")
        return None
    base_mean, cand_mean = stats.mean(base_times), stats.mean(cand_times)
    out: dict[str, Any] = {
        "baseline": stats.summarize(base_times).as_dict(),
        "candidate": stats.summarize(cand_times).as_dict(),
        "delta_s": cand_mean - base_mean,
        "delta_pct": (cand_mean - base_mean) / base_mean * 100,
        "speed_ratio": base_mean / cand_mean,
        "welch_less": _test_dict(stats.welch_less(cand_times, base_times)),
        "slowest_candidate_minus_fastest_baseline_s": max(cand_times) - min(base_times),
    }
    if paired:
        if len(base_times) != len(cand_times):
            notes.append(f"--paired needs equal run counts (baseline {len(base_times)}, candidate {len(cand_times)}): no paired test")
        else:
            ratio = stats.paired_less(cand_times, base_times)
            out["paired"] = {"n": ratio.n, **_test_dict(ratio.test), "geometric_ratio": ratio.geometric_ratio, "ci95": ratio.ci95,
                             "pairs": list(zip([r.label for r in base], [r.label for r in cand]))}
    return out


def compare_final_losses(base: list[RunFacts], cand: list[RunFacts], target: float = stats.TARGET_LOSS) -> dict[str, Any]:
    base_losses, cand_losses = [r.val_loss for r in base], [r.val_loss for r in cand]
    return {
        "baseline": stats.summarize(base_losses).as_dict(),
        "candidate": stats.summarize(cand_losses).as_dict(),
        "delta": stats.mean(cand_losses) - stats.mean(base_losses),
        "welch_two_sided": _test_dict(stats.welch_two_sided(cand_losses, base_losses)),
        "target": target,
        "baseline_p_below_target": stats.one_sample_less(base_losses, target).p,
        "candidate_p_below_target": stats.one_sample_less(cand_losses, target).p,
    }


def loss_at_matched_steps(base: list[RunFacts], cand: list[RunFacts]) -> list[dict[str, float]]:
    rows = []
    for step in shared_steps(base + cand):
        b = stats.mean([r.val_losses[step] for r in base])
        c = stats.mean([r.val_losses[step] for r in cand])
        rows.append({"step": step, "baseline": b, "candidate": c, "delta": c - b})
    return rows


def _step_avg(base: list[RunFacts], cand: list[RunFacts]) -> dict[str, float] | None:
    b = [r.step_avg_ms for r in base]
    c = [r.step_avg_ms for r in cand]
    if any(v is None for v in b + c):
        return None
    return {"baseline": stats.mean(b), "candidate": stats.mean(c), "delta": stats.mean(c) - stats.mean(b)}  # type: ignore[arg-type]


def track3_pairwise(baseline: RunSet, candidate: RunSet) -> dict[str, Any]:
    """Each arm at its own claim step (first passing step), then the Track 3 pairwise rule; no verdict (value and passes
    None, `not_comparable` saying why) when the arms' losses are on different validation sets."""
    old, new = track_report(baseline, 3), track_report(candidate, 3)
    result: dict[str, Any] = {
        "baseline": {"step": old["step"], "mean": old["val_loss"]["mean"], "n": old["n"], "passes": old["passes"]},
        "candidate": {"step": new["step"], "mean": new["val_loss"]["mean"], "n": new["n"], "passes": new["passes"]},
    }
    apart = losses_not_comparable(("candidate", candidate), ("baseline", baseline))
    if apart is not None:
        return {**result, "value": None, "passes": None, "z_p_value": None, "not_comparable": apart}
    pair = stats.track3_pairwise(old["val_loss"]["mean"], old["n"], old["step"], new["val_loss"]["mean"], new["n"], new["step"])
    return {**result, "value": pair.value, "passes": pair.passes, "z_p_value": pair.z_p}


def render_compare_text(result: dict[str, Any]) -> str:
    out = [f"baseline: {result['baseline']['configuration']}", f"candidate: {result['candidate']['configuration']}",
           f"track {result['track']}: baseline n={result['baseline']['n']}, candidate n={result['candidate']['n']}"]
    time = result["time"]
    if time is not None:
        out += [
            f"time  baseline {time['baseline']['mean']:.3f} s  candidate {time['candidate']['mean']:.3f} s  "
            f"delta {time['delta_s']:+.3f} s ({time['delta_pct']:+.2f}%)  speed ratio {time['speed_ratio']:.4f}x",
            f"      one-sided Welch (H1: candidate faster): t = {_num(time['welch_less']['statistic'])}  "
            f"df = {_num(time['welch_less']['df'], 1)}  p = {format_p(time['welch_less']['p_value'])}",
            f"      slowest candidate - fastest baseline: {time['slowest_candidate_minus_fastest_baseline_s']:+.3f} s",
        ]
        if "paired" in time:
            pair = time["paired"]
            ci = f"[{pair['ci95'][0]:.4f}, {pair['ci95'][1]:.4f}]" if pair["ci95"] else "undefined"
            out.append(f"      paired (n={pair['n']}): geometric ratio {pair['geometric_ratio']:.4f}  95% CI {ci}  one-sided p = {format_p(pair['p_value'])}")
    loss = result["loss"]
    if "not_comparable" in loss:
        out.append(f"loss  not compared: {loss['not_comparable']}")
    else:
        out.append(
            f"loss  baseline {loss['baseline']['mean']:.5f}  candidate {loss['candidate']['mean']:.5f}  delta {loss['delta']:+.5f}  "
            f"two-sided Welch p = {format_p(loss['welch_two_sided']['p_value'])}  "
            f"p(mean<{loss['target']}): baseline {format_p(loss['baseline_p_below_target'])}, candidate {format_p(loss['candidate_p_below_target'])}"
        )
    if result["step_avg_ms"]:
        s = result["step_avg_ms"]
        out.append(f"step_avg  baseline {s['baseline']:.2f} ms  candidate {s['candidate']:.2f} ms  delta {s['delta']:+.2f} ms")
    if result["matched_steps"]:
        out.append("val loss at matched steps (mean): step  baseline  candidate  delta")
        out += [f"  {r['step']:>6}  {r['baseline']:.5f}  {r['candidate']:.5f}  {r['delta']:+.5f}" for r in result["matched_steps"]]
    if "track3" in result and result["track3"].get("not_comparable"):
        out.append(f"track 3 pairwise: not computed: {result['track3']['not_comparable']}")
    elif "track3" in result:
        t3 = result["track3"]
        out.append(
            f"track 3 pairwise: baseline {t3['baseline']['mean']:.5f} @ {t3['baseline']['step']} (n={t3['baseline']['n']}), "
            f"candidate {t3['candidate']['mean']:.5f} @ {t3['candidate']['step']} (n={t3['candidate']['n']}): "
            f"value {t3['value']:.5f} (needs >= 0.004) -> {'significant' if t3['passes'] else 'not significant'}, z p = {format_p(t3['z_p_value'])}"
        )
    out += [f"note: {note}" for note in result["notes"]]
    return "\n".join(out)


def _num(value: float | None, digits: int = 3) -> str:
    return "undefined" if value is None else f"{value:.{digits}f}"
