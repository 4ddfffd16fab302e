// src/cpu/reference_nsa.h
// \brief The reference of native sparse attention's selection branch (nsa_params.h), forward and
// backward, on the CPU with fp64 accumulation.
//
// It is the CPU backend of nsa_fwd / nsa_bwd and the oracle of the GPU tests. Every pointer of the
// problem must be host memory. Each (sequence, token, kv head) resolves its selection to the set
// of valid, distinct blocks, then attends to their keys (causal keys removed) exactly as
// reference_fwd attends to a dense row.
#pragma once

#include "common/nsa_problem.h"
#include "cpu/reference_fwd.h"

namespace flashkit::cpu {

// The CPU backend: writes problem.out (in problem.dtype) and problem.lse, kExact precision.
void reference_nsa_fwd(const NsaProblem& problem);

// The oracle for tests: fp32 results in the caller's contiguous buffers
//   out: [batch, heads_q, seqlen_q, head_dim], lse: [batch, heads_q, seqlen_q].
// kInputDtype rounds as reference_fwd_fp32 does (scores and probabilities in the input dtype).
// problem.out and problem.lse are ignored.
void reference_nsa_fwd_fp32(const NsaProblem& problem, RefPrecision precision, float* out, float* lse);

// The CPU backend of nsa_bwd: writes problem.dq, dk, dv in problem.fwd.dtype (kExact, with lse
// and D_i = dot(dout_i, out_i) from what the forward saved). Keys that no query selected get zero
// dk / dv rows; a query row that sees no key gets a zero dq row.
void reference_nsa_bwd(const NsaBwdProblem& problem);

// The oracle for tests: fp32 gradients in the caller's contiguous buffers
//   dq: [batch, seqlen_q, heads_q, head_dim], dk, dv: [batch, seqlen_k, heads_kv, head_dim].
// `recompute` = false: lse and D from the saved out / lse (what the kernels do); true: recomputed
// from q, k, v (the exact gradient of the forward function, for finite-difference tests).
void reference_nsa_bwd_fp32(const NsaBwdProblem& problem, RefPrecision precision, bool recompute,
                            float* dq, float* dk, float* dv);

}  // namespace flashkit::cpu
