"""The torch.ops.flashkit operators: loading them, and their fake implementations.

The operators themselves are C++ (python/csrc/ops.cpp) and are registered when ``flashkit._C`` is
imported. The fake (meta) implementations below give torch.compile, FakeTensor and
torch.library.opcheck the output shapes without running anything: every output is contiguous, as
the C++ operators allocate it.

    fwd(q, k, v, ...)                 -> out [b, s_q, h_q, d], softmax_lse fp32 [b, h_q, s_q],
                                         rng_state, S_dmask (below)
    varlen_fwd(q, k, v, cu_q, cu_k, ...) -> out [total_q, h_q, d],
                                         softmax_lse fp32 [batch, h_q, max_seqlen_q] (entries
                                         past a sequence's length unwritten), rng_state, S_dmask
    bwd(dout, q, k, v, out, lse, ...) -> dq, dk, dv shaped like q, k, v
    varlen_bwd(...)                   -> dq, dk, dv shaped like q, k, v
    fwd_kvcache(q, k_cache, v_cache, k, v, ...) -> out [b, s_q, h_q, d],
                                         softmax_lse fp32 [b, h_q, s_q]; writes k and v into
                                         k_cache and v_cache in place (schema: Tensor(a!))
    nsa_fwd(q, k, v, block_indices, block_counts, ...) -> out [b, s_q, h_q, d],
                                         softmax_lse fp32 [b, h_q, s_q] (native sparse
                                         attention's selection branch; python/flashkit/nsa.py)
    nsa_bwd(dout, q, k, v, block_indices, ...) -> dq, dk, dv shaped like q, k, v

With dropout_p > 0 the forwards draw a Philox key from torch's generator and return it as rng_state,
int64 [2] on q's device, which the backwards take back; with return_softmax they also return
S_dmask [b, h_q, round128(s_q), round128(s_k)] in q's dtype (probabilities, dropped ones negated).
Without dropout both are empty.
"""

from __future__ import annotations

import torch

from flashkit import _C  # noqa: F401  (registers the operators)

fwd = torch.ops.flashkit.fwd.default
varlen_fwd = torch.ops.flashkit.varlen_fwd.default
bwd = torch.ops.flashkit.bwd.default
varlen_bwd = torch.ops.flashkit.varlen_bwd.default
fwd_kvcache = torch.ops.flashkit.fwd_kvcache.default
nsa_fwd = torch.ops.flashkit.nsa_fwd.default
nsa_bwd = torch.ops.flashkit.nsa_bwd.default


def _round_up_128(n):
    # flashkit::attn_probs_length (include/flashkit/api.h): S_dmask's rounded lengths.
    return (n + 127) // 128 * 128


def _dropout_outputs_fake(q, dropout_p, return_softmax, batch, max_seqlen_q, max_seqlen_k):
    if dropout_p <= 0:
        return q.new_empty((0,), dtype=torch.int64), q.new_empty((0,))
    rng_state = q.new_empty((2,), dtype=torch.int64)
    if not return_softmax:
        return rng_state, q.new_empty((0,))
    return rng_state, q.new_empty((batch, q.shape[-2], _round_up_128(max_seqlen_q),
                                   _round_up_128(max_seqlen_k)))


@torch.library.register_fake("flashkit::fwd")
def _fwd_fake(q, k, v, alibi_slopes, dropout_p, softmax_scale, causal, window_left, window_right,
              softcap, return_softmax, generator):
    batch, seqlen_q, heads_q, _ = q.shape
    out = q.new_empty(q.shape)
    softmax_lse = q.new_empty((batch, heads_q, seqlen_q), dtype=torch.float32)
    return (out, softmax_lse) + _dropout_outputs_fake(q, dropout_p, return_softmax, batch,
                                                      seqlen_q, k.shape[1])


@torch.library.register_fake("flashkit::varlen_fwd")
def _varlen_fwd_fake(q, k, v, cu_seqlens_q, cu_seqlens_k, seqused_k, max_seqlen_q, max_seqlen_k,
                     alibi_slopes, dropout_p, softmax_scale, causal, window_left, window_right,
                     softcap, return_softmax, generator):
    batch = cu_seqlens_q.shape[0] - 1
    out = q.new_empty(q.shape)
    softmax_lse = q.new_empty((batch, q.shape[1], max_seqlen_q), dtype=torch.float32)
    return (out, softmax_lse) + _dropout_outputs_fake(q, dropout_p, return_softmax, batch,
                                                      max_seqlen_q, max_seqlen_k)


@torch.library.register_fake("flashkit::bwd")
def _bwd_fake(dout, q, k, v, out, softmax_lse, alibi_slopes, dropout_p, rng_state, softmax_scale,
              causal, window_left, window_right, softcap, deterministic):
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)


@torch.library.register_fake("flashkit::varlen_bwd")
def _varlen_bwd_fake(dout, q, k, v, out, softmax_lse, cu_seqlens_q, cu_seqlens_k, seqused_k,
                     max_seqlen_q, max_seqlen_k, alibi_slopes, dropout_p, rng_state, softmax_scale,
                     causal, window_left, window_right, softcap, deterministic):
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)


@torch.library.register_fake("flashkit::fwd_kvcache")
def _fwd_kvcache_fake(q, k_cache, v_cache, k, v, rotary_cos, rotary_sin, cache_seqlens,
                      cache_seqlen, cache_batch_idx, cache_leftpad, block_table, alibi_slopes,
                      softmax_scale, causal, window_left, window_right, softcap,
                      rotary_interleaved, num_splits):
    # The in-place append into k_cache / v_cache is declared by the schema; nothing to fake.
    batch, seqlen_q, heads_q, _ = q.shape
    out = q.new_empty(q.shape)
    softmax_lse = q.new_empty((batch, heads_q, seqlen_q), dtype=torch.float32)
    return out, softmax_lse


@torch.library.register_fake("flashkit::nsa_fwd")
def _nsa_fwd_fake(q, k, v, block_indices, block_counts, block_size, softmax_scale, causal):
    batch, seqlen_q, heads_q, _ = q.shape
    out = q.new_empty(q.shape)
    softmax_lse = q.new_empty((batch, heads_q, seqlen_q), dtype=torch.float32)
    return out, softmax_lse


@torch.library.register_fake("flashkit::nsa_bwd")
def _nsa_bwd_fake(dout, q, k, v, block_indices, block_counts, block_size, out, softmax_lse,
                  softmax_scale, causal):
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)


_DTYPE_NAMES = {torch.float16: "float16", torch.bfloat16: "bfloat16"}


def cuda_fwd_built(dtype: torch.dtype, head_dim: int) -> bool:
    """Whether this build has the CUDA forward kernel for ``dtype`` at ``head_dim`` (a multiple of
    8; the Python functions pad other head dims up to one). Builds may leave out head-dim families
    and dtypes (FLASHKIT_HEAD_DIMS, FLASHKIT_DTYPES); a call for a left-out one raises."""
    return dtype in _DTYPE_NAMES and _C.cuda_fwd_built(_DTYPE_NAMES[dtype], head_dim)


def cuda_bwd_built(dtype: torch.dtype, head_dim: int) -> bool:
    """As cuda_fwd_built, for the backward kernels."""
    return dtype in _DTYPE_NAMES and _C.cuda_bwd_built(_DTYPE_NAMES[dtype], head_dim)


def cuda_kvcache_built(dtype: torch.dtype, head_dim: int) -> bool:
    """As cuda_fwd_built, for the decode (KV-cache) kernels of flash_attn_with_kvcache."""
    return dtype in _DTYPE_NAMES and _C.cuda_kvcache_built(_DTYPE_NAMES[dtype], head_dim)


def cuda_nsa_built(dtype: torch.dtype, head_dim: int) -> bool:
    """As cuda_fwd_built, for the native-sparse-attention kernels (forward and backward) of
    flashkit.nsa_selection_attn_func."""
    return dtype in _DTYPE_NAMES and _C.cuda_nsa_built(_DTYPE_NAMES[dtype], head_dim)
