"""The loaded Gemma 3 text tower: :class:`GemmaTextTower`, the type every text module takes.

Loading one is :func:`ltx_mgpu.text.encoder.loading.load_gemma_text_tower`'s (bf16 sources) and
:mod:`ltx_mgpu.text.nf4.load`'s (NF4); running it is :mod:`ltx_mgpu.text.gemma.forward`'s.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ltx_mgpu.text.gemma.sources import source_identity

__all__ = ["GemmaTextTower", "layers_device"]


def layers_device(model: nn.Module) -> torch.device:
    """The device of the first decoder layer (where hidden states are computed)."""
    return next(model.layers[0].parameters()).device


@dataclass
class GemmaTextTower:
    """A loaded Gemma 3 text tower and its tokenizer.

    Attributes:
        model: ``Gemma3TextModel`` in eval mode (weights in the requested dtype, RoPE buffers fp32).
        tokenizer: HF tokenizer: left padding, ``<bos>`` prepended, no ``<eos>``.
        config: the ``Gemma3TextConfig``.
        format: ``"hf_snapshot"``, ``"comfy_file"``, ``"gguf_file"`` or ``"nf4_artifact"`` (the
            source's format).
        path: the source path as given.
        files: the files whose bytes define the outputs (weights, config, tokenizer).
        weights: what is loaded: ``"bf16"`` (plain weights in the dtype; a GGUF file's quantized
            layers packed, ``ltx_mgpu.quantized.packed``, computing in it) or ``"nf4"`` (bitsandbytes
            ``Linear4bit`` projections; ``ltx_mgpu.text.nf4.quantize``), whatever was asked for.
    """

    model: Any
    tokenizer: Any
    config: Any
    format: str
    path: Path
    files: tuple[Path, ...] = field(default=())
    weights: str = "bf16"

    @functools.cached_property
    def identity(self) -> str:
        """Content identity of the source (see :func:`gemma_identity`); computed on first use."""
        return source_identity(Path(self.path), self.files)

    @property
    def num_hidden_states(self) -> int:
        """``L = num_hidden_layers + 1`` (embedding output + one per decoder layer); 49 for 12B."""
        return int(self.config.num_hidden_layers) + 1

    @property
    def hidden_size(self) -> int:
        """Hidden width ``D`` (3840 for Gemma 3 12B)."""
        return int(self.config.hidden_size)

    @property
    def device(self) -> torch.device:
        """Where the decoder layers run (the first layer's device under an Accelerate map; the
        embedding table may be elsewhere: ``ltx_mgpu.text.gemma.forward.offload_embeddings``)."""
        return layers_device(self.model)
