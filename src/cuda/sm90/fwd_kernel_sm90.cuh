// src/cuda/sm90/fwd_kernel_sm90.cuh
// \brief The warp-specialized forward kernel on wgmma + TMA (sm_90a, Hopper).
//
// A CTA walks tiles of kBlockM = 64 x kConsumerWarpgroups (128 or 192, fwd_tile_config_sm90.h)
// query rows of one (batch, head), in the order of TileOrder (heaviest first within groups of
// (batch, head) pairs): tile blockIdx.x, then every gridDim.x-th after it where all tiles cost the
// same, or the next one no CTA has taken where they differ (a mask, variable lengths), with one CTA
// per SM either way (take_next_tile, fwd_launch_sm90.cuh). Its warpgroups:
//
//   producer  (warpgroup 0, 40, 32 or 24 registers; its first warp works, one lane issues the copies)
//     per tile: wait q_empty (the consumers are done with the previous tile's Q and have read it);
//               publish the tile, located (FwdTile); TMA Q (kBlockM x D)  -> q_full
//               (a tile with no visible key is published without Q; num_tiles ends the walk)
//     for each visible key block n, last to first, through a ring of kStages stages (K[n] and
//     V[n] in stage s(n)), each V one step behind its K (a consumer needs K[n] with V[n + 1]):
//       wait k_empty[s(n)]; TMA K[n] -> k_full[s(n)]
//       wait v_empty[s(n + 1)]; TMA V[n + 1] -> v_full[s(n + 1)]   (the walk's previous block)
//     and after the last block its V
//       (varlen, a block reaching past the sequence: V lands on v_tail, the warp zeroes the rows
//        past the sequence (they hold the next sequence's tokens, possibly inf or NaN, which
//        0 * x would spread into O), fences, and then arrives on v_full[s] itself)
//   consumers (warpgroups 1 .. kConsumerWarpgroups, 232 or 240 registers for two, 160 for three;
//   64 query rows each), software-pipelined by one block so that each block's softmax overlaps the
//   tensor cores:
//     per tile: wait q_full; copy the located tile (the end of the walk: exit)
//     first block:  S = Q K^T (wgmma SS); release K; softmax S -> P (registers)
//     each next block n, previous block p:
//       [turn]  issue S_n = Q K_n^T (SS) and O += P_p V_p (RS: P from registers)   [pass turn]
//       test the next block's K and V barriers (Traits::kShortChain)
//       wait S_n; release K_n; softcap / ALiBi / mask; advance the row maxima; S_n -> P_n,
//       packed to 16 bits into the other P buffer (kShortChain, so that the softmax does not
//       depend on the pending P V; otherwise after the wait for O)
//       wait for the next K and V if the test failed; wait O; rescale O if a row maximum moved;
//       release V_p
//     (a consumer whose 64 rows all lie past the sequence's end, in the d64 / d128 kernels but
//      d128's dropout one: no products, no softmax; it waits for and releases each block's K and
//      V and takes its turns, in the same order, so that the others' products have the tensor
//      cores to themselves; likewise, before its first block, for the tile's leading blocks that
//      none of its rows sees, in d64 / d256)
//     release Q (every thread arrives on q_empty): with several tiles per CTA, the producer
//                          loads the next tile's Q under this tile's last P V and epilogue, as it
//                          loads the next tile's K and V into the stages this tile frees
//     last:   [turn] O += P V [pass turn]; release V
//     epilogue: O / rowsum -> 16-bit; LSE per row. Where shared memory has room for O (every
//               family but 256), each consumer writes its 64 rows into its own staging tile
//               (stmatrix) and one thread hands the tile to a TMA store, which clips rows past the
//               sequence and columns past head_dim; the warpgroup goes on to its next tile while the
//               copy engine writes (a varlen tile reaching past its sequence is copied out of the
//               staging tile by the warpgroup instead: store_output_staged). Otherwise (d256) each
//               quad transposes its rows' column pairs by shuffles and stores 16 bytes per lane
//               from registers (store_output_row_half; rows inside the sequence, columns inside
//               head_dim).
//   [turn] passes round the consumers (named barriers kScheduler0/1/2; ping-pong with two): a
//   warpgroup issues its matrix products only after the one before it has issued its own, so one
//   warpgroup's softmax runs while the others' products occupy the tensor cores.
//
// Dropout (Traits::kDropout, its own instance: the p = 0 kernel is compiled exactly as without it)
// zeroes the dropped probabilities of the packed P operand, after the row sums (the normaliser and
// the LSE are those of the undropped P, as in the reference) and before P V, with the Philox mask of
// common/philox.h: the m64nN accumulator is the mma.sync layout for each warp's 16 rows, addressed
// as the sm80 kernel does (one call per lane per 16 rows x 32 keys, 16 decisions). The softmax turns
// each call's words into drop marks (sm80::DropMarker, 3 instructions per 4 decisions) and the pack
// clears the dropped 16-bit halves (sm80::drop_packed_pairs, PRMT + LOP3 per two values) instead
// of a shift, compare and select per fp32 value. The 1/(1-p) scales O once in the epilogue.
//
// Packed query heads (FwdParams::rows, GQA): a tile's rows are (token, head) pairs of one kv head's
// group, loaded and stored through maps with the heads dim split in two; masks take each row's
// token. Split keys (Traits::kSplitKeys, its own instance): a tile runs one range of its key
// blocks and writes fp32 partial rows, which the decode kernel's combine pass merges. When each
// runs: sm90::plan_fwd (fwd_sm90.h).
//
// Blocks are visited from the last to the first, as in the sm80 kernel, so the blocks the causal
// diagonal or the sequence end cut come first. Rows and keys past a sequence's end are read (TMA
// zero-fills past the tensor, and in a packed varlen tensor reads the next sequence) but masked,
// zeroed (V) or never written (rows of O and LSE). Columns past head_dim (a head dim padded to its
// family) are zero-filled by TMA and never written.
#pragma once

#include <cuda.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>

#include "common/fwd_problem.h"
#include "cuda/common/attention_mask.cuh"
#include "cuda/common/dropout_mask.cuh"
#include "cuda/common/mma_sm80.cuh"
#include "cuda/common/online_softmax.cuh"
#include "cuda/common/score_mods.cuh"
#include "cuda/sm90/mbarrier.cuh"
#include "cuda/sm90/tensor_map.h"
#include "cuda/sm90/tma.cuh"
#include "cuda/sm90/warpgroup.cuh"
#include "cuda/sm90/wgmma.cuh"

namespace flashkit::sm90 {
#ifdef FLASHKIT_SM90_FWD_TRACE
inline namespace traced {  // the traced build's own symbols, beside the library's untraced ones
#endif

#ifdef FLASHKIT_SM90_FWD_TRACE
// The instrument of bench/fwd_trace_sm90.cu (defined there before this header, never in the
// library). Each consumer's first thread writes kTraceSlots values per tile into
// fwd_trace_buffer[(linear tile * consumers + consumer) * kTraceSlots + slot]: clock64 when the tile
// is located (0), its Q has landed (1), its first S has landed (2), every S has (3), its last P V has
// (4) and its epilogue is done (5); %globaltimer at its start (6) and end (8), comparable across
// SMs; the SM's id (7); the key blocks the tile visits (9). Slots 10-16 sum, over the main loop's
// iterations (every block but the first), the cycles of its phases: waiting for K and V (10; with
// Traits::kShortChain those waits follow the softmax and count in 14), for the turn (11), issuing S
// and P V (12), waiting for S (13), the softmax (14; with kShortChain also the pack), waiting for
// P V (15), rescaling O and releasing V (16; without kShortChain also the pack). Slots 17-19:
// clock64 at the end of the main loop's first, second and fourth iterations (0 if the tile has
// fewer); slots 20 and 21: the cycles of phase 14 spent waiting for the next K, then for the next V
// (kShortChain).
constexpr int kTraceSlots = 22;
constexpr int kTraceLoopPhases = 7;
inline long long* fwd_trace_buffer = nullptr;  // set by the tool; read by launch_fwd
__device__ __forceinline__ long long trace_global_ns() {
  long long t;
  asm volatile("mov.u64 %0, %%globaltimer;\n" : "=l"(t));
  return t;
}
__device__ __forceinline__ long long trace_sm_id() {
  uint32_t sm;
  asm volatile("mov.u32 %0, %%smid;\n" : "=r"(sm));
  return sm;
}
#define FLASHKIT_FWD_TRACE(slot, value)                                                            \
  do {                                                                                             \
    if (threadIdx.x % kWarpgroupThreads == 0) {                                                    \
      params.trace[(static_cast<int64_t>(linear) * Traits::kConsumerWarpgroups + consumer) *       \
                       kTraceSlots + (slot)] = (value);                                            \
    }                                                                                              \
  } while (0)
// Main-loop phase marks: MARK(i) at the end of phase i - 1 (i = 1 .. 7, 0 at the iteration's
// start); LOOP_SUM adds an iteration's phases to the tile's sums, LOOP_STORE writes them.
#define FLASHKIT_FWD_LOOP_MARK(i) loop_mark[i] = clock64()
#define FLASHKIT_FWD_LOOP_KV_WAIT() loop_kv_begin = clock64()
#define FLASHKIT_FWD_LOOP_V_WAIT() loop_v_begin = clock64()
#define FLASHKIT_FWD_LOOP_SUM()                                                                    \
  do {                                                                                             \
    for (int ph = 0; ph < kTraceLoopPhases; ++ph) loop_sum[ph] += loop_mark[ph + 1] - loop_mark[ph]; \
    ++loop_count;                                                                                  \
    if (loop_count == 1 || loop_count == 2 || loop_count == 4) loop_early[loop_count / 2] = loop_mark[7]; \
    loop_k_late += loop_v_begin - loop_kv_begin;                                                   \
    loop_v_late += loop_mark[5] - loop_v_begin;                                                    \
  } while (0)
#define FLASHKIT_FWD_LOOP_STORE()                                                          \
  do {                                                                                     \
    for (int ph = 0; ph < kTraceLoopPhases; ++ph) FLASHKIT_FWD_TRACE(10 + ph, loop_sum[ph]); \
    for (int i = 0; i < 3; ++i) FLASHKIT_FWD_TRACE(17 + i, loop_early[i]);                 \
    FLASHKIT_FWD_TRACE(20, loop_k_late);                                                   \
    FLASHKIT_FWD_TRACE(21, loop_v_late);                                                   \
  } while (0)
#else
#define FLASHKIT_FWD_TRACE(slot, value) \
  do {                                  \
  } while (0)
#define FLASHKIT_FWD_LOOP_MARK(i) \
  do {                            \
  } while (0)
#define FLASHKIT_FWD_LOOP_SUM() \
  do {                          \
  } while (0)
#define FLASHKIT_FWD_LOOP_KV_WAIT() \
  do {                              \
  } while (0)
#define FLASHKIT_FWD_LOOP_V_WAIT() \
  do {                             \
  } while (0)
#define FLASHKIT_FWD_LOOP_STORE() \
  do {                            \
  } while (0)
#endif

// Which query token and head each row of a tile holds. Each consumer warpgroup's 64 rows hold whole
// tokens: `tokens_per_consumer` = 64 / G of them, G rows each, one per query head of a kv head's
// group (G = `group`; 1: the rows are tokens of one query head). Row 64 c + j of a tile is then
// token c x tokens_per_consumer + j / G of the tile's tokens, head j % G of the group; where G does
// not divide 64, rows j >= tokens_per_consumer x G are padding, which Q's loads leave zero and
// nothing stores. (Whole tokens per consumer, so that each consumer's rows of O go out in one box
// of the map; with G a power of two the rows of a tile are simply its tokens x G in order.)
struct TileRows {
  int group;
  int tokens_per_consumer;
  int reciprocal;  // ceil(2^16 / G): j / G = (j x reciprocal) >> 16 exactly for j < 256 (fwd_sm90.h)

  // Row `row` (never negative: shifts and masks, not the signed division's fix-ups) as its token of
  // the tile's tokens (bits 0-7) and its head in the group (bits 8-13); a padding row gets token
  // kPaddingToken, past any tile's tokens. The kernel keeps the codes of a tile's rows in shared
  // memory (Barriers::row_codes): held in registers through the main loop, even one more register
  // made d256's kernels spill.
  static constexpr int kPaddingToken = 255;
  __device__ __forceinline__ int code(int row) const {
    const int j = row & 63;
    const int in_consumer = (j * reciprocal) >> 16;  // j / G
    if (in_consumer >= tokens_per_consumer) return kPaddingToken;
    return ((row >> 6) * tokens_per_consumer + in_consumer) | (j - group * in_consumer) << 8;
  }
  __device__ __forceinline__ static int token(int code) { return code & 0xff; }
  __device__ __forceinline__ static int head(int code) { return code >> 8; }

  // Consumer `consumer`'s tokens of a tile whose tokens are [token0, token0 + tile_tokens) of its
  // sequence (FwdTile): [first, first + count), count < tokens_per_consumer where the sequence ends
  // inside its rows and <= 0 where it ends before them.
  struct ConsumerTokens {
    int first;
    int count;
  };
  __device__ __forceinline__ ConsumerTokens consumer_tokens(int token0, int tile_tokens, int consumer) const {
    const int before = consumer * tokens_per_consumer;
    return {token0 + before, min(tokens_per_consumer, tile_tokens - before)};
  }
};

// The kernel's parameter block: the problem and the tensor maps of Q, K, V and O (K and V rank 4
// [D, seqlen, heads, batch] for fixed-length problems, rank 3 [D, total tokens, heads] for varlen;
// Q and O with the heads split into (head in group, group), rank 5 / 4, grouped_rows_tensor_map, in
// boxes of one consumer's rows).
struct FwdParams {
  FwdProblem problem;
  // The tiles' rows (fwd_pack_gqa_group, fwd_sm90.h): with G > 1 a tile runs G query heads of one kv
  // head, the Q and O maps have groups of G, and FwdTile::head is the group's first head.
  TileRows rows;
  // Split keys (Traits::kSplitKeys; fwd_split_count): tile `linear` is split linear / (tiles per
  // split) of its tile's key blocks, [split, split + 1) x blocks_per_split, and writes its rows'
  // partials to split_lse [splits, batch, heads_q, seqlen_q] and split_out [..., head_dim] (fp32,
  // the decode workspace's layout). Unused (1, 0, null) in the other instances.
  int num_splits;
  int blocks_per_split;
  float* split_lse;
  float* split_out;
  CUtensorMap q_map;
  CUtensorMap k_map;
  CUtensorMap v_map;
  CUtensorMap o_map;
  int tile_groups;  // TileOrder's number of (batch, head) groups, 1 .. batch * heads_q
  // The dynamic tile scheduler's counter (0 on entry, left 0; tile_counter_slots.h), or nullptr for
  // the static round robin (take_next_tile).
  unsigned* tile_counter;
#ifdef FLASHKIT_SM90_FWD_TRACE
  long long* trace;
#endif
};

// The order in which tiles are handed out (the hardware starts CTAs roughly in blockIdx order, so
// this is the order in which SMs pick tiles up). The batch * heads_q (batch, head) pairs are split
// into `groups` groups of consecutive pairs whose sizes differ by at most one (the larger first);
// the groups run one after the other, and inside a group the m-blocks run from the last (under a
// causal mask the heaviest) to the first, the group's pairs varying fastest. So every group ends on
// its lightest tiles and the last wave of the launch is made of light tiles (longest-first
// balancing), while the CTAs running at once belong to a few pairs and share their K and V in L2.
// One pair per group (groups = batch * heads_q) is the order of one (batch, head) after another.
struct TileOrder {
  int m_block;
  int batch_head;

  __device__ __forceinline__ static TileOrder locate(int linear, int num_m_blocks, int batch_heads,
                                                     int groups) {
    const int small = batch_heads / groups;  // pairs in a small group; the first `large` have one more
    const int large = batch_heads % groups;
    const int large_tiles = large * (small + 1) * num_m_blocks;
    int size = small + 1;
    int first_pair = 0;
    if (linear >= large_tiles) {
      linear -= large_tiles;
      size = small;
      first_pair = large * (small + 1);
    }
    const int group = linear / (size * num_m_blocks);
    const int within = linear - group * size * num_m_blocks;
    TileOrder o;
    o.m_block = num_m_blocks - 1 - within / size;
    o.batch_head = first_pair + group * size + within % size;
    return o;
  }
};

// Where a tile's rows and keys live, and which key blocks it visits. A tile runs `tokens_per_tile`
// query tokens (FwdParams::rows: of one head, or each with the G heads of a group).
struct alignas(16) FwdTile {
  int batch;
  int head;  // the query head of the rows; packed: the first of the group
  int kv_head;
  int m_block;
  int len_q;  // tokens
  int len_k;
  int q_token;  // varlen: the first token of the sequence in the packed tensors; 0 otherwise
  int k_token;
  int token0;   // the tile's first query token in its sequence
  int tokens;   // its tokens inside the sequence (<= 0: the tile is past its end)
  int n_begin;  // visible key blocks [n_begin, n_end), walked from the last
  int n_end;
  int split;  // the tile's key split (kSplitKeys), else 0

  // Tile `linear` of the problem, in TileOrder (with kSplitKeys, within its split).
  template <int kBlockM, int kBlockN, bool kSplitKeys>
  __device__ __forceinline__ static FwdTile locate(const FwdParams& params, int linear) {
    const FwdProblem& p = params.problem;
    const int group = params.rows.group;
    const int tokens_per_tile = kBlockM / 64 * params.rows.tokens_per_consumer;
    FwdTile t;
    const int num_m_blocks = (p.seqlen_q + tokens_per_tile - 1) / tokens_per_tile;
    const int row_heads = p.heads_q / group;  // heads (packed: groups) whose rows the tiles run
    t.split = 0;
    if constexpr (kSplitKeys) {
      const int tiles_per_split = num_m_blocks * p.batch * row_heads;
      t.split = linear / tiles_per_split;
      linear -= t.split * tiles_per_split;
    }
    const TileOrder order = TileOrder::locate(linear, num_m_blocks, p.batch * row_heads, params.tile_groups);
    t.m_block = order.m_block;
    t.head = (order.batch_head % row_heads) * group;
    t.batch = order.batch_head / row_heads;
    t.kv_head = t.head / (p.heads_q / p.heads_kv);
    t.len_q = p.seqlen_q;
    t.len_k = p.seqlen_k;
    t.q_token = 0;
    t.k_token = 0;
    if (p.cu_seqlens_q != nullptr) {
      t.q_token = p.cu_seqlens_q[t.batch];
      t.k_token = p.cu_seqlens_k[t.batch];
      t.len_q = p.cu_seqlens_q[t.batch + 1] - t.q_token;
      t.len_k = p.seqused_k != nullptr ? p.seqused_k[t.batch] : p.cu_seqlens_k[t.batch + 1] - t.k_token;
    } else if (p.seqused_k != nullptr) {  // a KV cache's lengths (api/kvcache_fwd_route.h)
      t.len_k = p.seqused_k[t.batch];
    }
    t.token0 = t.m_block * tokens_per_tile;
    t.tokens = min(tokens_per_tile, t.len_q - t.token0);
    t.n_begin = 0;
    t.n_end = 0;
    if (t.tokens > 0) {
      const sm80::KeyWindow window{t.len_q, t.len_k, p.window_left, p.window_right};
      const int key_lo = window.key_begin(t.token0);
      const int key_hi = window.key_end(t.token0 + t.tokens - 1);
      t.n_begin = key_lo / kBlockN;
      t.n_end = key_hi > key_lo ? (key_hi + kBlockN - 1) / kBlockN : t.n_begin;
      if constexpr (kSplitKeys) {  // a split without blocks of the tile: none (its partials: -inf, 0)
        t.n_begin = max(t.n_begin, t.split * params.blocks_per_split);
        t.n_end = max(t.n_begin, min(t.n_end, (t.split + 1) * params.blocks_per_split));
      }
    }
    return t;
  }

  __device__ __forceinline__ bool has_keys() const { return n_end > n_begin; }
};

template <typename Element_, int kHeadDim_, int kBlockM_, int kBlockN_, int kStages_, bool kDropout_,
          bool kSkipTrailingBlocks_ = false, bool kSplitKeys_ = false>
struct FwdKernelTraits {
  using Element = Element_;
  static constexpr bool kDropout = kDropout_;  // the instance that applies dropout (p > 0)
  static constexpr int kHeadDim = kHeadDim_;
  static constexpr int kBlockM = kBlockM_;  // 64 query rows per consumer warpgroup
  static constexpr int kBlockN = kBlockN_;
  static constexpr int kStages = kStages_;
  static constexpr int kConsumerWarpgroups = kBlockM / 64;
  static constexpr int kThreads = (1 + kConsumerWarpgroups) * kWarpgroupThreads;
  static constexpr int kConsumerWarps = kConsumerWarpgroups * 4;
  // The main loop's short chain (where the registers allow it): a block's P goes to a second P
  // buffer (kBlockN / 4 registers), so that nothing in the softmax has to wait for the previous
  // block's P V, which still reads the first; and the next block's K and V barriers are tested
  // right after the products are issued and waited for after the softmax. What ptxas makes of it
  // (SASS, d64 / d128): the exponentials, then the barrier waits, then P V's wait, then the pack
  // (sunk there). With one P buffer it hoists the barrier waits and P V's wait above the
  // exponentials, so each block's softmax waits for the previous block's P V, as it did before.
  // S, two P buffers and O take kBlockN + D / 2 registers per thread (S kBlockN / 2, each P
  // kBlockN / 4, O D / 2); the short chain runs where that leaves the rest room: up to 128 of the 160
  // registers of three consumers (d64 on 192 x 96 had it; on 192 x 128 a second P spilled 112 bytes,
  // and one P buffer on 128 keys measured faster: bench/NOTES.md, "Session 9"), up to 192 of the 232
  // of two (d128; not d256, whose O alone takes 128). The dropout instances never (their drop marks;
  // they spilled or ran slower with it). Otherwise the pack waits for P V and an iteration waits for
  // its K and V first. bench/NOTES.md, "Session 6".
  static constexpr bool kShortChain =
      !kDropout && kBlockN + kHeadDim / 2 <= (kConsumerWarpgroups == 3 ? 128 : 192);
  static constexpr int kPBuffers = kShortChain ? 2 : 1;
  // Whether a consumer whose rows all lie past the sequence skips its products (consumer_warpgroup).
  // Not at d256: there the walk that replaces them made ptxas spill in the main loop (p = 0: 44 B
  // instead of 20; dropout: 104 B instead of 0). Not in d128's dropout kernel: with the warpgroup
  // index that the skip takes through a shuffle (fwd_kernel), ptxas moves the first Philox rounds'
  // 8 multiplies per key block off the uniform datapath (UIMAD.WIDE -> IMAD.WIDE) and reshapes the
  // loop, for 13% more cycles at p = 0.1 (H200, bench/NOTES.md, session 14; d64's dropout kernel
  // measured 1-7% faster with the skip).
  static constexpr bool kSkipIdleRows = kHeadDim == 64 || (kHeadDim == 128 && !kDropout);
  // Whether the softmax takes its rows one after the other (OnlineSoftmax::advance_max_and_exponentiate)
  // instead of both maxima first: where it measured faster, the two-consumer p = 0 kernels (ncu
  // cycles at the base clock, H200, bf16 8k: d128 -2.6%, d256 -1.1%). d64's three consumers, whose
  // MUFU load bounds them, took 1.8% more cycles with it, d128's dropout kernel 2.2% (session 15).
  static constexpr bool kRowByRowSoftmax = kConsumerWarpgroups == 2 && !kDropout;
  // Whether a consumer skips the trailing key blocks none of its rows sees, left of a sliding
  // window's edge (consumer_warpgroup; run_fwd picks the instance that does for problems with a
  // left window edge, fwd_sliding_window_instance says where).
  static constexpr bool kSkipTrailingBlocks = kSkipTrailingBlocks_;
  // Whether the tiles run one split of their key blocks each and store fp32 partials for the
  // combine pass (FwdParams::num_splits; its own instance, so that the others keep their epilogue).
  static constexpr bool kSplitKeys = kSplitKeys_;
  static_assert(!kSplitKeys || !kDropout, "dropout does not split");
  static_assert(!kSkipTrailingBlocks || kBlockM > kBlockN, "the skip walks the tile's blocks per consumer");
  // setmaxnreg moves registers within the CTA's allocation at launch (the 64K file split evenly
  // and rounded down to 8: 168 per thread at 384 threads, 128 at 512). A consumer's claim blocks
  // until the producer's release has put enough in the pool, so the claims must not exceed the
  // release: 40 / 232 with two consumers, 32 / 160 with three (both balance exactly). d256's p = 0
  // kernel takes 24 / 240 (also exact): its 128 x 80 tile spills at 232. The other two-consumer
  // kernels keep 40 / 232: at 24 the producer warp spills (4 B in d128's p = 0 kernel and d64's
  // dropout kernel), and d128's consumers compile to the same code at 240 (SASS, session 15).
  static constexpr int kLaunchRegisters = 65536 / kThreads / 8 * 8;
  static constexpr bool kWideConsumers = kConsumerWarpgroups == 2 && kHeadDim == 256 && !kDropout;
  static constexpr int kProducerRegisters = kConsumerWarpgroups == 2 ? (kWideConsumers ? 24 : 40) : 32;
  static constexpr int kConsumerRegisters = kConsumerWarpgroups == 2 ? (kWideConsumers ? 240 : 232) : 160;
  static_assert((kLaunchRegisters - kProducerRegisters) * kWarpgroupThreads >=
                    (kConsumerRegisters - kLaunchRegisters) * kConsumerWarpgroups * kWarpgroupThreads,
                "the consumers claim more registers than the producer releases: setmaxnreg would hang");

  // The shapes the score helpers of score_mods.cuh index: one 16-row tile per warp, kBlockN / 8
  // column groups.
  static constexpr int kMTiles = 1;
  static constexpr int kNTiles = kBlockN / 8;
  static constexpr int kDTiles = kHeadDim / 8;

  using QTile = Swizzle128Tile<kBlockM, kHeadDim>;
  using KvTile = Swizzle128Tile<kBlockN, kHeadDim>;
  using OTile = Swizzle128Tile<64, kHeadDim>;  // one consumer's rows of O, staged for the TMA store

  struct Barriers {
    uint64_t q_full;   // the next tile is published in `tile` and, if it has keys, its Q has landed
    uint64_t q_empty;  // every consumer thread has read the tile and its last S = Q K^T is done
    uint64_t k_full[kStages];
    uint64_t v_full[kStages];
    uint64_t k_empty[kStages];  // K and V are released separately: K after S, V after O += P V
    uint64_t v_empty[kStages];
    uint64_t v_tail;
    int tile;  // the walk's next tile (num_tiles: its end), written before q_full completes
    // That tile as the producer located it, so that the consumers start it without the integer
    // divisions of FwdTile::locate (~900 cycles of dependent latency at each tile's start).
    FwdTile located;
    uint16_t row_codes[kBlockM];  // TileRows::code of each row of every tile, written at the start
  };
  // Shared-memory plan, byte offsets from a 1024-byte aligned base: Q, the K and V stages, O's
  // staging tiles where they fit and O is stored (kStageOutput; not kSplitKeys), barriers last.
  // + 1024: the dynamic shared-memory base is only 16-byte aligned; the kernel rounds it up.
  static constexpr int kSmemLimit = 227 * 1024;
  static constexpr int kQOffset = 0;
  static constexpr int kKOffset = kQOffset + QTile::kBytes;
  static constexpr int kVOffset = kKOffset + kStages * KvTile::kBytes;
  static constexpr int kOOffset = kVOffset + kStages * KvTile::kBytes;
  static constexpr int kOBytes = kConsumerWarpgroups * OTile::kBytes;
  static constexpr bool kStageOutput =
      !kSplitKeys && kOOffset + kOBytes + static_cast<int>(sizeof(Barriers)) + 1024 <= kSmemLimit;
  static constexpr int kBarrierOffset = kOOffset + (kStageOutput ? kOBytes : 0);
  static constexpr int kSmemBytes = kBarrierOffset + static_cast<int>(sizeof(Barriers)) + 1024;

  static_assert(kBlockN % 16 == 0 && kHeadDim % 64 == 0, "whole wgmma k-steps and swizzle atoms");
  static_assert(kConsumerWarpgroups == 2 || kConsumerWarpgroups == 3,
                "two or three consumer warpgroups");
  static_assert(kSmemBytes <= kSmemLimit, "shared memory plan exceeds an SM");
};

// The named barriers of this kernel (hardware ids; 0 is __syncthreads).
enum class FwdBarrier : uint32_t {
  kScheduler0 = kFirstNamedBarrier,  // consumer 0 may issue its products (256 threads: it and the
                                     // consumer before it, which passes the turn)
  kScheduler1,                       // consumer 1 may issue its matrix products
  kScheduler2,                       // consumer 2 (of three) may issue its matrix products
  kOutput0,  // consumer c's own (kOutput0 + c, its 128 threads): its staging tile free, then written;
             // Q's padding rows zeroed (consumer_warpgroup's start)
};

// The tiles a CTA walks: tile blockIdx.x first, then either every gridDim.x-th after it (the static
// round robin) or, with a counter (the dynamic scheduler), the next one that no CTA has taken:
// gridDim.x + a count that every CTA adds to, so that tiles go out in TileOrder to whichever SM frees
// up first, as the hardware hands out one-tile CTAs, but without a CTA start per tile. The producer
// warp takes the tiles and publishes each to the consumers with its Q (Barriers::tile, q_full), so
// that both walk the same ones.
//
// Called by the producer warp (every lane) after a tile's copies are issued, where it would wait for
// the consumers to free Q anyway, so the atomic's round trip costs nothing. Every walked tile is
// followed by one take, so a launch's takes number num_tiles, and the one that returns
// num_tiles - 1 is the last: it stores 0 back for the next launch on the counter.
__device__ __forceinline__ int take_next_tile(unsigned* counter, int linear, int num_tiles) {
  if (counter == nullptr) return linear + static_cast<int>(gridDim.x);
  unsigned taken = 0;
  if (threadIdx.x % 32 == 0) {
    taken = atomicAdd(counter, 1u);
    if (taken == static_cast<unsigned>(num_tiles) - 1u) *reinterpret_cast<volatile unsigned*>(counter) = 0u;
  }
  return static_cast<int>(gridDim.x) + static_cast<int>(__shfl_sync(0xffffffffu, taken, 0));
}

template <typename Traits>
__device__ __forceinline__ void producer_warp(const FwdParams& params, uint32_t smem,
                                              typename Traits::Barriers& bars, int num_tiles) {
  using QTile = typename Traits::QTile;
  using KvTile = typename Traits::KvTile;
  constexpr int kBlockN = Traits::kBlockN;
  const FwdProblem& p = params.problem;
  const int lane = static_cast<int>(threadIdx.x) % 32;
  const bool varlen = p.cu_seqlens_q != nullptr;

  if (lane == 0) {
    tma_prefetch_map(params.q_map);
    tma_prefetch_map(params.k_map);
    tma_prefetch_map(params.v_map);
    if (Traits::kStageOutput) tma_prefetch_map(params.o_map);
  }
  RingCursor<Traits::kStages> cursor;
  uint32_t tail_phase = 0;
  uint32_t q_loads = 0;
  FwdTile tile{};  // (assigned per tile below; initialized so that the lambdas capture no indeterminate value)
  int batch = 0;
  // V of key block n_block into the stage of `at`.
  auto load_v = [&](int n_block, const RingCursor<Traits::kStages>& at) {
    const int n0 = n_block * kBlockN;
    const uint32_t v_dst = smem + Traits::kVOffset + at.stage * KvTile::kBytes;
    const uint32_t v_full = smem_u32(&bars.v_full[at.stage]);
    mbarrier_wait(smem_u32(&bars.v_empty[at.stage]), at.phase ^ 1u);
    const int valid_keys = tile.len_k - n0;
    if (!varlen || valid_keys >= kBlockN) {
      if (lane == 0) {
        mbarrier_arrive_expect_tx(v_full, KvTile::kBytes);
        tma_load_tile<KvTile>(v_dst, params.v_map, v_full, varlen, tile.k_token + n0, tile.kv_head, batch);
      }
    } else {
      const uint32_t v_tail = smem_u32(&bars.v_tail);
      if (lane == 0) {
        mbarrier_arrive_expect_tx(v_tail, KvTile::kBytes);
        tma_load_tile<KvTile>(v_dst, params.v_map, v_tail, varlen, tile.k_token + n0, tile.kv_head, batch);
      }
      mbarrier_wait(v_tail, tail_phase);
      tail_phase ^= 1u;
      // Whole 128-byte rows of every column block: the swizzle only permutes chunks within a row.
      const int zero_rows = kBlockN - valid_keys;
      for (int i = lane; i < KvTile::kColumnBlocks * zero_rows * 8; i += 32) {
        const int cb = i / (zero_rows * 8);
        const int rest = i % (zero_rows * 8);
        const uint32_t addr =
            v_dst + cb * KvTile::kColumnBlockBytes + (valid_keys + rest / 8) * 128 + (rest % 8) * 16;
        asm volatile("st.shared.v4.b32 [%0], {%1, %1, %1, %1};\n" ::"r"(addr), "r"(0) : "memory");
      }
      fence_proxy_async_shared();
      __syncwarp();
      if (lane == 0) mbarrier_arrive(v_full);
    }
  };
  for (int linear = blockIdx.x; linear < num_tiles; linear = take_next_tile(params.tile_counter, linear, num_tiles)) {
    tile = FwdTile::locate<Traits::kBlockM, kBlockN, Traits::kSplitKeys>(params, linear);
    if (tile.tokens <= 0) continue;  // varlen: past the sequence; the consumers skip it too
    batch = varlen ? 0 : tile.batch;
    mbarrier_wait(smem_u32(&bars.q_empty), (q_loads & 1u) ^ 1u);
    ++q_loads;
    if (lane == 0) {
      *reinterpret_cast<volatile int*>(&bars.tile) = linear;
      bars.located = tile;
      const uint32_t q_full = smem_u32(&bars.q_full);
      if (tile.has_keys()) {  // one box per consumer: its rows in use (TileRows)
        const int tokens = params.rows.tokens_per_consumer;
        mbarrier_arrive_expect_tx(q_full, Traits::kConsumerWarpgroups * QTile::kColumnBlocks * tokens *
                                              params.rows.group * 128);
#pragma unroll
        for (int c = 0; c < Traits::kConsumerWarpgroups; ++c) {
          tma_load_grouped_tile<QTile>(smem + Traits::kQOffset + c * 64 * 128, params.q_map, q_full, varlen,
                                       tile.q_token + params.rows.consumer_tokens(tile.token0, tile.tokens, c).first,
                                       tile.head / params.rows.group, batch);
        }
      } else {
        mbarrier_arrive(q_full);
      }
    }
    // Each block's V goes out one step after its K, beside the next block's K: a consumer issues
    // block n's S with block n + 1's P V (blocks walk downwards), so it needs K[n] and V[n + 1]
    // together, and V[n + 1]'s stage frees only when the P V two blocks back is done, which comes
    // after the S that frees K[n]'s stage. In K, V order the next K queued behind that V wait
    // although its own stage was free (bench/NOTES.md, sessions 10 and 15).
    // One step per block and one more for the last V (a single copy of the V code).
    int v_block = -1;  // the block whose V is still to load (none: -1), in v_cursor's stage
    RingCursor<Traits::kStages> v_cursor;
    for (int n_block = tile.n_end - 1;; --n_block) {
      const bool k_left = n_block >= tile.n_begin;
      if (k_left) {
        const uint32_t k_full = smem_u32(&bars.k_full[cursor.stage]);
        mbarrier_wait(smem_u32(&bars.k_empty[cursor.stage]), cursor.phase ^ 1u);
        if (lane == 0) {
          mbarrier_arrive_expect_tx(k_full, KvTile::kBytes);
          tma_load_tile<KvTile>(smem + Traits::kKOffset + cursor.stage * KvTile::kBytes, params.k_map, k_full,
                                varlen, tile.k_token + n_block * kBlockN, tile.kv_head, batch);
        }
      }
      if (v_block >= 0) load_v(v_block, v_cursor);
      if (!k_left) break;
      v_block = n_block;
      v_cursor = cursor;
      cursor.advance();
    }
  }
  // The walk's end, published like a tile.
  mbarrier_wait(smem_u32(&bars.q_empty), (q_loads & 1u) ^ 1u);
  if (lane == 0) {
    *reinterpret_cast<volatile int*>(&bars.tile) = num_tiles;
    mbarrier_arrive(smem_u32(&bars.q_full));
  }
}

// The turn of consumer `consumer` of kConsumers (a ring: 0, 1, [2,] 0, ...): wait for it before
// issuing matrix products, pass it to the next consumer after.
template <int kConsumers>
struct ConsumerTurn {
  uint32_t mine;
  uint32_t next;

  __device__ __forceinline__ explicit ConsumerTurn(int consumer)
      : mine(static_cast<uint32_t>(FwdBarrier::kScheduler0) + consumer),
        next(static_cast<uint32_t>(FwdBarrier::kScheduler0) +
             (kConsumers == 2 ? 1 - consumer : (consumer + 1) % kConsumers)) {}
  __device__ __forceinline__ void wait() const { named_barrier_sync(mine, 2 * kWarpgroupThreads); }
  __device__ __forceinline__ void pass() const { named_barrier_arrive(next, 2 * kWarpgroupThreads); }
};

// S = Q K^T for this warpgroup's 64 rows, issued (not waited for).
template <typename Traits>
__device__ __forceinline__ void issue_qk(float* acc_s, uint32_t sQ_rows, uint32_t sK) {
  using QTile = typename Traits::QTile;
  using KvTile = typename Traits::KvTile;
  issue_k_major_product<typename Traits::Element, Traits::kBlockN, Traits::kHeadDim,
                        QTile::kColumnBlockBytes, KvTile::kColumnBlockBytes>(acc_s, sQ_rows, sK);
}

// O += P V, P from registers, issued (not waited for).
template <typename Traits>
__device__ __forceinline__ void issue_pv(float* acc_o, const uint32_t (&p_frag)[Traits::kBlockN / 16][4],
                                         uint32_t sV) {
  using KvTile = typename Traits::KvTile;
  issue_register_product<typename Traits::Element, Traits::kHeadDim, Traits::kBlockN,
                         KvTile::kColumnBlockBytes>(acc_o, p_frag, sV);
  wgmma_commit();
}

// The probabilities of two adjacent 8-key groups, packed to 16 bits, are one k-step of the A
// operand; with dropout, the halves that drop_marks (the block's) drop are zeroed.
template <typename Traits>
__device__ __forceinline__ void pack_probabilities(const float (&s)[1][Traits::kNTiles][4],
                                                   uint32_t (&p_frag)[Traits::kBlockN / 16][4],
                                                   const uint32_t (&drop_marks)[Traits::kBlockN / 32][4]) {
  using Element = typename Traits::Element;
#pragma unroll
  for (int kk = 0; kk < Traits::kBlockN / 16; ++kk) {
    p_frag[kk][0] = sm80::pack2<Element>(s[0][2 * kk][0], s[0][2 * kk][1]);
    p_frag[kk][1] = sm80::pack2<Element>(s[0][2 * kk][2], s[0][2 * kk][3]);
    p_frag[kk][2] = sm80::pack2<Element>(s[0][2 * kk + 1][0], s[0][2 * kk + 1][1]);
    p_frag[kk][3] = sm80::pack2<Element>(s[0][2 * kk + 1][2], s[0][2 * kk + 1][3]);
  }
  if constexpr (Traits::kDropout) sm80::drop_packed_pairs(p_frag, drop_marks);
}

// The staged epilogue: consumer `consumer`'s 64 normalized rows of O into its staging tile at
// `staging`, then out to O. The warpgroup's first thread first waits until its previous tile's TMA
// store has read the staging tile (long done in practice: a tile's main loop lies between); the
// first barrier tells the warpgroup so, the second publishes the tile. Then one TMA store per
// 64-column block, issued by that thread; except for a varlen tile whose 64 rows reach past its
// sequence (the packed tensor's map would write them into the next sequence's rows): there the
// warpgroup copies the rows inside the sequence out of the tile in 16-byte chunks. (Both cases go
// through the staging tile: a second, register epilogue beside it made ptxas move the main loop's
// descriptor arithmetic off the uniform datapath, +13-26 instructions per block.)
template <typename Traits>
__device__ __forceinline__ void store_output_staged(const FwdParams& params, const float* acc_o, uint32_t staging,
                                                    const FwdTile& tile, int consumer, int warp) {
  using OTile = typename Traits::OTile;
  using Element = typename Traits::Element;
  const FwdProblem& p = params.problem;
  const uint32_t barrier = static_cast<uint32_t>(FwdBarrier::kOutput0) + consumer;
  const int thread = static_cast<int>(threadIdx.x) % kWarpgroupThreads;
  if (thread == 0) tma_store_wait_read<0>();
  named_barrier_sync(barrier, kWarpgroupThreads);
  store_accumulator_tile<Element, Traits::kHeadDim>(acc_o, staging, warp);
  fence_proxy_async_shared();
  named_barrier_sync(barrier, kWarpgroupThreads);
  const int group = params.rows.group;
  const TileRows::ConsumerTokens rows = params.rows.consumer_tokens(tile.token0, tile.tokens, consumer);
  if (p.cu_seqlens_q == nullptr || rows.count == params.rows.tokens_per_consumer) {
    if (thread == 0) {
      const int token = tile.q_token + rows.first;
      const int head_group = tile.head / group;
      // One box per 64-column block, as for_each_column_block (tma.cuh) walks them, but written
      // out: with that lambda here (it captures the epilogue's state by reference) ptxas schedules
      // d128's dropout main loop differently, a third of the Philox draw above the row maxima, and
      // p = 0.1 ran 10-12% slower (H200, bench/NOTES.md, session 29). The p = 0 kernels compile
      // to the same code either way.
#pragma unroll
      for (int cb = 0; cb < OTile::kColumnBlocks; ++cb) {
        const uint32_t block = staging + cb * OTile::kColumnBlockBytes;
        const int column = cb * kSwizzleAtomElements;
        if (p.cu_seqlens_q != nullptr) {
          tma_store_4d(params.o_map, block, column, 0, token, head_group);
        } else {
          tma_store_5d(params.o_map, block, column, 0, token, head_group, tile.batch);
        }
      }
      tma_store_commit();
    }
  } else {
    const int chunks = p.head_dim / 8;  // the columns past head_dim are padding
    Element* out = static_cast<Element*>(p.out) + tile.batch * p.out_batch_stride + tile.head * p.out_head_stride;
    for (int i = thread; i < rows.count * group * chunks; i += kWarpgroupThreads) {
      const int row = i / chunks;  // rows (token, head in group) of the warpgroup, in order
      const int chunk = i % chunks;
      const int64_t token = tile.q_token + rows.first + row / group;
      uint4 v;
      asm volatile("ld.shared.v4.b32 {%0, %1, %2, %3}, [%4];\n"
                   : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
                   : "r"(staging + OTile::chunk_offset(row, chunk)));
      *reinterpret_cast<uint4*>(out + (row % group) * p.out_head_stride + token * p.out_row_stride + chunk * 8) = v;
    }
  }
}

// The register epilogue (families without room for a staging tile: d256): one row half of a
// warp's normalized O, 16 bytes per store. The quad's four lanes hold two columns each of every
// 8-column chunk of their row; for each group of four chunks a 4 x 4 transpose in two xor-shuffle
// rounds gives lane t all of chunk 4j + t, so that one store writes 64 contiguous bytes of each of
// the warp's 8 rows, where 4-byte stores wrote 16: a quarter of the store instructions and of their
// L1 wavefronts (the 4-byte stores took ~9,000 cycles per tile at d256, while the tensor cores
// idled; bench/NOTES.md, session 13). The shuffles run on every lane; the stores only where the row
// lies inside the sequence (`row_inside`) and the chunk inside head_dim.
template <typename Element, int kDTiles>
__device__ __forceinline__ void store_output_row_half(const float (&acc_o)[kDTiles][4], int half, Element* out_row,
                                                      bool row_inside, int head_chunks, int t) {
  static_assert(kDTiles % 4 == 0, "chunks go out in groups of four");
#pragma unroll
  for (int j = 0; j < kDTiles / 4; ++j) {
    uint32_t x[4];  // x[k]: this lane's two columns of chunk 4j + k; after the rounds, chunk 4j + t
#pragma unroll
    for (int k = 0; k < 4; ++k) x[k] = sm80::pack2<Element>(acc_o[4 * j + k][2 * half], acc_o[4 * j + k][2 * half + 1]);
#pragma unroll
    for (int m = 1; m <= 2; m *= 2) {
      // Each pair (k, k + m): the lane whose bit m is clear keeps x[k] and trades its x[k + m] for
      // the partner's x[k]; the other keeps x[k + m] and trades its x[k].
      const bool upper = (t & m) != 0;
#pragma unroll
      for (int k = 0; k < 4; ++k) {
        if (k & m) continue;
        const uint32_t received = __shfl_xor_sync(0xffffffffu, upper ? x[k] : x[k + m], m);
        if (upper) {
          x[k] = received;
        } else {
          x[k + m] = received;
        }
      }
    }
    const int chunk = 4 * j + t;
    if (row_inside && chunk < head_chunks) {
      *reinterpret_cast<uint4*>(out_row + 8 * chunk) = make_uint4(x[0], x[1], x[2], x[3]);
    }
  }
}

// The split epilogue (Traits::kSplitKeys): this thread's two rows of its warp's 16 (their
// TileRows::code in row_codes), normalized, as fp32 partial rows of split tile.split:
// FwdParams::split_lse / split_out at row ((split x batch + b) x heads_q + head) x seqlen_q + token,
// the decode workspace's order, which the combine pass reads. Rows past the sequence (which the
// combine skips) and columns past head_dim are not written. A split that sees none of a row's keys
// writes its lse -inf and zeros (finalize), weight 0.
template <typename Traits>
__device__ __forceinline__ void store_split_partials(const FwdParams& params, const float (&acc_o)[Traits::kDTiles][4],
                                                     const float (&lse)[2], const FwdTile& tile,
                                                     const int (&row_codes)[2], int lane) {
  const FwdProblem& p = params.problem;
  const int t = lane % 4;
#pragma unroll
  for (int half = 0; half < 2; ++half) {
    const int token = TileRows::token(row_codes[half]);
    if (token >= tile.tokens) continue;
    const int head = tile.head + TileRows::head(row_codes[half]);
    const int64_t partial_row =
        ((static_cast<int64_t>(tile.split) * p.batch + tile.batch) * p.heads_q + head) * p.seqlen_q +
        tile.token0 + token;
    if (t == 0) params.split_lse[partial_row] = lse[half];
    float* out = params.split_out + partial_row * p.head_dim + 2 * t;
#pragma unroll
    for (int dt = 0; dt < Traits::kDTiles; ++dt) {
      if (dt * 8 < p.head_dim) {
        *reinterpret_cast<float2*>(out + dt * 8) = make_float2(acc_o[dt][2 * half], acc_o[dt][2 * half + 1]);
      }
    }
  }
}

// kPipelined: the schedule of the header (one block of software pipelining + turns). Otherwise
// each block runs S, softmax, O += P V back to back (the first version; kept to measure the
// schedule against, selected by FLASHKIT_SM90_SCHEDULE=serial).
template <typename Traits, bool kPipelined>
__device__ __forceinline__ void consumer_warpgroup(const FwdParams& params, uint32_t smem,
                                                   typename Traits::Barriers& bars, int num_tiles,
                                                   int consumer) {
  using Element = typename Traits::Element;
  using KvTile = typename Traits::KvTile;
  using Cursor = RingCursor<Traits::kStages>;
  constexpr int kBlockM = Traits::kBlockM;
  constexpr int kBlockN = Traits::kBlockN;
  constexpr int kHeadDim = Traits::kHeadDim;
  constexpr int kNTiles = Traits::kNTiles;
  constexpr int kDTiles = Traits::kDTiles;
  constexpr float kLog2e = 1.4426950408889634f;
  const FwdProblem& p = params.problem;
  const int lane = static_cast<int>(threadIdx.x) % 32;
  const int warp = (static_cast<int>(threadIdx.x) / 32) % 4;  // within the warpgroup
  const int row0 = consumer * 64;  // this warpgroup's first row in a tile
  const int warp_row0 = row0 + warp * 16;
  const uint32_t sQ_rows = smem + Traits::kQOffset + row0 * 128;
  auto k_tile = [&](const Cursor& c) { return smem + Traits::kKOffset + c.stage * KvTile::kBytes; };
  auto v_tile = [&](const Cursor& c) { return smem + Traits::kVOffset + c.stage * KvTile::kBytes; };
  // One arrival per consumer warp frees a stage's K (or V) for the producer.
  auto release = [&](uint64_t& empty) {
    __syncwarp();
    if (lane == 0) mbarrier_arrive(smem_u32(&empty));
  };
  // Q and the published tile (Barriers::tile, located), which every thread read at the tile's
  // start: each thread arrives, not one per warp as for K and V. The producer overwrites the tile
  // after q_empty's wait, so one arrival per warp after a __syncwarp orders that on the hardware
  // too, but compute-sanitizer's racecheck takes an mbarrier as ordering only the arriving thread's
  // accesses, and reported the other lanes' reads against the producer's next stores wherever a
  // CTA walks several tiles (bench/NOTES.md, sessions 16 and 17).
  auto release_q = [&] { mbarrier_arrive(smem_u32(&bars.q_empty)); };
  const ConsumerTurn<Traits::kConsumerWarpgroups> turn(consumer);
  constexpr int kLastConsumer = Traits::kConsumerWarpgroups - 1;
  // Read once: with a device rng_state the dropout key is in global memory.
  const DropoutMask dropout_mask = Traits::kDropout ? p.dropout_mask() : DropoutMask{};
  [[maybe_unused]] const sm80::DropMarker drop_marker(dropout_mask);
  Cursor ring;  // the next K/V stage to consume, continued across tiles
  uint32_t q_loads = 0;

  // Each warpgroup's rows' codes (TileRows::code), and Q's padding rows (where G does not divide
  // 64), which no load writes, zero, so that their scores are finite. (A row is 128 bytes of its
  // column block whatever the swizzle.)
  {
    const int thread = static_cast<int>(threadIdx.x) % kWarpgroupThreads;
    if (thread < 64) bars.row_codes[row0 + thread] = static_cast<uint16_t>(params.rows.code(row0 + thread));
    const int used = params.rows.tokens_per_consumer * params.rows.group;
    for (int i = thread; i < Traits::QTile::kColumnBlocks * (64 - used) * 8; i += kWarpgroupThreads) {
      const int cb = i / ((64 - used) * 8);
      const int rest = i % ((64 - used) * 8);
      const uint32_t addr = sQ_rows + cb * Traits::QTile::kColumnBlockBytes + (used + rest / 8) * 128 + (rest % 8) * 16;
      asm volatile("st.shared.v4.b32 [%0], {%1, %1, %1, %1};\n" ::"r"(addr), "r"(0) : "memory");
    }
    fence_proxy_async_shared();
    named_barrier_sync(static_cast<uint32_t>(FwdBarrier::kOutput0) + consumer, kWarpgroupThreads);
  }
  // The code of this lane's row `half` (of its two in the warp's 16 rows).
  auto row_code = [&](int half) { return static_cast<int>(bars.row_codes[warp_row0 + lane / 4 + 8 * half]); };

  for (;;) {
    // The producer's next tile, and its Q (take_next_tile).
    mbarrier_wait(smem_u32(&bars.q_full), q_loads & 1u);
    ++q_loads;
    const int linear = *reinterpret_cast<volatile int*>(&bars.tile);
    if (linear >= num_tiles) break;
    const FwdTile tile = bars.located;
    FLASHKIT_FWD_TRACE(0, clock64());
    FLASHKIT_FWD_TRACE(6, trace_global_ns());
    FLASHKIT_FWD_TRACE(7, trace_sm_id());
    FLASHKIT_FWD_TRACE(9, tile.n_end - tile.n_begin);
    // This warpgroup's tokens of the tile, [first_token, first_token + tokens) (TileRows); without
    // packing, row r of the tile is token tile.token0 + r (ALiBi and dropout never pack).
    const TileRows::ConsumerTokens own = params.rows.consumer_tokens(tile.token0, tile.tokens, consumer);
    const int first_token = own.first;
    const int tokens = own.count;
    const sm80::KeyWindow window{tile.len_q, tile.len_k, p.window_left, p.window_right};
    const float alibi_slope =
        p.alibi_slopes != nullptr ? p.alibi_slopes[tile.batch * p.alibi_batch_stride + tile.head] : 0.0f;
    const bool transform = p.softcap > 0.0f || alibi_slope != 0.0f;
    const int diagonal = window.diagonal_offset();
    // Scores are exponentiated as exp2(x * log2_scale - ...). Without softcap or ALiBi, x is the raw
    // dot product and the softmax scale folds into log2_scale; with them, x is already scaled.
    const float log2_scale = transform ? kLog2e : p.softmax_scale * kLog2e;

    float acc_o[1][kDTiles][4];
    sm80::zero_accumulators(acc_o);
    sm80::OnlineSoftmax<1, kNTiles, kDTiles> softmax;
    softmax.init();
    // Dropout: the drop marks of the block softmax_block last saw, for pack_probabilities.
    [[maybe_unused]] uint32_t drop_marks[kBlockN / 32][4];
    // Scores of the block at key n0 -> probabilities (in place); returns whether O must be
    // rescaled (factors in `rescale`).
    // (ALiBi's rows are tokens: it never runs packed.)
    auto softmax_block = [&](float (&acc_s)[1][kNTiles][4], int n0, float (&rescale)[2]) {
      if (transform) {
        sm80::transform_scores<Traits>(acc_s, p, tile.token0 + warp_row0, n0, alibi_slope, diagonal);
      }
      if (!window.block_unmasked(tile.token0, tile.token0 + tile.tokens, n0, n0 + kBlockN)) {
        const int row_tokens[1][2] = {
            {tile.token0 + TileRows::token(row_code(0)), tile.token0 + TileRows::token(row_code(1))}};
        sm80::mask_scores<Traits>(acc_s, window, row_tokens, n0);
      }
      bool any;
      if constexpr (Traits::kRowByRowSoftmax) {
        any = softmax.advance_max_and_exponentiate(acc_s, log2_scale, rescale);
      } else {
        any = softmax.advance_max(acc_s, log2_scale, rescale);
        softmax.exponentiate(acc_s, log2_scale);
      }
      if constexpr (Traits::kDropout) {
        sm80::draw_drop_marks(drop_marks, dropout_mask, drop_marker,
                              static_cast<uint32_t>(tile.batch * p.heads_q + tile.head), tile.token0 + warp_row0,
                              n0);
      }
      return any;
    };

    // A consumer whose 64 rows all lie past the sequence's end (the last tile of a sequence whose
    // length is not a multiple of kBlockM) computes nothing: it only makes the handshakes its
    // products would have made, in the pipelined schedule's order (the K and V stages of each block,
    // the turns, Q), so that the other consumers' products have the tensor cores to themselves.
    // Its output rows are never stored and its LSE rows never written.
    const bool rows_here = !kPipelined || !Traits::kSkipIdleRows || tokens > 0;
    if (!tile.has_keys()) release_q();  // the producer may publish the next tile
    if (Traits::kSkipIdleRows && tile.has_keys() && !rows_here) {
      if (consumer == kLastConsumer) turn.pass();
      Cursor cursor = ring;
      mbarrier_wait(smem_u32(&bars.k_full[cursor.stage]), cursor.phase);
      turn.wait();
      turn.pass();
      release(bars.k_empty[cursor.stage]);
      for (int n_block = tile.n_end - 2; n_block >= tile.n_begin; --n_block) {
        const Cursor previous = cursor;
        cursor.advance();
        mbarrier_wait(smem_u32(&bars.k_full[cursor.stage]), cursor.phase);
        mbarrier_wait(smem_u32(&bars.v_full[previous.stage]), previous.phase);
        turn.wait();
        turn.pass();
        release(bars.k_empty[cursor.stage]);
        release(bars.v_empty[previous.stage]);
      }
      release_q();
      mbarrier_wait(smem_u32(&bars.v_full[cursor.stage]), cursor.phase);
      turn.wait();
      if (consumer != kLastConsumer) turn.pass();
      release(bars.v_empty[cursor.stage]);
      // The ring moves on by the tile's blocks (counted again; the walk's own cursor is not carried
      // out of it, the form whose SASS was checked and measured).
      for (int n_block = tile.n_end - 1; n_block >= tile.n_begin; --n_block) ring.advance();
    }
    if (tile.has_keys() && rows_here) {
      FLASHKIT_FWD_TRACE(1, clock64());
      float acc_s[1][kNTiles][4];
      float rescale[2];
      if constexpr (!kPipelined) {
        uint32_t p_frag[kBlockN / 16][4];
        for (int n_block = tile.n_end - 1; n_block >= tile.n_begin; --n_block) {
          mbarrier_wait(smem_u32(&bars.k_full[ring.stage]), ring.phase);
          wgmma_fence();
          issue_qk<Traits>(&acc_s[0][0][0], sQ_rows, k_tile(ring));
          wgmma_wait<0>();
          wgmma_fence_registers<kBlockN / 2>(&acc_s[0][0][0]);
          release(bars.k_empty[ring.stage]);
          if (softmax_block(acc_s, n_block * kBlockN, rescale)) softmax.rescale_output(acc_o, rescale);
          pack_probabilities<Traits>(acc_s, p_frag, drop_marks);
          mbarrier_wait(smem_u32(&bars.v_full[ring.stage]), ring.phase);
          wgmma_fence();
          issue_pv<Traits>(&acc_o[0][0][0], p_frag, v_tile(ring));
          wgmma_wait<0>();
          wgmma_fence_registers<kHeadDim / 2>(&acc_o[0][0][0]);
          release(bars.v_empty[ring.stage]);
          ring.advance();
        }
        release_q();
      } else {
        if (consumer == kLastConsumer) turn.pass();  // consumer 0 takes the tile's first turn
        Cursor cursor = ring;  // the block whose scores are being computed
        Cursor previous;       // the block whose P V is pending
        // The blocks of the tile that none of this consumer's rows sees get the idle rows'
        // handshakes only (each block's K and V, its turn), so that the tensor cores and MUFU skip
        // products and exponentials of scores that are all masked; the pipeline runs on the
        // blocks [n_stop, n_block] between, at least one, whose masking handles rows that see no
        // key at all.
        // - Leading blocks (walked first, before the pipeline): right of a causal diagonal that
        //   cuts a tile taller than a key block (d64's 192 rows over 128 keys, d256's 128 over 80
        //   or 64). Tiles as tall as a key block are left as they were: under a causal mask with
        //   aligned lengths every consumer sees every block of its tile.
        // - Trailing blocks (after the pipeline): left of a sliding window's edge, which a lower
        //   consumer's rows pass sooner (Traits::kSkipTrailingBlocks: its own instance, because
        //   the handshakes after the pipeline cost the loop 5 instructions per block, ~1% of
        //   cycles, also where there is nothing to skip).
        // The leading count goes through a shuffle, so that ptxas knows it to be warp-uniform
        // (computed from the consumer's rows alone, it spilled 128-176 B in the d256 kernels), and
        // the stop block through a warp max, whose REDUX leaves it in a uniform register beside
        // the tile's own bounds (through a shuffle, the d256 kernels spilled 124-176 B in the loop
        // when they took the trailing skip).
        int n_block = tile.n_end - 1;
        int n_stop = tile.n_begin;
        if constexpr (kBlockM > kBlockN) {
          const int seen_end = (window.key_end(first_token + tokens - 1) + kBlockN - 1) / kBlockN;
          const int spare_blocks = tile.n_end - 1 - tile.n_begin;  // all but one
          const int unseen_blocks =
              __shfl_sync(0xffffffffu, min(tile.n_end - seen_end, spare_blocks), 0);
          if constexpr (Traits::kSkipTrailingBlocks) {
            const int seen_begin = window.key_begin(first_token) / kBlockN;
            const int trailing = min(seen_begin - tile.n_begin, spare_blocks - unseen_blocks);
            n_stop = __reduce_max_sync(0xffffffffu, tile.n_begin + trailing);
          }
          for (int unseen = unseen_blocks; unseen > 0; --unseen) {
            mbarrier_wait(smem_u32(&bars.k_full[cursor.stage]), cursor.phase);
            turn.wait();
            turn.pass();
            release(bars.k_empty[cursor.stage]);
            mbarrier_wait(smem_u32(&bars.v_full[cursor.stage]), cursor.phase);
            release(bars.v_empty[cursor.stage]);
            cursor.advance();
            --n_block;
          }
        }
        uint32_t p_frag[Traits::kPBuffers][kBlockN / 16][4];

        mbarrier_wait(smem_u32(&bars.k_full[cursor.stage]), cursor.phase);
        turn.wait();
        wgmma_fence();
        issue_qk<Traits>(&acc_s[0][0][0], sQ_rows, k_tile(cursor));
        turn.pass();
        wgmma_wait<0>();
        wgmma_fence_registers<kBlockN / 2>(&acc_s[0][0][0]);
        release(bars.k_empty[cursor.stage]);
        FLASHKIT_FWD_TRACE(2, clock64());
        softmax_block(acc_s, n_block * kBlockN, rescale);  // O is still zero: nothing to rescale
        pack_probabilities<Traits>(acc_s, p_frag[0], drop_marks);
        if constexpr (Traits::kShortChain) {
          // Each iteration starts with its K and V landed: here for the first, and for the others
          // at the end of the one before.
          Cursor next = cursor;
          next.advance();
          if (n_block > n_stop) mbarrier_wait(smem_u32(&bars.k_full[next.stage]), next.phase);
          mbarrier_wait(smem_u32(&bars.v_full[cursor.stage]), cursor.phase);
        }
#ifdef FLASHKIT_SM90_FWD_TRACE
        long long loop_mark[kTraceLoopPhases + 1];
        long long loop_sum[kTraceLoopPhases] = {};
        long long loop_early[3] = {};
        int loop_count = 0;
        long long loop_kv_begin = 0;
        long long loop_v_begin = 0;
        long long loop_k_late = 0;
        long long loop_v_late = 0;
#endif
        // Block n_block: S = Q K^T and the previous block's P V (P from p_pending), the softmax, P
        // packed into p_next. With kShortChain p_next is the other buffer and the pack is written
        // before P V's wait (ptxas places it after; the point is that the softmax then has no
        // dependence on P V, see the traits), and the next iteration's K and V barriers are tested
        // right after the products are issued and waited for only after the softmax, so that the
        // test's latency runs under it; otherwise an iteration waits for its own K and V first and
        // packs after P V's wait.
        auto iteration = [&](const uint32_t(&p_pending)[kBlockN / 16][4], uint32_t(&p_next)[kBlockN / 16][4]) {
          FLASHKIT_FWD_LOOP_MARK(0);
          previous = cursor;
          cursor.advance();
          Cursor next = cursor;
          next.advance();
          const bool more = n_block > n_stop;
          if constexpr (!Traits::kShortChain) {
            mbarrier_wait(smem_u32(&bars.k_full[cursor.stage]), cursor.phase);
            mbarrier_wait(smem_u32(&bars.v_full[previous.stage]), previous.phase);
          }
          FLASHKIT_FWD_LOOP_MARK(1);
          turn.wait();
          FLASHKIT_FWD_LOOP_MARK(2);
          wgmma_fence();
          issue_qk<Traits>(&acc_s[0][0][0], sQ_rows, k_tile(cursor));
          issue_pv<Traits>(&acc_o[0][0][0], p_pending, v_tile(previous));
          turn.pass();
          bool k_ready = true;
          bool v_ready = true;
          if constexpr (Traits::kShortChain) {
            k_ready = !more || mbarrier_test(smem_u32(&bars.k_full[next.stage]), next.phase);
            v_ready = mbarrier_test(smem_u32(&bars.v_full[cursor.stage]), cursor.phase);
          }
          FLASHKIT_FWD_LOOP_MARK(3);
          wgmma_wait<1>();  // S of this block (issued first) has landed; P V may still run
          wgmma_fence_registers<kBlockN / 2>(&acc_s[0][0][0]);
          release(bars.k_empty[cursor.stage]);
          FLASHKIT_FWD_LOOP_MARK(4);
          const bool any_rescale = softmax_block(acc_s, n_block * kBlockN, rescale);
          if constexpr (Traits::kShortChain) pack_probabilities<Traits>(acc_s, p_next, drop_marks);
          FLASHKIT_FWD_LOOP_KV_WAIT();
          if (!k_ready) mbarrier_wait(smem_u32(&bars.k_full[next.stage]), next.phase);
          FLASHKIT_FWD_LOOP_V_WAIT();
          if (!v_ready) mbarrier_wait(smem_u32(&bars.v_full[cursor.stage]), cursor.phase);
          FLASHKIT_FWD_LOOP_MARK(5);
          wgmma_wait<0>();
          wgmma_fence_registers<kHeadDim / 2>(&acc_o[0][0][0]);
          FLASHKIT_FWD_LOOP_MARK(6);
          if (any_rescale) softmax.rescale_output(acc_o, rescale);
          release(bars.v_empty[previous.stage]);
          if constexpr (!Traits::kShortChain) pack_probabilities<Traits>(acc_s, p_next, drop_marks);
          FLASHKIT_FWD_LOOP_MARK(7);
          FLASHKIT_FWD_LOOP_SUM();
        };
        // With two P buffers, two iterations per trip, so that they swap roles without copies.
        constexpr int kSecond = Traits::kPBuffers - 1;
        bool last_p_in_second = false;
        if constexpr (Traits::kPBuffers == 2) {
          for (;;) {
            if (--n_block < n_stop) break;
            iteration(p_frag[0], p_frag[1]);
            if (--n_block < n_stop) {
              last_p_in_second = true;
              break;
            }
            iteration(p_frag[1], p_frag[0]);
          }
        } else {
          for (--n_block; n_block >= n_stop; --n_block) iteration(p_frag[0], p_frag[0]);
        }
        FLASHKIT_FWD_LOOP_STORE();
        release_q();  // every S of the tile has completed
        FLASHKIT_FWD_TRACE(3, clock64());

        if constexpr (!Traits::kShortChain) mbarrier_wait(smem_u32(&bars.v_full[cursor.stage]), cursor.phase);
        turn.wait();
        wgmma_fence();
        // (The branch is uniform across the warpgroup: both arms issue the same aligned wgmmas.)
        if (last_p_in_second) {
          issue_pv<Traits>(&acc_o[0][0][0], p_frag[kSecond], v_tile(cursor));
        } else {
          issue_pv<Traits>(&acc_o[0][0][0], p_frag[0], v_tile(cursor));
        }
        const int trailing_blocks = n_stop - tile.n_begin;
        // Every consumer but the last passes the tile's last turn on; the last one passes it to
        // consumer 0 at the next tile's start.
        if (consumer != kLastConsumer || trailing_blocks > 0) turn.pass();
        wgmma_wait<0>();
        wgmma_fence_registers<kHeadDim / 2>(&acc_o[0][0][0]);
        release(bars.v_empty[cursor.stage]);
        cursor.advance();
        for (int trailing = trailing_blocks; trailing > 0; --trailing) {
          mbarrier_wait(smem_u32(&bars.k_full[cursor.stage]), cursor.phase);
          turn.wait();
          if (trailing > 1 || consumer != kLastConsumer) turn.pass();
          release(bars.k_empty[cursor.stage]);
          mbarrier_wait(smem_u32(&bars.v_full[cursor.stage]), cursor.phase);
          release(bars.v_empty[cursor.stage]);
          cursor.advance();
        }
        ring = cursor;
        FLASHKIT_FWD_TRACE(4, clock64());
      }
    }

    // Epilogue: normalize; O staged for a TMA store, or stored from registers in 16-byte chunks of
    // its rows (the header says when); the LSE of each row from registers.
    float lse[2];
    softmax.finalize(acc_o, log2_scale, lse, Traits::kDropout ? 1.0f / (1.0f - p.dropout_p) : 1.0f);
    if constexpr (Traits::kSplitKeys) {
      store_split_partials<Traits>(params, acc_o[0], lse, tile, {row_code(0), row_code(1)}, lane);
      FLASHKIT_FWD_TRACE(5, clock64());
      FLASHKIT_FWD_TRACE(8, trace_global_ns());
      continue;
    }
    if constexpr (Traits::kStageOutput) {
      store_output_staged<Traits>(params, &acc_o[0][0][0], smem + Traits::kOOffset + consumer * Traits::OTile::kBytes,
                                  tile, consumer, warp);
    }
    const int t = lane % 4;
    const int head_chunks = p.head_dim / 8;  // the columns past head_dim are padding
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      const int code = row_code(half);
      const bool row_inside = TileRows::token(code) < tile.tokens;
      const int token = tile.token0 + TileRows::token(code);
      const int head = tile.head + TileRows::head(code);
      if constexpr (!Traits::kStageOutput) {
        Element* out_row = static_cast<Element*>(p.out) + tile.batch * p.out_batch_stride +
                           head * p.out_head_stride + (static_cast<int64_t>(tile.q_token) + token) * p.out_row_stride;
        store_output_row_half<Element, kDTiles>(acc_o[0], half, out_row, row_inside, head_chunks, t);
      }
      if (row_inside && t == 0) {
        p.lse[tile.batch * p.lse_batch_stride + head * p.lse_head_stride + token] = lse[half];
      }
    }
    FLASHKIT_FWD_TRACE(5, clock64());
    FLASHKIT_FWD_TRACE(8, trace_global_ns());
  }
  // The copy engine must have read the last staging tile before the CTA's shared memory goes away
  // (its writes to O are visible when the kernel ends).
  if (Traits::kStageOutput && threadIdx.x % kWarpgroupThreads == 0) tma_store_wait_read<0>();
}

template <typename Traits, bool kPipelined>
__global__ void __launch_bounds__(Traits::kThreads, 1)
    fwd_kernel(const __grid_constant__ FwdParams params, int num_tiles) {
  using Barriers = typename Traits::Barriers;
  extern __shared__ unsigned char smem_raw[];
  const uint32_t raw = smem_u32(smem_raw);
  const uint32_t smem = (raw + 1023u) & ~1023u;
  Barriers& bars = *reinterpret_cast<Barriers*>(smem_raw + (smem - raw) + Traits::kBarrierOffset);

  if (threadIdx.x == 0) {
    mbarrier_init(smem_u32(&bars.q_full), 1);
    mbarrier_init(smem_u32(&bars.q_empty), Traits::kConsumerWarps * 32);  // every consumer thread
    mbarrier_init(smem_u32(&bars.v_tail), 1);
#pragma unroll
    for (int s = 0; s < Traits::kStages; ++s) {
      mbarrier_init(smem_u32(&bars.k_full[s]), 1);
      mbarrier_init(smem_u32(&bars.v_full[s]), 1);
      mbarrier_init(smem_u32(&bars.k_empty[s]), Traits::kConsumerWarps);
      mbarrier_init(smem_u32(&bars.v_empty[s]), Traits::kConsumerWarps);
    }
    mbarrier_init_fence();
  }
  __syncthreads();

  // With kSkipIdleRows through a shuffle, so that ptxas knows it to be warp-uniform: derived from
  // threadIdx.x alone, the branch on a consumer's rows (consumer_warpgroup) kept the main loop's
  // descriptor arithmetic off the uniform datapath, and spilled. (At d256, which does not skip, the
  // shuffle alone made the dropout kernel spill 92 B.)
  const int thread_warpgroup = static_cast<int>(threadIdx.x) / kWarpgroupThreads;
  const int warpgroup = Traits::kSkipIdleRows ? __shfl_sync(0xffffffffu, thread_warpgroup, 0) : thread_warpgroup;
  if (warpgroup == 0) {
    warpgroup_release_registers<Traits::kProducerRegisters>();
    if (threadIdx.x / 32 == 0) producer_warp<Traits>(params, smem, bars, num_tiles);
  } else {
    warpgroup_claim_registers<Traits::kConsumerRegisters>();
    consumer_warpgroup<Traits, kPipelined>(params, smem, bars, num_tiles, warpgroup - 1);
  }
}

#ifdef FLASHKIT_SM90_FWD_TRACE
}  // namespace traced
#endif
}  // namespace flashkit::sm90
