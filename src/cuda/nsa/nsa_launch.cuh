// src/cuda/nsa/nsa_launch.cuh
// \brief Host side of the native-sparse-attention kernels: grids, shared-memory opt-in, and the
// backward's three passes in stream order. Included only by the generated per-(dtype, family)
// instance files.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>
#include <string>

#include "cuda/cuda_check.h"
#include "cuda/nsa/nsa_bwd_kernel.cuh"
#include "cuda/nsa/nsa_cuda.h"
#include "cuda/nsa/nsa_fwd_kernel.cuh"
#include "flashkit/error.h"

namespace flashkit::nsa {

template <DType kDType> struct ElementOf;
template <> struct ElementOf<DType::kBFloat16> { using type = __nv_bfloat16; };
template <> struct ElementOf<DType::kFloat16> { using type = __half; };

// One CTA per (query token, 16 heads of a kv head's group, sequence): x = token, y = kv head x
// row block, z = sequence. The grid's y and z dimensions are limited to 65,535.
inline dim3 nsa_grid(const char* fn, const NsaProblem& p) {
  const int64_t m_blocks = (p.heads_q / p.heads_kv + 15) / 16;
  const int64_t grid_y = p.heads_kv * m_blocks;
  if (grid_y > 65535 || p.batch > 65535) {
    throw Error(std::string(fn) + ": batch is " + std::to_string(p.batch) + " and heads_q " +
                std::to_string(p.heads_q) + "; the CUDA kernels support at most 65535 sequences and " +
                "65535 x 16 query heads per call");
  }
  return dim3(static_cast<unsigned>(p.seqlen_q), static_cast<unsigned>(grid_y), static_cast<unsigned>(p.batch));
}

// Lets `kernel` use `bytes` of dynamic shared memory on the current device, or says which device
// cannot give it (sm_86 / sm_89 GPUs offer 99 KiB per CTA; the head-dim-256 kernels need more).
template <typename Kernel>
void opt_in_smem(const char* fn, Kernel kernel, int bytes, const char* kernel_name) {
  int device = 0, available = 0;
  cuda::check(cudaGetDevice(&device), "cudaGetDevice");
  cuda::check(cudaDeviceGetAttribute(&available, cudaDevAttrMaxSharedMemoryPerBlockOptin, device),
              "cudaDeviceGetAttribute(max shared memory per block, opt-in)");
  if (bytes > available) {
    throw Error(std::string(fn) + ": " + kernel_name + " needs " + std::to_string(bytes) +
                " bytes of shared memory per CTA and cuda:" + std::to_string(device) + " offers " +
                std::to_string(available) + "; this head-dim family needs a GPU with more (A100, H100)");
  }
  cuda::check(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, bytes), kernel_name);
}

template <DType kDType, int kHeadDimFamily>
void run_nsa_fwd(const NsaProblem& problem, void* stream_ptr) {
  using Traits = NsaFwdTraits<typename ElementOf<kDType>::type, kHeadDimFamily>;
  if (problem.batch == 0 || problem.seqlen_q == 0) return;
  const auto stream = static_cast<cudaStream_t>(stream_ptr);
  const dim3 grid = nsa_grid("nsa_fwd", problem);
  opt_in_smem("nsa_fwd", nsa_fwd_kernel<Traits>, Traits::kSmemBytes, "nsa_fwd_kernel");
  nsa_fwd_kernel<Traits><<<grid, Traits::kThreads, Traits::kSmemBytes, stream>>>(problem);
  cuda::check_last_launch("nsa_fwd_kernel");
}

template <DType kDType, int kHeadDimFamily>
void run_nsa_bwd(const NsaBwdProblem& problem, void* stream_ptr) {
  using Element = typename ElementOf<kDType>::type;
  using Traits = NsaBwdTraits<Element, kHeadDimFamily>;
  const NsaProblem& f = problem.fwd;
  const auto stream = static_cast<cudaStream_t>(stream_ptr);
  const NsaBwdWorkspaceLayout layout = nsa_bwd_workspace_layout(f);
  const int64_t key_elements = static_cast<int64_t>(f.batch) * f.seqlen_k * f.heads_kv * f.head_dim;
  const int64_t query_rows = static_cast<int64_t>(f.batch) * f.heads_q * f.seqlen_q;
  // The key gradients are sums over the tokens that selected each block: they start at zero
  // (keys no token selected stay there).
  if (key_elements > 0) {
    cuda::check(cudaMemsetAsync(problem.workspace, 0, layout.delta_offset, stream), "cudaMemsetAsync(nsa workspace)");
  }
  if (query_rows > 0) {
    constexpr int kDotWarps = 8;
    nsa_bwd_dot_kernel<Element><<<static_cast<unsigned>((query_rows + kDotWarps - 1) / kDotWarps), kDotWarps * 32,
                                  0, stream>>>(problem);
    cuda::check_last_launch("nsa_bwd_dot_kernel");
    const dim3 grid = nsa_grid("nsa_bwd", f);
    opt_in_smem("nsa_bwd", nsa_bwd_dq_kernel<Traits>, Traits::kSmemBytes, "nsa_bwd_dq_kernel");
    nsa_bwd_dq_kernel<Traits><<<grid, Traits::kThreads, Traits::kSmemBytes, stream>>>(problem);
    cuda::check_last_launch("nsa_bwd_dq_kernel");
  }
  if (key_elements > 0 && query_rows > 0) {
    // x: (key block, 64-key part, token segment); the parts and segments no token reaches exit at once.
    const int64_t parts = (f.block_size + 63) / 64;
    const int64_t segments = (f.seqlen_q + kDkvSegment - 1) / kDkvSegment;
    const int64_t grid_x = static_cast<int64_t>(f.num_key_blocks) * parts * segments;
    if (grid_x > INT32_MAX) {
      throw Error("nsa_bwd: seqlen_k / block_size x seqlen_q / " + std::to_string(kDkvSegment) +
                  " is too large for one launch (" + std::to_string(grid_x) + " CTAs)");
    }
    const dim3 grid(static_cast<unsigned>(grid_x), static_cast<unsigned>(f.heads_kv), static_cast<unsigned>(f.batch));
    opt_in_smem("nsa_bwd", nsa_bwd_dkv_kernel<Traits>, Traits::kDkvSmemBytes, "nsa_bwd_dkv_kernel");
    nsa_bwd_dkv_kernel<Traits><<<grid, Traits::kThreads, Traits::kDkvSmemBytes, stream>>>(problem);
    cuda::check_last_launch("nsa_bwd_dkv_kernel");
  }
  if (key_elements > 0) {
    constexpr int kConvertThreads = 256;
    nsa_bwd_convert_kernel<Element><<<static_cast<unsigned>((key_elements + kConvertThreads - 1) / kConvertThreads),
                                      kConvertThreads, 0, stream>>>(problem);
    cuda::check_last_launch("nsa_bwd_convert_kernel");
  }
}

}  // namespace flashkit::nsa
