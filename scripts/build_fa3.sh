#!/usr/bin/env bash
# scripts/build_fa3.sh FA_DIR: builds FlashAttention-3's forward (its hopper/ extension) in place,
# so that bench/peers.py --impls fa3 can time it beside flashkit in the same run (docs/GPU.md: the
# figures that count are the ones measured beside the peers in one run).
#
# FA_DIR is a copy of github.com/Dao-AILab/flash-attention with README.md, hopper/ and
# csrc/cutlass/include (the submodule's commit); the GPU machine has no network, so the tree
# travels as an ignored folder named in the device call's carry (e.g. .peers/fa3, ~31 MB), and
# the build and the benchmark run in the same call (the machine keeps no carried folder between
# calls). Made from git mirrors of the two repositories (session 14: flash-attention 0251105a,
# cutlass 7127592):
#   git -C FLASH_ATTENTION_GIT archive HEAD hopper README.md | tar -x -C .peers/fa3
#   git -C CUTLASS_GIT archive $(git -C FLASH_ATTENTION_GIT rev-parse HEAD:csrc/cutlass) include |
#     tar -x -C .peers/fa3/csrc/cutlass
# The build takes ~100 s on the GPU machine's 16 cores. Only what the forward benchmark needs
# is compiled: sm90, bf16 and fp16, head dims 64 / 128 / 256, causal and not; no backward,
# split-KV, paged KV, append-KV, sliding window, softcap, GQA packing, fp8, varlen or clusters
# (seven translation units instead of a few hundred). Afterwards:
#   PYTHONPATH=FA_DIR/hopper python3 bench/peers.py --impls fa3 ...
set -euo pipefail
if [ $# -ne 1 ] || [ ! -f "$1/hopper/setup.py" ] || [ ! -d "$1/csrc/cutlass/include/cute" ]; then
  echo "usage: scripts/build_fa3.sh FA_DIR (with hopper/setup.py and csrc/cutlass/include)" >&2
  exit 2
fi
cd "$1/hopper"
for feature in BACKWARD SPLIT PAGEDKV APPENDKV LOCAL SOFTCAP PACKGQA FP8 VARLEN CLUSTER HDIM96 HDIM192 \
  HDIMDIFF64 HDIMDIFF192 SM80; do
  export "FLASH_ATTENTION_DISABLE_$feature=TRUE"
done
export FLASH_ATTENTION_FORCE_BUILD=TRUE FLASH_ATTENTION_OFFLINE_BUILD=TRUE
export MAX_JOBS=${MAX_JOBS:-$(nproc)} NVCC_THREADS=${NVCC_THREADS:-2}
python3 setup.py build_ext --inplace
PYTHONPATH=$PWD python3 -c "import flash_attn_interface; print('FlashAttention-3 built:', flash_attn_interface.__file__)"
