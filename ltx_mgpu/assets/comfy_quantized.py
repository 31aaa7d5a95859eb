"""LTX-2 transformer files in ComfyUI's quantized layouts, for the tests and the benchmarks: the
block linears of a safetensors DiT written as nvfp4, mxfp8, int8 (± ConvRot) or fp8 layers with ComfyUI's
``comfy_quant`` markers (comfy-kitchen's tensors, :func:`ltx_mgpu.quantized.encode.quantize_layer`:
what ComfyUI's own quantized files hold, e.g. an ``fp4_mixed`` or Kijai's ``int8_convrot``
transformer), and the float32 file of the values such a file holds (the reference a loader is
compared with).

:func:`export_comfy_quant` writes the file; :func:`dequantized_copy` the reference, each layer
dequantized by :func:`ltx_mgpu.quantized.dequant.dequantize` (comfy-kitchen's eager functions) in
float32.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save

from ltx_mgpu.files import write_atomically
from ltx_mgpu.quantized.dequant import dequantize
from ltx_mgpu.quantized.encode import quantize_layer
from ltx_mgpu.quantized.layers import LayerQuant, read_file_quant

__all__ = ["FORMATS", "block_linear_formats", "dequantized_copy", "export_comfy_quant"]

#: The formats :func:`block_linear_formats` names: ``LayerQuant`` by name (int8 ConvRot of group
#: 256 where it divides the input width, else the largest of 64 or 16 that does, as ComfyUI's
#: writers choose for narrow layers).
FORMATS = ("nvfp4", "mxfp8", "int8", "int8_convrot", "fp8")


def block_linear_formats(name: str) -> Callable[[str, tuple[int, ...]], LayerQuant | None]:
    """The rule of a quantized transformer file: the blocks' 2-D weights in format ``name`` (one of
    :data:`FORMATS`), everything else (1-D tensors, the tables, patchify / proj_out, the
    connectors) as stored."""
    if name not in FORMATS:
        raise ValueError(f"format must be one of {FORMATS}, got {name!r}")

    def rule(key: str, shape: tuple[int, ...]) -> LayerQuant | None:
        if not (key.startswith("transformer_blocks.") and key.endswith(".weight") and len(shape) == 2):
            return None
        if name == "nvfp4":  # whole 16 x 16 tiles: no padding (whose rows the header could not tell)
            return LayerQuant("nvfp4") if shape[0] % 16 == 0 and shape[1] % 16 == 0 else None
        if name == "mxfp8":  # whole 32 x 32 tiles: no padding
            return LayerQuant("mxfp8") if shape[0] % 32 == 0 and shape[1] % 32 == 0 else None
        if name == "fp8":
            return LayerQuant("float8_e4m3fn")
        if name == "int8":
            return LayerQuant("int8_tensorwise")
        group = next((g for g in (256, 64, 16) if shape[1] % g == 0), None)
        return LayerQuant("int8_tensorwise", group) if group else None

    return rule


def export_comfy_quant(src: str | os.PathLike, dst: str | os.PathLike,
                       rule: Callable[[str, tuple[int, ...]], LayerQuant | None], *, prefix: str = "") -> Path:
    """Write the DiT of safetensors file ``src`` (transformer-only, no prefix, or a monolith's
    ``model.diffusion_model.*``) as ``dst`` with each weight ``rule(key, shape)`` says quantized in
    ComfyUI's layout and marker, the rest as stored; keys written with ``prefix``; the ``config``
    metadata kept. Atomic. Returns ``dst``."""
    out: dict[str, torch.Tensor] = {}
    with safe_open(os.fspath(src), framework="pt", device="cpu") as f:
        meta = dict(f.metadata() or {})
        keys = list(f.keys())
        strip = "model.diffusion_model." if sum(k.startswith("model.diffusion_model.") for k in keys) > 5 else ""
        for key in keys:
            if not key.startswith(strip):
                continue
            full = key[len(strip):]
            t = f.get_tensor(key)
            quant = rule(full, tuple(t.shape))
            if quant is None:
                out[prefix + full] = t.contiguous()
                continue
            stem = prefix + full[: -len(".weight")]
            for name, value in quantize_layer(t.float(), quant).items():
                out[f"{stem}.{name}"] = value
    config = {"config": meta["config"]} if "config" in meta else None
    return write_atomically(Path(dst), save(out, metadata=config))


def dequantized_copy(path: str | os.PathLike, dst: str | os.PathLike) -> Path:
    """The float32 file of the values quantized file ``path`` holds (its quantized layers dequantized
    as ComfyUI computes them, in float32; the rest as float32), keys and ``config`` as in ``path``.
    Returns ``dst``."""
    layers = read_file_quant(path).layers
    out: dict[str, torch.Tensor] = {}
    with safe_open(os.fspath(path), framework="pt", device="cpu") as f:
        meta = dict(f.metadata() or {})
        keys = set(f.keys())
        aux = {f"{layer}.{name}" for layer, q in layers.items() for name in (*q.parts, "comfy_quant")}
        for key in sorted(keys - aux):
            layer = key[: -len(".weight")] if key.endswith(".weight") else None
            quant = layers.get(layer) if layer is not None else None
            if quant is None:
                out[key] = f.get_tensor(key).float().contiguous()
                continue
            parts = {"weight": f.get_tensor(key), **{p: f.get_tensor(f"{layer}.{p}") for p in quant.parts}}
            out[key] = dequantize(quant, parts, torch.float32, quant.logical_shape(tuple(parts["weight"].shape)))
    config = {"config": meta["config"]} if "config" in meta else None
    return write_atomically(Path(dst), save(out, metadata=config))
