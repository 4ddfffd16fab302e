// src/cuda/common/swizzled_tile.cuh
// \brief The shared-memory layout of a [rows x cols] tile of 16-bit elements, XOR-swizzled so that
// ldmatrix and cp.async hit 8 distinct 16-byte bank groups per phase.
//
// A row is cols / 8 chunks of 16 bytes. ldmatrix reads one chunk from each of 8 consecutive rows per
// phase; unswizzled, rows of 128 bytes or a multiple put that column of chunks in one bank group
// (8-way conflict). Swizzling the chunk index with the row spreads them:
//   chunks per row = 0 mod 8 (D = 64, 128, 192, 256): chunk ^ (row % 8)
//   chunks per row = 4 mod 8 (D = 32, 96):            chunk ^ ((row / 2) % 4); two rows fill a
//     128-byte line, so row parity already separates the upper and lower four bank groups.
// Both keep the chunk inside its row.
#pragma once

#include <cstdint>

namespace flashkit::sm80 {

template <int kRows, int kCols>
struct SwizzledTile {
  static_assert(kCols % 32 == 0, "tile columns come in 16-byte chunks, 4 or 8 per bank line");
  static constexpr int kChunksPerRow = kCols / 8;
  static constexpr int kRowBytes = kCols * 2;
  static constexpr int kBytes = kRows * kRowBytes;
  // The chunk-index bits the swizzle flips.
  static constexpr int kSwizzleMask = kChunksPerRow % 8 == 0 ? 7 : 3;

  // The XOR term of a row: depends only on row % 8, so it is fixed for a lane whose rows advance in
  // steps of 8.
  __device__ __forceinline__ static int swizzle_bits(int row) {
    return kChunksPerRow % 8 == 0 ? (row & 7) : ((row >> 1) & 3);
  }

  __device__ __forceinline__ static uint32_t chunk_offset(int row, int chunk) {
    return static_cast<uint32_t>(row * kRowBytes + (chunk ^ swizzle_bits(row)) * 16);
  }

  // The addresses one lane gives ldmatrix for fragments at row (row_step + lane_row) and chunk
  // (2 * chunk_step + lane_chunk), row_step a multiple of 8, chunk_step a compile-time loop index,
  // lane_chunk 0 or 1. Because row % 8 is fixed per lane, the swizzle touches only the low bits of
  // the chunk: (2s + c) ^ x = (2s & ~mask) | ((2s & mask | c) ^ x). So a lane keeps one base
  // address per value of (2s & mask) and every fragment address is base + a compile-time
  // immediate, instead of one live register per (row step, chunk step) pair.
  struct LaneAddresses {
    static constexpr int kVariants = (kSwizzleMask + 1) / 2;
    uint32_t base[kVariants];

    __device__ __forceinline__ LaneAddresses(uint32_t tile, int lane_row, int lane_chunk) {
#pragma unroll
      for (int j = 0; j < kVariants; ++j) {
        base[j] = tile + static_cast<uint32_t>(lane_row * kRowBytes +
                                               (((2 * j) | lane_chunk) ^ swizzle_bits(lane_row)) * 16);
      }
    }

    __device__ __forceinline__ uint32_t at(int row_step, int chunk_step) const {
      return base[chunk_step % kVariants] +
             static_cast<uint32_t>(row_step * kRowBytes + ((2 * chunk_step) & ~kSwizzleMask) * 16);
    }
  };
};

}  // namespace flashkit::sm80
