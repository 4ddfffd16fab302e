"""flashkit.bert_padding (flash_attn.bert_padding's functions): the packed layout against the mask
it comes from, the round trip, gradients, and a padded batch through flash_attn_varlen_func
against the reference on each row's own tokens."""

from __future__ import annotations

import pytest
import torch

from conftest import skip_unbuilt
from flashkit import flash_attn_varlen_func
from flashkit.bert_padding import (index_first_axis, index_put_first_axis, pad_input, unpad_input,
                                   unpad_input_for_concatenated_sequences)
from reference import Options, attention_ref, check_close
from test_forward import randn

# Rows of a batch of 4 x 7 tokens: full, left-padded, empty, holes.
MASK = [[1, 1, 1, 1, 1, 1, 1],
        [0, 0, 1, 1, 1, 1, 1],
        [0, 0, 0, 0, 0, 0, 0],
        [1, 0, 1, 1, 0, 0, 1]]


def test_unpad_input_keeps_the_masked_tokens_in_order(device):
    mask = torch.tensor(MASK, device=device)
    x = torch.arange(4 * 7 * 3, dtype=torch.float32, device=device).view(4, 7, 3)
    packed, indices, cu_seqlens, max_seqlen, seqused = unpad_input(x, mask)
    expected = [(b, s) for b in range(4) for s in range(7) if MASK[b][s]]
    assert indices.tolist() == [b * 7 + s for b, s in expected]
    assert torch.equal(packed, torch.stack([x[b, s] for b, s in expected]))
    assert cu_seqlens.dtype == torch.int32 and cu_seqlens.tolist() == [0, 7, 12, 12, 16]
    assert seqused.dtype == torch.int32 and seqused.tolist() == [7, 5, 0, 4]
    assert max_seqlen == 7 and isinstance(max_seqlen, int)


def test_unused_mask_is_packed_but_not_counted_as_used(device):
    mask = torch.tensor([[1, 1, 0, 0], [1, 0, 0, 0]], dtype=torch.bool, device=device)
    unused = torch.tensor([[0, 0, 1, 0], [0, 1, 1, 0]], dtype=torch.bool, device=device)
    x = torch.randn(2, 4, 5, device=device)
    packed, indices, cu_seqlens, max_seqlen, seqused = unpad_input(x, mask, unused)
    assert indices.tolist() == [0, 1, 2, 4, 5, 6]
    assert cu_seqlens.tolist() == [0, 3, 6] and max_seqlen == 3 and seqused.tolist() == [2, 1]
    assert torch.equal(packed, x.flatten(0, 1)[[0, 1, 2, 4, 5, 6]])


def test_pad_input_inverts_unpad_input_with_zeros_elsewhere(device):
    mask = torch.tensor(MASK, device=device)
    x = torch.randn(4, 7, 2, 3, device=device)
    packed, indices, _, _, _ = unpad_input(x, mask)
    padded = pad_input(packed, indices, 4, 7)
    assert padded.shape == x.shape
    assert torch.equal(padded, x * mask[:, :, None, None].to(x.dtype))


def test_gradients_flow_through_both_directions(device):
    mask = torch.tensor(MASK, device=device)
    x = torch.randn(4, 7, 3, device=device, requires_grad=True)
    packed, indices, _, _, _ = unpad_input(x, mask)
    weights = torch.randn(packed.shape, device=device)
    (pad_input(packed * 2, indices, 4, 7).flatten(0, 1)[indices] * weights).sum().backward()
    expected = torch.zeros(4 * 7, 3, device=device)
    expected[indices] = 2 * weights
    assert torch.equal(x.grad, expected.view(4, 7, 3))


def test_index_helpers(device):
    x = torch.randn(6, 2, 3, device=device)
    rows = torch.tensor([4, 0, 5], device=device)
    assert torch.equal(index_first_axis(x, rows), x[rows])
    put = index_put_first_axis(x[:3], rows, 8)
    assert put.shape == (8, 2, 3) and torch.equal(put[rows], x[:3])
    assert torch.all(put[[1, 2, 3, 6, 7]] == 0)


def test_concatenated_sequences():
    # flash_attn's example: rows holding sequences of 2 + 3, 3 + 2 and 6 tokens.
    lengths = torch.tensor([[2, 3, 0, 0, 0, 0], [3, 2, 0, 0, 0, 0], [6, 0, 0, 0, 0, 0]])
    x = torch.arange(3 * 6, dtype=torch.float32).view(3, 6, 1)
    packed, indices, cu_seqlens, max_seqlen = unpad_input_for_concatenated_sequences(x, lengths)
    assert indices.tolist() == [0, 1, 2, 3, 4, 6, 7, 8, 9, 10, 12, 13, 14, 15, 16, 17]
    assert cu_seqlens.dtype == torch.int32 and cu_seqlens.tolist() == [0, 2, 5, 8, 10, 16]
    assert max_seqlen == 6 and torch.equal(packed.flatten(), indices.to(torch.float32))


def test_padded_batch_through_varlen_attention(device):
    """The usual flash_attn pattern: unpad q, k, v of a padded batch, attend per row, pad back."""
    dtype = torch.bfloat16
    skip_unbuilt(device, dtype, 64)
    mask = torch.tensor(MASK, device=device)
    q, k, v = (randn((4, 7, 4, 64), dtype, "cpu", seed).to(device) for seed in (1, 2, 3))
    (q_packed, indices, cu_seqlens, max_seqlen, _), (k_packed, *_), (v_packed, *_) = (
        unpad_input(t, mask) for t in (q, k, v))
    out = flash_attn_varlen_func(q_packed, k_packed, v_packed, cu_seqlens, cu_seqlens, max_seqlen,
                                 max_seqlen, causal=True)
    padded = pad_input(out, indices, 4, 7)
    for b, row in enumerate(MASK):
        keep = torch.tensor(row, dtype=torch.bool)
        if not keep.any():
            assert torch.all(padded[b] == 0)
            continue
        q_b, k_b, v_b = (t[b][keep.to(t.device)].cpu()[None] for t in (q, k, v))
        ref, _ = attention_ref(q_b, k_b, v_b, Options(causal=True))
        lowp, _ = attention_ref(q_b, k_b, v_b, Options(causal=True), upcast=False)
        check_close(f"row {b}", padded[b][keep.to(device)].cpu()[None], ref, lowp, 2.0)
        assert torch.all(padded[b][~keep.to(device)] == 0)
