"""Native sparse attention (flashkit.nsa) against a pure-PyTorch reference written here: the
selection turned into a dense boolean mask, softmax in float64 on the CPU, and a second reference in
the input dtype for the error-ratio rule of TESTING.md (2x for the forward, 3x for gradients).

nsa_selection_attn_func: out, softmax_lse, dq, dk, dv for fp16 / bf16, GQA ratios 1 / 4 / 16, head
dims 40 / 64 / 128 (and 36, padded), block sizes 16 / 32 / 64, causal and not, seqlen_q != seqlen_k
both ways, -1 padding, repeated blocks, out-of-range blocks (int32 and int64, past int32 too),
block_counts as a tensor (int32, int64) and as an int, tokens that select nothing; layouts; opcheck
of flashkit::nsa_fwd / nsa_bwd; torch.compile(fullgraph=True); bad input. native_sparse_attn_func
against the three branches composed from the same reference, gradients of every input included,
and its compressed branch over many alignments.
"""

from __future__ import annotations

import pytest
import torch

import flashkit
from conftest import padded_head_dim, poison_cuda_allocator
from flashkit import _ops, native_sparse_attn_func, nsa_selection_attn_func
from flashkit.nsa import _compressed_attention
from reference import check_close, rounding_slack

DTYPES = [torch.float16, torch.bfloat16]
FWD_FACTOR = 2.0
GRAD_FACTOR = 3.0
GQA = [(2, 2), (4, 1), (16, 1)]  # (heads_q, heads_kv): ratios 1, 4, 16
LENGTHS = [(50, 128), (128, 77), (64, 64)]  # (seqlen_q, seqlen_k)
COUNT_FORMS = ["none", "int32", "int64", "int"]


def skip_unbuilt_nsa(device, dtype, head_dim):
    if device == "cuda" and not flashkit.cuda_nsa_built(dtype, padded_head_dim(head_dim)):
        pytest.skip(f"this build has no CUDA native-sparse-attention kernel for {dtype} head dim "
                    f"{head_dim}")


def skip_unbuilt_attention(device, dtype, head_dim):
    """The compressed and sliding-window branches of native_sparse_attn_func run flash_attn_func."""
    padded = padded_head_dim(head_dim)
    if device == "cuda" and not (flashkit.cuda_fwd_built(dtype, padded)
                                 and flashkit.cuda_bwd_built(dtype, padded)):
        pytest.skip(f"this build has no CUDA attention kernels for {dtype} head dim {head_dim}")


def randn(shape, dtype, device, seed):
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=gen).to(dtype).to(device)


def num_blocks(seqlen_k, block_size):
    return -(-seqlen_k // block_size)


def random_selection(batch, seqlen_q, heads_kv, selected, blocks, seed):
    """int64 block_indices [b, s_q, h_kv, selected] drawn from [-1, blocks + 2): -1 padding,
    out-of-range blocks and repeats (few blocks, several slots) all occur; and int64 block_counts
    [b, s_q, h_kv] drawn from [-1, selected + 2) (clamped by the semantics). Token 0 of sequence 0
    selects nothing at all."""
    gen = torch.Generator().manual_seed(seed)
    indices = torch.randint(-1, blocks + 2, (batch, seqlen_q, heads_kv, selected), generator=gen)
    indices[0, 0] = -1
    counts = torch.randint(-1, selected + 2, (batch, seqlen_q, heads_kv), generator=gen)
    return indices, counts


# --- the reference -----------------------------------------------------------------------------

def selection_mask(block_indices, block_counts, block_size, seqlen_k, heads_q, causal):
    """bool [b, h_q, s_q, s_k] from nsa_params.h's rules: the set of blocks named by the first
    clamp(count, 0, selected) slots that lie in [0, num_blocks), each block's keys, minus (causal)
    the keys after i + seqlen_k - seqlen_q; repeated for the query heads of each kv head."""
    indices = block_indices.long().cpu()
    batch, seqlen_q, heads_kv, selected = indices.shape
    blocks = num_blocks(seqlen_k, block_size)
    if block_counts is None:
        counts = torch.full((batch, seqlen_q, heads_kv), selected)
    elif isinstance(block_counts, int):
        counts = torch.full((batch, seqlen_q, heads_kv), block_counts)
    else:
        counts = block_counts.long().cpu()
    in_use = torch.arange(selected) < counts.clamp(0, selected)[..., None]
    valid = in_use & (indices >= 0) & (indices < blocks)
    chosen = torch.zeros(batch, seqlen_q, heads_kv, blocks + 1, dtype=torch.bool)
    chosen.scatter_(-1, torch.where(valid, indices, blocks), True)  # the invalid: a spare column
    mask = chosen[..., torch.arange(seqlen_k) // block_size]  # [b, s_q, h_kv, s_k]
    if causal:
        i = torch.arange(seqlen_q)[:, None]
        j = torch.arange(seqlen_k)[None, :]
        mask &= (j <= i + seqlen_k - seqlen_q)[None, :, None, :]
    return mask.repeat_interleave(heads_q // heads_kv, dim=2).permute(0, 2, 1, 3)


def masked_attention_ref(q, k, v, mask, scale, upcast=True):
    """out [b, s_q, h_q, d] and lse [b, h_q, s_q] of attention restricted to mask
    [b or 1, h_q or 1, s_q, s_k], on the CPU. upcast: float64 throughout. Otherwise the second
    reference: scores and probabilities rounded to the input dtype, keys scaled. A row with no key
    gives zeros and an lse of -inf (and no gradient)."""
    dtype = q.dtype
    q, k, v = (t.cpu() for t in (q, k, v))
    if upcast:
        q, k, v = q.double(), k.double(), v.double()
    group = q.shape[2] // k.shape[2]
    k = k.repeat_interleave(group, dim=2)
    v = v.repeat_interleave(group, dim=2)
    scores = torch.einsum("bqhd,bkhd->bhqk", q, k * scale)
    if not upcast:
        scores = scores.float()
    mask = mask.cpu().expand(scores.shape)
    seen = mask.any(-1, keepdim=True)
    # Rows that see nothing get finite scores (then zero probabilities) so that no NaN appears in
    # the values or the gradients.
    scores = scores.masked_fill(~mask, float("-inf")).masked_fill(~seen, 0.0)
    lse = torch.logsumexp(scores, dim=-1).masked_fill(~seen[..., 0], float("-inf"))
    probs = torch.softmax(scores, dim=-1).masked_fill(~mask, 0.0)
    if not upcast:
        probs = probs.to(dtype)
    out = torch.einsum("bhqk,bkhd->bqhd", probs.to(v.dtype), v)
    return (out if upcast else out.to(dtype)), lse


def reference_grads(q, k, v, mask, scale, dout, upcast, stored_out=None):
    """(out, lse, dq, dk, dv) of masked_attention_ref on leaf copies. stored_out: the output the
    backward is handed; its D = rowsum(dout * out) replaces the exact one (see
    test_backward.reference_grads for why that is the gradient of loss - sum_i dD_i lse_i)."""
    leaves = [(t.double() if upcast else t).detach().cpu().requires_grad_() for t in (q, k, v)]
    out, lse = masked_attention_ref(*leaves, mask, scale, upcast)
    dout = dout.detach().cpu().to(out.dtype)
    loss = (out * dout).sum()
    if stored_out is not None:
        d_error = (dout * (stored_out.detach().cpu().to(out.dtype) - out.detach())).sum(-1)
        loss = loss - (d_error.transpose(1, 2) * lse.masked_fill(torch.isinf(lse), 0.0)).sum()
    grads = torch.autograd.grad(loss, leaves)
    return (out.detach(), lse.detach(), *grads)


def check_selection(q, k, v, dout, block_indices, block_size, block_counts, causal, scale=None,
                    run_indices=None, run_counts=None):
    """Runs nsa_selection_attn_func (on run_indices / run_counts when given: the same selection
    in another form) with autograd and checks out, softmax_lse, dq, dk and dv against the
    references. Returns (out, lse, dq, dk, dv) of flashkit."""
    heads_q, head_dim = q.shape[2], q.shape[3]
    scale = scale if scale is not None else head_dim ** -0.5
    leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    poison_cuda_allocator(q.device.type)
    out, lse = nsa_selection_attn_func(
        *leaves, block_indices if run_indices is None else run_indices, block_size=block_size,
        block_counts=block_counts if run_counts is None else run_counts, causal=causal,
        softmax_scale=scale, return_lse=True)
    assert out.shape == q.shape and out.dtype == q.dtype and out.device == q.device
    assert lse.shape == (q.shape[0], heads_q, q.shape[1]) and lse.dtype == torch.float32
    assert out.requires_grad and not lse.requires_grad
    grads = torch.autograd.grad(out, leaves, dout)
    mask = selection_mask(block_indices, block_counts, block_size, k.shape[1], heads_q, causal)
    ref = reference_grads(q, k, v, mask, scale, dout, upcast=True, stored_out=out)
    lowp = reference_grads(q, k, v, mask, scale, dout, upcast=False)
    check_close("out", out, ref[0], lowp[0], FWD_FACTOR)
    check_close("softmax_lse", lse, ref[1], lowp[1], FWD_FACTOR)
    rows_per_key = q.shape[1] / k.shape[1]
    for name, leaf, grad, r, lp in zip(("dq", "dk", "dv"), leaves, grads, ref[2:], lowp[2:]):
        assert grad.shape == leaf.shape and grad.dtype == leaf.dtype
        check_close(name, grad, r, lp, GRAD_FACTOR,
                    rounding_slack(head_dim, 1.0 if name == "dq" else rows_per_key))
    return (out, lse, *grads)


def counts_form(form, counts, selected, seed):
    """block_counts in the form a case passes: None, an int32 / int64 tensor, or an int."""
    if form == "none":
        return None
    if form == "int":
        return 1 + seed % selected
    return counts.to(torch.int32 if form == "int32" else torch.int64)


# --- the selection branch ------------------------------------------------------------------------

@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("block_size", [16, 32, 64])
@pytest.mark.parametrize("head_dim", [40, 64, 128])
@pytest.mark.parametrize("dtype", DTYPES, ids=["fp16", "bf16"])
def test_selection_grid(device, dtype, head_dim, block_size, causal):
    skip_unbuilt_nsa(device, dtype, head_dim)
    seed = head_dim + block_size + int(causal)
    index = [40, 64, 128].index(head_dim) + 3 * [16, 32, 64].index(block_size) + 9 * int(causal)
    heads_q, heads_kv = GQA[index % len(GQA)]
    seqlen_q, seqlen_k = LENGTHS[(index // 3) % len(LENGTHS)]
    form = COUNT_FORMS[index % len(COUNT_FORMS)]
    selected = 3 + index % 3
    q = randn((2, seqlen_q, heads_q, head_dim), dtype, device, seed)
    k = randn((2, seqlen_k, heads_kv, head_dim), dtype, device, seed + 1)
    v = randn((2, seqlen_k, heads_kv, head_dim), dtype, device, seed + 2)
    dout = randn((2, seqlen_q, heads_q, head_dim), dtype, device, seed + 3)
    indices, counts = random_selection(2, seqlen_q, heads_kv, selected,
                                       num_blocks(seqlen_k, block_size), seed)
    block_counts = counts_form(form, counts, selected, seed)
    if isinstance(block_counts, torch.Tensor):
        block_counts = block_counts.to(device)
    indices = indices.to(torch.int64 if form == "int64" else torch.int32).to(device)
    out, lse, dq, _, _ = check_selection(q, k, v, dout, indices, block_size, block_counts, causal)
    # Token 0 of sequence 0 selected nothing: zeros, -inf, no gradient.
    assert torch.all(out[0, 0] == 0) and torch.all(lse[0, :, 0] == float("-inf"))
    assert torch.all(dq[0, 0] == 0)


def test_selection_hand_picked(device):
    """Padding, repeats, blocks past the end and below -1, a short last block (seqlen_k 70 with
    blocks of 16), counts below 0 and above selected."""
    skip_unbuilt_nsa(device, torch.bfloat16, 64)
    q = randn((1, 6, 4, 64), torch.bfloat16, device, 30)
    k = randn((1, 70, 2, 64), torch.bfloat16, device, 31)
    v = randn((1, 70, 2, 64), torch.bfloat16, device, 32)
    dout = randn((1, 6, 4, 64), torch.bfloat16, device, 33)
    rows = [[[4, 4, -1, 4], [0, 5, 2, -7]],      # repeats; past the end (5 blocks: 0..4)
            [[-1, -1, -1, -1], [3, 3, 3, 3]],    # nothing; one block named four times
            [[2, 1, 0, 4], [1, 100, -1, 1]],
            [[4, 3, 2, 1], [0, 0, 1, 1]],
            [[0, 1, 2, 3], [4, 2, 0, 2]],
            [[1, -1, 3, 99], [2, 2, 2, 2]]]
    indices = torch.tensor([rows], dtype=torch.int32, device=device)
    counts = torch.tensor([[[4, 2], [4, 1], [-3, 9], [2, 0], [4, 4], [3, 4]]], dtype=torch.int32,
                          device=device)
    for block_counts in (None, counts):
        for causal in (False, True):
            check_selection(q, k, v, dout, indices, 16, block_counts, causal)


def test_nothing_selected_gives_zeros(device):
    """Every slot -1, or a count of 0, or (causal, seqlen_q > seqlen_k) every selected key in the
    future: zero output rows, an lse of -inf, and zero gradients for them and for every key."""
    skip_unbuilt_nsa(device, torch.float16, 64)
    q = randn((1, 20, 4, 64), torch.float16, device, 40).requires_grad_()
    k = randn((1, 16, 2, 64), torch.float16, device, 41).requires_grad_()
    v = randn((1, 16, 2, 64), torch.float16, device, 42).requires_grad_()
    cases = [(torch.full((1, 20, 2, 2), -1, dtype=torch.int32), None, False),
             (torch.zeros((1, 20, 2, 2), dtype=torch.int32), 0, False),
             (torch.zeros((1, 20, 2, 2), dtype=torch.int32), torch.zeros((1, 20, 2)), False)]
    for indices, counts, causal in cases:
        if isinstance(counts, torch.Tensor):
            counts = counts.to(torch.int32).to(device)
        out, lse = nsa_selection_attn_func(q, k, v, indices.to(device), block_size=16,
                                           block_counts=counts, causal=causal, return_lse=True)
        assert torch.all(out == 0) and torch.all(lse == float("-inf"))
        grads = torch.autograd.grad(out, (q, k, v), torch.ones_like(out))
        assert all(torch.all(g == 0) for g in grads)
    # causal, 20 queries over 16 keys: query i sees keys <= i - 4, so rows 0..3 see nothing.
    indices = torch.zeros((1, 20, 2, 1), dtype=torch.int32, device=device)
    out, lse = nsa_selection_attn_func(q, k, v, indices, block_size=16, causal=True,
                                       return_lse=True)
    assert torch.all(out[:, :4] == 0) and torch.all(lse[:, :, :4] == float("-inf"))
    assert torch.isfinite(lse[:, :, 4:]).all() and not torch.isnan(out).any()


def test_head_dim_padded(device):
    """A head dim that is not a multiple of 8 runs zero-padded, scaled by the unpadded one."""
    skip_unbuilt_nsa(device, torch.bfloat16, 36)
    q = randn((2, 33, 4, 36), torch.bfloat16, device, 50)
    k = randn((2, 48, 2, 36), torch.bfloat16, device, 51)
    v = randn((2, 48, 2, 36), torch.bfloat16, device, 52)
    dout = randn((2, 33, 4, 36), torch.bfloat16, device, 53)
    indices, counts = random_selection(2, 33, 2, 3, 3, 54)
    check_selection(q, k, v, dout, indices.to(device), 16, counts.to(device), True)


@pytest.mark.parametrize("shape", [(0, 5, 16), (1, 0, 16), (1, 5, 0)],
                         ids=["batch0", "seqlen_q0", "seqlen_k0"])
def test_empty_shapes(device, shape):
    """Nothing to do: empty outputs, or (no keys) zeros with an lse of -inf; zero gradients."""
    skip_unbuilt_nsa(device, torch.bfloat16, 64)
    batch, seqlen_q, seqlen_k = shape
    q = randn((batch, seqlen_q, 4, 64), torch.bfloat16, device, 55).requires_grad_()
    k = randn((batch, seqlen_k, 2, 64), torch.bfloat16, device, 56).requires_grad_()
    v = randn((batch, seqlen_k, 2, 64), torch.bfloat16, device, 57).requires_grad_()
    indices = torch.zeros((batch, seqlen_q, 2, 3), dtype=torch.int32, device=device)
    out, lse = nsa_selection_attn_func(q, k, v, indices, 16, return_lse=True)
    assert out.shape == q.shape and lse.shape == (batch, 4, seqlen_q)
    assert torch.all(out == 0) and torch.all(lse == float("-inf"))
    out.float().sum().backward()
    for leaf in (q, k, v):
        assert leaf.grad.shape == leaf.shape and torch.all(leaf.grad == 0)


def test_block_counts_forms_agree(device):
    """An int is the same count everywhere; int64 tensors are int32 ones; an int at or past
    `selected` is no block_counts at all; int64 values past int32 still select nothing."""
    skip_unbuilt_nsa(device, torch.bfloat16, 64)
    q = randn((2, 40, 4, 64), torch.bfloat16, device, 60)
    k = randn((2, 96, 2, 64), torch.bfloat16, device, 61)
    v = randn((2, 96, 2, 64), torch.bfloat16, device, 62)
    indices, _ = random_selection(2, 40, 2, 4, 3, 63)
    indices = indices.to(device)
    indices32 = indices.to(torch.int32)

    def run(idx, counts):
        return nsa_selection_attn_func(q, k, v, idx, block_size=32, block_counts=counts)

    full = torch.full((2, 40, 2), 2, dtype=torch.int32, device=device)
    assert torch.equal(run(indices32, 2), run(indices32, full))
    assert torch.equal(run(indices, full.long()), run(indices32, full))
    assert torch.equal(run(indices32, 4), run(indices32, None))
    assert torch.equal(run(indices32, 1000), run(indices32, None))
    assert torch.equal(run(indices32, -5), run(indices32, 0))
    assert torch.equal(run(indices32, full.long() + 2 ** 32), run(indices32, None))
    assert torch.equal(run(indices32, full.long() - 2 ** 32), run(indices32, 0))
    # 2^32 would wrap to block 0 in a plain int32 cast; it is out of range, as -1 is.
    wide = indices.masked_fill(indices == 0, 2 ** 32)
    assert torch.equal(run(wide, None), run(indices32.masked_fill(indices32 == 0, -1), None))
    wide = indices.masked_fill(indices == 1, -2 ** 32 + 1)
    assert torch.equal(run(wide, None), run(indices32.masked_fill(indices32 == 1, -1), None))


def test_layout_invariance(device):
    """Permuted q, k, v and block_indices / block_counts with a strided last dim give the result
    of their contiguous copies, forward and backward."""
    skip_unbuilt_nsa(device, torch.bfloat16, 64)
    q = randn((2, 4, 45, 64), torch.bfloat16, device, 70).transpose(1, 2)
    k = randn((2, 2, 60, 64), torch.bfloat16, device, 71).transpose(1, 2)
    v = randn((2, 2, 60, 64), torch.bfloat16, device, 72).transpose(1, 2)
    dout = randn((2, 4, 45, 64), torch.bfloat16, device, 73).transpose(1, 2)
    indices, counts = random_selection(2, 45, 2, 3, 4, 74)
    indices_t = indices.to(torch.int32).transpose(2, 3).contiguous().transpose(2, 3).to(device)
    counts_t = counts.to(torch.int32).transpose(1, 2).contiguous().transpose(1, 2).to(device)
    assert indices_t.stride(-1) != 1 and counts_t.stride(-1) != 1 and not q.is_contiguous()
    results = []
    for args in ((q, k, v, indices_t, counts_t),
                 (q.contiguous(), k.contiguous(), v.contiguous(), indices_t.contiguous(),
                  counts_t.contiguous())):
        leaves = [t.detach().clone().requires_grad_() for t in args[:3]]
        out = nsa_selection_attn_func(*leaves, args[3], block_size=16, block_counts=args[4])
        results.append((out, *torch.autograd.grad(out, leaves, dout)))
    assert_same_results(*results)


def assert_same_results(first, second):
    """(out, dq, dk, dv) of two calls on the same values: out and dq bit for bit (each query row's
    order of operations is fixed); dk and dv to the rounding of their fp32 sums, whose order the
    CUDA backward's atomics leave open (bit for bit on the CPU backend)."""
    for name, a, b in zip(("out", "dq", "dk", "dv"), first, second):
        if name in ("out", "dq") or a.device.type == "cpu":
            assert torch.equal(a, b), name
        else:
            torch.testing.assert_close(a, b, rtol=2 ** -7, atol=1e-5, msg=name)


def misaligned_copy(x, offset):
    buffer = torch.empty(x.numel() + offset, dtype=x.dtype, device=x.device)
    view = buffer[offset:].view(x.shape)
    view.copy_(x)
    return view


def test_misaligned_views_run_on_copies(device):
    """Views off 16-byte boundaries give their contiguous copies' results, bit for bit."""
    skip_unbuilt_nsa(device, torch.bfloat16, 64)
    q, k, v, dout = (randn((2, 37, 4, 64), torch.bfloat16, device, 80 + i) for i in range(4))
    indices, _ = random_selection(2, 37, 4, 3, 3, 84)
    indices = indices.to(torch.int32).to(device)
    results = []
    for tensors in ((q, k, v), tuple(misaligned_copy(x, 1) for x in (q, k, v))):
        leaves = [t.detach().clone().requires_grad_() for t in tensors]
        out = nsa_selection_attn_func(*leaves, indices, block_size=16)
        results.append((out, *torch.autograd.grad(out, leaves, dout)))
    assert_same_results(*results)


def test_no_grad_call_matches_autograd(device):
    skip_unbuilt_nsa(device, torch.float16, 64)
    q, k, v = (randn((1, 30, 2, 64), torch.float16, device, 90 + i) for i in range(3))
    indices, counts = random_selection(1, 30, 2, 2, 2, 93)
    indices, counts = indices.to(device), counts.to(device)
    plain = nsa_selection_attn_func(q, k, v, indices, 16, counts, return_lse=True)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    tracked = nsa_selection_attn_func(*leaves, indices, 16, counts, return_lse=True)
    assert not plain[0].requires_grad and tracked[0].requires_grad
    assert torch.equal(plain[0], tracked[0]) and torch.equal(plain[1], tracked[1])


def test_cuda_nsa_built_is_exported():
    assert isinstance(flashkit.cuda_nsa_built(torch.bfloat16, 64), bool)
    assert flashkit.cuda_nsa_built(torch.float32, 64) is False


# --- the operators as PyTorch sees them ----------------------------------------------------------

OPCHECK_UTILS = ("test_schema", "test_faketensor", "test_aot_dispatch_dynamic")


def op_inputs(device, permuted, seqlen_q=33, seqlen_k=47, heads=(4, 2), head_dim=64, selected=3,
              block_size=16):
    def make(seqlen, h, seed):
        if permuted:  # [batch, heads, seqlen, dim] memory viewed as [batch, seqlen, heads, dim]
            return randn((2, h, seqlen, head_dim), torch.bfloat16, device, seed).transpose(1, 2)
        return randn((2, seqlen, h, head_dim), torch.bfloat16, device, seed)
    q, k, v = make(seqlen_q, heads[0], 1), make(seqlen_k, heads[1], 2), make(seqlen_k, heads[1], 3)
    indices, counts = random_selection(2, seqlen_q, heads[1], selected,
                                       num_blocks(seqlen_k, block_size), 4)
    return q, k, v, indices.to(torch.int32).to(device), counts.to(torch.int32).to(device)


@pytest.mark.parametrize("permuted", [False, True], ids=["contiguous", "permuted"])
def test_opcheck_nsa_fwd(device, permuted):
    skip_unbuilt_nsa(device, torch.bfloat16, 64)
    q, k, v, indices, counts = op_inputs(device, permuted)
    for args in [(q, k, v, indices, None, 16, 0.125, True),
                 (q, k, v, indices, counts, 16, 0.1, False)]:
        torch.library.opcheck(_ops.nsa_fwd, args, test_utils=OPCHECK_UTILS)


@pytest.mark.parametrize("permuted", [False, True], ids=["contiguous", "permuted"])
def test_opcheck_nsa_bwd(device, permuted):
    skip_unbuilt_nsa(device, torch.bfloat16, 64)
    q, k, v, indices, counts = op_inputs(device, permuted)
    dout = op_inputs(device, permuted)[0].flip(1)
    for block_counts, causal in ((None, True), (counts, False)):
        out, lse = _ops.nsa_fwd(q, k, v, indices, block_counts, 16, 0.125, causal)
        args = (dout, q, k, v, indices, block_counts, 16, out, lse, 0.125, causal)
        torch.library.opcheck(_ops.nsa_bwd, args, test_utils=OPCHECK_UTILS)


@pytest.mark.parametrize("dynamic", [False, True], ids=["static", "dynamic"])
def test_compile_fullgraph(device, dynamic):
    skip_unbuilt_nsa(device, torch.bfloat16, 64)
    torch._dynamo.reset()

    def attention(q, k, v, indices, counts):
        out, lse = nsa_selection_attn_func(q, k, v, indices, block_size=16, block_counts=counts,
                                           return_lse=True)
        return out * 2, lse

    compiled = torch.compile(attention, fullgraph=True, dynamic=dynamic)
    for seqlen in (31, 48):
        q, k, v, indices, counts = op_inputs(device, False, seqlen_q=seqlen, seqlen_k=seqlen)
        for c in (counts, counts.long(), 2, None):
            got, expected = compiled(q, k, v, indices.long(), c), attention(q, k, v, indices, c)
            assert torch.equal(got[0], expected[0]) and torch.equal(got[1], expected[1])


def test_compiled_training_step(device):
    skip_unbuilt_nsa(device, torch.bfloat16, 64)
    torch._dynamo.reset()

    def loss(q, k, v, indices):
        return nsa_selection_attn_func(q, k, v, indices, block_size=16).float().square().sum()

    q, k, v, indices, _ = op_inputs(device, False)
    grads = []
    for fn in (loss, torch.compile(loss, fullgraph=True)):
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        fn(*leaves, indices).backward()
        grads.append([leaf.grad for leaf in leaves])
    assert all(torch.equal(a, b) for a, b in zip(*grads))


# --- bad input -----------------------------------------------------------------------------------

def good_call(device):
    q, k, v, indices, counts = op_inputs(device, False)
    assert torch.isfinite(nsa_selection_attn_func(q, k, v, indices, 16, counts)).all()


BAD_CASES = {
    "block_size": (dict(block_size=24), r"nsa_fwd: block_size is 24; supported: a multiple of 16 "
                                        r"from 16 to 256"),
    "block_indices dtype": (dict(indices_dtype=torch.float32),
                            r"block_indices\.dtype is float32; it must be int32"),
    "block_indices shape": (dict(indices_heads=4), r"block_indices has shape \[2, 33, 4, 3\]; "
                                                   r"expected \[2, 33, 2, 3\]"),
    "no slots": (dict(slots=0), r"block_indices\.size\(3\) \(selected\) is 0; supported: 1 to "
                                r"256"),
    "block_counts shape": (dict(counts_heads=4), r"block_counts has shape \[2, 33, 4\]; "
                                                 r"expected \[2, 33, 2\]"),
    "q dtype": (dict(q_dtype=torch.float32), r"q\.dtype is float32; supported: float16, "
                                             r"bfloat16"),
}


@pytest.mark.parametrize("case", list(BAD_CASES))
def test_bad_input(device, case):
    options, message = BAD_CASES[case]
    q, k, v, indices, counts = op_inputs(device, False)
    if "indices_dtype" in options:
        indices = indices.to(options["indices_dtype"])
    if "indices_heads" in options:
        indices = indices.repeat(1, 1, 2, 1)
    if "slots" in options:
        indices = indices[..., :options["slots"]]
    if "counts_heads" in options:
        counts = counts.repeat(1, 1, 2)
    if "q_dtype" in options:
        q, k, v = q.float(), k.float(), v.float()
    with pytest.raises(RuntimeError, match=message):
        nsa_selection_attn_func(q, k, v, indices, options.get("block_size", 16), counts)
    good_call(device)


def test_bad_python_arguments():
    q, k, v, indices, _ = op_inputs("cpu", False)
    with pytest.raises(RuntimeError, match=r"q has shape \[33, 4, 64\]; expected 4 dims"):
        nsa_selection_attn_func(q[0], k, v, indices)
    with pytest.raises(ValueError, match=r"softmax_scale is 0\.0"):
        nsa_selection_attn_func(q, k, v, indices, softmax_scale=0.0)
    gates = torch.rand(2, 33, 4)
    with pytest.raises(ValueError, match=r"g_swa has shape \[2, 33\]"):
        native_sparse_attn_func(q, k, v, k, v, gates, gates, gates[..., 0], indices, 16)
    with pytest.raises(ValueError, match=r"window_size is 0"):
        native_sparse_attn_func(q, k, v, k, v, gates, gates, gates, indices, 16, window_size=0)
    with pytest.raises(ValueError, match=r"native_sparse_attn_func: block_counts is True"):
        native_sparse_attn_func(q, k, v, k, v, gates, gates, gates, indices, 16,
                                block_counts=True)


# --- native_sparse_attn_func ---------------------------------------------------------------------

def compressed_mask(seqlen_q, seqlen_k, seqlen_cmp, block, stride):
    """bool [s_q, s_cmp]: compressed key c (keys [c * stride, c * stride + block)) is visible to
    query i at position i + seqlen_k - seqlen_q when its whole block lies at or before it."""
    i = torch.arange(seqlen_q)[:, None]
    c = torch.arange(seqlen_cmp)[None, :]
    return c * stride + block - 1 <= i + seqlen_k - seqlen_q


def window_mask(seqlen_q, seqlen_k, window):
    i = torch.arange(seqlen_q)[:, None] + seqlen_k - seqlen_q
    j = torch.arange(seqlen_k)[None, :]
    return (j <= i) & (j > i - window)


def native_ref(tensors, indices, counts, block_size, window, block, stride, scale, upcast,
               stored=None):
    """o of native sparse attention composed from masked_attention_ref, and the gradients of
    (o * dout).sum() for every input. stored: flashkit's three branch outputs, whose D each
    backward takes (reference_grads' correction, one per branch)."""
    dtype = tensors[0].dtype
    q, k, v, k_cmp, v_cmp, g_cmp, g_slc, g_swa, dout = (t.detach().cpu() for t in tensors)
    leaves = [(t.double() if upcast else t).requires_grad_()
              for t in (q, k, v, k_cmp, v_cmp, g_cmp, g_slc, g_swa)]
    q_, k_, v_, kc_, vc_, gc_, gs_, gw_ = leaves
    seqlen_q, heads_q, seqlen_k = q.shape[1], q.shape[2], k.shape[1]
    masks = [compressed_mask(seqlen_q, seqlen_k, k_cmp.shape[1], block, stride),
             selection_mask(indices, counts, block_size, seqlen_k, heads_q, True),
             window_mask(seqlen_q, seqlen_k, window)]
    branches = [masked_attention_ref(q_, kc_, vc_, masks[0], scale, upcast),
                masked_attention_ref(q_, k_, v_, masks[1], scale, upcast),
                masked_attention_ref(q_, k_, v_, masks[2], scale, upcast)]
    o = sum(g[..., None] * out for g, (out, _) in zip((gc_, gs_, gw_), branches))
    o = o if upcast else o.to(dtype)
    loss = (o * dout.to(o.dtype)).sum()
    if stored is not None:
        for g, (out, lse), mine in zip((gc_, gs_, gw_), branches, stored):
            branch_dout = (g[..., None] * dout.to(g.dtype)).detach()
            d_error = (branch_dout * (mine.detach().cpu().to(out.dtype) - out.detach())).sum(-1)
            loss = loss - (d_error.transpose(1, 2) * lse.masked_fill(torch.isinf(lse), 0.0)).sum()
    return (o.detach(), *torch.autograd.grad(loss, leaves))


NATIVE_CASES = [
    # seqlen_q, seqlen_k, seqlen_cmp, compress block, stride, block_size, window, heads
    (96, 96, 6, 16, 16, 16, 32, (4, 1)),      # FLA's layout: compression blocks = selection ones
    (96, 96, 11, 32, 8, 32, 20, (2, 2)),      # overlapping compression blocks
    (40, 100, 12, 16, 8, 16, 24, (4, 2)),     # queries at the end of the keys
    (70, 50, 9, 8, 8, 16, 16, (2, 1)),        # more queries than keys: early ones see nothing
]


@pytest.mark.parametrize("case", range(len(NATIVE_CASES)))
@pytest.mark.parametrize("dtype", DTYPES, ids=["fp16", "bf16"])
def test_native_sparse_attention(device, dtype, case):
    seqlen_q, seqlen_k, seqlen_cmp, block, stride, block_size, window, heads = NATIVE_CASES[case]
    head_dim = 64 if case % 2 == 0 else 40
    skip_unbuilt_nsa(device, dtype, head_dim)
    skip_unbuilt_attention(device, dtype, head_dim)
    heads_q, heads_kv = heads
    seed = 1000 + 10 * case
    q = randn((2, seqlen_q, heads_q, head_dim), dtype, device, seed)
    k = randn((2, seqlen_k, heads_kv, head_dim), dtype, device, seed + 1)
    v = randn((2, seqlen_k, heads_kv, head_dim), dtype, device, seed + 2)
    k_cmp = randn((2, seqlen_cmp, heads_kv, head_dim), dtype, device, seed + 3)
    v_cmp = randn((2, seqlen_cmp, heads_kv, head_dim), dtype, device, seed + 4)
    g_cmp, g_slc, g_swa = (torch.sigmoid(randn((2, seqlen_q, heads_q), torch.float32, device,
                                               seed + 5 + i)) for i in range(3))
    dout = randn((2, seqlen_q, heads_q, head_dim), dtype, device, seed + 8)
    indices, counts = random_selection(2, seqlen_q, heads_kv, 3,
                                       num_blocks(seqlen_k, block_size), seed)
    indices, counts = indices.to(device), counts.to(device)
    scale = head_dim ** -0.5
    inputs = (q, k, v, k_cmp, v_cmp, g_cmp, g_slc, g_swa)
    leaves = [t.detach().clone().requires_grad_() for t in inputs]
    poison_cuda_allocator(device)
    o = native_sparse_attn_func(*leaves[:5], leaves[5], leaves[6], leaves[7], indices,
                                block_size=block_size, window_size=window, block_counts=counts,
                                compress_block_size=block, compress_stride=stride)
    assert o.shape == q.shape and o.dtype == dtype
    grads = torch.autograd.grad(o, leaves, dout)
    # The branch outputs flashkit's backwards were handed, for the reference's D correction.
    with torch.no_grad():
        stored = (_compressed_attention(q, k_cmp, v_cmp, seqlen_k, block, stride, scale),
                  nsa_selection_attn_func(q, k, v, indices, block_size, counts),
                  flashkit.flash_attn_func(q, k, v, causal=True, window_size=(window - 1, 0)))
    args = (indices, counts, block_size, window, block, stride, scale)
    ref = native_ref(inputs + (dout,), *args, upcast=True, stored=stored)
    lowp = native_ref(inputs + (dout,), *args, upcast=False)
    check_close("o", o, ref[0], lowp[0], GRAD_FACTOR)
    names = ("dq", "dk", "dv", "dk_cmp", "dv_cmp", "dg_cmp", "dg_slc", "dg_swa")
    for name, leaf, grad, r, lp in zip(names, leaves, grads, ref[1:], lowp[1:]):
        assert grad.shape == leaf.shape and grad.dtype == leaf.dtype, name
        check_close(name, grad, r, lp, GRAD_FACTOR,
                    rounding_slack(head_dim, max(seqlen_q / seqlen_k, seqlen_q / seqlen_cmp)))


def test_native_branches_can_be_left_out(device):
    """g_cmp None (with no compressed keys) and g_swa None leave those branches out."""
    skip_unbuilt_nsa(device, torch.bfloat16, 64)
    q, k, v, indices, counts = op_inputs(device, False, seqlen_q=40, seqlen_k=40)
    g = torch.rand(2, 40, 4, device=device)
    o = native_sparse_attn_func(q, k, v, None, None, None, g, None, indices, 16,
                                block_counts=counts)
    expected = (g[..., None] * nsa_selection_attn_func(q, k, v, indices, 16, counts)).to(q.dtype)
    assert torch.equal(o, expected)


CMP_GEOMETRIES = [(16, 16), (32, 16), (16, 8), (8, 8), (5, 3), (1, 1), (64, 64)]
CMP_LENGTHS = [(64, 64), (1, 64), (17, 64), (64, 17), (37, 90), (0, 8)]


@pytest.mark.parametrize("lengths", CMP_LENGTHS, ids=[f"{q}x{k}" for q, k in CMP_LENGTHS])
@pytest.mark.parametrize("geometry", CMP_GEOMETRIES, ids=[f"l{l}s{s}" for l, s in CMP_GEOMETRIES])
def test_compressed_branch_alignment(device, geometry, lengths):
    """The compressed branch (forward) for many (block, stride, seqlen_q, seqlen_k) and numbers of
    compressed keys: fewer than the sequence holds, exactly as many, more, and none."""
    block, stride = geometry
    seqlen_q, seqlen_k = lengths
    skip_unbuilt_attention(device, torch.bfloat16, 64)
    complete = max((seqlen_k - block) // stride + 1, 0)
    for seqlen_cmp in sorted({0, max(complete - 2, 1), complete, complete + 3}):
        seed = seqlen_cmp + 7 * block + stride
        q = randn((1, seqlen_q, 4, 64), torch.bfloat16, device, seed)
        k_cmp = randn((1, seqlen_cmp, 2, 64), torch.bfloat16, device, seed + 1)
        v_cmp = randn((1, seqlen_cmp, 2, 64), torch.bfloat16, device, seed + 2)
        out = _compressed_attention(q, k_cmp, v_cmp, seqlen_k, block, stride, 0.125)
        mask = compressed_mask(seqlen_q, seqlen_k, seqlen_cmp, block, stride)
        ref, _ = masked_attention_ref(q, k_cmp, v_cmp, mask, 0.125)
        lowp, _ = masked_attention_ref(q, k_cmp, v_cmp, mask, 0.125, upcast=False)
        assert out.shape == q.shape
        check_close(f"o_cmp with {seqlen_cmp} compressed keys", out, ref, lowp, FWD_FACTOR)
        blind = ~mask.any(-1)
        assert torch.all(out[:, blind.to(out.device)] == 0)


def test_native_math_is_consistent():
    """Sanity check of the test's own masks: the compressed mask of stride 1 and block 1 is the
    causal mask, and a window at least seqlen_k long is the causal mask."""
    causal = torch.arange(9)[None, :] <= torch.arange(9)[:, None]
    assert torch.equal(compressed_mask(9, 9, 9, 1, 1), causal)
    assert torch.equal(window_mask(9, 9, 9), causal)
