#!/usr/bin/env python3
"""bench/bwd_sdpa_probe.py: PyTorch SDPA's FlashAttention-2 backward on flashkit_bwd_probe's grid.

Prints one line per case (bf16, batch = 16384 / s, heads = 2048 / d, [b, s, h, d] memory viewed as
[b, h, s, d]), the backward alone: the forward runs once, then torch.autograd.grad with
retain_graph is timed with CUDA events (3 warm-up calls, median of 10). TFLOP/s counts 2.5x the
forward's 4 * b * h * s^2 * d, halved for causal, like flashkit_bwd_probe's.

usage: bwd_sdpa_probe.py [dims, e.g. 64,128] [seqlens, e.g. 2048,8192]
"""
import statistics
import sys

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel


def main():
    dims = [int(x) for x in (sys.argv[1] if len(sys.argv) > 1 else "64,128").split(",")]
    seqlens = [int(x) for x in (sys.argv[2] if len(sys.argv) > 2 else "2048,8192").split(",")]
    print(f"{'hdim':6} {'seqlen':6} {'causal':7} {'FA2 bwd TFLOP/s':>16}")
    for d in dims:
        for s in seqlens:
            for causal in (False, True):
                b, h = 16384 // s, 2048 // d
                q, k, v, dout = (torch.rand(b, s, h, d, device="cuda", dtype=torch.bfloat16) * 2 - 1
                                 for _ in range(4))
                q, k, v = (x.requires_grad_() for x in (q, k, v))
                with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
                    out = torch.nn.functional.scaled_dot_product_attention(
                        q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=causal)
                grad_out = dout.transpose(1, 2)
                times = []
                for rep in range(13):
                    start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                    start.record()
                    torch.autograd.grad(out, (q, k, v), grad_out, retain_graph=True)
                    stop.record()
                    stop.synchronize()
                    if rep >= 3:
                        times.append(start.elapsed_time(stop))
                flops = 2.5 * 4 * b * h * s * s * d * (0.5 if causal else 1.0)
                tflops = flops / (statistics.median(times) * 1e-3) / 1e12
                print(f"{d:<6} {s:<6} {'yes' if causal else 'no':7} {tflops:16.1f}", flush=True)


if __name__ == "__main__":
    main()
