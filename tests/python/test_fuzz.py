"""Seeded random calls mixing everything flash_attn_func and flash_attn_varlen_func accept, checked
with their gradients against the fp32 reference (error-ratio rule, 3x for gradients).

The grids of test_forward / test_backward / test_dropout vary one thing at a time over short
sequences; here each case draws all of them at once (dtype, any head dim 1..256, MHA / GQA / MQA,
batch, independent query and key lengths up to ~1100 so that every kernel walks several blocks,
fixed or packed varlen with empty sequences, causal / sliding window / softcap / ALiBi and their
combinations, dropout with the mask S_dmask reports, deterministic mode), so that a combination no
grid lists is still run. A failure names the seed; `draw_case(seed)` rebuilds the case.

The CUDA test runs seeds 0..119, and test_fuzz_strided_cuda seeds 1000..1039 with non-contiguous
q, k, v and dout (strided()); FLASHKIT_FUZZ_SEEDS="start-stop" runs range(start, stop) in both
instead (conftest.fuzz_seeds), e.g. FLASHKIT_FUZZ_SEEDS=0-2000 for a long run on a GPU.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import List, Optional, Tuple

import pytest
import torch

import flashkit
from conftest import (HAS_CUDA, NO_GPU_REASON, fuzz_seeds, padded_head_dim,
                      poison_cuda_allocator)
from flashkit import flash_attn_func, flash_attn_varlen_func
from reference import Options, check_close, rounding_slack
from test_backward import GRAD_FACTOR, reference_grads
from test_forward import DTYPES, pack, randn

CUDA_SEEDS = fuzz_seeds(range(120))
STRIDED_SEEDS = fuzz_seeds(range(1000, 1040))
CPU_SEEDS = range(100, 106)  # the CPU backend is the fp64 reference: a few short cases suffice
CPU_STRIDED_SEEDS = range(106, 109)
MASKS = ["none", "causal", "window", "softcap", "alibi", "causal_alibi", "causal_softcap",
         "window_alibi"]
# Bounds the reference's work per case: batch x heads_q x seqlen_q x seqlen_k x head_dim.
MAX_WORK = 1e9


@dataclass
class Case:
    seed: int
    dtype: torch.dtype
    head_dim: int
    heads_q: int
    heads_kv: int
    lengths_q: List[int]  # one per sequence; fixed-length cases repeat one length
    lengths_k: List[int]
    varlen: bool
    mask: str
    dropout_p: float
    deterministic: bool
    opts: Options = field(repr=False, default_factory=Options)

    def __str__(self) -> str:
        kind = "varlen" if self.varlen else "fixed"
        return (f"seed {self.seed}: {self.dtype} d{self.head_dim} heads {self.heads_q}/"
                f"{self.heads_kv} {kind} q {self.lengths_q} k {self.lengths_k} {self.mask} "
                f"p {self.dropout_p} det {self.deterministic} window {self.opts.window_size}")


def draw_case(seed: int, max_len: int) -> Case:
    rng = random.Random(seed)
    dtype = rng.choice(DTYPES)
    head_dim = rng.choice([rng.randrange(8, 257, 8), rng.randint(1, 256), 64, 128])
    heads_kv = rng.choice([1, 2, 3])
    heads_q = heads_kv * rng.choice([1, 2, 4])
    varlen = rng.random() < 0.35

    def length() -> int:
        return rng.choice([rng.randint(1, max_len), rng.randint(1, 160), 128 * rng.randint(1, 8)])

    if varlen:
        count = rng.randint(1, 4)
        lengths_q = [rng.choice([0, length(), length()]) for _ in range(count)]
        lengths_k = [rng.choice([0, length(), length()]) for _ in range(count)]
    else:
        batch = rng.randint(1, 3)
        lengths_q = [min(length(), max_len)] * batch
        lengths_k = [rng.choice([lengths_q[0], length()])] * batch
    work = heads_q * head_dim * sum(a * b for a, b in zip(lengths_q, lengths_k))
    if work > MAX_WORK:  # shrink every length by the same factor
        shrink = (MAX_WORK / work) ** 0.5
        lengths_q = [max(1, int(n * shrink)) if n else 0 for n in lengths_q]
        lengths_k = [max(1, int(n * shrink)) if n else 0 for n in lengths_k]

    mask = rng.choice(MASKS)
    opts = Options(causal=mask.startswith("causal"))
    if mask.startswith("window"):
        longest = max(lengths_k + [1])
        opts.window_size = (rng.choice([-1, rng.randint(0, longest)]),
                            rng.choice([-1, 0, rng.randint(0, longest)]))
    if mask.endswith("softcap"):
        opts.softcap = rng.choice([1.5, 8.0, 30.0])
    if mask.endswith("alibi"):
        batch = len(lengths_q)
        shape = (heads_q,) if rng.random() < 0.5 else (batch, heads_q)
        gen = torch.Generator().manual_seed(seed)
        opts.alibi_slopes = torch.rand(shape, generator=gen) * 0.5
    if rng.random() < 0.3:
        opts.softmax_scale = rng.uniform(0.02, 0.3)
    dropout_p = rng.choice([0.1, 0.3]) if rng.random() < 0.25 else 0.0
    deterministic = rng.random() < 0.25
    return Case(seed, dtype, head_dim, heads_q, heads_kv, lengths_q, lengths_k, varlen, mask,
                dropout_p, deterministic, opts)


def skip_unbuilt(case: Case, device: str) -> None:
    padded = padded_head_dim(case.head_dim)
    if device == "cuda" and not (flashkit.cuda_fwd_built(case.dtype, padded) and
                                 flashkit.cuda_bwd_built(case.dtype, padded)):
        pytest.skip(f"this build has no CUDA kernels for {case.dtype} head dim {padded}")


def make_inputs(case: Case, device: str) -> Tuple[list, list]:
    """Per sequence [len, heads, d] tensors (q, k, v, dout) on the CPU, seeded by the case."""
    d, s = case.head_dim, case.seed * 1000
    seqs = []
    for b, (len_q, len_k) in enumerate(zip(case.lengths_q, case.lengths_k)):
        seqs.append([randn((len_q, case.heads_q, d), case.dtype, "cpu", s + 10 * b),
                     randn((len_k, case.heads_kv, d), case.dtype, "cpu", s + 10 * b + 1),
                     randn((len_k, case.heads_kv, d), case.dtype, "cpu", s + 10 * b + 2),
                     randn((len_q, case.heads_q, d), case.dtype, "cpu", s + 10 * b + 3)])
    return seqs


def kept(s_dmask: Optional[torch.Tensor], b: int, len_q: int, len_k: int) -> Optional[torch.Tensor]:
    if s_dmask is None:
        return None
    return ~torch.signbit(s_dmask[b:b + 1, :, :len_q, :len_k]).cpu()


def strided(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dout: torch.Tensor):
    """The same values in layouts a model hands over ([..., tokens, heads, d] tensors, the tokens
    dim first after any batch dim): q and dout head-major underneath (a transposed
    [..., heads, tokens, d] tensor), k and v interleaved as in a packed kv tensor [..., tokens, 2,
    heads, d]. Differentiable, so the gradients reach the contiguous leaves."""
    tokens = q.dim() - 3  # the tokens dim: 1 fixed-length, 0 varlen

    def head_major(t):
        return t.transpose(tokens, tokens + 1).contiguous().transpose(tokens, tokens + 1)

    kv = torch.stack([k, v], dim=tokens + 1)
    return head_major(q), kv.select(tokens + 1, 0), kv.select(tokens + 1, 1), head_major(dout)


def run_case(case: Case, device: str, layout=lambda q, k, v, dout: (q, k, v, dout)) -> None:
    """`layout` maps the contiguous leaves (and dout) to the tensors the call gets."""
    skip_unbuilt(case, device)
    seqs = make_inputs(case, device)
    opts = case.opts
    kwargs = dict(causal=opts.causal, window_size=opts.window_size, softcap=opts.softcap,
                  softmax_scale=opts.softmax_scale, deterministic=case.deterministic,
                  dropout_p=case.dropout_p, return_attn_probs=True,
                  alibi_slopes=None if opts.alibi_slopes is None else opts.alibi_slopes.to(device))
    poison_cuda_allocator(device)
    if case.varlen:
        (q, cu_q), (k, cu_k), (v, _), (dout, _) = (pack([sq[i] for sq in seqs]) for i in range(4))
        leaves = [t.to(device).requires_grad_() for t in (q, k, v)]
        *inputs, dout_in = layout(*leaves, dout.to(device))
        out, lse, s_dmask = flash_attn_varlen_func(
            *inputs, cu_q.to(device), cu_k.to(device), max(case.lengths_q), max(case.lengths_k),
            **kwargs)
        out.backward(dout_in)
        rows_q = [slice(int(cu_q[b]), int(cu_q[b + 1])) for b in range(len(seqs))]
        rows_k = [slice(int(cu_k[b]), int(cu_k[b + 1])) for b in range(len(seqs))]
        pick = [lambda t, b=b: t[rows_q[b]][None] for b in range(len(seqs))]
        pick_k = [lambda t, b=b: t[rows_k[b]][None] for b in range(len(seqs))]
    else:
        q, k, v, dout = (torch.stack([sq[i] for sq in seqs]) for i in range(4))
        leaves = [t.to(device).requires_grad_() for t in (q, k, v)]
        *inputs, dout_in = layout(*leaves, dout.to(device))
        out, lse, s_dmask = flash_attn_func(*inputs, **kwargs)
        out.backward(dout_in)
        pick = pick_k = [lambda t, b=b: t[b:b + 1] for b in range(len(seqs))]
    assert (s_dmask is not None) == (case.dropout_p > 0)
    grads = [leaf.grad.cpu() for leaf in leaves]
    out = out.detach().cpu()
    for b, (sq, len_q, len_k) in enumerate(zip(seqs, case.lengths_q, case.lengths_k)):
        # Varlen window sides are compared with max_seqlen_k, as in flash_attn (params.h).
        seq_opts = Options(**{**opts.__dict__, "window_limit": max(case.lengths_k)})
        if opts.alibi_slopes is not None and opts.alibi_slopes.dim() == 2:
            seq_opts.alibi_slopes = opts.alibi_slopes[b:b + 1]
        seq_opts.dropout_p = case.dropout_p
        seq_opts.dropout_keep = kept(s_dmask, b, len_q, len_k)
        one = [t[None] for t in sq]
        ref = reference_grads(*one, seq_opts, upcast=True, stored_out=pick[b](out))
        lowp = reference_grads(*one, seq_opts, upcast=False)
        where = f"{case}, sequence {b}"
        check_close(f"out ({where})", pick[b](out), ref[0], lowp[0], GRAD_FACTOR)
        for i, name in enumerate(("dq", "dk", "dv")):
            got = (pick if i == 0 else pick_k)[b](grads[i])
            check_close(f"{name} ({where})", got, ref[i + 1], lowp[i + 1], GRAD_FACTOR,
                        rounding_slack(case.head_dim, 1.0 if i == 0 else len_q / max(len_k, 1)))


@pytest.mark.skipif(not HAS_CUDA, reason=NO_GPU_REASON)
@pytest.mark.parametrize("seed", CUDA_SEEDS)
def test_fuzz_cuda(seed):
    run_case(draw_case(seed, max_len=1100), "cuda")


@pytest.mark.parametrize("seed", CPU_SEEDS)
def test_fuzz_cpu(seed):
    run_case(draw_case(seed, max_len=200), "cpu")


@pytest.mark.skipif(not HAS_CUDA, reason=NO_GPU_REASON)
@pytest.mark.parametrize("seed", STRIDED_SEEDS)
def test_fuzz_strided_cuda(seed):
    """Other seeds' cases with non-contiguous q, k, v and dout (strided())."""
    run_case(draw_case(seed, max_len=1100), "cuda", layout=strided)


@pytest.mark.parametrize("seed", CPU_STRIDED_SEEDS)
def test_fuzz_strided_cpu(seed):
    run_case(draw_case(seed, max_len=200), "cpu", layout=strided)
