// src/api/split_heuristic.h
// \brief How many key splits a decode launch should use: a pure host function of the launch's
// shape and the GPU's size, so that it is unit-tested without a GPU.
//
// The decode kernel runs one CTA per (sequence, kv head, 16 packed query rows, split). A decode
// step is memory bound: it is fast when every SM streams K/V, and when no SM idles through a ragged
// last wave. Splitting the keys multiplies the CTAs at the price of a combine pass (small: fp32
// partials of the query rows only) and of a fixed cost per CTA (prologue, pipeline fill, the
// cross-warp merge).
//
// The model counts `ctas_per_sm` CTAs per SM as a full SM (decode_ctas_per_sm below):
//   * contiguous caches: one, but for very long splits. A launch of at most one CTA per SM runs
//     the whole-SM pipeline (one_cta_per_sm below; 160 KiB of K/V in flight per SM at D 128), and
//     a second co-resident CTA adds fixed costs without adding bandwidth: H200 (bench/NOTES.md,
//     decode), batch 1, GQA 32/8: 16 splits (128 whole-SM CTAs) beat 32 (256 shared-SM CTAs) by
//     5%, 5%, 1% at cache 8k, 32k, 128k. Where each of two CTAs per SM still streams at least
//     kSharedSmMinKeyBlocksContiguous key blocks, the two interleaved streams read 0.2-1.4% faster
//     (H200 session 12 sweep, batch 2 to 16 at 8k-128k: batch 8 at 32k and 128k, 4 splits over
//     2; batch 4 at 128k, 8 over 4; batch 16 at 128k, 2 over 1); over 32-64 blocks they tied or
//     lost up to 1.8% (batch 16 at 8k, batch 1 at 32k and 128k).
//   * paged caches of pages under kContiguousPageKeys keys: two, where the shared-SM pipeline fits
//     two CTAs in an SM (D <= 128) and the splits of one CTA per SM would not be short
//     (kSharedSmMinKeyBlocks). (Paged caches always run the shared-SM pipeline: decode_launch_plan.)
//     Two CTAs interleave two copy loops, which pays over a split of some length, while the second
//     CTA's fixed cost (prologue, merge, twice the partials) dominates a short one. H200, 16-token
//     pages: batch 8 (64 key blocks per CTA at 2 splits) 4 splits beat 2 by 14%; batch 1 (16
//     splits: 8, 32, 128 blocks per CTA at 8k, 32k, 128k) 32 splits beat 16 by 2% and 7% at 32k
//     and 128k, and 16 beat 32 by 4% at 8k (session 12's sweep of the paged instance; session 4's,
//     bench/results/h200-2026-11-23-decode-sweep4.md, whose 16 splits ran the whole-SM pipeline,
//     had 32 ahead at 8k too).
//
// So with `slots` = SMs x ctas_per_sm, s splits run ceil(ctas * s / slots) waves, each as long as
// one split's key blocks plus the fixed cost per CTA (counted in key blocks):
//     time(s) = ceil(ctas * s / slots) * (ceil(key_blocks / s) + kCtaOverheadBlocks)
// and s is the smallest minimiser of time(s). Splits that do not shorten the longest split (same
// ceil(key_blocks / s) as s - 1) are skipped: they add CTAs without removing work. When the
// unsplit launch already fills the SMs (ctas >= slots) nothing is split: another wave would only
// move work around.
#pragma once

#include <cstdint>

namespace flashkit::api {

struct SplitShape {
  int64_t ctas = 0;       // CTAs of one split: batch x heads_kv x packed-row blocks
  int64_t key_blocks = 0;  // key blocks of the longest sequence (the capacity when unknown)
  int sm_count = 0;
  int max_splits = 128;
  int ctas_per_sm = 1;  // decode_ctas_per_sm
};

// The fixed cost of a CTA in key-block times (launch, Q load, pipeline fill, merge, store).
constexpr int64_t kCtaOverheadBlocks = 2;

// Returns a split count in [1, max_splits]; 1 for degenerate input (no CTAs, no keys, no SMs).
int choose_num_splits(const SplitShape& shape);

// Whether `ctas` x `num_splits` CTAs (ctas as in SplitShape) put at most one CTA on each of
// `sm_count` SMs: then every CTA may take its SM's whole shared memory for a deeper K/V pipeline
// at no cost in waves (the decode kernel's whole-SM pipeline, src/cuda/sm80/decode_sm80.h).
bool one_cta_per_sm(int64_t ctas, int num_splits, int sm_count);

// Paged caches count two CTAs per SM only when one CTA per SM would give each CTA at least this
// many key blocks; contiguous ones only when two CTAs per SM would (see above).
constexpr int64_t kSharedSmMinKeyBlocks = 16;
constexpr int64_t kSharedSmMinKeyBlocksContiguous = 128;

// Pages of at least this many keys count as a contiguous cache: with the split's block-table lines
// prefetched into L2, one CTA per SM (on the shared-SM pipeline, decode_launch_plan) streams them
// as fast as a contiguous cache (H200, batch 1, 256-token pages: 16 splits 1.88 / 3.33 / 4.24 TB/s
// at 8k / 32k / 128k against 32 splits' 1.78 / 3.24 / 4.13; contiguous 1.79 / 3.29-3.35 /
// 4.10-4.17), while 16-token pages still read 1-7% slower so (1.78 / 3.04 / 3.82 against 1.75 /
// 3.15 / 4.13).
constexpr int kContiguousPageKeys = 256;

// The CTAs per SM the split model counts for `shape` (its ctas_per_sm is not read; see above), for
// a cache of `page_keys`-key pages (0: contiguous): 2 when two shared-SM CTAs of
// `shared_sm_cta_bytes` (the pipeline's shared memory plus the runtime's reserve per CTA) fit
// `smem_per_sm` and, for pages of fewer than kContiguousPageKeys keys, the split count of one CTA
// per SM leaves each CTA at least kSharedSmMinKeyBlocks key blocks, or, for a contiguous cache and
// larger pages, the split count of two CTAs per SM splits and leaves each at least
// kSharedSmMinKeyBlocksContiguous; else 1.
int decode_ctas_per_sm(const SplitShape& shape, int page_keys, int64_t shared_sm_cta_bytes,
                       int64_t smem_per_sm);

}  // namespace flashkit::api
