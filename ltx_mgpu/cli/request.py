"""The ``generate`` request: its fields, the checks that need no weights (numbers, paths, the
head split for the world size), the models it resolves to (the embedded default included), its
pool and the empty audio-video LATENT it denoises. See :mod:`ltx_mgpu.cli.pipeline` for the run.

Importing this module loads no torch (``generate``'s parser reads the defaults from it); the
functions import what they need.
"""

from __future__ import annotations

import dataclasses
import math
import os
from pathlib import Path
from typing import TYPE_CHECKING, Callable

from ltx_mgpu.assets import EMBEDDED_GEMMA

if TYPE_CHECKING:
    from ltx_mgpu.cli.decode import AudioGeometry

__all__ = ["DEFAULT_NEGATIVE", "EMBEDDED_GEMMA", "GenerateRequest", "ResolvedModels", "TINY_NOTICE",
           "empty_av_latent", "pool_spec_for", "resolve_models", "validate_request", "world_size_for"]

#: The negative prompt of Lightricks' LTX-2 examples.
DEFAULT_NEGATIVE = "worst quality, inconsistent motion, blurry, jittery, distorted"
TINY_NOTICE = ("note: no model paths given, using the embedded default: {gemma} and a tiny random LTX-2.3 "
               "transformer. The tiny transformer's output is noise; this run exercises the pipeline (pool, "
               "cache, sequence-parallel denoise, decode), not quality. Pass --checkpoint and --gemma for a "
               "real video.")


@dataclasses.dataclass(frozen=True)
class GenerateRequest:
    """One ``generate`` run.

    Attributes:
        prompt, negative: the texts (``negative`` is encoded only when ``cfg != 1``).
        frames: video frames, ``8k + 1``; height, width: pixels, multiples of 32; fps: frames/s.
        steps: denoising steps (LTX-2 scheduler); cfg: guidance scale; seed: ComfyUI noise seed.
        out: the MP4 path; the latents go to ``<out without .mp4>.latents.safetensors``.
        checkpoint: LTX-2 monolith (or transformer-only with ``vae``/``projection``); gemma: Gemma 3
            (HF snapshot dir, ComfyUI single file or NF4 artifact); both None -> embedded default.
        projection: the text projection source (default: ``checkpoint``); vae: the file holding
            ``vae.*`` (default: ``checkpoint``); connectors: the file holding the text connectors
            when ``checkpoint`` has none (an LTX-2.0 GGUF transformer; default: ``checkpoint``'s own).
        weights, placement: Gemma's weights mode (``bf16``/``nf4``) and placement in the pool.
        dtype: transformer dtype (``bf16``/``fp16``/``fp32``; None: bf16 on GPUs, fp32 on CPU ranks).
        transformer_weights: ``replicated`` (a whole transformer per rank) or ``sharded`` (a 1/N
            shard per rank, gathered block by block: for GPUs too small for a whole copy).
        layout: how a model call is split over the ranks (``auto``, ``ulysses``, ``cfg_ulysses``).
        compile: ``auto`` (the blocks compiled for dtype fp8 only) or ``on`` (compiled in every
            dtype; :data:`ltx_mgpu.choices.TRANSFORMER_COMPILE`).
        gpus: world size (ranks); None: the most GPUs (CPU: up to 2 ranks) the model's heads allow.
        gpu_ids: which GPUs (indices as this process sees them), as ``pool start --gpus 0,1``
            names them; sets the world size to their count. None: GPUs ``0..gpus-1``.
        cpu: CPU ranks (gloo) even when GPUs are visible.
        max_tokens: the video-token budget given to ``load_transformer``.
        cache_dir: embedding cache directory (None: the default); no_cache: neither read nor write.
        runtime_dir: base of the pool's runtime directory (``pool start --runtime-dir``).
        embedded_gemma: which Gemma the embedded default uses: ``auto`` (the real 270M when
            installed), ``gemma-270m`` or ``tiny``.
    """

    prompt: str
    negative: str = DEFAULT_NEGATIVE
    frames: int = 25
    height: int = 256
    width: int = 384
    fps: float = 25.0
    steps: int = 20
    cfg: float = 3.0
    seed: int = 0
    out: str = "out.mp4"
    checkpoint: str | None = None
    gemma: str | None = None
    projection: str | None = None
    vae: str | None = None
    connectors: str | None = None
    weights: str = "bf16"
    placement: str = "single"
    dtype: str | None = None
    transformer_weights: str = "replicated"
    layout: str = "auto"
    compile: str = "auto"
    gpus: int | None = None
    gpu_ids: tuple[int, ...] | None = None
    cpu: bool = False
    max_tokens: int = 32768
    cache_dir: str | None = None
    no_cache: bool = False
    runtime_dir: str | None = None
    embedded_gemma: str = "auto"

    @property
    def latents_path(self) -> Path:
        """``out`` with ``.mp4`` replaced by ``.latents.safetensors`` (appended for other suffixes)."""
        out = Path(self.out)
        return out.with_name((out.stem if out.suffix.lower() == ".mp4" else out.name) + ".latents.safetensors")


def _nearest(value: int, step: int, offset: int = 0) -> str:
    low = max(offset, (value - offset) // step * step + offset)
    high = low + step
    return f"{low}" if low == value else f"{low} or {high}"


def validate_request(req: GenerateRequest) -> None:
    """Check the numbers and paths that need no file reads (no torch is imported: the CLI runs
    it before the heavy imports, so a bad argument answers at once).

    Raises:
        ValueError: naming the bad field and a valid value. FileNotFoundError: a model path
            (``--checkpoint``, ``--gemma``, ``--projection``, ``--vae``, ``--connectors``) that
            does not exist.
    """
    from ltx_mgpu.cli.checks import check_paths_exist
    from ltx_mgpu.files import check_directory_setting, check_output_path  # deferred: loads safetensors

    if not req.prompt.strip():
        raise ValueError("--prompt is empty; describe the video to generate")
    if req.frames < 1 or (req.frames - 1) % 8:
        raise ValueError(f"--frames {req.frames}: LTX-2 takes 8k+1 frames (1, 9, 17, 25, ...); "
                         f"use {_nearest(req.frames, 8, 1)}")
    for name, v in (("height", req.height), ("width", req.width)):
        if v < 32 or v % 32:
            raise ValueError(f"--{name} {v}: LTX-2 takes multiples of 32 pixels; use {_nearest(max(v, 32), 32)}")
    if not (req.fps > 0 and math.isfinite(req.fps)):
        raise ValueError(f"--fps {req.fps}: give a positive frame rate (frames per second)")
    if req.steps < 1:
        raise ValueError(f"--steps {req.steps}: give at least 1 denoising step")
    if not (req.cfg > 0 and math.isfinite(req.cfg)):
        raise ValueError(f"--cfg {req.cfg}: give a positive guidance scale (1 = no guidance)")
    if not 0 <= req.seed < 1 << 64:
        raise ValueError(f"--seed {req.seed}: give a seed in 0..2**64-1")
    if req.gpus is not None and req.gpus < 1:
        raise ValueError(f"--gpus {req.gpus}: give at least 1 rank (GPU 0 alone: --gpus 0,)")
    if req.gpu_ids is not None:
        ids = list(req.gpu_ids)
        if not ids or len(set(ids)) != len(ids) or min(ids) < 0:
            raise ValueError(f"--gpus {','.join(map(str, ids))}: give distinct GPU indices, e.g. --gpus 0,1")
        if req.gpus is not None and req.gpus != len(ids):
            raise ValueError(f"{len(ids)} GPU indices but gpus={req.gpus}; give one or the other")
        if req.cpu:
            raise ValueError("--cpu runs CPU ranks; GPU indices (--gpus 0,1) do not apply")
    if req.embedded_gemma not in EMBEDDED_GEMMA:
        raise ValueError(f"--embedded-gemma must be one of {list(EMBEDDED_GEMMA)}, got {req.embedded_gemma!r}")
    if (req.checkpoint is None) != (req.gemma is None):
        given, missing = ("--checkpoint", "--gemma") if req.gemma is None else ("--gemma", "--checkpoint")
        raise ValueError(f"{given} was given without {missing}: pass both (the LTX-2 checkpoint and its Gemma 3), "
                         "or neither for the embedded default")
    check_paths_exist(checkpoint=req.checkpoint, gemma=req.gemma, projection=req.projection, vae=req.vae,
                      connectors=req.connectors)
    check_output_path(req.out)  # missing directories are made when the outputs are written
    if req.cache_dir:
        check_directory_setting(req.cache_dir, "--cache")
    if req.runtime_dir:
        check_directory_setting(req.runtime_dir, "--runtime-dir")
    if Path(req.out).suffix.lower() != ".mp4":
        raise ValueError(f"--out {req.out}: the video is written as MP4 (H.264); give a name ending in .mp4")


# --------------------------------------------------------------------------- models and geometry


@dataclasses.dataclass(frozen=True)
class ResolvedModels:
    """The files a run uses. ``embedded``: the tiny default (its output is noise)."""

    checkpoint: str
    projection: str
    vae: str
    gemma: Callable[[], str]  # resolved lazily: the 270M snapshot is converted on first use (slow, once)
    gemma_name: str
    embedded: bool


def resolve_models(req: GenerateRequest) -> ResolvedModels:
    """The checkpoint / projection / VAE paths and a thunk for the Gemma path. For the embedded
    default only the tiny checkpoint is built here (fast); Gemma is built when first needed.

    Raises:
        ModuleNotFoundError: ``embedded_gemma="gemma-270m"`` without its package.
    """
    if req.checkpoint is not None:
        ckpt = os.path.abspath(req.checkpoint)
        gemma = os.path.abspath(req.gemma)
        return ResolvedModels(ckpt, os.path.abspath(req.projection or ckpt), os.path.abspath(req.vae or ckpt),
                              lambda: gemma, Path(gemma).name, False)
    from ltx_mgpu.assets import embedded_default

    ckpt, gemma, label = embedded_default(req.embedded_gemma, "2.3")
    return ResolvedModels(ckpt, ckpt, ckpt, gemma, label, True)


def empty_av_latent(frames: int, height: int, width: int, fps: float,
                    geometry: AudioGeometry | None = None) -> dict:
    """ComfyUI's empty LTX-2 audio-video LATENT (``EmptyLTXVLatentVideo`` + ``LTXVEmptyLatentAudio``
    + ``LTXVConcatAVLatent``): ``{"samples": NestedTensorLike([video, audio]), "type": "audio"}``
    with video float32 zeros ``[1, 128, (frames-1)//8+1, height//32, width//32]`` and audio zeros
    ``[1, channels, N, freq_bins]``, ``N = ceil(frames / fps * latents_per_second)``; ``geometry``
    None: LTX-2's default :class:`~ltx_mgpu.cli.decode.AudioGeometry`."""
    import torch

    from ltx_mgpu.cli.decode import AudioGeometry, num_audio_latents
    from ltx_mgpu.nested import NestedTensorLike

    geometry = AudioGeometry() if geometry is None else geometry

    video = torch.zeros(1, 128, (frames - 1) // 8 + 1, height // 32, width // 32)
    audio = torch.zeros(1, geometry.channels, num_audio_latents(frames, fps, geometry), geometry.freq_bins)
    return {"samples": NestedTensorLike([video, audio]), "type": "audio"}


def world_size_for(req: GenerateRequest, info) -> tuple[int, bool]:
    """``(ranks, on_gpus)`` for the request, checked against the model's heads.

    Raises:
        SequenceParallelConfigError (ValueError): ``gpus`` does not divide the heads (the message
        lists the counts that work). ValueError: more GPUs than visible.
    """
    import torch

    from ltx_mgpu.denoise.model import check_world_size, meta_transformer
    from ltx_mgpu.denoise.parallel.split import SequenceParallelConfigError, valid_world_sizes

    gpus_seen = 0 if req.cpu or not torch.cuda.is_available() else torch.cuda.device_count()
    if req.gpu_ids is not None:
        world = len(req.gpu_ids)
        if max(req.gpu_ids) >= gpus_seen:
            raise ValueError(f"--gpus {','.join(map(str, req.gpu_ids))}: only {gpus_seen} GPU(s) are visible "
                             f"(indices 0..{gpus_seen - 1})" if gpus_seen else
                             f"--gpus {','.join(map(str, req.gpu_ids))}: no GPU is visible; "
                             "use --cpu --gpus N for N CPU ranks")
    elif req.gpus is None:
        limit = gpus_seen or 2
        world = max(n for n in valid_world_sizes(meta_transformer(info)) if n <= limit)
    else:
        world = req.gpus
        if gpus_seen and world > gpus_seen:
            raise ValueError(f"--gpus {world}: only {gpus_seen} GPU(s) are visible; use --gpus {gpus_seen} or fewer, "
                             "or --cpu for CPU ranks")
    try:
        check_world_size(info, world)
    except SequenceParallelConfigError as e:
        raise SequenceParallelConfigError(f"--gpus {world}: {e}") from None
    return world, bool(gpus_seen)


def pool_spec_for(req: GenerateRequest, world: int, on_gpus: bool):
    """The pool for ``world`` ranks: ``req.gpu_ids`` or GPUs ``0..world-1`` (as this process sees
    them), or CPU ranks; lifetime ``with-owner``; under ``req.runtime_dir``."""
    from ltx_mgpu.client.spec import resolve_spec

    if on_gpus:
        ids = list(req.gpu_ids) if req.gpu_ids is not None else list(range(world))
        return resolve_spec(ids, None, "with-owner", req.runtime_dir)
    return resolve_spec("cpu", world, "with-owner", req.runtime_dir)
