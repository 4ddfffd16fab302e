// src/api/mha_bwd.cpp
// \brief The backward entry points and their workspace size queries: validate, then run on the
// backend that owns the data. This is the one place that chooses a CUDA backward kernel.
//
// CPU views run the reference backward (src/cpu/reference_bwd.h), which needs no workspace. CUDA
// views run the sm80 (mma.sync) backward of the problem's (dtype, head-dim family), provided this
// build compiled it (FLASHKIT_SM80_BWD_INSTANCES in the generated build_config.h), with the
// caller's workspace checked against sm80::bwd_workspace_bytes first. Everything that can be
// rejected without the GPU is rejected before the first CUDA runtime call.
//
// Dropout (dropout.p > 0) runs on the sm80 backward, which regenerates the forward's Philox mask.
//
// A problem without query rows or without keys still runs: its gradients are zeros (dk / dv of
// keys no query sees, dq of rows that see no key), and the backend writes them.
#include <cstdio>
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

void run_on_cuda(const char* fn, const char* size_query, const BwdProblem& problem, int device,
                 void* stream) {
  const RunBwd run = sm80_bwd_or_throw(fn, problem.fwd);
  const size_t required = sm80::bwd_workspace_bytes(problem);
  api::check_bwd_workspace(fn, size_query, problem, required);
  if (debug_enabled()) {
    const FwdProblem& p = problem.fwd;
    std::fprintf(stderr,
                 "flashkit: %s: cuda:%d sm80 backward, %s head dim %d (family %d), %s, "
                 "workspace %zu bytes, batch %d heads %d/%d seqlen %d/%d%s\n",
                 fn, device, build_dtype_name(p.dtype), p.head_dim, bwd_head_dim_family(p.head_dim),
                 problem.deterministic ? "deterministic" : "not deterministic", required, p.batch,
                 p.heads_q, p.heads_kv, p.seqlen_q, p.seqlen_k,
                 p.is_varlen() ? " (varlen maxima)" : "");
  }
  const api::CurrentDeviceGuard device_guard(device);
  api::check_sm80_or_newer(fn, device);
  run(problem, stream);
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
  sm80_bwd_or_throw(fn, problem.fwd);
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
