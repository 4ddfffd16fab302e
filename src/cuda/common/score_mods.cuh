// src/cuda/common/score_mods.cuh
// \brief Softcap, ALiBi and masking applied to a warp's score tile in the mma.sync accumulator
// layout (kMTiles 16-row tiles x kNTiles 8-column groups, 4 floats each; lane g = lane / 4 holds rows
// g and g + 8, lane t = lane % 4 columns 2t and 2t + 1 of each group). Shared by the sm80 kernels
// and the sm90 forward, whose m64nN wgmma accumulator is that layout for each warp's 16 rows.
#pragma once

#include <cmath>

#include "common/fwd_problem.h"
#include "cuda/common/attention_mask.cuh"

namespace flashkit::sm80 {

// Raw dot products to scores in natural units, `kCount` of them in place: softcap * tanh(scale * x /
// softcap) when softcap is on, else scale * x. One uniform branch, unrolled loops on either side.
template <int kCount>
__device__ __forceinline__ void scale_or_softcap(float* x, const FwdProblem& p) {
  if (p.softcap > 0.0f) {
    // softcap * tanh(y), tanh(y) = 1 - 2 / (exp(2y) + 1): accurate to ~1e-7 absolute with the fast
    // exp, unlike tanh.approx (~5e-4 relative), which softcap would magnify by `softcap`.
    const float two_over_softcap = 2.0f * p.softmax_scale / p.softcap;
#pragma unroll
    for (int i = 0; i < kCount; ++i) {
      x[i] = p.softcap * (1.0f - __fdividef(2.0f, __expf(x[i] * two_over_softcap) + 1.0f));
    }
  } else {
#pragma unroll
    for (int i = 0; i < kCount; ++i) x[i] *= p.softmax_scale;
  }
}

// Softcap and ALiBi turn the raw dot products into scores in natural units. Each modification is
// one loop behind one uniform branch, so the unrolled per-element code carries no branches and the
// main loop's code stays compact (three inlined variants, one per combination, cost 3% at d128).
template <typename Traits>
__device__ __forceinline__ void transform_scores(float (&s)[Traits::kMTiles][Traits::kNTiles][4],
                                                 const FwdProblem& p, int first_row, int first_key,
                                                 float alibi_slope, int diagonal_offset) {
  scale_or_softcap<Traits::kMTiles * Traits::kNTiles * 4>(&s[0][0][0], p);
  if (alibi_slope != 0.0f) {
    const int lane = static_cast<int>(threadIdx.x) % 32;
#pragma unroll
    for (int mt = 0; mt < Traits::kMTiles; ++mt) {
#pragma unroll
      for (int half = 0; half < 2; ++half) {
        const int row = first_row + mt * 16 + lane / 4 + half * 8;
#pragma unroll
        for (int nt = 0; nt < Traits::kNTiles; ++nt) {
#pragma unroll
          for (int e = 0; e < 2; ++e) {
            const int key = first_key + nt * 8 + (lane % 4) * 2 + e;
            s[mt][nt][2 * half + e] += alibi_bias(alibi_slope, row, key, diagonal_offset);
          }
        }
      }
    }
  }
}

// Sets the scores of keys a row may not see to -inf. Only blocks cut by the mask call this.
// tokens[mt][half]: the query token of this lane's row mt * 16 + lane / 4 + half * 8 of the tile
// (the sm90 forward's packed query heads hold several rows per token; computed once per tile).
template <typename Traits>
__device__ __forceinline__ void mask_scores(float (&s)[Traits::kMTiles][Traits::kNTiles][4],
                                            const KeyWindow& window, const int (&tokens)[Traits::kMTiles][2],
                                            int first_key) {
  const int lane = static_cast<int>(threadIdx.x) % 32;
  const int lane_key = first_key + (lane % 4) * 2;
#pragma unroll
  for (int mt = 0; mt < Traits::kMTiles; ++mt) {
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      // Visible columns of this lane, relative to its first key: [begin, end).
      const int begin = window.key_begin(tokens[mt][half]) - lane_key;
      const int end = window.key_end(tokens[mt][half]) - lane_key;
#pragma unroll
      for (int nt = 0; nt < Traits::kNTiles; ++nt) {
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          const int column = nt * 8 + e;
          if (column < begin || column >= end) s[mt][nt][2 * half + e] = -INFINITY;
        }
      }
    }
  }
}

// The same where row r of the tile is token first_row + r (the sm80 kernels).
template <typename Traits>
__device__ __forceinline__ void mask_scores(float (&s)[Traits::kMTiles][Traits::kNTiles][4],
                                            const KeyWindow& window, int first_row, int first_key) {
  const int lane = static_cast<int>(threadIdx.x) % 32;
  int tokens[Traits::kMTiles][2];
#pragma unroll
  for (int mt = 0; mt < Traits::kMTiles; ++mt) {
#pragma unroll
    for (int half = 0; half < 2; ++half) tokens[mt][half] = first_row + mt * 16 + lane / 4 + half * 8;
  }
  mask_scores<Traits>(s, window, tokens, first_key);
}

}  // namespace flashkit::sm80
