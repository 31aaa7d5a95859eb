"""Stream a Gemma 3 source tensor by tensor, for NF4 quantization.

Both source formats of ``ltx_mgpu.text.gemma.sources`` are read with safetensors' ``safe_open``
one tensor at a time (the file is reopened per tensor, so at most one tensor of the source is
mapped or held in host memory), under the key handling of ``ltx_mgpu.text.encoder.loading``: the
multimodal / text-only prefixes of an HF snapshot are stripped (vision tower, projector and
``lm_head`` are not text-tower keys and are never read); a ComfyUI file is read through
``ltx_mgpu.text.gemma.comfy_file``: its quantized layers (nvfp4 ``fp4_mixed``, fp8, int8) are
dequantized into bf16 as ComfyUI does, on the device that then quantizes them to NF4, so NF4 is
made from the dense weights the bf16 loader computes with.
"""

from __future__ import annotations

import re
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator

import torch
from safetensors import safe_open

from ltx_mgpu.text.gemma.comfy_file import ComfyGemmaFile, open_comfy_file
from ltx_mgpu.text.gemma.keys import SNAPSHOT_KEY_MAPPING, TEXT_KEY
from ltx_mgpu.text.gemma.sources import (
    SUPPORTED_FORMATS,
    GemmaFormatError,
    GemmaWeightsError,
    comfy_tokenizer_files,
    detect_gemma_format,
    find_tokenizer_files,
    no_tokenizer_error,
)
from ltx_mgpu.text.gemma.tokenizer import check_tokenizer, comfy_file_tokenizer, load_tokenizer

__all__ = ["GemmaSource", "open_source"]

_PLAIN_DTYPES = ("BF16", "F16", "F32")


@dataclass
class GemmaSource:
    """A Gemma 3 source opened for streaming (headers read, no weights).

    Attributes:
        path: the snapshot directory or ComfyUI file.
        format: ``"hf_snapshot"`` or ``"comfy_file"``.
        config: its ``Gemma3TextConfig``.
        shapes: ``Gemma3TextModel`` parameter name -> dense shape, from the safetensors headers.
        locations: the same names -> ``(file, key in the file)``.
        comfy: the opened ComfyUI file (``"comfy_file"`` only), which reads its tensors.
    """

    path: Path
    format: str
    config: Any
    shapes: dict[str, tuple[int, ...]]
    locations: dict[str, tuple[Path, str]]
    _spm: bytes | None = field(default=None, repr=False)
    comfy: ComfyGemmaFile | None = field(default=None, repr=False)

    def read(self, name: str, device: torch.device | str = "cpu") -> torch.Tensor:
        """The tensor of parameter ``name`` on ``device``: as stored, or, for a ComfyUI file's
        quantized layer, dequantized there into bf16, NF4's compute dtype (``ComfyGemmaFile.read``:
        the weights the bf16 loader computes with). The file is opened for this tensor only."""
        if self.comfy is not None:
            return self.comfy.read(name, device, torch.bfloat16)
        file, key = self.locations[name]
        with safe_open(str(file), framework="pt", device="cpu") as f:
            return f.get_tensor(key).to(device)

    @property
    def stored_as(self) -> str:
        """The quantized formats a ComfyUI file stores (``"float8_e4m3fn,nvfp4"``); ``""`` for
        plain weights and for snapshots."""
        return self.comfy.quant.describe() if self.comfy is not None else ""

    def tokenizer(self) -> Any:
        """The source's checked tokenizer (left padding, ``<bos>``, no ``<eos>``)."""
        if self.format == "hf_snapshot":
            found = find_tokenizer_files(self.path)
            if found is None:
                raise no_tokenizer_error(self.path)
            return check_tokenizer(load_tokenizer(found), self.path)
        tok, _ = comfy_file_tokenizer(self.path, self._spm)
        return check_tokenizer(tok, self.path)

    def write_tokenizer(self, directory: Path) -> dict[str, Any]:
        """Put the source's tokenizer files into ``directory`` (ComfyUI's embedded
        ``spiece_model`` becomes ``tokenizer.model``).

        Returns:
            ``{"kind": "tokenizers" | "sentencepiece", "files": [names]}`` for the manifest.
        """
        if self.format == "comfy_file" and self._spm is not None:
            (directory / "tokenizer.model").write_bytes(self._spm)
            return {"kind": "sentencepiece", "files": ["tokenizer.model"]}
        found = find_tokenizer_files(self.path) if self.format == "hf_snapshot" else comfy_tokenizer_files(self.path)
        if found is None:
            raise no_tokenizer_error(self.path)
        for f in found.files:
            shutil.copyfile(f, directory / f.name)
        return {"kind": found.kind, "files": sorted(f.name for f in found.files)}


def _text_config(d: Path) -> Any:
    from transformers import AutoConfig

    cfg = AutoConfig.from_pretrained(str(d))
    return cfg.text_config if cfg.model_type == "gemma3" else cfg


def _open_snapshot(d: Path) -> GemmaSource:

    (pattern, repl), = SNAPSHOT_KEY_MAPPING.items()
    shapes: dict[str, tuple[int, ...]] = {}
    locations: dict[str, tuple[Path, str]] = {}
    for file in sorted(d.glob("*.safetensors")):
        with safe_open(str(file), framework="pt", device="cpu") as f:
            for key in f.keys():  # noqa: SIM118 - safe_open is not iterable
                name = re.sub(pattern, repl, key, count=1)
                if not TEXT_KEY.match(name):
                    continue  # vision tower, projector, lm_head: never read
                if name in locations:
                    raise GemmaWeightsError(
                        f"{d}: the text-tower weight {name} is stored twice "
                        f"({locations[name][0].name}:{locations[name][1]} "
                        f"and {file.name}:{key}); the snapshot mixes two key layouts, re-download it"
                    )
                sl = f.get_slice(key)
                if sl.get_dtype() not in _PLAIN_DTYPES:
                    raise GemmaFormatError(
                        f"{file}: tensor {key} is stored as {sl.get_dtype()}; NF4 quantization reads bf16, fp16 "
                        f"or fp32 snapshots. {SUPPORTED_FORMATS}"
                    )
                shapes[name] = tuple(sl.get_shape())
                locations[name] = (file, key)
    return GemmaSource(d, "hf_snapshot", _text_config(d), shapes, locations)


def _open_comfy(path: Path) -> GemmaSource:
    comfy = open_comfy_file(path)
    locations = {name: (path, "model." + name) for name in comfy.shapes}
    return GemmaSource(path, "comfy_file", comfy.config(), dict(comfy.shapes), locations, comfy.spm, comfy)


def open_source(path: str | Path) -> GemmaSource:
    """Open a Gemma 3 source (HF snapshot directory or ComfyUI file, quantized layers included)
    for streaming.

    Reads file names, ``config.json`` and safetensors headers only.

    Raises:
        FileNotFoundError: ``path`` does not exist.
        GemmaFormatError: unsupported source or tensor dtype; an NF4 artifact (already quantized).
        GemmaWeightsError: a text-tower weight stored twice.
    """
    p = Path(path)
    fmt = detect_gemma_format(p)
    if fmt == "nf4_artifact":
        raise GemmaFormatError(
            f"{p} is already an ltx_mgpu NF4 artifact; quantize from the bf16 Gemma 3 source (HF snapshot directory "
            "or ComfyUI file), or load the artifact directly"
        )
    return _open_snapshot(p) if fmt == "hf_snapshot" else _open_comfy(p)


def iter_source(source: GemmaSource, names: list[str],
                device: torch.device | str = "cpu") -> Iterator[tuple[str, torch.Tensor]]:
    """Yield ``(name, tensor on device)`` for ``names`` in that order, one tensor read at a time."""
    for name in names:
        yield name, source.read(name, device)
