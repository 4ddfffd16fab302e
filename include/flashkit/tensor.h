// flashkit/tensor.h
// \brief A non-owning view of a strided tensor: what every flashkit entry point takes.
//
// flashkit never allocates or frees the memory a view points to. A view carries the data pointer,
// the element type, up to four sizes and strides (strides in elements, not bytes) and the device the
// memory lives on. The layouts follow FlashAttention: q/k/v are [batch, seqlen, heads, head_dim]
// (or [total_tokens, heads, head_dim] for variable-length batches) with the last dim contiguous and
// every other stride free.
#pragma once

#include <cstdint>
#include <initializer_list>
#include <string>

namespace flashkit {

enum class DType : uint8_t { kFloat16, kBFloat16, kFloat32, kInt32 };

// Bytes per element of a dtype.
constexpr int64_t dtype_size(DType t) {
  return (t == DType::kFloat16 || t == DType::kBFloat16) ? 2 : 4;
}

const char* dtype_name(DType t);

// Where a view's memory lives. kCpu data runs on the CPU backend (the reference); kCuda data on the
// GPU kernels, on the device given by `device_index`.
enum class DeviceKind : uint8_t { kCpu, kCuda };

struct Device {
  DeviceKind kind = DeviceKind::kCpu;
  int index = 0;
  bool operator==(const Device& o) const { return kind == o.kind && index == o.index; }
  bool operator!=(const Device& o) const { return !(*this == o); }
};

constexpr int kMaxRank = 4;

struct TensorView {
  void* data = nullptr;
  DType dtype = DType::kFloat32;
  int rank = 0;
  int64_t sizes[kMaxRank] = {0, 0, 0, 0};
  int64_t strides[kMaxRank] = {0, 0, 0, 0};  // in elements
  Device device{};

  // True when the view names a tensor at all (optional arguments are empty views).
  bool defined() const { return rank > 0; }
  int64_t size(int dim) const { return sizes[dim < 0 ? dim + rank : dim]; }
  int64_t stride(int dim) const { return strides[dim < 0 ? dim + rank : dim]; }
  int64_t numel() const;
  bool is_contiguous() const;
  std::string shape_string() const;  // "[2, 128, 16, 64]"
};

// A view over contiguous (row-major) memory.
TensorView make_view(void* data, DType dtype, std::initializer_list<int64_t> sizes, Device device);

// A view with explicit strides (in elements).
TensorView make_strided_view(void* data, DType dtype, std::initializer_list<int64_t> sizes,
                             std::initializer_list<int64_t> strides, Device device);

}  // namespace flashkit
