// src/api/mha_fwd_kvcache.cpp
// \brief The mha_fwd_kvcache entry points: validate, choose the split count, check the workspace,
// then run on the backend that owns the data. The one place that chooses a decode kernel.
//
// CPU views run the reference (src/cpu/reference_kvcache). CUDA views run the sm80 decode kernels
// of the problem's (dtype, head-dim family) if this build compiled them (build_config.h lists
// them), planned by decode_dispatch.h. Everything that can be rejected without the GPU is rejected
// before the first CUDA call.
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

#include "api/decode_dispatch.h"
#include "api/dispatch_support.h"
#include "api/validate_kvcache.h"
#include "build_config.h"
#include "cpu/reference_kvcache.h"
#include "flashkit/api.h"
#include "flashkit/error.h"

#ifdef FLASHKIT_WITH_CUDA
#include <cuda_runtime.h>

#include "cuda/cuda_check.h"
#include "cuda/sm80/decode_sm80.h"
#endif

namespace flashkit {
namespace {

constexpr const char* kFn = "mha_fwd_kvcache";

using api::build_dtype_name;
using api::debug_enabled;

#ifdef FLASHKIT_WITH_CUDA

// FLASHKIT_CHECK_KVCACHE=1: copy the index arrays to the host and check what kvcache_params.h
// otherwise leaves to the caller. Synchronises with the device (the copies wait for `stream`).
// Read on every call (a getenv is nothing next to a launch), so a test can switch it on and off.
bool contents_check_enabled() {
  const char* value = std::getenv("FLASHKIT_CHECK_KVCACHE");
  return value != nullptr && value[0] != '\0' && value[0] != '0';
}

void check_contents_on_device(const KvcacheProblem& p, void* stream) {
  auto copy = [&](const int* device_array, size_t count, std::vector<int>& host) -> const int* {
    if (device_array == nullptr) return nullptr;
    host.resize(count);
    cuda::check(cudaMemcpyAsync(host.data(), device_array, count * sizeof(int),
                                cudaMemcpyDeviceToHost, static_cast<cudaStream_t>(stream)),
                "cudaMemcpyAsync(kvcache index array to host)");
    return host.data();
  };
  std::vector<int> seqlens, leftpad, batch_idx, table;
  api::KvcacheIndexArrays arrays;
  arrays.cache_seqlens = copy(p.cache_seqlens, p.batch, seqlens);
  arrays.cache_leftpad = copy(p.cache_leftpad, p.batch, leftpad);
  arrays.cache_batch_idx = copy(p.cache_batch_idx, p.batch, batch_idx);
  arrays.block_table =
      copy(p.block_table,
           p.is_paged() ? static_cast<size_t>(p.batch - 1) * p.block_table_batch_stride +
                              p.max_blocks_per_seq
                        : 0,
           table);
  cuda::check(cudaStreamSynchronize(static_cast<cudaStream_t>(stream)),
              "cudaStreamSynchronize(kvcache index arrays)");
  api::check_kvcache_contents(p, arrays);
}

void run_on_cuda(KvcacheProblem problem, const MhaFwdKvcacheParams& params, void* stream) {
  const int device = params.q.device.index;
  api::require_decode_kernel(kFn, problem.dtype, problem.head_dim);
  const int arch = api::decode_device_arch(device);
  if (arch < 80) {
    throw Error(std::string(kFn) + ": cuda:" + std::to_string(device) + " has compute capability " +
                std::to_string(arch / 10) + "." + std::to_string(arch % 10) +
                "; the flashkit CUDA kernels need 8.0 or newer (Ampere, Ada, Hopper)");
  }
  // Once per call: it runs the split model's loop over split counts (twice for a paged cache), on
  // the host's path to a decode step of a few microseconds.
  const api::DecodePlan plan = api::plan_decode(problem, device, params.num_splits);
  problem.num_splits = plan.num_splits;
  const size_t needed = plan.workspace_bytes;
  if (needed > 0) {
    if (params.workspace == nullptr || params.workspace_bytes < needed) {
      throw Error(std::string(kFn) + ": workspace is " +
                  (params.workspace == nullptr ? std::string("null")
                                               : std::to_string(params.workspace_bytes) + " bytes") +
                  " but " + std::to_string(problem.num_splits) + " key splits need " +
                  std::to_string(needed) +
                  " bytes (mha_fwd_kvcache_workspace_size); pass that much, or num_splits = 1");
    }
    api::check_decode_workspace_alignment(kFn, params.workspace);
    problem.workspace = params.workspace;
    problem.workspace_bytes = params.workspace_bytes;
  }
  const api::CurrentDeviceGuard device_guard(device);
  if (contents_check_enabled()) check_contents_on_device(problem, stream);
  if (debug_enabled()) {
    std::fprintf(stderr,
                 "flashkit: %s: cuda:%d sm80 decode, %s head dim %d (family %d), batch %d heads "
                 "%d/%d seqlen_q %d, %s cache capacity %d (page %d), append %d, rotary %d, "
                 "%d split(s), %s pipeline%s\n",
                 kFn, device, build_dtype_name(problem.dtype), problem.head_dim,
                 sm80::decode_head_dim_family(problem.head_dim), problem.batch, problem.heads_q,
                 problem.heads_kv, problem.seqlen_q, problem.is_paged() ? "paged" : "contiguous",
                 problem.cache_capacity, problem.page_block_size, problem.seqlen_new,
                 problem.rotary_dim, problem.num_splits, plan.whole_sm ? "whole-SM" : "shared-SM",
                 plan.programmatic ? ", programmatic launch" : "");
  }
  api::launch_decode(problem, plan, stream);
}

#endif  // FLASHKIT_WITH_CUDA

#ifndef FLASHKIT_WITH_CUDA
[[noreturn]] void fail_no_cuda(const Device& device) {
  throw Error(std::string(kFn) + ": the tensors are on cuda:" + std::to_string(device.index) +
              " but this build of flashkit has no CUDA kernels (configured without nvcc); "
              "rebuild with the CUDA toolkit and -DFLASHKIT_CUDA=ON, or pass CPU tensors");
}
#endif

// The split count and workspace bytes a call with these params uses.
struct SplitPlan {
  int num_splits = 1;
  size_t workspace_bytes = 0;
};

SplitPlan plan_splits(const MhaFwdKvcacheParams& params) {
  const KvcacheProblem problem = api::validate_mha_fwd_kvcache(params);
  SplitPlan plan;
  if (params.q.device.kind == DeviceKind::kCpu) return plan;
#ifdef FLASHKIT_WITH_CUDA
  api::require_decode_kernel(kFn, problem.dtype, problem.head_dim);
  const api::DecodePlan decode = api::plan_decode(problem, params.q.device.index, params.num_splits);
  plan.num_splits = decode.num_splits;
  plan.workspace_bytes = decode.workspace_bytes;
  return plan;
#else
  (void)problem;
  fail_no_cuda(params.q.device);
#endif
}

}  // namespace

void mha_fwd_kvcache(const MhaFwdKvcacheParams& params, void* stream) {
  const KvcacheProblem problem = api::validate_mha_fwd_kvcache(params);
  if (params.q.device.kind == DeviceKind::kCpu) {
    if (debug_enabled()) std::fprintf(stderr, "flashkit: %s: cpu reference backend\n", kFn);
    cpu::reference_kvcache(problem);
    return;
  }
#ifdef FLASHKIT_WITH_CUDA
  run_on_cuda(problem, params, stream);
#else
  (void)stream;
  fail_no_cuda(params.q.device);
#endif
}

size_t mha_fwd_kvcache_workspace_size(const MhaFwdKvcacheParams& params) {
  return plan_splits(params).workspace_bytes;
}

int mha_fwd_kvcache_num_splits(const MhaFwdKvcacheParams& params) {
  return plan_splits(params).num_splits;
}

bool cuda_kvcache_built(DType dtype, int head_dim) {
  if (head_dim <= 0 || head_dim % 8 != 0 || head_dim > 256) return false;
#ifdef FLASHKIT_WITH_CUDA
  return api::decode_kernel_built(dtype, head_dim);
#else
  (void)dtype;
  return false;
#endif
}

}  // namespace flashkit
