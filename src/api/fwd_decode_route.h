// src/api/fwd_decode_route.h
// \brief mha_fwd's short queries on the decode kernel: which problems go there, and the problem
// as a decode of a contiguous cache.
//
// A decoding step through mha_fwd (Hugging Face generate() calls flash attention this way: one
// new query token against every cached key) gives the forward kernels a tile of 128 or 192 query
// rows per query head with one row in use: the tile's full products for one row, and the keys
// read once per query head. The decode kernel (src/cuda/sm80/decode_kernel.cuh) packs the query
// tokens and the query heads of a kv head into 16-row tiles, reads each kv head's keys once per
// tile and splits the keys over the SMs when the batch alone does not fill them. Up to 16 query
// tokens, it reads no more key bytes than the forward kernels (ceil(seqlen_q x group / 16) tiles per
// kv head, against group tiles) and computes less. Variable-length batches too (padded batches in
// generate() go through flash_attn_varlen_func), with max_seqlen_q as the bound.
#pragma once

#include <string>

#include "common/fwd_problem.h"
#include "common/kvcache_problem.h"

namespace flashkit::api {

// Query tokens per sequence up to which the automatic choice runs mha_fwd on the decode kernel.
constexpr int kFwdDecodeMaxSeqlenQ = 16;

// Why the decode kernel cannot run `problem` ("" when it can), the build and the device aside.
std::string fwd_decode_unsupported_reason(const FwdProblem& problem);

// Whether the automatic choice runs `problem` on the decode kernel: it can, and seqlen_q is at most
// kFwdDecodeMaxSeqlenQ.
bool fwd_prefers_decode(const FwdProblem& problem);

// `problem` (one the decode kernel can run) as a decode: every sequence's keys form a contiguous
// cache (varlen: the packed keys are one cache row, sequence b's from index cu_seqlens_k[b] to
// cu_seqlens_k[b + 1], read as its left pad and its length), nothing appended, the same q, out,
// lse, mask, scale, softcap and ALiBi. One split and no workspace; the dispatcher sets both.
KvcacheProblem decode_view_of_fwd(const FwdProblem& problem);

}  // namespace flashkit::api
