// src/cuda/sm80/decode_launch.cuh
// \brief Host side of the sm80 decode path: append pass, split decode kernel (the shared-SM or
// the whole-SM pipeline, decode_sm80.h), combine pass, in that order on one stream. Included only
// by the generated per-(dtype, family) instance files.
#pragma once

#include <cuda_runtime.h>

#include <atomic>
#include <cstdint>
#include <string>

#include "cuda/common/programmatic_launch.cuh"
#include "cuda/cuda_check.h"
#include "cuda/sm80/decode_append.cuh"
#include "cuda/sm80/decode_combine.cuh"
#include "cuda/sm80/decode_kernel.cuh"
#include "cuda/sm80/decode_sm80.h"
#include "flashkit/error.h"

namespace flashkit::sm80 {

template <DType kDType> struct DecodeElementOf;
template <> struct DecodeElementOf<DType::kBFloat16> { using type = __nv_bfloat16; };
template <> struct DecodeElementOf<DType::kFloat16> { using type = __half; };

// The grid's y and z dimensions are limited to 65,535.
constexpr int64_t kMaxGridYZ = 65535;

// The shared-memory opt-in of a decode kernel is per device; it is set once per device (a few
// microseconds per call otherwise, comparable to a small decode step).
template <typename Traits>
void opt_in_decode_smem() {
  static std::atomic<uint64_t> opted_in_devices{0};
  int device = 0;
  cuda::check(cudaGetDevice(&device), "cudaGetDevice");
  const uint64_t device_bit = device < 64 ? uint64_t{1} << device : 0;
  if (device_bit != 0 && (opted_in_devices.load(std::memory_order_acquire) & device_bit) != 0) return;
  cuda::check(cudaFuncSetAttribute(decode_kernel<Traits>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                   Traits::kSmemBytes),
              "cudaFuncSetAttribute(decode_kernel, max dynamic shared memory)");
  opted_in_devices.fetch_or(device_bit, std::memory_order_release);
}

template <typename Traits>
void launch_decode_kernel(const KvcacheProblem& problem, dim3 grid, bool programmatic,
                          cudaStream_t stream) {
  opt_in_decode_smem<Traits>();
  launch_kernel(decode_kernel<Traits>, grid, dim3(Traits::kThreads), Traits::kSmemBytes, stream,
                programmatic, "sm80 decode_kernel", problem);
}

// The combine pass: one warp per row of [batch, heads_q, seqlen_q].
template <typename Element, int kHeadDimFamily>
void launch_combine(const KvcacheProblem& problem, bool programmatic, cudaStream_t stream) {
  const int64_t rows = static_cast<int64_t>(problem.batch) * problem.heads_q * problem.seqlen_q;
  const int64_t blocks = (rows + kCombineWarps - 1) / kCombineWarps;
  launch_kernel(decode_combine_kernel<Element, kHeadDimFamily>, dim3(static_cast<unsigned>(blocks)),
                dim3(kCombineWarps * 32), 0, stream, programmatic, "sm80 decode_combine_kernel", problem);
}

template <DType kDType, int kHeadDimFamily>
void run_decode(const KvcacheProblem& problem, const DecodeLaunchPlan& plan, void* stream_ptr) {
  using Element = typename DecodeElementOf<kDType>::type;
  const auto stream = static_cast<cudaStream_t>(stream_ptr);
  if (problem.batch > kMaxGridYZ || problem.heads_kv > kMaxGridYZ) {
    throw Error("mha_fwd_kvcache: batch is " + std::to_string(problem.batch) + " and heads_kv " +
                std::to_string(problem.heads_kv) +
                "; the CUDA decode kernels support at most 65535 of each per call");
  }

  if (plan.combine_only) {
    launch_combine<Element, kHeadDimFamily>(problem, false, stream);
    return;
  }
  if (problem.has_append() && problem.seqlen_new > 0) {
    decode_append_kernel<Element><<<dim3(problem.seqlen_new, problem.batch), kAppendThreads, 0,
                                    stream>>>(problem);
    cuda::check_last_launch("sm80 decode_append_kernel");
  }

  const int64_t packed_rows = static_cast<int64_t>(problem.seqlen_q) * (problem.heads_q / problem.heads_kv);
  const int64_t m_blocks = (packed_rows + kDecodeRows - 1) / kDecodeRows;
  if (m_blocks == 0) return;
  const int64_t grid_x = m_blocks * problem.num_splits;
  if (grid_x > INT32_MAX) {
    throw Error("mha_fwd_kvcache: seqlen_q * heads_q / heads_kv * num_splits is too large for one "
                "launch (" + std::to_string(grid_x) + " CTAs along x)");
  }
  const dim3 grid(static_cast<unsigned>(grid_x), problem.heads_kv, problem.batch);
  // Three instances: a contiguous cache on the whole-SM or the shared-SM pipeline
  // (plan.whole_sm), a paged one on the shared-SM pipeline (decode_launch_plan says why).
  if (problem.is_paged()) {
    launch_decode_kernel<DecodeTraits<Element, kHeadDimFamily, false, true>>(problem, grid,
                                                                            plan.programmatic, stream);
  } else if (plan.whole_sm) {
    launch_decode_kernel<DecodeTraits<Element, kHeadDimFamily, true, false>>(problem, grid,
                                                                            plan.programmatic, stream);
  } else {
    launch_decode_kernel<DecodeTraits<Element, kHeadDimFamily, false, false>>(problem, grid,
                                                                             plan.programmatic, stream);
  }

  if (problem.num_splits > 1) launch_combine<Element, kHeadDimFamily>(problem, plan.programmatic, stream);
}

}  // namespace flashkit::sm80
