"""``benchmarks/comfy_model_memory.py`` end to end on the tiny LTX-2.3 checkpoint: our MODEL built in
ComfyUI's process (a fresh one) costs it no weights: model management sees one byte, every key is
there as a meta tensor, and the JSON holds the measured growth.

Runs only when ``COMFYUI_DIR`` points at a ComfyUI checkout (docs/testing.md, "Testing against a
real ComfyUI"); ``$COMFYUI_PYTHON`` runs the benchmark.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from comfyui_support import COMFYUI_DIR, NEEDS_COMFYUI_REASON, has_comfyui  # noqa: E402

pytestmark = [pytest.mark.skipif(not has_comfyui(), reason=NEEDS_COMFYUI_REASON)]

REPO = Path(__file__).resolve().parents[2]


def test_our_model_costs_comfyuis_process_no_weights(tiny_ltx_23, tmp_path):
    out = tmp_path / "memory.json"
    python = os.environ.get("COMFYUI_PYTHON", sys.executable)
    proc = subprocess.run([python, str(REPO / "benchmarks" / "comfy_model_memory.py"), str(tiny_ltx_23), "--out",
                           str(out)], capture_output=True, text=True, timeout=600, cwd=REPO,
                          env={**os.environ, "COMFYUI_DIR": str(COMFYUI_DIR)})
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    (row,) = json.loads(out.read_text())["rows"]
    assert row["model_size_seen_by_comfyui"] == 1 and row["state_dict_keys"] > 0, row
    assert row["rss_growth_bytes"] > 0 and row["build_s"] > 0, row
