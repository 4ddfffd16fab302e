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

// The most key splits one launch may use: the in-kernel combine (decode_combine.cuh) holds 4 x 32
// split lse values per lane and counts arrivals in 8 bits.
constexpr int kDecodeMaxSplits = 128;

// Two pipeline depths per family. A decode CTA is memory bound: its speed is the K/V bytes it
// keeps in flight (kStages - 1 stages) over the loaded HBM latency.
//   * shared SM: two CTAs fit one SM's 228 KiB at D <= 128 (one at D = 256); for launches with
//     more CTAs than SMs, where the two CTAs of an SM together keep 2 x 64 KiB in flight at D 128.
//   * whole SM: as many stages as fit 227 KiB, the most one CTA may take on sm_90, for launches of
//     at most one CTA per SM (small batches after splitting): 160 KiB in flight per SM at D 128
//     instead of 64 KiB. Only on devices whose opt-in shared memory per block holds it.
constexpr int decode_stage_bytes(int family) { return 2 * kDecodeBlockN * family * 2; }  // K and V
constexpr int decode_fixed_smem_bytes(int family) {
  return kDecodeRows * family * 2 + kDecodeWarps * kDecodeRows * 4;  // Q tile, per-warp lse
}
constexpr int kDecodeWholeSmBytes = 227 * 1024;
constexpr int decode_stages(int family, bool whole_sm) {
  return whole_sm ? (kDecodeWholeSmBytes - decode_fixed_smem_bytes(family)) / decode_stage_bytes(family)
                  : (family <= 64 ? 4 : (family <= 128 ? 3 : 2));
}
constexpr int decode_smem_bytes(int family, bool whole_sm) {
  return decode_fixed_smem_bytes(family) + decode_stages(family, whole_sm) * decode_stage_bytes(family);
}

// The split workspace: lse partials [splits, batch, heads_q, seqlen_q] fp32, then (256-byte
// aligned) output partials [splits, batch, heads_q, seqlen_q, head_dim] fp32, then (256-byte
// aligned) one 64-bit arrival word per (sequence, kv head, block of kDecodeRows packed rows), the
// counter through which the last split CTA of a block finds out that it merges (decode_combine.cuh).
struct DecodeWorkspaceLayout {
  size_t out_offset = 0;
  size_t arrivals_offset = 0;
  size_t total_bytes = 0;
};

// constexpr so that the kernels (built with --expt-relaxed-constexpr) compute the same offsets.
constexpr size_t decode_workspace_align(size_t bytes) { return (bytes + 255) / 256 * 256; }

// Blocks of kDecodeRows packed query rows (query token x query head of one kv head's group).
constexpr int64_t decode_row_blocks(const KvcacheProblem& p) {
  const int64_t packed_rows = static_cast<int64_t>(p.seqlen_q) * (p.heads_q / p.heads_kv);
  return (packed_rows + kDecodeRows - 1) / kDecodeRows;
}

constexpr DecodeWorkspaceLayout decode_workspace_layout(const KvcacheProblem& p, int num_splits) {
  if (num_splits <= 1) return {0, 0, 0};
  const size_t rows = static_cast<size_t>(num_splits) * p.batch * p.heads_q * p.seqlen_q;
  const size_t out_offset = decode_workspace_align(rows * sizeof(float));
  const size_t arrivals_offset = out_offset + decode_workspace_align(rows * p.head_dim * sizeof(float));
  const size_t arrival_words = static_cast<size_t>(p.batch) * p.heads_kv * decode_row_blocks(p);
  return {out_offset, arrivals_offset,
          arrivals_offset + decode_workspace_align(arrival_words * sizeof(uint64_t))};
}

// How run_decode launches, chosen by the dispatcher for the device.
struct DecodeLaunchPlan {
  bool whole_sm = false;  // the whole-SM pipeline (decode_stages(family, true))
  // sm_90 and newer: the decode kernel is launched as a programmatic dependent of the kernel
  // before it (PDL), so that its launch and prologue overlap that kernel's tail.
  bool programmatic = false;
};

// Enqueues append (when k_new is given) and the split decode kernel (which also combines the
// splits) on the cudaStream_t `stream`. Device pointers, validated problem, num_splits and
// workspace set. Instantiated once per (dtype, family) in a generated .cu file.
template <DType kDType, int kHeadDimFamily>
void run_decode(const KvcacheProblem& problem, const DecodeLaunchPlan& plan, void* stream);

}  // namespace flashkit::sm80
