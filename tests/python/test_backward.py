"""Gradients through flashkit (autograd on the flashkit::bwd / varlen_bwd operators) against the
fp32 PyTorch reference, with the error-ratio rule for gradients (3x the input-dtype reference's
error): dtype x head dim (padded ones included) x masks x MHA/GQA/MQA, varlen, packed variants,
deterministic mode, torch.compile of a training step."""

from __future__ import annotations

import pytest
import torch

import flashkit
from conftest import padded_head_dim, poison_cuda_allocator, skip_unbuilt
from flashkit import (
    flash_attn_func,
    flash_attn_qkvpacked_func,
    flash_attn_varlen_func,
    flash_attn_varlen_kvpacked_func,
)
from reference import Options, attention_ref, check_close, rounding_slack
from test_forward import DTYPES, HEADS, make_options, pack, paged_cache, randn

GRAD_FACTOR = 3.0


def skip_unbuilt_bwd(device, dtype, head_dim):
    skip_unbuilt(device, dtype, head_dim)
    if device == "cuda" and not flashkit.cuda_bwd_built(dtype, padded_head_dim(head_dim)):
        pytest.skip(f"this build has no CUDA backward kernel for {dtype} head dim {head_dim}")


def reference_grads(q, k, v, dout, opts, upcast, stored_out=None):
    """(out, dq, dk, dv) of the reference on leaf copies of q, k, v.

    stored_out: the output the backward was handed (mha_bwd's `out`). The backward's formula
    dS = P (dP - D) takes D = rowsum(dO * out) from it, rounded as it is, where differentiating
    through the softmax uses the exact output; the gradients are then those of that formula. The
    difference dD_i is -dD_i * d(lse_i)/dS_ij = -dD_i P_ij on the scores, so it is the gradient of
    -sum_i dD_i lse_i, added to the loss. It is all of dq and dk where the exact ones vanish (a row
    with one visible key under dropout), and there the low-precision reference has no error."""
    leaves = [(t.float() if upcast else t).detach().cpu().requires_grad_() for t in (q, k, v)]
    cpu_opts = Options(**{**opts.__dict__})
    if opts.alibi_slopes is not None:
        cpu_opts.alibi_slopes = opts.alibi_slopes.cpu()
    out, lse = attention_ref(*leaves, cpu_opts, upcast=upcast)
    dout = dout.detach().cpu().to(out.dtype)
    loss = (out * dout).sum()
    if stored_out is not None:
        d_error = (dout * (stored_out.detach().cpu().float() - out.detach())).sum(-1).transpose(1, 2)
        loss = loss - (d_error * lse.masked_fill(torch.isinf(lse), 0.0)).sum()
    loss.backward()
    return (out, *(t.grad for t in leaves))


def check_grads(q, k, v, dout, opts, run):
    """Runs ``run(q, k, v)`` (leaf tensors requiring grad), backpropagates ``dout`` and checks
    out, dq, dk and dv against the references."""
    leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    poison_cuda_allocator(q.device.type)
    out = run(*leaves)
    out.backward(dout)
    ref = reference_grads(q, k, v, dout, opts, upcast=True, stored_out=out)
    lowp = reference_grads(q, k, v, dout, opts, upcast=False)
    check_close("out", out, ref[0], lowp[0], GRAD_FACTOR)
    for name, leaf, r, lp in zip(("dq", "dk", "dv"), leaves, ref[1:], lowp[1:]):
        assert leaf.grad.shape == leaf.shape and leaf.grad.dtype == leaf.dtype
        check_close(name, leaf.grad, r, lp, GRAD_FACTOR,
                    rounding_slack(q.shape[-1], 1.0 if name == "dq" else q.shape[1] / k.shape[1]))


@pytest.mark.parametrize("mask", ["none", "causal", "window", "softcap", "alibi"])
@pytest.mark.parametrize("head_dim", [40, 59, 64, 111, 128])
@pytest.mark.parametrize("dtype", DTYPES, ids=["fp16", "bf16"])
def test_grad_grid(device, dtype, head_dim, mask):
    skip_unbuilt_bwd(device, dtype, head_dim)
    seed = head_dim * 7 + len(mask)
    heads_q, heads_kv = HEADS[seed % len(HEADS)]
    seqlen_q, seqlen_k = [(61, 77), (77, 61), (128, 128)][seed % 3]
    q = randn((2, seqlen_q, heads_q, head_dim), dtype, device, seed)
    k = randn((2, seqlen_k, heads_kv, head_dim), dtype, device, seed + 1)
    v = randn((2, seqlen_k, heads_kv, head_dim), dtype, device, seed + 2)
    dout = randn((2, seqlen_q, heads_q, head_dim), dtype, device, seed + 3)
    opts = make_options(mask, heads_q, 2, device, seed)
    check_grads(q, k, v, dout, opts, lambda q, k, v: flash_attn_func(q, k, v, **opts.kwargs()))


@pytest.mark.parametrize("mask", ["none", "causal"])
def test_grad_varlen(device, mask):
    skip_unbuilt_bwd(device, torch.bfloat16, 64)
    dtype = torch.bfloat16
    lengths_q, lengths_k = [9, 0, 40, 23], [15, 3, 40, 0]
    qs = [randn((n, 4, 64), dtype, "cpu", 100 + b) for b, n in enumerate(lengths_q)]
    ks = [randn((n, 2, 64), dtype, "cpu", 200 + b) for b, n in enumerate(lengths_k)]
    vs = [randn((n, 2, 64), dtype, "cpu", 300 + b) for b, n in enumerate(lengths_k)]
    douts = [randn((n, 4, 64), dtype, "cpu", 400 + b) for b, n in enumerate(lengths_q)]
    q, cu_q = pack(qs)
    k, cu_k = pack(ks)
    v, _ = pack(vs)
    dout, _ = pack(douts)
    opts = Options(causal=mask == "causal")
    leaves = [t.to(device).requires_grad_() for t in (q, k, v)]
    out = flash_attn_varlen_func(*leaves, cu_q.to(device), cu_k.to(device), max(lengths_q),
                                 max(lengths_k), causal=opts.causal)
    out.backward(dout.to(device))
    grads = [leaf.grad.cpu() for leaf in leaves]
    for b in range(len(lengths_q)):
        rows_q = slice(int(cu_q[b]), int(cu_q[b + 1]))
        rows_k = slice(int(cu_k[b]), int(cu_k[b + 1]))
        ref = reference_grads(qs[b][None], ks[b][None], vs[b][None], douts[b][None], opts, True,
                              stored_out=out[rows_q][None])
        lowp = reference_grads(qs[b][None], ks[b][None], vs[b][None], douts[b][None], opts, False)
        check_close(f"out of sequence {b}", out[rows_q][None], ref[0], lowp[0], GRAD_FACTOR)
        for i, (name, rows) in enumerate((("dq", rows_q), ("dk", rows_k), ("dv", rows_k))):
            check_close(f"{name} of sequence {b}", grads[i][rows][None], ref[i + 1], lowp[i + 1],
                        GRAD_FACTOR, rounding_slack(q.shape[-1], 1.0 if i == 0 else
                                                    lengths_q[b] / max(lengths_k[b], 1)))


def test_grad_varlen_paged_kv(device):
    """Gradients through flash_attn_varlen_func's block_table reach the cache's pages: each
    sequence's rows against the reference, the pages no sequence reads zero."""
    skip_unbuilt_bwd(device, torch.bfloat16, 64)
    dtype = torch.bfloat16
    lengths_q, lengths_k = [9, 0, 40, 23], [15, 3, 40, 0]
    page_size = 16
    k_cache, v_cache, block_table, ks, vs = paged_cache(lengths_k, page_size, 2, 64, dtype, 600)
    qs = [randn((n, 4, 64), dtype, "cpu", 610 + b) for b, n in enumerate(lengths_q)]
    douts = [randn((n, 4, 64), dtype, "cpu", 620 + b) for b, n in enumerate(lengths_q)]
    q, cu_q = pack(qs)
    dout, _ = pack(douts)
    _, cu_k = pack(ks)
    leaves = [t.to(device).requires_grad_() for t in (q, k_cache, v_cache)]
    out = flash_attn_varlen_func(*leaves, cu_q.to(device), cu_k.to(device), max(lengths_q),
                                 max(lengths_k), causal=True, block_table=block_table.to(device))
    out.backward(dout.to(device))
    dq, dk_cache, dv_cache = (leaf.grad.cpu() for leaf in leaves)
    opts = Options(causal=True)
    read = torch.zeros(k_cache.shape[:2], dtype=torch.bool)
    for b in range(len(lengths_q)):
        rows_q = slice(int(cu_q[b]), int(cu_q[b + 1]))
        keys = torch.arange(lengths_k[b])
        pages, slots = block_table[b, keys // page_size].long(), keys % page_size
        read[pages, slots] = True
        ref = reference_grads(qs[b][None], ks[b][None], vs[b][None], douts[b][None], opts, True,
                              stored_out=out[rows_q][None])
        lowp = reference_grads(qs[b][None], ks[b][None], vs[b][None], douts[b][None], opts, False)
        slack = rounding_slack(64, lengths_q[b] / max(lengths_k[b], 1))
        check_close(f"dq of sequence {b}", dq[rows_q][None], ref[1], lowp[1], GRAD_FACTOR,
                    rounding_slack(64, 1.0))
        check_close(f"dk of sequence {b}", dk_cache[pages, slots][None], ref[2], lowp[2],
                    GRAD_FACTOR, slack)
        check_close(f"dv of sequence {b}", dv_cache[pages, slots][None], ref[3], lowp[3],
                    GRAD_FACTOR, slack)
    assert torch.all(dk_cache[~read] == 0) and torch.all(dv_cache[~read] == 0)


def test_grad_packed_matches_unpacked(device):
    skip_unbuilt_bwd(device, torch.float16, 64)
    qkv = randn((2, 30, 3, 4, 64), torch.float16, device, 500).requires_grad_()
    dout = randn((2, 30, 4, 64), torch.float16, device, 501)
    flash_attn_qkvpacked_func(qkv, causal=True).backward(dout)
    q, k, v = (t.detach().clone().requires_grad_() for t in qkv.unbind(2))
    flash_attn_func(q, k, v, causal=True).backward(dout)
    assert torch.equal(qkv.grad, torch.stack((q.grad, k.grad, v.grad), 2))

    cu = torch.tensor([0, 30, 60], dtype=torch.int32, device=device)
    q2 = q.detach().flatten(0, 1).requires_grad_()
    kv = qkv.detach()[:, :, 1:].flatten(0, 1).requires_grad_()
    flash_attn_varlen_kvpacked_func(q2, kv, cu, cu, 30, 30, causal=True).backward(
        dout.flatten(0, 1))
    assert torch.equal(q2.grad, q.grad.flatten(0, 1))
    assert torch.equal(kv.grad, torch.stack((k.grad, v.grad), 2).flatten(0, 1))


def test_deterministic_backward_is_bitwise_repeatable(device):
    skip_unbuilt_bwd(device, torch.bfloat16, 64)
    q, k, v = (randn((2, 90, 4, 64), torch.bfloat16, device, 600 + i) for i in range(3))
    dout = randn((2, 90, 4, 64), torch.bfloat16, device, 603)
    grads = []
    for _ in range(3):
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        flash_attn_func(*leaves, causal=True, deterministic=True).backward(dout)
        grads.append([leaf.grad for leaf in leaves])
    for other in grads[1:]:
        assert all(torch.equal(a, b) for a, b in zip(grads[0], other))


def test_lse_is_not_differentiable(device):
    skip_unbuilt_bwd(device, torch.bfloat16, 64)
    q = randn((1, 8, 2, 64), torch.bfloat16, device, 700).requires_grad_()
    out, lse, _ = flash_attn_func(q, q, q, return_attn_probs=True)
    assert out.requires_grad and not lse.requires_grad


def test_compiled_training_step(device):
    # The forward compiles with fullgraph=True; AOTAutograd traces the backward operator into the
    # compiled backward graph, which .backward() runs.
    skip_unbuilt_bwd(device, torch.bfloat16, 64)
    torch._dynamo.reset()

    def attention(q, k, v):
        return flash_attn_func(q, k, v, causal=True).float().square().sum()

    q, k, v = (randn((2, 40, 4, 64), torch.bfloat16, device, 800 + i) for i in range(3))
    grads = []
    for fn in (attention, torch.compile(attention, fullgraph=True)):
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        fn(*leaves).backward()
        grads.append([leaf.grad for leaf in leaves])
    assert all(torch.equal(a, b) for a, b in zip(*grads))


def test_grad_without_query_rows(device):
    """seqlen_q = 0: dq is empty and dk, dv are zeros. The gradient reaching the backward is an
    expanded empty tensor (stride 0), which the last-dim check must let through."""
    skip_unbuilt_bwd(device, torch.bfloat16, 64)
    q = randn((2, 0, 4, 64), torch.bfloat16, device, 700).requires_grad_()
    k, v = (randn((2, 9, 2, 64), torch.bfloat16, device, 701 + i).requires_grad_() for i in range(2))
    flash_attn_func(q, k, v, causal=True).sum().backward()
    assert q.grad.shape == q.shape
    assert torch.all(k.grad == 0) and torch.all(v.grad == 0)
