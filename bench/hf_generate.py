#!/usr/bin/env python3
"""bench/hf_generate.py: Hugging Face transformers' generate() on a Llama model with flashkit's
attention (flashkit.integrations.transformers), beside transformers' SDPA attention, in one run.

The model is transformers' own LlamaForCausalLM with random weights (bf16; hidden 2048, 8 layers,
16 query heads over 4 kv heads of 128, as one block of a Llama-3-style model): the same weights
under each attention implementation. Per case, greedy generate() timed end to end with
torch.cuda.synchronize() around it, median of --repeats runs after one warm-up:
  prefill_ms   generate(max_new_tokens=1): the prompt's forward and one token
  decode_ms    (generate(max_new_tokens=1 + N) - prefill) / N: one decoding step, all layers
Implementations: `flashkit` (flashkit.integrations.transformers), `sdpa` (transformers' SDPA
attention; PyTorch picks the backend). A padded batch (left padding, lengths spread over the last
half of the prompt) goes through flash_attn_varlen_func (prefill) and flash_attn_with_kvcache
(decoding) in flashkit, and a 4D mask in SDPA. generate() is host-bound at these sizes (~1 ms of
Python per layer and step): decode_ms moves by ~10% from run to run. The prefill logits of each
implementation are compared with SDPA's (max |diff|).

usage: hf_generate.py [--cases 1x16384,1x2048,8x2048p] [--new-tokens 64] [--repeats 3]
                      --json OUT.json [--md OUT.md]
Needs flashkit importable (PYTHONPATH=<build>/python) and transformers.
"""
import argparse
import statistics
import time

from peers_decode import save_results, write_table

IMPLS = ["flashkit", "sdpa"]


def parse_case(text):
    """"8x2048p" -> (8, 2048, True): batch x prompt length, p for a left-padded batch."""
    padded = text.endswith("p")
    batch, length = text.rstrip("p").split("x")
    return int(batch), int(length), padded


def make_model(torch, transformers):
    config = transformers.LlamaConfig(
        vocab_size=32000, hidden_size=2048, intermediate_size=5632, num_hidden_layers=8,
        num_attention_heads=16, num_key_value_heads=4, head_dim=128,
        max_position_embeddings=65536)
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = transformers.LlamaForCausalLM._from_config(config, attn_implementation="sdpa")
    return model.to(torch.bfloat16).eval()


def use_attention(model, name):
    """The same model (same weights) under another attention implementation."""
    if hasattr(model, "set_attn_implementation"):
        model.set_attn_implementation(name)
    else:
        model.config._attn_implementation = name


def timed_generate(torch, model, ids, mask, new_tokens):
    torch.cuda.synchronize()
    start = time.perf_counter()
    model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=new_tokens,
                   min_new_tokens=new_tokens, do_sample=False, pad_token_id=0)
    torch.cuda.synchronize()
    return (time.perf_counter() - start) * 1e3


def run(args):
    import torch
    import transformers
    import flashkit.integrations.transformers as flashkit_hf

    flashkit_hf.register()
    model = make_model(torch, transformers)
    records = []
    for case in args.cases:
        batch, length, padded = parse_case(case)
        gen = torch.Generator(device="cuda").manual_seed(1)
        ids = torch.randint(1, 32000, (batch, length), device="cuda", generator=gen)
        mask = torch.ones_like(ids)
        if padded:  # left padding: row r keeps its last length / 2 + r * length / (2 batch) tokens
            for r in range(batch):
                mask[r, :length // 2 - r * length // (2 * batch)] = 0
        reference_logits = None
        for impl in reversed(IMPLS):  # sdpa first: its logits are the reference
            rec = {"op": "generate", "impl": impl, "batch": batch, "prompt": length,
                   "padded": padded, "new_tokens": args.new_tokens, "prefill_ms": None,
                   "decode_ms": None}
            try:
                use_attention(model, "sdpa" if impl == "sdpa" else flashkit_hf.NAME)
                with torch.no_grad():
                    logits = model(input_ids=ids, attention_mask=mask).logits[:, -1].float()
                    if reference_logits is None:
                        reference_logits = logits
                    rec["logits_max_diff_vs_sdpa"] = (logits - reference_logits).abs().max().item()
                    timed_generate(torch, model, ids, mask, 1 + args.new_tokens)  # warm-up
                    prefill = [timed_generate(torch, model, ids, mask, 1)
                               for _ in range(args.repeats)]
                    full = [timed_generate(torch, model, ids, mask, 1 + args.new_tokens)
                            for _ in range(args.repeats)]
                rec["prefill_ms"] = statistics.median(prefill)
                rec["decode_ms"] = (statistics.median(full) - rec["prefill_ms"]) / args.new_tokens
            except Exception as e:  # an implementation that cannot run the case: null, with why
                rec["note"] = (str(e).strip().splitlines() or [type(e).__name__])[0][:200]
            finally:
                torch.cuda.empty_cache()
            records.append(rec)
            print(f"  {impl:14s} {case:10s} prefill {rec['prefill_ms']} ms, decode "
                  f"{rec['decode_ms']} ms/token {rec.get('note', '')}", flush=True)
    return records, torch


def write_markdown(path, result):
    rows = {}
    for r in result["records"]:
        key = (r["batch"], r["prompt"], r["padded"])
        rows.setdefault(key, {})[r["impl"]] = r

    def fmt(x, digits=2):
        return "-" if x is None else f"{x:.{digits}f}"
    lines = [f"# generate(): {result['gpu']}, {result['date']}, commit {result['git_commit']}", "",
             "LlamaForCausalLM, random weights, bf16, hidden 2048, 8 layers, 16/4 heads of 128; "
             "greedy; median ms (lower is better); decode = ms per generated token", "",
             "| batch | prompt | padded | " +
             " | ".join(f"{i} prefill | {i} decode" for i in IMPLS) +
             " | prefill: sdpa / flashkit | decode: sdpa / flashkit | logits max diff vs sdpa |",
             "|---" * (3 + 2 * len(IMPLS) + 3) + "|"]
    for key in sorted(rows):
        row = rows[key]

        def get(impl, field):
            return row.get(impl, {}).get(field)
        ratio = [get("sdpa", field) / get("flashkit", field)
                 if get("sdpa", field) and get("flashkit", field) else None
                 for field in ("prefill_ms", "decode_ms")]
        lines.append(f"| {key[0]} | {key[1]} | {'yes' if key[2] else 'no'} | " +
                     " | ".join(f"{fmt(get(i, 'prefill_ms'))} | {fmt(get(i, 'decode_ms'), 3)}"
                                for i in IMPLS) + " | " +
                     " | ".join(fmt(x) for x in ratio) + " | " +
                     fmt(get("flashkit", "logits_max_diff_vs_sdpa"), 4) + " |")
    write_table(path, lines, result["records"])


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--cases", default="1x16384,1x2048,8x2048p")
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--json", required=True)
    p.add_argument("--md")
    args = p.parse_args()
    args.cases = args.cases.split(",")
    records, torch = run(args)
    import transformers
    save_results(torch, args, records, write_markdown, transformers=transformers.__version__)


if __name__ == "__main__":
    main()
