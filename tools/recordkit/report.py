"""Per-track statistics of a run set, as a JSON-ready dict and as statistics.md."""

from __future__ import annotations

from typing import Any

from . import stats
from .errors import RecordsError
from .runs import RECORD_VAL_TOKENS
from .runsets import RunFacts, RunSet, validation_problems


def track_report(runset: RunSet, track: int, step: int | None = None) -> dict[str, Any]:
    """The statistics of the track's rule over the run set, and the verdict with its reason."""
    if track not in stats.TARGETS:
        raise RecordsError(f"--track {track}: unknown track; use 1, 2 or 3")
    runs = runset.runs
    if not runs:
        raise RecordsError("no usable run in this configuration; see the notes for why each was left out")
    if track == 3:
        report = _track3_report(runs, step, runset.notes)
    else:
        report = _ttest_report(runs, track, step, runset.notes)
    report["configuration"] = runset.description
    problems = validation_problems(runs)
    if problems:  # the target is a loss on FineWeb's validation tokens: on another set the rule says nothing
        report["rule_not_applied"] = problems[0] + (f" (+{len(problems) - 1} other set(s))" if len(problems) > 1 else "")
        report["passes"] = None
    report["verdict"] = verdict_reason(report)
    return report


def rule_text(report: dict[str, Any]) -> str:
    """`passes`, `does not pass`, or `rule not applied` (a validation set other than the records')."""
    if report["passes"] is None:
        return "rule not applied"
    return "passes" if report["passes"] else "does not pass"


def verdict_reason(report: dict[str, Any]) -> str:
    """Why the rule passes or not, and what would change that."""
    n, mean = report["n"], report["val_loss"]["mean"]
    if report.get("rule_not_applied"):
        return (f"{report['rule_not_applied']}; the {report['target']} target is a loss on FineWeb's first "
                f"{RECORD_VAL_TOKENS:,} validation tokens, so these losses cannot be judged by it")
    if report["track"] == 3:
        where = f"at step {report['step']} with n = {n}"
        if report["passes"]:
            return f"(3.28 − mean)·√n = {report['margin']:.5f} ≥ 0.004 {where}"
        needed = report["required_n"]
        if needed is None:
            return f"mean {mean:.5f} {where} is not below 3.28: no number of runs can pass; the mean must go down"
        return (f"(3.28 − mean)·√n = {report['margin']:.5f} < 0.004 {where}; "
                f"about {needed - n} more run{'s' if needed - n != 1 else ''} at this mean would pass (n = {needed})")
    target, p = report["target"], report["p_value"]
    if p is None:
        return f"p {report['p_undefined']}; the rule needs at least 2 runs whose losses differ"
    if report["passes"]:
        return f"p = {format_p(p)} < 0.01 with n = {n}"
    head = f"p = {format_p(p)} ≥ 0.01 with n = {n}"
    if mean >= target:
        return f"{head}; the mean {mean:.5f} is not below {target}: more runs cannot pass, the mean must go down"
    needed = stats.runs_needed_for_ttest(mean, report["val_loss"]["std"], target)
    more = (f"about {needed - n} more run{'s' if needed - n != 1 else ''} at this spread would reach p < 0.01"
            if needed is not None else "more than 100,000 runs at this spread would be needed")
    return f"{head}; the rule needs more runs or a lower mean; {more}"


def _losses_at(runs: list[RunFacts], step: int | None) -> list[float]:
    missing = [r.label for r in runs if r.loss_at(step) is None]
    if missing:
        raise RecordsError(f"step {step}: no val line in {', '.join(missing)}; pick a step all runs validated at")
    return [r.loss_at(step) for r in runs]  # type: ignore[misc]


def _times_at(runs: list[RunFacts], step: int | None) -> list[float] | None:
    times: list[float] = []
    for run in runs:
        if step is None or step == run.final_step:
            time = run.train_time_s
        else:
            point = run.run.val_at(step) if run.run is not None else None
            time = point.train_time_s if point is not None else None
        if time is None:
            return None
        times.append(time)
    return times


def _base(runs: list[RunFacts], track: int, step: int | None, losses: list[float], notes: list[str]) -> dict[str, Any]:
    times = _times_at(runs, step)
    time_summary = stats.summarize(times) if times else None
    return {
        "track": track,
        "target": stats.TARGETS[track],
        "n": len(runs),
        "step": step,
        "val_loss": stats.summarize(losses).as_dict(),
        "train_time_s": time_summary.as_dict() if time_summary else None,
        "runs": [
            {
                "label": r.label,
                "source": r.source,
                "val_loss": loss,
                "train_time_s": t,
                "final_step": r.final_step,
                "total_steps": r.total_steps,
                "status": r.status,
                "hardware": r.hardware,
                "code_hash": r.code_hash,
            }
            for r, loss, t in zip(runs, losses, _optional(times, len(runs)))
        ],
        "notes": list(notes),
    }


def _optional(values: list[float] | None, n: int) -> list[float | None]:
    return list(values) if values is not None else [None] * n


def _ttest_report(runs: list[RunFacts], track: int, step: int | None, notes: list[str]) -> dict[str, Any]:
    losses = _losses_at(runs, step)
    report = _base(runs, track, step, losses, notes)
    test = stats.one_sample_less(losses, stats.TARGETS[track])
    report["test"] = f"one-sided one-sample t-test, H1: mean < {stats.TARGETS[track]}"
    report["t_statistic"] = test.statistic
    report["df"] = test.df
    report["p_value"] = test.p
    if test.p is None:
        report["p_undefined"] = test.reason
        report["notes"].append(f"p-value {test.reason}")
    report["passes"] = test.p is not None and test.p < stats.TRACK1_P_THRESHOLD
    return report


def shared_steps(runs: list[RunFacts]) -> list[int]:
    common = set(runs[0].val_losses)
    for run in runs[1:]:
        common &= set(run.val_losses)
    return sorted(common)


def _track3_report(runs: list[RunFacts], step: int | None, notes: list[str]) -> dict[str, Any]:
    steps = [s for s in shared_steps(runs) if s > 0]  # no claim is made at initialization
    if not steps:
        raise RecordsError("no val step is shared by all runs; check that the logs belong to one configuration")
    table = stats.track3_step_table({s: [r.val_losses[s] for r in runs] for s in steps})
    first = stats.first_passing_step(table)
    claim = step if step is not None else (first if first is not None else steps[-1])
    losses = _losses_at(runs, claim)
    report = _base(runs, 3, claim, losses, notes)
    mean = report["val_loss"]["mean"]
    margin = stats.track3_margin(mean, len(runs))
    test = stats.one_sample_less(losses)
    report.update(
        {
            "test": "(3.28 − mean)·√n ≥ 0.004 (one-sided z-test, σ = 0.0013, p < 0.001)",
            "margin": margin,
            "z_p_value": stats.track3_z_p(margin),
            "required_n": stats.track3_required_n(mean),
            "p_value": test.p,  # the t-test p, printed alongside as claim scripts do
            "first_passing_step": first,
            "passes": stats.track3_passes(margin),
            "steps": [{"step": r.step, "mean": r.mean, "margin": r.margin, "passes": r.passes} for r in table],
        }
    )
    return report


# ----- statistics.md -----


def _fmt(value: float | None, digits: int) -> str:
    return "—" if value is None else f"{value:.{digits}f}"


def format_p(p: float | None) -> str:
    if p is None:
        return "undefined"
    return f"{p:.4f}" if p >= 1e-4 else f"{p:.2e}"


def render_statistics_md(report: dict[str, Any], title: str) -> str:
    track = report["track"]
    loss, time = report["val_loss"], report["train_time_s"]
    step_text = "final val line" if report["step"] is None else f"step {report['step']}"
    lines = [
        f"# Statistics: {title}",
        "",
        f"Track {track}, n = {report['n']}, {report.get('metric', 'val loss')} at the {step_text}. "
        "Generated by `python tools/records.py stats`.",
        "",
        f"Configuration: {report['configuration']}.",
        "",
        "| run | val loss | train time (s) at that step | last val step | status |",
        "|---|---|---|---|---|",
    ]
    for run in report["runs"]:
        steps = f"{run['final_step']}/{run['total_steps']}" if run["total_steps"] else str(run["final_step"] or "—")
        lines.append(f"| {run['label']} | {run['val_loss']:.5f} | {_fmt(run['train_time_s'], 3)} | {steps} | {run['status']} |")
    lines += [
        "",
        "| quantity | mean | sd | min | max |",
        "|---|---|---|---|---|",
        f"| val loss | {loss['mean']:.5f} | {_fmt(loss['std'], 5)} | {loss['min']:.5f} | {loss['max']:.5f} |",
    ]
    if time:
        lines.append(f"| train time (s) | {time['mean']:.3f} | {_fmt(time['std'], 3)} | {time['min']:.3f} | {time['max']:.3f} |")
    lines.append("")
    if track == 3:
        lines += _track3_md(report)
    else:
        t = _fmt(report["t_statistic"], 3)
        lines.append(
            f"One-sided p (H1: mean < {report['target']}): **{format_p(report['p_value'])}** (t = {t}, df = {_fmt(report['df'], 0)}); "
            f"the rule needs p < 0.01: **{rule_text(report)}** ({report['verdict']})."
        )
    lines += ["", "Raw values:", "", "```", f"losses = {[r['val_loss'] for r in report['runs']]}"]
    if time:
        lines.append(f"times = {[round(r['train_time_s'], 3) for r in report['runs']]}")
    lines.append("```")
    if report["notes"]:
        lines += ["", "Notes:", ""] + [f"- {note}" for note in report["notes"]]
    return "\n".join(lines) + "\n"


def _track3_md(report: dict[str, Any]) -> list[str]:
    lines = ["| step | mean val loss | (3.28 − mean)·√n | passes |", "|---|---|---|---|"]
    for row in report["steps"]:
        lines.append(f"| {row['step']} | {row['mean']:.5f} | {row['margin']:.5f} | {'✓' if row['passes'] else '✗'} |")
    first = report["first_passing_step"]
    lines += [
        "",
        f"First step at which the rule passes over the steps all runs share: **{first if first is not None else 'none'}**.",
        f"At step {report['step']}: margin {report['margin']:.5f} (needs ≥ 0.004), z-test p {format_p(report['z_p_value'])}, "
        f"runs needed at this mean: {report['required_n'] if report['required_n'] is not None else 'never (mean ≥ 3.28)'}; "
        f"t-test p {format_p(report['p_value'])}: **{rule_text(report)}** ({report['verdict']}).",
    ]
    return lines


def render_stats_text(report: dict[str, Any]) -> str:
    """The console form of `stats`: a short summary, then the notes."""
    loss, time = report["val_loss"], report["train_time_s"]
    step = "final" if report["step"] is None else f"step {report['step']}"
    out = [f"configuration: {report['configuration']}",
           f"track {report['track']}  n={report['n']}  {report.get('metric', 'val loss')} at {step}"]
    for run in report["runs"]:
        out.append(f"  {run['label']:<48} val_loss {run['val_loss']:.5f}  time {_fmt(run['train_time_s'], 3)} s  {run['status']}")
    out.append(f"val_loss     mean {loss['mean']:.5f}  sd {_fmt(loss['std'], 5)}  min {loss['min']:.5f}  max {loss['max']:.5f}")
    if time:
        out.append(f"train_time_s mean {time['mean']:.3f}  sd {_fmt(time['std'], 3)}  min {time['min']:.3f}  max {time['max']:.3f}")
    if report["track"] == 3:
        first = report["first_passing_step"]
        out.append(f"margin (3.28 − mean)·√n = {report['margin']:.5f} (needs ≥ 0.004)  z p = {format_p(report['z_p_value'])}")
        out.append(f"claim step: {report['step']} (first passing step over shared steps: {first if first is not None else 'none'})")
    else:
        out.append(f"one-sided t-test H1 mean < {report['target']}: t = {_fmt(report['t_statistic'], 3)}  p = {format_p(report['p_value'])}")
    if report["passes"] is None:
        out.append(f"rule not applied: {report['verdict']}")
    else:
        out.append(f"passes: {'yes' if report['passes'] else 'no'} ({report['verdict']})")
    out += [f"note: {note}" for note in report["notes"]]
    return "\n".join(out)
