"""Which layers of a ComfyUI ``.safetensors`` file are quantized, and how: :func:`read_file_quant`.

Read from the header and the small marker tensors only (never a weight). The layout, as ComfyUI
writes and reads it (ComfyUI 0.20.1 and its later ``comfy/ops.py`` ``_load_quantized_module`` /
``state_dict``, ``comfy/quant_ops.py`` ``QUANT_ALGOS``, ``comfy/utils.py`` ``convert_old_quants``;
the tensors are comfy-kitchen's layouts, ``comfy_kitchen/tensor/*.py``):

* a quantized layer ``L`` has a marker ``L.comfy_quant``: a uint8 tensor holding UTF-8 JSON
  ``{"format": F, ...}``. Older files carry the same per-layer JSON in the header entry
  ``_quantization_metadata`` (``{"layers": {L: {...}}}``), which ComfyUI turns into markers
  (overriding any marker of the same layer; so does :func:`read_file_quant`). A layer without
  either is stored plainly, except an fp8 weight, which is read as fp8 by its dtype with its
  scale if it has one (ComfyUI's older scaled-fp8 files: ``L.scale_weight``, or ``L.weight_scale``);
* the formats read (:data:`READABLE`) and their tensors beside ``L.weight``:

  ====================  ==============  ================================================================
  format                ``L.weight``    beside it
  ====================  ==============  ================================================================
  ``nvfp4``             U8 ``[R, C/2]`` ``weight_scale`` F8_E4M3 (or U8, viewed as it) ``[roundup(R, 128),
                                        roundup(C/16, 4)]`` in cuBLAS's swizzled tile layout;
                                        ``weight_scale_2`` F32 scalar; optional ``input_scale``
                                        (activations only: not needed for the weight) and
                                        ``pre_quant_scale`` ``[C]`` (input smoothing)
  ``float8_e4m3fn``,    F8 ``[R, C]``   ``weight_scale`` (older files: ``scale_weight``) F32 scalar
                                        (absent: 1); optional ``input_scale``
  ``float8_e5m2``
  ``int8_tensorwise``   I8 ``[R, C]``   ``weight_scale`` F32: a scalar (tensorwise) or ``[R, 1]`` (per
                                        row); the marker's ``convrot`` / ``convrot_groupsize`` (default
                                        256; at the top or under ``params``) say the rows were rotated
                                        by a Hadamard matrix per group of input columns
  ``mxfp8``             F8 ``[R, C]``   ``weight_scale`` U8 ``[roundup(R, 128), roundup(C/32, 4)]``: an
                                        E8M0 exponent per 32 elements of a row, in cuBLAS's swizzled
                                        tiles (ComfyUI stores them as uint8: ``comfy/ops.py``)
  ====================  ==============  ================================================================

  ``R, C`` are the weight's rows and columns, padded to multiples of 16 for nvfp4 and of 32 for
  mxfp8 (the logical shape, :meth:`LayerQuant.logical_shape`); the formulas are
  :mod:`ltx_mgpu.quantized.dequant`'s;
* ComfyUI's other formats (:data:`UNREADABLE`) raise :class:`QuantFormatError` naming the format.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass, field
from pathlib import Path

from safetensors import safe_open

__all__ = ["READABLE", "UNREADABLE", "AUX_SUFFIXES", "QuantFormatError", "LayerQuant", "FileQuant",
           "read_file_quant", "marker_json"]

#: The formats :mod:`ltx_mgpu.quantized.dequant` turns into dense weights.
READABLE = ("nvfp4", "float8_e4m3fn", "float8_e5m2", "int8_tensorwise", "mxfp8")
#: ComfyUI's other per-layer formats (``comfy/quant_ops.py``, later versions), which are refused.
UNREADABLE = {
    "convrot_w4a4": "4-bit weights and activations with a Hadamard rotation",
    "asym_w4a8_int8": "4-bit weights with fp8 group scales for int8 activations",
    "awq_w4a16": "AWQ 4-bit weights with group scales and zero points",
    "svdquant_w4a4": "SVDQuant 4-bit weights with a low-rank branch",
}
#: Names of the tensors a quantized layer keeps beside its weight (``L.<name>``).
AUX_SUFFIXES = (".comfy_quant", ".weight_scale", ".weight_scale_2", ".input_scale", ".pre_quant_scale",
                ".scale_weight", ".scale_input")
_HEADER_KEY = "_quantization_metadata"
_STORED_AS = {"nvfp4": "U8", "float8_e4m3fn": "F8_E4M3", "float8_e5m2": "F8_E5M2", "int8_tensorwise": "I8",
              "mxfp8": "F8_E4M3"}
_FP8_BY_DTYPE = {"F8_E4M3": "float8_e4m3fn", "F8_E5M2": "float8_e5m2"}
_SCALE_SUFFIXES = (".weight_scale", ".scale_weight", ".weight_scale_2", ".pre_quant_scale")
#: The dtypes a per-tensor, per-row or per-column scale may be stored in (nvfp4's and mxfp8's block
#: scales have their own, checked with their layout).
_SCALE_DTYPES = ("F32", "F16", "BF16", "F64")


class QuantFormatError(ValueError):
    """A layer's quantization cannot be read: an unknown or unsupported format, a marker that is not
    ComfyUI's JSON, or a tensor missing or of the wrong dtype or shape. The message names the file,
    the layer and the format."""


@dataclass(frozen=True)
class LayerQuant:
    """How one layer's weight is stored.

    Attributes:
        format: one of :data:`READABLE`.
        convrot_groupsize: ``int8_tensorwise`` with ConvRot: the Hadamard group size (a power of
            4 dividing the input width); ``None``: no rotation (and for every other format).
        scale: the name of the weight's scale tensor beside the weight (``"weight_scale"``, or
            ``"scale_weight"`` in older scaled-fp8 files); ``None`` for an fp8 weight without one.
        pre_quant_scale: nvfp4 only: the layer has ``pre_quant_scale`` (folded into the weight).
    """

    format: str
    convrot_groupsize: int | None = None
    scale: str | None = "weight_scale"
    pre_quant_scale: bool = False

    def __post_init__(self) -> None:
        if self.format not in READABLE:
            raise ValueError(f"LayerQuant.format must be one of {READABLE}, got {self.format!r}")
        g = self.convrot_groupsize
        if g is not None and (self.format != "int8_tensorwise" or not _power_of_4(g)):
            raise ValueError(f"convrot_groupsize applies to int8_tensorwise only and must be a power of 4, got {g!r}")

    @property
    def parts(self) -> tuple[str, ...]:
        """The tensors besides the weight that its dense value needs (names after ``L.``)."""
        if self.format == "nvfp4":
            return ("weight_scale", "weight_scale_2") + (("pre_quant_scale",) if self.pre_quant_scale else ())
        return (self.scale,) if self.scale else ()

    def describe(self) -> str:
        """A short name: ``"nvfp4"``, ``"int8_tensorwise+convrot256"``, ``"nvfp4+pre_quant_scale"``."""
        extra = f"+convrot{self.convrot_groupsize}" if self.convrot_groupsize else ""
        return self.format + extra + ("+pre_quant_scale" if self.pre_quant_scale else "")

    def logical_shape(self, stored: tuple[int, ...]) -> tuple[int, ...]:
        """The dense weight's shape from the stored one (nvfp4 packs two columns per byte)."""
        if self.format == "nvfp4":
            return (stored[0], stored[1] * 2)
        return tuple(stored)

    def marker(self) -> dict:
        """The marker JSON ComfyUI writes for this layer (``comfy/ops.py`` ``state_dict``)."""
        conf: dict = {"format": self.format}
        if self.convrot_groupsize:
            conf.update(convrot=True, convrot_groupsize=self.convrot_groupsize)
        return conf


@dataclass(frozen=True)
class FileQuant:
    """The quantized layers of one file.

    Attributes:
        layers: layer name (the weight's key without ``.weight``) -> :class:`LayerQuant`; plain
            layers are absent.
    """

    layers: dict[str, LayerQuant] = field(default_factory=dict)

    def of(self, weight_key: str) -> LayerQuant | None:
        """The quantization of the tensor ``weight_key`` (``L.weight``), or ``None`` if it is plain."""
        if not weight_key.endswith(".weight"):
            return None
        return self.layers.get(weight_key[: -len(".weight")])

    def describe(self) -> str:
        """The formats present, sorted and comma-separated (``""`` for a file without any)."""
        return ",".join(sorted({q.describe() for q in self.layers.values()}))


def marker_json(data: bytes, where: str) -> dict:
    """The JSON of a ``comfy_quant`` marker's bytes.

    Raises:
        QuantFormatError: not UTF-8 JSON of an object with a string ``format``.
    """
    try:
        conf = json.loads(data.decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError):
        conf = None
    if not isinstance(conf, dict) or not isinstance(conf.get("format"), str):
        raise QuantFormatError(f"{where}: the comfy_quant marker is not ComfyUI's JSON {{\"format\": ...}} "
                               f"(got {data[:80]!r}); the file is damaged or not a ComfyUI file")
    return conf


def _power_of_4(n: object) -> bool:
    return isinstance(n, int) and not isinstance(n, bool) and n >= 4 and (n & (n - 1)) == 0 and n.bit_length() % 2 == 1


def _roundup(x: int, m: int) -> int:
    return -(-x // m) * m


def _check_scales(q: LayerQuant, layer: str, shape: tuple[int, ...], slices: dict, where: str, hint: str) -> None:
    """The shapes of a layer's per-tensor, per-row and per-column scales (the table in the module
    doc): an fp8 or int8 ``weight_scale`` is one number or one per row (``[R]`` or ``[R, 1]``),
    nvfp4's ``weight_scale_2`` one number, its ``pre_quant_scale`` one per input column (``[C]``;
    the padding columns may be left out)."""
    rows = shape[0]
    wants: list[tuple[str, str, bool]] = []
    if q.format in ("float8_e4m3fn", "float8_e5m2", "int8_tensorwise") and q.scale:
        article = "an" if q.format.startswith("int8") else "a"
        wants.append((q.scale, f"{article} {q.format} weight scale is one number or one per row ([{rows}] or "
                               f"[{rows}, 1])", False))
    if q.format == "nvfp4":
        wants.append(("weight_scale_2", "nvfp4's weight_scale_2 is one number", False))
        if q.pre_quant_scale:
            wants.append(("pre_quant_scale", f"nvfp4's pre_quant_scale is one per input column ([{shape[1] * 2}])",
                          True))
    for part, want, columns in wants:
        sl = slices[f"{layer}.{part}"]
        got, dtype = [int(n) for n in sl.get_shape()], sl.get_dtype()
        n = math.prod(got)
        if columns:
            ok = len(got) == 1 and shape[1] * 2 - 16 < n <= shape[1] * 2
        else:
            ok = n == 1 or (n == rows and got in ([rows], [rows, 1]))
        if not ok or dtype not in _SCALE_DTYPES:
            raise QuantFormatError(f"{where}: {layer}.{part} is {dtype} {got}; {want}, float; the file is damaged "
                                   f"(download it again){hint}")


def _layer(conf: dict, layer: str, keys: set[str], slices: dict, where: str, hint: str) -> LayerQuant:
    """The :class:`LayerQuant` of a marked layer, checked against the tensors stored for it."""
    fmt = conf["format"]
    if fmt in UNREADABLE:
        raise QuantFormatError(f"{where}: layer {layer} is stored as ComfyUI {fmt!r} ({UNREADABLE[fmt]}), which "
                               f"ltx_mgpu cannot read yet (it reads {', '.join(READABLE)}){hint}")
    if fmt not in READABLE:
        raise QuantFormatError(f"{where}: layer {layer} has the unknown quantization format {fmt!r} "
                               f"(ltx_mgpu reads {', '.join(READABLE)}){hint}")
    weight = slices[f"{layer}.weight"]
    dtype, shape = weight.get_dtype(), tuple(weight.get_shape())
    if dtype != _STORED_AS[fmt] or len(shape) != 2:
        raise QuantFormatError(f"{where}: layer {layer} is marked {fmt!r}, whose weight ComfyUI stores as a 2-D "
                               f"{_STORED_AS[fmt]} tensor, but {layer}.weight is {dtype} {list(shape)}; the file "
                               f"is damaged{hint}")
    params = conf.get("params") if isinstance(conf.get("params"), dict) else {}
    group = None
    if fmt == "int8_tensorwise" and conf.get("convrot", params.get("convrot", False)):
        group = conf.get("convrot_groupsize", params.get("convrot_groupsize", 256))
        if not _power_of_4(group) or shape[1] % group:
            raise QuantFormatError(f"{where}: layer {layer} is int8 with a ConvRot rotation of group {group!r}, which "
                                   f"must be a power of 4 dividing its {shape[1]} input columns; the file is damaged"
                                   f"{hint}")
    scale = "weight_scale"
    if fmt.startswith("float8"):  # optional, and named scale_weight in older scaled-fp8 files
        scale = next((s for s in ("weight_scale", "scale_weight") if f"{layer}.{s}" in keys), None)
    q = LayerQuant(fmt, group, scale, pre_quant_scale=fmt == "nvfp4" and f"{layer}.pre_quant_scale" in keys)
    missing = [f"{layer}.{p}" for p in q.parts if f"{layer}.{p}" not in keys]
    if missing:
        raise QuantFormatError(f"{where}: layer {layer} is {fmt!r} but {', '.join(missing)} is missing; the file is "
                               f"incomplete{hint}")
    _check_scales(q, layer, shape, slices, where, hint)
    if fmt in ("nvfp4", "mxfp8"):
        scales = slices[f"{layer}.weight_scale"]
        cols, block, kinds = (shape[1] * 2, 16, ("F8_E4M3", "U8")) if fmt == "nvfp4" else (shape[1], 32, ("U8",))
        want = [_roundup(shape[0], 128), _roundup(cols // block, 4)]
        if scales.get_dtype() not in kinds or list(scales.get_shape()) != want:
            raise QuantFormatError(f"{where}: {layer}.weight_scale is {scales.get_dtype()} {scales.get_shape()}; "
                                   f"{fmt} block scales of a {list(shape)} weight are {kinds[0]} {want} (cuBLAS's "
                                   f"swizzled layout); the file is damaged{hint}")
    return q


def read_file_quant(path: str | os.PathLike, prefix: str = "", hint: str = "") -> FileQuant:
    """The quantized layers of a ComfyUI ``.safetensors`` file (header and markers only).

    Args:
        path: the file.
        prefix: only layers whose names start with it (e.g. ``"model."``: a text encoder's text
            tower, not its vision tower) are read and checked.
        hint: appended to every error's message (what the caller accepts instead).

    Raises:
        QuantFormatError: a marker that is not ComfyUI's JSON, a format of :data:`UNREADABLE` or an
            unknown one, a weight of the wrong dtype, a missing scale, block scales of the wrong
            shape, or a ConvRot group that cannot apply.
        OSError, safetensors' errors: the file cannot be read.
    """
    where = str(Path(path))
    with safe_open(os.fspath(path), framework="pt", device="cpu") as f:
        keys = set(f.keys())
        meta = dict(f.metadata() or {})
        confs: dict[str, dict] = {}
        for key in sorted(k for k in keys if k.endswith(".comfy_quant")):
            confs[key[: -len(".comfy_quant")]] = marker_json(f.get_tensor(key).numpy().tobytes(), f"{where}: {key}")
        if _HEADER_KEY in meta:
            try:
                header = json.loads(meta[_HEADER_KEY])
                layers = header["layers"]
                assert isinstance(layers, dict)
            except (ValueError, KeyError, TypeError, AssertionError, RecursionError):
                raise QuantFormatError(f"{where}: the header's {_HEADER_KEY} is not ComfyUI's "
                                       f"{{\"layers\": {{...}}}} JSON; the file is damaged{hint}") from None
            for layer, conf in layers.items():
                confs[layer] = marker_json(json.dumps(conf).encode(), f"{where}: {_HEADER_KEY}[{layer!r}]")
        slices = {k: f.get_slice(k) for k in keys if k.endswith((".weight", *_SCALE_SUFFIXES))}
        out: dict[str, LayerQuant] = {}
        for layer, conf in confs.items():
            if layer.startswith(prefix) and f"{layer}.weight" in keys:
                out[layer] = _layer(conf, layer, keys, slices, where, hint)
        for key, sl in slices.items():
            layer = key[: -len(".weight")]
            if (key.endswith(".weight") and key.startswith(prefix) and layer not in out
                    and sl.get_dtype() in _FP8_BY_DTYPE):
                scale = next((s for s in ("weight_scale", "scale_weight") if f"{layer}.{s}" in keys), None)
                out[layer] = LayerQuant(_FP8_BY_DTYPE[sl.get_dtype()], scale=scale)
                _check_scales(out[layer], layer, tuple(sl.get_shape()), slices, where, hint)
    return FileQuant(out)
