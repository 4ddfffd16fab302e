// src/cuda/common/mma_sm80.cuh
// \brief Warp-level building blocks of the sm80 path: mma.sync m16n8k16, ldmatrix, cp.async.
//
// Fragment layouts (PTX ISA, "Matrix fragments for mma.m16n8k16"), per lane with g = lane / 4 and
// t = lane % 4:
//   A 16x16 (row-major), 4 registers of 2 elements: a0 (g, 2t..2t+1), a1 (g+8, 2t..), a2 (g, 2t+8..),
//                                                    a3 (g+8, 2t+8..)
//   B 16x8  (k x n),     2 registers of 2 elements: b0 (k = 2t..2t+1, n = g), b1 (k = 2t+8.., n = g)
//   C 16x8  fp32,        4 floats:                  c0,c1 (g, 2t..2t+1), c2,c3 (g+8, 2t..2t+1)
// so the C fragments of two adjacent 16x8 tiles, packed to 16 bits, are exactly an A fragment: the
// attention probabilities P never leave registers between the two GEMMs.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>

namespace flashkit::sm80 {

// The CUDA element type of a 16-bit storage type, and the mma.sync spelling of it.
template <typename Element> struct MmaType;
template <> struct MmaType<__nv_bfloat16> { static constexpr bool kIsBf16 = true; };
template <> struct MmaType<__half> { static constexpr bool kIsBf16 = false; };

// D = A * B + D for one 16x8x16 tile, fp32 accumulators.
template <typename Element>
__device__ __forceinline__ void mma_16x8x16(float (&d)[4], const uint32_t (&a)[4], uint32_t b0,
                                            uint32_t b1) {
  if constexpr (MmaType<Element>::kIsBf16) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 "
        "{%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  } else {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 "
        "{%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  }
}

// Clears a [tiles x column tiles] block of mma accumulator fragments.
template <int kRowTiles, int kColTiles>
__device__ __forceinline__ void zero_accumulators(float (&acc)[kRowTiles][kColTiles][4]) {
#pragma unroll
  for (int r = 0; r < kRowTiles; ++r)
#pragma unroll
    for (int c = 0; c < kColTiles; ++c)
#pragma unroll
      for (int i = 0; i < 4; ++i) acc[r][c][i] = 0.0f;
}

// One B fragment pair from ldmatrix.x4 (b[0..1]: 8 columns, b[2..3]: the next 8) against every
// m-tile's A fragment: acc[mt][2j] and acc[mt][2j + 1] += a[mt] * B. Both GEMMs of the attention
// kernel are sequences of these, so each B fragment read from shared memory feeds kMTiles tiles.
template <typename Element, int kMTiles, int kColTiles>
__device__ __forceinline__ void mma_column_pair(float (&acc)[kMTiles][kColTiles][4],
                                                const uint32_t (&a)[kMTiles][4],
                                                const uint32_t (&b)[4], int j) {
#pragma unroll
  for (int mt = 0; mt < kMTiles; ++mt) {
    mma_16x8x16<Element>(acc[mt][2 * j], a[mt], b[0], b[1]);
    mma_16x8x16<Element>(acc[mt][2 * j + 1], a[mt], b[2], b[3]);
  }
}

// Four 8x8 matrices of 16-bit elements from shared memory; lane L gives the row address of matrix
// L / 8, row L % 8. `.trans` delivers each matrix transposed.
__device__ __forceinline__ void ldmatrix_x4(uint32_t (&r)[4], uint32_t smem_addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(smem_addr));
}

__device__ __forceinline__ void ldmatrix_x4_trans(uint32_t (&r)[4], uint32_t smem_addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(smem_addr));
}

// 16-byte asynchronous copy global -> shared. When `valid` is false nothing is read and the 16
// bytes are zero-filled: this is how tiles are padded past the sequence end and the head dim.
__device__ __forceinline__ void cp_async_16(uint32_t smem_addr, const void* gmem, bool valid) {
  const int src_bytes = valid ? 16 : 0;
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(smem_addr), "l"(gmem),
               "r"(src_bytes));
}

__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }

// Waits until at most `kPending` committed groups of this thread are still in flight.
template <int kPending>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(kPending));
}

__device__ __forceinline__ uint32_t smem_address(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

// Two fp32 values rounded to the 16-bit element type and packed (first value in the low half).
template <typename Element>
__device__ __forceinline__ uint32_t pack2(float lo, float hi) {
  if constexpr (MmaType<Element>::kIsBf16) {
    __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
    return *reinterpret_cast<uint32_t*>(&v);
  } else {
    __half2 v = __floats2half2_rn(lo, hi);
    return *reinterpret_cast<uint32_t*>(&v);
  }
}

// pack2 of max(lo, 0) and max(hi, 0), in the same one conversion instruction (cvt.rn.relu).
template <typename Element>
__device__ __forceinline__ uint32_t pack2_relu(float lo, float hi) {
  uint32_t packed;
  if constexpr (MmaType<Element>::kIsBf16) {
    asm("cvt.rn.relu.bf16x2.f32 %0, %1, %2;\n" : "=r"(packed) : "f"(hi), "f"(lo));
  } else {
    asm("cvt.rn.relu.f16x2.f32 %0, %1, %2;\n" : "=r"(packed) : "f"(hi), "f"(lo));
  }
  return packed;
}

// A warp's 16 x 16 accumulator tile (C layout: rows g, g + 8; columns 2 (lane % 4) + {0, 1, 8, 9})
// rounded and packed as the A operand of the next product, k along its columns: P for P V, and the
// backward's dS for dS K or, from a transposed product, P^T and dS^T.
template <typename Element>
__device__ __forceinline__ void pack_scores_as_a(const float (&c)[1][2][4], uint32_t (&a)[4]) {
  a[0] = pack2<Element>(c[0][0][0], c[0][0][1]);
  a[1] = pack2<Element>(c[0][0][2], c[0][0][3]);
  a[2] = pack2<Element>(c[0][1][0], c[0][1][1]);
  a[3] = pack2<Element>(c[0][1][2], c[0][1][3]);
}

}  // namespace flashkit::sm80
