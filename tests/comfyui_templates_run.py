"""Run API-format graphs in-process with ComfyUI's own executor, and keep their samplers' latents.

Used by ``tests/comfyui/test_comfyui_templates.py``; run with ComfyUI's Python (``$COMFYUI_PYTHON``)::

    python tests/comfyui_templates_run.py SPEC.json OUT_DIR

``SPEC.json``: ``{"comfyui": dir, "models": dir (ComfyUI model folders: checkpoints,
text_encoders, loras, latent_upscale_models), "input": dir, "output": dir, "temp": dir,
"runtime_dir": dir, "gemma_config": the tiny Gemma snapshot's config.json, "projections":
{"2.0": width, "2.3": [video width, audio width]}, "assets": {...} (:func:`build_assets`),
"runs": [{"id", "prompt": API graph, "samplers": [node ids]}, ...]}``.

ComfyUI starts as ``main.py`` would on the CPU (its core and extra nodes; no server) with this
pack's nodes registered as ComfyUI registers a custom node pack. Each run is one prompt through
``execution.validate_prompt`` and a fresh ``execution.PromptExecutor``, as ComfyUI runs a queued
prompt, whose outputs are capture nodes added after the named ``SamplerCustomAdvanced`` nodes
(both their outputs, ``output`` and ``denoised_output``); the rest of the graph (decoding,
saving) is not run. One test adaptation, the same as ``comfyui_clip_run.py``'s: ComfyUI
hard-codes Gemma 3 12B's sizes (``comfyui_clip_run.shrink_gemma`` replaces them by the tiny
Gemma's and the tiny checkpoints' projection widths). Our nodes run as shipped: the Gemma
Loader at its defaults (dtype ``auto``: fp32 on this CPU pool, as ComfyUI's text encoder
computes), the Model Loader as the swapped graph sets it. The Model Loader is only wrapped to
record its MODEL's pool calls for the report (it computes nothing differently).

Writes ``OUT_DIR/<run id>.safetensors`` (``<sampler id>.<output|denoised>.<part>``, the parts of
a NestedTensor latent in order: video, audio) and ``OUT_DIR/report.json``: per run whether it
succeeded, the error ComfyUI reported (node id, type, exception message), the seconds it took,
whether a ``TextGenerate*`` node (prompt enhancement) ran,
the latents' shapes, and for our MODEL the pool requests it sent by type, each patch set the
pool merged (the executing node, the seconds the request took) and any reload of the model.
"""

from __future__ import annotations

import asyncio
import importlib
import json
import os
import sys
import time
import traceback
from pathlib import Path

from comfyui_clip_run import shrink_gemma  # noqa: E402 - this script runs from tests/
from comfyui_support import load_pack_in_process  # noqa: E402

CAPTURE = "LTXMGPUTest_CaptureLatents"


class Server:
    """What ``execution.PromptExecutor`` and the nodes (``GetImageSize``'s text) need of ComfyUI's
    server: messages are recorded."""

    def __init__(self):
        self.client_id, self.last_node_id, self.last_prompt_id, self.messages = None, None, None, []

    def send_sync(self, event, data, sid=None):
        self.messages.append((event, data))

    def send_progress_text(self, text, node_id, sid=None):
        self.messages.append(("progress_text", {"text": text, "node": node_id}))

    def queue_updated(self):
        pass


def build_assets(assets: dict) -> None:
    """Write the tiny stand-ins that need ComfyUI's classes or its media libraries, each seeded
    by its path's position: ``upsamplers`` (paths: a ``LatentUpsampler`` of ComfyUI's own class,
    128 latent channels, 2x spatial, one block of 32 channels per stage, its config in the
    metadata as ``LatentUpscaleModelLoader`` reads it), ``images`` (``{path: [w, h]}``: RGB PNGs),
    ``videos`` (``{path: [w, h, frames]}``: H.264 MP4s at 24 fps), ``audio`` (``{path: seconds}``:
    stereo MP3s at 44.1 kHz)."""
    import av
    import numpy as np
    import torch
    from comfy.ldm.lightricks.latent_upsampler import LatentUpsampler
    from PIL import Image
    from safetensors.torch import save_file

    for i, path in enumerate(assets.get("upsamplers", [])):
        torch.manual_seed(100 + i)
        model = LatentUpsampler(in_channels=128, mid_channels=32, num_blocks_per_stage=1, dims=3,
                                spatial_upsample=True, temporal_upsample=False, spatial_scale=2.0)
        sd = {k: v.contiguous() for k, v in model.state_dict().items()}
        save_file(sd, path, metadata={"config": json.dumps(model.config())})
    rng = np.random.default_rng(7)
    for path, (w, h) in assets.get("images", {}).items():
        Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8)).save(path)
    for path, (w, h, frames) in assets.get("videos", {}).items():
        with av.open(path, "w") as out:
            stream = out.add_stream("libx264", rate=24)
            stream.width, stream.height, stream.pix_fmt = w, h, "yuv420p"
            for _ in range(frames):
                frame = av.VideoFrame.from_ndarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8), format="rgb24")
                out.mux(stream.encode(frame))
            out.mux(stream.encode())
    for path, seconds in assets.get("audio", {}).items():
        rate = 44100
        with av.open(path, "w") as out:
            stream = out.add_stream("libmp3lame", rate=rate, layout="stereo")
            samples = (0.1 * rng.standard_normal((2, int(seconds * rate)))).astype(np.float32)
            for start in range(0, samples.shape[1], 1152):
                frame = av.AudioFrame.from_ndarray(np.ascontiguousarray(samples[:, start:start + 1152]),
                                                   format="fltp", layout="stereo")
                frame.sample_rate = rate
                out.mux(stream.encode(frame))
            out.mux(stream.encode())


def main() -> int:
    spec_path, out_dir = Path(sys.argv[1]), Path(sys.argv[2])
    spec = json.loads(spec_path.read_text())
    sys.path.insert(0, spec["comfyui"])
    # ComfyUI's own utils package before anything of comfy's (as main.py), which puts comfy/ and its
    # utils.py on sys.path; the nodes import utils.install_util later
    importlib.import_module("utils.extra_config")
    from comfy.cli_args import args

    args.cpu = True
    os.environ["LTX_MGPU_RUNTIME_DIR"] = spec["runtime_dir"]
    import comfy.model_management  # noqa: F401 - ComfyUI's device setup, after args
    import comfy.nested_tensor
    import execution
    import folder_paths
    from safetensors.torch import save_file
    from server import PromptServer

    import nodes

    asyncio.run(nodes.init_extra_nodes(init_custom_nodes=False, init_api_nodes=False))
    build_assets(spec.get("assets", {}))
    projections = spec["projections"]
    shrink_gemma(json.loads(Path(spec["gemma_config"]).read_text()), tuple(projections["2.3"]),
                 single_width=projections["2.0"])
    models = Path(spec["models"])
    for folder in sorted(p.name for p in models.iterdir() if p.is_dir()):
        folder_paths.add_model_folder_path(folder, str(models / folder), is_default=True)
    folder_paths.set_input_directory(spec["input"])
    folder_paths.set_output_directory(spec["output"])
    folder_paths.set_temp_directory(spec["temp"])

    ours = load_pack_in_process()
    captured: dict = {}

    class CaptureLatents:
        """Test output node: keeps both latents of a sampler."""

        @classmethod
        def INPUT_TYPES(cls):
            return {"required": {"output": ("LATENT",), "denoised": ("LATENT",), "name": ("STRING", {})}}

        RETURN_TYPES = ()
        FUNCTION = "capture"
        OUTPUT_NODE = True
        CATEGORY = "testing"

        def capture(self, output, denoised, name):
            captured[name] = {"output": output["samples"], "denoised": denoised["samples"]}
            return {}

    pool_models: list = []  # our MODELs' PoolModels, each once
    syncs: list = []  # {"node", "seconds"} of each patch set the pool merged
    reloads: list = []  # node ids where a MODEL found its model gone from the pool and loaded it again

    def instrument(pool_model):
        sync, load = pool_model.sync_patches, pool_model.load

        def timed_sync(*a, **k):
            before, started = pool_model.sent.get("model_patches", 0), time.perf_counter()
            sync(*a, **k)
            if pool_model.sent.get("model_patches", 0) > before:
                syncs.append({"node": server.last_node_id, "seconds": time.perf_counter() - started})

        def counted_load():
            reloads.append(server.last_node_id)
            return load()

        pool_model.sync_patches, pool_model.load = timed_sync, counted_load
        pool_models.append(pool_model)

    model_loader = ours["LTXMGPU_ModelLoader"]

    class RecordingModelLoader(model_loader):
        """Our Model Loader, its MODEL's pool calls recorded for the report."""

        @classmethod
        def execute(cls, *a, **k):
            out = super().execute(*a, **k)
            pool_model = out[1].model.diffusion_model.pool_model
            if all(pool_model is not m for m in pool_models):
                instrument(pool_model)
            return out

    nodes.NODE_CLASS_MAPPINGS.update({**ours, "LTXMGPU_ModelLoader": RecordingModelLoader, CAPTURE: CaptureLatents})

    report: dict = {"runs": {}}
    pools = []
    for run in spec["runs"]:
        prompt = dict(run["prompt"])
        outputs = []
        for sampler in run["samplers"]:
            cid = f"capture:{sampler}"
            prompt[cid] = {"class_type": CAPTURE, "inputs": {"output": [sampler, 0], "denoised": [sampler, 1],
                                                              "name": sampler}}
            outputs.append(cid)
        entry = report["runs"][run["id"]] = {}
        captured.clear()
        server = PromptServer.instance = Server()
        sent_before = [dict(m.sent) for m in pool_models]
        syncs.clear()
        reloads.clear()
        started = time.monotonic()
        try:
            valid, error, good, node_errors = asyncio.run(execution.validate_prompt(run["id"], prompt, outputs))
            if not valid:
                entry.update(ok=False, error={"validation": error, "nodes": node_errors})
                continue
            executor = execution.PromptExecutor(server, cache_type=execution.CacheType.CLASSIC,
                                                cache_args={"lru": 0, "ram": 0})
            executor.execute(prompt, run["id"], {"client_id": "templates-test"}, good)
            entry["ok"] = executor.success
            errors = [d for e, d in executor.status_messages if e == "execution_error"]
            if errors:
                e = errors[0]
                entry["error"] = {k: e.get(k) for k in ("node_id", "node_type", "exception_type",
                                                         "exception_message")}
        except Exception:  # noqa: BLE001 - reported to the test, which fails with it
            entry.update(ok=False, error={"exception_message": traceback.format_exc()[-4000:]})
        finally:
            entry["seconds"] = round(time.monotonic() - started, 2)
            executed = {d.get("node") for e, d in server.messages if e == "executing" and isinstance(d, dict)}
            entry["generated"] = any(prompt[i]["class_type"].startswith("TextGenerate") for i in executed
                                     if i in prompt)
        tensors = {}
        for sampler, latents in captured.items():
            for which, samples in latents.items():
                parts = samples.unbind() if isinstance(samples, comfy.nested_tensor.NestedTensor) else [samples]
                for i, part in enumerate(parts):
                    tensors[f"{sampler}.{which}.{i}"] = part.contiguous().float()
        entry["captured"] = {k: list(v.shape) for k, v in tensors.items()}
        sent: dict = {}
        for i, m in enumerate(pool_models):
            for k, v in m.sent.items():
                sent[k] = sent.get(k, 0) + v - (sent_before[i].get(k, 0) if i < len(sent_before) else 0)
        entry["pool"] = {"sent": sent, "patch_syncs": list(syncs), "reloads": list(reloads)}
        if tensors:
            save_file(tensors, str(out_dir / f"{run['id']}.safetensors"))
        if any(v["class_type"] == "LTXMGPU_Pool" for v in prompt.values()):
            pools.append(ours["LTXMGPU_Pool"].execute(gpus="cpu", cpu_ranks=2, lifetime="with-owner",
                                                      free_comfy_vram=False)[0])
    for pool in pools[:1]:
        pool.client.shutdown()
    (out_dir / "report.json").write_text(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    sys.exit(main())
