// src/cuda/common/exp2_fma.cuh
// \brief 2^x on the FMA pipe: a polynomial stand-in for MUFU.EX2, for kernels whose softmax is bound
// by the multi-function unit.
//
// Why: an SM's MUFU computes 16 exponentials per clock, a quarter of its FP32 rate. At head dim 64
// the forward's 128 x 128 score block costs as many MUFU clocks (16384 / 16 = 1024) as its two
// matrix products cost tensor clocks (4.2 MFLOP at ~4096 FLOP per clock), so the softmax keeps up
// with the tensor cores only if the overlap is perfect. Moving a fraction of the exponentials to the
// FMA pipe trades MUFU clocks for issue slots (FlashAttention-4 does this on Blackwell).
//
// How (9 instructions, none on MUFU: max, 3 adds, 3 FMAs, shift, multiply):
//   x <- max(x, -127)                       NaN stays NaN; -inf and very negative x become -127
//   t =  x + (1.5 * 2^23 + 127), rounded down: floor(x) + 127 lands in t's low mantissa bits
//   j =  t - (1.5 * 2^23 + 127) = floor(x)  exact
//   f =  x - j                             in [0, 1), exact
//   p =  1 + f (c1 + f (c2 + f c3))        ~ 2^f in [1, 2); minimax in relative error with p(0) = 1
//   2^x = p * 2^j, 2^j built as the bits (floor(x) + 127) << 23
// The coefficients: Remez exchange for the relative error of a cubic with p(0) = 1 on [0, 1],
// rounded to fp32; max relative error 8.6e-5 (the 16-bit probabilities round at 3.9e-3 (bf16)
// and 4.9e-4 (fp16)). p(0) = 1 makes 2^x exact at integers (2^0 = 1, as MUFU gives) and p >= 1.
//
// Domain and special values: x < 128. Results below 2^-126 are flushed to zero as MUFU.EX2.FTZ
// flushes them: x < -126 (and -inf) has j = -127, whose scale is exactly 0, so 2^x = +0. NaN ->
// NaN (NaN * the scale). The softmax feeds it x <= kRescaleThreshold (online_softmax.cuh).
#pragma once

#include <cstdint>

namespace flashkit {

__device__ __forceinline__ float exp2_fma(float x) {
  constexpr float kC1 = 0.6951167583465576f;
  constexpr float kC2 = 0.22764499485492706f;
  constexpr float kC3 = 0.07706703990697861f;
  // 1.5 * 2^23 puts the units digit of any |x| < 2^22 at the last mantissa bit; + 127 biases it to
  // an fp32 exponent.
  constexpr float kShifter = 12582912.0f + 127.0f;
  float clamped;
  asm("max.NaN.f32 %0, %1, %2;\n" : "=f"(clamped) : "f"(x), "f"(-127.0f));
  const float shifted = __fadd_rd(clamped, kShifter);
  const float whole = shifted - kShifter;
  const float frac = clamped - whole;
  const float poly = fmaf(fmaf(fmaf(kC3, frac, kC2), frac, kC1), frac, 1.0f);
  const float scale = __uint_as_float(__float_as_uint(shifted) << 23);
  return poly * scale;
}

}  // namespace flashkit
