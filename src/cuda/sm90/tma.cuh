// src/cuda/sm90/tma.cuh
// \brief Device side of the bulk tensor copy engine (TMA): a tile of a tensor described by a
// CUtensorMap (built on the host, tensor_map.h) copied into shared memory, completing on an
// mbarrier as transaction bytes, or copied out of shared memory into the tensor, tracked as a bulk
// async-group of the issuing thread. Coordinates are in elements, innermost first; a box that
// reaches past the tensor's bounds is zero-filled there (loads) or clipped (stores).
#pragma once

#include <cuda.h>

#include <cstdint>

#include "cuda/sm90/tensor_map.h"

namespace flashkit::sm90 {

// The tensor map must live in kernel-parameter, constant or global memory (a __grid_constant__
// parameter here); the copy engine reads it through its generic address.
__device__ __forceinline__ void tma_prefetch_map(const CUtensorMap& map) {
  asm volatile("prefetch.tensormap [%0];\n" ::"l"(reinterpret_cast<uint64_t>(&map)) : "memory");
}

__device__ __forceinline__ void tma_load_3d(uint32_t dst, const CUtensorMap& map, uint32_t bar,
                                            int c0, int c1, int c2) {
  asm volatile(
      "cp.async.bulk.tensor.3d.shared::cluster.global.tile.mbarrier::complete_tx::bytes"
      " [%0], [%1, {%3, %4, %5}], [%2];\n" ::"r"(dst),
      "l"(reinterpret_cast<uint64_t>(&map)), "r"(bar), "r"(c0), "r"(c1), "r"(c2)
      : "memory");
}

__device__ __forceinline__ void tma_load_4d(uint32_t dst, const CUtensorMap& map, uint32_t bar,
                                            int c0, int c1, int c2, int c3) {
  asm volatile(
      "cp.async.bulk.tensor.4d.shared::cluster.global.tile.mbarrier::complete_tx::bytes"
      " [%0], [%1, {%3, %4, %5, %6}], [%2];\n" ::"r"(dst),
      "l"(reinterpret_cast<uint64_t>(&map)), "r"(bar), "r"(c0), "r"(c1), "r"(c2), "r"(c3)
      : "memory");
}

__device__ __forceinline__ void tma_load_5d(uint32_t dst, const CUtensorMap& map, uint32_t bar,
                                            int c0, int c1, int c2, int c3, int c4) {
  asm volatile(
      "cp.async.bulk.tensor.5d.shared::cluster.global.tile.mbarrier::complete_tx::bytes"
      " [%0], [%1, {%3, %4, %5, %6, %7}], [%2];\n" ::"r"(dst),
      "l"(reinterpret_cast<uint64_t>(&map)), "r"(bar), "r"(c0), "r"(c1), "r"(c2), "r"(c3), "r"(c4)
      : "memory");
}

// A tile moves as one box per 64-column block (the 128-byte swizzle's width): calls
// `copy(block, first_column)` with each block's shared-memory address and first column.
template <typename Tile, typename Copy>
__device__ __forceinline__ void for_each_column_block(uint32_t tile, Copy copy) {
#pragma unroll
  for (int cb = 0; cb < Tile::kColumnBlocks; ++cb) copy(tile + cb * Tile::kColumnBlockBytes, cb * kSwizzleAtomElements);
}

// Copies rows [row, row + box rows) of the (head, batch) slice of a tensor, all column blocks, into
// the tile at `dst`, completing on `bar`.
template <typename Tile>
__device__ __forceinline__ void tma_load_tile(uint32_t dst, const CUtensorMap& map, uint32_t bar,
                                              bool varlen, int row, int head, int batch) {
  for_each_column_block<Tile>(dst, [&](uint32_t block, int column) {
    if (varlen) {
      tma_load_3d(block, map, bar, column, row, head);
    } else {
      tma_load_4d(block, map, bar, column, row, head, batch);
    }
  });
}

// The same through a map of grouped_rows_tensor_map (tensor_map.h): the box of the group of heads
// `head_group`, tokens [token, token + box tokens), every head of the group.
template <typename Tile>
__device__ __forceinline__ void tma_load_grouped_tile(uint32_t dst, const CUtensorMap& map, uint32_t bar,
                                                      bool varlen, int token, int head_group, int batch) {
  for_each_column_block<Tile>(dst, [&](uint32_t block, int column) {
    if (varlen) {
      tma_load_4d(block, map, bar, column, 0, token, head_group);
    } else {
      tma_load_5d(block, map, bar, column, 0, token, head_group, batch);
    }
  });
}

// Copies `bytes` (a multiple of 16) from global memory at `src` (16-byte aligned) into shared memory
// at `dst` (16-byte aligned), completing on `bar` as transaction bytes: a bulk copy without a
// tensor map, for contiguous runs.
__device__ __forceinline__ void bulk_load(uint32_t dst, const void* src, uint32_t bytes, uint32_t bar) {
  asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];\n" ::"r"(dst),
               "l"(reinterpret_cast<uint64_t>(src)), "r"(bytes), "r"(bar)
               : "memory");
}

// Stores and bulk reductions. The writes to shared memory that one reads must be ordered before it
// by fence_proxy_async_shared() (warpgroup.cuh) in every writing thread and a barrier; the issuing
// thread then closes them into a group with tma_store_commit() and may reuse the shared memory only
// after tma_store_wait_read<0>() (the engine has read it), and must not exit before that.
__device__ __forceinline__ void tma_store_4d(const CUtensorMap& map, uint32_t src, int c0, int c1, int c2,
                                             int c3) {
  asm volatile("cp.async.bulk.tensor.4d.global.shared::cta.bulk_group [%0, {%2, %3, %4, %5}], [%1];\n" ::"l"(
                   reinterpret_cast<uint64_t>(&map)),
               "r"(src), "r"(c0), "r"(c1), "r"(c2), "r"(c3)
               : "memory");
}

__device__ __forceinline__ void tma_store_5d(const CUtensorMap& map, uint32_t src, int c0, int c1, int c2,
                                             int c3, int c4) {
  asm volatile(
      "cp.async.bulk.tensor.5d.global.shared::cta.bulk_group [%0, {%2, %3, %4, %5, %6}], [%1];\n" ::"l"(
          reinterpret_cast<uint64_t>(&map)),
      "r"(src), "r"(c0), "r"(c1), "r"(c2), "r"(c3), "r"(c4)
      : "memory");
}

// Adds the box of `map` at (c0, c1, c2) from shared memory at `src` (in the map's swizzled box layout)
// to the tensor element by element, in L2; tracked like a store. Parts of the box past the tensor's
// bounds are dropped.
__device__ __forceinline__ void tma_reduce_add_3d(const CUtensorMap& map, uint32_t src, int c0, int c1, int c2) {
  asm volatile(
      "cp.reduce.async.bulk.tensor.3d.global.shared::cta.add.tile.bulk_group [%0, {%2, %3, %4}], [%1];\n" ::"l"(
          reinterpret_cast<uint64_t>(&map)),
      "r"(src), "r"(c0), "r"(c1), "r"(c2)
      : "memory");
}

__device__ __forceinline__ void tma_store_commit() { asm volatile("cp.async.bulk.commit_group;\n" ::: "memory"); }

// Waits until at most kPending of this thread's store groups still read their shared memory.
template <int kPending>
__device__ __forceinline__ void tma_store_wait_read() {
  asm volatile("cp.async.bulk.wait_group.read %0;\n" ::"n"(kPending) : "memory");
}

// Waits until at most kPending of this thread's store groups are still in flight (their writes to
// global memory included).
template <int kPending>
__device__ __forceinline__ void tma_store_wait() {
  asm volatile("cp.async.bulk.wait_group %0;\n" ::"n"(kPending) : "memory");
}

}  // namespace flashkit::sm90
