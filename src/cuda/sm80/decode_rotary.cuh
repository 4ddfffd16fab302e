// src/cuda/sm80/decode_rotary.cuh
// \brief Where a sequence's keys live in the cache (contiguous or paged), and the rotary embedding
// of one 16-byte chunk: the pieces the append kernel and the decode kernel share.
//
// Rotary is computed in fp32 with __fmul_rn / __fadd_rn / __fsub_rn, which the compiler never
// fuses into FMAs, and rounded once to the element type: the CPU reference does the same
// (cpu::rotate_pair), so an appended key matches it bit for bit.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>

#include "common/kvcache_problem.h"
#include "cuda/common/mma_sm80.cuh"

namespace flashkit::sm80 {

// What one sequence of the batch holds (see kvcache_params.h).
struct DecodeSequence {
  int length;   // cached tokens before the append
  int leftpad;  // first valid cache index
  int len_k;    // keys attended: cache indices [leftpad, leftpad + len_k)
  int cache_row;  // contiguous caches: the cache_batch_idx row (b without it)
  int q_begin;  // the sequence's first query row of q and out (past the batch stride)
  int len_q;    // its query tokens (seqlen_q but for varlen queries)

  __device__ __forceinline__ static DecodeSequence locate(const KvcacheProblem& p, int b) {
    DecodeSequence s;
    s.length = p.cache_seqlens != nullptr ? p.cache_seqlens[b] : p.cache_seqlen;
    s.leftpad = p.cache_leftpad != nullptr ? p.cache_leftpad[b] : 0;
    s.len_k = p.seqused_k != nullptr ? p.seqused_k[b] : s.length + p.seqlen_new - s.leftpad;
    s.cache_row = p.cache_batch_idx != nullptr ? p.cache_batch_idx[b] : b;
    s.q_begin = p.cu_seqlens_q != nullptr ? p.cu_seqlens_q[b] : 0;
    s.len_q = p.cu_seqlens_q != nullptr ? p.cu_seqlens_q[b + 1] - s.q_begin : p.seqlen_q;
    return s;
  }
};

// Element offsets of cache index `index` of sequence b (kv head 0, column 0) in the K and the V
// cache: a page lookup for paged caches, the cache row otherwise.
struct CacheRowOffsets {
  int64_t k;
  int64_t v;
};

__device__ __forceinline__ CacheRowOffsets cache_row_offsets(const KvcacheProblem& p, int b,
                                                             const DecodeSequence& s, int index) {
  int64_t base;
  int64_t row;
  if (p.block_table != nullptr) {
    const bool power_of_two = p.page_block_shift >= 0;
    const int page = power_of_two ? index >> p.page_block_shift : index / p.page_block_size;
    base = p.block_table[b * p.block_table_batch_stride + page];
    row = power_of_two ? index & (p.page_block_size - 1) : index - page * p.page_block_size;
  } else {
    base = s.cache_row;
    row = index;
  }
  return {base * p.k_cache_batch_stride + row * p.k_cache_row_stride,
          base * p.v_cache_batch_stride + row * p.v_cache_row_stride};
}

template <typename Element>
__device__ __forceinline__ float2 unpack2(uint32_t bits) {
  if constexpr (MmaType<Element>::kIsBf16) {
    return __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&bits));
  } else {
    return __half22float2(*reinterpret_cast<const __half2*>(&bits));
  }
}

template <typename Element>
__device__ __forceinline__ float element_to_float(const Element* p) {
  if constexpr (MmaType<Element>::kIsBf16) {
    return __bfloat162float(*p);
  } else {
    return __half2float(*p);
  }
}

// Chunk `x` (columns col0 .. col0 + 7 of `row`, a row of head_dim elements in global memory)
// rotated to `position`; unchanged past rotary_dim or without rotary. rotary_dim is a multiple of
// 16, so a chunk never straddles the rotated and the plain part, and in the half-split layout the
// partner columns (col +- rotary_dim / 2) form one whole chunk too. A position past the tables
// (a query token beyond them: a broken promise of kvcache_params.h, which FLASHKIT_CHECK_KVCACHE=1
// reports) reads their last row rather than memory past them.
template <typename Element>
__device__ __forceinline__ uint4 rotary_chunk(const KvcacheProblem& p, const Element* row,
                                              int col0, uint4 x, int position) {
  if (p.rotary_cos == nullptr || col0 >= p.rotary_dim) return x;
  position = min(position, p.rotary_seqlen - 1);
  const int half = p.rotary_dim / 2;
  const auto* cos_row = static_cast<const Element*>(p.rotary_cos) + static_cast<int64_t>(position) * half;
  const auto* sin_row = static_cast<const Element*>(p.rotary_sin) + static_cast<int64_t>(position) * half;
  uint32_t* words = &x.x;
  float v[8];
#pragma unroll
  for (int w = 0; w < 4; ++w) {
    const float2 f = unpack2<Element>(words[w]);
    v[2 * w] = f.x;
    v[2 * w + 1] = f.y;
  }
  float r[8];
  if (p.rotary_interleaved) {
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const float c = element_to_float(cos_row + col0 / 2 + e);
      const float s = element_to_float(sin_row + col0 / 2 + e);
      r[2 * e] = __fsub_rn(__fmul_rn(v[2 * e], c), __fmul_rn(v[2 * e + 1], s));
      r[2 * e + 1] = __fadd_rn(__fmul_rn(v[2 * e + 1], c), __fmul_rn(v[2 * e], s));
    }
  } else {
    const bool first_half = col0 < half;
    const int partner_col = first_half ? col0 + half : col0 - half;
    uint4 partner = *reinterpret_cast<const uint4*>(row + partner_col);
    const uint32_t* partner_words = &partner.x;
    float u[8];
#pragma unroll
    for (int w = 0; w < 4; ++w) {
      const float2 f = unpack2<Element>(partner_words[w]);
      u[2 * w] = f.x;
      u[2 * w + 1] = f.y;
    }
    const int table_col = first_half ? col0 : partner_col;
#pragma unroll
    for (int e = 0; e < 8; ++e) {
      const float c = element_to_float(cos_row + table_col + e);
      const float s = element_to_float(sin_row + table_col + e);
      // First half: x1 = mine, x2 = partner -> x1 c - x2 s. Second half: x2 = mine -> x2 c + x1 s.
      r[e] = first_half ? __fsub_rn(__fmul_rn(v[e], c), __fmul_rn(u[e], s))
                        : __fadd_rn(__fmul_rn(v[e], c), __fmul_rn(u[e], s));
    }
  }
  uint4 y;
  uint32_t* out = &y.x;
#pragma unroll
  for (int w = 0; w < 4; ++w) out[w] = pack2<Element>(r[2 * w], r[2 * w + 1]);
  return y;
}

}  // namespace flashkit::sm80
