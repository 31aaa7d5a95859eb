"""Reading the header of a user-named ``.safetensors`` file, with an error that says which file."""

from __future__ import annotations

import os


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
    from safetensors import safe_open

    try:
        with safe_open(os.fspath(path), framework="pt", device="cpu") as f:
            return list(f.keys()), dict(f.metadata() or {})
    except Exception as exc:  # noqa: BLE001 - any header failure means an unreadable file
        raise error(f"{path}: not a readable .safetensors file ({exc}){hint}") from None
