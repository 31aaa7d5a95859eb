"""The pool's side of shared-memory delivery: :class:`ArenaSender` places a connection's large
payloads in its arena, or hands them over in a spare memfd made ahead of time, or in one a job
reserved and wrote in place. The frames, the arena's layout and the rules both sides follow are
:mod:`ltx_mgpu.wire.arena`'s; the client's side is :mod:`ltx_mgpu.wire.receiver`."""

from __future__ import annotations

import threading
import time

import psutil
import torch

from ltx_mgpu.wire.arena import (
    HEADER_BYTES,
    IDLE_SECONDS,
    MIN_BYTES,
    OWN_MIN_BYTES,
    Arena,
    Budget,
    arena_size,
    fits,
    new_arena,
)

__all__ = ["ArenaSender"]


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
        self.arena: Arena | None = None
        self.arena_id = 0
        self.seq = 0
        self.last_used = time.monotonic()
        self.frames = self.handed = 0
        self._lock = threading.Lock()
        self._spare: Arena | None = None
        self._reserved: Arena | None = None  # a spare set aside by reserve() (still in the budget)
        self._making: threading.Thread | None = None
        self._given: list[Arena] = []
        self._last: str | None = None  # what the last place() used: "arena", "gift" or None
        self._spare_need = 0  # bytes of the last placed frame whose spare sent() starts making
        self._closed = False

    def place(self, payload) -> tuple[dict, list[int]] | None:
        """Put ``payload`` (a ``ltx_mgpu.wire.payload.Payload``) in shared memory: ``(ref, fds)`` for
        the frame header and the descriptors to attach (a new arena's, a handed-over spare's,
        else none), or ``None`` to send it through the socket (too small, previous frame not
        acknowledged, no memory or budget for an arena large enough). Call :meth:`sent` once
        the frame is out: a large payload's next spare is made then (after the send, so the
        making, a thread start and the allocation of its pages, does not delay this frame)."""
        n = payload.nbytes
        if n < self.min_bytes:
            return None
        need = HEADER_BYTES + n
        own = self.own and n >= self.own_min_bytes
        placed = None
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
                placed = {"own": True, "offset": HEADER_BYTES, "size": n}, [gift.fd]
                return placed
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
            placed = {"arena": self.arena_id, "seq": self.seq, "offset": HEADER_BYTES, "size": n}, fds
            return placed
        finally:
            # after this payload has its memory (the spare never takes the budget from it), and
            # for a placed payload after its frame is out (sent / unsent)
            if own and placed is None:
                self._make_spare_soon(need)
            self._spare_need = need if own and placed is not None else 0

    def reserve(self, nbytes: int) -> torch.Tensor | None:
        """Set the ready spare aside for the next payload, of ``nbytes`` bytes, so that its
        producer can write it in place: the uint8 view of the ``[HEADER_BYTES, HEADER_BYTES +
        nbytes)`` bytes where :meth:`place` puts the payload, or None (hand-over off, under
        :attr:`own_min_bytes`, or no spare that :func:`fits`; the payload then goes as usual).

        The reservation is used by the payload whose tensors all lie at their places in it
        (:func:`~ltx_mgpu.wire.payload.payload_layout` gives them), and then nothing is copied; any
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

    def _take_reserved(self, payload) -> Arena | None:
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
        if self._last is not None:
            self.frames -= 1
        self.sent()

    def sent(self) -> None:
        """The frame of the last :meth:`place` is out: unmap and close what was handed over
        (its memory is the receiver's now), and start making the next spare if it was large."""
        self._last = None
        while self._given:
            self._given.pop().close()
        need, self._spare_need = self._spare_need, 0
        if need:
            self._make_spare_soon(need)

    def _grow(self, need: int) -> Arena | None:
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

    def _take_spare(self, need: int, release: bool = True) -> Arena | None:
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


def _placed(payload):
    """``(offset, part, tensor)`` for each part of ``payload`` as it lies in an arena from
    :data:`HEADER_BYTES`: ``tensor`` is the uint8 tensor over a tensor part's bytes (numpy view),
    None for the safetensors header (bytes)."""
    off = HEADER_BYTES
    for part in payload.parts:
        tensor = None if isinstance(part, (bytes, bytearray)) else torch.from_numpy(part)
        yield off, part, tensor
        off += memoryview(part).nbytes


def _write(arena: Arena, payload) -> None:
    """Copy ``payload``'s parts to ``arena`` from offset :data:`HEADER_BYTES`; a part already at
    its place (written there through :meth:`ArenaSender.reserve`) is left as it is."""
    for off, part, src in _placed(payload):
        if src is None:  # the safetensors header: small
            arena.mm[off:off + len(part)] = part
        elif src.data_ptr() != arena.base + off:  # torch copies without holding the GIL
            arena.u8[off:off + src.numel()].copy_(src)


def _in_place(arena: Arena, payload) -> bool:
    """Whether every tensor part of ``payload`` already lies where :func:`_write` would put it
    in ``arena`` (and at least one does)."""
    tensors = [(off, t) for off, _, t in _placed(payload) if t is not None]
    return (bool(tensors) and HEADER_BYTES + payload.nbytes <= arena.size
            and all(t.data_ptr() == arena.base + off for off, t in tensors))


def _make_arena(size: int) -> Arena | None:
    """:func:`new_arena`, or None when the host is short of memory (less than twice ``size``
    available) or the allocation fails."""
    try:
        if psutil.virtual_memory().available < 2 * size:
            return None
        return new_arena(size)
    except (OSError, MemoryError):
        return None
