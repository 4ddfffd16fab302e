// tests/cpp/kvcache_case.h
// \brief The host side of an mha_fwd_kvcache test case, shared by the CPU and the GPU tests: the
// case description (KvcacheCase), seeded inputs rounded into the dtype (make_kvcache_inputs: caches,
// randperm block tables, lengths, left pads, batch indices, rotary tables of real angles), and the
// params over any set of buffers (kvcache_params), host or device. Builds on attention_case.h
// (Rng, fill_random, short_dtype_name).
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <numeric>
#include <ostream>
#include <sstream>
#include <string>
#include <vector>

#include "attention_case.h"
#include "common/half_float.h"
#include "flashkit/flashkit.h"

namespace flashkit::test {

// 0xFFFF: NaN in fp16 and bf16, the fill of outputs a test expects to be overwritten.
constexpr uint16_t kKvcachePoison16 = 0xFFFF;

struct KvcacheCase {
  std::string name;
  DType dtype = DType::kBFloat16;
  int batch = 2;
  int heads_q = 4;
  int heads_kv = 2;
  int head_dim = 64;
  int seqlen_q = 1;
  int seqlen_new = 0;       // 0: no append
  int page_block_size = 0;  // 0: contiguous cache
  int capacity = 64;        // per sequence: seqlen_cache, or max_blocks_per_seq * page_block_size
  int extra_cache_rows = 0;  // contiguous: batch_cache = batch + extra (with cache_batch_idx)
  bool batch_idx = false;
  bool leftpad = false;
  bool scalar_length = false;  // cache_seqlen instead of cache_seqlens
  bool fill_to_end = false;    // the longest sequence's append ends exactly at the capacity
  int rotary_dim = 0;
  bool rotary_interleaved = false;
  bool causal = false;
  int window_left = -1;
  int window_right = -1;
  bool alibi = false;
  float softcap = 0.0f;
  int num_splits = 1;
  uint64_t seed = 1;

  int max_blocks() const { return page_block_size > 0 ? capacity / page_block_size : 0; }
  // Paged: twice the pages the batch needs, so the randperm table leaves holes.
  int num_blocks() const { return 2 * batch * max_blocks() + 1; }
  int cache_batches() const { return page_block_size > 0 ? num_blocks() : batch + extra_cache_rows; }
  int cache_rows() const { return page_block_size > 0 ? page_block_size : capacity; }
  int64_t cache_elements() const {
    return int64_t{cache_batches()} * cache_rows() * heads_kv * head_dim;
  }
  std::string describe() const {
    std::ostringstream os;
    os << name << " " << short_dtype_name(dtype) << " b" << batch << " h" << heads_q << "/"
       << heads_kv << " d" << head_dim << " sq" << seqlen_q << " new" << seqlen_new << " cap"
       << capacity << " page" << page_block_size << " rot" << rotary_dim
       << (rotary_interleaved ? "i" : "") << (batch_idx ? " bidx" : "") << (leftpad ? " lpad" : "")
       << (causal ? " causal" : "") << " win" << window_left << "," << window_right
       << (alibi ? " alibi" : "") << " cap" << softcap << " splits" << num_splits;
    return os.str();
  }
};

// GoogleTest prints a parameterised case with this instead of its bytes.
inline void PrintTo(const KvcacheCase& c, std::ostream* os) { *os << c.describe(); }

struct KvcacheInputs {
  std::vector<uint16_t> q, k_cache, v_cache, k_new, v_new, rotary_cos, rotary_sin;
  std::vector<float> alibi;
  std::vector<int> seqlens, leftpad, batch_idx, block_table;
};

// Lengths are drawn so every append fits: length + seqlen_new <= capacity, leftpad <= length.
inline KvcacheInputs make_kvcache_inputs(const KvcacheCase& c) {
  KvcacheInputs in;
  Rng rng(c.seed * 7919 + 17);
  const int64_t hq = c.heads_q, hkv = c.heads_kv, d = c.head_dim;
  in.q.resize(c.batch * c.seqlen_q * hq * d);
  fill_random(in.q, c.dtype, c.seed * 11 + 1, 1.0f, 1.0f);
  in.k_cache.resize(c.cache_elements());
  in.v_cache.resize(c.cache_elements());
  fill_random(in.k_cache, c.dtype, c.seed * 11 + 2, 1.0f, 1.0f);
  fill_random(in.v_cache, c.dtype, c.seed * 11 + 3, 1.0f, 1.0f);
  if (c.seqlen_new > 0) {
    in.k_new.resize(c.batch * c.seqlen_new * hkv * d);
    in.v_new.resize(in.k_new.size());
    fill_random(in.k_new, c.dtype, c.seed * 11 + 4, 1.0f, 1.0f);
    fill_random(in.v_new, c.dtype, c.seed * 11 + 5, 1.0f, 1.0f);
  }
  const int max_length = c.capacity - c.seqlen_new;
  const int scalar = rng.uniform_int(0, max_length);
  for (int b = 0; b < c.batch; ++b) {
    int length = c.scalar_length ? scalar : rng.uniform_int(0, max_length);
    if (c.fill_to_end && b == 0) length = max_length;
    in.seqlens.push_back(length);
    in.leftpad.push_back(c.leftpad ? rng.uniform_int(0, length) : 0);
  }
  if (c.batch_idx) {
    std::vector<int> rows(c.batch + c.extra_cache_rows);
    std::iota(rows.begin(), rows.end(), 0);
    for (size_t i = rows.size(); i > 1; --i) std::swap(rows[i - 1], rows[rng.next() % i]);
    in.batch_idx.assign(rows.begin(), rows.begin() + c.batch);
  }
  if (c.page_block_size > 0) {
    std::vector<int> pages(c.num_blocks());
    std::iota(pages.begin(), pages.end(), 0);
    for (size_t i = pages.size(); i > 1; --i) std::swap(pages[i - 1], pages[rng.next() % i]);
    in.block_table.assign(pages.begin(), pages.begin() + int64_t{c.batch} * c.max_blocks());
  }
  if (c.rotary_dim > 0) {
    const int half = c.rotary_dim / 2;
    in.rotary_cos.resize(int64_t{c.capacity} * half);
    in.rotary_sin.resize(in.rotary_cos.size());
    for (int pos = 0; pos < c.capacity; ++pos) {
      for (int i = 0; i < half; ++i) {
        const double angle = pos * std::pow(10000.0, -2.0 * i / c.rotary_dim);
        in.rotary_cos[pos * half + i] = float_to_bits(c.dtype, static_cast<float>(std::cos(angle)));
        in.rotary_sin[pos * half + i] = float_to_bits(c.dtype, static_cast<float>(std::sin(angle)));
      }
    }
  }
  if (c.alibi) {
    for (int h = 0; h < c.heads_q; ++h) in.alibi.push_back(0.05f * (h + 1) / c.heads_q);
  }
  return in;
}

// Where each tensor of a case lives (host vectors' data, or device copies of them).
struct KvcacheBuffers {
  void* q = nullptr;
  void* k_cache = nullptr;
  void* v_cache = nullptr;
  void* k_new = nullptr;
  void* v_new = nullptr;
  void* rotary_cos = nullptr;
  void* rotary_sin = nullptr;
  void* alibi = nullptr;
  void* seqlens = nullptr;
  void* leftpad = nullptr;
  void* batch_idx = nullptr;
  void* block_table = nullptr;
  void* out = nullptr;
  void* lse = nullptr;
};

inline KvcacheBuffers host_buffers(KvcacheInputs& in, std::vector<uint16_t>& out,
                                   std::vector<float>& lse) {
  auto ptr = [](auto& v) -> void* { return v.empty() ? nullptr : v.data(); };
  KvcacheBuffers b;
  b.q = ptr(in.q);
  b.k_cache = ptr(in.k_cache);
  b.v_cache = ptr(in.v_cache);
  b.k_new = ptr(in.k_new);
  b.v_new = ptr(in.v_new);
  b.rotary_cos = ptr(in.rotary_cos);
  b.rotary_sin = ptr(in.rotary_sin);
  b.alibi = ptr(in.alibi);
  b.seqlens = ptr(in.seqlens);
  b.leftpad = ptr(in.leftpad);
  b.batch_idx = ptr(in.batch_idx);
  b.block_table = ptr(in.block_table);
  b.out = ptr(out);
  b.lse = ptr(lse);
  return b;
}

// The params of case `c` over `buf` (contiguous layouts) on `device`.
inline MhaFwdKvcacheParams kvcache_params(const KvcacheCase& c, const KvcacheInputs& in,
                                          const KvcacheBuffers& buf, Device device) {
  const int64_t hq = c.heads_q, hkv = c.heads_kv, d = c.head_dim;
  MhaFwdKvcacheParams p;
  p.q = make_view(buf.q, c.dtype, {c.batch, c.seqlen_q, hq, d}, device);
  p.k_cache = make_view(buf.k_cache, c.dtype, {c.cache_batches(), c.cache_rows(), hkv, d}, device);
  p.v_cache = make_view(buf.v_cache, c.dtype, {c.cache_batches(), c.cache_rows(), hkv, d}, device);
  if (c.page_block_size > 0) {
    p.block_table = make_view(buf.block_table, DType::kInt32, {c.batch, c.max_blocks()}, device);
  }
  if (c.scalar_length) {
    p.cache_seqlen = in.seqlens[0];
  } else {
    p.cache_seqlens = make_view(buf.seqlens, DType::kInt32, {c.batch}, device);
  }
  if (c.seqlen_new > 0) {
    p.k_new = make_view(buf.k_new, c.dtype, {c.batch, c.seqlen_new, hkv, d}, device);
    p.v_new = make_view(buf.v_new, c.dtype, {c.batch, c.seqlen_new, hkv, d}, device);
  }
  if (c.rotary_dim > 0) {
    p.rotary_cos = make_view(buf.rotary_cos, c.dtype, {c.capacity, c.rotary_dim / 2}, device);
    p.rotary_sin = make_view(buf.rotary_sin, c.dtype, {c.capacity, c.rotary_dim / 2}, device);
    p.rotary_interleaved = c.rotary_interleaved;
  }
  if (c.batch_idx) p.cache_batch_idx = make_view(buf.batch_idx, DType::kInt32, {c.batch}, device);
  if (c.leftpad) p.cache_leftpad = make_view(buf.leftpad, DType::kInt32, {c.batch}, device);
  if (c.alibi) p.alibi_slopes = make_view(buf.alibi, DType::kFloat32, {hq}, device);
  p.out = make_view(buf.out, c.dtype, {c.batch, c.seqlen_q, hq, d}, device);
  p.softmax_lse = make_view(buf.lse, DType::kFloat32, {c.batch, hq, c.seqlen_q}, device);
  p.softcap = c.softcap;
  p.mask.causal = c.causal;
  p.mask.window_left = c.window_left;
  p.mask.window_right = c.window_right;
  p.num_splits = c.num_splits;
  return p;
}

}  // namespace flashkit::test
