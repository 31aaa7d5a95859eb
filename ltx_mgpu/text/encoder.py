"""Prompt encoding for LTX-2: tokenise, run the Gemma text tower, extract features.

``PromptEncoder`` turns prompts into :class:`~ltx_mgpu.text.features.PromptEmbedding`
objects in sub-batches (``batch_size`` bounds activation memory: one 1024-token prompt
holds ``L x 1024 x D`` hidden states, 385 MB in bf16 for Gemma 3 12B). Batched and
one-by-one results agree: padding is on the left, pad keys are masked, and the feature
extractor's statistics use valid tokens only.

``TextEncoderSpec`` + :func:`encode_prompts` are the cache-aware entry point used by the
CLI and the pool: cache keys are computed from file contents without loading Gemma, so a
fully cached prompt set never constructs it.
"""

from __future__ import annotations

import logging
import os
import threading
import time
import warnings
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable, Sequence

import torch

from ltx_mgpu.text.features import TOKEN_BUDGET, Projection, PromptEmbedding, load_projection, projection_identity

if TYPE_CHECKING:  # pragma: no cover
    from ltx_mgpu.text.cache import CacheReport, EmbeddingCache
    from ltx_mgpu.text.gemma import GemmaTextTower

log = logging.getLogger(__name__)

_DTYPES = {"bfloat16": torch.bfloat16, "bf16": torch.bfloat16, "float32": torch.float32, "fp32": torch.float32,
           "float16": torch.float16, "fp16": torch.float16}


def parse_dtype(name: str | torch.dtype) -> torch.dtype:
    """``"bf16"``/``"bfloat16"``/``"fp32"``/``"float32"``/``"fp16"`` -> ``torch.dtype``.

    Raises:
        ValueError: an unknown name (the message lists the accepted ones).
    """
    if isinstance(name, torch.dtype):
        return name
    try:
        return _DTYPES[name.lower()]
    except KeyError:
        raise ValueError(f"unknown dtype {name!r}; use one of {sorted(_DTYPES)}") from None


COMPILE_NF4 = ("compile works with bf16 weights: NF4 (weights nf4, or an NF4 artifact directory, which is always "
               "NF4) dequantizes each layer outside the compiled graphs; turn compile off, or use a bf16 Gemma source "
               "with weights bf16")

#: ``out(j) -> tensor | None``: where row ``j`` goes (see :meth:`PromptEncoder.encode`).
RowAllocator = Callable[[int], "torch.Tensor | None"]


def _store(row: torch.Tensor, dtype: torch.dtype, out: RowAllocator | None, j: int) -> torch.Tensor:
    """``row`` as a CPU ``dtype`` tensor of its own: copied into ``out(j)`` when that gives one."""
    dest = None if out is None else out(j)
    if dest is None:
        return row.to("cpu", dtype, copy=True)
    if tuple(dest.shape) != tuple(row.shape) or dest.dtype != dtype or dest.device.type != "cpu":
        raise ValueError(f"row {j} needs a CPU {dtype} tensor of shape {tuple(row.shape)}; out gave "
                         f"{dest.dtype} {tuple(dest.shape)} on {dest.device}")
    return dest.copy_(row)


class PromptEncoder:
    """Gemma 3 text tower + LTX-2 projection -> per-prompt embeddings.

    Args:
        tower: the loaded Gemma 3 text tower (:func:`ltx_mgpu.text.gemma.load_gemma_text_tower`).
        projection: the checkpoint's text projection (:func:`load_projection`), on the
            tower's device. Its ``num_layers`` must equal the tower's hidden-state count.
        token_budget: tokens per prompt including BOS (1024 for LTX-2).
        truncate: cut prompts over the budget with a warning giving the number of dropped
            tokens; ``False`` raises ``PromptTooLongError`` instead.
        trim: run each batch at the length of its longest prompt instead of the full budget
            (``ltx_mgpu.text.forward.run_tower``; same outputs up to summation order).
        cuda_graphs: replay batches of up to 1024 tokens as CUDA graphs
            (``ltx_mgpu.text.graphs``: same outputs to rounding) when the tower runs on one CUDA
            device, uncompiled; None (default) means on unless ``LTX_MGPU_CUDA_GRAPHS=0``.
            Needs ``trim``.

    Raises:
        ValueError: the projection does not fit this Gemma (hidden size or layer count).
    """

    def __init__(self, tower: "GemmaTextTower", projection: Projection, token_budget: int = TOKEN_BUDGET,
                 truncate: bool = True, trim: bool = True, cuda_graphs: bool | None = None) -> None:
        if projection.num_layers != tower.num_hidden_states or projection.embedding_dim != tower.hidden_size:
            raise ValueError(
                f"the LTX-{projection.version} projection in {projection.source or 'the checkpoint'} takes "
                f"{projection.num_layers} hidden states of width {projection.embedding_dim}, but the Gemma at "
                f"{tower.path} gives {tower.num_hidden_states} of width {tower.hidden_size}. "
                "Pair the checkpoint with its Gemma (Gemma 3 12B for LTX-2)."
            )
        self.tower = tower
        self.projection = projection
        self.token_budget = token_budget
        self.truncate = truncate
        self.trim = trim
        self._staging: torch.Tensor | None = None
        # one encode at a time: the forward collects hidden states with hooks on the shared
        # layers, and the pinned staging buffer is reused
        self._lock = threading.Lock()
        self._pretokenized: tuple[dict[str, int], torch.Tensor, torch.Tensor, list[int]] | None = None
        from ltx_mgpu.text import graphs

        if cuda_graphs is None:
            cuda_graphs = graphs.graphs_enabled()
        self.graphs = graphs.TowerGraphs(tower) if cuda_graphs and trim and graphs.ineligible(tower) is None else None

    def token_counts(self, prompts: Sequence[str]) -> list[int]:
        """The number of tokens (BOS included, after truncation to the budget) each prompt's
        embedding will have: the ``T_valid`` of :meth:`encode`'s rows, known before encoding.

        Raises:
            ValueError: a non-string prompt; PromptTooLongError: as :meth:`encode`.
        """
        from ltx_mgpu.text.tokenizer import tokenize

        self._check_prompts(prompts)
        if not prompts:
            return []
        ids, mask, dropped = tokenize(self.tower, list(prompts), max_length=self.token_budget, truncate=self.truncate)
        # kept for the encode that follows (the pool's): its sub-batches take their rows from here
        self._pretokenized = ({p: i for i, p in enumerate(prompts)}, ids, mask, list(dropped))
        return [int(n) for n in mask.sum(dim=1).tolist()]

    def _tokenize(self, chunk: list[str]) -> tuple[torch.Tensor, torch.Tensor, list[int]]:
        """``tokenize(chunk)``, or the same rows cut from the last :meth:`token_counts` when it
        covered these prompts: left padding makes a row of a larger batch the chunk's row with
        more pad columns in front, so keeping the last ``max(real tokens)`` columns gives exactly
        what tokenizing the chunk gives."""
        from ltx_mgpu.text.tokenizer import tokenize

        pre = self._pretokenized
        if pre is not None and all(p in pre[0] for p in chunk):
            index, ids, mask, dropped = pre
            rows = [index[p] for p in chunk]
            m = mask[rows]
            width = int(m.sum(dim=1).max())
            return ids[rows][:, -width:].contiguous(), m[:, -width:].contiguous(), [dropped[i] for i in rows]
        return tokenize(self.tower, chunk, max_length=self.token_budget, truncate=self.truncate)

    @staticmethod
    def _check_prompts(prompts: Sequence[str]) -> None:
        for i, p in enumerate(prompts):
            if not isinstance(p, str):
                raise ValueError(f"prompt {i} is {type(p).__name__}, expected str")

    @torch.inference_mode()
    def encode(self, prompts: Sequence[str], batch_size: int = 8, out_dtype: torch.dtype = torch.float32,
               out: RowAllocator | None = None) -> list[PromptEmbedding]:
        """Encode prompts in sub-batches of ``batch_size``.

        Args:
            out_dtype: the dtype of the returned rows: float32 (ComfyUI's conditioning, the
                default) or the projection's compute dtype, in which the rows are computed, so
                that a transport (the pool's wire) needs no conversion; exact either way.
            out: optional ``out(i)`` -> the CPU tensor to write prompt ``i``'s row into,
                ``[T_valid, D_out]`` (:meth:`token_counts`) in ``out_dtype``, or None for a new
                one; called when the row is ready to be written, after the forward (the pool
                returns views of the shared memory its result will be handed over in, set
                aside at that moment, when the memory is most likely ready).

        Returns:
            One :class:`PromptEmbedding` per prompt, in order: ``[T_valid, D_out]`` in
            ``out_dtype`` on CPU, each with its own storage (safe to serialise independently),
            or the tensors ``out`` gave.

        Raises:
            ValueError: ``batch_size < 1``, a non-string prompt, or a tensor from ``out`` of the
                wrong shape, dtype or device.
            PromptTooLongError: a prompt exceeds the budget and ``truncate`` is False.
        """
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        self._check_prompts(prompts)
        result: list[PromptEmbedding] = []
        for start in range(0, len(prompts), batch_size):
            chunk = list(prompts[start:start + batch_size])
            ids, mask, dropped = self._tokenize(chunk)
            for j, n in enumerate(dropped):
                if n:
                    warnings.warn(
                        f"prompt {start + j} is longer than the {self.token_budget}-token budget: "
                        f"{n} tokens were dropped (truncate=False, or --no-truncate, makes it an error)",
                        stacklevel=2,
                    )
            dest = None if out is None else (lambda j, start=start: out(start + j))
            result.extend(self.encode_tokens(ids, mask, dropped, out_dtype, out=dest))
        return result

    @torch.inference_mode()
    def encode_tokens(self, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                      dropped: Sequence[int] | None = None, out_dtype: torch.dtype = torch.float32,
                      out: RowAllocator | None = None) -> list[PromptEmbedding]:
        """Encode already-tokenised prompts (one Gemma forward).

        The batch runs at the length of its longest prompt (``ltx_mgpu.text.forward.run_tower``;
        ``trim=False`` runs the full padded width), then the projection and the copy to
        the host are pipelined (:meth:`_project_rows`).

        Args:
            input_ids: ``[B, T]`` int64, left-padded.
            attention_mask: ``[B, T]``, 1 for real tokens.
            dropped: tokens cut from each prompt by truncation (recorded in the result).
            out_dtype, out: as :meth:`encode` (``out(j)`` for row ``j`` of this batch).

        Returns:
            One :class:`PromptEmbedding` per row: ``[T_valid, D_out]`` in ``out_dtype`` on CPU
            with its own storage (or the tensor ``out`` gave).

        Raises:
            ValueError: shapes differ, the padding is not on the left, or a tensor from ``out``
                does not match its row.
        """
        from ltx_mgpu.text.forward import run_tower

        lengths = [int(n) for n in attention_mask.sum(dim=1).tolist()]
        with self._lock:
            states = self.graphs.run(input_ids, attention_mask) if self.graphs is not None else None
            if states is None:
                states = run_tower(self.tower, input_ids, attention_mask, trim=self.trim)
            features = self.projection.normalised(states.hidden_states, states.attention_mask)
            del states
            rows = self._project_rows(features, lengths, out_dtype, out)
        dropped = list(dropped) if dropped is not None else [0] * len(lengths)
        return [PromptEmbedding(row, self.projection.version, int(d)) for row, d in zip(rows, dropped)]

    #: Tokens per projection GEMM when the projection and the host copy are pipelined: enough
    #: rows that the 188160-wide GEMM stays efficient (M >= 1024 ran at ~800 TFLOPS on an H200).
    PIPELINE_TOKENS = 1024

    def _project_rows(self, features: torch.Tensor, lengths: Sequence[int],
                      out_dtype: torch.dtype = torch.float32,
                      out: RowAllocator | None = None) -> list[torch.Tensor]:
        """Project ``features`` (``[B, m, L*D]``) and return each prompt's valid rows as its own
        ``out_dtype`` CPU tensor (one copy each, into ``out(j)`` when it gives one).

        On a GPU the batch is projected in groups of about :attr:`PIPELINE_TOKENS` tokens; each
        group's valid rows go to a reused pinned staging buffer in the projection's dtype
        (a pageable device->host copy ran at 1.6 GB/s on an H200 host), and the host upcasts a
        group to float32 while the GPU projects the next one (at 8x1024 tokens on an H200 the
        upcast of the whole batch after the projection took 22 ms).
        """
        b, m = features.shape[:2]
        if features.device.type != "cuda":
            projected = self.projection.project(features)
            return [_store(projected[j, m - n:], out_dtype, out, j) for j, n in enumerate(lengths)]
        width = self.projection.out_features
        numel = sum(lengths) * width
        staging = self._staging
        if staging is None or staging.numel() < numel or staging.dtype != self.projection.dtype:
            staging = self._staging = torch.empty(numel, dtype=self.projection.dtype, pin_memory=True)
        group = max(1, -(-self.PIPELINE_TOKENS // max(m, 1)))
        stream = torch.cuda.current_stream(features.device)
        pending, at = [], 0
        for g0 in range(0, b, group):
            projected = self.projection.project(features[g0:g0 + group])
            views = []
            for j in range(g0, min(b, g0 + group)):
                n = lengths[j]
                host = staging[at:at + n * width].view(n, width)
                host.copy_(projected[j - g0, m - n:], non_blocking=True)
                views.append(host)
                at += n * width
            done = torch.cuda.Event()
            done.record(stream)
            pending.append((done, views))
        rows: list[torch.Tensor] = []
        for done, views in pending:
            done.synchronize()
            for v in views:
                rows.append(_store(v, out_dtype, out, len(rows)))
        return rows


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
