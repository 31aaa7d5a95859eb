"""Content identities (digests) of model weights, memoised so they are computed once.

Cache keys must change when the *content* of the weights changes, not only their path
(a public report: a prompt-keyed cache returned stale embeddings after the encoder or its
precision changed). Digests are SHA-256 over the bytes; the memo maps a file's
``(realpath, size, mtime_ns, inode)`` to its digest in a small JSON file under the
ltx_mgpu home directory, so a multi-GB Gemma is hashed once per version of the file.
"""

from __future__ import annotations

import hashlib
import json
import os
import threading
from pathlib import Path
from typing import Callable, Iterable, Mapping

import torch

_CHUNK = 16 * 1024 * 1024
_LOCK = threading.Lock()
_MEMORY: dict[str, str] = {}


def home_dir() -> Path:
    """ltx_mgpu's per-user state directory: ``$LTX_MGPU_HOME`` or ``$XDG_CACHE_HOME/ltx_mgpu``
    (``~/.cache/ltx_mgpu``)."""
    env = os.environ.get("LTX_MGPU_HOME")
    if env:
        return Path(env).expanduser()
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
        with open(tmp, "w", encoding="utf-8") as f:
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
