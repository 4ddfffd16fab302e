#!/usr/bin/env python3
"""bench/report.py: merges benchmark result files into one results file and a markdown table.

usage: report.py [--out-dir DIR] [--what NAME] [--base IMPL] RESULT.json [RESULT.json ...]

Each input is a results file of docs/DESIGN.md (flashkit_bench's, peers.py's, or an earlier
merge). Writes DIR/<gpu>-<yyyy-mm-dd>-<what>.json (DIR defaults to bench/results beside this script;
<what> to the ops of the records, e.g. "fwd"), holding the header fields, "runs" (each input's
header) and every record tagged with "run" (its input's index), and the same name with .md: the
header lines (GPU, driver, CUDA, PyTorch, date, commit) and per op a table with, per shape, each
implementation's TFLOP/s (TB/s for bandwidth-bound ops) and the ratio of the base implementation
(default flashkit, of the first input that has it) to each other one; where records carry --energy's
energy and mean power, a second table per op of TFLOP per joule and a third of the speed sustained
over the energy window, with the same ratios; then the notes of the cells left empty. An implementation found in several inputs gets one column per input, tagged with its
commit (or file name). Prints the two paths. Standard library only.
"""
import argparse
import collections
import datetime
import json
import math
import pathlib
import re
import sys

HEADER_KEYS = ("gpu", "driver", "cuda", "torch", "date", "git_commit")
IMPL_ORDER = ["flashkit", "flashkit_det", "flashkit_py", "sdpa_flash", "sdpa_cudnn", "sdpa_efficient", "flex"]
SHAPE_KEYS = ("op", "dtype", "head_dim", "causal", "window", "seqlen_q", "seqlen_k", "batch",
              "heads_q", "heads_kv")


def load_runs(paths):
    """[(path, header dict, records)] with each merged input's own runs expanded."""
    runs = []
    for path in paths:
        data = json.loads(pathlib.Path(path).read_text())
        if "runs" in data:  # an earlier merge: keep its inputs as separate runs
            for i, header in enumerate(data["runs"]):
                runs.append((header.get("source", path), header,
                             [r for r in data["records"] if r.get("run") == i]))
        else:
            header = {k: v for k, v in data.items() if k != "records"}
            runs.append((path, header, data["records"]))
    return runs


def merged_value(runs, key):
    """The one value of a header field; where runs disagree, each value with its source."""
    values = []
    for path, header, _ in runs:
        v = header.get(key)
        if v not in (None, "", "unknown") and v not in [x for x, _ in values]:
            values.append((v, path))
    if not values:
        return None
    if len(values) == 1 or key == "date":
        return min(v for v, _ in values) if key == "date" else values[0][0]
    if key == "gpu":
        print(f"report.py: warning: the inputs come from different GPUs: {values}", file=sys.stderr)
    return "; ".join(f"{v} ({pathlib.Path(p).name})" for v, p in values)


def slug(text):
    text = re.sub(r"^nvidia\s+", "", (text or "unknown-gpu").strip().lower())
    return re.sub(r"[^a-z0-9]+", "-", text).strip("-")


def column_labels(runs):
    """Label per (run index, impl): the impl's name, tagged with its run where two runs share it."""
    runs_of = collections.defaultdict(list)
    for i, (_, _, records) in enumerate(runs):
        for impl in dict.fromkeys(r["impl"] for r in records):
            runs_of[impl].append(i)
    labels = {}
    for impl, idx in runs_of.items():
        commits = [runs[i][1].get("git_commit") for i in idx]
        for i, commit in zip(idx, commits):
            if len(idx) == 1:
                labels[(i, impl)] = impl
            elif len(set(commits)) == len(idx) and commit:
                labels[(i, impl)] = f"{impl}@{str(commit)[:10]}"
            else:
                labels[(i, impl)] = f"{impl}@{pathlib.Path(runs[i][0]).stem}"
    order = {impl: n for n, impl in enumerate(IMPL_ORDER)}
    ordered = sorted(dict.fromkeys(labels.values()),
                     key=lambda lab: (order.get(lab.split("@")[0], len(order)), lab))
    return labels, ordered


def shape_key(r):
    return tuple(tuple(r.get(k) or []) if k == "window" else r.get(k) for k in SHAPE_KEYS)


def shape_cells(key, show_window):
    s = dict(zip(SHAPE_KEYS, key))
    def pair(a, b):
        return str(s[a]) if s[a] == s[b] else f"{s[a]}/{s[b]}"
    cells = [s["dtype"], str(s["head_dim"]), "yes" if s["causal"] else "no",
             pair("seqlen_q", "seqlen_k"), str(s["batch"]), pair("heads_q", "heads_kv")]
    if show_window:
        cells.append(str(list(s["window"])))
    return cells


def short_shape(key):
    s = dict(zip(SHAPE_KEYS, key))
    return f"{s['dtype']} d{s['head_dim']} s{s['seqlen_q']}{' causal' if s['causal'] else ''}"


def format_value(v):
    """One decimal for GPU-sized numbers, three significant digits for small ones (the CPU mode)."""
    if v is None:
        return "—"
    return f"{v:.1f}" if abs(v) >= 10 else f"{v:.3g}"


def flop_per_joule(r):
    """TFLOP per joule of a record measured with --energy: its FLOP per call (TFLOP/s x ms) over
    its joules per call, else None. (Not TFLOP/s over watts: the speed comes from the timed calls,
    the power from the energy window's, and the two differ where the timed calls ran before the
    power limiter settled.)"""
    if r.get("tflops") is None or not r.get("joules") or not r.get("ms"):
        return None
    return r["tflops"] * r["ms"] * 1e-3 / r["joules"]


def sustained_tflops(r):
    """TFLOP/s over --energy's window (1 s of calls back to back after the timed ones): TFLOP per
    joule x the window's mean power, the speed once the power limiter has settled; else None."""
    per_joule = flop_per_joule(r)
    return per_joule * r["watts"] if per_joule is not None and r.get("watts") else None


def ratio_summary(base, peer, ratios, of="the ratios"):
    """One line on base / peer over cells: the geometric mean of `ratios` (positive), their range
    and the cells below 0.97 (issue 8's per-cell floor), so that a grid's headline is read, not
    recomputed."""
    geo = math.exp(sum(math.log(v) for v in ratios) / len(ratios))
    low = sum(v < 0.97 for v in ratios)
    return (f"- {base} / {peer}: geometric mean of {of} {geo:.3f} over {len(ratios)} cells "
            f"({min(ratios):.3f} to {max(ratios):.3f}), {low} below 0.97")


def op_table(op, rows, labels, base_label, kind="speed"):
    """Markdown lines for one op: rows maps shape key -> {label: record}. kind "speed": the timed
    calls' TFLOP/s (or TB/s); "energy": TFLOP per joule; "sustained": TFLOP/s over the energy
    window (both from --energy's records)."""
    records = [r for cells in rows.values() for r in cells.values()]
    metric = "tflops" if any(r.get("tflops") is not None for r in records) \
        or not any(r.get("tbps") is not None for r in records) else "tbps"
    unit = "TFLOP/s" if metric == "tflops" else "TB/s"
    read = lambda r: r.get(metric)
    energy = kind == "energy"
    if energy:
        unit, read = "TFLOP per joule (FLOP per call over joules per call)", flop_per_joule
    elif kind == "sustained":
        unit, read = ("TFLOP/s sustained (over --energy's 1 s window: TFLOP per joule x mean power)",
                      sustained_tflops)
    present = [lab for lab in labels if any(lab in cells for cells in rows.values())]
    peers = [lab for lab in present if lab != base_label] if base_label in present else []
    show_window = any(list(k[SHAPE_KEYS.index("window")]) not in ([], [-1, -1]) for k in rows)

    head = ["dtype", "hdim", "causal", "seqlen", "batch", "heads"]
    head += ["window"] if show_window else []
    head += present + [f"{base_label} / {p}" for p in peers]
    title = f"## {op}: {unit}, higher is better"
    if peers:
        better = "spends less energy per FLOP" if energy else "faster"
        title += f"; ratio = {base_label} / peer (> 1: {base_label} {better})"
    lines = [title, "", "| " + " | ".join(head) + " |", "|" + " --- |" * len(head)]
    ratios = collections.defaultdict(list)
    for key in sorted(rows, key=lambda k: tuple((v is None, v) for v in k)):
        cells = rows[key]
        value = {lab: read(cells[lab]) if lab in cells else None for lab in present}
        row = shape_cells(key, show_window)
        row += [("—" if value[lab] is None else f"{value[lab]:.3f}") if energy
                else format_value(value[lab]) for lab in present]
        for p in peers:
            ok = value[base_label] is not None and value[p]
            if ok and value[base_label] > 0:
                ratios[p].append(value[base_label] / value[p])
            row.append(f"{value[base_label] / value[p]:.2f}x" if ok else "—")
        lines.append("| " + " | ".join(row) + " |")
    if ratios:
        lines.append("")
    lines += [ratio_summary(base_label, p, values) for p, values in ratios.items()]
    return lines


def notes_lines(rows_by_op):
    """The notes of every record, grouped by (implementation, note)."""
    grouped = collections.defaultdict(list)
    for rows in rows_by_op.values():
        for key, cells in rows.items():
            for lab, r in cells.items():
                if r.get("note"):
                    grouped[(lab, r["note"])].append(short_shape(key))
    if not grouped:
        return []
    lines = ["## Notes (why a cell is empty)", ""]
    for (lab, note), shapes in sorted(grouped.items()):
        more = f" and {len(shapes) - 4} more" if len(shapes) > 4 else ""
        lines.append(f"- `{lab}`, {len(shapes)} shape(s) ({', '.join(shapes[:4])}{more}): {note}")
    return lines + [""]


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("inputs", nargs="+", metavar="RESULT.json")
    p.add_argument("--out-dir", default=str(pathlib.Path(__file__).resolve().parent / "results"))
    p.add_argument("--what", help="the name's last part (default: the records' ops, e.g. fwd)")
    p.add_argument("--base", default="flashkit",
                   help="the implementation whose number the ratios divide (default flashkit)")
    args = p.parse_args()

    runs = load_runs(args.inputs)
    labels, ordered = column_labels(runs)
    header = {k: merged_value(runs, k) for k in HEADER_KEYS}
    base_runs = [i for i, (_, _, recs) in enumerate(runs)
                 if any(r["impl"] == args.base for r in recs)]
    if base_runs and runs[base_runs[0]][1].get("git_commit"):
        # The commit of the code measured, not of the peers' run.
        header["git_commit"] = runs[base_runs[0]][1]["git_commit"]
    base_label = labels.get((base_runs[0], args.base)) if base_runs else None

    records, rows_by_op = [], collections.defaultdict(lambda: collections.defaultdict(dict))
    for i, (_, _, recs) in enumerate(runs):
        for r in recs:
            records.append(dict(r, run=i))
            rows_by_op[r["op"]][shape_key(r)][labels[(i, r["impl"])]] = r

    what = args.what or "-".join(sorted(rows_by_op))
    day = (header["date"] or datetime.date.today().isoformat())[:10]
    gpus = [h.get("gpu") for _, h, _ in runs if h.get("gpu")]
    out_dir = pathlib.Path(args.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    stem = out_dir / f"{slug(gpus[0] if gpus else None)}-{day}-{what}"

    run_headers = [dict(h, source=pathlib.Path(path).name) for path, h, _ in runs]
    merged = dict(header, runs=run_headers, records=records)
    json_path, md_path = pathlib.Path(f"{stem}.json"), pathlib.Path(f"{stem}.md")
    json_path.write_text(json.dumps(merged, indent=1) + "\n")

    md = [f"# Benchmark: {what} on {header['gpu']}, {day}", ""]
    shown = {k: "n/a" if v is None else v for k, v in header.items()}
    md += [f"- GPU: {shown['gpu']}", f"- Driver: {shown['driver']}", f"- CUDA: {shown['cuda']}",
           f"- PyTorch: {shown['torch']}", f"- Date: {shown['date']}",
           f"- flashkit commit: {shown['git_commit']}"]
    for h, (_, _, recs) in zip(run_headers, runs):
        impls = ", ".join(dict.fromkeys(r["impl"] for r in recs))
        extra = "".join(f", {k} {h[k]}" for k in ("torch", "cudnn", "triton") if h.get(k))
        md.append(f"- Run `{h['source']}`: {impls}; {len(recs)} records; {h.get('date')}{extra}")
    notes = list(dict.fromkeys(h["note"] for h in run_headers if h.get("note")))
    md += [f"- Method: {n}" for n in notes] + [""]
    for op, rows in sorted(rows_by_op.items()):
        md += op_table(op, rows, ordered, base_label) + [""]
        if any(flop_per_joule(r) is not None for cells in rows.values() for r in cells.values()):
            md += op_table(op, rows, ordered, base_label, kind="energy") + [""]
            md += op_table(op, rows, ordered, base_label, kind="sustained") + [""]
    md += notes_lines(rows_by_op)
    md_path.write_text("\n".join(md))
    print(json_path)
    print(md_path)


if __name__ == "__main__":
    main()
