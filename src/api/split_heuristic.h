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
// The model counts one CTA per SM as a full SM: a launch of at most one CTA per SM runs the
// whole-SM pipeline (one_cta_per_sm below; 160 KiB of K/V in flight per SM at D 128), and a
// second co-resident CTA would add fixed costs without adding bandwidth. Measured on an H100
// (bench/NOTES.md, decode), before the whole-SM pipeline existed: batch 1, GQA 32/8, 16 splits
// (128 CTAs) beat 32 splits (256 CTAs, two per SM) by 23%, 7% and 6% at cache 8k, 32k and 128k;
// batch 8, 2 splits beat 4 by 2-4%.
//
// So with `slots` = SMs, s splits run ceil(ctas * s / slots) waves, each as long as one split's
// key blocks plus the fixed cost per CTA (counted in key blocks):
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
};

// The fixed cost of a CTA in key-block times (launch, Q load, pipeline fill, merge, store).
constexpr int64_t kCtaOverheadBlocks = 2;

// Returns a split count in [1, max_splits]; 1 for degenerate input (no CTAs, no keys, no SMs).
int choose_num_splits(const SplitShape& shape);

// Whether `ctas` x `num_splits` CTAs (ctas as in SplitShape) put at most one CTA on each of
// `sm_count` SMs: then every CTA may take its SM's whole shared memory for a deeper K/V pipeline
// at no cost in waves (the decode kernel's whole-SM pipeline, src/cuda/sm80/decode_sm80.h).
bool one_cta_per_sm(int64_t ctas, int num_splits, int sm_count);

}  // namespace flashkit::api
