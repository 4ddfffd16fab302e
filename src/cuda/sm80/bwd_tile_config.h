// src/cuda/sm80/bwd_tile_config.h
// \brief Tile sizes of the sm80 backward kernel per head-dim family, with the reasoning; plain C++
// (the workspace size depends on BlockM).
//
// A CTA owns BlockN keys of one (batch, query head) and streams the BlockM-row query blocks that
// see them. Each warp owns 16 keys (one mma row tile) of S^T = K Q^T and dP^T = V dO^T, so P^T and
// dS^T stay in registers as the A operands of dV += P^T dO and dK += dS^T Q; only dS goes through
// shared memory, for dQ = dS K. The fp32 accumulators per lane are dK + dV = 2 * 16 * D / (32 *
// dsplit) and S^T + dP^T = 2 * 16 * BlockM / 32; at D >= 192 dK + dV alone would exceed 255
// registers, so two warps share 16 keys and split dK/dV by columns ("dsplit"), each recomputing the
// (cheap at that D) S^T and dP^T of its keys.
//
//   family | BlockM | BlockN | warps | dsplit | dK+dV + S^T+dP^T (fp32 regs/lane) | shared memory
//   32     | 64     | 128    | 8     | 1     | 32 + 64                            | 64 KiB
//   64     | 64     | 128    | 8     | 1     | 64 + 64                            | 96 KiB
//   96     | 64     | 128    | 8     | 1     | 96 + 64                            | 128 KiB
//   128    | 64     | 128    | 8     | 1     | 128 + 64                           | 144 KiB
//   192    | 64     | 64     | 8     | 2     | 96 + 64                            | 152 KiB
//   256    | 64     | 64     | 8     | 2     | 128 + 64                           | 200 KiB
// Shared memory: K and V (BlockN x D each, resident), Q and dO (BlockM x D, double-buffered), dS^T
// (BlockN x BlockM) and the LSE / dot(dO, O) rows: one CTA of 256 threads per SM, bound by registers.
#pragma once

namespace flashkit::sm80 {

struct BwdTileConfig {
  int block_m;
  int block_n;
  int warps;
  int dsplit;  // warps sharing one 16-key row tile, each owning D / dsplit columns of dK and dV
};

constexpr BwdTileConfig bwd_tile_config(int head_dim_family) {
  switch (head_dim_family) {
    case 32: return {64, 128, 8, 1};
    case 64: return {64, 128, 8, 1};
    case 96: return {64, 128, 8, 1};
    case 128: return {64, 128, 8, 1};
    case 192: return {64, 64, 8, 2};
    case 256: return {64, 64, 8, 2};
    default: return {0, 0, 0, 0};
  }
}

}  // namespace flashkit::sm80
