"""Prompt encoding for LTX-2: tokenise, run the Gemma text tower, extract features.

``PromptEncoder`` turns prompts into :class:`~ltx_mgpu.text.features.PromptEmbedding`
objects in sub-batches (``batch_size`` bounds activation memory: one 1024-token prompt
holds ``L x 1024 x D`` hidden states, 385 MB in bf16 for Gemma 3 12B). Batched and
one-by-one results agree: padding is on the left, pad keys are masked, and the feature
extractor's statistics use valid tokens only.

:func:`compile_prompt_encoder` makes one whose tower's layers run through ``torch.compile``.
What to encode with is a :class:`~ltx_mgpu.text.config.TextEncoderConfig`; encoding with one in
this process, through the cache, is :class:`~ltx_mgpu.text.encoder.local.LocalTextEncoder`'s.
"""

from __future__ import annotations

import logging
import threading
import time
import warnings
from typing import Callable, Sequence

import torch

from ltx_mgpu.finite import is_finite, nonfinite
from ltx_mgpu.text.config import TOKEN_BUDGET, canonical_dtype
from ltx_mgpu.text.features import Projection, PromptEmbedding
from ltx_mgpu.text.gemma import graphs
from ltx_mgpu.text.gemma.forward import compile_text_tower, run_tower
from ltx_mgpu.text.gemma.tokenizer import tokenize
from ltx_mgpu.text.gemma.tower import GemmaTextTower

log = logging.getLogger(__name__)

def parse_dtype(name: str | torch.dtype) -> torch.dtype:
    """``"bf16"``/``"bfloat16"``/``"fp32"``/``"float32"``/``"fp16"``/``"float16"`` -> ``torch.dtype``
    (the names of :data:`ltx_mgpu.text.config.DTYPE_ALIASES`).

    Raises:
        ValueError: an unknown name (the message lists the accepted ones).
    """
    if isinstance(name, torch.dtype):
        return name
    return getattr(torch, canonical_dtype(name))


class NonFiniteEmbeddingError(ValueError):
    """A prompt's embedding holds NaN or infinite values; it is never returned (nor cached). The
    message names the prompt and the first of Gemma's hidden states that is not finite; ``row``
    is the prompt's index in its batch."""

    def __init__(self, message: str, row: int = 0):
        super().__init__(message)
        self.row = row


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


def _nonfinite_flag(t: torch.Tensor) -> torch.Tensor:
    """:func:`ltx_mgpu.finite.nonfinite` of ``t`` as a 0-dim bool tensor on ``t``'s device (False
    where ``t`` cannot hold a NaN: an empty row)."""
    flag = nonfinite(t)
    return flag if flag is not None else torch.zeros((), dtype=torch.bool, device=t.device)


def _exact_in(src: torch.dtype, dst: torch.dtype) -> bool:
    """Casting ``src`` values to ``dst`` keeps every finite value finite (no overflow)."""
    return src == dst or torch.finfo(dst).max >= torch.finfo(src).max


class PromptEncoder:
    """Gemma 3 text tower + LTX-2 projection -> per-prompt embeddings.

    Args:
        tower: the loaded Gemma 3 text tower (:func:`ltx_mgpu.text.encoder.loading.load_gemma_text_tower`).
        projection: the checkpoint's text projection (:func:`load_projection`), on the
            tower's device. Its ``num_layers`` must equal the tower's hidden-state count.
        token_budget: tokens per prompt including BOS (1024 for LTX-2).
        truncate: cut prompts over the budget with a warning giving the number of dropped
            tokens; ``False`` raises ``PromptTooLongError`` instead.
        trim: run each batch at the length of its longest prompt instead of the full budget
            (``ltx_mgpu.text.gemma.forward.run_tower``; same outputs up to summation order).
        cuda_graphs: replay batches of up to 1024 tokens as CUDA graphs
            (``ltx_mgpu.text.gemma.graphs``: same outputs to rounding) when the tower runs on one CUDA
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
        self._pretokenized: tuple[dict[str, int], torch.Tensor, torch.Tensor, list[int], tuple[int, bool]] | None = None
        if cuda_graphs is None:
            cuda_graphs = graphs.graphs_enabled()
        self.graphs = graphs.TowerGraphs(tower) if cuda_graphs and trim and graphs.ineligible(tower) is None else None

    def _limits(self, max_tokens: int | None) -> tuple[int, bool]:
        """``(max_length, truncate)`` for the tokenizer: the encoder's budget and truncation, or
        ``max_tokens`` without truncation (every prompt whole)."""
        if max_tokens is None:
            return self.token_budget, self.truncate
        if isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < 1:
            raise ValueError(f"max_tokens must be a positive int (tokens) or None, got {max_tokens!r}")
        return max_tokens, False

    def token_counts(self, prompts: Sequence[str], max_tokens: int | None = None) -> list[int]:
        """The number of tokens (BOS included, after truncation to the budget) each prompt's
        embedding will have: the ``T_valid`` of :meth:`encode`'s rows, known before encoding.
        ``max_tokens`` as :meth:`encode`.

        Raises:
            ValueError: a bad ``max_tokens``; PromptTooLongError: as :meth:`encode`.
        """
        limits = self._limits(max_tokens)
        if not prompts:
            return []
        ids, mask, dropped = tokenize(self.tower, list(prompts), max_length=limits[0], truncate=limits[1])
        # kept for the encode that follows (the pool's): its sub-batches take their rows from here
        self._pretokenized = ({p: i for i, p in enumerate(prompts)}, ids, mask, list(dropped), limits)
        return [int(n) for n in mask.sum(dim=1).tolist()]

    def _tokenize(self, chunk: list[str],
                  max_tokens: int | None = None) -> tuple[torch.Tensor, torch.Tensor, list[int]]:
        """``tokenize(chunk)``, or the same rows cut from the last :meth:`token_counts` when it
        covered these prompts with the same limits: left padding makes a row of a larger batch
        the chunk's row with more pad columns in front, so keeping the last ``max(real tokens)``
        columns gives exactly what tokenizing the chunk gives."""
        limits = self._limits(max_tokens)
        pre = self._pretokenized
        if pre is not None and pre[4] == limits and all(p in pre[0] for p in chunk):
            index, ids, mask, dropped, _ = pre
            rows = [index[p] for p in chunk]
            m = mask[rows]
            width = int(m.sum(dim=1).max())
            ids, mask, dropped = ids[rows][:, -width:], m[:, -width:], [dropped[i] for i in rows]
        else:
            ids, mask, dropped = tokenize(self.tower, chunk, max_length=limits[0], truncate=limits[1])
        return (*self._padded(ids, mask, min(limits[0], TOKEN_BUDGET)), dropped)

    def _padded(self, ids: torch.Tensor, mask: torch.Tensor, width: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``ids`` / ``mask`` left-padded to at least ``width`` columns: the length LTX-2's
        tokenizers pad to, so the real tokens get the RoPE positions they have there. ltx-core pads
        a prompt to its ``max_length`` (the budget, 1024); ComfyUI's LTX-2 tokenizer to
        ``max(1024, T)`` (``min_length=1024``, ``Gemma3_12BTokenizer`` in
        ``comfy/text_encoders/lt.py``), so ``min(max_length, 1024)``. RoPE is relative, but the
        angles of other positions round differently, which the fp32 parity with ComfyUI's encoder
        sees (``tests/comfyui/test_comfyui_templates.py``). The pad columns are not computed
        (``run_tower``'s trim starts the real tokens at their padded positions; the CUDA graphs
        do the same)."""
        short = width - ids.shape[1]
        if short <= 0:
            return ids.contiguous(), mask.contiguous()
        pad = torch.full((ids.shape[0], short), int(self.tower.tokenizer.pad_token_id), dtype=ids.dtype)
        return torch.cat([pad, ids], 1), torch.cat([torch.zeros((mask.shape[0], short), dtype=mask.dtype), mask], 1)

    @torch.inference_mode()
    def encode(self, prompts: Sequence[str], batch_size: int = 8, out_dtype: torch.dtype = torch.float32,
               out: RowAllocator | None = None, max_tokens: int | None = None) -> list[PromptEmbedding]:
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
            max_tokens: None: the encoder's ``token_budget`` and ``truncate``. A number: every
                prompt is encoded whole, up to that many tokens (BOS included), whatever the
                budget, as ComfyUI's LTX-2 text encoder does (it cuts nothing: ``min_length=1024``
                of ``Gemma3_12BTokenizer`` in ``comfy/text_encoders/lt.py`` only pads); a longer
                prompt raises PromptTooLongError.

        Returns:
            One :class:`PromptEmbedding` per prompt, in order: ``[T_valid, D_out]`` in
            ``out_dtype`` on CPU, each with its own storage (safe to serialise independently),
            or the tensors ``out`` gave.

        The prompts are Unicode text, as the entry points checked
        (:func:`~ltx_mgpu.text.gemma.tokenizer.check_prompts`: ``LocalTextEncoder.encode``, the
        pool's ``encode``); nothing here checks them again.

        Raises:
            ValueError: ``batch_size < 1``, a bad ``max_tokens``, or a tensor from ``out`` of the
                wrong shape, dtype or device.
            PromptTooLongError: a prompt exceeds the budget and ``truncate`` is False, or exceeds
                ``max_tokens``.
            NonFiniteEmbeddingError: a prompt's embedding is not finite (names the prompt and
                the first hidden state that is not: :meth:`encode_tokens`).
        """
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        self._limits(max_tokens)
        result: list[PromptEmbedding] = []
        for start in range(0, len(prompts), batch_size):
            chunk = list(prompts[start:start + batch_size])
            ids, mask, dropped = self._tokenize(chunk, max_tokens)
            for j, n in enumerate(dropped):
                if n:
                    warnings.warn(
                        f"prompt {start + j} is longer than the {self.token_budget}-token budget: "
                        f"{n} tokens were dropped (truncate=False, or --no-truncate, makes it an error)",
                        stacklevel=2,
                    )
            dest = None if out is None else (lambda j, start=start: out(start + j))
            try:
                result.extend(self.encode_tokens(ids, mask, dropped, out_dtype, out=dest))
            except NonFiniteEmbeddingError as e:
                raise NonFiniteEmbeddingError(f"prompt {start + e.row} ({chunk[e.row]!r:.60}): {e}", start + e.row) \
                    from None
        return result

    @torch.inference_mode()
    def encode_tokens(self, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                      dropped: Sequence[int] | None = None, out_dtype: torch.dtype = torch.float32,
                      out: RowAllocator | None = None) -> list[PromptEmbedding]:
        """Encode already-tokenised prompts (one Gemma forward).

        The batch runs at the length of its longest prompt (``ltx_mgpu.text.gemma.forward.run_tower``;
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

        Every row is checked finite (one reduction over the embedding, not over the hidden
        states: on the GPU before its copy to the host when the tower runs on one, on the host
        otherwise, :meth:`_project_rows`); a row that is not is diagnosed by running its prompt
        alone again (:meth:`_first_non_finite`).

        Raises:
            ValueError: shapes differ, the padding is not on the left, or a tensor from ``out``
                does not match its row.
            NonFiniteEmbeddingError: a row holds NaN or infinite values (``row``: its index in the
                batch; the message names the first hidden state that is not finite).
        """
        lengths = [int(n) for n in attention_mask.sum(dim=1).tolist()]
        with self._lock:
            states = self.graphs.run(input_ids, attention_mask) if self.graphs is not None else None
            if states is None:
                states = run_tower(self.tower, input_ids, attention_mask, trim=self.trim)
            features = self.projection.normalised(states.hidden_states, states.attention_mask)
            del states
            rows, finite = self._project_rows(features, lengths, out_dtype, out)
            del features
            bad = next((j for j, ok in enumerate(finite) if not ok), None)
            if bad is not None:
                raise NonFiniteEmbeddingError(self._first_non_finite(input_ids[bad:bad + 1],
                                                                     attention_mask[bad:bad + 1]), row=bad)
        dropped = list(dropped) if dropped is not None else [0] * len(lengths)
        return [PromptEmbedding(row, self.projection.version, int(d)) for row, d in zip(rows, dropped)]

    def _first_non_finite(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> str:
        """Why one prompt's embedding is not finite: the first of the tower's hidden states (0:
        the token embeddings, ``k``: decoder layer ``k - 1``'s output) with a NaN or infinite
        value at a real token, or the projection when every hidden state is finite."""
        states = run_tower(self.tower, input_ids, attention_mask, trim=self.trim)
        keep = states.attention_mask.to(states.hidden_states[0].device).bool()
        where = next((k for k, h in enumerate(states.hidden_states) if not bool(torch.isfinite(h[keep]).all())), None)
        dtype = str(states.hidden_states[0].dtype).removeprefix("torch.")
        if where is None:
            return (f"its embedding holds NaN or infinite values, every Gemma hidden state being finite: the LTX-2 "
                    f"text projection ({self.projection.source or 'the checkpoint'}) holds them or overflows in "
                    f"{dtype}; check that file")
        layer = "the token embeddings" if where == 0 else f"the output of decoder layer {where - 1}"
        return (f"its embedding holds NaN or infinite values, from Gemma's hidden state {where} ({layer}, {dtype}) on: "
                f"the weights of {self.tower.path} are damaged there (download the file again), or the model "
                "overflows in this dtype (encode in bfloat16 or float32)")

    #: Tokens per projection GEMM when the projection and the host copy are pipelined: enough
    #: rows that the 188160-wide GEMM stays efficient.
    PIPELINE_TOKENS = 1024

    def _project_rows(self, features: torch.Tensor, lengths: Sequence[int],
                      out_dtype: torch.dtype = torch.float32,
                      out: RowAllocator | None = None) -> tuple[list[torch.Tensor], list[bool]]:
        """Project ``features`` (``[B, m, L*D]``) and return each prompt's valid rows as its own
        ``out_dtype`` CPU tensor (one copy each, into ``out(j)`` when it gives one), and for each
        row whether every value of it is finite.

        On a GPU the batch is projected in groups of about :attr:`PIPELINE_TOKENS` tokens; each
        group's valid rows go to a reused pinned staging buffer in the projection's dtype
        (a pageable device->host copy is much slower than a pinned one), and the host upcasts a
        group to float32 while the GPU projects the next one (so the upcast overlaps the
        projection instead of following it). The finite check of a row is a reduction on the GPU
        whose one-byte answer comes back with the row (the upcast to ``out_dtype`` keeps every
        value finite or not as it was, unless ``out_dtype`` is narrower, when the host row is
        checked too).
        """
        b, m = features.shape[:2]
        if features.device.type != "cuda":
            projected = self.projection.project(features)
            rows = [_store(projected[j, m - n:], out_dtype, out, j) for j, n in enumerate(lengths)]
            return rows, [is_finite(row) for row in rows]
        width = self.projection.out_features
        numel = sum(lengths) * width
        staging = self._staging
        if staging is None or staging.numel() < numel or staging.dtype != self.projection.dtype:
            staging = self._staging = torch.empty(numel, dtype=self.projection.dtype, pin_memory=True)
        flags = torch.empty(b, dtype=torch.bool, pin_memory=True)
        group = max(1, -(-self.PIPELINE_TOKENS // max(m, 1)))
        stream = torch.cuda.current_stream(features.device)
        pending, at = [], 0
        for g0 in range(0, b, group):
            projected = self.projection.project(features[g0:g0 + group])
            views, bad = [], []
            for j in range(g0, min(b, g0 + group)):
                n = lengths[j]
                host = staging[at:at + n * width].view(n, width)
                host.copy_(projected[j - g0, m - n:], non_blocking=True)
                bad.append(_nonfinite_flag(projected[j - g0, m - n:]))
                views.append(host)
                at += n * width
            flags[g0:g0 + len(bad)].copy_(torch.stack(bad), non_blocking=True)
            done = torch.cuda.Event()
            done.record(stream)
            pending.append((done, views))
        rows: list[torch.Tensor] = []
        for done, views in pending:
            done.synchronize()
            for v in views:
                rows.append(_store(v, out_dtype, out, len(rows)))
        ok = [not f for f in flags.tolist()]
        if not _exact_in(self.projection.dtype, out_dtype):
            ok = [f and is_finite(row) for f, row in zip(ok, rows)]
        return rows, ok


def compile_prompt_encoder(encoder: PromptEncoder) -> PromptEncoder:
    """A ``PromptEncoder`` like ``encoder`` with its tower's layers compiled
    (:func:`compile_text_tower`, ``scope="layers"``) and warmed up on a one-prompt and a padded
    two-prompt batch (what ``LocalTextEncoder`` builds for ``TextEncoderConfig(compile=True)``).

    Raises:
        ValueError: torch.compile failed here (no C++ compiler for the CPU backend, a broken
            Triton...), with the compiler's first line and the fix (turn compile off).
    """
    import torch._dynamo.exc  # torch's compiler stack loads only when compile is asked for

    compiled = PromptEncoder(compile_text_tower(encoder.tower, scope="layers"), encoder.projection,
                             encoder.token_budget, encoder.truncate, encoder.trim, cuda_graphs=False)
    t0 = time.perf_counter()
    try:
        compiled.encode(["a"])
        compiled.encode(["a", "a photo of a cat"])
    except torch._dynamo.exc.TorchDynamoException as e:
        cause = getattr(e, "inner_exception", None) or e  # a backend's failure: its own error
        first = f"{type(cause).__name__}: {(str(cause).strip().splitlines() or [''])[0]}"
        raise ValueError(f"torch.compile could not compile Gemma's layers on {encoder.tower.device}: {first} "
                         "(turn compile off to encode without it)") from e
    log.info("compiled Gemma's layers for one and two prompts in %.1f s", time.perf_counter() - t0)
    return compiled
