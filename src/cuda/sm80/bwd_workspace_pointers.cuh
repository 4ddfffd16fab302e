// src/cuda/sm80/bwd_workspace_pointers.cuh
// \brief The workspace regions of bwd_workspace.h as typed device pointers, passed to every
// backward kernel by value.
#pragma once

#include "common/bwd_problem.h"
#include "cuda/sm80/bwd_workspace.h"

namespace flashkit::sm80 {

struct BwdWorkspacePointers {
  float* dq_accum;     // [total_q][heads_q][head_dim]
  float* dot;          // [batch][heads_q][stats_rows]
  float* lse;          // [batch][heads_q][stats_rows], a copy of the LSE rows
  int64_t stats_rows;  // bwd_row_stats_rows(seqlen_q)
  float* dk_expanded;  // [total_k][heads_q][head_dim], GQA/MQA only
  float* dv_expanded;
  int* semaphores;     // [batch][heads_q][m blocks], deterministic mode only

  static BwdWorkspacePointers of(const BwdProblem& problem) {
    const BwdWorkspaceLayout layout = BwdWorkspaceLayout::of(problem);
    auto* base = static_cast<unsigned char*>(problem.workspace);
    return {reinterpret_cast<float*>(base + layout.dq_accum), reinterpret_cast<float*>(base + layout.dot),
            reinterpret_cast<float*>(base + layout.lse), bwd_row_stats_rows(problem.fwd.seqlen_q),
            reinterpret_cast<float*>(base + layout.dk_expanded),
            reinterpret_cast<float*>(base + layout.dv_expanded),
            reinterpret_cast<int*>(base + layout.semaphores)};
  }
};

}  // namespace flashkit::sm80
