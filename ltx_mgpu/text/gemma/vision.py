"""Gemma 3's vision tower (SigLIP + the multi-modal projector) from a Gemma source:
:func:`find_vision`, :func:`load_vision`, :class:`GemmaVision`.

What ComfyUI 0.20.1 runs for an image in a Gemma 3 prompt (``Gemma3_12B.preprocess_embed`` and
``Gemma3MultiModalProjector`` in ``comfy/text_encoders/llama.py``, ``CLIPVision`` in
``comfy/clip_model.py``): the SigLIP vision transformer's last hidden state (after its final
LayerNorm), average-pooled to ``mm_tokens_per_image`` tokens, RMS-normed and projected to the text
width. The modules here are transformers' own (``SiglipVisionModel``,
``Gemma3MultiModalProjector``), loaded with the source's weights, in float32: ComfyUI runs the
vision tower on a float32 image with its weights cast to float32 whatever the file's dtype
(``comfy.ops`` casts a weight to its input's dtype). Two settings follow ComfyUI where it differs
from transformers' Gemma 3 config: SigLIP's LayerNorms use epsilon 1e-5 (``torch.nn.LayerNorm``'s
default, which ComfyUI's ``CLIPLayer`` and ``post_layernorm`` use; Gemma 3's config says 1e-6),
and the projector's RMSNorm the text tower's ``rms_norm_eps`` (transformers takes the vision
LayerNorm's).

Where the weights are:

* a ComfyUI file (``gemma_3_12B_it*.safetensors``): ``vision_model.*`` (``embeddings``,
  ``encoder.layers.N``, ``post_layernorm``; transformers' ``SiglipVisionTransformer`` names) and
  ``multi_modal_projector.{mm_input_projection_weight, mm_soft_emb_norm.weight}``; quantized layers
  (a ``comfy_quant`` marker) dequantized to float32. Sizes from the tensors' shapes (width, MLP
  width, layers, patch size; image size from the position table), heads and tokens per image
  from the header's :data:`VISION_CONFIG_METADATA_KEY` (``{"vision_config": ...,
  "mm_tokens_per_image": n}``) when present, else ComfyUI's (16 heads, 256 tokens per image:
  ``GEMMA3_VISION_CONFIG``, ``Gemma3_12B_Config``);
* a Hugging Face snapshot of ``Gemma3ForConditionalGeneration``: ``vision_tower.`` (optionally
  ``vision_model.`` after it, or ``model.`` before it) and ``multi_modal_projector.`` (or
  ``model.multi_modal_projector.``), the sizes from ``config.json``;
* a GGUF file (llama.cpp keeps the vision tower in a separate ``mmproj`` file), an NF4 artifact
  and a text-only snapshot (``Gemma3ForCausalLM``) have none: :func:`find_vision` returns None.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

import torch
from safetensors import safe_open
from torch import nn

from ltx_mgpu.files import json_metadata
from ltx_mgpu.finite import is_finite
from ltx_mgpu.quantized.dequant import dequantize, load_decoder
from ltx_mgpu.quantized.layers import AUX_SUFFIXES, FileQuant, QuantFormatError, read_file_quant
from ltx_mgpu.text.gemma.sources import GemmaFormatError, GemmaWeightsError, detect_gemma_format, safetensors_keys

__all__ = ["VISION_CONFIG_METADATA_KEY", "COMFY_LAYER_NORM_EPS", "VisionSource", "GemmaVision", "find_vision",
           "load_vision", "vision_weights"]

#: A ComfyUI file's header entry with the vision tower's config (JSON) where its sizes are not
#: Gemma 3 12B's in what the shapes do not tell (heads, tokens per image).
VISION_CONFIG_METADATA_KEY = "ltx_mgpu_gemma_vision_config"
#: ComfyUI's SigLIP LayerNorm epsilon (``torch.nn.LayerNorm``'s default; module doc).
COMFY_LAYER_NORM_EPS = 1e-5
#: ComfyUI's Gemma 3 vision settings the shapes do not tell (``GEMMA3_VISION_CONFIG``, ``Gemma3_12B_Config``).
_COMFY_HEADS, _COMFY_TOKENS_PER_IMAGE = 16, 256
#: Stored dtypes read as they are (safetensors' names).
_PLAIN = ("BF16", "F16", "F32")
#: Stored by some exports, not weights of the tower: SigLIP's attention-pooling head, unused by
#: Gemma 3 (``vision_use_head`` off; ComfyUI's ``CLIPVision`` has none and ignores it), and the
#: position ids (``arange``, a buffer transformers makes and 4.x-era exports wrote; int64).
_UNUSED = ("tower.head.", "tower.embeddings.position_ids")
#: Stored prefix -> our prefix (``tower.`` + transformers' ``SiglipVisionModel`` names, ``projector.``).
_PREFIXES = (("model.vision_tower.vision_model.", "tower."), ("vision_tower.vision_model.", "tower."),
             ("model.vision_tower.", "tower."), ("vision_tower.", "tower."), ("vision_model.", "tower."),
             ("model.multi_modal_projector.", "projector."), ("multi_modal_projector.", "projector."))


@dataclass(frozen=True)
class VisionSource:
    """Where a Gemma source keeps its vision tower (headers read, no weights).

    Attributes:
        path: the source (file or directory).
        keys: our name (``tower.<SiglipVisionModel name>`` or ``projector.<name>``) ->
            (safetensors file, stored key).
        vision_config: the ``SiglipVisionConfig`` (LayerNorm epsilon ComfyUI's).
        mm_tokens_per_image: image tokens after the projector's pooling.
        quant: a ComfyUI file's quantized vision layers (by stored key), else None.
    """

    path: Path
    keys: dict[str, tuple[Path, str]]
    vision_config: Any
    mm_tokens_per_image: int
    quant: FileQuant | None = None

    @property
    def image_size(self) -> int:
        """The square side, in pixels, that the vision tower takes."""
        return int(self.vision_config.image_size)


def _ours(key: str) -> str | None:
    for stored, ours in _PREFIXES:
        if key.startswith(stored):
            return ours + key[len(stored):]
    return None


def _vision_keys(files: list[Path]) -> dict[str, tuple[Path, str]]:
    keys: dict[str, tuple[Path, str]] = {}
    for f in files:
        names, _ = safetensors_keys(f)
        for k in names:
            ours = _ours(k)
            if ours is not None and not k.endswith(AUX_SUFFIXES) and not ours.startswith(_UNUSED):
                keys[ours] = (f, k)
    return keys


def _each(keys: dict[str, tuple[Path, str]]) -> Iterator[tuple[str, tuple[Path, str], Any]]:
    """``(our name, (file, key), safetensors slice)`` for each of ``keys``, each file opened once."""
    by_file: dict[Path, list[str]] = {}
    for ours, (f, _) in keys.items():
        by_file.setdefault(f, []).append(ours)
    for f, names in by_file.items():
        with safe_open(str(f), framework="pt", device="cpu") as sf:
            for ours in names:
                yield ours, keys[ours], sf.get_slice(keys[ours][1])


def _shapes(keys: dict[str, tuple[Path, str]], quant: FileQuant | None) -> dict[str, tuple[int, ...]]:
    """Our name -> dense shape; every tensor without a quantization marker checked to be bf16,
    fp16 or fp32 (another dtype would need a scale the file does not name)."""
    out = {}
    for ours, (f, k), piece in _each(keys):
        q = quant.of(k) if quant is not None else None
        stored, kind = tuple(piece.get_shape()), piece.get_dtype()
        if q is None and kind not in _PLAIN:
            raise GemmaFormatError(f"{f}: vision tensor {k} is stored as {kind} without a ComfyUI comfy_quant marker "
                                   "saying how to read it; use a Gemma 3 file whose vision tower is bf16, fp16, fp32 "
                                   "or marked, or disconnect the image")
        out[ours] = q.logical_shape(stored) if q is not None else stored
    return out


def vision_weights(source: VisionSource) -> dict[str, tuple[tuple[int, ...], str | None]]:
    """Our name (``tower.<SiglipVisionModel name>`` / ``projector.<name>``) -> (dense shape, the
    safetensors dtype the source stores it in: ``"BF16"``, ``"F16"`` or ``"F32"``; None for a
    quantized layer) of each vision weight (headers only).

    Raises:
        GemmaFormatError: a tensor of a kind ltx_mgpu cannot read (as :func:`find_vision`).
    """
    shapes = _shapes(source.keys, source.quant)
    out = {}
    for ours, (_, k), piece in _each(source.keys):
        q = source.quant.of(k) if source.quant is not None else None
        out[ours] = (shapes[ours], None if q is not None else piece.get_dtype())
    return out


def _comfy_config(path: Path, meta: dict[str, str], shapes: dict[str, tuple[int, ...]]) -> tuple[Any, int]:
    from transformers import SiglipVisionConfig

    hint = "; export the file again or remove the metadata entry"
    stored = json_metadata(meta, VISION_CONFIG_METADATA_KEY, str(path), GemmaFormatError, hint) or {}
    try:
        hidden, channels, patch, _ = shapes["tower.embeddings.patch_embedding.weight"]
        positions = shapes["tower.embeddings.position_embedding.weight"][0]
        intermediate = shapes["tower.encoder.layers.0.mlp.fc1.weight"][0]
    except (KeyError, ValueError):
        raise GemmaFormatError(f"{path}: its vision tower lacks the patch embedding, the position table or a first "
                               "layer (vision_model.embeddings.*, vision_model.encoder.layers.0.mlp.fc1.weight); the "
                               "file is damaged or not Gemma 3's") from None
    side = math.isqrt(positions)
    layers = len({k.split(".")[3] for k in shapes if k.startswith("tower.encoder.layers.")})
    given = dict(stored.get("vision_config") or {})
    config = SiglipVisionConfig(**{**given, "hidden_size": hidden, "intermediate_size": intermediate,
                                   "num_hidden_layers": layers, "num_channels": channels, "patch_size": patch,
                                   "image_size": side * patch,
                                   "num_attention_heads": given.get("num_attention_heads", _COMFY_HEADS),
                                   "hidden_act": "gelu_pytorch_tanh", "vision_use_head": False})
    return config, int(stored.get("mm_tokens_per_image", _COMFY_TOKENS_PER_IMAGE))


def find_vision(path: str | os.PathLike) -> VisionSource | None:
    """The vision tower of the Gemma source at ``path``, or None when it has none (module doc).
    Reads headers, ``config.json`` and quantization markers only.

    Raises:
        FileNotFoundError, GemmaFormatError: as ``detect_gemma_format``; a vision tower without
            its projector or a layer ltx_mgpu cannot read.
    """
    from transformers import SiglipVisionConfig

    p = Path(path)
    fmt = detect_gemma_format(p)
    quant = None
    if fmt == "comfy_file":
        files = [p]
        keys = _vision_keys(files)
        if not keys:
            return None
        try:
            quant = read_file_quant(p, prefix="vision_model.")
        except QuantFormatError as e:
            raise GemmaFormatError(str(e)) from None
        if quant.layers:
            load_decoder()
        _, meta = safetensors_keys(p)
        config, tokens = _comfy_config(p, meta, _shapes(keys, quant))
    elif fmt == "hf_snapshot":
        files = sorted(p.glob("*.safetensors"))
        keys = _vision_keys(files)
        raw = json.loads((p / "config.json").read_text(encoding="utf-8"))
        if not keys or not isinstance(raw.get("vision_config"), dict):
            return None
        config = SiglipVisionConfig(**raw["vision_config"])
        tokens = int(raw.get("mm_tokens_per_image", _COMFY_TOKENS_PER_IMAGE))
    else:
        return None
    if not any(k.startswith("projector.") for k in keys):
        raise GemmaFormatError(f"{p}: it has a vision tower but no multi-modal projector (multi_modal_projector.*); "
                               "the file is incomplete: use a complete Gemma 3 file")
    config.layer_norm_eps = COMFY_LAYER_NORM_EPS
    per_side = config.image_size // config.patch_size
    root = math.isqrt(tokens)
    if root * root != tokens or root == 0 or per_side % root:
        raise GemmaFormatError(f"{p}: {tokens} image tokens per image do not pool the vision tower's "
                               f"{per_side}x{per_side} patches (a square number whose side divides {per_side} is "
                               f"needed); store the right mm_tokens_per_image in the config")
    return VisionSource(p, keys, config, tokens, quant)


class GemmaVision(nn.Module):
    """SigLIP and Gemma 3's projector (transformers'), float32: images -> soft tokens.

    Args:
        source: :func:`find_vision`'s result.
        text_config: the text tower's ``Gemma3TextConfig`` (its width and ``rms_norm_eps``).
    """

    def __init__(self, source: VisionSource, text_config: Any):
        from transformers import Gemma3Config, SiglipVisionModel
        from transformers.models.gemma3.modeling_gemma3 import Gemma3MultiModalProjector

        super().__init__()
        self.source = source
        self.tower = SiglipVisionModel(source.vision_config)
        self.projector = Gemma3MultiModalProjector(Gemma3Config(
            text_config=text_config.to_dict(), vision_config=source.vision_config.to_dict(),
            mm_tokens_per_image=source.mm_tokens_per_image))
        self.projector.mm_soft_emb_norm.eps = float(text_config.rms_norm_eps)  # ComfyUI's (module doc)

    @property
    def image_size(self) -> int:
        return self.source.image_size

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:
        """``pixels`` ``[B, 3, S, S]`` (``ltx_mgpu.text.generate.image.vision_pixels``) ->
        ``[B * mm_tokens_per_image, D]`` float32 soft tokens, image after image (ComfyUI splices
        all of them where the prompt's ``<image_soft_token>`` was)."""
        p = next(self.parameters())
        hidden = self.tower(pixel_values=pixels.to(p.device, torch.float32)).last_hidden_state
        return self.projector(hidden).reshape(-1, self.projector.mm_input_projection_weight.shape[1])


def _read(source: VisionSource, stored: tuple[Path, str], piece: Any, device: torch.device) -> torch.Tensor:
    """One weight as float32 on ``device`` (``piece``: its open safetensors slice)."""
    f, key = stored
    q = source.quant.of(key) if source.quant is not None else None
    if q is None:
        w = piece[:].to(device=device, dtype=torch.float32)
    else:
        layer = key[: -len(".weight")]
        with safe_open(str(f), framework="pt", device="cpu") as sf:
            parts = {"weight": sf.get_tensor(key), **{n: sf.get_tensor(f"{layer}.{n}") for n in q.parts}}
        w = dequantize(q, parts, torch.float32, device=device)
    if not is_finite(w):
        raise GemmaWeightsError(f"{f}: {key} holds NaN or infinite values; the file is damaged: download it again")
    return w


def load_vision(source: VisionSource, text_config: Any, device: torch.device | str = "cpu") -> GemmaVision:
    """:class:`GemmaVision` with ``source``'s weights on ``device``, float32, eval mode.

    Raises:
        GemmaWeightsError: a weight missing, of a shape the config has no place for, or not finite.
    """
    device = torch.device(device)
    with torch.device(device):
        model = GemmaVision(source, text_config)
    state = {k: _read(source, stored, piece, device) for k, stored, piece in _each(source.keys)}
    persistent = set(model.state_dict())
    missing = sorted(persistent - set(state))
    stray = sorted(set(state) - persistent)
    if missing or stray:
        raise GemmaWeightsError(f"{source.path}: the vision tower's weights do not match its config: missing "
                                f"{missing[:8]}, unexpected {stray[:8]}; use a complete Gemma 3 file")
    try:
        model.load_state_dict(state, strict=False)
    except RuntimeError as e:
        raise GemmaWeightsError(f"{source.path}: the vision tower's weights do not match its config "
                                f"({str(e).splitlines()[-1][:200]}); use a complete Gemma 3 file") from None
    return model.to(torch.float32).eval().requires_grad_(False)
