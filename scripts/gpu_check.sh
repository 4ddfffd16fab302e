#!/usr/bin/env bash
# scripts/gpu_check.sh OUT_DIR: everything the GPU machine is for, in one call (docs/GPU.md).
#
# Steps, in order; a failed step does not stop the later ones that do not depend on it, and the exit
# status is 1 if any step failed, timed out or was left unrun for lack of time:
#   env        nvidia-smi, nvcc, cmake, ninja, python / torch / cuDNN / triton versions
#   configure  cmake --preset $FLASHKIT_PRESET (default hopper) $FLASHKIT_CMAKE_ARGS; GoogleTest
#              from $FLASHKIT_GTEST_SOURCE_DIR, else from a carried .deps/googletest if none is
#              installed
#   build      cmake --build <preset dir> -j $FLASHKIT_JOBS (default: all cores), timed
#   gpu_tests  flashkit_gpu_tests [--gtest_filter=$FLASHKIT_GTEST_FILTER]
#   gpu_tests_sm80  the forward GPU suite again with FLASHKIT_FWD_PATH=sm80, so that on a Hopper GPU
#              both forward paths run it (gpu_tests takes the automatic choice, sm90 there, and
#              the decode kernel for short queries: their suite runs forced onto sm90 first, and
#              the GQA suites with the sm90 forward's query heads packed, FLASHKIT_SM90_PACK_GQA=1)
#   gpu_tests_bwd_sm80  the backward GPU suite again with FLASHKIT_BWD_PATH=sm80, likewise
#              The two reruns are skipped with FLASHKIT_SKIP_SM80_RERUN=1; FLASHKIT_SM80_RERUNS
#              (default "fwd bwd") picks which of them run.
#   cpu_tests  flashkit_cpu_tests
#   python_tests  tests/python (pytest) against the extension the build staged in <build>/python
#              (FLASHKIT_PYTHON=AUTO builds it where python3 imports torch), on the GPU;
#              [-k $FLASHKIT_PYTEST_FILTER]; skipped when FLASHKIT_CMAKE_ARGS has
#              -DFLASHKIT_PYTHON=OFF (no extension to test)
#   memcheck, racecheck, synccheck   only with FLASHKIT_SANITIZE=1: compute-sanitizer on the GPU tests
#              [--gtest_filter=$FLASHKIT_SANITIZE_FILTER]
#   bench      flashkit_bench (--quick with FLASHKIT_BENCH_QUICK=1; grid flags from
#              FLASHKIT_BENCH_ARGS, e.g. "--hdim 128 --seqlen 8k", passed to peers too; the ops
#              from FLASHKIT_BENCH_OPS, default fwd,bwd,fwd_bwd)
#   peers      bench/peers.py on the same grid (--impls $FLASHKIT_PEERS_IMPLS when set)
#   report     bench/report.py: the merged JSON and markdown table
# FLASHKIT_SKIP_TESTS=1 skips gpu_tests and cpu_tests; FLASHKIT_SKIP_BENCH=1 skips bench, peers
# and report; FLASHKIT_SKIP_PEERS=1 skips peers. FLASHKIT_GIT_COMMIT names the commit measured (the
# device machine's copy of the tree has no .git). FLASHKIT_JOBS sets the build's parallelism.
# FLASHKIT_TIME_BUDGET_S (default 570) bounds the whole run: each step is cut off so that the
# summary still prints before the device tool's 600 s limit.
#
# OUT_DIR receives at most 7 files (the device tool returns 8):
#   gpu_check.log                     every step's output, each line stamped "HH:MM:SS step |"
#   build_time.txt                    seconds of the build
#   gpu_tests.json                    GoogleTest's report of the GPU tests
#   flashkit.json, peers.json         the raw results of each benchmark
#   <gpu>-<yyyy-mm-dd>-<ops>.json, .md  the merged results and table (to commit under
#                                     bench/results; <ops> e.g. bwd-fwd-fwd_bwd)
# The summary prints last: the table, then each step's result, test counts and the build time.
set -uo pipefail

if [ $# -ne 1 ]; then
  echo "usage: scripts/gpu_check.sh OUT_DIR" >&2
  exit 2
fi
mkdir -p "$1" || exit 2
OUT=$(cd "$1" && pwd)
cd "$(dirname "$0")/.." || exit 2
export PATH="/usr/local/cuda/bin:$PATH" PYTHONUNBUFFERED=1
export OUT
export PRESET=${FLASHKIT_PRESET:-hopper}
export JOBS=${FLASHKIT_JOBS:-$(nproc)}
BUILD_DIR="$PWD/$(python3 scripts/preset_dir.py "$PRESET")" || exit 2
export BUILD_DIR
if [ -z "${FLASHKIT_GIT_COMMIT:-}" ]; then
  FLASHKIT_GIT_COMMIT=$(git describe --always --dirty --abbrev=12 2>/dev/null || echo unknown)
fi
export FLASHKIT_GIT_COMMIT
if [ -z "${FLASHKIT_DRIVER:-}" ]; then
  FLASHKIT_DRIVER=$(nvidia-smi --query-gpu=driver_version --format=csv,noheader 2>/dev/null \
    | head -1)
fi
export FLASHKIT_DRIVER
GRID_ARGS="${FLASHKIT_BENCH_ARGS:-}"
if [ "${FLASHKIT_BENCH_QUICK:-0}" = 1 ]; then GRID_ARGS="--quick $GRID_ARGS"; fi
export GRID_ARGS

LOG="$OUT/gpu_check.log"
: >"$LOG"
SCRATCH=$(mktemp -d)  # each step's raw output, for the summary; not returned
trap 'rm -rf "$SCRATCH"' EXIT
BUDGET=${FLASHKIT_TIME_BUDGET_S:-570}
START=$SECONDS
INCREMENTAL=$([ -e "$BUILD_DIR/build.ninja" ] && echo " (incremental: the build dir existed)")

# ---- the steps (run in a child bash under `timeout`, hence exported) -----------------------------

step_env() {
  nvidia-smi
  local rc=$?
  nvcc --version
  cmake --version | head -1
  echo "ninja $(ninja --version)"
  echo "cores $(nproc)"
  python3 - <<'EOF'
import sys
print("python", sys.version.split()[0])
try:
    import torch
    gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else None
    print("torch", torch.__version__, "| cuda", torch.version.cuda,
          "| cudnn", torch.backends.cudnn.version(), "| gpu", gpu)
except Exception as e:
    print("torch not usable:", e)
try:
    import triton
    print("triton", triton.__version__)
except Exception as e:
    print("triton not usable:", e)
EOF
  echo "commit $FLASHKIT_GIT_COMMIT"
  return $rc
}

step_configure() {
  local args=()
  if [ -n "${FLASHKIT_GTEST_SOURCE_DIR:-}" ]; then
    args+=("-DFLASHKIT_GTEST_SOURCE_DIR=$FLASHKIT_GTEST_SOURCE_DIR")
  elif [ ! -e /usr/include/gtest/gtest.h ] && [ ! -e /usr/local/include/gtest/gtest.h ] \
       && [ -d .deps/googletest ]; then
    args+=("-DFLASHKIT_GTEST_SOURCE_DIR=$PWD/.deps/googletest")
  fi
  local user=()
  read -r -a user <<<"${FLASHKIT_CMAKE_ARGS:-}"
  echo "+ cmake --preset $PRESET ${args[*]} ${user[*]}"
  cmake --preset "$PRESET" "${args[@]}" "${user[@]}"
}

step_build() {
  local begin end rc seconds
  begin=$(date +%s.%N)
  cmake --build "$BUILD_DIR" -j "$JOBS"
  rc=$?
  end=$(date +%s.%N)
  seconds=$(awk -v a="$begin" -v b="$end" 'BEGIN { printf "%.1f", b - a }')
  if [ $rc -eq 0 ]; then
    echo "$seconds" >"$OUT/build_time.txt"
  else
    echo "failed after $seconds" >"$OUT/build_time.txt"
  fi
  echo "build: $seconds s with -j $JOBS (exit $rc)"
  return $rc
}

step_gpu_tests() {
  local args=("--gtest_output=json:$OUT/gpu_tests.json")
  if [ -n "${FLASHKIT_GTEST_FILTER:-}" ]; then args+=("--gtest_filter=$FLASHKIT_GTEST_FILTER"); fi
  "$BUILD_DIR/tests/cpp/flashkit_gpu_tests" "${args[@]}"
}

step_gpu_tests_sm80() {
  local rc=0
  # The automatic choice gives short queries to the decode kernel; on a Hopper GPU they run on the
  # sm90 forward here too (first, so that the summary counts the sm80 run's tests).
  if [ "$(nvidia-smi --query-gpu=compute_cap --format=csv,noheader 2>/dev/null | head -1)" = 9.0 ]; then
    FLASHKIT_FWD_PATH=sm90 "$BUILD_DIR/tests/cpp/flashkit_gpu_tests" "--gtest_filter=*ShortQueries*" || rc=1
    # The sm90 forward's packed query heads wherever it can pack (the automatic choice packs only
    # where it pays, which few of these small cases reach).
    FLASHKIT_FWD_PATH=sm90 FLASHKIT_SM90_PACK_GQA=1 "$BUILD_DIR/tests/cpp/flashkit_gpu_tests" \
      "--gtest_filter=*ShortQueries*:*ShapesGqaVarlen*:*VarlenEdges*:*EmptyRows*:*Layout*:*NoKeys*" || rc=1
  fi
  FLASHKIT_FWD_PATH=sm80 "$BUILD_DIR/tests/cpp/flashkit_gpu_tests" "--gtest_filter=*GpuFwd*" || rc=1
  return $rc
}

step_gpu_tests_bwd_sm80() {
  FLASHKIT_BWD_PATH=sm80 "$BUILD_DIR/tests/cpp/flashkit_gpu_tests" "--gtest_filter=*GpuBwd*"
}

step_cpu_tests() {
  "$BUILD_DIR/tests/cpp/flashkit_cpu_tests"
}

step_python_tests() {
  local args=(-rf)
  if [ -n "${FLASHKIT_PYTEST_FILTER:-}" ]; then args+=(-k "$FLASHKIT_PYTEST_FILTER"); fi
  bash scripts/python_tests.sh "$BUILD_DIR" "${args[@]}"
}

sanitize() {  # sanitize TOOL
  compute-sanitizer --tool "$1" --error-exitcode 99 "$BUILD_DIR/tests/cpp/flashkit_gpu_tests" \
    "--gtest_filter=${FLASHKIT_SANITIZE_FILTER:-*}"
}
step_memcheck() { sanitize memcheck; }
step_racecheck() { sanitize racecheck; }
step_synccheck() { sanitize synccheck; }  # named barriers and mbarrier waits of the sm90 kernels

step_bench() {
  local grid=()
  read -r -a grid <<<"$GRID_ARGS"
  "$BUILD_DIR/bench/flashkit_bench" "${grid[@]}" --op "${FLASHKIT_BENCH_OPS:-fwd,bwd,fwd_bwd}" \
    --json "$OUT/flashkit.json"
}

step_peers() {
  local grid=()
  read -r -a grid <<<"$GRID_ARGS"
  if [ -n "${FLASHKIT_PEERS_IMPLS:-}" ]; then grid+=(--impls "$FLASHKIT_PEERS_IMPLS"); fi
  python3 bench/peers.py "${grid[@]}" --ops "${FLASHKIT_BENCH_OPS:-fwd,bwd,fwd_bwd}" \
    --json "$OUT/peers.json"
}

step_report() {
  rm -f "$OUT"/*.tmp  # a results file half-written when a step was cut off (OUT_DIR's file limit)
  local inputs=()
  for name in flashkit peers; do
    if [ -s "$OUT/$name.json" ]; then inputs+=("$OUT/$name.json"); fi
  done
  if [ ${#inputs[@]} -eq 0 ]; then
    echo "no benchmark results to report"
    return 1
  fi
  python3 bench/report.py --out-dir "$OUT" "${inputs[@]}"
}

export -f step_env step_configure step_build step_gpu_tests step_gpu_tests_sm80 \
  step_gpu_tests_bwd_sm80 step_cpu_tests \
  step_python_tests \
  sanitize step_memcheck \
  step_racecheck step_synccheck step_bench step_peers step_report

# ---- running them --------------------------------------------------------------------------------

STEPS=()
declare -A RESULT SECS

# Prefixes each line of stdin with the time and the step's name.
stamp() {
  local line
  while IFS= read -r line; do printf '%(%H:%M:%S)T %-9s | %s\n' -1 "$1" "$line"; done
}

say() {
  printf '%(%H:%M:%S)T gpu_check: %s\n' -1 "$*" | tee -a "$LOG"
}

# run_step NAME [RESERVE_S]: runs step_NAME under a timeout that leaves RESERVE_S (default 25) of
# the budget for the steps after it and the summary.
run_step() {
  local name=$1 reserve=${2:-25}
  STEPS+=("$name")
  local left=$((BUDGET - (SECONDS - START) - reserve))
  if [ $left -lt 5 ]; then
    RESULT[$name]="NOT RUN (time budget spent)"
    SECS[$name]=0
    say "$name: not run, the time budget is spent"
    return
  fi
  say "$name: started (at most ${left} s)"
  local begin=$SECONDS
  timeout -k 10 "$left" bash -c "step_$name" </dev/null 2>&1 \
    | tee "$SCRATCH/$name.log" | stamp "$name" >>"$LOG"
  local rc=${PIPESTATUS[0]}
  SECS[$name]=$((SECONDS - begin))
  case $rc in
    0) RESULT[$name]="ok" ;;
    124 | 137) RESULT[$name]="TIMED OUT after ${left} s" ;;
    *) RESULT[$name]="FAILED (exit $rc)" ;;
  esac
  say "$name: ${RESULT[$name]} in ${SECS[$name]} s"
}

# skip_step NAME WHY: records a step that is not run (not a failure by itself).
skip_step() {
  STEPS+=("$1")
  RESULT[$1]="skipped ($2)"
  SECS[$1]=0
  say "$1: skipped ($2)"
}

ok() { [ "${RESULT[$1]:-}" = ok ]; }

say "out $OUT, preset $PRESET ($BUILD_DIR), -j $JOBS, commit $FLASHKIT_GIT_COMMIT," \
  "budget ${BUDGET} s"
run_step env
run_step configure
if ok configure; then run_step build; else skip_step build "configure failed"; fi

SM80_RERUNS=" ${FLASHKIT_SM80_RERUNS:-fwd bwd} "
for t in gpu_tests gpu_tests_sm80 gpu_tests_bwd_sm80 cpu_tests python_tests; do
  if [ "${FLASHKIT_SKIP_TESTS:-0}" = 1 ]; then skip_step $t "FLASHKIT_SKIP_TESTS=1"
  elif [[ $t = gpu_tests*sm80 ]] && [ "${FLASHKIT_SKIP_SM80_RERUN:-0}" = 1 ]; then
    skip_step $t "FLASHKIT_SKIP_SM80_RERUN=1"
  elif [ $t = gpu_tests_sm80 ] && [[ $SM80_RERUNS != *" fwd "* ]]; then
    skip_step $t "not in FLASHKIT_SM80_RERUNS"
  elif [ $t = gpu_tests_bwd_sm80 ] && [[ $SM80_RERUNS != *" bwd "* ]]; then
    skip_step $t "not in FLASHKIT_SM80_RERUNS"
  elif [ $t = python_tests ] && [[ " ${FLASHKIT_CMAKE_ARGS:-} " == *" -DFLASHKIT_PYTHON=OFF "* ]]; then
    skip_step $t "FLASHKIT_CMAKE_ARGS builds no extension (-DFLASHKIT_PYTHON=OFF)"
  elif ok build; then run_step $t
  else skip_step $t "no build"; fi
done
if [ "${FLASHKIT_SANITIZE:-0}" = 1 ]; then
  for t in memcheck racecheck synccheck; do
    if ok build; then run_step $t; else skip_step $t "no build"; fi
  done
fi

if [ "${FLASHKIT_SKIP_BENCH:-0}" = 1 ]; then
  for t in bench peers report; do skip_step $t "FLASHKIT_SKIP_BENCH=1"; done
elif ! ok build; then
  for t in bench peers report; do skip_step $t "no build"; done
else
  run_step bench
  if [ "${FLASHKIT_SKIP_PEERS:-0}" = 1 ]; then
    skip_step peers "FLASHKIT_SKIP_PEERS=1"
  else
    run_step peers
  fi
  run_step report 5
fi

# ---- the summary ---------------------------------------------------------------------------------

# "P passed, F failed, S skipped" from a GoogleTest log, then the names of the failed tests.
test_counts() {
  local log=$1 passed skipped failed
  if ! grep -q '^\[==========\] .* ran\.' "$log" 2>/dev/null; then
    echo "did not finish: see gpu_check.log"
    return
  fi
  passed=$(sed -n 's/^\[  PASSED  \] \([0-9]*\) tests\{0,1\}\..*/\1/p' "$log" | tail -1)
  skipped=$(sed -n 's/^\[  SKIPPED \] \([0-9]*\) tests\{0,1\}, listed.*/\1/p' "$log" | tail -1)
  failed=$(sed -n 's/^\[  FAILED  \] \([0-9]*\) tests\{0,1\}, listed.*/\1/p' "$log" | tail -1)
  echo "${passed:-0} passed, ${failed:-0} failed, ${skipped:-0} skipped"
  grep '^\[  FAILED  \] [A-Za-z_]' "$log" | awk '{ sub(/,$/, "", $4); print "    failed: " $4 }' \
    | sort -u | head -20
}

# last_line STEP PATTERN: the step's last output line matching PATTERN, if the step ran.
last_line() {
  if [ -e "$SCRATCH/$1.log" ]; then
    local line
    line=$(grep -h "$2" "$SCRATCH/$1.log" | tail -1)
    echo "$1: ${line:-no final line: see gpu_check.log}"
  fi
}

summary() {
  local tables=("$OUT"/*.md)
  echo
  echo "==================== gpu_check summary ===================="
  if [ -e "${tables[0]}" ]; then cat "${tables[0]}"; echo; fi
  for s in "${STEPS[@]}"; do
    case ${RESULT[$s]} in
      ok | skipped*) ;;
      *)
        if [ -s "$SCRATCH/$s.log" ]; then
          echo "---- last lines of $s ----"
          tail -30 "$SCRATCH/$s.log"
        fi
        ;;
    esac
  done
  echo "GPU: $(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -1), driver" \
       "${FLASHKIT_DRIVER:-?}; $(nvcc --version 2>/dev/null | grep -o 'release [0-9.]*'); commit" \
       "$FLASHKIT_GIT_COMMIT; preset $PRESET"
  printf '%-10s %-32s %s\n' step result seconds
  for s in "${STEPS[@]}"; do printf '%-10s %-32s %s\n' "$s" "${RESULT[$s]}" "${SECS[$s]}"; done
  if ok build; then echo "build time: $(cat "$OUT/build_time.txt") s with -j $JOBS$INCREMENTAL"; fi
  for t in gpu_tests gpu_tests_sm80 gpu_tests_bwd_sm80 cpu_tests; do
    if [ -e "$SCRATCH/$t.log" ]; then echo "$t: $(test_counts "$SCRATCH/$t.log")"; fi
  done
  last_line python_tests ' in [0-9.]*s'
  last_line memcheck 'SUMMARY:'
  last_line racecheck 'SUMMARY:'
  last_line synccheck 'SUMMARY:'
  last_line bench 'cases failed'
  last_line peers 'have no number'
  echo "files in $OUT:" "$(cd "$OUT" && echo *)"
}

summary 2>&1 | tee -a "$LOG"
failed=0
for s in "${STEPS[@]}"; do
  case ${RESULT[$s]} in ok | skipped*) ;; *) failed=$((failed + 1)) ;; esac
done
say "$failed step(s) failed; $((SECONDS - START)) s in all"
[ $failed -eq 0 ]
