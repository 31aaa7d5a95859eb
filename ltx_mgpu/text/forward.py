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
  with that one difference, so a batch without padding runs ``is_causal=True`` kernels: on an
  H200 at 8x1024 tokens, Gemma 3 12B's attention shape takes 0.22 ms per call causal vs 0.62 ms
  with a mask (cuDNN; ``benchmarks/profile_text.py --attention``).
* **Embedding table in host memory** (:func:`offload_embeddings`): the 262208 x 3840 bf16 table
  of Gemma 3 12B is 2.0 GB, a quarter of an NF4 tower's GPU memory, for a lookup of ``T`` rows
  (7.5 MB per 1024-token prompt). :class:`HostEmbedding` keeps it on the CPU, gathers the rows
  into pinned memory and copies them to the GPU, where the ``sqrt(D)`` scale is applied exactly
  as ``Gemma3TextScaledWordEmbedding`` does.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

if TYPE_CHECKING:  # pragma: no cover
    from ltx_mgpu.text.gemma import GemmaTextTower

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


def layers_device(model: nn.Module) -> torch.device:
    """The device of the first decoder layer (where hidden states are computed)."""
    return next(model.layers[0].parameters()).device


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


def run_tower(tower: "GemmaTextTower", input_ids: torch.Tensor, attention_mask: torch.Tensor, *,
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
        out = model(input_ids=ids.to(emb_device), output_hidden_states=True, use_cache=False, **kwargs)
    return TowerOutput(tuple(out.hidden_states), mask, offset)
