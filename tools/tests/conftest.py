"""Shared fixtures of the records tool's tests: a throw-away repository root with the published seed folders."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import records_fixtures  # noqa: F401  (puts tools/ on sys.path for `recordkit`)

from recordkit.tables import end_marker, start_marker, write_tables

REPO = Path(__file__).resolve().parents[2]
SEED_FOLDERS = ("track_1_short/2025-09-23_MuonCustomSizing", "track_3_optimization/results/20260513_shampoo_1_4_power")
README = "\n\n".join(
    ["# Records", start_marker("track1"), end_marker("track1"), start_marker("track3"), end_marker("track3"),
     start_marker("folders"), end_marker("folders"), ""]
)


@pytest.fixture
def root(tmp_path: Path) -> Path:
    """A repository root whose records/ holds the two published seed folders and a README with markers."""
    records = tmp_path / "repo" / "records"
    for seed in SEED_FOLDERS:  # only these: folders of our own runs come and go
        shutil.copytree(REPO / "records" / seed, records / seed)
    for history in ("track_1_short/history.csv", "track_3_optimization/history.csv"):
        shutil.copy(REPO / "records" / history, records / history)
    (records / "README.md").write_text(README)
    write_tables(tmp_path / "repo", records)
    return tmp_path / "repo"
