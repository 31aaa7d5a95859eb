"""GGUF files and the GGML block formats: a file's tensors read with the ``gguf`` package
(llama.cpp's own reader; no parser of ours), and their blocks dequantized with torch on any
device, bit for bit as ``gguf.quants.dequantize`` computes them.

A GGUF tensor is stored as rows of blocks along its innermost dimension (``ne0`` in GGML's
order, the last in torch's): a weight ``[out, in]`` is ``out`` rows of ``in / block`` blocks, each
block ``type_size`` bytes for ``block`` values (``gguf.GGML_QUANT_SIZES``). The formats read here
(:data:`READABLE`), by family:

* plain: ``F32``, ``F16``, ``BF16`` (a block of one value);
* the legacy 32-value blocks: ``Q8_0`` (an fp16 scale ``d``, 32 int8), ``Q4_0`` / ``Q5_0`` (``d`` and
  4- or 5-bit codes less 8 or 16), ``Q4_1`` / ``Q5_1`` (``d``, a minimum ``m`` and unsigned codes:
  ``d * q + m``);
* the K-quants, 256-value super-blocks of 16 or 8 sub-blocks with their own scales: ``Q2_K``,
  ``Q3_K``, ``Q4_K``, ``Q5_K``, ``Q6_K`` (layouts: llama.cpp's ``ggml-common.h``; the arithmetic
  here follows ``gguf/quants.py``'s numpy reference operation by operation, in float32, so the
  results are the same bits).

:func:`dequantize` turns a tensor's bytes (``uint8``, any shape whose elements are the rows' bytes
in order) into float32 values of the logical shape; :class:`GGUFFile` lists a file's tensors and
reads their bytes memory-mapped. A tensor type outside :data:`READABLE` is refused naming the
tensor and the types that are read.
"""

from __future__ import annotations

import functools
import os
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

__all__ = ["BLOCK_SHAPES", "DECODER", "READABLE", "GGMLFormatError", "GGUFFile", "GGUFTensor", "dequantize",
           "open_gguf", "packed_shape"]

#: The version of :func:`dequantize`'s arithmetic: part of a GGUF Gemma's identity (the prompt
#: cache's key), so a change to how the blocks decode never serves embeddings of the old values.
DECODER = "ltx_mgpu.ggml.1"

#: The GGML types this module reads: name -> (values per block, bytes per block) (``gguf.GGML_QUANT_SIZES``).
BLOCK_SHAPES: dict[str, tuple[int, int]] = {
    "F32": (1, 4), "F16": (1, 2), "BF16": (1, 2),
    "Q8_0": (32, 34), "Q4_0": (32, 18), "Q4_1": (32, 20), "Q5_0": (32, 22), "Q5_1": (32, 24),
    "Q2_K": (256, 84), "Q3_K": (256, 110), "Q4_K": (256, 144), "Q5_K": (256, 176), "Q6_K": (256, 210),
}
READABLE = tuple(BLOCK_SHAPES)
_QK_K = 256


class GGMLFormatError(ValueError):
    """A GGUF file or tensor ltx_mgpu cannot read (names the file or tensor and the fix)."""


def packed_shape(qtype: str, shape: tuple[int, ...]) -> tuple[int, ...]:
    """The byte shape of a ``qtype`` tensor of logical ``shape``: the last dimension becomes its
    blocks' bytes (``[..., n / block * type_size]``).

    Raises:
        GGMLFormatError: an unknown type, or a last dimension that is not whole blocks.
    """
    if qtype not in BLOCK_SHAPES:
        raise GGMLFormatError(f"GGML type {qtype} is not read by ltx_mgpu; readable: {', '.join(READABLE)}")
    block, size = BLOCK_SHAPES[qtype]
    if not shape or shape[-1] % block:
        raise GGMLFormatError(f"a {qtype} tensor's rows must be whole {block}-value blocks, got shape {shape}")
    return (*shape[:-1], shape[-1] // block * size)


# --------------------------------------------------------------------------- dequantization


def _f16(b: torch.Tensor) -> torch.Tensor:
    """Little-endian fp16 from ``[n, 2]`` bytes, as float32 ``[n, 1]``."""
    return b.contiguous().view(torch.float16).float()


def _nibbles(qs: torch.Tensor, groups: int) -> torch.Tensor:
    """``[n, groups * w]`` bytes -> ``[n, groups, 2, w]`` 4-bit codes: the low nibbles of each
    group's ``w`` bytes, then their high nibbles (GGML's order)."""
    n = qs.shape[0]
    q = qs.reshape(n, groups, 1, -1)
    return torch.cat([q & 0x0F, q >> 4], dim=2)


def _bits(b: torch.Tensor, groups: int, width: int, count: int) -> torch.Tensor:
    """``[n, groups * w]`` bytes -> ``[n, groups, count, w]``: field ``j`` of ``width`` bits at bit
    ``j * width`` of every byte."""
    n = b.shape[0]
    q = b.reshape(n, groups, 1, -1)
    mask = (1 << width) - 1
    return torch.cat([(q >> (j * width)) & mask for j in range(count)], dim=2)


def _legacy(blocks: torch.Tensor, qtype: str) -> torch.Tensor:
    n = blocks.shape[0]
    d = _f16(blocks[:, :2])
    if qtype == "Q8_0":
        return blocks[:, 2:].contiguous().view(torch.int8).float() * d
    minimum = _f16(blocks[:, 2:4]) if qtype in ("Q4_1", "Q5_1") else None
    at = 4 if minimum is not None else 2
    high = None
    if qtype in ("Q5_0", "Q5_1"):
        qh = blocks[:, at:at + 4].contiguous().view(torch.int32)  # bit i: the fifth bit of value i
        high = ((qh >> torch.arange(32, dtype=torch.int32, device=blocks.device)) & 1).to(torch.uint8)
        at += 4
    q = _nibbles(blocks[:, at:], 1).reshape(n, 32)
    if high is not None:
        q = q | (high << 4)
    if minimum is None:
        offset = 8 if qtype == "Q4_0" else 16
        return d * (q.to(torch.int8) - offset).float()
    return d * q.float() + minimum


def _scale_min_k4(scales: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Q4_K / Q5_K's eight 6-bit scales and eight 6-bit minimums from their 12 bytes."""
    n = scales.shape[0]
    s = scales.reshape(n, 3, 4)
    d, m, m_d = s[:, 0], s[:, 1], s[:, 2]
    sc = torch.cat([d & 0x3F, (m_d & 0x0F) | ((d >> 2) & 0x30)], dim=-1)
    mn = torch.cat([m & 0x3F, (m_d >> 4) | ((m >> 2) & 0x30)], dim=-1)
    return sc, mn


def _k_quant(blocks: torch.Tensor, qtype: str) -> torch.Tensor:
    n = blocks.shape[0]
    if qtype == "Q2_K":
        scales, qs, d, dmin = blocks[:, :16], blocks[:, 16:80], _f16(blocks[:, 80:82]), _f16(blocks[:, 82:84])
        dl = (d * (scales & 0xF).float()).reshape(n, 16, 1)
        ml = (dmin * (scales >> 4).float()).reshape(n, 16, 1)
        q = _bits(qs, 2, 2, 4).reshape(n, 16, 16).float()
        return (dl * q - ml).reshape(n, _QK_K)
    if qtype == "Q3_K":
        hmask, qs, scales, d = blocks[:, :32], blocks[:, 32:96], blocks[:, 96:108], _f16(blocks[:, 108:110])
        low = _bits(scales[:, :8], 1, 4, 2).reshape(n, 16)
        high = _bits(scales[:, 8:], 1, 2, 4).reshape(n, 16)
        sc = ((low | (high << 4)).to(torch.int8) - 32).float()
        dl = (d * sc).reshape(n, 16, 1)
        ql = _bits(qs, 2, 2, 4).reshape(n, 16, 16)
        qh = _bits(hmask, 1, 1, 8).reshape(n, 16, 16) ^ 1  # a set mask bit means no -4 offset
        q = (ql.to(torch.int8) - (qh << 2).to(torch.int8)).float()
        return (dl * q).reshape(n, _QK_K)
    if qtype in ("Q4_K", "Q5_K"):
        d, dmin = _f16(blocks[:, :2]), _f16(blocks[:, 2:4])
        sc, mn = _scale_min_k4(blocks[:, 4:16])
        d = (d * sc.float()).reshape(n, 8, 1)
        dm = (dmin * mn.float()).reshape(n, 8, 1)
        if qtype == "Q4_K":
            q = _nibbles(blocks[:, 16:], 4).reshape(n, 8, 32).float()
        else:
            qh, qs = blocks[:, 16:48], blocks[:, 48:]
            high = _bits(qh, 1, 1, 8).reshape(n, 8, 32)
            q = (_nibbles(qs, 4).reshape(n, 8, 32) | (high << 4)).float()
        return (d * q - dm).reshape(n, _QK_K)
    # Q6_K
    ql, qh, scales, d = blocks[:, :128], blocks[:, 128:192], blocks[:, 192:208], _f16(blocks[:, 208:210])
    d = (d * scales.contiguous().view(torch.int8).float()).reshape(n, 16, 1)
    low = _nibbles(ql, 2).reshape(n, 8, 32)
    high = _bits(qh, 2, 2, 4).reshape(n, 8, 32)
    q = ((low | (high << 4)).to(torch.int8) - 32).reshape(n, 16, 16).float()
    return (d * q).reshape(n, _QK_K)


def dequantize(data: torch.Tensor, qtype: str, shape: tuple[int, ...]) -> torch.Tensor:
    """The float32 values of a GGML tensor, on ``data``'s device.

    Args:
        data: the tensor's bytes as ``uint8`` (any shape; its elements in storage order), e.g.
            :meth:`GGUFFile.read` or a shard of whole rows of it.
        qtype: one of :data:`READABLE`.
        shape: the logical shape of the values ``data`` holds (torch's order, rows last).

    Returns:
        float32 ``shape``: ``gguf.quants.dequantize``'s values, bit for bit.

    Raises:
        GGMLFormatError: an unreadable type, or ``data`` not the size ``shape`` takes.
    """
    want = packed_shape(qtype, tuple(shape))
    if data.dtype != torch.uint8 or data.numel() != int(np.prod(want)):
        raise GGMLFormatError(f"a {qtype} tensor of shape {tuple(shape)} takes {int(np.prod(want))} bytes, "
                              f"got {data.numel()} of {data.dtype}")
    block, size = BLOCK_SHAPES[qtype]
    flat = data.reshape(-1)
    if qtype == "F32":
        return flat.view(torch.float32).reshape(shape).clone()
    if qtype in ("F16", "BF16"):
        return flat.view(torch.float16 if qtype == "F16" else torch.bfloat16).float().reshape(shape)
    blocks = flat.reshape(-1, size)
    out = _k_quant(blocks, qtype) if qtype.endswith("_K") else _legacy(blocks, qtype)
    return out.reshape(shape)


# --------------------------------------------------------------------------- files


@dataclass(frozen=True)
class GGUFTensor:
    """One tensor of a GGUF file: its name, GGML type, logical shape (torch's order) and index."""

    name: str
    qtype: str
    shape: tuple[int, ...]
    index: int


def open_gguf(path: str | os.PathLike) -> GGUFFile:
    """:class:`GGUFFile` of ``path``, opened once per process while the file is unchanged (same
    size and modification time): ``gguf.GGUFReader`` parses every metadata array element by
    element in Python, which takes seconds for a Gemma file's 262,144-token vocabulary.

    Raises:
        GGMLFormatError: as :class:`GGUFFile`. OSError: the file cannot be read.
    """
    st = os.stat(path)
    return _open_gguf(os.path.realpath(path), st.st_size, st.st_mtime_ns)


@functools.lru_cache(maxsize=4)
def _open_gguf(path: str, size: int, mtime_ns: int) -> GGUFFile:  # noqa: ARG001 - the cache key
    return GGUFFile(path)


class GGUFFile:
    """A GGUF file opened with ``gguf.GGUFReader`` (memory-mapped): its tensors and metadata.

    Raises (at construction):
        GGMLFormatError: not a readable GGUF file.
    """

    def __init__(self, path: str | os.PathLike):
        import gguf  # deferred: only GGUF files need llama.cpp's reader

        self.path = Path(path)
        try:
            self._reader = gguf.GGUFReader(str(self.path))
        except Exception as e:  # noqa: BLE001 - any reader failure means an unreadable file
            raise GGMLFormatError(f"{self.path}: not a readable GGUF file ({type(e).__name__}: {e})") from None
        self.tensors: dict[str, GGUFTensor] = {}
        for i, t in enumerate(self._reader.tensors):
            shape = self._orig_shape(t.name) or tuple(int(v) for v in reversed(t.shape))
            self.tensors[t.name] = GGUFTensor(t.name, t.tensor_type.name, shape, i)

    def _orig_shape(self, name: str) -> tuple[int, ...] | None:
        """``comfy.gguf.orig_shape.<name>`` (ComfyUI-GGUF's converters store a 5-D tensor's shape
        there, the tensor itself flattened to fewer dimensions)."""
        value = self.field(f"comfy.gguf.orig_shape.{name}")
        return tuple(int(v) for v in value) if value is not None else None

    def has_field(self, key: str) -> bool:
        """Whether the metadata has ``key`` (its value not decoded)."""
        return self._reader.get_field(key) is not None

    def field(self, key: str) -> Any:
        """A metadata value: a string, a number, a list of them, or None when absent."""
        f = self._reader.get_field(key)
        if f is None:
            return None
        import gguf  # deferred as above

        parts = [f.parts[i] for i in f.data]
        if f.types and f.types[0] == gguf.GGUFValueType.STRING:
            return str(bytes(parts[-1]), encoding="utf-8")
        if f.types and f.types[0] == gguf.GGUFValueType.ARRAY:
            if len(f.types) > 1 and f.types[1] == gguf.GGUFValueType.STRING:
                return [str(bytes(p), encoding="utf-8") for p in parts]
            return [p[0].item() for p in parts]
        return parts[-1][0].item()

    @property
    def architecture(self) -> str | None:
        """``general.architecture`` (``ltxv`` for the LTX-2 transformer files, ``gemma3`` for Gemma 3)."""
        return self.field("general.architecture")

    def read(self, name: str) -> torch.Tensor:
        """The bytes of tensor ``name`` as a CPU ``uint8`` tensor over the memory-mapped file
        (shape :func:`packed_shape`; not writable: copy before changing it).

        Raises:
            KeyError: no such tensor. GGMLFormatError: its type is not read here.
        """
        t = self.tensors[name]
        if t.qtype not in BLOCK_SHAPES:
            raise GGMLFormatError(f"{self.path}: tensor {name} is {t.qtype}, which ltx_mgpu does not read; "
                                  f"readable: {', '.join(READABLE)}. Use a file quantized to one of them")
        raw = self._reader.tensors[t.index].data
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
            data = torch.from_numpy(np.asarray(raw).reshape(-1).view(np.uint8))
        return data.reshape(packed_shape(t.qtype, t.shape))
