// src/cuda/sm90/bwd_tile_config_sm90.h
// \brief Tile sizes of the sm90 (wgmma) backward kernel per head-dim family, with the counts that
// chose them; plain C++ (the dispatcher names the tile).
//
// A CTA owns BlockN = 128 keys of one (batch, query head): two warpgroups of 64 keys each (wgmma's
// M is 64). Per query block of BlockM queries, warpgroup w computes, for its 64 keys:
//   S^T  = K_w Q^T    P x m64 n(BlockM/P) k16 x D/16  A = K (smem, K-major), B = Q (smem, K-major)
//   dP^T = V_w dO^T   P x m64 n(BlockM/P) k16 x D/16  A = V, B = dO
//   dV  += P^T dO     m64 n(D) k16 x BlockM/16        A = P^T (registers), B = dO (smem, MN-major)
//   dK  += dS^T Q     m64 n(D) k16 x BlockM/16        A = dS^T (registers), B = Q (MN-major)
// S^T and dP^T run in P = query_parts parts of the queries, dV and dK following per part: with
// P = 2 one part's softmax runs while the other part's products do. Measured (H200, bf16, 16k
// tokens, bench/NOTES.md "sm90 backward"): d64 (parts of 64 queries) +4-6% with P = 2; d128 -7%
// (parts of 32 queries: m64n32 wgmma reads K from shared memory twice as often per FLOP), so P = 1.
//   dQ   = dS K       m64 n64 k16 x BlockN/16         A = dS (the stored dS^T tile, MN-major),
//                                                     B = K (MN-major); the two warpgroups split
//                                                     dQ's BlockM x D into 64 x 64 parts
// fp32 registers per thread (128 threads per warpgroup): dK + dV = 2 * 64 * D / 128 = D, resident;
// S^T + dP^T = 2 * 64 * BlockM / 128 = BlockM; dQ = 64 * 64 / 128 = 32; P^T and dS^T packed to
// 16 bits for the register operand, BlockM / 4 each.
//
//   family | BlockM | BlockN | dK+dV | S^T+dP^T | P,dS packed | dQ | smem (K, V, 2 x (Q, dO), dS^T, LSE/dot)
//   64     | 128    | 128    | 64    | 128      | 64          | 32 | 16+16+64+32+2 = 130 KiB
//   128    | 64     | 128    | 128   | 64       | 32          | 32 | 32+32+64+16+1 = 145 KiB
// Both stay under ~200 live registers at the peak (scores and dS: dK + dV + S^T + dP^T = 192), so
// one CTA of 256 threads per SM at <= 255 registers; shared memory would allow one CTA too.
#pragma once

namespace flashkit::sm90 {

struct BwdTileConfig {
  int block_m;      // queries per query block
  int block_n;      // keys per CTA (64 per consumer warpgroup)
  int query_parts;  // S^T / dP^T parts per query block (1 or 2)
};

constexpr BwdTileConfig bwd_tile_config(int head_dim_family) {
  switch (head_dim_family) {
    case 64: return {128, 128, 2};
    case 128: return {64, 128, 1};
    default: return {0, 0, 0};
  }
}

}  // namespace flashkit::sm90
