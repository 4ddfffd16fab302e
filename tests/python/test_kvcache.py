"""flash_attn_with_kvcache against an fp32 PyTorch reference written here (gather the cache, append,
rotate, attend) with the error-ratio rule of TESTING.md: contiguous and paged caches (randperm block
tables, page sizes that divide and do not divide the appends), appends crossing page boundaries and
filling the cache to its end, rotary interleaved and half-split with rotary_dim < head_dim,
cache_batch_idx, cache_leftpad, GQA / MQA, num_splits, the cache contents after the append; opcheck
of torch.ops.flashkit.fwd_kvcache, torch.compile(fullgraph=True) of a decode step, bad inputs."""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Optional, Tuple

import pytest
import torch

import flashkit
from conftest import HAS_CUDA, NO_GPU_REASON, poison_cuda_allocator
from flashkit import _ops, flash_attn_with_kvcache
from reference import Options, attention_ref, check_close


def skip_unbuilt_kvcache(device: str, dtype: torch.dtype, head_dim: int) -> None:
    if device == "cuda" and not flashkit.cuda_kvcache_built(dtype, (head_dim + 7) // 8 * 8):
        pytest.skip(f"this build has no CUDA decode kernel for {dtype} head dim {head_dim}")


@dataclass
class Case:
    """One call of flash_attn_with_kvcache and what its inputs look like."""

    batch: int = 3
    seqlen_q: int = 1
    seqlen_new: int = 1  # 0: no append
    heads: Tuple[int, int] = (4, 2)
    head_dim: int = 64
    dtype: torch.dtype = torch.bfloat16
    capacity: int = 70  # the cache rows of one sequence
    page_block_size: int = 0  # 0: a contiguous cache
    rotary: str = "none"  # "none", "interleaved", "half"
    rotary_dim: int = 0  # 0: head_dim
    batch_idx: bool = False
    leftpad: bool = False
    scalar_seqlens: bool = False
    lengths: Optional[Tuple[int, ...]] = None  # cache_seqlens; None: random
    num_splits: int = 0
    # "separate": K and V caches of their own, contiguous; "packed": the halves of one
    # [blocks, rows, 2, heads_kv, d] tensor (one layout for both); "v_padded": a V cache whose rows
    # hold one head more than it shows (strides of its own).
    cache_layout: str = "separate"
    opts: Options = field(default_factory=Options)
    seed: int = 0

    def cache_capacity(self) -> int:
        """The capacity flashkit sees: a paged cache holds whole pages."""
        page = self.page_block_size
        return -(-self.capacity // page) * page if page else self.capacity

    def __str__(self) -> str:
        """Every knob on one line: a fuzz failure names the whole drawn case."""
        opts = self.opts
        alibi = None if opts.alibi_slopes is None else list(opts.alibi_slopes.shape)
        cache = f"page {self.page_block_size}" if self.page_block_size else "contiguous"
        cache += f" {self.cache_layout}"
        return (f"seed {self.seed}: {self.dtype} d{self.head_dim} heads {self.heads[0]}/"
                f"{self.heads[1]} batch {self.batch} s_q {self.seqlen_q} new {self.seqlen_new} "
                f"capacity {self.capacity} {cache} rotary {self.rotary}/{self.rotary_dim} "
                f"batch_idx {self.batch_idx} leftpad {self.leftpad} scalar_seqlens "
                f"{self.scalar_seqlens} lengths {self.lengths} num_splits {self.num_splits} "
                f"causal {opts.causal} window {opts.window_size} softcap {opts.softcap} "
                f"alibi {alibi} scale {opts.softmax_scale}")


def randn(shape, dtype, device, gen):
    return torch.randn(shape, generator=gen).to(dtype).to(device)


def rotary_tables(case: Case, device):
    rotary_dim = case.rotary_dim or case.head_dim
    inv_freq = 1.0 / (10000 ** (torch.arange(0, rotary_dim, 2).float() / rotary_dim))
    seqlen_ro = case.cache_capacity()  # every position the cache can hold
    angles = torch.arange(seqlen_ro).float()[:, None] * inv_freq[None, :]
    return angles.cos().to(case.dtype).to(device), angles.sin().to(case.dtype).to(device)


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, positions: torch.Tensor,
           interleaved: bool, compute_dtype: torch.dtype) -> torch.Tensor:
    """x [tokens, heads, d] rotated to positions [tokens] in compute_dtype's arithmetic."""
    half = cos.shape[1]
    x = x.to(compute_dtype)
    c = cos[positions].to(compute_dtype)[:, None, :]
    s = sin[positions].to(compute_dtype)[:, None, :]
    if interleaved:
        x0, x1 = x[..., 0:2 * half:2], x[..., 1:2 * half:2]
    else:
        x0, x1 = x[..., :half], x[..., half:2 * half]
    r0, r1 = x0 * c - x1 * s, x0 * s + x1 * c
    rotated = (torch.stack([r0, r1], dim=-1).flatten(-2) if interleaved
               else torch.cat([r0, r1], dim=-1))
    return torch.cat([rotated, x[..., 2 * half:]], dim=-1)


@dataclass
class Inputs:
    q: torch.Tensor
    k_cache: torch.Tensor
    v_cache: torch.Tensor
    k: Optional[torch.Tensor]
    v: Optional[torch.Tensor]
    cos: Optional[torch.Tensor]
    sin: Optional[torch.Tensor]
    lengths: torch.Tensor  # int64 [batch], on the CPU
    leftpad: torch.Tensor  # int64 [batch], on the CPU
    rows: torch.Tensor  # the cache row (contiguous) of each sequence, int64 [batch]
    block_table: Optional[torch.Tensor]

    def kwargs(self, case: Case, device) -> dict:
        i32 = dict(dtype=torch.int32, device=device)
        seqlens = (int(self.lengths[0]) if case.scalar_seqlens
                   else self.lengths.to(**i32))
        opts = case.opts.kwargs()
        if case.opts.alibi_slopes is not None:  # a drawn case holds them on the CPU
            opts["alibi_slopes"] = case.opts.alibi_slopes.to(device)
        return dict(
            k=self.k, v=self.v, rotary_cos=self.cos, rotary_sin=self.sin, cache_seqlens=seqlens,
            cache_batch_idx=self.rows.to(**i32) if case.batch_idx else None,
            cache_leftpad=self.leftpad.to(**i32) if case.leftpad else None,
            block_table=self.block_table, rotary_interleaved=case.rotary == "interleaved",
            num_splits=case.num_splits, return_softmax_lse=True, **opts)


def make_inputs(case: Case, device) -> Inputs:
    gen = torch.Generator().manual_seed(case.seed)
    heads_q, heads_kv = case.heads
    d, n = case.head_dim, case.seqlen_new
    q = randn((case.batch, case.seqlen_q, heads_q, d), case.dtype, device, gen)
    if case.lengths is not None:
        lengths = torch.tensor(case.lengths)
    elif case.scalar_seqlens:
        lengths = torch.full((case.batch,), int(torch.randint(0, case.capacity - n + 1, (1,),
                                                              generator=gen)))
    else:
        lengths = torch.randint(0, case.capacity - n + 1, (case.batch,), generator=gen)
    leftpad = torch.zeros(case.batch, dtype=torch.int64)
    if case.leftpad:
        leftpad = (torch.rand(case.batch, generator=gen) * (lengths + 1)).long().clamp(max=lengths)
    rows = torch.arange(case.batch)
    block_table = None
    if case.page_block_size:
        pages_per_seq = -(-case.capacity // case.page_block_size)
        num_blocks = case.batch * pages_per_seq + 3  # a few pages nobody uses
        cache_shape = (num_blocks, case.page_block_size, heads_kv, d)
        block_table = (torch.randperm(num_blocks, generator=gen)[:case.batch * pages_per_seq]
                       .view(case.batch, pages_per_seq).to(torch.int32).to(device))
    else:
        batch_cache = case.batch + 2 if case.batch_idx else case.batch
        cache_shape = (batch_cache, case.capacity, heads_kv, d)
        if case.batch_idx:
            rows = torch.randperm(batch_cache, generator=gen)[:case.batch]
    k_cache = randn(cache_shape, case.dtype, device, gen)
    v_cache = randn(cache_shape, case.dtype, device, gen)
    if case.cache_layout == "packed":
        kv = torch.stack((k_cache, v_cache), dim=2)
        k_cache, v_cache = kv[:, :, 0], kv[:, :, 1]
    elif case.cache_layout == "v_padded":
        padded = randn(cache_shape[:2] + (heads_kv + 1, d), case.dtype, device, gen)
        padded[:, :, :heads_kv] = v_cache
        v_cache = padded[:, :, :heads_kv]
    k = v = None
    if n:
        k = randn((case.batch, n, heads_kv, d), case.dtype, device, gen)
        v = randn((case.batch, n, heads_kv, d), case.dtype, device, gen)
    cos = sin = None
    if case.rotary != "none":
        cos, sin = rotary_tables(case, device)
    return Inputs(q, k_cache, v_cache, k, v, cos, sin, lengths, leftpad, rows, block_table)


def sequence_cache(cache: torch.Tensor, inputs: Inputs, b: int) -> torch.Tensor:
    """The cache rows of sequence b, [capacity(-ish), heads_kv, d], a copy on the CPU."""
    cache = cache.cpu()
    if inputs.block_table is None:
        return cache[int(inputs.rows[b])].clone()
    pages = inputs.block_table[b].long().cpu()
    return cache[pages].flatten(0, 1).clone()


def reference(case: Case, inputs: Inputs, upcast: bool):
    """(out [b, s_q, h_q, d], lse [b, h_q, s_q], the (rotated) appended keys [b, n, h_kv, d]) in
    fp32 (upcast) or in the input dtype's arithmetic; the attention reads the appended keys rounded
    to the dtype, as the cache stores them, and the rotated queries rounded likewise, as the
    kernels hold them."""
    compute = torch.float32 if upcast else case.dtype
    n = case.seqlen_new
    interleaved = case.rotary == "interleaved"
    # As flash_attn's kvcache (kvcache_params.h): window sides are compared with the capacity, and
    # the queries are rotated token by token under a causal mask or a window left after that.
    limited = [side for side in case.opts.window_size if 0 <= side < case.cache_capacity()]
    rotary_q = case.opts.causal or bool(limited)
    outs, lses, new_keys = [], [], []
    for b in range(case.batch):
        length, pad = int(inputs.lengths[b]), int(inputs.leftpad[b])
        keys = sequence_cache(inputs.k_cache, inputs, b)
        values = sequence_cache(inputs.v_cache, inputs, b)
        q = inputs.q[b].cpu()
        if n:
            k_new = inputs.k[b].cpu()
            if inputs.cos is not None:
                positions = torch.arange(n) + length - pad
                k_new = rotate(k_new, inputs.cos.cpu(), inputs.sin.cpu(), positions, interleaved,
                               compute)
            new_keys.append(k_new)
            keys[length:length + n] = k_new.to(case.dtype)  # the cache stores the dtype
            values[length:length + n] = inputs.v[b].cpu()
        if inputs.cos is not None:
            positions = (torch.arange(case.seqlen_q) if rotary_q
                         else torch.zeros(case.seqlen_q, dtype=torch.int64)) + length - pad
            q = rotate(q, inputs.cos.cpu(), inputs.sin.cpu(), positions, interleaved,
                       compute).to(case.dtype)
        opts = replace(case.opts, window_limit=case.cache_capacity())
        if opts.alibi_slopes is not None and opts.alibi_slopes.dim() == 2:
            opts = replace(opts, alibi_slopes=opts.alibi_slopes[b])
        if opts.alibi_slopes is not None:
            opts = replace(opts, alibi_slopes=opts.alibi_slopes.cpu())
        out, lse = attention_ref(q[None].to(compute), keys[None, pad:length + n].to(compute),
                                 values[None, pad:length + n].to(compute), opts, upcast=upcast)
        outs.append(out[0])
        lses.append(lse[0])
    new_k = torch.stack(new_keys) if n else None
    return torch.stack(outs), torch.stack(lses), new_k


def run(case: Case, device: str) -> None:
    skip_unbuilt_kvcache(device, case.dtype, case.head_dim)
    inputs = make_inputs(case, device)
    k_cache_before = inputs.k_cache.clone()
    v_cache_before = inputs.v_cache.clone()
    before = Inputs(**{**inputs.__dict__, "k_cache": k_cache_before, "v_cache": v_cache_before})
    poison_cuda_allocator(device)
    out, lse = flash_attn_with_kvcache(inputs.q, inputs.k_cache, inputs.v_cache,
                                       **inputs.kwargs(case, device))
    assert out.shape == inputs.q.shape and out.dtype == case.dtype and out.device == inputs.q.device
    assert lse.shape == (case.batch, case.heads[0], case.seqlen_q) and lse.dtype == torch.float32
    out_ref, lse_ref, k_new_ref = reference(case, before, upcast=True)
    out_lowp, lse_lowp, k_new_lowp = reference(case, before, upcast=False)
    factor = 3.0 if case.opts.softcap > 0 or case.rotary != "none" else 2.0
    check_close("out", out, out_ref, out_lowp, factor)
    check_close("softmax_lse", lse, lse_ref, lse_lowp, factor)
    check_cache_after_append(case, before, inputs, k_new_ref, k_new_lowp)


def check_cache_after_append(case: Case, before: Inputs, after: Inputs, k_new_ref, k_new_lowp):
    """Element by element: the appended rows hold the (rotated) new keys and the new values, every
    other row of the cache (other sequences' rows, unused pages) is untouched."""
    k_expected, v_expected = before.k_cache.cpu().clone(), before.v_cache.cpu().clone()
    k_got, v_got = after.k_cache.cpu(), after.v_cache.cpu()
    appended = torch.zeros(k_expected.shape[:2], dtype=torch.bool)
    for b in range(case.batch if case.seqlen_new else 0):
        length = int(before.lengths[b])
        for i in range(case.seqlen_new):
            pos = length + i
            if before.block_table is None:
                at = (int(before.rows[b]), pos)
            else:
                page_size = case.page_block_size
                at = (int(before.block_table[b, pos // page_size]), pos % page_size)
            appended[at] = True
            if case.rotary == "none":
                assert torch.equal(k_got[at], before.k[b, i].cpu()), f"k_cache at {at}"
            else:
                check_close(f"k_cache at {at}", k_got[at], k_new_ref[b, i], k_new_lowp[b, i])
            assert torch.equal(v_got[at], before.v[b, i].cpu()), f"v_cache at {at}"
    for name, got, expected in (("k_cache", k_got, k_expected), ("v_cache", v_got, v_expected)):
        assert torch.equal(got[~appended], expected[~appended]), f"{name} changed elsewhere"


DTYPES = [torch.float16, torch.bfloat16]


@pytest.mark.parametrize("page_block_size", [0, 16, 5, 512],
                         ids=["contiguous", "page16", "page5", "page512"])
@pytest.mark.parametrize("rotary", ["none", "interleaved", "half"])
@pytest.mark.parametrize("dtype", DTYPES, ids=["fp16", "bf16"])
def test_append_rotary_paging(device, dtype, rotary, page_block_size):
    seed = ["none", "interleaved", "half"].index(rotary) * 3 + page_block_size
    run(Case(dtype=dtype, rotary=rotary, page_block_size=page_block_size, seqlen_q=2,
             seqlen_new=2, opts=Options(causal=True), seed=seed), device)


@pytest.mark.parametrize("head_dim", [40, 64, 128, 256])
@pytest.mark.parametrize("heads", [(4, 4), (8, 2), (16, 1)], ids=["mha", "gqa4", "mqa"])
def test_head_dims_and_groups(device, head_dim, heads):
    run(Case(heads=heads, head_dim=head_dim, seqlen_q=3, seqlen_new=3, rotary="half",
             rotary_dim=32, opts=Options(causal=True), seed=head_dim + heads[0]), device)


@pytest.mark.parametrize("seqlen_q", [1, 7, 16])
@pytest.mark.parametrize("heads", [(8, 1), (16, 2), (32, 8)], ids=["mqa", "gqa8", "gqa4"])
def test_seqlen_q_and_group_ratio(device, seqlen_q, heads):
    run(Case(batch=2, heads=heads, seqlen_q=seqlen_q, seqlen_new=seqlen_q, capacity=96,
             page_block_size=16, rotary="half", opts=Options(causal=True),
             seed=seqlen_q * 100 + heads[0]), device)


@pytest.mark.parametrize("rotary", ["interleaved", "half"])
def test_partial_rotary_dim(device, rotary):
    run(Case(head_dim=128, rotary=rotary, rotary_dim=48, seqlen_q=4, seqlen_new=4,
             page_block_size=16, seed=7), device)


@pytest.mark.parametrize("rotary", ["none", "half"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_rotary_query_position(device, rotary, causal):
    """Without a causal or local mask every query token sits at the first new position."""
    run(Case(rotary=rotary, seqlen_q=3, seqlen_new=3, opts=Options(causal=causal), seed=11),
        device)


@pytest.mark.parametrize("page_block_size", [16, 7, 1])
def test_append_crosses_pages_and_fills_cache(device, page_block_size):
    """Lengths whose appended rows straddle page boundaries, and one that fills the cache."""
    capacity = 64
    n = 5
    lengths = (14, capacity - n, 30)
    run(Case(page_block_size=page_block_size, capacity=capacity, seqlen_q=n, seqlen_new=n,
             lengths=lengths, rotary="interleaved", opts=Options(causal=True), seed=3), device)


@pytest.mark.parametrize("page_block_size", [0, 16], ids=["contiguous", "paged"])
def test_leftpad(device, page_block_size):
    run(Case(leftpad=True, page_block_size=page_block_size, seqlen_q=2, seqlen_new=2,
             rotary="half", opts=Options(causal=True), seed=5), device)


def test_cache_batch_idx(device):
    run(Case(batch_idx=True, seqlen_q=2, seqlen_new=2, rotary="interleaved",
             opts=Options(causal=True), seed=9), device)


def test_cache_batch_idx_leftpad_no_append(device):
    run(Case(batch_idx=True, leftpad=True, seqlen_new=0, seqlen_q=4, seed=13), device)


@pytest.mark.parametrize("num_splits", [1, 0, 3, 16])
@pytest.mark.parametrize("page_block_size", [0, 16], ids=["contiguous", "paged"])
def test_num_splits(device, num_splits, page_block_size):
    run(Case(batch=2, capacity=300, heads=(8, 2), num_splits=num_splits,
             page_block_size=page_block_size, seqlen_new=1, seed=17 + num_splits), device)


@pytest.mark.parametrize("layout", ["packed", "v_padded"])
@pytest.mark.parametrize("page_block_size", [0, 16, 5], ids=["contiguous", "page16", "page5"])
def test_cache_layouts(device, layout, page_block_size):
    """K and V caches of one strided layout (the paged kernel computes each row's offset once for
    both) and of two (each its own), read and appended to in place."""
    run(Case(cache_layout=layout, page_block_size=page_block_size, batch=2, capacity=300,
             seqlen_q=2, seqlen_new=2, rotary="half", num_splits=3, opts=Options(causal=True),
             seed=29), device)


@pytest.mark.parametrize("mask", ["window", "softcap", "alibi", "alibi_batch"])
def test_mask_options(device, mask):
    gen = torch.Generator().manual_seed(23)
    opts = Options()
    if mask == "window":
        opts.window_size = (20, 0)
    elif mask == "softcap":
        opts.softcap = 2.5
    else:
        shape = (4,) if mask == "alibi" else (3, 4)
        opts.alibi_slopes = (torch.rand(shape, generator=gen) * 0.3).to(device)
    run(Case(seqlen_q=3, seqlen_new=2, page_block_size=16, opts=opts, seed=29), device)


def test_no_append_scalar_seqlens_and_whole_cache(device):
    run(Case(seqlen_new=0, scalar_seqlens=True, seqlen_q=2, seed=31), device)
    case = Case(seqlen_new=0, seqlen_q=2, seed=37, lengths=(70, 70, 70))
    inputs = make_inputs(case, device)
    got = flash_attn_with_kvcache(inputs.q, inputs.k_cache, inputs.v_cache)
    out_ref = reference(case, inputs, upcast=True)[0]
    out_lowp = reference(case, inputs, upcast=False)[0]
    check_close("out (cache_seqlens=None)", got, out_ref, out_lowp)


def test_scalar_seqlens_with_append(device):
    run(Case(scalar_seqlens=True, seqlen_q=2, seqlen_new=2, page_block_size=16, rotary="half",
             opts=Options(causal=True), seed=41), device)


def test_return_values(device):
    case = Case(seqlen_new=0, seed=43)
    inputs = make_inputs(case, device)
    out = flash_attn_with_kvcache(inputs.q, inputs.k_cache, inputs.v_cache,
                                  cache_seqlens=inputs.lengths.to(torch.int32).to(device))
    assert isinstance(out, torch.Tensor) and out.shape == inputs.q.shape


def test_empty_sequence_gives_zeros_and_minus_inf(device):
    case = Case(seqlen_new=0, lengths=(0, 5, 0), seed=47)
    inputs = make_inputs(case, device)
    out, lse = flash_attn_with_kvcache(inputs.q, inputs.k_cache, inputs.v_cache,
                                       **inputs.kwargs(case, device))
    assert torch.equal(out[0].float().cpu(), torch.zeros_like(out[0], dtype=torch.float32).cpu())
    assert torch.isneginf(lse[0]).all() and torch.isneginf(lse[2]).all()
    assert torch.isfinite(lse[1]).all()


# Many query tokens against a contiguous cache, nothing appended (chunked prefill, speculative
# drafts): on compute capability 9.0 the sm90 forward runs these (src/api/kvcache_fwd_route.h);
# FLASHKIT_KVCACHE_PATH=decode keeps them on the decode kernel. Both against the reference, with an
# empty cache and one shorter than the queries (causal rows without keys) among the lengths.
@pytest.mark.parametrize("path", ["auto", "decode"])
@pytest.mark.parametrize("mask", ["none", "causal", "window", "softcap", "alibi"])
@pytest.mark.parametrize("head_dim", [64, 128, 256])
def test_many_query_tokens(device, monkeypatch, head_dim, mask, path):
    if path == "decode":
        if device != "cuda":
            pytest.skip("the path switch is the CUDA dispatcher's")
        monkeypatch.setenv("FLASHKIT_KVCACHE_PATH", "decode")
    opts = Options()
    if mask == "causal":
        opts.causal = True
    elif mask == "window":
        opts.window_size = (40, 0)
    elif mask == "softcap":
        opts.softcap, opts.causal = 2.5, True
    elif mask == "alibi":
        gen = torch.Generator().manual_seed(5)
        opts.alibi_slopes = (torch.rand((8,), generator=gen) * 0.3).to(device)
    run(Case(batch=3, seqlen_q=100, seqlen_new=0, heads=(8, 2), head_dim=head_dim, capacity=300,
             lengths=(300, 57, 0), opts=opts, seed=53), device)


def test_many_query_tokens_one_length(device):
    run(Case(batch=2, seqlen_q=64, seqlen_new=0, scalar_seqlens=True, heads=(8, 8), head_dim=128,
             capacity=200, opts=Options(causal=True), seed=59), device)


@pytest.mark.skipif(not HAS_CUDA, reason=NO_GPU_REASON)
def test_kvcache_path_switch(monkeypatch):
    case = Case(seqlen_q=40, seqlen_new=2, head_dim=128, seed=61)
    skip_unbuilt_kvcache("cuda", case.dtype, case.head_dim)
    inputs = make_inputs(case, "cuda")
    call = lambda: flash_attn_with_kvcache(inputs.q, inputs.k_cache, inputs.v_cache,
                                           **inputs.kwargs(case, "cuda"))
    monkeypatch.setenv("FLASHKIT_KVCACHE_PATH", "fast")
    with pytest.raises(RuntimeError, match="FLASHKIT_KVCACHE_PATH is 'fast'"):
        call()
    monkeypatch.setenv("FLASHKIT_KVCACHE_PATH", "sm90")  # an append: only the decode kernel does it
    with pytest.raises(RuntimeError, match="FLASHKIT_KVCACHE_PATH=sm90 but the sm90 forward cannot"):
        call()


# torch.ops.flashkit.fwd_kvcache as PyTorch sees it: the schema declares the cache mutation, the
# fake implementation gives the shapes, AOT dispatch handles the mutated inputs.
OPCHECK_UTILS = ("test_schema", "test_faketensor", "test_aot_dispatch_dynamic")


@pytest.mark.parametrize("permuted", [False, True], ids=["contiguous", "permuted"])
@pytest.mark.parametrize("paged", [False, True], ids=["contiguous_cache", "paged"])
def test_opcheck_fwd_kvcache(device, paged, permuted):
    skip_unbuilt_kvcache(device, torch.bfloat16, 64)
    case = Case(page_block_size=16 if paged else 0, seqlen_q=2, seqlen_new=2, rotary="half")
    inputs = make_inputs(case, device)
    if permuted:  # q, k, v in [batch, heads, seqlen, dim] memory viewed as [batch, seqlen, ...]
        inputs.q, inputs.k, inputs.v = (t.transpose(1, 2).contiguous().transpose(1, 2)
                                        for t in (inputs.q, inputs.k, inputs.v))
    kw = inputs.kwargs(case, device)
    args = (inputs.q, inputs.k_cache, inputs.v_cache, inputs.k, inputs.v, inputs.cos, inputs.sin,
            kw["cache_seqlens"], -1, None, None, inputs.block_table, None, 0.125, True, -1, -1,
            0.0, False, 1)
    torch.library.opcheck(_ops.fwd_kvcache, args, test_utils=OPCHECK_UTILS)
    no_append = (inputs.q, inputs.k_cache, inputs.v_cache, None, None, None, None, None, 40,
                 None, None, inputs.block_table, None, 0.125, False, -1, -1, 0.0, True, 0)
    torch.library.opcheck(_ops.fwd_kvcache, no_append, test_utils=OPCHECK_UTILS)


@pytest.mark.parametrize("dynamic", [False, True], ids=["static", "dynamic"])
def test_compile_fullgraph_decode_step(device, dynamic):
    """A decode step (append one rotated token to a paged cache, attend, advance the lengths)
    compiled with fullgraph=True gives the eager result and the same cache contents."""
    skip_unbuilt_kvcache(device, torch.bfloat16, 64)
    torch._dynamo.reset()

    def decode_step(q, k_cache, v_cache, k, v, cos, sin, seqlens, block_table):
        out = flash_attn_with_kvcache(q, k_cache, v_cache, k, v, cos, sin, seqlens,
                                      block_table=block_table, causal=True,
                                      rotary_interleaved=False)
        seqlens.add_(k.shape[1])
        return out * 2

    compiled = torch.compile(decode_step, fullgraph=True, dynamic=dynamic)
    case = Case(page_block_size=16, rotary="half", lengths=(3, 17, 40))
    eager_inputs = make_inputs(case, device)
    compiled_inputs = make_inputs(case, device)
    eager_seqlens = eager_inputs.lengths.to(torch.int32).to(device)
    compiled_seqlens = eager_seqlens.clone()
    for step in range(3):
        gen = torch.Generator().manual_seed(100 + step)
        q, k, v = (randn(t.shape, t.dtype, device, gen)
                   for t in (eager_inputs.q, eager_inputs.k, eager_inputs.v))
        expected = decode_step(q, eager_inputs.k_cache, eager_inputs.v_cache, k, v,
                               eager_inputs.cos, eager_inputs.sin, eager_seqlens,
                               eager_inputs.block_table)
        got = compiled(q, compiled_inputs.k_cache, compiled_inputs.v_cache, k, v,
                       compiled_inputs.cos, compiled_inputs.sin, compiled_seqlens,
                       compiled_inputs.block_table)
        assert torch.equal(got, expected), f"step {step}"
        assert torch.equal(compiled_seqlens, eager_seqlens)
    assert torch.equal(compiled_inputs.k_cache, eager_inputs.k_cache)
    assert torch.equal(compiled_inputs.v_cache, eager_inputs.v_cache)


@pytest.mark.skipif(not HAS_CUDA, reason=NO_GPU_REASON)
def test_cuda_graph_decode_step():
    """A decode step with a split workspace captured in a CUDA graph and replayed with new tokens
    and advanced lengths: nothing in the call synchronises or reads device memory on the host."""
    skip_unbuilt_kvcache("cuda", torch.bfloat16, 128)
    case = Case(batch=4, heads=(8, 2), head_dim=128, capacity=512, page_block_size=16,
                rotary="half", lengths=(5, 100, 300, 17), num_splits=4)
    graph_inputs = make_inputs(case, "cuda")
    eager_inputs = make_inputs(case, "cuda")
    seqlens = graph_inputs.lengths.to(torch.int32).cuda()
    q, k, v = (t.clone() for t in (graph_inputs.q, graph_inputs.k, graph_inputs.v))

    def step(q_, k_cache, v_cache, k_, v_, inputs, lengths):
        return flash_attn_with_kvcache(q_, k_cache, v_cache, k_, v_, inputs.cos, inputs.sin,
                                       lengths, block_table=inputs.block_table, causal=True,
                                       rotary_interleaved=False, num_splits=case.num_splits)

    warmup = torch.cuda.Stream()
    warmup.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(warmup):  # the first call's allocations, outside the graph
        step(q, graph_inputs.k_cache.clone(), graph_inputs.v_cache.clone(), k, v, graph_inputs,
             seqlens)
    torch.cuda.current_stream().wait_stream(warmup)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = step(q, graph_inputs.k_cache, graph_inputs.v_cache, k, v, graph_inputs, seqlens)
    eager_seqlens = seqlens.clone()
    for replay in range(3):
        gen = torch.Generator().manual_seed(200 + replay)
        fresh = [randn(t.shape, t.dtype, "cuda", gen) for t in (q, k, v)]
        for dst, src in zip((q, k, v), fresh):
            dst.copy_(src)
        graph.replay()
        expected = step(*fresh[:1], eager_inputs.k_cache, eager_inputs.v_cache, *fresh[1:],
                        eager_inputs, eager_seqlens)
        torch.cuda.synchronize()
        assert torch.equal(out, expected), f"replay {replay}"
        seqlens.add_(1)
        eager_seqlens.add_(1)
    assert torch.equal(graph_inputs.k_cache, eager_inputs.k_cache)
    assert torch.equal(graph_inputs.v_cache, eager_inputs.v_cache)


@pytest.mark.skipif(not HAS_CUDA, reason=NO_GPU_REASON)
def test_non_default_stream():
    skip_unbuilt_kvcache("cuda", torch.bfloat16, 64)
    case = Case(page_block_size=16, seqlen_new=1, num_splits=3, lengths=(10, 40, 60))
    expected_inputs, stream_inputs = make_inputs(case, "cuda"), make_inputs(case, "cuda")
    expected = flash_attn_with_kvcache(expected_inputs.q, expected_inputs.k_cache,
                                       expected_inputs.v_cache,
                                       **expected_inputs.kwargs(case, "cuda"))
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        got = flash_attn_with_kvcache(stream_inputs.q, stream_inputs.k_cache,
                                      stream_inputs.v_cache, **stream_inputs.kwargs(case, "cuda"))
    torch.cuda.current_stream().wait_stream(stream)
    assert torch.equal(got[0], expected[0]) and torch.equal(got[1], expected[1])
    assert torch.equal(stream_inputs.k_cache, expected_inputs.k_cache)


# Bad inputs: each raises with a message naming the argument, and the next call still works.
def bad_cases():
    i32 = torch.int32

    def paged(d):
        inputs = make_inputs(Case(page_block_size=16, seqlen_new=1, lengths=(3, 4, 5)), d)
        return inputs

    return {
        "block_table dtype": (paged, lambda i, d: dict(block_table=i.block_table.long()),
                              RuntimeError, r"block_table has dtype Long"),
        "block_table shape": (paged, lambda i, d: dict(block_table=i.block_table[:2]),
                              RuntimeError, r"block_table has shape \[2, 5\]"),
        "too few blocks": (paged, lambda i, d: dict(block_table=i.block_table[:, :1],
                                                    cache_seqlens=30),
                           RuntimeError, r"cache_seqlen"),
        "num_splits": (paged, lambda i, d: dict(num_splits=129), RuntimeError,
                       r"num_splits is 129; supported"),
        "rotary without k": (paged, lambda i, d: dict(k=None, v=None, rotary_cos=rotary_tables(
            Case(), d)[0], rotary_sin=rotary_tables(Case(), d)[1]), RuntimeError,
                             r"rotary_cos / rotary_sin are given without k_new"),
        "rotary_dim": (paged, lambda i, d: dict(rotary_cos=rotary_tables(Case(rotary_dim=24),
                                                                         d)[0][:, :12],
                                                rotary_sin=rotary_tables(Case(rotary_dim=24),
                                                                         d)[1][:, :12]),
                       RuntimeError, r"rotary_dim \(2 \* rotary_cos\.size\(1\)\) is 24"),
        "k without v": (paged, lambda i, d: dict(v=None), ValueError, r"k is given without v"),
        "k heads": (paged, lambda i, d: dict(k=i.k.repeat(1, 1, 2, 1), v=i.v.repeat(1, 1, 2, 1)),
                    RuntimeError, r"k_new has shape \[3, 1, 4, 64\]"),
        "cache_seqlens dtype": (paged, lambda i, d: dict(cache_seqlens=i.lengths.to(d)),
                                RuntimeError, r"cache_seqlens has dtype Long"),
        "batch_idx with pages": (paged, lambda i, d: dict(cache_batch_idx=torch.arange(
            3, dtype=i32, device=d)), RuntimeError, r"cache_batch_idx is given with a paged cache"),
        "cache dtype": (paged, lambda i, d: dict(k_cache=i.k_cache.half(),
                                                 v_cache=i.v_cache.half()), RuntimeError, r"k_cache\.dtype is float16"),
        "window pair": (paged, lambda i, d: dict(window_size=(1, 2, 3)), ValueError,
                        r"window_size is \(1, 2, 3\)"),
        # Written in place, so never copied: a strided last dim is refused, not made contiguous.
        "cache stride": (paged, lambda i, d: dict(k_cache=i.k_cache.repeat(1, 1, 1, 2)[..., ::2]),
                         RuntimeError, r"k_cache\.stride\(-1\) is 2; the last dim must be "
                                       r"contiguous"),
    }


BAD_CASES = bad_cases()


@pytest.mark.parametrize("case", list(BAD_CASES))
def test_bad_input(device, case):
    make, overrides, error, message = BAD_CASES[case]
    inputs = make(device)
    kwargs = dict(k=inputs.k, v=inputs.v,
                  cache_seqlens=inputs.lengths.to(torch.int32).to(device),
                  block_table=inputs.block_table)
    kwargs.update(overrides(inputs, device))
    k_cache = kwargs.pop("k_cache", inputs.k_cache)
    v_cache = kwargs.pop("v_cache", inputs.v_cache)
    with pytest.raises(error, match=message) as info:
        flash_attn_with_kvcache(inputs.q, k_cache, v_cache, **kwargs)
    assert "flash_attn_with_kvcache" in str(info.value) or "mha_fwd_kvcache" in str(info.value) \
        or "fwd_kvcache" in str(info.value)
    good = Case(page_block_size=16, seqlen_new=1, lengths=(3, 4, 5))
    run(good, device)


def test_cpu_checks_contents():
    """The CPU backend checks what the CUDA path takes on trust: a length past the cache."""
    inputs = make_inputs(Case(seqlen_new=1, lengths=(3, 4, 5)), "cpu")
    with pytest.raises(RuntimeError, match=r"cache_seqlens\[1\] is 70"):
        flash_attn_with_kvcache(inputs.q, inputs.k_cache, inputs.v_cache, inputs.k, inputs.v,
                                cache_seqlens=torch.tensor([3, 70, 5], dtype=torch.int32))


def test_rotary_dim_past_an_unpadded_head_dim(device):
    """Head dim 41 runs on copies padded to 48; rotary_dim 48 is still past the caller's 41."""
    inputs = make_inputs(Case(head_dim=41, seqlen_new=1, lengths=(3, 4, 5)), device)
    cos, sin = rotary_tables(Case(head_dim=48, rotary="half", rotary_dim=48), device)
    with pytest.raises(ValueError, match=r"rotary_dim \(2 \* rotary_cos\.shape\[1\]\) is 48 but "
                                         r"head_dim is 41"):
        flash_attn_with_kvcache(inputs.q, inputs.k_cache, inputs.v_cache, inputs.k, inputs.v,
                                rotary_cos=cos, rotary_sin=sin,
                                cache_seqlens=inputs.lengths.to(torch.int32).to(device))


def test_rotary_query_positions_past_the_tables(device, monkeypatch):
    """Under a causal mask query token i sits at L - P + i: four queries after one appended token
    of a full cache reach past the tables. A broken promise on CUDA (kvcache_params.h), reported
    with FLASHKIT_CHECK_KVCACHE=1 and otherwise kept inside the tables' memory; an error on the
    CPU, which always checks."""
    case = Case(seqlen_q=4, seqlen_new=1, rotary="half", opts=Options(causal=True),
                lengths=(69, 10, 20))  # capacity 70 = seqlen_ro; sequence 0 ends full
    inputs = make_inputs(case, device)

    def call():
        return flash_attn_with_kvcache(inputs.q, inputs.k_cache, inputs.v_cache,
                                       **inputs.kwargs(case, device))

    message = r"query token 3 of sequence 0 sits at position 72 .* 70 rows \(seqlen_ro\)"
    if device == "cpu":
        with pytest.raises(RuntimeError, match=message):
            call()
        return
    monkeypatch.setenv("FLASHKIT_CHECK_KVCACHE", "1")
    with pytest.raises(RuntimeError, match=message):
        call()
    monkeypatch.delenv("FLASHKIT_CHECK_KVCACHE")
    out, lse = call()
    assert torch.isfinite(out).all() and torch.isfinite(lse).all()
