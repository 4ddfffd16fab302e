// src/common/half_float.h
// \brief Host-side conversions between float and the 16-bit storage types (fp16, bf16).
//
// The CPU reference reads fp16/bf16 tensors and writes them with round-to-nearest-even; tests use
// the same routines to build inputs. Values are carried as their raw 16-bit patterns.
#pragma once

#include <cstdint>
#include <cstring>

#include "flashkit/tensor.h"

namespace flashkit {

inline float bf16_bits_to_float(uint16_t bits) {
  uint32_t word = static_cast<uint32_t>(bits) << 16;
  float f;
  std::memcpy(&f, &word, sizeof(f));
  return f;
}

inline uint16_t float_to_bf16_bits(float f) {
  uint32_t word;
  std::memcpy(&word, &f, sizeof(word));
  if ((word & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((word >> 16) | 0x40u);  // NaN
  const uint32_t rounding_bias = 0x7fffu + ((word >> 16) & 1u);  // ties to even
  return static_cast<uint16_t>((word + rounding_bias) >> 16);
}

inline float fp16_bits_to_float(uint16_t bits) {
  const uint32_t sign = static_cast<uint32_t>(bits & 0x8000u) << 16;
  const uint32_t exponent = (bits >> 10) & 0x1fu;
  uint32_t mantissa = bits & 0x3ffu;
  uint32_t word;
  if (exponent == 0x1f) {
    word = sign | 0x7f800000u | (mantissa << 13);  // inf / NaN
  } else if (exponent != 0) {
    word = sign | ((exponent + 112u) << 23) | (mantissa << 13);
  } else if (mantissa == 0) {
    word = sign;  // signed zero
  } else {
    // Subnormal: shift the mantissa up until its leading one becomes the implicit bit.
    uint32_t e = 113;
    while ((mantissa & 0x400u) == 0) {
      mantissa <<= 1;
      --e;
    }
    word = sign | (e << 23) | ((mantissa & 0x3ffu) << 13);
  }
  float f;
  std::memcpy(&f, &word, sizeof(f));
  return f;
}

inline uint16_t float_to_fp16_bits(float f) {
  uint32_t word;
  std::memcpy(&word, &f, sizeof(word));
  const uint16_t sign = static_cast<uint16_t>((word >> 16) & 0x8000u);
  const uint32_t abs = word & 0x7fffffffu;
  if (abs > 0x7f800000u) return sign | 0x7e00u;             // NaN
  if (abs >= 0x477ff000u) return sign | 0x7c00u;            // rounds to >= 65520: inf
  if (abs < 0x33000001u) return sign;                       // below half the smallest subnormal
  const int32_t exponent = static_cast<int32_t>(abs >> 23) - 127;
  uint32_t mantissa = (abs & 0x7fffffu) | 0x800000u;        // with the implicit bit
  int shift;                                                // bits dropped from the 24-bit mantissa
  uint32_t half_exponent;
  if (exponent < -14) {                                     // fp16 subnormal
    shift = 13 + (-14 - exponent);
    half_exponent = 0;
  } else {
    shift = 13;
    half_exponent = static_cast<uint32_t>(exponent + 15);
  }
  uint32_t kept = mantissa >> shift;
  const uint32_t dropped = mantissa & ((1u << shift) - 1u);
  const uint32_t halfway = 1u << (shift - 1);
  if (dropped > halfway || (dropped == halfway && (kept & 1u))) ++kept;  // ties to even
  // `kept` holds the implicit bit for normals; adding the exponent field carries correctly on
  // mantissa overflow (and a subnormal that rounds up becomes the smallest normal).
  const uint32_t bits = half_exponent == 0 ? kept : ((half_exponent << 10) + (kept - 0x400u));
  return static_cast<uint16_t>(sign | bits);
}

inline float bits_to_float(DType dtype, uint16_t bits) {
  return dtype == DType::kBFloat16 ? bf16_bits_to_float(bits) : fp16_bits_to_float(bits);
}

inline uint16_t float_to_bits(DType dtype, float f) {
  return dtype == DType::kBFloat16 ? float_to_bf16_bits(f) : float_to_fp16_bits(f);
}

// Rounds a float to the nearest value representable in dtype (fp16 or bf16).
inline float round_to(DType dtype, float f) { return bits_to_float(dtype, float_to_bits(dtype, f)); }

}  // namespace flashkit
