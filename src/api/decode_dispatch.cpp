// src/api/decode_dispatch.cpp
// \brief The CUDA decode kernels' lookup, split count, workspace and pipeline (decode_dispatch.h).
//
// The split count of a heuristic call needs the device's SM count, which the first call on a
// device asks for (cudaDeviceGetAttribute, no synchronisation) and later calls reuse.
#include "api/decode_dispatch.h"

#ifdef FLASHKIT_WITH_CUDA

#include <cuda_runtime.h>

#include <cstdint>
#include <cstdio>
#include <map>
#include <mutex>
#include <string>

#include "api/dispatch_support.h"
#include "api/split_heuristic.h"
#include "api/validate_kvcache.h"
#include "build_config.h"
#include "cuda/cuda_check.h"
#include "cuda/sm80/decode_sm80.h"
#include "flashkit/error.h"

namespace flashkit::api {
namespace {

static_assert(kMaxKvcacheSplits <= sm80::kDecodeMaxSplits,
              "the decode combine cannot merge as many splits as validation allows");

using RunDecode = void (*)(const KvcacheProblem&, const sm80::DecodeLaunchPlan&, void*);

RunDecode find_sm80_decode(DType dtype, int family) {
#define FLASHKIT_SM80_DECODE_INSTANCE(kDType, kFamily) \
  if (dtype == DType::kDType && family == kFamily) return &sm80::run_decode<DType::kDType, kFamily>;
  FLASHKIT_SM80_DECODE_INSTANCES
#undef FLASHKIT_SM80_DECODE_INSTANCE
  return nullptr;
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
SplitShape split_shape(const KvcacheProblem& problem, const DeviceLimits& limits) {
  // The longest sequence: exact for one scalar length, else bounded by the capacity (the lengths
  // are on the device).
  const int64_t max_keys = problem.cache_seqlens == nullptr
                               ? static_cast<int64_t>(problem.cache_seqlen) + problem.seqlen_new
                               : problem.cache_capacity;
  SplitShape shape;
  shape.ctas = decode_ctas(problem);
  shape.key_blocks = (max_keys + sm80::kDecodeBlockN - 1) / sm80::kDecodeBlockN;
  shape.sm_count = limits.sm_count;
  shape.max_splits = kMaxKvcacheSplits;
  const int family = sm80::decode_head_dim_family(problem.head_dim);
  shape.ctas_per_sm = decode_ctas_per_sm(
      shape, sm80::decode_smem_bytes(family, false, problem.is_paged()) + limits.reserved_smem_per_block,
      limits.smem_per_sm);
  return shape;
}

}  // namespace

bool decode_kernel_built(DType dtype, int head_dim) {
  return find_sm80_decode(dtype, sm80::decode_head_dim_family(head_dim)) != nullptr;
}

void require_decode_kernel(const char* fn, DType dtype, int head_dim) {
  if (decode_kernel_built(dtype, head_dim)) return;
  const int family = sm80::decode_head_dim_family(head_dim);
  bool family_built = false;
  bool dtype_built = false;
  for (DType other : {DType::kBFloat16, DType::kFloat16}) {
    family_built |= find_sm80_decode(other, family) != nullptr;
  }
  for (int other : sm80::kDecodeHeadDimFamilies) {
    dtype_built |= find_sm80_decode(dtype, other) != nullptr;
  }
  throw_kernel_not_built(fn, "decode", dtype, head_dim, family, family_built, dtype_built);
}

int decode_device_arch(int device) { return device_limits(device).arch; }

int decode_device_sm_count(int device) { return device_limits(device).sm_count; }

// The whole-SM pipeline for a contiguous cache when the split model counts one CTA per SM, the
// launch puts at most one CTA on an SM, and the device lets one CTA take that much shared memory
// (sm_90: 227 KiB; not sm_80's 163 KiB or sm_86/89's 99 KiB); PDL from sm_90 on. A paged cache
// keeps the shared-SM pipeline even at one CTA per SM: its deeper ring read 256-token pages slower
// (H200, batch 1, 16 splits: 1.59 / 3.13 / 4.05 TB/s at 8k / 32k / 128k against 1.88 / 3.33 / 4.24
// in session 12). Session 19 traced that to the unrolled prologue's cold instruction-cache lines
// (its deeper ring unrolled more blocks); with the prologue rolled the whole-SM pipeline reads
// paged caches no faster (batch 1: 1.78 / 3.26 / 4.07 TB/s against 1.85 / 3.25 / 4.11).
DecodePlan plan_decode(const KvcacheProblem& problem, int device, int requested_splits) {
  const DeviceLimits limits = device_limits(device);
  const SplitShape shape = split_shape(problem, limits);
  DecodePlan plan;
  plan.num_splits = requested_splits > 0 ? requested_splits : choose_num_splits(shape);
  plan.workspace_bytes = sm80::decode_workspace_layout(problem, plan.num_splits).total_bytes;
  const int family = sm80::decode_head_dim_family(problem.head_dim);
  plan.whole_sm = !problem.is_paged() && shape.ctas_per_sm == 1 &&
                  one_cta_per_sm(decode_ctas(problem), plan.num_splits, limits.sm_count) &&
                  sm80::decode_smem_bytes(family, true, false) <= limits.max_smem_per_block;
  plan.programmatic = limits.arch >= 90;
  return plan;
}

void check_decode_workspace_alignment(const char* fn, const void* workspace) {
  if (reinterpret_cast<uintptr_t>(workspace) % 256 == 0) return;
  char address[32];
  std::snprintf(address, sizeof address, "%p", workspace);
  throw Error(std::string(fn) + ": workspace (" + address +
              ") is not 256-byte aligned; pass memory from cudaMalloc or an aligned pool");
}

void launch_decode(const KvcacheProblem& problem, const DecodePlan& plan, void* stream) {
  const RunDecode run =
      find_sm80_decode(problem.dtype, sm80::decode_head_dim_family(problem.head_dim));
  sm80::DecodeLaunchPlan launch;
  launch.whole_sm = plan.whole_sm;
  launch.programmatic = plan.programmatic;
  run(problem, launch, stream);
}

void launch_decode_combine(const KvcacheProblem& problem, void* stream) {
  sm80::DecodeLaunchPlan launch;
  launch.combine_only = true;
  find_sm80_decode(problem.dtype, sm80::decode_head_dim_family(problem.head_dim))(problem, launch, stream);
}

}  // namespace flashkit::api

#endif  // FLASHKIT_WITH_CUDA
