#!/usr/bin/env bash
# scripts/ncu_bwd.sh BUILD_DIR OUT_DIR [CELL ...]: Nsight Compute profiles of flashkit's main backward
# kernel (the sm90 or sm80 bwd_kernel, not the row kernels around it), one launch per cell, with the
# per-instruction stall samples, so that two instances (e.g. dropout p = 0 and p = 0.1) can be read
# side by side down to the SASS line (GPU.md's "explain" step; scripts/ncu_fwd.sh is the forward's).
#
# A CELL is "dtype:hdim:seqlen:causal:dropout" of the benchmark grid (16k tokens, model dim 2048),
# e.g. bf16:128:8k:no:0.1. BUILD_DIR holds bench/flashkit_bench. Writes, per cell, into OUT_DIR:
#   ncu-bwd-<cell>.txt        the details page (speed of light, warp states, instruction mix,
#                             launch, occupancy, shared-memory bank conflicts, source hot spots)
#   ncu-bwd-<cell>-sass.csv   the source page: per SASS instruction, its executed count and stall
#                             samples by reason
#   ncu-bwd-<cell>-raw.csv    every collected metric
#   ncu-bwd-<cell>.log        the profiled run's output; .ncu-<cell>.ncu-rep the report itself
# Clocks are left as the driver runs them (--clock-control none; GPU.md).
set -uo pipefail

if [ $# -lt 2 ]; then
  echo "usage: scripts/ncu_bwd.sh BUILD_DIR OUT_DIR [dtype:hdim:seqlen:causal:dropout ...]" >&2
  exit 2
fi
BUILD_DIR=$1
OUT=$2
shift 2
CELLS=("$@")
if [ ${#CELLS[@]} -eq 0 ]; then
  CELLS=(bf16:128:8k:no:0 bf16:128:8k:no:0.1)
fi
NCU=$(command -v ncu || echo /usr/local/cuda/bin/ncu)
if [ ! -x "$NCU" ]; then
  echo "ncu (Nsight Compute) not found" >&2
  exit 1
fi
mkdir -p "$OUT"

# What explains a kernel that alternates tensor-core products with CUDA-core work behind barriers:
# issue and stall reasons (per instruction too), pipes, shared-memory wavefronts and conflicts,
# local memory (spills), the clock it ran at. The pipes' busy cycles (the tensor pipe among them:
# the same FLOPs in both instances, so more busy cycles mean slower products) are in the raw page.
PROFILE=(--clock-control none --launch-skip 3 --launch-count 1
         --section SpeedOfLight --section ComputeWorkloadAnalysis --section SchedulerStats
         --section WarpStateStats --section InstructionStats --section LaunchStats --section Occupancy
         --section MemoryWorkloadAnalysis_Tables --section SourceCounters
         --metrics smsp__inst_executed.sum,sm__cycles_elapsed.max,sm__cycles_elapsed.avg.per_second,gpu__time_duration.sum,l1tex__data_bank_conflicts_pipe_lsu_mem_shared_op_ld.sum,l1tex__data_bank_conflicts_pipe_lsu_mem_shared_op_st.sum,l1tex__t_bytes_pipe_lsu_mem_local_op_ld.sum,l1tex__t_bytes_pipe_lsu_mem_local_op_st.sum,smsp__inst_executed_pipe_fma.sum,smsp__inst_executed_pipe_alu.sum,smsp__inst_executed_pipe_xu.sum,smsp__inst_executed_pipe_lsu.sum,smsp__inst_executed_pipe_uniform.sum)

status=0
for cell in "${CELLS[@]}"; do
  IFS=: read -r dtype hdim seqlen causal dropout <<<"$cell"
  name="$dtype-d$hdim-$seqlen-causal_$causal-p$dropout"
  echo "== $name"
  "$NCU" --kernel-name regex:^bwd_kernel "${PROFILE[@]}" -f -o "$OUT/.ncu-$name" \
    "$BUILD_DIR/bench/flashkit_bench" --dtype "$dtype" --hdim "$hdim" --seqlen "$seqlen" --causal "$causal" \
    --dropout "$dropout" --op bwd >"$OUT/ncu-bwd-$name.log" 2>&1 || status=1
  "$NCU" -i "$OUT/.ncu-$name.ncu-rep" --page details >"$OUT/ncu-bwd-$name.txt" 2>&1 || status=1
  "$NCU" -i "$OUT/.ncu-$name.ncu-rep" --page source --print-source sass --csv >"$OUT/ncu-bwd-$name-sass.csv" 2>&1 ||
    status=1
  "$NCU" -i "$OUT/.ncu-$name.ncu-rep" --page raw --csv >"$OUT/ncu-bwd-$name-raw.csv" 2>&1 || status=1
  grep -h -E "Duration|SM Frequency|Compute \(SM\) Throughput|Issue Slots Busy|No Eligible|Registers Per|Dynamic Shared|Achieved Occupancy|Executed Instructions " \
    "$OUT/ncu-bwd-$name.txt" | sed 's/^/   /'
done
exit $status
