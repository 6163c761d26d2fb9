#!/usr/bin/env python3
"""`python tools/records.py <subcommand> ...`: record statistics, folders, tables and diffs.

Subcommands: parse, stats, compare, diff, new, extract, check, tables (see --help of each).
"""

import signal
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from recordkit.cli import main  # noqa: E402

if __name__ == "__main__":
    if hasattr(signal, "SIGPIPE"):
        signal.signal(signal.SIGPIPE, signal.SIG_DFL)  # `records parse ... | head` ends quietly
    sys.exit(main())
