"""The ``Gemma3TextConfig`` of any Gemma 3 source, from its headers only: :func:`read_gemma_config`.

A snapshot's ``config.json`` (through ``transformers.AutoConfig``; a multimodal one's text
config), the header of a ComfyUI or GGUF file, the manifest of an NF4 artifact. No weights are
read.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from ltx_mgpu.text.gemma.comfy_file import open_comfy_file
from ltx_mgpu.text.gemma.gguf_file import open_gemma_gguf
from ltx_mgpu.text.gemma.sources import detect_gemma_format, gemma_source_files
from ltx_mgpu.text.nf4.artifact import read_manifest

__all__ = ["read_gemma_config"]


def read_gemma_config(path: str | os.PathLike) -> Any:
    """The ``Gemma3TextConfig`` of the Gemma 3 source at ``path`` (module doc). The source's
    files (tokenizer included) are checked too.

    Raises:
        FileNotFoundError, GemmaFormatError (a ValueError): as ``gemma_source_files``.
    """
    p = Path(path)
    fmt = detect_gemma_format(p)
    gemma_source_files(p)  # raises when the tokenizer is missing
    if fmt == "hf_snapshot":
        from transformers import AutoConfig  # deferred: transformers takes seconds to import

        cfg = AutoConfig.from_pretrained(str(p))
        return cfg.text_config if cfg.model_type == "gemma3" else cfg
    if fmt == "comfy_file":
        return open_comfy_file(p).config()
    if fmt == "gguf_file":
        return open_gemma_gguf(p).config()
    from transformers import Gemma3TextConfig  # deferred: transformers takes seconds to import

    return Gemma3TextConfig.from_dict(read_manifest(p)["config"])
