// flashkit/params.h
// \brief The arguments of each attention operation, named after what they mean.
//
// These structs are the whole boundary between a caller (C++ program, PyTorch glue) and flashkit.
// Every tensor is a caller-owned TensorView; optional tensors are left as empty views.
#pragma once

#include <cstddef>
#include <cstdint>

#include "flashkit/tensor.h"

namespace flashkit {

// Which keys a query may attend to. Query row i of a sequence (seqlen_q rows, seqlen_k keys) may see
// key j iff
//     i + (seqlen_k - seqlen_q) - window_left <= j <= i + (seqlen_k - seqlen_q) + window_right,
// where a negative window side is unbounded, and so is a side at or beyond seqlen_k (varlen: beyond
// max_seqlen_k, not the sequence's own length: FlashAttention's convention; a side between the two
// still hides keys from the first rows of a sequence with more queries than keys). `causal` is
// window_right = 0 (bottom-right aligned when seqlen_q != seqlen_k, the FlashAttention >= 2.1
// convention).
struct MaskSpec {
  bool causal = false;
  int window_left = -1;
  int window_right = -1;
};

// Dropout on the attention probabilities, with a counter-based RNG (Philox4x32-10) keyed by (seed,
// offset) so that the backward pass regenerates the same mask from the same three values. p is in
// [0, 1): each probability is kept with probability 1 - p (realised as a multiple of 1/256, within
// 1/512 of it) and kept ones are scaled by 1 / (1 - p); softmax_lse stays that of the undropped
// scores. A call draws from the Philox counters offset .. offset + ceil(seqlen_k / 32) - 1 (varlen:
// max_seqlen_k): advance the offset by at least that much between calls that should draw
// independent masks. src/common/philox.h defines the mask exactly.
//
// rng_state (CUDA views only; optional): device memory holding int64 {seed, base offset}. When set,
// the kernels read the key there when they run, as seed = rng_state[0] and offset = rng_state[1] +
// offset, and `seed` is ignored. This is for callers that do not know the key on the host when they
// enqueue the call: a CUDA graph being captured, whose generator state lives on the device and
// changes between replays (PyTorch's Philox state); and a backward reusing the forward's state.
struct DropoutSpec {
  float p = 0.0f;
  uint64_t seed = 0;
  uint64_t offset = 0;
  const int64_t* rng_state = nullptr;
};

// Arguments shared by the fixed-length and the variable-length forward pass.
struct FwdCommon {
  TensorView q;  // [batch, seqlen_q, heads_q, head_dim]       (varlen: [total_q, heads_q, head_dim])
  TensorView k;  // [batch, seqlen_k, heads_kv, head_dim]      (varlen: [total_k, heads_kv, head_dim])
  TensorView v;  // [batch, seqlen_k, heads_kv, head_dim]      (varlen: [total_k, heads_kv, head_dim])
  TensorView out;          // same shape and dtype as q; written. May be q itself (in place), except
                           // with attn_probs; never k, v or softmax_lse
  TensorView softmax_lse;  // fp32 [batch, heads_q, seqlen_q] (varlen: [batch, heads_q, max_seqlen_q]);
                           // natural log of the softmax denominator per row, -inf for a row that sees
                           // no key (its output row is zero). Written; the backward pass reads it.
  TensorView alibi_slopes;  // optional fp32 [heads_q] or [batch, heads_q]; adds
                            // -slope * |i + seqlen_k - seqlen_q - j| to the score of (i, j).
  float softmax_scale = 0.0f;  // multiplies q.k; 0 means 1/sqrt(head_dim)
  float softcap = 0.0f;        // > 0: score = softcap * tanh(score / softcap), after scaling
  MaskSpec mask{};
  DropoutSpec dropout{};
  // Optional (return_softmax, for tests): [batch, heads_q, round128(seqlen_q), round128(seqlen_k)]
  // (varlen: the max_seqlen_* rounded) in q's dtype, last dim contiguous; written. Element
  // (b, h, i, j) is the undropped probability of query row i and key j of sequence b, negated
  // (sign bit set) where dropout dropped it; masked pairs and the rounding padding are +0.
  TensorView attn_probs;
  // Optional scratch memory on the tensors' device, 256-byte aligned, at least
  // mha_fwd_workspace_size(params) (mha_varlen_fwd_workspace_size) bytes; its contents on entry do
  // not matter. Only short queries use it (on the decode kernel, src/api/fwd_decode_route.h): there it
  // holds the fp32 partial results of a key split, which spreads few long sequences over the SMs.
  // Null runs them without a split (slower when batch x heads_kv is small against the SM count).
  void* workspace = nullptr;
  size_t workspace_bytes = 0;
};

// mha_fwd: every sequence of the batch has the same lengths.
struct MhaFwdParams : FwdCommon {};

// mha_varlen_fwd: sequences packed along the token dimension.
struct MhaVarlenFwdParams : FwdCommon {
  TensorView cu_seqlens_q;  // int32 [batch + 1], prefix sums of the query lengths, starting at 0
  TensorView cu_seqlens_k;  // int32 [batch + 1], prefix sums of the key lengths, starting at 0
  TensorView seqused_k;     // optional int32 [batch]: use only the first seqused_k[b] keys of sequence b
  int max_seqlen_q = 0;     // >= every query length (sizes softmax_lse and the grid)
  int max_seqlen_k = 0;     // >= every key length
};

// Arguments shared by the fixed-length and the variable-length backward pass. The forward's inputs
// and options must be passed unchanged (same q, k, v, out, softmax_lse, scale, mask, softcap, ALiBi,
// dropout seed and offset); the backward recomputes the probabilities from them.
struct BwdCommon {
  TensorView dout;         // gradient of out: same shape as q (any strides, last dim contiguous)
  TensorView q;            // as given to the forward
  TensorView k;
  TensorView v;
  TensorView out;          // what the forward wrote
  TensorView softmax_lse;  // what the forward wrote: fp32 [batch, heads_q, seqlen_q]
                           // (varlen: [batch, heads_q, max_seqlen_q])
  TensorView dq;           // written: same shape and dtype as q
  TensorView dk;           // written: same shape and dtype as k (summed over each query-head group)
  TensorView dv;           // written: same shape and dtype as v
                           // Every gradient row of every sequence is written: a query row that
                           // sees no key gets dq = 0, a key that no query sees (keys past
                           // seqused_k included) dk = dv = 0. Varlen tokens after the last
                           // sequence are not written.
  TensorView alibi_slopes;
  float softmax_scale = 0.0f;
  float softcap = 0.0f;
  MaskSpec mask{};
  DropoutSpec dropout{};
  // true: dq, dk and dv are bit-identical from run to run (no order-dependent atomics), at a cost.
  bool deterministic = false;
  // Scratch memory on the tensors' device, at least mha_bwd_workspace_size(params) bytes (the
  // varlen call's query likewise), 256-byte aligned; its contents on entry do not matter. It holds
  // the fp32 dq accumulator, the dot(dout, out) rows and, for GQA/MQA, the per-query-head dk/dv
  // before the group sum. May be null when the size query returns 0.
  void* workspace = nullptr;
  size_t workspace_bytes = 0;
};

// mha_bwd: the gradients of mha_fwd.
struct MhaBwdParams : BwdCommon {};

// mha_varlen_bwd: the gradients of mha_varlen_fwd; same packing and lengths as the forward call.
struct MhaVarlenBwdParams : BwdCommon {
  TensorView cu_seqlens_q;
  TensorView cu_seqlens_k;
  TensorView seqused_k;
  int max_seqlen_q = 0;
  int max_seqlen_k = 0;  // must also bound the stored key lengths (cu_seqlens_k), whose dk / dv
                         // rows are all written, when seqused_k is shorter
};

}  // namespace flashkit
