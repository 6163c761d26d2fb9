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

if [[ -n "${NPROC:-}" ]]; then
  [[ "$NPROC" =~ ^[1-9][0-9]*$ ]] || fail "NPROC must be a positive number of processes, got '$NPROC'"
  nproc_per_node=$NPROC
else
  nproc_per_node=$(count_visible_gpus)
  ((nproc_per_node > 0)) ||
    fail "no CUDA GPU is visible; to train a tiny model on the CPU instead, run: python train_gpt.py --preset=smoke"
fi

# train_gpt.py reads the default shards unless told otherwise (the smoke preset writes its own);
# like train_gpt.py, DATA_PATH is prefixed to the default paths.
if [[ " $* " != *" --train_files"* && " $* " != *" --val_files"* && " $* " != *" --preset=smoke "* ]]; then
  for shard in data/fineweb10B/fineweb_train_000001.bin data/fineweb10B/fineweb_val_000000.bin; do
    [[ -f "${DATA_PATH:-.}/$shard" ]] ||
      fail "${DATA_PATH:-.}/$shard is missing; download the first 900M FineWeb tokens with: python data/cached_fineweb10B.py 9"
  done
fi

exec torchrun --standalone --nproc_per_node="$nproc_per_node" train_gpt.py "$@"
