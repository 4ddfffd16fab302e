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
// 8-column groups). A layout with keys as rows (S^T) does not map this way.
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

}  // namespace flashkit::sm80
