"""python -m flashkit.bench: flashkit's Python front end timed beside PyTorch's attention backends.

Two measurements in one run, on the first CUDA GPU:

1. The calling overhead (the front-end issue's question): the eager per-call time of
   flash_attn_func on a tiny problem (batch 1, seqlen 128, 8 heads, head dim 64, bf16, causal),
   forward and forward + backward, beside SDPA's flash backend and under torch.compile. Host work
   dominates there: a latency measurement, not a throughput one.
2. The standard grid (bf16 and fp16; head dims 64, 128, 256; seqlen 512 ... 16k at 16k tokens per
   batch, 2048 model dim; causal and not) for the forward, the backward and both: flashkit's
   flash_attn_func (impl ``flashkit_py``) beside SDPA's flash, cuDNN and efficient backends and
   FlexAttention, every implementation on one case's input sets before the next case. The
   harness (inputs, warm-up, CUDA-event timing, FLOP counts, records) is bench/peers.py's, with
   shorter runs: warm-up 10 ms, median of >= 10 calls and >= 30 ms; FlexAttention compiled with
   batch and seqlen dynamic (one kernel per dtype, head dim, mask and grad mode; --flex-static
   compiles one per shape, as peers.py). Cases run in the order dtype, head dim, mask, seqlen, op
   until --budget-s seconds have passed; the rest are recorded with a note. bench/report.py then writes
   the results JSON (docs/DESIGN.md format, the overhead numbers in its header) and the markdown
   table with the ratios flashkit_py / peer into --out-dir, and this module a PNG: TFLOP/s against
   seqlen, one panel per (op, dtype) row and (head dim, mask) column.

    python -m flashkit.bench [--quick] [--dtype bf16,fp16] [--hdim 64,128,256]
                             [--seqlen 512,1k,...,16k] [--causal both|yes|no]
                             [--ops fwd,bwd,fwd_bwd] [--impls flashkit_py,sdpa_flash,...]
                             [--budget-s 240] [--flex-static] [--no-overhead] [--no-grid]
                             [--out-dir bench/results] [--json RAW.json] [--no-report]
    python -m flashkit.bench --plot RESULTS.json   # the PNG of an existing results file

The grid needs bench/peers.py and bench/report.py of a flashkit checkout: found through
FLASHKIT_SOURCE_DIR, the current directory or this file's location. Without a CUDA GPU there is
nothing to time: the module says so and exits 0.
"""

from __future__ import annotations

import argparse
import datetime
import importlib.util
import json
import os
import pathlib
import subprocess
import sys
import tempfile
import time
from typing import Callable, Dict, List, Optional

import torch
import torch.nn.functional as F

from flashkit import flash_attn_func

IMPL = "flashkit_py"
PEER_IMPLS = ["sdpa_flash", "sdpa_cudnn", "sdpa_efficient", "flex"]
WARMUP_MS, MIN_TIMED_MS, MIN_REPS = 10.0, 30.0, 10
METHOD_NOTE = (
    "python -m flashkit.bench: flashkit_py is flash_attn_func (autograd, [b, s, h, d] tensors) and "
    "the peers as in bench/peers.py, case by case on the same input sets; shorter runs (warm-up "
    "10 ms, median of >= 10 calls and >= 30 ms); flex compiled with {flex} shapes; tflops = "
    "4*b*h*sq*sk*d / time (x2.5 for bwd, x3.5 for fwd_bwd), halved for causal; bwd times "
    "torch.autograd.grad of a saved forward")


# --- the calling overhead -------------------------------------------------------------------

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


def measure_overhead(batch: int, seqlen: int, heads: int, head_dim: int,
                     iters: int) -> Dict[str, object]:
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
    return {"problem": {"batch": batch, "seqlen": seqlen, "heads": heads, "head_dim": head_dim,
                        "dtype": "bf16", "causal": True, "iters": iters},
            "results": results}


def print_overhead(report: Dict[str, object]) -> None:
    print(f"eager per-call time, {report['problem']}")
    for key, value in report["results"].items():
        shown = value if isinstance(value, str) or value is None else f"{value:8.1f}"
        print(f"  {key:32s} {shown}")


# --- the grid -------------------------------------------------------------------------------

def find_bench_dir() -> pathlib.Path:
    """bench/ of the flashkit checkout (peers.py, report.py)."""
    candidates = []
    if os.environ.get("FLASHKIT_SOURCE_DIR"):
        candidates.append(pathlib.Path(os.environ["FLASHKIT_SOURCE_DIR"]))
    candidates.append(pathlib.Path.cwd())
    candidates += list(pathlib.Path(__file__).resolve().parents)
    for root in candidates:
        if (root / "bench" / "peers.py").is_file() and (root / "bench" / "report.py").is_file():
            return root / "bench"
    raise SystemExit("flashkit.bench: the grid benchmark uses bench/peers.py and bench/report.py "
                     "of a flashkit checkout; run from its root or set FLASHKIT_SOURCE_DIR "
                     "(--no-grid times the calling overhead alone)")


def load_module(path: pathlib.Path, name: str):
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def flashkit_runner(peers):
    """peers.py's runner protocol for flash_attn_func: the sets are [b, h, s, d] views of
    [b, s, h, d] memory, so transposing them back hands flashkit its own layout (no copy)."""
    def run(c, sets, bench):
        def attend(q, k, v):
            out = flash_attn_func(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                  causal=c["causal"])
            return out.transpose(1, 2)
        call, _ = peers.timed_op(torch, attend, c, sets)
        return bench.time_ms(call, len(sets))
    return run


def run_grid(peers, args) -> List[dict]:
    """Records of the results format, case-major: every implementation on one case's input sets
    before the next case, so that a budget cut leaves whole rows; the ops innermost, so that a cut
    drops the last shapes (fp16, large head dims) of every op rather than a whole op."""
    bench = peers.Bench(torch, warmup_ms=WARMUP_MS, min_timed_ms=MIN_TIMED_MS, min_reps=MIN_REPS)
    runners = {}
    for impl in args.impl_list:
        try:
            runners[impl] = (flashkit_runner(peers) if impl == IMPL else
                             peers.impl_runner(torch, impl,
                                               flex_dynamic=False if args.flex_static else None))
        except Exception as error:  # e.g. a torch without flex_attention
            runners[impl] = peers.failing_runner(error)
    grid = sorted(peers.make_grid(args), key=lambda c: (
        args.dtypes.index(c["dtype"]), args.hdims.index(c["head_dim"]), c["causal"],
        args.seqlens.index(c["seqlen"]), args.op_list.index(c["op"])))
    print(f"{len(grid)} cases x {len(runners)} implementations, budget {args.budget_s:g} s",
          flush=True)
    print(f"{'op':<7} {'dtype':<5} {'hdim':>4} {'seqlen':>6} {'causal':>6}  "
          + "  ".join(f"{impl:>14}" for impl in runners), flush=True)
    records, start = [], time.perf_counter()
    for c in grid:
        over = args.budget_s > 0 and time.perf_counter() - start > args.budget_s
        sets = None if over else bench.input_sets(c)
        row = []
        for impl, runner in runners.items():
            if over:
                record = peers.run_case(torch, bench, impl, peers.failing_runner(
                    TimeoutError(f"skipped: past the --budget-s {args.budget_s:g} s")), c, [None])
            else:
                record = peers.run_case(torch, bench, impl, runner, c, sets)
            records.append(record)
            row.append("-" if record["tflops"] is None else f"{record['tflops']:.1f}")
        del sets
        causal = "yes" if c["causal"] else "no"
        print(f"{c['op']:<7} {c['dtype']:<5} {c['head_dim']:>4} {c['seqlen']:>6} {causal:>6}  "
              + "  ".join(f"{cell:>14}" for cell in row), flush=True)
    torch.cuda.empty_cache()
    return records


def plot(results_path: pathlib.Path, png_path: pathlib.Path) -> Optional[pathlib.Path]:
    """TFLOP/s against seqlen: a row per (op, dtype), a column per (head dim, mask), a line per
    implementation. Returns the path, or None (and says why) without matplotlib."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("flashkit.bench: matplotlib is not installed: no plot", file=sys.stderr)
        return None
    data = json.loads(results_path.read_text())
    records = [r for r in data["records"] if r.get("tflops") is not None]
    if not records:
        print("flashkit.bench: no numbers to plot", file=sys.stderr)
        return None
    impls = list(dict.fromkeys(r["impl"] for r in data["records"]))
    colors = {impl: f"C{i}" for i, impl in enumerate(impls)}  # one colour per impl everywhere
    op_order = {"fwd": 0, "bwd": 1, "fwd_bwd": 2}
    rows = sorted({(r["op"], r["dtype"]) for r in records},
                  key=lambda x: (op_order.get(x[0], len(op_order)), x[0], x[1]))
    cols = sorted({(r["head_dim"], bool(r["causal"])) for r in records})
    seqlens = sorted({r["seqlen_q"] for r in records})
    height = 2.4 * len(rows) + 0.9  # 0.9 inch on top for the title and the legend
    fig, axes = plt.subplots(len(rows), len(cols), figsize=(3.2 * len(cols), height),
                             squeeze=False)
    for i, (op, dtype) in enumerate(rows):
        for j, (head_dim, causal) in enumerate(cols):
            ax = axes[i][j]
            for impl in impls:
                points = sorted((r["seqlen_q"], r["tflops"]) for r in records
                                if r["impl"] == impl and r["op"] == op and r["dtype"] == dtype
                                and r["head_dim"] == head_dim and bool(r["causal"]) == causal)
                if points:
                    ax.plot(*zip(*points), marker="o", markersize=3, color=colors[impl],
                            linewidth=2.2 if impl.startswith("flashkit") else 1.2)
            ax.set_xscale("log", base=2)
            ax.set_xticks(seqlens, [f"{s // 1024}k" if s % 1024 == 0 else str(s)
                                    for s in seqlens], fontsize=7)
            ax.minorticks_off()
            ax.set_ylim(bottom=0)
            ax.tick_params(axis="y", labelsize=7)
            ax.set_title(f"{op} {dtype} d{head_dim} {'causal' if causal else 'full'}",
                         fontsize=9)
            ax.grid(True, alpha=0.3)
            if j == 0:
                ax.set_ylabel("TFLOP/s", fontsize=8)
            if i == len(rows) - 1:
                ax.set_xlabel("seqlen", fontsize=8)
    handles = [plt.Line2D([], [], color=colors[impl], marker="o",
                          linewidth=2.2 if impl.startswith("flashkit") else 1.2)
               for impl in impls]
    fig.legend(handles, impls, loc="upper center", ncol=len(impls), fontsize=9,
               bbox_to_anchor=(0.5, 1 - 0.35 / height))
    fig.suptitle(f"{data.get('gpu')}, {str(data.get('date'))[:10]}, flashkit "
                 f"{data.get('git_commit')}: TFLOP/s against seqlen (16k tokens per batch)",
                 fontsize=10)
    fig.tight_layout(rect=(0, 0, 1, 1 - 0.75 / height))
    fig.savefig(png_path, dpi=90)
    plt.close(fig)
    return png_path


def header(peers, overhead, flex_static: bool) -> dict:
    return dict(
        gpu=torch.cuda.get_device_name(0), driver=peers.driver_version(), cuda=torch.version.cuda,
        torch=torch.__version__,
        date=datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
        git_commit=os.environ.get("FLASHKIT_GIT_COMMIT") or "unknown",
        cudnn=torch.backends.cudnn.version(),
        note=METHOD_NOTE.format(flex="static" if flex_static else "automatic dynamic"),
        eager_overhead=overhead)


def report(bench_dir: pathlib.Path, raw: pathlib.Path, out_dir: str) -> List[pathlib.Path]:
    """bench/report.py on the raw results: the merged JSON and the markdown table."""
    written = subprocess.run(
        [sys.executable, str(bench_dir / "report.py"), "--out-dir", out_dir, "--base", IMPL,
         "--what", "python-" + "-".join(sorted({r["op"] for r in
                                                json.loads(raw.read_text())["records"]})),
         str(raw)], check=True, capture_output=True, text=True).stdout.split()
    return [pathlib.Path(p) for p in written]


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    grid = parser.add_argument_group("the grid (as bench/peers.py)")
    grid.add_argument("--dtype", help="comma-separated: bf16,fp16")
    grid.add_argument("--hdim", help="comma-separated head dims, e.g. 64,128,256")
    grid.add_argument("--seqlen", help="comma-separated, k suffix allowed, e.g. 512,1k,16k")
    grid.add_argument("--causal", default="both",
                      choices=["both", "yes", "no", "1", "0", "true", "false"])
    grid.add_argument("--quick", action="store_true",
                      help="bf16, hdim 64 and 128, seqlen 2k and 8k (explicit flags override)")
    grid.add_argument("--ops", default="fwd,bwd,fwd_bwd")
    grid.add_argument("--impls", default=",".join([IMPL] + PEER_IMPLS))
    grid.add_argument("--budget-s", type=float, default=240.0,
                      help="stop starting cases after this many seconds (0: no limit)")
    grid.add_argument("--flex-static", action="store_true",
                      help="compile FlexAttention once per shape (slower to run, as peers.py)")
    parser.add_argument("--no-overhead", action="store_true", help="skip the overhead measurement")
    parser.add_argument("--no-grid", action="store_true", help="the overhead measurement alone")
    parser.add_argument("--iters", type=int, default=2000, help="calls per overhead measurement")
    parser.add_argument("--out-dir", default=None,
                        help="where report.py writes (default: bench/results of the checkout)")
    parser.add_argument("--json", help="also keep the raw results (before report.py) here")
    parser.add_argument("--no-report", action="store_true",
                        help="no report.py and no plot (with --json: what make bench merges)")
    parser.add_argument("--plot", metavar="RESULTS.json",
                        help="only draw the PNG of an existing results file, beside it")
    args = parser.parse_args(argv)
    dtypes = args.dtype or ("bf16" if args.quick else "bf16,fp16")
    hdims = args.hdim or ("64,128" if args.quick else "64,128,256")
    seqlens = args.seqlen or ("2k,8k" if args.quick else "512,1k,2k,4k,8k,16k")
    args.dtypes = dtypes.split(",")
    args.causals = {"both": [False, True], "yes": [True], "1": [True], "true": [True]}.get(
        args.causal, [False])
    args.op_list = args.ops.split(",")
    args.impl_list = args.impls.split(",")
    args.dropout = 0.0  # peers.make_grid's dropout_p of the SDPA backends: none here
    args.gqa = 1  # and its query heads per key / value head: multi-head attention here
    try:
        args.hdims = [int(x) for x in hdims.split(",")]
        args.seqlens = [int(x[:-1]) * 1024 if x[-1:] in "kK" else int(x)
                        for x in seqlens.split(",")]
    except ValueError as error:
        parser.error(f"bad number in a list: {error}")
    for what, values, allowed in (("op", args.op_list, ["fwd", "bwd", "fwd_bwd"]),
                                  ("dtype", args.dtypes, ["bf16", "fp16"]),
                                  ("impl", args.impl_list, [IMPL] + PEER_IMPLS)):
        for bad in [v for v in values if v not in allowed]:
            parser.error(f"{what} '{bad}' is not one of {', '.join(allowed)}")
    return args


def main(argv=None) -> None:
    args = parse_args(argv)
    if args.plot:
        path = pathlib.Path(args.plot)
        png = plot(path, path.with_suffix(".png"))
        if png:
            print(png)
        return
    if not torch.cuda.is_available():
        print("flashkit.bench: no CUDA GPU visible to torch: nothing to time (the CPU backend is "
              "the fp64 reference, not a fast path)")
        return
    print(f"flashkit.bench: {torch.cuda.get_device_name()}, torch {torch.__version__}", flush=True)
    overhead = None
    if not args.no_overhead:
        overhead = measure_overhead(1, 128, 8, 64, args.iters)
        print_overhead(overhead)
    if args.no_grid:
        return
    bench_dir = find_bench_dir()
    peers = load_module(bench_dir / "peers.py", "flashkit_bench_peers")
    records = run_grid(peers, args)
    with tempfile.TemporaryDirectory() as tmp:
        raw = pathlib.Path(args.json) if args.json else pathlib.Path(tmp) / "python.json"
        peers.write_json(str(raw), header(peers, overhead, args.flex_static), records)
        if args.no_report:
            print(f"flashkit.bench: raw results in {raw}")
            return
        out_dir = args.out_dir or str(bench_dir / "results")
        written = report(bench_dir, raw, out_dir)
    json_path, md_path = written[0], written[1]
    print()
    print(md_path.read_text())
    png = plot(json_path, json_path.with_suffix(".png"))
    print(f"flashkit.bench: wrote {json_path} {md_path}" + (f" {png}" if png else ""))


if __name__ == "__main__":
    main()
