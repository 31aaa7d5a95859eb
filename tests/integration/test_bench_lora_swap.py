"""``benchmarks/bench_lora_swap.py`` on a CPU rank (tiny widths), so it is ready for the GPU: the
header-only checkpoint loads in the pool, every LoRA set of the sequence is merged and restored,
and the JSON holds each swap's time and the weights it patches."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_lora_swap_bench_runs_on_a_cpu_rank(tmp_path):
    out = tmp_path / "lora_swap.json"
    proc = subprocess.run(
        [sys.executable, "benchmarks/bench_lora_swap.py", "--device", "cpu", "--nproc", "1", "--layers", "2",
         "--video-heads", "4", "--video-head-dim", "8", "--audio-heads", "4", "--audio-head-dim", "4",
         "--caption-channels", "64", "--rank", "4", "--style-rank", "2", "--runs", "1", "--out", str(out)],
        cwd=REPO, capture_output=True, text=True, timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    results = json.loads(out.read_text())
    swaps = results["swaps"]
    assert list(swaps) == ["stage2_distilled", "next_stage1_base", "stage2_distilled_again", "distilled_strength_0.5",
                           "stage1_style", "stage2_style_plus_distilled", "back_to_base"]
    per_block = results["loras"]["distilled"]["weights"] // 2
    assert per_block > 20 and swaps["stage2_distilled"]["weights"] == 2 * per_block
    assert swaps["stage1_style"]["weights"] == 2 * 4  # q, k, v, out of each block's video self-attention
    assert swaps["next_stage1_base"]["weights"] == 0 and swaps["next_stage1_base"]["factor_bytes"] == 0
    assert all(row["seconds"] > 0 and len(row["runs_s"]) == 1 for row in swaps.values())
    assert results["load_s"] > 0 and "stage2_distilled" in proc.stdout
