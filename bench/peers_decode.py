#!/usr/bin/env python3
"""bench/peers_decode.py: PyTorch SDPA's flash and cuDNN backends and FlashInfer's decode on
flashkit_bench_decode's grid, and the merged decode results (JSON in the docs/DESIGN.md format + a
markdown table with ratios).

Shapes as flashkit_bench_decode: bf16, seqlen_q 1, heads 32 / heads_kv (8), head dim 128, every
sequence holding the whole cache. SDPA has no paged cache: q is a [b, h, 1, d] view of [b, 1, h, d]
memory and k / v are [b, h_kv, s, d] views of [b, s, h_kv, d] memory, as flashkit reads them; GQA
through enable_gqa=True. FlashInfer (BatchDecodeWithPagedKVCacheWrapper, NHD, planned once per
shape outside the timing) reads the same paged caches as flashkit: 16- and 256-token pages, randperm
page tables. Its contiguous API is single_decode_with_kv_cache, one sequence: the contiguous column
holds it at batch 1 only (a batch as one page per sequence would be a misuse: FlashInfer splits a
sequence's work by pages). `flashinfer` is its default CUDA-core decode kernel, `flashinfer_tc` its
tensor-core path (use_tensor_cores=True). FlashInfer compiles its
kernels on first use (nvcc; FLASHINFER_CUDA_ARCH_LIST picks the arch); where it is not importable
its records say so. tbps counts the bytes of K and V once, as for flashkit. Method: warm-up >= 25 ms
in >= 2 batches, CUDA events around each call, median of >= 20 calls and >= 100 ms, cache sets
rotated past 2x L2.

usage: peers_decode.py [--batch 1,8,64,256] [--cache 1k,8k,32k,128k] [--heads-kv 8]
                       [--max-tokens 2048k] [--flashkit PATH] --json OUT.json [--md OUT.md]
"""
import argparse
import json
import math
import os
import statistics
import sys

IMPLS = ["sdpa_flash", "sdpa_cudnn", "flashinfer", "flashinfer_tc"]
FLASHINFER_LAYOUTS = {"contiguous": None, "paged16": 16, "paged256": 256}  # None: single decode
KV_VALUE = 0.0115  # every K and V element: the output is this value whatever the weights


def parse_list(text):
    return [int(x[:-1]) * 1024 if x[-1] in "kK" else int(x) for x in text.split(",")]


def rotation_sets(set_bytes, l2_bytes):
    """How many copies of an input set of set_bytes to rotate through so that a call never finds
    its inputs in an L2 of l2_bytes (the rotation spans more than twice the L2)."""
    return max(1, (2 * l2_bytes) // set_bytes + 1)


def time_ms(torch, fn, sets):
    def event():
        return torch.cuda.Event(enable_timing=True)
    calls, warm, batch, rnd = 0, 0.0, 3, 0
    while True:
        b, e = event(), event()
        b.record()
        for _ in range(batch):
            fn(calls % sets)
            calls += 1
        e.record()
        e.synchronize()
        ms = b.elapsed_time(e)
        warm += ms
        est = max(ms / batch, 1e-3)
        if rnd >= 1 and warm >= 25.0:
            break
        batch = max(3, math.ceil((25.0 - warm) / est))
        rnd += 1
    reps = min(2000, max(20, math.ceil(100.0 / est)))
    events = [(event(), event()) for _ in range(reps)]
    for i, (b, e) in enumerate(events):
        b.record()
        fn(i % sets)
        e.record()
    torch.cuda.synchronize()
    return statistics.median(b.elapsed_time(e) for b, e in events)


def run_peers(args):
    import torch
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel
    backends = {"sdpa_flash": SDPBackend.FLASH_ATTENTION, "sdpa_cudnn": SDPBackend.CUDNN_ATTENTION}
    l2 = getattr(torch.cuda.get_device_properties(0), "L2_cache_size", 50 << 20)
    records = []
    hq, hkv, d = 32, args.heads_kv, 128
    for cache in args.caches:
        for batch in args.batches:
            if batch * cache > args.max_tokens:
                continue
            set_bytes = 2 * batch * cache * hkv * d * 2
            sets = rotation_sets(set_bytes, l2)
            q = torch.empty(batch, 1, hq, d, dtype=torch.bfloat16, device="cuda").uniform_(-1, 1)
            q = q.transpose(1, 2)
            kv = []
            for _ in range(sets):
                k, v = (torch.full((batch, cache, hkv, d), KV_VALUE, dtype=torch.bfloat16,
                                   device="cuda") for _ in range(2))
                kv.append((k.transpose(1, 2), v.transpose(1, 2)))

            def sdpa_call():
                return lambda i: F.scaled_dot_product_attention(q, kv[i][0], kv[i][1],
                                                                enable_gqa=hkv != hq)
            for impl in [i for i in args.impls if i.startswith("sdpa")]:
                with sdpa_kernel([backends[impl]]):
                    records.append(measure(torch, impl, "contiguous", (batch, hq, hkv, cache, d),
                                           sets, sdpa_call))
            del kv
            for impl in [i for i in args.impls if i.startswith("flashinfer")]:
                records += run_flashinfer(torch, impl, q.transpose(1, 2)[:, 0], cache, hkv, sets)
            torch.cuda.empty_cache()
    return records, torch


def print_record(rec):
    ms, tbps = (float("nan") if rec[k] is None else rec[k] for k in ("ms", "tbps"))
    print(f"  {rec['impl']:13s} {rec['layout']:10s} batch {rec['batch']:4d} cache "
          f"{rec['seqlen_k']:7d}: {ms:8.4f} ms  {tbps:6.3f} TB/s {rec.get('note', '')}", flush=True)


def measure(torch, impl, layout, shape, sets, make_call):
    """One decode record of shape (batch, heads_q, heads_kv, cache, head_dim): make_call() returns
    the call(i) to time over the cache sets, or raises where the implementation cannot run the case.
    Its first output must be KV_VALUE everywhere (the weighted mean of equal values). Any failure
    leaves the record's numbers null, with the reason."""
    batch, hq, hkv, cache, d = shape
    rec = {"op": "decode", "impl": impl, "dtype": "bf16", "batch": batch, "heads_q": hq,
           "heads_kv": hkv, "seqlen_q": 1, "seqlen_k": cache, "head_dim": d, "causal": False,
           "window": [-1, -1], "layout": layout, "ms": None, "tflops": None, "tbps": None}
    try:
        call = make_call()
        out = call(0).float()
        if not torch.allclose(out, torch.full_like(out, KV_VALUE), rtol=1e-2):
            raise RuntimeError("wrong output: not the weighted mean of equal values")
        rec["ms"] = time_ms(torch, call, sets)
        rec["tbps"] = 2 * batch * cache * hkv * d * 2 / (rec["ms"] * 1e-3) / 1e12
    except Exception as e:  # an implementation that cannot run the case: null with the reason
        lines = str(e).strip().splitlines()
        rec["note"] = lines[0][:200] if lines else type(e).__name__
    print_record(rec)
    return rec


def run_flashinfer(torch, impl, q, cache, hkv, sets):
    """FlashInfer's batch decode of q [batch, heads, d] over each layout of FLASHINFER_LAYOUTS: one
    record per layout, null with the reason where FlashInfer is missing or fails."""
    batch, hq, d = q.shape
    try:
        import flashinfer
        workspace = torch.zeros(128 << 20, dtype=torch.uint8, device="cuda")
        missing = None
    except Exception as e:  # not installed, or its import fails on this machine
        missing = f"flashinfer is not importable: {type(e).__name__}: {str(e)[:150]}"
    tc = impl == "flashinfer_tc"

    def caches(*shape):
        return [tuple(torch.full(shape, KV_VALUE, dtype=torch.bfloat16, device="cuda")
                      for _ in range(2)) for _ in range(sets)]

    def flashinfer_call(page):
        if missing:
            raise RuntimeError(missing)
        if page is None:
            if batch != 1:
                raise RuntimeError("FlashInfer's contiguous decode (single_decode_with_kv_cache) "
                                   "takes one sequence: see its paged columns")
            kv = caches(cache, hkv, d)
            return lambda i: flashinfer.single_decode_with_kv_cache(
                q[0], *kv[i], "NHD", use_tensor_cores=tc)[None]
        per_seq = -(-cache // page)
        pages = batch * per_seq
        dev = dict(dtype=torch.int32, device="cuda")
        wrapper = flashinfer.BatchDecodeWithPagedKVCacheWrapper(workspace, "NHD",
                                                                use_tensor_cores=tc)
        wrapper.plan(torch.arange(batch + 1, **dev) * per_seq,
                     torch.randperm(pages, device="cuda").to(torch.int32),
                     torch.full((batch,), cache - (per_seq - 1) * page, **dev), hq, hkv, d, page,
                     q_data_type=torch.bfloat16, kv_data_type=torch.bfloat16)
        kv = caches(pages, page, hkv, d)
        return lambda i: wrapper.run(q, kv[i])

    return [measure(torch, impl, layout, (batch, hq, hkv, cache, d), sets,
                    lambda page=page: flashinfer_call(page))
            for layout, page in FLASHINFER_LAYOUTS.items()]


def write_markdown(path, result):
    cells = {}
    for r in result["records"]:
        key = (r["batch"], r["seqlen_k"])
        cells.setdefault(key, {})[(r["impl"], r.get("layout", "contiguous"))] = r["tbps"]
    cols = [("flashkit", "contiguous"), ("flashkit", "paged16"), ("flashkit", "paged256"),
            ("sdpa_flash", "contiguous"), ("sdpa_cudnn", "contiguous")]
    cols += [(impl, layout) for impl in ("flashinfer", "flashinfer_tc")
             for layout in FLASHINFER_LAYOUTS
             if any(row.get((impl, layout)) for row in cells.values())]
    # (name, numerator column, denominator column)
    ratios = [("flashkit / cuDNN", cols[0], cols[4]), ("paged16 / contiguous", cols[1], cols[0])]
    ratios += [(f"flashkit / {impl} {layout}", ("flashkit", layout), (impl, layout))
               for impl, layout in cols[5:]]

    def fmt(x):
        return "-" if x is None else f"{x:.2f}"
    lines = [f"# decode: {result['gpu']}, {result['date']}, commit {result['git_commit']}", "",
             "bf16, seqlen_q 1, heads 32/" + str(result["records"][0]["heads_kv"]) +
             ", head dim 128; TB/s of K+V read (higher is better)", "",
             "| batch | cache | " + " | ".join(f"{i} {l}" for i, l in cols) + " | " +
             " | ".join(name for name, _, _ in ratios) + " |",
             "|---" * (len(cols) + len(ratios) + 2) + "|"]
    for (b, s) in sorted(cells):
        row = cells[(b, s)]
        quotients = [row[n] / row[m] if row.get(n) and row.get(m) else None for _, n, m in ratios]
        lines.append(f"| {b} | {s} | " + " | ".join(fmt(row.get(c)) for c in cols) + " | " +
                     " | ".join(fmt(x) for x in quotients) + " |")
    write_table(path, lines, result["records"])


def save_results(torch, args, records, write_markdown, **extra):
    """The run's JSON (GPU, driver, versions, UTC time, FLASHKIT_GIT_COMMIT, the records and
    `extra`) at args.json, and its markdown at args.md when given."""
    import datetime
    import subprocess
    try:
        driver = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                                capture_output=True, text=True).stdout.strip()
    except OSError:  # no nvidia-smi on the PATH
        driver = None
    result = {"gpu": torch.cuda.get_device_name(0), "driver": driver, "torch": torch.__version__,
              "cudnn": torch.backends.cudnn.version(),
              "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
              "git_commit": os.environ.get("FLASHKIT_GIT_COMMIT", "unknown"), **extra,
              "records": records}
    with open(args.json, "w") as f:
        json.dump(result, f, indent=1)
    if args.md:
        write_markdown(args.md, result)


def write_table(path, lines, records):
    """Writes a markdown table's lines to path, then why each empty cell is empty."""
    notes = sorted({(r["impl"], r["note"]) for r in records if r.get("note")})
    if notes:
        lines = lines + ["", "Cells left empty:"] + [f"- {impl}: {note}" for impl, note in notes]
    with open(path, "w") as f:
        f.write("\n".join(lines) + "\n")


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--batch", default="1,8,64,256")
    p.add_argument("--cache", default="1k,8k,32k,128k")
    p.add_argument("--heads-kv", type=int, default=8)
    p.add_argument("--max-tokens", default="2048k")
    # flashkit_bench_decode's other grid flags, taken so that one argument list drives both: the
    # peers read contiguous caches with their own split choice, so these select nothing here.
    p.add_argument("--pages", help="flashkit only (the peers' caches are contiguous)")
    p.add_argument("--splits", help="flashkit only (the peers choose their own splits)")
    p.add_argument("--append", action="store_true", help="flashkit only (the peers do not append)")
    p.add_argument("--impls", default=",".join(IMPLS))
    p.add_argument("--flashkit", help="flashkit_bench_decode's JSON to merge")
    p.add_argument("--json", required=True)
    p.add_argument("--md")
    args = p.parse_args()
    args.batches = parse_list(args.batch)
    args.caches = parse_list(args.cache)
    args.max_tokens = parse_list(args.max_tokens)[0]
    args.impls = args.impls.split(",")
    records, torch = run_peers(args)
    result = {"gpu": torch.cuda.get_device_name(0), "driver": os.environ.get("FLASHKIT_DRIVER"),
              "cuda": torch.version.cuda, "torch": torch.__version__, "date": None,
              "git_commit": os.environ.get("FLASHKIT_GIT_COMMIT", "unknown"), "records": []}
    if args.flashkit:
        with open(args.flashkit) as f:
            mine = json.load(f)
        result["date"] = mine["date"]
        result["records"].extend(mine["records"])
    if result["date"] is None:
        import datetime
        result["date"] = datetime.date.today().isoformat()
    result["records"].extend(records)
    result["note"] = ("tbps = bytes of K and V read (2*b*s*h_kv*d*2) / median time; SDPA backends "
                      "on contiguous caches with enable_gqa; FlashInfer on paged caches as "
                      "flashkit's, contiguous only at batch 1 (single_decode_with_kv_cache)")
    if any(r["impl"].startswith("flashinfer") for r in records):
        try:
            import flashinfer
            result["flashinfer"] = flashinfer.__version__
        except Exception:
            pass
    with open(args.json, "w") as f:
        json.dump(result, f, indent=1)
    if args.md:
        write_markdown(args.md, result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
