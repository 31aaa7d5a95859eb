"""ComfyUI's official LTX-2 templates, as shipped and with our two loaders swapped in, in a real ComfyUI.

Runs only when ``COMFYUI_DIR`` points at a ComfyUI checkout (docs/testing.md, "Testing against a
real ComfyUI") and Chromium is installed (``$CHROMIUM``, default ``/usr/bin/chromium``); skipped
otherwise, with the reason. The templates are the release ``requirements-templates.txt`` pins
(comfyui-workflow-templates-json 0.1.123, the one comfyui-workflow-templates 0.11.97 pins),
which ``scripts/bootstrap.sh`` installs into ``.templates/`` (``pip install --no-deps --target``;
``$COMFYUI_TEMPLATES_JSON`` points elsewhere): not the templates package of ComfyUI's own
environment. Last run: ComfyUI 0.20.1, frontend 1.43.18.

1. Every LTX-2 template of the release (``video_ltx2*``, ``template_ltx2_3*``) is in
   :data:`TEMPLATES` (the 13 ComfyUI 0.20.1 runs: every node type they hold, in their subgraphs
   too, is one its ``/object_info`` lists) or in :data:`NEEDS_NEWER_COMFYUI` (its
   ``minComfyUIVersion`` is above the installed ComfyUI's, and node types it needs are missing).
2. ComfyUI's own frontend, in headless Chromium, loads each template and converts it to API
   format (``app.graphToPrompt``: subgraphs expanded, bypassed and muted nodes dropped).
3. ``template_support`` edits the API graph: :func:`~template_support.shrink` turns the
   template's own size knobs down (192x128 output, stage 1 at 96x64, 9 frames or 1 second,
   ``LTXVScheduler`` at 4 steps; sigmas, seeds, cfg, samplers, LoRA strengths, prompts and the
   prompt-enhancement switch and settings stay); :func:`~template_support.swap_loaders` makes the
   README's swap (checked to change nothing else: :func:`~template_support.swap_differences`):
   the Gemma Loader at its defaults (dtype ``auto``: fp32 on these CPU ranks, as ComfyUI's text
   encoder computes), our Model Loader in ``fp32`` (ComfyUI's own model computes in fp32 on the CPU).
4. ``tests/comfyui_templates_run.py`` runs both graphs in one ComfyUI process with ComfyUI's
   executor, the nodes as shipped (no test patch): the template on ComfyUI's own model
   (in-process, CPU, fp32), the swapped one on a pool of 2 CPU ranks, up to each
   ``SamplerCustomAdvanced`` (stage 1, and stage 2 after ``LTXVCropGuides`` and
   ``LTXVLatentUpsampler`` where the template has one), the prompt-enhancement branch run where
   the template has it on. Both outputs of each sampler (``output``, ``denoised_output``) agree
   to 1e-5 relative (max |delta| / max |x|), video and audio parts apart. Stage 2 runs on the
   same pool model as stage 1: it is not loaded again, and the pool merges a new LoRA set exactly
   when stage 2's differs (the distilled LoRA added for stage 2 in the LTX-2.0 templates).

Two templates have prompt enhancement on by default (:data:`ENHANCED`): their Gemma Loader CLIP
goes through ``LoraLoader`` (a Gemma LoRA) into ``TextGenerateLTX2Prompt`` (``clip.generate``).
Their cases run that branch as shipped, on ComfyUI's CLIP and on ours (the enhancement in the pool).

The tiny models stand in under the file names the templates load: the tiny LTX-2.3 and LTX-2.0
checkpoints (ComfyUI's audio VAE added, the text projection in bf16 as in the real files), the
tiny Gemma 3 as ComfyUI's single file (for ``gemma_3_12B_it_fp4_mixed.safetensors`` too), a tiny
LoRA per LoRA file (distilled, IC-LoRA canny / depth, camera and style LoRAs, ID LoRA: factors
for a few of the tiny model's weights; the Gemma LoRA: factors for a few of the tiny Gemma's, in
ComfyUI's generic ``text_encoders.`` key format), a tiny ``LatentUpsampler`` of ComfyUI's own
class per upscaler file; random images, H.264 videos and MP3s under the input names. What they
cannot stand in for is replaced, the same in both graphs: the depth template's *Image to Depth
Map (Lotus)* subgraph (a Stable Diffusion 2 depth model) is removed and its input frames are used
as the depth maps (:func:`~template_support.stand_in_for_lotus`). The tiny transformer's output
is noise: these runs prove that the swapped graph computes what the template computes, not quality.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import comfyui_support  # noqa: E402
import template_support as ts  # noqa: E402
from comfyui_support import (  # noqa: E402
    AUDIO_VAE_SCRIPT,
    COMFYUI_DIR,
    COMFYUI_PYTHON,
    NEEDS_COMFYUI_REASON,
    REPO,
    has_comfyui,
)

pytestmark = [
    pytest.mark.skipif(not has_comfyui(), reason=NEEDS_COMFYUI_REASON),
]

SCRIPT = Path(__file__).resolve().parents[1] / "comfyui_templates_run.py"
REL = 1e-5
#: The output size the graphs are shrunk to (stage 1 samples half of it) and the input media's.
WIDTH, HEIGHT = 192, 128
MEDIA = {"image": [160, 96], "video": [160, 96, 12], "audio": 2.0}
#: The templates release the tests run: ``requirements-templates.txt``'s one line.
(PIN,) = [line.strip() for line in (REPO / "requirements-templates.txt").read_text().splitlines()
          if line.strip() and not line.startswith("#")]
#: Where it is installed (``scripts/bootstrap.sh``), or ``$COMFYUI_TEMPLATES_JSON``.
TEMPLATES_ROOT = Path(os.environ.get("COMFYUI_TEMPLATES_JSON")
                      or REPO / ".templates" / "comfyui-workflow-templates-json")

#: Every LTX-2 template of the release that ComfyUI 0.20.1 runs: LTX version, sampler stages run, what it does.
TEMPLATES = {
    "video_ltx2_t2v": ("2.0", 2, "text to video; LTXVScheduler, cfg 4; stage 2 adds the distilled LoRA"),
    "video_ltx2_t2v_distilled": ("2.0", 2, "text to video, distilled checkpoint, 8 + 3 steps"),
    "video_ltx2_i2v": ("2.0", 2, "image to video (LTXVImgToVideoInplace); stage 2 adds the distilled LoRA"),
    "video_ltx2_i2v_distilled": ("2.0", 2, "image to video, distilled checkpoint"),
    "video_ltx2_i2v_lora": ("2.0", 2, "image to video with a LoRA on both stages; stage 2 adds the distilled LoRA"),
    "video_ltx2_canny_to_video": ("2.0", 2, "Canny edges of a video as guides (LTXVAddGuide, IC-LoRA); stage 2 "
                                            "adds the distilled LoRA (the distilled variant is bypassed)"),
    "video_ltx2_depth_to_video": ("2.0", 2, "depth maps (Lotus) as guides (LTXVAddGuide, IC-LoRA); stage 2 adds the "
                                            "distilled LoRA; the Lotus model stood in (module doc)"),
    "video_ltx2_3_t2v": ("2.3", 2, "text to video, prompt enhancement on (Gemma LoRA + TextGenerateLTX2Prompt); "
                                   "the distilled LoRA at 0.5 on both stages"),
    "video_ltx2_3_i2v": ("2.3", 2, "image to video, prompt enhancement off; the distilled LoRA at 0.5 on both stages"),
    "video_ltx2_3_ia2v": ("2.3", 2, "image + audio to video (the audio kept: SetLatentNoiseMask), prompt enhancement "
                                    "on"),
    "video_ltx2_3_id_lora": ("2.3", 2, "reference audio (LTXVReferenceAudio, identity guidance) and the ID LoRA on "
                                       "stage 1"),
    "video_ltx2_3_flf2v": ("2.3", 1, "first and last frame to video (two LTXVAddGuide), distilled checkpoint"),
    "template_ltx2_3_style_transition": ("2.3", 1, "first / last frame with a style-transition LoRA"),
}
#: The release's other LTX-2 templates: the ComfyUI release they ask for (their ``minComfyUIVersion``)
#: and what they need that ComfyUI 0.20.1 lacks.
NEEDS_NEWER_COMFYUI = {
    "video_ltx2_3_ic_lora": ("0.22.0", "GetICLoRAParameters and the MoGe depth nodes (IC-LoRA union control)"),
    "template_ltx2_3_ic_lora_ingredients": ("0.22.0", "GetICLoRAParameters (IC-LoRA reference sheet)"),
    "video_ltx2_5_t2v": ("0.32.0", "LTXVDualCFGGuider (LTX-2.5)"),
    "video_ltx2_5_i2v": ("0.32.0", "LTXVDualCFGGuider (LTX-2.5)"),
    "video_ltx2_5_flf2v": ("0.32.0", "LTXVDualCFGGuider (LTX-2.5)"),
}
#: The templates with prompt enhancement on: their swapped runs generate with our CLIP in the pool.
ENHANCED = {"video_ltx2_3_t2v", "video_ltx2_3_ia2v"}
#: The template whose LoRAs are also left out once (on ComfyUI's model), to show that they matter.
CONTROL = "video_ltx2_i2v_lora"
STAGES = [pytest.param(name, stage, id=f"{name}-stage{stage}")
          for name, (_, n, _) in TEMPLATES.items() for stage in range(1, n + 1)]


def _version(text: str) -> tuple[int, ...]:
    return tuple(int(x) for x in text.split("."))


def _comfyui_version() -> str:
    """The installed ComfyUI's version (its ``comfyui_version.py``)."""
    text = (Path(COMFYUI_DIR) / "comfyui_version.py").read_text()
    return text.split("__version__ =", 1)[1].strip().strip("\"'")


def _chromium() -> str:
    path = os.environ.get("CHROMIUM") or shutil.which("chromium") or "/usr/bin/chromium"
    if not Path(path).exists():
        pytest.skip("no Chromium (Debian: apt-get install chromium); set $CHROMIUM to its path: the templates are "
                    "converted to API format by ComfyUI's own frontend")
    return path


@pytest.fixture(scope="module")
def templates(tiny_gemma_dir, tiny_ltx_23):
    """``{"version": the release's, "ui": {name: UI workflow}, "index": {name: index entry}, "api":
    {name: the frontend's API graph}, "unknown": {name: node types the frontend did not know},
    "object_info": node types the server lists}``; the server is stopped before the graphs run."""
    assert TEMPLATES_ROOT.is_dir(), (f"the official templates ({PIN}) are not installed at {TEMPLATES_ROOT}: run "
                                     "scripts/bootstrap.sh (it installs requirements-templates.txt into .templates/), "
                                     "or point $COMFYUI_TEMPLATES_JSON at a 'pip install --no-deps --target' of it")
    chromium = _chromium()
    version, ui, index = ts.read_templates(TEMPLATES_ROOT)
    with comfyui_support.comfyui_server(tiny_gemma_dir, tiny_ltx_23) as srv:
        status, info = comfyui_support.http(f"{srv.url}/object_info", timeout=120)
        assert status == 200, info
        runnable = {k: v for k, v in ui.items() if k in TEMPLATES}
        converted = ts.convert_in_frontend(srv.url, chromium, runnable, comfyui_support)
    return {"version": version, "ui": ui, "index": index, "api": {k: v["api"] for k, v in converted.items()},
            "unknown": {k: v["unknown"] for k, v in converted.items()}, "object_info": set(info)}


def _prepare(api: dict) -> dict:
    """The graph both runs take (Lotus stood in, shrunk) and its swap."""
    graph, _ = ts.stand_in_for_lotus(api)
    small = ts.shrink(graph, width=WIDTH, height=HEIGHT)
    return {"small": small, "swapped": ts.swap_loaders(small, cpu_ranks=2, dtype="fp32"),
            "samplers": ts.sampler_stages(small)}


def _lora(path: Path, checkpoint: Path, seed: int) -> None:
    """A tiny LoRA (rank 2) for a few weights of ``checkpoint``: the first block's video and
    audio self-attention queries, its audio-to-video keys, the last block's feed-forward input."""
    with safe_open(str(checkpoint), "pt") as f:
        names = f.keys()
        shapes = {k: f.get_slice(k).get_shape() for k in names}
    prefix = "model.diffusion_model.transformer_blocks."
    last = max(int(k[len(prefix):].split(".")[0]) for k in shapes if k.startswith(prefix))
    stems = ["0.attn1.to_q", "0.audio_attn1.to_q", "0.audio_to_video_attn.to_k", f"{last}.ff.net.0.proj"]
    g = torch.Generator().manual_seed(seed)
    sd = {}
    for stem in stems:
        out_f, in_f = shapes[f"{prefix}{stem}.weight"]
        sd[f"diffusion_model.transformer_blocks.{stem}.lora_A.weight"] = torch.randn(2, in_f, generator=g)
        sd[f"diffusion_model.transformer_blocks.{stem}.lora_B.weight"] = 0.5 * torch.randn(out_f, 2, generator=g)
    save_file(sd, str(path))


def _gemma_lora(path: Path, gemma: Path, seed: int) -> None:
    """A tiny Gemma LoRA (rank 2) for the tiny Gemma of ComfyUI's single file ``gemma``: its first and
    last layers' attention queries and MLP down projections, in ComfyUI's generic text-encoder key
    format (``text_encoders.<the CLIP's state-dict key>``, ``comfy/lora.py`` ``model_lora_keys_clip``;
    LTX-2's CLIP holds Gemma as ``gemma3_12b.transformer.model.*``)."""
    with safe_open(str(gemma), "pt") as f:
        names = f.keys()
        shapes = {k: f.get_slice(k).get_shape() for k in names if k.startswith("model.layers.")}
    last = max(int(k.split(".")[2]) for k in shapes)
    g = torch.Generator().manual_seed(seed)
    sd = {}
    for layer in (0, last):
        for stem in ("self_attn.q_proj", "mlp.down_proj"):
            out_f, in_f = shapes[f"model.layers.{layer}.{stem}.weight"]
            key = f"text_encoders.gemma3_12b.transformer.model.layers.{layer}.{stem}"
            sd[f"{key}.lora_A.weight"] = torch.randn(2, in_f, generator=g)
            sd[f"{key}.lora_B.weight"] = 0.5 * torch.randn(out_f, 2, generator=g)
    save_file(sd, str(path))


def _checkpoint(src: Path, dst: Path, work: Path) -> None:
    """The tiny checkpoint with its text projection in bf16 (as in the real files; ComfyUI keeps it
    in the Gemma file's dtype) and ComfyUI's own audio VAE and vocoder added."""
    with safe_open(str(src), "pt") as f:
        metadata = f.metadata()
    sd = {k: (v.to(torch.bfloat16) if k.startswith("text_embedding_projection.") else v)
          for k, v in load_file(str(src)).items()}
    staged = work / f"staged-{dst.name}"
    save_file(sd, str(staged), metadata=metadata)
    built = subprocess.run([COMFYUI_PYTHON, "-c", AUDIO_VAE_SCRIPT, str(staged), str(dst), COMFYUI_DIR],
                           capture_output=True, text=True, timeout=600, cwd=COMFYUI_DIR)
    assert built.returncode == 0, f"building the tiny audio VAE in ComfyUI failed:\n{built.stderr[-4000:]}"
    staged.unlink()


@pytest.fixture(scope="module")
def run(templates, tiny_gemma_dir, tiny_gemma_comfy_file, tiny_ltx_20, tiny_ltx_23):
    """Both graphs of every template ComfyUI runs through ``comfyui_templates_run.py``; ``(prepared
    graphs, out dir, report)``."""
    work = Path(tempfile.mkdtemp(prefix="lm-tpl-", dir="/tmp"))
    dirs = {name: work / name for name in ("models", "input", "output", "temp", "rt", "out", "cache")}
    for d in dirs.values():
        d.mkdir()
    tiny = {"2.0": work / "tiny-ltx-2.0.safetensors", "2.3": work / "tiny-ltx-2.3.safetensors"}
    _checkpoint(tiny_ltx_20, tiny["2.0"], work)
    _checkpoint(tiny_ltx_23, tiny["2.3"], work)
    prepared = {name: _prepare(api) for name, api in templates["api"].items() if name in TEMPLATES}
    assets: dict = {"upsamplers": [], "images": {}, "videos": {}, "audio": {}}
    runs = []
    for name, graphs in prepared.items():
        version = TEMPLATES[name][0]
        for folder, files in ts.model_files(graphs["small"]).items():
            (dirs["models"] / folder).mkdir(exist_ok=True)
            for file in sorted(files):
                path = dirs["models"] / folder / file
                if path.exists() or path.is_symlink():
                    continue
                if folder == "checkpoints":
                    path.symlink_to(tiny["2.3" if "2.3" in file else "2.0"])
                elif folder == "text_encoders":
                    path.symlink_to(tiny_gemma_comfy_file)
                elif folder == "loras" and "gemma" in file.lower():  # a text-encoder LoRA
                    _gemma_lora(path, tiny_gemma_comfy_file, seed=len(list(path.parent.iterdir())) + 1)
                elif folder == "loras":
                    _lora(path, tiny[version], seed=len(list(path.parent.iterdir())) + 1)
                elif folder == "latent_upscale_models":
                    assets["upsamplers"].append(str(path))
                else:
                    raise AssertionError(f"{name} loads {folder}/{file}, which no tiny model stands in for")
        for kind, files in ts.input_files(graphs["small"]).items():
            for file in files:
                assets[{"image": "images", "video": "videos", "audio": "audio"}[kind]][str(dirs["input"] / file)] = \
                    MEDIA[kind]
        for who, graph in (("comfy", graphs["small"]), ("ours", graphs["swapped"])):
            runs.append({"id": f"{name}.{who}", "prompt": graph, "samplers": graphs["samplers"]})
    control = prepared[CONTROL]
    runs.append({"id": f"{CONTROL}.comfy-without-loras", "prompt": ts.without_loras(control["small"]),
                 "samplers": control["samplers"]})
    with safe_open(str(tiny["2.3"]), "pt") as f:
        widths = [f.get_slice(f"text_embedding_projection.{m}_aggregate_embed.bias").get_shape()[0]
                  for m in ("video", "audio")]
    with safe_open(str(tiny["2.0"]), "pt") as f:
        single = f.get_slice("text_embedding_projection.aggregate_embed.weight").get_shape()[0]
    spec = {"comfyui": COMFYUI_DIR, "models": str(dirs["models"]), "input": str(dirs["input"]),
            "output": str(dirs["output"]), "temp": str(dirs["temp"]), "runtime_dir": str(dirs["rt"]),
            "gemma_config": str(Path(tiny_gemma_dir) / "config.json"),
            "projections": {"2.0": single, "2.3": widths}, "assets": assets, "runs": runs}
    (work / "spec.json").write_text(json.dumps(spec))
    env = {**os.environ, "OMP_NUM_THREADS": "1", "LTX_MGPU_RUNTIME_DIR": str(dirs["rt"]),
           "LTX_MGPU_CACHE_DIR": str(dirs["cache"])}
    proc = subprocess.run([COMFYUI_PYTHON, str(SCRIPT), str(work / "spec.json"), str(dirs["out"])], cwd=COMFYUI_DIR,
                          env=env, capture_output=True, text=True, timeout=1500)
    assert proc.returncode == 0, f"{SCRIPT.name} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
    yield prepared, dirs["out"], json.loads((dirs["out"] / "report.json").read_text())
    from pool_support import cleanup

    cleanup(dirs["rt"])
    shutil.rmtree(work, ignore_errors=True)


# --------------------------------------------------------------------------- which templates, which nodes


def test_every_ltx2_template_of_the_release_is_known(templates):
    assert f"comfyui-workflow-templates-json=={templates['version']}" == PIN, (templates["version"], PIN)
    assert sorted(templates["ui"]) == sorted([*TEMPLATES, *NEEDS_NEWER_COMFYUI]), \
        "templates added or removed: update TEMPLATES / NEEDS_NEWER_COMFYUI and the README"


@pytest.mark.parametrize("name", TEMPLATES)
def test_comfyui_has_every_node_the_template_uses(templates, name):
    missing = sorted(ts.ui_node_types(templates["ui"][name]) - templates["object_info"])
    assert not missing, f"{name} needs nodes this ComfyUI lacks: {missing}"
    assert _version(templates["index"][name]["minComfyUIVersion"]) <= _version(_comfyui_version())


@pytest.mark.parametrize("name", NEEDS_NEWER_COMFYUI)
def test_the_others_ask_for_a_newer_comfyui_and_need_nodes_it_lacks(templates, name):
    release, _ = NEEDS_NEWER_COMFYUI[name]
    assert templates["index"][name]["minComfyUIVersion"] == release
    assert _version(release) > _version(_comfyui_version())
    assert ts.ui_node_types(templates["ui"][name]) - templates["object_info"], name


@pytest.mark.parametrize("name", TEMPLATES)
def test_the_frontend_converts_the_template(templates, name):
    api = templates["api"][name]
    assert not templates["unknown"][name], templates["unknown"][name]
    assert {v["class_type"] for v in api.values()} <= templates["object_info"]
    graph, lotus = ts.stand_in_for_lotus(api)
    assert lotus == (name == "video_ltx2_depth_to_video")  # the one sampler the tiny models cannot run
    assert len(ts.sampler_stages(graph)) == TEMPLATES[name][1]
    assert ts.version_of(graph) == TEMPLATES[name][0]


@pytest.mark.parametrize("name", TEMPLATES)
def test_the_swap_replaces_the_two_loaders_and_nothing_else(run, name):
    prepared, _, _ = run
    small, swapped = prepared[name]["small"], prepared[name]["swapped"]
    assert ts.swap_differences(small, swapped) == []
    types = [v["class_type"] for v in swapped.values()]
    assert "CheckpointLoaderSimple" not in types and "LTXAVTextEncoderLoader" not in types
    assert types.count("LTXMGPU_Pool") == 1 and "LTXMGPU_ModelLoader" in types and "LTXMGPU_GemmaLoader" in types


# --------------------------------------------------------------------------- parity


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max().clamp(min=1e-12))


@pytest.mark.parametrize("name", TEMPLATES)
def test_the_template_runs_on_comfyuis_own_model(run, name):
    """The stock side of every comparison, prompt enhancement included where it is on."""
    _, _, report = run
    entry = report["runs"][f"{name}.comfy"]
    assert entry["ok"], f"{name} failed on ComfyUI's own model: {json.dumps(entry.get('error'))[:3000]}"
    if name in ENHANCED:
        assert entry["generated"], entry  # TextGenerateLTX2Prompt ran


@pytest.mark.parametrize(("name", "stage"), STAGES)
def test_the_swapped_template_samples_what_the_template_samples(run, name, stage, record_property):
    prepared, out, report = run
    for who in ("comfy", "ours"):
        entry = report["runs"][f"{name}.{who}"]
        assert entry["ok"], f"{name} ({who}) failed: {json.dumps(entry.get('error'))[:3000]}"
    sampler = prepared[name]["samplers"][stage - 1]
    theirs, ours = (load_file(str(out / f"{name}.{who}.safetensors")) for who in ("comfy", "ours"))
    keys = sorted(k for k in theirs if k.startswith(f"{sampler}."))
    assert keys and keys == sorted(k for k in ours if k.startswith(f"{sampler}.")), (keys, sorted(ours))
    worst = {"video": 0.0, "audio": 0.0}
    for key in keys:
        assert theirs[key].shape == ours[key].shape, key
        part = "video" if key.endswith(".0") else "audio"
        worst[part] = max(worst[part], _rel(ours[key], theirs[key]))
    video = theirs[f"{sampler}.output.0"]
    frames, h, w = video.shape[2:]  # latent frames (guide frames too); 32x spatial
    assert frames <= 8 and h * w <= (HEIGHT // 32) * (WIDTH // 32), f"the graph was not shrunk: {tuple(video.shape)}"
    assert f"{sampler}.output.1" in keys, "an LTX-2 template samples audio and video"
    for part, rel in worst.items():
        record_property(f"{part}_max_rel", rel)
        assert rel <= REL, (name, stage, part, rel)


def test_the_tiny_loras_change_the_latents_far_beyond_the_tolerance(run):
    prepared, out, report = run
    entry = report["runs"][f"{CONTROL}.comfy-without-loras"]
    assert entry["ok"], entry.get("error")
    with_loras, without = (load_file(str(out / f"{CONTROL}.{who}.safetensors"))
                           for who in ("comfy", "comfy-without-loras"))
    for sampler in prepared[CONTROL]["samplers"]:
        for part in (0, 1):
            key = f"{sampler}.output.{part}"
            assert _rel(without[key], with_loras[key]) > 100 * REL, key


def _lora_chain(api: dict, sampler: str) -> list:
    """The ``LoraLoaderModelOnly`` (file, strength) pairs between a sampler's guider model and its
    loader, nearest the loader first."""
    node_id = api[sampler]["inputs"]["guider"][0]
    chain = []
    while True:
        node = api[node_id]
        if node["class_type"] == "LoraLoaderModelOnly":
            chain.append((node["inputs"]["lora_name"], node["inputs"]["strength_model"]))
        model = node["inputs"].get("model")
        if not ts.is_link(model):
            return chain[::-1]
        node_id = model[0]


TWO_STAGES = [pytest.param(name) for name, (_, n, _) in TEMPLATES.items() if n == 2]


@pytest.mark.parametrize("name", TWO_STAGES)
def test_stage_2_runs_on_the_same_pool_model_with_its_own_loras(run, name, record_property):
    prepared, _, report = run
    graph = prepared[name]["swapped"]
    stage1, stage2 = prepared[name]["samplers"]
    entry = report["runs"][f"{name}.ours"]
    assert entry["ok"], entry.get("error")
    pool = entry["pool"]
    assert pool["reloads"] == [], pool  # the MODEL never found its model gone: no base weights loaded again
    merged_in_stage_2 = [s for s in pool["patch_syncs"] if s["node"] == stage2]
    loras = (_lora_chain(graph, stage1), _lora_chain(graph, stage2))
    assert len(merged_in_stage_2) == (1 if loras[0] != loras[1] else 0), (pool, loras)
    if merged_in_stage_2:
        record_property("lora_swap_seconds", merged_in_stage_2[0]["seconds"])
