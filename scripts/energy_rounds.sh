#!/usr/bin/env bash
# scripts/energy_rounds.sh OUT_DIR: flashkit beside PyTorch's attention backends, speed and energy
# per FLOP, in alternated rounds (flashkit first in odd rounds, the peers first in even ones, so
# that neither always runs on the cooler GPU), with nvidia-smi sampling the SM clock and power.
# Under the power limit the time per call follows the energy per call (bench/NOTES.md,
# "Session 10"), so TFLOP per joule says which kernel would be faster at the same power.
#
#   ENERGY_ROUNDS=2 ENERGY_ARGS="--dtype bf16 --hdim 64,128 --seqlen 2k,8k --causal both" \
#     ENERGY_IMPLS=sdpa_cudnn,sdpa_flash ENERGY_OP=fwd bash scripts/energy_rounds.sh $OUT
# With energy, each cell also gets the speed sustained over the 1 s energy window (TFLOP per joule x
# mean power) and its ratio: the timed calls (>= 100 ms after a 25 ms warm-up) can run before the
# power limiter settles, so their ratio carries that transient (bench/NOTES.md, session 13).
# ENERGY_MEASURE=0 leaves --energy out (speed only, about a third of the time per cell): rounds of a
# whole grid, whose per-cell medians of flashkit / peer and their geometric mean say how much of
# one run's ratio is the run's draw (cuDNN's figures move by 5-14% between runs).
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
energy=(--energy)
[ "${ENERGY_MEASURE:-1}" = 0 ] && energy=()
run_flashkit() {
  "$BENCH" --op "$op" "${grid[@]}" "${energy[@]}" --json "$work/flashkit-$1.json" >"$work/flashkit-$1.log" 2>&1
}
run_peers() {
  python3 bench/peers.py --ops "$op" "${grid[@]}" --impls "${ENERGY_IMPLS:-sdpa_cudnn,sdpa_flash}" \
    "${energy[@]}" --json "$work/peers-$1.json" >"$work/peers-$1.log" 2>&1
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
import collections, glob, json, re, statistics, sys
sys.path.insert(0, "bench")
from report import flop_per_joule, ratio_summary, sustained_tflops
# cells[key][impl][round] = the record
cells = collections.defaultdict(lambda: collections.defaultdict(dict))
for path in glob.glob(f"{sys.argv[1]}/*-round*.json"):
    rnd = int(re.search(r"round(\d+)", path).group(1))
    for r in json.load(open(path))["records"]:
        if r.get("tflops"):
            key = (r["dtype"], r["head_dim"], "causal" if r["causal"] else "full", r["seqlen_q"])
            cells[key][r["impl"]][rnd] = r
impls = sorted({i for c in cells.values() for i in c}, key=lambda i: (i != "flashkit", i))
peers = [i for i in impls if i != "flashkit"]
with_energy = all(flop_per_joule(r) for c in cells.values() for runs in c.values() for r in runs.values())
# With energy, each cell also gets the speed sustained over the 1 s energy window (TFLOP per joule x
# mean power), and the ratios are given for it too.
what = ("TFLOP/s | TFLOP per joule | watts | sustained TFLOP/s" if with_energy else "TFLOP/s")
print(f"## Medians over the rounds: {what}; flashkit / peer: the median of the rounds' ratios\n")
measures = [("", lambda r: r["tflops"])] + ([(" sustained", sustained_tflops)] if with_energy else [])
ratio_heads = [f"flashkit / {p}{name}" for name, _ in measures for p in peers]
print("| cell | " + " | ".join(impls + ratio_heads) + " |")
print("|" + " --- |" * (len(impls) + len(ratio_heads) + 1))
ratios = collections.defaultdict(list)
for key in sorted(cells):
    row = []
    for impl in impls:
        runs = list(cells[key].get(impl, {}).values())
        if not runs:
            row.append("—")
            continue
        speed = statistics.median(r["tflops"] for r in runs)
        if with_energy:
            per_joule = statistics.median(flop_per_joule(r) for r in runs)
            watts = statistics.median(r["watts"] for r in runs)
            sustained = statistics.median(sustained_tflops(r) for r in runs)
            row.append(f"{speed:.0f} / {per_joule:.3f} / {watts:.0f} W / {sustained:.0f}")
        else:
            row.append(f"{speed:.0f}")
    for name, read in measures:
        for peer in peers:
            mine, theirs = cells[key].get("flashkit", {}), cells[key].get(peer, {})
            both = [read(mine[r]) / read(theirs[r]) for r in mine if r in theirs]
            if both:
                ratios[peer + name].append(statistics.median(both))
                row.append(f"{statistics.median(both):.3f} ({min(both):.2f}-{max(both):.2f})")
            else:
                row.append("—")
    print(f"| {' '.join(map(str, key))} | " + " | ".join(row) + " |")
print()
for peer, values in ratios.items():
    print(ratio_summary("flashkit", peer, values, of="the cells' medians"))
PY
} >"$OUT/energy.md"
tar -C "$work" -czf "$OUT/rounds.tgz" .
cat "$OUT/energy.md" | grep -A100 "Medians over"
