"""CUDA-graph replay of the Gemma 3 text tower for small batches.

A one-prompt encode is bound by the host, not the GPU: Gemma 3 12B's eager forward launches
~3600 kernels, and at 1x1024 tokens the host takes longer to launch them than the GPU takes to
run them (``benchmarks/results/nf4_h200_profile.log``; shorter prompts are bound by the host
even more). Replaying a captured CUDA graph
(https://docs.pytorch.org/docs/stable/notes/cuda.html#cuda-graphs) launches the whole decoder
stack at once, so the forward takes the GPU's time.

How a batch is laid out for a graph (:class:`TowerGraphs`):

* **Left-aligned rows, causal attention, no mask.** Row ``j``'s ``n_j`` real tokens go to
  columns ``0 .. n_j - 1`` at the positions they have in the left-padded sequence
  (``T - n_j + k``: the RoPE angles of :func:`~ltx_mgpu.text.gemma.forward.run_tower`'s run), and
  filler tokens follow them. Under causal attention no real token sees a later column, so the
  filler changes nothing the real tokens compute, and every batch, padded or not, runs the
  mask-free causal kernels (this needs causal attention: a bidirectional Gemma is not graphed).
* **Length buckets.** Graphs have static shapes, so the width is the longest prompt rounded up
  to a multiple of :data:`BUCKET` tokens; a batch of ``B`` rows in a bucket of width ``W`` is
  graphed when ``B * W <= max_tokens`` (:data:`MAX_TOKENS`: larger batches keep the GPU busy
  eagerly). The first batch of a shape captures its graph (one warm-up forward before the
  first capture, then the capture: ~2-3 eager forwards once per shape).
* **Memory.** Every graph writes its hidden states into one shared buffer of
  ``(L - 1) x max_tokens x D`` elements in the model's dtype (Gemma 3 12B: 377 MB) and takes
  its intermediates from one shared memory pool (each layer's output is copied out as it is
  made, so the pool holds about one layer's activations); graphs are replayed one at a time and
  none keeps an output in the pool, so sharing is safe in any replay order. The states handed out
  are views of that buffer (or gathered copies for rows of unequal length), valid until the
  next replay: :class:`~ltx_mgpu.text.encoder.PromptEncoder` consumes them under its lock.

Results equal the eager forward's to rounding (a different width changes GEMM tiling; the
mask-free kernels differ from the masked ones a padded eager batch uses), like a change of
batch size; the cache key does not include it. ``LTX_MGPU_CUDA_GRAPHS=0`` turns graphs off.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from ltx_mgpu import settings
from ltx_mgpu.text.gemma.forward import TowerOutput
from ltx_mgpu.text.gemma.tower import layers_device

if TYPE_CHECKING:  # pragma: no cover
    from ltx_mgpu.text.gemma.tower import GemmaTextTower

log = logging.getLogger(__name__)

#: Width granularity of the graphs, in tokens (at most 16 widths for a one-prompt batch of up
#: to 1024 tokens; a prompt runs at most 63 filler tokens).
BUCKET = 64
#: The most tokens (rows x width) a graphed batch has. At 1x1024 tokens the eager 12B forward
#: is bound by the host (above); at 8x1024 the GPU is busy throughout and a graph saves nothing.
MAX_TOKENS = 1024
#: The environment variable whose ``0`` turns CUDA graphs off in every :class:`PromptEncoder`.
ENV = settings.CUDA_GRAPHS.name


def graphs_enabled() -> bool:
    """Whether :data:`ltx_mgpu.settings.CUDA_GRAPHS` leaves CUDA graphs on (unset: on). A value
    it cannot read leaves them on with a warning naming the accepted values: an encode that is
    already running is not failed over a switch."""
    try:
        return bool(settings.CUDA_GRAPHS.get())
    except ValueError as e:
        log.warning("%s: CUDA graphs stay on", e)
        return True


def ineligible(tower: "GemmaTextTower", capture: bool = True) -> str | None:
    """Why ``tower`` cannot be graphed, or None when it can.

    A tower is graphed when its layers run on one CUDA device (``capture=False``: any one
    device, the eager stand-in the CPU tests use), uncompiled, with causal attention.
    """
    model = tower.model
    if getattr(model, "hf_device_map", None) and len(set(model.hf_device_map.values())) > 1:
        return "the layers are spread over several devices"
    if capture and layers_device(model).type != "cuda":
        return "the layers are not on a CUDA device"
    if model._compiled_call_impl is not None or any(hasattr(layer.forward, "_torchdynamo_orig_callable")
                                                     for layer in model.layers):
        return "the tower is compiled with torch.compile"
    if getattr(model.config, "use_bidirectional_attention", False):
        return "the attention is bidirectional (filler tokens would be seen)"
    return None


@dataclass
class _Graph:
    """One captured shape: static inputs, the hidden-state views it writes, and the graph."""

    embeds: torch.Tensor  # [B, W, D] model dtype: the scaled embeddings (hidden state 0)
    positions: torch.Tensor  # [B, W] int64
    states: tuple[torch.Tensor, ...]  # L tensors [B, W, D]: embeds, then views of the shared buffer
    graph: Any = None  # torch.cuda.CUDAGraph, or None: run eagerly (capture=False)


class TowerGraphs:
    """Run a Gemma 3 text tower's forward as replayed CUDA graphs, one per batch shape.

    Args:
        tower: a tower that :func:`ineligible` accepts.
        max_tokens: the largest ``rows x width`` graphed (:data:`MAX_TOKENS`).
        bucket: width granularity in tokens (:data:`BUCKET`).
        capture: capture CUDA graphs (default); ``False`` runs the same static-buffer forward
            eagerly, on any device (the CPU tests' stand-in for the layout and bucketing).

    Raises:
        ValueError: the tower is not eligible (the message says why).
    """

    def __init__(self, tower: "GemmaTextTower", max_tokens: int = MAX_TOKENS, bucket: int = BUCKET,
                 capture: bool = True) -> None:
        reason = ineligible(tower, capture)
        if reason:
            raise ValueError(f"cannot replay this Gemma as CUDA graphs: {reason}")
        self.tower, self.max_tokens, self.bucket, self.capture = tower, int(max_tokens), int(bucket), capture
        self.model = tower.model
        self.device = layers_device(self.model)
        cfg = tower.config
        self.window = getattr(cfg, "sliding_window", None)
        self.pad_id = int(getattr(cfg, "pad_token_id", None) or 0)
        self._graphs: dict[tuple[int, int], _Graph] = {}
        self._buffer: torch.Tensor | None = None  # [L - 1, max_tokens * D]
        self._pool = None
        self._stream = None  # the capture stream, on self.device
        self._warm = False
        self.disabled: str | None = None  # why capturing failed (then every batch runs eagerly)

    @property
    def shapes(self) -> list[tuple[int, int]]:
        """The ``(rows, width)`` shapes captured so far."""
        return sorted(self._graphs)

    def width(self, longest: int) -> int:
        """The graph width for a batch whose longest prompt has ``longest`` tokens."""
        return -(-longest // self.bucket) * self.bucket

    def run(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> TowerOutput | None:
        """The tower's hidden states for a left-padded batch, as ``run_tower(trim=True)`` gives
        them, or None when this batch is not graphed (too many tokens, not left-padded, a
        width beyond the sliding window, or graphs disabled after a failed capture): run it
        eagerly then.

        Args:
            input_ids: ``[B, T]`` int64, left-padded.
            attention_mask: ``[B, T]``, 1 for real tokens.

        Returns:
            :class:`TowerOutput` with ``L`` hidden states ``[B, m, D]`` (``m`` the longest
            prompt) on the layers' device, **valid until the next call** (views of the shared
            buffer when all rows have ``m`` tokens).
        """
        if self.disabled or input_ids.ndim != 2 or input_ids.shape != attention_mask.shape:
            return None
        mask = attention_mask.to("cpu", torch.int64)
        b, t = mask.shape
        lengths = mask.sum(dim=1)
        m = int(lengths.max()) if b else 0
        w = self.width(m)
        if not b or not m or b * w > self.max_tokens or (self.window is not None and w > self.window):
            return None
        cols = torch.arange(m)
        if not torch.equal(mask[:, t - m:], (cols >= m - lengths[:, None]).to(torch.int64)) or mask[:, :t - m].any():
            return None  # not left-padded: run_tower says why
        g = self._graphs.get((b, w))
        if g is None:
            g = self._new(b, w)
            if g is None:
                return None
        ids = input_ids.to("cpu")[:, t - m:]
        aligned = torch.full((b, w), self.pad_id, dtype=torch.long)
        positions = torch.empty((b, w), dtype=torch.long)
        for j, n in enumerate(lengths.tolist()):
            aligned[j, :n] = ids[j, m - n:]
            positions[j] = torch.arange(t - n, t - n + w)
        emb = self.model.get_input_embeddings()
        with torch.inference_mode():
            g.embeds.copy_(emb(aligned.to(emb.weight.device)))  # a HostEmbedding's table is on the CPU
            g.positions.copy_(positions)
            if g.graph is not None:
                g.graph.replay()
            else:
                self._forward(g)
            if bool((lengths == m).all()):
                states = tuple(s[:, :m] for s in g.states)
            else:  # back to left padding: column c of row j holds token c - (m - n_j)
                index = (cols[None, :] - (m - lengths)[:, None]).clamp_(min=0).to(self.device)
                index = index[:, :, None].expand(b, m, g.embeds.shape[-1])
                states = tuple(s.gather(1, index) for s in g.states)
        return TowerOutput(states, mask[:, t - m:], t - m)

    def _forward(self, g: _Graph) -> None:
        """The forward a graph holds: the decoder stack on the static inputs, each layer's output
        copied into the shared buffer as it is made (so the graph's pool holds one layer's
        activations, not all ``L`` states) and the final-normed output after it.

        The attention masks are given as "none" for every layer type: during a capture
        transformers' ``is_tracing()`` is true and its mask builder would materialise a causal
        ``[B, 1, W, W]`` mask; with the filler after the real tokens no mask is needed
        (``W <= sliding_window``: the window excludes nothing), so every layer takes SDPA's
        ``is_causal`` kernels, in the capture as eagerly."""
        model = self.model
        layers = model.layers
        hooks = [layer.register_forward_hook(
            lambda m, args, out, dst=dst: dst.copy_(out[0] if isinstance(out, tuple) else out))
            for layer, dst in zip(layers[:-1], g.states[1:-1])]
        try:
            out = model(inputs_embeds=g.embeds, position_ids=g.positions, use_cache=False,
                        attention_mask={t: None for t in set(model.config.layer_types)})
        finally:
            for h in hooks:
                h.remove()
        g.states[-1].copy_(out.last_hidden_state)

    def _new(self, b: int, w: int) -> _Graph | None:
        d, n_states = self.tower.hidden_size, self.tower.num_hidden_states
        dtype = self.model.get_input_embeddings().weight.dtype
        try:
            if self._buffer is None:
                self._buffer = torch.empty((n_states - 1, self.max_tokens * d), dtype=dtype, device=self.device)
            g = _Graph(embeds=torch.zeros((b, w, d), dtype=dtype, device=self.device),
                       positions=torch.arange(w, device=self.device).expand(b, w).contiguous(), states=())
            g.states = (g.embeds, *(self._buffer[i, :b * w * d].view(b, w, d) for i in range(n_states - 1)))
            if self.capture:
                g.graph = self._capture(g)
        except Exception as e:  # out of memory, or a kernel or library that cannot be captured: eager from here on
            cause = e.__context__ if isinstance(e.__context__, Exception) else e  # a failed capture's first error
            text = str(cause).strip()
            self.disabled = f"{type(cause).__name__}: {text.splitlines()[0] if text else ''}"
            log.warning("CUDA graph capture of Gemma failed (%s); encoding eagerly from now on", self.disabled)
            self.clear()
            return None
        self._graphs[(b, w)] = g
        return g

    def _end_generator_capture(self) -> None:
        """After a failed capture, end the CUDA random generator's capture state. A capture marks
        the device's default generator as capturing at its start and unmarks it only when it ends
        well (``CUDAGraph::capture_end``: ``cudaStreamEndCapture`` fails first, and the
        generator's ``capture_epilogue`` is never reached), so every later random number on the
        device would fail with "Offset increment outside graph capture encountered unexpectedly"
        (Inductor draws some while it compiles the fp8 layers). One capture that ends well, of a
        single tiny kernel on the same stream, runs the prologue and the epilogue and clears it."""
        with torch.cuda.stream(self._stream):
            probe = torch.zeros(1, device=self.device)
            torch.cuda.synchronize(self.device)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, stream=self._stream, capture_error_mode="thread_local"):
                probe.add_(1)
        torch.cuda.synchronize(self.device)

    def clear(self) -> None:
        """Drop every graph, the shared buffer and the pool (new shapes capture again). Needed
        after changing the model (its kernels and weight addresses are baked into the graphs)."""
        self._graphs.clear()
        self._buffer = None
        self._pool = None
        self._warm = False

    def _capture(self, g: _Graph) -> Any:
        """Capture :meth:`_forward` on ``g``'s buffers (after one warm-up forward on a side
        stream the first time: cuBLAS handles, Triton compilation and other lazy set-up must
        not happen inside a capture)."""
        with torch.cuda.device(self.device), torch.inference_mode():
            current = torch.cuda.current_stream(self.device)
            if self._stream is None:  # this device's own: torch's default capture stream is per process
                self._stream = torch.cuda.Stream(self.device)
            try:
                if not self._warm:
                    self._stream.wait_stream(current)
                    with torch.cuda.stream(self._stream):
                        self._forward(g)
                    current.wait_stream(self._stream)
                    self._warm = True
                if self._pool is None:
                    self._pool = torch.cuda.graph_pool_handle()
                graph = torch.cuda.CUDAGraph()
                # thread_local: other threads of the process (ComfyUI's) may keep using CUDA meanwhile
                try:
                    with torch.cuda.graph(graph, pool=self._pool, stream=self._stream,
                                          capture_error_mode="thread_local"):
                        self._forward(g)
                except Exception:
                    self._end_generator_capture()
                    raise
            finally:  # a capture that fails inside may leave its stream current
                torch.cuda.set_stream(current)
        log.info("captured a CUDA graph of Gemma for %d x %d tokens", *g.embeds.shape[:2])
        return graph
