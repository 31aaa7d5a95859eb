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
is the slow part, 92 ms for 200 MB on the H200 host) and then gives away: the frame carries the
descriptor and ``"shm": {"own": true, "offset", "size"}``, the sender unmaps and closes its
side once the frame is out, and the receiver maps ``[0, offset + size)`` (shared, pages mapped on first touch;
no other process maps it any more) and returns views of it, kept as long as they live (nothing
to acknowledge; no copy unless a ``receive`` makes one, e.g. an upcast). A spare is
used only when it fits the payload within a factor of two (:func:`fits`), so a small result
never pins a large one's memory; the receiver refuses a larger one.
A producer that knows its payload's layout in advance (``ltx_mgpu.payload.payload_layout``)
can :meth:`ArenaSender.reserve` the spare and write the tensors at their places; that payload
is then handed over without being copied (the pool's one-rank ``encode``: the encoder's float32
upcast goes straight into the client's memory, instead of into fresh pages and then a copy).

Settings (environment of the pool, or of the client for ``LTX_MGPU_SHM``):
``LTX_MGPU_SHM=0`` turns the feature off; ``LTX_MGPU_SHM_MIN_BYTES`` (1 MiB),
``LTX_MGPU_SHM_MAX_BYTES`` (2 GiB: all arenas and spares of a pool together),
``LTX_MGPU_SHM_IDLE_SECONDS`` (60) and ``LTX_MGPU_SHM_OWN_MIN_BYTES`` (4 MiB).
"""

from __future__ import annotations

import array
import contextlib
import fcntl
import mmap
import os
import socket
import threading
import time
from typing import Any, Callable, Mapping

import psutil
import torch

__all__ = ["FEATURE", "FEATURE_OWN", "FLAG_SHM", "FLAG_SHM_FD", "FLAG_SHM_DROP", "HEADER_BYTES", "MIN_BYTES",
           "MAX_BYTES", "IDLE_SECONDS", "OWN_MIN_BYTES", "available", "arena_size", "fits", "Budget", "ArenaSender",
           "ShmError", "Take", "send_with_fds", "recvmsg_into"]

FEATURE = "shm"
FEATURE_OWN = "shm_own"
#: Frame flags (the u16 of the frame prefix): payload in the arena / a new arena's descriptor
#: comes with this frame / unmap the arena.
FLAG_SHM, FLAG_SHM_FD, FLAG_SHM_DROP = 0x1, 0x2, 0x4
HEADER_BYTES = 64
MIN_BYTES = int(os.environ.get("LTX_MGPU_SHM_MIN_BYTES", 1 << 20))
MAX_BYTES = int(os.environ.get("LTX_MGPU_SHM_MAX_BYTES", 2 << 30))
IDLE_SECONDS = float(os.environ.get("LTX_MGPU_SHM_IDLE_SECONDS", 60.0))
OWN_MIN_BYTES = int(os.environ.get("LTX_MGPU_SHM_OWN_MIN_BYTES", 4 << 20))
_ROUND = 1 << 20
_SEALS = fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW if hasattr(fcntl, "F_SEAL_SHRINK") else 0
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
        """Let go of the mapping and close the descriptor this side still holds. The memory is
        unmapped when the last tensor viewing it is gone, never before: ``torch.frombuffer``
        views keep the ``mmap`` object alive but do not stop ``mmap.close()`` from unmapping
        under them, and a reservation's views are a job's rows (:meth:`ArenaSender.reserve`),
        so ``mmap.close()`` is never called here."""
        self.ack = self.u8 = self.mm = None
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
    """The pool's side of one connection: places payloads in its arena, or with ``own`` hands
    large ones over in a spare (see the module doc).

    ``place``, ``sent``, ``unsent`` and ``drop`` are called by the connection's one writer
    thread; the spare is made by a background thread and swapped in under ``_lock``. Counters:
    ``frames`` (placed), ``handed`` (of which handed over)."""

    def __init__(self, budget: Budget, min_bytes: int = MIN_BYTES, idle_seconds: float = IDLE_SECONDS,
                 own: bool = False, own_min_bytes: int = OWN_MIN_BYTES):
        self.budget, self.min_bytes, self.idle_seconds = budget, int(min_bytes), float(idle_seconds)
        self.own, self.own_min_bytes = bool(own), max(int(own_min_bytes), int(min_bytes))
        self.arena: _Arena | None = None
        self.arena_id = 0
        self.seq = 0
        self.last_used = time.monotonic()
        self.frames = self.handed = 0
        self._lock = threading.Lock()
        self._spare: _Arena | None = None
        self._reserved: _Arena | None = None  # a spare set aside by reserve() (still in the budget)
        self._making: threading.Thread | None = None
        self._given: list[_Arena] = []
        self._last: str | None = None  # what the last place() used: "arena", "gift" or None
        self._closed = False

    def place(self, payload) -> tuple[dict, list[int]] | None:
        """Put ``payload`` (a ``ltx_mgpu.payload.Payload``) in shared memory: ``(ref, fds)`` for
        the frame header and the descriptors to attach (a new arena's, a handed-over spare's,
        else none), or ``None`` to send it through the socket (too small, previous frame not
        acknowledged, no memory or budget for an arena large enough). Call :meth:`sent` once
        the frame is out."""
        n = payload.nbytes
        if n < self.min_bytes:
            return None
        need = HEADER_BYTES + n
        own = self.own and n >= self.own_min_bytes
        try:
            gift = self._take_reserved(payload) if own else None
            if gift is None and own:
                gift = self._take_spare(need)
            if gift is not None:
                try:
                    _write(gift, payload)
                except BaseException:
                    gift.close()
                    raise
                self._given.append(gift)
                self._last = "gift"
                self.handed += 1
                self.frames += 1
                self.last_used = time.monotonic()
                return {"own": True, "offset": HEADER_BYTES, "size": n}, [gift.fd]
            arena, fds = self.arena, []
            if arena is not None and int(arena.ack[0]) != self.seq:
                return None  # the receiver is still reading the previous frame
            if arena is None or arena.size < need:
                arena = self._grow(need)
                if arena is None:
                    return None
                fds = [arena.fd]
            _write(arena, payload)
            self._last = "arena"
            self.seq += 1
            self.frames += 1
            self.last_used = time.monotonic()
            return {"arena": self.arena_id, "seq": self.seq, "offset": HEADER_BYTES, "size": n}, fds
        finally:
            if own:  # after this payload has its memory: the spare never takes the budget from it
                self._make_spare_soon(need)

    def reserve(self, nbytes: int) -> torch.Tensor | None:
        """Set the ready spare aside for the next payload, of ``nbytes`` bytes, so that its
        producer can write it in place: the uint8 view of the ``[HEADER_BYTES, HEADER_BYTES +
        nbytes)`` bytes where :meth:`place` puts the payload, or None (hand-over off, under
        :attr:`own_min_bytes`, or no spare that :func:`fits`; the payload then goes as usual).

        The reservation is used by the payload whose tensors all lie at their places in it
        (:func:`~ltx_mgpu.payload.payload_layout` gives them), and then nothing is copied; any
        other payload leaves it alone. It counts against the pool's :class:`Budget` until it is
        handed over or dropped. It may be dropped before its payload comes (a newer
        reservation, the idle drop, the connection closing): the views stay valid (the memory
        goes with the last of them) and the payload is then copied as any other. Called from
        the job's thread; :meth:`place` runs on the connection's writer thread.
        """
        need = HEADER_BYTES + int(nbytes)
        if not self.own or nbytes < self.own_min_bytes:
            return None
        spare = self._take_spare(need, release=False)
        if spare is None:
            return None
        with self._lock:
            if self._closed:  # closed meanwhile: nothing would ever drop it
                old, spare = spare, None
            else:
                old, self._reserved = self._reserved, spare
                self.last_used = time.monotonic()
        if old is not None:
            self.budget.release(old.size)
            old.close()
        return None if spare is None else spare.u8[HEADER_BYTES:need]

    def _take_reserved(self, payload) -> _Arena | None:
        """The reserved arena if ``payload`` was written in it, every tensor at its place (then
        nothing is copied); otherwise None, and the reservation stays for its own payload."""
        with self._lock:
            arena = self._reserved
            if arena is None or not _in_place(arena, payload):
                return None
            self._reserved = None
        self.budget.release(arena.size)  # from here on it is the receiver's memory
        return arena

    def unsent(self) -> None:
        """The frame of the last :meth:`place` could not be sent (its header broke the limits):
        undo it, so the arena's acknowledgement stays in step (a gift is dropped)."""
        if self._last == "arena":
            self.seq -= 1
        elif self._last == "gift":
            self.handed -= 1
            self.sent()
        if self._last is not None:
            self.frames -= 1
        self._last = None

    def sent(self) -> None:
        """The frame of the last :meth:`place` is out: unmap and close what was handed over
        (its memory is the receiver's now)."""
        self._last = None
        while self._given:
            self._given.pop().close()

    def _grow(self, need: int) -> _Arena | None:
        size = arena_size(need)
        old = self.arena.size if self.arena is not None else 0  # < size: its budget carries over
        if not self.budget.reserve(size - old):
            return None
        arena = _make_arena(size)
        if arena is None:
            self.budget.release(size - old)
            return None
        if self.arena is not None:
            self.arena.close()
        self.arena, self.arena_id = arena, self.arena_id + 1
        return arena

    def _take_spare(self, need: int, release: bool = True) -> _Arena | None:
        """The ready spare if it :func:`fits` ``need`` bytes; a spare that does not fit is
        dropped (a new one of the right size is made next). ``release``: its budget goes with
        it (it is about to be handed over); else it stays charged (a reservation)."""
        with self._lock:
            spare = self._spare
            if spare is None or spare.size < need:
                return None
            self._spare = None
        if not fits(spare.size, need):
            self.budget.release(spare.size)
            spare.close()
            return None
        if release:  # from here on it is the receiver's memory
            self.budget.release(spare.size)
        return spare

    def _make_spare_soon(self, need: int) -> None:
        """Start making a spare for ``need`` bytes in the background, unless one is being made
        or a fitting one is ready."""
        size = arena_size(need)
        with self._lock:
            if self._closed or self._busy() or (self._spare is not None and fits(self._spare.size, need)):
                return
            self._making = threading.Thread(target=self._make_spare, args=(size,), name="shm-spare", daemon=True)
            self._making.start()

    def _busy(self) -> bool:
        return self._making is not None and self._making.is_alive()

    def _make_spare(self, size: int) -> None:
        if not self.budget.reserve(size):
            return
        try:
            arena = _make_arena(size)
        except BaseException:
            self.budget.release(size)
            raise
        if arena is None:
            self.budget.release(size)
            return
        with self._lock:
            old, self._spare = self._spare, arena
            if self._closed:
                old, self._spare = arena, old
        if old is not None:
            self.budget.release(old.size)
            old.close()

    def holding(self) -> bool:
        """Whether an arena or a spare is held or a spare is being made (something to drop
        when idle)."""
        return self.arena is not None or self._spare is not None or self._reserved is not None or self._busy()

    def idle(self, now: float | None = None) -> bool:
        """Whether what is held is acknowledged and unused for ``idle_seconds`` (time to drop it)."""
        now = time.monotonic() if now is None else now
        return (self.holding() and now - self.last_used >= self.idle_seconds
                and (self.arena is None or int(self.arena.ack[0]) == self.seq))

    def drop(self) -> None:
        """Drop the arena (its memory goes once the receiver unmapped it too) and the spare;
        new ones are made when needed. A spare still being made is kept when it is done and
        dropped at the next idle check (:meth:`holding` counts it)."""
        with self._lock:
            spare, self._spare = self._spare, None
            reserved, self._reserved = self._reserved, None
        for held in (self.arena, spare, reserved):
            if held is not None:
                self.budget.release(held.size)
                held.close()
        self.arena = None
        self.sent()

    def close(self) -> None:
        """:meth:`drop`, for good (a spare still being made is dropped when it is done)."""
        with self._lock:
            self._closed = True
        self.drop()


def arena_size(need: int) -> int:
    """The size in bytes of an arena or spare made for a ``need``-byte frame (header + payload):
    ``need`` rounded up to whole MiB."""
    return -(-need // _ROUND) * _ROUND


def fits(size: int, need: int) -> bool:
    """Whether a spare of ``size`` bytes may carry a ``need``-byte frame: it holds it and
    wastes at most half of itself (a small result never pins a large one's memory; the
    receiver refuses a hand-over that breaks this rule)."""
    return need <= size <= 2 * need


def _write(arena: _Arena, payload) -> None:
    """Copy ``payload``'s parts to ``arena`` from offset :data:`HEADER_BYTES`; a part already at
    its place (written there through :meth:`ArenaSender.reserve`) is left as it is."""
    off = HEADER_BYTES
    for part in payload.parts:
        if isinstance(part, (bytes, bytearray)):  # the safetensors header: small
            arena.mm[off:off + len(part)] = part
            off += len(part)
        else:  # a tensor's bytes (numpy uint8 view): torch copies without holding the GIL
            src = torch.from_numpy(part)
            if src.data_ptr() != arena.base + off:
                arena.u8[off:off + src.numel()].copy_(src)
            off += src.numel()


def _in_place(arena: _Arena, payload) -> bool:
    """Whether every tensor part of ``payload`` already lies where :func:`_write` would put it
    in ``arena`` (and at least one does)."""
    off, placed = HEADER_BYTES, False
    for part in payload.parts:
        n = memoryview(part).nbytes
        if not isinstance(part, (bytes, bytearray)):
            if torch.from_numpy(part).data_ptr() != arena.base + off:
                return False
            placed = True
        off += n
    return placed and off <= arena.size


def _make_arena(size: int) -> _Arena | None:
    """:func:`_new_arena`, or None when the host is short of memory (less than twice ``size``
    available) or the allocation fails."""
    try:
        if psutil.virtual_memory().available < 2 * size:
            return None
        return _new_arena(size)
    except (OSError, MemoryError):
        return None

