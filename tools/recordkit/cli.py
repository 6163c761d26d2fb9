"""Command line of `python tools/records.py`: argparse front end over the recordkit library."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any, Callable

from .errors import RecordsError
from .parse import find_logs, parse_log
from .report import render_stats_text, render_statistics_md, track_report
from .runsets import load_runset
from .serialize import run_to_json, run_to_text

REPO_ROOT = Path(__file__).resolve().parents[2]


def _add_selection_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--allow-incomplete", action="store_true", help="include truncated runs (last val before the last step)")
    parser.add_argument("--allow-mixed", action="store_true", help="accept runs whose code hash, step count or GPU count differ")


def _track(parser: argparse.ArgumentParser, required: bool) -> None:
    parser.add_argument("--track", type=int, choices=(1, 2, 3), required=required, help="1/2: t-test vs the target; 3: margin rule")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="records", description="Parse speedrun logs, compute record statistics, manage records/.")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    p = sub.add_parser("parse", help="one structured run per log (multi-trial logs split)")
    p.add_argument("logs", nargs="+", type=Path, metavar="LOG|DIR")
    p.add_argument("--json", action="store_true", help="print a JSON list (with the embedded sources)")
    p.add_argument("--no-source", action="store_true", help="leave source text out of the JSON")
    p.set_defaults(handler=cmd_parse)

    p = sub.add_parser("stats", help="n, mean/sd/min/max, and the track's significance rule")
    p.add_argument("logs", nargs="+", type=Path, metavar="LOG|DIR")
    _track(p, required=True)
    p.add_argument("--step", type=int, help="use the val loss at this step (default: final; Track 3: first passing step)")
    p.add_argument("--json", action="store_true", help="print the statistics as a JSON object")
    p.add_argument("--md", type=Path, metavar="FILE", help="statistics.md path (default: statistics.md in the folder given, if one)")
    p.add_argument("--title", default=None, help="title of statistics.md")
    _add_selection_flags(p)
    p.set_defaults(handler=cmd_stats)
    return parser


def cmd_parse(args: argparse.Namespace) -> int:
    runs = [run for log in find_logs(args.logs) for run in parse_log(log)]
    if args.json:
        print(json.dumps([run_to_json(r, include_source=not args.no_source) for r in runs], indent=1))
    else:
        print("\n".join(run_to_text(r) for r in runs))
    return 0


def cmd_stats(args: argparse.Namespace) -> int:
    runset = load_runset(args.logs, allow_incomplete=args.allow_incomplete, allow_mixed=args.allow_mixed)
    report = track_report(runset, args.track, args.step)
    md_path = args.md
    if md_path is None and len(args.logs) == 1 and args.logs[0].is_dir():
        md_path = args.logs[0] / "statistics.md"
    if md_path is not None:
        title = args.title or (args.logs[0].resolve().name if args.logs[0].is_dir() else "runs")
        _write_new_or_same(md_path, render_statistics_md(report, title))
    if args.json:
        print(json.dumps(report, indent=1, ensure_ascii=False))
    else:
        print(render_stats_text(report))
        if md_path is not None:
            print(f"wrote {md_path}")
    return 0


def _write_new_or_same(path: Path, text: str) -> None:
    """Write a generated file; an existing one is replaced only if it is generated too (same title line)."""
    if path.exists():
        old = path.read_text()
        if old == text:
            return
        if old.splitlines()[:1] != text.splitlines()[:1]:
            raise RecordsError(f"{path}: exists and was not written by this tool; move it away or pass --md OTHER_FILE")
    path.write_text(text)


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    handler: Callable[[argparse.Namespace], int] = args.handler
    try:
        return handler(args)
    except RecordsError as exc:
        print(f"records: error: {exc}", file=sys.stderr)
        return 2


def run_cli(argv: list[str] | None = None) -> Any:
    return main(argv)
