// src/cuda/nsa/nsa_fwd_kernel.cuh
// \brief The forward kernel of native sparse attention's selection branch (mma.sync: Ampere, Ada,
// Hopper).
//
// Every query token has its own selection of key blocks, so tokens share no K/V tile; what they
// share is the kv head: the query heads of one group read the same selected blocks. A CTA
// therefore owns ONE (sequence, token, kv head) and packs the group's query heads as the 16 rows
// of its mma tile (a group of more than 16 heads takes several CTAs, one per 16 heads), the
// layout NSA was designed around (GQA groups of 16 and more).
//
//   prologue   Q (16 heads x D) copied with cp.async; the selection resolved in shared memory
//              (nsa_selection.cuh); the first kStages - 1 chunks of 64 selected keys of K and V
//              copied
//   per chunk  wait until chunk n landed; barrier; copy chunk n + kStages - 1
//              S = Q K^T on this warp's 16 keys (one block's consecutive keys)
//              mask (keys past the sequence or the causal limit, slices past the selection)
//              online softmax; O += P V
//   epilogue   the four warps' partial results merged (warp_merge.cuh) and stored with the lse
//
// The warps split a chunk's keys, not its rows, as in the decode kernel: each has its own online
// softmax over its slices, merged once at the end.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>

#include "common/nsa_problem.h"
#include "cuda/common/mma_sm80.cuh"
#include "cuda/common/online_softmax.cuh"
#include "cuda/common/swizzled_tile.cuh"
#include "cuda/common/warp_merge.cuh"
#include "cuda/nsa/nsa_copies.cuh"
#include "cuda/nsa/nsa_selection.cuh"

namespace flashkit::nsa {

using sm80::SwizzledTile;

template <typename Element_, int kHeadDim_>
struct NsaFwdTraits {
  using Element = Element_;
  static constexpr int kHeadDim = kHeadDim_;
  static constexpr int kRows = 16;    // query heads of one group per CTA
  static constexpr int kBlockN = 64;  // selected keys per pipeline stage
  static constexpr int kWarps = 4;
  static constexpr int kThreads = kWarps * 32;
  // Two stages: a token's selection is a few chunks (NSA: 16 blocks of 64 keys), so more CTAs per
  // SM (three at D 128) hide a CTA's prologue and epilogue better than a deeper pipeline would.
  static constexpr int kStages = 2;
  static constexpr int kQkSteps = kHeadDim / 16;
  static constexpr int kDTiles = kHeadDim / 8;
  static constexpr int kChunks = kHeadDim / 8;  // 16-byte chunks per row

  using QTile = SwizzledTile<kRows, kHeadDim>;
  using KvTile = SwizzledTile<kBlockN, kHeadDim>;
  using Merge = sm80::WarpMerge<kWarps, kHeadDim>;

  // Shared memory: [ Q | stage 0: K, V | stage 1: K, V | ... | per-warp lse | selection ]. After
  // the loop the stages hold the merge buffer.
  static constexpr int kQOffset = 0;
  static constexpr int kKvOffset = kQOffset + QTile::kBytes;
  static constexpr int kStageBytes = 2 * KvTile::kBytes;
  static constexpr int kLseOffset = kKvOffset + kStages * kStageBytes;
  static constexpr int kSelectionOffset = kLseOffset + Merge::kLseBytes;
  static constexpr int kSmemBytes = kSelectionOffset + kSelectionSmemBytes;

  static_assert(kBlockN == kWarps * 16, "each warp owns one 16-key slice of a chunk");
  static_assert(Merge::kMergeBytes <= kStages * kStageBytes, "the merge buffer reuses the K/V stages");
};

template <typename Traits>
__global__ void __launch_bounds__(Traits::kThreads) nsa_fwd_kernel(const __grid_constant__ NsaProblem p) {
  using Element = typename Traits::Element;
  using QTile = typename Traits::QTile;
  using KvTile = typename Traits::KvTile;
  constexpr int kRows = Traits::kRows;
  constexpr int kBlockN = Traits::kBlockN;
  constexpr int kHeadDim = Traits::kHeadDim;
  constexpr int kStages = Traits::kStages;

  extern __shared__ __align__(128) unsigned char smem[];
  const uint32_t sQ = sm80::smem_address(smem + Traits::kQOffset);
  const uint32_t sKv = sm80::smem_address(smem + Traits::kKvOffset);
  const typename Traits::Merge merge{reinterpret_cast<float*>(smem + Traits::kLseOffset),
                                     reinterpret_cast<float*>(smem + Traits::kKvOffset)};

  const int tid = static_cast<int>(threadIdx.x);
  const int lane = tid % 32;
  const int warp = tid / 32;
  static_assert(kRows == 16, "TokenCta's row blocks are 16 heads");
  const TokenCta cta = TokenCta::locate(p);
  const int token = cta.token, kv_head = cta.kv_head, b = cta.b, group = cta.group, m0 = cta.m0;
  const int rows_here = cta.rows_here;
  const int head_chunks = p.head_dim / 8;
  const int block_size = p.block_size;

  // ---- Q: the group's heads of this token, zero rows past the group and columns past head_dim;
  // issued first, its copy overlaps the selection's resolution.
  copy_head_rows<QTile, kRows, Traits::kThreads>(
      sQ, static_cast<const Element*>(p.q) + b * p.q_batch_stride + token * p.q_row_stride + (kv_head * group + m0) * p.q_head_stride,
      p.q_head_stride, rows_here, head_chunks);

  const Selection selection =
      resolve_selection<Traits::kThreads>(p, b, token, kv_head, smem + Traits::kSelectionOffset);
  const int chunks = (selection.virtual_keys(block_size) + kBlockN - 1) / kBlockN;

  // ---- K/V copies of one chunk (nsa_copies.cuh).
  const SelectedKeyCopier<KvTile, Traits::kThreads, Element> copier(p, b, kv_head);
  auto load_kv = [&](int n, int stage) {
    const uint32_t sK = sKv + static_cast<uint32_t>(stage * Traits::kStageBytes);
    copier.copy(selection, n, block_size, p.seqlen_k, sK, sK + KvTile::kBytes);
  };

#pragma unroll
  for (int s = 0; s < kStages - 1; ++s) {
    if (s < chunks) load_kv(s, s);
    sm80::cp_async_commit();  // Q travels with the first group
  }

  constexpr float kLog2e = 1.4426950408889634f;
  const float log2_scale = p.softmax_scale * kLog2e;
  const typename QTile::LaneAddresses q_addr(sQ, lane % 16, lane / 16);
  const typename KvTile::LaneAddresses k_addr(sKv, lane % 8 + (lane / 16) * 8, (lane / 8) % 2);
  const typename KvTile::LaneAddresses v_addr(sKv + KvTile::kBytes, lane % 16, lane / 16);

  float acc_o[1][Traits::kDTiles][4];
  sm80::zero_accumulators(acc_o);
  sm80::OnlineSoftmax<1, 2, Traits::kDTiles> softmax;
  softmax.init();

  for (int n = 0; n < chunks; ++n) {
    sm80::cp_async_wait<kStages - 2>();
    __syncthreads();
    if (n + kStages - 1 < chunks) load_kv(n + kStages - 1, (n + kStages - 1) % kStages);
    sm80::cp_async_commit();
    const uint32_t stage_offset = static_cast<uint32_t>((n % kStages) * Traits::kStageBytes);
    const int slice_key = selection.slice_key(n * kBlockN + warp * 16, block_size);

    float acc_s[1][2][4];
    sm80::zero_accumulators(acc_s);
#pragma unroll
    for (int kk = 0; kk < Traits::kQkSteps; ++kk) {
      uint32_t a[1][4];
      sm80::ldmatrix_x4(a[0], q_addr.at(0, kk));
      uint32_t bk[4];
      sm80::ldmatrix_x4(bk, k_addr.at(warp * 16, kk) + stage_offset);
      sm80::mma_column_pair<Element>(acc_s, a, bk, 0);
    }
    // Every row is the same token, so one limit masks the slice: keys past last_key (the causal
    // limit or the sequence's end), or all 16 for a slice past the selection.
    if (slice_key < 0 || slice_key + 15 > selection.last_key) {
#pragma unroll
      for (int nt = 0; nt < 2; ++nt)
#pragma unroll
        for (int i = 0; i < 4; ++i) {
          const int key = slice_key + nt * 8 + (lane % 4) * 2 + i % 2;
          if (slice_key < 0 || key > selection.last_key) acc_s[0][nt][i] = -INFINITY;
        }
    }
    softmax.update(acc_s, acc_o, log2_scale);

    uint32_t a[1][4];
    sm80::pack_scores_as_a<Element>(acc_s, a[0]);
#pragma unroll
    for (int dp = 0; dp < Traits::kDTiles / 2; ++dp) {
      uint32_t bv[4];
      sm80::ldmatrix_x4_trans(bv, v_addr.at(warp * 16, dp) + stage_offset);
      sm80::mma_column_pair<Element>(acc_o, a, bv, dp);
    }
  }
  sm80::cp_async_wait<0>();

  // ---- Merge the warps' partial results; store the group's rows and their lse.
  float lse[2];
  softmax.finalize(acc_o, log2_scale, lse);
  merge.publish_lse(lse, warp, lane);  // every warp is past its last K/V read: the stages become the buffer
  merge.publish_output(acc_o, lse, warp, lane);
#pragma unroll
  for (int i = 0; i < kRows * kHeadDim / 4 / Traits::kThreads; ++i) {
    const int item = tid + i * Traits::kThreads;
    const int row = item / (kHeadDim / 4);
    const int col = (item % (kHeadDim / 4)) * 4;
    if (row >= rows_here || col >= p.head_dim) continue;
    const float4 sum = merge.row_sum(row, col);
    const int head = kv_head * group + m0 + row;
    Element* out = static_cast<Element*>(p.out) + b * p.out_batch_stride + token * p.out_row_stride +
                   head * p.out_head_stride + col;
    *reinterpret_cast<uint2*>(out) =
        make_uint2(sm80::pack2<Element>(sum.x, sum.y), sm80::pack2<Element>(sum.z, sum.w));
    if (col == 0) p.lse[b * p.lse_batch_stride + head * p.lse_head_stride + token] = merge.total_lse(row);
  }
}

}  // namespace flashkit::nsa
