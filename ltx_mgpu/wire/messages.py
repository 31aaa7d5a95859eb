"""Messages of the wire protocol (``ltx_mgpu.wire``): the request and event schemas, their
registry and validation.

Requests carry ``{"type", "id", "params"}``; events carry ``{"event", "id", ...}`` (``id`` =
the request they answer). Both are validated on receipt against the schemas below (type,
required fields, field types, ranges and list lengths); :func:`register_request` adds request
types. The request limits (``MAX_STEPS``, ``MAX_PROMPTS`` ...) bound the work a request may ask
for; the schemas check its top-level fields, the pool's parsers the nested ones.

Related modules: :mod:`ltx_mgpu.wire.frames` (the byte layout and socket I/O that carry these
headers, ``ProtocolError`` and request ids), :mod:`ltx_mgpu.wire` (the protocol's overview
and public namespace, re-exporting both).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Iterable, Mapping

import torch

from ltx_mgpu.choices import (
    AV_TIMESTEP_CONVENTIONS,
)
from ltx_mgpu.wire.frames import ProtocolError, check_id, encode_header, valid_id

__all__ = [
    "BAD_INPUT_REASONS",
    "ERROR_KINDS", "SchemaError", "F", "MessageSchema", "REQUESTS", "EVENTS", "register_request", "Request",
    "parse_request", "make_request", "make_event", "parse_event", "job_types",
    "MAX_STEPS", "MAX_PROMPTS", "MAX_TEXT_TOKENS", "MAX_VIDEO_TOKENS", "MAX_LATENT_PARTS", "MAX_BATCH", "MAX_LORAS",
    "FORWARD_KWARGS",
    "FORWARD_TENSORS",
    "MAX_GUIDES",
    "MAX_SKIP_BLOCKS",
    "GUIDE_FIELDS",
    "NO_PATCHES",
    "MAX_ADAPTERS",
    "MAX_PATCH_KEYS",
    "MAX_NEW_TOKENS",
    "MAX_STOP_TOKENS",
]

ERROR_KINDS = ("bad_input", "cancelled", "fatal")
#: Machine-readable causes of a ``bad_input`` (the error event's ``reason``) that a client can
#: remedy and retry: the model is not resident (load it again), a text context or weight adapter
#: the pool does not hold (send it), weight patches other than the ones merged (send them).
BAD_INPUT_REASONS = ("no_model", "unknown_context", "unknown_adapter", "stale_patches")

# --------------------------------------------------------------------------- request limits
# The sizes one request may imply, stated once for both sides. A request's bytes are bounded by
# the frame limits (``ltx_mgpu.wire.frames``); these bound the work a few bytes can ask for
# (a count, an index, a length), so that the pool refuses it up front, before allocating anything
# (the schemas below check the top-level fields at receipt; the pool's parsers, ``ltx_mgpu.wire.codec``
# and ``ltx_mgpu.pool``, check the nested ones). Every refusal is ``bad_input`` naming the field.

#: Denoising steps of one ``sample``: ``steps`` is 1..MAX_STEPS, a ``sigmas`` tensor holds at most
#: MAX_STEPS + 1 values.
MAX_STEPS = 10_000
#: Prompts in one ``encode`` request, and its ``batch_size`` (prompts per Gemma forward).
MAX_PROMPTS = 4096
#: Tokens of one prompt: ``load_text_encoder.token_budget`` and the tokens of a ``sample``
#: conditioning tensor (LTX-2 uses 1024).
MAX_TEXT_TOKENS = 8192
#: ``load_transformer.max_tokens``: the largest video-token budget a model may be loaded with.
MAX_VIDEO_TOKENS = 1 << 20
#: Parts of a nested (audio-video) LATENT or noise mask: LTX-2 nests (video, audio).
MAX_LATENT_PARTS = 2
#: The batch of a LATENT or CONDITIONING, and one more than the largest ``batch_index`` value
#: (ComfyUI's largest batch).
MAX_BATCH = 4096
#: LoRAs one ``load_transformer`` fuses.
MAX_LORAS = 64
#: Weight keys one ``model_patches`` request may patch (an LTX-2 transformer has about 2,000),
#: and the adapters (LoRA factor pairs, diffs) it may reference.
MAX_PATCH_KEYS = 16384
MAX_ADAPTERS = 65536
#: Tokens one ``generate`` may produce (its ``max_length``; ComfyUI's ``TextGenerate`` offers up
#: to 2048), and the stop tokens it may name.
MAX_NEW_TOKENS = 16384
MAX_STOP_TOKENS = 64
#: The keyword arguments of ComfyUI's LTXAV model call a ``forward`` implements
#: (``LTXAV.extra_conds``): the denoise masks (ComfyUI has folded them into the per-token
#: timesteps, ``LTXAV.process_timestep``; with keyframe guides the video one also drops tokens),
#: keyframe guides, guide attention, reference audio and ``latent_shapes`` (the packed latent's
#: shapes, which ComfyUI's model does not read either). Any other is refused by name, never
#: ignored.
FORWARD_KWARGS = ("denoise_mask", "audio_denoise_mask", "keyframe_idxs", "guide_attention_entries", "ref_audio",
                  "latent_shapes")
#: The tensors of a ``forward`` request: the latent parts ``x.<i>`` and timesteps ``t.<i>``, the
#: processed text ``context`` (when new), the text ``attention_mask``, and the guide inputs:
#: ``denoise_mask`` (sample 0's minimum over channels ``[1, 1, F, H, W]``: what ComfyUI's grid
#: mask reads), ``keyframe_idxs``, ``ref_audio`` and ``guide.<i>.pixel_mask``.
FORWARD_TENSORS = ("x.0", "x.1", "t.0", "t.1", "context", "attention_mask", "denoise_mask", "keyframe_idxs",
                   "ref_audio")
#: Guide attention entries one ``forward`` may carry.
MAX_GUIDES = 256
#: Transformer blocks one ``forward`` may skip (``skip_blocks``; LTX-2 has 48).
MAX_SKIP_BLOCKS = 1024
#: The fields of a guide attention entry (``LTXVAddGuide``'s ``guide_attention_entries`` items,
#: ``comfy_extras/nodes_lt.py``) the pool implements: its tokens before the grid mask, strength,
#: latent shape and pixel mask. An entry with another field is refused by name, never ignored.
GUIDE_FIELDS = ("pre_filter_count", "strength", "latent_shape", "pixel_mask")
#: The ``patches`` id of a transformer with its loaded weights (no ComfyUI weight patches merged).
NO_PATCHES = "none"


class SchemaError(ProtocolError):
    """A well-framed request whose ``params`` break its schema (answered ``bad_input``; the
    connection stays open)."""


# --------------------------------------------------------------------------- schemas

_JSON_TYPES: dict[str, tuple[type, ...]] = {
    "str": (str,), "int": (int,), "number": (int, float), "bool": (bool,),
    "list": (list,), "object": (dict,), "null": (type(None),),
}


@dataclass(frozen=True)
class F:
    """One field of a message: ``types`` are JSON type names (``str int number bool list object
    null``); ``items`` the element type name for lists; ``choices`` allowed values (of each item,
    for a list with ``items``); ``bounds`` the
    inclusive ``(low, high)`` range of a number; ``max_items`` the longest list; ``hint`` the fix,
    added to a range or length refusal."""

    name: str
    types: tuple[str, ...]
    required: bool = True
    items: str | None = None
    choices: tuple | None = None
    bounds: tuple[float, float] | None = None
    max_items: int | None = None
    hint: str = ""

    def check(self, value: Any, where: str) -> None:
        """Raise :class:`SchemaError` naming ``<where>.<name>`` unless ``value`` fits this field."""
        ok = any(isinstance(value, _JSON_TYPES[t]) and not (t in ("int", "number") and isinstance(value, bool))
                 for t in self.types)
        if not ok:
            raise SchemaError(f"{where}.{self.name} must be {' or '.join(self.types)}, "
                              f"got {type(value).__name__} {value!r:.80}")
        if isinstance(value, float) and not math.isfinite(value):
            raise SchemaError(f"{where}.{self.name} must be finite, got {value}")
        hint = f"; {self.hint}" if self.hint else ""
        if self.max_items is not None and isinstance(value, list) and len(value) > self.max_items:
            raise SchemaError(f"{where}.{self.name} holds {len(value)} items, at most {self.max_items}{hint}")
        if self.items and isinstance(value, list):  # choices, with items, are the items' choices
            for i, v in enumerate(value):
                F(f"{self.name}[{i}]", (self.items,), choices=self.choices, hint=self.hint).check(v, where)
        elif self.choices is not None and value is not None and value not in self.choices:
            raise SchemaError(f"{where}.{self.name} must be one of {list(self.choices)}, got {value!r}")
        if (self.bounds is not None and isinstance(value, (int, float)) and not isinstance(value, bool)
                and not self.bounds[0] <= value <= self.bounds[1]):
            raise SchemaError(f"{where}.{self.name} must be in {self.bounds[0]}..{self.bounds[1]}, "
                              f"got {value!r:.80}{hint}")


@dataclass(frozen=True)
class MessageSchema:
    """A request or event type: its fields; ``extra`` allows undeclared fields (the engine checks
    them); ``job`` = queued and run on every rank; ``tensors`` = may carry a payload."""

    name: str
    fields: tuple[F, ...] = ()
    extra: bool = False
    job: bool = True
    tensors: bool = False
    doc: str = ""

    def validate(self, params: Mapping[str, Any], where: str) -> None:
        known = {f.name for f in self.fields}
        for f in self.fields:
            if f.name in params:
                f.check(params[f.name], where)
            elif f.required:
                raise SchemaError(f"{where} is missing the required field {f.name!r}")
        if not self.extra:
            unknown = sorted(set(params) - known)
            if unknown:
                raise SchemaError(f"{where} has unknown field(s) {unknown}; known: {sorted(known)}")


REQUESTS: dict[str, MessageSchema] = {}
EVENTS: dict[str, MessageSchema] = {}


def register_request(schema: MessageSchema) -> MessageSchema:
    """Add (or replace) a request type; returns it. Engines register their job types here."""
    REQUESTS[schema.name] = schema
    return schema


for _s in (
    MessageSchema("hello", (F("token", ("str",)), F("client", ("str",), False), F("pid", ("int",), False),
                            F("hold", ("bool",), False)),
                  job=False, doc="authenticate; the answer describes the pool. hold: this client would start a pool "
                                 "of its own without this one, so a with-owner pool stays while it is connected"),
    MessageSchema("features", (F("enable", ("list",), items="str"),), job=False,
                  doc="turn on optional features the hello answer offers (e.g. 'shm') for this connection"),
    MessageSchema("status", job=False, doc="per-rank devices, memory, models; the queue and current job"),
    MessageSchema("cancel", (F("job_id", ("str",)),), job=False, doc="cancel a queued or running job"),
    MessageSchema("shutdown", (F("reason", ("str",), False),), job=False, doc="stop the pool"),
    MessageSchema("release", job=False,
                  doc="this client no longer holds the pool (its run is done); a with-owner pool stops once its owner "
                      "has released it or exited and no other client holds it or has a job in it"),
    MessageSchema("load_text_encoder", (
        F("source", ("str",)), F("projection", ("str", "null"), False),
        F("weights", ("str",), False), F("placement", ("str",), False),
        F("dtype", ("str",), False), F("max_memory", ("object", "null"), False),
        F("token_budget", ("int",), False, bounds=(1, MAX_TEXT_TOKENS), hint="LTX-2 uses 1024 tokens per prompt"),
        F("truncate", ("bool",), False), F("compile", ("bool",), False), F("key", ("str", "null"), False)),
        doc="load Gemma 3 (+ the LTX-2 text projection) into the pool; the values are a TextEncoderConfig's "
            "(ltx_mgpu.text.config checks them)"),
    MessageSchema("encode", (
        F("prompts", ("list",), items="str", max_items=MAX_PROMPTS, hint="send the prompts in several requests"),
        F("batch_size", ("int",), False, bounds=(1, MAX_PROMPTS), hint="prompts per Gemma forward (default 8)"),
        F("expect", ("str", "null"), False),
        F("keep", ("bool",), False), F("verify", ("bool",), False),
        F("max_tokens", ("int",), False, bounds=(1, MAX_TEXT_TOKENS),
          hint="tokens a prompt encoded whole may have (BOS included)"),
        F("patches", ("str",), False)),
        doc="encode prompts; every rank ends holding every embedding"),
    MessageSchema("generate", (
        F("text", ("str",)), F("expect", ("str", "null"), False), F("patches", ("str",), False),
        F("do_sample", ("bool",), False),
        F("max_length", ("int",), False, bounds=(1, MAX_NEW_TOKENS), hint="generate fewer tokens per request"),
        F("temperature", ("number",), False, bounds=(0, 1e4)),
        F("top_k", ("int",), False, bounds=(0, 1 << 31)),
        F("top_p", ("number",), False, bounds=(0, 1)), F("min_p", ("number",), False, bounds=(0, 1)),
        F("repetition_penalty", ("number",), False, bounds=(0, 1e4)),
        F("presence_penalty", ("number",), False, bounds=(-1e4, 1e4)),
        F("seed", ("int", "null"), False, bounds=(0, (1 << 64) - 1), hint="ComfyUI's seeds are 0..2**64-1"),
        F("stop_tokens", ("list",), False, items="int", max_items=MAX_STOP_TOKENS),
        F("pad_to", ("int",), False, bounds=(0, MAX_TEXT_TOKENS),
          hint="ComfyUI pads a Gemma prompt on the left to 1024 tokens")),
        tensors=True,
        doc="generate text with the resident Gemma 3 as a causal LM on a prompt (ComfyUI's CLIP.generate); "
            "the values are a GenerateOptions' (ltx_mgpu.text.generate.options checks them); tensor 'image' "
            "(optional): [B, h, w, 3] float32, ComfyUI's IMAGE after its Gemma tokenizer's resize"),
    MessageSchema("text_patches", (
        F("expect", ("str", "null"), False), F("patches", ("str",)),
        F("entries", ("list",), items="object", max_items=MAX_PATCH_KEYS, hint="apply fewer LoRAs"),
        F("adapters", ("list",), False, items="object", max_items=MAX_ADAPTERS, hint="apply fewer LoRAs")),
        tensors=True, doc="merge ComfyUI's weight patches (LoraLoader's CLIP strength) into the resident text "
                          "encoder, by content id; an empty entries list restores its loaded weights"),
    MessageSchema("unload", (F("names", ("list", "null"), False, items="str"),),
                  doc="free resident models (all when names is null)"),
    MessageSchema("selftest", (
        F("steps", ("int",)), F("step_seconds", ("number",), False), F("numel", ("int",), False),
        F("result_bytes", ("int",), False), F("echo", ("bool",), False),
        F("fail_rank", ("int", "null"), False), F("fail_step", ("int",), False)),
        tensors=True, doc="communication self-test: all-reduce per step, progress, cancel"),
):
    register_request(_s)

# LTX-2 denoising (ltx_mgpu.pool.denoise_jobs; the tensor layout of ``sample`` is
# ltx_mgpu.wire.codec's).
register_request(MessageSchema("load_transformer", (
    F("checkpoint", ("str",)), F("dtype", ("str",), False), F("weights", ("str",), False), F("layout", ("str",), False),
    F("loras", ("list",), False, items="object", max_items=MAX_LORAS, hint="merge LoRAs, or fuse fewer"),
    F("max_tokens", ("int",), False, bounds=(1, MAX_VIDEO_TOKENS),
      hint="the video tokens one sample may have (default 32768)"),
    F("attention_type", ("str", "null"), False), F("connectors", ("str",), False), F("compile", ("str",), False),
    F("name", ("str",), False)),
    doc="load an LTX-2 transformer (+ connectors, LoRAs fused) on every rank for sequence parallelism, "
        "replicated or sharded; the values are a TransformerPlan's (ltx_mgpu.denoise.plan checks them)"))
register_request(MessageSchema("sample", (
    F("model", ("str",), False), F("positive", ("list",), items="object"),
    F("negative", ("list", "null"), False, items="object"), F("latent", ("object",)),
    F("steps", ("int", "null"), False, bounds=(1, MAX_STEPS), hint="sample with fewer steps"),
    F("cfg", ("number",), False, bounds=(0, 100), hint="ComfyUI's CFG range"), F("seed", ("int",), False),
    F("sampler", ("str",), False), F("scheduler", ("object", "null"), False)),
    tensors=True, doc="denoise a ComfyUI LTX-2 LATENT with the SP sampler; progress every step"))

# The MODEL path (ltx_mgpu.pool.model_jobs): ComfyUI's sampler runs its loop and calls the model.
register_request(MessageSchema("text_contexts", (
    F("model", ("str",), False), F("key", ("str",), False), F("unprocessed", ("bool",), False),
    F("patches", ("str",), False)),
    tensors=True, doc="the text connectors (ComfyUI's preprocess_text_embeds) on tensor 'context' [B, L, D]"))
register_request(MessageSchema("forward", (
    F("model", ("str",), False), F("key", ("str",), False), F("context_id", ("str",)),
    F("frame_rate", ("number",), False, bounds=(1e-3, 1e4), hint="frames per second of the video"),
    F("av_timestep", ("str",), False, choices=AV_TIMESTEP_CONVENTIONS),
    F("patches", ("str",), False),
    F("kwargs", ("list",), False, items="str", max_items=16, choices=FORWARD_KWARGS,
      hint="a node upstream of the sampler added an argument this pool does not implement: remove it, or update "
           "ltx_mgpu if a newer ComfyUI adds it"),
    F("guides", ("list",), False, items="object", max_items=MAX_GUIDES, hint="use fewer LTXVAddGuide nodes"),
    F("skip_blocks", ("list",), False, items="int", max_items=MAX_SKIP_BLOCKS,
      hint="the transformer blocks this call skips (skip-layer guidance)"),
    F("timestep_range", ("list",), False, items="number", max_items=2,
      hint="[low, high]: the timesteps of the model sampling in use (default [0, 1], LTX-2's sigmas)")),
    tensors=True, doc="one call of the transformer on ComfyUI's tensors (FORWARD_TENSORS): 'x.0' video, 'x.1' "
                      "audio latent, 't.0' / 't.1' their timesteps, 'context' (when new), the guide inputs, the "
                      "blocks to skip"))
register_request(MessageSchema("model_patches", (
    F("model", ("str",), False), F("key", ("str",), False), F("patches", ("str",)),
    F("entries", ("list",), items="object", max_items=MAX_PATCH_KEYS, hint="apply fewer LoRAs"),
    F("adapters", ("list",), False, items="object", max_items=MAX_ADAPTERS, hint="apply fewer LoRAs")),
    tensors=True, doc="merge ComfyUI's weight patches (LoRA loaders) into a resident transformer, by content id"))

for _s in (
    MessageSchema("accepted", (F("job", ("str",)), F("position", ("int",)))),
    MessageSchema("progress", (F("phase", ("str",)), F("step", ("int",)), F("total", ("int",)))),
    MessageSchema("log", (F("level", ("str",)), F("message", ("str",)), F("rank", ("int",)))),
    MessageSchema("result", (F("result", ("object",)),), tensors=True),
    MessageSchema("error", (F("kind", ("str",), choices=ERROR_KINDS), F("message", ("str",)),
                            F("progress", ("object", "null"), False), F("rank", ("int", "null"), False),
                            F("reason", ("str", "null"), False, choices=BAD_INPUT_REASONS))),
):
    EVENTS[_s.name] = _s


@dataclass(frozen=True)
class Request:
    """A validated request: ``type``, client-chosen ``id``, ``params`` and input ``tensors``."""

    type: str
    id: str
    params: dict
    tensors: dict

    @property
    def schema(self) -> MessageSchema:
        return REQUESTS[self.type]


def parse_request(header: Mapping[str, Any], tensors: Mapping[str, torch.Tensor] | None = None) -> Request:
    """Validate a request header (and its tensors) against :data:`REQUESTS`.

    Raises:
        ProtocolError: a broken envelope (unknown ``type``, bad ``id``, unknown top-level keys,
            tensors on a request type that takes none): the connection is closed.
        SchemaError: ``params`` break the type's schema (answer ``bad_input``, keep serving).
    """
    unknown = sorted(set(header) - {"type", "id", "params"})
    rid = valid_id(header.get("id"))
    if unknown:
        raise ProtocolError(f"request has unknown top-level keys {unknown}", rid)
    mtype = header.get("type")
    if not isinstance(mtype, str) or mtype not in REQUESTS:
        raise ProtocolError(f"unknown request type {mtype!r:.80}; known: {sorted(REQUESTS)}", rid)
    rid = check_id(header.get("id"), "request id")
    params = header.get("params", {})
    if not isinstance(params, dict):
        raise ProtocolError(f"{mtype}.params must be a JSON object", rid)
    schema = REQUESTS[mtype]
    tensors = dict(tensors or {})
    if tensors and not schema.tensors:
        raise ProtocolError(f"request type {mtype!r} takes no tensors", rid)
    try:
        schema.validate(params, mtype)
    except SchemaError as e:
        raise SchemaError(str(e), rid) from None
    return Request(mtype, rid, params, tensors)


def make_request(mtype: str, rid: str, params: Mapping[str, Any] | None = None,
                 tensors: Mapping[str, torch.Tensor] | None = None) -> dict:
    """Build a request header and check it once, on the client's side, as the pool will: the
    schema of ``params`` and ``tensors`` (:func:`parse_request`) and the header's encoded size, so
    a request the pool would refuse is refused before it is sent (a header over the frame limit
    would otherwise close the connection).

    Raises:
        ProtocolError / SchemaError: as :func:`parse_request`; ProtocolError: a header over
            :data:`~ltx_mgpu.wire.frames.MAX_HEADER_BYTES` encoded, or not JSON (names the size).
    """
    header = {"type": mtype, "id": rid, "params": dict(params or {})}
    parse_request(header, tensors)
    encode_header(header)
    return header


def make_event(event: str, rid: str | None, **fields: Any) -> dict:
    """Build and validate an event header, e.g. ``make_event("progress", rid, phase="denoise",
    step=3, total=30)``.

    Raises:
        ProtocolError: unknown event or fields breaking its schema.
    """
    header = {"event": event, "id": rid, **fields}
    parse_event(header)
    return header


def parse_event(header: Mapping[str, Any]) -> dict:
    """Validate an event header against :data:`EVENTS`; returns it as a dict.

    Raises:
        ProtocolError: unknown event, bad ``id`` or fields breaking the schema.
    """
    event = header.get("event")
    if not isinstance(event, str) or event not in EVENTS:
        raise ProtocolError(f"unknown event {event!r:.80}; known: {sorted(EVENTS)}")
    rid = header.get("id")
    if rid is not None:
        check_id(rid, "event id")
    fields = {k: v for k, v in header.items() if k not in ("event", "id")}
    try:
        EVENTS[event].validate(fields, event)
    except SchemaError as e:
        raise ProtocolError(str(e), rid) from None
    return dict(header)


def job_types() -> Iterable[str]:
    """Names of the queued (job) request types."""
    return [name for name, s in REQUESTS.items() if s.job]
