"""``benchmarks/bench_finite_checks.py`` on the CPU with a tiny model, so it is ready for the GPU:
the header-only bf16 and fp8 files are written, every tensor is read and checked, the JSON holds
the read, check and ``torch.isfinite`` seconds and the whole load runs."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_finite_checks_bench_runs_on_the_cpu(tmp_path):
    out = tmp_path / "finite.json"
    proc = subprocess.run(
        [sys.executable, "benchmarks/bench_finite_checks.py", "--device", "cpu", "--layers", "1", "--video-heads",
         "4", "--video-head-dim", "8", "--audio-heads", "4", "--audio-head-dim", "4", "--caption-channels", "64",
         "--out", str(out)],
        cwd=REPO, capture_output=True, text=True, timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(out.read_text())
    assert set(result["files"]) == {"bf16", "fp8_blocks"} and result["load_ltx_model_bf16_s"] > 0
    for row in result["files"].values():
        assert row["tensors"] > 50 and row["read_s"] > 0 and row["check_s"] > 0 and row["isfinite_s"] > 0
    assert result["files"]["fp8_blocks"]["bytes"] < result["files"]["bf16"]["bytes"]
    assert "of the read" in proc.stdout
