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
#include "cuda/sm90/tensor_map.h"

namespace flashkit::sm90 {

// The traits of a family's kernel, in deterministic mode or not, with dropout or not: the same
// tiles and shared memory (dropout's instances add the Philox exchange at its end).
template <DType kDType, int kHeadDimFamily, bool kDeterministic, bool kDropout>
using BwdTraitsOf = BwdKernelTraits<typename sm80::ElementOf<kDType>::type, kHeadDimFamily,
                                    bwd_tile_config(kHeadDimFamily).block_m, bwd_tile_config(kHeadDimFamily).block_n,
                                    bwd_tile_config(kHeadDimFamily).query_parts,
                                    bwd_tile_config(kHeadDimFamily).split_head_dim, kDeterministic, kDropout>;

// A kernel instance, the dynamic shared memory its traits plan, and whether it adds dQ through the
// accumulator's tensor map (BwdKernelTraits::kDqBulkReduce). Its parameters: the problem, the
// workspace, and the tensor maps of q, dout and the dQ accumulator.
struct BwdInstance {
  void (*kernel)(BwdProblem, sm80::BwdWorkspacePointers, CUtensorMap, CUtensorMap, CUtensorMap);
  int smem_bytes;
  bool reduces_dq_in_bulk;
};

template <typename Traits>
BwdInstance bwd_instance() {
  return {bwd_kernel<Traits>, Traits::kSmemBytes, Traits::kDqBulkReduce};
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

// The fp32 dQ accumulator [total_q][heads_q][head_dim] as the tensor map of the kernels' bulk
// reductions (BwdKernelTraits::kDqBulkReduce): boxes of 32 columns x 1 head x 16 rows. A problem
// without queries gets a map of one row, never used.
inline CUtensorMap dq_accum_tensor_map(const BwdProblem& problem, const sm80::BwdWorkspacePointers& ws,
                                       int box_columns) {
  const FwdProblem& p = problem.fwd;
  StridedTensor t;
  t.base = ws.dq_accum;
  t.rank = 3;
  t.extents[0] = static_cast<uint64_t>(p.head_dim);
  t.extents[1] = static_cast<uint64_t>(p.heads_q);
  t.extents[2] = static_cast<uint64_t>(problem.total_q > 0 ? problem.total_q : 1);
  t.byte_strides[0] = static_cast<uint64_t>(p.head_dim) * sizeof(float);
  t.byte_strides[1] = static_cast<uint64_t>(p.heads_q) * p.head_dim * sizeof(float);
  const uint32_t box[3] = {static_cast<uint32_t>(box_columns), 1, 16};
  return encode_fp32_tensor_map(t, box, "the dQ accumulator");
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
    // Q and dO come by the copy engine, a query block (BlockM rows) per box.
    const FwdProblem& p = problem.fwd;
    const int64_t rows = p.q_tensor_rows();
    const CUtensorMap q_map = input_tensor_map(p, p.q, rows, p.heads_q, p.q_row_stride, p.q_head_stride,
                                               p.q_batch_stride, Traits::kBlockM, "q");
    const CUtensorMap do_map =
        input_tensor_map(p, problem.dout, rows, p.heads_q, problem.dout_row_stride, problem.dout_head_stride,
                         problem.dout_batch_stride, Traits::kBlockM, "dout");
    // The instances that add dQ with atomics never read the map: no encoding for them.
    const CUtensorMap dq_map =
        instance.reduces_dq_in_bulk ? dq_accum_tensor_map(problem, ws, Traits::kDqBoxColumns) : CUtensorMap{};
    instance.kernel<<<static_cast<unsigned>(num_blocks), Traits::kThreads, instance.smem_bytes, s>>>(
        problem, ws, q_map, do_map, dq_map);
    cuda::check_last_launch("sm90 bwd_kernel");
  }
  sm80::launch_bwd_postprocess<Element>(problem, ws, s);
}

}  // namespace flashkit::sm90
