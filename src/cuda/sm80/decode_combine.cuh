// src/cuda/sm80/decode_combine.cuh
// \brief Combining the splits of split-KV decoding, inside the decode kernel: the last CTA to
// finish among the splits of one (sequence, kv head, block of packed query rows) merges the
// splits' fp32 partial outputs O_s and log-sum-exps L_s of its rows into
//     L = log(sum_s exp(L_s)),   O = sum_s exp(L_s - L) O_s,
// written as the 16-bit output and softmax_lse. A split that saw no key has L_s = -inf (weight 0);
// a row no split saw gets O = 0 and L = -inf, as an unsplit launch writes.
//
// Why in the decode kernel: a separate combine kernel is a second launch (~4 us of host enqueue per
// call) and waits for the whole decode grid before its L2 round trip for the partials.
//
// Who is last: one 64-bit word per block in the workspace, (tag << 16) | (published << 8) |
// arrived, where the tag is a value the host draws per launch (next_split_merge_tag). The
// workspace's contents on entry are arbitrary (kvcache_params.h), so nothing may rely on a zeroed
// word. Thread 0 of each split CTA:
//   claim     prologue: read the word (guess); after the Q gather, unless it carries this launch's
//             tag, compare-and-swap it from guess to (tag, 0, 0). Only this launch writes the word
//             while it runs, and only values with its tag, so a failed swap means another split
//             claimed it first. Nothing waits for the swap: the add below is the same thread's
//             later access to the same location, hence after it in the word's coherence order.
//   arrive    right after the main loop (the add's round trip hides behind the cross-warp merge):
//             add 1 to `arrived`. The split whose add returns splits - 1 arrivals is the last.
//   publish   every other split: store its partials; barrier; fence (release, cumulative over what
//             the barrier ordered); add 1 to `published`.
//   merge     the last split does not store its partial: it keeps it in shared memory, waits until
//             `published` reaches splits - 1 (the value its arrival returned, else polling), fences
//             (acquire), stores (tag, 0, 0) back, and after a barrier merges every split's rows.
// So the last split's path from its main loop to the merge's loads is one atomic round trip, hidden
// under its own epilogue, unless another split is still publishing.
// The reset makes a replay of the same launch (a CUDA graph: same tag, same workspace) find
// (tag, 0, 0) and count from zero; any other launch draws a new tag and claims the word afresh,
// whatever the word held: garbage, a stale tag, 0xff bytes. The one input this misreads is a word
// that already carries this launch's 48-bit tag with non-zero counts without having been written by
// it: the tags are drawn through a 64-bit mix (never 0 or all ones), so no fixed pattern is likely
// to hold one (a chance of 2^-48 per word and launch for anything else).
//
// Memory order (PTX model): a publishing split's partial stores precede the barrier, which precedes
// thread 0's fence.acq_rel and add (a release pattern); the last split's read of `published` (its
// arrival add or a poll) observes that add through the word's chain of atomic adds, and its
// fence.acq_rel (the acquire pattern) orders every publisher's partials before the merge's loads,
// issued after a barrier behind that fence. The merge reads with ld.global.cg: read once, from L2.
//
// The merge: one warp per row (rows ordered [batch, heads_q, seqlen_q] like the workspace); lanes
// hold four columns each per 128-column pass, so every partial row is read once with 16-byte loads.
#pragma once

#include <cstdint>

#include "common/kvcache_problem.h"
#include "cuda/common/mma_sm80.cuh"
#include "cuda/sm80/decode_sm80.h"

namespace flashkit::sm80 {

// The word's fields: arrivals and publications (at most kDecodeMaxSplits each), then the tag.
constexpr int kPublishedShift = 8;
constexpr int kTagShift = 16;
constexpr unsigned long long kCountMask = (1ull << kPublishedShift) - 1;
static_assert(kDecodeMaxSplits <= kCountMask, "a count fits its 8 bits");

// The arrival word of the block of packed rows `m_block` of sequence b, kv head kv_head.
__device__ __forceinline__ unsigned long long* split_arrival_word(const KvcacheProblem& p,
                                                                  const DecodeWorkspaceLayout& layout,
                                                                  int b, int kv_head, int m_block) {
  auto* words = reinterpret_cast<unsigned long long*>(static_cast<char*>(p.workspace) +
                                                      layout.arrivals_offset);
  return words + (static_cast<int64_t>(b) * p.heads_kv + kv_head) * decode_row_blocks(p) + m_block;
}

__device__ __forceinline__ unsigned long long load_relaxed(const unsigned long long* word) {
  unsigned long long value;
  asm volatile("ld.relaxed.gpu.global.b64 %0, [%1];\n" : "=l"(value) : "l"(word) : "memory");
  return value;
}

__device__ __forceinline__ void fence_acq_rel() { asm volatile("fence.acq_rel.gpu;\n" ::: "memory"); }

// Claim: `guess` is the word as read earlier in this launch (load_relaxed).
__device__ __forceinline__ void claim_arrival_word(unsigned long long* word, unsigned long long guess,
                                                   unsigned long long tag) {
  if (guess >> kTagShift != tag) atomicCAS(word, guess, tag << kTagShift);
}

// Arrive: returns the word before this split's arrival (is_last_arrival reads it).
__device__ __forceinline__ unsigned long long arrive(unsigned long long* word) { return atomicAdd(word, 1ull); }

__device__ __forceinline__ bool is_last_arrival(unsigned long long before, int splits) {
  return static_cast<int>(before & kCountMask) + 1 == splits;
}

// Publish, by thread 0 of a split that is not last, after a barrier behind its partial stores.
__device__ __forceinline__ void publish_partials(unsigned long long* word) {
  fence_acq_rel();
  atomicAdd(word, 1ull << kPublishedShift);
}

// By thread 0 of the last split: returns once every other split's partials are visible to the CTA
// (after the caller's barrier), leaving the word at (tag, 0, 0) for a replay.
__device__ __forceinline__ void wait_for_partials(unsigned long long* word, unsigned long long before,
                                                  unsigned long long tag, int splits) {
  unsigned long long seen = before;
  while (static_cast<int>((seen >> kPublishedShift) & kCountMask) != splits - 1) seen = load_relaxed(word);
  fence_acq_rel();
  asm volatile("st.relaxed.gpu.global.b64 [%0], %1;\n" ::"l"(word), "l"(tag << kTagShift) : "memory");
}

// Splits whose partial rows a lane loads before it sums any: 16 (64 registers at D <= 128) covers
// a batch-1 launch (16 splits at GQA 32/8 on 132 SMs) in one round trip.
template <int kHeadDim>
constexpr int combine_splits_in_flight() {
  return kHeadDim <= 128 ? 16 : 8;
}

// The lse values of up to 32 x kMaxSplitChunks splits, lane j holding splits j, j + 32, ...
constexpr int kMaxSplitChunks = 4;
static_assert(kDecodeMaxSplits <= 32 * kMaxSplitChunks, "every split's lse has a lane");

// Merges the splits of workspace row `row` ([batch, heads_q, seqlen_q] order) into out and lse;
// called by a whole warp. Split `own` (the caller's) is not in the workspace: its partial row is
// `own_partial` (shared memory, fp32) and its lse `own_lse`.
template <typename Element, int kHeadDim>
__device__ __forceinline__ void combine_split_row(const KvcacheProblem& p,
                                                  const DecodeWorkspaceLayout& layout, int64_t row,
                                                  int own, const float* own_partial, float own_lse) {
  constexpr int kPasses = (kHeadDim + 127) / 128;
  constexpr int kInFlight = combine_splits_in_flight<kHeadDim>();
  static_assert(32 % kInFlight == 0, "a group of splits lies within one lane chunk of 32");
  const int lane = static_cast<int>(threadIdx.x) % 32;
  const int64_t rows = static_cast<int64_t>(p.batch) * p.heads_q * p.seqlen_q;
  const int splits = p.num_splits;
  const float* lse_accum = static_cast<const float*>(p.workspace);
  const float* out_accum =
      reinterpret_cast<const float*>(static_cast<const char*>(p.workspace) + layout.out_offset);

  // The partial rows of splits s0 .. s0 + kInFlight - 1 (zero past the last split).
  float4 x[kInFlight][kPasses];
  auto load_partials = [&](int s0) {
#pragma unroll
    for (int u = 0; u < kInFlight; ++u) {
      const int s = s0 + u;
      const float* partial = out_accum + (s * rows + row) * p.head_dim;
#pragma unroll
      for (int pass = 0; pass < kPasses; ++pass) {
        const int col = pass * 128 + lane * 4;
        x[u][pass] = !(s < splits && col < p.head_dim) ? make_float4(0.0f, 0.0f, 0.0f, 0.0f)
                     : s == own ? *reinterpret_cast<const float4*>(own_partial + col)
                                : __ldcg(reinterpret_cast<const float4*>(partial + col));
      }
    }
  };
  // The first group's partials go out with the lse loads, so that a launch of at most kInFlight
  // splits waits for one L2 round trip, not one for the lse values and one for the partials.
  load_partials(0);
  float split_lse[kMaxSplitChunks];
#pragma unroll
  for (int c = 0; c < kMaxSplitChunks; ++c) {
    const int s = c * 32 + lane;
    split_lse[c] = !(s < splits) ? -INFINITY : s == own ? own_lse : __ldcg(lse_accum + s * rows + row);
  }

  float m = -INFINITY;
#pragma unroll
  for (int c = 0; c < kMaxSplitChunks; ++c) m = fmaxf(m, split_lse[c]);
#pragma unroll
  for (int offset = 16; offset > 0; offset /= 2) m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, offset));
  float sum = 0.0f;
  if (m != -INFINITY) {
#pragma unroll
    for (int c = 0; c < kMaxSplitChunks; ++c) sum += __expf(split_lse[c] - m);  // exp(-inf) = 0
  }
#pragma unroll
  for (int offset = 16; offset > 0; offset /= 2) sum += __shfl_xor_sync(0xffffffffu, sum, offset);
  const float total = m == -INFINITY ? -INFINITY : m + __logf(sum);

  float4 acc[kPasses];
#pragma unroll
  for (int pass = 0; pass < kPasses; ++pass) acc[pass] = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
  for (int s0 = 0; s0 < splits; s0 += kInFlight) {
    if (s0 > 0) load_partials(s0);
    // This lane's split of the chunk holding s0, and its weight; a split that saw no key (lse
    // -inf, partial 0) weighs 0, also when no split saw one.
    const int chunk = s0 / 32;
    float l = split_lse[0];
#pragma unroll
    for (int c = 1; c < kMaxSplitChunks; ++c) l = chunk == c ? split_lse[c] : l;
    const float lane_weight = l == -INFINITY ? 0.0f : __expf(l - total);
#pragma unroll
    for (int u = 0; u < kInFlight; ++u) {
      const float weight = __shfl_sync(0xffffffffu, lane_weight, (s0 + u) % 32);
#pragma unroll
      for (int pass = 0; pass < kPasses; ++pass) {
        acc[pass].x += weight * x[u][pass].x;
        acc[pass].y += weight * x[u][pass].y;
        acc[pass].z += weight * x[u][pass].z;
        acc[pass].w += weight * x[u][pass].w;
      }
    }
  }

  const int token = static_cast<int>(row % p.seqlen_q);
  const int head = static_cast<int>((row / p.seqlen_q) % p.heads_q);
  const int b = static_cast<int>(row / (static_cast<int64_t>(p.seqlen_q) * p.heads_q));
  Element* out = static_cast<Element*>(p.out) + b * p.out_batch_stride + token * p.out_row_stride +
                 head * p.out_head_stride;
#pragma unroll
  for (int pass = 0; pass < kPasses; ++pass) {
    const int col = pass * 128 + lane * 4;
    if (col < p.head_dim) {
      *reinterpret_cast<uint2*>(out + col) = make_uint2(pack2<Element>(acc[pass].x, acc[pass].y),
                                                        pack2<Element>(acc[pass].z, acc[pass].w));
    }
  }
  if (lane == 0) p.lse[b * p.lse_batch_stride + head * p.lse_head_stride + token] = total;
}

}  // namespace flashkit::sm80
