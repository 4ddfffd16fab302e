// src/cuda/nsa/nsa_copies.cuh
// \brief The cp.async copies the NSA kernels share: a token's query-head rows (Q, dO) and chunks of
// a token's selected keys (K, V), each into a swizzled shared-memory tile, zero-filled where the
// tile runs past the data (rows past the group or the selection, columns past head_dim) from an
// address inside the tensor.
#pragma once

#include <cstdint>

#include "cuda/common/mma_sm80.cuh"
#include "cuda/nsa/nsa_selection.cuh"

namespace flashkit::nsa {

// Rows 0 .. rows_here - 1 of `first_row` (head_stride apart: one token's heads) into `tile`, a
// Tile of kRows x kHeadDim; every thread of the CTA calls it.
template <typename Tile, int kRows, int kThreads, typename Element>
__device__ __forceinline__ void copy_head_rows(uint32_t tile, const Element* first_row, int64_t head_stride,
                                               int rows_here, int head_chunks) {
  constexpr int kChunks = Tile::kChunksPerRow;
  static_assert(kRows * kChunks % kThreads == 0, "the rows' chunks split evenly over the threads");
#pragma unroll
  for (int i = 0; i < kRows * kChunks / kThreads; ++i) {
    const int item = static_cast<int>(threadIdx.x) + i * kThreads;
    const int row = item / kChunks;
    const int chunk = item % kChunks;
    const bool valid = row < rows_here && chunk < head_chunks;
    sm80::cp_async_16(tile + Tile::chunk_offset(row, chunk), valid ? first_row + row * head_stride + chunk * 8 : first_row,
                      valid);
  }
}

// Chunks of 64 selected keys of one (sequence, kv head) into K and V tiles: a thread keeps one
// 16-byte column and walks rows kRowsPerPass apart, each row's key found through the selection
// (the 16 rows of a slice are consecutive keys of one block).
template <typename KvTile, int kThreads, typename Element>
struct SelectedKeyCopier {
  static constexpr int kChunks = KvTile::kChunksPerRow;
  static constexpr int kRowsPerPass = kThreads / kChunks;
  static constexpr int kPasses = 64 / kRowsPerPass;
  static_assert(kThreads % kChunks == 0 && 64 % kRowsPerPass == 0, "a chunk's rows split evenly");
  static_assert(16 % kRowsPerPass == 0 || kRowsPerPass % 16 == 0, "a pass stays inside 16-key slices");

  const Element* k_base;  // key 0 of the kv head, this thread's column
  const Element* v_base;
  int64_t k_row_stride, v_row_stride;
  int first_row;
  bool column_valid;  // the column is below head_dim

  __device__ __forceinline__ SelectedKeyCopier(const NsaProblem& p, int b, int kv_head) {
    const int column = static_cast<int>(threadIdx.x) % kChunks;
    column_valid = column < p.head_dim / 8;
    const int source = column_valid ? column : 0;
    k_base = static_cast<const Element*>(p.k) + b * p.k_batch_stride + kv_head * p.k_head_stride + source * 8;
    v_base = static_cast<const Element*>(p.v) + b * p.v_batch_stride + kv_head * p.v_head_stride + source * 8;
    k_row_stride = p.k_row_stride;
    v_row_stride = p.v_row_stride;
    first_row = static_cast<int>(threadIdx.x) / kChunks;
  }

  // Chunk n (virtual keys 64 n .. 64 n + 63 of the selection) into the tiles at sK and sV.
  __device__ __forceinline__ void copy(const Selection& selection, int n, int block_size, int seqlen_k, uint32_t sK,
                                       uint32_t sV) const {
    const int column = static_cast<int>(threadIdx.x) % kChunks;
#pragma unroll
    for (int i = 0; i < kPasses; ++i) {
      const int row = first_row + i * kRowsPerPass;
      const int slice_key = selection.slice_key(n * 64 + (row & ~15), block_size);
      const int key = slice_key + (row & 15);
      const bool valid = column_valid && slice_key >= 0 && key < seqlen_k;
      const uint32_t dst = KvTile::chunk_offset(row, column);
      sm80::cp_async_16(sK + dst, valid ? k_base + key * k_row_stride : k_base, valid);
      sm80::cp_async_16(sV + dst, valid ? v_base + key * v_row_stride : v_base, valid);
    }
  }
};

}  // namespace flashkit::nsa
