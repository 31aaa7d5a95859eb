"""ComfyUI's own LTX-2 text encoder and our Gemma Loader on ComfyUI's quantized Gemma files, in-process.

Used by ``tests/comfyui/test_comfyui_gemma_formats.py``; run with ComfyUI's Python (``$COMFYUI_PYTHON``)::

    python tests/comfyui_quant_run.py SPEC.json OUT_DIR

``SPEC.json``: ``{"comfyui": dir, "gemma_config": the tiny snapshot's config.json, "text_encoders":
dir, "files": {format: file name there}, "checkpoints": dir, "checkpoint": file name there,
"prompts": {case: text}}``. ComfyUI's 12B sizes are replaced by the tiny model's exactly as for
the bf16 file (``comfyui_clip_run.shrink_gemma``). For each file whose formats this ComfyUI
knows (``comfy.quant_ops.QUANT_ALGOS``; the others are listed as ``not_in_comfyui``):

* ``LTXAVTextEncoderLoader`` loads it, and every text projection's weight as ComfyUI computes
  with it for fp32 and for bf16 inputs (cast, then ``QuantizedTensor.dequantize()`` for a
  quantized one, as ``comfy/ops.py`` ``cast_bias_weight`` does) is compared with ours
  (``ltx_mgpu.text.gemma.comfy_file``) bit for bit;
* every prompt goes through ``nodes.CLIPTextEncode`` on ComfyUI's CLIP (``comfy``), on our Gemma
  Loader's ``clip`` at its defaults (bf16 weights, dtype ``auto``: fp32 on this CPU pool, as
  ComfyUI's encoder computes: ``ours``), with its dtype at ``bf16`` (``ours_bf16``) and
  on our Gemma Loader with ``weights: nf4`` (``ours_nf4``), on a pool of one CPU rank.

It writes ``OUT_DIR/conds.safetensors`` (``<format>.<case>.<who>``) and ``OUT_DIR/report.json``
(``weights``: per format the layers compared, how many ComfyUI holds quantized, those that differ;
``conds``: each conditioning described; ``not_in_comfyui``).
"""

from __future__ import annotations

import json
import os
import re
import sys
from pathlib import Path

from comfyui_clip_run import describe, prepare_text_encoders  # noqa: E402 - this script runs from tests/
from comfyui_support import REPO, load_pack_in_process  # noqa: E402

_PROJECTION = re.compile(r"(?:^|\.)model\.(layers\.\d+\.(?:self_attn|mlp)\.\w+_proj)$")


def main() -> int:
    spec = json.loads(Path(sys.argv[1]).read_text())
    out_dir = Path(sys.argv[2])
    sys.path.insert(0, spec["comfyui"])
    from comfy.cli_args import args

    args.cpu = True
    import comfy.model_management  # noqa: F401 - ComfyUI's device setup, after args
    import torch
    from comfy.quant_ops import QUANT_ALGOS, QuantizedTensor
    from comfy_extras.nodes_lt_audio import LTXAVTextEncoderLoader
    from safetensors.torch import save_file

    import nodes as comfy_nodes

    prepare_text_encoders(spec, ("text_encoders", "checkpoints"))
    ours_nodes = load_pack_in_process()
    sys.path.append(str(REPO))  # after ComfyUI's own modules: its ``nodes`` is not our nodes/
    from ltx_mgpu.text.gemma.comfy_file import open_comfy_file

    (pool,) = ours_nodes["LTXMGPU_Pool"].execute(gpus="cpu", cpu_ranks=1, lifetime="with-owner", free_comfy_vram=False)
    loader = ours_nodes["LTXMGPU_GemmaLoader"]
    encode = comfy_nodes.CLIPTextEncode().encode

    tensors, report = {}, {"weights": {}, "conds": {}, "not_in_comfyui": {}}
    with torch.inference_mode():
        for fmt, name in spec["files"].items():
            path = Path(spec["text_encoders"]) / name
            src = open_comfy_file(path)
            missing = sorted({q.format for q in src.quant.layers.values()} - set(QUANT_ALGOS))
            if missing:
                report["not_in_comfyui"][fmt] = missing
                continue
            theirs = LTXAVTextEncoderLoader.execute(text_encoder=name, ckpt_name=spec["checkpoint"]).result[0]
            compared, quantized, unequal = 0, 0, []
            for module_name, module in theirs.cond_stage_model.named_modules():
                m = _PROJECTION.search(module_name)
                if m is None:
                    continue
                quantized += isinstance(module.weight, QuantizedTensor)
                compared += 1
                for dtype in (torch.float32, torch.bfloat16):  # what ComfyUI's layer computes with for
                    weight = module.weight.to(dtype=dtype, copy=True)  # inputs of dtype (comfy/ops.py
                    if isinstance(weight, QuantizedTensor):  # cast_bias_weight)
                        weight = weight.dequantize()
                    mine = src.read(m.group(1) + ".weight", dtype=dtype).to(dtype)
                    if weight.dtype != dtype or not torch.equal(weight, mine):
                        unequal.append(f"{m.group(1)} ({dtype})")
            report["weights"][fmt] = {"compared": compared, "quantized": quantized, "unequal": unequal,
                                      "ours_quantized": len(src.quant.layers)}
            # the node as shipped (dtype 'auto': fp32 on this CPU pool), and with its dtype at bf16
            _, ours = loader.execute(pool, name, f"checkpoints/{spec['checkpoint']}", "bf16", "single", True)
            _, clip = loader.execute(pool, name, f"checkpoints/{spec['checkpoint']}", "bf16", "single", True,
                                     dtype="bf16")
            _, ours_nf4 = loader.execute(pool, name, f"checkpoints/{spec['checkpoint']}", "nf4", "single", True)
            for case, text in spec["prompts"].items():
                for who, c in (("comfy", theirs), ("ours", ours), ("ours_bf16", clip), ("ours_nf4", ours_nf4)):
                    (cond,) = encode(c, text)
                    report["conds"].setdefault(fmt, {}).setdefault(case, {})[who] = describe(cond)
                    tensors[f"{fmt}.{case}.{who}"] = cond[0][0].contiguous()
    pool.client.shutdown()
    save_file(tensors, str(out_dir / "conds.safetensors"))
    (out_dir / "report.json").write_text(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    sys.exit(main())
