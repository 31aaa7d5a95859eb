"""``benchmarks/bench_sp_ranks.py`` on CPU gloo ranks (real processes, a tiny model): the
multi-GPU scaling benchmark runs end to end, world size 2 gives the world-size-1 velocities
(one size split evenly, one that needs a padded token), and its JSON holds the step times,
speed-ups, efficiencies and communication shares the closing notes quote. On GPUs the same
script measures LTX-2 19B-shaped steps over NCCL."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.slow


def test_sp_ranks_bench_runs_on_cpu_ranks_and_two_ranks_equal_one(tmp_path):
    out = tmp_path / "sp_ranks.json"
    proc = subprocess.run(
        [sys.executable, "benchmarks/bench_sp_ranks.py", "--device", "cpu", "--world-sizes", "1,2", "--layers", "1",
         "--video-heads", "4", "--video-head-dim", "8", "--audio-heads", "4", "--audio-head-dim", "4",
         "--caption-channels", "64", "--text-tokens", "16", "--audio-tokens", "5", "--shapes", "2x3x4,1x3x5",
         "--warmup", "1", "--runs", "2", "--out", str(out)],
        cwd=REPO, capture_output=True, text=True, timeout=300, env={**__import__("os").environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    data = json.loads(out.read_text())
    assert set(data["summary"]) == {"24", "15"}  # 15 tokens over 2 ranks: one padded token
    for tokens, row in data["summary"].items():
        assert set(row) == {"1", "2"}
        assert row["1"]["speedup"] == pytest.approx(1.0) and row["1"]["efficiency"] == pytest.approx(1.0)
        assert row["2"]["max_abs_diff_vs_ws1"] <= 1e-5
        assert row["2"]["median_ms"] > 0 and 0 < row["2"]["comm_share"] < 1
        assert row["2"]["efficiency"] == pytest.approx(row["2"]["speedup"] / 2)
    assert "efficiency" in proc.stdout and "max |diff|" in proc.stdout
