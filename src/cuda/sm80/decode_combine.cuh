// src/cuda/sm80/decode_combine.cuh
// \brief The combine pass of split-KV decoding: per query row, the fp32 partial outputs O_s and
// log-sum-exps L_s of the splits merge into
//     L = log(sum_s exp(L_s)),   O = sum_s exp(L_s - L) O_s,
// written as the 16-bit output and softmax_lse. A split that saw no key has L_s = -inf (weight 0);
// a row no split saw gets O = 0 and L = -inf, as an unsplit launch writes.
//
// One warp per row (rows ordered [batch, heads_q, seqlen_q] like the workspace); lanes hold four
// columns each per 128-column pass, so every partial row is read once with 16-byte loads.
#pragma once

#include <cstdint>

#include "common/kvcache_problem.h"
#include "cuda/common/mma_sm80.cuh"
#include "cuda/common/programmatic_launch.cuh"
#include "cuda/sm80/decode_sm80.h"

namespace flashkit::sm80 {

constexpr int kCombineWarps = 4;
constexpr int kSplitsInFlight = 8;

template <typename Element, int kHeadDim>
__global__ void __launch_bounds__(kCombineWarps * 32)
    decode_combine_kernel(const __grid_constant__ KvcacheProblem p) {
  // Launched as a programmatic dependent of the decode kernel: its launch overlaps the decode's
  // tail, and it waits here for the decode's partials.
  wait_for_prior_grids();
  allow_dependent_grids();
  constexpr int kPasses = (kHeadDim + 127) / 128;
  const int lane = static_cast<int>(threadIdx.x) % 32;
  const int64_t rows = static_cast<int64_t>(p.batch) * p.heads_q * p.seqlen_q;
  const int64_t row = static_cast<int64_t>(blockIdx.x) * kCombineWarps + threadIdx.x / 32;
  if (row >= rows) return;
  const int splits = p.num_splits;
  const DecodeWorkspaceLayout layout = decode_workspace_layout(p, splits);
  const float* lse_accum = static_cast<const float*>(p.workspace);
  const float* out_accum =
      reinterpret_cast<const float*>(static_cast<const char*>(p.workspace) + layout.out_offset);

  float m = -INFINITY;
  for (int s = lane; s < splits; s += 32) m = fmaxf(m, lse_accum[s * rows + row]);
#pragma unroll
  for (int offset = 16; offset > 0; offset /= 2) m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, offset));
  float sum = 0.0f;
  if (m != -INFINITY) {
    for (int s = lane; s < splits; s += 32) sum += __expf(lse_accum[s * rows + row] - m);
  }
#pragma unroll
  for (int offset = 16; offset > 0; offset /= 2) sum += __shfl_xor_sync(0xffffffffu, sum, offset);
  const float total = m == -INFINITY ? -INFINITY : m + __logf(sum);

  // The partials of kSplitsInFlight splits are loaded before any is summed: a loop that loads one
  // split's row and adds it before loading the next pays one L2 round trip per split (16 splits at
  // batch 1: several microseconds of a 20-microsecond decode step).
  float4 acc[kPasses];
#pragma unroll
  for (int pass = 0; pass < kPasses; ++pass) acc[pass] = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
  for (int s0 = 0; s0 < splits; s0 += kSplitsInFlight) {
    float weight[kSplitsInFlight];
    float4 x[kSplitsInFlight][kPasses];
#pragma unroll
    for (int u = 0; u < kSplitsInFlight; ++u) {
      const int s = s0 + u;
      // A split that saw no key (lse -inf, partial 0) weighs 0, also when no split saw one.
      const float l = s < splits ? lse_accum[s * rows + row] : -INFINITY;
      weight[u] = l == -INFINITY ? 0.0f : __expf(l - total);
      const float* partial = out_accum + (s * rows + row) * p.head_dim;
#pragma unroll
      for (int pass = 0; pass < kPasses; ++pass) {
        const int col = pass * 128 + lane * 4;
        x[u][pass] = s < splits && col < p.head_dim ? *reinterpret_cast<const float4*>(partial + col)
                                                    : make_float4(0.0f, 0.0f, 0.0f, 0.0f);
      }
    }
#pragma unroll
    for (int u = 0; u < kSplitsInFlight; ++u) {
#pragma unroll
      for (int pass = 0; pass < kPasses; ++pass) {
        acc[pass].x += weight[u] * x[u][pass].x;
        acc[pass].y += weight[u] * x[u][pass].y;
        acc[pass].z += weight[u] * x[u][pass].z;
        acc[pass].w += weight[u] * x[u][pass].w;
      }
    }
  }

  const int token = static_cast<int>(row % p.seqlen_q);
  const int head = static_cast<int>((row / p.seqlen_q) % p.heads_q);
  const int b = static_cast<int>(row / (static_cast<int64_t>(p.seqlen_q) * p.heads_q));
  Element* out = static_cast<Element*>(p.out) + b * p.out_batch_stride + token * p.out_row_stride +
                 head * p.out_head_stride;
#pragma unroll
  for (int pass = 0; pass < kPasses; ++pass) {
    const int col = pass * 128 + lane * 4;
    if (col < p.head_dim) {
      *reinterpret_cast<uint2*>(out + col) = make_uint2(pack2<Element>(acc[pass].x, acc[pass].y),
                                                        pack2<Element>(acc[pass].z, acc[pass].w));
    }
  }
  if (lane == 0) p.lse[b * p.lse_batch_stride + head * p.lse_head_stride + token] = total;
}

}  // namespace flashkit::sm80
