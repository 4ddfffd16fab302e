// src/cuda/sm80/fwd_launch.cuh
// \brief Host side of the sm80 forward kernel: tile choice for a family, grid, shared memory,
// launch (and, when the caller asked for return_softmax, the attn_probs kernel after it). Included
// only by the generated per-(dtype, family) instance files.
#pragma once

#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <string>

#include "cuda/cuda_check.h"
#include "cuda/sm80/fwd_attn_probs.cuh"
#include "cuda/sm80/fwd_kernel.cuh"
#include "cuda/sm80/fwd_sm80.h"
#include "cuda/sm80/fwd_tile_config.h"
#include "flashkit/error.h"

namespace flashkit::sm80 {

template <DType kDType> struct ElementOf;
template <> struct ElementOf<DType::kBFloat16> { using type = __nv_bfloat16; };
template <> struct ElementOf<DType::kFloat16> { using type = __half; };

// The traits of a family's kernel, with (kDropout) or without dropout: the same tiles.
template <DType kDType, int kHeadDimFamily, bool kDropout>
using FwdTraitsOf =
    FwdKernelTraits<typename ElementOf<kDType>::type, kHeadDimFamily,
                    fwd_tile_config(kHeadDimFamily).block_m, fwd_tile_config(kHeadDimFamily).block_n,
                    fwd_tile_config(kHeadDimFamily).warps,
                    fwd_tile_config(kHeadDimFamily).q_in_registers,
                    fwd_tile_config(kHeadDimFamily).min_blocks_per_sm, kDropout>;

template <DType kDType, int kHeadDimFamily>
void run_fwd(const FwdProblem& problem, void* stream) {
  static_assert(fwd_tile_config(kHeadDimFamily).block_m > 0,
                "no tile configuration for this head-dim family");
  using Traits = FwdTraitsOf<kDType, kHeadDimFamily, false>;

  const int64_t num_m_blocks = (problem.seqlen_q + Traits::kBlockM - 1) / Traits::kBlockM;
  const int64_t num_blocks = num_m_blocks * problem.batch * problem.heads_q;
  if (num_blocks == 0) return;
  if (num_blocks > INT32_MAX) {
    throw Error("mha_fwd: batch * heads_q * ceil(seqlen_q / " + std::to_string(Traits::kBlockM) +
                ") = " + std::to_string(num_blocks) + " exceeds the 2^31 - 1 CTAs one launch can run");
  }

  // Two instances: with dropout, and without it (the p = 0 path, untouched by dropout's code).
  auto kernel = problem.dropout_p > 0.0f ? fwd_kernel<FwdTraitsOf<kDType, kHeadDimFamily, true>>
                                         : fwd_kernel<Traits>;
  cuda::check(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                   Traits::kSmemBytes),
              "cudaFuncSetAttribute(fwd_kernel, max dynamic shared memory)");
  kernel<<<static_cast<unsigned>(num_blocks), Traits::kThreads, Traits::kSmemBytes,
           static_cast<cudaStream_t>(stream)>>>(problem);
  cuda::check_last_launch("sm80 fwd_kernel");

  if (problem.attn_probs != nullptr) {
    // Reads the lse just written, on the same stream.
    const int64_t rows = int64_t{problem.attn_probs_rows} * problem.heads_q * problem.batch;
    const auto grid = static_cast<unsigned>(std::min<int64_t>(rows, INT32_MAX));
    fwd_attn_probs_kernel<typename ElementOf<kDType>::type, kHeadDimFamily>
        <<<grid, kAttnProbsThreads, 0, static_cast<cudaStream_t>(stream)>>>(problem);
    cuda::check_last_launch("sm80 fwd_attn_probs_kernel");
  }
}

}  // namespace flashkit::sm80
