"""The shipped workflows, the web panel's view logic and the packaging metadata, without ComfyUI.

Workflows (``workflows/*.json`` UI format, ``workflows/api/*.api.json`` API twins): every node
type is ours or a core node listed in :data:`CORE_NODES`; every UI link's type equals its
origin output's and target input's types; link tables and node sockets agree; each node's
``widgets_values`` has one value per widget (plus ``control_after_generate`` entries) and
each combo value of ours is a legal choice; every required input is connected or set; and the
API twin is exactly what the UI file converts to (so the files tested headless are the files
users drag onto the canvas). The web panel's pure view module runs under Node.js when it is
installed. Packaging: pyproject ``[project]`` / ``[tool.comfy]``, ``.comfyignore``.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path

import pytest
import tomllib
from nodes_support import load_pack

REPO = Path(__file__).resolve().parents[2]
WORKFLOWS = REPO / "workflows"
API_DIR = WORKFLOWS / "api"
WIDGET_TYPES = {"INT", "FLOAT", "STRING", "BOOLEAN", "COMBO"}

# Core node contracts used by our workflows, transcribed from ComfyUI's source (comfyanonymous/ComfyUI):
#   comfy_extras/nodes_lt.py @ 085a1a95 (EmptyLTXVLatentVideo, LTXVConditioning, LTXVScheduler,
#     LTXVConcatAVLatent, LTXVSeparateAVLatent); comfy_extras/nodes_lt_audio.py @ 0ab8df09
#     (LTXVAudioVAELoader, LTXVEmptyLatentAudio, LTXVAudioVAEDecode); comfy_extras/nodes_custom_sampler.py
#     @ 065c1df0 (SamplerCustomAdvanced, CFGGuider, RandomNoise, KSamplerSelect, ManualSigmas);
#     comfy_extras/nodes_video.py @ 0413db9d (CreateVideo, SaveVideo); nodes.py @ 01094316
#     (CheckpointLoaderSimple, VAEDecode).
# Inputs in declaration order as (name, type); "?" marks optional inputs; "INT+control" is an INT widget with
# control_after_generate (one extra widgets_values entry in UI files). Outputs as (name, type).
CORE_NODES: dict[str, dict] = {
    "CheckpointLoaderSimple": {"inputs": [("ckpt_name", "COMBO")],
                               "outputs": [("MODEL", "MODEL"), ("CLIP", "CLIP"), ("VAE", "VAE")]},
    "VAEDecode": {"inputs": [("samples", "LATENT"), ("vae", "VAE")], "outputs": [("IMAGE", "IMAGE")]},
    "EmptyLTXVLatentVideo": {"inputs": [("width", "INT"), ("height", "INT"), ("length", "INT"), ("batch_size", "INT")],
                             "outputs": [("LATENT", "LATENT")]},
    "LTXVConditioning": {"inputs": [("positive", "CONDITIONING"), ("negative", "CONDITIONING"),
                                    ("frame_rate", "FLOAT")],
                         "outputs": [("positive", "CONDITIONING"), ("negative", "CONDITIONING")]},
    "LTXVScheduler": {"inputs": [("steps", "INT"), ("max_shift", "FLOAT"), ("base_shift", "FLOAT"),
                                 ("stretch", "BOOLEAN"), ("terminal", "FLOAT"), ("latent?", "LATENT")],
                      "outputs": [("SIGMAS", "SIGMAS")]},
    "LTXVConcatAVLatent": {"inputs": [("video_latent", "LATENT"), ("audio_latent", "LATENT")],
                           "outputs": [("latent", "LATENT")]},
    "LTXVSeparateAVLatent": {"inputs": [("av_latent", "LATENT")],
                             "outputs": [("video_latent", "LATENT"), ("audio_latent", "LATENT")]},
    "LTXVAudioVAELoader": {"inputs": [("ckpt_name", "COMBO")], "outputs": [("Audio VAE", "VAE")]},
    "LTXVEmptyLatentAudio": {"inputs": [("frames_number", "INT"), ("frame_rate", "INT"), ("batch_size", "INT"),
                                        ("audio_vae", "VAE")],
                             "outputs": [("Latent", "LATENT")]},
    "LTXVAudioVAEDecode": {"inputs": [("samples", "LATENT"), ("audio_vae", "VAE")], "outputs": [("Audio", "AUDIO")]},
    "SamplerCustomAdvanced": {"inputs": [("noise", "NOISE"), ("guider", "GUIDER"), ("sampler", "SAMPLER"),
                                         ("sigmas", "SIGMAS"), ("latent_image", "LATENT")],
                              "outputs": [("output", "LATENT"), ("denoised_output", "LATENT")]},
    "CFGGuider": {"inputs": [("model", "MODEL"), ("positive", "CONDITIONING"), ("negative", "CONDITIONING"),
                             ("cfg", "FLOAT")],
                  "outputs": [("GUIDER", "GUIDER")]},
    "RandomNoise": {"inputs": [("noise_seed", "INT+control")], "outputs": [("NOISE", "NOISE")]},
    "KSamplerSelect": {"inputs": [("sampler_name", "COMBO")], "outputs": [("SAMPLER", "SAMPLER")]},
    "ManualSigmas": {"inputs": [("sigmas", "STRING")], "outputs": [("SIGMAS", "SIGMAS")]},
    "CreateVideo": {"inputs": [("images", "IMAGE"), ("fps", "FLOAT"), ("audio?", "AUDIO")],
                    "outputs": [("VIDEO", "VIDEO")]},
    "SaveVideo": {"inputs": [("video", "VIDEO"), ("filename_prefix", "STRING"), ("format", "COMBO"),
                             ("codec", "COMBO")],
                  "outputs": []},
}


def _contract_of_ours(cls) -> dict:
    """Our node's contract in the CORE_NODES form, from its schema (ComfyUI's V3 ``define_schema``,
    which ComfyUI turns into the same required-then-optional input order the frontend shows)."""
    schema = cls.define_schema()
    inputs, choices = [], {}
    for optional in (False, True):
        for i in schema.inputs:
            if i.optional != optional:
                continue
            kind = i.io_type
            if kind == "COMBO":
                choices[i.id] = list(i.options)
            if kind == "INT" and i.control_after_generate:
                kind = "INT+control"
            inputs.append((i.id + ("?" if optional else ""), kind))
    return {"inputs": inputs, "outputs": [(o.display_name, o.io_type) for o in schema.outputs], "choices": choices}


def contracts() -> dict[str, dict]:
    pack = load_pack()
    out = {k: dict(v, choices={}) for k, v in CORE_NODES.items()}
    out.update({k: _contract_of_ours(c) for k, c in pack.NODES.items()})
    return out


def _base(t: str) -> str:
    return t.split("+")[0]


def widget_names(contract: dict) -> list[str]:
    return [n.rstrip("?") for n, t in contract["inputs"] if _base(t) in WIDGET_TYPES]


def link_inputs(contract: dict) -> list[tuple[str, str, bool]]:
    return [(n.rstrip("?"), t, n.endswith("?")) for n, t in contract["inputs"] if _base(t) not in WIDGET_TYPES]


def ui_to_api(ui: dict, known: dict[str, dict]) -> dict:
    """The API-format prompt of a UI-format workflow (what ComfyUI's frontend queues): widget
    values by name (``control_after_generate`` entries dropped), links as ``[node_id, slot]``."""
    links = {link[0]: link for link in ui["links"]}
    api = {}
    for node in sorted(ui["nodes"], key=lambda n: n["id"]):
        contract = known[node["type"]]
        values = list(node.get("widgets_values", []))
        inputs: dict = {}
        for name, t in ((n.rstrip("?"), t) for n, t in contract["inputs"] if _base(t) in WIDGET_TYPES):
            inputs[name] = values.pop(0)
            if t == "INT+control":
                values.pop(0)
        for slot in node.get("inputs", []):
            if slot.get("link") is not None:
                link = links[slot["link"]]
                inputs[slot["name"]] = [str(link[1]), link[2]]
        api[str(node["id"])] = {"class_type": node["type"], "inputs": inputs,
                                "_meta": {"title": node.get("title") or node["type"]}}
    return api


def _ui_files() -> list[Path]:
    return sorted(WORKFLOWS.glob("*.json"))


def test_every_ui_workflow_has_an_api_twin_and_there_are_three():
    names = [p.stem for p in _ui_files()]
    assert len(names) >= 3, names
    assert sorted(p.name.removesuffix(".api.json") for p in API_DIR.glob("*.api.json")) == sorted(names)


@pytest.mark.parametrize("path", _ui_files(), ids=lambda p: p.stem)
def test_ui_workflow_is_well_typed(path):
    ui = json.loads(path.read_text())
    known = contracts()
    assert ui["version"] == 0.4 and isinstance(ui["nodes"], list) and isinstance(ui["links"], list)
    nodes = {n["id"]: n for n in ui["nodes"]}
    assert len(nodes) == len(ui["nodes"]) and ui["last_node_id"] >= max(nodes)
    assert ui["last_link_id"] >= max((link[0] for link in ui["links"]), default=0)
    for node in ui["nodes"]:
        assert node["type"] in known, f"{path.name}: unknown node type {node['type']}"
        contract = known[node["type"]]
        # sockets: our link inputs in declaration order, outputs as declared
        declared = link_inputs(contract)
        sockets = node.get("inputs", [])
        assert [(s["name"], s["type"]) for s in sockets] == [(n, t) for n, t, _ in declared], node["type"]
        for (name, _, optional), s in zip(declared, sockets):
            assert optional or s.get("link") is not None, f"{path.name}: {node['type']}.{name} is not connected"
        assert [(o["name"], o["type"]) for o in node.get("outputs", [])] == contract["outputs"], node["type"]
        # widgets: one value each (+ control_after_generate), combo values of ours are legal
        values = node.get("widgets_values", [])
        expected = sum(2 if t == "INT+control" else 1 for n, t in contract["inputs"] if _base(t) in WIDGET_TYPES)
        assert len(values) == expected, f"{path.name}: {node['type']} has {len(values)} widget values, wants {expected}"
        assert node["properties"]["Node name for S&R"] == node["type"]
    for link_id, origin, oslot, target, tslot, ltype in ui["links"]:
        out = nodes[origin]["outputs"][oslot]
        inp = nodes[target]["inputs"][tslot]
        assert out["type"] == ltype == inp["type"], f"{path.name}: link {link_id} is {ltype}: {out} -> {inp}"
        assert link_id in out["links"] and inp["link"] == link_id
    for node in ui["nodes"]:  # every socket link is in the table
        for s in node.get("inputs", []):
            assert s.get("link") is None or any(link[0] == s["link"] for link in ui["links"])
        for o in node.get("outputs", []):
            assert all(any(link[0] == lid and link[1] == node["id"] for link in ui["links"])
                       for lid in o["links"] or [])


@pytest.mark.parametrize("path", _ui_files(), ids=lambda p: p.stem)
def test_api_twin_is_the_ui_workflow_converted(path):
    known = contracts()
    ui = json.loads(path.read_text())
    api = json.loads((API_DIR / f"{path.stem}.api.json").read_text())
    assert api == ui_to_api(ui, known)
    for node_id, node in api.items():
        contract = known[node["class_type"]]
        for name, _t in contract["inputs"]:
            if not name.endswith("?"):
                assert name in node["inputs"], f"{path.stem}: node {node_id} lacks {name}"
        for name, value in node["inputs"].items():
            t = dict((n.rstrip("?"), t) for n, t in contract["inputs"])[name]
            if isinstance(value, list):
                src = api[value[0]]
                assert known[src["class_type"]]["outputs"][value[1]][1] == t, f"{path.stem}: {node_id}.{name}"
            elif name in contract["choices"] and contract["choices"][name]:
                assert value in contract["choices"][name], f"{path.stem}: {node_id}.{name}={value!r}"


#: The official download of each model file the workflows name, as ComfyUI's own LTX-2 templates
#: list them (comfyui-workflow-templates 0.9.73: ``video_ltx2_t2v.json`` and its siblings, node
#: ``properties.models``; ``tests/comfyui/test_comfyui_try_it.py`` checks this table against the
#: installed template packages).
OFFICIAL_MODELS = {
    "ltx-2-19b-dev.safetensors": {
        "url": "https://huggingface.co/Lightricks/LTX-2/resolve/main/ltx-2-19b-dev.safetensors",
        "directory": "checkpoints"},
    "gemma_3_12B_it.safetensors": {
        "url": "https://huggingface.co/Comfy-Org/ltx-2/resolve/main/split_files/text_encoders/gemma_3_12B_it.safetensors",
        "directory": "text_encoders"},
}
#: Model pickers: node type -> widget indices holding a model file (a projection: ``folder/name``).
MODEL_WIDGETS = {"LTXMGPU_GemmaLoader": (0, 1), "LTXMGPU_ModelLoader": (0,), "LTXVAudioVAELoader": (0,),
                 "CheckpointLoaderSimple": (0,)}


@pytest.mark.parametrize("path", _ui_files(), ids=lambda p: p.stem)
def test_every_model_a_workflow_names_comes_with_its_official_download(path):
    """ComfyUI's missing-models dialog offers a download for each file a node lists in
    ``properties.models`` (name, URL, folder): every model picker's file is listed on its node,
    with the URL and folder ComfyUI's own templates give it."""
    ui = json.loads(path.read_text())
    for node in ui["nodes"]:
        names = [node["widgets_values"][i].rsplit("/", 1)[-1] for i in MODEL_WIDGETS.get(node["type"], ())]
        listed = node["properties"].get("models", [])
        assert [m["name"] for m in listed] == list(dict.fromkeys(names)), (path.name, node["type"])
        for m in listed:
            assert {k: m[k] for k in ("url", "directory")} == OFFICIAL_MODELS[m["name"]], (path.name, m["name"])


def test_every_workflow_has_a_thumbnail_as_comfyui_serves_custom_templates():
    """Browse Templates shows ``/api/workflow_templates/<pack>/<name>.jpg`` for a custom node's
    template: each workflow has a JPEG beside it."""
    for path in _ui_files():
        thumb = path.with_suffix(".jpg")
        assert thumb.is_file(), f"{thumb.name} is missing (make it with: python docs/thumbnails.py)"
        head = thumb.read_bytes()[:3]
        assert head == b"\xff\xd8\xff", f"{thumb.name} is not a JPEG"


def test_templates_are_grouped_under_the_display_name():
    """Browse Templates titles a custom node's group by its folder name, through the i18n key
    ``templateWorkflows.category.<folder>``; the pack's ``locales/en/main.json`` gives the folder
    names it is installed under (the registry's and the README's clone: the pyproject name) its
    display name."""
    meta = tomllib.loads((REPO / "pyproject.toml").read_text())
    categories = json.loads((REPO / "locales" / "en" / "main.json").read_text())["templateWorkflows"]["category"]
    display = meta["tool"]["comfy"]["DisplayName"]
    assert categories[meta["project"]["name"]] == display
    assert set(categories.values()) == {display} and "locales/" in meta["tool"]["comfy"]["includes"]


def test_workflows_cover_the_three_use_cases():
    types = {p.stem: {n["type"] for n in json.loads(p.read_text())["nodes"]} for p in _ui_files()}
    t2v = next(t for t in types.values() if "LTXMGPU_SPSampler" in t)
    assert {"LTXMGPU_Pool", "LTXMGPU_GemmaLoader", "LTXMGPU_PromptEncode", "LTXMGPU_ModelLoader",
            "LTXVSeparateAVLatent", "VAEDecode", "LTXVAudioVAEDecode", "CreateVideo", "SaveVideo"} <= t2v
    core = next(t for t in types.values() if "SamplerCustomAdvanced" in t)
    assert {"LTXMGPU_GemmaLoader", "LTXMGPU_PromptEncode", "CFGGuider", "LTXVScheduler"} <= core
    assert any("LTXMGPU_PromptBatchEncode" in t for t in types.values())
    nf4 = [n for p in _ui_files() for n in json.loads(p.read_text())["nodes"] if n["type"] == "LTXMGPU_GemmaLoader"]
    assert any(n["widgets_values"][2] == "nf4" for n in nf4)


# --------------------------------------------------------------------------- web panel


def test_web_extension_files_are_served_and_reference_the_routes():
    js = (REPO / "web" / "ltx_mgpu.js").read_text()
    assert 'from "../../scripts/app.js"' in js and "registerSidebarTab" in js and "/ltx_mgpu/status" in js
    assert "console.error" not in js and "console.log" not in js
    assert (REPO / "web" / "ltx_mgpu.css").is_file()
    assert load_pack().WEB_DIRECTORY == "./web"


def _node_eval(script: str) -> str:
    node = shutil.which("node")
    if node is None:
        pytest.skip("Node.js is not installed; the panel's view module cannot be executed here")
    out = subprocess.run([node, "--input-type=module", "-e", script], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    return out.stdout


def test_panel_view_model_shows_state_job_and_one_memory_bar_per_rank(tmp_path):
    status = {"available": True, "message": None, "pools": [
        {"key": "gpu-0-1", "gpus": [0, 1], "nproc": 2, "state": "busy", "error": None,
         "current": {"type": "sample", "progress": {"phase": "denoise", "step": 3, "total": 20}, "elapsed": 41.7},
         "queue": [{"id": "x", "type": "encode", "position": 1}],
         "ranks": [{"rank": 0, "device": "cuda:0", "models": {"ltx": {}, "big": {"bytes": 3 * 2**29,
                                                                                 "plan": {"weights": "sharded"}}},
                    "memory": {"total": 80 * 2**30, "free": 20 * 2**30, "reserved": 50 * 2**30}},
                   {"rank": 1, "device": "cuda:1", "models": {},
                    "memory": {"total": 80 * 2**30, "free": 80 * 2**30, "reserved": 0}}]},
        {"key": "cpu-2", "gpus": [], "nproc": 2, "state": "not running", "ranks": [], "queue": []},
        {"key": "cpu-4", "gpus": [], "nproc": 4, "state": "starting", "ranks": [], "queue": [],
         "current": {"id": None, "type": "start", "progress": {"phase": "pool", "step": 0, "total": 1},
                     "elapsed": 12.2}},
        {"key": "gpu-2", "gpus": [2], "nproc": 1, "state": "busy", "ranks": [], "queue": [],
         "current": {"type": "load_text_encoder", "progress": {"phase": "load_text_encoder", "step": 0, "total": 1}}}]}
    module = tmp_path / "ltx_mgpu_panel.mjs"  # .mjs: an ES module whatever Node's module detection
    module.write_text((REPO / "web" / "ltx_mgpu_panel.js").read_text())
    url = module.as_uri()
    out = _node_eval(f"import {{summarize, formatBytes}} from '{url}';"
                     f"console.log(JSON.stringify({{v: summarize({json.dumps(status)}), b: formatBytes(1536 * 2**20),"
                     f" na: summarize({{available: false, message: 'Linux only'}})}}))")
    got = json.loads(out)
    view = got["v"]
    assert view["busy"] is True
    assert [p["state"] for p in view["pools"]] == ["busy", "not running", "starting", "busy"]
    gpu = view["pools"][0]
    assert gpu["title"] == "GPUs 0,1" and gpu["job"] == "Sampling (SP Sampler) · denoising 3/20 · 41 s"
    assert gpu["queued"] == 1
    assert view["pools"][2]["job"] == "Starting the pool · 12 s"  # the words people read, not the pool's job ids
    assert view["pools"][3]["job"] == "Loading Gemma"
    assert [b["fraction"] for b in gpu["bars"]] == [0.75, 0] and gpu["bars"][0]["text"] == "60.0 GiB / 80.0 GiB"
    assert gpu["bars"][0]["models"] == ["ltx", "big · 1.5 GiB shard"] and view["pools"][1]["title"] == "CPU × 2"
    assert got["b"] == "1.5 GiB" and got["na"]["message"] == "Linux only" and got["na"]["pools"] == []


def test_web_modules_parse(tmp_path):
    for name in ("ltx_mgpu.js", "ltx_mgpu_panel.js"):
        copy = tmp_path / (name.removesuffix(".js") + ".mjs")  # --check parses, it does not resolve imports
        copy.write_text((REPO / "web" / name).read_text())
        node = shutil.which("node")
        if node is None:
            pytest.skip("Node.js is not installed; the web modules cannot be parsed here")
        out = subprocess.run([node, "--check", str(copy)], capture_output=True, text=True, timeout=60)
        assert out.returncode == 0, out.stderr


# --------------------------------------------------------------------------- packaging


def test_pyproject_has_what_the_registry_and_manager_need():
    meta = tomllib.loads((REPO / "pyproject.toml").read_text())
    project, comfy = meta["project"], meta["tool"]["comfy"]
    assert re.fullmatch(r"\d+\.\d+\.\d+", project["version"])
    assert project["license"] and project["urls"]["Repository"].startswith("https://")
    assert comfy["PublisherId"] and comfy["DisplayName"] == "LTX-2 Multi-GPU"
    assert comfy["Icon"].startswith("https://") and {"web/", "workflows/"} <= set(comfy["includes"])
    reqs = (REPO / "requirements.txt").read_text().splitlines()
    assert not any(re.match(r"\s*torch\b", line) for line in reqs)  # ComfyUI owns torch


def test_comfyignore_keeps_tests_and_benchmarks_out_of_the_published_archive():
    patterns = [line.strip() for line in (REPO / ".comfyignore").read_text().splitlines()
                if line.strip() and not line.startswith("#")]
    for must in ("tests/", "benchmarks/"):
        assert must in patterns
    assert not any(p.startswith(("web", "workflows", "nodes", "ltx_mgpu")) for p in patterns)
