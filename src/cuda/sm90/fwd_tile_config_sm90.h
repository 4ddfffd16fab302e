// src/cuda/sm90/fwd_tile_config_sm90.h
// \brief Tile sizes of the sm90 (wgmma + TMA) forward kernel per head-dim family, with the reasoning.
//
// A CTA is one producer warpgroup (its first warp issues the TMA copies) and two consumer
// warpgroups of 64 query rows each, so kBlockM = 128. S = Q K^T is m64 x kBlockN per consumer, held
// in kBlockN / 2 fp32 registers per thread, beside the output accumulator (D / 2 registers) and the
// previous block's P (kBlockN / 4 registers, read by O += P V while S of the next block lands); the
// consumers run at 232 registers after setmaxnreg. Shared memory holds Q (128 x D) and kStages
// stages of K and V (kBlockN x D each) and caps the stages:
//
//   family | kBlockN | stages | smem (KiB)        | O + S + P registers | why
//   64     | 128     | 4      | 16 + 4 x 32 = 144 | 32 + 64 + 32        | short k-loop (4 k-steps per S): a deep ring hides the TMA latency
//   128    | 128     | 2      | 32 + 2 x 64 = 160 | 64 + 64 + 32        | FA3's d128 shape; 128 keys per block amortise the softmax; 2 stages suffice because K and V are freed separately
//   256    | 64      | 2      | 64 + 2 x 64 = 192 | 128 + 32 + 16       | O takes 128 registers; 80 keys spilled 100 bytes with the pipelined schedule (S of the next block live beside P), 64 spill none
//
// fma_exp2_tiles: of the block_n / 8 column tiles of a score block, how many are exponentiated by
// exp2_fma (common/exp2_fma.cuh: 9 issue slots, no MUFU) instead of MUFU.EX2 (1 issue slot, 8 clocks
// of a sub-core's MUFU per warp). Count at d64, per warp and 128 x 128 block: the softmax issues
// ~430 instructions of which 64 MUFU.EX2 (SASS), the warp's exponentials alone take 64 x 8 = 512
// MUFU clocks, and the block's products 2 x 512 tensor clocks for the two consumers: MUFU ties the
// tensor core. k of the warp's 64 exponentials on the FMA pipe cost 8k issue slots and save 8k MUFU
// clocks; the exponential phase (FFMA, MUFU, FADD, half an F2FP per element: ~3.5 issue slots)
// balances at k ~ 18 (4-5 tiles of 16), the whole sub-core (two consumer warps, ~860 issue slots
// per block) at k ~ 5. d128 has twice the tensor work per exponential: no MUFU bound to relieve.
#pragma once

namespace flashkit::sm90 {

struct FwdTileConfig {
  int block_m;
  int block_n;
  int stages;
  int fma_exp2_tiles;  // of the block_n / 8 score column tiles, those exponentiated on the FMA pipe
};

constexpr FwdTileConfig fwd_tile_config(int head_dim_family) {
  switch (head_dim_family) {
    case 64: return {128, 128, 4, 0};
    case 128: return {128, 128, 2, 0};
    case 256: return {128, 64, 2, 0};
    default: return {0, 0, 0, 0};
  }
}

}  // namespace flashkit::sm90
