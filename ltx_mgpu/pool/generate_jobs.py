"""The pool's ``generate`` job: ComfyUI's ``CLIP.generate`` on the resident Gemma 3
(``ltx_mgpu.text.generate``).

Rank 0 holds Gemma in every placement (``single``, ``accelerate``: its layers over the pool's
GPUs; ``batch_parallel``: one replica per rank), so rank 0 generates and the other ranks wait for
its outcome. Rank 0 tokenizes the prompt as ComfyUI does, runs transformers' ``generate`` on the
causal LM over the resident tower (with the patch set the request names merged, as ``encode``)
and decodes the tokens as ComfyUI's ``CLIP.decode`` does. The generator (LM head, tokenizer) is
made by the first ``generate`` on a loaded encoder and kept with it.

Cancel: rank 0 polls the client's cancel once per token (``JobContext.cancel_requested``) and
stops transformers' loop; then every rank meets at one ``check_cancel`` and the job ends
``cancelled`` everywhere. Progress: ``("generate", tokens so far, max_length)``, at most every
:data:`PROGRESS_EVERY_S` seconds and at the end.

Image: the request's tensor ``image`` (``[B, h, w, 3]`` float32, the image as ComfyUI's Gemma
tokenizer leaves it: ``ltx_mgpu.text.generate.image.tokenizer_image``) is prepared for the vision
tower as ComfyUI's model prepares it (``vision_pixels``), run through the source's SigLIP and
projector (``ltx_mgpu.text.gemma.vision``, loaded on rank 0's layer device by the first
generation with an image and kept with the encoder; the resident patch set's vision keys merged into
it when it loads and whenever the set changes: ``ltx_mgpu.text.encoder.patches.VisionPatches``) and
spliced in place of the prompt's first
``<image_soft_token>`` (``ltx_mgpu.text.generate.causal_lm``). A source without a vision tower
refuses it (``bad_input``, naming the fix). A prompt without that token ignores the image, as
ComfyUI's tokenizer does: the vision tower is neither loaded nor run for it.

Errors: the options, the prompt's text and the image are checked on every rank before any work
(:class:`~ltx_mgpu.text.generate.options.GenerateOptions`, ``check_prompts``, ``check_tokenized``:
an image larger than the tokenizer leaves one or of a long side over ``MAX_ASPECT`` times its short
side is refused);
what only rank 0 can find (no vision tower, the prompt's tokens over the protocol's bound, out of
memory) is agreed: ``bad_input``, the pool keeps serving.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import torch

from ltx_mgpu.pool.engines import BadInput, JobContext, failure_message, free_memory, register_engine
from ltx_mgpu.pool.text_jobs import resident_text_encoder
from ltx_mgpu.text.gemma.tokenizer import check_prompts
from ltx_mgpu.text.gemma.vision import find_vision, load_vision
from ltx_mgpu.text.generate.causal_lm import GemmaGenerator, GenerationCancelled, GenerationResult
from ltx_mgpu.text.generate.image import check_tokenized, vision_pixels
from ltx_mgpu.text.generate.options import GenerateOptions
from ltx_mgpu.text.generate.tokens import IMAGE_SOFT_TOKEN, GenerationTokenizer, sentencepiece_model
from ltx_mgpu.wire.messages import MAX_TEXT_TOKENS

__all__ = ["PROGRESS_EVERY_S", "NO_VISION_TOWER", "NoVisionTower", "Generation", "generate"]

#: The least seconds between two progress events of a generation (one per token would be
#: thousands of events for a long text).
PROGRESS_EVERY_S = 0.1
#: Why an image is refused by a Gemma source without a vision tower, and the fix.
NO_VISION_TOWER = ("has no vision tower (SigLIP and the multi-modal projector), so it cannot read an image: load a "
                   "Gemma 3 file that has one, e.g. ComfyUI's gemma_3_12B_it_fp4_mixed.safetensors (the one the "
                   "LTX-2.3 templates name) or a Gemma3ForConditionalGeneration snapshot (a GGUF keeps it in a "
                   "separate mmproj file, an NF4 artifact drops it), or disconnect the image and describe it in the "
                   "prompt")


class NoVisionTower(ValueError):
    """An image for a Gemma source without a vision tower (the message names the fix)."""


@dataclass(eq=False)
class Generation:
    """What a resident text encoder generates with (rank 0): its tokenizer for generation and
    the generator over its tower."""

    tokenizer: GenerationTokenizer
    generator: GemmaGenerator
    vision: Any = field(default=None, repr=False)

    def reset(self) -> None:
        """The tower's weights changed: the generator makes its LM head again (the vision tower's
        patches are merged into it in place: ``ltx_mgpu.text.encoder.patches.VisionPatches``)."""
        self.generator.reset()

    def image_tokens(self, image: Any, patches: Any = None) -> Any:
        """The soft tokens ``[B * mm_tokens_per_image, D]`` of ``image`` (module doc); the vision
        tower is loaded on first use, and then takes ``patches`` (the resident encoder's
        ``VisionPatches``, which keeps it patched from then on; None: no patch set yet).

        Raises:
            NoVisionTower: the source has no vision tower (:data:`NO_VISION_TOWER`).
        """
        tower = self.generator.tower
        if self.vision is None:
            source = find_vision(tower.path)
            if source is None:
                raise NoVisionTower(f"the Gemma source {tower.path} {NO_VISION_TOWER}")
            vision = load_vision(source, tower.config, tower.device)
            if patches is not None:
                patches.attach(vision)
            self.vision = vision
        with torch.inference_mode():
            return self.vision(vision_pixels(image.to(tower.device, torch.float32), self.vision.image_size))


def _generation(state) -> Generation:
    if state.generation is None:
        tower = state.encoder.tower
        state.generation = Generation(GenerationTokenizer(tower, sentencepiece_model(tower)),
                                      GemmaGenerator(tower, compile=state.request.config.compile))
    return state.generation


@register_engine("generate")
def generate(ctx: JobContext, params: dict, tensors: dict) -> tuple[dict, dict]:
    """Generate text from a prompt with the resident Gemma (module doc).

    Params: ``text`` (the prompt as ComfyUI's tokenizer gets it: the chat template, if any,
    already applied), ``expect``, ``patches`` (as ``encode``) and the options of
    :class:`~ltx_mgpu.text.generate.options.GenerateOptions` (``do_sample``, ``max_length``,
    ``temperature``, ``top_k``, ``top_p``, ``min_p``, ``repetition_penalty``,
    ``presence_penalty``, ``seed``, ``stop_tokens``, ``pad_to``). Tensors: ``image`` (optional,
    module doc).

    Returns (rank 0):
        ``{"tokens": generated ids (the stop token included), "text": CLIP.decode's text,
        "text_with_special": the same with skip_special_tokens=False, "stopped": a stop token
        ended it, "prompt_tokens", "tokenizer": "sentencepiece" | "transformers", "seconds":
        {"first_token", "total"}, "decode_tokens_per_second"}``.

    Raises:
        BadInput: options out of range (named), a prompt that is not Unicode text, an image that
            is not a finite ``[B, H, W, 3+]`` float tensor as the tokenizer leaves one
            (``check_tokenized``), no encoder or another one or another
            patch set (as ``encode``); a source without a vision tower for an image, a prompt of
            more than ``MAX_TEXT_TOKENS`` ids, out of memory or any failure of rank 0's generation
            (agreed).
        JobCancelled: the client cancelled (every rank).
    """
    try:
        options = GenerateOptions.from_params(params)
        check_prompts([params["text"]], "text")
        extra = sorted(set(tensors) - {"image"})
        if extra:
            raise ValueError(f"the generate request carries unexpected tensor(s) {extra[:5]}; it takes 'image' only")
        image = check_tokenized(tensors["image"], "the request's image") if "image" in tensors else None
    except ValueError as e:
        raise BadInput(str(e)) from None
    state = resident_text_encoder(ctx, params)
    error, result, texts, kind = None, None, ("", ""), ""
    if ctx.is_main:
        last = [0.0]

        def on_token(n: int) -> None:
            now = time.perf_counter()
            if n >= options.max_length or now - last[0] >= PROGRESS_EVERY_S:
                last[0] = now
                ctx.progress("generate", min(n, options.max_length), options.max_length)

        try:
            generation = _generation(state)
            kind = generation.tokenizer.kind
            ids = generation.tokenizer.prompt_ids(params["text"], options.pad_to)
            if len(ids) > MAX_TEXT_TOKENS:
                raise ValueError(f"the prompt has {len(ids)} tokens, over the protocol's {MAX_TEXT_TOKENS}; "
                                 "shorten it")
            ctx.progress("generate", 0, options.max_length)
            # ComfyUI reads an image only in place of an <image_soft_token> (its tokenizer drops it otherwise)
            read = image is not None and IMAGE_SOFT_TOKEN in ids
            loads_vision = read and generation.vision is None
            vision_patches = state.merged.vision if state.merged is not None else None
            image_tokens = generation.image_tokens(image, vision_patches) if read else None
            if loads_vision:  # status counts the vision tower's bytes from now on
                state.publish(ctx)
            result = generation.generator.generate(ids, options, should_stop=ctx.cancel_requested, on_token=on_token,
                                                   image_tokens=image_tokens)
            texts = (generation.tokenizer.decode(result.tokens), generation.tokenizer.decode(result.tokens, False))
            ctx.progress("generate", options.max_length, options.max_length)
        except GenerationCancelled:
            result = None
        except NoVisionTower as e:
            error, result = str(e), None
        except Exception as e:  # noqa: BLE001 - rank 0's failure alone: agreed below
            error = failure_message(e, "generating")
            result = None
            free_memory(ctx.device)
    ctx.agree(error)
    ctx.check_cancel()
    if not ctx.is_main:
        return {}, {}
    return _result(result, texts, kind), {}


def _result(result: GenerationResult, texts: tuple[str, str], kind: str) -> dict:
    decoded = len(result.tokens) - 1
    decode_s = result.seconds - result.first_token_s
    return {"tokens": result.tokens, "text": texts[0], "text_with_special": texts[1], "stopped": result.stopped,
            "prompt_tokens": result.prompt_tokens,
            "tokenizer": kind, "seconds": {"first_token": result.first_token_s, "total": result.seconds},
            "decode_tokens_per_second": decoded / decode_s if decoded > 0 and decode_s > 0 else None}
