// src/cuda/common/dropout_mask.cuh
// \brief Dropout applied to a warp's probability tile in the mma.sync accumulator layout (kMTiles
// 16-row tiles x kNTiles 8-column groups, 4 floats each; lane g = lane / 4 holds rows g and g + 8,
// lane t = lane % 4 columns 2t and 2t + 1 of each group), with the Philox mask of common/philox.h.
// The m64nN wgmma accumulator of an sm90 warpgroup is that layout for each warp's 16 rows, so a
// Hopper kernel can use this too.
//
// The mask's addressing is built for this layout: with the tile's first row a multiple of 16 and
// its first key a multiple of 32, lane l is Philox slot l of every 16 x 32 block, and one Philox
// call gives it exactly its 16 elements of the block (rows g, g + 8 x keys 2t, 2t + 1 of four
// 8-column groups). The backward's S^T tile (keys as rows) maps onto it with one exchange between
// lane pairs: see mark_dropped_transposed.
#pragma once

#include <cstdint>

#include "common/philox.h"

namespace flashkit::sm80 {

// Sets the probabilities that the mask drops to 0 (the 1 / (1 - p) scale of the kept ones is the
// caller's, applied once to the output). Rows first_row + mt * 16 + g (+ 8), keys first_key +
// nt * 8 + 2t (+ 1); first_row must be a multiple of 16 and first_key of 32.
template <int kMTiles, int kNTiles>
__device__ __forceinline__ void apply_dropout(float (&p)[kMTiles][kNTiles][4],
                                              const DropoutMask& mask, uint32_t batch_head,
                                              int first_row, int first_key) {
  static_assert(kNTiles % 4 == 0, "a Philox call covers four 8-key groups");
  const uint32_t lane = threadIdx.x % 32;
#pragma unroll
  for (int mt = 0; mt < kMTiles; ++mt) {
    const uint32_t row16 = static_cast<uint32_t>(first_row + mt * 16) / 16;
#pragma unroll
    for (int group = 0; group < kNTiles / 4; ++group) {
      const PhiloxBlock bits =
          mask.block(batch_head, row16, lane, static_cast<uint32_t>(first_key) / 32 + group);
#pragma unroll
      for (int half = 0; half < 2; ++half) {
#pragma unroll
        for (int tile = 0; tile < 4; ++tile) {
#pragma unroll
          for (int e = 0; e < 2; ++e) {
            if (!mask.keeps(bits, half * 8 + tile * 2 + e))
              p[mt][4 * group + tile][2 * half + e] = 0.0f;
          }
        }
      }
    }
  }
}

// The backward's S^T tile: kKeyTiles 16-key row tiles x kQueryTiles 8-query column groups, lane
// g = lane / 4 holding keys g, g + 8 and lane t = lane % 4 queries 2t, 2t + 1 of each. Dropped
// probabilities get their sign flipped instead of being zeroed (P >= 0): dV wants the kept P,
// max(P, 0), and dS wants both P and the decision, |P| and the sign.
//
// Element (query i, key j) of lane (g, t) has i % 8 = 2t + e and j % 8 = g, so its Philox slot
// (i % 8) * 4 + (j % 8) / 2 = (2t + e) * 4 + g / 2 is shared by lanes g and g ^ 1 (lane ^ 4) for
// both e, and its byte ((i % 16) / 8) * 8 + ((j % 32) / 8) * 2 + j % 2 has j % 2 = g % 2: per 16
// queries x 32 keys the pair needs two calls (e = 0, 1) and each lane half of each call's bytes.
// Lane g draws the call of e = g % 2, keeps the 8 bytes of its key parity and trades the other 8
// for its partner's: one call, four byte_perm and two shuffles per 16 decisions, the forward's
// count. With 16 keys per warp (kKeyTiles == 1) half of the decisions belong to another warp and
// are drawn there too. first_query must be a multiple of 16 and first_key of 16 (32 when the warp
// spans 32 keys or more).
template <int kKeyTiles, int kQueryTiles>
__device__ __forceinline__ void mark_dropped_transposed(float (&p)[kKeyTiles][kQueryTiles][4],
                                                        const DropoutMask& mask, uint32_t batch_head,
                                                        int first_key, int first_query) {
  static_assert(kQueryTiles % 2 == 0, "a Philox call covers two 8-query groups");
  static_assert(kKeyTiles == 1 || kKeyTiles % 2 == 0, "a Philox call covers 32 keys");
  constexpr int kKeyBlocks = (kKeyTiles + 1) / 2;     // 32-key blocks of the warp
  constexpr int kTilesPerBlock = kKeyTiles == 1 ? 1 : 2;
  const uint32_t lane = threadIdx.x % 32;
  const uint32_t parity = (lane / 4) % 2;
  const uint32_t slot = ((lane % 4) * 2 + parity) * 4 + lane / 8;
  // __byte_perm selectors taking the even (odd) bytes of two words, in order: bytes 2c + parity of
  // words 2h, 2h + 1 are the decisions of key groups c = 0..3 of this parity.
  const uint32_t own_bytes = parity != 0 ? 0x7531u : 0x6420u;
  const uint32_t partner_bytes = parity != 0 ? 0x6420u : 0x7531u;
  // The warp's first 8-key group within its 32-key block (0 or 2 with 16 keys per warp).
  const int first_group = kKeyTiles == 1 ? (first_key % 32) / 8 : 0;
#pragma unroll
  for (int m = 0; m < kQueryTiles / 2; ++m) {
    const uint32_t row16 = static_cast<uint32_t>(first_query) / 16 + m;
#pragma unroll
    for (int kb = 0; kb < kKeyBlocks; ++kb) {
      const PhiloxBlock bits =
          mask.block(batch_head, row16, slot, static_cast<uint32_t>(first_key) / 32 + kb);
      // by_query[e][h]: byte c decides key group c for query 16 * row16 + 8h + 2t + e.
      uint32_t by_query[2][2];
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const uint32_t own = __byte_perm(bits.word[2 * h], bits.word[2 * h + 1], own_bytes);
        const uint32_t sent = __byte_perm(bits.word[2 * h], bits.word[2 * h + 1], partner_bytes);
        const uint32_t received = __shfl_xor_sync(0xffffffffu, sent, 4);
        by_query[0][h] = parity != 0 ? received : own;
        by_query[1][h] = parity != 0 ? own : received;
      }
#pragma unroll
      for (int tile = 0; tile < kTilesPerBlock; ++tile) {
#pragma unroll
        for (int half = 0; half < 2; ++half) {
          const int group = first_group + 2 * tile + half;
#pragma unroll
          for (int h = 0; h < 2; ++h) {
#pragma unroll
            for (int e = 0; e < 2; ++e) {
              float& x = p[kb * kTilesPerBlock + tile][2 * m + h][2 * half + e];
              if (!mask.keeps_byte(by_query[e][h], group)) x = -x;
            }
          }
        }
      }
    }
  }
}

// Drop marks: the decisions of four Philox bytes at once, for kernels that mask packed 16-bit
// probabilities (the sm90 forward's P operand) instead of fp32 ones. Bit 7 of each byte of
// marks(w) is set where that byte of w drops its element (byte >= keep_threshold): b >= T exactly
// when b + (256 - T) carries out of the byte, and that carry is the majority of the two bit 7s and
// of bit 7 of the sum of the low seven bits, which cannot carry into the next byte. Three
// instructions per word; the other bits of the result are don't-care. T = 0 (256 - T does not fit
// a byte) takes addend bit 7 and a low addend of 128, which makes every carry 1.
struct DropMarker {
  uint32_t addend;      // 256 - T in every byte (0 when T = 256: nothing is dropped)
  uint32_t addend_low;  // its low seven bits (128 when T = 0)

  __device__ __forceinline__ explicit DropMarker(const DropoutMask& mask)
      : addend(mask.keep_threshold == 0u ? 0x80808080u : ((256u - mask.keep_threshold) & 0xffu) * 0x01010101u),
        addend_low(mask.keep_threshold == 0u ? 0x80808080u : addend & 0x7f7f7f7fu) {}

  __device__ __forceinline__ uint32_t marks(uint32_t word) const {
    const uint32_t low_sum = (word & 0x7f7f7f7fu) + addend_low;
    return (word & addend) | (word & low_sum) | (addend & low_sum);  // one LOP3: the carries
  }
};

// The backward's S^T drop marks for a warp holding 16 keys whose neighbour warp holds the other 16
// keys of the same 32-key block (the sm90 backward: warp w of a warpgroup holds keys 16w .. 16w +
// 15), passed through shared memory in two steps: store_transposed_marks_pair draws and stores,
// and after a barrier of the caller's load_transposed_marks reads a lane's marks.
//
// Both warps need the same Philox calls: lane l (g = l / 4, t = l % 4) of either needs slot (2t +
// e) * 4 + g / 2 (mark_dropped_transposed's addressing) of each 16-query row block for its queries
// 2t + e, e = 0, 1, and of a call's four words, words q and 2 + q decide the keys of pair rank q (0:
// the block's first 16 keys), query halves h = 0 and 1. So rank r draws only the calls of the row
// blocks m with m % 2 == r and writes both ranks' words: half the calls of drawing every block in
// both warps. Each word becomes drop marks (DropMarker) and is stored as drawn: the lane a reader
// takes its bytes from (those of its key parity g % 2) is chosen by kept_transposed's selector.
//
// Which lane draws which slot is free: lane d draws slot (2t + e) * 4 + k with t = (d / 2) % 4, e =
// d % 2, k = d / 8, so that the two calls a reader (t, k = g / 2) needs (e = 0, 1) are next to each
// other. The exchange (one per warp pair: kRowBlocks x 32 chunks of 16 bytes) holds in chunk m * 32
// + t + 4 (k % 2) + 8q + 16 (k / 2) the marks of words q and 2 + q (h = 0, 1) of the calls e = 0, 1
// of row block m, i.e. word 2e + h of the chunk. A reader's chunk is (l & 0x13) + ((l / 2) & 4) +
// 8 rank, a drawer's 8-byte slot d + (d & 16) + 16q: one 8-byte store per call and rank from the
// drawing lane (each half warp's 16 stores on 16 different 8-byte bank pairs), one 16-byte load per
// row block for the reader. (Each lane drawing the call of its own queries 2t + g % 2 and storing
// the bytes its partner lane l ^ 4 needs cost a byte_perm per stored word, 8 per warp and query
// block at d128, and twice the stores.) `keys`: mask.round_keys().
template <int kRowBlocks>
__device__ __forceinline__ void store_transposed_marks_pair(const DropoutMask& mask, const PhiloxRoundKeys& keys,
                                                            const DropMarker& marker, uint32_t batch_head,
                                                            int first_key, int first_query, uint32_t* exchange) {
  static_assert(kRowBlocks % 2 == 0, "the pair's two warps draw the same number of calls");
  const uint32_t lane = threadIdx.x % 32;
  const uint32_t slot = (lane & 6u) * 4u + (lane % 2) * 4u + lane / 8;  // (2t + e) * 4 + k
  const int pair_slot = static_cast<int>(lane + (lane & 0x10u));       // chunk (t + 4 (k % 2) + 16 (k / 2)) * 2 + e
  const int rank = (first_key / 16) % 2;
  const uint32_t key32 = static_cast<uint32_t>(first_key) / 32;
  const uint32_t row16 = static_cast<uint32_t>(first_query) / 16;
#pragma unroll
  for (int c = 0; c < kRowBlocks / 2; ++c) {
    const int m = 2 * c + rank;
    const PhiloxBlock bits = mask.block(batch_head, row16 + static_cast<uint32_t>(m), slot, key32, keys);
#pragma unroll
    for (int q = 0; q < 2; ++q) {
      const uint2 marks = make_uint2(marker.marks(bits.word[q]), marker.marks(bits.word[2 + q]));
      *reinterpret_cast<uint2*>(exchange + (m * 64 + 16 * q + pair_slot) * 2) = marks;
    }
  }
}

// This lane's marks from a pair exchange that store_transposed_marks_pair filled (both warps of the
// pair, before a barrier): marks[m][e][h] = the marks of word 2h + rank of the call of row block m
// that holds the lane's queries 2t + e, one 16-byte load per row block.
template <int kRowBlocks>
__device__ __forceinline__ void load_transposed_marks(uint32_t (&marks)[kRowBlocks][2][2], const uint32_t* exchange,
                                                      int first_key) {
  const int lane = static_cast<int>(threadIdx.x % 32);
  // t + 4 (k % 2) + 8 rank + 16 (k / 2)
  const int chunk = (lane & 0x13) + ((lane >> 1) & 4) + 8 * ((first_key / 16) % 2);
#pragma unroll
  for (int m = 0; m < kRowBlocks; ++m) {
    const uint4 words = *reinterpret_cast<const uint4*>(exchange + (m * 32 + chunk) * 4);
    marks[m][0][0] = words.x;
    marks[m][0][1] = words.y;
    marks[m][1][0] = words.z;
    marks[m][1][1] = words.w;
  }
}

// The PRMT selectors of kept_transposed for this lane: selectors[tile] replicates the sign of byte
// 2 tile + parity (the lane's key parity, (lane / 4) % 2) over a word.
__device__ __forceinline__ void transposed_mark_selectors(uint32_t (&selectors)[2]) {
  selectors[0] = (threadIdx.x & 4u) != 0 ? 0x9999u : 0x8888u;
  selectors[1] = selectors[0] + 0x2222u;
}

// Dropout on element [nt][i] of a warp's S^T-layout fragments (16 keys x 2 kRowBlocks 8-query
// groups), with the marks of load_transposed_marks: x where the mask keeps the element, 0 where it
// drops it. The element (key g + 8 (i / 2), query 8 nt + 2t + i % 2) is byte 2 (i / 2) + parity of
// marks[nt / 2][i % 2][nt % 2] (transposed_mark_selectors). Two integer instructions: PRMT
// replicates the mark over a word and LOP3 clears x with it. A bit test into a predicate and a
// select count the same, but in the sm90 backward the compiler hoisted those tests, kept some
// predicates as bits of a register and spilled more: 43 more instructions in its main loop (bf16
// d128), 14 of them spill loads.
template <int kRowBlocks>
__device__ __forceinline__ float kept_transposed(const uint32_t (&marks)[kRowBlocks][2][2],
                                                 const uint32_t (&selectors)[2], int nt, int i, float x) {
  uint32_t dropped;
  asm("prmt.b32 %0, %1, %1, %2;\n" : "=r"(dropped) : "r"(marks[nt / 2][i % 2][nt % 2]), "r"(selectors[i / 2]));
  return __uint_as_float(__float_as_uint(x) & ~dropped);
}

// The drop marks of a warp's 16 rows x (32 * kKeyBlocks) keys in the m16n8 accumulator layout
// (apply_dropout's addressing: one Philox call per lane and 32 keys): marks[b][w] holds the bytes of
// word w of key block b. first_row must be a multiple of 16 and first_key of 32.
template <int kKeyBlocks>
__device__ __forceinline__ void draw_drop_marks(uint32_t (&marks)[kKeyBlocks][4], const DropoutMask& mask,
                                                const DropMarker& marker, uint32_t batch_head, int first_row,
                                                int first_key) {
  const uint32_t lane = threadIdx.x % 32;
#pragma unroll
  for (int b = 0; b < kKeyBlocks; ++b) {
    const PhiloxBlock bits = mask.block(batch_head, static_cast<uint32_t>(first_row) / 16, lane,
                                        static_cast<uint32_t>(first_key) / 32 + b);
#pragma unroll
    for (int w = 0; w < 4; ++w) marks[b][w] = marker.marks(bits.word[w]);
  }
}

// Zeroes the dropped halves of packed A fragments of P (m16n8k16: a[kk] holds rows g, g + 8 x keys
// 16 kk + 2t, + 1 and 16 kk + 8 + 2t, + 1, two 16-bit values per register). The two values of a
// register are bytes 2c, 2c + 1 of one Philox word (apply_dropout's byte order), so one PRMT
// replicating their bit 7 across each half gives the register's drop mask: two instructions per
// two elements instead of three per element on the fp32 values.
template <int kKSteps>
__device__ __forceinline__ void drop_packed_pairs(uint32_t (&a)[kKSteps][4], const uint32_t (&marks)[kKSteps / 2][4]) {
  static_assert(kKSteps % 2 == 0, "drop marks cover 32 keys, two k-steps");
#pragma unroll
  for (int kk = 0; kk < kKSteps; ++kk) {
#pragma unroll
    for (int r = 0; r < 4; ++r) {
      // Register r: rows g (r even) or g + 8 (odd), keys of the k-step's first (r < 2) or second
      // 8-key group: word 2 * (r % 2) + kk % 2 of the block, bytes 0-1 (r < 2) or 2-3.
      const uint32_t word = marks[kk / 2][2 * (r % 2) + kk % 2];
      uint32_t drop;
      if (r < 2) {
        asm("prmt.b32 %0, %1, %1, 0x9988;\n" : "=r"(drop) : "r"(word));  // sign of bytes 0, 1
      } else {
        asm("prmt.b32 %0, %1, %1, 0xBBAA;\n" : "=r"(drop) : "r"(word));  // sign of bytes 2, 3
      }
      a[kk][r] &= ~drop;
    }
  }
}

}  // namespace flashkit::sm80
