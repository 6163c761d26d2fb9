"""`diff`: new runs against a prior record: code, hyperparameters, environment, losses, timing.

These are what a submission is judged on: the code (every log embeds its script, so a prior record's
code comes from its logs), the changed constants, the software and GPUs (a new stack alone can move the
loss by a few 1e-4), the loss at equal steps, and step_avg and total time.
"""

from __future__ import annotations

import ast
import difflib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from . import stats
from .compare import loss_at_matched_steps
from .errors import RecordsError
from .folders import is_record_folder, list_folders, listed_logs, load_folder_runset, read_results
from .runs import Environment, Run
from .runsets import RunFacts, RunSet, load_runset
from .tables import load_history

ENV_FIELDS = ("python", "torch", "cuda", "triton", "driver", "hardware", "world_size", "device")
ENV_SKIP_SETTINGS = {"hyperparameters", "overrides"}


@dataclass
class Side:
    """One side of a diff: its runs and a representative parsed log (None for published figures)."""

    name: str
    runset: RunSet
    example: Run | None


def side_from_logs(name: str, paths: list[Path], allow_incomplete: bool, allow_mixed: bool) -> Side:
    runset = load_runset(paths, allow_incomplete=allow_incomplete, allow_mixed=allow_mixed)
    return Side(name, runset, _example(runset))


def side_from_folder(folder: Path) -> Side:
    runset = load_folder_runset(folder, allow_incomplete=True, allow_mixed=True)
    return Side(folder.name, runset, _example(runset))


def _example(runset: RunSet) -> Run | None:
    # Prefer a run whose log embeds its source (a console capture carries none).
    runs = [fact.run for fact in runset.runs if fact.run is not None]
    return next((run for run in runs if run.sources), runs[0] if runs else None)


def resolve_against(records_root: Path, track: int, against: str, new: Side | None = None) -> tuple[Path, str]:
    """The folder or log to diff against, and why it was chosen.

    `auto`: the newest record of the track whose logs are in the repository (a folder that a history row
    links, or that `new` filed as a record), other than the one holding the new logs; a record known only by
    its published figures has no code or hyperparameters to diff, so it is passed over.
    """
    if against != "auto":
        path = Path(against)
        if not path.exists():
            raise RecordsError(f"--against {against}: no such folder or log; pass a record folder, logs, or 'auto'")
        return path, "given with --against"
    linked = {row.folder: row.number for row in load_history(records_root, track) if row.folder}
    new_files = {fact.run.file_sha256 for fact in new.runset.runs if fact.run is not None} if new else set()
    without_logs: list[str] = []
    for folder in reversed(list_folders(records_root, track)):  # newest first
        if not is_record_folder(folder.path):
            continue
        results = read_results(folder.results_path)
        if folder.path.name not in linked and results.get("record") is not True:
            continue  # our own results (or a folder that predates the label): not a record
        if not listed_logs(folder.path, results):
            without_logs.append(folder.path.name)
            continue
        if new_files & {entry.get("sha256") for entry in results.get("runs") or []}:
            continue  # the new runs' own folder
        why = f"history row #{linked[folder.path.name]}" if folder.path.name in linked else "filed by `new` as a record"
        skipped = f"; newer records without logs here: {', '.join(without_logs)}" if without_logs else ""
        return folder.path, f"the newest Track {track} record with logs in this repository ({why}){skipped}"
    newest = f" (newest: {without_logs[0]}, published figures only)" if without_logs else ""
    raise RecordsError(f"no Track {track} record with logs in this repository to diff against{newest}; pass --against RECORD_DIR|LOG")


def load_against(path: Path, allow_incomplete: bool, allow_mixed: bool) -> Side:
    if is_record_folder(path):
        return side_from_folder(path)
    return side_from_logs(path.name, [path], allow_incomplete, allow_mixed)


# ----- sections -----


def source_diff(old: Run | None, new: Run | None, context: int = 3) -> list[str]:
    if old is None or not old.sources:
        return ["(the prior record has no log with embedded source here: no code diff)"]
    if new is None or not new.sources:
        return ["(the new log embeds no source, e.g. a console capture: no code diff)"]
    if old.code_hash == new.code_hash:
        return [f"(sources identical, code hash {new.code_hash[:12] if new.code_hash else '?'})"]
    lines: list[str] = []
    if old.program_hash == new.program_hash:
        lines.append("(same program: the code differs only in comments/docstrings; the text diff follows)")
    for name in list(dict.fromkeys([*old.sources, *new.sources])):
        label = "train script" if name == "__script__" else name
        before, after = old.sources.get(name), new.sources.get(name)
        if before == after:
            continue
        if before is None or after is None:
            lines.append(f"(file {label} only in the {'new run' if before is None else 'prior record'})")
            continue
        lines += difflib.unified_diff(before.splitlines(), after.splitlines(), f"record/{label}", f"new/{label}", n=context, lineterm="")
    return lines


def hyperparameters(run: Run | None) -> tuple[dict[str, Any], str] | None:
    """The run's hyperparameters and where they came from: our `hyperparameters:` line, else the source."""
    if run is None:
        return None
    if run.env.hyperparameters is not None:
        return run.env.hyperparameters, "log"
    script = next(iter(run.sources.values()), None)
    values = hyperparameters_from_source(script) if script else None
    return (values, "source") if values is not None else None


def hyperparameters_from_source(source: str) -> dict[str, Any] | None:
    """Field defaults of `class Hyperparameters` (literal values, else their source text)."""
    try:
        tree = ast.parse(source)
    except SyntaxError:
        return None
    for node in ast.walk(tree):
        if isinstance(node, ast.ClassDef) and node.name == "Hyperparameters":
            values: dict[str, Any] = {}
            for item in node.body:
                target = item.target if isinstance(item, ast.AnnAssign) else (item.targets[0] if isinstance(item, ast.Assign) and len(item.targets) == 1 else None)
                value = getattr(item, "value", None)
                if isinstance(target, ast.Name) and value is not None:
                    values[target.id] = _literal_or_text(value)
            return values
    return None


def _literal_or_text(node: ast.expr) -> Any:
    try:
        return ast.literal_eval(node)
    except (ValueError, SyntaxError, TypeError):
        return ast.unparse(node)


def mapping_diff(old: dict[str, Any], new: dict[str, Any]) -> list[str]:
    lines = []
    for key in sorted(set(old) | set(new)):
        if key not in old:
            lines.append(f"+ {key} = {new[key]!r}")
        elif key not in new:
            lines.append(f"- {key} = {old[key]!r}")
        elif old[key] != new[key]:
            lines.append(f"~ {key}: {old[key]!r} -> {new[key]!r}")
    return lines


def hyperparameter_diff(old: Run | None, new: Run | None) -> list[str]:
    before, after = hyperparameters(old), hyperparameters(new)
    if before is None or after is None:
        missing = "prior record" if before is None else "new run"
        return [f"(no Hyperparameters found for the {missing}: neither a `hyperparameters:` log line nor a `class Hyperparameters` in its source)"]
    lines = mapping_diff(before[0], after[0])
    origin = f"(record values from its {before[1]}, new values from its {after[1]})"
    return [origin] + (lines or ["(no differences)"])


def environment_of(env: Environment) -> dict[str, Any]:
    values = {name: getattr(env, name) for name in ENV_FIELDS}
    values.update({k: v for k, v in env.settings.items() if k not in ENV_SKIP_SETTINGS})
    return {k: v for k, v in values.items() if v is not None}


def environment_diff(old: Side, new: Side) -> list[str]:
    if old.example is None:
        hardware = sorted({f.hardware for f in old.runset.runs if f.hardware})
        mine = new.example.env.hardware if new.example else None
        return [f"(prior record: published figures only; its hardware: {', '.join(hardware) or 'unknown'}; new: {mine or 'unknown'})"]
    if new.example is None:
        return ["(no parsed log on the new side)"]
    return mapping_diff(environment_of(old.example.env), environment_of(new.example.env)) or ["(no differences)"]


def loss_table(old: list[RunFacts], new: list[RunFacts]) -> list[str]:
    rows = loss_at_matched_steps(old, new)
    if not rows:
        return ["(no val step shared by every run on both sides)"]
    return [f"{'step':>6}  {'record':>9}  {'new':>9}  {'delta':>9}"] + [
        f"{r['step']:>6}  {r['baseline']:>9.5f}  {r['candidate']:>9.5f}  {r['delta']:>+9.5f}" for r in rows
    ]


def timing_lines(old: list[RunFacts], new: list[RunFacts]) -> list[str]:
    lines = []
    steps_old = sorted({r.total_steps for r in old if r.total_steps})
    steps_new = sorted({r.total_steps for r in new if r.total_steps})
    lines.append(f"steps: record {steps_old or '?'}  new {steps_new or '?'}")
    for label, key, unit, digits in (("total train time", "train_time_s", "s", 3), ("final step_avg", "step_avg_ms", "ms", 2)):
        before = [getattr(r, key) for r in old]
        after = [getattr(r, key) for r in new]
        if any(v is None for v in before) or any(v is None for v in after):
            lines.append(f"{label}: not in every run")
            continue
        b, a = stats.mean(before), stats.mean(after)
        lines.append(f"{label}: record {b:.{digits}f} {unit}  new {a:.{digits}f} {unit}  delta {a - b:+.{digits}f} {unit} ({(a - b) / b * 100:+.2f}%)")
    lines.append("(a record's official time may come from a re-timing, not from these logs)")
    return lines


def render_diff(old: Side, new: Side) -> str:
    sections = [
        (f"new: {len(new.runset.runs)} run(s) [{', '.join(r.label for r in new.runset.runs)}]  vs record: {old.name} "
         f"({len(old.runset.runs)} run(s){', published figures' if old.example is None else ''})", []),
        ("== source diff", source_diff(old.example, new.example)),
        ("== Hyperparameters", hyperparameter_diff(old.example, new.example)),
        ("== environment", environment_diff(old, new)),
        ("== val loss at shared steps (mean over runs)", loss_table(old.runset.runs, new.runset.runs)),
        ("== timing (means over runs)", timing_lines(old.runset.runs, new.runset.runs)),
    ]
    out: list[str] = []
    for title, lines in sections:
        out.append(title)
        out += lines
    notes = old.runset.notes + new.runset.notes
    out += [f"note: {note}" for note in notes]
    return "\n".join(out)


def plot_val_curves(old: Side, new: Side, path: Path, target: float = stats.TARGET_LOSS) -> None:
    """Overlay every run's val-loss curve (record in grey, new in colour); written with the Agg backend."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 5), dpi=100)
    finals = []
    for side, color in ((old, "0.5"), (new, "tab:blue")):
        for i, fact in enumerate(side.runset.runs):
            steps = sorted(s for s in fact.val_losses if s > 0)
            if not steps:
                continue
            losses = [fact.val_losses[s] for s in steps]
            finals.append(min(losses))
            ax.plot(steps, losses, color=color, marker="." if len(steps) < 10 else None, lw=1, alpha=0.8,
                    label=f"{side.name}" if i == 0 else None)
    ax.axhline(target, color="tab:red", lw=0.8, ls="--", label=f"{target} target")
    if finals:
        ax.set_ylim(min(finals) - 0.02, min(finals) + 0.8)
    ax.set_xlabel("step")
    ax.set_ylabel("val loss")
    ax.legend()
    ax.grid(alpha=0.3)
    fig.tight_layout()
    try:
        fig.savefig(path, format="png")
    except OSError as exc:
        raise RecordsError(f"{path}: cannot write the plot ({exc.strerror}); pick a writable path") from None
    finally:
        plt.close(fig)
