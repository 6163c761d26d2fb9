"""Where the host pauses in a one-process train_gpt.py run: every garbage collection and every batch transfer.

The profiles of bench/ab.py show the GPU idle for 11-21 ms a few times per step, waiting for the host, next to a
batch's host-to-device copies (bench/NOTES.md, 2026-12-02, commits 1c45907 and 7e9fd34). This runs train_gpt.py in this process with
Python's gc.callbacks and a timer around each `_to_device` call, and prints, from the first step line on
(validation left out): collections by generation (count, total and longest ms, the steps of those over 1 ms) and
the training batch copies over 0.5 ms. With `train_gpt.PinnedStaging` a long copy can also be the host waiting
for a staging buffer, i.e. running more than 16 copies ahead of the GPU (harmless: the GPU has work queued).

    python bench/host_pauses.py -- <train_gpt.py overrides>      # one GPU (or CPU with a tiny preset)
"""

import gc
import re
import sys
import time
from collections import defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the repository root (bench/scripts.py)

import train_gpt as tg  # noqa: E402

STEP_LINE = re.compile(r"step:(\d+)/\d+ ")


def main() -> None:
    argv = sys.argv[1:]
    if argv[:1] == ["--"]:
        argv = argv[1:]
    state = {"step": None, "timed": False, "validating": False, "gc_start": 0.0}
    collections: dict[int, list[tuple[float, object]]] = defaultdict(list)
    transfers: list[tuple[float, object]] = []

    def on_gc(phase: str, info: dict) -> None:
        if phase == "start":
            state["gc_start"] = time.perf_counter()
        elif state["timed"]:
            collections[info["generation"]].append((1000 * (time.perf_counter() - state["gc_start"]), state["step"]))

    original_print0, original_to_device, original_evaluate = tg.print0, tg._to_device, tg.evaluate

    def print0(s: str, console: bool = False) -> None:
        original_print0(s, console)
        match = STEP_LINE.match(s)
        if match:  # from the first training step on (after the warm-up and its explicit collection)
            state["step"], state["timed"] = int(match[1]), True

    def to_device(*args, **kwargs):
        start = time.perf_counter()
        result = original_to_device(*args, **kwargs)
        ms = 1000 * (time.perf_counter() - start)
        if state["timed"] and not state["validating"] and ms > 0.5:
            transfers.append((ms, state["step"]))
        return result

    def evaluate(*args, **kwargs):
        state["validating"] = True
        try:
            return original_evaluate(*args, **kwargs)
        finally:
            state["validating"] = False

    tg.print0, tg._to_device, tg.evaluate = print0, to_device, evaluate
    gc.callbacks.append(on_gc)
    try:
        tg.run(argv)
    except tg.UserError as error:  # refused before training: nothing to report
        raise SystemExit(f"host_pauses.py: error: {error}")
    except (tg.RunStopped, KeyboardInterrupt) as stop:  # what was seen up to the stop is printed too
        report(collections, transfers)
        raise SystemExit(f"host_pauses.py: stopped: {str(stop) or 'interrupted (Ctrl-C)'}")
    finally:
        gc.callbacks.remove(on_gc)
    report(collections, transfers)


def report(collections: dict[int, list[tuple[float, object]]], transfers: list[tuple[float, object]]) -> None:
    print(f"Python {sys.version.split()[0]}, gc thresholds {gc.get_threshold()}, frozen objects {gc.get_freeze_count()}")
    for generation in sorted(collections):
        times = collections[generation]
        long = [(round(ms, 1), step) for ms, step in times if ms > 1.0]
        print(
            f"gc generation {generation}: {len(times)} collections in training, {sum(ms for ms, _ in times):.1f} ms in all, "
            f"longest {max(ms for ms, _ in times):.2f} ms; over 1 ms (ms, step): {long[:40]}"
        )
    per_step: dict[object, int] = defaultdict(int)
    for _, step in transfers:
        per_step[step] += 1
    print(f"batch copies over 0.5 ms: {len(transfers)}, {sum(ms for ms, _ in transfers):.1f} ms in all; per step: {dict(per_step)}")
    print(f"the first 60 (ms, step): {[(round(ms, 1), step) for ms, step in transfers][:60]}")


if __name__ == "__main__":
    main()
