// tests/cpp/attention_case.h
// \brief One forward attention problem on the host for the C++ tests: random inputs (fixed seed,
// rounded to the input dtype), poisoned outputs, and the views / params / FwdProblem over them.
//
// Buffers are contiguous: q/out [batch, seqlen_q, heads_q, head_dim], k/v [batch, seqlen_k,
// heads_kv, head_dim], softmax_lse [batch, heads_q, seqlen_q]; for a varlen case q/out are
// [total_q, heads_q, head_dim], k/v [total_k, heads_kv, head_dim] and softmax_lse
// [batch, heads_q, max_seqlen_q].
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <random>
#include <vector>

#include "common/fwd_problem.h"
#include "common/half_float.h"
#include "flashkit/params.h"

namespace flashkit::test {

enum class Alibi { kNone, kPerHead, kPerBatchHead };

struct CaseSpec {
  DType dtype = DType::kBFloat16;
  int batch = 1;  // ignored for varlen: lens_q.size() is the batch
  int heads_q = 1;
  int heads_kv = 1;
  int head_dim = 64;
  int seqlen_q = 1;  // fixed length only
  int seqlen_k = 1;
  // Varlen when lens_q is not empty: per-sequence lengths; used_k (optional) becomes seqused_k.
  std::vector<int> lens_q, lens_k, used_k;
  int tail_tokens = 0;         // unused tokens after the last sequence of the packed q/k/v
  float softmax_scale = 0.0f;  // 0: 1/sqrt(head_dim)
  float softcap = 0.0f;
  bool causal = false;
  int window_left = -1;
  int window_right = -1;
  Alibi alibi = Alibi::kNone;
  uint64_t seed = 1;

  bool is_varlen() const { return !lens_q.empty(); }
};

// A quiet NaN of dtype, to poison outputs: a row the code under test forgets to write stays NaN.
inline uint16_t nan_bits(DType dtype) { return dtype == DType::kFloat16 ? 0x7e00 : 0x7fc0; }

class AttentionCase {
 public:
  explicit AttentionCase(const CaseSpec& spec) : spec_(spec) {
    batch_ = spec.is_varlen() ? static_cast<int>(spec.lens_q.size()) : spec.batch;
    if (spec.is_varlen()) {
      cu_seqlens_q.assign(1, 0);
      cu_seqlens_k.assign(1, 0);
      for (int b = 0; b < batch_; ++b) {
        cu_seqlens_q.push_back(cu_seqlens_q.back() + spec.lens_q[b]);
        cu_seqlens_k.push_back(cu_seqlens_k.back() + spec.lens_k[b]);
      }
      seqused_k = spec.used_k;
      max_seqlen_q = *std::max_element(spec.lens_q.begin(), spec.lens_q.end());
      max_seqlen_k = *std::max_element(spec.lens_k.begin(), spec.lens_k.end());
      total_q = cu_seqlens_q.back() + spec.tail_tokens;
      total_k = cu_seqlens_k.back() + spec.tail_tokens;
    } else {
      max_seqlen_q = spec.seqlen_q;
      max_seqlen_k = spec.seqlen_k;
      total_q = static_cast<int64_t>(batch_) * spec.seqlen_q;
      total_k = static_cast<int64_t>(batch_) * spec.seqlen_k;
    }
    std::mt19937_64 rng(spec.seed);
    std::normal_distribution<float> normal(0.0f, 1.0f);
    auto random_half = [&](int64_t count) {
      std::vector<uint16_t> values(count);
      for (auto& x : values) x = float_to_bits(spec.dtype, normal(rng));
      return values;
    };
    q = random_half(total_q * spec.heads_q * spec.head_dim);
    k = random_half(total_k * spec.heads_kv * spec.head_dim);
    v = random_half(total_k * spec.heads_kv * spec.head_dim);
    out.assign(q.size(), nan_bits(spec.dtype));
    lse.assign(static_cast<size_t>(batch_) * spec.heads_q * max_seqlen_q, std::nanf(""));
    if (spec.alibi != Alibi::kNone) {
      std::uniform_real_distribution<float> slope(0.01f, 0.5f);
      alibi_slopes.resize(spec.alibi == Alibi::kPerHead ? spec.heads_q : batch_ * spec.heads_q);
      for (float& s : alibi_slopes) s = slope(rng);
    }
  }

  const CaseSpec& spec() const { return spec_; }
  int batch() const { return batch_; }

  // Element index of (token, head, c) in the contiguous q/out or k/v buffers (token counts over the
  // whole batch: b * seqlen + i for fixed length, the packed index for varlen).
  int64_t q_index(int64_t token, int head, int c) const {
    return (token * spec_.heads_q + head) * spec_.head_dim + c;
  }
  int64_t k_index(int64_t token, int head, int c) const {
    return (token * spec_.heads_kv + head) * spec_.head_dim + c;
  }

  // The tensor views of the public API over this case's buffers (CPU).
  FwdCommon common_views() {
    const Device cpu{};
    const DType t = spec_.dtype;
    const int64_t hq = spec_.heads_q, hkv = spec_.heads_kv, d = spec_.head_dim;
    FwdCommon c;
    if (spec_.is_varlen()) {
      c.q = make_view(q.data(), t, {total_q, hq, d}, cpu);
      c.k = make_view(k.data(), t, {total_k, hkv, d}, cpu);
      c.v = make_view(v.data(), t, {total_k, hkv, d}, cpu);
      c.out = make_view(out.data(), t, {total_q, hq, d}, cpu);
    } else {
      c.q = make_view(q.data(), t, {batch_, spec_.seqlen_q, hq, d}, cpu);
      c.k = make_view(k.data(), t, {batch_, spec_.seqlen_k, hkv, d}, cpu);
      c.v = make_view(v.data(), t, {batch_, spec_.seqlen_k, hkv, d}, cpu);
      c.out = make_view(out.data(), t, {batch_, spec_.seqlen_q, hq, d}, cpu);
    }
    c.softmax_lse = make_view(lse.data(), DType::kFloat32, {batch_, hq, max_seqlen_q}, cpu);
    if (spec_.alibi == Alibi::kPerHead) {
      c.alibi_slopes = make_view(alibi_slopes.data(), DType::kFloat32, {hq}, cpu);
    } else if (spec_.alibi == Alibi::kPerBatchHead) {
      c.alibi_slopes = make_view(alibi_slopes.data(), DType::kFloat32, {batch_, hq}, cpu);
    }
    c.softmax_scale = spec_.softmax_scale;
    c.softcap = spec_.softcap;
    c.mask = MaskSpec{spec_.causal, spec_.window_left, spec_.window_right};
    return c;
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
    p.cu_seqlens_q = make_view(cu_seqlens_q.data(), DType::kInt32, {batch_ + 1}, cpu);
    p.cu_seqlens_k = make_view(cu_seqlens_k.data(), DType::kInt32, {batch_ + 1}, cpu);
    if (!seqused_k.empty()) {
      p.seqused_k = make_view(seqused_k.data(), DType::kInt32, {batch_}, cpu);
    }
    p.max_seqlen_q = max_seqlen_q;
    p.max_seqlen_k = max_seqlen_k;
    return p;
  }

  // The problem exactly as specified, built without validation: only the softmax scale default and
  // causal (window_right = 0) are applied, so windows reach the reference unresolved.
  FwdProblem problem() {
    FwdProblem p;
    p.dtype = spec_.dtype;
    p.batch = batch_;
    p.heads_q = spec_.heads_q;
    p.heads_kv = spec_.heads_kv;
    p.head_dim = spec_.head_dim;
    p.seqlen_q = max_seqlen_q;
    p.seqlen_k = max_seqlen_k;
    p.q = q.data();
    p.k = k.data();
    p.v = v.data();
    p.out = out.data();
    const int64_t hq = spec_.heads_q, hkv = spec_.heads_kv, d = spec_.head_dim;
    p.q_row_stride = p.out_row_stride = hq * d;
    p.q_head_stride = p.out_head_stride = d;
    p.k_row_stride = p.v_row_stride = hkv * d;
    p.k_head_stride = p.v_head_stride = d;
    if (!spec_.is_varlen()) {
      p.q_batch_stride = p.out_batch_stride = spec_.seqlen_q * hq * d;
      p.k_batch_stride = p.v_batch_stride = spec_.seqlen_k * hkv * d;
    } else {
      p.cu_seqlens_q = cu_seqlens_q.data();
      p.cu_seqlens_k = cu_seqlens_k.data();
      p.seqused_k = seqused_k.empty() ? nullptr : seqused_k.data();
    }
    p.lse = lse.data();
    p.lse_head_stride = max_seqlen_q;
    p.lse_batch_stride = hq * max_seqlen_q;
    if (spec_.alibi != Alibi::kNone) {
      p.alibi_slopes = alibi_slopes.data();
      p.alibi_batch_stride = spec_.alibi == Alibi::kPerBatchHead ? hq : 0;
    }
    p.softmax_scale = spec_.softmax_scale != 0.0f
                          ? spec_.softmax_scale
                          : static_cast<float>(1.0 / std::sqrt(static_cast<double>(d)));
    p.softcap = spec_.softcap;
    p.causal = spec_.causal;
    p.window_left = spec_.window_left;
    p.window_right = spec_.causal ? 0 : spec_.window_right;
    return p;
  }

  std::vector<uint16_t> q, k, v, out;
  std::vector<float> lse, alibi_slopes;
  std::vector<int32_t> cu_seqlens_q, cu_seqlens_k, seqused_k;
  int max_seqlen_q = 0;
  int max_seqlen_k = 0;
  int64_t total_q = 0;
  int64_t total_k = 0;

 private:
  CaseSpec spec_;
  int batch_ = 0;
};

}  // namespace flashkit::test
