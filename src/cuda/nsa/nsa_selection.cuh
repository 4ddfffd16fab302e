// src/cuda/nsa/nsa_selection.cuh
// \brief One query token's selected key blocks, resolved in shared memory, and the keys they
// stand for.
//
// A CTA of the NSA kernels serves one (sequence, query token, kv head). Its selection, as
// nsa_params.h defines it, is the set of distinct block indices among the first `count` slots that
// name a block of the sequence; the CTA drops the others up front, plus the blocks a causal mask
// hides entirely (first key past the token's last visible key), and keeps the rest, in slot order,
// as a compact list. The kernels then walk the selected keys as one virtual sequence:
// virtual key u is key u % block_size of the list's block u / block_size. block_size is a multiple
// of 16, so every 16 consecutive virtual keys from a multiple of 16 are consecutive keys of one
// block: one warp's key slice is (first key, 16 keys), one lookup.
#pragma once

#include <cstdint>

#include "common/nsa_problem.h"
#include "flashkit/nsa_params.h"

namespace flashkit::nsa {

// What a token CTA of the forward and of the backward's dq kernel serves: grid x = token,
// y = kv head x row block (16 heads of the group), z = sequence.
struct TokenCta {
  int token;
  int kv_head;
  int b;
  int group;      // query heads per kv head
  int m0;         // the CTA's first head within the group
  int rows_here;  // heads of the group from m0 on, at most 16

  __device__ __forceinline__ static TokenCta locate(const NsaProblem& p) {
    TokenCta cta;
    cta.group = p.heads_q / p.heads_kv;
    const int m_blocks = (cta.group + 15) / 16;
    cta.token = static_cast<int>(blockIdx.x);
    cta.kv_head = static_cast<int>(blockIdx.y) / m_blocks;
    cta.m0 = (static_cast<int>(blockIdx.y) % m_blocks) * 16;
    cta.b = static_cast<int>(blockIdx.z);
    cta.rows_here = min(16, cta.group - cta.m0);
    return cta;
  }
};

// Shared memory: the raw slots (one int each), then the compact list.
constexpr int kSelectionSmemBytes = 2 * kNsaMaxSelected * 4 + 4;

struct Selection {
  const int* blocks;  // shared memory: the selected blocks, slot order
  int count;          // how many
  int last_key;       // the token's last visible key (< 0: none)

  // The first key of the 16-key slice starting at virtual key u (a multiple of 16), or -1 past the
  // list's end.
  __device__ __forceinline__ int slice_key(int u, int block_size) const {
    const int slot = u / block_size;
    return slot < count ? blocks[slot] * block_size + (u - slot * block_size) : -1;
  }
  __device__ __forceinline__ int virtual_keys(int block_size) const { return count * block_size; }
};

// Resolves the selection of (b, token, kv_head) into `smem` (kSelectionSmemBytes); every thread of
// the CTA calls it and gets the same result. Contains barriers.
template <int kThreads>
__device__ Selection resolve_selection(const NsaProblem& p, int b, int token, int kv_head, unsigned char* smem) {
  int* raw = reinterpret_cast<int*>(smem);
  int* list = raw + kNsaMaxSelected;
  int* list_count = list + kNsaMaxSelected;
  const int tid = static_cast<int>(threadIdx.x);

  const int64_t row = b * p.bc_batch_stride + static_cast<int64_t>(token) * p.bc_row_stride + kv_head;
  int count = p.selected;
  if (p.block_counts != nullptr) count = min(max(p.block_counts[row], 0), p.selected);
  const int last_key = min(p.last_visible_key(token), p.seqlen_k - 1);
  // A block is visible when its first key is: blocks past last_block hold no key this token sees.
  const int last_block = last_key < 0 ? -1 : last_key / p.block_size;
  const int* slots = p.block_indices + b * p.bi_batch_stride + static_cast<int64_t>(token) * p.bi_row_stride +
                     kv_head * p.bi_head_stride;
  for (int s = tid; s < p.selected; s += kThreads) {
    const int block = s < count ? slots[s] : -1;
    raw[s] = block >= 0 && block <= last_block ? block : -1;
  }
  __syncthreads();
  // Warp 0 compacts, 32 slots per step; a slot stays when it is valid and no earlier slot names
  // the same block (the raw list is short: NSA selects 16).
  if (tid < 32) {
    int kept = 0;
    for (int base = 0; base < p.selected; base += 32) {
      const int s = base + tid;
      const int block = s < p.selected ? raw[s] : -1;
      bool keep = block >= 0;
      for (int t = 0; keep && t < s; ++t) keep = raw[t] != block;
      const unsigned ballot = __ballot_sync(0xffffffffu, keep);
      if (keep) list[kept + __popc(ballot & ((1u << tid) - 1u))] = block;
      kept += __popc(ballot);
    }
    if (tid == 0) *list_count = kept;
  }
  __syncthreads();
  return Selection{list, *list_count, last_key};
}

}  // namespace flashkit::nsa
