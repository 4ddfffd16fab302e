#!/usr/bin/env bash
# scripts/energy_rounds.sh OUT_DIR: flashkit beside PyTorch's attention backends, speed and energy
# per FLOP, in alternated rounds (flashkit first in odd rounds, the peers first in even ones, so
# that neither always runs on the cooler GPU), with nvidia-smi sampling the SM clock and power.
# Under the power limit the time per call follows the energy per call (bench/NOTES.md,
# "Session 10"), so TFLOP per joule says which kernel would be faster at the same power.
#
#   ENERGY_ROUNDS=2 ENERGY_ARGS="--dtype bf16 --hdim 64,128 --seqlen 2k,8k --causal both" \
#     ENERGY_IMPLS=sdpa_cudnn,sdpa_flash ENERGY_OP=fwd bash scripts/energy_rounds.sh $OUT
# Needs a built flashkit_bench in $ENERGY_BUILD (default build-hopper: scripts/gpu_check.sh with
# FLASHKIT_SKIP_TESTS=1 FLASHKIT_SKIP_BENCH=1 builds it). Writes to OUT_DIR: energy.md (every
# round's tables from bench/report.py, then the medians over rounds), smi.csv, rounds.tgz (the
# JSON of each run).
set -u
OUT=$(mkdir -p "$1" && cd "$1" && pwd)
cd "$(dirname "$0")/.." || exit 2
BENCH="${ENERGY_BUILD:-build-hopper}/bench/flashkit_bench"
[ -x "$BENCH" ] || { echo "energy_rounds.sh: no $BENCH: build it first" >&2; exit 2; }
read -r -a grid <<<"${ENERGY_ARGS:---dtype bf16 --hdim 64,128 --seqlen 2k,8k --causal both}"
op=${ENERGY_OP:-fwd}
work=$(mktemp -d)
nvidia-smi --query-gpu=timestamp,clocks.sm,power.draw,power.limit,temperature.gpu,clocks_event_reasons.sw_power_cap \
  --format=csv,noheader -lms 200 >"$OUT/smi.csv" 2>&1 &
smi=$!
run_flashkit() {
  "$BENCH" --op "$op" "${grid[@]}" --energy --json "$work/flashkit-$1.json" >"$work/flashkit-$1.log" 2>&1
}
run_peers() {
  python3 bench/peers.py --ops "$op" "${grid[@]}" --impls "${ENERGY_IMPLS:-sdpa_cudnn,sdpa_flash}" \
    --energy --json "$work/peers-$1.json" >"$work/peers-$1.log" 2>&1
}
for round in $(seq 1 "${ENERGY_ROUNDS:-2}"); do
  date +"%H:%M:%S round $round" | tee -a "$work/marks.txt"
  if [ $((round % 2)) = 1 ]; then run_flashkit "$round"; run_peers "$round"
  else run_peers "$round"; run_flashkit "$round"; fi
  python3 bench/report.py --out-dir "$work" --what "round$round" \
    "$work/flashkit-$round.json" "$work/peers-$round.json" >/dev/null
done
kill "$smi"
{
  for md in "$work"/*-round*.md; do cat "$md"; echo; done
  python3 - "$work" <<'PY'
import collections, glob, json, statistics, sys
cells = collections.defaultdict(lambda: collections.defaultdict(lambda: ([], [])))
for path in glob.glob(f"{sys.argv[1]}/*-round*.json"):
    for r in json.load(open(path))["records"]:
        if r.get("tflops") and r.get("watts"):
            key = (r["dtype"], r["head_dim"], "causal" if r["causal"] else "full", r["seqlen_q"])
            speed, energy = cells[key][r["impl"]]
            speed.append(r["tflops"])
            energy.append(r["tflops"] / r["watts"])
impls = sorted({i for c in cells.values() for i in c}, key=lambda i: (i != "flashkit", i))
print("## Medians over the rounds: TFLOP/s | TFLOP per joule | watts\n")
print("| cell | " + " | ".join(impls) + " |")
print("|" + " --- |" * (len(impls) + 1))
for key in sorted(cells):
    row = []
    for impl in impls:
        s, e = cells[key].get(impl, ([], []))
        row.append(f"{statistics.median(s):.0f} / {statistics.median(e):.3f} / "
                   f"{statistics.median(s) / statistics.median(e):.0f} W" if s else "—")
    print(f"| {' '.join(map(str, key))} | " + " | ".join(row) + " |")
PY
} >"$OUT/energy.md"
tar -C "$work" -czf "$OUT/rounds.tgz" .
cat "$OUT/energy.md" | grep -A100 "Medians over"
