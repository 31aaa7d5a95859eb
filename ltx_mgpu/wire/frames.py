"""Frames of the wire protocol (``ltx_mgpu.wire``): the byte layout, its limits and errors,
and sending / receiving one frame over a socket.

A *frame* is a fixed 20-byte prefix, a JSON header and an optional payload::

    prefix  = struct "!4sHHIQ": magic b"LTXM", protocol version (u16), flags (u16, 0 unless
              the ``shm`` feature is on), header length (u32, bytes), payload length (u64, bytes)
    header  = UTF-8 JSON object, at most ``Limits.max_header_bytes`` (default 1 MiB)
    payload = a safetensors blob (named CPU tensors), at most ``Limits.max_payload_bytes``
              (default 8 GiB, ``$LTX_MGPU_MAX_PAYLOAD_BYTES``); absent when its length is 0

Nothing received is ever unpickled: headers are JSON; payloads are received with ``recv_into``
into one buffer and parsed in place by :mod:`ltx_mgpu.wire.payload`. Frames flagged ``FLAG_SHM*``
carry their payload in a shared-memory arena instead (:mod:`ltx_mgpu.wire.arena`).

Related modules: :mod:`ltx_mgpu.wire.messages` (the request / event schemas carried in headers),
:mod:`ltx_mgpu.wire` (the protocol's overview and public namespace, re-exporting both).
"""

from __future__ import annotations

import contextlib
import json
import mmap
import os
import re
import socket
import struct
from dataclasses import dataclass, field
from typing import Any, Mapping

import torch

from ltx_mgpu import settings
from ltx_mgpu.wire.arena import FLAG_SHM, FLAG_SHM_DROP, FLAG_SHM_FD, ShmError, recvmsg_into, send_with_fds
from ltx_mgpu.wire.payload import Payload, PayloadError, parse_payload

__all__ = [
    "MAGIC", "PROTOCOL_VERSION", "PREFIX_SIZE", "MAX_HEADER_BYTES", "DEFAULT_MAX_PAYLOAD_BYTES",
    "PREAUTH_LIMITS_HEADER", "LAZY_PAYLOAD_BYTES", "MAX_HEADER_DEPTH", "ProtocolError", "ConnectionClosed", "Limits",
    "PREAUTH_LIMITS",
    "payload_to_tensors", "json_depth", "encode_header", "send_frame", "recv_frame", "valid_id", "check_id",
]

MAGIC = b"LTXM"
#: Bump on any incompatible change of framing or schemas; both sides reject other versions.
PROTOCOL_VERSION = 3
_PREFIX = struct.Struct("!4sHHIQ")
PREFIX_SIZE = _PREFIX.size  # 20 bytes
MAX_HEADER_BYTES = 1 << 20
DEFAULT_MAX_PAYLOAD_BYTES = settings.MAX_PAYLOAD_BYTES.default
#: Before a connection has authenticated, frames are tiny and carry no tensors.
PREAUTH_LIMITS_HEADER = 64 << 10
#: Payloads of at least this many bytes are received into lazily allocated memory.
LAZY_PAYLOAD_BYTES = 1 << 20
#: The deepest nesting of objects and lists a header may have (ours use 4).
MAX_HEADER_DEPTH = 32


class ProtocolError(Exception):
    """A frame or message that breaks the protocol; the connection that sent it is closed.

    ``request_id`` names the offending request when it could be read (else ``None``)."""

    def __init__(self, message: str, request_id: str | None = None):
        super().__init__(message)
        self.request_id = request_id


class ConnectionClosed(ProtocolError):
    """The peer closed the connection cleanly at a frame boundary."""


@dataclass(frozen=True)
class Limits:
    """Frame size limits in bytes (header: JSON; payload: safetensors)."""

    max_header_bytes: int = MAX_HEADER_BYTES
    max_payload_bytes: int = field(
        default_factory=lambda: settings.MAX_PAYLOAD_BYTES.get())


PREAUTH_LIMITS = Limits(max_header_bytes=PREAUTH_LIMITS_HEADER, max_payload_bytes=0)

# --------------------------------------------------------------------------- tensors <-> payload
# The codec lives in ltx_mgpu.wire.payload; this name (and tensors_to_payload, which ltx_mgpu.wire
# re-exports) is the protocol's public API.


def payload_to_tensors(payload: bytes | bytearray | memoryview | torch.Tensor | None) -> dict[str, torch.Tensor]:
    """Parse a safetensors blob into named CPU tensors (:func:`ltx_mgpu.wire.payload.parse_payload`:
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

def json_depth(value: Any) -> int:
    """How deeply ``value``'s dicts and lists nest (a scalar is 0), without recursion."""
    deepest, stack = 0, [(value, 1)]
    while stack:
        v, d = stack.pop()
        children = v.values() if isinstance(v, dict) else v if isinstance(v, list) else None
        if children is None:
            continue
        deepest = max(deepest, d)
        stack.extend((c, d + 1) for c in children if isinstance(c, (dict, list)))
    return deepest


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
    on ``sock``. ``shm`` (an ``ltx_mgpu.wire.sender.ArenaSender``, only on connections that enabled
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
    try:
        raw = encode_header(header, limits)
    except BaseException:
        if placed is not None:
            shm.unsent()  # nothing went out: keep the arena's acknowledgement in step
        raise
    try:
        send_with_fds(sock, _PREFIX.pack(MAGIC, PROTOCOL_VERSION, flags, len(raw), n) + raw, fds)
    finally:
        if placed is not None:
            shm.sent()  # what was handed over is the receiver's now (or lost with the connection)
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
    """Read one frame: ``(header, tensors)``. ``shm`` (an ``ltx_mgpu.wire.receiver.ArenaReceiver``, on
    connections that enabled the feature) reads ``shm`` frames and applies drop notices.

    Raises:
        ConnectionClosed: clean EOF before a frame started.
        ProtocolError: bad magic or version, unknown flags (any flag without ``shm``), a header
            or payload over the limits, a truncated frame, a header that is not a JSON object,
            a payload that is not safetensors, or a broken ``shm`` frame (``ltx_mgpu.wire.arena``).
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
    if json_depth(header) > MAX_HEADER_DEPTH:
        raise ProtocolError(f"header is nested more than {MAX_HEADER_DEPTH} levels deep", valid_id(header.get("id")))
    if flags or fds:
        try:
            return shm.receive(flags, payload_len, fds, header, limits.max_payload_bytes)
        except ShmError as e:
            raise ProtocolError(str(e), valid_id(header.get("id"))) from None
    # The payload lands in one buffer of the exact size (the kernel writes into it) and the
    # tensors are views into it: no user-space copy. A bytearray (zero-filled: its pages are
    # touched at once) for small payloads; an anonymous mapping for large ones, whose pages are
    # allocated only as the bytes arrive, so a header declaring gigabytes costs nothing until
    # they come (the mapping goes with the last tensor viewing it).
    payload = bytearray(payload_len) if payload_len < LAZY_PAYLOAD_BYTES else mmap.mmap(-1, payload_len)
    if payload_len:
        _recv_into(sock, memoryview(payload), "payload")
    try:
        tensors = payload_to_tensors(payload)
    except ProtocolError as e:
        raise ProtocolError(str(e), valid_id(header.get("id"))) from None
    return header, tensors


# --------------------------------------------------------------------------- request ids
# (here, not in ltx_mgpu.wire.messages, because a broken frame is attributed to its request id)

_ID_RE = re.compile(r"^[A-Za-z0-9_.:\-]{1,64}$")


def valid_id(value: Any) -> str | None:
    """``value`` when it is a well-formed request id (1-64 of ``[A-Za-z0-9_.:-]``), else None."""
    return value if isinstance(value, str) and _ID_RE.match(value) else None


def check_id(value: Any, what: str) -> str:
    """``value`` when it is a valid request id (:func:`valid_id`).

    Raises:
        ProtocolError: naming ``what`` and the allowed characters.
    """
    if not isinstance(value, str) or not _ID_RE.match(value):
        raise ProtocolError(f"{what} must be 1-64 characters of [A-Za-z0-9_.:-], got {value!r:.80}")
    return value

