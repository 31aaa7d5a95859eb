"""One client connection of rank 0's socket server (:mod:`ltx_mgpu.pool.server`): a reader
thread (the ``hello`` handshake within ``HELLO_TIMEOUT`` seconds, then frames -> validated
requests handed to its :class:`ConnectionOwner`, the server) and a writer thread (an outbound queue, so a slow
client never blocks the job loop; it also drops the connection's idle shared-memory arena and
spare).

The queue, the job loop's interface and the listening socket are :class:`ltx_mgpu.pool.server.Server`'s;
the frames and messages are :mod:`ltx_mgpu.wire`'s, the arena :mod:`ltx_mgpu.wire.arena`'s.
"""

from __future__ import annotations

import contextlib
import hmac
import itertools
import logging
import os
import queue
import socket
import threading
import time
from typing import Any, Protocol

from ltx_mgpu import settings, wire
from ltx_mgpu.wire import arena
from ltx_mgpu.wire.arena import Budget
from ltx_mgpu.wire.frames import ConnectionClosed, Limits, ProtocolError
from ltx_mgpu.wire.messages import SchemaError
from ltx_mgpu.wire.rendezvous import peer_credentials
from ltx_mgpu.wire.sender import ArenaSender

# The server's logger, so that connection records keep the name they had before this module was split off.
log = logging.getLogger("ltx_mgpu.pool.server")

#: Seconds a new connection has, in all, to authenticate (:data:`ltx_mgpu.settings.HELLO_TIMEOUT`).
HELLO_TIMEOUT = settings.HELLO_TIMEOUT.get()


class ConnectionOwner(Protocol):
    """What a :class:`Connection` needs of the server that accepted it."""

    token: str
    limits: Limits
    shm_budget: Budget | None

    def hello_answer(self) -> dict[str, Any]:
        """The ``hello`` result: the pool's description and the features it offers."""

    def handle(self, conn: Connection, req: wire.Request) -> None:
        """An authenticated, validated request from ``conn``."""

    def connection_closed(self, conn: Connection) -> None:
        """``conn`` is gone: drop its queued jobs and events."""

    def admit(self, conn: Connection) -> str | None:
        """Count ``conn`` as authenticated (making room if need be); else why it is refused."""


class Connection:
    """One client connection: a reader thread and a writer thread with an outbound queue."""

    _ids = itertools.count(1)

    def __init__(self, server: ConnectionOwner, sock: socket.socket):
        self.server, self.sock, self.cid = server, sock, next(self._ids)
        self.out: queue.SimpleQueue = queue.SimpleQueue()
        self.closed = threading.Event()
        self.authenticated = False
        #: Closed by the server to make room for a new client (no longer counted, requests ignored).
        self.evicted = False
        #: The client holds the pool (``hello``'s ``hold``): a with-owner pool waits for it to leave.
        self.holds = False
        #: ``time.monotonic()`` of the handshake or the last request: who is idle longest.
        self.last_active = time.monotonic()
        #: The client's pid as the kernel recorded it at ``connect`` (``SO_PEERCRED``).
        self.peer_pid: int | None = None
        self.shm: ArenaSender | None = None  # set by the reader (features), used by the writer
        self._reader = threading.Thread(target=self._read_loop, name=f"conn{self.cid}-reader", daemon=True)
        self._writer = threading.Thread(target=self._write_loop, name=f"conn{self.cid}-writer", daemon=True)

    def start(self) -> None:
        self._writer.start()
        self._reader.start()
        # the whole handshake is bounded, not each recv: a client trickling bytes is cut off
        timer = threading.Timer(HELLO_TIMEOUT, self._hello_expired)
        timer.daemon = True
        timer.start()

    def _hello_expired(self) -> None:
        if not self.authenticated and not self.closed.is_set():
            with contextlib.suppress(OSError):
                self.sock.shutdown(socket.SHUT_RDWR)

    # ---- writing
    def send(self, header: dict, payload: wire.Payload | None = None) -> None:
        """Queue an event; silently dropped once the connection is closed."""
        if not self.closed.is_set():
            self.out.put((header, payload))

    def close(self) -> None:
        """Send what is queued, then close (asynchronously, on the writer thread)."""
        self.out.put(None)

    def evict(self, message: str) -> None:
        """Close this connection to make room for another: an ``error`` event saying so, then
        the close; from now on it is not counted and its requests are ignored (the server's lock
        is held)."""
        self.evicted = True
        self._error(None, message)
        self.close()

    def join(self, timeout: float) -> None:
        self._writer.join(timeout)

    def enable(self, features: list[str]) -> list[str]:
        """Turn on the requested features this pool offers; returns those on for this connection."""
        if arena.FEATURE in features and self.server.shm_budget is not None and self.shm is None:
            self.shm = ArenaSender(self.server.shm_budget, own=arena.FEATURE_OWN in features)
        if self.shm is None:
            return []
        return [arena.FEATURE] + [arena.FEATURE_OWN] * self.shm.own

    def _next(self):
        """The next outbound item; meanwhile, shared memory idle for its time is dropped (the
        arena with a notice to the client; a spare the client never saw, silently)."""
        while True:
            sender = self.shm
            wait = None if sender is None or not sender.holding() else \
                max(0.05, sender.last_used + sender.idle_seconds - time.monotonic())
            try:
                return self.out.get(timeout=wait)
            except queue.Empty:
                if sender.idle():
                    if sender.arena is not None:
                        wire.send_frame(self.sock, {}, flags=wire.FLAG_SHM_DROP)
                    sender.drop()

    def _write_loop(self) -> None:
        try:
            while True:
                item = self._next()
                if item is None:
                    break
                header, payload = item
                # drop the references once sent: a handed-over result's memory must not stay
                # mapped in the pool while the writer waits for the next event
                item = None
                try:
                    wire.send_frame(self.sock, header, payload, shm=self.shm)
                except ProtocolError as e:  # an event broke the limits (checked before any byte went out)
                    log.error("connection %d: event not sent: %s", self.cid, e)
                    wire.send_frame(self.sock, wire.make_event(
                        "error", header.get("id"), kind="bad_input", message=f"the answer could not be sent: {e}"))
                finally:
                    payload = None
        except OSError:
            pass
        except BaseException:  # never let a writer die silently
            log.exception("connection %d: writer failed", self.cid)
        finally:
            self.closed.set()
            if self.shm is not None:
                self.shm.close()
            with contextlib.suppress(OSError):
                self.sock.shutdown(socket.SHUT_RDWR)
            with contextlib.suppress(OSError):
                self.sock.close()

    # ---- reading
    def _error(self, rid: str | None, message: str, kind: str = "bad_input") -> None:
        self.send(wire.make_event("error", wire.valid_id(rid), kind=kind, message=message))

    def _read_loop(self) -> None:
        try:
            self.peer_pid, uid, _ = peer_credentials(self.sock)
            if uid != os.getuid():  # the socket is 0600 in a 0700 directory; this is the second lock
                raise ProtocolError(f"connections from uid {uid} are refused: this pool serves uid {os.getuid()}")
            self.sock.settimeout(HELLO_TIMEOUT)
            header, tensors = wire.recv_frame(self.sock, wire.PREAUTH_LIMITS)
            req = wire.parse_request(header, tensors)
            if req.type != "hello":
                raise ProtocolError(f"the first request must be 'hello' with the pool's token, got {req.type!r}",
                                    req.id)
            if not hmac.compare_digest(req.params["token"].encode(), self.server.token.encode()):
                raise ProtocolError("wrong token: read it from the pool's runtime directory", req.id)
            self.holds = bool(req.params.get("hold", False))
            refused = self.server.admit(self)
            if refused is not None:
                raise ProtocolError(refused, req.id)
            self.last_active = time.monotonic()
            self.send(wire.make_event("result", req.id, result=self.server.hello_answer()))
            self.sock.settimeout(None)
            while True:
                header, tensors = wire.recv_frame(self.sock, self.server.limits)
                if self.evicted:
                    break
                self.last_active = time.monotonic()
                try:
                    req = wire.parse_request(header, tensors)
                except SchemaError as e:
                    self._error(e.request_id, str(e))
                    continue
                try:
                    self.server.handle(self, req)
                except Exception as e:  # a bug answering one request must not drop the connection
                    log.exception("connection %d: %s failed", self.cid, req.type)
                    self._error(req.id, f"the pool could not answer {req.type}: {type(e).__name__}: {e}")
        except ConnectionClosed:
            pass
        except ProtocolError as e:
            self._error(e.request_id, str(e))
        except socket.timeout:
            self._error(None, f"no hello within {HELLO_TIMEOUT:.0f}s")
        except OSError:
            if not self.authenticated:
                self._error(None, f"no hello within {HELLO_TIMEOUT:.0f}s")
        except BaseException as e:  # a frame nothing above understood: say so before closing
            log.exception("connection %d: reader failed", self.cid)
            self._error(None, f"the pool could not read a frame: {type(e).__name__}: {e!s:.300}")
        finally:
            self.close()
            self.server.connection_closed(self)
