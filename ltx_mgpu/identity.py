"""Content identities (digests) of model weights, memoised so they are computed once.

Cache keys must change when the *content* of the weights changes, not only their path
(a public report: a prompt-keyed cache returned stale embeddings after the encoder or its
precision changed). Digests are SHA-256 over the bytes; the memo maps a file's
``(realpath, size, mtime_ns, inode)`` to its digest in a small JSON file under the
ltx_mgpu home directory (``digests.json``, mode 0600 like the embedding cache), so a multi-GB
Gemma is hashed once per version of the file.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import stat
import threading
import time
from pathlib import Path
from typing import Callable, Hashable, Iterable, Mapping, Sequence, TypeVar

import torch

from ltx_mgpu import settings

_CHUNK = 16 * 1024 * 1024
_LOCK = threading.Lock()
_MEMORY: dict[str, str] = {}
_BY_STATS: dict[Hashable, tuple[tuple, object]] = {}
#: A file modified less than this many seconds before its signature was taken may change again
#: within the same mtime tick unseen (the "racy" case of any stat-based check), so a value
#: computed from it is not memoised by :func:`memoized_by_stats`.
RACY_SECONDS = 2.0
T = TypeVar("T")


def home_dir() -> Path:
    """ltx_mgpu's per-user state directory: ``$LTX_MGPU_HOME`` or ``$XDG_CACHE_HOME/ltx_mgpu``
    (``~/.cache/ltx_mgpu``).

    Raises:
        ValueError: ``$LTX_MGPU_HOME`` names a file (or a path under one).
    """
    home = settings.HOME.get()
    if home is not None:
        return home
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "ltx_mgpu"


def _memo_path() -> Path:
    return home_dir() / "digests.json"


def _stat_key(path: str) -> str:
    st = os.stat(path)
    return f"{os.path.realpath(path)}|{st.st_size}|{st.st_mtime_ns}|{st.st_ino}"


def _load_memo() -> dict[str, str]:
    try:
        with open(_memo_path(), encoding="utf-8") as f:
            data = json.load(f)
        return data if isinstance(data, dict) else {}
    except (OSError, ValueError):
        return {}


def _store_memo(key: str, digest: str) -> None:
    path = _memo_path()
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        data = _load_memo()
        data[key] = digest
        tmp = path.with_name(f".{path.name}.{os.getpid()}.{threading.get_ident()}.tmp")
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        # 0600 like the embedding cache: the paths of a user's models are nobody else's business
        with os.fdopen(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600), "w",
                       encoding="utf-8") as f:
            json.dump(data, f)
        os.replace(tmp, path)
    except OSError:
        pass  # the memo is an optimisation; a read-only home only costs re-hashing


def memoized_digest(path: str | os.PathLike, label: str, compute: Callable[[], str]) -> str:
    """Return ``compute()`` for ``path``, memoised (in memory and on disk) by the file's stat
    signature and ``label``, so expensive content digests run once per version of a file.

    Raises:
        FileNotFoundError: the file does not exist.
    """
    path = os.fspath(path)
    key = f"{label}|{_stat_key(path)}"
    with _LOCK:
        if key in _MEMORY:
            return _MEMORY[key]
    digest = _load_memo().get(key)
    if digest is None:
        digest = compute()
        _store_memo(key, digest)
    with _LOCK:
        _MEMORY[key] = digest
    return digest


def file_digest(path: str | os.PathLike) -> str:
    """SHA-256 (hex) of a file's bytes, memoised by its stat signature.

    Raises:
        FileNotFoundError: the file does not exist.
    """

    def compute() -> str:
        h = hashlib.sha256()
        with open(path, "rb") as f:
            while chunk := f.read(_CHUNK):
                h.update(chunk)
        return h.hexdigest()

    return memoized_digest(path, "sha256", compute)


def files_digest(paths: Iterable[str | os.PathLike], root: str | os.PathLike | None = None) -> str:
    """Digest of several files (e.g. a snapshot directory's weights and tokenizer), combining
    each file's name relative to ``root`` with its :func:`file_digest`; order-independent."""
    h = hashlib.sha256()
    items = []
    for p in paths:
        name = os.path.relpath(p, root) if root is not None else os.path.basename(p)
        items.append((name, file_digest(p)))
    for name, digest in sorted(items):
        h.update(f"{name}\0{digest}\n".encode())
    return h.hexdigest()


def tensors_digest(tensors: Mapping[str, torch.Tensor], extra: str = "") -> str:
    """SHA-256 of named tensors' names, dtypes, shapes and bytes (sorted by name)."""
    h = hashlib.sha256(extra.encode())
    for name in sorted(tensors):
        t = tensors[name].detach().contiguous().cpu()
        h.update(f"\0{name}\0{t.dtype}\0{tuple(t.shape)}\0".encode())
        h.update(t.view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return h.hexdigest()


def stat_signature(paths: Iterable[str | os.PathLike]) -> tuple:
    """``(path, device, inode, size, mtime_ns, is_file)`` of each path, and of the directory of
    each path that is a file (deduplicated, in order); a path that does not exist gives
    ``(path, None)``. A file rewritten or replaced, a file added or removed beside one, or a
    named directory's entries changing, changes it. One ``stat`` per entry (no reads, no
    ``realpath``). A directory's mtime changes when entries are added, removed or renamed in it,
    not below it: name every directory whose listing matters."""
    entries: dict[str, tuple] = {}
    for p in paths:
        p = os.fspath(p)
        if p not in entries:
            entries[p] = entry = _entry(p)
            if len(entry) > 2 and entry[5]:
                parent = os.path.dirname(p) or "."
                if parent not in entries:
                    entries[parent] = _entry(parent)
    return tuple(entries.values())


def _entry(path: str) -> tuple:
    try:
        st = os.stat(path)
    except FileNotFoundError:
        return path, None
    return path, st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, stat.S_ISREG(st.st_mode)


def memoized_by_stats(key: Hashable, watched: Callable[[], Sequence[str | os.PathLike]],
                      compute: Callable[[Sequence[str | os.PathLike]], T]) -> T:
    """``compute(watched())``'s value, memoised in memory under ``key`` while the watched paths
    are unchanged. ``watched()`` lists, cheaply (names only), every file whose bytes the value
    depends on and every directory whose listing it depends on (missing paths allowed); a later
    call re-stats them (:func:`stat_signature`, one ``stat`` per path) instead of recomputing.
    Used where a per-request cost matters: the text encoder's cache key is asked for on every
    prompt (format detection, safetensors header parsing and per-file digest lookups cost far
    more than the stats).

    The value is kept only when the listing and its signature are the same before and after
    ``compute`` (nothing was replaced meanwhile: hashing a new Gemma takes minutes) and no
    entry was modified within :data:`RACY_SECONDS` (a later change in the same mtime tick
    would go unseen).

    Raises:
        Whatever ``watched`` or ``compute`` raise (nothing is memoised then).
    """
    with _LOCK:
        hit = _BY_STATS.get(key)
    if hit is not None:
        signature, value = hit
        if all(_entry(entry[0]) == entry for entry in signature):
            return value  # type: ignore[return-value]
    files = list(watched())
    before = stat_signature(files)
    value = compute(files)
    after = stat_signature(watched())
    now = time.time_ns()
    if after == before and all(now - e[4] > RACY_SECONDS * 1e9 for e in after if e[1] is not None):
        with _LOCK:
            _BY_STATS[key] = (after, value)
    return value
