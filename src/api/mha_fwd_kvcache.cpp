// src/api/mha_fwd_kvcache.cpp
// \brief The mha_fwd_kvcache entry points: validate, choose the split count, check the workspace,
// then run on the backend that owns the data. The one place that chooses a decode kernel.
//
// CPU views run the reference (src/cpu/reference_kvcache). CUDA views run the sm80 decode kernels
// of the problem's (dtype, head-dim family) if this build compiled them (build_config.h lists
// them). Everything that can be rejected without the GPU is rejected before the first CUDA call;
// the split count of num_splits = 0 needs the device's SM count, which the first call on a device
// asks for (cudaDeviceGetAttribute, no synchronisation) and later calls reuse.
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <map>
#include <mutex>
#include <string>
#include <vector>

#include "api/dispatch_support.h"
#include "api/split_heuristic.h"
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

static_assert(api::kMaxKvcacheSplits <= sm80::kDecodeMaxSplits,
              "the decode combine cannot merge as many splits as validation allows");

using RunDecode = void (*)(const KvcacheProblem&, const sm80::DecodeLaunchPlan&, void*);

RunDecode find_sm80_decode(DType dtype, int family) {
#define FLASHKIT_SM80_DECODE_INSTANCE(kDType, kFamily) \
  if (dtype == DType::kDType && family == kFamily) return &sm80::run_decode<DType::kDType, kFamily>;
  FLASHKIT_SM80_DECODE_INSTANCES
#undef FLASHKIT_SM80_DECODE_INSTANCE
  return nullptr;
}

RunDecode require_sm80_decode(const KvcacheProblem& problem) {
  const int family = sm80::decode_head_dim_family(problem.head_dim);
  const RunDecode run = find_sm80_decode(problem.dtype, family);
  if (run == nullptr) {
    bool family_built = false;
    bool dtype_built = false;
    for (DType dtype : {DType::kBFloat16, DType::kFloat16}) {
      family_built |= find_sm80_decode(dtype, family) != nullptr;
    }
    for (int other : sm80::kDecodeHeadDimFamilies) {
      dtype_built |= find_sm80_decode(problem.dtype, other) != nullptr;
    }
    api::throw_kernel_not_built(kFn, "decode", problem.dtype, problem.head_dim, family,
                                family_built, dtype_built);
  }
  return run;
}

// What the dispatch needs to know about a device, queried once per device and process: a decode
// step of a small batch takes a few microseconds on the GPU, so per-call attribute queries would
// show up in its latency.
struct DeviceLimits {
  int arch = 0;
  int sm_count = 0;
  int max_smem_per_block = 0;  // with the opt-in
  int smem_per_sm = 0;
  int reserved_smem_per_block = 0;  // what the runtime keeps of an SM's shared memory per CTA
};

DeviceLimits device_limits(int device) {
  static std::mutex mutex;
  static std::map<int, DeviceLimits> known;
  const std::lock_guard<std::mutex> lock(mutex);
  const auto found = known.find(device);
  if (found != known.end()) return found->second;
  DeviceLimits limits;
  int major = 0, minor = 0;
  cuda::check(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device),
              "cudaDeviceGetAttribute(compute capability major)");
  cuda::check(cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, device),
              "cudaDeviceGetAttribute(compute capability minor)");
  cuda::check(cudaDeviceGetAttribute(&limits.sm_count, cudaDevAttrMultiProcessorCount, device),
              "cudaDeviceGetAttribute(multiprocessor count)");
  cuda::check(cudaDeviceGetAttribute(&limits.max_smem_per_block,
                                     cudaDevAttrMaxSharedMemoryPerBlockOptin, device),
              "cudaDeviceGetAttribute(max shared memory per block, opt-in)");
  cuda::check(cudaDeviceGetAttribute(&limits.smem_per_sm,
                                     cudaDevAttrMaxSharedMemoryPerMultiprocessor, device),
              "cudaDeviceGetAttribute(max shared memory per multiprocessor)");
  cuda::check(cudaDeviceGetAttribute(&limits.reserved_smem_per_block,
                                     cudaDevAttrReservedSharedMemoryPerBlock, device),
              "cudaDeviceGetAttribute(reserved shared memory per block)");
  limits.arch = 10 * major + minor;
  known[device] = limits;
  return limits;
}

// The decode CTAs of one split: batch x heads_kv x blocks of packed query rows.
int64_t decode_ctas(const KvcacheProblem& problem) {
  const int64_t packed_rows = static_cast<int64_t>(problem.seqlen_q) *
                              (problem.heads_q / problem.heads_kv);
  return static_cast<int64_t>(problem.batch) * problem.heads_kv *
         ((packed_rows + sm80::kDecodeRows - 1) / sm80::kDecodeRows);
}

// The split model's view of this problem on this device (split_heuristic.h), CTAs per SM included.
api::SplitShape split_shape(const KvcacheProblem& problem, const DeviceLimits& limits) {
  // The longest sequence: exact for one scalar length, else bounded by the capacity (the lengths
  // are on the device).
  const int64_t max_keys = problem.cache_seqlens == nullptr
                               ? static_cast<int64_t>(problem.cache_seqlen) + problem.seqlen_new
                               : problem.cache_capacity;
  api::SplitShape shape;
  shape.ctas = decode_ctas(problem);
  shape.key_blocks = (max_keys + sm80::kDecodeBlockN - 1) / sm80::kDecodeBlockN;
  shape.sm_count = limits.sm_count;
  shape.max_splits = api::kMaxKvcacheSplits;
  const int family = sm80::decode_head_dim_family(problem.head_dim);
  shape.ctas_per_sm = api::decode_ctas_per_sm(
      shape, sm80::decode_smem_bytes(family, false, problem.is_paged()) + limits.reserved_smem_per_block,
      limits.smem_per_sm);
  return shape;
}

// The split count of a CUDA call: the caller's, or the heuristic's for `shape`.
int cuda_num_splits(const api::SplitShape& shape, int requested) {
  return requested > 0 ? requested : api::choose_num_splits(shape);
}

// The whole-SM pipeline for a contiguous cache when the split model counts one CTA per SM, the
// launch puts at most one CTA on an SM, and the device lets one CTA take that much shared memory
// (sm_90: 227 KiB; not sm_80's 163 KiB or sm_86/89's 99 KiB); PDL from sm_90 on. A paged cache
// keeps the shared-SM pipeline even at one CTA per SM: its deeper ring read 256-token pages slower
// (H200, batch 1, 16 splits: 1.59 / 3.13 / 4.05 TB/s at 8k / 32k / 128k against 1.88 / 3.33 / 4.24
// in session 12). Session 19 traced that to the unrolled prologue's cold instruction-cache lines
// (its deeper ring unrolled more blocks); with the prologue rolled the whole-SM pipeline reads
// paged caches no faster (batch 1: 1.78 / 3.26 / 4.07 TB/s against 1.85 / 3.25 / 4.11).
sm80::DecodeLaunchPlan decode_launch_plan(const KvcacheProblem& problem, const api::SplitShape& shape,
                                          const DeviceLimits& limits) {
  const int family = sm80::decode_head_dim_family(problem.head_dim);
  sm80::DecodeLaunchPlan plan;
  plan.whole_sm = !problem.is_paged() && shape.ctas_per_sm == 1 &&
                  api::one_cta_per_sm(decode_ctas(problem), problem.num_splits, limits.sm_count) &&
                  sm80::decode_smem_bytes(family, true, false) <= limits.max_smem_per_block;
  plan.programmatic = limits.arch >= 90;
  return plan;
}

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
  const RunDecode run = require_sm80_decode(problem);
  const DeviceLimits limits = device_limits(device);
  const int arch = limits.arch;
  if (arch < 80) {
    throw Error(std::string(kFn) + ": cuda:" + std::to_string(device) + " has compute capability " +
                std::to_string(arch / 10) + "." + std::to_string(arch % 10) +
                "; the flashkit CUDA kernels need 8.0 or newer (Ampere, Ada, Hopper)");
  }
  // Once per call: it runs the split model's loop over split counts (twice for a paged cache), on
  // the host's path to a decode step of a few microseconds.
  const api::SplitShape shape = split_shape(problem, limits);
  problem.num_splits = cuda_num_splits(shape, params.num_splits);
  const size_t needed = sm80::decode_workspace_layout(problem, problem.num_splits).total_bytes;
  if (needed > 0) {
    if (params.workspace == nullptr || params.workspace_bytes < needed) {
      throw Error(std::string(kFn) + ": workspace is " +
                  (params.workspace == nullptr ? std::string("null")
                                               : std::to_string(params.workspace_bytes) + " bytes") +
                  " but " + std::to_string(problem.num_splits) + " key splits need " +
                  std::to_string(needed) +
                  " bytes (mha_fwd_kvcache_workspace_size); pass that much, or num_splits = 1");
    }
    if (reinterpret_cast<uintptr_t>(params.workspace) % 256 != 0) {
      char address[32];
      std::snprintf(address, sizeof address, "%p", params.workspace);
      throw Error(std::string(kFn) + ": workspace (" + address +
                  ") is not 256-byte aligned; pass memory from cudaMalloc or an aligned pool");
    }
    problem.workspace = params.workspace;
    problem.workspace_bytes = params.workspace_bytes;
  }
  const sm80::DecodeLaunchPlan plan = decode_launch_plan(problem, shape, limits);
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
  run(problem, plan, stream);
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
  require_sm80_decode(problem);
  plan.num_splits =
      cuda_num_splits(split_shape(problem, device_limits(params.q.device.index)), params.num_splits);
  plan.workspace_bytes = sm80::decode_workspace_layout(problem, plan.num_splits).total_bytes;
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
  return find_sm80_decode(dtype, sm80::decode_head_dim_family(head_dim)) != nullptr;
#else
  (void)dtype;
  return false;
#endif
}

}  // namespace flashkit
