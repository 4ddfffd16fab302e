// tests/cpp/test_reference.cpp
// \brief The CPU reference against a deliberately naive fp64 attention written here (full score
// matrix, mask tested key by key, plain softmax), across dtypes, head dims, GQA/MQA, masks, ALiBi,
// softcap, varlen and odd lengths; the mask semantics spelled out on tiny cases; the kInputDtype
// mode; and the public API on CPU views, including layout invariance.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <random>
#include <string>
#include <type_traits>
#include <vector>

#include "api/validate_fwd.h"
#include "attention_case.h"
#include "common/half_float.h"
#include "cpu/reference_fwd.h"
#include "flashkit/flashkit.h"

namespace flashkit::test {
namespace {

constexpr double kInf = std::numeric_limits<double>::infinity();

// ---- the naive oracle ----

// out: [batch, heads_q, max_seqlen_q, head_dim], lse: [batch, heads_q, max_seqlen_q]; rows past a
// varlen sequence's end stay NaN.
struct NaiveResult {
  std::vector<double> out;
  std::vector<double> lse;
};

// Reads the inputs straight from the case's contiguous buffers and the sequence lengths from its
// FwdCase; only the scalar options (scale, softcap, windows) come from the problem.
//
// T = double: the exact oracle. T = float: an emulation of plain framework code in the input dtype
// (fp32 dot products rounded to the dtype, fp32 softmax, probabilities and outputs rounded to the
// dtype), independent of the reference's kInputDtype mode.
template <typename T>
NaiveResult naive_attention(const AttentionCase& c, const FwdProblem& p) {
  const FwdCase& spec = c.fwd_case();
  const bool emulate_input_dtype = std::is_same_v<T, float>;
  auto to_input_dtype = [&](T x) {
    return emulate_input_dtype ? static_cast<T>(round_to(spec.dtype, static_cast<float>(x))) : x;
  };
  auto input = [&](const std::vector<uint16_t>& buffer, int64_t index) {
    return static_cast<T>(bits_to_float(spec.dtype, buffer[index]));
  };
  const int batch = spec.batch, hq = spec.heads_q, d = spec.head_dim;
  const int group = spec.heads_q / spec.heads_kv;
  const int rows = spec.lse_rows();
  NaiveResult result{std::vector<double>(static_cast<size_t>(batch) * hq * rows * d, std::nan("")),
                     std::vector<double>(static_cast<size_t>(batch) * hq * rows, std::nan(""))};

  int64_t q_start = 0, k_start = 0;
  for (int b = 0; b < batch; ++b) {
    const int len_q = spec.varlen ? spec.lens_q[b] : spec.seqlen_q;
    const int stored_k = spec.varlen ? spec.lens_k[b] : spec.seqlen_k;
    const int len_k = spec.used_k.empty() ? stored_k : spec.used_k[b];
    for (int h = 0; h < hq; ++h) {
      const int kv_head = h / group;
      T slope = 0;
      if (spec.alibi == AlibiKind::kPerHead) slope = c.in.alibi[h];
      if (spec.alibi == AlibiKind::kPerBatchHead) slope = c.in.alibi[b * hq + h];

      std::vector<T> scores(static_cast<size_t>(len_q) * len_k);
      std::vector<bool> allowed(scores.size());
      for (int i = 0; i < len_q; ++i) {
        for (int j = 0; j < len_k; ++j) {
          T dot = 0;
          for (int e = 0; e < d; ++e) {
            dot += input(c.in.q, c.q_index(q_start + i, h, e)) *
                   input(c.in.k, c.k_index(k_start + j, kv_head, e));
          }
          T s = to_input_dtype(dot) * static_cast<T>(p.softmax_scale);
          if (p.softcap > 0.0f) {
            const T cap = p.softcap;
            s = cap * std::tanh(s / cap);
          }
          const int64_t shift = static_cast<int64_t>(len_k) - len_q;
          s -= slope * static_cast<T>(std::abs(i + shift - j));
          scores[i * len_k + j] = s;
          allowed[i * len_k + j] = (p.window_left < 0 || j >= i + shift - p.window_left) &&
                                   (p.window_right < 0 || j <= i + shift + p.window_right);
        }
      }
      for (int i = 0; i < len_q; ++i) {
        const size_t row = (static_cast<size_t>(b) * hq + h) * rows + i;
        T max_score = -std::numeric_limits<T>::infinity();
        for (int j = 0; j < len_k; ++j) {
          if (allowed[i * len_k + j]) max_score = std::max(max_score, scores[i * len_k + j]);
        }
        std::vector<T> out_row(d, T(0));
        if (max_score == -std::numeric_limits<T>::infinity()) {
          std::fill_n(&result.out[row * d], d, 0.0);
          result.lse[row] = -kInf;
          continue;
        }
        T sum = 0;
        for (int j = 0; j < len_k; ++j) {
          if (allowed[i * len_k + j]) sum += std::exp(scores[i * len_k + j] - max_score);
        }
        for (int j = 0; j < len_k; ++j) {
          if (!allowed[i * len_k + j]) continue;
          const T prob = to_input_dtype(std::exp(scores[i * len_k + j] - max_score) / sum);
          for (int e = 0; e < d; ++e) {
            out_row[e] += prob * input(c.in.v, c.k_index(k_start + j, kv_head, e));
          }
        }
        for (int e = 0; e < d; ++e) result.out[row * d + e] = to_input_dtype(out_row[e]);
        result.lse[row] = max_score + std::log(sum);
      }
    }
    q_start += len_q;
    k_start += stored_k;
  }
  return result;
}

// ---- comparisons ----

// NaN (row never written), -inf (row with no key) and zeros must match exactly; finite values up
// to |actual - expected| <= atol + rtol * |expected|.
void expect_close(const std::vector<float>& actual, const std::vector<double>& expected,
                  double atol, double rtol, const std::string& what) {
  ASSERT_EQ(actual.size(), expected.size()) << what;
  for (size_t n = 0; n < actual.size(); ++n) {
    const double a = actual[n], e = expected[n];
    if (std::isnan(e) || std::isinf(e)) {
      ASSERT_TRUE(std::isnan(e) ? std::isnan(a) : a == e)
          << what << "[" << n << "] is " << a << ", expected " << e;
      continue;
    }
    ASSERT_LE(std::fabs(a - e), atol + rtol * std::fabs(e))
        << what << "[" << n << "] is " << a << ", expected " << e;
  }
}

struct Fp32Result {
  std::vector<float> out;
  std::vector<float> lse;
};

Fp32Result run_reference_fp32(const FwdProblem& p, cpu::RefPrecision precision) {
  Fp32Result r{
      std::vector<float>(static_cast<size_t>(p.batch) * p.heads_q * p.seqlen_q * p.head_dim,
                         std::nanf("")),
      std::vector<float>(static_cast<size_t>(p.batch) * p.heads_q * p.seqlen_q, std::nanf(""))};
  cpu::reference_fwd_fp32(p, precision, r.out.data(), r.lse.data());
  return r;
}

// The kExact reference against the naive oracle: both are fp64 inside, so only the final float
// rounding separates them.
void expect_reference_matches_naive(AttentionCase& c) {
  const FwdProblem p = c.problem();
  const Fp32Result r = run_reference_fp32(p, cpu::RefPrecision::kExact);
  const NaiveResult naive = naive_attention<double>(c, p);
  expect_close(r.out, naive.out, 1e-6, 1e-6, "out");
  expect_close(r.lse, naive.lse, 1e-6, 1e-6, "lse");
}

// ---- random cases ----

enum class MaskKind { kNone, kCausal, kWindow, kCausalWithLeftWindow };

int odd_length(std::mt19937_64& rng, bool allow_zero) {
  static const int kLengths[] = {1, 3, 17, 33};
  std::uniform_int_distribution<int> pick(allow_zero ? -1 : 0, 4);
  const int n = pick(rng);
  if (n < 0) return 0;
  if (n == 4) return std::uniform_int_distribution<int>(2, 40)(rng);
  return kLengths[n];
}

// A case with the given dtype / head dim / heads / mask and everything else drawn from `rng`:
// ALiBi (none, per head, per batch and head), softcap, fixed or variable length (with zero-length
// sequences, seqused_k and unused tail tokens), odd lengths with seqlen_q above and below seqlen_k.
FwdCase random_case(std::mt19937_64& rng, DType dtype, int head_dim, int heads_q, int heads_kv,
                    MaskKind mask) {
  auto coin = [&](double p) { return std::bernoulli_distribution(p)(rng); };
  FwdCase s;
  s.name = "random";
  s.dtype = dtype;
  s.head_dim = head_dim;
  s.heads_q = heads_q;
  s.heads_kv = heads_kv;
  s.seed = rng();
  if (coin(0.5)) {
    s.varlen = true;
    s.batch = std::uniform_int_distribution<int>(1, 4)(rng);
    for (int b = 0; b < s.batch; ++b) {
      s.lens_q.push_back(odd_length(rng, true));
      s.lens_k.push_back(odd_length(rng, true));
    }
    if (coin(0.4)) {
      for (int b = 0; b < s.batch; ++b) {
        s.used_k.push_back(std::uniform_int_distribution<int>(0, s.lens_k[b])(rng));
      }
    }
    s.tail_q = s.tail_k = coin(0.3) ? 5 : 0;
  } else {
    s.batch = std::uniform_int_distribution<int>(1, 3)(rng);
    s.seqlen_q = odd_length(rng, false);
    s.seqlen_k = odd_length(rng, coin(0.1));
  }
  const int max_k = 40;
  auto random_side = [&] {
    return coin(0.25) ? -1 : std::uniform_int_distribution<int>(0, max_k)(rng);
  };
  switch (mask) {
    case MaskKind::kNone:
      break;
    case MaskKind::kCausal:
      s.causal = true;
      break;
    case MaskKind::kWindow:
      s.window_left = random_side();
      s.window_right = random_side();
      break;
    case MaskKind::kCausalWithLeftWindow:
      s.causal = true;
      s.window_left = std::uniform_int_distribution<int>(0, 8)(rng);
      break;
  }
  const int alibi = std::uniform_int_distribution<int>(0, 2)(rng);
  s.alibi = alibi == 0   ? AlibiKind::kNone
            : alibi == 1 ? AlibiKind::kPerHead
                         : AlibiKind::kPerBatchHead;
  if (coin(0.35)) s.softcap = std::uniform_real_distribution<float>(0.5f, 10.0f)(rng);
  if (coin(0.3)) s.softmax_scale = std::uniform_real_distribution<float>(0.05f, 0.5f)(rng);
  return s;
}

TEST(ReferenceVsNaive, FeatureGrid) {
  std::mt19937_64 rng(20240601);
  const DType dtypes[] = {DType::kFloat16, DType::kBFloat16};
  const int head_dims[] = {8, 40, 64, 136, 256};
  const int heads[][2] = {{3, 3}, {6, 2}, {4, 1}};  // MHA, GQA, MQA
  const MaskKind masks[] = {MaskKind::kNone, MaskKind::kCausal, MaskKind::kWindow,
                            MaskKind::kCausalWithLeftWindow};
  for (DType dtype : dtypes) {
    for (int head_dim : head_dims) {
      for (const auto& h : heads) {
        for (MaskKind mask : masks) {
          AttentionCase c(random_case(rng, dtype, head_dim, h[0], h[1], mask));
          SCOPED_TRACE(c.fwd_case().describe());
          expect_reference_matches_naive(c);
          if (HasFatalFailure()) return;
        }
      }
    }
  }
}

TEST(ReferenceVsNaive, RandomCases) {
  std::mt19937_64 rng(777);
  for (int n = 0; n < 150; ++n) {
    const DType dtype = n % 2 ? DType::kFloat16 : DType::kBFloat16;
    const int head_dim = 8 * std::uniform_int_distribution<int>(1, 32)(rng);
    const int heads_kv = std::uniform_int_distribution<int>(1, 3)(rng);
    const int heads_q = heads_kv * std::uniform_int_distribution<int>(1, 3)(rng);
    const auto mask = static_cast<MaskKind>(std::uniform_int_distribution<int>(0, 3)(rng));
    AttentionCase c(random_case(rng, dtype, head_dim, heads_q, heads_kv, mask));
    SCOPED_TRACE(c.fwd_case().describe());
    expect_reference_matches_naive(c);
    if (HasFatalFailure()) return;
  }
}

// seqlen_q below, equal to and above seqlen_k, where the bottom-right alignment of the masks shows.
TEST(ReferenceVsNaive, QueryAndKeyLengthsBothWays) {
  const int lengths[][2] = {{1, 33}, {33, 1}, {17, 33}, {33, 17}, {3, 3}, {1, 1}};
  uint64_t seed = 5;
  for (const auto& len : lengths) {
    for (int variant = 0; variant < 4; ++variant) {
      FwdCase s;
      s.name = "lengths";
      s.dtype = DType::kFloat16;
      s.batch = 2;
      s.heads_q = 4;
      s.heads_kv = 2;
      s.head_dim = 32;
      s.seqlen_q = len[0];
      s.seqlen_k = len[1];
      s.causal = variant == 1 || variant == 3;
      if (variant == 2) s.window_left = s.window_right = 2;
      if (variant == 3) s.alibi = AlibiKind::kPerHead;
      s.seed = ++seed;
      AttentionCase c(s);
      SCOPED_TRACE(s.describe());
      expect_reference_matches_naive(c);
      if (HasFatalFailure()) return;
    }
  }
}

// Large enough to run on several threads and to cross many row blocks.
TEST(ReferenceVsNaive, LargerProblemOnSeveralThreads) {
  FwdCase s;
  s.dtype = DType::kBFloat16;
  s.batch = 2;
  s.heads_q = 4;
  s.heads_kv = 2;
  s.head_dim = 64;
  s.seqlen_q = 150;
  s.seqlen_k = 203;
  s.causal = true;
  s.alibi = AlibiKind::kPerBatchHead;
  s.seed = 99;
  AttentionCase c(s);
  expect_reference_matches_naive(c);
}

// ---- the mask semantics, spelled out ----

FwdCase tiny_case(int seqlen_q, int seqlen_k) {
  FwdCase s;
  s.dtype = DType::kFloat16;
  s.batch = 1;
  s.heads_q = 2;
  s.heads_kv = 1;
  s.head_dim = 16;
  s.seqlen_q = seqlen_q;
  s.seqlen_k = seqlen_k;
  s.seed = 11;
  return s;
}

float value_of(const AttentionCase& c, const std::vector<uint16_t>& buffer, int64_t index) {
  return bits_to_float(c.fwd_case().dtype, buffer[index]);
}

// The score of (query token i, key token j) for query head h, as the reference defines it.
double score_of(const AttentionCase& c, float scale, int64_t i, int64_t j, int h) {
  const FwdCase& s = c.fwd_case();
  double dot = 0.0;
  for (int e = 0; e < s.head_dim; ++e) {
    dot += static_cast<double>(value_of(c, c.in.q, c.q_index(i, h, e))) *
           value_of(c, c.in.k, c.k_index(j, h / (s.heads_q / s.heads_kv), e));
  }
  return scale * dot;
}

// Bottom-right alignment: with 8 queries and 3 keys, row i sees keys j <= i - 5, so rows 0..4 see
// none (zeros, lse -inf) and row 5 sees key 0 alone (out = v_0, lse = its score).
TEST(MaskSemantics, CausalWithMoreQueriesThanKeysLeavesFirstRowsEmpty) {
  FwdCase s = tiny_case(8, 3);
  s.causal = true;
  AttentionCase c(s);
  const FwdProblem p = c.problem();
  const Fp32Result r = run_reference_fp32(p, cpu::RefPrecision::kExact);
  const int d = s.head_dim;
  for (int h = 0; h < s.heads_q; ++h) {
    for (int i = 0; i < 5; ++i) {
      EXPECT_EQ(r.lse[h * 8 + i], -std::numeric_limits<float>::infinity()) << "row " << i;
      for (int e = 0; e < d; ++e) EXPECT_EQ(r.out[(h * 8 + i) * d + e], 0.0f);
    }
    EXPECT_FLOAT_EQ(r.lse[h * 8 + 5], static_cast<float>(score_of(c, p.softmax_scale, 5, 0, h)));
    for (int e = 0; e < d; ++e) {
      EXPECT_FLOAT_EQ(r.out[(h * 8 + 5) * d + e], value_of(c, c.in.v, c.k_index(0, 0, e)));
    }
    EXPECT_NE(r.lse[h * 8 + 6], -std::numeric_limits<float>::infinity());
  }
}

// Window (0, 0) keeps only the aligned diagonal key i + seqlen_k - seqlen_q: out_i is that key's
// value row, lse_i its score.
TEST(MaskSemantics, WindowZeroZeroAttendsToTheAlignedDiagonalOnly) {
  const int lengths[][2] = {{5, 5}, {3, 7}};
  for (const auto& len : lengths) {
    FwdCase s = tiny_case(len[0], len[1]);
    s.window_left = 0;
    s.window_right = 0;
    AttentionCase c(s);
    const FwdProblem p = c.problem();
    const Fp32Result r = run_reference_fp32(p, cpu::RefPrecision::kExact);
    for (int h = 0; h < s.heads_q; ++h) {
      for (int i = 0; i < len[0]; ++i) {
        const int j = i + len[1] - len[0];
        const int64_t row = h * len[0] + i;
        EXPECT_FLOAT_EQ(r.lse[row], static_cast<float>(score_of(c, p.softmax_scale, i, j, h)));
        for (int e = 0; e < s.head_dim; ++e) {
          EXPECT_FLOAT_EQ(r.out[row * s.head_dim + e], value_of(c, c.in.v, c.k_index(j, 0, e)));
        }
      }
    }
  }
}

// No key at all (seqlen_k == 0, a zero-length key sequence, seqused_k == 0): zeros and -inf.
TEST(MaskSemantics, NoKeysGivesZeroRowsAndMinusInfinity) {
  AttentionCase fixed(tiny_case(4, 0));
  const Fp32Result r = run_reference_fp32(fixed.problem(), cpu::RefPrecision::kExact);
  for (float x : r.out) EXPECT_EQ(x, 0.0f);
  for (float x : r.lse) EXPECT_EQ(x, -std::numeric_limits<float>::infinity());

  FwdCase s = tiny_case(0, 0);
  s.varlen = true;
  s.batch = 2;
  s.lens_q = {3, 2};
  s.lens_k = {0, 4};
  s.used_k = {0, 0};
  AttentionCase varlen(s);
  const Fp32Result rv = run_reference_fp32(varlen.problem(), cpu::RefPrecision::kExact);
  const int rows = s.lse_rows();
  for (int b = 0; b < 2; ++b) {
    for (int h = 0; h < s.heads_q; ++h) {
      for (int i = 0; i < s.lens_q[b]; ++i) {
        EXPECT_EQ(rv.lse[(b * s.heads_q + h) * rows + i], -std::numeric_limits<float>::infinity());
      }
    }
  }
}

// Varlen: rows past a sequence's length belong to no query; the fp32 oracle leaves them alone.
TEST(MaskSemantics, VarlenRowsPastTheSequenceAreLeftUntouched) {
  FwdCase s = tiny_case(0, 0);
  s.varlen = true;
  s.batch = 3;
  s.lens_q = {5, 0, 2};
  s.lens_k = {3, 4, 0};
  AttentionCase c(s);
  const Fp32Result r = run_reference_fp32(c.problem(), cpu::RefPrecision::kExact);
  for (int b = 0; b < 3; ++b) {
    for (int h = 0; h < s.heads_q; ++h) {
      for (int i = 0; i < 5; ++i) {
        const float lse = r.lse[(b * s.heads_q + h) * 5 + i];
        EXPECT_EQ(std::isnan(lse), i >= s.lens_q[b]) << "b=" << b << " i=" << i;
      }
    }
  }
}

// ---- precision modes ----

// kInputDtype rounds scores, probabilities and outputs to the input dtype: it must differ from
// kExact, but only by what that rounding explains.
TEST(Precision, InputDtypeModeDiffersFromExactByAPlausibleAmount) {
  for (DType dtype : {DType::kFloat16, DType::kBFloat16}) {
    FwdCase s;
    s.dtype = dtype;
    s.batch = 2;
    s.heads_q = 4;
    s.heads_kv = 2;
    s.head_dim = 64;
    s.seqlen_q = 65;
    s.seqlen_k = 97;
    s.causal = true;
    s.softcap = 8.0f;
    s.alibi = AlibiKind::kPerHead;
    s.seed = 3;
    AttentionCase c(s);
    const FwdProblem p = c.problem();
    const Fp32Result exact = run_reference_fp32(p, cpu::RefPrecision::kExact);
    const Fp32Result input = run_reference_fp32(p, cpu::RefPrecision::kInputDtype);
    double max_diff = 0.0, max_value = 0.0, max_lse_diff = 0.0;
    for (size_t n = 0; n < exact.out.size(); ++n) {
      max_diff = std::max(max_diff, std::fabs(static_cast<double>(input.out[n]) - exact.out[n]));
      max_value = std::max(max_value, std::fabs(static_cast<double>(exact.out[n])));
    }
    for (size_t n = 0; n < exact.lse.size(); ++n) {
      max_lse_diff =
          std::max(max_lse_diff, std::fabs(static_cast<double>(input.lse[n]) - exact.lse[n]));
    }
    SCOPED_TRACE(dtype_name(dtype));
    const double relative = max_diff / max_value;
    EXPECT_GT(relative, 1e-5);
    EXPECT_LT(relative, 2e-2);
    EXPECT_GT(max_lse_diff, 0.0);
    EXPECT_LT(max_lse_diff, 0.1);
  }
}

// kInputDtype against the naive float emulation. Both sum in the same order, so they agree to
// the bit but for rare ties that fp32 contraction or library differences may flip: every element
// within one ulp of the dtype, nearly all of them equal.
TEST(Precision, InputDtypeModeMatchesANaiveEmulation) {
  std::mt19937_64 rng(4242);
  for (int n = 0; n < 40; ++n) {
    const DType dtype = n % 2 ? DType::kFloat16 : DType::kBFloat16;
    AttentionCase c(random_case(rng, dtype, 8 * (1 + n % 32), 4, n % 3 == 0 ? 1 : 2,
                                static_cast<MaskKind>(n % 4)));
    SCOPED_TRACE(c.fwd_case().describe());
    const FwdProblem p = c.problem();
    const Fp32Result r = run_reference_fp32(p, cpu::RefPrecision::kInputDtype);
    const NaiveResult naive = naive_attention<float>(c, p);
    const double ulp = dtype == DType::kFloat16 ? std::ldexp(1.0, -10) : std::ldexp(1.0, -7);
    expect_close(r.out, naive.out, 1e-6, ulp, "out");
    expect_close(r.lse, naive.lse, 1e-6, 1e-6, "lse");
    size_t equal = 0, finite = 0;
    for (size_t k = 0; k < r.out.size(); ++k) {
      if (std::isnan(naive.out[k])) continue;
      ++finite;
      equal += r.out[k] == naive.out[k];
    }
    EXPECT_GE(equal, finite * 99 / 100);
    if (HasFatalFailure()) return;
  }
}

// ---- the public API on CPU views ----

// The API writes out in the input dtype: it must be the fp32 oracle rounded to that dtype (within
// half an ulp, the two being rounded from the same fp64 value), and the same lse.
void expect_api_matches_oracle(AttentionCase& c, const FwdProblem& validated) {
  const Fp32Result oracle = run_reference_fp32(validated, cpu::RefPrecision::kExact);
  const FwdCase& s = c.fwd_case();
  const double half_ulp = s.dtype == DType::kFloat16 ? std::ldexp(1.0, -11) : std::ldexp(1.0, -8);
  int64_t q_start = 0;
  for (int b = 0; b < s.batch; ++b) {
    const int len_q = s.len_q(b);
    for (int h = 0; h < s.heads_q; ++h) {
      for (int i = 0; i < len_q; ++i) {
        const int64_t row = (static_cast<int64_t>(b) * s.heads_q + h) * s.lse_rows() + i;
        ASSERT_EQ(c.lse[row], oracle.lse[row]) << "lse b=" << b << " h=" << h << " i=" << i;
        for (int e = 0; e < s.head_dim; ++e) {
          const double expected = oracle.out[row * s.head_dim + e];
          const double actual = bits_to_float(s.dtype, c.out[c.q_index(q_start + i, h, e)]);
          ASSERT_LE(std::fabs(actual - expected), half_ulp * std::fabs(expected) + 1e-7)
              << "out b=" << b << " h=" << h << " i=" << i << " e=" << e;
        }
      }
    }
    q_start += len_q;
  }
}

TEST(PublicApi, MhaFwdOnCpuViewsMatchesTheFp32Reference) {
  std::mt19937_64 rng(31);
  for (int n = 0; n < 24; ++n) {
    FwdCase s = random_case(rng, n % 2 ? DType::kFloat16 : DType::kBFloat16, 8 * (1 + n % 8), 4,
                            n % 3 == 0 ? 1 : 2, static_cast<MaskKind>(n % 4));
    s.varlen = false;
    s.batch = 2;
    s.seqlen_q = odd_length(rng, false);
    s.seqlen_k = odd_length(rng, false);
    AttentionCase c(s);
    SCOPED_TRACE(s.describe());
    const MhaFwdParams params = c.fwd_params();
    mha_fwd(params);
    expect_api_matches_oracle(c, api::validate_mha_fwd(params));
    if (HasFatalFailure()) return;
  }
}

TEST(PublicApi, MhaVarlenFwdOnCpuViewsMatchesTheFp32Reference) {
  std::mt19937_64 rng(32);
  for (int n = 0; n < 24; ++n) {
    FwdCase s;
    do {
      s = random_case(rng, n % 2 ? DType::kFloat16 : DType::kBFloat16, 8 * (1 + n % 8), 6, 2,
                      static_cast<MaskKind>(n % 4));
    } while (!s.varlen);
    AttentionCase c(s);
    SCOPED_TRACE(s.describe());
    const MhaVarlenFwdParams params = c.varlen_params();
    mha_varlen_fwd(params);
    expect_api_matches_oracle(c, api::validate_mha_varlen_fwd(params));
    if (HasFatalFailure()) return;
  }
}

// seqlen_k == 0 through the API: every row is zero with lse -inf (written, not left poisoned).
TEST(PublicApi, NoKeysWritesZerosAndMinusInfinity) {
  AttentionCase c(tiny_case(3, 0));
  mha_fwd(c.fwd_params());
  for (uint16_t bits : c.out) EXPECT_EQ(bits_to_float(c.fwd_case().dtype, bits), 0.0f);
  for (float x : c.lse) EXPECT_EQ(x, -std::numeric_limits<float>::infinity());
}

// seqlen_q == 0 is valid and leaves nothing to do.
TEST(PublicApi, NoQueriesIsValidAndWritesNothing) {
  AttentionCase c(tiny_case(0, 5));
  EXPECT_NO_THROW(mha_fwd(c.fwd_params()));
}

// ---- layout invariance ----

// The same values behind padded, permuted strides (q/out stored [batch, heads, seqlen, dim + pad],
// k/v [seqlen, batch, heads, dim + pad], lse [heads, batch, seqlen + pad]) give bit-identical
// results.
TEST(Layout, NonContiguousStridesGiveTheSameResult) {
  FwdCase s;
  s.dtype = DType::kBFloat16;
  s.batch = 2;
  s.heads_q = 4;
  s.heads_kv = 2;
  s.head_dim = 24;
  s.seqlen_q = 17;
  s.seqlen_k = 33;
  s.causal = true;
  s.alibi = AlibiKind::kPerBatchHead;
  s.seed = 8;
  AttentionCase c(s);
  mha_fwd(c.fwd_params());

  const int64_t B = s.batch, H = s.heads_q, G = s.heads_kv, D = s.head_dim, SQ = s.seqlen_q,
                SK = s.seqlen_k, pad = 5, P = D + pad;
  const Device cpu{};
  // q/out: element (b, i, h, e) at ((b * H + h) * SQ + i) * P + e.
  std::vector<uint16_t> q(B * H * SQ * P, nan_bits(s.dtype)), out(q.size(), nan_bits(s.dtype));
  // k/v: element (b, j, g, e) at ((j * B + b) * G + g) * P + e.
  std::vector<uint16_t> k(SK * B * G * P, nan_bits(s.dtype)), v(k.size(), nan_bits(s.dtype));
  // lse: element (b, h, i) at (h * B + b) * (SQ + pad) + i.
  std::vector<float> lse(H * B * (SQ + pad), std::nanf(""));
  for (int64_t b = 0; b < B; ++b) {
    for (int64_t i = 0; i < SQ; ++i) {
      for (int64_t h = 0; h < H; ++h) {
        for (int64_t e = 0; e < D; ++e)
          q[((b * H + h) * SQ + i) * P + e] = c.in.q[c.q_index(b * SQ + i, h, e)];
      }
    }
    for (int64_t j = 0; j < SK; ++j) {
      for (int64_t g = 0; g < G; ++g) {
        for (int64_t e = 0; e < D; ++e) {
          k[((j * B + b) * G + g) * P + e] = c.in.k[c.k_index(b * SK + j, g, e)];
          v[((j * B + b) * G + g) * P + e] = c.in.v[c.k_index(b * SK + j, g, e)];
        }
      }
    }
  }
  MhaFwdParams strided = c.fwd_params();
  strided.q = make_strided_view(q.data(), s.dtype, {B, SQ, H, D}, {H * SQ * P, P, SQ * P, 1}, cpu);
  strided.out =
      make_strided_view(out.data(), s.dtype, {B, SQ, H, D}, {H * SQ * P, P, SQ * P, 1}, cpu);
  strided.k = make_strided_view(k.data(), s.dtype, {B, SK, G, D}, {G * P, B * G * P, P, 1}, cpu);
  strided.v = make_strided_view(v.data(), s.dtype, {B, SK, G, D}, {G * P, B * G * P, P, 1}, cpu);
  strided.softmax_lse = make_strided_view(lse.data(), DType::kFloat32, {B, H, SQ},
                                          {SQ + pad, B * (SQ + pad), 1}, cpu);
  mha_fwd(strided);

  for (int64_t b = 0; b < B; ++b) {
    for (int64_t h = 0; h < H; ++h) {
      for (int64_t i = 0; i < SQ; ++i) {
        ASSERT_EQ(lse[(h * B + b) * (SQ + pad) + i], c.lse[(b * H + h) * SQ + i]);
        for (int64_t e = 0; e < D; ++e) {
          ASSERT_EQ(out[((b * H + h) * SQ + i) * P + e], c.out[c.q_index(b * SQ + i, h, e)]);
        }
      }
    }
  }
  // The padding between rows is never written.
  for (int64_t n = 0; n < static_cast<int64_t>(out.size()); ++n) {
    if (n % P >= D) {
      ASSERT_EQ(out[n], nan_bits(s.dtype));
    }
  }
}

// ---- what the reference refuses ----

TEST(Reference, RejectsDropoutOutsideZeroOne) {
  AttentionCase c(tiny_case(3, 3));
  FwdProblem p = c.problem();
  for (float prob : {1.0f, -0.25f}) {
    p.dropout_p = prob;
    EXPECT_THROW(cpu::reference_fwd(p), Error);
  }
}

}  // namespace
}  // namespace flashkit::test
