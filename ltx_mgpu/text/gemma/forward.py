"""The Gemma 3 text-tower forward as LTX-2 prompt encoding runs it.

Three things make it cheaper than a plain ``Gemma3TextModel(input_ids, attention_mask,
output_hidden_states=True)`` call on the 1024-token left-padded batch, without changing what
the real tokens compute:

* **Trimmed padding** (:func:`run_tower`): LTX-2 pads every prompt on the left to the
  1024-token budget (``features.TOKEN_BUDGET``), but pad keys are masked and the result keeps
  only the real tokens, so a batch is run at the length of its longest prompt. The real tokens
  keep the positions they have in the padded sequence (``position_ids`` start at ``T - m``),
  so the RoPE angles are the padded computation's; the outputs of real tokens equal the padded
  run up to floating-point summation order. A typical 150-token prompt runs ~7x fewer tokens.
* **Causal attention without a mask tensor** (:data:`ATTENTION`): transformers' SDPA mask
  builder materialises a ``[B, 1, T, T]`` mask for Gemma 3's sliding-window layers unless
  ``T < sliding_window`` (strict); for ``T <= sliding_window`` the window excludes nothing
  (transformers' rule: key ``j`` is visible to query ``i`` when ``i - sliding_window < j <= i``),
  so the layer is plain causal. The ``ltx_mgpu_sdpa`` implementation (transformers'
  ``AttentionInterface`` / ``AttentionMaskInterface``, the documented extension points) is SDPA
  with that one difference, so a batch without padding runs ``is_causal=True`` kernels, which
  are much faster than the masked ones for Gemma 3 12B's attention shape (cuDNN;
  ``benchmarks/profile_text.py --attention`` measures it).
* **Embedding table in host memory** (:func:`offload_embeddings`): the 262208 x 3840 bf16 table
  of Gemma 3 12B is 2.0 GB, a quarter of an NF4 tower's GPU memory, for a lookup of ``T`` rows
  (7.5 MB per 1024-token prompt). :class:`HostEmbedding` keeps it on the CPU, gathers the rows
  into pinned memory and copies them to the GPU, where the ``sqrt(D)`` scale is applied exactly
  as ``Gemma3TextScaledWordEmbedding`` does.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import itertools
import logging
from dataclasses import dataclass
from typing import Any, Literal

import torch
from torch import nn

from ltx_mgpu.text.gemma.tower import GemmaTextTower, layers_device

log = logging.getLogger(__name__)

#: The transformers attention implementation registered by :func:`register_attention`.
ATTENTION = "ltx_mgpu_sdpa"


@functools.cache
def register_attention() -> str:
    """Register :data:`ATTENTION` with transformers (once per process) and return its name.

    The attention function is transformers' own ``sdpa_attention_forward``; the mask function
    is transformers' ``sdpa_mask`` called without the sliding window when the keys fit in it
    (``kv_length <= local_size``), so the is-causal shortcut applies to every layer.
    """
    from transformers import AttentionInterface
    from transformers.integrations.sdpa_attention import sdpa_attention_forward
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    def mask(*args: Any, **kwargs: Any):
        local, kv_length = kwargs.get("local_size"), kwargs.get("kv_length")
        if local is not None and kv_length is not None and kv_length <= local:
            kwargs["local_size"] = None  # the window covers every key: plain causal
        return sdpa_mask(*args, **kwargs)

    AttentionInterface.register(ATTENTION, sdpa_attention_forward)
    AttentionMaskInterface.register(ATTENTION, mask)
    return ATTENTION


def use_causal_skip(model: nn.Module) -> None:
    """Switch a ``Gemma3TextModel`` running transformers' ``"sdpa"`` to :data:`ATTENTION`
    (other implementations are left as they are). Same weights, same results up to kernel
    choice."""
    if getattr(model.config, "_attn_implementation", None) == "sdpa":
        model.set_attn_implementation(register_attention())


class HostEmbedding(nn.Module):
    """Gemma 3's scaled token embedding with its table in host memory.

    Holds the original ``weight`` parameter (same name, so state dicts and NF4 saving are
    unchanged) on the CPU and the ``embed_scale`` buffer; ``forward`` gathers the rows of
    ``input_ids`` on the CPU into a reused pinned buffer, copies them to :attr:`device` and
    multiplies by ``embed_scale`` cast to the weight dtype there (the operations of
    ``Gemma3TextScaledWordEmbedding.forward``, so the result is bit-identical).

    Args:
        embedding: the model's ``Gemma3TextScaledWordEmbedding``.
        device: where the layers run (the output's device).
    """

    def __init__(self, embedding: nn.Module, device: torch.device) -> None:
        super().__init__()
        self.device = torch.device(device)
        self.padding_idx = embedding.padding_idx
        self.weight = nn.Parameter(embedding.weight.detach().to("cpu"), requires_grad=False)
        self.embed_scale = nn.Buffer(embedding.embed_scale.detach().to(self.device), persistent=False)
        self._pinned: torch.Tensor | None = None
        self._copied: torch.cuda.Event | None = None

    @property
    def num_embeddings(self) -> int:
        return int(self.weight.shape[0])

    @property
    def embedding_dim(self) -> int:
        return int(self.weight.shape[1])

    @torch.compiler.disable
    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        """``[B, T]`` int64 ids (any device) -> ``[B, T, D]`` scaled embeddings on :attr:`device`."""
        ids = input_ids.to("cpu").reshape(-1)
        n, d = ids.numel(), self.embedding_dim
        if self.device.type == "cuda":
            if self._pinned is None or self._pinned.numel() < n * d:
                self._pinned = torch.empty(n * d, dtype=self.weight.dtype, pin_memory=True)
            rows = self._pinned[:n * d].view(n, d)
            if self._copied is not None:  # the last copy out of the buffer must finish before refilling it
                self._copied.synchronize()
            torch.index_select(self.weight, 0, ids, out=rows)
            out = rows.to(self.device, non_blocking=True)
            self._copied = torch.cuda.Event()
            self._copied.record(torch.cuda.current_stream(self.device))
        else:
            out = torch.index_select(self.weight, 0, ids).to(self.device)
        return (out * self.embed_scale.to(self.weight.dtype)).view(*input_ids.shape, d)


def offload_embeddings(model: nn.Module) -> bool:
    """Move a single-device ``Gemma3TextModel``'s embedding table to host memory
    (:class:`HostEmbedding`); the layers stay where they are. No-op (returns ``False``) when
    the model already runs on the CPU or has been dispatched over several devices."""
    emb = model.get_input_embeddings()
    if isinstance(emb, HostEmbedding):
        return True
    device = layers_device(model)
    if device.type == "cpu" or getattr(model, "hf_device_map", None):
        return False
    model.set_input_embeddings(HostEmbedding(emb, device))
    return True


@dataclass(frozen=True)
class TowerOutput:
    """The hidden states of a (possibly trimmed) batch.

    Attributes:
        hidden_states: ``L`` tensors ``[B, m, D]`` on the layers' device (index 0 the scaled
            embedding output, L-1 the final-normed last layer: transformers' convention).
        attention_mask: ``[B, m]`` int64 on the CPU, 1 for real tokens (left padding).
        offset: ``T - m``, the leading pad columns that were not computed.
    """

    hidden_states: tuple[torch.Tensor, ...]
    attention_mask: torch.Tensor
    offset: int


def run_tower(tower: GemmaTextTower, input_ids: torch.Tensor, attention_mask: torch.Tensor, *,
              trim: bool = True) -> TowerOutput:
    """Run the text tower on a left-padded batch and return every hidden state.

    Args:
        input_ids: ``[B, T]`` int64, left-padded (as from ``tokenize``).
        attention_mask: ``[B, T]``, 1 for real tokens, 0 for padding (any device).
        trim: run only the last ``m = max(real tokens per row)`` columns, at positions
            ``T - m .. T - 1`` (see the module docstring). ``False`` runs all ``T``.

    Returns:
        :class:`TowerOutput`. Values at padded positions are meaningless.

    Raises:
        ValueError: shapes differ or are not 2-D, or ``trim`` with padding that is not on the
            left (a real token inside the trimmed columns).
    """
    if input_ids.ndim != 2 or input_ids.shape != attention_mask.shape:
        raise ValueError(
            f"input_ids and attention_mask must both be [B, T]; got {tuple(input_ids.shape)} and "
            f"{tuple(attention_mask.shape)}"
        )
    mask = attention_mask.to("cpu", torch.int64)
    b, t = mask.shape
    m = int(mask.sum(dim=1).max()) if b else t
    offset = t - m if trim else 0
    if offset and bool(mask[:, :offset].any()):
        raise ValueError("run_tower(trim=True) needs left padding (real tokens last in every row); "
                         "tokenize with padding_side='left' or pass trim=False")
    ids, mask = input_ids[:, offset:], mask[:, offset:]
    model = tower.model
    device = layers_device(model)
    emb_device = model.get_input_embeddings().weight.device
    kwargs: dict[str, Any] = {}
    if offset:
        kwargs["position_ids"] = torch.arange(offset, t, device=device).unsqueeze(0).expand(b, -1)
    # no padding left: no mask, so every layer can take the causal kernel (see ATTENTION)
    kwargs["attention_mask"] = None if bool(mask.all()) else mask.to(device)
    with torch.inference_mode():
        states = _forward_collecting(model, input_ids=ids.to(emb_device), use_cache=False, **kwargs)
    return TowerOutput(states, mask, offset)


def _forward_collecting(model: nn.Module, **kwargs: Any) -> tuple[torch.Tensor, ...]:
    """``model(**kwargs)`` and its ``L`` hidden states in transformers' convention: the input of
    layer 0 (the scaled embeddings), the outputs of layers ``0..L-3``, and the final-normed
    output of the last layer.

    They are collected by forward hooks on the decoder layers, outside any compiled region, not
    by transformers' ``output_hidden_states`` capture, whose hooks read a ``ContextVar`` that
    Dynamo cannot trace (two graph breaks inside every compiled layer). A model compiled as a
    whole (``compile_text_tower(scope="model")``) keeps transformers' capture, which its graph
    includes.
    """
    if model._compiled_call_impl is not None:
        return tuple(model(output_hidden_states=True, **kwargs).hidden_states)
    states: list[torch.Tensor] = []
    layers = model.layers
    handles = [layers[0].register_forward_pre_hook(lambda m, args: states.append(args[0]))]
    handles += [layer.register_forward_hook(
                    lambda m, args, out: states.append(out[0] if isinstance(out, tuple) else out))
                for layer in layers[:-1]]
    try:
        out = model(output_hidden_states=False, **kwargs)
    finally:
        for h in handles:
            h.remove()
    states.append(out.last_hidden_state)
    return tuple(states)


# --------------------------------------------------------------------------- compile


def copy_sharing_weights(model: torch.nn.Module, *, own_config: bool = False) -> torch.nn.Module:
    """A new module tree equal to ``model`` that shares its parameters and buffers.

    ``copy.deepcopy`` with every tensor entered in the memo as itself: every module object (with
    its own child table, hooks and attributes) is new, no tensor is copied. Modules compiled in
    ``model`` start uncompiled in the copy (their compiled call would run the original module).

    Args:
        own_config: give the copy its own deep copy of the config (so e.g. switching its
            attention implementation leaves ``model`` alone); by default the config is shared.
    """
    memo: dict[int, Any] = {id(t): t for t in itertools.chain(model.parameters(), model.buffers())}
    if not own_config:
        memo[id(model.config)] = model.config
    new = copy.deepcopy(model, memo)
    for module in new.modules():
        if module._compiled_call_impl is not None:
            module._compiled_call_impl = None
    return new


def _install_capture_hooks(model: torch.nn.Module) -> None:
    """Run one eager 1-token forward asking for hidden states: transformers installs its
    hidden-state capture hooks lazily on the first such call, under a ``threading.Lock`` that
    Dynamo cannot trace (a graph break; an error with ``fullgraph=True``)."""
    device = model.get_input_embeddings().weight.device
    with torch.inference_mode():
        ids = torch.zeros((1, 1), dtype=torch.long, device=device)
        model(input_ids=ids, output_hidden_states=True, use_cache=False)


def compile_text_tower(
    tower: GemmaTextTower, scope: Literal["model", "layers"] = "model", **compile_kwargs: Any
) -> GemmaTextTower:
    """A copy of ``tower`` whose Gemma forward runs through ``torch.compile``.

    The copy's model is a new ``Gemma3TextModel`` module tree sharing every parameter, buffer and
    the config with ``tower.model`` (no weight memory is added); ``tower`` itself stays
    uncompiled, and :func:`encode_hidden_states` gives the same hidden states on either (bit for
    bit with ``backend="eager"``; to compiler rounding with Inductor).

    Args:
        scope: what is compiled.

            * ``"model"`` (default): the whole ``Gemma3TextModel`` is compiled
              (``nn.Module.compile``): one graph with the masks and the hidden-state capture
              included, no graph break (``fullgraph=True`` holds), so the most room for fusion and
              for CUDA graphs (``mode="reduce-overhead"``); compile time grows with the depth (all
              48 layers are traced and inlined) and is paid again for every new input shape
              unless the sizes are dynamic.
            * ``"layers"`` (regional compilation, PyTorch's recipe for models made of repeated
              blocks: https://docs.pytorch.org/tutorials/recipes/regional_compilation.html): each
              decoder layer's ``forward`` is compiled (its module hooks stay eager). The layers
              share one code object and, with ``torch._dynamo.config.inline_inbuilt_nn_modules``
              (the default since torch 2.5), take their weights as graph inputs, so one graph per
              attention type (sliding / full) serves all layers: the compile cost of one or two
              layers, not 48. The embedding, the mask construction and the final norm run eagerly;
              :func:`run_tower` collects the hidden states with hooks between the compiled layers.
        compile_kwargs: passed to ``torch.compile`` (``backend``, ``mode`` such as
            ``"max-autotune"``, ``dynamic``, ``options``, ``fullgraph`` for ``scope="model"``).
            Each new input shape recompiles until Dynamo marks the sizes dynamic (on the second
            shape by default); ``dynamic=True`` starts dynamic, ``dynamic=False`` never is.

    Dynamo's ``recompile_limit`` is raised to at least 64, process-wide (see the code: the
    decoder layers of every compiled tower share one code object and its 8 default graphs).

    Returns:
        A ``GemmaTextTower`` equal to ``tower`` except for ``model``.

    Raises:
        ValueError: ``scope`` is neither ``"model"`` nor ``"layers"``.
    """
    if scope not in ("model", "layers"):
        raise ValueError(f"scope must be 'model' (whole model) or 'layers' (regional compilation), got {scope!r}")
    model = copy_sharing_weights(tower.model)
    # Dynamo keeps at most ``recompile_limit`` (8) graphs per code object and then runs it eager,
    # silently; every decoder layer of every compiled tower in the process shares one code
    # object, and one tower with a mix of prompts already needs about 7 (batch of one or more,
    # padded or not, static then dynamic lengths), so a pool that swaps encoders would run out.
    import torch._dynamo

    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 64)
    if scope == "model":
        _install_capture_hooks(model)
        model.compile(**compile_kwargs)
    else:  # the forward only: module hooks (run_tower's hidden-state collection) stay outside
        for layer in model.layers:
            layer.forward = torch.compile(layer.forward, **compile_kwargs)
    return dataclasses.replace(tower, model=model)


# --------------------------------------------------------------------------- encode


def encode_hidden_states(
    tower: GemmaTextTower, input_ids: torch.Tensor, attention_mask: torch.Tensor
) -> tuple[torch.Tensor, ...]:
    """Run the text tower and return all ``L = num_hidden_layers + 1`` hidden states.

    Args:
        input_ids: ``[B, T]`` int64 token ids (as from :func:`tokenize`).
        attention_mask: ``[B, T]``, 1 for real tokens, 0 for padding.

    Returns:
        ``L`` tensors ``[B, T, D]`` in the model's dtype on its device: index 0 is the scaled
        embedding output (``embed * sqrt(D)``), indices 1..L-2 the raw decoder-layer outputs, and
        index L-1 the last layer's output *after* the final RMSNorm (transformers'
        ``hidden_states`` convention, which ComfyUI's ``intermediate_output="all"`` matches).
        Values at padded positions are meaningless; callers mask or trim them.

    Raises:
        ValueError: shapes differ or are not 2-D.
    """
    return run_tower(tower, input_ids, attention_mask, trim=False).hidden_states
