// src/cuda/sm90/bwd_kernel_sm90.cuh
// \brief The backward kernel on wgmma (sm_90a, Hopper): the sm80 kernel's algorithm with its five
// matrix products on warpgroup MMAs (bwd_tile_config_sm90.h has the shapes and the counts).
//
// Families 64 and 128 (family 256: below): one CTA owns BlockN = 128 keys of one (batch, query
// head): two warpgroups, 64 keys each, hold their dK and dV in registers and walk the query
// blocks whose forward pass visited the key block (sm80::VisibleQueryBlocks, the same test and
// skips as the sm80 kernel). K and V stay in shared
// memory (cp.async, once); Q, dO and the rows' LSE and dot(dO, O) come by the copy engine (TMA,
// issued by thread 0, no producer warp) through kStages stages (three where they fit, else two),
// each on its stage's mbarrier, each query block's loads issued kStages - 1 blocks ahead:
//
//   prologue     cp.async K, V; TMA Q, dO, LSE, dot of the first kStages - 1 query blocks
//   per block    wait for stage s's barrier; a block past the sequence's end zeroes its rows
//                past it (zero_rows_past); kDqBehind with one dS^T buffer: wait for the previous
//                block's products; barrier
//                TMA the query block kStages - 1 ahead into the stage the last one used
//                                                         (two dS^T buffers: after the second
//                                                          barrier, the wait for the previous
//                                                          block's products after this one)
//                S^T = K_w Q^T, dP^T = V_w dO^T           (wgmma ss, in one or two parts of the
//                                                          queries (tile config): issued together;
//                                                          kDqBehind: the previous block's dQ
//                                                          added once S^T_0 is issued, below)
//                per part, once its S^T and dP^T landed (the next part's still running):
//                  softcap / ALiBi / mask; P^T = exp2(S^T log2e - LSE log2e)   (registers)
//                  dS^T = P^T (dP^T - dot) [* softcap derivative]             (registers)
//                  dS^T -> shared memory
//                  dV += P^T dO, dK += dS^T Q             (wgmma rs over the part's queries: the
//                                                          S^T-layout accumulators, packed to 16
//                                                          bits, are A fragments; B = dO, Q read
//                                                          MN-major), issued, not waited for
//                proxy fence
//                barrier (dS^T complete)
//                dQ part = dS K                           (wgmma ss: A = dS^T read transposed,
//                                                          B = K MN-major; warpgroup w computes
//                                                          one 64 x 64 part of BlockM x D)
//                dQ accumulator += dQ part                (each warp stages its 16 rows in
//                                                          shared memory and the copy engine
//                                                          adds them, two tensor-map bulk
//                                                          reductions of 16 x 32, during the
//                                                          next block's S^T (kDqBehind) or
//                                                          after the last block; family 256:
//                                                          in this block, below; deterministic
//                                                          mode and family 64's dropout
//                                                          instance: in this block, by fp32
//                                                          vector reductions as sm80,
//                                                          deterministic mode's in key-block
//                                                          order, below)
//   epilogue     dK * scale, dV -> dk, dv (MHA) or the fp32 per-query-head workspace (GQA/MQA)
//
// Family 256 (Traits::kSplitHeadDim): 64 keys per CTA, shared by both warpgroups, since 64 keys x
// 256 columns of dK + dV would take 256 registers per thread. Warpgroup w computes S^T / dP^T for
// the w-th half of the queries and stores P^T as well as dS^T; after the barrier it issues dQ for
// the w-th half of the head dim, then dV += P^T dO and dK += dS^T Q for that half (both operands
// from shared memory). Once all three have landed, its dQ half is staged in the block's Q and dO
// stage, in the columns its dV and dK products read, and the copy engine adds it while the next
// block runs (kDqInStage; the next load into that stage waits for the engine to have read it).
//
// The sm80 kernel's arch-independent pieces are reused as they are: block location, visible query
// blocks, score transform and masks on S^T fragments (a warp's 16 keys x the part's queries
// are exactly an sm80 warp tile of one 16-key row tile), probabilities, score gradients, the dS^T store,
// the dQ reductions and the dK/dV epilogue. Not covered (the dispatcher keeps them on sm80):
// head-dim families other than 64, 128 and 256.
//
// Dropout (Traits::kDropout) regenerates the forward's Philox mask for each query block one block
// ahead: while the tensor cores work on a block's dV, dK and dQ, the warps draw the next block's
// drop marks (sm80::store_transposed_marks_pair: the two warps of a 32-key block each draw half of
// the block's Philox calls) into shared memory (two stages, like Q and dO), and the next block reads
// them once its dP^T is in (sm80::load_transposed_marks). So the RNG runs in the tensor cores'
// shadow instead of between S^T and dS^T. P^T comes out already scaled by 1 / (1 - p) (folded into
// the LSE term), so its kept entries (sm80::kept_transposed, two instructions per element) are
// P^T o Z, dV's operand as it is, and dropout_score_gradients_t gives dS^T from them with
// p = 0's count per element.
//
// Deterministic mode (Traits::kDeterministic) is the sm80 kernel's: each query block's dQ takes the
// key blocks' adds in descending key-block order behind a semaphore per query block
// (sm80::DqAddTurn), but with a grid order of its own (deterministic_location; a CTA still waits
// only for CTAs that started before it). Every warp reads the semaphore itself, relaxed, just
// before the second barrier, so that the round trip runs during the barrier and the dQ product;
// once dQ has landed it spins only if that read did not show its turn, and an acquire fence then
// orders its adds after the earlier key blocks'. (An acquire load, issued after the dQ product,
// stalled the warp until its value returned; one poll per warpgroup or per CTA passed on through a
// barrier measured slower than either: bench/NOTES.md, "deterministic mode's poll".) Thread 0
// publishes a block's adds after the next block's first barrier, once the next products are issued
// (its fence waits while the tensor cores work) and before it issues the next block's loads: its
// fence waits for the thread's memory operations in flight, and with the loads first that cost
// 2.5-4.7% of deterministic mode's time at d128 and d256 (bench/NOTES.md, "deterministic mode's
// hand-over"; measured when the loads were every thread's cp.async copies, before thread 0 issued
// them to the copy engine: not measured again since).
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>

#include "common/bwd_problem.h"
#include "cuda/common/attention_mask.cuh"
#include "cuda/common/dropout_mask.cuh"
#include "cuda/common/mma_sm80.cuh"
#include "cuda/sm80/bwd_kernel.cuh"
#include "cuda/sm80/bwd_workspace_pointers.cuh"
#include "cuda/sm80/fwd_kernel.cuh"
#include "cuda/sm90/mbarrier.cuh"
#include "cuda/sm90/tma.cuh"
#include "cuda/sm90/warpgroup.cuh"
#include "cuda/sm90/wgmma.cuh"

namespace flashkit::sm90 {

template <typename Element_, int kHeadDim_, int kBlockM_, int kBlockN_, int kQueryParts_, bool kSplitHeadDim_,
          bool kDeterministic_, bool kDropout_>
struct BwdKernelTraits {
  using Element = Element_;
  // The instances that add dQ in key-block order (deterministic mode) and that regenerate the
  // dropout mask (p > 0): kernels of their own, so that the default one carries none of their code.
  static constexpr bool kDeterministic = kDeterministic_;
  static constexpr bool kDropout = kDropout_;
  static constexpr int kHeadDim = kHeadDim_;
  static constexpr int kBlockM = kBlockM_;
  static constexpr int kBlockN = kBlockN_;
  // Without the split, each warpgroup owns 64 keys (wgmma's M) and all of their dK/dV columns and
  // the block's queries. With it (family 256, bwd_tile_config_sm90.h), two warpgroups share the 64
  // keys: warpgroup w computes S^T / dP^T for the w-th half of the queries and dK / dV for the
  // w-th half of the head dim, P^T and dS^T meeting in shared memory.
  static constexpr bool kSplitHeadDim = kSplitHeadDim_;
  static constexpr int kWarpgroups = kSplitHeadDim ? 2 : kBlockN / 64;
  static constexpr int kThreads = kWarpgroups * kWarpgroupThreads;
  static constexpr int kWarpgroupQueries = kSplitHeadDim ? kBlockM / kWarpgroups : kBlockM;
  static constexpr int kKvColumns = kSplitHeadDim ? kHeadDim / kWarpgroups : kHeadDim;

  // S^T and dP^T run in kQueryParts parts of the warpgroup's queries (kPartM each); with two,
  // one part's softmax and dS overlap the other part's products on the tensor cores.
  static constexpr int kQueryParts = kQueryParts_;
  static constexpr int kPartM = kWarpgroupQueries / kQueryParts;
  // The shapes the sm80 S^T helpers index: per warp one 16-key tile x kPartM / 8 query columns.
  struct PartScores {
    using Element = Element_;
    using PTile = Swizzle128Tile<kBlockN_, kBlockM_>;
    static constexpr int kSKeyTiles = 1;
    static constexpr int kSQueryTiles = kPartM / 8;
  };
  static constexpr int kDTiles = kKvColumns / 8;  // dK, dV columns per thread's fragment row

  // dQ (kBlockM x kHeadDim) in one part per warpgroup, 64 queries x kDqColumns: kDqQueryParts
  // along the queries.
  static constexpr int kDqQueryParts = kBlockM / 64;
  static constexpr int kDqColumns = kHeadDim * kDqQueryParts / kWarpgroups;
  static constexpr int kDqTiles = kDqColumns / 8;

  using KvTile = Swizzle128Tile<kBlockN, kHeadDim>;  // K, V
  using QTile = Swizzle128Tile<kBlockM, kHeadDim>;   // Q, dO
  using PTile = Swizzle128Tile<kBlockN, kBlockM>;    // dS^T: keys x queries

  // dQ's way into the accumulator: atomic adds from the registers (sm80::add_dq_rows: ~160
  // instructions per warp and query block on the consumers' path) or, with kDqBulkReduce, each
  // warp's 16 x kDqColumns part staged in shared memory and added by the copy engine in boxes of 16
  // rows x 32 columns (reduce_dq_in_bulk). Not in deterministic mode, whose adds wait for their turn
  // in the consumers, nor in family 64's dropout instance (two query parts), where ptxas spilled 136
  // bytes with the staging against 92 without and the plan lost its third stage: not measured, so
  // it keeps the atomics. Measured with three stages (below; H200, bf16, bench/NOTES.md session 21):
  // +4-6% at d128, +3% at d64, d128 p = 0.1 +4-5%; either change alone, +-1%.
  static constexpr bool kDqBulkReduce = !kDeterministic && !(kDropout && kQueryParts == 2);
  // The split layout's dQ (64 x 128 per warpgroup, 32 KiB) has no room of its own: it is staged in
  // the block's own Q and dO stage, in the bytes that only its warpgroup's dV and dK products read
  // (its 128 columns of Q and of dO), once those products have landed. The next load into that
  // stage waits for the engine to have read them. With atomics there, 16-byte reductions of one
  // 32-byte sector each kept the crossbar into L2 82% busy and the warps' shuffles and selects
  // that build them held a third of the stall samples (bf16 d256 8k, H200, bench/NOTES.md session 23).
  static constexpr bool kDqInStage = kDqBulkReduce && kSplitHeadDim;
  static constexpr int kDqBoxColumns = 32;  // fp32: one 128-byte swizzle row
  static constexpr int kDqBoxBytes = 16 * kDqBoxColumns * static_cast<int>(sizeof(float));
  static constexpr int kDqWarpBytes = kDqColumns / kDqBoxColumns * kDqBoxBytes;
  static constexpr int kDqStagingBytes = kDqBulkReduce && !kDqInStage ? kThreads / 32 * kDqWarpBytes : 0;

  // dQ one block behind (default mode, families 64 and 128): a block's dQ product is issued after
  // its second barrier and left running; the next block waits for it (and for the dV and dK
  // products), issues S^T_0 and adds the previous dQ to the accumulator while S^T runs on the tensor
  // cores. So the adds no longer sit between two blocks' products with the tensor cores idle.
  // Where that wait happens depends on kDsBuffers (below). (Waiting after S^T_0's issue instead
  // made ptxas serialize every wgmma: it does not follow a group across the loop's back edge.) The
  // instances of the staging (kDqBulkReduce): deterministic mode adds in turn (the wait for the
  // turn would then hold up the next block's scores), and family 64's dropout instance spilled 244
  // bytes so (92 without): they keep dQ in its block, as does the split layout (whose staging waits
  // for its block's dV and dK anyway).
  static constexpr bool kDqBehind = kDqBulkReduce && !kSplitHeadDim;

  // Shared-memory plan, byte offsets from a 1024-byte aligned base (the 128-byte swizzle's period):
  //   [ dQ staging (kDqBulkReduce) | K | V | Q stage 0 | dO stage 0 | Q stage 1 | dO stage 1 | ... |
  //     dS^T x kDsBuffers | P^T (split only) | LSE x kStages | dot x kStages | stage barriers |
  //     drop marks x 2, Philox round keys (dropout only) ]
  static constexpr int kStageBytes = 2 * QTile::kBytes;
  static constexpr int kRowStatsBytes = kBlockM * static_cast<int>(sizeof(float));
  // A stage's mbarrier (8 bytes), in 16 so that the dropout exchange after them stays 16-byte aligned.
  static constexpr int kBarrierBytes = 16;
  // What the copy engine brings per stage: Q, dO and the LSE and dot rows.
  static constexpr int kStageTxBytes = kStageBytes + 2 * kRowStatsBytes;
  // Dropout: the drop marks the two warps of a 32-key block pass each other
  // (sm80::store_transposed_marks_pair), in two stages (drawn one block ahead), per warp pair and
  // query part kPartM / 16 row blocks x 32 chunks of 16 bytes (4 marks words).
  static constexpr int kMarkStages = 2;
  static constexpr int kDropoutPairs = kWarpgroups * 2;
  static constexpr int kDropoutExchangeBytes = (kPartM / 16) * 32 * 16;
  static constexpr int kDropoutStageBytes = kDropoutPairs * kQueryParts * kDropoutExchangeBytes;
  // Pipeline stages of Q, dO, LSE and dot: a query block's loads are issued kStages - 1 blocks ahead
  // of its products. Three where they fit (a block's loads then have two blocks' time to land; with
  // one and the dQ staging, the d128 kernel stood waiting for them in 13% of its stall samples:
  // bench/NOTES.md, session 21), else two (family 256's split layout). + 1024: the dynamic
  // shared-memory base is only 16-byte aligned; the kernel rounds it up.
  static constexpr int kBytesBesideStagesAndDs =
      kDqStagingBytes + 2 * KvTile::kBytes + (kSplitHeadDim ? PTile::kBytes : 0) +
      (kDropout ? kMarkStages * kDropoutStageBytes + static_cast<int>(sizeof(PhiloxRoundKeys)) : 0) + 1024;
  static constexpr int kThreeStagesBytes = 3 * (kStageTxBytes + kBarrierBytes);
  // dS^T's buffers. With kDqBehind, two where three stages still fit beside them (family 128 at
  // p = 0): the next block's dS^T goes to the other one, so the wait for the previous block's
  // products can follow the first barrier, and the loads into the previous block's stage wait for
  // the second. Elsewhere one buffer: the wait comes before the first barrier, which then frees
  // dS^T and the stage (three stages instead of two for family 64 and family 128 with dropout:
  // H200, bf16, d64 +1-6%, d128 p = 0.1 +3-9%; at d128 p = 0 the two buffers measured 2-3% faster
  // than one: bench/NOTES.md, session 22).
  static constexpr int kDsBuffers =
      kDqBehind && kBytesBesideStagesAndDs + 2 * PTile::kBytes + kThreeStagesBytes <= 227 * 1024 ? 2 : 1;
  static constexpr int kBytesBesideStages = kBytesBesideStagesAndDs + kDsBuffers * PTile::kBytes;
  static constexpr int kStages = kBytesBesideStages + kThreeStagesBytes <= 227 * 1024 ? 3 : 2;
  static constexpr int kDqOffset = 0;
  static constexpr int kKOffset = kDqOffset + kDqStagingBytes;
  static constexpr int kVOffset = kKOffset + KvTile::kBytes;
  static constexpr int kQOffset = kVOffset + KvTile::kBytes;
  static constexpr int kDoOffset = kQOffset + QTile::kBytes;
  static constexpr int kDsOffset = kQOffset + kStages * kStageBytes;
  static constexpr int kPOffset = kDsOffset + kDsBuffers * PTile::kBytes;
  static constexpr int kLseOffset = kPOffset + (kSplitHeadDim ? PTile::kBytes : 0);
  static constexpr int kDotOffset = kLseOffset + kStages * kRowStatsBytes;
  static constexpr int kBarrierOffset = kDotOffset + kStages * kRowStatsBytes;
  static constexpr int kDropoutOffset = kBarrierOffset + kStages * kBarrierBytes;
  // And the Philox round keys (PhiloxRoundKeys), read by every draw.
  static constexpr int kRoundKeysOffset = kDropoutOffset + kMarkStages * kDropoutStageBytes;
  // + 1024: the dynamic shared-memory base is only 16-byte aligned; the kernel rounds it up.
  static constexpr int kSmemBytes =
      (kDropout ? kRoundKeysOffset + static_cast<int>(sizeof(PhiloxRoundKeys)) : kDropoutOffset) + 1024;

  static_assert(kBlockN % 64 == 0 && kBlockM % 64 == 0 && kHeadDim % 64 == 0,
                "whole wgmma M tiles and 64-column swizzle atoms");
  static_assert((kQueryParts == 1 || kQueryParts == 2) && kPartM % 16 == 0, "one or two query parts");
  static_assert(kDqQueryParts * (kHeadDim / kDqColumns) == kWarpgroups && kDqColumns % 64 == 0,
                "the dQ parts are one per warpgroup, whole swizzle atoms wide");
  static_assert(!kSplitHeadDim || (kBlockN == 64 && kQueryParts == 1 && kKvColumns % 64 == 0),
                "the split shares one 64-key block and halves whole swizzle atoms of the head dim");
  static_assert(kRoundKeysOffset % 16 == 0, "the round keys load as 16-byte vectors");
  static_assert(kDqStagingBytes % 1024 == 0, "K, V, Q and dO start on the swizzle's period");
  static_assert(!kDqInStage || (kDqQueryParts == 1 && kDqColumns == kKvColumns &&
                                 2 * kDqWarpBytes == kKvColumns / 64 * QTile::kColumnBlockBytes),
                "a warpgroup's dQ staging is its Q and dO columns of the stage: two warps' boxes in each");
  static_assert(kSmemBytes <= 227 * 1024, "shared memory plan exceeds an SM");
  static_assert(kSmemBytes == kBytesBesideStages + kStages * (kStageTxBytes + kBarrierBytes),
                "the stage count's estimate is the plan");
};

// Deterministic mode's semaphore read without acquire semantics: LDG.STRONG.GPU alone, which stalls
// the warp only where its value is used (ld.acquire adds a CCTL.IVALL that waits for the value).
__device__ __forceinline__ int load_relaxed(const int* p) {
  int value;
  asm volatile("ld.relaxed.gpu.global.b32 %0, [%1];\n" : "=r"(value) : "l"(p) : "memory");
  return value;
}

// After a relaxed read that showed the turn: with it, an acquire pattern of the PTX memory model
// (CCTL.IVALL; the read's value is in by then, so it waits for nothing).
__device__ __forceinline__ void fence_acquire() { asm volatile("fence.acquire.gpu;\n" ::: "memory"); }

// dS^T with dropout, in place of dP^T once it is in, and `kept`, dV's operand. `scaled` is
// P^T / (1 - p) (sm80::probabilities_t with log2_factor = log2(1 / (1 - p))), and kept its entries
// that the mask keeps (sm80::kept_transposed with the marks of sm80::load_transposed_marks), i.e.
// P^T o Z. Then dS^T = P^T (dP^T o Z - dot) = kept dP^T - scaled ((1 - p) dot): one multiply and
// one fused multiply-add per element, the count of the code without dropout, and no select on
// dP^T. `kept_dot_rows` holds (1 - p) dot already (the preprocess kernel's kKeepScaled: one
// multiply per row there instead of two per 8-query group and warp here, the same fp32 product).
// kept is made element by element as scaled is consumed, so that the two do not live side by
// side; softcap's chain rule (sm80::softcap_chain_rule_t, on P^T = scaled (1 - p)) takes the same
// per-element gradient.
template <typename Traits, int kRowBlocks>
__device__ __forceinline__ void dropout_score_gradients_t(
    float (&dp)[1][2 * kRowBlocks][4], const float (&scaled)[1][2 * kRowBlocks][4],
    float (&kept)[1][2 * kRowBlocks][4], const uint32_t (&marks)[kRowBlocks][2][2], const float* lse_rows,
    const float* kept_dot_rows, int first_query, int m0, int first_key, const FwdProblem& p, float alibi_slope,
    int diagonal) {
  static_assert(Traits::kSKeyTiles == 1 && Traits::kSQueryTiles == 2 * kRowBlocks, "a warp's 16 keys");
  uint32_t selectors[2];
  sm80::transposed_mark_selectors(selectors);
  auto gradient = [&](int nt, int i, float kept_dot) {
    kept[0][nt][i] = sm80::kept_transposed(marks, selectors, nt, i, scaled[0][nt][i]);
    return kept[0][nt][i] * dp[0][nt][i] - scaled[0][nt][i] * kept_dot;
  };
  if (p.softcap > 0.0f) {
    sm80::softcap_chain_rule_t<Traits>(dp, scaled, 1.0f - p.dropout_p, lse_rows, first_query, m0, first_key, p,
                                       alibi_slope, diagonal, [&](int, int nt, int i, int column) {
                                         return gradient(nt, i, kept_dot_rows[column + i % 2]);
                                       });
    return;
  }
  const int lane = static_cast<int>(threadIdx.x) % 32;
#pragma unroll
  for (int nt = 0; nt < Traits::kSQueryTiles; ++nt) {
    const float2 kept_dot = *reinterpret_cast<const float2*>(kept_dot_rows + first_query + nt * 8 + (lane % 4) * 2);
#pragma unroll
    for (int i = 0; i < 4; ++i) dp[0][nt][i] = gradient(nt, i, i % 2 == 0 ? kept_dot.x : kept_dot.y);
  }
}

// wgmma_wait with a count known only after unrolling (a loop index): 0 to 3 groups in flight.
__device__ __forceinline__ void wgmma_wait_dynamic(int in_flight) {
  if (in_flight >= 3) {
    wgmma_wait<3>();
  } else if (in_flight == 2) {
    wgmma_wait<2>();
  } else if (in_flight == 1) {
    wgmma_wait<1>();
  } else {
    wgmma_wait<0>();
  }
}

// The S^T-layout fragments of a warp (16 keys x kTiles 8-query groups), packed to 16 bits, as the
// A operand of kTiles / 2 k-steps of 16 queries.
template <typename Element, int kTiles>
__device__ __forceinline__ void pack_a_operand(const float (&x)[1][kTiles][4], uint32_t (&a)[kTiles / 2][4]) {
#pragma unroll
  for (int kk = 0; kk < kTiles / 2; ++kk) {
    a[kk][0] = sm80::pack2<Element>(x[0][2 * kk][0], x[0][2 * kk][1]);
    a[kk][1] = sm80::pack2<Element>(x[0][2 * kk][2], x[0][2 * kk][3]);
    a[kk][2] = sm80::pack2<Element>(x[0][2 * kk + 1][0], x[0][2 * kk + 1][1]);
    a[kk][3] = sm80::pack2<Element>(x[0][2 * kk + 1][2], x[0][2 * kk + 1][3]);
  }
}

// A warp's S^T-layout A operand (pack_a_operand: 16 keys x kPartM queries, 16 bits) into the keys x
// queries tile `tile` at key row first_key_row (a multiple of 8) and 8-query chunk
// first_query_chunk: one stmatrix.x4 per k-step of 16 queries, its four 8 x 8 matrices the
// operand's four registers (keys 0-7 / 8-15 x queries 0-7 / 8-15 of the step), lane i giving the
// address of row i % 8 of matrix i / 8. Four instructions instead of sm80::store_keys_by_queries'
// 16 st.shared.b32 (bf16 d128), and 4 row addresses per lane instead of 16 (the swizzle XORs the
// chunk with the row, so one address per k-step): in the dropout instances, where those 16
// addresses were spilled, that took the spill loads out of the loop; in the default p = 0 instances,
// with the dQ staging's registers, ptxas otherwise spilled those addresses too (120 bytes at bf16
// d128). (Deterministic mode's p = 0 instances keep store_keys_by_queries, so that their code stays
// as measured; so does the split layout (d256), where this store spilled 4-12 bytes that
// store_keys_by_queries does not, and its deterministic dropout instance ran 1% slower:
// bench/NOTES.md, "Session 10".)
template <typename Traits>
__device__ __forceinline__ void store_a_operand(uint32_t tile, const uint32_t (&a)[Traits::kPartM / 16][4],
                                                int first_key_row, int first_query_chunk) {
  using PTile = typename Traits::PTile;
  const int lane = static_cast<int>(threadIdx.x) % 32;
  const int row = first_key_row + ((lane / 8) % 2) * 8 + lane % 8;
#pragma unroll
  for (int kk = 0; kk < Traits::kPartM / 16; ++kk) {
    const uint32_t address = tile + PTile::chunk_offset(row, first_query_chunk + 2 * kk + lane / 16);
    asm volatile("stmatrix.sync.aligned.m8n8.x4.shared.b16 [%0], {%1, %2, %3, %4};\n" ::"r"(address),
                 "r"(a[kk][0]), "r"(a[kk][1]), "r"(a[kk][2]), "r"(a[kk][3]));
  }
}

// acc (64 rows of `a_rows` x kPartM columns) = A B^T over the head dim: A = K or V rows of this
// warpgroup, B = kPartM Q or dO rows from `b_rows`, both K-major. Issued, not waited for.
template <typename Traits>
__device__ __forceinline__ void issue_scores(float* acc, uint32_t a_rows, uint32_t b_rows) {
  using KvTile = typename Traits::KvTile;
  using QTile = typename Traits::QTile;
  issue_k_major_product<typename Traits::Element, Traits::kPartM, Traits::kHeadDim,
                        KvTile::kColumnBlockBytes, QTile::kColumnBlockBytes>(acc, a_rows, b_rows);
}

// acc (64 keys x kKvColumns) += X B over kPartM queries, X from registers (P^T or dS^T), B = the
// part's dO or Q rows from `b_rows` (queries x head dim, read MN-major). Issued, not committed.
template <typename Traits>
__device__ __forceinline__ void issue_key_gradient(float* acc, const uint32_t (&x)[Traits::kPartM / 16][4],
                                                   uint32_t b_rows) {
  using QTile = typename Traits::QTile;
  issue_register_product<typename Traits::Element, Traits::kKvColumns, Traits::kPartM,
                         QTile::kColumnBlockBytes>(acc, x, b_rows);
}

// The split layout's (Traits::kSplitHeadDim) key gradient: acc (64 keys x kKvColumns) += X B over
// the block's kBlockM queries, X = the whole P^T or dS^T from the keys x queries tile `x_tile`
// (K-major), B = the warpgroup's dO or Q columns from `b_columns` (MN-major). Issued, not committed.
template <typename Traits>
__device__ __forceinline__ void issue_key_gradient_from_tile(float* acc, uint32_t x_tile, uint32_t b_columns) {
  using PTile = typename Traits::PTile;
  using QTile = typename Traits::QTile;
  const SharedDescriptor a_desc = k_major_descriptor(x_tile);
  const SharedDescriptor b_desc = mn_major_descriptor<QTile::kColumnBlockBytes>(b_columns);
#pragma unroll
  for (int kk = 0; kk < Traits::kBlockM / 16; ++kk) {
    Wgmma<Traits::kKvColumns>::template ss<typename Traits::Element, 1>(
        acc, a_desc.at((kk / 4) * PTile::kColumnBlockBytes + (kk % 4) * 32), b_desc.at(kk * 16 * 128), 1u);
  }
}

// dQ accumulator += a warp's 16-row dQ fragments (the m64 accumulator rows 16 w + g, 16 w + g + 8 of
// warp w, kDqTiles 8-column tiles) by the copy engine: `first_row` is the rows' index in the
// sequence, `first_col` their first column, `map` the accumulator's tensor map (head dim, query
// heads, total_q). The lanes store their fragments in the warp's staging boxes (`staging`, 1024-byte
// aligned, laid out as the map's 128-byte swizzle wants: the 16-byte chunk c of row r at chunk
// c ^ (r % 8)), and lane 0 issues one bulk reduce-add per 32-column box. The warp goes on at once;
// lane 0 waits for the engine to have read the boxes before the next block's stores (a block later,
// long done) and, with the kernel's last wait, before the CTA exits. Columns
// past head_dim fall outside the map and are dropped. Rows past the sequence (its last block) are
// inside the map (the next sequence's, or the next batch's): they are staged as zeros, and adding
// zeros changes no accumulator element (the accumulator starts at +0 and a sum of floats is -0 only
// when both terms are, so no element is -0, and x + +-0 = x for every other x).
template <typename Traits>
__device__ __forceinline__ void reduce_dq_in_bulk(const CUtensorMap& map, const float (&acc)[Traits::kDqTiles][4],
                                                  unsigned char* staging, int first_row, int first_col,
                                                  int len_q, int head, int64_t q_flat, int head_dim) {
  static_assert(Traits::kDqColumns % Traits::kDqBoxColumns == 0, "whole boxes");
  const int lane = static_cast<int>(threadIdx.x) % 32;
  if (lane == 0) tma_store_wait_read<0>();
  __syncwarp();
  const int g = lane / 4;
  const int t = lane % 4;
  // Each store instruction i writes, in lanes with t < 2, tile dt = i and, in lanes with t >= 2, tile
  // dt = i ^ 2 (same box): a half warp (g 0-3 or 4-7) then covers all eight 16-byte chunks of the
  // 128-byte rows once ((2 (dt % 4) + t / 2) ^ g differs in bit 2 between the two lane halves),
  // where storing tile i in every lane hit each chunk twice (4 shared wavefronts per store instead
  // of 2). The selects cost one instruction per register moved.
  const bool swapped = t >= 2;
  auto stage = [&](bool row_g, bool row_g8) {
#pragma unroll
    for (int i = 0; i < Traits::kDqTiles; ++i) {
      const int dt_lo = i, dt_hi = i ^ 2;
      // Columns 8 dt + 2t, + 1: box dt / 4, 16-byte chunk 2 (dt % 4) + t / 2, its half t % 2.
      const int chunk = 2 * ((swapped ? dt_hi : dt_lo) % 4) + t / 2;
      unsigned char* const box = staging + (i / 4) * Traits::kDqBoxBytes + (t % 2) * 8 + (chunk ^ g) * 16;
      const float2 upper =
          swapped ? make_float2(acc[dt_hi][0], acc[dt_hi][1]) : make_float2(acc[dt_lo][0], acc[dt_lo][1]);
      const float2 lower =
          swapped ? make_float2(acc[dt_hi][2], acc[dt_hi][3]) : make_float2(acc[dt_lo][2], acc[dt_lo][3]);
      *reinterpret_cast<float2*>(box + g * 128) = row_g ? upper : make_float2(0.0f, 0.0f);
      *reinterpret_cast<float2*>(box + (g + 8) * 128) = row_g8 ? lower : make_float2(0.0f, 0.0f);
    }
  };
  if (first_row + 16 <= len_q) {  // the same for the whole warp
    stage(true, true);
  } else {
    stage(first_row + g < len_q, first_row + g + 8 < len_q);
  }
  fence_proxy_async_shared();  // this lane's stores, before the engine reads them
  __syncwarp();
  if (lane == 0) {
    const uint32_t boxes = smem_u32(staging);
    const int row = static_cast<int>(q_flat) + first_row;
#pragma unroll
    for (int b = 0; b < Traits::kDqColumns / Traits::kDqBoxColumns; ++b) {
      const int col = first_col + b * Traits::kDqBoxColumns;
      if (col < head_dim) tma_reduce_add_3d(map, boxes + b * Traits::kDqBoxBytes, col, head, row);
    }
    tma_store_commit();
  }
}

// A query block that reaches past its sequence: rows [valid, kBlockM) of its stage's Q and dO tiles
// and of its LSE and dot rows set to zero, every thread a share (the copy engine brought the next
// sequence's rows there, or zeros past the tensor, and the workspace rows past a sequence hold
// anything).
template <typename Traits>
__device__ __forceinline__ void zero_rows_past(unsigned char* smem, int stage, int valid) {
  using QTile = typename Traits::QTile;
  const int tid = static_cast<int>(threadIdx.x);
  unsigned char* const q_tile = smem + Traits::kQOffset + stage * Traits::kStageBytes;
  unsigned char* const do_tile = smem + Traits::kDoOffset + stage * Traits::kStageBytes;
  const int chunks = (Traits::kBlockM - valid) * QTile::kChunksPerRow;
  for (int i = tid; i < chunks; i += Traits::kThreads) {
    const uint32_t offset = QTile::chunk_offset(valid + i / QTile::kChunksPerRow, i % QTile::kChunksPerRow);
    *reinterpret_cast<uint4*>(q_tile + offset) = make_uint4(0u, 0u, 0u, 0u);
    *reinterpret_cast<uint4*>(do_tile + offset) = make_uint4(0u, 0u, 0u, 0u);
  }
  float* const lse = reinterpret_cast<float*>(smem + Traits::kLseOffset + stage * Traits::kRowStatsBytes);
  float* const dot = reinterpret_cast<float*>(smem + Traits::kDotOffset + stage * Traits::kRowStatsBytes);
  for (int row = valid + tid; row < Traits::kBlockM; row += Traits::kThreads) {
    lse[row] = 0.0f;
    dot[row] = 0.0f;
  }
}

// Deterministic mode's order of the grid. The sm80 order (the grid backwards, each (batch, head)'s
// key blocks together) starts all key blocks of a head at once, and without a causal mask they then
// meet each query block together: key block n waits for n + 1, which waits for n + 2, ..., a chain
// that idles the SMs at each CTA start (measured: up to 1.31x the default's time at 2k tokens).
// Here the heads go in chunks, and within a chunk the key blocks take turns: the last key block of
// every head of the chunk, then the one before, and so on. About 132 / chunk CTAs of a head run at
// once instead of all its key blocks, and a head's key block n still starts before n - 1 (a CTA
// waits only on CTAs that started before it: no deadlock). A chunk has as many heads as keep their
// Q, dO and dQ accumulator (8 x seqlen_q x head_dim bytes each) within 24 MiB, so that they stay
// in L2 as one head's do in the sm80 order.
template <typename Element>
__device__ __forceinline__ sm80::BwdBlockLocation<Element> deterministic_location(
    const BwdProblem& bp, const sm80::BwdWorkspacePointers& ws, int block_n) {
  constexpr int64_t kChunkBytes = int64_t{24} << 20;
  const FwdProblem& p = bp.fwd;
  const int num_n_blocks = (p.seqlen_k + block_n - 1) / block_n;
  const int batch_heads = p.batch * p.heads_q;
  const int64_t head_bytes = int64_t{8} * p.seqlen_q * p.head_dim;
  const int64_t heads_in_budget = max(int64_t{1}, kChunkBytes / max(head_bytes, int64_t{1}));
  const int chunk = static_cast<int>(min(static_cast<int64_t>(batch_heads), heads_in_budget));
  const int linear = static_cast<int>(blockIdx.x);
  const int first_head = linear / (chunk * num_n_blocks) * chunk;
  const int heads = min(chunk, batch_heads - first_head);
  const int turn = linear - first_head * num_n_blocks;
  return sm80::BwdBlockLocation<Element>::at(bp, ws, num_n_blocks - 1 - turn / heads,
                                             first_head + turn % heads);
}

template <typename Traits>
__global__ void __launch_bounds__(Traits::kThreads, 1)
    bwd_kernel(const __grid_constant__ BwdProblem bp, const sm80::BwdWorkspacePointers ws,
               const __grid_constant__ CUtensorMap q_map, const __grid_constant__ CUtensorMap do_map,
               const __grid_constant__ CUtensorMap dq_map) {
  using Element = typename Traits::Element;
  using KvTile = typename Traits::KvTile;
  using QTile = typename Traits::QTile;
  using PTile = typename Traits::PTile;
  constexpr int kBlockM = Traits::kBlockM;
  constexpr int kBlockN = Traits::kBlockN;
  constexpr int kQueryParts = Traits::kQueryParts;
  constexpr int kPartM = Traits::kPartM;
  using PartScores = typename Traits::PartScores;
  constexpr int kDTiles = Traits::kDTiles;
  constexpr float kLog2e = 1.4426950408889634f;
  const FwdProblem& p = bp.fwd;

  extern __shared__ unsigned char smem_raw[];
  const uint32_t raw = smem_u32(smem_raw);
  const uint32_t smem = (raw + 1023u) & ~1023u;
  unsigned char* const smem_aligned = smem_raw + (smem - raw);

  const int tid = static_cast<int>(threadIdx.x);
  const int warpgroup = tid / kWarpgroupThreads;
  const int warp = (tid / 32) % 4;  // within the warpgroup
  // This warpgroup's first key in the block, first query of its S^T / dP^T, and first dK / dV
  // column (the split layout's warpgroups share the keys and split the queries and columns).
  const int wg_key0 = Traits::kSplitHeadDim ? 0 : warpgroup * 64;
  const int wg_query0 = Traits::kSplitHeadDim ? warpgroup * Traits::kWarpgroupQueries : 0;
  const int wg_kv_col0 = Traits::kSplitHeadDim ? warpgroup * Traits::kKvColumns : 0;
  const int warp_key0 = wg_key0 + warp * 16;   // this warp's first key (its 16 accumulator rows)
  // This warpgroup's dQ part: 64 queries x kDqColumns columns.
  const int dq_query_part = warpgroup % Traits::kDqQueryParts;
  const int dq_column_part = warpgroup / Traits::kDqQueryParts;

  const sm80::BwdBlockLocation<Element> loc = Traits::kDeterministic
                                                  ? deterministic_location<Element>(bp, ws, kBlockN)
                                                  : sm80::BwdBlockLocation<Element>::locate(bp, ws, kBlockN);
  const int n0 = loc.n_block * kBlockN;
  if (n0 >= loc.len_k_rows) return;  // varlen: this sequence is shorter than max_seqlen_k
  const int head_chunks = p.head_dim / 8;

  const sm80::KeyWindow window{loc.len_q, loc.len_k, p.window_left, p.window_right};
  const auto visible = sm80::VisibleQueryBlocks<kBlockM, kBlockN>::of(window, loc.n_block);

  float acc_dk[1][kDTiles][4];
  float acc_dv[1][kDTiles][4];
  sm80::zero_accumulators(acc_dk);
  sm80::zero_accumulators(acc_dv);

  const float alibi_slope =
      p.alibi_slopes != nullptr ? p.alibi_slopes[loc.batch * p.alibi_batch_stride + loc.head] : 0.0f;
  const bool transform = p.softcap > 0.0f || alibi_slope != 0.0f;
  const int diagonal = window.diagonal_offset();
  const float log2_scale = transform ? kLog2e : p.softmax_scale * kLog2e;
  // Read once: with a device rng_state the dropout key is in global memory.
  const DropoutMask dropout_mask = Traits::kDropout ? p.dropout_mask() : DropoutMask{};
  [[maybe_unused]] const sm80::DropMarker drop_marker(dropout_mask);
  // Dropout: P^T is computed times 1 / (1 - p), the kept entries' weight in the forward's output.
  const float log2_keep_scale = Traits::kDropout ? -log2f(1.0f - p.dropout_p) : 0.0f;
  const uint32_t batch_head = static_cast<uint32_t>(loc.batch * p.heads_q + loc.head);

  if (visible.begin < visible.end) {
    const bool varlen = p.cu_seqlens_q != nullptr;  // the maps are rank 3 [D, total, heads]
    // One barrier per stage of Q, dO, LSE and dot, completed by the copy engine's bytes.
    const uint32_t stage_bars = smem + Traits::kBarrierOffset;
    if (tid == 0) {
      for (int stage = 0; stage < Traits::kStages; ++stage) {
        mbarrier_init(stage_bars + static_cast<uint32_t>(stage * Traits::kBarrierBytes), 1);
      }
      mbarrier_init_fence();
      tma_prefetch_map(q_map);
      tma_prefetch_map(do_map);
    }
    __syncthreads();
    sm80::load_tile_async<Traits, KvTile>(smem + Traits::kKOffset,
                                          loc.k + static_cast<int64_t>(n0) * p.k_row_stride,
                                          p.k_row_stride, loc.len_k - n0, head_chunks);
    sm80::load_tile_async<Traits, KvTile>(smem + Traits::kVOffset,
                                          loc.v + static_cast<int64_t>(n0) * p.v_row_stride,
                                          p.v_row_stride, loc.len_k - n0, head_chunks);
    // Q, dO, LSE and dot of query block m into pipeline stage `stage` by the copy engine, completing on
    // the stage's barrier; issued by thread 0. Rows past the sequence are the next sequence's (varlen)
    // or zeros (past the tensor), and the workspace's LSE and dot rows past it anything: the block
    // zeroes them on arrival (below).
    auto load_query_block = [&](int m_block, int stage) {
      const int m0 = m_block * kBlockM;
      const uint32_t bar = stage_bars + static_cast<uint32_t>(stage * Traits::kBarrierBytes);
      const uint32_t stage_offset = static_cast<uint32_t>(stage * Traits::kStageBytes);
      const int row = static_cast<int>(varlen ? loc.q_flat + m0 : m0);
      mbarrier_arrive_expect_tx(bar, Traits::kStageTxBytes);
      tma_load_tile<QTile>(smem + Traits::kQOffset + stage_offset, q_map, bar, varlen, row, loc.head, loc.batch);
      tma_load_tile<QTile>(smem + Traits::kDoOffset + stage_offset, do_map, bar, varlen, row, loc.head, loc.batch);
      const uint32_t stats = static_cast<uint32_t>(stage * Traits::kRowStatsBytes);
      bulk_load(smem + Traits::kLseOffset + stats, ws.lse + loc.stats_row0 + m0, Traits::kRowStatsBytes, bar);
      bulk_load(smem + Traits::kDotOffset + stats, ws.dot + loc.stats_row0 + m0, Traits::kRowStatsBytes, bar);
    };
    if (tid == 0) {
      for (int ahead = 0; ahead + 1 < Traits::kStages && visible.begin + ahead < visible.end; ++ahead) {
        load_query_block(visible.begin + ahead, ahead);
      }
    }
    // K and V in place (their copies, and the barrier below, before the first block's products).
    sm80::cp_async_commit();
    sm80::cp_async_wait<0>();
    fence_proxy_async_shared();
    // Dropout: the drop marks of query block m into stage `stage` of the exchange, each query part's
    // in its warp pair's buffer (read after the next barrier: load_transposed_marks).
    const int first_key = n0 + warp_key0;
    auto exchange = [&](int stage, int h) {
      const int pair = warpgroup * 2 + warp / 2;
      return reinterpret_cast<uint32_t*>(smem_aligned + Traits::kDropoutOffset + stage * Traits::kDropoutStageBytes +
                                         (pair * kQueryParts + h) * Traits::kDropoutExchangeBytes);
    };
    PhiloxRoundKeys* const round_keys = reinterpret_cast<PhiloxRoundKeys*>(smem_aligned + Traits::kRoundKeysOffset);
    [[maybe_unused]] auto store_drop_marks = [&](int m_block, int stage) {
      const PhiloxRoundKeys keys = *round_keys;
#pragma unroll
      for (int h = 0; h < kQueryParts; ++h) {
        sm80::store_transposed_marks_pair<kPartM / 16>(dropout_mask, keys, drop_marker, batch_head, first_key,
                                                       m_block * kBlockM + wg_query0 + h * kPartM, exchange(stage, h));
      }
    };
    if constexpr (Traits::kDropout) {
      if (tid == 0) *round_keys = dropout_mask.round_keys();
      __syncthreads();
      store_drop_marks(visible.begin, 0);
    }

    const int64_t dq_row_stride = static_cast<int64_t>(p.heads_q) * p.head_dim;
    float* dq_accum = ws.dq_accum + loc.q_flat * dq_row_stride + static_cast<int64_t>(loc.head) * p.head_dim;
    const uint32_t k_rows = smem + Traits::kKOffset + wg_key0 * 128;
    const uint32_t v_rows = smem + Traits::kVOffset + wg_key0 * 128;

    // This warpgroup's dQ part of a block (64 queries x kDqColumns) into the accumulator: staged
    // for the copy engine's reductions, or atomic adds. With kDqInStage the staging is in `stage`,
    // the block's pipeline stage: this warpgroup's columns of its Q (warps 0-1) and dO (warps 2-3).
    float acc_dq[Traits::kDqTiles][4];
    auto add_dq = [&](int dq_m0, [[maybe_unused]] int stage = 0) {
      const int first_row = dq_m0 + dq_query_part * 64 + warp * 16;
      const int first_col = dq_column_part * Traits::kDqColumns;
      if constexpr (Traits::kDqBulkReduce) {
        unsigned char* const staging =
            Traits::kDqInStage
                ? smem_aligned + Traits::kQOffset + stage * Traits::kStageBytes + (warp / 2) * QTile::kBytes +
                      (wg_kv_col0 / 64) * QTile::kColumnBlockBytes + (warp % 2) * Traits::kDqWarpBytes
                : smem_aligned + Traits::kDqOffset + static_cast<int>(threadIdx.x / 32) * Traits::kDqWarpBytes;
        reduce_dq_in_bulk<Traits>(dq_map, acc_dq, staging, first_row, first_col, loc.len_q, loc.head, loc.q_flat,
                                  p.head_dim);
      } else {
        sm80::add_dq_rows<Traits::kDqTiles>(dq_accum, dq_row_stride, acc_dq, first_row, first_col, loc.len_q,
                                            p.head_dim);
      }
    };
    auto key_gradients_landed = [&] {
      wgmma_fence_registers<Traits::kKvColumns / 2>(&acc_dk[0][0][0]);
      wgmma_fence_registers<Traits::kKvColumns / 2>(&acc_dv[0][0][0]);
    };
    // kDqBehind: every product issued so far (the previous block's dV, dK and dQ) landed.
    auto previous_products_landed = [&] {
      wgmma_wait<0>();
      wgmma_fence_registers<Traits::kDqColumns / 2>(&acc_dq[0][0]);
      key_gradients_landed();
    };
    // Deterministic mode: the semaphore of the query block whose dQ adds this CTA made last and has
    // not published yet.
    [[maybe_unused]] int* unpublished = nullptr;
    for (int m_block = visible.begin, stage = 0; m_block < visible.end;
         ++m_block, stage = stage + 1 == Traits::kStages ? 0 : stage + 1) {
      const int m0 = m_block * kBlockM;
      // This block's Q, dO, LSE and dot landed. In a block that reaches past the sequence, its rows
      // past the end become zeros, so that they add nothing to dV and dK (their P^T is
      // exp2(0 - 0) = 1 times dO = 0, and dS^T = P^T (0 - 0)): the products then read them.
      mbarrier_wait(stage_bars + static_cast<uint32_t>(stage * Traits::kBarrierBytes),
                    static_cast<uint32_t>((m_block - visible.begin) / Traits::kStages) & 1u);
      if (m0 + kBlockM > loc.len_q) {
        zero_rows_past<Traits>(smem_aligned, stage, loc.len_q - m0);
        fence_proxy_async_shared();  // the zeros, before wgmma reads them
      }
      if constexpr (Traits::kDqBehind && Traits::kDsBuffers == 1) previous_products_landed();
      __syncthreads();
      const bool prefetch = m_block + 1 < visible.end;  // (the next block's drop marks)
      // The loads of block m_block + kStages - 1 (if there is one) into the stage the previous block
      // used, once that block's products have all landed in both warpgroups (before this barrier;
      // with two dS^T buffers, before the second one).
      auto load_ahead = [&] {
        const int ahead = m_block + Traits::kStages - 1;
        if (tid == 0 && ahead < visible.end) {
          load_query_block(ahead, stage == 0 ? Traits::kStages - 1 : stage - 1);
        }
      };
      // (kDqInStage: the previous block's dQ staging in that stage is read by the engine by then.)
      constexpr bool kLoadsAfterSecondBarrier = Traits::kDsBuffers == 2 || Traits::kDqInStage;
      if (!Traits::kDeterministic && !kLoadsAfterSecondBarrier) load_ahead();
      const int marks_stage = (m_block - visible.begin) % Traits::kMarkStages;
      const uint32_t q_tile = smem + Traits::kQOffset + static_cast<uint32_t>(stage * Traits::kStageBytes);
      const uint32_t do_tile = smem + Traits::kDoOffset + static_cast<uint32_t>(stage * Traits::kStageBytes);
      const float* lse_rows =
          reinterpret_cast<const float*>(smem_aligned + Traits::kLseOffset + stage * Traits::kRowStatsBytes);
      // With dropout these rows hold (1 - p) dot (run_bwd's preprocess; dropout_score_gradients_t).
      const float* dot_rows =
          reinterpret_cast<const float*>(smem_aligned + Traits::kDotOffset + stage * Traits::kRowStatsBytes);

      const int ds_buffer = (m_block - visible.begin) % Traits::kDsBuffers;
      const uint32_t ds_tile = smem + Traits::kDsOffset + static_cast<uint32_t>(ds_buffer * PTile::kBytes);

      // S^T = K Q^T and dP^T = V dO^T over this warpgroup's 64 keys x its queries, in kQueryParts
      // parts of kPartM queries: 2 x kQueryParts groups in flight, part 0's first. With kDqBehind,
      // the previous block's dQ is added once S^T_0 is issued, while it runs.
      float acc_s[kQueryParts][1][kPartM / 8][4];
      float acc_dp[kQueryParts][1][kPartM / 8][4];
      if constexpr (Traits::kDqBehind && Traits::kDsBuffers == 2) previous_products_landed();
      wgmma_fence();
#pragma unroll
      for (int h = 0; h < kQueryParts; ++h) {
        const uint32_t part_rows = static_cast<uint32_t>((wg_query0 + h * kPartM) * 128);
        issue_scores<Traits>(&acc_s[h][0][0][0], k_rows, q_tile + part_rows);
        if (Traits::kDqBehind && h == 0 && m_block > visible.begin) {
          add_dq(m0 - kBlockM);
          wgmma_fence();  // the adds read registers that dP^T's accumulator may take over
        }
        issue_scores<Traits>(&acc_dp[h][0][0][0], v_rows, do_tile + part_rows);
      }
      if constexpr (Traits::kDeterministic) {
        // The barrier above ordered every thread's adds of the previous query block before this.
        if (unpublished != nullptr && tid == 0) sm80::publish_dq_adds(unpublished);
        unpublished = nullptr;
        // Only now, so that the publishing fence above does not wait for them.
        load_ahead();
      }
      // Dropout: the next block's drop marks, drawn while S^T and dP^T run on the tensor cores (a
      // window the scores' wait otherwise leaves nearly empty; drawn after dQ's issue instead, under
      // dV, dK and dQ, it cost 2% more: bench/NOTES.md). The other marks stage was last read before
      // this block's first barrier. The split layout's dQ holds twice the registers: there the
      // draw follows its adds, below.
      if constexpr (Traits::kDropout && !Traits::kSplitHeadDim) {
        if (prefetch) store_drop_marks(m_block + 1, marks_stage ^ 1);
      }
      const bool cut = !window.block_unmasked(m0, min(m0 + kBlockM, loc.len_q), n0, n0 + kBlockN);
      // Per part, once its S^T and dP^T have landed: P^T and dS^T in registers, dS^T to shared
      // memory, then dV += P^T dO and dK += dS^T Q over the part's queries, issued so that they run
      // during the next part's softmax or the barrier. The split layout stores P^T too and issues
      // dV and dK after the barrier, over the whole block's P^T and dS^T.
      uint32_t p_frag[kQueryParts][kPartM / 16][4];
      uint32_t ds_frag[kQueryParts][kPartM / 16][4];
#pragma unroll
      for (int h = 0; h < kQueryParts; ++h) {
        // Committed so far: 2 x kQueryParts products of scores (S^T_0, dP^T_0, S^T_1, ...) and h
        // of key gradients; groups land in order. P^T needs S^T_h (2h + 1 groups landed), dS^T
        // needs dP^T_h (2h + 2 landed). With one part, P^T is computed while dP^T lands; with two,
        // the next part's products already overlap, and waiting twice measured 2-3% slower (d64),
        // so one wait serves both.
        constexpr bool kProbabilitiesFirst = kQueryParts == 1;
        const int first_query = wg_query0 + h * kPartM;  // in the block
        wgmma_wait_dynamic(2 * kQueryParts - h - (kProbabilitiesFirst ? 1 : 2));
        wgmma_fence_registers<kPartM / 2>(&acc_s[h][0][0][0]);
        if (!kProbabilitiesFirst) wgmma_fence_registers<kPartM / 2>(&acc_dp[h][0][0][0]);
        if (transform) {
          sm80::transform_scores_t<PartScores>(acc_s[h], p, first_key, m0 + first_query, alibi_slope, diagonal);
        }
        if (cut) sm80::mask_scores_t<PartScores>(acc_s[h], window, first_key, m0 + first_query);
        sm80::probabilities_t<PartScores>(acc_s[h], lse_rows, first_query, log2_scale, log2_keep_scale);
        if (kProbabilitiesFirst) {
          wgmma_wait_dynamic(2 * kQueryParts - h - 2);
          wgmma_fence_registers<kPartM / 2>(&acc_dp[h][0][0][0]);
        }
        // P^T for dV (with dropout its kept entries): packed to an A operand, or (split) stored for
        // the other warpgroup too.
        auto keep_probabilities = [&](const float (&probabilities)[1][kPartM / 8][4]) {
          if constexpr (Traits::kSplitHeadDim) {
            sm80::store_keys_by_queries<PartScores>(smem + Traits::kPOffset, probabilities, warp_key0,
                                                    first_query / 8);
          } else {
            pack_a_operand<Element, kPartM / 8>(probabilities, p_frag[h]);
          }
        };
        if constexpr (Traits::kDropout) {  // dS^T, and P^T o Z for dV
          // This part's drop marks, stored during the previous block (or the prologue). Loaded here,
          // not before the waits: 4 words per row block, and held across the exponentials they cost
          // 9 spill loads in the loop (bf16 d128).
          uint32_t drop_marks[kPartM / 16][2][2];
          sm80::load_transposed_marks(drop_marks, exchange(marks_stage, h), first_key);
          float kept[1][kPartM / 8][4];
          dropout_score_gradients_t<PartScores>(acc_dp[h], acc_s[h], kept, drop_marks, lse_rows, dot_rows,
                                                      first_query, m0, first_key, p, alibi_slope, diagonal);
          keep_probabilities(kept);
        } else {
          sm80::score_gradients_t<PartScores>(acc_dp[h], acc_s[h], lse_rows, dot_rows, first_query, m0,
                                              first_key, p, alibi_slope, diagonal);
          keep_probabilities(acc_s[h]);
        }
        if constexpr ((Traits::kDropout || Traits::kDqBulkReduce) && !Traits::kSplitHeadDim) {
          pack_a_operand<Element>(acc_dp[h], ds_frag[h]);
          store_a_operand<Traits>(ds_tile, ds_frag[h], warp_key0, first_query / 8);
        } else {
          sm80::store_keys_by_queries<PartScores>(ds_tile, acc_dp[h], warp_key0, first_query / 8);
          if constexpr (!Traits::kSplitHeadDim) pack_a_operand<Element>(acc_dp[h], ds_frag[h]);
        }
        if constexpr (!Traits::kSplitHeadDim) {
          wgmma_fence();
          issue_key_gradient<Traits>(&acc_dv[0][0][0], p_frag[h], do_tile + first_query * 128);
          issue_key_gradient<Traits>(&acc_dk[0][0][0], ds_frag[h], q_tile + first_query * 128);
          wgmma_commit();
        }
      }
      // Deterministic mode: the first read of the semaphore travels during the barrier and dQ.
      [[maybe_unused]] const auto dq_turn =
          sm80::DqAddTurn<kBlockM, kBlockN>::of(bp, ws, loc.batch, loc.head, window, m_block, loc.n_block);
      [[maybe_unused]] int dq_turn_seen = 0;
      if constexpr (Traits::kDeterministic) dq_turn_seen = load_relaxed(dq_turn.semaphore);
      // kDqInStage: the engine has read the previous block's dQ staging (issued a block ago), so that
      // the loads after the barrier may overwrite its stage.
      if constexpr (Traits::kDqInStage) {
        if (tid % 32 == 0) tma_store_wait_read<0>();
      }
      fence_proxy_async_shared();  // the P^T / dS^T stores, before the wgmmas read them
      __syncthreads();  // P^T / dS^T complete
      if constexpr (kLoadsAfterSecondBarrier) load_ahead();

      // dQ part = dS K: A = dS (64 queries x 16 keys per step) read transposed from dS^T, B = K
      // (16 keys x kDqColumns columns) read MN-major.
      const uint32_t ds_columns = ds_tile + dq_query_part * PTile::kColumnBlockBytes;
      const uint32_t k_columns =
          smem + Traits::kKOffset + dq_column_part * (Traits::kDqColumns / 64) * KvTile::kColumnBlockBytes;
      const SharedDescriptor ds_desc = mn_major_descriptor<PTile::kColumnBlockBytes>(ds_columns);
      const SharedDescriptor k_desc = mn_major_descriptor<KvTile::kColumnBlockBytes>(k_columns);
#pragma unroll
      for (int kk = 0; kk < kBlockN / 16; ++kk) {
        Wgmma<Traits::kDqColumns>::template ss<Element, 1, 1>(&acc_dq[0][0], ds_desc.at(kk * 16 * 128),
                                                              k_desc.at(kk * 16 * 128), kk > 0 ? 1u : 0u);
      }
      wgmma_commit();
      if constexpr (Traits::kSplitHeadDim) {
        // dV += P^T dO and dK += dS^T Q over the block's queries and this warpgroup's columns,
        // behind dQ (with atomics, its adds below run while these products do).
        const uint32_t kv_columns = static_cast<uint32_t>((wg_kv_col0 / 64) * QTile::kColumnBlockBytes);
        issue_key_gradient_from_tile<Traits>(&acc_dv[0][0][0], smem + Traits::kPOffset, do_tile + kv_columns);
        issue_key_gradient_from_tile<Traits>(&acc_dk[0][0][0], ds_tile, q_tile + kv_columns);
        wgmma_commit();
      }
      // dQ landed and added in this block (kDqBehind: during the next block, or after the loop).
      if constexpr (Traits::kDqInStage) {
        if constexpr (Traits::kDropout) {  // the next block's drop marks, while the products run
          if (prefetch) store_drop_marks(m_block + 1, marks_stage ^ 1);
        }
        // Everything landed: this warpgroup's columns of the stage's Q and dO are free for dQ.
        wgmma_wait<0>();
        wgmma_fence_registers<Traits::kDqColumns / 2>(&acc_dq[0][0]);
        key_gradients_landed();
        add_dq(m0, stage);
      } else if constexpr (!Traits::kDqBehind) {
        wgmma_wait<Traits::kSplitHeadDim ? 1 : 0>();  // dQ (without the split: everything) landed
        wgmma_fence_registers<Traits::kDqColumns / 2>(&acc_dq[0][0]);
        if constexpr (!Traits::kSplitHeadDim) key_gradients_landed();

        if constexpr (Traits::kDeterministic) {
          while (dq_turn_seen != dq_turn.turn) dq_turn_seen = load_relaxed(dq_turn.semaphore);
          fence_acquire();
          unpublished = dq_turn.semaphore;
        }
        add_dq(m0);
        if constexpr (Traits::kSplitHeadDim) {
          if constexpr (Traits::kDropout) {
            if (prefetch) store_drop_marks(m_block + 1, marks_stage ^ 1);
          }
          // The key gradients' reads of this stage's Q and dO and of P^T and dS^T finish before the
          // next block's barrier lets anyone overwrite them.
          wgmma_wait<0>();
          key_gradients_landed();
        }
      }
    }
    if constexpr (Traits::kDqBehind) {  // the last block's dQ (the loop ran at least once)
      previous_products_landed();
      add_dq((visible.end - 1) * kBlockM);
    }
    if constexpr (Traits::kDeterministic) {
      if (unpublished != nullptr) {
        __syncthreads();
        if (tid == 0) sm80::publish_dq_adds(unpublished);
      }
    }
    // The bulk reductions read this CTA's shared memory: they must be done before it exits.
    if constexpr (Traits::kDqBulkReduce) {
      if (tid % 32 == 0) tma_store_wait<0>();
    }
  }

  // With dropout, dV summed P^T o Z: no 1 / (1 - p) left to apply.
  sm80::store_key_gradients<Element, 1, kDTiles>(bp, ws, loc, acc_dk, acc_dv, n0 + warp_key0, wg_kv_col0);
}

}  // namespace flashkit::sm90
