// src/cuda/sm80/decode_kernel.cuh
// \brief The split-KV decode kernel of mha_fwd_kvcache on mma.sync (Ampere, Ada, Hopper).
//
// Decoding reads the whole KV cache for a handful of query rows, so the kernel is built around the
// K/V stream, not around the math:
//   * GQA packing: a CTA owns 16 packed query rows of ONE kv head, row r = (token r / group, query
//     head kv_head * group + r % group). Every query head of a group (and every query token) shares
//     one read of its kv head; with seqlen_q * group <= 16 the cache is read exactly once.
//   * Split-KV: the CTA takes split `s` of the key blocks of its (sequence, kv head); partial
//     outputs and log-sum-exps go to the workspace in fp32 and decode_combine.cuh merges them.
//   * Warps split keys, not rows: each K/V block of 64 keys is cut into four 16-key slices, one
//     per warp, with its own online softmax; the four partial results merge through shared memory
//     at the end (weighted by exp(lse_warp - lse_total), like the splits).
//   * Paged or contiguous (an instance each): a paged cache's page is looked up per key (a shift
//     or division by page_block_size, then the page's block-table entry), so any page size works.
//     The CTA first copies its split's block-table entries into shared memory (up to
//     kDecodePageSlots; a longer split reads the table in global memory, prefetched into L2), and
//     the lookups of a block are issued one block before its copies (find_pages). K and V caches
//     of one layout share each row's byte offset. A contiguous cache needs no lookup: each thread
//     walks its rows with a running pointer. With one CTA (four warps) per SM the copy loop's
//     instruction count bounds the bandwidth, hence the lean address code.
//   * Pipeline depth: decode_stages(family, kWholeSm), see decode_sm80.h.
//
//   prologue   wait for the kernel before (PDL); Q's chunks loaded into registers; paged: the
//              split's pages staged in shared memory; cp.async K/V of the first kStages - 1
//              blocks of this split (paged: each block's lookups, then its copies), one commit
//              group each; then Q rotated (when rotary is on) and stored to shared memory
//   per block  wait until block n landed; barrier    (every warp is done with block n - 1's stage)
//              cp.async K/V of block n + kStages - 1 into block n - 1's stage; page lookups of
//              block n + kStages
//              S = Q K^T on this warp's 16 keys       (mma.sync m16n8k16, fp32)
//              scale / softcap / ALiBi / mask        (mask only on blocks the window or end cuts)
//              online softmax; O += P V               (P straight from registers)
//   epilogue   per-warp normalise, then the warps' results merged (warp_merge.cuh: weighted by
//              exp(lse_warp - lse_total)) and stored (16-bit out + lse, or fp32 partials for the
//              combine)
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>

#include "common/kvcache_problem.h"
#include "cuda/common/attention_mask.cuh"
#include "cuda/common/mma_sm80.cuh"
#include "cuda/common/online_softmax.cuh"
#include "cuda/common/programmatic_launch.cuh"
#include "cuda/common/swizzled_tile.cuh"
#include "cuda/common/warp_merge.cuh"
#include "cuda/sm80/decode_rotary.cuh"
#include "cuda/sm80/decode_sm80.h"

namespace flashkit::sm80 {

template <typename Element_, int kHeadDim_, bool kWholeSm_, bool kPaged_>
struct DecodeTraits {
  using Element = Element_;
  static constexpr int kHeadDim = kHeadDim_;
  static constexpr bool kWholeSm = kWholeSm_;
  // A paged cache (block_table) or a contiguous one: instances of their own, because the paged
  // path's lookups and block-table prefetch cost the contiguous loop ~1-5% in one kernel (H200,
  // bench/NOTES.md, session 12). Paged caches run the shared-SM pipeline only: on the whole-SM one
  // they read no faster at batch 1 and 2 (session 19, with the rolled prologue below; unrolled, its
  // cold instruction-cache lines had cost 3-15%).
  static constexpr bool kPaged = kPaged_;
  static_assert(!(kPaged && kWholeSm), "paged caches run the shared-SM pipeline (decode_launch_plan)");
  static constexpr int kRows = kDecodeRows;
  static constexpr int kBlockN = kDecodeBlockN;
  static constexpr int kWarps = kDecodeWarps;
  static constexpr int kThreads = kWarps * 32;
  static constexpr int kStages = decode_stages(kHeadDim, kWholeSm);
  static constexpr int kQkSteps = kHeadDim / 16;
  static constexpr int kDTiles = kHeadDim / 8;
  static constexpr int kChunks = kHeadDim / 8;  // 16-byte chunks per row

  using QTile = SwizzledTile<kRows, kHeadDim>;
  using KvTile = SwizzledTile<kBlockN, kHeadDim>;
  using Merge = WarpMerge<kWarps, kHeadDim>;

  // Shared-memory plan: [ Q | stage 0: K, V | stage 1: K, V | ... | per-warp lse ]. After the main
  // loop the stages hold the merge buffer: [warp][row][head_dim] fp32.
  static constexpr int kQOffset = 0;
  static constexpr int kKvOffset = kQOffset + QTile::kBytes;
  static constexpr int kStageBytes = 2 * KvTile::kBytes;
  static constexpr int kLseOffset = kKvOffset + kStages * kStageBytes;
  static constexpr int kPageOffset = kLseOffset + Merge::kLseBytes;  // paged: the split's pages
  static constexpr int kSmemBytes = kPageOffset + (kPaged ? kDecodePageSlots * 4 : 0);

  // K/V loads: a thread keeps one chunk column and walks rows kRowsPerPass apart.
  static constexpr int kRowsPerPass = kThreads / kChunks;
  static constexpr int kLoadPasses = kBlockN / kRowsPerPass;

  static_assert(kBlockN == kWarps * 16, "each warp owns one 16-key slice of a block");
  static_assert(kThreads % kChunks == 0 && kBlockN % kRowsPerPass == 0, "K/V chunks split evenly");
  static_assert((kRows * kChunks) % kThreads == 0, "Q chunks split evenly");
  static_assert(Merge::kMergeBytes <= kStages * kStageBytes, "the merge buffer reuses the K/V stages");
  static_assert(kStages >= 2, "one stage in flight while another is read");
  static_assert(kSmemBytes == decode_smem_bytes(kHeadDim, kWholeSm, kPaged), "decode_sm80.h states the plan's size");
  static_assert(kDecodePageSlots % kThreads == 0, "the page slots split evenly over the threads");
};

// Scale, softcap and ALiBi of one warp's 16 x 16 scores; `token`/`slope` per lane row (g, g + 8).
template <typename Traits>
__device__ __forceinline__ void decode_transform_scores(float (&s)[1][2][4], const KvcacheProblem& p,
                                                        const int (&token)[2], const float (&slope)[2],
                                                        int first_key, int diagonal_offset) {
  if (p.softcap > 0.0f) {
    const float two_over_softcap = 2.0f * p.softmax_scale / p.softcap;
#pragma unroll
    for (int nt = 0; nt < 2; ++nt)
#pragma unroll
      for (int i = 0; i < 4; ++i)
        s[0][nt][i] = p.softcap * (1.0f - __fdividef(2.0f, __expf(s[0][nt][i] * two_over_softcap) + 1.0f));
  } else {
#pragma unroll
    for (int nt = 0; nt < 2; ++nt)
#pragma unroll
      for (int i = 0; i < 4; ++i) s[0][nt][i] *= p.softmax_scale;
  }
  if (p.alibi_slopes != nullptr) {
    const int lane = static_cast<int>(threadIdx.x) % 32;
#pragma unroll
    for (int half = 0; half < 2; ++half)
#pragma unroll
      for (int nt = 0; nt < 2; ++nt)
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          const int key = first_key + nt * 8 + (lane % 4) * 2 + e;
          s[0][nt][2 * half + e] += alibi_bias(slope[half], token[half], key, diagonal_offset);
        }
  }
}

// -inf for the keys a row's token may not see (window, causal, sequence end).
__device__ __forceinline__ void decode_mask_scores(float (&s)[1][2][4], const KeyWindow& window,
                                                   const int (&token)[2], int first_key) {
  const int lane = static_cast<int>(threadIdx.x) % 32;
#pragma unroll
  for (int half = 0; half < 2; ++half) {
    const int begin = window.key_begin(token[half]);
    const int end = window.key_end(token[half]);
#pragma unroll
    for (int nt = 0; nt < 2; ++nt)
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        const int key = first_key + nt * 8 + (lane % 4) * 2 + e;
        if (key < begin || key >= end) s[0][nt][2 * half + e] = -INFINITY;
      }
  }
}

// A 16-byte global load kept in program order with the cp.async copies around it (both volatile
// asm): issued where it is written, not sunk to its first use.
__device__ __forceinline__ uint4 load_global_in_order(const void* ptr) {
  uint4 v;
  asm volatile("ld.global.nc.v4.u32 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
               : "l"(ptr));
  return v;
}

template <typename Traits>
__global__ void __launch_bounds__(Traits::kThreads)
    decode_kernel(const __grid_constant__ KvcacheProblem p) {
  using Element = typename Traits::Element;
  using QTile = typename Traits::QTile;
  using KvTile = typename Traits::KvTile;
  constexpr int kRows = Traits::kRows;
  constexpr int kBlockN = Traits::kBlockN;
  constexpr int kHeadDim = Traits::kHeadDim;
  constexpr int kStages = Traits::kStages;

  extern __shared__ __align__(128) unsigned char smem[];
  const uint32_t sQ = smem_address(smem + Traits::kQOffset);
  const uint32_t sKv = smem_address(smem + Traits::kKvOffset);
  const typename Traits::Merge merge{reinterpret_cast<float*>(smem + Traits::kLseOffset),
                                     reinterpret_cast<float*>(smem + Traits::kKvOffset)};

  // Everything below may read what the kernel before wrote (the append pass, the caller's Q).
  wait_for_prior_grids();
  allow_dependent_grids();  // the combine pass may launch; it waits for this grid to finish

  const int tid = static_cast<int>(threadIdx.x);
  const int lane = tid % 32;
  const int warp = tid / 32;
  const int num_splits = p.num_splits;
  const int m_block = static_cast<int>(blockIdx.x) / num_splits;
  const int split = static_cast<int>(blockIdx.x) % num_splits;
  const int kv_head = static_cast<int>(blockIdx.y);
  const int b = static_cast<int>(blockIdx.z);
  const int group = p.heads_q / p.heads_kv;
  const DecodeSequence seq = DecodeSequence::locate(p, b);
  const int packed_rows = seq.len_q * group;
  const int m0 = m_block * kRows;
  if (m0 >= packed_rows) return;  // varlen queries: past this sequence's tokens, nothing to do
  const int rows_here = min(kRows, packed_rows - m0);
  const int head_chunks = p.head_dim / 8;

  const KeyWindow window{seq.len_q, seq.len_k, p.window_left, p.window_right};
  const int token_first = m0 / group;
  const int token_last = (m0 + rows_here - 1) / group;

  // ---- This split's key blocks.
  const int key_lo = window.key_begin(token_first);
  const int key_hi = window.key_end(token_last);
  const int n_begin = key_lo / kBlockN;
  const int n_end = key_hi > key_lo ? (key_hi + kBlockN - 1) / kBlockN : n_begin;
  const int per_split = (n_end - n_begin + num_splits - 1) / num_splits;
  const int split_begin = min(n_end, n_begin + split * per_split);
  const int split_blocks = min(n_end, split_begin + per_split) - split_begin;

  // K/V copies: a thread copies one chunk column of kLoadPasses rows (kRowsPerPass apart) of each
  // block; rows past the sequence and columns past head_dim are zero-filled (a zero V row times
  // p = 0 adds nothing; a stale one could be NaN). The copy loop is the kernel's main instruction
  // stream (one CTA per SM issues it for 32 KiB of K/V per block at D 128), so its addresses are
  // cheap: a contiguous cache row advances by a fixed stride; a paged row is (page, row in page),
  // looked up by find_pages (block-table load, shift or division) one block before the copies.
  // Measured on the H200 (bench/NOTES.md): the old per-chunk address code (~1,050 of the loop's
  // 1,400 instructions per block) held one CTA per SM to 0.8x of the bandwidth.
  constexpr int kLoadPasses = Traits::kLoadPasses;
  struct PageRows {
    int page[kLoadPasses];
    int row[kLoadPasses];
  };
  constexpr bool paged = Traits::kPaged;
  // K and V pages of one layout with page and row strides that fit 32 bits (any realistic cache:
  // separate K and V tensors of one shape, or the two halves of one packed KV tensor) share a
  // chunk's byte offset, page x page stride + row x row stride: two wide multiply-adds per pass,
  // then one 64-bit add per cache, instead of 64-bit products per cache. With one CTA per SM the
  // copy loop's instruction count bounds the bandwidth.
  auto fits_int32 = [](int64_t elements) {
    const int64_t bytes = elements * static_cast<int64_t>(sizeof(Element));
    return bytes >= INT32_MIN && bytes <= INT32_MAX;
  };
  const bool shared_page_offsets = paged && p.k_cache_batch_stride == p.v_cache_batch_stride &&
                                   p.k_cache_row_stride == p.v_cache_row_stride &&
                                   fits_int32(p.k_cache_batch_stride) && fits_int32(p.k_cache_row_stride);
  const int page_bytes = static_cast<int>(p.k_cache_batch_stride * sizeof(Element));
  const int row_bytes = static_cast<int>(p.k_cache_row_stride * sizeof(Element));
  const int kv_chunk = tid % Traits::kChunks;
  const int first_row = tid / Traits::kChunks;
  const bool chunk_valid = kv_chunk < head_chunks;
  // A chunk past the head dim copies nothing (zero fill) from its row's first chunk: every
  // address a thread forms stays inside its row.
  const int source_chunk = chunk_valid ? kv_chunk : 0;
  const auto* k_cache =
      static_cast<const Element*>(p.k_cache) + kv_head * p.k_cache_head_stride + source_chunk * 8;
  const auto* v_cache =
      static_cast<const Element*>(p.v_cache) + kv_head * p.v_cache_head_stride + source_chunk * 8;
  // Contiguous: this thread's first row of block 0 (cache index leftpad + first_row).
  const int64_t first_index = seq.leftpad + first_row;
  const Element* k_rows =
      k_cache + seq.cache_row * p.k_cache_batch_stride + first_index * p.k_cache_row_stride;
  const Element* v_rows =
      v_cache + seq.cache_row * p.v_cache_batch_stride + first_index * p.v_cache_row_stride;

  // Q's chunks (each packed row is its own token and head), loaded before the first K/V copies: a
  // load issued after them returns behind the prologue's K/V stream (~160 KiB per SM on the
  // whole-SM pipeline, ~4 us at batch 1), and no block's S = Q K^T can start before it.
  constexpr int kQItems = kRows * Traits::kChunks / Traits::kThreads;
  auto q_item = [&](int i, int& row, int& chunk, int& token) -> const Element* {
    const int item = tid + i * Traits::kThreads;
    row = item / Traits::kChunks;
    chunk = item % Traits::kChunks;
    token = 0;
    if (row >= rows_here || chunk >= head_chunks) return nullptr;
    const int packed = m0 + row;
    token = packed / group;
    const int head = kv_head * group + packed % group;
    return static_cast<const Element*>(p.q) + b * p.q_batch_stride + (seq.q_begin + token) * p.q_row_stride +
           head * p.q_head_stride;
  };
  uint4 q_raw[kQItems];
#pragma unroll
  for (int i = 0; i < kQItems; ++i) {
    int row, chunk, token;
    const Element* q_row = q_item(i, row, chunk, token);
    q_raw[i] = q_row != nullptr ? load_global_in_order(q_row + chunk * 8) : make_uint4(0, 0, 0, 0);
  }

  const int* block_table_row = paged ? p.block_table + b * p.block_table_batch_stride : nullptr;
  // The split's pages, split_first_page to split_last_page: staged in shared memory when they fit
  // (`pages` then points there, else at the block table), before any lookup.
  const int* pages = block_table_row;
  int split_first_page = 0;
  int split_last_page = -1;
  bool pages_staged = false;
  if (paged && split_blocks > 0) {
    const int last_key = min((split_begin + split_blocks) * kBlockN, seq.len_k) - 1;
    split_first_page = (seq.leftpad + split_begin * kBlockN) / p.page_block_size;
    split_last_page = (seq.leftpad + last_key) / p.page_block_size;
    const int page_count = split_last_page - split_first_page + 1;
    pages_staged = page_count <= kDecodePageSlots;
    if (pages_staged) {
      // Every load out before the first store: one block-table latency, not one per kThreads
      // entries (a 128k-key split at 16-token pages has 512).
      constexpr int kSlotsPerThread = kDecodePageSlots / Traits::kThreads;
      int entry[kSlotsPerThread];
#pragma unroll
      for (int j = 0; j < kSlotsPerThread; ++j) {
        const int i = tid + j * Traits::kThreads;
        entry[j] = i < page_count ? block_table_row[split_first_page + i] : 0;
      }
      int* staged = reinterpret_cast<int*>(smem + Traits::kPageOffset);
#pragma unroll
      for (int j = 0; j < kSlotsPerThread; ++j) {
        const int i = tid + j * Traits::kThreads;
        if (i < page_count) staged[i] = entry[j];
      }
      __syncthreads();
      pages = staged;
    } else {
      pages = block_table_row + split_first_page;
    }
  }
  // A page of a power-of-two size (page_block_shift >= 0) splits a cache index with a shift and a
  // mask, any other with a division; the choice is made once per block, not per pass (per pass,
  // it cost a branch and a reload of the page size: ~4 of the ~11 instructions of a lookup, in a
  // copy loop whose instruction count bounds the bandwidth).
  // A row past the sequence's end looks up its last key's page instead (a clamp, not a branch):
  // its copy only zero-fills, and the address it forms stays inside that page.
  const int last_index = seq.leftpad + seq.len_k - 1;
  auto find_pages = [&](int n_block, PageRows& rows) {
    if (!paged) return;
    const int block_index = seq.leftpad + n_block * kBlockN + first_row;
    if (p.page_block_shift >= 0) {
      const int row_mask = p.page_block_size - 1;
#pragma unroll
      for (int i = 0; i < kLoadPasses; ++i) {
        const int index = min(block_index + i * Traits::kRowsPerPass, last_index);
        rows.row[i] = index & row_mask;
        rows.page[i] = pages[(index >> p.page_block_shift) - split_first_page];
      }
    } else {
#pragma unroll
      for (int i = 0; i < kLoadPasses; ++i) {
        const int index = min(block_index + i * Traits::kRowsPerPass, last_index);
        const int page = index / p.page_block_size;
        rows.row[i] = index - page * p.page_block_size;
        rows.page[i] = pages[page - split_first_page];
      }
    }
  };
  // Contiguous rows kRowsPerPass apart: a running pointer per cache, one 64-bit add per pass.
  const int64_t k_pass_stride = Traits::kRowsPerPass * p.k_cache_row_stride;
  const int64_t v_pass_stride = Traits::kRowsPerPass * p.v_cache_row_stride;
  auto load_kv = [&](int n_block, const PageRows& rows, int stage) {
    const uint32_t sK = sKv + static_cast<uint32_t>(stage * Traits::kStageBytes);
    const uint32_t sV = sK + KvTile::kBytes;
    const int block_key = n_block * kBlockN + first_row;
    auto copy = [&](int i, const Element* k_src, const Element* v_src, bool valid) {
      const uint32_t dst = KvTile::chunk_offset(first_row + i * Traits::kRowsPerPass, kv_chunk);
      cp_async_16(sK + dst, k_src, valid);
      cp_async_16(sV + dst, v_src, valid);
    };
    auto row_valid = [&](int i) { return chunk_valid && block_key + i * Traits::kRowsPerPass < seq.len_k; };
    // A paged row past the sequence's end was looked up as its last key's page and row (find_pages
    // clamps the index): its address is inside the pool, so it needs no clamp, only the zero fill.
    if (shared_page_offsets) {
      const auto* k_bytes = reinterpret_cast<const char*>(k_cache);
      const auto* v_bytes = reinterpret_cast<const char*>(v_cache);
#pragma unroll
      for (int i = 0; i < kLoadPasses; ++i) {
        const int64_t offset = static_cast<int64_t>(rows.page[i]) * page_bytes +
                               static_cast<int64_t>(rows.row[i]) * row_bytes;
        copy(i, reinterpret_cast<const Element*>(k_bytes + offset),
             reinterpret_cast<const Element*>(v_bytes + offset), row_valid(i));
      }
    } else if (paged) {
#pragma unroll
      for (int i = 0; i < kLoadPasses; ++i) {
        copy(i, k_cache + rows.page[i] * p.k_cache_batch_stride + rows.row[i] * p.k_cache_row_stride,
             v_cache + rows.page[i] * p.v_cache_batch_stride + rows.row[i] * p.v_cache_row_stride, row_valid(i));
      }
    } else {
      // A contiguous row past the end may lie past the allocation: its address is clamped to the
      // first row's.
      const int64_t block_row = static_cast<int64_t>(n_block) * kBlockN;
      const Element* k_src = k_rows + block_row * p.k_cache_row_stride;
      const Element* v_src = v_rows + block_row * p.v_cache_row_stride;
#pragma unroll
      for (int i = 0; i < kLoadPasses; ++i) {
        const bool valid = row_valid(i);
        copy(i, valid ? k_src : k_cache, valid ? v_src : v_cache, valid);
        k_src += k_pass_stride;
        v_src += v_pass_stride;
      }
    }
  };

  // The prologue's first kStages - 1 blocks. A paged cache's are looked up and copied block by
  // block in a loop kept rolled: unrolled, each block is ~20 instruction-cache lines that every
  // CTA runs once, cold (H200 clock64 trace, one CTA per SM: 5 blocks took ~11,000 cycles, against
  // ~1,400 for a contiguous cache's same copies). Their lookups read the staged pages (or, past
  // the slots, the block table: then one latency per block).
  if constexpr (paged) {
#pragma unroll 1
    for (int s = 0; s < kStages - 1; ++s) {
      PageRows rows;
      if (s < split_blocks) {
        find_pages(split_begin + s, rows);
        load_kv(split_begin + s, rows, s);
      }
      cp_async_commit();
    }
  } else {
    const PageRows no_rows{};
#pragma unroll
    for (int s = 0; s < kStages - 1; ++s) {
      if (s < split_blocks) load_kv(split_begin + s, no_rows, s);
      cp_async_commit();
    }
  }
  // The rest of the split's block-table entries go to L2 now, so that the loop's lookups (one block
  // ahead of their copies) find them there: a 128-byte line holds the pages of 8 blocks at 16-token
  // pages, and its first lookup would otherwise wait on HBM (~1 us, about a block's time at one CTA
  // per SM). Pages of a power-of-two size only (a shift, no division, in the prologue).
  if (paged && !pages_staged && p.page_block_shift >= 0 && split_blocks > kStages - 1) {
    const int first_page = (seq.leftpad + (split_begin + kStages - 1) * kBlockN) >> p.page_block_shift;
    const uintptr_t first_line = reinterpret_cast<uintptr_t>(block_table_row + first_page) / 128;
    const uintptr_t last_line = reinterpret_cast<uintptr_t>(block_table_row + split_last_page) / 128;
    for (uintptr_t line = first_line + tid; line <= last_line; line += Traits::kThreads) {
      asm volatile("prefetch.global.L2 [%0];\n" ::"l"(line * 128));
    }
  }
  PageRows next_rows;  // of block kStages - 1 + it at the top of iteration it
  if (kStages - 1 < split_blocks) find_pages(split_begin + kStages - 1, next_rows);

  // ---- Q: rotated and stored (swizzled) from the chunks loaded before the K/V copies.
  {
    const int position_base = seq.length - seq.leftpad;
    const bool per_token = p.rotary_q_positions_per_token();
#pragma unroll
    for (int i = 0; i < kQItems; ++i) {
      int row, chunk, token;
      const Element* q_row = q_item(i, row, chunk, token);
      const uint4 value = q_row != nullptr ? rotary_chunk<Element>(p, q_row, chunk * 8, q_raw[i],
                                                                  position_base + (per_token ? token : 0))
                                           : make_uint4(0, 0, 0, 0);
      asm volatile("st.shared.v4.b32 [%0], {%1, %2, %3, %4};\n" ::"r"(sQ + QTile::chunk_offset(row, chunk)),
                   "r"(value.x), "r"(value.y), "r"(value.z), "r"(value.w));
    }
  }

  // Per lane: rows g and g + 8 of the tile; their tokens (clamped for padding rows) and slopes.
  int row_token[2];
  float row_slope[2];
#pragma unroll
  for (int half = 0; half < 2; ++half) {
    const int packed = min(m0 + lane / 4 + 8 * half, m0 + rows_here - 1);
    row_token[half] = packed / group;
    const int head = kv_head * group + packed % group;
    row_slope[half] = p.alibi_slopes != nullptr ? p.alibi_slopes[b * p.alibi_batch_stride + head] : 0.0f;
  }
  constexpr float kLog2e = 1.4426950408889634f;
  const bool transform = p.softcap > 0.0f || p.alibi_slopes != nullptr;
  const float log2_scale = transform ? kLog2e : p.softmax_scale * kLog2e;
  const int diagonal = window.diagonal_offset();

  const typename QTile::LaneAddresses q_addr(sQ, lane % 16, lane / 16);
  const typename KvTile::LaneAddresses k_addr(sKv, lane % 8 + (lane / 16) * 8, (lane / 8) % 2);
  const typename KvTile::LaneAddresses v_addr(sKv + KvTile::kBytes, lane % 16, lane / 16);

  float acc_o[1][Traits::kDTiles][4];
  zero_accumulators(acc_o);
  OnlineSoftmax<1, 2, Traits::kDTiles> softmax;
  softmax.init();

  for (int it = 0; it < split_blocks; ++it) {
    cp_async_wait<kStages - 2>();
    __syncthreads();
    const int ahead = it + kStages - 1;
    if (ahead < split_blocks) {
      load_kv(split_begin + ahead, next_rows, ahead % kStages);
      if (ahead + 1 < split_blocks) find_pages(split_begin + ahead + 1, next_rows);
    }
    cp_async_commit();
    const uint32_t stage_offset = static_cast<uint32_t>((it % kStages) * Traits::kStageBytes);
    const int n0 = (split_begin + it) * kBlockN;
    const int warp_key0 = n0 + warp * 16;

    float acc_s[1][2][4];
    zero_accumulators(acc_s);
#pragma unroll
    for (int kk = 0; kk < Traits::kQkSteps; ++kk) {
      uint32_t a[1][4];
      ldmatrix_x4(a[0], q_addr.at(0, kk));
      uint32_t bk[4];
      ldmatrix_x4(bk, k_addr.at(warp * 16, kk) + stage_offset);
      mma_column_pair<Element>(acc_s, a, bk, 0);
    }
    if (transform) decode_transform_scores<Traits>(acc_s, p, row_token, row_slope, warp_key0, diagonal);
    if (!window.block_unmasked(token_first, token_last + 1, n0, n0 + kBlockN)) {
      decode_mask_scores(acc_s, window, row_token, warp_key0);
    }
    softmax.update(acc_s, acc_o, log2_scale);

    uint32_t a[1][4];
    a[0][0] = pack2<Element>(acc_s[0][0][0], acc_s[0][0][1]);
    a[0][1] = pack2<Element>(acc_s[0][0][2], acc_s[0][0][3]);
    a[0][2] = pack2<Element>(acc_s[0][1][0], acc_s[0][1][1]);
    a[0][3] = pack2<Element>(acc_s[0][1][2], acc_s[0][1][3]);
#pragma unroll
    for (int dp = 0; dp < Traits::kDTiles / 2; ++dp) {
      uint32_t bv[4];
      ldmatrix_x4_trans(bv, v_addr.at(warp * 16, dp) + stage_offset);
      mma_column_pair<Element>(acc_o, a, bv, dp);
    }
  }
  cp_async_wait<0>();

  // ---- Merge the warps' partial results.
  float lse[2];
  softmax.finalize(acc_o, log2_scale, lse);
  merge.publish_lse(lse, warp, lane);  // every warp is past its last K/V read: the stages become the buffer
  merge.publish_output(acc_o, lse, warp, lane);

  // ---- Store: 4 columns per item, rows of this tile that exist, columns below head_dim.
  const bool partial = num_splits > 1;
  float* lse_accum = static_cast<float*>(p.workspace);
  const DecodeWorkspaceLayout layout = decode_workspace_layout(p, num_splits);
  float* out_accum = reinterpret_cast<float*>(static_cast<char*>(p.workspace) + layout.out_offset);
  const int64_t rows_per_split = static_cast<int64_t>(p.batch) * p.heads_q * p.seqlen_q;
#pragma unroll
  for (int i = 0; i < kRows * kHeadDim / 4 / Traits::kThreads; ++i) {
    const int item = tid + i * Traits::kThreads;
    const int row = item / (kHeadDim / 4);
    const int col = (item % (kHeadDim / 4)) * 4;
    if (row >= rows_here || col >= p.head_dim) continue;
    const float4 sum = merge.row_sum(row, col);
    const int packed = m0 + row;
    const int token = packed / group;
    const int head = kv_head * group + packed % group;
    const bool writes_lse = col == 0;
    if (partial) {
      const int64_t out_row = split * rows_per_split + (static_cast<int64_t>(b) * p.heads_q + head) * p.seqlen_q + token;
      *reinterpret_cast<float4*>(out_accum + out_row * p.head_dim + col) = sum;
      if (writes_lse) lse_accum[out_row] = merge.total_lse(row);
    } else {
      Element* out = static_cast<Element*>(p.out) + b * p.out_batch_stride +
                     (seq.q_begin + token) * p.out_row_stride + head * p.out_head_stride + col;
      *reinterpret_cast<uint2*>(out) = make_uint2(pack2<Element>(sum.x, sum.y), pack2<Element>(sum.z, sum.w));
      if (writes_lse) p.lse[b * p.lse_batch_stride + head * p.lse_head_stride + token] = merge.total_lse(row);
    }
  }
}

}  // namespace flashkit::sm80
