// src/common/fwd_problem.h
// \brief The forward problem after validation: plain pointers, 64-bit strides and resolved options.
//
// src/api/ builds one FwdProblem from the public params (defaults applied, causal folded into the
// window, dtypes and shapes checked); every backend (src/cpu/ reference, src/cuda/ kernels) consumes
// only this. It holds no torch and no CUDA types, so it can cross into .cu files unchanged.
#pragma once

#include <cstdint>

#include "common/philox.h"
#include "flashkit/tensor.h"

namespace flashkit {

struct FwdProblem {
  DType dtype = DType::kBFloat16;  // of q, k, v and out
  int batch = 0;
  int heads_q = 0;
  int heads_kv = 0;  // heads_q % heads_kv == 0; query head h reads kv head h / (heads_q / heads_kv)
  int head_dim = 0;  // a multiple of 8, at most 256
  // Fixed-length: the lengths of every sequence. Varlen: the max_seqlen_* bounds.
  int seqlen_q = 0;
  int seqlen_k = 0;

  // Element pointers and strides (in elements). For varlen, *_batch_stride is 0 and the token
  // offset of sequence b comes from cu_seqlens_*.
  const void* q = nullptr;
  const void* k = nullptr;
  const void* v = nullptr;
  void* out = nullptr;
  int64_t q_batch_stride = 0, q_row_stride = 0, q_head_stride = 0;
  int64_t k_batch_stride = 0, k_row_stride = 0, k_head_stride = 0;
  int64_t v_batch_stride = 0, v_row_stride = 0, v_head_stride = 0;
  int64_t out_batch_stride = 0, out_row_stride = 0, out_head_stride = 0;

  float* lse = nullptr;  // [batch, heads_q, seqlen_q], row stride 1
  int64_t lse_batch_stride = 0, lse_head_stride = 0;

  // Variable length (all null for mha_fwd).
  const int* cu_seqlens_q = nullptr;
  const int* cu_seqlens_k = nullptr;
  // Varlen: sequence b attends to its first seqused_k[b] keys. Also set, without cu_seqlens, only by
  // mha_fwd_kvcache's route onto the sm90 forward (api/kvcache_fwd_route.h): batch entry b's cache
  // holds seqused_k[b] of its seqlen_k rows. No other kernel reads it then.
  const int* seqused_k = nullptr;
  // Varlen: the rows of the packed q (and out) and k (and v), q.size(0) and k.size(0); the extent a
  // kernel reading whole tiles (the sm90 copy engine) may address. 0 for mha_fwd.
  int64_t total_q = 0;
  int64_t total_k = 0;

  const float* alibi_slopes = nullptr;  // slope of (b, h) = alibi_slopes[b * alibi_batch_stride + h]
  int64_t alibi_batch_stride = 0;       // 0 for [heads_q] slopes

  float softmax_scale = 0.0f;  // resolved: never 0
  float softcap = 0.0f;        // 0: off
  int window_left = -1;        // resolved: causal sets window_right = 0; -1 is unbounded
  int window_right = -1;
  bool causal = false;         // kept for heuristics; the window already encodes it

  // Dropout on the probabilities (0: off), with the Philox mask of common/philox.h.
  float dropout_p = 0.0f;
  uint64_t dropout_seed = 0;
  uint64_t dropout_offset = 0;
  const int64_t* dropout_rng_state = nullptr;  // device {seed, base offset}: DropoutSpec::rng_state

  // return_softmax (tests): null, or [batch, heads_q, attn_probs_rows, attn_probs_cols] in dtype,
  // last dim contiguous, the rounded seqlen_q x seqlen_k. Element (b, h, i, j) of a visible pair is
  // the undropped probability exp(s_ij - lse_i), negated (sign bit set, also for a zero) when
  // dropout drops it; every other element is +0.
  void* attn_probs = nullptr;
  int64_t attn_probs_batch_stride = 0, attn_probs_head_stride = 0, attn_probs_row_stride = 0;
  int attn_probs_rows = 0;
  int attn_probs_cols = 0;

  bool is_varlen() const { return cu_seqlens_q != nullptr; }
  // The rows of q and out (k and v) along which a whole-tile reader (the sm90 copy engine's tensor
  // maps) addresses them: the packed total when varlen, else seqlen per (batch, head).
  int64_t q_tensor_rows() const { return is_varlen() ? total_q : seqlen_q; }
  int64_t k_tensor_rows() const { return is_varlen() ? total_k : seqlen_k; }
  // The mask's key. A kernel calls this once, before its main loop: with a device rng_state it
  // reads global memory. Host code (the reference) only sees problems without one (validation).
  FLASHKIT_HOST_DEVICE DropoutMask dropout_mask() const {
    uint64_t seed = dropout_seed;
    uint64_t offset = dropout_offset;
#ifdef __CUDA_ARCH__
    if (dropout_rng_state != nullptr) {
      seed = static_cast<uint64_t>(dropout_rng_state[0]);
      offset += static_cast<uint64_t>(dropout_rng_state[1]);
    }
#endif
    return {seed, offset, dropout_keep_threshold(dropout_p)};
  }
};

}  // namespace flashkit
