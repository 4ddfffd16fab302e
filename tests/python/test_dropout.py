"""Dropout through the Python API. The mask that S_dmask reports is the one the kernels applied:
out and the gradients match the reference fed that mask (error-ratio rule), fixed-length and varlen,
over masks and GQA. The generator decides the mask (same seed, same bytes; the next call, a fresh
mask), the backward regenerates it from the forward's rng_state, and a CUDA graph draws a fresh
mask at each replay, as torch's own dropout does."""

from __future__ import annotations

import pytest
import torch

from conftest import HAS_CUDA, NO_GPU_REASON, poison_cuda_allocator
from flashkit import flash_attn_func, flash_attn_varlen_func
from reference import Options, check_close
from test_backward import GRAD_FACTOR, reference_grads, skip_unbuilt_bwd
from test_forward import DTYPES, make_options, pack, randn

P = 0.17


def kept(s_dmask: torch.Tensor, seqlen_q: int, seqlen_k: int) -> torch.Tensor:
    """bool [b, h, s_q, s_k]: the entries S_dmask does not mark as dropped (sign bit set)."""
    return ~torch.signbit(s_dmask[:, :, :seqlen_q, :seqlen_k])


def check_against_mask(q, k, v, dout, opts, out, grads, keep):
    """out and (dq, dk, dv) against the references that drop what `keep` drops."""
    opts = Options(**{**opts.__dict__, "dropout_p": P, "dropout_keep": keep.cpu()})
    ref = reference_grads(q, k, v, dout, opts, upcast=True, stored_out=out)
    lowp = reference_grads(q, k, v, dout, opts, upcast=False)
    check_close("out", out, ref[0], lowp[0], GRAD_FACTOR)
    for name, grad, r, lp in zip(("dq", "dk", "dv"), grads, ref[1:], lowp[1:]):
        check_close(name, grad, r, lp, GRAD_FACTOR)


@pytest.mark.parametrize("mask", ["none", "causal", "window", "alibi", "softcap"])
@pytest.mark.parametrize("dtype", DTYPES, ids=["fp16", "bf16"])
def test_out_and_grads_follow_the_returned_mask(device, dtype, mask):
    head_dim = 64 if mask != "window" else 40  # 40: padded to 48 for the kernel
    skip_unbuilt_bwd(device, dtype, head_dim)
    seed = 900 + len(mask)
    heads_q, heads_kv = (4, 2) if mask != "alibi" else (4, 1)
    seqlen_q, seqlen_k = (61, 77) if mask != "causal" else (77, 61)
    q = randn((2, seqlen_q, heads_q, head_dim), dtype, device, seed)
    k = randn((2, seqlen_k, heads_kv, head_dim), dtype, device, seed + 1)
    v = randn((2, seqlen_k, heads_kv, head_dim), dtype, device, seed + 2)
    dout = randn((2, seqlen_q, heads_q, head_dim), dtype, device, seed + 3)
    opts = make_options(mask, heads_q, 2, device, seed)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    poison_cuda_allocator(device)
    out, _, s_dmask = flash_attn_func(*leaves, dropout_p=P, return_attn_probs=True,
                                      **opts.kwargs())
    out.backward(dout)
    keep = kept(s_dmask, seqlen_q, seqlen_k)
    # Dropout really dropped some, and kept most: P = 0.17 over ~20k entries.
    fraction = keep.float().mean().item()
    assert 0.7 < fraction < 0.95, f"kept fraction {fraction}"
    check_against_mask(q, k, v, dout, opts, out, [t.grad for t in leaves], keep)


@pytest.mark.parametrize("mask", ["none", "causal"])
def test_varlen_follows_the_returned_mask(device, mask):
    skip_unbuilt_bwd(device, torch.bfloat16, 64)
    q_lens, k_lens = [37, 0, 70], [50, 9, 64]
    max_q, max_k = 70, 64

    def packed(lens, seed):
        return pack([randn((n, 4, 64), torch.bfloat16, device, seed + b)
                     for b, n in enumerate(lens)])

    (q, cu_q), (k, cu_k), (v, _), (dout, _) = (packed(q_lens, 950), packed(k_lens, 960),
                                                packed(k_lens, 970), packed(q_lens, 980))
    opts = Options(causal=mask == "causal")
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    out, _, s_dmask = flash_attn_varlen_func(*leaves, cu_q.to(device), cu_k.to(device), max_q,
                                             max_k, dropout_p=P, causal=opts.causal,
                                             return_attn_probs=True)
    out.backward(dout)
    assert s_dmask.shape == (3, 4, 128, 128)
    for b, (len_q, len_k) in enumerate(zip(q_lens, k_lens)):
        rows = slice(int(cu_q[b]), int(cu_q[b + 1]))
        keys = slice(int(cu_k[b]), int(cu_k[b + 1]))
        keep = kept(s_dmask[b:b + 1], len_q, len_k)
        one = [t[None, s] for t, s in ((q, rows), (k, keys), (v, keys), (dout, rows))]
        grads = [leaves[0].grad[rows], leaves[1].grad[keys], leaves[2].grad[keys]]
        check_against_mask(*one, opts, out[rows][None], [g[None] for g in grads], keep)


def test_the_generator_decides_the_mask(device):
    skip_unbuilt_bwd(device, torch.bfloat16, 64)
    q, k, v = (randn((1, 64, 2, 64), torch.bfloat16, device, 990 + i) for i in range(3))

    def draw():
        return flash_attn_func(q, k, v, dropout_p=P, return_attn_probs=True)

    torch.manual_seed(5)
    first, again = draw(), draw()
    torch.manual_seed(5)
    replayed = draw()
    assert torch.equal(first[0], replayed[0]) and torch.equal(first[2], replayed[2])
    assert not torch.equal(kept(first[2], 64, 64), kept(again[2], 64, 64))
    # Without return_attn_probs the same draw gives the same output.
    torch.manual_seed(5)
    assert torch.equal(flash_attn_func(q, k, v, dropout_p=P), first[0])


def test_dropout_zero_is_the_plain_kernel(device):
    q, k, v = (randn((2, 50, 2, 64), torch.bfloat16, device, 995 + i) for i in range(3))
    out, lse, s_dmask = flash_attn_func(q, k, v, dropout_p=0.0, causal=True,
                                        return_attn_probs=True)
    assert s_dmask is None
    assert torch.equal(out, flash_attn_func(q, k, v, causal=True))


@pytest.mark.skipif(not HAS_CUDA, reason=NO_GPU_REASON)
def test_cuda_graph_replays_draw_fresh_masks():
    skip_unbuilt_bwd("cuda", torch.bfloat16, 64)
    q, k, v = (randn((1, 64, 2, 64), torch.bfloat16, "cuda", 980 + i) for i in range(3))
    dout = randn((1, 64, 2, 64), torch.bfloat16, "cuda", 983)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    for leaf in leaves:
        leaf.grad = torch.zeros_like(leaf)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):  # warm up outside the graph, on a side stream
        flash_attn_func(*leaves, dropout_p=P, return_attn_probs=True)[0].backward(dout)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    for leaf in leaves:
        leaf.grad = None
    with torch.cuda.graph(graph):
        out, _, s_dmask = flash_attn_func(*leaves, dropout_p=P, return_attn_probs=True)
        out.backward(dout)
    masks = []
    for _ in range(2):
        graph.replay()
        torch.cuda.synchronize()
        keep = kept(s_dmask, 64, 64).clone()
        masks.append(keep)
        check_against_mask(q, k, v, dout, Options(), out, [t.grad for t in leaves], keep)
    assert not torch.equal(masks[0], masks[1])


def test_compiled_dropout_step(device):
    skip_unbuilt_bwd(device, torch.bfloat16, 64)
    torch._dynamo.reset()

    def attention(q, k, v):
        out, _, s_dmask = flash_attn_func(q, k, v, dropout_p=P, causal=True,
                                          return_attn_probs=True)
        return out, s_dmask

    q, k, v = (randn((2, 40, 4, 64), torch.bfloat16, device, 970 + i) for i in range(3))
    dout = randn((2, 40, 4, 64), torch.bfloat16, device, 973)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    out, s_dmask = torch.compile(attention, fullgraph=True)(*leaves)
    out.backward(dout)
    check_against_mask(q, k, v, dout, Options(causal=True), out, [t.grad for t in leaves],
                       kept(s_dmask, 40, 40))
