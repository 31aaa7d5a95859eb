"""HTTP routes on ComfyUI's server, for the web panel and scripts (also under ``/api/...``):

* ``GET /ltx_mgpu/status``: :func:`status_payload` as JSON: whether the pool can run here, and
  per pool its state, per-rank devices, memory and resident models, the current job with its
  progress, and the queue.
* ``POST /ltx_mgpu/free``: :func:`free_payload`; body ``{"stop": true}`` stops the pools instead
  of unloading their models. ComfyUI's own ``POST /free`` cannot reach the pool's processes.

Routes are registered only when ComfyUI's ``PromptServer`` exists (``register``); the payload
functions are plain and never start a pool. Blocking pool calls run in a worker thread
(``asyncio.to_thread``), never on the server's event loop.
"""

from __future__ import annotations

import time
from typing import Any

from . import _comfy
from ._runtime import pool_specs, pool_unavailable_reason, starting_since

_REGISTERED = False


def _spec_info(spec) -> dict:
    return {"key": spec.key, "gpus": list(spec.gpus), "nproc": spec.nproc, "device": spec.device,
            "lifetime": spec.lifetime, "dir": str(spec.dir)}


def status_payload(timeout: float = 5.0) -> dict:
    """What ``GET /ltx_mgpu/status`` answers::

        {"available": bool, "message": str | None, "time": unix seconds,
         "pools": [{"key", "gpus", "nproc", "device", "lifetime", "dir",
                    "state": "not running" | "starting" | "idle" | "busy" | "error", "error": str | None,
                    ("starting" while a node of this process starts the pool: ``current`` is then
                    ``{"id": None, "type": "start", "progress": {"phase": "pool", ...}, "elapsed"}``)
                    (busy also while ComfyUI's own sampler calls our MODEL on it: ``current``
                    is then ``{"type": "comfy_sampling", ...}``)
                    "ranks": [{"rank", "pid", "device", "memory": {bytes...}, "models": {...}}],
                    "current": {"id", "type", "progress": {"phase", "step", "total"}, "elapsed"} | None,
                    "queue": [{"id", "type", "position"}]}]}
    """
    reason = pool_unavailable_reason()
    out: dict[str, Any] = {"available": reason is None, "message": reason, "time": time.time(), "pools": []}
    if reason is not None:
        return out
    from ltx_mgpu.client.discovery import pool_status
    from ltx_mgpu.client.errors import PoolError

    for spec in pool_specs():
        entry = {**_spec_info(spec), "state": "not running", "error": None, "ranks": [], "current": None, "queue": []}
        since = starting_since(str(spec.dir))
        if since is not None:  # a node of this process is starting it: it answers nobody yet
            entry.update(state="starting", current={"id": None, "type": "start",
                                                    "progress": {"phase": "pool", "step": 0, "total": 1},
                                                    "elapsed": time.monotonic() - since})
            out["pools"].append(entry)
            continue
        try:
            status = pool_status(spec, timeout=timeout)
        except (PoolError, PermissionError) as e:  # PermissionError: a runtime directory that cannot be trusted
            entry.update(state="error", error=str(e).splitlines()[0])
            status = None
        if status is not None:
            current = status.get("current") or _sampling(spec)
            entry.update(state="busy" if current else "idle", ranks=status.get("ranks", []),
                         current=current, queue=status.get("queue", []))
        out["pools"].append(entry)
    return out


def _sampling(spec) -> dict | None:
    """The pool's "current job" while ComfyUI's own sampler drives our MODEL on it (between two
    model calls the pool runs no job): ``{"id": None, "type": "comfy_sampling", "progress":
    {"phase": "<n> model calls", "step": n, "total": 0}, "elapsed": seconds}`` (the panel shows
    "comfy_sampling · 12 model calls"), or None."""
    from ltx_mgpu.client.model import model_activity

    active = model_activity(str(spec.dir))
    if active is None:
        return None
    calls = active["calls"]
    return {"id": None, "type": "comfy_sampling",
            "progress": {"phase": f"{calls} model call{'s' if calls != 1 else ''}", "step": calls, "total": 0},
            "elapsed": time.monotonic() - active["since"]}


def free_payload(stop: bool = False) -> dict:
    """What ``POST /ltx_mgpu/free`` answers: ``{"pools": [{"key", "running", "unloaded",
    "stopped", "error"}]}`` after every running pool released its models (or stopped)."""
    if pool_unavailable_reason() is not None:
        return {"pools": []}
    from ltx_mgpu.client.discovery import free_pool
    from ltx_mgpu.client.errors import PoolError

    pools = []
    for spec in pool_specs():
        entry = {"key": spec.key, "running": False, "unloaded": [], "stopped": False, "error": None}
        try:
            entry.update(free_pool(spec, shutdown=stop))
        except (PoolError, PermissionError) as e:
            entry["error"] = str(e).splitlines()[0]
        pools.append(entry)
    return {"pools": pools}


def register() -> bool:
    """Add the routes to ComfyUI's server (once); False when there is no server (no ComfyUI)."""
    global _REGISTERED
    server = _comfy.prompt_server()
    if server is None or _REGISTERED:
        return _REGISTERED
    import asyncio

    from aiohttp import web

    routes = server.routes

    @routes.get("/ltx_mgpu/status")
    async def _status(request):
        return web.json_response(await asyncio.to_thread(status_payload))

    @routes.post("/ltx_mgpu/free")
    async def _free(request):
        body: dict = {}
        if request.can_read_body:
            try:
                body = await request.json()
            except ValueError:
                return web.json_response({"error": "the body must be JSON like {\"stop\": false}"}, status=400)
        stop = bool(body.get("stop", False)) if isinstance(body, dict) else False
        return web.json_response(await asyncio.to_thread(free_payload, stop))

    _REGISTERED = True
    return True
