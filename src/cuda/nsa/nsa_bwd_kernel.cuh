// src/cuda/nsa/nsa_bwd_kernel.cuh
// \brief The backward kernels of native sparse attention's selection branch (mma.sync).
//
// The gradients split by owner. dq belongs to a query token, so a CTA per (sequence, token, kv
// head, 16 heads of the group) computes it with the forward's layout: four warps splitting each
// chunk of 64 selected keys into 16-key slices, recomputing P from the saved lse and, with
// D = dot(dout, out), dP = dO V^T, dS = P o (dP - D), dQ += dS K. dk and dv belong to a key, and
// every token that selected the key's block adds to them, so a second kernel runs per key block:
// the first kernel marks each (token, block) pair it resolves in a bitmap (a bit per token, a row
// per key block), and a CTA per (key block, 64 of its keys, segment of kDkvSegment tokens) walks
// the segment's set bits in token order with its K and V resident in shared memory:
//   S^T = K Q^T, P^T, dP^T = V dO^T, dS^T = P^T o (dP^T - D),  dV += P^T dO,  dK += dS^T Q
// (the transposed products need no transposed operand: P^T and dS^T come out of the mma in the A
// operand's layout). Each segment adds its sums into fp32 accumulators with one 16-byte reduction
// per four columns; a last pass converts them to dk, dv.
//
//   nsa_bwd_dot_kernel      D = dot(dout, out) per query row, into the workspace
//   nsa_bwd_dq_kernel       dq; the selection bitmap
//   nsa_bwd_dkv_kernel      dk, dv sums per (key block, token segment) into the workspace
//   nsa_bwd_convert_kernel  the accumulators -> dk, dv
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>

#include "common/nsa_problem.h"
#include "cuda/common/mma_sm80.cuh"
#include "cuda/common/swizzled_tile.cuh"
#include "cuda/common/warp_merge.cuh"
#include "cuda/nsa/nsa_cuda.h"
#include "cuda/nsa/nsa_copies.cuh"
#include "cuda/nsa/nsa_selection.cuh"

namespace flashkit::nsa {

// D[b, h, i] = dot(dout[b, i, h], out[b, i, h]) in fp32: one warp per query row.
template <typename Element>
__global__ void nsa_bwd_dot_kernel(const __grid_constant__ NsaBwdProblem p) {
  const NsaProblem& f = p.fwd;
  const int64_t rows = static_cast<int64_t>(f.batch) * f.heads_q * f.seqlen_q;
  const int64_t row = static_cast<int64_t>(blockIdx.x) * (blockDim.x / 32) + threadIdx.x / 32;
  if (row >= rows) return;
  const int lane = static_cast<int>(threadIdx.x) % 32;
  const int token = static_cast<int>(row % f.seqlen_q);
  const int head = static_cast<int>(row / f.seqlen_q % f.heads_q);
  const int b = static_cast<int>(row / f.seqlen_q / f.heads_q);
  const auto* out = static_cast<const Element*>(f.out) + b * f.out_batch_stride + token * f.out_row_stride +
                    head * f.out_head_stride;
  const auto* dout = static_cast<const Element*>(p.dout) + b * p.dout_batch_stride + token * p.dout_row_stride +
                     head * p.dout_head_stride;
  float sum = 0.0f;
  for (int c = lane; c < f.head_dim; c += 32) sum += static_cast<float>(out[c]) * static_cast<float>(dout[c]);
#pragma unroll
  for (int offset = 16; offset > 0; offset /= 2) sum += __shfl_xor_sync(0xffffffffu, sum, offset);
  float* delta = reinterpret_cast<float*>(static_cast<char*>(p.workspace) + nsa_bwd_workspace_layout(f).delta_offset);
  if (lane == 0) delta[row] = sum;
}

// dk, dv from the fp32 accumulators [batch, seqlen_k, heads_kv, head_dim]: one thread per element.
template <typename Element>
__global__ void nsa_bwd_convert_kernel(const __grid_constant__ NsaBwdProblem p) {
  const NsaProblem& f = p.fwd;
  const int64_t elements = static_cast<int64_t>(f.batch) * f.seqlen_k * f.heads_kv * f.head_dim;
  const int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= elements) return;
  const int col = static_cast<int>(i % f.head_dim);
  const int kv_head = static_cast<int>(i / f.head_dim % f.heads_kv);
  const int64_t key_row = i / f.head_dim / f.heads_kv;  // b * seqlen_k + key
  const int key = static_cast<int>(key_row % f.seqlen_k);
  const int b = static_cast<int>(key_row / f.seqlen_k);
  const NsaBwdWorkspaceLayout layout = nsa_bwd_workspace_layout(f);
  const auto* dk_accum = static_cast<const float*>(p.workspace);
  const auto* dv_accum = reinterpret_cast<const float*>(static_cast<const char*>(p.workspace) + layout.dv_offset);
  static_cast<Element*>(p.dk)[b * p.dk_batch_stride + key * p.dk_row_stride + kv_head * p.dk_head_stride + col] =
      static_cast<Element>(dk_accum[i]);
  static_cast<Element*>(p.dv)[b * p.dv_batch_stride + key * p.dv_row_stride + kv_head * p.dv_head_stride + col] =
      static_cast<Element>(dv_accum[i]);
}

template <typename Element_, int kHeadDim_>
struct NsaBwdTraits {
  using Element = Element_;
  static constexpr int kHeadDim = kHeadDim_;
  static constexpr int kRows = 16;
  static constexpr int kBlockN = 64;
  static constexpr int kWarps = 4;
  static constexpr int kThreads = kWarps * 32;
  static constexpr int kStages = 2;
  static constexpr int kQkSteps = kHeadDim / 16;
  static constexpr int kDTiles = kHeadDim / 8;
  static constexpr int kChunks = kHeadDim / 8;

  using RowTile = sm80::SwizzledTile<kRows, kHeadDim>;  // Q and dO
  using KvTile = sm80::SwizzledTile<kBlockN, kHeadDim>;
  using Merge = sm80::WarpMerge<kWarps, kHeadDim>;

  // dq kernel: [ Q | dO | stages: K, V | lse, D of the rows | selection ]. After the loop the
  // stages hold the dQ merge buffer.
  static constexpr int kQOffset = 0;
  static constexpr int kDoOffset = kQOffset + RowTile::kBytes;
  static constexpr int kKvOffset = kDoOffset + RowTile::kBytes;
  static constexpr int kStageBytes = 2 * KvTile::kBytes;
  static constexpr int kRowStatsOffset = kKvOffset + kStages * kStageBytes;
  static constexpr int kSelectionOffset = kRowStatsOffset + 2 * kRows * 4;
  static constexpr int kSmemBytes = kSelectionOffset + kSelectionSmemBytes;

  // dkv kernel: [ K, V of the CTA's 64 keys | token stages: Q, dO, lse, D ]. Its warps hold dK and
  // dV of 16 keys in registers for kDkvCols columns at a time (all of them up to D 128; D 256
  // walks its tokens twice, once per half).
  static constexpr int kDkvCols = kHeadDim < 128 ? kHeadDim : 128;
  static constexpr int kDkvColTiles = kDkvCols / 8;
  static constexpr int kTokenStageBytes = 2 * RowTile::kBytes + 2 * kRows * 4;
  static constexpr int kDkvTokenOffset = 2 * KvTile::kBytes;
  static constexpr int kDkvSmemBytes = kDkvTokenOffset + kStages * kTokenStageBytes;

  static constexpr int kRowsPerPass = kThreads / kChunks;
  static constexpr int kLoadPasses = kBlockN / kRowsPerPass;
  static_assert(kBlockN == kWarps * 16, "each warp owns one 16-key slice of a chunk");
  static_assert(Merge::kMergeBytes <= kStages * kStageBytes, "the merge buffer reuses the K/V stages");
};

// One 8-column accumulator tile of a lane pair (2c, 2c + 1), rows g and g + 8, regrouped: the even
// lane returns row g's columns 4c' .. 4c' + 3 (c' = c / 2), the odd lane row g + 8's.
__device__ __forceinline__ float4 pair_rows_to_columns(const float (&acc)[4], bool odd) {
  // The even lane gives away its row g + 8 pair, the odd lane its row g pair.
  const float give0 = odd ? acc[0] : acc[2];
  const float give1 = odd ? acc[1] : acc[3];
  const float got0 = __shfl_xor_sync(0xffffffffu, give0, 1);
  const float got1 = __shfl_xor_sync(0xffffffffu, give1, 1);
  return odd ? make_float4(got0, got1, acc[2], acc[3]) : make_float4(acc[0], acc[1], got0, got1);
}

// A 16-byte atomic add into global memory (one vector reduction on sm_90, four elsewhere).
__device__ __forceinline__ void add_float4(float* address, float4 value) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  atomicAdd(reinterpret_cast<float4*>(address), value);
#else
  atomicAdd(address, value.x);
  atomicAdd(address + 1, value.y);
  atomicAdd(address + 2, value.z);
  atomicAdd(address + 3, value.w);
#endif
}

template <typename Traits>
__global__ void __launch_bounds__(Traits::kThreads) nsa_bwd_dq_kernel(const __grid_constant__ NsaBwdProblem bp) {
  using Element = typename Traits::Element;
  using RowTile = typename Traits::RowTile;
  using KvTile = typename Traits::KvTile;
  constexpr int kRows = Traits::kRows;
  constexpr int kBlockN = Traits::kBlockN;
  constexpr int kHeadDim = Traits::kHeadDim;
  constexpr int kStages = Traits::kStages;
  const NsaProblem& p = bp.fwd;

  extern __shared__ __align__(128) unsigned char smem[];
  const uint32_t sQ = sm80::smem_address(smem + Traits::kQOffset);
  const uint32_t sDo = sm80::smem_address(smem + Traits::kDoOffset);
  const uint32_t sKv = sm80::smem_address(smem + Traits::kKvOffset);
  float* row_lse = reinterpret_cast<float*>(smem + Traits::kRowStatsOffset);  // log2 units
  float* row_delta = row_lse + kRows;

  const int tid = static_cast<int>(threadIdx.x);
  const int lane = tid % 32;
  const int warp = tid / 32;
  static_assert(kRows == 16, "TokenCta's row blocks are 16 heads");
  const TokenCta cta = TokenCta::locate(p);
  const int token = cta.token, kv_head = cta.kv_head, b = cta.b, group = cta.group, m0 = cta.m0;
  const int rows_here = cta.rows_here;
  const int head_chunks = p.head_dim / 8;
  const int block_size = p.block_size;

  const NsaBwdWorkspaceLayout layout = nsa_bwd_workspace_layout(p);
  const float* delta = reinterpret_cast<const float*>(static_cast<const char*>(bp.workspace) + layout.delta_offset);

  // Row statistics: lse in log2 units (+inf for a row that saw no key, so that its P is 0) and D.
  constexpr float kLog2e = 1.4426950408889634f;
  if (tid < kRows) {
    const int head = kv_head * group + m0 + min(tid, rows_here - 1);
    const float lse = p.lse[b * p.lse_batch_stride + head * p.lse_head_stride + token];
    row_lse[tid] = lse == -INFINITY ? INFINITY : lse * kLog2e;
    row_delta[tid] = delta[(static_cast<int64_t>(b) * p.heads_q + head) * p.seqlen_q + token];
  }
  const Selection selection =
      resolve_selection<Traits::kThreads>(p, b, token, kv_head, smem + Traits::kSelectionOffset);
  const int chunks = (selection.virtual_keys(block_size) + kBlockN - 1) / kBlockN;
  // The token's blocks, for the dk / dv kernel (one row block marks them for all).
  if (m0 == 0) {
    uint32_t* bitmap = reinterpret_cast<uint32_t*>(static_cast<char*>(bp.workspace) + layout.bitmap_offset);
    const int64_t words = nsa_bitmap_words(p);
    for (int s = tid; s < selection.count; s += Traits::kThreads) {
      const int64_t row = (static_cast<int64_t>(b) * p.heads_kv + kv_head) * p.num_key_blocks + selection.blocks[s];
      atomicOr(bitmap + row * words + token / 32, 1u << (token % 32));
    }
  }

  // ---- Q and dO of the group's heads; K/V chunks as the forward copies them.
  {
    const int64_t row = static_cast<int64_t>(b) * p.q_batch_stride + token * p.q_row_stride;
    copy_head_rows<RowTile, kRows, Traits::kThreads>(
        sQ, static_cast<const Element*>(p.q) + row + (kv_head * group + m0) * p.q_head_stride, p.q_head_stride,
        rows_here, head_chunks);
    copy_head_rows<RowTile, kRows, Traits::kThreads>(
        sDo,
        static_cast<const Element*>(bp.dout) + b * bp.dout_batch_stride + token * bp.dout_row_stride +
            (kv_head * group + m0) * bp.dout_head_stride,
        bp.dout_head_stride, rows_here, head_chunks);
  }
  const SelectedKeyCopier<KvTile, Traits::kThreads, Element> copier(p, b, kv_head);
  auto load_kv = [&](int n, int stage) {
    const uint32_t sK = sKv + static_cast<uint32_t>(stage * Traits::kStageBytes);
    copier.copy(selection, n, block_size, p.seqlen_k, sK, sK + KvTile::kBytes);
  };
#pragma unroll
  for (int s = 0; s < kStages - 1; ++s) {
    if (s < chunks) load_kv(s, s);
    sm80::cp_async_commit();
  }

  const float log2_scale = p.softmax_scale * kLog2e;
  const typename RowTile::LaneAddresses q_addr(sQ, lane % 16, lane / 16);
  const typename RowTile::LaneAddresses do_addr(sDo, lane % 16, lane / 16);
  // K and V slices as B operands with keys along n (S, dP) and with keys along k (dQ).
  const typename KvTile::LaneAddresses k_addr(sKv, lane % 8 + (lane / 16) * 8, (lane / 8) % 2);
  const typename KvTile::LaneAddresses v_addr(sKv + KvTile::kBytes, lane % 8 + (lane / 16) * 8, (lane / 8) % 2);
  const typename KvTile::LaneAddresses k_trans_addr(sKv, lane % 16, lane / 16);

  float acc_dq[1][Traits::kDTiles][4];
  sm80::zero_accumulators(acc_dq);

  for (int n = 0; n < chunks; ++n) {
    sm80::cp_async_wait<kStages - 2>();
    __syncthreads();
    if (n + kStages - 1 < chunks) load_kv(n + kStages - 1, (n + kStages - 1) % kStages);
    sm80::cp_async_commit();
    const uint32_t stage_offset = static_cast<uint32_t>((n % kStages) * Traits::kStageBytes);
    const int slice_key = selection.slice_key(n * kBlockN + warp * 16, block_size);
    if (slice_key < 0) continue;  // past the selection: nothing to add (the warp's barrier is at the top)

    // S = Q K^T and dP = dO V^T on the slice.
    float acc_s[1][2][4];
    float acc_dp[1][2][4];
    sm80::zero_accumulators(acc_s);
    sm80::zero_accumulators(acc_dp);
#pragma unroll
    for (int kk = 0; kk < Traits::kQkSteps; ++kk) {
      uint32_t a[1][4];
      uint32_t bk[4];
      sm80::ldmatrix_x4(a[0], q_addr.at(0, kk));
      sm80::ldmatrix_x4(bk, k_addr.at(warp * 16, kk) + stage_offset);
      sm80::mma_column_pair<Element>(acc_s, a, bk, 0);
      sm80::ldmatrix_x4(a[0], do_addr.at(0, kk));
      sm80::ldmatrix_x4(bk, v_addr.at(warp * 16, kk) + stage_offset);
      sm80::mma_column_pair<Element>(acc_dp, a, bk, 0);
    }
    // P from the saved lse (0 for masked keys), dS = P (dP - D).
#pragma unroll
    for (int nt = 0; nt < 2; ++nt)
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        const int row = lane / 4 + 8 * (i / 2);
        const int key = slice_key + nt * 8 + (lane % 4) * 2 + i % 2;
        const float prob = key > selection.last_key ? 0.0f : exp2f(acc_s[0][nt][i] * log2_scale - row_lse[row]);
        acc_s[0][nt][i] = prob;
        acc_dp[0][nt][i] = prob * (acc_dp[0][nt][i] - row_delta[row]);
      }
    uint32_t ds_a[4];
    sm80::pack_scores_as_a<Element>(acc_dp, ds_a);

    // dQ += dS K (keys along k: the K slice read transposed, as V in P V).
    {
      const uint32_t a[1][4] = {{ds_a[0], ds_a[1], ds_a[2], ds_a[3]}};
#pragma unroll
      for (int dp = 0; dp < Traits::kDTiles / 2; ++dp) {
        uint32_t bk[4];
        sm80::ldmatrix_x4_trans(bk, k_trans_addr.at(warp * 16, dp) + stage_offset);
        sm80::mma_column_pair<Element>(acc_dq, a, bk, dp);
      }
    }

  }
  sm80::cp_async_wait<0>();

  // ---- dQ: the warps' partial sums added through shared memory, scaled and stored.
  const typename Traits::Merge merge{nullptr, reinterpret_cast<float*>(smem + Traits::kKvOffset)};
  __syncthreads();  // every warp is past its last K/V read: the stages become the buffer
  merge.publish_sum(acc_dq, warp, lane);
#pragma unroll
  for (int i = 0; i < kRows * kHeadDim / 4 / Traits::kThreads; ++i) {
    const int item = tid + i * Traits::kThreads;
    const int row = item / (kHeadDim / 4);
    const int col = (item % (kHeadDim / 4)) * 4;
    if (row >= rows_here || col >= p.head_dim) continue;
    const float4 sum = merge.row_sum(row, col);
    const float scale = p.softmax_scale;
    const int head = kv_head * group + m0 + row;
    Element* dq = static_cast<Element*>(bp.dq) + b * bp.dq_batch_stride + token * bp.dq_row_stride +
                  head * bp.dq_head_stride + col;
    *reinterpret_cast<uint2*>(dq) = make_uint2(sm80::pack2<Element>(sum.x * scale, sum.y * scale),
                                               sm80::pack2<Element>(sum.z * scale, sum.w * scale));
  }
}

// A 4-byte asynchronous copy global -> shared, zero-filled when `valid` is false (the row
// statistics of a token's heads, which are not contiguous).
__device__ __forceinline__ void cp_async_4(uint32_t smem_addr, const void* gmem, bool valid) {
  asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;\n" ::"r"(smem_addr), "l"(gmem), "r"(valid ? 4 : 0));
}

// The tokens of one bitmap row segment, in increasing order; every thread of a CTA walks the same
// words and so gets the same sequence.
struct TokenWalk {
  const uint32_t* words;  // the block's bitmap row
  int word;               // the word `bits` came from
  int end_word;
  uint32_t bits;          // its bits not returned yet

  __device__ __forceinline__ TokenWalk(const uint32_t* row, int first_word, int last_word)
      : words(row), word(first_word), end_word(last_word), bits(first_word < last_word ? row[first_word] : 0u) {}

  // The next token, or -1.
  __device__ __forceinline__ int next() {
    while (bits == 0) {
      if (++word >= end_word) return -1;
      bits = words[word];
    }
    const int bit = __ffs(static_cast<int>(bits)) - 1;
    bits &= bits - 1;
    return word * 32 + bit;
  }
};

// dK and dV of 64 keys of one block (a 16-key slice per warp) over the tokens of one segment that
// selected the block: grid x = (block, 64-key part, segment), y = kv head, z = sequence.
template <typename Traits>
__global__ void __launch_bounds__(Traits::kThreads) nsa_bwd_dkv_kernel(const __grid_constant__ NsaBwdProblem bp) {
  using Element = typename Traits::Element;
  using RowTile = typename Traits::RowTile;
  using KvTile = typename Traits::KvTile;
  constexpr int kRows = Traits::kRows;
  constexpr int kHeadDim = Traits::kHeadDim;
  constexpr int kCols = Traits::kDkvCols;
  constexpr int kColTiles = Traits::kDkvColTiles;
  constexpr float kLog2e = 1.4426950408889634f;
  const NsaProblem& p = bp.fwd;

  extern __shared__ __align__(128) unsigned char smem[];
  const uint32_t sK = sm80::smem_address(smem);
  const uint32_t sV = sK + KvTile::kBytes;
  const uint32_t sTokens = sm80::smem_address(smem + Traits::kDkvTokenOffset);

  const int tid = static_cast<int>(threadIdx.x);
  const int lane = tid % 32;
  const int warp = tid / 32;
  const int parts = (p.block_size + 63) / 64;
  const int segments = (p.seqlen_q + kDkvSegment - 1) / kDkvSegment;
  const int segment = static_cast<int>(blockIdx.x % segments);
  const int part = static_cast<int>(blockIdx.x / segments % parts);
  const int block = static_cast<int>(blockIdx.x / segments / parts);
  const int kv_head = static_cast<int>(blockIdx.y);
  const int b = static_cast<int>(blockIdx.z);
  const int key0 = block * p.block_size + part * 64;
  const int keys_here = min(min(64, p.block_size - part * 64), p.seqlen_k - key0);
  if (keys_here <= 0) return;
  const int group = p.heads_q / p.heads_kv;
  const int head_chunks = p.head_dim / 8;

  const NsaBwdWorkspaceLayout layout = nsa_bwd_workspace_layout(p);
  const int64_t words = nsa_bitmap_words(p);
  const auto* bitmap_row = reinterpret_cast<const uint32_t*>(static_cast<const char*>(bp.workspace) +
                                                             layout.bitmap_offset) +
                           ((static_cast<int64_t>(b) * p.heads_kv + kv_head) * p.num_key_blocks + block) * words;
  const int first_word = segment * (kDkvSegment / 32);
  const int last_word = static_cast<int>(words < first_word + kDkvSegment / 32 ? words : first_word + kDkvSegment / 32);
  if (TokenWalk(bitmap_row, first_word, last_word).next() < 0) return;  // no token of the segment selected it
  const float* delta = reinterpret_cast<const float*>(static_cast<const char*>(bp.workspace) + layout.delta_offset);
  float* dk_accum = static_cast<float*>(bp.workspace);
  float* dv_accum = reinterpret_cast<float*>(static_cast<char*>(bp.workspace) + layout.dv_offset);

  // ---- K and V of the CTA's keys, resident for the whole walk (zero rows past keys_here).
  {
    const int kv_chunk = tid % Traits::kChunks;
    const int first_row = tid / Traits::kChunks;
    const bool chunk_valid = kv_chunk < head_chunks;
    const auto* k_base = static_cast<const Element*>(p.k) + b * p.k_batch_stride + kv_head * p.k_head_stride +
                         (chunk_valid ? kv_chunk : 0) * 8;
    const auto* v_base = static_cast<const Element*>(p.v) + b * p.v_batch_stride + kv_head * p.v_head_stride +
                         (chunk_valid ? kv_chunk : 0) * 8;
#pragma unroll
    for (int i = 0; i < Traits::kLoadPasses; ++i) {
      const int row = first_row + i * Traits::kRowsPerPass;
      const bool valid = chunk_valid && row < keys_here;
      const int64_t key = key0 + (valid ? row : 0);
      const uint32_t dst = KvTile::chunk_offset(row, kv_chunk);
      sm80::cp_async_16(sK + dst, k_base + key * p.k_row_stride, valid);
      sm80::cp_async_16(sV + dst, v_base + key * p.v_row_stride, valid);
    }
    sm80::cp_async_commit();
  }

  // One work item: the 16 heads m0 .. m0 + 15 of a token's group. Stage layout: [ Q | dO | lse | D ].
  auto load_item = [&](int token, int m0, int stage) {
    const uint32_t base = sTokens + static_cast<uint32_t>(stage * Traits::kTokenStageBytes);
    const int rows_here = min(kRows, group - m0);
    copy_head_rows<RowTile, kRows, Traits::kThreads>(
        base,
        static_cast<const Element*>(p.q) + b * p.q_batch_stride + token * p.q_row_stride +
            (kv_head * group + m0) * p.q_head_stride,
        p.q_head_stride, rows_here, head_chunks);
    copy_head_rows<RowTile, kRows, Traits::kThreads>(
        base + RowTile::kBytes,
        static_cast<const Element*>(bp.dout) + b * bp.dout_batch_stride + token * bp.dout_row_stride +
            (kv_head * group + m0) * bp.dout_head_stride,
        bp.dout_head_stride, rows_here, head_chunks);
    if (tid < kRows) {
      // Padding rows get lse = D = 0 with zero Q and dO: their P is 1 but adds nothing.
      const bool valid = tid < rows_here;
      const int head = kv_head * group + m0 + (valid ? tid : 0);
      const uint32_t stats = base + 2 * RowTile::kBytes;
      cp_async_4(stats + tid * 4, p.lse + b * p.lse_batch_stride + head * p.lse_head_stride + token, valid);
      cp_async_4(stats + (kRows + tid) * 4, delta + (static_cast<int64_t>(b) * p.heads_q + head) * p.seqlen_q + token,
                 valid);
    }
  };

  const float log2_scale = p.softmax_scale * kLog2e;
  // K and V slices as A operands (keys along m); Q and dO as B operands with heads along n (S^T,
  // dP^T) and, read transposed, with heads along k (dK, dV).
  const typename KvTile::LaneAddresses k_addr(sK, lane % 16, lane / 16);
  const typename KvTile::LaneAddresses v_addr(sV, lane % 16, lane / 16);
  const typename RowTile::LaneAddresses q_addr(sTokens, lane % 8 + (lane / 16) * 8, (lane / 8) % 2);
  const typename RowTile::LaneAddresses do_addr(sTokens + RowTile::kBytes, lane % 8 + (lane / 16) * 8,
                                                (lane / 8) % 2);
  const typename RowTile::LaneAddresses q_trans_addr(sTokens, lane % 16, lane / 16);
  const typename RowTile::LaneAddresses do_trans_addr(sTokens + RowTile::kBytes, lane % 16, lane / 16);
  const float* stats_smem = reinterpret_cast<const float*>(smem + Traits::kDkvTokenOffset + 2 * RowTile::kBytes);
  // The lane's accumulator rows: keys key_lo and key_lo + 8 of the CTA.
  const int key_lo = warp * 16 + lane / 4;

  for (int c0 = 0; c0 < kHeadDim; c0 += kCols) {
    float acc_dk[1][kColTiles][4], acc_dv[1][kColTiles][4];
    sm80::zero_accumulators(acc_dk);
    sm80::zero_accumulators(acc_dv);
    TokenWalk walk(bitmap_row, first_word, last_word);
    int token = walk.next(), m0 = 0;
    load_item(token, m0, 0);
    sm80::cp_async_commit();
    for (int stage = 0; token >= 0; stage ^= 1) {
      // The next item's copies go out before this one's products.
      int next_token = token, next_m0 = m0 + kRows;
      if (next_m0 >= group) {
        next_token = walk.next();
        next_m0 = 0;
      }
      if (next_token >= 0) load_item(next_token, next_m0, stage ^ 1);
      sm80::cp_async_commit();
      sm80::cp_async_wait<1>();
      __syncthreads();

      const uint32_t stage_offset = static_cast<uint32_t>(stage * Traits::kTokenStageBytes);
      const float* lse = stats_smem + stage * (Traits::kTokenStageBytes / 4);
      const float* row_delta = lse + kRows;
      float acc_s[1][2][4], acc_dp[1][2][4];
      sm80::zero_accumulators(acc_s);
      sm80::zero_accumulators(acc_dp);
#pragma unroll
      for (int kk = 0; kk < Traits::kQkSteps; ++kk) {
        uint32_t a[1][4], bq[4];
        sm80::ldmatrix_x4(a[0], k_addr.at(warp * 16, kk));
        sm80::ldmatrix_x4(bq, q_addr.at(0, kk) + stage_offset);
        sm80::mma_column_pair<Element>(acc_s, a, bq, 0);
        sm80::ldmatrix_x4(a[0], v_addr.at(warp * 16, kk));
        sm80::ldmatrix_x4(bq, do_addr.at(0, kk) + stage_offset);
        sm80::mma_column_pair<Element>(acc_dp, a, bq, 0);
      }
      // P^T from the saved lse, 0 for keys past the block's end or the token's causal limit;
      // dS^T = P^T (dP^T - D).
      const int last_key = p.last_visible_key(token);
#pragma unroll
      for (int nt = 0; nt < 2; ++nt)
#pragma unroll
        for (int i = 0; i < 4; ++i) {
          const int row = nt * 8 + (lane % 4) * 2 + i % 2;
          const int key = key_lo + 8 * (i / 2);
          const bool visible = key < keys_here && key0 + key <= last_key;
          const float prob = visible ? exp2f(acc_s[0][nt][i] * log2_scale - lse[row] * kLog2e) : 0.0f;
          acc_s[0][nt][i] = prob;
          acc_dp[0][nt][i] = prob * (acc_dp[0][nt][i] - row_delta[row]);
        }
      uint32_t pt[1][4], dst[1][4];
      sm80::pack_scores_as_a<Element>(acc_s, pt[0]);
      sm80::pack_scores_as_a<Element>(acc_dp, dst[0]);
#pragma unroll
      for (int dp = 0; dp < kColTiles / 2; ++dp) {
        uint32_t bt[4];
        sm80::ldmatrix_x4_trans(bt, do_trans_addr.at(0, c0 / 16 + dp) + stage_offset);
        sm80::mma_column_pair<Element>(acc_dv, pt, bt, dp);
        sm80::ldmatrix_x4_trans(bt, q_trans_addr.at(0, c0 / 16 + dp) + stage_offset);
        sm80::mma_column_pair<Element>(acc_dk, dst, bt, dp);
      }
      __syncthreads();  // every warp is done with this stage before the next item's copies reuse it
      token = next_token;
      m0 = next_m0;
    }

    // ---- The segment's sums into the accumulators: four columns per lane and tile (see
    // pair_rows_to_columns), rows of real keys, columns below head_dim.
    const bool odd = lane % 2 != 0;
    const int key = key_lo + (odd ? 8 : 0);
    const int64_t accum_row = ((static_cast<int64_t>(b) * p.seqlen_k + key0 + key) * p.heads_kv + kv_head) * p.head_dim +
                              ((lane % 4) / 2) * 4;
#pragma unroll
    for (int dt = 0; dt < kColTiles; ++dt) {
      const float4 dv4 = pair_rows_to_columns(acc_dv[0][dt], odd);
      const float4 dk4 = pair_rows_to_columns(acc_dk[0][dt], odd);
      const int col = c0 + dt * 8 + ((lane % 4) / 2) * 4;
      if (key >= keys_here || col >= p.head_dim) continue;
      add_float4(dv_accum + accum_row + c0 + dt * 8, dv4);
      add_float4(dk_accum + accum_row + c0 + dt * 8, make_float4(dk4.x * p.softmax_scale, dk4.y * p.softmax_scale,
                                                                 dk4.z * p.softmax_scale, dk4.w * p.softmax_scale));
    }
  }
}

}  // namespace flashkit::nsa
