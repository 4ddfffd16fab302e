// src/common/nsa_problem.h
// \brief Native sparse attention's selection branch after validation: plain pointers, 64-bit
// strides, resolved options (see include/flashkit/nsa_params.h for the semantics).
//
// src/api/ builds one NsaProblem (and one NsaBwdProblem for the gradients) from the public params;
// the CPU reference and the CUDA kernels consume only these. No torch and no CUDA types, so they
// cross into .cu files unchanged (NsaProblem is the forward kernel's __grid_constant__ argument).
#pragma once

#include <cstddef>
#include <cstdint>

#include "flashkit/tensor.h"

namespace flashkit {

struct NsaProblem {
  DType dtype = DType::kBFloat16;  // of q, k, v and out
  int batch = 0;
  int seqlen_q = 0;
  int seqlen_k = 0;
  int heads_q = 0;
  int heads_kv = 0;  // heads_q % heads_kv == 0; query head h reads kv head h / (heads_q / heads_kv)
  int head_dim = 0;  // a multiple of 8, at most 256
  int block_size = 0;      // a multiple of 16, 16 ... 256
  int num_key_blocks = 0;  // ceil(seqlen_k / block_size)
  int selected = 0;        // slots per (token, kv head): block_indices.size(3)

  const void* q = nullptr;
  int64_t q_batch_stride = 0, q_row_stride = 0, q_head_stride = 0;
  const void* k = nullptr;
  int64_t k_batch_stride = 0, k_row_stride = 0, k_head_stride = 0;
  const void* v = nullptr;
  int64_t v_batch_stride = 0, v_row_stride = 0, v_head_stride = 0;

  // block_indices[b * bi_batch_stride + i * bi_row_stride + g * bi_head_stride + s] (contiguous
  // slots); block_counts[b * bc_batch_stride + i * bc_row_stride + g] or null (all slots used).
  const int* block_indices = nullptr;
  int64_t bi_batch_stride = 0, bi_row_stride = 0, bi_head_stride = 0;
  const int* block_counts = nullptr;
  int64_t bc_batch_stride = 0, bc_row_stride = 0;

  void* out = nullptr;  // forward: written; backward: read
  int64_t out_batch_stride = 0, out_row_stride = 0, out_head_stride = 0;
  float* lse = nullptr;  // [batch, heads_q, seqlen_q], row stride 1; forward: written; backward: read
  int64_t lse_batch_stride = 0, lse_head_stride = 0;

  float softmax_scale = 0.0f;  // resolved: never 0
  bool causal = false;

  // The last key query row i may see: i + seqlen_k - seqlen_q under causal, else seqlen_k - 1.
  constexpr int last_visible_key(int row) const {
    return causal ? row + seqlen_k - seqlen_q : seqlen_k - 1;
  }
};

struct NsaBwdProblem {
  NsaProblem fwd;  // as the forward resolved it; out and lse are read

  const void* dout = nullptr;
  int64_t dout_batch_stride = 0, dout_row_stride = 0, dout_head_stride = 0;
  void* dq = nullptr;
  int64_t dq_batch_stride = 0, dq_row_stride = 0, dq_head_stride = 0;
  void* dk = nullptr;
  int64_t dk_batch_stride = 0, dk_row_stride = 0, dk_head_stride = 0;
  void* dv = nullptr;
  int64_t dv_batch_stride = 0, dv_row_stride = 0, dv_head_stride = 0;

  void* workspace = nullptr;  // the caller's scratch memory; the CPU backend needs none
  size_t workspace_bytes = 0;
};

}  // namespace flashkit
