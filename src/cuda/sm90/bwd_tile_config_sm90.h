// src/cuda/sm90/bwd_tile_config_sm90.h
// \brief Tile sizes of the sm90 (wgmma) backward kernel per head-dim family, with the counts that
// chose them; plain C++ (the dispatcher names the tile).
//
// Families 64 and 128 (256: below): a CTA owns BlockN = 128 keys of one (batch, query head): two
// warpgroups of 64 keys each (wgmma's M is 64). Per query block of BlockM queries, warpgroup w
// computes, for its 64 keys:
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
//   family | BlockM | BlockN | dK+dV | S^T+dP^T | P,dS packed | dQ | smem (dQ staging, K, V, 3 x (Q, dO), dS^T, rows)
//   64     | 128    | 128    | 64    | 128      | 64          | 32 | 32+16+16+96+32+3 = 195 KiB
//   128    | 64     | 128    | 128   | 64       | 32          | 32 | 32+32+32+96+2x16+1.5 = 225.5 KiB
// (d128 at p = 0 has room for a second dS^T buffer: BwdKernelTraits::kDsBuffers)
// (the default mode's plan: BwdKernelTraits in bwd_kernel_sm90.cuh has the others)
// Both stay under ~200 live registers at the peak (scores and dS: dK + dV + S^T + dP^T = 192), so
// one CTA of 256 threads per SM at <= 255 registers; shared memory would allow one CTA too.
//
// Family 256 cannot keep that layout: a warpgroup's dK + dV for 64 keys x 256 dims is 256 fp32
// registers per thread. There the two warpgroups share one block of BlockN = 64 keys and split
// the work the other way (split_head_dim; FlashAttention-3's hdim-256 backward tiles 64 x 64 the
// same way, with its roles of M and N swapped):
//   S^T, dP^T    warpgroup w: the 64 keys x queries [32w, 32w + 32)   m64 n32 k16 x 16, ss
//   P^T, dS^T    -> shared memory (keys x queries), both whole, then a barrier
//   dV += P^T dO warpgroup w: head-dim columns [128w, 128w + 128)     m64 n128 k16 x 4, ss
//                (A = P^T from shared memory, K-major; B = dO, MN-major)
//   dK += dS^T Q likewise with A = dS^T, B = Q
//   dQ = dS K    warpgroup w: the 64 queries x columns [128w, 128w + 128)  m64 n128 k16 x 4, ss
// fp32 registers per thread: dK + dV = 2 * 64 * 128 / 128 = 128 resident, S^T + dP^T = 32, dQ = 64
// (after the scores are dead): peak ~128 + 64 + addresses. Shared memory: K, V 32 + 32 KiB,
// 2 x (Q, dO) 128 KiB, P^T + dS^T 16 KiB, LSE/dot 1 KiB = 209 KiB (+ 1 KiB alignment) of 227:
// no room for dQ's 64 KiB of staging, which therefore takes the block's own Q/dO stage once the
// products that read it have landed (BwdKernelTraits::kDqInStage).
//   family | BlockM | BlockN | split | dK+dV | S^T+dP^T | dQ
//   256    | 64     | 64     | yes   | 128   | 32       | 64
// Bytes per FLOP against the d128 tile: per (64-query, 64-key) pair the CTA reads Q and dO
// (64 KiB) and reduces 64 KiB of fp32 dQ for 5 x 2 x 64 x 64 x 256 = 10.5 MFLOP, twice d128's
// L2 traffic per FLOP (its 128-key CTAs share each Q/dO load between two warpgroups); at
// ~300 TFLOP/s that is ~3.7 TB/s of L2, within an H200's L2 bandwidth but not free. How dQ travels
// counts too: as 16-byte atomics (one 32-byte L2 request each) they kept the crossbar into L2 82%
// busy at ~290 TFLOP/s, as the copy engine's bulk reductions (128-byte requests) the kernel runs
// ~1.25x faster (H200, bench/NOTES.md session 23).
#pragma once

namespace flashkit::sm90 {

struct BwdTileConfig {
  int block_m;          // queries per query block
  int block_n;          // keys per CTA (64 per consumer warpgroup, or 64 shared: split_head_dim)
  int query_parts;      // S^T / dP^T parts per query block and warpgroup (1 or 2)
  bool split_head_dim;  // both warpgroups own the same keys: dK/dV split by head dim (above)
};

constexpr BwdTileConfig bwd_tile_config(int head_dim_family) {
  switch (head_dim_family) {
    case 64: return {128, 128, 2, false};
    case 128: return {64, 128, 1, false};
    case 256: return {64, 64, 1, true};
    default: return {0, 0, 0, false};
  }
}

}  // namespace flashkit::sm90
