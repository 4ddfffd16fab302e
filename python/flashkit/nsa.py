"""Native sparse attention (DeepSeek's NSA) on flashkit: the selection branch as its own operator,
and the three-branch mixture.

    nsa_selection_attn_func(q, k, v, block_indices, ...)     selection branch (flashkit::nsa_fwd
                                                             and nsa_bwd)
    native_sparse_attn_func(q, k, v, k_cmp, v_cmp, g_cmp, g_slc, g_swa, block_indices, ...)
                                                             compressed + selected + sliding window

Layouts (last dim contiguous, other strides free; a strided last dim is copied, as in
flash_attn_interface):

    q [batch, seqlen_q, heads_q, head_dim], k and v [batch, seqlen_k, heads_kv, head_dim]
    block_indices int [batch, seqlen_q, heads_kv, selected] (1 <= selected <= 256)
    block_counts  int [batch, seqlen_q, heads_kv], a Python int (the same count everywhere), or None

Selection semantics (include/flashkit/nsa_params.h is the contract): the keys are cut into blocks
of block_size (block n holds keys [n * block_size, (n + 1) * block_size), the last one shorter), and
query token i of kv head g attends to the keys of the *set* of blocks named by its first
count = clamp(block_counts[b, i, g], 0, selected) slots (all slots without block_counts). Slots
naming a block outside [0, ceil(seqlen_k / block_size)) select nothing (-1 is the usual padding),
and a block named twice counts once. Query head h reads kv head h // (heads_q // heads_kv). With
causal=True the keys j > i + seqlen_k - seqlen_q are removed as well (bottom-right aligned, as
flash_attn_func). A token that sees no key gets a zero output row, a log-sum-exp of -inf and no
gradient. Only the contents of block_indices and block_counts are never an error.

int64 (or other integer) block_indices and block_counts are converted to int32 here, values beyond
int32 clamped first so that they still select nothing. Head dims that are not a multiple of 8 run
zero-padded, as in flash_attn_func. Errors from flashkit (dtype, shapes, block_size not a multiple
of 16 in 16..256, a kernel this build left out) raise RuntimeError with flashkit's message.
"""

from __future__ import annotations

from typing import Optional, Tuple, Union

import torch
import torch.nn.functional as F

from flashkit import _ops
from flashkit.flash_attn_interface import (
    _check_head_dim,
    _last_dim_contiguous,
    _needs_grad,
    _pad_head_dim,
    _softmax_scale,
    flash_attn_func,
)

_INT32_MAX = 2 ** 31 - 1


class _NsaSelectionFunc(torch.autograd.Function):
    """The selection branch: flashkit::nsa_fwd forward, flashkit::nsa_bwd backward."""

    @staticmethod
    def forward(ctx, q, k, v, block_indices, block_counts, block_size, softmax_scale, causal):
        head_dim = q.shape[-1]
        q, k, v = _pad_head_dim(q), _pad_head_dim(k), _pad_head_dim(v)
        out, softmax_lse = _ops.nsa_fwd(q, k, v, block_indices, block_counts, block_size,
                                        softmax_scale, causal)
        ctx.save_for_backward(q, k, v, block_indices, block_counts, out, softmax_lse)
        ctx.options = (block_size, softmax_scale, causal)
        ctx.head_dim = head_dim
        ctx.mark_non_differentiable(softmax_lse)
        return out[..., :head_dim], softmax_lse

    @staticmethod
    @torch.autograd.function.once_differentiable  # the gradients have no gradient of their own
    def backward(ctx, dout, _dlse):
        q, k, v, block_indices, block_counts, out, softmax_lse = ctx.saved_tensors
        block_size, softmax_scale, causal = ctx.options
        dq, dk, dv = _ops.nsa_bwd(_pad_head_dim(dout), q, k, v, block_indices, block_counts,
                                  block_size, out, softmax_lse, softmax_scale, causal)
        d = ctx.head_dim
        return (dq[..., :d], dk[..., :d], dv[..., :d]) + (None,) * 5


def _as_int32(x: torch.Tensor, low: int, high: int) -> torch.Tensor:
    """An integer tensor as int32 with a contiguous last dim. int64 values outside [low, high] are
    clamped first, which keeps their meaning (an index stays out of range, a count stays at or past
    `selected` or at or below 0) where a plain cast would wrap them. Other dtypes (float, bool) go
    through unchanged for flashkit to name."""
    if x.dtype == torch.int64:
        x = x.clamp(low, high).to(torch.int32)
    elif x.dtype in (torch.int8, torch.int16, torch.uint8):
        x = x.to(torch.int32)
    return _last_dim_contiguous(x)


def _selection_args(fn: str, block_indices: torch.Tensor,
                    block_counts: Union[None, int, torch.Tensor]):
    """(block_indices, block_counts) as the operators take them (int32, last dim contiguous)."""
    block_indices = _as_int32(block_indices, -1, _INT32_MAX)
    selected = block_indices.shape[-1] if block_indices.dim() > 0 else 0
    if isinstance(block_counts, bool):
        raise ValueError(f"{fn}: block_counts is {block_counts}; expected an int, an integer "
                         "tensor [batch, seqlen_q, heads_kv] or None")
    if isinstance(block_counts, int):
        # The same count for every token: all slots (None, the operators' fast case) or a tensor.
        if block_counts >= selected:
            return block_indices, None
        block_counts = torch.full(block_indices.shape[:-1], max(block_counts, 0),
                                  dtype=torch.int32, device=block_indices.device)
    elif block_counts is not None:
        block_counts = _as_int32(block_counts, 0, _INT32_MAX)
    return block_indices, block_counts


def _selection(fn, q, k, v, block_indices, block_size, block_counts, causal, softmax_scale):
    """(out, softmax_lse) of the selection branch, through autograd when a gradient is wanted.
    softmax_scale is resolved (never None)."""
    if q.dim() != 4:
        raise RuntimeError(f"{fn}: q has shape {list(q.shape)}; expected 4 dims "
                           "[batch, seqlen_q, heads_q, head_dim]")
    _check_head_dim(fn, q, k=k, v=v)
    block_indices, block_counts = _selection_args(fn, block_indices, block_counts)
    if _needs_grad(q, k, v):
        return _NsaSelectionFunc.apply(q, k, v, block_indices, block_counts, block_size,
                                       softmax_scale, causal)
    out, softmax_lse = _ops.nsa_fwd(_pad_head_dim(q), _pad_head_dim(k), _pad_head_dim(v),
                                    block_indices, block_counts, block_size, softmax_scale, causal)
    return out[..., :q.shape[-1]], softmax_lse


def nsa_selection_attn_func(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    block_indices: torch.Tensor,
    block_size: int = 64,
    block_counts: Union[None, int, torch.Tensor] = None,
    causal: bool = True,
    softmax_scale: Optional[float] = None,
    return_lse: bool = False,
) -> Union[torch.Tensor, Tuple[torch.Tensor, torch.Tensor]]:
    """Native sparse attention's selection branch: each query token attends only to the keys of
    the blocks it selected (see the module docstring and include/flashkit/nsa_params.h).

    Args:
        q: [batch, seqlen_q, heads_q, head_dim], float16 or bfloat16.
        k, v: [batch, seqlen_k, heads_kv, head_dim]; heads_q a multiple of heads_kv.
        block_indices: int32 or int64 [batch, seqlen_q, heads_kv, selected]: the key blocks of
            each (token, kv head); out-of-range entries (-1 padding) and repeats are allowed.
        block_size: keys per block, a multiple of 16 from 16 to 256.
        block_counts: None (every slot in use), an int (the same number of leading slots for
            every token, as FLA's parallel_nsa takes it), or an int32 / int64 tensor
            [batch, seqlen_q, heads_kv] (clamped to [0, selected]).
        causal: also hide the keys after each token (bottom-right aligned).
        softmax_scale: defaults to 1 / sqrt(head_dim).
        return_lse: also return softmax_lse, fp32 [batch, heads_q, seqlen_q] (natural log; -inf
            for a token that sees no key). Not differentiable.

    Returns:
        out [batch, seqlen_q, heads_q, head_dim] in q's dtype, or (out, softmax_lse).
        Gradients flow to q, k and v (keys that no token selected get zero dk and dv).
    """
    fn = "nsa_selection_attn_func"
    softmax_scale = _softmax_scale(fn, softmax_scale, q.shape[-1])
    out, softmax_lse = _selection(fn, q, k, v, block_indices, block_size, block_counts, causal,
                                  softmax_scale)
    return (out, softmax_lse) if return_lse else out


def _fold_queries(q: torch.Tensor, front: int, groups: int, stride: int) -> torch.Tensor:
    """q [b, s_q, h, d] -> [b, groups, h * stride, d]: `front` zero rows before the tokens and
    zero rows after them up to groups * stride; each run of `stride` rows becomes one row whose
    heads are (h, r) with r minor, so that folded head h * stride + r still reads kv head
    h // (heads_q // heads_kv) with heads_q * stride query heads."""
    batch, seqlen_q, heads, head_dim = q.shape
    q = F.pad(q, [0, 0, 0, 0, front, groups * stride - front - seqlen_q])
    q = q.view(batch, groups, stride, heads, head_dim).transpose(2, 3)
    return q.reshape(batch, groups, heads * stride, head_dim)


def _unfold_output(out: torch.Tensor, front: int, seqlen_q: int, stride: int) -> torch.Tensor:
    """_fold_queries' inverse on [b, groups, h * stride, d], dropping the padding rows."""
    batch, groups, heads_stride, head_dim = out.shape
    out = out.view(batch, groups, heads_stride // stride, stride, head_dim).transpose(2, 3)
    return out.reshape(batch, groups * stride, heads_stride // stride, head_dim)[
        :, front:front + seqlen_q]


def _compressed_attention(q: torch.Tensor, k_cmp: torch.Tensor, v_cmp: torch.Tensor,
                          seqlen_k: int, block: int, stride: int,
                          softmax_scale: float) -> torch.Tensor:
    """The compressed branch: query i (at key position p = i + seqlen_k - seqlen_q) attends to
    the compressed keys c whose whole block [c * stride, c * stride + block) lies at or before p,
    that is c <= floor((p + 1 - block) / stride); a query that sees none gets zeros.

    flash_attn_func's bottom-right causal mask lets row i see keys j <= i + const: slope one. Here
    `stride` consecutive queries share one limit, so the queries are folded: each run of `stride`
    queries that share a limit becomes one row of stride * heads_q query heads (_fold_queries),
    and the rows split into three ranges, each one flash_attn_func call or none:
      - rows that see no compressed key: zeros, no call;
      - rows that see a strict prefix: causal over the first keys (the limit grows by one per row,
        which bottom-right causal expresses exactly once the keys are cut to the last row's limit);
      - rows that see every compressed key: no mask.
    Exact for any block and stride, with autograd through flash_attn_func."""
    batch, seqlen_q, heads_q, head_dim = q.shape
    seqlen_cmp = k_cmp.shape[1]
    # Query i sees c <= (i + base) // stride = (i + front) // stride + first_limit.
    base = seqlen_k - seqlen_q + 1 - block
    front = base % stride
    first_limit = (base - front) // stride  # exact
    groups = -(-(seqlen_q + front) // stride)
    # Folded row g sees c <= g + first_limit: none below `blind`, all from `full`.
    blind = min(max(-first_limit, 0), groups)
    full = min(max(seqlen_cmp - 1 - first_limit, blind), groups)
    if groups == 0:  # no query tokens
        return q.new_zeros(q.shape)
    folded = _fold_queries(q, front, groups, stride)
    parts = []
    if blind > 0:
        parts.append(folded.new_zeros((batch, blind) + folded.shape[2:]))
    if full > blind:
        # Row r of this range (g = blind + r) sees c <= r + blind + first_limit; with the keys cut
        # after the last row's limit, bottom-right causal gives exactly that.
        keys = full + first_limit
        parts.append(flash_attn_func(folded[:, blind:full], k_cmp[:, :keys], v_cmp[:, :keys],
                                     softmax_scale=softmax_scale, causal=True))
    if groups > full:
        if seqlen_cmp > 0:
            parts.append(flash_attn_func(folded[:, full:], k_cmp, v_cmp,
                                         softmax_scale=softmax_scale))
        else:
            parts.append(folded.new_zeros((batch, groups - full) + folded.shape[2:]))
    out = parts[0] if len(parts) == 1 else torch.cat(parts, dim=1)
    return _unfold_output(out, front, seqlen_q, stride)


def _check_gate(fn: str, name: str, gate: Optional[torch.Tensor], q: torch.Tensor) -> None:
    if gate is not None and tuple(gate.shape) != tuple(q.shape[:3]):
        raise ValueError(f"{fn}: {name} has shape {list(gate.shape)}; expected [batch, seqlen_q, "
                         f"heads_q] = {list(q.shape[:3])}")


def native_sparse_attn_func(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_cmp: Optional[torch.Tensor],
    v_cmp: Optional[torch.Tensor],
    g_cmp: Optional[torch.Tensor],
    g_slc: torch.Tensor,
    g_swa: Optional[torch.Tensor],
    block_indices: torch.Tensor,
    block_size: int = 64,
    window_size: int = 512,
    block_counts: Union[None, int, torch.Tensor] = None,
    softmax_scale: Optional[float] = None,
    *,
    compress_block_size: Optional[int] = None,
    compress_stride: Optional[int] = None,
) -> torch.Tensor:
    """Native sparse attention: o = g_cmp * o_cmp + g_slc * o_slc + g_swa * o_swa, every branch
    causal with the query tokens bottom-right aligned (query i sits at key position
    p = i + seqlen_k - seqlen_q, as flash_attn_func aligns causal masks).

    - o_slc: the selection branch, nsa_selection_attn_func(q, k, v, block_indices, block_size,
      block_counts, causal=True).
    - o_swa: sliding window, flash_attn_func(q, k, v, causal=True,
      window_size=(window_size - 1, 0)): the keys p - window_size + 1 .. p.
    - o_cmp: attention over the caller's compressed keys and values. Compressed key c summarises
      the keys [c * compress_stride, c * compress_stride + compress_block_size), and query p sees
      it only when that whole block lies at or before p:
      c * compress_stride + compress_block_size - 1 <= p. Both default to block_size
      (non-overlapping blocks, as FLA's parallel_nsa compresses). Tokens before the first full
      block see no compressed key and get o_cmp = 0. Exact for any block and stride (see
      _compressed_attention for how flash_attn_func serves this mask). Compressed keys past the
      sequence (seqlen_cmp may be any length) are simply never seen.

    Args:
        q: [batch, seqlen_q, heads_q, head_dim], float16 or bfloat16.
        k, v: [batch, seqlen_k, heads_kv, head_dim].
        k_cmp, v_cmp: [batch, seqlen_cmp, heads_kv, head_dim], dtype of q (e.g. mean-pooled or
            learned compressions of k and v); None with g_cmp None.
        g_cmp, g_slc, g_swa: gates [batch, seqlen_q, heads_q] (any float dtype; typically
            sigmoid outputs). g_cmp or g_swa None leaves that branch out.
        block_indices, block_size, block_counts: the selection (nsa_selection_attn_func).
        window_size: the sliding window's length in keys, including the token's own (>= 1).
        softmax_scale: of all three branches; defaults to 1 / sqrt(head_dim).
        compress_block_size, compress_stride: the compressed keys' geometry (see above).

    Returns:
        o [batch, seqlen_q, heads_q, head_dim] in q's dtype (the gated sum is formed in the
        promoted dtype of the branch outputs and gates, then cast). Gradients flow to q, k, v,
        k_cmp, v_cmp and the gates.
    """
    fn = "native_sparse_attn_func"
    if q.dim() != 4:
        raise RuntimeError(f"{fn}: q has shape {list(q.shape)}; expected 4 dims "
                           "[batch, seqlen_q, heads_q, head_dim]")
    if g_slc is None:
        raise ValueError(f"{fn}: g_slc is None; the selection branch's gate is required")
    for name, gate in (("g_cmp", g_cmp), ("g_slc", g_slc), ("g_swa", g_swa)):
        _check_gate(fn, name, gate, q)
    if g_cmp is not None and (k_cmp is None or v_cmp is None):
        raise ValueError(f"{fn}: g_cmp is given without k_cmp and v_cmp; pass all three or none")
    if g_swa is not None and window_size < 1:
        raise ValueError(f"{fn}: window_size is {window_size}; it must be >= 1 (the keys a token "
                         "sees in the sliding-window branch, its own included)")
    block = block_size if compress_block_size is None else compress_block_size
    stride = block if compress_stride is None else compress_stride
    if block < 1 or stride < 1:
        raise ValueError(f"{fn}: compress_block_size is {block} and compress_stride is {stride}; "
                         "both must be >= 1")
    softmax_scale = _softmax_scale(fn, softmax_scale, q.shape[-1])

    o_slc, _ = _selection(fn, q, k, v, block_indices, block_size, block_counts, True,
                          softmax_scale)
    o = g_slc.unsqueeze(-1) * o_slc
    if g_swa is not None:
        o_swa = flash_attn_func(q, k, v, softmax_scale=softmax_scale, causal=True,
                                window_size=(window_size - 1, 0))
        o = o + g_swa.unsqueeze(-1) * o_swa
    if g_cmp is not None:
        _check_head_dim(fn, q, k_cmp=k_cmp, v_cmp=v_cmp)
        o_cmp = _compressed_attention(q, k_cmp, v_cmp, k.shape[1], block, stride, softmax_scale)
        o = o + g_cmp.unsqueeze(-1) * o_cmp
    return o.to(q.dtype)
