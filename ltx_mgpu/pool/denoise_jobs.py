"""The pool's LTX-2 denoising jobs: ``load_transformer`` and ``sample``, run on every rank (SPMD).

``load_transformer`` validates the request identically on every rank before anything heavy
(the checkpoint's header and config, the head split for this pool's world size, the LoRA
files), then every rank loads a full replica (memory-mapped reads, LoRAs fused; DESIGN §5),
wraps it once in :class:`~ltx_mgpu.denoise.sequence_parallel.SequenceParallelTransformer`
over the data group and keeps it resident under a name. Loading the same files with the same
options again keeps the resident model (``reused``).

``sample`` rebuilds the ComfyUI LATENT / CONDITIONING / SIGMAS from the request
(:mod:`ltx_mgpu.wire.codec`). The worker already hands every rank identical copies of the
request tensors (the job spec broadcast over the control group), so no rank re-broadcasts
them. Every rank then runs :func:`ltx_mgpu.denoise.sampler.sample` with the same inputs and
seed; the SP transformer exchanges activations over the data group. A progress event is sent
per step, cancel is decided at every step boundary by rank 0 (``ctx.check_cancel``), and rank
0 returns the denoised latent parts.

Errors: the denoise modules raise ``ValueError`` subclasses (``CheckpointError``,
``ConditioningError``, ``LatentFormatError``, ``SequenceParallelConfigError``) for wrong
requests; raised before the first transformer forward they are deterministic on every rank
and become :class:`~ltx_mgpu.pool.engines.BadInput` (the pool keeps serving). Anything later
is fatal.
"""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path

import torch

from ltx_mgpu.choices import SAMPLERS
from ltx_mgpu.denoise.checkpoint import CheckpointError, LoraSpec, inspect_checkpoint
from ltx_mgpu.denoise.model import LTXDenoiser, check_world_size, load_ltx_model
from ltx_mgpu.denoise.sampler import sample
from ltx_mgpu.denoise.sequence_parallel import SequenceParallelTransformer
from ltx_mgpu.denoise.sp_config import SequenceParallelConfigError, check_token_budget, valid_world_sizes
from ltx_mgpu.nested import NestedTensorLike, is_nested
from ltx_mgpu.pool.engines import BadInput, JobContext, free_memory, register_engine
from ltx_mgpu.wire import codec

__all__ = ["DTYPES", "ResidentTransformer", "load_transformer", "sample_job"]

#: ``load_transformer`` dtype names -> torch dtypes.
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
#: ``LTX2Scheduler`` options a ``sample`` request may set (``ltx_mgpu.denoise.sampler.ltx2_sigmas``).
SCHEDULER_OPTIONS = ("max_shift", "base_shift", "stretch", "terminal")


@dataclasses.dataclass(eq=False)
class ResidentTransformer:
    """A loaded denoiser kept in ``ctx.models``.

    Attributes:
        denoiser: the :class:`LTXDenoiser` (transformer + connectors) on this rank's device.
        velocity: its SP wrapper over the pool's data group (built once, at load).
        identity: what was loaded (resolved paths, sizes and mtimes, options); a request with
            the same identity keeps this model.
    """

    denoiser: LTXDenoiser
    velocity: SequenceParallelTransformer
    identity: dict


def _file_identity(path: str) -> dict:
    st = os.stat(path)
    return {"path": str(Path(path).resolve()), "size": st.st_size, "mtime_ns": st.st_mtime_ns}


def _parse_loras(raw) -> tuple[LoraSpec, ...]:
    specs = []
    for i, item in enumerate(raw or []):
        strength = item.get("strength", 1.0)
        if (not isinstance(item.get("path"), str) or isinstance(strength, bool)
                or not isinstance(strength, (int, float))):
            raise BadInput(f"loras[{i}] must be {{\"path\": str, \"strength\": number}}, got {item!r:.120}")
        if not Path(item["path"]).is_file():
            raise BadInput(f"no LoRA file at {item['path']}; pick a file from models/loras")
        specs.append(LoraSpec(item["path"], float(strength)))
    return tuple(specs)


def _model_bytes(m: LTXDenoiser) -> int:
    modules = [x for x in (m.transformer, m.video_connector, m.audio_connector) if x is not None]
    return int(sum(t.numel() * t.element_size() for mod in modules for t in [*mod.parameters(), *mod.buffers()]))


def _describe(name: str, r: ResidentTransformer, world_size: int, reused: bool) -> dict:
    m, t = r.denoiser, r.denoiser.config["transformer"]
    return {
        "model": name, "reused": reused, "checkpoint": m.source, "version": m.version,
        "dtype": r.identity["dtype"], "max_tokens": m.max_tokens, "world_size": world_size,
        "heads": {"video": int(t["num_attention_heads"]), "audio": int(t["audio_num_attention_heads"])},
        "valid_world_sizes": valid_world_sizes(m.transformer), "context_widths": list(m.context_widths),
        "has_connectors": m.video_connector is not None, "loras": [dataclasses.asdict(s) for s in m.loras],
        "bytes": _model_bytes(m),
    }


@register_engine("load_transformer")
def load_transformer(ctx: JobContext, params: dict, tensors: dict) -> tuple[dict, dict]:
    """Load an LTX-2 transformer + connectors on every rank and keep it resident as ``name``.

    Params: ``checkpoint`` (path), ``dtype`` ("bf16" | "fp16" | "fp32", default bf16),
    ``loras`` ([{"path", "strength"}]), ``max_tokens`` (video tokens per ``sample``, default
    32768), ``attention_type`` (ltx-core backend or null), ``name`` (default "ltx").

    Returns:
        ``{"model", "reused", "checkpoint", "version", "dtype", "max_tokens", "world_size",
        "heads": {"video", "audio"}, "valid_world_sizes", "context_widths", "has_connectors",
        "loras", "bytes"}`` (bytes of one rank's replica).
    Raises:
        BadInput (identically on every rank, before any collective): no such file, not an
        LTX-2 checkpoint, heads the world size does not divide (naming the GPU counts that
        work), a missing or foreign LoRA, ``max_tokens < 1``; after a control-group agreement:
        a ``name`` held by a non-transformer model, out of memory while loading (on any rank).
    """
    name = params.get("name", codec.DEFAULT_MODEL)
    dtype_name = params.get("dtype", "bf16")
    max_tokens = int(params.get("max_tokens", 32768))
    attention_type = params.get("attention_type")
    path = params["checkpoint"]
    if max_tokens < 1:
        raise BadInput(f"max_tokens must be a positive number of video tokens, got {max_tokens}")
    if not Path(path).is_file():
        raise BadInput(f"no checkpoint at {path}; pick an LTX-2 file from models/checkpoints or "
                       "models/diffusion_models (the path is read by the pool's processes)")
    loras = _parse_loras(params.get("loras"))
    try:
        info = inspect_checkpoint(path)
        check_world_size(info, ctx.world_size)  # from the config alone: no weight read yet
    except (CheckpointError, SequenceParallelConfigError) as e:
        raise BadInput(f"{Path(path).name}: {e}") from None
    identity = {"checkpoint": _file_identity(path), "dtype": dtype_name, "max_tokens": max_tokens,
                "attention_type": attention_type,
                "loras": [{**_file_identity(s.path), "strength": s.strength} for s in loras]}
    # Everything above is decided by the files alone; what follows depends on this rank's state
    # (resident models, free memory), so the ranks agree on the outcome over the control group.
    resident = ctx.models.get(name)
    clash = None
    if resident is not None and not isinstance(resident, ResidentTransformer):
        clash = (f"the name '{name}' belongs to another resident model ({type(resident).__name__}); "
                 "load the transformer under another name")
    ctx.agree(clash)
    if isinstance(resident, ResidentTransformer) and resident.identity == identity:
        return _describe(name, resident, ctx.world_size, reused=True), {}
    if ctx.models.pop(name) is not None:  # free the old replica before reading the new one
        del resident
        free_memory(ctx.device)
    m = velocity = error = None
    try:
        m = load_ltx_model(path, ctx.device, DTYPES[dtype_name], loras, max_tokens, attention_type=attention_type)
        velocity = m.velocity_model(ctx.data_group)
    except (FileNotFoundError, ValueError) as e:  # CheckpointError & co (identical on every rank)
        error = f"{Path(path).name}: {e}"
    except (torch.OutOfMemoryError, MemoryError):
        error = (f"out of memory loading {Path(path).name} ({dtype_name}) on {ctx.device}: every GPU holds a "
                 "full replica; free memory first (unload other models, e.g. the text encoder) or use a "
                 "smaller file (fp8)")
    if error is not None:
        m = velocity = None
        free_memory(ctx.device)
    ctx.agree(error)
    resident = ResidentTransformer(m, velocity, identity)
    ctx.models.put(name, resident, {"kind": "ltx_transformer", "checkpoint": m.source, "version": m.version,
                                    "dtype": dtype_name, "bytes": _model_bytes(m), "devices": [str(m.device)]})
    ctx.log(f"loaded LTX-{m.version} transformer '{name}' from {m.source} ({dtype_name}, "
            f"{len(m.loras)} LoRA(s), world size {ctx.world_size})")
    return _describe(name, resident, ctx.world_size, reused=False), {}


def _video_tokens(latent: dict) -> int:
    """Video tokens (frames x height x width) of a LATENT (0 for audio-only)."""
    samples = latent["samples"]
    if is_nested(samples):
        samples = samples.tensors[0]
    elif latent.get("type") == "audio":
        return 0
    return int(samples.shape[2] * samples.shape[3] * samples.shape[4]) if samples.ndim == 5 else 0


@register_engine("sample")
def sample_job(ctx: JobContext, params: dict, tensors: dict) -> tuple[dict, dict]:
    """Denoise a ComfyUI LTX-2 LATENT on every rank with the resident SP transformer.

    Params and tensors: :meth:`ltx_mgpu.client.denoise.SampleRequest.to_wire` (``model``,
    ``positive``, ``negative``, ``latent``, ``sigmas`` tensor or ``steps`` + ``scheduler``,
    ``cfg``, ``seed``, ``sampler``). Progress: phase ``"denoise"``, once per step.

    Returns:
        On rank 0: ``({"latent": {"samples", "parts"}, "steps": n}, {"latent" | "latent.i": ...})``
        (the denoised parts in the input dtype, on CPU); on the other ranks ``({}, {})``.
    Raises:
        BadInput: no such model, a malformed request, unsupported conditioning keys, a LATENT
            that is not LTX-2's, bad sigmas, more video tokens than ``max_tokens``.
        JobCancelled: cancelled at a step boundary (on every rank together).
    """
    name = params.get("model", codec.DEFAULT_MODEL)
    resident = ctx.models.get(name)
    if not isinstance(resident, ResidentTransformer):
        raise BadInput(f"no LTX-2 transformer named '{name}' is loaded in the pool; load one first "
                       "(load_transformer / the Model Loader node)")
    sampler = params.get("sampler", "euler")
    if sampler not in SAMPLERS:
        raise BadInput(f"sampler '{sampler}' is not supported; use one of {', '.join(SAMPLERS)}")
    scheduler = params.get("scheduler") or {}
    unknown = sorted(set(scheduler) - set(SCHEDULER_OPTIONS))
    if unknown:
        raise BadInput(f"unknown scheduler option(s) {unknown}; known: {list(SCHEDULER_OPTIONS)}")
    seed = int(params.get("seed", 0))
    if not 0 <= seed < 1 << 64:
        raise BadInput(f"seed must be in 0..2**64-1 (ComfyUI's range), got {seed}")
    m = resident.denoiser
    try:
        latent = codec.latent_from_request(params["latent"], tensors, NestedTensorLike)
        positive = codec.conditioning_from_request(params["positive"], tensors, "positive")
        negative = (codec.conditioning_from_request(params["negative"], tensors, "negative")
                    if params.get("negative") is not None else None)
        check_token_budget(_video_tokens(latent), m.max_tokens)
    except ValueError as e:
        raise BadInput(str(e)) from None

    forwards = done = 0

    def velocity(video, audio, perturbations):
        nonlocal forwards
        forwards += 1
        return resident.velocity(video, audio, perturbations)

    def on_step(step: int, total: int) -> None:
        nonlocal done
        done = step
        ctx.progress("denoise", step, total)

    def should_stop() -> bool:
        ctx.check_cancel()  # raises JobCancelled on every rank together
        return False

    try:
        out = sample(m, positive, negative, latent, sigmas=tensors.get("sigmas"), steps=params.get("steps"),
                     cfg=float(params.get("cfg", 1.0)), seed=seed, sampler=sampler, scheduler=scheduler,
                     velocity_model=velocity, should_stop=should_stop, on_step=on_step)
    except SequenceParallelConfigError as e:  # raised inside forward before its first collective
        raise BadInput(str(e)) from None
    except ValueError as e:
        if forwards:  # a collective may have run: not a clean request error
            raise
        raise BadInput(str(e)) from None
    if not ctx.is_main:
        return {}, {}
    spec, out_tensors = codec.latent_to_result(out)
    return {"latent": spec, "steps": done, "model": name}, out_tensors
