// src/api/validate_bwd.h
// \brief From the public backward params to a BwdProblem: every check, every default, no side
// effects.
//
// The forward arguments the backward is given (q, k, v, out, softmax_lse, ALiBi, scale, softcap,
// mask, dropout, and for varlen the cu_seqlens / seqused_k / max_seqlen) go through the forward's
// own validation (validate_fwd.h) under the backward's name, so the backward resolves exactly the
// FwdProblem the forward call did. The gradient tensors and the workspace are checked here. Like
// the forward's, validation reads only metadata (plus the varlen index arrays of a CPU batch) and
// never calls the CUDA runtime.
#pragma once

#include <cstddef>

#include "common/bwd_problem.h"
#include "flashkit/params.h"

namespace flashkit::api {

// The caller's workspace must start on this boundary (BwdCommon::workspace), so that a backend can
// carve it into aligned pieces without wasting the caller's bytes.
constexpr size_t kWorkspaceAlignmentBytes = 256;

// Throw flashkit::Error("<fn>: ...") naming the argument, the value it got and what is supported.
// `fn` is the entry point ("mha_bwd", "mha_bwd_workspace_size", ...). The workspace is not checked
// here: its size depends on the backend (check_bwd_workspace).
BwdProblem validate_mha_bwd(const MhaBwdParams& params, const char* fn = "mha_bwd");
BwdProblem validate_mha_varlen_bwd(const MhaVarlenBwdParams& params,
                                   const char* fn = "mha_varlen_bwd");

// The problem's workspace against the `required_bytes` its backend needs: a null workspace only
// when nothing is needed, at least `required_bytes` bytes, kWorkspaceAlignmentBytes-aligned. The
// message points at `size_query` (e.g. "mha_bwd_workspace_size") for the size to allocate.
void check_bwd_workspace(const char* fn, const char* size_query, const BwdProblem& problem,
                         size_t required_bytes);

}  // namespace flashkit::api
