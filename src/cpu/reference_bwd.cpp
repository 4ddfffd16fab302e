// src/cpu/reference_bwd.cpp
// \brief The reference backward pass (see reference_bwd.h): the gradients of reference_fwd.cpp's
// attention, written for clarity first and for speed second.
//
// For one (batch b, query head h) with kv head g = h / (heads_q / heads_kv), and a pair (i, j) that
// the mask allows (reference_fwd.cpp states the mask and the score), with x = q_i . k_j:
//   a_ij  = softmax_scale * x                     the scaled score
//   c_ij  = softcap * tanh(a_ij / softcap)        (c = a without softcap)
//   s_ij  = c_ij - slope(b, h) * |i + len_k - len_q - j|
//   P_ij  = exp(s_ij - lse_i)                      recomputed from the saved lse, as the kernels do
//   m_ij  = keep_ij / (1 - p)                      dropout's factor (1 without dropout); keep_ij is
//                                                  the forward's Philox mask, regenerated
//   dP_ij = m_ij dout_i . v_j                      gradient w.r.t. the undropped P_ij
//   D_i   = dout_i . out_i                         (= sum_j P_ij dP_ij)
//   dS_ij = P_ij (dP_ij - D_i)                     gradient of the loss w.r.t. s_ij
//   dX_ij = dS_ij * softmax_scale * (1 - tanh^2(a_ij / softcap))   (no softcap: * softmax_scale)
//   dq_i  = sum_j dX_ij k_j,   dk_j = sum_{h in g's group, i} dX_ij q_i,
//   dv_j  = sum_{h, i} m_ij P_ij dout_i
// ALiBi's bias does not depend on q or k, so it changes P but adds no term. Pairs outside the mask
// contribute nothing: a row that sees no key has dq_i = 0, a key no row sees dk_j = dv_j = 0, and
// neither ever reads its lse (-inf for such a row), so no NaN can arise.
//
// Three kinds of task, each writing its own rows only (no reduction across threads, so the result
// does not depend on the thread count):
//   statistics  (b, h, rows)   lse_i and D_i of a block of rows, kept for the two others
//   dq          (b, h, rows)   a block of dq rows: each row against every key it sees
//   dk / dv     (b, g, keys)   a block of dk / dv rows: each key against every row of every query
//                              head of the group that sees it (the GQA / MQA sum happens here)
// The score of each allowed pair is thus computed twice (once for dq, once for dk / dv), which
// keeps every task independent.
#include "cpu/reference_bwd.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <limits>
#include <string>
#include <vector>

#include "cpu/reference_common.h"
#include "flashkit/error.h"

namespace flashkit::cpu {
namespace {

constexpr int kRowsPerTask = 64;
constexpr int kKeysPerTask = 64;

// Loads `count` rows of one head of a 16-bit tensor (rows `first`, `first + 1`, ...) as Acc,
// into `dst` ([count, head_dim]).
template <typename Acc>
void load_rows(DType dtype, const void* base, int64_t first_row_offset, int64_t row_stride,
               int64_t count, int head_dim, std::vector<Acc>& dst) {
  dst.resize(static_cast<size_t>(count) * head_dim);
  for (int64_t r = 0; r < count; ++r) {
    const int64_t offset = first_row_offset + r * row_stride;
    for (int c = 0; c < head_dim; ++c) dst[r * head_dim + c] = load_half(dtype, base, offset + c);
  }
}

// Four partial sums (head_dim is a multiple of 8): independent chains the CPU overlaps and the
// compiler vectorises, where one running sum would wait on every addition.
template <typename Acc>
Acc dot(const Acc* a, const Acc* b, int n) {
  Acc sum[4] = {0, 0, 0, 0};
  for (int c = 0; c < n; c += 4) {
    for (int lane = 0; lane < 4; ++lane) sum[lane] += a[c + lane] * b[c + lane];
  }
  return (sum[0] + sum[1]) + (sum[2] + sum[3]);
}

// The score model of one (batch, query head, sequence): s_ij and d s_ij / d x_ij.
template <typename Acc>
struct Scores {
  const Arithmetic<Acc>& math;
  Acc scale;
  Acc softcap;
  Acc slope;
  int64_t shift;  // len_k - len_q: the bottom-right alignment
  bool dropout;
  DropoutMask mask;
  uint32_t bh;     // b * heads_q + h: the mask's head index
  Acc keep_scale;  // 1 / (1 - p)

  // m_ij of keys [first, end) of row i, in `factors` (all 1 without dropout).
  void dropout_factors(int64_t i, int64_t first, int64_t end, std::vector<uint8_t>& keep,
                       std::vector<Acc>& factors) const {
    factors.assign(static_cast<size_t>(std::max<int64_t>(0, end - first)), Acc(1));
    if (!dropout) return;
    dropout_keep_row(mask, bh, i, first, end, keep);
    for (size_t n = 0; n < factors.size(); ++n) factors[n] = keep[n] ? keep_scale : Acc(0);
  }

  // `x` is the raw dot product q_i . k_j; returns s_ij, and dX/dS in `ds_dx`.
  Acc score(Acc x, int64_t i, int64_t j, Acc& ds_dx) const {
    Acc s = math.round(x) * scale;
    ds_dx = scale;
    if (softcap > 0) {
      const Acc t = std::tanh(s / softcap);
      s = softcap * t;
      ds_dx = scale * (Acc(1) - t * t);
    }
    if (slope != 0) s -= slope * static_cast<Acc>(std::abs(i + shift - j));
    return s;
  }
};

// Everything the three kinds of task share for one problem.
template <typename Acc>
struct Context {
  const BwdProblem& problem;
  const FwdProblem& p;  // problem.fwd
  Arithmetic<Acc> math;
  BwdStatistics statistics;
  std::vector<Sequence> sequences;
  // lse_i and D_i per (b, h, i), laid out [batch, heads_q, seqlen_q].
  std::vector<Acc> lse;
  std::vector<Acc> d_rows;

  int group() const { return p.heads_q / p.heads_kv; }
  size_t stat_index(int b, int h, int64_t i) const {
    return (static_cast<size_t>(b) * p.heads_q + h) * p.seqlen_q + i;
  }
  Scores<Acc> scores(int b, int h, const Sequence& s) const {
    const Acc slope =
        p.alibi_slopes != nullptr ? p.alibi_slopes[b * p.alibi_batch_stride + h] : Acc(0);
    return {math,
            static_cast<Acc>(p.softmax_scale),
            static_cast<Acc>(p.softcap),
            slope,
            static_cast<int64_t>(s.len_k) - s.len_q,
            p.dropout_p > 0.0f,
            p.dropout_mask(),
            static_cast<uint32_t>(b * p.heads_q + h),
            static_cast<Acc>(1.0 / (1.0 - static_cast<double>(p.dropout_p)))};
  }
  int64_t q_offset(int b, int h, const Sequence& s, int64_t i) const {
    return b * p.q_batch_stride + (s.q_token + i) * p.q_row_stride + h * p.q_head_stride;
  }
  int64_t dout_offset(int b, int h, const Sequence& s, int64_t i) const {
    return b * problem.dout_batch_stride + (s.q_token + i) * problem.dout_row_stride +
           h * problem.dout_head_stride;
  }
  int64_t k_offset(int b, int g, const Sequence& s, int64_t j) const {
    return b * p.k_batch_stride + (s.k_token + j) * p.k_row_stride + g * p.k_head_stride;
  }
  int64_t v_offset(int b, int g, const Sequence& s, int64_t j) const {
    return b * p.v_batch_stride + (s.k_token + j) * p.v_row_stride + g * p.v_head_stride;
  }
};

// Per-thread buffers, reused across tasks.
template <typename Acc>
struct Buffers {
  std::vector<Acc> q, dout, out, k, v;  // [rows or keys, head_dim]
  std::vector<Acc> factors;             // one row's dropout factors m_ij
  std::vector<Acc> acc_a, acc_b;        // gradient rows being accumulated
  std::vector<uint8_t> keep;            // one row's dropout decisions
};

// Query rows [row_begin, row_end) of (b, h), or keys [row_begin, row_end) of (b, kv head h).
struct Task {
  enum Kind { kStatistics, kDq, kDkDv } kind;
  int b;
  int h;
  int row_begin;
  int row_end;
};

// lse_i and D_i of the task's rows.
template <typename Acc>
void run_statistics(Context<Acc>& ctx, const Task& task, Buffers<Acc>& buf) {
  const FwdProblem& p = ctx.p;
  const Sequence& s = ctx.sequences[task.b];
  const int d = p.head_dim, b = task.b, h = task.h;
  const int64_t rows = task.row_end - task.row_begin;
  load_rows(p.dtype, ctx.problem.dout, ctx.dout_offset(b, h, s, task.row_begin),
            ctx.problem.dout_row_stride, rows, d, buf.dout);
  if (ctx.statistics == BwdStatistics::kFromForward) {
    const int64_t out_first = b * p.out_batch_stride +
                              (s.q_token + task.row_begin) * p.out_row_stride +
                              h * p.out_head_stride;
    load_rows(p.dtype, p.out, out_first, p.out_row_stride, rows, d, buf.out);
    for (int64_t r = 0; r < rows; ++r) {
      const int64_t i = task.row_begin + r;
      ctx.lse[ctx.stat_index(b, h, i)] = p.lse[b * p.lse_batch_stride + h * p.lse_head_stride + i];
      ctx.d_rows[ctx.stat_index(b, h, i)] = dot(&buf.dout[r * d], &buf.out[r * d], d);
    }
    return;
  }
  // kRecompute: a softmax over each row's keys, then D_i = sum_j P_ij dP_ij.
  const int g = h / ctx.group();
  load_rows(p.dtype, p.q, ctx.q_offset(b, h, s, task.row_begin), p.q_row_stride, rows, d, buf.q);
  load_rows(p.dtype, p.k, ctx.k_offset(b, g, s, 0), p.k_row_stride, s.len_k, d, buf.k);
  load_rows(p.dtype, p.v, ctx.v_offset(b, g, s, 0), p.v_row_stride, s.len_k, d, buf.v);
  const Scores<Acc> scores = ctx.scores(b, h, s);
  std::vector<Acc>& row_scores = buf.acc_a;
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t i = task.row_begin + r;
    const KeyRange range = allowed_keys(p, s, i);
    if (range.empty()) {
      ctx.lse[ctx.stat_index(b, h, i)] = -std::numeric_limits<Acc>::infinity();
      ctx.d_rows[ctx.stat_index(b, h, i)] = 0;
      continue;
    }
    row_scores.resize(range.end - range.first);
    Acc max_score = -std::numeric_limits<Acc>::infinity();
    for (int64_t j = range.first; j < range.end; ++j) {
      Acc unused;
      const Acc score = scores.score(dot(&buf.q[r * d], &buf.k[j * d], d), i, j, unused);
      row_scores[j - range.first] = score;
      max_score = std::max(max_score, score);
    }
    Acc sum = 0;
    for (Acc score : row_scores) sum += std::exp(score - max_score);
    const Acc lse = max_score + std::log(sum);
    scores.dropout_factors(i, range.first, range.end, buf.keep, buf.factors);
    Acc d_row = 0;
    for (int64_t j = range.first; j < range.end; ++j) {
      const Acc prob = ctx.math.round(std::exp(row_scores[j - range.first] - lse));
      d_row += prob * ctx.math.round(buf.factors[j - range.first] *
                                     dot(&buf.dout[r * d], &buf.v[j * d], d));
    }
    ctx.lse[ctx.stat_index(b, h, i)] = lse;
    ctx.d_rows[ctx.stat_index(b, h, i)] = d_row;
  }
}

// P_ij and dX_ij (the gradient w.r.t. the raw dot q_i . k_j) of one allowed pair whose dropout
// factor is m_ij = `factor`; q_row and dout_row belong to row i, k_row and v_row to key j.
template <typename Acc>
void pair_gradient(const Context<Acc>& ctx, const Scores<Acc>& scores, int b, int h, int64_t i,
                   int64_t j, const Acc* q_row, const Acc* dout_row, const Acc* k_row,
                   const Acc* v_row, Acc factor, Acc& prob, Acc& dx) {
  const int d = ctx.p.head_dim;
  const Arithmetic<Acc>& math = ctx.math;
  Acc ds_dx;
  const Acc score = scores.score(dot(q_row, k_row, d), i, j, ds_dx);
  prob = math.round(std::exp(score - ctx.lse[ctx.stat_index(b, h, i)]));
  const Acc dp = math.round(factor * dot(dout_row, v_row, d));
  dx = math.round(math.round(prob * (dp - ctx.d_rows[ctx.stat_index(b, h, i)])) * ds_dx);
}

// dq rows of the task: dq_i = sum_j dX_ij k_j over the keys row i sees.
template <typename Acc, typename Output>
void run_dq(const Context<Acc>& ctx, const Output& output, const Task& task, Buffers<Acc>& buf) {
  const FwdProblem& p = ctx.p;
  const Sequence& s = ctx.sequences[task.b];
  const int d = p.head_dim, b = task.b, h = task.h, g = h / ctx.group();
  const int64_t rows = task.row_end - task.row_begin;
  load_rows(p.dtype, p.q, ctx.q_offset(b, h, s, task.row_begin), p.q_row_stride, rows, d, buf.q);
  load_rows(p.dtype, ctx.problem.dout, ctx.dout_offset(b, h, s, task.row_begin),
            ctx.problem.dout_row_stride, rows, d, buf.dout);
  load_rows(p.dtype, p.k, ctx.k_offset(b, g, s, 0), p.k_row_stride, s.len_k, d, buf.k);
  load_rows(p.dtype, p.v, ctx.v_offset(b, g, s, 0), p.v_row_stride, s.len_k, d, buf.v);
  const Scores<Acc> scores = ctx.scores(b, h, s);
  std::vector<Acc>& dq = buf.acc_a;
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t i = task.row_begin + r;
    dq.assign(d, Acc(0));
    const KeyRange range = allowed_keys(p, s, i);
    scores.dropout_factors(i, range.first, range.end, buf.keep, buf.factors);
    for (int64_t j = range.first; j < range.end; ++j) {
      Acc prob, dx;
      pair_gradient(ctx, scores, b, h, i, j, &buf.q[r * d], &buf.dout[r * d], &buf.k[j * d],
                    &buf.v[j * d], buf.factors[j - range.first], prob, dx);
      const Acc* k_row = &buf.k[j * d];
      for (int c = 0; c < d; ++c) dq[c] += dx * k_row[c];
    }
    output.write_dq_row(b, h, s, i, dq.data());
  }
}

// dk / dv rows of the task's keys (kv head task.h), summed over the query heads of the group. Keys
// past the used length (seqused_k) are in no row's range and get zero rows.
template <typename Acc, typename Output>
void run_dk_dv(const Context<Acc>& ctx, const Output& output, const Task& task, Buffers<Acc>& buf) {
  const FwdProblem& p = ctx.p;
  const Sequence& s = ctx.sequences[task.b];
  const int d = p.head_dim, b = task.b, g = task.h;
  const int64_t key_begin = task.row_begin, keys = task.row_end - task.row_begin;
  const int64_t used_keys = std::clamp<int64_t>(s.len_k - key_begin, 0, keys);
  load_rows(p.dtype, p.k, ctx.k_offset(b, g, s, key_begin), p.k_row_stride, used_keys, d, buf.k);
  load_rows(p.dtype, p.v, ctx.v_offset(b, g, s, key_begin), p.v_row_stride, used_keys, d, buf.v);
  std::vector<Acc>& dk = buf.acc_a;
  std::vector<Acc>& dv = buf.acc_b;
  dk.assign(static_cast<size_t>(keys) * d, Acc(0));
  dv.assign(static_cast<size_t>(keys) * d, Acc(0));
  for (int h = g * ctx.group(); h < (g + 1) * ctx.group(); ++h) {
    const Scores<Acc> scores = ctx.scores(b, h, s);
    for (int64_t i = 0; i < s.len_q; ++i) {
      const KeyRange range = allowed_keys(p, s, i);
      const int64_t first = std::max(range.first, key_begin);
      const int64_t end = std::min(range.end, key_begin + used_keys);
      if (first >= end) continue;
      load_rows(p.dtype, p.q, ctx.q_offset(b, h, s, i), 0, 1, d, buf.q);
      load_rows(p.dtype, ctx.problem.dout, ctx.dout_offset(b, h, s, i), 0, 1, d, buf.dout);
      scores.dropout_factors(i, first, end, buf.keep, buf.factors);
      for (int64_t j = first; j < end; ++j) {
        const int64_t r = j - key_begin;
        const Acc factor = buf.factors[j - first];
        Acc prob, dx;
        pair_gradient(ctx, scores, b, h, i, j, buf.q.data(), buf.dout.data(), &buf.k[r * d],
                      &buf.v[r * d], factor, prob, dx);
        const Acc dropped_prob = ctx.math.round(factor * prob);
        for (int c = 0; c < d; ++c) {
          dk[r * d + c] += dx * buf.q[c];
          dv[r * d + c] += dropped_prob * buf.dout[c];
        }
      }
    }
  }
  for (int64_t r = 0; r < keys; ++r) {
    output.write_dk_dv_row(b, g, s, key_begin + r, &dk[r * d], &dv[r * d]);
  }
}

// Where gradients go: called once per dq row and once per (dk, dv) row pair.
template <typename Acc>
class StridedGradients {  // problem.dq / dk / dv in the input dtype, with the problem's strides
 public:
  explicit StridedGradients(const BwdProblem& problem) : b_(problem) {}
  void write_dq_row(int b, int h, const Sequence& s, int64_t i, const Acc* row) const {
    store(b_.dq,
          b * b_.dq_batch_stride + (s.q_token + i) * b_.dq_row_stride + h * b_.dq_head_stride, row);
  }
  void write_dk_dv_row(int b, int g, const Sequence& s, int64_t j, const Acc* dk,
                       const Acc* dv) const {
    store(b_.dk,
          b * b_.dk_batch_stride + (s.k_token + j) * b_.dk_row_stride + g * b_.dk_head_stride, dk);
    store(b_.dv,
          b * b_.dv_batch_stride + (s.k_token + j) * b_.dv_row_stride + g * b_.dv_head_stride, dv);
  }

 private:
  void store(void* base, int64_t offset, const Acc* row) const {
    auto* dst = static_cast<uint16_t*>(base) + offset;
    for (int c = 0; c < b_.fwd.head_dim; ++c) {
      dst[c] = double_to_half_bits(b_.fwd.dtype, static_cast<double>(row[c]));
    }
  }
  const BwdProblem& b_;
};

template <typename Acc>
class ContiguousFp32Gradients {  // [total_q, heads_q, head_dim] and [total_k, heads_kv, head_dim]
 public:
  ContiguousFp32Gradients(const FwdProblem& p, const Arithmetic<Acc>& math, float* dq, float* dk,
                          float* dv)
      : p_(p), math_(math), dq_(dq), dk_(dk), dv_(dv) {}
  void write_dq_row(int b, int h, const Sequence& s, int64_t i, const Acc* row) const {
    const int64_t token = p_.is_varlen() ? s.q_token + i : int64_t{b} * p_.seqlen_q + i;
    store(dq_ + (token * p_.heads_q + h) * p_.head_dim, row);
  }
  void write_dk_dv_row(int b, int g, const Sequence& s, int64_t j, const Acc* dk,
                       const Acc* dv) const {
    const int64_t token = p_.is_varlen() ? s.k_token + j : int64_t{b} * p_.seqlen_k + j;
    const int64_t offset = (token * p_.heads_kv + g) * p_.head_dim;
    store(dk_ + offset, dk);
    store(dv_ + offset, dv);
  }

 private:
  void store(float* dst, const Acc* row) const {
    for (int c = 0; c < p_.head_dim; ++c) dst[c] = static_cast<float>(math_.round(row[c]));
  }
  const FwdProblem& p_;
  Arithmetic<Acc> math_;
  float* dq_;
  float* dk_;
  float* dv_;
};

void check_problem(const BwdProblem& problem) {
  const FwdProblem& p = problem.fwd;
  if (p.dtype != DType::kFloat16 && p.dtype != DType::kBFloat16) {
    throw Error(std::string("reference_bwd: dtype is ") + dtype_name(p.dtype) +
                "; supported: float16, bfloat16");
  }
  if (p.heads_kv <= 0 || p.heads_q % p.heads_kv != 0) {
    throw Error("reference_bwd: heads_q = " + std::to_string(p.heads_q) +
                " is not a multiple of heads_kv = " + std::to_string(p.heads_kv));
  }
  if (!(p.dropout_p >= 0.0f && p.dropout_p < 1.0f)) {
    throw Error("reference_bwd: dropout_p is " + std::to_string(p.dropout_p) +
                "; it must be in [0, 1)");
  }
}

// The statistics tasks first (the two others read them), then the dq and dk / dv tasks together.
template <typename Acc, typename Output>
void run_reference(const BwdProblem& problem, const Arithmetic<Acc>& math, BwdStatistics statistics,
                   const Output& output) {
  check_problem(problem);
  const FwdProblem& p = problem.fwd;
  Context<Acc> ctx{problem, p, math, statistics, sequences_of(p, "reference_bwd"), {}, {}};
  const size_t stat_rows = static_cast<size_t>(p.batch) * p.heads_q * p.seqlen_q;
  ctx.lse.assign(stat_rows, Acc(0));
  ctx.d_rows.assign(stat_rows, Acc(0));

  std::vector<Task> statistics_tasks, gradient_tasks;
  double work = 0;
  for (int b = 0; b < p.batch; ++b) {
    const Sequence& s = ctx.sequences[b];
    work += static_cast<double>(s.len_q) * s.len_k * p.heads_q * p.head_dim;
    for (int h = 0; h < p.heads_q; ++h) {
      for (int row = 0; row < s.len_q; row += kRowsPerTask) {
        const int end = std::min(s.len_q, row + kRowsPerTask);
        statistics_tasks.push_back({Task::kStatistics, b, h, row, end});
        gradient_tasks.push_back({Task::kDq, b, h, row, end});
      }
    }
    for (int g = 0; g < p.heads_kv; ++g) {
      for (int key = 0; key < s.stored_len_k; key += kKeysPerTask) {
        gradient_tasks.push_back(
            {Task::kDkDv, b, g, key, std::min(s.stored_len_k, key + kKeysPerTask)});
      }
    }
  }
  const double statistics_work = statistics == BwdStatistics::kRecompute ? 2 * work : 0;
  run_tasks<Buffers<Acc>>(
      static_cast<int>(statistics_tasks.size()), statistics_work,
      [&](Buffers<Acc>& buf, int n) { run_statistics(ctx, statistics_tasks[n], buf); });
  run_tasks<Buffers<Acc>>(static_cast<int>(gradient_tasks.size()), 6 * work,
                          [&](Buffers<Acc>& buf, int n) {
                            const Task& task = gradient_tasks[n];
                            if (task.kind == Task::kDq) {
                              run_dq(ctx, output, task, buf);
                            } else {
                              run_dk_dv(ctx, output, task, buf);
                            }
                          });
}

}  // namespace

void reference_bwd(const BwdProblem& problem) {
  run_reference(problem, Arithmetic<double>{problem.fwd.dtype, false}, BwdStatistics::kFromForward,
                StridedGradients<double>(problem));
}

void reference_bwd_fp32(const BwdProblem& problem, RefPrecision precision, BwdStatistics statistics,
                        float* dq, float* dk, float* dv) {
  const FwdProblem& p = problem.fwd;
  if (precision == RefPrecision::kExact) {
    const Arithmetic<double> math{p.dtype, false};
    run_reference(problem, math, statistics, ContiguousFp32Gradients<double>(p, math, dq, dk, dv));
  } else {
    const Arithmetic<float> math{p.dtype, true};
    run_reference(problem, math, statistics, ContiguousFp32Gradients<float>(p, math, dq, dk, dv));
  }
}

}  // namespace flashkit::cpu
