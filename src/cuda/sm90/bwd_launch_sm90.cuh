// src/cuda/sm90/bwd_launch_sm90.cuh
// \brief Host side of the sm90 backward: the sm80 backward's row kernels around the wgmma main
// kernel, on one stream, with the same workspace. Included only by the generated per-(dtype,
// family) instance files.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "cuda/cuda_check.h"
#include "cuda/sm80/bwd_launch.cuh"
#include "cuda/sm90/bwd_kernel_sm90.cuh"
#include "cuda/sm90/bwd_sm90.h"
#include "cuda/sm90/bwd_tile_config_sm90.h"

namespace flashkit::sm90 {

template <DType kDType, int kHeadDimFamily>
void run_bwd(const BwdProblem& problem, void* stream) {
  constexpr BwdTileConfig kTile = bwd_tile_config(kHeadDimFamily);
  static_assert(kTile.block_m > 0, "no sm90 backward tile for this head-dim family");
  using Element = typename sm80::ElementOf<kDType>::type;
  using Traits = BwdKernelTraits<Element, kHeadDimFamily, kTile.block_m, kTile.block_n, kTile.query_parts>;
  auto* s = static_cast<cudaStream_t>(stream);
  const sm80::BwdWorkspacePointers ws = sm80::BwdWorkspacePointers::of(problem);

  sm80::launch_bwd_preprocess<Element>(problem, ws, s);
  const int64_t num_blocks = sm80::bwd_main_grid(problem.fwd, Traits::kBlockN);
  if (num_blocks > 0) {
    auto kernel = bwd_kernel<Traits>;
    cuda::check(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, Traits::kSmemBytes),
                "cudaFuncSetAttribute(sm90 bwd_kernel, max dynamic shared memory)");
    kernel<<<static_cast<unsigned>(num_blocks), Traits::kThreads, Traits::kSmemBytes, s>>>(problem, ws);
    cuda::check_last_launch("sm90 bwd_kernel");
  }
  sm80::launch_bwd_postprocess<Element>(problem, ws, s);
}

}  // namespace flashkit::sm90
