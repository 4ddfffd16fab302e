// python/csrc/tensor_view.h
// \brief The bridge between torch tensors and flashkit views: at::Tensor -> flashkit::TensorView, and
// the CUDA stream a call runs on (torch's current stream on the tensors' device).
//
// A view borrows the tensor's memory (data pointer with the storage offset applied, sizes, strides in
// elements). Anything a view cannot describe (a dtype or device flashkit has no name for, a rank
// above four) is rejected here with the function, the argument, its value and what is supported;
// everything else (shapes, strides, head dims, which dtype goes where) is flashkit's validation.
#pragma once

#include <optional>

#include <ATen/core/Tensor.h>

#include "flashkit/tensor.h"

namespace flashkit::torch_glue {

// The view of `tensor`, named `name` in errors raised for the call `fn`.
TensorView to_view(const char* fn, const char* name, const at::Tensor& tensor);

// An empty view for an absent optional argument, else to_view.
TensorView to_optional_view(const char* fn, const char* name,
                            const std::optional<at::Tensor>& tensor);

// Raises unless `tensor` has `rank` dims: the glue needs the sizes to allocate the outputs before
// flashkit validates the rest. `layout` names the dims, e.g. "[batch, seqlen_q, heads_q, head_dim]".
void check_rank(const char* fn, const char* name, const at::Tensor& tensor, int64_t rank,
                const char* layout);

// The cudaStream_t of torch's current stream on `device` (nullptr for the CPU), as flashkit takes it.
void* current_stream(const at::Device& device);

}  // namespace flashkit::torch_glue
