// src/cuda/sm90/bwd_sm90.h
// \brief What the sm90 (wgmma, sm_90a) backward kernels offer the dispatcher; includable from plain
// C++. They use the sm80 backward's workspace layout (sm80::bwd_workspace_bytes) and row kernels.
#pragma once

#include <string>

#include "common/bwd_problem.h"

namespace flashkit::sm90 {

// The head-dim families the sm90 backward is compiled for; a head dim runs in the sm80 backward's
// family (sm80::fwd_head_dim_family), so the sm90 path covers the head dims whose sm80 family is
// one of these.
constexpr int kBwdHeadDimFamilies[] = {64, 128, 256};

// Why the sm90 backward cannot run `problem` (a head dim it does not cover, or a q or dout layout its
// copy engine cannot read: tma_layout.h), or "" when it can.
// Whether the (dtype, family) instance was compiled is the dispatcher's question, not this.
std::string bwd_unsupported_reason(const BwdProblem& problem);

// Enqueues the backward pass of `problem` (device pointers, validated, covered, workspace of at
// least sm80::bwd_workspace_bytes(problem) bytes) on the cudaStream_t `stream`. Instantiated once
// per (dtype, family) in a generated .cu file; see src/CMakeLists.txt.
template <DType kDType, int kHeadDimFamily>
void run_bwd(const BwdProblem& problem, void* stream);

}  // namespace flashkit::sm90
