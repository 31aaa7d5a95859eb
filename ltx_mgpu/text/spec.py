"""What to encode with, and encoding through the cache.

``TextEncoderSpec`` names a Gemma source, a projection and the settings that change the result
(all of which enter the cache key, computed from file contents without loading Gemma); its
:meth:`~TextEncoderSpec.build` loads a :class:`~ltx_mgpu.text.encoder.PromptEncoder` once.
:func:`encode_prompts` is the cache-aware entry point used by the CLI and the pool: a fully
cached prompt set never constructs Gemma.
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Sequence

import torch

from ltx_mgpu.text.encoder import PromptEncoder, parse_dtype
from ltx_mgpu.text.features import TOKEN_BUDGET, PromptEmbedding, load_projection, projection_identity

if TYPE_CHECKING:  # pragma: no cover
    from ltx_mgpu.text.cache import CacheReport, EmbeddingCache

log = logging.getLogger(__name__)

COMPILE_NF4 = ("compile works with bf16 weights: NF4 (weights nf4, or an NF4 artifact directory, which is always "
               "NF4) dequantizes each layer outside the compiled graphs; turn compile off, or use a bf16 Gemma source "
               "with weights bf16")


@dataclass
class TextEncoderSpec:
    """What to encode with: the Gemma source, the projection source, and the settings that
    change the result (all of which enter the cache key).

    Attributes:
        gemma: a Gemma 3 HF snapshot directory, ComfyUI single file, or NF4 artifact.
        projection: an LTX-2 checkpoint or projection file (``text_embedding_projection.*``).
        weights: ``"bf16"`` or ``"nf4"``: what to make of a bf16 source. An NF4 artifact is
            always loaded as NF4; :attr:`weights_mode` is what is actually loaded, and is what
            enters the cache key (so NF4 and bf16 embeddings are never mixed).
        device: where Gemma runs (``"cpu"``, ``"cuda:0"``...).
        dtype: the compute dtype name (``"bfloat16"`` by default; ``"float32"`` on CPU
            for reference runs).
        token_budget: tokens per prompt (1024).
        truncate: see :class:`PromptEncoder`.
        compile: run Gemma's decoder layers through ``torch.compile`` (regional:
            ``ltx_mgpu.text.forward.compile_text_tower(scope="layers")``). bf16 weights on one
            device only. :meth:`build` compiles for a one-prompt and a padded two-prompt batch
            (so a compiler that cannot work here fails there, with a message, not in an encode);
            other kinds of batch compile on first use (a batch of one vs several, padded or
            not, a new length and then any length: about 7 graphs for a mix of prompts). With
            one fixed 1x1024-token shape a Gemma 3 12B encode took 42 ms instead of 66-73 ms
            eager on an H200 (``benchmarks/bench_text.py``); the shape-generic graphs that
            prompts of varying length end up on have not been timed on a GPU. Results differ
            from the eager ones at bf16 rounding only, like a change of batch size or attention
            kernel, so the cache key does not include it.
    """

    gemma: str
    projection: str
    weights: str = "bf16"
    device: str = "cpu"
    dtype: str = "bfloat16"
    token_budget: int = TOKEN_BUDGET
    truncate: bool = True
    compile: bool = False
    _encoder: PromptEncoder | None = field(default=None, init=False, repr=False)

    def __post_init__(self) -> None:
        self.gemma = os.fspath(self.gemma)
        self.projection = os.fspath(self.projection)
        if self.weights not in ("bf16", "nf4"):
            raise ValueError(f"weights must be 'bf16' or 'nf4', got {self.weights!r}")
        self.dtype = str(parse_dtype(self.dtype)).removeprefix("torch.")
        if not isinstance(self.compile, bool):
            raise ValueError(f"compile must be True or False, got {self.compile!r}")
        if self.compile and self.weights == "nf4":
            raise ValueError(COMPILE_NF4)

    @property
    def weights_mode(self) -> str:
        """The weights actually loaded: ``"nf4"`` for an NF4 artifact whatever :attr:`weights`
        says, else :attr:`weights` (reads the source's file names only).

        Raises:
            FileNotFoundError, GemmaFormatError: as ``detect_gemma_format``.
        """
        from ltx_mgpu.text.gemma_sources import detect_gemma_format

        return "nf4" if detect_gemma_format(self.gemma) == "nf4_artifact" else self.weights

    def cache_key_parts(self):
        """The cache key components for this spec, computed from file contents without
        loading Gemma (digests are memoised by file stat; the parts themselves by the stats of
        every file they come from, ``identity.memoized_by_stats``, since they are asked for on
        every request).

        Raises:
            FileNotFoundError, GemmaFormatError, ProjectionFormatError.
        """
        from pathlib import Path

        from ltx_mgpu.identity import memoized_by_stats
        from ltx_mgpu.text.cache import CacheKeyParts
        from ltx_mgpu.text.gemma_sources import gemma_source_listing, source_identity

        def watched():
            files, dirs = gemma_source_listing(self.gemma)
            return (*dirs, *files, self.projection)

        def compute(watched_paths):
            files, _ = gemma_source_listing(self.gemma)
            return CacheKeyParts(
                gemma_identity=source_identity(Path(self.gemma), files),
                projection_identity=projection_identity(self.projection),
                weights_mode=self.weights_mode,
                token_budget=self.token_budget,
                dtype=self.dtype,
            )

        key = ("cache-key-parts", os.path.abspath(self.gemma), os.path.abspath(self.projection), self.weights,
               self.token_budget, self.dtype)
        return memoized_by_stats(key, watched, compute)

    def build(self) -> PromptEncoder:
        """Load Gemma and the projection (once; later calls return the same encoder)."""
        if self._encoder is None:
            from ltx_mgpu.text.gemma import load_gemma_text_tower

            dtype = parse_dtype(self.dtype)
            if self.compile and self.weights_mode == "nf4":  # an NF4 artifact: before anything is loaded
                raise ValueError(COMPILE_NF4)
            t0 = time.perf_counter()
            tower = load_gemma_text_tower(self.gemma, device=self.device, dtype=dtype, weights=self.weights)
            if tower.weights != self.weights_mode:  # the cache key would name other weights than these
                raise RuntimeError(f"{self.gemma}: loaded {tower.weights} weights, but the cache key says "
                                   f"{self.weights_mode}; this is a bug in ltx_mgpu")
            proj_dtype = torch.float32 if tower.device.type == "cpu" else dtype
            projection = load_projection(self.projection, device=tower.device, dtype=proj_dtype,
                                         num_layers=tower.num_hidden_states)
            encoder = PromptEncoder(tower, projection, self.token_budget, self.truncate)
            if self.compile:
                from ltx_mgpu.text.forward import compile_prompt_encoder

                encoder = compile_prompt_encoder(encoder)
            self._encoder = encoder
            log.info("loaded Gemma (%s) and the LTX-%s projection in %.1f s%s", tower.format, projection.version,
                     time.perf_counter() - t0, "; its layers compile on the first encodes" if self.compile else "")
        return self._encoder

    @property
    def loaded(self) -> bool:
        return self._encoder is not None


def encode_prompts(spec: TextEncoderSpec, prompts: Sequence[str], batch_size: int = 8,
                   cache: "EmbeddingCache | None" = None) -> tuple[list[PromptEmbedding], "CacheReport"]:
    """Encode through the cache: hits are read, misses encoded (Gemma is loaded only if
    there is at least one miss) and stored.

    Returns:
        ``(embeddings in prompt order, CacheReport)``.
    """
    from ltx_mgpu.text.cache import CacheReport, encode_cached

    if cache is None:
        t0 = time.perf_counter()
        embeddings = spec.build().encode(prompts, batch_size)
        return embeddings, CacheReport(hits=0, misses=len(prompts), encoded=len(prompts),
                                       seconds=time.perf_counter() - t0)
    out = encode_cached(cache, list(prompts), spec.cache_key_parts(),
                        lambda missing: spec.build().encode(missing, batch_size), batch_size)
    if not spec.truncate:
        check_not_truncated(out[0], spec.token_budget)
    return out


def check_not_truncated(embeddings: Sequence[PromptEmbedding], token_budget: int) -> None:
    """Raise for an embedding of a truncated prompt when truncation is not allowed: the cache
    key does not include the truncation setting, so a hit may hold a prompt that an earlier,
    truncating run cut.

    Raises:
        PromptTooLongError: names the first such prompt and its dropped tokens.
    """
    from ltx_mgpu.text.tokenizer import prompt_too_long

    for i, e in enumerate(embeddings):
        if e.dropped_tokens:
            raise prompt_too_long(i, token_budget + e.dropped_tokens, token_budget)
