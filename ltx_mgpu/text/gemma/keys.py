"""How stored Gemma 3 tensors map onto ``Gemma3TextModel``'s weights: key names and scaled fp8.

* :data:`SNAPSHOT_KEY_MAPPING`: the prefixes a Hugging Face snapshot's multimodal or text-only
  keys carry before the text tower's own names (transformers' ``key_mapping`` form);
* :data:`TEXT_KEY`: the text tower's own key names (decoder layers, embedding, final norm);
* :data:`COMFY_AUX_SUFFIXES`: the auxiliary tensors of a ComfyUI single file (scales, quant
  markers) that are not weights themselves;
* :class:`ScaledFp8`: an fp8 tensor read lazily as ``w.float() * scale``.

Both the bf16 loader (:mod:`ltx_mgpu.text.gemma.loading`) and the NF4 source reader
(:mod:`ltx_mgpu.text.nf4.source`) read weights through these.
"""

from __future__ import annotations

import re
from typing import Any

import torch

__all__ = ["SNAPSHOT_KEY_MAPPING", "TEXT_KEY", "COMFY_AUX_SUFFIXES", "ScaledFp8"]

#: Multimodal / text-only prefixes stripped to reach Gemma3TextModel keys.
SNAPSHOT_KEY_MAPPING = {r"^(?:language_model\.model|model\.language_model|model)\.": ""}
#: A text-tower key (after :data:`SNAPSHOT_KEY_MAPPING`).
TEXT_KEY = re.compile(r"^(?:layers\.\d+\.|embed_tokens\.|norm\.)")
#: Suffixes of a ComfyUI file's auxiliary tensors (fp8 scales, per-layer quantization markers).
COMFY_AUX_SUFFIXES = (".weight_scale", ".scale_weight", ".input_scale", ".scale_input", ".comfy_quant")


class ScaledFp8:
    """Lazy fp8 -> fp32 dequantisation of one safetensors slice: ``w.float() * scale``.

    Exposes ``[...]`` like a safetensors slice, which is all transformers' loader uses.
    """

    def __init__(self, slice_: Any, scale: torch.Tensor | None):
        self._slice, self._scale = slice_, scale

    def __getitem__(self, index: Any) -> torch.Tensor:
        w = self._slice[...].to(torch.float32)
        if self._scale is not None:
            w = w * self._scale.to(torch.float32)
        return w[index]
