"""Start, find, attach to and stop sidecar pools (``torchrun`` + N ``ltx_mgpu.pool.worker`` ranks).

``launch`` starts ``python -m torch.distributed.run --nproc-per-node N --master-addr 127.0.0.1
--master-port P ... -m ltx_mgpu.pool.worker ...`` in its own session with a curated
environment (:func:`worker_env`), retrying on a fresh port when the rendezvous port is taken,
and waits until rank 0 answers ``hello``. ``find_live_pool`` / ``ping`` attach, ``stop`` ends a
pool (``shutdown`` request, then SIGTERM, then SIGKILL) and removes its files. The runtime
directory and its files are described in :mod:`ltx_mgpu.wire.rendezvous`.

Lifetimes: ``with-owner`` (the default for clients: rank 0 polls the owner pid and the pool
exits when the owner dies) and ``detached`` (``python -m ltx_mgpu pool start --detach``).
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import secrets
import shutil
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import psutil
import torch

import ltx_mgpu
from ltx_mgpu import settings, wire
from ltx_mgpu.client.errors import PoolError, PoolStartError, PoolTrustError
from ltx_mgpu.client.spec import PoolSpec
from ltx_mgpu.wire.rendezvous import (
    INFO_NAME,
    LOG_NAME,
    SOCKET_NAME,
    TOKEN_NAME,
    PoolInfo,
    check_private_dir,
    ensure_private_dir,
    is_alive,
    is_pool_process,
    kill_processes,
    launch_lock,
    log_tail,
    peer_credentials,
    process_start,
    rank_records,
    read_token,
    remove_pool_files,
    same_process,
    wait_gone,
    write_private,
)

log = logging.getLogger(__name__)

_PORT_CONFLICT = ("EADDRINUSE", "address already in use", "Address already in use")
_DROP_ENV = {"MASTER_ADDR", "MASTER_PORT", "RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE",
             "GROUP_RANK", "GROUP_WORLD_SIZE", "ROLE_RANK", "ROLE_NAME", "ROLE_WORLD_SIZE",
             "CUDA_VISIBLE_DEVICES", "PYTORCH_CUDA_ALLOC_CONF", "OMP_NUM_THREADS", "PYTHONSTARTUP",
             "PYTHONINSPECT", "PYTHONHOME"}
_DROP_ENV_PREFIXES = ("TORCHELASTIC_", "PET_")  # PET_* are read by torchrun as argument defaults


# --------------------------------------------------------------------------- talking to a pool

def open_socket(dir: Path, timeout: float | None = 10.0) -> socket.socket:
    """Connect to the pool's socket and check who serves it: a process of this user that belongs
    to the pool ``pool.json`` describes (torchrun or one of its descendants), so an impostor
    bound to the path never sees a request.

    Raises:
        OSError (FileNotFoundError, ConnectionRefusedError): no one listens.
        PoolTrustError: the socket is served by another user's process, or by one that is not
            the pool's.
    """
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        s.settimeout(timeout)
        s.connect(os.fspath(dir / SOCKET_NAME))
        check_served_by_pool(s, dir)
        return s
    except BaseException:
        s.close()
        raise


def check_served_by_pool(sock: socket.socket, dir: Path) -> None:
    """Raise :class:`PoolTrustError` unless the peer of ``sock`` is this user's and descends from
    the torchrun process of ``dir/pool.json`` (``SO_PEERCRED``; a process is its own descendant)."""
    pid, uid, _ = peer_credentials(sock)
    if uid != os.getuid():
        raise PoolTrustError(f"the socket in {dir} is served by uid {uid}, not by you: not your pool; remove "
                        f"{dir} and start again")
    info = PoolInfo.read(dir)
    try:
        chain = [psutil.Process(pid), *psutil.Process(pid).parents()]
    except psutil.Error:
        chain = []
    if info is None or not any(p.pid == info.pid and same_process(p.pid, info.create_time) for p in chain):
        raise PoolTrustError(f"the socket in {dir} is served by pid {pid}, which is not the pool recorded in "
                        f"{dir / INFO_NAME}; stop it with `python -m ltx_mgpu pool stop` and start again")


def hello(sock: socket.socket, token: str, rid: str = "hello", hold: bool = False) -> dict:
    """Authenticate on a connected socket; returns the pool description (``result``). ``hold``:
    this client would start a pool of its own without this one, so a with-owner pool whose
    owner has left stays while it is connected (``ltx_mgpu.pool.server``).

    Raises:
        PoolError: the pool answered with an error (e.g. a wrong token).
        wire.ProtocolError / OSError: the exchange failed.
    """
    params = {"token": token, "pid": os.getpid(), "client": "ltx_mgpu", **({"hold": True} if hold else {})}
    wire.send_frame(sock, wire.make_request("hello", rid, params))
    header, _ = wire.recv_frame(sock)
    header = wire.parse_event(header)
    if header["event"] == "error":
        raise PoolError(f"pool refused hello: {header['message']}")
    if header["event"] != "result":
        raise wire.ProtocolError(f"unexpected answer to hello: {header['event']}")
    return header["result"]


def enable_features(sock: socket.socket, features: list[str], shm=None, rid: str = "features") -> list[str]:
    """Turn on optional protocol features (offered in the ``hello`` answer's ``features``) for
    this connection; returns those now on. ``shm``: the ``ltx_mgpu.wire.receiver.ArenaReceiver`` that
    reads the connection's frames once ``shm`` is on.

    Raises:
        PoolError: the pool answered with an error. wire.ProtocolError / OSError: the
            exchange failed.
    """
    wire.send_frame(sock, wire.make_request("features", rid, {"enable": list(features)}))
    header, _ = wire.recv_frame(sock, shm=shm)
    header = wire.parse_event(header)
    if header["event"] != "result":
        raise PoolError(f"pool refused features {features}: {header.get('message', header['event'])}")
    enabled = header["result"].get("enabled")
    if not (isinstance(enabled, list) and all(isinstance(f, str) for f in enabled)):
        raise wire.ProtocolError(f"bad answer to features: {header['result']!r:.200}")
    return enabled


def ping(dir: Path, timeout: float = 5.0) -> dict | None:
    """``hello`` round trip; the pool description, or ``None`` when it does not answer."""
    try:
        with contextlib.closing(open_socket(dir, timeout)) as s:
            return hello(s, read_token(dir))
    except (OSError, PoolError, wire.ProtocolError):
        return None


def find_live_pool(dir: Path, *, locked: bool = False) -> PoolInfo | None:
    """The pool whose ``pool.json`` is in ``dir`` when its torchrun still runs (``None`` when
    none does). The files of a pool that is not running are removed, but only under the
    directory's launch lock (held by the caller: ``locked``, or taken here when free): while
    another process holds it, a pool may be starting there (its token written, its
    ``pool.json`` not yet), and its files are left alone.

    Raises:
        PermissionError: ``dir`` is not a private directory of this user (a link, another
            user's, writable by others): nothing in it is read or removed.
    """
    if dir.exists() or dir.is_symlink():
        check_private_dir(dir)
    info = PoolInfo.read(dir)
    if info is not None and info.alive():
        return info
    if not dir.is_dir() or not any((dir / n).exists() for n in (INFO_NAME, TOKEN_NAME, SOCKET_NAME)):
        return None
    if locked:
        remove_pool_files(dir)
        return None
    with contextlib.suppress(TimeoutError), launch_lock(dir, timeout=0.0):
        info = PoolInfo.read(dir)  # it may have started meanwhile
        if info is not None and info.alive():
            return info
        if info is not None and same_process(info.pid, info.create_time):
            log.warning("%s names pid %d, which runs but is not a process of this pool (a stale or forged file): "
                        "the pool's files were removed and the process left alone", dir / INFO_NAME, info.pid)
        remove_pool_files(dir)
    return None


# --------------------------------------------------------------------------- launching

def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago (bind to port 0)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def repo_root() -> Path:
    """The directory holding the ``ltx_mgpu`` package (put on the workers' PYTHONPATH)."""
    return Path(ltx_mgpu.__file__).resolve().parent.parent


def worker_env(spec: PoolSpec, base: dict | None = None) -> dict[str, str]:
    """The workers' environment: the caller's, minus distributed/device variables it must not
    leak (``MASTER_*``, ``RANK``..., ``PET_*``, ``CUDA_VISIBLE_DEVICES``, ComfyUI's
    ``PYTORCH_CUDA_ALLOC_CONF``), plus explicit ``PYTHONPATH`` (repo root first),
    ``CUDA_VISIBLE_DEVICES`` (the pool's GPUs; empty on CPU), ``OMP_NUM_THREADS`` (the caller's,
    else physical cores / nproc, PyTorch's own default for one process, so SMT siblings are
    not oversubscribed; where the two counts agree (no SMT), nothing changes) and
    ``PYTHONUNBUFFERED``. NCCL_*/TORCH_*/NVSHMEM_* settings such as ``NCCL_NVLS_ENABLE=0``
    pass through unchanged."""
    src = dict(os.environ if base is None else base)
    env = {k: v for k, v in src.items() if k not in _DROP_ENV and not k.startswith(_DROP_ENV_PREFIXES)}
    env["PYTHONPATH"] = os.pathsep.join([str(repo_root())] + ([src["PYTHONPATH"]] if src.get("PYTHONPATH") else []))
    env["PYTHONUNBUFFERED"] = "1"
    cores = psutil.cpu_count(logical=False) or os.cpu_count() or 1
    env["OMP_NUM_THREADS"] = src.get("OMP_NUM_THREADS") or str(max(1, cores // spec.nproc))
    env["CUDA_VISIBLE_DEVICES"] = ",".join(map(str, spec.gpus))
    if spec.gpus:
        env["PYTORCH_CUDA_ALLOC_CONF"] = settings.CUDA_ALLOC_CONF.get(src)
    return env


def check_startable(spec: PoolSpec) -> None:
    """Raise a one-line ValueError naming the fix when a pool for ``spec`` cannot start here:
    it asks for GPUs and torch sees none, or ``$LTX_MGPU_PROFILE_JOBS`` is not a number
    (checked before anything starts or is written)."""
    settings.PROFILE_JOBS.get()
    if spec.gpus and not torch.cuda.is_available():
        raise ValueError(
            f"GPUs {','.join(map(str, spec.gpus))} requested, but torch sees no CUDA GPU (a CPU-only torch "
            "build, or no driver). Run CPU ranks instead: --gpus cpu --nproc N."
        )


def torchrun_command(spec: PoolSpec, port: int, owner: tuple[int, float] | None) -> list[str]:
    """``python -m torch.distributed.run ... -m ltx_mgpu.pool.worker ...`` for ``spec``."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "1", "--nproc-per-node", str(spec.nproc),
           "--master-addr", "127.0.0.1", "--master-port", str(port), "--max-restarts", "0",
           "--monitor-interval", "0.1", "--log-dir", str(spec.dir / "elastic"),
           "-m", "ltx_mgpu.pool.worker", "--runtime-dir", str(spec.dir), "--device", spec.device,
           "--lifetime", spec.lifetime]
    if owner is not None:
        cmd += ["--owner-pid", str(owner[0]), "--owner-create-time", repr(owner[1])]
    return cmd


@dataclass
class LaunchedPool:
    """A pool this process started: its ``info`` and the torchrun ``popen`` (to reap it)."""

    info: PoolInfo
    popen: subprocess.Popen


def _rotate_log(dir: Path) -> None:
    with contextlib.suppress(FileNotFoundError):
        os.replace(dir / LOG_NAME, dir / (LOG_NAME + ".1"))


def launch(spec: PoolSpec, *, owner_pid: int | None = None, master_port: int | None = None,
           startup_timeout: float = 300.0, attempts: int = 3) -> LaunchedPool:
    """Start a pool for ``spec`` and wait until it answers ``hello``. Call it under
    :func:`launch_lock` after :func:`find_live_pool` found none.

    ``master_port`` (else ``$LTX_MGPU_MASTER_PORT``, else a free port) is tried first; when
    the rendezvous port turns out to be taken, torchrun is restarted on a fresh free port (up
    to ``attempts`` times). ``owner_pid`` is required for ``with-owner``.

    Raises:
        PoolStartError: torchrun exited or the pool was not ready within ``startup_timeout``
            seconds; the message carries the tail of ``pool.log``.
        ValueError: GPUs were asked for but torch sees no CUDA GPU (checked before anything
            starts, so the user gets one line naming the fix instead of a torchrun traceback).
    """
    if spec.lifetime == "with-owner" and owner_pid is None:
        raise ValueError("a with-owner pool needs owner_pid")
    check_startable(spec)
    ensure_private_dir(spec.dir)
    remove_pool_files(spec.dir)
    shutil.rmtree(spec.dir / "elastic", ignore_errors=True)
    _rotate_log(spec.dir)
    owner = (owner_pid, process_start(owner_pid)) if owner_pid else None
    port = master_port or settings.MASTER_PORT.get()
    last = ""
    for attempt in range(attempts):
        port = port if (attempt == 0 and port) else free_port()
        write_private(spec.dir / TOKEN_NAME, secrets.token_hex(32).encode())
        with os.fdopen(os.open(spec.dir / LOG_NAME, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600), "ab") as log:
            start_offset = log.tell()
            log.write(f"--- ltx_mgpu pool launch, attempt {attempt + 1}, master port {port}\n".encode())
            log.flush()
            popen = subprocess.Popen(torchrun_command(spec, port, owner), env=worker_env(spec),
                                     stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                                     start_new_session=True, close_fds=True)
        info = PoolInfo(pid=popen.pid, create_time=process_start(popen.pid),
                        gpus=list(spec.gpus), nproc=spec.nproc, device=spec.device,
                        version=ltx_mgpu.__version__, protocol=wire.PROTOCOL_VERSION,
                        start_time=time.time(), lifetime=spec.lifetime, owner_pid=owner_pid,
                        master_port=port, instance=secrets.token_hex(8), dir=str(spec.dir))
        info.write()
        launched = LaunchedPool(info, popen)
        deadline = time.monotonic() + startup_timeout
        try:
            while True:
                if popen.poll() is not None:
                    last = log_tail(spec.dir, start=start_offset)
                    break
                if (spec.dir / SOCKET_NAME).exists() and ping(spec.dir, timeout=5.0) is not None:
                    return launched
                if time.monotonic() > deadline:
                    raise PoolStartError(f"the pool did not become ready within {startup_timeout:.0f}s; "
                                         f"log tail ({spec.dir / LOG_NAME}):\n{log_tail(spec.dir)}")
                time.sleep(0.05)
        except BaseException:  # timeout, or the caller interrupted (Ctrl-C, ComfyUI's Stop)
            _abort(launched, remove_files=True)
            raise
        _abort(launched, remove_files=False)
        if not is_port_conflict(last):
            break
    remove_pool_files(spec.dir)
    raise PoolStartError(f"the pool exited during start-up (exit code {popen.returncode}); "
                         f"log tail ({spec.dir / LOG_NAME}):\n{last}")


def _abort(launched: LaunchedPool, remove_files: bool) -> None:
    """Kill a pool that failed to start (its torchrun and any rank already up)."""
    dir = Path(launched.info.dir)
    kill_processes(pool_processes(dir, launched.info), grace=3.0)
    with contextlib.suppress(subprocess.TimeoutExpired):
        launched.popen.wait(timeout=5.0)
    if remove_files:
        remove_pool_files(dir)


# --------------------------------------------------------------------------- stopping

def pool_processes(dir: Path, info: PoolInfo | None = None) -> list[psutil.Process]:
    """The live processes of the pool in ``dir``: torchrun (checked by start time), its
    descendants, and every rank recorded in ``rank<r>.json`` (checked by start time). torchrun
    and the recorded ranks count only when :func:`~ltx_mgpu.wire.rendezvous.is_pool_process` proves
    them the pool's, so forged files never get an unrelated process signalled."""
    procs: dict[int, psutil.Process] = {}
    info = info or PoolInfo.read(dir)
    if info is not None and same_process(info.pid, info.create_time):
        with contextlib.suppress(psutil.Error):
            p = psutil.Process(info.pid)
            if is_pool_process(p, dir):
                procs[p.pid] = p
                for c in p.children(recursive=True):
                    procs[c.pid] = c
    for rec in rank_records(dir):
        if same_process(rec.get("pid"), rec.get("create_time")):
            with contextlib.suppress(psutil.Error):
                p = psutil.Process(rec["pid"])
                if is_pool_process(p, dir):
                    procs[p.pid] = p
    return list(procs.values())


def stop(dir: Path, *, launched: LaunchedPool | None = None, graceful: bool = True,
         timeout: float = 20.0, processes: list[psutil.Process] | None = None) -> bool:
    """Stop the pool in ``dir`` and remove its files; True when one was running.

    Graceful: a ``shutdown`` request over the socket, then up to ``timeout`` seconds for every
    process to exit; whatever remains gets SIGTERM, then SIGKILL. ``processes`` adds processes
    known from earlier (e.g. ranks of a pool whose files are already gone).
    """
    check_private_dir(dir)
    info = launched.info if launched else PoolInfo.read(dir)
    procs = pool_processes(dir, info)
    for p in processes or []:
        if p.pid not in {q.pid for q in procs} and is_alive(p):
            procs.append(p)
    was_running = bool(procs)
    if graceful and procs and (dir / SOCKET_NAME).exists():
        with contextlib.suppress(OSError, PoolError, wire.ProtocolError):
            with contextlib.closing(open_socket(dir, timeout=5.0)) as s:
                hello(s, read_token(dir))
                wire.send_frame(s, wire.make_request("shutdown", "shutdown", {"reason": "stop"}))
                wire.recv_frame(s)
            wait_gone(procs, timeout)
    kill_processes([p for p in procs if is_alive(p)], grace=5.0)
    if launched is not None:
        with contextlib.suppress(subprocess.TimeoutExpired):
            launched.popen.wait(timeout=5.0)
    if dir.is_dir():
        remove_pool_files(dir, info.instance if info else None)
        if info is None or not info.alive():
            remove_pool_files(dir)
    return was_running


def is_port_conflict(log_text: str) -> bool:
    """Whether a torchrun log says the rendezvous port was taken."""
    return any(s in log_text for s in _PORT_CONFLICT) or f"[Errno {errno.EADDRINUSE}]" in log_text
