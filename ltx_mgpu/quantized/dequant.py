"""A quantized layer's dense weight, computed as ComfyUI computes it: :func:`dequantize`.

ComfyUI dequantizes a layer through comfy-kitchen (``QuantizedTensor.dequantize`` -> the
layout's ``dequantize`` -> ``comfy_kitchen.dequantize_*``, which runs the eager backend on the
CPU) into the dtype of the layer's input (``comfy/ops.py`` ``cast_bias_weight`` casts the
quantized weight to it first). :func:`dequantize` calls
those eager functions (``comfy_kitchen.backends.eager``) directly: the same code on every device,
with no dispatch to comfy-kitchen's CUDA or Triton kernels, so the weights are ComfyUI-on-CPU's
bit for bit on any machine (``tests/comfyui/test_comfyui_clip.py`` compares them with ComfyUI's own).

The formulas (the formats' definitions, which comfy-kitchen implements; ``R x C`` weight, ``r``
row, ``c`` column, ``dtype`` the output dtype):

* ``nvfp4`` (NVIDIA's NVFP4: FP4 E2M1 elements, one FP8 E4M3 scale per 16 consecutive elements of
  a row, one FP32 scale per tensor): ``w[r, c] = e2m1(q[r, c]) * (s2 * s[r, c // 16])`` with
  ``e2m1`` in ``{±0, ±0.5, ±1, ±1.5, ±2, ±3, ±4, ±6}``, the two scales multiplied in ``dtype``
  and then the element, as comfy-kitchen does. A byte holds two elements, the even one in the high
  nibble (comfy-kitchen's ``hi_first`` default, which ComfyUI writes and reads). The block scales
  are stored in cuBLAS's "1D block scaling factors layout" (128 x 4 tiles, rows padded to 128 and
  scale columns to 4: NVIDIA cuBLAS documentation, section "D block scaling factors layout"), and
  the padding of the weight to multiples of 16 is cut off. A ``pre_quant_scale`` (ModelOpt's
  AWQ-style input smoothing, which later ComfyUI versions multiply into the layer's input) is
  folded into the columns: ``w[:, c] *= p[c]`` in fp32, then cast to ``dtype``.
* ``float8_e4m3fn`` / ``float8_e5m2``: ``w = q.to(dtype) * scale.to(dtype)`` (scale 1 if absent; one
  per row when it has a value per row, as an int8 scale).
* ``mxfp8`` (OCP's MX FP8: FP8 E4M3 elements, one E8M0 power-of-two scale per 32 consecutive
  elements of a row, in the same swizzled tiles as nvfp4's): ``w[r, c] = q[r, c] * 2^(e[r, c // 32]
  - 127)`` in fp32 (an exponent of 0 gives 0, as comfy-kitchen's ``e8m0_to_f32``), then cast to
  ``dtype``; the padding to multiples of 32 is cut off.
* ``int8_tensorwise``: ``w = q * scale`` in fp32 (a scalar, or one scale per row); with ConvRot of
  group ``g`` the writer stored ``W @ H^T`` per group of ``g`` input columns, ``H`` the regular
  Hadamard matrix of size ``g`` (Kronecker powers of the 4 x 4 regular Hadamard matrix, divided by
  ``sqrt(g)``): symmetric and orthogonal, so ``w <- w @ H^T`` per group undoes it; then cast to
  ``dtype``.

comfy-kitchen is imported inside the functions: it takes about 2 s to import, and a file without
quantized layers never needs it.
"""

from __future__ import annotations

from typing import Mapping

import torch

from ltx_mgpu.quantized.layers import FileQuant, LayerQuant

__all__ = ["DECODER", "dequantize", "describe_decoding", "load_decoder"]

#: The dequantization's version, part of a quantized file's content identity: bump it when the
#: dense weights of any format change (cached embeddings of such files then become misses).
DECODER = "comfy-kitchen-eager.1"


def _eager():
    # deferred: comfy-kitchen takes ~2 s to import, and only quantized layers need it
    from comfy_kitchen.backends import eager

    return eager


def load_decoder() -> None:
    """Import comfy-kitchen now, in the calling thread: before a loader's worker threads call
    :func:`dequantize` (transformers materializes weights in a thread pool). comfy-kitchen's
    package imports its backends, and its CUDA backend imports the eager one back: two threads
    importing it at once find one of them half-initialized (``ImportError: ... partially
    initialized module``), seen with the platform wheel ComfyUI installs."""
    import comfy_kitchen  # noqa: F401 - deferred as above; the package first, then its eager backend

    _eager()


def dequantize(quant: LayerQuant, parts: Mapping[str, torch.Tensor], dtype: torch.dtype,
               shape: tuple[int, ...] | None = None, device: torch.device | str | None = None) -> torch.Tensor:
    """The dense weight of one quantized layer (module docstring: the formulas).

    Args:
        quant: how the layer is stored (``ltx_mgpu.quantized.layers.read_file_quant``).
        parts: ``"weight"`` and every name in ``quant.parts``, as stored (any device).
        dtype: the output dtype (bf16, fp16 or fp32): the dtype the model computes in, for which
            these are ComfyUI's weights exactly.
        shape: the layer's ``(rows, columns)``; nvfp4's padding beyond it is cut off. ``None``: the
            stored (padded) shape.
        device: where to compute (default: the weight's device); the result is there.

    Returns:
        A ``shape`` tensor of ``dtype`` on ``device``.

    Raises:
        KeyError: a part of ``quant.parts`` is missing from ``parts``.
        ValueError: ``shape`` larger than what is stored.
    """
    eager = _eager()
    dev = torch.device(device) if device is not None else parts["weight"].device
    p = {k: parts[k].to(dev) for k in ("weight", *quant.parts)}
    q = p["weight"]
    if quant.format == "nvfp4":
        blocks = p["weight_scale"]
        blocks = blocks.view(torch.float8_e4m3fn) if blocks.dtype == torch.uint8 else blocks
        w = eager.dequantize_nvfp4(q, p["weight_scale_2"].to(torch.float32), blocks, dtype)
        if quant.pre_quant_scale:  # one per logical column: the padding columns are cut first
            columns = p["pre_quant_scale"].reshape(-1)
            w = (w[:, : columns.numel()].float() * columns.float()).to(dtype)
    elif quant.format == "mxfp8":
        w = eager.dequantize_mxfp8(q, p["weight_scale"].view(torch.uint8).view(torch.float8_e8m0fnu), dtype)
    elif quant.format in ("float8_e4m3fn", "float8_e5m2"):
        scale = p[quant.scale] if quant.scale else torch.ones((), dtype=torch.float32, device=dev)
        if scale.numel() == q.shape[0] > 1:
            scale = scale.reshape(-1, 1)  # one scale per row, stored flat or [R, 1]
        w = eager.dequantize_per_tensor_fp8(q, scale, dtype)
    else:
        scale = p[quant.scale].to(torch.float32)
        if scale.dim() == 1 and scale.numel() == q.shape[0] > 1:
            scale = scale.unsqueeze(1)  # one scale per row, stored flat
        if quant.convrot_groupsize:
            w = eager.dequantize_int8_convrot_weight(q, scale, quant.convrot_groupsize)
        else:
            w = eager.dequantize_int8_simple(q, scale)
        w = w.to(dtype)
    if shape is not None and tuple(w.shape) != tuple(shape):
        if len(shape) != 2 or shape[0] > w.shape[0] or shape[1] > w.shape[1]:
            raise ValueError(f"a {quant.describe()} weight stored as {list(w.shape)} cannot be {list(shape)}")
        w = w[: shape[0], : shape[1]].contiguous()
    return w


def describe_decoding(quant: FileQuant) -> str:
    """What a file's content identity adds for its quantized layers: ``""`` for a file without
    any, else :data:`DECODER` and the formats present (``"comfy-kitchen-eager.1:float8_e4m3fn,nvfp4"``)."""
    formats = quant.describe()
    return f"{DECODER}:{formats}" if formats else ""
