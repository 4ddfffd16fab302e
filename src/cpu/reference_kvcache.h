// src/cpu/reference_kvcache.h
// \brief The reference of mha_fwd_kvcache: the append (rotary, paging, batch index), then the
// attention of each sequence over its cache entries [leftpad, length + seqlen_new), computed by
// the forward reference (reference_fwd) on a gathered copy of that sequence.
//
// It is the CPU backend of mha_fwd_kvcache and the oracle of the GPU tests. Every pointer of the
// problem must be host memory. Rotary runs in fp32 with separately rounded products and
// difference (no fused multiply-add), rounded once to the dtype, exactly as the CUDA kernels do,
// so that the appended cache matches the GPU's bit for bit.
#pragma once

#include <cstdint>

#include "common/kvcache_problem.h"
#include "cpu/reference_fwd.h"

namespace flashkit::cpu {

// Writes k_new / v_new (keys rotated) into problem.k_cache / v_cache. Idempotent for given inputs.
void reference_kvcache_append(const KvcacheProblem& problem);

// The CPU backend: append, then write problem.out (in problem.dtype) and problem.lse (kExact).
void reference_kvcache(const KvcacheProblem& problem);

// The oracle for tests: the attention only (the caller appends first, once), fp32 results in
//   out: [batch, heads_q, seqlen_q, head_dim] contiguous, lse: [batch, heads_q, seqlen_q].
void reference_kvcache_attention_fp32(const KvcacheProblem& problem, RefPrecision precision,
                                      float* out, float* lse);

// The rotation of one element pair as the kernels compute it: returns (x1 * cos - x2 * sin,
// x2 * cos + x1 * sin), each rounded once to fp32 per operation.
struct RotatedPair {
  float first;
  float second;
};
RotatedPair rotate_pair(float x1, float x2, float cos, float sin);

}  // namespace flashkit::cpu
