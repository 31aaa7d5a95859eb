"""``benchmarks/bench_sharded.py`` and ``benchmarks/bench_layouts.py`` on CPU gloo ranks (tiny
shapes), so they are ready for the GPU: both loads / layouts run and the JSON holds the times
and their ratio."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
TINY = ["--device", "cpu", "--nproc", "2", "--layers", "2", "--video-heads", "4", "--video-head-dim", "8",
        "--audio-heads", "4", "--audio-head-dim", "4", "--caption-channels", "64", "--text-tokens", "16",
        "--audio-tokens", "5", "--shapes", "3x3x5", "--warmup", "1", "--runs", "2"]


@pytest.mark.parametrize("script, keys, extra", [
    ("bench_sharded.py", ("replicated_ms", "sharded_ms", "overhead"), []),
    ("bench_layouts.py", ("ulysses_ms", "cfg_ulysses_ms", "speedup"), []),
    ("bench_layouts.py", ("ulysses_ms", "auto_ms", "cfg_ulysses_speedup"),  # three guidance passes
     ["--batch", "3", "--layouts", "cfg_ulysses,auto"]),
])
def test_the_bench_runs_on_cpu_ranks(tmp_path, script, keys, extra):
    out = tmp_path / "out.json"
    proc = subprocess.run([sys.executable, f"benchmarks/{script}", *TINY, *extra, "--out", str(out)], cwd=REPO,
                          capture_output=True, text=True, timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    row = json.loads(out.read_text())["sizes"]["45"]
    assert all(row[k] > 0 for k in keys[:2])
    assert keys[2] in row
