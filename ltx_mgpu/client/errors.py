"""The errors the client reports, one home for all of them: :class:`PoolError` and its kinds.

The pool answers a failed job with an ``error`` event whose ``kind`` is one of
``ltx_mgpu.wire.messages.ERROR_KINDS``; the client raises the matching class:

* ``bad_input`` -> :class:`BadInputError` (the request was wrong; the pool keeps serving);
* ``cancelled`` -> :class:`JobCancelledError` (or :class:`PoolTimeoutError` when the client
  cancelled it for exceeding its timeout);
* ``fatal`` -> :class:`PoolFatalError` (the pool failed and exits; the next request on the same
  client starts a fresh pool).

:class:`PoolStartError` is raised when a pool does not start, :class:`PoolBusyError` when a running
pool does not take a connection in time, :class:`PoolTrustError` when the socket cannot be trusted.
"""

from __future__ import annotations

from ltx_mgpu.cancellation import Cancelled

__all__ = ["PoolError", "PoolStartError", "PoolBusyError", "PoolTrustError", "PoolFatalError", "BadInputError",
           "JobCancelledError", "PoolTimeoutError"]


class PoolError(RuntimeError):
    """Base of every pool failure reported to clients."""


class PoolStartError(PoolError):
    """The pool did not start; the message ends with the tail of its log."""


class PoolBusyError(PoolError):
    """The pool runs but did not take a connection in time (its backlog or slots were full, or it
    hangs); it was left running."""


class PoolTrustError(PoolError, PermissionError):
    """The pool's socket is served by another user's process, or by one that is not the pool's
    (an impostor): nothing was sent to it, not even the token. Not retried: the message says
    what to remove or stop. A ``PermissionError`` too, like the refusals of a runtime directory
    that is a link or another user's (``ltx_mgpu.wire.rendezvous.check_private_dir``)."""


class PoolFatalError(PoolError):
    """The pool failed (a rank died, a collective broke, the connection was lost) and exits;
    the next request on the same client starts a fresh pool."""


class BadInputError(PoolError, ValueError):
    """The pool rejected the request (``error{bad_input}``); it keeps serving. ``reason`` is the
    event's machine-readable cause (``ltx_mgpu.wire.messages.BAD_INPUT_REASONS``) or None."""

    def __init__(self, message: str = "", reason: str | None = None):
        super().__init__(message)
        self.reason = reason


class JobCancelledError(PoolError, Cancelled):
    """The job was cancelled (by ``cancel()``, ``should_cancel`` or a pool shutdown)."""


class PoolTimeoutError(PoolError, TimeoutError):
    """The job did not finish within its timeout; it was cancelled."""
