"""Which pool a client means: :class:`PoolSpec` (GPU set, ranks, lifetime, runtime directory)
from what a user types (:func:`resolve_spec`).

One pool serves one GPU set. Its runtime directory is ``<base>/<key>``: ``<base>`` is
``runtime_dir`` / ``$LTX_MGPU_RUNTIME_DIR``, else ``$XDG_RUNTIME_DIR/ltx_mgpu``, else
``<ltx_mgpu home>/run`` (:func:`runtime_base`); ``<key>`` is ``gpu-0-1`` or ``cpu-2`` (CPU ranks).
What the directory holds is :mod:`ltx_mgpu.wire.rendezvous`'s.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

from ltx_mgpu import settings
from ltx_mgpu.choices import LIFETIMES
from ltx_mgpu.files import check_directory_setting
from ltx_mgpu.identity import home_dir
from ltx_mgpu.wire.rendezvous import SOCKET_NAME, UNIX_PATH_MAX

__all__ = ["PoolSpec", "runtime_base", "parse_gpus", "resolve_spec"]


@dataclass(frozen=True)
class PoolSpec:
    """Which pool: ``gpus`` are physical CUDA indices (``()`` = CPU ranks on gloo), ``nproc``
    ranks (one per GPU on CUDA), ``lifetime`` and the pool's runtime directory ``dir``."""

    gpus: tuple[int, ...]
    nproc: int
    lifetime: str
    dir: Path

    @property
    def device(self) -> str:
        return "cuda" if self.gpus else "cpu"

    @property
    def key(self) -> str:
        return "gpu-" + "-".join(map(str, self.gpus)) if self.gpus else f"cpu-{self.nproc}"


def runtime_base(runtime_dir: str | os.PathLike | None = None) -> Path:
    """The base directory under which each GPU set gets its pool directory (see module doc).

    Raises:
        ValueError: ``runtime_dir`` or ``$LTX_MGPU_RUNTIME_DIR`` names a file (or a path under one).
    """
    if runtime_dir:
        return check_directory_setting(runtime_dir, "runtime directory").absolute()
    base = settings.RUNTIME_DIR.get()
    if base is not None:
        return base.absolute()
    xdg = os.environ.get("XDG_RUNTIME_DIR")
    if xdg and os.path.isdir(xdg) and os.stat(xdg).st_uid == os.getuid():
        return Path(xdg) / "ltx_mgpu"
    return home_dir() / "run"


def _visible_cuda_ids() -> list[str] | None:
    """The caller's CUDA_VISIBLE_DEVICES as a list (None when unset)."""
    cvd = os.environ.get("CUDA_VISIBLE_DEVICES")
    if cvd is None:
        return None
    return [x.strip() for x in cvd.split(",") if x.strip() and x.strip() != "-1"]


def parse_gpus(gpus: str | Sequence[int] | None) -> tuple[int, ...] | None:
    """``None``/``"all"`` -> None (every visible GPU), ``"cpu"``/``""``/``[]`` -> () (CPU ranks),
    ``"0,1"`` / ``[0, 1]`` -> (0, 1).

    Raises:
        ValueError: not a comma-separated list of distinct non-negative integers.
    """
    if gpus is None or (isinstance(gpus, str) and gpus.strip().lower() == "all"):
        return None
    if isinstance(gpus, str):
        text = gpus.strip().lower()
        if text in ("", "cpu", "none"):
            return ()
        try:
            ids = [int(x) for x in text.split(",") if x.strip()]
        except ValueError:
            raise ValueError(f"gpus must be 'all', 'cpu' or a list like '0,1', got {gpus!r}") from None
    else:
        ids = [int(x) for x in gpus]
    if len(set(ids)) != len(ids) or any(i < 0 for i in ids):
        raise ValueError(f"gpus must be distinct non-negative indices, got {list(ids)}")
    return tuple(ids)


def resolve_spec(gpus: str | Sequence[int] | None = None, nproc: int | None = None,
                 lifetime: str = "with-owner", runtime_dir: str | os.PathLike | None = None) -> PoolSpec:
    """Turn user choices into a :class:`PoolSpec`.

    ``gpus`` are indices as the caller sees them (mapped through its ``CUDA_VISIBLE_DEVICES``);
    ``None`` means every visible GPU, or CPU ranks when torch sees no GPU. ``nproc`` defaults
    to the number of GPUs (1 on CPU) and must equal it on GPUs (one rank per GPU).

    Raises:
        ValueError: bad gpus / nproc / lifetime, or a GPU index the caller cannot see.
    """
    if lifetime not in LIFETIMES:
        raise ValueError(f"lifetime must be one of {LIFETIMES}, got {lifetime!r}")
    ids = parse_gpus(gpus)
    if ids is None:
        import torch  # deferred: the nodes import this module at ComfyUI's start-up

        ids = tuple(range(torch.cuda.device_count())) if torch.cuda.is_available() else ()
    visible = _visible_cuda_ids()
    if ids and visible is not None:
        if max(ids) >= len(visible):
            raise ValueError(f"GPU {max(ids)} is not visible (CUDA_VISIBLE_DEVICES={','.join(visible)})")
        if not all(v.isdigit() for v in visible):
            raise ValueError("CUDA_VISIBLE_DEVICES holds UUIDs; give the pool GPU indices with it unset")
        ids = tuple(int(visible[i]) for i in ids)
    if ids:
        nproc = len(ids) if nproc is None else int(nproc)
        if nproc != len(ids):
            raise ValueError(f"nproc={nproc} but {len(ids)} GPU(s) given: the pool runs one rank per GPU")
    else:
        nproc = 1 if nproc is None else int(nproc)
        if nproc < 1:
            raise ValueError(f"nproc must be >= 1, got {nproc}")
    spec = PoolSpec(ids, nproc, lifetime, Path("."))
    spec = PoolSpec(ids, nproc, lifetime, runtime_base(runtime_dir) / spec.key)
    sock = spec.dir / SOCKET_NAME
    if len(os.fsencode(sock)) > UNIX_PATH_MAX:
        raise ValueError(f"socket path {sock} is longer than {UNIX_PATH_MAX} bytes; pass a shorter "
                         "runtime_dir (--runtime-dir) or set $LTX_MGPU_RUNTIME_DIR")
    return spec
