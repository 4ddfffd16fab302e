// src/cuda/sm90/tma.cuh
// \brief Device side of the bulk tensor copy engine (TMA): a tile of a tensor described by a
// CUtensorMap (built on the host, tensor_map.h) copied into shared memory, completing on an
// mbarrier as transaction bytes. Coordinates are in elements, innermost first; a box that reaches
// past the tensor's bounds is zero-filled there.
#pragma once

#include <cuda.h>

#include <cstdint>

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

}  // namespace flashkit::sm90
