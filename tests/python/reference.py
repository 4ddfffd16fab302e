"""The oracle of the Python tests: attention in plain PyTorch, with flashkit's semantics.

attention_ref computes in fp32 (``upcast=True``, the reference) or in the input dtype (the second
reference whose error sets the tolerance, keys scaled instead of queries), per TESTING.md. Masks are
bottom-right aligned; a window side >= seqlen_k (or Options.window_limit) is unbounded; a row that
sees no key gives zeros and a log-sum-exp of -inf.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Optional, Tuple

import torch


@dataclass
class Options:
    """The attention options a case runs with (flash_attn_func's keyword arguments)."""

    causal: bool = False
    window_size: Tuple[int, int] = (-1, -1)
    softcap: float = 0.0
    alibi: bool = False
    softmax_scale: Optional[float] = None
    alibi_slopes: Optional[torch.Tensor] = field(default=None, repr=False)
    # Dropout with a given mask (bool [b, h_q, s_q, s_k], True = kept): what S_dmask says the
    # kernel drew. The kept probabilities are scaled by 1 / (1 - dropout_p); the LSE is unchanged.
    dropout_p: float = 0.0
    dropout_keep: Optional[torch.Tensor] = field(default=None, repr=False)
    # What a window side is compared with (a side at or beyond it is unbounded): None for seqlen_k
    # (flash_attn_func), the cache capacity for flash_attn_with_kvcache. Not an API argument.
    window_limit: Optional[int] = None

    def kwargs(self) -> dict:
        return dict(causal=self.causal, window_size=self.window_size, softcap=self.softcap,
                    alibi_slopes=self.alibi_slopes, softmax_scale=self.softmax_scale)


def visible(seqlen_q: int, seqlen_k: int, opts: Options, device) -> torch.Tensor:
    """bool [seqlen_q, seqlen_k]: which keys each query row may see."""
    left, right = opts.window_size
    limit = seqlen_k if opts.window_limit is None else opts.window_limit
    if left >= limit:
        left = -1
    if right >= limit:
        right = -1
    if opts.causal:
        right = 0
    i = torch.arange(seqlen_q, device=device)[:, None]
    j = torch.arange(seqlen_k, device=device)[None, :]
    diag = i + seqlen_k - seqlen_q
    ok = torch.ones(seqlen_q, seqlen_k, dtype=torch.bool, device=device)
    if left >= 0:
        ok &= j >= diag - left
    if right >= 0:
        ok &= j <= diag + right
    return ok


def attention_ref(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, opts: Options,
                  upcast: bool = True) -> Tuple[torch.Tensor, torch.Tensor]:
    """out [b, s_q, h_q, d] and lse fp32 [b, h_q, s_q] of q [b, s_q, h_q, d], k/v [b, s_k, h_kv, d].

    upcast=True: fp32 throughout, out in fp32. upcast=False: scores and probabilities rounded to the
    input dtype, out in the input dtype."""
    dtype = q.dtype
    if upcast:
        q, k, v = q.float(), k.float(), v.float()
    batch, seqlen_q, heads_q, head_dim = q.shape
    seqlen_k, heads_kv = k.shape[1], k.shape[2]
    k = k.repeat_interleave(heads_q // heads_kv, dim=2)
    v = v.repeat_interleave(heads_q // heads_kv, dim=2)
    scale = opts.softmax_scale if opts.softmax_scale is not None else 1.0 / math.sqrt(head_dim)
    scores = torch.einsum("bqhd,bkhd->bhqk", q, k * scale).float()
    if not upcast:
        scores = scores.to(dtype).float()
    if opts.softcap > 0:
        scores = opts.softcap * torch.tanh(scores / opts.softcap)
    if opts.alibi_slopes is not None:
        slopes = opts.alibi_slopes.float()
        slopes = slopes[None, :, None, None] if slopes.dim() == 1 else slopes[:, :, None, None]
        i = torch.arange(seqlen_q, device=q.device)[:, None]
        j = torch.arange(seqlen_k, device=q.device)[None, :]
        scores = scores - slopes * (i + seqlen_k - seqlen_q - j).abs().float()
    mask = visible(seqlen_q, seqlen_k, opts, q.device)
    scores = scores.masked_fill(~mask, float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)  # -inf for a row that sees nothing
    probs = torch.exp(scores - lse[..., None].masked_fill(torch.isinf(lse)[..., None], 0.0))
    probs = probs.masked_fill(~mask, 0.0)
    if opts.dropout_keep is not None:
        probs = probs.masked_fill(~opts.dropout_keep.to(probs.device), 0.0)
    if not upcast:
        probs = probs.to(dtype)
    out = torch.einsum("bhqk,bkhd->bqhd", probs.to(v.dtype), v)
    if opts.dropout_keep is not None:
        out = out / (1.0 - opts.dropout_p)
    return (out if upcast else out.to(dtype)), lse


def rounding_slack(head_dim: int, rows_per_key: float = 1.0) -> float:
    """check_close's fp32-rounding slack for a gradient: 1e-5, growing with the head dim and, for dk
    and dv, with the square root of the query rows per key (seqlen_q / seqlen_k). It matters only
    where the low-precision reference is exact by cancellation, e.g. one key: P = 1 and
    dS = dP - D = 0, which the reference gets exactly, while the kernel takes D from the stored O
    and dP from the tensor cores' fp32 accumulation. The two agree to the rounding of a
    head_dim-long dot product (relative to its terms, which grow with head_dim), dq carries one
    such error per row (the row's probabilities sum to 1) and dk sums one per query row whose
    probability mass lands on that key. Fuzz seeds 20398 (dk, 766 rows on one key, d64: 1.5e-5)
    and 21320 (d242, 23 rows on one key: dk 1.4e-5, dq 1.2e-5) measured it."""
    return 1e-5 * max(1.0, max(rows_per_key, 1.0) ** 0.5 * head_dim / 64)


def check_close(name: str, got: torch.Tensor, ref: torch.Tensor, lowp: torch.Tensor,
                factor: float = 2.0, slack: float = 1e-5) -> None:
    """The error-ratio rule: max|got - ref| <= factor * max|lowp - ref| + slack, with NaN and inf
    in the same positions on both sides."""
    lowp_dtype = lowp.dtype
    got, ref, lowp = got.float().cpu(), ref.float().cpu(), lowp.float().cpu()
    assert got.shape == ref.shape, f"{name}: shape {tuple(got.shape)} vs {tuple(ref.shape)}"
    nan_got, nan_ref = torch.isnan(got), torch.isnan(ref)
    assert torch.equal(nan_got, nan_ref), (
        f"{name}: NaN at {int(nan_got.sum())} positions, the reference at {int(nan_ref.sum())}")
    inf_got, inf_ref = torch.isinf(got), torch.isinf(ref)
    assert torch.equal(inf_got, inf_ref), f"{name}: inf positions differ from the reference"
    assert torch.equal(got[inf_got], ref[inf_ref]), f"{name}: inf signs differ"
    finite = ~(nan_ref | inf_ref)
    if not finite.any():
        return
    err = (got[finite] - ref[finite]).abs().max().item()
    lowp_finite = finite & torch.isfinite(lowp)
    err_lowp = (lowp[lowp_finite] - ref[lowp_finite]).abs().max().item() if lowp_finite.any() else 0
    assert err <= factor * err_lowp + slack, (
        f"{name}: max error {err:.3g} exceeds {factor} x the {lowp_dtype} reference's "
        f"{err_lowp:.3g} + {slack:g}")
