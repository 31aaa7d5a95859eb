"""The Gemma Loader's CLIP inside a real ComfyUI, against ComfyUI's own LTX-2 text encoder (in-process, CPU).

Runs only when ``COMFYUI_DIR`` points at a ComfyUI checkout (docs/testing.md, "Testing against
a real ComfyUI"); ``$COMFYUI_PYTHON`` runs ``tests/comfyui_clip_run.py``, which loads the tiny
Gemma in ComfyUI's single-file format with ``LTXAVTextEncoderLoader`` (as the LTX-2 templates
do; ComfyUI's hard-coded Gemma 3 12B sizes replaced by the tiny model's, nothing else) and with
our Gemma Loader (its ``clip`` output, on a pool of 2 CPU ranks), and encodes with ComfyUI's own
``CLIPTextEncode`` on both:

* a short prompt, a prompt of more than 1,100 tokens, a unicode prompt (umlauts, emoji, kanji),
  a prompt with ComfyUI's weight and escape syntax (literal for LTX-2) and the empty prompt give
  the same CONDITIONING: same entries, dict keys and values, shape and dtype, and tensors within
  1e-4 relative (the Gemma Loader at its defaults: dtype ``auto``, fp32 on the CPU as ComfyUI's;
  the long prompt whole, as many tokens as ComfyUI's tokenizer makes); with the loader's dtype at
  ``bf16`` it agrees to bf16 rounding;
* ``ConditioningZeroOut``, ``LTXVConditioning`` and ``ConditioningCombine`` treat our
  conditioning as they treat ComfyUI's;
* ComfyUI's ``SamplerCustomAdvanced`` (``CFGGuider``, euler, ComfyUI's own model) and our SP
  Sampler give the same latent with our conditioning as with ComfyUI's;
* inside a node's execution, our encode's progress bar is that node's;
* ``LoraLoader`` with our CLIP applies the LoRA to the model and its text-encoder key to our
  CLIP (the pool's Gemma): the conditioning equals ComfyUI's LoRA'd encoder's (fp32, 1e-4), no key
  reported as not loaded (more LoRA cases and prompt enhancement: test_comfyui_generate.py); a LoRA on
  the text projection (both LTX-2.3 linears, a ``.diff_b`` on the video bias, and a tower key; strength
  0.8) patches the same keys as on ComfyUI's encoder, none reported as not loaded, and the
  conditioning equals ComfyUI's (fp32, 1e-4); on the tiny LTX-2.0 checkpoint (its projection in bf16
  too) a LoRA on the single projection (ComfyUI's key ``text_embedding_projection.weight``) does the
  same, and the plain encodes agree.

The text projection of the tiny LTX-2.3 checkpoint is stored in bf16 for this test, as in the real
LTX-2 checkpoints: ComfyUI keeps the projection in the Gemma file's dtype (bf16), so an fp32 one
would be rounded on its side only.
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

pytestmark = [
    pytest.mark.skipif(not has_comfyui(), reason=NEEDS_COMFYUI_REASON),
]

SCRIPT = Path(__file__).resolve().parents[1] / "comfyui_clip_run.py"
PROMPTS = {
    "short": "a red fox walks slowly through the snow at night, camera light",
    "unicode": "Ein Fuchs läuft durch den Schnee 🦊, 雪の中の狐",
    "syntax": "a \\(red\\) fox, (snow:1.3), ((night)), [blue]",
    "empty": "",
}
CASES = (*PROMPTS, "long")
LONG_TOKENS = 1100
REL = 1e-4
TE_KEY = "text_encoders.gemma3_12b.transformer.model.layers.0.self_attn.q_proj"
PROJ_KEY = "text_encoders.text_embedding_projection"
MODEL_KEY = "diffusion_model.transformer_blocks.0.attn1.to_q"


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max().clamp(min=1e-12))


@pytest.fixture(scope="module")
def run(tiny_ltx_23, tiny_ltx_20, tiny_gemma_dir, tiny_gemma_comfy_file):
    with tempfile.TemporaryDirectory(prefix="ltxm-clip-") as d:
        root = Path(d)
        folders = {name: root / name for name in ("text_encoders", "checkpoints", "loras", "out")}
        for path in folders.values():
            path.mkdir()
        (folders["text_encoders"] / "tiny-gemma-comfy.safetensors").symlink_to(tiny_gemma_comfy_file)
        with safe_open(str(tiny_ltx_23), "pt") as f:
            metadata = f.metadata()
        sd = {k: (v.to(torch.bfloat16) if k.startswith("text_embedding_projection.") else v)
              for k, v in load_file(str(tiny_ltx_23)).items()}
        save_file(sd, str(folders["checkpoints"] / "tiny-ltx-2.3.safetensors"), metadata=metadata)
        g = torch.Generator().manual_seed(5)
        save_file({f"{MODEL_KEY}.lora_A.weight": torch.randn(2, 32, generator=g),
                   f"{MODEL_KEY}.lora_B.weight": torch.randn(32, 2, generator=g),
                   f"{TE_KEY}.lora_A.weight": torch.randn(2, 64, generator=g),
                   f"{TE_KEY}.lora_B.weight": torch.randn(64, 2, generator=g)},
                  str(folders["loras"] / "te-and-model.safetensors"))
        proj = {k[len("text_embedding_projection."):]: v.shape for k, v in sd.items()
                if k.startswith("text_embedding_projection.")}
        lora_proj = {f"{TE_KEY}.lora_A.weight": torch.randn(2, 64, generator=g),
                     f"{TE_KEY}.lora_B.weight": torch.randn(64, 2, generator=g),
                     f"{PROJ_KEY}.video_aggregate_embed.diff_b": torch.randn(proj["video_aggregate_embed.bias"],
                                                                            generator=g)}
        for side in ("video", "audio"):
            out_f, in_f = proj[f"{side}_aggregate_embed.weight"]
            lora_proj[f"{PROJ_KEY}.{side}_aggregate_embed.lora_A.weight"] = torch.randn(4, in_f, generator=g)
            lora_proj[f"{PROJ_KEY}.{side}_aggregate_embed.lora_B.weight"] = torch.randn(out_f, 4, generator=g)
            lora_proj[f"{PROJ_KEY}.{side}_aggregate_embed.alpha"] = torch.tensor(2.0)
        save_file(lora_proj, str(folders["loras"] / "te-projection.safetensors"))
        with safe_open(str(tiny_ltx_20), "pt") as f:
            metadata20 = f.metadata()
        sd20 = {k: (v.to(torch.bfloat16) if k.startswith("text_embedding_projection.") else v)
                for k, v in load_file(str(tiny_ltx_20)).items()}
        save_file(sd20, str(folders["checkpoints"] / "tiny-ltx-2.0.safetensors"), metadata=metadata20)
        out_f, in_f = sd20["text_embedding_projection.aggregate_embed.weight"].shape
        save_file({f"{PROJ_KEY}.lora_A.weight": torch.randn(4, in_f, generator=g),
                   f"{PROJ_KEY}.lora_B.weight": torch.randn(out_f, 4, generator=g),
                   f"{PROJ_KEY}.alpha": torch.tensor(2.0)}, str(folders["loras"] / "te-projection-20.safetensors"))
        spec = {"comfyui": COMFYUI_DIR, "gemma_config": str(Path(tiny_gemma_dir) / "config.json"),
                "gemma": "tiny-gemma-comfy.safetensors", "checkpoint": "tiny-ltx-2.3.safetensors",
                "lora": "te-and-model.safetensors", "lora_projection": "te-projection.safetensors",
                "checkpoint_20": "tiny-ltx-2.0.safetensors", "lora_projection_20": "te-projection-20.safetensors",
                "prompts": PROMPTS, "long_tokens": LONG_TOKENS,
                **{k: str(v) for k, v in folders.items() if k != "out"}}
        (root / "spec.json").write_text(json.dumps(spec))
        env = {**os.environ, "OMP_NUM_THREADS": "1", "LTX_MGPU_RUNTIME_DIR": str(root / "run"),
               "LTX_MGPU_CACHE_DIR": str(root / "cache")}
        proc = subprocess.run([COMFYUI_PYTHON, str(SCRIPT), str(root / "spec.json"), str(folders["out"])],
                              cwd=COMFYUI_DIR, env=env, capture_output=True, text=True, timeout=1200)
        assert proc.returncode == 0, f"{SCRIPT.name} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
        yield (load_file(str(folders["out"] / "conds.safetensors")),
               json.loads((folders["out"] / "report.json").read_text()))


@pytest.mark.parametrize("case", CASES)
def test_clip_text_encode_equals_comfyuis_own_text_encoder(run, case):
    tensors, report = run
    theirs, ours = report["cases"][case]["comfy"], report["cases"][case]["ours"]
    assert ours == theirs  # one entry each: dtype, shape, device, every dict key and value
    assert theirs[0]["opts"] == {"pooled_output": None, "unprocessed_ltxav_embeds": True}
    assert theirs[0]["dtype"] == "torch.float32" and theirs[0]["shape"][1] == report["tokens"][case]
    assert _rel(tensors[f"{case}.ours"], tensors[f"{case}.comfy"]) <= REL


def test_a_long_prompt_is_encoded_whole(run):
    _, report = run
    assert report["tokens"]["long"] >= LONG_TOKENS
    assert report["cases"]["long"]["ours"][0]["shape"][1] == report["tokens"]["long"]


def test_the_node_output_as_loaded_agrees_to_bf16_rounding(run):
    tensors, report = run
    assert report["cases"]["short"]["ours_bf16"] == report["cases"]["short"]["comfy"]
    assert _rel(tensors["short.ours_bf16"], tensors["short.comfy"]) <= 5e-2


def test_the_progress_bar_is_the_executing_nodes(run):
    _, report = run
    assert report["progress"] and all(node_id == "42" for node_id, _, _ in report["progress"])
    assert report["progress"][-1][1] == report["progress"][-1][2]


def test_core_conditioning_nodes_take_our_output(run):
    _, report = run
    ours, theirs = report["downstream"]["ours"], report["downstream"]["comfy"]
    assert ours == theirs
    assert ours["zero_is_zero"] and ours["positive"][0]["opts"]["frame_rate"] == 25.0
    assert len(ours["combined"]) == 2


@pytest.mark.parametrize("sampler", ["comfy_model", "sp"])
def test_samplers_give_the_same_latent_with_our_conditioning(run, sampler):
    tensors, _ = run
    for part in (0, 1):  # video, audio
        theirs, ours = tensors[f"sample.{sampler}.comfy.{part}"], tensors[f"sample.{sampler}.ours.{part}"]
        assert theirs.abs().max() > 0 and _rel(ours, theirs) <= REL


def test_lora_loader_with_our_clip(run):
    tensors, report = run
    lora = report["lora"]
    assert lora["clip_type"] == "GemmaClip" and not lora["same_clip_object"] and lora["model_patched"]
    assert _rel(tensors["lora.ours"], tensors["short.ours"]) > 1e-3  # the text encoder's LoRA is merged
    assert _rel(tensors["lora.ours"], tensors["lora.comfy"]) <= REL  # as ComfyUI's LoRA'd encoder
    assert not [m for m in lora["logs"] if "lora key not loaded" in m and TE_KEY in m]


def test_lora_loader_patches_the_text_projection_as_comfyuis_encoder(run):
    tensors, report = run
    lora = report["lora_projection"]
    projection = {f"text_embedding_projection.{s}_aggregate_embed.{p}" for s in ("video", "audio")
                  for p in ("weight", "bias")} - {"text_embedding_projection.audio_aggregate_embed.bias"}
    assert projection <= set(lora["comfy"]) and lora["ours"] == lora["comfy"]  # the same keys patched
    assert not lora["logs"]  # no key reported as not loaded
    assert _rel(tensors["lora_projection.comfy"], tensors["short.comfy"]) > 1e-3  # the LoRA changes it
    assert _rel(tensors["lora_projection.ours"], tensors["lora_projection.comfy"]) <= REL


def test_lora_loader_patches_ltx20s_single_projection_as_comfyuis_encoder(run):
    tensors, report = run
    lora = report["lora_projection_20"]
    assert lora["ours"] == lora["comfy"] == ["text_embedding_projection.weight"] and not lora["logs"]
    assert _rel(tensors["ltx20.plain.ours"], tensors["ltx20.plain.comfy"]) <= REL
    assert _rel(tensors["ltx20.lora.comfy"], tensors["ltx20.plain.comfy"]) > 1e-3  # the LoRA changes it
    assert _rel(tensors["ltx20.lora.ours"], tensors["ltx20.lora.comfy"]) <= REL
