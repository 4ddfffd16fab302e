// src/cuda/nsa/nsa_bwd_kernel.cuh
// \brief The backward kernels of native sparse attention's selection branch (mma.sync).
//
// The forward's CTA layout again: one CTA per (sequence, token, kv head), the group's query heads
// as 16 rows, four warps splitting each chunk of 64 selected keys into 16-key slices. Per slice a
// warp recomputes P from the saved lse and, with D = dot(dout, out):
//   dP = dO V^T,  dS = P o (dP - D)
//   dQ += dS K                     (registers; the warps' sums merged at the end, scaled, stored)
//   dV[keys] += P^T dO, dK[keys] += scale dS^T Q
// The key gradients of a slice belong to whichever tokens selected its block, so they are added
// into fp32 accumulators in the workspace with atomics and converted to the output dtype by a last
// pass. P^T and dS^T reach the mma's A operand through a 16 x 16 shared-memory tile per warp and
// ldmatrix.trans; each 8-column product goes to the accumulators as soon as it is computed, so
// nothing of size head_dim is held per slice.
//
//   nsa_bwd_dot_kernel      D = dot(dout, out) per query row, into the workspace
//   nsa_bwd_kernel          dq, and the key gradients added into the workspace
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
#include "cuda/nsa/nsa_selection.cuh"

namespace flashkit::nsa {

template <typename Element>
__device__ __forceinline__ float to_float(Element x) {
  if constexpr (sm80::MmaType<Element>::kIsBf16) {
    return __bfloat162float(x);
  } else {
    return __half2float(x);
  }
}

template <typename Element>
__device__ __forceinline__ Element from_float(float x) {
  if constexpr (sm80::MmaType<Element>::kIsBf16) {
    return __float2bfloat16_rn(x);
  } else {
    return __float2half_rn(x);
  }
}

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
  for (int c = lane; c < f.head_dim; c += 32) sum += to_float(out[c]) * to_float(dout[c]);
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
      from_float<Element>(dk_accum[i]);
  static_cast<Element*>(p.dv)[b * p.dv_batch_stride + key * p.dv_row_stride + kv_head * p.dv_head_stride + col] =
      from_float<Element>(dv_accum[i]);
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

  // Shared memory: [ Q | dO | stages: K, V | per-warp P and dS tiles (16 x 16 each) | lse, D of the
  // rows | selection ]. After the loop the stages hold the dQ merge buffer.
  static constexpr int kQOffset = 0;
  static constexpr int kDoOffset = kQOffset + RowTile::kBytes;
  static constexpr int kKvOffset = kDoOffset + RowTile::kBytes;
  static constexpr int kStageBytes = 2 * KvTile::kBytes;
  static constexpr int kTransposeOffset = kKvOffset + kStages * kStageBytes;
  static constexpr int kTransposeBytes = 16 * 16 * 2;
  static constexpr int kRowStatsOffset = kTransposeOffset + kWarps * 2 * kTransposeBytes;
  static constexpr int kSelectionOffset = kRowStatsOffset + 2 * kRows * 4;
  static constexpr int kSmemBytes = kSelectionOffset + kSelectionSmemBytes;

  static constexpr int kRowsPerPass = kThreads / kChunks;
  static constexpr int kLoadPasses = kBlockN / kRowsPerPass;
  static_assert(kBlockN == kWarps * 16, "each warp owns one 16-key slice of a chunk");
  static_assert(Merge::kMergeBytes <= kStages * kStageBytes, "the merge buffer reuses the K/V stages");
};

// A warp's 16 x 16 fragment (C layout: rows g, g + 8; columns 2 (lane % 4) + {0, 1, 8, 9}) packed
// into the A operand of the next product (P for P V).
template <typename Element>
__device__ __forceinline__ void pack_a(const float (&x)[1][2][4], uint32_t (&a)[4]) {
  a[0] = sm80::pack2<Element>(x[0][0][0], x[0][0][1]);
  a[1] = sm80::pack2<Element>(x[0][0][2], x[0][0][3]);
  a[2] = sm80::pack2<Element>(x[0][1][0], x[0][1][1]);
  a[3] = sm80::pack2<Element>(x[0][1][2], x[0][1][3]);
}

// The transpose of a packed 16 x 16 A fragment, through the warp's tile at `tile` (32-byte rows):
// stored as it is, read back with ldmatrix.trans, so rows become the product's k dimension.
__device__ __forceinline__ void transpose_a(const uint32_t (&a)[4], uint32_t tile, uint32_t (&at)[4]) {
  const int lane = static_cast<int>(threadIdx.x) % 32;
  const int g = lane / 4;
  const int c = lane % 4;
  // a[0]: (row g, cols 2c..), a[1]: (g + 8, 2c..), a[2]: (g, 2c + 8..), a[3]: (g + 8, 2c + 8..).
  auto store = [&](int row, int col, uint32_t value) {
    asm volatile("st.shared.b32 [%0], %1;\n" ::"r"(tile + static_cast<uint32_t>(row * 32 + col * 2)), "r"(value));
  };
  store(g, 2 * c, a[0]);
  store(g + 8, 2 * c, a[1]);
  store(g, 2 * c + 8, a[2]);
  store(g + 8, 2 * c + 8, a[3]);
  __syncwarp();
  // Matrix j of the transposed fragment: stored rows 8 (j / 2) .. + 7, columns 8 (j % 2) .. + 7.
  const int j = lane / 8;
  sm80::ldmatrix_x4_trans(at, tile + static_cast<uint32_t>(((j / 2) * 8 + lane % 8) * 32 + (j % 2) * 16));
  __syncwarp();
}

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
__global__ void __launch_bounds__(Traits::kThreads) nsa_bwd_kernel(const __grid_constant__ NsaBwdProblem bp) {
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
  const int group = p.heads_q / p.heads_kv;
  const int m_blocks = (group + kRows - 1) / kRows;
  const int token = static_cast<int>(blockIdx.x);
  const int kv_head = static_cast<int>(blockIdx.y) / m_blocks;
  const int m0 = (static_cast<int>(blockIdx.y) % m_blocks) * kRows;
  const int b = static_cast<int>(blockIdx.z);
  const int rows_here = min(kRows, group - m0);
  const int head_chunks = p.head_dim / 8;
  const int block_size = p.block_size;
  const uint32_t sP = sm80::smem_address(smem + Traits::kTransposeOffset) +
                      static_cast<uint32_t>(warp * 2 * Traits::kTransposeBytes);
  const uint32_t sDs = sP + Traits::kTransposeBytes;

  const NsaBwdWorkspaceLayout layout = nsa_bwd_workspace_layout(p);
  float* dk_accum = static_cast<float*>(bp.workspace);
  float* dv_accum = reinterpret_cast<float*>(static_cast<char*>(bp.workspace) + layout.dv_offset);
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

  // ---- Q and dO of the group's heads.
  {
    const auto* q = static_cast<const Element*>(p.q) + b * p.q_batch_stride + token * p.q_row_stride +
                    (kv_head * group + m0) * p.q_head_stride;
    const auto* dout = static_cast<const Element*>(bp.dout) + b * bp.dout_batch_stride + token * bp.dout_row_stride +
                       (kv_head * group + m0) * bp.dout_head_stride;
#pragma unroll
    for (int i = 0; i < kRows * Traits::kChunks / Traits::kThreads; ++i) {
      const int item = tid + i * Traits::kThreads;
      const int row = item / Traits::kChunks;
      const int chunk = item % Traits::kChunks;
      const bool valid = row < rows_here && chunk < head_chunks;
      const uint32_t dst = RowTile::chunk_offset(row, chunk);
      sm80::cp_async_16(sQ + dst, valid ? q + row * p.q_head_stride + chunk * 8 : q, valid);
      sm80::cp_async_16(sDo + dst, valid ? dout + row * bp.dout_head_stride + chunk * 8 : dout, valid);
    }
  }

  const int kv_chunk = tid % Traits::kChunks;
  const int first_row = tid / Traits::kChunks;
  const bool chunk_valid = kv_chunk < head_chunks;
  const int source_chunk = chunk_valid ? kv_chunk : 0;
  const auto* k_base = static_cast<const Element*>(p.k) + b * p.k_batch_stride + kv_head * p.k_head_stride +
                       source_chunk * 8;
  const auto* v_base = static_cast<const Element*>(p.v) + b * p.v_batch_stride + kv_head * p.v_head_stride +
                       source_chunk * 8;
  auto load_kv = [&](int n, int stage) {
    const uint32_t sK = sKv + static_cast<uint32_t>(stage * Traits::kStageBytes);
    const uint32_t sV = sK + KvTile::kBytes;
#pragma unroll
    for (int i = 0; i < Traits::kLoadPasses; ++i) {
      const int row = first_row + i * Traits::kRowsPerPass;
      const int slice_key = selection.slice_key(n * kBlockN + (row & ~15), block_size);
      const int key = slice_key + (row & 15);
      const bool valid = chunk_valid && slice_key >= 0 && key < p.seqlen_k;
      const uint32_t dst = KvTile::chunk_offset(row, kv_chunk);
      sm80::cp_async_16(sK + dst, valid ? k_base + key * p.k_row_stride : k_base, valid);
      sm80::cp_async_16(sV + dst, valid ? v_base + key * p.v_row_stride : v_base, valid);
    }
  };
#pragma unroll
  for (int s = 0; s < kStages - 1; ++s) {
    if (s < chunks) load_kv(s, s);
    sm80::cp_async_commit();
  }

  const float log2_scale = p.softmax_scale * kLog2e;
  // Q and dO serve as A operands (S, dP) and, read transposed, as B operands with rows along k
  // (dK, dV): ldmatrix takes the same lane addresses for both.
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
    uint32_t p_a[4], ds_a[4];
    pack_a<Element>(acc_s, p_a);
    pack_a<Element>(acc_dp, ds_a);

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

    // dV += P^T dO and dK += scale dS^T Q, 16 columns at a time, added into the accumulators.
    uint32_t pt[1][4], dst[1][4];
    transpose_a(p_a, sP, pt[0]);
    transpose_a(ds_a, sDs, dst[0]);
    // Each lane pair (2c, 2c + 1) trades halves so that the even lane holds row g's four columns
    // 4c' .. 4c' + 3 and the odd lane row g + 8's: one 16-byte add per lane, tensor and 8 columns.
    const bool odd = lane % 2 != 0;
    const int key = slice_key + lane / 4 + (odd ? 8 : 0);
    const int64_t row_stride = static_cast<int64_t>(p.heads_kv) * p.head_dim;
    const int64_t accum_row = (static_cast<int64_t>(b) * p.seqlen_k + key) * row_stride + kv_head * p.head_dim +
                              ((lane % 4) / 2) * 4;
    const bool key_valid = key <= selection.last_key;
#pragma unroll
    for (int dp = 0; dp < Traits::kDTiles / 2; ++dp) {
      float dv[1][2][4], dk[1][2][4];
      sm80::zero_accumulators(dv);
      sm80::zero_accumulators(dk);
      uint32_t bd[4], bq[4];
      sm80::ldmatrix_x4_trans(bd, do_addr.at(0, dp));
      sm80::mma_column_pair<Element>(dv, pt, bd, 0);
      sm80::ldmatrix_x4_trans(bq, q_addr.at(0, dp));
      sm80::mma_column_pair<Element>(dk, dst, bq, 0);
#pragma unroll
      for (int nt = 0; nt < 2; ++nt) {
        const float4 dv4 = pair_rows_to_columns(dv[0][nt], odd);
        const float4 dk4 = pair_rows_to_columns(dk[0][nt], odd);
        const int col = dp * 16 + nt * 8 + ((lane % 4) / 2) * 4;
        if (!key_valid || col >= p.head_dim) continue;
        const int64_t at = accum_row + dp * 16 + nt * 8;
        add_float4(dv_accum + at, dv4);
        add_float4(dk_accum + at, make_float4(dk4.x * p.softmax_scale, dk4.y * p.softmax_scale,
                                              dk4.z * p.softmax_scale, dk4.w * p.softmax_scale));
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

}  // namespace flashkit::nsa
