"""The flash_attn 2.x functions on flashkit: same names, argument order, defaults and results.

Layouts (the last dim contiguous; other strides free):

    fixed length:  q [batch, seqlen_q, heads_q, head_dim], k and v [batch, seqlen_k, heads_kv, head_dim]
    varlen:        q [total_q, heads_q, head_dim], k and v [total_k, heads_kv, head_dim], sequence b
                   being rows cu_seqlens_q[b]:cu_seqlens_q[b + 1] (int32 prefix sums from 0)
    KV cache:      q as fixed length; k_cache and v_cache [batch_cache, seqlen_cache, heads_kv,
                   head_dim] or paged [num_blocks, page_block_size, heads_kv, head_dim] with a
                   block_table (flash_attn_with_kvcache states the append and rotary semantics)

Semantics:

- heads_q must be a multiple of heads_kv (MHA, GQA, MQA); query head h reads KV head
  h // (heads_q // heads_kv).
- dtype float16 or bfloat16 on CUDA (sm_80 or newer) or on the CPU, where flashkit's fp64 reference
  backend runs with the same semantics.
- Head dims up to 256. One that is not a multiple of 8 is zero-padded to the next multiple for the
  kernel and the result sliced back, as flash_attn does; softmax_scale defaults to
  1 / sqrt(the unpadded head dim).
- Masks are bottom-right aligned: query row i (of seqlen_q) may see key j (of seqlen_k) iff
  i + seqlen_k - seqlen_q - window_size[0] <= j <= i + seqlen_k - seqlen_q + window_size[1], a
  negative side being unbounded; causal=True sets window_size[1] = 0.
- A query row that sees no key (causal with seqlen_q > seqlen_k, an empty sequence) gets a zero
  output row and a log-sum-exp of -inf, never NaN.
- softcap > 0: score = softcap * tanh(score / softcap). alibi_slopes: fp32 [heads_q] or
  [batch, heads_q]; adds -slope * |i + seqlen_k - seqlen_q - j| to each score.
- dropout_p in [0, 1): each probability is dropped with probability dropout_p and the kept ones
  scaled by 1 / (1 - dropout_p), with a mask drawn from torch's default generator of q's device
  (torch.manual_seed makes it reproducible; CUDA graphs draw a fresh mask at each replay). The
  backward regenerates the same mask. As in flash_attn, pass dropout_p=0.0 for evaluation.
- return_attn_probs=True returns (out, softmax_lse, S_dmask): softmax_lse is fp32 [batch, heads_q,
  seqlen_q] (varlen: [heads_q, total_q], as flash_attn 2.x), the natural log of each row's softmax
  denominator of the undropped scores. S_dmask (for tests) is None without dropout, else
  [batch, heads_q, seqlen_q_rounded, seqlen_k_rounded] (lengths rounded up to 128; varlen: the max
  lengths) in q's dtype: the undropped probabilities, negated where dropout dropped them, and 0
  outside the real (query, key) pairs.
- Gradients flow to q, k, v (and the packed tensors) through flashkit's backward pass; a build
  without it raises flashkit's error when backward runs. The log-sum-exp is not differentiable.
- Errors (bad device, dtype, shape, stride, head dim, a kernel this build left out) raise
  RuntimeError with flashkit's message, as flash_attn's checks do; Python-side argument errors
  raise ValueError or NotImplementedError.
"""

from __future__ import annotations

from typing import Optional, Sequence, Tuple, Union

import torch
import torch.nn.functional as F

from flashkit import _ops
from flashkit._packing import token_sequences

_HEAD_DIM_MULTIPLE = 8
_MAX_HEAD_DIM = 256

AttnOutput = Union[torch.Tensor, Tuple[torch.Tensor, torch.Tensor, Optional[torch.Tensor]]]


def _window(fn: str, window_size: Sequence[int]) -> Tuple[int, int]:
    if len(window_size) != 2:
        raise ValueError(f"{fn}: window_size is {tuple(window_size)}; expected a pair "
                         "(left, right), -1 for an unbounded side")
    return int(window_size[0]), int(window_size[1])


def _check_head_dim(fn: str, q: torch.Tensor, **others: Optional[torch.Tensor]) -> None:
    """q's head dim is supported and the other tensors (None: not given) have the same. Checked
    here because the operators see the padded head dims: 12 and 16 both run as 16."""
    head_dim = q.shape[-1]
    if head_dim > _MAX_HEAD_DIM:
        raise RuntimeError(f"{fn}: head_dim (q.size(-1)) is {head_dim}; supported: up to "
                           f"{_MAX_HEAD_DIM}")
    for name, tensor in others.items():
        if tensor is not None and tensor.dim() > 0 and tensor.shape[-1] != head_dim:
            raise RuntimeError(f"{fn}: {name}.size(-1) is {tensor.shape[-1]} but q's head_dim is "
                               f"{head_dim}; they must be equal")


def _softmax_scale(fn: str, softmax_scale: Optional[float], head_dim: int) -> float:
    """The scale the operators get. They read 0 as "the default", so an explicit 0 (which
    flash_attn would apply, giving uniform attention) is refused rather than silently replaced."""
    if softmax_scale is None:
        return head_dim ** -0.5
    if softmax_scale == 0.0:
        raise ValueError(f"{fn}: softmax_scale is 0.0; flashkit supports a positive scale (None "
                         "for 1 / sqrt(head_dim))")
    return softmax_scale


def _last_dim_contiguous(x: torch.Tensor) -> torch.Tensor:
    return x if x.stride(-1) == 1 else x.contiguous()


def _pad_head_dim(x: torch.Tensor) -> torch.Tensor:
    remainder = x.shape[-1] % _HEAD_DIM_MULTIPLE
    if remainder == 0:
        return _last_dim_contiguous(x)
    return F.pad(x, [0, _HEAD_DIM_MULTIPLE - remainder])


def _needs_grad(*tensors: torch.Tensor) -> bool:
    return torch.is_grad_enabled() and any(t.requires_grad for t in tensors)


class _FlashAttnFunc(torch.autograd.Function):
    """Fixed-length attention: flashkit::fwd forward, flashkit::bwd backward."""

    @staticmethod
    def forward(ctx, q, k, v, dropout_p, softmax_scale, causal, window, softcap, alibi_slopes,
                deterministic, return_softmax):
        head_dim = q.shape[-1]
        q, k, v = _pad_head_dim(q), _pad_head_dim(k), _pad_head_dim(v)
        out, softmax_lse, rng_state, s_dmask = _ops.fwd(
            q, k, v, alibi_slopes, dropout_p, softmax_scale, causal, window[0], window[1], softcap,
            return_softmax, None)
        ctx.save_for_backward(q, k, v, out, softmax_lse, alibi_slopes, rng_state)
        ctx.options = (dropout_p, softmax_scale, causal, window, softcap, deterministic)
        ctx.head_dim = head_dim
        ctx.mark_non_differentiable(softmax_lse, s_dmask)
        return out[..., :head_dim], softmax_lse, s_dmask

    @staticmethod
    @torch.autograd.function.once_differentiable  # the gradients have no gradient of their own
    def backward(ctx, dout, _dlse, _ds_dmask):
        q, k, v, out, softmax_lse, alibi_slopes, rng_state = ctx.saved_tensors
        dropout_p, softmax_scale, causal, window, softcap, deterministic = ctx.options
        dq, dk, dv = _ops.bwd(_pad_head_dim(dout), q, k, v, out, softmax_lse, alibi_slopes,
                              dropout_p, rng_state, softmax_scale, causal, window[0], window[1],
                              softcap, deterministic)
        d = ctx.head_dim
        return (dq[..., :d], dk[..., :d], dv[..., :d]) + (None,) * 8


class _FlashAttnVarlenFunc(torch.autograd.Function):
    """Variable-length attention: flashkit::varlen_fwd forward, flashkit::varlen_bwd backward."""

    @staticmethod
    def forward(ctx, q, k, v, cu_seqlens_q, cu_seqlens_k, seqused_k, max_seqlen_q, max_seqlen_k,
                dropout_p, softmax_scale, causal, window, softcap, alibi_slopes, deterministic,
                return_softmax):
        head_dim = q.shape[-1]
        q, k, v = _pad_head_dim(q), _pad_head_dim(k), _pad_head_dim(v)
        out, softmax_lse, rng_state, s_dmask = _ops.varlen_fwd(
            q, k, v, cu_seqlens_q, cu_seqlens_k, seqused_k, max_seqlen_q, max_seqlen_k,
            alibi_slopes, dropout_p, softmax_scale, causal, window[0], window[1], softcap,
            return_softmax, None)
        ctx.save_for_backward(q, k, v, out, softmax_lse, cu_seqlens_q, cu_seqlens_k, seqused_k,
                              alibi_slopes, rng_state)
        ctx.options = (max_seqlen_q, max_seqlen_k, dropout_p, softmax_scale, causal, window,
                       softcap, deterministic)
        ctx.head_dim = head_dim
        ctx.mark_non_differentiable(softmax_lse, s_dmask)
        return out[..., :head_dim], softmax_lse, s_dmask

    @staticmethod
    @torch.autograd.function.once_differentiable  # the gradients have no gradient of their own
    def backward(ctx, dout, _dlse, _ds_dmask):
        (q, k, v, out, softmax_lse, cu_seqlens_q, cu_seqlens_k, seqused_k, alibi_slopes,
         rng_state) = ctx.saved_tensors
        (max_seqlen_q, max_seqlen_k, dropout_p, softmax_scale, causal, window, softcap,
         deterministic) = ctx.options
        dq, dk, dv = _ops.varlen_bwd(_pad_head_dim(dout), q, k, v, out, softmax_lse, cu_seqlens_q,
                                     cu_seqlens_k, seqused_k, max_seqlen_q, max_seqlen_k,
                                     alibi_slopes, dropout_p, rng_state, softmax_scale, causal,
                                     window[0], window[1], softcap, deterministic)
        d = ctx.head_dim
        return (dq[..., :d], dk[..., :d], dv[..., :d]) + (None,) * 13


def _attention(fn, q, k, v, dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes,
               deterministic, return_attn_probs):
    """Fixed-length attention with autograd when a gradient is wanted, else the bare operator.
    Returns (out, softmax_lse, S_dmask or None)."""
    if q.dim() != 4:
        raise RuntimeError(f"{fn}: q has shape {list(q.shape)}; expected 4 dims "
                           "[batch, seqlen_q, heads_q, head_dim]")
    _check_head_dim(fn, q, k=k, v=v)
    window = _window(fn, window_size)
    softmax_scale = _softmax_scale(fn, softmax_scale, q.shape[-1])
    return_softmax = bool(return_attn_probs) and dropout_p > 0
    if _needs_grad(q, k, v):
        out, softmax_lse, s_dmask = _FlashAttnFunc.apply(q, k, v, dropout_p, softmax_scale, causal,
                                                         window, softcap, alibi_slopes,
                                                         deterministic, return_softmax)
    else:
        out, softmax_lse, _, s_dmask = _ops.fwd(
            _pad_head_dim(q), _pad_head_dim(k), _pad_head_dim(v), alibi_slopes, dropout_p,
            softmax_scale, causal, window[0], window[1], softcap, return_softmax, None)
        out = out[..., :q.shape[-1]]
    return out, softmax_lse, s_dmask if return_softmax else None


def _varlen_attention(fn, q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                      dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes,
                      deterministic, return_attn_probs, seqused_k=None):
    if q.dim() != 3:
        raise RuntimeError(f"{fn}: q has shape {list(q.shape)}; expected 3 dims "
                           "[total_q, heads_q, head_dim]")
    _check_head_dim(fn, q, k=k, v=v)
    window = _window(fn, window_size)
    softmax_scale = _softmax_scale(fn, softmax_scale, q.shape[-1])
    return_softmax = bool(return_attn_probs) and dropout_p > 0
    if _needs_grad(q, k, v):
        out, softmax_lse, s_dmask = _FlashAttnVarlenFunc.apply(
            q, k, v, cu_seqlens_q, cu_seqlens_k, seqused_k, max_seqlen_q, max_seqlen_k, dropout_p,
            softmax_scale, causal, window, softcap, alibi_slopes, deterministic, return_softmax)
    else:
        out, softmax_lse, _, s_dmask = _ops.varlen_fwd(
            _pad_head_dim(q), _pad_head_dim(k), _pad_head_dim(v), cu_seqlens_q, cu_seqlens_k,
            seqused_k, max_seqlen_q, max_seqlen_k, alibi_slopes, dropout_p, softmax_scale, causal,
            window[0], window[1], softcap, return_softmax, None)
        out = out[..., :q.shape[-1]]
    return out, softmax_lse, s_dmask if return_softmax else None


def _packed_lse(softmax_lse: torch.Tensor, cu_seqlens_q: torch.Tensor,
                total_q: int) -> torch.Tensor:
    """flashkit's varlen LSE [batch, heads, max_seqlen_q] as flash_attn 2.x's [heads, total_q].
    Tokens of no sequence (before cu_seqlens_q[0] or past cu_seqlens_q[-1]) get -inf."""
    batch, heads, max_seqlen_q = softmax_lse.shape
    if batch == 0 or max_seqlen_q == 0:
        return softmax_lse.new_full((heads, total_q), float("-inf"))
    seq, row, in_batch = token_sequences(cu_seqlens_q, total_q)
    row = row.clamp(0, max_seqlen_q - 1)
    # One gather along the flattened (sequence, row) axis of [heads, batch * max_seqlen_q].
    by_head = softmax_lse.permute(1, 0, 2).reshape(heads, batch * max_seqlen_q)
    packed = by_head.index_select(1, seq.long() * max_seqlen_q + row.long())  # [heads, total_q]
    return torch.where(in_batch[None, :], packed, float("-inf")).contiguous()


def _result(out, softmax_lse, s_dmask, return_attn_probs):
    return (out, softmax_lse, s_dmask) if return_attn_probs else out


def flash_attn_func(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    dropout_p: float = 0.0,
    softmax_scale: Optional[float] = None,
    causal: bool = False,
    window_size: Tuple[int, int] = (-1, -1),
    softcap: float = 0.0,
    alibi_slopes: Optional[torch.Tensor] = None,
    deterministic: bool = False,
    return_attn_probs: bool = False,
) -> AttnOutput:
    """softmax(q k^T * softmax_scale + bias, masked) v for a batch of equal-length sequences.

    Args:
        q: [batch, seqlen_q, heads_q, head_dim], float16 or bfloat16.
        k, v: [batch, seqlen_k, heads_kv, head_dim]; heads_q a multiple of heads_kv.
        dropout_p: dropout probability of the attention weights (0.0 for evaluation).
        softmax_scale: defaults to 1 / sqrt(head_dim).
        causal: bottom-right aligned causal mask.
        window_size: (left, right) sliding window; -1 is unbounded, and so is a side >= seqlen_k.
        softcap: > 0 applies softcap * tanh(score / softcap).
        alibi_slopes: fp32 [heads_q] or [batch, heads_q].
        deterministic: bit-identical gradients from run to run.
        return_attn_probs: also return softmax_lse [batch, heads_q, seqlen_q] and S_dmask (None
            without dropout; see the module docstring).

    Returns:
        out [batch, seqlen_q, heads_q, head_dim], or (out, softmax_lse, S_dmask).
    """
    out, softmax_lse, s_dmask = _attention(
        "flash_attn_func", q, k, v, dropout_p, softmax_scale, causal, window_size, softcap,
        alibi_slopes, deterministic, return_attn_probs)
    return _result(out, softmax_lse, s_dmask, return_attn_probs)


def flash_attn_qkvpacked_func(
    qkv: torch.Tensor,
    dropout_p: float = 0.0,
    softmax_scale: Optional[float] = None,
    causal: bool = False,
    window_size: Tuple[int, int] = (-1, -1),
    softcap: float = 0.0,
    alibi_slopes: Optional[torch.Tensor] = None,
    deterministic: bool = False,
    return_attn_probs: bool = False,
) -> AttnOutput:
    """flash_attn_func on qkv [batch, seqlen, 3, heads, head_dim] (q, k, v stacked on dim 2).

    Returns out [batch, seqlen, heads, head_dim], or (out, softmax_lse, S_dmask); the gradient is
    one tensor shaped like qkv.
    """
    if qkv.dim() != 5 or qkv.shape[2] != 3:
        raise RuntimeError(f"flash_attn_qkvpacked_func: qkv has shape {list(qkv.shape)}; expected "
                           "[batch, seqlen, 3, heads, head_dim]")
    q, k, v = qkv.unbind(2)
    out, softmax_lse, s_dmask = _attention(
        "flash_attn_qkvpacked_func", q, k, v, dropout_p, softmax_scale, causal, window_size,
        softcap, alibi_slopes, deterministic, return_attn_probs)
    return _result(out, softmax_lse, s_dmask, return_attn_probs)


def flash_attn_kvpacked_func(
    q: torch.Tensor,
    kv: torch.Tensor,
    dropout_p: float = 0.0,
    softmax_scale: Optional[float] = None,
    causal: bool = False,
    window_size: Tuple[int, int] = (-1, -1),
    softcap: float = 0.0,
    alibi_slopes: Optional[torch.Tensor] = None,
    deterministic: bool = False,
    return_attn_probs: bool = False,
) -> AttnOutput:
    """flash_attn_func with kv [batch, seqlen_k, 2, heads_kv, head_dim] (k, v stacked on dim 2).

    Returns out [batch, seqlen_q, heads_q, head_dim], or (out, softmax_lse, S_dmask).
    """
    if kv.dim() != 5 or kv.shape[2] != 2:
        raise RuntimeError(f"flash_attn_kvpacked_func: kv has shape {list(kv.shape)}; expected "
                           "[batch, seqlen_k, 2, heads_kv, head_dim]")
    k, v = kv.unbind(2)
    out, softmax_lse, s_dmask = _attention(
        "flash_attn_kvpacked_func", q, k, v, dropout_p, softmax_scale, causal, window_size, softcap,
        alibi_slopes, deterministic, return_attn_probs)
    return _result(out, softmax_lse, s_dmask, return_attn_probs)


def flash_attn_varlen_func(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    max_seqlen_q: int,
    max_seqlen_k: int,
    dropout_p: float = 0.0,
    softmax_scale: Optional[float] = None,
    causal: bool = False,
    window_size: Tuple[int, int] = (-1, -1),
    softcap: float = 0.0,
    alibi_slopes: Optional[torch.Tensor] = None,
    deterministic: bool = False,
    return_attn_probs: bool = False,
    block_table: Optional[torch.Tensor] = None,
) -> AttnOutput:
    """Attention over sequences of different lengths packed along the token dimension.

    Args:
        q: [total_q, heads_q, head_dim]; k, v: [total_k, heads_kv, head_dim].
        cu_seqlens_q, cu_seqlens_k: int32 [batch + 1], prefix sums of the lengths, from 0.
        max_seqlen_q, max_seqlen_k: bounds on every query / key length.
        block_table: optional int32 [batch, max_blocks_per_seq], a paged KV cache (as in
            flash_attn 2.6): k and v are then [num_blocks, page_block_size, heads_kv, head_dim]
            and key i of sequence b is row i % page_block_size of page
            block_table[b, i // page_block_size]; cu_seqlens_k still gives the key lengths. Any
            page_block_size (flash_attn: multiples of 256). Up to 16 query tokens per sequence
            (max_seqlen_q), without dropout or gradients, the decode kernel reads the pages in
            place (flash_attn_with_kvcache's); otherwise flashkit gathers each sequence's keys
            and values into a [batch x max_seqlen_k] copy and runs the varlen kernels on it,
            its lengths as seqused_k, and gradients reach the cache. No host synchronisation.
        The rest as flash_attn_func; masks apply per sequence, except that a window side is
        unbounded at or beyond max_seqlen_k (as in flash_attn), not the sequence's own length.

    Returns:
        out [total_q, heads_q, head_dim] (rows past cu_seqlens_q[-1] are not written), or
        (out, softmax_lse [heads_q, total_q], S_dmask).
    """
    fn = "flash_attn_varlen_func"
    seqused_k = None
    if block_table is not None:
        lengths_k = _check_pages(fn, k, v, block_table, cu_seqlens_q, cu_seqlens_k, max_seqlen_k)
        if (0 < cu_seqlens_q.numel() - 1 and max_seqlen_q <= _PAGED_DECODE_MAX_QUERIES
                and dropout_p == 0 and not _needs_grad(q, k, v)):
            out, softmax_lse = _paged_decode(fn, q, k, v, block_table, cu_seqlens_q, lengths_k,
                                             max_seqlen_q, max_seqlen_k, softmax_scale, causal,
                                             window_size, softcap, alibi_slopes)
            return (out, softmax_lse, None) if return_attn_probs else out
        k, v, cu_seqlens_k = _gather_pages(k, v, block_table, max_seqlen_k)
        seqused_k = lengths_k
    out, softmax_lse, s_dmask = _varlen_attention(
        fn, q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p,
        softmax_scale, causal, window_size, softcap, alibi_slopes, deterministic,
        return_attn_probs, seqused_k)
    if not return_attn_probs:
        return out
    return out, _packed_lse(softmax_lse, cu_seqlens_q, q.shape[0]), s_dmask


# Up to this many query tokens per sequence, a paged flash_attn_varlen_func call without dropout or
# gradients runs on the decode kernel, which reads the pages in place (_paged_decode); longer
# queries gather the pages and run the varlen kernels (_gather_pages), where the copy is small
# beside the products.
_PAGED_DECODE_MAX_QUERIES = 16


def _check_pages(fn, k_cache, v_cache, block_table, cu_seqlens_q, cu_seqlens_k, max_seqlen_k):
    """The paged arguments of flash_attn_varlen_func; returns each sequence's key length (int32
    [batch], from cu_seqlens_k, on the cache's device)."""
    for name, cache in (("k", k_cache), ("v", v_cache)):
        if cache.dim() != 4:
            raise RuntimeError(f"{fn}: with block_table, {name} has shape {list(cache.shape)}; "
                               "expected 4 dims [num_blocks, page_block_size, heads_kv, head_dim]")
    if k_cache.shape[:3] != v_cache.shape[:3]:
        raise RuntimeError(f"{fn}: with block_table, k {list(k_cache.shape)} and v "
                           f"{list(v_cache.shape)} must have the same pages, page size and heads")
    if block_table.dtype != torch.int32:
        raise RuntimeError(f"{fn}: block_table has dtype {block_table.dtype}; expected torch.int32")
    for name, tensor in (("block_table", block_table), ("cu_seqlens_q", cu_seqlens_q),
                         ("cu_seqlens_k", cu_seqlens_k)):
        if tensor.device != k_cache.device:
            raise RuntimeError(f"{fn}: {name} is on {tensor.device} but k is on {k_cache.device}")
    for name, tensor in (("cu_seqlens_q", cu_seqlens_q), ("cu_seqlens_k", cu_seqlens_k)):
        if tensor.dtype != torch.int32 or tensor.dim() != 1:
            raise RuntimeError(f"{fn}: {name} has dtype {tensor.dtype} and shape "
                               f"{list(tensor.shape)}; expected int32 [batch + 1]")
    batch = cu_seqlens_q.numel() - 1
    if block_table.dim() != 2 or block_table.shape[0] != batch:
        raise RuntimeError(f"{fn}: block_table has shape {list(block_table.shape)}; expected "
                           f"[batch, max_blocks_per_seq] with batch = {batch} (cu_seqlens_q)")
    if cu_seqlens_k.numel() != batch + 1:
        raise RuntimeError(f"{fn}: cu_seqlens_k has shape {list(cu_seqlens_k.shape)}; expected "
                           f"[batch + 1] = [{batch + 1}]")
    num_blocks, page_size = k_cache.shape[0], k_cache.shape[1]
    if max_seqlen_k > block_table.shape[1] * page_size:
        raise RuntimeError(f"{fn}: max_seqlen_k is {max_seqlen_k} but block_table holds "
                           f"{block_table.shape[1]} pages of {page_size} keys per sequence")
    if max_seqlen_k > 0 and num_blocks == 0:
        raise RuntimeError(f"{fn}: max_seqlen_k is {max_seqlen_k} but the cache has no pages")
    lengths = cu_seqlens_k[1:] - cu_seqlens_k[:-1]
    if lengths.device.type == "cpu" and batch > 0 and int(lengths.max()) > max_seqlen_k:
        raise RuntimeError(f"{fn}: a sequence has {int(lengths.max())} keys (cu_seqlens_k) but "
                           f"max_seqlen_k is {max_seqlen_k}")
    return lengths


def _gather_pages(k_cache, v_cache, block_table, max_seqlen_k):
    """A paged cache's keys and values as varlen tensors of max_seqlen_k rows per sequence:
    (k, v [batch * max_seqlen_k, heads_kv, head_dim], their cu_seqlens_k). The rows past a
    sequence's length are never read (its length goes to the kernels as seqused_k). Page indices
    are the caller's promise, as in flash_attn_with_kvcache, clamped into [0, num_blocks) so that
    a bad one gives wrong rows, not a fault."""
    batch = block_table.shape[0]
    num_blocks, page_size = k_cache.shape[0], k_cache.shape[1]
    # Whole pages move: index_select copies each page's rows as one contiguous run. A table entry
    # past a sequence's own pages may hold anything: clamped into range, its rows lie past the
    # sequence's length, which the kernels never read.
    pages_per_seq = -(-max_seqlen_k // page_size)
    pages = block_table[:, :pages_per_seq].clamp(0, max(num_blocks - 1, 0)).reshape(-1)

    def gather(cache):
        rows = cache.index_select(0, pages).view(batch, pages_per_seq * page_size, *cache.shape[2:])
        return rows[:, :max_seqlen_k].reshape(batch * max_seqlen_k, *cache.shape[2:])

    padded_cu = torch.arange(0, (batch + 1) * max_seqlen_k, max(max_seqlen_k, 1), dtype=torch.int32,
                             device=k_cache.device)
    if max_seqlen_k == 0:
        padded_cu = torch.zeros(batch + 1, dtype=torch.int32, device=k_cache.device)
    return gather(k_cache), gather(v_cache), padded_cu


def _paged_decode(fn, q, k_cache, v_cache, block_table, cu_seqlens_q, lengths_k, max_seqlen_q,
                  max_seqlen_k, softmax_scale, causal, window_size, softcap, alibi_slopes):
    """Short queries over a paged cache on flash_attn_with_kvcache's operator, which reads the pages
    in place. Each sequence's queries go right-aligned into a row of a [batch, max_seqlen_q] block,
    so that its last query meets its last key as the varlen masks align them (the rows before
    are padding, computed and dropped), and a window side at or beyond max_seqlen_k is made
    unbounded first (the varlen rule; the kvcache one compares with the cache's capacity). Returns
    (out [total_q, heads_q, head_dim], softmax_lse [heads_q, total_q]); tokens of no sequence get
    zero rows and -inf."""
    total_q, heads_q, head_dim = q.shape
    batch = cu_seqlens_q.numel() - 1
    rows = max(max_seqlen_q, 1)
    lengths_q = cu_seqlens_q[1:] - cu_seqlens_q[:-1]
    if lengths_q.device.type == "cpu" and batch > 0 and int(lengths_q.max()) > rows:
        raise RuntimeError(f"{fn}: a sequence has {int(lengths_q.max())} query tokens "
                           f"(cu_seqlens_q) but max_seqlen_q is {max_seqlen_q}")
    window = tuple(-1 if side >= max_seqlen_k else side for side in _window(fn, window_size))
    seq, position, inside = token_sequences(cu_seqlens_q, total_q)
    slot = seq * rows + rows - lengths_q[seq] + position
    # Tokens of no sequence go to the spare row past the block; the clamp keeps cu_seqlens_q that
    # break the caller's promise (on CUDA, unchecked) from indexing out of bounds.
    slot = torch.where(inside, slot, batch * rows).clamp_(0, batch * rows).long()
    block = q.new_zeros(batch * rows + 1, heads_q, head_dim).index_copy_(0, slot, q)
    out, lse = flash_attn_with_kvcache(
        block[:-1].view(batch, rows, heads_q, head_dim), k_cache, v_cache, cache_seqlens=lengths_k,
        block_table=block_table, softmax_scale=softmax_scale, causal=causal, window_size=window,
        softcap=softcap, alibi_slopes=alibi_slopes, return_softmax_lse=True)
    out = torch.cat((out.reshape(batch * rows, heads_q, head_dim), out.new_zeros(1, heads_q, head_dim)))
    lse = torch.cat((lse.permute(1, 0, 2).reshape(heads_q, batch * rows),
                     lse.new_full((heads_q, 1), float("-inf"))), dim=1)
    return out.index_select(0, slot), lse.index_select(1, slot)


def flash_attn_varlen_qkvpacked_func(
    qkv: torch.Tensor,
    cu_seqlens: torch.Tensor,
    max_seqlen: int,
    dropout_p: float = 0.0,
    softmax_scale: Optional[float] = None,
    causal: bool = False,
    window_size: Tuple[int, int] = (-1, -1),
    softcap: float = 0.0,
    alibi_slopes: Optional[torch.Tensor] = None,
    deterministic: bool = False,
    return_attn_probs: bool = False,
) -> AttnOutput:
    """flash_attn_varlen_func on qkv [total, 3, heads, head_dim] with one cu_seqlens for q and k.

    Returns out [total, heads, head_dim], or (out, softmax_lse [heads, total], S_dmask).
    """
    if qkv.dim() != 4 or qkv.shape[1] != 3:
        raise RuntimeError(f"flash_attn_varlen_qkvpacked_func: qkv has shape {list(qkv.shape)}; "
                           "expected [total, 3, heads, head_dim]")
    q, k, v = qkv.unbind(1)
    return flash_attn_varlen_func(q, k, v, cu_seqlens, cu_seqlens, max_seqlen, max_seqlen,
                                  dropout_p, softmax_scale, causal, window_size, softcap,
                                  alibi_slopes, deterministic, return_attn_probs)


def flash_attn_varlen_kvpacked_func(
    q: torch.Tensor,
    kv: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    max_seqlen_q: int,
    max_seqlen_k: int,
    dropout_p: float = 0.0,
    softmax_scale: Optional[float] = None,
    causal: bool = False,
    window_size: Tuple[int, int] = (-1, -1),
    softcap: float = 0.0,
    alibi_slopes: Optional[torch.Tensor] = None,
    deterministic: bool = False,
    return_attn_probs: bool = False,
) -> AttnOutput:
    """flash_attn_varlen_func with kv [total_k, 2, heads_kv, head_dim] (k, v stacked on dim 1).

    Returns out [total_q, heads_q, head_dim], or (out, softmax_lse [heads_q, total_q], S_dmask).
    """
    if kv.dim() != 4 or kv.shape[1] != 2:
        raise RuntimeError(f"flash_attn_varlen_kvpacked_func: kv has shape {list(kv.shape)}; "
                           "expected [total_k, 2, heads_kv, head_dim]")
    k, v = kv.unbind(1)
    return flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                                  dropout_p, softmax_scale, causal, window_size, softcap,
                                  alibi_slopes, deterministic, return_attn_probs)


def _padded_cache(cache: torch.Tensor) -> torch.Tensor:
    """A cache whose head dim is not a multiple of 8, copied into a padded one for the kernel."""
    return F.pad(cache, [0, _HEAD_DIM_MULTIPLE - cache.shape[-1] % _HEAD_DIM_MULTIPLE])


def flash_attn_with_kvcache(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    k: Optional[torch.Tensor] = None,
    v: Optional[torch.Tensor] = None,
    rotary_cos: Optional[torch.Tensor] = None,
    rotary_sin: Optional[torch.Tensor] = None,
    cache_seqlens: Optional[Union[int, torch.Tensor]] = None,
    cache_batch_idx: Optional[torch.Tensor] = None,
    cache_leftpad: Optional[torch.Tensor] = None,
    block_table: Optional[torch.Tensor] = None,
    softmax_scale: Optional[float] = None,
    causal: bool = False,
    window_size: Tuple[int, int] = (-1, -1),
    softcap: float = 0.0,
    rotary_interleaved: bool = True,
    alibi_slopes: Optional[torch.Tensor] = None,
    num_splits: int = 0,
    return_softmax_lse: bool = False,
) -> Union[torch.Tensor, Tuple[torch.Tensor, torch.Tensor]]:
    """Attention of a few new query tokens against a KV cache, with an optional in-place append.

    Per sequence b, with L = cache_seqlens[b], P = cache_leftpad[b] (0 without it) and N = the
    number of new tokens (k.shape[1], 0 without k):

    1. If k and v are given, k[b, i] and v[b, i] are written into the cache at index L + i, in
       place (paged: page block_table[b, (L + i) // page_block_size], row (L + i) %
       page_block_size). With rotary_cos / rotary_sin, k[b, i] is rotated to position L - P + i
       before it is written.
    2. Query b attends to the cache entries [P, L + N) as flash_attn_func would with seqlen_k =
       L + N - P: bottom-right aligned causal / window masks, ALiBi, softcap; except that, as in
       flash_attn, a window side at or beyond the cache capacity means no limit on that side
       (flash_attn_func compares it with its own seqlen_k). With rotary, query token i is rotated
       to position L - P + i if causal or a window is set (after that rule), else to L - P.

    Args:
        q: [batch, seqlen_q, heads_q, head_dim], float16 or bfloat16.
        k_cache, v_cache: [batch_cache, seqlen_cache, heads_kv, head_dim] (contiguous cache), or
            [num_blocks, page_block_size, heads_kv, head_dim] with block_table (paged cache,
            any page_block_size >= 1); dtype of q; last dim contiguous (they are written in place,
            so they are not copied, except for a head dim that is not a multiple of 8: that runs
            on padded copies and the appended rows are copied back). heads_q a multiple of
            heads_kv.
        k, v: optional [batch, seqlen_new, heads_kv, head_dim], appended to the cache (both or
            neither; they need cache_seqlens).
        rotary_cos, rotary_sin: optional [seqlen_ro, rotary_dim / 2], dtype of q; rotary_dim a
            multiple of 16, at most head_dim; seqlen_ro at least the cache capacity, and past
            every query position (L - P + seqlen_q - 1 when causal or windowed). Only with k.
        cache_seqlens: int32 [batch] or an int: the cached tokens of each sequence before the
            append. None: the whole cache (seqlen_cache, or max_blocks_per_seq * page_block_size).
        cache_batch_idx: optional int32 [batch]: the cache row of each sequence (contiguous caches
            only); without it sequence b uses row b.
        cache_leftpad: optional int32 [batch]: the first valid cache index of each sequence.
        block_table: optional int32 [batch, max_blocks_per_seq]: the pages of each sequence.
        softmax_scale: defaults to 1 / sqrt(head_dim).
        causal, window_size, softcap, alibi_slopes: as in flash_attn_func.
        rotary_interleaved: True rotates the pairs (2i, 2i + 1) (GPT-J), False the pairs
            (i, i + rotary_dim / 2) (GPT-NeoX).
        num_splits: split-KV parallelism: 0 lets flashkit choose from the GPU's SM count, 1 turns
            splitting off, at most 128. The split partials live in a workspace from torch's
            caching allocator on the current stream.
        return_softmax_lse: also return softmax_lse, fp32 [batch, heads_q, seqlen_q] (natural log;
            -inf for a query that sees no key, whose output row is zeros).

    Returns:
        out [batch, seqlen_q, heads_q, head_dim], or (out, softmax_lse).

    On CUDA the contents of cache_seqlens, cache_leftpad, cache_batch_idx and block_table are the
    caller's promise (0 <= P <= L, L + N within the cache, pages in range and not shared by two
    sequences' appended rows, rotary query positions inside the tables); FLASHKIT_CHECK_KVCACHE=1
    checks them on the host first (one synchronisation). CPU tensors are always checked. Not
    differentiable (inference only). flashkit's error messages call k and v k_new and v_new, the
    C++ API's names.
    """
    fn = "flash_attn_with_kvcache"
    if q.dim() != 4:
        raise RuntimeError(f"{fn}: q has shape {list(q.shape)}; expected 4 dims "
                           "[batch, seqlen_q, heads_q, head_dim]")
    _check_head_dim(fn, q, k_cache=k_cache, v_cache=v_cache, k=k, v=v)
    window = _window(fn, window_size)
    if (k is None) != (v is None):
        raise ValueError(f"{fn}: {'k' if v is None else 'v'} is given without "
                         f"{'v' if v is None else 'k'}; pass both new keys and values or neither")
    head_dim = q.shape[-1]
    # The C++ check sees the head dim padded to a multiple of 8; the bound is the caller's.
    if rotary_cos is not None and rotary_cos.dim() == 2 and 2 * rotary_cos.shape[1] > head_dim:
        raise ValueError(f"{fn}: rotary_dim (2 * rotary_cos.shape[1]) is {2 * rotary_cos.shape[1]} "
                         f"but head_dim is {head_dim}; rotary_dim must be at most head_dim")
    softmax_scale = _softmax_scale(fn, softmax_scale, head_dim)
    cache_seqlen = -1
    if isinstance(cache_seqlens, int):
        cache_seqlen, cache_seqlens = cache_seqlens, None
    # The index arrays with a strided last dim are copied, as flash_attn does.
    cache_seqlens, cache_batch_idx, cache_leftpad, block_table = (
        None if x is None else _last_dim_contiguous(x)
        for x in (cache_seqlens, cache_batch_idx, cache_leftpad, block_table))
    pad = head_dim % _HEAD_DIM_MULTIPLE != 0
    # A head dim that is not a multiple of 8 runs on zero-padded copies, as in flash_attn; the
    # appended rows are copied back into the caller's caches afterwards.
    k_cache_run = _padded_cache(k_cache) if pad else k_cache
    v_cache_run = _padded_cache(v_cache) if pad else v_cache
    with torch.no_grad():  # inference only: the outputs never require grad, as in flash_attn
        out, softmax_lse = _ops.fwd_kvcache(
            _pad_head_dim(q), k_cache_run, v_cache_run,
            None if k is None else _pad_head_dim(k), None if v is None else _pad_head_dim(v),
            rotary_cos if rotary_cos is None else _last_dim_contiguous(rotary_cos),
            rotary_sin if rotary_sin is None else _last_dim_contiguous(rotary_sin),
            cache_seqlens, cache_seqlen, cache_batch_idx, cache_leftpad, block_table, alibi_slopes,
            softmax_scale, causal, window[0], window[1], softcap, rotary_interleaved, num_splits)
    if pad:
        out = out[..., :head_dim]
        if k is not None:
            k_cache.copy_(k_cache_run[..., :head_dim])
            v_cache.copy_(v_cache_run[..., :head_dim])
    return (out, softmax_lse) if return_softmax_lse else out


# flash_attn's low-level functions, with flash_attn 2.7's arguments and results: libraries that
# build their own autograd around the kernels (ring and context-parallel attention) import these
# from flash_attn.flash_attn_interface. q, k, v, dout are as the functions above take them; the
# caller passes softmax_scale and the window sides explicitly.

def _empty_s_dmask(q: torch.Tensor, s_dmask: Optional[torch.Tensor]) -> torch.Tensor:
    return s_dmask if s_dmask is not None else q.new_empty((0,))


def _flash_attn_forward(q, k, v, dropout_p, softmax_scale, causal, window_size_left,
                        window_size_right, softcap, alibi_slopes, return_softmax):
    """(out, softmax_lse [batch, heads_q, seqlen_q], S_dmask (empty without return_softmax),
    rng_state): one forward, no autograd."""
    fn = "_flash_attn_forward"
    _check_head_dim(fn, q, k=k, v=v)
    return_softmax = bool(return_softmax) and dropout_p > 0
    out, softmax_lse, rng_state, s_dmask = _ops.fwd(
        _pad_head_dim(q), _pad_head_dim(k), _pad_head_dim(v), alibi_slopes, dropout_p,
        _softmax_scale(fn, softmax_scale, q.shape[-1]), causal, window_size_left,
        window_size_right, softcap, return_softmax, None)
    return out[..., :q.shape[-1]], softmax_lse, _empty_s_dmask(q, s_dmask), rng_state


def _flash_attn_varlen_forward(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                               dropout_p, softmax_scale, causal, window_size_left=-1,
                               window_size_right=-1, softcap=0.0, alibi_slopes=None,
                               return_softmax=False, block_table=None, leftpad_k=None,
                               seqused_k=None, zero_tensors=False, num_splits=0):
    """(out, softmax_lse [heads_q, total_q] (flash_attn 2.x's varlen layout), S_dmask, rng_state).
    block_table as flash_attn_varlen_func's gather; leftpad_k is not supported (flash_attn_with_kvcache
    takes cache_leftpad); zero_tensors and num_splits change nothing here (rows outside every
    sequence are left unwritten either way; flashkit chooses its own splits)."""
    fn = "_flash_attn_varlen_forward"
    if leftpad_k is not None:
        raise NotImplementedError(f"{fn}: leftpad_k is not supported by flashkit's varlen forward; "
                                  "flash_attn_with_kvcache takes cache_leftpad")
    _check_head_dim(fn, q, k=k, v=v)
    if block_table is not None:
        lengths_k = _check_pages(fn, k, v, block_table, cu_seqlens_q, cu_seqlens_k, max_seqlen_k)
        k, v, cu_seqlens_k = _gather_pages(k, v, block_table, max_seqlen_k)
        seqused_k = lengths_k if seqused_k is None else torch.minimum(seqused_k, lengths_k)
    return_softmax = bool(return_softmax) and dropout_p > 0
    out, softmax_lse, rng_state, s_dmask = _ops.varlen_fwd(
        _pad_head_dim(q), _pad_head_dim(k), _pad_head_dim(v), cu_seqlens_q, cu_seqlens_k,
        seqused_k, max_seqlen_q, max_seqlen_k, alibi_slopes, dropout_p,
        _softmax_scale(fn, softmax_scale, q.shape[-1]), causal, window_size_left,
        window_size_right, softcap, return_softmax, None)
    return (out[..., :q.shape[-1]], _packed_lse(softmax_lse, cu_seqlens_q, q.shape[0]),
            _empty_s_dmask(q, s_dmask), rng_state)


def _into(target: Optional[torch.Tensor], grad: torch.Tensor, head_dim: int) -> torch.Tensor:
    """A gradient written into the caller's preallocated tensor (if any), as flash_attn does."""
    grad = grad[..., :head_dim]
    return grad if target is None else target.copy_(grad)


def _softmax_d(dout: torch.Tensor, out: torch.Tensor, token_dim: int) -> torch.Tensor:
    """rowsum(dout * out) in fp32, heads before tokens: what flash_attn's backward returns as
    softmax_d (flash_attn pads the token dim to a multiple of 128; here it is not padded)."""
    return (dout.float() * out.float()).sum(-1).transpose(token_dim, token_dim + 1).contiguous()


def _flash_attn_backward(dout, q, k, v, out, softmax_lse, dq, dk, dv, dropout_p, softmax_scale,
                         causal, window_size_left, window_size_right, softcap, alibi_slopes,
                         deterministic, rng_state=None):
    """The gradients of _flash_attn_forward into dq, dk, dv (allocated when None); returns
    softmax_d [batch, heads_q, seqlen_q]."""
    fn = "_flash_attn_backward"
    head_dim = q.shape[-1]
    grads = _ops.bwd(_pad_head_dim(dout), _pad_head_dim(q), _pad_head_dim(k), _pad_head_dim(v),
                     _pad_head_dim(out), softmax_lse, alibi_slopes, dropout_p, rng_state,
                     _softmax_scale(fn, softmax_scale, head_dim), causal, window_size_left,
                     window_size_right, softcap, deterministic)
    for target, grad in zip((dq, dk, dv), grads):
        _into(target, grad, head_dim)
    return _softmax_d(dout, out, 1)


def _unpacked_lse(softmax_lse: torch.Tensor, cu_seqlens_q: torch.Tensor,
                  max_seqlen_q: int) -> torch.Tensor:
    """flash_attn's varlen LSE [heads, total_q] as flashkit's [batch, heads, max_seqlen_q] (the
    inverse of _packed_lse; rows past a sequence's end repeat a value the kernels never read)."""
    heads, total_q = softmax_lse.shape
    batch = cu_seqlens_q.numel() - 1
    if total_q == 0 or batch == 0 or max_seqlen_q == 0:
        return softmax_lse.new_full((batch, heads, max_seqlen_q), float("-inf"))
    rows = torch.arange(max_seqlen_q, device=softmax_lse.device, dtype=cu_seqlens_q.dtype)
    index = (cu_seqlens_q[:-1, None] + rows[None, :]).clamp(0, total_q - 1).long()
    return softmax_lse[:, index].permute(1, 0, 2).contiguous()


def _flash_attn_varlen_backward(dout, q, k, v, out, softmax_lse, dq, dk, dv, cu_seqlens_q,
                                cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p, softmax_scale,
                                causal, window_size_left, window_size_right, softcap, alibi_slopes,
                                deterministic, rng_state=None, zero_tensors=False):
    """The gradients of _flash_attn_varlen_forward (softmax_lse in its [heads_q, total_q] layout)
    into dq, dk, dv (allocated when None); returns softmax_d [heads_q, total_q]."""
    fn = "_flash_attn_varlen_backward"
    head_dim = q.shape[-1]
    grads = _ops.varlen_bwd(_pad_head_dim(dout), _pad_head_dim(q), _pad_head_dim(k),
                            _pad_head_dim(v), _pad_head_dim(out),
                            _unpacked_lse(softmax_lse, cu_seqlens_q, max_seqlen_q), cu_seqlens_q,
                            cu_seqlens_k, None, max_seqlen_q, max_seqlen_k, alibi_slopes,
                            dropout_p, rng_state, _softmax_scale(fn, softmax_scale, head_dim),
                            causal, window_size_left, window_size_right, softcap, deterministic)
    for target, grad in zip((dq, dk, dv), grads):
        _into(target, grad, head_dim)
    return _softmax_d(dout, out, 0)
