// tests/cpp/test_dropout.cpp
// \brief Dropout on the CPU: Philox4x32-10 against Random123's published known-answer vectors; the
// mask's addressing (the fragment layout the kernels rely on, the per-row helper the reference
// uses); the mask's statistics (kept fraction, per-row and per-column binomial bounds, no
// correlation between neighbouring rows, columns, heads or offsets); the reference forward against
// a naive computation with the regenerated mask; and the CPU backend's return_softmax output, seed
// and offset semantics. The backward's gradients with dropout are checked against finite
// differences in test_reference_bwd.cpp.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <string>
#include <vector>

#include "attention_case.h"
#include "common/philox.h"
#include "cpu/reference_common.h"
#include "cpu/reference_fwd.h"
#include "flashkit/flashkit.h"

namespace flashkit::test {
namespace {

// ---- Philox4x32-10 ----

// Random123's kat_vectors for philox4x32 with 10 rounds: (counter, key) -> output.
TEST(Philox, KnownAnswerVectors) {
  struct Kat {
    uint32_t counter[4];
    uint32_t key[2];
    uint32_t expected[4];
  };
  const Kat kats[] = {
      {{0, 0, 0, 0}, {0, 0}, {0x6627e8d5u, 0xe169c58du, 0xbc57ac4cu, 0x9b00dbd8u}},
      {{0xffffffffu, 0xffffffffu, 0xffffffffu, 0xffffffffu},
       {0xffffffffu, 0xffffffffu},
       {0x408f276du, 0x41c83b0eu, 0xa20bc7c6u, 0x6d5451fdu}},
      {{0x243f6a88u, 0x85a308d3u, 0x13198a2eu, 0x03707344u},
       {0xa4093822u, 0x299f31d0u},
       {0xd16cfe09u, 0x94fdccebu, 0x5001e420u, 0x24126ea1u}},
  };
  for (const Kat& kat : kats) {
    const PhiloxBlock out = philox4x32_10(kat.counter[0], kat.counter[1], kat.counter[2],
                                          kat.counter[3], kat.key[0], kat.key[1]);
    for (int w = 0; w < 4; ++w) EXPECT_EQ(out.word[w], kat.expected[w]) << "word " << w;
  }
}

// ---- the mask's definition ----

TEST(DropoutMask, KeepThresholdIsTheNearest256th) {
  EXPECT_EQ(dropout_keep_threshold(0.0f), 256u);
  EXPECT_EQ(dropout_keep_threshold(0.001f), 256u);  // below 1/512: nothing dropped
  EXPECT_EQ(dropout_keep_threshold(0.1f), 230u);    // 230.4
  EXPECT_EQ(dropout_keep_threshold(0.25f), 192u);
  EXPECT_EQ(dropout_keep_threshold(0.5f), 128u);
  EXPECT_EQ(dropout_keep_threshold(0.999f), 0u);  // 0.256: everything dropped
}

// keeps() tests byte < threshold without extracting the byte: the same decision for every byte
// value and threshold, 256 keeping all and 0 none.
TEST(DropoutMask, KeepsIsTheByteBelowTheThreshold) {
  Rng rng(7);
  for (uint32_t threshold : {0u, 1u, 2u, 127u, 128u, 200u, 254u, 255u, 256u}) {
    DropoutMask mask;
    mask.keep_threshold = threshold;
    for (int trial = 0; trial < 2000; ++trial) {
      PhiloxBlock bits;
      for (uint32_t& word : bits.word) word = static_cast<uint32_t>(rng.next());
      if (trial < 256) bits.word[trial % 4] = 0x01010101u * static_cast<uint32_t>(trial);
      for (int byte = 0; byte < 16; ++byte) {
        const uint32_t value = (bits.word[byte / 4] >> (8 * (byte % 4))) & 0xffu;
        ASSERT_EQ(mask.keeps(bits, byte), value < threshold)
            << "byte value " << value << ", threshold " << threshold;
      }
    }
  }
}

// The kernels' use: lane l of a warp holding the 16 x 32 block (16 * row16, 32 * key32) of an
// mma.sync m16n8 accumulator holds rows 16 * row16 + l / 4 + 8 * half and keys
// 32 * key32 + 8 * tile + 2 * (l % 4) + e, and reads byte 8 * half + 2 * tile + e of the block of
// slot l. That must be the same decision as the element's own definition.
TEST(DropoutMask, OneCallPerLaneCoversItsFragmentOfA16x32Block) {
  const DropoutMask mask{0x0123456789abcdefULL, 0xfedcba9876543210ULL, 128};
  for (uint32_t bh : {0u, 5u, 0xfffffffeu}) {
    for (uint32_t row16 : {0u, 1u, 7u, 100000u}) {
      for (uint32_t key32 : {0u, 3u, 65535u}) {
        for (uint32_t lane = 0; lane < 32; ++lane) {
          const PhiloxBlock bits = mask.block(bh, row16, lane, key32);
          for (int half = 0; half < 2; ++half) {
            for (int tile = 0; tile < 4; ++tile) {
              for (int e = 0; e < 2; ++e) {
                const uint32_t i = row16 * 16 + lane / 4 + 8 * half;
                const uint32_t j = key32 * 32 + 8 * tile + 2 * (lane % 4) + e;
                ASSERT_EQ(DropoutMask::byte_of(i, j), 8 * half + 2 * tile + e);
                ASSERT_EQ(mask.keeps(bits, 8 * half + 2 * tile + e), mask.keep(bh, i, j))
                    << "bh " << bh << " row " << i << " key " << j;
              }
            }
          }
        }
      }
    }
  }
}

// The reference's row helper (four calls per 32 keys) against one call per element, over ranges
// that start and end anywhere.
TEST(DropoutMask, RowHelperMatchesTheElementwiseDefinition) {
  const DropoutMask mask{42, 1000, dropout_keep_threshold(0.3f)};
  std::vector<uint8_t> keep;
  for (int64_t i : {0, 1, 7, 8, 15, 16, 17, 1023, 4097}) {
    for (auto [first, end] :
         {std::pair<int64_t, int64_t>{0, 1}, {0, 32}, {3, 97}, {31, 33}, {64, 64}, {100, 513}}) {
      cpu::dropout_keep_row(mask, 9, i, first, end, keep);
      ASSERT_EQ(static_cast<int64_t>(keep.size()), end - first);
      for (int64_t j = first; j < end; ++j) {
        ASSERT_EQ(keep[j - first] != 0,
                  mask.keep(9, static_cast<uint32_t>(i), static_cast<uint32_t>(j)))
            << "row " << i << " key " << j;
      }
    }
  }
}

// ---- the mask's statistics ----

// The mask of (bh, offset) over [rows x cols], row-major, 1 = kept.
std::vector<uint8_t> mask_matrix(const DropoutMask& mask, uint32_t bh, int rows, int cols) {
  std::vector<uint8_t> matrix(static_cast<size_t>(rows) * cols);
  std::vector<uint8_t> keep;
  for (int i = 0; i < rows; ++i) {
    cpu::dropout_keep_row(mask, bh, i, 0, cols, keep);
    std::memcpy(&matrix[static_cast<size_t>(i) * cols], keep.data(), cols);
  }
  return matrix;
}

// The fraction of positions where a and b agree.
double agreement(const std::vector<uint8_t>& a, const std::vector<uint8_t>& b) {
  int64_t same = 0;
  for (size_t n = 0; n < a.size(); ++n) same += a[n] == b[n];
  return static_cast<double>(same) / static_cast<double>(a.size());
}

// Over 2048 x 2048 elements: the kept fraction within 0.5% of 1 - p; every row's and every
// column's count within 6 standard deviations of the binomial mean, and their spread that of a
// binomial (a mask with structure, e.g. rows repeating, would have a wrong spread or correlations);
// neighbouring rows and columns (inside a Philox block, across lanes, across blocks), other heads
// and other offsets agree as often as independent draws do (q^2 + (1 - q)^2).
TEST(DropoutStatistics, KeptFractionBinomialCountsAndNoCorrelation) {
  constexpr int kRows = 2048;
  constexpr int kCols = 2048;
  for (float p : {0.1f, 0.25f, 0.5f, 0.8f}) {
    SCOPED_TRACE("p = " + std::to_string(p));
    const DropoutMask mask{0x9e3779b97f4a7c15ULL, 12, dropout_keep_threshold(p)};
    const std::vector<uint8_t> m = mask_matrix(mask, 3, kRows, kCols);
    int64_t kept = 0;
    std::vector<int64_t> row_counts(kRows, 0), col_counts(kCols, 0);
    for (int i = 0; i < kRows; ++i) {
      for (int j = 0; j < kCols; ++j) {
        const int bit = m[static_cast<size_t>(i) * kCols + j];
        kept += bit;
        row_counts[i] += bit;
        col_counts[j] += bit;
      }
    }
    const double q = static_cast<double>(kept) / (static_cast<double>(kRows) * kCols);
    EXPECT_NEAR(q, 1.0 - p, 0.005);
    const double q_exact = mask.keep_threshold / 256.0;  // the realised keep probability
    for (const auto& [counts, n] : {std::pair{&row_counts, kCols}, std::pair{&col_counts, kRows}}) {
      const double mean = n * q_exact;
      const double sigma = std::sqrt(n * q_exact * (1.0 - q_exact));
      double spread = 0;
      for (int64_t count : *counts) {
        ASSERT_LE(std::fabs(static_cast<double>(count) - mean), 6 * sigma);
        spread += (count - mean) * (count - mean);
      }
      spread /= static_cast<double>(counts->size());
      EXPECT_GT(spread / (sigma * sigma), 0.8);
      EXPECT_LT(spread / (sigma * sigma), 1.25);
    }
    const double independent = q_exact * q_exact + (1.0 - q_exact) * (1.0 - q_exact);
    auto shifted = [&](int di, int dj) {  // m[i + di][j + dj] against m[i][j], as two matrices
      std::vector<uint8_t> a, b;
      for (int i = 0; i + di < kRows; ++i) {
        for (int j = 0; j + dj < kCols; ++j) {
          a.push_back(m[static_cast<size_t>(i) * kCols + j]);
          b.push_back(m[static_cast<size_t>(i + di) * kCols + j + dj]);
        }
      }
      return agreement(a, b);
    };
    for (auto [di, dj] : {std::pair{1, 0}, {8, 0}, {16, 0}, {0, 1}, {0, 2}, {0, 8}, {0, 32}}) {
      EXPECT_NEAR(shifted(di, dj), independent, 0.005) << "shift (" << di << ", " << dj << ")";
    }
    EXPECT_NEAR(agreement(m, mask_matrix(mask, 4, kRows, kCols)), independent, 0.005)
        << "another head";
    DropoutMask next = mask;
    next.offset += kCols / 32;
    EXPECT_NEAR(agreement(m, mask_matrix(next, 3, kRows, kCols)), independent, 0.005)
        << "the next call's offset";
    DropoutMask other_seed = mask;
    other_seed.seed += 1;
    EXPECT_NEAR(agreement(m, mask_matrix(other_seed, 3, kRows, kCols)), independent, 0.005)
        << "another seed";
  }
}

// ---- the reference forward with dropout ----

FwdCase dropout_case(int heads_q, int heads_kv, int seqlen_q, int seqlen_k, float p) {
  FwdCase s;
  s.name = "dropout";
  s.dtype = DType::kBFloat16;
  s.batch = 2;
  s.heads_q = heads_q;
  s.heads_kv = heads_kv;
  s.head_dim = 32;
  s.seqlen_q = seqlen_q;
  s.seqlen_k = seqlen_k;
  s.seed = 31;
  s.dropout = {p, 0xabcdef0123ULL, 77};
  return s;
}

struct Fp32Outputs {
  std::vector<float> out, lse;
};

Fp32Outputs reference_fp32(AttentionCase& c, cpu::RefPrecision precision) {
  const FwdCase& s = c.fwd_case();
  Fp32Outputs r;
  r.out.assign(static_cast<size_t>(s.batch) * s.heads_q * s.lse_rows() * s.head_dim,
               std::numeric_limits<float>::quiet_NaN());
  r.lse.assign(static_cast<size_t>(s.batch) * s.heads_q * s.lse_rows(),
               std::numeric_limits<float>::quiet_NaN());
  cpu::reference_fwd_fp32(c.problem(), precision, r.out.data(), r.lse.data());
  return r;
}

// The reference against a naive fp64 computation written here: full softmax of each row, then
// out_i = sum_j P_ij keep_ij / (1 - p) v_j with keep from DropoutMask::keep element by element;
// the lse must be exactly that of the same case without dropout.
TEST(ReferenceDropout, MatchesANaiveComputationWithTheRegeneratedMask) {
  for (bool causal : {false, true}) {
    FwdCase s = dropout_case(4, 2, 37, 70, 0.3f);
    s.causal = causal;
    SCOPED_TRACE(s.describe());
    AttentionCase c(s);
    const Fp32Outputs ref = reference_fp32(c, cpu::RefPrecision::kExact);
    const FwdProblem p = c.problem();
    const DropoutMask mask = p.dropout_mask();
    const int d = s.head_dim;
    int64_t dropped = 0, visible = 0;
    for (int b = 0; b < s.batch; ++b) {
      for (int h = 0; h < s.heads_q; ++h) {
        const int g = h / (s.heads_q / s.heads_kv);
        for (int i = 0; i < s.seqlen_q; ++i) {
          const int end =
              causal ? std::min(s.seqlen_k, i + s.seqlen_k - s.seqlen_q + 1) : s.seqlen_k;
          std::vector<double> scores(end);
          double max_score = -std::numeric_limits<double>::infinity();
          for (int j = 0; j < end; ++j) {
            double dot = 0;
            for (int e = 0; e < d; ++e) {
              dot += static_cast<double>(
                         bits_to_float(s.dtype, c.in.q[c.q_index(b * s.seqlen_q + i, h, e)])) *
                     bits_to_float(s.dtype, c.in.k[c.k_index(b * s.seqlen_k + j, g, e)]);
            }
            scores[j] = dot * p.softmax_scale;
            max_score = std::max(max_score, scores[j]);
          }
          double sum = 0;
          for (double& x : scores) sum += (x = std::exp(x - max_score));
          for (int e = 0; e < d; ++e) {
            double out = 0;
            for (int j = 0; j < end; ++j) {
              const bool kept = mask.keep(static_cast<uint32_t>(b * s.heads_q + h), i, j);
              if (!kept) continue;
              out += scores[j] / sum / (1.0 - p.dropout_p) *
                     bits_to_float(s.dtype, c.in.v[c.k_index(b * s.seqlen_k + j, g, e)]);
            }
            const float got =
                ref.out[((static_cast<size_t>(b) * s.heads_q + h) * s.seqlen_q + i) * d + e];
            ASSERT_NEAR(got, out, 1e-6 * (1.0 + std::fabs(out)))
                << b << " " << h << " " << i << " " << e;
          }
          for (int j = 0; j < end; ++j) {
            dropped += !mask.keep(static_cast<uint32_t>(b * s.heads_q + h), i, j);
            ++visible;
          }
          const double lse = max_score + std::log(sum);
          ASSERT_NEAR(ref.lse[(static_cast<size_t>(b) * s.heads_q + h) * s.seqlen_q + i], lse,
                      1e-5);
        }
      }
    }
    EXPECT_GT(dropped, visible / 5);  // p = 0.3 really drops
    EXPECT_LT(dropped, visible * 2 / 5);

    FwdCase undropped = s;
    undropped.dropout = {};
    AttentionCase plain(undropped);
    const Fp32Outputs no_dropout = reference_fp32(plain, cpu::RefPrecision::kExact);
    EXPECT_EQ(ref.lse, no_dropout.lse) << "the lse is that of the undropped scores";
    EXPECT_NE(ref.out, no_dropout.out);
  }
}

// p = 0 with any seed and offset is exactly the call without dropout, in both precision modes.
TEST(ReferenceDropout, PZeroIsExactlyNoDropout) {
  FwdCase s = dropout_case(2, 2, 19, 40, 0.0f);
  s.dropout.seed = 5;
  s.dropout.offset = 1234;
  FwdCase plain = s;
  plain.dropout = {};
  AttentionCase a(s), b(plain);
  for (cpu::RefPrecision precision : {cpu::RefPrecision::kExact, cpu::RefPrecision::kInputDtype}) {
    const Fp32Outputs x = reference_fp32(a, precision), y = reference_fp32(b, precision);
    EXPECT_EQ(x.out, y.out);
    EXPECT_EQ(x.lse, y.lse);
  }
}

// ---- the CPU backend: return_softmax, seed and offset ----

// mha_fwd on CPU views of case `c`, with attn_probs when `probs` is not null.
void run_mha_fwd(AttentionCase& c, std::vector<uint16_t>* probs) {
  const FwdCase& s = c.fwd_case();
  const int64_t rows = (s.max_len_q() + 127) / 128 * 128;
  const int64_t cols = (s.max_len_k() + 127) / 128 * 128;
  auto attach = [&](FwdCommon& f) {
    if (probs == nullptr) return;
    probs->assign(static_cast<size_t>(s.batch) * s.heads_q * rows * cols, nan_bits(s.dtype));
    f.attn_probs = make_view(probs->data(), s.dtype, {s.batch, s.heads_q, rows, cols}, Device{});
  };
  if (s.varlen) {
    MhaVarlenFwdParams params = c.varlen_params();
    attach(params);
    mha_varlen_fwd(params);
  } else {
    MhaFwdParams params = c.fwd_params();
    attach(params);
    mha_fwd(params);
  }
}

// attn_probs: every element written; visible pairs carry the undropped probability (the same bits
// as the call without dropout writes) with the sign bit set exactly where the mask drops; masked
// pairs and padding are +0; each row's magnitudes sum to 1 up to the dtype's rounding.
TEST(CpuBackendDropout, AttnProbsCarryTheProbabilitiesAndTheMask) {
  FwdCase fixed = dropout_case(4, 2, 45, 150, 0.4f);
  fixed.causal = true;
  FwdCase varlen = dropout_case(2, 1, 0, 0, 0.4f);
  varlen.varlen = true;
  varlen.batch = 3;
  varlen.lens_q = {17, 0, 140};
  varlen.lens_k = {33, 5, 129};
  varlen.window_left = 20;
  for (const FwdCase& s : {fixed, varlen}) {
    SCOPED_TRACE(s.describe());
    AttentionCase c(s);
    std::vector<uint16_t> probs;
    run_mha_fwd(c, &probs);
    FwdCase undropped_case = s;
    undropped_case.dropout = {};
    AttentionCase undropped(undropped_case);
    std::vector<uint16_t> plain_probs;
    run_mha_fwd(undropped, &plain_probs);

    const FwdProblem p = c.problem();
    const DropoutMask mask = p.dropout_mask();
    const int64_t rows = (s.max_len_q() + 127) / 128 * 128;
    const int64_t cols = (s.max_len_k() + 127) / 128 * 128;
    int64_t negative = 0, positive = 0;
    for (int b = 0; b < s.batch; ++b) {
      const cpu::Sequence seq{s.len_q(b), s.len_k(b), s.len_k(b), 0, 0};
      for (int h = 0; h < s.heads_q; ++h) {
        for (int64_t i = 0; i < rows; ++i) {
          const cpu::KeyRange range =
              i < seq.len_q ? cpu::allowed_keys(p, seq, i) : cpu::KeyRange{0, 0};
          double row_sum = 0;
          for (int64_t j = 0; j < cols; ++j) {
            const size_t n = ((static_cast<size_t>(b) * s.heads_q + h) * rows + i) * cols + j;
            if (j < range.first || j >= range.end) {
              ASSERT_EQ(probs[n], 0) << "b " << b << " h " << h << " i " << i << " j " << j;
              continue;
            }
            const bool kept = mask.keep(static_cast<uint32_t>(b * s.heads_q + h),
                                        static_cast<uint32_t>(i), static_cast<uint32_t>(j));
            const float value = bits_to_float(s.dtype, probs[n]);
            ASSERT_EQ(std::signbit(value), !kept)
                << "b " << b << " h " << h << " i " << i << " j " << j;
            ASSERT_EQ(probs[n] & 0x7fff, plain_probs[n]) << "magnitude of " << n;
            ASSERT_FALSE(std::signbit(bits_to_float(s.dtype, plain_probs[n])));
            (kept ? positive : negative) += 1;
            row_sum += std::fabs(value);
          }
          // Each magnitude is rounded to bf16 (relative error <= 2^-9).
          if (!range.empty()) {
            ASSERT_NEAR(row_sum, 1.0, 0.005);
          }
        }
      }
    }
    EXPECT_GT(negative, (negative + positive) / 4);
    EXPECT_LT(negative, (negative + positive) * 11 / 20);
  }
}

// The same seed and offset give identical bytes; another offset or seed gives other outputs but the
// same lse.
TEST(CpuBackendDropout, SeedAndOffsetDecideTheMask) {
  const FwdCase s = dropout_case(2, 2, 40, 64, 0.2f);
  AttentionCase first(s), again(s);
  run_mha_fwd(first, nullptr);
  run_mha_fwd(again, nullptr);
  EXPECT_EQ(first.out, again.out);
  EXPECT_EQ(first.lse, again.lse);
  for (DropoutSpec other : {DropoutSpec{0.2f, s.dropout.seed, s.dropout.offset + 1},
                            DropoutSpec{0.2f, s.dropout.seed + 1, s.dropout.offset}}) {
    FwdCase changed = s;
    changed.dropout = other;
    AttentionCase c(changed);
    run_mha_fwd(c, nullptr);
    EXPECT_NE(c.out, first.out);
    EXPECT_EQ(c.lse, first.lse);
  }
}

}  // namespace
}  // namespace flashkit::test
