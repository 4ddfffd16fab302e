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
  float row_max[kRows];                      // reference max, in score units; -inf until a key
  float row_sum[kRows];                      // this lane's share of sum(exp2(...))

  __device__ __forceinline__ void init() {
#pragma unroll
    for (int r = 0; r < kRows; ++r) {
      row_max[r] = -INFINITY;
      row_sum[r] = 0.0f;
    }
  }

  // Folds one block of scores into the running state: scores become probabilities in place. Masked
  // scores are -inf.
  //
  // Lazy rescaling: a row's reference max moves only when the block's max exceeds it by more than
  // kRescaleThreshold (log2 units). Otherwise the probabilities are exp2 of at most that much
  // (<= 256), harmless in fp32 sums and in the 16-bit P (bf16 and fp16 keep their relative
  // precision there), and the final normalization uses the same reference max, so the result is
  // unchanged. Past the first blocks the maxima rarely jump that far, so the warp skips the
  // rescale of its whole output accumulator (D / 8 * 4 FMULs per row pair) on almost every block.
  __device__ __forceinline__ void update(float (&scores)[kMTiles][kNTiles][4],
                                         float (&out)[kMTiles][kDTiles][4], float log2_scale) {
    float rescale[kRows];
    if (advance_max(scores, log2_scale, rescale)) rescale_output(out, rescale);
    exponentiate(scores, log2_scale);
  }

  // update() in three steps, for kernels whose output accumulator is still being written by an
  // asynchronous matrix product when the next block's scores arrive (sm90): advance_max and
  // exponentiate need only the scores; rescale_output runs once the accumulator is settled.
  //
  // advance_max moves the reference maxima (see update) and scales the row sums; it returns whether
  // any row of the warp moved, and then `rescale` holds each row's factor for rescale_output.
  __device__ __forceinline__ bool advance_max(const float (&scores)[kMTiles][kNTiles][4],
                                              float log2_scale, float (&rescale)[kRows]) {
    bool any_rescale = false;
#pragma unroll
    for (int r = 0; r < kRows; ++r) any_rescale |= advance_row_max(scores, r, log2_scale, rescale[r]);
    const bool any = __any_sync(0xffffffffu, any_rescale);
    if (any) {
#pragma unroll
      for (int r = 0; r < kRows; ++r) row_sum[r] *= rescale[r];
    }
    return any;
  }

  __device__ __forceinline__ void rescale_output(float (&out)[kMTiles][kDTiles][4],
                                                 const float (&rescale)[kRows]) const {
#pragma unroll
    for (int mt = 0; mt < kMTiles; ++mt)
#pragma unroll
      for (int dt = 0; dt < kDTiles; ++dt)
#pragma unroll
        for (int i = 0; i < 4; ++i) out[mt][dt][i] *= rescale[2 * mt + i / 2];
  }

  // Scores -> probabilities against the current reference maxima, added to the row sums.
  __device__ __forceinline__ void exponentiate(float (&scores)[kMTiles][kNTiles][4], float log2_scale) {
#pragma unroll
    for (int r = 0; r < kRows; ++r) row_sum[r] += exponentiate_row(scores, r, log2_scale);
  }

  // advance_max and exponentiate one row after the other (the sm90 forward, where its traits say
  // so): the first row's exponentials, the MUFU-bound part of the softmax, need not wait for the
  // second row's maximum, and ptxas then interleaves the packing of P with them. The row sums take
  // each row's factor (1 where its reference did not move: an exact no-op) without waiting for the
  // warp's vote.
  __device__ __forceinline__ bool advance_max_and_exponentiate(float (&scores)[kMTiles][kNTiles][4],
                                                               float log2_scale, float (&rescale)[kRows]) {
    bool any_rescale = false;
#pragma unroll
    for (int r = 0; r < kRows; ++r) {
      any_rescale |= advance_row_max(scores, r, log2_scale, rescale[r]);
      row_sum[r] = row_sum[r] * rescale[r] + exponentiate_row(scores, r, log2_scale);
    }
    return __any_sync(0xffffffffu, any_rescale);
  }

  // Normalizes the output rows (and multiplies them by out_scale: dropout's 1 / (1 - p)) and
  // returns each row's natural-log log-sum-exp in `lse` (-inf and a zero row where no key was
  // visible).
  __device__ __forceinline__ void finalize(float (&out)[kMTiles][kDTiles][4], float log2_scale,
                                           float (&lse)[kRows], float out_scale = 1.0f) {
    constexpr float kLn2 = 0.69314718055994530942f;
#pragma unroll
    for (int mt = 0; mt < kMTiles; ++mt) {
#pragma unroll
      for (int half = 0; half < 2; ++half) {
        const int r = 2 * mt + half;
        const float sum = quad_sum(row_sum[r]);
        const bool empty = !(sum > 0.0f);
        const float inv = empty ? 0.0f : (1.0f / sum) * out_scale;
        lse[r] = empty ? -INFINITY : (row_max[r] * log2_scale + __log2f(sum)) * kLn2;
#pragma unroll
        for (int dt = 0; dt < kDTiles; ++dt) {
          out[mt][dt][2 * half] *= inv;
          out[mt][dt][2 * half + 1] *= inv;
        }
      }
    }
  }

 private:
  // Row r (tile r / 2, half r % 2) of the block: moves its reference max if the block's max exceeds
  // it by more than kRescaleThreshold; returns whether it moved, with the factor in `rescale`.
  __device__ __forceinline__ bool advance_row_max(const float (&scores)[kMTiles][kNTiles][4], int r,
                                                  float log2_scale, float& rescale) {
    constexpr float kRescaleThreshold = 8.0f;
    const int mt = r / 2;
    const int half = r % 2;
    float block_max = -INFINITY;
#pragma unroll
    for (int nt = 0; nt < kNTiles; ++nt) {
      block_max = fmaxf(block_max, fmaxf(scores[mt][nt][2 * half], scores[mt][nt][2 * half + 1]));
    }
    block_max = quad_max(block_max);
    // -inf - -inf is NaN, which compares false: a row that has seen only masked keys stays at
    // -inf with nothing to rescale.
    const bool grow = (block_max - row_max[r]) * log2_scale > kRescaleThreshold;
    rescale = grow ? exp2f((row_max[r] - block_max) * log2_scale) : 1.0f;
    if (grow) row_max[r] = block_max;
    return grow;
  }

  // Row r's scores -> probabilities against its reference max; returns their sum (this lane's).
  __device__ __forceinline__ float exponentiate_row(float (&scores)[kMTiles][kNTiles][4], int r,
                                                    float log2_scale) const {
    const int mt = r / 2;
    const int half = r % 2;
    // Subtracting 0 for a row still at -inf keeps every exp2 at exp2(-inf) = 0, not NaN.
    const float max_scaled = row_max[r] == -INFINITY ? 0.0f : row_max[r] * log2_scale;
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
    return sum;
  }
};

}  // namespace flashkit::sm80
