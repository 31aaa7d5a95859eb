"""Linear layers whose weights stay packed as the file stores them (GGUF's GGML blocks), and are
dequantized just before their GEMM: :class:`PackedLinear`.

A GGUF file's quantized linears (an LTX-2 transformer's block linears, a Gemma 3's projections)
keep their bytes on the device: ``weight`` holds the file's
``[out, in / block * type_size]`` bytes (whole blocks per row, so FSDP2's ``Shard(0)`` splits it
by rows and its all-gathers move packed bytes), dequantized per call by
:func:`ltx_mgpu.quantized.ggml.dequantize` into float32, merged with the layer's LoRAs (the
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

from ltx_mgpu.quantized import kernels
from ltx_mgpu.quantized.ggml import BLOCK_SHAPES, dequantize, packed_shape
from ltx_mgpu.shards import local_rows, local_tensor

__all__ = ["PACKED_TYPES", "STORAGE_DTYPE", "LoraDelta", "Merge", "PackedEmbedding", "PackedLinear", "dequantize_rows",
           "packed_layers", "swap_packed_linears"]

#: The dtype the packed bytes are held under (:meth:`PackedLinear.packed` views them as ``uint8``):
#: a one-byte floating dtype, because FSDP2 before torch 2.10 makes every parameter it shards able
#: to require gradients (``nn.Parameter(...)`` with its default ``requires_grad=True``,
#: ``torch/distributed/fsdp/_fully_shard/_fsdp_param.py``), which an integer tensor cannot. Only
#: bytes are copied and gathered, never values converted: no mixed-precision policy is set.
STORAGE_DTYPE = torch.float8_e4m3fn
#: The GGML types kept packed (the rest of a GGUF file, F32 / F16 / BF16, is loaded dense).
PACKED_TYPES = tuple(t for t in BLOCK_SHAPES if t not in ("F32", "F16", "BF16"))


class Merge(Protocol):
    """One change merged into a dequantized weight: ``apply(weight, rows)`` adds it to the float32
    ``weight`` in place (``rows``: the rows of the whole weight ``weight`` holds, for a shard)."""

    def apply(self, weight: torch.Tensor, rows: slice | None = None) -> None: ...


@dataclasses.dataclass(frozen=True)
class LoraDelta:
    """A LoRA of the loader's list (``TransformerPlan.loras``): ``weight += strength * up @ down``
    in float32, as :class:`~ltx_mgpu.denoise.checkpoint.StateDictLoader` fuses it into a dense
    weight. ``up`` ``[out, r]``, ``down`` ``[r, in]`` (any float dtype, any device)."""

    up: torch.Tensor
    down: torch.Tensor
    strength: float

    def apply(self, weight: torch.Tensor, rows: slice | None = None) -> None:
        up = self.up.to(device=weight.device, dtype=torch.float32)
        up = up if rows is None else up[rows]
        weight += self.strength * torch.mm(up, self.down.to(device=weight.device, dtype=torch.float32))


def dequantize_rows(packed: torch.Tensor, qtype: str, cols: int, dtype: torch.dtype,
                    merges: Sequence[Merge] = (), rows: slice | None = None) -> torch.Tensor:
    """``packed`` GGML rows (``uint8`` ``[n, row bytes]``) as ``dtype`` ``[n, cols]``, ``merges``
    added in float32 first (``rows``: which rows of the whole weight these are).

    On a CUDA device with Triton, one kernel launch
    (:func:`ltx_mgpu.quantized.kernels.dequantize_ggml`, into ``dtype``, or float32 when there are
    merges); else :func:`ltx_mgpu.quantized.ggml.dequantize`. The values are the same either way.
    """
    n = packed.shape[0]
    if qtype in kernels.GGML_KERNEL_TYPES and kernels.available(packed.device) and packed.is_contiguous():
        out = torch.empty(n, cols, dtype=torch.float32 if merges else dtype, device=packed.device)
        w = kernels.dequantize_ggml(packed, qtype, out)
    else:
        w = dequantize(packed, qtype, (n, cols))
    for m in merges:
        m.apply(w, rows)
    return w.to(dtype)


class PackedLinear(torch.nn.Module):
    """A ``torch.nn.Linear`` whose weight is GGML-packed (module doc).

    Parameters, without gradients: ``weight`` ``[out, row bytes]`` bytes under
    :data:`STORAGE_DTYPE` (a shard: its rows; :meth:`packed` is them as ``uint8``),
    ``bias`` ``[out]`` in the compute dtype, or None. ``qtype`` is the weight's GGML type;
    ``loras`` then ``patches`` are merged into it per call. Input ``[..., in]`` in the compute
    dtype, output ``[..., out]`` in the same dtype.
    """

    def __init__(self, in_features: int, out_features: int, bias: bool, dtype: torch.dtype, qtype: str,
                 device=None):
        super().__init__()
        self.in_features, self.out_features, self.qtype = in_features, out_features, qtype
        self.weight = torch.nn.Parameter(torch.empty(packed_shape(qtype, (out_features, in_features)),
                                                     dtype=STORAGE_DTYPE, device=device), requires_grad=False)
        self.bias = (torch.nn.Parameter(torch.empty(out_features, dtype=dtype, device=device), requires_grad=False)
                     if bias else None)
        self.loras: tuple[Merge, ...] = ()
        self.patches: tuple[Merge, ...] = ()

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
                               local_rows(self.weight))

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

