"""Text nodes: Gemma 3 in the pool, prompt encoding through the embedding cache.

* **Gemma Loader** (``LTXMGPU_GemmaLoader``) -> ``LTXMGPU_TEXT_ENCODER`` and the same text
  encoder as a ComfyUI ``CLIP`` (:class:`nodes._clip.GemmaClip`, for core ``CLIPTextEncode``):
  which Gemma 3 (a file or a snapshot / NF4 directory from ``models/text_encoders``), which LTX-2
  text projection (the LTX checkpoint from ``models/checkpoints``, or a projection file from
  ``models/text_encoders``), weights ``bf16 | nf4``, placement ``single | accelerate |
  batch_parallel``, keep loaded, compile (``torch.compile`` of the layers). Nothing is loaded
  here: Gemma loads in the pool on the first prompt that is not in the cache.
* **Prompt Encode** (``LTXMGPU_PromptEncode``) -> two CONDITIONING in ComfyUI's LTX-2 form
  (``[[float32 [1, T, D] on CPU, {"pooled_output": None, "unprocessed_ltxav_embeds": True}]]``,
  ``ltx_mgpu.text.features.PromptEmbedding.to_conditioning``), so core ``LTXVConditioning``,
  ``CFGGuider`` ... take them unchanged.
* **Prompt Batch Encode** (``LTXMGPU_PromptBatchEncode``) -> STRING: fills the cache with one
  prompt per line (an interrupted batch resumes).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ltx_mgpu.choices import PLACEMENTS, WEIGHTS
from ltx_mgpu.text.config import TextEncoderConfig

from . import _comfy
from ._clip import GemmaClip
from ._runtime import CATEGORY, POOL, TEXT_ENCODER, JobWatch, PoolHandle

#: Files that make a directory in ``models/text_encoders`` a Gemma source (HF snapshot, NF4 artifact).
GEMMA_DIR_MARKERS = ("config.json", "ltx_mgpu_nf4.json")
#: Folders a projection source may come from (prefix of the picker's entries).
PROJECTION_FOLDERS = ("checkpoints", "text_encoders")


def gemma_choices() -> list[str]:
    """Gemma sources in ``models/text_encoders``: snapshot / NF4 directories (``name/``) and
    single files outside them."""
    dirs = _comfy.directory_list("text_encoders", GEMMA_DIR_MARKERS)
    files = [f for f in _comfy.filename_list("text_encoders") if not any(f.startswith(d) for d in dirs)]
    return dirs + files


def projection_choices() -> list[str]:
    """``checkpoints/<LTX checkpoint>`` and ``text_encoders/<projection file>`` entries."""
    return [f"{folder}/{name}" for folder in PROJECTION_FOLDERS for name in _comfy.filename_list(folder)]


def resolve_projection(choice: str) -> str:
    """The absolute path of a :func:`projection_choices` entry (or of an absolute path).

    Raises:
        FileNotFoundError: not found; the message names the folders searched.
    """
    folder, _, name = choice.partition("/")
    if folder in PROJECTION_FOLDERS and name:
        return _comfy.full_path(folder, name)
    return _comfy.full_path("checkpoints", choice)


@dataclass(frozen=True)
class TextEncoderHandle:
    """The ``LTXMGPU_TEXT_ENCODER`` value: the pool, the text encoder's config and whether Gemma
    stays loaded."""

    pool: PoolHandle
    config: TextEncoderConfig
    keep_loaded: bool = True

    def encode(self, prompts: list[str], use_cache: bool = True, node_id: str | None = None, batch_size: int = 8,
               whole: bool = False) -> tuple[list, Any, Any]:
        """``(embeddings, CacheReport, cache)`` of ``prompts`` through the cache and the pool
        (``ltx_mgpu.client.text.encode_prompts``), with the progress bar of node ``node_id`` and
        Stop; Gemma is unloaded afterwards when it is not to stay loaded. ``whole``: no prompt is
        cut at the token budget (the CLIP output, as ComfyUI's LTX-2 text encoder). The
        embeddings are ``PromptEmbedding`` s, float32 ``[T_i, D]`` on CPU; ``cache`` is None
        without ``use_cache``.

        Raises:
            ComfyUI's interrupt exception (Stop), and what ``encode_prompts`` raises.
        """
        from ltx_mgpu.client.text import default_cache, encode_prompts

        cache = default_cache() if use_cache else None
        session = self.pool.session()
        with JobWatch(node_id) as watch:
            embeddings, report = encode_prompts(session, self.config, prompts, cache=cache, batch_size=batch_size,
                                                keep=False, on_progress=watch.on_progress,
                                                should_cancel=watch.should_cancel, whole=whole)
            if not self.keep_loaded and report.encoded:
                session.request("unload", {"names": ["text_encoder", "text_embeddings"]}, timeout=120)
            watch.done()
        return embeddings, report, cache


def _combo(choices: list[str], tooltip: str, **extra: Any) -> tuple:
    opts = {"tooltip": tooltip, **extra}
    if choices:
        opts.setdefault("default", choices[0])
    return (choices, opts)


class LTXMGPUGemmaLoader:
    """-> (``LTXMGPU_TEXT_ENCODER``, ``CLIP``: a :class:`GemmaClip` of it). Raises FileNotFoundError /
    GemmaFormatError (headers only) / ValueError (weights, placement, compile with NF4 or accelerate)
    before anything is loaded."""

    @classmethod
    def INPUT_TYPES(cls):
        return {
            "required": {
                "pool": (POOL, {"tooltip": "The pool Gemma runs in (from the Pool node)."}),
                "gemma": _combo(gemma_choices(), (
                    "Gemma 3 12B from models/text_encoders: a Hugging Face snapshot directory (gemma-3-12b-it/), "
                    "ComfyUI's single file (gemma_3_12B_it*.safetensors: bf16, fp8_scaled or fp4_mixed, whose "
                    "quantized layers are dequantized as ComfyUI does) or an ltx_mgpu NF4 directory.")),
                "projection": _combo(projection_choices(), (
                    "Where the LTX-2 text projection comes from: the LTX-2 checkpoint you sample with "
                    "(checkpoints/...), or a separate projection file (text_encoders/...). Its version (2.0 or "
                    "2.3) decides the embedding layout.")),
                "weights": (list(WEIGHTS), {"default": "bf16", "tooltip": (
                    "bf16: Gemma as is (about 24 GB). nf4: 4-bit NormalFloat through bitsandbytes (about 8 GB, "
                    "slightly different embeddings, cached separately); an NF4 directory is always nf4.")}),
                "placement": (list(PLACEMENTS), {"default": "single", "tooltip": (
                    "single: Gemma on the pool's first GPU. accelerate: its layers sharded over all the pool's "
                    "GPUs (when one GPU is too small). batch_parallel: a copy per GPU, prompts split across "
                    "them (fastest for many prompts).")}),
                "keep_loaded": ("BOOLEAN", {"default": True, "tooltip": (
                    "Keep Gemma in the pool after encoding (faster next time). Off: unload it right after, "
                    "leaving the GPUs' memory to the LTX-2 transformer.")}),
            },
            "optional": {
                "compile": ("BOOLEAN", {"default": False, "tooltip": (
                    "Run Gemma's layers through torch.compile: Gemma takes longer to load (it compiles), and new "
                    "kinds of batch compile on first use; then encoding is faster. bf16 weights, placement single "
                    "or batch_parallel.")}),
            },
        }

    RETURN_TYPES = (TEXT_ENCODER, "CLIP")
    RETURN_NAMES = ("text_encoder", "clip")
    OUTPUT_TOOLTIPS = (
        "Gemma 3 + LTX-2 projection in the pool; connect it to Prompt Encode.",
        "The same text encoder as a ComfyUI CLIP, for CLIPTextEncode (in LTX-2 templates it replaces "
        "LTXAVTextEncoderLoader's output): prompts encode in the pool, through the embedding cache, whole (no "
        "cut at 1024 tokens), exactly as ComfyUI's own LTX-2 text encoder. Text-encoder LoRAs are not applied.")
    FUNCTION = "load"
    CATEGORY = CATEGORY
    DESCRIPTION = ("Chooses Gemma 3 and the LTX-2 text projection for the pool. Gemma is loaded on the first "
                   "prompt that is not already in the embedding cache.")

    def load(self, pool: PoolHandle, gemma: str, projection: str, weights: str, placement: str, keep_loaded: bool,
             compile: bool = False):
        from ltx_mgpu.client.text import check_sources

        config = TextEncoderConfig(_comfy.full_path("text_encoders", gemma), resolve_projection(projection),
                                   weights=weights, placement=placement, compile=bool(compile))
        check_sources(config)  # headers only: a wrong file fails here, naming the supported formats
        handle = TextEncoderHandle(pool, config, bool(keep_loaded))
        return (handle, GemmaClip(handle))


class LTXMGPUPromptEncode:
    """-> (positive, negative) CONDITIONING: ``[[float32 [1, T, D] CPU, {"pooled_output": None,
    "unprocessed_ltxav_embeds": True}]]`` each (D = 3840 for LTX-2.0, 6144 for 2.3; T = real tokens)."""

    @classmethod
    def INPUT_TYPES(cls):
        return {
            "required": {
                "text_encoder": (TEXT_ENCODER, {"tooltip": "Gemma 3 in the pool (from the Gemma Loader)."}),
                "positive": ("STRING", {"multiline": True, "default": "", "tooltip": (
                    "What the video shows and sounds like.")}),
                "negative": ("STRING", {"multiline": True, "default": "", "tooltip": (
                    "What to steer away from (used when cfg > 1).")}),
                "use_cache": ("BOOLEAN", {"default": True, "tooltip": (
                    "Look prompts up in the embedding cache first and store new ones; a fully cached pair never "
                    "loads Gemma. The key covers the prompt, the Gemma and projection files' contents, weights "
                    "and dtype.")}),
            },
            "hidden": {"unique_id": "UNIQUE_ID"},
        }

    RETURN_TYPES = ("CONDITIONING", "CONDITIONING")
    RETURN_NAMES = ("positive", "negative")
    OUTPUT_TOOLTIPS = ("LTX-2 conditioning of the positive prompt (ComfyUI's own format).",
                       "LTX-2 conditioning of the negative prompt.")
    FUNCTION = "encode"
    CATEGORY = CATEGORY
    DESCRIPTION = "Encodes a positive and a negative prompt with Gemma 3 in the pool, through the embedding cache."

    def encode(self, text_encoder: TextEncoderHandle, positive: str, negative: str, use_cache: bool,
               unique_id: str | None = None):
        embeddings, _, _ = text_encoder.encode([positive, negative], bool(use_cache), unique_id)
        return (embeddings[0].to_conditioning(), embeddings[1].to_conditioning())


class LTXMGPUPromptBatchEncode:
    """-> STRING cache report (``CacheReport`` + cache directory). Raises ValueError on no prompts."""

    @classmethod
    def INPUT_TYPES(cls):
        return {
            "required": {
                "text_encoder": (TEXT_ENCODER, {"tooltip": "Gemma 3 in the pool (from the Gemma Loader)."}),
                "prompts": ("STRING", {"multiline": True, "default": "", "tooltip": (
                    "One prompt per line (empty lines are skipped). Already cached prompts are not encoded again.")}),
                "batch_size": ("INT", {"default": 8, "min": 1, "max": 256, "tooltip": (
                    "Prompts per Gemma forward pass (per GPU with batch_parallel). Larger is faster until "
                    "memory runs out; results are stored after every batch.")}),
            },
            "hidden": {"unique_id": "UNIQUE_ID"},
        }

    RETURN_TYPES = ("STRING",)
    RETURN_NAMES = ("report",)
    OUTPUT_TOOLTIPS = ("How many prompts were cached already, how many were encoded, and where the cache is.",)
    FUNCTION = "encode"
    CATEGORY = CATEGORY
    OUTPUT_NODE = True
    DESCRIPTION = "Precomputes the embeddings of a prompt list into the cache (resumes where it stopped)."

    def encode(self, text_encoder: TextEncoderHandle, prompts: str, batch_size: int, unique_id: str | None = None):
        lines = [line.strip() for line in prompts.splitlines() if line.strip()]
        if not lines:
            raise ValueError("Prompt Batch Encode: no prompts; write one prompt per line")
        _, report, cache = text_encoder.encode(lines, True, unique_id, batch_size=int(batch_size))
        text = f"{report} (cache: {cache.root})"
        return {"ui": {"text": [text]}, "result": (text,)}


NODE_CLASS_MAPPINGS = {
    "LTXMGPU_GemmaLoader": LTXMGPUGemmaLoader,
    "LTXMGPU_PromptEncode": LTXMGPUPromptEncode,
    "LTXMGPU_PromptBatchEncode": LTXMGPUPromptBatchEncode,
}
NODE_DISPLAY_NAME_MAPPINGS = {
    "LTXMGPU_GemmaLoader": "LTX-2 Multi-GPU Gemma Loader",
    "LTXMGPU_PromptEncode": "LTX-2 Multi-GPU Prompt Encode",
    "LTXMGPU_PromptBatchEncode": "LTX-2 Multi-GPU Prompt Batch Encode",
}
