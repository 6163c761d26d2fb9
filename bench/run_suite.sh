#!/usr/bin/env bash
# Every device benchmark of this repository in one go, on the docs proxy (or any shards in the FineWeb
# format), for a machine with 1 or 2+ GPUs. Outputs and logs go to $OUT_DIR (default bench/out/<date>).
#
#   bash bench/run_suite.sh /path/to/docs_proxy [all|track1|track3|shampoo]
#
# Proxy sizes: the docs proxy's validation shard holds 2,097,152 tokens, so validation uses 1,572,864.
set -uo pipefail
cd "$(dirname "$0")/.."
data=${1:?usage: bash bench/run_suite.sh DATA_DIR [all|track1|track3|shampoo]}
what=${2:-all}
[[ $what =~ ^(all|track1|track3|shampoo)$ ]] || { echo "run_suite.sh: unknown part '$what'; use all, track1, track3 or shampoo" >&2; exit 2; }
gpus=$(python3 -c "import torch; print(torch.cuda.device_count())")
[ "$gpus" -ge 1 ] || { echo "run_suite.sh: no CUDA GPU visible; the CPU smoke runs are python train_gpt.py --preset=smoke and python train_gpt_shampoo.py --preset=smoke" >&2; exit 1; }
out=${OUT_DIR:-bench/out/$(date +%Y%m%d-%H%M%S)}
mkdir -p "$out"
export PYTHONUNBUFFERED=1
t1="--train_files=$data/docs_train_*.bin --val_files=$data/docs_val_*.bin --cycle_train_files=true --val_tokens=1572864 --val_batch_size=1572864 --iteration_extension=0"
t3="--train_files=$data/docs_train_*.bin --val_files=$data/docs_val_*.bin --cycle_train_files=true --val_tokens=1572864 --log_dir=$out/logs"

step() {  # name, command...: runs one measurement, keeps its output, goes on after a failure
    local name=$1; shift
    echo "== $name: $*"
    "$@" > "$out/$name.txt" 2>&1; local rc=$?
    echo "   rc=$rc, output in $out/$name.txt"
}

if [[ $what == all || $what == track1 ]]; then
    step t1_1gpu env CUDA_VISIBLE_DEVICES=0 python3 bench/bench_train_gpt.py --nproc 1 --steps 150 --log-dir "$out/logs" -- $t1 --val_loss_every=25
    step softcap_ce env CUDA_VISIBLE_DEVICES=0 python3 bench/bench_softcap_ce.py
    step fp8_head env CUDA_VISIBLE_DEVICES=0 python3 bench/bench_fp8_head.py
    step qk_rotary env CUDA_VISIBLE_DEVICES=0 python3 bench/bench_qk_rotary.py
    step flex env CUDA_VISIBLE_DEVICES=0 python3 bench/bench_flex.py
    step ncu env CUDA_VISIBLE_DEVICES=0 bash bench/ncu_kernels.sh "$out/ncu"
    step cuda_tests env CUDA_VISIBLE_DEVICES=0 python3 -m pytest -q tests/test_train_gpt_cuda.py
    step t1_syncs env CUDA_VISIBLE_DEVICES=0 python3 bench/sync_check.py --compile=false --train_batch_size=32768 --num_iterations=4 --iteration_extension=0 --warmup_steps=1 --train_files="$data/docs_train_*.bin" --val_files="$data/docs_val_*.bin" --cycle_train_files=true --val_tokens=65536 --val_batch_size=65536 --log_dir="$out/logs"
    step t1_host_pauses env CUDA_VISIBLE_DEVICES=0 python3 bench/host_pauses.py -- $t1 --num_iterations=50 --log_dir="$out/logs"
    step t1_profile env CUDA_VISIBLE_DEVICES=0 torchrun --standalone --nproc_per_node=1 bench/profile_train_gpt.py $t1
    [ "$gpus" -ge 2 ] && step t1_2gpu env CUDA_VISIBLE_DEVICES=0,1 python3 bench/bench_train_gpt.py --nproc 2 --steps 100 --log-dir "$out/logs" -- $t1 --val_loss_every=50
fi
if [[ $what == all || $what == shampoo ]]; then
    step shampoo_step_1gpu env CUDA_VISIBLE_DEVICES=0 python3 bench/bench_shampoo_step.py --root-streams 1,2,4,8 --memory-fractions 0.1,inf
    step eigh_probe env CUDA_VISIBLE_DEVICES=0 python3 bench/probe_eigh.py
    # the package's GPU tests (left out of the CPU suite's collection: pyproject.toml's norecursedirs)
    step shampoo_gpu_tests env CUDA_VISIBLE_DEVICES=0 python3 -m pytest -q -p no:cacheprovider distributed_shampoo/gpu_tests
    [ "$gpus" -ge 2 ] && step shampoo_step_2gpu env CUDA_VISIBLE_DEVICES=0,1 torchrun --standalone --nproc_per_node=2 bench/bench_shampoo_step.py --root-streams 1,8
fi
if [[ $what == all || $what == track3 ]]; then
    step t3_shampoo_1gpu env CUDA_VISIBLE_DEVICES=0 torchrun --standalone --nproc_per_node=1 train_gpt_shampoo.py $t3 --train_steps=150 --val_every=25
    step t3_adamw_1gpu env CUDA_VISIBLE_DEVICES=0 torchrun --standalone --nproc_per_node=1 train_gpt_shampoo.py $t3 --train_steps=150 --val_every=25 --matrix_optimizer=adamw
    [ "$gpus" -ge 2 ] && step t3_shampoo_2gpu env CUDA_VISIBLE_DEVICES=0,1 torchrun --standalone --nproc_per_node=2 train_gpt_shampoo.py $t3 --train_steps=30 --val_every=10
fi
echo "done: $out"
