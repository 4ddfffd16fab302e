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
// kv head, against group tiles) and computes less; up to 32 it still wins where the forward kernels'
// few tiles leave most SMs idle. Against the sm90 forward with packed query heads, which also
// reads the keys once per kv head, the bounds are in packed rows (fwd_prefers_decode).
// Variable-length batches too (padded batches in generate() go through flash_attn_varlen_func),
// with max_seqlen_q as the bound.
#pragma once

#include <string>

#include "common/fwd_problem.h"
#include "common/kvcache_problem.h"

namespace flashkit::api {

// Query tokens per sequence up to which the automatic choice runs mha_fwd on the decode kernel.
constexpr int kFwdDecodeMaxSeqlenQ = 16;
// Up to this many as well when the forward kernels would leave most of the GPU idle: their tiles
// (one per query head and batch entry at these lengths) fill at most a quarter of the SMs, while
// the decode kernel splits the keys over all of them. H200, bf16 d128, GQA 32/8, CUDA-graph timing
// (bench/results/h200-2026-11-25-session25-short-queries.md): at 24 and 32 tokens the decode
// kernel is 1.26x-2.9x the sm90 forward at batch 1 (32 tiles), 0.86x-1.30x at batch 2 (64 tiles)
// and 0.63x-0.83x from batch 4 (128 tiles).
constexpr int kFwdDecodeMaxSeqlenQFewTiles = 32;
// Keys up to which the decode kernel also takes more than 16 packed rows beside a forward that
// splits, while its tiles are few (fwd_prefers_decode): with 16 key blocks the forward splits at
// most 4 ways and leaves most SMs idle.
constexpr int kFwdDecodeMaxKeysBesideSplit = 2048;

// Why the decode kernel cannot run `problem` ("" when it can), the build and the device aside.
std::string fwd_decode_unsupported_reason(const FwdProblem& problem);

// Whether the automatic choice runs `problem` on the decode kernel of a GPU with `sm_count` SMs
// rather than on a forward kernel whose tiles hold `forward_heads_per_tile` query heads of each
// token (the sm90 forward's packed query heads, src/cuda/sm90/fwd_sm90.h: heads_q / heads_kv; 1:
// one head per tile) and that splits the keys over the SMs or not (`forward_splits`, the sm90
// forward's split keys). It must be able to, and seqlen_q at most kFwdDecodeMaxSeqlenQFewTiles;
// then
// - beside a forward that splits: one query token (the decoding step the decode kernel is tuned
//   for), or seqlen_q x G at most one decode tile's 16 rows (G = heads_q / heads_kv). Both then read
//   each kv head's keys once and fill the SMs; the decode kernel computes 16 rows where the forward
//   computes 128. H200, bf16 d128, 32/8 heads, 2k-32k keys (session 26):
//   the decode kernel 1.03x-1.12x the split forward at one token, at 16 tokens 0.96x (2k keys) and
//   0.46x-0.61x (8k-32k). Also up to kFwdDecodeMaxKeysBesideSplit keys while the decode kernel's
//   tiles, batch x heads_kv x ceil(seqlen_q x G / 16), fill at most a quarter of the SMs: at 2k
//   keys, 32/8 and 28/4 heads, batch 1-4, 4-16 tokens (session 27), the decode kernel 1.03x-1.39x
//   the forward wherever its tiles were at most 32, 0.64x-0.90x wherever they were 56 or more; at
//   8k-32k keys 0.54x-0.93x beyond 16 rows (G = 7 at batch 1, 8k, 4 tokens: 1.02x);
// - beside a forward that packs but does not split (its tiles fill the SMs): seqlen_q x G at most
//   16 rows, or the decode kernel's tiles, batch x heads_kv x ceil(seqlen_q x G / 16), at most 3/4
//   of the SMs. Session 26: the packed forward 1.1x-3.2x the decode kernel from 8 tokens at batch
//   8 and 32; the decode kernel 1.01x-1.16x it up to 4 tokens;
// - beside one head per tile without a split: seqlen_q at most kFwdDecodeMaxSeqlenQ, or batch x
//   heads_q (the forward's tiles at these lengths) at most sm_count / 4.
bool fwd_prefers_decode(const FwdProblem& problem, int sm_count, int forward_heads_per_tile, bool forward_splits);

// `problem` (one the decode kernel can run) as a decode: every sequence's keys form a contiguous
// cache (varlen: the packed keys are one cache row, sequence b's from index cu_seqlens_k[b] to
// cu_seqlens_k[b + 1], read as its left pad and its length, or seqused_k[b] keys from the left
// pad), nothing appended, the same q, out,
// lse, mask, scale, softcap and ALiBi. One split and no workspace; the dispatcher sets both.
KvcacheProblem decode_view_of_fwd(const FwdProblem& problem);

}  // namespace flashkit::api
