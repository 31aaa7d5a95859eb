"""Linear layers whose weights stay packed as the file stores them (GGUF's GGML blocks, ComfyUI's
nvfp4 and int8 layers), and are dequantized just before their GEMM: :class:`PackedLinear`.

A GGUF file's quantized linears (an LTX-2 transformer's block linears, a Gemma 3's projections)
keep their bytes on the device: ``weight`` holds the file's
``[out, in / block * type_size]`` bytes (whole blocks per row, so FSDP2's ``Shard(0)`` splits it
by rows and its all-gathers move packed bytes). A ComfyUI nvfp4 or int8 layer is held the same
way, as the packed rows of :mod:`ltx_mgpu.quantized.rows` (each row's elements, then its scales;
nvfp4's per-tensor scale and ``pre_quant_scale`` as the buffers ``tensor_scale`` and
``column_scale``, whole on every rank). Per call the rows are dequantized
(:func:`dequantize_rows`: GGML blocks into float32 by :func:`ltx_mgpu.quantized.ggml.dequantize`,
ComfyUI's rows into the compute dtype as ComfyUI computes them), merged with the layer's LoRAs (the
loader's list, :attr:`PackedLinear.loras`) and then ComfyUI's patches
(:attr:`PackedLinear.patches`, set by :func:`ltx_mgpu.denoise.patches.apply_patches`), in order,
in float32, as a dense weight has them merged at load, cast to the input's dtype and multiplied.
The file's bytes are never changed: removing a patch brings the file's weight back exactly. No
whole-model dequantization happens: one layer's dense weight exists at a time, for its GEMM.

Swapped into ltx-core's transformer and transformers' Gemma 3 by :func:`swap_packed_linears`
(module swap, never a fork of their code), as the fp8 layers are (:mod:`ltx_mgpu.denoise.fp8`);
:class:`PackedEmbedding` does the same for a token embedding table.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Protocol

import torch
import torch.nn.functional as F

from ltx_mgpu.quantized import ggml, kernels, rows
from ltx_mgpu.quantized.ggml import BLOCK_SHAPES, dequantize
from ltx_mgpu.shards import local_rows, local_tensor

__all__ = ["PACKED_TYPES", "STORAGE_DTYPE", "LoraDelta", "Merge", "PackedEmbedding", "PackedLinear", "dequantize_rows",
           "is_packed_type", "packed_layers", "packed_shape", "swap_packed_linears"]

#: The dtype the packed bytes are held under (:meth:`PackedLinear.packed` views them as ``uint8``):
#: a one-byte floating dtype, because FSDP2 before torch 2.10 makes every parameter it shards able
#: to require gradients (``nn.Parameter(...)`` with its default ``requires_grad=True``,
#: ``torch/distributed/fsdp/_fully_shard/_fsdp_param.py``), which an integer tensor cannot. Only
#: bytes are copied and gathered, never values converted: no mixed-precision policy is set.
STORAGE_DTYPE = torch.float8_e4m3fn
#: The GGML types kept packed (the rest of a GGUF file, F32 / F16 / BF16, is loaded dense).
PACKED_TYPES = tuple(t for t in BLOCK_SHAPES if t not in ("F32", "F16", "BF16"))


def is_packed_type(qtype: str | None) -> bool:
    """Whether ``qtype`` is kept packed: a GGML type of :data:`PACKED_TYPES` or a row format of
    :mod:`ltx_mgpu.quantized.rows` (``"nvfp4"``, ``"int8_tensorwise+convrot256"``...)."""
    return qtype in PACKED_TYPES or rows.is_row_format(qtype)


def packed_shape(qtype: str, shape: tuple[int, ...]) -> tuple[int, ...]:
    """The byte shape of a ``qtype`` weight of logical ``shape``: GGML's blocks per row
    (:func:`ltx_mgpu.quantized.ggml.packed_shape`) or a row format's bytes per row
    (:func:`ltx_mgpu.quantized.rows.packed_shape`).

    Raises:
        ggml.GGMLFormatError, rows.RowFormatError: an unknown type or a shape it cannot hold.
    """
    return rows.packed_shape(qtype, shape) if rows.is_row_format(qtype) else ggml.packed_shape(qtype, shape)


class Merge(Protocol):
    """One change merged into a dequantized weight: ``apply(weight, rows)`` adds it to the float32
    ``weight`` in place (``rows``: the rows of the whole weight ``weight`` holds, for a shard)."""

    def apply(self, weight: torch.Tensor, rows: slice | None = None) -> None: ...


@dataclasses.dataclass(frozen=True)
class LoraDelta:
    """A LoRA of the loader's list (``TransformerPlan.loras``): ``weight += strength * up @ down``
    in float32, as :class:`~ltx_mgpu.denoise.checkpoint.StateDictLoader` fuses it into a dense
    weight. ``up`` ``[out, r]``, ``down`` ``[r, in]`` (any float dtype, any device).

    Factors held in bf16 (:meth:`of` keeps them so when that loses nothing, as for a LoRA file
    stored in bf16) multiply on a GPU's bf16 tensor cores into float32 (``torch.mm(...,
    out_dtype=torch.float32)``): the products of bf16 values are exact in float32 and the sums
    accumulate in float32, as the float32 product's do, in another order."""

    up: torch.Tensor
    down: torch.Tensor
    strength: float

    @classmethod
    def of(cls, up: torch.Tensor, down: torch.Tensor, strength: float) -> LoraDelta:
        """The delta of factors given in any float dtype, held in bf16 where both are exactly bf16
        values (else as given)."""
        narrow = [t.to(torch.bfloat16) for t in (up, down)]
        if all(torch.equal(n.to(t.dtype), t) for n, t in zip(narrow, (up, down))):
            up, down = narrow
        return cls(up, down, strength)

    def apply(self, weight: torch.Tensor, rows: slice | None = None) -> None:
        if weight.is_cuda and self.up.dtype == self.down.dtype == torch.bfloat16:
            up, down = self.up.to(weight.device), self.down.to(weight.device)
            up = up if rows is None else up[rows]
            weight += self.strength * torch.mm(up, down, out_dtype=torch.float32)
            return
        up = self.up.to(device=weight.device, dtype=torch.float32)
        up = up if rows is None else up[rows]
        weight += self.strength * torch.mm(up, self.down.to(device=weight.device, dtype=torch.float32))


def dequantize_rows(packed: torch.Tensor, qtype: str, cols: int, dtype: torch.dtype,
                    merges: Sequence[Merge] = (), rows_of: slice | None = None,
                    tensor_scale: torch.Tensor | None = None, column_scale: torch.Tensor | None = None) -> torch.Tensor:
    """``packed`` rows (``uint8`` ``[n, row bytes]``) of a ``qtype`` weight as ``dtype`` ``[n, cols]``,
    ``merges`` added in float32 first (``rows_of``: which rows of the whole weight these are).

    GGML blocks are dequantized into float32 (gguf's arithmetic), ComfyUI's rows into ``dtype``
    (ComfyUI's; ``tensor_scale`` and ``column_scale`` are an nvfp4 layer's, module doc), then the
    merges are added in float32 and the sum cast to ``dtype``. On a CUDA device with Triton, one
    kernel launch (:mod:`ltx_mgpu.quantized.kernels`, into ``dtype``, or float32 when there are
    merges and the format's values are float32's); else the torch path
    (:func:`ltx_mgpu.quantized.ggml.dequantize`, :func:`ltx_mgpu.quantized.rows.dequantize`).
    The values are the same either way (int8 with ConvRot: to float32's last bits,
    :mod:`ltx_mgpu.quantized.rows`).
    """
    n = packed.shape[0]
    fast = kernels.available(packed.device) and packed.is_contiguous()
    if rows.is_row_format(qtype):
        quant = rows.parse(qtype)
        group = quant.convrot_groupsize
        nvfp4 = quant.format == "nvfp4"
        into = dtype if nvfp4 or not merges else torch.float32  # nvfp4's values are the compute dtype's
        if fast and (group is None or group >= 16):
            out = torch.empty(n, cols, dtype=into, device=packed.device)
            if nvfp4:
                w = kernels.dequantize_nvfp4_rows(packed, cols, -(-cols // 16) * 16, tensor_scale.float(),
                                                  None if column_scale is None else column_scale.float(), out)
            elif quant.format == "mxfp8":
                w = kernels.dequantize_mxfp8_rows(packed, cols, -(-cols // 32) * 32, out)
            else:
                w = kernels.dequantize_int8_rows(packed, cols, group, out)
        else:
            w = rows.dequantize(packed, qtype, cols, dtype if nvfp4 else torch.float32, tensor_scale, column_scale)
        if merges:
            w = w.float()
    elif qtype in kernels.GGML_KERNEL_TYPES and fast:
        out = torch.empty(n, cols, dtype=torch.float32 if merges else dtype, device=packed.device)
        w = kernels.dequantize_ggml(packed, qtype, out)
    else:
        w = dequantize(packed, qtype, (n, cols))
    for m in merges:
        m.apply(w, rows_of)
    return w.to(dtype)


class PackedLinear(torch.nn.Module):
    """A ``torch.nn.Linear`` whose weight is GGML-packed (module doc).

    Parameters, without gradients: ``weight`` ``[out, row bytes]`` bytes under
    :data:`STORAGE_DTYPE` (a shard: its rows; :meth:`packed` is them as ``uint8``),
    ``bias`` ``[out]`` in the compute dtype, or None. ``qtype`` is the weight's GGML type or row
    format (:func:`is_packed_type`); an nvfp4 layer also has the float32 buffers ``tensor_scale``
    (``[]``) and, with ``+pre_quant_scale``, ``column_scale`` (``[in]``), whole on every rank
    (:meth:`set_packed` fills them). ``loras`` then ``patches`` are merged into the weight per
    call. Input ``[..., in]`` in the compute dtype, output ``[..., out]`` in the same dtype.
    """

    def __init__(self, in_features: int, out_features: int, bias: bool, dtype: torch.dtype, qtype: str,
                 device=None):
        super().__init__()
        self.in_features, self.out_features, self.qtype = in_features, out_features, qtype
        self.weight = torch.nn.Parameter(torch.empty(packed_shape(qtype, (out_features, in_features)),
                                                     dtype=STORAGE_DTYPE, device=device), requires_grad=False)
        self.bias = (torch.nn.Parameter(torch.empty(out_features, dtype=dtype, device=device), requires_grad=False)
                     if bias else None)
        quant = rows.parse(qtype) if rows.is_row_format(qtype) else None
        nvfp4 = quant is not None and quant.format == "nvfp4"
        self.register_buffer("tensor_scale", torch.empty((), device=device) if nvfp4 else None)
        self.register_buffer("column_scale", torch.empty(in_features, device=device)
                             if nvfp4 and quant.pre_quant_scale else None)
        self.loras: tuple[Merge, ...] = ()
        self.patches: tuple[Merge, ...] = ()

    def set_packed(self, packed: torch.Tensor, tensor_scale: torch.Tensor | None = None,
                   column_scale: torch.Tensor | None = None) -> None:
        """Fill this rank's rows (``uint8`` ``[rows, row bytes]``, as :meth:`packed`) and an nvfp4
        layer's scales (float32; those it has, :func:`ltx_mgpu.quantized.rows.pack`'s)."""
        held = self.packed()
        if tuple(packed.shape) != tuple(held.shape):
            raise ValueError(f"{self.qtype} rows of shape {list(packed.shape)} do not fit a {self.out_features} x "
                             f"{self.in_features} layer ({list(held.shape)} here); the file does not match its config")
        held.copy_(packed)
        for name, value in (("tensor_scale", tensor_scale), ("column_scale", column_scale)):
            held = getattr(self, name)
            if (held is None) != (value is None):
                raise ValueError(f"a {self.qtype} layer {'has' if held is not None else 'has no'} {name}")
            if held is not None:
                held.copy_(value.reshape(held.shape))

    @property
    def weight_shape(self) -> tuple[int, int]:
        """The logical shape of the whole weight, ``(out, in)``."""
        return self.out_features, self.in_features

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, "
                f"qtype={self.qtype}, loras={len(self.loras)}, patches={len(self.patches)}")

    def packed(self) -> torch.Tensor:
        """This rank's GGML rows as ``uint8`` ``[rows, row bytes]`` (a view: writing it fills the layer)."""
        return local_tensor(self.weight).view(torch.uint8)

    def dense(self, dtype: torch.dtype) -> torch.Tensor:
        """The weight this layer multiplies by (its rows, for a shard): dequantized, merged, ``dtype``."""
        return dequantize_rows(self.packed(), self.qtype, self.in_features, dtype, (*self.loras, *self.patches),
                               local_rows(self.weight), self.tensor_scale, self.column_scale)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.dense(x.dtype), self.bias)


def swap_packed_linears(model: torch.nn.Module, qtypes: dict[str, str]) -> list[str]:
    """Replace the ``nn.Linear`` layers named in ``qtypes`` (layer name -> GGML type) by empty
    :class:`PackedLinear` shells of that type, in place (on the meta device: they are filled from
    the file afterwards); returns the names."""
    for name, qtype in qtypes.items():
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name)
        old = getattr(parent, child)
        dtype = old.bias.dtype if old.bias is not None else old.weight.dtype
        setattr(parent, child, PackedLinear(old.in_features, old.out_features, old.bias is not None, dtype, qtype,
                                            device=old.weight.device))
    return list(qtypes)


class PackedEmbedding(torch.nn.Module):
    """A token embedding whose table is GGML-packed: a lookup gathers the packed rows of its ids
    (whole blocks per row) and dequantizes only those, so the table stays at the file's size.

    ``weight``: ``[vocab, row bytes]`` bytes under :data:`STORAGE_DTYPE`; ``qtype`` its GGML
    type. ``forward(ids)``: int64 ids ``[...]`` -> ``[..., dim]`` in ``dtype``, times ``scale``
    when given, cast to ``dtype`` first (the operations of transformers'
    ``Gemma3TextScaledWordEmbedding``: ``embedding(ids) * embed_scale.to(weight.dtype)``, so a
    table dequantized to ``dtype`` gives the same values).
    """

    def __init__(self, num_embeddings: int, embedding_dim: int, qtype: str, dtype: torch.dtype,
                 scale: float | None = None, padding_idx: int | None = None, device=None):
        super().__init__()
        self.num_embeddings, self.embedding_dim, self.qtype, self.dtype = num_embeddings, embedding_dim, qtype, dtype
        self.padding_idx = padding_idx
        self.weight = torch.nn.Parameter(torch.empty(packed_shape(qtype, (num_embeddings, embedding_dim)),
                                                     dtype=STORAGE_DTYPE, device=device), requires_grad=False)
        self.scale = scale

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}, qtype={self.qtype}, scale={self.scale}"

    def packed(self) -> torch.Tensor:
        """The table's GGML rows as ``uint8`` ``[vocab, row bytes]`` (a view: writing it fills it)."""
        return self.weight.view(torch.uint8)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        rows = self.packed()[ids.reshape(-1).to(self.weight.device)]
        out = dequantize_rows(rows, self.qtype, self.embedding_dim, self.dtype).reshape(*ids.shape, self.embedding_dim)
        if self.scale is not None:
            out = out * torch.tensor(self.scale, dtype=torch.float32, device=out.device).to(self.dtype)
        return out


def packed_layers(model: torch.nn.Module) -> dict[str, PackedLinear]:
    """Every :class:`PackedLinear` of ``model``, by module name."""
    return {n: m for n, m in model.named_modules() if isinstance(m, PackedLinear)}

