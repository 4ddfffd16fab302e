#!/usr/bin/env bash
# scripts/ncu_fwd.sh BUILD_DIR OUT_DIR [CELL ...]: Nsight Compute profiles of flashkit's forward kernel
# and of the peers' on the same cells, one launch each, so that they can be read side by side
# (tensor-pipe and MUFU utilisation, issue slots, instructions, stall reasons: GPU.md's "explain"
# step). The peers are bench/peers.py implementations, $NCU_PEERS (default "sdpa_cudnn"; "fa3" needs
# FlashAttention-3 built and on PYTHONPATH: scripts/build_fa3.sh).
#
# A CELL is "dtype:hdim:seqlen:causal" of the benchmark grid (16k tokens, model dim 2048), e.g.
# bf16:256:2k:no; the default cells are the weakest of bench/results/h200-2026-11-23-final-bwd-fwd.md
# beside a strong one. BUILD_DIR holds bench/flashkit_bench (any build with the bench); the peers run
# in bench/peers.py with PyTorch. Writes OUT_DIR/ncu-<impl>-<cell>.txt (ncu's details page).
set -uo pipefail

if [ $# -lt 2 ]; then
  echo "usage: scripts/ncu_fwd.sh BUILD_DIR OUT_DIR [dtype:hdim:seqlen:causal ...]" >&2
  exit 2
fi
BUILD_DIR=$1
OUT=$2
shift 2
CELLS=("$@")
if [ ${#CELLS[@]} -eq 0 ]; then
  CELLS=(bf16:64:2k:no bf16:64:2k:yes bf16:128:8k:no bf16:256:2k:no bf16:256:8k:no)
fi
cd "$(dirname "$0")/.." || exit 2
NCU=$(command -v ncu || echo /usr/local/cuda/bin/ncu)
if [ ! -x "$NCU" ]; then
  echo "ncu (Nsight Compute) not found" >&2
  exit 1
fi
mkdir -p "$OUT"

# The sections that explain a compute-bound kernel, and the pipes a forward pass lives on.
PROFILE=(--launch-skip 5 --launch-count 1
         --section SpeedOfLight --section ComputeWorkloadAnalysis --section SchedulerStats
         --section WarpStateStats --section InstructionStats --section LaunchStats
         --metrics sm__pipe_tensor_op_gmma_cycles_active.avg.pct_of_peak_sustained_active,sm__inst_executed_pipe_xu.avg.pct_of_peak_sustained_active,smsp__inst_executed.sum,sm__cycles_elapsed.max,gpu__time_duration.sum)

status=0
for cell in "${CELLS[@]}"; do
  IFS=: read -r dtype hdim seqlen causal <<<"$cell"
  grid=(--dtype "$dtype" --hdim "$hdim" --seqlen "$seqlen" --causal "$causal")
  name="$dtype-d$hdim-$seqlen-causal_$causal"
  echo "== $name"
  "$NCU" --kernel-name regex:fwd_kernel "${PROFILE[@]}" \
    "$BUILD_DIR/bench/flashkit_bench" "${grid[@]}" --op fwd >"$OUT/ncu-flashkit-$name.txt" 2>&1 ||
    status=1
  reports=("$OUT/ncu-flashkit-$name.txt")
  for peer in ${NCU_PEERS:-sdpa_cudnn}; do
    # The peer's forward kernel, by its demangled name (FA3's is cutlass::device_kernel<...
    # FlashAttnFwdSm90 ...>).
    case $peer in
      fa3) kernel=(--kernel-name-base demangled --kernel-name regex:FlashAttnFwdSm90) ;;
      *) kernel=(--kernel-name "regex:cudnn|sdpa|fmha") ;;
    esac
    "$NCU" "${kernel[@]}" "${PROFILE[@]}" \
      python3 bench/peers.py "${grid[@]}" --impls "$peer" --ops fwd --json "$OUT/.peers.tmp" \
      >"$OUT/ncu-$peer-$name.txt" 2>&1 || status=1
    rm -f "$OUT/.peers.tmp"
    reports+=("$OUT/ncu-$peer-$name.txt")
  done
  grep -H -E "Duration|Compute \(SM\) Throughput|gmma_cycles_active|pipe_xu|Issue Slots Busy|No Eligible|inst_executed.sum" \
    "${reports[@]}" | sed "s|^$OUT/||; s/^/   /"
done
exit $status
