"""The helpers train_gpt.py and train_gpt_shampoo.py both carry stay the same.

Each script is self-contained (its log holds its whole program), so the shared helpers are copied on purpose;
this test fails when a copy drifts. Every name the two scripts both define at module level is listed once:
in SHARED (the same code, compared after parsing: formatting and line wrapping may differ, code, docstrings
and comments may not) or in DIFFERENT with the reason the two definitions differ.
"""

import ast
import io
import os
import re
import subprocess
import sys
import tokenize
from pathlib import Path

import numpy as np
import pytest

import train_gpt as tg
import train_gpt_shampoo as tgs
from conftest import ROOT

SCRIPTS = (ROOT / "train_gpt.py", ROOT / "train_gpt_shampoo.py")

SHARED = (
    # errors and the command line
    "UserError", "RunStopped", "need", "_ArgumentParser", "_parse_bool", "_parse_float", "HELP_GROUPS", "setting",
    "FLAG_GROUPS", "FLAG_HELP", "SEED_LIMIT", "NAME_LIMIT", "PATH_FLAGS", "check_path_names",
    # shards
    "SHARD_MAGIC", "SHARD_VERSION", "SHARD_HEADER_INTS", "GPT2_VOCAB_SIZE", "HUB_SHARD_SCRIPTS",
    "resolve_files", "shard_fix", "read_shard_header", "read_shard", "check_train_data", "check_val_is_held_out", "shard_bytes",
    "TEMPORARY_NAME", "NO_LOCK_ERRNOS", "flock_if_supported", "write_atomically", "remove_dead_temporaries", "write_shard",
    # smoke shards: one writer; each track its own sizes, tokens and folder (smoke_shards)
    "write_smoke_shards", "refresh_smoke_shards",
    # processes, log and stopping
    "Runtime", "_free_port", "read_world_size", "cpu_threads", "setup_distributed", "synchronize",
    "raise_if_any_rank_failed", "run_on", "announce_log", "new_run_id", "_log_path", "_log_error", "_is_master", "append_to_log", "write_log",
    "print0", "open_log", "_command_output", "git_commit", "_stop_signal", "_defer_stop", "_step_reached",
    "NON_FINITE_EXIT_STATUS", "LOST_PROCESS_EXIT_STATUS", "HEALTH_LAG_CUDA", "STOP_SIGNALS", "stop_requested",
    "interrupted", "stop_if_asked", "_on_stop_signal", "install_stop_handlers", "LOST_PROCESS_SIGNS", "lost_process_line",
    "StepHealth", "report_stop", "environment_lines",
    # what a run writes, checked before its log exists
    "FREE_SPACE_MARGIN", "LOG_HEADER_BYTES", "log_bytes", "CHECKPOINT_DIR_LOCK", "_checkpoint_dir_lock", "tensor_bytes", "optimizer_bytes",
    "nearest_existing", "check_output_folder", "check_room", "claim_checkpoint_dir", "release_checkpoint_dir", "prepare_outputs",
    # checkpoint files
    "PARTIAL_MARKER", "_last_checkpoint", "last_checkpoint_note", "remove_stale_partial_checkpoints", "HashingWriter",
    "atomic_torch_save", "fsync_directory", "rng_state", "set_rng_state", "comparable_settings", "write_checkpoint",
    "agree_on_checkpoint_write", "stage_checkpoint_files", "publish_checkpoint", "ResumePoint", "read_manifest",
    "file_sha256", "checkpoint_problem", "checkpoint_file_names", "previous_complete_checkpoint", "checkpoint_manifest",
    "MANIFEST_FIELDS", "manifest_problem", "writer_commit_note", "first_setting_difference", "check_shared_state",
    "check_same_settings", "train_shard_record", "check_ranks_read_the_same_shards", "shard_text", "first_shard_difference", "check_same_train_shards", "open_checkpoint",
    "checkpoint_steps",
)

DIFFERENT = {
    "Hyperparameters": "each track's record settings",
    "DOWNLOAD_HINT": "the training shards each record reads (9 for Track 1, 22 for Track 3)",
    "PRESETS": "each track's smoke configuration",
    "parse_args": "Track 1 takes tuple fields and maps --train_steps",
    "validate_hyperparameters": "each track's settings",
    "FLAG_ALIASES": "each script accepts the other's names for its settings",
    "_build_parser": "Track 1 also maps the other script's --train_steps and parses tuples",
    "lr_multiplier": "each record's schedule",
    "Rotary": "Track 1 adds YaRN and precomputed tables",
    "MLP": "each record's architecture",
    "Block": "each record's architecture",
    "GPT": "each record's architecture",
    "build_optimizers": "Muon and DistAdam versus AdamW and Shampoo",
    "evaluate": "each track's validation data and reduction",
    "run": "the whole run from a command line: Track 1's returns the final val loss, Track 3's the log and every trial's losses",
    "main": "each script's entry point",
    "CHECKPOINT_FORMAT": "each script's own checkpoint format",
    "Progress": "Track 3 also tracks the trial and the last validation",
    "RUNTIME_ONLY_FIELDS": "each script's settings that a resumed run may change",
    "save_resumable": "each script's optimizers and loader",
    "load_resumable": "each script's optimizers and loader",
    "check_checkpoints_are_new": "Track 3 checkpoint names include the trial",
    "smoke_shards": "each track's smoke shard sizes, tokens and folder (the writer, write_smoke_shards, is shared)",
}


def definitions(source: str) -> dict[str, ast.AST]:
    """Module-level functions, classes and assigned names (also inside a top-level try)."""
    found: dict[str, ast.AST] = {}
    for node in ast.parse(source).body:
        for inner in node.body + [s for h in node.handlers for s in h.body] if isinstance(node, ast.Try) else [node]:
            if isinstance(inner, (ast.FunctionDef, ast.ClassDef)):
                found[inner.name] = inner
            elif isinstance(inner, ast.Assign):
                found.update((t.id, inner) for t in inner.targets if isinstance(t, ast.Name))
            elif isinstance(inner, ast.AnnAssign) and isinstance(inner.target, ast.Name):
                found[inner.target.id] = inner
    return found


def normalized(source: str, name: str) -> tuple[str, str]:
    """The definition's code as parsed (blind to formatting and wrapping) and the words of its comments."""
    node = definitions(source)[name]
    lines = "".join(source.splitlines(keepends=True)[node.lineno - 1 : node.end_lineno])  # whole lines: end comments too
    tokens = tokenize.generate_tokens(io.StringIO(lines).readline)
    comments = " ".join(tok.string.lstrip("#") for tok in tokens if tok.type == tokenize.COMMENT)
    return ast.dump(node, include_attributes=False), " ".join(comments.split())


def sources() -> tuple[str, str]:
    return tuple(path.read_text(encoding="utf-8") for path in SCRIPTS)


def test_every_name_both_scripts_define_is_listed_once():
    first, second = sources()
    common = set(definitions(first)) & set(definitions(second))
    assert not set(SHARED) & set(DIFFERENT)
    assert sorted(common - set(SHARED) - set(DIFFERENT)) == [], "list each new common name in SHARED or DIFFERENT"
    assert sorted((set(SHARED) | set(DIFFERENT)) - common) == [], "a listed name is no longer in both scripts"


@pytest.mark.parametrize("name", SHARED)
def test_shared_helper_is_the_same_in_both_scripts(name):
    first, second = sources()
    assert normalized(first, name) == normalized(second, name), (
        f"{name} differs between train_gpt.py and train_gpt_shampoo.py: change both copies"
    )


def test_the_comparison_sees_code_and_comments_but_not_wrapping():
    original = 'def f(x):\n    """Doc."""\n    return g("a" "b", x)  # why\n'
    rewrapped = 'def f(x):\n    """Doc."""\n    return g(\n        "ab",\n        x,\n    )  # why\n'
    same = lambda a, b: normalized(a, "f") == normalized(b, "f")
    assert same(original, rewrapped)
    assert not same(original, original.replace(", x)", ", x + 1)"))
    assert not same(original, original.replace("# why", "# other reason"))
    assert not same(original, original.replace("Doc.", "Other doc."))


# ---- the shared behaviour itself, run in both scripts ----
@pytest.mark.parametrize("script", [tg, tgs], ids=["train_gpt", "train_gpt_shampoo"])
def test_write_shard_never_replaces_a_file(script, tmp_path):
    path = tmp_path / "a_train_000001.bin"
    script.write_shard(path, np.arange(10))
    stamp = path.stat().st_mtime_ns, path.stat().st_ino
    script.write_shard(path, np.arange(10))  # the same bytes (another rank writing the same shard): kept as is
    assert (path.stat().st_mtime_ns, path.stat().st_ino) == stamp
    with pytest.raises(script.UserError, match=re.escape(f"{path} exists with other content")):
        script.write_shard(path, np.arange(11))
    assert script.read_shard(path, 100).tolist() == list(range(10))
    assert [p.name for p in tmp_path.iterdir()] == [path.name]  # no temporary file left behind


@pytest.mark.parametrize("script", [tg, tgs], ids=["train_gpt", "train_gpt_shampoo"])
def test_the_scripts_and_data_shards_agree_on_the_format(script, tmp_path):
    """The third implementation of the format, data/shards.py (the data tools'): the same bytes for the same tokens,
    and each reads the other's shards."""
    import shards

    tokens = np.random.default_rng(0).integers(0, 50257, size=1000)
    script.write_shard(tmp_path / "by_script.bin", tokens)
    shards.write_shard(tmp_path / "by_data.bin", tokens)
    assert (tmp_path / "by_script.bin").read_bytes() == (tmp_path / "by_data.bin").read_bytes()
    assert script.read_shard(tmp_path / "by_data.bin", 50257).tolist() == tokens.tolist()
    assert shards.read_shard(tmp_path / "by_script.bin").tolist() == tokens.tolist()
    assert script.read_shard_header(tmp_path / "by_data.bin") == shards.read_header(tmp_path / "by_script.bin") == 1000
    assert (script.SHARD_MAGIC, script.SHARD_VERSION, script.SHARD_HEADER_INTS) == (shards.MAGIC, shards.VERSION, shards.HEADER_INTS)


@pytest.mark.parametrize("script", [tg, tgs], ids=["train_gpt", "train_gpt_shampoo"])
def test_synchronize_is_no_barrier(script, monkeypatch):
    """One meaning in both scripts: wait for this process's GPU, never for the other ranks."""
    calls = []
    monkeypatch.setattr(script.dist, "barrier", lambda *args, **kwargs: calls.append("barrier"))
    script.synchronize(script.torch.device("cpu"))
    assert calls == []


GLOO_EXIT_CHECK = r"""
import importlib, os, sys, torch
module = importlib.import_module(sys.argv[1])  # the training script, as torchrun starts it
torch.distributed.init_process_group("gloo", rank=0, world_size=1)
torch.optim.AdamW([torch.nn.Parameter(torch.ones(3))])  # imports what torch.optim needs, after the group exists
value = torch.ones(3)
torch.distributed.all_reduce(value)
torch.distributed.destroy_process_group()
print(sorted(open(f"/proc/self/task/{task}/comm").read().strip() for task in os.listdir("/proc/self/task")))
"""


@pytest.mark.skipif(not Path("/proc/self/task").is_dir(), reason="reads the thread names from Linux's /proc")
@pytest.mark.parametrize("script", ["train_gpt", "train_gpt_shampoo"])
def test_destroying_the_process_group_ends_its_gloo_threads(script: str) -> None:
    """torch._dynamo imported after the group exists keeps it alive past destroy_process_group; its gloo threads
    then outlive main() and can abort the process at exit. Each script imports dynamo first."""
    from conftest import free_port

    env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), OMP_NUM_THREADS="1")
    result = subprocess.run([sys.executable, "-c", GLOO_EXIT_CHECK, script], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]
    threads = ast.literal_eval(result.stdout.strip().splitlines()[-1])
    assert not [name for name in threads if "gloo" in name], threads
