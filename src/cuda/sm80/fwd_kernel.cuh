// src/cuda/sm80/fwd_kernel.cuh
// \brief The FlashAttention-2-class forward kernel on mma.sync (Ampere, Ada, Hopper).
//
// One CTA computes kBlockM query rows of one (batch, head). It walks the visible key blocks from
// the last to the first (the last blocks are the ones cut by the causal diagonal or the sequence
// end, so the masked path runs first and the rest take the unmasked path). K and V tiles are
// double-buffered, so each key block costs one barrier and its loads have a whole block of compute
// to land:
//
//   prologue   cp.async Q, K[last], V[last] into stage 0
//   per block  wait for stage n; barrier     (K[n], V[n] landed; every warp is done with the
//                                             other stage, read during the previous block)
//              cp.async K[n-1], V[n-1] into the other stage
//              S = Q K[n]^T                  (mma.sync, fp32 accumulators in registers)
//              softcap / ALiBi / mask         (masking only on blocks the mask cuts)
//              online softmax: S -> P         (lazy rescaling of O, see online_softmax.cuh)
//              dropout (kDropout only)        (after the row sums: the normaliser and the LSE are
//                                             those of the undropped P; dropped P -> 0)
//              O += P V[n]                   (P straight from registers as the A operand)
//   epilogue   O / rowsum (x 1 / (1 - p)) -> 16-bit, staged through the Q tile for 16-byte
//              stores; LSE per row
//
// Dropout draws its mask from Philox (common/philox.h), addressed so that one call per lane covers
// the lane's 16 elements of a 16-row x 32-key block (~370 integer instructions per lane and key
// block at d128, next to ~1950 in the loop). It is a template flag, not a runtime branch: the
// kernels run at the 255-register cap, and the dropout block's live values made the register
// allocator spill inside the main loop of the p = 0 path (d96: 5 spill loads per key block; d256:
// 16 bytes where there were none), so the p = 0 instance is compiled exactly as without dropout
// and the dropout instance is its own. return_softmax is not part of this kernel either:
// fwd_attn_probs.cuh writes the probabilities afterwards from the LSE this kernel wrote.
//
// Everything that is per launch (scale, softcap, ALiBi, window, strides, varlen offsets) comes from
// the FwdProblem at run time; the element type, the tile shape and Traits::kDropout are template
// parameters, so there are two kernels per (dtype, head-dim family).
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>

#include "common/fwd_problem.h"
#include "cuda/common/attention_mask.cuh"
#include "cuda/common/dropout_mask.cuh"
#include "cuda/common/mma_sm80.cuh"
#include "cuda/common/online_softmax.cuh"
#include "cuda/common/score_mods.cuh"
#include "cuda/common/swizzled_tile.cuh"

namespace flashkit::sm80 {

template <typename Element_, int kHeadDim_, int kBlockM_, int kBlockN_, int kWarps_,
          bool kQInRegisters_, int kMinBlocksPerSm_, bool kDropout_>
struct FwdKernelTraits {
  using Element = Element_;
  static constexpr int kHeadDim = kHeadDim_;
  static constexpr int kBlockM = kBlockM_;
  static constexpr int kBlockN = kBlockN_;
  static constexpr int kWarps = kWarps_;
  static constexpr bool kQInRegisters = kQInRegisters_;

  static constexpr int kThreads = kWarps * 32;
  static constexpr int kWarpRows = kBlockM / kWarps;
  static constexpr int kMTiles = kWarpRows / 16;  // 16-row mma tiles per warp
  static constexpr int kNTiles = kBlockN / 8;     // 8-column tiles of S per warp
  static constexpr int kDTiles = kHeadDim / 8;    // 8-column tiles of O per warp
  static constexpr int kQkSteps = kHeadDim / 16;  // k-steps of Q.K^T
  static constexpr int kPvSteps = kBlockN / 16;   // k-steps of P.V
  static constexpr int kMinBlocksPerSm = kMinBlocksPerSm_;
  static constexpr bool kDropout = kDropout_;  // the instance that applies dropout (p > 0)

  using QTile = SwizzledTile<kBlockM, kHeadDim>;   // also stages O in the epilogue
  using KvTile = SwizzledTile<kBlockN, kHeadDim>;  // one K or V buffer

  // Shared-memory plan: [ Q | K stage 0 | V stage 0 | K stage 1 | V stage 1 ], byte offsets from the
  // dynamic shared-memory base; stage s of K (V) is at kKOffset (kVOffset) + s * kStageBytes.
  static constexpr int kStages = 2;
  static constexpr int kStageBytes = 2 * KvTile::kBytes;
  static constexpr int kQOffset = 0;
  static constexpr int kKOffset = kQOffset + QTile::kBytes;
  static constexpr int kVOffset = kKOffset + KvTile::kBytes;
  static constexpr int kSmemBytes = kKOffset + kStages * kStageBytes;

  static_assert(kWarpRows % 16 == 0, "a warp owns whole 16-row mma tiles");
  static_assert(kHeadDim % 16 == 0 && kBlockN % 16 == 0, "mma k-steps are 16 wide");
  static_assert((kBlockM * kHeadDim / 8) % kThreads == 0, "Q tile chunks split evenly");
  static_assert((kBlockN * kHeadDim / 8) % kThreads == 0, "K/V tile chunks split evenly");
  static_assert(kSmemBytes <= 227 * 1024, "shared memory plan exceeds an SM");
};

// Returns x unchanged, hidden from the optimizer so that nothing derived from it is hoisted.
__device__ __forceinline__ int64_t opaque(int64_t x) {
  int64_t y;
  asm volatile("mov.b64 %0, %1;\n" : "=l"(y) : "l"(x));
  return y;
}

// Copies a [Tile rows x head dim] block of a [rows x head_dim] global matrix (row stride in
// elements) into a swizzled shared tile with cp.async. Rows >= valid_rows and 16-byte chunks >=
// valid_chunks are zero-filled, which pads partial key blocks and head dims below the family.
// Thread t copies chunk t % chunks_per_row of rows t / chunks_per_row + i * (threads / chunks_per_row)
// when the threads cover whole rows, so one source pointer and one shared offset advance by a
// constant stride (and the swizzle, which depends on row % 8, stays fixed when the stride is a
// multiple of 8 rows); other shapes fall back to computing each chunk's position.
template <typename Traits, typename Tile>
__device__ __forceinline__ void load_tile_async(uint32_t smem_tile,
                                                const typename Traits::Element* gmem,
                                                int64_t row_stride, int valid_rows,
                                                int valid_chunks) {
  constexpr int kChunks = Tile::kChunksPerRow;
  constexpr int kPerThread = (Tile::kBytes / 16) / Traits::kThreads;
  const int tid = static_cast<int>(threadIdx.x);
  // The per-chunk source offsets (i * rows * row_stride) are loop-invariant across key blocks, so
  // the compiler would hoist all of them into 64-bit registers for K and for V and then spill. An
  // opaque copy of the stride makes it recompute them (a few IMADs per tile) instead.
  row_stride = opaque(row_stride);
  if constexpr (Traits::kThreads % kChunks == 0 && (Traits::kThreads / kChunks) % 8 == 0) {
    constexpr int kRowsPerPass = Traits::kThreads / kChunks;
    const int row = tid / kChunks;
    const int chunk = tid % kChunks;
    const uint32_t dst = smem_tile + Tile::chunk_offset(row, chunk);
    const auto* src = gmem + row * row_stride + chunk * 8;
    const bool chunk_valid = chunk < valid_chunks;
#pragma unroll
    for (int i = 0; i < kPerThread; ++i) {
      const bool valid = chunk_valid && row + i * kRowsPerPass < valid_rows;
      cp_async_16(dst + i * kRowsPerPass * Tile::kRowBytes,
                  valid ? src + i * kRowsPerPass * row_stride : gmem, valid);
    }
  } else {
#pragma unroll
    for (int i = 0; i < kPerThread; ++i) {
      const int index = tid + i * Traits::kThreads;
      const int row = index / kChunks;
      const int chunk = index % kChunks;
      const bool valid = row < valid_rows && chunk < valid_chunks;
      cp_async_16(smem_tile + Tile::chunk_offset(row, chunk),
                  valid ? gmem + row * row_stride + chunk * 8 : gmem, valid);
    }
  }
}

// Where this CTA's rows and keys live: batch/head, sequence lengths and base pointers.
template <typename Element>
struct FwdBlockLocation {
  int batch;
  int head;
  int m_block;
  int len_q;
  int len_k;
  const Element* q;  // row 0 of this (batch, head) sequence
  const Element* k;
  const Element* v;
  Element* out;
  float* lse;        // lse[row], row stride 1

  __device__ __forceinline__ static FwdBlockLocation locate(const FwdProblem& p, int block_m) {
    FwdBlockLocation loc;
    // Linear grid (no 65,535 limit on batch x heads): m-blocks vary fastest and run heaviest first,
    // so under a causal mask the long rows start early and the short ones fill the tail.
    const int num_m_blocks = (p.seqlen_q + block_m - 1) / block_m;
    const int linear = static_cast<int>(blockIdx.x);
    loc.m_block = num_m_blocks - 1 - linear % num_m_blocks;
    const int batch_head = linear / num_m_blocks;
    loc.head = batch_head % p.heads_q;
    loc.batch = batch_head / p.heads_q;
    const int kv_head = loc.head / (p.heads_q / p.heads_kv);

    int64_t q_token = 0, k_token = 0;
    loc.len_q = p.seqlen_q;
    loc.len_k = p.seqlen_k;
    if (p.cu_seqlens_q != nullptr) {
      q_token = p.cu_seqlens_q[loc.batch];
      k_token = p.cu_seqlens_k[loc.batch];
      loc.len_q = p.cu_seqlens_q[loc.batch + 1] - static_cast<int>(q_token);
      loc.len_k = p.seqused_k != nullptr ? p.seqused_k[loc.batch]
                                         : p.cu_seqlens_k[loc.batch + 1] - static_cast<int>(k_token);
    }
    const int64_t b = loc.batch;
    loc.q = static_cast<const Element*>(p.q) + b * p.q_batch_stride + q_token * p.q_row_stride +
            loc.head * p.q_head_stride;
    loc.k = static_cast<const Element*>(p.k) + b * p.k_batch_stride + k_token * p.k_row_stride +
            kv_head * p.k_head_stride;
    loc.v = static_cast<const Element*>(p.v) + b * p.v_batch_stride + k_token * p.v_row_stride +
            kv_head * p.v_head_stride;
    loc.out = static_cast<Element*>(p.out) + b * p.out_batch_stride + q_token * p.out_row_stride +
              loc.head * p.out_head_stride;
    loc.lse = p.lse + b * p.lse_batch_stride + loc.head * p.lse_head_stride;
    return loc;
  }
};

template <typename Traits>
__global__ void __launch_bounds__(Traits::kThreads, Traits::kMinBlocksPerSm)
    fwd_kernel(const __grid_constant__ FwdProblem p) {
  using Element = typename Traits::Element;
  using QTile = typename Traits::QTile;
  using KvTile = typename Traits::KvTile;
  constexpr int kBlockM = Traits::kBlockM;
  constexpr int kBlockN = Traits::kBlockN;
  constexpr int kMTiles = Traits::kMTiles;
  constexpr int kNTiles = Traits::kNTiles;
  constexpr int kDTiles = Traits::kDTiles;

  extern __shared__ __align__(128) unsigned char smem[];
  const uint32_t sQ = smem_address(smem + Traits::kQOffset);
  const uint32_t sK = smem_address(smem + Traits::kKOffset);
  const uint32_t sV = smem_address(smem + Traits::kVOffset);

  const int lane = static_cast<int>(threadIdx.x) % 32;
  const int warp = static_cast<int>(threadIdx.x) / 32;
  const int warp_row0 = warp * Traits::kWarpRows;  // first row of this warp within the block

  // ldmatrix addresses (see SwizzledTile::LaneAddresses). Q and V fragments: lane gives row
  // lane % 16 and chunk half lane / 16; K fragments (two 8-key tiles x two 8-dim halves): key
  // lane % 8 + 8 * (lane / 16), chunk half (lane / 8) % 2.
  const typename QTile::LaneAddresses q_addr(sQ, warp_row0 + lane % 16, lane / 16);
  const typename KvTile::LaneAddresses k_addr(sK, lane % 8 + (lane / 16) * 8, (lane / 8) % 2);
  const typename KvTile::LaneAddresses v_addr(sV, lane % 16, lane / 16);

  const FwdBlockLocation<Element> loc = FwdBlockLocation<Element>::locate(p, kBlockM);
  const int m0 = loc.m_block * kBlockM;
  if (m0 >= loc.len_q) return;  // varlen: this sequence is shorter than max_seqlen_q
  const int rows_in_block = min(kBlockM, loc.len_q - m0);
  const int head_chunks = p.head_dim / 8;

  const KeyWindow window{loc.len_q, loc.len_k, p.window_left, p.window_right};
  const int key_lo = window.key_begin(m0);
  const int key_hi = window.key_end(m0 + rows_in_block - 1);
  const int n_begin = key_lo / kBlockN;
  const int n_end = key_hi > key_lo ? (key_hi + kBlockN - 1) / kBlockN : n_begin;

  float acc_o[kMTiles][kDTiles][4];
  zero_accumulators(acc_o);

  OnlineSoftmax<kMTiles, kNTiles, kDTiles> softmax;
  softmax.init();

  // Scores are exponentiated as exp2(x * log2_scale - ...). Without softcap or ALiBi, x is the raw
  // dot product and the softmax scale folds into log2_scale; with them, x is already scaled.
  constexpr float kLog2e = 1.4426950408889634f;
  const float alibi_slope =
      p.alibi_slopes != nullptr ? p.alibi_slopes[loc.batch * p.alibi_batch_stride + loc.head] : 0.0f;
  const bool transform = p.softcap > 0.0f || alibi_slope != 0.0f;
  const int diagonal = window.diagonal_offset();
  const float log2_scale = transform ? kLog2e : p.softmax_scale * kLog2e;
  // Read once: with a device rng_state the key is in global memory.
  const DropoutMask dropout_mask = Traits::kDropout ? p.dropout_mask() : DropoutMask{};

  if (n_end > n_begin) {
    load_tile_async<Traits, QTile>(sQ, loc.q + static_cast<int64_t>(m0) * p.q_row_stride,
                                   p.q_row_stride, rows_in_block, head_chunks);
    // K and V of key block n into pipeline stage `stage`.
    auto load_kv = [&](int n_block, int stage) {
      const int n0 = n_block * kBlockN;
      const uint32_t stage_offset = static_cast<uint32_t>(stage * Traits::kStageBytes);
      load_tile_async<Traits, KvTile>(sK + stage_offset, loc.k + static_cast<int64_t>(n0) * p.k_row_stride,
                                      p.k_row_stride, loc.len_k - n0, head_chunks);
      load_tile_async<Traits, KvTile>(sV + stage_offset, loc.v + static_cast<int64_t>(n0) * p.v_row_stride,
                                      p.v_row_stride, loc.len_k - n0, head_chunks);
      cp_async_commit();
    };
    load_kv(n_end - 1, 0);

    uint32_t q_frag[Traits::kQInRegisters ? kMTiles : 1][Traits::kQInRegisters ? Traits::kQkSteps : 1][4];

    for (int n_block = n_end - 1, stage = 0; n_block >= n_begin; --n_block, stage ^= 1) {
      const int n0 = n_block * kBlockN;
      cp_async_wait<0>();
      __syncthreads();
      if (n_block > n_begin) load_kv(n_block - 1, stage ^ 1);
      const uint32_t stage_offset = static_cast<uint32_t>(stage * Traits::kStageBytes);

      if constexpr (Traits::kQInRegisters) {
        if (n_block == n_end - 1) {
#pragma unroll
          for (int mt = 0; mt < kMTiles; ++mt)
#pragma unroll
            for (int kk = 0; kk < Traits::kQkSteps; ++kk)
              ldmatrix_x4(q_frag[mt][kk], q_addr.at(mt * 16, kk));
        }
      }

      // S = Q K^T for this warp's rows: each K fragment (ldmatrix.x4: two 8-key tiles x 16 dims)
      // feeds every m-tile of the warp.
      float acc_s[kMTiles][kNTiles][4];
      zero_accumulators(acc_s);

#pragma unroll
      for (int kk = 0; kk < Traits::kQkSteps; ++kk) {
        uint32_t a[kMTiles][4];
#pragma unroll
        for (int mt = 0; mt < kMTiles; ++mt) {
          if constexpr (Traits::kQInRegisters) {
#pragma unroll
            for (int i = 0; i < 4; ++i) a[mt][i] = q_frag[mt][kk][i];
          } else {
            ldmatrix_x4(a[mt], q_addr.at(mt * 16, kk));
          }
        }
#pragma unroll
        for (int np = 0; np < kNTiles / 2; ++np) {
          uint32_t b[4];
          ldmatrix_x4(b, k_addr.at(np * 16, kk) + stage_offset);
          mma_column_pair<Element>(acc_s, a, b, np);
        }
      }

      if (transform) transform_scores<Traits>(acc_s, p, m0 + warp_row0, n0, alibi_slope, diagonal);
      if (!window.block_unmasked(m0, m0 + rows_in_block, n0, n0 + kBlockN)) {
        mask_scores<Traits>(acc_s, window, m0 + warp_row0, n0);
      }
      softmax.update(acc_s, acc_o, log2_scale);
      if constexpr (Traits::kDropout) {
        apply_dropout(acc_s, dropout_mask,
                      static_cast<uint32_t>(loc.batch * p.heads_q + loc.head), m0 + warp_row0, n0);
      }

      // O += P V: the probabilities of two adjacent 8-key tiles form one A fragment.
#pragma unroll
      for (int kk = 0; kk < Traits::kPvSteps; ++kk) {
        uint32_t a[kMTiles][4];
#pragma unroll
        for (int mt = 0; mt < kMTiles; ++mt) {
          a[mt][0] = pack2<Element>(acc_s[mt][2 * kk][0], acc_s[mt][2 * kk][1]);
          a[mt][1] = pack2<Element>(acc_s[mt][2 * kk][2], acc_s[mt][2 * kk][3]);
          a[mt][2] = pack2<Element>(acc_s[mt][2 * kk + 1][0], acc_s[mt][2 * kk + 1][1]);
          a[mt][3] = pack2<Element>(acc_s[mt][2 * kk + 1][2], acc_s[mt][2 * kk + 1][3]);
        }
#pragma unroll
        for (int dp = 0; dp < kDTiles / 2; ++dp) {
          uint32_t b[4];
          ldmatrix_x4_trans(b, v_addr.at(kk * 16, dp) + stage_offset);
          mma_column_pair<Element>(acc_o, a, b, dp);
        }
      }
    }
  }

  float lse[2 * kMTiles];
  softmax.finalize(acc_o, log2_scale, lse,
                   Traits::kDropout ? 1.0f / (1.0f - p.dropout_p) : 1.0f);

  // Epilogue. The warp stages its own rows of O in its own rows of the Q tile (no other warp reads
  // them), then writes 16-byte chunks, skipping rows past the sequence and columns past head_dim.
  __syncwarp();
#pragma unroll
  for (int mt = 0; mt < kMTiles; ++mt) {
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      const int row = warp_row0 + mt * 16 + lane / 4 + half * 8;
#pragma unroll
      for (int dt = 0; dt < kDTiles; ++dt) {
        const uint32_t value = pack2<Element>(acc_o[mt][dt][2 * half], acc_o[mt][dt][2 * half + 1]);
        const uint32_t addr = sQ + QTile::chunk_offset(row, dt) + (lane % 4) * 4;
        asm volatile("st.shared.b32 [%0], %1;\n" ::"r"(addr), "r"(value));
      }
    }
  }
  __syncwarp();
  constexpr int kChunks = QTile::kChunksPerRow;
#pragma unroll
  for (int i = lane; i < Traits::kWarpRows * kChunks; i += 32) {
    const int row = warp_row0 + i / kChunks;
    const int chunk = i % kChunks;
    if (row < rows_in_block && chunk < head_chunks) {
      uint4 value;
      asm volatile("ld.shared.v4.b32 {%0, %1, %2, %3}, [%4];\n"
                   : "=r"(value.x), "=r"(value.y), "=r"(value.z), "=r"(value.w)
                   : "r"(sQ + QTile::chunk_offset(row, chunk)));
      *reinterpret_cast<uint4*>(loc.out + static_cast<int64_t>(m0 + row) * p.out_row_stride + chunk * 8) =
          value;
    }
  }
  if (lane % 4 == 0) {
#pragma unroll
    for (int mt = 0; mt < kMTiles; ++mt) {
#pragma unroll
      for (int half = 0; half < 2; ++half) {
        const int row = warp_row0 + mt * 16 + lane / 4 + half * 8;
        if (row < rows_in_block) loc.lse[m0 + row] = lse[2 * mt + half];
      }
    }
  }
}

}  // namespace flashkit::sm80
