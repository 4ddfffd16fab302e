// src/api/tensor.cpp
// \brief The non-owning TensorView: element counts, contiguity, printing and the two constructors.
#include "flashkit/tensor.h"

#include <cstdint>
#include <string>

#include "flashkit/error.h"

namespace flashkit {

const char* dtype_name(DType t) {
  switch (t) {
    case DType::kFloat16:
      return "float16";
    case DType::kBFloat16:
      return "bfloat16";
    case DType::kFloat32:
      return "float32";
    case DType::kInt32:
      return "int32";
  }
  return "unknown dtype";
}

// An undefined view (rank 0) names no tensor and so has no elements. The product saturates at
// INT64_MAX: a hand-filled view whose sizes multiply past 2^63 (e.g. [2^20, 2^20, 2^16, 256])
// must not wrap to 0, which would read as "empty" and skip the pointer and stride checks.
int64_t TensorView::numel() const {
  if (!defined()) return 0;
  const int dims = rank < kMaxRank ? rank : kMaxRank;
  for (int d = 0; d < dims; ++d) {
    if (sizes[d] == 0) return 0;
  }
  int64_t count = 1;
  for (int d = 0; d < dims; ++d) {
    const int64_t size = sizes[d];
    if (size < 0) return size;  // not a valid view; validation reports the negative size
    if (count > INT64_MAX / size) return INT64_MAX;
    count *= size;
  }
  return count;
}

// Row-major contiguity as PyTorch defines it: the stride of a dim of size 1 is never used to
// address an element, so it may be anything, and a view with no elements is contiguous.
bool TensorView::is_contiguous() const {
  if (numel() == 0) return true;
  int64_t expected = 1;
  for (int d = rank - 1; d >= 0; --d) {
    if (sizes[d] != 1 && strides[d] != expected) return false;
    expected *= sizes[d];
  }
  return true;
}

std::string TensorView::shape_string() const {
  std::string text = "[";
  for (int d = 0; d < rank && d < kMaxRank; ++d) {
    if (d > 0) text += ", ";
    text += std::to_string(sizes[d]);
  }
  return text + "]";
}

namespace {

// Both constructors reject what no view can describe, so that a bad view fails where it is made.
void check_view_sizes(const char* fn, std::initializer_list<int64_t> sizes) {
  if (sizes.size() == 0 || sizes.size() > static_cast<size_t>(kMaxRank)) {
    throw Error(std::string(fn) + ": rank " + std::to_string(sizes.size()) +
                " is not supported; a view has 1 to " + std::to_string(kMaxRank) + " dims");
  }
  int d = 0;
  for (int64_t size : sizes) {
    if (size < 0) {
      throw Error(std::string(fn) + ": sizes[" + std::to_string(d) + "] is " +
                  std::to_string(size) + "; sizes must be >= 0");
    }
    ++d;
  }
}

// A view with data, dtype, device and sizes filled in; strides are the caller's to set.
TensorView view_without_strides(void* data, DType dtype, std::initializer_list<int64_t> sizes,
                                Device device) {
  TensorView view;
  view.data = data;
  view.dtype = dtype;
  view.rank = static_cast<int>(sizes.size());
  view.device = device;
  int d = 0;
  for (int64_t size : sizes) view.sizes[d++] = size;
  return view;
}

}  // namespace

TensorView make_view(void* data, DType dtype, std::initializer_list<int64_t> sizes, Device device) {
  check_view_sizes("make_view", sizes);
  TensorView view = view_without_strides(data, dtype, sizes, device);
  int64_t stride = 1;
  for (int d = view.rank - 1; d >= 0; --d) {
    view.strides[d] = stride;
    stride *= view.sizes[d];
  }
  return view;
}

TensorView make_strided_view(void* data, DType dtype, std::initializer_list<int64_t> sizes,
                             std::initializer_list<int64_t> strides, Device device) {
  check_view_sizes("make_strided_view", sizes);
  if (strides.size() != sizes.size()) {
    throw Error("make_strided_view: " + std::to_string(strides.size()) + " strides given for " +
                std::to_string(sizes.size()) + " sizes; give one stride per dim");
  }
  TensorView view = view_without_strides(data, dtype, sizes, device);
  int d = 0;
  for (int64_t stride : strides) view.strides[d++] = stride;
  return view;
}

}  // namespace flashkit
