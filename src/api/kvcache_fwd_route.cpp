// src/api/kvcache_fwd_route.cpp
// \brief See kvcache_fwd_route.h.
#include "api/kvcache_fwd_route.h"

#include "api/fwd_decode_route.h"

namespace flashkit::api {

std::string kvcache_fwd_unsupported_reason(const KvcacheProblem& p) {
  if (p.has_append()) return "it appends k / v (the decode kernel appends and attends in one pass)";
  if (p.is_paged()) return "the cache is paged (the forward reads contiguous keys)";
  if (p.cache_batch_idx != nullptr) return "cache_batch_idx picks the cache rows";
  if (p.cache_leftpad != nullptr) return "cache_leftpad offsets the keys";
  if (p.cu_seqlens_q != nullptr || p.seqused_k != nullptr) return "it is mha_varlen_fwd's decode view";
  return "";
}

FwdProblem fwd_view_of_kvcache(const KvcacheProblem& p) {
  FwdProblem f;
  f.dtype = p.dtype;
  f.batch = p.batch;
  f.heads_q = p.heads_q;
  f.heads_kv = p.heads_kv;
  f.head_dim = p.head_dim;
  f.seqlen_q = p.seqlen_q;
  // Per-entry lengths up to the capacity, or one length for all.
  f.seqlen_k = p.cache_seqlens != nullptr ? p.cache_capacity : p.cache_seqlen;
  f.seqused_k = p.cache_seqlens;

  f.q = p.q;
  f.q_batch_stride = p.q_batch_stride;
  f.q_row_stride = p.q_row_stride;
  f.q_head_stride = p.q_head_stride;
  f.k = p.k_cache;
  f.k_batch_stride = p.k_cache_batch_stride;
  f.k_row_stride = p.k_cache_row_stride;
  f.k_head_stride = p.k_cache_head_stride;
  f.v = p.v_cache;
  f.v_batch_stride = p.v_cache_batch_stride;
  f.v_row_stride = p.v_cache_row_stride;
  f.v_head_stride = p.v_cache_head_stride;
  f.out = p.out;
  f.out_batch_stride = p.out_batch_stride;
  f.out_row_stride = p.out_row_stride;
  f.out_head_stride = p.out_head_stride;
  f.lse = p.lse;
  f.lse_batch_stride = p.lse_batch_stride;
  f.lse_head_stride = p.lse_head_stride;

  f.alibi_slopes = p.alibi_slopes;
  f.alibi_batch_stride = p.alibi_batch_stride;
  f.softmax_scale = p.softmax_scale;
  f.softcap = p.softcap;
  f.window_left = p.window_left;
  f.window_right = p.window_right;
  f.causal = p.causal;
  return f;
}

bool kvcache_prefers_fwd(const KvcacheProblem& p, int sm_count, int pack_group) {
  return !fwd_prefers_decode(fwd_view_of_kvcache(p), sm_count, pack_group, false);
}

}  // namespace flashkit::api
