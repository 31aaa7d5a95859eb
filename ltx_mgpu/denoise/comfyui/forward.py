"""One call of the LTX-2 transformer on ComfyUI's tensors: what ComfyUI's ``LTXAVModel.forward``
takes and returns, computed by ltx-core's ``LTXModel`` (sequence-parallel through
:class:`~ltx_mgpu.denoise.parallel.ulysses.SequenceParallelTransformer`, the velocity model the
SP Sampler uses too).

ComfyUI's ``BaseModel._apply_model`` calls its diffusion model as ``forward(x, timestep,
context, attention_mask=None, frame_rate=25, transformer_options={}, keyframe_idxs=None,
**extra_conds)`` (``comfy/model_base.py``, ``comfy/ldm/lightricks/av_model.py``):

* ``x``: the video latent ``[B, 128, F, H, W]``, or ``[video, audio [B, 8, N, 16]]`` for an
  audio-video model (``utils.unpack_latents``), in the model dtype;
* ``timestep``: ``(video, audio)`` sigmas (``model_sampling.timestep(sigma)`` is the sigma for
  LTX-2's flow matching), each ``[B]``, or per token ``[B, T]`` / ``[B, T, 1]`` when a denoise
  mask made them per token (``LTXAV.process_timestep``);
* ``context``: the processed text context ``[B, L, Dv + Da]`` (``preprocess_text_embeds``' output,
  :func:`processed_context`), split ``[video | audio]`` here;
* ``frame_rate``: frames per second of the video positions.

The other keyword arguments (keyframe guides, guide attention, reference audio, the text
``attention_mask``) arrive as an :class:`~ltx_mgpu.denoise.comfyui.extra_conds.ExtraConds` and are
applied as ComfyUI's model applies them (:mod:`ltx_mgpu.denoise.comfyui.extra_conds`); the denoise
masks are in the per-token timesteps already (``LTXAV.process_timestep``). It returns the
velocities in ``x``'s layout (``[video, audio]`` or the video tensor), in the model dtype.

The audio-video cross-attention AdaLN timesteps: ltx-core 1.0.0 (and ComfyUI after
Comfy-Org/ComfyUI#14097) scale them by ``timestep_scale_multiplier``; ComfyUI up to 0.20.1 passes
the raw sigma. :func:`av_timestep_convention` sets which one a call follows, by wrapping ltx-core's
``MultiModalTransformerArgsPreprocessor._prepare_cross_attention_timestep`` on the model's two
preprocessors for the call (ltx-core's code is not changed).

:func:`~ltx_mgpu.denoise.comfyui.transformer_call.transformer_call` is the one place both samplers call
the transformer: the SP Sampler's steps (:mod:`ltx_mgpu.denoise.comfyui.sampler`) and the MODEL's
forward (:func:`comfy_forward`).
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable, Iterator
from typing import Any, Literal

import torch
from ltx_core.types import AudioLatentShape, VideoLatentShape

from ltx_mgpu.choices import AV_TIMESTEP_CONVENTIONS
from ltx_mgpu.denoise.comfyui.conditioning import text_contexts
from ltx_mgpu.denoise.comfyui.extra_conds import ExtraConds, apply_extra_conds, restore_outputs
from ltx_mgpu.denoise.comfyui.latents import AUDIO_PATCHIFIER, latent_to_tokens, tokens_to_latent
from ltx_mgpu.denoise.comfyui.transformer_call import ModalityInput, transformer_call
from ltx_mgpu.denoise.parallel.split import check_token_budget
from ltx_mgpu.nested import NestedTensorLike

__all__ = ["SIGMA_RANGE", "ForwardError", "av_timestep_convention", "check_call", "comfy_forward",
           "processed_context"]

#: The timesteps a call takes, at the tokens in it: LTX-2's flow-matching sigmas (0 = the clean
#: latent, 1 = pure noise; ComfyUI's ``model_sampling.timestep(sigma)`` is the sigma itself for
#: LTX-2's FLUX-type sampling, ``LTXAV.process_timestep`` multiplies it by a denoise mask in
#: ``0..1``, and ltx-core scales it by ``timestep_scale_multiplier`` into the ``0..1000`` its
#: AdaLN timestep embedding was trained on). Tokens the grid mask drops (guide tokens with a
#: negative mask, hence a negative timestep) are not in the call and not checked. A call may give
#: its own range (``timestep_range``): ComfyUI's ``ModelSampling*`` nodes change what
#: ``model_sampling.timestep(sigma)`` gives (``ModelSamplingContinuousEDM``: ``0.25 ln sigma``,
#: negative below sigma 1), and the MODEL sends the active model sampling's range.
SIGMA_RANGE = (0.0, 1.0)

AvConvention = Literal["scaled", "raw"]


class ForwardError(ValueError):
    """Inputs of a model call that do not form an LTX-2 forward (names the input and the fix)."""


def processed_context(model, context: torch.Tensor, unprocessed: bool) -> torch.Tensor:
    """ComfyUI's ``preprocess_text_embeds``: the connectors' outputs ``[B, L, Dv + Da]`` (video |
    audio, ``model.context_widths``), in the model dtype on its device.

    Raises:
        ConditioningError: as :func:`ltx_mgpu.denoise.comfyui.conditioning.text_contexts`.
    """
    video, audio = text_contexts(model, context, unprocessed)
    return torch.cat([video, audio], dim=-1)


def _token_timesteps(t: torch.Tensor, batch: int, tokens: int, what: str) -> torch.Tensor:
    """A ComfyUI timestep (``[B]`` / ``[1]`` / ``[B, T]`` / ``[B, T, 1]``) as float32 ``[B, T]``,
    or ``[B, 1]`` for one timestep per sample (``[B]`` / ``[1]`` / a scalar): ltx-core then computes
    the AdaLN modulation once per sample, as ComfyUI's model does for a ``[B]`` timestep, instead
    of once per token (:class:`~ltx_mgpu.denoise.comfyui.transformer_call.ModalityInput`)."""
    if not isinstance(t, torch.Tensor) or not t.dtype.is_floating_point:
        raise ForwardError(f"the {what} timestep must be a float tensor, got {getattr(t, 'dtype', type(t).__name__)}")
    t = t.float()
    if t.ndim == 3 and t.shape[-1] == 1:
        t = t[..., 0]
    if t.ndim == 0:
        t = t.reshape(1)
    if t.ndim == 1:
        if t.shape[0] not in (1, batch):
            raise ForwardError(f"the {what} timestep has {t.shape[0]} values for a batch of {batch}")
        return t.reshape(-1, 1).expand(batch, 1)
    if t.ndim == 2 and t.shape[1] == tokens and t.shape[0] in (1, batch):
        return t.expand(batch, tokens)
    raise ForwardError(f"the {what} timestep of shape {tuple(t.shape)} fits neither [B] nor [B, {tokens}] tokens")


def _parts(x: Any) -> list[torch.Tensor]:
    parts = list(x) if isinstance(x, (list, tuple)) else [x]
    if len(parts) not in (1, 2) or not all(isinstance(p, torch.Tensor) for p in parts):
        raise ForwardError("x must be the video latent or [video latent, audio latent]")
    if len(parts) == 2 and parts[1].numel() == 0:
        parts = parts[:1]
    return parts


def _check_range(t: torch.Tensor, what: str, keep: torch.Tensor | None,
                 bounds: tuple[float, float] = SIGMA_RANGE) -> None:
    """Raise unless the timesteps ``t`` (``[B, T]``, the call's tokens) are finite and lie in
    ``bounds`` (:data:`SIGMA_RANGE` unless the call gives its own) at the tokens ``keep`` leaves
    in the call."""
    if keep is not None and t.shape[1] == keep.shape[0]:
        t = t[:, keep.to(t.device)]
    if not t.numel():
        return
    low, high = bounds
    lo, hi = float(t.min()), float(t.max())
    if not (bool(torch.isfinite(t).all()) and low <= lo and hi <= high):
        bad = t[~torch.isfinite(t)] if not bool(torch.isfinite(t).all()) else None
        shown = f"{float(bad[0])}" if bad is not None else f"from {lo:.6g} to {hi:.6g}"
        raise ForwardError(f"{what} holds {shown} at the tokens of the call; this call's timesteps lie in "
                           f"{low:g}..{high:g} (LTX-2's flow-matching sigmas: 0 = clean, 1 = noise; ComfyUI passes "
                           "model_sampling.timestep(sigma), times the denoise mask): check the SIGMAS (ManualSigmas, "
                           "the scheduler) and the noise masks")


def check_call(model, x: Any, timestep: Any, conds: ExtraConds | None = None,
               timestep_range: tuple[float, float] = SIGMA_RANGE) -> None:
    """Every input of one :func:`comfy_forward` call against ``model``, from shapes, the keyframe
    coordinates and the timesteps' values alone (nothing is computed, nothing moves to a device):
    what the pool runs, identically on every rank, before any work, and what
    :func:`comfy_forward` runs first.

    Args:
        model: the :class:`~ltx_mgpu.denoise.model.LTXDenoiser` (its latent widths, ``max_tokens``).
        x, timestep, conds, timestep_range: as :func:`comfy_forward` takes them.
    Raises:
        ForwardError: ``x`` that is not the model's latents (video ``[B, C, F, H, W]`` with its
            ``C``; audio ``[B, C, N, M]`` with ``C x M`` its audio width; audio for a video-only
            model; batches that differ), timesteps of the wrong shape, not finite or outside
            ``timestep_range`` at the tokens of the call.
        SequenceParallelConfigError: more video tokens (guide frames included) or audio tokens
            (reference audio included) than the model's ``max_tokens``.
        ExtraCondsError: conditions that do not fit the latent (:meth:`ExtraConds.check_fits`).
    """
    conds = conds or ExtraConds()
    parts = _parts(x)
    video_width, audio_width = model.latent_widths
    v = parts[0]
    if v.ndim != 5:
        raise ForwardError(f"x[0] (the video latent) is {list(v.shape)}; an LTX-2 video latent is [B, {video_width}, "
                           "F, H, W]")
    if v.shape[1] != video_width:
        raise ForwardError(f"x[0] (the video latent) has {v.shape[1]} channels; this model takes {video_width} "
                           f"([B, {video_width}, F, H, W], its VAE's latent): the latent was made for another model")
    video = VideoLatentShape.from_torch_shape(v.shape)
    audio = None
    if len(parts) == 2:
        a = parts[1]
        if a.ndim != 4:
            raise ForwardError(f"x[1] (the audio latent) is {list(a.shape)}; an LTX-2 audio latent is [B, 8, N, 16]")
        if audio_width is None:
            raise ForwardError("x[1] is an audio latent, and this model has no audio: give the video latent alone")
        if a.shape[1] * a.shape[3] != audio_width:
            raise ForwardError(f"x[1] (the audio latent) is {list(a.shape)}: {a.shape[1]} channels x {a.shape[3]} "
                               f"mel bins = {a.shape[1] * a.shape[3]} values per token; this model takes "
                               f"{audio_width} ([B, 8, N, 16] from LTX-2's audio VAE)")
        if a.shape[0] != v.shape[0]:
            raise ForwardError(f"x[0] has batch {v.shape[0]}, x[1] {a.shape[0]}: the video and audio latents of a "
                               "call share their batch")
        audio = AudioLatentShape.from_torch_shape(a.shape)
    check_token_budget(video.token_count(), model.max_tokens)
    conds.check_fits(video, audio)
    if audio is not None:
        ref = 0 if conds.ref_audio is None else conds.ref_audio.shape[1]
        check_token_budget(audio.frames + ref, model.max_tokens, "audio",
                           f"{audio.frames} + {ref} of the reference audio" if ref else None)
    v_t, a_t = timestep if isinstance(timestep, (list, tuple)) and len(timestep) == 2 else (timestep, timestep)
    _check_range(_token_timesteps(v_t, video.batch, video.token_count(), "video"), "timestep[0] (video)", conds.keep,
                 timestep_range)
    if audio is not None:
        _check_range(_token_timesteps(a_t, audio.batch, audio.frames, "audio"), "timestep[1] (audio)", None,
                     timestep_range)


def comfy_forward(model, velocity: Callable, x: Any, timestep: Any, context: torch.Tensor, *,
                  frame_rate: float = 25.0, conds: ExtraConds | None = None,
                  timestep_range: tuple[float, float] = SIGMA_RANGE) -> Any:
    """One ComfyUI-layout call of the transformer (see the module doc).

    Args:
        model: the :class:`~ltx_mgpu.denoise.model.LTXDenoiser` (dtype, device, widths).
        velocity: ``f(video, audio, perturbations) -> (vx, ax)`` (``model.velocity_model(group)``).
        x: the video latent (guide frames appended), or ``[video, audio]``.
        timestep: ``(video, audio)`` timesteps (or one for both).
        context: the processed context ``[B, L, Dv + Da]``.
        frame_rate: video frames per second.
        conds: keyframe guides, guide attention, reference audio, text mask (none by default).
    Returns:
        The velocities, ``[video, audio]`` or the video tensor, in the model dtype on its device.
    Every input is checked first (:func:`check_call`); then the latents move to the model's
    device (patchifying and the positions run there) and the transformer runs.

    Raises:
        ForwardError: inputs of the wrong layout, or that do not fit the model (:func:`check_call`).
        SequenceParallelConfigError: more tokens than the model's ``max_tokens``.
        ExtraCondsError: conditions that do not fit the latent or context.
        LatentFormatError: a latent that is not LTX-2's.
    """
    check_call(model, x, timestep, conds, timestep_range)
    parts = [p.to(model.device, non_blocking=True) for p in _parts(x)]
    latent = {"samples": NestedTensorLike(parts)} if len(parts) == 2 else {"samples": parts[0]}
    state = latent_to_tokens(latent, float(frame_rate), audio_patchifier=AUDIO_PATCHIFIER)
    v_t, a_t = timestep if isinstance(timestep, (list, tuple)) and len(timestep) == 2 else (timestep, timestep)
    if not isinstance(context, torch.Tensor) or context.ndim != 3:
        raise ForwardError(f"context must be [B, L, D], got {getattr(context, 'shape', type(context).__name__)}")
    vw, aw = model.context_widths
    if context.shape[-1] != vw + aw:
        raise ForwardError(f"the context is {context.shape[-1]} wide; this LTX-{model.version} model takes the "
                           f"processed {vw} + {aw} (its connectors' outputs)")
    ctx = context.to(device=model.device, dtype=model.dtype)
    batch = parts[0].shape[0]
    if ctx.shape[0] not in (1, batch):
        raise ForwardError(f"the context has batch {ctx.shape[0]}, the latent {batch}")
    ctx = ctx.expand(batch, -1, -1)
    inputs = {}
    for name, tokens_state, t, c in (("video", state.video, v_t, ctx[..., :vw]), ("audio", state.audio, a_t,
                                                                                 ctx[..., vw:])):
        if tokens_state is None:
            continue
        ts = _token_timesteps(t, batch, tokens_state.tokens.shape[1], name).to(model.device)
        inputs[name] = ModalityInput(tokens=tokens_state.tokens.to(device=model.device, dtype=model.dtype),
                                     timesteps=ts, positions=tokens_state.positions.to(model.device), context=c)
    inputs, layout = apply_extra_conds(inputs, conds or ExtraConds(), float(frame_rate), AUDIO_PATCHIFIER)
    v = restore_outputs(transformer_call(velocity, inputs), layout)
    vx, ax = v.get("video"), v.get("audio")
    out = tokens_to_latent(dataclasses.replace(state, extras={}), vx, ax, audio_patchifier=AUDIO_PATCHIFIER)["samples"]
    if len(parts) == 2:
        return [t.to(model.dtype) for t in out.unbind()]
    return out.to(model.dtype)


@contextlib.contextmanager
def av_timestep_convention(transformer, convention: AvConvention) -> Iterator[None]:
    """Within the block, ``transformer`` (an ltx-core ``LTXModel``) feeds its audio-video
    cross-attention AdaLNs as ``convention`` says (see the module doc); on leaving, ltx-core's own
    (``"scaled"``) again. ``"raw"`` emulates ComfyUI 0.20.1's ``_prepare_timestep``: the
    scale/shift AdaLN gets the raw sigma, the gate AdaLN sigma x ``av_ca_timestep_scale_multiplier``
    / ``timestep_scale_multiplier``, by calling ltx-core's
    ``MultiModalTransformerArgsPreprocessor._prepare_cross_attention_timestep`` with the sigma
    divided by the multiplier it then applies (per instance; ltx-core's code is unchanged).

    Raises:
        ValueError: an unknown convention.
    """
    if convention not in AV_TIMESTEP_CONVENTIONS:
        raise ValueError(f"the AV timestep convention must be one of {AV_TIMESTEP_CONVENTIONS}, got {convention!r}")
    wrapped = []
    if convention == "raw":
        for name in ("video_args_preprocessor", "audio_args_preprocessor"):
            pre = getattr(transformer, name, None)
            if pre is None or not hasattr(type(pre), "_prepare_cross_attention_timestep"):
                continue
            original = type(pre)._prepare_cross_attention_timestep.__get__(pre)

            def raw(timestep, timestep_scale_multiplier, batch_size, hidden_dtype, _original=original):
                return _original(timestep=timestep / timestep_scale_multiplier,
                                 timestep_scale_multiplier=timestep_scale_multiplier,
                                 batch_size=batch_size, hidden_dtype=hidden_dtype)

            pre._prepare_cross_attention_timestep = raw
            wrapped.append(pre)
    try:
        yield
    finally:
        for pre in wrapped:
            pre.__dict__.pop("_prepare_cross_attention_timestep", None)

