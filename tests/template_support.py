"""ComfyUI's official LTX-2 templates as the template tests use them (``test_comfyui_templates.py``).

Nothing here imports ComfyUI or torch; it runs in either interpreter. A template is read from the
official templates' JSON package (:func:`read_templates`: ``index.json`` and ``<name>.json``, the
files *Browse Templates* loads), converted to API format by ComfyUI's own frontend in headless
Chromium (:func:`convert_in_frontend`: ``app.loadGraphData`` then ``app.graphToPrompt``, which
expands subgraphs, drops muted and bypassed nodes and resolves primitives), then edited in API
format by the functions below:

* :func:`swap_loaders`: the README's recipe, nothing else. ``CheckpointLoaderSimple`` becomes our
  Model Loader (same checkpoint, same node id: its MODEL links now take ``comfy_model``, its VAE
  links ``vae``), ``LTXAVTextEncoderLoader`` our Gemma Loader (same Gemma, the projection from
  the checkpoint it named; its CLIP links take ``clip``), both on one added Pool node.
  :func:`swap_differences` lists every difference between a graph and its swap, so a test can
  check that nothing else changed.
* :func:`shrink`: the template's own size knobs turned down (its Width / Height / Length /
  Frame Count / Duration primitives by title, literal sizes of ``EmptyImage`` and
  ``ResizeImageMaskNode``, ``ResizeImagesByLongerEdge``, ``LTXVScheduler`` steps), so a run takes
  seconds on the CPU with the tiny models. Sigmas, seeds, cfg, samplers and prompts stay.
* :func:`stand_in_for_lotus`: the depth template's *Image to Depth Map (Lotus)* subgraph (a
  Stable Diffusion 2 depth model and VAE that no tiny model replaces) is removed and its input
  frames are passed on in place of its depth maps.

:func:`model_files` and :func:`input_files` name the files a graph loads, for the tiny stand-ins;
:func:`without_loras` is a control graph.
"""

from __future__ import annotations

import copy
import json
from collections.abc import Iterable
from pathlib import Path

#: Name prefixes of ComfyUI's LTX-2.0 / 2.3 templates.
LTX2_PREFIXES = ("video_ltx2", "template_ltx2_3")
#: UI node types that are not ComfyUI nodes (frontend-only: notes, reroutes, widget primitives).
FRONTEND_ONLY = {"MarkdownNote", "Note", "Reroute", "PrimitiveNode"}

POOL_ID = "ltx_mgpu_pool"
#: Output slot maps of the swapped loaders: template output slot -> our loader's output slot.
CHECKPOINT_SLOTS = {0: 1, 2: 2}  # MODEL -> comfy_model, VAE -> vae (CLIP, slot 1, has no counterpart)
TEXT_ENCODER_SLOTS = {0: 1}  # CLIP -> clip

#: Loader class -> (input naming the file, models folder).
LOADER_FILES = {
    "CheckpointLoaderSimple": (("ckpt_name", "checkpoints"),),
    "LTXMGPU_ModelLoader": (("ckpt_name", "checkpoints"),),
    "LTXVAudioVAELoader": (("ckpt_name", "checkpoints"),),
    "LTXAVTextEncoderLoader": (("text_encoder", "text_encoders"), ("ckpt_name", "checkpoints")),
    "LoraLoaderModelOnly": (("lora_name", "loras"),),
    "LoraLoader": (("lora_name", "loras"),),
    "LatentUpscaleModelLoader": (("model_name", "latent_upscale_models"),),
    "UNETLoader": (("unet_name", "diffusion_models"),),
    "VAELoader": (("vae_name", "vae"),),
}
#: Input-loading class -> (input naming the file, kind).
INPUT_FILES = {"LoadImage": ("image", "image"), "LoadVideo": ("file", "video"), "LoadAudio": ("audio", "audio")}


def template_names(index: list) -> list[str]:
    """The LTX-2 template names in a template index (``templates/index.json``: a list of
    categories, each with ``templates`` entries named by ``name``), sorted."""
    names = {t["name"] for category in index for t in category.get("templates", [])}
    return sorted(n for n in names if n.startswith(LTX2_PREFIXES))


def read_templates(root: str | Path) -> tuple[str, dict[str, dict], dict[str, dict]]:
    """``(version, {name: UI workflow}, {name: index entry})`` of every LTX-2 template of the
    ``comfyui-workflow-templates-json`` package installed under ``root`` (``pip install --target``:
    ``root/comfyui_workflow_templates_json/templates/`` holds ``index.json`` and one ``<name>.json``
    per template, the files *Browse Templates* loads; the version is its ``.dist-info``'s).

    Raises:
        AssertionError: no such package under ``root``, or its index names a template it lacks.
    """
    root = Path(root)
    folder = root / "comfyui_workflow_templates_json" / "templates"
    infos = sorted(root.glob("comfyui_workflow_templates_json-*.dist-info"))
    assert folder.is_dir() and len(infos) == 1, f"no comfyui-workflow-templates-json package under {root}"
    version = infos[0].name.removeprefix("comfyui_workflow_templates_json-").removesuffix(".dist-info")
    index = json.loads((folder / "index.json").read_text())
    entries = {t["name"]: t for category in index for t in category.get("templates", [])}
    out = {}
    for name in template_names(index):
        path = folder / f"{name}.json"
        assert path.is_file(), f"the index names {name}, which the package lacks"
        out[name] = json.loads(path.read_text())
    return version, out, {name: entries[name] for name in out}


def ui_node_types(ui: dict) -> set[str]:
    """Every node type a UI workflow holds, inside its subgraphs (``definitions.subgraphs``) too,
    muted and bypassed nodes included; subgraph instances and frontend-only nodes excluded."""
    subgraphs = ui.get("definitions", {}).get("subgraphs", [])
    ids = {s["id"] for s in subgraphs}
    types = {n["type"] for n in ui.get("nodes", [])}
    for s in subgraphs:
        types |= {n["type"] for n in s.get("nodes", [])}
    return types - ids - FRONTEND_ONLY


# Load a template as a drop or Browse Templates does, then let the frontend convert it for /prompt.
LOAD_AND_CONVERT = """(async () => {
  await app.loadGraphData(%s, true, true, %s);
  await new Promise(r => setTimeout(r, 300));
  const nodes = app.graph._nodes;
  const api = {};
  for (const [id, node] of Object.entries((await app.graphToPrompt()).output))
    api[id] = {class_type: node.class_type, inputs: node.inputs, _meta: node._meta};
  return {api, unknown: nodes.filter(n => !LiteGraph.registered_node_types[n.type]).map(n => n.type)}; })()"""


def convert_in_frontend(url: str, chromium: str, templates: dict[str, dict], support) -> dict[str, dict]:
    """``{name: {"api": API prompt, "unknown": node types the frontend does not know}}``: each
    template converted by ComfyUI's frontend (served at ``url``) in headless ``chromium``.
    ``support`` is the ``comfyui_support`` module (its Chromium and DevTools helpers)."""
    import asyncio

    async def ready(evaluate):
        return await support.wait_for(evaluate, "window.app && app.graph ? true : null", "ComfyUI's page")

    def convert(name: str):
        async def step(evaluate):
            return await evaluate(LOAD_AND_CONVERT % (json.dumps(templates[name]), json.dumps(name)))
        return step

    names = list(templates)
    with support.chromium_page(url, chromium) as ws_url:
        results, _ = asyncio.run(support.cdp_page(ws_url, [ready] + [convert(n) for n in names], timeout=300))
    return dict(zip(names, results[1:]))


# --------------------------------------------------------------------------- reading an API graph


def links(api: dict) -> Iterable[tuple[str, str, str, int]]:
    """``(node id, input name, source id, source slot)`` for every linked input."""
    for node_id, node in api.items():
        for name, value in node["inputs"].items():
            if is_link(value):
                yield node_id, name, str(value[0]), int(value[1])


def is_link(value) -> bool:
    """Whether an API input value is a link ``[source id, output slot]`` (else a widget value)."""
    return isinstance(value, list) and len(value) == 2 and isinstance(value[0], str) and isinstance(value[1], int)


def of_type(api: dict, *class_types: str) -> list[str]:
    """Ids of the nodes of these classes, in the graph's order."""
    return [k for k, v in api.items() if v["class_type"] in class_types]


def upstream(api: dict, node_id: str) -> set[str]:
    """Every node ``node_id`` depends on (not itself)."""
    seen, todo = set(), [node_id]
    while todo:
        for value in api[todo.pop()]["inputs"].values():
            if is_link(value) and value[0] not in seen:
                seen.add(value[0])
                todo.append(value[0])
    return seen


def sampler_stages(api: dict) -> list[str]:
    """The ``SamplerCustomAdvanced`` nodes in stage order: a sampler that another one depends on
    comes first (stage 1, then stage 2 after the latent upsampler)."""
    samplers = of_type(api, "SamplerCustomAdvanced")
    return sorted(samplers, key=lambda s: len(upstream(api, s) & set(samplers)))


def version_of(api: dict) -> str:
    """``"2.3"`` or ``"2.0"``: the LTX-2 version of the graph's checkpoint (by its name)."""
    names = [api[k]["inputs"]["ckpt_name"] for k in of_type(api, "CheckpointLoaderSimple", "LTXMGPU_ModelLoader")]
    assert names, "the graph loads no LTX-2 checkpoint"
    return "2.3" if all("2.3" in n for n in names) else "2.0"


def model_files(api: dict) -> dict[str, set[str]]:
    """``{models folder: file names}`` the graph's loaders read."""
    out: dict[str, set[str]] = {}
    for node in api.values():
        for name, folder in LOADER_FILES.get(node["class_type"], ()):
            value = node["inputs"].get(name)
            if isinstance(value, str):
                out.setdefault(folder, set()).add(value)
    return out


def input_files(api: dict) -> dict[str, set[str]]:
    """``{"image" | "video" | "audio": file names}`` the graph loads from ComfyUI's input folder."""
    out: dict[str, set[str]] = {}
    for node in api.values():
        if node["class_type"] in INPUT_FILES:
            name, kind = INPUT_FILES[node["class_type"]]
            out.setdefault(kind, set()).add(node["inputs"][name])
    return out


# --------------------------------------------------------------------------- editing an API graph


def swap_loaders(api: dict, cpu_ranks: int = 2, dtype: str = "bf16") -> dict:
    """The graph with our loaders in place of the template's, as the README says (section "The
    official LTX-2 templates on several GPUs"): each ``CheckpointLoaderSimple`` becomes
    ``LTXMGPU_ModelLoader`` (same id and checkpoint; ``dtype``, no LoRAs of its own, the default
    token limit), each ``LTXAVTextEncoderLoader`` becomes ``LTXMGPU_GemmaLoader`` (same id and
    Gemma file, projection ``checkpoints/<its checkpoint>``, bf16 weights, placement single, kept
    loaded), both on one ``LTXMGPU_Pool`` (id :data:`POOL_ID`; CPU ranks for the tests: ``gpus``
    ``cpu``). Every link from the old loaders is moved to the matching output; nothing else
    changes. ``api`` is not modified.

    Raises:
        ValueError: the graph has neither loader, or uses an output that has no counterpart
            (the checkpoint's CLIP).
    """
    out = copy.deepcopy(api)
    checkpoints = of_type(out, "CheckpointLoaderSimple")
    encoders = of_type(out, "LTXAVTextEncoderLoader")
    if not checkpoints or not encoders:
        raise ValueError("the graph has no CheckpointLoaderSimple or no LTXAVTextEncoderLoader to swap")
    assert POOL_ID not in out
    pool = [POOL_ID, 0]
    slot_maps = {}
    for node_id in checkpoints:
        ckpt = out[node_id]["inputs"]["ckpt_name"]
        out[node_id] = {"class_type": "LTXMGPU_ModelLoader", "_meta": {"title": "Model Loader"},
                        "inputs": {"pool": pool, "ckpt_name": ckpt, "dtype": dtype, "loras": "", "max_tokens": 32768}}
        slot_maps[node_id] = CHECKPOINT_SLOTS
    for node_id in encoders:
        inputs = out[node_id]["inputs"]
        out[node_id] = {"class_type": "LTXMGPU_GemmaLoader", "_meta": {"title": "Gemma Loader"},
                        "inputs": {"pool": pool, "gemma": inputs["text_encoder"],
                                   "projection": f"checkpoints/{inputs['ckpt_name']}", "weights": "bf16",
                                   "placement": "single", "keep_loaded": True}}
        slot_maps[node_id] = TEXT_ENCODER_SLOTS
    for node_id, name, source, slot in list(links(out)):
        if source in slot_maps:
            if slot not in slot_maps[source]:
                raise ValueError(f"node {node_id} ({out[node_id]['class_type']}) takes output {slot} of "
                                 f"{api[source]['class_type']} {source}, which our loaders do not give")
            out[node_id]["inputs"][name] = [source, slot_maps[source][slot]]
    out[POOL_ID] = {"class_type": "LTXMGPU_Pool", "_meta": {"title": "Pool"},
                    "inputs": {"gpus": "cpu", "cpu_ranks": cpu_ranks, "lifetime": "with-owner",
                               "free_comfy_vram": False}}
    return out


def swap_differences(api: dict, swapped: dict) -> list[str]:
    """What differs between a graph and its :func:`swap_loaders` result other than the swap
    itself (the loaders, the Pool, links moved to the matching outputs): an empty list when the
    swap changed nothing else."""
    swapped_ids = {k for k, v in api.items() if v["class_type"] in ("CheckpointLoaderSimple", "LTXAVTextEncoderLoader")}
    maps = {k: CHECKPOINT_SLOTS if api[k]["class_type"] == "CheckpointLoaderSimple" else TEXT_ENCODER_SLOTS
            for k in swapped_ids}
    problems = []
    if set(swapped) != set(api) | {POOL_ID}:
        problems.append(f"node ids differ: {sorted(set(swapped) ^ (set(api) | {POOL_ID}))}")
    for node_id, node in api.items():
        if node_id in swapped_ids or node_id not in swapped:
            continue
        other = swapped[node_id]
        if other["class_type"] != node["class_type"] or set(other["inputs"]) != set(node["inputs"]):
            problems.append(f"{node_id} ({node['class_type']}) changed class or inputs")
            continue
        for name, value in node["inputs"].items():
            want = value
            if is_link(value) and value[0] in maps:
                want = [value[0], maps[value[0]][value[1]]]
            if other["inputs"][name] != want:
                problems.append(f"{node_id} ({node['class_type']}).{name}: {value!r} -> {other['inputs'][name]!r}")
    return problems


#: Titles of the templates' size primitives (lower case) -> what they set.
SIZE_TITLES = {"width": "width", "height": "height", "length": "frames", "frame count": "frames",
               "duration": "seconds"}


def shrink(api: dict, width: int = 192, height: int = 128, frames: int = 9, seconds: int = 1,
           scheduler_steps: int = 4) -> dict:
    """The graph at a size the CPU runs in seconds, through the template's own knobs: primitives
    titled Width / Height (the output size; the templates sample stage 1 at half of it),
    Length / Frame Count (``frames``), Duration (``seconds``); literal sizes of ``EmptyImage``
    and ``ResizeImageMaskNode``; ``ResizeImagesByLongerEdge`` to the longer side; ``LTXVScheduler``
    steps to at most ``scheduler_steps``. ``api`` is not modified; sigmas, seeds, cfg, samplers,
    prompts and strengths are kept.

    Raises:
        ValueError: the graph has no width or height to set (an unknown template layout).
    """
    out = copy.deepcopy(api)
    sizes = {"width": width, "height": height, "frames": frames, "seconds": seconds}
    seen = set()
    for node in out.values():
        t, inputs = node["class_type"], node["inputs"]
        title = node.get("_meta", {}).get("title", "").strip().lower()
        if t in ("PrimitiveInt", "PrimitiveFloat") and title in SIZE_TITLES:
            inputs["value"] = sizes[SIZE_TITLES[title]]
            seen.add(SIZE_TITLES[title])
        elif t == "EmptyImage":
            for name, value in (("width", width), ("height", height)):
                if not is_link(inputs[name]):
                    inputs[name] = value
                    seen.add(name)
        elif t == "ResizeImageMaskNode":
            for name, value in (("resize_type.width", width), ("resize_type.height", height)):
                if name in inputs and not is_link(inputs[name]):
                    inputs[name] = value
                    seen.add(name.split(".")[1])
        elif t == "ResizeImagesByLongerEdge":
            inputs["longer_edge"] = max(width, height)
        elif t == "LTXVScheduler":
            inputs["steps"] = min(int(inputs["steps"]), scheduler_steps)
    if not {"width", "height"} <= seen:
        raise ValueError(f"no width / height knob found in the graph (found {sorted(seen)})")
    return out


def stand_in_for_lotus(api: dict) -> tuple[dict, bool]:
    """``(graph, replaced)``: the graph without the *Image to Depth Map (Lotus)* subgraph (every
    node sharing the subgraph prefix of its ``LotusConditioning``), the nodes that took its depth
    maps taking the frames it was given instead (its ``VAEEncode`` pixels); ``replaced`` False and
    the graph unchanged when there is no Lotus node. ``api`` is not modified."""
    lotus = of_type(api, "LotusConditioning")
    if not lotus:
        return api, False
    prefix = lotus[0].rsplit(":", 1)[0] + ":"
    inside = {k for k in api if k.startswith(prefix)}
    (encode,) = [k for k in inside if api[k]["class_type"] == "VAEEncode"]
    frames = api[encode]["inputs"]["pixels"]
    out = {k: copy.deepcopy(v) for k, v in api.items() if k not in inside}
    for node_id, name, source, _ in list(links(out)):
        if source in inside:
            out[node_id]["inputs"][name] = list(frames)
    return out, True


def without_loras(api: dict) -> dict:
    """The graph with every ``LoraLoaderModelOnly`` removed (its consumers take the model it was
    given): a control that shows what the LoRAs change. ``api`` is not modified."""
    out = copy.deepcopy(api)
    loras = set(of_type(out, "LoraLoaderModelOnly"))
    for node_id, name, source, _ in list(links(out)):
        while source in loras:
            out[node_id]["inputs"][name] = list(out[source]["inputs"]["model"])
            source = out[node_id]["inputs"][name][0]
    return {k: v for k, v in out.items() if k not in loras}
