// src/cuda/common/attention_mask.cuh
// \brief Which keys a query row may see (causal / sliding window / sequence end), and the ALiBi and
// softcap score modifications. Shared by every kernel family.
//
// Row i of a sequence with len_q queries and len_k keys sees keys j in [key_begin(i), key_end(i)):
//   key_begin(i) = max(0, i + len_k - len_q - window_left)            (0 when window_left < 0)
//   key_end(i)   = min(len_k, i + len_k - len_q + window_right + 1)   (len_k when window_right < 0)
// Both bounds grow with i, so a block of rows [m0, m1) needs keys [key_begin(m0), key_end(m1 - 1))
// and a key block [n0, n1) is unmasked for all those rows iff n0 >= key_begin(m1 - 1) and
// n1 <= key_end(m0). Only blocks that fail that test pay for per-element masking.
#pragma once

namespace flashkit::sm80 {

struct KeyWindow {
  int len_q;
  int len_k;
  int window_left;   // -1: unbounded
  int window_right;  // -1: unbounded

  __device__ __forceinline__ int diagonal_offset() const { return len_k - len_q; }

  __device__ __forceinline__ int key_begin(int row) const {
    return window_left < 0 ? 0 : max(0, row + diagonal_offset() - window_left);
  }
  __device__ __forceinline__ int key_end(int row) const {
    return window_right < 0 ? len_k : min(len_k, row + diagonal_offset() + window_right + 1);
  }

  // True when every key of [n0, n1) is visible to every row of [m0, m1).
  __device__ __forceinline__ bool block_unmasked(int m0, int m1, int n0, int n1) const {
    return n0 >= key_begin(m1 - 1) && n1 <= key_end(m0);
  }
};

// The ALiBi bias of (row, key): -slope * |row + len_k - len_q - key|. The same formula holds with
// and without causal masking, so the log-sum-exp is that of the biased scores in every mode.
__device__ __forceinline__ float alibi_bias(float slope, int row, int key, int diagonal_offset) {
  return -slope * fabsf(static_cast<float>(row + diagonal_offset - key));
}

}  // namespace flashkit::sm80
