"""The pool's text-encoding jobs: ``load_text_encoder`` and ``encode`` (``ltx_mgpu.text.encoder.placement``).

Both run on every rank (SPMD, ``ltx_mgpu.pool.engines``). The placement logic and the
embedding broadcast live in ``ltx_mgpu.text.encoder.placement`` (which knows nothing of the pool); this
module validates requests, keeps the encoder resident and turns failures into ``bad_input``.

Errors: every parameter, path, format and the projection/Gemma pairing is checked from file
headers on every rank alike, before any collective (:func:`parse_load_request`). What only a
holder can find out (a damaged weight file, out of memory, a prompt over the token budget with
``truncate=False``) is *agreed* (``JobContext.agree``): each rank contributes a flag over the
control group, and if any rank failed every rank raises the same :class:`BadInput` (the first
failing rank's message), so the pool keeps serving.

Resident state (``ctx.models``): ``text_encoder`` on every rank (a :class:`ResidentTextEncoder`;
the holders' copy carries the model; ``status`` reports its ``key``, placement and bytes) and,
after an ``encode`` with ``keep`` (the default), ``text_embeddings``: the last encode's
embeddings on every rank's device, for a following job. A new load frees both first; ``unload``
frees them.

Text-encoder LoRAs (``text_patches``, ComfyUI's ``LoraLoader`` on the Gemma Loader's CLIP): the
resident encoder holds one patch set at a time, named by the client's content id
(``patches``; ``"none"`` for the loaded weights), merged into the holders' Gemma and text
projection (``ltx_mgpu.text.encoder.patches.EncoderPatches``). ``encode`` and ``generate`` name the set they
expect; any other is refused with reason ``stale_patches`` and the client sends its set and
retries, so an encode never runs on another CLIP's LoRA.
"""

from __future__ import annotations

import dataclasses
import json
import math
import time
from dataclasses import dataclass, field
from typing import Any

import torch
from accelerate.utils import convert_file_size_to_int

from ltx_mgpu.pool.engines import BadInput, JobContext, failure_message, free_memory, register_engine
from ltx_mgpu.text.config import COMPILE_NF4, MAX_KEY, TextEncoderConfig
from ltx_mgpu.text.encoder import placement as tp
from ltx_mgpu.text.encoder.device_map import describe_device_map
from ltx_mgpu.text.encoder.patches import EncoderPatches
from ltx_mgpu.text.encoder.prompt import PromptEncoder
from ltx_mgpu.text.gemma.tokenizer import check_prompts
from ltx_mgpu.wire.messages import NO_PATCHES

__all__ = ["TEXT_ENCODER", "EMBEDDINGS", "LoadRequest", "ResidentTextEncoder", "parse_load_request",
           "resident_text_encoder", "load_text_encoder", "encode", "text_patches"]

TEXT_ENCODER = "text_encoder"
EMBEDDINGS = "text_embeddings"


@dataclass(frozen=True)
class LoadRequest:
    """A validated ``load_text_encoder`` request (identical on every rank): the text encoder's
    config, what it loads (``weights_mode``: ``nf4`` for an NF4 artifact whatever
    ``config.weights`` says), ``max_memory`` in bytes per device index (accelerate only), the
    client's ``key`` for it (by default the JSON of the config) and the projection's LTX-2
    ``version`` and output ``width``."""

    config: TextEncoderConfig
    weights_mode: str
    max_memory: dict[int, int] | None
    key: str
    version: str
    width: int


def _max_memory(value: Any, devices: int) -> dict[int, int] | None:
    """A config's ``max_memory`` (device index -> bytes or ``"70GiB"``) in bytes, for every device."""
    if value is None:
        return None
    out: dict[int, int] = {}
    for k, v in value.items():
        try:
            n = v if isinstance(v, int) and not isinstance(v, bool) else convert_file_size_to_int(v)
        except (ValueError, TypeError, AttributeError):
            n = -1
        if not isinstance(n, int) or n <= 0:
            raise BadInput(f"max_memory[{str(k)!r}] must be a positive byte count or a size like '70GiB', got {v!r}")
        out[k] = n
    if sorted(out) != list(range(devices)):
        raise BadInput(f"max_memory must give every device of the pool a budget: indices 0..{devices - 1}, got "
                       f"{sorted(out)}")
    return out


def parse_load_request(params: dict, world_size: int, device_type: str) -> LoadRequest:
    """Check a ``load_text_encoder`` request from headers only (no weights are read).

    Raises:
        BadInput: whatever :meth:`TextEncoderConfig.from_params` refuses (unknown fields, a
            missing or relative path, weights / placement / dtype / budget / flags, compile with
            NF4 weights or placement ``accelerate``, a bad ``key``); a path that does not exist
            or is not a supported Gemma 3 source / LTX-2 projection; a projection that does not
            fit the Gemma; NF4 with a dtype other than bf16; a bad ``max_memory``.

    A compute dtype of ``auto`` is resolved here, for ``device_type`` and the weights loaded
    (``ltx_mgpu.text.config.resolve_text_dtype``); our client resolves it before sending (its
    cache key needs it), so this serves requests written by hand.
    """
    try:
        config, key = TextEncoderConfig.from_params(params)
        gemma = tp.read_gemma_shape(config.gemma)
        proj = tp.read_projection_shape(config.projection)
        tp.check_pairing(gemma, proj, config.gemma, config.projection)
    except (OSError, ValueError) as e:  # FileNotFoundError, GemmaFormatError, ProjectionFormatError, pairing
        raise BadInput(str(e)) from None
    except Exception as e:  # noqa: BLE001 - a header nothing above expected (a hostile file): identical on every rank
        raise BadInput(f"{type(e).__name__} reading the text encoder's files: {e}; give a Gemma 3 source and an "
                       "LTX-2 checkpoint") from None
    weights_mode = "nf4" if gemma.format == "nf4_artifact" else config.weights
    config = config.on_device(device_type, weights_mode)  # 'auto': this pool's device decides
    if weights_mode == "nf4" and config.dtype != "bfloat16":
        raise BadInput(f"NF4 weights compute in bfloat16 (fp16 gives empty outputs for Gemma 3); got dtype "
                       f"{config.dtype!r}")
    if weights_mode == "nf4" and config.compile:
        raise BadInput(COMPILE_NF4)
    devices = world_size if device_type == "cuda" else 1
    max_memory = _max_memory(config.max_memory, devices)
    if key is None:
        fields = {**dataclasses.asdict(config), "weights_mode": weights_mode, "max_memory": max_memory}
        key = json.dumps(fields, sort_keys=True, default=str)[:MAX_KEY]
    return LoadRequest(config, weights_mode, max_memory, key, proj.version, proj.out_features)


@dataclass(eq=False)
class ResidentTextEncoder:
    """The loaded text encoder as one rank knows it: the request, the model (holders only),
    the broadcast dtype and, for ``accelerate``, the device map; the merged patch set's id
    (``patches``, the same on every rank), the adapters held for it and, on holders, the
    patches merged into Gemma; the generator (``ltx_mgpu.pool.generate_jobs``), made by the
    first ``generate``."""

    request: LoadRequest
    encoder: PromptEncoder | None
    wire: torch.dtype
    device_map: dict | None = None
    patches: str = NO_PATCHES
    adapters: dict = field(default_factory=dict)
    merged: EncoderPatches | None = None
    generation: Any = None

    def weights_changed(self) -> None:
        """After the holders' weights changed (a patch set merged): the encoder's CUDA graphs and
        the generator are made again on next use (hooks and packed-layer patches are not in a
        graph captured before them; a dense copy of the embedding table is stale)."""
        if self.encoder is not None and self.encoder.graphs is not None:
            self.encoder.graphs.clear()
        if self.generation is not None:
            self.generation.reset()

    def publish(self, ctx: JobContext) -> None:
        """Hold this encoder in ``ctx``'s model registry under :data:`TEXT_ENCODER`, with its
        :meth:`info` and patch set id as its ``status`` entry (again after a change they show)."""
        ctx.models.put(TEXT_ENCODER, self, info={**self.info(), "patches": self.patches})

    def info(self) -> dict:
        """``status`` entry: key, placement, weights, whether this rank holds Gemma, and the
        bytes and devices of its weights (Gemma + projection, and the vision tower once an image
        loaded it: rank 0, float32)."""
        config = self.request.config
        info: dict[str, Any] = {"key": self.request.key, "placement": config.placement,
                                "weights": self.request.weights_mode, "dtype": config.dtype,
                                "compile": config.compile,
                                "version": self.request.version, "holds_model": self.encoder is not None,
                                "bytes": 0, "devices": []}
        if self.encoder is not None:
            tensors = [*self.encoder.tower.model.parameters(), *self.encoder.tower.model.buffers(),
                       *self.encoder.projection.parameters()]
            vision = getattr(self.generation, "vision", None)
            if vision is not None:
                tensors += [*vision.parameters(), *vision.buffers()]
            info["bytes"] = int(sum(t.numel() * t.element_size() for t in tensors))
            info["devices"] = sorted({str(t.device) for t in tensors})
        if self.device_map:
            info["layers"] = describe_device_map(self.device_map)
        return info


@register_engine("load_text_encoder")
def load_text_encoder(ctx: JobContext, params: dict, tensors: dict) -> tuple[dict, dict]:
    """Load Gemma 3 + the LTX-2 projection into the pool with a placement (every rank).

    Params: ``source``, ``projection`` (absolute paths), ``weights`` (``bf16``|``nf4``),
    ``placement`` (``single``|``accelerate``|``batch_parallel``), ``dtype`` (``bfloat16``;
    ``float32`` for reference runs), ``max_memory`` (accelerate: ``{"0": bytes or "70GiB", ...}``
    per pool GPU; the layer split follows it), ``token_budget`` (1024), ``truncate`` (true),
    ``key`` (the client's name for this configuration, e.g. a digest of the files' contents;
    default: the JSON of the other fields). A load equal to the resident one (key included) is
    a no-op; otherwise the previous text encoder and embeddings are freed first, so a load that
    fails leaves none loaded.

    Returns (rank 0): ``{"key", "placement", "weights", "version", "width", "holders",
    "reused", "seconds", "layers"}`` where ``layers`` maps device -> decoder layers (accelerate).

    Raises:
        BadInput: see :func:`parse_load_request`; a load that failed on any rank (agreed).
    """
    req = parse_load_request(params, ctx.world_size, ctx.device.type)
    config = req.config
    holders = tp.holder_ranks(config.placement, ctx.world_size)
    summary = {"key": req.key, "placement": config.placement, "weights": req.weights_mode, "version": req.version,
               "width": req.width, "holders": holders}
    current = ctx.models.get(TEXT_ENCODER)
    if current is not None and current.request == req:
        return {**summary, "reused": True, "seconds": 0.0, "layers": describe_device_map(current.device_map)}, {}
    ctx.models.pop(TEXT_ENCODER)
    ctx.models.pop(EMBEDDINGS)
    del current
    free_memory(ctx.device)
    ctx.progress("load_text_encoder", 0, 1)
    t0 = time.perf_counter()
    encoder, device_map, error = None, None, None
    if ctx.rank in holders:
        shard = None
        if config.placement == "accelerate":
            shard = ([torch.device("cuda", i) for i in range(ctx.world_size)] if ctx.device.type == "cuda"
                     else [ctx.device])
        try:
            encoder, device_map = tp.load_prompt_encoder(config, device=ctx.device, shard_over=shard,
                                                         max_memory=req.max_memory)
            wire_dtype = tp.wire_dtype(ctx.device.type, config.dtype)
            loaded = getattr(encoder.tower, "weights", "bf16")
            if encoder.projection.dtype != wire_dtype or loaded != req.weights_mode:
                raise RuntimeError(f"loaded a {loaded} tower with a {encoder.projection.dtype} "
                                   f"projection, expected {req.weights_mode} / {wire_dtype} (a bug in ltx_mgpu)")
        except Exception as e:  # noqa: BLE001 - a local load failure leaves this rank consistent
            encoder = device_map = None
            error = failure_message(e, f"loading the text encoder on {ctx.device}")
            free_memory(ctx.device)
    ctx.agree(error)
    state = ResidentTextEncoder(req, encoder, tp.wire_dtype(ctx.device.type, config.dtype), device_map)
    state.publish(ctx)
    seconds = time.perf_counter() - t0
    if encoder is not None:
        ctx.log(f"loaded Gemma ({encoder.tower.format}, {req.weights_mode}, {config.placement}) and the "
                f"LTX-{req.version} projection in {seconds:.1f} s on {state.info()['devices']}")
    ctx.progress("load_text_encoder", 1, 1)
    return {**summary, "reused": False, "seconds": seconds, "layers": describe_device_map(device_map)}, {}


def resident_text_encoder(ctx: JobContext, params: dict, *, check_patches: bool = True) -> ResidentTextEncoder:
    """The resident text encoder a request (``encode``, ``generate``, ``text_patches``) is for,
    checked the same way on every rank: one is loaded, it is the ``expect`` ed one and (with
    ``check_patches``) its merged patch set is the request's ``patches`` (default ``"none"``).

    Raises:
        BadInput: no encoder loaded; another one than ``expect``; another patch set (reason
            ``stale_patches``: the client sends its set and retries).
    """
    state = ctx.models.get(TEXT_ENCODER)
    if state is None:
        raise BadInput("no text encoder is loaded in the pool; send load_text_encoder first")
    expect = params.get("expect")
    if expect is not None and expect != state.request.key:
        raise BadInput(f"the pool's text encoder is {state.request.key!r:.120}, not the expected {expect!r:.120} "
                       "(another client loaded a different one); load yours again")
    want = params.get("patches", NO_PATCHES)
    if check_patches and want != state.patches:
        raise BadInput(f"the pool's text encoder holds the weight patches {state.patches!r:.80}, not "
                       f"{want!r:.80}; send them with text_patches", reason="stale_patches")
    return state


def _encode_params(ctx: JobContext, params: dict) -> tuple[ResidentTextEncoder, list[str], int, bool, bool]:
    """The resident encoder and the request's prompts and options. The schema typed and bounded
    every field at receipt (``ltx_mgpu.wire.messages``: strings, at most ``MAX_PROMPTS``, a
    ``batch_size`` in range, booleans); what it cannot say is whether each prompt is Unicode
    text the tokenizer takes, checked here, once, before any collective.

    Raises:
        BadInput: a prompt that is not Unicode text (first: a bad prompt never costs a Gemma load),
            and what :func:`resident_text_encoder` raises.
    """
    prompts = list(params["prompts"])
    try:
        check_prompts(prompts)  # the tokenizer cannot take a lone surrogate
    except ValueError as e:
        raise BadInput(str(e)) from None
    state = resident_text_encoder(ctx, params)
    batch_size, keep, verify = params.get("batch_size", 8), params.get("keep", True), params.get("verify", False)
    return state, prompts, batch_size, keep, verify


def _compile_error() -> type:
    """torch.compile's failures (Dynamo, Inductor): a compiled encoder meeting a new kind of batch
    compiles then, and a compiler that fails there is the request's error, not the pool's end.
    Evaluated only when an exception is being matched (importing Dynamo is not free)."""
    import torch._dynamo.exc

    return torch._dynamo.exc.TorchDynamoException


class _HandOverRows:
    """At world size 1, the encoder's ``out``: on the first row to be written, sets aside the
    shared memory the result will be handed over in (``JobContext.result_buffers``) for every
    prompt's float32 ``[T_i, width]`` row, so the encoder's upcast writes the client's tensors
    directly (no copy into the arena, no fresh pages); None (new tensors) when it cannot.
    Reserved after the forward, not before: the spare for a large result is made in the
    background after the previous one and may take longer than the gap between two requests.
    Only without ``keep``: the client may write to what it receives, which must not be the
    pool's resident copy."""

    def __init__(self, ctx: JobContext, counts: list[int], width: int):
        self.ctx, self.counts, self.width = ctx, counts, width
        self.asked = False
        self.rows: list[torch.Tensor] | None = None

    def __call__(self, i: int) -> torch.Tensor | None:
        if not self.asked:
            self.asked = True
            specs = [(f"prompt_{k}", torch.float32, (n, self.width)) for k, n in enumerate(self.counts)]
            bufs = self.ctx.result_buffers(specs)
            self.rows = None if bufs is None else [bufs[name] for name, _, _ in specs]
        return None if self.rows is None else self.rows[i]


@register_engine("encode")
def encode(ctx: JobContext, params: dict, tensors: dict) -> tuple[dict, dict]:
    """Encode prompts with the resident text encoder; afterwards every rank holds every prompt's
    embedding (``ltx_mgpu.text.encoder.placement.replicate_embeddings``).

    Params: ``prompts`` (list of str), ``batch_size`` (prompts per Gemma forward, default 8),
    ``expect`` (the key the client loaded: a mismatch is bad input, so a client never gets
    another configuration's embeddings), ``keep`` (default true: keep the embeddings resident as
    ``text_embeddings`` on every rank), ``verify`` (a diagnostic of the broadcast: gather every
    rank's SHA-256 of each embedding it holds to rank 0), ``max_tokens`` (optional: encode every
    prompt whole up to that many tokens, BOS included, ignoring the loaded ``token_budget`` and
    ``truncate``, as ComfyUI's LTX-2 text encoder does; ``PromptEncoder.encode(max_tokens=)``),
    ``patches`` (the weight patch set the client expects merged, default ``"none"``).

    ``single``/``accelerate``: rank 0 encodes in sub-batches; ``batch_parallel``: each rank
    its contiguous slice. Between sub-batches every rank passes ``check_cancel`` the same
    number of times (the most any rank needs) and rank 0 reports ``progress("encode", k, n)``.

    Returns (rank 0): ``{"count", "version", "dropped_tokens", "num_tokens", "owners",
    "placement", "key", "wire_dtype", "broadcast_bytes", "seconds": {"encode", "broadcast"},
    "rows_in_place"}`` (the rows were written into shared memory set aside to be handed over:
    then they go without a copy, unless that memory was taken back before the result was sent)
    (plus ``rank_digests`` [rank][prompt] hex and ``consistent`` with ``verify``) and tensors
    ``prompt_<i>``: ``[T_i, D]`` in ``wire_dtype`` (float32 at world size 1; with more ranks
    bf16 when the pool computes in bf16, of which the embeddings are float32 upcasts that
    ``embeddings_from_result`` restores exactly), prompt order.

    Raises:
        BadInput: no encoder loaded, an ``expect`` mismatch, another patch set merged
            (``stale_patches``), bad parameters (more than
            ``MAX_PROMPTS`` prompts or a ``batch_size`` over it: refused at receipt), a prompt
            that is not valid Unicode text (a lone surrogate, from a non-UTF-8 command-line
            argument); a prompt over the token budget with ``truncate=False`` (or over
            ``max_tokens``), out of memory or any other failure of a holder's encode, on any
            rank (agreed).
        JobCancelled: at a sub-batch boundary.
    """
    state, prompts, batch_size, keep, verify = _encode_params(ctx, params)
    max_tokens = params.get("max_tokens")
    req, count = state.request, len(prompts)
    ctx.models.pop(EMBEDDINGS)
    owners = tp.prompt_owners(count, ctx.world_size, req.config.placement)
    per_rank = [owners.count(r) for r in range(ctx.world_size)]
    rounds = max(1, max(math.ceil(n / batch_size) for n in per_rank))
    mine = [i for i in range(count) if owners[i] == ctx.rank]
    # At world size 1 nothing is broadcast: rank 0 encodes straight to float32, the client's
    # format (as the in-process encode does), so a result handed over in shared memory
    # (``ltx_mgpu.wire.arena``, ``shm_own``) is the client's tensor as it is, no upcast on either side.
    # With more ranks the rows are broadcast in the wire dtype and sent in it.
    out_dtype = torch.float32 if ctx.world_size == 1 else state.wire
    local, error = {}, None
    t0 = time.perf_counter()
    dest = None
    if ctx.world_size == 1 and not keep:
        try:
            dest = _HandOverRows(ctx, state.encoder.token_counts(prompts, max_tokens), req.width)
        except Exception as e:  # noqa: BLE001 - PromptTooLongError, the tokenizer: reported as the encode would
            error = failure_message(e, "encoding")
    for k in range(rounds):
        ctx.check_cancel()
        chunk = mine[k * batch_size:(k + 1) * batch_size]
        if chunk and error is None:
            try:
                out = state.encoder.encode([prompts[i] for i in chunk], batch_size=batch_size, out_dtype=out_dtype,
                                           out=None if dest is None else (lambda j, chunk=chunk: dest(chunk[j])),
                                           max_tokens=max_tokens)
            except Exception as e:  # noqa: BLE001 - a holder's encode runs no collective: agreed below
                # PromptTooLongError (a ValueError), out of memory, the tokenizer, or the compiler on
                # a new kind of batch
                error = failure_message(e, "encoding")
                if isinstance(e, _compile_error()):
                    error = error.splitlines()[0] + " (load the text encoder with compile off)"
                local.clear()
                free_memory(ctx.device)
            else:
                local.update(zip(chunk, out))
        ctx.progress("encode", k + 1, rounds)
    ctx.agree(error)
    t_encode = time.perf_counter() - t0
    ctx.check_cancel()
    t0 = time.perf_counter()
    held = tp.replicate_embeddings(local, owners, rank=ctx.rank, world_size=ctx.world_size, device=ctx.device,
                                   wire=state.wire, width=req.width, version=req.version, group=ctx.data_group)
    if ctx.device.type == "cuda":
        torch.cuda.synchronize(ctx.device)
    t_broadcast = time.perf_counter() - t0
    if not ctx.is_main:
        del local
    digests = tp.gather_digests(held, world_size=ctx.world_size, group=ctx.control_group) if verify else None
    if keep:
        ctx.models.put(EMBEDDINGS, held, info={"count": count, "bytes": held.nbytes, "version": req.version,
                                                "devices": [str(ctx.device)], "job": ctx.job_id})
    if not ctx.is_main:
        return {}, {}
    # Rank 0 sends every prompt in ``out_dtype``: float32 at world size 1; else the wire dtype
    # (tp.wire_dtype: bf16 when the pool computes in bf16), of which the embeddings are float32
    # upcasts, so the client's upcast (ltx_mgpu.client.text.embeddings_from_result) restores them bit for
    # bit from half the bytes. Its own prompts come from the encoder already in that dtype (no
    # device->host copy back); the others come down in it.
    rows = [local[i].tensor if i in local else t.detach().to(device="cpu", dtype=out_dtype, copy=True)
            for i, t in enumerate(held.tensors)]
    del local
    result = {"count": count, "version": req.version, "dropped_tokens": [int(d) for d in held.dropped],
              "num_tokens": [int(r.shape[0]) for r in rows], "owners": owners, "placement": req.config.placement,
              "key": req.key, "wire_dtype": str(out_dtype).removeprefix("torch."), "broadcast_bytes": held.nbytes,
              "seconds": {"encode": t_encode, "broadcast": t_broadcast},
              "rows_in_place": dest is not None and dest.rows is not None}
    if digests is not None:
        result["rank_digests"] = digests
        result["consistent"] = all(d == digests[0] for d in digests)
    return result, {f"prompt_{i}": r for i, r in enumerate(rows)}


@register_engine("text_patches")
def text_patches(ctx: JobContext, params: dict, tensors: dict) -> tuple[dict, dict]:
    """Merge ComfyUI's weight patches (``LoraLoader``'s CLIP strength) into the resident text
    encoder, on every rank that holds Gemma: its text tower and the LTX-2 text projection
    (``ltx_mgpu.text.encoder.patches.EncoderPatches``).

    Params: ``patches`` (the set's id), ``entries`` and ``adapters`` (ComfyUI's patch set:
    ``ltx_mgpu.pool.patch_requests``; keys ``gemma3_12b.transformer.model.<weight>`` and
    ``text_embedding_projection.<weight or bias>``), ``expect``.
    Empty ``entries`` restores the loaded weights.

    Returns (rank 0):
        ``{"patches": id, "keys": patched weights, "adapters": ids held}``.

    Raises:
        BadInput: no encoder loaded or another one (as :func:`resident_text_encoder`); an adapter
            neither sent nor held (``unknown_adapter``); malformed entries; a key the Gemma does
            not have or a factor that does not fit its weight (names the key; agreed). On any
            failure the loaded weights are restored (patch set ``"none"``); when even that
            fails the text encoder is unloaded.
    """
    # loads ltx-core (WeightPatch): only a text encoder with LoRAs needs it
    from ltx_mgpu.pool.patch_requests import parse_adapters, parse_entries, used_adapters

    state = resident_text_encoder(ctx, params, check_patches=False)
    held = {**state.adapters, **parse_adapters(params.get("adapters"), tensors)}
    patches = parse_entries(params["entries"], held)
    error = broken = None
    keys: set[str] = set()
    if state.encoder is not None:
        if state.merged is None:
            state.merged = EncoderPatches(state.encoder.tower, state.encoder.projection)
            vision = getattr(state.generation, "vision", None)
            if vision is not None:  # rank 0 loaded the vision tower for an image before any patch set
                state.merged.vision.attach(vision)
        try:
            keys = state.merged.set(patches)
        except Exception as e:  # noqa: BLE001 - a key that does not fit, out of memory: agreed below
            error = str(e) if isinstance(e, ValueError) else failure_message(e, "merging the text encoder's LoRA")
            try:
                state.merged.set({})
            except Exception as e2:  # noqa: BLE001 - the weights are neither loaded nor patched
                broken = failure_message(e2, "restoring the text encoder's loaded weights")
        state.weights_changed()
    try:
        ctx.agree(broken)
    except BadInput as e:
        ctx.models.pop(TEXT_ENCODER)
        ctx.models.pop(EMBEDDINGS)
        free_memory(ctx.device)
        raise BadInput(f"{e}; the text encoder was unloaded (load it again)") from None
    try:
        ctx.agree(error)
    except BadInput:
        state.patches, state.adapters = NO_PATCHES, {}
        raise
    used = used_adapters(params["entries"])
    state.patches = params["patches"] if patches else NO_PATCHES
    state.adapters = {k: v for k, v in held.items() if k in used}
    state.publish(ctx)
    return {"patches": state.patches, "keys": len(keys), "adapters": sorted(state.adapters)}, {}
