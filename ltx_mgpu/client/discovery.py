"""Finding, inspecting and freeing pools without starting one: what the ComfyUI nodes (the panel,
Pool Status, Free Pool Memory) and the CLI (``pool status``, ``pool stop``) share.

Every function here only observes: a status-only client (``start=False``) is kept per pool
directory, and nothing starts a pool.
"""

from __future__ import annotations

import logging
import os
import threading
from pathlib import Path

from ltx_mgpu.client import launch
from ltx_mgpu.client.pool_client import PoolClient
from ltx_mgpu.client.spec import PoolSpec, runtime_base
from ltx_mgpu.wire.rendezvous import INFO_NAME, PoolInfo, check_private_dir

__all__ = ["live_pools", "spec_of", "pool_status", "free_pool", "format_status"]

log = logging.getLogger(__name__)

_OBSERVERS: dict[str, PoolClient] = {}
_LOCK = threading.Lock()


def live_pools(runtime_dir: str | None = None) -> list[PoolInfo]:
    """Every live pool under the runtime base directory (``runtime_dir`` or the default), by
    directory name; none (with a warning) when the base is a link, another user's or writable
    by others.

    Raises:
        ValueError: ``runtime_dir`` (or ``$LTX_MGPU_RUNTIME_DIR``) names a file.
    """
    base = runtime_base(runtime_dir)
    try:
        if os.path.lexists(base):
            check_private_dir(base)
    except PermissionError as e:  # a link or another user's: nothing under it is read or signalled
        log.warning("skipping %s: %s", base, e)
        return []
    found = []
    for d in sorted(p.parent for p in base.glob(f"*/{INFO_NAME}")) if base.is_dir() else []:
        try:
            info = launch.find_live_pool(d)
        except PermissionError as e:  # not a directory we trust: never read, never signalled
            log.warning("skipping %s: %s", d, e)
            continue
        if info is not None:
            found.append(info)
    return found


def spec_of(info: PoolInfo) -> PoolSpec:
    """The :class:`PoolSpec` of a running pool."""
    return PoolSpec(tuple(info.gpus), info.nproc, info.lifetime, Path(info.dir))


def _observer(spec: PoolSpec) -> PoolClient:
    """A status-only client of the pool in ``spec.dir`` (``start=False``: it never starts one)."""
    key = str(spec.dir)
    with _LOCK:
        client = _OBSERVERS.get(key)
        if client is None:
            client = _OBSERVERS[key] = PoolClient(spec, start=False)
        return client


def pool_status(spec: PoolSpec, timeout: float = 10.0) -> dict | None:
    """The pool's ``status`` answer (ranks, memory, models, current job, queue), or None when
    no pool runs for ``spec`` (none is started).

    Raises:
        ltx_mgpu.client.errors.PoolError: the pool runs but does not answer.
    """
    if launch.find_live_pool(spec.dir) is None:
        return None
    return _observer(spec).status(timeout=timeout)


def free_pool(spec: PoolSpec, shutdown: bool = False, timeout: float = 60.0) -> dict:
    """Make the pool of ``spec`` release every resident model (``unload``), or stop it.

    Returns:
        ``{"running": bool, "unloaded": [names], "stopped": bool}`` (nothing is started).
    Raises:
        ltx_mgpu.client.errors.PoolError: the pool runs but does not answer.
    """
    if launch.find_live_pool(spec.dir) is None:
        return {"running": False, "unloaded": [], "stopped": False}
    if shutdown:
        return {"running": True, "unloaded": [], "stopped": launch.stop(spec.dir)}
    result, _ = _observer(spec).request("unload", {"names": None}, timeout=timeout)
    return {"running": True, "unloaded": result["unloaded"], "stopped": False}


def _gib(n: int | None) -> str:
    return "-" if n is None else f"{n / 2**30:.2f}G"


def format_status(status: dict) -> str:
    """A human-readable table of a ``status`` answer (memory in GiB)."""
    pool = status["pool"]
    lines = [f"pool pid {pool['torchrun_pid']}  ltx_mgpu {pool['version']}  {pool['world_size']} rank(s) on "
             f"{pool['device']}{' GPUs ' + ','.join(map(str, pool['gpus'])) if pool['gpus'] else ''}  "
             f"lifetime {pool['lifetime']}  dir {pool['dir']}",
             f"{'rank':>4} {'pid':>8} {'device':<8} {'alloc':>8} {'reserved':>8} {'total':>8} {'rss':>8}  models"]
    for r in status["ranks"]:
        m = r.get("memory", {})
        models = ", ".join(f"{k} ({_gib(v.get('bytes'))})" for k, v in r.get("models", {}).items()) or "-"
        lines.append(f"{r['rank']:>4} {r['pid']:>8} {r['device']:<8} {_gib(m.get('allocated')):>8} "
                     f"{_gib(m.get('reserved')):>8} {_gib(m.get('total')):>8} {_gib(m.get('rss')):>8}  {models}")
    cur = status.get("current")
    if cur:
        prog = cur.get("progress") or {}
        lines.append(f"running: {cur['type']} {cur['id']} {prog.get('phase', '')} "
                     f"{prog.get('step', '?')}/{prog.get('total', '?')} ({cur['elapsed']:.1f}s)")
    else:
        lines.append("running: -")
    lines.append(f"queued: {', '.join(j['type'] + ' ' + j['id'] for j in status['queue']) or '-'}")
    return "\n".join(lines)
