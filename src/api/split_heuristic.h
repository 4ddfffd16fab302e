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
// The model counts `ctas_per_sm` CTAs per SM as a full SM (decode_ctas_per_sm below): one, but for
// very long splits. A launch of at most one CTA per SM runs the whole-SM pipeline for a contiguous
// cache (one_cta_per_sm below; 160 KiB of K/V in flight per SM at D 128), and a second co-resident
// CTA adds fixed costs without adding bandwidth: H200 (bench/NOTES.md, decode), batch 1, GQA 32/8:
// 16 splits (128 whole-SM CTAs) beat 32 (256 shared-SM CTAs) by 5%, 5%, 1% at cache 8k, 32k,
// 128k. Where each of two CTAs per SM still streams at least kSharedSmMinKeyBlocks key blocks, the
// two interleaved streams read 0.2-1.4% faster (H200 session 12 sweep, batch 2 to 16 at 8k-128k:
// batch 8 at 32k and 128k, 4 splits over 2; batch 4 at 128k, 8 over 4; batch 16 at 128k, 2 over
// 1); over 32-64 blocks they tied or lost up to 1.8% (batch 16 at 8k, batch 1 at 32k and 128k).
// Paged caches (which run the shared-SM pipeline at any count) follow the same rule: since their
// lookups read the split's pages from shared memory with a lean address code, 16 splits read 16-
// and 256-token pages at batch 1 as fast as 32 or faster, and at batch 2 5-15% faster (H200,
// session 19; before, 16-token pages had a rule of their own, two CTAs per SM).
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

// Two CTAs per SM count only when two per SM would still give each CTA at least this many key
// blocks (see above).
constexpr int64_t kSharedSmMinKeyBlocks = 128;

// The CTAs per SM the split model counts for `shape` (its ctas_per_sm is not read; see above): 2
// when two shared-SM CTAs of `shared_sm_cta_bytes` (the pipeline's shared memory plus the runtime's
// reserve per CTA) fit `smem_per_sm` and the split count of two CTAs per SM splits and leaves each
// at least kSharedSmMinKeyBlocks; else 1.
int decode_ctas_per_sm(const SplitShape& shape, int64_t shared_sm_cta_bytes, int64_t smem_per_sm);

}  // namespace flashkit::api
