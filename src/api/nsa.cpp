// src/api/nsa.cpp
// \brief The native-sparse-attention entry points (nsa_fwd, nsa_bwd and the backward's workspace
// query): validate, then run on the backend that owns the data. The one place that chooses an NSA
// kernel.
//
// CPU views run the reference (src/cpu/reference_nsa.h). CUDA views run the kernels of
// src/cuda/nsa/ for the problem's (dtype, head-dim family) if this build compiled them
// (FLASHKIT_NSA_INSTANCES in the generated build_config.h). Everything that can be rejected
// without the GPU is rejected before the first CUDA runtime call.
#include <cstdint>
#include <cstdio>
#include <string>

#include "api/dispatch_support.h"
#include "api/tensor_checks.h"
#include "api/validate_nsa.h"
#include "build_config.h"
#include "cpu/reference_nsa.h"
#include "flashkit/api.h"
#include "flashkit/error.h"

#ifdef FLASHKIT_WITH_CUDA
#include "cuda/cuda_check.h"
#include "cuda/nsa/nsa_cuda.h"
#endif

namespace flashkit {
namespace {

using api::build_dtype_name;
using api::debug_enabled;

#ifdef FLASHKIT_WITH_CUDA

struct NsaKernels {
  void (*fwd)(const NsaProblem&, void*) = nullptr;
  void (*bwd)(const NsaBwdProblem&, void*) = nullptr;
};

NsaKernels find_nsa([[maybe_unused]] DType dtype, [[maybe_unused]] int family) {
#define FLASHKIT_NSA_INSTANCE(kDType, kFamily)                       \
  if (dtype == DType::kDType && family == kFamily) {                 \
    return {&nsa::run_nsa_fwd<DType::kDType, kFamily>, &nsa::run_nsa_bwd<DType::kDType, kFamily>}; \
  }
  FLASHKIT_NSA_INSTANCES
#undef FLASHKIT_NSA_INSTANCE
  return {};
}

// The kernels of `problem`, or an error naming the flags of a build that has them.
NsaKernels require_nsa(const char* fn, const NsaProblem& problem) {
  const int family = nsa::nsa_head_dim_family(problem.head_dim);
  const NsaKernels kernels = find_nsa(problem.dtype, family);
  if (kernels.fwd != nullptr) return kernels;
  bool family_built = false;
  bool dtype_built = false;
  for (DType dtype : {DType::kBFloat16, DType::kFloat16}) {
    family_built |= find_nsa(dtype, family).fwd != nullptr;
  }
  for (int other : nsa::kNsaHeadDimFamilies) {
    dtype_built |= find_nsa(problem.dtype, other).fwd != nullptr;
  }
  api::throw_kernel_not_built(fn, "native sparse attention", problem.dtype, problem.head_dim, family,
                              family_built, dtype_built);
}

void print_debug(const char* fn, int device, const NsaProblem& p) {
  if (!debug_enabled()) return;
  std::fprintf(stderr,
               "flashkit: %s: cuda:%d nsa, %s head dim %d (family %d), batch %d seqlen %d/%d heads "
               "%d/%d, block %d x %d slots%s\n",
               fn, device, build_dtype_name(p.dtype), p.head_dim, nsa::nsa_head_dim_family(p.head_dim),
               p.batch, p.seqlen_q, p.seqlen_k, p.heads_q, p.heads_kv, p.block_size, p.selected,
               p.causal ? ", causal" : "");
}

#else

[[noreturn]] void fail_no_cuda(const char* fn, const Device& device) {
  throw Error(std::string(fn) + ": the tensors are on cuda:" + std::to_string(device.index) +
              " but this build of flashkit has no CUDA kernels (configured without nvcc); "
              "rebuild with the CUDA toolkit and -DFLASHKIT_CUDA=ON, or pass CPU tensors");
}

#endif  // FLASHKIT_WITH_CUDA

}  // namespace

void nsa_fwd(const NsaFwdParams& params, void* stream) {
  constexpr const char* kFn = "nsa_fwd";
  const NsaProblem problem = api::validate_nsa_fwd(params);
  if (params.q.device.kind == DeviceKind::kCpu) {
    if (debug_enabled()) std::fprintf(stderr, "flashkit: %s: cpu reference backend\n", kFn);
    cpu::reference_nsa_fwd(problem);
    return;
  }
#ifdef FLASHKIT_WITH_CUDA
  const NsaKernels kernels = require_nsa(kFn, problem);
  const int device = params.q.device.index;
  const api::CurrentDeviceGuard device_guard(device);
  api::check_sm80_or_newer(kFn, device);
  print_debug(kFn, device, problem);
  kernels.fwd(problem, stream);
#else
  (void)stream;
  fail_no_cuda(kFn, params.q.device);
#endif
}

size_t nsa_bwd_workspace_size(const NsaBwdParams& params) {
  const NsaBwdProblem problem = api::validate_nsa_bwd(params);
  if (params.q.device.kind == DeviceKind::kCpu) return 0;
#ifdef FLASHKIT_WITH_CUDA
  return nsa::nsa_bwd_workspace_layout(problem.fwd).total_bytes;
#else
  (void)problem;
  fail_no_cuda("nsa_bwd_workspace_size", params.q.device);
#endif
}

void nsa_bwd(const NsaBwdParams& params, void* stream) {
  constexpr const char* kFn = "nsa_bwd";
  const NsaBwdProblem problem = api::validate_nsa_bwd(params);
  if (params.q.device.kind == DeviceKind::kCpu) {
    if (debug_enabled()) std::fprintf(stderr, "flashkit: %s: cpu reference backend\n", kFn);
    cpu::reference_nsa_bwd(problem);
    return;
  }
#ifdef FLASHKIT_WITH_CUDA
  const NsaKernels kernels = require_nsa(kFn, problem.fwd);
  const size_t needed = nsa::nsa_bwd_workspace_layout(problem.fwd).total_bytes;
  if (problem.workspace_bytes < needed || (needed > 0 && problem.workspace == nullptr)) {
    api::fail(kFn, "workspace holds ", problem.workspace_bytes, " bytes but this call needs ", needed,
              " (nsa_bwd_workspace_size)");
  }
  if (reinterpret_cast<uintptr_t>(problem.workspace) % 256 != 0) {
    api::fail(kFn, "workspace is not 256-byte aligned; pass memory from cudaMalloc or an aligned pool");
  }
  const int device = params.q.device.index;
  const api::CurrentDeviceGuard device_guard(device);
  api::check_sm80_or_newer(kFn, device);
  print_debug(kFn, device, problem.fwd);
  kernels.bwd(problem, stream);
#else
  (void)stream;
  fail_no_cuda(kFn, params.q.device);
#endif
}

bool cuda_nsa_built(DType dtype, int head_dim) {
  if (head_dim <= 0 || head_dim % 8 != 0 || head_dim > 256) return false;
#ifdef FLASHKIT_WITH_CUDA
  return find_nsa(dtype, nsa::nsa_head_dim_family(head_dim)).fwd != nullptr;
#else
  (void)dtype;
  return false;
#endif
}

}  // namespace flashkit
