// src/cuda/sm80/bwd_workspace.cpp
// \brief The sm80 backward's workspace layout and size (see bwd_workspace.h).
#include "cuda/sm80/bwd_workspace.h"

#include "cuda/sm80/bwd_sm80.h"
#include "cuda/sm80/bwd_tile_config.h"
#include "cuda/sm80/fwd_sm80.h"

namespace flashkit::sm80 {
namespace {

constexpr size_t kRegionAlignment = 256;

size_t align_up(size_t bytes) { return (bytes + kRegionAlignment - 1) / kRegionAlignment * kRegionAlignment; }

}  // namespace

int64_t bwd_num_m_blocks(const BwdProblem& problem) {
  const int block_m = bwd_tile_config(fwd_head_dim_family(problem.fwd.head_dim)).block_m;
  return block_m > 0 ? (problem.fwd.seqlen_q + block_m - 1) / block_m : 0;
}

BwdWorkspaceLayout BwdWorkspaceLayout::of(const BwdProblem& problem) {
  const FwdProblem& f = problem.fwd;
  const size_t heads_q = static_cast<size_t>(f.heads_q);
  const size_t head_dim = static_cast<size_t>(f.head_dim);
  const bool grouped = f.heads_q != f.heads_kv;
  BwdWorkspaceLayout layout;
  size_t offset = 0;
  auto region = [&offset](size_t bytes) {
    const size_t start = offset;
    offset += align_up(bytes);
    return start;
  };
  layout.dq_accum = region(static_cast<size_t>(problem.total_q) * heads_q * head_dim * sizeof(float));
  const size_t stats_bytes =
      static_cast<size_t>(f.batch) * heads_q * static_cast<size_t>(bwd_row_stats_rows(f.seqlen_q)) * sizeof(float);
  layout.dot = region(stats_bytes);
  layout.lse = region(stats_bytes);
  const size_t expanded = grouped ? static_cast<size_t>(problem.total_k) * heads_q * head_dim * sizeof(float) : 0;
  layout.dk_expanded = region(expanded);
  layout.dv_expanded = region(expanded);
  layout.semaphores = region(problem.deterministic ? static_cast<size_t>(f.batch) * heads_q *
                                                         static_cast<size_t>(bwd_num_m_blocks(problem)) * sizeof(int)
                                                   : 0);
  layout.total = offset;
  return layout;
}

size_t bwd_workspace_bytes(const BwdProblem& problem) { return BwdWorkspaceLayout::of(problem).total; }

}  // namespace flashkit::sm80
