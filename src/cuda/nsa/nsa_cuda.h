// src/cuda/nsa/nsa_cuda.h
// \brief What the native-sparse-attention kernels offer the dispatcher: head-dim families, the
// backward's workspace layout and the launch entry points. Plain C++.
#pragma once

#include <cstddef>

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

// The backward's workspace: fp32 dk and dv accumulators [batch, seqlen_k, heads_kv, head_dim]
// (query tokens add their blocks' gradients into them), then D = dot(dout, out) per query row
// [batch, heads_q, seqlen_q], each part 256-byte aligned.
struct NsaBwdWorkspaceLayout {
  size_t dv_offset = 0;
  size_t delta_offset = 0;
  size_t total_bytes = 0;
};

constexpr size_t nsa_workspace_align(size_t bytes) { return (bytes + 255) / 256 * 256; }

constexpr NsaBwdWorkspaceLayout nsa_bwd_workspace_layout(const NsaProblem& p) {
  const size_t kv_bytes = nsa_workspace_align(static_cast<size_t>(p.batch) * p.seqlen_k * p.heads_kv *
                                              p.head_dim * sizeof(float));
  const size_t delta_bytes =
      nsa_workspace_align(static_cast<size_t>(p.batch) * p.heads_q * p.seqlen_q * sizeof(float));
  return {kv_bytes, 2 * kv_bytes, 2 * kv_bytes + delta_bytes};
}

// Enqueue the forward / backward on the cudaStream_t `stream`: device pointers, validated problem
// (the backward's workspace checked against nsa_bwd_workspace_layout). One instance per (dtype,
// family) in a generated .cu file.
template <DType kDType, int kHeadDimFamily>
void run_nsa_fwd(const NsaProblem& problem, void* stream);
template <DType kDType, int kHeadDimFamily>
void run_nsa_bwd(const NsaBwdProblem& problem, void* stream);

}  // namespace flashkit::nsa
