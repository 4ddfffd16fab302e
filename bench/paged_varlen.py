"""What flash_attn_varlen_func's block_table costs: the same call with its keys and values in a
contiguous varlen tensor and in a paged cache (shuffled pages), timed with CUDA events (median of
the calls after warm-up), bf16, causal, on the current GPU. Up to 16 queries per sequence the paged
call reads the pages in place (the decode kernel), longer ones gather them first.

    python3 bench/paged_varlen.py [--batch 4] [--seqlen-q 2048] [--seqlen-k 4096] [--heads 32/8]
                                  [--head-dim 128] [--pages 16,256]

Run with the build's python dir on PYTHONPATH (scripts/python_tests.sh shows how). Prints one line
per layout: ms per call, eager and as a CUDA graph's replay, and the ratios to the contiguous call.
"""

from __future__ import annotations

import argparse
import statistics

import torch

from flashkit import flash_attn_varlen_func


def time_ms(call, warmup=5, calls=30, graph=False):
    """Median ms per call between CUDA events; with graph=True per replay of a CUDA graph of the
    call (the GPU's time without Python's launch overhead)."""
    for _ in range(warmup):
        call()
    if graph:
        torch.cuda.synchronize()
        captured = torch.cuda.CUDAGraph()
        with torch.cuda.graph(captured):
            call()
        call = captured.replay
        call()
    times = []
    for _ in range(calls):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        call()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seqlen-q", type=int, default=2048)
    parser.add_argument("--seqlen-k", type=int, default=4096)
    parser.add_argument("--heads", default="32/8")
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--pages", default="16,256")
    args = parser.parse_args()
    heads_q, heads_kv = (int(x) for x in args.heads.split("/"))
    b, sq, sk, d = args.batch, args.seqlen_q, args.seqlen_k, args.head_dim
    dev, dt = "cuda", torch.bfloat16
    q = torch.randn(b * sq, heads_q, d, device=dev, dtype=dt)
    k = torch.randn(b * sk, heads_kv, d, device=dev, dtype=dt)
    v = torch.randn(b * sk, heads_kv, d, device=dev, dtype=dt)
    cu_q = torch.arange(b + 1, device=dev, dtype=torch.int32) * sq
    cu_k = torch.arange(b + 1, device=dev, dtype=torch.int32) * sk
    print(f"{torch.cuda.get_device_name()}: batch {b}, {sq} queries over {sk} keys, heads "
          f"{heads_q}/{heads_kv}, d{d}, bf16, causal")
    def contiguous_call():
        return flash_attn_varlen_func(q, k, v, cu_q, cu_k, sq, sk, causal=True)

    contiguous = time_ms(contiguous_call)
    contiguous_graph = time_ms(contiguous_call, graph=True)
    print(f"  contiguous        {contiguous:8.3f} ms eager {contiguous_graph:8.3f} ms graph")
    for page in (int(x) for x in args.pages.split(",")):
        pages_per_seq = -(-sk // page)
        order = torch.randperm(b * pages_per_seq, device=dev)
        table = order.view(b, pages_per_seq).to(torch.int32)
        k_cache = torch.empty(b * pages_per_seq, page, heads_kv, d, device=dev, dtype=dt)
        v_cache = torch.empty_like(k_cache)
        keys = torch.arange(sk, device=dev)
        for s in range(b):  # sequence s's keys onto its pages
            k_cache[table[s, keys // page].long(), keys % page] = k[s * sk:(s + 1) * sk]
            v_cache[table[s, keys // page].long(), keys % page] = v[s * sk:(s + 1) * sk]
        out = flash_attn_varlen_func(q, k_cache, v_cache, cu_q, cu_k, sq, sk, causal=True,
                                     block_table=table)
        same = torch.equal(out, flash_attn_varlen_func(q, k, v, cu_q, cu_k, sq, sk, causal=True))
        def paged_call():
            return flash_attn_varlen_func(q, k_cache, v_cache, cu_q, cu_k, sq, sk, causal=True,
                                          block_table=table)

        ms, ms_graph = time_ms(paged_call), time_ms(paged_call, graph=True)
        print(f"  paged {page:4d}        {ms:8.3f} ms eager {ms_graph:8.3f} ms graph: "
              f"{ms / contiguous:5.2f}x / {ms_graph / contiguous_graph:5.2f}x contiguous "
              f"(output {'bit-identical' if same else 'differs'})")


if __name__ == "__main__":
    main()
