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

// Splits whose partial rows a lane loads before it sums any: 16 (64 registers at D <= 128) covers
// a batch-1 launch (16 splits at GQA 32/8 on 132 SMs) in one round trip.
template <int kHeadDim>
constexpr int combine_splits_in_flight() {
  return kHeadDim <= 128 ? 16 : 8;
}

// The lse values of up to kDecodeMaxSplits splits, lane j holding splits j, j + 32, ...
constexpr int kMaxSplitChunks = (kDecodeMaxSplits + 31) / 32;

template <typename Element, int kHeadDim>
__global__ void __launch_bounds__(kCombineWarps * 32)
    decode_combine_kernel(const __grid_constant__ KvcacheProblem p) {
  // Launched as a programmatic dependent of the decode kernel: its launch overlaps the decode's
  // tail, and it waits here for the decode's partials.
  wait_for_prior_grids();
  allow_dependent_grids();
  constexpr int kPasses = (kHeadDim + 127) / 128;
  constexpr int kInFlight = combine_splits_in_flight<kHeadDim>();
  static_assert(32 % kInFlight == 0, "a group of splits lies within one lane chunk of 32");
  const int lane = static_cast<int>(threadIdx.x) % 32;
  const int64_t rows = static_cast<int64_t>(p.batch) * p.heads_q * p.seqlen_q;
  const int64_t row = static_cast<int64_t>(blockIdx.x) * kCombineWarps + threadIdx.x / 32;
  if (row >= rows) return;
  const int token = static_cast<int>(row % p.seqlen_q);
  const int head = static_cast<int>((row / p.seqlen_q) % p.heads_q);
  const int b = static_cast<int>(row / (static_cast<int64_t>(p.seqlen_q) * p.heads_q));
  // Varlen queries: a row past its sequence's tokens has no partials and no output.
  const int q_begin = p.cu_seqlens_q != nullptr ? p.cu_seqlens_q[b] : 0;
  if (p.cu_seqlens_q != nullptr && token >= p.cu_seqlens_q[b + 1] - q_begin) return;
  const int splits = p.num_splits;
  const DecodeWorkspaceLayout layout = decode_workspace_layout(p, splits);
  const float* lse_accum = static_cast<const float*>(p.workspace);
  const float* out_accum =
      reinterpret_cast<const float*>(static_cast<const char*>(p.workspace) + layout.out_offset);

  // The partial rows of splits s0 .. s0 + kInFlight - 1 (zero past the last split).
  float4 x[kInFlight][kPasses];
  auto load_partials = [&](int s0) {
#pragma unroll
    for (int u = 0; u < kInFlight; ++u) {
      const int s = s0 + u;
      const float* partial = out_accum + (s * rows + row) * p.head_dim;
#pragma unroll
      for (int pass = 0; pass < kPasses; ++pass) {
        const int col = pass * 128 + lane * 4;
        x[u][pass] = s < splits && col < p.head_dim ? *reinterpret_cast<const float4*>(partial + col)
                                                    : make_float4(0.0f, 0.0f, 0.0f, 0.0f);
      }
    }
  };
  // The first group's partials go out with the lse loads, so that a launch of at most kInFlight
  // splits waits for one L2 round trip, not one for the lse values and one for the partials.
  load_partials(0);
  float split_lse[kMaxSplitChunks];
#pragma unroll
  for (int c = 0; c < kMaxSplitChunks; ++c) {
    const int s = c * 32 + lane;
    split_lse[c] = s < splits ? lse_accum[s * rows + row] : -INFINITY;
  }

  float m = -INFINITY;
#pragma unroll
  for (int c = 0; c < kMaxSplitChunks; ++c) m = fmaxf(m, split_lse[c]);
#pragma unroll
  for (int offset = 16; offset > 0; offset /= 2) m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, offset));
  float sum = 0.0f;
  if (m != -INFINITY) {
#pragma unroll
    for (int c = 0; c < kMaxSplitChunks; ++c) sum += __expf(split_lse[c] - m);  // exp(-inf) = 0
  }
#pragma unroll
  for (int offset = 16; offset > 0; offset /= 2) sum += __shfl_xor_sync(0xffffffffu, sum, offset);
  const float total = m == -INFINITY ? -INFINITY : m + __logf(sum);

  float4 acc[kPasses];
#pragma unroll
  for (int pass = 0; pass < kPasses; ++pass) acc[pass] = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
  for (int s0 = 0; s0 < splits; s0 += kInFlight) {
    if (s0 > 0) load_partials(s0);
    // This lane's split of the chunk holding s0, and its weight; a split that saw no key (lse
    // -inf, partial 0) weighs 0, also when no split saw one.
    const int chunk = s0 / 32;
    float l = split_lse[0];
#pragma unroll
    for (int c = 1; c < kMaxSplitChunks; ++c) l = chunk == c ? split_lse[c] : l;
    const float lane_weight = l == -INFINITY ? 0.0f : __expf(l - total);
#pragma unroll
    for (int u = 0; u < kInFlight; ++u) {
      const float weight = __shfl_sync(0xffffffffu, lane_weight, (s0 + u) % 32);
#pragma unroll
      for (int pass = 0; pass < kPasses; ++pass) {
        acc[pass].x += weight * x[u][pass].x;
        acc[pass].y += weight * x[u][pass].y;
        acc[pass].z += weight * x[u][pass].z;
        acc[pass].w += weight * x[u][pass].w;
      }
    }
  }

  Element* out = static_cast<Element*>(p.out) + b * p.out_batch_stride +
                 static_cast<int64_t>(q_begin + token) * p.out_row_stride + head * p.out_head_stride;
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
