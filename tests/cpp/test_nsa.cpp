// tests/cpp/test_nsa.cpp
// \brief Native sparse attention's selection branch on the CPU: the reference against a naive
// oracle written straight from nsa_params.h (a dense boolean mask per sequence and kv head, then
// plain softmax attention in fp64) over nsa_rule_cases() and a random grid; the rules spelled out
// on tiny cases; the kInputDtype mode against a naive float emulation; the backward reference
// against finite differences of the forward; the public nsa_fwd / nsa_bwd on CPU views, layouts
// included; and every bad input through the public API.
//
// Views labelled DeviceKind::kCuda here point at host memory: every call that gets one is rejected
// by validation (or, in a build without CUDA, by dispatch) before any CUDA runtime call.
#include <gtest/gtest.h>

#include <algorithm>
#include <climits>
#include <cmath>
#include <cstdint>
#include <limits>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "api/validate_nsa.h"
#include "build_config.h"
#include "common/half_float.h"
#include "cpu/reference_nsa.h"
#include "expect_error.h"
#include "flashkit/flashkit.h"
#include "nsa_case.h"

namespace flashkit::test {
namespace {

using cpu::RefPrecision;

constexpr double kInf = std::numeric_limits<double>::infinity();
constexpr Device kCuda0{DeviceKind::kCuda, 0};

// ------------------------------------------------------------------------------------------------
// The naive oracle
// ------------------------------------------------------------------------------------------------

std::vector<char> dense_mask(const NsaHostCase& c, int b, int g) { return nsa_dense_mask(c.spec(), c.in, b, g); }

// out: [batch, heads_q, seqlen_q, head_dim], lse: [batch, heads_q, seqlen_q], as the fp32 oracle.
struct NaiveResult {
  std::vector<double> out;
  std::vector<double> lse;
};

// Plain softmax attention of every query row over the keys its mask allows. T = double: the exact
// oracle. T = float: an emulation of plain framework code in the input dtype (fp32 dot products
// rounded to the dtype, fp32 softmax, probabilities and outputs rounded to the dtype), independent
// of the reference's kInputDtype mode.
template <typename T>
NaiveResult naive_nsa(const NsaHostCase& c) {
  const NsaCase& s = c.spec();
  const bool emulate_input_dtype = std::is_same_v<T, float>;
  auto to_input_dtype = [&](T x) {
    return emulate_input_dtype ? static_cast<T>(round_to(s.dtype, static_cast<float>(x))) : x;
  };
  const int d = s.head_dim;
  NaiveResult r{std::vector<double>(static_cast<size_t>(s.lse_elements()) * d, std::nan("")),
                std::vector<double>(static_cast<size_t>(s.lse_elements()), std::nan(""))};
  std::vector<T> scores(s.seqlen_k);
  for (int b = 0; b < s.batch; ++b) {
    for (int g = 0; g < s.heads_kv; ++g) {
      const std::vector<char> mask = dense_mask(c, b, g);
      for (int h = g * s.group(); h < (g + 1) * s.group(); ++h) {
        for (int i = 0; i < s.seqlen_q; ++i) {
          const char* allowed = &mask[static_cast<size_t>(i) * s.seqlen_k];
          const int64_t row = s.lse_offset(b, h, i);
          T max_score = -std::numeric_limits<T>::infinity();
          for (int j = 0; j < s.seqlen_k; ++j) {
            if (!allowed[j]) continue;
            T dot = 0;
            for (int e = 0; e < d; ++e) {
              dot += static_cast<T>(c.value(c.in.q, s.q_offset(b, i, h) + e)) *
                     static_cast<T>(c.value(c.in.k, s.kv_offset(b, j, g) + e));
            }
            scores[j] = to_input_dtype(dot) * static_cast<T>(s.resolved_scale());
            max_score = std::max(max_score, scores[j]);
          }
          if (max_score == -std::numeric_limits<T>::infinity()) {
            std::fill_n(&r.out[row * d], d, 0.0);
            r.lse[row] = -kInf;
            continue;
          }
          T sum = 0;
          for (int j = 0; j < s.seqlen_k; ++j) {
            if (allowed[j]) sum += std::exp(scores[j] - max_score);
          }
          std::vector<T> out_row(d, T(0));
          for (int j = 0; j < s.seqlen_k; ++j) {
            if (!allowed[j]) continue;
            const T prob = to_input_dtype(std::exp(scores[j] - max_score) / sum);
            for (int e = 0; e < d; ++e) {
              out_row[e] += prob * static_cast<T>(c.value(c.in.v, s.kv_offset(b, j, g) + e));
            }
          }
          for (int e = 0; e < d; ++e) r.out[row * d + e] = to_input_dtype(out_row[e]);
          r.lse[row] = max_score + std::log(sum);
        }
      }
    }
  }
  return r;
}

// ------------------------------------------------------------------------------------------------
// Running the reference, comparing
// ------------------------------------------------------------------------------------------------

struct Fp32Forward {
  std::vector<float> out;  // [batch, heads_q, seqlen_q, head_dim]
  std::vector<float> lse;  // [batch, heads_q, seqlen_q]
};

Fp32Forward reference_fwd_fp32(const NsaProblem& p, RefPrecision precision) {
  const size_t rows = static_cast<size_t>(p.batch) * p.heads_q * p.seqlen_q;
  Fp32Forward r{std::vector<float>(rows * p.head_dim, std::nanf("")),
                std::vector<float>(rows, std::nanf(""))};
  cpu::reference_nsa_fwd_fp32(p, precision, r.out.data(), r.lse.data());
  return r;
}

struct Fp32Gradients {
  std::vector<float> dq;  // [batch, seqlen_q, heads_q, head_dim]
  std::vector<float> dk;  // [batch, seqlen_k, heads_kv, head_dim]
  std::vector<float> dv;
};

Fp32Gradients reference_bwd_fp32(const NsaBwdProblem& problem, RefPrecision precision,
                                 bool recompute) {
  const NsaProblem& p = problem.fwd;
  const size_t q_size = static_cast<size_t>(p.batch) * p.seqlen_q * p.heads_q * p.head_dim;
  const size_t kv_size = static_cast<size_t>(p.batch) * p.seqlen_k * p.heads_kv * p.head_dim;
  Fp32Gradients g{std::vector<float>(q_size, std::nanf("")),
                  std::vector<float>(kv_size, std::nanf("")),
                  std::vector<float>(kv_size, std::nanf(""))};
  cpu::reference_nsa_bwd_fp32(problem, precision, recompute, g.dq.data(), g.dk.data(),
                              g.dv.data());
  return g;
}

// Index of (b, t, head, e) in the fp32 gradients' contiguous [batch, seqlen, heads, dim] layout.
int64_t dense_index(int b, int t, int head, int e, int seqlen, int heads, int head_dim) {
  return ((int64_t{b} * seqlen + t) * heads + head) * head_dim + e;
}

// NaN (never written) and -inf (no key) must match exactly; finite values up to
// |actual - expected| <= atol + rtol * |expected|.
template <typename Actual>
void expect_close(const std::vector<Actual>& actual, const std::vector<double>& expected,
                  double atol, double rtol, const char* what) {
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

// The largest |a - b| over two equally long arrays, and the largest |b|.
std::pair<double, double> max_diff_and_value(const std::vector<float>& a,
                                             const std::vector<float>& b) {
  double diff = 0, value = 0;
  for (size_t n = 0; n < a.size(); ++n) {
    diff = std::max(diff, std::fabs(static_cast<double>(a[n]) - b[n]));
    value = std::max(value, std::fabs(static_cast<double>(b[n])));
  }
  return {diff, value};
}

// The kExact reference against the fp64 naive oracle: only the final float rounding separates them.
void expect_reference_matches_naive(NsaHostCase& c) {
  const Fp32Forward r = reference_fwd_fp32(c.problem(), RefPrecision::kExact);
  const NaiveResult naive = naive_nsa<double>(c);
  expect_close(r.out, naive.out, 1e-6, 1e-6, "out");
  expect_close(r.lse, naive.lse, 1e-6, 1e-6, "lse");
}

// ------------------------------------------------------------------------------------------------
// The shared cases
// ------------------------------------------------------------------------------------------------

// nsa_rule_cases() claims to exercise every rule of nsa_params.h, and the GPU tests rely on it:
// count what its selections hold.
TEST(NsaCase, TheRuleCasesExerciseEveryRule) {
  int duplicates = 0, padding = 0, past_last_block = 0, large_negative = 0, future_blocks = 0,
      short_last_block = 0, empty_selections = 0, counts_below_zero = 0, counts_past_selected = 0,
      counts_inside = 0, causal_more_queries = 0, causal_fewer_queries = 0, heads_major = 0,
      strided_indices = 0, empty_problems = 0;
  std::vector<int> groups, head_dims, block_sizes;
  for (const NsaCase& s : nsa_rule_cases()) {
    NsaHostCase c(s);
    groups.push_back(s.group());
    head_dims.push_back(s.head_dim);
    block_sizes.push_back(s.block_size);
    heads_major += s.heads_major && s.dim_pad > 0;
    strided_indices += s.strided_indices;
    empty_problems += s.batch == 0 || s.seqlen_q == 0 || s.seqlen_k == 0;
    causal_more_queries += s.causal && s.seqlen_q > s.seqlen_k && s.seqlen_k > 0;
    causal_fewer_queries += s.causal && s.seqlen_q < s.seqlen_k;
    for (int b = 0; b < s.batch; ++b) {
      for (int i = 0; i < s.seqlen_q; ++i) {
        for (int g = 0; g < s.heads_kv; ++g) {
          int count = s.selected;
          if (s.counts != CountsKind::kNone) {
            const int stored = c.in.block_counts[s.count_offset(b, i, g)];
            counts_below_zero += stored < 0;
            counts_past_selected += stored > s.selected;
            counts_inside += stored > 0 && stored < s.selected;
            count = std::clamp(stored, 0, s.selected);
          }
          const int32_t* slots = &c.in.block_indices[s.index_offset(b, i, g)];
          const int64_t last_key = s.causal ? int64_t{i} + s.seqlen_k - s.seqlen_q : s.seqlen_k - 1;
          bool any_valid = false;
          for (int n = 0; n < count; ++n) {
            const int block = slots[n];
            padding += block == -1;
            large_negative += block < -1;
            past_last_block += block >= s.num_key_blocks();
            if (block < 0 || block >= s.num_key_blocks()) continue;
            any_valid = true;
            duplicates += std::find(slots, slots + n, block) != slots + n;
            future_blocks += s.causal && int64_t{block} * s.block_size > last_key;
            short_last_block += s.seqlen_k % s.block_size != 0 && block == s.num_key_blocks() - 1;
          }
          empty_selections += !any_valid;
        }
      }
    }
  }
  for (int count : {duplicates, padding, past_last_block, large_negative, future_blocks,
                    short_last_block, empty_selections, counts_below_zero, counts_past_selected,
                    counts_inside, causal_more_queries, causal_fewer_queries, heads_major,
                    strided_indices, empty_problems}) {
    EXPECT_GT(count, 0);
  }
  for (int group : {1, 4, 16, 32}) {
    EXPECT_NE(std::find(groups.begin(), groups.end(), group), groups.end()) << "group " << group;
  }
  for (int head_dim : {40, 64, 96, 128, 256}) {
    EXPECT_NE(std::find(head_dims.begin(), head_dims.end(), head_dim), head_dims.end())
        << "head dim " << head_dim;
  }
  for (int block_size : {16, 256}) {
    EXPECT_NE(std::find(block_sizes.begin(), block_sizes.end(), block_size), block_sizes.end())
        << "block size " << block_size;
  }
}

// ------------------------------------------------------------------------------------------------
// The reference against the naive oracle
// ------------------------------------------------------------------------------------------------

TEST(NsaReferenceVsNaive, EveryRuleCase) {
  for (const NsaCase& s : nsa_rule_cases()) {
    SCOPED_TRACE(s.describe());
    NsaHostCase c(s);
    expect_reference_matches_naive(c);
    if (HasFatalFailure()) return;
  }
}

// A case with everything drawn from `rng`; sizes kept small (the oracle is quadratic).
NsaCase random_case(Rng& rng, int n) {
  static const std::vector<int> kHeadDims = {40, 64, 96, 128, 256};
  static const std::vector<int> kGroups = {1, 4, 16, 32};
  static const std::vector<int> kBlockSizes = {16, 32, 48, 64, 128};
  NsaCase s;
  s.name = "random";
  s.dtype = n % 2 ? DType::kFloat16 : DType::kBFloat16;
  s.batch = rng.uniform_int(1, 2);
  const int group = rng.pick(kGroups);
  s.heads_kv = group >= 16 ? 1 : rng.uniform_int(1, 2);
  s.heads_q = s.heads_kv * group;
  s.head_dim = rng.pick(kHeadDims);
  s.block_size = rng.pick(kBlockSizes);
  s.seqlen_q = rng.uniform_int(1, group >= 16 ? 12 : 40);
  s.seqlen_k = rng.uniform_int(1, 200);
  s.selected = rng.uniform_int(1, 8);
  s.causal = rng.chance(0.5);
  s.own_block_first = rng.chance(0.7);
  s.mix = {rng.chance(0.5) ? 0.2 : 0.0, rng.chance(0.5) ? 0.2 : 0.0, rng.chance(0.5) ? 0.2 : 0.0};
  s.counts = static_cast<CountsKind>(rng.uniform_int(0, 2));
  if (rng.chance(0.3)) s.empty_token = rng.uniform_int(0, s.seqlen_q - 1);
  s.heads_major = rng.chance(0.3);
  s.dim_pad = rng.chance(0.3) ? 8 : 0;
  s.strided_indices = rng.chance(0.3);
  if (rng.chance(0.3)) s.softmax_scale = static_cast<float>(0.05 + 0.4 * rng.uniform01());
  s.seed = 1000 + n;
  return s;
}

TEST(NsaReferenceVsNaive, RandomCases) {
  Rng rng(20250101);
  for (int n = 0; n < 24; ++n) {
    const NsaCase s = random_case(rng, n);
    SCOPED_TRACE(s.describe());
    NsaHostCase c(s);
    expect_reference_matches_naive(c);
    if (HasFatalFailure()) return;
  }
}

// A long sequence as NSA runs it: 1025 tokens (seqlen_k not a multiple of block_size), 16 blocks
// of 64, causal, the local block always selected.
TEST(NsaReferenceVsNaive, LongCausalSequence) {
  NsaCase s;
  s.name = "long";
  s.dtype = DType::kBFloat16;
  s.heads_q = 4;
  s.heads_kv = 1;
  s.head_dim = 64;
  s.seqlen_q = s.seqlen_k = 1025;
  s.block_size = 64;
  s.selected = 16;
  s.causal = true;
  s.seed = 77;
  NsaHostCase c(s);
  expect_reference_matches_naive(c);
}

// ------------------------------------------------------------------------------------------------
// The rules, spelled out on tiny cases
// ------------------------------------------------------------------------------------------------

// 1 sequence, 2 query heads over 1 kv head, head dim 16, 8 queries, 70 keys in 5 blocks of 16
// (the last one holds 6), 4 slots, no causal, no counts: the tests write the slots themselves.
NsaCase tiny_case() {
  NsaCase s;
  s.name = "tiny";
  s.dtype = DType::kFloat16;
  s.batch = 1;
  s.heads_q = 2;
  s.heads_kv = 1;
  s.head_dim = 16;
  s.seqlen_q = 8;
  s.seqlen_k = 70;
  s.block_size = 16;
  s.selected = 4;
  s.seed = 5;
  return s;
}

void set_slots(NsaHostCase& c, int i, std::initializer_list<int> slots) {
  std::copy(slots.begin(), slots.end(), &c.in.block_indices[c.spec().index_offset(0, i, 0)]);
}

// The slots name a set: order, repeats, -1 padding and out-of-range entries (past the last block,
// large negatives) change nothing, bit for bit.
TEST(NsaSemantics, TheSelectionIsASetOfValidBlocks) {
  NsaHostCase plain(tiny_case());
  NsaHostCase noisy(tiny_case());
  for (int i = 0; i < 8; ++i) {
    set_slots(plain, i, {1, 4, -1, -1});
    const int rotations[][4] = {{4, 1, 4, -1}, {-1, 1, 5, 4}, {INT_MIN, 4, 1, 1}, {4, 99, 1, -7}};
    const int* r = rotations[i % 4];
    set_slots(noisy, i, {r[0], r[1], r[2], r[3]});
  }
  nsa_fwd(plain.fwd_params());
  nsa_fwd(noisy.fwd_params());
  EXPECT_EQ(plain.out, noisy.out);
  EXPECT_EQ(plain.lse, noisy.lse);
  // And the set is what the naive oracle sees: keys 16..31 and 64..69 (the short last block).
  const NaiveResult naive = naive_nsa<double>(plain);
  expect_close(plain.lse, naive.lse, 1e-6, 1e-6, "lse");
}

// block_counts clamps to [0, selected]: counts past selected use every slot, 0 and negative counts
// none (a zero row, lse -inf), and slots past the count are never read.
TEST(NsaSemantics, BlockCountsAreClampedToZeroAndSelected) {
  NsaCase s = tiny_case();
  s.counts = CountsKind::kInRange;
  NsaHostCase counted(s);
  NsaHostCase all(tiny_case()), first_two(tiny_case()), first_one(tiny_case());
  const int counts[] = {4, 5, INT_MAX, 0, -1, INT_MIN, 2, 1};
  for (int i = 0; i < 8; ++i) {
    set_slots(counted, i, {0, 3, 2, 1});
    counted.in.block_counts[s.count_offset(0, i, 0)] = counts[i];
    set_slots(all, i, {0, 3, 2, 1});
    set_slots(first_two, i, {0, 3, -1, -1});
    set_slots(first_one, i, {0, -1, -1, -1});
  }
  for (NsaHostCase* c : {&counted, &all, &first_two, &first_one}) nsa_fwd(c->fwd_params());
  for (int i = 0; i < 8; ++i) {
    SCOPED_TRACE("token " + std::to_string(i) + ", count " + std::to_string(counts[i]));
    const NsaHostCase* expected = counts[i] >= 4   ? &all
                                  : counts[i] == 2 ? &first_two
                                  : counts[i] == 1 ? &first_one
                                                   : nullptr;  // clamped to 0: nothing selected
    for (int h = 0; h < s.heads_q; ++h) {
      const float lse = counted.lse[s.lse_offset(0, h, i)];
      const int64_t row = s.q_offset(0, i, h);
      if (expected == nullptr) {
        EXPECT_EQ(lse, -std::numeric_limits<float>::infinity());
        for (int e = 0; e < s.head_dim; ++e) EXPECT_EQ(counted.value(counted.out, row + e), 0.0f);
      } else {
        EXPECT_EQ(lse, expected->lse[s.lse_offset(0, h, i)]);
        EXPECT_TRUE(std::equal(&counted.out[row], &counted.out[row] + s.head_dim,
                               &expected->out[row]));
      }
    }
  }
}

// One block alone is dense attention over its keys: with block 4 = keys 64..69 and causal off,
// lse is the log-sum-exp of those six scores.
TEST(NsaSemantics, OneBlockIsDenseAttentionOverItsKeys) {
  NsaHostCase c(tiny_case());
  for (int i = 0; i < 8; ++i) set_slots(c, i, {4, -1, -1, -1});
  nsa_fwd(c.fwd_params());
  const NsaCase& s = c.spec();
  for (int i = 0; i < 8; ++i) {
    for (int h = 0; h < 2; ++h) {
      double scores[6], max_score = -kInf;
      for (int j = 64; j < 70; ++j) {
        double dot = 0;
        for (int e = 0; e < 16; ++e) {
          dot += double{c.value(c.in.q, s.q_offset(0, i, h) + e)} *
                 c.value(c.in.k, s.kv_offset(0, j, 0) + e);
        }
        scores[j - 64] = dot * s.resolved_scale();
        max_score = std::max(max_score, scores[j - 64]);
      }
      double sum = 0;
      for (double x : scores) sum += std::exp(x - max_score);
      EXPECT_FLOAT_EQ(c.lse[s.lse_offset(0, h, i)], static_cast<float>(max_score + std::log(sum)));
    }
  }
}

// Causal, bottom-right aligned: with 8 queries and 70 keys, token i sees keys j <= i + 62. A token
// that selects only block 4 (keys 64..69) sees keys 64..i + 62: none for i < 2 (zero row, -inf),
// key 64 alone for i = 2, then one more per token.
TEST(NsaSemantics, CausalCutsBlocksAtTheBottomRightDiagonal) {
  NsaCase s = tiny_case();
  s.causal = true;
  NsaHostCase c(s);
  for (int i = 0; i < 8; ++i) set_slots(c, i, {4, -1, -1, -1});
  nsa_fwd(c.fwd_params());
  for (int h = 0; h < 2; ++h) {
    for (int i = 0; i < 2; ++i) {
      EXPECT_EQ(c.lse[s.lse_offset(0, h, i)], -std::numeric_limits<float>::infinity());
      for (int e = 0; e < 16; ++e) EXPECT_EQ(c.value(c.out, s.q_offset(0, i, h) + e), 0.0f);
    }
    // Token 2 sees key 64 alone: out is v_64, exactly (one probability of 1).
    for (int e = 0; e < 16; ++e) {
      EXPECT_EQ(c.value(c.out, s.q_offset(0, 2, h) + e),
                c.value(c.in.v, s.kv_offset(0, 64, 0) + e));
    }
  }
  const NaiveResult naive = naive_nsa<double>(c);
  expect_close(c.lse, naive.lse, 1e-6, 1e-6, "lse");
}

// ------------------------------------------------------------------------------------------------
// Precision modes
// ------------------------------------------------------------------------------------------------

// kInputDtype against the naive float emulation: both sum in the same order (keys ascending), so
// every element is within one ulp of the dtype and nearly all are equal.
TEST(NsaPrecision, InputDtypeModeMatchesANaiveEmulation) {
  for (const NsaCase& s : nsa_rule_cases()) {
    SCOPED_TRACE(s.describe());
    NsaHostCase c(s);
    const Fp32Forward r = reference_fwd_fp32(c.problem(), RefPrecision::kInputDtype);
    const NaiveResult naive = naive_nsa<float>(c);
    const double ulp = s.dtype == DType::kFloat16 ? std::ldexp(1.0, -10) : std::ldexp(1.0, -7);
    expect_close(r.out, naive.out, 1e-6, ulp, "out");
    expect_close(r.lse, naive.lse, 1e-6, 1e-6, "lse");
    size_t equal = 0;
    for (size_t n = 0; n < r.out.size(); ++n) equal += r.out[n] == naive.out[n];
    EXPECT_GE(equal, r.out.size() * 99 / 100);
    if (HasFatalFailure()) return;
  }
}

// kInputDtype rounds scores, probabilities and outputs (and the backward's intermediates): it must
// differ from kExact, by what that rounding explains.
TEST(NsaPrecision, InputDtypeModeDiffersFromExactByAPlausibleAmount) {
  for (DType dtype : {DType::kFloat16, DType::kBFloat16}) {
    SCOPED_TRACE(dtype_name(dtype));
    NsaCase s;
    s.dtype = dtype;
    s.batch = 2;
    s.heads_q = 8;
    s.heads_kv = 2;
    s.head_dim = 64;
    s.seqlen_q = 65;
    s.seqlen_k = 150;
    s.block_size = 16;
    s.selected = 6;
    s.causal = true;
    s.seed = 3;
    NsaHostCase c(s);
    const NsaProblem p = c.problem();
    const Fp32Forward exact = reference_fwd_fp32(p, RefPrecision::kExact);
    const Fp32Forward low = reference_fwd_fp32(p, RefPrecision::kInputDtype);
    const auto [out_diff, out_max] = max_diff_and_value(low.out, exact.out);
    EXPECT_GT(out_diff / out_max, 1e-5);
    EXPECT_LT(out_diff / out_max, 2e-2);
    const double lse_diff = max_diff_and_value(low.lse, exact.lse).first;
    EXPECT_GT(lse_diff, 0.0);
    EXPECT_LT(lse_diff, 0.1);

    nsa_fwd(c.fwd_params());
    const NsaBwdProblem problem = c.bwd_problem();
    const Fp32Gradients g_exact = reference_bwd_fp32(problem, RefPrecision::kExact, false);
    const Fp32Gradients g_low = reference_bwd_fp32(problem, RefPrecision::kInputDtype, false);
    const std::pair<const std::vector<float>*, const std::vector<float>*> pairs[] = {
        {&g_low.dq, &g_exact.dq}, {&g_low.dk, &g_exact.dk}, {&g_low.dv, &g_exact.dv}};
    for (const auto& [l, e] : pairs) {
      const auto [diff, value] = max_diff_and_value(*l, *e);
      EXPECT_GT(diff / value, 1e-5);
      EXPECT_LT(diff / value, 5e-2);
    }
  }
}

// ------------------------------------------------------------------------------------------------
// The backward reference against finite differences
// ------------------------------------------------------------------------------------------------

// sum_{b, i, h, e} dout * out of the reference forward (kExact) at the case's current inputs.
double loss(const NsaHostCase& c, const NsaProblem& p) {
  const NsaCase& s = c.spec();
  const Fp32Forward r = reference_fwd_fp32(p, RefPrecision::kExact);
  double sum = 0;
  for (int b = 0; b < s.batch; ++b) {
    for (int h = 0; h < s.heads_q; ++h) {
      for (int i = 0; i < s.seqlen_q; ++i) {
        const float* row = &r.out[s.lse_offset(b, h, i) * s.head_dim];
        for (int e = 0; e < s.head_dim; ++e) {
          sum += double{c.value(c.in.dout, s.q_offset(b, i, h) + e)} * row[e];
        }
      }
    }
  }
  return sum;
}

// The representable value of `dtype` nearest x + direction * 2^-8 that differs from x (a larger
// step where 2^-8 is below half an ulp of x).
float neighbour(DType dtype, float x, float direction) {
  for (float step = std::ldexp(1.0f, -8);; step *= 2) {
    const float y = round_to(dtype, x + direction * step);
    if (y != x) return y;
  }
}

// d loss / d x for the 16-bit input element `bits`. The inputs can only hold dtype values, so the
// two steps (up to x + h_up, down to x - h_down) may differ; the three-point central difference
// for unequal steps, (h_down^2 (f+ - f0) + h_up^2 (f0 - f-)) / (h_up h_down (h_up + h_down)),
// keeps second-order accuracy either way (and is (f+ - f-) / 2h when they are equal).
double central_difference(NsaHostCase& c, const NsaProblem& p, uint16_t& bits, double f0) {
  const DType dtype = c.spec().dtype;
  const uint16_t saved = bits;
  const float x = bits_to_float(dtype, saved);
  const float up = neighbour(dtype, x, 1.0f), down = neighbour(dtype, x, -1.0f);
  bits = float_to_bits(dtype, up);
  const double f_up = loss(c, p);
  bits = float_to_bits(dtype, down);
  const double f_down = loss(c, p);
  bits = saved;
  const double h_up = double{up} - x, h_down = double{x} - down;
  return (h_down * h_down * (f_up - f0) + h_up * h_up * (f0 - f_down)) /
         (h_up * h_down * (h_up + h_down));
}

// Every element of q, k and v: the backward reference (kExact, statistics recomputed, so that it
// is the gradient of the function differentiated here) against the finite difference, within
// 5e-4 of the largest gradient (as test_reference_bwd.cpp): a wrong term is off by O(1).
void expect_gradients_match_finite_differences(NsaHostCase& c) {
  const NsaCase& s = c.spec();
  const NsaBwdProblem problem = c.bwd_problem();
  const Fp32Gradients g = reference_bwd_fp32(problem, RefPrecision::kExact, true);
  double max_grad = 1.0;
  for (const std::vector<float>* grad : {&g.dq, &g.dk, &g.dv}) {
    for (float x : *grad) {
      ASSERT_TRUE(std::isfinite(x));
      max_grad = std::max(max_grad, std::fabs(static_cast<double>(x)));
    }
  }
  const double tolerance = 5e-4 * max_grad;
  const double f0 = loss(c, problem.fwd);
  struct Input {
    const char* name;
    std::vector<uint16_t>& values;
    const std::vector<float>& grad;
    int seqlen;
    int heads;
  } inputs[] = {{"dq", c.in.q, g.dq, s.seqlen_q, s.heads_q},
                {"dk", c.in.k, g.dk, s.seqlen_k, s.heads_kv},
                {"dv", c.in.v, g.dv, s.seqlen_k, s.heads_kv}};
  for (const Input& input : inputs) {
    const NsaCase::Strides st = s.tensor_strides(input.seqlen, input.heads);
    for (int b = 0; b < s.batch; ++b) {
      for (int t = 0; t < input.seqlen; ++t) {
        for (int h = 0; h < input.heads; ++h) {
          for (int e = 0; e < s.head_dim; ++e) {
            uint16_t& bits = input.values[b * st.batch + t * st.row + h * st.head + e];
            const double numeric = central_difference(c, problem.fwd, bits, f0);
            const double analytic =
                input.grad[dense_index(b, t, h, e, input.seqlen, input.heads, s.head_dim)];
            ASSERT_LE(std::fabs(numeric - analytic), tolerance)
                << input.name << " b=" << b << " token=" << t << " head=" << h << " e=" << e
                << ": reference " << analytic << ", finite difference " << numeric;
          }
        }
      }
    }
  }
}

// fp16 (finer steps than bf16), head dim 8, a few dozen keys: every element is differentiated.
NsaCase fd_case(const char* name, int heads_q, int heads_kv, int seqlen_q, int seqlen_k,
                uint64_t seed) {
  NsaCase s;
  s.name = name;
  s.dtype = DType::kFloat16;
  s.batch = 2;
  s.heads_q = heads_q;
  s.heads_kv = heads_kv;
  s.head_dim = 8;
  s.seqlen_q = seqlen_q;
  s.seqlen_k = seqlen_k;
  s.block_size = 16;
  s.selected = 3;
  s.seed = seed;
  return s;
}

TEST(NsaReferenceBwdFiniteDifferences, EveryRule) {
  std::vector<NsaCase> cases;
  {
    NsaCase s = fd_case("mha_duplicates_padding", 2, 2, 5, 40, 1);
    s.own_block_first = false;
    s.mix = {0.3, 0.3, 0.0};
    cases.push_back(s);
  }
  {
    NsaCase s = fd_case("causal_gqa_counts", 4, 2, 6, 37, 2);
    s.causal = true;
    s.counts = CountsKind::kMixed;
    cases.push_back(s);
  }
  {
    NsaCase s = fd_case("more_queries_than_keys", 2, 1, 24, 20, 3);  // tokens 0..3 see nothing
    s.causal = true;
    s.empty_token = 10;
    cases.push_back(s);
  }
  {
    NsaCase s = fd_case("strided_scale_out_of_range", 4, 1, 5, 33, 4);
    s.heads_major = true;
    s.dim_pad = 8;
    s.strided_indices = true;
    s.mix = {0.1, 0.1, 0.3};
    s.softmax_scale = 0.5f;
    s.q_scale = 2.0f;
    cases.push_back(s);
  }
  for (const NsaCase& s : cases) {
    SCOPED_TRACE(s.describe());
    NsaHostCase c(s);
    expect_gradients_match_finite_differences(c);
    if (HasFatalFailure()) return;
  }
}

// lse and D from the saved out / lse (what the kernels use) against recomputed ones: out was
// rounded to fp16, so D moves by about |dout| |out| 2^-11 and dq / dk with it; dv depends on P
// alone, which the saved fp32 lse reproduces to fp32 precision.
TEST(NsaReferenceBwd, SavedAndRecomputedStatisticsAgreeUpToTheRoundingOfOut) {
  NsaCase s = fd_case("statistics", 8, 2, 33, 90, 21);
  s.head_dim = 64;
  s.causal = true;
  s.counts = CountsKind::kMixed;
  s.mix = {0.2, 0.2, 0.2};
  NsaHostCase c(s);
  nsa_fwd(c.fwd_params());
  const NsaBwdProblem problem = c.bwd_problem();
  const Fp32Gradients saved = reference_bwd_fp32(problem, RefPrecision::kExact, false);
  const Fp32Gradients recomputed = reference_bwd_fp32(problem, RefPrecision::kExact, true);
  const std::pair<const std::vector<float>*, const std::vector<float>*> pairs[] = {
      {&saved.dq, &recomputed.dq}, {&saved.dk, &recomputed.dk}, {&saved.dv, &recomputed.dv}};
  for (const auto& [a, b] : pairs) {
    const auto [diff, value] = max_diff_and_value(*a, *b);
    EXPECT_LT(diff, 5e-3 * value);
  }
  for (size_t n = 0; n < saved.dv.size(); ++n) {
    ASSERT_NEAR(saved.dv[n], recomputed.dv[n], 1e-5 * (1 + std::fabs(recomputed.dv[n]))) << n;
  }
}

// The saved path reads what the forward saved: lse raised by ln 2 halves every P, so dv halves;
// out zeroed makes D_i = 0, which moves dq and dk but not dv (P alone).
TEST(NsaReferenceBwd, TheSavedPathReadsTheSavedLseAndOut) {
  NsaCase s = fd_case("saved", 4, 2, 17, 70, 22);
  s.head_dim = 32;
  s.causal = true;
  NsaHostCase c(s);
  nsa_fwd(c.fwd_params());
  const NsaBwdProblem problem = c.bwd_problem();
  const Fp32Gradients base = reference_bwd_fp32(problem, RefPrecision::kExact, false);

  const std::vector<float> saved_lse = c.lse;
  for (float& x : c.lse) x += static_cast<float>(std::log(2.0));
  const Fp32Gradients half = reference_bwd_fp32(problem, RefPrecision::kExact, false);
  for (size_t n = 0; n < base.dv.size(); ++n) {
    ASSERT_NEAR(half.dv[n], 0.5f * base.dv[n], 1e-5 * (1 + std::fabs(base.dv[n]))) << n;
  }
  c.lse = saved_lse;

  std::fill(c.out.begin(), c.out.end(), uint16_t{0});
  const Fp32Gradients no_d = reference_bwd_fp32(problem, RefPrecision::kExact, false);
  EXPECT_EQ(no_d.dv, base.dv);
  EXPECT_GT(max_diff_and_value(no_d.dq, base.dq).first, 1e-3);
  EXPECT_GT(max_diff_and_value(no_d.dk, base.dk).first, 1e-3);
}

// Tokens that see no key get dq = 0 exactly; keys that no token selects (or that causal hides from
// every token that selects them) get dk = dv = 0 exactly. Every element is written.
TEST(NsaReferenceBwd, RowsWithoutKeysAndUnseenKeysGetZeroGradients) {
  NsaCase s = fd_case("zeros", 4, 2, 12, 60, 31);
  s.head_dim = 16;
  s.causal = true;
  s.empty_token = 9;
  NsaHostCase c(s);
  // Sequence 0 selects blocks 0 and 3 only, sequence 1 block 2 only; token 9 selects nothing.
  // Token i sees keys j <= i + 48, so every key of those blocks is seen (key 59 by token 11).
  for (int b = 0; b < 2; ++b) {
    for (int i = 0; i < 12; ++i) {
      for (int g = 0; g < 2; ++g) {
        int32_t* slots = &c.in.block_indices[s.index_offset(b, i, g)];
        slots[0] = b == 0 ? 0 : 2;
        slots[1] = b == 0 ? 3 : -1;
        slots[2] = -1;
        if (i == 9) slots[0] = slots[1] = -1;
      }
    }
  }
  nsa_fwd(c.fwd_params());
  nsa_bwd(c.bwd_params());
  auto seen = [&](int b, int j) {
    const int block = j / 16;
    return b == 0 ? (block == 0 || block == 3) : block == 2;
  };
  for (int b = 0; b < 2; ++b) {
    for (int g = 0; g < 2; ++g) {
      for (int j = 0; j < 60; ++j) {
        for (int e = 0; e < 16; ++e) {
          const float dk = c.value(c.dk, s.kv_offset(b, j, g) + e);
          const float dv = c.value(c.dv, s.kv_offset(b, j, g) + e);
          ASSERT_FALSE(std::isnan(dk) || std::isnan(dv)) << "b=" << b << " j=" << j;
          if (!seen(b, j)) {
            ASSERT_TRUE(dk == 0.0f && dv == 0.0f) << "b=" << b << " j=" << j;
          } else {
            ASSERT_NE(dv, 0.0f) << "b=" << b << " j=" << j;
          }
        }
      }
    }
    for (int h = 0; h < 4; ++h) {
      for (int i = 0; i < 12; ++i) {
        for (int e = 0; e < 16; ++e) {
          const float dq = c.value(c.dq, s.q_offset(b, i, h) + e);
          ASSERT_FALSE(std::isnan(dq));
          if (i == 9) {
            ASSERT_EQ(dq, 0.0f) << "the empty token, b=" << b;
          }
        }
      }
    }
  }
}

// ------------------------------------------------------------------------------------------------
// The public API on CPU views
// ------------------------------------------------------------------------------------------------

// The 16-bit buffer `api` (stored as the case lays out a [batch, seqlen, heads, dim] tensor) holds
// the fp32 oracle `oracle` rounded to the dtype: within half an ulp (both round the same fp64
// value), and the padding of every row keeps its poison.
void expect_rounded_from(const NsaHostCase& c, const std::vector<uint16_t>& api, int seqlen,
                         int heads, const std::vector<float>& oracle, bool oracle_heads_major,
                         const char* what) {
  const NsaCase& s = c.spec();
  const double half_ulp = s.dtype == DType::kFloat16 ? std::ldexp(1.0, -11) : std::ldexp(1.0, -8);
  const NsaCase::Strides st = s.tensor_strides(seqlen, heads);
  for (int b = 0; b < s.batch; ++b) {
    for (int t = 0; t < seqlen; ++t) {
      for (int h = 0; h < heads; ++h) {
        const int64_t first = b * st.batch + t * st.row + h * st.head;
        const int64_t oracle_row =
            oracle_heads_major ? (int64_t{b} * heads + h) * seqlen + t
                               : (int64_t{b} * seqlen + t) * heads + h;
        for (int e = 0; e < s.head_dim; ++e) {
          const double expected = oracle[oracle_row * s.head_dim + e];
          const double actual = c.value(api, first + e);
          ASSERT_LE(std::fabs(actual - expected), half_ulp * std::fabs(expected) + 1e-7)
              << what << " b=" << b << " token=" << t << " head=" << h << " e=" << e << ": api "
              << actual << ", oracle " << expected;
        }
        for (int e = s.head_dim; e < s.row_elements(); ++e) {
          ASSERT_EQ(api[first + e], nan_bits(s.dtype)) << what << ": padding written";
        }
      }
    }
  }
}

TEST(NsaPublicApi, FwdAndBwdOnCpuViewsMatchTheFp32Reference) {
  for (const NsaCase& s : nsa_rule_cases()) {
    SCOPED_TRACE(s.describe());
    NsaHostCase c(s);
    nsa_fwd(c.fwd_params());
    const Fp32Forward oracle = reference_fwd_fp32(c.problem(), RefPrecision::kExact);
    ASSERT_EQ(c.lse, oracle.lse);
    expect_rounded_from(c, c.out, s.seqlen_q, s.heads_q, oracle.out, true, "out");

    nsa_bwd(c.bwd_params());
    const Fp32Gradients grads = reference_bwd_fp32(c.bwd_problem(), RefPrecision::kExact, false);
    expect_rounded_from(c, c.dq, s.seqlen_q, s.heads_q, grads.dq, false, "dq");
    expect_rounded_from(c, c.dk, s.seqlen_k, s.heads_kv, grads.dk, false, "dk");
    expect_rounded_from(c, c.dv, s.seqlen_k, s.heads_kv, grads.dv, false, "dv");
    if (HasFatalFailure()) return;
  }
}

// The same values behind heads-major, padded q/k/v/out/gradients and padded, kv-head-major
// selection arrays give bit-identical results.
TEST(NsaPublicApi, LayoutDoesNotChangeTheResult) {
  NsaCase s;
  s.name = "layout";
  s.dtype = DType::kBFloat16;
  s.batch = 2;
  s.heads_q = 8;
  s.heads_kv = 2;
  s.head_dim = 40;
  s.seqlen_q = 37;
  s.seqlen_k = 101;
  s.block_size = 16;
  s.selected = 5;
  s.causal = true;
  s.counts = CountsKind::kMixed;
  s.mix = {0.2, 0.2, 0.2};
  s.seed = 8;
  NsaCase strided = s;
  strided.heads_major = true;
  strided.dim_pad = 8;
  strided.strided_indices = true;
  NsaHostCase a(s), b(strided);
  for (NsaHostCase* c : {&a, &b}) {
    nsa_fwd(c->fwd_params());
    nsa_bwd(c->bwd_params());
  }
  ASSERT_EQ(a.lse, b.lse);
  for (int n = 0; n < s.batch; ++n) {
    for (int i = 0; i < s.seqlen_q; ++i) {
      for (int h = 0; h < s.heads_q; ++h) {
        ASSERT_TRUE(std::equal(&a.out[s.q_offset(n, i, h)], &a.out[s.q_offset(n, i, h)] + 40,
                               &b.out[strided.q_offset(n, i, h)]));
        ASSERT_TRUE(std::equal(&a.dq[s.q_offset(n, i, h)], &a.dq[s.q_offset(n, i, h)] + 40,
                               &b.dq[strided.q_offset(n, i, h)]));
      }
    }
    for (int j = 0; j < s.seqlen_k; ++j) {
      for (int g = 0; g < s.heads_kv; ++g) {
        ASSERT_TRUE(std::equal(&a.dk[s.kv_offset(n, j, g)], &a.dk[s.kv_offset(n, j, g)] + 40,
                               &b.dk[strided.kv_offset(n, j, g)]));
        ASSERT_TRUE(std::equal(&a.dv[s.kv_offset(n, j, g)], &a.dv[s.kv_offset(n, j, g)] + 40,
                               &b.dv[strided.kv_offset(n, j, g)]));
      }
    }
  }
}

// No keys: every out and dq row is zero with lse -inf; no queries: every dk / dv row is zero; an
// empty batch: nothing to do.
TEST(NsaPublicApi, EmptyProblemsAreValid) {
  NsaCase s = tiny_case();
  s.seqlen_k = 0;
  NsaHostCase no_keys(s);
  nsa_fwd(no_keys.fwd_params());
  nsa_bwd(no_keys.bwd_params());
  for (float x : no_keys.lse) EXPECT_EQ(x, -std::numeric_limits<float>::infinity());
  for (uint16_t bits : no_keys.out) EXPECT_EQ(bits_to_float(s.dtype, bits), 0.0f);
  for (uint16_t bits : no_keys.dq) EXPECT_EQ(bits_to_float(s.dtype, bits), 0.0f);

  s = tiny_case();
  s.seqlen_q = 0;
  NsaHostCase no_queries(s);
  nsa_fwd(no_queries.fwd_params());
  nsa_bwd(no_queries.bwd_params());
  for (uint16_t bits : no_queries.dk) EXPECT_EQ(bits_to_float(s.dtype, bits), 0.0f);
  for (uint16_t bits : no_queries.dv) EXPECT_EQ(bits_to_float(s.dtype, bits), 0.0f);

  s = tiny_case();
  s.batch = 0;
  NsaHostCase empty(s);
  EXPECT_NO_THROW(nsa_fwd(empty.fwd_params()));
  EXPECT_NO_THROW(nsa_bwd(empty.bwd_params()));
}

TEST(NsaPublicApi, BwdWorkspaceSizeIsZeroForCpuViews) {
  for (const NsaCase& s : nsa_rule_cases()) {
    NsaHostCase c(s);
    EXPECT_EQ(nsa_bwd_workspace_size(c.bwd_params()), 0u) << s.describe();
  }
}

// ------------------------------------------------------------------------------------------------
// Validation: what the problem holds
// ------------------------------------------------------------------------------------------------

// fp16, batch 2, 5 queries, 40 keys (3 blocks of 16, the last one short), 4 query heads over 2 kv
// heads, head dim 16, 3 slots, with block_counts.
NsaCase validation_case() {
  NsaCase s;
  s.name = "validation";
  s.dtype = DType::kFloat16;
  s.batch = 2;
  s.heads_q = 4;
  s.heads_kv = 2;
  s.head_dim = 16;
  s.seqlen_q = 5;
  s.seqlen_k = 40;
  s.block_size = 16;
  s.selected = 3;
  s.counts = CountsKind::kInRange;
  s.seed = 42;
  return s;
}

TEST(NsaValidationProblem, HoldsTheSizesStridesPointersAndDefaults) {
  NsaCase s = validation_case();
  s.heads_major = true;
  s.dim_pad = 8;
  s.strided_indices = true;
  NsaHostCase c(s);
  const NsaFwdParams params = c.fwd_params();
  const NsaProblem p = api::validate_nsa_fwd(params);
  EXPECT_EQ(p.dtype, DType::kFloat16);
  EXPECT_EQ(p.batch, 2);
  EXPECT_EQ(p.seqlen_q, 5);
  EXPECT_EQ(p.seqlen_k, 40);
  EXPECT_EQ(p.heads_q, 4);
  EXPECT_EQ(p.heads_kv, 2);
  EXPECT_EQ(p.head_dim, 16);
  EXPECT_EQ(p.block_size, 16);
  EXPECT_EQ(p.num_key_blocks, 3);
  EXPECT_EQ(p.selected, 3);
  EXPECT_EQ(p.q, c.in.q.data());
  EXPECT_EQ(p.q_batch_stride, 4 * 5 * 24);
  EXPECT_EQ(p.q_row_stride, 24);
  EXPECT_EQ(p.q_head_stride, 5 * 24);
  EXPECT_EQ(p.k_batch_stride, 2 * 40 * 24);
  EXPECT_EQ(p.v_row_stride, 24);
  EXPECT_EQ(p.out, c.out.data());
  EXPECT_EQ(p.out_head_stride, 5 * 24);
  EXPECT_EQ(p.block_indices, c.in.block_indices.data());
  EXPECT_EQ(p.bi_batch_stride, 5 * 6);
  EXPECT_EQ(p.bi_row_stride, 6);
  EXPECT_EQ(p.bi_head_stride, 2 * 5 * 6);
  EXPECT_EQ(p.block_counts, c.in.block_counts.data());
  EXPECT_EQ(p.bc_batch_stride, 4);
  EXPECT_EQ(p.bc_row_stride, 2 * 4);
  EXPECT_EQ(p.lse, c.lse.data());
  EXPECT_EQ(p.lse_batch_stride, 4 * 5);
  EXPECT_EQ(p.lse_head_stride, 5);
  EXPECT_FLOAT_EQ(p.softmax_scale, 0.25f);  // 1 / sqrt(16)
  EXPECT_FALSE(p.causal);

  NsaFwdParams explicit_scale = params;
  explicit_scale.softmax_scale = 0.125f;
  explicit_scale.causal = true;
  explicit_scale.block_size = 256;
  explicit_scale.block_counts = TensorView{};
  const NsaProblem q = api::validate_nsa_fwd(explicit_scale);
  EXPECT_EQ(q.softmax_scale, 0.125f);
  EXPECT_TRUE(q.causal);
  EXPECT_EQ(q.num_key_blocks, 1);
  EXPECT_EQ(q.block_counts, nullptr);
}

TEST(NsaValidationProblem, TheBackwardAddsTheGradientsAndCopiesTheWorkspaceUnchecked) {
  NsaHostCase c(validation_case());
  NsaBwdParams params = c.bwd_params();
  int scratch = 0;
  params.workspace = &scratch;
  params.workspace_bytes = 12345;
  const NsaBwdProblem p = api::validate_nsa_bwd(params);
  EXPECT_EQ(p.workspace, &scratch);
  EXPECT_EQ(p.workspace_bytes, 12345u);
  EXPECT_EQ(p.fwd.num_key_blocks, 3);
  EXPECT_EQ(p.dout, c.in.dout.data());
  EXPECT_EQ(p.dq, c.dq.data());
  EXPECT_EQ(p.dk, c.dk.data());
  EXPECT_EQ(p.dv, c.dv.data());
  EXPECT_EQ(p.dq_row_stride, 4 * 16);
  EXPECT_EQ(p.dk_batch_stride, 40 * 2 * 16);
  EXPECT_EQ(p.dv_head_stride, 16);
  EXPECT_EQ(p.dout_batch_stride, 5 * 4 * 16);
  EXPECT_NO_THROW(nsa_bwd(params));  // the CPU backend needs no workspace and ignores it
}

// ------------------------------------------------------------------------------------------------
// Validation: every bad input of nsa_fwd
// ------------------------------------------------------------------------------------------------

// Moves every tensor of the params onto cuda:0 (the host pointers stay; nothing dereferences them
// as long as validation or dispatch rejects the call).
template <typename Params>
void label_all_cuda(Params& p) {
  for (TensorView* view : {&p.q, &p.k, &p.v, &p.block_indices, &p.block_counts, &p.out,
                           &p.softmax_lse}) {
    view->device = kCuda0;
  }
  if constexpr (std::is_same_v<Params, NsaBwdParams>) {
    for (TensorView* view : {&p.dout, &p.dq, &p.dk, &p.dv}) view->device = kCuda0;
  }
}

class NsaFwdValidation : public ::testing::Test {
 protected:
  NsaHostCase c{validation_case()};
  NsaFwdParams p = c.fwd_params();
  const Device cpu{};
};

TEST_F(NsaFwdValidation, TheValidCaseRuns) { EXPECT_NO_THROW(nsa_fwd(p)); }

TEST_F(NsaFwdValidation, UndefinedTensorsAreNamed) {
  const std::pair<const char*, TensorView NsaFwdParams::*> required[] = {
      {"nsa_fwd: q is undefined", &NsaFwdParams::q},
      {"nsa_fwd: k is undefined", &NsaFwdParams::k},
      {"nsa_fwd: v is undefined", &NsaFwdParams::v},
      {"nsa_fwd: block_indices is undefined", &NsaFwdParams::block_indices},
      {"nsa_fwd: out is undefined", &NsaFwdParams::out},
      {"nsa_fwd: softmax_lse is undefined", &NsaFwdParams::softmax_lse}};
  for (const auto& [message, member] : required) {
    NsaFwdParams bad = p;
    bad.*member = TensorView{};
    EXPECT_ERROR_MENTIONS(nsa_fwd(bad), message);
  }
}

TEST_F(NsaFwdValidation, AttentionDtypesMustBeOneOfFp16AndBf16) {
  NsaFwdParams bad = p;
  bad.q.dtype = DType::kFloat32;
  EXPECT_ERROR_MENTIONS(nsa_fwd(bad), "nsa_fwd: q.dtype is float32", "float16, bfloat16");
  bad = p;
  bad.k.dtype = DType::kBFloat16;
  EXPECT_ERROR_MENTIONS(nsa_fwd(bad), "k.dtype is bfloat16 but q.dtype is float16");
  bad = p;
  bad.v.dtype = DType::kBFloat16;
  EXPECT_ERROR_MENTIONS(nsa_fwd(bad), "v.dtype is bfloat16 but q.dtype is float16");
  bad = p;
  bad.out.dtype = DType::kFloat32;
  EXPECT_ERROR_MENTIONS(nsa_fwd(bad), "out.dtype is float32 but q.dtype is float16");
  bad = p;
  bad.softmax_lse.dtype = DType::kFloat16;
  EXPECT_ERROR_MENTIONS(nsa_fwd(bad), "softmax_lse.dtype is float16", "float32");
}

TEST_F(NsaFwdValidation, SelectionArraysMustBeInt32) {
  NsaFwdParams bad = p;
  bad.block_indices.dtype = DType::kFloat32;
  EXPECT_ERROR_MENTIONS(nsa_fwd(bad), "nsa_fwd: block_indices.dtype is float32", "int32");
  bad = p;
  bad.block_counts.dtype = DType::kFloat16;
  EXPECT_ERROR_MENTIONS(nsa_fwd(bad), "nsa_fwd: block_counts.dtype is float16", "int32");
}

TEST_F(NsaFwdValidation, AllTensorsMustBeOnOneDevice) {
  const std::pair<const char*, TensorView NsaFwdParams::*> others[] = {
      {"k is on cuda:0 but q is on cpu", &NsaFwdParams::k},
      {"v is on cuda:0 but q is on cpu", &NsaFwdParams::v},
      {"block_indices is on cuda:0 but q is on cpu", &NsaFwdParams::block_indices},
      {"block_counts is on cuda:0 but q is on cpu", &NsaFwdParams::block_counts},
      {"out is on cuda:0 but q is on cpu", &NsaFwdParams::out},
      {"softmax_lse is on cuda:0 but q is on cpu", &NsaFwdParams::softmax_lse}};
  for (const auto& [message, member] : others) {
    NsaFwdParams bad = p;
    (bad.*member).device = kCuda0;
    EXPECT_ERROR_MENTIONS(nsa_fwd(bad), "nsa_fwd:", message);
  }
  NsaFwdParams bad = p;
  label_all_cuda(bad);
  bad.block_indices.device = Device{DeviceKind::kCuda, 1};
  EXPECT_ERROR_MENTIONS(nsa_fwd(bad), "block_indices is on cuda:1 but q is on cuda:0");
  bad = p;
  label_all_cuda(bad);
  for (TensorView* view : {&bad.q, &bad.k, &bad.v, &bad.block_indices, &bad.block_counts, &bad.out,
                           &bad.softmax_lse}) {
    view->device.index = -1;
  }
  EXPECT_ERROR_MENTIONS(nsa_fwd(bad), "q.device is cuda:-1");
}

TEST_F(NsaFwdValidation, RanksAreChecked) {
  NsaFwdParams bad = p;
  bad.q = make_view(c.in.q.data(), DType::kFloat16, {10, 4, 16}, cpu);
  EXPECT_ERROR_MENTIONS(nsa_fwd(bad), "q has rank 3", "expected rank 4");
  bad = p;
  bad.k = make_view(c.in.k.data(), DType::kFloat16, {80, 2, 16}, cpu);
  EXPECT_ERROR_MENTIONS(nsa_fwd(bad), "k has rank 3", "[batch, seqlen_k, heads_kv, head_dim]");
  bad = p;
  bad.block_indices = make_view(c.in.block_indices.data(), DType::kInt32, {2, 5, 6}, cpu);
  EXPECT_ERROR_MENTIONS(nsa_fwd(bad), "block_indices has rank 3",
                        "[batch, seqlen_q, heads_kv, selected]");
  bad = p;
  bad.block_counts = make_view(c.in.block_counts.data(), DType::kInt32, {2, 10}, cpu);
  EXPECT_ERROR_MENTIONS(nsa_fwd(bad), "block_counts has rank 2", "[batch, seqlen_q, heads_kv]");
}

TEST_F(NsaFwdValidation, HeadDimMustBeAMultipleOf8UpTo256) {
  for (int64_t head_dim : {36, 264, 0}) {
    std::vector<uint16_t> big(2 * 40 * 4 * 264);
    NsaFwdParams bad = p;
    bad.q = make_view(big.data(), DType::kFloat16, {2, 5, 4, head_dim}, cpu);
    const std::string value = "nsa_fwd: head_dim (q.size(-1)) is " + std::to_string(head_dim);
    EXPECT_ERROR_MENTIONS(nsa_fwd(bad), value.c_str(), "a multiple of 8 from 8 to 256");
  }
}

TEST_F(NsaFwdValidation, QueryHeadsMustBeAMultipleOfKvHeads) {
  p.k = make_view(c.in.k.data(), DType::kFloat16, {2, 40, 3, 16}, cpu);
  EXPECT_ERROR_MENTIONS(nsa_fwd(p), "q has 4 heads and k has 3", "multiple of heads_kv");
}

TEST_F(NsaFwdValidation, ShapesMustMatchAndNameTheExpectedShape) {
  NsaFwdParams bad = p;
  bad.k = make_view(c.in.k.data(), DType::kFloat16, {1, 40, 2, 16}, cpu);
  EXPECT_ERROR_MENTIONS(nsa_fwd(bad), "k has shape [1, 40, 2, 16]; expected [2, 40, 2, 16]");
  bad = p;
  bad.k = make_view(c.in.k.data(), DType::kFloat16, {2, 20, 2, 32}, cpu);
  EXPECT_ERROR_MENTIONS(nsa_fwd(bad), "k has shape [2, 20, 2, 32]; expected [2, 20, 2, 16]");
  bad = p;
  bad.v = make_view(c.in.v.data(), DType::kFloat16, {2, 39, 2, 16}, cpu);
  EXPECT_ERROR_MENTIONS(nsa_fwd(bad), "v has shape [2, 39, 2, 16]; expected [2, 40, 2, 16]");
  bad = p;
  bad.out = make_view(c.out.data(), DType::kFloat16, {2, 5, 2, 16}, cpu);
  EXPECT_ERROR_MENTIONS(nsa_fwd(bad), "out has shape [2, 5, 2, 16]; expected [2, 5, 4, 16]");
  bad = p;
  bad.softmax_lse = make_view(c.lse.data(), DType::kFloat32, {2, 5, 4}, cpu);
  EXPECT_ERROR_MENTIONS(nsa_fwd(bad), "softmax_lse has shape [2, 5, 4]; expected [2, 4, 5]");
  bad = p;
  bad.block_indices = make_view(c.in.block_indices.data(), DType::kInt32, {2, 5, 1, 3}, cpu);
  EXPECT_ERROR_MENTIONS(nsa_fwd(bad),
                        "block_indices has shape [2, 5, 1, 3]; expected [2, 5, 2, 3]");
  bad = p;
  bad.block_indices = make_view(c.in.block_indices.data(), DType::kInt32, {2, 4, 2, 3}, cpu);
  EXPECT_ERROR_MENTIONS(nsa_fwd(bad),
                        "block_indices has shape [2, 4, 2, 3]; expected [2, 5, 2, 3]");
  bad = p;
  bad.block_counts = make_view(c.in.block_counts.data(), DType::kInt32, {2, 5, 1}, cpu);
  EXPECT_ERROR_MENTIONS(nsa_fwd(bad), "block_counts has shape [2, 5, 1]; expected [2, 5, 2]");
}

TEST_F(NsaFwdValidation, SelectedMustBeFrom1ToTheMaximum) {
  std::vector<int32_t> slots(2 * 5 * 2 * (kNsaMaxSelected + 1), -1);
  for (int64_t selected : {0, kNsaMaxSelected + 1}) {
    NsaFwdParams bad = p;
    bad.block_indices = make_view(slots.data(), DType::kInt32, {2, 5, 2, selected}, cpu);
    const std::string value =
        "nsa_fwd: block_indices.size(3) (selected) is " + std::to_string(selected);
    EXPECT_ERROR_MENTIONS(nsa_fwd(bad), value.c_str(), "1 to 256");
  }
  p.block_indices = make_view(slots.data(), DType::kInt32, {2, 5, 2, kNsaMaxSelected}, cpu);
  EXPECT_NO_THROW(nsa_fwd(p));
}

TEST_F(NsaFwdValidation, BlockSizeMustBeAMultipleOf16UpTo256) {
  for (int block_size : {0, 8, 24, 272, -16}) {
    NsaFwdParams bad = p;
    bad.block_size = block_size;
    const std::string value = "nsa_fwd: block_size is " + std::to_string(block_size);
    EXPECT_ERROR_MENTIONS(nsa_fwd(bad), value.c_str(), "a multiple of 16 from 16 to 256");
  }
  for (int block_size : {16, 48, 256}) {
    p.block_size = block_size;
    EXPECT_NO_THROW(nsa_fwd(p)) << block_size;
  }
}

TEST_F(NsaFwdValidation, LastDimsMustBeContiguous) {
  NsaFwdParams bad = p;
  std::vector<uint16_t> spread(2 * 5 * 4 * 16 * 2);
  bad.q = make_strided_view(spread.data(), DType::kFloat16, {2, 5, 4, 16}, {640, 128, 32, 2}, cpu);
  EXPECT_ERROR_MENTIONS(nsa_fwd(bad), "nsa_fwd: q.stride(-1) is 2", "stride 1");
  bad = p;
  std::vector<int32_t> slots(2 * 5 * 2 * 3 * 2);
  bad.block_indices =
      make_strided_view(slots.data(), DType::kInt32, {2, 5, 2, 3}, {60, 12, 6, 2}, cpu);
  EXPECT_ERROR_MENTIONS(nsa_fwd(bad), "nsa_fwd: block_indices.stride(-1) is 2");
  bad = p;
  bad.block_counts = make_strided_view(slots.data(), DType::kInt32, {2, 5, 2}, {20, 4, 2}, cpu);
  EXPECT_ERROR_MENTIONS(nsa_fwd(bad), "nsa_fwd: block_counts.stride(-1) is 2");
  bad = p;
  std::vector<float> lse(2 * 4 * 5 * 2);
  bad.softmax_lse = make_strided_view(lse.data(), DType::kFloat32, {2, 4, 5}, {40, 10, 2}, cpu);
  EXPECT_ERROR_MENTIONS(nsa_fwd(bad), "softmax_lse.stride(-1) is 2");
}

TEST_F(NsaFwdValidation, DataPointersMustBeSetAndElementAligned) {
  NsaFwdParams bad = p;
  bad.v.data = nullptr;
  EXPECT_ERROR_MENTIONS(nsa_fwd(bad), "v.data is null");
  bad = p;
  bad.block_indices.data = nullptr;
  EXPECT_ERROR_MENTIONS(nsa_fwd(bad), "block_indices.data is null");
  bad = p;
  bad.block_indices.data = reinterpret_cast<char*>(c.in.block_indices.data()) + 2;
  EXPECT_ERROR_MENTIONS(nsa_fwd(bad), "block_indices.data", "not aligned to its 4-byte int32");
  bad = p;
  bad.block_counts.data = reinterpret_cast<char*>(c.in.block_counts.data()) + 1;
  EXPECT_ERROR_MENTIONS(nsa_fwd(bad), "block_counts.data", "not aligned to its 4-byte int32");
}

TEST_F(NsaFwdValidation, OutputsMayNotShareMemoryWithTheInputs) {
  const std::pair<const char*, void*> inputs[] = {{"is also q.data", c.in.q.data()},
                                                  {"is also k.data", c.in.k.data()},
                                                  {"is also v.data", c.in.v.data()}};
  for (const auto& [message, data] : inputs) {
    NsaFwdParams bad = p;
    bad.out.data = data;
    EXPECT_ERROR_MENTIONS(nsa_fwd(bad), "nsa_fwd: out.data", message, "out may not be q");
  }
  NsaFwdParams bad = p;
  bad.softmax_lse.data = c.in.q.data();
  EXPECT_ERROR_MENTIONS(nsa_fwd(bad), "nsa_fwd: softmax_lse.data", "is also q.data");
  bad = p;
  bad.out.data = c.in.block_indices.data();
  EXPECT_ERROR_MENTIONS(nsa_fwd(bad), "out.data", "is also block_indices.data");
}

TEST_F(NsaFwdValidation, SoftmaxScaleMustBeFiniteAndNonNegative) {
  for (float scale : {-0.5f, std::nanf(""), INFINITY}) {
    NsaFwdParams bad = p;
    bad.softmax_scale = scale;
    EXPECT_ERROR_MENTIONS(nsa_fwd(bad), "nsa_fwd: softmax_scale is", "finite and >= 0");
  }
  NsaFwdParams bad = p;
  bad.softmax_scale = -0.5f;
  EXPECT_ERROR_MENTIONS(nsa_fwd(bad), "softmax_scale is -0.5");
}

TEST_F(NsaFwdValidation, CudaPointersAndStridesMustKeepRows16ByteAligned) {
  label_all_cuda(p);
  NsaFwdParams bad = p;
  bad.q.data = c.in.q.data() + 1;
  EXPECT_ERROR_MENTIONS(nsa_fwd(bad), "nsa_fwd: q.data", "is not 16-byte aligned");
  bad = p;
  bad.k.data = c.in.k.data() + 4;
  EXPECT_ERROR_MENTIONS(nsa_fwd(bad), "nsa_fwd: k.data", "is not 16-byte aligned");
  bad = p;
  std::vector<uint16_t> padded(2 * 5 * 4 * 20);
  bad.out = make_strided_view(padded.data(), DType::kFloat16, {2, 5, 4, 16}, {400, 80, 20, 1},
                              kCuda0);
  EXPECT_ERROR_MENTIONS(nsa_fwd(bad), "out.stride(2) is 20", "multiple of 8 elements");
}

#ifndef FLASHKIT_WITH_CUDA
TEST_F(NsaFwdValidation, CudaViewsNeedACudaBuild) {
  label_all_cuda(p);  // valid views: this build rejects them at dispatch, before any device call
  EXPECT_ERROR_MENTIONS(nsa_fwd(p), "nsa_fwd:", "has no CUDA kernels (configured without nvcc)");
  NsaBwdParams b = c.bwd_params();
  label_all_cuda(b);
  EXPECT_ERROR_MENTIONS(nsa_bwd(b), "nsa_bwd:", "has no CUDA kernels");
  EXPECT_ERROR_MENTIONS(nsa_bwd_workspace_size(b), "nsa_bwd_workspace_size:",
                        "has no CUDA kernels");
  for (DType dtype : {DType::kFloat16, DType::kBFloat16}) {
    EXPECT_FALSE(cuda_nsa_built(dtype, 64));
    EXPECT_FALSE(cuda_nsa_built(dtype, 128));
  }
}
#endif

TEST(NsaCudaBuiltQuery, InvalidHeadDimsAreNeverBuilt) {
  for (int head_dim : {0, -8, 36, 264}) {
    EXPECT_FALSE(cuda_nsa_built(DType::kBFloat16, head_dim)) << head_dim;
    EXPECT_FALSE(cuda_nsa_built(DType::kFloat16, head_dim)) << head_dim;
  }
}

TEST_F(NsaFwdValidation, TheNextValidCallWorksAfterAnError) {
  NsaFwdParams bad = p;
  bad.block_size = 24;
  EXPECT_THROW(nsa_fwd(bad), Error);
  for (uint16_t bits : c.out) {
    ASSERT_EQ(bits, nan_bits(DType::kFloat16)) << "written before failing";
  }
  for (float x : c.lse) ASSERT_TRUE(std::isnan(x)) << "written before failing";
  ASSERT_NO_THROW(nsa_fwd(p));
  for (uint16_t bits : c.out) ASSERT_FALSE(std::isnan(bits_to_float(DType::kFloat16, bits)));
}

// ------------------------------------------------------------------------------------------------
// Validation: every bad input of nsa_bwd
// ------------------------------------------------------------------------------------------------

class NsaBwdValidation : public ::testing::Test {
 protected:
  void SetUp() override { nsa_fwd(c.fwd_params()); }
  NsaHostCase c{validation_case()};
  NsaBwdParams p = c.bwd_params();
  const Device cpu{};
};

TEST_F(NsaBwdValidation, TheValidCaseRuns) {
  EXPECT_NO_THROW(nsa_bwd(p));
  EXPECT_EQ(nsa_bwd_workspace_size(p), 0u);
}

TEST_F(NsaBwdValidation, UndefinedTensorsAreNamed) {
  const std::pair<const char*, TensorView NsaBwdParams::*> required[] = {
      {"nsa_bwd: dout is undefined", &NsaBwdParams::dout},
      {"nsa_bwd: dq is undefined", &NsaBwdParams::dq},
      {"nsa_bwd: dk is undefined", &NsaBwdParams::dk},
      {"nsa_bwd: dv is undefined", &NsaBwdParams::dv},
      {"nsa_bwd: out is undefined", &NsaBwdParams::out},
      {"nsa_bwd: softmax_lse is undefined", &NsaBwdParams::softmax_lse},
      {"nsa_bwd: block_indices is undefined", &NsaBwdParams::block_indices}};
  for (const auto& [message, member] : required) {
    NsaBwdParams bad = p;
    bad.*member = TensorView{};
    EXPECT_ERROR_MENTIONS(nsa_bwd(bad), message);
    EXPECT_ERROR_MENTIONS(nsa_bwd_workspace_size(bad), message);
  }
}

// The arguments the forward took are checked as the forward checks them, under nsa_bwd's name.
TEST_F(NsaBwdValidation, TheForwardRulesApply) {
  NsaBwdParams bad = p;
  bad.block_size = 24;
  EXPECT_ERROR_MENTIONS(nsa_bwd(bad), "nsa_bwd: block_size is 24");
  bad = p;
  bad.block_indices.dtype = DType::kFloat32;
  EXPECT_ERROR_MENTIONS(nsa_bwd(bad), "nsa_bwd: block_indices.dtype is float32");
  bad = p;
  bad.softmax_lse = make_view(c.lse.data(), DType::kFloat32, {2, 5, 4}, cpu);
  EXPECT_ERROR_MENTIONS(nsa_bwd(bad), "nsa_bwd: softmax_lse has shape [2, 5, 4]");
  bad = p;
  bad.out.data = bad.q.data;
  EXPECT_ERROR_MENTIONS(nsa_bwd(bad), "nsa_bwd: out.data", "is also q.data");
  bad = p;
  bad.softmax_scale = -1.0f;
  EXPECT_ERROR_MENTIONS(nsa_bwd(bad), "nsa_bwd: softmax_scale is -1");
}

TEST_F(NsaBwdValidation, GradientsMustMatchTheirTensors) {
  NsaBwdParams bad = p;
  bad.dq.dtype = DType::kBFloat16;
  EXPECT_ERROR_MENTIONS(nsa_bwd(bad), "nsa_bwd: dq.dtype is bfloat16 but q.dtype is float16");
  bad = p;
  bad.dout.device = kCuda0;
  EXPECT_ERROR_MENTIONS(nsa_bwd(bad), "nsa_bwd: dout is on cuda:0 but q is on cpu");
  bad = p;
  bad.dk = make_view(c.dk.data(), DType::kFloat16, {2, 40, 4, 8}, cpu);
  EXPECT_ERROR_MENTIONS(nsa_bwd(bad),
                        "nsa_bwd: dk has shape [2, 40, 4, 8]; expected [2, 40, 2, 16]",
                        "the shape of k");
  bad = p;
  bad.dv = make_view(c.dv.data(), DType::kFloat16, {2, 40, 32}, cpu);
  EXPECT_ERROR_MENTIONS(nsa_bwd(bad), "nsa_bwd: dv has shape [2, 40, 32]");
  bad = p;
  std::vector<uint16_t> spread(2 * 5 * 4 * 16 * 2);
  bad.dout = make_strided_view(spread.data(), DType::kFloat16, {2, 5, 4, 16}, {640, 128, 32, 2},
                               cpu);
  EXPECT_ERROR_MENTIONS(nsa_bwd(bad), "nsa_bwd: dout.stride(-1) is 2");
  bad = p;
  bad.dq = make_strided_view(c.dq.data(), DType::kFloat16, {2, 5, 4, 16}, {320, 64, 16, 2}, cpu);
  EXPECT_ERROR_MENTIONS(nsa_bwd(bad), "nsa_bwd: dq.stride(-1) is 2");
  bad = p;
  bad.dv.data = nullptr;
  EXPECT_ERROR_MENTIONS(nsa_bwd(bad), "nsa_bwd: dv.data is null");
}

TEST_F(NsaBwdValidation, GradientsMayNotShareMemoryWithAnyOtherTensor) {
  struct Alias {
    TensorView NsaBwdParams::*gradient;
    void* data;
    const char* message;
  };
  const Alias aliases[] = {
      {&NsaBwdParams::dq, c.in.q.data(), "dq.data"},
      {&NsaBwdParams::dq, c.in.dout.data(), "is also dout.data"},
      {&NsaBwdParams::dk, c.in.k.data(), "is also k.data"},
      {&NsaBwdParams::dk, c.dv.data(), "is also dv.data"},
      {&NsaBwdParams::dv, c.out.data(), "is also out.data"},
      {&NsaBwdParams::dv, c.in.block_indices.data(), "is also block_indices.data"},
      {&NsaBwdParams::dq, c.lse.data(), "is also softmax_lse.data"}};
  for (const Alias& alias : aliases) {
    NsaBwdParams bad = p;
    (bad.*alias.gradient).data = alias.data;
    EXPECT_ERROR_MENTIONS(nsa_bwd(bad), "nsa_bwd:", alias.message, "memory of its own");
  }
}

TEST_F(NsaBwdValidation, CudaGradientsMustKeepRows16ByteAligned) {
  label_all_cuda(p);
  NsaBwdParams bad = p;
  bad.dk.data = c.dk.data() + 2;
  EXPECT_ERROR_MENTIONS(nsa_bwd(bad), "nsa_bwd: dk.data", "is not 16-byte aligned");
  EXPECT_ERROR_MENTIONS(nsa_bwd_workspace_size(bad), "dk.data", "is not 16-byte aligned");
}

TEST_F(NsaBwdValidation, TheNextValidCallWorksAfterAnError) {
  NsaBwdParams bad = p;
  bad.dk.data = bad.dv.data;
  EXPECT_THROW(nsa_bwd(bad), Error);
  for (uint16_t bits : c.dq) ASSERT_EQ(bits, nan_bits(DType::kFloat16)) << "written before failing";
  ASSERT_NO_THROW(nsa_bwd(p));
  for (const std::vector<uint16_t>* grad : {&c.dq, &c.dk, &c.dv}) {
    for (uint16_t bits : *grad) ASSERT_FALSE(std::isnan(bits_to_float(DType::kFloat16, bits)));
  }
}

}  // namespace
}  // namespace flashkit::test
