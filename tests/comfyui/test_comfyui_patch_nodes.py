"""Every MODEL -> MODEL node of the installed ComfyUI on our pool MODEL, against ComfyUI's own model.

Runs only when ``COMFYUI_DIR`` points at a ComfyUI checkout (docs/testing.md, "Testing against
a real ComfyUI"); ``$COMFYUI_PYTHON`` runs ``tests/comfyui_patch_nodes_run.py`` once (one
process, one pool of 2 CPU ranks, the tiny LTX-2.3 checkpoint in fp32). It lists every node
ComfyUI registers with a MODEL input and a MODEL output (79 in ComfyUI 0.20.1) and runs each,
with its defaults or the inputs of :data:`CASES` (which also adds variants: both merge
directions, compute dtypes, a video-only latent where ComfyUI's own model fails on the
audio-video one), plus ``ModelSave`` and ``CheckpointSave``, on ComfyUI's model and on ours,
followed by a minimal text-to-video graph (``CFGGuider`` at cfg 3, euler, 6 steps; 12 for the
caches). Each case is one of:

* **same**: the latents agree to 1e-5 relative (fp32); where the node changes the result
  (LoRAs in both loaders' modes, bypass LoRAs, skip-layer guidance, attention multipliers, the
  caches' skipped steps) it changed ours too;
* **refused**: ComfyUI's own model runs it, ours refuses it with a message that starts with the
  node's id and says what to use instead, before any model call (merges, saves, a compute
  dtype other than the pool's);
* **fails**: ComfyUI's own LTX-2 model fails too (nodes made for other models).

Nothing else: no silent difference, no internal error. ``EasyCache`` skips the same steps on both
(the pool is called as often as ComfyUI's transformer runs), ``TorchCompileModel`` says that the
pool compiles its own blocks, the patches ComfyUI's LTX-2 model does not read are logged once, and
the README's patch-node table is this run's (:func:`comfyui_patch_nodes_run.patch_table`).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from comfyui_patch_nodes_run import REFUSAL, SAME, patch_table, verdict  # noqa: E402
from comfyui_support import COMFYUI_DIR, NEEDS_COMFYUI_REASON, has_comfyui  # noqa: E402

pytestmark = [
    pytest.mark.skipif(not has_comfyui(), reason=NEEDS_COMFYUI_REASON),
]

SCRIPT = Path(__file__).resolve().parents[1] / "comfyui_patch_nodes_run.py"
README = Path(__file__).resolve().parents[2] / "README.md"
LORA = {"lora_name": "a.safetensors"}
SLG = {"single_layers": "", "start_percent": 0.0, "end_percent": 1.0}
MULTIPLY = {"q": 1.2, "k": 0.9, "v": 1.1, "out": 0.8}
#: The cases other than a node's defaults (``node`` defaults to the id; ``note`` labels the
#: README row, ``calls`` adds the model calls to it). Every other MODEL -> MODEL node runs with
#: its defaults as case ``<node id>``.
CASES = {
    "EasyCache": {"inputs": {"reuse_threshold": 1.5}, "steps": 12, "note": "threshold 1.5, 12 steps", "calls": True},
    "EasyCache-default": {"node": "EasyCache", "steps": 12, "note": "threshold 0.2 (default)", "calls": True},
    "LazyCache": {"inputs": {"reuse_threshold": 1.5}, "steps": 12, "note": "threshold 1.5, 12 steps", "calls": True},
    "LoraLoader": {"inputs": LORA},
    "LoraLoaderModelOnly": {"inputs": LORA},
    "LoraLoaderBypass": {"inputs": LORA},
    "LoraLoaderBypassModelOnly": {"inputs": {**LORA, "strength_model": 0.7}},
    "LoraModelLoader-bypass": {"node": "LoraModelLoader", "inputs": {"bypass": True}},
    "ModelComputeDtype": {"note": "default"},
    "ModelComputeDtype-fp32": {"node": "ModelComputeDtype", "inputs": {"dtype": "fp32"},
                               "note": "fp32 (the Model Loader's)"},
    "ModelComputeDtype-bf16": {"node": "ModelComputeDtype", "inputs": {"dtype": "bf16"}, "note": "bf16"},
    "ModelComputeDtype-fp16": {"node": "ModelComputeDtype", "inputs": {"dtype": "fp16"}, "note": "fp16"},
    "ModelMergeSimple": {"inputs": {"ratio": 0.5}},
    "ModelMergeSimple-ours-comfy": {"node": "ModelMergeSimple", "models": {"model1": "ours", "model2": "comfy"},
                                    "inputs": {"ratio": 0.5}},
    "ModelMergeSimple-comfy-ours": {"node": "ModelMergeSimple", "models": {"model1": "comfy", "model2": "ours"},
                                    "inputs": {"ratio": 0.5}},
    "SkipLayerGuidanceDiT": {"inputs": {**SLG, "double_layers": "1"}},
    "SkipLayerGuidanceDiTSimple": {"inputs": {**SLG, "double_layers": "0"}},
    "SkipLayerGuidanceSD3": {"inputs": {"layers": "1", "start_percent": 0.0, "end_percent": 1.0}},
    "UNetSelfAttentionMultiply": {"inputs": MULTIPLY},
    "UNetCrossAttentionMultiply": {"inputs": MULTIPLY},
    "UNetTemporalAttentionMultiply": {"inputs": {"self_structural": 1.2, "self_temporal": 0.9,
                                                 "cross_structural": 1.1, "cross_temporal": 0.8}},
    "HypernetworkLoader": {"inputs": {"hypernetwork_name": "h.pt"}},
    "RenormCFG": {"inputs": {"renorm_cfg": 0.5}},
    "TorchCompileModel": {"inputs": {"backend": "cudagraphs"}},  # inductor compiles ComfyUI's model for minutes
    "ModelSave": {"inputs": {"filename_prefix": "diffusion_models/test"}},
    "CheckpointSave": {"inputs": {"filename_prefix": "checkpoints/test", "clip": None, "vae": None}},
    **{n: {"note": "audio-video latent"} for n in ("RescaleCFG", "VideoLinearCFGGuidance", "VideoTriangleCFGGuidance",
                                                   "WanContextWindowsManual", "PerpNeg")},
    **{f"{n}-video": {"node": n, "latent": "video", "note": "video latent"}
       for n in ("RescaleCFG", "VideoLinearCFGGuidance", "VideoTriangleCFGGuidance", "WanContextWindowsManual",
                 "PerpNeg")},
}
#: Cases whose node changes the sampled latent: it must change ours as much as ComfyUI's.
CHANGES = ("EasyCache", "LazyCache", "LoraLoader", "LoraLoaderModelOnly", "LoraLoaderBypass",
           "LoraLoaderBypassModelOnly", "LoraModelLoader", "LoraModelLoader-bypass", "SkipLayerGuidanceDiT",
           "SkipLayerGuidanceDiTSimple", "SkipLayerGuidanceSD3", "UNetSelfAttentionMultiply",
           "UNetCrossAttentionMultiply", "UNetTemporalAttentionMultiply", "RenormCFG", "ModelSamplingLTXV")
#: The MODEL -> MODEL nodes the issue measured first (issue 28), each of which must be in the run.
FIRST = ("EasyCache", "LoraLoaderBypassModelOnly", "ModelComputeDtype", "ModelMergeSimple", "RenormCFG",
         "SkipLayerGuidanceDiT", "PerturbedAttentionGuidance", "NAGuidance", "UNetSelfAttentionMultiply",
         "LazyCache", "TorchCompileModel", "CFGNorm", "CFGZeroStar", "APG", "Mahiro", "TCFG", "FreSca",
         "ModelSamplingLTXV", "ModelSamplingSD3")
#: The README section this run writes (between these two lines).
BEGIN, END = "<!-- patch-nodes table: begin -->", "<!-- patch-nodes table: end -->"


def _lora(path: Path) -> None:
    """A LoRA on two weights of the tiny LTX-2.3 transformer (ComfyUI's key names)."""
    g = torch.Generator().manual_seed(1)
    sd = {}
    for stem, (o, i) in {"diffusion_model.transformer_blocks.0.attn1.to_q": (32, 32),
                         "diffusion_model.transformer_blocks.1.video_to_audio_attn.to_k": (16, 32)}.items():
        sd[f"{stem}.lora_A.weight"] = torch.randn(2, i, generator=g)
        sd[f"{stem}.lora_B.weight"] = 0.5 * torch.randn(o, 2, generator=g)
    save_file(sd, str(path))


def _hypernetwork(path: Path) -> None:
    """A Stable Diffusion hypernetwork for 32-wide attention (ComfyUI reads it with
    ``torch.load(weights_only=True)``; nothing of ours unpickles it)."""
    g = torch.Generator().manual_seed(5)
    layer = {"linear.0.weight": 0.1 * torch.randn(16, 32, generator=g), "linear.0.bias": torch.zeros(16),
             "linear.1.weight": 0.1 * torch.randn(32, 16, generator=g), "linear.1.bias": torch.zeros(32)}
    torch.save({32: [layer, dict(layer)]}, str(path))


@pytest.fixture(scope="module")
def run(tiny_ltx_23):
    """Every case, once (one ComfyUI process, one pool); the report."""
    work = Path(tempfile.mkdtemp(prefix="lm-pn-", dir="/tmp"))
    for d in ("loras", "hypernetworks", "rt", "output", "out"):
        (work / d).mkdir()
    _lora(work / "loras" / "a.safetensors")
    _hypernetwork(work / "hypernetworks" / "h.pt")
    spec = {"comfyui": str(COMFYUI_DIR), "checkpoint": str(tiny_ltx_23), "loras_dir": str(work / "loras"),
            "hypernetworks_dir": str(work / "hypernetworks"), "runtime_dir": str(work / "rt"),
            "output_dir": str(work / "output"), "steps": 6, "cfg": 3.0, "cases": CASES}
    (work / "spec.json").write_text(json.dumps(spec))
    python = os.environ.get("COMFYUI_PYTHON", sys.executable)
    proc = subprocess.run([python, str(SCRIPT), str(work / "spec.json"), str(work / "out")], capture_output=True,
                          text=True, timeout=1500, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    return json.loads((work / "out" / "report.json").read_text())


def test_every_model_node_of_comfyui_runs_on_both_models(run):
    nodes = run["nodes"]
    assert len(nodes) >= 79 and set(FIRST) <= set(nodes), sorted(nodes)
    assert all(n in run["cases"] for n in nodes)
    assert {"ModelSave", "CheckpointSave"} <= {e["node"] for e in run["cases"].values()}


def test_each_node_is_the_same_refused_by_name_or_fails_on_comfyuis_model_too(run):
    bad = {cid: (e["comfy"].get("error"), e["ours"].get("error"), e.get("rel"))
           for cid, e in run["cases"].items() if verdict(e) == "differs"}
    assert not bad, bad
    same = [cid for cid, e in run["cases"].items() if verdict(e) == "same"]
    assert len(same) >= 50  # most nodes: sampler-level, weight, cache and guidance patches


@pytest.mark.parametrize("case", CHANGES)
def test_a_node_that_changes_the_result_changes_ours_the_same(run, case):
    entry = run["cases"][case]
    assert verdict(entry) == "same" and entry["rel"] <= SAME, entry
    assert entry["changed"] > 1e-3, entry  # it took effect: not the plain MODEL's latent


def test_easycache_skips_the_same_steps_with_no_pool_call(run):
    for case, skipped in (("EasyCache", 5), ("EasyCache-default", 0), ("LazyCache", 7)):
        entry = run["cases"][case]
        assert entry["comfy"]["forwards"] == entry["ours"]["forwards"] == 12 - skipped, (case, entry)
        assert any(f"skipped {skipped}/12 steps" in m for m in entry["ours"]["log"]), entry["ours"]["log"]


@pytest.mark.parametrize("case, phase, says", [
    ("ModelMergeSimple", "node", "ModelMergeSimple" + REFUSAL + "its weights live in the pool"),
    ("ModelMergeSimple-comfy-ours", "node", "ModelMergeSimple" + REFUSAL + "its weights live in the pool"),
    ("ModelMergeSimple-ours-comfy", "node", "ModelMergeSimple" + REFUSAL + "another model's weights"),
    ("ModelMergeBlocks", "node", "ModelMergeBlocks" + REFUSAL),
    ("ModelMergeLTXV", "node", "ModelMergeLTXV" + REFUSAL),
    ("ModelSave", "node", "ModelSave" + REFUSAL + "its weights live in the pool, so ComfyUI cannot save them"),
    ("CheckpointSave", "node", "CheckpointSave" + REFUSAL),
    ("ModelComputeDtype-bf16", "node", "ModelComputeDtype" + REFUSAL + "the pool computes in the Model Loader's dtype "
     "(float32), not bfloat16; set the Model Loader's dtype"),
    ("ModelComputeDtype-fp16", "node", "ModelComputeDtype" + REFUSAL + "the pool computes in the Model Loader's dtype "
     "(float32), not float16"),
])
def test_refusals_name_the_node_and_what_to_use_before_any_model_call(run, case, phase, says):
    entry = run["cases"][case]
    assert verdict(entry) == "refused", entry
    ours = entry["ours"]
    assert ours["phase"] == phase and ours["forwards"] == 0 and ours["error"].startswith(says), ours
    assert "; " in ours["error"]  # ...; what to use instead


def test_perpneg_is_refused_by_name_where_comfyuis_model_fails(run):
    for case in ("PerpNeg", "PerpNeg-video"):
        entry = run["cases"][case]
        assert verdict(entry) == "fails" and not entry["comfy"]["ok"], entry
        assert entry["ours"]["error"].startswith("PerpNeg" + REFUSAL) and "PerpNegGuider" in entry["ours"]["error"]


def test_torch_compile_model_says_that_the_pool_compiles_its_own_blocks(run):
    entry = run["cases"]["TorchCompileModel"]
    assert verdict(entry) == "same"
    said = [m for m in entry["ours"]["log"] if "TorchCompileModel compiles nothing" in m]
    assert len(said) == 1 and "compiles its own blocks" in said[0], entry["ours"]["log"]


@pytest.mark.parametrize("case, patch", [("PerturbedAttentionGuidance", "attn1 replacement"),
                                         ("NAGuidance", "attn1_output_patch"), ("TomePatchModel", "attn1_patch")])
def test_patches_comfyuis_ltx_model_does_not_read_are_left_and_logged(run, case, patch):
    entry = run["cases"][case]
    assert verdict(entry) == "same"
    said = [m for m in entry["ours"]["log"] if m.startswith(f"ltx_mgpu: {case}'s {patch}")]
    assert said and "has no effect on LTX-2" in said[0], entry["ours"]["log"]


def test_the_readme_table_is_this_runs(run):
    text = README.read_text()
    assert BEGIN in text and END in text, "README: the patch-node table's markers are missing"
    readme = text.split(BEGIN, 1)[1].split(END, 1)[0].strip().splitlines()
    made = patch_table(run, CASES).strip().splitlines()

    def cells(lines):
        return [[c.strip() for c in line.strip("|").split("|")] for line in lines]

    assert [r[:2] for r in cells(readme)] == [r[:2] for r in cells(made)], "regenerate the README's table:\n" + \
        "\n".join(made)
    for row in cells(readme)[2:]:
        number = re.fullmatch(r"[0-9.]+e-0[0-9]", row[2])
        assert row[2] == "—" or (number and float(row[2]) <= SAME), row
