// src/api/validate_fwd.h
// \brief From the public forward params to a FwdProblem: every check, every default, no side
// effects.
//
// Validation reads only the views' metadata, plus, for CPU views of a varlen batch, the contents of
// cu_seqlens_q/k and seqused_k (they are host memory then, and the reference indexes with them). It
// never calls the CUDA runtime, so any bad input fails before a device is touched; that is also why
// a test may feed it CUDA views with fake pointers.
#pragma once

#include "common/fwd_problem.h"
#include "flashkit/params.h"

namespace flashkit::api {

// Throw flashkit::Error("mha_fwd: ..." / "mha_varlen_fwd: ...") naming the argument, the value it
// got and what is supported. On success the problem has its defaults resolved:
//   softmax_scale 0            -> 1 / sqrt(head_dim)
//   a window side >= seqlen_k  -> -1 (unbounded), seqlen_k being max_seqlen_k for varlen, as in
//                                 FlashAttention (for seqlen_q > seqlen_k this widens window_right)
//   seqlen_q == 1, no ALiBi    -> causal off (a single row sees every key either way)
//   causal                     -> window_right = 0, window_left kept
//   problem.causal             =  window_left < 0 && window_right == 0 (the mask is exactly causal)
// `fn` is the entry point the messages name: the backward validates the forward arguments it is
// given with these same checks, under its own name.
FwdProblem validate_mha_fwd(const MhaFwdParams& params, const char* fn = "mha_fwd");
FwdProblem validate_mha_varlen_fwd(const MhaVarlenFwdParams& params,
                                   const char* fn = "mha_varlen_fwd");

// False when the problem has no query row at all (seqlen_q, or max_seqlen_q for varlen, is 0): then
// there is nothing to write and no kernel needs to run.
inline bool has_query_rows(const FwdProblem& problem) { return problem.seqlen_q > 0; }

}  // namespace flashkit::api
