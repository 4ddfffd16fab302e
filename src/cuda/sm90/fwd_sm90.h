// src/cuda/sm90/fwd_sm90.h
// \brief What the sm90 (wgmma + TMA, sm_90a) forward kernels offer the dispatcher; includable from
// plain C++.
#pragma once

#include <string>

#include "common/fwd_problem.h"

namespace flashkit::sm90 {

// The head-dim families the sm90 forward is compiled for. A head dim runs in the smallest family
// that holds it: the copy engine zero-fills the columns past head_dim (the tensor map's inner extent
// is head_dim, its box the family's 64-column atoms), so they add nothing to Q K^T, and the epilogue
// writes only the first head_dim columns. Padding costs family / head_dim in matrix work.
constexpr int kFwdHeadDimFamilies[] = {64, 128, 256};

constexpr int fwd_head_dim_family(int head_dim) {
  for (int family : kFwdHeadDimFamilies) {
    if (head_dim <= family) return family;
  }
  return -1;
}

// Why the sm90 kernels cannot run `problem` (layout or options they do not cover), or "" when they
// can. Whether the (dtype, family) instance was compiled is the dispatcher's question, not this.
std::string fwd_unsupported_reason(const FwdProblem& problem);

// Enqueues the forward pass of `problem` (device pointers, validated, covered) on the cudaStream_t
// `stream`. Instantiated once per (dtype, family) in a generated .cu file; see src/CMakeLists.txt.
template <DType kDType, int kHeadDimFamily>
void run_fwd(const FwdProblem& problem, void* stream);

}  // namespace flashkit::sm90
