// src/common/kvcache_problem.h
// \brief The mha_fwd_kvcache problem after validation: plain pointers, 64-bit strides and resolved
// options (see include/flashkit/kvcache_params.h for the semantics).
//
// src/api/ builds one KvcacheProblem from the public params; the CPU reference and the CUDA decode
// kernels consume only this. No torch and no CUDA types, so it crosses into .cu files unchanged
// (it is also the kernels' __grid_constant__ argument).
#pragma once

#include <cstddef>
#include <cstdint>

#include "flashkit/tensor.h"

namespace flashkit {

struct KvcacheProblem {
  DType dtype = DType::kBFloat16;  // of q, the caches, k_new / v_new, rotary tables and out
  int batch = 0;
  int heads_q = 0;
  int heads_kv = 0;  // heads_q % heads_kv == 0; query head h reads kv head h / (heads_q / heads_kv)
  int head_dim = 0;  // a multiple of 8, at most 256
  int seqlen_q = 0;
  int seqlen_new = 0;      // tokens appended per sequence; 0 without k_new / v_new
  int cache_capacity = 0;  // keys one sequence's cache can hold (seqlen_cache, or pages * page size)

  const void* q = nullptr;
  int64_t q_batch_stride = 0, q_row_stride = 0, q_head_stride = 0;
  // Null for mha_fwd_kvcache: every sequence has seqlen_q query tokens. Set only by mha_varlen_fwd's
  // short queries (api/fwd_decode_route.h): sequence b's tokens are rows cu_seqlens_q[b] ..
  // cu_seqlens_q[b + 1] - 1 of q and out (their batch strides 0), at most seqlen_q of them; the lse
  // and split rows keep the seqlen_q-row layout. The CPU reference does not take it.
  const int* cu_seqlens_q = nullptr;
  // Null for mha_fwd_kvcache. Set only by mha_varlen_fwd's short queries with seqused_k: sequence b
  // attends to the seqused_k[b] keys from its left pad, whatever its cache length.
  const int* seqused_k = nullptr;

  // Contiguous: batch stride is that of dim 0 (the cache row); paged: the stride between pages.
  void* k_cache = nullptr;
  void* v_cache = nullptr;
  int64_t k_cache_batch_stride = 0, k_cache_row_stride = 0, k_cache_head_stride = 0;
  int64_t v_cache_batch_stride = 0, v_cache_row_stride = 0, v_cache_head_stride = 0;
  int cache_batches = 0;  // contiguous: batch_cache; paged: num_blocks

  const int* block_table = nullptr;  // paged only: block_table[b * stride + i], page i of sequence b
  int64_t block_table_batch_stride = 0;
  int max_blocks_per_seq = 0;
  int page_block_size = 0;  // 0: contiguous cache
  int page_block_shift = -1;  // log2(page_block_size) for a power of two (the kernels shift and
                              // mask instead of dividing), else -1

  const int* cache_seqlens = nullptr;  // null: every sequence holds cache_seqlen tokens
  int cache_seqlen = 0;
  const int* cache_batch_idx = nullptr;  // null: sequence b uses cache row b
  const int* cache_leftpad = nullptr;    // null: every sequence starts at cache index 0

  const void* k_new = nullptr;  // null: no append
  const void* v_new = nullptr;
  int64_t k_new_batch_stride = 0, k_new_row_stride = 0, k_new_head_stride = 0;
  int64_t v_new_batch_stride = 0, v_new_row_stride = 0, v_new_head_stride = 0;

  const void* rotary_cos = nullptr;  // [rotary_seqlen, rotary_dim / 2], contiguous; null: no rotary
  const void* rotary_sin = nullptr;
  int rotary_dim = 0;
  int rotary_seqlen = 0;
  bool rotary_interleaved = false;

  void* out = nullptr;
  int64_t out_batch_stride = 0, out_row_stride = 0, out_head_stride = 0;
  float* lse = nullptr;  // [batch, heads_q, seqlen_q], row stride 1
  int64_t lse_batch_stride = 0, lse_head_stride = 0;

  const float* alibi_slopes = nullptr;  // slope of (b, h) = alibi_slopes[b * alibi_batch_stride + h]
  int64_t alibi_batch_stride = 0;

  float softmax_scale = 0.0f;  // resolved: never 0
  float softcap = 0.0f;
  int window_left = -1;  // resolved against cache_capacity as mha_fwd does against seqlen_k
  int window_right = -1;
  bool causal = false;

  // Set by the dispatcher (1 on the CPU): key splits, and where their partial results go.
  int num_splits = 1;
  void* workspace = nullptr;
  size_t workspace_bytes = 0;

  constexpr bool is_paged() const { return block_table != nullptr; }
  constexpr bool has_append() const { return k_new != nullptr; }
  // (constexpr: the kernels call these too.) Queries sit at consecutive positions (L - P + i) under a causal or local mask, else all at L - P.
  constexpr bool rotary_q_positions_per_token() const { return window_left >= 0 || window_right >= 0; }
};

}  // namespace flashkit
