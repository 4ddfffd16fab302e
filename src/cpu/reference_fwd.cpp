// src/cpu/reference_fwd.cpp
// \brief The reference forward pass (see reference_fwd.h): exact semantics, written for clarity
// first and for speed second (GPU tests run it at sequence lengths of several thousand).
//
// For batch b and query head h (kv head h / (heads_q / heads_kv)), row i of a sequence with len_q
// queries and len_k keys attends to key j iff
//   j < len_k, j >= i + len_k - len_q - window_left (window_left >= 0),
//   j <= i + len_k - len_q + window_right (window_right >= 0),
// always one contiguous range of keys. Its score is
//   s = softmax_scale * q_i . k_j,  then softcap * tanh(s / softcap) when softcap > 0,
//   then - slope(b, h) * |i + len_k - len_q - j| with ALiBi,
// out_i = sum_j softmax(s)_j v_j and lse_i = log(sum_j exp(s_j)) (natural log). A row with no key
// gets out_i = 0 and lse_i = -inf, never NaN.
//
// Dropout (p > 0): out_i = sum_j softmax(s)_j keep_ij / (1 - p) v_j with keep_ij the Philox mask of
// common/philox.h, addressed by (b * heads_q + h, i, j) within the sequence; lse_i stays that of
// the undropped scores. The CPU backend also writes attn_probs (return_softmax) when asked: the
// undropped probabilities, negated where dropped, +0 elsewhere.
//
// Work is split into tasks of up to kRowsPerTask query rows of one (batch, query head), so that
// even a single head spreads over every core. A task converts its kv head's keys (transposed) and
// values to float once (a small cost next to kRowsPerTask rows of work); its rows then go in blocks
// of kRowBlock so that each key and value loaded feeds several rows, and the inner loops run over
// contiguous memory (keys for Q.K^T, head_dim for P.V), which the compiler vectorises.
#include "cpu/reference_fwd.h"

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

constexpr int kRowBlock = 4;  // the two products in attend_rows are unrolled for 4 rows
constexpr int kRowsPerTask = 128;

// Element offset of row i of (b, h) in attn_probs.
int64_t attn_probs_index(const FwdProblem& p, int b, int h, int64_t i) {
  return b * p.attn_probs_batch_stride + h * p.attn_probs_head_stride + i * p.attn_probs_row_stride;
}

// Per-thread buffers, grown on demand and reused across tasks.
template <typename Acc>
struct Workspace {
  std::vector<float> k_transposed;  // [head_dim, len_k]
  std::vector<float> v;             // [len_k, head_dim]
  std::vector<Acc> q_block;         // [kRowBlock, head_dim]
  std::vector<Acc> scores;          // [kRowBlock, block keys]; then the probabilities
  std::vector<Acc> out_block;       // [kRowBlock, head_dim]
  std::vector<uint8_t> keep;        // one row's dropout decisions
};

// Where results go: called once per query row with the finished output row (nullptr for a row that
// sees no key) and its lse.
template <typename Acc>
class StridedOutput {  // problem.out in problem.dtype, problem.lse, both with the problem's strides
 public:
  explicit StridedOutput(const FwdProblem& p) : p_(p) {}
  void write_row(int b, int h, const Sequence& s, int i, const Acc* row, double lse) const {
    auto* out = static_cast<uint16_t*>(p_.out) + b * p_.out_batch_stride +
                (s.q_token + i) * p_.out_row_stride + h * p_.out_head_stride;
    for (int c = 0; c < p_.head_dim; ++c) {
      out[c] = double_to_half_bits(p_.dtype, row != nullptr ? static_cast<double>(row[c]) : 0.0);
    }
    p_.lse[b * p_.lse_batch_stride + h * p_.lse_head_stride + i] = static_cast<float>(lse);
  }
  bool wants_probs() const { return p_.attn_probs != nullptr; }
  // Probability `prob` of (row i, key j) of (b, h), negated when dropped.
  void write_prob(int b, int h, int i, int64_t j, double prob, bool kept) const {
    static_cast<uint16_t*>(p_.attn_probs)[attn_probs_index(p_, b, h, i) + j] =
        double_to_half_bits(p_.dtype, kept ? prob : -prob);
  }

 private:
  const FwdProblem& p_;
};

template <typename Acc>
class ContiguousFp32Output {  // [batch, heads_q, seqlen_q, head_dim] and [batch, heads_q, seqlen_q]
 public:
  ContiguousFp32Output(const FwdProblem& p, float* out, float* lse) : p_(p), out_(out), lse_(lse) {}
  void write_row(int b, int h, const Sequence&, int i, const Acc* row, double lse) const {
    const int64_t row_index = (static_cast<int64_t>(b) * p_.heads_q + h) * p_.seqlen_q + i;
    float* out = out_ + row_index * p_.head_dim;
    for (int c = 0; c < p_.head_dim; ++c) {
      out[c] = row != nullptr ? static_cast<float>(row[c]) : 0.0f;
    }
    lse_[row_index] = static_cast<float>(lse);
  }
  bool wants_probs() const { return false; }
  void write_prob(int, int, int, int64_t, double, bool) const {}

 private:
  const FwdProblem& p_;
  float* out_;
  float* lse_;
};

// Query rows [row_begin, row_end) of batch b, query head h.
struct Task {
  int b;
  int h;
  int row_begin;
  int row_end;
};

// Computes one task.
template <typename Acc, typename Output>
void attend_rows(const FwdProblem& p, const Arithmetic<Acc>& math, const Output& output,
                 const Sequence& s, const Task& task, Workspace<Acc>& ws) {
  const int b = task.b, h = task.h;
  const int kv_head = h / (p.heads_q / p.heads_kv);
  const int d = p.head_dim;
  const int64_t len_k = s.len_k;
  ws.k_transposed.resize(static_cast<size_t>(d) * len_k);
  ws.v.resize(static_cast<size_t>(len_k) * d);
  for (int64_t j = 0; j < len_k; ++j) {
    const int64_t k_row =
        b * p.k_batch_stride + (s.k_token + j) * p.k_row_stride + kv_head * p.k_head_stride;
    const int64_t v_row =
        b * p.v_batch_stride + (s.k_token + j) * p.v_row_stride + kv_head * p.v_head_stride;
    for (int c = 0; c < d; ++c) {
      ws.k_transposed[c * len_k + j] = load_half(p.dtype, p.k, k_row + c);
      ws.v[j * d + c] = load_half(p.dtype, p.v, v_row + c);
    }
  }
  ws.q_block.resize(static_cast<size_t>(kRowBlock) * d);
  ws.out_block.resize(static_cast<size_t>(kRowBlock) * d);

  const double slope =
      p.alibi_slopes != nullptr ? p.alibi_slopes[b * p.alibi_batch_stride + h] : 0.0;
  const bool dropout = p.dropout_p > 0.0f;
  const DropoutMask mask = p.dropout_mask();
  const uint32_t bh = static_cast<uint32_t>(b * p.heads_q + h);
  const Acc keep_scale = static_cast<Acc>(1.0 / (1.0 - static_cast<double>(p.dropout_p)));
  for (int row0 = task.row_begin; row0 < task.row_end; row0 += kRowBlock) {
    const int rows = std::min(kRowBlock, task.row_end - row0);

    // The union of the rows' key ranges: the block's scores cover it, masked keys get p = 0.
    KeyRange ranges[kRowBlock];
    int64_t block_first = len_k, block_end = 0;
    for (int r = 0; r < kRowBlock; ++r) {
      ranges[r] = r < rows ? allowed_keys(p, s, row0 + r) : KeyRange{0, 0};
      if (ranges[r].first < ranges[r].end) {
        block_first = std::min(block_first, ranges[r].first);
        block_end = std::max(block_end, ranges[r].end);
      }
    }
    const int64_t width = std::max<int64_t>(0, block_end - block_first);

    // Rows past the task's end stay zero and are never written out.
    std::fill(ws.q_block.begin(), ws.q_block.end(), Acc(0));
    for (int r = 0; r < rows; ++r) {
      const int64_t q_row =
          b * p.q_batch_stride + (s.q_token + row0 + r) * p.q_row_stride + h * p.q_head_stride;
      for (int c = 0; c < d; ++c) ws.q_block[r * d + c] = load_half(p.dtype, p.q, q_row + c);
    }

    // S = Q K^T over the block's keys, one column of K^T at a time.
    static_assert(kRowBlock == 4);
    ws.scores.assign(static_cast<size_t>(kRowBlock) * width, Acc(0));
    Acc* __restrict s0 = ws.scores.data();
    Acc* __restrict s1 = s0 + width;
    Acc* __restrict s2 = s1 + width;
    Acc* __restrict s3 = s2 + width;
    for (int c = 0; c < d; ++c) {
      const float* __restrict k_col = ws.k_transposed.data() + c * len_k + block_first;
      const Acc q0 = ws.q_block[c], q1 = ws.q_block[d + c];
      const Acc q2 = ws.q_block[2 * d + c], q3 = ws.q_block[3 * d + c];
      for (int64_t j = 0; j < width; ++j) {
        const Acc key = k_col[j];
        s0[j] += q0 * key;
        s1[j] += q1 * key;
        s2[j] += q2 * key;
        s3[j] += q3 * key;
      }
    }

    // Scores -> probabilities, in place. kExact keeps them unnormalised and divides the output
    // by the sum at the end; kInputDtype normalises, then rounds them to the input dtype.
    Acc row_sum[kRowBlock];
    double row_lse[kRowBlock];
    for (int r = 0; r < rows; ++r) {
      Acc* probs = ws.scores.data() + r * width;
      const KeyRange range = ranges[r];
      if (range.first >= range.end) {
        std::fill(probs, probs + width, Acc(0));
        row_lse[r] = -std::numeric_limits<double>::infinity();
        continue;
      }
      const int64_t diagonal = row0 + r + len_k - s.len_q;
      Acc max_score = -std::numeric_limits<Acc>::infinity();
      for (int64_t j = range.first; j < range.end; ++j) {
        Acc score = math.round(probs[j - block_first]) * static_cast<Acc>(p.softmax_scale);
        if (p.softcap > 0.0f) {
          const Acc cap = p.softcap;
          score = cap * std::tanh(score / cap);
        }
        if (p.alibi_slopes != nullptr) {
          score -= static_cast<Acc>(slope) * static_cast<Acc>(std::abs(diagonal - j));
        }
        probs[j - block_first] = score;
        max_score = std::max(max_score, score);
      }
      Acc sum = 0;
      for (int64_t j = 0; j < width; ++j) {
        const int64_t key = block_first + j;
        probs[j] =
            (key >= range.first && key < range.end) ? std::exp(probs[j] - max_score) : Acc(0);
        sum += probs[j];
      }
      row_sum[r] = sum;
      row_lse[r] = static_cast<double>(max_score + std::log(sum));
      if (math.round_to_input) {
        for (int64_t j = range.first; j < range.end; ++j) {
          probs[j - block_first] = math.round(probs[j - block_first] / sum);
        }
      }
      if (dropout || output.wants_probs()) {
        // After the sum: the normaliser and the lse are those of the undropped probabilities.
        const int i = row0 + r;
        if (dropout) dropout_keep_row(mask, bh, i, range.first, range.end, ws.keep);
        for (int64_t j = range.first; j < range.end; ++j) {
          Acc& prob = probs[j - block_first];
          const bool kept = !dropout || ws.keep[j - range.first] != 0;
          if (output.wants_probs()) {
            const Acc normalized = math.round_to_input ? prob : prob / sum;
            output.write_prob(b, h, i, j, static_cast<double>(normalized), kept);
          }
          if (dropout) prob = kept ? math.round(prob * keep_scale) : Acc(0);
        }
      }
    }

    // O = P V, one key row of V at a time.
    std::fill(ws.out_block.begin(), ws.out_block.end(), Acc(0));
    Acc* __restrict o0 = ws.out_block.data();
    Acc* __restrict o1 = o0 + d;
    Acc* __restrict o2 = o1 + d;
    Acc* __restrict o3 = o2 + d;
    for (int64_t j = 0; j < width; ++j) {
      const float* __restrict v_row = ws.v.data() + (block_first + j) * d;
      const Acc p0 = s0[j], p1 = s1[j], p2 = s2[j], p3 = s3[j];
      for (int c = 0; c < d; ++c) {
        const Acc value = v_row[c];
        o0[c] += p0 * value;
        o1[c] += p1 * value;
        o2[c] += p2 * value;
        o3[c] += p3 * value;
      }
    }

    for (int r = 0; r < rows; ++r) {
      if (ranges[r].first >= ranges[r].end) {
        output.write_row(b, h, s, row0 + r, nullptr, row_lse[r]);
        continue;
      }
      Acc* out_row = ws.out_block.data() + r * d;
      for (int c = 0; c < d; ++c) {
        out_row[c] = math.round_to_input ? math.round(out_row[c]) : out_row[c] / row_sum[r];
      }
      output.write_row(b, h, s, row0 + r, out_row, row_lse[r]);
    }
  }
}

void check_problem(const FwdProblem& p) {
  if (p.dtype != DType::kFloat16 && p.dtype != DType::kBFloat16) {
    throw Error(std::string("reference_fwd: dtype is ") + dtype_name(p.dtype) +
                "; supported: float16, bfloat16");
  }
  if (p.heads_kv <= 0 || p.heads_q % p.heads_kv != 0) {
    throw Error("reference_fwd: heads_q = " + std::to_string(p.heads_q) +
                " is not a multiple of heads_kv = " + std::to_string(p.heads_kv));
  }
  if (!(p.dropout_p >= 0.0f && p.dropout_p < 1.0f)) {
    throw Error("reference_fwd: dropout_p is " + std::to_string(p.dropout_p) +
                "; it must be in [0, 1)");
  }
}

// Zeroes every element of attn_probs (padding rows and columns, masked pairs); the tasks then write
// the visible pairs.
void clear_attn_probs(const FwdProblem& p) {
  if (p.attn_probs == nullptr) return;
  for (int b = 0; b < p.batch; ++b) {
    for (int h = 0; h < p.heads_q; ++h) {
      for (int i = 0; i < p.attn_probs_rows; ++i) {
        uint16_t* row = static_cast<uint16_t*>(p.attn_probs) + attn_probs_index(p, b, h, i);
        std::fill(row, row + p.attn_probs_cols, uint16_t{0});
      }
    }
  }
}

// Runs every task, on several threads when the problem is large enough.
template <typename Acc, typename Output>
void run_reference(const FwdProblem& p, const Arithmetic<Acc>& math, const Output& output) {
  check_problem(p);
  const std::vector<Sequence> sequences = sequences_of(p, "reference_fwd");
  std::vector<Task> task_list;
  double work = 0;
  for (int b = 0; b < p.batch; ++b) {
    const Sequence& s = sequences[b];
    work += static_cast<double>(s.len_q) * s.len_k * p.heads_q * p.head_dim;
    for (int h = 0; h < p.heads_q; ++h) {
      for (int row = 0; row < s.len_q; row += kRowsPerTask) {
        task_list.push_back({b, h, row, std::min(s.len_q, row + kRowsPerTask)});
      }
    }
  }
  if (output.wants_probs()) clear_attn_probs(p);
  run_tasks<Workspace<Acc>>(static_cast<int>(task_list.size()), work,
                            [&](Workspace<Acc>& ws, int n) {
                              const Task& task = task_list[n];
                              attend_rows(p, math, output, sequences[task.b], task, ws);
                            });
}

}  // namespace

void reference_fwd(const FwdProblem& problem) {
  run_reference(problem, Arithmetic<double>{problem.dtype, false}, StridedOutput<double>(problem));
}

void reference_fwd_fp32(const FwdProblem& problem, RefPrecision precision, float* out, float* lse) {
  if (precision == RefPrecision::kExact) {
    run_reference(problem, Arithmetic<double>{problem.dtype, false},
                  ContiguousFp32Output<double>(problem, out, lse));
  } else {
    run_reference(problem, Arithmetic<float>{problem.dtype, true},
                  ContiguousFp32Output<float>(problem, out, lse));
  }
}

}  // namespace flashkit::cpu
