"""The LTX-2 sampler: ComfyUI's ``SamplerCustomAdvanced`` + ``CFGGuider`` + ``euler`` on ltx-core.

It reproduces, for ComfyUI LATENT / CONDITIONING / SIGMAS inputs, what ComfyUI computes for
``model_base.LTXAV`` (``ModelSamplingFlux`` + ``CONST``) — sources in ComfyUI:
``comfy/sample.py`` (``prepare_noise``), ``comfy/samplers.py`` (``CFGGuider``, ``KSAMPLER``,
``KSamplerX0Inpaint``, ``sampling_function`` / ``cfg_function``), ``comfy/model_sampling.py``
(``CONST``), ``comfy/k_diffusion/sampling.py`` (``sample_euler``), ``comfy/model_base.py``
(``LTXAV.process_timestep`` / ``scale_latent_inpaint``), ``comfy_extras/nodes_lt.py``
(``LTXVScheduler``):

1. noise: ``g = torch.manual_seed(seed)`` semantics (a fresh CPU generator), float32
   ``randn`` of each latent's full shape — video first, then audio — cast to its dtype;
   ``batch_index`` selects per-sample draws as ``prepare_noise``'s ``noise_inds`` does;
2. ``x = sigma_0 * noise + (1 - sigma_0) * latent`` (CONST ``noise_scaling``), float32;
3. per step ``i`` (Euler): with a LATENT ``noise_mask`` m, the model input is
   ``x * m + latent * (1 - m)`` (LTXAV's ``scale_latent_inpaint`` returns the clean latent);
   per-token timesteps ``m * sigma`` (``process_timestep``); ``denoised = x_in - sigma * v``
   (CONST, v = ltx-core velocity, upcast to float32); CFG ``uncond + (cond - uncond) * cfg``
   with both prompts in **one** batched forward (cfg == 1 -> one pass, ``cond * cfg``); then
   ``denoised * m + latent * (1 - m)``; ``d = (x - denoised) / sigma``;
   ``x += d * (sigma_next - sigma)``;
4. ``x / (1 - sigma_last)`` (CONST ``inverse_noise_scaling``; exact for the usual 0).

The velocity model is any callable with ``LTXModel.forward``'s signature, so
:class:`~ltx_mgpu.denoise.parallel.ulysses.SequenceParallelTransformer` plugs in; every rank
then runs this whole function in lockstep with identical inputs (SPMD).

Known differences from ComfyUI: the noise mask is applied per token (ComfyUI applies the
element-wise mask; identical whenever it is constant across a token's channels / mel bins, as
every LTX node makes it); the cross-modal AdaLN timestep of a modality is the per-sample
maximum of its token timesteps (ComfyUI: the maximum over the batch; identical when every
sample has the same mask). The audio-video cross-attention AdaLN takes ``sigma x 1000`` as
ltx-core 1.0.0 computes it (``transformer_args.py``); ComfyUI up to 0.20.1 passed the raw sigma
there and later releases scale it too (Comfy-Org/ComfyUI#14097), so on audio+video latents we
equal ComfyUI after that fix (video-only and image-to-video latents agree with 0.20.1 to 1e-6;
``tests/comfyui/test_comfyui_real.py``).
"""

from __future__ import annotations

import dataclasses
import logging
import math
import numbers
from collections.abc import Callable, Sequence

import numpy as np
import torch
from ltx_core.components.schedulers import LTX2Scheduler

from ltx_mgpu.cancellation import Cancelled
from ltx_mgpu.choices import SAMPLERS
from ltx_mgpu.denoise.comfyui.conditioning import (
    ConditioningError,
    parse_conditioning,
    sampling_frame_rate,
    text_contexts,
)
from ltx_mgpu.denoise.comfyui.extra_conds import (
    ExtraConds,
    apply_extra_conds,
    concat_extra_conds,
    extra_conds,
    restore_outputs,
)
from ltx_mgpu.denoise.comfyui.latents import AUDIO_PATCHIFIER, latent_to_tokens, repeat_to_batch, tokens_to_latent
from ltx_mgpu.denoise.comfyui.transformer_call import ModalityInput, transformer_call
from ltx_mgpu.nested import is_nested

LOG = logging.getLogger("ltx_mgpu")
_said: set[str] = set()

__all__ = ["SAMPLERS", "SCHEDULER_OPTIONS", "SamplingCancelled", "check_scheduler_options", "comfy_noise",
           "ltx2_sigmas", "resolve_sigmas", "sample"]

#: The ``LTXVScheduler`` options :func:`ltx2_sigmas` takes: name -> (kind, low, high), ComfyUI's
#: ranges for the node's inputs (``comfy_extras/nodes_lt.py``).
SCHEDULER_OPTIONS = {
    "max_shift": ("number", 0.0, 100.0),
    "base_shift": ("number", 0.0, 100.0),
    "stretch": ("bool", None, None),
    "terminal": ("number", 0.0, 0.99),
}


class SamplingCancelled(RuntimeError, Cancelled):
    """``should_stop()`` returned True at a step boundary; ``step`` steps of ``total`` were done."""

    def __init__(self, step: int, total: int):
        super().__init__(f"sampling cancelled after {step} of {total} steps")
        self.step, self.total = step, total


# --------------------------------------------------------------------------- sigmas and noise


def check_scheduler_options(options) -> dict:
    """``options`` for :func:`ltx2_sigmas`, checked: a mapping of :data:`SCHEDULER_OPTIONS` names
    to finite numbers in the node's range (``max_shift`` / ``base_shift`` 0..100, ``terminal``
    0..0.99) or, for ``stretch``, a bool. Returns them as a dict.

    Raises:
        ValueError: not a mapping, an unknown name, or a value of the wrong type or range
            (``"scheduler.<name> must be ..."``).
    """
    if options is None:
        return {}
    if not isinstance(options, dict):
        raise ValueError(f"scheduler options must be an object of {list(SCHEDULER_OPTIONS)}, got {options!r:.80}")
    unknown = sorted(set(options) - set(SCHEDULER_OPTIONS))
    if unknown:
        raise ValueError(f"unknown scheduler option(s) {unknown}; known: {list(SCHEDULER_OPTIONS)}")
    for name, value in options.items():
        kind, low, high = SCHEDULER_OPTIONS[name]
        if kind == "bool":
            if not isinstance(value, bool):
                raise ValueError(f"scheduler.{name} must be true or false, got {value!r:.40}")
            continue
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            raise ValueError(f"scheduler.{name} must be a number in {low:g}..{high:g} (LTXVScheduler's range), "
                             f"got {value!r:.40}")
        if not low <= value <= high:
            raise ValueError(f"scheduler.{name} must be in {low:g}..{high:g} (LTXVScheduler's range), got {value}")
    return dict(options)


def ltx2_sigmas(
    steps: int,
    latent: dict | None = None,
    *,
    max_shift: float = 2.05,
    base_shift: float = 0.95,
    stretch: bool = True,
    terminal: float = 0.1,
) -> torch.Tensor:
    """ComfyUI's ``LTXVScheduler`` via ltx-core's ``LTX2Scheduler``: float32 ``[steps + 1]``.

    The shift is interpolated through (1024 tokens, base_shift) and (4096, max_shift) with
    tokens = ``prod(latent["samples"].shape[2:])`` (the video shape of an audio-video LATENT),
    or 4096 without a latent. Raises ValueError for ``steps`` that is not an int >= 1, options
    :func:`check_scheduler_options` refuses, or options that give sigmas the sampler cannot use
    (an overflowing shift, non-finite values).
    """
    if isinstance(steps, bool) or not isinstance(steps, numbers.Integral) or steps < 1:
        raise ValueError(f"steps must be an int >= 1, got {steps!r:.40}")
    steps = int(steps)
    options = check_scheduler_options({"max_shift": max_shift, "base_shift": base_shift, "stretch": stretch,
                                       "terminal": terminal})
    shape = None
    if latent is not None:
        samples = latent["samples"]
        shape = samples.tensors[0].shape if is_nested(samples) else samples.shape
    ref = torch.empty(shape, device="meta") if shape is not None else None
    try:
        sigmas = LTX2Scheduler().execute(steps, latent=ref, **options).to(torch.float32)
    except (ArithmeticError, IndexError, RuntimeError) as e:  # math.exp overflow, an all-zero schedule...
        raise ValueError(f"the LTX-2 scheduler cannot make {steps} sigmas with {options} for this latent "
                         f"({type(e).__name__}: {e}); lower max_shift / base_shift") from None
    if not bool(torch.isfinite(sigmas).all()):
        raise ValueError(f"the LTX-2 scheduler gives non-finite sigmas for {steps} step(s) with {options}; "
                         "use more steps, stretch=false, or lower max_shift / base_shift")
    return sigmas


def resolve_sigmas(latent: dict, sigmas=None, steps: int | None = None, **scheduler) -> torch.Tensor:
    """Float32 CPU sigmas from a ComfyUI SIGMAS input or, with ``steps``, :func:`ltx2_sigmas`.

    Raises ValueError unless exactly one of ``sigmas`` / ``steps`` is given, or for sigmas that
    are not real, 1-D and finite, a zero sigma before the last, a last sigma of 1 or more, or
    ``scheduler`` options :func:`ltx2_sigmas` refuses.
    """
    if (sigmas is None) == (steps is None):
        raise ValueError("give either sigmas (a ComfyUI SIGMAS tensor) or steps (for the LTX-2 scheduler), not both")
    if steps is not None:
        return ltx2_sigmas(steps, latent, **check_scheduler_options(scheduler))
    s = torch.as_tensor(sigmas).detach()
    if s.is_complex():
        raise ValueError(f"sigmas must be a real tensor (ComfyUI SIGMAS), got {s.dtype}")
    s = s.to(device="cpu", dtype=torch.float32)
    if s.ndim != 1:
        raise ValueError(f"sigmas must be a 1-D tensor (ComfyUI SIGMAS), got shape {tuple(s.shape)}")
    if not bool(torch.isfinite(s).all()):
        raise ValueError("sigmas must be finite")
    if s.numel() > 1 and bool((s[:-1] <= 0).any()):
        raise ValueError("every sigma but the last must be > 0 (the Euler step divides by it)")
    if s.numel() > 1 and float(s[-1]) >= 1:
        raise ValueError(f"the last sigma must be < 1 (the result is divided by 1 - sigma), got {float(s[-1])}")
    return s


def comfy_noise(latent: dict, seed: int) -> list[torch.Tensor]:
    """ComfyUI's ``prepare_noise(latent["samples"], seed, latent.get("batch_index"))``.

    One CPU generator seeded with ``seed`` (``torch.manual_seed`` semantics, without touching the
    global RNG) draws float32 ``randn`` of each tensor's full shape, video first then audio for a
    NestedTensor, cast to the tensor's dtype. With ``batch_index`` (``noise_inds``) one
    ``[1, ...]`` draw is made per index up to the largest and the batch picks its own.
    Returns the noise tensors in LATENT order (one for a plain latent).
    """
    gen = torch.Generator(device="cpu").manual_seed(int(seed))
    samples = latent["samples"]
    tensors = list(samples.tensors) if is_nested(samples) else [samples]
    inds = latent.get("batch_index")
    out = []
    for t in tensors:
        if inds is None:
            out.append(torch.randn(t.shape, dtype=torch.float32, generator=gen, device="cpu").to(t.dtype))
            continue
        unique, inverse = np.unique(np.asarray(inds), return_inverse=True)
        draws = {}
        for i in range(int(unique[-1]) + 1):
            n = torch.randn([1, *t.shape[1:]], dtype=torch.float32, generator=gen, device="cpu").to(t.dtype)
            if i in unique:
                draws[i] = n
        out.append(torch.cat([draws[int(unique[j])] for j in inverse.reshape(-1)], dim=0))
    return out


# --------------------------------------------------------------------------- the loop


@dataclasses.dataclass
class _Stream:
    """One modality's sampling state on the model device (float32 tokens ``[B, T, C]``)."""

    x: torch.Tensor
    latent: torch.Tensor
    timestep_mask: torch.Tensor  # [B, T], or [B, 1] when uniform (ModalityInput.timesteps)
    mask: torch.Tensor | None  # [B, T, 1] when the LATENT has a noise_mask
    positions: torch.Tensor
    contexts: list  # per pass: [B, L, D] in the model dtype


def _predict(streams: dict, sigma: torch.Tensor, cfg: float, dtype: torch.dtype, velocity: Callable,
             conds: list[ExtraConds], frame_rate: float) -> dict:
    """Denoised float32 tokens per modality at ``sigma`` (KSamplerX0Inpaint + CFG + CONST);
    ``conds[i]``: the model conditions of pass ``i`` (cond, uncond)."""
    inputs = {k: (s.x * s.mask + s.latent * (1 - s.mask)) if s.mask is not None else s.x for k, s in streams.items()}
    timesteps = {k: s.timestep_mask * sigma for k, s in streams.items()}
    passes = len(next(iter(streams.values())).contexts)

    def modality(k: str, idx: list[int]) -> ModalityInput:
        s, n = streams[k], len(idx)
        return ModalityInput(tokens=inputs[k].to(dtype).repeat(n, 1, 1), timesteps=timesteps[k].repeat(n, 1),
                             positions=s.positions.repeat(n, 1, 1, 1), context=torch.cat([s.contexts[i] for i in idx]))

    def run(idx: list[int]) -> dict:
        batch = next(iter(inputs.values())).shape[0]
        call = concat_extra_conds([conds[i] for i in idx], [batch] * len(idx))
        modalities, layout = apply_extra_conds({k: modality(k, idx) for k in streams}, call, frame_rate,
                                               AUDIO_PATCHIFIER)
        outs = restore_outputs(transformer_call(velocity, modalities), layout)
        return {k: (inputs[k].repeat(len(idx), 1, 1) - outs[k].float() * sigma).chunk(len(idx)) for k in streams}

    batchable = all(len({tuple(c.shape) for c in s.contexts}) == 1 for s in streams.values()) and all(
        conds[0].batchable_with(c) for c in conds[1:])
    if batchable:  # ComfyUI batches cond and uncond when their conditioning shapes match
        den = run(list(range(passes)))
    else:
        parts = [run([i]) for i in range(passes)]
        den = {k: [p[k][0] for p in parts] for k in streams}
    out = {}
    for k, s in streams.items():
        d = den[k][1] + (den[k][0] - den[k][1]) * cfg if passes == 2 else den[k][0] * cfg
        out[k] = d * s.mask + s.latent * (1 - s.mask) if s.mask is not None else d
    return out


def _pass_conds(prompt, state) -> ExtraConds:
    """A prompt's keyframe guides and reference audio as the conditions of its model pass, checked
    against the latent (``ExtraConds.check_fits``); the grid mask is read from the LATENT's noise
    mask (sample 0, as ComfyUI's model reads it)."""
    ex = prompt.extras
    video, audio = state.video, state.audio
    keep = None
    if ex.get("keyframe_idxs") is not None and video is not None:
        keep = video.denoise_mask[0] >= 0
    conds = extra_conds(keyframe_idxs=ex.get("keyframe_idxs"), keep=keep,
                        guide_attention_entries=ex.get("guide_attention_entries"), ref_audio=ex.get("ref_audio"))
    conds.check_fits(video.shape if video is not None else None, audio.shape if audio is not None else None)
    return conds


@torch.no_grad()
def sample(
    model,
    positive,
    negative,
    latent: dict,
    *,
    sigmas=None,
    steps: int | None = None,
    cfg: float = 1.0,
    seed: int = 0,
    sampler: str = "euler",
    scheduler: dict | None = None,
    velocity_model: Callable | None = None,
    on_step: Callable[[int, int], None] | None = None,
    should_stop: Callable[[], bool] | None = None,
    on_ready: Callable[[], None] | None = None,
) -> dict:
    """Sample an LTX-2 LATENT like ComfyUI's SamplerCustomAdvanced + CFGGuider + euler.

    Args:
        model: :class:`~ltx_mgpu.denoise.model.LTXDenoiser` (connectors, dtype, device).
        positive / negative: ComfyUI CONDITIONING (``negative`` unused and may be None when
            ``cfg`` is 1).
        latent: ComfyUI LATENT: video ``[B, 128, F, H, W]``, audio ``{"samples": [B, 8, N, 16],
            "type": "audio"}`` or a NestedTensor of both; optional ``noise_mask`` and
            ``batch_index``.
        sigmas: a ComfyUI SIGMAS tensor, or ``steps`` for the LTX-2 scheduler (``scheduler``:
            its ``max_shift`` / ``base_shift`` / ``stretch`` / ``terminal`` options).
        cfg: guidance scale; ``seed``: noise seed; ``sampler``: "euler".
        velocity_model: ``f(video, audio, perturbations) -> (vx, ax)`` like ``LTXModel.forward``
            (default ``model.transformer``; pass ``model.velocity_model(group)`` for SP).
        on_step: called as ``on_step(step, total)`` after each step (step counts from 1).
        should_stop: checked before every step; True raises :class:`SamplingCancelled`. Under
            SP it must answer identically on every rank (rank 0 decides, then broadcast).
        on_ready: called once when every input is checked and the sampling state is on the
            model's device, before the first step and before any ``should_stop`` or model call
            (also when there is no step to make). Under SP, a failure until then is this rank's
            alone: the pool agrees on the outcome there (``JobContext.agree``).
    Returns:
        A LATENT of the same structure: a copy of ``latent`` with denoised ``samples`` (the
        input's dtype and device; ``noise_mask`` and other keys kept, as ComfyUI does).
    Raises:
        ValueError (incl. ConditioningError, LatentFormatError): bad inputs, before
        ``on_ready`` and any model call; SamplingCancelled: see ``should_stop``.
    """
    if sampler not in SAMPLERS:
        raise ValueError(f"sampler {sampler!r} is not supported; use one of {', '.join(SAMPLERS)}")
    use_cfg = not math.isclose(float(cfg), 1.0)
    pos = parse_conditioning(positive, "positive")
    if use_cfg and negative is None:
        raise ConditioningError(f"cfg {cfg} needs a negative conditioning (or set cfg to 1)")
    neg = parse_conditioning(negative, "negative") if use_cfg else None
    state = latent_to_tokens(latent, sampling_frame_rate(pos, neg))
    sig = resolve_sigmas(latent, sigmas, steps, **(scheduler or {}))
    if sig.numel() == 0:
        if on_ready is not None:
            on_ready()
        return dict(latent)
    noise_tokens = latent_to_tokens({**latent, "samples": _like(latent["samples"], comfy_noise(latent, seed))},
                                    state.frame_rate)
    dev = model.device
    sig = sig.to(dev)
    mods = {k: getattr(state, k) for k in ("video", "audio") if getattr(state, k) is not None}
    for k, want in zip(("video", "audio"), model.latent_widths):
        if k in mods and mods[k].tokens.shape[-1] != want:
            raise ValueError(f"the {k} latent has {mods[k].tokens.shape[-1]} channels per token, "
                             f"the model takes {want}")
    prompts = [pos, neg] if use_cfg else [pos]
    conds = [_pass_conds(p, state) for p in prompts]  # raises ExtraCondsError before any model call
    if any(p.extras.get("ref_audio") is not None for p in prompts) and not _said:
        _said.add("ref_audio")
        LOG.info("ltx_mgpu: the SP Sampler conditions on the reference audio in context; LTXVReferenceAudio's "
                 "identity guidance (its MODEL output) needs ComfyUI's sampler on the Model Loader's comfy_model")
    ctxs = [text_contexts(model, p.tensor, p.unprocessed) for p in prompts]
    has_mask = latent.get("noise_mask") is not None
    streams = {}
    for _i, (k, m) in enumerate(mods.items()):
        lat = m.tokens.to(device=dev, dtype=torch.float32)
        noise = getattr(noise_tokens, k).tokens.to(device=dev, dtype=torch.float32)
        tmask = m.denoise_mask.to(device=dev, dtype=torch.float32)
        b = lat.shape[0]
        streams[k] = _Stream(
            x=sig[0] * noise + (1.0 - sig[0]) * lat, latent=lat,
            timestep_mask=tmask[:, :1] if bool((tmask == tmask[:, :1]).all()) else tmask,  # uniform: per sample
            mask=tmask.unsqueeze(-1) if has_mask else None, positions=m.positions.to(dev),
            contexts=[repeat_to_batch(c[0 if k == "video" else 1], b) for c in ctxs],
        )
    velocity = velocity_model if velocity_model is not None else model.transformer
    if on_ready is not None:
        on_ready()
    total = sig.numel() - 1
    for i in range(total):
        if should_stop is not None and should_stop():
            raise SamplingCancelled(i, total)
        sigma, dt = sig[i], sig[i + 1] - sig[i]
        denoised = _predict(streams, sigma, float(cfg), model.dtype, velocity, conds, state.frame_rate)
        for k, s in streams.items():
            s.x = s.x + (s.x - denoised[k]) / sigma * dt
        if on_step is not None:
            on_step(i + 1, total)
    out = {k: s.x / (1.0 - sig[-1]) for k, s in streams.items()}
    return tokens_to_latent(state, out.get("video"), out.get("audio"))


def _like(samples, tensors: Sequence[torch.Tensor]):
    """``tensors`` in the structure of ``samples`` (a NestedTensor class instance, or a tensor)."""
    return type(samples)(list(tensors)) if is_nested(samples) else tensors[0]
