"""The two training scripts' command lines: the same names for the same settings, the same --help layout."""

import dataclasses
import re
import subprocess
import sys

import pytest

import train_gpt as tg
import train_gpt_shampoo as tgs
from conftest import ROOT

HELP_GROUPS = ["data", "model", "optimizer", "schedule", "logging", "runtime"]


@pytest.mark.parametrize(
    "alias_argv, field_argv",
    [
        (["--val_every=50"], ["--val_loss_every=50"]),
        (["--preset=smoke", "--val_every=3"], ["--preset=smoke", "--val_loss_every=3"]),
        (["--train_steps=1680"], []),  # the record's total: 1640 scheduled + 40 extension steps
        (["--train_steps=500"], ["--num_iterations=460"]),
        (["--train_steps=500", "--iteration_extension=0"], ["--num_iterations=500", "--iteration_extension=0"]),
        (["--preset=smoke", "--train_steps=20"], ["--preset=smoke", "--num_iterations=19"]),  # the smoke extension is 1
    ],
)
def test_track1_aliases_parse_to_the_same_hyperparameters(alias_argv, field_argv):
    hp_alias, overrides_alias = tg.parse_args(alias_argv)
    hp_field, overrides_field = tg.parse_args(field_argv)
    assert hp_alias == hp_field
    if field_argv:  # the log and a resumed run see the field's name, whichever spelling was used
        assert overrides_alias == overrides_field
    assert hp_alias.train_steps == hp_field.train_steps


@pytest.mark.parametrize(
    "alias_argv, field_argv",
    [
        (["--val_loss_every=50"], ["--val_every=50"]),
        (["--num_iterations=300"], ["--train_steps=300"]),
        (["--preset=smoke", "--num_iterations=8", "--val_loss_every=4"], ["--preset=smoke", "--train_steps=8", "--val_every=4"]),
    ],
)
def test_track3_aliases_parse_to_the_same_hyperparameters(alias_argv, field_argv):
    assert tgs.parse_args(alias_argv) == tgs.parse_args(field_argv)


def test_the_shared_names_mean_the_same_in_both_scripts():
    """--train_steps is the number of steps trained and --val_every the validation period, in either script."""
    track1, _ = tg.parse_args(["--preset=smoke", "--train_steps=12", "--val_every=4"])
    track3, _ = tgs.parse_args(["--preset=smoke", "--train_steps=12", "--val_every=4"])
    assert track1.train_steps == track3.train_steps == 12
    assert track1.val_loss_every == track3.val_every == 4


@pytest.mark.parametrize(
    "parse, argv, fragment",
    [
        (tg.parse_args, ["--val_every=5", "--val_loss_every=6"], "--val_every and --val_loss_every"),
        (tg.parse_args, ["--train_steps=100", "--num_iterations=60"], "--train_steps"),
        (tg.parse_args, ["--train_steps=40"], "--train_steps=40 must exceed --iteration_extension=40"),
        (tgs.parse_args, ["--num_iterations=5", "--train_steps=6"], "--num_iterations and --train_steps"),
        (tgs.parse_args, ["--val_loss_every=5", "--val_every=5"], "--val_loss_every and --val_every"),
        (tg.parse_args, ["--num_iter=5"], "--num_iter"),  # no abbreviations: an alias could make them ambiguous
        (tgs.parse_args, ["--train_step=5"], "--train_step"),
    ],
)
def test_conflicting_or_abbreviated_flags_are_one_line_errors(parse, argv, fragment):
    errors = (tg.UserError, tgs.UserError)
    with pytest.raises(errors) as info:
        parse(argv)
    assert fragment in str(info.value) and "\n" not in str(info.value)


@pytest.mark.parametrize("module", [tg, tgs])
def test_every_hyperparameter_is_in_exactly_one_help_group(module):
    grouped = [name for names in module.FLAG_GROUPS.values() for name in names]
    fields = [f.name for f in dataclasses.fields(module.Hyperparameters)]
    assert list(module.FLAG_GROUPS) == HELP_GROUPS
    assert sorted(grouped) == sorted(fields), set(grouped) ^ set(fields)
    assert set(module.FLAG_HELP) == set(fields)
    assert not set(module.FLAG_ALIASES) & set(fields)


def _help(script: str) -> str:
    result = subprocess.run([sys.executable, str(ROOT / script), "--help"], capture_output=True, text=True, timeout=120,
                            env={"PATH": "/usr/bin:/bin", "COLUMNS": "200"})
    assert result.returncode == 0, result.stderr
    return result.stdout


def test_help_has_the_same_layout_in_both_scripts():
    layouts = {}
    for script in ("train_gpt.py", "train_gpt_shampoo.py"):
        text = _help(script)
        assert text.startswith(f"usage: {script} [-h] [--preset=smoke] [--name=value ...]\n")
        headings = re.findall(r"^(\w+):$", text, re.M)
        layouts[script] = headings
        assert headings == ["options", *HELP_GROUPS], headings  # no "other" group: every flag has its place
        assert re.search(r"^  --preset \{smoke\} +\S", text, re.M)
    track1, track3 = _help("train_gpt.py"), _help("train_gpt_shampoo.py")
    assert re.search(r"^  --val_loss_every int +.*\(default: 125\); also --val_every$", track1, re.M)
    assert re.search(r"^  --val_every int +.*\(default: 125\); also --val_loss_every$", track3, re.M)
    assert re.search(r"^  --num_iterations int +.*--train_steps=N .*\(default: 1640\)$", track1, re.M)
    assert re.search(r"^  --train_steps int +.*\(default: 4150\); also --num_iterations$", track3, re.M)
    assert re.search(r"^  --ws_schedule INTS +.*\(default: 3,7,11\)$", track1, re.M)
    assert "--num_trials int" in track3.split("\nruntime:\n")[1] and "--seed int" in track1.split("\nruntime:\n")[1]


@pytest.mark.parametrize(("module", "local_processes", "cores", "expected"), [
    (tg, 1, 2, 1), (tg, 1, 16, 8), (tg, 2, 16, 4), (tg, 8, 2, 1), (tgs, 1, 2, 1), (tgs, 4, 32, 4),
])
def test_cpu_threads_leave_room_for_the_other_ranks(monkeypatch, module, local_processes, cores, expected):
    monkeypatch.setattr(module.os, "sched_getaffinity", lambda pid: set(range(cores)), raising=False)
    assert module.cpu_threads(local_processes) == expected
