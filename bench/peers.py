#!/usr/bin/env python3
"""bench/peers.py: times PyTorch's attention backends on flashkit_bench's grid.

Runs on the GPU machine (PyTorch with CUDA). For each op (--ops: fwd, the forward; bwd, the backward
alone, as torch.autograd.grad of a saved forward; fwd_bwd, both) and each case of the grid (same
flags and defaults as flashkit_bench: batch = 16384 / seqlen, heads = 2048 / hdim) it times
  sdpa_flash      scaled_dot_product_attention under SDPBackend.FLASH_ATTENTION (FlashAttention-2)
  sdpa_cudnn      ... under SDPBackend.CUDNN_ATTENTION
  sdpa_efficient  ... under SDPBackend.EFFICIENT_ATTENTION
  flex            flex_attention compiled with torch.compile (static shapes; a causal block mask)
  fa3             FlashAttention-3's flash_attn_func (its `flash_attn_interface` module, built from
                  the public source: scripts/build_fa3.sh), only when asked for with --impls
on [b, h, s, d] views made by transposing [b, s, h, d] tensors, so memory is laid out as flashkit's.
The method mirrors flashkit_bench: inputs uniform in [-1, 1), rotated among enough sets to exceed
twice the L2; warm-up in batches until 25 ms (at least two batches, so that compilation stays out of
the estimate); CUDA events around each call, median of >= 20 calls and >= 100 ms. A backend that
fails a case gets tflops null and a note (the exception's first line). The JSON (docs/DESIGN.md
format) is rewritten after every case; cases run backend by backend, flex last, since its compiles
cost the most time.

usage: peers.py [--dtype bf16,fp16] [--hdim 64,128,256] [--seqlen 512,1k,...,16k]
                [--causal both|yes|no] [--quick] [--ops fwd,bwd,fwd_bwd]
                [--impls sdpa_flash,...,flex] [--json PATH] [--dropout P] [--gqa G] [--energy]
--gqa G: heads / G key / value heads (SDPA and flex with enable_gqa, FA3 natively), as flashkit_bench.
--energy adds the energy per call and the mean power (records get "joules" and "watts"), from the
GPU's energy counter over 1 s more of calls per case, as flashkit_bench --energy measures them.
Environment: FLASHKIT_GIT_COMMIT, FLASHKIT_DRIVER (as for flashkit_bench).
"""
import argparse
import datetime
import json
import math
import os
import statistics
import subprocess
import sys
import warnings

TOTAL_TOKENS = 16384  # batch * seqlen of every grid shape
MODEL_DIM = 2048  # heads * head_dim of every grid shape
WARMUP_MS = 25.0
MIN_WARMUP_CALLS = 3
MIN_TIMED_MS = 100.0
MIN_REPS, MAX_REPS = 20, 2000
ENERGY_MS = 1000.0  # --energy: calls back to back for this long between two energy readings
IMPLS = ["sdpa_flash", "sdpa_cudnn", "sdpa_efficient", "flex"]
# Peers that run only when named (not installed by this project's files).
OPTIONAL_IMPLS = ["fa3"]
ALL_IMPLS = IMPLS + OPTIONAL_IMPLS
OPS = ["fwd", "bwd", "fwd_bwd"]
# FLOPs of each op in units of the forward's 4*b*h*sq*sk*d (the FlashAttention convention: the
# backward's five matrix products against the forward's two).
OP_FLOP_FACTOR = {"fwd": 1.0, "bwd": 2.5, "fwd_bwd": 3.5}
METHOD_NOTE = (
    "tflops = 4*b*h*sq*sk*d / time (x2.5 for bwd, x3.5 for fwd_bwd), halved for causal (the "
    "FlashAttention convention, not the exact count of unmasked pairs); bwd times "
    "torch.autograd.grad of a saved forward; time = median of CUDA-event-timed calls after warm-up (>= 20 "
    "calls and >= 100 ms), inputs uniform in [-1, 1) in [b, h, s, d] views of [b, s, h, d] "
    "memory, rotated past 2x L2; outputs checked for NaN/inf")


def parse_seqlen(text):
    value = int(text[:-1]) * 1024 if text[-1:] in ("k", "K") else int(text)
    if value <= 0:
        raise ValueError(text)
    return value


def parse_args():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--dtype", help="comma-separated: bf16,fp16")
    p.add_argument("--hdim", help="comma-separated head dims, e.g. 64,128,256")
    p.add_argument("--seqlen", help="comma-separated, k suffix allowed, e.g. 512,1k,16k")
    p.add_argument("--causal", default="both",
                   choices=["both", "yes", "no", "1", "0", "true", "false"])
    p.add_argument("--quick", action="store_true",
                   help="bf16, hdim 64 and 128, seqlen 2k and 8k (explicit flags still override)")
    p.add_argument("--ops", default=",".join(OPS), help="comma-separated subset of " + ",".join(OPS))
    p.add_argument("--impls", default=",".join(IMPLS),
                   help="comma-separated subset of " + ",".join(ALL_IMPLS))
    p.add_argument("--json", help="write the results (docs/DESIGN.md format) to this path")
    p.add_argument("--dropout", type=float, default=0.0,
                   help="dropout_p of the SDPA backends (flex has none); records get \"dropout\"")
    p.add_argument("--gqa", type=int, default=1,
                   help="query heads per key / value head (grouped-query attention); records get heads_kv")
    p.add_argument("--energy", action="store_true",
                   help="also the energy per call and the mean power (NVML's energy counter)")
    args = p.parse_args()
    if not 0.0 <= args.dropout < 1.0:
        p.error(f"--dropout takes a probability in [0, 1), not {args.dropout}")

    dtypes = args.dtype or ("bf16" if args.quick else "bf16,fp16")
    hdims = args.hdim or ("64,128" if args.quick else "64,128,256")
    seqlens = args.seqlen or ("2k,8k" if args.quick else "512,1k,2k,4k,8k,16k")
    try:
        args.hdims = [int(x) for x in hdims.split(",")]
        args.seqlens = [parse_seqlen(x) for x in seqlens.split(",")]
    except ValueError as e:
        p.error(f"bad number in a list: {e}")
    for d in args.hdims:
        if args.gqa < 1 or max(1, MODEL_DIM // d) % args.gqa:
            p.error(f"--gqa {args.gqa} does not divide head dim {d}'s {max(1, MODEL_DIM // d)} heads")
    args.dtypes = dtypes.split(",")
    args.causals = {"both": [False, True], "yes": [True], "1": [True], "true": [True]}.get(
        args.causal, [False])
    args.impl_list = args.impls.split(",")
    args.op_list = args.ops.split(",")
    for bad in [o for o in args.op_list if o not in OPS]:
        p.error(f"op '{bad}' is not one of {', '.join(OPS)}")
    for bad in [d for d in args.dtypes if d not in ("bf16", "fp16")]:
        p.error(f"dtype '{bad}' is not bf16 or fp16")
    for bad in [i for i in args.impl_list if i not in ALL_IMPLS]:
        p.error(f"impl '{bad}' is not one of {', '.join(ALL_IMPLS)}")
    return args


def make_grid(args):
    """The cases in flashkit_bench's order: op, dtype, head dim, causal, seqlen."""
    return [dict(op=op, dtype=dt, batch=max(1, TOTAL_TOKENS // s), heads=max(1, MODEL_DIM // d),
                 seqlen=s, head_dim=d, causal=causal, dropout=args.dropout, group=args.gqa)
            for op in args.op_list for dt in args.dtypes for d in args.hdims
            for causal in args.causals for s in args.seqlens]


def case_flops(c):
    flops = 4.0 * c["batch"] * c["heads"] * c["seqlen"] ** 2 * c["head_dim"]
    flops *= OP_FLOP_FACTOR[c["op"]]
    return flops / 2 if c["causal"] else flops


def first_line(text):
    lines = str(text).strip().splitlines()
    return lines[0] if lines else ""


def driver_version():
    """nvidia-smi's driver version: FLASHKIT_DRIVER, else nvidia-smi, else the kernel module."""
    if os.environ.get("FLASHKIT_DRIVER"):
        return os.environ["FLASHKIT_DRIVER"]
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=30)
        if out.returncode == 0 and out.stdout.strip():
            return out.stdout.strip().splitlines()[0]
    except (OSError, subprocess.TimeoutExpired):
        pass
    try:
        with open("/proc/driver/nvidia/version") as f:
            return f.readline().split("Kernel Module")[1].split()[0]
    except (OSError, IndexError):
        return None


class EnergyMeter:
    """The GPU's energy counter (NVML's total energy since the driver loaded, in mJ), read through
    libnvidia-ml with ctypes, as flashkit_bench --energy reads it (bench/energy_meter.h). Raises
    OSError or RuntimeError where it cannot be read."""

    def __init__(self, torch):
        import ctypes
        self.ctypes = ctypes
        self.lib = ctypes.CDLL("libnvidia-ml.so.1")
        if self.lib.nvmlInit_v2() != 0:
            raise RuntimeError("nvmlInit failed")
        self.device = ctypes.c_void_p()
        props = torch.cuda.get_device_properties(torch.cuda.current_device())
        if all(hasattr(props, f) for f in ("pci_domain_id", "pci_bus_id", "pci_device_id")):
            bus_id = f"{props.pci_domain_id:08x}:{props.pci_bus_id:02x}:{props.pci_device_id:02x}.0"
            found = self.lib.nvmlDeviceGetHandleByPciBusId_v2(bus_id.encode(), ctypes.byref(self.device))
        elif "CUDA_VISIBLE_DEVICES" not in os.environ:  # CUDA's and NVML's indices agree
            found = self.lib.nvmlDeviceGetHandleByIndex_v2(torch.cuda.current_device(), ctypes.byref(self.device))
        else:
            raise RuntimeError("cannot match the CUDA device to NVML's (no PCI ids in torch)")
        if found != 0:
            raise RuntimeError("no NVML device for the current CUDA device")
        if self.millijoules() is None:
            raise RuntimeError("this GPU has no total-energy counter")

    def millijoules(self):
        mj = self.ctypes.c_ulonglong()
        if self.lib.nvmlDeviceGetTotalEnergyConsumption(self.device, self.ctypes.byref(mj)) != 0:
            return None
        return float(mj.value)


class Bench:
    """Times callables on the current CUDA device with flashkit_bench's method; with an
    EnergyMeter, also the energy per call (last_energy: (joules, watts) of the last time_ms)."""

    def __init__(self, torch, warmup_ms=WARMUP_MS, min_timed_ms=MIN_TIMED_MS, min_reps=MIN_REPS,
                 energy=None):
        self.torch = torch
        self.energy, self.last_energy = energy, None
        props = torch.cuda.get_device_properties(0)
        self.l2_bytes = getattr(props, "L2_cache_size", 50 << 20)
        # Shorter runs (python -m flashkit.bench) trade a little precision for a grid in minutes.
        self.warmup_ms, self.min_timed_ms, self.min_reps = warmup_ms, min_timed_ms, min_reps

    def input_sets(self, c):
        """Sets of (q, k, v): [b, h, s, d] views of [b, s, h, d] memory, enough to pass 2x L2
        (k and v with heads / group heads). For the backward ops, q, k and v require gradients and
        each set has a dout as well."""
        torch = self.torch
        dtype = torch.bfloat16 if c["dtype"] == "bf16" else torch.float16
        shape = (c["batch"], c["seqlen"], c["heads"], c["head_dim"])
        kv_shape = (c["batch"], c["seqlen"], c["heads"] // c.get("group", 1), c["head_dim"])
        backward = c["op"] != "fwd"
        shapes = [shape, kv_shape, kv_shape] + ([shape] if backward else [])
        set_bytes = sum(math.prod(s) for s in shapes) * 2
        sets = max(1, math.ceil(2 * self.l2_bytes / set_bytes))
        gen = torch.Generator(device="cuda").manual_seed(0)

        def tensor(shape, grad):
            t = torch.empty(shape, dtype=dtype, device="cuda").uniform_(-1, 1, generator=gen)
            return t.transpose(1, 2).requires_grad_(grad)
        return [tuple(tensor(s, backward and i < 3) for i, s in enumerate(shapes)) for _ in range(sets)]

    def time_ms(self, fn, sets):
        """Median ms of fn(i % sets) calls; returns (ms, the last call's output)."""
        torch = self.torch

        def event():
            return torch.cuda.Event(enable_timing=True)
        calls, warm_ms, batch, rnd = 0, 0.0, MIN_WARMUP_CALLS, 0
        while True:
            begin, end = event(), event()
            begin.record()
            for _ in range(batch):
                fn(calls % sets)
                calls += 1
            end.record()
            end.synchronize()
            ms = begin.elapsed_time(end)
            warm_ms += ms
            # From the last batch only: the first may include compilation.
            estimate = max(ms / batch, 1e-3)
            if rnd >= 1 and warm_ms >= self.warmup_ms:
                break
            batch = max(MIN_WARMUP_CALLS, math.ceil((self.warmup_ms - warm_ms) / estimate))
            rnd += 1
        reps = min(MAX_REPS, max(self.min_reps, math.ceil(self.min_timed_ms / estimate)))
        events = [(event(), event()) for _ in range(reps)]
        out = None
        for i, (b, e) in enumerate(events):
            b.record()
            out = fn(i % sets)
            e.record()
        torch.cuda.synchronize()
        ms = statistics.median(b.elapsed_time(e) for b, e in events)
        self.last_energy = None
        if self.energy is not None:
            reps = math.ceil(ENERGY_MS / max(ms, 1e-3))
            before = self.energy.millijoules()
            begin, end = event(), event()
            begin.record()
            for i in range(reps):
                out = fn(i % sets)
            end.record()
            end.synchronize()
            after = self.energy.millijoules()
            if before is not None and after is not None and after > before:
                self.last_energy = ((after - before) * 1e-3 / reps, (after - before) / begin.elapsed_time(end))
        return ms, out


def timed_op(torch, attend, c, sets):
    """call(i) for the case's op on input set i: the forward; the backward of a forward saved once
    per set (torch.autograd.grad, graph retained); or both. Returns (call, the saved outputs)."""
    if c["op"] == "fwd":
        return (lambda i: attend(*sets[i])), None
    if c["op"] == "fwd_bwd":
        def fwd_bwd(i):
            q, k, v, dout = sets[i]
            return torch.autograd.grad(attend(q, k, v), (q, k, v), dout)[0]
        return fwd_bwd, None
    saved = [attend(q, k, v) for q, k, v, _ in sets]

    def bwd(i):
        q, k, v, dout = sets[i]
        return torch.autograd.grad(saved[i], (q, k, v), dout, retain_graph=True)[0]
    return bwd, saved


def impl_runner(torch, impl, flex_dynamic=False):
    """Returns run(case, input_sets, bench) -> (ms, out) for one implementation (out: the forward's
    output, or dq for the backward ops). flex_dynamic=None compiles flex with torch's automatic
    dynamic shapes over batch and seqlen (heads and head dim stay static: a few kernels for the
    whole grid instead of one per shape)."""
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    if impl == "fa3":
        import flash_attn_interface  # FlashAttention-3's own module name

        def run_fa3(c, sets, bench):
            if c["dropout"] > 0:
                raise NotImplementedError("FlashAttention-3 has no dropout")

            def attend(q, k, v):  # [b, h, s, d] views of [b, s, h, d] memory: FA3 takes the latter
                out = flash_attn_interface.flash_attn_func(q.transpose(1, 2), k.transpose(1, 2),
                                                           v.transpose(1, 2), causal=c["causal"])
                out = out[0] if isinstance(out, tuple) else out
                return out.transpose(1, 2)
            call, _ = timed_op(torch, attend, c, sets)
            return bench.time_ms(call, len(sets))
        return run_fa3

    if impl != "flex":
        backend = {"sdpa_flash": SDPBackend.FLASH_ATTENTION,
                   "sdpa_cudnn": SDPBackend.CUDNN_ATTENTION,
                   "sdpa_efficient": SDPBackend.EFFICIENT_ATTENTION}[impl]

        def run_sdpa(c, sets, bench):
            def attend(q, k, v):
                return F.scaled_dot_product_attention(q, k, v, is_causal=c["causal"],
                                                      dropout_p=c["dropout"],
                                                      enable_gqa=c.get("group", 1) > 1)
            with sdpa_kernel([backend]):
                call, _ = timed_op(torch, attend, c, sets)
                return bench.time_ms(call, len(sets))
        return run_sdpa

    from torch.nn.attention.flex_attention import create_block_mask, flex_attention
    # One compiled kernel per shape (static shapes, as flex is benchmarked upstream): let dynamo
    # keep them all instead of falling back to eager after its default limit of 8.
    for name in ("recompile_limit", "cache_size_limit", "accumulated_recompile_limit",
                 "accumulated_cache_size_limit"):
        if hasattr(torch._dynamo.config, name):
            setattr(torch._dynamo.config, name, 1024)
    flex = torch.compile(flex_attention, dynamic=flex_dynamic)

    def causal_mask(b, h, q_idx, kv_idx):
        return q_idx >= kv_idx

    def run_flex(c, sets, bench):
        if c["dropout"] > 0:
            raise NotImplementedError("flex_attention has no dropout")
        s = c["seqlen"]
        mask = create_block_mask(causal_mask, None, None, s, s, device="cuda") if c["causal"] \
            else None
        if flex_dynamic is None:  # batch and seqlen symbolic from the first compile on
            for t in (t for tensors in sets for t in tensors[:3]):
                torch._dynamo.mark_static(t, 1)
                torch._dynamo.mark_static(t, 3)
                torch._dynamo.maybe_mark_dynamic(t, 0)
                torch._dynamo.maybe_mark_dynamic(t, 2)
        gqa = c.get("group", 1) > 1
        call, _ = timed_op(torch, lambda q, k, v: flex(q, k, v, block_mask=mask, enable_gqa=gqa), c, sets)
        return bench.time_ms(call, len(sets))
    return run_flex


def failing_runner(error):
    """A runner for an implementation that could not be set up: each case reports `error`."""
    def run(c, sets, bench):
        raise error
    return run


def run_case(torch, bench, impl, runner, c, sets=None):
    """One record of the results format. sets: input sets of bench.input_sets(c) to reuse."""
    record = dict(op=c["op"], impl=impl, dtype=c["dtype"], batch=c["batch"], heads_q=c["heads"],
                  heads_kv=c["heads"] // c.get("group", 1), seqlen_q=c["seqlen"], seqlen_k=c["seqlen"],
                  head_dim=c["head_dim"], causal=c["causal"], window=[-1, -1], ms=None,
                  tflops=None, tbps=None)
    if c["dropout"] > 0:
        record["dropout"] = c["dropout"]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            ms, out = runner(c, sets or bench.input_sets(c), bench)
            record["ms"] = round(ms, 6)
            energy = getattr(bench, "last_energy", None)  # (stand-ins for Bench may not measure it)
            if energy is not None:
                record["joules"] = round(energy[0], 6)
                record["watts"] = round(energy[1], 1)
            if not bool(torch.isfinite(out).all()):
                record["note"] = "output has NaN/inf"
            else:
                record["tflops"] = round(case_flops(c) / (ms * 1e9), 2)
        except Exception as e:  # any failure of a backend on a case is a result, not a crash
            note = f"{type(e).__name__}: {first_line(e)}"
            reasons = [first_line(w.message) for w in caught if issubclass(w.category, UserWarning)]
            if reasons:
                note += f" (warning: {reasons[0]})"
            record["note"] = note
    return record


def write_json(path, header, records):
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(dict(header, records=records), f, indent=1)
        f.write("\n")
    os.replace(tmp, path)


def main():
    args = parse_args()
    try:
        import torch
    except ImportError:
        sys.exit("peers.py: PyTorch is not installed; it runs on the GPU machine")
    if not torch.cuda.is_available():
        sys.exit("peers.py: no CUDA device visible to PyTorch")

    header = dict(
        gpu=torch.cuda.get_device_name(0), driver=driver_version(), cuda=torch.version.cuda,
        torch=torch.__version__,
        date=datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
        git_commit=os.environ.get("FLASHKIT_GIT_COMMIT") or "unknown",
        cudnn=torch.backends.cudnn.version(), triton=None, note=METHOD_NOTE)
    try:
        import triton
        header["triton"] = triton.__version__
    except ImportError:
        pass
    print(f"peers.py: {header['gpu']}, driver {header['driver']}, CUDA {header['cuda']}, torch "
          f"{header['torch']}, cuDNN {header['cudnn']}, triton {header['triton']}", flush=True)

    energy = None
    if args.energy:
        try:
            energy = EnergyMeter(torch)
        except (OSError, RuntimeError, AttributeError) as e:
            sys.exit(f"peers.py: --energy: {e}")
    bench = Bench(torch, energy=energy)
    grid = make_grid(args)
    records = []
    print(f"{'op':<7} {'impl':<15} {'dtype':<5} {'hdim':>4} {'seqlen':>6} {'batch':>5} {'heads':>5} "
          f"{'causal':>6} {'ms':>10} {'TFLOP/s':>8}", flush=True)
    for impl in args.impl_list:
        try:
            runner = impl_runner(torch, impl)
        except Exception as e:  # e.g. a torch without flex_attention: every case gets the note
            runner = failing_runner(e)
        for c in grid:
            r = run_case(torch, bench, impl, runner, c)
            records.append(r)
            ms = "-" if r["ms"] is None else f"{r['ms']:.4f}"
            tf = "-" if r["tflops"] is None else f"{r['tflops']:.1f}"
            causal = "yes" if c["causal"] else "no"
            note = f"  note: {r['note']}" if r.get("note") else ""
            if "joules" in r:
                note = f"  {r['joules'] * 1e3:.1f} mJ, {r['watts']:.0f} W" + note
            print(f"{c['op']:<7} {impl:<15} {c['dtype']:<5} {c['head_dim']:>4} {c['seqlen']:>6} "
                  f"{c['batch']:>5} {c['heads']:>5} {causal:>6} {ms:>10} {tf:>8}{note}", flush=True)
            if args.json:
                write_json(args.json, header, records)
    failed = sum(r["tflops"] is None for r in records)
    print(f"{failed} of {len(records)} (impl, case) pairs have no number"
          + (f"; results in {args.json}" if args.json else ""))


if __name__ == "__main__":
    main()
