"""The pool's LTX-2 denoising jobs: ``load_transformer`` and ``sample``, run on every rank (SPMD).

``load_transformer`` validates the request identically on every rank before anything heavy
(the checkpoint's header and config, the head split for this pool's world size, the LoRA
files), then every rank loads a full replica (memory-mapped reads, LoRAs fused; DESIGN §5),
wraps it once in :class:`~ltx_mgpu.denoise.parallel.ulysses.SequenceParallelTransformer`
over the data group and keeps it resident under a name. Loading the same files with the same
options again keeps the resident model (``reused``).

``sample`` rebuilds the ComfyUI LATENT / CONDITIONING / SIGMAS from the request
(:mod:`ltx_mgpu.wire.codec`). The worker already hands every rank identical copies of the
request tensors (the job spec broadcast over the control group), so no rank re-broadcasts
them. Every rank then runs :func:`ltx_mgpu.denoise.comfyui.sampler.sample` with the same inputs and
seed; the SP transformer exchanges activations over the data group. A progress event is sent
per step, cancel is decided at every step boundary by rank 0 (``ctx.check_cancel``), and rank
0 returns the denoised latent parts.

Errors: every field is typed, ranged and shape-checked before any work: the schemas
(``ltx_mgpu.wire.messages``, with the protocol's request limits) at receipt, then on every rank
alike the nested params (``ltx_mgpu.wire.codec``), the sizes they imply, the checkpoint's and
the LoRA files' headers. The denoise modules raise ``ValueError`` subclasses
(``CheckpointError``, ``ConditioningError``, ``LatentFormatError``,
``SequenceParallelConfigError``) for wrong requests. What only a rank's device can tell (an
attention backend that cannot run, out of memory, LoRA values, a failure while the sampler
prepares its inputs) is *agreed* before any data collective (``JobContext.agree``), so every
rank raises the same :class:`~ltx_mgpu.pool.engines.BadInput` and the pool keeps serving.
A failure after that agreement, inside the denoising loop, is fatal.
"""

from __future__ import annotations

import collections
import dataclasses
import hashlib
import json
import math
import os
from pathlib import Path

import torch

from ltx_mgpu.choices import SAMPLERS
from ltx_mgpu.denoise.attention.function import TRITON_8BIT, attention_function, support_error
from ltx_mgpu.denoise.checkpoint import (
    CONNECTORS,
    CheckpointError,
    CheckpointInfo,
    check_loras,
    connector_info,
    inspect_checkpoint,
    packed_weight,
)
from ltx_mgpu.denoise.comfyui.sampler import SCHEDULER_OPTIONS, check_scheduler_options, sample
from ltx_mgpu.denoise.fp8 import fp8_support_error, fp8_weight
from ltx_mgpu.denoise.model import LTXDenoiser, check_world_size, checkpoint_storage, load_ltx_model
from ltx_mgpu.denoise.parallel.fsdp import fit_error, held_bytes, weight_plan
from ltx_mgpu.denoise.parallel.split import SequenceParallelConfigError, check_token_budget, valid_world_sizes
from ltx_mgpu.denoise.parallel.ulysses import SequenceParallelTransformer
from ltx_mgpu.denoise.patches import PatchError, WeightPatch, apply_patches
from ltx_mgpu.denoise.plan import TransformerPlan
from ltx_mgpu.nested import NestedTensorLike, is_nested
from ltx_mgpu.pool.engines import BadInput, JobContext, failure_message, free_memory, register_engine
from ltx_mgpu.quantized.packed import packed_shape
from ltx_mgpu.wire import codec
from ltx_mgpu.wire.messages import MAX_BATCH, MAX_STEPS, MAX_TEXT_TOKENS, NO_PATCHES

__all__ = ["SCHEDULER_OPTIONS", "ResidentTransformer", "load_transformer", "resident_transformer", "sample_job",
           "set_weight_patches"]


@dataclasses.dataclass(eq=False)
class ResidentTransformer:
    """A loaded denoiser kept in ``ctx.models``.

    Attributes:
        denoiser: the :class:`LTXDenoiser` (transformer + connectors) on this rank's device.
        velocity: its SP wrapper over the pool's data group (built once, at load).
        identity: what was loaded (resolved paths, sizes and mtimes, options); a request with
            the same identity keeps this model.
        patches: the id of the ComfyUI weight patches merged into the weights (``NO_PATCHES``:
            the loaded weights), ``patched_keys`` the ComfyUI keys they touch, ``adapters`` the
            patch tensors by adapter id (CPU), all kept by :mod:`ltx_mgpu.pool.model_jobs`.
        contexts: processed text contexts of the MODEL path by id, oldest first
            (``ltx_mgpu.pool.model_jobs.CONTEXT_SLOTS`` at most).
    """

    denoiser: LTXDenoiser
    velocity: SequenceParallelTransformer
    identity: dict
    patches: str = NO_PATCHES
    patched_keys: frozenset = frozenset()
    adapters: dict = dataclasses.field(default_factory=dict)
    contexts: collections.OrderedDict = dataclasses.field(default_factory=collections.OrderedDict)

    @property
    def key(self) -> str:
        """A digest of ``identity``: the same files and options give the same key (the MODEL
        path's calls name it, so a call never runs another model loaded under the same name)."""
        return hashlib.sha256(json.dumps(self.identity, sort_keys=True).encode()).hexdigest()[:16]


def resident_transformer(ctx: JobContext, name: str, key: str | None = None) -> ResidentTransformer:
    """The transformer resident as ``name`` (and, with ``key``, loaded with that key).

    Raises:
        BadInput (reason ``no_model``): none of that name (never loaded, freed, or the pool
            restarted), or another model loaded under the name since.
    """
    resident = ctx.models.get(name)
    if not isinstance(resident, ResidentTransformer):
        raise BadInput(f"no LTX-2 transformer named '{name}' is loaded in the pool; load one first "
                       "(load_transformer / the Model Loader node)", reason="no_model")
    if key is not None and key != resident.key:
        raise BadInput(f"the pool's '{name}' is another model now ({Path(resident.denoiser.source).name}); "
                       "load this one again", reason="no_model")
    if resident.denoiser.compiles is not None:  # this job reports a first call's compile
        resident.denoiser.compiles.on_compile = lambda text, cached: announce_compile(ctx, text)
        resident.denoiser.compiles.on_compiled = lambda text: announce_compile(ctx, text, done=True)
    return resident


def announce_compile(ctx: JobContext, text: str, done: bool = False) -> None:
    """A compile of the transformer blocks begins (``done`` False) or ends: ``text`` in the log
    (:func:`ltx_mgpu.denoise.compiling.compile_message` / ``compiled_message``) and the
    ``compile`` phase's one step, 0 of 1 at the start, 1 of 1 at the end (a progress bar of the
    phase closes there)."""
    ctx.log(text)
    ctx.progress("compile", int(done), 1)


def set_weight_patches(ctx: JobContext, name: str, resident: ResidentTransformer,
                       patches: dict[str, list[WeightPatch]], patches_id: str) -> None:
    """Merge ComfyUI weight ``patches`` (ComfyUI key -> patch list) into the resident model on
    every rank, in place of the ones merged before (:func:`ltx_mgpu.denoise.patches.apply_patches`);
    ``{}`` with :data:`NO_PATCHES` restores the loaded weights.

    Raises:
        BadInput: a key or patch that does not fit the model (identically on every rank, before
            any weight changes); a merge that failed on any rank midway (agreed): the half-merged
            model is then dropped from the pool, so the next request loads it again.
    """
    m, error, keys = resident.denoiser, None, None
    try:
        keys = apply_patches(m, patches, resident.patched_keys)
    except PatchError as e:  # raised before any weight changed, from the request alone
        raise BadInput(str(e)) from None
    except Exception as e:  # noqa: BLE001 - a failure midway (memory, the file): agreed, then the model is dropped
        error = failure_message(e, "merging the weight patches")
    try:
        ctx.agree(error)
    except BadInput as e:
        ctx.models.pop(name)
        free_memory(ctx.device)
        raise BadInput(f"{e}; the model was unloaded, the next run loads it again") from None
    resident.patches, resident.patched_keys = patches_id, frozenset(keys)
    ctx.log(f"'{name}': {len(keys)} weight(s) patched ({patches_id})")


def _file_identity(path: str) -> dict:
    st = os.stat(path)
    return {"path": str(Path(path).resolve()), "size": st.st_size, "mtime_ns": st.st_mtime_ns}


def _attention_error(attention_type: str | None, info: CheckpointInfo, ctx: JobContext,
                     dtype: torch.dtype) -> str | None:
    """Why this rank cannot run ``attention_type`` (or the checkpoint's own, when None) in
    ``dtype``, or None.

    The backend runs once on a tiny input of the model's head sizes and dtype on this rank's
    device (xformers and FlashAttention 3 need their packages and a GPU that they support; our
    ``triton_8bit`` a Hopper or newer GPU and Triton, :func:`~ltx_mgpu.denoise.attention.function.support_error`,
    and the model's dtype bf16 or fp16), so a backend the pool cannot run is refused at load, not at the
    first ``sample``.
    """
    t = info.config["transformer"]
    name = attention_type if attention_type is not None else t.get("attention_type", "default")
    if name == TRITON_8BIT and (err := support_error(ctx.device)):
        return err
    try:
        fn = attention_function(name)
        for head_dim in sorted({int(t.get("attention_head_dim", 64)), int(t.get("audio_attention_head_dim", 64))}):
            q = torch.zeros(1, 8, 2 * head_dim, device=ctx.device, dtype=dtype)
            fn(q, q, q, 2)
        if ctx.device.type == "cuda":
            torch.cuda.synchronize(ctx.device)
    except Exception as e:  # noqa: BLE001 - any failure means this backend cannot serve here
        first = (str(e).strip().splitlines() or [""])[0][:300]
        return (f"attention_type '{name}' cannot run on {ctx.device.type} ({type(e).__name__}: {first}); load the "
                f"model with attention_type 'pytorch' (or 'default')")
    return None


def _model_bytes(m: LTXDenoiser) -> int:
    """Bytes of weights this rank holds between calls (a sharded transformer: its shard)."""
    modules = [x for x in (m.transformer, m.video_connector, m.audio_connector) if x is not None]
    return sum(held_bytes(mod) for mod in modules)


def _weight_plan(info: CheckpointInfo, plan: TransformerPlan, world: int):
    """The :class:`~ltx_mgpu.denoise.parallel.fsdp.WeightPlan` of loading ``info`` as ``plan``
    says: the block linears at one byte per value where they are held as e4m3 (``linears`` fp8:
    all of them; ``upcast``: those the file stores so), at their GGML blocks' or packed rows'
    bytes where they stay packed (``packed``)."""
    def stored(key: str) -> int | None:
        shape = info.shapes[key]
        if plan.linears == "fp8" and fp8_weight(key, shape):
            return math.prod(shape)
        if plan.linears == "upcast" and key in info.e4m3_keys and fp8_weight(key, shape, compute=False):
            return math.prod(shape)
        if plan.linears == "packed" and packed_weight(key, qtype := info.stored_type(key)):
            return math.prod(packed_shape(qtype, shape))
        return None

    return weight_plan(info.shapes, getattr(torch, plan.compute_dtype).itemsize, world, CONNECTORS, stored)


def _describe(name: str, r: ResidentTransformer, world_size: int, reused: bool) -> dict:
    m, t = r.denoiser, r.denoiser.config["transformer"]
    return {
        "model": name, "reused": reused, "checkpoint": m.source, "version": m.version, "plan": m.plan.describe(),
        "world_size": world_size,
        "heads": {"video": int(t["num_attention_heads"]), "audio": int(t["audio_num_attention_heads"])},
        "valid_world_sizes": valid_world_sizes(m.transformer), "context_widths": list(m.context_widths),
        "has_connectors": m.video_connector is not None, "loras": [dataclasses.asdict(s) for s in m.loras],
        "bytes": _model_bytes(m), "key": r.key,
    }


@register_engine("load_transformer")
def load_transformer(ctx: JobContext, params: dict, tensors: dict) -> tuple[dict, dict]:
    """Load an LTX-2 transformer + connectors on every rank and keep it resident as ``name``.

    Params: a :class:`~ltx_mgpu.denoise.plan.TransformerPlan`'s (``TransformerPlan.to_params``:
    ``checkpoint``, ``dtype``, ``weights``, ``layout``, ``loras``, ``max_tokens``,
    ``attention_type``) and ``name`` (default "ltx"). The plan is parsed once, here, and its
    storage resolved from the checkpoint's header; the loader and the SP wrapper take it as it is.

    Returns:
        ``{"model", "reused", "checkpoint", "version", "plan", "world_size", "heads": {"video",
        "audio"}, "valid_world_sizes", "context_widths", "has_connectors", "loras", "bytes",
        "key"}`` (``plan``: ``TransformerPlan.describe()``; bytes of weights one rank holds: its
        replica or its shard; ``key`` names what was loaded, for the MODEL path's calls).
    Raises:
        BadInput (identically on every rank, before any collective): a plan the request does not
        make (a field outside its choices or range, named), no such file, not an LTX-2
        checkpoint, heads the world size does not divide (naming the GPU counts that work), a
        LoRA file that ``check_loras`` refuses (not safetensors, truncated, foreign keys, factors
        of the wrong rank or shape); after a control-group agreement: dtype fp8 on a rank without
        FP8 tensor cores (CPU, or a GPU older than Ada), a ``name`` held by a non-transformer
        model, an ``attention_type`` this rank cannot run, or a load that failed on any rank (out
        of memory, LoRA values that are not finite, ...); on GPUs, weights that do not fit a
        rank's free memory (:func:`~ltx_mgpu.denoise.parallel.fsdp.fit_error`: how much the other
        choice would need), before anything is read.
    """
    name = params.get("name", codec.DEFAULT_MODEL)
    try:
        plan = TransformerPlan.from_params(params)
    except ValueError as e:
        raise BadInput(str(e)) from None
    path = plan.checkpoint
    if not Path(path).is_file():
        raise BadInput(f"no checkpoint at {path}; pick an LTX-2 file from models/checkpoints or "
                       "models/diffusion_models (the path is read by the pool's processes)")
    for i, lora in enumerate(plan.loras):
        if not Path(lora.path).is_file():
            raise BadInput(f"loras[{i}]: no LoRA file at {lora.path}; pick a file from models/loras")
    try:
        info = inspect_checkpoint(path)
        check_world_size(info, ctx.world_size)  # from the config alone: no weight read yet
        conn_shapes = connector_info(plan.connectors, info).shapes if plan.connectors is not None else {}
    except (CheckpointError, SequenceParallelConfigError) as e:
        raise BadInput(f"{Path(path).name}: {e}") from None
    except FileNotFoundError as e:
        raise BadInput(f"{e}; pick the LTX-2 checkpoint or the embeddings-connector file (the path is read by the "
                       "pool's processes)") from None
    try:
        check_loras(plan.loras, {**info.shapes, **conn_shapes})  # from the LoRA files' headers: no tensor read yet
        plan = plan.with_storage(checkpoint_storage(info))
    except (CheckpointError, ValueError) as e:
        raise BadInput(str(e)) from None
    what = f"{Path(path).name} ({plan.dtype})"
    # compile as its outcome: dtype fp8 runs compiled blocks under auto and on alike (no reload)
    identity = {**dataclasses.asdict(plan), "compile": plan.compiled, "checkpoint": _file_identity(path),
                "connectors": _file_identity(plan.connectors) if plan.connectors is not None else None,
                "loras": [{**_file_identity(s.path), "strength": s.strength} for s in plan.loras]}
    # Everything above is decided by the files alone; what follows depends on this rank's state
    # (resident models, free memory), so the ranks agree on the outcome over the control group.
    resident = ctx.models.get(name)
    clash = None
    if resident is not None and not isinstance(resident, ResidentTransformer):
        clash = (f"the name '{name}' belongs to another resident model ({type(resident).__name__}); "
                 "load the transformer under another name")
    if clash is None and not (isinstance(resident, ResidentTransformer) and resident.identity == identity):
        clash = fp8_support_error(ctx.device) if plan.linears == "fp8" else None
        clash = clash or _attention_error(plan.attention_type, info, ctx, getattr(torch, plan.compute_dtype))
        if clash is None and ctx.device.type == "cuda":
            other = dataclasses.replace(plan, weights="sharded" if plan.weights == "replicated" else "replicated")
            sized = dataclasses.replace(info, shapes={**info.shapes, **conn_shapes})  # the connectors' file's too
            needs, other_needs = (_weight_plan(sized, p, ctx.world_size) for p in (plan, other))
            free, total = torch.cuda.mem_get_info(ctx.device)
            if isinstance(resident, ResidentTransformer):  # its memory is freed before the new load
                free += held_bytes(resident.denoiser.transformer)
            clash = fit_error(needs, plan.weights, free, total, what, other_needs)
    ctx.agree(clash)
    if isinstance(resident, ResidentTransformer) and resident.identity == identity:
        return _describe(name, resident, ctx.world_size, reused=True), {}
    if ctx.models.pop(name) is not None:  # free the old replica before reading the new one
        del resident
        free_memory(ctx.device)
    m = velocity = error = None
    try:
        m = load_ltx_model(plan, ctx.device, group=ctx.data_group, info=info)
        velocity = m.velocity_model(ctx.data_group)
    except (torch.OutOfMemoryError, MemoryError):
        hint = ("every GPU holds a full replica: try weights 'sharded'" if plan.weights == "replicated" else
                "each GPU holds a shard")
        error = (f"out of memory loading {what} on {ctx.device} ({hint}); free memory first (unload other models, "
                 "e.g. the text encoder)")
    except (FileNotFoundError, ValueError) as e:  # CheckpointError & co (identical on every rank)
        error = f"{Path(path).name}: {e}"
    except Exception as e:  # noqa: BLE001 - the load runs no collective: any failure is this request's, agreed
        error = failure_message(e, f"loading {Path(path).name}")
    if error is not None:
        m = velocity = None
        free_memory(ctx.device)
    ctx.agree(error)
    resident = ResidentTransformer(m, velocity, identity)
    ctx.models.put(name, resident, {"kind": "ltx_transformer", "checkpoint": m.source, "version": m.version,
                                    "plan": m.plan.describe(), "bytes": _model_bytes(m),
                                    "devices": [str(m.device)]})
    ctx.log(f"loaded LTX-{m.version} transformer '{name}' from {m.source} ({plan.dtype}, {plan.weights}, "
            f"{len(m.loras)} LoRA(s), world size {ctx.world_size}, {_model_bytes(m) / 2**30:.2f} GiB on this rank)")
    if m.plan.compiled:
        ctx.log(("dtype fp8" if m.linears == "fp8" else "compile on")
                + ": the first call at each size compiles the transformer blocks (torch.compile); later calls "
                "at that size run compiled, and later pools load the compile from the compile cache "
                "($LTX_MGPU_COMPILE_CACHE_DIR)"
                + (f"; video token counts are padded up to buckets ({m.buckets.per_octave} per doubling, "
                   "$LTX_MGPU_TOKEN_BUCKETS), so nearby sizes share a compile" if m.buckets is not None else ""))
    return _describe(name, resident, ctx.world_size, reused=False), {}


def _token_counts(latent: dict) -> tuple[int, int]:
    """(video tokens per sample, audio tokens per sample) of a LATENT (0 for a missing modality):
    frames x height x width of the video, frames of the audio; 0 for a shape that is not LTX-2's
    (``latent_to_tokens`` refuses it)."""
    samples = latent["samples"]
    parts = list(samples.tensors) if is_nested(samples) else [samples]
    video = audio = 0
    for i, t in enumerate(parts):
        if not isinstance(t, torch.Tensor):
            continue
        if t.ndim == 5 and i == 0 and (len(parts) > 1 or latent.get("type") != "audio"):
            video = math.prod(t.shape[2:])
        elif t.ndim == 4 and (i == 1 or latent.get("type") == "audio"):
            audio = int(t.shape[2])
    return video, audio


def _check_sizes(m: LTXDenoiser, params: dict, tensors: dict, latent: dict, conditionings: dict) -> None:
    """The sizes a ``sample`` implies, against the protocol's limits and the model's token
    budget, before any work (identically on every rank).

    Raises:
        BadInput: tensors the params do not name; a LATENT or CONDITIONING batch over
            ``MAX_BATCH``; conditioning tokens over ``MAX_TEXT_TOKENS``; more than
            ``MAX_STEPS + 1`` sigmas.
        SequenceParallelConfigError: video or audio tokens over the model's ``max_tokens``.
    """
    extra = sorted(set(tensors) - codec.sample_tensor_names(params))
    if extra:
        raise BadInput(f"the sample request carries unexpected tensor(s) {extra[:5]}; send only the tensors "
                       "params.latent, positive and negative name, and 'sigmas'")
    samples = latent["samples"]
    first = samples.tensors[0] if is_nested(samples) else samples
    if isinstance(first, torch.Tensor) and first.ndim and first.shape[0] > MAX_BATCH:
        raise BadInput(f"the latent's batch is {first.shape[0]}, more than {MAX_BATCH} (ComfyUI's largest batch); "
                       "sample fewer latents at once")
    for side, conditioning in conditionings.items():
        for entry in conditioning:
            t = entry[0]
            if isinstance(t, torch.Tensor) and t.ndim == 3 and t.shape[0] > MAX_BATCH:
                raise BadInput(f"{side} conditioning's batch is {t.shape[0]}, more than {MAX_BATCH}")
            if isinstance(t, torch.Tensor) and t.ndim == 3 and t.shape[1] > MAX_TEXT_TOKENS:
                raise BadInput(f"{side} conditioning has {t.shape[1]} tokens, more than {MAX_TEXT_TOKENS} (the "
                               f"protocol's MAX_TEXT_TOKENS; LTX-2's text encoder gives at most 1024): encode a "
                               "shorter prompt")
    sigmas = tensors.get("sigmas")
    if sigmas is not None and sigmas.numel() > MAX_STEPS + 1:
        raise BadInput(f"sigmas holds {sigmas.numel()} values, at most {MAX_STEPS + 1} ({MAX_STEPS} steps): "
                       "sample with fewer steps")
    video, audio = _token_counts(latent)
    check_token_budget(video, m.max_tokens)
    check_token_budget(audio, m.max_tokens, "audio")


@register_engine("sample")
def sample_job(ctx: JobContext, params: dict, tensors: dict) -> tuple[dict, dict]:
    """Denoise a ComfyUI LTX-2 LATENT on every rank with the resident SP transformer.

    Params and tensors: :meth:`ltx_mgpu.client.denoise.SampleRequest.to_wire` (``model``,
    ``positive``, ``negative``, ``latent``, ``sigmas`` tensor or ``steps`` + ``scheduler``,
    ``cfg``, ``seed``, ``sampler``). Progress: phase ``"denoise"``, once per step.

    Every input is checked before any work: the params and the sizes they imply
    (:func:`_check_sizes`) identically on every rank; then the sampler checks the LATENT /
    CONDITIONING / SIGMAS and moves them to the device, and the ranks agree on that outcome
    (``JobContext.agree``, at the sampler's ``on_ready``) before the first step, so a failure
    there, even one only some ranks see (out of memory), is every rank's ``BadInput``.

    Returns:
        On rank 0: ``({"latent": {"samples", "parts"}, "steps": n}, {"latent" | "latent.i": ...})``
        (the denoised parts in the input dtype, on CPU); on the other ranks ``({}, {})``.
    Raises:
        BadInput: no such model, a malformed request, scheduler options of the wrong type or
            range, unsupported conditioning keys, a LATENT that is not LTX-2's (or has an empty
            dimension, or a ``batch_index`` that is not one index per sample), bad sigmas, sizes
            over the protocol's limits, more video or audio tokens than ``max_tokens``; any
            failure before the first step (agreed).
        JobCancelled: cancelled at a step boundary (on every rank together).
    """
    name = params.get("model", codec.DEFAULT_MODEL)
    resident = resident_transformer(ctx, name)
    sampler = params.get("sampler", "euler")
    if sampler not in SAMPLERS:
        raise BadInput(f"sampler '{sampler}' is not supported; use one of {', '.join(SAMPLERS)}")
    seed = int(params.get("seed", 0))
    if not 0 <= seed < 1 << 64:
        raise BadInput(f"seed must be in 0..2**64-1 (ComfyUI's range), got {seed}")
    m = resident.denoiser
    try:
        scheduler = check_scheduler_options(params.get("scheduler"))
        latent = codec.latent_from_request(params["latent"], tensors, NestedTensorLike)
        conditionings = {"positive": codec.conditioning_from_request(params["positive"], tensors, "positive")}
        if params.get("negative") is not None:
            conditionings["negative"] = codec.conditioning_from_request(params["negative"], tensors, "negative")
        _check_sizes(m, params, tensors, latent, conditionings)
    except ValueError as e:
        raise BadInput(str(e)) from None

    if resident.patches != NO_PATCHES:  # a MODEL-path run left ComfyUI's LoRA patches merged
        set_weight_patches(ctx, name, resident, {}, NO_PATCHES)
    done = 0
    ready = False

    def on_ready() -> None:  # every input checked and on the device, on this rank
        nonlocal ready
        ready = True
        ctx.agree(None)  # raises BadInput when another rank failed before this point

    def on_step(step: int, total: int) -> None:
        nonlocal done
        done = step
        ctx.progress("denoise", step, total)

    def should_stop() -> bool:
        ctx.check_cancel()  # raises JobCancelled on every rank together
        return False

    error = out = None
    try:
        out = sample(m, conditionings["positive"], conditionings.get("negative"), latent,
                     sigmas=tensors.get("sigmas"), steps=params.get("steps"), cfg=float(params.get("cfg", 1.0)),
                     seed=seed, sampler=sampler, scheduler=scheduler, velocity_model=resident.velocity,
                     should_stop=should_stop, on_step=on_step, on_ready=on_ready)
    except BadInput:
        raise
    except SequenceParallelConfigError as e:  # raised inside forward before its first collective, on every rank
        if ready:
            raise BadInput(str(e)) from None
        error = str(e)
    except Exception as e:
        if ready:  # after the agreement collectives may have run: not a clean request error (fatal)
            raise
        error = str(e) if isinstance(e, ValueError) else failure_message(e, "preparing the sample")
    if error is not None:
        # Before on_ready nothing collective ran: the ranks agree here (the others wait in
        # on_ready's agreement, or failed too) and every rank raises the same BadInput.
        ctx.agree(error)
    if not ctx.is_main:
        return {}, {}
    spec, out_tensors = codec.latent_to_result(out)
    return {"latent": spec, "steps": done, "model": name}, out_tensors
