"""Bad input raises a Python exception whose message names the argument, the value it got and what
is supported, and leaves flashkit ready for the next call (each case runs a good call after)."""

from __future__ import annotations

import pytest
import torch

from conftest import HAS_CUDA, NO_GPU_REASON
from flashkit import _ops, flash_attn_func, flash_attn_varlen_func

BF16 = torch.bfloat16


def t(*shape, dtype=BF16, device="cpu"):
    return torch.randn(*shape, device=device).to(dtype)


def good_call(device):
    q = t(1, 8, 2, 64, device=device)
    assert torch.isfinite(flash_attn_func(q, q, q, causal=True)).all()


FIXED_CASES = {
    "k dtype": (lambda d: (t(1, 8, 2, 64, device=d), t(1, 8, 2, 64, dtype=torch.float16,
                                                          device=d), t(1, 8, 2, 64, device=d)),
                {}, RuntimeError, r"k\.dtype is float16 but q\.dtype is bfloat16"),
    "q float32": (lambda d: tuple(t(1, 8, 2, 64, dtype=torch.float32, device=d) for _ in "qkv"),
                  {}, RuntimeError, r"q\.dtype is float32; supported: float16, bfloat16"),
    "q float64": (lambda d: tuple(t(1, 8, 2, 64, dtype=torch.float64, device=d) for _ in "qkv"),
                  {}, RuntimeError, r"q has dtype Double; supported"),
    "head dim": (lambda d: tuple(t(1, 8, 2, 264, device=d) for _ in "qkv"), {}, RuntimeError,
                 r"head_dim \(q\.size\(-1\)\) is 264; supported: up to 256"),
    "heads": (lambda d: (t(1, 8, 6, 64, device=d), t(1, 8, 4, 64, device=d),
                         t(1, 8, 4, 64, device=d)),
              {}, RuntimeError, r"q has 6 heads and k has 4"),
    "batch": (lambda d: (t(2, 8, 2, 64, device=d), t(1, 8, 2, 64, device=d),
                         t(1, 8, 2, 64, device=d)),
              {}, RuntimeError, r"k has shape \[1, 8, 2, 64\]"),
    "rank": (lambda d: tuple(t(8, 2, 64, device=d) for _ in "qkv"), {}, RuntimeError,
             r"q has shape \[8, 2, 64\]; expected 4 dims"),
    "window pair": (lambda d: tuple(t(1, 8, 2, 64, device=d) for _ in "qkv"),
                    {"window_size": (1, 2, 3)}, ValueError, r"window_size is \(1, 2, 3\)"),
    "window side": (lambda d: tuple(t(1, 8, 2, 64, device=d) for _ in "qkv"),
                    {"window_size": (-5, 0)}, RuntimeError, r"window_left is -5"),
    "dropout": (lambda d: tuple(t(1, 8, 2, 64, device=d) for _ in "qkv"), {"dropout_p": 1.0},
                RuntimeError, r"dropout.p is 1; it must be in \[0, 1\)"),
    "softcap": (lambda d: tuple(t(1, 8, 2, 64, device=d) for _ in "qkv"), {"softcap": -1.0},
                RuntimeError, r"softcap is -1; it must be finite and >= 0"),
    "alibi shape": (lambda d: tuple(t(1, 8, 2, 64, device=d) for _ in "qkv"),
                    {"alibi_slopes": torch.ones(3)}, RuntimeError,
                    r"alibi_slopes has shape \[3\]; expected \[heads_q\] = \[2\]"),
    "alibi dtype": (lambda d: tuple(t(1, 8, 2, 64, device=d) for _ in "qkv"),
                    {"alibi_slopes": torch.ones(2, dtype=torch.float16)}, RuntimeError,
                    r"alibi_slopes\.dtype is float16"),
}


@pytest.mark.parametrize("case", list(FIXED_CASES))
def test_bad_fixed_input(device, case):
    make, kwargs, error, message = FIXED_CASES[case]
    if "alibi_slopes" in kwargs:
        kwargs = {**kwargs, "alibi_slopes": kwargs["alibi_slopes"].to(device)}
    with pytest.raises(error, match=message):
        flash_attn_func(*make(device), **kwargs)
    good_call(device)


def test_last_dim_must_be_contiguous_at_the_operator(device):
    # The Python functions make such inputs contiguous (as flash_attn does); the operator refuses.
    q = t(1, 64, 2, 8, device=device).transpose(1, 3)
    with pytest.raises(RuntimeError, match=r"q.*last dim"):
        _ops.fwd(q, q, q, None, 0.0, 0.0, False, -1, -1, 0.0, False, None)
    assert flash_attn_func(q, q, q).shape == q.shape
    good_call(device)


def varlen_args(device, cu_q=(0, 5, 12), cu_k=(0, 5, 12), cu_dtype=torch.int32, max_q=7,
                max_k=7):
    q = t(12, 2, 64, device=device)
    return (q, q, q, torch.tensor(cu_q, dtype=cu_dtype, device=device),
            torch.tensor(cu_k, dtype=cu_dtype, device=device), max_q, max_k)


VARLEN_CASES = {
    "cu_seqlens dtype": (dict(cu_dtype=torch.int64), r"cu_seqlens_q has dtype Long"),
    "cu_seqlens shapes": (dict(cu_k=(0, 12)), r"cu_seqlens_k has shape \[2\] but cu_seqlens_q "
                                              r"has \[3\]"),
}
CPU_VARLEN_CASES = {  # contents are checked on the CPU backend (on CUDA they stay on the device)
    "decreasing": (dict(cu_q=(0, 7, 5)), r"cu_seqlens_q\[2\] = 5 is less than"),
    "past the end": (dict(cu_q=(0, 5, 13)), r"cu_seqlens_q\[2\] is 13 but q\.size\(0\)"),
    "max_seqlen": (dict(max_q=6), r"sequence 1 has 7 query tokens .* max_seqlen_q is 6"),
}


@pytest.mark.parametrize("case", list(VARLEN_CASES) + list(CPU_VARLEN_CASES))
def test_bad_varlen_input(device, case):
    if case in CPU_VARLEN_CASES and device != "cpu":
        pytest.skip("cu_seqlens contents are the caller's promise on CUDA")
    kwargs, message = {**VARLEN_CASES, **CPU_VARLEN_CASES}[case]
    with pytest.raises(RuntimeError, match=message):
        flash_attn_varlen_func(*varlen_args(device, **kwargs))
    assert flash_attn_varlen_func(*varlen_args(device)).shape == (12, 2, 64)


PAGED_CASES = {  # (k cache shape, block_table dtype, block_table shape, max_seqlen_k, message)
    "k not paged": ((12, 2, 64), torch.int32, (2, 2), 7, r"expected 4 dims \[num_blocks"),
    "table dtype": ((4, 4, 2, 64), torch.int64, (2, 2), 7, r"block_table has dtype torch.int64"),
    "table rows": ((4, 4, 2, 64), torch.int32, (3, 2), 7, r"block_table has shape \[3, 2\]"),
    "table too short": ((4, 4, 2, 64), torch.int32, (2, 1), 7,
                        r"max_seqlen_k is 7 but block_table holds 1 pages of 4 keys"),
}


@pytest.mark.parametrize("case", list(PAGED_CASES))
def test_bad_paged_varlen_input(device, case):
    cache_shape, dtype, table_shape, max_k, message = PAGED_CASES[case]
    q, _, _, cu_q, cu_k, max_q, _ = varlen_args(device)
    cache = t(*cache_shape, device=device)
    table = torch.zeros(table_shape, dtype=dtype, device=device)
    with pytest.raises(RuntimeError, match=message):
        flash_attn_varlen_func(q, cache, cache, cu_q, cu_k, max_q, max_k, block_table=table)
    good_table = torch.arange(4, dtype=torch.int32, device=device).view(2, 2)
    good_cache = t(4, 4, 2, 64, device=device)
    assert flash_attn_varlen_func(q, good_cache, good_cache, cu_q, cu_k, max_q, 7,
                                  block_table=good_table).shape == (12, 2, 64)


@pytest.mark.skipif(not HAS_CUDA, reason=NO_GPU_REASON)
def test_mixed_devices():
    q = t(1, 8, 2, 64, device="cuda")
    with pytest.raises(RuntimeError, match=r"k is on cpu but q is on cuda:0"):
        flash_attn_func(q, q.cpu(), q)
    good_call("cuda")


@pytest.mark.skipif(not HAS_CUDA, reason=NO_GPU_REASON)
def test_kernel_left_out_of_the_build():
    import flashkit
    missing = [(dtype, d) for dtype in (torch.float16, torch.bfloat16)
               for d in (32, 64, 96, 128, 192, 256) if not flashkit.cuda_fwd_built(dtype, d)]
    if not missing:
        pytest.skip("this build has every CUDA forward kernel")
    dtype, head_dim = missing[0]
    q = t(1, 8, 2, head_dim, dtype=dtype, device="cuda")
    with pytest.raises(RuntimeError, match=r"does not include the CUDA forward kernel.*rebuild"):
        flash_attn_func(q, q, q)
