#!/usr/bin/env bash
# scripts/ab_rounds.sh OUT_DIR: more alternated rounds of the benchmark for two trees, A = this
# checkout and B = $AB_B, in /tmp/ab-A and /tmp/ab-B (scripts/ab_common.sh: a tree scripts/ab_branch.sh
# built is brought up to date for $AB_FAMILIES / $AB_DTYPES, a fresh machine builds it),
# with nvidia-smi sampling the SM clock, power and clock-event reasons beside them, so that a
# difference in cycles can be told from a difference in clocks (a power-capped GPU lowers its clock
# when the same energy is spent in fewer cycles).
#
#   AB_B=.hx/x AB_ROUNDS=5 AB_BENCH_ARGS="--dtype bf16 --hdim 128 --seqlen 8k,16k --causal both" \
#     bash scripts/ab_rounds.sh $OUT
# With --energy in AB_BENCH_ARGS (both trees must have it) the energy per call is compared too.
# AB_NCU="op:dtype:hdim:seqlen:causal ..." (e.g. "fwd:bf16:128:8k:yes") then profiles three launches
# of each cell and tree with Nsight Compute at the base clock (its default clock control), so that
# the comparison of cycles is free of the power cap's clock (bench/NOTES.md, "Session 10"):
# sm__cycles_elapsed.max, gpu__time_duration.sum and smsp__inst_executed.sum per launch, in ncu.md;
# AB_NCU_ARGS adds flashkit_bench arguments to those launches (e.g. "--dropout 0.1").
set -u
FINAL=$(mkdir -p "$1" && cd "$1" && pwd)
cd "$(dirname "$0")/.." || exit 2
ROOT=$PWD
export PATH=/usr/local/cuda/bin:$PATH
# shellcheck source=scripts/ab_common.sh
source "$ROOT/scripts/ab_common.sh"
ab_build_tree A "$ROOT" "$FINAL" 16 flashkit_bench
ab_build_tree B "$ROOT/$AB_B" "$FINAL" 16 flashkit_bench
nvidia-smi --query-gpu=timestamp,clocks.sm,power.draw,power.limit,temperature.gpu,clocks_event_reasons.sw_power_cap,clocks_event_reasons.hw_slowdown,clocks_event_reasons.sw_thermal_slowdown \
  --format=csv,noheader -lms 100 >"$FINAL/smi.csv" 2>&1 &
smi=$!
read -r -a args <<<"${AB_BENCH_ARGS:---dtype bf16 --hdim 128 --seqlen 8k,16k --causal both}"
for round in $(seq 1 "${AB_ROUNDS:-5}"); do
  for tree in A B; do
    date +"%H:%M:%S.%N start $tree $round" >>"$FINAL/marks.txt"
    timeout 150 "/tmp/ab-$tree/bench/flashkit_bench" --op fwd "${args[@]}" --json "$FINAL/bench-$tree-$round.json" >/dev/null 2>&1
    date +"%H:%M:%S.%N end $tree $round" >>"$FINAL/marks.txt"
  done
done
kill $smi
if [ -n "${AB_NCU:-}" ]; then
  NCU=$(command -v ncu || echo /usr/local/cuda/bin/ncu)
  {
    echo "| cell | tree | cycles (sm__cycles_elapsed.max) | time (gpu__time_duration.sum) | instructions |"
    echo "| --- | --- | --- | --- | --- |"
    for cell in $AB_NCU; do
      IFS=: read -r op dtype hdim seqlen causal <<<"$cell"
      for tree in A B; do
        log="$FINAL/ncu-$tree-${cell//:/-}.txt"
        timeout 120 "$NCU" -k 'regex:(fwd|bwd)_kernel' --launch-skip 5 --launch-count 3 \
          --metrics sm__cycles_elapsed.max,gpu__time_duration.sum,smsp__inst_executed.sum \
          "/tmp/ab-$tree/bench/flashkit_bench" --op "$op" --dtype "$dtype" --hdim "$hdim" \
          --seqlen "$seqlen" --causal "$causal" ${AB_NCU_ARGS:-} >"$log" 2>&1
        pick() { grep "$1" "$log" | awk '{print $(NF - 1) " " $NF}' | paste -sd' '; }
        echo "| $cell | $tree | $(pick sm__cycles_elapsed.max) | $(pick gpu__time_duration.sum) | $(pick smsp__inst_executed.sum) |"
      done
    done
  } | tee "$FINAL/ncu.md"
fi
python3 - "$FINAL" <<'PY'
import collections, glob, json, statistics, sys
d = sys.argv[1]
cells = collections.defaultdict(lambda: collections.defaultdict(list))
for path in sorted(glob.glob(f"{d}/bench-*-*.json")):
    tree = path.rsplit("/", 1)[1].split("-")[1]
    for rec in json.load(open(path))["records"]:
        key = (rec["op"], rec["impl"], rec["dtype"], rec["head_dim"], rec["causal"], rec["seqlen_q"])
        cells[key][tree].append(rec["tflops"])
        if rec.get("joules") is not None:  # --energy
            cells[key][tree + "J"].append(rec["joules"] * 1e3)
for unit, suffix, digits in (("TFLOP/s", "", 0), ("mJ per call (--energy)", "J", 1)):
    keys = [k for k in sorted(cells) if cells[k]["A" + suffix] and cells[k]["B" + suffix]]
    if not keys:
        continue
    print(f"\n{unit}\n")
    print("| op | impl | dtype | hdim | causal | seqlen | A rounds | B rounds | B/A (medians) |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for key in keys:
        a, b = cells[key]["A" + suffix], cells[key]["B" + suffix]
        ma, mb = statistics.median(a), statistics.median(b)
        print(f"| {' | '.join(map(str, key))} | {' '.join(f'{x:.{digits}f}' for x in a)} |"
              f" {' '.join(f'{x:.{digits}f}' for x in b)} | {mb / ma:.3f} |")
rows = [l.split(", ") for l in open(f"{d}/smi.csv") if l.count(",") >= 7]
busy = [r for r in rows if float(r[2].split()[0]) > 200]
if busy:
    clocks = sorted(int(r[1].split()[0]) for r in busy)
    power = sorted(float(r[2].split()[0]) for r in busy)
    capped = sum(1 for r in busy if "Active" in r[5])
    def sec(hms):
        h, m, x = hms.split(":")
        return int(h) * 3600 + int(m) * 60 + float(x)
    spans = collections.defaultdict(list)
    start = {}
    for line in open(f"{d}/marks.txt"):
        t, what, tree, rnd = line.split()
        if what == "start":
            start[(tree, rnd)] = sec(t)
        else:
            spans[tree].append((start[(tree, rnd)], sec(t)))
    for tree in sorted(spans):
        mine = [r for r in busy if any(a <= sec(r[0].split()[1]) <= b for a, b in spans[tree])]
        if mine:
            c = sorted(int(r[1].split()[0]) for r in mine)
            w = sorted(float(r[2].split()[0]) for r in mine)
            print(f"tree {tree}: SM clock median {c[len(c)//2]} MHz, power median {w[len(w)//2]:.0f} W ({len(mine)} samples)")
    print(f"\nnvidia-smi over {len(busy)} samples above 200 W: SM clock median {clocks[len(clocks)//2]} MHz"
          f" (min {clocks[0]}, max {clocks[-1]}), power median {power[len(power)//2]:.0f} W (max {power[-1]:.0f},"
          f" limit {busy[0][3]}), power-cap reason active in {capped} samples")
PY
