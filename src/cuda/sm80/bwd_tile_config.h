// src/cuda/sm80/bwd_tile_config.h
// \brief Tile sizes and warp layouts of the sm80 backward kernel per head-dim family, with the
// reasoning; plain C++ (the workspace size depends on BlockM).
//
// A CTA owns BlockN keys of one (batch, query head) and streams the BlockM-row query blocks that
// see them. The five GEMMs of a query block are tiled over the warps in three layouts:
//   S^T = K Q^T, dP^T = V dO^T  keys x queries: s_key_warps along the keys, the rest along the
//                               queries (each warp computes its share once; P^T and dS^T go to
//                               shared memory);
//   dV += P^T dO, dK += dS^T Q  keys x head dim: kv_key_warps along the keys, the rest along the
//                               head dim (P^T, dS^T read back with ldmatrix);
//   dQ = dS K                   queries x head dim: BlockM / 16 warps along the queries.
// Warp tiles of 32 x 32 (S^T, dP^T) and 32 x D/2 (dK, dV) let each ldmatrix fragment feed two or
// more mma.sync: 0.475 shared-memory loads per mma at d128 instead of 0.65 with one 16-key row
// tile per warp, measured 1.21-1.24x faster (NOTES.md, "Backward: warp tiling"). With 8 x 1 in
// both layouts (d32, d64) a warp's S^T rows are its dK/dV rows and P^T, dS^T feed dV, dK straight
// from registers: at D = 64 the 32 x 32 tiling measured 3-4% slower, its saved loads (8 of 96 per
// warp) not paying for the P^T round trip through shared memory. The fp32 accumulators per lane
// are dK + dV = 2 * BlockN * D / threads (fixed by the tile, not the layout) and S^T + dP^T = 2 *
// BlockN * BlockM / threads.
//
//   family | BlockM | BlockN | warps | S keys x queries warps | dKV keys x dims warps | dK+dV + S^T+dP^T
//   32     | 64     | 128    | 8     | 8 x 1 (16 x 64)        | 8 x 1 (16 x 32)       | 32 + 64
//   64     | 64     | 128    | 8     | 8 x 1 (16 x 64)        | 8 x 1 (16 x 64)       | 64 + 64
//   96     | 64     | 128    | 8     | 4 x 2 (32 x 32)        | 4 x 2 (32 x 48)       | 96 + 64
//   128    | 64     | 128    | 8     | 4 x 2 (32 x 32)        | 4 x 2 (32 x 64)       | 128 + 64
//   192    | 32     | 64     | 8     | 4 x 2 (16 x 16)        | 2 x 4 (32 x 48)       | 96 + 16
//   256    | 32     | 64     | 8     | 4 x 2 (16 x 16)        | 2 x 4 (32 x 64)       | 128 + 16
// Shared memory: K and V (BlockN x D each, resident), Q and dO (BlockM x D, double-buffered), P^T
// (not with 8 x 1 layouts) and dS^T (BlockN x BlockM each) and the LSE / dot(dO, O) rows; at most
// 161 KiB (D = 128; fits an A100's 163 KiB), so registers bound occupancy: one CTA of 256 threads
// per SM.
#pragma once

namespace flashkit::sm80 {

struct BwdTileConfig {
  int block_m;
  int block_n;
  int warps;
  int s_key_warps;   // S^T / dP^T: warps along the keys (the others along the queries)
  int kv_key_warps;  // dK / dV: warps along the keys (the others along the head dim)
  int min_blocks_per_sm;  // __launch_bounds__ occupancy target
};

constexpr BwdTileConfig bwd_tile_config(int head_dim_family) {
  switch (head_dim_family) {
    case 32: return {64, 128, 8, 8, 8, 1};
    case 64: return {64, 128, 8, 8, 8, 1};
    case 96: return {64, 128, 8, 4, 4, 1};
    case 128: return {64, 128, 8, 4, 4, 1};
    case 192: return {32, 64, 8, 4, 2, 1};
    case 256: return {32, 64, 8, 4, 2, 1};
    default: return {0, 0, 0, 0, 0, 0};
  }
}

}  // namespace flashkit::sm80
