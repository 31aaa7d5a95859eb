"""The Gemma Loader's ``CLIP`` output: the pool's Gemma behind ComfyUI's CLIP interface.

ComfyUI's LTX-2 templates encode prompts with core ``CLIPTextEncode`` on the CLIP of
``LTXAVTextEncoderLoader``. :class:`GemmaClip` is a CLIP those nodes accept, so a template keeps
its ``CLIPTextEncode`` nodes and takes the Gemma Loader's ``clip`` output instead of that
loader's. It is duck-typed (the pack imports without ComfyUI, so it cannot subclass
``comfy.sd.CLIP``); it has what ComfyUI 0.20.1's core nodes call on a CLIP (``nodes.py``
``CLIPTextEncode``, ``CLIPSetLastLayer``, ``LoraLoader`` through ``comfy.sd.load_lora_for_models``;
the CLIP class in ``comfy/sd.py``):

* ``tokenize(text, return_word_ids=False, **kwargs)`` -> ``{"ltx_mgpu_prompt": text}``: the
  prompt's text, after ComfyUI's chat template when one is asked for (``skip_template=False``
  with a text that does not start with ``<start_of_turn>``: ``Gemma3_Tokenizer``'s
  ``llama_template``, ComfyUI's default or the one given; then ``"ltx_mgpu_template": True``
  marks it). Gemma tokenises it in the pool as ComfyUI does: for encoding as ComfyUI's LTX-2
  tokenizer (``Gemma3_12BTokenizer`` in ``comfy/text_encoders/lt.py`` with ``SDTokenizer`` in
  ``comfy/sd1_clip.py``: raw text, prompt weights off, ``\\(`` / ``\\)`` lose their backslash,
  ``<bos>`` first, no ``<eos>``; ``ltx_mgpu.text.gemma.tokenizer.tokenize``), for generation
  with its SentencePiece model exactly as ComfyUI's ``CLIP.tokenize`` makes the ids
  (``ltx_mgpu.text.generate.tokens``). ComfyUI pads a prompt on the left to ``min_length`` 1024
  and drops the padding after Gemma; that changes the real tokens' states only by rounding
  (RoPE is relative), so the pool encodes a prompt at its own length (it generates from the
  padded ids, as ComfyUI). A prompt is never cut: one over 1024 tokens is encoded whole, as
  ComfyUI does. ``return_word_ids``, ``tokenizer_options`` (``set_tokenizer_option``),
  ``min_length``, ``disable_weights``, ``thinking``, ``video`` and ``audio`` do not change
  ComfyUI's LTX-2 tokens (``Gemma3_Tokenizer.tokenize_with_weights`` does not pass them on) and
  do not change ours. An ``image`` (``TextGenerate`` / ``TextGenerateLTX2Prompt`` with one
  connected) is kept in the tokens (``"ltx_mgpu_image"``; ``generate`` prepares it as ComfyUI's
  Gemma tokenizer does: ``ltx_mgpu.client.text.generate_text``); with ``skip_template=False`` and
  no template given, ComfyUI's image template (``llama_template_images``) wraps the text. Refused
  when the Gemma file has no vision tower (below).
* ``encode_from_tokens(tokens, return_pooled=False, return_dict=False)`` -> the conditioning
  tensor ``[1, T, D]`` float32 on CPU (``T`` the prompt's tokens, BOS included; ``D`` 3840 for
  LTX-2.0, 6144 for LTX-2.3), ``(tensor, None)`` with ``return_pooled``, or
  ``{"cond": tensor, "pooled_output": None, "unprocessed_ltxav_embeds": True}`` with
  ``return_dict``: ComfyUI's ``LTXAVTEModel.encode_token_weights`` result, which drops Gemma's
  attention mask (all ones once the padding is cut). Tokens made with a chat template or an
  image are refused (LTX-2 encodes prompts as plain text).
* ``encode_from_tokens_scheduled(tokens, unprojected=False, add_dict={}, show_pbar=True)`` ->
  ``[[tensor, {"pooled_output": None, "unprocessed_ltxav_embeds": True, **add_dict}]]``, the
  CONDITIONING ``CLIPTextEncode`` returns, the same as ``LTXMGPU_PromptEncode``'s (one
  implementation: ``TextEncoderHandle.encode`` with ``whole=True``, the pool and the embedding
  cache, ``ltx_mgpu.client.text.encode_prompts``). The progress bar is the executing node's
  (``show_pbar`` is ComfyUI's bar over hook keyframes, of which there are none here). Each
  ``CLIPTextEncode`` is one request: with the loader's *keep loaded* off, Gemma is loaded and
  unloaded for each prompt that is not cached (Prompt Encode does the pair with one load).
* ``generate(tokens, do_sample, max_length, temperature, top_k, top_p, min_p,
  repetition_penalty, seed, presence_penalty)`` -> the generated token ids, and
  ``decode(ids, skip_special_tokens=True)`` -> their text: what ComfyUI's ``TextGenerate`` and
  ``TextGenerateLTX2Prompt`` (the prompt enhancer of the LTX-2.3 templates) call. The pool runs
  Gemma 3 as a causal LM with transformers' ``generate`` on its loaded Gemma (every weights mode
  and placement), with ComfyUI's sampler, seed and stop token (``ltx_mgpu.text.generate``;
  ``ltx_mgpu.pool.generate_jobs``); the progress bar is the node's, Stop ends it at the next
  token. The tokens' image travels to the pool as raw float32 bytes; the pool runs it through the
  Gemma file's SigLIP vision tower and projector (transformers', loaded with the first image) and
  puts the soft tokens where the prompt's first ``<image_soft_token>`` is, as ComfyUI does.
  ``decode`` takes the ids this CLIP's ``generate`` returned (the pool decoded them).
* ``clone()``, ``clip_layer(idx)`` and ``set_tokenizer_option(name, value)``: kept on the clone,
  without effect on the embedding, as in ComfyUI (its Gemma runs with ``layer="all"``, which
  ignores the layer option; LTX-2 conditions on every Gemma layer).
* ``add_patches(patches, strength_patch=1.0, strength_model=1.0)`` (``LoraLoader``'s CLIP
  strength): kept on the clone as ComfyUI's ``ModelPatcher`` keeps them, for the keys of
  ``cond_stage_model.state_dict()``, as meta tensors: ComfyUI's names of every weight of its
  LTX-2 text encoder (``LTXAVTEModel``, ``comfy/text_encoders/lt.py``), which
  ``comfy.lora.model_lora_keys_clip`` maps a LoRA's text-encoder keys onto: the Gemma text
  tower's (``gemma3_12b.transformer.model.<weight>``), the LTX-2 text projection's
  (``text_embedding_projection.weight`` for LTX-2.0, ``text_embedding_projection.{video,audio}_
  aggregate_embed.{weight,bias}`` for 2.3) and, when the Gemma file has a vision tower, its
  SigLIP's and projector's (``gemma3_12b.transformer.vision_model.<weight>``,
  ``gemma3_12b.transformer.multi_modal_projector.<weight>``); returns the keys taken. Encodes and
  generations of a CLIP with patches run with them merged into the pool's text encoder as
  ComfyUI merges them (``ltx_mgpu.text.encoder.patches.EncoderPatches``: the tower, the
  projection, and the vision tower when an image loads it) and are cached under the patches'
  content id; a CLIP without patches gets the loaded weights back. Only plain LoRAs and diffs
  merge (LoHa, LoKr, DoRA, offsets: refused, naming the key).

**Images need the vision tower.** ``tokenize(image=...)`` reads the Gemma file's headers: a file
without Gemma 3's vision tower (a text-only file or snapshot, a GGUF, whose vision tower is a
separate ``mmproj`` file, an NF4 artifact) is refused there, naming the fix: a Gemma 3 file with
the vision tower (ComfyUI's ``gemma_3_12B_it_fp4_mixed.safetensors``, the one the LTX-2.3
templates name, has it), or disconnect the image and describe it in the prompt.

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

Anything else ComfyUI's CLIP has (``patcher``, ``load_model``, ``get_sd``, hooks...) is an
:class:`UnsupportedClipFeature` (an ``AttributeError``) naming what to use instead, so
``hasattr`` is False and a node that needs it stops with that message.
"""

from __future__ import annotations

import collections
import logging
import re
from typing import Any, Protocol, Sequence

from . import _comfy

__all__ = ["TOKENS_KEY", "TEMPLATE_KEY", "IMAGE_KEY", "COMFY_CHAT_TEMPLATE", "COMFY_CHAT_TEMPLATE_IMAGES", "GemmaClip",
           "PoolTextEncoderModel", "UnsupportedClipFeature"]

log = logging.getLogger(__name__)

#: The key of :meth:`GemmaClip.tokenize`'s result (ComfyUI keys its token lists by tokenizer name).
TOKENS_KEY = "ltx_mgpu_prompt"
#: Set (True) in :meth:`GemmaClip.tokenize`'s result when a chat template was applied.
TEMPLATE_KEY = "ltx_mgpu_template"
#: ComfyUI's default chat template of Gemma 3 (``Gemma3_Tokenizer.llama_template``, ``comfy/text_encoders/lt.py``).
COMFY_CHAT_TEMPLATE = ("<start_of_turn>system\nYou are a helpful assistant.<end_of_turn>\n<start_of_turn>user\n{}"
                       "<end_of_turn>\n<start_of_turn>model\n")
#: ComfyUI's textual-inversion syntax (``SDTokenizer.tokenize_with_weights``): ``embedding:`` at
#: the start of the text or after a space or a newline.
_EMBEDDING_SYNTAX = re.compile(r"(?:^|[ \n])embedding:")
_ELSEWHERE = ("load the text encoder with ComfyUI's LTXAVTextEncoderLoader for that node; the Gemma Loader's clip "
              "output encodes prompts (CLIPTextEncode and the nodes built on tokenize and encode) and generates "
              "text (TextGenerate, TextGenerateLTX2Prompt)")
#: The key of :meth:`GemmaClip.tokenize`'s result that holds the image (ComfyUI's IMAGE as given).
IMAGE_KEY = "ltx_mgpu_image"
#: ComfyUI's chat template of Gemma 3 for a prompt with an image (``Gemma3_Tokenizer.llama_template_images``).
COMFY_CHAT_TEMPLATE_IMAGES = ("<start_of_turn>system\nYou are a helpful assistant.<end_of_turn>\n<start_of_turn>user\n"
                              "\n<image_soft_token>{}<end_of_turn>\n\n<start_of_turn>model\n")
#: Generations whose text :meth:`GemmaClip.decode` remembers, per CLIP.
_DECODED = 8



class UnsupportedClipFeature(AttributeError):
    """A part of ComfyUI's CLIP that :class:`GemmaClip` does not have (Gemma runs in the pool)."""


class _Handle(Protocol):
    """What the CLIP needs of ``nodes.text.TextEncoderHandle``."""

    config: Any

    def encode(self, prompts: list[str], use_cache: bool = True, node_id: str | None = None, batch_size: int = 8,
               whole: bool = False, patches: Any = None) -> tuple[list, Any, Any]: ...

    def generate(self, text: str, options: dict, patches: Any = None, node_id: str | None = None,
                 image: Any = None) -> dict: ...


class PoolTextEncoderModel:
    """``GemmaClip.cond_stage_model``: Gemma lives in the pool, not in this process.

    ``state_dict()`` names the text encoder's weights as ComfyUI's LTX-2 text encoder does (the
    Gemma text tower's, the text projection's, the vision tower's and projector's when the Gemma
    file has them: module doc), as meta tensors of their shapes: all that
    ``comfy.lora.model_lora_keys_clip`` reads (read from the files' headers on first use,
    ``ltx_mgpu.client.text.clip_weight_keys``). Any other attribute of ComfyUI's text encoder
    model raises :class:`UnsupportedClipFeature`.
    """

    def __init__(self, handle: _Handle | None = None):
        self._handle = handle

    def state_dict(self, *args: Any, **kwargs: Any) -> dict:
        if self._handle is None:
            return {}
        import torch  # deferred: the CLIP's other calls need no tensors in ComfyUI's process

        from ltx_mgpu.client.text import clip_weight_keys

        return {k: torch.empty(shape, device="meta") for k, shape in clip_weight_keys(self._handle.config).items()}

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__") or name == "_handle":
            raise AttributeError(name)
        raise UnsupportedClipFeature(
            f"the Gemma Loader's CLIP has no text encoder model in ComfyUI's process (Gemma runs in the pool), so "
            f"cond_stage_model.{name} does not exist; {_ELSEWHERE}")


class GemmaClip:
    """A ComfyUI ``CLIP`` whose prompts are encoded by the pool's Gemma (see the module doc).

    Args:
        handle: the Gemma Loader's ``LTXMGPU_TEXT_ENCODER`` (``nodes.text.TextEncoderHandle``).
        patches: ComfyUI key -> ``[(strength, adapter, strength_model, offset, function)]``
            (``add_patches``; a clone copies the lists).
    """

    def __init__(self, handle: _Handle, layer_idx: int | None = None,
                 tokenizer_options: dict[str, Any] | None = None, patches: dict[str, list] | None = None):
        self.handle = handle
        self.cond_stage_model = PoolTextEncoderModel(handle)
        self.layer_idx = layer_idx
        self.tokenizer_options = dict(tokenizer_options or {})
        self.patches = {k: list(v) for k, v in (patches or {}).items()}
        self._decoded: collections.OrderedDict[tuple[int, ...], dict] = collections.OrderedDict()

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__") or name in ("handle", "cond_stage_model", "patches", "_decoded"):
            raise AttributeError(name)
        raise UnsupportedClipFeature(
            f"the Gemma Loader's CLIP has no {name!r} (ComfyUI's CLIP has it for its own text encoder model; Gemma "
            f"runs in the pool); {_ELSEWHERE}")

    def __repr__(self) -> str:
        config = getattr(self.handle, "config", None)
        return f"GemmaClip({getattr(config, 'gemma', self.handle)!s}, {len(self.patches)} patched weights)"

    # ---- ComfyUI's CLIP surface

    def clone(self) -> GemmaClip:
        """A copy sharing the text encoder, with its own layer and tokenizer options and patch lists."""
        return GemmaClip(self.handle, self.layer_idx, self.tokenizer_options, self.patches)

    def clip_layer(self, layer_idx: int) -> None:
        """``CLIPSetLastLayer``: kept, no effect (as in ComfyUI: LTX-2 uses every Gemma layer)."""
        self.layer_idx = layer_idx

    def set_tokenizer_option(self, option_name: str, value: Any) -> None:
        """Kept and passed on as ComfyUI does; it does not change LTX-2 tokens (module doc)."""
        self.tokenizer_options[option_name] = value

    def add_patches(self, patches: dict, strength_patch: float = 1.0, strength_model: float = 1.0) -> list:
        """Keep ``patches`` (``LoraLoader``: ComfyUI key or ``(key, offset[, function])`` -> adapter)
        for the keys of ``cond_stage_model.state_dict()``, as ComfyUI's ``ModelPatcher.add_patches``
        keeps them; returns the keys taken (ComfyUI reports the others as not loaded).

        Raises:
            ltx_mgpu.client.model.PatchFormatError: a patch the pool cannot merge (LyCORIS,
                DoRA, an offset or a function), naming the key, before any pool work.
        """
        from ltx_mgpu.client.model import wire_patches

        if not patches:
            return []
        known = self.cond_stage_model.state_dict()
        taken = []
        for k, adapter in patches.items():
            key, offset, function = (k, None, None) if isinstance(k, str) else (*k[:2], k[2] if len(k) > 2 else None)
            if key not in known:
                continue
            entry = (strength_patch, adapter, strength_model, offset, function)
            wire_patches({key: [entry]}, lambda v: "check")  # refuses what the pool cannot merge, by key
            self.patches.setdefault(key, []).append(entry)
            taken.append(k)
        return taken

    def tokenize(self, text: str, return_word_ids: bool = False, **kwargs: Any) -> dict[str, Any]:
        """``{TOKENS_KEY: text}`` (``TEMPLATE_KEY: True`` added when a chat template was applied);
        Gemma tokenises ``text`` in the pool as ComfyUI does (module doc).

        Raises:
            ValueError: ``text`` is not a string; it uses ComfyUI's ``embedding:<name>``
                textual-inversion syntax (ComfyUI would splice in an embedding file, or drop the
                word when there is none); an ``image`` for a Gemma file without a vision tower
                (the message names the fix).
        """
        if not isinstance(text, str):
            raise ValueError(f"CLIP.tokenize takes the prompt as a string, got {type(text).__name__}")
        image = kwargs.get("image")
        if image is not None:
            image = self._image(image)
        # Gemma3_Tokenizer.tokenize_with_weights: a text that starts with <start_of_turn> is used
        # as it is; else skip_template=False wraps it in the given or the default chat template
        templated = not kwargs.get("skip_template", True) and not text.startswith("<start_of_turn>")
        if templated:
            template = kwargs.get("llama_template")
            default = COMFY_CHAT_TEMPLATE if image is None else COMFY_CHAT_TEMPLATE_IMAGES
            text = (template if template is not None else default).format(text)
        found = _EMBEDDING_SYNTAX.search(text)
        if found is not None:
            at = found.end() - len("embedding:")
            raise ValueError(
                f"the prompt uses ComfyUI's textual-inversion syntax 'embedding:' (character {at}: "
                f"{text[at:at + 40]!r}); the Gemma Loader's CLIP does not load embedding files (ComfyUI would "
                "splice one in from models/embeddings, or drop the word when there is none). Remove 'embedding:' "
                "or write it without the space before it.")
        tokens: dict[str, Any] = {TOKENS_KEY: text, TEMPLATE_KEY: True} if templated else {TOKENS_KEY: text}
        if image is not None:
            tokens[IMAGE_KEY] = image
        return tokens

    def _image(self, image: Any) -> Any:
        """``image``, once the Gemma file is known to have a vision tower (module doc)."""
        from ltx_mgpu.client.text import has_vision_tower

        config = self.handle.config
        if not has_vision_tower(config):
            raise ValueError(
                f"the Gemma file {config.gemma} has no vision tower (SigLIP and the multi-modal projector), so the "
                "Gemma Loader's CLIP cannot read the image connected to this node. Load a Gemma 3 file that has one "
                "in the Gemma Loader, e.g. ComfyUI's gemma_3_12B_it_fp4_mixed.safetensors (the one the LTX-2.3 "
                "templates name), or disconnect the image and describe it in the prompt")
        return image

    def _text_patches(self) -> Any:
        from ltx_mgpu.client.lora import text_patches

        return text_patches(self.patches)

    def encode_from_tokens(self, tokens: Any, return_pooled: bool | str = False, return_dict: bool = False) -> Any:
        """The conditioning tensor ``[1, T, D]`` float32 CPU; ``(tensor, None)`` with
        ``return_pooled`` (``True`` or ``"unprojected"``: LTX-2 has no pooled output); the dict
        ``{"cond", "pooled_output": None, "unprocessed_ltxav_embeds": True}`` with ``return_dict``.
        With patches (``add_patches``) the pool's Gemma encodes with them merged.

        Raises:
            ValueError: ``tokens`` are not this CLIP's :meth:`tokenize` result, or were made with a
                chat template (LTX-2 encodes plain text).
            ComfyUI's interrupt exception (Stop), and the pool's errors (``PoolError`` kinds,
            e.g. ``BadInputError`` for a prompt over the protocol's token bound).
        """
        text, templated, image = self._text(tokens)
        if templated or image is not None:
            made = "a chat template (tokenize(skip_template=False))" if templated else "an image"
            raise ValueError("the Gemma Loader's CLIP encodes LTX-2 prompts as plain text; these tokens were made "
                             f"with {made}; tokenize the text alone; {_ELSEWHERE}")
        embeddings, report, _ = self.handle.encode([text], use_cache=True, node_id=_comfy.executing_node_id(),
                                                   whole=True, patches=self._text_patches())
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

    def generate(self, tokens: Any, do_sample: bool = True, max_length: int = 256, temperature: float = 1.0,
                 top_k: int = 50, top_p: float = 0.95, min_p: float = 0.0, repetition_penalty: float = 1.0,
                 seed: int | None = None, presence_penalty: float = 0.0) -> list[int]:
        """ComfyUI's ``CLIP.generate`` (same arguments and defaults) on the pool's Gemma: the
        generated token ids, ``<end_of_turn>`` last when it ended the text (module doc). The
        text is kept for :meth:`decode`.

        Raises:
            ValueError: ``tokens`` are not this CLIP's; an option out of range (named), sampling
                without a seed; an image that is not a finite ComfyUI IMAGE.
            ComfyUI's interrupt exception (Stop), and the pool's errors.
        """
        text, _, image = self._text(tokens)
        options = {"do_sample": bool(do_sample), "max_length": max_length, "temperature": temperature,
                   "top_k": top_k, "top_p": top_p, "min_p": min_p, "repetition_penalty": repetition_penalty,
                   "presence_penalty": presence_penalty if presence_penalty is not None else 0.0, "seed": seed}
        result = self.handle.generate(text, options, patches=self._text_patches(), node_id=_comfy.executing_node_id(),
                                      image=image)
        ids = [int(t) for t in result["tokens"]]
        self._decoded[tuple(ids)] = result
        while len(self._decoded) > _DECODED:
            self._decoded.popitem(last=False)
        return ids

    def decode(self, token_ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        """``CLIP.decode``: the text of ids this CLIP's :meth:`generate` returned, as ComfyUI's
        tokenizer decodes them (the pool decoded them; ``skip_special_tokens=False`` keeps
        ``<end_of_turn>``).

        Raises:
            ValueError: ids that none of this CLIP's last generations returned.
        """
        result = self._decoded.get(tuple(int(t) for t in token_ids))
        if result is None:
            raise ValueError("the Gemma Loader's CLIP decodes the token ids its own generate returned (Gemma's "
                             "tokenizer is in the pool); pass generate's result unchanged")
        return result["text"] if skip_special_tokens else result["text_with_special"]

    @staticmethod
    def _text(tokens: Any) -> tuple[str, bool, Any]:
        if (isinstance(tokens, dict) and isinstance(tokens.get(TOKENS_KEY), str)
                and set(tokens) <= {TOKENS_KEY, TEMPLATE_KEY, IMAGE_KEY}):
            return tokens[TOKENS_KEY], bool(tokens.get(TEMPLATE_KEY, False)), tokens.get(IMAGE_KEY)
        keys: Sequence[Any] = sorted(map(str, tokens)) if isinstance(tokens, dict) else [type(tokens).__name__]
        raise ValueError(
            f"the Gemma Loader's CLIP got tokens it did not make ({keys}); encode the tokens of its own "
            "tokenize(text), not another CLIP's or edited ones")
