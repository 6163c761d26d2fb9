"""Command line of `python tools/records.py`: argparse front end over the recordkit library."""

from __future__ import annotations

import argparse
import datetime as dt
import json
import sys
from pathlib import Path
from typing import Callable

from . import check, compare, diff, extract, folders, tables
from .errors import RecordsError
from .parse import find_logs, parse_log
from .report import render_stats_text, render_statistics_md, track_report
from .runsets import RESULTS_JSON, RunSet, load_runset
from .serialize import run_to_json, run_to_text

REPO_ROOT = Path(__file__).resolve().parents[2]


def _add_selection_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--allow-incomplete", action="store_true", help="include truncated runs (last val before the last step)")
    parser.add_argument("--allow-mixed", action="store_true", help="accept runs whose code hash, step count, GPU count or logged hyperparameters differ")


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
    p.add_argument("--metric", default="val_loss", help="val-line column to use, e.g. val_ema_loss (default: val_loss)")
    p.add_argument("--json", action="store_true", help="print the statistics as a JSON object")
    p.add_argument("--md", type=Path, metavar="FILE", help="statistics.md path (default: statistics.md in the folder given, if one)")
    p.add_argument("--title", default=None, help="title of statistics.md")
    _add_selection_flags(p)
    p.set_defaults(handler=cmd_stats)

    p = sub.add_parser("compare", help="candidate vs baseline: time (Welch, paired), loss, matched steps, Track 3 pairwise rule")
    p.add_argument("--baseline", nargs="+", type=Path, required=True, metavar="LOG|DIR", help="logs, a folder of logs, or a record folder")
    p.add_argument("--candidate", nargs="+", type=Path, required=True, metavar="LOG|DIR")
    p.add_argument("--track", type=int, choices=(1, 2, 3), help="default: 3 for logs timed in seconds, else 1")
    p.add_argument("--paired", action="store_true", help="runs were interleaved: pair the i-th baseline with the i-th candidate (pass files in run order)")
    p.add_argument("--json", action="store_true")
    _add_selection_flags(p)
    p.set_defaults(handler=cmd_compare)

    p = sub.add_parser("diff", help="new runs against the prior record: code, Hyperparameters, environment, losses, timing")
    p.add_argument("logs", nargs="+", type=Path, metavar="NEW_LOG")
    p.add_argument("--against", default="auto", metavar="RECORD_DIR|LOG|auto", help="auto: the newest record folder of the track")
    p.add_argument("--track", type=int, choices=(1, 2, 3), help="track for --against auto (default: 3 for logs timed in seconds, else 1)")
    p.add_argument("--plot", type=Path, metavar="OUT.png", help="overlay the val-loss curves in a PNG")
    _add_selection_flags(p)
    p.set_defaults(handler=cmd_diff)

    p = sub.add_parser("new", help="create a record folder from logs (never overwrites anything)")
    _track(p, required=True)
    p.add_argument("--name", required=True, help="Track 1: CamelCase; Track 3: snake_case")
    p.add_argument("--logs", nargs="+", type=Path, required=True, metavar="LOG|DIR")
    p.add_argument("--date", type=_date, help="YYYY-MM-DD (default: today, UTC)")
    p.add_argument("--hardware", help="describe the machine (default: from the logs' environment)")
    p.add_argument("--note", help="one line saying what these runs are (e.g. 'CPU smoke run, not a record')")
    _add_selection_flags(p)
    p.set_defaults(handler=cmd_new)

    p = sub.add_parser("extract", help="write the script(s) embedded in a log, ready to rerun")
    p.add_argument("log", type=Path)
    p.add_argument("-o", "--output", type=Path, required=True, metavar="FILE", help="path of the script; appended files go next to it")
    p.set_defaults(handler=cmd_extract)

    p = sub.add_parser("check", help="lint record folders, results.json against logs, README tables against folders")
    p.set_defaults(handler=cmd_check)

    p = sub.add_parser("tables", help="print (or --write into marked READMEs) the record tables")
    p.add_argument("--write", action="store_true", help="update every README.md that holds records:* markers")
    p.add_argument("--block", choices=tables.BLOCKS, help="print only this table")
    p.set_defaults(handler=cmd_tables)

    parser.add_argument("--root", type=Path, default=REPO_ROOT, help="repository root holding records/ (default: this checkout)")
    return parser


def _date(text: str) -> dt.date:
    try:
        return dt.date.fromisoformat(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a date; use YYYY-MM-DD") from None


def _records_root(args: argparse.Namespace) -> Path:
    return Path(args.root) / "records"


def cmd_parse(args: argparse.Namespace) -> int:
    runs = [run for log in find_logs(args.logs) for run in parse_log(log)]
    if args.json:
        print(json.dumps([run_to_json(r, include_source=not args.no_source) for r in runs], indent=1))
    else:
        print("\n".join(run_to_text(r) for r in runs))
    return 0


def cmd_stats(args: argparse.Namespace) -> int:
    runset = load_runset(args.logs, allow_incomplete=args.allow_incomplete, allow_mixed=args.allow_mixed, metric=args.metric)
    report = track_report(runset, args.track, args.step)
    if args.metric != "val_loss":
        report["metric"] = args.metric
    md_path = args.md
    folder = args.logs[0] if len(args.logs) == 1 and args.logs[0].is_dir() else None
    if md_path is None and folder is not None and not (folder / RESULTS_JSON).is_file():
        md_path = folder / "statistics.md"  # a record folder's statistics.md belongs to `new` and `check`
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


def _load_side(paths: list[Path], args: argparse.Namespace) -> RunSet:
    if len(paths) == 1 and (paths[0] / RESULTS_JSON).is_file():
        return folders.load_folder_runset(paths[0], args.allow_incomplete, args.allow_mixed)
    return load_runset(paths, allow_incomplete=args.allow_incomplete, allow_mixed=args.allow_mixed)


def _infer_track(runset: RunSet) -> int:
    """Track 3 logs time in seconds (era `track3`); everything else is read as Track 1."""
    return 3 if any(r.run is not None and r.run.era.endswith("track3") for r in runset.runs) else 1


def cmd_compare(args: argparse.Namespace) -> int:
    baseline, candidate = _load_side(args.baseline, args), _load_side(args.candidate, args)
    track = args.track or _infer_track(candidate)
    result = compare.compare_runsets(baseline, candidate, track, paired=args.paired)
    print(json.dumps(result, indent=1, ensure_ascii=False) if args.json else compare.render_compare_text(result))
    return 0


def cmd_diff(args: argparse.Namespace) -> int:
    new = diff.side_from_logs("new", args.logs, args.allow_incomplete, args.allow_mixed)
    track = args.track or _infer_track(new.runset)
    against = diff.resolve_against(_records_root(args), track, args.against)
    old = diff.load_against(against, args.allow_incomplete, args.allow_mixed)
    print(diff.render_diff(old, new))
    if args.plot is not None:
        if args.plot.exists():
            raise RecordsError(f"{args.plot}: already exists; pass another --plot path")
        diff.plot_val_curves(old, new, args.plot)
        print(f"wrote {args.plot}")
    return 0


def cmd_new(args: argparse.Namespace) -> int:
    records_root = _records_root(args)
    folder = folders.create_record(records_root, args.track, args.name, args.logs, date=args.date, hardware=args.hardware,
                                   note=args.note, allow_incomplete=args.allow_incomplete, allow_mixed=args.allow_mixed)
    print(f"created {folder}")
    for path in sorted(folder.iterdir()):
        print(f"  {path.name}")
    for readme in tables.write_tables(args.root, records_root):
        print(f"updated tables in {readme}")
    return 0


def cmd_extract(args: argparse.Namespace) -> int:
    for path in extract.extract_sources(args.log, args.output):
        print(f"wrote {path}")
    return 0


def cmd_check(args: argparse.Namespace) -> int:
    problems = check.check_all(args.root, _records_root(args))
    for problem in problems:
        print(problem)
    counted = sum(len(folders.list_folders(_records_root(args), t)) for t in folders.TRACK_DIRS)
    readmes = len(tables.find_marked_readmes(args.root))
    print(f"check: {counted} record folder(s), {readmes} README(s) with tables: "
          + (f"{len(problems)} problem(s)" if problems else "ok"))
    return 1 if problems else 0


def cmd_tables(args: argparse.Namespace) -> int:
    records_root = _records_root(args)
    if args.write:
        changed = tables.write_tables(args.root, records_root)
        for readme in changed:
            print(f"updated {readme}")
        if not tables.find_marked_readmes(args.root):
            raise RecordsError(f"{args.root}: no README.md holds records:* markers; add e.g. {tables.start_marker('track1')} / {tables.end_marker('track1')}")
        if not changed:
            print("tables already up to date")
        return 0
    for block in [args.block] if args.block else list(tables.BLOCKS):
        print(tables.render_block(block, records_root, readme_dir=records_root))  # links as seen from records/
        print()
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

