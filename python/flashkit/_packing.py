"""Where the tokens of a packed (varlen) tensor belong, for the front end's index arithmetic."""

from __future__ import annotations

from typing import Tuple

import torch


def token_sequences(cu_seqlens: torch.Tensor,
                    total: int) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """For each of `total` packed tokens, with cu_seqlens (int [batch + 1], nondecreasing) the
    sequences' prefix sums: (its sequence, clamped into [0, batch); its position in that sequence;
    whether it lies in a sequence at all: tokens before cu_seqlens[0] or from cu_seqlens[-1] on
    do not). Device tensors of `total` entries, computed without a host synchronisation."""
    batch = cu_seqlens.numel() - 1
    tokens = torch.arange(total, device=cu_seqlens.device, dtype=cu_seqlens.dtype)
    # How many of cu_seqlens[1:] are <= each token, counted on the whole cu_seqlens (minus its
    # leading entry): torch.compile's Triton searchsorted ignores the offset of a sliced boundary
    # tensor and answers off by one (pytorch/pytorch#182343, torch 2.11).
    seq = torch.searchsorted(cu_seqlens, tokens, right=True) - 1
    inside = (seq >= 0) & (seq < batch)
    seq = seq.clamp(0, max(batch - 1, 0))
    return seq, tokens - cu_seqlens[seq], inside
