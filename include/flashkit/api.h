// flashkit/api.h
// \brief The entry points. Each validates its arguments (throwing flashkit::Error), then runs on the
// backend that owns the data: views on a CUDA device run the GPU kernels on `stream`, views on the
// CPU run the fp64-accumulating reference. Nothing is allocated behind the caller's back.
#pragma once

#include "flashkit/kvcache_params.h"
#include "flashkit/nsa_params.h"
#include "flashkit/params.h"

namespace flashkit {

// `stream` is a cudaStream_t (nullptr: the legacy default stream); ignored for CPU views.
// Both calls return once the work is enqueued (GPU) or done (CPU).
void mha_fwd(const MhaFwdParams& params, void* stream = nullptr);
void mha_varlen_fwd(const MhaVarlenFwdParams& params, void* stream = nullptr);
// Bytes of the optional workspace (FwdCommon::workspace) that mha_fwd (mha_varlen_fwd) with these
// params uses: 0 unless it runs on the decode kernel with a key split (validates the params; on
// CUDA it queries the SM count of q's device once).
size_t mha_fwd_workspace_size(const MhaFwdParams& params);
size_t mha_varlen_fwd_workspace_size(const MhaVarlenFwdParams& params);

// The length that seqlen_q and seqlen_k each take in the forward's optional attn_probs output
// ([batch, heads_q, attn_probs_length(seqlen_q), attn_probs_length(seqlen_k)]; varlen: of the
// max_seqlen_*): rounded up to a multiple of 128, as FlashAttention sizes S_dmask; 0 below 0.
int64_t attn_probs_length(int64_t seqlen);

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

// Decoding against a KV cache (see kvcache_params.h): optional in-place append with rotary, then
// attention, split over the keys when that fills the GPU better. params.workspace must hold at
// least mha_fwd_kvcache_workspace_size(params) bytes.
void mha_fwd_kvcache(const MhaFwdKvcacheParams& params, void* stream = nullptr);
// Bytes of workspace the call needs (0 without a split; validates the params). For num_splits 0
// on CUDA it queries the SM count of q's device.
size_t mha_fwd_kvcache_workspace_size(const MhaFwdKvcacheParams& params);
// The number of key splits the call will use (1 on the CPU backend).
int mha_fwd_kvcache_num_splits(const MhaFwdKvcacheParams& params);
// Whether this build has the CUDA decode kernel for `dtype` at `head_dim` (rounded up to 64, 128
// or 256).
bool cuda_kvcache_built(DType dtype, int head_dim);
// Whether this build serves the backward pass (mha_bwd / mha_varlen_bwd) of `dtype` at `head_dim`
// on CUDA; a call for a left-out pair throws with the flags of a build that has it.
bool cuda_bwd_built(DType dtype, int head_dim);

// Native sparse attention's selection branch (see nsa_params.h): each query token attends to the
// key blocks it selected. nsa_bwd's params.workspace must hold nsa_bwd_workspace_size(params) bytes.
void nsa_fwd(const NsaFwdParams& params, void* stream = nullptr);
void nsa_bwd(const NsaBwdParams& params, void* stream = nullptr);
size_t nsa_bwd_workspace_size(const NsaBwdParams& params);
// Whether this build has the CUDA native-sparse-attention kernels for `dtype` at `head_dim`
// (rounded up to 64, 128 or 256).
bool cuda_nsa_built(DType dtype, int head_dim);

}  // namespace flashkit
