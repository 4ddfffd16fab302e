// src/cuda/common/online_softmax.cuh
// \brief The streaming softmax of one warp's rows, in base 2, over score tiles held in mma.sync
// accumulator fragments.
//
// Each lane holds, for every 16-row mma tile, two rows (g and g + 8) and two columns per 8-column
// tile. The four lanes of a quad (same g) together hold a whole row, so row reductions are two
// shuffles. Scores x are turned into probabilities as exp2(x * log2_scale - max * log2_scale): one
// FFMA and one MUFU.EX2 per element (exp2 rather than exp so that the scale folds into the FFMA).
// The running sum stays per lane (the rescale factor is uniform across the quad) and is reduced only
// once, at the end.
#pragma once

#include <cmath>

namespace flashkit::sm80 {

__device__ __forceinline__ float quad_max(float v) {
  v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, 1));
  return fmaxf(v, __shfl_xor_sync(0xffffffffu, v, 2));
}

__device__ __forceinline__ float quad_sum(float v) {
  v += __shfl_xor_sync(0xffffffffu, v, 1);
  return v + __shfl_xor_sync(0xffffffffu, v, 2);
}

// kMTiles 16-row tiles, kNTiles 8-column score tiles, kDTiles 8-column output tiles per lane.
template <int kMTiles, int kNTiles, int kDTiles>
struct OnlineSoftmax {
  static constexpr int kRows = 2 * kMTiles;  // rows per lane: (tile, g) and (tile, g + 8)
  float row_max[kRows];                      // in score units; -inf until a key is seen
  float row_sum[kRows];                      // this lane's share of sum(exp2(...))

  __device__ __forceinline__ void init() {
#pragma unroll
    for (int r = 0; r < kRows; ++r) {
      row_max[r] = -INFINITY;
      row_sum[r] = 0.0f;
    }
  }

  // Folds one block of scores into the running state: scores become probabilities in place and the
  // output accumulator is rescaled to the new row maxima. Masked scores are -inf.
  __device__ __forceinline__ void update(float (&scores)[kMTiles][kNTiles][4],
                                         float (&out)[kMTiles][kDTiles][4], float log2_scale) {
#pragma unroll
    for (int mt = 0; mt < kMTiles; ++mt) {
#pragma unroll
      for (int half = 0; half < 2; ++half) {
        const int r = 2 * mt + half;
        float block_max = -INFINITY;
#pragma unroll
        for (int nt = 0; nt < kNTiles; ++nt) {
          block_max = fmaxf(block_max, fmaxf(scores[mt][nt][2 * half], scores[mt][nt][2 * half + 1]));
        }
        const float new_max = fmaxf(row_max[r], quad_max(block_max));
        // A row that has seen only masked keys keeps max -inf; subtracting 0 instead keeps every
        // exp2 at exp2(-inf) = 0 rather than NaN.
        const float max_scaled = new_max == -INFINITY ? 0.0f : new_max * log2_scale;
        const float rescale = exp2f(row_max[r] * log2_scale - max_scaled);
        row_max[r] = new_max;
        float sum = 0.0f;
#pragma unroll
        for (int nt = 0; nt < kNTiles; ++nt) {
#pragma unroll
          for (int e = 0; e < 2; ++e) {
            const float p = exp2f(scores[mt][nt][2 * half + e] * log2_scale - max_scaled);
            scores[mt][nt][2 * half + e] = p;
            sum += p;
          }
        }
        row_sum[r] = row_sum[r] * rescale + sum;
#pragma unroll
        for (int dt = 0; dt < kDTiles; ++dt) {
          out[mt][dt][2 * half] *= rescale;
          out[mt][dt][2 * half + 1] *= rescale;
        }
      }
    }
  }

  // Normalizes the output rows and returns each row's natural-log log-sum-exp in `lse`
  // (-inf and a zero row where no key was visible).
  __device__ __forceinline__ void finalize(float (&out)[kMTiles][kDTiles][4], float log2_scale,
                                           float (&lse)[kRows]) {
    constexpr float kLn2 = 0.69314718055994530942f;
#pragma unroll
    for (int mt = 0; mt < kMTiles; ++mt) {
#pragma unroll
      for (int half = 0; half < 2; ++half) {
        const int r = 2 * mt + half;
        const float sum = quad_sum(row_sum[r]);
        const bool empty = !(sum > 0.0f);
        const float inv = empty ? 0.0f : 1.0f / sum;
        lse[r] = empty ? -INFINITY : (row_max[r] * log2_scale + __log2f(sum)) * kLn2;
#pragma unroll
        for (int dt = 0; dt < kDTiles; ++dt) {
          out[mt][dt][2 * half] *= inv;
          out[mt][dt][2 * half + 1] *= inv;
        }
      }
    }
  }
};

}  // namespace flashkit::sm80
