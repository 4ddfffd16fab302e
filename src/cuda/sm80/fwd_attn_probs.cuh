// src/cuda/sm80/fwd_attn_probs.cuh
// \brief return_softmax: writes the attention probabilities, with the dropout mask in their sign
// bits, after the forward kernel has written the LSE. A test aid, not a fast path.
//
// The forward kernel keeps its probabilities relative to a running row maximum and never holds a
// normalised row, so instead of bloating its main loop (and its registers) for a test-only output,
// this small kernel recomputes each visible score from q and k (fp32 dot product, the same scale,
// softcap and ALiBi as the forward) and writes exp(s - lse) with the forward's lse. The mask bits
// come from the same DropoutMask (common/philox.h) the forward kernel draws, so a test comparing
// the signs with the host's Philox checks the very function the forward applied; the magnitudes
// are the probabilities to fp32 accuracy, independent of the forward's arithmetic.
//
// Layout: one CTA per row (b, h, i) of the rounded [batch, heads_q, rows, cols] tensor, a grid
// stride past 2^31 - 1 rows; the CTA stages q_i in shared memory as fp32 and its threads walk the
// columns. Every element is written: +0 for padding and masked pairs.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>

#include "common/fwd_problem.h"
#include "common/philox.h"
#include "cuda/common/attention_mask.cuh"

namespace flashkit::sm80 {

constexpr int kAttnProbsThreads = 128;

template <typename Element>
__device__ __forceinline__ uint16_t attn_probs_bits(float x);
template <>
__device__ __forceinline__ uint16_t attn_probs_bits<__nv_bfloat16>(float x) {
  return __bfloat16_as_ushort(__float2bfloat16_rn(x));
}
template <>
__device__ __forceinline__ uint16_t attn_probs_bits<__half>(float x) {
  return __half_as_ushort(__float2half_rn(x));
}

template <typename Element, int kHeadDim>
__global__ void __launch_bounds__(kAttnProbsThreads)
    fwd_attn_probs_kernel(const __grid_constant__ FwdProblem p) {
  __shared__ float q_row[kHeadDim];
  const int64_t rows_per_head = p.attn_probs_rows;
  const int64_t total_rows = rows_per_head * p.heads_q * p.batch;
  const DropoutMask mask = p.dropout_mask();
  for (int64_t linear = blockIdx.x; linear < total_rows; linear += gridDim.x) {
    const int i = static_cast<int>(linear % rows_per_head);
    const int head = static_cast<int>((linear / rows_per_head) % p.heads_q);
    const int batch = static_cast<int>(linear / rows_per_head / p.heads_q);
    const int kv_head = head / (p.heads_q / p.heads_kv);
    int64_t q_token = 0, k_token = 0;
    int len_q = p.seqlen_q, len_k = p.seqlen_k;
    if (p.cu_seqlens_q != nullptr) {
      q_token = p.cu_seqlens_q[batch];
      k_token = p.cu_seqlens_k[batch];
      len_q = p.cu_seqlens_q[batch + 1] - static_cast<int>(q_token);
      len_k = p.seqused_k != nullptr ? p.seqused_k[batch]
                                     : p.cu_seqlens_k[batch + 1] - static_cast<int>(k_token);
    }
    uint16_t* out = static_cast<uint16_t*>(p.attn_probs) + batch * p.attn_probs_batch_stride +
                    head * p.attn_probs_head_stride + i * p.attn_probs_row_stride;
    const KeyWindow window{len_q, len_k, p.window_left, p.window_right};
    const bool row_valid = i < len_q;
    const int key_begin = row_valid ? window.key_begin(i) : 0;
    const int key_end = row_valid ? window.key_end(i) : 0;

    __syncthreads();  // the previous row's threads are done with q_row
    if (row_valid) {
      const auto* q = static_cast<const Element*>(p.q) + batch * p.q_batch_stride +
                      (q_token + i) * p.q_row_stride + head * p.q_head_stride;
      for (int c = threadIdx.x; c < kHeadDim; c += blockDim.x) {
        q_row[c] = c < p.head_dim ? static_cast<float>(q[c]) : 0.0f;
      }
    }
    __syncthreads();

    const float lse =
        row_valid ? p.lse[batch * p.lse_batch_stride + head * p.lse_head_stride + i] : 0.0f;
    const float slope =
        p.alibi_slopes != nullptr ? p.alibi_slopes[batch * p.alibi_batch_stride + head] : 0.0f;
    const auto* k_head = static_cast<const Element*>(p.k) + batch * p.k_batch_stride +
                         k_token * p.k_row_stride + kv_head * p.k_head_stride;
    const uint32_t batch_head = static_cast<uint32_t>(batch * p.heads_q + head);
    for (int j = threadIdx.x; j < p.attn_probs_cols; j += blockDim.x) {
      if (j < key_begin || j >= key_end) {
        out[j] = 0;
        continue;
      }
      const Element* k = k_head + j * p.k_row_stride;
      float dot = 0.0f;
      for (int c = 0; c < p.head_dim; ++c) dot += q_row[c] * static_cast<float>(k[c]);
      float score = dot * p.softmax_scale;
      if (p.softcap > 0.0f) {
        // tanh as 1 - 2 / (exp(2y) + 1), as the forward computes it: tanhf under --use_fast_math
        // is tanh.approx (~5e-4 relative), which the cap would magnify past the dtype's rounding.
        const float two_over_softcap = 2.0f * p.softmax_scale / p.softcap;
        score = p.softcap * (1.0f - __fdividef(2.0f, __expf(dot * two_over_softcap) + 1.0f));
      }
      if (slope != 0.0f) score += alibi_bias(slope, i, j, window.diagonal_offset());
      const float prob = expf(score - lse);
      const bool kept = p.dropout_p <= 0.0f || mask.keep(batch_head, i, j);
      out[j] = static_cast<uint16_t>(attn_probs_bits<Element>(prob) | (kept ? 0u : 0x8000u));
    }
  }
}

}  // namespace flashkit::sm80
