"""Our pool MODEL inside a real ComfyUI, against ComfyUI's own model (in-process, CPU, fp32).

Runs only when ``COMFYUI_DIR`` points at a ComfyUI checkout (docs/testing.md, "Testing against
a real ComfyUI"); ``$COMFYUI_PYTHON`` runs ``tests/comfyui_model_run.py``, which loads the tiny
LTX-2.3 checkpoint with ComfyUI's ``load_checkpoint_guess_config`` and with our Model Loader
(its ``comfy_model`` output, on a pool of 1 or 2 CPU ranks) and samples with ComfyUI's own
nodes on both:

* ``SamplerCustomAdvanced`` + ``CFGGuider`` + ``KSamplerSelect`` for euler, euler_ancestral,
  gradient_estimation, res_multistep, dpmpp_2m and lcm, at cfg 1 and 3, on an audio-video and
  a video-only latent; ``KSampler`` for two of them, ``KSamplerAdvanced`` with leftover noise,
  ``BasicGuider`` with ``LTXVScheduler`` sigmas, ``DualCFGGuider``, ``SamplerEulerAncestral``
  (eta 0.7) with ``ManualSigmas``: the latents agree to 1e-4 relative;
* the same seed twice gives the same latent; world size 1 and 2 agree;
* ``LoraLoaderModelOnly`` (one LoRA at 0.5 and -1, two stacked) equals ComfyUI's own model
  with the same LoRAs; the loader's MODEL without them again equals the base; a LoRA key that
  matches nothing is warned about by ComfyUI's own loader, key named, as for its own model;
* ComfyUI's LTX conditioning nodes: ``LTXVImgToVideoInplace``, ``LTXVAddGuide`` (two guides,
  strength 0.7, a token count not divisible by the world size; world size 1 and 2 agree),
  ``LTXVCropGuides``, ``LTXVReferenceAudio`` (ID-LoRA reference audio and its identity guidance),
  audio-to-video (a zero audio noise mask returns the audio exactly), a text attention mask;
* Stop (ComfyUI's interrupt) during the second model call ends the sampling, and the next run
  on the same pool works;
* a GGUF transformer (the tiny checkpoint's blocks in Q8_0 and Q4_0... as ComfyUI-GGUF's converters
  write them) in ``models/unet`` is listed by our Model Loader and, replicated and sharded over 2
  ranks, with and without ``LoraLoaderModelOnly``, equals ComfyUI's own model on the float32 file
  of the same values (``UNETLoader``); so do transformer files of ComfyUI's quantized layers in
  ``models/diffusion_models``: nvfp4 against ComfyUI's own model on the nvfp4 file itself, int8
  with ConvRot (which ComfyUI 0.20.1 does not read) against the float32 file of its values. With a
  LoRA, ComfyUI rounds the merged weight of its own nvfp4 layer back to nvfp4, which the pool does
  not (it keeps the file's rows and merges the LoRA exactly, per call): there the reference is
  ComfyUI's model on the float32 file of the values, with the same LoRA;
* the MODEL is one byte to ComfyUI's model management and ComfyUI's RSS grows by less than
  64 MiB when it loads (the tiny checkpoint; the 19B-shaped header is measured in
  ``benchmarks/bench_model_path.py``).
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

from ltx_mgpu.assets import comfy_quantized
from ltx_mgpu.assets.ggml_export import dequantized_copy, export_gguf
from ltx_mgpu.denoise.checkpoint import inspect_checkpoint

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from comfyui_support import COMFYUI_DIR, NEEDS_COMFYUI_REASON, has_comfyui  # noqa: E402

pytestmark = [
    pytest.mark.skipif(not has_comfyui(), reason=NEEDS_COMFYUI_REASON),
]

SCRIPT = Path(__file__).resolve().parents[1] / "comfyui_model_run.py"
SAMPLERS = ("euler", "euler_ancestral", "gradient_estimation", "res_multistep", "dpmpp_2m", "lcm")
Q = "diffusion_model.transformer_blocks.0.attn1.to_q"
K = "diffusion_model.transformer_blocks.1.video_to_audio_attn.to_k"
REL = 1e-4
#: The packed transformer files: a GGUF in models/unet, ComfyUI's nvfp4 and int8 ConvRot layers.
PACKED = ("gguf", "nvfp4", "int8_convrot")


def _lora(path: Path, seed: int, unknown: bool = False) -> None:
    g = torch.Generator().manual_seed(seed)
    sd = {}
    for stem, (o, i) in {Q: (32, 32), K: (16, 32)}.items():
        sd[f"{stem}.lora_A.weight"] = torch.randn(2, i, generator=g)
        sd[f"{stem}.lora_B.weight"] = 0.5 * torch.randn(o, 2, generator=g)
    if unknown:
        sd["diffusion_model.no_such_block.lora_A.weight"] = torch.randn(2, 4, generator=g)
        sd["diffusion_model.no_such_block.lora_B.weight"] = torch.randn(4, 2, generator=g)
    save_file(sd, str(path))


def _block_linears(checkpoint: Path, kind: str) -> list[str]:
    """The DiT keys of the blocks' 2-D weights of ``kind`` (``attn``: attention, ``ff``: feed-forward)
    whose rows are whole 32-value GGML blocks."""
    info = inspect_checkpoint(checkpoint)
    return [k for k, shape in info.shapes.items() if k.startswith("transformer_blocks.") and k.endswith(".weight")
            and len(shape) == 2 and shape[1] % 32 == 0 and (".ff." in k or "_ff." in k) == (kind == "ff")]


def _cases() -> list[dict]:
    cases = []
    for sampler in SAMPLERS:
        for cfg in (1.0, 3.0):
            for latent in ("av", "video"):
                cases.append({"id": f"{sampler}-cfg{cfg:g}-{latent}", "sampler": sampler, "cfg": cfg, "latent": latent})
    cases += [
        {"id": "ksampler-euler", "graph": "ksampler", "sampler": "euler", "cfg": 3.0},
        {"id": "ksampler-euler_ancestral", "graph": "ksampler", "sampler": "euler_ancestral", "cfg": 3.0,
         "scheduler": "linear_quadratic"},
        {"id": "ksampler_advanced-dpmpp_2m", "graph": "ksampler_advanced", "sampler": "dpmpp_2m", "cfg": 3.0,
         "steps": 4},
        {"id": "basic-guider-ltxv-scheduler", "guider": "basic", "sampler": "euler", "sigmas": "ltxv", "steps": 4},
        {"id": "dual-cfg-guider", "guider": "dual", "sampler": "euler", "cfg": 3.0},
        {"id": "eta-euler-ancestral-manual-sigmas", "sampler": "SamplerEulerAncestral", "eta": 0.7,
         "sigmas": "manual", "cfg": 3.0},
        {"id": "seed-again", "sampler": "euler_ancestral", "cfg": 3.0, "who": ["ours"]},
        {"id": "one-rank", "sampler": "euler_ancestral", "cfg": 3.0, "ranks": 1, "who": ["ours"]},
        {"id": "lora-0.5", "sampler": "euler", "cfg": 3.0, "loras": [["a.safetensors", 0.5]]},
        {"id": "lora-minus1", "sampler": "euler", "cfg": 3.0, "loras": [["a.safetensors", -1.0]]},
        {"id": "lora-stacked", "sampler": "euler", "cfg": 3.0, "loras": [["a.safetensors", 1.0],
                                                                         ["b.safetensors", 0.5]]},
        {"id": "lora-removed", "sampler": "euler", "cfg": 3.0},
        {"id": "lora-unknown-key", "sampler": "euler", "cfg": 3.0, "loras": [["unknown.safetensors", 1.0]]},
        {"id": "cond-i2v", "conditioning": "i2v", "sampler": "euler_ancestral", "cfg": 3.0},
        {"id": "cond-guides", "conditioning": "guides", "sampler": "euler_ancestral", "cfg": 3.0},
        {"id": "cond-guides_odd", "conditioning": "guides_odd", "sampler": "gradient_estimation", "cfg": 3.0},
        {"id": "cond-guides_odd-1rank", "conditioning": "guides_odd", "sampler": "gradient_estimation", "cfg": 3.0,
         "ranks": 1, "who": ["ours"]},
        {"id": "cond-guides_crop", "conditioning": "guides_crop", "sampler": "euler", "cfg": 1.0},
        {"id": "cond-ref_audio", "conditioning": "ref_audio", "sampler": "euler", "cfg": 3.0},
        {"id": "cond-a2v", "conditioning": "a2v", "sampler": "euler_ancestral", "cfg": 3.0},
        {"id": "cond-text_mask", "conditioning": "text_mask", "sampler": "euler", "cfg": 3.0},
        {"id": "stop", "sampler": "euler", "cfg": 3.0, "steps": 8, "stop_after": 2, "who": ["ours"]},
        {"id": "after-stop", "sampler": "euler", "cfg": 3.0},
    ]
    for model in [k + s for k in PACKED for s in ("", "_sharded")]:
        cases += [{"id": f"{model}-euler", "model": model, "sampler": "euler", "cfg": 3.0},
                  {"id": f"{model}-lora", "model": model, "sampler": "euler", "cfg": 3.0,
                   "loras": [["a.safetensors", 0.5]], "reference": "values"}]
    # the Model Loader's compile: on (last: it replaces the 2-rank pool's eager transformer)
    cases += [{"id": "compiled-euler", "model": "compiled", "sampler": "euler", "cfg": 3.0},
              {"id": "compiled-lora", "model": "compiled", "sampler": "euler", "cfg": 3.0,
               "loras": [["a.safetensors", 0.5]]},
              {"id": "compiled-stop", "model": "compiled", "sampler": "euler", "cfg": 3.0, "steps": 8,
               "stop_after": 2, "who": ["ours"]},
              {"id": "compiled-after-stop", "model": "compiled", "sampler": "euler", "cfg": 3.0}]
    return cases


@pytest.fixture(scope="module")
def run(tiny_ltx_23):
    """Run every case once (one ComfyUI process, one pool per world size); (out dir, report)."""
    work = Path(tempfile.mkdtemp(prefix="lm-cm-", dir="/tmp"))
    loras = work / "loras"
    loras.mkdir()
    _lora(loras / "a.safetensors", 1)
    _lora(loras / "b.safetensors", 2)
    _lora(loras / "unknown.safetensors", 3, unknown=True)
    unet = work / "unet"
    unet.mkdir()
    types = {**{k: "Q8_0" for k in _block_linears(tiny_ltx_23, "attn")}, **{k: "Q4_0" for k in _block_linears(
        tiny_ltx_23, "ff")}}
    gguf = export_gguf(tiny_ltx_23, unet / "ltx-2.3-tiny-Q8_0.gguf", types)
    values = str(dequantized_copy(gguf, work / "ltx-2.3-tiny-gguf-values.safetensors"))
    packed = {"gguf": {"dir": str(unet), "name": gguf.name, "reference": values, "values": values}}
    diffusion = work / "diffusion_models"
    diffusion.mkdir()
    for kind in ("nvfp4", "int8_convrot"):
        path = comfy_quantized.export_comfy_quant(tiny_ltx_23, diffusion / f"ltx-2.3-tiny-{kind}.safetensors",
                                               comfy_quantized.block_linear_formats(kind))
        values = str(comfy_quantized.dequantized_copy(path, work / f"{kind}-values.safetensors"))
        # ComfyUI 0.20.1 reads nvfp4, not int8: then the values' float32 file
        packed[kind] = {"dir": str(diffusion), "name": path.name, "values": values,
                        "reference": str(path) if kind == "nvfp4" else values}
    spec = {"comfyui": str(COMFYUI_DIR), "checkpoint": str(tiny_ltx_23), "loras_dir": str(loras),
            "runtime_dir": str(work / "rt"), "cases": _cases(), "packed": packed}
    (work / "rt").mkdir()
    (work / "spec.json").write_text(json.dumps(spec))
    out = work / "out"
    out.mkdir()
    python = os.environ.get("COMFYUI_PYTHON", sys.executable)
    proc = subprocess.run([python, str(SCRIPT), str(work / "spec.json"), str(out)], capture_output=True, text=True,
                          timeout=1500, env={**os.environ, "OMP_NUM_THREADS": "1",
                                             "LTX_MGPU_COMPILE_CACHE_DIR": str(work / "compile")})
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    return out, json.loads((out / "report.json").read_text())


def _read(out: Path, case: str, who: str) -> list[torch.Tensor]:
    sd = load_file(str(out / f"{case}.{who}.safetensors"))
    return [sd[f"part.{i}"] for i in range(len(sd))]


def _rel(a: list[torch.Tensor], b: list[torch.Tensor]) -> float:
    assert [t.shape for t in a] == [t.shape for t in b]
    return max(float((x - y).norm() / x.norm()) for x, y in zip(a, b, strict=True))


GRAPHS = ("ksampler", "ksampler_advanced", "basic", "dual", "eta")


@pytest.mark.parametrize("case", [c["id"] for c in _cases() if c["id"].split("-")[0] in SAMPLERS + GRAPHS])
def test_comfyuis_samplers_on_our_model_equal_comfyuis_own_model(run, case):
    out, _ = run
    theirs, ours = _read(out, case, "comfy"), _read(out, case, "ours")
    assert len(theirs) == (1 if case.endswith("-video") else 2)
    assert _rel(theirs, ours) <= REL, case


CONDITIONED = ("cond-i2v", "cond-guides", "cond-guides_odd", "cond-guides_crop", "cond-ref_audio", "cond-a2v",
               "cond-text_mask")


@pytest.mark.parametrize("case", CONDITIONED)
def test_ltx_conditioning_nodes_on_our_model_equal_comfyuis_own_model(run, case):
    """LTXVImgToVideoInplace, LTXVAddGuide (first and last frame, strengths 1 and 0.7; 75 video
    tokens: not divisible by the 2 ranks), LTXVCropGuides, LTXVReferenceAudio (ID-LoRA, with its
    identity-guidance pass), audio-to-video (SetLatentNoiseMask 0 on the audio), a text mask."""
    out, _ = run
    theirs, ours = _read(out, case, "comfy"), _read(out, case, "ours")
    assert _rel(theirs, ours) <= REL, case
    plain = _read(out, "euler-cfg3-av", "ours")
    if [t.shape for t in plain] == [t.shape for t in ours]:
        assert _rel(plain, ours) > 1e-3  # the conditioning changed the result
    if case == "cond-guides_crop":  # the guide frames are cropped off again
        assert ours[0].shape[2] == 4
    if case == "cond-a2v":  # a zero audio mask returns the audio exactly
        assert torch.equal(ours[1], theirs[1])
        g = torch.Generator().manual_seed(5)
        assert torch.equal(ours[1], torch.randn(1, 8, 5, 16, generator=g))
    if case == "cond-guides_odd":
        assert _rel(ours, _read(out, "cond-guides_odd-1rank", "ours")) <= 1e-5


def test_the_same_seed_twice_and_world_sizes_1_and_2_agree(run):
    out, _ = run
    first = _read(out, "euler_ancestral-cfg3-av", "ours")
    assert _rel(first, _read(out, "seed-again", "ours")) == 0.0
    assert _rel(first, _read(out, "one-rank", "ours")) <= 1e-5


@pytest.mark.parametrize("case", ["lora-0.5", "lora-minus1", "lora-stacked", "lora-removed", "lora-unknown-key"])
def test_comfyuis_lora_loader_on_our_model_equals_its_own_model(run, case):
    out, report = run
    theirs, ours = _read(out, case, "comfy"), _read(out, case, "ours")
    assert _rel(theirs, ours) <= REL
    base = _read(out, "euler-cfg3-av", "ours")
    if case == "lora-removed":
        assert _rel(base, ours) == 0.0
    else:
        assert _rel(base, ours) > 1e-3
    entry = report["cases"][case]
    if case == "lora-unknown-key":
        assert any("no_such_block" in w for w in entry["ours_warnings"]), entry
        assert entry["ours_warnings"] == entry["comfy_warnings"]


def test_the_context_and_the_patches_are_sent_once_per_run(run):
    _, report = run
    first = report["cases"]["euler-cfg1-av"]["ours_calls"]
    assert first == {"text_contexts": 2, "forward": 3, "context": 1}, first  # cond alone at cfg 1
    calls = report["cases"]["lora-stacked"]["ours_calls"]  # cond + uncond in one call per step, LoRAs once
    assert calls["forward"] == 3 and calls["context"] <= 1 and calls["model_patches"] == 1, calls


def test_stop_interrupts_sampling_and_the_next_run_works(run):
    out, report = run
    stop = report["cases"]["stop"]
    assert stop.get("ours_interrupted") and stop["ours_calls"]["forward"] <= 2, stop
    assert _rel(_read(out, "after-stop", "comfy"), _read(out, "after-stop", "ours")) <= REL


@pytest.mark.parametrize("model", [k + s for k in PACKED for s in ("", "_sharded")])
def test_a_packed_transformer_file_equals_comfyuis_own_model_on_it(run, model):
    out, report = run
    assert report["listed"][model.removesuffix("_sharded")]
    plain, lora = (f"{model}-euler", f"{model}-lora")
    for case in (plain, lora):
        assert _rel(_read(out, case, "comfy"), _read(out, case, "ours")) <= REL, case
    assert _rel(_read(out, lora, "ours"), _read(out, plain, "ours")) > 1e-3  # the LoRA took effect


def test_comfyui_sees_a_model_of_one_byte_and_reads_no_weights(run):
    _, report = run
    assert report["model_size"] == 1
    assert report["vae"] == "VAE"
    assert all(v < 64 << 20 for v in report["rss_model_load"].values()), report["rss_model_load"]


def test_compile_on_with_comfyuis_lora_loader_and_stop_equals_comfyuis_own_model(run):
    """The Model Loader's ``compile: on`` (fp32 on 2 CPU ranks): ComfyUI's sampler on the compiled
    blocks, with ComfyUI's LoRA loader on that MODEL, equals ComfyUI's own model; Stop interrupts
    it and the next run equals ComfyUI's own model again."""
    out, report = run
    assert report["compiled_plan"]["compiled"] is True, report["compiled_plan"]
    for case in ("compiled-euler", "compiled-lora", "compiled-after-stop"):
        assert _rel(_read(out, case, "comfy"), _read(out, case, "ours")) <= REL, case
    assert _rel(_read(out, "compiled-lora", "ours"), _read(out, "compiled-euler", "ours")) > 1e-3
    stop = report["cases"]["compiled-stop"]
    assert stop.get("ours_interrupted") and stop["ours_calls"]["forward"] <= 2, stop
