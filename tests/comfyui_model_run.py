"""Run ComfyUI's own sampling nodes in-process on ComfyUI's model and on our pool MODEL.

Used by ``tests/comfyui/test_comfyui_model.py``; run with ComfyUI's Python (``$COMFYUI_PYTHON``)::

    python tests/comfyui_model_run.py SPEC.json OUT_DIR

``SPEC.json``: ``{"comfyui": dir, "checkpoint": path, "loras_dir": dir, "runtime_dir": dir,
"cases": [...]}``; each case ``{"id", "graph": "advanced" | "ksampler" | "ksampler_advanced",
"guider": "cfg" | "basic" | "dual", "sampler" (a KSamplerSelect name or "SamplerEulerAncestral"
with "eta"), "sigmas": "basic" (BasicScheduler with "scheduler") | "ltxv" | "manual", "cfg",
"latent": "av" | "video", "loras": [[file, strength], ...], "seed", "steps", "ranks" (1 or 2),
"who": ["comfy", "ours"], "stop_after": calls or null, "model": "<kind>" | "<kind>_sharded"}``;
with ``"packed": {kind: {"dir", "name", "reference", "values"}}`` (a GGUF file, ComfyUI-quantized
files), the cases naming a ``model`` run ComfyUI's own model on ``reference`` (``UNETLoader``'s
``load_diffusion_model``: the quantized file itself where ComfyUI reads it, else ``values``, the
float32 file of its values; ``values`` for a case with ``"reference": "values"``) and our Model
Loader on ``name``, found in ``dir`` added to
``models/diffusion_models``' folders (which ``models/unet`` is, as ComfyUI-GGUF's users keep
their files). For each case and each ``who`` it writes
``OUT_DIR/<id>.<who>.safetensors`` (the sampled latent parts ``part.0`` / ``part.1``) and
``OUT_DIR/report.json``: per case the LoRA warnings ComfyUI logged, the model calls our MODEL
made, whether Stop interrupted it; and the process's RSS around loading our MODEL.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

from comfyui_support import collect_warnings, load_pack_in_process  # noqa: E402 - this script runs from tests/


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _pool_plan(pool) -> dict:
    """The plan (``TransformerPlan.describe``) of the LTX-2 transformer resident in ``pool``'s rank 0."""
    models = pool.client.status()["ranks"][0]["models"]
    (plan,) = [m["plan"] for m in models.values() if m.get("kind") == "ltx_transformer"]
    return plan


def main() -> int:
    spec_path, out_dir = Path(sys.argv[1]), Path(sys.argv[2])
    spec = json.loads(spec_path.read_text())
    sys.path.insert(0, spec["comfyui"])
    from comfy.cli_args import args

    args.cpu = True
    os.environ["LTX_MGPU_RUNTIME_DIR"] = spec["runtime_dir"]
    import comfy.model_management as mm
    import comfy.nested_tensor
    import comfy.sd
    import folder_paths
    import node_helpers
    import torch
    from comfy_extras import nodes_custom_sampler as ncs
    from comfy_extras import nodes_lt

    import nodes as comfy_nodes

    folder_paths.add_model_folder_path("loras", spec["loras_dir"])
    ours_nodes = load_pack_in_process()
    warnings = collect_warnings()

    checkpoint = spec["checkpoint"]
    theirs = comfy.sd.load_checkpoint_guess_config(checkpoint, output_vae=False, output_clip=False)[0]
    report: dict = {"cases": {}}
    models, pools = {}, {}
    for ranks in sorted({c.get("ranks", 2) for c in spec["cases"]}):
        (pool,) = ours_nodes["LTXMGPU_Pool"].execute(gpus="cpu", cpu_ranks=ranks, lifetime="with-owner",
                                                     free_comfy_vram=False)
        pools[ranks] = pool
        before = _rss()
        _, model, vae = ours_nodes["LTXMGPU_ModelLoader"].execute(pool, checkpoint, "fp32", "", 32768)
        report.setdefault("rss_model_load", {})[str(ranks)] = _rss() - before
        report["model_size"] = model.model_size()
        report["vae"] = type(vae).__name__
        models[ranks] = model
    packed = spec.get("packed", {})
    theirs_packed: dict = {}

    def packed_models(kind: str, which: str):
        """ComfyUI's model on the ``kind`` file's ``which`` (``reference`` or ``values``), and ours on
        the file from its folder (loaded at the kind's first case: the pool holds one transformer,
        so the cases before keep theirs)."""
        import importlib

        entry = packed[kind]
        if f"{kind}_sharded" in models:
            return comfy.sd.load_diffusion_model(entry[which], model_options={"dtype": torch.float32})
        folder_paths.add_model_folder_path("diffusion_models", entry["dir"])
        loader = ours_nodes["LTXMGPU_ModelLoader"]
        report.setdefault("listed", {})[kind] = entry["name"] in importlib.import_module(
            loader.__module__).checkpoint_choices()
        for weights in ("replicated", "sharded"):
            models[kind if weights == "replicated" else f"{kind}_sharded"] = loader.execute(
                pools[2], entry["name"], "fp32", "", 32768, weights)[1]
        return comfy.sd.load_diffusion_model(entry[which], model_options={"dtype": torch.float32})

    def conditioning(seed: int):
        t = torch.randn(1, 9, 48, generator=torch.Generator().manual_seed(seed))
        return [[t, {"pooled_output": None, "unprocessed_ltxav_embeds": True, "frame_rate": 25.0}]]

    positive, negative, third = conditioning(1), conditioning(2), conditioning(3)
    positives = (positive, negative)
    video = torch.zeros(1, 128, 2, 2, 3)
    latents = {"video": {"samples": video},
               "av": {"samples": comfy.nested_tensor.NestedTensor((video, torch.zeros(1, 8, 5, 16)))}}

    class StubVAE:
        """A stand-in video / audio VAE for the conditioning nodes: a deterministic latent of the
        right shape from the pixels or waveform (the pool never sees a VAE; both models get the
        same latents)."""

        downscale_index_formula = (8, 32, 32)
        audio_sample_rate = 16000

        def encode(self, pixels):
            g = torch.Generator().manual_seed(int(pixels.double().abs().sum() * 1000) % (2 ** 31))
            if pixels.ndim == 3:  # audio [B, samples, channels] -> [B, 8, N, 16]
                return torch.randn(pixels.shape[0], 8, 1 + pixels.shape[1] // 640, 16, generator=g)
            f, h, w = pixels.shape[0], pixels.shape[1] // 32, pixels.shape[2] // 32
            return torch.randn(1, 128, (f - 1) // 8 + 1, h, w, generator=g)

    vae = StubVAE()

    def image(seed: int, frames: int = 1):
        return torch.rand(frames, 96, 160, 3, generator=torch.Generator().manual_seed(seed))

    def conditioned(model, case, positive, negative, latent):
        """Apply the case's LTX conditioning nodes (ComfyUI's own); returns what sampling takes
        and what to do with its output (LTXVCropGuides after sampling)."""
        kind = case.get("conditioning")
        after = None
        if kind in ("i2v", "guides", "guides_crop", "guides_odd"):
            f = 4 if kind != "guides_odd" else 3
            video = {"samples": torch.zeros(1, 128, f, 3, 5)}
            if kind == "i2v":
                (video,) = nodes_lt.LTXVImgToVideoInplace.execute(vae, image(1), video, 1.0).result
            else:
                add = nodes_lt.LTXVAddGuide.execute
                positive, negative, video = add(positive, negative, vae, video, image(2), 0, 1.0).result
                positive, negative, video = add(positive, negative, vae, video, image(3), -1, 0.7).result
            if kind == "guides_crop":
                def after(out, positive=positive, negative=negative):
                    v, a = nodes_lt.LTXVSeparateAVLatent.execute({"samples": out}).result
                    _, _, v = nodes_lt.LTXVCropGuides.execute(positive, negative, v).result
                    return comfy.nested_tensor.NestedTensor((v["samples"], a["samples"]))
            audio = {"samples": torch.zeros(1, 8, 5, 16), "type": "audio"}
            (latent,) = nodes_lt.LTXVConcatAVLatent.execute(video, audio).result
        elif kind == "ref_audio":
            reference = {"waveform": torch.randn(1, 1, 16000 * 2 // 10, generator=torch.Generator().manual_seed(4)),
                         "sample_rate": 16000}
            model, positive, negative = nodes_lt.LTXVReferenceAudio.execute(model, positive, negative, reference, vae,
                                                                            3.0, 0.0, 1.0).result
        elif kind == "a2v":
            audio = {"samples": torch.randn(1, 8, 5, 16, generator=torch.Generator().manual_seed(5)), "type": "audio"}
            (audio,) = comfy_nodes.SetLatentNoiseMask().set_mask(audio, torch.zeros(1, 5, 16))
            (latent,) = nodes_lt.LTXVConcatAVLatent.execute({"samples": torch.zeros(1, 128, 2, 2, 3)}, audio).result
        elif kind == "text_mask":
            mask = torch.ones(1, 1024, dtype=torch.long)
            mask[:, -100:] = 0
            positive = node_helpers.conditioning_set_values(positive, {"attention_mask": mask})
        return model, positive, negative, latent, after

    def sample(model, case):
        for name, strength in case.get("loras", []):
            (model,) = comfy_nodes.LoraLoaderModelOnly().load_lora_model_only(model, name, strength)
        latent = latents[case.get("latent", "av")]
        model, positive, negative, latent, after = conditioned(model, case, positives[0], positives[1], latent)
        out = sample_graph(model, case, positive, negative, latent)
        return after(out) if after is not None else out

    def sample_graph(model, case, positive, negative, latent):
        steps, cfg, seed = case.get("steps", 3), case.get("cfg", 1.0), case.get("seed", 42)
        graph = case.get("graph", "advanced")
        if graph == "ksampler":
            (out,) = comfy_nodes.KSampler().sample(model, seed, steps, cfg, case["sampler"],
                                                   case.get("scheduler", "simple"), positive, negative, latent)
            return out["samples"]
        if graph == "ksampler_advanced":  # the last step left to another sampler: leftover noise kept
            (out,) = comfy_nodes.KSamplerAdvanced().sample(model, "enable", seed, steps, cfg, case["sampler"],
                                                           case.get("scheduler", "simple"), positive, negative,
                                                           latent, 0, steps - 1, "enable")
            return out["samples"]
        guider = {"cfg": lambda: ncs.CFGGuider.execute(model, positive, negative, cfg),
                  "basic": lambda: ncs.BasicGuider.execute(model, positive),
                  "dual": lambda: ncs.DualCFGGuider.execute(model, positive, third, negative, cfg, 2.0, "regular"),
                  }[case.get("guider", "cfg")]().result[0]
        if case["sampler"] == "SamplerEulerAncestral":
            sampler = ncs.SamplerEulerAncestral.execute(case.get("eta", 1.0), 1.0).result[0]
        else:
            sampler = ncs.KSamplerSelect.execute(case["sampler"]).result[0]
        schedule = case.get("sigmas", "basic")
        if schedule == "ltxv":
            sigmas = nodes_lt.LTXVScheduler.execute(steps, 2.05, 0.95, True, 0.1, latent).result[0]
        elif schedule == "manual":
            sigmas = ncs.ManualSigmas.execute("1.0, 0.99375, 0.9875, 0.98125, 0.975, 0.909375, 0.725, 0.421875, 0.0"
                                              ).result[0]
        else:
            sigmas = ncs.BasicScheduler.execute(model, case.get("scheduler", "simple"), steps, 1.0).result[0]
        noise = ncs.RandomNoise.execute(seed).result[0]
        return ncs.SamplerCustomAdvanced.execute(noise, guider, sampler, sigmas, latent).result[0]["samples"]

    from safetensors.torch import save_file

    for case in spec["cases"]:
        entry = report["cases"][case["id"]] = {}
        for who in case.get("who", ["comfy", "ours"]):
            warnings.clear()
            if case.get("model") == "compiled":  # the Model Loader's compile: on, on the 2-rank pool
                if "compiled" not in models:
                    loaded = ours_nodes["LTXMGPU_ModelLoader"].execute(pools[2], checkpoint, "fp32", "", 32768,
                                                                       compile="on")
                    models["compiled"] = loaded[1]
                    report["compiled_plan"] = _pool_plan(pools[2])
                model = theirs if who == "comfy" else models["compiled"]
            elif "model" in case:
                kind = case["model"].removesuffix("_sharded")
                which = case.get("reference", "reference")
                if (kind, which) not in theirs_packed:
                    theirs_packed[kind, which] = packed_models(kind, which)
                model = theirs_packed[kind, which] if who == "comfy" else models[case["model"]]
            else:
                model = theirs if who == "comfy" else models[case.get("ranks", 2)]
            pool_model = None if who == "comfy" else model.model.diffusion_model.pool_model
            calls = dict(pool_model.sent) if pool_model is not None else {}
            stop = case.get("stop_after") if who == "ours" else None
            if stop is not None:
                forward = pool_model.forward
                count = {"n": 0}

                def counting(*a, _forward=forward, _count=count, _stop=stop, **k):
                    _count["n"] += 1
                    if _count["n"] == _stop:
                        mm.interrupt_current_processing(True)  # Stop pressed while this call runs
                    return _forward(*a, **k)

                pool_model.forward = counting
            try:
                out = sample(model, case)
            except mm.InterruptProcessingException:
                entry[f"{who}_interrupted"] = True
                out = None
            finally:
                if stop is not None:
                    pool_model.forward = forward
                    mm.interrupt_current_processing(False)
            entry[f"{who}_warnings"] = [w for w in warnings if "lora" in w.lower() or "not loaded" in w.lower()]
            if pool_model is not None:
                entry[f"{who}_calls"] = {k: v - calls.get(k, 0) for k, v in pool_model.sent.items()}
            if out is not None:
                parts = out.unbind() if isinstance(out, comfy.nested_tensor.NestedTensor) else [out]
                save_file({f"part.{i}": p.contiguous() for i, p in enumerate(parts)},
                          str(out_dir / f"{case['id']}.{who}.safetensors"))
    (out_dir / "report.json").write_text(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
