"""Shared-memory delivery of large payloads (the protocol's ``shm`` feature, ``ltx_mgpu.protocol``).

Why (``benchmarks/bench_socket.py``, 2-core dev VM, steady state, three runs): a 12.5 MB
result (one 1024-token LTX-2.3 embedding in bf16) took 2.7-3.6 ms through the socket and
1.9-3.1 ms through the arena; as float32 in hand (an ``encode`` result) 4.2-6.2 vs 2.5-4.1 ms;
eight of them 143-329 vs 88-187 ms (page faults of the fresh float32 output dominate there).
A fresh tmpfs file per payload took 7.7-8.8 ms, slower than the socket: tmpfs allocates and
clears new pages for every file (~1.5 GB/s here). So the pool keeps one warm *arena* per
connection and reuses it; a memcpy into it runs at 25-35 GB/s.

The arena is a sealed ``memfd`` (no name in any file system, so nothing can be left behind or
guessed: its memory goes when the last process holding it closes or unmaps it). Its size is
fixed at creation (``F_SEAL_SHRINK | F_SEAL_GROW``: no one can truncate it under a mapping,
so reading it cannot raise SIGBUS) and its pages are allocated then (``posix_fallocate``:
out of memory is an error there, never a signal later). Layout: bytes 0-7 hold the
acknowledgement (little-endian int64, written by the receiver), the payload starts at
:data:`HEADER_BYTES`.

Frames (flags of the frame prefix, see ``ltx_mgpu.protocol``):

* ``FLAG_SHM``: no payload bytes follow on the socket; the JSON header carries
  ``"shm": {"arena": int, "seq": int, "offset": int, "size": int}`` and the payload (the same
  safetensors blob the socket would carry) lies at ``[offset, offset + size)`` of the arena;
* ``FLAG_SHM_FD`` (with ``FLAG_SHM``): the frame introduces a new arena: its file descriptor
  rides on the frame's first byte (``SCM_RIGHTS``); the receiver replaces (unmaps) its old one;
* ``FLAG_SHM_DROP``: an empty frame (header ``{}``) telling the receiver to unmap its arena
  (the sender dropped it after :data:`IDLE_SECONDS` without use).

The receiver copies the blob out into one buffer of its own and parses it there, exactly what
the socket would have delivered; or, when ``take(header)`` gives a per-tensor ``receive(name,
view)`` for the frame (``encode``: the float32 upcast), parses it in place and keeps what that
returns, one pass straight from the arena (a result still in the arena is copied). Then it
writes ``seq`` into the acknowledgement. The sender writes into the arena only when the
previous frame has been acknowledged; otherwise, under :data:`MIN_BYTES`, or when no arena can
be had (the pool-wide :class:`Budget`, memory), the payload goes through the socket as before.
Only connections that asked for it (the ``features`` request) get ``shm`` frames.

Settings (environment of the pool, or of the client for ``LTX_MGPU_SHM``):
``LTX_MGPU_SHM=0`` turns the feature off; ``LTX_MGPU_SHM_MIN_BYTES`` (1 MiB),
``LTX_MGPU_SHM_MAX_BYTES`` (2 GiB: all arenas of a pool together) and
``LTX_MGPU_SHM_IDLE_SECONDS`` (60).
"""

from __future__ import annotations

import array
import contextlib
import fcntl
import mmap
import os
import socket
import stat
import threading
import time
from typing import Any, Callable, Mapping

import psutil
import torch

from ltx_mgpu.payload import PayloadError, parse_payload

__all__ = ["FEATURE", "FLAG_SHM", "FLAG_SHM_FD", "FLAG_SHM_DROP", "HEADER_BYTES", "MIN_BYTES", "MAX_BYTES",
           "IDLE_SECONDS", "available", "Budget",
           "ArenaSender", "ArenaReceiver", "ShmError", "Take", "send_with_fds", "recvmsg_into"]

FEATURE = "shm"
#: Frame flags (the u16 of the frame prefix): payload in the arena / a new arena's descriptor
#: comes with this frame / unmap the arena.
FLAG_SHM, FLAG_SHM_FD, FLAG_SHM_DROP = 0x1, 0x2, 0x4
HEADER_BYTES = 64
MIN_BYTES = int(os.environ.get("LTX_MGPU_SHM_MIN_BYTES", 1 << 20))
MAX_BYTES = int(os.environ.get("LTX_MGPU_SHM_MAX_BYTES", 2 << 30))
IDLE_SECONDS = float(os.environ.get("LTX_MGPU_SHM_IDLE_SECONDS", 60.0))
_ROUND = 1 << 20
_SEALS = fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW if hasattr(fcntl, "F_SEAL_SHRINK") else 0
_REF_KEYS = {"arena", "seq", "offset", "size"}
#: ``take(header) -> receive | None``: the per-tensor ``receive(name, view) -> tensor`` for a
#: frame (its ``header``), or None to copy the frame's payload out as the socket delivers it.
Take = Callable[[Mapping[str, Any]], Callable[[str, torch.Tensor], torch.Tensor] | None]


class ShmError(ValueError):
    """A shared-memory frame that breaks the rules (the message says which); the connection is
    closed by the caller (``ltx_mgpu.protocol`` turns it into a ``ProtocolError``)."""


def available() -> bool:
    """Whether this process can use the feature: Linux ``memfd_create`` with sealing, SCM_RIGHTS,
    and ``LTX_MGPU_SHM`` not ``0``."""
    return (os.environ.get("LTX_MGPU_SHM", "1") not in ("0", "off", "false") and hasattr(os, "memfd_create")
            and bool(_SEALS) and hasattr(socket, "SCM_RIGHTS") and hasattr(mmap, "MAP_SHARED"))


def send_with_fds(sock: socket.socket, data: bytes, fds: list[int]) -> None:
    """``sock.sendall(data)``, with ``fds`` (may be empty) passed on its first byte (SCM_RIGHTS)."""
    if not fds:
        sock.sendall(data)
        return
    sent = sock.sendmsg([data], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", fds))])
    sock.sendall(data[sent:])


def recvmsg_into(sock: socket.socket, view: memoryview, fds: list[int]) -> int:
    """``sock.recv_into(view)`` that appends descriptors passed with the bytes to ``fds``.

    Raises:
        ShmError: more than 4 descriptors came at once (the excess was discarded by the kernel).
    """
    k, anc, flags, _ = sock.recvmsg_into([view], socket.CMSG_SPACE(4 * array.array("i").itemsize))
    for level, kind, data in anc:
        if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
            fds.extend(array.array("i", data[:len(data) - len(data) % 4]))
    if flags & socket.MSG_CTRUNC:
        raise ShmError("too many file descriptors came with a frame")
    return k


class Budget:
    """Bytes of arena memory a pool may hold over all its connections (``total`` bytes)."""

    def __init__(self, total: int = MAX_BYTES):
        self.total, self.used = int(total), 0
        self._lock = threading.Lock()

    def reserve(self, n: int) -> bool:
        """Take ``n`` bytes of the budget; False (nothing taken) when that would exceed it."""
        with self._lock:
            if self.used + n > self.total:
                return False
            self.used += n
            return True

    def release(self, n: int) -> None:
        """Give ``n`` bytes back."""
        with self._lock:
            self.used = max(0, self.used - n)


class _Arena:
    """One mapped arena: ``fd`` (sender: kept until dropped; receiver: closed after mapping),
    ``mm`` the shared mapping, ``u8`` a uint8 tensor over it, ``ack`` an int64 view of bytes 0-7."""

    def __init__(self, fd: int, size: int, populate: bool = True):
        flags = mmap.MAP_SHARED | (getattr(mmap, "MAP_POPULATE", 0) if populate else 0)
        self.fd, self.size = fd, size
        self.mm = mmap.mmap(fd, size, flags=flags, prot=mmap.PROT_READ | mmap.PROT_WRITE)
        self.u8 = torch.frombuffer(self.mm, dtype=torch.uint8)
        self.ack = self.u8[:8].view(torch.int64)
        self.base = self.u8.data_ptr()

    def holds(self, t: torch.Tensor) -> bool:
        """Whether ``t``'s memory lies in this arena."""
        if t.numel() == 0:
            return False
        p = t.untyped_storage().data_ptr()
        return self.base <= p < self.base + self.size

    def close(self) -> None:
        """Unmap (once no view is left) and close the descriptor this side still holds."""
        self.ack = self.u8 = None
        with contextlib.suppress(BufferError):  # a view still alive: the mapping goes with it
            self.mm.close()
        if self.fd >= 0:
            with contextlib.suppress(OSError):
                os.close(self.fd)
            self.fd = -1


def _new_arena(size: int) -> _Arena:
    """A sealed memfd of ``size`` bytes, pages allocated, mapped. Raises OSError."""
    fd = os.memfd_create("ltx_mgpu-arena", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    try:
        os.ftruncate(fd, size)
        os.posix_fallocate(fd, 0, size)
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, _SEALS | fcntl.F_SEAL_SEAL)
        return _Arena(fd, size)
    except BaseException:
        os.close(fd)
        raise


class ArenaSender:
    """The pool's side of one connection: places payloads in its arena (see the module doc).

    Not thread-safe: one connection's writer thread uses it."""

    def __init__(self, budget: Budget, min_bytes: int = MIN_BYTES, idle_seconds: float = IDLE_SECONDS):
        self.budget, self.min_bytes, self.idle_seconds = budget, int(min_bytes), float(idle_seconds)
        self.arena: _Arena | None = None
        self.arena_id = 0
        self.seq = 0
        self.last_used = time.monotonic()
        self.frames = 0

    def place(self, payload) -> tuple[dict, list[int]] | None:
        """Copy ``payload`` (a ``ltx_mgpu.payload.Payload``) into the arena: ``(ref, fds)`` for
        the frame header and the descriptors to attach (the new arena's, else none), or
        ``None`` to send it through the socket (too small, previous frame not acknowledged,
        no memory or budget for an arena large enough)."""
        n = payload.nbytes
        if n < self.min_bytes:
            return None
        arena, fds = self.arena, []
        if arena is not None and int(arena.ack[0]) != self.seq:
            return None  # the receiver is still reading the previous frame
        need = HEADER_BYTES + n
        if arena is None or arena.size < need:
            arena = self._grow(need)
            if arena is None:
                return None
            fds = [arena.fd]
        off = HEADER_BYTES
        for part in payload.parts:
            if isinstance(part, (bytes, bytearray)):  # the safetensors header: small
                arena.mm[off:off + len(part)] = part
                off += len(part)
            else:  # a tensor's bytes (numpy uint8 view): torch copies without holding the GIL
                src = torch.from_numpy(part)
                arena.u8[off:off + src.numel()].copy_(src)
                off += src.numel()
        self.seq += 1
        self.frames += 1
        self.last_used = time.monotonic()
        return {"arena": self.arena_id, "seq": self.seq, "offset": HEADER_BYTES, "size": n}, fds

    def _grow(self, need: int) -> _Arena | None:
        size = -(-need // _ROUND) * _ROUND
        old = self.arena.size if self.arena is not None else 0  # < size: its budget carries over
        if not self.budget.reserve(size - old):
            return None
        try:
            if psutil.virtual_memory().available < 2 * size:
                raise MemoryError
            arena = _new_arena(size)
        except (OSError, MemoryError):
            self.budget.release(size - old)
            return None
        if self.arena is not None:
            self.arena.close()
        self.arena, self.arena_id = arena, self.arena_id + 1
        return arena

    def idle(self, now: float | None = None) -> bool:
        """Whether the arena is acknowledged and unused for ``idle_seconds`` (time to drop it)."""
        now = time.monotonic() if now is None else now
        return (self.arena is not None and now - self.last_used >= self.idle_seconds
                and int(self.arena.ack[0]) == self.seq)

    def close(self) -> None:
        """Drop the arena (its memory goes once the receiver unmapped it too)."""
        if self.arena is not None:
            self.budget.release(self.arena.size)
            self.arena.close()
            self.arena = None


def _check_fd(fd: int) -> int:
    """The size of a received arena descriptor after checking it is a sealed memfd."""
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode):
        raise ShmError("the shared-memory descriptor is not a regular memory file")
    try:
        seals = fcntl.fcntl(fd, fcntl.F_GET_SEALS)
    except OSError:
        raise ShmError("the shared-memory descriptor is not a memfd (it has no seals)") from None
    if seals & _SEALS != _SEALS:
        raise ShmError("the shared-memory arena is not sealed against resizing")
    if not HEADER_BYTES < st.st_size <= (1 << 40):
        raise ShmError(f"the shared-memory arena has {st.st_size} bytes")
    return st.st_size


def _int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v >= 0


class ArenaReceiver:
    """The client's side: maps the pool's arena, reads ``shm`` frames, acknowledges them.

    ``take`` (:data:`Take`; default: none) chooses per frame between a copy of the payload
    (tensors are views into one private buffer, as from the socket) and a ``receive`` of each
    tensor. Counters: ``frames``, ``bytes``, ``arenas``.
    Used by the connection's single reader thread."""

    def __init__(self, take: Take | None = None):
        self.take = take
        self.arena: _Arena | None = None
        self.arena_id: int | None = None
        self.seq = 0
        self.frames = self.bytes = self.arenas = 0

    def receive(self, flags: int, payload_len: int, fds: list[int], header: dict,
                max_bytes: int) -> tuple[dict, dict[str, torch.Tensor]] | None:
        """Handle a frame with ``shm`` flags (or descriptors): ``(header, tensors)`` of a
        ``FLAG_SHM`` frame (its ``shm`` reference removed from ``header``), ``None`` for a drop
        notice (the arena is unmapped).

        Raises:
            ShmError: an invalid flag combination, a socket payload or descriptors where none
                belong, a drop notice with a header, or what :meth:`read` raises.
        """
        if flags not in (FLAG_SHM, FLAG_SHM | FLAG_SHM_FD, FLAG_SHM_DROP) or payload_len:
            raise ShmError(f"frame flags {flags:#x} with a {payload_len}-byte socket payload are not a valid "
                           "combination")
        if bool(fds) != bool(flags & FLAG_SHM_FD):
            raise ShmError(f"{len(fds)} file descriptor(s) came with a frame of flags {flags:#x} (one comes with, and "
                           "only with, a frame introducing a shared-memory arena)")
        if flags == FLAG_SHM_DROP:
            if header:
                raise ShmError("a shared-memory drop notice must have an empty header")
            self.drop()
            return None
        return header, self.read(header.pop("shm", None), fds, header, max_bytes)

    def read(self, ref: Any, fds: list[int], header: Mapping[str, Any], max_bytes: int) -> dict[str, torch.Tensor]:
        """The tensors of a ``shm`` frame (``fds``: the descriptors that came with it; taken
        over: closed or kept here).

        Raises:
            ShmError: a malformed reference, a descriptor that is not a sealed memfd, an unknown
                arena, a range outside it, an old sequence number or a payload that is not
                safetensors.
        """
        try:
            if not (isinstance(ref, dict) and set(ref) == _REF_KEYS and all(_int(ref[k]) for k in _REF_KEYS)):
                raise ShmError(f"the shm reference must be {{{', '.join(sorted(_REF_KEYS))}}} of non-negative ints, "
                               f"got {ref!r:.200}")
            if len(fds) > 1:
                raise ShmError(f"{len(fds)} descriptors came with one frame (at most one new arena)")
            if fds:
                size = _check_fd(fds[0])
                try:
                    arena = _Arena(fds[0], size)
                except (OSError, ValueError) as e:
                    raise ShmError(f"cannot map the {size}-byte shared-memory arena: {e}") from None
                arena.fd = -1  # the mapping keeps the memory; the descriptor is closed below
                self.drop()
                self.arena, self.arena_id = arena, ref["arena"]
                self.arenas += 1
            if self.arena is None or ref["arena"] != self.arena_id:
                raise ShmError(f"the frame refers to arena {ref['arena']}, but this connection maps "
                               f"{'none' if self.arena is None else self.arena_id}")
            off, n, seq = ref["offset"], ref["size"], ref["seq"]
            if off < HEADER_BYTES or off % 8 or not 0 < n <= max_bytes or off + n > self.arena.size:
                raise ShmError(f"bytes [{off}, {off + n}) are not a payload range of the {self.arena.size}-byte arena "
                               f"(at most {max_bytes} bytes from offset >= {HEADER_BYTES}, 8-aligned)")
            if seq <= self.seq:
                raise ShmError(f"sequence number {seq} is not after {self.seq}")
        finally:
            while fds:
                with contextlib.suppress(OSError):
                    os.close(fds.pop())
        arena = self.arena
        receive = self.take(header) if self.take is not None else None
        blob = arena.u8[off:off + n]
        if receive is None:  # one copy out, then views into it: what the socket would deliver
            blob = torch.empty(n, dtype=torch.uint8).copy_(blob)
        try:
            views = parse_payload(blob)
        except PayloadError as e:
            raise ShmError(f"the shared-memory payload is not a valid safetensors blob: {e}") from None
        out = {}
        for name in list(views):
            kept = view = views.pop(name)
            if receive is not None:
                kept = receive(name, view)
                if isinstance(kept, torch.Tensor) and arena.holds(kept):
                    kept = torch.empty(kept.shape, dtype=kept.dtype).copy_(kept)
            out[name] = kept
        blob = view = kept = None
        # Every copy out of the arena is complete before this store, the sender checks it before
        # it writes the next payload: from here on it may overwrite the arena.
        arena.ack[0] = seq
        self.seq = seq
        self.frames += 1
        self.bytes += n
        return out

    def drop(self) -> None:
        """Unmap the arena (its memory goes once the pool dropped it too)."""
        if self.arena is not None:
            self.arena.close()
            self.arena, self.arena_id = None, None
