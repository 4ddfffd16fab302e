// src/api/tensor_checks.h
// \brief The checks every entry point's validation shares: presence, dtype, device, rank, shape,
// strides and pointer alignment of one view, each throwing flashkit::Error with a message that names
// the function, the argument, the value it got and what is supported.
//
// Per-op rules (which tensors, which shapes, which options) live in validate_<op>.cpp; only the
// checks of a single view, which read nothing but its metadata, live here.
#pragma once

#include <cstdint>
#include <initializer_list>
#include <sstream>
#include <string>
#include <utility>

#include "flashkit/error.h"
#include "flashkit/params.h"
#include "flashkit/tensor.h"

namespace flashkit::api {

// The CUDA kernels move q/k/v/out in 16-byte vectors: the data pointers and the strides of every
// dim but the last must keep each row start 16-byte aligned.
constexpr int64_t kCudaAlignmentBytes = 16;
constexpr int64_t kCudaStrideMultiple = kCudaAlignmentBytes / 2;  // in 16-bit elements

constexpr int kMaxHeadDim = 256;
constexpr int kHeadDimMultiple = 8;

// Throws Error("<fn>: <parts...>").
template <typename... Parts>
[[noreturn]] void fail(const char* fn, const Parts&... parts) {
  std::ostringstream message;
  message << fn << ": ";
  (message << ... << parts);
  throw Error(message.str());
}

std::string device_string(const Device& device);                // "cpu", "cuda:1"
std::string shape_string(std::initializer_list<int64_t> sizes);  // "[2, 128, 16, 64]"

// `view` must be defined; `what` says what the argument is for.
void check_defined(const char* fn, const char* name, const TensorView& view, const char* what);
void check_dtype(const char* fn, const char* name, const TensorView& view, DType expected);
void check_same_dtype_as_q(const char* fn, const char* name, const TensorView& view,
                           const TensorView& q);
void check_same_device_as_q(const char* fn, const char* name, const TensorView& view,
                            const TensorView& q);
// Rank, then sizes that a hand-filled view could get wrong (negative).
void check_rank(const char* fn, const char* name, const TensorView& view, int expected_rank,
                const char* layout);
// `value` narrowed to int, or an error naming `what`.
int to_int(const char* fn, const char* what, int64_t value);
void check_shape(const char* fn, const char* name, const TensorView& view,
                 std::initializer_list<int64_t> expected, const char* layout);
void check_last_dim_contiguous(const char* fn, const char* name, const TensorView& view);
// At least one query and one kv head, heads_q a multiple of heads_kv (the kv heads counted by
// the tensor named `kv_name`), head_dim a multiple of 8 up to 256.
void check_head_counts_and_dim(const char* fn, int64_t heads_q, const char* kv_name, int64_t heads_kv,
                               int64_t head_dim);
// q, k, v and out: last dim contiguous, usable pointers, 16-byte aligned rows on CUDA; softmax_lse:
// last dim contiguous, a usable pointer. Their shapes are checked before.
void check_attention_layouts(const char* fn, const TensorView& q, const TensorView& k, const TensorView& v,
                             const TensorView& out, const TensorView& softmax_lse);
// `view` has the sizes of `like` (named `like_name` in the message).
void check_same_shape(const char* fn, const char* name, const TensorView& view, const char* like_name,
                      const TensorView& like);
// A gradient tensor (dout read; dq, dk, dv written): present, of q's dtype and device, shaped like
// `like`, last dim contiguous, a usable pointer (16-byte aligned rows on CUDA, like every attention
// tensor).
void check_gradient(const char* fn, const char* name, const TensorView& view, const char* what,
                    const char* like_name, const TensorView& like, const TensorView& q);

// Whether two non-empty views start at the same address: a view passed twice, the aliasing the
// validators refuse where an output would be written over an input that other rows still read.
inline bool shares_data(const TensorView& a, const TensorView& b) {
  return a.numel() > 0 && b.numel() > 0 && a.data == b.data;
}

// Fails when the output `name` shares its data with one of `others` (shares_data; `view` itself in
// the list is skipped): "<name>.data (<pointer>) is also <other>.data; <why>". Only the common
// mistake is caught, a view passed twice; views that overlap from different addresses are not.
void check_own_memory(const char* fn, const char* name, const TensorView& view,
                      std::initializer_list<std::pair<const char*, const TensorView*>> others,
                      const char* why);
void check_contiguous(const char* fn, const char* name, const TensorView& view);
// Every view with elements needs a non-null pointer aligned to its element type, on any device.
void check_data_pointer(const char* fn, const char* name, const TensorView& view);
// On CUDA: a 16-byte aligned pointer and strides (but the last) that keep rows 16-byte aligned.
void check_cuda_vector_alignment(const char* fn, const char* name, const TensorView& view);
// A CUDA device index must be >= 0.
void check_device_index(const char* fn, const TensorView& q);

// ALiBi slopes of shape [heads_q] or [batch, heads_q] with a contiguous last dim (the caller
// checks dtype and device); returns the batch stride of the slopes (0 for one slope per head).
int64_t check_alibi(const char* fn, const TensorView& alibi, int64_t batch, int64_t heads_q);
// softmax_scale and softcap finite and >= 0, window sides >= -1: the score options every
// attention entry point takes.
void check_score_options(const char* fn, float softmax_scale, float softcap, const MaskSpec& mask);

}  // namespace flashkit::api
