"""Gemma 3 text towers written in ComfyUI's quantized layouts: :data:`PLANS`, :func:`quantize_text_tensors`.

Which layers a plan quantizes, and to what (the layout of each is ``ltx_mgpu.quantized.encode``'s,
so the files are what ComfyUI writes: per-layer ``comfy_quant`` markers, comfy-kitchen's tensors).
Only the seven projections of each decoder layer (``model.layers.N.*_proj.weight``) are
quantized; the embedding and the norms stay as they are, as in ComfyUI's own Gemma files.

* ``nvfp4``: every projection NVFP4;
* ``fp4_mixed``: NVFP4, except the first decoder layer's projections (kept plain) and the last
  one's (``float8_e4m3fn``): all three kinds in one file, as the name of ComfyUI's
  ``gemma_3_12B_it_fp4_mixed.safetensors`` says (which layers that file keeps in what is read
  from its markers, not assumed: the loader follows the markers whatever they say);
* ``fp8``: every projection ``float8_e4m3fn`` with a per-tensor scale and a marker;
* ``int8``: every projection ``int8_tensorwise`` with one scale per tensor;
* ``int8_convrot``: ``int8_tensorwise`` with per-row scales and ConvRot, group 256 where it
  divides the input width (Gemma 3 12B: every projection), else the largest of 64 or 16 that does
  (the tiny model's 64/128-wide inputs; Gemma 3 270M's 640-wide ones).

These serve the tests and ``benchmarks/gemma_formats.py``; comfy-kitchen writes the tensors.
"""

from __future__ import annotations

import re

import torch

from ltx_mgpu.quantized.encode import quantize_layer
from ltx_mgpu.quantized.layers import LayerQuant

__all__ = ["PLANS", "plan_layer", "quantize_text_tensors"]

PLANS = ("nvfp4", "fp4_mixed", "fp8", "int8", "int8_convrot")
_PROJECTION = re.compile(r"^model\.layers\.(\d+)\.(?:self_attn|mlp)\.\w+_proj\.weight$")


def plan_layer(plan: str, key: str, shape: tuple[int, ...], num_layers: int) -> LayerQuant | None:
    """How ``plan`` stores the tensor ``key`` of a text tower of ``num_layers`` decoder layers
    (``None``: plain).

    Raises:
        ValueError: an unknown plan.
    """
    if plan not in PLANS:
        raise ValueError(f"unknown quantization plan {plan!r}; one of {PLANS}")
    m = _PROJECTION.match(key)
    if m is None:
        return None
    layer = int(m.group(1))
    if plan == "nvfp4" or (plan == "fp4_mixed" and 0 < layer < num_layers - 1):
        return LayerQuant("nvfp4")
    if plan == "fp4_mixed":
        return None if layer == 0 else LayerQuant("float8_e4m3fn")
    if plan == "fp8":
        return LayerQuant("float8_e4m3fn")
    if plan == "int8":
        return LayerQuant("int8_tensorwise")
    group = next(g for g in (256, 64, 16, 4) if shape[1] % g == 0)
    return LayerQuant("int8_tensorwise", convrot_groupsize=group)


def quantize_text_tensors(tensors: dict[str, torch.Tensor], plan: str,
                          num_layers: int) -> tuple[dict[str, torch.Tensor], dict[str, LayerQuant]]:
    """A ComfyUI-keyed text tower (``model.*``; other keys pass through) stored as ``plan`` says.

    Returns:
        ``(tensors, layers)``: the tensors to write (each quantized layer's weight replaced by its
        stored tensors and marker) and the layers quantized (name without ``.weight`` -> format).
    """
    out: dict[str, torch.Tensor] = {}
    layers: dict[str, LayerQuant] = {}
    for key in sorted(tensors):
        t = tensors[key]
        quant = plan_layer(plan, key, tuple(t.shape), num_layers)
        if quant is None:
            out[key] = t
            continue
        layer = key[: -len(".weight")]
        layers[layer] = quant
        out.update({f"{layer}.{k}": v for k, v in quantize_layer(t, quant).items()})
    return out, layers
