"""recordkit: library behind `python tools/records.py` (parse speedrun logs, statistics, record folders)."""
