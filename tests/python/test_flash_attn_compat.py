"""Edges where flashkit's flash_attn drop-in once differed from flash_attn 2.x (an API audit of
flash_attn/flash_attn_interface.py and csrc/flash_attn/flash_api.cpp, 2026-11-23): each test pins
the behaviour a drop-in must have, or flashkit's clear refusal where it supports less. The
deliberate differences are listed in the README ("Differences from flash_attn").
"""

from __future__ import annotations

import warnings

import pytest
import torch

from conftest import skip_unbuilt
from flashkit import (flash_attn_func, flash_attn_varlen_func, flash_attn_with_kvcache)

BF16 = torch.bfloat16


def t(*shape, device="cpu", dtype=BF16):
    return torch.randn(*shape, device=device).to(dtype)


def i32(values, device):
    return torch.tensor(values, dtype=torch.int32, device=device)


# --- Wrong results ---------------------------------------------------------------------------

def test_softmax_scale_zero_is_refused(device):
    """The operators read 0 as "the default scale"; flash_attn would apply 0 (uniform attention).
    Silently using 1 / sqrt(head_dim) would be a wrong result, so an explicit 0 is refused."""
    skip_unbuilt(device, BF16, 64)
    q, k, v = t(1, 4, 2, 64, device=device), t(1, 6, 2, 64, device=device), t(1, 6, 2, 64,
                                                                                 device=device)
    with pytest.raises(ValueError, match=r"softmax_scale is 0\.0"):
        flash_attn_func(q, k, v, softmax_scale=0.0)
    with pytest.raises(ValueError, match=r"softmax_scale is 0\.0"):
        flash_attn_with_kvcache(q, k, v, softmax_scale=0.0)


# --- Invalid input accepted (silently computed) ----------------------------------------------

# flash_attn checks k and v against q's unpadded head dim. flashkit pads each tensor to a multiple
# of 8 before the operators see it, so the Python layer compares the head dims first: 12 and 16
# would otherwise both run as 16.
MISMATCHED_HEAD_DIMS = [(16, 12, 12), (12, 16, 16), (16, 16, 10), (12, 12, 16), (13, 10, 15)]


@pytest.mark.parametrize("dims", MISMATCHED_HEAD_DIMS, ids=lambda d: "q%d_k%d_v%d" % d)
def test_mismatched_head_dims_refused(device, dims):
    skip_unbuilt(device, BF16, 16)
    dq, dk, dv = dims
    with pytest.raises(RuntimeError, match=r"size\(-1\) is \d+ but q's head_dim is"):
        flash_attn_func(t(1, 4, 2, dq, device=device), t(1, 5, 2, dk, device=device),
                        t(1, 5, 2, dv, device=device))


def test_varlen_mismatched_head_dims_refused(device):
    skip_unbuilt(device, BF16, 16)
    with pytest.raises(RuntimeError, match=r"k\.size\(-1\) is 12 but q's head_dim is 16"):
        flash_attn_varlen_func(t(4, 2, 16, device=device), t(5, 2, 12, device=device),
                               t(5, 2, 12, device=device), i32([0, 4], device),
                               i32([0, 5], device), 4, 5)


@pytest.mark.parametrize("case", ["k_new_10", "k_new_16", "cache_10"])
def test_kvcache_mismatched_head_dims_refused(device, case):
    skip_unbuilt(device, BF16, 16)
    cache_dim = 10 if case == "cache_10" else 12
    new_dim = {"k_new_10": 10, "k_new_16": 16, "cache_10": 12}[case]
    k_cache, v_cache = t(1, 8, 2, cache_dim, device=device), t(1, 8, 2, cache_dim, device=device)
    k_new, v_new = (t(1, 1, 2, new_dim, device=device) for _ in "kv")
    kwargs = {} if case == "cache_10" else dict(k=k_new, v=v_new, cache_seqlens=2)
    with pytest.raises(RuntimeError, match=r"size\(-1\) is \d+ but q's head_dim is 12"):
        flash_attn_with_kvcache(t(1, 1, 2, 12, device=device), k_cache, v_cache, **kwargs)


# --- Crashes -----------------------------------------------------------------------------------

def test_varlen_lse_with_leading_offset(device):
    skip_unbuilt(device, BF16, 16)
    torch.manual_seed(0)
    q, k, v = t(10, 2, 16, device=device), t(9, 2, 16, device=device), t(9, 2, 16, device=device)
    cu_k = i32([0, 4, 9], device)
    out, lse, _ = flash_attn_varlen_func(q, k, v, i32([2, 5, 10], device), cu_k, 5, 5,
                                         return_attn_probs=True)
    out_ref, lse_ref, _ = flash_attn_varlen_func(q[2:], k, v, i32([0, 3, 8], device), cu_k, 5, 5,
                                                 return_attn_probs=True)
    torch.testing.assert_close(out[2:], out_ref, atol=0, rtol=0)
    torch.testing.assert_close(lse[:, 2:], lse_ref, atol=0, rtol=0)


def test_varlen_lse_with_no_query_rows(device):
    skip_unbuilt(device, BF16, 16)
    q, k = t(3, 2, 16, device=device), t(5, 2, 16, device=device)
    _, lse, _ = flash_attn_varlen_func(q, k, k, i32([0, 0], device), i32([0, 5], device), 0, 5,
                                       return_attn_probs=True)
    assert lse.shape == (2, 3)  # [heads, total_q]; every token is past cu_seqlens_q[-1]


# --- Autograd ----------------------------------------------------------------------------------

def test_double_backward_refused(device):
    skip_unbuilt(device, BF16, 16)
    q, k, v = (t(1, 4, 2, 16, device=device).requires_grad_() for _ in "qkv")
    out = flash_attn_func(q, k, v)
    (dq,) = torch.autograd.grad(out.sum(), q, create_graph=True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with pytest.raises(RuntimeError):
            dq.sum().backward()


def test_kvcache_is_not_differentiable(device):
    """Inference only, as in flash_attn: the output does not require grad even when q does."""
    skip_unbuilt(device, BF16, 16)
    q = t(1, 1, 2, 16, device=device).requires_grad_()
    out = flash_attn_with_kvcache(q, t(1, 8, 2, 16, device=device), t(1, 8, 2, 16, device=device),
                                  cache_seqlens=4)
    assert not out.requires_grad


# --- Valid flash_attn input that flashkit must take -------------------------------------------

@pytest.mark.parametrize("which", ["block_table", "cache_batch_idx"])
def test_kvcache_index_arrays_with_strides(device, which):
    skip_unbuilt(device, BF16, 16)
    torch.manual_seed(0)
    q = t(2, 1, 2, 16, device=device)
    seqlens = i32([3, 4], device)
    if which == "block_table":
        k_cache, v_cache = t(4, 16, 2, 16, device=device), t(4, 16, 2, 16, device=device)
        table = i32([[0, 9, 2, 9], [1, 9, 3, 9]], device)[:, ::2]  # pages [0, 2] and [1, 3]
        seqlens = i32([19, 4], device)
        out = flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=seqlens,
                                      block_table=table)
        ref = flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=seqlens,
                                      block_table=table.contiguous())
    else:
        k_cache, v_cache = t(3, 8, 2, 16, device=device), t(3, 8, 2, 16, device=device)
        idx = i32([[2, 0], [0, 0]], device)
        out = flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=seqlens,
                                      cache_batch_idx=idx[:, 0])
        ref = flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=seqlens,
                                      cache_batch_idx=idx[:, 0].contiguous())
    torch.testing.assert_close(out, ref, atol=0, rtol=0)
