#!/usr/bin/env bash
# scripts/ab_branch.sh OUT_DIR: one device call that measures a change against this checkout, the way
# bench/NOTES.md wants it (same run, alternated rounds): A = the repository root (e.g. main), B = the
# tree at $AB_B (a worktree path relative to the root, e.g. .hx/mybranch, carried to the device).
#
#   1. builds A (flashkit_bench) and B (flashkit_bench, flashkit_gpu_tests) side by side, from
#      scratch (a warm device machine keeps /tmp), sm_90a, families $AB_FAMILIES (default
#      "64;128;256"), dtypes $AB_DTYPES (default bf16)
#   2. with $AB_TESTS, B's GPU tests with that gtest filter (timeout $AB_TEST_TIMEOUT, 200 s), first,
#      so that a branch that hangs costs the timeout and the benchmark still runs
#   3. flashkit_bench on the same grid, A, B, A, B: --hdim $AB_HDIMS (64,128,256) --seqlen $AB_SEQ
#      (2k,8k,16k) --causal both --op $AB_OPS (fwd) plus $AB_BENCH_ARGS (e.g. "--dropout 0.1"), each
#      run cut off after $AB_BENCH_TIMEOUT (150) s
#   4. with $AB_RACECHECK, compute-sanitizer racecheck of B's GPU tests with that filter
#      (timeout $AB_RACECHECK_TIMEOUT, 60 s)
# Before the tests it prints, per sm90 kernel object, how many kernels' wgmma loops B moved
# (scripts/sass_loops.py --diff; the details in ab.tgz's sass-loops-diff.txt).
# OUT_DIR receives ab.md (per cell: A1 A2 B1 B2 TFLOP/s and B / A of the means), ab.tgz (every log
# and JSON) and racecheck-B.log.
#
#   AB_B=.hx/x AB_FAMILIES=128 AB_HDIMS=128 AB_SEQ=2k,8k AB_TESTS='*Fwd*' bash scripts/ab_branch.sh $OUT
set -u
if [ $# -ne 1 ] || [ -z "${AB_B:-}" ]; then
  echo "usage: AB_B=<worktree path> scripts/ab_branch.sh OUT_DIR" >&2
  exit 2
fi
FINAL=$(mkdir -p "$1" && cd "$1" && pwd)
cd "$(dirname "$0")/.." || exit 2
ROOT=$PWD
WORK=/tmp/ab-branch-work
rm -rf "$WORK" && mkdir -p "$WORK"
export PATH=/usr/local/cuda/bin:$PATH

# shellcheck source=scripts/ab_common.sh
source "$ROOT/scripts/ab_common.sh"
rm -rf /tmp/ab-A /tmp/ab-B  # from scratch: a measured pair is built the same way
ab_build_tree A "$ROOT" "$WORK" 8 flashkit_bench &
ab_build_tree B "$ROOT/$AB_B" "$WORK" 8 flashkit_bench flashkit_gpu_tests &
wait

# Which wgmma kernels' loops the change moved, instance by instance (dropout, split and window
# instances too: a change can leave every p = 0 loop alone and still move another's schedule).
for obj in /tmp/ab-A/src/CMakeFiles/flashkit_sm90_kernels.dir/generated/*.o; do
  other=/tmp/ab-B/src/CMakeFiles/flashkit_sm90_kernels.dir/generated/$(basename "$obj")
  [ -f "$other" ] || continue
  echo "== $(basename "$obj")"
  python3 "$ROOT/scripts/sass_loops.py" --diff "$obj" "$other"
done >"$WORK/sass-loops-diff.txt" 2>&1
echo "sass loops (B against A):"; grep -E "^==|kernels' loops differ" "$WORK/sass-loops-diff.txt" | paste - - | sed 's/^/  /'

if [ -n "${AB_TESTS:-}" ]; then
  timeout "${AB_TEST_TIMEOUT:-200}" /tmp/ab-B/tests/cpp/flashkit_gpu_tests --gtest_filter="$AB_TESTS" \
    --gtest_output="json:$WORK/gpu-tests-B.json" >"$WORK/gpu-tests-B.log" 2>&1
  echo "gpu tests B: $?"
  grep -E "^\[  (PASSED|FAILED)" "$WORK/gpu-tests-B.log" | tail -5
fi
dtypes=$(echo "${AB_DTYPES:-bf16}" | tr ';' ',')
read -r -a extra <<<"${AB_BENCH_ARGS:-}"
for round in 1 2; do
  for tree in A B; do
    timeout "${AB_BENCH_TIMEOUT:-150}" "/tmp/ab-$tree/bench/flashkit_bench" --dtype "$dtypes" --hdim "${AB_HDIMS:-64,128,256}" \
      --seqlen "${AB_SEQ:-2k,8k,16k}" --causal both --op "${AB_OPS:-fwd}" "${extra[@]}" \
      --json "$WORK/bench-$tree-$round.json" >"$WORK/bench-$tree-$round.txt" 2>&1
    echo "bench $tree round $round: $?"
  done
done

python3 - "$WORK" <<'PY' | tee "$FINAL/ab.md"
import collections, glob, json, sys
work = sys.argv[1]
cells = collections.defaultdict(dict)
for path in sorted(glob.glob(f"{work}/bench-*-*.json")):
    tree, rnd = path.rsplit("/", 1)[1][len("bench-"):-len(".json")].split("-")
    for rec in json.load(open(path))["records"]:
        key = (rec["op"], rec["dtype"], rec["head_dim"], rec["causal"], rec["seqlen_q"])
        cells[key][tree + rnd] = rec["tflops"]
print("| op | dtype | hdim | causal | seqlen | A1 | A2 | B1 | B2 | B/A (mean) |")
print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
for key in sorted(cells):
    t = cells[key]
    a = (t.get("A1", 0) + t.get("A2", 0)) / 2
    b = (t.get("B1", 0) + t.get("B2", 0)) / 2
    runs = " | ".join(f"{t.get(k, 0):.1f}" for k in ("A1", "A2", "B1", "B2"))
    print(f"| {' | '.join(str(k) for k in key)} | {runs} | {b / a if a else 0:.3f} |")
PY

if [ -n "${AB_RACECHECK:-}" ]; then
  timeout "${AB_RACECHECK_TIMEOUT:-60}" compute-sanitizer --tool racecheck --error-exitcode 99 \
    /tmp/ab-B/tests/cpp/flashkit_gpu_tests --gtest_filter="$AB_RACECHECK" >"$FINAL/racecheck-B.log" 2>&1
  echo "racecheck B: $?"
  grep -E "RACECHECK SUMMARY|^\[  (PASSED|FAILED)" "$FINAL/racecheck-B.log" | tail -3
fi
(cd "$WORK" && tar czf "$FINAL/ab.tgz" .)
