"""A pool's private files, which both the pool and its clients read: what its runtime directory
holds, and process helpers that survive pid reuse. Which runtime directory a GPU set gets is
:mod:`ltx_mgpu.client.spec`'s.

The runtime directory (mode 0700) holds:

* ``pool.sock`` (0600): the AF_UNIX socket, bound by rank 0 once every rank is up;
* ``token`` (0600): a fresh ``secrets.token_hex(32)`` per launch; ``hello`` must present it;
* ``pool.json`` (0600): pid and start time of torchrun, GPUs, nproc, versions, lifetime, owner,
  rendezvous port (:class:`PoolInfo`);
* ``pool.log`` (0600): torchrun's and every rank's output (the previous run's is ``pool.log.1``);
* ``rank<r>.json``: each rank's pid, device, memory and models (refreshed about every second);
  ``rank<r>.error``: why a rank failed;
* ``launch.lock``: serialises start-or-attach between processes.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import signal
import socket
import stat
import struct
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Iterator

import psutil

SOCKET_NAME, TOKEN_NAME, INFO_NAME, LOG_NAME, LOCK_NAME = "pool.sock", "token", "pool.json", "pool.log", "launch.lock"
UNIX_PATH_MAX = 107  # sun_path is 108 bytes including the terminating NUL (Linux unix(7))


# --------------------------------------------------------------------------- files

def check_private_dir(path: Path) -> None:
    """Refuse a directory we cannot trust with a pool's socket and token.

    Raises:
        PermissionError: ``path`` is a symbolic link, not a directory, belongs to another user,
            or is writable by others without being sticky (``lstat``: links are not followed).
    """
    st = os.lstat(path)
    if stat.S_ISLNK(st.st_mode):
        raise PermissionError(f"runtime directory {path} is a symbolic link; give a real directory as runtime_dir")
    if not stat.S_ISDIR(st.st_mode):
        raise PermissionError(f"runtime directory {path} is not a directory")
    if st.st_uid != os.getuid():
        raise PermissionError(f"runtime directory {path} belongs to uid {st.st_uid}, not to you; "
                              "choose another runtime_dir")
    if st.st_mode & 0o022 and not st.st_mode & stat.S_ISVTX:
        raise PermissionError(f"runtime directory {path} is writable by others (mode {st.st_mode & 0o7777:o}); "
                              "make it private (chmod 700) or choose another runtime_dir")


def ensure_private_dir(path: Path) -> Path:
    """Create ``path`` (and missing parents) with mode 0700, and check it and its parent (the
    runtime base) with :func:`check_private_dir`; ``path`` itself is then made 0700. An existing
    parent is checked before anything is created, so nothing is ever made inside a link's target
    or another user's directory.

    Raises:
        PermissionError: as :func:`check_private_dir`, for ``path`` or its parent.
    """
    if os.path.lexists(path.parent):
        check_private_dir(path.parent)
    path.mkdir(mode=0o700, parents=True, exist_ok=True)
    check_private_dir(path.parent)
    check_private_dir(path)
    if os.lstat(path).st_mode & 0o777 != 0o700:
        os.chmod(path, 0o700)
    return path


def open_private(path: Path) -> int:
    """A read-only descriptor of the regular file ``path`` that we own, never through a link.

    Raises:
        FileNotFoundError: no such file. PermissionError: a link, not a regular file, or another
            user's.
    """
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode) or st.st_uid != os.getuid():
        os.close(fd)
        raise PermissionError(f"{path} is not a regular file of yours; remove it")
    return fd


def read_private(path: Path, limit: int = 1 << 20) -> bytes:
    """The bytes of ``path`` (at most ``limit``) as :func:`open_private` opens it.

    Raises:
        FileNotFoundError, PermissionError: as :func:`open_private`; ValueError: over ``limit``.
    """
    with os.fdopen(open_private(path), "rb") as f:
        data = f.read(limit + 1)
    if len(data) > limit:
        raise ValueError(f"{path} is over {limit} bytes")
    return data


def write_private(path: Path, data: bytes) -> None:
    """Atomically write ``data`` to ``path`` with mode 0600 (a fresh temp file, never through a
    link, then renamed over ``path``)."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{threading.get_ident()}.tmp")
    with contextlib.suppress(FileNotFoundError):
        os.unlink(tmp)
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def read_token(dir: Path) -> str:
    """The pool's token.

    Raises:
        FileNotFoundError: no pool was launched there. PermissionError: the token is a link,
            not a regular file, or another user's.
    """
    return read_private(dir / TOKEN_NAME, 4096).decode("ascii", "replace").strip()


def log_tail(dir: Path, nbytes: int = 6000, start: int = 0) -> str:
    """The last ``nbytes`` of ``pool.log`` after byte offset ``start`` ('' when absent)."""
    try:
        with open(dir / LOG_NAME, "rb") as f:
            size = f.seek(0, os.SEEK_END)
            f.seek(max(start, size - nbytes))
            return f.read().decode("utf-8", "replace")
    except OSError:
        return ""


@dataclass(frozen=True)
class PoolInfo:
    """Contents of ``pool.json`` (written by the launcher): ``pid``/``create_time`` identify the
    torchrun process, ``gpus`` are physical indices, ``start_time`` is Unix seconds."""

    pid: int
    create_time: float
    gpus: list
    nproc: int
    device: str
    version: str
    protocol: int
    start_time: float
    lifetime: str
    owner_pid: int | None
    master_port: int
    instance: str
    dir: str

    @classmethod
    def read(cls, dir: Path) -> PoolInfo | None:
        """Parse ``dir/pool.json``; ``None`` when missing, unreadable, or recording another
        directory than the one it is in (a copied or forged file)."""
        try:
            data = json.loads(read_private(dir / INFO_NAME))
            info = cls(**{k: data[k] for k in cls.__dataclass_fields__})
            if not (isinstance(info.dir, str) and os.path.samefile(info.dir, dir)):
                return None
            return info
        except (OSError, ValueError, TypeError, KeyError):
            return None

    def write(self) -> None:
        write_private(Path(self.dir) / INFO_NAME, json.dumps(asdict(self), indent=1).encode())

    def alive(self) -> bool:
        """Whether the pool's torchrun still runs: the same pid *and* start time (zombies are
        dead), and a process of this pool (:func:`is_pool_process`): a ``pool.json`` naming an
        unrelated process describes no live pool."""
        if not same_process(self.pid, self.create_time):
            return False
        try:
            return is_pool_process(psutil.Process(self.pid), Path(self.dir))
        except psutil.Error:
            return False


_PROC_STAT = os.path.exists("/proc/self/stat")
_CLOCK_TICKS = os.sysconf("SC_CLK_TCK") if _PROC_STAT else 100


def process_start(pid: int) -> float:
    """When process ``pid`` started, in seconds: since boot, from ``starttime`` in
    ``/proc/<pid>/stat`` (clock ticks; proc(5)) where there is one, exact to the tick and
    untouched by changes of the wall clock; elsewhere psutil's ``create_time()`` (Unix seconds).

    Every process record of a pool (``pool.json``, ``rank<r>.json``, the owner, the ``hello``
    answer) holds this value and :func:`same_process` compares it. Not psutil's ``create_time()``
    on Linux: that adds the boot time the kernel derives from the wall clock, re-read on every
    call in whole seconds, so a clock step moves it and a live pool looked dead (a second pool
    was started beside it).

    Raises:
        psutil.NoSuchProcess: no such process.
    """
    if not _PROC_STAT:
        return psutil.Process(pid).create_time()
    try:
        with open(f"/proc/{int(pid)}/stat", "rb") as f:
            data = f.read()
    except (FileNotFoundError, ProcessLookupError):
        raise psutil.NoSuchProcess(pid) from None
    # the command name (field 2) may hold spaces and parentheses: count from the last ")"
    return int(data.rpartition(b")")[2].split()[19]) / _CLOCK_TICKS


def same_process(pid: int | None, create_time: float | None) -> bool:
    """True when ``pid`` runs and started at ``create_time`` (:func:`process_start`; guards
    against pid reuse); a zombie counts as gone."""
    if not pid:
        return False
    try:
        p = psutil.Process(pid)
        return (p.status() != psutil.STATUS_ZOMBIE
                and (create_time is None or abs(process_start(pid) - create_time) < 0.05))
    except (psutil.NoSuchProcess, psutil.AccessDenied):
        return False


def rank_records(dir: Path) -> list[dict]:
    """The ``rank<r>.json`` records present (pid, create_time, device, memory...), by rank."""
    out = []
    for p in sorted(dir.glob("rank*.json")):
        with contextlib.suppress(OSError, ValueError):
            rec = json.loads(read_private(p))
            if isinstance(rec, dict) and isinstance(rec.get("rank"), int):
                out.append(rec)
    return sorted(out, key=lambda r: r["rank"])


def remove_pool_files(dir: Path, instance: str | None = None) -> None:
    """Remove socket, token, pool.json and rank files. With ``instance`` given, only when
    ``pool.json`` still belongs to that instance: a newer pool's files, or those of a launch that
    has removed the old ``pool.json`` and not yet written its own, are left alone."""
    if instance is not None:
        info = PoolInfo.read(dir)
        if info is None or info.instance != instance:
            return
    names = [SOCKET_NAME, TOKEN_NAME, INFO_NAME] + [p.name for p in dir.glob("rank*.json")]
    names += [p.name for p in dir.glob("rank*.error")]
    for name in names:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(dir / name)


@contextlib.contextmanager
def launch_lock(dir: Path, timeout: float = 300.0) -> Iterator[None]:
    """Hold ``dir/launch.lock`` (flock) so only one process starts or attaches at a time.

    Raises:
        TimeoutError: another process held it for ``timeout`` seconds.
    """
    ensure_private_dir(dir)
    fd = os.open(dir / LOCK_NAME, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        deadline = time.monotonic() + timeout
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() > deadline:
                    raise TimeoutError(f"another process holds {dir / LOCK_NAME} (starting a pool?) "
                                       f"for over {timeout:.0f}s") from None
                time.sleep(0.05)
        yield
    finally:
        os.close(fd)  # releases the lock


# --------------------------------------------------------------------------- processes

def peer_credentials(sock: socket.socket) -> tuple[int, int, int]:
    """``(pid, uid, gid)`` of the process at the other end of a connected AF_UNIX socket, as the
    kernel recorded it at ``connect``/``listen`` (``SO_PEERCRED``, Linux ``unix(7)``)."""
    raw = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    pid, uid, gid = struct.unpack("3i", raw)
    return pid, uid, gid


def is_pool_process(p: psutil.Process, dir: Path) -> bool:
    """Whether ``p`` is a process of the pool in ``dir``, proven before it is signalled: it runs
    as this user and its command line names ``dir`` (torchrun and every rank are started with
    ``--runtime-dir dir``), so a ``pool.json`` or rank record naming an unrelated process is not
    obeyed."""
    try:
        return p.uids().real == os.getuid() and os.fspath(dir) in p.cmdline()
    except psutil.Error:
        return False


def is_alive(p: psutil.Process) -> bool:
    """Whether ``p`` (the same process, not a reused pid) runs; a zombie counts as gone."""
    try:
        return p.is_running() and p.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def wait_gone(procs: list[psutil.Process], timeout: float) -> list[psutil.Process]:
    """Wait up to ``timeout`` seconds for ``procs`` to exit (reaping our own children);
    returns those still alive. Unlike ``psutil.wait_procs`` a zombie that is not our child
    (its parent is a non-reaping init) counts as gone at once."""
    deadline = time.monotonic() + timeout
    while True:
        for p in procs:
            with contextlib.suppress(ChildProcessError, OSError):
                os.waitpid(p.pid, os.WNOHANG)  # reap it if it is our child
        alive = [p for p in procs if is_alive(p)]
        if not alive or time.monotonic() >= deadline:
            return alive
        time.sleep(0.05)


def kill_processes(procs: list[psutil.Process], grace: float = 5.0) -> None:
    """SIGTERM ``procs``, wait up to ``grace`` seconds, SIGKILL the survivors, wait for them."""
    alive = []
    for p in procs:
        if is_alive(p):
            with contextlib.suppress(psutil.Error):
                p.send_signal(signal.SIGTERM)
                alive.append(p)
    alive = wait_gone(alive, grace)
    for p in alive:
        with contextlib.suppress(psutil.Error):
            p.kill()
    wait_gone(alive, 5.0)
