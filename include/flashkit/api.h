// flashkit/api.h
// \brief The entry points. Each validates its arguments (throwing flashkit::Error), then runs on the
// backend that owns the data: views on a CUDA device run the GPU kernels on `stream`, views on the
// CPU run the fp64-accumulating reference. Nothing is allocated behind the caller's back.
#pragma once

#include "flashkit/params.h"

namespace flashkit {

// `stream` is a cudaStream_t (nullptr: the legacy default stream); ignored for CPU views.
// Both calls return once the work is enqueued (GPU) or done (CPU).
void mha_fwd(const MhaFwdParams& params, void* stream = nullptr);
void mha_varlen_fwd(const MhaVarlenFwdParams& params, void* stream = nullptr);

// The gradients of mha_fwd / mha_varlen_fwd: dq, dk and dv from dout and what the forward saved.
// params.workspace must hold at least the size query's bytes (see BwdCommon::workspace).
void mha_bwd(const MhaBwdParams& params, void* stream = nullptr);
void mha_varlen_bwd(const MhaVarlenBwdParams& params, void* stream = nullptr);
// Bytes of workspace a call with these params needs (validates the params the size depends on).
size_t mha_bwd_workspace_size(const MhaBwdParams& params);
size_t mha_varlen_bwd_workspace_size(const MhaVarlenBwdParams& params);

// The head dims the CUDA kernels of this build were compiled for are rounded up to one of these
// families; a head dim whose family was left out of the build is rejected with an error that says
// how to rebuild. Returns true when `head_dim` (a multiple of 8, at most 256) is served on CUDA.
bool cuda_head_dim_built(int head_dim);

// Whether this build serves `dtype` (kFloat16 or kBFloat16) at `head_dim` on CUDA: a build may leave
// out a dtype as well as head-dim families (FLASHKIT_DTYPES), and a call for a left-out pair throws.
bool cuda_fwd_built(DType dtype, int head_dim);

// Whether this build serves the backward pass (mha_bwd / mha_varlen_bwd) of `dtype` at `head_dim`
// on CUDA; a call for a left-out pair throws with the flags of a build that has it.
bool cuda_bwd_built(DType dtype, int head_dim);

}  // namespace flashkit
