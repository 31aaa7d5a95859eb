"""A heartbeat for long work that reports no progress of its own (a pool start, a model load, a
model conversion): a function called every few seconds with the seconds elapsed, so a bar or a
line shows that the work moves."""

from __future__ import annotations

import threading
import time
from typing import Callable

__all__ = ["HEARTBEAT_S", "Heartbeat"]

#: Seconds between two heartbeats, by default.
HEARTBEAT_S = 1.0


class Heartbeat:
    """Call ``beat(elapsed_seconds)`` every ``interval`` seconds from a daemon thread until
    stopped (a context manager: started on enter, stopped on exit; the thread is joined).

    ``wait`` (default: the stop event's ``wait``) is how the thread waits between beats; tests pass
    a function that returns at once so beats come without real time passing. An exception from
    ``beat`` stops the heartbeat (it never reaches the phase's own thread).
    """

    def __init__(self, beat: Callable[[float], object], interval: float = HEARTBEAT_S,
                 wait: Callable[[float], bool] | None = None):
        self.beat, self.interval = beat, float(interval)
        self._stop = threading.Event()
        self._wait = wait or self._stop.wait
        self._thread: threading.Thread | None = None
        self.started = time.monotonic()
        self.beats = 0

    def _run(self) -> None:
        while not self._wait(self.interval) and not self._stop.is_set():
            try:
                self.beat(time.monotonic() - self.started)
            except Exception:  # noqa: BLE001 - a display failure must not end the work it shows
                return
            self.beats += 1

    @property
    def started_once(self) -> bool:
        """Whether :meth:`start` was called (a heartbeat runs once: it is not restarted)."""
        return self._thread is not None

    def start(self) -> Heartbeat:
        self.started = time.monotonic()
        self._thread = threading.Thread(target=self._run, name="ltx_mgpu-heartbeat", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=5)

    def __enter__(self) -> Heartbeat:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
