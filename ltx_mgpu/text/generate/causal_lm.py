"""Gemma 3 as a causal LM over a loaded text tower, generating with transformers' ``generate``:
:class:`GemmaGenerator`.

The tower (``ltx_mgpu.text.gemma.tower.GemmaTextTower``: bf16 / fp32 weights, ComfyUI's quantized
files dequantized, a GGUF file's packed layers, NF4, on one device or spread by Accelerate) is
wrapped, not copied, into a ``Gemma3ForCausalLM``: its ``Gemma3TextModel`` is the LM's ``model``
and the LM head is the token-embedding table (Gemma 3 ties them; ComfyUI's ``BaseGenerate.logits``
multiplies by ``embed_tokens.weight`` too). The head is made when the first generation asks for
it: the table itself where it lies dense on a device the layers use, else a dense copy on the
layers' device (an NF4 tower keeps its table in host memory, a GGUF one packed: 2 GB more GPU
memory for Gemma 3 12B in bf16).

An image (``image_tokens``: the vision tower's soft tokens, ``ltx_mgpu.text.gemma.vision``) goes
where ComfyUI puts it (``SDClipModel.process_tokens``, ``comfy/sd1_clip.py``): the prompt's first
``<image_soft_token>`` id (262144, ComfyUI's) is taken out and the soft tokens are spliced in its
place, so the prompt runs as embeddings (``inputs_embeds``) one row longer per soft token but
one; the attention stays causal over them, as ComfyUI's ``generate`` runs it (no bidirectional
image attention, no ``<start_of_image>`` around them). A prompt without that id ignores the
image, as ComfyUI does.

What ComfyUI's ``BaseGenerate.generate`` does and how it is matched:

* the prompt's ids, pads included, run without an attention mask (so the pads are attended,
  at positions 0..): the attention mask passed is all ones;
* greedy: the argmax of the logits; sampling: :class:`~ltx_mgpu.text.generate.sampling.ComfySampling`
  with transformers' own warpers off, the device's default generator seeded with the seed for
  the call (``torch.random.fork_rng``: the process's RNG state is restored afterwards);
* the stop tokens end the generation and are part of the output; at most ``max_length`` tokens.

Where the result can still differ from ComfyUI's, said once: the model's arithmetic is
transformers' Gemma 3, not ComfyUI's (same operations; kernels and summation order differ, so
logits agree to the compute dtype's rounding and a near-tie can pick another token, more likely
in bf16); ComfyUI embeds each *generated* token in the Gemma file's dtype (its scaled embedding
runs in the weight's dtype for a token it feeds back, in float32 for the prompt's), transformers
in the compute dtype for both: with an fp32 computation of a bf16 file the generated tokens'
embeddings differ by the file dtype's rounding (not at all where ``sqrt(hidden)`` is a power of
two); transformers' ``Gemma3TextScaledWordEmbedding`` multiplies by ``sqrt(hidden)`` rounded to the
weight dtype, ComfyUI by the float32 value: in bf16 the embeddings differ by that rounding.

Speed: with ``compile`` (the text encoder's ``compile`` switch) and the layers on one CUDA device,
transformers runs the decode steps on a static KV cache through ``torch.compile`` (its
auto-compile: CUDA graphs); otherwise eagerly on its dynamic cache (sliding-window layers keep only
their window). An NF4 tower decodes through bitsandbytes' own ``Linear4bit`` (its one-token kernel
reads the 4-bit weights once) instead of the encoder's layer-wise dequantization.
"""

from __future__ import annotations

import contextlib
import copy
import time
from dataclasses import dataclass
from typing import Callable, Iterator, Sequence

import torch
import torch.nn.functional as F
from torch import nn
from transformers import (
    Gemma3ForCausalLM,
    GenerationConfig,
    LogitsProcessorList,
    StoppingCriteria,
    StoppingCriteriaList,
)

from ltx_mgpu.quantized.packed import PackedEmbedding, dequantize_rows
from ltx_mgpu.text.gemma.forward import HostEmbedding, copy_sharing_weights
from ltx_mgpu.text.gemma.tower import GemmaTextTower, layers_device
from ltx_mgpu.text.generate.options import GenerateOptions
from ltx_mgpu.text.generate.sampling import ComfySampling
from ltx_mgpu.text.generate.tokens import BOS, IMAGE_SOFT_TOKEN, PAD
from ltx_mgpu.text.nf4.dequant import installed_fast_dequant

__all__ = ["GenerationResult", "GemmaGenerator", "GenerationCancelled"]


class GenerationCancelled(Exception):
    """``should_stop`` asked to stop a generation before it ended (carries the tokens so far)."""

    def __init__(self, tokens: list[int]):
        super().__init__(f"generation stopped after {len(tokens)} tokens")
        self.tokens = tokens


@dataclass(frozen=True)
class GenerationResult:
    """One generation.

    Attributes:
        tokens: the generated ids (the stop token included when one ended it).
        stopped: a stop token ended it (else ``max_length`` did).
        prompt_tokens: the prompt's ids, pads included.
        first_token_s: seconds from the call to the first token (the prompt's forward).
        seconds: seconds of the whole call.
    """

    tokens: list[int]
    stopped: bool
    prompt_tokens: int
    first_token_s: float
    seconds: float


class _TiedHead(nn.Module):
    """Gemma 3's LM head: ``x @ weight.T`` with the token-embedding table (``[V, D]``), computed
    where the table is (the hidden state moves there: under an Accelerate map the last layer may
    sit on another device)."""

    def __init__(self, weight: torch.Tensor):
        super().__init__()
        self.weight = weight if isinstance(weight, nn.Parameter) else nn.Parameter(weight, requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x.to(self.weight.device), self.weight)


class _CausalLM(Gemma3ForCausalLM):
    """``Gemma3ForCausalLM`` whose inputs go where the decoder layers run (not to its first
    parameter's device: an NF4 tower's embedding table is in host memory)."""

    @property
    def device(self) -> torch.device:
        return layers_device(self.model)


class _Watch(StoppingCriteria):
    """Per generated token: time the first, report the count, stop when asked to."""

    def __init__(self, prompt_length: int, should_stop: Callable[[], bool] | None,
                 on_token: Callable[[int], None] | None):
        self.prompt_length, self.should_stop, self.on_token = prompt_length, should_stop, on_token
        self.first: float | None = None
        self.cancelled = False

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor, **kwargs) -> torch.BoolTensor:
        if self.first is None:
            self.first = time.perf_counter()
        if self.on_token is not None:
            self.on_token(int(input_ids.shape[1]) - self.prompt_length)
        if self.should_stop is not None and self.should_stop():
            self.cancelled = True
        return torch.full((input_ids.shape[0],), self.cancelled, dtype=torch.bool, device=input_ids.device)


def _compiled_layers(model: nn.Module) -> bool:
    """Whether ``model``'s decoder layers run ``torch.compile``d forwards (``compile_text_tower``,
    ``scope="layers"``: a compiled function set on each layer)."""
    return any(hasattr(layer.__dict__.get("forward"), "_torchdynamo_orig_callable") for layer in model.layers)


def _uncompiled(model: nn.Module) -> nn.Module:
    """``model``, or a module tree sharing its weights without the layers' compiled forwards
    (those were compiled for the encoder's shapes; generation compiles its own, if at all)."""
    if not _compiled_layers(model):
        return model
    plain = copy_sharing_weights(model)
    for layer in plain.layers:
        layer.__dict__.pop("forward", None)
    return plain


def _head_weight(model: nn.Module, dtype: torch.dtype) -> torch.Tensor:
    """The LM head's table ``[V, D]`` (module doc): the embedding's own weight when it is a dense
    table on a device, else a dense copy on the layers' device in ``dtype``."""
    emb = model.get_input_embeddings()
    device = layers_device(model)
    if isinstance(emb, HostEmbedding):
        return emb.weight.detach().to(device=device, dtype=dtype, copy=True)
    if isinstance(emb, PackedEmbedding):
        return dequantize_rows(emb.packed(), emb.qtype, emb.embedding_dim, dtype).to(device)
    return emb.weight


@contextlib.contextmanager
def _seeded(seed: int | None, device: torch.device) -> Iterator[None]:
    """The default generator of ``device`` seeded with ``seed`` (as ``torch.Generator(device)
    .manual_seed(seed)``), its state and the CPU's restored afterwards."""
    if seed is None:
        yield
        return
    cuda = [device.index if device.index is not None else torch.cuda.current_device()] if device.type == "cuda" else []
    with torch.random.fork_rng(devices=cuda, device_type="cuda" if cuda else "cpu"):
        if cuda:
            torch.cuda.default_generators[cuda[0]].manual_seed(seed)
        else:
            torch.random.default_generator.manual_seed(seed)
        yield


class GemmaGenerator:
    """Generation with transformers' ``generate`` on a loaded text tower (module doc).

    Args:
        tower: the loaded tower (its weights are shared, not copied).
        compile: decode on a static cache through ``torch.compile`` where the layers sit on one
            CUDA device (transformers' auto-compile); else eager on the dynamic cache.
        static_cache: force the static cache on (True) or off (False) whatever ``compile`` says;
            on a CPU or without ``compile`` it runs eagerly (transformers compiles on GPUs only).
    """

    def __init__(self, tower: GemmaTextTower, compile: bool = False, static_cache: bool | None = None):
        self.tower, self.compile, self.static_cache = tower, compile, static_cache
        self._lm: _CausalLM | None = None

    @property
    def dtype(self) -> torch.dtype:
        """The compute dtype (the final norm's)."""
        return self.tower.model.norm.weight.dtype

    def reset(self) -> None:
        """Drop the LM head and wrapper (made again by the next generation): after the tower's
        weights changed (a LoRA merged into the embedding table)."""
        self._lm = None

    def causal_lm(self) -> _CausalLM:
        """The ``Gemma3ForCausalLM`` over the tower (made on first use)."""
        if self._lm is None:
            model = _uncompiled(self.tower.model)
            with torch.device("meta"):
                lm = _CausalLM(copy.deepcopy(self.tower.config))
            lm.model = model
            lm.lm_head = _TiedHead(_head_weight(model, self.dtype))
            lm.generation_config = GenerationConfig()
            self._lm = lm.eval()
        return self._lm

    def _config(self, options: GenerateOptions, device: torch.device) -> GenerationConfig:
        static = self.static_cache
        if static is None:
            static = self.compile and device.type == "cuda" and not getattr(self.tower.model, "hf_device_map", None)
        settings = {"max_new_tokens": options.max_length, "min_new_tokens": 0, "num_beams": 1, "use_cache": True,
                    "do_sample": not options.greedy, "pad_token_id": PAD, "bos_token_id": BOS,
                    "eos_token_id": list(options.stop_tokens) or None,
                    "cache_implementation": "static" if static else None}
        if not options.greedy:  # transformers' warpers off: ComfySampling does ComfyUI's
            settings.update(temperature=1.0, top_k=0, top_p=1.0, repetition_penalty=1.0)
        if static and not (self.compile and device.type == "cuda"):
            settings["disable_compile"] = True
        return GenerationConfig(**settings)

    def generate(self, prompt_ids: Sequence[int], options: GenerateOptions, *,
                 should_stop: Callable[[], bool] | None = None,
                 on_token: Callable[[int], None] | None = None,
                 image_tokens: torch.Tensor | None = None) -> GenerationResult:
        """Generate from ``prompt_ids`` (:meth:`GenerationTokenizer.prompt_ids
        <ltx_mgpu.text.generate.tokens.GenerationTokenizer.prompt_ids>`) with ``options``.

        Args:
            should_stop: polled once per generated token; True ends the generation.
            on_token: called once per generated token with the count so far.
            image_tokens: ``[N, D]`` soft tokens of an image (``GemmaVision``'s), spliced in place
                of the prompt's first :data:`IMAGE_SOFT_TOKEN` (module doc).

        Raises:
            GenerationCancelled: ``should_stop`` said so.
            ValueError: an empty prompt, or an id outside the vocabulary.
            torch.OutOfMemoryError and what the model raises.
        """
        vocab = int(self.tower.config.vocab_size)
        if not prompt_ids:
            raise ValueError("generate needs at least one prompt token")
        prompt_ids = [int(i) for i in prompt_ids]
        at = prompt_ids.index(IMAGE_SOFT_TOKEN) if image_tokens is not None and IMAGE_SOFT_TOKEN in prompt_ids else None
        bad = [i for n, i in enumerate(prompt_ids) if not 0 <= i < vocab and n != at]
        if bad:
            raise ValueError(f"prompt token ids {bad[:8]} are outside Gemma's {vocab}-token vocabulary")
        t0 = time.perf_counter()
        lm = self.causal_lm()
        device = lm.device
        ids = torch.tensor([prompt_ids], dtype=torch.long, device=device)
        if at is None:
            inputs, prompt_length, length = {"input_ids": ids, "attention_mask": torch.ones_like(ids)}, len(ids[0]), 0
        else:
            embeds = self._spliced(lm, ids, at, image_tokens)
            # inputs_embeds alone: transformers' output and input_ids then hold the new tokens only
            length = int(embeds.shape[1])
            inputs, prompt_length = {"inputs_embeds": embeds, "attention_mask": torch.ones(
                embeds.shape[:2], dtype=torch.long, device=device)}, 0
        watch = _Watch(prompt_length, should_stop, on_token)
        processors = [] if options.greedy else [ComfySampling(options, prompt_length, self.dtype)]
        fast = installed_fast_dequant(lm.model)
        with _seeded(None if options.greedy else options.seed, device), \
                (fast.bypassed() if fast is not None else contextlib.nullcontext()):
            out = lm.generate(**inputs, generation_config=self._config(options, device),
                              logits_processor=LogitsProcessorList(processors),
                              stopping_criteria=StoppingCriteriaList([watch]))
        tokens = [int(t) for t in out[0, prompt_length:].tolist()]
        if watch.cancelled:
            raise GenerationCancelled(tokens)
        end = time.perf_counter()
        stopped = bool(tokens) and tokens[-1] in options.stop_tokens
        first = (watch.first if watch.first is not None else end) - t0
        return GenerationResult(tokens, stopped, length or len(prompt_ids), first, end - t0)

    def _spliced(self, lm: _CausalLM, ids: torch.Tensor, at: int, image_tokens: torch.Tensor) -> torch.Tensor:
        """The prompt's embeddings ``[1, T - 1 + N, D]`` with ``image_tokens`` ``[N, D]`` in place
        of the id at ``at`` (module doc)."""
        if image_tokens.ndim != 2 or image_tokens.shape[1] != self.tower.hidden_size:
            raise ValueError(f"image tokens of shape {list(image_tokens.shape)} do not fit Gemma's "
                             f"{self.tower.hidden_size}-wide embeddings")
        embed = lm.get_input_embeddings()
        before, after = embed(ids[:, :at]).to(ids.device), embed(ids[:, at + 1:]).to(ids.device)
        image = image_tokens.to(device=ids.device, dtype=before.dtype)[None]
        return torch.cat([before, image, after], dim=1)
