"""Rank 0's socket server: authentication, a FIFO job queue, per-connection event streams.

Threads: one accepts connections; each connection has a reader (frames -> requests) and a
writer (an outbound queue, so a slow client never blocks the job loop). The job loop itself
runs on rank 0's main thread (``ltx_mgpu.pool.worker``) and talks to this module through
:meth:`Server.next_job`, the ``emit_*`` methods, :meth:`Server.finish` and :meth:`Server.fail`.

Rules (see ``ltx_mgpu.wire``): the first frame must be ``hello`` with the pool's token
(within ``HELLO_TIMEOUT`` seconds, tiny, no tensors); a wrong token, a malformed, oversized,
truncated or unknown frame gets an ``error`` event and the connection is closed, while the
server keeps serving the others. ``status``, ``cancel``, ``features`` and ``shutdown`` are
answered at once, even while a job runs. A connection that turned ``shm`` on (``features``)
gets large payloads through a shared-memory arena of its own (``ltx_mgpu.wire.arena``), dropped after
``LTX_MGPU_SHM_IDLE_SECONDS`` without use and when the connection closes. Jobs run one at a
time in arrival order; cancelling a queued job removes it; cancelling the running one raises
``JobCancelled`` at its next step boundary. A client that disconnects has its queued jobs
dropped and its running job cancelled.

Connection slots: at most ``MAX_CONNECTIONS`` authenticated connections. A ``hello`` with every
slot taken closes the authenticated connection idle longest (no job queued or running, the
oldest last request) to make room, so a status or a job always gets in, whatever number of
connections other clients hold open; only when every connection has a job is it refused.

Lifetime of a ``with-owner`` pool (``owner`` is its owner's pid): it stops once its owner has
left (the owner process exited, or the client it started the pool with sent ``release``) and
no other client holds it (a ``hello`` with ``hold``: a client that would start a pool of its
own without this one) or has a job queued or running. A pool started for one run is so handed
over to the clients that attached meanwhile, never stopped under their jobs. ``shutdown``
stops it at once, whoever uses it.

Modules: this one holds :class:`Server` (listening socket, queue, job-loop interface) and the
server-side :class:`Job`; each client connection (reader / writer threads) is a
:class:`ltx_mgpu.pool.connection.Connection`.
"""

from __future__ import annotations

import collections
import contextlib
import logging
import os
import socket
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from ltx_mgpu import wire
from ltx_mgpu.pool.connection import Connection
from ltx_mgpu.wire import arena
from ltx_mgpu.wire.frames import ProtocolError

log = logging.getLogger("ltx_mgpu.pool.server")

#: Authenticated connections at once; a hello beyond it is refused ("too many connections").
MAX_CONNECTIONS = 256
#: Connections still in their handshake at once; more are closed at accept, so connections that
#: never authenticate cannot take the slots of those that do (each has HELLO_TIMEOUT in all).
MAX_PENDING = 64


@dataclass(eq=False)
class Job:
    """A queued or running job (server side). ``progress`` is the last reported
    ``{"phase", "step", "total"}``; ``submitted`` and ``started`` are ``time.time()`` seconds;
    ``clock`` holds the same moments (and ``finished``) in ``time.monotonic()`` seconds, which
    every process of the host reads alike (Linux ``CLOCK_MONOTONIC``): the result's ``timeline``."""

    request: wire.Request
    conn: "Connection"
    submitted: float = field(default_factory=time.time)
    started: float | None = None
    clock: dict = field(default_factory=lambda: {"received": time.monotonic()})
    progress: dict | None = None
    cancel: threading.Event = field(default_factory=threading.Event)
    done: bool = False

    @property
    def id(self) -> str:
        return self.request.id

    @property
    def type(self) -> str:
        return self.request.type


class Server:
    """The AF_UNIX server of rank 0.

    ``describe()`` gives the pool description for ``hello``; ``status_fn()`` returns the
    per-rank part of ``status`` (a list of dicts); ``owner``: the owner's pid of a with-owner
    pool (see the module doc for when it stops). The socket is bound under a temporary name,
    chmod 0600, listening, then renamed to ``socket_path``: when the path exists, it answers.
    """

    def __init__(self, socket_path: Path, token: str, describe: Callable[[], dict],
                 status_fn: Callable[[], list], limits: wire.Limits | None = None, owner: int | None = None):
        self.socket_path, self.token, self.describe, self.status_fn = Path(socket_path), token, describe, status_fn
        #: The owner's pid (a with-owner pool; None: detached), and why it no longer holds the pool.
        self.owner, self.owner_left = owner, None
        self.limits = limits or wire.Limits()
        #: Arena memory over all connections (None: shared memory is not available here).
        self.shm_budget = arena.Budget() if arena.available() else None
        self._lock = threading.Condition()
        self._queue: collections.deque[Job] = collections.deque()
        self._current: Job | None = None
        self._conns: set[Connection] = set()
        self.stopping: str | None = None  # the reason, once a stop was requested
        self._listener: socket.socket | None = None
        self._ino: tuple[int, int] | None = None

    # ---- lifecycle
    def start(self) -> None:
        """Bind, listen and start accepting."""
        tmp = self.socket_path.with_name(f".{self.socket_path.name}.{os.getpid()}")
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.bind(os.fspath(tmp))
        os.chmod(tmp, 0o600)
        s.listen(socket.SOMAXCONN)
        os.replace(tmp, self.socket_path)
        st = os.stat(self.socket_path)
        self._ino = (st.st_dev, st.st_ino)
        self._listener = s
        threading.Thread(target=self._accept_loop, name="accept", daemon=True).start()

    def _accept_loop(self) -> None:
        while True:
            try:
                sock, _ = self._listener.accept()
            except OSError:
                return
            with self._lock:
                pending = sum(1 for c in self._conns if not c.authenticated)
                if pending >= MAX_PENDING or self.stopping:
                    sock.close()
                    continue
                conn = Connection(self, sock)
                self._conns.add(conn)
            conn.start()

    def admit(self, conn: Connection) -> str | None:
        """Count ``conn`` as authenticated (its hello was right); with every slot taken, the
        authenticated connection idle longest is closed to make room. Returns why ``conn`` is
        refused instead (the pool is stopping, or every connection has a job), else None."""
        with self._lock:
            if self.stopping:
                return f"the pool is stopping ({self.stopping}); a new one starts on your next request"
            authenticated = [c for c in self._conns if c.authenticated and not c.evicted]
            if len(authenticated) >= MAX_CONNECTIONS:
                busy = self._job_connections()
                idle = [c for c in authenticated if c not in busy]
                if not idle:
                    return (f"all {MAX_CONNECTIONS} connections to this pool have a job queued or running; "
                            "try again when one ends")
                victim = min(idle, key=lambda c: c.last_active)
                victim.evict(f"closed to make room for a new client: all {MAX_CONNECTIONS} connection slots of the "
                             "pool were taken and this connection was idle longest; reconnect to go on")
                log.warning("connection %d evicted (idle for %.0f s): every connection slot was taken", victim.cid,
                            time.monotonic() - victim.last_active)
            conn.authenticated = True
            return None

    def _job_connections(self) -> set[Connection]:
        """The connections with a job queued or running (under the lock)."""
        return {j.conn for j in self._queue} | ({self._current.conn} if self._current is not None else set())

    def _users(self) -> tuple[int, int]:
        """``(holders, jobs)``: authenticated connections holding the pool, jobs queued or running."""
        holders = sum(1 for c in self._conns if c.authenticated and c.holds and not c.evicted and not c.closed.is_set())
        return holders, len(self._queue) + (self._current is not None)

    def _stop_if_unused(self) -> None:
        """Stop a with-owner pool whose owner has left once nobody holds it or has a job in it."""
        with self._lock:
            if self.owner_left is not None and not self.stopping and self._users() == (0, 0):
                self.request_stop(f"{self.owner_left}, and no other client uses it")

    def owner_gone(self, reason: str) -> None:
        """The owner process exited (the watchdog): stop now, or when the last client that holds
        the pool or has a job in it is done."""
        with self._lock:
            if self.owner is not None and self.owner_left is None:
                self.owner_left = reason
                log.info("%s", reason)
            self._stop_if_unused()

    def release(self, conn: Connection) -> dict:
        """``release`` from ``conn``: it no longer holds the pool; from the owner's process it
        also means the owner has left (its run is done). Returns ``{"stopping", "holders",
        "jobs"}``: whether the pool now stops, else who still uses it."""
        with self._lock:
            conn.holds = False
            if self.owner is not None and conn.peer_pid == self.owner and self.owner_left is None:
                self.owner_left = f"the client that started it (pid {self.owner}) released it"
            self._stop_if_unused()
            holders, jobs = self._users()
            return {"stopping": bool(self.stopping), "holders": holders, "jobs": jobs}

    def unlink_socket(self) -> None:
        """Remove the socket file if it is still ours (a newer pool may have replaced it)."""
        with contextlib.suppress(OSError):
            st = os.stat(self.socket_path)
            if (st.st_dev, st.st_ino) == self._ino:
                os.unlink(self.socket_path)
        if self._listener is not None:
            with contextlib.suppress(OSError):
                self._listener.shutdown(socket.SHUT_RDWR)  # wakes the accept() of the accept thread
            with contextlib.suppress(OSError):
                self._listener.close()

    def close(self, flush_timeout: float = 3.0) -> None:
        """Stop accepting, flush every connection for up to ``flush_timeout`` s, close them."""
        self.unlink_socket()
        with self._lock:
            conns = list(self._conns)
        for c in conns:
            c.close()
        deadline = time.monotonic() + flush_timeout
        for c in conns:
            c.join(max(0.0, deadline - time.monotonic()))

    # ---- requests (reader threads)
    def hello_answer(self) -> dict:
        """The pool description plus the optional ``features`` this pool offers."""
        return {**self.describe(),
                "features": [arena.FEATURE, arena.FEATURE_OWN] if self.shm_budget is not None else []}

    def handle(self, conn: Connection, req: wire.Request) -> None:
        """Dispatch one validated request from ``conn``."""
        if req.type == "hello":
            conn.send(wire.make_event("result", req.id, result=self.hello_answer()))
        elif req.type == "features":
            conn.send(wire.make_event("result", req.id, result={"enabled": conn.enable(req.params["enable"])}))
        elif req.type == "status":
            conn.send(wire.make_event("result", req.id, result=self.status()))
        elif req.type == "cancel":
            conn.send(wire.make_event("result", req.id, result=self.cancel(req.params["job_id"])))
        elif req.type == "shutdown":
            conn.send(wire.make_event("result", req.id, result={"stopping": True}))
            self.request_stop(req.params.get("reason") or "shutdown requested")
        elif req.type == "release":
            conn.send(wire.make_event("result", req.id, result=self.release(conn)))
        else:
            self._submit(conn, req)

    def _submit(self, conn: Connection, req: wire.Request) -> None:
        with self._lock:
            if self.stopping:
                conn._error(req.id, f"the pool is shutting down ({self.stopping})", kind="cancelled")
                return
            live = {j.id for j in self._queue} | ({self._current.id} if self._current else set())
            if req.id in live:
                conn._error(req.id, f"job id {req.id!r} is already queued or running; use a fresh id")
                return
            job = Job(req, conn)
            self._queue.append(job)
            position = len(self._queue) - 1 + (1 if self._current else 0)
            conn.send(wire.make_event("accepted", req.id, job=req.type, position=position))
            self._lock.notify_all()

    def cancel(self, job_id: str) -> dict:
        """Cancel a queued (removed at once) or running (stops at its next step boundary) job.

        Returns ``{"found", "state"}`` plus, for a running job, ``progress`` as last reported
        before the cancel: the job reports at most one further step."""
        with self._lock:
            for job in self._queue:
                if job.id == job_id:
                    self._queue.remove(job)
                    job.done = True
                    job.conn._error(job.id, "cancelled while queued", kind="cancelled")
                    self._stop_if_unused()
                    return {"found": True, "state": "queued"}
            if self._current is not None and self._current.id == job_id:
                self._current.cancel.set()
                return {"found": True, "state": "running", "progress": self._current.progress}
        return {"found": False, "state": None}

    def request_stop(self, reason: str) -> None:
        """Begin a clean shutdown: queued jobs are cancelled, the running one is asked to stop,
        and :meth:`next_job` returns ``None`` from now on (the job loop then broadcasts it)."""
        with self._lock:
            if self.stopping:
                return
            self.stopping = reason
            while self._queue:
                job = self._queue.popleft()
                job.done = True
                job.conn._error(job.id, f"the pool is shutting down ({reason})", kind="cancelled")
            if self._current is not None:
                self._current.cancel.set()
            self._lock.notify_all()
        log.info("stopping: %s", reason)

    def connection_closed(self, conn: Connection) -> None:
        with self._lock:
            self._conns.discard(conn)
            for job in [j for j in self._queue if j.conn is conn]:
                self._queue.remove(job)
            if self._current is not None and self._current.conn is conn:
                self._current.cancel.set()
            self._stop_if_unused()

    def status(self) -> dict:
        """The ``status`` answer: pool description, per-rank records, queue and current job,
        connections (``holders`` of them hold the pool), ``owner_left`` (why the owner of a
        with-owner pool no longer holds it, or None) and ``stopping`` (why it stops, or None)."""
        now = time.time()
        with self._lock:
            cur = self._current
            current = None if cur is None else {
                "id": cur.id, "type": cur.type, "progress": cur.progress, "started": cur.started,
                "elapsed": now - (cur.started or now), "cancelling": cur.cancel.is_set()}
            queued = [{"id": j.id, "type": j.type, "position": i + (1 if cur else 0)}
                      for i, j in enumerate(self._queue)]
            nconn = len(self._conns)
            holders, _ = self._users()
        return {"pool": self.describe(), "ranks": self.status_fn(), "current": current, "queue": queued,
                "connections": nconn, "holders": holders, "owner_left": self.owner_left, "stopping": self.stopping}

    # ---- the job loop (rank 0 main thread)
    def next_job(self, timeout: float) -> Job | None:
        """The next queued job (now running), or ``None`` after ``timeout`` s or when stopping."""
        with self._lock:
            if not self._queue and not self.stopping:
                self._lock.wait(timeout)
            if self.stopping or not self._queue:
                return None
            job = self._current = self._queue.popleft()
            job.started = time.time()
            job.clock["started"] = time.monotonic()
            return job

    def cancel_requested(self, job: Job) -> bool:
        return job.cancel.is_set() or bool(self.stopping)

    def emit_progress(self, job: Job, phase: str, step: int, total: int) -> None:
        job.progress = {"phase": phase, "step": int(step), "total": int(total)}
        job.conn.send(wire.make_event("progress", job.id, **job.progress))

    def emit_log(self, job: Job, level: str, message: str, rank: int = 0) -> None:
        job.conn.send(wire.make_event("log", job.id, level=level, message=message, rank=rank))

    def reserve_result(self, job: Job, nbytes: int):
        """Shared memory for ``job``'s ``nbytes``-byte result payload, to be written in place
        (``ltx_mgpu.wire.sender.ArenaSender.reserve``; ``JobContext.result_buffers``), or None."""
        sender = job.conn.shm
        return None if sender is None else sender.reserve(nbytes)

    def finish(self, job: Job, result: dict, tensors: dict | None) -> None:
        """Send the job's ``result`` (and tensors) and mark it done. The result gains
        ``timeline`` (a reserved key: an engine's own is replaced):
        ``{"received", "started", "finished"}``, ``time.monotonic()`` seconds of
        the request's arrival, the job's start and its result's hand-off to the connection's
        writer (a client on the same host compares them with its own clock:
        :attr:`ltx_mgpu.client.jobs.Job.clock`)."""
        job.clock["finished"] = time.monotonic()
        try:  # a result that is not a dict is the engine's bad answer (TypeError), not the pool's end
            result = {**result, "timeline": dict(job.clock)}
            header = wire.make_event("result", job.id, result=result)
            wire.encode_header(header, self.limits)
            payload = wire.tensors_to_payload(tensors)
            if payload is not None and payload.nbytes > self.limits.max_payload_bytes:
                raise ProtocolError(f"{payload.nbytes} bytes of tensors exceed the "
                                    f"{self.limits.max_payload_bytes}-byte payload limit")
        except (ProtocolError, TypeError) as e:
            self.fail(job, "bad_input", f"the {job.type} job produced a result that cannot be sent: {e}")
            return
        job.conn.send(header, payload)
        self._done(job)

    def fail(self, job: Job, kind: str, message: str, rank: int | None = None, reason: str | None = None) -> None:
        """Send the job's terminal ``error`` (with a ``bad_input`` ``reason`` when given) and mark it done."""
        fields = {"reason": reason} if reason is not None else {}
        job.conn.send(wire.make_event("error", job.id, kind=kind, message=message,
                                          progress=job.progress, rank=rank, **fields))
        self._done(job)

    def _done(self, job: Job) -> None:
        with self._lock:
            job.done = True
            if self._current is job:
                self._current = None
            self._stop_if_unused()

    def fail_all(self, message: str, flush_timeout: float = 3.0) -> None:
        """Fatal end: ``error{fatal}`` to the running and queued jobs, then close everything."""
        with self._lock:
            self.stopping = self.stopping or "fatal error"
            jobs = ([self._current] if self._current is not None else []) + list(self._queue)
            self._queue.clear()
        for job in jobs:
            if not job.done:
                self.fail(job, "fatal", message)
        self.close(flush_timeout)
