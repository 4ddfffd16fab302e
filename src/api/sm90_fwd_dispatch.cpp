// src/api/sm90_fwd_dispatch.cpp
// \brief See sm90_fwd_dispatch.h.
#include "api/sm90_fwd_dispatch.h"

#ifdef FLASHKIT_WITH_CUDA

#include <cstdio>

#include "api/decode_dispatch.h"
#include "api/dispatch_support.h"
#include "api/fwd_decode_route.h"
#include "flashkit/error.h"

namespace flashkit::api {

// (A build without sm_90a code has an empty list, hence the maybe-unused parameters.)
RunSm90Fwd find_sm90_fwd([[maybe_unused]] DType dtype, [[maybe_unused]] int family) {
#define FLASHKIT_SM90_FWD_INSTANCE(kDType, kFamily) \
  if (dtype == DType::kDType && family == kFamily) return &sm90::run_fwd<DType::kDType, kFamily>;
  FLASHKIT_SM90_FWD_INSTANCES
#undef FLASHKIT_SM90_FWD_INSTANCE
  return nullptr;
}

std::string sm90_unavailable_reason(const FwdProblem& problem) {
  const int family = sm90::fwd_head_dim_family(problem.head_dim);
  if (find_sm90_fwd(problem.dtype, family) == nullptr) {
    return std::string("this build has no sm90 forward kernel for ") +
           build_dtype_name(problem.dtype) + " head dim " + std::to_string(problem.head_dim) +
           " (sm90 family " + std::to_string(family) +
           "; the sm90 families 64, 128 and 256 are built when CMAKE_CUDA_ARCHITECTURES includes "
           "90 and FLASHKIT_SM90=ON; built head dims " + FLASHKIT_BUILT_HEAD_DIMS + ", dtypes " +
           FLASHKIT_BUILT_DTYPES + ")";
  }
  return sm90::fwd_unsupported_reason(problem);
}

static_assert(sm90::kFwdMaxSplits <= sm80::kDecodeMaxSplits, "the combine pass merges the splits");

sm90::FwdPlan plan_sm90(const FwdProblem& problem, int device, bool has_workspace) {
  const bool can_split = has_workspace && decode_kernel_built(problem.dtype, problem.head_dim);
  return sm90::plan_fwd(problem, decode_device_sm_count(device), can_split, sm90::pack_gqa_from_env(),
                        sm90::forced_splits_from_env());
}

sm80::DecodeWorkspaceLayout sm90_workspace_layout(const FwdProblem& problem, const sm90::FwdPlan& plan) {
  return sm80::decode_workspace_layout(decode_view_of_fwd(problem), plan.num_splits);
}

void run_on_sm90(const char* fn, const FwdProblem& problem, void* workspace, size_t workspace_bytes,
                 sm90::FwdPlan plan, void* stream) {
  if (plan.num_splits > 1) {
    const sm80::DecodeWorkspaceLayout layout = sm90_workspace_layout(problem, plan);
    if (workspace_bytes < layout.total_bytes) {
      throw Error(std::string(fn) + ": workspace_bytes is " + std::to_string(workspace_bytes) +
                  " but this call needs " + std::to_string(layout.total_bytes) + " (" + fn +
                  "_workspace_size); pass that much, or a null workspace to run without a key split");
    }
    check_decode_workspace_alignment(fn, workspace);
    char* bytes = static_cast<char*>(workspace);
    plan.split_lse = reinterpret_cast<float*>(bytes);
    plan.split_out = reinterpret_cast<float*>(bytes + layout.out_offset);
  }
  if (debug_enabled()) {
    std::fprintf(stderr, "flashkit: %s: sm90 forward plan: %d query head(s) per kv head packed into a tile, keys "
                 "split %d way(s)%s\n", fn, plan.pack_group, plan.num_splits,
                 plan.num_splits > 1 ? ", then the decode kernel's combine pass" : "");
  }
  find_sm90_fwd(problem.dtype, sm90::fwd_head_dim_family(problem.head_dim))(problem, plan, stream);
  if (plan.num_splits > 1) {
    KvcacheProblem combine = decode_view_of_fwd(problem);
    combine.num_splits = plan.num_splits;
    combine.workspace = workspace;
    combine.workspace_bytes = workspace_bytes;
    launch_decode_combine(combine, stream);
  }
}

}  // namespace flashkit::api

#endif  // FLASHKIT_WITH_CUDA
