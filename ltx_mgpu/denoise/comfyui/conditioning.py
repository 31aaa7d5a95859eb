"""ComfyUI CONDITIONING for LTX-2, checked and turned into ltx-core text contexts.

Accepted (ComfyUI's ``comfy/text_encoders/lt.py``, ``LTXAV.extra_conds`` in ``comfy/model_base.py``
and ``comfy_extras/nodes_lt.py``):

* our encoder's and ComfyUI's own LTX-2 TE output: ``[[tensor [B, T, D], {"pooled_output":
  None, "unprocessed_ltxav_embeds": True}]]`` (D = 3840 for 2.0, 6144 for 2.3; 64 / 48 for the
  tiny checkpoints), run through the model's connectors;
* ComfyUI's processed compat form for LTX-2.0 checkpoints: ``[B, >=1024, 2 * caption_channels]``
  and no flag, passed through (as is a 2.3 ``[B, L, 4096 + 2048]`` without the flag);
* the ``frame_rate`` added by ``LTXVConditioning`` (default 25 fps), and an all-ones
  ``attention_mask``;
* keyframe guides (``keyframe_idxs``, ``guide_attention_entries``: ``LTXVAddGuide``) and
  reference audio (``ref_audio``: ``LTXVReferenceAudio``), kept in ``extras`` for the sampler
  (:mod:`ltx_mgpu.denoise.comfyui.extra_conds` checks and applies them).

Anything else a core LTX node adds that we do not implement and any other unknown key is
rejected with a :class:`ConditioningError` naming it — never silently ignored, since ignoring it
would change the video. Only ``pooled_output`` (LTX-2 has no pooled embedding) is accepted and
ignored.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import torch

from ltx_mgpu.denoise.comfyui.latents import DEFAULT_FRAME_RATE, FLOAT_DTYPES, frame_rate_from_conditioning

__all__ = [
    "EXTRA_KEYS",
    "ConditioningError",
    "PromptConditioning",
    "parse_conditioning",
    "run_connector",
    "sampling_frame_rate",
    "text_contexts",
]

#: Keys core / LTX nodes add that change sampling and are not implemented here, with the node.
UNSUPPORTED_KEYS = {
    "generated_keyframes": "LTX keyframe nodes",
    "concat_mask": "inpaint-model conditioning",
    "denoise_mask": "a conditioning-level denoise mask",
    "audio_denoise_mask": "a conditioning-level audio denoise mask",
    "latent_shapes": "a packed-latent conditioning",
    "area": "ConditioningSetArea",
    "mask": "ConditioningSetMask",
    "strength": "ConditioningSetAreaStrength",
    "start_percent": "ConditioningSetTimestepRange",
    "end_percent": "ConditioningSetTimestepRange",
    "control": "ControlNet",
    "gligen": "GLIGEN",
    "hooks": "hook keyframes / LoRA hooks",
}
#: The model conditions a conditioning may carry (applied by ``ltx_mgpu.denoise.comfyui.extra_conds``).
EXTRA_KEYS = ("keyframe_idxs", "guide_attention_entries", "ref_audio")
_KNOWN = {"pooled_output", "unprocessed_ltxav_embeds", "frame_rate", "attention_mask", *EXTRA_KEYS}


class ConditioningError(ValueError):
    """A CONDITIONING the LTX-2 sampler cannot honour exactly; the message names the key/fix."""


@dataclasses.dataclass
class PromptConditioning:
    """One prompt's text conditioning.

    Attributes:
        tensor: ``[B, T, D]`` as given (float, any device).
        unprocessed: the ``unprocessed_ltxav_embeds`` flag.
        frame_rate: ``frame_rate`` if present (frames per second), else None.
        extras: the :data:`EXTRA_KEYS` present (keyframe guides from ``LTXVAddGuide``, reference
            audio from ``LTXVReferenceAudio``), as given; checked where they are applied.
    """

    tensor: torch.Tensor
    unprocessed: bool
    frame_rate: float | None
    extras: dict = dataclasses.field(default_factory=dict)


def _check_attention_mask(mask: Any, tensor: torch.Tensor, name: str) -> None:
    if not isinstance(mask, torch.Tensor) or mask.ndim != 2 or mask.is_complex():
        shape = tuple(mask.shape) if isinstance(mask, torch.Tensor) else type(mask).__name__
        raise ConditioningError(f"{name} conditioning's attention_mask must be [batch, tokens] (ComfyUI's layout), "
                                f"got {shape}; drop the option or send the text encoder's own mask")
    if mask.shape[-1] != tensor.shape[1]:
        raise ConditioningError(f"{name} conditioning's attention_mask covers {mask.shape[-1]} tokens, "
                                f"not {tensor.shape[1]}")
    if mask.numel() == 0 or not bool((mask == 1).all()):
        raise ConditioningError(
            f"{name} conditioning has an 'attention_mask' that is not all ones; padded text tokens are not "
            "supported by the multi-GPU sampler. Trim the padding (ComfyUI's LTX-2 text encoder does) instead."
        )


def parse_conditioning(conditioning: Any, name: str = "positive") -> PromptConditioning:
    """Validate one CONDITIONING input and return its tensor, flag and frame rate.

    Args:
        conditioning: ``[[tensor, dict]]`` (list or tuple; exactly one entry).
        name: "positive" / "negative", used in messages.
    Raises:
        ConditioningError: not a CONDITIONING, several entries (combined prompts), a tensor
            that is not ``[B, T, D]`` float or has an empty dimension, an unsupported or unknown
            key, an attention mask that is not ``[B, T]`` ones, an ``unprocessed_ltxav_embeds``
            that is not a bool, or a bad frame rate.
    """
    if not isinstance(conditioning, (list, tuple)) or not conditioning:
        raise ConditioningError(f"{name} must be a ComfyUI CONDITIONING: a list of [tensor, dict] entries")
    if len(conditioning) != 1:
        raise ConditioningError(
            f"{name} conditioning has {len(conditioning)} entries (combined/concatenated prompts); the LTX-2 "
            "multi-GPU sampler takes exactly one. Encode a single prompt instead."
        )
    entry = conditioning[0]
    if not isinstance(entry, (list, tuple)) or len(entry) != 2 or not isinstance(entry[1], dict):
        raise ConditioningError(f"{name} conditioning entry must be [tensor, dict]")
    tensor, opts = entry
    if not isinstance(tensor, torch.Tensor) or tensor.ndim != 3 or tensor.dtype not in FLOAT_DTYPES:
        shape = (f"{tensor.dtype} {tuple(tensor.shape)}" if isinstance(tensor, torch.Tensor)
                 else type(tensor).__name__)
        raise ConditioningError(f"{name} conditioning tensor must be a float [batch, tokens, width] tensor, "
                                f"got {shape}; connect a text encoder's CONDITIONING")
    if tensor.numel() == 0:
        raise ConditioningError(f"{name} conditioning tensor is empty: {tuple(tensor.shape)}; every dimension "
                                "must be at least 1 (encode a prompt)")
    for key in opts:
        if key in UNSUPPORTED_KEYS:
            raise ConditioningError(
                f"{name} conditioning has '{key}' (from {UNSUPPORTED_KEYS[key]}), which the LTX-2 multi-GPU sampler "
                "does not support yet; remove that node or sample with ComfyUI's own sampler."
            )
        if key not in _KNOWN:
            raise ConditioningError(
                f"{name} conditioning has the unknown key '{key}'; the LTX-2 multi-GPU sampler refuses to ignore "
                "it silently. Remove the node that adds it or sample with ComfyUI's own sampler."
            )
    if opts.get("attention_mask") is not None:
        _check_attention_mask(opts["attention_mask"], tensor, name)
    flag = opts.get("unprocessed_ltxav_embeds")
    if flag is not None and not isinstance(flag, bool):
        raise ConditioningError(f"{name} conditioning's 'unprocessed_ltxav_embeds' must be true or false, got "
                                f"{flag!r:.40}; ComfyUI's LTX-2 text encoder sets it to true")
    fps = frame_rate_from_conditioning([entry], default=math.nan)  # raises ValueError for a bad value
    return PromptConditioning(tensor, bool(opts.get("unprocessed_ltxav_embeds", False)),
                              None if math.isnan(fps) else fps,
                              {k: opts[k] for k in EXTRA_KEYS if opts.get(k) is not None})


def sampling_frame_rate(positive: PromptConditioning, negative: PromptConditioning | None) -> float:
    """The frame rate (fps) for video positions: ``frame_rate``, else 25 (ComfyUI's default).

    ComfyUI gives each prompt its own ``frame_rate`` (default 25); the batched CFG pass uses one
    set of positions, so the two must agree. Raises ConditioningError if they differ (set both
    with one ``LTXVConditioning`` node).
    """
    fps = positive.frame_rate if positive.frame_rate is not None else DEFAULT_FRAME_RATE
    if negative is not None:
        neg = negative.frame_rate if negative.frame_rate is not None else DEFAULT_FRAME_RATE
        if neg != fps:
            raise ConditioningError(
                f"positive frame_rate {fps} and negative frame_rate {neg} differ (a missing one means 25); "
                "set both with one LTXVConditioning node"
            )
    return float(fps)


# --------------------------------------------------------------------------- text contexts


@torch.no_grad()
def text_contexts(model, context: torch.Tensor, unprocessed: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """ComfyUI's ``LTXAVModel.preprocess_text_embeds`` followed by ``_prepare_context``'s split.

    Args:
        model: an :class:`~ltx_mgpu.denoise.model.LTXDenoiser`.
        context: ``[B, T, D]`` from CONDITIONING (any float dtype/device).
        unprocessed: the ``unprocessed_ltxav_embeds`` flag.
    Returns:
        (video ``[B, L, Dv]``, audio ``[B, L, Da]``) ``Modality.context`` tensors in the model
        dtype and device, widths ``model.context_widths``. Without the flag, a width of
        ``video inner + audio inner`` (2.3) or ``2 * caption_channels`` (2.0: ComfyUI's compat
        TE output) is already processed and only split. Otherwise the context is split
        ``[video inner | audio inner]`` when that wide, else given to both connectors (2.0:
        3840 -> both), and each part runs through its connector (:func:`run_connector`).
    Raises:
        ConditioningError: a width that fits neither form, or unprocessed input for a file
            without connectors.
    """
    t = model.config["transformer"]
    vdim, adim = int(t["cross_attention_dim"]), int(t["audio_cross_attention_dim"])
    cap = None if t.get("caption_proj_before_connector", False) else int(t["caption_channels"])
    width = context.shape[-1]
    ctx = context.to(device=model.device, dtype=model.dtype)
    if not unprocessed and width in ({vdim + adim} | ({2 * cap} if cap else set())):
        vw, aw = model.context_widths
        if width != vw + aw:
            raise ConditioningError(f"a processed LTX-{model.version} context is {vw}+{aw} = {vw + aw} wide; "
                                    f"got {width}")
        return ctx[..., :vw], ctx[..., vw:]
    if model.video_connector is None or model.audio_connector is None:
        raise ConditioningError(
            f"{model.source} has no embeddings connectors, so the conditioning must be the processed form "
            "(ComfyUI's own LTX-2.0 TE output); use the full checkpoint to run the connectors here"
        )
    v, a = (ctx[..., :vdim], ctx[..., vdim:]) if width == vdim + adim else (ctx, ctx)
    want = (model.video_connector.inner_dim, model.audio_connector.inner_dim)
    if (v.shape[-1], a.shape[-1]) != want:
        raise ConditioningError(
            f"conditioning of width {width} does not fit this LTX-{model.version} model: its connectors take "
            f"{want[0]} (video) and {want[1]} (audio) wide text features. Encode the prompt with the text encoder "
            "that belongs to this checkpoint."
        )
    return run_connector(model.video_connector, v), run_connector(model.audio_connector, a)


def run_connector(connector, x: torch.Tensor) -> torch.Tensor:
    """An ltx-core ``Embeddings1DConnector`` over ``[B, T, D]`` with ComfyUI's register layout.

    ComfyUI's ``Embeddings1DConnector.forward`` appends the tiled learnable registers
    ``registers[T:L]`` after the T real tokens, ``L = R * ceil(max(1024, T) / R)`` (R registers),
    and attends without a mask. ltx-core's connector replaces masked (padding) positions
    instead; fed the already-padded sequence with an all-valid mask its replacement is the
    identity, so the result is ComfyUI's. Returns ``[B, L, D]``.
    """
    r = connector.num_learnable_registers
    if not r:
        return connector(x, None)[0]
    b, t, _ = x.shape
    length = r * math.ceil(max(1024, t) / r)
    regs = connector.learnable_registers.to(x).tile(length // r, 1)[t:]
    seq = torch.cat([x, regs.unsqueeze(0).expand(b, -1, -1)], dim=1)
    mask = torch.zeros(1, 1, 1, length, dtype=x.dtype, device=x.device)
    # ltx-core's register replacement indexes with a squeezed mask: one sample at a time.
    return torch.cat([connector(seq[i : i + 1], mask)[0] for i in range(b)])
