"""Command line of `python tools/records.py`: argparse front end over the recordkit library."""

from __future__ import annotations

import argparse
import datetime as dt
import json
import sys
import textwrap
from pathlib import Path
from typing import Any, Callable, NoReturn

from . import check, compare, diff, extract, folders, index, newrecord, published, stats, tables
from .errors import RecordsError
from .parse import find_logs, parse_log
from .report import render_statistics_md, render_stats_text, track_report
from .runs import Run
from .runsets import LoadedLogs, RunSet, differing_parts, first_code_difference, no_run_left, pool, select_track, track_text
from .serialize import run_to_json, run_to_text

REPO_ROOT = Path(__file__).resolve().parents[2]
TOOL = "python tools/records.py"
DEFAULT_MD = Path("<folder>/statistics.md")  # the value of a bare --md
BLOCK_NAMES = {"track1": "Track 1 history", "track2": "Track 2 history", "track3": "Track 3 history", "folders": "record folders"}

DESCRIPTIONS = {
    "parse": (
        "Parse speedrun logs of any era (2024 logs, today's Track 1 and Track 3 logs, llm.c baselines, console "
        "captures, multi-trial Track 3 logs) into one run per trial: the embedded code and its hashes, the "
        "environment, the val and train lines, the final line and peak memory. Folders are searched "
        "recursively for *.txt, *.log, *.stdout and *.out; a log that cannot be used is skipped with the reason.",
        [f"{TOOL} parse logs/", f"{TOOL} parse logs/ --json --no-source > runs.json"],
    ),
    "stats": (
        "Statistics of the track's rule over the runs in the logs or folders given. Runs are grouped into "
        "configurations (track, program, GPU count, step count, logged hyperparameters; comments, docstrings "
        "and runtime-only settings such as shampoo_root_streams or log paths do not count), and each "
        "configuration gets its own block: n, mean/sd/min/max of val loss and train time, then Tracks 1/2: "
        "the one-sided t-test against the target (p < 0.01 passes), Track 3: (3.28 − mean)·√n ≥ 0.004 at the "
        "first step that passes. Diverged and truncated runs are left out with a note unless --allow-incomplete; "
        "unusable logs are listed as skipped. A record folder (one holding results.json) is read as its "
        "results.json lists it. Nothing is written unless --md is given.",
        [f"{TOOL} stats logs/", f"{TOOL} stats logs/ --track 1", f"{TOOL} stats records/track_1_short/2025-09-23_MuonCustomSizing",
         f"{TOOL} stats runs/ --track 3 --md   # writes runs/statistics.md"],
    ),
    "compare": (
        "A candidate set of runs against a baseline set timed on the same machine: mean train time with a "
        "one-sided Welch test (or a paired test of interleaved runs with --paired), the speed ratio, final "
        "losses, loss at every step both validated at, step_avg, and for Track 3 the pairwise rule (loss "
        "difference plus 0.0045 per 100 saved steps, over √(1/n₁ + 1/n₂), ≥ 0.004). Each side may be logs, "
        "folders or a record folder; a side holding several configurations gives one comparison per pair of "
        "configurations of the same track.",
        [f"{TOOL} compare --baseline runs/base/ --candidate runs/new/",
         f"{TOOL} compare --baseline b1.txt b2.txt --candidate c1.txt c2.txt --paired"],
    ),
    "diff": (
        "New runs against the prior record. The first screen is the decision: the track, steps and claim step, "
        "every changed hyperparameter, val loss at the steps both share, and time to the target with a Welch test "
        "(Tracks 1, 2) or steps to 3.28 with the pairwise rule (Track 3); then the changed lines per top-level "
        "definition (--code: the full source diff), the environment and timing detail. Without --against the "
        "prior record is the prior world record of the logs' track, fetched into the cache like `fetch` (or a "
        "newer record folder of ours with logs); the first line says which and why.",
        [f"{TOOL} diff logs/<run>.txt", f"{TOOL} diff logs/<run>.txt --code",
         f"{TOOL} diff logs/a.txt logs/b.txt --against 1:88 --plot curves.png",
         f"{TOOL} diff logs/a.txt --against /path/to/record/logs/   # offline"],
    ),
    "new": (
        "Create a record folder from the logs of one configuration: the logs copied byte for byte (checked by "
        "sha256), results.json, statistics.md and a README to complete. Logs that cannot be used, and runs "
        "that diverged or stopped early, are left out and listed in the README. A record needs hardware that "
        "can make one (Tracks 1 and 2: 8 GPUs; Track 3: a GPU); runs on fewer GPUs or the CPU are refused "
        "unless --not-a-record files the folder as our own results. Nothing is ever overwritten; the output "
        "names every README table it regenerated.",
        [f"{TOOL} new --track 1 --name MyIdea --logs logs/a.txt logs/b.txt logs/c.txt logs/d.txt",
         f"{TOOL} new --track 3 --name cpu_smoke --logs logs/<run>.txt --not-a-record --note 'CPU smoke run'"],
    ),
    "extract": (
        "Write the script embedded in a log, and every file appended after it (Triton kernels, the "
        "distributed_shampoo package), so that the run can be repeated as it was logged. Refuses before "
        "writing anything if one of the files exists, or a file stands where one of their folders goes.",
        [f"{TOOL} extract logs/<run>.txt -o /tmp/repro/train_gpt.py"],
    ),
    "fetch": (
        "Download a published record's logs into a cache (the platform's user cache folder, or --cache-dir): the files "
        "that records/published_logs.csv lists for the record, each checked (size, sha256, and that it parses as a log) "
        "and moved into place atomically; a file already in the cache is checked, never overwritten. The source is "
        f"the public repository at a fixed commit; --source-url or ${published.SOURCE_URL_ENV} points at a mirror. "
        "Offline, `diff --against LOCAL_DIR` compares with logs you have.",
        [f"{TOOL} fetch latest", f"{TOOL} fetch 1:89", f"{TOOL} fetch 3:45 --cache-dir /tmp/records-cache",
         f"{TOOL} fetch FP8DownProjection"],
    ),
    "index": (
        "Rebuild records/published_logs.csv from a local clone of the public speedrun repository (checked out at the "
        "commit recordkit/published.py names): for every history row with logs_at, the files holding the record's "
        "runs, with size and sha256. Without --write, prints what it found.",
        [f"{TOOL} index ~/src/modded-nanogpt", f"{TOOL} index ~/src/modded-nanogpt --write"],
    ),
    "check": (
        "Check records/: every folder's logs against the sha256 and figures in its results.json, its "
        "statistics.md against the runs, record folders' hardware, folder names, history.csv rows against "
        "the folders, and the README tables against both. Prints one line per problem; exit status 1 if any.",
        [f"{TOOL} check"],
    ),
    "tables": (
        "Print the record tables generated from records/*/history.csv and the record folders, or with "
        "--write regenerate them in every README.md that holds records:* marker comments (text outside the "
        "markers is left alone), naming each table that changed.",
        [f"{TOOL} tables --block track3", f"{TOOL} tables --write"],
    ),
}


def _subcommand(sub: Any, name: str, summary: str, common: argparse.ArgumentParser) -> argparse.ArgumentParser:
    description, examples = DESCRIPTIONS[name]
    return sub.add_parser(name, help=summary, description=textwrap.fill(description, 100), parents=[common],
                          epilog="examples:\n" + "\n".join(f"  {example}" for example in examples),
                          formatter_class=argparse.RawDescriptionHelpFormatter)


def _add_selection_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--allow-incomplete", action="store_true",
                        help="include truncated runs and diverged runs (at their last val line before the divergence)")
    parser.add_argument("--allow-mixed", action="store_true", help="pool runs of different configurations into one statistic")


def _add_source_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--cache-dir", type=_path, metavar="DIR", help=f"where fetched logs go (default: {published.default_cache_dir()})")
    parser.add_argument("--source-url", metavar="URL", help=f"raw-file server of the public repository (default: ${published.SOURCE_URL_ENV}, "
                                                           "else its GitHub raw files at the pinned commit)")


def _track(parser: argparse.ArgumentParser, required: bool, default_help: str) -> None:
    parser.add_argument("--track", type=int, choices=(1, 2, 3), required=required,
                        help=f"1/2: t-test against 3.28/2.92; 3: margin rule ({default_help})")


class _OneLineParser(argparse.ArgumentParser):
    """argparse's errors as one line, like the tool's own (argparse prints the whole usage first); --help keeps it."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message}; see `{self.prog} --help`\n")


def build_parser() -> argparse.ArgumentParser:
    parser = _OneLineParser(prog="records", description="Parse speedrun logs, compute record statistics, manage records/.",
                                     epilog=f"`{TOOL} COMMAND --help` describes each command, with examples.")
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("-v", "--verbose", action="store_true", help="full detail: every differing setting, every file behind an error")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    p = _subcommand(sub, "parse", "one structured run per log (multi-trial logs split)", common)
    p.add_argument("logs", nargs="+", type=_path, metavar="LOG|DIR")
    p.add_argument("--json", action="store_true", help="print a JSON list (with the embedded sources)")
    p.add_argument("--no-source", action="store_true", help="leave source text out of the JSON")
    p.set_defaults(handler=cmd_parse)

    p = _subcommand(sub, "stats", "per configuration: n, mean/sd/min/max, and the track's significance rule", common)
    p.add_argument("logs", nargs="+", type=_path, metavar="LOG|DIR")
    _track(p, required=False, default_help="default: each configuration's own, told from its logs (docs/records.md)")
    p.add_argument("--step", type=int, help="use the val loss at this step (default: final; Track 3: first passing step)")
    p.add_argument("--metric", default="val_loss", help="val-line column to use, e.g. val_ema_loss (default: val_loss)")
    p.add_argument("--json", action="store_true", help="print the statistics as a JSON object")
    p.add_argument("--md", nargs="?", type=_path, const=DEFAULT_MD, metavar="FILE",
                   help="write statistics.md to FILE (put it after the logs, or use --md=FILE); bare --md: statistics.md in the one folder given")
    p.add_argument("--force", action="store_true", help="let --md replace a file this tool did not write, or one edited since")
    p.add_argument("--title", default=None, help="title of statistics.md (default: the folder's name)")
    _add_selection_flags(p)
    p.set_defaults(handler=cmd_stats)

    p = _subcommand(sub, "compare", "candidate vs baseline: time (Welch, paired), loss, matched steps, Track 3 pairwise rule", common)
    p.add_argument("--baseline", nargs="+", type=_path, required=True, metavar="LOG|DIR", help="logs, a folder of logs, or a record folder")
    p.add_argument("--candidate", nargs="+", type=_path, required=True, metavar="LOG|DIR")
    _track(p, required=False, default_help="default: told from the logs (docs/records.md)")
    p.add_argument("--paired", action="store_true", help="runs were interleaved: pair the i-th baseline with the i-th candidate (pass files in run order)")
    p.add_argument("--json", action="store_true")
    _add_selection_flags(p)
    p.set_defaults(handler=cmd_compare)

    p = _subcommand(sub, "diff", "new runs against the prior record: code, Hyperparameters, environment, losses, timing", common)
    p.add_argument("logs", nargs="+", type=_path, metavar="NEW_LOG")
    p.add_argument("--against", default="auto", type=_not_empty, metavar="RECORD_DIR|LOG|TRACK:N|NAME|auto",
                   help="auto (default): the prior world record of the logs' track (fetched), or a newer record folder of ours")
    _track(p, required=False, default_help="default: the track the logs tell")
    p.add_argument("--code", action="store_true", help="also print the full source diff")
    p.add_argument("--plot", type=_path, metavar="OUT.png", help="overlay the val-loss curves in a PNG")
    _add_source_flags(p)
    _add_selection_flags(p)
    p.set_defaults(handler=cmd_diff)

    p = _subcommand(sub, "new", "create a record folder from logs (never overwrites anything)", common)
    _track(p, required=True, default_help="required")
    p.add_argument("--name", required=True, help="Track 1: CamelCase; Track 3: snake_case")
    p.add_argument("--logs", nargs="+", type=_path, required=True, metavar="LOG|DIR")
    p.add_argument("--date", type=_date, help="YYYY-MM-DD, today or earlier (default: today, UTC)")
    p.add_argument("--hardware", help="describe the machine (default: from the logs' environment)")
    p.add_argument("--note", help="one line saying what these runs are (e.g. 'CPU smoke run')")
    p.add_argument("--not-a-record", action="store_true",
                   help="file the folder as our own results, not a record (needed for CPU runs or too few GPUs)")
    _add_selection_flags(p)
    p.set_defaults(handler=cmd_new)

    p = _subcommand(sub, "extract", "write the script(s) embedded in a log, ready to rerun", common)
    p.add_argument("log", type=_path)
    p.add_argument("-o", "--output", required=True, metavar="FILE", help="path of the script; appended files go next to it")
    p.set_defaults(handler=cmd_extract)

    p = _subcommand(sub, "fetch", "download a published record's logs into the cache (checked, never overwritten)", common)
    p.add_argument("record", metavar="TRACK:N|NAME|latest", help="e.g. 1:89, 3:45, FP8DownProjection, or latest (of --track, default 1)")
    p.add_argument("--track", type=int, choices=(1, 2, 3), help="the track of `latest` or of NAME")
    _add_source_flags(p)
    p.set_defaults(handler=cmd_fetch)

    p = _subcommand(sub, "index", "rebuild records/published_logs.csv from a clone of the public repository", common)
    p.add_argument("clone", type=_path, metavar="CLONE_DIR")
    p.add_argument("--write", action="store_true", help="write records/published_logs.csv (default: print a summary)")
    p.set_defaults(handler=cmd_index)

    p = _subcommand(sub, "check", "lint record folders, results.json against logs, README tables against folders", common)
    p.set_defaults(handler=cmd_check)

    p = _subcommand(sub, "tables", "print (or --write into marked READMEs) the record tables", common)
    p.add_argument("--write", action="store_true", help="update every README.md that holds records:* markers")
    p.add_argument("--block", choices=tables.BLOCKS, help="print only this table")
    p.set_defaults(handler=cmd_tables)

    parser.add_argument("--root", type=_path, default=REPO_ROOT, help="repository root holding records/ (default: this checkout)")
    return parser


def _not_empty(text: str) -> str:
    """An argparse type: '' names nothing, yet Path('') is the current folder (fetch --cache-dir '' would fill it) and a
    lookup of '' fails somewhere far from the flag."""
    if not text:
        raise argparse.ArgumentTypeError("'' is empty, which would be read as the current folder; pass a path")
    return text


def _path(text: str) -> Path:
    return Path(_not_empty(text))


def _date(text: str) -> dt.date:
    try:
        return dt.date.fromisoformat(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a date; use YYYY-MM-DD") from None


def _records_root(args: argparse.Namespace) -> Path:
    return Path(args.root) / "records"


def _existing_records_root(args: argparse.Namespace) -> Path:
    """records/ under --root, for the commands that read or write the record folders; refused when it is not there."""
    records_root = _records_root(args)
    if not records_root.is_dir():
        raise RecordsError(f"{records_root}: no records folder there; pass --root REPO, the checkout that holds records/")
    return records_root


def cmd_parse(args: argparse.Namespace) -> int:
    parsed: list[tuple[Path, list[Run]]] = []
    unreadable: list[str] = []
    for log in find_logs(args.logs, unreadable):
        try:
            parsed.append((log, parse_log(log)))
        except RecordsError as exc:
            if log in args.logs:  # named on the command line: an error; found in a folder: skipped
                raise
            print(f"skipped {exc}", file=sys.stderr)
            parsed.append((log, []))
    for problem in unreadable:
        print(f"warning: {problem}", file=sys.stderr)
    _refuse_folders_without_a_run(args.logs, parsed)
    runs = [run for _, log_runs in parsed for run in log_runs]
    if args.json:
        print(json.dumps([run_to_json(r, include_source=not args.no_source) for r in runs], indent=1))
    else:
        print("\n".join(run_to_text(r) for r in runs))
    return 0


def _refuse_folders_without_a_run(paths: list[Path], parsed: list[tuple[Path, list[Run]]]) -> None:
    """A folder given whose every log was skipped is an error, as that log named alone is: otherwise parse printed only the
    skips (--json: an empty list) and exited 0. A folder with a usable log keeps its skips as notes."""
    for folder in (path for path in paths if path.is_dir()):
        found = [runs for log, runs in parsed if log.is_relative_to(folder)]
        if found and not any(found):
            raise RecordsError(f"{folder}: none of its {len(found)} log file(s) is usable (each is skipped above, with the reason); "
                               "pass a folder that holds training logs")


# ----- stats -----


def _paths_text(paths: list[Path]) -> str:
    return str(paths[0]) if len(paths) == 1 else f"{paths[0]} (+{len(paths) - 1} more)"


def _configurations(loaded: LoadedLogs, track: int | None, allow_mixed: bool, paths: list[Path]) -> list[RunSet]:
    """The configurations a command reports on: those of `track` if given, pooled into one with --allow-mixed."""
    groups = loaded.groups
    if track is not None:
        chosen = select_track(groups, track)
        if not chosen:
            found = ", ".join(sorted({track_text(g.track).capitalize() for g in groups}))
            raise RecordsError(f"no Track {track} runs in {_paths_text(paths)} (found {found} logs); pass another --track or drop it")
        if len(chosen) < len(groups):
            loaded.notes.append(f"{len(groups) - len(chosen)} configuration(s) of another track not shown (--track {track}); drop --track to see them")
        groups = chosen
    if allow_mixed and len(groups) > 1:
        groups = [pool(groups)]
    elif len(groups) > 1:
        loaded.notes.append(f"{len(groups)} configurations (they differ in {', '.join(differing_parts(groups))}), each reported on its "
                            "own; --allow-mixed pools those of one track, -v says where they differ")
    if all(not group.runs for group in groups):
        raise no_run_left([note for group in groups for note in group.notes] + loaded.notes)
    return groups


def _group_reports(groups: list[RunSet], track: int | None, step: int | None, metric: str) -> list[dict[str, Any]]:
    reports = []
    for group in groups:
        if not group.runs:  # every run left out: the notes say why; the other configurations are still reported
            reports.append({"configuration": group.description, "no_usable_run": True, "notes": group.notes})
            continue
        try:
            report = track_report(group, _group_track(group, track), step)
        except RecordsError as exc:
            if len(groups) == 1:
                raise
            report = {"configuration": group.description, "error": str(exc), "notes": group.notes}
        if metric != "val_loss":
            report["metric"] = metric
        report["distinct"] = group.distinct
        reports.append(report)
    return reports


def _group_track(group: RunSet, track: int | None) -> int:
    """The track whose rule applies: --track, else the one the logs tell; a log that does not say is refused."""
    chosen = track or group.track
    if chosen is None:
        why = next((fact.run.track_reason for fact in group.runs if fact.run is not None), "")
        raise RecordsError(f"{group.runs[0].label if group.runs else 'these logs'}: the track cannot be told from the log "
                           f"({why}); pass --track 1 or --track 2")
    return chosen


def cmd_stats(args: argparse.Namespace) -> int:
    loaded = folders.load_paths(args.logs, allow_incomplete=args.allow_incomplete, metric=args.metric)
    groups = _configurations(loaded, args.track, args.allow_mixed, args.logs)
    reports = _group_reports(groups, args.track, args.step, args.metric)
    if args.json:
        print(json.dumps({"configurations": reports, "notes": loaded.notes}, indent=1, ensure_ascii=False))
    else:
        blocks = []
        first = _example_run(groups[0])
        for number, (report, group) in enumerate(zip(reports, groups), start=1):
            heading = f"configuration {number} of {len(reports)}" if len(reports) > 1 else "configuration"
            block = _render_block(report, heading, args.verbose)
            where = first_code_difference(first, _example_run(group)) if args.verbose and number > 1 else None
            blocks.append(block + (f"\ncode differs from configuration 1 at {where}" if where else ""))
        print("\n\n".join(blocks))
        for note in loaded.notes:
            print(f"note: {note}")
    if args.md is not None:
        print(_write_md(args, reports), file=sys.stderr if args.json else sys.stdout)
    return 2 if any("error" in report for report in reports) else 0


def _example_run(group: RunSet) -> Run | None:
    return next((fact.run for fact in group.runs if fact.run is not None and fact.run.sources), None)


def _render_block(report: dict[str, Any], heading: str, verbose: bool) -> str:
    if "error" in report or "no_usable_run" in report:
        problem = f"cannot compute: {report['error']}" if "error" in report else "no usable run (the notes say why)"
        lines = [f"{heading}: {report['configuration']}", problem]
        return "\n".join(lines + [f"note: {note}" for note in report["notes"]])
    text = render_stats_text(report).replace("configuration:", f"{heading}:", 1)
    if verbose and report.get("distinct"):
        text += "\nsettings that set this configuration apart: " + ", ".join(report["distinct"])
    return text


def _write_md(args: argparse.Namespace, reports: list[dict[str, Any]]) -> str:
    if len(reports) == 1 and ("error" in reports[0] or "no_usable_run" in reports[0]):
        raise RecordsError("--md: no statistics to write (see the configuration above); nothing written")
    if len(reports) != 1:
        raise RecordsError(f"--md writes the statistics of one configuration, and these logs hold {len(reports)}; "
                           "pick one with --track, pass its logs only, or --allow-mixed")
    folder = args.logs[0] if len(args.logs) == 1 and args.logs[0].is_dir() else None
    if args.md == DEFAULT_MD:
        if folder is None:
            raise RecordsError("bare --md writes statistics.md into the one folder given; pass --md FILE instead")
        path = folder / folders.STATISTICS_MD
    else:
        path = args.md
    _refuse_md_over_a_log(path, args.logs)
    title = args.title or (folder.resolve().name if folder is not None else "runs")
    what = folders.write_generated(path, render_statistics_md(reports[0], title), force=args.force)
    return f"{what} {path}"


def _refuse_md_over_a_log(path: Path, logs: list[Path]) -> None:
    """--md FILE naming one of the logs just read would replace that log (with --force, without a word)."""
    if path.is_file() and any(path.samefile(log) for log in find_logs(logs, [])):
        raise RecordsError(f"{path}: one of the logs these statistics were read from; pass another --md FILE (nothing written)")


# ----- compare, diff -----


def cmd_compare(args: argparse.Namespace) -> int:
    sides = []
    for paths in (args.baseline, args.candidate):
        loaded = folders.load_paths(paths, allow_incomplete=args.allow_incomplete)
        groups = _configurations(loaded, args.track, args.allow_mixed, paths)
        loaded.notes += [f"{group.description}: no usable run, not compared ({'; '.join(group.notes)})" for group in groups if not group.runs]
        sides.append(([group for group in groups if group.runs], loaded.notes))
    (baselines, base_notes), (candidates, cand_notes) = sides
    pairs = [(b, c) for b in baselines for c in candidates if b.track == c.track or None in (b.track, c.track)]
    if not pairs:
        raise RecordsError("baseline and candidate hold no configurations of the same track; check the paths, or pass --track N")
    results = []
    for baseline, candidate in pairs:
        track = args.track or candidate.track or baseline.track
        if track is None:
            raise RecordsError(f"{_paths_text(args.candidate)}: the track cannot be told from these logs; pass --track 1 or --track 2")
        result = compare.compare_runsets(baseline, candidate, track, paired=args.paired)
        result["notes"] += base_notes + cand_notes
        results.append(result)
    if args.json:
        print(json.dumps({"comparisons": results}, indent=1, ensure_ascii=False))
    else:
        blocks = [compare.render_compare_text(result) for result in results]
        if len(blocks) > 1:
            blocks = [f"== comparison {i} of {len(blocks)}\n{block}" for i, block in enumerate(blocks, start=1)]
        print("\n\n".join(blocks))
    return 0


def cmd_diff(args: argparse.Namespace) -> int:
    if args.plot is not None:
        diff.check_plot_path(args.plot)
    new = diff.side_from_logs("new", args.logs, args.allow_incomplete, args.allow_mixed)
    track = _group_track(new.runset, args.track)
    source = diff.Source(args.cache_dir or published.default_cache_dir(), published.source_url(args.source_url))
    prior = diff.choose_prior(_records_root(args), track, args.against, new, source, args.allow_incomplete, args.allow_mixed)
    other = prior.side.runset.track
    if other is not None and other != track:
        raise RecordsError(f"--against {args.against}: Track {other} runs, and the new logs are Track {track}; a diff compares "
                           f"runs of one track: pass a Track {track} record (e.g. --against {track}:N, or a folder of Track {track} logs)")
    print(f"against {prior.where}: {prior.why}")
    print(diff.render_diff(prior.side, new, track, full_code=args.code, verbose=args.verbose))
    if args.plot is not None:
        diff.plot_val_curves(prior.side, new, args.plot, target=stats.TARGETS[track])
        print(f"wrote {args.plot}")
    return 0


# ----- new, extract, check, tables -----


def cmd_new(args: argparse.Namespace) -> int:
    records_root = _records_root(args)  # `new` may start a records/ folder in a fresh --root
    changed: list[tuple[Path, list[str]]] = []

    def update_tables(_: Path) -> None:  # inside `new`: README tables that cannot be written leave no folder behind
        changed.extend(tables.write_tables(args.root, records_root, newrecord.RERUN_NEW, newrecord.UNFILED))

    folder = newrecord.create_record(records_root, args.track, args.name, args.logs, date=args.date, hardware=args.hardware,
                                     note=args.note, allow_incomplete=args.allow_incomplete, allow_mixed=args.allow_mixed,
                                     not_a_record=args.not_a_record, when_filled=update_tables)
    print(f"created {folder}" + (" (our own results, not a record)" if args.not_a_record else ""))
    for path in sorted(folder.iterdir()):
        print(f"  {path.name}")
    for line in folders.read_results(folder / folders.RESULTS_JSON).get("left_out", []):
        print(f"left out: {line}")
    _report_tables(changed)
    return 0


def _report_tables(changed: list[tuple[Path, list[str]]]) -> None:
    for readme, blocks in changed:
        print(f"updated {readme}: " + ", ".join(f"{block} table ({BLOCK_NAMES[block]})" for block in blocks))


def cmd_extract(args: argparse.Namespace) -> int:
    extraction = extract.extract_sources(args.log, extract.script_path(args.output))
    for path in extraction.written:
        print(f"wrote {path}")
    if extraction.invalid_bytes:
        print(f"warning: {args.log}: the embedded code holds {extraction.invalid_bytes} byte(s) that are not valid UTF-8, "
              "written back unchanged; Python will refuse the file until they are fixed", file=sys.stderr)
    if extraction.python_unchecked:
        print(f"note: {args.log}: the run used Python {extraction.python_unchecked}, and its code does not compile in this "
              f"Python {sys.version_info[0]}.{sys.version_info[1]}, for a reason other than a cut (newer syntax?); run it with "
              f"Python {extraction.python_unchecked}", file=sys.stderr)
    return 0


def cmd_fetch(args: argparse.Namespace) -> int:
    record = published.resolve_record(_existing_records_root(args), args.record, args.track)
    fetched = published.fetch_record(record, args.cache_dir or published.default_cache_dir(), published.source_url(args.source_url))
    print(f"{record.label}: {len(fetched.files)} log(s) in {fetched.folder} "
          f"({fetched.downloaded} downloaded, {fetched.from_cache} already in the cache)")
    return 0


def cmd_index(args: argparse.Namespace) -> int:
    indexed = index.index_clone(args.clone, _existing_records_root(args))
    files = sum(len(record.files) for record in indexed)
    megabytes = sum(entry.size for record in indexed for entry in record.files) / 1e6
    for record in indexed if args.verbose else []:
        print(f"Track {record.track} #{record.number}: {len(record.files)} file(s), {record.runs} run(s) in {record.logs_at}")
    print(f"{len(indexed)} records, {files} log files, {megabytes:.1f} MB")
    if args.write:
        print(f"{index.write_manifest(_records_root(args), indexed)} {published.manifest_path(_records_root(args))}")
    return 0


def cmd_check(args: argparse.Namespace) -> int:
    problems = check.check_all(args.root, _existing_records_root(args))
    for problem in problems:
        print(problem)
    counted = check.folder_count(_records_root(args))
    readmes = len(tables.find_marked_readmes(args.root, []))  # one that cannot be read is among the problems
    print(f"check: {counted} record folder(s), {readmes} README(s) with tables: "
          + (f"{len(problems)} problem(s)" if problems else "ok"))
    return 1 if problems else 0


def cmd_tables(args: argparse.Namespace) -> int:
    records_root = _existing_records_root(args)
    if args.write:
        if not tables.find_marked_readmes(args.root):
            raise RecordsError(f"{args.root}: no README.md holds records:* markers; add e.g. {tables.start_marker('track1')} / {tables.end_marker('track1')}")
        changed = tables.write_tables(args.root, records_root)
        _report_tables(changed)
        if not changed:
            print("tables already up to date")
        return 0
    # All rendered before any is printed: a file that cannot be read leaves its error line alone, not half the tables.
    rendered = [tables.render_block(block, records_root, readme_dir=records_root)  # links as seen from records/
                for block in ([args.block] if args.block else tables.BLOCKS)]
    for text in rendered:
        print(text)
        print()
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    handler: Callable[[argparse.Namespace], int] = args.handler
    try:
        return handler(args)
    except RecordsError as exc:
        more = " (--verbose lists all)" if len(exc.detail) > 1 and not args.verbose else ""
        print(f"records: error: {exc}{more}", file=sys.stderr)
        if args.verbose:
            for line in exc.detail:
                print(f"  {line}", file=sys.stderr)
        return 2
