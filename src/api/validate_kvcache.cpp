// src/api/validate_kvcache.cpp
// \brief The checks of mha_fwd_kvcache and the defaults they resolve (see validate_kvcache.h).
//
// Checks run from the most basic to the most specific (presence, dtype, device, rank, shapes,
// strides and pointers, optional tensors, scalars, then the contents of CPU index arrays), so the
// first message names the root cause.
#include "api/validate_kvcache.h"

#include <cmath>
#include <cstdint>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

#include "api/tensor_checks.h"
#include "flashkit/error.h"

namespace flashkit::api {
namespace {

constexpr const char* kFn = "mha_fwd_kvcache";

// An int32 index array of `expected` shape (rank 1 or 2 given by the list), contiguous, on q's
// device.
void check_index_array(const char* name, const TensorView& view, const TensorView& q,
                       std::initializer_list<int64_t> expected, const char* layout) {
  check_dtype(kFn, name, view, DType::kInt32);
  check_same_device_as_q(kFn, name, view, q);
  check_rank(kFn, name, view, static_cast<int>(expected.size()), layout);
  check_shape(kFn, name, view, expected, layout);
  check_contiguous(kFn, name, view);
  check_data_pointer(kFn, name, view);
}

// A 16-bit attention tensor: dtype of q, q's device, last dim contiguous, aligned.
void check_attention_tensor(const char* name, const TensorView& view, const TensorView& q) {
  check_same_dtype_as_q(kFn, name, view, q);
  check_same_device_as_q(kFn, name, view, q);
  check_last_dim_contiguous(kFn, name, view);
  check_data_pointer(kFn, name, view);
  check_cuda_vector_alignment(kFn, name, view);
}

void strides_of(const TensorView& v, int64_t& batch, int64_t& row, int64_t& head) {
  batch = v.strides[0];
  row = v.strides[1];
  head = v.strides[2];
}

// The tensors' metadata; returns nothing, fills the problem's shapes, pointers and strides.
void check_and_fill_tensors(const MhaFwdKvcacheParams& p, KvcacheProblem& problem) {
  check_defined(kFn, "q", p.q, "the queries [batch, seqlen_q, heads_q, head_dim]");
  check_defined(kFn, "k_cache", p.k_cache, "the key cache");
  check_defined(kFn, "v_cache", p.v_cache, "the value cache");
  check_defined(kFn, "out", p.out, "the output, same shape and dtype as q");
  check_defined(kFn, "softmax_lse", p.softmax_lse, "the float32 log-sum-exp output");
  if (p.q.dtype != DType::kFloat16 && p.q.dtype != DType::kBFloat16) {
    fail(kFn, "q.dtype is ", dtype_name(p.q.dtype), "; supported: float16, bfloat16");
  }
  check_device_index(kFn, p.q);
  check_rank(kFn, "q", p.q, 4, "[batch, seqlen_q, heads_q, head_dim]");
  const bool paged = p.block_table.defined();
  const char* cache_layout = paged ? "[num_blocks, page_block_size, heads_kv, head_dim] (paged)"
                                   : "[batch_cache, seqlen_cache, heads_kv, head_dim]";
  check_rank(kFn, "k_cache", p.k_cache, 4, cache_layout);

  const int64_t batch = p.q.sizes[0];
  const int64_t seqlen_q = p.q.sizes[1];
  const int64_t heads_q = p.q.sizes[2];
  const int64_t head_dim = p.q.sizes[3];
  const int64_t cache_batches = p.k_cache.sizes[0];
  const int64_t cache_rows = p.k_cache.sizes[1];
  const int64_t heads_kv = p.k_cache.sizes[2];
  if (batch <= 0) fail(kFn, "batch (q.size(0)) is ", batch, "; it must be >= 1");
  check_head_counts_and_dim(kFn, heads_q, "k_cache", heads_kv, head_dim);
  check_attention_tensor("q", p.q, p.q);
  check_attention_tensor("k_cache", p.k_cache, p.q);
  check_shape(kFn, "k_cache", p.k_cache, {cache_batches, cache_rows, heads_kv, head_dim},
              "(head_dim from q)");
  check_attention_tensor("v_cache", p.v_cache, p.q);
  check_shape(kFn, "v_cache", p.v_cache, {cache_batches, cache_rows, heads_kv, head_dim},
              "(the shape of k_cache)");
  check_attention_tensor("out", p.out, p.q);
  check_shape(kFn, "out", p.out, {batch, seqlen_q, heads_q, head_dim}, "(the shape of q)");
  check_dtype(kFn, "softmax_lse", p.softmax_lse, DType::kFloat32);
  check_same_device_as_q(kFn, "softmax_lse", p.softmax_lse, p.q);
  check_shape(kFn, "softmax_lse", p.softmax_lse, {batch, heads_q, seqlen_q},
              "([batch, heads_q, seqlen_q])");
  check_last_dim_contiguous(kFn, "softmax_lse", p.softmax_lse);
  check_data_pointer(kFn, "softmax_lse", p.softmax_lse);

  // out and softmax_lse are written while the caches (and, for softmax_lse, q) are still read:
  // only the common mistake of passing a view twice (same data pointer) is caught. out may be q.
  check_own_memory(kFn, "out", p.out,
                   {{"k_cache", &p.k_cache}, {"v_cache", &p.v_cache}, {"softmax_lse", &p.softmax_lse}},
                   "out needs memory of its own (it may be q)");
  check_own_memory(kFn, "softmax_lse", p.softmax_lse,
                   {{"q", &p.q}, {"k_cache", &p.k_cache}, {"v_cache", &p.v_cache}},
                   "softmax_lse needs memory of its own");

  problem.dtype = p.q.dtype;
  problem.batch = to_int(kFn, "batch (q.size(0))", batch);
  problem.seqlen_q = to_int(kFn, "seqlen_q (q.size(1))", seqlen_q);
  problem.heads_q = to_int(kFn, "heads_q (q.size(2))", heads_q);
  problem.heads_kv = to_int(kFn, "heads_kv (k_cache.size(2))", heads_kv);
  problem.head_dim = static_cast<int>(head_dim);
  problem.cache_batches = to_int(kFn, "k_cache.size(0)", cache_batches);

  if (paged) {
    if (p.cache_batch_idx.defined()) {
      fail(kFn, "cache_batch_idx is given with a paged cache (block_table); a paged cache names "
                "its pages per sequence, so cache_batch_idx is only for contiguous caches");
    }
    if (cache_rows < 1) {
      fail(kFn, "page_block_size (k_cache.size(1)) is ", cache_rows, "; a page holds at least one token");
    }
    check_dtype(kFn, "block_table", p.block_table, DType::kInt32);
    check_same_device_as_q(kFn, "block_table", p.block_table, p.q);
    check_rank(kFn, "block_table", p.block_table, 2, "[batch, max_blocks_per_seq]");
    const int64_t max_blocks = p.block_table.sizes[1];
    check_shape(kFn, "block_table", p.block_table, {batch, max_blocks},
                "([batch, max_blocks_per_seq], batch from q)");
    if (max_blocks < 1) {
      fail(kFn, "block_table has shape ", p.block_table.shape_string(),
           "; each sequence needs at least one page (max_blocks_per_seq >= 1)");
    }
    check_last_dim_contiguous(kFn, "block_table", p.block_table);
    check_data_pointer(kFn, "block_table", p.block_table);
    problem.block_table = static_cast<const int*>(p.block_table.data);
    problem.block_table_batch_stride = p.block_table.strides[0];
    problem.max_blocks_per_seq = to_int(kFn, "max_blocks_per_seq (block_table.size(1))", max_blocks);
    problem.page_block_size = static_cast<int>(cache_rows);
    for (int shift = 0; (1 << shift) <= cache_rows; ++shift) {
      if ((1 << shift) == cache_rows) problem.page_block_shift = shift;
    }
    problem.cache_capacity =
        to_int(kFn, "max_blocks_per_seq * page_block_size", max_blocks * cache_rows);
  } else {
    problem.cache_capacity = to_int(kFn, "seqlen_cache (k_cache.size(1))", cache_rows);
    if (p.cache_batch_idx.defined()) {
      check_index_array("cache_batch_idx", p.cache_batch_idx, p.q, {batch}, "[batch]");
      problem.cache_batch_idx = static_cast<const int*>(p.cache_batch_idx.data);
    } else if (cache_batches < batch) {
      fail(kFn, "k_cache.size(0) (batch_cache) is ", cache_batches, " but q has batch ", batch,
           "; without cache_batch_idx sequence b uses cache row b, so batch_cache >= batch");
    }
  }

  problem.q = p.q.data;
  strides_of(p.q, problem.q_batch_stride, problem.q_row_stride, problem.q_head_stride);
  problem.k_cache = p.k_cache.data;
  problem.v_cache = p.v_cache.data;
  strides_of(p.k_cache, problem.k_cache_batch_stride, problem.k_cache_row_stride,
             problem.k_cache_head_stride);
  strides_of(p.v_cache, problem.v_cache_batch_stride, problem.v_cache_row_stride,
             problem.v_cache_head_stride);
  problem.out = p.out.data;
  strides_of(p.out, problem.out_batch_stride, problem.out_row_stride, problem.out_head_stride);
  problem.lse = static_cast<float*>(p.softmax_lse.data);
  problem.lse_batch_stride = p.softmax_lse.strides[0];
  problem.lse_head_stride = p.softmax_lse.strides[1];
}

void check_and_fill_lengths(const MhaFwdKvcacheParams& p, KvcacheProblem& problem) {
  const int64_t batch = problem.batch;
  if (p.cache_seqlens.defined()) {
    check_index_array("cache_seqlens", p.cache_seqlens, p.q, {batch}, "[batch]");
    problem.cache_seqlens = static_cast<const int*>(p.cache_seqlens.data);
  } else if (p.cache_seqlen < -1 || p.cache_seqlen > problem.cache_capacity) {
    fail(kFn, "cache_seqlen is ", p.cache_seqlen, "; it must be in [0, ", problem.cache_capacity,
         "] (the cache capacity), or -1 for the whole capacity");
  }
  if (p.cache_leftpad.defined()) {
    check_index_array("cache_leftpad", p.cache_leftpad, p.q, {batch}, "[batch]");
    problem.cache_leftpad = static_cast<const int*>(p.cache_leftpad.data);
  }

  if (p.k_new.defined() != p.v_new.defined()) {
    fail(kFn, p.k_new.defined() ? "k_new is given without v_new" : "v_new is given without k_new",
         "; an append needs both (or neither)");
  }
  if (p.k_new.defined()) {
    if (!p.cache_seqlens.defined() && p.cache_seqlen < 0) {
      fail(kFn, "k_new is given but neither cache_seqlens nor cache_seqlen (it is ", p.cache_seqlen,
           "); an append needs to know where each sequence ends");
    }
    check_rank(kFn, "k_new", p.k_new, 4, "[batch, seqlen_new, heads_kv, head_dim]");
    const int64_t seqlen_new = p.k_new.sizes[1];
    check_attention_tensor("k_new", p.k_new, p.q);
    check_shape(kFn, "k_new", p.k_new, {batch, seqlen_new, problem.heads_kv, problem.head_dim},
                "([batch, seqlen_new, heads_kv, head_dim], batch and head_dim from q, heads_kv "
                "from k_cache)");
    check_attention_tensor("v_new", p.v_new, p.q);
    check_shape(kFn, "v_new", p.v_new, {batch, seqlen_new, problem.heads_kv, problem.head_dim},
                "(the shape of k_new)");
    if (seqlen_new > problem.cache_capacity) {
      fail(kFn, "k_new.size(1) (seqlen_new) is ", seqlen_new, " but the cache holds at most ",
           problem.cache_capacity, " tokens per sequence");
    }
    if (!p.cache_seqlens.defined() && p.cache_seqlen + seqlen_new > problem.cache_capacity) {
      fail(kFn, "cache_seqlen (", p.cache_seqlen, ") + seqlen_new (", seqlen_new, ") is ",
           p.cache_seqlen + seqlen_new, " but the cache holds at most ", problem.cache_capacity,
           " tokens per sequence");
    }
    problem.seqlen_new = static_cast<int>(seqlen_new);
    problem.k_new = p.k_new.data;
    problem.v_new = p.v_new.data;
    strides_of(p.k_new, problem.k_new_batch_stride, problem.k_new_row_stride,
               problem.k_new_head_stride);
    strides_of(p.v_new, problem.v_new_batch_stride, problem.v_new_row_stride,
               problem.v_new_head_stride);
  }
  problem.cache_seqlen = p.cache_seqlens.defined() ? 0
                         : p.cache_seqlen < 0      ? problem.cache_capacity
                                                   : p.cache_seqlen;
}

void check_and_fill_rotary(const MhaFwdKvcacheParams& p, KvcacheProblem& problem) {
  if (!p.rotary_cos.defined() && !p.rotary_sin.defined()) return;
  if (p.rotary_cos.defined() != p.rotary_sin.defined()) {
    fail(kFn, p.rotary_cos.defined() ? "rotary_cos is given without rotary_sin"
                                     : "rotary_sin is given without rotary_cos",
         "; rotary embedding needs both");
  }
  if (!p.k_new.defined()) {
    fail(kFn, "rotary_cos / rotary_sin are given without k_new; rotary embedding rotates the "
              "appended keys (the cached ones are already rotated), so it needs k_new and v_new");
  }
  check_same_dtype_as_q(kFn, "rotary_cos", p.rotary_cos, p.q);
  check_same_dtype_as_q(kFn, "rotary_sin", p.rotary_sin, p.q);
  check_same_device_as_q(kFn, "rotary_cos", p.rotary_cos, p.q);
  check_same_device_as_q(kFn, "rotary_sin", p.rotary_sin, p.q);
  check_rank(kFn, "rotary_cos", p.rotary_cos, 2, "[seqlen_ro, rotary_dim / 2]");
  const int64_t seqlen_ro = p.rotary_cos.sizes[0];
  const int64_t rotary_dim = 2 * p.rotary_cos.sizes[1];
  check_shape(kFn, "rotary_sin", p.rotary_sin, {seqlen_ro, rotary_dim / 2},
              "(the shape of rotary_cos)");
  if (rotary_dim <= 0 || rotary_dim % 16 != 0 || rotary_dim > problem.head_dim) {
    fail(kFn, "rotary_dim (2 * rotary_cos.size(1)) is ", rotary_dim,
         "; supported: a multiple of 16 from 16 to head_dim (", problem.head_dim, ")");
  }
  if (seqlen_ro < problem.cache_capacity) {
    fail(kFn, "rotary_cos.size(0) (seqlen_ro) is ", seqlen_ro, " but the cache holds up to ",
         problem.cache_capacity, " tokens; the tables must cover every position of the cache");
  }
  check_contiguous(kFn, "rotary_cos", p.rotary_cos);
  check_contiguous(kFn, "rotary_sin", p.rotary_sin);
  check_data_pointer(kFn, "rotary_cos", p.rotary_cos);
  check_data_pointer(kFn, "rotary_sin", p.rotary_sin);
  problem.rotary_cos = p.rotary_cos.data;
  problem.rotary_sin = p.rotary_sin.data;
  problem.rotary_dim = static_cast<int>(rotary_dim);
  problem.rotary_seqlen = to_int(kFn, "seqlen_ro (rotary_cos.size(0))", seqlen_ro);
  problem.rotary_interleaved = p.rotary_interleaved;
}

void check_and_fill_options(const MhaFwdKvcacheParams& p, KvcacheProblem& problem) {
  if (p.alibi_slopes.defined()) {
    check_dtype(kFn, "alibi_slopes", p.alibi_slopes, DType::kFloat32);
    check_same_device_as_q(kFn, "alibi_slopes", p.alibi_slopes, p.q);
    problem.alibi_batch_stride =
        check_alibi(kFn, p.alibi_slopes, problem.batch, problem.heads_q);
    problem.alibi_slopes = static_cast<const float*>(p.alibi_slopes.data);
  }
  check_score_options(kFn, p.softmax_scale, p.softcap, p.mask);
  if (p.num_splits < 0 || p.num_splits > kMaxKvcacheSplits) {
    fail(kFn, "num_splits is ", p.num_splits, "; supported: 0 (chosen by flashkit), 1 (no split) to ",
         kMaxKvcacheSplits);
  }
  problem.softmax_scale =
      p.softmax_scale == 0.0f
          ? static_cast<float>(1.0 / std::sqrt(static_cast<double>(problem.head_dim)))
          : p.softmax_scale;
  problem.softcap = p.softcap;
  // As mha_fwd, with the cache capacity as seqlen_k: the per-sequence key counts are on the device.
  const bool causal = p.mask.causal && !(problem.seqlen_q == 1 && !p.alibi_slopes.defined());
  int window_left = p.mask.window_left;
  int window_right = p.mask.window_right;
  if (window_left >= problem.cache_capacity) window_left = -1;
  if (window_right >= problem.cache_capacity) window_right = -1;
  if (causal) window_right = 0;
  problem.window_left = window_left;
  problem.window_right = window_right;
  problem.causal = window_left < 0 && window_right == 0;
}

}  // namespace

KvcacheProblem validate_mha_fwd_kvcache(const MhaFwdKvcacheParams& p) {
  KvcacheProblem problem;
  check_and_fill_tensors(p, problem);
  check_and_fill_lengths(p, problem);
  check_and_fill_rotary(p, problem);
  check_and_fill_options(p, problem);
  if (p.q.device.kind == DeviceKind::kCpu) {
    check_kvcache_contents(problem, {problem.cache_seqlens, problem.cache_leftpad,
                                     problem.cache_batch_idx, problem.block_table});
  }
  return problem;
}

void check_kvcache_contents(const KvcacheProblem& p, const KvcacheIndexArrays& a) {
  std::vector<int> row_of_cache(p.is_paged() ? 0 : p.cache_batches, -1);
  // Paged: each page the append writes -> the (sequence, block_table index) that names it.
  std::unordered_map<int, std::pair<int, int>> appending_page;
  for (int b = 0; b < p.batch; ++b) {
    const int length = a.cache_seqlens != nullptr ? a.cache_seqlens[b] : p.cache_seqlen;
    const int leftpad = a.cache_leftpad != nullptr ? a.cache_leftpad[b] : 0;
    if (length < 0 || static_cast<int64_t>(length) + p.seqlen_new > p.cache_capacity) {
      fail(kFn, "cache_seqlens[", b, "] is ", length, "; with seqlen_new = ", p.seqlen_new,
           " it must be in [0, ", p.cache_capacity - p.seqlen_new, "] (the capacity is ",
           p.cache_capacity, " tokens)");
    }
    if (leftpad < 0 || leftpad > length) {
      fail(kFn, "cache_leftpad[", b, "] is ", leftpad, "; it must be in [0, cache_seqlens[", b,
           "] = ", length, "]");
    }
    if (p.rotary_cos != nullptr) {  // the last query token's position is inside the tables
      const int queries_past_first = p.rotary_q_positions_per_token() ? p.seqlen_q - 1 : 0;
      const int64_t last = static_cast<int64_t>(length) - leftpad + queries_past_first;
      if (last >= p.rotary_seqlen) {
        fail(kFn, "with rotary, query token ", queries_past_first, " of sequence ", b,
             " sits at position ", last, " (cache_seqlens[", b, "] - cache_leftpad[", b, "]",
             queries_past_first > 0 ? " + its index" : "", ") but rotary_cos has ", p.rotary_seqlen,
             " rows (seqlen_ro); the tables must cover every query position");
      }
    }
    if (a.cache_batch_idx != nullptr) {
      const int row = a.cache_batch_idx[b];
      if (row < 0 || row >= p.cache_batches) {
        fail(kFn, "cache_batch_idx[", b, "] is ", row, "; it must be in [0, ", p.cache_batches,
             ") (k_cache.size(0))");
      }
      if (p.has_append() && row_of_cache[row] >= 0) {
        fail(kFn, "cache_batch_idx[", b, "] and cache_batch_idx[", row_of_cache[row], "] are both ",
             row, "; sequences that append must use distinct cache rows");
      }
      row_of_cache[row] = b;
    }
    if (a.block_table != nullptr) {
      const int end = length + p.seqlen_new;
      const int first_page = leftpad / p.page_block_size;
      const int end_page = (end + p.page_block_size - 1) / p.page_block_size;
      for (int i = first_page; i < end_page; ++i) {
        const int page = a.block_table[b * p.block_table_batch_stride + i];
        if (page < 0 || page >= p.cache_batches) {
          fail(kFn, "block_table[", b, "][", i, "] is ", page, "; sequence ", b, " uses pages ",
               first_page, "..", end_page - 1, " and each must be in [0, ", p.cache_batches,
               ") (num_blocks, k_cache.size(0))");
        }
      }
      // The pages the append writes: named twice (by two sequences, or twice by one), the rows
      // they get would depend on the order of the writes (the CUDA append writes every token of
      // every sequence in parallel).
      if (p.has_append() && p.seqlen_new > 0) {
        const int first_append_page = length / p.page_block_size;
        for (int i = first_append_page; i < end_page; ++i) {
          const int page = a.block_table[b * p.block_table_batch_stride + i];
          const auto [it, inserted] = appending_page.emplace(page, std::pair<int, int>{b, i});
          if (!inserted) {
            fail(kFn, "block_table[", b, "][", i, "] and block_table[", it->second.first, "][",
                 it->second.second, "] are both page ", page, " and both receive appended "
                 "tokens; the pages an append writes must be distinct");
          }
        }
      }
    }
  }
}

}  // namespace flashkit::api
