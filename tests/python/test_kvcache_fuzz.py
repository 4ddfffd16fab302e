"""Seeded random calls of flash_attn_with_kvcache, each checked by test_kvcache.run (outputs and LSE
against the fp32 reference with the error-ratio rule, the cache contents after the append).

test_kvcache's grids vary one or two knobs at a time; here each case draws all of them at once:
dtype, any head dim 1..256 (non-multiples of 8 run on padded copies), MHA / GQA 4, 8, 16 / MQA,
batch 1..5, seqlen_q 1..16, appends of 0..8 tokens, caches of up to ~2000 rows, contiguous or paged
with any page size 1..256 or 512..1024 (flash_attn's multiples of 256), rotary (interleaved or half,
rotary_dim a multiple of 16 up to head_dim) on the appended keys, cache_batch_idx, cache_leftpad, scalar cache_seqlens, empty and full
sequences, num_splits 0..128, causal / sliding window / softcap / ALiBi and their combinations.
Only what the API accepts is drawn (test_kvcache.test_bad_input covers the refusals).

A failure names the seed and the drawn case; `draw_case(seed, ...)` rebuilds it. The CUDA test runs
seeds 0..59; FLASHKIT_FUZZ_SEEDS="start-stop" runs range(start, stop) instead (conftest.fuzz_seeds),
e.g. FLASHKIT_FUZZ_SEEDS=0-2000 for a long run on a GPU.
"""

from __future__ import annotations

import random

import pytest
import torch

from conftest import HAS_CUDA, NO_GPU_REASON, fuzz_seeds
from reference import Options
from test_kvcache import DTYPES, Case, run

CUDA_SEEDS = fuzz_seeds(range(60))
CPU_SEEDS = range(100, 110)  # the CPU backend is the fp64 reference: these mostly test the harness
MASKS = ["none", "causal", "window", "softcap", "alibi", "causal_alibi", "causal_softcap",
         "window_alibi", "window_softcap"]
# Bounds the reference's work per case, batch x heads_q x seqlen_q x capacity x head_dim, by
# shrinking the cache: the reference loops over sequences in Python and runs twice (fp32 and the
# input dtype).
CUDA_MAX_WORK = 2e8
CPU_MAX_WORK = 2e7
ROTARY_MULTIPLE = 16  # rotary_dim: a multiple of 16 (validate_kvcache.cpp)


def draw_case(seed: int, max_capacity: int, max_work: float) -> Case:
    rng = random.Random(seed)
    dtype = rng.choice(DTYPES)
    head_dim = rng.choice([rng.randint(1, 256), rng.randrange(8, 257, 8), 64, 128, 256])
    heads_kv = rng.choice([1, 1, 2, 3])  # 1: MQA whatever the ratio
    heads = (heads_kv * rng.choice([1, 4, 8, 16]), heads_kv)
    batch = rng.randint(1, 5)
    seqlen_q = rng.choice([1, rng.randint(1, 16)])
    seqlen_new = rng.choice([0, 1, rng.randint(0, 8), min(seqlen_q, 8)])

    capacity = rng.choice([rng.randint(1, max_capacity), rng.randint(1, 64)])
    work = batch * heads[0] * seqlen_q * capacity * head_dim
    if work > max_work:
        capacity = int(capacity * max_work / work)
    # Rotary rotates the appended keys, so it needs an append, and a head dim that holds 16.
    rotary, rotary_dim = "none", 0
    if seqlen_new and head_dim >= ROTARY_MULTIPLE and rng.random() < 0.6:
        rotary = rng.choice(["interleaved", "half"])
        widest = head_dim // ROTARY_MULTIPLE
        rotary_dim = ROTARY_MULTIPLE * rng.choice([widest, rng.randint(1, widest)])
    # Query token i is rotated to position L - P + i: the tables (as long as the cache) must
    # reach it (the caller's promise on CUDA, kvcache_params.h), so a rotary case keeps
    # L + seqlen_q within the capacity.
    capacity = max(capacity, seqlen_new, seqlen_q if rotary != "none" else 1)
    page_block_size = rng.choice([0, 0, 16 * rng.randint(1, 16), 2 ** rng.randint(0, 8),
                                  rng.randint(1, 256), 256 * rng.randint(2, 4)])

    batch_idx = not page_block_size and rng.random() < 0.3  # paged caches name pages instead
    leftpad = rng.random() < 0.3
    scalar_seqlens = rng.random() < 0.2
    # The longest cache that still takes the append (and, with rotary, the queries' positions).
    top = capacity - max(seqlen_new, seqlen_q if rotary != "none" else 0)

    def length() -> int:  # an edge (empty, full) a third of the time
        return rng.choice([0, top]) if rng.random() < 1 / 3 else rng.randint(0, top)

    lengths = (length(),) * batch if scalar_seqlens else tuple(length() for _ in range(batch))
    num_splits = rng.choice([0, 0, 1, rng.randint(2, 8), rng.randint(1, 128)])

    mask = rng.choice(MASKS)
    opts = Options(causal=mask.startswith("causal"))
    if mask.startswith("window"):
        # Any side: one at or beyond the (page-rounded) capacity means no limit, in flashkit as in
        # the reference (test_kvcache.reference), and a side past a sequence's keys but below the
        # capacity still hides keys from the first queries when seqlen_q exceeds them.
        def side() -> int:
            return rng.choice([-1, rng.randint(0, max(seqlen_new, 1) - 1),
                               rng.randint(0, capacity - 1), rng.randint(capacity, 2 * capacity)])

        opts.window_size = (side(), side())
    if mask.endswith("softcap"):
        opts.softcap = rng.choice([1.5, 8.0, 30.0])
    if mask.endswith("alibi"):
        shape = (heads[0],) if rng.random() < 0.5 else (batch, heads[0])
        opts.alibi_slopes = torch.rand(shape, generator=torch.Generator().manual_seed(seed)) * 0.5
    if rng.random() < 0.3:
        opts.softmax_scale = rng.uniform(0.02, 0.3)
    return Case(batch=batch, seqlen_q=seqlen_q, seqlen_new=seqlen_new, heads=heads,
                head_dim=head_dim, dtype=dtype, capacity=capacity,
                page_block_size=page_block_size, rotary=rotary, rotary_dim=rotary_dim,
                batch_idx=batch_idx, leftpad=leftpad, scalar_seqlens=scalar_seqlens,
                lengths=lengths, num_splits=num_splits, opts=opts, seed=seed)


def run_drawn(case: Case, device: str) -> None:
    """test_kvcache.run, with the drawn case named in any failure (a check or a refusal)."""
    try:
        run(case, device)
    except Exception as error:
        raise AssertionError(f"{case}\n{error}") from error


@pytest.mark.skipif(not HAS_CUDA, reason=NO_GPU_REASON)
@pytest.mark.parametrize("seed", CUDA_SEEDS)
def test_kvcache_fuzz_cuda(seed):
    run_drawn(draw_case(seed, max_capacity=2000, max_work=CUDA_MAX_WORK), "cuda")


@pytest.mark.parametrize("seed", CPU_SEEDS)
def test_kvcache_fuzz_cpu(seed):
    run_drawn(draw_case(seed, max_capacity=200, max_work=CPU_MAX_WORK), "cpu")
