// flashkit/kvcache_params.h
// \brief The arguments of mha_fwd_kvcache: attention of a few new query tokens against a KV cache
// (contiguous or paged), with an optional in-place append of new keys/values and rotary embedding.
//
// Per sequence b of the batch, with L = cache_seqlens[b] (or cache_seqlen), P = cache_leftpad[b]
// (0 without it) and N = k_new.size(1) (0 without an append):
//   1. Append: k_new[b, i] and v_new[b, i] are written into the cache at index L + i (paged: into
//      the page block_table[b][(L + i) / page_block_size], row (L + i) % page_block_size). With
//      rotary, k_new[b, i] is rotated to position L - P + i before it is written.
//   2. Attention: the sequence's keys are the cache entries [P, L + N) (after the append), so
//      seqlen_k = L + N - P; query row i attends as in mha_fwd with seqlen_q = q.size(1) and that
//      seqlen_k (bottom-right aligned causal / window masks, ALiBi distances, softcap). With rotary,
//      query token i is rotated to position L - P + i when the mask is causal or local, and to
//      L - P otherwise (every query token then sits at the first new position).
// The cache of sequence b is k_cache[cache_batch_idx[b]] (contiguous caches only; b without it).
//
// Window sides are first compared with the cache capacity (as flash_attn's kvcache does): a side at
// or beyond it means no limit on that side; causal sets the right side to 0.
//
// What only the device knows (the contents of cache_seqlens, cache_leftpad, cache_batch_idx and
// block_table) is the caller's promise on CUDA: 0 <= P <= L, L + N <= the cache capacity, batch
// indices in [0, batch_cache) and pairwise distinct when appending, block_table entries that cover
// [P, L + N) in [0, num_blocks), when appending no page shared by two sequences' appended rows,
// and with rotary every query position inside the tables (L - P + seqlen_q - 1 < seqlen_ro under a
// causal or local mask: more query tokens than new ones reach past L + N). CPU views are checked;
// FLASHKIT_CHECK_KVCACHE=1 makes the CUDA path copy the four arrays to the host and check them too
// (one synchronisation per call, for debugging).
#pragma once

#include <cstddef>

#include "flashkit/params.h"
#include "flashkit/tensor.h"

namespace flashkit {

struct MhaFwdKvcacheParams {
  TensorView q;  // [batch, seqlen_q, heads_q, head_dim]
  // Contiguous: [batch_cache, seqlen_cache, heads_kv, head_dim]; paged (block_table given):
  // [num_blocks, page_block_size, heads_kv, head_dim], any page_block_size >= 1. Same dtype as q;
  // written in place when k_new / v_new are given.
  TensorView k_cache;
  TensorView v_cache;
  TensorView block_table;    // optional int32 [batch, max_blocks_per_seq]: the pages of sequence b
  TensorView cache_seqlens;  // optional int32 [batch]: cached tokens of each sequence before the append
  int cache_seqlen = -1;     // without cache_seqlens: one length for every sequence; -1 means the
                             // whole capacity (seqlen_cache, or max_blocks_per_seq * page_block_size)
  TensorView k_new;          // optional [batch, seqlen_new, heads_kv, head_dim]: appended keys
  TensorView v_new;          // optional, same shape: appended values (both or neither)
  TensorView rotary_cos;     // optional [seqlen_ro, rotary_dim / 2], dtype of q; needs k_new;
  TensorView rotary_sin;     // rotary_dim a multiple of 16, at most head_dim; seqlen_ro >= capacity
                             // (and past every query position: see the promise above)
  bool rotary_interleaved = false;  // true: rotate pairs (2i, 2i + 1); false: (i, i + rotary_dim / 2)
  TensorView cache_batch_idx;  // optional int32 [batch]: the cache row of each sequence (contiguous)
  TensorView cache_leftpad;    // optional int32 [batch]: the first valid cache index of each sequence
  TensorView out;              // written: same shape and dtype as q
  TensorView softmax_lse;      // written: fp32 [batch, heads_q, seqlen_q] (natural log; -inf: no key)
  TensorView alibi_slopes;     // optional fp32 [heads_q] or [batch, heads_q]
  float softmax_scale = 0.0f;  // 0 means 1/sqrt(head_dim)
  float softcap = 0.0f;        // > 0: score = softcap * tanh(score / softcap)
  MaskSpec mask{};
  // Split-KV: each (sequence, kv head) is cut into num_splits key ranges computed in parallel and
  // combined. 0 lets flashkit choose from the device's SM count (mha_fwd_kvcache_num_splits says
  // what it chose), 1 turns splitting off, at most 128.
  int num_splits = 0;
  // Scratch memory on q's device for the fp32 partial outputs and log-sum-exps of the splits, at
  // least mha_fwd_kvcache_workspace_size(params) bytes, 256-byte aligned; its contents on entry do
  // not matter (calls one after another on a stream, and replays of a captured call, may share one
  // workspace; calls that may run at the same time may not). May be null when the size query
  // returns 0 (no split, or CPU views).
  void* workspace = nullptr;
  size_t workspace_bytes = 0;
};

}  // namespace flashkit
