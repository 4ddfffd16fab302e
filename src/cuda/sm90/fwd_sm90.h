// src/cuda/sm90/fwd_sm90.h
// \brief What the sm90 (wgmma + TMA, sm_90a) forward kernels offer the dispatcher; includable from
// plain C++.
#pragma once

#include <string>

#include "common/fwd_problem.h"

namespace flashkit::sm90 {

// The head-dim families the sm90 forward is compiled for. Unlike the sm80 path, a head dim is
// served only at its exact family (no zero padding inside the TMA box yet); the others run on sm80.
constexpr int kFwdHeadDimFamilies[] = {64, 128, 256};

// Why the sm90 kernels cannot run `problem` (layout or options they do not cover), or "" when they
// can. Whether the (dtype, family) instance was compiled is the dispatcher's question, not this.
std::string fwd_unsupported_reason(const FwdProblem& problem);

// Enqueues the forward pass of `problem` (device pointers, validated, covered) on the cudaStream_t
// `stream`. Instantiated once per (dtype, family) in a generated .cu file; see src/CMakeLists.txt.
template <DType kDType, int kHeadDimFamily>
void run_fwd(const FwdProblem& problem, void* stream);

}  // namespace flashkit::sm90
