"""python -m flashkit.bench: flashkit's Python front end timed beside PyTorch SDPA's backends.

Today it measures the calling overhead the front-end issue asks about: the eager per-call time of
flash_attn_func on a tiny problem (default batch 1, seqlen 128, 8 heads, head dim 64, bf16), forward
and forward + backward, beside SDPA's flash backend on the same problem, and the same function under
torch.compile. The problem is so small that host-side work dominates: this is a latency benchmark,
not a throughput one (bench/ has the throughput benchmark of the kernels).

    python -m flashkit.bench [--batch 1] [--seqlen 128] [--heads 8] [--head-dim 64]
                             [--iters 2000] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import time
from typing import Callable, Dict, Optional

import torch
import torch.nn.functional as F

from flashkit import flash_attn_func


def per_call_us(fn: Callable[[], object], iters: int) -> float:
    """Wall time per call in microseconds over ``iters`` back-to-back calls, device synchronised
    before and after (so a call's time is max(host time, device time))."""
    for _ in range(max(iters // 10, 10)):
        fn()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(iters):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - start) / iters * 1e6


def fwd_bwd(fn: Callable[[], torch.Tensor], grad: torch.Tensor) -> Callable[[], None]:
    return lambda: fn().backward(grad)


def measure(batch: int, seqlen: int, heads: int, head_dim: int, iters: int) -> Dict[str, object]:
    dtype = torch.bfloat16
    shape = (batch, seqlen, heads, head_dim)
    q, k, v = (torch.randn(shape, device="cuda", dtype=dtype) for _ in range(3))
    qt, kt, vt = (t.transpose(1, 2).contiguous() for t in (q, k, v))  # SDPA's [b, h, s, d]
    results: Dict[str, Optional[float]] = {}

    def sdpa(q_, k_, v_):
        with torch.nn.attention.sdpa_kernel(torch.nn.attention.SDPBackend.FLASH_ATTENTION):
            return F.scaled_dot_product_attention(q_, k_, v_, is_causal=True)

    compiled = torch.compile(lambda a, b, c: flash_attn_func(a, b, c, causal=True), fullgraph=True)
    calls = {
        "flashkit": lambda a, b, c: flash_attn_func(a, b, c, causal=True),
        "flashkit_compiled": compiled,
        "sdpa_flash": sdpa,
    }
    for name, call in calls.items():
        args = (qt, kt, vt) if name == "sdpa_flash" else (q, k, v)
        results[f"{name}_fwd_us"] = per_call_us(lambda: call(*args), iters)
        leaves = [t.clone().requires_grad_() for t in args]
        grad = torch.randn_like(args[0])
        try:
            results[f"{name}_fwd_bwd_us"] = per_call_us(fwd_bwd(lambda: call(*leaves), grad),
                                                        iters)
        except RuntimeError as error:  # e.g. a build without the CUDA backward
            results[f"{name}_fwd_bwd_us"] = None
            results[f"{name}_fwd_bwd_error"] = str(error).splitlines()[0]
    return {"device": torch.cuda.get_device_name(), "torch": torch.__version__,
            "problem": {"batch": batch, "seqlen": seqlen, "heads": heads, "head_dim": head_dim,
                        "dtype": "bf16", "causal": True, "iters": iters},
            "results": results}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--seqlen", type=int, default=128)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--iters", type=int, default=2000)
    parser.add_argument("--json", help="also write the results to this file")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("flashkit.bench: no CUDA GPU visible to torch; the timings need one")
    report = measure(args.batch, args.seqlen, args.heads, args.head_dim, args.iters)
    print(f"{report['device']}, torch {report['torch']}, {report['problem']}")
    for key, value in report["results"].items():
        print(f"  {key:32s} {value if isinstance(value, str) or value is None else f'{value:8.1f}'}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=2)


if __name__ == "__main__":
    main()
