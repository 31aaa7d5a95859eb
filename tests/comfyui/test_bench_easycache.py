"""``benchmarks/bench_easycache.py`` end to end, tiny, on the CPU: ComfyUI's ``EasyCache`` on our
pool MODEL (2 CPU ranks) skips the same steps as on ComfyUI's own model, so the pool is called as
often as ComfyUI's transformer runs, and the latents agree.

Runs only when ``COMFYUI_DIR`` points at a ComfyUI checkout (docs/testing.md, "Testing against a
real ComfyUI"); ``$COMFYUI_PYTHON`` runs the benchmark once per checkpoint (one warm-up-free timed
round each): the tiny LTX-2.3 checkpoint, and a random-weights checkpoint the benchmark writes
(``--random-layers``: the option its GPU run uses, here at toy sizes).
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
STEPS = 12


@pytest.fixture(scope="module", params=["tiny", "random"])
def result(request, tiny_ltx_23, tmp_path_factory):
    """The benchmark's JSON for the tiny checkpoint or a toy random-weights one."""
    out = tmp_path_factory.mktemp("easycache") / "easycache.json"
    model = ["--checkpoint", str(tiny_ltx_23)] if request.param == "tiny" else \
        ["--random-layers", "1", "--random-heads", "2", "--random-head-dim", "16", "--random-audio-heads", "2",
         "--random-audio-head-dim", "8", "--latent", "2x2x4", "--audio-tokens", "6"]
    python = os.environ.get("COMFYUI_PYTHON", sys.executable)
    proc = subprocess.run([python, str(REPO / "benchmarks" / "bench_easycache.py"), *model, "--steps", str(STEPS),
                           "--warmup", "0", "--runs", "1", "--out", str(out)], capture_output=True, text=True,
                          timeout=900, cwd=REPO, env={**os.environ, "COMFYUI_DIR": str(COMFYUI_DIR),
                                                      "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    return request.param, json.loads(out.read_text())


def test_the_pool_is_called_as_often_as_comfyuis_transformer_runs(result):
    which, r = result
    for variant in ("none", "default", "high"):
        ours, comfy = r["ours"][variant], r["comfy"][variant]
        assert ours["forwards"] == comfy["forwards"] and ours["skipped"] == comfy["skipped"], (variant, ours, comfy)
        assert ours["forwards"] == STEPS - (ours["skipped"] or 0), (variant, ours)
        assert ours["rel_to_comfy"] <= 1e-5, (variant, ours)  # fp32: the same model
    assert r["ours"]["none"]["skipped"] is None and r["ours"]["default"]["skipped"] is not None
    if which == "tiny":  # as tests/comfyui/test_comfyui_patch_nodes.py measures on this checkpoint
        assert r["ours"]["default"]["skipped"] == 0 and r["ours"]["high"]["skipped"] == 5, r["ours"]


def test_each_variant_has_its_times_and_speed_up(result):
    _, r = result
    assert r["easycache_defaults"]["reuse_threshold"] == 0.2, r["easycache_defaults"]
    for who in ("ours", "comfy"):
        for variant in ("none", "default", "high"):
            row = r[who][variant]
            assert row["median_ms"] > 0 and len(row["times_ms"]) == 1, row
            assert ("speedup" in row) == (variant != "none"), row
            if variant != "none":
                assert row["speedup"] == pytest.approx(r[who]["none"]["median_ms"] / row["median_ms"])
