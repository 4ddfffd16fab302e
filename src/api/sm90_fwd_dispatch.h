// src/api/sm90_fwd_dispatch.h
// \brief Running a FwdProblem on the sm90 (wgmma + TMA) forward: the kernel this build compiled,
// why it cannot run a problem, its plan (packed query heads, key split) and the launch with the
// combine pass a split needs. Shared by mha_fwd / mha_varlen_fwd (mha_fwd.cpp, which chooses among
// the forward paths) and by mha_fwd_kvcache's long queries (kvcache_fwd_route.h).
#pragma once

#include <cstddef>
#include <string>

#include "build_config.h"
#include "common/fwd_problem.h"

#ifdef FLASHKIT_WITH_CUDA

#include "cuda/sm80/decode_sm80.h"
#include "cuda/sm90/fwd_sm90.h"

namespace flashkit::api {

using RunSm90Fwd = void (*)(const FwdProblem&, const sm90::FwdPlan&, void*);

// The sm90 kernel for (dtype, family), or nullptr when this build left it out.
RunSm90Fwd find_sm90_fwd(DType dtype, int family);

// Why the sm90 kernel cannot run `problem` in this build, or "" when it can (the device aside).
std::string sm90_unavailable_reason(const FwdProblem& problem);

// The sm90 forward's plan for `problem` (which it covers) on cuda:`device` (sm90::plan_fwd): it
// splits the keys only with a workspace (`has_workspace`; the size query plans with one) and the
// decode kernel's combine pass in this build.
sm90::FwdPlan plan_sm90(const FwdProblem& problem, int device, bool has_workspace);

// Where a plan's split partials go in the workspace: the decode workspace's layout (total 0
// unsplit), which the combine pass reads.
sm80::DecodeWorkspaceLayout sm90_workspace_layout(const FwdProblem& problem, const sm90::FwdPlan& plan);

// Runs `problem` on the sm90 forward as `plan` (plan_sm90's for the caller's workspace) says, then
// the combine pass when the keys split; `fn` names the entry point in errors and FLASHKIT_DEBUG.
void run_on_sm90(const char* fn, const FwdProblem& problem, void* workspace, size_t workspace_bytes,
                 sm90::FwdPlan plan, void* stream);

}  // namespace flashkit::api

#endif  // FLASHKIT_WITH_CUDA
