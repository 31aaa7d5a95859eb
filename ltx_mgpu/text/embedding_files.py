"""Embeddings in a file: what ``python -m ltx_mgpu encode --out`` writes, one safetensors file
with tensors ``prompt_<i>`` (``[T_i, D]`` float32) and metadata ``format``
(``ltx_mgpu.embeddings/1``), ``prompts`` (JSON list), ``version`` and ``dropped_tokens`` (JSON
list)."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Sequence

from safetensors import safe_open
from safetensors.torch import save

from ltx_mgpu.files import make_parent, umask_mode, write_atomically
from ltx_mgpu.text.features import PromptEmbedding

__all__ = ["save_embeddings", "load_embeddings"]

FORMAT = "ltx_mgpu.embeddings/1"


def save_embeddings(path: str | os.PathLike, prompts: Sequence[str], embeddings: Sequence[PromptEmbedding]) -> Path:
    """Write ``embeddings`` (in the order of ``prompts``) to ``path`` atomically (a reader never
    sees a partial file; ``ltx_mgpu.files.write_atomically``), creating its directory.

    Raises:
        OSError: the file cannot be written.
    """
    path = make_parent(path)
    tensors = {f"prompt_{i}": e.tensor.contiguous() for i, e in enumerate(embeddings)}
    meta = {
        "format": FORMAT,
        "prompts": json.dumps(list(prompts)),
        "version": ",".join(sorted({e.version for e in embeddings})),
        "dropped_tokens": json.dumps([e.dropped_tokens for e in embeddings]),
    }
    return write_atomically(path, save(tensors, metadata=meta), mode=umask_mode())


def load_embeddings(path: str | os.PathLike) -> tuple[list[str], list[PromptEmbedding]]:
    """``(prompts, embeddings)`` from a file written by :func:`save_embeddings`.

    Raises:
        OSError, KeyError (not such a file), safetensors' errors (a damaged file).
    """
    with safe_open(os.fspath(path), framework="pt") as f:
        meta = f.metadata() or {}
        prompts = json.loads(meta["prompts"])
        dropped = json.loads(meta.get("dropped_tokens", "[]")) or [0] * len(prompts)
        version = meta["version"]
        embeddings = [PromptEmbedding(f.get_tensor(f"prompt_{i}"), version, dropped[i]) for i in range(len(prompts))]
    return prompts, embeddings
