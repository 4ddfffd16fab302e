// src/api/decode_dispatch.h
// \brief Running a validated KvcacheProblem on the CUDA decode kernels: the kernel lookup, the key
// split count, the workspace size and the pipeline choice. Shared by mha_fwd_kvcache and by
// mha_fwd's short-query path (fwd_decode_route.h), so that both plan a decode the same way.
#pragma once

#include <cstddef>

#include "build_config.h"
#include "common/kvcache_problem.h"
#include "flashkit/tensor.h"

#ifdef FLASHKIT_WITH_CUDA

namespace flashkit::api {

// Whether this build compiled the decode kernel for `dtype` at `head_dim` (its family).
bool decode_kernel_built(DType dtype, int head_dim);

// Throws the rebuild hint (naming `fn`) when decode_kernel_built is false.
void require_decode_kernel(const char* fn, DType dtype, int head_dim);

// How one call runs on `device`: the split count, the workspace it needs, the pipeline.
struct DecodePlan {
  int num_splits = 1;
  size_t workspace_bytes = 0;  // 0 without a split
  bool whole_sm = false;       // the whole-SM pipeline (decode_sm80.h)
  bool programmatic = false;   // programmatic dependent launch (sm_90 and newer)
};

// The plan for `problem` on `device`: `requested_splits` when > 0, else the split heuristic
// (split_heuristic.h) on the device's SM count. Checks nothing about the workspace.
DecodePlan plan_decode(const KvcacheProblem& problem, int device, int requested_splits);

// The device's compute capability as 10 * major + minor, and its SM count, queried once per device.
int decode_device_arch(int device);
int decode_device_sm_count(int device);

// Throws (naming `fn`) unless `workspace` is 256-byte aligned, as the split partials need.
void check_decode_workspace_alignment(const char* fn, const void* workspace);

// Enqueues `problem` on `stream` (`device` current): problem.num_splits and problem.workspace
// must be `plan`'s.
void launch_decode(const KvcacheProblem& problem, const DecodePlan& plan, void* stream);

// Enqueues the combine pass alone on `stream`: the partials of problem.num_splits (> 1) splits are
// in problem.workspace, written by another kernel (the sm90 forward's split keys) in the decode
// workspace's layout.
void launch_decode_combine(const KvcacheProblem& problem, void* stream);

}  // namespace flashkit::api

#endif  // FLASHKIT_WITH_CUDA
