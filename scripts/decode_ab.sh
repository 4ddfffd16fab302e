#!/usr/bin/env bash
# scripts/decode_ab.sh OUT_DIR A_TREE B_TREE: the decode path of two source trees side by side in
# one device call. Builds A (flashkit_bench_decode) and B (that, and the GPU and CPU tests) in
# parallel, then runs, in this order of priority (a run cut short keeps what came first): B's kvcache
# GPU tests; flashkit_bench_decode on one grid alternating A, B, A, B; SDPA flash and cuDNN on the
# same grid (bench/peers_decode.py, merged with B's second round); a table of A and B per cell
# (TB/s and us per call; B / A, and each against cuDNN) in OUT/ab.md; B once more with AB_SWEEP's
# arguments (e.g. a --splits sweep); the CPU tests; memcheck and racecheck.
# Knobs: AB_GRID (flashkit_bench_decode arguments), AB_SWEEP, AB_B_FAMILIES (head dims of B's
# build), AB_SANITIZE_FILTER, AB_SANITIZE_TIMEOUT, FLASHKIT_GTEST_SOURCE_DIR, FLASHKIT_GIT_COMMIT
# (B's commit). Raw logs and JSON end in OUT/logs.tgz.
set -u
OUT=$1 A=$(cd "$2" && pwd) B=$(cd "$3" && pwd)
export PATH=/usr/local/cuda/bin:$PATH
read -r -a grid <<<"${AB_GRID:---batch 1,8,64 --cache 8k,32k,128k --pages 0,16}"
logs=$OUT/logs
mkdir -p "$logs"
jobs=$(( $(nproc) / 2 ))

build() {  # build NAME SRC FAMILIES DTYPES TESTS TARGETS...
  local name=$1 src=$2 families=$3 dtypes=$4 tests=$5 begin=$SECONDS
  shift 5
  cmake -S "$src" -B "/tmp/dab-$name" -G Ninja -DCMAKE_BUILD_TYPE=Release -DCMAKE_CUDA_ARCHITECTURES=90 \
    -DFLASHKIT_HEAD_DIMS="$families" -DFLASHKIT_DTYPES="$dtypes" -DFLASHKIT_SM90=OFF \
    -DFLASHKIT_TESTS="$tests" -DFLASHKIT_PYTHON=OFF \
    ${FLASHKIT_GTEST_SOURCE_DIR:+-DFLASHKIT_GTEST_SOURCE_DIR=$FLASHKIT_GTEST_SOURCE_DIR} \
    >"$logs/build-$name.log" 2>&1 &&
    cmake --build "/tmp/dab-$name" -j "$jobs" --target "$@" >>"$logs/build-$name.log" 2>&1
  echo "build $name: rc $?, $((SECONDS - begin)) s"
}
build A "$A" 128 bf16 OFF flashkit_bench_decode &
build B "$B" "${AB_B_FAMILIES:-64;128;256}" "bf16;fp16" ON flashkit_bench_decode flashkit_gpu_tests \
  flashkit_cpu_tests &
wait
[ -x /tmp/dab-A/bench/flashkit_bench_decode ] && [ -x /tmp/dab-B/bench/flashkit_bench_decode ] ||
  { tail -40 "$logs"/build-*.log; exit 1; }

tests=/tmp/dab-B/tests/cpp
timeout 150 "$tests/flashkit_gpu_tests" --gtest_filter='*Kvcache*:*Decode*' >"$logs/gpu_tests.log" 2>&1
echo "gpu tests: rc $? $(grep -E '^\[  (PASSED|FAILED|SKIPPED) ' "$logs/gpu_tests.log" | tr '\n' ' ')"
grep -E '^\[  FAILED  \]' "$logs/gpu_tests.log" | head -20
for round in 1 2; do
  for v in A B; do
    /tmp/dab-$v/bench/flashkit_bench_decode "${grid[@]}" --json "$logs/decode-$v-$round.json" \
      >"$logs/decode-$v-$round.txt" 2>&1
    echo "bench $v round $round: rc $?"
  done
done
stem=$OUT/h200-decode
FLASHKIT_GIT_COMMIT=${FLASHKIT_GIT_COMMIT:-unknown} python3 "$B/bench/peers_decode.py" "${grid[@]}" \
  --flashkit "$logs/decode-B-2.json" --json "$stem.json" --md "$stem.md" >"$logs/peers.log" 2>&1
echo "peers: rc $?"

python3 - "$logs" "$stem.json" >"$OUT/ab.md" <<'PY'
import json, sys, statistics
logs, peers = sys.argv[1], sys.argv[2]
cell = {}
for v in "AB":
    for r in (1, 2):
        for rec in json.load(open(f"{logs}/decode-{v}-{r}.json"))["records"]:
            key = (rec["batch"], rec["seqlen_k"], rec.get("layout", "contiguous"))
            cell.setdefault(key, {}).setdefault(v, []).append(rec)
cudnn = {}
try:
    for rec in json.load(open(peers))["records"]:
        if rec["impl"] == "sdpa_cudnn" and rec["tbps"]:
            cudnn[(rec["batch"], rec["seqlen_k"])] = rec["tbps"]
except Exception as e:
    print(f"(no peers: {e})")
print("| batch | cache | layout | splits | A TB/s | B TB/s | A us | B us | B - A us | B / A | A / cuDNN | B / cuDNN |")
print("|---" * 12 + "|")
for key in sorted(cell):
    a, b = cell[key].get("A", []), cell[key].get("B", [])
    if not a or not b or any(r["tbps"] is None for r in a + b):
        continue
    ta = statistics.mean(r["tbps"] for r in a); tb = statistics.mean(r["tbps"] for r in b)
    ua = 1e3 * statistics.mean(r["ms"] for r in a); ub = 1e3 * statistics.mean(r["ms"] for r in b)
    c = cudnn.get(key[:2])
    f = lambda x: f"{x:.2f}" if x else "-"
    print(f"| {key[0]} | {key[1]} | {key[2]} | {b[0].get('splits', '-')} | {ta:.3f} | {tb:.3f} | "
          f"{ua:.1f} | {ub:.1f} | {ub - ua:+.1f} | {tb / ta:.3f} | {f(c and ta / c)} | {f(c and tb / c)} |")
PY
cat "$OUT/ab.md"
if [ -n "${AB_SWEEP:-}" ]; then
  read -r -a sweep <<<"$AB_SWEEP"
  /tmp/dab-B/bench/flashkit_bench_decode "${sweep[@]}" --json "$logs/sweep-B.json" >"$logs/sweep-B.txt" 2>&1
  echo "sweep B: rc $?"
fi
"$tests/flashkit_cpu_tests" >"$logs/cpu_tests.log" 2>&1
echo "cpu tests: rc $? $(grep -E '^\[  (PASSED|FAILED) ' "$logs/cpu_tests.log" | tr '\n' ' ')"
filter=${AB_SANITIZE_FILTER:-Splits/*:GpuKvcache.SplitCounters*:GpuKvcache.Empty*:GqaSeqlenQ/*hq16_hkv1*}
for tool in memcheck racecheck; do
  timeout "${AB_SANITIZE_TIMEOUT:-90}" compute-sanitizer --tool "$tool" --error-exitcode 9 "$tests/flashkit_gpu_tests" \
    --gtest_filter="$filter" >"$logs/sanitize-$tool.log" 2>&1
  echo "sanitizer $tool: rc $? $(grep -E 'ERROR SUMMARY|^\[  (PASSED|FAILED) ' "$logs/sanitize-$tool.log" | tr '\n' ' ')"
done

echo "batch-1 lines (per call between events, back to back, host enqueue), A then B, round 2:"
grep -h "batch    1 " "$logs/decode-A-2.txt" "$logs/decode-B-2.txt"
tar -C "$OUT" -czf "$OUT/logs.tgz" logs && rm -rf "$logs"
