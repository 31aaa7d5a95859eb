"""The client's side of shared-memory frames (``ltx_mgpu.wire.arena``): map the pool's arena, read
``shm`` frames from it and acknowledge them, and take handed-over memory (``shm_own``)."""

from __future__ import annotations

import contextlib
import ctypes
import fcntl
import mmap
import os
import stat
import weakref
from typing import Any, Mapping

import torch

from ltx_mgpu.wire.arena import (
    FLAG_SHM,
    FLAG_SHM_DROP,
    FLAG_SHM_FD,
    HEADER_BYTES,
    SEALS,
    Arena,
    ShmError,
    Take,
    arena_size,
    fits,
)
from ltx_mgpu.wire.payload import PayloadError, parse_payload

__all__ = ["ArenaReceiver"]

_REF_KEYS = {"arena", "seq", "offset", "size"}
_OWN_KEYS = {"own", "offset", "size"}
_libc = ctypes.CDLL(None, use_errno=True)
_libc.mmap.restype = ctypes.c_void_p
_libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
_libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]


def _map_owned(fd: int, length: int) -> torch.Tensor:
    """Map the first ``length`` bytes of ``fd`` (shared, not populated) as a uint8 tensor that
    owns the mapping: it is unmapped when the tensor and every view of it are gone (not at
    interpreter exit, where a view may still be read). The descriptor may be closed right after.
    ``mmap.mmap`` would keep a duplicate descriptor open per mapping for as long as it lives: a
    client keeping hundreds of results would run out of descriptors.

    The mapping is shared (a private writable mapping would be copied page by page when
    written); after the pool has let go no other process maps it, but a child ``fork()`` ed
    while it lives shares it, as with any shared memory. It is not populated: the sender
    allocated every page (``posix_fallocate``) and sealed the size, so a first touch cannot
    fail, and the kernel maps pages on first touch several at a time (fault-around), which costs
    less than populating the mapping up front and then reading it; the cost moves to whoever
    reads the tensors first.

    Raises:
        OSError: ``mmap(2)`` failed (errno).
    """
    addr = _libc.mmap(None, length, mmap.PROT_READ | mmap.PROT_WRITE, mmap.MAP_SHARED, fd, 0)
    if addr in (None, ctypes.c_void_p(-1).value):
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err))
    buf = (ctypes.c_uint8 * length).from_address(addr)
    weakref.finalize(buf, _libc.munmap, addr, length).atexit = False
    return torch.frombuffer(buf, dtype=torch.uint8)



def _check_fd(fd: int) -> int:
    """The size of a received arena descriptor after checking it is a sealed memfd."""
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode):
        raise ShmError("the shared-memory descriptor is not a regular memory file")
    try:
        seals = fcntl.fcntl(fd, fcntl.F_GET_SEALS)
    except OSError:
        raise ShmError("the shared-memory descriptor is not a memfd (it has no seals)") from None
    if seals & SEALS != SEALS:
        raise ShmError("the shared-memory arena is not sealed against resizing")
    if not HEADER_BYTES < st.st_size <= (1 << 40):
        raise ShmError(f"the shared-memory arena has {st.st_size} bytes")
    return st.st_size


def _arena_limit(max_bytes: int) -> int:
    """The largest arena a sender may make for payloads of at most ``max_bytes`` (``ArenaSender``
    rounds the header plus the payload up to whole MiB)."""
    return arena_size(HEADER_BYTES + max_bytes)


def _int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v >= 0


class ArenaReceiver:
    """The client's side: maps the pool's arena, reads ``shm`` frames, acknowledges them.

    ``take`` (:data:`Take`; default: none) chooses per frame between a copy of the payload
    (tensors are views into one private buffer, as from the socket) and a ``receive`` of each
    tensor; a handed-over frame's tensors are views of memory that is this process's from then
    on, never copied. Counters: ``frames``, ``bytes``, ``arenas`` (connection arenas mapped),
    ``owned`` (handed-over frames taken).
    Used by the connection's single reader thread."""

    def __init__(self, take: Take | None = None):
        self.take = take
        self.arena: Arena | None = None
        self.arena_id: int | None = None
        self.seq = 0
        self.frames = self.bytes = self.arenas = self.owned = 0

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
                           "only with, a frame introducing a shared-memory arena or handing memory over)")
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
        if isinstance(ref, dict) and "own" in ref:
            return self._take(ref, fds, header, max_bytes)
        try:
            if not (isinstance(ref, dict) and set(ref) == _REF_KEYS and all(_int(ref[k]) for k in _REF_KEYS)):
                raise ShmError(f"the shm reference must be {{{', '.join(sorted(_REF_KEYS))}}} of non-negative ints, "
                               f"got {ref!r:.200}")
            if len(fds) > 1:
                raise ShmError(f"{len(fds)} descriptors came with one frame (at most one new arena)")
            if fds:
                size = _check_fd(fds[0])
                if size > _arena_limit(max_bytes):  # mapped whole and populated: bounded by what frames may carry
                    raise ShmError(f"the shared-memory arena has {size} bytes, more than a {max_bytes}-byte payload "
                                   "needs")
                try:
                    arena = Arena(fds[0], size)
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

    def _take(self, ref: dict, fds: list[int], header: Mapping[str, Any], max_bytes: int) -> dict[str, torch.Tensor]:
        """The tensors of a handed-over frame: views of its memfd, mapped here and kept by them.

        Raises:
            ShmError: a malformed reference, not exactly one descriptor, a descriptor that is
                not a sealed memfd, a range outside it or a payload that is not safetensors.
        """
        try:
            if not (set(ref) == _OWN_KEYS and ref["own"] is True and _int(ref["offset"]) and _int(ref["size"])):
                raise ShmError(f"a handed-over shm reference must be {{own: true, offset, size}} with non-negative "
                               f"ints, got {ref!r:.200}")
            if len(fds) != 1:
                raise ShmError(f"{len(fds)} descriptors came with a handed-over frame (exactly one belongs to it)")
            size = _check_fd(fds[0])
            off, n = ref["offset"], ref["size"]
            if off < HEADER_BYTES or off % 8 or not 0 < n <= max_bytes or off + n > size:
                raise ShmError(f"bytes [{off}, {off + n}) are not a payload range of the {size}-byte handed-over "
                               f"memory (at most {max_bytes} bytes from offset >= {HEADER_BYTES}, 8-aligned)")
            if not fits(size, off + n):
                raise ShmError(f"{size} bytes of handed-over memory for a {off + n}-byte frame: more than twice "
                               "what it carries")
            try:
                u8 = _map_owned(fds[0], off + n)
            except OSError as e:
                raise ShmError(f"cannot map the {size}-byte handed-over memory: {e}") from None
        finally:
            while fds:
                with contextlib.suppress(OSError):
                    os.close(fds.pop())
        receive = self.take(header) if self.take is not None else None
        try:
            views = parse_payload(u8[off:off + n])
        except PayloadError as e:
            raise ShmError(f"the handed-over payload is not a valid safetensors blob: {e}") from None
        # the views keep the mapping alive; it is unmapped with the last one (_map_owned)
        out = {name: receive(name, view) if receive is not None else view for name, view in views.items()}
        self.owned += 1
        self.frames += 1
        self.bytes += n
        return out

    def drop(self) -> None:
        """Unmap the arena (its memory goes once the pool dropped it too)."""
        if self.arena is not None:
            self.arena.close()
            self.arena, self.arena_id = None, None
