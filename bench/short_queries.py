#!/usr/bin/env python3
"""bench/short_queries.py: flash_attn_func with a few query tokens against many keys (decoding
through the forward API, as Hugging Face generate() does), on each flashkit path beside PyTorch
SDPA's flash and cuDNN backends, in one run.

`flashkit` is flash_attn_func on the automatic path (src/api/fwd_decode_route.h); the others force
a path through FLASHKIT_FWD_PATH (read on every call): `decode` the decode kernel, `sm90` the
wgmma forward with one query head per tile and `sm90packed` with a kv head's query heads packed
into its tiles (FLASHKIT_SM90_PACK_GQA=0 / 1); `flashkit_varlen` is the same batch through
flash_attn_varlen_func (automatic path). bf16, head dim 128, --heads-q over --heads-kv, no mask;
q [b, s_q, h, d] and k / v [b, s_k, h_kv, d] memory (SDPA reads [b, h, s, d] views of it, GQA
through enable_gqa). tbps counts the bytes of K and V once; tflops 4 * b * h * s_q * s_k * d.
Every implementation's output is compared with SDPA flash's. Method as bench/peers_decode.py
(median of CUDA-event-timed calls, inputs rotated past 2x L2): each call eagerly, host time
included, or with --graphs the GPU time of calls replayed from a CUDA graph.

usage: short_queries.py [--seqlen-q 1,4,16,32,64] [--seqlen-k 2k,8k,32k] [--batch 1,8,32]
                        [--heads-q 32] [--heads-kv 8] [--max-tokens 256k] [--graphs] [--impls a,b,...]
                        --json OUT.json [--md OUT.md]
Needs flashkit importable (PYTHONPATH=<build>/python).
"""
import argparse
import os

from peers_decode import parse_list, rotation_sets, save_results, time_ms, write_table

IMPLS = ["flashkit", "flashkit_decode", "flashkit_varlen", "flashkit_sm90", "flashkit_sm90packed",
         "sdpa_flash", "sdpa_cudnn"]
# The environment each forced flashkit path runs under.
FORCED = {"flashkit": {},
          "flashkit_decode": {"FLASHKIT_FWD_PATH": "decode"},
          "flashkit_sm90": {"FLASHKIT_FWD_PATH": "sm90", "FLASHKIT_SM90_PACK_GQA": "0"},
          "flashkit_sm90packed": {"FLASHKIT_FWD_PATH": "sm90", "FLASHKIT_SM90_PACK_GQA": "1"}}
# The markdown's speedup columns: (flashkit path, peer), the peer's time over the path's.
SPEEDUPS = [("flashkit_decode", "flashkit_sm90"), ("flashkit_sm90packed", "flashkit_sm90"),
            ("flashkit", "sdpa_flash"), ("flashkit", "sdpa_cudnn")]
GRAPH_CALLS = 20  # calls captured per CUDA graph with --graphs


def time_graph_ms(torch, fn, sets):
    """GPU time per call: GRAPH_CALLS calls (cycling the input sets) captured in one CUDA graph
    after a warm-up on a side stream, the graph replayed and timed as time_ms times a call."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for i in range(3):
            fn(i % sets)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(GRAPH_CALLS):
            fn(i % sets)
    return time_ms(torch, lambda i: graph.replay(), 1) / GRAPH_CALLS


def run(args):
    import torch
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel
    import flashkit

    backends = {"sdpa_flash": SDPBackend.FLASH_ATTENTION, "sdpa_cudnn": SDPBackend.CUDNN_ATTENTION}
    l2 = getattr(torch.cuda.get_device_properties(0), "L2_cache_size", 50 << 20)
    hq, hkv, d = args.heads_q, args.heads_kv, 128
    timer = time_graph_ms if args.graphs else time_ms
    records = []
    for sk in args.seqlen_k:
        for batch in args.batch:
            if batch * sk > args.max_tokens:
                continue
            set_bytes = 2 * batch * sk * hkv * d * 2
            sets = rotation_sets(set_bytes, l2)
            kv = [tuple(torch.empty(batch, sk, hkv, d, dtype=torch.bfloat16, device="cuda")
                        .uniform_(-1, 1) for _ in range(2)) for _ in range(sets)]
            for sq in args.seqlen_q:
                q = torch.empty(batch, sq, hq, d, dtype=torch.bfloat16,
                                device="cuda").uniform_(-1, 1)
                with sdpa_kernel([SDPBackend.FLASH_ATTENTION]):
                    expected = F.scaled_dot_product_attention(
                        q.transpose(1, 2), kv[0][0].transpose(1, 2), kv[0][1].transpose(1, 2),
                        enable_gqa=hkv != hq).transpose(1, 2)
                for impl in args.impls:
                    rec = {"op": "fwd", "impl": impl, "dtype": "bf16", "batch": batch,
                           "heads_q": hq, "heads_kv": hkv, "seqlen_q": sq, "seqlen_k": sk,
                           "head_dim": d, "causal": False, "ms": None, "tflops": None,
                           "tbps": None, "timing": "graph" if args.graphs else "per call"}
                    try:
                        if impl == "flashkit_varlen":  # the same batch through the varlen API
                            cu_q = torch.arange(0, (batch + 1) * sq, sq, dtype=torch.int32,
                                                device="cuda")
                            cu_k = torch.arange(0, (batch + 1) * sk, sk, dtype=torch.int32,
                                                device="cuda")

                            def call(i):
                                return flashkit.flash_attn_varlen_func(
                                    q.view(-1, hq, d), kv[i][0].view(-1, hkv, d),
                                    kv[i][1].view(-1, hkv, d), cu_q, cu_k, sq, sk)
                            out = call(0).view(batch, sq, hq, d)
                            rec["ms"] = timer(torch, call, sets)
                        elif impl.startswith("flashkit"):
                            os.environ.update(FORCED[impl])

                            def call(i):
                                return flashkit.flash_attn_func(q, kv[i][0], kv[i][1])
                            out = call(0)
                            rec["ms"] = timer(torch, call, sets)
                        else:
                            def call(i):
                                return F.scaled_dot_product_attention(
                                    q.transpose(1, 2), kv[i][0].transpose(1, 2),
                                    kv[i][1].transpose(1, 2), enable_gqa=hkv != hq)
                            with sdpa_kernel([backends[impl]]):
                                out = call(0).transpose(1, 2)
                                rec["ms"] = timer(torch, call, sets)
                        err = (out.float() - expected.float()).abs().max().item()
                        if not err <= 2e-2:
                            raise RuntimeError(f"output differs from SDPA flash's by {err}")
                        sec = rec["ms"] * 1e-3
                        rec["tbps"] = set_bytes / sec / 1e12
                        rec["tflops"] = 4 * batch * hq * sq * sk * d / sec / 1e12
                    except Exception as e:  # a backend that cannot run the case: null, with why
                        rec["ms"] = None
                        rec["note"] = (str(e).strip().splitlines() or [type(e).__name__])[0][:200]
                    finally:
                        for name in FORCED.get(impl, {}):
                            os.environ.pop(name, None)
                    records.append(rec)
                    print(f"  {impl:16s} b {batch:3d} s_q {sq:3d} s_k {sk:6d}: "
                          f"{rec['ms'] if rec['ms'] is not None else float('nan'):8.4f} ms "
                          f"{rec['tbps'] or float('nan'):6.3f} TB/s {rec.get('note', '')}",
                          flush=True)
            del kv
            torch.cuda.empty_cache()
    return records, torch


def write_markdown(path, result):
    cells = {}
    for r in result["records"]:
        cells.setdefault((r["seqlen_k"], r["batch"], r["seqlen_q"]), {})[r["impl"]] = r["ms"]

    def fmt(x, digits=4):
        return "-" if x is None else f"{x:.{digits}f}"

    def ratio(row, a, b):  # time of b over time of a: > 1 when a is faster
        return None if not row.get(a) or not row.get(b) else row[b] / row[a]
    lines = [f"# short queries: {result['gpu']}, {result['date']}, "
             f"commit {result['git_commit']}", "",
             f"flash_attn_func, bf16, {result['records'][0]['heads_q']}/{result['records'][0]['heads_kv']} heads, "
             "head dim 128, "
             f"no mask; ms per call, timed {result['records'][0]['timing']} (lower is better); "
             "a / b = b's time over a's (> 1: a faster)", "",
             "| s_k | batch | s_q | " + " | ".join(IMPLS) + " | " +
             " | ".join(f"{a.replace('flashkit_', '')} / {b.replace('flashkit_', '')}" for a, b in SPEEDUPS) +
             " |", "|---" * (len(IMPLS) + len(SPEEDUPS) + 3) + "|"]
    for key in sorted(cells):
        row = cells[key]
        lines.append("| " + " | ".join(str(k) for k in key) + " | " +
                     " | ".join(fmt(row.get(i)) for i in IMPLS) + " | " +
                     " | ".join(fmt(ratio(row, a, b), 2) for a, b in SPEEDUPS) + " |")
    write_table(path, lines, result["records"])


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seqlen-q", default="1,4,16,32,64")
    p.add_argument("--seqlen-k", default="2k,8k,32k")
    p.add_argument("--batch", default="1,8,32")
    p.add_argument("--heads-q", type=int, default=32)
    p.add_argument("--heads-kv", type=int, default=8)
    p.add_argument("--max-tokens", default="256k")
    p.add_argument("--graphs", action="store_true",
                   help=f"GPU time per call: {GRAPH_CALLS} calls in a CUDA graph, replayed (no "
                        "host time); default: each call timed eagerly, host time included")
    p.add_argument("--impls", default=",".join(IMPLS), help="a subset of " + ", ".join(IMPLS))
    p.add_argument("--json", required=True)
    p.add_argument("--md")
    args = p.parse_args()
    args.seqlen_q, args.seqlen_k, args.batch = (parse_list(x) for x in
                                                (args.seqlen_q, args.seqlen_k, args.batch))
    args.max_tokens = parse_list(args.max_tokens)[0]
    args.impls = args.impls.split(",")
    if not set(args.impls) <= set(IMPLS):
        p.error(f"--impls: unknown {sorted(set(args.impls) - set(IMPLS))}; known: {', '.join(IMPLS)}")
    records, torch = run(args)
    save_results(torch, args, records, write_markdown)


if __name__ == "__main__":
    main()
