#!/usr/bin/env bash
# bench/run_bench.sh BUILD_DIR [GRID FLAGS...]: what `make bench` runs.
#
# With a GPU: runs BUILD_DIR/bench/flashkit_bench, then bench/peers.py (PyTorch SDPA backends and
# FlexAttention) on the same grid when python3 has CUDA-enabled PyTorch, then bench/report.py, which
# writes <results>/<gpu>-<yyyy-mm-dd>-<ops>.json and .md (printed at the end; <ops> e.g.
# bwd-fwd-fwd_bwd). Without a GPU: runs
# flashkit_bench, which times the CPU backend on a small problem and says so; nothing is written.
#
# Grid flags (--dtype, --hdim, --seqlen, --causal) go to both tools, from the arguments and from
# FLASHKIT_BENCH_ARGS. FLASHKIT_BENCH_OPS (default fwd,bwd,fwd_bwd) picks the ops: flashkit_bench's
# --op and peers.py's --ops. Environment:
#   FLASHKIT_BENCH_QUICK=1   the quick subset (bf16, hdim 64 and 128, seqlen 2k and 8k)
#   FLASHKIT_RESULTS_DIR     where the merged results go (default bench/results)
#   FLASHKIT_GIT_COMMIT      recorded in the results (default: git describe of this checkout)
# Exits non-zero when a tool failed (flashkit_bench fails when any case failed its checks).
#
# Then the decode benchmark: BUILD_DIR/bench/flashkit_bench_decode and bench/peers_decode.py (SDPA
# flash and cuDNN on its grid), written as <results>/<gpu>-<yyyy-mm-dd>-decode.json and .md;
# FLASHKIT_SKIP_DECODE=1 leaves it out.
#
# Then, when BUILD_DIR staged the PyTorch extension, native sparse attention: bench/bench_nsa.py
# (beside flash-linear-attention's Triton kernels where `fla` imports, and dense causal attention),
# written as <results>/<gpu>-<yyyy-mm-dd>-nsa.json and .md; FLASHKIT_SKIP_NSA=1 leaves it out.
#
# When BUILD_DIR staged the PyTorch extension (BUILD_DIR/python/flashkit/_C*.so), `python -m
# flashkit.bench` takes peers.py's place: the same peers through peers.py's harness, plus flashkit's
# Python front end (impl flashkit_py), in one run; the PNG plot is then written beside the table.
set -euo pipefail

if [ $# -lt 1 ]; then
  echo "usage: bench/run_bench.sh BUILD_DIR [GRID FLAGS: --dtype, --hdim, --seqlen, --causal]" >&2
  exit 2
fi
build_dir=$(cd "$1" && pwd)
shift
cd "$(dirname "$0")/.."
bench="$build_dir/bench/flashkit_bench"
if [ ! -x "$bench" ]; then
  echo "run_bench.sh: $bench not found; build first (make build)" >&2
  exit 1
fi
read -r -a grid <<<"${FLASHKIT_BENCH_ARGS:-}"
grid+=("$@")
if [ "${FLASHKIT_BENCH_QUICK:-0}" = 1 ]; then
  grid=(--quick "${grid[@]}")
fi
results=${FLASHKIT_RESULTS_DIR:-bench/results}
if [ -z "${FLASHKIT_GIT_COMMIT:-}" ]; then
  FLASHKIT_GIT_COMMIT=$(git describe --always --dirty --abbrev=12 2>/dev/null || echo unknown)
fi
export FLASHKIT_GIT_COMMIT

if ! nvidia-smi -L >/dev/null 2>&1; then
  echo "run_bench.sh: no GPU found (nvidia-smi lists none): the CPU backend only, nothing written"
  exec "$bench" "${grid[@]}"
fi
if [ -z "${FLASHKIT_DRIVER:-}" ]; then
  FLASHKIT_DRIVER=$(nvidia-smi --query-gpu=driver_version --format=csv,noheader | head -1)
fi
export FLASHKIT_DRIVER

raw=$(mktemp -d)
trap 'rm -rf "$raw"' EXIT
status=0
ops=${FLASHKIT_BENCH_OPS:-fwd,bwd,fwd_bwd}
"$bench" "${grid[@]}" --op "$ops" --json "$raw/flashkit.json" || status=$?
front_end=0
if python3 -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)' 2>/dev/null; then
  if compgen -G "$build_dir/python/flashkit/_C*.so" >/dev/null; then
    front_end=1
    PYTHONPATH="$build_dir/python${PYTHONPATH:+:$PYTHONPATH}" python3 -m flashkit.bench \
      "${grid[@]}" --ops "$ops" --budget-s 0 --json "$raw/python.json" --no-report || status=$?
  else
    python3 bench/peers.py "${grid[@]}" --ops "$ops" --json "$raw/peers.json" || status=$?
  fi
else
  echo "run_bench.sh: python3 has no CUDA-enabled PyTorch: no peers in this run"
fi

inputs=()
for name in flashkit python peers; do
  if [ -s "$raw/$name.json" ]; then inputs+=("$raw/$name.json"); fi
done
if [ ${#inputs[@]} -eq 0 ]; then
  echo "run_bench.sh: no results to report" >&2
  exit 1
fi
written=$(python3 bench/report.py --out-dir "$results" "${inputs[@]}")
echo
cat "$(sed -n 2p <<<"$written")"
echo
if [ "$front_end" = 1 ]; then
  PYTHONPATH="$build_dir/python${PYTHONPATH:+:$PYTHONPATH}" \
    python3 -m flashkit.bench --plot "$(sed -n 1p <<<"$written")" || status=$?
fi
echo "run_bench.sh: wrote $(tr '\n' ' ' <<<"$written")"

decode="$build_dir/bench/flashkit_bench_decode"
if [ "${FLASHKIT_SKIP_DECODE:-0}" != 1 ] && [ -x "$decode" ]; then
  "$decode" --json "$raw/decode.json" || status=$?
  gpu=$(PYTHONPATH=bench python3 -c \
    'import json, sys, report; print(report.slug(json.load(open(sys.argv[1]))["gpu"]))' \
    "$raw/decode.json")
  stem="$results/$gpu-$(date -u +%Y-%m-%d)-decode"
  python3 bench/peers_decode.py --flashkit "$raw/decode.json" --json "$stem.json" --md "$stem.md" \
    || status=$?
  cat "$stem.md"
  echo "run_bench.sh: wrote $stem.json $stem.md"
fi

if [ "${FLASHKIT_SKIP_NSA:-0}" != 1 ] && [ "$front_end" = 1 ]; then
  gpu=$(python3 -c 'import torch; print(torch.cuda.get_device_name(0))' | PYTHONPATH=bench python3 -c \
    'import sys, report; print(report.slug(sys.stdin.read().strip()))')
  stem="$results/$gpu-$(date -u +%Y-%m-%d)-nsa"
  PYTHONPATH="$build_dir/python${PYTHONPATH:+:$PYTHONPATH}" \
    python3 bench/bench_nsa.py --json "$stem.json" --md "$stem.md" || status=$?
  [ -f "$stem.md" ] && cat "$stem.md" && echo "run_bench.sh: wrote $stem.json $stem.md"
fi
exit "$status"
