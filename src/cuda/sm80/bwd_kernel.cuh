// src/cuda/sm80/bwd_kernel.cuh
// \brief The FlashAttention-2-class backward kernel on mma.sync (Ampere, Ada, Hopper).
//
// One CTA owns kBlockN keys of one (batch, query head) and walks, first to last, the query blocks
// whose forward pass visited that key block (the same block-level visibility test as the forward,
// so causal and window blocks that are fully masked are skipped and only cut blocks pay for
// per-element masking). K and V stay in shared memory; Q, dO and the rows' LSE and dot(dO, O) are
// double-buffered, so each query block's loads land during the previous block's compute:
//
//   prologue     cp.async K, V, then Q, dO, LSE, dot of the first query block into stage 0
//   per block    wait for stage s; barrier   (every warp is done with the other stage, P^T and dS^T)
//                cp.async the next query block into the other stage
//                S^T = K Q^T                 (warps tile keys x queries, 32 x 32 where it fits)
//                softcap / ALiBi / mask; P^T = exp2(S^T log2e - LSE log2e) -> shared memory
//                dP^T = V dO^T               (same warp tiles)
//                dS^T = P^T (dP^T - dot) [* softcap derivative] -> shared memory; barrier
//                dV += P^T dO, dK += dS^T Q  (warps re-tiled over keys x head dim; P^T, dS^T read
//                                             back with ldmatrix, dO, Q with ldmatrix.trans)
//                dQ_block = dS K             (warps re-tiled over queries x head dim)
//                dQ accumulator += dQ_block  (fp32 atomics; deterministic mode: in a fixed key-block
//                                             order, see below)
//   epilogue     dK * scale, dV -> dk, dv (MHA) or the fp32 per-query-head workspace (GQA/MQA)
// Where one warp spans all queries of S^T and all columns of dK/dV (8 x 1 layouts, kPInRegisters),
// P^T and dS^T are already the A fragments of dV and dK: dV += P^T dO runs right after P^T, dK +=
// dS^T Q right after dS^T, both from registers, and only dS^T is stored (for dQ).
//
// The scale (and softcap's chain rule) is applied to dS by the end users: dK here, dQ in the
// convert kernel. Rows with no visible key have LSE = -inf, read as +inf, so their P is 0.
//
// The arch-independent pieces (BwdBlockLocation, VisibleQueryBlocks, the S^T-fragment helpers
// transform/mask/probabilities/score_gradients and softcap_chain_rule_t, store_keys_by_queries, add_dq_rows,
// store_key_gradients, deterministic mode's DqAddTurn and publish_dq_adds) are shared with the sm90
// backward (src/cuda/sm90/bwd_kernel_sm90.cuh), whose warps hold S^T in the same fragment layout.
//
// Dropout (Traits::kDropout, its own instance so that the p = 0 kernel is compiled exactly as
// without it, as in the forward) regenerates the forward's Philox mask Z in {0, 1/(1-p)} (the
// reference backward's m_ij) for the warp's S^T tile right after P^T and marks dropped entries by
// flipping their sign. dV += (P o Z)^T dO takes max(P^T, 0) (the conversion to 16 bits clamps for
// free) and the 1/(1-p) once in the epilogue; after dP^T = V dO^T, dP^T becomes dP^T o Z and P^T
// |P^T|, so dS^T = P^T (dP^T o Z - dot) is the unchanged code below. dot = rowsum(dO o O) needs
// nothing: O is the dropped output.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>
#include <type_traits>

#include "common/bwd_problem.h"
#include "cuda/common/attention_mask.cuh"
#include "cuda/common/dropout_mask.cuh"
#include "cuda/common/mma_sm80.cuh"
#include "cuda/common/score_mods.cuh"
#include "cuda/common/swizzled_tile.cuh"
#include "cuda/sm80/bwd_workspace_pointers.cuh"
#include "cuda/sm80/fwd_kernel.cuh"

namespace flashkit::sm80 {

template <typename Element_, int kHeadDim_, int kBlockM_, int kBlockN_, int kWarps_, int kSKeyWarps_,
          int kKvKeyWarps_, int kMinBlocksPerSm_, bool kDropout_>
struct BwdKernelTraits {
  using Element = Element_;
  static constexpr bool kDropout = kDropout_;  // the instance that regenerates the mask (p > 0)
  static constexpr int kHeadDim = kHeadDim_;
  static constexpr int kBlockM = kBlockM_;
  static constexpr int kBlockN = kBlockN_;
  static constexpr int kWarps = kWarps_;
  static constexpr int kMinBlocksPerSm = kMinBlocksPerSm_;
  static constexpr int kThreads = kWarps * 32;

  // S^T and dP^T (keys x queries): kSKeyWarps x kSQueryWarps warps, each kSKeyTiles 16-key row
  // tiles x kSQueryTiles 8-query column tiles.
  static constexpr int kSKeyWarps = kSKeyWarps_;
  static constexpr int kSQueryWarps = kWarps / kSKeyWarps;
  static constexpr int kSKeyTiles = kBlockN / kSKeyWarps / 16;
  static constexpr int kSQueryTiles = kBlockM / kSQueryWarps / 8;
  // dK and dV (keys x head dim): kKvKeyWarps x kKvDimWarps warps, each kKvKeyTiles 16-key row tiles
  // x kKvTiles 8-column tiles.
  static constexpr int kKvKeyWarps = kKvKeyWarps_;
  static constexpr int kKvDimWarps = kWarps / kKvKeyWarps;
  static constexpr int kKvKeyTiles = kBlockN / kKvKeyWarps / 16;
  static constexpr int kKvTiles = kHeadDim / kKvDimWarps / 8;
  // dQ (queries x head dim): kDqRowWarps x kDqColWarps warps, each 16 queries x kDqTiles tiles.
  static constexpr int kDqRowWarps = kBlockM / 16;
  static constexpr int kDqColWarps = kWarps / kDqRowWarps;
  static constexpr int kDqTiles = kHeadDim / kDqColWarps / 8;
  // With one warp across the queries in S^T and across the head dim in dK/dV, a warp's S^T rows
  // are exactly its dK/dV rows: P^T and dS^T then feed dV and dK straight from registers (packed
  // C fragments are A fragments) and only dS^T goes to shared memory, for dQ.
  static constexpr bool kPInRegisters = kSQueryWarps == 1 && kKvDimWarps == 1;

  static constexpr int kQuerySteps = kBlockM / 16;          // k-steps of P^T dO and dS^T Q
  static constexpr int kDimSteps = kHeadDim / 16;           // k-steps of K Q^T and V dO^T
  static constexpr int kKeySteps = kBlockN / 16;            // k-steps of dS K

  using KvTile = SwizzledTile<kBlockN, kHeadDim>;  // K, V
  using QTile = SwizzledTile<kBlockM, kHeadDim>;   // Q, dO
  using PTile = SwizzledTile<kBlockN, kBlockM>;    // P^T, dS^T: keys x queries

  // Shared-memory plan (byte offsets from the dynamic shared-memory base):
  //   [ K | V | Q stage 0 | dO stage 0 | Q stage 1 | dO stage 1 | P^T | dS^T | LSE x 2 | dot x 2 ]
  // (no P^T with kPInRegisters)
  // stage s of Q (dO) is at kQOffset (kDoOffset) + s * kStageBytes; of LSE (dot) at kLseOffset
  // (kDotOffset) + s * kRowStatsBytes.
  static constexpr int kStages = 2;
  static constexpr int kKOffset = 0;
  static constexpr int kVOffset = kKOffset + KvTile::kBytes;
  static constexpr int kQOffset = kVOffset + KvTile::kBytes;
  static constexpr int kDoOffset = kQOffset + QTile::kBytes;
  static constexpr int kStageBytes = 2 * QTile::kBytes;
  static constexpr int kPOffset = kQOffset + kStages * kStageBytes;
  static constexpr int kDsOffset = kPOffset + (kPInRegisters ? 0 : PTile::kBytes);
  static constexpr int kRowStatsBytes = kBlockM * static_cast<int>(sizeof(float));
  static constexpr int kLseOffset = kDsOffset + PTile::kBytes;
  static constexpr int kDotOffset = kLseOffset + kStages * kRowStatsBytes;
  static constexpr int kSmemBytes = kDotOffset + kStages * kRowStatsBytes;

  static_assert(kWarps % kSKeyWarps == 0 && kWarps % kKvKeyWarps == 0, "warp layouts tile the CTA");
  static_assert(kSKeyTiles * kSKeyWarps * 16 == kBlockN, "S^T warps tile the keys in 16-key tiles");
  static_assert(kSQueryTiles * kSQueryWarps * 8 == kBlockM, "S^T warps tile the queries");
  static_assert(kKvKeyTiles * kKvKeyWarps * 16 == kBlockN, "dK/dV warps tile the keys in 16-key tiles");
  static_assert(kKvTiles * kKvDimWarps * 8 == kHeadDim, "dK/dV warps tile the head dim");
  static_assert(kWarps % kDqRowWarps == 0, "dQ warps tile the query block evenly");
  static_assert(kKvTiles % 2 == 0 && kDqTiles % 2 == 0 && kSQueryTiles % 2 == 0,
                "B fragments come in 16-column pairs");
  static_assert(kHeadDim % 16 == 0, "mma k-steps are 16 wide");
  static_assert(2 * kBlockM <= kThreads, "one thread per LSE / dot row copy");
  static_assert((kBlockM * kHeadDim / 8) % kThreads == 0, "Q tile chunks split evenly");
  static_assert((kBlockN * kHeadDim / 8) % kThreads == 0, "K/V tile chunks split evenly");
  static_assert(kSmemBytes * kMinBlocksPerSm <= 227 * 1024, "shared memory plan exceeds an SM");
};

// ldmatrix addresses of a lane for a warp that reads a fixed run of kSteps 16-column steps starting
// at a run-time step (a warp's share of the head dim): one base per step, since a run-time start
// moves the swizzle pattern.
template <typename Tile, int kSteps>
struct WarpColumnAddresses {
  uint32_t base[kSteps];

  __device__ __forceinline__ WarpColumnAddresses(uint32_t tile, int lane_row, int lane_chunk,
                                                 int first_step) {
#pragma unroll
    for (int s = 0; s < kSteps; ++s) {
      const int chunk = (2 * (first_step + s)) | lane_chunk;
      base[s] = tile + static_cast<uint32_t>(lane_row * Tile::kRowBytes +
                                             (chunk ^ Tile::swizzle_bits(lane_row)) * 16);
    }
  }

  __device__ __forceinline__ uint32_t at(int row_step, int step) const {
    return base[step] + static_cast<uint32_t>(row_step * Tile::kRowBytes);
  }
};

// 4-byte asynchronous copy global -> shared (zero-filled when !valid): the LSE and dot rows, whose
// starts are only 4-byte aligned.
__device__ __forceinline__ void cp_async_4(uint32_t smem_addr, const void* gmem, bool valid) {
  const int src_bytes = valid ? 4 : 0;
  asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;\n" ::"r"(smem_addr), "l"(gmem),
               "r"(src_bytes));
}

// p[0..3] += (a, b, c, d), each element atomically (p 16-byte aligned). Hopper has the vector
// reduction: one request instead of four, which matters because the dQ atomics share the L1/shared
// memory datapath that bounds the kernel.
__device__ __forceinline__ void atomic_add_x4(float* p, float a, float b, float c, float d) {
#if __CUDA_ARCH__ >= 900
  asm volatile("red.global.add.v4.f32 [%0], {%1, %2, %3, %4};\n" ::"l"(p), "f"(a), "f"(b), "f"(c), "f"(d)
               : "memory");
#else
  atomicAdd(p, a);
  atomicAdd(p + 1, b);
  atomicAdd(p + 2, c);
  atomicAdd(p + 3, d);
#endif
}

__device__ __forceinline__ int load_acquire(const int* p) {
  int value;
  asm volatile("ld.acquire.gpu.global.b32 %0, [%1];\n" : "=r"(value) : "l"(p) : "memory");
  return value;
}

// Where this CTA's keys and their queries live.
template <typename Element>
struct BwdBlockLocation {
  int batch;
  int head;     // query head
  int n_block;
  int len_q;
  int len_k;       // keys the queries attend to (seqused_k when given)
  int len_k_rows;  // rows of dk / dv this sequence owns (the packed length)
  int64_t q_flat;  // row 0's index in the flattened [total_q] / [total_k] row numbering
  int64_t k_flat;
  const Element* q;  // row 0 of this (batch, head) sequence
  const Element* k;
  const Element* v;
  const Element* dout;
  const float* lse;  // lse[row]
  const float* dot;  // dot[row]
  int64_t stats_row0;  // row 0's index in the workspace's dot and lse regions

  __device__ __forceinline__ static BwdBlockLocation locate(const BwdProblem& bp, const BwdWorkspacePointers& ws,
                                                             int block_n) {
    // Linear grid (no 65,535 limit on batch x heads), key blocks fastest. By default the first key
    // blocks start first: under a causal mask they see the most queries, so the heaviest CTAs run
    // early. Deterministic mode adds dQ in descending key-block order and must wait only on CTAs of
    // lower block index (started earlier), so it runs the grid backwards: last key blocks first.
    const int num_n_blocks = (bp.fwd.seqlen_k + block_n - 1) / block_n;
    const int linear = static_cast<int>(bp.deterministic ? gridDim.x - 1 - blockIdx.x : blockIdx.x);
    return at(bp, ws, linear % num_n_blocks, linear / num_n_blocks);
  }

  // Key block `n_block` of (batch, query head) number `batch_head` (= batch * heads_q + head).
  __device__ __forceinline__ static BwdBlockLocation at(const BwdProblem& bp, const BwdWorkspacePointers& ws,
                                                         int n_block, int batch_head) {
    const FwdProblem& p = bp.fwd;
    BwdBlockLocation loc;
    loc.n_block = n_block;
    loc.head = batch_head % p.heads_q;
    loc.batch = batch_head / p.heads_q;
    const int kv_head = loc.head / (p.heads_q / p.heads_kv);

    int64_t q_token = 0, k_token = 0;
    loc.len_q = p.seqlen_q;
    loc.len_k = p.seqlen_k;
    loc.len_k_rows = p.seqlen_k;
    loc.q_flat = static_cast<int64_t>(loc.batch) * p.seqlen_q;
    loc.k_flat = static_cast<int64_t>(loc.batch) * p.seqlen_k;
    if (p.cu_seqlens_q != nullptr) {
      q_token = p.cu_seqlens_q[loc.batch];
      k_token = p.cu_seqlens_k[loc.batch];
      loc.len_q = p.cu_seqlens_q[loc.batch + 1] - static_cast<int>(q_token);
      loc.len_k_rows = p.cu_seqlens_k[loc.batch + 1] - static_cast<int>(k_token);
      loc.len_k = p.seqused_k != nullptr ? p.seqused_k[loc.batch] : loc.len_k_rows;
      loc.q_flat = q_token;
      loc.k_flat = k_token;
    }
    const int64_t b = loc.batch;
    loc.q = static_cast<const Element*>(p.q) + b * p.q_batch_stride + q_token * p.q_row_stride +
            loc.head * p.q_head_stride;
    loc.k = static_cast<const Element*>(p.k) + b * p.k_batch_stride + k_token * p.k_row_stride +
            kv_head * p.k_head_stride;
    loc.v = static_cast<const Element*>(p.v) + b * p.v_batch_stride + k_token * p.v_row_stride +
            kv_head * p.v_head_stride;
    loc.dout = static_cast<const Element*>(bp.dout) + b * bp.dout_batch_stride +
               q_token * bp.dout_row_stride + loc.head * bp.dout_head_stride;
    loc.lse = p.lse + b * p.lse_batch_stride + loc.head * p.lse_head_stride;
    loc.stats_row0 = (b * p.heads_q + loc.head) * ws.stats_rows;
    loc.dot = ws.dot + loc.stats_row0;
    return loc;
  }
};

// The forward's score transform on a warp's S^T fragments (row = key, column = query): softcap or
// the plain scale, then ALiBi.
template <typename Traits>
__device__ __forceinline__ void transform_scores_t(
    float (&s)[Traits::kSKeyTiles][Traits::kSQueryTiles][4], const FwdProblem& p, int first_key,
    int first_query, float alibi_slope, int diagonal_offset) {
  scale_or_softcap<Traits::kSKeyTiles * Traits::kSQueryTiles * 4>(&s[0][0][0], p);
  if (alibi_slope != 0.0f) {
    const int lane = static_cast<int>(threadIdx.x) % 32;
#pragma unroll
    for (int kt = 0; kt < Traits::kSKeyTiles; ++kt) {
#pragma unroll
      for (int half = 0; half < 2; ++half) {
        const int key = first_key + kt * 16 + lane / 4 + half * 8;
#pragma unroll
        for (int nt = 0; nt < Traits::kSQueryTiles; ++nt) {
#pragma unroll
          for (int e = 0; e < 2; ++e) {
            const int query = first_query + nt * 8 + (lane % 4) * 2 + e;
            s[kt][nt][2 * half + e] += alibi_bias(alibi_slope, query, key, diagonal_offset);
          }
        }
      }
    }
  }
}

// Sets the S^T entries of (key, query) pairs the query may not see to -inf (cut blocks only).
template <typename Traits>
__device__ __forceinline__ void mask_scores_t(float (&s)[Traits::kSKeyTiles][Traits::kSQueryTiles][4],
                                              const KeyWindow& window, int first_key,
                                              int first_query) {
  const int lane = static_cast<int>(threadIdx.x) % 32;
#pragma unroll
  for (int nt = 0; nt < Traits::kSQueryTiles; ++nt) {
#pragma unroll
    for (int e = 0; e < 2; ++e) {
      const int query = first_query + nt * 8 + (lane % 4) * 2 + e;
      const int begin = window.key_begin(query);
      const int end = window.key_end(query);
#pragma unroll
      for (int kt = 0; kt < Traits::kSKeyTiles; ++kt) {
#pragma unroll
        for (int half = 0; half < 2; ++half) {
          const int key = first_key + kt * 16 + lane / 4 + half * 8;
          if (key < begin || key >= end) s[kt][nt][2 * half + e] = -INFINITY;
        }
      }
    }
  }
}

// Packs a warp's fp32 S^T-layout fragments to 16 bits and stores them into a keys x queries tile
// (P^T or dS^T) at the warp's key and query offsets. Each 8-query column tile is one 16-byte
// chunk of a row; the swizzle keeps the 8 rows of a store in distinct bank groups. kKeptOnly
// stores max(x, 0): the kept entries of a sign-marked P^T (dropout).
template <typename Traits, bool kKeptOnly = false>
__device__ __forceinline__ void store_keys_by_queries(
    uint32_t tile, const float (&x)[Traits::kSKeyTiles][Traits::kSQueryTiles][4], int first_key_row,
    int first_query_chunk) {
  using Element = typename Traits::Element;
  using PTile = typename Traits::PTile;
  const int lane = static_cast<int>(threadIdx.x) % 32;
#pragma unroll
  for (int kt = 0; kt < Traits::kSKeyTiles; ++kt) {
#pragma unroll
    for (int nt = 0; nt < Traits::kSQueryTiles; ++nt) {
#pragma unroll
      for (int half = 0; half < 2; ++half) {
        const int row = first_key_row + kt * 16 + lane / 4 + half * 8;
        const float lo = x[kt][nt][2 * half], hi = x[kt][nt][2 * half + 1];
        const uint32_t value = kKeptOnly ? pack2_relu<Element>(lo, hi) : pack2<Element>(lo, hi);
        const uint32_t addr = tile + PTile::chunk_offset(row, first_query_chunk + nt) + (lane % 4) * 4;
        asm volatile("st.shared.b32 [%0], %1;\n" ::"r"(addr), "r"(value));
      }
    }
  }
}

// The query blocks whose forward pass visits key block `n_block` (the forward's block-level test
// with this tiling): [begin, end), empty when begin >= end. Both bounds of a query block's key range
// grow with the block, so they form one run.
template <int kBlockM, int kBlockN>
struct VisibleQueryBlocks {
  int begin;
  int end;

  // One past the last key block that query block `m_block` sees.
  __device__ __forceinline__ static int key_block_end(const KeyWindow& window, int m_block) {
    return (window.key_end(min(m_block * kBlockM + kBlockM, window.len_q) - 1) + kBlockN - 1) / kBlockN;
  }

  __device__ __forceinline__ static VisibleQueryBlocks of(const KeyWindow& window, int n_block) {
    const int num_m_blocks = (window.len_q + kBlockM - 1) / kBlockM;
    VisibleQueryBlocks r{num_m_blocks, 0};
    for (int m_block = 0; m_block < num_m_blocks; ++m_block) {
      const int m0 = m_block * kBlockM;
      const int key_lo = window.key_begin(m0);
      const int key_hi = window.key_end(min(m0 + kBlockM, window.len_q) - 1);
      if (key_hi > key_lo && key_lo / kBlockN <= n_block && n_block < key_block_end(window, m_block)) {
        r.begin = min(r.begin, m_block);
        r.end = m_block + 1;
      }
    }
    return r;
  }
};

// Deterministic mode: each query block's dQ takes its key blocks' adds in descending key-block
// order. The query block's semaphore in the workspace (zeroed before the main kernel) counts the
// key blocks that have published their adds; key block n adds when all later key blocks that see
// the query block have. The grid order starts a head's key block n + 1 before its key block n
// (BwdBlockLocation::locate runs the grid backwards; the sm90 kernel has an order of its own), so
// the CTAs waited for started earlier and never wait for the waiter: no deadlock.
template <int kBlockM, int kBlockN>
struct DqAddTurn {
  int* semaphore;
  int turn;  // the count at which this key block adds

  __device__ __forceinline__ static DqAddTurn of(const BwdProblem& bp, const BwdWorkspacePointers& ws,
                                                 int batch, int head, const KeyWindow& window,
                                                 int m_block, int n_block) {
    const FwdProblem& p = bp.fwd;
    const int64_t m_blocks_max = (p.seqlen_q + kBlockM - 1) / kBlockM;
    return {ws.semaphores + (static_cast<int64_t>(batch) * p.heads_q + head) * m_blocks_max + m_block,
            VisibleQueryBlocks<kBlockM, kBlockN>::key_block_end(window, m_block) - 1 - n_block};
  }

  // The semaphore's count now, read with acquire semantics: adds issued after a read that shows
  // this key block's turn are ordered after the earlier key blocks' adds.
  __device__ __forceinline__ int poll() const { return load_acquire(semaphore); }

  // Returns once this key block's turn has come. (The sm90 kernel reads the semaphore relaxed,
  // earlier, and fences once: sm90::fence_acquire.)
  __device__ __forceinline__ void wait() const {
    while (poll() != turn) {
    }
  }
};

// Publishes a query block's dQ adds, made by every thread of the CTA before a barrier that the
// caller passed since: the fence is cumulative over what the barrier ordered before it. (A single
// red.release.gpu would do as well, but it moved the sm80 kernels' register allocation: d128 spill
// stores 36 -> 52 bytes.)
__device__ __forceinline__ void publish_dq_adds(int* semaphore) {
  __threadfence();
  atomicAdd(semaphore, 1);
}

// P^T = exp2(S^T * log2_scale - LSE * log2e) in place, on a warp's S^T fragments whose first query
// column is `first_query` of the block (LSE rows indexed by the block's query). A row without keys
// has LSE = -inf: read as +inf, it gives P = 0. log2_factor > 0 gives P^T * 2^log2_factor instead,
// at no cost (folded into the per-row LSE term: the sm90 backward's dropout scale).
template <typename Traits>
__device__ __forceinline__ void probabilities_t(float (&s)[Traits::kSKeyTiles][Traits::kSQueryTiles][4],
                                                const float* lse_rows, int first_query, float log2_scale,
                                                float log2_factor = 0.0f) {
  constexpr float kLog2e = 1.4426950408889634f;
  const int lane = static_cast<int>(threadIdx.x) % 32;
#pragma unroll
  for (int nt = 0; nt < Traits::kSQueryTiles; ++nt) {
    const float2 lse = *reinterpret_cast<const float2*>(lse_rows + first_query + nt * 8 + (lane % 4) * 2);
    const float lse2[2] = {lse.x == -INFINITY ? INFINITY : lse.x * kLog2e - log2_factor,
                           lse.y == -INFINITY ? INFINITY : lse.y * kLog2e - log2_factor};
#pragma unroll
    for (int kt = 0; kt < Traits::kSKeyTiles; ++kt) {
#pragma unroll
      for (int i = 0; i < 4; ++i) s[kt][nt][i] = exp2f(s[kt][nt][i] * log2_scale - lse2[i % 2]);
    }
  }
}

// Dropout, once dP^T is in, on a warp's S^T-layout fragments whose P^T carries the marks of
// mark_dropped_transposed: dP^T becomes dP^T o Z (kept entries times keep_scale = 1 / (1 - p),
// dropped ones 0) and P^T loses the marks (|P^T|), so that score_gradients_t then gives
// dS^T = P^T (dP^T o Z - dot).
template <typename Traits>
__device__ __forceinline__ void apply_dropout_to_gradients_t(
    float (&dp)[Traits::kSKeyTiles][Traits::kSQueryTiles][4],
    float (&prob)[Traits::kSKeyTiles][Traits::kSQueryTiles][4], float keep_scale) {
#pragma unroll
  for (int kt = 0; kt < Traits::kSKeyTiles; ++kt) {
#pragma unroll
    for (int nt = 0; nt < Traits::kSQueryTiles; ++nt) {
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        const float marked = prob[kt][nt][i];
        dp[kt][nt][i] = marked >= 0.0f ? dp[kt][nt][i] * keep_scale : 0.0f;
        prob[kt][nt][i] = fabsf(marked);
      }
    }
  }
}

// Softcap's chain rule on a warp's S^T fragments, in place of dP^T: the score is softcap * tanh(u)
// (+ ALiBi), and its derivative 1 - tanh(u)^2 comes from the score recovered from P: ln P + LSE.
// gradient(kt, nt, i, column) gives the element's gradient with respect to the capped score, P =
// prob * prob_scale. `first_query` is the warp's first column within the block, `m0` the block's
// first query, `first_key` the warp's first key.
template <typename Traits, typename Gradient>
__device__ __forceinline__ void softcap_chain_rule_t(
    float (&dp)[Traits::kSKeyTiles][Traits::kSQueryTiles][4],
    const float (&prob)[Traits::kSKeyTiles][Traits::kSQueryTiles][4], float prob_scale, const float* lse_rows,
    int first_query, int m0, int first_key, const FwdProblem& p, float alibi_slope, int diagonal,
    Gradient gradient) {
  const int lane = static_cast<int>(threadIdx.x) % 32;
#pragma unroll
  for (int kt = 0; kt < Traits::kSKeyTiles; ++kt) {
#pragma unroll
    for (int nt = 0; nt < Traits::kSQueryTiles; ++nt) {
      const int column = first_query + nt * 8 + (lane % 4) * 2;
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        const float pr = prob[kt][nt][i] * prob_scale;
        const int query = m0 + column + i % 2;
        const int key = first_key + kt * 16 + lane / 4 + (i / 2) * 8;
        const float bias = alibi_slope != 0.0f ? alibi_bias(alibi_slope, query, key, diagonal) : 0.0f;
        const float tanh_u = (__logf(pr) + lse_rows[column + i % 2] - bias) / p.softcap;
        const float ds = gradient(kt, nt, i, column);
        dp[kt][nt][i] = pr > 0.0f ? ds * (1.0f - tanh_u * tanh_u) : 0.0f;
      }
    }
  }
}

// dS^T = P^T (dP^T - dot), in place of dP^T, times softcap's derivative where there is one
// (softcap_chain_rule_t). One uniform branch, so the common path's loop carries no per-element test.
template <typename Traits>
__device__ __forceinline__ void score_gradients_t(
    float (&dp)[Traits::kSKeyTiles][Traits::kSQueryTiles][4],
    const float (&prob)[Traits::kSKeyTiles][Traits::kSQueryTiles][4], const float* lse_rows,
    const float* dot_rows, int first_query, int m0, int first_key, const FwdProblem& p,
    float alibi_slope, int diagonal) {
  const int lane = static_cast<int>(threadIdx.x) % 32;
  if (p.softcap > 0.0f) {
    softcap_chain_rule_t<Traits>(dp, prob, 1.0f, lse_rows, first_query, m0, first_key, p, alibi_slope, diagonal,
                                 [&](int kt, int nt, int i, int column) {
                                   return prob[kt][nt][i] * (dp[kt][nt][i] - dot_rows[column + i % 2]);
                                 });
  } else {
#pragma unroll
    for (int nt = 0; nt < Traits::kSQueryTiles; ++nt) {
      const float2 dot = *reinterpret_cast<const float2*>(dot_rows + first_query + nt * 8 + (lane % 4) * 2);
#pragma unroll
      for (int kt = 0; kt < Traits::kSKeyTiles; ++kt) {
#pragma unroll
        for (int i = 0; i < 4; ++i) {
          dp[kt][nt][i] = prob[kt][nt][i] * (dp[kt][nt][i] - (i % 2 == 0 ? dot.x : dot.y));
        }
      }
    }
  }
}

// dQ accumulator += a warp's 16-row dQ fragments (kTiles 8-column tiles; rows from `first_row`,
// columns from `first_col`; rows past len_q and columns past head_dim are dropped). Lanes 2u and
// 2u + 1 of a quad swap halves so that each holds four consecutive columns of one row (even lane:
// row g, odd lane: row g + 8): one 16-byte atomic per lane and tile.
template <int kTiles>
__device__ __forceinline__ void add_dq_rows(float* dq_accum, int64_t row_stride, const float (&acc)[kTiles][4],
                                            int first_row, int first_col, int len_q, int head_dim) {
  const int lane = static_cast<int>(threadIdx.x) % 32;
  const bool odd = lane % 2 == 1;
  const int row = first_row + lane / 4 + (odd ? 8 : 0);
#pragma unroll
  for (int dt = 0; dt < kTiles; ++dt) {
    const float* c = acc[dt];
    const float send0 = odd ? c[0] : c[2];
    const float send1 = odd ? c[1] : c[3];
    const float recv0 = __shfl_xor_sync(0xffffffffu, send0, 1);
    const float recv1 = __shfl_xor_sync(0xffffffffu, send1, 1);
    const int col = first_col + dt * 8 + (lane % 4 - (odd ? 1 : 0)) * 2;
    // The four values are selected before the one atomic, so that the warp issues one reduction
    // per tile; an atomic in each arm of an odd/even branch issues two half-warp ones.
    const float v0 = odd ? recv0 : c[0];
    const float v1 = odd ? recv1 : c[1];
    const float v2 = odd ? c[2] : recv0;
    const float v3 = odd ? c[3] : recv1;
    if (row < len_q && col < head_dim) atomic_add_x4(dq_accum + row * row_stride + col, v0, v1, v2, v3);
  }
}

// Epilogue: a warp's dK (times the scale) and dV fragments (kKeyTiles 16-key tiles from
// `first_key`, kTiles 8-column tiles from `first_col`). MHA writes the gradients; GQA/MQA writes
// this query head's share to the fp32 workspace for the group sum. Keys past seqused_k got P = 0
// and are written as zeros. dv_scale multiplies dV: dropout's 1 / (1 - p), since dV summed the kept
// P and the forward scaled those (1 without dropout: folded away).
template <typename Element, int kKeyTiles, int kTiles>
__device__ __forceinline__ void store_key_gradients(const BwdProblem& bp, const BwdWorkspacePointers& ws,
                                                    const BwdBlockLocation<Element>& loc,
                                                    const float (&acc_dk)[kKeyTiles][kTiles][4],
                                                    const float (&acc_dv)[kKeyTiles][kTiles][4],
                                                    int first_key, int first_col,
                                                    float dv_scale = 1.0f) {
  const FwdProblem& p = bp.fwd;
  const int lane = static_cast<int>(threadIdx.x) % 32;
  const bool grouped = p.heads_q != p.heads_kv;
  const int kv_head = loc.head / (p.heads_q / p.heads_kv);
  const int64_t b = loc.batch;
  const int64_t k_token = p.cu_seqlens_k != nullptr ? loc.k_flat : 0;
  Element* dk = static_cast<Element*>(bp.dk) + b * bp.dk_batch_stride + k_token * bp.dk_row_stride +
                kv_head * bp.dk_head_stride;
  Element* dv = static_cast<Element*>(bp.dv) + b * bp.dv_batch_stride + k_token * bp.dv_row_stride +
                kv_head * bp.dv_head_stride;
  const int64_t expanded_row_stride = static_cast<int64_t>(p.heads_q) * p.head_dim;
  const int64_t expanded_base = loc.k_flat * expanded_row_stride + static_cast<int64_t>(loc.head) * p.head_dim;
#pragma unroll
  for (int kt = 0; kt < kKeyTiles; ++kt) {
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      const int key = first_key + kt * 16 + lane / 4 + half * 8;
      if (key >= loc.len_k_rows) continue;
#pragma unroll
      for (int dt = 0; dt < kTiles; ++dt) {
        const int col = first_col + dt * 8 + (lane % 4) * 2;
        if (col >= p.head_dim) continue;
        const float dk0 = acc_dk[kt][dt][2 * half] * p.softmax_scale;
        const float dk1 = acc_dk[kt][dt][2 * half + 1] * p.softmax_scale;
        const float dv0 = acc_dv[kt][dt][2 * half] * dv_scale;
        const float dv1 = acc_dv[kt][dt][2 * half + 1] * dv_scale;
        if (grouped) {
          const int64_t offset = expanded_base + key * expanded_row_stride + col;
          *reinterpret_cast<float2*>(ws.dk_expanded + offset) = make_float2(dk0, dk1);
          *reinterpret_cast<float2*>(ws.dv_expanded + offset) = make_float2(dv0, dv1);
        } else {
          *reinterpret_cast<uint32_t*>(dk + key * bp.dk_row_stride + col) = pack2<Element>(dk0, dk1);
          *reinterpret_cast<uint32_t*>(dv + key * bp.dv_row_stride + col) = pack2<Element>(dv0, dv1);
        }
      }
    }
  }
}

template <typename Traits>
__global__ void __launch_bounds__(Traits::kThreads, Traits::kMinBlocksPerSm)
    bwd_kernel(const __grid_constant__ BwdProblem bp, const BwdWorkspacePointers ws) {
  using Element = typename Traits::Element;
  using QTile = typename Traits::QTile;
  using KvTile = typename Traits::KvTile;
  using PTile = typename Traits::PTile;
  constexpr int kBlockM = Traits::kBlockM;
  constexpr int kBlockN = Traits::kBlockN;
  constexpr int kSKeyTiles = Traits::kSKeyTiles;
  constexpr int kSQueryTiles = Traits::kSQueryTiles;
  constexpr int kKvKeyTiles = Traits::kKvKeyTiles;
  constexpr int kKvTiles = Traits::kKvTiles;
  constexpr int kDqTiles = Traits::kDqTiles;
  const FwdProblem& p = bp.fwd;

  extern __shared__ __align__(128) unsigned char smem[];
  const uint32_t smem_base = smem_address(smem);

  const int tid = static_cast<int>(threadIdx.x);
  const int lane = tid % 32;
  const int warp = tid / 32;
  // This warp's tile in each of the three layouts (bwd_tile_config.h).
  const int s_first_key = (warp % Traits::kSKeyWarps) * kSKeyTiles * 16;        // S^T, dP^T rows
  const int s_first_query =                                                     //       columns
      Traits::kSQueryWarps == 1 ? 0 : (warp / Traits::kSKeyWarps) * kSQueryTiles * 8;
  const int kv_first_key = (warp % Traits::kKvKeyWarps) * kKvKeyTiles * 16;     // dK, dV rows
  const int kv_dim_part = Traits::kKvDimWarps == 1 ? 0 : warp / Traits::kKvKeyWarps;  // columns
  const uint32_t s_key_bytes = static_cast<uint32_t>(s_first_key * KvTile::kRowBytes);
  const uint32_t s_query_bytes = static_cast<uint32_t>(s_first_query * QTile::kRowBytes);
  const uint32_t kv_key_bytes = static_cast<uint32_t>(kv_first_key * PTile::kRowBytes);

  // ldmatrix lane patterns (see SwizzledTile::LaneAddresses). Row-major A operands and transposed B
  // operands (K, V, P^T, dS^T as A with the warp's key offset; Q, dO, K as B of P^T dO, dS^T Q,
  // dS K): row lane % 16, chunk half lane / 16. Non-transposed B operands (Q, dO of K Q^T and
  // V dO^T) and the transposed A operand dS (from dS^T): row lane % 8 + 8 * (lane / 16), chunk
  // half (lane / 8) % 2. K, V, Q and dO tiles all have kHeadDim columns, so one object per pattern
  // serves them all with the tile's offset added; P^T and dS^T share one too.
  const typename KvTile::LaneAddresses row_addr(smem_base, lane % 16, lane / 16);
  const typename KvTile::LaneAddresses col_addr(smem_base, lane % 8 + (lane / 16) * 8, (lane / 8) % 2);
  const typename PTile::LaneAddresses p_row_addr(smem_base + kv_key_bytes, lane % 16, lane / 16);

  const BwdBlockLocation<Element> loc = BwdBlockLocation<Element>::locate(bp, ws, kBlockN);
  const int n0 = loc.n_block * kBlockN;
  if (n0 >= loc.len_k_rows) return;  // varlen: this sequence is shorter than max_seqlen_k
  const int head_chunks = p.head_dim / 8;

  const KeyWindow window{loc.len_q, loc.len_k, p.window_left, p.window_right};
  using QueryBlocks = VisibleQueryBlocks<kBlockM, kBlockN>;
  const QueryBlocks visible = QueryBlocks::of(window, loc.n_block);
  const int m_begin = visible.begin, m_end = visible.end;

  float acc_dk[kKvKeyTiles][kKvTiles][4];
  float acc_dv[kKvKeyTiles][kKvTiles][4];
  zero_accumulators(acc_dk);
  zero_accumulators(acc_dv);

  constexpr float kLog2e = 1.4426950408889634f;
  const float alibi_slope =
      p.alibi_slopes != nullptr ? p.alibi_slopes[loc.batch * p.alibi_batch_stride + loc.head] : 0.0f;
  const bool transform = p.softcap > 0.0f || alibi_slope != 0.0f;
  const int diagonal = window.diagonal_offset();
  const float log2_scale = transform ? kLog2e : p.softmax_scale * kLog2e;
  // Read once: with a device rng_state the dropout key is in global memory.
  const DropoutMask dropout_mask = Traits::kDropout ? p.dropout_mask() : DropoutMask{};

  if (m_begin < m_end) {
    load_tile_async<Traits, KvTile>(smem_base + Traits::kKOffset,
                                    loc.k + static_cast<int64_t>(n0) * p.k_row_stride, p.k_row_stride,
                                    loc.len_k - n0, head_chunks);
    load_tile_async<Traits, KvTile>(smem_base + Traits::kVOffset,
                                    loc.v + static_cast<int64_t>(n0) * p.v_row_stride, p.v_row_stride,
                                    loc.len_k - n0, head_chunks);
    // Q, dO, LSE and dot of query block m into pipeline stage `stage`.
    auto load_query_block = [&](int m_block, int stage) {
      const int m0 = m_block * kBlockM;
      const uint32_t stage_offset = static_cast<uint32_t>(stage * Traits::kStageBytes);
      load_tile_async<Traits, QTile>(smem_base + Traits::kQOffset + stage_offset,
                                     loc.q + static_cast<int64_t>(m0) * p.q_row_stride,
                                     p.q_row_stride, loc.len_q - m0, head_chunks);
      load_tile_async<Traits, QTile>(smem_base + Traits::kDoOffset + stage_offset,
                                     loc.dout + static_cast<int64_t>(m0) * bp.dout_row_stride,
                                     bp.dout_row_stride, loc.len_q - m0, head_chunks);
      if (tid < 2 * kBlockM) {
        const int row = tid % kBlockM;
        const bool is_lse = tid < kBlockM;
        const uint32_t dst = smem_base + (is_lse ? Traits::kLseOffset : Traits::kDotOffset) +
                             static_cast<uint32_t>(stage * Traits::kRowStatsBytes + row * 4);
        const float* rows = is_lse ? loc.lse : loc.dot;
        const bool valid = m0 + row < loc.len_q;
        cp_async_4(dst, valid ? rows + m0 + row : rows, valid);
      }
      cp_async_commit();
    };
    load_query_block(m_begin, 0);

    // Transposed-B addresses for this warp's share of dK/dV columns, and for the dQ phase: this
    // warp's 16 queries of dS (fixed chunk) and its share of K's columns.
    const int dq_rows = warp % Traits::kDqRowWarps;
    const int dq_cols = warp / Traits::kDqRowWarps;
    const WarpColumnAddresses<PTile, 1> ds_addr(smem_base + Traits::kDsOffset,
                                                 lane % 8 + (lane / 16) * 8, (lane / 8) % 2, dq_rows);
    const WarpColumnAddresses<KvTile, kDqTiles / 2> k_col_addr(
        smem_base + Traits::kKOffset, lane % 16, lane / 16, dq_cols * (kDqTiles / 2));
    // dK/dV B operands (Q, dO transposed): with one warp across the head dim row_addr serves;
    // with split columns the warp's run starts at a run-time step.
    const WarpColumnAddresses<QTile, Traits::kKvDimWarps == 1 ? 1 : kKvTiles / 2> kv_col_addr(
        smem_base, lane % 16, lane / 16, kv_dim_part * (kKvTiles / 2));
    auto kv_b_address = [&](uint32_t tile_offset, int kk, int dp) {
      if constexpr (Traits::kKvDimWarps == 1) {
        return row_addr.at(kk * 16, dp) + tile_offset;
      } else {
        return kv_col_addr.at(kk * 16, dp) + tile_offset;
      }
    };
    // kPInRegisters: acc += X B, X the warp's S^T-layout fragments (P^T or dS^T) packed into A
    // fragments, B (Q or dO, queries x head dim) read transposed from `b_tile`. kept_only
    // (std::true_type) packs max(X, 0), the kept entries of a sign-marked P^T.
    auto accumulate_from_registers = [&](auto& acc, const auto& x, uint32_t b_tile, auto kept_only) {
      auto pack = [](float lo, float hi) {
        return decltype(kept_only)::value ? pack2_relu<Element>(lo, hi) : pack2<Element>(lo, hi);
      };
#pragma unroll
      for (int kk = 0; kk < Traits::kQuerySteps; ++kk) {
        uint32_t a[kSKeyTiles][4];
#pragma unroll
        for (int kt = 0; kt < kSKeyTiles; ++kt) {
          a[kt][0] = pack(x[kt][2 * kk][0], x[kt][2 * kk][1]);
          a[kt][1] = pack(x[kt][2 * kk][2], x[kt][2 * kk][3]);
          a[kt][2] = pack(x[kt][2 * kk + 1][0], x[kt][2 * kk + 1][1]);
          a[kt][3] = pack(x[kt][2 * kk + 1][2], x[kt][2 * kk + 1][3]);
        }
#pragma unroll
        for (int dp = 0; dp < kKvTiles / 2; ++dp) {
          uint32_t b[4];
          ldmatrix_x4_trans(b, kv_b_address(b_tile, kk, dp));
          mma_column_pair<Element>(acc, a, b, dp);
        }
      }
    };
    // Otherwise: acc += X B with X (P^T or dS^T) read back from the keys x queries tile at
    // `x_tile` as row-major A fragments of the warp's dK/dV keys.
    auto accumulate_from_shared = [&](auto& acc, uint32_t x_tile, uint32_t b_tile) {
#pragma unroll
      for (int kk = 0; kk < Traits::kQuerySteps; ++kk) {
        uint32_t a[kKvKeyTiles][4];
#pragma unroll
        for (int kt = 0; kt < kKvKeyTiles; ++kt) ldmatrix_x4(a[kt], p_row_addr.at(kt * 16, kk) + x_tile);
#pragma unroll
        for (int dp = 0; dp < kKvTiles / 2; ++dp) {
          uint32_t b[4];
          ldmatrix_x4_trans(b, kv_b_address(b_tile, kk, dp));
          mma_column_pair<Element>(acc, a, b, dp);
        }
      }
    };

    // Deterministic mode: the semaphore of the query block whose dQ adds this CTA issued last and
    // has not yet published (see the end of the loop).
    int* unpublished = nullptr;
    for (int m_block = m_begin, stage = 0; m_block < m_end; ++m_block, stage ^= 1) {
      const int m0 = m_block * kBlockM;
      cp_async_wait<0>();
      __syncthreads();
      if (m_block + 1 < m_end) load_query_block(m_block + 1, stage ^ 1);
      const uint32_t q_stage = static_cast<uint32_t>(stage * Traits::kStageBytes);
      const float* lse_rows = reinterpret_cast<const float*>(smem + Traits::kLseOffset + stage * Traits::kRowStatsBytes);
      const float* dot_rows = reinterpret_cast<const float*>(smem + Traits::kDotOffset + stage * Traits::kRowStatsBytes);

      // S^T = K Q^T over the warp's keys x queries tile.
      float acc_s[kSKeyTiles][kSQueryTiles][4];
      zero_accumulators(acc_s);
#pragma unroll
      for (int kk = 0; kk < Traits::kDimSteps; ++kk) {
        uint32_t a[kSKeyTiles][4];
#pragma unroll
        for (int kt = 0; kt < kSKeyTiles; ++kt) {
          ldmatrix_x4(a[kt], row_addr.at(kt * 16, kk) + Traits::kKOffset + s_key_bytes);
        }
#pragma unroll
        for (int np = 0; np < kSQueryTiles / 2; ++np) {
          uint32_t b[4];
          ldmatrix_x4(b, col_addr.at(np * 16, kk) + Traits::kQOffset + q_stage + s_query_bytes);
          mma_column_pair<Element>(acc_s, a, b, np);
        }
      }
      // Deterministic mode: publish the previous query block's dQ adds. The barrier at the top of
      // this iteration ordered every thread's adds before thread 0's (cumulative) fence, and the
      // GEMM above gave them time to land, so the fence rarely waits.
      if (unpublished != nullptr && tid == 0) publish_dq_adds(unpublished);
      unpublished = nullptr;

      const int first_key = n0 + s_first_key;
      const int first_query = m0 + s_first_query;
      if (transform) transform_scores_t<Traits>(acc_s, p, first_key, first_query, alibi_slope, diagonal);
      if (!window.block_unmasked(m0, min(m0 + kBlockM, loc.len_q), n0, n0 + kBlockN)) {
        mask_scores_t<Traits>(acc_s, window, first_key, first_query);
      }
      probabilities_t<Traits>(acc_s, lse_rows, s_first_query, log2_scale);
      if constexpr (Traits::kDropout) {
        mark_dropped_transposed(acc_s, dropout_mask,
                                static_cast<uint32_t>(loc.batch * p.heads_q + loc.head), first_key,
                                first_query);
      }
      if constexpr (Traits::kPInRegisters) {  // dV += P^T dO
        accumulate_from_registers(acc_dv, acc_s, Traits::kDoOffset + q_stage,
                                  std::bool_constant<Traits::kDropout>{});
      } else {
        store_keys_by_queries<Traits, Traits::kDropout>(smem_base + Traits::kPOffset, acc_s,
                                                        s_first_key, s_first_query / 8);
      }

      // dP^T = V dO^T.
      float acc_dp[kSKeyTiles][kSQueryTiles][4];
      zero_accumulators(acc_dp);
#pragma unroll
      for (int kk = 0; kk < Traits::kDimSteps; ++kk) {
        uint32_t a[kSKeyTiles][4];
#pragma unroll
        for (int kt = 0; kt < kSKeyTiles; ++kt) {
          ldmatrix_x4(a[kt], row_addr.at(kt * 16, kk) + Traits::kVOffset + s_key_bytes);
        }
#pragma unroll
        for (int np = 0; np < kSQueryTiles / 2; ++np) {
          uint32_t b[4];
          ldmatrix_x4(b, col_addr.at(np * 16, kk) + Traits::kDoOffset + q_stage + s_query_bytes);
          mma_column_pair<Element>(acc_dp, a, b, np);
        }
      }

      if constexpr (Traits::kDropout) {  // dP^T o Z, and P^T without the marks
        apply_dropout_to_gradients_t<Traits>(acc_dp, acc_s, 1.0f / (1.0f - p.dropout_p));
      }
      score_gradients_t<Traits>(acc_dp, acc_s, lse_rows, dot_rows, s_first_query, m0, first_key, p,
                                alibi_slope, diagonal);
      if constexpr (Traits::kPInRegisters) {
        accumulate_from_registers(acc_dk, acc_dp, Traits::kQOffset + q_stage,  // dK += dS^T Q
                                  std::false_type{});
      }
      store_keys_by_queries<Traits>(smem_base + Traits::kDsOffset, acc_dp, s_first_key, s_first_query / 8);
      __syncthreads();  // P^T and dS^T complete

      // Otherwise dV += P^T dO and dK += dS^T Q over the warp's keys x head-dim tile.
      if constexpr (!Traits::kPInRegisters) {
        accumulate_from_shared(acc_dv, Traits::kPOffset, Traits::kDoOffset + q_stage);
        accumulate_from_shared(acc_dk, Traits::kDsOffset, Traits::kQOffset + q_stage);
      }

      // dQ_block = dS K: this warp's 16 queries x its share of the head dim, over all keys.
      float acc_dq[1][kDqTiles][4];
      zero_accumulators(acc_dq);
#pragma unroll
      for (int kk = 0; kk < Traits::kKeySteps; ++kk) {
        uint32_t a[1][4];
        ldmatrix_x4_trans(a[0], ds_addr.at(kk * 16, 0));
#pragma unroll
        for (int dp = 0; dp < kDqTiles / 2; ++dp) {
          uint32_t b[4];
          ldmatrix_x4_trans(b, k_col_addr.at(kk * 16, dp));
          mma_column_pair<Element>(acc_dq, a, b, dp);
        }
      }

      // Deterministic mode: add in descending key-block order (DqAddTurn). Under a causal mask the
      // later key blocks reach a query block in fewer steps, so they are rarely waited for.
      int* semaphore = nullptr;
      if (bp.deterministic) {
        const auto dq_turn =
            DqAddTurn<kBlockM, kBlockN>::of(bp, ws, loc.batch, loc.head, window, m_block, loc.n_block);
        semaphore = dq_turn.semaphore;
        if (tid == 0) dq_turn.wait();
        __syncthreads();
      }
      const int64_t dq_row_stride = static_cast<int64_t>(p.heads_q) * p.head_dim;
      float* dq_accum = ws.dq_accum + loc.q_flat * dq_row_stride + static_cast<int64_t>(loc.head) * p.head_dim;
      add_dq_rows<kDqTiles>(dq_accum, dq_row_stride, acc_dq[0], m0 + dq_rows * 16, dq_cols * kDqTiles * 8,
                            loc.len_q, p.head_dim);
      // Published during the next iteration (or after the loop) instead of behind a fence here:
      // a fence right after the adds waits for them to reach L2 on every query block.
      unpublished = semaphore;
    }
    if (unpublished != nullptr) {
      __syncthreads();
      if (tid == 0) publish_dq_adds(unpublished);
    }
  }

  store_key_gradients<Element, kKvKeyTiles, kKvTiles>(
      bp, ws, loc, acc_dk, acc_dv, n0 + kv_first_key, kv_dim_part * kKvTiles * 8,
      Traits::kDropout ? 1.0f / (1.0f - p.dropout_p) : 1.0f);
}

}  // namespace flashkit::sm80
