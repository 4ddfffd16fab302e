"""Rotary position embeddings (RoPE) in plain PyTorch: flash_attn.layers.rotary's apply_rotary_emb,
and the RotaryEmbedding of flashkit.modules.MHA.

The first ``rotary_dim`` channels of each head are rotated in pairs by position-dependent angles
pos * base^(-2i / rotary_dim); the other channels pass through. Pairs are (i, i + rotary_dim / 2)
(GPT-NeoX / Llama layout) or, with ``interleaved``, (2i, 2i + 1) (GPT-J layout).
"""

from __future__ import annotations

from typing import Optional, Union

import torch
from torch import nn

from flashkit._packing import token_sequences


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleaved: bool) -> torch.Tensor:
    """x [..., heads, head_dim] with its first rotary_dim channels rotated by each token's cos /
    sin [..., rotary_dim / 2] (the token dims of x, broadcast over heads), in fp32, returned in
    x's dtype; the other channels pass through."""
    rotary_dim = cos.shape[-1] * 2
    rotated = x[..., :rotary_dim].float()
    cos, sin = cos[..., None, :].float(), sin[..., None, :].float()
    if interleaved:
        x1, x2 = rotated[..., 0::2], rotated[..., 1::2]
        out = torch.stack((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1).flatten(-2)
    else:
        x1, x2 = rotated.chunk(2, dim=-1)
        out = torch.cat((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1)
    return torch.cat((out.to(x.dtype), x[..., rotary_dim:]), dim=-1)


def apply_rotary_emb(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                     interleaved: bool = False, inplace: bool = False,
                     seqlen_offsets: Union[int, torch.Tensor] = 0,
                     cu_seqlens: Optional[torch.Tensor] = None,
                     max_seqlen: Optional[int] = None) -> torch.Tensor:
    """flash_attn.layers.rotary.apply_rotary_emb: rotary embeddings from tables.

    x [batch, seqlen, heads, head_dim], or [total, heads, head_dim] packed with cu_seqlens (int32
    [batch + 1]) and max_seqlen; cos, sin [seqlen_rotary, rotary_dim / 2], rotary_dim <= head_dim.
    Token s of sequence b is rotated by row s + seqlen_offsets (an int, or int [batch]: one per
    sequence, as for tokens appended after a KV cache) of the tables; a row past the tables
    leaves its token unrotated, as flash_attn's kernel does (an int offset that reaches past them
    is an error, as there). Channels past rotary_dim pass through. Computed in fp32 and returned
    in x's dtype; with inplace, written into x, which is returned.
    """
    fn = "apply_rotary_emb"
    rows, half = cos.shape
    if sin.shape != cos.shape:
        raise ValueError(f"{fn}: cos {list(cos.shape)} and sin {list(sin.shape)} differ")
    if 2 * half > x.shape[-1]:
        raise ValueError(f"{fn}: rotary_dim (2 * cos.shape[1]) is {2 * half} but head_dim is "
                         f"{x.shape[-1]}")
    if cu_seqlens is None:
        if x.dim() != 4:
            raise ValueError(f"{fn}: x has shape {list(x.shape)}; expected [batch, seqlen, heads, "
                             "head_dim], or [total, heads, head_dim] with cu_seqlens")
        longest = x.shape[1]
        positions = torch.arange(longest, device=x.device)[None, :]  # [1, seqlen]
        if isinstance(seqlen_offsets, torch.Tensor):
            positions = positions + seqlen_offsets.to(x.device)[:, None]
    else:
        if x.dim() != 3 or max_seqlen is None:
            raise ValueError(f"{fn}: with cu_seqlens, x must be [total, heads, head_dim] "
                             f"(it has shape {list(x.shape)}) and max_seqlen given")
        longest = max_seqlen
        seq, positions, _ = token_sequences(cu_seqlens, x.shape[0])  # [total]
        if isinstance(seqlen_offsets, torch.Tensor):
            positions = positions + seqlen_offsets.to(x.device)[seq]
    if not isinstance(seqlen_offsets, torch.Tensor):
        if longest + seqlen_offsets > rows:
            raise ValueError(f"{fn}: tokens up to {longest} past offset {seqlen_offsets} need "
                             f"{longest + seqlen_offsets} rows of cos / sin; they have {rows}")
        positions = positions + seqlen_offsets
    inside = positions < rows
    index = positions.clamp(0, max(rows - 1, 0)).long()
    cos_rows = torch.where(inside[..., None], cos[index], 1.0)
    sin_rows = torch.where(inside[..., None], sin[index], 0.0)
    if cu_seqlens is None and cos_rows.shape[0] == 1:  # one row of tables for every sequence
        cos_rows, sin_rows = cos_rows[0], sin_rows[0]
    rotated = _rotate(x, cos_rows, sin_rows, interleaved)
    return x.copy_(rotated) if inplace else rotated


class RotaryEmbedding(nn.Module):
    """cos/sin tables for positions, computed on demand (no cache to go stale across devices)."""

    def __init__(self, dim: int, base: float = 10000.0, interleaved: bool = False,
                 device: torch.device | None = None):
        super().__init__()
        if dim % 2 != 0 or dim <= 0:
            raise ValueError(f"RotaryEmbedding: dim is {dim}; it must be even and positive")
        self.dim = dim
        self.interleaved = interleaved
        inv_freq = base ** (-torch.arange(0, dim, 2, device=device, dtype=torch.float32) / dim)
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def cos_sin(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin [tokens, dim / 2] for integer ``positions`` [tokens]."""
        angles = positions.to(torch.float32)[:, None] * self.inv_freq[None, :]
        return angles.cos(), angles.sin()

    def forward(self, q: torch.Tensor, k: torch.Tensor,
                positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """q and k [..., tokens, heads, head_dim] rotated for ``positions`` [tokens]."""
        cos, sin = self.cos_sin(positions)
        return _rotate(q, cos, sin, self.interleaved), _rotate(k, cos, sin, self.interleaved)
