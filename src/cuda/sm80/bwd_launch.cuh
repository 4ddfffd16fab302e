// src/cuda/sm80/bwd_launch.cuh
// \brief Host side of the sm80 backward: tile choice for a family, the four launches (preprocess,
// main kernel, dq convert, GQA/MQA group sum) on one stream. Included only by the generated
// per-(dtype, family) instance files.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>
#include <string>

#include "cuda/cuda_check.h"
#include "cuda/sm80/bwd_kernel.cuh"
#include "cuda/sm80/bwd_row_kernels.cuh"
#include "cuda/sm80/bwd_sm80.h"
#include "cuda/sm80/bwd_tile_config.h"
#include "cuda/sm80/bwd_workspace.h"
#include "cuda/sm80/fwd_launch.cuh"
#include "flashkit/error.h"

namespace flashkit::sm80 {

// Blocks of kRowKernelWarps warps covering `rows` one-warp rows.
inline unsigned row_kernel_blocks(int64_t rows, const char* what) {
  const int64_t blocks = (rows + kRowKernelWarps - 1) / kRowKernelWarps;
  if (blocks > INT32_MAX) {
    throw Error(std::string("mha_bwd: ") + what + " rows = " + std::to_string(rows) +
                " exceed the 2^31 - 1 CTAs one launch can run");
  }
  return static_cast<unsigned>(blocks);
}

// The traits of a family's kernel, with (kDropout) or without dropout: the same tiles.
template <DType kDType, int kHeadDimFamily, bool kDropout>
using BwdTraitsOf =
    BwdKernelTraits<typename ElementOf<kDType>::type, kHeadDimFamily,
                    bwd_tile_config(kHeadDimFamily).block_m, bwd_tile_config(kHeadDimFamily).block_n,
                    bwd_tile_config(kHeadDimFamily).warps, bwd_tile_config(kHeadDimFamily).s_key_warps,
                    bwd_tile_config(kHeadDimFamily).kv_key_warps,
                    bwd_tile_config(kHeadDimFamily).min_blocks_per_sm, kDropout>;

template <DType kDType, int kHeadDimFamily>
void run_bwd(const BwdProblem& problem, void* stream) {
  static_assert(bwd_tile_config(kHeadDimFamily).block_m > 0,
                "no tile configuration for this head-dim family");
  using Element = typename ElementOf<kDType>::type;
  using Traits = BwdTraitsOf<kDType, kHeadDimFamily, false>;
  const FwdProblem& p = problem.fwd;
  auto* s = static_cast<cudaStream_t>(stream);
  const BwdWorkspaceLayout layout = BwdWorkspaceLayout::of(problem);
  const BwdWorkspacePointers ws = BwdWorkspacePointers::of(problem);
  constexpr int kRowThreads = kRowKernelWarps * 32;

  if (problem.deterministic) {
    cuda::check(cudaMemsetAsync(ws.semaphores, 0, layout.total - layout.semaphores, s),
                "cudaMemsetAsync(backward semaphores)");
  }
  const int64_t q_rows = static_cast<int64_t>(p.batch) * p.heads_q * p.seqlen_q;
  if (q_rows > 0) {
    bwd_preprocess_kernel<Element><<<row_kernel_blocks(q_rows, "query"), kRowThreads, 0, s>>>(problem, ws);
    cuda::check_last_launch("sm80 bwd_preprocess_kernel");
  }

  const int64_t num_n_blocks = (p.seqlen_k + Traits::kBlockN - 1) / Traits::kBlockN;
  const int64_t num_blocks = num_n_blocks * p.batch * p.heads_q;
  if (num_blocks > INT32_MAX) {
    throw Error("mha_bwd: batch * heads_q * ceil(seqlen_k / " + std::to_string(Traits::kBlockN) +
                ") = " + std::to_string(num_blocks) + " exceeds the 2^31 - 1 CTAs one launch can run");
  }
  if (num_blocks > 0) {
    // Two instances: with dropout, and without it (the p = 0 path, untouched by dropout's code).
    auto kernel = p.dropout_p > 0.0f ? bwd_kernel<BwdTraitsOf<kDType, kHeadDimFamily, true>>
                                     : bwd_kernel<Traits>;
    cuda::check(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, Traits::kSmemBytes),
                "cudaFuncSetAttribute(bwd_kernel, max dynamic shared memory)");
    kernel<<<static_cast<unsigned>(num_blocks), Traits::kThreads, Traits::kSmemBytes, s>>>(problem, ws);
    cuda::check_last_launch("sm80 bwd_kernel");
  }

  if (q_rows > 0) {
    bwd_dq_convert_kernel<Element><<<row_kernel_blocks(q_rows, "query"), kRowThreads, 0, s>>>(problem, ws);
    cuda::check_last_launch("sm80 bwd_dq_convert_kernel");
  }
  const int64_t kv_rows = static_cast<int64_t>(p.batch) * p.heads_kv * p.seqlen_k;
  if (p.heads_q != p.heads_kv && kv_rows > 0) {
    bwd_group_sum_kernel<Element><<<row_kernel_blocks(kv_rows, "key"), kRowThreads, 0, s>>>(problem, ws);
    cuda::check_last_launch("sm80 bwd_group_sum_kernel");
  }
}

}  // namespace flashkit::sm80
