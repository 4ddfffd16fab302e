#!/usr/bin/env bash
# scripts/decode_check.sh OUT_DIR: the decode path's GPU check in one call, for iterating on
# mha_fwd_kvcache without building or benchmarking the rest (scripts/gpu_check.sh does everything).
#
# Steps: configure (preset $FLASHKIT_PRESET, default hopper, plus $FLASHKIT_CMAKE_ARGS); build only
# flashkit_gpu_tests and flashkit_bench_decode; the kvcache GPU tests (--gtest_filter
# $FLASHKIT_GTEST_FILTER, default '*GpuKvcache*'); flashkit_bench_decode ($FLASHKIT_DECODE_ARGS)
# and bench/peers_decode.py on its grid, merged into <gpu>-<date>-decode.{json,md}; with
# FLASHKIT_DECODE_SWEEP_ARGS, flashkit_bench_decode once more with those arguments (e.g. a --splits
# sweep) into decode_sweep.json; with FLASHKIT_NCU_ARGS (flashkit_bench_decode arguments of one
# cell), an ncu profile of one decode kernel of that cell (memory throughput, occupancy, warp
# stalls). Every step's output goes to OUT_DIR/decode_check.log; at most 5 files in OUT_DIR.
# FLASHKIT_GIT_COMMIT names the commit measured (the device machine's copy has no .git).
set -uo pipefail

if [ $# -ne 1 ]; then
  echo "usage: scripts/decode_check.sh OUT_DIR" >&2
  exit 2
fi
mkdir -p "$1" || exit 2
OUT=$(cd "$1" && pwd)
cd "$(dirname "$0")/.." || exit 2
export PATH="/usr/local/cuda/bin:$PATH"
export FLASHKIT_GIT_COMMIT=${FLASHKIT_GIT_COMMIT:-unknown}
preset=${FLASHKIT_PRESET:-hopper}
build=$PWD/$(python3 scripts/preset_dir.py "$preset") || exit 2
log=$OUT/decode_check.log
: >"$log"
status=0

step() {  # step NAME COMMAND...: run with its output in the log; a failure sets the exit status
  local name=$1 begin=$SECONDS rc
  shift
  echo "==== $name: $*" >>"$log"
  "$@" >>"$log" 2>&1
  rc=$?
  echo "$name: rc $rc, $((SECONDS - begin)) s" | tee -a "$log"
  [ $rc -eq 0 ] || status=1
  return $rc
}

gtest=()
[ -n "${FLASHKIT_GTEST_SOURCE_DIR:-}" ] && gtest=("-DFLASHKIT_GTEST_SOURCE_DIR=$FLASHKIT_GTEST_SOURCE_DIR")
read -r -a user <<<"${FLASHKIT_CMAKE_ARGS:-}"
step configure cmake --preset "$preset" "${gtest[@]}" "${user[@]}" || exit 1
step build cmake --build "$build" -j "$(nproc)" --target flashkit_gpu_tests flashkit_bench_decode \
  || { tail -30 "$log"; exit 1; }
step gpu_tests "$build/tests/cpp/flashkit_gpu_tests" "--gtest_filter=${FLASHKIT_GTEST_FILTER:-*GpuKvcache*}"
grep "^\[  PASSED\|^\[  FAILED\|tests ran" "$log"

read -r -a grid <<<"${FLASHKIT_DECODE_ARGS:-}"
step bench "$build/bench/flashkit_bench_decode" "${grid[@]}" --json "$OUT/flashkit_decode.json"
gpu=$(PYTHONPATH=bench python3 -c \
  'import json, sys, report; print(report.slug(json.load(open(sys.argv[1]))["gpu"]))' \
  "$OUT/flashkit_decode.json")
stem="$OUT/$gpu-$(date -u +%Y-%m-%d)-decode"
step peers python3 bench/peers_decode.py "${grid[@]}" --flashkit "$OUT/flashkit_decode.json" \
  --json "$stem.json" --md "$stem.md"
cat "$stem.md"

if [ -n "${FLASHKIT_DECODE_SWEEP_ARGS:-}" ]; then
  read -r -a sweep <<<"$FLASHKIT_DECODE_SWEEP_ARGS"
  step sweep "$build/bench/flashkit_bench_decode" "${sweep[@]}" --json "$OUT/decode_sweep.json"
fi

if [ -n "${FLASHKIT_NCU_ARGS:-}" ] && command -v ncu >/dev/null; then
  read -r -a cell <<<"$FLASHKIT_NCU_ARGS"
  step ncu timeout 90 ncu --clock-control none -k regex:decode_kernel --launch-skip 20 --launch-count 1 \
    --section SpeedOfLight --section Occupancy --section WarpStateStats \
    "$build/bench/flashkit_bench_decode" "${cell[@]}" --json /dev/null
  sed -n '/==== ncu/,$p' "$log" | grep -i "throughput\|occupancy\|stall\|cycles per\|duration" | head -30
fi
exit $status
