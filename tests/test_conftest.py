"""The suite's own helpers in conftest.py: a run that never shows the awaited line fails its test, not the suite."""

import signal
import subprocess
import sys
import time

import pytest

from conftest import signal_when


def test_signal_when_kills_a_run_that_never_prints_the_line():
    silent = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True)
    start = time.monotonic()
    try:
        with pytest.raises(pytest.fail.Exception, match=r"no line starting with 'step:5/10 ' \(killed after 2 s\)"):
            signal_when(silent, "step:5/10 ", signal.SIGINT, timeout=2)
    finally:
        silent.kill()
        silent.wait()
    assert silent.returncode == -signal.SIGKILL and time.monotonic() - start < 30


def test_signal_when_names_a_run_that_ended_before_the_line():
    crashed = subprocess.Popen([sys.executable, "-c", "import sys; sys.exit('boom')"], stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, text=True)
    with pytest.raises(pytest.fail.Exception, match=r"\(ended with status 1\); its stderr ends: 'boom\\n'"):
        signal_when(crashed, "step:5/10 ", signal.SIGINT, timeout=60)


def test_signal_when_signals_a_run_once_it_prints_the_line():
    script = "import signal, sys, time\nsignal.signal(signal.SIGINT, lambda *_: sys.exit(7))\nprint('step:5/10 x', flush=True)\ntime.sleep(120)"
    run = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    signal_when(run, "step:5/10 ", signal.SIGINT, timeout=60)
    assert run.returncode == 7
