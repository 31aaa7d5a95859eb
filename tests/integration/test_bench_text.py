"""``benchmarks/bench_text.py`` on the CPU with a small Gemma, so that its GPU run is ready: every
variant (the compiled one with the finite check as fa442e1 ran it beside it), the per-stage
breakdown of our encodes and the host record are in its JSON."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_text_bench_runs_on_the_cpu(tmp_path):
    out = tmp_path / "text.json"
    proc = subprocess.run(
        [sys.executable, "benchmarks/bench_text.py", "--device", "cpu", "--shape", "tiny", "--layers", "2",
         "--tokens", "32", "--batches", "1", "--warmup", "0", "--runs", "1", "--compile-modes", "default@layers",
         "--out", str(out)],
        cwd=REPO, capture_output=True, text=True, timeout=600, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(out.read_text())
    names = {k.rsplit("/", 1)[0] for k in result["variants"]}
    assert names == {"plain", "ours-eager", "ours-eager-stock-sdpa", "compiled-default@layers",
                     "compiled-default@layers+host-isfinite", "parity"}, names
    assert result["variants"]["parity/1x32"]["eager_max_abs_err"] == 0.0
    for name in ("ours-eager/1x32", "compiled-default@layers/1x32"):
        parts = result["breakdown"][name]
        assert all(parts[k] > 0 for k in ("encode_ms", "launch_ms", "forward_ms", "features_ms", "projection_ms",
                                          "rows_ms")), parts
        assert parts["gpu_busy_ms"] is None  # no GPU here
    assert result["dynamo"]["graph_breaks"] == {} and result["dynamo"]["unique_graphs"] >= 1
    assert result["host"]["cpus"] >= 1 and result["host"]["torch"] == result["torch"]
    probes = {"upcast_rows_ms/1", "upcast_into_ms/1", "isfinite_rows_ms/1", "aminmax_rows_ms/1"}
    assert probes <= set(result["host_probes"])


def test_compiled_path_ops_counts_this_tree():
    """``benchmarks/compiled_path_ops.py`` on this checkout: one compiled-graph call per layer per
    encode and no graph break (what the issue-30 comparison of commits reads)."""
    proc = subprocess.run(
        [sys.executable, "benchmarks/compiled_path_ops.py", str(REPO), "--tokens", "32", "--layers", "2"],
        cwd=REPO, capture_output=True, text=True, timeout=600, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = proc.stdout
    assert "1x32: 1 graph(s) compiled, 2 compiled-graph calls per encode" in out, out
    assert "8x32: 1 graph(s) compiled, 2 compiled-graph calls per encode" in out, out
    assert "graph breaks: {}" in out and "aminmax 8" in out, out
