#!/usr/bin/env bash
# Train on every visible CUDA GPU: ./run.sh [--name=value ...]     Check the machine first: ./run.sh --check
#   TRACK=3                train_gpt_shampoo.py instead of train_gpt.py (Track 1)
#   NPROC=N                processes on this machine instead of the visible GPU count (CUDA_VISIBLE_DEVICES limits those)
#   NNODES=N               machines in the run, through torchrun's c10d rendezvous; every machine runs ./run.sh with
#   MASTER_ADDR, MASTER_PORT   the same NNODES and the rendezvous address (the first machine's, port 29500 by default),
#   RDZV_ENDPOINT          or host:port in one; NODE_RANK=0 marks the machine that hosts the rendezvous (others 1, 2, ...)
#   RDZV_ID                the run's name at the rendezvous (default: SLURM_JOB_ID, else nanogpt)
set -euo pipefail
cd "$(dirname "$0")"

fail() { echo "run.sh: $*" >&2; exit 1; }

case "${TRACK:-1}" in
  1) script=train_gpt.py download="python data/cached_fineweb10B.py 9" ;;
  3) script=train_gpt_shampoo.py download="python data/cached_fineweb10B.py 22" ;;
  *) fail "TRACK must be 1 (train_gpt.py) or 3 (train_gpt_shampoo.py), got '$TRACK'" ;;
esac

if [[ "${1:-}" == "--check" ]]; then # the pre-flight check of this run, by tools/doctor.py
  shift
  doctor=(--track "${TRACK:-1}")
  [[ -n "${NPROC:-}" ]] && doctor+=(--nproc "$NPROC")
  [[ -n "${NNODES:-}" ]] && doctor+=(--nnodes "$NNODES")
  exec python3 tools/doctor.py "${doctor[@]}" "$@"
fi

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

# The scripts split their batch over a world size that divides 8.
largest_usable() { local n=8; while ((n > $1)); do n=$((n / 2)); done; echo "$n"; }

if [[ -n "${NPROC:-}" ]]; then
  [[ "$NPROC" =~ ^[1-9][0-9]*$ ]] || fail "NPROC must be a positive number of processes, got '$NPROC'"
  ((8 % NPROC == 0)) ||
    fail "NPROC=$NPROC: $script splits its batch over 1, 2, 4 or 8 processes; set NPROC=$(largest_usable "$NPROC")"
  nproc_per_node=$NPROC
else
  nproc_per_node=$(count_visible_gpus)
  ((nproc_per_node > 0)) ||
    fail "no CUDA GPU is visible; to train a tiny model on the CPU instead, run: python $script --preset=smoke"
  ((8 % nproc_per_node == 0)) ||
    fail "$nproc_per_node GPUs are visible, but $script splits its batch over 1, 2, 4 or 8 processes; set NPROC=$(largest_usable "$nproc_per_node") (or CUDA_VISIBLE_DEVICES)"
fi

# One machine: torchrun --standalone. Several (NNODES): torchrun's c10d rendezvous at RDZV_ENDPOINT or
# MASTER_ADDR:MASTER_PORT. c10d numbers the machines itself (the one whose host name sorts first gets rank 0 and
# writes the log); NODE_RANK only says which machine hosts the rendezvous store, for when host names do not
# match the address (containers, Slurm).
rendezvous=(--standalone)
if [[ -n "${NNODES:-}" ]]; then
  [[ "$NNODES" =~ ^[1-9][0-9]*$ ]] || fail "NNODES must be a positive number of machines, got '$NNODES'"
  world_size=$((NNODES * nproc_per_node))
  ((8 % world_size == 0)) ||
    fail "NNODES=$NNODES x $nproc_per_node processes = $world_size, but $script splits its batch over 1, 2, 4 or 8 processes in all; set NPROC (per machine) so that NNODES x NPROC is one of them"
  endpoint=${RDZV_ENDPOINT:-}
  if [[ -z "$endpoint" ]]; then
    if [[ -z "${MASTER_ADDR:-}" ]]; then
      ((NNODES == 1)) || fail "NNODES=$NNODES: set MASTER_ADDR to the first machine's address (reachable from every machine), or RDZV_ENDPOINT=host:port"
      MASTER_ADDR=127.0.0.1
    fi
    endpoint="$MASTER_ADDR:${MASTER_PORT:-29500}"
  fi
  rendezvous=(--nnodes="$NNODES" --rdzv-backend=c10d --rdzv-endpoint="$endpoint" --rdzv-id="${RDZV_ID:-${SLURM_JOB_ID:-nanogpt}}")
  if [[ -n "${NODE_RANK:-}" ]]; then
    [[ "$NODE_RANK" =~ ^[0-9]+$ ]] && ((NODE_RANK < NNODES)) ||
      fail "NODE_RANK must be 0 .. $((NNODES - 1)) (NNODES=$NNODES), got '$NODE_RANK'"
    if ((NODE_RANK == 0)); then rendezvous+=(--rdzv-conf=is_host=1); else rendezvous+=(--rdzv-conf=is_host=0); fi
  fi
fi

# The script reads the default shards unless told otherwise (the smoke preset writes its own);
# like the scripts, DATA_PATH is prefixed to the default paths.
if [[ " $* " != *" --train_files"* && " $* " != *" --val_files"* && " $* " != *" --preset=smoke "* ]]; then
  for shard in data/fineweb10B/fineweb_train_000001.bin data/fineweb10B/fineweb_val_000000.bin; do
    [[ -f "${DATA_PATH:-.}/$shard" ]] ||
      fail "${DATA_PATH:-.}/$shard is missing; download the FineWeb shards with: $download"
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
torchrun "${rendezvous[@]}" --nproc_per_node="$nproc_per_node" --log-dir="$launcher_dir/torchrun" "$script" "$@" 2>&"$filtered_stderr" &
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
