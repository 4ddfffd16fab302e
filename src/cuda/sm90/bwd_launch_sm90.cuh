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

// The traits of a family's kernel, in deterministic mode or not, with dropout or not: the same
// tiles and shared memory (dropout's instances add the Philox exchange at its end).
template <DType kDType, int kHeadDimFamily, bool kDeterministic, bool kDropout>
using BwdTraitsOf = BwdKernelTraits<typename sm80::ElementOf<kDType>::type, kHeadDimFamily,
                                    bwd_tile_config(kHeadDimFamily).block_m, bwd_tile_config(kHeadDimFamily).block_n,
                                    bwd_tile_config(kHeadDimFamily).query_parts,
                                    bwd_tile_config(kHeadDimFamily).split_head_dim, kDeterministic, kDropout>;

// A kernel instance and the dynamic shared memory its traits plan.
struct BwdInstance {
  void (*kernel)(BwdProblem, sm80::BwdWorkspacePointers);
  int smem_bytes;
};

template <typename Traits>
BwdInstance bwd_instance() {
  return {bwd_kernel<Traits>, Traits::kSmemBytes};
}

// The instance for `problem`'s mode and dropout.
template <DType kDType, int kHeadDimFamily>
BwdInstance bwd_instance_for(const BwdProblem& problem) {
  const bool dropout = problem.fwd.dropout_p > 0.0f;
  if (problem.deterministic) {
    return dropout ? bwd_instance<BwdTraitsOf<kDType, kHeadDimFamily, true, true>>()
                   : bwd_instance<BwdTraitsOf<kDType, kHeadDimFamily, true, false>>();
  }
  return dropout ? bwd_instance<BwdTraitsOf<kDType, kHeadDimFamily, false, true>>()
                 : bwd_instance<BwdTraitsOf<kDType, kHeadDimFamily, false, false>>();
}

template <DType kDType, int kHeadDimFamily>
void run_bwd(const BwdProblem& problem, void* stream) {
  constexpr BwdTileConfig kTile = bwd_tile_config(kHeadDimFamily);
  static_assert(kTile.block_m > 0, "no sm90 backward tile for this head-dim family");
  // The workspace (sm80::bwd_workspace_bytes, whatever path runs) holds one deterministic-mode
  // semaphore per sm80 query block; this kernel's query blocks are as large or larger.
  static_assert(kTile.block_m >= sm80::bwd_tile_config(kHeadDimFamily).block_m,
                "the workspace's semaphores cover this kernel's query blocks");
  using Element = typename sm80::ElementOf<kDType>::type;
  using Traits = BwdTraitsOf<kDType, kHeadDimFamily, false, false>;
  auto* s = static_cast<cudaStream_t>(stream);
  const sm80::BwdWorkspacePointers ws = sm80::BwdWorkspacePointers::of(problem);

  // The dropout instances take dot(dO, O) times 1 - p (dropout_score_gradients_t).
  if (problem.fwd.dropout_p > 0.0f) {
    sm80::launch_bwd_preprocess<Element, true>(problem, ws, s);
  } else {
    sm80::launch_bwd_preprocess<Element>(problem, ws, s);
  }
  const int64_t num_blocks = sm80::bwd_main_grid(problem.fwd, Traits::kBlockN);
  if (num_blocks > 0) {
    const BwdInstance instance = bwd_instance_for<kDType, kHeadDimFamily>(problem);
    cuda::check(cudaFuncSetAttribute(instance.kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                     instance.smem_bytes),
                "cudaFuncSetAttribute(sm90 bwd_kernel, max dynamic shared memory)");
    instance.kernel<<<static_cast<unsigned>(num_blocks), Traits::kThreads, instance.smem_bytes, s>>>(problem, ws);
    cuda::check_last_launch("sm90 bwd_kernel");
  }
  sm80::launch_bwd_postprocess<Element>(problem, ws, s);
}

}  // namespace flashkit::sm90
