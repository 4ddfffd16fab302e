// src/cuda/sm90/fwd_tile_config_sm90.h
// \brief Tile sizes of the sm90 (wgmma + TMA) forward kernel per head-dim family, with the reasoning.
//
// A CTA is one producer warpgroup (its first warp issues the TMA copies) and kBlockM / 64 consumer
// warpgroups of 64 query rows each. S = Q K^T is m64 x kBlockN per consumer, held in kBlockN / 2
// fp32 registers per thread, beside the output accumulator (D / 2 registers) and the previous
// block's P (kBlockN / 4 registers, read by O += P V while S of the next block lands); after
// setmaxnreg two consumers run at 232 registers (240 in d256's p = 0 kernel), three at 160. Shared
// memory holds Q (kBlockM x D) and kStages stages of K and V (kBlockN x D each) and caps the
// stages; where it has room beside them (all but 256), also O's staging tiles for the TMA-store
// epilogue (kBlockM x D, the "+ O" in the table):
//
//   family | kBlockM x kBlockN | stages | smem (KiB)        | O + S + P registers | why
//   64     | 192 x 128         | 4      | 24 + 4 x 32 = 152 + O 24 | 32 + 64 + 32 (160)  | three consumers keep the tensor cores busier than two (H200, bf16+fp16: +8% over 128 x 128); 128 keys per block with one P buffer (no short chain: two spilled 112 bytes at 160 registers) beat 96 keys with two by 2.6-8.7% without a mask, -1..+3.3% causal (H200, session 9); 2048 keys are 16 whole blocks (21.3 of 96)
//   64 (dropout) | 128 x 128   | 4      | 16 + 4 x 32 = 144 + O 16 | 32 + 64 + 32 (232)  | the dropout instance, tested on this shape; short k-loop (4 k-steps per S): a deep ring hides the TMA latency
//   128    | 128 x 128         | 2      | 32 + 2 x 64 = 160 + O 32 | 64 + 64 + 32 (232)  | FA3's d128 shape; 128 keys per block amortise the softmax; 2 stages suffice because K and V are freed separately; O's 64 registers leave no room for a third consumer
//   256    | 128 x 80          | 2      | 64 + 2 x 80 = 224 | 128 + 40 + 20 (240) | O takes 128 registers; at 232 registers 80 keys spilled 100 bytes with the pipelined schedule (S of the next block live beside P); at 240 (the producer at 24) 40 bytes, outside the main loop (none since session 11: bench/NOTES.md, hx/lead256); 1.02-1.10x 128 x 64 (H200, bf16 + fp16, bench/NOTES.md, session 8)
//   256 (dropout) | 128 x 64    | 2      | 64 + 2 x 64 = 192 | 128 + 32 + 16 (232) | the drop marks take 32 keys at a time (the consumers draw them); 232 registers, as every two-consumer kernel but d256's p = 0 one
//
// d64, measured on an H200 (bench/NOTES.md, 2026-11-23, forward, bf16 + fp16, 2k/8k/16k, causal and
// not, geometric mean over the 12 cells vs SDPA cuDNN in the same run): 128 x 128 0.927, 192 x 128
// with the serial schedule (fits 160 registers) 0.938, 192 x 128 pipelined (spilling) 0.988,
// 192 x 96 pipelined 1.002 (those runs also waited for P V after the softmax, a placement since
// reverted as undefined: bench/NOTES.md; the final grid of that session read d64 at 0.999). Session 6's
// short chain (a second P buffer) then kept 192 x 96; session 9 measured 192 x 128 with one P buffer
// against it (bench/NOTES.md, "Session 9").
#pragma once

namespace flashkit::sm90 {

struct FwdTileConfig {
  int block_m;  // 64 query rows per consumer warpgroup: 128 (two consumers) or 192 (three)
  int block_n;
  int stages;
};

// The tile of a head-dim family's p = 0 kernel, or of its dropout kernel (`dropout`).
constexpr FwdTileConfig fwd_tile_config(int head_dim_family, bool dropout = false) {
  switch (head_dim_family) {
    case 64: return dropout ? FwdTileConfig{128, 128, 4} : FwdTileConfig{192, 128, 4};
    case 128: return {128, 128, 2};
    case 256: return dropout ? FwdTileConfig{128, 64, 2} : FwdTileConfig{128, 80, 2};
    default: return {0, 0, 0};
  }
}

// Whether a head-dim family's p = 0 kernel has an instance for problems with a left window edge
// in which a consumer skips the trailing key blocks that none of its rows sees (fwd_kernel_sm90.cuh,
// consumer_warpgroup). The d64 tile, 192 x 128: its third consumer's rows start a whole key block
// below the first's, so each tile that a window's edge crosses sheds a block or two of products
// (H200, bf16 and fp16, causal with window 128: 1.12-1.15x; 1024: 1.02-1.04x). Not d256 (128 x 80,
// at most one block for the second consumer; window 128: 0.97-1.00x, and its dropout tile 128 x 64
// 0.96-0.99x): those tiles move 2.6x the bytes per product and wait on their K and V loads, which
// the producer makes for every block anyway. d128's 128 x 128 has no such block.
constexpr bool fwd_sliding_window_instance(int head_dim_family) { return head_dim_family == 64; }

// Whether run_fwd launches a problem on that instance: p = 0, a left window edge (window_left >= 0
// after validation), a family that has one.
constexpr bool fwd_takes_sliding_window_instance(int head_dim_family, int window_left, float dropout_p) {
  return dropout_p == 0.0f && window_left >= 0 && fwd_sliding_window_instance(head_dim_family);
}

}  // namespace flashkit::sm90
