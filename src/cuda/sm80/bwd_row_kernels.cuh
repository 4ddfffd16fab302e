// src/cuda/sm80/bwd_row_kernels.cuh
// \brief The backward's memory-bound kernels around the main one. A row of head_dim elements takes
// row_lanes(head_dim) lanes, each moving one 16-byte chunk of 8 elements (head_dim <= 256), and a
// warp 32 / row_lanes(head_dim) consecutive rows:
//   bwd_preprocess_kernel  dot(dout, out) per query row (fp32), the row's LSE copied beside it
//                          (bwd_workspace.h), and zeroing of the dq accumulator (kKeepScaled: dot
//                          times 1 - p, for the sm90 backward's dropout instances)
//   bwd_dq_convert_kernel  dq = scale * dq accumulator, rounded to the element type
//   bwd_group_sum_kernel   GQA/MQA: dk, dv of a kv head = sum over its query heads, in head order
// Rows are numbered (batch, head, row within the sequence), row fastest; rows past a varlen
// sequence's end do nothing.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>

#include "common/bwd_problem.h"
#include "cuda/common/mma_sm80.cuh"
#include "cuda/sm80/bwd_workspace_pointers.cuh"

namespace flashkit::sm80 {

constexpr int kRowKernelWarps = 8;

// The lanes of one row: its 16-byte chunks, rounded up to a power of two so that a warp holds whole
// rows and a row's sum is a butterfly over its lanes. One warp per row left 24 of 32 lanes idle at
// head_dim 64 (16 at 128), and each warp had only its row's few hundred bytes in flight.
__host__ __device__ constexpr int row_lanes(int head_dim) {
  int lanes = 1;
  while (lanes < 32 && lanes * 8 < head_dim) lanes *= 2;
  return lanes;
}

// One row of a sequence of a (batch, head): its packed-token offsets and length.
struct SequenceRow {
  int batch;
  int head;
  int row;
  int64_t token;  // the sequence's first token in the tensors (varlen), 0 for fixed length
  int64_t flat;   // this row's index in the flattened [batch * seqlen] / [total] numbering
  bool valid;

  __device__ __forceinline__ static SequenceRow of(int64_t index, int batch, int heads, int seqlen,
                                                   const int* cu_seqlens) {
    SequenceRow r;
    r.row = static_cast<int>(index % seqlen);
    const int64_t batch_head = index / seqlen;
    r.head = static_cast<int>(batch_head % heads);
    r.batch = static_cast<int>(batch_head / heads);
    r.valid = r.batch < batch;
    if (!r.valid) return r;
    int len = seqlen;
    r.token = 0;
    r.flat = static_cast<int64_t>(r.batch) * seqlen + r.row;
    if (cu_seqlens != nullptr) {
      r.token = cu_seqlens[r.batch];
      len = cu_seqlens[r.batch + 1] - static_cast<int>(r.token);
      r.flat = r.token + r.row;
    }
    r.valid = r.row < len;
    return r;
  }
};

// This thread's row (rows numbered as above) and 16-byte chunk within it.
struct RowChunk {
  int64_t row;
  int chunk;

  __device__ __forceinline__ static RowChunk of(int head_dim) {
    const int lanes = row_lanes(head_dim);
    const int lane = static_cast<int>(threadIdx.x) % 32;
    const int64_t warp = static_cast<int64_t>(blockIdx.x) * kRowKernelWarps + threadIdx.x / 32;
    return {warp * (32 / lanes) + lane / lanes, lane % lanes};
  }
};

// Eight 16-bit elements as floats.
template <typename Element>
__device__ __forceinline__ void unpack8(const uint4& chunk, float (&x)[8]) {
  const Element* e = reinterpret_cast<const Element*>(&chunk);
#pragma unroll
  for (int i = 0; i < 8; ++i) x[i] = static_cast<float>(e[i]);
}

template <typename Element>
__device__ __forceinline__ uint4 pack8(const float (&x)[8]) {
  return make_uint4(pack2<Element>(x[0], x[1]), pack2<Element>(x[2], x[3]), pack2<Element>(x[4], x[5]),
                    pack2<Element>(x[6], x[7]));
}

// kKeepScaled stores (1 - p) dot, the product the sm90 backward's dropout instances take (dS^T =
// kept dP^T - (P^T / (1 - p)) ((1 - p) dot)): one multiply per row here instead of one per row in
// every warp of every key block there, rounded the same way (1 - p, then the product, in fp32).
template <typename Element, bool kKeepScaled = false>
__global__ void __launch_bounds__(kRowKernelWarps * 32)
    bwd_preprocess_kernel(const __grid_constant__ BwdProblem bp, const BwdWorkspacePointers ws) {
  const FwdProblem& p = bp.fwd;
  const RowChunk rc = RowChunk::of(p.head_dim);
  const SequenceRow r = SequenceRow::of(rc.row, p.batch, p.heads_q, p.seqlen_q, p.cu_seqlens_q);
  const int64_t b = r.batch;
  float sum = 0.0f;
  if (r.valid && rc.chunk * 8 < p.head_dim) {  // (no return before the butterfly: whole warps take it)
    const int64_t token = r.token + r.row;
    const auto* dout = static_cast<const Element*>(bp.dout) + b * bp.dout_batch_stride +
                       token * bp.dout_row_stride + r.head * bp.dout_head_stride + rc.chunk * 8;
    const auto* out = static_cast<const Element*>(p.out) + b * p.out_batch_stride + token * p.out_row_stride +
                      r.head * p.out_head_stride + rc.chunk * 8;
    float x[8], y[8];
    unpack8<Element>(*reinterpret_cast<const uint4*>(dout), x);
    unpack8<Element>(*reinterpret_cast<const uint4*>(out), y);
#pragma unroll
    for (int i = 0; i < 8; ++i) sum += x[i] * y[i];
    float* accum = ws.dq_accum + (r.flat * p.heads_q + r.head) * p.head_dim + rc.chunk * 8;
    reinterpret_cast<float4*>(accum)[0] = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
    reinterpret_cast<float4*>(accum)[1] = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
  }
  for (int offset = row_lanes(p.head_dim) / 2; offset > 0; offset /= 2) {
    sum += __shfl_xor_sync(0xffffffffu, sum, offset);
  }
  if constexpr (kKeepScaled) sum *= 1.0f - p.dropout_p;
  if (r.valid && rc.chunk == 0) {
    const int64_t row = (b * p.heads_q + r.head) * ws.stats_rows + r.row;
    ws.dot[row] = sum;
    ws.lse[row] = p.lse[b * p.lse_batch_stride + r.head * p.lse_head_stride + r.row];
  }
}

template <typename Element>
__global__ void __launch_bounds__(kRowKernelWarps * 32)
    bwd_dq_convert_kernel(const __grid_constant__ BwdProblem bp, const BwdWorkspacePointers ws) {
  const FwdProblem& p = bp.fwd;
  const RowChunk rc = RowChunk::of(p.head_dim);
  const SequenceRow r = SequenceRow::of(rc.row, p.batch, p.heads_q, p.seqlen_q, p.cu_seqlens_q);
  if (!r.valid || rc.chunk * 8 >= p.head_dim) return;
  const float* accum = ws.dq_accum + (r.flat * p.heads_q + r.head) * p.head_dim + rc.chunk * 8;
  const float4 lo = reinterpret_cast<const float4*>(accum)[0];
  const float4 hi = reinterpret_cast<const float4*>(accum)[1];
  const float s = p.softmax_scale;
  const float x[8] = {lo.x * s, lo.y * s, lo.z * s, lo.w * s, hi.x * s, hi.y * s, hi.z * s, hi.w * s};
  auto* dq = static_cast<Element*>(bp.dq) + static_cast<int64_t>(r.batch) * bp.dq_batch_stride +
             (r.token + r.row) * bp.dq_row_stride + r.head * bp.dq_head_stride + rc.chunk * 8;
  *reinterpret_cast<uint4*>(dq) = pack8<Element>(x);
}

template <typename Element>
__global__ void __launch_bounds__(kRowKernelWarps * 32)
    bwd_group_sum_kernel(const __grid_constant__ BwdProblem bp, const BwdWorkspacePointers ws) {
  const FwdProblem& p = bp.fwd;
  const RowChunk rc = RowChunk::of(p.head_dim);
  const SequenceRow r = SequenceRow::of(rc.row, p.batch, p.heads_kv, p.seqlen_k, p.cu_seqlens_k);
  if (!r.valid || rc.chunk * 8 >= p.head_dim) return;
  const int group = p.heads_q / p.heads_kv;
  float dk[8] = {}, dv[8] = {};
  for (int g = 0; g < group; ++g) {
    const int64_t offset = (r.flat * p.heads_q + r.head * group + g) * p.head_dim + rc.chunk * 8;
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      const float4 k = reinterpret_cast<const float4*>(ws.dk_expanded + offset)[half];
      const float4 v = reinterpret_cast<const float4*>(ws.dv_expanded + offset)[half];
      dk[4 * half] += k.x, dk[4 * half + 1] += k.y, dk[4 * half + 2] += k.z, dk[4 * half + 3] += k.w;
      dv[4 * half] += v.x, dv[4 * half + 1] += v.y, dv[4 * half + 2] += v.z, dv[4 * half + 3] += v.w;
    }
  }
  const int64_t b = r.batch;
  const int64_t token = r.token + r.row;
  auto* dk_out = static_cast<Element*>(bp.dk) + b * bp.dk_batch_stride + token * bp.dk_row_stride +
                 r.head * bp.dk_head_stride + rc.chunk * 8;
  auto* dv_out = static_cast<Element*>(bp.dv) + b * bp.dv_batch_stride + token * bp.dv_row_stride +
                 r.head * bp.dv_head_stride + rc.chunk * 8;
  *reinterpret_cast<uint4*>(dk_out) = pack8<Element>(dk);
  *reinterpret_cast<uint4*>(dv_out) = pack8<Element>(dv);
}

}  // namespace flashkit::sm80
