"""flash_attn's low-level functions (_flash_attn_forward / _backward and their varlen forms, which
ring and context-parallel attention libraries call): the same results as the public functions and
their autograd, gradients written into the caller's tensors, flash_attn's varlen LSE layout both
ways, and a ring-style merge of two key halves against the reference."""

from __future__ import annotations

import torch

from conftest import skip_unbuilt
from flashkit import flash_attn_func, flash_attn_varlen_func
from flashkit.flash_attn_interface import (_flash_attn_backward, _flash_attn_forward,
                                           _flash_attn_varlen_backward, _flash_attn_varlen_forward)
from reference import Options, attention_ref, check_close
from test_backward import skip_unbuilt_bwd
from test_forward import pack, randn

SCALE = 64 ** -0.5


def test_forward_matches_flash_attn_func(device):
    skip_unbuilt(device, torch.bfloat16, 64)
    q = randn((2, 70, 4, 64), torch.bfloat16, device, 1)
    k, v = (randn((2, 90, 2, 64), torch.bfloat16, device, s) for s in (2, 3))
    out, lse, s_dmask, _ = _flash_attn_forward(q, k, v, 0.0, SCALE, True, 16, -1, 0.0, None, False)
    expected, expected_lse, _ = flash_attn_func(q, k, v, causal=True, window_size=(16, -1),
                                                return_attn_probs=True)
    assert torch.equal(out, expected) and torch.equal(lse, expected_lse)
    assert s_dmask.numel() == 0


def test_backward_fills_the_callers_tensors(device):
    skip_unbuilt_bwd(device, torch.bfloat16, 64)
    q = randn((2, 70, 4, 64), torch.bfloat16, device, 4)
    k, v = (randn((2, 90, 2, 64), torch.bfloat16, device, s) for s in (5, 6))
    dout = randn((2, 70, 4, 64), torch.bfloat16, device, 7)
    out, lse, _, rng_state = _flash_attn_forward(q, k, v, 0.0, SCALE, True, -1, -1, 0.0, None,
                                                 False)
    dq, dk, dv = (torch.empty_like(t) for t in (q, k, v))
    softmax_d = _flash_attn_backward(dout, q, k, v, out, lse, dq, dk, dv, 0.0, SCALE, True, -1,
                                     -1, 0.0, None, True, rng_state)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    flash_attn_func(*leaves, causal=True, deterministic=True).backward(dout)
    for name, mine, leaf in zip(("dq", "dk", "dv"), (dq, dk, dv), leaves):
        assert torch.equal(mine, leaf.grad), name
    assert softmax_d.shape == (2, 4, 70)
    torch.testing.assert_close(softmax_d, (dout.float() * out.float()).sum(-1).transpose(1, 2))


def test_varlen_forward_and_backward_in_flash_attns_layout(device):
    skip_unbuilt_bwd(device, torch.bfloat16, 64)
    lengths_q, lengths_k = [17, 0, 40], [30, 4, 40]
    q, cu_q = pack([randn((n, 4, 64), torch.bfloat16, "cpu", 10 + b)
                    for b, n in enumerate(lengths_q)])
    k, cu_k = pack([randn((n, 2, 64), torch.bfloat16, "cpu", 20 + b)
                    for b, n in enumerate(lengths_k)])
    v, _ = pack([randn((n, 2, 64), torch.bfloat16, "cpu", 30 + b) for b, n in enumerate(lengths_k)])
    dout = randn(q.shape, torch.bfloat16, "cpu", 40)
    q, k, v, dout, cu_q, cu_k = (t.to(device) for t in (q, k, v, dout, cu_q, cu_k))
    args = (cu_q, cu_k, max(lengths_q), max(lengths_k))
    out, lse, _, rng_state = _flash_attn_varlen_forward(q, k, v, *args, 0.0, SCALE, True)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    expected, expected_lse, _ = flash_attn_varlen_func(*leaves, *args, causal=True,
                                                       deterministic=True, return_attn_probs=True)
    assert torch.equal(out, expected) and torch.equal(lse, expected_lse)
    assert lse.shape == (4, q.shape[0])
    expected.backward(dout)
    dq, dk, dv = (torch.zeros_like(t) for t in (q, k, v))
    softmax_d = _flash_attn_varlen_backward(dout, q, k, v, out, lse, dq, dk, dv, *args, 0.0, SCALE,
                                            True, -1, -1, 0.0, None, True, rng_state)
    for name, mine, leaf in zip(("dq", "dk", "dv"), (dq, dk, dv), leaves):
        assert torch.equal(mine, leaf.grad), name
    assert softmax_d.shape == (4, q.shape[0])


def test_ring_style_merge_of_two_key_halves(device):
    """What a ring-attention step does: attend to each half of the keys, merge by the LSEs."""
    skip_unbuilt(device, torch.bfloat16, 64)
    q = randn((2, 50, 4, 64), torch.bfloat16, "cpu", 50)
    k, v = (randn((2, 96, 4, 64), torch.bfloat16, "cpu", s) for s in (51, 52))
    parts = [_flash_attn_forward(q.to(device), k[:, half].to(device), v[:, half].to(device), 0.0,
                                 SCALE, False, -1, -1, 0.0, None, False)
             for half in (slice(0, 48), slice(48, 96))]
    (out1, lse1, _, _), (out2, lse2, _, _) = parts
    lse = torch.logaddexp(lse1, lse2)
    weight = lambda part_lse: (part_lse - lse).exp().transpose(1, 2)[..., None]  # noqa: E731
    merged = out1.float() * weight(lse1) + out2.float() * weight(lse2)
    ref, lse_ref = attention_ref(q, k, v, Options())
    lowp, lse_lowp = attention_ref(q, k, v, Options(), upcast=False)
    check_close("merged out", merged.cpu(), ref, lowp, 2.0)
    check_close("merged lse", lse.cpu(), lse_ref, lse_lowp, 2.0)
