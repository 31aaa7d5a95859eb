"""Files the user names or receives: reading a ``.safetensors`` header (and a JSON value of its
metadata) with an error that says which file, and writing an output atomically."""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path

from safetensors import safe_open


def safetensors_header(path: str | os.PathLike, error: type[Exception] = ValueError,
                       hint: str = "") -> tuple[list[str], dict[str, str]]:
    """Tensor names and string metadata of a ``.safetensors`` file (only the header is read).

    Args:
        path: the file.
        error: the exception class raised for a file that is not readable as safetensors (the
            caller's format error, so its callers catch one type).
        hint: appended to that error's message (what the caller expected instead).

    Raises:
        error: ``"<path>: not a readable .safetensors file (<reason>)<hint>"`` for a damaged,
            truncated or foreign file (safetensors raises its own error types for bad headers).
    """
    try:
        with safe_open(os.fspath(path), framework="pt", device="cpu") as f:
            return list(f.keys()), dict(f.metadata() or {})
    except Exception as exc:  # noqa: BLE001 - any header failure means an unreadable file
        raise error(f"{path}: not a readable .safetensors file ({exc}){hint}") from None


#: The largest JSON metadata value read from a file's header (bytes): a model config is a few KB.
MAX_JSON_METADATA = 1 << 20


def json_metadata(meta: dict[str, str], key: str, where: str, error: type[Exception] = ValueError,
                  hint: str = "", limit: int = MAX_JSON_METADATA) -> dict | None:
    """The JSON object stored under ``key`` in a file's header metadata, or None when absent.

    Args:
        meta: the header's string metadata (:func:`safetensors_header`).
        where: the file, for messages. error, hint: as :func:`safetensors_header`.
        limit: the largest value read, in bytes (UTF-8).
    Raises:
        error: ``"<where>: the '<key>' metadata ..."``: larger than ``limit``, not JSON (nested too
            deeply for Python's parser included), or not a JSON object.
    """
    raw = meta.get(key)
    if raw is None:
        return None
    size = len(raw.encode("utf-8", "surrogatepass"))
    if size > limit:
        raise error(f"{where}: the '{key}' metadata is {size} bytes, more than {limit} (a config is a few KB); the "
                    f"file's header is damaged or not what it claims{hint}")
    try:
        value = json.loads(raw)
    except (ValueError, RecursionError) as e:
        raise error(f"{where}: the '{key}' metadata is not JSON ({type(e).__name__}: {str(e)[:120]}); the file's "
                    f"header is damaged{hint}") from None
    if not isinstance(value, dict):
        raise error(f"{where}: the '{key}' metadata is not a JSON object (got a {type(value).__name__}); the file's "
                    f"header is damaged{hint}")
    return value


def write_atomically(path: str | os.PathLike, data: bytes, *, mode: int | None = None) -> Path:
    """Write ``data`` to ``path`` through a temporary file in the same directory and a rename, so
    that a reader never sees a partial file and an interrupted write leaves none.

    Args:
        mode: the file's permission bits; ``None`` keeps ``mkstemp``'s private 0600
            (:func:`umask_mode` gives what ``open()`` would).

    Returns:
        ``path`` as a ``Path``.

    Raises:
        OSError: the directory does not exist or cannot be written (the temporary file is removed).
    """
    path = Path(path)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        if mode is not None:
            os.fchmod(fd, mode)
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path


def _nearest_existing(path: Path) -> Path:
    """``path`` or its nearest ancestor that exists (the root of a relative path that none does)."""
    while not path.exists() and path != path.parent:
        path = path.parent
    return path


def check_output_path(path: str | os.PathLike, flag: str = "--out") -> Path:
    """Check, before any work, that ``path`` can be created as an output file; missing
    directories are fine (the writer creates them: :func:`make_parent`).

    Returns:
        ``path`` as an absolute ``Path``.

    Raises:
        ValueError: ``"<flag> <path>: ..."``: it is a directory, a component of it is a file,
            or its nearest existing directory is not writable.
    """
    path = Path(path).absolute()
    if path.is_dir():
        raise ValueError(f"{flag} {path}: is a directory; give a file name inside it")
    parent = _nearest_existing(path.parent)
    if not parent.is_dir():
        raise ValueError(f"{flag} {path}: {parent} is a file, not a directory")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise ValueError(f"{flag} {path}: cannot write in {parent} (permissions); choose another place")
    return path


def check_directory_setting(path: str | os.PathLike, what: str) -> Path:
    """Check that a directory setting (a cache, home or runtime directory, made on first use)
    names a directory or a place where one can be made.

    Args:
        what: how the user gave it, for the message (``"--cache"``, ``"$LTX_MGPU_HOME"``...).

    Returns:
        ``path`` as a ``Path`` (``~`` expanded).

    Raises:
        ValueError: ``"<what> <path>: <component> is a file, not a directory; ..."``.
    """
    path = Path(path).expanduser()
    at = _nearest_existing(path)
    if at.exists() and not at.is_dir():
        raise ValueError(f"{what} {path}: {at} is a file, not a directory; give a directory (it is made if missing)")
    return path


def make_parent(path: str | os.PathLike) -> Path:
    """Create ``path``'s directory (and missing parents) and return ``path`` as a ``Path``."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    return path


def umask_mode() -> int:
    """``0o666`` less the process umask: the mode ``open()`` would give a new output file."""
    mask = os.umask(0)
    os.umask(mask)
    return 0o666 & ~mask
