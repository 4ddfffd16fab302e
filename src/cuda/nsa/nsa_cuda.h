// src/cuda/nsa/nsa_cuda.h
// \brief What the native-sparse-attention kernels offer the dispatcher: head-dim families, the
// backward's workspace layout and the launch entry points. Plain C++.
#pragma once

#include <cstddef>
#include <cstdint>

#include "common/nsa_problem.h"

namespace flashkit::nsa {

// A head dim is rounded up to the smallest family that holds it; the padded columns are zero-filled
// in shared memory and never written back.
constexpr int kNsaHeadDimFamilies[] = {64, 128, 256};

constexpr int nsa_head_dim_family(int head_dim) {
  for (int family : kNsaHeadDimFamilies) {
    if (head_dim <= family) return family;
  }
  return -1;
}

// The backward's dk / dv kernel walks the tokens of a key block in segments of this many: enough
// CTAs to balance a block that many tokens selected (NSA's first and local blocks), few enough
// empty ones to skip.
constexpr int kDkvSegment = 512;

// Words of the backward's selection bitmap per key block: a bit per query token.
constexpr int64_t nsa_bitmap_words(const NsaProblem& p) { return (static_cast<int64_t>(p.seqlen_q) + 31) / 32; }

// The backward's workspace, each part 256-byte aligned: fp32 dk and dv accumulators
// [batch, seqlen_k, heads_kv, head_dim]; the selection bitmap [batch, heads_kv, num_key_blocks,
// nsa_bitmap_words] (bit t of a row: token t selected the block); D = dot(dout, out) per query row
// [batch, heads_q, seqlen_q]. The accumulators and the bitmap are zeroed by each call.
struct NsaBwdWorkspaceLayout {
  size_t dv_offset = 0;
  size_t bitmap_offset = 0;
  size_t delta_offset = 0;
  size_t total_bytes = 0;
};

constexpr size_t nsa_workspace_align(size_t bytes) { return (bytes + 255) / 256 * 256; }

constexpr NsaBwdWorkspaceLayout nsa_bwd_workspace_layout(const NsaProblem& p) {
  const size_t kv_bytes = nsa_workspace_align(static_cast<size_t>(p.batch) * p.seqlen_k * p.heads_kv *
                                              p.head_dim * sizeof(float));
  const size_t bitmap_bytes = nsa_workspace_align(static_cast<size_t>(p.batch) * p.heads_kv * p.num_key_blocks *
                                                  nsa_bitmap_words(p) * sizeof(uint32_t));
  const size_t delta_bytes =
      nsa_workspace_align(static_cast<size_t>(p.batch) * p.heads_q * p.seqlen_q * sizeof(float));
  return {kv_bytes, 2 * kv_bytes, 2 * kv_bytes + bitmap_bytes, 2 * kv_bytes + bitmap_bytes + delta_bytes};
}

// Enqueue the forward / backward on the cudaStream_t `stream`: device pointers, validated problem
// (the backward's workspace checked against nsa_bwd_workspace_layout). One instance per (dtype,
// family) in a generated .cu file.
template <DType kDType, int kHeadDimFamily>
void run_nsa_fwd(const NsaProblem& problem, void* stream);
template <DType kDType, int kHeadDimFamily>
void run_nsa_bwd(const NsaBwdProblem& problem, void* stream);

}  // namespace flashkit::nsa
