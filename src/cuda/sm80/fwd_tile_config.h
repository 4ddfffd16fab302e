// src/cuda/sm80/fwd_tile_config.h
// \brief Tile sizes of the sm80 forward kernel per head-dim family, with the reasoning.
//
// A CTA owns kBlockM query rows and streams kBlockN keys at a time. Each warp owns kBlockM / kWarps
// consecutive rows. Warps of 32 rows (two 16-row mma tiles) read every K/V fragment from shared
// memory once for two tiles, halving shared-memory traffic per FLOP relative to 16-row warps:
// with 16-row warps a warp does 4*16*N*D FLOPs per 4*N*D bytes of K and V read, 16 FLOP/byte,
// which at 128 B/clk of shared-memory bandwidth caps an SM at 2048 FLOP/clk, below what mma.sync
// can issue on Hopper; 32-row warps lift the cap to 4096. Registers decide the rest: the output
// accumulator is rows * D / 32 floats per lane and the score tile rows * N / 32, and both must fit
// with room to spare under 255 (so D >= 192 falls back to 16-row warps).
//
//   family | BlockM | BlockN | warps | rows/warp | O acc + S acc (fp32 regs/lane) | Q in registers
//   32     | 128    | 128    | 4     | 32        | 32 + 128                       | yes (16)
//   64     | 128    | 64     | 4     | 32        | 64 + 64                        | yes (32)
//   96     | 128    | 64     | 4     | 32        | 96 + 64                        | no
//   128    | 128    | 64     | 4     | 32        | 128 + 64                       | no
//   192    | 128    | 64     | 8     | 16        | 96 + 32                        | yes (48)
//   256    | 128    | 64     | 8     | 16        | 128 + 32                       | no
// Shared memory: Q (BlockM x D) + K and V (BlockN x D each), single-buffered; at D = 128 that is
// 64 KiB, so registers, not shared memory, bound occupancy (2 CTAs of 128 threads per SM).
#pragma once

namespace flashkit::sm80 {

struct FwdTileConfig {
  int block_m;
  int block_n;
  int warps;
  bool q_in_registers;
  int min_blocks_per_sm;  // __launch_bounds__ occupancy target; caps registers at 64K / (threads * it)
};

constexpr FwdTileConfig fwd_tile_config(int head_dim_family) {
  switch (head_dim_family) {
    case 32: return {128, 128, 4, true, 2};
    case 64: return {128, 64, 4, true, 2};
    case 96: return {128, 64, 4, false, 2};
    case 128: return {128, 64, 4, false, 2};
    case 192: return {128, 64, 8, true, 1};
    case 256: return {128, 64, 8, false, 1};
    default: return {0, 0, 0, false, 0};
  }
}

}  // namespace flashkit::sm80
