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
  flash_attn_varlen_func and scattered back (padded query rows are zero); for one decoded token per
  row whose kept keys form one run (left or right padding, as generate() makes them), the KV cache
  is read in place instead, by flash_attn_with_kvcache with each run's start and end. The mask
  covers the keys; the queries are its last columns in causal self-attention, all real in
  cross-attention (the encoder's mask) and for one decoded token. Keys past the mask (a static
  cache's unwritten slots) are dropped; for causal self-attention the mask function makes such a
  mask where flash attention's would be None (generate() drops an all-ones mask unless the name says
  "flash");
- packed sequences (cu_seq_lens_q/k and max_length_q/k passed by the caller, or position_ids that
  stop counting up by 1, as transformers' eager masks split them, in a batch of any size): one
  varlen call over the sequences;
- otherwise flash_attn_func on the batch.

Causal masks are bottom-right aligned (what a decoder with a KV cache needs); sliding windows become
flash_attn's (window - 1, window - 1); softcap, dropout (transformers passes the module's
attention_dropout while training, 0 in eval mode), deterministic (or FLASH_ATTENTION_DETERMINISTIC)
and the module's scaling pass through. fp32 queries (an fp32 model under autocast) run in the
autocast dtype, as transformers' flash path runs them; a value head dim below the query's
(multi-head latent attention) is padded and the output cropped. Refused (NotImplementedError), not
dropped: attention sinks (s_aux: gpt-oss), T5's position bias, sparse indices, a 4D mask.
output_attentions=True warns (no weights are returned). Models whose attention does not go through
transformers' attention interface (model._supports_attention_backend False: Bloom, MPT, ...) accept
the name but run their own attention with this mask: use them with "eager" or "sdpa".
"""

from __future__ import annotations

import os
import warnings
from typing import Optional, Tuple

import torch

from flashkit.flash_attn_interface import (flash_attn_func, flash_attn_varlen_func,
                                           flash_attn_with_kvcache)

NAME = "fk_attention"


def _cu_seqlens(lengths: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.pad(lengths.cumsum(0, dtype=torch.int32), (1, 0))


def _packed_from_position_ids(position_ids: torch.Tensor) -> Tuple[torch.Tensor, int]:
    """cu_seqlens and the longest length of the sequences packed in position_ids [batch, seqlen]
    (flattened row by row): a sequence starts at each row start and wherever the position id does
    not follow the previous one by 1, as transformers' eager/sdpa masks split them
    (masking_utils.find_packed_sequence_indices)."""
    starts = torch.ones_like(position_ids, dtype=torch.bool)
    starts[:, 1:] = torch.diff(position_ids, dim=-1) != 1
    starts = torch.nonzero(starts.flatten()).flatten()
    total = torch.tensor([position_ids.numel()], device=position_ids.device)
    lengths = torch.diff(torch.cat((starts, total)))
    return _cu_seqlens(lengths), int(lengths.max())


def _key_ranges(attention_mask: torch.Tensor,
                seqlen_k: int) -> Optional[Tuple[torch.Tensor, torch.Tensor]]:
    """(start, end), int32 [batch]: the keys [start, end) of each row of a 2D padding mask whose
    kept keys form one run per row (left or right padding, as generate() makes them; a row with none
    gives (0, 0)), or None where some row has a hole. One host synchronisation per mask: the result
    is kept on the mask, which transformers hands to every layer of a forward pass."""
    try:
        version = (attention_mask._version, seqlen_k)
    except RuntimeError:  # an inference-mode tensor tracks no version: nothing is kept
        version = None
    cached = getattr(attention_mask, "_flashkit_key_ranges", None)
    if version is not None and cached is not None and cached[0] == version:
        return cached[1]
    keep = attention_mask[:, :seqlen_k].bool()
    count = keep.sum(1, dtype=torch.int32)
    start = keep.int().argmax(1).to(torch.int32)
    end = seqlen_k - keep.flip(1).int().argmax(1).to(torch.int32)
    start = torch.where(count > 0, start, 0)
    end = torch.where(count > 0, end, 0)
    ranges = (start, end) if bool(((end - start) == count).all()) else None
    if version is not None:
        attention_mask._flashkit_key_ranges = (version, ranges)
    return ranges


def _is_packed(position_ids: Optional[torch.Tensor], batch: int, seqlen: int) -> bool:
    return (position_ids is not None and position_ids.dim() == 2
            and position_ids.shape[0] in (1, batch) and position_ids.shape[1] == seqlen > 1
            and bool((torch.diff(position_ids, dim=-1) != 1).any()))


def _target_dtype(query: torch.Tensor, module: torch.nn.Module) -> Optional[torch.dtype]:
    """The half-precision dtype to run fp32 queries in, as transformers' flash-attention path: the
    autocast dtype where autocast is on (fp32 activations of an fp32 model trained under autocast:
    the rotary embedding leaves q and k in fp32), else the dtype of the module's linear weights
    (fp32 layer norms of a half-precision model, as PEFT makes them); None where nothing is
    half-precision (an fp32 model without autocast, which flashkit refuses)."""
    if query.dtype != torch.float32:
        return None
    device_type = query.device.type
    if torch.is_autocast_enabled(device_type):
        dtype = torch.get_autocast_dtype(device_type)
    else:
        linear = next((m for m in module.modules() if isinstance(m, torch.nn.Linear)), None)
        dtype = None if linear is None else linear.weight.dtype
    return dtype if dtype in (torch.float16, torch.bfloat16) else None


# Attention-function arguments that change the result and that flash_attn_func cannot express:
# refused instead of dropped.
_UNSUPPORTED = {
    "s_aux": "attention sinks (s_aux, e.g. gpt-oss)",
    "sinks": "attention sinks",
    "position_bias": "an additive position bias (T5-style relative attention)",
    "indices": "sparse top-k attention indices (DeepSeek sparse attention)",
    "block_indices": "block-sparse attention indices",
}


def flashkit_attention_forward(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor,
                               value: torch.Tensor, attention_mask: Optional[torch.Tensor],
                               dropout: float = 0.0, scaling: Optional[float] = None,
                               sliding_window: Optional[int] = None,
                               softcap: Optional[float] = None,
                               **kwargs) -> Tuple[torch.Tensor, None]:
    """transformers' attention-function signature: query [batch, heads_q, seqlen_q, head_dim],
    key/value [batch, heads_kv, seqlen_k, head_dim], attention_mask a 2D padding mask or None.
    Returns ([batch, seqlen_q, heads_q, head_dim], None): no attention weights."""
    for name, what in _UNSUPPORTED.items():
        if kwargs.get(name) is not None:
            raise NotImplementedError(f"{NAME}: this model passes {what}, which flashkit's "
                                      "attention does not support; use attn_implementation='eager'")
    if attention_mask is not None and attention_mask.dim() != 2:
        raise NotImplementedError(
            f"{NAME}: a {attention_mask.dim()}D attention mask (a custom mask passed to the model, "
            "or a model that builds its own) is not supported: flashkit takes a 2D padding mask, "
            "cu_seq_lens or packed position_ids; use attn_implementation='eager' or 'sdpa'")
    if kwargs.get("output_attentions"):
        warnings.warn(f"{NAME} does not return attention weights (output_attentions=True); use "
                      "attn_implementation='eager' for them", stacklevel=2)

    q, k, v = (t.transpose(1, 2) for t in (query, key, value))
    target = _target_dtype(q, module)
    if target is not None:
        q, k, v = q.to(target), k.to(target), v.to(target)
    # Multi-head latent attention (DeepSeek-V2/V3): v's head dim below q's; padded, output cropped.
    head_dim, v_head_dim = q.shape[-1], v.shape[-1]
    if v_head_dim < head_dim:
        v = torch.nn.functional.pad(v, (0, head_dim - v_head_dim))
    batch, seqlen_q, seqlen_k = q.shape[0], q.shape[1], k.shape[1]
    is_causal = kwargs.get("is_causal")
    if is_causal is None:
        is_causal = getattr(module, "is_causal", True)
    causal = bool(is_causal) and seqlen_q > 1
    deterministic = kwargs.get("deterministic")
    if deterministic is None:
        deterministic = os.getenv("FLASH_ATTENTION_DETERMINISTIC", "0") == "1"
    options = dict(dropout_p=dropout, softmax_scale=scaling, causal=causal,
                   softcap=softcap or 0.0, deterministic=bool(deterministic),
                   window_size=(-1, -1) if sliding_window is None
                   else (sliding_window - 1, sliding_window - 1))

    if attention_mask is not None and seqlen_q == 1 and dropout == 0.0:
        # One decoded token per sequence (generate() on a padded batch): the kept keys of a row are
        # one run, so the KV cache is read in place from each run's start (its left pad) to its
        # end, without gathering it (a copy of every key per layer and step).
        ranges = _key_ranges(attention_mask, min(seqlen_k, attention_mask.shape[1]))
        if ranges is not None:
            out = flash_attn_with_kvcache(
                q, k, v, cache_seqlens=ranges[1], cache_leftpad=ranges[0],
                softmax_scale=scaling, causal=False, window_size=options["window_size"],
                softcap=options["softcap"])
            return out[..., :v_head_dim], None

    if attention_mask is not None:
        keep_k = attention_mask.bool()
        # A static cache holds max_cache_len keys; the mask covers the ones written so far.
        if seqlen_k > keep_k.shape[1]:
            k, v = k[:, :keep_k.shape[1]], v[:, :keep_k.shape[1]]
            seqlen_k = keep_k.shape[1]
        lengths_k = keep_k.sum(1)
        rows_k = torch.nonzero(keep_k.flatten()).flatten()
        if causal or seqlen_q == seqlen_k:
            # Self-attention: the queries are the last seqlen_q positions of the mask.
            keep_q = keep_k[:, -seqlen_q:]
        else:
            # Cross-attention (the mask is the encoder's) or one decoded token: every query is real.
            keep_q = torch.ones(batch, seqlen_q, dtype=torch.bool, device=keep_k.device)
        rows_q = torch.nonzero(keep_q.flatten()).flatten()
        lengths_q = keep_q.sum(1)
        out = flash_attn_varlen_func(
            q.reshape(-1, *q.shape[2:])[rows_q], k.reshape(-1, *k.shape[2:])[rows_k],
            v.reshape(-1, *v.shape[2:])[rows_k], _cu_seqlens(lengths_q), _cu_seqlens(lengths_k),
            int(lengths_q.max()), int(lengths_k.max()), **options)
        padded = out.new_zeros(batch * seqlen_q, *out.shape[1:])
        padded[rows_q] = out
        return padded.view(batch, seqlen_q, *out.shape[1:])[..., :v_head_dim], None

    if kwargs.get("cu_seq_lens_q") is not None:
        cu_q, cu_k = kwargs["cu_seq_lens_q"], kwargs["cu_seq_lens_k"]
        max_q, max_k = int(kwargs["max_length_q"]), int(kwargs["max_length_k"])
    elif seqlen_q == seqlen_k and _is_packed(kwargs.get("position_ids"), batch, seqlen_q):
        position_ids = kwargs["position_ids"].expand(batch, -1)
        cu_q, max_q = _packed_from_position_ids(position_ids)
        cu_k, max_k = cu_q, max_q
    else:
        return flash_attn_func(q, k, v, **options)[..., :v_head_dim], None
    out = flash_attn_varlen_func(q.reshape(-1, *q.shape[2:]), k.reshape(-1, *k.shape[2:]),
                                 v.reshape(-1, *v.shape[2:]), cu_q.to(torch.int32),
                                 cu_k.to(torch.int32), max_q, max_k, **options)
    return out.view(batch, seqlen_q, *out.shape[1:])[..., :v_head_dim], None


def _mask_function(flash_attention_mask):
    """transformers' flash-attention mask function (the 2D padding mask, or None), and for causal
    self-attention whose keys run past the last query (a static cache: max_cache_len keys, the
    unwritten ones zero) a 2D mask of the written keys where the padding mask would be None.
    generate() keeps the padding mask of a static cache only for implementations named "flash"."""

    def mask(*args, **kwargs):
        attention_mask = flash_attention_mask(*args, **kwargs)
        if attention_mask is None and "allow_is_bidirectional_skip" not in kwargs:
            written = (int(kwargs.get("q_offset", 0)) + int(kwargs["q_length"])
                       - int(kwargs.get("kv_offset", 0)))
            if written < kwargs["kv_length"]:
                attention_mask = torch.ones(kwargs["batch_size"], written, dtype=torch.bool,
                                            device=kwargs.get("device"))
        return attention_mask

    return mask


def register() -> None:
    """Registers NAME with transformers' AttentionInterface, and its mask with the mask
    interface (the 2D padding mask of flash attention, trimmed to the written keys of a static
    cache), where this transformers version has one."""
    from transformers import AttentionInterface

    AttentionInterface.register(NAME, flashkit_attention_forward)
    try:
        from transformers.masking_utils import AttentionMaskInterface, flash_attention_mask
    except ImportError:  # versions before the mask interface pass flash attention's mask anyway
        return
    AttentionMaskInterface.register(NAME, _mask_function(flash_attention_mask))
