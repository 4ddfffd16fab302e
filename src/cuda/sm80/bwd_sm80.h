// src/cuda/sm80/bwd_sm80.h
// \brief What the sm80 (mma.sync) backward kernels offer the dispatcher; includable from plain C++.
//
// The dispatcher (src/api/mha_bwd.cpp) asks for the workspace size, checks the caller's workspace
// against it, then calls run_bwd of the problem's (dtype, head-dim family). The compiled instances
// are listed by FLASHKIT_SM80_BWD_INSTANCES in the generated build_config.h, as for the forward.
#pragma once

#include <cstddef>

#include "common/bwd_problem.h"

namespace flashkit::sm80 {

// Bytes of workspace run_bwd needs for `problem` (fp32 dq accumulator, dot(dout, out) rows, the
// per-query-head dk/dv of GQA/MQA before the group sum; the layout is the kernels' own). A plain
// host function: the dispatcher calls it before any CUDA call.
size_t bwd_workspace_bytes(const BwdProblem& problem);

// Enqueues the backward pass of `problem` (device pointers, validated, workspace of at least
// bwd_workspace_bytes(problem) bytes) on the cudaStream_t `stream`. Instantiated once per
// (dtype, family) in a generated .cu file; see src/CMakeLists.txt.
template <DType kDType, int kHeadDimFamily>
void run_bwd(const BwdProblem& problem, void* stream);

}  // namespace flashkit::sm80
