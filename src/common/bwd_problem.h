// src/common/bwd_problem.h
// \brief The backward problem after validation: the forward problem it differentiates, plus the
// gradient tensors, the workspace and the backward's own options.
//
// src/api/ builds one BwdProblem from MhaBwdParams / MhaVarlenBwdParams; every backend consumes only
// this. `fwd` is exactly the FwdProblem the forward call resolved from the same arguments (its `out`
// and `lse` are read, never written, here), so the backward recomputes the same probabilities with
// the same masks, scale, softcap and ALiBi.
#pragma once

#include <cstddef>
#include <cstdint>

#include "common/fwd_problem.h"

namespace flashkit {

struct BwdProblem {
  FwdProblem fwd;

  // Gradient of out (read): same layout rules as q.
  const void* dout = nullptr;
  int64_t dout_batch_stride = 0, dout_row_stride = 0, dout_head_stride = 0;
  // Gradients (written): dq like q; dk, dv like k, v (summed over each query-head group).
  void* dq = nullptr;
  int64_t dq_batch_stride = 0, dq_row_stride = 0, dq_head_stride = 0;
  void* dk = nullptr;
  int64_t dk_batch_stride = 0, dk_row_stride = 0, dk_head_stride = 0;
  void* dv = nullptr;
  int64_t dv_batch_stride = 0, dv_row_stride = 0, dv_head_stride = 0;

  bool deterministic = false;

  // Varlen: the rows of the packed tensors (q.size(0), k.size(0)); sizes per-token workspaces.
  // Fixed length: batch * seqlen_q and batch * seqlen_k.
  int64_t total_q = 0;
  int64_t total_k = 0;

  // The caller's scratch memory (256-byte aligned, at least the size query's bytes). How it is
  // carved up is the backend's business; the CPU backend needs none.
  void* workspace = nullptr;
  size_t workspace_bytes = 0;
};

}  // namespace flashkit
