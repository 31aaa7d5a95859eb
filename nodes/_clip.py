"""The Gemma Loader's ``CLIP`` output: the pool's Gemma behind ComfyUI's CLIP interface.

ComfyUI's LTX-2 templates encode prompts with core ``CLIPTextEncode`` on the CLIP of
``LTXAVTextEncoderLoader``. :class:`GemmaClip` is a CLIP those nodes accept, so a template keeps
its ``CLIPTextEncode`` nodes and takes the Gemma Loader's ``clip`` output instead of that
loader's. It is duck-typed (the pack imports without ComfyUI, so it cannot subclass
``comfy.sd.CLIP``); it has what ComfyUI 0.20.1's core nodes call on a CLIP (``nodes.py``
``CLIPTextEncode``, ``CLIPSetLastLayer``, ``LoraLoader`` through ``comfy.sd.load_lora_for_models``;
the CLIP class in ``comfy/sd.py``):

* ``tokenize(text, return_word_ids=False, **kwargs)`` -> ``{"ltx_mgpu_prompt": text}``: the
  prompt's text. Gemma tokenises it in the pool as ComfyUI's LTX-2 tokenizer does
  (``Gemma3_12BTokenizer`` in ``comfy/text_encoders/lt.py`` with ``SDTokenizer`` in
  ``comfy/sd1_clip.py``: raw text, no chat template, prompt weights off, ``\\(`` / ``\\)`` lose
  their backslash, ``<bos>`` first, no ``<eos>``; ``ltx_mgpu.text.gemma.tokenizer.tokenize``).
  ComfyUI pads a prompt on the left to ``min_length`` 1024 and drops the padding after Gemma;
  that changes the real tokens' states only by rounding (RoPE is relative), so the pool runs a
  prompt at its own length. A prompt is never cut: one over 1024 tokens is encoded whole, as
  ComfyUI does. ``return_word_ids``, ``tokenizer_options`` (``set_tokenizer_option``),
  ``min_length`` and ``disable_weights`` do not change ComfyUI's LTX-2 tokens
  (``Gemma3_Tokenizer.tokenize_with_weights`` does not pass them on) and do not change ours.
* ``encode_from_tokens(tokens, return_pooled=False, return_dict=False)`` -> the conditioning
  tensor ``[1, T, D]`` float32 on CPU (``T`` the prompt's tokens, BOS included; ``D`` 3840 for
  LTX-2.0, 6144 for LTX-2.3), ``(tensor, None)`` with ``return_pooled``, or
  ``{"cond": tensor, "pooled_output": None, "unprocessed_ltxav_embeds": True}`` with
  ``return_dict``: ComfyUI's ``LTXAVTEModel.encode_token_weights`` result, which drops Gemma's
  attention mask (all ones once the padding is cut).
* ``encode_from_tokens_scheduled(tokens, unprojected=False, add_dict={}, show_pbar=True)`` ->
  ``[[tensor, {"pooled_output": None, "unprocessed_ltxav_embeds": True, **add_dict}]]``, the
  CONDITIONING ``CLIPTextEncode`` returns, the same as ``LTXMGPU_PromptEncode``'s (one
  implementation: ``TextEncoderHandle.encode`` with ``whole=True``, the pool and the embedding
  cache, ``ltx_mgpu.client.text.encode_prompts``). The progress bar is the executing node's
  (``show_pbar`` is ComfyUI's bar over hook keyframes, of which there are none here). Each
  ``CLIPTextEncode`` is one request: with the loader's *keep loaded* off, Gemma is loaded and
  unloaded for each prompt that is not cached (Prompt Encode does the pair with one load).
* ``clone()``, ``clip_layer(idx)`` and ``set_tokenizer_option(name, value)``: kept on the clone,
  without effect on the embedding, as in ComfyUI (its Gemma runs with ``layer="all"``, which
  ignores the layer option; LTX-2 conditions on every Gemma layer).
* ``add_patches(patches, strength_patch=1.0, strength_model=1.0)`` -> ``[]``: no text-encoder
  LoRA is applied (Gemma runs in the pool), which is logged once per process.
  ``cond_stage_model.state_dict()`` is empty, so ``comfy.lora.model_lora_keys_clip`` maps no
  LoRA key to the text encoder and ComfyUI logs such keys as not loaded.

**Which form the conditioning takes.** Always the *unprocessed* form (the flag
``unprocessed_ltxav_embeds``; the embeddings connectors run in the denoiser), for LTX-2.0 as
for 2.3. For an LTX-2.0 checkpoint whose audio connector has fewer than three blocks, 3840
wide (``LTXAVTEModel.load_sd``), ComfyUI's own text encoder runs the connectors itself
(``enable_compat_mode``, marked "TODO: remove") and emits the *processed* form,
``[1, max(1024, T), 2 x 3840]`` (the connectors' registers fill it to 1024 rows), without the
flag. We emit the unprocessed form because it is what ComfyUI's encoder emits in every other
case, what Prompt Encode emits and the embedding cache holds (one entry serves both nodes), it
needs no connector weights in the text encoder (the denoiser has them), and it is the smaller
tensor. ComfyUI's sampler runs the same connectors on it (``LTXAV.extra_conds`` ->
``preprocess_text_embeds``, ``comfy/model_base.py`` and ``comfy/ldm/lightricks/av_model.py``),
as our SP Sampler does; both samplers also take the processed form
(``ltx_mgpu.denoise.comfyui.conditioning`` passes it through).

Anything else ComfyUI's CLIP has (``patcher``, ``load_model``, ``get_sd``, ``generate``...) is
an :class:`UnsupportedClipFeature` (an ``AttributeError``) naming what to use instead, so
``hasattr`` is False and a node that needs it stops with that message.
"""

from __future__ import annotations

import logging
import re
import threading
from typing import Any, Protocol, Sequence

from . import _comfy

__all__ = ["TOKENS_KEY", "GemmaClip", "PoolTextEncoderModel", "UnsupportedClipFeature"]

log = logging.getLogger(__name__)

#: The key of :meth:`GemmaClip.tokenize`'s result (ComfyUI keys its token lists by tokenizer name).
TOKENS_KEY = "ltx_mgpu_prompt"
#: ComfyUI's textual-inversion syntax (``SDTokenizer.tokenize_with_weights``): ``embedding:`` at
#: the start of the text or after a space or a newline.
_EMBEDDING_SYNTAX = re.compile(r"(?:^|[ \n])embedding:")
_ELSEWHERE = ("load the text encoder with ComfyUI's LTXAVTextEncoderLoader for that node; the Gemma Loader's clip "
              "output encodes prompts (CLIPTextEncode and the nodes built on tokenize and encode)")

_lora_warned = threading.Event()


class UnsupportedClipFeature(AttributeError):
    """A part of ComfyUI's CLIP that :class:`GemmaClip` does not have (Gemma runs in the pool)."""


class _Handle(Protocol):
    """What the CLIP needs of ``nodes.text.TextEncoderHandle``."""

    def encode(self, prompts: list[str], use_cache: bool = True, node_id: str | None = None, batch_size: int = 8,
               whole: bool = False) -> tuple[list, Any, Any]: ...


class PoolTextEncoderModel:
    """``GemmaClip.cond_stage_model``: Gemma lives in the pool, not in this process.

    ``state_dict()`` is empty (``comfy.lora.model_lora_keys_clip`` reads only its keys); any
    other attribute of ComfyUI's text encoder model raises :class:`UnsupportedClipFeature`.
    """

    def state_dict(self, *args: Any, **kwargs: Any) -> dict:
        return {}

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        raise UnsupportedClipFeature(
            f"the Gemma Loader's CLIP has no text encoder model in ComfyUI's process (Gemma runs in the pool), so "
            f"cond_stage_model.{name} does not exist; {_ELSEWHERE}")


class GemmaClip:
    """A ComfyUI ``CLIP`` whose prompts are encoded by the pool's Gemma (see the module doc).

    Args:
        handle: the Gemma Loader's ``LTXMGPU_TEXT_ENCODER`` (``nodes.text.TextEncoderHandle``).
    """

    def __init__(self, handle: _Handle, layer_idx: int | None = None,
                 tokenizer_options: dict[str, Any] | None = None):
        self.handle = handle
        self.cond_stage_model = PoolTextEncoderModel()
        self.layer_idx = layer_idx
        self.tokenizer_options = dict(tokenizer_options or {})

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__") or name in ("handle", "cond_stage_model"):
            raise AttributeError(name)
        raise UnsupportedClipFeature(
            f"the Gemma Loader's CLIP has no {name!r} (ComfyUI's CLIP has it for its own text encoder model; Gemma "
            f"runs in the pool); {_ELSEWHERE}")

    def __repr__(self) -> str:
        config = getattr(self.handle, "config", None)
        return f"GemmaClip({getattr(config, 'gemma', self.handle)!s})"

    # ---- ComfyUI's CLIP surface

    def clone(self) -> GemmaClip:
        """A copy sharing the text encoder, with its own layer and tokenizer options."""
        return GemmaClip(self.handle, self.layer_idx, self.tokenizer_options)

    def clip_layer(self, layer_idx: int) -> None:
        """``CLIPSetLastLayer``: kept, no effect (as in ComfyUI: LTX-2 uses every Gemma layer)."""
        self.layer_idx = layer_idx

    def set_tokenizer_option(self, option_name: str, value: Any) -> None:
        """Kept and passed on as ComfyUI does; it does not change LTX-2 tokens (module doc)."""
        self.tokenizer_options[option_name] = value

    def add_patches(self, patches: dict, strength_patch: float = 1.0, strength_model: float = 1.0) -> list:
        """Apply no weight patch and return ``[]`` (no key patched): the text encoder's LoRA weights
        are not applied to the pool's Gemma. Logged once per process when a LoRA reaches it."""
        if patches and strength_patch != 0 and not _lora_warned.is_set():
            _lora_warned.set()
            log.warning("LTX-2 Multi-GPU: LoRA weights for the text encoder are not applied to the Gemma Loader's "
                        "CLIP (Gemma runs in the pool), so strength_clip has no effect; the LoRA's diffusion-model "
                        "weights are applied as usual.")
        return []

    def tokenize(self, text: str, return_word_ids: bool = False, **kwargs: Any) -> dict[str, str]:
        """``{TOKENS_KEY: text}``; Gemma tokenises ``text`` in the pool as ComfyUI does.

        Raises:
            ValueError: ``text`` is not a string; it uses ComfyUI's ``embedding:<name>``
                textual-inversion syntax (ComfyUI would splice in an embedding file, or drop the
                word when there is none); ``image``, ``llama_template`` or ``skip_template=False``
                (a chat template or an image: not what LTX-2 encodes).
        """
        if not isinstance(text, str):
            raise ValueError(f"CLIP.tokenize takes the prompt as a string, got {type(text).__name__}")
        # the arguments that change ComfyUI's LTX-2 tokens (Gemma3_Tokenizer.tokenize_with_weights):
        # an image to splice in, or a chat template (skip_template=False; a text that starts with
        # <start_of_turn> is left as it is)
        templated = not kwargs.get("skip_template", True) and not text.startswith("<start_of_turn>")
        for name, given in (("image", kwargs.get("image") is not None),
                            ("llama_template", kwargs.get("llama_template") is not None and templated),
                            ("skip_template", templated)):
            if given:
                raise ValueError(f"the Gemma Loader's CLIP encodes LTX-2 prompts as plain text; tokenize({name}=...) "
                                 f"(an image or a chat template) is not supported; {_ELSEWHERE}")
        found = _EMBEDDING_SYNTAX.search(text)
        if found is not None:
            at = found.end() - len("embedding:")
            raise ValueError(
                f"the prompt uses ComfyUI's textual-inversion syntax 'embedding:' (character {at}: "
                f"{text[at:at + 40]!r}); the Gemma Loader's CLIP does not load embedding files (ComfyUI would "
                "splice one in from models/embeddings, or drop the word when there is none). Remove 'embedding:' "
                "or write it without the space before it.")
        return {TOKENS_KEY: text}

    def encode_from_tokens(self, tokens: Any, return_pooled: bool | str = False, return_dict: bool = False) -> Any:
        """The conditioning tensor ``[1, T, D]`` float32 CPU; ``(tensor, None)`` with
        ``return_pooled`` (``True`` or ``"unprojected"``: LTX-2 has no pooled output); the dict
        ``{"cond", "pooled_output": None, "unprocessed_ltxav_embeds": True}`` with ``return_dict``.

        Raises:
            ValueError: ``tokens`` are not this CLIP's :meth:`tokenize` result.
            ComfyUI's interrupt exception (Stop), and the pool's errors (``PoolError`` kinds,
            e.g. ``BadInputError`` for a prompt over the protocol's token bound).
        """
        text = self._text(tokens)
        embeddings, report, _ = self.handle.encode([text], use_cache=True, node_id=_comfy.executing_node_id(),
                                                   whole=True)
        log.debug("LTX-2 Multi-GPU CLIP encode: %s", report)
        ((cond, opts),) = embeddings[0].to_conditioning()
        if return_dict:
            return {"cond": cond, **opts}
        if return_pooled:
            return cond, opts["pooled_output"]
        return cond

    def encode_from_tokens_scheduled(self, tokens: Any, unprojected: bool = False, add_dict: dict | None = None,
                                     show_pbar: bool = True) -> list:
        """``CLIPTextEncode``'s CONDITIONING: ``[[tensor [1, T, D], {"pooled_output": None,
        "unprocessed_ltxav_embeds": True, **add_dict}]]`` (one entry: no hooks to schedule).

        Raises:
            As :meth:`encode_from_tokens`.
        """
        opts = self.encode_from_tokens(tokens, return_pooled="unprojected" if unprojected else True,
                                       return_dict=True)
        cond = opts.pop("cond")
        opts.update(add_dict or {})
        return [[cond, opts]]

    def encode(self, text: str) -> Any:
        """``encode_from_tokens(tokenize(text))``: the conditioning tensor."""
        return self.encode_from_tokens(self.tokenize(text))

    @staticmethod
    def _text(tokens: Any) -> str:
        if isinstance(tokens, dict) and set(tokens) == {TOKENS_KEY} and isinstance(tokens[TOKENS_KEY], str):
            return tokens[TOKENS_KEY]
        keys: Sequence[Any] = sorted(map(str, tokens)) if isinstance(tokens, dict) else [type(tokens).__name__]
        raise ValueError(
            f"the Gemma Loader's CLIP got tokens it did not make ({keys}); encode the tokens of its own "
            "tokenize(text), not another CLIP's or edited ones")
