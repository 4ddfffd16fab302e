"""Attention modules over flashkit, after flash_attn.modules.mha: FlashSelfAttention (packed qkv)
and FlashCrossAttention (q and packed kv) with flash_attn's constructor and forward arguments, and
MHA (projections, optional rotary embeddings, GQA/MQA around them) with flash_attn's weight layout
but its own, smaller set of arguments (see its docstring).

Every module takes either padded batches ([batch, seqlen, ...]) or, with ``cu_seqlens`` and
``max_seqlen``, sequences packed along the token dimension ([total, ...]); see
flashkit.flash_attn_interface for the mask semantics (bottom-right causal, rows that see no key give
zeros).
"""

from __future__ import annotations

from typing import Optional, Tuple

import torch
from torch import nn

from flashkit._packing import token_sequences
from flashkit.flash_attn_interface import (
    flash_attn_kvpacked_func,
    flash_attn_qkvpacked_func,
    flash_attn_varlen_kvpacked_func,
    flash_attn_varlen_qkvpacked_func,
    flash_attn_with_kvcache,
)
from flashkit.modules.rotary import RotaryEmbedding


class FlashSelfAttention(nn.Module):
    """Softmax attention of packed qkv.

    Args:
        causal: the default mask of forward().
        softmax_scale: defaults to 1 / sqrt(head_dim).
        attention_dropout: dropout on the probabilities while training (none in eval mode).
        window_size: (left, right) sliding window, -1 unbounded.
        alibi_slopes: fp32 [heads] or [batch, heads].
        deterministic: bit-identical gradients.
    """

    def __init__(self, causal: bool = False, softmax_scale: Optional[float] = None,
                 attention_dropout: float = 0.0, window_size: Tuple[int, int] = (-1, -1),
                 alibi_slopes: Optional[torch.Tensor] = None, deterministic: bool = False):
        super().__init__()
        self.causal = causal
        self.softmax_scale = softmax_scale
        self.drop = nn.Dropout(attention_dropout)
        self.window_size = window_size
        # A buffer (not saved), so that .to() / .cuda() move the slopes with the module.
        self.register_buffer("alibi_slopes", alibi_slopes, persistent=False)
        self.deterministic = deterministic

    def forward(self, qkv: torch.Tensor, causal: Optional[bool] = None,
                cu_seqlens: Optional[torch.Tensor] = None,
                max_seqlen: Optional[int] = None) -> torch.Tensor:
        """qkv [batch, seqlen, 3, heads, head_dim], or [total, 3, heads, head_dim] with cu_seqlens
        (int32 [batch + 1]) and max_seqlen. Returns [batch, seqlen, heads, head_dim] or
        [total, heads, head_dim]. ``causal`` overrides the module's default."""
        causal = self.causal if causal is None else causal
        dropout_p = self.drop.p if self.training else 0.0
        options = dict(softmax_scale=self.softmax_scale, causal=causal,
                       window_size=self.window_size, alibi_slopes=self.alibi_slopes,
                       deterministic=self.deterministic)
        if cu_seqlens is not None:
            if max_seqlen is None:
                raise ValueError("FlashSelfAttention: cu_seqlens was given without max_seqlen")
            return flash_attn_varlen_qkvpacked_func(qkv, cu_seqlens, max_seqlen, dropout_p,
                                                    **options)
        return flash_attn_qkvpacked_func(qkv, dropout_p, **options)


class FlashCrossAttention(nn.Module):
    """Softmax attention of queries over packed keys and values (arguments as FlashSelfAttention)."""

    def __init__(self, causal: bool = False, softmax_scale: Optional[float] = None,
                 attention_dropout: float = 0.0, window_size: Tuple[int, int] = (-1, -1),
                 alibi_slopes: Optional[torch.Tensor] = None, deterministic: bool = False):
        super().__init__()
        self.causal = causal
        self.softmax_scale = softmax_scale
        self.drop = nn.Dropout(attention_dropout)
        self.window_size = window_size
        # A buffer (not saved), so that .to() / .cuda() move the slopes with the module.
        self.register_buffer("alibi_slopes", alibi_slopes, persistent=False)
        self.deterministic = deterministic

    def forward(self, q: torch.Tensor, kv: torch.Tensor, causal: Optional[bool] = None,
                cu_seqlens: Optional[torch.Tensor] = None, max_seqlen: Optional[int] = None,
                cu_seqlens_k: Optional[torch.Tensor] = None,
                max_seqlen_k: Optional[int] = None) -> torch.Tensor:
        """q [batch, seqlen_q, heads_q, head_dim] and kv [batch, seqlen_k, 2, heads_kv, head_dim],
        or q [total_q, heads_q, head_dim] and kv [total_k, 2, heads_kv, head_dim] with
        cu_seqlens / max_seqlen (queries) and cu_seqlens_k / max_seqlen_k (keys). Returns the
        output shaped like q."""
        causal = self.causal if causal is None else causal
        dropout_p = self.drop.p if self.training else 0.0
        options = dict(softmax_scale=self.softmax_scale, causal=causal,
                       window_size=self.window_size, alibi_slopes=self.alibi_slopes,
                       deterministic=self.deterministic)
        if cu_seqlens is not None:
            if None in (max_seqlen, cu_seqlens_k, max_seqlen_k):
                raise ValueError("FlashCrossAttention: cu_seqlens needs max_seqlen, cu_seqlens_k "
                                 "and max_seqlen_k as well")
            return flash_attn_varlen_kvpacked_func(q, kv, cu_seqlens, cu_seqlens_k, max_seqlen,
                                                   max_seqlen_k, dropout_p, **options)
        return flash_attn_kvpacked_func(q, kv, dropout_p, **options)


class MHA(nn.Module):
    """Multi-head self-attention: fused QKV projection, optional rotary embeddings, flashkit
    attention (MHA, or GQA/MQA with num_heads_kv < num_heads), output projection.

    Args:
        embed_dim: model width; num_heads must divide it (head_dim = embed_dim // num_heads).
        num_heads: query heads. num_heads_kv: key/value heads (default num_heads); must divide
            num_heads.
        qkv_proj_bias, out_proj_bias: biases of the two projections.
        dropout: attention dropout while training (none in eval mode).
        softmax_scale, causal, window_size: as flash_attn_func.
        rotary_emb_dim: channels per head rotated by RoPE (0: none); rotary_emb_base its base;
            rotary_emb_interleaved the GPT-J pair layout instead of GPT-NeoX's.

    Inference with a KV cache: allocate_kv_cache() makes the (k_cache, v_cache) pair, and
    forward(x, kv_cache=..., cache_seqlens=...) appends x's keys and values to it in place and
    attends over the cache through flash_attn_with_kvcache (prefill: cache_seqlens 0 and the
    prompt; decode: one token per sequence). The caller advances cache_seqlens by x.shape[1].
    Rotary runs in the decode kernel there (rotary_emb_dim a multiple of 16), at the positions
    flash_attn_with_kvcache states, which with causal=True are the tokens' own.
    """

    def __init__(self, embed_dim: int, num_heads: int, num_heads_kv: Optional[int] = None,
                 qkv_proj_bias: bool = True, out_proj_bias: bool = True, dropout: float = 0.0,
                 softmax_scale: Optional[float] = None, causal: bool = False,
                 rotary_emb_dim: int = 0, rotary_emb_base: float = 10000.0,
                 rotary_emb_interleaved: bool = False, window_size: Tuple[int, int] = (-1, -1),
                 deterministic: bool = False, device: Optional[torch.device] = None,
                 dtype: Optional[torch.dtype] = None):
        super().__init__()
        num_heads_kv = num_heads if num_heads_kv is None else num_heads_kv
        if embed_dim % num_heads != 0:
            raise ValueError(f"MHA: embed_dim {embed_dim} is not a multiple of num_heads "
                             f"{num_heads}")
        if num_heads % num_heads_kv != 0:
            raise ValueError(f"MHA: num_heads {num_heads} is not a multiple of num_heads_kv "
                             f"{num_heads_kv}")
        self.embed_dim = embed_dim
        self.num_heads = num_heads
        self.num_heads_kv = num_heads_kv
        self.head_dim = embed_dim // num_heads
        factory = dict(device=device, dtype=dtype)
        qkv_dim = self.head_dim * (num_heads + 2 * num_heads_kv)
        self.Wqkv = nn.Linear(embed_dim, qkv_dim, bias=qkv_proj_bias, **factory)
        self.out_proj = nn.Linear(embed_dim, embed_dim, bias=out_proj_bias, **factory)
        self.rotary_emb = (RotaryEmbedding(rotary_emb_dim, rotary_emb_base, rotary_emb_interleaved,
                                           device=device) if rotary_emb_dim > 0 else None)
        self.inner_attn = FlashCrossAttention(causal=causal, softmax_scale=softmax_scale,
                                              attention_dropout=dropout, window_size=window_size,
                                              deterministic=deterministic)

    @staticmethod
    def _positions(x: torch.Tensor, cu_seqlens: Optional[torch.Tensor]) -> torch.Tensor:
        """The position of each token in its sequence: [seqlen] for a padded batch, [total] packed."""
        if cu_seqlens is None:
            return torch.arange(x.shape[1], device=x.device)
        return token_sequences(cu_seqlens, x.shape[0])[1]

    def allocate_kv_cache(self, batch: int, max_seqlen: int, dtype: Optional[torch.dtype] = None,
                          device: Optional[torch.device] = None
                          ) -> Tuple[torch.Tensor, torch.Tensor]:
        """Empty contiguous caches [batch, max_seqlen, num_heads_kv, head_dim] for forward's
        kv_cache (dtype and device default to the projection's)."""
        weight = self.Wqkv.weight
        shape = (batch, max_seqlen, self.num_heads_kv, self.head_dim)
        options = dict(dtype=dtype or weight.dtype, device=device or weight.device)
        return torch.zeros(shape, **options), torch.zeros(shape, **options)

    def _decode(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                kv_cache: Tuple[torch.Tensor, torch.Tensor],
                cache_seqlens: torch.Tensor) -> torch.Tensor:
        k_cache, v_cache = kv_cache
        cos = sin = None
        if self.rotary_emb is not None:
            positions = torch.arange(k_cache.shape[1], device=q.device)
            cos, sin = (t.to(q.dtype) for t in self.rotary_emb.cos_sin(positions))
        attn = self.inner_attn
        return flash_attn_with_kvcache(
            q, k_cache, v_cache, k, v, rotary_cos=cos, rotary_sin=sin,
            cache_seqlens=cache_seqlens, softmax_scale=attn.softmax_scale, causal=attn.causal,
            window_size=attn.window_size,
            rotary_interleaved=self.rotary_emb is not None and self.rotary_emb.interleaved)

    def forward(self, x: torch.Tensor, cu_seqlens: Optional[torch.Tensor] = None,
                max_seqlen: Optional[int] = None,
                kv_cache: Optional[Tuple[torch.Tensor, torch.Tensor]] = None,
                cache_seqlens: Optional[torch.Tensor] = None) -> torch.Tensor:
        """x [batch, seqlen, embed_dim], or [total, embed_dim] with cu_seqlens (int32 [batch + 1])
        and max_seqlen. Returns the same shape. With kv_cache (allocate_kv_cache's pair) and
        cache_seqlens (int32 [batch], the tokens cached before x): x's keys and values are
        appended to the cache in place and x attends over everything cached."""
        qkv = self.Wqkv(x)
        qkv = qkv.unflatten(-1, (self.num_heads + 2 * self.num_heads_kv, self.head_dim))
        q, k, v = qkv.split([self.num_heads, self.num_heads_kv, self.num_heads_kv], dim=-2)
        if kv_cache is not None:
            if cu_seqlens is not None or cache_seqlens is None:
                raise ValueError("MHA: kv_cache takes a padded batch x [batch, seqlen, embed_dim] "
                                 "and cache_seqlens, not cu_seqlens")
            return self.out_proj(self._decode(q, k, v, kv_cache, cache_seqlens).flatten(-2))
        if self.rotary_emb is not None:
            q, k = self.rotary_emb(q, k, self._positions(x, cu_seqlens))
        kv = torch.stack((k, v), dim=-3)
        if cu_seqlens is not None:
            out = self.inner_attn(q, kv, cu_seqlens=cu_seqlens, max_seqlen=max_seqlen,
                                  cu_seqlens_k=cu_seqlens, max_seqlen_k=max_seqlen)
        else:
            out = self.inner_attn(q, kv)
        return self.out_proj(out.flatten(-2))
