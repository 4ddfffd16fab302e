// tests/cpp/attention_case.h
// \brief The host side of a forward attention test case, shared by the CPU tests and the GPU tests
// and free of CUDA: the case description (FwdCase), seeded random inputs rounded into the 16-bit
// dtype (make_inputs), NaN poison for outputs, and AttentionCase, the CPU tests' host buffers with
// the views / params / FwdProblem over them.
//
// The backward pass adds BackwardCase: the same case with a random dout, the forward's out / lse
// computed by the CPU reference, and poisoned dq / dk / dv, with the backward views / params /
// BwdProblem over them.
//
// Host buffers are contiguous: q/out [batch * seqlen_q, heads_q, head_dim], k/v
// [batch * seqlen_k, heads_kv, head_dim] for fixed length, [total_q, heads_q, head_dim] and
// [total_k, heads_kv, head_dim] for varlen; softmax_lse [batch, heads_q, max_seqlen_q].
#pragma once

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <exception>
#include <functional>
#include <mutex>
#include <ostream>
#include <sstream>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "common/bwd_problem.h"
#include "common/fwd_problem.h"
#include "common/half_float.h"
#include "flashkit/api.h"
#include "flashkit/params.h"

namespace flashkit::test {

// ------------------------------------------------------------------------------------------------
// Host helpers: parallel loops and seeded random numbers
// ------------------------------------------------------------------------------------------------

// Runs body(i) for i in [0, n) on all hardware threads; rethrows the first exception.
inline void parallel_for(size_t n, const std::function<void(size_t)>& body) {
  const size_t threads = std::min<size_t>(n, std::max(1u, std::thread::hardware_concurrency()));
  if (threads <= 1) {
    for (size_t i = 0; i < n; ++i) body(i);
    return;
  }
  std::atomic<size_t> next{0};
  std::exception_ptr error;
  std::mutex error_mutex;
  std::vector<std::thread> pool;
  pool.reserve(threads);
  for (size_t t = 0; t < threads; ++t) {
    pool.emplace_back([&] {
      for (size_t i = next++; i < n; i = next++) {
        try {
          body(i);
        } catch (...) {
          std::lock_guard<std::mutex> lock(error_mutex);
          if (!error) error = std::current_exception();
        }
      }
    });
  }
  for (auto& thread : pool) thread.join();
  if (error) std::rethrow_exception(error);
}

inline uint64_t splitmix64(uint64_t x) {
  x += 0x9e3779b97f4a7c15ull;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
  return x ^ (x >> 31);
}

// A small deterministic generator (the standard distributions are implementation-defined, so
// they would draw different cases on different standard libraries).
class Rng {
 public:
  explicit Rng(uint64_t seed) : state_(seed) {}
  uint64_t next() { return state_ = splitmix64(state_); }
  int uniform_int(int lo, int hi) {  // inclusive
    return lo + static_cast<int>(next() % static_cast<uint64_t>(hi - lo + 1));
  }
  double uniform01() { return static_cast<double>(next() >> 11) * 0x1.0p-53; }
  bool chance(double p) { return uniform01() < p; }
  template <class T>
  const T& pick(const std::vector<T>& v) {
    return v[next() % v.size()];
  }

 private:
  uint64_t state_;
};

// Element `index` of the random stream `stream_seed`: standard normal (Box-Muller), with one
// element in 64 multiplied by `outlier_factor`, so that some scores are large and some softmax rows
// peaky. A pure function of (seed, index): inputs fill in parallel and can be regenerated anywhere.
inline float input_value(uint64_t stream_seed, uint64_t index, float outlier_factor) {
  const uint64_t a = splitmix64(stream_seed ^ splitmix64(index));
  const uint64_t b = splitmix64(a);
  const double u1 = static_cast<double>((a >> 11) + 1) * 0x1.0p-53;  // (0, 1]
  const double u2 = static_cast<double>(b >> 11) * 0x1.0p-53;        // [0, 1)
  double normal = std::sqrt(-2.0 * std::log(u1)) * std::cos(6.283185307179586 * u2);
  if ((b & 63) == 0) normal *= outlier_factor;
  return static_cast<float>(normal);
}

// Fills bits[i] with round(dtype, scale * input_value(seed, i, outlier_factor)): the oracle and the
// kernel both see exactly these rounded values.
inline void fill_random(std::vector<uint16_t>& bits, DType dtype, uint64_t seed, float scale,
                        float outlier_factor) {
  constexpr size_t kChunk = size_t{1} << 16;
  const size_t chunks = (bits.size() + kChunk - 1) / kChunk;
  parallel_for(chunks, [&](size_t chunk) {
    const size_t end = std::min(bits.size(), (chunk + 1) * kChunk);
    for (size_t i = chunk * kChunk; i < end; ++i) {
      bits[i] = flashkit::float_to_bits(dtype, scale * input_value(seed, i, outlier_factor));
    }
  });
}

// ------------------------------------------------------------------------------------------------
// Test cases
// ------------------------------------------------------------------------------------------------

enum class AlibiKind { kNone, kPerHead, kPerBatchHead };

inline const char* short_dtype_name(DType dtype) {
  return dtype == DType::kBFloat16 ? "bf16" : dtype == DType::kFloat16 ? "fp16" : "other";
}

// Everything that defines one forward call. Fixed length uses seqlen_q/seqlen_k; varlen uses the
// per-sequence lengths (and packs them, followed by tail_q/tail_k unused tokens).
struct FwdCase {
  std::string name;  // a GoogleTest-safe name ([A-Za-z0-9_])
  DType dtype = DType::kBFloat16;
  int batch = 1;
  int heads_q = 1;
  int heads_kv = 1;
  int head_dim = 64;
  int seqlen_q = 1;  // fixed length only
  int seqlen_k = 1;  // fixed length only

  bool varlen = false;
  std::vector<int> lens_q;  // varlen: [batch]
  std::vector<int> lens_k;  // varlen: [batch]
  std::vector<int> used_k;  // varlen: seqused_k [batch]; empty: not passed
  int tail_q = 0;           // varlen: tokens after cu_seqlens_q[batch] that belong to no sequence
  int tail_k = 0;
  int extra_max_seqlen_q = 0;  // varlen: max_seqlen_q is passed as max(lens_q) + this

  bool causal = false;
  int window_left = -1;
  int window_right = -1;
  AlibiKind alibi = AlibiKind::kNone;
  float softcap = 0.0f;
  float softmax_scale = 0.0f;  // 0: the default 1/sqrt(head_dim)
  float q_scale = 1.0f;        // multiplies the random queries: softcap needs large scores
  uint64_t seed = 1;
  DropoutSpec dropout{};       // p = 0: off

  int max_len_q() const {
    return varlen ? *std::max_element(lens_q.begin(), lens_q.end()) + extra_max_seqlen_q : seqlen_q;
  }
  int max_len_k() const {
    return varlen ? *std::max_element(lens_k.begin(), lens_k.end()) : seqlen_k;
  }
  // Rows per (batch, head) of softmax_lse (and of the oracle's output blocks).
  int lse_rows() const { return max_len_q(); }
  int len_q(int b) const { return varlen ? lens_q[b] : seqlen_q; }
  int len_k(int b) const { return varlen ? lens_k[b] : seqlen_k; }
  // Token index of the first query / key of sequence b in the packed (or [batch*seqlen]) arrays.
  int64_t start_q(int b) const {
    return varlen ? prefix_sums(lens_q, prefix_q_)[b] : int64_t{b} * seqlen_q;
  }
  int64_t start_k(int b) const {
    return varlen ? prefix_sums(lens_k, prefix_k_)[b] : int64_t{b} * seqlen_k;
  }
  // Tokens written by a correct kernel (rows past them must keep their poison).
  int64_t used_tokens_q() const { return varlen ? start_q(batch) : int64_t{batch} * seqlen_q; }
  int64_t total_q() const { return used_tokens_q() + (varlen ? tail_q : 0); }
  int64_t total_k() const { return varlen ? start_k(batch) + tail_k : int64_t{batch} * seqlen_k; }

  std::string describe() const;

 private:
  // Prefix sums of `lens`, cached (batches of 70,000 sequences are looked up once per row). A
  // case is built, then used: its lengths do not change after the first lookup.
  static const std::vector<int64_t>& prefix_sums(const std::vector<int>& lens,
                                                 std::vector<int64_t>& cache) {
    if (cache.size() != lens.size() + 1) {
      cache.assign(1, 0);
      for (int len : lens) cache.push_back(cache.back() + len);
    }
    return cache;
  }
  mutable std::vector<int64_t> prefix_q_, prefix_k_;
};

inline std::string list_string(const std::vector<int>& v) {
  std::ostringstream os;
  os << "{";
  const size_t shown = std::min<size_t>(v.size(), 24);
  for (size_t i = 0; i < shown; ++i) os << (i ? ", " : "") << v[i];
  if (shown < v.size()) os << ", ... (" << v.size() << " in all)";
  os << "}";
  return os.str();
}

inline std::string FwdCase::describe() const {
  std::ostringstream os;
  os << name << ": " << short_dtype_name(dtype) << " batch=" << batch << " heads_q=" << heads_q
     << " heads_kv=" << heads_kv << " head_dim=" << head_dim;
  if (varlen) {
    os << " varlen lens_q=" << list_string(lens_q) << " lens_k=" << list_string(lens_k);
    if (!used_k.empty()) os << " seqused_k=" << list_string(used_k);
    os << " tail_q=" << tail_q << " tail_k=" << tail_k << " max_seqlen_q=" << max_len_q()
       << " max_seqlen_k=" << max_len_k();
  } else {
    os << " seqlen_q=" << seqlen_q << " seqlen_k=" << seqlen_k;
  }
  os << " causal=" << (causal ? "true" : "false") << " window=(" << window_left << ", "
     << window_right << ")";
  if (alibi != AlibiKind::kNone) {
    os << " alibi=" << (alibi == AlibiKind::kPerHead ? "[heads_q]" : "[batch, heads_q]");
  }
  if (softcap > 0.0f) os << " softcap=" << softcap;
  os << " softmax_scale="
     << (softmax_scale == 0.0f ? std::string("default") : std::to_string(softmax_scale));
  if (q_scale != 1.0f) os << " q_scale=" << q_scale;
  if (dropout.p > 0.0f) {
    os << " dropout=(p " << dropout.p << ", seed " << dropout.seed << ", offset " << dropout.offset
       << ")";
  }
  os << " seed=" << seed;
  return os.str();
}

// GoogleTest prints parameters with this (instead of a byte dump).
inline void PrintTo(const FwdCase& c, std::ostream* os) { *os << c.describe(); }

// ------------------------------------------------------------------------------------------------
// Host inputs
// ------------------------------------------------------------------------------------------------

struct HostInputs {
  std::vector<uint16_t> q;  // [total_q, heads_q, head_dim] (fixed: [batch * seqlen_q, ...])
  std::vector<uint16_t> k;  // [total_k, heads_kv, head_dim]
  std::vector<uint16_t> v;
  std::vector<float> alibi;  // [heads_q] or [batch, heads_q]
  std::vector<int> cu_q;     // varlen: [batch + 1]
  std::vector<int> cu_k;
  std::vector<int> used_k;  // varlen with seqused_k: [batch]
};

inline HostInputs make_inputs(const FwdCase& c) {
  HostInputs in;
  const int d = c.head_dim;
  in.q.resize(static_cast<size_t>(c.total_q()) * c.heads_q * d);
  in.k.resize(static_cast<size_t>(c.total_k()) * c.heads_kv * d);
  in.v.resize(in.k.size());
  // Outliers (x4) in q and k give heavy-tailed scores: peaky rows, large running-max updates. v
  // stays standard normal: the error rule takes one max over all outputs, and outliers in v would
  // inflate the input-dtype reference's error (probability error x |v|) and with it the bound.
  fill_random(in.q, c.dtype, splitmix64(c.seed * 4 + 0), c.q_scale, 4.0f);
  fill_random(in.k, c.dtype, splitmix64(c.seed * 4 + 1), 1.0f, 4.0f);
  fill_random(in.v, c.dtype, splitmix64(c.seed * 4 + 2), 1.0f, 1.0f);
  if (c.alibi != AlibiKind::kNone) {
    // The usual geometric slopes 2^(-8 (h + 1) / heads); per-batch slopes get a random factor in
    // [0.5, 1.5) so that batches differ.
    Rng rng(splitmix64(c.seed * 4 + 3));
    const int rows = c.alibi == AlibiKind::kPerBatchHead ? c.batch : 1;
    for (int b = 0; b < rows; ++b) {
      for (int h = 0; h < c.heads_q; ++h) {
        float slope = std::exp2(-8.0f * static_cast<float>(h + 1) / static_cast<float>(c.heads_q));
        if (c.alibi == AlibiKind::kPerBatchHead) slope *= static_cast<float>(0.5 + rng.uniform01());
        in.alibi.push_back(slope);
      }
    }
  }
  if (c.varlen) {
    for (int b = 0; b <= c.batch; ++b) {
      in.cu_q.push_back(static_cast<int>(c.start_q(b)));
      in.cu_k.push_back(static_cast<int>(c.start_k(b)));
    }
    in.used_k = c.used_k;
  }
  return in;
}

// The gradient of out for a backward case, [total_q, heads_q, head_dim] like q: standard normal,
// rounded into the dtype, from its own random stream.
inline std::vector<uint16_t> make_dout(const FwdCase& c) {
  std::vector<uint16_t> dout(static_cast<size_t>(c.total_q()) * c.heads_q * c.head_dim);
  fill_random(dout, c.dtype, splitmix64(~(c.seed * 4)), 1.0f, 1.0f);
  return dout;
}

// ------------------------------------------------------------------------------------------------
// The case on the host, for the CPU tests
// ------------------------------------------------------------------------------------------------

// A quiet NaN of dtype, to poison outputs: a row the code under test forgets to write stays NaN.
inline uint16_t nan_bits(DType dtype) { return dtype == DType::kFloat16 ? 0x7e00 : 0x7fc0; }

// The inputs of make_inputs, out poisoned with nan_bits and lse with NaN, and the CPU views over
// them. Tests may replace or resize any buffer before they ask for views.
class AttentionCase {
 public:
  explicit AttentionCase(FwdCase c) : case_(std::move(c)) {
    in = make_inputs(case_);
    out.assign(in.q.size(), nan_bits(case_.dtype));
    lse.assign(static_cast<size_t>(case_.batch) * case_.heads_q * case_.lse_rows(), std::nanf(""));
  }

  const FwdCase& fwd_case() const { return case_; }

  // Element index of (token, head, c) in the contiguous q/out or k/v buffers (token counts over the
  // whole batch: b * seqlen + i for fixed length, the packed index for varlen).
  int64_t q_index(int64_t token, int head, int c) const {
    return (token * case_.heads_q + head) * case_.head_dim + c;
  }
  int64_t k_index(int64_t token, int head, int c) const {
    return (token * case_.heads_kv + head) * case_.head_dim + c;
  }

  // The tensor views of the public API over this case's buffers (CPU).
  FwdCommon common_views() {
    const Device cpu{};
    const FwdCase& c = case_;
    const int64_t hq = c.heads_q, hkv = c.heads_kv, d = c.head_dim;
    FwdCommon f;
    if (c.varlen) {
      f.q = make_view(in.q.data(), c.dtype, {c.total_q(), hq, d}, cpu);
      f.k = make_view(in.k.data(), c.dtype, {c.total_k(), hkv, d}, cpu);
      f.v = make_view(in.v.data(), c.dtype, {c.total_k(), hkv, d}, cpu);
      f.out = make_view(out.data(), c.dtype, {c.total_q(), hq, d}, cpu);
    } else {
      f.q = make_view(in.q.data(), c.dtype, {c.batch, c.seqlen_q, hq, d}, cpu);
      f.k = make_view(in.k.data(), c.dtype, {c.batch, c.seqlen_k, hkv, d}, cpu);
      f.v = make_view(in.v.data(), c.dtype, {c.batch, c.seqlen_k, hkv, d}, cpu);
      f.out = make_view(out.data(), c.dtype, {c.batch, c.seqlen_q, hq, d}, cpu);
    }
    f.softmax_lse = make_view(lse.data(), DType::kFloat32, {c.batch, hq, c.lse_rows()}, cpu);
    if (c.alibi == AlibiKind::kPerHead) {
      f.alibi_slopes = make_view(in.alibi.data(), DType::kFloat32, {hq}, cpu);
    } else if (c.alibi == AlibiKind::kPerBatchHead) {
      f.alibi_slopes = make_view(in.alibi.data(), DType::kFloat32, {c.batch, hq}, cpu);
    }
    f.softmax_scale = c.softmax_scale;
    f.softcap = c.softcap;
    f.mask = MaskSpec{c.causal, c.window_left, c.window_right};
    f.dropout = c.dropout;
    return f;
  }

  MhaFwdParams fwd_params() {
    MhaFwdParams p;
    static_cast<FwdCommon&>(p) = common_views();
    return p;
  }

  MhaVarlenFwdParams varlen_params() {
    MhaVarlenFwdParams p;
    static_cast<FwdCommon&>(p) = common_views();
    const Device cpu{};
    const int batch = case_.batch;
    p.cu_seqlens_q = make_view(in.cu_q.data(), DType::kInt32, {batch + 1}, cpu);
    p.cu_seqlens_k = make_view(in.cu_k.data(), DType::kInt32, {batch + 1}, cpu);
    if (!in.used_k.empty()) {
      p.seqused_k = make_view(in.used_k.data(), DType::kInt32, {batch}, cpu);
    }
    p.max_seqlen_q = case_.max_len_q();
    p.max_seqlen_k = case_.max_len_k();
    return p;
  }

  // The problem exactly as specified, built without validation: only the softmax scale default and
  // causal (window_right = 0) are applied, so windows reach the reference unresolved.
  FwdProblem problem() {
    const FwdCase& c = case_;
    FwdProblem p;
    p.dtype = c.dtype;
    p.batch = c.batch;
    p.heads_q = c.heads_q;
    p.heads_kv = c.heads_kv;
    p.head_dim = c.head_dim;
    p.seqlen_q = c.max_len_q();
    p.seqlen_k = c.max_len_k();
    p.q = in.q.data();
    p.k = in.k.data();
    p.v = in.v.data();
    p.out = out.data();
    const int64_t hq = c.heads_q, hkv = c.heads_kv, d = c.head_dim;
    p.q_row_stride = p.out_row_stride = hq * d;
    p.q_head_stride = p.out_head_stride = d;
    p.k_row_stride = p.v_row_stride = hkv * d;
    p.k_head_stride = p.v_head_stride = d;
    if (!c.varlen) {
      p.q_batch_stride = p.out_batch_stride = c.seqlen_q * hq * d;
      p.k_batch_stride = p.v_batch_stride = c.seqlen_k * hkv * d;
    } else {
      p.cu_seqlens_q = in.cu_q.data();
      p.cu_seqlens_k = in.cu_k.data();
      p.seqused_k = in.used_k.empty() ? nullptr : in.used_k.data();
    }
    p.lse = lse.data();
    p.lse_head_stride = c.lse_rows();
    p.lse_batch_stride = hq * c.lse_rows();
    if (c.alibi != AlibiKind::kNone) {
      p.alibi_slopes = in.alibi.data();
      p.alibi_batch_stride = c.alibi == AlibiKind::kPerBatchHead ? hq : 0;
    }
    p.softmax_scale = c.softmax_scale != 0.0f
                          ? c.softmax_scale
                          : static_cast<float>(1.0 / std::sqrt(static_cast<double>(d)));
    p.softcap = c.softcap;
    p.causal = c.causal;
    p.window_left = c.window_left;
    p.window_right = c.causal ? 0 : c.window_right;
    p.dropout_p = c.dropout.p;
    p.dropout_seed = c.dropout.seed;
    p.dropout_offset = c.dropout.offset;
    return p;
  }

  HostInputs in;
  std::vector<uint16_t> out;
  std::vector<float> lse;

 private:
  FwdCase case_;
};

// The backward of a case on the host: the inputs and the forward's out / lse (computed by the CPU
// reference through mha_fwd / mha_varlen_fwd, as a training step would), a random dout, and
// dq / dk / dv poisoned with nan_bits. Tests may replace any buffer before they ask for views.
class BackwardCase : public AttentionCase {
 public:
  explicit BackwardCase(FwdCase c) : AttentionCase(std::move(c)) {
    const FwdCase& s = fwd_case();
    if (s.varlen) {
      mha_varlen_fwd(varlen_params());
    } else {
      mha_fwd(fwd_params());
    }
    dout = make_dout(s);
    dq.assign(in.q.size(), nan_bits(s.dtype));
    dk.assign(in.k.size(), nan_bits(s.dtype));
    dv.assign(in.v.size(), nan_bits(s.dtype));
  }

  // The backward's views over this case's buffers (CPU): the forward's plus dout / dq / dk / dv.
  BwdCommon bwd_common_views() {
    const FwdCommon f = common_views();
    BwdCommon b;
    b.q = f.q;
    b.k = f.k;
    b.v = f.v;
    b.out = f.out;
    b.softmax_lse = f.softmax_lse;
    b.alibi_slopes = f.alibi_slopes;
    b.softmax_scale = f.softmax_scale;
    b.softcap = f.softcap;
    b.mask = f.mask;
    b.dropout = f.dropout;
    b.dout = like(f.q, dout.data());
    b.dq = like(f.q, dq.data());
    b.dk = like(f.k, dk.data());
    b.dv = like(f.v, dv.data());
    return b;
  }

  MhaBwdParams bwd_params() {
    MhaBwdParams p;
    static_cast<BwdCommon&>(p) = bwd_common_views();
    return p;
  }

  MhaVarlenBwdParams varlen_bwd_params() {
    MhaVarlenBwdParams p;
    static_cast<BwdCommon&>(p) = bwd_common_views();
    const MhaVarlenFwdParams f = varlen_params();
    p.cu_seqlens_q = f.cu_seqlens_q;
    p.cu_seqlens_k = f.cu_seqlens_k;
    p.seqused_k = f.seqused_k;
    p.max_seqlen_q = f.max_seqlen_q;
    p.max_seqlen_k = f.max_seqlen_k;
    return p;
  }

  // The backward problem exactly as specified (AttentionCase::problem() for the forward part),
  // built without validation, over contiguous buffers.
  BwdProblem bwd_problem() {
    BwdProblem b;
    b.fwd = problem();
    const FwdCase& c = fwd_case();
    b.dout = dout.data();
    b.dq = dq.data();
    b.dk = dk.data();
    b.dv = dv.data();
    b.dout_row_stride = b.dq_row_stride = b.fwd.q_row_stride;
    b.dout_head_stride = b.dq_head_stride = b.fwd.q_head_stride;
    b.dout_batch_stride = b.dq_batch_stride = b.fwd.q_batch_stride;
    b.dk_row_stride = b.dv_row_stride = b.fwd.k_row_stride;
    b.dk_head_stride = b.dv_head_stride = b.fwd.k_head_stride;
    b.dk_batch_stride = b.dv_batch_stride = b.fwd.k_batch_stride;
    b.total_q = c.total_q();
    b.total_k = c.total_k();
    return b;
  }

  std::vector<uint16_t> dout;
  std::vector<uint16_t> dq;
  std::vector<uint16_t> dk;
  std::vector<uint16_t> dv;

 private:
  // A view with the dtype, shape, strides and device of `shape_of`, over `data`.
  static TensorView like(const TensorView& shape_of, void* data) {
    TensorView view = shape_of;
    view.data = data;
    return view;
  }
};

}  // namespace flashkit::test
