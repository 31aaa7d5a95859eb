"""Content-addressed disk cache of LTX-2 prompt embeddings.

An entry is keyed by a SHA-256 over *every* input that changes the tensor
(:mod:`ltx_mgpu.text.cache.keys`: prompt, Gemma and projection content digests, weights
mode, token budget, dtype, format version).

Entries are safetensors files ``<root>/<key[:2]>/<key>.safetensors`` (their layout, checks
and the bf16 storage of bf16-exact embeddings: :mod:`ltx_mgpu.text.cache.entry`). Writes are atomic
(temp file in the same directory, fsync, ``os.replace``), so concurrent processes never see a partial
entry; a damaged entry (truncated, flipped bytes, foreign file) is reported with a :class:`CacheEntryWarning`,
deleted and treated as a miss, so the caller re-encodes. Tensors are stored on CPU and moved
to the device at use (sdnext PR #4887: cached CPU embeddings reached a CUDA connector).
The total size is bounded by least-recently-used eviction; the access time is the file's
mtime, refreshed on every hit, which every process sharing the directory sees.

What is found in the directory is not trusted to be what the cache wrote. Only regular files of
ours no larger than ``max_entry_bytes`` are read, opened ``O_NOFOLLOW | O_NONBLOCK`` and checked
with ``fstat`` before any read, relative to a shard directory opened ``O_NOFOLLOW``: a FIFO, a
link, a device, a directory, another user's or an oversized file at an entry's path is a miss
with a :class:`CacheEntryWarning`, removed (an empty directory too; never a link's target) and
re-encoded. Nothing is written through a link: temp files are created ``O_EXCL | O_NOFOLLOW``
and renamed within the verified shard directory. A shard directory that is a link, not a
directory or another user's is not ours to replace: it is left alone with a warning, nothing is
read from or written to it, and its prompts are encoded but not cached until it is removed. The
root itself may be a link (it is the user's setting); a root that cannot be read (or that is a
file) is one :class:`CacheDirectoryWarning` naming the setting, and the cache is then bypassed.
Entries are 0600 and the directories the cache makes 0700; a shard or entry of ours with looser
modes (an older version's) is tightened when it is used. An existing root keeps its mode (it may
be a directory shared with other things, such as ``$HOME``): what is inside it is private anyway.
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import os
import stat
import threading
import time
import uuid
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Sequence

import torch

from ltx_mgpu.files import check_directory_setting
from ltx_mgpu.finite import is_finite
from ltx_mgpu.text.cache.entry import DamagedEntry, decode_entry, encode_entry
from ltx_mgpu.text.cache.keys import CacheKeyParts, cache_key, default_cache_dir
from ltx_mgpu.text.features import PromptEmbedding

__all__ = [
    "CacheDirectoryWarning", "CacheEntryWarning", "CacheReport", "CacheStats", "EmbeddingCache", "encode_cached",
    "DEFAULT_MAX_BYTES", "DEFAULT_MAX_ENTRY_BYTES", "STALE_TEMP_SECONDS",
]

#: Default bound of the cache's total size, bytes.
DEFAULT_MAX_BYTES = 2 * 1024**3

#: Default bound of one entry's size, bytes: a file over it is not read (it is no entry the cache
#: wrote: the largest LTX-2 entry at the 1024-token budget is 25 MB, 1024 x 6144 float32), and an
#: embedding whose entry would be over it is not written (``put`` raises ``OSError(EFBIG)``).
DEFAULT_MAX_ENTRY_BYTES = 256 * 1024**2

#: Temp files older than this (seconds) are leftovers of a killed writer; eviction removes them.
STALE_TEMP_SECONDS = 3600.0

_SUFFIX = ".safetensors"
_HEX = frozenset("0123456789abcdef")
_DIR_MODE, _FILE_MODE = 0o700, 0o600
# getattr: the module still imports where these flags do not exist (the nodes load and say why, README)
_NOFOLLOW, _CLOEXEC = getattr(os, "O_NOFOLLOW", 0), getattr(os, "O_CLOEXEC", 0)
_OPEN_DIR = os.O_RDONLY | getattr(os, "O_DIRECTORY", 0) | _CLOEXEC
_OPEN_ENTRY = os.O_RDONLY | _NOFOLLOW | getattr(os, "O_NONBLOCK", 0) | _CLOEXEC  # a FIFO cannot block the open
_CREATE_TEMP = os.O_WRONLY | os.O_CREAT | os.O_EXCL | _NOFOLLOW | _CLOEXEC
_SETTING = "set --cache or $LTX_MGPU_CACHE_DIR to a directory you can read and write, or pass --no-cache"


class CacheEntryWarning(UserWarning):
    """A cache entry was damaged, did not match its key, or was no regular file of ours under the
    size bound (or its shard directory was a link, not a directory or another user's); it was
    not used (removed where that is safe) and the prompt is re-encoded."""


class CacheDirectoryWarning(UserWarning):
    """The cache directory cannot be read (it is a file, or not accessible to this user); the
    cache is bypassed and every prompt is encoded. Given once per :class:`EmbeddingCache`."""


class _RootError(OSError):
    """The cache directory cannot be made or written (the message names the setting)."""


class _Refused(OSError):
    """A shard directory the cache must not use (a link, not a directory, another user's)."""


class _NotAnEntry(Exception):
    """What is at an entry's path cannot be served (``reason``); ``inode`` is what was examined."""

    def __init__(self, reason: str, inode: int) -> None:
        super().__init__(reason)
        self.inode = inode


@dataclass
class CacheStats:
    """Counters of one :class:`EmbeddingCache` object (this process only).

    ``hits``/``misses`` count :meth:`EmbeddingCache.get` lookups (a damaged entry is a miss
    and also counts in ``damaged``); ``writes`` counts entries written; ``evictions`` counts
    entries removed to stay under ``max_bytes``.
    """

    hits: int = 0
    misses: int = 0
    writes: int = 0
    evictions: int = 0
    damaged: int = 0


@dataclass(frozen=True)
class CacheReport:
    """What :func:`encode_cached` did.

    Attributes:
        hits: distinct prompts served from the cache.
        misses: distinct prompts not in the cache.
        encoded: prompts passed to ``encode_fn`` (equals ``misses`` after a full run).
        seconds: wall time of the whole call, seconds.
    """

    hits: int
    misses: int
    encoded: int
    seconds: float

    def __str__(self) -> str:
        total = self.hits + self.misses
        return (
            f"{total} prompt{'s' if total != 1 else ''}: {self.hits} cached, "
            f"{self.encoded} encoded in {self.seconds:.2f} s"
        )


class EmbeddingCache:
    """Disk cache of :class:`PromptEmbedding` s, safe to share between processes.

    Args:
        root: cache directory (created on the first write); ``None`` uses
            :func:`default_cache_dir`.
        max_bytes: bound of the total size of the entries, bytes. After each write the
            least recently used entries are deleted until the total fits; the entry just
            written is never evicted (so one entry larger than the bound still persists).
        max_entry_bytes: bound of one entry, bytes (:data:`DEFAULT_MAX_ENTRY_BYTES`): a larger
            file at an entry's path is not read, a larger entry is not written.

    Raises:
        ValueError: ``max_bytes`` or ``max_entry_bytes`` is not a positive int; ``root`` is a
            file (the message names the setting).
    """

    def __init__(self, root: str | os.PathLike | None = None, max_bytes: int = DEFAULT_MAX_BYTES,
                 max_entry_bytes: int = DEFAULT_MAX_ENTRY_BYTES) -> None:
        for name, value in (("max_bytes", max_bytes), ("max_entry_bytes", max_entry_bytes)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive int (bytes), got {value!r}")
        self.root = check_directory_setting(root, "cache directory") if root is not None else default_cache_dir()
        self.max_bytes = max_bytes
        self.max_entry_bytes = max_entry_bytes
        self._stats = CacheStats()
        self._lock = threading.Lock()
        self._root_warned = False

    def __repr__(self) -> str:
        return (f"EmbeddingCache(root={str(self.root)!r}, max_bytes={self.max_bytes}, "
                f"max_entry_bytes={self.max_entry_bytes})")

    @property
    def stats(self) -> CacheStats:
        """A snapshot of this object's counters."""
        with self._lock:
            return dataclasses.replace(self._stats)

    def path_for(self, prompt: str, parts: CacheKeyParts) -> Path:
        """The entry file of ``prompt`` under ``parts`` (whether or not it exists)."""
        key = cache_key(prompt, parts)
        return self.root / key[:2] / f"{key}{_SUFFIX}"

    def get(
        self, prompt: str, parts: CacheKeyParts, device: torch.device | str | None = None
    ) -> PromptEmbedding | None:
        """Look up one prompt.

        Returns:
            The embedding (tensor ``[T, D]`` float32 as it was put, owning its memory) on CPU,
            or on ``device`` when given; ``None`` on a miss. Never blocks on, nor reads more than
            ``max_entry_bytes`` of, what is at the entry's path. A damaged entry, one whose
            metadata does not match the key, or anything that is not a regular file of ours
            under the size bound (a FIFO, a link, a directory...) is warned about
            (:class:`CacheEntryWarning`, naming the file), removed (never a link's target) and
            reported as a miss; so is an entry in a shard directory that is a link, not a
            directory or another user's (left alone). A cache directory that cannot be read is
            a miss and one :class:`CacheDirectoryWarning`. A hit refreshes the entry's access
            time (mtime) for LRU eviction, and makes a looser entry or shard of ours private.
        """
        key = cache_key(prompt, parts)
        shard, name = key[:2], f"{key}{_SUFFIX}"
        path = self.root / shard / name
        try:
            sfd = self._open_shard(shard, create=False)
        except FileNotFoundError:
            self._count(misses=1)
            return None
        except _Refused as exc:
            warnings.warn(f"ltx_mgpu embedding cache: {exc}; not used, the prompt will be re-encoded",
                          CacheEntryWarning, stacklevel=2)
            self._count(misses=1, damaged=1)
            return None
        except OSError as exc:
            self._warn_root(_root_reason(exc))
            self._count(misses=1)
            return None
        try:
            embedding = self._read(sfd, name, key, parts)
        except _NotAnEntry as exc:
            self._discard(sfd, name, path, exc)
            self._count(misses=1, damaged=1)
            return None
        finally:
            os.close(sfd)
        if embedding is None:
            self._count(misses=1)
            return None
        self._count(hits=1)
        if device is not None:
            embedding = dataclasses.replace(embedding, tensor=embedding.tensor.to(device))
        return embedding

    def get_many(
        self, prompts: Sequence[str], parts: CacheKeyParts, device: torch.device | str | None = None
    ) -> list[PromptEmbedding | None]:
        """:meth:`get` for each prompt, in order (``None`` for each miss)."""
        return [self.get(p, parts, device) for p in prompts]

    def put(self, prompt: str, parts: CacheKeyParts, embedding: PromptEmbedding) -> Path:
        """Store one embedding atomically and enforce ``max_bytes``; returns the entry path.

        The tensor is copied to a contiguous CPU tensor of its own (never a view into a
        batch tensor), so the file holds exactly this prompt's ``[T, D]`` rows. Two writers
        of one key both complete and the last rename wins; readers never see a partial file.
        The entry is 0600 and the directories made for it 0700; nothing is written through a
        link (a link at the entry's path is replaced, not followed).

        Raises:
            TypeError: ``embedding`` is not a :class:`PromptEmbedding`.
            ValueError: the tensor has no data (a ``meta`` tensor), or holds NaN or infinite
                values (names the prompt; :func:`encode_cached` lets it through: never cached,
                never returned).
            OSError: the directory cannot be written (disk full, read-only, ...; a cache
                directory that is not usable names the setting); the shard directory is a
                link, not a directory or another user's (left alone); a directory is at the
                entry's path; the entry would be over ``max_entry_bytes`` (``errno.EFBIG``).
        """
        if not isinstance(embedding, PromptEmbedding):
            raise TypeError(f"embedding must be a PromptEmbedding, got {type(embedding).__name__}")
        key = cache_key(prompt, parts)
        shard, name = key[:2], f"{key}{_SUFFIX}"
        try:
            payload = encode_entry(key, parts, embedding)
        except ValueError as e:
            raise ValueError(f"prompt {prompt!r:.60}: {e}") from None
        if len(payload) > self.max_entry_bytes:
            raise OSError(errno.EFBIG, f"the entry is {len(payload)} bytes, over the per-entry limit of "
                                       f"{self.max_entry_bytes} bytes (max_entry_bytes); not written")
        try:
            self.root.mkdir(mode=_DIR_MODE, parents=True, exist_ok=True)
            sfd = self._open_shard(shard, create=True)
        except _Refused:
            raise
        except OSError as exc:
            raise _RootError(exc.errno, f"the cache directory {self.root} {_root_reason(exc)} ({_SETTING})") from None
        try:
            tmp = f".{key}.{os.getpid()}.{threading.get_ident()}.{uuid.uuid4().hex[:12]}.tmp"
            fd = os.open(tmp, _CREATE_TEMP, _FILE_MODE, dir_fd=sfd)
            try:
                try:
                    _write_all(fd, payload)
                    os.fsync(fd)
                    _touch(fd)
                finally:
                    os.close(fd)
                os.replace(tmp, name, src_dir_fd=sfd, dst_dir_fd=sfd)  # a link at `name` is replaced, not followed
            except BaseException:
                with contextlib.suppress(OSError):
                    os.unlink(tmp, dir_fd=sfd)
                raise
            with contextlib.suppress(OSError):  # persist the rename (POSIX)
                os.fsync(sfd)
        finally:
            os.close(sfd)
        self._count(writes=1)
        self._evict(keep=(shard, name))
        return self.root / shard / name

    def size_bytes(self) -> int:
        """Total size of the entries on disk, bytes (regular files named as entries, in shard
        directories of ours; temp files excluded)."""
        return sum(size for _, _, _, size in self._entries())

    def clear(self) -> None:
        """Delete every entry (and stale temp files of dead writers); counters are kept. Shard
        directories that are links or another user's are left alone."""
        for _, shard, name, _ in self._entries():
            self._remove(shard, name)

    def unusable_reason(self) -> str | None:
        """Why the cache directory cannot be read (``"is not a directory ..."``, ``"is not
        accessible ..."``), or ``None`` when it can, or does not exist yet (the first write
        makes it)."""
        try:
            fd = os.open(self.root, _OPEN_DIR)
        except FileNotFoundError:
            return None
        except OSError as exc:
            return _root_reason(exc)
        os.close(fd)
        if not os.access(self.root, os.R_OK | os.X_OK):
            return "is not accessible to you (permission denied)"
        return None

    # -- internals ---------------------------------------------------------------------

    def _count(self, **deltas: int) -> None:
        with self._lock:
            for name, delta in deltas.items():
                setattr(self._stats, name, getattr(self._stats, name) + delta)

    def _warn_root(self, reason: str, stacklevel: int = 2) -> None:
        """One :class:`CacheDirectoryWarning` per cache object, naming the setting (``stacklevel``
        as seen from the caller: 2 points at the caller's caller)."""
        with self._lock:
            if self._root_warned:
                return
            self._root_warned = True
        warnings.warn(f"ltx_mgpu embedding cache: the cache directory {self.root} {reason}; the cache is not used "
                      f"and every prompt is encoded ({_SETTING})", CacheDirectoryWarning, stacklevel=stacklevel + 1)

    def _open_shard(self, shard: str, create: bool, root_fd: int | None = None) -> int:
        """A descriptor of the shard directory ``shard``, opened ``O_NOFOLLOW`` in the root (itself
        followed if a link: it is the user's setting); made 0700 if ``create`` and absent, and
        tightened to owner-only if it is ours and looser.

        Raises:
            FileNotFoundError: the root or (unless ``create``) the shard does not exist.
            _Refused: the shard is a link, not a directory, not openable, or another user's.
            OSError: the root cannot be opened (or written, to make the shard).
        """
        rfd = os.open(self.root, _OPEN_DIR) if root_fd is None else root_fd
        try:
            if create:
                with contextlib.suppress(FileExistsError):
                    os.mkdir(shard, _DIR_MODE, dir_fd=rfd)
            try:
                sfd = os.open(shard, _OPEN_DIR | _NOFOLLOW, dir_fd=rfd)
            except FileNotFoundError:
                raise
            except OSError as exc:
                raise _Refused(exc.errno, f"shard directory {self.root / shard} {_describe(rfd, shard, exc)}") from None
        finally:
            if root_fd is None:
                os.close(rfd)
        st = os.fstat(sfd)
        if st.st_uid != os.getuid():
            os.close(sfd)
            raise _Refused(errno.EPERM, f"shard directory {self.root / shard} belongs to uid {st.st_uid}, not to you")
        if st.st_mode & 0o077:  # ours, from an older version: make it private
            with contextlib.suppress(OSError):
                os.fchmod(sfd, stat.S_IMODE(st.st_mode) & _DIR_MODE)
        return sfd

    def _read(self, sfd: int, name: str, key: str, parts: CacheKeyParts) -> PromptEmbedding | None:
        """The entry ``name`` of the shard ``sfd``, ``None`` if absent.

        Raises:
            _NotAnEntry: anything but a valid entry: not a regular file of ours (``lstat`` before
                the open, ``fstat`` after it), over ``max_entry_bytes``, unreadable, damaged.
        """
        try:
            st = os.stat(name, dir_fd=sfd, follow_symlinks=False)
        except FileNotFoundError:
            return None
        except OSError as exc:
            raise _NotAnEntry(f"cannot be examined: {exc.strerror}", -1) from None
        _check_entry(st, self.max_entry_bytes)  # a FIFO or a device is never even opened
        try:
            fd = os.open(name, _OPEN_ENTRY, dir_fd=sfd)
        except FileNotFoundError:
            return None  # evicted or replaced by another process meanwhile
        except OSError as exc:
            raise _NotAnEntry(f"cannot be opened: {exc.strerror}", st.st_ino) from None
        try:
            st = os.fstat(fd)  # what was opened, if it was swapped after the lstat
            _check_entry(st, self.max_entry_bytes)
            try:
                data = _read_at_most(fd, st.st_size + 1)
            except OSError as exc:
                raise _NotAnEntry(f"cannot be read: {exc.strerror}", st.st_ino) from None
            if len(data) != st.st_size:
                raise _NotAnEntry(f"changed size while being read ({st.st_size} bytes, read {len(data)})", st.st_ino)
            try:
                embedding = decode_entry(data, key, parts)
            except DamagedEntry as exc:
                raise _NotAnEntry(str(exc), st.st_ino) from None
            if st.st_mode & 0o077:  # ours (checked), from an older version: make it private
                with contextlib.suppress(OSError):
                    os.fchmod(fd, stat.S_IMODE(st.st_mode) & _FILE_MODE)
            _touch(fd)
        finally:
            os.close(fd)
        return embedding

    def _discard(self, sfd: int, name: str, path: Path, exc: _NotAnEntry) -> None:
        warnings.warn(
            f"ltx_mgpu embedding cache: bad entry {path} ({exc}); removed, the prompt will be re-encoded",
            CacheEntryWarning,
            stacklevel=3,
        )
        try:
            st = os.stat(name, dir_fd=sfd, follow_symlinks=False)
            # Only remove what we examined: a concurrent writer may have replaced it since. A link
            # is removed itself (never its target); a directory only if empty.
            if st.st_ino == exc.inode:
                (os.rmdir if stat.S_ISDIR(st.st_mode) else os.unlink)(name, dir_fd=sfd)
        except FileNotFoundError:
            pass
        except OSError as err:
            warnings.warn(f"ltx_mgpu embedding cache: could not remove {path}: {err.strerror}", CacheEntryWarning,
                          stacklevel=3)

    def _entries(self) -> list[tuple[int, str, str, int]]:
        """``(mtime_ns, shard, name, size_bytes)`` of every entry (regular files named as entries in
        shard directories of ours; links not followed); removes stale temp files on the way."""
        found: list[tuple[int, str, str, int]] = []
        now = time.time()
        try:
            rfd = os.open(self.root, _OPEN_DIR)
        except OSError:
            return found  # absent (nothing stored) or unusable (get and put say so)
        try:
            with os.scandir(rfd) as it:
                shards = [d.name for d in it
                          if len(d.name) == 2 and set(d.name) <= _HEX and d.is_dir(follow_symlinks=False)]
            for shard in shards:
                try:
                    sfd = self._open_shard(shard, create=False, root_fd=rfd)
                except OSError:
                    continue  # removed meanwhile, or not ours to touch
                try:
                    with os.scandir(sfd) as it:
                        files = list(it)
                    for entry in files:
                        try:
                            st = entry.stat(follow_symlinks=False)
                        except FileNotFoundError:
                            continue  # evicted or replaced by another process meanwhile
                        name = entry.name
                        if name.endswith(".tmp") and name.startswith("."):
                            if now - st.st_mtime > STALE_TEMP_SECONDS and not stat.S_ISDIR(st.st_mode):
                                with contextlib.suppress(OSError):
                                    os.unlink(name, dir_fd=sfd)
                        elif stat.S_ISREG(st.st_mode) and name.endswith(_SUFFIX) and _is_key(name[: -len(_SUFFIX)]):
                            found.append((st.st_mtime_ns, shard, name, st.st_size))
                finally:
                    os.close(sfd)
        finally:
            os.close(rfd)
        return found

    def _remove(self, shard: str, name: str) -> bool:
        """Unlink entry ``name`` of ``shard`` (through the shard opened ``O_NOFOLLOW``); whether it was there."""
        try:
            sfd = self._open_shard(shard, create=False)
        except OSError:
            return False
        try:
            os.unlink(name, dir_fd=sfd)
        except FileNotFoundError:
            return False  # another process removed it first
        finally:
            os.close(sfd)
        return True

    def _evict(self, keep: tuple[str, str]) -> None:
        entries = self._entries()
        total = sum(size for _, _, _, size in entries)
        if total <= self.max_bytes:
            return
        for _, shard, name, size in sorted(entries, key=lambda e: (e[0], e[2])):
            if total <= self.max_bytes:
                break
            if (shard, name) == keep:
                continue
            if self._remove(shard, name):
                self._count(evictions=1)
            total -= size  # removed by us or by another process: it no longer counts either way


def encode_cached(
    cache: EmbeddingCache,
    prompts: Sequence[str],
    parts: CacheKeyParts,
    encode_fn: Callable[[list[str]], Sequence[PromptEmbedding]],
    batch_size: int,
    device: torch.device | str | None = None,
    short: CacheKeyParts | None = None,
) -> tuple[list[PromptEmbedding], CacheReport]:
    """Embeddings for ``prompts``, encoding only those not cached.

    Every prompt is looked up first; the distinct misses are passed to ``encode_fn`` in
    sub-lists of at most ``batch_size`` prompts, and each sub-batch's results are written
    to the cache as soon as it returns, so an interrupted batch resumes where it stopped.
    ``encode_fn`` is not called at all when every prompt is cached (a lazy encoder never
    loads Gemma). A write that fails (disk full, read-only, a shard directory that is not ours)
    is warned about and skipped; one that fails because the cache directory cannot be made or
    written is warned about once, and no other write of this call is tried. A cache directory
    that cannot be read is one :class:`CacheDirectoryWarning` (naming the setting) and the
    cache is bypassed: every prompt is encoded, nothing is read or written.

    Args:
        cache: the cache to read and fill.
        prompts: prompts in output order (duplicates are encoded once).
        parts: the key parts of the encoder ``encode_fn`` stands for.
        encode_fn: ``list[str] -> list[PromptEmbedding]``, one result per prompt, in order.
        batch_size: most prompts per ``encode_fn`` call (>= 1).
        device: move every returned tensor there (cache entries stay on CPU).
        short: with ``parts`` describing an encoder that truncates nothing up to its budget
            (prompts encoded whole), the parts of the same encoder at a smaller budget. A prompt
            that fits the smaller budget has the same embedding under both, so it is looked up
            and stored under ``short`` (an entry there that dropped tokens is passed over), and
            entries are shared with the truncating encoder; a longer prompt under ``parts``.

    Returns:
        ``(embeddings in input order, CacheReport)``: hits as :meth:`EmbeddingCache.get`
        returns them, encoded ones as ``encode_fn`` produced them (moved to ``device`` if
        given); a duplicated prompt maps to the same object.

    Raises:
        ValueError: ``batch_size`` < 1, or ``encode_fn`` returned the wrong number of results.
        TypeError: ``encode_fn`` returned something other than :class:`PromptEmbedding` s.
        Whatever ``encode_fn`` raises (sub-batches finished before it stay cached).
        ValueError: an embedding ``encode_fn`` returned holds NaN or infinite values (checked
            before anything of its sub-batch is stored: never cached, never returned).
    """
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
        raise ValueError(f"batch_size must be a positive int, got {batch_size!r}")
    start = time.perf_counter()
    unique = list(dict.fromkeys(prompts))
    found: dict[str, PromptEmbedding] = {}
    reason = cache.unusable_reason()
    if reason is not None:
        cache._warn_root(reason)  # this module's own class
    writable = reason is None
    for p in unique if reason is None else ():
        hit = cache.get(p, short, device) if short is not None else None
        if hit is None or hit.dropped_tokens:
            hit = cache.get(p, parts, device)
        if hit is not None:
            found[p] = hit
    missing = [p for p in unique if p not in found]
    for i in range(0, len(missing), batch_size):
        chunk = missing[i : i + batch_size]
        results = list(encode_fn(list(chunk)))
        if len(results) != len(chunk):
            raise ValueError(f"encode_fn returned {len(results)} embeddings for {len(chunk)} prompts")
        for prompt, emb in zip(chunk, results):
            if not isinstance(emb, PromptEmbedding):
                raise TypeError(f"encode_fn must return PromptEmbedding objects, got {type(emb).__name__}")
            if emb.tensor.device.type != "meta" and not is_finite(emb.tensor):
                raise ValueError(f"the embedding of prompt {prompt!r:.60} holds NaN or infinite values; nothing of "
                                 "it is cached or returned (the text encoder's weights are damaged or overflow in "
                                 "its dtype: load them again, or encode in bfloat16 or float32)")
        for prompt, emb in zip(chunk, results):
            try:
                if writable:
                    fits = short is not None and not emb.dropped_tokens and emb.num_tokens <= short.token_budget
                    cache.put(prompt, short if fits else parts, emb)
            except _RootError as exc:
                warnings.warn(f"ltx_mgpu embedding cache: could not write: {exc}; not caching", stacklevel=2)
                writable = False
            except OSError as exc:
                warnings.warn(f"ltx_mgpu embedding cache: could not write to {cache.root}: {exc}", stacklevel=2)
            found[prompt] = emb if device is None else dataclasses.replace(emb, tensor=emb.tensor.to(device))
    report = CacheReport(
        hits=len(unique) - len(missing), misses=len(missing), encoded=len(missing), seconds=time.perf_counter() - start
    )
    return [found[p] for p in prompts], report


def _is_key(name: str) -> bool:
    return len(name) == 64 and set(name) <= _HEX


def _root_reason(exc: OSError) -> str:
    """What is wrong with the cache root, from the error of opening (or making) it."""
    if exc.errno in (errno.ENOTDIR, errno.EEXIST):
        return "is not a directory (it, or a directory above it, is a file)"
    if exc.errno in (errno.EACCES, errno.EPERM):
        return "is not accessible to you (permission denied)"
    return f"cannot be used ({exc.strerror or exc})"


def _describe(dir_fd: int, name: str, exc: OSError) -> str:
    """Why ``name`` (in ``dir_fd``) could not be opened as a directory without following a link."""
    try:
        st = os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
    except OSError:
        return f"cannot be opened ({exc.strerror})"
    if stat.S_ISLNK(st.st_mode):
        return "is a symbolic link, not a directory of the cache (not followed; remove it)"
    if not stat.S_ISDIR(st.st_mode):
        return f"is {_kind(st.st_mode)}, not a directory (remove it)"
    return f"cannot be opened ({exc.strerror})"


_KINDS = ((stat.S_ISREG, "a regular file"), (stat.S_ISLNK, "a symbolic link"), (stat.S_ISDIR, "a directory"),
          (stat.S_ISFIFO, "a FIFO"), (stat.S_ISSOCK, "a socket"), (stat.S_ISCHR, "a character device"),
          (stat.S_ISBLK, "a block device"))


def _kind(mode: int) -> str:
    """``"a FIFO"``, ``"a directory"``... for a ``st_mode``."""
    for test, what in _KINDS:
        if test(mode):
            return what
    return f"of type {stat.S_IFMT(mode):o}"


def _check_entry(st: os.stat_result, limit: int) -> None:
    """Raise :class:`_NotAnEntry` unless ``st`` is a regular file of ours of at most ``limit`` bytes."""
    if not stat.S_ISREG(st.st_mode):
        raise _NotAnEntry(f"{_kind(st.st_mode)}, not a regular file", st.st_ino)
    if st.st_uid != os.getuid():
        raise _NotAnEntry(f"belongs to uid {st.st_uid}, not to you", st.st_ino)
    if st.st_size > limit:
        raise _NotAnEntry(f"{st.st_size} bytes, over the per-entry limit of {limit} bytes (max_entry_bytes)",
                          st.st_ino)


def _read_at_most(fd: int, n: int) -> bytes:
    """Up to ``n`` bytes of ``fd`` (fewer at end of file)."""
    chunks = []
    while n > 0:
        chunk = os.read(fd, min(n, 1 << 30))
        if not chunk:
            break
        chunks.append(chunk)
        n -= len(chunk)
    return b"".join(chunks)


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view):]


def _touch(fd: int) -> None:
    """Set the access/modification time of an open file to now (ns resolution) for LRU; best effort."""
    now = time.time_ns()
    with contextlib.suppress(OSError):  # a read-only cache: LRU order is only a hint
        os.utime(fd, ns=(now, now))
