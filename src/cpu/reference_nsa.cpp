// src/cpu/reference_nsa.cpp
// \brief The reference of native sparse attention's selection branch (see reference_nsa.h):
// written for clarity, in plain single-threaded loops.
//
// For every (sequence b, query token i, kv head g) the selection is resolved once
// (visible_keys): the slots in use (block_counts clamped to [0, selected], else all), minus the
// entries outside [0, num_key_blocks), sorted and deduplicated, then expanded into the keys of
// those blocks that the causal limit leaves (j <= i + seqlen_k - seqlen_q). The keys come out
// ascending, so a row is summed in the order the dense reference sums it. Then each query head h
// of g's group attends to exactly those keys:
//   s_j   = softmax_scale * q_i . k_j
//   lse_i = log(sum_j exp(s_j))            (natural log; -inf when no key is visible)
//   out_i = sum_j exp(s_j - lse_i) v_j     (0 when no key is visible)
// and the backward, with P_j = exp(s_j - lse_i), dP_j = dout_i . v_j and D_i = dout_i . out_i
// (or sum_j P_j dP_j when recomputed):
//   dS_j = P_j (dP_j - D_i),  dq_i = scale sum_j dS_j k_j,
//   dk_j += scale dS_j q_i,   dv_j += P_j dout_i     (summed over every token and query head
//                                                     that sees key j; 0 for keys nobody sees)
//
// Both passes walk (sequence, token, kv head) in order; the backward adds each token's terms into
// dk / dv accumulators of the whole sequence, key by key for the whole query-head group.
//
// RefPrecision::kInputDtype rounds the intermediates to the input dtype exactly where
// reference_fwd.cpp and reference_bwd.cpp round them (the raw dot q.k, the normalised
// probabilities, the output; in the backward P, dP, dS, dS * scale and the gradients), in fp32, so
// that the error of that mode against kExact sets a kernel's tolerance as it does for the dense
// kernels.
#include "cpu/reference_nsa.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <string>
#include <vector>

#include "cpu/reference_common.h"
#include "flashkit/error.h"

namespace flashkit::cpu {
namespace {

void check_problem(const NsaProblem& p, const char* who) {
  if (p.dtype != DType::kFloat16 && p.dtype != DType::kBFloat16) {
    throw Error(std::string(who) + ": dtype is " + dtype_name(p.dtype) +
                "; supported: float16, bfloat16");
  }
  if (p.heads_kv <= 0 || p.heads_q % p.heads_kv != 0) {
    throw Error(std::string(who) + ": heads_q = " + std::to_string(p.heads_q) +
                " is not a multiple of heads_kv = " + std::to_string(p.heads_kv));
  }
  if (p.block_size <= 0) {
    throw Error(std::string(who) + ": block_size is " + std::to_string(p.block_size) +
                "; it must be positive");
  }
}

// Buffers reused from one (token, kv head) to the next.
template <typename Acc>
struct Buffers {
  std::vector<int> blocks;  // the resolved selection: valid, distinct, ascending
  std::vector<int> keys;    // the keys it leaves visible, ascending
  std::vector<Acc> k, v;    // [keys, head_dim]: the visible keys' rows of the kv head
  // Forward: one query row. Backward: the group's rows, [group, head_dim] (out: one saved row).
  std::vector<Acc> q, dout, out;
  std::vector<Acc> scores;  // forward [keys]: score, then exp(score - max); backward
                            // [group, keys]: score, then P
  std::vector<Acc> dp;      // backward [group, keys]: dP, then dX = scale * dS
  std::vector<Acc> row;     // forward: the output row; backward: the group's dq rows
};

// Resolves the selection of (b, i, g) into buf.blocks and buf.keys (see the file comment).
template <typename Acc>
void visible_keys(const NsaProblem& p, int b, int i, int g, Buffers<Acc>& buf) {
  int count = p.selected;
  if (p.block_counts != nullptr) {
    const int stored = p.block_counts[b * p.bc_batch_stride + i * p.bc_row_stride + g];
    count = std::clamp(stored, 0, p.selected);
  }
  const int* slots =
      p.block_indices + b * p.bi_batch_stride + i * p.bi_row_stride + g * p.bi_head_stride;
  buf.blocks.clear();
  for (int s = 0; s < count; ++s) {
    if (slots[s] >= 0 && slots[s] < p.num_key_blocks) buf.blocks.push_back(slots[s]);
  }
  std::sort(buf.blocks.begin(), buf.blocks.end());
  buf.blocks.erase(std::unique(buf.blocks.begin(), buf.blocks.end()), buf.blocks.end());

  const int64_t last_key = std::min(p.last_visible_key(i), p.seqlen_k - 1);
  buf.keys.clear();
  for (int block : buf.blocks) {
    const int64_t first = int64_t{block} * p.block_size;
    const int64_t end = std::min<int64_t>(first + p.block_size, last_key + 1);
    for (int64_t j = first; j < end; ++j) buf.keys.push_back(static_cast<int>(j));
  }
}

// The head_dim elements of the 16-bit row at `offset` of `base`, as Acc (exact).
template <typename Acc>
void load_row(DType dtype, const void* base, int64_t offset, int head_dim, Acc* dst) {
  for (int c = 0; c < head_dim; ++c) dst[c] = load_half(dtype, base, offset + c);
}

// Rows of kv head g of the visible keys, from k and v, into buf.k and buf.v.
template <typename Acc>
void load_visible_keys(const NsaProblem& p, int b, int g, Buffers<Acc>& buf) {
  const int d = p.head_dim;
  buf.k.resize(buf.keys.size() * d);
  buf.v.resize(buf.keys.size() * d);
  for (size_t n = 0; n < buf.keys.size(); ++n) {
    const int64_t j = buf.keys[n];
    load_row(p.dtype, p.k, b * p.k_batch_stride + j * p.k_row_stride + g * p.k_head_stride, d,
             &buf.k[n * d]);
    load_row(p.dtype, p.v, b * p.v_batch_stride + j * p.v_row_stride + g * p.v_head_stride, d,
             &buf.v[n * d]);
  }
}

// The forward's q . k_n for each of `keys` key rows ([keys, head_dim]): each summed in one running
// sum from the first element on, the order reference_fwd sums in (kInputDtype rounds the result,
// so the order shows in the last bit). Four keys at a time: four independent sums overlap where
// one would wait on every addition.
template <typename Acc>
void dot_with_keys(const Acc* __restrict q, const Acc* __restrict k, size_t keys, int head_dim,
                   Acc* __restrict scores) {
  size_t n = 0;
  for (; n + 4 <= keys; n += 4) {
    const Acc* k0 = k + n * head_dim;
    const Acc* k1 = k0 + head_dim;
    const Acc* k2 = k1 + head_dim;
    const Acc* k3 = k2 + head_dim;
    Acc s0 = 0, s1 = 0, s2 = 0, s3 = 0;
    for (int c = 0; c < head_dim; ++c) {
      s0 += q[c] * k0[c];
      s1 += q[c] * k1[c];
      s2 += q[c] * k2[c];
      s3 += q[c] * k3[c];
    }
    scores[n] = s0;
    scores[n + 1] = s1;
    scores[n + 2] = s2;
    scores[n + 3] = s3;
  }
  for (; n < keys; ++n) {
    Acc sum = 0;
    for (int c = 0; c < head_dim; ++c) sum += q[c] * k[n * head_dim + c];
    scores[n] = sum;
  }
}

// The backward's dot product: four partial sums, as reference_bwd sums (independent chains the CPU
// overlaps, where one running sum waits on every addition; the backward takes two dot products
// per key where the forward takes one).
template <typename Acc>
Acc dot4(const Acc* a, const Acc* b, int n) {
  Acc sum[4] = {0, 0, 0, 0};
  int c = 0;
  for (; c + 4 <= n; c += 4) {
    for (int lane = 0; lane < 4; ++lane) sum[lane] += a[c + lane] * b[c + lane];
  }
  for (; c < n; ++c) sum[0] += a[c] * b[c];
  return (sum[0] + sum[1]) + (sum[2] + sum[3]);
}

// y += a x over n elements. The buffers never overlap; saying so lets the compiler vectorise.
template <typename Acc>
void add_scaled(Acc a, const Acc* __restrict x, Acc* __restrict y, int n) {
  for (int c = 0; c < n; ++c) y[c] += a * x[c];
}

// ------------------------------------------------------------------------------------------------
// Forward
// ------------------------------------------------------------------------------------------------

// Where forward results go: once per query row, with the finished output row (nullptr for a row
// that sees no key) and its lse.
template <typename Acc>
class StridedFwdOutput {  // problem.out in problem.dtype and problem.lse, with their strides
 public:
  explicit StridedFwdOutput(const NsaProblem& p) : p_(p) {}
  void write_row(int b, int h, int i, const Acc* row, double lse) const {
    auto* out = static_cast<uint16_t*>(p_.out) + b * p_.out_batch_stride + i * p_.out_row_stride +
                h * p_.out_head_stride;
    for (int c = 0; c < p_.head_dim; ++c) {
      out[c] = double_to_half_bits(p_.dtype, row != nullptr ? static_cast<double>(row[c]) : 0.0);
    }
    p_.lse[b * p_.lse_batch_stride + h * p_.lse_head_stride + i] = static_cast<float>(lse);
  }

 private:
  const NsaProblem& p_;
};

template <typename Acc>
class Fp32FwdOutput {  // out [batch, heads_q, seqlen_q, head_dim], lse [batch, heads_q, seqlen_q]
 public:
  Fp32FwdOutput(const NsaProblem& p, float* out, float* lse) : p_(p), out_(out), lse_(lse) {}
  void write_row(int b, int h, int i, const Acc* row, double lse) const {
    const int64_t row_index = (int64_t{b} * p_.heads_q + h) * p_.seqlen_q + i;
    float* out = out_ + row_index * p_.head_dim;
    for (int c = 0; c < p_.head_dim; ++c) {
      out[c] = row != nullptr ? static_cast<float>(row[c]) : 0.0f;
    }
    lse_[row_index] = static_cast<float>(lse);
  }

 private:
  const NsaProblem& p_;
  float* out_;
  float* lse_;
};

// Query row i of head h over the visible keys loaded in `buf`.
template <typename Acc, typename Output>
void attend_row(const NsaProblem& p, const Arithmetic<Acc>& math, const Output& output, int b,
                int h, int i, Buffers<Acc>& buf) {
  const int d = p.head_dim;
  const size_t keys = buf.keys.size();
  if (keys == 0) {
    output.write_row(b, h, i, nullptr, -std::numeric_limits<double>::infinity());
    return;
  }
  buf.q.resize(d);
  load_row(p.dtype, p.q, b * p.q_batch_stride + i * p.q_row_stride + h * p.q_head_stride, d,
           buf.q.data());
  buf.scores.resize(keys);
  dot_with_keys(buf.q.data(), buf.k.data(), keys, d, buf.scores.data());
  Acc max_score = -std::numeric_limits<Acc>::infinity();
  for (Acc& score : buf.scores) {
    score = math.round(score) * static_cast<Acc>(p.softmax_scale);
    max_score = std::max(max_score, score);
  }
  Acc sum = 0;
  for (Acc& score : buf.scores) {
    score = std::exp(score - max_score);
    sum += score;
  }
  const double lse = static_cast<double>(max_score + std::log(sum));

  // kExact keeps the probabilities unnormalised and divides the output once; kInputDtype
  // normalises and rounds each probability, then rounds the output (as reference_fwd).
  buf.row.assign(d, Acc(0));
  for (size_t n = 0; n < keys; ++n) {
    const Acc prob = math.round_to_input ? math.round(buf.scores[n] / sum) : buf.scores[n];
    add_scaled(prob, &buf.v[n * d], buf.row.data(), d);
  }
  for (Acc& x : buf.row) x = math.round_to_input ? math.round(x) : x / sum;
  output.write_row(b, h, i, buf.row.data(), lse);
}

template <typename Acc, typename Output>
void run_forward(const NsaProblem& p, const Arithmetic<Acc>& math, const Output& output) {
  check_problem(p, "reference_nsa_fwd");
  const int group = p.heads_q / p.heads_kv;
  Buffers<Acc> buf;
  for (int b = 0; b < p.batch; ++b) {
    for (int i = 0; i < p.seqlen_q; ++i) {
      for (int g = 0; g < p.heads_kv; ++g) {
        visible_keys(p, b, i, g, buf);
        load_visible_keys(p, b, g, buf);
        for (int h = g * group; h < (g + 1) * group; ++h) attend_row(p, math, output, b, h, i, buf);
      }
    }
  }
}

// ------------------------------------------------------------------------------------------------
// Backward
// ------------------------------------------------------------------------------------------------

// Where gradients go: once per dq row and once per (dk, dv) row pair.
template <typename Acc>
class StridedGradients {  // problem.dq / dk / dv in the input dtype, with the problem's strides
 public:
  explicit StridedGradients(const NsaBwdProblem& problem) : g_(problem) {}
  void write_dq_row(int b, int h, int i, const Acc* row) const {
    store(g_.dq, b * g_.dq_batch_stride + i * g_.dq_row_stride + h * g_.dq_head_stride, row);
  }
  void write_dk_dv_row(int b, int g, int j, const Acc* dk, const Acc* dv) const {
    store(g_.dk, b * g_.dk_batch_stride + j * g_.dk_row_stride + g * g_.dk_head_stride, dk);
    store(g_.dv, b * g_.dv_batch_stride + j * g_.dv_row_stride + g * g_.dv_head_stride, dv);
  }

 private:
  void store(void* base, int64_t offset, const Acc* row) const {
    auto* dst = static_cast<uint16_t*>(base) + offset;
    for (int c = 0; c < g_.fwd.head_dim; ++c) {
      dst[c] = double_to_half_bits(g_.fwd.dtype, static_cast<double>(row[c]));
    }
  }
  const NsaBwdProblem& g_;
};

// dq [batch, seqlen_q, heads_q, head_dim], dk / dv [batch, seqlen_k, heads_kv, head_dim], fp32
template <typename Acc>
class Fp32Gradients {
 public:
  Fp32Gradients(const NsaProblem& p, const Arithmetic<Acc>& math, float* dq, float* dk, float* dv)
      : p_(p), math_(math), dq_(dq), dk_(dk), dv_(dv) {}
  void write_dq_row(int b, int h, int i, const Acc* row) const {
    store(dq_ + ((int64_t{b} * p_.seqlen_q + i) * p_.heads_q + h) * p_.head_dim, row);
  }
  void write_dk_dv_row(int b, int g, int j, const Acc* dk, const Acc* dv) const {
    const int64_t offset = ((int64_t{b} * p_.seqlen_k + j) * p_.heads_kv + g) * p_.head_dim;
    store(dk_ + offset, dk);
    store(dv_ + offset, dv);
  }

 private:
  void store(float* dst, const Acc* row) const {
    for (int c = 0; c < p_.head_dim; ++c) dst[c] = static_cast<float>(math_.round(row[c]));
  }
  const NsaProblem& p_;
  Arithmetic<Acc> math_;
  float* dq_;
  float* dk_;
  float* dv_;
};

// The statistics of query row r of the group (head h, token i) over the visible keys loaded in
// `buf`, whose q and dout rows are loaded: fills its P and dX = scale * dS per key
// (buf.scores / buf.dp rows r, [group, keys]).
template <typename Acc>
void row_probabilities(const NsaBwdProblem& problem, const Arithmetic<Acc>& math, bool recompute,
                       int b, int h, int i, int r, Buffers<Acc>& buf) {
  const NsaProblem& p = problem.fwd;
  const int d = p.head_dim;
  const size_t keys = buf.keys.size();
  const Acc* q = &buf.q[r * d];
  const Acc* dout = &buf.dout[r * d];
  Acc* probs = &buf.scores[r * keys];  // scores, then P
  Acc* dx = &buf.dp[r * keys];         // dP, then dX
  const Acc scale = static_cast<Acc>(p.softmax_scale);
  for (size_t n = 0; n < keys; ++n) {
    probs[n] = math.round(dot4(q, &buf.k[n * d], d)) * scale;
    dx[n] = math.round(dot4(dout, &buf.v[n * d], d));
  }

  // lse and D_i, saved by the forward or recomputed from q, k and v.
  Acc lse, d_row = 0;
  if (recompute) {
    Acc max_score = -std::numeric_limits<Acc>::infinity();
    for (size_t n = 0; n < keys; ++n) max_score = std::max(max_score, probs[n]);
    Acc sum = 0;
    for (size_t n = 0; n < keys; ++n) sum += std::exp(probs[n] - max_score);
    lse = max_score + std::log(sum);
    for (size_t n = 0; n < keys; ++n) d_row += math.round(std::exp(probs[n] - lse)) * dx[n];
  } else {
    lse = p.lse[b * p.lse_batch_stride + h * p.lse_head_stride + i];
    buf.out.resize(d);
    load_row(p.dtype, p.out, b * p.out_batch_stride + i * p.out_row_stride + h * p.out_head_stride,
             d, buf.out.data());
    d_row = dot4(dout, buf.out.data(), d);
  }

  for (size_t n = 0; n < keys; ++n) {
    probs[n] = math.round(std::exp(probs[n] - lse));
    dx[n] = math.round(math.round(probs[n] * (dx[n] - d_row)) * scale);
  }
}

// The gradients of token i's query heads in kv head g's group over the visible keys loaded in
// `buf`: writes their dq rows and adds their terms to the sequence's dk / dv accumulators
// ([seqlen_k, heads_kv, head_dim]). Keys outer, heads inner: each key's dk / dv row takes the whole
// group's terms while it is in cache (the accumulators of a long sequence are not).
template <typename Acc, typename Output>
void backward_token(const NsaBwdProblem& problem, const Arithmetic<Acc>& math, bool recompute,
                    const Output& output, int b, int i, int g, Buffers<Acc>& buf,
                    std::vector<Acc>& dk_acc, std::vector<Acc>& dv_acc) {
  const NsaProblem& p = problem.fwd;
  const int d = p.head_dim;
  const int group = p.heads_q / p.heads_kv;
  const size_t keys = buf.keys.size();
  buf.row.assign(static_cast<size_t>(group) * d, Acc(0));  // the group's dq rows
  if (keys > 0) {  // with no key: no score, dq_i = 0, and the lse (-inf) is never read
    buf.q.resize(static_cast<size_t>(group) * d);
    buf.dout.resize(static_cast<size_t>(group) * d);
    buf.scores.resize(group * keys);
    buf.dp.resize(group * keys);
    for (int r = 0; r < group; ++r) {
      const int h = g * group + r;
      load_row(p.dtype, p.q, b * p.q_batch_stride + i * p.q_row_stride + h * p.q_head_stride, d,
               &buf.q[r * d]);
      load_row(p.dtype, problem.dout,
               b * problem.dout_batch_stride + i * problem.dout_row_stride +
                   h * problem.dout_head_stride,
               d, &buf.dout[r * d]);
      row_probabilities(problem, math, recompute, b, h, i, r, buf);
    }
    for (size_t n = 0; n < keys; ++n) {
      const int64_t key_row = (int64_t{buf.keys[n]} * p.heads_kv + g) * d;
      for (int r = 0; r < group; ++r) {
        const Acc prob = buf.scores[r * keys + n];
        const Acc dx = buf.dp[r * keys + n];
        add_scaled(dx, &buf.k[n * d], &buf.row[r * d], d);           // dq_i += dX_j k_j
        add_scaled(dx, &buf.q[r * d], &dk_acc[key_row], d);          // dk_j += dX_j q_i
        add_scaled(prob, &buf.dout[r * d], &dv_acc[key_row], d);     // dv_j += P_j dout_i
      }
    }
  }
  for (int r = 0; r < group; ++r) output.write_dq_row(b, g * group + r, i, &buf.row[r * d]);
}

template <typename Acc, typename Output>
void run_backward(const NsaBwdProblem& problem, const Arithmetic<Acc>& math, bool recompute,
                  const Output& output) {
  const NsaProblem& p = problem.fwd;
  check_problem(p, "reference_nsa_bwd");
  const int d = p.head_dim;
  Buffers<Acc> buf;
  // One sequence's dk / dv, [seqlen_k, heads_kv, head_dim]: every (token, query head) that sees a
  // key adds its term; keys nobody sees keep their zeros.
  std::vector<Acc> dk_acc, dv_acc;
  for (int b = 0; b < p.batch; ++b) {
    dk_acc.assign(static_cast<size_t>(p.seqlen_k) * p.heads_kv * d, Acc(0));
    dv_acc.assign(dk_acc.size(), Acc(0));
    for (int i = 0; i < p.seqlen_q; ++i) {
      for (int g = 0; g < p.heads_kv; ++g) {
        visible_keys(p, b, i, g, buf);
        load_visible_keys(p, b, g, buf);
        backward_token(problem, math, recompute, output, b, i, g, buf, dk_acc, dv_acc);
      }
    }
    for (int j = 0; j < p.seqlen_k; ++j) {
      for (int g = 0; g < p.heads_kv; ++g) {
        const size_t offset = (static_cast<size_t>(j) * p.heads_kv + g) * d;
        output.write_dk_dv_row(b, g, j, &dk_acc[offset], &dv_acc[offset]);
      }
    }
  }
}

}  // namespace

void reference_nsa_fwd(const NsaProblem& problem) {
  run_forward(problem, Arithmetic<double>{problem.dtype, false}, StridedFwdOutput<double>(problem));
}

void reference_nsa_fwd_fp32(const NsaProblem& problem, RefPrecision precision, float* out,
                            float* lse) {
  if (precision == RefPrecision::kExact) {
    run_forward(problem, Arithmetic<double>{problem.dtype, false},
                Fp32FwdOutput<double>(problem, out, lse));
  } else {
    run_forward(problem, Arithmetic<float>{problem.dtype, true},
                Fp32FwdOutput<float>(problem, out, lse));
  }
}

void reference_nsa_bwd(const NsaBwdProblem& problem) {
  run_backward(problem, Arithmetic<double>{problem.fwd.dtype, false}, false,
               StridedGradients<double>(problem));
}

void reference_nsa_bwd_fp32(const NsaBwdProblem& problem, RefPrecision precision, bool recompute,
                            float* dq, float* dk, float* dv) {
  const NsaProblem& p = problem.fwd;
  if (precision == RefPrecision::kExact) {
    const Arithmetic<double> math{p.dtype, false};
    run_backward(problem, math, recompute, Fp32Gradients<double>(p, math, dq, dk, dv));
  } else {
    const Arithmetic<float> math{p.dtype, true};
    run_backward(problem, math, recompute, Fp32Gradients<float>(p, math, dq, dk, dv));
  }
}

}  // namespace flashkit::cpu
