// src/api/tensor_checks.cpp
// \brief The single-view checks shared by every entry point's validation (see tensor_checks.h).
#include "api/tensor_checks.h"

#include <climits>
#include <cmath>
#include <utility>

namespace flashkit::api {

std::string device_string(const Device& device) {
  // CPU views normally carry index 0; another index is named, or a mismatch would read
  // "k is on cpu but q is on cpu".
  if (device.kind == DeviceKind::kCpu) {
    return device.index == 0 ? "cpu" : "cpu:" + std::to_string(device.index);
  }
  return "cuda:" + std::to_string(device.index);
}

std::string shape_string(std::initializer_list<int64_t> sizes) {
  std::string text = "[";
  for (auto it = sizes.begin(); it != sizes.end(); ++it) {
    if (it != sizes.begin()) text += ", ";
    text += std::to_string(*it);
  }
  return text + "]";
}

void check_defined(const char* fn, const char* name, const TensorView& view, const char* what) {
  if (!view.defined()) fail(fn, name, " is undefined (an empty view); it is required: ", what);
}

void check_dtype(const char* fn, const char* name, const TensorView& view, DType expected) {
  if (view.dtype != expected) {
    fail(fn, name, ".dtype is ", dtype_name(view.dtype), "; it must be ", dtype_name(expected));
  }
}

void check_same_dtype_as_q(const char* fn, const char* name, const TensorView& view,
                           const TensorView& q) {
  if (view.dtype != q.dtype) {
    fail(fn, name, ".dtype is ", dtype_name(view.dtype), " but q.dtype is ", dtype_name(q.dtype),
         "; the attention tensors of one call (q, k, v, out and their gradients) must share one dtype");
  }
}

void check_same_device_as_q(const char* fn, const char* name, const TensorView& view,
                            const TensorView& q) {
  if (view.device != q.device) {
    fail(fn, name, " is on ", device_string(view.device), " but q is on ", device_string(q.device),
         "; every tensor of one call must be on the same device");
  }
}

// Rank, then sizes that a hand-filled view could get wrong (negative, or too large for the int
// fields of FwdProblem).
void check_rank(const char* fn, const char* name, const TensorView& view, int expected_rank,
                const char* layout) {
  if (view.rank != expected_rank) {
    fail(fn, name, " has rank ", view.rank, " (shape ", view.shape_string(), "); expected rank ",
         expected_rank, ": ", layout);
  }
  for (int d = 0; d < view.rank; ++d) {
    if (view.sizes[d] < 0) {
      fail(fn, name, ".size(", d, ") is ", view.sizes[d], "; sizes must be >= 0");
    }
  }
}

int to_int(const char* fn, const char* what, int64_t value) {
  if (value > INT_MAX) fail(fn, what, " is ", value, "; at most ", INT_MAX, " is supported");
  return static_cast<int>(value);
}

void check_shape(const char* fn, const char* name, const TensorView& view,
                 std::initializer_list<int64_t> expected, const char* layout) {
  bool same = view.rank == static_cast<int>(expected.size());
  int d = 0;
  for (int64_t size : expected) {
    same = same && view.sizes[d++] == size;
  }
  if (!same) {
    fail(fn, name, " has shape ", view.shape_string(), "; expected ", shape_string(expected), " ",
         layout);
  }
}

void check_last_dim_contiguous(const char* fn, const char* name, const TensorView& view) {
  // An empty tensor addresses nothing; frameworks give some any strides (an expanded empty
  // gradient has stride 0).
  if (view.stride(-1) != 1 && view.numel() > 0) {
    fail(fn, name, ".stride(-1) is ", view.stride(-1),
         "; the last dim must be contiguous (stride 1)");
  }
}

void check_contiguous(const char* fn, const char* name, const TensorView& view) {
  if (!view.is_contiguous()) {
    fail(fn, name, " with shape ", view.shape_string(), " has stride ", view.stride(0),
         "; it must be contiguous");
  }
}

void check_own_memory(const char* fn, const char* name, const TensorView& view,
                      std::initializer_list<std::pair<const char*, const TensorView*>> others,
                      const char* why) {
  for (const auto& [other_name, other] : others) {
    if (other != &view && shares_data(view, *other)) {
      fail(fn, name, ".data (", view.data, ") is also ", other_name, ".data; ", why);
    }
  }
}

// Every view with elements needs a pointer aligned to its element type, on any device.
void check_data_pointer(const char* fn, const char* name, const TensorView& view) {
  if (view.numel() == 0) return;
  if (view.data == nullptr) {
    fail(fn, name, ".data is null but ", name, " has ", view.numel(), " elements");
  }
  const auto address = reinterpret_cast<uintptr_t>(view.data);
  if (address % static_cast<uintptr_t>(dtype_size(view.dtype)) != 0) {
    fail(fn, name, ".data (", view.data, ") is not aligned to its ", dtype_size(view.dtype),
         "-byte ", dtype_name(view.dtype), " elements");
  }
}

// q/k/v/out on CUDA: 16-byte aligned rows (see kCudaAlignmentBytes). The stride of a dim of size
// 1 never moves the pointer, so it is not constrained.
void check_cuda_vector_alignment(const char* fn, const char* name, const TensorView& view) {
  if (view.device.kind != DeviceKind::kCuda || view.numel() == 0) return;
  const auto address = reinterpret_cast<uintptr_t>(view.data);
  if (address % kCudaAlignmentBytes != 0) {
    fail(fn, name, ".data (", view.data, ") is not ", kCudaAlignmentBytes,
         "-byte aligned; the CUDA kernels move attention tensors in 16-byte vectors");
  }
  for (int d = 0; d + 1 < view.rank; ++d) {
    if (view.sizes[d] > 1 && view.strides[d] % kCudaStrideMultiple != 0) {
      fail(fn, name, ".stride(", d, ") is ", view.strides[d],
           "; on CUDA every stride but the last ", "must be a multiple of ", kCudaStrideMultiple,
           " elements (16 bytes)");
    }
  }
}

void check_device_index(const char* fn, const TensorView& q) {
  if (q.device.kind == DeviceKind::kCuda && q.device.index < 0) {
    fail(fn, "q.device is ", device_string(q.device), "; a CUDA device index must be >= 0");
  }
}

int64_t check_alibi(const char* fn, const TensorView& alibi, int64_t batch, int64_t heads_q) {
  const bool per_head = alibi.rank == 1 && alibi.sizes[0] == heads_q;
  const bool per_batch_and_head =
      alibi.rank == 2 && alibi.sizes[0] == batch && alibi.sizes[1] == heads_q;
  if (!per_head && !per_batch_and_head) {
    fail(fn, "alibi_slopes has shape ", alibi.shape_string(),
         "; expected [heads_q] = ", shape_string({heads_q}),
         " or [batch, heads_q] = ", shape_string({batch, heads_q}));
  }
  check_last_dim_contiguous(fn, "alibi_slopes", alibi);
  check_data_pointer(fn, "alibi_slopes", alibi);
  return per_batch_and_head ? alibi.strides[0] : 0;
}


void check_score_options(const char* fn, float softmax_scale, float softcap,
                         const MaskSpec& mask) {
  if (!(softmax_scale >= 0.0f) || std::isinf(softmax_scale)) {
    fail(fn, "softmax_scale is ", softmax_scale,
         "; it must be finite and >= 0 (0 means 1/sqrt(head_dim))");
  }
  if (!(softcap >= 0.0f) || std::isinf(softcap)) {
    fail(fn, "softcap is ", softcap, "; it must be finite and >= 0 (0 turns it off)");
  }
  if (mask.window_left < -1) {
    fail(fn, "mask.window_left is ", mask.window_left, "; it must be >= 0, or -1 for unbounded");
  }
  if (mask.window_right < -1) {
    fail(fn, "mask.window_right is ", mask.window_right, "; it must be >= 0, or -1 for unbounded");
  }
}

void check_same_shape(const char* fn, const char* name, const TensorView& view, const char* like_name,
                      const TensorView& like) {
  bool same = view.rank == like.rank;
  for (int d = 0; same && d < view.rank; ++d) same = view.sizes[d] == like.sizes[d];
  if (!same) {
    fail(fn, name, " has shape ", view.shape_string(), "; expected ", like.shape_string(), " (the shape of ",
         like_name, ")");
  }
}

void check_gradient(const char* fn, const char* name, const TensorView& view, const char* what,
                    const char* like_name, const TensorView& like, const TensorView& q) {
  check_defined(fn, name, view, what);
  check_same_dtype_as_q(fn, name, view, q);
  check_same_device_as_q(fn, name, view, q);
  check_same_shape(fn, name, view, like_name, like);
  check_last_dim_contiguous(fn, name, view);
  check_data_pointer(fn, name, view);
  check_cuda_vector_alignment(fn, name, view);
}

void check_attention_layouts(const char* fn, const TensorView& q, const TensorView& k, const TensorView& v,
                             const TensorView& out, const TensorView& softmax_lse) {
  const std::pair<const char*, const TensorView*> qkvo[] = {{"q", &q}, {"k", &k}, {"v", &v}, {"out", &out}};
  for (const auto& [name, view] : qkvo) {
    check_last_dim_contiguous(fn, name, *view);
    check_data_pointer(fn, name, *view);
  }
  check_last_dim_contiguous(fn, "softmax_lse", softmax_lse);
  check_data_pointer(fn, "softmax_lse", softmax_lse);
  for (const auto& [name, view] : qkvo) {
    check_cuda_vector_alignment(fn, name, *view);
  }
}

void check_head_counts_and_dim(const char* fn, int64_t heads_q, const char* kv_name, int64_t heads_kv,
                               int64_t head_dim) {
  if (heads_q <= 0) fail(fn, "q has ", heads_q, " heads; it must have at least 1");
  if (heads_kv <= 0) fail(fn, kv_name, " has ", heads_kv, " heads; it must have at least 1");
  if (heads_q % heads_kv != 0) {
    fail(fn, "q has ", heads_q, " heads and ", kv_name, " has ", heads_kv,
         "; heads_q must be a multiple of heads_kv (MHA, GQA or MQA)");
  }
  if (head_dim <= 0 || head_dim % kHeadDimMultiple != 0 || head_dim > kMaxHeadDim) {
    fail(fn, "head_dim (q.size(-1)) is ", head_dim, "; supported: a multiple of ", kHeadDimMultiple, " from ",
         kHeadDimMultiple, " to ", kMaxHeadDim);
  }
}

}  // namespace flashkit::api
