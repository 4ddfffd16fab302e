// src/cpu/reference_bwd.h
// \brief The reference backward pass: dq, dk and dv of the reference forward, every feature, on the
// CPU.
//
// It is both the CPU backend of mha_bwd / mha_varlen_bwd (views on the CPU) and the oracle the GPU
// gradient tests compare against; tests/cpp/test_reference_bwd.cpp checks it against central
// finite differences of the reference forward, which is what makes it an oracle. All pointers in
// the BwdProblem must be host pointers.
#pragma once

#include "common/bwd_problem.h"
#include "cpu/reference_fwd.h"

namespace flashkit::cpu {

// Where the softmax statistics of each query row come from.
enum class BwdStatistics {
  // What the kernels do: lse as saved by the forward (problem.fwd.lse) and D_i = dot(dout_i, out_i)
  // from the saved out. The gradient of the forward at the given out / lse.
  kFromForward,
  // lse and D_i = sum_j P_ij dP_ij recomputed from q, k, v: the exact gradient of the forward
  // function, independent of how out and lse were rounded (the finite-difference tests use it).
  kRecompute,
};

// The CPU backend: writes problem.dq, dk, dv (in problem.fwd.dtype, with the problem's strides)
// with kExact precision and kFromForward statistics. Rows of keys past seqused_k, and of keys no
// query sees, get zero gradients; a query row that sees no key gets a zero dq row.
void reference_bwd(const BwdProblem& problem);

// The oracle for tests: the same computation, writing fp32 results in the caller's contiguous
// buffers, laid out like the packed tensors (fixed length: token b * seqlen + i):
//   dq: [total_q, heads_q, head_dim]   dk, dv: [total_k, heads_kv, head_dim]
// Tokens past the last sequence (varlen tail tokens) are left untouched. With kInputDtype the
// intermediates are rounded as plain framework code in the input dtype rounds them (scores,
// probabilities, dP, dS; fp32 accumulation) and so are the results; its error against kExact
// sets the tolerance a kernel must meet. problem.dq / dk / dv are ignored.
void reference_bwd_fp32(const BwdProblem& problem, RefPrecision precision, BwdStatistics statistics,
                        float* dq, float* dk, float* dv);

}  // namespace flashkit::cpu
