"""Text nodes: Gemma 3 in the pool, prompt encoding through the embedding cache.

* **Gemma Loader** (``LTXMGPU_GemmaLoader``) -> ``LTXMGPU_TEXT_ENCODER`` and the same text
  encoder as a ComfyUI ``CLIP`` (:class:`nodes._clip.GemmaClip`, for core ``CLIPTextEncode``):
  which Gemma 3 (a ComfyUI or GGUF file or a snapshot / NF4 directory from ``models/text_encoders``), which LTX-2
  text projection (the LTX checkpoint from ``models/checkpoints``, or a projection file from
  ``models/text_encoders``), weights ``bf16 | nf4``, placement ``single | accelerate |
  batch_parallel``, keep loaded, compile (``torch.compile`` of the layers), compute dtype
  (``auto``: ComfyUI's text encoder's on the pool's device, resolved by the client from the pool's
  spec: ``ltx_mgpu.text.config.resolve_text_dtype``). Nothing is loaded here: Gemma loads in the
  pool on the first prompt that is not in the cache.
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

from ltx_mgpu.choices import AUTO_DTYPE, PLACEMENTS, TEXT_COMPUTE_DTYPES, WEIGHTS, check_choice
from ltx_mgpu.text.config import TextEncoderConfig

from . import _comfy
from ._clip import GemmaClip
from ._comfy import io
from ._runtime import CATEGORY, JobWatch, PoolHandle, PoolType, TextEncoderType, executing_node

#: Files that make a directory in ``models/text_encoders`` a Gemma source (HF snapshot, NF4 artifact).
GEMMA_DIR_MARKERS = ("config.json", "ltx_mgpu_nf4.json")
#: Folders a projection source may come from (prefix of the picker's entries).
PROJECTION_FOLDERS = ("checkpoints", "text_encoders")


def gemma_choices() -> list[str]:
    """Gemma sources in ``models/text_encoders`` (and ``models/clip``): snapshot / NF4 directories
    (``name/``), then single files outside them: ComfyUI's ``.safetensors`` and GGUF files (where
    ComfyUI-GGUF's ``CLIPLoaderGGUF`` reads them)."""
    dirs = _comfy.directory_list("text_encoders", GEMMA_DIR_MARKERS)
    names = _comfy.filename_list("text_encoders") + _comfy.filename_list("text_encoders", (".gguf",))
    return dirs + [f for f in dict.fromkeys(names) if not any(f.startswith(d) for d in dirs)]


def projection_choices() -> list[str]:
    """``checkpoints/<LTX checkpoint>`` and ``text_encoders/<projection file>`` entries; not the
    Gemma files beside the projections in ``text_encoders`` (a name with ``gemma`` in it, or a
    file inside a Gemma snapshot / NF4 directory), which hold no projection."""
    gemma_dirs = tuple(_comfy.directory_list("text_encoders", GEMMA_DIR_MARKERS))
    return [f"{folder}/{name}" for folder in PROJECTION_FOLDERS for name in _comfy.filename_list(folder)
            if folder != "text_encoders" or not ("gemma" in name.lower() or name.startswith(gemma_dirs))]


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
               whole: bool = False, patches: Any = None) -> tuple[list, Any, Any]:
        """``(embeddings, CacheReport, cache)`` of ``prompts`` through the cache and the pool
        (``ltx_mgpu.client.text.encode_prompts``), with the progress bar of node ``node_id`` and
        Stop; Gemma is unloaded afterwards when it is not to stay loaded. ``whole``: no prompt is
        cut at the token budget (the CLIP output, as ComfyUI's LTX-2 text encoder). ``patches``:
        the CLIP's text-encoder LoRAs (``ltx_mgpu.client.lora.TextPatches``). The embeddings are
        ``PromptEmbedding`` s, float32 ``[T_i, D]`` on CPU; ``cache`` is None without ``use_cache``.

        Raises:
            ComfyUI's interrupt exception (Stop), and what ``encode_prompts`` raises.
        """
        from ltx_mgpu.client.text import default_cache, encode_prompts

        cache = default_cache() if use_cache else None
        session = self.pool.session()
        with JobWatch(node_id) as watch:
            embeddings, report = encode_prompts(session, self.config, prompts, cache=cache, batch_size=batch_size,
                                                keep=False, on_progress=watch.on_progress,
                                                should_cancel=watch.should_cancel, whole=whole, patches=patches)
            if not self.keep_loaded and report.encoded:
                self._unload(session)
            watch.done()
        return embeddings, report, cache

    def generate(self, text: str, options: dict, patches: Any = None, node_id: str | None = None,
                 image: Any = None) -> dict:
        """ComfyUI's ``CLIP.generate`` + ``decode`` on the pool's Gemma
        (``ltx_mgpu.client.text.generate_text``): ``text`` as ComfyUI's tokenizer gets it,
        ``options`` ``CLIP.generate``'s keywords, ``patches`` the CLIP's LoRAs, ``image`` the
        prompt's image as ComfyUI's Gemma tokenizer leaves it (or None); the progress bar
        of node ``node_id`` (one tick per token) and Stop; Gemma is unloaded afterwards when it is
        not to stay loaded.

        Returns:
            The pool's ``generate`` result (``tokens``, ``text``, ``text_with_special``...).

        Raises:
            ValueError (an option out of range), ComfyUI's interrupt exception (Stop), and what
            ``generate_text`` raises.
        """
        from ltx_mgpu.client.text import generate_text

        session = self.pool.session()
        with JobWatch(node_id) as watch:
            result = generate_text(session, self.config, text, options, patches=patches,
                                   on_progress=watch.on_progress, should_cancel=watch.should_cancel, image=image)
            if not self.keep_loaded:
                self._unload(session)
            watch.done()
        return result

    @staticmethod
    def _unload(session: Any) -> None:
        session.request("unload", {"names": ["text_encoder", "text_embeddings"]}, timeout=120)


def _combo(name: str, choices: list[str], tooltip: str):
    """A file picker: the choices as ComfyUI lists them, the first one the default."""
    return io.Combo.Input(name, options=choices, default=choices[0] if choices else None, tooltip=tooltip)


def _text_encoder_input():
    return TextEncoderType.Input("text_encoder", tooltip="Gemma 3 in the pool (from the Gemma Loader).")


class LTXMGPUGemmaLoader(io.ComfyNode):
    """-> (``LTXMGPU_TEXT_ENCODER``, ``CLIP``: a :class:`GemmaClip` of it). Raises FileNotFoundError /
    GemmaFormatError (headers only) / ValueError (compile with NF4 or accelerate) before anything
    is loaded."""

    @classmethod
    def define_schema(cls):
        return io.Schema(
            node_id="LTXMGPU_GemmaLoader",
            display_name="LTX-2 Multi-GPU Gemma Loader",
            category=CATEGORY,
            description=("Chooses Gemma 3 and the LTX-2 text projection for the pool. Gemma is loaded on the first "
                         "prompt that is not already in the embedding cache."),
            inputs=[
                PoolType.Input("pool", tooltip="The pool Gemma runs in (from the Pool node)."),
                _combo("gemma", gemma_choices(), (
                    "Gemma 3 12B from models/text_encoders: a Hugging Face snapshot directory (gemma-3-12b-it/), "
                    "ComfyUI's single file (gemma_3_12B_it*.safetensors: bf16, fp8_scaled or fp4_mixed, whose "
                    "quantized layers are dequantized as ComfyUI does), a GGUF file (gemma-3-12b-it-Q4_K_M.gguf: its "
                    "quantized blocks stay quantized on the GPU, the tokenizer from the file) or an ltx_mgpu NF4 "
                    "directory.")),
                _combo("projection", projection_choices(), (
                    "Where the LTX-2 text projection comes from: the LTX-2 checkpoint you sample with "
                    "(checkpoints/...), or a separate projection file (text_encoders/...). Its version (2.0 or "
                    "2.3) decides the embedding layout.")),
                io.Combo.Input("weights", options=list(WEIGHTS), default="bf16", tooltip=(
                    "bf16: Gemma as is (about 24 GB; a GGUF file as stored, computing in bf16). nf4: 4-bit "
                    "NormalFloat through bitsandbytes (about 8 GB, slightly different embeddings, cached separately) "
                    "made from a bf16 or ComfyUI source; an NF4 directory is always nf4.")),
                io.Combo.Input("placement", options=list(PLACEMENTS), default="single", tooltip=(
                    "single: Gemma on the pool's first GPU. accelerate: its layers sharded over all the pool's "
                    "GPUs (when one GPU is too small). batch_parallel: a copy per GPU, prompts split across "
                    "them (fastest for many prompts).")),
                io.Boolean.Input("keep_loaded", default=True, tooltip=(
                    "Keep Gemma in the pool after encoding (faster next time). Off: unload it right after, "
                    "leaving the GPUs' memory to the LTX-2 transformer.")),
                io.Boolean.Input("compile", default=False, optional=True, tooltip=(
                    "Run Gemma's layers through torch.compile: Gemma takes longer to load (it compiles), and new "
                    "kinds of batch compile on first use; then encoding is faster. bf16 weights, placement single "
                    "or batch_parallel.")),
                io.Combo.Input("dtype", options=list(TEXT_COMPUTE_DTYPES), default=AUTO_DTYPE, optional=True,
                               tooltip=(
                    "Gemma's compute dtype. auto: what ComfyUI's own text encoder uses on the pool's device: fp32 "
                    "on CPU ranks (ComfyUI's result), bf16 on GPUs (ComfyUI computes fp32 there too: choose fp32 "
                    "for its exact result, at twice Gemma's memory). NF4 weights always compute in bf16. Embeddings "
                    "are cached per dtype.")),
            ],
            outputs=[
                TextEncoderType.Output("text_encoder", tooltip=(
                    "Gemma 3 + LTX-2 projection in the pool; connect it to Prompt Encode.")),
                io.Clip.Output("clip", tooltip=(
                    "The same text encoder as a ComfyUI CLIP, for CLIPTextEncode (in LTX-2 templates it replaces "
                    "LTXAVTextEncoderLoader's output): prompts encode in the pool, through the embedding cache, "
                    "whole (no cut at 1024 tokens), exactly as ComfyUI's own LTX-2 text encoder; TextGenerate / "
                    "TextGenerateLTX2Prompt (prompt enhancement; an image needs a Gemma file with its vision tower) "
                    "generate with the pool's Gemma; "
                    "LoraLoader's CLIP strength merges the LoRA into the pool's Gemma.")),
            ],
        )

    @classmethod
    def execute(cls, pool: PoolHandle, gemma: str, projection: str, weights: str, placement: str,
                keep_loaded: bool, compile: bool = False, dtype: str = AUTO_DTYPE) -> io.NodeOutput:
        from ltx_mgpu.client.text import check_sources

        check_choice(dtype, TEXT_COMPUTE_DTYPES, "dtype")
        config = TextEncoderConfig(_comfy.full_path("text_encoders", gemma), resolve_projection(projection),
                                   weights=weights, placement=placement, compile=bool(compile), dtype=dtype)
        check_sources(config)  # headers only: a wrong file fails here, naming the supported formats
        handle = TextEncoderHandle(pool, config, bool(keep_loaded))
        return io.NodeOutput(handle, GemmaClip(handle))


class LTXMGPUPromptEncode(io.ComfyNode):
    """-> (positive, negative) CONDITIONING: ``[[float32 [1, T, D] CPU, {"pooled_output": None,
    "unprocessed_ltxav_embeds": True}]]`` each (D = 3840 for LTX-2.0, 6144 for 2.3; T = real tokens)."""

    @classmethod
    def define_schema(cls):
        return io.Schema(
            node_id="LTXMGPU_PromptEncode",
            display_name="LTX-2 Multi-GPU Prompt Encode",
            category=CATEGORY,
            description=("Encodes a positive and a negative prompt with Gemma 3 in the pool, through the embedding "
                         "cache."),
            inputs=[
                _text_encoder_input(),
                io.String.Input("positive", multiline=True, default="", tooltip=(
                    "What the video shows and sounds like.")),
                io.String.Input("negative", multiline=True, default="", tooltip=(
                    "What to steer away from (used when cfg > 1).")),
                io.Boolean.Input("use_cache", default=True, tooltip=(
                    "Look prompts up in the embedding cache first and store new ones; a fully cached pair never "
                    "loads Gemma. The key covers the prompt, the Gemma and projection files' contents, weights "
                    "and dtype.")),
            ],
            outputs=[
                io.Conditioning.Output("positive", tooltip="LTX-2 conditioning of the positive prompt (ComfyUI's "
                                                           "own format)."),
                io.Conditioning.Output("negative", tooltip="LTX-2 conditioning of the negative prompt."),
            ],
            hidden=[io.Hidden.unique_id],
        )

    @classmethod
    def execute(cls, text_encoder: TextEncoderHandle, positive: str, negative: str, use_cache: bool) -> io.NodeOutput:
        embeddings, _, _ = text_encoder.encode([positive, negative], bool(use_cache), executing_node(cls))
        return io.NodeOutput(embeddings[0].to_conditioning(), embeddings[1].to_conditioning())


class LTXMGPUPromptBatchEncode(io.ComfyNode):
    """-> STRING cache report (``CacheReport`` + cache directory). Raises ValueError on no prompts."""

    @classmethod
    def define_schema(cls):
        return io.Schema(
            node_id="LTXMGPU_PromptBatchEncode",
            display_name="LTX-2 Multi-GPU Prompt Batch Encode",
            category=CATEGORY,
            description="Precomputes the embeddings of a prompt list into the cache (resumes where it stopped).",
            inputs=[
                _text_encoder_input(),
                io.String.Input("prompts", multiline=True, default="", tooltip=(
                    "One prompt per line (empty lines are skipped). Already cached prompts are not encoded again.")),
                io.Int.Input("batch_size", default=8, min=1, max=256, tooltip=(
                    "Prompts per Gemma forward pass (per GPU with batch_parallel). Larger is faster until "
                    "memory runs out; results are stored after every batch.")),
            ],
            outputs=[io.String.Output("report", tooltip=(
                "How many prompts were cached already, how many were encoded, and where the cache is."))],
            hidden=[io.Hidden.unique_id],
            is_output_node=True,
        )

    @classmethod
    def execute(cls, text_encoder: TextEncoderHandle, prompts: str, batch_size: int) -> io.NodeOutput:
        lines = [line.strip() for line in prompts.splitlines() if line.strip()]
        if not lines:
            raise ValueError("Prompt Batch Encode: no prompts; write one prompt per line")
        _, report, cache = text_encoder.encode(lines, True, executing_node(cls), batch_size=int(batch_size))
        text = f"{report} (cache: {cache.root})"
        return io.NodeOutput(text, ui={"text": [text]})


NODES = (LTXMGPUGemmaLoader, LTXMGPUPromptEncode, LTXMGPUPromptBatchEncode)
