"""JSON and one-screen text forms of a parsed `Run` (the `parse` subcommand)."""

from __future__ import annotations

from dataclasses import asdict
from typing import Any

from .runs import Run, ValPoint


def _point(point: ValPoint) -> dict[str, Any]:
    data = asdict(point)
    data["extras"] = dict(point.extras)
    return data


def run_to_json(run: Run, include_source: bool = True) -> dict[str, Any]:
    env = asdict(run.env)
    env["gpu_count"] = run.env.gpu_count
    env["hardware"] = run.env.hardware
    return {
        "path": str(run.path),
        "file_sha256": run.file_sha256,
        "trial": run.trial,
        "trial_count": run.trial_count,
        "label": run.label,
        "era": run.era,
        "code_hash": run.code_hash,
        "source_files": {name: len(text.splitlines()) for name, text in run.sources.items()},
        "sources": run.sources if include_source else None,
        "environment": env,
        "val_points": [_point(p) for p in run.val_points],
        "train_points": [asdict(p) for p in run.train_points],
        "final": _point(run.final) if run.final else None,
        "status": run.status,
        "complete": run.complete,
        "track": run.track,
        "track_reason": run.track_reason,
        "inconsistencies": run.inconsistencies,
        "lost_val_lines": run.lost_val_lines,
        "fixed_stop": {"step": run.fixed_stop[0], "fixed_by": run.fixed_stop[1]} if run.fixed_stop else None,
        "total_steps": run.total_steps,
        "peak_memory": asdict(run.peak_memory) if run.peak_memory else None,
        "warmup_time_s": run.warmup_time_s,
        "notes": run.notes,
    }


def run_to_text(run: Run) -> str:
    env = run.env
    final = run.final
    lines = [
        f"{run.label}  [{run.era}]  {run.status}",
        f"  track: {run.track if run.track is not None else 'unknown'} ({run.track_reason})",
        f"  code: {run.code_hash[:12] if run.code_hash else 'none embedded'}"
        + (f"  files: {', '.join(n if n != '__script__' else 'script' for n in run.sources)}" if run.sources else ""),
        f"  env: python {_short(env.python)}  torch {env.torch or '?'}  cuda {env.cuda or '?'}  triton {env.triton or '?'}"
        f"  hardware {env.hardware or '?'}",
        f"  val points: {len(run.val_points)}  train points: {len(run.train_points)}",
    ]
    if final is not None:
        time = f"{final.train_time_s:.3f} s" if final.train_time_s is not None else "no time"
        avg = f"  step_avg {final.step_avg_ms:.2f} ms" if final.step_avg_ms is not None else ""
        total = f"/{final.total_steps}" if final.total_steps else ""
        lines.append(f"  final: step {final.step}{total}  val_loss {final.val_loss}  train_time {time}{avg}")
    if run.peak_memory is not None:
        reserved = f", reserved {run.peak_memory.reserved_mib} MiB" if run.peak_memory.reserved_mib is not None else ""
        lines.append(f"  peak memory: allocated {run.peak_memory.allocated_mib} MiB{reserved}")
    if run.warmup_time_s is not None:
        lines.append(f"  warmup_time: {run.warmup_time_s} s")
    lines += [f"  note: {note}" for note in run.notes]
    return "\n".join(lines)


def _short(version: str | None) -> str:
    return version.split()[0] if version else "?"
