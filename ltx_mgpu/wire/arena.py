"""Shared-memory delivery of large payloads (the protocol's ``shm`` feature, ``ltx_mgpu.wire``).

Why: a large result (e.g. one 1024-token LTX-2.3 embedding, 12.5 MB in bf16) arrives sooner
through shared memory than through the socket, in bf16 and as float32 in hand (an ``encode``
result; for many of them the page faults of the fresh float32 output dominate either way).
A fresh tmpfs file per payload would be slower than the socket: tmpfs allocates and clears
new pages for every file. So the pool keeps one warm *arena* per connection and reuses it: a
memcpy into the warm arena is much faster than a fresh file's page clearing
(``benchmarks/bench_socket.py`` measures the three ways).

The arena is a sealed ``memfd`` (no name in any file system, so nothing can be left behind or
guessed: its memory goes when the last process holding it closes or unmaps it). Its size is
fixed at creation (``F_SEAL_SHRINK | F_SEAL_GROW``: no one can truncate it under a mapping,
so reading it cannot raise SIGBUS) and its pages are allocated then (``posix_fallocate``:
out of memory is an error there, never a signal later). Layout: bytes 0-7 hold the
acknowledgement (little-endian int64, written by the receiver), the payload starts at
:data:`HEADER_BYTES`.

Frames (flags of the frame prefix, see ``ltx_mgpu.wire``):

* ``FLAG_SHM``: no payload bytes follow on the socket; the JSON header carries
  ``"shm": {"arena": int, "seq": int, "offset": int, "size": int}`` and the payload (the same
  safetensors blob the socket would carry) lies at ``[offset, offset + size)`` of the arena;
* ``FLAG_SHM_FD`` (with ``FLAG_SHM``): a file descriptor rides on the frame's first byte
  (``SCM_RIGHTS``): a new arena's, which replaces (unmaps) the receiver's old one, or a
  handed-over spare's (see below);
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

**Hand-over** (the ``shm_own`` feature, on top of ``shm``): a payload of at least
:data:`OWN_MIN_BYTES` may instead go into a *spare* memfd that the pool made ahead of time (in
a background thread, after the previous large payload: allocating and faulting in fresh pages
is the slow part) and then gives away: the frame carries the descriptor and
``"shm": {"own": true, "offset", "size"}``, the sender unmaps and closes its side once the frame
is out, and the receiver maps ``[0, offset + size)`` (shared, pages mapped on first touch; no
other process maps it any more) and returns views of it, kept as long as they live (nothing
to acknowledge; no copy unless a ``receive`` makes one, e.g. an upcast). A spare is
used only when it fits the payload within a factor of two (:func:`fits`), so a small result
never pins a large one's memory; the receiver refuses a larger one.
A producer that knows its payload's layout in advance (``ltx_mgpu.wire.payload.payload_layout``)
can ``ltx_mgpu.wire.sender.ArenaSender.reserve`` the spare and write the tensors at their places; that payload
is then handed over without being copied (the pool's one-rank ``encode``: the encoder's float32
upcast goes straight into the client's memory, instead of into fresh pages and then a copy).

Settings: ``ltx_mgpu.settings.SHM`` (off: everything through the socket) and the thresholds
``SHM_MIN_BYTES``, ``SHM_MAX_BYTES`` (all arenas and spares of a pool together),
``SHM_IDLE_SECONDS`` and ``SHM_OWN_MIN_BYTES``, read from the pool's environment (``SHM`` also
from the client's).
"""

from __future__ import annotations

import array
import contextlib
import fcntl
import mmap
import os
import socket
import threading
from typing import Any, Callable, Mapping

import torch

from ltx_mgpu import settings

__all__ = ["FEATURE", "FEATURE_OWN", "FLAG_SHM", "FLAG_SHM_FD", "FLAG_SHM_DROP", "HEADER_BYTES", "MIN_BYTES",
           "MAX_BYTES", "IDLE_SECONDS", "OWN_MIN_BYTES", "available", "arena_size", "fits", "Budget",
           "ShmError", "Take", "Arena", "new_arena", "SEALS", "send_with_fds", "recvmsg_into"]

FEATURE = "shm"
FEATURE_OWN = "shm_own"
#: Frame flags (the u16 of the frame prefix): payload in the arena / a new arena's descriptor
#: comes with this frame / unmap the arena.
FLAG_SHM, FLAG_SHM_FD, FLAG_SHM_DROP = 0x1, 0x2, 0x4
HEADER_BYTES = 64
MIN_BYTES = settings.SHM_MIN_BYTES.get()
MAX_BYTES = settings.SHM_MAX_BYTES.get()
IDLE_SECONDS = settings.SHM_IDLE_SECONDS.get()
OWN_MIN_BYTES = settings.SHM_OWN_MIN_BYTES.get()
_ROUND = 1 << 20
SEALS = fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW if hasattr(fcntl, "F_SEAL_SHRINK") else 0
#: ``take(header) -> receive | None``: the per-tensor ``receive(name, view) -> tensor`` for a
#: frame (its ``header``), or None to copy the frame's payload out as the socket delivers it.
Take = Callable[[Mapping[str, Any]], Callable[[str, torch.Tensor], torch.Tensor] | None]


class ShmError(ValueError):
    """A shared-memory frame that breaks the rules (the message says which); the connection is
    closed by the caller (``ltx_mgpu.wire`` turns it into a ``ProtocolError``)."""


def available() -> bool:
    """Whether this process can use the feature: Linux ``memfd_create`` with sealing, SCM_RIGHTS,
    and ``LTX_MGPU_SHM`` not ``0``."""
    return (settings.SHM.get() and hasattr(os, "memfd_create")
            and bool(SEALS) and hasattr(socket, "SCM_RIGHTS") and hasattr(mmap, "MAP_SHARED"))


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


class Arena:
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
        """Let go of the mapping and close the descriptor this side still holds. The memory is
        unmapped when the last tensor viewing it is gone, never before: ``torch.frombuffer``
        views keep the ``mmap`` object alive but do not stop ``mmap.close()`` from unmapping
        under them, and a reservation's views are a job's rows (``ltx_mgpu.wire.sender.ArenaSender.reserve``),
        so ``mmap.close()`` is never called here."""
        self.ack = self.u8 = self.mm = None
        if self.fd >= 0:
            with contextlib.suppress(OSError):
                os.close(self.fd)
            self.fd = -1


def new_arena(size: int) -> Arena:
    """A sealed memfd of ``size`` bytes, pages allocated, mapped. Raises OSError."""
    fd = os.memfd_create("ltx_mgpu-arena", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    try:
        os.ftruncate(fd, size)
        os.posix_fallocate(fd, 0, size)
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, SEALS | fcntl.F_SEAL_SEAL)
        return Arena(fd, size)
    except BaseException:
        os.close(fd)
        raise


def arena_size(need: int) -> int:
    """The size in bytes of an arena or spare made for a ``need``-byte frame (header + payload):
    ``need`` rounded up to whole MiB."""
    return -(-need // _ROUND) * _ROUND


def fits(size: int, need: int) -> bool:
    """Whether a spare of ``size`` bytes may carry a ``need``-byte frame: it holds it and
    wastes at most half of itself (a small result never pins a large one's memory; the
    receiver refuses a hand-over that breaks this rule)."""
    return need <= size <= 2 * need
