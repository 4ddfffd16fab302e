// src/cpu/reference_kvcache.cpp
// \brief The reference of mha_fwd_kvcache (see reference_kvcache.h).
//
// The attention reuses reference_fwd: each sequence b is gathered into a contiguous
// [len_k, heads_kv, head_dim] copy of its keys and values (cache entries [leftpad, length +
// seqlen_new), paged or not), its queries rotated into a copy, and handed to the forward reference
// as a batch-1 FwdProblem with the same options. The forward's masks, ALiBi and softcap then apply
// with seqlen_k = len_k, which is the semantics kvcache_params.h states.
#include "cpu/reference_kvcache.h"

#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include "common/fwd_problem.h"
#include "common/half_float.h"
#include "flashkit/error.h"

namespace flashkit::cpu {
namespace {

struct SequenceSpan {
  int length;   // cached tokens before the append
  int leftpad;  // first valid cache index
  int len_k;    // keys attended: length + seqlen_new - leftpad
};

SequenceSpan span_of(const KvcacheProblem& p, int b) {
  SequenceSpan s;
  s.length = p.cache_seqlens != nullptr ? p.cache_seqlens[b] : p.cache_seqlen;
  s.leftpad = p.cache_leftpad != nullptr ? p.cache_leftpad[b] : 0;
  s.len_k = s.length + p.seqlen_new - s.leftpad;
  return s;
}

// Element offset of (cache index `index`, kv head `head`) of sequence b, before the column.
int64_t cache_offset(const KvcacheProblem& p, int b, int64_t index, int head, bool values) {
  const int64_t batch_stride = values ? p.v_cache_batch_stride : p.k_cache_batch_stride;
  const int64_t row_stride = values ? p.v_cache_row_stride : p.k_cache_row_stride;
  const int64_t head_stride = values ? p.v_cache_head_stride : p.k_cache_head_stride;
  int64_t base;
  int64_t row;
  if (p.is_paged()) {
    base = p.block_table[b * p.block_table_batch_stride + index / p.page_block_size];
    row = index % p.page_block_size;
  } else {
    base = p.cache_batch_idx != nullptr ? p.cache_batch_idx[b] : b;
    row = index;
  }
  return base * batch_stride + row * row_stride + head * head_stride;
}

// `src` (head_dim elements of the dtype) rotated to `position` into `dst`; copied when no rotary.
void rotate_row(const KvcacheProblem& p, const uint16_t* src, int position, uint16_t* dst) {
  std::memcpy(dst, src, sizeof(uint16_t) * p.head_dim);
  if (p.rotary_dim == 0) return;
  const auto* cos_row = static_cast<const uint16_t*>(p.rotary_cos) +
                        static_cast<int64_t>(position) * (p.rotary_dim / 2);
  const auto* sin_row = static_cast<const uint16_t*>(p.rotary_sin) +
                        static_cast<int64_t>(position) * (p.rotary_dim / 2);
  for (int i = 0; i < p.rotary_dim / 2; ++i) {
    const int first = p.rotary_interleaved ? 2 * i : i;
    const int second = p.rotary_interleaved ? 2 * i + 1 : i + p.rotary_dim / 2;
    const RotatedPair r = rotate_pair(bits_to_float(p.dtype, src[first]),
                                      bits_to_float(p.dtype, src[second]),
                                      bits_to_float(p.dtype, cos_row[i]),
                                      bits_to_float(p.dtype, sin_row[i]));
    dst[first] = float_to_bits(p.dtype, r.first);
    dst[second] = float_to_bits(p.dtype, r.second);
  }
}

void check_problem(const KvcacheProblem& p) {
  if (p.dtype != DType::kFloat16 && p.dtype != DType::kBFloat16) {
    throw Error(std::string("reference_kvcache: dtype is ") + dtype_name(p.dtype) +
                "; supported: float16, bfloat16");
  }
  for (int b = 0; b < p.batch; ++b) {
    const SequenceSpan s = span_of(p, b);
    if (s.leftpad < 0 || s.length < s.leftpad ||
        static_cast<int64_t>(s.length) + p.seqlen_new > p.cache_capacity) {
      throw Error("reference_kvcache: sequence " + std::to_string(b) + " has length " +
                  std::to_string(s.length) + ", leftpad " + std::to_string(s.leftpad) +
                  " and appends " + std::to_string(p.seqlen_new) + " tokens to a cache of " +
                  std::to_string(p.cache_capacity));
    }
  }
}

// One sequence gathered for the forward reference, and the batch-1 problem over it.
struct GatheredSequence {
  std::vector<uint16_t> q, k, v;  // [seqlen_q, heads_q, d], [len_k, heads_kv, d] x 2
  FwdProblem problem;
};

GatheredSequence gather(const KvcacheProblem& p, int b) {
  const SequenceSpan s = span_of(p, b);
  const int d = p.head_dim;
  GatheredSequence g;
  g.q.resize(static_cast<size_t>(p.seqlen_q) * p.heads_q * d);
  g.k.resize(static_cast<size_t>(s.len_k) * p.heads_kv * d);
  g.v.resize(g.k.size());
  const auto* q = static_cast<const uint16_t*>(p.q);
  for (int i = 0; i < p.seqlen_q; ++i) {
    const int position = s.length - s.leftpad + (p.rotary_q_positions_per_token() ? i : 0);
    for (int h = 0; h < p.heads_q; ++h) {
      rotate_row(p, q + b * p.q_batch_stride + i * p.q_row_stride + h * p.q_head_stride, position,
                 &g.q[(static_cast<size_t>(i) * p.heads_q + h) * d]);
    }
  }
  const auto* k_cache = static_cast<const uint16_t*>(p.k_cache);
  const auto* v_cache = static_cast<const uint16_t*>(p.v_cache);
  for (int j = 0; j < s.len_k; ++j) {
    for (int h = 0; h < p.heads_kv; ++h) {
      const size_t dst = (static_cast<size_t>(j) * p.heads_kv + h) * d;
      std::memcpy(&g.k[dst], k_cache + cache_offset(p, b, s.leftpad + j, h, false),
                  sizeof(uint16_t) * d);
      std::memcpy(&g.v[dst], v_cache + cache_offset(p, b, s.leftpad + j, h, true),
                  sizeof(uint16_t) * d);
    }
  }
  FwdProblem& f = g.problem;
  f.dtype = p.dtype;
  f.batch = 1;
  f.heads_q = p.heads_q;
  f.heads_kv = p.heads_kv;
  f.head_dim = d;
  f.seqlen_q = p.seqlen_q;
  f.seqlen_k = s.len_k;
  f.q = g.q.data();
  f.k = g.k.data();
  f.v = g.v.data();
  f.q_row_stride = static_cast<int64_t>(p.heads_q) * d;
  f.q_head_stride = d;
  f.k_row_stride = f.v_row_stride = static_cast<int64_t>(p.heads_kv) * d;
  f.k_head_stride = f.v_head_stride = d;
  f.alibi_slopes =
      p.alibi_slopes != nullptr ? p.alibi_slopes + b * p.alibi_batch_stride : nullptr;
  f.softmax_scale = p.softmax_scale;
  f.softcap = p.softcap;
  f.window_left = p.window_left;
  f.window_right = p.window_right;
  f.causal = p.causal;
  return g;
}

}  // namespace

RotatedPair rotate_pair(float x1, float x2, float cos, float sin) {
  // volatile keeps each product rounded on its own: the kernels use __fmul_rn / __fsub_rn, which
  // the compiler never fuses, and a host compiler allowed to contract would differ in the last bit.
  volatile float a = x1 * cos;
  volatile float b = x2 * sin;
  volatile float c = x2 * cos;
  volatile float e = x1 * sin;
  return {a - b, c + e};
}

void reference_kvcache_append(const KvcacheProblem& p) {
  check_problem(p);
  if (!p.has_append()) return;
  const auto* k_new = static_cast<const uint16_t*>(p.k_new);
  const auto* v_new = static_cast<const uint16_t*>(p.v_new);
  auto* k_cache = static_cast<uint16_t*>(p.k_cache);
  auto* v_cache = static_cast<uint16_t*>(p.v_cache);
  const int d = p.head_dim;
  for (int b = 0; b < p.batch; ++b) {
    const SequenceSpan s = span_of(p, b);
    for (int i = 0; i < p.seqlen_new; ++i) {
      for (int h = 0; h < p.heads_kv; ++h) {
        rotate_row(p, k_new + b * p.k_new_batch_stride + i * p.k_new_row_stride +
                          h * p.k_new_head_stride,
                   s.length - s.leftpad + i, k_cache + cache_offset(p, b, s.length + i, h, false));
        std::memcpy(v_cache + cache_offset(p, b, s.length + i, h, true),
                    v_new + b * p.v_new_batch_stride + i * p.v_new_row_stride +
                        h * p.v_new_head_stride,
                    sizeof(uint16_t) * d);
      }
    }
  }
}

void reference_kvcache(const KvcacheProblem& p) {
  if (p.cu_seqlens_q != nullptr) {
    throw Error("reference_kvcache: varlen queries (cu_seqlens_q) are a CUDA decode-kernel form of "
                "mha_varlen_fwd, whose CPU backend is reference_fwd");
  }
  reference_kvcache_append(p);
  for (int b = 0; b < p.batch; ++b) {
    GatheredSequence g = gather(p, b);
    g.problem.out = static_cast<uint16_t*>(p.out) + b * p.out_batch_stride;
    g.problem.out_row_stride = p.out_row_stride;
    g.problem.out_head_stride = p.out_head_stride;
    g.problem.lse = p.lse + b * p.lse_batch_stride;
    g.problem.lse_head_stride = p.lse_head_stride;
    reference_fwd(g.problem);
  }
}

void reference_kvcache_attention_fp32(const KvcacheProblem& p, RefPrecision precision, float* out,
                                      float* lse) {
  check_problem(p);
  const size_t rows = static_cast<size_t>(p.heads_q) * p.seqlen_q;
  for (int b = 0; b < p.batch; ++b) {
    const GatheredSequence g = gather(p, b);
    reference_fwd_fp32(g.problem, precision, out + b * rows * p.head_dim, lse + b * rows);
  }
}

}  // namespace flashkit::cpu
