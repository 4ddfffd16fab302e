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

}  // namespace flashkit::sm90
