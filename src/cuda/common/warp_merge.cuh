// src/cuda/common/warp_merge.cuh
// \brief The merge of warps that split one tile's keys: each warp ends its key loop with a
// normalised 16-row output and a log-sum-exp over its own keys; the tile's result is their sum
// weighted by exp(lse_warp - lse_total), the same rule that combines split-KV partials.
//
// Used by the kernels whose warps split keys rather than rows (the decode kernel, the native
// sparse attention forward). Shared memory: kWarps x 16 floats of lse, and a merge buffer of
// kWarps x 16 x kHeadDim floats that may reuse the K/V stages once every warp is past its last
// read of them (the barrier in publish_lse is that point).
//
//   merge.publish_lse(lse)      each warp's row lse values; barrier
//   merge.publish_output(o, lse) each warp's rows scaled by their weight; barrier
//     (or merge.publish_sum(acc): partial sums of the warps, weight 1, e.g. a gradient)
//   merge.row_sum(row, col)      four columns of one row, summed over the warps
//   merge.total_lse(row)         the row's lse over every warp's keys (-inf: no key anywhere)
#pragma once

#include <cmath>

namespace flashkit::sm80 {

template <int kWarps, int kHeadDim>
struct WarpMerge {
  static constexpr int kRows = 16;
  static constexpr int kDTiles = kHeadDim / 8;
  static constexpr int kLseBytes = kWarps * kRows * 4;
  static constexpr int kMergeBytes = kWarps * kRows * kHeadDim * 4;

  float* lse_smem;  // [warp][row]
  float* merge;     // [warp][row][kHeadDim]

  // Lanes 4k hold rows k and k + 8 (the mma accumulator layout). Ends with a barrier, after which
  // the merge buffer may be written.
  __device__ __forceinline__ void publish_lse(const float (&lse)[2], int warp, int lane) const {
    if (lane % 4 == 0) {
      lse_smem[warp * kRows + lane / 4] = lse[0];
      lse_smem[warp * kRows + lane / 4 + 8] = lse[1];
    }
    __syncthreads();
  }

  __device__ __forceinline__ float total_lse(int row) const {
    float m = -INFINITY;
#pragma unroll
    for (int w = 0; w < kWarps; ++w) m = fmaxf(m, lse_smem[w * kRows + row]);
    if (m == -INFINITY) return -INFINITY;
    float sum = 0.0f;
#pragma unroll
    for (int w = 0; w < kWarps; ++w) sum += __expf(lse_smem[w * kRows + row] - m);
    return m + __logf(sum);
  }

  // The warp's normalised output rows, weighted, into the merge buffer; ends with a barrier.
  __device__ __forceinline__ void publish_output(const float (&acc_o)[1][kDTiles][4], const float (&lse)[2],
                                                 int warp, int lane) const {
    float weight[2];
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      const float total = total_lse(lane / 4 + 8 * half);
      weight[half] = total == -INFINITY ? 0.0f : __expf(lse[half] - total);
    }
    store(acc_o, weight, warp, lane);
  }

  // Partial sums (not softmax outputs: no lse, weight 1) into the merge buffer, for row_sum; the
  // caller's barrier must precede it when the buffer reuses other data. Ends with a barrier.
  __device__ __forceinline__ void publish_sum(const float (&acc)[1][kDTiles][4], int warp, int lane) const {
    const float weight[2] = {1.0f, 1.0f};
    store(acc, weight, warp, lane);
  }

  // Columns col .. col + 3 of `row`, summed over the warps (col a multiple of 4).
  __device__ __forceinline__ float4 row_sum(int row, int col) const {
    float4 sum = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
#pragma unroll
    for (int w = 0; w < kWarps; ++w) {
      const float4 x = *reinterpret_cast<const float4*>(merge + (w * kRows + row) * kHeadDim + col);
      sum.x += x.x;
      sum.y += x.y;
      sum.z += x.z;
      sum.w += x.w;
    }
    return sum;
  }

 private:
  __device__ __forceinline__ void store(const float (&acc)[1][kDTiles][4], const float (&weight)[2], int warp,
                                        int lane) const {
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      float* merge_row = merge + (warp * kRows + lane / 4 + 8 * half) * kHeadDim + (lane % 4) * 2;
#pragma unroll
      for (int dt = 0; dt < kDTiles; ++dt) {
        *reinterpret_cast<float2*>(merge_row + dt * 8) =
            make_float2(acc[0][dt][2 * half] * weight[half], acc[0][dt][2 * half + 1] * weight[half]);
      }
    }
    __syncthreads();
  }
};

}  // namespace flashkit::sm80
