// src/cuda/common/programmatic_launch.cuh
// \brief Programmatic dependent launch (PDL, sm_90 and newer), device side and host side.
//
// A kernel launched with cudaLaunchAttributeProgrammaticStreamSerialization may start while the
// kernel before it on the stream is still running, as soon as every CTA of that kernel has called
// allow_dependent_grids() (or exited). It must call wait_for_prior_grids() before it touches
// memory the earlier kernel writes: that waits for the earlier grid's completion and its memory.
// The launch and prologue of a small kernel (a few microseconds) then overlap the tail of the one
// before instead of following it. Both calls are no-ops without the attribute and before sm_90.
#pragma once

#include <cuda_runtime.h>

#include "cuda/cuda_check.h"

namespace flashkit {

__device__ __forceinline__ void wait_for_prior_grids() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;\n" ::: "memory");
#endif
}

__device__ __forceinline__ void allow_dependent_grids() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;\n" ::: "memory");
#endif
}

// kernel<<<grid, block, smem_bytes, stream>>>(args...), as a programmatic dependent of the work
// before it on `stream` when `programmatic` (only on devices of compute capability 9.0 or newer).
template <typename... Params, typename... Args>
void launch_kernel(void (*kernel)(Params...), dim3 grid, dim3 block, size_t smem_bytes,
                   cudaStream_t stream, bool programmatic, const char* what, const Args&... args) {
  cudaLaunchConfig_t config = {};
  config.gridDim = grid;
  config.blockDim = block;
  config.dynamicSmemBytes = smem_bytes;
  config.stream = stream;
  cudaLaunchAttribute attribute = {};
  attribute.id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attribute.val.programmaticStreamSerializationAllowed = 1;
  config.attrs = &attribute;
  config.numAttrs = programmatic ? 1 : 0;
  cuda::check(cudaLaunchKernelEx(&config, kernel, args...), what);
}

}  // namespace flashkit
