"""Where the embedded models are built: a versioned cache directory, each model written atomically."""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path
from typing import Callable

from ltx_mgpu.identity import home_dir

__all__ = ["ASSETS_VERSION", "DEFAULT_SEED", "assets_dir", "ensure"]

#: Bump when any generator changes its output, so stale caches are not reused.
ASSETS_VERSION = 3
#: The default seed of every generator.
DEFAULT_SEED = 0


def assets_dir(root: str | os.PathLike | None = None) -> Path:
    """Where the embedded models live: ``root`` or ``<ltx_mgpu home>/assets/v<N>``."""
    if root is not None:
        return Path(root)
    return home_dir() / "assets" / f"v{ASSETS_VERSION}"


def ensure(target: Path, build: Callable[[Path], None]) -> Path:
    """Build ``target`` (a file or directory) atomically if it is missing.

    ``build`` writes into a temporary sibling path; it is renamed into place only when
    complete, so an interrupted build never leaves something that looks valid.
    """
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp_root = Path(tempfile.mkdtemp(prefix=f".{target.name}.", dir=target.parent))
    try:
        tmp = tmp_root / target.name
        build(tmp)
        try:
            os.replace(tmp, target)
        except OSError:
            if not target.exists():  # a concurrent builder won the race: keep theirs
                raise
    finally:
        shutil.rmtree(tmp_root, ignore_errors=True)
    return target
