// src/cuda/sm80/fwd_sm80.h
// \brief What the sm80 (mma.sync) forward kernels offer the dispatcher; includable from plain C++.
#pragma once

#include "common/fwd_problem.h"

namespace flashkit::sm80 {

// The head-dim families the forward kernel is compiled for. A problem's head dim is rounded up to
// the smallest family that holds it; the columns past head_dim are zero-filled in shared memory and
// never written back.
constexpr int kFwdHeadDimFamilies[] = {32, 64, 96, 128, 192, 256};

constexpr int fwd_head_dim_family(int head_dim) {
  for (int family : kFwdHeadDimFamilies) {
    if (head_dim <= family) return family;
  }
  return -1;
}

// Enqueues the forward pass of `problem` (device pointers, validated) on the cudaStream_t `stream`.
// Instantiated once per (dtype, family) in a generated .cu file; see src/CMakeLists.txt.
template <DType kDType, int kHeadDimFamily>
void run_fwd(const FwdProblem& problem, void* stream);

}  // namespace flashkit::sm80
