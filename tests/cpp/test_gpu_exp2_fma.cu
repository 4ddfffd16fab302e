// tests/cpp/test_gpu_exp2_fma.cu
// \brief GPU unit test of exp2_fma (src/cuda/common/exp2_fma.cuh), the FMA-pipe 2^x of the sm90
// forward's softmax, against std::exp2 in double over its whole domain: a dense sweep of
// [-130, 128) (every 1/1024 and the fp32 neighbours of each integer), random floats, the special
// values (-inf, NaN, +-0, subnormal inputs, -FLT_MAX) and the row sums the softmax accumulates.
// Compiled with the kernels' flags (--use_fast_math: flush-to-zero, as in the kernels) for the
// project's CUDA architectures; skips itself without a CUDA device.
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cfloat>
#include <cmath>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "cuda/common/exp2_fma.cuh"

namespace flashkit {
namespace {

// The relative error the header promises (8.6e-5 for the polynomial, plus fp32 rounding).
constexpr double kMaxRelativeError = 1e-4;

__global__ void exp2_fma_kernel(const float* x, float* y, int n) {
  const int i = static_cast<int>(blockIdx.x * blockDim.x + threadIdx.x);
  if (i < n) y[i] = exp2_fma(x[i]);
}

bool has_device() {
  int count = 0;
  if (cudaGetDeviceCount(&count) != cudaSuccess || count == 0) {
    cudaGetLastError();
    return false;
  }
  return true;
}

// exp2_fma of every input, computed on the device.
std::vector<float> exp2_fma_on_device(const std::vector<float>& x) {
  const int n = static_cast<int>(x.size());
  float* d_x = nullptr;
  float* d_y = nullptr;
  std::vector<float> y(x.size(), 0.0f);
  EXPECT_EQ(cudaMalloc(&d_x, x.size() * sizeof(float)), cudaSuccess);
  EXPECT_EQ(cudaMalloc(&d_y, x.size() * sizeof(float)), cudaSuccess);
  EXPECT_EQ(cudaMemcpy(d_x, x.data(), x.size() * sizeof(float), cudaMemcpyHostToDevice), cudaSuccess);
  EXPECT_EQ(cudaMemset(d_y, 0xFF, x.size() * sizeof(float)), cudaSuccess);  // NaN poison
  exp2_fma_kernel<<<(n + 255) / 256, 256>>>(d_x, d_y, n);
  EXPECT_EQ(cudaGetLastError(), cudaSuccess);
  EXPECT_EQ(cudaMemcpy(y.data(), d_y, x.size() * sizeof(float), cudaMemcpyDeviceToHost), cudaSuccess);
  cudaFree(d_x);
  cudaFree(d_y);
  return y;
}

class GpuExp2FmaTest : public ::testing::Test {
 protected:
  void SetUp() override {
    if (!has_device()) GTEST_SKIP() << "no CUDA device";
  }
};

// Every x of the finite domain: 2^x within the relative bound where it is a normal float
// (x >= -126), +0 where MUFU.EX2.FTZ flushes it (x < -126), exact at integers.
TEST_F(GpuExp2FmaTest, MatchesExp2OverTheDomain) {
  std::vector<float> x;
  for (int i = -130 * 1024; i < 128 * 1024; ++i) x.push_back(static_cast<float>(i) / 1024.0f);
  for (int k = -130; k < 128; ++k) {
    const float integer = static_cast<float>(k);
    x.push_back(std::nextafter(integer, -INFINITY));
    x.push_back(std::nextafter(integer, INFINITY));
  }
  std::mt19937 gen(7);
  std::uniform_real_distribution<float> anywhere(-140.0f, 127.99f);
  std::uniform_real_distribution<float> softmax_range(-30.0f, 8.0f);
  for (int i = 0; i < 200000; ++i) x.push_back(anywhere(gen));
  for (int i = 0; i < 200000; ++i) x.push_back(softmax_range(gen));
  const std::vector<float> y = exp2_fma_on_device(x);

  double worst = 0.0;
  float worst_x = 0.0f;
  for (size_t i = 0; i < x.size(); ++i) {
    const double exact = std::exp2(static_cast<double>(x[i]));
    if (x[i] < -126.0f) {
      ASSERT_EQ(y[i], 0.0f) << "x = " << x[i];
      ASSERT_FALSE(std::signbit(y[i])) << "x = " << x[i];
      continue;
    }
    if (x[i] == std::floor(x[i])) ASSERT_EQ(static_cast<double>(y[i]), exact) << "x = " << x[i];
    const double relative = std::fabs(static_cast<double>(y[i]) - exact) / exact;
    if (relative > worst) {
      worst = relative;
      worst_x = x[i];
    }
  }
  EXPECT_LE(worst, kMaxRelativeError) << "worst at x = " << worst_x;
  RecordProperty("max_relative_error", std::to_string(worst));
}

TEST_F(GpuExp2FmaTest, SpecialValues) {
  const float nan = std::numeric_limits<float>::quiet_NaN();
  const float subnormal = 1e-40f;
  const std::vector<float> x = {-INFINITY, -FLT_MAX, -1e30f, -1000.0f, -127.0f, -126.5f, nan,
                                0.0f, -0.0f, subnormal, -subnormal, -126.0f, 127.0f};
  const std::vector<float> y = exp2_fma_on_device(x);
  for (int i = 0; i <= 5; ++i) {
    EXPECT_EQ(y[i], 0.0f) << "x = " << x[i];
    EXPECT_FALSE(std::signbit(y[i])) << "x = " << x[i];
  }
  EXPECT_TRUE(std::isnan(y[6])) << "NaN must stay NaN (as MUFU.EX2 keeps it), got " << y[6];
  EXPECT_EQ(y[7], 1.0f);
  EXPECT_EQ(y[8], 1.0f);
  // Subnormal inputs are 0 under flush-to-zero; without it 2^x is within the bound of 1.
  EXPECT_NEAR(y[9], 1.0f, kMaxRelativeError);
  EXPECT_NEAR(y[10], 1.0f, kMaxRelativeError);
  EXPECT_EQ(y[11], std::ldexp(1.0f, -126));
  EXPECT_EQ(y[12], std::ldexp(1.0f, 127));
}

// The softmax adds the probabilities of a row in fp32: rows of 128 scores after the max
// subtraction (x <= 8 with the lazy rescale; a quarter masked to -inf) sum to within the bound.
TEST_F(GpuExp2FmaTest, RowSumsWithinTheBound) {
  constexpr int kRows = 4096;
  constexpr int kKeys = 128;
  std::mt19937 gen(11);
  std::uniform_real_distribution<float> score(-24.0f, 8.0f);
  std::vector<float> x(kRows * kKeys);
  for (int i = 0; i < kRows * kKeys; ++i) x[i] = i % 4 == 3 ? -INFINITY : score(gen);
  const std::vector<float> y = exp2_fma_on_device(x);
  double worst = 0.0;
  for (int r = 0; r < kRows; ++r) {
    float sum = 0.0f;
    double exact = 0.0;
    for (int k = 0; k < kKeys; ++k) {
      sum += y[r * kKeys + k];
      exact += std::exp2(static_cast<double>(x[r * kKeys + k]));
    }
    worst = std::max(worst, std::fabs(static_cast<double>(sum) - exact) / exact);
  }
  EXPECT_LE(worst, kMaxRelativeError);
  RecordProperty("max_row_sum_relative_error", std::to_string(worst));
}

}  // namespace
}  // namespace flashkit
