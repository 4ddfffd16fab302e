// src/cuda/sm80/decode_sm80.h
// \brief What the sm80 (mma.sync) decode kernels offer the dispatcher: head-dim families, tile
// shape, shared memory, the split workspace layout and the launch entry point. Plain C++.
#pragma once

#include <cstddef>
#include <cstdint>

#include "common/kvcache_problem.h"

namespace flashkit::sm80 {

// A head dim is rounded up to the smallest family that holds it; the padded columns are zero-filled
// in shared memory and never written back.
constexpr int kDecodeHeadDimFamilies[] = {64, 128, 256};

constexpr int decode_head_dim_family(int head_dim) {
  for (int family : kDecodeHeadDimFamilies) {
    if (head_dim <= family) return family;
  }
  return -1;
}

// One CTA: 16 packed query rows (query token x query head of one kv head's group) against
// kDecodeBlockN keys per pipeline stage, kDecodeWarps warps each taking 16 of those keys.
constexpr int kDecodeRows = 16;
constexpr int kDecodeBlockN = 64;
constexpr int kDecodeWarps = kDecodeBlockN / 16;

// Pipeline depth per family: enough K/V bytes in flight per SM to cover HBM latency, while two
// CTAs still fit in an SM's shared memory at D <= 128 (one at D = 256).
constexpr int decode_stages(int family) { return family <= 64 ? 4 : (family <= 128 ? 3 : 2); }

constexpr int decode_smem_bytes(int family) {
  const int q_tile = kDecodeRows * family * 2;
  const int stage = 2 * kDecodeBlockN * family * 2;  // K and V tiles
  const int lse_merge = kDecodeWarps * kDecodeRows * 4;
  return q_tile + decode_stages(family) * stage + lse_merge;
}

// The split workspace: lse partials [splits, batch, heads_q, seqlen_q] fp32, then (256-byte
// aligned) output partials [splits, batch, heads_q, seqlen_q, head_dim] fp32.
struct DecodeWorkspaceLayout {
  size_t out_offset = 0;
  size_t total_bytes = 0;
};

// constexpr so that the kernels (built with --expt-relaxed-constexpr) compute the same offsets.
constexpr size_t decode_workspace_align(size_t bytes) { return (bytes + 255) / 256 * 256; }

constexpr DecodeWorkspaceLayout decode_workspace_layout(const KvcacheProblem& p, int num_splits) {
  if (num_splits <= 1) return {0, 0};
  const size_t rows = static_cast<size_t>(num_splits) * p.batch * p.heads_q * p.seqlen_q;
  const size_t out_offset = decode_workspace_align(rows * sizeof(float));
  return {out_offset, out_offset + decode_workspace_align(rows * p.head_dim * sizeof(float))};
}

// Enqueues append (when k_new is given), the split decode kernel and, for num_splits > 1, the
// combine kernel on the cudaStream_t `stream`. Device pointers, validated problem, num_splits and
// workspace set. Instantiated once per (dtype, family) in a generated .cu file.
template <DType kDType, int kHeadDimFamily>
void run_decode(const KvcacheProblem& problem, void* stream);

}  // namespace flashkit::sm80
