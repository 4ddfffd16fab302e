// src/cuda/sm80/bwd_workspace.h
// \brief How the sm80 backward carves up the caller's workspace (the sm90 backward uses the same
// layout); plain C++ (the dispatcher sizes the workspace before any CUDA call).
//
// Regions, each starting on a 256-byte boundary, in this order:
//   dq_accum    fp32 [total_q][heads_q][head_dim]  dQ accumulated over key blocks (atomics), then
//                                                 scaled and converted into dq
//   dot         fp32 [batch][heads_q][stats_rows]  dot(dout, out) per query row (varlen: seqlen_q is
//                                                 the max); stats_rows = seqlen_q rounded up to
//                                                 kRowStatsRowMultiple, so that a query block's rows
//                                                 are one aligned 16-byte-multiple run that the sm90
//                                                 kernel copies in bulk (rows past a sequence's end
//                                                 hold anything: the kernels zero them on arrival)
//   lse         fp32 [batch][heads_q][stats_rows]  the LSE rows, copied from the caller's softmax_lse
//                                                 (any strides) into that layout
//   dk_expanded fp32 [total_k][heads_q][head_dim]  GQA/MQA only: dK per query head before the
//   dv_expanded fp32 [total_k][heads_q][head_dim]  group sum (empty for MHA: written to dk/dv)
//   semaphores  int  [batch][heads_q][m blocks]     deterministic mode only: how many key blocks
//                                                 have added into each query block's dQ (m blocks
//                                                 of this kernel's BlockM; the sm90 kernel's query
//                                                 blocks are as large or larger and use a prefix)
#pragma once

#include <cstddef>
#include <cstdint>

#include "common/bwd_problem.h"

namespace flashkit::sm80 {

struct BwdWorkspaceLayout {
  // Byte offsets from the workspace start, and the total size.
  size_t dq_accum = 0;
  size_t dot = 0;
  size_t lse = 0;
  size_t dk_expanded = 0;
  size_t dv_expanded = 0;
  size_t semaphores = 0;
  size_t total = 0;

  static BwdWorkspaceLayout of(const BwdProblem& problem);
};

// The rows of a (batch, head)'s run in the dot and lse regions: seqlen_q rounded up to the largest
// query block of the backward kernels (128), which so never reaches past its run.
constexpr int64_t kRowStatsRowMultiple = 128;
constexpr int64_t bwd_row_stats_rows(int64_t seqlen_q) {
  return (seqlen_q + kRowStatsRowMultiple - 1) / kRowStatsRowMultiple * kRowStatsRowMultiple;
}

// Number of query blocks of the backward kernel's tiling for `problem` (its semaphore count per
// (batch, head)).
int64_t bwd_num_m_blocks(const BwdProblem& problem);

}  // namespace flashkit::sm80
