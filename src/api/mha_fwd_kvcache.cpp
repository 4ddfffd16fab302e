// src/api/mha_fwd_kvcache.cpp
// \brief The mha_fwd_kvcache entry points: validate, choose the split count, check the workspace,
// then run on the backend that owns the data. The one place that chooses a decode kernel.
//
// CPU views run the reference (src/cpu/reference_kvcache). CUDA views run the sm80 decode kernels
// of the problem's (dtype, head-dim family) if this build compiled them (build_config.h lists
// them), planned by decode_dispatch.h; except, on compute capability 9.0, calls with many query
// tokens that are forward problems (kvcache_fwd_route.h), which run on the sm90 forward. The
// environment variable FLASHKIT_KVCACHE_PATH=decode|sm90 forces one of the two (tests, bugs).
// Everything that can be rejected without the GPU is rejected before the first CUDA call.
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <optional>
#include <string>
#include <vector>

#include "api/decode_dispatch.h"
#include "api/dispatch_support.h"
#include "api/kvcache_fwd_route.h"
#include "api/validate_kvcache.h"
#include "build_config.h"
#include "cpu/reference_kvcache.h"
#include "flashkit/api.h"
#include "flashkit/error.h"

#ifdef FLASHKIT_WITH_CUDA
#include <cuda_runtime.h>

#include "api/sm90_fwd_dispatch.h"
#include "cuda/cuda_check.h"
#include "cuda/sm80/decode_sm80.h"
#include "cuda/sm90/fwd_tile_config_sm90.h"
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

enum class KvcachePath { kAuto, kDecode, kSm90 };

// FLASHKIT_KVCACHE_PATH: unset or empty for the automatic choice, "decode" or "sm90" to force one.
// Read on every call, so a test can switch it between calls.
KvcachePath requested_kvcache_path() {
  const char* value = std::getenv("FLASHKIT_KVCACHE_PATH");
  if (value == nullptr || value[0] == '\0') return KvcachePath::kAuto;
  if (std::strcmp(value, "decode") == 0) return KvcachePath::kDecode;
  if (std::strcmp(value, "sm90") == 0) return KvcachePath::kSm90;
  throw Error(std::string(kFn) + ": FLASHKIT_KVCACHE_PATH is '" + value +
              "'; it must be decode, sm90 or unset (automatic: the sm90 forward for many query tokens "
              "where the call is a forward problem, src/api/kvcache_fwd_route.h, else the decode kernel)");
}

// A call as the sm90 forward runs it: the forward view of the problem and the forward's plan.
struct Sm90Route {
  FwdProblem forward;
  sm90::FwdPlan plan;
};

// The sm90 forward's run when `problem` goes there on cuda:`device`, else nothing: forced by
// FLASHKIT_KVCACHE_PATH=sm90 (an error where it cannot run), or chosen automatically where the
// call is a forward problem (no append, a contiguous cache without batch index or left pad), the
// caller left the split to flashkit (num_splits 0, or 1: the forward then runs unsplit too) and
// kvcache_prefers_fwd says so. The forward never splits here, so it needs no workspace.
std::optional<Sm90Route> sm90_route(const KvcacheProblem& problem, int requested_splits, int device) {
  const KvcachePath requested = requested_kvcache_path();
  if (requested == KvcachePath::kDecode) return std::nullopt;
  const bool forced = requested == KvcachePath::kSm90;
  std::string why_not = api::kvcache_fwd_unsupported_reason(problem);
  FwdProblem forward;
  if (why_not.empty()) {
    forward = api::fwd_view_of_kvcache(problem);
    why_not = api::sm90_unavailable_reason(forward);
  }
  const int arch = api::decode_device_arch(device);
  if (why_not.empty() && arch != 90) why_not = "the sm90 forward runs on compute capability 9.0 only";
  if (forced && !why_not.empty()) {
    throw Error(std::string(kFn) + ": FLASHKIT_KVCACHE_PATH=sm90 but the sm90 forward cannot run this call: " +
                why_not + "; unset FLASHKIT_KVCACHE_PATH to let flashkit choose");
  }
  if (!why_not.empty() || (!forced && requested_splits > 1)) return std::nullopt;
  const sm90::FwdPlan plan = api::plan_sm90(forward, device, /*has_workspace=*/false);
  if (!forced && !api::kvcache_prefers_fwd(problem, api::decode_device_sm_count(device), plan.pack_group)) {
    return std::nullopt;
  }
  return Sm90Route{forward, plan};
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
  if (const std::optional<Sm90Route> route = sm90_route(problem, params.num_splits, device)) {
    const api::CurrentDeviceGuard device_guard(device);
    if (contents_check_enabled()) check_contents_on_device(problem, stream);
    if (debug_enabled()) {
      const int family = sm90::fwd_head_dim_family(problem.head_dim);
      const sm90::FwdTileConfig tile = sm90::fwd_tile_config(family);
      std::fprintf(stderr,
                   "flashkit: %s: cuda:%d sm90 forward (many query tokens on a contiguous cache), %s head "
                   "dim %d (family %d), tile %dx%d, batch %d heads %d/%d seqlen_q %d, cache capacity %d\n",
                   kFn, device, build_dtype_name(problem.dtype), problem.head_dim, family, tile.block_m,
                   tile.block_n, problem.batch, problem.heads_q, problem.heads_kv, problem.seqlen_q,
                   problem.cache_capacity);
    }
    if (problem.seqlen_q > 0) api::run_on_sm90(kFn, route->forward, nullptr, 0, route->plan, stream);
    return;
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
  if (sm90_route(problem, params.num_splits, params.q.device.index)) return plan;  // unsplit, no workspace
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
