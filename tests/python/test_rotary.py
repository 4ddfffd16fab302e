"""flashkit.modules.apply_rotary_emb with flash_attn.layers.rotary's arguments, against a rotation
written token by token in complex fp64: both pair layouts, rotary_dim below head_dim, int and
per-sequence offsets, packed sequences, positions past the tables, in place, and the errors."""

from __future__ import annotations

import pytest
import torch

from flashkit.modules import apply_rotary_emb


def tables(rows, half, seed=0):
    angles = torch.rand(rows, half, generator=torch.Generator().manual_seed(seed)) * 6.3
    return angles.cos(), angles.sin()


def rotated_token(token, cos_row, sin_row, interleaved):
    """One token [heads, head_dim] rotated by one row of the tables (None: past them), in fp64."""
    out = token.double().clone()
    if cos_row is None:
        return out
    half = cos_row.shape[0]
    first, second = ((slice(0, 2 * half, 2), slice(1, 2 * half, 2)) if interleaved
                     else (slice(0, half), slice(half, 2 * half)))
    z = torch.complex(out[:, first], out[:, second]) * torch.complex(cos_row.double(),
                                                                      sin_row.double())
    out[:, first], out[:, second] = z.real, z.imag
    return out


def expected(x, cos, sin, interleaved, positions):
    """x's tokens (flattened over the token dims) each at its position in `positions`."""
    tokens = x.reshape(-1, *x.shape[-2:]).cpu()
    rows = [rotated_token(t, *((cos[p], sin[p]) if p < cos.shape[0] else (None, None)),
                          interleaved) for t, p in zip(tokens, positions)]
    return torch.stack(rows).view(x.shape)


@pytest.mark.parametrize("interleaved", [False, True])
@pytest.mark.parametrize("offsets", ["none", "int", "tensor"])
def test_padded_batch(device, interleaved, offsets):
    x = torch.randn(3, 11, 4, 64).to(torch.bfloat16)
    cos, sin = tables(40, 16)  # rotary_dim 32 of 64
    per_seq = torch.tensor([0, 5, 33])  # 33 + 11 > 40: its last three tokens past the tables
    seqlen_offsets = {"none": 0, "int": 7, "tensor": per_seq.to(device)}[offsets]
    out = apply_rotary_emb(x.to(device), cos.to(device), sin.to(device), interleaved,
                           seqlen_offsets=seqlen_offsets)
    start = {"none": [0] * 3, "int": [7] * 3, "tensor": per_seq.tolist()}[offsets]
    positions = [start[b] + s for b in range(3) for s in range(11)]
    ref = expected(x, cos, sin, interleaved, positions)
    assert out.dtype == x.dtype and out.shape == x.shape
    torch.testing.assert_close(out.cpu().double(), ref, atol=0.02, rtol=0.01)
    assert torch.equal(out[..., 32:].cpu(), x[..., 32:])


@pytest.mark.parametrize("interleaved", [False, True])
def test_packed_sequences_with_offsets(device, interleaved):
    lengths = [5, 0, 9, 1]
    cu = torch.tensor([0, 5, 5, 14, 15], dtype=torch.int32)
    x = torch.randn(15, 2, 32)
    cos, sin = tables(30, 16, seed=1)
    offsets = torch.tensor([3, 0, 20, 29], dtype=torch.int32)
    out = apply_rotary_emb(x.to(device), cos.to(device), sin.to(device), interleaved,
                           seqlen_offsets=offsets.to(device), cu_seqlens=cu.to(device),
                           max_seqlen=9)
    positions = [int(offsets[b]) + s for b, n in enumerate(lengths) for s in range(n)]
    torch.testing.assert_close(out.cpu().double(), expected(x, cos, sin, interleaved, positions),
                               atol=1e-5, rtol=1e-5)


def test_in_place_returns_x(device):
    x = torch.randn(2, 6, 3, 16, device=device)
    cos, sin = tables(6, 8, seed=2)
    copy = apply_rotary_emb(x, cos.to(device), sin.to(device))
    same = apply_rotary_emb(x, cos.to(device), sin.to(device), inplace=True)
    assert same is x and torch.equal(x, copy)


def test_gradient_is_the_inverse_rotation():
    x = torch.randn(1, 4, 2, 16, requires_grad=True)
    cos, sin = tables(4, 8, seed=3)
    grad = torch.randn(1, 4, 2, 16)
    apply_rotary_emb(x, cos, sin).backward(grad)
    # A rotation's adjoint is the rotation by the opposite angle.
    torch.testing.assert_close(x.grad, apply_rotary_emb(grad, cos, -sin), atol=1e-6, rtol=1e-6)


def test_errors():
    cos, sin = tables(8, 8)
    with pytest.raises(ValueError, match="need 10 rows of cos / sin; they have 8"):
        apply_rotary_emb(torch.randn(1, 6, 2, 16), cos, sin, seqlen_offsets=4)
    with pytest.raises(ValueError, match="rotary_dim .* is 16 but head_dim is 8"):
        apply_rotary_emb(torch.randn(1, 6, 2, 8), cos, sin)
    with pytest.raises(ValueError, match="with cu_seqlens"):
        apply_rotary_emb(torch.randn(6, 2, 16), cos, sin,
                         cu_seqlens=torch.tensor([0, 6], dtype=torch.int32))
