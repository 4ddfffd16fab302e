"""Broadcast inputs: views made by torch's expand(), whose batch, head or sequence stride is 0 (a
prefix's keys shared by every sequence of a batch, one kv head written out as every query head,
one query batch against several caches). flash_attn accepts any stride but the last, and so must a
drop-in: the forward and the gradients of such views against the reference run on contiguous
copies (autograd sums the gradients of an expanded view over its broadcast dims)."""

from __future__ import annotations

import pytest
import torch

from conftest import poison_cuda_allocator
from flashkit import flash_attn_func, flash_attn_with_kvcache
from reference import Options, attention_ref, check_close, rounding_slack
from test_backward import GRAD_FACTOR, reference_grads, skip_unbuilt_bwd
from test_forward import randn

BATCH, HEADS, SEQLEN_Q, SEQLEN_K = 3, 4, 150, 203

# Each case: the shapes of the q, k and v that are expanded to [BATCH, seqlen, HEADS, d], the
# dims a -1 leaves as they are.
CASES = {
    "kv_over_batch": ((BATCH, SEQLEN_Q, HEADS), (1, SEQLEN_K, HEADS), (1, SEQLEN_K, HEADS)),
    "kv_over_heads": ((BATCH, SEQLEN_Q, HEADS), (BATCH, SEQLEN_K, 1), (BATCH, SEQLEN_K, 1)),
    "kv_over_rows": ((BATCH, SEQLEN_Q, HEADS), (BATCH, 1, HEADS), (BATCH, 1, HEADS)),
    "q_over_batch": ((1, SEQLEN_Q, HEADS), (BATCH, SEQLEN_K, HEADS), (BATCH, SEQLEN_K, HEADS)),
    "all_over_batch": ((1, SEQLEN_Q, HEADS), (1, SEQLEN_K, HEADS), (1, SEQLEN_K, HEADS)),
}


def bases(case, dtype, head_dim, device, seed=0):
    return [randn((*shape, head_dim), dtype, device, seed + i) for i, shape in enumerate(CASES[case])]


def expanded(q, k, v):
    """The broadcast views the call is made with (stride 0 in every expanded dim)."""
    q = q.expand(BATCH, SEQLEN_Q, HEADS, -1)
    return q, k.expand(BATCH, SEQLEN_K, HEADS, -1), v.expand(BATCH, SEQLEN_K, HEADS, -1)


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("case", list(CASES))
def test_expanded_forward(device, case, head_dim, causal):
    dtype = torch.bfloat16
    skip_unbuilt_bwd(device, dtype, head_dim)
    q, k, v = expanded(*bases(case, dtype, head_dim, device))
    assert 0 in q.stride() + k.stride() + v.stride()
    opts = Options(causal=causal)
    poison_cuda_allocator(device)
    out, lse, _ = flash_attn_func(q, k, v, causal=causal, return_attn_probs=True)
    contiguous = [t.contiguous() for t in (q, k, v)]
    out_ref, lse_ref = attention_ref(*contiguous, opts)
    out_lowp, lse_lowp = attention_ref(*contiguous, opts, upcast=False)
    check_close("out", out, out_ref, out_lowp)
    check_close("softmax_lse", lse, lse_ref, lse_lowp)


@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("case", list(CASES))
def test_expanded_gradients(device, case, head_dim):
    dtype = torch.bfloat16
    skip_unbuilt_bwd(device, dtype, head_dim)
    leaves = [t.requires_grad_() for t in bases(case, dtype, head_dim, device)]
    dout = randn((BATCH, SEQLEN_Q, HEADS, head_dim), dtype, device, 7)
    poison_cuda_allocator(device)
    out = flash_attn_func(*expanded(*leaves), causal=True)
    out.backward(dout)
    contiguous = [t.detach().contiguous() for t in expanded(*leaves)]
    opts = Options(causal=True)
    ref = reference_grads(*contiguous, dout, opts, upcast=True, stored_out=out)
    lowp = reference_grads(*contiguous, dout, opts, upcast=False)
    check_close("out", out, ref[0], lowp[0], GRAD_FACTOR)
    for name, leaf, r, lp in zip(("dq", "dk", "dv"), leaves, ref[1:], lowp[1:]):
        # The gradient of a broadcast view is its expanded gradient summed over the broadcast dims.
        dims = [d for d in range(3) if leaf.shape[d] == 1 and r.shape[d] > 1]
        summed = 1
        for d in dims:
            summed *= r.shape[d]
        r, lp = (g.sum(dim=dims, keepdim=True) if dims else g for g in (r, lp))
        assert leaf.grad.shape == leaf.shape and leaf.grad.dtype == leaf.dtype
        rows_per_key = (1.0 if name == "dq" else SEQLEN_Q / SEQLEN_K) * summed
        check_close(name, leaf.grad, r, lp, GRAD_FACTOR, rounding_slack(head_dim, rows_per_key))


def test_expanded_cache_without_append(device):
    """flash_attn_with_kvcache reading one cache row shared by the batch (nothing appended: an
    append into a broadcast view would write one row for every sequence)."""
    dtype, head_dim = torch.bfloat16, 128
    skip_unbuilt_bwd(device, dtype, head_dim)
    q = randn((BATCH, 1, HEADS, head_dim), dtype, device, 0)
    k_cache = randn((1, 256, 2, head_dim), dtype, device, 1).expand(BATCH, -1, -1, -1)
    v_cache = randn((1, 256, 2, head_dim), dtype, device, 2).expand(BATCH, -1, -1, -1)
    lengths = torch.tensor([256, 100, 37], dtype=torch.int32, device=device)
    poison_cuda_allocator(device)
    out = flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=lengths, causal=True)
    for b, length in enumerate(lengths.tolist()):
        keys = k_cache[b:b + 1, :length].contiguous()
        values = v_cache[b:b + 1, :length].contiguous()
        opts = Options(causal=True)
        out_ref, _ = attention_ref(q[b:b + 1], keys, values, opts)
        out_lowp, _ = attention_ref(q[b:b + 1], keys, values, opts, upcast=False)
        check_close(f"out[{b}]", out[b:b + 1], out_ref, out_lowp)
