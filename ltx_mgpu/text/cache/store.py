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
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import threading
import time
import uuid
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Sequence

import torch

from ltx_mgpu.files import check_directory_setting
from ltx_mgpu.text.cache.entry import DamagedEntry, decode_entry, encode_entry
from ltx_mgpu.text.cache.keys import CacheKeyParts, cache_key, default_cache_dir
from ltx_mgpu.text.features import PromptEmbedding

__all__ = [
    "CacheEntryWarning", "CacheReport", "CacheStats", "EmbeddingCache", "encode_cached", "DEFAULT_MAX_BYTES",
    "STALE_TEMP_SECONDS",
]

#: Default bound of the cache's total size, bytes.
DEFAULT_MAX_BYTES = 2 * 1024**3

#: Temp files older than this (seconds) are leftovers of a killed writer; eviction removes them.
STALE_TEMP_SECONDS = 3600.0

_SUFFIX = ".safetensors"
_HEX = frozenset("0123456789abcdef")


class CacheEntryWarning(UserWarning):
    """A cache entry was damaged or did not match its key; it was deleted and will be re-encoded."""


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

    Raises:
        ValueError: ``max_bytes`` is not a positive int.
    """

    def __init__(self, root: str | os.PathLike | None = None, max_bytes: int = DEFAULT_MAX_BYTES) -> None:
        if isinstance(max_bytes, bool) or not isinstance(max_bytes, int) or max_bytes < 1:
            raise ValueError(f"max_bytes must be a positive int (bytes), got {max_bytes!r}")
        self.root = check_directory_setting(root, "cache directory") if root is not None else default_cache_dir()
        self.max_bytes = max_bytes
        self._stats = CacheStats()
        self._lock = threading.Lock()

    def __repr__(self) -> str:
        return f"EmbeddingCache(root={str(self.root)!r}, max_bytes={self.max_bytes})"

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
            or on ``device`` when given; ``None`` on a miss. A damaged entry, or one whose
            metadata does not match the key, is warned about (:class:`CacheEntryWarning`,
            naming the file), deleted and reported as a miss. A hit refreshes the entry's
            access time (mtime) for LRU eviction.
        """
        key = cache_key(prompt, parts)
        path = self.root / key[:2] / f"{key}{_SUFFIX}"
        try:
            with open(path, "rb") as f:
                inode = os.fstat(f.fileno()).st_ino
                data = f.read()
        except FileNotFoundError:
            self._count(misses=1)
            return None
        try:
            embedding = decode_entry(data, key, parts)
        except DamagedEntry as exc:
            self._discard(path, inode, str(exc))
            self._count(misses=1, damaged=1)
            return None
        _touch(path)
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

        Raises:
            TypeError: ``embedding`` is not a :class:`PromptEmbedding`.
            ValueError: the tensor has no data (a ``meta`` tensor).
            OSError: the directory cannot be written (disk full, read-only, ...).
        """
        if not isinstance(embedding, PromptEmbedding):
            raise TypeError(f"embedding must be a PromptEmbedding, got {type(embedding).__name__}")
        key = cache_key(prompt, parts)
        path = self.root / key[:2] / f"{key}{_SUFFIX}"
        payload = encode_entry(key, parts, embedding)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{key}.{os.getpid()}.{threading.get_ident()}.{uuid.uuid4().hex[:12]}.tmp")
        try:
            with open(tmp, "wb") as f:
                f.write(payload)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, path)
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise
        _fsync_dir(path.parent)
        _touch(path)
        self._count(writes=1)
        self._evict(keep=path)
        return path

    def size_bytes(self) -> int:
        """Total size of the entries on disk, bytes (temp files excluded)."""
        return sum(size for _, _, size in self._entries())

    def clear(self) -> None:
        """Delete every entry (and stale temp files of dead writers); counters are kept."""
        for _, path, _ in self._entries():
            path.unlink(missing_ok=True)

    # -- internals ---------------------------------------------------------------------

    def _count(self, **deltas: int) -> None:
        with self._lock:
            for name, delta in deltas.items():
                setattr(self._stats, name, getattr(self._stats, name) + delta)

    def _discard(self, path: Path, inode: int, reason: str) -> None:
        warnings.warn(
            f"ltx_mgpu embedding cache: damaged entry {path} ({reason}); deleted, the prompt will be re-encoded",
            CacheEntryWarning,
            stacklevel=3,
        )
        try:
            # Only delete the file we read: a concurrent writer may have replaced it since.
            if os.stat(path).st_ino == inode:
                path.unlink()
        except FileNotFoundError:
            pass
        except OSError as exc:
            warnings.warn(f"ltx_mgpu embedding cache: could not delete {path}: {exc}", CacheEntryWarning, stacklevel=3)

    def _entries(self) -> list[tuple[int, Path, int]]:
        """``(mtime_ns, path, size_bytes)`` of every entry; removes stale temp files on the way."""
        found: list[tuple[int, Path, int]] = []
        now = time.time()
        try:
            shards = [d for d in os.scandir(self.root) if len(d.name) == 2 and d.is_dir(follow_symlinks=False)]
        except FileNotFoundError:
            return found
        for shard in shards:
            try:
                files = list(os.scandir(shard.path))
            except FileNotFoundError:
                continue
            for entry in files:
                try:
                    st = entry.stat(follow_symlinks=False)
                except FileNotFoundError:
                    continue  # evicted or replaced by another process meanwhile
                name = entry.name
                if name.endswith(".tmp") and name.startswith("."):
                    if now - st.st_mtime > STALE_TEMP_SECONDS:
                        Path(entry.path).unlink(missing_ok=True)
                elif name.endswith(_SUFFIX) and _is_key(name[: -len(_SUFFIX)]):
                    found.append((st.st_mtime_ns, Path(entry.path), st.st_size))
        return found

    def _evict(self, keep: Path) -> None:
        entries = self._entries()
        total = sum(size for _, _, size in entries)
        if total <= self.max_bytes:
            return
        for _, path, size in sorted(entries, key=lambda e: (e[0], e[1].name)):
            if total <= self.max_bytes:
                break
            if path == keep:
                continue
            try:
                path.unlink()
            except FileNotFoundError:
                pass  # another process evicted it first; it no longer counts either way
            else:
                self._count(evictions=1)
            total -= size


def encode_cached(
    cache: EmbeddingCache,
    prompts: Sequence[str],
    parts: CacheKeyParts,
    encode_fn: Callable[[list[str]], Sequence[PromptEmbedding]],
    batch_size: int,
    device: torch.device | str | None = None,
) -> tuple[list[PromptEmbedding], CacheReport]:
    """Embeddings for ``prompts``, encoding only those not cached.

    Every prompt is looked up first; the distinct misses are passed to ``encode_fn`` in
    sub-lists of at most ``batch_size`` prompts, and each sub-batch's results are written
    to the cache as soon as it returns, so an interrupted batch resumes where it stopped.
    ``encode_fn`` is not called at all when every prompt is cached (a lazy encoder never
    loads Gemma). A write that fails (disk full, read-only) is warned about and skipped.

    Args:
        cache: the cache to read and fill.
        prompts: prompts in output order (duplicates are encoded once).
        parts: the key parts of the encoder ``encode_fn`` stands for.
        encode_fn: ``list[str] -> list[PromptEmbedding]``, one result per prompt, in order.
        batch_size: most prompts per ``encode_fn`` call (>= 1).
        device: move every returned tensor there (cache entries stay on CPU).

    Returns:
        ``(embeddings in input order, CacheReport)``: hits as :meth:`EmbeddingCache.get`
        returns them, encoded ones as ``encode_fn`` produced them (moved to ``device`` if
        given); a duplicated prompt maps to the same object.

    Raises:
        ValueError: ``batch_size`` < 1, or ``encode_fn`` returned the wrong number of results.
        TypeError: a prompt is not a str, or ``encode_fn`` returned something other than
            :class:`PromptEmbedding` s.
        Whatever ``encode_fn`` raises (sub-batches finished before it stay cached).
    """
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
        raise ValueError(f"batch_size must be a positive int, got {batch_size!r}")
    for p in prompts:
        if not isinstance(p, str):
            raise TypeError(f"prompts must be strings, got {type(p).__name__}")
    start = time.perf_counter()
    unique = list(dict.fromkeys(prompts))
    found: dict[str, PromptEmbedding] = {}
    for p in unique:
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
            try:
                cache.put(prompt, parts, emb)
            except OSError as exc:
                warnings.warn(f"ltx_mgpu embedding cache: could not write to {cache.root}: {exc}", stacklevel=2)
            found[prompt] = emb if device is None else dataclasses.replace(emb, tensor=emb.tensor.to(device))
    report = CacheReport(
        hits=len(unique) - len(missing), misses=len(missing), encoded=len(missing), seconds=time.perf_counter() - start
    )
    return [found[p] for p in prompts], report


def _is_key(name: str) -> bool:
    return len(name) == 64 and set(name) <= _HEX


def _touch(path: Path) -> None:
    """Set the access/modification time to now (ns resolution) for LRU; best effort."""
    now = time.time_ns()
    with contextlib.suppress(OSError):  # evicted meanwhile, or a read-only cache: LRU order is only a hint
        os.utime(path, ns=(now, now))


def _fsync_dir(directory: Path) -> None:
    """Persist a rename (POSIX); a no-op where directories cannot be opened."""
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)
