#!/usr/bin/env bash
# Nsight Compute's full section set on the last launch of each bench/ncu_kernels.py target, then a summary of
# each (bench/ncu_kernels.py summarize). Clocks stay as the card has them (--clock-control none). Exit status 1
# when any target could not be profiled or summarized.
#
#   bash bench/ncu_kernels.sh [OUT_DIR] [TARGET ...]     # default: bench/out/ncu, every target
set -uo pipefail
cd "$(dirname "$0")/.."
out=${1:-bench/out/ncu}
shift $(( $# > 0 ? 1 : 0 ))
targets=${*:-softcap_ce flex head_matmul}
python=${PYTHON:-python3}
ncu=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | tail -1)
[ -n "$ncu" ] || { echo "ncu_kernels.sh: no ncu (Nsight Compute) on PATH or under /opt/nvidia/nsight-compute" >&2; exit 1; }
launches=3  # per target run: the first compile and warm up, the last is profiled
declare -A kernels=(  # kernel-name filter and kernels per launch
    [softcap_ce]="regex:_softcap_ce_e5m2_kernel 1"
    [flex]="regex:triton_tem 2"
    [head_matmul]="regex:gemm|nvjet|cutlass|xmma 1"
)
for target in $targets; do
    [ -n "${kernels[$target]:-}" ] || { echo "ncu_kernels.sh: unknown target '$target'; use softcap_ce, flex or head_matmul" >&2; exit 2; }
done
mkdir -p "$out"
failed=0
for target in $targets; do
    read -r filter count <<< "${kernels[$target]}"
    skip=$(( (launches - 1) * count ))
    echo "== $target: ncu -k $filter --launch-skip $skip --launch-count $count"
    if ! "$ncu" --clock-control none --target-processes application-only --set full -k "$filter" --launch-skip "$skip" \
            --launch-count "$count" -f -o "$out/$target" "$python" bench/ncu_kernels.py run "$target" --launches "$launches" \
            > "$out/$target.log" 2>&1; then
        echo "   ncu failed, see $out/$target.log:"; tail -5 "$out/$target.log"; failed=1; continue
    fi
    if ! { "$ncu" --import "$out/$target.ncu-rep" --page details > "$out/$target.details.txt" \
            && "$ncu" --import "$out/$target.ncu-rep" --page raw --csv > "$out/$target.raw.csv" \
            && "$python" bench/ncu_kernels.py summarize "$out/$target.raw.csv"; }; then
        echo "   could not read back $out/$target.ncu-rep"; failed=1
    fi
done
exit $failed
