#!/usr/bin/env bash
# Train with train_gpt.py on every visible CUDA GPU: ./run.sh [--name=value ...]
# NPROC=N overrides the GPU count; CUDA_VISIBLE_DEVICES limits which GPUs are visible.
set -euo pipefail
cd "$(dirname "$0")"

fail() { echo "run.sh: $*" >&2; exit 1; }

count_visible_gpus() {
  local physical=0
  if command -v nvidia-smi >/dev/null 2>&1; then
    physical=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU ' || true)
  fi
  if [[ -n "${CUDA_VISIBLE_DEVICES+set}" ]]; then
    # CUDA_VISIBLE_DEVICES="" (or -1) hides every GPU; "0,2" shows two of them.
    local ids="${CUDA_VISIBLE_DEVICES// /}" visible=0
    [[ -n "$ids" && "$ids" != -1* ]] && visible=$(awk -F, '{ print NF }' <<<"$ids")
    ((visible < physical)) && physical=$visible
  fi
  echo "$physical"
}

# train_gpt.py splits its batch over a world size that divides 8.
largest_usable() { local n=8; while ((n > $1)); do n=$((n / 2)); done; echo "$n"; }

if [[ -n "${NPROC:-}" ]]; then
  [[ "$NPROC" =~ ^[1-9][0-9]*$ ]] || fail "NPROC must be a positive number of processes, got '$NPROC'"
  ((8 % NPROC == 0)) ||
    fail "NPROC=$NPROC: train_gpt.py splits its batch over 1, 2, 4 or 8 processes; set NPROC=$(largest_usable "$NPROC")"
  nproc_per_node=$NPROC
else
  nproc_per_node=$(count_visible_gpus)
  ((nproc_per_node > 0)) ||
    fail "no CUDA GPU is visible; to train a tiny model on the CPU instead, run: python train_gpt.py --preset=smoke"
  ((8 % nproc_per_node == 0)) ||
    fail "$nproc_per_node GPUs are visible, but train_gpt.py splits its batch over 1, 2, 4 or 8 processes; set NPROC=$(largest_usable "$nproc_per_node") (or CUDA_VISIBLE_DEVICES)"
fi

# train_gpt.py reads the default shards unless told otherwise (the smoke preset writes its own);
# like train_gpt.py, DATA_PATH is prefixed to the default paths.
if [[ " $* " != *" --train_files"* && " $* " != *" --val_files"* && " $* " != *" --preset=smoke "* ]]; then
  for shard in data/fineweb10B/fineweb_train_000001.bin data/fineweb10B/fineweb_val_000000.bin; do
    [[ -f "${DATA_PATH:-.}/$shard" ]] ||
      fail "${DATA_PATH:-.}/$shard is missing; download the first 900M FineWeb tokens with: python data/cached_fineweb10B.py 9"
  done
fi

# A worker that stops on an error it reports (one line on stderr) also writes that line to torchrun's
# per-rank error file (TORCHELASTIC_ERROR_FILE, under --log-dir). torchrun then adds its own traceback and
# failure table; when a worker's line exists, that report is left out and the line is all that shows.
launcher_dir=$(mktemp -d "${TMPDIR:-/tmp}/run_sh.XXXXXX")
trap 'rm -rf "$launcher_dir"' EXIT

# stderr passes through, except torchrun's own log lines and, from its failure or shutdown message on,
# everything (the report): those go to report.txt. Signals are for torchrun, not for this filter.
split_launcher_report() {
  trap '' INT TERM
  local line in_report=0
  while IFS= read -r line || [[ -n "$line" ]]; do
    if [[ "$line" =~ torch/distributed/elastic/.*\]\ (failed\ \(exitcode|Received.*death\ signal) ]]; then
      in_report=1
    fi
    if ((in_report)) || [[ "$line" =~ ^[IWE][0-9]{4}\ .*torch/distributed/elastic/ ]]; then
      printf '%s\n' "$line" >>"$launcher_dir/report.txt"
    else
      printf '%s\n' "$line" >&2
      printf '%s\n' "$line" >>"$launcher_dir/passed.txt"
    fi
  done
}

exec {filtered_stderr}> >(split_launcher_report)
filter_pid=$!
torchrun --standalone --nproc_per_node="$nproc_per_node" --log-dir="$launcher_dir/torchrun" train_gpt.py "$@" 2>&"$filtered_stderr" &
launcher_pid=$!
received=""
trap 'received=INT' INT # a terminal's Ctrl-C reaches torchrun too, which passes it to the workers
trap 'received=TERM; kill -TERM "$launcher_pid" 2>/dev/null || true' TERM
while kill -0 "$launcher_pid" 2>/dev/null; do wait "$launcher_pid" || true; done
status=0
wait "$launcher_pid" || status=$?
exec {filtered_stderr}>&-
wait "$filter_pid" || true
if ((status == 0)); then
  [[ -f "$launcher_dir/report.txt" ]] && cat "$launcher_dir/report.txt" >&2
  exit 0
fi

error_files=$(find "$launcher_dir/torchrun" -name error.json 2>/dev/null | sort || true)
if [[ -z "$error_files" ]]; then # no worker explained itself: the launcher's report is all there is
  [[ -f "$launcher_dir/report.txt" ]] && cat "$launcher_dir/report.txt" >&2
  exit "$status"
fi
rank0_file=$(grep -m1 '/0/error.json$' <<<"$error_files" || head -n1 <<<"$error_files")
message=$(python3 -c 'import json, sys; print(json.load(open(sys.argv[1]))["message"])' "$rank0_file" 2>/dev/null || true)
if [[ -n "$message" ]] && ! grep -qxF -- "$message" "$launcher_dir/passed.txt" 2>/dev/null; then
  printf '%s\n' "$message" >&2
fi
worker_status=$(sed -n 's/.*failed (exitcode: \([0-9]*\)).*/\1/p' "$launcher_dir/report.txt" 2>/dev/null | head -n1)
case "$received" in
  INT) exit 130 ;;
  TERM) exit 143 ;;
  *) exit "${worker_status:-$status}" ;;
esac
