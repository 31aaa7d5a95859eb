"""The wire protocol between ComfyUI (``ltx_mgpu.client.pool_client``) and the sidecar pool (rank 0).

A *frame* is a fixed prefix, a JSON header and an optional safetensors payload (the byte layout
and its limits: :mod:`ltx_mgpu.wire.frames`). Nothing received is ever unpickled: headers are JSON,
payloads are parsed in place by :mod:`ltx_mgpu.wire.payload`.

Requests carry ``{"type", "id", "params"}``; events carry ``{"event", "id", ...}`` (``id`` = the
request they answer). Both are validated on receipt against the schemas of
:mod:`ltx_mgpu.wire.messages` (type, required fields, field types); :func:`register_request` adds
request types (the denoise jobs ``load_transformer`` and ``sample`` are added that way).

Optional features are offered in the ``hello`` answer (``features``) and turned on per
connection by a ``features`` request, so older peers keep working: ``shm`` puts large result
payloads in a shared-memory arena instead of the socket (flags ``FLAG_SHM*``, :mod:`ltx_mgpu.wire.arena`).

Job requests (``REQUESTS[t].job``) are queued and answered by ``accepted``, any number of
``progress`` / ``log`` and one terminal ``result`` or ``error``. Control requests (``hello``,
``features``, ``status``, ``cancel``, ``shutdown``) are answered at once by one ``result`` or ``error``.
``error.kind`` is ``bad_input`` (the request was wrong; the pool keeps serving),
``cancelled`` (the job was cancelled) or ``fatal`` (the pool failed and is exiting).

Modules: :mod:`ltx_mgpu.wire.frames` holds the frame layout, limits, errors and socket I/O;
:mod:`ltx_mgpu.wire.messages` the request / event schemas and their validation. This module is the
protocol's public namespace: it re-exports their public names (and the payload codec's
``Payload`` / ``tensors_to_payload``), so ``from ltx_mgpu import wire`` gives all of it.
"""

from __future__ import annotations

from ltx_mgpu.wire.arena import FLAG_SHM, FLAG_SHM_DROP, FLAG_SHM_FD
from ltx_mgpu.wire.frames import (
    DEFAULT_MAX_PAYLOAD_BYTES,
    MAGIC,
    MAX_HEADER_BYTES,
    PREAUTH_LIMITS,
    PREAUTH_LIMITS_HEADER,
    PREFIX_SIZE,
    PROTOCOL_VERSION,
    ConnectionClosed,
    Limits,
    ProtocolError,
    encode_header,
    payload_to_tensors,
    recv_frame,
    send_frame,
    valid_id,
)
from ltx_mgpu.wire.messages import (
    ERROR_KINDS,
    EVENTS,
    REQUESTS,
    F,
    MessageSchema,
    Request,
    SchemaError,
    job_types,
    make_event,
    make_request,
    parse_event,
    parse_request,
    register_request,
)
from ltx_mgpu.wire.payload import Payload, tensors_to_payload

__all__ = [
    "MAGIC", "PROTOCOL_VERSION", "PREFIX_SIZE", "ERROR_KINDS", "ProtocolError", "ConnectionClosed", "SchemaError",
    "Limits", "PREAUTH_LIMITS", "Payload", "tensors_to_payload", "payload_to_tensors", "encode_header", "send_frame",
    "recv_frame", "FLAG_SHM", "FLAG_SHM_FD", "FLAG_SHM_DROP", "F", "MessageSchema", "REQUESTS", "EVENTS",
    "register_request", "Request", "valid_id",
    "parse_request", "make_request", "make_event", "parse_event", "job_types",
    # the limits' defaults, in bytes
    "MAX_HEADER_BYTES", "DEFAULT_MAX_PAYLOAD_BYTES", "PREAUTH_LIMITS_HEADER",
]
