// src/cuda/sm80/bwd_launch.cuh
// \brief Host side of the sm80 backward: tile choice for a family, the four launches (preprocess,
// main kernel, dq convert, GQA/MQA group sum) on one stream. Included only by the generated
// per-(dtype, family) instance files (the sm90 backward's too: it shares the row kernels' launches).
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

// Blocks of kRowKernelWarps warps covering `rows` rows of head_dim elements (row_lanes).
inline unsigned row_kernel_blocks(int64_t rows, int head_dim, const char* what) {
  const int64_t rows_per_block = int64_t{kRowKernelWarps} * (32 / row_lanes(head_dim));
  const int64_t blocks = (rows + rows_per_block - 1) / rows_per_block;
  if (blocks > INT32_MAX) {
    throw Error(std::string("mha_bwd: ") + what + " rows = " + std::to_string(rows) +
                " exceed the 2^31 - 1 CTAs one launch can run");
  }
  return static_cast<unsigned>(blocks);
}

// Launches before the main kernel: the deterministic mode's semaphores cleared, then dot(dO, O)
// per query row (which also zeroes the dq accumulator). Shared by the sm80 and sm90 backward;
// kKeepScaled (the sm90 backward with dropout) stores (1 - p) dot instead.
template <typename Element, bool kKeepScaled = false>
void launch_bwd_preprocess(const BwdProblem& problem, const BwdWorkspacePointers& ws, cudaStream_t s) {
  const FwdProblem& p = problem.fwd;
  if (problem.deterministic) {
    const BwdWorkspaceLayout layout = BwdWorkspaceLayout::of(problem);
    cuda::check(cudaMemsetAsync(ws.semaphores, 0, layout.total - layout.semaphores, s),
                "cudaMemsetAsync(backward semaphores)");
  }
  const int64_t q_rows = static_cast<int64_t>(p.batch) * p.heads_q * p.seqlen_q;
  if (q_rows > 0) {
    bwd_preprocess_kernel<Element, kKeepScaled>
        <<<row_kernel_blocks(q_rows, p.head_dim, "query"), kRowKernelWarps * 32, 0, s>>>(problem, ws);
    cuda::check_last_launch("bwd_preprocess_kernel");
  }
}

// Launches after the main kernel: dq from its fp32 accumulator, and the GQA/MQA group sum of dk, dv.
template <typename Element>
void launch_bwd_postprocess(const BwdProblem& problem, const BwdWorkspacePointers& ws, cudaStream_t s) {
  const FwdProblem& p = problem.fwd;
  constexpr int kRowThreads = kRowKernelWarps * 32;
  const int64_t q_rows = static_cast<int64_t>(p.batch) * p.heads_q * p.seqlen_q;
  if (q_rows > 0) {
    bwd_dq_convert_kernel<Element><<<row_kernel_blocks(q_rows, p.head_dim, "query"), kRowThreads, 0, s>>>(problem, ws);
    cuda::check_last_launch("bwd_dq_convert_kernel");
  }
  const int64_t kv_rows = static_cast<int64_t>(p.batch) * p.heads_kv * p.seqlen_k;
  if (p.heads_q != p.heads_kv && kv_rows > 0) {
    bwd_group_sum_kernel<Element><<<row_kernel_blocks(kv_rows, p.head_dim, "key"), kRowThreads, 0, s>>>(problem, ws);
    cuda::check_last_launch("bwd_group_sum_kernel");
  }
}

// CTAs of a main kernel with one CTA per (key block of block_n, query head, batch).
inline int64_t bwd_main_grid(const FwdProblem& p, int block_n) {
  const int64_t num_n_blocks = (p.seqlen_k + block_n - 1) / block_n;
  const int64_t num_blocks = num_n_blocks * p.batch * p.heads_q;
  if (num_blocks > INT32_MAX) {
    throw Error("mha_bwd: batch * heads_q * ceil(seqlen_k / " + std::to_string(block_n) + ") = " +
                std::to_string(num_blocks) + " exceeds the 2^31 - 1 CTAs one launch can run");
  }
  return num_blocks;
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
  const BwdWorkspacePointers ws = BwdWorkspacePointers::of(problem);

  launch_bwd_preprocess<Element>(problem, ws, s);
  const int64_t num_blocks = bwd_main_grid(problem.fwd, Traits::kBlockN);
  if (num_blocks > 0) {
    // Two instances: with dropout, and without it (the p = 0 path, untouched by dropout's code).
    auto kernel = p.dropout_p > 0.0f ? bwd_kernel<BwdTraitsOf<kDType, kHeadDimFamily, true>>
                                     : bwd_kernel<Traits>;
    cuda::check(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, Traits::kSmemBytes),
                "cudaFuncSetAttribute(bwd_kernel, max dynamic shared memory)");
    kernel<<<static_cast<unsigned>(num_blocks), Traits::kThreads, Traits::kSmemBytes, s>>>(problem, ws);
    cuda::check_last_launch("sm80 bwd_kernel");
  }
  launch_bwd_postprocess<Element>(problem, ws, s);
}

}  // namespace flashkit::sm80
