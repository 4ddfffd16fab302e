// src/api/fwd_decode_route.cpp
// \brief mha_fwd's short queries on the decode kernel (fwd_decode_route.h).
#include "api/fwd_decode_route.h"

#include <cstdint>

#include "cuda/sm80/decode_sm80.h"

namespace flashkit::api {

std::string fwd_decode_unsupported_reason(const FwdProblem& p) {
  if (p.dropout_p > 0.0f) return "the decode kernel has no dropout";
  if (p.attn_probs != nullptr) return "the decode kernel does not return the probabilities";
  if (p.seqlen_k == 0) return "seqlen_k is 0 (no keys to decode against)";
  // The decode grid's y and z dimensions (src/cuda/sm80/decode_launch.cuh).
  if (p.batch > 65535 || p.heads_kv > 65535) {
    return "the decode grid holds at most 65535 sequences and 65535 kv heads";
  }
  return "";
}

bool fwd_prefers_decode(const FwdProblem& p, int sm_count, int forward_heads_per_tile, bool forward_splits) {
  if (p.seqlen_q > kFwdDecodeMaxSeqlenQFewTiles || !fwd_decode_unsupported_reason(p).empty()) return false;
  const int64_t decode_rows = static_cast<int64_t>(p.seqlen_q) * (p.heads_q / p.heads_kv);  // per kv head
  const int64_t decode_tiles =
      static_cast<int64_t>(p.batch) * p.heads_kv * ((decode_rows + sm80::kDecodeRows - 1) / sm80::kDecodeRows);
  if (forward_splits) {
    return p.seqlen_q == 1 || decode_rows <= sm80::kDecodeRows ||
           (p.seqlen_k <= kFwdDecodeMaxKeysBesideSplit && 4 * decode_tiles <= sm_count);
  }
  if (forward_heads_per_tile <= 1) {
    return p.seqlen_q <= kFwdDecodeMaxSeqlenQ || static_cast<int64_t>(p.batch) * p.heads_q <= sm_count / 4;
  }
  return decode_rows <= sm80::kDecodeRows || 4 * decode_tiles <= 3 * static_cast<int64_t>(sm_count);
}

KvcacheProblem decode_view_of_fwd(const FwdProblem& p) {
  KvcacheProblem d;
  d.dtype = p.dtype;
  d.batch = p.batch;
  d.heads_q = p.heads_q;
  d.heads_kv = p.heads_kv;
  d.head_dim = p.head_dim;
  d.seqlen_q = p.seqlen_q;  // varlen: the bound max_seqlen_q, the lse's row count
  d.cache_capacity = p.seqlen_k;
  d.cache_seqlen = p.seqlen_k;
  d.cache_batches = p.batch;
  if (p.is_varlen()) {
    // Every sequence reads one cache row (batch strides 0) from index cu_seqlens_k[b] (its left
    // pad) to cu_seqlens_k[b + 1] (its length), or seqused_k[b] keys from there, and its queries
    // from cu_seqlens_q[b].
    d.cu_seqlens_q = p.cu_seqlens_q;
    d.cache_leftpad = p.cu_seqlens_k;
    d.cache_seqlens = p.cu_seqlens_k + 1;
    d.seqused_k = p.seqused_k;
    d.cache_batches = 1;
  }

  d.q = p.q;
  d.q_batch_stride = p.q_batch_stride;
  d.q_row_stride = p.q_row_stride;
  d.q_head_stride = p.q_head_stride;
  // The caches are only read: nothing is appended.
  d.k_cache = const_cast<void*>(p.k);
  d.v_cache = const_cast<void*>(p.v);
  d.k_cache_batch_stride = p.k_batch_stride;
  d.k_cache_row_stride = p.k_row_stride;
  d.k_cache_head_stride = p.k_head_stride;
  d.v_cache_batch_stride = p.v_batch_stride;
  d.v_cache_row_stride = p.v_row_stride;
  d.v_cache_head_stride = p.v_head_stride;

  d.out = p.out;
  d.out_batch_stride = p.out_batch_stride;
  d.out_row_stride = p.out_row_stride;
  d.out_head_stride = p.out_head_stride;
  d.lse = p.lse;
  d.lse_batch_stride = p.lse_batch_stride;
  d.lse_head_stride = p.lse_head_stride;

  d.alibi_slopes = p.alibi_slopes;
  d.alibi_batch_stride = p.alibi_batch_stride;
  d.softmax_scale = p.softmax_scale;
  d.softcap = p.softcap;
  // Resolved against seqlen_k, which is the capacity here: the same window.
  d.window_left = p.window_left;
  d.window_right = p.window_right;
  d.causal = p.causal;
  return d;
}

}  // namespace flashkit::api
