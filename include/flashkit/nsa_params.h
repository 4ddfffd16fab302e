// flashkit/nsa_params.h
// \brief The arguments of native sparse attention's selection branch (DeepSeek's NSA): each query
// token attends only to the key blocks it selected.
//
// The keys of a sequence are cut into blocks of block_size: block n holds keys
// [n * block_size, min((n + 1) * block_size, seqlen_k)), and there are
// num_key_blocks = ceil(seqlen_k / block_size) of them. For query token i of sequence b and kv
// head g, the selection is
//     S(b, i, g) = { block_indices[b, i, g, s] : 0 <= s < count(b, i, g) } ∩ [0, num_key_blocks),
// where count(b, i, g) = block_counts[b, i, g] clamped to [0, selected] (all `selected` slots
// without block_counts). Entries outside [0, num_key_blocks) (-1 is the usual padding) select
// nothing, and a block named twice counts once: S is a set. Every query head h of kv head
// g = h / (heads_q / heads_kv) attends to the keys of the blocks in S(b, i, g), minus, when
// `causal` is set, the keys j > i + seqlen_k - seqlen_q (bottom-right aligned, as mha_fwd). The
// scores q.k are scaled by softmax_scale and normalised over those keys only; a row that sees no
// key gets a zero output and a log-sum-exp of -inf.
//
// The other two branches of NSA are ordinary attention: the sliding window is mha_fwd with
// window_left = window - 1 and causal, and the compressed branch is mha_fwd over the compressed
// keys; the gates that mix the three outputs are the model's (python/flashkit/nsa.py composes
// them).
//
// The contents of block_indices and block_counts are never an error: out-of-range values select
// nothing, so the CUDA path needs no device check and reads them only in its kernels.
#pragma once

#include <cstddef>

#include "flashkit/tensor.h"

namespace flashkit {

// The most slots a selection may have (block_indices.size(3)); NSA selects 16.
constexpr int kNsaMaxSelected = 256;

struct NsaFwdParams {
  TensorView q;  // [batch, seqlen_q, heads_q, head_dim]
  TensorView k;  // [batch, seqlen_k, heads_kv, head_dim]
  TensorView v;  // [batch, seqlen_k, heads_kv, head_dim]
  TensorView block_indices;  // int32 [batch, seqlen_q, heads_kv, selected], 1 <= selected <= kNsaMaxSelected
  TensorView block_counts;   // optional int32 [batch, seqlen_q, heads_kv]: slots in use
  int block_size = 64;       // keys per block: a multiple of 16, from 16 to 256
  TensorView out;            // written: same shape and dtype as q (not q itself)
  TensorView softmax_lse;    // written: fp32 [batch, heads_q, seqlen_q] (natural log; -inf: no key)
  float softmax_scale = 0.0f;  // 0 means 1/sqrt(head_dim)
  bool causal = false;
};

// The gradients of nsa_fwd. The forward's inputs and options must be passed unchanged. On CUDA, dk
// and dv are fp32 sums over the tokens that selected each key, added in an order that may change
// from run to run (atomics): repeated calls may differ in their last bits. dq is the same every run.
struct NsaBwdParams {
  TensorView dout;  // gradient of out: same shape as q (last dim contiguous)
  TensorView q;
  TensorView k;
  TensorView v;
  TensorView block_indices;
  TensorView block_counts;
  int block_size = 64;
  TensorView out;          // what the forward wrote
  TensorView softmax_lse;  // what the forward wrote
  TensorView dq;           // written: same shape and dtype as q
  TensorView dk;           // written: same shape and dtype as k (summed over each query-head group;
  TensorView dv;           // written: same shape and dtype as v  keys no query selected get 0)
  float softmax_scale = 0.0f;
  bool causal = false;
  // Scratch memory on the tensors' device, at least nsa_bwd_workspace_size(params) bytes,
  // 256-byte aligned; its contents on entry do not matter. May be null when the size is 0.
  void* workspace = nullptr;
  size_t workspace_bytes = 0;
};

}  // namespace flashkit
