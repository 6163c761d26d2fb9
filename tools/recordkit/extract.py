"""`extract`: write the script embedded in a log (and the files appended after it) back to disk.

The extra files land next to the script at their logged relative paths, e.g.
`distributed_shampoo/shampoo.py` beside `train_gpt_shampoo.py`, so the extracted script runs as is.
"""

from __future__ import annotations

from pathlib import Path, PurePosixPath

from .errors import RecordsError
from .parse import parse_log


def extraction_plan(log: Path, output: Path) -> dict[Path, str]:
    runs = parse_log(log)
    sources = runs[0].sources
    if not sources:
        raise RecordsError(f"{log}: no embedded source (a console capture or an llm.c log?); extract from the run's log file instead")
    plan: dict[Path, str] = {}
    for name, text in sources.items():
        if name == "__script__":
            plan[output] = text
            continue
        relative = PurePosixPath(name)
        if relative.is_absolute() or ".." in relative.parts:
            raise RecordsError(f"{log}: embedded file name {name!r} points outside the output folder; not extracted")
        plan[output.parent / Path(*relative.parts)] = text
    return plan


def extract_sources(log: Path, output: Path) -> list[Path]:
    """Write every embedded file; refuse before writing anything if one of them already exists."""
    plan = extraction_plan(log, output)
    existing = [path for path in plan if path.exists()]
    if existing:
        raise RecordsError(f"{existing[0]}: already exists; extract into an empty folder (nothing was written)")
    for path, text in plan.items():
        path.parent.mkdir(parents=True, exist_ok=True)
        with path.open("x", encoding="utf-8") as handle:
            handle.write(text)
    return list(plan)
