#!/usr/bin/env python3
"""bench/kvcache_long_queries.py: flash_attn_with_kvcache with many query tokens (chunked prefill
against a cache, speculative drafts) beside flash_attn_func on the same problem, in one run.

bf16, head dim 128, 32 / 8 heads, batch 4, every cache full (cache_seqlens = capacity), causal. Per
(seqlen_k, seqlen_q): flash_attn_func(q, k, v); flash_attn_with_kvcache on the same contiguous
cache, on the automatic path (src/api/kvcache_fwd_route.h) and forced onto the decode kernel
(FLASHKIT_KVCACHE_PATH=decode); and on a paged copy (256-token pages, which the decode kernel
runs). Times: median of 30 CUDA-event-timed eager calls after 5 warm-up calls (no L2 rotation: the
caches are 32-512 MiB). The largest difference of the kvcache outputs from flash_attn_func's is
printed beside.

usage: kvcache_long_queries.py OUT.json      (PYTHONPATH=<build>/python)
"""
import json
import os
import sys

import torch

from flashkit import flash_attn_func, flash_attn_with_kvcache

BATCH, HEADS_Q, HEADS_KV, HEAD_DIM, PAGE = 4, 32, 8, 128, 256


def time_ms(fn, iters=30):
    for _ in range(5):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return sorted(times)[len(times) // 2]


def on_decode_kernel(fn):
    os.environ["FLASHKIT_KVCACHE_PATH"] = "decode"
    try:
        return fn()
    finally:
        del os.environ["FLASHKIT_KVCACHE_PATH"]


def main():
    torch.manual_seed(0)
    dev, bf16 = "cuda", torch.bfloat16
    rows = []
    print("| seqlen_k | seqlen_q | flash_attn_func ms | with_kvcache (auto) ms | with_kvcache (decode) ms "
          "| paged256 ms | auto / func | decode / func | paged / func | max diff |")
    print("| --- " * 10 + "|")
    for seqlen_k in (8192, 32768):
        k = torch.randn(BATCH, seqlen_k, HEADS_KV, HEAD_DIM, device=dev, dtype=bf16)
        v = torch.randn_like(k)
        lengths = torch.full((BATCH,), seqlen_k, dtype=torch.int32, device=dev)
        k_pages = k.reshape(-1, PAGE, HEADS_KV, HEAD_DIM)
        v_pages = v.reshape(-1, PAGE, HEADS_KV, HEAD_DIM)
        table = torch.arange(k_pages.shape[0], dtype=torch.int32, device=dev).reshape(BATCH, -1)
        for seqlen_q in (1, 16, 64, 256, 1024, 4096):
            q = torch.randn(BATCH, seqlen_q, HEADS_Q, HEAD_DIM, device=dev, dtype=bf16)
            forward = lambda: flash_attn_func(q, k, v, causal=True)
            cache = lambda: flash_attn_with_kvcache(q, k, v, cache_seqlens=lengths, causal=True)
            paged = lambda: flash_attn_with_kvcache(q, k_pages, v_pages, cache_seqlens=lengths,
                                                    block_table=table, causal=True)
            t_fwd, t_auto, t_paged = time_ms(forward), time_ms(cache), time_ms(paged)
            t_decode = on_decode_kernel(lambda: time_ms(cache))
            ref = forward().float()
            diff = max((cache().float() - ref).abs().max().item(),
                       (on_decode_kernel(cache).float() - ref).abs().max().item(),
                       (paged().float() - ref).abs().max().item())
            rows.append(dict(seqlen_k=seqlen_k, seqlen_q=seqlen_q, fwd_ms=t_fwd, kvcache_ms=t_auto,
                             kvcache_decode_ms=t_decode, kvcache_paged256_ms=t_paged, max_diff=diff))
            print(f"| {seqlen_k} | {seqlen_q} | {t_fwd:.3f} | {t_auto:.3f} | {t_decode:.3f} | {t_paged:.3f} "
                  f"| {t_auto / t_fwd:.2f}x | {t_decode / t_fwd:.2f}x | {t_paged / t_fwd:.2f}x | {diff:.3g} |",
                  flush=True)
    with open(sys.argv[1], "w") as f:
        json.dump(dict(gpu=torch.cuda.get_device_name(), torch=torch.__version__, rows=rows), f, indent=1)


if __name__ == "__main__":
    main()
