"""The multi-GPU benchmarks on CPU gloo ranks (real processes, tiny models), so they are ready
when a machine with several GPUs is: ``benchmarks/bench_sp_ranks.py`` runs end to end, world
size 2 gives the world-size-1 velocities (one size split evenly, one that needs a padded token)
and its JSON holds the step times, speed-ups, efficiencies and communication shares;
``benchmarks/bench_text_placements.py`` times every placement x weights mode in one 2-rank
pool. On GPUs the same scripts measure LTX-2 19B-shaped steps over NCCL and Gemma 3
12B-shaped encodes."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


def test_sp_ranks_bench_runs_on_cpu_ranks_and_two_ranks_equal_one(tmp_path):
    out = tmp_path / "sp_ranks.json"
    proc = subprocess.run(
        [sys.executable, "benchmarks/bench_sp_ranks.py", "--device", "cpu", "--world-sizes", "1,2", "--layers", "1",
         "--video-heads", "4", "--video-head-dim", "8", "--audio-heads", "4", "--audio-head-dim", "4",
         "--caption-channels", "64", "--text-tokens", "16", "--audio-tokens", "5", "--shapes", "2x3x4,1x3x5",
         "--warmup", "1", "--runs", "2", "--out", str(out)],
        cwd=REPO, capture_output=True, text=True, timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    data = json.loads(out.read_text())
    assert set(data["summary"]) == {"24", "15"}  # 15 tokens over 2 ranks: one padded token
    for _tokens, row in data["summary"].items():
        assert set(row) == {"1", "2"}
        assert row["1"]["speedup"] == pytest.approx(1.0) and row["1"]["efficiency"] == pytest.approx(1.0)
        assert row["2"]["max_abs_diff_vs_ws1"] <= 1e-5
        assert row["2"]["median_ms"] > 0 and 0 < row["2"]["comm_share"] < 1
        assert row["2"]["efficiency"] == pytest.approx(row["2"]["speedup"] / 2)
    assert "efficiency" in proc.stdout and "max |diff|" in proc.stdout


def test_text_placements_bench_times_every_placement_and_weights_mode_in_one_pool(tmp_path):
    out = tmp_path / "placements.json"
    proc = subprocess.run(
        [sys.executable, "benchmarks/bench_text_placements.py", "--gpus", "cpu", "--nproc", "2", "--source", "tiny",
         "--tokens", "64", "--batches", "3", "--runs", "1", "--warmup", "0", "--tmp", str(tmp_path), "--out", str(out)],
        cwd=REPO, capture_output=True, text=True, timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    data = json.loads(out.read_text())
    assert data["pool"]["world_size"] == 2
    assert set(data["rows"]) == {f"{w}/{p}" for w in ("bf16", "nf4")
                                 for p in ("single", "accelerate", "batch_parallel")}
    for name, row in data["rows"].items():
        s = row["sets"]["3x64"]
        assert s["median_ms"] > 0 and s["encode_ms"] > 0 and len(s["memory"]) == 2
        assert s["owners"] == ([0, 0, 1] if name.endswith("batch_parallel") else [0, 0, 0])
    assert "x single" in proc.stdout
