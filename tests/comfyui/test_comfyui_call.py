"""One model call of the transformer our pool runs against ComfyUI's own LTX-2 model, in a real ComfyUI.

Runs only when ``COMFYUI_DIR`` points at a ComfyUI checkout (docs/testing.md, "Testing against a
real ComfyUI"); ``$COMFYUI_PYTHON`` runs ``tests/comfyui_call_run.py``, which loads the tiny LTX-2.0
and LTX-2.3 checkpoints with ComfyUI's ``load_checkpoint_guess_config`` and with our
``load_ltx_model`` (fp32, CPU) and makes one call of each on the same unprocessed text (cond and
uncond, batched) and audio-video latent, at several sigmas:

* the text connectors' outputs and both velocities, video and audio, agree to :data:`REL`
  relative (max |delta| / max |ComfyUI's|): fp32 rounding, what is left of ComfyUI's attention
  kernel on the CPU (sub-quadratic) against ours (PyTorch's SDPA);
* with the attention's query / key RMSNorms at ltx-core's own epsilon (1e-6) instead of
  ComfyUI's (1e-5, :mod:`ltx_mgpu.denoise.comfyui.qk_norm`), the LTX-2.0 audio velocity differs by
  more than :data:`WITHOUT`: the difference that classifier-free guidance multiplied past 1e-5 in
  the LTX-2.0 templates' audio (``test_comfyui_templates.py``).

Sampling whole graphs on both models is ``test_comfyui_model.py``'s and ``test_comfyui_templates.py``'s.
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

SCRIPT = Path(__file__).resolve().parents[1] / "comfyui_call_run.py"
#: The bound of one call (contexts and velocities), as loaded.
REL = 1e-6
#: What the LTX-2.0 audio velocity differs by, at least, with ltx-core's query / key norm epsilon.
WITHOUT = 2e-6
SIGMAS = (1.0, 0.9, 0.5, 0.1)


@pytest.fixture(scope="module")
def report(tiny_ltx_20, tiny_ltx_23, tmp_path_factory) -> dict:
    work = tmp_path_factory.mktemp("call")
    spec = {"comfyui": COMFYUI_DIR, "checkpoints": {"2.0": str(tiny_ltx_20), "2.3": str(tiny_ltx_23)},
            "sigmas": list(SIGMAS)}
    (work / "spec.json").write_text(json.dumps(spec))
    python = os.environ.get("COMFYUI_PYTHON", sys.executable)
    proc = subprocess.run([python, str(SCRIPT), str(work / "spec.json"), str(work / "report.json")],
                          capture_output=True, text=True, timeout=900, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    return json.loads((work / "report.json").read_text())


@pytest.mark.parametrize("version", ["2.0", "2.3"])
def test_one_call_equals_comfyuis_model_at_fp32_rounding(report, version):
    entry = report["versions"][version]["ours"]
    assert sorted(map(float, entry)) == sorted(SIGMAS)
    for sigma, rels in entry.items():
        for part, rel in rels.items():
            assert rel <= REL, (version, sigma, part, rel)


def test_ltx_cores_query_key_norm_epsilon_is_what_differed(report):
    for sigma, rels in report["versions"]["2.0"]["ltx_core_eps"].items():
        assert rels["audio"] > WITHOUT, (sigma, rels)
        assert rels["context_audio"] > REL, (sigma, rels)
