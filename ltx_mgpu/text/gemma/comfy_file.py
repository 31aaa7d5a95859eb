"""A ComfyUI single-file Gemma 3 opened for reading: :func:`open_comfy_file`.

Both the bf16 loader (``ltx_mgpu.text.encoder.loading``) and the NF4 source reader
(``ltx_mgpu.text.nf4.source``) read a ComfyUI file through :class:`ComfyGemmaFile`: its text-tower
tensors under ``Gemma3TextModel``'s names (``model.`` stripped; the vision tower and projector
are ``ltx_mgpu.text.gemma.vision``'s), their dense shapes, the embedded tokenizer, and each
tensor's dense value. A plain tensor is read as stored; a quantized layer
(``ltx_mgpu.text.gemma.sources.comfy_file_quant``: nvfp4, fp8, int8) is dequantized by
``ltx_mgpu.quantized.dequant`` straight into the dtype the model computes in. That is the weight
ComfyUI computes with for activations of that dtype: its layer casts the quantized weight to the
input's dtype and then dequantizes it (``comfy/ops.py`` ``cast_bias_weight``:
``s.weight.to(dtype=...)``, then ``dequantize()``), so a bf16 model gets ComfyUI's bf16 weights
and an fp32 one its fp32 weights, bit for bit.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from ltx_mgpu.finite import is_finite
from ltx_mgpu.quantized.dequant import dequantize, load_decoder
from ltx_mgpu.quantized.layers import AUX_SUFFIXES, FileQuant
from ltx_mgpu.text.gemma.sources import GemmaWeightsError, comfy_file_quant, comfy_text_config

__all__ = ["ComfyGemmaFile", "LazyDense", "open_comfy_file"]



@dataclass(frozen=True)
class ComfyGemmaFile:
    """A ComfyUI Gemma 3 file's text tower, headers read (no weights).

    Attributes:
        path: the file.
        metadata: the safetensors header metadata.
        quant: its quantized text layers (``ltx_mgpu.quantized.layers.FileQuant``).
        shapes: ``Gemma3TextModel`` parameter name -> dense shape (nvfp4's packed columns
            counted twice).
        spm: the embedded SentencePiece model's bytes, or ``None``.
    """

    path: Path
    metadata: dict[str, str]
    quant: FileQuant
    shapes: dict[str, tuple[int, ...]]
    spm: bytes | None = field(default=None, repr=False)

    def config(self) -> Any:
        """The ``Gemma3TextConfig`` (``ltx_mgpu.text.gemma.sources.comfy_text_config``)."""
        return comfy_text_config(self.metadata, {"model." + k: v for k, v in self.shapes.items()}, self.path)

    def read(self, name: str, device: torch.device | str = "cpu",
             dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
        """Parameter ``name``'s dense value on ``device``: a plain tensor as stored, a quantized
        layer dequantized there into ``dtype`` (bf16, fp16 or fp32: the model's compute dtype).
        The file is opened for this tensor only.

        Every value is checked finite as it is read (on ``device``): a NaN or infinite weight, or
        a scale that makes one, would give NaN embeddings for every prompt.

        Raises:
            KeyError: no such text-tower tensor.
            GemmaWeightsError: NaN or infinite values (names the tensor and, for a quantized layer,
                its format: a damaged scale).
        """
        key = "model." + name
        if name not in self.shapes:
            raise KeyError(f"{self.path}: no text-tower tensor {key}")
        quant = self.quant.of(key)
        with safe_open(str(self.path), framework="pt", device="cpu") as f:
            if quant is None:
                w = f.get_tensor(key).to(device)
            else:
                layer = key[: -len(".weight")]
                parts = {"weight": f.get_tensor(key), **{p: f.get_tensor(f"{layer}.{p}") for p in quant.parts}}
        if quant is not None:
            w = dequantize(quant, parts, dtype, device=device)
        if not is_finite(w):
            stored = f" ({quant.describe()}: its scales or values)" if quant is not None else ""
            raise GemmaWeightsError(f"{self.path}: {key}{stored} holds NaN or infinite values; the file is damaged: "
                                    "download it again")
        return w

    def lazy(self, name: str, device: torch.device | str = "cpu", dtype: torch.dtype = torch.bfloat16) -> LazyDense:
        """:meth:`read` deferred until transformers' loader indexes it."""
        return LazyDense(self, name, device, dtype)


@dataclass(frozen=True)
class LazyDense:
    """One tensor of a :class:`ComfyGemmaFile`, read (and dequantized into ``dtype`` on
    ``device``) when indexed: ``[...]`` like a safetensors slice, which is all transformers'
    loader uses."""

    file: ComfyGemmaFile
    name: str
    device: torch.device | str = "cpu"
    dtype: torch.dtype = torch.bfloat16

    def __getitem__(self, index: Any) -> torch.Tensor:
        return self.file.read(self.name, self.device, self.dtype)[index]


def open_comfy_file(path: str | os.PathLike) -> ComfyGemmaFile:
    """Open a ComfyUI Gemma 3 file: header, markers and the embedded tokenizer only.

    Raises:
        GemmaFormatError: as ``ltx_mgpu.text.gemma.sources.comfy_file_quant`` (a storage ltx_mgpu
            cannot read), naming the tensor and what to use instead.
    """
    p = Path(path)
    quant = comfy_file_quant(p)
    if quant.layers:  # before any loader thread dequantizes a layer (load_decoder says why)
        load_decoder()
    shapes: dict[str, tuple[int, ...]] = {}
    with safe_open(str(p), framework="pt", device="cpu") as f:
        keys = set(f.keys())
        meta = dict(f.metadata() or {})
        spm = f.get_tensor("spiece_model").numpy().tobytes() if "spiece_model" in keys else None
        for key in sorted(keys):
            if not key.startswith("model.") or key.endswith(AUX_SUFFIXES):
                continue
            stored = tuple(f.get_slice(key).get_shape())
            q = quant.of(key)
            shapes[key[len("model."):]] = q.logical_shape(stored) if q is not None else stored
    return ComfyGemmaFile(p, meta, quant, shapes, spm)
