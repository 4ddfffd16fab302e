// src/cuda/sm90/fwd_sm90.h
// \brief What the sm90 (wgmma + TMA, sm_90a) forward kernels offer the dispatcher; includable from
// plain C++.
#pragma once

#include <string>

#include "common/fwd_problem.h"

namespace flashkit::sm90 {

// The head-dim families the sm90 forward is compiled for. A head dim runs in the smallest family
// that holds it: the copy engine zero-fills the columns past head_dim (the tensor map's inner extent
// is head_dim, its box the family's 64-column atoms), so they add nothing to Q K^T, and the epilogue
// writes only the first head_dim columns. Padding costs family / head_dim in matrix work.
constexpr int kFwdHeadDimFamilies[] = {64, 128, 256};

constexpr int fwd_head_dim_family(int head_dim) {
  for (int family : kFwdHeadDimFamilies) {
    if (head_dim <= family) return family;
  }
  return -1;
}

// Why the sm90 kernels cannot run `problem` (layout or options they do not cover), or "" when they
// can. Whether the (dtype, family) instance was compiled is the dispatcher's question, not this.
std::string fwd_unsupported_reason(const FwdProblem& problem);

// Grouped-query attention with a kv head's G = heads_q / heads_kv query heads packed into one tile
// (FlashAttention-3's PackGQA): the kernel's tiles then run over the rows of a (batch, kv head),
// row r being token r / G of query head kv_head * G + r % G, so that s_q tokens fill s_q x G rows
// instead of s_q rows of each of G tiles. Where s_q leaves most of a tile's rows empty (a few query
// tokens against many keys) that is up to G times fewer tiles: 1.3x-2.2x at 32 and 64 tokens (H200,
// bf16 d128 32/8 heads, 2k-8k keys, bench/NOTES.md session 26). It never adds empty rows (G x s_q
// rounded up to a tile is at most G times s_q rounded up), and with long sequences the G heads of a
// tile share their K and V reads in L2: +0% to +10% at 2k-8k tokens in that run. So the sm90
// forward packs wherever it covers the problem: G a power of two up to 64 (G divides every tile's
// rows and each consumer's 64, so that Q and O move as TMA boxes of whole tokens), no dropout (the
// mask is addressed by the tile's head and rows), no ALiBi (a slope per tile), s_q x G below 2^31.
//
// log2(G) when the sm90 forward packs `problem`'s query heads on tiles of `block_m` rows, else 0.
// `allowed` false (FLASHKIT_SM90_PACK_GQA=0, a measurement switch): never.
int fwd_pack_gqa_shift(const FwdProblem& problem, int block_m, bool allowed);

// FLASHKIT_SM90_PACK_GQA, read at each call: unset or 1 packs where covered, 0 never; throws
// flashkit::Error on another value.
bool pack_gqa_allowed_by_env();

// Enqueues the forward pass of `problem` (device pointers, validated, covered) on the cudaStream_t
// `stream`. Instantiated once per (dtype, family) in a generated .cu file; see src/CMakeLists.txt.
template <DType kDType, int kHeadDimFamily>
void run_fwd(const FwdProblem& problem, void* stream);

}  // namespace flashkit::sm90
