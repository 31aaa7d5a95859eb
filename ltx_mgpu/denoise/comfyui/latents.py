"""ComfyUI LTX-2 LATENTs <-> ltx-core token states (tokens, positions, per-token denoise masks).

ComfyUI's LTX-2 LATENT comes in three shapes (ComfyUI's ``comfy_extras/nodes_lt.py``,
``comfy_extras/nodes_lt_audio.py`` and ``comfy/nested_tensor.py``):

* video: ``{"samples": [B, 128, F, H, W]}`` (``EmptyLTXVLatentVideo``);
* audio: ``{"samples": [B, 8, N, 16], "type": "audio"}`` (``LTXVEmptyLatentAudio``);
* audio-video: ``{"samples": NestedTensor((video, audio)), ...}`` (``LTXVConcatAVLatent``),
  ``comfy.nested_tensor.NestedTensor`` being a plain class with ``.tensors`` and
  ``is_nested = True``. It is duck-typed here (ComfyUI is never imported);
  ``NestedTensorLike`` stands in for it without ComfyUI.

An optional ``noise_mask`` (a tensor, or a NestedTensor of (video mask, audio mask)) gives the
denoise strength per latent element (1 = denoise, 0 = keep), as image-to-video and stage-2
nodes set it. ComfyUI resizes it to the latent with ``comfy.utils.reshape_mask``
(interpolation) and then reads channel 0 per video token and channel 0 / mel bin 0 per
audio token (``LTXAV.process_timestep``); ``_video_token_mask`` / ``_audio_token_mask``
reproduce that. No mask means ones.

Tokens and positions are made by ltx-core 1.0.0's own patchifiers and coordinate helpers,
the same calls ``VideoLatentTools`` / ``AudioLatentTools`` make: video positions are
``[B, 3, T, 2]`` ``[start, end)`` bounds in pixels with time in seconds (pixel frame / fps,
with the causal first-frame fix), audio positions ``[B, 1, T, 2]`` in seconds. Positions
are float32 (ComfyUI keeps them float32; ltx-core's pipelines cast them to the model dtype).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import torch
import torch.nn.functional as F
from ltx_core.components.patchifiers import AudioPatchifier, VideoLatentPatchifier, get_pixel_coords
from ltx_core.types import VIDEO_SCALE_FACTORS, AudioLatentShape, VideoLatentShape

from ltx_mgpu.nested import NestedTensorLike, is_nested  # noqa: F401 - re-exported for callers

__all__ = [
    "AUDIO_PATCHIFIER",
    "DEFAULT_FRAME_RATE",
    "FLOAT_DTYPES",
    "LatentFormatError",
    "ModalityTokens",
    "NestedTensorLike",
    "TokenLatents",
    "frame_rate_from_conditioning",
    "is_nested",
    "latent_to_tokens",
    "repeat_to_batch",
    "tokens_to_latent",
]

#: ComfyUI's ``LTXVConditioning`` default frame rate (frames per second) and the model's
#: fallback when a conditioning carries no ``frame_rate``.
DEFAULT_FRAME_RATE = 25.0
#: The dtypes a LATENT, noise mask or CONDITIONING tensor may have (ComfyUI's float types).
FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)

_VIDEO_PATCHIFIER = VideoLatentPatchifier(patch_size=1)
#: LTX-2's audio timing (16 kHz, hop 160, 4x latent downsampling: ltx-core's defaults), the
#: default of every conversion here; the reference audio of a call is placed with it too.
AUDIO_PATCHIFIER = AudioPatchifier(patch_size=1)


class LatentFormatError(ValueError):
    """A LATENT that is not one of ComfyUI's LTX-2 layouts (video, audio, audio-video)."""


@dataclasses.dataclass
class ModalityTokens:
    """One modality as ltx-core tokens.

    Attributes:
        tokens: ``[B, T, C]`` patchified latent (video ``C = 128``: T = F*H*W; audio
            ``C = channels * mel_bins = 128``: T = N), in the LATENT's dtype and device.
        positions: float32 ``[B, 3, T, 2]`` (video: time in seconds, height and width in
            pixels) or ``[B, 1, T, 2]`` (audio: seconds), ``[start, end)`` per token.
        denoise_mask: float32 ``[B, T]``, 1 = denoise, 0 = keep (ltx-core's convention).
        shape: the ltx-core latent shape (``VideoLatentShape`` / ``AudioLatentShape``).
        dtype: the LATENT tensor's dtype, restored by ``tokens_to_latent``.
    """

    tokens: torch.Tensor
    positions: torch.Tensor
    denoise_mask: torch.Tensor
    shape: VideoLatentShape | AudioLatentShape
    dtype: torch.dtype


@dataclasses.dataclass
class TokenLatents:
    """A ComfyUI LATENT as token states, plus what is needed to rebuild it exactly.

    Attributes:
        video / audio: the modalities present (``None`` when absent).
        frame_rate: frames per second used for the video time positions.
        nested_type: the class of the input NestedTensor (audio-video LATENTs), else None.
        extras: the LATENT's other keys (``noise_mask``, ``type``, ``batch_index`` ...),
            carried into the output unchanged, as ComfyUI's samplers do.
    """

    video: ModalityTokens | None
    audio: ModalityTokens | None
    frame_rate: float
    nested_type: type | None = None
    extras: dict = dataclasses.field(default_factory=dict)


# --------------------------------------------------------------------------- conditioning


def frame_rate_from_conditioning(conditioning: Any, default: float = DEFAULT_FRAME_RATE) -> float:
    """The ``frame_rate`` an LTX-2 CONDITIONING carries (``LTXVConditioning``), else ``default``.

    Accepts ComfyUI's CONDITIONING (a list of ``[tensor, dict]``), a single such pair, or a
    plain options dict. Raises ``ValueError`` for a non-positive or non-numeric frame rate.
    """
    entries = conditioning if isinstance(conditioning, (list, tuple)) else [conditioning]
    for entry in entries:  # [tensor, dict] pairs; a bare pair yields its dict directly
        opts = entry[1] if isinstance(entry, (list, tuple)) and len(entry) > 1 else entry
        if isinstance(opts, dict) and opts.get("frame_rate") is not None:
            try:
                if isinstance(opts["frame_rate"], bool):
                    raise TypeError("a bool")
                fps = float(opts["frame_rate"])
            except (TypeError, ValueError):
                raise ValueError(f"conditioning frame_rate must be a number (frames per second), got "
                                 f"{opts['frame_rate']!r:.40}; set it on LTXVConditioning") from None
            if not (fps > 0 and math.isfinite(fps)):
                raise ValueError(f"conditioning frame_rate must be positive, got {fps}; set it on LTXVConditioning")
            return fps
    return float(default)


# --------------------------------------------------------------------------- checks


def _check_tensor(t: Any, what: str, layout: str) -> None:
    """Raise LatentFormatError unless ``t`` is a float tensor (:data:`FLOAT_DTYPES`) with no empty
    dimension (``layout`` names the expected one, for the message)."""
    if not isinstance(t, torch.Tensor) or getattr(t, "is_nested", False):
        raise LatentFormatError(f"{what} must be a tensor {layout}, got {type(t).__name__}")
    if t.dtype not in FLOAT_DTYPES:
        raise LatentFormatError(f"{what} is {t.dtype}; LATENTs and noise masks are float16, bfloat16, float32 or "
                                "float64 tensors")
    if t.numel() == 0 or t.ndim == 0:
        raise LatentFormatError(f"{what} has shape {tuple(t.shape)}, expected {layout} with every dimension at "
                                "least 1 (an empty latent or mask has nothing to denoise); check the node that made it")


def _check_batch_index(index: Any, batch: int) -> None:
    """ComfyUI's ``batch_index`` (``prepare_noise``'s noise indices): one non-negative int per sample."""
    if not isinstance(index, (list, tuple)) or not all(isinstance(i, int) and not isinstance(i, bool) and i >= 0
                                                       for i in index):
        raise LatentFormatError(f"latent batch_index must be a list of non-negative ints, got {index!r:.80}")
    if len(index) != batch:
        raise LatentFormatError(f"latent batch_index has {len(index)} entries; the latent's batch is {batch}: give "
                                "one entry per sample (ComfyUI's noise indices) or none")


# --------------------------------------------------------------------------- masks


def repeat_to_batch(x: torch.Tensor, batch: int) -> torch.Tensor:
    """ComfyUI's ``repeat_to_batch_size`` (``comfy/utils.py``): ``x[:batch]`` when ``x`` has more than
    ``batch`` rows along dim 0, else ``x`` tiled along dim 0 and cut to ``batch`` rows; any dtype."""
    if x.shape[0] > batch:
        return x[:batch]
    if x.shape[0] < batch:
        return x.repeat([math.ceil(batch / x.shape[0])] + [1] * (x.ndim - 1))[:batch]
    return x


def _video_token_mask(mask: torch.Tensor | None, shape: VideoLatentShape, device) -> torch.Tensor:
    """A video ``noise_mask`` -> float32 ``[B, F*H*W]``.

    Follows ComfyUI: a mask of fewer than 5 dims is read as ``[..., F', H', W']`` frames,
    resized to ``(F, H, W)`` trilinearly (exact when the sizes match or are 1), channel 0.
    """
    if mask is None:
        return torch.ones(shape.batch, shape.token_count(), dtype=torch.float32, device=device)
    m = mask.to(device=device, dtype=torch.float32)
    if not 2 <= m.ndim <= 5:
        raise LatentFormatError(f"video noise_mask must have 2 to 5 dims ([..., H, W] up to [B, C, F, H, W]), "
                                f"got shape {tuple(mask.shape)}")
    if m.ndim < 5:
        m = m.reshape(1, 1, -1, m.shape[-2], m.shape[-1])
    m = m[:, :1]
    if tuple(m.shape[2:]) != (shape.frames, shape.height, shape.width):
        m = F.interpolate(m, size=(shape.frames, shape.height, shape.width), mode="trilinear")
    m = repeat_to_batch(m, shape.batch)
    return _VIDEO_PATCHIFIER.patchify(m)[..., 0]


def _audio_token_mask(mask: torch.Tensor | None, shape: AudioLatentShape, patchifier, device) -> torch.Tensor:
    """An audio ``noise_mask`` -> float32 ``[B, N]``.

    Follows ComfyUI: the mask is reshaped to ``[-1, 1, N', M']`` (so a ``[1, C, N, M]`` mask
    reads channel 0; with batch > 1 and several channels ComfyUI's reshape mixes channels
    into the batch, and so does this), resized bilinearly to ``(N, mel_bins)``, then mel bin 0.
    """
    if mask is None:
        return torch.ones(shape.batch, shape.frames, dtype=torch.float32, device=device)
    m = mask.to(device=device, dtype=torch.float32)
    if m.ndim < 2:
        raise LatentFormatError(f"audio noise_mask must have >= 2 dims ([..., N, mel_bins]), "
                                f"got shape {tuple(mask.shape)}")
    m = m.reshape(-1, 1, m.shape[-2], m.shape[-1])
    if tuple(m.shape[2:]) != (shape.frames, shape.mel_bins):
        m = F.interpolate(m, size=(shape.frames, shape.mel_bins), mode="bilinear")
    m = repeat_to_batch(m, shape.batch)[..., :1]  # [B, 1, N, 1]
    return patchifier.patchify(m)[..., 0]


# --------------------------------------------------------------------------- conversion


def _video_tokens(samples: torch.Tensor, mask, frame_rate: float, what: str = "video latent",
                  mask_what: str = "noise_mask") -> ModalityTokens:
    _check_tensor(samples, what, "[B, 128, F, H, W]")
    if samples.ndim != 5:
        raise LatentFormatError(f"an LTX-2 video latent is [B, 128, F, H, W]; got shape {tuple(samples.shape)}")
    if mask is not None:
        _check_tensor(mask, mask_what, "[..., H, W]")
    shape = VideoLatentShape.from_torch_shape(samples.shape)
    coords = _VIDEO_PATCHIFIER.get_patch_grid_bounds(shape, device=samples.device)
    positions = get_pixel_coords(coords, VIDEO_SCALE_FACTORS, causal_fix=True).float()
    positions[:, 0] = positions[:, 0] / frame_rate
    return ModalityTokens(
        tokens=_VIDEO_PATCHIFIER.patchify(samples),
        positions=positions,
        denoise_mask=_video_token_mask(mask, shape, samples.device),
        shape=shape,
        dtype=samples.dtype,
    )


def _audio_tokens(samples: torch.Tensor, mask, patchifier: AudioPatchifier, what: str = "audio latent",
                  mask_what: str = "noise_mask") -> ModalityTokens:
    _check_tensor(samples, what, "[B, 8, N, 16]")
    if samples.ndim != 4:
        raise LatentFormatError(f"an LTX-2 audio latent is [B, 8, N, 16]; got shape {tuple(samples.shape)}")
    if mask is not None:
        _check_tensor(mask, mask_what, "[..., N, mel_bins]")
    shape = AudioLatentShape.from_torch_shape(samples.shape)
    return ModalityTokens(
        tokens=patchifier.patchify(samples),
        positions=patchifier.get_patch_grid_bounds(shape, device=samples.device).float(),
        denoise_mask=_audio_token_mask(mask, shape, patchifier, samples.device),
        shape=shape,
        dtype=samples.dtype,
    )


def latent_to_tokens(
    latent: dict,
    frame_rate: float = DEFAULT_FRAME_RATE,
    *,
    audio_patchifier: AudioPatchifier | None = None,
) -> TokenLatents:
    """Convert a ComfyUI LTX-2 LATENT to ltx-core token states.

    Args:
        latent: ``{"samples": ..., ["noise_mask": ...], [other keys]}`` in one of the three
            layouts in the module docstring.
        frame_rate: video frames per second (from ``frame_rate_from_conditioning``).
        audio_patchifier: the audio timing (16 kHz, hop 160, 4x latent downsampling by
            default, LTX-2's audio VAE); pass another for a differently configured VAE.
    Returns:
        ``TokenLatents``; ``tokens_to_latent`` inverts it exactly.
    Raises:
        LatentFormatError: not a LATENT dict, a ``torch.nested`` tensor, a NestedTensor
            that is not (video, audio), a latent or mask that is not a float tensor or has an
            empty dimension, mismatched batch sizes, a mask of the wrong rank, or a
            ``batch_index`` that is not one non-negative int per sample.
        ValueError: ``frame_rate`` not positive.
    """
    if not isinstance(latent, dict) or "samples" not in latent:
        raise LatentFormatError("expected a ComfyUI LATENT: a dict with a 'samples' entry")
    if not (frame_rate > 0 and math.isfinite(frame_rate)):
        raise ValueError(f"frame_rate must be a positive number of frames per second, got {frame_rate}")
    patchifier = audio_patchifier or AUDIO_PATCHIFIER
    samples, mask = latent["samples"], latent.get("noise_mask")
    extras = {k: v for k, v in latent.items() if k != "samples"}
    if is_nested(samples):
        parts = list(samples.unbind())
        if len(parts) != 2:
            raise LatentFormatError(
                f"an LTX-2 audio-video LATENT nests (video, audio); got {len(parts)} tensors. "
                "Build it with LTXVConcatAVLatent."
            )
        masks = list(mask.unbind()) if is_nested(mask) else [mask]
        if len(masks) > 2:
            raise LatentFormatError(f"an audio-video noise_mask nests (video mask, audio mask); got {len(masks)} "
                                    "tensors")
        masks += [None] * (2 - len(masks))
        video = _video_tokens(parts[0], masks[0], frame_rate, "latent part 0 (video)", "noise_mask part 0 (video)")
        audio = _audio_tokens(parts[1], masks[1], patchifier, "latent part 1 (audio)", "noise_mask part 1 (audio)")
        if video.shape.batch != audio.shape.batch:
            raise LatentFormatError(
                f"video batch {video.shape.batch} and audio batch {audio.shape.batch} differ; "
                "use the same batch size on both empty-latent nodes"
            )
        _check_extras(latent, video.shape.batch)
        return TokenLatents(video, audio, float(frame_rate), type(samples), extras)
    if not isinstance(samples, torch.Tensor) or getattr(samples, "is_nested", False):
        raise LatentFormatError(
            f"LATENT samples must be a tensor or ComfyUI's NestedTensor, got {type(samples).__name__}"
        )
    if is_nested(mask):
        raise LatentFormatError("a nested noise_mask needs a nested (audio-video) LATENT")
    if latent.get("type") == "audio":
        state = TokenLatents(None, _audio_tokens(samples, mask, patchifier), float(frame_rate), None, extras)
    else:
        state = TokenLatents(_video_tokens(samples, mask, frame_rate), None, float(frame_rate), None, extras)
    _check_extras(latent, samples.shape[0])
    return state


def _check_extras(latent: dict, batch: int) -> None:
    if latent.get("batch_index") is not None:
        _check_batch_index(latent["batch_index"], batch)


def _restore(mod: ModalityTokens, tokens: torch.Tensor | None, unpatchify) -> torch.Tensor:
    tokens = mod.tokens if tokens is None else tokens
    expected = (mod.shape.batch, mod.shape.token_count())
    if tuple(tokens.shape[:2]) != expected or tokens.shape[2] != mod.tokens.shape[2]:
        raise ValueError(f"tokens of shape {tuple(tokens.shape)} do not fit the latent {tuple(mod.tokens.shape)}")
    return unpatchify(tokens, mod.shape).to(device=mod.tokens.device, dtype=mod.dtype)


def tokens_to_latent(
    state: TokenLatents,
    video_tokens: torch.Tensor | None = None,
    audio_tokens: torch.Tensor | None = None,
    *,
    audio_patchifier: AudioPatchifier | None = None,
) -> dict:
    """Rebuild the ComfyUI LATENT of ``state`` from (new) tokens.

    Args:
        state: from ``latent_to_tokens``.
        video_tokens / audio_tokens: ``[B, T, C]`` results (e.g. the denoised latent); None
            keeps the state's own tokens. Cast back to the input LATENT's dtype and device.
    Returns:
        ``{**extras, "samples": ...}``: a video or audio tensor, or an instance of the input's
        NestedTensor class holding (video, audio), like ComfyUI's samplers return.
    Raises:
        ValueError: tokens whose shape does not match the state.
    """
    patchifier = audio_patchifier or AUDIO_PATCHIFIER
    out = dict(state.extras)
    video = _restore(state.video, video_tokens, _VIDEO_PATCHIFIER.unpatchify) if state.video else None
    audio = _restore(state.audio, audio_tokens, patchifier.unpatchify) if state.audio else None
    if state.nested_type is not None:
        out["samples"] = state.nested_type([video, audio])
    else:
        out["samples"] = video if video is not None else audio
    return out
