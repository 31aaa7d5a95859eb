"""The client's job object: :class:`Job`, a submitted request (its events, ``wait`` with cancel /
timeout handling, ``cancel``).

Jobs are created by :class:`ltx_mgpu.client.pool_client.PoolClient`, whose connection reader
thread hands each job its events (:meth:`Job.deliver`, :meth:`Job.lose`). A job talks back to
its client only through :class:`JobOwner`. The errors it raises are :mod:`ltx_mgpu.client.errors`'.
"""

from __future__ import annotations

import contextlib
import queue
import time
from typing import Any, Callable, Iterator, Protocol

import torch

from ltx_mgpu import wire
from ltx_mgpu.client.errors import BadInputError, JobCancelledError, PoolError, PoolFatalError, PoolTimeoutError

__all__ = ["Job", "JobOwner", "ProgressCallback", "Receive", "CANCEL_TIMEOUT_S", "LOAD_CANCEL_TIMEOUT_S",
           "cancel_timeout_for"]


class JobOwner(Protocol):
    """What a :class:`Job` needs of the client that sent it."""

    def send_cancel(self, job_id: str) -> None:
        """Ask the pool to cancel ``job_id``; nothing when not connected."""

    def forget(self, job_id: str) -> None:
        """Stop routing events to ``job_id``."""

    def mark_dead(self, reason: str, fatal: bool = False) -> None:
        """The connection is lost (``fatal``: the pool failed)."""

    def kill(self, reason: str) -> None:
        """Kill the pool now (it stopped answering)."""

    def with_log(self, message: str) -> str:
        """``message`` followed by the tail of the pool's log."""


#: The event a job gets when its connection is lost (with the reason in place of the tensors).
_LOST = "__lost__"
#: Seconds a job may run on after its cancel before the pool is taken for hung and killed. Jobs
#: with step boundaries (encode sub-batches, denoise steps, selftest) stop at the next one;
#: a model load has none and finishes first (reading a 12B Gemma or a 19B checkpoint takes
#: tens of seconds to minutes): killing the pool then would only lose what it holds.
CANCEL_TIMEOUT_S = 15.0
LOAD_CANCEL_TIMEOUT_S = 900.0
_UNSTEPPED_JOBS = frozenset({"load_text_encoder", "load_transformer"})


def cancel_timeout_for(job_type: str) -> float:
    """The default ``cancel_timeout`` of :meth:`Job.wait` for a job type (see
    :data:`CANCEL_TIMEOUT_S`, :data:`LOAD_CANCEL_TIMEOUT_S`)."""
    return LOAD_CANCEL_TIMEOUT_S if job_type in _UNSTEPPED_JOBS else CANCEL_TIMEOUT_S
ProgressCallback = Callable[[str, int, int], Any]
Receive = Callable[[str, torch.Tensor], torch.Tensor]


class Job:
    """A submitted request. Iterate :meth:`events` or call :meth:`wait`; :meth:`cancel` asks the
    pool to stop it (queued: at once; running: at its next step boundary)."""

    def __init__(self, client: JobOwner, rid: str, mtype: str, receive: Receive | None = None):
        self.client, self.id, self.type, self.receive = client, rid, mtype, receive
        self._q: queue.SimpleQueue = queue.SimpleQueue()
        self.progress: dict | None = None
        self.accepted: dict | None = None
        self.done = False
        self.cancel_sent = False
        #: ``time.monotonic()`` seconds (host-wide, comparable with the result's ``timeline``):
        #: ``sent`` (the request starts going out), ``arrived`` (the terminal frame was read, payload
        #: mapped), ``queued`` (after ``receive``, handed to the waiter), ``returned`` (``wait``
        #: returns).
        self.clock: dict[str, float] = {}

    def cancel(self) -> None:
        """Ask the pool to cancel this job (no-op when done or already asked)."""
        if self.done or self.cancel_sent:
            return
        self.cancel_sent = True
        with contextlib.suppress(PoolError):
            self.client.send_cancel(self.id)

    def deliver(self, event: dict, tensors: dict) -> None:
        """An event for this job (called by the client's reader thread)."""
        self._q.put((event, tensors))

    def lose(self, reason: str) -> None:
        """The connection to the pool is gone: :meth:`wait` raises PoolFatalError with ``reason``."""
        self._q.put((_LOST, reason))

    @property
    def _is_job(self) -> bool:
        schema = wire.REQUESTS.get(self.type)
        return schema is not None and schema.job

    def _abandon(self) -> None:
        """The waiter is leaving (a callback raised): cancel the job and drop its events."""
        self.cancel()
        self.done = True
        self.client.forget(self.id)

    def _terminal(self, ev: dict, tensors: dict, timed_out: bool) -> tuple[dict, dict]:
        self.clock["returned"] = time.monotonic()
        self.done = True
        self.client.forget(self.id)
        if ev["event"] == "result":
            return ev["result"], tensors
        kind, msg = ev["kind"], ev["message"]
        if kind == "bad_input":
            raise BadInputError(msg, reason=ev.get("reason"))
        if kind == "cancelled":
            if timed_out:
                raise PoolTimeoutError(f"{self.type} job {self.id} timed out and was cancelled ({msg})")
            raise JobCancelledError(msg)
        self.client.mark_dead(msg, fatal=True)
        raise PoolFatalError(self.client.with_log(f"the pool failed during {self.type} job {self.id}: {msg}"))

    def events(self, timeout: float | None = None) -> Iterator[dict]:
        """Yield ``accepted`` / ``progress`` / ``log`` events until the job ends; the terminal
        result is then available from :meth:`wait` (which returns at once).

        Raises:
            PoolTimeoutError: no event for ``timeout`` seconds (the job is not cancelled).
        """
        while not self.done:
            try:
                item = self._q.get(timeout=timeout)
            except queue.Empty:
                raise PoolTimeoutError(f"no event from {self.type} job {self.id} for {timeout}s") from None
            ev = item[0]
            if ev == _LOST or ev["event"] in ("result", "error"):
                self._q.put(item)  # leave the terminal for wait()
                return
            self._note(ev)
            yield ev

    def _note(self, ev: dict) -> None:
        if ev["event"] == "progress":
            self.progress = {k: ev[k] for k in ("phase", "step", "total")}
        elif ev["event"] == "accepted":
            self.accepted = ev

    def wait(self, timeout: float | None = None, poll_interval: float = 0.1,
             should_cancel: Callable[[], bool] | None = None, on_progress: ProgressCallback | None = None,
             on_log: Callable[[dict], Any] | None = None, cancel_timeout: float | None = None) -> tuple[dict, dict]:
        """Wait for the job's result: ``(result: dict, tensors: dict[str, Tensor])``.

        Every ``poll_interval`` seconds ``should_cancel()`` is polled; when it turns true (or
        ``timeout`` seconds pass) a cancel is sent. If the pool does not end the job within
        ``cancel_timeout`` seconds after that (default :func:`cancel_timeout_for` the job's
        type: 15 s, 900 s for a model load, which cannot stop midway and whose result then
        comes back as usual), the pool is killed (PoolFatalError). Control
        requests (``status``, ``cancel``...) are not cancelled: they raise PoolTimeoutError.
        Callbacks run on the waiting thread.

        Raises:
            BadInputError, JobCancelledError, PoolTimeoutError, PoolFatalError.
            Whatever ``on_progress`` / ``on_log`` raise (after cancelling the job).
        """
        if cancel_timeout is None:
            cancel_timeout = cancel_timeout_for(self.type)
        deadline = None if timeout is None else time.monotonic() + timeout
        cancel_at: float | None = None
        timed_out = False
        while True:
            try:
                ev, tensors = self._q.get(timeout=poll_interval)
            except queue.Empty:
                ev, tensors = None, None
            if ev == _LOST:
                self.done = True
                self.client.forget(self.id)
                raise PoolFatalError(self.client.with_log(f"{self.type} job {self.id}: {tensors}"))
            if ev is not None:
                if ev["event"] in ("result", "error"):
                    return self._terminal(ev, tensors, timed_out)
                self._note(ev)
                try:
                    if ev["event"] == "progress" and on_progress is not None:
                        on_progress(ev["phase"], ev["step"], ev["total"])
                    elif ev["event"] == "log" and on_log is not None:
                        on_log(ev)
                except BaseException:
                    self._abandon()
                    raise
            now = time.monotonic()
            if cancel_at is None:
                try:
                    wanted = should_cancel is not None and should_cancel()
                except BaseException:
                    self._abandon()
                    raise
                if not self._is_job and deadline is not None and now > deadline:
                    self.client.forget(self.id)  # control requests are not cancellable
                    raise PoolTimeoutError(f"the pool did not answer {self.type} within {timeout}s")
                if wanted or (deadline is not None and now > deadline):
                    timed_out = not wanted
                    self.cancel()
                    cancel_at = now
            elif now - cancel_at > cancel_timeout:
                self.client.kill(f"{self.type} job {self.id} did not stop within {cancel_timeout:.0f}s of cancel")
                self.done = True
                raise PoolFatalError(self.client.with_log(
                    f"the pool did not stop {self.type} job {self.id} within {cancel_timeout:.0f}s of a cancel "
                    "and was killed; the next request starts a fresh pool"))
