"""Dense weights -> ComfyUI's quantized layout (for test and benchmark files): :func:`quantize_layer`.

The stored tensors are comfy-kitchen's layouts as ComfyUI saves them: ``QuantizedTensor.from_float``
with the layout ComfyUI names for the format (``comfy/quant_ops.py`` ``QUANT_ALGOS``), its
``state_dict`` (``comfy_kitchen/tensor/*.py`` ``state_dict_tensors``: ``weight``, ``weight_scale``,
``weight_scale_2``), and ComfyUI's marker, ``json.dumps`` of the layer's conf as uint8
(``comfy/ops.py`` ``state_dict``). Scales are recomputed from the weight: nvfp4's per-tensor scale
``amax / (448 * 6)`` and its block scales (comfy-kitchen's ``quantize_nvfp4``), fp8's ``amax / max``
(ComfyUI's ``fp8_scaled`` files), int8's ``amax / 127`` per tensor, or per row for ConvRot
(comfy-kitchen's ``quantize_int8_*``). Reading them back is :mod:`ltx_mgpu.quantized.dequant`'s.

comfy-kitchen is imported inside the function (about 2 s to import).
"""

from __future__ import annotations

import json

import torch

from ltx_mgpu.quantized.layers import LayerQuant

__all__ = ["LAYOUTS", "quantize_layer", "marker_tensor"]

#: comfy-kitchen's layout class for each format, as ComfyUI names it (``QUANT_ALGOS``).
LAYOUTS = {"nvfp4": "TensorCoreNVFP4Layout", "float8_e4m3fn": "TensorCoreFP8Layout",
           "float8_e5m2": "TensorCoreFP8Layout", "int8_tensorwise": "TensorWiseINT8Layout",
           "mxfp8": "TensorCoreMXFP8Layout"}


def marker_tensor(quant: LayerQuant) -> torch.Tensor:
    """The layer's ``comfy_quant`` marker as ComfyUI writes it: uint8 bytes of ``json.dumps(conf)``."""
    return torch.tensor(list(json.dumps(quant.marker()).encode("utf-8")), dtype=torch.uint8)


def quantize_layer(weight: torch.Tensor, quant: LayerQuant) -> dict[str, torch.Tensor]:
    """One 2-D weight in ComfyUI's stored layout for ``quant``.

    Args:
        weight: the dense ``[rows, columns]`` weight (bf16 or fp32).
        quant: the format; nvfp4 with ``pre_quant_scale`` is not written, and int8 with ConvRot
            needs the columns to be a multiple of the group size.

    Returns:
        ``{"weight": ..., "weight_scale": ..., ["weight_scale_2": ...,] "comfy_quant": marker}``:
        the names after the layer's ``L.`` prefix, contiguous tensors on ``weight``'s device (the
        marker on the CPU).

    Raises:
        ValueError: a weight that is not 2-D, ``pre_quant_scale``, or a ConvRot group that does not
            divide the columns.
    """
    # deferred: comfy-kitchen takes ~2 s to import, and only writing quantized files needs it
    from comfy_kitchen.tensor import QuantizedTensor

    if weight.dim() != 2 or quant.pre_quant_scale:
        raise ValueError(f"quantize_layer writes 2-D weights without pre_quant_scale, got {list(weight.shape)} "
                         f"as {quant.describe()}")
    kwargs: dict = {}
    if quant.format in ("float8_e4m3fn", "float8_e5m2"):
        kwargs = {"scale": "recalculate",
                  "dtype": torch.float8_e4m3fn if quant.format == "float8_e4m3fn" else torch.float8_e5m2}
    elif quant.format == "int8_tensorwise" and quant.convrot_groupsize:
        if weight.shape[1] % quant.convrot_groupsize:
            raise ValueError(f"ConvRot group {quant.convrot_groupsize} does not divide {weight.shape[1]} columns")
        kwargs = {"per_channel": True, "convrot": True, "convrot_groupsize": quant.convrot_groupsize}
    qt = QuantizedTensor.from_float(weight.contiguous(), LAYOUTS[quant.format], **kwargs)
    # E8M0 scales are stored as uint8, as ComfyUI writes and reads them (safetensors has no torch dtype for them)
    out = {k: (v.view(torch.uint8) if v.dtype == torch.float8_e8m0fnu else v).contiguous()
           for k, v in qt.state_dict("weight").items()}
    out["comfy_quant"] = marker_tensor(quant)
    return out
