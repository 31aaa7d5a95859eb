"""``benchmarks/bench_model_path.py`` on CPU gloo ranks (tiny model), so it is ready for the GPU:
the header-only checkpoint loads in the pool, both paths run, and the JSON holds the step
times, the overhead ratio and the bytes per step."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


def test_model_path_bench_runs_on_cpu_ranks(tmp_path):
    out = tmp_path / "model_path.json"
    proc = subprocess.run(
        [sys.executable, "benchmarks/bench_model_path.py", "--device", "cpu", "--nproc", "2", "--layers", "1",
         "--video-heads", "4", "--video-head-dim", "8", "--audio-heads", "4", "--audio-head-dim", "4",
         "--caption-channels", "64", "--text-tokens", "16", "--audio-tokens", "5", "--shapes", "2x3x4",
         "--warmup", "1", "--runs", "2", "--steps", "2", "--out", str(out)],
        cwd=REPO, capture_output=True, text=True, timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    row = json.loads(out.read_text())["sizes"]["24"]
    assert row["model_path_step_ms"] > 0 and row["pool_sampler_step_ms"] > 0
    assert row["overhead"] == pytest.approx(row["model_path_step_ms"] / row["pool_sampler_step_ms"] - 1)
    assert row["bytes_sent_per_step"] == 2 * (128 * 24 + 8 * 5 * 16) * 4 + 16  # fp32 on CPU, + two sigmas pairs
    assert "overhead" in proc.stdout
