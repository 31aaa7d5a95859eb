"""Every MODEL -> MODEL node of the installed ComfyUI on ComfyUI's own LTX-2 model and on our pool MODEL.

Used by ``tests/comfyui/test_comfyui_patch_nodes.py``; run with ComfyUI's Python (``$COMFYUI_PYTHON``)::

    python tests/comfyui_patch_nodes_run.py SPEC.json OUT_DIR

It lists every node ComfyUI registers from ``nodes.py`` and ``comfy_extras/`` with a ``MODEL``
input and a ``MODEL`` output (:func:`model_nodes`), plus the nodes that read the model's weights to
save them (``ModelSave``, ``CheckpointSave``), and runs each once per case on both models: the node
with its default inputs (``SPEC["cases"][id]["inputs"]`` overrides them; other inputs get stand-ins
by type: ComfyUI's conditioning, an image, a stand-in VAE, a LoRA...), then a minimal LTX-2.3
text-to-video graph on its MODEL output (``CFGGuider`` at ``cfg``, ``euler``, ``BasicScheduler``
``steps``, an audio-video latent), on a pool of 2 CPU ranks in fp32.

``SPEC.json``: ``{"comfyui", "checkpoint", "loras_dir", "hypernetworks_dir", "runtime_dir",
"output_dir", "steps", "cfg", "cases": {id: {"node", "inputs", "models", "steps", "cfg", "latent"}}}``
(``latent``: ``"av"``, the default, or ``"video"``: a video-only latent); ``models``
names, for a node with several MODEL inputs (the merges), which of them is ours on our side
(``{"model1": "ours", "model2": "comfy"}``; default: all ours). A node without a case runs as the
case ``<node id>`` with its defaults.

Writes ``OUT_DIR/report.json``: ``{"nodes": {node id: source file}, "cases": {id: {"node",
"comfy": outcome, "ours": outcome, "rel": max relative difference of the two latents or null,
"changed": the same between ours and our MODEL sampled without the node}}}``, an outcome being
``{"ok", "phase" ("node" / "sample"), "error_type", "error", "forwards" (transformer calls: the
pool's ``forward`` requests, or ComfyUI's ``_forward`` runs), "log" (what ComfyUI and the pack
logged)}``, and ``OUT_DIR/table.md``, the README's patch-node table (:func:`patch_table`).
``$LTX_MGPU_PATCH_CASES`` (comma-separated case ids) runs only those.
"""

from __future__ import annotations

import asyncio
import inspect
import json
import logging
import math
import os
import sys
import traceback
from pathlib import Path

from comfyui_support import load_pack_in_process  # noqa: E402 - this script runs from tests/

#: Input types a node gets a stand-in for (anything else: the input is None).
STAND_INS = ("CONDITIONING", "IMAGE", "VAE", "AUDIO", "LATENT", "MASK", "LORA_MODEL", "LATENT_OPERATION", "CLIP",
             "MODEL_PATCH", "CLIP_VISION_OUTPUT")


#: Widget input types: their default value is used.
WIDGETS = ("INT", "FLOAT", "BOOLEAN", "STRING", "COMBO")


def model_nodes(mappings: dict) -> dict[str, str]:
    """``{node id: source file}`` of every node with a MODEL input and a MODEL output."""
    found = {}
    for nid, cls in sorted(mappings.items()):
        try:
            types = cls.INPUT_TYPES()
        except Exception:  # noqa: BLE001 - a node whose inputs cannot be listed here takes no MODEL we test
            continue
        inputs = {**types.get("required", {}), **types.get("optional", {})}
        takes = any(isinstance(v, tuple) and v and v[0] == "MODEL" for v in inputs.values())
        if takes and "MODEL" in tuple(getattr(cls, "RETURN_TYPES", ()) or ()):
            found[nid] = _source(cls)
    return found


def _source(cls) -> str:
    module = getattr(cls, "RELATIVE_PYTHON_MODULE", None) or cls.__module__
    name = str(module).replace("\\", "/").rsplit("/", 1)[-1]
    return "nodes.py" if name == "nodes" else f"comfy_extras/{name.removeprefix('comfy_extras.')}.py"


def main() -> int:
    spec_path, out_dir = Path(sys.argv[1]), Path(sys.argv[2])
    spec = json.loads(spec_path.read_text())
    sys.path.insert(0, spec["comfyui"])
    from comfy.cli_args import args

    args.cpu = True
    args.output_directory = spec["output_dir"]
    os.environ["LTX_MGPU_RUNTIME_DIR"] = spec["runtime_dir"]
    import comfy.model_management as mm
    import comfy.model_patcher
    import comfy.nested_tensor
    import comfy.sd
    import comfy.utils
    import folder_paths
    import torch
    from comfy_api.latest import io
    from comfy_extras import nodes_custom_sampler as ncs

    import nodes as comfy_nodes

    folder_paths.add_model_folder_path("loras", spec["loras_dir"])
    folder_paths.add_model_folder_path("hypernetworks", spec["hypernetworks_dir"])
    folder_paths.set_output_directory(spec["output_dir"])
    asyncio.run(comfy_nodes.init_extra_nodes(init_custom_nodes=False, init_api_nodes=False))
    ours_nodes = load_pack_in_process()
    logging.getLogger().setLevel(logging.INFO)
    log: list[str] = []

    class Collect(logging.Handler):
        def emit(self, record):
            log.append(record.getMessage())

    logging.getLogger().addHandler(Collect(level=logging.INFO))

    checkpoint = spec["checkpoint"]
    theirs = comfy.sd.load_checkpoint_guess_config(checkpoint, output_vae=False, output_clip=False)[0]
    (pool,) = ours_nodes["LTXMGPU_Pool"].execute(gpus="cpu", cpu_ranks=2, lifetime="with-owner", free_comfy_vram=False)
    ours = ours_nodes["LTXMGPU_ModelLoader"].execute(pool, checkpoint, "fp32", "", 32768)[1]
    pool_model = ours.model.diffusion_model.pool_model
    calls = {"comfy": 0}
    dm = theirs.model.diffusion_model
    forward = dm._forward

    def counted(*a, **k):
        calls["comfy"] += 1
        return forward(*a, **k)

    dm._forward = counted  # ComfyUI's transformer runs (its DIFFUSION_MODEL wrappers may skip them)

    def forwards(who: str) -> int:
        return calls["comfy"] if who == "comfy" else pool_model.sent.get("forward", 0)

    def conditioning(seed: int):
        t = torch.randn(1, 9, 48, generator=torch.Generator().manual_seed(seed))
        return [[t, {"pooled_output": None, "unprocessed_ltxav_embeds": True, "frame_rate": 25.0}]]

    positive, negative, third = conditioning(1), conditioning(2), conditioning(3)
    video = torch.zeros(1, 128, 2, 2, 3)
    latent = {"samples": comfy.nested_tensor.NestedTensor((video, torch.zeros(1, 8, 5, 16)))}
    latents = {"av": latent, "video": {"samples": video}}

    class StubVAE:
        """A stand-in video / audio VAE: a deterministic latent of the right shape from the pixels or
        waveform (both models get the same latents)."""

        downscale_index_formula = (8, 32, 32)
        audio_sample_rate = 16000
        latent_channels = 128

        def encode(self, pixels):
            g = torch.Generator().manual_seed(int(pixels.double().abs().sum() * 1000) % (2 ** 31))
            if pixels.ndim == 3:
                return torch.randn(pixels.shape[0], 8, 1 + pixels.shape[1] // 640, 16, generator=g)
            f, h, w = pixels.shape[0], pixels.shape[1] // 32, pixels.shape[2] // 32
            return torch.randn(1, 128, (f - 1) // 8 + 1, h, w, generator=g)

    lora_file = str(Path(spec["loras_dir"]) / "a.safetensors")

    def stand_in(kind: str, name: str):
        if kind == "CONDITIONING":
            return {"positive": positive, "negative": negative}.get(name, third)
        if kind == "IMAGE":
            return torch.rand(1, 96, 160, 3, generator=torch.Generator().manual_seed(7))
        if kind == "VAE":
            return StubVAE()
        if kind == "AUDIO":
            return {"waveform": torch.randn(1, 1, 3200, generator=torch.Generator().manual_seed(4)),
                    "sample_rate": 16000}
        if kind == "LATENT":
            return latent
        if kind == "MASK":
            return torch.ones(1, 96, 160)
        if kind == "LORA_MODEL":
            return comfy.utils.load_torch_file(lora_file, safe_load=True)
        if kind == "LATENT_OPERATION":
            return comfy_nodes.NODE_CLASS_MAPPINGS["LatentOperationTonemapReinhard"].execute(1.0).result[0]
        return None  # CLIP (model-only use), MODEL_PATCH, CLIP_VISION_OUTPUT: nothing of LTX-2

    def default(spec_: tuple):
        kind, opts = spec_[0], (spec_[1] if len(spec_) > 1 and isinstance(spec_[1], dict) else {})
        if isinstance(kind, list):
            return opts.get("default", kind[0] if kind else None)
        if kind == "COMBO":
            options = opts.get("options") or [None]
            return opts.get("default", options[0])
        return opts.get("default")

    def run_node(nid: str, case: dict, who: str):
        """The node's outputs on ``who``'s model: (model, positive, negative) for sampling, or None
        for a node without a MODEL output."""
        cls = comfy_nodes.NODE_CLASS_MAPPINGS[nid]
        types = cls.INPUT_TYPES()
        kwargs = {}
        pos, neg = positive, negative
        for section in ("required", "optional"):
            for name, s in types.get(section, {}).items():
                if name in case.get("inputs", {}):
                    kwargs[name] = case["inputs"][name]
                elif isinstance(s, tuple) and s and s[0] == "MODEL":
                    mine = case.get("models", {}).get(name, "ours")
                    kwargs[name] = theirs if who == "comfy" or mine == "comfy" else ours
                elif isinstance(s, tuple) and s and isinstance(s[0], str) and s[0] in STAND_INS:
                    kwargs[name] = stand_in(s[0], name)
                elif isinstance(s, tuple) and s and (isinstance(s[0], list) or s[0] in WIDGETS):
                    kwargs[name] = default(s)
                elif section == "required":
                    kwargs[name] = None
        if isinstance(cls, type) and issubclass(cls, io.ComfyNode):
            out = cls.execute(**kwargs)
            out = asyncio.run(out) if inspect.iscoroutine(out) else out
            result = tuple(out.result or ()) if isinstance(out, io.NodeOutput) else tuple(out)
        else:
            out = getattr(cls(), cls.FUNCTION)(**kwargs)
            result = tuple(out.get("result", ()) if isinstance(out, dict) else out)
        returns = list(getattr(cls, "RETURN_TYPES", ()) or ())
        if "MODEL" not in returns:
            return None
        model = result[returns.index("MODEL")]
        conds = [r for r, t in zip(result, returns) if t == "CONDITIONING"]
        if len(conds) >= 2:
            pos, neg = conds[0], conds[1]
        return model, pos, neg

    def sample(model, pos, neg, case: dict):
        steps, cfg = case.get("steps", spec["steps"]), case.get("cfg", spec["cfg"])
        guider = ncs.CFGGuider.execute(model, pos, neg, cfg).result[0]
        sampler = ncs.KSamplerSelect.execute("euler").result[0]
        sigmas = ncs.BasicScheduler.execute(model, "simple", steps, 1.0).result[0]
        noise = ncs.RandomNoise.execute(42).result[0]
        start = latents[case.get("latent", "av")]
        return ncs.SamplerCustomAdvanced.execute(noise, guider, sampler, sigmas, start).result[0]["samples"]

    found = model_nodes(comfy_nodes.NODE_CLASS_MAPPINGS)
    report: dict = {"nodes": found, "cases": {}}
    cases = dict(spec.get("cases", {}))
    for nid in found:
        cases.setdefault(nid, {"node": nid})
    plain: dict[tuple, list] = {}  # our MODEL without the node, by (latent, steps, cfg)

    def rel(a: list, b: list) -> float | None:
        """Max over the latent parts of |a - b| / |a| (None: other shapes, or not finite)."""
        if [t.shape for t in a] != [t.shape for t in b]:
            return None
        rels = [float((x - y).norm() / x.norm()) if float(x.norm()) else float((x - y).norm()) for x, y in zip(a, b)]
        return max(rels) if all(math.isfinite(r) for r in rels) else None

    only = os.environ.get("LTX_MGPU_PATCH_CASES")
    for cid, case in sorted(cases.items()):
        if only and cid not in only.split(","):
            continue
        nid = case.get("node", cid)
        entry = report["cases"][cid] = {"node": nid}
        outs = {}
        for who in ("comfy", "ours"):
            del log[:]
            before = forwards(who)
            outcome: dict = {"ok": False, "phase": "node"}
            try:
                made = run_node(nid, case, who)
                if made is not None:
                    outcome["phase"] = "sample"
                    out = sample(*made, case)
                    parts = out.unbind() if isinstance(out, comfy.nested_tensor.NestedTensor) else [out]
                    outs[who] = [p.float().clone() for p in parts]
                outcome["ok"] = True
            except mm.InterruptProcessingException:
                raise
            except Exception as e:  # noqa: BLE001 - the outcome is what this harness reports
                outcome.update(error_type=type(e).__name__, error=str(e)[:2000],
                               trace=traceback.format_exc()[-3000:])
            finally:
                mm.interrupt_current_processing(False)
            outcome["forwards"] = forwards(who) - before
            outcome["log"] = [m[:400] for m in log if not m.startswith(("Requested to load", "loaded completely",
                                                                         "model weight dtype", "model_type"))][:40]
            entry[who] = outcome
        if "comfy" in outs and "ours" in outs:
            entry["rel"] = rel(outs["comfy"], outs["ours"])
            if entry["rel"] is None:
                entry["shapes"] = [[list(t.shape) for t in outs["comfy"]], [list(t.shape) for t in outs["ours"]]]
        if "ours" in outs:
            key = (case.get("latent", "av"), case.get("steps", spec["steps"]), case.get("cfg", spec["cfg"]))
            if key not in plain:
                out = sample(ours, positive, negative, case)
                plain[key] = out.unbind() if isinstance(out, comfy.nested_tensor.NestedTensor) else [out]
            entry["changed"] = rel(plain[key], outs["ours"])
        print(cid, json.dumps({k: (v if not isinstance(v, dict) else {kk: vv for kk, vv in v.items()
                                                                       if kk not in ("log", "trace")})
                               for k, v in entry.items()})[:600], flush=True)
    (out_dir / "report.json").write_text(json.dumps(report, indent=1))
    (out_dir / "table.md").write_text(patch_table(report, spec.get("cases", {})))
    return 0


#: The largest relative difference of "same".
SAME = 1e-5
#: What a refusal of ours says (``nodes._patches.refuse``).
REFUSAL = " on the multi-GPU LTX-2 MODEL: "


def verdict(entry: dict) -> str:
    """``same`` (both ran, within :data:`SAME`), ``refused`` (ComfyUI's model ran, ours refused by
    the node's name before any model call), ``fails`` (ComfyUI's own model fails too), else
    ``differs``."""
    comfy, ours = entry["comfy"], entry["ours"]
    if comfy["ok"] and ours["ok"]:
        rel = entry.get("rel")
        return "same" if (rel is not None and rel <= SAME) or ("rel" not in entry and comfy["phase"] == "node") \
            else "differs"
    if comfy["ok"]:
        named = ours.get("error", "").split(REFUSAL)[0].split("/")
        refused = ours.get("error_type") == "ModelPatchRefused" and ours["forwards"] == 0 and entry["node"] in named
        return "refused" if refused else "differs"
    return "fails" if not ours["ok"] else "differs"


def _ignored(entry: dict) -> bool:
    return any("has no effect on LTX-2" in m for m in entry["ours"].get("log", []))


def patch_table(report: dict, cases: dict) -> str:
    """The README's patch-node table (markdown) from a report: one row per node with notes or
    mixed verdicts, the others grouped by verdict."""
    by_node: dict[str, list] = {}
    for cid, entry in sorted(report["cases"].items()):
        by_node.setdefault(entry["node"], []).append((cid, entry))
    groups: dict[tuple, list] = {}
    own = []
    for node, entries in sorted(by_node.items(), key=lambda kv: kv[0].lower()):
        kinds = [verdict(e) for _, e in entries]
        rels = [e["rel"] for (_, e), k in zip(entries, kinds) if k == "same" and e.get("rel") is not None]
        notes = [cases.get(cid, {}).get("note") for cid, _ in entries]
        if len(set(kinds)) == 1 and not any(notes):
            kind, first = kinds[0], entries[0][1]
            if kind == "same":
                text = "same" + (" (its patch does nothing on ComfyUI's LTX-2 model either; logged)"
                                 if _ignored(first) else "")
            elif kind == "refused":
                text = "refused: " + first["ours"]["error"].split("; ")[-1]
            else:
                text = {"fails": "fails on ComfyUI's own LTX-2 model too", "differs": "DIFFERS"}[kind]
            groups.setdefault((kind, text), []).append((node, max(rels) if rels else None))
            continue
        said: dict[str, list[str]] = {}  # what -> the cases' notes, in order
        for (cid, entry), kind, note in zip(entries, kinds, notes):
            what = {"same": "same", "refused": "refused", "fails": "fails on ComfyUI's model too",
                    "differs": "DIFFERS"}[kind]
            if kind == "refused" or (kind == "fails" and REFUSAL in entry["ours"].get("error", "")):
                what += (", refused by name here" if kind == "fails" else "") + ": " + \
                    entry["ours"]["error"].split("; ")[-1]
            if cases.get(cid, {}).get("calls"):
                what += f" (transformer calls: ComfyUI's {entry['comfy']['forwards']}, the pool's " \
                        f"{entry['ours']['forwards']})"
            said.setdefault(what, []).append(note or cid)
        own.append((node, "; ".join(f"{', '.join(n)}: {w}" for w, n in said.items()), max(rels) if rels else None))
    rows = [(", ".join(f"`{n}`" for n, _ in members), text, max((r for _, r in members if r is not None),
                                                                default=None))
            for (kind, text), members in sorted(groups.items(), key=lambda kv: ("same", "refused", "fails",
                                                                                "differs").index(kv[0][0]))]
    rows = [(f"`{n}`", t, r) for n, t, r in own] + rows
    lines = ["| node | on the multi-GPU MODEL | max rel. Δ |", "| --- | --- | --- |"]
    lines += [f"| {n} | {t} | {f'{r:.1e}' if r is not None else '—'} |" for n, t, r in rows]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.exit(main())
