"""Helpers shared by the pool tests: short private runtime dirs, raw protocol access, pid checks,
a clean-up that stops a pool and kills whatever of it remains, and an artificial CPU load."""

from __future__ import annotations

import contextlib
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Iterator

import psutil
import torch

from ltx_mgpu import wire
from ltx_mgpu.client import launch
from ltx_mgpu.wire import rendezvous

ENV = {**os.environ, "OMP_NUM_THREADS": "1"}


def short_dir() -> Path:
    """A fresh base directory with a short path (AF_UNIX paths are limited to 107 bytes)."""
    return Path(tempfile.mkdtemp(prefix="lm-", dir="/tmp"))


def pool_pids(client) -> list[tuple[int, float | None]]:
    """(pid, create_time) of torchrun and every rank of the client's pool."""
    pool = client.pool
    return ([(pool["torchrun_pid"], pool["torchrun_create_time"])]
            + [(r["pid"], r["create_time"]) for r in pool["ranks"]])


def running(pids: list[tuple[int, float | None]]) -> list[int]:
    """The pids (of those processes) still running; a zombie counts as gone."""
    return [pid for pid, ct in pids if rendezvous.same_process(pid, ct)]


def wait_all_gone(pids, timeout: float = 30.0) -> list[int]:
    deadline = time.monotonic() + timeout
    while (alive := running(pids)) and time.monotonic() < deadline:
        time.sleep(0.1)
    return alive


def cleanup(base: Path) -> None:
    """Stop every pool under ``base`` (gracefully, then by signal) and delete the directory."""
    for d in base.glob("*/"):
        with contextlib.suppress(Exception):
            launch.stop(d, timeout=10.0)
        for rec in rendezvous.rank_records(d):  # ranks of a pool whose torchrun already died
            with contextlib.suppress(psutil.Error):
                if rendezvous.same_process(rec["pid"], rec["create_time"]):
                    psutil.Process(rec["pid"]).kill()
    shutil.rmtree(base, ignore_errors=True)


def raw_connect(dir: Path, timeout: float = 10.0) -> socket.socket:
    return launch.open_socket(dir, timeout=timeout)


def raw_hello(sock: socket.socket, dir: Path) -> dict:
    return launch.hello(sock, rendezvous.read_token(dir))


def read_answer(sock: socket.socket, timeout: float = 10.0):
    """The next frame's header, or None when the peer closed the connection."""
    sock.settimeout(timeout)
    try:
        header, _ = wire.recv_frame(sock)
        return header
    except (wire.ConnectionClosed, ConnectionResetError, BrokenPipeError):
        return None


def socket_pair() -> tuple[socket.socket, socket.socket]:
    """Two connected Unix stream sockets (a frame written on one is read on the other)."""
    return socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)


def assert_same_tensors(got: dict, want: dict) -> None:
    """``got`` has exactly ``want``'s names, each with its dtype, shape and values (on the CPU)."""
    assert set(got) == set(want)
    for k, v in want.items():
        assert got[k].dtype == v.dtype and got[k].shape == v.shape, k
        assert torch.equal(got[k], v.detach().cpu()), k


@contextlib.contextmanager
def cpu_load(processes: int | None = None) -> Iterator[list[subprocess.Popen]]:
    """Keep the CPU busy: one busy-loop process per core (``processes``, default
    ``os.cpu_count()``) for the duration, at the same priority as the tests. What the lifecycle
    tests must bear (issue 31: a test failed at a load average of 9); ``pytest --cpu-load`` runs
    a whole session under it."""
    n = processes or os.cpu_count() or 1
    spinners = [subprocess.Popen([sys.executable, "-c", "while True: pass"], stdin=subprocess.DEVNULL)
                for _ in range(n)]
    try:
        yield spinners
    finally:
        for p in spinners:
            p.kill()
        for p in spinners:
            p.wait()
