// src/cuda/common/dropout_mask.cuh
// \brief Dropout applied to a warp's probability tile in the mma.sync accumulator layout (kMTiles
// 16-row tiles x kNTiles 8-column groups, 4 floats each; lane g = lane / 4 holds rows g and g + 8,
// lane t = lane % 4 columns 2t and 2t + 1 of each group), with the Philox mask of common/philox.h.
// The m64nN wgmma accumulator of an sm90 warpgroup is that layout for each warp's 16 rows, so a
// Hopper kernel can use this too.
//
// The mask's addressing is built for this layout: with the tile's first row a multiple of 16 and
// its first key a multiple of 32, lane l is Philox slot l of every 16 x 32 block, and one Philox
// call gives it exactly its 16 elements of the block (rows g, g + 8 x keys 2t, 2t + 1 of four
// 8-column groups). The backward's S^T tile (keys as rows) maps onto it with one exchange between
// lane pairs: see mark_dropped_transposed.
#pragma once

#include <cstdint>

#include "common/philox.h"

namespace flashkit::sm80 {

// Sets the probabilities that the mask drops to 0 (the 1 / (1 - p) scale of the kept ones is the
// caller's, applied once to the output). Rows first_row + mt * 16 + g (+ 8), keys first_key +
// nt * 8 + 2t (+ 1); first_row must be a multiple of 16 and first_key of 32.
template <int kMTiles, int kNTiles>
__device__ __forceinline__ void apply_dropout(float (&p)[kMTiles][kNTiles][4],
                                              const DropoutMask& mask, uint32_t batch_head,
                                              int first_row, int first_key) {
  static_assert(kNTiles % 4 == 0, "a Philox call covers four 8-key groups");
  const uint32_t lane = threadIdx.x % 32;
#pragma unroll
  for (int mt = 0; mt < kMTiles; ++mt) {
    const uint32_t row16 = static_cast<uint32_t>(first_row + mt * 16) / 16;
#pragma unroll
    for (int group = 0; group < kNTiles / 4; ++group) {
      const PhiloxBlock bits =
          mask.block(batch_head, row16, lane, static_cast<uint32_t>(first_key) / 32 + group);
#pragma unroll
      for (int half = 0; half < 2; ++half) {
#pragma unroll
        for (int tile = 0; tile < 4; ++tile) {
#pragma unroll
          for (int e = 0; e < 2; ++e) {
            if (!mask.keeps(bits, half * 8 + tile * 2 + e))
              p[mt][4 * group + tile][2 * half + e] = 0.0f;
          }
        }
      }
    }
  }
}

// The backward's S^T tile: kKeyTiles 16-key row tiles x kQueryTiles 8-query column groups, lane
// g = lane / 4 holding keys g, g + 8 and lane t = lane % 4 queries 2t, 2t + 1 of each. Dropped
// probabilities get their sign flipped instead of being zeroed (P >= 0): dV wants the kept P,
// max(P, 0), and dS wants both P and the decision, |P| and the sign.
//
// Element (query i, key j) of lane (g, t) has i % 8 = 2t + e and j % 8 = g, so its Philox slot
// (i % 8) * 4 + (j % 8) / 2 = (2t + e) * 4 + g / 2 is shared by lanes g and g ^ 1 (lane ^ 4) for
// both e, and its byte ((i % 16) / 8) * 8 + ((j % 32) / 8) * 2 + j % 2 has j % 2 = g % 2: per 16
// queries x 32 keys the pair needs two calls (e = 0, 1) and each lane half of each call's bytes.
// Lane g draws the call of e = g % 2, keeps the 8 bytes of its key parity and trades the other 8
// for its partner's: one call, four byte_perm and two shuffles per 16 decisions, the forward's
// count. With 16 keys per warp (kKeyTiles == 1) half of the decisions belong to another warp and
// are drawn there too. first_query must be a multiple of 16 and first_key of 16 (32 when the warp
// spans 32 keys or more).
template <int kKeyTiles, int kQueryTiles>
__device__ __forceinline__ void mark_dropped_transposed(float (&p)[kKeyTiles][kQueryTiles][4],
                                                        const DropoutMask& mask, uint32_t batch_head,
                                                        int first_key, int first_query) {
  static_assert(kQueryTiles % 2 == 0, "a Philox call covers two 8-query groups");
  static_assert(kKeyTiles == 1 || kKeyTiles % 2 == 0, "a Philox call covers 32 keys");
  constexpr int kKeyBlocks = (kKeyTiles + 1) / 2;     // 32-key blocks of the warp
  constexpr int kTilesPerBlock = kKeyTiles == 1 ? 1 : 2;
  const uint32_t lane = threadIdx.x % 32;
  const uint32_t parity = (lane / 4) % 2;
  const uint32_t slot = ((lane % 4) * 2 + parity) * 4 + lane / 8;
  // __byte_perm selectors taking the even (odd) bytes of two words, in order: bytes 2c + parity of
  // words 2h, 2h + 1 are the decisions of key groups c = 0..3 of this parity.
  const uint32_t own_bytes = parity != 0 ? 0x7531u : 0x6420u;
  const uint32_t partner_bytes = parity != 0 ? 0x6420u : 0x7531u;
  // The warp's first 8-key group within its 32-key block (0 or 2 with 16 keys per warp).
  const int first_group = kKeyTiles == 1 ? (first_key % 32) / 8 : 0;
#pragma unroll
  for (int m = 0; m < kQueryTiles / 2; ++m) {
    const uint32_t row16 = static_cast<uint32_t>(first_query) / 16 + m;
#pragma unroll
    for (int kb = 0; kb < kKeyBlocks; ++kb) {
      const PhiloxBlock bits =
          mask.block(batch_head, row16, slot, static_cast<uint32_t>(first_key) / 32 + kb);
      // by_query[e][h]: byte c decides key group c for query 16 * row16 + 8h + 2t + e.
      uint32_t by_query[2][2];
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const uint32_t own = __byte_perm(bits.word[2 * h], bits.word[2 * h + 1], own_bytes);
        const uint32_t sent = __byte_perm(bits.word[2 * h], bits.word[2 * h + 1], partner_bytes);
        const uint32_t received = __shfl_xor_sync(0xffffffffu, sent, 4);
        by_query[0][h] = parity != 0 ? received : own;
        by_query[1][h] = parity != 0 ? own : received;
      }
#pragma unroll
      for (int tile = 0; tile < kTilesPerBlock; ++tile) {
#pragma unroll
        for (int half = 0; half < 2; ++half) {
          const int group = first_group + 2 * tile + half;
#pragma unroll
          for (int h = 0; h < 2; ++h) {
#pragma unroll
            for (int e = 0; e < 2; ++e) {
              float& x = p[kb * kTilesPerBlock + tile][2 * m + h][2 * half + e];
              if (!mask.keeps_byte(by_query[e][h], group)) x = -x;
            }
          }
        }
      }
    }
  }
}

}  // namespace flashkit::sm80
