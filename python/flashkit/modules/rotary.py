"""Rotary position embeddings (RoPE) in plain PyTorch, for flashkit.modules.MHA.

The first ``rotary_dim`` channels of each head are rotated in pairs by position-dependent angles
pos * base^(-2i / rotary_dim); the other channels pass through. Pairs are (i, i + rotary_dim / 2)
(GPT-NeoX / Llama layout) or, with ``interleaved``, (2i, 2i + 1) (GPT-J layout).
"""

from __future__ import annotations

import torch
from torch import nn


def apply_rotary_emb(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                     interleaved: bool = False) -> torch.Tensor:
    """Rotates ``x`` [..., tokens, heads, head_dim] by ``cos``/``sin`` [tokens, rotary_dim / 2].

    Computed in fp32 and returned in x's dtype.
    """
    rotary_dim = cos.shape[-1] * 2
    rotated, rest = x[..., :rotary_dim].float(), x[..., rotary_dim:]
    cos, sin = cos[:, None, :], sin[:, None, :]  # broadcast over heads
    if interleaved:
        x1, x2 = rotated[..., 0::2], rotated[..., 1::2]
        out = torch.stack((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1).flatten(-2)
    else:
        x1, x2 = rotated.chunk(2, dim=-1)
        out = torch.cat((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1)
    return torch.cat((out.to(x.dtype), rest), dim=-1)


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
        return (apply_rotary_emb(q, cos, sin, self.interleaved),
                apply_rotary_emb(k, cos, sin, self.interleaved))
