// src/cuda/sm90/fwd_sm90.h
// \brief What the sm90 (wgmma + TMA, sm_90a) forward kernels offer the dispatcher; includable from
// plain C++.
#pragma once

#include <string>

#include "common/fwd_problem.h"

namespace flashkit::sm90 {

// The head-dim families the sm90 forward is compiled for. A head dim runs in the smallest family
// that holds it: the copy engine zero-fills the columns past head_dim (the tensor map's inner extent
// is head_dim, its box the family's 64-column atoms), so they add nothing to Q K^T, and the epilogue
// writes only the first head_dim columns. Padding costs family / head_dim in matrix work.
constexpr int kFwdHeadDimFamilies[] = {64, 128, 256};

constexpr int fwd_head_dim_family(int head_dim) {
  for (int family : kFwdHeadDimFamilies) {
    if (head_dim <= family) return family;
  }
  return -1;
}

// Why the sm90 kernels cannot run `problem` (layout or options they do not cover), or "" when they
// can. Whether the (dtype, family) instance was compiled is the dispatcher's question, not this.
std::string fwd_unsupported_reason(const FwdProblem& problem);

// Grouped-query attention with a kv head's G = heads_q / heads_kv query heads packed into one tile
// (FlashAttention-3's PackGQA): the kernel's tiles then run over the (token, head) pairs of a
// (batch, kv head), each token's G query heads in G rows, so that s_q tokens fill s_q x G rows
// instead of s_q rows of each of G tiles. Each consumer warpgroup's 64 rows hold floor(64 / G)
// whole tokens (fwd_tokens_per_tile), so that its Q and O move as TMA boxes of whole tokens; where
// G does not divide 64 the rest are padding (G = 7: 63 of 64 rows in use, G = 24: 48). What it
// covers: 2 <= G <= 64, no dropout (the mask is addressed by the tile's head and rows), no ALiBi (a
// slope per tile), s_q x G below 2^31.
//
// Split keys: where the tiles fill few of the SMs and the keys are many, each tile's key blocks
// are cut into num_splits ranges, one CTA each. A split writes its rows' normalized output and
// log-sum-exp in fp32 into a workspace laid out as the decode kernel's
// (sm80::decode_workspace_layout of the problem's decode view), and the decode kernel's combine
// pass merges them into out and softmax_lse. Not with dropout (its instance does not split) or a
// sliding window's left edge (its tiles' key ranges differ, and a row sees few keys).
//
// When each pays (H200, bf16 d128, 32/8 heads, CUDA-graph timing, bench/NOTES.md session 26):
// - With G a power of two, packing never adds empty rows (G x s_q rounded up to a tile is at most
//   G times s_q rounded up). Where the unpacked tiles exceed one wave it removes up to G times the
//   empty rows' work:
//   8-64 query tokens at batch 8 and 32: 1.24x-2.24x; 200 tokens (last tile 56% empty):
//   1.03x-1.15x; d64's 192-row tiles over 512 and 2048 tokens: 1.09x and 1.02x-1.05x. With whole
//   tiles either way the GQA grid read -9% to +9% per cell, no better on the whole.
// - Where the unpacked tiles fit one wave, each has an SM to itself (and one whose rows end within
//   its first consumer's 64 skips the other's products): packed without a split, G times fewer
//   tiles run all their rows, 0.77x-0.85x at batch 1 and 4 with 32-64 tokens. Split, the packed
//   tiles read each kv head's keys once per split where the unpacked ones read them G times:
//   1.2x-2.5x the unpacked split at batch 1-4 with 16-64 tokens and 8k-32k keys, about even at
//   128-200 tokens (the same number of splits either way), 0.79x-1.33x at batch 1 with 2k keys (16
//   blocks: 4 splits either way). At batch 4 with 2k keys the unpacked tiles (128) are too many to
//   split while the packed ones (32) split 4 ways: 8-32 tokens 1.10x-1.45x unpacked (and 1.10x-1.42x
//   the decode kernel, which the route took before, session 27), but at 64 tokens 0.80x: 64
//   packed tiles split 2 ways give each CTA 2 consumers x 8 key blocks, the unpacked ones 1 x 16.
//   Fitted to those cells (session 27): a CTA's key block costs 1 + 0.3 per consumer past the
//   first (H200, d128: ~1.3-1.45 us with one, ~1.65-2 with two), and a split adds about 8 blocks
//   (the partials written and read, the combine launch: ~10-12 us).
// - Splitting at batch 1: 1.5x-3.5x the unsplit forward at 64-200 tokens and 8k-32k keys.
// So the plan (plan_fwd): problems whose unpacked tiles fill at most a wave pack where the busiest
// CTA costs less packed: its split's key blocks x (1 + kFwdConsumerBlockCost per consumer past the
// first), plus kFwdSplitCostBlocks if it splits (the splits as below; only with `can_split`, a
// workspace and the combine pass). Problems with more tiles pack where the rows in use per row run,
// G s_q / (block_m x packed tiles), beat s_q / round_up(s_q, block_m) by more than 1%, and as
// varlen also where they are no worse (each sequence's last tile is part empty; packed, one per kv
// head instead of one per query head).
// Then the keys split where the (packed or not) tiles fill at most half the SMs: as many splits as
// bring them to one wave, each of at least kFwdMinBlocksPerSplit key blocks, at most kFwdMaxSplits.
enum class PackGqa {
  kAuto,      // as said above; FLASHKIT_SM90_PACK_GQA unset
  kNever,     // FLASHKIT_SM90_PACK_GQA=0 (measurements)
  kWherever,  // FLASHKIT_SM90_PACK_GQA=1: every problem it covers (tests)
};
constexpr int kFwdMaxSplits = 128;  // sm80::kDecodeMaxSplits: the combine's limit
constexpr double kFwdConsumerBlockCost = 0.3;
constexpr double kFwdSplitCostBlocks = 8.0;
constexpr int kFwdMinBlocksPerSplit = 4;

// FLASHKIT_SM90_PACK_GQA, read at each call; throws flashkit::Error on a value other than 0 or 1.
PackGqa pack_gqa_from_env();

// FLASHKIT_SM90_SPLITS: unset or 0 for the automatic count, n >= 1 forces n wherever the forward
// can split (1: never), up to the key blocks; throws flashkit::Error on another value.
int forced_splits_from_env();

// The query tokens of one consumer warpgroup's 64 rows with `group` query heads packed per token
// (1: unpacked), and of a tile of `block_m` rows (64 per consumer).
constexpr int fwd_tokens_per_consumer(int group) { return 64 / group; }
constexpr int fwd_tokens_per_tile(int block_m, int group) { return block_m / 64 * fwd_tokens_per_consumer(group); }

// ceil(2^16 / group): the kernel's j / group as (j x reciprocal) >> 16, exact for 0 <= j < 256 and
// 1 <= group <= 64 (the error term j x (reciprocal x group - 2^16) / 2^16 stays below 1 / group).
constexpr int fwd_pack_reciprocal(int group) { return (65536 + group - 1) / group; }

// G when the sm90 forward packs `problem`'s query heads on tiles of `block_m` x `block_n` on a GPU
// of `sm_count` SMs, else 1 (the rule above).
int fwd_pack_gqa_group(const FwdProblem& problem, int block_m, int block_n, int sm_count, bool can_split,
                       PackGqa mode);

// The number of key splits for `problem` on tiles of `block_m` x `block_n` with `pack_group` query
// heads per token (1: unpacked), 1 for none (the rule above); `forced` > 0: that many wherever
// covered, up to the key blocks and kFwdMaxSplits.
int fwd_split_count(const FwdProblem& problem, int block_m, int block_n, int pack_group, int sm_count,
                    int forced);

// How one launch runs: the packing, and the key split (num_splits > 1 writes the partials into
// split_lse and split_out, the two parts of the caller's workspace in sm80::decode_workspace_layout,
// which the caller then combines; 1 runs unsplit).
struct FwdPlan {
  int pack_group = 1;  // query heads per token in a tile's rows (1: unpacked)
  int num_splits = 1;
  float* split_lse = nullptr;
  float* split_out = nullptr;
};

// The plan of `problem` (covered by the sm90 forward) on `sm_count` SMs; it splits only with
// `can_split`. The partials' pointers are the caller's to set.
FwdPlan plan_fwd(const FwdProblem& problem, int sm_count, bool can_split, PackGqa pack_mode, int forced_splits);

// Enqueues the forward pass of `problem` (device pointers, validated, covered) on the cudaStream_t
// `stream` as `plan` says (the combine pass of a split is the caller's). Instantiated once per
// (dtype, family) in a generated .cu file; see src/CMakeLists.txt.
template <DType kDType, int kHeadDimFamily>
void run_fwd(const FwdProblem& problem, const FwdPlan& plan, void* stream);

}  // namespace flashkit::sm90
