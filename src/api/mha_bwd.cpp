// src/api/mha_bwd.cpp
// \brief The backward entry points and their workspace size queries: validate, then run on the
// backend that owns the data. This is the one place that chooses a CUDA backward kernel.
//
// CPU views run the reference backward (src/cpu/reference_bwd.h), which needs no workspace. CUDA
// views run, on compute capability 9.0, the sm90 (wgmma) backward of the problem's (dtype, head-dim
// family) when this build compiled it (FLASHKIT_SM90_BWD_INSTANCES) and it covers the problem
// (sm90::bwd_unsupported_reason), and otherwise the sm80 (mma.sync) backward, provided this build
// compiled it (FLASHKIT_SM80_BWD_INSTANCES in the generated build_config.h). Both use the same
// workspace (sm80::bwd_workspace_bytes), checked first. FLASHKIT_BWD_PATH=sm80|sm90 forces a path
// (tests, bug hunts); forcing sm90 where it cannot run is an error, not a fallback. Everything that
// can be rejected without the GPU is rejected before the first CUDA runtime call.
//
// Dropout (dropout.p > 0) and deterministic mode run on either backward: both regenerate the
// forward's Philox mask, and both add dQ in key-block order behind the workspace's semaphores.
//
// A problem without query rows or without keys still runs: its gradients are zeros (dk / dv of
// keys no query sees, dq of rows that see no key), and the backend writes them.
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>

#include "api/dispatch_support.h"
#include "api/tensor_checks.h"
#include "api/validate_bwd.h"
#include "build_config.h"
#include "cpu/reference_bwd.h"
#include "flashkit/api.h"
#include "flashkit/error.h"

#ifdef FLASHKIT_WITH_CUDA
#include "cuda/cuda_check.h"
#include "cuda/sm80/bwd_sm80.h"
#include "cuda/sm80/fwd_sm80.h"
#include "cuda/sm90/bwd_sm90.h"
#include "cuda/sm90/bwd_tile_config_sm90.h"
#endif

namespace flashkit {
namespace {

using api::build_dtype_name;
using api::debug_enabled;

#ifdef FLASHKIT_WITH_CUDA

using RunBwd = void (*)(const BwdProblem&, void*);

// The backward instances are generated over the same FLASHKIT_HEAD_DIMS families as the forward
// (src/CMakeLists.txt), so a head dim maps to its family exactly as for the forward.
int bwd_head_dim_family(int head_dim) { return sm80::fwd_head_dim_family(head_dim); }

// The backward kernel compiled for (dtype, family), or nullptr when this build left it out (the
// arguments go unused in a build that lists no backward instance at all).
RunBwd find_sm80_bwd([[maybe_unused]] DType dtype, [[maybe_unused]] int family) {
#define FLASHKIT_SM80_BWD_INSTANCE(kDType, kFamily) \
  if (dtype == DType::kDType && family == kFamily) return &sm80::run_bwd<DType::kDType, kFamily>;
  FLASHKIT_SM80_BWD_INSTANCES
#undef FLASHKIT_SM80_BWD_INSTANCE
  return nullptr;
}

// The kernel of `problem`, or an error naming the flags of a build that has it.
RunBwd sm80_bwd_or_throw(const char* fn, const FwdProblem& problem) {
  const int family = bwd_head_dim_family(problem.head_dim);
  if (const RunBwd run = find_sm80_bwd(problem.dtype, family)) return run;
  bool family_built = false;
  bool dtype_built = false;
  for (DType dtype : {DType::kBFloat16, DType::kFloat16}) {
    family_built |= find_sm80_bwd(dtype, family) != nullptr;
  }
  for (int other : sm80::kFwdHeadDimFamilies) {
    dtype_built |= find_sm80_bwd(problem.dtype, other) != nullptr;
  }
  api::throw_kernel_not_built(fn, "backward", problem.dtype, problem.head_dim, family,
                              family_built, dtype_built);
}

// The sm90 backward compiled for (dtype, family), or nullptr when this build left it out (a build
// without sm_90a code has an empty list, hence the maybe-unused parameters).
RunBwd find_sm90_bwd([[maybe_unused]] DType dtype, [[maybe_unused]] int family) {
#define FLASHKIT_SM90_BWD_INSTANCE(kDType, kFamily) \
  if (dtype == DType::kDType && family == kFamily) return &sm90::run_bwd<DType::kDType, kFamily>;
  FLASHKIT_SM90_BWD_INSTANCES
#undef FLASHKIT_SM90_BWD_INSTANCE
  return nullptr;
}

enum class BwdPath { kAuto, kSm80, kSm90 };

// FLASHKIT_BWD_PATH: unset, empty or "auto" for the automatic choice, "sm80" or "sm90" to force
// one. Read on every call, so a test can switch it between calls.
BwdPath requested_bwd_path(const char* fn) {
  const char* value = std::getenv("FLASHKIT_BWD_PATH");
  if (value == nullptr || value[0] == '\0' || std::strcmp(value, "auto") == 0) return BwdPath::kAuto;
  if (std::strcmp(value, "sm80") == 0) return BwdPath::kSm80;
  if (std::strcmp(value, "sm90") == 0) return BwdPath::kSm90;
  throw Error(std::string(fn) + ": FLASHKIT_BWD_PATH is '" + value +
              "'; it must be sm80, sm90, auto or unset (automatic: sm90 on compute capability 9.0 "
              "where it covers the problem, else sm80)");
}

// Why the sm90 backward cannot run `problem` in this build, or "" when it can (the device aside).
std::string sm90_unavailable_reason(const BwdProblem& problem) {
  const FwdProblem& p = problem.fwd;
  const int family = bwd_head_dim_family(p.head_dim);
  if (const std::string why = sm90::bwd_unsupported_reason(problem); !why.empty()) return why;
  if (find_sm90_bwd(p.dtype, family) == nullptr) {
    return std::string("this build has no sm90 backward kernel for ") + build_dtype_name(p.dtype) +
           " head dim " + std::to_string(p.head_dim) + " (family " + std::to_string(family) +
           "; the sm90 backward families 64, 128 and 256 are built when CMAKE_CUDA_ARCHITECTURES "
           "includes 90 and FLASHKIT_SM90=ON; built head dims " FLASHKIT_BUILT_HEAD_DIMS ", dtypes "
           FLASHKIT_BUILT_DTYPES ")";
  }
  return "";
}

// The path's preconditions that need no GPU: a forced sm90 path must cover the problem, any other
// request needs the sm80 kernel (the fallback). Returns the sm80 kernel, or nullptr when sm90 is
// forced.
RunBwd check_bwd_path(const char* fn, BwdPath requested, const BwdProblem& problem,
                      const std::string& sm90_unavailable) {
  if (requested != BwdPath::kSm90) return sm80_bwd_or_throw(fn, problem.fwd);
  if (!sm90_unavailable.empty()) {
    api::fail(fn, "FLASHKIT_BWD_PATH=sm90 but the sm90 backward cannot run this problem: ",
              sm90_unavailable, "; unset FLASHKIT_BWD_PATH to let flashkit choose");
  }
  return nullptr;
}

void run_on_cuda(const char* fn, const char* size_query, const BwdProblem& problem, int device,
                 void* stream) {
  const FwdProblem& p = problem.fwd;
  const BwdPath requested = requested_bwd_path(fn);
  const std::string sm90_unavailable = sm90_unavailable_reason(problem);
  const RunBwd run_sm80 = check_bwd_path(fn, requested, problem, sm90_unavailable);
  const size_t required = sm80::bwd_workspace_bytes(problem);
  api::check_bwd_workspace(fn, size_query, problem, required);

  const api::CurrentDeviceGuard device_guard(device);
  api::check_sm80_or_newer(fn, device);
  const int arch = cuda::current_device_arch();
  if (requested == BwdPath::kSm90 && arch != 90) {
    api::fail(fn, "FLASHKIT_BWD_PATH=sm90 but cuda:", device, " has compute capability ", arch / 10,
              ".", arch % 10, "; the sm90 kernels run on 9.0 (Hopper) only");
  }
  const bool use_sm90 = requested == BwdPath::kSm90 ||
                        (requested == BwdPath::kAuto && arch == 90 && sm90_unavailable.empty());
  const int family = bwd_head_dim_family(p.head_dim);
  if (debug_enabled()) {
    std::string path;
    if (use_sm90) {
      const sm90::BwdTileConfig tile = sm90::bwd_tile_config(family);
      path = "sm90 backward (wgmma), tile " + std::to_string(tile.block_m) + " queries x " +
             std::to_string(tile.block_n) + " keys, 2 warpgroups" +
             (tile.split_head_dim ? " sharing the keys, head dim split" : "") + ", scores in " +
             std::to_string(tile.query_parts) + " part(s)";
    } else {
      const std::string why_not_sm90 = requested == BwdPath::kSm80 ? "forced by FLASHKIT_BWD_PATH=sm80"
                                       : arch != 90                ? "compute capability is not 9.0"
                                                                   : sm90_unavailable;
      path = "sm80 backward (not sm90: " + why_not_sm90 + ")";
    }
    const std::string dropout = p.dropout_p > 0.0f ? ", dropout p = " + std::to_string(p.dropout_p) : "";
    std::fprintf(stderr,
                 "flashkit: %s: cuda:%d %s, %s head dim %d (family %d), %s%s, workspace %zu bytes, "
                 "batch %d heads %d/%d seqlen %d/%d%s\n",
                 fn, device, path.c_str(), build_dtype_name(p.dtype), p.head_dim, family,
                 problem.deterministic ? "deterministic" : "not deterministic", dropout.c_str(), required,
                 p.batch, p.heads_q, p.heads_kv, p.seqlen_q, p.seqlen_k, p.is_varlen() ? " (varlen maxima)" : "");
  }
  if (use_sm90) {
    find_sm90_bwd(p.dtype, family)(problem, stream);
  } else {
    run_sm80(problem, stream);
  }
}

#else

[[noreturn]] void no_cuda_build(const char* fn, const Device& device) {
  throw Error(std::string(fn) + ": the tensors are on cuda:" + std::to_string(device.index) +
              " but this build of flashkit has no CUDA kernels (configured without nvcc); "
              "rebuild with the CUDA toolkit and -DFLASHKIT_CUDA=ON, or pass CPU tensors");
}

#endif  // FLASHKIT_WITH_CUDA

void run_on_backend(const char* fn, const char* size_query, const BwdProblem& problem,
                    const Device& device, void* stream) {
  if (device.kind == DeviceKind::kCpu) {
    api::check_bwd_workspace(fn, size_query, problem, 0);
    if (debug_enabled()) std::fprintf(stderr, "flashkit: %s: cpu reference backend\n", fn);
    cpu::reference_bwd(problem);
    return;
  }
#ifdef FLASHKIT_WITH_CUDA
  run_on_cuda(fn, size_query, problem, device.index, stream);
#else
  (void)stream;
  no_cuda_build(fn, device);
#endif
}

size_t workspace_bytes(const char* fn, const BwdProblem& problem, const Device& device) {
  if (device.kind == DeviceKind::kCpu) return 0;
#ifdef FLASHKIT_WITH_CUDA
  // Both paths use the sm80 backward's workspace layout.
  check_bwd_path(fn, requested_bwd_path(fn), problem, sm90_unavailable_reason(problem));
  return sm80::bwd_workspace_bytes(problem);
#else
  (void)problem;
  no_cuda_build(fn, device);
#endif
}

}  // namespace

void mha_bwd(const MhaBwdParams& params, void* stream) {
  const BwdProblem problem = api::validate_mha_bwd(params, "mha_bwd");
  run_on_backend("mha_bwd", "mha_bwd_workspace_size", problem, params.q.device, stream);
}

void mha_varlen_bwd(const MhaVarlenBwdParams& params, void* stream) {
  const BwdProblem problem = api::validate_mha_varlen_bwd(params, "mha_varlen_bwd");
  run_on_backend("mha_varlen_bwd", "mha_varlen_bwd_workspace_size", problem, params.q.device,
                 stream);
}

size_t mha_bwd_workspace_size(const MhaBwdParams& params) {
  const char* fn = "mha_bwd_workspace_size";
  return workspace_bytes(fn, api::validate_mha_bwd(params, fn), params.q.device);
}

size_t mha_varlen_bwd_workspace_size(const MhaVarlenBwdParams& params) {
  const char* fn = "mha_varlen_bwd_workspace_size";
  return workspace_bytes(fn, api::validate_mha_varlen_bwd(params, fn), params.q.device);
}

bool cuda_bwd_built(DType dtype, int head_dim) {
  if (head_dim <= 0 || head_dim % 8 != 0 || head_dim > 256) return false;
#ifdef FLASHKIT_WITH_CUDA
  return find_sm80_bwd(dtype, bwd_head_dim_family(head_dim)) != nullptr;
#else
  (void)dtype;
  return false;
#endif
}

}  // namespace flashkit
