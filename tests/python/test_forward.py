"""The forward functions against the fp32 PyTorch reference (error-ratio rule of TESTING.md): dtype x
head dim (including ones padded to a multiple of 8) x masks x MHA/GQA/MQA x lengths, fixed-length
and varlen; the packed variants against the unpacked ones; return values as flash_attn's."""

from __future__ import annotations

import pytest
import torch

from conftest import poison_cuda_allocator, skip_unbuilt
from flashkit import (
    flash_attn_func,
    flash_attn_kvpacked_func,
    flash_attn_qkvpacked_func,
    flash_attn_varlen_func,
    flash_attn_varlen_kvpacked_func,
    flash_attn_varlen_qkvpacked_func,
)
from reference import Options, attention_ref, check_close

DTYPES = [torch.float16, torch.bfloat16]
HEAD_DIMS = [8, 40, 59, 64, 96, 111, 128, 256]
MASKS = ["none", "causal", "window", "softcap", "alibi", "causal_alibi"]
HEADS = [(6, 6), (6, 2), (6, 1)]
# (seqlen_q, seqlen_k): both orders, ones, odd and block-straddling lengths.
LENGTHS = [(1, 1), (1, 239), (3, 17), (17, 3), (97, 113), (113, 97), (127, 128), (203, 339),
           (239, 1), (64, 0)]


def make_options(mask: str, heads_q: int, batch: int, device: str, seed: int) -> Options:
    gen = torch.Generator().manual_seed(seed)
    opts = Options()
    if mask in ("causal", "causal_alibi"):
        opts.causal = True
    if mask == "window":
        left, right = torch.randint(0, 64, (2,), generator=gen).tolist()
        opts.window_size = (left, right)
    if mask == "softcap":
        opts.softcap = 2.5
    if mask in ("alibi", "causal_alibi"):
        shape = (heads_q,) if seed % 2 == 0 else (batch, heads_q)
        opts.alibi_slopes = (torch.rand(shape, generator=gen) * 0.3).to(device)
    return opts


def randn(shape, dtype, device, seed):
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=gen).to(dtype).to(device)


def run_fixed(device, dtype, head_dim, mask, heads, seqlen_q, seqlen_k, batch=2, seed=0):
    skip_unbuilt(device, dtype, head_dim)
    heads_q, heads_kv = heads
    q = randn((batch, seqlen_q, heads_q, head_dim), dtype, device, seed)
    k = randn((batch, seqlen_k, heads_kv, head_dim), dtype, device, seed + 1)
    v = randn((batch, seqlen_k, heads_kv, head_dim), dtype, device, seed + 2)
    opts = make_options(mask, heads_q, batch, device, seed)
    poison_cuda_allocator(device)
    out, lse, s_dmask = flash_attn_func(q, k, v, return_attn_probs=True, **opts.kwargs())
    assert s_dmask is None
    assert out.shape == q.shape and out.dtype == dtype and out.device == q.device
    assert lse.shape == (batch, heads_q, seqlen_q) and lse.dtype == torch.float32
    out_ref, lse_ref = attention_ref(q, k, v, opts)
    out_lowp, lse_lowp = attention_ref(q, k, v, opts, upcast=False)
    factor = 3.0 if opts.softcap > 0 else 2.0
    check_close("out", out, out_ref, out_lowp, factor)
    check_close("softmax_lse", lse, lse_ref, lse_lowp, factor)


@pytest.mark.parametrize("mask", MASKS)
@pytest.mark.parametrize("head_dim", HEAD_DIMS)
@pytest.mark.parametrize("dtype", DTYPES, ids=["fp16", "bf16"])
def test_fwd_grid(device, dtype, head_dim, mask):
    index = HEAD_DIMS.index(head_dim) + len(HEAD_DIMS) * MASKS.index(mask)
    seqlen_q, seqlen_k = [(97, 113), (113, 97), (17, 203), (128, 128)][index % 4]
    run_fixed(device, dtype, head_dim, mask, HEADS[index % len(HEADS)], seqlen_q, seqlen_k,
              seed=index)


@pytest.mark.parametrize("mask", ["none", "causal", "window"])
@pytest.mark.parametrize("lengths", LENGTHS, ids=[f"{q}x{k}" for q, k in LENGTHS])
def test_fwd_lengths(device, lengths, mask):
    run_fixed(device, torch.bfloat16, 64, mask, (4, 2), *lengths, seed=sum(lengths))


def test_empty_rows_are_zero_with_lse_minus_inf(device):
    # causal with seqlen_q > seqlen_k: the first seqlen_q - seqlen_k rows see no key.
    q = randn((1, 9, 2, 64), torch.float16, device, 1)
    k = randn((1, 4, 2, 64), torch.float16, device, 2)
    out, lse, _ = flash_attn_func(q, k, k, causal=True, return_attn_probs=True)
    assert torch.all(out[:, :5] == 0)
    assert torch.all(lse[:, :, :5] == float("-inf"))
    assert torch.isfinite(lse[:, :, 5:]).all() and not torch.isnan(out).any()


def pack(tensors):
    """[sum of lengths, ...] and int32 prefix sums of a list of [len_b, ...] tensors."""
    lengths = [t.shape[0] for t in tensors]
    cu = torch.tensor([0] + lengths, dtype=torch.int32).cumsum(0).to(torch.int32)
    return torch.cat(tensors), cu


def on_device(opts: Options, device: str) -> Options:
    """opts with its ALiBi slopes (drawn on the CPU) on `device`."""
    moved = Options(**{**opts.__dict__})
    if opts.alibi_slopes is not None:
        moved.alibi_slopes = opts.alibi_slopes.to(device)
    return moved


def check_varlen_sequences(out, lse, cu_q, qs, ks, vs, opts):
    """A varlen call's out [total_q, ...] and softmax_lse [heads_q, total_q], sequence by sequence
    against the reference on sequence b's qs[b], ks[b], vs[b] (a window side compared with the
    longest key length, as flash_attn_varlen_func does; [batch, heads] ALiBi slopes by row)."""
    max_k = max(k.shape[0] for k in ks)
    for b in range(len(qs)):
        rows = slice(int(cu_q[b]), int(cu_q[b + 1]))
        seq_opts = Options(**{**opts.__dict__, "window_limit": max_k})
        if opts.alibi_slopes is not None and opts.alibi_slopes.dim() == 2:
            seq_opts.alibi_slopes = opts.alibi_slopes[b]
        ref, lse_ref = attention_ref(qs[b][None], ks[b][None], vs[b][None], seq_opts)
        lowp, lse_lowp = attention_ref(qs[b][None], ks[b][None], vs[b][None], seq_opts,
                                       upcast=False)
        factor = 3.0 if opts.softcap > 0 else 2.0
        check_close(f"out of sequence {b}", out[rows][None], ref, lowp, factor)
        check_close(f"softmax_lse of sequence {b}", lse[:, rows][None], lse_ref, lse_lowp, factor)


@pytest.mark.parametrize("mask", ["none", "causal", "window", "alibi", "softcap"])
@pytest.mark.parametrize("head_dim", [40, 64, 128])
@pytest.mark.parametrize("dtype", DTYPES, ids=["fp16", "bf16"])
def test_varlen(device, dtype, head_dim, mask):
    skip_unbuilt(device, dtype, head_dim)
    seed = head_dim + MASKS.index(mask)
    heads_q, heads_kv = HEADS[seed % len(HEADS)]
    lengths_q = [17, 0, 113, 1, 64]
    lengths_k = [33, 5, 97, 0, 64]
    qs = [randn((n, heads_q, head_dim), dtype, "cpu", seed + 10 * b) for b, n in
          enumerate(lengths_q)]
    ks = [randn((n, heads_kv, head_dim), dtype, "cpu", seed + 10 * b + 1) for b, n in
          enumerate(lengths_k)]
    vs = [randn((n, heads_kv, head_dim), dtype, "cpu", seed + 10 * b + 2) for b, n in
          enumerate(lengths_k)]
    opts = make_options(mask, heads_q, len(lengths_q), "cpu", seed)
    q, cu_q = pack(qs)
    k, cu_k = pack(ks)
    v, _ = pack(vs)
    device_opts = on_device(opts, device)
    poison_cuda_allocator(device)
    out, lse, _ = flash_attn_varlen_func(q.to(device), k.to(device), v.to(device), cu_q.to(device),
                                         cu_k.to(device), max(lengths_q), max(lengths_k),
                                         return_attn_probs=True, **device_opts.kwargs())
    assert out.shape == q.shape and lse.shape == (heads_q, q.shape[0])
    check_varlen_sequences(out, lse, cu_q, qs, ks, vs, opts)


def paged_cache(lengths_k, page_size, heads_kv, head_dim, dtype, seed):
    """A paged cache holding each sequence's keys and values on the pages of a shuffled block
    table, with spare pages no sequence uses: (k_cache, v_cache, block_table, ks, vs), ks[b] and
    vs[b] being sequence b's keys and values in order (CPU tensors)."""
    batch = len(lengths_k)
    pages_per_seq = max(-(-max(lengths_k) // page_size), 1)
    num_blocks = batch * pages_per_seq + 3
    gen = torch.Generator().manual_seed(seed)
    block_table = torch.randperm(num_blocks, generator=gen)[:batch * pages_per_seq]
    block_table = block_table.view(batch, pages_per_seq).to(torch.int32)
    k_cache = randn((num_blocks, page_size, heads_kv, head_dim), dtype, "cpu", seed + 1)
    v_cache = randn((num_blocks, page_size, heads_kv, head_dim), dtype, "cpu", seed + 2)

    def sequence(cache, b):
        keys = torch.arange(lengths_k[b])
        return cache[block_table[b, keys // page_size].long(), keys % page_size]

    ks = [sequence(k_cache, b) for b in range(batch)]
    vs = [sequence(v_cache, b) for b in range(batch)]
    return k_cache, v_cache, block_table, ks, vs


# Query lengths of the paged tests: "prefill" gathers the pages for the varlen kernels, "decode"
# (at most 16 per sequence) reads them in place on the decode kernel.
PAGED_QUERIES = {"prefill": [17, 0, 113, 1, 64], "decode": [1, 0, 16, 1, 5]}


@pytest.mark.parametrize("queries", list(PAGED_QUERIES))
@pytest.mark.parametrize("mask", ["none", "causal", "window", "alibi", "softcap"])
@pytest.mark.parametrize("page_size", [1, 3, 16, 256])
def test_varlen_paged_kv(device, page_size, mask, queries):
    """flash_attn_varlen_func with a block_table (flash_attn 2.6's paged KV): each sequence against
    the reference on the keys and values its pages hold."""
    dtype, head_dim, (heads_q, heads_kv) = torch.bfloat16, 64, (6, 2)
    skip_unbuilt(device, dtype, head_dim)
    seed = page_size + len(mask) + len(queries)
    lengths_q = PAGED_QUERIES[queries]
    lengths_k = [33, 5, 97, 0, 300]
    k_cache, v_cache, block_table, ks, vs = paged_cache(lengths_k, page_size, heads_kv, head_dim,
                                                        dtype, seed)
    qs = [randn((n, heads_q, head_dim), dtype, "cpu", seed + 10 * b) for b, n in
          enumerate(lengths_q)]
    q, cu_q = pack(qs)
    _, cu_k = pack(ks)
    opts = make_options(mask, heads_q, len(lengths_q), "cpu", seed)
    device_opts = on_device(opts, device)
    poison_cuda_allocator(device)
    out, lse, _ = flash_attn_varlen_func(
        q.to(device), k_cache.to(device), v_cache.to(device), cu_q.to(device), cu_k.to(device),
        max(lengths_q), max(lengths_k), return_attn_probs=True, block_table=block_table.to(device),
        **device_opts.kwargs())
    assert out.shape == q.shape and lse.shape == (heads_q, q.shape[0])
    check_varlen_sequences(out, lse, cu_q, qs, ks, vs, opts)


def test_varlen_matches_fixed_when_lengths_are_equal(device):
    q = randn((3, 50, 4, 64), torch.bfloat16, device, 3)
    k = randn((3, 70, 2, 64), torch.bfloat16, device, 4)
    v = randn((3, 70, 2, 64), torch.bfloat16, device, 5)
    cu_q = torch.arange(0, 151, 50, dtype=torch.int32, device=device)
    cu_k = torch.arange(0, 211, 70, dtype=torch.int32, device=device)
    fixed = flash_attn_func(q, k, v, causal=True)
    varlen = flash_attn_varlen_func(q.flatten(0, 1), k.flatten(0, 1), v.flatten(0, 1), cu_q, cu_k,
                                    50, 70, causal=True)
    assert torch.equal(varlen, fixed.flatten(0, 1))


@pytest.mark.parametrize("head_dim", [64, 59])
def test_packed_variants_match_unpacked(device, head_dim):
    skip_unbuilt(device, torch.float16, head_dim)
    qkv = randn((2, 37, 3, 4, head_dim), torch.float16, device, 7)
    q, k, v = qkv.unbind(2)
    expected = flash_attn_func(q, k, v, causal=True)
    assert torch.equal(flash_attn_qkvpacked_func(qkv, causal=True), expected)
    assert torch.equal(flash_attn_kvpacked_func(q, qkv[:, :, 1:], causal=True), expected)

    cu = torch.tensor([0, 37, 74], dtype=torch.int32, device=device)
    flat = qkv.flatten(0, 1)
    expected_varlen = flash_attn_varlen_func(*flat.unbind(1), cu, cu, 37, 37, causal=True)
    assert torch.equal(expected_varlen, expected.flatten(0, 1))
    assert torch.equal(flash_attn_varlen_qkvpacked_func(flat, cu, 37, causal=True),
                       expected_varlen)
    assert torch.equal(flash_attn_varlen_kvpacked_func(flat[:, 0], flat[:, 1:], cu, cu, 37, 37,
                                                       causal=True), expected_varlen)


def test_layout_invariance(device):
    # The same values through [batch, heads, seqlen, dim]-ordered memory give the same result.
    q = randn((2, 4, 45, 64), torch.bfloat16, device, 8).transpose(1, 2)
    k = randn((2, 4, 60, 64), torch.bfloat16, device, 9).transpose(1, 2)
    v = randn((2, 4, 60, 64), torch.bfloat16, device, 10).transpose(1, 2)
    assert not q.is_contiguous()
    assert torch.equal(flash_attn_func(q, k, v), flash_attn_func(q.contiguous(), k.contiguous(),
                                                                 v.contiguous()))


def misaligned_copy(x, offset):
    """x's values in a view `offset` elements into a fresh buffer (2 * offset bytes off the
    allocation's alignment for 16-bit types), with the same strides as a contiguous x."""
    buffer = torch.empty(x.numel() + offset, dtype=x.dtype, device=x.device)
    view = buffer[offset:].view(x.shape)
    view.copy_(x)
    return view


@pytest.mark.parametrize("offset", [1, 4])
def test_misaligned_views_run_on_copies(device, offset):
    """A view that is not on 16-byte boundaries (an odd storage offset; a row stride of 44
    elements, 88 bytes) is a valid flash_attn input: it gives the result of its contiguous copy,
    bit for bit, forward and backward, and the caller's tensors are left unchanged."""
    skip_unbuilt(device, torch.bfloat16, 64)
    q, k, v = (randn((2, 37, 4, 64), torch.bfloat16, device, 20 + i) for i in range(3))
    shifted = [misaligned_copy(x, offset).requires_grad_() for x in (q, k, v)]
    assert all(x.data_ptr() % 16 != 0 for x in shifted)
    plain = [x.clone().requires_grad_() for x in (q, k, v)]
    out = flash_attn_func(*shifted, causal=True)
    expected = flash_attn_func(*plain, causal=True)
    assert torch.equal(out, expected)
    dout = randn(out.shape, torch.bfloat16, device, 23)
    out.backward(dout)
    expected.backward(dout)
    for x, y, original in zip(shifted, plain, (q, k, v)):
        assert torch.equal(x.grad, y.grad)
        assert torch.equal(x.detach(), original)
    # Rows 88 bytes apart: head dim 40 (a multiple of 8) inside rows of 44 elements.
    wide = randn((1, 29, 2, 44), torch.bfloat16, device, 24)[..., :40]
    assert wide.stride(2) * 2 % 16 != 0
    expected = flash_attn_func(*(wide.contiguous(),) * 3)
    assert torch.equal(flash_attn_func(wide, wide, wide), expected)


def test_softmax_scale_default_uses_unpadded_head_dim(device):
    q = randn((1, 20, 2, 59), torch.float16, device, 11)
    k = randn((1, 20, 2, 59), torch.float16, device, 12)
    assert torch.equal(flash_attn_func(q, k, k), flash_attn_func(q, k, k, softmax_scale=59 ** -0.5))
    assert flash_attn_func(q, k, k).shape == q.shape


def test_return_values(device):
    q = randn((2, 5, 2, 32), torch.bfloat16, device, 13)
    out = flash_attn_func(q, q, q)
    assert isinstance(out, torch.Tensor)
    result = flash_attn_qkvpacked_func(torch.stack((q, q, q), 2), return_attn_probs=True)
    assert isinstance(result, tuple) and len(result) == 3 and result[2] is None


def test_varlen_window_sides_compare_with_max_seqlen_k(device):
    """A window side between a sequence's own key count and max_seqlen_k stays a window (as in
    flash_attn): with 40 queries on 5 keys, a right side of 10 hides every key from the first rows,
    where flash_attn_func on that sequence alone (seqlen_k 5) would drop the side."""
    skip_unbuilt(device, torch.bfloat16, 64)
    lengths_q, lengths_k = [40, 8], [5, 30]
    qs = [randn((n, 2, 64), torch.bfloat16, "cpu", 600 + b) for b, n in enumerate(lengths_q)]
    ks = [randn((n, 2, 64), torch.bfloat16, "cpu", 610 + b) for b, n in enumerate(lengths_k)]
    vs = [randn((n, 2, 64), torch.bfloat16, "cpu", 620 + b) for b, n in enumerate(lengths_k)]
    (q, cu_q), (k, cu_k), (v, _) = pack(qs), pack(ks), pack(vs)
    out, lse, _ = flash_attn_varlen_func(q.to(device), k.to(device), v.to(device), cu_q.to(device),
                                         cu_k.to(device), 40, 30, window_size=(-1, 10),
                                         return_attn_probs=True)
    # Row i of the first sequence sees keys j <= i + 5 - 40 + 10: none for i < 25.
    assert torch.all(out[:25] == 0) and torch.all(torch.isneginf(lse[:, :25]))
    opts = Options(window_size=(-1, 10), window_limit=30)
    for b in range(2):
        rows = slice(int(cu_q[b]), int(cu_q[b + 1]))
        ref, lse_ref = attention_ref(qs[b][None], ks[b][None], vs[b][None], opts)
        lowp, lse_lowp = attention_ref(qs[b][None], ks[b][None], vs[b][None], opts, upcast=False)
        check_close(f"out of sequence {b}", out[rows][None], ref, lowp)
        check_close(f"softmax_lse of sequence {b}", lse[:, rows][None], lse_ref, lse_lowp)
