// src/cuda/sm80/decode_append.cuh
// \brief The append pre-pass of mha_fwd_kvcache: k_new / v_new written into the cache (into pages
// when paged) at cache_seqlens, keys rotated to their positions on the way.
//
// One CTA per (new token, sequence); its threads stride over (kv head, 16-byte chunk). A pass of
// its own (rather than fused into the decode kernel) because every split and every query-row block
// of the decode kernel reads the appended keys: writing them once, before, keeps the decode
// kernel's loads uniform. It costs one small launch, ordered before the decode kernel by the
// stream.
#pragma once

#include <cstdint>

#include "common/kvcache_problem.h"
#include "cuda/sm80/decode_rotary.cuh"

namespace flashkit::sm80 {

constexpr int kAppendThreads = 128;

template <typename Element>
__global__ void __launch_bounds__(kAppendThreads)
    decode_append_kernel(const __grid_constant__ KvcacheProblem p) {
  const int token = static_cast<int>(blockIdx.x);
  const int b = static_cast<int>(blockIdx.y);
  const DecodeSequence seq = DecodeSequence::locate(p, b);
  const int index = seq.length + token;
  const int position = seq.length - seq.leftpad + token;
  const CacheRowOffsets dst = cache_row_offsets(p, b, seq, index);
  const int chunks = p.head_dim / 8;
  auto* k_cache = static_cast<Element*>(p.k_cache);
  auto* v_cache = static_cast<Element*>(p.v_cache);
  const auto* k_new = static_cast<const Element*>(p.k_new);
  const auto* v_new = static_cast<const Element*>(p.v_new);
  for (int item = static_cast<int>(threadIdx.x); item < p.heads_kv * chunks; item += kAppendThreads) {
    const int head = item / chunks;
    const int col = (item % chunks) * 8;
    const Element* k_row = k_new + b * p.k_new_batch_stride + token * p.k_new_row_stride +
                           head * p.k_new_head_stride;
    const Element* v_row = v_new + b * p.v_new_batch_stride + token * p.v_new_row_stride +
                           head * p.v_new_head_stride;
    const uint4 k = rotary_chunk<Element>(p, k_row, col, *reinterpret_cast<const uint4*>(k_row + col),
                                          position);
    *reinterpret_cast<uint4*>(k_cache + dst.k + head * p.k_cache_head_stride + col) = k;
    *reinterpret_cast<uint4*>(v_cache + dst.v + head * p.v_cache_head_stride + col) =
        *reinterpret_cast<const uint4*>(v_row + col);
  }
}

}  // namespace flashkit::sm80
