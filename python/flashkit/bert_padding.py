"""flash_attn.bert_padding on flashkit: moving between padded batches and the packed varlen layout.

    from flashkit.bert_padding import pad_input, unpad_input  # instead of flash_attn.bert_padding

A padded batch is [batch, seqlen, ...] with a 0/1 (or bool) attention_mask [batch, seqlen]; the
packed layout keeps only the selected tokens, [total, ...] in row-major order, which is what
flash_attn_varlen_func takes with the cu_seqlens that unpad_input returns:

    x_packed, indices, cu_seqlens, max_seqlen, seqused = unpad_input(x, attention_mask)
    out = flash_attn_varlen_func(q_packed, k_packed, v_packed, cu_seqlens, cu_seqlens,
                                 max_seqlen, max_seqlen)
    out = pad_input(out, indices, batch, seqlen)   # zeros where the mask was 0

The names, arguments and results are flash_attn 2.7's (unpad_input returns five values; flash_attn
before 2.6 returned the first four). Every function is differentiable in its tensor input and
runs on any device; unpad_input and unpad_input_for_concatenated_sequences read the longest length
back to the host (one synchronisation), as flash_attn's do.
"""

from __future__ import annotations

from typing import Optional, Tuple

import torch
import torch.nn.functional as F

__all__ = ["index_first_axis", "index_put_first_axis", "pad_input", "unpad_input",
           "unpad_input_for_concatenated_sequences"]


def index_first_axis(input: torch.Tensor, indices: torch.Tensor) -> torch.Tensor:
    """input[indices] along the first axis: [len(indices), *input.shape[1:]]."""
    return input.index_select(0, indices)


def index_put_first_axis(values: torch.Tensor, indices: torch.Tensor,
                         first_axis_dim: int) -> torch.Tensor:
    """A [first_axis_dim, *values.shape[1:]] tensor of zeros with values[i] at row indices[i]."""
    zeros = values.new_zeros(first_axis_dim, *values.shape[1:])
    return zeros.index_copy(0, indices, values)


def _packed(hidden_states: torch.Tensor, selected: torch.Tensor, seqlens: torch.Tensor):
    """The selected tokens of [batch, seqlen, ...] with their flat indices, the int32 prefix sums
    of the per-sequence lengths `seqlens` and the longest of them."""
    indices = torch.nonzero(selected.flatten()).flatten()
    cu_seqlens = F.pad(torch.cumsum(seqlens, 0, dtype=torch.int32), (1, 0))
    max_seqlen = int(seqlens.max()) if seqlens.numel() > 0 else 0
    return index_first_axis(hidden_states.flatten(0, 1), indices), indices, cu_seqlens, max_seqlen


def unpad_input(hidden_states: torch.Tensor, attention_mask: torch.Tensor,
                unused_mask: Optional[torch.Tensor] = None
                ) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor, int, torch.Tensor]:
    """The tokens of [batch, seqlen, ...] that attention_mask (or unused_mask: slots allocated to a
    sequence but not attended to, kept in the packed tensor) selects.

    Returns (hidden_states [total, ...], indices [total] into the flattened batch x seqlen,
    cu_seqlens int32 [batch + 1] of the selected tokens per row, max_seqlen_in_batch (int),
    seqused int32 [batch]: the tokens per row that attention_mask alone selects).
    """
    attended = attention_mask.bool()
    selected = attended if unused_mask is None else attended | unused_mask.bool()
    packed, indices, cu_seqlens, max_seqlen = _packed(
        hidden_states, selected, selected.sum(-1, dtype=torch.int32))
    return packed, indices, cu_seqlens, max_seqlen, attended.sum(-1, dtype=torch.int32)


def unpad_input_for_concatenated_sequences(hidden_states: torch.Tensor,
                                           attention_mask_in_length: torch.Tensor
                                           ) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor, int]:
    """Rows that each hold several sequences back to back: attention_mask_in_length [batch, seqlen]
    lists, in its nonzero entries and in order, the lengths of the sequences that row b holds from
    its first token (e.g. [2, 3, 0, 0, 0, 0]: tokens 0-1 and 2-4, token 5 unused). Each sequence
    becomes one of the varlen batch's, so attention stays within it.

    Returns (hidden_states [total, ...], indices [total], cu_seqlens int32 [sequences + 1],
    max_seqlen_in_batch).
    """
    lengths = attention_mask_in_length
    seqlen = lengths.shape[-1]
    row_tokens = lengths.sum(-1)
    selected = torch.arange(seqlen, device=lengths.device)[None, :] < row_tokens[:, None]
    flat = lengths.flatten()
    return _packed(hidden_states, selected, flat[flat != 0].to(torch.int32))


def pad_input(hidden_states: torch.Tensor, indices: torch.Tensor, batch: int,
              seqlen: int) -> torch.Tensor:
    """The inverse of unpad_input: [total, ...] back to [batch, seqlen, ...], zeros elsewhere."""
    return index_put_first_axis(hidden_states, indices, batch * seqlen).unflatten(0, (batch, seqlen))
