"""flashkit as a Hugging Face transformers attention implementation.

    import flashkit.integrations.transformers as flashkit_hf
    flashkit_hf.register()                       # once; registers flashkit_hf.NAME
    model = AutoModelForCausalLM.from_config(config, attn_implementation=flashkit_hf.NAME)

The name is "fk_attention", not "flashkit": transformers takes any implementation name containing
"flash" for a flash-attn kernel that it must import (and fails to find).

The model then hands flashkit's attention its queries, keys and values ([batch, heads, seqlen,
head_dim]) and, through the mask interface, the 2D padding mask that flash attention takes (or None
for an unpadded batch). Three cases, as transformers' flash-attention path:

- a padding mask: the valid tokens are gathered into a varlen batch, attended with
  flash_attn_varlen_func and scattered back (padded query rows are zero);
- packed sequences (cu_seq_lens_q/k and max_length_q/k passed by the caller, or a batch of one whose
  position_ids restart at 0 where each sequence starts): one varlen call over the sequences;
- otherwise flash_attn_func on the batch.

Causal masks are bottom-right aligned (what a decoder with a KV cache needs); sliding windows become
flash_attn's (window - 1, window - 1); softcap, dropout (transformers passes the module's
attention_dropout while training, 0 in eval mode) and the module's scaling pass through.
"""

from __future__ import annotations

from typing import Optional, Tuple

import torch

from flashkit.flash_attn_interface import flash_attn_func, flash_attn_varlen_func

NAME = "fk_attention"


def _cu_seqlens(lengths: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.pad(lengths.cumsum(0, dtype=torch.int32), (1, 0))


def _packed_from_position_ids(position_ids: torch.Tensor) -> Tuple[torch.Tensor, int]:
    """cu_seqlens and the longest length of the sequences packed in a batch of one whose position
    ids restart at 0 at each sequence start."""
    starts = torch.nonzero(position_ids[0] == 0).flatten()
    total = torch.tensor([position_ids.shape[1]], device=position_ids.device)
    lengths = torch.diff(torch.cat((starts, total)))
    return _cu_seqlens(lengths), int(lengths.max())


def _is_packed(position_ids: Optional[torch.Tensor]) -> bool:
    return (position_ids is not None and position_ids.dim() == 2 and position_ids.shape[0] == 1
            and bool((torch.diff(position_ids[0]) != 1).any()))


def flashkit_attention_forward(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor,
                               value: torch.Tensor, attention_mask: Optional[torch.Tensor],
                               dropout: float = 0.0, scaling: Optional[float] = None,
                               sliding_window: Optional[int] = None,
                               softcap: Optional[float] = None,
                               **kwargs) -> Tuple[torch.Tensor, None]:
    """transformers' attention-function signature: query [batch, heads_q, seqlen_q, head_dim],
    key/value [batch, heads_kv, seqlen_k, head_dim], attention_mask a 2D padding mask or None.
    Returns ([batch, seqlen_q, heads_q, head_dim], None): no attention weights."""
    q, k, v = (t.transpose(1, 2) for t in (query, key, value))
    batch, seqlen_q = q.shape[0], q.shape[1]
    causal = bool(kwargs.get("is_causal", getattr(module, "is_causal", True))) and seqlen_q > 1
    options = dict(dropout_p=dropout, softmax_scale=scaling, causal=causal,
                   softcap=softcap or 0.0,
                   window_size=(-1, -1) if sliding_window is None
                   else (sliding_window - 1, sliding_window - 1))

    if attention_mask is not None and attention_mask.dim() == 2:
        keep_k = attention_mask.bool()
        keep_q = keep_k[:, -seqlen_q:]
        rows_q = torch.nonzero(keep_q.flatten()).flatten()
        rows_k = torch.nonzero(keep_k.flatten()).flatten()
        lengths_q, lengths_k = keep_q.sum(1), keep_k.sum(1)
        out = flash_attn_varlen_func(
            q.reshape(-1, *q.shape[2:])[rows_q], k.reshape(-1, *k.shape[2:])[rows_k],
            v.reshape(-1, *v.shape[2:])[rows_k], _cu_seqlens(lengths_q), _cu_seqlens(lengths_k),
            int(lengths_q.max()), int(lengths_k.max()), **options)
        padded = out.new_zeros(batch * seqlen_q, *out.shape[1:])
        padded[rows_q] = out
        return padded.view(batch, seqlen_q, *out.shape[1:]), None

    if kwargs.get("cu_seq_lens_q") is not None:
        cu_q, cu_k = kwargs["cu_seq_lens_q"], kwargs["cu_seq_lens_k"]
        max_q, max_k = int(kwargs["max_length_q"]), int(kwargs["max_length_k"])
    elif attention_mask is None and _is_packed(kwargs.get("position_ids")):
        cu_q, max_q = _packed_from_position_ids(kwargs["position_ids"])
        cu_k, max_k = cu_q, max_q
    else:
        return flash_attn_func(q, k, v, **options), None
    out = flash_attn_varlen_func(q[0], k[0], v[0], cu_q.to(torch.int32), cu_k.to(torch.int32),
                                 max_q, max_k, **options)
    return out.unsqueeze(0), None


def register() -> None:
    """Registers NAME with transformers' AttentionInterface, and its mask with the mask
    interface (the 2D padding mask of flash attention), where this transformers version has one."""
    from transformers import AttentionInterface

    AttentionInterface.register(NAME, flashkit_attention_forward)
    try:
        from transformers.masking_utils import AttentionMaskInterface, flash_attention_mask
    except ImportError:  # versions before the mask interface pass flash attention's mask anyway
        return
    AttentionMaskInterface.register(NAME, flash_attention_mask)
