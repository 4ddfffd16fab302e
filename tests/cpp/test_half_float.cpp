// tests/cpp/test_half_float.cpp
// \brief The host fp16 / bf16 conversions (src/common/half_float.h) that the reference and every
// test rely on: exhaustive round trips, every rounding tie, overflow, subnormals and NaN.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <ostream>
#include <random>
#include <string>

#include "common/half_float.h"

namespace flashkit {

// Names the test parameter in gtest's output.
void PrintTo(DType dtype, std::ostream* os) { *os << dtype_name(dtype); }

namespace {

bool is_nan_bits(DType dtype, uint16_t bits) {
  return dtype == DType::kFloat16 ? ((bits & 0x7c00) == 0x7c00 && (bits & 0x3ff) != 0)
                                  : ((bits & 0x7f80) == 0x7f80 && (bits & 0x7f) != 0);
}

// The largest finite bit pattern (positive) of each format.
uint16_t max_finite_bits(DType dtype) { return dtype == DType::kFloat16 ? 0x7bff : 0x7f7f; }

class HalfFloat : public ::testing::TestWithParam<DType> {};

TEST_P(HalfFloat, EveryBitPatternRoundTrips) {
  const DType dtype = GetParam();
  for (uint32_t n = 0; n <= 0xffff; ++n) {
    const auto bits = static_cast<uint16_t>(n);
    const float x = bits_to_float(dtype, bits);
    if (is_nan_bits(dtype, bits)) {
      ASSERT_TRUE(std::isnan(x)) << std::hex << n;
      ASSERT_TRUE(is_nan_bits(dtype, float_to_bits(dtype, x))) << std::hex << n;
    } else {
      ASSERT_EQ(float_to_bits(dtype, x), bits) << std::hex << n << " -> " << x;
    }
  }
}

// Between two neighbours a < b the midpoint (exact in float: both formats have at most 11
// significand bits) rounds to the one with an even pattern; anything off the midpoint rounds to
// the nearer one. Covers subnormals, the normal range and the top of the range.
TEST_P(HalfFloat, RoundsToNearestWithTiesToEven) {
  const DType dtype = GetParam();
  for (uint32_t n = 0; n < max_finite_bits(dtype); ++n) {
    for (const uint32_t sign : {0u, 0x8000u}) {
      const auto low = static_cast<uint16_t>(n | sign),
                 high = static_cast<uint16_t>((n + 1) | sign);
      const float a = bits_to_float(dtype, low), b = bits_to_float(dtype, high);
      const float mid = a + (b - a) / 2;
      ASSERT_EQ(static_cast<double>(mid), (static_cast<double>(a) + b) / 2) << "midpoint inexact";
      ASSERT_EQ(float_to_bits(dtype, mid), (n % 2 == 0) ? low : high) << std::hex << n;
      ASSERT_EQ(float_to_bits(dtype, std::nextafter(mid, a)), low) << std::hex << n;
      ASSERT_EQ(float_to_bits(dtype, std::nextafter(mid, b)), high) << std::hex << n;
    }
  }
}

TEST_P(HalfFloat, OverflowInfinityAndNan) {
  const DType dtype = GetParam();
  const uint16_t inf = dtype == DType::kFloat16 ? 0x7c00 : 0x7f80;
  const float max_finite = bits_to_float(dtype, max_finite_bits(dtype));
  const float below_max = bits_to_float(dtype, max_finite_bits(dtype) - 1);
  // Half an ulp above the largest finite value: a tie whose even neighbour is infinity.
  const float halfway = max_finite + (max_finite - below_max) / 2;
  EXPECT_EQ(float_to_bits(dtype, max_finite), max_finite_bits(dtype));
  EXPECT_EQ(float_to_bits(dtype, std::nextafter(halfway, 0.0f)), max_finite_bits(dtype));
  EXPECT_EQ(float_to_bits(dtype, halfway), inf);
  EXPECT_EQ(float_to_bits(dtype, std::numeric_limits<float>::infinity()), inf);
  EXPECT_EQ(float_to_bits(dtype, -std::numeric_limits<float>::infinity()), inf | 0x8000);
  EXPECT_EQ(bits_to_float(dtype, inf), std::numeric_limits<float>::infinity());
  EXPECT_TRUE(is_nan_bits(dtype, float_to_bits(dtype, std::nanf(""))));
  EXPECT_EQ(float_to_bits(dtype, -0.0f), 0x8000);
}

TEST(HalfFloatFp16, SmallestSubnormalAndUnderflow) {
  const float smallest = std::ldexp(1.0f, -24);
  EXPECT_EQ(fp16_bits_to_float(0x0001), smallest);
  EXPECT_EQ(fp16_bits_to_float(0x03ff), std::ldexp(1023.0f, -24));
  EXPECT_EQ(fp16_bits_to_float(0x0400), std::ldexp(1.0f, -14));
  EXPECT_EQ(float_to_fp16_bits(smallest / 2), 0x0000);  // a tie: to even, zero
  EXPECT_EQ(float_to_fp16_bits(std::nextafter(smallest / 2, 1.0f)), 0x0001);
  EXPECT_EQ(float_to_fp16_bits(std::ldexp(1.0f, -40)), 0x0000);
  EXPECT_EQ(float_to_fp16_bits(-std::ldexp(1.0f, -40)), 0x8000);
}

// Random floats over the whole exponent range: the result is never farther than a neighbour.
TEST_P(HalfFloat, RandomFloatsRoundToTheNearestValue) {
  const DType dtype = GetParam();
  std::mt19937 rng(12345);
  const float max_finite = bits_to_float(dtype, max_finite_bits(dtype));
  for (int n = 0; n < 200000; ++n) {
    uint32_t word = rng();
    float x;
    std::memcpy(&x, &word, sizeof x);
    if (!std::isfinite(x) || std::fabs(x) > max_finite) continue;
    const uint16_t r = float_to_bits(dtype, x);
    const double error = std::fabs(static_cast<double>(bits_to_float(dtype, r)) - x);
    for (const int step : {-1, 1}) {
      const auto neighbour = static_cast<uint16_t>(r + step);
      if (is_nan_bits(dtype, neighbour) || (neighbour & 0x7fff) > max_finite_bits(dtype)) continue;
      if ((neighbour & 0x8000) != (r & 0x8000)) continue;
      ASSERT_LE(error, std::fabs(static_cast<double>(bits_to_float(dtype, neighbour)) - x))
          << x << " -> " << std::hex << r;
    }
  }
}

TEST_P(HalfFloat, RoundToMatchesTheBitConversions) {
  const DType dtype = GetParam();
  for (float x : {0.1f, -3.14159f, 1000.7f, 1e-6f}) {
    EXPECT_EQ(round_to(dtype, x), bits_to_float(dtype, float_to_bits(dtype, x)));
  }
}

INSTANTIATE_TEST_SUITE_P(Both, HalfFloat, ::testing::Values(DType::kFloat16, DType::kBFloat16),
                         [](const auto& info) { return std::string(dtype_name(info.param)); });

}  // namespace
}  // namespace flashkit
