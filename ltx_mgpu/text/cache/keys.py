"""Cache keys of the embedding cache: every input that changes an LTX-2 prompt embedding.

A key is a SHA-256 over the prompt text (exactly, whitespace included), the content digests
of the Gemma weights + tokenizer and of the text projection, the weights mode (bf16 / nf4),
the token budget, the compute dtype, the text-encoder LoRAs merged (their content and strengths:
``ltx_mgpu.client.lora``; absent without one, so a plain encoder's keys are unchanged) and
:data:`FORMAT_VERSION`. A cache keyed on the prompt
alone serves stale embeddings after a model or precision change (kijai/ComfyUI-WanVideoWrapper
issue #2046); :class:`CacheKeyParts` holds the rest of the key, and :func:`cache_key_parts`
computes them for a :class:`~ltx_mgpu.text.config.TextEncoderConfig` from the files' contents.

Not in the key: what changes an embedding only at the compute dtype's rounding, as kernels do
(the batch size and padding, the attention kernel, ``torch.compile`` of the layers, the
placement). An entry made one way serves the others.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import sys
from dataclasses import dataclass
from pathlib import Path

import torch

from ltx_mgpu import settings
from ltx_mgpu.choices import AUTO_DTYPE, WEIGHTS
from ltx_mgpu.identity import home_dir, memoized_by_stats
from ltx_mgpu.text.config import TOKEN_BUDGET, TextEncoderConfig
from ltx_mgpu.text.features import projection_identity
from ltx_mgpu.text.gemma.sources import detect_gemma_format, gemma_source_listing, source_identity

#: Version of the entry layout and of the key encoding; bump it when either changes, and
#: every older entry becomes a miss (it is folded into the key). 4: the entry checksum covers
#: every metadata field (``dropped_tokens`` and ``version`` included), not only the tensor.
FORMAT_VERSION = 4

_KEY_DOMAIN = "ltx_mgpu.text.cache"


@dataclass(frozen=True)
class CacheKeyParts:
    """Everything besides the prompt that determines an embedding.

    Attributes:
        gemma_identity: content digest of the Gemma 3 weights and tokenizer
            (:func:`ltx_mgpu.identity.files_digest` / ``tensors_digest``).
        projection_identity: content digest of the LTX text projection
            (:attr:`ltx_mgpu.text.features.Projection.identity`).
        weights_mode: ``"bf16"`` or ``"nf4"``.
        token_budget: Gemma token budget in tokens (1024 for LTX-2).
        dtype: the compute dtype's name, e.g. ``"bfloat16"``; a ``torch.dtype`` is accepted
            and stored as its name.
        lora: the content id of the text-encoder weight patches (LoRAs) merged into Gemma
            (``ltx_mgpu.client.lora.TextPatches.identity``), ``""`` for none; left out of the key
            and of :meth:`to_json` when empty.

    Raises:
        ValueError: an empty identity, an unknown weights mode, a non-positive budget or an
            empty dtype.
    """

    gemma_identity: str
    projection_identity: str
    weights_mode: str
    token_budget: int = TOKEN_BUDGET
    dtype: str = "bfloat16"
    lora: str = ""

    def __post_init__(self) -> None:
        if isinstance(self.dtype, torch.dtype):
            object.__setattr__(self, "dtype", str(self.dtype).removeprefix("torch."))
        for name in ("gemma_identity", "projection_identity", "dtype"):
            value = getattr(self, name)
            if not isinstance(value, str) or not value:
                raise ValueError(f"CacheKeyParts.{name} must be a non-empty string, got {value!r}")
        if self.weights_mode not in WEIGHTS:
            raise ValueError(f"CacheKeyParts.weights_mode must be one of {WEIGHTS}, got {self.weights_mode!r}")
        if isinstance(self.token_budget, bool) or not isinstance(self.token_budget, int) or self.token_budget < 1:
            raise ValueError(f"CacheKeyParts.token_budget must be a positive int (tokens), got {self.token_budget!r}")
        if not isinstance(self.lora, str):
            raise ValueError(f"CacheKeyParts.lora must be a string, got {self.lora!r}")

    def fields(self) -> dict:
        """The parts as a dict, ``lora`` only when set (a plain encoder's keys stay what they were)."""
        out = dataclasses.asdict(self)
        if not self.lora:
            del out["lora"]
        return out

    def to_json(self) -> str:
        """Canonical JSON of the parts (sorted keys, no spaces); stored in each entry."""
        return json.dumps(self.fields(), sort_keys=True, separators=(",", ":"))


def cache_key(prompt: str, parts: CacheKeyParts) -> str:
    """SHA-256 (64 hex chars) of the prompt and every key part, plus :data:`FORMAT_VERSION`.

    The encoding is canonical JSON (sorted keys, ASCII escapes), so no two different inputs
    share an encoding: the prompt is hashed exactly as given, with no stripping or
    normalisation.

    Raises:
        TypeError: ``parts`` is not a :class:`CacheKeyParts`.
    """
    if not isinstance(parts, CacheKeyParts):
        raise TypeError(f"parts must be a CacheKeyParts, got {type(parts).__name__}")
    record = {"domain": _KEY_DOMAIN, "format": FORMAT_VERSION, "parts": parts.fields(), "prompt": prompt}
    return hashlib.sha256(json.dumps(record, sort_keys=True, separators=(",", ":")).encode("ascii")).hexdigest()


def default_cache_dir() -> Path:
    """Where embeddings are cached when no root is given.

    ``$LTX_MGPU_CACHE_DIR`` if set; else, inside a running ComfyUI (its ``folder_paths``
    module already imported — it is never imported here),
    ``<ComfyUI user directory>/ltx_mgpu/embeddings``; else ``home_dir() / "embeddings"``
    (:func:`ltx_mgpu.identity.home_dir`).
    """
    configured = settings.CACHE_DIR.get()
    if configured is not None:
        return configured
    folder_paths = sys.modules.get("folder_paths")
    get_user_directory = getattr(folder_paths, "get_user_directory", None)
    if callable(get_user_directory):
        return Path(get_user_directory()) / "ltx_mgpu" / "embeddings"
    return home_dir() / "embeddings"


def weights_mode(config: TextEncoderConfig) -> str:
    """The weights a config actually loads: ``"nf4"`` for an NF4 artifact whatever
    ``config.weights`` says, else ``config.weights`` (reads the source's file names only).

    Raises:
        FileNotFoundError, GemmaFormatError: as ``detect_gemma_format``.
    """
    return "nf4" if detect_gemma_format(config.gemma) == "nf4_artifact" else config.weights


def resolve_dtype(config: TextEncoderConfig, device_type: str) -> TextEncoderConfig:
    """``config`` with a compute dtype of ``auto`` resolved for Gemma on ``device_type`` and the
    weights the config actually loads (:func:`weights_mode`;
    :func:`ltx_mgpu.text.config.resolve_text_dtype`); ``config`` itself when its dtype is named.

    Raises:
        FileNotFoundError, GemmaFormatError: as :func:`weights_mode` (``auto`` only).
    """
    if config.dtype != AUTO_DTYPE:
        return config
    return config.on_device(device_type, weights_mode(config))


def cache_key_parts(config: TextEncoderConfig) -> CacheKeyParts:
    """The cache key parts of ``config``, from file contents without loading Gemma (digests are
    memoised by file stat; the parts themselves by the stats of every file they come from,
    ``identity.memoized_by_stats``, since they are asked for on every request).

    Raises:
        ValueError: a compute dtype of ``auto`` (an embedding depends on the dtype it was
            computed in: :func:`resolve_dtype` first).
        FileNotFoundError, GemmaFormatError, ProjectionFormatError.
    """
    if config.dtype == AUTO_DTYPE:
        raise ValueError("the text encoder's compute dtype is 'auto': resolve it for the device Gemma runs on "
                         "(ltx_mgpu.text.cache.keys.resolve_dtype) before making a cache key of it")
    def watched():
        files, dirs = gemma_source_listing(config.gemma)
        return (*dirs, *files, config.projection)

    def compute(watched_paths):
        files, _ = gemma_source_listing(config.gemma)
        return CacheKeyParts(
            gemma_identity=source_identity(Path(config.gemma), files),
            projection_identity=projection_identity(config.projection),
            weights_mode=weights_mode(config),
            token_budget=config.token_budget,
            dtype=config.dtype,
        )

    key = ("cache-key-parts", config.gemma, config.projection, config.weights, config.token_budget, config.dtype)
    return memoized_by_stats(key, watched, compute)
