"""``benchmarks/profile_comfy_model.py`` end to end, tiny, on the CPU: one call of ComfyUI's own
LTX-2.3 model and of our transformer on the same random weights (fp32) agree, with the sigmas
given per sample (as ComfyUI gives them: ltx-core's AdaLN once per sample) and per token.

Runs only when ``COMFYUI_DIR`` points at a ComfyUI checkout (docs/testing.md, "Testing against a
real ComfyUI"); ``$COMFYUI_PYTHON`` runs the script once at toy sizes (its GPU run:
``docs/benchmarks.md``, "EasyCache on a GPU").
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


def test_ours_equals_comfyuis_call_per_sample_and_per_token(tmp_path):
    out = tmp_path / "comfy_model.json"
    python = os.environ.get("COMFYUI_PYTHON", sys.executable)
    proc = subprocess.run([python, str(REPO / "benchmarks" / "profile_comfy_model.py"), "--device", "cpu",
                           "--dtype", "fp32", "--random-layers", "1", "--random-heads", "2", "--random-head-dim", "16",
                           "--random-audio-heads", "2", "--random-audio-head-dim", "8", "--latent", "2x2x4",
                           "--audio-tokens", "6", "--text-tokens", "8", "--warmup", "0", "--runs", "2",
                           "--out", str(out)], capture_output=True, text=True, timeout=600, cwd=REPO,
                          env={**os.environ, "COMFYUI_DIR": str(COMFYUI_DIR), "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    r = json.loads(out.read_text())
    assert set(r["variants"]) == {"comfy", "ours", "ours_per_token"}, r["variants"]
    assert r["video_tokens"] == 16 and r["layers"] == 1, r
    for name, row in r["variants"].items():
        assert row["median_ms"] > 0 and len(row["times_ms"]) == 2, (name, row)
        if name != "comfy":
            assert max(row["rel_to_comfy"].values()) <= 1e-5, (name, row)  # fp32: the same model
