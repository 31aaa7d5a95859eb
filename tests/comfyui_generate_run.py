"""Prompt enhancement and a text-encoder LoRA with ComfyUI's own LTX-2 text encoder and with our
Gemma Loader's CLIP, in-process.

Used by ``tests/comfyui/test_comfyui_generate.py``; run with ComfyUI's Python (``$COMFYUI_PYTHON``)::

    python tests/comfyui_generate_run.py SPEC.json OUT_DIR

``SPEC.json``: ``{"comfyui": dir, "gemma_config": the model's config.json, "text_encoders": dir,
"gemma": file name there (ComfyUI's single-file format), "checkpoints": dir, "checkpoint": file
name there, "loras": dir, "lora": file name there or null, "lora_vision": file name there or null
(a LoRA on the vision tower), "prompts": [...], "max_length": n, "plain":
TextGenerate's cases too (default true), "images": the cases with an image too (default false)}``.

ComfyUI hard-codes Gemma 3 12B's sizes; ``comfyui_clip_run.shrink_gemma`` replaces them by the
model's. For a config that is not 12B-like in its other settings (the real Gemma 3 270M: no RoPE
scaling on its global layers, no vision tower) :func:`comfy_config` states ComfyUI's equivalents
first (``rope_scale`` 1, the same float32 norm epsilon, a one-layer vision tower that generation
never runs). Then, on ``LTXAVTextEncoderLoader``'s CLIP (``comfy``) and on our Gemma Loader's
``clip`` (a pool of 2 CPU ranks) made to compute in fp32 as ComfyUI's text encoder does (``ours``):

* ``TextGenerateLTX2Prompt`` on each prompt, sampling off and on (the templates' settings:
  temperature 0.7, top-k 64, top-p 0.95, min-p 0.05, repetition penalty 1.05, seed 0), and
  ``TextGenerate`` with ComfyUI's default chat template and without; each call's token ids
  (``clip.generate`` recorded) and text;
* with ``images``: ``TextGenerateLTX2Prompt`` with an image connected (:func:`image`: random RGB of
  odd sizes), greedy on two images, sampled, and greedy on a batch of two; ``TextGenerate`` with
  ComfyUI's default (image) chat template and an image;
* with a LoRA (``lora``): ComfyUI's ``LoraLoader`` (strength_clip 0.8) on each CLIP, then
  ``CLIPTextEncode`` and the greedy enhancement on the LoRA'd CLIPs, and ``CLIPTextEncode`` on
  the plain ones;
* with a LoRA on the vision tower and projector (``lora_vision``): ``LoraLoader`` (strength_clip
  0.8) on each CLIP, then ``TextGenerateLTX2Prompt`` greedy with an image and with a batch of two;
  the keys each CLIP patched, and both CLIPs' state-dict names and shapes of the vision weights.

Writes ``OUT_DIR/report.json`` (``{"runs": {case: {who: {"ids", "text"}}}, "lora_logs": [...], "lora_vision":
{"patched", "state_dict", "logs"}}``)
and ``OUT_DIR/conds.safetensors`` (``<case>.<who>`` conditioning tensors).
"""

from __future__ import annotations

import copy
import dataclasses
import json
import os
import sys
from pathlib import Path

from comfyui_clip_run import shrink_gemma  # noqa: E402 - this script runs from tests/
from comfyui_support import collect_warnings, load_pack_in_process  # noqa: E402

#: A one-layer vision tower for a text-only Gemma (ComfyUI's Gemma 3 always builds one).
SMALL_VISION = {"hidden_size": 32, "image_size": 28, "intermediate_size": 64, "num_attention_heads": 2,
                "num_hidden_layers": 1, "patch_size": 14}
SAMPLING_ON = {"sampling_mode": "on", "temperature": 0.7, "top_k": 64, "top_p": 0.95, "min_p": 0.05,
               "repetition_penalty": 1.05, "seed": 0, "presence_penalty": 0.0}
SAMPLING_OFF = {"sampling_mode": "off"}


def image(seed: int, batch: int = 1, height: int = 37, width: int = 53):
    """A ComfyUI IMAGE ``[batch, height, width, 3]`` of uniform random values (seeded)."""
    import torch

    return torch.rand(batch, height, width, 3, generator=torch.Generator().manual_seed(seed))


def comfy_config(config: dict) -> dict:
    """``config`` (a ``config.json``) in the form ``shrink_gemma`` takes, with ComfyUI's
    equivalents of what it does not name (module doc); ComfyUI's ``rope_scale`` set to match."""
    import comfy.text_encoders.llama as llama

    config = copy.deepcopy(config)
    if "text_config" not in config:  # a text-only Gemma 3 (Gemma3ForCausalLM)
        config = {"text_config": config, "vision_config": dict(SMALL_VISION), "mm_tokens_per_image": 4}
    text = config["text_config"]
    full = text["rope_parameters"]["full_attention"]
    if "factor" not in full:  # rope_type "default": no scaling, ComfyUI's rope_scale 1
        full["factor"] = 1.0
        llama.Gemma3_12B_Config.rope_scale = [1.0, 1.0]
    import numpy as np

    if float(np.float32(text["rms_norm_eps"])) == float(np.float32(1e-6)):  # the same float32 epsilon
        text["rms_norm_eps"] = 1e-6
    return config


def main() -> int:
    spec_path, out_dir = Path(sys.argv[1]), Path(sys.argv[2])
    spec = json.loads(spec_path.read_text())
    sys.path.insert(0, spec["comfyui"])
    from comfy.cli_args import args

    args.cpu = True
    import comfy.model_management  # noqa: F401 - ComfyUI's device setup, after args
    import comfy.sd
    import folder_paths
    import torch
    from comfy_extras.nodes_lt_audio import LTXAVTextEncoderLoader
    from comfy_extras.nodes_textgen import TextGenerate, TextGenerateLTX2Prompt
    from safetensors import safe_open
    from safetensors.torch import save_file

    import nodes as comfy_nodes

    checkpoint = str(Path(spec["checkpoints"]) / spec["checkpoint"])
    with safe_open(checkpoint, "pt") as f:
        widths = (f.get_slice("text_embedding_projection.video_aggregate_embed.bias").get_shape()[0],
                  f.get_slice("text_embedding_projection.audio_aggregate_embed.bias").get_shape()[0])
    shrink_gemma(comfy_config(json.loads(Path(spec["gemma_config"]).read_text())), widths)
    for folder in ("text_encoders", "checkpoints", "loras"):
        folder_paths.add_model_folder_path(folder, spec[folder])

    ours_nodes = load_pack_in_process()
    logs = collect_warnings()
    theirs = LTXAVTextEncoderLoader.execute(text_encoder=spec["gemma"], ckpt_name=spec["checkpoint"]).result[0]
    (pool,) = ours_nodes["LTXMGPU_Pool"].execute(gpus="cpu", cpu_ranks=2, lifetime="with-owner", free_comfy_vram=False)
    te, clip_bf16 = ours_nodes["LTXMGPU_GemmaLoader"].execute(pool, spec["gemma"], f"checkpoints/{spec['checkpoint']}",
                                                             "bf16", "single", True)
    # ComfyUI's LTX-2 text encoder computes in fp32 on the CPU (its weights upcast per layer)
    ours = type(clip_bf16)(dataclasses.replace(te, config=dataclasses.replace(te.config, dtype="float32")))

    def recording(clip, sink: list):
        """The CLIP with its ``generate`` results appended to ``sink`` (the node decodes them)."""
        generate = clip.generate

        def record(*a, **k):
            ids = generate(*a, **k)
            sink.append([int(t) for t in ids])
            return ids

        clip.generate = record
        return clip

    runs: dict = {}

    def enhance(case: str, node, clips: dict, prompt: str, mode: dict, **kw) -> None:
        for who, clip in clips.items():
            sink: list = []
            out = node.execute(recording(clip, sink), prompt, spec["max_length"], dict(mode), **kw)
            (text,) = out.result
            runs.setdefault(case, {})[who] = {"ids": sink[-1], "text": text}

    both = {"comfy": theirs, "ours": ours}
    report_vision: dict = {}
    lora_logs: list = []
    with torch.inference_mode():
        for i, prompt in enumerate(spec["prompts"]):
            enhance(f"ltx2.greedy.{i}", TextGenerateLTX2Prompt, both, prompt, SAMPLING_OFF)
            enhance(f"ltx2.sampled.{i}", TextGenerateLTX2Prompt, both, prompt, SAMPLING_ON)
        if spec.get("plain", True):
            enhance("plain.template", TextGenerate, both, spec["prompts"][0], SAMPLING_OFF, use_default_template=True)
            enhance("plain.raw", TextGenerate, both, spec["prompts"][0], SAMPLING_ON, use_default_template=False)
        if spec.get("images", False):
            first = spec["prompts"][0]
            enhance("image.greedy.0", TextGenerateLTX2Prompt, both, first, SAMPLING_OFF, image=image(0))
            enhance("image.greedy.1", TextGenerateLTX2Prompt, both, first, SAMPLING_OFF, image=image(1, 1, 96, 64))
            enhance("image.sampled", TextGenerateLTX2Prompt, both, first, SAMPLING_ON, image=image(0))
            enhance("image.batch", TextGenerateLTX2Prompt, both, first, SAMPLING_OFF, image=image(2, 2))
            enhance("image.template", TextGenerate, both, first, SAMPLING_OFF, image=image(3),
                    use_default_template=True)

        tensors: dict = {}
        if spec.get("lora"):
            model = comfy.sd.load_checkpoint_guess_config(checkpoint, output_vae=False, output_clip=False)[0]
            logs.clear()
            lora_clips = {who: comfy_nodes.LoraLoader().load_lora(model, clip, spec["lora"], 0.0, 0.8)[1]
                          for who, clip in both.items()}
            encode = comfy_nodes.CLIPTextEncode().encode
            for who in both:
                for case, clip in (("lora", lora_clips[who]), ("plain", both[who])):
                    for i, prompt in enumerate(spec["prompts"]):
                        (cond,) = encode(clip, prompt)
                        tensors[f"{case}.{i}.{who}"] = cond[0][0].contiguous()
            enhance("lora.greedy", TextGenerateLTX2Prompt, lora_clips, spec["prompts"][0], SAMPLING_OFF)
            lora_logs = list(logs)
        if spec.get("lora_vision"):
            model = comfy.sd.load_checkpoint_guess_config(checkpoint, output_vae=False, output_clip=False)[0]
            logs.clear()
            vision_clips = {who: comfy_nodes.LoraLoader().load_lora(model, clip, spec["lora_vision"], 0.0, 0.8)[1]
                            for who, clip in both.items()}
            vision_logs = [m for m in logs if "not loaded" in m.lower()]
            enhance("image.lora.greedy.0", TextGenerateLTX2Prompt, vision_clips, spec["prompts"][0], SAMPLING_OFF,
                    image=image(0))
            enhance("image.lora.batch", TextGenerateLTX2Prompt, vision_clips, spec["prompts"][0], SAMPLING_OFF,
                    image=image(2, 2))
            # the patched keys, and the vision tower's and projector's state-dict names and shapes on both CLIPs
            vision = ("gemma3_12b.transformer.vision_model.", "gemma3_12b.transformer.multi_modal_projector.")
            state = {"ours": ours.cond_stage_model.state_dict(), "comfy": theirs.cond_stage_model.state_dict()}
            report_vision = {
                "patched": {"ours": sorted(vision_clips["ours"].patches),
                            "comfy": sorted(vision_clips["comfy"].patcher.patches)},
                "state_dict": {who: {k: list(v.shape) for k, v in sd.items() if k.startswith(vision)}
                               for who, sd in state.items()},
                "logs": vision_logs}
    pool.client.shutdown()
    if tensors:
        save_file(tensors, str(out_dir / "conds.safetensors"))
    (out_dir / "report.json").write_text(json.dumps({"runs": runs, "lora_logs": lora_logs,
                                                     "lora_vision": report_vision}, indent=1))
    return 0


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    sys.exit(main())
