// src/cuda/sm90/wgmma.cuh
// \brief Warpgroup matrix multiply (wgmma, sm_90a): the shared-memory tile layout the copy engine
// writes and the tensor cores read, its matrix descriptors, and D += A * B for one m64nNk16 step.
//
// Tile layout (Swizzle128Tile). A [rows x cols] tile of 16-bit elements is stored as cols / 64
// column blocks of [rows x 64]; a row of a column block is 128 bytes, and its eight 16-byte chunks
// are permuted by chunk ^ (row % 8), the 128-byte swizzle. This is exactly what one TMA box of
// 64 x rows with CU_TENSOR_MAP_SWIZZLE_128B writes, and what a wgmma descriptor with layout type
// "128B swizzle" reads. Column blocks and the tile itself start 1024-byte aligned (the swizzle
// repeats every 8 rows = 1024 bytes and the descriptor's base offset is left 0).
//
// Descriptors (PTX ISA, "Matrix Descriptor Format"): start address, leading and stride byte
// offsets (all >> 4), layout type in bits 62-63 (1 = 128-byte swizzle).
//   K-major (the reduction dim contiguous: Q and K as A and B of S = Q K^T): 8-row groups are 1024
//     bytes apart (stride offset); the leading offset is unused. The k-step kk of 16 elements
//     starts at column block kk / 4, byte 32 * (kk % 4) of the row: the hardware applies the
//     swizzle to the address it forms, so advancing the start address selects the k-slice.
//   MN-major (the output dim contiguous: V as B of O = P V): along N, 64-element column blocks are
//     `leading` bytes apart; along K, 8-row groups are 1024 bytes apart. The k-step of 16 keys
//     starts 16 rows (2048 bytes) further.
//
// Accumulator layout (m64nN, fp32): warp w of the warpgroup owns rows 16w..16w+15; within it the
// registers come in groups of 4 per 8 columns, exactly the mma.sync m16n8 C fragment (lane g =
// lane / 4, t = lane % 4: d[4j], d[4j+1] at (g, 8j + 2t, +1), d[4j+2], d[4j+3] at (g + 8, ...)).
// The A operand from registers (m64k16) is the mma.sync m16n8k16 A fragment of the warp's 16 rows,
// so the probabilities P of two adjacent 8-column groups, packed to 16 bits, are an A fragment.
//
// Ordering: wgmma_fence() before the first wgmma of a batch whenever registers it uses were
// written by ordinary instructions; wgmma_commit() closes a batch; wgmma_wait<n>() waits until at
// most n batches are in flight, after which their accumulators may be read.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>

#include "cuda/common/mma_sm80.cuh"

namespace flashkit::sm90 {

template <int kRows, int kCols>
struct Swizzle128Tile {
  static_assert(kCols % 64 == 0, "tiles are whole 64-column (128-byte) swizzle atoms wide");
  static_assert((kRows * 128) % 1024 == 0, "column blocks stay 1024-byte aligned");
  static constexpr int kColumnBlocks = kCols / 64;
  static constexpr int kColumnBlockBytes = kRows * 128;
  static constexpr int kBytes = kColumnBlocks * kColumnBlockBytes;
  // For the generic 16-byte-chunk copy loops (sm80::load_tile_async): chunks per row, and bytes from
  // a row to the next within a column block (8-row steps keep the swizzle pattern).
  static constexpr int kChunksPerRow = kCols / 8;
  static constexpr int kRowBytes = 128;

  // Byte offset of the 16-byte chunk `chunk` (8 elements) of row `row`.
  __device__ __forceinline__ static uint32_t chunk_offset(int row, int chunk) {
    return static_cast<uint32_t>((chunk / 8) * kColumnBlockBytes + row * 128 +
                                 (((chunk % 8) ^ (row % 8)) * 16));
  }
};

constexpr uint64_t kDescriptorSwizzle128 = uint64_t{1} << 62;
constexpr uint32_t kSwizzleGroupBytes = 1024;  // 8 rows of 128 bytes

// A matrix descriptor as its two 32-bit words. The start address field holds bits 4-17 of a
// shared address, and every shared address of a CTA is below 2^18 (228 KiB), so moving an operand's
// start by a multiple of 16 bytes inside the tile is one add of (bytes >> 4) to the low word, with no
// carry into the leading byte offset above the field. A product's k-steps use that: their offsets
// are compile-time constants, so each step's descriptor is one uniform add (UIADD3) instead of the
// add, mask, shift and or of encoding each address anew (~5 uniform instructions per wgmma, on the
// path between a turn's barrier and the products' issue: bench/NOTES.md, session 15).
struct SharedDescriptor {
  uint32_t lo;  // start address >> 4 (bits 0-13), leading byte offset >> 4 (bits 16-29)
  uint32_t hi;  // stride byte offset >> 4 (bits 0-13), layout type (bits 30-31)

  // The descriptor of the operand `bytes` (a multiple of 16) past this one's start.
  __device__ __forceinline__ uint64_t at(uint32_t bytes) const {
    return (static_cast<uint64_t>(hi) << 32) | (lo + (bytes >> 4));
  }
};

// The descriptor with the 128-byte swizzle, 8-row groups 1024 bytes apart, the given leading byte
// offset and its start at shared address `address`.
template <uint32_t kLeadingBytes>
__device__ __forceinline__ SharedDescriptor swizzle128_descriptor(uint32_t address) {
  constexpr uint64_t kFixed = kDescriptorSwizzle128 | (uint64_t{kSwizzleGroupBytes >> 4} << 32) |
                              (uint64_t{kLeadingBytes >> 4} << 16);
  return {static_cast<uint32_t>(kFixed) | ((address & 0x3FFFF) >> 4), static_cast<uint32_t>(kFixed >> 32)};
}

// Descriptor of a K-major operand whose first row starts at shared address `address` (the layout
// does not use the leading offset; its field holds 1, i.e. 16 bytes).
__device__ __forceinline__ SharedDescriptor k_major_descriptor(uint32_t address) {
  return swizzle128_descriptor<16>(address);
}

// Descriptor of an MN-major operand (K rows, N contiguous) whose column blocks are
// kColumnBlockBytes apart.
template <uint32_t kColumnBlockBytes>
__device__ __forceinline__ SharedDescriptor mn_major_descriptor(uint32_t address) {
  return swizzle128_descriptor<kColumnBlockBytes>(address);
}

__device__ __forceinline__ void wgmma_fence() {
  asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory");
}

__device__ __forceinline__ void wgmma_commit() {
  asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory");
}

template <int kInFlight>
__device__ __forceinline__ void wgmma_wait() {
  asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(kInFlight) : "memory");
}

// Keeps the compiler from moving reads or writes of an accumulator across a wgmma boundary.
template <int kCount>
__device__ __forceinline__ void wgmma_fence_registers(float* d) {
#pragma unroll
  for (int i = 0; i < kCount; ++i) asm volatile("" : "+f"(d[i])::"memory");
}

template <typename Element>
struct WgmmaType;
template <>
struct WgmmaType<__nv_bfloat16> {
  static constexpr bool kIsBf16 = true;
};
template <>
struct WgmmaType<__half> {
  static constexpr bool kIsBf16 = false;
};

// D (64 x N fp32, N / 2 registers per thread) += A (64 x 16) * B (16 x N) for one k-step.
//   ss: A and B from shared memory (descriptors); rs: A from registers (the warp's 16 x 16 slice).
//   kTransposeB = 0: B is K-major ([N x 16] rows in memory); 1: MN-major.
//   kTransposeA (ss only) = 0: A is K-major ([64 x 16] rows); 1: MN-major ([16 x 64] rows, e.g. the
//     transpose of a stored keys x queries tile; described like an MN-major B).
//   accumulate = 0 overwrites D (the first k-step of a product), 1 adds.
// Inline assembly takes no variadic register lists, so each N spells its accumulator list
// "{%0, ..., %(N/2 - 1)}" and its N/2 read-write operands once (FLASHKIT_WGMMA_N<N>_REGS / _OUT,
// found by name from N); the operands after them are numbered from N/2 on, which
// FLASHKIT_WGMMA_MEMBERS takes as the literals m0 ... m6. The N values are the tile widths the
// kernels use.
template <int N>
struct Wgmma;

#define FLASHKIT_WGMMA_STR(x) #x

// One wgmma with A and B from shared memory; kType is "bf16" or "f16".
#define FLASHKIT_WGMMA_SS(kN, kType, m0, m1, m2, m3, m4) \
  asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %" FLASHKIT_WGMMA_STR(m2) ", 0;\n"          \
               "wgmma.mma_async.sync.aligned.m64n" FLASHKIT_WGMMA_STR(kN) "k16.f32." kType "." \
               kType " " FLASHKIT_WGMMA_N##kN##_REGS ", %" FLASHKIT_WGMMA_STR(m0) ", %" FLASHKIT_WGMMA_STR(m1)        \
               ", p, 1, 1, %" FLASHKIT_WGMMA_STR(m4) ", %" FLASHKIT_WGMMA_STR(m3) ";\n}\n"     \
               : FLASHKIT_WGMMA_N##kN##_OUT                                                     \
               : "l"(desc_a), "l"(desc_b), "r"(accumulate), "n"(kTransposeB), "n"(kTransposeA))

// One wgmma with A from registers and B from shared memory.
#define FLASHKIT_WGMMA_RS(kN, kType, m0, m1, m2, m3, m4, m5, m6) \
  asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %" FLASHKIT_WGMMA_STR(m5) ", 0;\n"          \
               "wgmma.mma_async.sync.aligned.m64n" FLASHKIT_WGMMA_STR(kN) "k16.f32." kType "." \
               kType " " FLASHKIT_WGMMA_N##kN##_REGS ", {%" FLASHKIT_WGMMA_STR(m0) ", %" FLASHKIT_WGMMA_STR(m1)       \
               ", %" FLASHKIT_WGMMA_STR(m2) ", %" FLASHKIT_WGMMA_STR(m3) "}, %"                 \
               FLASHKIT_WGMMA_STR(m4) ", p, 1, 1, %" FLASHKIT_WGMMA_STR(m6) ";\n}\n"          \
               : FLASHKIT_WGMMA_N##kN##_OUT                                                     \
               : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc_b), "r"(accumulate),      \
                 "n"(kTransposeB))

// The body of Wgmma<kN>: ss and rs, each for bf16 and fp16.
#define FLASHKIT_WGMMA_MEMBERS(kN, m0, m1, m2, m3, m4, m5, m6)                                \
  template <typename Element, int kTransposeB, int kTransposeA = 0>                            \
  __device__ __forceinline__ static void ss(float* d, uint64_t desc_a, uint64_t desc_b,       \
                                            uint32_t accumulate) {                            \
    if constexpr (WgmmaType<Element>::kIsBf16) {                                              \
      FLASHKIT_WGMMA_SS(kN, "bf16", m0, m1, m2, m3, m4);                                      \
    } else {                                                                                  \
      FLASHKIT_WGMMA_SS(kN, "f16", m0, m1, m2, m3, m4);                                       \
    }                                                                                         \
  }                                                                                           \
  template <typename Element, int kTransposeB>                                                \
  __device__ __forceinline__ static void rs(float* d, const uint32_t(&a)[4], uint64_t desc_b, \
                                            uint32_t accumulate) {                            \
    if constexpr (WgmmaType<Element>::kIsBf16) {                                              \
      FLASHKIT_WGMMA_RS(kN, "bf16", m0, m1, m2, m3, m4, m5, m6);                              \
    } else {                                                                                  \
      FLASHKIT_WGMMA_RS(kN, "f16", m0, m1, m2, m3, m4, m5, m6);                               \
    }                                                                                         \
  }

#define FLASHKIT_WGMMA_N32_REGS \
  "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15}"
#define FLASHKIT_WGMMA_N32_OUT                                                                    \
  "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), \
      "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]),    \
      "+f"(d[15])
template <>
struct Wgmma<32> {
  FLASHKIT_WGMMA_MEMBERS(32, 16, 17, 18, 19, 20, 21, 22)
};

#define FLASHKIT_WGMMA_N64_REGS                                            \
  "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15," \
  " %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}"
#define FLASHKIT_WGMMA_N64_OUT                                                                    \
  "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), \
      "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]),    \
      "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]),  \
      "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]),  \
      "+f"(d[29]), "+f"(d[30]), "+f"(d[31])
template <>
struct Wgmma<64> {
  FLASHKIT_WGMMA_MEMBERS(64, 32, 33, 34, 35, 36, 37, 38)
};

#define FLASHKIT_WGMMA_N80_REGS                                                      \
  "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15,"           \
  " %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31," \
  " %32, %33, %34, %35, %36, %37, %38, %39}"
#define FLASHKIT_WGMMA_N80_OUT                                                                    \
  "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), \
      "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]),    \
      "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]),  \
      "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]),  \
      "+f"(d[29]), "+f"(d[30]), "+f"(d[31]), "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]),  \
      "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39])
template <>
struct Wgmma<80> {
  FLASHKIT_WGMMA_MEMBERS(80, 40, 41, 42, 43, 44, 45, 46)
};

#define FLASHKIT_WGMMA_N96_REGS \
  "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15,"  \
  " %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31,"  \
  " %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47}"
#define FLASHKIT_WGMMA_N96_OUT \
  "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), \
      "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), \
      "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), \
      "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), \
      "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), \
      "+f"(d[30]), "+f"(d[31]), "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), \
      "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), "+f"(d[40]), "+f"(d[41]), \
      "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47])
template <>
struct Wgmma<96> {
  FLASHKIT_WGMMA_MEMBERS(96, 48, 49, 50, 51, 52, 53, 54)
};

#define FLASHKIT_WGMMA_N128_REGS                                                     \
  "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15,"           \
  " %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31," \
  " %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47," \
  " %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}"
#define FLASHKIT_WGMMA_N128_OUT                                                                   \
  "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), \
      "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]),    \
      "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]),  \
      "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]),  \
      "+f"(d[29]), "+f"(d[30]), "+f"(d[31]), "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]),  \
      "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), "+f"(d[40]), "+f"(d[41]), "+f"(d[42]),  \
      "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), "+f"(d[48]), "+f"(d[49]),  \
      "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]), "+f"(d[56]),  \
      "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63])
template <>
struct Wgmma<128> {
  FLASHKIT_WGMMA_MEMBERS(128, 64, 65, 66, 67, 68, 69, 70)
};

#define FLASHKIT_WGMMA_N256_REGS                                                                 \
  "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15,"                       \
  " %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31,"             \
  " %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47,"             \
  " %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63,"             \
  " %64, %65, %66, %67, %68, %69, %70, %71, %72, %73, %74, %75, %76, %77, %78, %79,"             \
  " %80, %81, %82, %83, %84, %85, %86, %87, %88, %89, %90, %91, %92, %93, %94, %95,"             \
  " %96, %97, %98, %99, %100, %101, %102, %103, %104, %105, %106, %107, %108, %109, %110, %111," \
  " %112, %113, %114, %115, %116, %117, %118, %119, %120, %121, %122, %123, %124, %125, %126, "  \
  "%127}"
#define FLASHKIT_WGMMA_N256_OUT                                                                   \
  "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), \
      "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]),    \
      "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]),  \
      "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]),  \
      "+f"(d[29]), "+f"(d[30]), "+f"(d[31]), "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]),  \
      "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), "+f"(d[40]), "+f"(d[41]), "+f"(d[42]),  \
      "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), "+f"(d[48]), "+f"(d[49]),  \
      "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]), "+f"(d[56]),  \
      "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63]),  \
      "+f"(d[64]), "+f"(d[65]), "+f"(d[66]), "+f"(d[67]), "+f"(d[68]), "+f"(d[69]), "+f"(d[70]),  \
      "+f"(d[71]), "+f"(d[72]), "+f"(d[73]), "+f"(d[74]), "+f"(d[75]), "+f"(d[76]), "+f"(d[77]),  \
      "+f"(d[78]), "+f"(d[79]), "+f"(d[80]), "+f"(d[81]), "+f"(d[82]), "+f"(d[83]), "+f"(d[84]),  \
      "+f"(d[85]), "+f"(d[86]), "+f"(d[87]), "+f"(d[88]), "+f"(d[89]), "+f"(d[90]), "+f"(d[91]),  \
      "+f"(d[92]), "+f"(d[93]), "+f"(d[94]), "+f"(d[95]), "+f"(d[96]), "+f"(d[97]), "+f"(d[98]),  \
      "+f"(d[99]), "+f"(d[100]), "+f"(d[101]), "+f"(d[102]), "+f"(d[103]), "+f"(d[104]),          \
      "+f"(d[105]), "+f"(d[106]), "+f"(d[107]), "+f"(d[108]), "+f"(d[109]), "+f"(d[110]),         \
      "+f"(d[111]), "+f"(d[112]), "+f"(d[113]), "+f"(d[114]), "+f"(d[115]), "+f"(d[116]),         \
      "+f"(d[117]), "+f"(d[118]), "+f"(d[119]), "+f"(d[120]), "+f"(d[121]), "+f"(d[122]),         \
      "+f"(d[123]), "+f"(d[124]), "+f"(d[125]), "+f"(d[126]), "+f"(d[127])
template <>
struct Wgmma<256> {
  FLASHKIT_WGMMA_MEMBERS(256, 128, 129, 130, 131, 132, 133, 134)
};

#undef FLASHKIT_WGMMA_N32_REGS
#undef FLASHKIT_WGMMA_N32_OUT
#undef FLASHKIT_WGMMA_N64_REGS
#undef FLASHKIT_WGMMA_N64_OUT
#undef FLASHKIT_WGMMA_N80_REGS
#undef FLASHKIT_WGMMA_N80_OUT
#undef FLASHKIT_WGMMA_N96_REGS
#undef FLASHKIT_WGMMA_N96_OUT
#undef FLASHKIT_WGMMA_N128_REGS
#undef FLASHKIT_WGMMA_N128_OUT
#undef FLASHKIT_WGMMA_N256_REGS
#undef FLASHKIT_WGMMA_N256_OUT
#undef FLASHKIT_WGMMA_MEMBERS
#undef FLASHKIT_WGMMA_RS
#undef FLASHKIT_WGMMA_SS
#undef FLASHKIT_WGMMA_STR

// acc (64 x N) = A B^T over kDepth (a multiple of 16), A and B both K-major in shared memory with
// the 128-byte swizzle, stored in 64-element column blocks kABlockBytes / kBBlockBytes apart: the
// forward's S = Q K^T, the backward's S^T = K Q^T and dP^T = V dO^T. Issued and committed, not
// waited for.
template <typename Element, int N, int kDepth, int kABlockBytes, int kBBlockBytes>
__device__ __forceinline__ void issue_k_major_product(float* acc, uint32_t a, uint32_t b) {
  const SharedDescriptor a_desc = k_major_descriptor(a);
  const SharedDescriptor b_desc = k_major_descriptor(b);
#pragma unroll
  for (int kk = 0; kk < kDepth / 16; ++kk) {
    Wgmma<N>::template ss<Element, 0>(acc, a_desc.at((kk / 4) * kABlockBytes + (kk % 4) * 32),
                                      b_desc.at((kk / 4) * kBBlockBytes + (kk % 4) * 32), kk > 0 ? 1u : 0u);
  }
  wgmma_commit();
}

// acc (64 x N) += X B over kDepth (a multiple of 16), X from registers (the warp's A fragment of
// each 16-deep step), B MN-major in shared memory (128-byte rows, 64-element column blocks
// kBBlockBytes apart): the forward's O += P V, the backward's dV += P^T dO and dK += dS^T Q.
// Issued, not committed.
template <typename Element, int N, int kDepth, int kBBlockBytes>
__device__ __forceinline__ void issue_register_product(float* acc, const uint32_t (&x)[kDepth / 16][4],
                                                       uint32_t b) {
  const SharedDescriptor b_desc = mn_major_descriptor<kBBlockBytes>(b);
#pragma unroll
  for (int kk = 0; kk < kDepth / 16; ++kk) Wgmma<N>::template rs<Element, 1>(acc, x[kk], b_desc.at(kk * 16 * 128), 1u);
}

// Stores warp `warp`'s 16 rows of a warpgroup's m64 x kCols fp32 accumulator (the layout above),
// converted to Element, into rows 16 warp .. 16 warp + 15 of the Swizzle128Tile<64, kCols> at shared
// address `tile`: the layout a TMA store with the 128-byte swizzle reads. One stmatrix per two 8-column
// groups writes four 8 x 8 blocks, (rows 0-7, rows 8-15) x (group j, group j + 1); lane l names
// row l % 8 of block l / 8, whose register holds exactly the accumulator pair of that block (the
// mma.sync C fragment is stmatrix's fragment). The swizzle puts a block's 8 rows in 8 bank groups.
// The lane index is read with a volatile asm so that the addresses are formed here, at the store:
// hoisted out of a kernel's tile loop they stayed live across its main loop (the d64 forward at 160
// registers: 16 bytes of spills in one version, 5 more instructions per key block in another).
template <typename Element, int kCols>
__device__ __forceinline__ void store_accumulator_tile(const float* acc, uint32_t tile, int warp) {
  using Tile = Swizzle128Tile<64, kCols>;
  int lane;
  asm volatile("mov.u32 %0, %%laneid;\n" : "=r"(lane));
  const int row = warp * 16 + (lane / 8) % 2 * 8 + lane % 8;
  const int group_in_pair = lane / 16;
#pragma unroll
  for (int j = 0; j < kCols / 8; j += 2) {
    const uint32_t address = tile + Tile::chunk_offset(row, j + group_in_pair);
    asm volatile("stmatrix.sync.aligned.m8n8.x4.shared.b16 [%0], {%1, %2, %3, %4};\n" ::"r"(address),
                 "r"(sm80::pack2<Element>(acc[4 * j], acc[4 * j + 1])),
                 "r"(sm80::pack2<Element>(acc[4 * j + 2], acc[4 * j + 3])),
                 "r"(sm80::pack2<Element>(acc[4 * j + 4], acc[4 * j + 5])),
                 "r"(sm80::pack2<Element>(acc[4 * j + 6], acc[4 * j + 7]))
                 : "memory");
  }
}

}  // namespace flashkit::sm90
