// src/api/mha_fwd.cpp
// \brief The forward entry points: validate, then run on the backend that owns the data. This is
// the one place that chooses a CUDA kernel.
//
// CPU views run the reference (src/cpu/). CUDA views run, for a few query tokens per sequence
// (decoding through mha_fwd / mha_varlen_fwd), the decode kernel that mha_fwd_kvcache runs
// (fwd_decode_route.h says which problems and why); otherwise, on compute capability 9.0, the sm90
// (wgmma + TMA) kernel of the problem's (dtype, head-dim family) when this build compiled it and it
// covers the problem (sm90::fwd_unsupported_reason; with a kv head's query heads packed into its
// tiles where that pays, sm90::fwd_pack_gqa_group), and otherwise the sm80 (mma.sync) kernel,
// provided this build compiled it; the generated build_config.h lists which ones it did. The
// environment variable FLASHKIT_FWD_PATH=sm80|sm90|decode forces a path (for tests and for chasing
// a bug); forcing one where it cannot run is an error, not a fallback. Everything that can be
// rejected without the GPU is rejected before the first CUDA runtime call, so bad input never
// touches the device.
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>

#include "api/dispatch_support.h"
#include "api/fwd_decode_route.h"
#include "api/sm90_fwd_dispatch.h"
#include "api/validate_fwd.h"
#include "build_config.h"
#include "cpu/reference_fwd.h"
#include "flashkit/api.h"
#include "flashkit/error.h"

#ifdef FLASHKIT_WITH_CUDA
#include <cuda_runtime.h>

#include "api/decode_dispatch.h"
#include "cuda/cuda_check.h"
#include "cuda/sm80/decode_sm80.h"
#include "cuda/sm80/fwd_sm80.h"
#include "cuda/sm80/fwd_tile_config.h"
#include "cuda/sm90/fwd_sm90.h"
#include "cuda/sm90/fwd_tile_config_sm90.h"
#endif

namespace flashkit {
namespace {

using api::build_dtype_name;
using api::debug_enabled;

#ifdef FLASHKIT_WITH_CUDA

using api::plan_sm90;
using api::sm90_unavailable_reason;
using api::sm90_workspace_layout;

using RunFwd = void (*)(const FwdProblem&, void*);

// The kernel compiled for (dtype, family), or nullptr when this build left it out. The list of
// compiled instances comes from the build (src/CMakeLists.txt writes it into build_config.h).
RunFwd find_sm80_fwd(DType dtype, int family) {
#define FLASHKIT_SM80_FWD_INSTANCE(kDType, kFamily) \
  if (dtype == DType::kDType && family == kFamily) return &sm80::run_fwd<DType::kDType, kFamily>;
  FLASHKIT_SM80_FWD_INSTANCES
#undef FLASHKIT_SM80_FWD_INSTANCE
  return nullptr;
}

enum class FwdPath { kAuto, kSm80, kSm90, kDecode };

// FLASHKIT_FWD_PATH: unset or empty for the automatic choice, "sm80", "sm90" or "decode" to force
// one. Read on every call, so a test can switch it between calls.
FwdPath requested_fwd_path(const char* fn) {
  const char* value = std::getenv("FLASHKIT_FWD_PATH");
  if (value == nullptr || value[0] == '\0') return FwdPath::kAuto;
  if (std::strcmp(value, "sm80") == 0) return FwdPath::kSm80;
  if (std::strcmp(value, "sm90") == 0) return FwdPath::kSm90;
  if (std::strcmp(value, "decode") == 0) return FwdPath::kDecode;
  throw Error(std::string(fn) + ": FLASHKIT_FWD_PATH is '" + value +
              "'; it must be sm80, sm90, decode or unset (automatic: the decode kernel for a few query "
              "tokens (up to " + std::to_string(api::kFwdDecodeMaxSeqlenQFewTiles) +
              ", src/api/fwd_decode_route.h), else sm90 on compute capability 9.0 where it covers the "
              "problem, else sm80)");
}

// Why the decode kernel cannot run `problem` in this build, or "" when it can (the device aside).
std::string decode_unavailable_reason(const FwdProblem& problem) {
  if (!api::decode_kernel_built(problem.dtype, problem.head_dim)) {
    return std::string("this build has no decode kernel for ") + build_dtype_name(problem.dtype) +
           " head dim " + std::to_string(problem.head_dim) + " (built head dims " +
           FLASHKIT_BUILT_HEAD_DIMS + ", dtypes " + FLASHKIT_BUILT_DTYPES + ")";
  }
  return api::fwd_decode_unsupported_reason(problem);
}

bool family_built_for_some_dtype(int family) {
  return find_sm80_fwd(DType::kBFloat16, family) != nullptr ||
         find_sm80_fwd(DType::kFloat16, family) != nullptr;
}

bool dtype_built_for_some_family(DType dtype) {
  for (int family : sm80::kFwdHeadDimFamilies) {
    if (find_sm80_fwd(dtype, family) != nullptr) return true;
  }
  return false;
}

// Throws unless the path `requested` can run `problem` in this build (the device aside): a forced
// path that does not cover it, or a kernel the build left out.
void check_requested_path(const char* fn, const FwdProblem& problem, FwdPath requested) {
  if (requested == FwdPath::kSm90) {
    const std::string why_not = sm90_unavailable_reason(problem);
    if (!why_not.empty()) {
      throw Error(std::string(fn) + ": FLASHKIT_FWD_PATH=sm90 but the sm90 forward cannot run "
                  "this problem: " + why_not + "; unset FLASHKIT_FWD_PATH to let flashkit choose");
    }
  }
  if (requested == FwdPath::kDecode) {
    const std::string why_not = decode_unavailable_reason(problem);
    if (!why_not.empty()) {
      throw Error(std::string(fn) + ": FLASHKIT_FWD_PATH=decode but the decode kernel cannot run "
                  "this problem: " + why_not + "; unset FLASHKIT_FWD_PATH to let flashkit choose");
    }
  }
  const int family = sm80::fwd_head_dim_family(problem.head_dim);
  if ((requested == FwdPath::kAuto || requested == FwdPath::kSm80) &&
      find_sm80_fwd(problem.dtype, family) == nullptr) {
    api::throw_kernel_not_built(fn, "forward", problem.dtype, problem.head_dim, family,
                                family_built_for_some_dtype(family),
                                dtype_built_for_some_family(problem.dtype));
  }
}

// The kernel that runs a problem, and the sm90 forward's plan when it is that one.
struct CudaChoice {
  FwdPath path = FwdPath::kSm80;
  sm90::FwdPlan sm90_plan;
};

// Which kernel runs `problem` on cuda:`device` (current; check_requested_path passed): the forced
// one, once the device is known to run it, or the automatic choice, which weighs the sm90 forward
// as it would run with or without a workspace (`has_workspace`: split keys or not). Launches
// nothing.
CudaChoice choose_cuda_path(const char* fn, const FwdProblem& problem, FwdPath requested, int device,
                            bool has_workspace) {
  api::check_sm80_or_newer(fn, device);
  const int arch = cuda::current_device_arch();
  if (requested == FwdPath::kSm90 && arch != 90) {
    throw Error(std::string(fn) + ": FLASHKIT_FWD_PATH=sm90 but cuda:" + std::to_string(device) +
                " has compute capability " + std::to_string(arch / 10) + "." +
                std::to_string(arch % 10) + "; the sm90 kernels run on 9.0 (Hopper) only");
  }
  if (requested == FwdPath::kSm90) return {FwdPath::kSm90, plan_sm90(problem, device, has_workspace)};
  if (requested != FwdPath::kAuto) return {requested, {}};
  const bool sm90 = arch == 90 && sm90_unavailable_reason(problem).empty();
  // fwd_prefers_decode includes the problem checks; only the build's kernel is left to ask for.
  sm90::FwdPlan forward;  // the sm80 forward's: one head per tile, no split
  if (sm90) forward = plan_sm90(problem, device, has_workspace);
  if (api::fwd_prefers_decode(problem, api::decode_device_sm_count(device), forward.pack_group,
                              forward.num_splits > 1) &&
      api::decode_kernel_built(problem.dtype, problem.head_dim)) {
    return {FwdPath::kDecode, {}};
  }
  return {sm90 ? FwdPath::kSm90 : FwdPath::kSm80, forward};
}

// The decode kernel's plan for `decode` (the problem's decode view): the heuristic's key split when
// the caller passed a workspace, else one split (no workspace needed).
api::DecodePlan plan_fwd_decode(const KvcacheProblem& decode, int device, bool has_workspace) {
  return api::plan_decode(decode, device, has_workspace ? 0 : 1);
}

void run_on_decode(const char* fn, const FwdProblem& problem, const FwdCommon& params, int device,
                   void* stream) {
  KvcacheProblem decode = api::decode_view_of_fwd(problem);
  const api::DecodePlan plan = plan_fwd_decode(decode, device, params.workspace != nullptr);
  if (plan.workspace_bytes > 0) {
    if (params.workspace_bytes < plan.workspace_bytes) {
      throw Error(std::string(fn) + ": workspace_bytes is " + std::to_string(params.workspace_bytes) +
                  " but this call needs " + std::to_string(plan.workspace_bytes) + " (" + fn +
                  "_workspace_size); pass that much, or a null workspace to run without a key "
                  "split");
    }
    api::check_decode_workspace_alignment(fn, params.workspace);
  }
  decode.num_splits = plan.num_splits;
  decode.workspace = params.workspace;
  decode.workspace_bytes = params.workspace_bytes;
  if (debug_enabled()) {
    std::fprintf(stderr,
                 "flashkit: %s: cuda:%d decode kernel (short queries), %s head dim %d "
                 "(family %d), batch %d heads %d/%d seqlen %d/%d, %d split(s)%s, %s pipeline\n",
                 fn, device, build_dtype_name(problem.dtype),
                 problem.head_dim, sm80::decode_head_dim_family(problem.head_dim), problem.batch,
                 problem.heads_q, problem.heads_kv, problem.seqlen_q, problem.seqlen_k,
                 plan.num_splits, params.workspace == nullptr ? " (no workspace given)" : "",
                 plan.whole_sm ? "whole-SM" : "shared-SM");
  }
  api::launch_decode(decode, plan, stream);
}

void run_on_cuda(const char* fn, const FwdProblem& problem, const FwdCommon& params, int device,
                 void* stream) {
  const FwdPath requested = requested_fwd_path(fn);
  check_requested_path(fn, problem, requested);
  if (!api::has_query_rows(problem)) return;
  const api::CurrentDeviceGuard device_guard(device);
  const CudaChoice choice = choose_cuda_path(fn, problem, requested, device, params.workspace != nullptr);
  const FwdPath path = choice.path;
  if (path == FwdPath::kDecode) {
    run_on_decode(fn, problem, params, device, stream);
    return;
  }
  const bool use_sm90 = path == FwdPath::kSm90;
  const int family = sm80::fwd_head_dim_family(problem.head_dim);
  if (debug_enabled()) {
    if (use_sm90) {
      const int family90 = sm90::fwd_head_dim_family(problem.head_dim);
      const sm90::FwdTileConfig tile = sm90::fwd_tile_config(family90, problem.dropout_p > 0.0f);
      std::fprintf(stderr,
                   "flashkit: %s: cuda:%d sm90 forward (wgmma + TMA), %s head dim %d (family %d), "
                   "tile %dx%d, %d stages, %d consumer warpgroups, batch %d heads %d/%d seqlen "
                   "%d/%d%s%s\n",
                   fn, device, build_dtype_name(problem.dtype), problem.head_dim, family90, tile.block_m,
                   tile.block_n, tile.stages, tile.block_m / 64, problem.batch, problem.heads_q,
                   problem.heads_kv, problem.seqlen_q, problem.seqlen_k,
                   problem.is_varlen() ? " (varlen maxima)" : "",
                   sm90::fwd_takes_sliding_window_instance(family90, problem.window_left, problem.dropout_p)
                       ? ", the sliding-window instance (skips blocks left of the window per consumer)"
                       : "");
    } else {
      const sm80::FwdTileConfig tile = sm80::fwd_tile_config(family);
      const std::string why_not_sm90 =
          requested == FwdPath::kSm80         ? "forced by FLASHKIT_FWD_PATH=sm80"
          : cuda::current_device_arch() != 90 ? "compute capability is not 9.0"
                                              : sm90_unavailable_reason(problem);
      std::fprintf(stderr,
                   "flashkit: %s: cuda:%d sm80 forward, %s head dim %d (family %d), tile %dx%d, "
                   "%d warps, Q in %s, batch %d heads %d/%d seqlen %d/%d%s (not sm90: %s)\n",
                   fn, device, build_dtype_name(problem.dtype), problem.head_dim, family,
                   tile.block_m, tile.block_n, tile.warps,
                   tile.q_in_registers ? "registers" : "shared memory", problem.batch,
                   problem.heads_q, problem.heads_kv, problem.seqlen_q, problem.seqlen_k,
                   problem.is_varlen() ? " (varlen maxima)" : "", why_not_sm90.c_str());
    }
  }
  if (use_sm90) {
    api::run_on_sm90(fn, problem, params.workspace, params.workspace_bytes, choice.sm90_plan, stream);
  } else {
    find_sm80_fwd(problem.dtype, family)(problem, stream);
  }
}

// The workspace bytes the CUDA call of `problem` uses: the key split of the decode kernel or of the
// sm90 forward, where it runs there with a workspace; 0 on the sm80 path.
size_t cuda_workspace_bytes(const char* fn, const FwdProblem& problem, int device) {
  const FwdPath requested = requested_fwd_path(fn);
  check_requested_path(fn, problem, requested);
  if (!api::has_query_rows(problem)) return 0;
  const api::CurrentDeviceGuard device_guard(device);
  const CudaChoice choice = choose_cuda_path(fn, problem, requested, device, true);
  switch (choice.path) {
    case FwdPath::kDecode: return plan_fwd_decode(api::decode_view_of_fwd(problem), device, true).workspace_bytes;
    case FwdPath::kSm90: return sm90_workspace_layout(problem, choice.sm90_plan).total_bytes;
    default: return 0;
  }
}

#endif  // FLASHKIT_WITH_CUDA

void run_on_backend(const char* fn, const FwdProblem& problem, const FwdCommon& params,
                    void* stream) {
  const Device& device = params.q.device;
  if (device.kind == DeviceKind::kCpu) {
    if (debug_enabled()) std::fprintf(stderr, "flashkit: %s: cpu reference backend\n", fn);
    cpu::reference_fwd(problem);
    return;
  }
#ifdef FLASHKIT_WITH_CUDA
  run_on_cuda(fn, problem, params, device.index, stream);
#else
  (void)stream;
  throw Error(std::string(fn) + ": the tensors are on cuda:" + std::to_string(device.index) +
              " but this build of flashkit has no CUDA kernels (configured without nvcc); "
              "rebuild with the CUDA toolkit and -DFLASHKIT_CUDA=ON, or pass CPU tensors");
#endif
}

// The size query's answer for a validated problem of the entry point `fn` (its errors, as the
// validation's, name the call the size is for): 0 on the CPU backend (and in a build without
// CUDA, whose call then fails naming the missing kernels).
size_t workspace_bytes([[maybe_unused]] const char* fn, [[maybe_unused]] const FwdProblem& problem,
                       const Device& device) {
  if (device.kind == DeviceKind::kCpu) return 0;
#ifdef FLASHKIT_WITH_CUDA
  return cuda_workspace_bytes(fn, problem, device.index);
#else
  return 0;
#endif
}

}  // namespace

void mha_fwd(const MhaFwdParams& params, void* stream) {
  const FwdProblem problem = api::validate_mha_fwd(params);
  run_on_backend("mha_fwd", problem, params, stream);
}

size_t mha_fwd_workspace_size(const MhaFwdParams& params) {
  return workspace_bytes("mha_fwd", api::validate_mha_fwd(params), params.q.device);
}

void mha_varlen_fwd(const MhaVarlenFwdParams& params, void* stream) {
  const FwdProblem problem = api::validate_mha_varlen_fwd(params);
  run_on_backend("mha_varlen_fwd", problem, params, stream);
}

size_t mha_varlen_fwd_workspace_size(const MhaVarlenFwdParams& params) {
  return workspace_bytes("mha_varlen_fwd", api::validate_mha_varlen_fwd(params),
                         params.q.device);
}

bool cuda_head_dim_built(int head_dim) {
  return cuda_fwd_built(DType::kBFloat16, head_dim) || cuda_fwd_built(DType::kFloat16, head_dim);
}

bool cuda_fwd_built(DType dtype, int head_dim) {
  if (head_dim <= 0 || head_dim % 8 != 0 || head_dim > 256) return false;
#ifdef FLASHKIT_WITH_CUDA
  return find_sm80_fwd(dtype, sm80::fwd_head_dim_family(head_dim)) != nullptr;
#else
  (void)dtype;
  return false;
#endif
}

}  // namespace flashkit
