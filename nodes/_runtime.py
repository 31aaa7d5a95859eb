"""What the node families share: the custom type names, the platform check, the pool handle
(one :class:`ltx_mgpu.client.pool_client.PoolClient` per GPU set for the whole ComfyUI process) and
:class:`JobWatch`, which ties a pool job to the node's progress bar and to ComfyUI's Stop.

Stop, step by step (ComfyUI's interrupt API is in ``comfy/model_management.py``): while a node
waits on the pool, ``JobWatch.should_cancel`` peeks ComfyUI's interrupt flag every 0.1 s; when it
is set the client sends ``cancel`` and waits (``Job.wait``'s ``cancel_timeout``: 15 s, or 900 s for
a model load, which has no step boundary and finishes first, so Stop during a load keeps the pool
and the loaded model) for the pool to stop the job at its next step boundary (the pool keeps
serving); if the pool does not answer in time the client kills it and the next request starts a
fresh one. Either way the node then raises ComfyUI's ``InterruptProcessingException`` (a
``BaseException``). A progress update itself may raise that exception (ComfyUI's progress hook
checks the flag); ``JobWatch.on_progress`` turns it back into the flag so the cancel above still
happens.
"""

from __future__ import annotations

import contextlib
import sys
import threading
import time
from dataclasses import dataclass, field
from typing import Any

from ltx_mgpu.client.phases import phase_text
from ltx_mgpu.heartbeat import HEARTBEAT_S, Heartbeat

from . import _comfy

__all__ = ["CATEGORY", "POOL", "TEXT_ENCODER", "MODEL", "PoolType", "TextEncoderType", "ModelType", "JobWatch",
           "PoolHandle", "executing_node", "known_clients", "pool_specs", "pool_unavailable_reason", "require_pool",
           "starting_since"]

CATEGORY = "LTX-2 Multi-GPU"
#: Custom types passed between our nodes (ids carry the LTXMGPU prefix; core owns LTXV*).
POOL, TEXT_ENCODER, MODEL = "LTXMGPU_POOL", "LTXMGPU_TEXT_ENCODER", "LTXMGPU_MODEL"
#: The same types in ComfyUI's schema (``io.Custom``).
PoolType, TextEncoderType, ModelType = (_comfy.io.Custom(t) for t in (POOL, TEXT_ENCODER, MODEL))


def executing_node(node_cls) -> str | None:
    """The id of the node ``node_cls`` executes as: ComfyUI's hidden ``unique_id`` of this
    execution (``cls.hidden``, set by ComfyUI on the class it runs), or None outside ComfyUI."""
    return getattr(getattr(node_cls, "hidden", None), "unique_id", None)


def pool_unavailable_reason() -> str | None:
    """Why the sidecar pool cannot run on this machine (None when it can): it needs Linux
    (AF_UNIX sockets, ``fcntl`` locks, process sessions) and ``torch.distributed``."""
    if not sys.platform.startswith("linux"):
        return (f"LTX-2 Multi-GPU: the multi-GPU pool runs on Linux only (this is {sys.platform}); "
                "use ComfyUI's own LTX-2 nodes here, or run ComfyUI on a Linux machine")
    import torch.distributed as dist

    if not dist.is_available():
        return ("LTX-2 Multi-GPU: this torch build has no torch.distributed, which the pool needs; "
                "install a torch build with distributed support (the official Linux wheels have it)")
    try:
        import ltx_mgpu.client.pool_client  # noqa: F401
    except Exception as e:  # noqa: BLE001 - report any import failure as the reason
        return f"LTX-2 Multi-GPU: the pool client could not be imported ({type(e).__name__}: {e}); " \
               "reinstall the pack's requirements (pip install -r requirements.txt)"
    return None


def require_pool() -> None:
    """Raise a clear ``RuntimeError`` when the pool cannot run here (see above)."""
    reason = pool_unavailable_reason()
    if reason is not None:
        raise RuntimeError(reason)


# --------------------------------------------------------------------------- pool handle

_CLIENTS: dict[str, Any] = {}
_CLIENTS_LOCK = threading.Lock()


def known_clients() -> list:
    """The pool clients this process created (one per GPU set), in creation order."""
    with _CLIENTS_LOCK:
        return list(_CLIENTS.values())


def starting_since(key: str | None = None) -> float | None:
    """``time.monotonic()`` when a pool client of this process began starting its pool (the pool of
    runtime directory ``key``, or any), while it starts; else None."""
    for client in known_clients():
        since = getattr(client, "starting_since", None)
        if since is not None and (key is None or str(client.spec.dir) == key):
            return since
    return None


@dataclass(frozen=True)
class PoolHandle:
    """The ``LTXMGPU_POOL`` value: which pool (GPU set, CPU ranks, lifetime) and whether to
    ask ComfyUI to unload its own models before a pool job on ComfyUI's GPU.

    Nothing starts here: the pool starts (or is attached to) on the first request that needs
    it, so a fully cached prompt never starts one.

    Raises (at construction):
        RuntimeError: the pool cannot run on this platform.
        ValueError: bad ``gpus`` / ``cpu_ranks`` / ``lifetime`` (the message names the fix).
    """

    gpus: str = "all"
    cpu_ranks: int = 1
    lifetime: str = "with-owner"
    free_comfy_vram: bool = True
    spec: Any = field(default=None, compare=False)

    def __post_init__(self) -> None:
        require_pool()
        from ltx_mgpu.client.spec import parse_gpus, resolve_spec

        ids = parse_gpus(self.gpus)
        if ids is None:
            import torch

            ids = () if not torch.cuda.is_available() or torch.cuda.device_count() == 0 else None
        nproc = int(self.cpu_ranks) if ids == () else None
        object.__setattr__(self, "spec", resolve_spec(self.gpus, nproc, self.lifetime))

    @property
    def client(self):
        """The process-wide :class:`PoolClient` of this GPU set (created unconnected)."""
        from ltx_mgpu.client.pool_client import PoolClient

        key = str(self.spec.dir)
        with _CLIENTS_LOCK:
            client = _CLIENTS.get(key)
            if client is None:
                client = _CLIENTS[key] = PoolClient(self.spec)
            return client

    def shares_comfy_gpu(self) -> bool:
        """Whether the pool's GPUs include the GPU ComfyUI computes on (True when ComfyUI is on
        CUDA but its physical GPU cannot be told; False without ComfyUI or on its CPU)."""
        index = _comfy.comfy_cuda_index()
        return bool(self.spec.gpus) and index is not None and (index == -1 or index in self.spec.gpus)

    def before_job(self) -> None:
        """Free ComfyUI's own VRAM first when enabled and the pool uses ComfyUI's GPU."""
        if self.free_comfy_vram and self.shares_comfy_gpu():
            _comfy.unload_comfy_models()

    def session(self) -> _Session:
        """The client, wrapped so that :meth:`before_job` runs once, just before the first
        request that reaches the pool (a fully cached encode never triggers it)."""
        return _Session(self)

    def describe(self) -> str:
        """``"GPUs 0,1 (2 ranks)"`` / ``"CPU (2 ranks)"``."""
        where = f"GPUs {','.join(map(str, self.spec.gpus))}" if self.spec.gpus else "CPU"
        return f"{where} ({self.spec.nproc} rank{'s' if self.spec.nproc != 1 else ''})"


class _Session:
    """A :class:`PoolClient` proxy (what ``ltx_mgpu.client.text`` / ``ltx_mgpu.client.denoise`` call:
    ``request``, ``submit``, ``status``, ``spec``...) running ``handle.before_job()`` once."""

    def __init__(self, handle: PoolHandle):
        self._handle, self._client, self._prepared = handle, handle.client, False

    def _prepare(self) -> None:
        if not self._prepared:
            self._prepared = True
            self._handle.before_job()

    def request(self, *args: Any, **kwargs: Any):
        self._prepare()
        return self._client.request(*args, **kwargs)

    def submit(self, *args: Any, **kwargs: Any):
        self._prepare()
        return self._client.submit(*args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._client, name)


# --------------------------------------------------------------------------- observing pools


def pool_specs() -> list:
    """The pools to report: every GPU set a Pool node configured in this process (started or
    not) and every live pool under the runtime base directory (e.g. one started with
    ``python -m ltx_mgpu pool start --detach``), without duplicates."""
    from ltx_mgpu.client.discovery import live_pools, spec_of

    specs = {str(c.spec.dir): c.spec for c in known_clients()}
    for info in live_pools():
        specs.setdefault(str(info.dir), spec_of(info))
    return list(specs.values())


# --------------------------------------------------------------------------- progress and Stop


class JobWatch:
    """Progress bar, phase text and Stop handling for the pool calls of one node execution.

    Use as a context manager around the calls and pass ``should_cancel`` / ``on_progress``
    to them. On leaving with ``JobCancelledError`` (the pool confirmed the cancel) or
    ``PoolFatalError`` (the pool was killed after not confirming) while Stop was pressed, it
    raises ComfyUI's interrupt exception instead.

    While it is entered, a heartbeat shows the current phase with its elapsed time on the node
    every :data:`~ltx_mgpu.heartbeat.HEARTBEAT_S` seconds (``_comfy.progress_text``; the words of
    ``ltx_mgpu.client.phases``): the pool starting (this process's client launching it), a phase
    the node names (:meth:`phase`, e.g. a model load, which reports no steps), or the pool's last
    progress event. At the end the text says how it went ("done in 65 s", "stopped after 3 s",
    "failed after 2 s"). :attr:`texts` keeps the phases shown (the tests read it).
    """

    def __init__(self, node_id: str | None, heartbeat: float = HEARTBEAT_S):
        self.node_id = node_id
        self.interrupted = False
        self._bar = None
        self._phase: str | None = None
        self._progress: tuple[str, float, int, int] | None = None  # (phase, since, step, total)
        self._named: tuple[str, float] | None = None
        self._heartbeat = Heartbeat(self._beat, heartbeat)
        self.texts: list[str] = []

    def current_phase(self) -> str | None:
        """The phase text shown now (``"starting the pool · 12 s"``), or None when there is none."""
        now = time.monotonic()
        since = starting_since()
        if since is not None:
            return phase_text("pool", now - since)
        if self._named is not None:
            return phase_text(self._named[0], now - self._named[1])
        if self._progress is not None:
            phase, began, step, total = self._progress
            return phase_text(phase, now - began, step, total)
        return None

    def _beat(self, _elapsed: float) -> None:
        text = self.current_phase()
        if text is not None and not self.interrupted:
            self.texts.append(text)
            _comfy.progress_text(text, self.node_id)

    @contextlib.contextmanager
    def phase(self, name: str):
        """Name the work inside the block (a ``ltx_mgpu.client.phases`` id such as
        ``"load_transformer"``) for the heartbeat's text."""
        self._named = (name, time.monotonic())
        try:
            yield self
        finally:
            self._named = None

    def should_cancel(self) -> bool:
        if not self.interrupted and _comfy.processing_interrupted():
            self.interrupted = True
        return self.interrupted

    def on_progress(self, phase: str, step: int, total: int) -> None:
        if self.should_cancel():
            return
        if self._progress is None or self._progress[0] != phase:
            self._progress = (phase, time.monotonic(), step, total)
        else:
            self._progress = (phase, self._progress[1], step, total)
        try:
            if self._bar is None or phase != self._phase:
                self._bar, self._phase = _comfy.progress_bar(total, self.node_id), phase
            self._bar.update_absolute(step, total)
        except _comfy.interrupt_exception():
            _comfy.interrupt_current_processing(True)  # ComfyUI's hook cleared it while raising
            self.interrupted = True

    def done(self) -> None:
        """Fill the bar (a node whose pool call reported no progress)."""
        if not self.interrupted and self._bar is None:
            self.on_progress("done", 1, 1)

    def __enter__(self) -> JobWatch:
        self._heartbeat.start()
        return self

    def __exit__(self, exc_type, exc, tb) -> bool:
        self._heartbeat.stop()
        if self.texts:  # the node's text ends with what happened, not a phase still "running"
            seconds = int(time.monotonic() - self._heartbeat.started)
            outcome = "done" if exc is None else "stopped" if self.interrupted else "failed"
            _comfy.progress_text(f"{outcome} in {seconds} s" if exc is None else f"{outcome} after {seconds} s",
                                 self.node_id)
        if exc is None or not self.interrupted:
            return False
        from ltx_mgpu.client.errors import JobCancelledError, PoolFatalError

        if isinstance(exc, (JobCancelledError, PoolFatalError)):
            _comfy.raise_interrupt()
        return False
