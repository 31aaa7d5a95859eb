"""ComfyUI's quantized layers (nvfp4, mxfp8, int8 with or without ConvRot) held as packed rows: each row of
the weight as its stored elements followed by its own scales, so a layer is one ``uint8``
``[rows, row bytes]`` tensor that FSDP2's ``Shard(0)`` splits by rows and gathers as bytes, as a
GGUF file's GGML blocks are (:mod:`ltx_mgpu.quantized.packed` holds both the same way).

A format is named by its :meth:`~ltx_mgpu.quantized.layers.LayerQuant.describe` string (its
``qtype`` in :class:`~ltx_mgpu.quantized.packed.PackedLinear`): ``"nvfp4"``,
``"nvfp4+pre_quant_scale"``, ``"int8_tensorwise"``, ``"int8_tensorwise+convrot256"``.
The row layouts (``C`` the stored columns, the weight's columns padded to 16 for nvfp4, to 32 for
mxfp8):

==========================  =======================================================  ==================
format                      one row's bytes                                          beside the rows
==========================  =======================================================  ==================
``nvfp4``                   ``C / 2`` bytes of two E2M1 elements (the even one in    ``tensor_scale``: the
                            the high nibble, as stored), then ``C / 16`` float8       float32 scale per
                            e4m3 block scales: the file's ``weight_scale`` taken out   tensor
                            of cuBLAS's swizzled tiles into row order                  (``weight_scale_2``);
                                                                                     ``column_scale``:
                                                                                     ``pre_quant_scale``
                                                                                     ``[C]``, if any
``int8_tensorwise``         ``C`` int8 elements, then the row's float32 scale         nothing
                            (little-endian; a per-tensor scale is repeated per row)
``mxfp8``                   ``C`` float8 e4m3 elements, then ``C / 32`` E8M0          nothing
                            exponents (out of the swizzled tiles, as nvfp4's)
==========================  =======================================================  ==================

:func:`pack_rows` turns a layer's stored tensors (as :func:`ltx_mgpu.quantized.layers.read_file_quant`
describes them) into these rows; :func:`dequantize` turns rows back into the dense weight with
comfy-kitchen's own eager functions (the row-order block scales put back into the swizzled tiles
first), so the values are ComfyUI-on-CPU's bit for bit (:mod:`ltx_mgpu.quantized.dequant` gives the
formulas). On a CUDA device :mod:`ltx_mgpu.quantized.kernels` dequantizes the same rows in one
launch: nvfp4, mxfp8 and plain int8 to the same bits; int8 with ConvRot as the exact rotation of the
integers (``q @ H`` is exact in float32, then one rounding), where comfy-kitchen's float32 matmul
of ``q * s`` by ``H`` rounds at every addition: the two agree to float32's last bits, not always
bit for bit.
"""

from __future__ import annotations

import torch

from ltx_mgpu.quantized.layers import READABLE, LayerQuant

__all__ = ["ROW_FORMATS", "RowFormatError", "dequantize", "is_row_format", "pack_rows", "packed_shape", "parse",
           "split"]

#: The ComfyUI formats held as packed rows (the fp8 ones are held as e4m3 by ``ltx_mgpu.denoise.fp8``).
ROW_FORMATS = ("nvfp4", "mxfp8", "int8_tensorwise")


class RowFormatError(ValueError):
    """A row format name or a layer's tensors that cannot be packed (names what is wrong)."""


def parse(qtype: str) -> LayerQuant:
    """The :class:`LayerQuant` a row-format name describes (``"int8_tensorwise+convrot256"``...).

    Raises:
        RowFormatError: not the name of a format in :data:`ROW_FORMATS`.
    """
    fmt, *extras = qtype.split("+")
    group, pre = None, False
    try:
        for extra in extras:
            if extra == "pre_quant_scale" and fmt == "nvfp4" and not pre:
                pre = True
            elif extra.startswith("convrot") and fmt == "int8_tensorwise" and group is None:
                group = int(extra[len("convrot"):])
            else:
                raise ValueError(extra)
        if fmt not in ROW_FORMATS:
            raise ValueError(fmt)
        return LayerQuant(fmt, group, pre_quant_scale=pre)
    except ValueError:
        raise RowFormatError(f"{qtype!r} is not a packed row format ({', '.join(ROW_FORMATS)}, +convrot<g>, "
                             "+pre_quant_scale)") from None


def is_row_format(qtype: str | None) -> bool:
    """Whether ``qtype`` names a packed row format."""
    if not qtype:
        return False
    try:
        parse(qtype)
    except RowFormatError:
        return False
    return True


def _stored_columns(fmt: str, cols: int) -> int:
    block = {"nvfp4": 16, "mxfp8": 32}.get(fmt, 1)
    return -(-cols // block) * block


def packed_shape(qtype: str, shape: tuple[int, ...]) -> tuple[int, int]:
    """``(rows, row bytes)`` of a ``qtype`` weight of logical ``shape`` ``(rows, columns)``.

    Raises:
        RowFormatError: an unknown format or a shape that is not 2-D.
    """
    quant = parse(qtype)
    if len(shape) != 2:
        raise RowFormatError(f"a {qtype} weight is 2-D, got shape {tuple(shape)}")
    rows, cols = shape
    c = _stored_columns(quant.format, cols)
    return rows, {"nvfp4": c // 2 + c // 16, "mxfp8": c + c // 32}.get(quant.format, c + 4)


def _unswizzle(blocks: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    """nvfp4 / mxfp8 block scales from cuBLAS's 128 x 4 tiles (``[roundup(rows, 128), roundup(cols,
    4)]``) into row order ``[rows, cols]``: comfy-kitchen's ``from_blocked``."""
    from comfy_kitchen.float_utils import from_blocked  # deferred: ~2 s import, only quantized files need it

    return from_blocked(blocks, num_rows=rows, num_cols=cols)


def pack_rows(quant: LayerQuant, parts: dict[str, torch.Tensor], shape: tuple[int, int], rows: slice | None = None,
         where: str = "") -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """A layer's stored tensors as packed rows.

    Args:
        quant: the layer's format (nvfp4 or int8_tensorwise).
        parts: ``"weight"`` and every name of ``quant.parts``, as the file stores them (CPU or any
            device), the scales whole; ``"weight"`` whole (nvfp4: with its padding rows), or just
            the rows ``rows`` when that is given.
        shape: the layer's logical ``(rows, columns)``; an nvfp4 weight's padding rows are dropped.
        rows: the rows of the whole weight wanted (a shard's: ``"weight"`` holds just them), or
            None for all.
        where: the layer's name, for messages.

    Returns:
        ``(packed, tensor_scale, column_scale)``: ``uint8`` ``[n, row bytes]`` on the weight's
        device; nvfp4's float32 per-tensor scale (a 0-d tensor) and its float32 ``[C]``
        ``pre_quant_scale`` or None; None and None for int8.

    Raises:
        RowFormatError: tensors of the wrong dtype or shape, or scales that are NaN or infinite
            (the message names the layer and the tensor).
    """
    r0, r1 = (0, shape[0]) if rows is None else (rows.start, rows.stop)
    n = r1 - r0
    q = parts["weight"]
    if q.shape[0] < n or (rows is not None and q.shape[0] != n):
        raise RowFormatError(f"{where}.weight has {q.shape[0]} rows; rows {r0}..{r1} of a {list(shape)} weight wanted")
    q = q[:n]
    cols = _stored_columns(quant.format, shape[1])

    def finite(name: str, t: torch.Tensor) -> torch.Tensor:
        t = t.float()
        if not bool(torch.isfinite(t).all()):
            raise RowFormatError(f"{where}.{name} holds NaN or infinite values; the file is damaged: download it again")
        return t

    if quant.format == "nvfp4":
        if q.dtype != torch.uint8 or q.dim() != 2 or q.shape[1] != cols // 2:
            raise RowFormatError(f"{where}.weight is {q.dtype} {list(q.shape)}; nvfp4 of {list(shape)} is uint8 "
                                 f"[rows, {cols // 2}]")
        blocks = parts["weight_scale"]
        blocks = blocks.view(torch.float8_e4m3fn) if blocks.dtype == torch.uint8 else blocks
        want = [-(-max(shape[0], 1) // 128) * 128, -(-(cols // 16) // 4) * 4]
        if blocks.dtype != torch.float8_e4m3fn or list(blocks.shape) < want:
            raise RowFormatError(f"{where}.weight_scale is {blocks.dtype} {list(blocks.shape)}; nvfp4 block scales "
                                 f"of a {list(shape)} weight are float8 e4m3 {want} (cuBLAS's swizzled tiles)")
        scales = _unswizzle(blocks.to(q.device), shape[0], cols // 16)[r0:r1]
        finite("weight_scale", scales)
        packed = torch.cat([q, scales.contiguous().view(torch.uint8)], dim=1)
        s2 = parts["weight_scale_2"]
        if s2.numel() != 1:
            raise RowFormatError(f"{where}.weight_scale_2 is {list(s2.shape)}; nvfp4's per-tensor scale is one number")
        tensor_scale = finite("weight_scale_2", s2).reshape(()).to(q.device)
        column_scale = None
        if quant.pre_quant_scale:
            p = parts["pre_quant_scale"]
            if p.numel() != shape[1]:
                raise RowFormatError(f"{where}.pre_quant_scale is {list(p.shape)}; it scales the {shape[1]} input "
                                     "columns")
            column_scale = finite("pre_quant_scale", p).reshape(-1).to(q.device)
        return packed.contiguous(), tensor_scale, column_scale
    if quant.format == "mxfp8":
        if q.dtype != torch.float8_e4m3fn or q.dim() != 2 or q.shape[1] != cols:
            raise RowFormatError(f"{where}.weight is {q.dtype} {list(q.shape)}; mxfp8 of {list(shape)} is float8 e4m3 "
                                 f"[rows, {cols}]")
        blocks = parts["weight_scale"].view(torch.uint8)
        want = [-(-max(shape[0], 1) // 128) * 128, -(-(cols // 32) // 4) * 4]
        if blocks.dim() != 2 or list(blocks.shape) < want:
            raise RowFormatError(f"{where}.weight_scale is {list(blocks.shape)}; mxfp8 block scales of a {list(shape)} "
                                 f"weight are uint8 {want} (cuBLAS's swizzled tiles)")
        scales = _unswizzle(blocks.to(q.device), shape[0], cols // 32)[r0:r1]
        if bool((scales == 255).any()):  # E8M0's NaN
            raise RowFormatError(f"{where}.weight_scale holds NaN or infinite values; the file is damaged: download it "
                                 "again")
        return torch.cat([q.view(torch.uint8), scales.contiguous()], dim=1).contiguous(), None, None
    if q.dtype != torch.int8 or q.dim() != 2 or q.shape[1] != cols:
        raise RowFormatError(f"{where}.weight is {q.dtype} {list(q.shape)}; int8 of {list(shape)} is int8 "
                             f"[rows, {cols}]")
    scale = parts[quant.scale or "weight_scale"]
    if scale.numel() == 1:
        per_row = finite("weight_scale", scale).reshape(1).expand(n)
    elif scale.numel() == shape[0]:
        per_row = finite("weight_scale", scale).reshape(-1)[r0:r1]
    else:
        raise RowFormatError(f"{where}.weight_scale is {list(scale.shape)}; an int8 scale is one number or one per "
                             f"row ([{shape[0]}, 1])")
    packed = torch.cat([q.view(torch.uint8), per_row.contiguous().to(q.device).view(torch.uint8).reshape(n, 4)],
                       dim=1)
    return packed.contiguous(), None, None


def split(packed: torch.Tensor, qtype: str, cols: int) -> dict[str, torch.Tensor]:
    """Packed rows back into their stored parts, row order: ``{"weight", "scales"}`` (nvfp4:
    uint8 ``[n, C/2]`` and float8 e4m3 ``[n, C/16]``; mxfp8: float8 e4m3 ``[n, C]`` and uint8
    E8M0 exponents ``[n, C/32]``; int8: int8 ``[n, C]`` and float32 ``[n, 1]``)."""
    quant = parse(qtype)
    c = _stored_columns(quant.format, cols)
    n = packed.shape[0]
    if quant.format == "nvfp4":
        return {"weight": packed[:, : c // 2], "scales": packed[:, c // 2:].contiguous().view(torch.float8_e4m3fn)}
    if quant.format == "mxfp8":
        return {"weight": packed[:, :c].contiguous().view(torch.float8_e4m3fn), "scales": packed[:, c:].contiguous()}
    return {"weight": packed[:, :c].contiguous().view(torch.int8),
            "scales": packed[:, c:].contiguous().view(torch.float32).reshape(n, 1)}


def dequantize(packed: torch.Tensor, qtype: str, cols: int, dtype: torch.dtype,
               tensor_scale: torch.Tensor | None = None, column_scale: torch.Tensor | None = None) -> torch.Tensor:
    """Packed rows ``uint8`` ``[n, row bytes]`` -> the dense weight ``dtype`` ``[n, cols]``, with
    comfy-kitchen's eager functions (module doc), on ``packed``'s device.

    nvfp4 is computed in ``dtype`` as ComfyUI computes it (the two scales multiplied in ``dtype``,
    then the element), ``column_scale`` folded into the columns in float32; mxfp8 and int8 in
    float32 (``q * 2^e``; ``q * s``, then the ConvRot rotation), then cast.
    """
    from comfy_kitchen.backends import eager  # deferred: ~2 s import, only quantized files need it
    from comfy_kitchen.float_utils import to_blocked  # deferred, as above

    quant = parse(qtype)
    parts = split(packed, qtype, cols)
    if quant.format == "nvfp4":
        if tensor_scale is None:
            raise RowFormatError(f"{qtype} rows need their tensor_scale")
        w = eager.dequantize_nvfp4(parts["weight"].contiguous(), tensor_scale.float(), to_blocked(parts["scales"],
                                   flatten=False), dtype)[:, :cols]
        if column_scale is not None:
            w = (w.float() * column_scale.float()).to(dtype)
        return w.contiguous()
    if quant.format == "mxfp8":
        blocks = to_blocked(parts["scales"], flatten=False).view(torch.float8_e8m0fnu)
        return eager.dequantize_mxfp8(parts["weight"], blocks, dtype)[:, :cols].contiguous()
    if quant.convrot_groupsize:
        w = eager.dequantize_int8_convrot_weight(parts["weight"], parts["scales"], quant.convrot_groupsize)
    else:
        w = eager.dequantize_int8_simple(parts["weight"], parts["scales"])
    return w.to(dtype)


assert set(ROW_FORMATS) <= set(READABLE)
