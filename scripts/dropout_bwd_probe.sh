#!/usr/bin/env bash
# scripts/dropout_bwd_probe.sh OUT_DIR [SRC]: where the sm90 backward's dropout time goes, in one device
# call (bf16 d128, sm90). Builds the bench from SRC (default: this tree) and from copies of it with
# one edit each of the dropout instance. Three are timing-only ablations (their masks are wrong:
# never test them):
#   nodraw   the loop does not draw the next query block's marks (store_drop_marks in the tail)
#   noapply  kept_transposed returns its input (the marks are loaded but not applied)
#   none     both: what is left is the instance's structure (P^T / (1 - p), the dS^T formula,
#            shared memory, registers and spills)
# and one is a candidate with the same mask:
#   early    the next block's marks are drawn right after S^T and dP^T are issued (products with
#            both operands in shared memory, and a window the scores' wait leaves nearly empty)
#            instead of after dQ's issue, under dV and dK (register A operands) and dQ
# Then scripts/ncu_bwd.sh on the p = 0 and p = 0.1 instances at 8k (while the edited copies build), and
# flashkit_bench --op bwd on 2k, 8k x causal both: SRC at p = 0 and p = 0.1 and each edit at
# p = 0.1, in two alternating rounds, with nvidia-smi's SM clock and power sampled beside each run.
# Prints the mean clock and power per run, a table of TFLOP/s (columns <tree>-p<p>-<round>) and
# leaves OUT_DIR/probe.tgz (logs, bench JSON, ncu pages) and OUT_DIR/probe-reps.tgz (ncu reports).
set -uo pipefail

if [ $# -lt 1 ]; then
  echo "usage: scripts/dropout_bwd_probe.sh OUT_DIR [SRC]" >&2
  exit 2
fi
mkdir -p "$1" || exit 2
OUT=$(cd "$1" && pwd)
SRC=$(cd "${2:-$(dirname "$0")/..}" && pwd)
HERE=$(cd "$(dirname "$0")" && pwd)
export PATH=/usr/local/cuda/bin:$PATH
R=$OUT/probe
mkdir -p "$R"
T0=$SECONDS
elapsed() { echo "[$((SECONDS - T0)) s]"; }

# The edits; a copy whose edit did not apply is not built.
edit() {  # edit VARIANT DST
  local kernel=$2/src/cuda/sm90/bwd_kernel_sm90.cuh mask=$2/src/cuda/common/dropout_mask.cuh
  mkdir -p "$2" && (cd "$SRC" && tar cf - --exclude=./.git --exclude=./.hx --exclude=./.deps --exclude='./build*' .) |
    (cd "$2" && tar xf -) || return 1
  if [ "$1" = nodraw ] || [ "$1" = none ]; then
    sed -i 's/if (prefetch) store_drop_marks(m_block + 1, stage ^ 1);/;/' "$kernel"
    ! grep -q "store_drop_marks(m_block + 1" "$kernel" || return 1
  fi
  if [ "$1" = noapply ] || [ "$1" = none ]; then
    sed -i 's/return __uint_as_float(__float_as_uint(x) \& ~dropped);/return x;/' "$mask"
    grep -q "return x;" "$mask" || return 1
  fi
  if [ "$1" = early ]; then
    python3 - "$kernel" <<'PY' || return 1
import sys
path = sys.argv[1]
text = open(path).read()
draw = ("      if constexpr (Traits::kDropout && !Traits::kSplitHeadDim) {\n"
        "        if (prefetch) store_drop_marks(m_block + 1, stage ^ 1);\n"
        "      }\n")
anchor = "      const bool cut = !window.block_unmasked("
assert text.count(draw) == 1 and text.count(anchor) == 1
open(path, "w").write(text.replace(draw, "").replace(anchor, draw + anchor))
PY
  fi
}
build() {  # build NAME TREE JOBS
  cmake -S "$2" -B "/tmp/probe-$1" -G Ninja -DCMAKE_BUILD_TYPE=Release -DCMAKE_CUDA_ARCHITECTURES=90 \
    -DFLASHKIT_HEAD_DIMS=128 -DFLASHKIT_DTYPES=bf16 -DFLASHKIT_TESTS=OFF -DFLASHKIT_PYTHON=OFF >"$R/build-$1.log" 2>&1 &&
    cmake --build "/tmp/probe-$1" -j "$3" --target flashkit_bench >>"$R/build-$1.log" 2>&1
  echo "build $1: rc $? $(elapsed)"
}

VARIANTS=(nodraw noapply none early)
build src "$SRC" "$(nproc)"
(
  for v in "${VARIANTS[@]}"; do
    if edit "$v" "/tmp/probe-src-$v"; then build "$v" "/tmp/probe-src-$v" 4 & else echo "edit $v did not apply"; fi
  done
  wait
) >"$R/variant-builds.txt" 2>&1 &
builds=$!
timeout 150 bash "$HERE/ncu_bwd.sh" /tmp/probe-src "$R" bf16:128:8k:no:0 bf16:128:8k:no:0.1
echo "ncu: rc $? $(elapsed)"
wait $builds
cat "$R/variant-builds.txt"

GRID=(--dtype bf16 --hdim 128 --seqlen 2k,8k --causal both --op bwd)
# Each run with the SM clock and board power sampled beside it (a dropout instance that ran at a lower
# clock would show it here, not in its instruction count).
bench() {  # bench TREE P ROUND
  [ -x "/tmp/probe-$1/bench/flashkit_bench" ] || return
  local tag=$1-p$2-$3
  nvidia-smi --query-gpu=clocks.sm,power.draw --format=csv,noheader,nounits -lms 100 >"$R/smi-$tag.csv" 2>/dev/null &
  local smi=$!
  timeout 30 "/tmp/probe-$1/bench/flashkit_bench" "${GRID[@]}" --dropout "$2" --json "$R/bench-$tag.json" \
    >"$R/bench-$tag.txt" 2>&1
  local rc=$?
  kill $smi 2>/dev/null
  echo "bench $tag: rc $rc $(elapsed)"
}
for round in 1 2; do
  bench src 0 $round
  bench src 0.1 $round
  for v in "${VARIANTS[@]}"; do bench "$v" 0.1 $round; done
done
python3 - "$R" <<'PY'
import collections, glob, json, sys
results = collections.defaultdict(dict)
for path in sorted(glob.glob(sys.argv[1] + "/bench-*.json")):
    tag = path.split("/bench-")[1][:-len(".json")]
    try:
        data = json.load(open(path))
    except (OSError, ValueError) as error:
        print(path, error)
        continue
    for rec in data.get("records") or data.get("results") or []:
        results[(rec["causal"], rec["seqlen_q"])][tag] = rec["tflops"]
# Mean SM clock (MHz) and power (W) over the samples of each run drawing more than 300 W (the
# kernels' stretches, not the host's setup between them).
for path in sorted(glob.glob(sys.argv[1] + "/smi-*.csv")):
    samples = []
    for line in open(path):
        try:
            clock, power = (float(x) for x in line.split(","))
        except ValueError:
            continue
        if power > 300:
            samples.append((clock, power))
    if samples:
        print(f"{path.split('/smi-')[1][:-4]}: {sum(c for c, _ in samples) / len(samples):.0f} MHz, "
              f"{sum(p for _, p in samples) / len(samples):.0f} W over {len(samples)} samples")
tags = sorted({tag for cell in results.values() for tag in cell})
print("| causal | seqlen | " + " | ".join(tags) + " |")
print("| --- | --- | " + " | ".join("---" for _ in tags) + " |")
for key in sorted(results):
    print(f"| {key[0]} | {key[1]} | " + " | ".join(f"{results[key].get(t, 0):.1f}" for t in tags) + " |")
PY
cd "$OUT" && tar czf probe-reps.tgz probe/.ncu-* 2>/dev/null; rm -f probe/.ncu-*
tar czf probe.tgz probe && rm -rf probe
echo "done $(elapsed)"
