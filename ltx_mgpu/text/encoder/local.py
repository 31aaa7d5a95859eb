"""Encoding in this process: :class:`LocalTextEncoder`, a config loaded on one device on first
use, whose :meth:`~LocalTextEncoder.encode` goes through the cache (a fully cached prompt set
never constructs Gemma). Encoding in the pool is :func:`ltx_mgpu.client.text.encode_prompts`;
both take the same :class:`~ltx_mgpu.text.config.TextEncoderConfig` and check the prompts the
same way, once, where they come in (:func:`~ltx_mgpu.text.gemma.tokenizer.check_prompts`).
"""

from __future__ import annotations

import logging
import time
from typing import Any, Callable, Sequence

import torch

from ltx_mgpu.text.cache.keys import cache_key_parts, resolve_dtype, weights_mode
from ltx_mgpu.text.cache.store import CacheReport, EmbeddingCache, encode_cached
from ltx_mgpu.text.config import COMPILE_NF4, TextEncoderConfig
from ltx_mgpu.text.encoder.loading import load_gemma_text_tower
from ltx_mgpu.text.encoder.prompt import PromptEncoder, compile_prompt_encoder, parse_dtype
from ltx_mgpu.text.features import PromptEmbedding, load_projection
from ltx_mgpu.text.gemma.tokenizer import check_prompts, prompt_too_long

__all__ = ["LocalTextEncoder", "check_not_truncated"]

log = logging.getLogger(__name__)


class LocalTextEncoder:
    """A text encoder for this process: ``config`` loaded on ``device`` by :meth:`build`, once
    (later calls return the same :class:`~ltx_mgpu.text.encoder.PromptEncoder`). The config's
    placement and ``max_memory`` are the pool's business and are not used here; a compute dtype
    of ``auto`` becomes ``device``'s (``self.config`` holds the resolved one).

    Raises (at construction):
        ValueError: ``config`` is not a :class:`TextEncoderConfig`.
        FileNotFoundError, GemmaFormatError: dtype ``auto`` with a Gemma source that is not there.
    """

    def __init__(self, config: TextEncoderConfig, device: str = "cpu"):
        if not isinstance(config, TextEncoderConfig):
            raise ValueError(f"config must be a TextEncoderConfig, got {type(config).__name__}")
        # 'auto': the dtype of this device (file names read to tell NF4 artifacts apart)
        self.config, self.device = resolve_dtype(config, torch.device(device).type), str(device)
        self._encoder: PromptEncoder | None = None

    def build(self) -> PromptEncoder:
        """Load Gemma and the projection (once; later calls return the same encoder).

        Raises:
            ValueError: ``compile`` with an NF4 artifact (before anything is loaded); a compiler
                that cannot work here. Whatever loading Gemma or the projection raises.
        """
        if self._encoder is None:
            c = self.config
            dtype = parse_dtype(c.dtype)
            mode = weights_mode(c)
            if c.compile and mode == "nf4":  # an NF4 artifact: before anything is loaded
                raise ValueError(COMPILE_NF4)
            t0 = time.perf_counter()
            tower = load_gemma_text_tower(c.gemma, device=self.device, dtype=dtype, weights=c.weights)
            if tower.weights != mode:  # the cache key would name other weights than these
                raise RuntimeError(f"{c.gemma}: loaded {tower.weights} weights, but the cache key says "
                                   f"{mode}; this is a bug in ltx_mgpu")
            proj_dtype = torch.float32 if tower.device.type == "cpu" else dtype
            projection = load_projection(c.projection, device=tower.device, dtype=proj_dtype,
                                         num_layers=tower.num_hidden_states)
            encoder = PromptEncoder(tower, projection, c.token_budget, c.truncate)
            if c.compile:
                encoder = compile_prompt_encoder(encoder)
            self._encoder = encoder
            log.info("loaded Gemma (%s) and the LTX-%s projection in %.1f s%s", tower.format, projection.version,
                     time.perf_counter() - t0, "; its layers compile on the first encodes" if c.compile else "")
        return self._encoder

    @property
    def loaded(self) -> bool:
        """Whether :meth:`build` has loaded the encoder."""
        return self._encoder is not None

    def encode(self, prompts: Sequence[str], batch_size: int = 8, cache: EmbeddingCache | None = None,
               on_progress: Callable[[str, int, int], Any] | None = None
               ) -> tuple[list[PromptEmbedding], CacheReport]:
        """Encode ``prompts`` through ``cache`` (None: no cache): hits are read, misses encoded in
        sub-batches of ``batch_size`` and stored after each; Gemma is loaded only when a prompt
        misses.

        ``on_progress(phase, step, total)`` gets ``load_text_encoder`` (0/1 when Gemma starts
        loading, 1/1 when it is ready) and ``encode`` (prompts done of those to encode, once per
        sub-batch), the phases a pool's encode reports.

        Returns:
            ``(embeddings in prompt order, CacheReport)``.
        Raises:
            ValueError: prompts :func:`~ltx_mgpu.text.gemma.tokenizer.check_prompts` refuses, a
                ``batch_size`` below 1; ``PromptTooLongError`` when the config does not truncate
                and a prompt (or a cached entry of an earlier, truncating run) is over the budget.
            Whatever :meth:`build` raises.
        """
        check_prompts(prompts)
        if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
            raise ValueError(f"batch_size must be a positive int, got {batch_size!r}")
        report = on_progress or (lambda phase, step, total: None)
        done = [0, 0]  # prompts encoded, prompts to encode

        def encode_misses(missing: list[str]) -> list[PromptEmbedding]:
            if not self.loaded:
                report("load_text_encoder", 0, 1)
                self.build()
                report("load_text_encoder", 1, 1)
            done[1] = max(done[1], done[0] + len(missing))
            report("encode", done[0], done[1])
            out = []
            for i in range(0, len(missing), batch_size):
                batch = missing[i:i + batch_size]
                out += self.build().encode(batch, len(batch))
                done[0] += len(batch)
                report("encode", done[0], done[1])
            return out

        if cache is None:
            t0 = time.perf_counter()
            embeddings = encode_misses(list(prompts))
            return embeddings, CacheReport(hits=0, misses=len(prompts), encoded=len(prompts),
                                           seconds=time.perf_counter() - t0)
        out = encode_cached(cache, list(prompts), cache_key_parts(self.config), encode_misses, batch_size)
        if not self.config.truncate:
            check_not_truncated(out[0], self.config.token_budget)
        return out


def check_not_truncated(embeddings: Sequence[PromptEmbedding], token_budget: int) -> None:
    """Raise for an embedding of a truncated prompt when truncation is not allowed: the cache
    key does not include the truncation setting, so a hit may hold a prompt that an earlier,
    truncating run cut.

    Raises:
        PromptTooLongError: names the first such prompt and its dropped tokens.
    """
    for i, e in enumerate(embeddings):
        if e.dropped_tokens:
            raise prompt_too_long(i, token_budget + e.dropped_tokens, token_budget)
