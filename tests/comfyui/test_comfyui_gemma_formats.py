"""ComfyUI's quantized Gemma files (``fp4_mixed`` and kin): our Gemma Loader against ComfyUI's own LTX-2
text encoder on the same file, inside a real ComfyUI (in-process, CPU).

Runs only when ``COMFYUI_DIR`` points at a ComfyUI checkout (docs/testing.md, "Testing against a
real ComfyUI"); ``$COMFYUI_PYTHON`` runs ``tests/comfyui_quant_run.py`` on the tiny Gemma written
in ComfyUI's quantized layouts (``ltx_mgpu.assets.quant_plans``: nvfp4, fp4_mixed = nvfp4 + fp8
+ plain layers, fp8 with markers, int8, int8 with ConvRot) and in the older header-marked fp8
(``fp8_e4m3fn_scaled``), ComfyUI's 12B sizes replaced by the tiny model's as in
``tests/comfyui/test_comfyui_clip.py``. For every file whose formats this ComfyUI reads (0.20.1: nvfp4 and
fp8; its int8 layouts came later, and those files are then listed as not comparable):

* ComfyUI holds the same layers quantized as our loader finds, and every text projection's
  weight ComfyUI computes with equals ours bit for bit;
* ``CLIPTextEncode`` on our Gemma Loader's CLIP at its defaults (dtype ``auto``: fp32 on the
  CPU, as ComfyUI's encoder computes) gives ComfyUI's CONDITIONING: same entries and dict,
  tensors within 1e-4 relative; with the loader's dtype at ``bf16`` it agrees to bf16 rounding;
* with ``weights: nf4`` (NF4 made from the dequantized weights) it stays close: per-token cosine
  >= 0.7 on the tiny random model (NF4 of its bf16 weights alone gives a mean 0.87 on the final
  state, tests/unit/test_nf4_fidelity.py).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from comfyui_support import COMFYUI_DIR, COMFYUI_PYTHON, NEEDS_COMFYUI_REASON, has_comfyui  # noqa: E402

from ltx_mgpu.assets.gemma import build_tiny_gemma_comfy_file  # noqa: E402
from ltx_mgpu.assets.quant_plans import PLANS  # noqa: E402

pytestmark = [
    pytest.mark.skipif(not has_comfyui(), reason=NEEDS_COMFYUI_REASON),
]

SCRIPT = Path(__file__).resolve().parents[1] / "comfyui_quant_run.py"
FORMATS = (*PLANS, "fp8_e4m3fn_scaled")
#: What ComfyUI 0.20.1 reads (``comfy/quant_ops.py`` ``QUANT_ALGOS``); later versions read more.
IN_COMFYUI_0_20 = ("nvfp4", "fp4_mixed", "fp8", "fp8_e4m3fn_scaled")
PROMPTS = {"short": "a red fox walks slowly through the snow at night, camera light",
           "unicode": "Ein Fuchs läuft durch den Schnee 🦊, 雪の中の狐"}
REL = 1e-4


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max().clamp(min=1e-12))


@pytest.fixture(scope="module")
def run(tiny_ltx_23, tiny_gemma_dir):
    with tempfile.TemporaryDirectory(prefix="ltxm-quant-") as d:
        root = Path(d)
        folders = {name: root / name for name in ("text_encoders", "checkpoints", "out")}
        for path in folders.values():
            path.mkdir()
        files = {}
        for fmt in FORMATS:
            files[fmt] = f"tiny-gemma-{fmt}.safetensors"
            build_tiny_gemma_comfy_file(tiny_gemma_dir, folders["text_encoders"] / files[fmt], fmt)
        with safe_open(str(tiny_ltx_23), "pt") as f:
            metadata = f.metadata()
        sd = {k: (v.to(torch.bfloat16) if k.startswith("text_embedding_projection.") else v)
              for k, v in load_file(str(tiny_ltx_23)).items()}  # bf16 projection, as in the real checkpoints
        save_file(sd, str(folders["checkpoints"] / "tiny-ltx-2.3.safetensors"), metadata=metadata)
        spec = {"comfyui": COMFYUI_DIR, "gemma_config": str(Path(tiny_gemma_dir) / "config.json"),
                "files": files, "checkpoint": "tiny-ltx-2.3.safetensors", "prompts": PROMPTS,
                **{k: str(v) for k, v in folders.items() if k != "out"}}
        (root / "spec.json").write_text(json.dumps(spec))
        env = {**os.environ, "OMP_NUM_THREADS": "1", "LTX_MGPU_RUNTIME_DIR": str(root / "run"),
               "LTX_MGPU_CACHE_DIR": str(root / "cache")}
        proc = subprocess.run([COMFYUI_PYTHON, str(SCRIPT), str(root / "spec.json"), str(folders["out"])],
                              cwd=COMFYUI_DIR, env=env, capture_output=True, text=True, timeout=1200)
        assert proc.returncode == 0, f"{SCRIPT.name} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
        yield (load_file(str(folders["out"] / "conds.safetensors")),
               json.loads((folders["out"] / "report.json").read_text()))


def test_every_format_comfyui_reads_was_compared(run):
    _, report = run
    assert set(report["weights"]) | set(report["not_in_comfyui"]) == set(FORMATS)
    assert set(IN_COMFYUI_0_20) <= set(report["weights"])  # what ComfyUI 0.20.1 already reads
    assert all(missing == ["int8_tensorwise"] for missing in report["not_in_comfyui"].values())


@pytest.mark.parametrize("fmt", FORMATS)
def test_comfyuis_weights_equal_ours_bit_for_bit(run, fmt):
    _, report = run
    if fmt in report["not_in_comfyui"]:
        pytest.skip(f"this ComfyUI does not read {report['not_in_comfyui'][fmt]} (0.20.1 does not; tests/"
                    "test_gemma_quantized.py compares these layers with comfy-kitchen's own dequantization)")
    w = report["weights"][fmt]
    assert w["compared"] == 6 * 7 and w["unequal"] == []
    assert w["quantized"] == w["ours_quantized"] == (35 if fmt == "fp4_mixed" else 42)


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("case", PROMPTS)
def test_clip_text_encode_equals_comfyuis_on_the_same_file(run, fmt, case):
    tensors, report = run
    if fmt in report["not_in_comfyui"]:
        pytest.skip(f"this ComfyUI does not read {report['not_in_comfyui'][fmt]}")
    conds = report["conds"][fmt][case]
    # entries, shapes, dtypes, dict keys and values
    assert conds["ours"] == conds["comfy"] == conds["ours_bf16"] == conds["ours_nf4"]
    theirs = tensors[f"{fmt}.{case}.comfy"]
    assert _rel(tensors[f"{fmt}.{case}.ours"], theirs) <= REL
    assert _rel(tensors[f"{fmt}.{case}.ours_bf16"], theirs) <= 5e-2  # as loaded: bf16 compute (measured 1.2-1.7 %)
    nf4 = tensors[f"{fmt}.{case}.ours_nf4"]
    cos = torch.nn.functional.cosine_similarity(nf4[0].float(), theirs[0].float(), dim=-1)
    assert float(cos.min()) >= 0.7, cos
