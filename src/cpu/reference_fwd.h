// src/cpu/reference_fwd.h
// \brief The reference forward pass: every feature, exact semantics, computed on the CPU.
//
// It is both the CPU backend of mha_fwd / mha_varlen_fwd (views on the CPU) and the oracle that the
// GPU tests compare against. All pointers in the FwdProblem must be host pointers.
#pragma once

#include <vector>

#include "common/fwd_problem.h"

namespace flashkit::cpu {

// How the oracle rounds its intermediates.
enum class RefPrecision {
  kExact,       // fp64 accumulation, no intermediate rounding: the ground truth
  kInputDtype,  // what plain framework code does in the input dtype: scores rounded to the input
                // dtype after Q.K^T, probabilities rounded to it before P.V, fp32 accumulation.
                // Its error against kExact sets the tolerance a kernel must meet (at most 2x).
};

// The CPU backend: writes problem.out (in problem.dtype) and problem.lse, with kExact precision.
void reference_fwd(const FwdProblem& problem);

// The oracle for tests: the same computation, writing fp32 results in the caller's buffers
//   out: [batch, heads_q, seqlen_q, head_dim] contiguous (varlen: seqlen_q = max_seqlen_q; rows past a
//        sequence's length are left untouched)
//   lse: [batch, heads_q, seqlen_q] contiguous
// problem.out and problem.lse are ignored.
void reference_fwd_fp32(const FwdProblem& problem, RefPrecision precision, float* out, float* lse);

}  // namespace flashkit::cpu
