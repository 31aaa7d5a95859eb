"""The wire protocol between ComfyUI (``ltx_mgpu.client``) and the sidecar pool (rank 0).

A *frame* is a fixed 20-byte prefix, a JSON header and an optional payload::

    prefix  = struct "!4sHHIQ": magic b"LTXM", protocol version (u16), flags (u16, 0 unless
              the ``shm`` feature is on), header length (u32, bytes), payload length (u64, bytes)
    header  = UTF-8 JSON object, at most ``Limits.max_header_bytes`` (default 1 MiB)
    payload = a safetensors blob (named CPU tensors), at most ``Limits.max_payload_bytes``
              (default 8 GiB, ``$LTX_MGPU_MAX_PAYLOAD_BYTES``); absent when its length is 0

Nothing received is ever unpickled: headers are JSON; payloads are received with ``recv_into``
into one buffer and parsed in place by :mod:`ltx_mgpu.payload` (strict safetensors header
checks; received tensors are writable views into that buffer, see there for their lifetime).
Requests carry ``{"type", "id", "params"}``; events carry
``{"event", "id", ...}`` (``id`` = the request they answer). Both are validated on receipt
against the schemas below (type, required fields, field types); :func:`register_request`
adds request types (``load_transformer`` and ``sample`` land there later).

Optional features are offered in the ``hello`` answer (``features``) and turned on per
connection by a ``features`` request, so older peers keep working: ``shm`` puts large result
payloads in a shared-memory arena instead of the socket (flags ``FLAG_SHM*``, :mod:`ltx_mgpu.shm`).

Job requests (``REQUESTS[t].job``) are queued and answered by ``accepted``, any number of
``progress`` / ``log`` and one terminal ``result`` or ``error``. Control requests (``hello``,
``features``, ``status``, ``cancel``, ``shutdown``) are answered at once by one ``result`` or ``error``.
``error.kind`` is ``bad_input`` (the request was wrong; the pool keeps serving),
``cancelled`` (the job was cancelled) or ``fatal`` (the pool failed and is exiting).
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import re
import socket
import struct
from dataclasses import dataclass, field
from typing import Any, Iterable, Mapping

import torch

from ltx_mgpu.payload import Payload, PayloadError, parse_payload, tensors_to_payload
from ltx_mgpu.shm import FLAG_SHM, FLAG_SHM_DROP, FLAG_SHM_FD, ShmError, recvmsg_into, send_with_fds

__all__ = [
    "MAGIC", "PROTOCOL_VERSION", "PREFIX_SIZE", "ERROR_KINDS", "ProtocolError", "ConnectionClosed", "SchemaError",
    "Limits", "PREAUTH_LIMITS", "Payload", "tensors_to_payload", "payload_to_tensors", "encode_header", "send_frame",
    "recv_frame", "FLAG_SHM", "FLAG_SHM_FD", "FLAG_SHM_DROP", "F", "MessageSchema", "REQUESTS", "EVENTS",
    "register_request", "Request", "valid_id",
    "parse_request", "make_request", "make_event", "parse_event", "job_types",
]

MAGIC = b"LTXM"
#: Bump on any incompatible change of framing or schemas; both sides reject other versions.
PROTOCOL_VERSION = 1
_PREFIX = struct.Struct("!4sHHIQ")
PREFIX_SIZE = _PREFIX.size  # 20 bytes
MAX_HEADER_BYTES = 1 << 20
DEFAULT_MAX_PAYLOAD_BYTES = 8 << 30
#: Before a connection has authenticated, frames are tiny and carry no tensors.
PREAUTH_LIMITS_HEADER = 64 << 10

ERROR_KINDS = ("bad_input", "cancelled", "fatal")
_ID_RE = re.compile(r"^[A-Za-z0-9_.:\-]{1,64}$")


class ProtocolError(Exception):
    """A frame or message that breaks the protocol; the connection that sent it is closed.

    ``request_id`` names the offending request when it could be read (else ``None``)."""

    def __init__(self, message: str, request_id: str | None = None):
        super().__init__(message)
        self.request_id = request_id


class ConnectionClosed(ProtocolError):
    """The peer closed the connection cleanly at a frame boundary."""


class SchemaError(ProtocolError):
    """A well-framed request whose ``params`` break its schema (answered ``bad_input``; the
    connection stays open)."""


@dataclass(frozen=True)
class Limits:
    """Frame size limits in bytes (header: JSON; payload: safetensors)."""

    max_header_bytes: int = MAX_HEADER_BYTES
    max_payload_bytes: int = field(
        default_factory=lambda: int(os.environ.get("LTX_MGPU_MAX_PAYLOAD_BYTES", DEFAULT_MAX_PAYLOAD_BYTES)))


PREAUTH_LIMITS = Limits(max_header_bytes=PREAUTH_LIMITS_HEADER, max_payload_bytes=0)

# --------------------------------------------------------------------------- tensors <-> payload
# The codec lives in ltx_mgpu.payload; these names are the protocol's public API.


def payload_to_tensors(payload: bytes | bytearray | memoryview | torch.Tensor | None) -> dict[str, torch.Tensor]:
    """Parse a safetensors blob into named CPU tensors (:func:`ltx_mgpu.payload.parse_payload`:
    strict header checks, views into a writable buffer, one copy of read-only ``bytes``).

    Raises:
        ProtocolError: the blob is not valid safetensors (the message names the rule broken).
    """
    if payload is None or len(payload) == 0:
        return {}
    try:
        return parse_payload(payload)
    except PayloadError as e:
        raise ProtocolError(f"payload is not a valid safetensors blob: {e}") from None


# --------------------------------------------------------------------------- framing

def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not valid JSON")


def encode_header(header: Mapping[str, Any], limits: Limits | None = None) -> bytes:
    """UTF-8 JSON of a frame header.

    Raises:
        ProtocolError: the header exceeds ``limits.max_header_bytes`` or is not JSON-serialisable
            (NaN and infinities are refused).
    """
    limits = limits or Limits()
    try:
        raw = json.dumps(header, separators=(",", ":"), allow_nan=False).encode()
    except (TypeError, ValueError) as e:
        raise ProtocolError(f"header is not JSON-serialisable: {e}") from None
    if len(raw) > limits.max_header_bytes:
        raise ProtocolError(f"header is {len(raw)} bytes, over the {limits.max_header_bytes}-byte limit")
    return raw


def send_frame(sock: socket.socket, header: Mapping[str, Any], payload: Payload | None = None,
               limits: Limits | None = None, shm=None, flags: int = 0) -> int:
    """Write one frame; returns the bytes written to the socket. The caller serialises writers
    on ``sock``. ``shm`` (an ``ltx_mgpu.shm.ArenaSender``, only on connections that enabled
    the feature) may take the payload into shared memory; ``flags=FLAG_SHM_DROP`` with an empty
    header sends its drop notice.

    Raises:
        ProtocolError: the header or payload exceeds the limits.
        OSError: the socket failed (peer gone: ``BrokenPipeError`` / ``ConnectionResetError``).
    """
    limits = limits or Limits()
    n = payload.nbytes if payload is not None else 0
    if n > limits.max_payload_bytes:
        raise ProtocolError(f"payload is {n} bytes, over the {limits.max_payload_bytes}-byte limit")
    placed = shm.place(payload) if shm is not None and payload is not None else None
    fds: list[int] = []
    if placed is not None:
        ref, fds = placed
        header, payload, n = {**header, "shm": ref}, None, 0
        flags |= FLAG_SHM | (FLAG_SHM_FD if fds else 0)
    raw = encode_header(header, limits)
    send_with_fds(sock, _PREFIX.pack(MAGIC, PROTOCOL_VERSION, flags, len(raw), n) + raw, fds)
    if payload is not None:
        for part in payload.parts:
            sock.sendall(part)
    return PREFIX_SIZE + len(raw) + n


def _recv_into(sock: socket.socket, view: memoryview, what: str, at_start: bool = False,
               fds: list[int] | None = None) -> None:
    """Fill ``view`` (a writable byte buffer of the exact size) from ``sock`` with ``recv_into``:
    the kernel writes straight into it, no user-space copy. With ``fds`` (a list), descriptors
    passed with the bytes (``SCM_RIGHTS``) are appended to it (``recvmsg_into``).

    Raises ConnectionClosed on EOF before any byte when ``at_start``, else ProtocolError."""
    n, got = view.nbytes, 0
    while got < n:
        k = sock.recv_into(view[got:], n - got) if fds is None else recvmsg_into(sock, view[got:], fds)
        if k == 0:
            if at_start and got == 0:
                raise ConnectionClosed("connection closed")
            raise ProtocolError(f"truncated frame: connection closed after {got} of {n} {what} bytes")
        got += k


def _recv_bytes(sock: socket.socket, n: int, what: str, at_start: bool = False,
                fds: list[int] | None = None) -> bytearray:
    """``n`` bytes from ``sock`` in a fresh ``bytearray`` (for the prefix and the JSON header)."""
    buf = bytearray(n)
    if n:
        _recv_into(sock, memoryview(buf), what, at_start, fds)
    return buf


def recv_frame(sock: socket.socket, limits: Limits | None = None, shm=None) -> tuple[dict, dict[str, torch.Tensor]]:
    """Read one frame: ``(header, tensors)``. ``shm`` (an ``ltx_mgpu.shm.ArenaReceiver``, on
    connections that enabled the feature) reads ``shm`` frames and applies drop notices.

    Raises:
        ConnectionClosed: clean EOF before a frame started.
        ProtocolError: bad magic or version, unknown flags (any flag without ``shm``), a header
            or payload over the limits, a truncated frame, a header that is not a JSON object,
            a payload that is not safetensors, or a broken ``shm`` frame (``ltx_mgpu.shm``).
        OSError / socket.timeout: the socket failed or timed out.
    """
    limits = limits or Limits()
    while True:
        fds: list[int] = []
        try:
            frame = _recv_one(sock, limits, shm, fds)
        except ShmError as e:  # from receiving descriptors
            raise ProtocolError(str(e)) from None
        finally:
            for fd in fds:  # descriptors nothing took over
                with contextlib.suppress(OSError):
                    os.close(fd)
        if frame is not None:
            return frame


def _recv_one(sock: socket.socket, limits: Limits, shm, fds: list[int]) -> tuple[dict, dict] | None:
    head = _recv_bytes(sock, PREFIX_SIZE, "prefix", at_start=True, fds=fds if shm is not None else None)
    magic, version, flags, header_len, payload_len = _PREFIX.unpack(head)
    if magic != MAGIC:
        raise ProtocolError(f"bad magic {magic!r}: not an ltx_mgpu frame (expected {MAGIC!r})")
    if version != PROTOCOL_VERSION:
        raise ProtocolError(f"protocol version {version} is not supported (this side speaks "
                            f"{PROTOCOL_VERSION}); update ltx_mgpu on both sides and restart the pool")
    if flags & ~(FLAG_SHM | FLAG_SHM_FD | FLAG_SHM_DROP):
        raise ProtocolError(f"unknown frame flags {flags:#x}")
    if flags and shm is None:
        raise ProtocolError(f"shared-memory frame flags {flags:#x} are not accepted here (the pool sends them, "
                            "only to clients that enabled 'shm')")
    if header_len > limits.max_header_bytes:
        raise ProtocolError(f"header of {header_len} bytes is over the {limits.max_header_bytes}-byte limit")
    if payload_len > limits.max_payload_bytes:
        raise ProtocolError(f"payload of {payload_len} bytes is over the {limits.max_payload_bytes}-byte "
                            "limit (raise $LTX_MGPU_MAX_PAYLOAD_BYTES on both sides)")
    raw = _recv_bytes(sock, header_len, "header")
    try:
        header = json.loads(raw.decode("utf-8"), parse_constant=_reject_constant)
    except (UnicodeDecodeError, ValueError, RecursionError) as e:
        raise ProtocolError(f"header is not UTF-8 JSON: {e!s:.200}") from None
    if not isinstance(header, dict):
        raise ProtocolError(f"header must be a JSON object, got {type(header).__name__}")
    if flags or fds:
        try:
            return shm.receive(flags, payload_len, fds, header, limits.max_payload_bytes)
        except ShmError as e:
            raise ProtocolError(str(e), valid_id(header.get("id"))) from None
    # The payload lands in one bytearray of the exact size (the kernel writes into it) and the
    # tensors are views into it: no user-space copy. (A bytearray rather than torch.empty: as
    # fast, and glibc hands its memory back like the bytes of before; torch's allocations of
    # the same sizes stayed resident, ~20 MB more RSS after ten 4 MiB frames.)
    payload = bytearray(payload_len)
    if payload_len:
        _recv_into(sock, memoryview(payload), "payload")
    try:
        tensors = payload_to_tensors(payload)
    except ProtocolError as e:
        raise ProtocolError(str(e), valid_id(header.get("id"))) from None
    return header, tensors


# --------------------------------------------------------------------------- schemas

_JSON_TYPES: dict[str, tuple[type, ...]] = {
    "str": (str,), "int": (int,), "number": (int, float), "bool": (bool,),
    "list": (list,), "object": (dict,), "null": (type(None),),
}


@dataclass(frozen=True)
class F:
    """One field of a message: ``types`` are JSON type names (``str int number bool list object
    null``); ``items`` the element type name for lists; ``choices`` allowed values."""

    name: str
    types: tuple[str, ...]
    required: bool = True
    items: str | None = None
    choices: tuple | None = None

    def check(self, value: Any, where: str) -> None:
        ok = any(isinstance(value, _JSON_TYPES[t]) and not (t in ("int", "number") and isinstance(value, bool))
                 for t in self.types)
        if not ok:
            raise SchemaError(f"{where}.{self.name} must be {' or '.join(self.types)}, "
                              f"got {type(value).__name__} {value!r:.80}")
        if isinstance(value, float) and not math.isfinite(value):
            raise SchemaError(f"{where}.{self.name} must be finite, got {value}")
        if self.items and isinstance(value, list):
            for i, v in enumerate(value):
                F(f"{self.name}[{i}]", (self.items,)).check(v, where)
        if self.choices is not None and value is not None and value not in self.choices:
            raise SchemaError(f"{where}.{self.name} must be one of {list(self.choices)}, got {value!r}")


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
    MessageSchema("hello", (F("token", ("str",)), F("client", ("str",), False), F("pid", ("int",), False)),
                  job=False, doc="authenticate; the answer describes the pool"),
    MessageSchema("features", (F("enable", ("list",), items="str"),), job=False,
                  doc="turn on optional features the hello answer offers (e.g. 'shm') for this connection"),
    MessageSchema("status", job=False, doc="per-rank devices, memory, models; the queue and current job"),
    MessageSchema("cancel", (F("job_id", ("str",)),), job=False, doc="cancel a queued or running job"),
    MessageSchema("shutdown", (F("reason", ("str",), False),), job=False, doc="stop the pool"),
    MessageSchema("load_text_encoder", (
        F("source", ("str",)), F("projection", ("str", "null"), False),
        F("weights", ("str",), False, choices=("bf16", "nf4")),
        F("placement", ("str",), False, choices=("single", "accelerate", "batch_parallel")),
        F("dtype", ("str",), False), F("max_memory", ("object", "null"), False), F("token_budget", ("int",), False),
        F("truncate", ("bool",), False), F("key", ("str", "null"), False)),
        doc="load Gemma 3 (+ the LTX-2 text projection) into the pool (ltx_mgpu.pool.text_jobs checks the values)"),
    MessageSchema("encode", (
        F("prompts", ("list",), items="str"), F("batch_size", ("int",), False), F("expect", ("str", "null"), False),
        F("keep", ("bool",), False), F("verify", ("bool",), False)),
        doc="encode prompts; every rank ends holding every embedding"),
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
# ltx_mgpu.remote_denoise's).
register_request(MessageSchema("load_transformer", (
    F("checkpoint", ("str",)), F("dtype", ("str",), False, choices=("bf16", "fp16", "fp32")),
    F("loras", ("list",), False, items="object"), F("max_tokens", ("int",), False),
    F("attention_type", ("str", "null"), False, choices=("default", "pytorch", "xformers", "flash_attention_3")),
    F("name", ("str",), False)),
    doc="load an LTX-2 transformer (+ connectors, LoRAs fused) on every rank for sequence parallelism"))
register_request(MessageSchema("sample", (
    F("model", ("str",), False), F("positive", ("list",), items="object"),
    F("negative", ("list", "null"), False, items="object"), F("latent", ("object",)),
    F("steps", ("int", "null"), False), F("cfg", ("number",), False), F("seed", ("int",), False),
    F("sampler", ("str",), False), F("scheduler", ("object", "null"), False)),
    tensors=True, doc="denoise a ComfyUI LTX-2 LATENT with the SP sampler; progress every step"))

for _s in (
    MessageSchema("accepted", (F("job", ("str",)), F("position", ("int",)))),
    MessageSchema("progress", (F("phase", ("str",)), F("step", ("int",)), F("total", ("int",)))),
    MessageSchema("log", (F("level", ("str",)), F("message", ("str",)), F("rank", ("int",)))),
    MessageSchema("result", (F("result", ("object",)),), tensors=True),
    MessageSchema("error", (F("kind", ("str",), choices=ERROR_KINDS), F("message", ("str",)),
                            F("progress", ("object", "null"), False), F("rank", ("int", "null"), False))),
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


def valid_id(value: Any) -> str | None:
    """``value`` when it is a well-formed request id (1-64 of ``[A-Za-z0-9_.:-]``), else None."""
    return value if isinstance(value, str) and _ID_RE.match(value) else None


def _check_id(value: Any, what: str) -> str:
    if not isinstance(value, str) or not _ID_RE.match(value):
        raise ProtocolError(f"{what} must be 1-64 characters of [A-Za-z0-9_.:-], got {value!r:.80}")
    return value


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
    rid = _check_id(header.get("id"), "request id")
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


def make_request(mtype: str, rid: str, params: Mapping[str, Any] | None = None) -> dict:
    """Build and validate a request header (client side).

    Raises:
        ProtocolError / SchemaError: as :func:`parse_request`.
    """
    header = {"type": mtype, "id": rid, "params": dict(params or {})}
    parse_request(header)
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
        _check_id(rid, "event id")
    fields = {k: v for k, v in header.items() if k not in ("event", "id")}
    try:
        EVENTS[event].validate(fields, event)
    except SchemaError as e:
        raise ProtocolError(str(e), rid) from None
    return dict(header)


def job_types() -> Iterable[str]:
    """Names of the queued (job) request types."""
    return [name for name, s in REQUESTS.items() if s.job]
