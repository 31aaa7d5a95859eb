"""The MODEL path's jobs: ComfyUI's own sampler runs the loop, the pool runs the transformer.

A transformer loaded by ``load_transformer`` (:mod:`ltx_mgpu.pool.denoise_jobs`) also serves:

* ``text_contexts``: the text connectors on a CONDITIONING tensor (ComfyUI's
  ``preprocess_text_embeds``, called once per conditioning when sampling starts); returns the
  processed context ``[B, L, Dv + Da]`` in the model dtype.
* ``forward``: one call of the transformer as ComfyUI's ``LTXAVModel.forward`` makes it
  (:func:`ltx_mgpu.denoise.comfyui.forward.comfy_forward`), sequence-parallel over every rank through
  the same :class:`~ltx_mgpu.denoise.parallel.ulysses.SequenceParallelTransformer` and the same
  transformer call as the SP Sampler. Tensors: ``x.0`` video latent ``[B, 128, F, H, W]``,
  ``x.1`` audio latent ``[B, 8, N, 16]`` (optional), ``t.0`` / ``t.1`` their timesteps (``[B]``
  or per token), ``context`` (only when new), and the call's keyframe guides, guide attention,
  reference audio and text mask (``wire.messages.FORWARD_TENSORS``, params ``kwargs`` /
  ``guides``; applied by :mod:`ltx_mgpu.denoise.comfyui.extra_conds`), and the blocks to skip
  (param ``skip_blocks``: ComfyUI's skip-layer guidance, :mod:`ltx_mgpu.denoise.comfyui.skip_blocks`). The text context
  is kept per model under the client's ``context_id`` (:data:`CONTEXT_SLOTS`, oldest dropped), so
  a sampling run sends it once, not per step. Returns ``out.0`` / ``out.1``, the velocities in
  the model dtype (into the client's shared memory when offered: ``JobContext.result_buffers``).
* ``model_patches``: ComfyUI's weight patches (its LoRA loaders' output) for the model's keys,
  merged on every rank (:func:`~ltx_mgpu.pool.denoise_jobs.set_weight_patches`). Adapters (a
  LoRA's factor pair, a diff) are content-addressed by the client's ids and kept on CPU: one
  sent before is referenced, not resent; a strength change re-merges without sending tensors.

``forward`` names the patches it expects (``patches``); when they are not the merged ones it is
refused with reason ``stale_patches``, an unknown ``context_id`` with ``unknown_context``, an
adapter id the pool does not hold with ``unknown_adapter``, a model that is not loaded with
``no_model``: the client remedies and retries (:mod:`ltx_mgpu.client.model`).

Errors: every input is checked before any work, identically on every rank (the same request
tensors reach every rank; :func:`ltx_mgpu.denoise.comfyui.forward.check_call`: the latents'
widths against the model's, video and audio tokens against its ``max_tokens``, timesteps in
``0..1``, the guides and reference audio against the latent); a failure inside the transformer
call (out of memory on one rank) is fatal, as in ``sample``. A cancel is honoured between
transformer blocks (``LTXDenoiser.stoppable``), so a long call stops within a few blocks.
"""

from __future__ import annotations

import math

import torch

from ltx_mgpu.denoise.comfyui.conditioning import ConditioningError
from ltx_mgpu.denoise.comfyui.extra_conds import ExtraConds, ExtraCondsError, extra_conds, grid_mask
from ltx_mgpu.denoise.comfyui.forward import (
    SIGMA_RANGE,
    ForwardError,
    av_timestep_convention,
    comfy_forward,
    processed_context,
)
from ltx_mgpu.denoise.comfyui.latents import LatentFormatError
from ltx_mgpu.denoise.comfyui.skip_blocks import SkipBlocksError, skipped_blocks
from ltx_mgpu.denoise.parallel.split import SequenceParallelConfigError
from ltx_mgpu.pool.denoise_jobs import resident_transformer, set_weight_patches
from ltx_mgpu.pool.engines import BadInput, JobCancelled, JobContext, register_engine
from ltx_mgpu.pool.patch_requests import parse_adapters, parse_entries, used_adapters
from ltx_mgpu.wire import codec
from ltx_mgpu.wire.messages import FORWARD_TENSORS, MAX_BATCH, MAX_TEXT_TOKENS, NO_PATCHES

__all__ = ["CONTEXT_SLOTS", "forward_job", "model_patches_job", "text_contexts_job"]

#: Text contexts kept per model (cond and uncond batched is one; separate, two; DualCFG, three).
CONTEXT_SLOTS = 4


def _float_tensor(tensors: dict, name: str, ndim: tuple[int, ...], what: str) -> torch.Tensor:
    """``tensors[name]`` when it is a float tensor of one of ``ndim`` dimensions (its values are
    not scanned: a NaN latent gives NaN velocities, as in ComfyUI's own model, and harms nothing)."""
    t = tensors.get(name)
    if not isinstance(t, torch.Tensor) or not t.dtype.is_floating_point or t.ndim not in ndim:
        got = "nothing" if t is None else f"{getattr(t, 'dtype', type(t).__name__)} {tuple(getattr(t, 'shape', ()))}"
        raise BadInput(f"tensor '{name}' ({what}) must be a float tensor of {' or '.join(map(str, ndim))} "
                       f"dimensions, got {got}")
    return t


def _context(context: torch.Tensor) -> torch.Tensor:
    if context.shape[0] > MAX_BATCH or context.shape[1] > MAX_TEXT_TOKENS or 0 in context.shape:
        raise BadInput(f"the text context's shape {tuple(context.shape)} is empty or over the protocol's limits "
                       f"(batch {MAX_BATCH}, {MAX_TEXT_TOKENS} tokens)")
    return context


@register_engine("text_contexts")
def text_contexts_job(ctx: JobContext, params: dict, tensors: dict) -> tuple[dict, dict]:
    """ComfyUI's ``preprocess_text_embeds`` on tensor ``context`` ``[B, L, D]`` with the resident
    model's connectors (``unprocessed``: the CONDITIONING's ``unprocessed_ltxav_embeds`` flag;
    ``patches``, when given: the weight patches the call expects merged, as ``forward``'s).

    Returns:
        On rank 0 ``({"shape": [B, L, Dv + Da]}, {"context": tensor})`` (model dtype, CPU).
    Raises:
        BadInput: no such model (reason ``no_model``); other weight patches merged (reason
            ``stale_patches``); a tensor that is not ``[B, L, D]`` float of the width the
            model's connectors (or its processed form) take.
    """
    name = params.get("model", codec.DEFAULT_MODEL)
    resident = resident_transformer(ctx, name, params.get("key"))
    want = params.get("patches")
    if want is not None and want != resident.patches:
        raise BadInput(f"the pool's '{name}' has weight patches {resident.patches}, the call expects {want}",
                       reason="stale_patches")
    context = _context(_float_tensor(tensors, "context", (3,), "the CONDITIONING tensor"))
    extra = sorted(set(tensors) - {"context"})
    if extra:
        raise BadInput(f"text_contexts takes only tensor 'context', got also {extra[:5]}")
    try:
        with torch.no_grad():
            out = processed_context(resident.denoiser, context, bool(params.get("unprocessed", False)))
    except ConditioningError as e:
        raise BadInput(str(e)) from None
    if not ctx.is_main:
        return {}, {}
    return {"shape": list(out.shape)}, {"context": out.cpu()}


def _extra_conds(kwargs: list, guides: list, tensors: dict) -> ExtraConds:
    """The call's keyframe guides, guide attention, reference audio and text mask, checked
    (:func:`ltx_mgpu.denoise.comfyui.extra_conds.extra_conds`; ``wire_conds`` of the client encodes them)."""
    if ("guide_attention_entries" in kwargs) != bool(guides):
        raise BadInput("the forward names guide_attention_entries and sends no guides, or the reverse")
    for name in ("keyframe_idxs", "ref_audio"):
        if (name in kwargs) != (name in tensors):
            raise BadInput(f"the forward names {name} and sends no tensor {name!r}, or the reverse")
    entries = []
    for i, g in enumerate(guides):
        if not isinstance(g, dict):
            raise BadInput(f"guides[{i}] must be an object")
        entries.append({**g, "pixel_mask": tensors.get(f"guide.{i}.pixel_mask")})
    try:
        keep = grid_mask(tensors["denoise_mask"]) if "denoise_mask" in tensors else None
        return extra_conds(keyframe_idxs=tensors.get("keyframe_idxs"), keep=keep,
                           guide_attention_entries=entries or None, ref_audio=tensors.get("ref_audio"),
                           attention_mask=tensors.get("attention_mask"))
    except ExtraCondsError as e:
        raise BadInput(str(e)) from None


@register_engine("forward")
def forward_job(ctx: JobContext, params: dict, tensors: dict) -> tuple[dict, dict]:
    """One transformer call on ComfyUI's tensors (module doc), sequence-parallel on every rank.

    Returns:
        On rank 0 ``({"parts": n}, {"out.0": video velocity, "out.1": audio velocity})``.
    Raises:
        BadInput: reasons ``no_model`` / ``stale_patches`` / ``unknown_context`` (module doc);
            tensors of the wrong names, shapes or values; ComfyUI keyword arguments outside
            ``FORWARD_KWARGS``; more video or audio tokens (reference audio included) than the
            model's ``max_tokens``; latents, timesteps, guides or reference audio that do not fit
            the model or the latent (``check_call``); a block to skip that the model does not have.
        JobCancelled: cancelled between transformer blocks (on every rank together).
    """
    name = params.get("model", codec.DEFAULT_MODEL)
    resident = resident_transformer(ctx, name, params.get("key"))
    m = resident.denoiser
    want = params.get("patches", NO_PATCHES)
    if want != resident.patches:
        raise BadInput(f"the pool's '{name}' has weight patches {resident.patches}, the call expects {want}",
                       reason="stale_patches")
    guides = params.get("guides") or []
    allowed = set(FORWARD_TENSORS) | {f"guide.{i}.pixel_mask" for i in range(len(guides))}
    unknown = sorted(set(tensors) - allowed)
    if unknown:
        raise BadInput(f"forward takes the tensors {list(FORWARD_TENSORS)} (and guide.<i>.pixel_mask), got also "
                       f"{unknown[:5]}")
    kwargs = list(params.get("kwargs") or [])  # each one of FORWARD_KWARGS: the schema checked them
    video = _float_tensor(tensors, "x.0", (5,), "the video latent")
    parts = [video]
    if "x.1" in tensors:
        parts.append(_float_tensor(tensors, "x.1", (4,), "the audio latent"))
    steps = [_float_tensor(tensors, "t.0", (1, 2, 3), "the video timesteps")]
    steps.append(_float_tensor(tensors, "t.1", (1, 2, 3), "the audio timesteps") if "t.1" in tensors else steps[0])
    if any(0 in p.shape for p in parts):
        raise BadInput(f"the latent has an empty dimension: {[tuple(p.shape) for p in parts]}")
    cid = params["context_id"]
    if "context" in tensors:
        context = _context(_float_tensor(tensors, "context", (3,), "the processed text context"))
        resident.contexts.pop(cid, None)
        resident.contexts[cid] = context.to(device=m.device, dtype=m.dtype)
        while len(resident.contexts) > CONTEXT_SLOTS:
            resident.contexts.popitem(last=False)
    context = resident.contexts.get(cid)
    if context is None:
        raise BadInput(f"the pool does not hold text context {cid!r}; send it", reason="unknown_context")
    resident.contexts.move_to_end(cid)
    conds = _extra_conds(kwargs, guides, tensors)
    frame_rate = float(params.get("frame_rate", 25.0))
    bounds = _timestep_range(params.get("timestep_range"))
    video = parts[0]
    def cancelled() -> bool:  # the cancel decision: a collective every rank reaches at the same blocks
        try:
            ctx.check_cancel()
        except JobCancelled:
            return True
        return False

    try:
        # comfy_forward checks every input against the model (check_call) before it moves the
        # latents to the model's device (patchifying and the positions run there)
        with torch.no_grad(), av_timestep_convention(m.transformer, params.get("av_timestep", "scaled")), \
                skipped_blocks(m.transformer, params.get("skip_blocks") or ()), m.stoppable(cancelled) as stopped:
            out = comfy_forward(m, resident.velocity, parts if len(parts) == 2 else video, tuple(steps), context,
                                frame_rate=frame_rate, conds=conds, timestep_range=bounds)
    except (ForwardError, ExtraCondsError, LatentFormatError, SequenceParallelConfigError, SkipBlocksError) as e:
        # raised before the transformer's first collective, from the request alone (every rank)
        raise BadInput(str(e)) from None
    if stopped():  # cancelled between blocks, on every rank together: the outputs are discarded
        raise JobCancelled(f"job {ctx.job_id} cancelled during the forward")
    if not ctx.is_main:
        return {}, {}
    outs = list(out) if isinstance(out, list) else [out]
    names = [f"out.{i}" for i in range(len(outs))]
    buffers = ctx.result_buffers([(n, t.dtype, tuple(t.shape)) for n, t in zip(names, outs)])
    if buffers is None:
        return {"parts": len(outs)}, {n: t.cpu() for n, t in zip(names, outs)}
    for n, t in zip(names, outs):
        buffers[n].copy_(t)
    return {"parts": len(outs)}, buffers


#: The widest timestep range a call may declare (ComfyUI's model samplings stay far inside it).
_TIMESTEP_LIMIT = 1e4


def _timestep_range(raw) -> tuple[float, float]:
    """A call's ``timestep_range`` as ``(low, high)``; :data:`SIGMA_RANGE` when not given.

    Raises:
        BadInput: not two finite numbers with ``low <= high`` inside +-:data:`_TIMESTEP_LIMIT`.
    """
    if raw is None:
        return SIGMA_RANGE
    if (len(raw) != 2 or not all(math.isfinite(v) and abs(v) <= _TIMESTEP_LIMIT for v in raw)
            or raw[0] > raw[1]):
        raise BadInput(f"timestep_range must be [low, high], finite, low <= high, within +-{_TIMESTEP_LIMIT:g}; "
                       f"got {raw!r:.80}")
    return float(raw[0]), float(raw[1])


@register_engine("model_patches")
def model_patches_job(ctx: JobContext, params: dict, tensors: dict) -> tuple[dict, dict]:
    """Merge ComfyUI's weight patches into the resident transformer on every rank.

    Params: ``patches`` (the set's id), ``entries`` ([{"key": ComfyUI key, "patches":
    [{"adapter": id, "strength", "strength_model"}]}], ComfyUI's order), ``adapters`` (the new
    ones: [{"id", "kind": "lora" | "diff" | "scale", "alpha"}], tensors ``<id>.up`` / ``<id>.down``
    or ``<id>.diff``; none for ``scale``). An empty ``entries`` restores the loaded weights.

    Returns:
        ``{"patches": id, "keys": patched weights, "adapters": ids held}``.
    Raises:
        BadInput: no such model (``no_model``); an adapter id neither sent nor held
            (``unknown_adapter``); malformed entries; a key or factor that does not fit the
            model (names the key); a merge that failed (agreed; the model is dropped).
    """
    name = params.get("model", codec.DEFAULT_MODEL)
    resident = resident_transformer(ctx, name, params.get("key"))
    held = {**resident.adapters, **parse_adapters(params.get("adapters"), tensors)}
    patches = parse_entries(params["entries"], held)
    used = used_adapters(params["entries"])
    set_weight_patches(ctx, name, resident, patches, params["patches"])
    resident.adapters = {k: v for k, v in held.items() if k in used}
    return {"patches": resident.patches, "keys": len(resident.patched_keys),
            "adapters": sorted(resident.adapters)}, {}
