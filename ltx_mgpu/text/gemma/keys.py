"""How stored Gemma 3 tensor names map onto ``Gemma3TextModel``'s weights.

* :data:`SNAPSHOT_KEY_MAPPING`: the prefixes a Hugging Face snapshot's multimodal or text-only
  keys carry before the text tower's own names (transformers' ``key_mapping`` form);
* :data:`TEXT_KEY`: the text tower's own key names (decoder layers, embedding, final norm).

A ComfyUI file's names are ``model.`` + the text tower's; its quantized layers and their scales
are ``ltx_mgpu.text.gemma.comfy_file``'s. The bf16 loader (:mod:`ltx_mgpu.text.encoder.loading`)
and the NF4 source reader (:mod:`ltx_mgpu.text.nf4.source`) read snapshots through these.
"""

from __future__ import annotations

import re

__all__ = ["SNAPSHOT_KEY_MAPPING", "TEXT_KEY"]

#: Multimodal / text-only prefixes stripped to reach Gemma3TextModel keys.
SNAPSHOT_KEY_MAPPING = {r"^(?:language_model\.model|model\.language_model|model)\.": ""}
#: A text-tower key (after :data:`SNAPSHOT_KEY_MAPPING`).
TEXT_KEY = re.compile(r"^(?:layers\.\d+\.|embed_tokens\.|norm\.)")
