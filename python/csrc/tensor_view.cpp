// python/csrc/tensor_view.cpp
// \brief at::Tensor -> flashkit::TensorView and torch's current stream (see tensor_view.h).
#include "tensor_view.h"

#include <c10/util/Exception.h>

#ifdef FLASHKIT_TORCH_CUDA
#include <c10/cuda/CUDAStream.h>
#endif

namespace flashkit::torch_glue {
namespace {

DType to_flashkit_dtype(const char* fn, const char* name, at::ScalarType type) {
  switch (type) {
    case at::kHalf:
      return DType::kFloat16;
    case at::kBFloat16:
      return DType::kBFloat16;
    case at::kFloat:
      return DType::kFloat32;
    case at::kInt:
      return DType::kInt32;
    default:
      TORCH_CHECK(false, fn, ": ", name, " has dtype ", type,
                  "; supported: float16 and bfloat16 (q, k, v and gradients), float32 "
                  "(softmax_lse, alibi_slopes), int32 (cu_seqlens, seqused_k, cache_seqlens, "
                  "cache_batch_idx, cache_leftpad, block_table, block_indices, block_counts)");
  }
}

Device to_flashkit_device(const char* fn, const char* name, const at::Device& device) {
  if (device.is_cpu()) return Device{DeviceKind::kCpu, 0};
  TORCH_CHECK(device.is_cuda(), fn, ": ", name, " is on ", device,
              "; supported: cpu (the reference backend) and cuda devices");
  return Device{DeviceKind::kCuda, device.index()};
}

}  // namespace

TensorView to_view(const char* fn, const char* name, const at::Tensor& tensor) {
  TORCH_CHECK(tensor.defined(), fn, ": ", name, " is an undefined tensor");
  TORCH_CHECK(tensor.dim() >= 1 && tensor.dim() <= kMaxRank, fn, ": ", name, " has ", tensor.dim(),
              " dims (shape ", tensor.sizes(), "); flashkit takes tensors of 1 to ", kMaxRank,
              " dims");
  TensorView view;
  view.data = tensor.data_ptr();
  view.dtype = to_flashkit_dtype(fn, name, tensor.scalar_type());
  view.rank = static_cast<int>(tensor.dim());
  for (int d = 0; d < view.rank; ++d) {
    view.sizes[d] = tensor.size(d);
    view.strides[d] = tensor.stride(d);
  }
  view.device = to_flashkit_device(fn, name, tensor.device());
  return view;
}

TensorView to_optional_view(const char* fn, const char* name,
                            const std::optional<at::Tensor>& tensor) {
  if (!tensor.has_value() || !tensor->defined()) return TensorView{};
  return to_view(fn, name, *tensor);
}

void check_rank(const char* fn, const char* name, const at::Tensor& tensor, int64_t rank,
                const char* layout) {
  TORCH_CHECK(tensor.dim() == rank, fn, ": ", name, " has shape ", tensor.sizes(), "; expected ",
              rank, " dims ", layout);
}

void* current_stream(const at::Device& device) {
#ifdef FLASHKIT_TORCH_CUDA
  if (device.is_cuda()) return c10::cuda::getCurrentCUDAStream(device.index()).stream();
#endif
  (void)device;
  return nullptr;
}

}  // namespace flashkit::torch_glue
