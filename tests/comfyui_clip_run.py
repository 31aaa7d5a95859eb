"""Encode prompts with ComfyUI's own LTX-2 text encoder and with our Gemma Loader's CLIP, in-process.

Used by ``tests/comfyui/test_comfyui_clip.py``; run with ComfyUI's Python (``$COMFYUI_PYTHON``)::

    python tests/comfyui_clip_run.py SPEC.json OUT_DIR

``SPEC.json``: ``{"comfyui": dir, "gemma_config": the tiny snapshot's config.json, "text_encoders":
dir, "gemma": file name there (ComfyUI's single-file format), "checkpoints": dir, "checkpoint":
file name there, "loras": dir, "lora": file name there, "lora_projection": file name there (a LoRA
on the text projection), "checkpoint_20" and "lora_projection_20" (optional: the tiny LTX-2.0
checkpoint there and a LoRA on its projection), "prompts": {case: text},
"long_tokens": n}``. The ``long`` case is made here: the shortest repetition of a sentence that
ComfyUI's tokenizer makes at least ``long_tokens`` tokens.

ComfyUI hard-codes Gemma 3 12B's sizes; :func:`shrink_gemma` replaces those numbers (and only
those) by the tiny model's. Then every case goes through ``nodes.CLIPTextEncode`` on the CLIP of
``LTXAVTextEncoderLoader`` (``comfy``) and on our Gemma Loader's ``clip`` output at its defaults
(``ours``: dtype ``auto``, fp32 on this CPU pool, as ComfyUI's text encoder computes); the
``short`` case also with the loader's dtype at ``bf16`` (``ours_bf16``). Our conditioning then
goes through ``ConditioningZeroOut``, ``LTXVConditioning``, ``ConditioningCombine``, ComfyUI's
``SamplerCustomAdvanced`` (ComfyUI's own model) and our SP Sampler, and our CLIP through
``LoraLoader``; one encode runs inside a node's execution context, its progress ticks recorded.
It writes ``OUT_DIR/conds.safetensors`` (``<case>.<who>`` tensors, ``sample.<who>.<part>`` latents) and
``OUT_DIR/report.json`` (each conditioning's dict, ComfyUI's token counts, the downstream nodes'
results described, the progress ticks, the LoRA log lines).
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys
from pathlib import Path

from comfyui_support import collect_warnings, load_pack_in_process  # noqa: E402 - this script runs from tests/


def shrink_gemma(config: dict, widths: tuple[int, int], single_width: int | None = None) -> None:
    """Give ComfyUI's LTX-2 text encoder the tiny Gemma's sizes and the tiny LTX-2.3 projection's
    widths, where ComfyUI hard-codes Gemma 3 12B's (``Gemma3_12B_Config`` and its vision config in
    ``comfy/text_encoders/llama.py``; ``3840 * 49``, the 48th layer's key and ``4096, 2048`` in
    ``comfy/text_encoders/lt.py``, whose source is re-run with only those numbers replaced).
    ``single_width``: also the output width of LTX-2.0's single projection (``3840`` there), for
    the tiny LTX-2.0 checkpoint.

    Raises:
        AssertionError: the tiny model differs from Gemma 3 12B in something that is not a size
            (RoPE, norm epsilon, attention scale), or ComfyUI's source no longer has the numbers.
    """
    import comfy.text_encoders.llama as llama
    import comfy.text_encoders.lt as lt

    text, vision = config["text_config"], config["vision_config"]
    base = llama.Gemma3_12B_Config
    rope = text["rope_parameters"]
    same = {"rms_norm_eps": (text["rms_norm_eps"], base.rms_norm_eps),
            "rope_theta": ([rope["full_attention"]["rope_theta"], rope["sliding_attention"]["rope_theta"]],
                           base.rope_theta),
            "rope_scale": ([rope["full_attention"]["factor"], 1.0], base.rope_scale),
            "query_pre_attn_scalar": (text["query_pre_attn_scalar"], text["head_dim"])}
    for name, (tiny, comfy) in same.items():
        assert tiny == comfy, f"the tiny Gemma's {name} is {tiny}, ComfyUI's Gemma 3 12B has {comfy}"
    layers, pattern = text["num_hidden_layers"], text["_sliding_window_pattern"]
    fields = {k: text[k] for k in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                                   "num_attention_heads", "num_key_value_heads", "max_position_embeddings")}
    tiny = dataclasses.make_dataclass("TinyGemma3Config", [(k, int, dataclasses.field(default=v))
                                                           for k, v in fields.items()], bases=(base,))
    tiny.head_dim = text["head_dim"]
    tiny.sliding_attention = [text["sliding_window"]] * (pattern - 1) + [False]
    tiny.vision_config = {**llama.GEMMA3_VISION_CONFIG, **{k: vision[k] for k in (
        "hidden_size", "image_size", "intermediate_size", "num_attention_heads", "num_hidden_layers", "patch_size")}}
    tiny.mm_tokens_per_image = config["mm_tokens_per_image"]
    llama.Gemma3_12B_Config = tiny

    source = Path(lt.__file__).read_text()
    single = (("Linear(3840 * 49, 3840, bias=False", f"Linear(3840 * 49, {single_width}, bias=False", 1),)
    for old, new, count in (*(single if single_width is not None else ()),
                            ("3840 * 49", f"{text['hidden_size']} * {layers + 1}", 2),
                            ("model.layers.47.self_attn.q_norm.weight",
                             f"model.layers.{layers - 1}.self_attn.q_norm.weight", 1),
                            ("4096, 2048", f"{widths[0]}, {widths[1]}", 1)):
        assert source.count(old) == count, f"{lt.__file__} no longer holds {old!r} {count} time(s)"
        source = source.replace(old, new)
    exec(compile(source, lt.__file__, "exec"), lt.__dict__)  # noqa: S102 - ComfyUI's own source, numbers replaced


def prepare_text_encoders(spec: dict, folders: tuple[str, ...]) -> None:
    """ComfyUI's LTX-2 text encoder sized for the tiny Gemma and the checkpoint's projection
    widths (:func:`shrink_gemma`), and the spec's model ``folders`` registered with ComfyUI
    (after ``comfy.cli_args`` and ``comfy.model_management`` are set up)."""
    import folder_paths
    from safetensors import safe_open

    checkpoint = str(Path(spec["checkpoints"]) / spec["checkpoint"])
    with safe_open(checkpoint, "pt") as f:
        widths = (f.get_slice("text_embedding_projection.video_aggregate_embed.bias").get_shape()[0],
                  f.get_slice("text_embedding_projection.audio_aggregate_embed.bias").get_shape()[0])
    single = None
    if spec.get("checkpoint_20"):
        with safe_open(str(Path(spec["checkpoints"]) / spec["checkpoint_20"]), "pt") as f:
            single = f.get_slice("text_embedding_projection.aggregate_embed.weight").get_shape()[0]
    shrink_gemma(json.loads(Path(spec["gemma_config"]).read_text()), widths, single_width=single)
    for folder in folders:
        folder_paths.add_model_folder_path(folder, spec[folder])


def main() -> int:
    spec_path, out_dir = Path(sys.argv[1]), Path(sys.argv[2])
    spec = json.loads(spec_path.read_text())
    sys.path.insert(0, spec["comfyui"])
    from comfy.cli_args import args

    args.cpu = True
    import comfy.model_management  # noqa: F401 - ComfyUI's device setup, after args
    import comfy.nested_tensor
    import comfy.sd
    import torch
    from comfy_extras import nodes_custom_sampler as ncs
    from comfy_extras import nodes_lt
    from comfy_extras.nodes_lt_audio import LTXAVTextEncoderLoader
    from safetensors.torch import save_file

    import nodes as comfy_nodes

    prepare_text_encoders(spec, ("text_encoders", "checkpoints", "loras"))

    ours_nodes = load_pack_in_process()
    logs = collect_warnings()

    theirs = LTXAVTextEncoderLoader.execute(text_encoder=spec["gemma"], ckpt_name=spec["checkpoint"]).result[0]
    (pool,) = ours_nodes["LTXMGPU_Pool"].execute(gpus="cpu", cpu_ranks=2, lifetime="with-owner", free_comfy_vram=False)
    loader = ours_nodes["LTXMGPU_GemmaLoader"]
    # the node as shipped: its dtype 'auto' is fp32 on this CPU pool, as ComfyUI's text encoder computes
    _, ours = loader.execute(pool, spec["gemma"], f"checkpoints/{spec['checkpoint']}", "bf16", "single", True)
    _, clip_bf16 = loader.execute(pool, spec["gemma"], f"checkpoints/{spec['checkpoint']}", "bf16", "single", True,
                                  dtype="bf16")

    def comfy_tokens(text: str) -> int:
        (row,) = theirs.tokenize(text)["gemma3_12b"]
        return sum(1 for t, _ in row if t != 0)  # left padding is <pad> (0); the text has none

    prompts = dict(spec["prompts"])
    sentence, n = "the cat walks in the city at night and the light of the rain is blue ", 1
    while comfy_tokens(sentence * n) < spec["long_tokens"]:
        n += 1
    prompts["long"] = sentence * n

    encode = comfy_nodes.CLIPTextEncode().encode
    tensors, report = {}, {"cases": {}, "tokens": {}}
    conds = {}
    with torch.inference_mode():
        for case, text in prompts.items():
            report["tokens"][case] = comfy_tokens(text)
            whos = {"comfy": theirs, "ours": ours, **({"ours_bf16": clip_bf16} if case == "short" else {})}
            for who, clip in whos.items():
                (cond,) = encode(clip, text)
                conds[(case, who)] = cond
                report["cases"].setdefault(case, {})[who] = describe(cond)
                tensors[f"{case}.{who}"] = cond[0][0].contiguous()

        # inside a node's execution our encode's progress bar is that node's (ComfyUI's context)
        import comfy.utils
        from comfy_execution.utils import CurrentNodeContext

        ticks: list = []
        comfy.utils.set_progress_bar_global_hook(lambda value, total, preview, node_id=None: ticks.append(
            [node_id, value, total]))
        with CurrentNodeContext("prompt-1", "42"):
            encode(ours, prompts["short"] + " at dawn")
        comfy.utils.set_progress_bar_global_hook(None)
        report["progress"] = ticks

        # the core conditioning nodes on our output and on ComfyUI's
        report["downstream"] = {}
        for who in ("comfy", "ours"):
            cond = conds[("short", who)]
            (zero,) = comfy_nodes.ConditioningZeroOut().zero_out(cond)
            positive, negative = nodes_lt.LTXVConditioning.execute(cond, zero, 25.0).result
            (combined,) = comfy_nodes.ConditioningCombine().combine(cond, conds[("unicode", who)])
            report["downstream"][who] = {"zero": describe(zero), "positive": describe(positive),
                                         "negative": describe(negative), "combined": describe(combined),
                                         "zero_is_zero": bool((zero[0][0] == 0).all())}
            conds[("positive", who)], conds[("negative", who)] = positive, negative

        # samplers: ComfyUI's on its own model, and our SP Sampler, each with both conditionings
        checkpoint = str(Path(spec["checkpoints"]) / spec["checkpoint"])
        model = comfy.sd.load_checkpoint_guess_config(checkpoint, output_vae=False, output_clip=False)[0]
        (sp_model, *_) = ours_nodes["LTXMGPU_ModelLoader"].execute(pool, spec["checkpoint"], "fp32", "", 32768)
        video = torch.zeros(1, 128, 2, 2, 3)
        latent = {"samples": comfy.nested_tensor.NestedTensor((video, torch.zeros(1, 8, 5, 16)))}
        sigmas = ncs.ManualSigmas.execute("1.0, 0.725, 0.421875, 0.0").result[0]
        for who in ("comfy", "ours"):
            positive, negative = conds[("positive", who)], conds[("negative", who)]
            guider = ncs.CFGGuider.execute(model, positive, negative, 3.0).result[0]
            sampler = ncs.KSamplerSelect.execute("euler").result[0]
            noise = ncs.RandomNoise.execute(42).result[0]
            out = ncs.SamplerCustomAdvanced.execute(noise, guider, sampler, sigmas, latent).result[0]["samples"]
            for i, part in enumerate(out.unbind()):
                tensors[f"sample.comfy_model.{who}.{i}"] = part.contiguous()
            (sp,) = ours_nodes["LTXMGPU_SPSampler"].execute(sp_model, positive, negative, latent, 3, 3.0, 42, "euler",
                                                             sigmas=sigmas)
            for i, part in enumerate(sp["samples"].unbind()):
                tensors[f"sample.sp.{who}.{i}"] = part.contiguous()

        # LoraLoader with our CLIP and with ComfyUI's: the model's LoRA and the text encoder's apply
        logs.clear()
        lora_model, lora_clip = comfy_nodes.LoraLoader().load_lora(model, ours, spec["lora"], 1.0, 1.0)
        (after,) = encode(lora_clip, prompts["short"])
        report["lora"] = {"clip_type": type(lora_clip).__name__, "same_clip_object": lora_clip is ours,
                          "model_patched": lora_model is not model and len(lora_model.patches) > 0,
                          "logs": [m for m in logs if "lora" in m.lower() or "not loaded" in m.lower()]}
        tensors["lora.ours"] = after[0][0].contiguous()
        (theirs_after,) = encode(comfy_nodes.LoraLoader().load_lora(model, theirs, spec["lora"], 1.0, 1.0)[1],
                                 prompts["short"])
        tensors["lora.comfy"] = theirs_after[0][0].contiguous()

        # a LoRA on the text projection (a tower key with it) at strength_clip 0.8, on both CLIPs
        logs.clear()
        proj_ours = comfy_nodes.LoraLoader().load_lora(model, ours, spec["lora_projection"], 1.0, 0.8)[1]
        proj_theirs = comfy_nodes.LoraLoader().load_lora(model, theirs, spec["lora_projection"], 1.0, 0.8)[1]
        report["lora_projection"] = {"ours": sorted(proj_ours.patches), "comfy": sorted(proj_theirs.patcher.patches),
                                     "logs": [m for m in logs if "not loaded" in m.lower()]}
        for who, clip in (("ours", proj_ours), ("comfy", proj_theirs)):
            (cond,) = encode(clip, prompts["short"])
            tensors[f"lora_projection.{who}"] = cond[0][0].contiguous()

        # LTX-2.0's single projection (ComfyUI's key text_embedding_projection.weight): plain and with a LoRA on it
        if spec.get("checkpoint_20"):
            logs.clear()
            theirs20 = LTXAVTextEncoderLoader.execute(text_encoder=spec["gemma"],
                                                      ckpt_name=spec["checkpoint_20"]).result[0]
            _, ours20 = loader.execute(pool, spec["gemma"], f"checkpoints/{spec['checkpoint_20']}", "bf16", "single",
                                       True)
            lora20 = {who: comfy_nodes.LoraLoader().load_lora(model, clip, spec["lora_projection_20"], 1.0, 0.8)[1]
                      for who, clip in (("ours", ours20), ("comfy", theirs20))}
            report["lora_projection_20"] = {"ours": sorted(lora20["ours"].patches),
                                            "comfy": sorted(lora20["comfy"].patcher.patches),
                                            "logs": [m for m in logs if "not loaded" in m.lower()]}
            for who, plain in (("ours", ours20), ("comfy", theirs20)):
                for case, clip in (("plain", plain), ("lora", lora20[who])):
                    (cond,) = encode(clip, prompts["short"])
                    tensors[f"ltx20.{case}.{who}"] = cond[0][0].contiguous()
    pool.client.shutdown()
    save_file(tensors, str(out_dir / "conds.safetensors"))
    (out_dir / "report.json").write_text(json.dumps(report, indent=1))
    return 0


def describe(cond: list) -> list:
    """A CONDITIONING as JSON: per entry the tensor's dtype, shape and device, and the dict (values
    that are not JSON as their type name)."""
    out = []
    for tensor, opts in cond:
        items = {k: (v if v is None or isinstance(v, (bool, int, float, str)) else type(v).__name__)
                 for k, v in opts.items()}
        out.append({"dtype": str(tensor.dtype), "shape": list(tensor.shape), "device": str(tensor.device),
                    "opts": items})
    return out


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    sys.exit(main())
