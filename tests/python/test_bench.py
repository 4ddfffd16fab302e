"""python -m flashkit.bench without a GPU: it says so and exits 0; its grid driver, report and plot
run end to end on the CPU with a CPU stand-in for bench/peers.py's CUDA-event timer (tiny shapes),
so that the GPU run only adds the timing."""

from __future__ import annotations

import importlib.util
import json
import pathlib
import time

import pytest
import torch

from flashkit import bench

pytestmark = pytest.mark.skipif(
    not (bench.pathlib.Path.cwd() / "bench" / "peers.py").is_file(),
    reason="run from the flashkit checkout (bench/peers.py)")


class CpuBench:
    """peers.Bench's interface on the CPU: one input set, one timed call."""

    def __init__(self, torch_module, warmup_ms, min_timed_ms, min_reps):
        pass

    def input_sets(self, c):
        dtype = torch.bfloat16 if c["dtype"] == "bf16" else torch.float16
        shape = (c["batch"], c["seqlen"], c["heads"], c["head_dim"])
        backward = c["op"] != "fwd"

        def tensor(grad):
            return torch.empty(shape, dtype=dtype).uniform_(-1, 1).transpose(1, 2) \
                .requires_grad_(grad)
        return [tuple(tensor(backward and i < 3) for i in range(4 if backward else 3))]

    def time_ms(self, fn, sets):
        start = time.perf_counter()
        out = fn(0)
        return (time.perf_counter() - start) * 1e3, out


@pytest.fixture
def cpu_peers(monkeypatch):
    peers = bench.load_module(bench.find_bench_dir() / "peers.py", "flashkit_test_peers")
    monkeypatch.setattr(peers, "TOTAL_TOKENS", 128)
    monkeypatch.setattr(peers, "MODEL_DIM", 64)
    monkeypatch.setattr(peers, "Bench", CpuBench)
    return peers


@pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU is present: the real run times")
def test_without_gpu_says_so_and_exits_0(capsys):
    bench.main([])
    assert "no CUDA GPU" in capsys.readouterr().out


def test_bad_flags_are_refused():
    with pytest.raises(SystemExit):
        bench.parse_args(["--ops", "fwd,nope"])
    with pytest.raises(SystemExit):
        bench.parse_args(["--impls", "flashkit_py,cutlass"])


def grid_args(budget_s):
    return bench.parse_args(["--dtype", "bf16", "--hdim", "32", "--seqlen", "32,64", "--impls",
                             "flashkit_py,sdpa_flash", "--budget-s", str(budget_s)])


def test_grid_report_and_plot(cpu_peers, tmp_path, monkeypatch):
    records = bench.run_grid(cpu_peers, grid_args(0))
    assert len(records) == 3 * 2 * 2 * 2  # ops x causal x seqlens x impls
    ours = [r for r in records if r["impl"] == "flashkit_py"]
    assert all(r["ms"] is not None and "note" not in r for r in ours), ours
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *args: "CPU stand-in")
    raw = tmp_path / "raw.json"
    cpu_peers.write_json(str(raw), bench.header(cpu_peers, None, False), records)
    json_path, md_path = bench.report(bench.find_bench_dir(), raw, str(tmp_path))
    assert json_path.name == f"cpu-stand-in-{json.loads(raw.read_text())['date'][:10]}-" \
                             "python-bwd-fwd-fwd_bwd.json"
    table = md_path.read_text()
    for op in ("fwd", "bwd", "fwd_bwd"):
        assert f"## {op}: TFLOP/s" in table
    assert "flashkit_py / sdpa_flash" in table
    if importlib.util.find_spec("matplotlib") is None:
        pytest.skip("matplotlib is not installed: the plot is not drawn")
    png = bench.plot(json_path, tmp_path / "grid.png")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_budget_cut_leaves_notes(cpu_peers):
    records = bench.run_grid(cpu_peers, grid_args(1e-9))
    skipped = [r for r in records if "--budget-s" in r.get("note", "")]
    assert skipped and all(r["tflops"] is None for r in skipped)
    assert len(records) == 24


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU and its NVML")
def test_peers_energy_gives_joules_and_watts(tmp_path):
    """bench/peers.py --energy on one small case: the record carries the energy per call and the
    mean power over its extra second of calls, both positive and consistent with the time per call
    (power = energy / time within a factor of two: the two are measured over different calls)."""
    import subprocess
    import sys
    out = tmp_path / "peers.json"
    subprocess.run([sys.executable, "bench/peers.py", "--dtype", "bf16", "--hdim", "64", "--seqlen",
                    "1k", "--causal", "no", "--ops", "fwd", "--impls", "sdpa_flash", "--energy",
                    "--json", str(out)], check=True, timeout=300)
    (record,) = json.loads(out.read_text())["records"]
    assert record["tflops"] is not None, record
    assert record["joules"] > 0 and record["watts"] > 0, record
    implied_watts = record["joules"] / (record["ms"] * 1e-3)
    assert 0.5 < implied_watts / record["watts"] < 2.0, record


def test_report_energy_table(tmp_path):
    """bench/report.py: records with --energy's energy and mean power get a table of TFLOP per joule
    (FLOP per call over joules per call) and one of the speed sustained over the energy window
    (TFLOP per joule x watts), flashkit's divided by the peer's; records without them leave those
    tables alone."""
    import subprocess
    import sys

    def results(impl, tflops, watts, joules=None):
        shape = dict(op="fwd", dtype="bf16", head_dim=128, causal=False, window=[-1, -1],
                     seqlen_q=8192, seqlen_k=8192, batch=2, heads_q=16, heads_kv=16)
        record = dict(shape, impl=impl, tflops=tflops, ms=1.0)
        if watts is not None:
            # By default the window's calls last as long as the timed ones (1 ms at `watts`).
            record.update(watts=watts, joules=watts * 1e-3 if joules is None else joules)
        return {"gpu": "CPU stand-in", "date": "2026-11-24T00:00:00Z", "records": [record]}

    def report(*inputs):
        paths = []
        for n, data in enumerate(inputs):
            paths.append(tmp_path / f"in{n}.json")
            paths[-1].write_text(json.dumps(data))
        out = subprocess.run([sys.executable, "bench/report.py", "--out-dir", str(tmp_path),
                              "--what", f"t{len(list(tmp_path.iterdir()))}", *map(str, paths)],
                             check=True, capture_output=True, text=True).stdout.split()
        return pathlib.Path(out[1]).read_text()

    table = report(results("flashkit", 600.0, 600.0), results("sdpa_cudnn", 550.0, 500.0))
    energy = table.split("## fwd: TFLOP per joule")[1]
    assert "| 1.000 | 1.100 | 0.91x |" in energy, energy  # 600/600 beside 550/500
    assert "| 600.0 | 550.0 | 1.09x |" in table.split("## fwd: TFLOP per joule")[0]
    sustained = table.split("## fwd: TFLOP/s sustained")[1]
    assert "| 600.0 | 550.0 | 1.09x |" in sustained, sustained
    assert "TFLOP per joule" not in report(results("flashkit", 600.0, None),
                                           results("sdpa_cudnn", 550.0, None))
    # The window slower than the timed calls (0.75 J per call at 600 W: 1.25 ms per call): 0.6 TFLOP
    # per call over 0.75 J is 0.8 TFLOP/J, sustained 480 TFLOP/s, whatever the timed 600 said.
    slowed = report(results("flashkit", 600.0, 600.0, joules=0.75), results("sdpa_cudnn", 550.0, 500.0))
    assert "| 0.800 | 1.100 | 0.73x |" in slowed.split("## fwd: TFLOP per joule")[1], slowed
    assert "| 480.0 | 550.0 | 0.87x |" in slowed.split("## fwd: TFLOP/s sustained")[1], slowed


def test_report_summarises_each_peer(tmp_path):
    """bench/report.py: under each table, per peer, the geometric mean of flashkit / peer over the
    cells both measured, their range and the count below 0.97."""
    import subprocess
    import sys

    def record(impl, seqlen, tflops):
        return dict(op="fwd", dtype="bf16", head_dim=128, causal=False, window=[-1, -1], seqlen_q=seqlen,
                    seqlen_k=seqlen, batch=1, heads_q=16, heads_kv=16, impl=impl, tflops=tflops, ms=1.0)

    ours = [record("flashkit", s, t) for s, t in ((2048, 480.0), (4096, 600.0), (8192, 700.0))]
    theirs = [record("sdpa_cudnn", s, t) for s, t in ((2048, 500.0), (4096, 600.0), (8192, None))]
    paths = []
    for n, recs in enumerate((ours, theirs)):
        paths.append(tmp_path / f"in{n}.json")
        paths[-1].write_text(json.dumps({"gpu": "CPU stand-in", "date": "2026-11-24T00:00:00Z",
                                         "records": recs}))
    out = subprocess.run([sys.executable, "bench/report.py", "--out-dir", str(tmp_path), "--what", "s",
                          *map(str, paths)], check=True, capture_output=True, text=True).stdout.split()
    table = pathlib.Path(out[1]).read_text()
    # 480 / 500 = 0.96 and 600 / 600 = 1; the 8k cell has no peer number and is left out.
    assert ("- flashkit / sdpa_cudnn: geometric mean of the ratios 0.980 over 2 cells (0.960 to 1.000), "
            "1 below 0.97" in table), table
