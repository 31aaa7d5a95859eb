"""``PoolClient``: start or attach to the sidecar pool, send requests, stream events, cancel.

Typical use (a ComfyUI node waits on one thread and polls for an interrupt)::

    client = PoolClient.connect(gpus=[0, 1])                 # starts the pool or attaches
    job = client.submit("encode", {"prompts": [...]})
    result, tensors = job.wait(poll_interval=0.1, should_cancel=processing_interrupted,
                               on_progress=lambda phase, step, total: bar.update_absolute(step, total))

Errors: :class:`BadInputError` (the request was wrong, the pool keeps serving),
:class:`JobCancelledError`, :class:`PoolTimeoutError` (the job exceeded ``timeout``; it was
cancelled), :class:`PoolFatalError` (the pool failed or was lost; the next request starts a
fresh one) and :class:`PoolStartError`. All derive from :class:`PoolError`.

Thread safety: one client may be shared by threads; each job's events go to the thread that
waits on it; callbacks run on that thread, except ``receive`` (see :meth:`PoolClient.submit`),
which runs on the connection's reader thread. Large results come through a shared-memory
arena when both sides can, or in memory the pool hands over (no copy on this side)
(``ltx_mgpu.wire.arena``; ``shm=False`` or ``LTX_MGPU_SHM=0``: the socket).
A callback that raises (ComfyUI's ``InterruptProcessingException`` is a ``BaseException``) first
cancels the job.

:class:`Job` is :mod:`ltx_mgpu.client.jobs`'; the errors are :mod:`ltx_mgpu.client.errors`'; starting,
finding and stopping pool processes is :mod:`ltx_mgpu.client.launch`'.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import threading
import time
import uuid
import weakref
from typing import Any, Callable, Mapping, Sequence

import psutil
import torch

import ltx_mgpu
from ltx_mgpu import wire
from ltx_mgpu.client import launch
from ltx_mgpu.client.errors import BadInputError, PoolBusyError, PoolError, PoolFatalError, PoolTrustError
from ltx_mgpu.client.jobs import Job, ProgressCallback, Receive
from ltx_mgpu.client.spec import PoolSpec, resolve_spec
from ltx_mgpu.wire import rendezvous
from ltx_mgpu.wire.arena import FEATURE as SHM
from ltx_mgpu.wire.arena import FEATURE_OWN as SHM_OWN
from ltx_mgpu.wire.arena import available as shm_available
from ltx_mgpu.wire.receiver import ArenaReceiver

__all__ = ["PoolClient", "READER_JOIN_S", "ATTACH_TIMEOUT_S"]

#: Seconds :meth:`PoolClient.close` waits for the connection's reader thread to end.
READER_JOIN_S = 5.0
#: Seconds a client keeps retrying to connect to a pool that runs (backlog or slots full).
ATTACH_TIMEOUT_S = 15.0
#: Connected clients, closed at interpreter exit (before daemon threads are frozen).
_OPEN: weakref.WeakSet = weakref.WeakSet()


@atexit.register
def _close_open_clients() -> None:
    for client in list(_OPEN):
        with contextlib.suppress(Exception):
            client.close()


class PoolClient:
    """A connection to the pool for one GPU set; see the module doc. Build with :meth:`connect`."""

    def __init__(self, spec: PoolSpec, *, start: bool = True, startup_timeout: float = 300.0,
                 master_port: int | None = None, shm: bool | None = None):
        self.spec, self.start, self.startup_timeout, self.master_port = spec, start, startup_timeout, master_port
        self.use_shm = shm_available() if shm is None else bool(shm)
        self._shm: ArenaReceiver | None = None
        self._lock = threading.RLock()
        self._send_lock = threading.Lock()
        self._pending: dict[str, Job] = {}
        self._sock = None
        self._dead: str | None = None
        self._fatal = False
        self._procs: list[psutil.Process] = []
        self._launched: launch.LaunchedPool | None = None
        self._reader: threading.Thread | None = None
        self._closing = threading.Event()  # set by close(): a reader sweeping a dead pool's files stops
        self.pool: dict = {}
        #: ``time.monotonic()`` when this client began starting its pool, while it starts; else None
        #: (the node's phase text and the panel show the start as it happens).
        self.starting_since: float | None = None

    @classmethod
    def connect(cls, gpus: str | Sequence[int] | None = None, nproc: int | None = None,
                lifetime: str = "with-owner", runtime_dir: str | os.PathLike | None = None, start: bool = True,
                startup_timeout: float = 300.0, master_port: int | None = None,
                shm: bool | None = None) -> PoolClient:
        """Attach to the live pool of this GPU set, or start one (``start=True``).

        ``gpus``: ``None``/``"all"``, ``"cpu"``/``[]`` (CPU ranks on gloo; ``nproc`` of them) or
        indices. A started pool lives ``with-owner`` (exits when this process dies) or
        ``detached``. ``shm``: take large results through shared memory when the pool offers it
        (default: when this platform can, ``LTX_MGPU_SHM`` not ``0``).

        Raises:
            ValueError: bad arguments. PoolStartError: the pool did not start. PoolError: no
            pool runs and ``start=False``, or the running one is incompatible.
        """
        client = cls(resolve_spec(gpus, nproc, lifetime, runtime_dir), start=start,
                     startup_timeout=startup_timeout, master_port=master_port, shm=shm)
        client._ensure()
        return client

    # ---- connection management
    @property
    def dir(self):
        return self.spec.dir

    @property
    def pid(self) -> int | None:
        """torchrun's pid (the pool's identity)."""
        return self.pool.get("torchrun_pid")

    @property
    def shm_stats(self) -> dict:
        """Shared-memory delivery on the current connection: ``enabled``, ``frames`` and
        ``bytes`` received through it, ``arenas`` mapped so far, ``mapped`` (one is now),
        ``owned`` (frames whose memory was handed over: their tensors are views of it)."""
        r = self._shm
        return {"enabled": r is not None, "frames": r.frames if r else 0, "bytes": r.bytes if r else 0,
                "arenas": r.arenas if r else 0, "mapped": r is not None and r.arena is not None,
                "owned": r.owned if r else 0}

    @property
    def launched(self) -> bool:
        """Whether this client started the pool it is connected to (rather than attaching)."""
        return self._launched is not None

    def with_log(self, message: str) -> str:
        """``message`` followed by the tail of the pool's log (when it has one)."""
        tail = rendezvous.log_tail(self.dir, 3000).strip()
        return f"{message}\n--- tail of {self.dir / rendezvous.LOG_NAME} ---\n{tail}" if tail else message

    def _ensure(self) -> None:
        with self._lock:
            if self._sock is not None and self._dead is None:
                return
            if self._sock is not None or self._fatal:
                self._reap()
            if self.start and not self.dir.is_dir():  # no pool there: refuse GPUs torch cannot see before
                launch.check_startable(self.spec)  # the lock makes the directory
            with rendezvous.launch_lock(self.dir, timeout=self.startup_timeout + 60):
                info = launch.find_live_pool(self.dir, locked=True)
                if info is not None:
                    want = (ltx_mgpu.__version__, wire.PROTOCOL_VERSION, list(self.spec.gpus), self.spec.nproc)
                    have = (info.version, info.protocol, list(info.gpus), info.nproc)
                    if have != want:
                        raise PoolError(f"an incompatible pool runs in {self.dir} (version, protocol, gpus, nproc = "
                                        f"{have}, wanted {want}); stop it with `python -m ltx_mgpu pool stop "
                                        f"--gpus {','.join(map(str, info.gpus)) or 'cpu'} --nproc {info.nproc} "
                                        f"--runtime-dir {self.dir.parent}`")
                    if self._attach(info):
                        return
                    launch.find_live_pool(self.dir, locked=True)  # it died meanwhile: its files go, a fresh one starts
                if not self.start:
                    raise PoolError(f"no pool runs in {self.dir}; start one with `python -m ltx_mgpu pool start`")
                owner = os.getpid() if self.spec.lifetime == "with-owner" else None
                self.starting_since = time.monotonic()
                try:
                    self._launched = launch.launch(self.spec, owner_pid=owner, master_port=self.master_port,
                                                   startup_timeout=self.startup_timeout)
                    self._open()
                finally:
                    self.starting_since = None

    def _attach(self, info: rendezvous.PoolInfo) -> bool:
        """Connect to the live pool ``info``, retrying with backoff while it runs: a burst of
        clients can fill its listen backlog or its connection slots for a moment. A pool that
        answers nobody is never stopped from here (only one proven dead is replaced).

        Returns:
            True when connected; False when the pool died meanwhile.
        Raises:
            PoolBusyError: it still runs but did not take this connection within
                :data:`ATTACH_TIMEOUT_S` seconds.
            PoolTrustError, PermissionError: the socket or the token cannot be trusted (not
                retried).
        """
        deadline, delay = time.monotonic() + ATTACH_TIMEOUT_S, 0.02
        while True:
            try:
                self._open()
                return True
            except (PoolTrustError, PermissionError):
                raise
            except (OSError, PoolError, wire.ProtocolError) as e:
                if not info.alive():
                    return False
                if time.monotonic() + delay > deadline:
                    raise PoolBusyError(
                        f"the pool in {self.dir} (pid {info.pid}) runs but did not take this connection within "
                        f"{ATTACH_TIMEOUT_S:.0f} s ({type(e).__name__}: {e}); it may be serving many clients: try "
                        f"again, or if it hangs stop it with `python -m ltx_mgpu pool stop --runtime-dir "
                        f"{self.dir.parent}`") from e
            time.sleep(delay)
            delay = min(delay * 2, 0.5)

    def _open(self) -> None:
        sock = launch.open_socket(self.dir, timeout=10.0)
        receiver = None
        try:
            self.pool = launch.hello(sock, rendezvous.read_token(self.dir), rid=uuid.uuid4().hex, hold=self.start)
            offered = self.pool.get("features", ())
            if self.use_shm and SHM in offered:
                receiver = ArenaReceiver(take=self._take)
                wanted = [SHM] + [SHM_OWN] * (SHM_OWN in offered)
                if SHM not in launch.enable_features(sock, wanted, receiver, rid=uuid.uuid4().hex):
                    receiver = None
            sock.settimeout(None)
        except BaseException:
            sock.close()
            raise
        procs = []
        known = [(self.pool["torchrun_pid"], self.pool.get("torchrun_create_time"))]
        for pid, ct in known + [(r["pid"], r["create_time"]) for r in self.pool["ranks"]]:
            if rendezvous.same_process(pid, ct):
                with contextlib.suppress(psutil.Error):
                    p = psutil.Process(pid)
                    if rendezvous.is_pool_process(p, self.dir):  # what may be signalled later
                        procs.append(p)
        self._procs, self._sock, self._dead, self._fatal, self._shm = procs, sock, None, False, receiver
        self._closing.clear()
        self._reader = threading.Thread(target=self._read_loop, args=(sock, receiver), name="ltx_mgpu-pool-reader",
                                        daemon=True)
        self._reader.start()
        _OPEN.add(self)

    def _take(self, header: dict) -> Receive | None:
        """The ``receive`` of the job a frame answers (the arena receiver applies it), or None."""
        with self._lock:
            job = self._pending.get(header.get("id"))
        return job.receive if job is not None else None

    def _read_loop(self, sock, receiver: ArenaReceiver | None) -> None:
        reason = "the pool closed the connection"
        try:
            while True:
                before = receiver.frames if receiver is not None else 0
                header, tensors = wire.recv_frame(sock, shm=receiver)
                arrived = time.monotonic()
                ev = wire.parse_event(header)
                with self._lock:
                    job = self._pending.get(ev["id"])
                if tensors and job is not None and job.receive is not None and (
                        receiver is None or receiver.frames == before):  # socket frames; arena ones had it
                    tensors = {name: job.receive(name, t) for name, t in tensors.items()}
                if job is not None and ev["event"] in ("result", "error"):
                    job.clock.update(arrived=arrived, queued=time.monotonic())
                if ev["event"] == "error" and ev["kind"] == "fatal":
                    self._fatal = True
                if job is not None:
                    job.deliver(ev, tensors)
        except wire.ConnectionClosed:
            pass
        except BaseException as e:  # noqa: BLE001 - a thread boundary: report everything
            reason = f"connection to the pool lost: {type(e).__name__}: {e}"
        if receiver is not None:
            receiver.drop()
        lost = sock is self._sock  # not closed by this client
        procs = list(self._procs)
        self.mark_dead(reason, sock=sock)
        if lost:
            self._sweep(self.pool.get("instance"), procs)

    def _sweep(self, instance: str | None, procs: list[psutil.Process], wait: float = 20.0) -> None:
        """After a lost connection: when the pool that served it is gone (its torchrun exits soon
        after a rank dies), end the processes of it seen at attach that outlived it (orphaned
        ranks) and remove its socket, token and ``pool.json``, so nothing finds a dead pool's
        files; a pool that still runs, or a newer one, is left alone."""
        deadline = time.monotonic() + wait
        while True:
            info = rendezvous.PoolInfo.read(self.dir)
            if info is None or info.instance != instance:
                return
            if not info.alive():
                rendezvous.kill_processes([p for p in procs if rendezvous.is_alive(p)], grace=3.0)
                with contextlib.suppress(TimeoutError), rendezvous.launch_lock(self.dir, timeout=30.0):
                    rendezvous.remove_pool_files(self.dir, instance)  # not while a new pool is launching
                return
            if time.monotonic() > deadline or self._closing.wait(0.1):
                return

    def mark_dead(self, reason: str, fatal: bool = False, sock=None) -> None:
        """The connection is lost (``fatal``: the pool failed): every waiting job fails with
        ``reason``. ``sock``: only when it is still the current connection."""
        with self._lock:
            if sock is not None and sock is not self._sock:
                return  # an old connection's reader
            self._fatal = self._fatal or fatal
            if self._dead is None:
                self._dead = reason
            pending, self._pending = list(self._pending.values()), {}
            if self._sock is not None:
                with contextlib.suppress(OSError):
                    self._sock.shutdown(2)
        for job in pending:
            job.lose(reason)

    def forget(self, rid: str) -> None:
        """Stop routing events to job ``rid``."""
        with self._lock:
            self._pending.pop(rid, None)

    def _reap(self) -> None:
        """After a loss: keep a pool that still answers, otherwise make sure every process of
        the old one is gone (only the processes seen at attach; a newer pool is left alone)."""
        with contextlib.suppress(OSError):
            self._sock.close()
        self._sock = None
        if not self._fatal and launch.ping(self.dir, timeout=3.0) is not None:
            return
        rendezvous.kill_processes(rendezvous.wait_gone(self._procs, 5.0), grace=3.0)
        if self._launched is not None:
            with contextlib.suppress(Exception):
                self._launched.popen.wait(timeout=5.0)
        info = rendezvous.PoolInfo.read(self.dir)
        if info is not None and not info.alive():
            rendezvous.remove_pool_files(self.dir, info.instance)
        self._procs, self._launched = [], None

    def kill(self, reason: str) -> None:
        """Kill the pool now (it stopped answering)."""
        with self._lock:
            self._fatal = True
            rendezvous.kill_processes(self._procs, grace=3.0)
            self.mark_dead(reason, fatal=True)

    # ---- requests
    def _send(self, mtype: str, params: Mapping[str, Any] | None, tensors: Mapping[str, torch.Tensor] | None = None,
              track: bool = True, ensure: bool = True, receive: Receive | None = None) -> Job | None:
        """Send a request (``ensure``: start or re-attach the pool first; otherwise skip the send,
        returning None, when not connected)."""
        if ensure:
            self._ensure()
        elif self._sock is None or self._dead is not None:
            return None
        rid = uuid.uuid4().hex
        try:
            header = wire.make_request(mtype, rid, params, tensors)
            payload = wire.tensors_to_payload(tensors)
        except wire.ProtocolError as e:
            raise BadInputError(str(e)) from None
        job = Job(self, rid, mtype, receive)
        with self._lock:
            sock = self._sock
            if track:
                self._pending[rid] = job
        try:
            with self._send_lock:
                job.clock["sent"] = time.monotonic()  # before: the pool may read it before send_frame returns
                wire.send_frame(sock, header, payload)
        except wire.ProtocolError as e:  # over the frame's limits: refused before a byte went out
            with self._lock:
                self._pending.pop(rid, None)
            raise BadInputError(f"the {mtype} request: {e}") from None
        except OSError as e:
            self.mark_dead(f"sending {mtype} failed: {e}", sock=sock)
            raise PoolFatalError(self.with_log(f"sending {mtype} to the pool failed: {e}")) from e
        return job

    def send_cancel(self, job_id: str) -> None:
        """Ask the pool to cancel ``job_id`` without waiting for the answer; nothing when not connected."""
        self._send("cancel", {"job_id": job_id}, track=False, ensure=False)

    def submit(self, mtype: str, params: Mapping[str, Any] | None = None,
               tensors: Mapping[str, torch.Tensor] | None = None, receive: Receive | None = None) -> Job:
        """Send a request; returns its :class:`Job` at once (starting the pool if needed).

        ``receive(name, tensor) -> tensor`` (optional) turns each received tensor into the one
        the job returns, on the reader thread, while it may still be a view into the shared
        arena (e.g. ``t.float()``: one pass from the arena straight into the result). A result
        still pointing into the arena is copied (one in handed-over memory is kept as it is); it
        must not raise (the connection is lost).

        Raises:
            BadInputError: unknown type or params that break its schema (checked locally).
            PoolFatalError / PoolStartError: the pool is unreachable and could not be restarted.
        """
        return self._send(mtype, params, tensors, receive=receive)

    def request(self, mtype: str, params: Mapping[str, Any] | None = None,
                tensors: Mapping[str, torch.Tensor] | None = None, on_progress: ProgressCallback | None = None,
                timeout: float | None = None, should_cancel: Callable[[], bool] | None = None,
                poll_interval: float = 0.1, receive: Receive | None = None) -> tuple[dict, dict]:
        """``submit`` + ``wait``: returns ``(result, tensors)``; raises as :meth:`Job.wait`."""
        return self.submit(mtype, params, tensors, receive).wait(timeout=timeout, poll_interval=poll_interval,
                                                                 should_cancel=should_cancel, on_progress=on_progress)

    def status(self, timeout: float = 10.0) -> dict:
        """Per-rank devices, memory (bytes) and models, the queue and the current job."""
        return self.request("status", timeout=timeout)[0]

    def cancel(self, job_id: str, timeout: float = 10.0) -> dict:
        """Cancel a job by id (any client's): ``{"found": bool, "state": "queued"|"running"|None}``."""
        return self.request("cancel", {"job_id": job_id}, timeout=timeout)[0]

    def shutdown(self, timeout: float = 30.0) -> None:
        """Stop the pool (queued jobs cancelled, the running one stopped at its next step), wait
        up to ``timeout`` seconds for its processes to exit, then kill what remains."""
        with self._lock:
            procs, launched, instance = list(self._procs), self._launched, self.pool.get("instance")
        if self._sock is not None and self._dead is None:
            with contextlib.suppress(PoolError):
                self.request("shutdown", {"reason": "client shutdown"}, timeout=10.0)
        self._end_pool(procs, launched, instance, timeout)

    def _end_pool(self, procs: list, launched, instance: str | None, timeout: float) -> None:
        """Wait up to ``timeout`` seconds for the pool's processes to end, kill what is left,
        reap the launcher, remove the pool's files once its record is dead; close this client."""
        rendezvous.kill_processes(rendezvous.wait_gone(procs, timeout), grace=5.0)
        if launched is not None:
            with contextlib.suppress(Exception):
                launched.popen.wait(timeout=5.0)
        if instance is not None:
            info = rendezvous.PoolInfo.read(self.dir)
            if info is not None and not info.alive():
                rendezvous.remove_pool_files(self.dir, instance)
        self.close()

    def release(self, timeout: float = 30.0) -> bool:
        """End this client's use of a pool it started for its run (:attr:`launched`): the pool
        stops now unless another client holds it or has a job in it (it is then handed over to
        them and stops once they are done), never under another client's job. Closes this
        client. A pool this client attached to is left as it is.

        Returns:
            True when the pool stopped (its processes are gone, waited for up to ``timeout``
            seconds, then killed); False when it runs on for other clients, or was not started
            here.
        """
        with self._lock:
            procs, launched, instance = list(self._procs), self._launched, self.pool.get("instance")
        if launched is None:
            self.close()
            return False
        answer = None
        job = self._send("release", None, ensure=False)  # None: not connected (the pool is gone)
        if job is not None:
            with contextlib.suppress(PoolError):
                answer = job.wait(timeout=10.0)[0]
        if answer is None and launch.ping(self.dir, timeout=5.0) is not None:
            answer = {"stopping": False}  # no answer, but it answers others: never stopped from here
        if answer is not None and not answer.get("stopping"):
            self.close()
            return False
        self._end_pool(procs, launched, instance, timeout)
        return True

    def close(self) -> None:
        """Close this connection (the pool keeps running; a with-owner pool stops once its owner
        has left and no client holds it: :meth:`release`).
        Jobs still waiting on it fail with PoolFatalError."""
        with self._lock:
            sock, self._sock, self._shm = self._sock, None, None  # the reader unmaps the arena as it ends
            self._dead, self._fatal, self._procs, self._launched = None, False, [], None
            pending, self._pending = list(self._pending.values()), {}
        for job in pending:
            job.lose("the client was closed")
        if sock is not None:
            with contextlib.suppress(OSError):
                sock.shutdown(2)
            sock.close()
        reader, self._reader = self._reader, None
        self._closing.set()
        if reader is not None and reader is not threading.current_thread():
            # the reader ends with the socket; waiting for it keeps it out of torch code when the
            # interpreter exits (a daemon thread stopped inside a torch op aborts the process)
            reader.join(READER_JOIN_S)
        _OPEN.discard(self)

    def __enter__(self) -> PoolClient:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()
