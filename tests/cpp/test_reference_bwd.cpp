// tests/cpp/test_reference_bwd.cpp
// \brief The CPU reference backward as an oracle: against central finite differences of the
// reference forward on tiny cases of every feature (causal, windows, ALiBi [h] and [b, h],
// softcap, GQA / MQA, varlen with seqused_k and zero-length sequences, s_q != s_k, rows with no
// key); the saved-statistics path against the recomputed one; the kInputDtype mode; and the public
// API (mha_bwd / mha_varlen_bwd) on CPU views, layouts included.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <string>
#include <vector>

#include "api/validate_bwd.h"
#include "attention_case.h"
#include "common/half_float.h"
#include "cpu/reference_bwd.h"
#include "cpu/reference_fwd.h"
#include "flashkit/flashkit.h"

namespace flashkit::test {
namespace {

using cpu::BwdStatistics;
using cpu::RefPrecision;

// fp32 gradients in the oracle's layout ([tokens, heads, head_dim]); NaN where never written.
struct Gradients {
  std::vector<float> dq, dk, dv;
};

Gradients run_reference_bwd(const BwdProblem& problem, const FwdCase& c, RefPrecision precision,
                            BwdStatistics statistics) {
  const float nan = std::numeric_limits<float>::quiet_NaN();
  Gradients g{std::vector<float>(static_cast<size_t>(c.total_q()) * c.heads_q * c.head_dim, nan),
              std::vector<float>(static_cast<size_t>(c.total_k()) * c.heads_kv * c.head_dim, nan),
              std::vector<float>(static_cast<size_t>(c.total_k()) * c.heads_kv * c.head_dim, nan)};
  cpu::reference_bwd_fp32(problem, precision, statistics, g.dq.data(), g.dk.data(), g.dv.data());
  return g;
}

// ---- finite differences ----

// The loss sum_{i, c} dout_ic * out_ic of the reference forward (kExact) at the case's current
// inputs, in fp64 over the fp32 outputs.
double loss(BackwardCase& c) {
  const FwdCase& s = c.fwd_case();
  const FwdProblem p = c.problem();
  std::vector<float> out(static_cast<size_t>(s.batch) * s.heads_q * s.lse_rows() * s.head_dim);
  std::vector<float> lse(static_cast<size_t>(s.batch) * s.heads_q * s.lse_rows());
  cpu::reference_fwd_fp32(p, RefPrecision::kExact, out.data(), lse.data());
  double sum = 0;
  for (int b = 0; b < s.batch; ++b) {
    for (int h = 0; h < s.heads_q; ++h) {
      for (int i = 0; i < s.len_q(b); ++i) {
        const float* row =
            &out[((static_cast<size_t>(b) * s.heads_q + h) * s.lse_rows() + i) * s.head_dim];
        for (int e = 0; e < s.head_dim; ++e) {
          const double grad = bits_to_float(s.dtype, c.dout[c.q_index(s.start_q(b) + i, h, e)]);
          sum += grad * row[e];
        }
      }
    }
  }
  return sum;
}

// A step near 2^-8 for which x + step and x - step are both exactly representable in `dtype`
// (the inputs cannot hold anything else): a multiple of x's ulp, odd where x + step crosses into
// a coarser binade. 2^-8 keeps the truncation error (step^2 / 6 times the third derivative) near
// 1e-5, about the size of the fp32 rounding of the outputs divided by the step. Some tiny x (an
// odd multiple of a fine ulp, with x + step and x - step in coarser binades of both signs) have no
// such step: 2^-8 is returned, and the difference is taken between the nearest representable
// neighbours, which sit within a fine ulp of x +- 2^-8 there.
float representable_step(DType dtype, float x) {
  const int mantissa_bits = dtype == DType::kFloat16 ? 10 : 7;
  const float target = std::ldexp(1.0f, -8);
  const float ulp =
      x == 0.0f ? std::ldexp(1.0f, -24) : std::ldexp(1.0f, std::ilogb(x) - mantissa_bits);
  const int k0 = std::max(1, static_cast<int>(std::lround(target / ulp)));
  auto exact = [&](float y) { return round_to(dtype, y) == y; };
  for (int delta = 0; delta < 64; ++delta) {
    for (int k : {k0 + delta, k0 - delta}) {
      const float step = static_cast<float>(k) * ulp;
      if (k >= 1 && exact(x + step) && exact(x - step)) return step;
    }
  }
  return target;
}

// d loss / d x for the 16-bit element `bits` (an input of the case), by a central difference.
double central_difference(BackwardCase& c, uint16_t& bits) {
  const DType dtype = c.fwd_case().dtype;
  const uint16_t saved = bits;
  const float x = bits_to_float(dtype, saved);
  const float step = representable_step(dtype, x);
  bits = float_to_bits(dtype, x + step);
  const double x_plus = bits_to_float(dtype, bits);
  const double plus = loss(c);
  bits = float_to_bits(dtype, x - step);
  const double x_minus = bits_to_float(dtype, bits);
  const double minus = loss(c);
  bits = saved;
  return (plus - minus) / (x_plus - x_minus);
}

// Every element of q, k and v: the reference's gradient (kExact, statistics recomputed from q, k
// and v, so that it is the gradient of the very function differentiated here) against the
// central difference, within 5e-4 of the largest gradient: the differences measure below 1.5e-4
// of it, and a wrong term is off by O(1).
void expect_gradients_match_finite_differences(BackwardCase& c) {
  const FwdCase& s = c.fwd_case();
  const Gradients g =
      run_reference_bwd(c.bwd_problem(), s, RefPrecision::kExact, BwdStatistics::kRecompute);
  struct Input {
    const char* name;
    std::vector<uint16_t>& values;
    const std::vector<float>& grad;
    int64_t used_elems;  // varlen: tail tokens belong to no sequence and have no gradient
  } inputs[] = {
      {"dq", c.in.q, g.dq, s.used_tokens_q() * s.heads_q * s.head_dim},
      {"dk", c.in.k, g.dk, (s.total_k() - (s.varlen ? s.tail_k : 0)) * s.heads_kv * s.head_dim},
      {"dv", c.in.v, g.dv, (s.total_k() - (s.varlen ? s.tail_k : 0)) * s.heads_kv * s.head_dim},
  };
  double max_grad = 1.0;
  for (const Input& input : inputs) {
    for (int64_t n = 0; n < input.used_elems; ++n) {
      max_grad = std::max(max_grad, std::fabs(static_cast<double>(input.grad[n])));
    }
  }
  const double tolerance = 5e-4 * max_grad;
  for (const Input& input : inputs) {
    for (int64_t n = 0; n < input.used_elems; ++n) {
      const double numeric = central_difference(c, input.values[n]);
      const double analytic = input.grad[n];
      ASSERT_TRUE(std::isfinite(analytic)) << input.name << "[" << n << "] is " << analytic;
      ASSERT_LE(std::fabs(numeric - analytic), tolerance)
          << input.name << "[" << n << "]: reference " << analytic << ", finite difference "
          << numeric;
    }
    // Tail tokens (varlen) belong to no sequence: never written.
    for (size_t n = input.used_elems; n < input.grad.size(); ++n) {
      ASSERT_TRUE(std::isnan(input.grad[n])) << input.name << " tail element " << n << " written";
    }
  }
}

// fp16 (finer steps than bf16), small sizes: every element is differentiated.
FwdCase tiny(int heads_q, int heads_kv, int seqlen_q, int seqlen_k, uint64_t seed) {
  FwdCase s;
  s.name = "tiny";
  s.dtype = DType::kFloat16;
  s.batch = 2;
  s.heads_q = heads_q;
  s.heads_kv = heads_kv;
  s.head_dim = 8;
  s.seqlen_q = seqlen_q;
  s.seqlen_k = seqlen_k;
  s.seed = seed;
  return s;
}

FwdCase tiny_varlen(std::vector<int> lens_q, std::vector<int> lens_k, uint64_t seed) {
  FwdCase s = tiny(4, 2, 0, 0, seed);
  s.varlen = true;
  s.batch = static_cast<int>(lens_q.size());
  s.lens_q = std::move(lens_q);
  s.lens_k = std::move(lens_k);
  return s;
}

struct FdCase {
  const char* what;
  FwdCase spec;
};

std::vector<FdCase> finite_difference_cases() {
  std::vector<FdCase> cases;
  cases.push_back({"plain MHA", tiny(2, 2, 5, 7, 1)});
  {
    FwdCase s = tiny(2, 2, 6, 6, 2);
    s.causal = true;
    cases.push_back({"causal", s});
  }
  {
    FwdCase s = tiny(2, 1, 7, 4, 3);  // rows 0..2 see no key
    s.causal = true;
    cases.push_back({"causal, s_q > s_k (rows with no key), MQA", s});
  }
  {
    FwdCase s = tiny(2, 2, 4, 9, 4);
    s.window_left = 2;
    s.window_right = 1;
    cases.push_back({"window (2, 1), s_q < s_k", s});
  }
  {
    FwdCase s = tiny(3, 3, 6, 5, 5);
    s.alibi = AlibiKind::kPerHead;
    cases.push_back({"ALiBi [heads]", s});
  }
  {
    FwdCase s = tiny(2, 2, 5, 6, 6);
    s.alibi = AlibiKind::kPerBatchHead;
    s.causal = true;
    cases.push_back({"causal + ALiBi [batch, heads]", s});
  }
  {
    FwdCase s = tiny(2, 2, 5, 6, 7);
    s.softcap = 1.5f;
    s.q_scale = 2.0f;
    s.softmax_scale = 0.5f;
    cases.push_back({"softcap (scores past the cap), explicit scale", s});
  }
  {
    FwdCase s = tiny(4, 2, 5, 5, 8);
    s.softcap = 2.0f;
    s.causal = true;
    cases.push_back({"causal + softcap, GQA", s});
  }
  {
    FwdCase s = tiny(6, 2, 3, 5, 9);
    s.alibi = AlibiKind::kPerHead;
    s.window_left = 1;
    cases.push_back({"GQA 6/2, ALiBi, left window", s});
  }
  {
    FwdCase s = tiny_varlen({3, 0, 4, 2}, {5, 3, 0, 4}, 10);
    s.used_k = {4, 1, 0, 4};
    s.tail_q = 2;
    s.tail_k = 3;
    s.causal = true;
    cases.push_back({"varlen: zero-length sequences, seqused_k, tails, causal", s});
  }
  {
    FwdCase s = tiny_varlen({4, 2}, {3, 6}, 11);
    s.softcap = 1.0f;
    s.alibi = AlibiKind::kPerBatchHead;
    cases.push_back({"varlen: softcap + ALiBi [batch, heads]", s});
  }
  // Dropout: the forward regenerates the same Philox mask at every perturbed input, so the finite
  // differences see the mask fixed, as the backward's gradient does.
  {
    FwdCase s = tiny(2, 2, 18, 37, 12);  // past one 16-row x 32-key Philox block
    s.dropout = {0.3f, 0x1234abcdULL, 7};
    cases.push_back({"dropout 0.3", s});
  }
  {
    FwdCase s = tiny(4, 2, 6, 9, 13);
    s.dropout = {0.5f, 99, 0};
    s.causal = true;
    s.alibi = AlibiKind::kPerHead;
    cases.push_back({"dropout 0.5 + causal + ALiBi, GQA", s});
  }
  {
    FwdCase s = tiny_varlen({3, 0, 5}, {4, 2, 6}, 14);
    s.dropout = {0.2f, 5, 1u << 20};
    s.softcap = 1.5f;
    cases.push_back({"varlen dropout 0.2 + softcap", s});
  }
  return cases;
}

TEST(ReferenceBwdFiniteDifferences, EveryFeature) {
  for (FdCase& fd : finite_difference_cases()) {
    SCOPED_TRACE(std::string(fd.what) + ": " + fd.spec.describe());
    BackwardCase c(fd.spec);
    expect_gradients_match_finite_differences(c);
    if (HasFatalFailure()) return;
  }
}

// ---- the saved statistics ----

// lse and D from the saved fp16 out / fp32 lse (what the kernels use) against lse and D
// recomputed exactly: out was rounded to the dtype, so D_i moves by up to about |dout_i| |out_i|
// 2^-11 and every gradient term with it; nothing else differs.
TEST(ReferenceBwdStatistics, SavedAndRecomputedAgreeUpToTheRoundingOfOut) {
  FwdCase s = tiny(4, 2, 33, 47, 21);
  s.head_dim = 64;
  s.causal = true;
  s.alibi = AlibiKind::kPerHead;
  BackwardCase c(s);
  const BwdProblem problem = c.bwd_problem();
  const Gradients saved =
      run_reference_bwd(problem, s, RefPrecision::kExact, BwdStatistics::kFromForward);
  const Gradients recomputed =
      run_reference_bwd(problem, s, RefPrecision::kExact, BwdStatistics::kRecompute);
  const std::pair<const std::vector<float>*, const std::vector<float>*> pairs[] = {
      {&saved.dq, &recomputed.dq}, {&saved.dk, &recomputed.dk}, {&saved.dv, &recomputed.dv}};
  for (const auto& [a, b] : pairs) {
    double max_diff = 0, max_value = 0;
    for (size_t n = 0; n < a->size(); ++n) {
      max_diff = std::max(max_diff, std::fabs(static_cast<double>((*a)[n]) - (*b)[n]));
      max_value = std::max(max_value, std::fabs(static_cast<double>((*b)[n])));
    }
    EXPECT_LT(max_diff, 5e-3 * max_value);
  }
  // dv depends on P alone, which the saved fp32 lse reproduces to fp32 precision.
  for (size_t n = 0; n < saved.dv.size(); ++n) {
    ASSERT_NEAR(saved.dv[n], recomputed.dv[n], 1e-5 * (1 + std::fabs(recomputed.dv[n]))) << n;
  }
}

// ---- precision modes ----

TEST(ReferenceBwdPrecision, InputDtypeModeDiffersFromExactByAPlausibleAmount) {
  for (DType dtype : {DType::kFloat16, DType::kBFloat16}) {
    FwdCase s = tiny(4, 2, 65, 97, 3);
    s.dtype = dtype;
    s.head_dim = 64;
    s.causal = true;
    s.softcap = 8.0f;
    s.alibi = AlibiKind::kPerHead;
    BackwardCase c(s);
    const BwdProblem problem = c.bwd_problem();
    const Gradients exact =
        run_reference_bwd(problem, s, RefPrecision::kExact, BwdStatistics::kFromForward);
    const Gradients low =
        run_reference_bwd(problem, s, RefPrecision::kInputDtype, BwdStatistics::kFromForward);
    SCOPED_TRACE(dtype_name(dtype));
    const std::pair<const std::vector<float>*, const std::vector<float>*> pairs[] = {
        {&exact.dq, &low.dq}, {&exact.dk, &low.dk}, {&exact.dv, &low.dv}};
    for (const auto& [e, l] : pairs) {
      double max_diff = 0, max_value = 0;
      for (size_t n = 0; n < e->size(); ++n) {
        max_diff = std::max(max_diff, std::fabs(static_cast<double>((*l)[n]) - (*e)[n]));
        max_value = std::max(max_value, std::fabs(static_cast<double>((*e)[n])));
      }
      EXPECT_GT(max_diff / max_value, 1e-5);
      EXPECT_LT(max_diff / max_value, 5e-2);
    }
  }
}

// ---- rows and keys without gradient ----

// Causal with s_q > s_k: the first rows see no key (lse -inf): their dq is exactly zero. Window
// (0, 0) with s_q < s_k: the first keys are seen by no row: their dk and dv are exactly zero.
TEST(ReferenceBwdEmpty, RowsWithoutKeysAndKeysWithoutRowsGetZeroGradients) {
  {
    FwdCase s = tiny(2, 1, 8, 3, 31);
    s.causal = true;
    BackwardCase c(s);
    const Gradients g =
        run_reference_bwd(c.bwd_problem(), s, RefPrecision::kExact, BwdStatistics::kFromForward);
    for (int b = 0; b < s.batch; ++b) {
      for (int h = 0; h < s.heads_q; ++h) {
        for (int i = 0; i < 8; ++i) {
          for (int e = 0; e < s.head_dim; ++e) {
            const float x = g.dq[c.q_index(b * 8 + i, h, e)];
            ASSERT_FALSE(std::isnan(x));
            if (i < 5) {
              ASSERT_EQ(x, 0.0f) << "row " << i << " sees no key";
            }
          }
        }
      }
    }
  }
  {
    FwdCase s = tiny(2, 2, 3, 7, 32);
    s.window_left = 0;
    s.window_right = 0;
    BackwardCase c(s);
    const Gradients g =
        run_reference_bwd(c.bwd_problem(), s, RefPrecision::kExact, BwdStatistics::kFromForward);
    for (int b = 0; b < s.batch; ++b) {
      for (int j = 0; j < 4; ++j) {  // keys 0..3: row i sees key i + 4 only
        for (int e = 0; e < s.head_dim; ++e) {
          ASSERT_EQ(g.dk[c.k_index(b * 7 + j, 0, e)], 0.0f);
          ASSERT_EQ(g.dv[c.k_index(b * 7 + j, 1, e)], 0.0f);
        }
      }
    }
  }
}

// seqlen_k == 0: every dq row is zero; seqlen_q == 0: every dk / dv row is zero.
TEST(ReferenceBwdEmpty, NoKeysOrNoQueriesGiveZeroGradients) {
  for (const auto& [sq, sk] : {std::pair{4, 0}, std::pair{0, 5}}) {
    BackwardCase c(tiny(2, 1, sq, sk, 33));
    mha_bwd(c.bwd_params());
    for (const std::vector<uint16_t>* grad : {&c.dq, &c.dk, &c.dv}) {
      for (uint16_t bits : *grad) ASSERT_EQ(bits_to_float(DType::kFloat16, bits), 0.0f);
    }
  }
}

// Keys past seqused_k are used by no query: their dk / dv rows are written, as zeros.
TEST(ReferenceBwdEmpty, KeysPastSequsedKGetZeroGradients) {
  FwdCase s = tiny_varlen({3, 2, 4}, {5, 4, 6}, 34);
  s.used_k = {2, 0, 6};
  s.tail_k = 2;
  BackwardCase c(s);
  mha_varlen_bwd(c.varlen_bwd_params());
  for (int b = 0; b < s.batch; ++b) {
    for (int j = 0; j < s.lens_k[b]; ++j) {
      for (int g = 0; g < s.heads_kv; ++g) {
        for (int e = 0; e < s.head_dim; ++e) {
          const float dk = bits_to_float(s.dtype, c.dk[c.k_index(s.start_k(b) + j, g, e)]);
          const float dv = bits_to_float(s.dtype, c.dv[c.k_index(s.start_k(b) + j, g, e)]);
          ASSERT_FALSE(std::isnan(dk) || std::isnan(dv)) << "b=" << b << " j=" << j;
          if (j >= s.used_k[b]) {
            ASSERT_TRUE(dk == 0.0f && dv == 0.0f) << "b=" << b << " j=" << j;
          }
        }
      }
    }
  }
  // The tail tokens after the last sequence keep their poison.
  for (int64_t n = s.start_k(s.batch) * s.heads_kv * s.head_dim; n < int64_t(c.dk.size()); ++n) {
    ASSERT_EQ(c.dk[n], nan_bits(s.dtype));
    ASSERT_EQ(c.dv[n], nan_bits(s.dtype));
  }
}

// ---- the public API on CPU views ----

// The API writes the gradients in the input dtype: each must be the fp32 oracle (kExact, saved
// statistics, exactly what the CPU backend computes) rounded to that dtype, within half an ulp.
void expect_api_matches_oracle(BackwardCase& c, const BwdProblem& validated) {
  const FwdCase& s = c.fwd_case();
  const Gradients oracle =
      run_reference_bwd(validated, s, RefPrecision::kExact, BwdStatistics::kFromForward);
  const double half_ulp = s.dtype == DType::kFloat16 ? std::ldexp(1.0, -11) : std::ldexp(1.0, -8);
  const std::pair<const std::vector<uint16_t>*, const std::vector<float>*> pairs[] = {
      {&c.dq, &oracle.dq}, {&c.dk, &oracle.dk}, {&c.dv, &oracle.dv}};
  for (const auto& [api, ref] : pairs) {
    for (size_t n = 0; n < api->size(); ++n) {
      const double expected = (*ref)[n];
      const double actual = bits_to_float(s.dtype, (*api)[n]);
      if (std::isnan(expected)) {
        ASSERT_TRUE(std::isnan(actual)) << n << ": a tail element was written";
        continue;
      }
      ASSERT_LE(std::fabs(actual - expected), half_ulp * std::fabs(expected) + 1e-7)
          << n << ": api " << actual << " oracle " << expected;
    }
  }
}

TEST(ReferenceBwdPublicApi, MhaBwdOnCpuViewsMatchesTheFp32Reference) {
  const int lengths[][2] = {{1, 1}, {17, 33}, {33, 17}, {3, 40}, {64, 64}};
  int n = 0;
  for (const auto& len : lengths) {
    for (int variant = 0; variant < 4; ++variant, ++n) {
      FwdCase s = tiny(n % 2 ? 6 : 4, n % 3 == 0 ? 1 : 2, len[0], len[1], 40 + n);
      s.dtype = n % 2 ? DType::kBFloat16 : DType::kFloat16;
      s.head_dim = 8 * (1 + n % 9);
      s.causal = variant == 1 || variant == 3;
      if (variant == 2) s.window_left = s.window_right = 3;
      if (variant == 3) s.alibi = AlibiKind::kPerBatchHead;
      if (n % 5 == 0) s.softcap = 5.0f;
      BackwardCase c(s);
      SCOPED_TRACE(s.describe());
      const MhaBwdParams params = c.bwd_params();
      mha_bwd(params);
      expect_api_matches_oracle(c, api::validate_mha_bwd(params));
      if (HasFatalFailure()) return;
    }
  }
}

TEST(ReferenceBwdPublicApi, MhaVarlenBwdOnCpuViewsMatchesTheFp32Reference) {
  for (int n = 0; n < 6; ++n) {
    FwdCase s = tiny_varlen({5, 0, 17, 1}, {9, 4, 30, 0}, 60 + n);
    s.dtype = n % 2 ? DType::kBFloat16 : DType::kFloat16;
    s.head_dim = 16 * (1 + n % 3);
    s.tail_q = n % 3;
    s.tail_k = 2;
    if (n % 2) s.used_k = {9, 0, 12, 0};
    s.causal = n % 3 == 1;
    if (n % 3 == 2) s.window_left = 4;
    if (n >= 3) s.alibi = AlibiKind::kPerHead;
    if (n == 4) s.softcap = 3.0f;
    BackwardCase c(s);
    SCOPED_TRACE(s.describe());
    const MhaVarlenBwdParams params = c.varlen_bwd_params();
    mha_varlen_bwd(params);
    expect_api_matches_oracle(c, api::validate_mha_varlen_bwd(params));
    if (HasFatalFailure()) return;
  }
}

// The same values behind padded, permuted strides (dout / dq stored [batch, heads, seqlen,
// dim + pad], dk / dv [seqlen, batch, heads, dim + pad]) give bit-identical gradients, and the
// padding is never written.
TEST(ReferenceBwdPublicApi, NonContiguousGradientsGiveTheSameResult) {
  FwdCase s = tiny(4, 2, 17, 23, 70);
  s.dtype = DType::kBFloat16;
  s.head_dim = 24;
  s.causal = true;
  s.alibi = AlibiKind::kPerHead;
  BackwardCase c(s);
  mha_bwd(c.bwd_params());

  const int64_t B = s.batch, H = s.heads_q, G = s.heads_kv, D = s.head_dim, SQ = s.seqlen_q,
                SK = s.seqlen_k, P = D + 5;
  const uint16_t poison = nan_bits(s.dtype);
  std::vector<uint16_t> dout(B * H * SQ * P, poison), dq(dout.size(), poison);
  std::vector<uint16_t> dk(SK * B * G * P, poison), dv(dk.size(), poison);
  for (int64_t b = 0; b < B; ++b) {
    for (int64_t i = 0; i < SQ; ++i) {
      for (int64_t h = 0; h < H; ++h) {
        for (int64_t e = 0; e < D; ++e) {
          dout[((b * H + h) * SQ + i) * P + e] = c.dout[c.q_index(b * SQ + i, h, e)];
        }
      }
    }
  }
  const Device cpu{};
  MhaBwdParams strided = c.bwd_params();
  strided.dout =
      make_strided_view(dout.data(), s.dtype, {B, SQ, H, D}, {H * SQ * P, P, SQ * P, 1}, cpu);
  strided.dq =
      make_strided_view(dq.data(), s.dtype, {B, SQ, H, D}, {H * SQ * P, P, SQ * P, 1}, cpu);
  strided.dk = make_strided_view(dk.data(), s.dtype, {B, SK, G, D}, {G * P, B * G * P, P, 1}, cpu);
  strided.dv = make_strided_view(dv.data(), s.dtype, {B, SK, G, D}, {G * P, B * G * P, P, 1}, cpu);
  mha_bwd(strided);

  for (int64_t b = 0; b < B; ++b) {
    for (int64_t e = 0; e < D; ++e) {
      for (int64_t h = 0; h < H; ++h) {
        for (int64_t i = 0; i < SQ; ++i) {
          ASSERT_EQ(dq[((b * H + h) * SQ + i) * P + e], c.dq[c.q_index(b * SQ + i, h, e)]);
        }
      }
      for (int64_t g = 0; g < G; ++g) {
        for (int64_t j = 0; j < SK; ++j) {
          ASSERT_EQ(dk[((j * B + b) * G + g) * P + e], c.dk[c.k_index(b * SK + j, g, e)]);
          ASSERT_EQ(dv[((j * B + b) * G + g) * P + e], c.dv[c.k_index(b * SK + j, g, e)]);
        }
      }
    }
  }
  for (const std::vector<uint16_t>* buffer : {&dq, &dk, &dv}) {
    for (size_t n = 0; n < buffer->size(); ++n) {
      if (static_cast<int64_t>(n) % P >= D) {
        ASSERT_EQ((*buffer)[n], poison) << n;
      }
    }
  }
}

// ---- what the reference refuses ----

TEST(ReferenceBwd, RejectsDropoutOutsideZeroOne) {
  BackwardCase c(tiny(2, 2, 3, 3, 80));
  BwdProblem p = c.bwd_problem();
  for (float prob : {1.0f, -0.25f}) {
    p.fwd.dropout_p = prob;
    EXPECT_THROW(cpu::reference_bwd(p), Error);
  }
}

}  // namespace
}  // namespace flashkit::test
