// src/common/philox.h
// \brief Philox4x32-10 and the attention dropout mask built on it: one header for the host (the CPU
// reference, tests) and the device (the kernels), so that every pass draws the same bits.
//
// Philox4x32-10 (Salmon et al., "Parallel random numbers: as easy as 1, 2, 3", SC 2011) maps a
// 128-bit counter and a 64-bit key to 128 random bits with ten rounds of two 32x32->64-bit
// multiplies and a few XORs. It is stateless: any thread can draw the bits of any element directly,
// which is what lets a kernel tile, the backward pass and the reference agree without storing a
// mask.
//
// Addressing. The key is the caller's 64-bit seed. One Philox call yields 16 bytes, and each byte
// decides one element of the attention matrix (keep iff byte < keep_threshold, see below). The 16
// elements of one call are exactly what one lane of a warp holds of a 16-row x 32-key block of an
// mma.sync m16n8 accumulator: rows r and r + 8, keys 2c, 2c + 1 of four 8-key tiles. For element
// (bh = batch * heads_q + head, query row i, key j) of a sequence:
//   counter word 0, 1  offset + j / 32, as a 64-bit number (word 0 the low half)
//   counter word 2     (i / 16) * 32 + slot, slot = (i % 8) * 4 + (j % 8) / 2 (the fragment lane)
//   counter word 3     bh
//   byte               ((i % 16) / 8) * 8 + ((j % 32) / 8) * 2 + j % 2
//                      (of word byte / 4, bits 8 * (byte % 4) and up)
// so a lane holding S = Q K^T in that layout makes one call per 16 x 32 block and uses all 16
// bytes. A kernel holding S^T (keys as rows) gets the same count with one exchange of two words
// between lane pairs (cuda/common/dropout_mask.cuh, mark_dropped_transposed). Row and key indices
// are those within the sequence (varlen: relative to the sequence's first token), so a sequence's
// mask does not depend on how the batch was packed.
//
// Offset. A call's counters use the low 64-bit words offset .. offset + ceil(seqlen_k / 32) - 1; a
// caller that wants independent masks for two calls with the same seed advances the offset by at
// least ceil(max_seqlen_k / 32) between them (the PyTorch front end reserves that much of the
// generator's Philox offset per call). Calls whose offsets differ by less see masks shifted by
// 32-key groups, which are different masks but not independent ones.
//
// Resolution: 8 bits per decision. 16 decisions per call keep the mask at about six integer
// instructions per element in the sm80 forward (SASS: ~370 per lane for 64 elements, 4 calls, at
// d128); 32-bit uniforms would cost four calls per 16 elements. The price is that the keep probability is a multiple of 1/256:
// keep_threshold = round(256 * (1 - p)) and an element is kept iff its byte < keep_threshold, so
// the realised keep rate is within 1/512 of 1 - p (p = 0.1 keeps 230/256 = 0.8984), and p < 1/512
// drops nothing. Kept values are scaled by 1 / (1 - p), as in FlashAttention.
#pragma once

#include <cstdint>

#if defined(__CUDACC__)
#define FLASHKIT_HOST_DEVICE __host__ __device__ __forceinline__
#else
#define FLASHKIT_HOST_DEVICE inline
#endif

namespace flashkit {

// 128 random bits.
struct PhiloxBlock {
  uint32_t word[4];
};

// The 64-bit product of two 32-bit words. On the device, mul.wide.u32 becomes one IMAD.WIDE.U32;
// the plain 64-bit multiply compiles to that plus an add of a zero high-word term per product
// (nvcc 13), a sixth of the RNG's instructions.
FLASHKIT_HOST_DEVICE uint64_t mul_wide_u32(uint32_t a, uint32_t b) {
#if defined(__CUDA_ARCH__)
  uint64_t product;
  asm("mul.wide.u32 %0, %1, %2;" : "=l"(product) : "r"(a), "r"(b));
  return product;
#else
  return static_cast<uint64_t>(a) * b;
#endif
}

constexpr uint32_t kPhiloxWeyl0 = 0x9E3779B9u;  // golden ratio
constexpr uint32_t kPhiloxWeyl1 = 0xBB67AE85u;  // sqrt(3) - 1

// One Philox4x32 round on counter (c0, c1, c2, c3) with round key (k0, k1).
FLASHKIT_HOST_DEVICE void philox_round(uint32_t& c0, uint32_t& c1, uint32_t& c2, uint32_t& c3, uint32_t k0,
                                       uint32_t k1) {
  constexpr uint32_t kMultiplier0 = 0xD2511F53u;
  constexpr uint32_t kMultiplier1 = 0xCD9E8D57u;
  const uint64_t product0 = mul_wide_u32(kMultiplier0, c0);
  const uint64_t product1 = mul_wide_u32(kMultiplier1, c2);
  const uint32_t hi0 = static_cast<uint32_t>(product0 >> 32);
  const uint32_t hi1 = static_cast<uint32_t>(product1 >> 32);
  c0 = hi1 ^ c1 ^ k0;
  c1 = static_cast<uint32_t>(product1);
  c2 = hi0 ^ c3 ^ k1;
  c3 = static_cast<uint32_t>(product0);
}

// Philox4x32 with 10 rounds on counter (c0, c1, c2, c3) and key (k0, k1), as in Random123.
FLASHKIT_HOST_DEVICE PhiloxBlock philox4x32_10(uint32_t c0, uint32_t c1, uint32_t c2, uint32_t c3,
                                               uint32_t k0, uint32_t k1) {
#if defined(__CUDA_ARCH__)
#pragma unroll
#endif
  for (int round = 0; round < 10; ++round) {
    philox_round(c0, c1, c2, c3, k0, k1);
    k0 += kPhiloxWeyl0;
    k1 += kPhiloxWeyl1;
  }
  return {{c0, c1, c2, c3}};
}

// The ten round keys of a Philox4x32-10 key, for a kernel that draws many calls in a loop: kept in
// shared memory and loaded per batch of calls, they cost five 16-byte loads instead of eighteen
// adds, and no registers between the batches (the compiler otherwise holds all of them).
struct alignas(16) PhiloxRoundKeys {
  uint32_t k0[10];
  uint32_t k1[10];

  FLASHKIT_HOST_DEVICE static PhiloxRoundKeys of(uint32_t k0, uint32_t k1) {
    PhiloxRoundKeys keys{};
    for (int round = 0; round < 10; ++round) {
      keys.k0[round] = k0 + static_cast<uint32_t>(round) * kPhiloxWeyl0;
      keys.k1[round] = k1 + static_cast<uint32_t>(round) * kPhiloxWeyl1;
    }
    return keys;
  }
};

// philox4x32_10 with the key's round keys given.
FLASHKIT_HOST_DEVICE PhiloxBlock philox4x32_10(uint32_t c0, uint32_t c1, uint32_t c2, uint32_t c3,
                                               const PhiloxRoundKeys& keys) {
#if defined(__CUDA_ARCH__)
#pragma unroll
#endif
  for (int round = 0; round < 10; ++round) philox_round(c0, c1, c2, c3, keys.k0[round], keys.k1[round]);
  return {{c0, c1, c2, c3}};
}

// round(256 * (1 - p)) for p in [0, 1): elements whose byte is below it are kept. 256 (p < 1/512)
// keeps everything. Plain float arithmetic, exact in 1 - p's rounding on host and device alike
// (the multiply by 256 is exact, so a fused multiply-add gives the same result).
FLASHKIT_HOST_DEVICE uint32_t dropout_keep_threshold(float p) {
  return static_cast<uint32_t>((1.0f - p) * 256.0f + 0.5f);
}

// The dropout mask of one call: its seed, offset and keep threshold.
struct DropoutMask {
  uint64_t seed = 0;
  uint64_t offset = 0;
  uint32_t keep_threshold = 256;

  // The 16 bytes of the 16-row x 32-key block with first row 16 * row16 and first key 32 * key32,
  // as seen by fragment lane `slot` (see the header comment).
  FLASHKIT_HOST_DEVICE PhiloxBlock block(uint32_t bh, uint32_t row16, uint32_t slot,
                                         uint32_t key32) const {
    const uint64_t column = offset + key32;
    return philox4x32_10(static_cast<uint32_t>(column), static_cast<uint32_t>(column >> 32),
                         row16 * 32u + slot, bh, static_cast<uint32_t>(seed),
                         static_cast<uint32_t>(seed >> 32));
  }

  // block() with the seed's round keys given (round_keys()).
  FLASHKIT_HOST_DEVICE PhiloxBlock block(uint32_t bh, uint32_t row16, uint32_t slot, uint32_t key32,
                                         const PhiloxRoundKeys& keys) const {
    const uint64_t column = offset + key32;
    return philox4x32_10(static_cast<uint32_t>(column), static_cast<uint32_t>(column >> 32),
                         row16 * 32u + slot, bh, keys);
  }

  FLASHKIT_HOST_DEVICE PhiloxRoundKeys round_keys() const {
    return PhiloxRoundKeys::of(static_cast<uint32_t>(seed), static_cast<uint32_t>(seed >> 32));
  }

  // Whether byte `byte` (0..15) of `bits` keeps its element: byte < keep_threshold, tested without
  // extracting the byte (one shift and one compare on the device). Shifted to the top of the word,
  // the byte compares against the threshold placed there; the bytes below it matter only when the
  // two are equal, and then the element is dropped either way. A threshold of 256 keeps all.
  FLASHKIT_HOST_DEVICE bool keeps(const PhiloxBlock& bits, int byte) const {
    return keeps_byte(bits.word[byte / 4], byte % 4);
  }

  // The same test on byte `byte` (0..3) of one word (a kernel that regroups the bytes of its calls).
  FLASHKIT_HOST_DEVICE bool keeps_byte(uint32_t word, int byte) const {
    const uint32_t top = word << (24 - 8 * byte);
    return top < (keep_threshold << 24) || keep_threshold >= 256u;
  }

  // Element (bh, i, j) alone: one Philox call for one decision (tests, the reference).
  FLASHKIT_HOST_DEVICE bool keep(uint32_t bh, uint32_t i, uint32_t j) const {
    const PhiloxBlock bits = block(bh, i / 16, (i % 8) * 4 + (j % 8) / 2, j / 32);
    return keeps(bits, byte_of(i, j));
  }

  FLASHKIT_HOST_DEVICE static int byte_of(uint32_t i, uint32_t j) {
    return static_cast<int>(((i % 16) / 8) * 8 + ((j % 32) / 8) * 2 + j % 2);
  }
};

}  // namespace flashkit
