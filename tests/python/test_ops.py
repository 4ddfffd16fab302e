"""The torch.ops.flashkit operators as PyTorch sees them: torch.library.opcheck (schema, fake
implementation, autograd registration, AOT dispatch) on contiguous and permuted inputs;
torch.compile(fullgraph=True), static and dynamic shapes; CUDA-graph capture and replay."""

from __future__ import annotations

import pytest
import torch

import flashkit
from conftest import HAS_CUDA, NO_GPU_REASON
from flashkit import _ops, flash_attn_func, flash_attn_varlen_func

# opcheck's tests but test_autograd_registration: the operators carry no autograd kernel of their
# own; the Python functions' autograd.Function pairs each forward with its backward operator.
OPCHECK_UTILS = ("test_schema", "test_faketensor", "test_aot_dispatch_dynamic")


def qkv(device, permuted, batch=2, seqlen_q=33, seqlen_k=47, heads=(4, 2), head_dim=64,
        dtype=torch.bfloat16):
    def make(seqlen, h):
        if permuted:  # [batch, heads, seqlen, dim] memory viewed as [batch, seqlen, heads, dim]
            return torch.randn(batch, h, seqlen, head_dim, device=device).to(dtype).transpose(1, 2)
        return torch.randn(batch, seqlen, h, head_dim, device=device).to(dtype)
    return make(seqlen_q, heads[0]), make(seqlen_k, heads[1]), make(seqlen_k, heads[1])


@pytest.mark.parametrize("permuted", [False, True], ids=["contiguous", "permuted"])
def test_opcheck_fwd(device, permuted):
    q, k, v = qkv(device, permuted)
    slopes = torch.rand(4, device=device)
    for args in [(q, k, v, None, 0.0, 0.125, True, -1, -1, 0.0, False, None),
                 (q, k, v, slopes, 0.0, 0.1, False, 8, 3, 4.0, True, None)]:
        torch.library.opcheck(_ops.fwd, args, test_utils=OPCHECK_UTILS)
    # With dropout each call draws a new mask, so only the schema and the fake shapes compare.
    args = (q, k, v, None, 0.1, 0.125, True, -1, -1, 0.0, True, None)
    torch.library.opcheck(_ops.fwd, args, test_utils=("test_schema", "test_faketensor"))


@pytest.mark.parametrize("permuted", [False, True], ids=["contiguous", "permuted"])
def test_opcheck_varlen_fwd(device, permuted):
    q, k, v = qkv(device, permuted, batch=1, seqlen_q=60, seqlen_k=60)
    q, k, v = q[0], k[0], v[0]  # [total, heads, dim]; permuted keeps a head-major layout
    cu = torch.tensor([0, 30, 60], dtype=torch.int32, device=device)
    # Sequences of max_seqlen rows fill the whole batch: every row of out and softmax_lse is
    # written (flashkit leaves the rows past a sequence's length alone, and so would differ).
    args = (q, k, v, cu, cu, None, 30, 30, None, 0.0, 0.125, True, -1, -1, 0.0, False, None)
    torch.library.opcheck(_ops.varlen_fwd, args, test_utils=OPCHECK_UTILS)
    args = (q, k, v, cu, cu, None, 30, 30, None, 0.1, 0.125, True, -1, -1, 0.0, True, None)
    torch.library.opcheck(_ops.varlen_fwd, args, test_utils=("test_schema", "test_faketensor"))


@pytest.mark.parametrize("permuted", [False, True], ids=["contiguous", "permuted"])
def test_opcheck_bwd(device, permuted):
    if device == "cuda" and not flashkit.cuda_bwd_built(torch.bfloat16, 64):
        pytest.skip("this build has no CUDA backward kernel for bf16 head dim 64")
    q, k, v = qkv(device, permuted)
    dout = qkv(device, permuted)[0]
    for dropout_p in (0.0, 0.1):
        out, lse, rng_state, _ = _ops.fwd(q, k, v, None, dropout_p, 0.125, True, -1, -1, 0.0,
                                          False, None)
        args = (dout, q, k, v, out, lse, None, dropout_p, rng_state, 0.125, True, -1, -1, 0.0,
                True)
        torch.library.opcheck(_ops.bwd, args, test_utils=OPCHECK_UTILS)


@pytest.mark.parametrize("permuted", [False, True], ids=["contiguous", "permuted"])
def test_opcheck_varlen_bwd(device, permuted):
    if device == "cuda" and not flashkit.cuda_bwd_built(torch.bfloat16, 64):
        pytest.skip("this build has no CUDA backward kernel for bf16 head dim 64")
    q, k, v, dout = (t[0] for t in qkv(device, permuted, batch=1, seqlen_q=60, seqlen_k=60)
                     + qkv(device, permuted, batch=1, seqlen_q=60, seqlen_k=60)[:1])
    cu = torch.tensor([0, 30, 60], dtype=torch.int32, device=device)
    for dropout_p in (0.0, 0.1):
        out, lse, rng_state, _ = _ops.varlen_fwd(q, k, v, cu, cu, None, 30, 30, None, dropout_p,
                                                 0.125, True, -1, -1, 0.0, False, None)
        args = (dout, q, k, v, out, lse, cu, cu, None, 30, 30, None, dropout_p, rng_state, 0.125,
                True, -1, -1, 0.0, True)
        torch.library.opcheck(_ops.varlen_bwd, args, test_utils=OPCHECK_UTILS)


@pytest.mark.parametrize("dynamic", [False, True], ids=["static", "dynamic"])
def test_compile_fullgraph(device, dynamic):
    torch._dynamo.reset()

    def attention(q, k, v):
        return flash_attn_func(q, k, v, causal=True, window_size=(16, 0)) * 2

    compiled = torch.compile(attention, fullgraph=True, dynamic=dynamic)
    for seqlen in (31, 48):
        q, k, v = qkv(device, False, seqlen_q=seqlen, seqlen_k=seqlen)
        assert torch.equal(compiled(q, k, v), attention(q, k, v))


def test_compile_fullgraph_varlen(device):
    torch._dynamo.reset()

    def attention(q, k, v, cu, max_seqlen):
        out, lse, _ = flash_attn_varlen_func(q, k, v, cu, cu, max_seqlen, max_seqlen, causal=True,
                                             return_attn_probs=True)
        return out, lse

    compiled = torch.compile(attention, fullgraph=True, dynamic=True)
    q, k, v = (t[0] for t in qkv(device, False, batch=1, seqlen_q=50, seqlen_k=50))
    cu = torch.tensor([0, 13, 50], dtype=torch.int32, device=device)
    expected = attention(q, k, v, cu, 37)
    got = compiled(q, k, v, cu, 37)
    assert torch.equal(got[0], expected[0]) and torch.equal(got[1], expected[1])


@pytest.mark.skipif(not HAS_CUDA, reason=NO_GPU_REASON)
def test_cuda_graph_capture_and_replay():
    q, k, v = qkv("cuda", False)
    cu_q = torch.tensor([0, 10, 33], dtype=torch.int32, device="cuda")
    static = [t.clone() for t in (q, k, v)]
    flat = [t.flatten(0, 1)[:33].clone() for t in (q, k, v)]
    flash_attn_func(*static, causal=True)  # warm up outside the graph
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = flash_attn_func(*static, causal=True)
        out_varlen = flash_attn_varlen_func(*flat, cu_q, cu_q, 23, 23, causal=True)
    for seed in range(2):
        torch.manual_seed(seed)
        fresh = qkv("cuda", False)
        for dst, src in zip(static, fresh):
            dst.copy_(src)
        for dst, src in zip(flat, fresh):
            dst.copy_(src.flatten(0, 1)[:33])
        cu_q.copy_(torch.tensor([0, 20 + seed, 33], dtype=torch.int32))  # changed metadata
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, flash_attn_func(*fresh, causal=True))
        assert torch.equal(out_varlen, flash_attn_varlen_func(*flat, cu_q, cu_q, 23, 23,
                                                              causal=True))


@pytest.mark.skipif(not HAS_CUDA, reason=NO_GPU_REASON)
def test_non_default_stream():
    q, k, v = qkv("cuda", False)
    expected = flash_attn_func(q, k, v)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        got = flash_attn_func(q, k, v)
    torch.cuda.current_stream().wait_stream(stream)
    assert torch.equal(got, expected)


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA GPUs")
def test_second_device():
    q, k, v = qkv("cuda:1", False)
    out = flash_attn_func(q, k, v)
    assert out.device == torch.device("cuda:1")
    assert torch.equal(out.cpu(), flash_attn_func(q.cpu(), k.cpu(), v.cpu()))
