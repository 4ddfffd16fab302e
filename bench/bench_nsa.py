#!/usr/bin/env python3
"""bench/bench_nsa.py: native sparse attention's selection branch, flashkit beside its peers.

Runs on the GPU machine (PyTorch with CUDA, flashkit's extension on PYTHONPATH). For each case
(bf16; batch 1; heads_q 64 over heads_kv 4, the NSA paper's GQA groups of 16; head dim 128; block
size 64 and 16 selected blocks per token; causal; seqlen --seqlen) it times
  flashkit      flashkit.nsa_selection_attn_func (torch.ops.flashkit.nsa_fwd / nsa_bwd)
  fla           flash-linear-attention's Triton kernels (fla.ops.nsa.parallel, ParallelNSAFunction:
                the selection branch alone), where `fla` imports (its wheel travels to the GPU
                machine: bench/NOTES.md says how)
  dense_causal  flashkit.flash_attn_func, causal over all keys: what the selection saves
for op fwd (the forward) and fwd_bwd (forward, then torch.autograd.grad of q, k, v). Every token
selects 16 distinct blocks at random among the blocks its causal mask reaches (fewer near the
start: the rest of the slots are -1), the same selection for every implementation; flashkit's and
FLA's outputs are compared (max |difference|, printed and recorded) before timing.

tflops counts the selected pairs: 4 * b * h_q * (selected keys summed over tokens) * d per forward
(x 3.5 for fwd_bwd, the FlashAttention convention), causal cuts inside the diagonal block counted
as whole blocks; dense_causal counts its own pairs (half the square). time = median of
CUDA-event-timed calls after warm-up (peers_decode.time_ms: >= 25 ms in >= 2 batches, >= 20 calls
and >= 100 ms); inputs normal(0, 1).

usage: bench_nsa.py [--seqlen 8k,32k] [--impls flashkit,fla,dense_causal] --json OUT [--md OUT]
Environment: FLASHKIT_GIT_COMMIT.
"""
import argparse
import datetime
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from peers_decode import parse_list, time_ms  # noqa: E402  (the decode peers' timing method)

IMPLS = ["flashkit", "fla", "dense_causal"]
OPS = ["fwd", "fwd_bwd"]
HEADS_Q, HEADS_KV, HEAD_DIM, BLOCK_SIZE, SELECTED = 64, 4, 128, 64, 16


def random_selection(torch, batch, seqlen, heads_kv, generator):
    """[b, s, h_kv, SELECTED] int32: distinct random blocks among those at or before each token's own."""
    blocks = (seqlen + BLOCK_SIZE - 1) // BLOCK_SIZE
    scores = torch.rand((batch, seqlen, heads_kv, blocks), device="cuda", generator=generator)
    visible = torch.arange(blocks, device="cuda") <= (torch.arange(seqlen, device="cuda") // BLOCK_SIZE)[:, None]
    scores = scores.masked_fill(~visible[None, :, None, :], -1.0)
    top, indices = scores.topk(min(SELECTED, blocks), dim=-1)
    indices = indices.masked_fill(top < 0, -1).to(torch.int32)
    if indices.shape[-1] < SELECTED:
        pad = indices.new_full(indices.shape[:-1] + (SELECTED - indices.shape[-1],), -1)
        indices = torch.cat([indices, pad], dim=-1)
    return indices.contiguous()


def selected_keys(indices):
    """Keys attended, summed over tokens and kv heads (whole blocks)."""
    return int((indices >= 0).sum().item()) * BLOCK_SIZE


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seqlen", default="8k,32k")
    p.add_argument("--impls", default=",".join(IMPLS))
    p.add_argument("--json", required=True)
    p.add_argument("--md")
    args = p.parse_args()
    import torch
    import flashkit

    impls = args.impls.split(",")
    fla_fn, fla_note = None, None
    if "fla" in impls:
        try:
            import fla
            from fla.ops.nsa.parallel import ParallelNSAFunction
            fla_fn = ParallelNSAFunction.apply
            fla_note = getattr(fla, "__version__", "unknown")
        except Exception as error:  # noqa: BLE001  (recorded: the peer could not run here)
            fla_note = f"not importable: {str(error).splitlines()[0]}"
    records = []
    generator = torch.Generator(device="cuda").manual_seed(0)
    scale = HEAD_DIM ** -0.5
    for seqlen in parse_list(args.seqlen):
        q = torch.randn((1, seqlen, HEADS_Q, HEAD_DIM), device="cuda", dtype=torch.bfloat16, generator=generator)
        k = torch.randn((1, seqlen, HEADS_KV, HEAD_DIM), device="cuda", dtype=torch.bfloat16, generator=generator)
        v = torch.randn_like(k)
        dout = torch.randn_like(q)
        indices = random_selection(torch, 1, seqlen, HEADS_KV, generator)
        pairs = selected_keys(indices) * (HEADS_Q // HEADS_KV)
        runners = {
            "flashkit": lambda q, k, v: flashkit.nsa_selection_attn_func(
                q, k, v, indices, block_size=BLOCK_SIZE, causal=True, softmax_scale=scale),
            "dense_causal": lambda q, k, v: flashkit.flash_attn_func(q, k, v, softmax_scale=scale, causal=True),
        }
        if fla_fn is not None:
            runners["fla"] = lambda q, k, v: fla_fn(q, k, v, indices, SELECTED, BLOCK_SIZE, scale, None)
        reference = runners["flashkit"](q, k, v)
        agreement = None
        if "fla" in runners and "fla" in impls:
            diff = (runners["fla"](q, k, v).float() - reference.float()).abs()
            agreement = {"max_abs": diff.max().item(), "mean_abs": diff.mean().item(),
                         "mean_abs_out": reference.float().abs().mean().item()}
            print(f"seqlen {seqlen}: |flashkit - fla| max {agreement['max_abs']:.3e} mean "
                  f"{agreement['mean_abs']:.3e} (mean |out| {agreement['mean_abs_out']:.3e})", flush=True)
        for impl in impls:
            for op in OPS:
                record = {"op": f"nsa_{op}", "impl": impl, "dtype": "bf16", "batch": 1, "heads_q": HEADS_Q,
                          "heads_kv": HEADS_KV, "seqlen_q": seqlen, "seqlen_k": seqlen, "head_dim": HEAD_DIM,
                          "causal": True, "block_size": BLOCK_SIZE, "selected": SELECTED, "ms": None,
                          "tflops": None}
                if impl == "fla":
                    record["diff_vs_flashkit"] = agreement
                if impl not in runners:
                    record["note"] = fla_note if impl == "fla" else "unknown impl"
                    records.append(record)
                    continue
                run = runners[impl]
                if op == "fwd":
                    def call(_, run=run):
                        return run(q, k, v)
                else:
                    qg, kg, vg = (t.detach().requires_grad_() for t in (q, k, v))

                    def call(_, run=run, qg=qg, kg=kg, vg=vg):
                        return torch.autograd.grad(run(qg, kg, vg), (qg, kg, vg), dout)
                try:
                    ms = time_ms(torch, call, 1)
                except Exception as error:  # noqa: BLE001  (recorded, the other cells go on)
                    record["note"] = str(error).splitlines()[0]
                    records.append(record)
                    continue
                flops = 4.0 * HEAD_DIM * (pairs if impl != "dense_causal" else
                                          HEADS_Q * seqlen * (seqlen + 1) / 2)
                flops *= 3.5 if op == "fwd_bwd" else 1.0
                record["ms"] = round(ms, 6)
                record["tflops"] = round(flops / ms / 1e9, 3)
                records.append(record)
                print(f"{op:8s} {impl:13s} seqlen {seqlen:6d}: {ms:9.3f} ms {record['tflops']:8.1f} TFLOP/s",
                      flush=True)
    result = {"gpu": torch.cuda.get_device_name(0), "cuda": torch.version.cuda, "torch": torch.__version__,
              "date": datetime.date.today().isoformat(),
              "git_commit": os.environ.get("FLASHKIT_GIT_COMMIT", "unknown"), "fla": fla_note,
              "note": __doc__.split("\n\n")[2].replace("\n", " "), "records": records}
    with open(args.json, "w") as f:
        json.dump(result, f, indent=1)
    if args.md:
        with open(args.md, "w") as f:
            f.write(f"# Native sparse attention (selection branch), {result['gpu']}, {result['date']}\n\n")
            f.write(f"flashkit {result['git_commit']}, torch {result['torch']}, fla {fla_note}. "
                    f"bf16, batch 1, heads {HEADS_Q}/{HEADS_KV}, head dim {HEAD_DIM}, block {BLOCK_SIZE}, "
                    f"{SELECTED} blocks selected per token, causal. {result['note']}\n\n")
            f.write("| op | seqlen | impl | ms | TFLOP/s | flashkit speedup |\n|---|---|---|---|---|---|\n")
            mine = {(r["op"], r["seqlen_q"]): r["ms"] for r in records if r["impl"] == "flashkit"}
            for r in records:
                base = mine.get((r["op"], r["seqlen_q"]))
                speedup = f"{r['ms'] / base:.2f}x" if r["ms"] and base and r["impl"] != "flashkit" else ""
                ms = f"{r['ms']:.3f}" if r["ms"] else r.get("note", "")
                tf = f"{r['tflops']:.1f}" if r["tflops"] else ""
                f.write(f"| {r['op']} | {r['seqlen_q']} | {r['impl']} | {ms} | {tf} | {speedup} |\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
