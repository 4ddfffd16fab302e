// src/cuda/sm90/tensor_map.cpp
// \brief cuTensorMapEncodeTiled through the runtime's driver entry point (see tensor_map.h).
#include "cuda/sm90/tensor_map.h"

#include <cuda_runtime.h>
#include <cudaTypedefs.h>

#include <string>

#include "flashkit/error.h"

namespace flashkit::sm90 {
namespace {

PFN_cuTensorMapEncodeTiled_v12000 encode_function() {
  static const PFN_cuTensorMapEncodeTiled_v12000 function = [] {
    void* address = nullptr;
    cudaDriverEntryPointQueryResult found = cudaDriverEntryPointSymbolNotFound;
    const cudaError_t code = cudaGetDriverEntryPointByVersion(
        "cuTensorMapEncodeTiled", &address, 12000, cudaEnableDefault, &found);
    if (code != cudaSuccess || found != cudaDriverEntryPointSuccess || address == nullptr) {
      throw Error(std::string("sm90 kernels: the CUDA driver does not provide cuTensorMapEncodeTiled (") +
                  cudaGetErrorString(code) + "); the Hopper kernels need a CUDA 12 driver or newer");
    }
    return reinterpret_cast<PFN_cuTensorMapEncodeTiled_v12000>(address);
  }();
  return function;
}

// The map of `tensor` with elements of `type` and boxes of box[i] elements, 128-byte swizzle, zero
// fill out of bounds.
CUtensorMap encode(const StridedTensor& tensor, CUtensorMapDataType type, const cuuint32_t* box,
                   const char* what) {
  CUtensorMap map;
  cuuint64_t extents[5];
  cuuint64_t strides[4];
  cuuint32_t element_strides[5];
  for (int i = 0; i < tensor.rank; ++i) {
    extents[i] = tensor.extents[i];
    element_strides[i] = 1;
    if (i > 0) strides[i - 1] = tensor.byte_strides[i - 1];
  }
  const CUresult result = encode_function()(
      &map, type, static_cast<cuuint32_t>(tensor.rank), const_cast<void*>(tensor.base), extents, strides,
      box, element_strides, CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B,
      CU_TENSOR_MAP_L2_PROMOTION_L2_256B, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  if (result != CUDA_SUCCESS) {
    std::string shape;
    for (int i = 0; i < tensor.rank; ++i) {
      shape += (i ? ", " : "") + std::to_string(tensor.extents[i]);
    }
    std::string stride_list;
    for (int i = 0; i + 1 < tensor.rank; ++i) {
      stride_list += (i ? ", " : "") + std::to_string(tensor.byte_strides[i]);
    }
    throw Error(std::string("sm90 kernels: cuTensorMapEncodeTiled refused ") + what +
                " (CUresult " + std::to_string(static_cast<int>(result)) + ", extents [" + shape +
                "] innermost first, byte strides [" + stride_list +
                "]); set FLASHKIT_FWD_PATH=sm80 (or FLASHKIT_BWD_PATH=sm80) to run the sm80 kernels");
  }
  return map;
}

}  // namespace

CUtensorMap encode_tensor_map(const StridedTensor& tensor, bool bf16, int box_rows,
                              const char* what) {
  cuuint32_t box[5];
  for (int i = 0; i < tensor.rank; ++i) {
    box[i] = i == 0 ? kSwizzleAtomElements : i == 1 ? static_cast<cuuint32_t>(box_rows) : 1;
  }
  return encode(tensor, bf16 ? CU_TENSOR_MAP_DATA_TYPE_BFLOAT16 : CU_TENSOR_MAP_DATA_TYPE_FLOAT16, box, what);
}

CUtensorMap encode_fp32_tensor_map(const StridedTensor& tensor, const uint32_t* box, const char* what) {
  cuuint32_t boxes[5];
  for (int i = 0; i < tensor.rank; ++i) boxes[i] = box[i];
  return encode(tensor, CU_TENSOR_MAP_DATA_TYPE_FLOAT32, boxes, what);
}

namespace {

// The map of one of the API's 16-bit tensors: `rank` dims, extents innermost first (dim 0 is
// head_dim, contiguous), the element strides of dims 1 .. rank - 1, boxes of box[i] elements. A
// tensor with no rows (`empty`) gets extents of 1; a dim of extent 1 whose stride the driver would
// refuse gets the span of the dims inside it (the stride of such a dim is never used).
CUtensorMap api_tensor_map(const FwdProblem& p, const void* base, int rank, const int64_t* extents,
                           const int64_t* strides, const cuuint32_t* box, bool empty, const char* what) {
  StridedTensor t;
  t.base = base;
  t.rank = rank;
  for (int i = 0; i < rank; ++i) t.extents[i] = static_cast<uint64_t>(i == 0 || !empty ? extents[i] : 1);
  int64_t span = 2 * p.head_dim;  // bytes covered by the dims inside the current one
  for (int i = 0; i + 1 < rank; ++i) {
    const int64_t bytes = 2 * strides[i];
    const bool usable = bytes > 0 && bytes % 16 == 0;
    const int64_t rounded = (span + 15) / 16 * 16;
    t.byte_strides[i] = static_cast<uint64_t>(usable || t.extents[i + 1] != 1 ? bytes : rounded);
    span = static_cast<int64_t>(t.byte_strides[i]) * static_cast<int64_t>(t.extents[i + 1]);
  }
  return encode(t, p.dtype == DType::kBFloat16 ? CU_TENSOR_MAP_DATA_TYPE_BFLOAT16 : CU_TENSOR_MAP_DATA_TYPE_FLOAT16,
                box, what);
}

}  // namespace

CUtensorMap input_tensor_map(const FwdProblem& p, const void* base, int64_t rows, int heads, int64_t row_stride,
                             int64_t head_stride, int64_t batch_stride, int box_rows, const char* what) {
  const int64_t extents[4] = {p.head_dim, rows, heads, p.batch};
  const int64_t strides[3] = {row_stride, head_stride, batch_stride};
  const cuuint32_t box[4] = {kSwizzleAtomElements, static_cast<cuuint32_t>(box_rows), 1, 1};
  return api_tensor_map(p, base, p.is_varlen() ? 3 : 4, extents, strides, box, rows <= 0, what);
}

CUtensorMap grouped_rows_tensor_map(const FwdProblem& p, const void* base, int64_t rows, int heads, int group,
                                    int64_t row_stride, int64_t head_stride, int64_t batch_stride, int box_tokens,
                                    const char* what) {
  const int64_t extents[5] = {p.head_dim, group, rows, heads / group, p.batch};
  const int64_t strides[4] = {head_stride, row_stride, group * head_stride, batch_stride};
  const cuuint32_t box[5] = {kSwizzleAtomElements, static_cast<cuuint32_t>(group),
                             static_cast<cuuint32_t>(box_tokens), 1, 1};
  return api_tensor_map(p, base, p.is_varlen() ? 4 : 5, extents, strides, box, rows <= 0, what);
}

}  // namespace flashkit::sm90
