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
// A paged cache's CTA copies its split's block-table entries into shared memory once, in the
// prologue, when they fit kDecodePageSlots (a split of up to 16K keys at 16-token pages), so that
// the loop's page lookups never wait on a block-table line in global memory.
constexpr int kDecodePageSlots = 1024;
constexpr int decode_smem_bytes(int family, bool whole_sm, bool paged) {
  return decode_fixed_smem_bytes(family) + decode_stages(family, whole_sm) * decode_stage_bytes(family) +
         (paged ? kDecodePageSlots * 4 : 0);
}

// The most splits a decode launch may have: the combine holds the lse values of a row's splits in
// registers, 32 per lane chunk (decode_combine.cuh). The API's limit (kMaxKvcacheSplits) may not
// exceed it.
constexpr int kDecodeMaxSplits = 128;

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

// How run_decode launches, chosen by the dispatcher for the device.
struct DecodeLaunchPlan {
  bool whole_sm = false;  // the whole-SM pipeline (decode_stages(family, true))
  // sm_90 and newer: the decode and combine kernels are launched as programmatic dependents of the
  // kernel before them (PDL), so that their launch and prologue overlap its tail.
  bool programmatic = false;
  // The partials are in the workspace already (another kernel wrote them): the combine pass only.
  bool combine_only = false;
};

// Enqueues append (when k_new is given), the split decode kernel and, for num_splits > 1, the
// combine kernel on the cudaStream_t `stream` (plan.combine_only: the combine kernel alone). Device pointers, validated problem, num_splits and
// workspace set. Instantiated once per (dtype, family) in a generated .cu file.
template <DType kDType, int kHeadDimFamily>
void run_decode(const KvcacheProblem& problem, const DecodeLaunchPlan& plan, void* stream);

}  // namespace flashkit::sm80
