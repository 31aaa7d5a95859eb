"""The conditions of an LTX-2 transformer call beyond latent, timesteps and text context: keyframe
guides, guide attention, reference audio and the text mask — honoured as ComfyUI 0.20.1's
``LTXAVModel`` computes them (``comfy/ldm/lightricks/model.py``: ``LTXVModel._process_input``,
``_build_guide_self_attention_mask``, ``_downsample_mask_to_latent``, ``_process_output``;
``comfy/ldm/lightricks/av_model.py``: ``LTXAVModel._process_input``, ``_prepare_timestep``,
``_process_output``), by changing the ltx-core ``Modality`` inputs of the call (tokens,
positions, per-token timesteps, a self-attention mask, a text mask), never ltx-core's model code:

* **Keyframe guides** (``LTXVAddGuide``): the guide latents are appended to the video latent's
  frames (the LATENT carries them) and ``keyframe_idxs`` ``[B, 3, Tk, 2]`` holds their pixel
  coordinates (time in pixel frames, ``[start, end)``). Tokens whose denoise mask is negative in
  any channel of sample 0 leave the call (ComfyUI's ``grid_mask``) and get a zero velocity; the
  positions of the last kept guide tokens become ``keyframe_idxs`` (time divided by the frame
  rate, as every video position). Under sequence parallelism guide tokens are video tokens:
  they are split, padded and masked like them, and ``max_tokens`` counts them.
* **Guide attention** (``guide_attention_entries``): one entry per guide, in order;
  ``pre_filter_count`` tokens each (together, the last Tk tokens before the grid mask), a
  ``strength`` and an optional pixel-space ``pixel_mask`` with the guide's ``latent_shape``.
  When a weight is below 1, self-attention between the noisy tokens and that guide's tokens
  (both ways) is scaled by the weight: ltx-core's ``Modality.attention_mask`` in ``[0, 1]``,
  which it turns into ComfyUI's log-space bias (``log w``, ``finfo.min`` for 0).
* **Reference audio** (``LTXVReferenceAudio``, ID-LoRA): ``ref_audio["tokens"]`` ``[B, Tr, 128]``
  is prepended to the audio tokens with zero timesteps and positions shifted to end one latent
  step (hop x downsampling / sample rate) before t = 0; their velocities are dropped.
* **Text mask** (``attention_mask`` ``[B, L]``): the text cross-attention mask of both
  modalities (``Modality.context_mask``).

Build an :class:`ExtraConds` with :func:`extra_conds` (it checks every value and raises
:class:`ExtraCondsError` naming it), check it against the call's latent with
:meth:`ExtraConds.check_fits` (before any work), then :func:`apply_extra_conds` before the call and
:func:`restore_outputs` after it.

The valid ranges (from what ComfyUI's nodes make and its model assumes; outside them ComfyUI
computes something meaningless or fails midway, so they are refused up front):

* ``keyframe_idxs``: batch 1 or the latent's; each ``[start, end)`` pair with ``start <= end``
  inside the latent's pixel extent, guide frames included: time in ``0..F x 8`` pixel frames,
  height ``0..H x 32``, width ``0..W x 32`` pixels (ltx-core's ``VIDEO_SCALE_FACTORS``;
  ``LTXVAddGuide`` places a guide at a pixel frame of the video, its causal first frame at
  ``[0, 1)``, and a small-grid IC-LoRA guide's end within its dilated extent);
* the grid mask keeps at least one token (a denoise mask negative everywhere leaves nothing to call);
* a guide entry's ``latent_shape`` ``F x H x W`` is at most its ``pre_filter_count`` tokens (the
  guide latent's own shape; a dilated small grid has more tokens, never fewer); its ``pixel_mask``
  is ``[B, 1, F_pix, H_pix, W_pix]`` (ComfyUI's ``_downsample_mask_to_latent`` takes one channel)
  in pixel space, at least as fine as the guide latent (``H_pix >= H``, ``W_pix >= W``: it is
  area-averaged down to it), with values in ``0..1``;
* reference audio tokens: batch 1 or the latent's, as wide as the audio latent's tokens
  (channels x mel bins).
"""

from __future__ import annotations

import dataclasses
import logging
import math
from typing import Any

import torch
import torch.nn.functional as F
from ltx_core.types import VIDEO_SCALE_FACTORS, AudioLatentShape, VideoLatentShape

from ltx_mgpu.denoise.comfyui.transformer_call import ModalityInput
from ltx_mgpu.wire.messages import GUIDE_FIELDS

__all__ = ["CallLayout", "ExtraConds", "ExtraCondsError", "GuideEntry", "apply_extra_conds", "concat_extra_conds",
           "extra_conds", "grid_mask", "restore_outputs"]

LOG = logging.getLogger("ltx_mgpu")


class ExtraCondsError(ValueError):
    """A keyframe guide, guide attention entry, reference audio or text mask that does not fit
    the call (the message names the value and its producer)."""


@dataclasses.dataclass(frozen=True)
class GuideEntry:
    """One ``guide_attention_entries`` item (``comfy_extras/nodes_lt.py``
    ``_append_guide_attention_entry``).

    Attributes:
        pre_filter_count: the guide's tokens before the grid mask (``F * H * W`` of its latent).
        strength: its attention weight, ``>= 0`` (1 = full attention, ``LTXVAddGuide``'s strength).
        latent_shape: ``(F, H, W)`` of the guide latent, or None.
        pixel_mask: a pixel-space mask ``[B, 1, F_pix, H_pix, W_pix]`` in ``[0, 1]``, or None.
    """

    pre_filter_count: int
    strength: float
    latent_shape: tuple[int, int, int] | None = None
    pixel_mask: torch.Tensor | None = None


@dataclasses.dataclass(frozen=True)
class ExtraConds:
    """The checked conditions of one call (module doc); the default is none of them.

    Attributes:
        keyframe_idxs: float32 ``[B or 1, 3, Tk, 2]`` guide pixel coordinates, or None.
        keep: bool ``[T]``: the video tokens that stay in the call (ComfyUI's ``grid_mask``,
            :func:`grid_mask`); given exactly when ``keyframe_idxs`` is.
        guides: the guide attention entries (their counts sum to Tk).
        ref_audio: float ``[B or 1, Tr, C]`` reference audio tokens, or None.
        text_mask: ``[B or 1, L]`` text mask, or None.
    """

    keyframe_idxs: torch.Tensor | None = None
    keep: torch.Tensor | None = None
    guides: tuple[GuideEntry, ...] = ()
    ref_audio: torch.Tensor | None = None
    text_mask: torch.Tensor | None = None

    def batchable_with(self, other: ExtraConds) -> bool:
        """True when the two can run in one batched call (ComfyUI's ``can_concat``: the tensors
        of equal shapes, the guide entries and grid masks equal)."""

        def same_shape(a, b):
            return (a is None) == (b is None) and (a is None or a.shape[1:] == b.shape[1:])

        return (same_shape(self.keyframe_idxs, other.keyframe_idxs) and same_shape(self.ref_audio, other.ref_audio)
                and same_shape(self.text_mask, other.text_mask) and _equal(self.keep, other.keep)
                and len(self.guides) == len(other.guides)
                and all(a.pre_filter_count == b.pre_filter_count and a.strength == b.strength
                        and a.latent_shape == b.latent_shape and _equal(a.pixel_mask, b.pixel_mask)
                        for a, b in zip(self.guides, other.guides)))

    def check_fits(self, video: VideoLatentShape | None, audio: AudioLatentShape | None) -> None:
        """Check the conditions against the call's latent (module doc: the valid ranges), from
        shapes and the keyframe coordinates alone, before any work.

        Args:
            video / audio: the latent's shapes (guide frames included), None for a modality it lacks.
        Raises:
            ExtraCondsError: guides without a video latent, of another batch, whose grid mask does
                not cover the latent or whose coordinates lie outside it; reference audio without an
                audio latent, of another batch or width.
        """
        if self.keyframe_idxs is not None:
            kf = self.keyframe_idxs
            if video is None:
                raise ExtraCondsError("keyframe guides (LTXVAddGuide) need a video latent")
            if kf.shape[0] not in (1, video.batch):
                raise ExtraCondsError(f"keyframe_idxs (from LTXVAddGuide) has batch {kf.shape[0]}; the latent's batch "
                                      f"is {video.batch}: give one set of guide coordinates, or one per sample")
            if self.keep.shape[0] != video.token_count():
                raise ExtraCondsError(f"the video denoise_mask covers {self.keep.shape[0]} tokens, the latent has "
                                      f"{video.token_count()}: LTXVAddGuide's latent and noise mask must be the ones "
                                      "sampled")
            scale_t, scale_h, scale_w = VIDEO_SCALE_FACTORS
            extent = (video.frames * scale_t, video.height * scale_h, video.width * scale_w)
            for axis, (name, top) in enumerate(zip(("time", "height", "width"), extent)):
                start, end = kf[:, axis, :, 0], kf[:, axis, :, 1]
                low, high = float(torch.minimum(start, end).min()), float(torch.maximum(start, end).max())
                if low < 0 or high > top or bool((start > end).any()):
                    raise ExtraCondsError(
                        f"keyframe_idxs (from LTXVAddGuide) has {name} coordinates from {low:.10g} to {high:.10g}"
                        f"{' (a start after its end)' if bool((start > end).any()) else ''}; the latent spans "
                        f"0..{extent[0]} pixel frames, 0..{extent[1]} x 0..{extent[2]} pixels (height x width), "
                        "and every [start, end) pair lies inside it: the guide nodes made them for another latent")
        if self.ref_audio is not None:
            if audio is None:
                raise ExtraCondsError("reference audio (LTXVReferenceAudio) needs an audio-video latent")
            width = audio.channels * audio.mel_bins
            if self.ref_audio.shape[2] != width or self.ref_audio.shape[0] not in (1, audio.batch):
                raise ExtraCondsError(f"the reference audio tokens {list(self.ref_audio.shape)} do not fit the audio "
                                      f"latent {[audio.batch, audio.channels, audio.frames, audio.mel_bins]} (batch 1 "
                                      f"or {audio.batch}, {width} channels x mel bins per token): encode the reference "
                                      "with this model's audio VAE")


def _equal(a, b) -> bool:
    return (a is None and b is None) or (a is not None and b is not None and a.shape == b.shape and torch.equal(a, b))


def concat_extra_conds(conds: list[ExtraConds], sizes: list[int]) -> ExtraConds:
    """``conds`` of batchable calls (:meth:`ExtraConds.batchable_with`) as one call's, each
    tensor repeated to its call's batch ``sizes[i]`` and concatenated along the batch."""
    first = conds[0]

    def joined(name: str):
        parts = [getattr(c, name) for c in conds]
        if parts[0] is None:
            return None
        return torch.cat([p.expand(n, *p.shape[1:]) if p.shape[0] == 1 else p for p, n in zip(parts, sizes)])

    return dataclasses.replace(first, keyframe_idxs=joined("keyframe_idxs"), ref_audio=joined("ref_audio"),
                               text_mask=joined("text_mask"))


def grid_mask(denoise_mask: torch.Tensor) -> torch.Tensor:
    """ComfyUI's ``grid_mask``: bool ``[F * H * W]``, False where sample 0 of the video denoise mask
    ``[B, C, F, H, W]`` is negative in any channel (``~any(patchify(mask) < 0, -1)[0]``).

    Raises:
        ExtraCondsError: not a 5-D float tensor.
    """
    if not isinstance(denoise_mask, torch.Tensor) or denoise_mask.ndim != 5 or not denoise_mask.dtype.is_floating_point:
        raise ExtraCondsError(f"keyframe guides need the video denoise mask [B, C, F, H, W] (LTXVAddGuide's latent "
                              f"noise_mask), got {getattr(denoise_mask, 'shape', type(denoise_mask).__name__)}")
    return ~(denoise_mask[0] < 0).any(dim=0).flatten()


_INTS = (torch.int8, torch.int16, torch.int32, torch.int64, torch.uint8)


def _float(t: Any, name: str, ndim: int, layout: str, source: str, ints: bool = False) -> torch.Tensor:
    """``t`` when it is a finite float (or, with ``ints``, integer) tensor of ``ndim`` dims."""
    real = isinstance(t, torch.Tensor) and (t.dtype.is_floating_point or (ints and t.dtype in _INTS))
    if not real or t.ndim != ndim or 0 in t.shape:
        got = f"{t.dtype} {tuple(t.shape)}" if isinstance(t, torch.Tensor) else type(t).__name__
        kind = "a float or integer" if ints else "a float"
        raise ExtraCondsError(f"{name} (from {source}) must be {kind} tensor {layout}, got {got}")
    if t.dtype.is_floating_point and not bool(torch.isfinite(t).all()):
        raise ExtraCondsError(f"{name} (from {source}) holds NaN or infinite values")
    return t


def _guide(i: int, entry: Any) -> GuideEntry:
    where = f"guide_attention_entries[{i}] (from LTXVAddGuide)"
    if not isinstance(entry, dict):
        raise ExtraCondsError(f"{where} must be a dict with pre_filter_count and strength, got {type(entry).__name__}")
    count, strength = entry.get("pre_filter_count"), entry.get("strength", 1.0)
    if isinstance(count, bool) or not isinstance(count, int) or count < 0:
        raise ExtraCondsError(f"{where}: pre_filter_count must be a non-negative int, got {count!r:.40}")
    if isinstance(strength, bool) or not isinstance(strength, (int, float)) or not math.isfinite(strength) \
            or strength < 0:
        raise ExtraCondsError(f"{where}: strength must be a finite number >= 0, got {strength!r:.40}")
    shape = entry.get("latent_shape")
    if shape is not None:
        if not isinstance(shape, (list, tuple)) or len(shape) != 3 or not all(
                isinstance(s, int) and not isinstance(s, bool) and s > 0 for s in shape):
            raise ExtraCondsError(f"{where}: latent_shape must be [F, H, W] positive ints, got {shape!r:.60}")
        shape = tuple(shape)
        if math.prod(shape) > count:
            raise ExtraCondsError(f"{where}: latent_shape {list(shape)} is {math.prod(shape)} tokens, more than its "
                                  f"pre_filter_count {count}: the guide latent's [F, H, W] has at most that many "
                                  "tokens; the guide node made it for another guide")
    mask = entry.get("pixel_mask")
    if mask is not None:
        mask = _float(mask, f"{where} pixel_mask", 5, "[B, 1, F, H, W]", "the guide node")
        if mask.shape[1] != 1 or (shape is not None and (mask.shape[3] < shape[1] or mask.shape[4] < shape[2])):
            fit = f", at least the guide latent's {shape[1]} x {shape[2]} (height x width)" if shape else ""
            raise ExtraCondsError(f"{where}: pixel_mask is {list(mask.shape)}; a guide's pixel mask is [B, 1, F, H, W] "
                                  f"in pixel space{fit}: the guide node made it for another guide")
        if bool((mask < 0).any() or (mask > 1).any()):
            raise ExtraCondsError(f"{where}: pixel_mask holds values outside 0..1 (from {float(mask.min()):.6g} to "
                                  f"{float(mask.max()):.6g}); it weighs the guide's attention per pixel")
    unknown = sorted(set(entry) - set(GUIDE_FIELDS))
    if unknown:
        raise ExtraCondsError(f"{where} has the unknown field(s) {unknown}; this pool implements "
                              f"{', '.join(GUIDE_FIELDS)} (a newer ComfyUI may add more: update ltx_mgpu)")
    return GuideEntry(count, float(strength), shape, mask)


def extra_conds(*, keyframe_idxs: Any = None, keep: torch.Tensor | None = None, guide_attention_entries: Any = None,
                ref_audio: Any = None, attention_mask: Any = None) -> ExtraConds:
    """The checked :class:`ExtraConds` of ComfyUI's model-call values.

    Args:
        keyframe_idxs: ``[B, 3, Tk, 2]`` (``LTXVAddGuide`` makes them int64 pixel coordinates;
            float is taken too), or None.
        keep: the :func:`grid_mask` of the call's video denoise mask (needed with
            ``keyframe_idxs``).
        guide_attention_entries: the list of dicts ``LTXVAddGuide`` adds, or None.
        ref_audio: ``{"tokens": [B, Tr, C]}`` (``LTXVReferenceAudio``) or the tokens, or None.
        attention_mask: the text mask ``[B, L]``, or None.
    Raises:
        ExtraCondsError: a value of the wrong type, layout or content (names it); guide entries
            without keyframes or counts that do not sum to the keyframe tokens.
    """
    kf = None
    if keyframe_idxs is not None:
        kf = _float(keyframe_idxs, "keyframe_idxs", 4, "[B, 3, tokens, 2]", "LTXVAddGuide", ints=True)
        if kf.shape[1] != 3 or kf.shape[3] != 2:
            raise ExtraCondsError(f"keyframe_idxs (from LTXVAddGuide) must be [B, 3, tokens, 2] pixel coordinates, "
                                  f"got {tuple(kf.shape)}")
        if not isinstance(keep, torch.Tensor) or keep.dtype != torch.bool or keep.ndim != 1:
            raise ExtraCondsError("keyframe guides need the video denoise mask (LTXVAddGuide sets the latent's "
                                  "noise_mask): none reached the model call")
        if keep.shape[0] < kf.shape[2]:
            raise ExtraCondsError(f"keyframe_idxs has {kf.shape[2]} guide tokens, the video latent only "
                                  f"{keep.shape[0]}: LTXVAddGuide's latent must be the one sampled")
        if not bool(keep.any()):
            raise ExtraCondsError("the video denoise_mask is negative in every video token, so the grid mask drops "
                                  "every video token and nothing is left to call; negative values mark guide tokens "
                                  "to leave out (LTXVAddGuide's guide mask), not the whole latent")
        kf = kf.float()
    guides: tuple[GuideEntry, ...] = ()
    if guide_attention_entries:
        if not isinstance(guide_attention_entries, (list, tuple)):
            raise ExtraCondsError("guide_attention_entries (from LTXVAddGuide) must be a list of dicts, got "
                                  f"{type(guide_attention_entries).__name__}")
        guides = tuple(_guide(i, e) for i, e in enumerate(guide_attention_entries))
        if kf is None:
            raise ExtraCondsError("guide_attention_entries came without keyframe_idxs: both come from LTXVAddGuide "
                                  "(LTXVCropGuides removes both); check the conditioning nodes")
        total = sum(g.pre_filter_count for g in guides)
        if total != kf.shape[2]:
            raise ExtraCondsError(f"the guide entries' pre_filter_counts sum to {total}, keyframe_idxs has "
                                  f"{kf.shape[2]} tokens (ComfyUI raises the same); the guide nodes disagree")
    ref = None
    if ref_audio is not None:
        tokens = ref_audio.get("tokens") if isinstance(ref_audio, dict) else ref_audio
        ref = _float(tokens, "ref_audio tokens", 3, "[B, tokens, channels x mel bins]", "LTXVReferenceAudio")
    text = None
    if attention_mask is not None:
        if not isinstance(attention_mask, torch.Tensor) or attention_mask.ndim != 2 or attention_mask.is_complex() \
                or 0 in attention_mask.shape:
            raise ExtraCondsError(f"the text attention_mask must be [B, tokens], got "
                                  f"{getattr(attention_mask, 'shape', type(attention_mask).__name__)}")
        text = attention_mask
    return ExtraConds(kf, keep if kf is not None else None, guides, ref, text)


def _downsample_pixel_mask(mask: torch.Tensor, f_lat: int, h_lat: int, w_lat: int) -> torch.Tensor:
    """A pixel-space guide mask ``[B, 1, F_pix, H_pix, W_pix]`` -> per-token weights
    ``[B, f_lat * h_lat * w_lat]`` as ComfyUI's ``_downsample_mask_to_latent``: area
    interpolation per frame; in time, pixel frame 0 is latent frame 0 and the rest are averaged
    in groups of ``(F_pix - 1) // (f_lat - 1)`` (trailing frames dropped), or repeated (nearest)
    when there are fewer pixel than latent frames."""
    b, _, f_pix, h_pix, w_pix = mask.shape
    spatial = F.interpolate(mask.permute(0, 2, 1, 3, 4).reshape(b * f_pix, 1, h_pix, w_pix), size=(h_lat, w_lat),
                            mode="area").reshape(b, f_pix, 1, h_lat, w_lat).permute(0, 2, 1, 3, 4)
    first = spatial[:, :, :1]
    if f_pix > 1 and f_lat > 1:
        group = (f_pix - 1) // (f_lat - 1)
        if group < 1:
            rest = spatial[:, :, 1:].permute(0, 3, 4, 1, 2).reshape(b * h_lat * w_lat, 1, f_pix - 1)
            rest = F.interpolate(rest, size=f_lat - 1, mode="nearest")
            rest = rest.reshape(b, h_lat, w_lat, 1, f_lat - 1).permute(0, 3, 4, 1, 2)
        else:
            usable = spatial[:, :, 1:1 + (f_lat - 1) * group]
            rest = usable.reshape(b, 1, f_lat - 1, group, h_lat, w_lat).mean(dim=3)
        latent = torch.cat([first, rest], dim=2)
    elif f_lat > 1:
        latent = first.expand(-1, -1, f_lat, -1, -1)
    else:
        latent = first
    return latent.reshape(b, -1)


def _guide_weights(conds: ExtraConds, kf_keep: torch.Tensor, tokens: int, guide_tokens: int,
                   dtype: torch.dtype, device) -> torch.Tensor | None:
    """ComfyUI's guide self-attention attenuation as ltx-core weights ``[1, T, T]`` (1 = full
    attention), or None when no weight is below 1."""
    if not conds.guides or guide_tokens == 0 or not any(g.strength < 1.0 or g.pixel_mask is not None
                                                        for g in conds.guides):
        return None
    weights, offset = [], 0
    for g in conds.guides:
        surviving = int(kf_keep[offset:offset + g.pre_filter_count].sum())
        offset += g.pre_filter_count
        if surviving == 0:
            continue
        if g.pixel_mask is not None and g.latent_shape is not None:
            per_token = _downsample_pixel_mask(g.pixel_mask.to(device=device, dtype=dtype), *g.latent_shape)
            if per_token.shape[0] > 1 and not all(torch.equal(per_token[0], p) for p in per_token[1:]):
                LOG.warning("ltx_mgpu: a guide's pixel_mask differs across the batch; using the first sample's "
                            "(as ComfyUI does)")
            per_token = per_token[:1]
            w = per_token[:, :min(per_token.shape[1], surviving)] * g.strength
        else:
            w = torch.full((1, surviving), g.strength, device=device, dtype=dtype)
        weights.append(w)
    if not weights:
        return None
    tracked = torch.cat(weights, dim=1)[0]
    if bool((tracked >= 1.0).all()):
        return None
    start = tokens - guide_tokens
    end = start + tracked.shape[0]
    full = torch.ones(1, tokens, tokens, dtype=dtype, device=device)
    full[:, :start, start:end] = tracked.view(1, 1, -1)
    full[:, start:end, :start] = tracked.view(1, -1, 1)
    return full


@dataclasses.dataclass(frozen=True)
class CallLayout:
    """How :func:`restore_outputs` maps the call's velocities back to the caller's tokens.

    Attributes:
        video_tokens: the video tokens before the grid mask.
        keep: the grid mask, or None (every token was in the call).
        ref_tokens: reference audio tokens prepended to the audio.
    """

    video_tokens: int = 0
    keep: torch.Tensor | None = None
    ref_tokens: int = 0


def apply_extra_conds(inputs: dict[str, ModalityInput], conds: ExtraConds, frame_rate: float,
                      audio_patchifier) -> tuple[dict[str, ModalityInput], CallLayout]:
    """The call's inputs with ``conds`` applied (module doc) and how to restore its outputs.

    Args:
        inputs: ``{"video": ..., "audio": ...}`` as the latent gives them (guide frames included).
        conds: from :func:`extra_conds`.
        frame_rate: frames per second of the video positions (keyframe times are divided by it).
        audio_patchifier: ltx-core's ``AudioPatchifier`` of the audio positions (its timing
            places the reference audio).
    Raises:
        ExtraCondsError: guides without a video latent or whose grid mask does not cover its
            tokens, reference audio without an audio latent or of another width or batch, a text
            mask that does not cover the context.
    """
    out = dict(inputs)
    layout = CallLayout()
    video, audio = inputs.get("video"), inputs.get("audio")
    if conds.keyframe_idxs is not None:
        if video is None:
            raise ExtraCondsError("keyframe guides (LTXVAddGuide) need a video latent")
        tokens = video.tokens.shape[1]
        keep = conds.keep.to(video.tokens.device)
        if keep.shape[0] != tokens:
            raise ExtraCondsError(f"the video denoise mask covers {keep.shape[0]} tokens, the latent has {tokens}")
        n_kf = conds.keyframe_idxs.shape[2]
        kf_keep = keep[-n_kf:]
        kf = conds.keyframe_idxs.to(video.positions.device)[..., kf_keep, :].to(video.positions.dtype)
        kf[:, 0] = kf[:, 0] / frame_rate
        positions = video.positions[:, :, keep].clone()
        guide_tokens = kf.shape[2]
        if guide_tokens:
            positions[:, :, positions.shape[2] - guide_tokens:] = kf
        kept = int(keep.sum())
        out["video"] = dataclasses.replace(
            video, tokens=video.tokens[:, keep], positions=positions,
            timesteps=video.timesteps[:, keep] if video.timesteps.shape[1] == tokens else video.timesteps,
            self_attention=_guide_weights(conds, kf_keep, kept, guide_tokens, video.tokens.dtype,
                                          video.tokens.device))
        layout = dataclasses.replace(layout, video_tokens=tokens, keep=None if bool(keep.all()) else keep)
    if conds.ref_audio is not None:
        if audio is None:
            raise ExtraCondsError("reference audio (LTXVReferenceAudio) needs an audio-video latent")
        batch = audio.tokens.shape[0]
        ref = conds.ref_audio.to(device=audio.tokens.device, dtype=audio.tokens.dtype)
        if ref.shape[2] != audio.tokens.shape[2] or ref.shape[0] not in (1, batch):
            raise ExtraCondsError(f"the reference audio tokens {tuple(ref.shape)} do not fit the audio latent's "
                                  f"{tuple(audio.tokens.shape)} (batch 1 or {batch}, the same channels x mel bins): "
                                  "encode the reference with this model's audio VAE")
        ref = ref.expand(batch, -1, -1)
        n_ref = ref.shape[1]
        shape = AudioLatentShape(batch=batch, channels=1, frames=n_ref, mel_bins=1)
        bounds = audio_patchifier.get_patch_grid_bounds(shape, device=audio.positions.device).float()
        step = (audio_patchifier.hop_length * audio_patchifier.audio_latent_downsample_factor
                / audio_patchifier.sample_rate)
        bounds = bounds - (bounds[0, 0, -1, 1].item() + step)
        base = out["audio"]
        out["audio"] = dataclasses.replace(
            base, tokens=torch.cat([ref, base.tokens], dim=1),
            timesteps=torch.cat([base.timesteps.new_zeros(batch, n_ref),
                                 base.timesteps.expand(batch, base.tokens.shape[1])], dim=1),
            positions=torch.cat([bounds.to(base.positions.dtype), base.positions], dim=2))
        layout = dataclasses.replace(layout, ref_tokens=n_ref)
    if conds.text_mask is not None:
        for name, m in list(out.items()):
            mask = conds.text_mask.to(m.context.device)
            if mask.shape[1] != m.context.shape[1] or mask.shape[0] not in (1, m.context.shape[0]):
                raise ExtraCondsError(f"the text attention_mask {tuple(mask.shape)} does not cover the "
                                      f"{tuple(m.context.shape[:2])} text context")
            out[name] = dataclasses.replace(m, context_mask=mask)
    return out, layout


def restore_outputs(outs: dict[str, torch.Tensor], layout: CallLayout) -> dict[str, torch.Tensor]:
    """The call's velocities in the caller's token layout: zeros for the video tokens the grid
    mask left out (ComfyUI's ``_process_output``), the reference audio tokens dropped."""
    outs = dict(outs)
    if layout.keep is not None and "video" in outs:
        v = outs["video"]
        full = v.new_zeros(v.shape[0], layout.video_tokens, v.shape[2])
        full[:, layout.keep.to(v.device)] = v
        outs["video"] = full
    if layout.ref_tokens and "audio" in outs:
        outs["audio"] = outs["audio"][:, layout.ref_tokens:]
    return outs
