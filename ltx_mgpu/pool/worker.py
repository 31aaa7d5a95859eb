"""Every rank's main loop (``python -m ltx_mgpu.pool.worker``, started by torchrun).

Rank 0 runs the socket server (``ltx_mgpu.pool.server``) and the job loop; every other rank
waits for rank 0's control messages. Control travels over a CPU gloo group: a 3-int64 header
``[kind, json_bytes, payload_bytes]`` then, for a job, its JSON spec and its input tensors
as a safetensors blob. While idle, rank 0 broadcasts a TICK every ``$LTX_MGPU_TICK_SECONDS``
(1 s), so idle ranks wait in a short gloo broadcast (never inside NCCL) and a dead rank is
noticed within a tick. After each job every rank all-gathers its outcome (ok / bad_input /
cancelled); ranks that disagree make the job fatal. A one-rank pool has nobody to tell or
agree with and skips all of this (a per-request cost, with occasional long outliers, that buys
nothing there).

Failure handling: an unexpected exception on rank 0, or SIGTERM/SIGINT (torchrun sends SIGTERM
to every rank when one of them died; a thread of its own takes it, so this works while the main
thread waits inside NCCL), sends ``error{fatal}`` to the clients, removes the socket and
``pool.json`` and exits 1; on another rank an exception writes ``rank<r>.error`` and exits 1,
and torchrun ends the rest.
A watchdog thread per rank refreshes ``rank<r>.json`` (pid, device, memory, models) every
second, exits when torchrun is gone, and on rank 0 tells the server when the owner of a ``with-owner``
pool died (it stops then, or once the clients that attached meanwhile are done: ``ltx_mgpu.pool.server``).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import sys
import threading
import time
import traceback
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any

import psutil
import torch
import torch.distributed as dist

import ltx_mgpu
from ltx_mgpu import settings, wire
from ltx_mgpu.choices import LIFETIMES
from ltx_mgpu.pool.engines import BadInput, JobCancelled, JobContext, ModelStore, resolve_engine
from ltx_mgpu.pool.profiling import JobProfiler
from ltx_mgpu.pool.server import Job, Server
from ltx_mgpu.wire import rendezvous

TICK_SECONDS = settings.TICK_SECONDS.get()
WATCH_SECONDS = 1.0
COLLECTIVE_TIMEOUT = settings.COLLECTIVE_TIMEOUT.get()
_TICK, _JOB, _SHUTDOWN = 0, 1, 2
_OK, _BAD_INPUT, _CANCELLED = 0, 1, 2
_OUTCOME = {_OK: "ok", _BAD_INPUT: "bad_input", _CANCELLED: "cancelled"}


@dataclass(eq=False)
class Rank:
    """This process's place in the pool."""

    rank: int
    world_size: int
    local_rank: int
    device: torch.device
    control: Any
    data: Any
    dir: Path
    args: argparse.Namespace
    models: ModelStore = field(default_factory=ModelStore)
    profiler: JobProfiler = field(default_factory=JobProfiler)
    peers: list = field(default_factory=list)  # [{"rank", "pid", "create_time"}] of every rank
    info: rendezvous.PoolInfo | None = None

    @property
    def record_path(self) -> Path:
        return self.dir / f"rank{self.rank}.json"

    def record(self) -> dict:
        """This rank's ``status`` entry: pid, device, intra-op CPU threads, memory (bytes),
        resident models."""
        proc = psutil.Process()
        rec = {"rank": self.rank, "pid": os.getpid(), "create_time": rendezvous.process_start(os.getpid()),
               "device": str(self.device), "threads": torch.get_num_threads(), "models": self.models.describe(),
               "updated": time.time()}
        if self.device.type == "cuda":
            free, total = torch.cuda.mem_get_info(self.device)
            rec["memory"] = {"allocated": torch.cuda.memory_allocated(self.device),
                             "reserved": torch.cuda.memory_reserved(self.device),
                             "free": free, "total": total, "rss": proc.memory_info().rss}
        else:
            rec["memory"] = {"allocated": None, "reserved": None, "rss": proc.memory_info().rss,
                             "total": psutil.virtual_memory().total}
        return rec

    def write_record(self) -> None:
        rendezvous.write_private(self.record_path, json.dumps(self.record()).encode())


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="ltx_mgpu.pool.worker")
    p.add_argument("--runtime-dir", required=True)
    p.add_argument("--device", choices=["cpu", "cuda"], required=True)
    p.add_argument("--lifetime", choices=LIFETIMES, default="detached")
    p.add_argument("--owner-pid", type=int)
    p.add_argument("--owner-create-time", type=float)
    return p.parse_args(argv)


def setup(args: argparse.Namespace) -> Rank:
    """Initialise the process groups (data: NCCL on GPU / gloo on CPU; control: gloo), exchange
    pids, and all-reduce once on the data group (a start-up communication check: a broken NCCL
    setup fails or times out here, before the socket appears)."""
    rank, world, local = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), int(os.environ["LOCAL_RANK"])
    timeout = timedelta(seconds=COLLECTIVE_TIMEOUT)
    if args.device == "cuda":
        torch.cuda.set_device(local)
        device = torch.device("cuda", local)
        dist.init_process_group("nccl", device_id=device, timeout=timeout)
    else:
        device = torch.device("cpu")
        dist.init_process_group("gloo", timeout=timeout)
    control = dist.new_group(backend="gloo", timeout=timeout)
    state = Rank(rank, world, local, device, control, dist.group.WORLD, Path(args.runtime_dir), args)
    mine = torch.tensor([os.getpid(), round(rendezvous.process_start(os.getpid()) * 1e6)], dtype=torch.int64)
    every = [torch.zeros(2, dtype=torch.int64) for _ in range(world)]
    dist.all_gather(every, mine, group=control)
    state.peers = [{"rank": r, "pid": int(t[0]), "create_time": int(t[1]) / 1e6} for r, t in enumerate(every)]
    probe = torch.ones(1, device=device)  # the data plane works before the pool calls itself ready
    dist.all_reduce(probe, group=state.data)
    if int(probe.item()) != world:
        raise RuntimeError(f"start-up all-reduce on the data group gave {probe.item()}, expected {world}")
    state.info = rendezvous.PoolInfo.read(state.dir)
    state.write_record()
    return state


# --------------------------------------------------------------------------- control messages

def send_control(state: Rank, kind: int, spec: dict | None = None, blob: bytes = b"") -> None:
    if state.world_size == 1:  # no other rank to tell
        return
    raw = json.dumps(spec).encode() if spec is not None else b""
    dist.broadcast(torch.tensor([kind, len(raw), len(blob)], dtype=torch.int64), src=0, group=state.control)
    if raw or blob:
        dist.broadcast(torch.frombuffer(bytearray(raw + blob), dtype=torch.uint8), src=0, group=state.control)


def recv_control(state: Rank) -> tuple[int, dict | None, dict]:
    head = torch.zeros(3, dtype=torch.int64)
    dist.broadcast(head, src=0, group=state.control)
    kind, nraw, nblob = (int(x) for x in head)
    if not nraw + nblob:
        return kind, None, {}
    buf = torch.empty(nraw + nblob, dtype=torch.uint8)
    dist.broadcast(buf, src=0, group=state.control)
    data = bytes(buf.numpy())
    return kind, json.loads(data[:nraw].decode()), wire.payload_to_tensors(data[nraw:])


# --------------------------------------------------------------------------- jobs

def run_job(state: Rank, spec: dict, tensors: dict, server: Server | None = None,
            job: Job | None = None) -> tuple[int, str, dict, dict]:
    """Run one job on this rank: ``(outcome, message, result, tensors)``. Exceptions other than
    ``BadInput`` / ``JobCancelled`` propagate (fatal). Raises RuntimeError when ranks disagree
    on the outcome."""
    ctx = JobContext(state.rank, state.world_size, state.local_rank, state.device, state.control, state.data,
                     state.models, spec["id"], spec["type"])
    if server is not None and job is not None:
        ctx._emit_progress = lambda phase, step, total: server.emit_progress(job, phase, step, total)
        ctx._emit_log = lambda level, message: server.emit_log(job, level, message)
        ctx._cancel_requested = lambda: server.cancel_requested(job)
        ctx._reserve_result = lambda nbytes: server.reserve_result(job, nbytes)
    code, message, result, out, reason = _OK, "", {}, {}, None
    try:
        handler = resolve_engine(spec["type"])
        with state.profiler.job(spec, state.rank, state.device, state.dir):
            result, out = handler(ctx, dict(spec["params"]), dict(tensors))
    except BadInput as e:
        code, message, reason = _BAD_INPUT, str(e) or type(e).__name__, e.reason
    except JobCancelled:
        code, message = _CANCELLED, f"{spec['type']} job {spec['id']} cancelled after {ctx.checks} step boundaries"
    if state.world_size == 1:
        outcomes = [code]
    else:
        codes = [torch.zeros(1, dtype=torch.int32) for _ in range(state.world_size)]
        dist.all_gather(codes, torch.tensor([code], dtype=torch.int32), group=state.control)
        outcomes = [int(c) for c in codes]
    if len(set(outcomes)) > 1:
        raise RuntimeError(f"ranks disagreed on the outcome of {spec['type']} job {spec['id']}: "
                           + ", ".join(f"rank {r} {_OUTCOME.get(o, o)}" for r, o in enumerate(outcomes))
                           + " (BadInput must be raised identically on every rank, before any collective)")
    if code == _BAD_INPUT and reason is not None:
        result = {"reason": reason}
    return code, message, result or {}, out or {}


def _rank0_loop(state: Rank, server: Server) -> None:
    while True:
        job = server.next_job(TICK_SECONDS)
        if job is None:
            if server.stopping:
                send_control(state, _SHUTDOWN)
                return
            send_control(state, _TICK)
            continue
        spec = {"id": job.id, "type": job.type, "params": job.request.params}
        if state.world_size > 1:  # the job's inputs go to the other ranks (a one-rank pool skips this)
            payload = wire.tensors_to_payload(job.request.tensors)
            send_control(state, _JOB, spec, payload.tobytes() if payload is not None else b"")
        code, message, result, out = run_job(state, spec, job.request.tensors, server, job)
        if code == _OK:
            server.finish(job, result, out)
        elif code == _BAD_INPUT:
            server.fail(job, "bad_input", message, reason=result.get("reason"))
        else:
            server.fail(job, "cancelled", message)
        del job, result, out  # a result's tensors may be shared memory handed to the client (result_buffers)


def _other_loop(state: Rank) -> None:
    while True:
        kind, spec, tensors = recv_control(state)
        if kind == _SHUTDOWN:
            return
        if kind == _JOB:
            run_job(state, spec, tensors)
            with contextlib.suppress(Exception):  # the status shows what the job loaded or freed at once
                state.write_record()
        del spec, tensors


# --------------------------------------------------------------------------- lifecycle

def _watchdog(state: Rank, server: Server | None) -> None:
    ppid = os.getppid()
    owner = (state.args.owner_pid, state.args.owner_create_time) if state.args.lifetime == "with-owner" else None
    while True:
        time.sleep(WATCH_SECONDS)
        with contextlib.suppress(Exception):
            state.write_record()
        if os.getppid() != ppid:  # torchrun is gone: nobody will clean up after us
            if server is not None:
                _die_rank0(state, server, "torchrun exited; the pool cannot continue")
            os._exit(1)
        if server is not None and owner and owner[0] and not rendezvous.same_process(*owner):
            server.owner_gone(f"its owner process {owner[0]} exited")


def _peer_report(state: Rank) -> str:
    """What the other ranks left behind: their ``rank<r>.error`` files, and which are gone."""
    time.sleep(0.2)  # a failing rank writes its error file just before it exits
    lines = []
    for peer in state.peers[1:]:
        with contextlib.suppress(OSError):
            lines.append((state.dir / f"rank{peer['rank']}.error").read_text().strip())
        if not rendezvous.same_process(peer["pid"], peer["create_time"]):
            lines.append(f"rank {peer['rank']} (pid {peer['pid']}) is gone (killed, crashed or out of memory?)")
    return "\n".join(lines)


_DYING = threading.Lock()
_TERMINATING_SIGNALS = {signal.SIGTERM, signal.SIGINT, signal.SIGHUP}


def _die_rank0(state: Rank | None, server: Server | None, why: str) -> None:
    """Rank 0's fatal end, from any thread: error{fatal} to the clients, files removed, exit 1."""
    if not _DYING.acquire(blocking=False):
        while True:  # another thread is already ending the process
            time.sleep(60)
    threading.Timer(15.0, os._exit, args=(1,)).start()  # hard deadline for the clean-up below
    print(f"[rank 0] fatal: {why}", file=sys.stderr, flush=True)
    if state is not None:
        peers = _peer_report(state)
        message = why + (f"\n{peers}" if peers else "") + f"\n(see {state.dir / rendezvous.LOG_NAME})"
        with contextlib.suppress(BaseException):
            if server is not None:
                server.fail_all(message)
        with contextlib.suppress(BaseException):
            rendezvous.remove_pool_files(state.dir, state.info.instance if state.info else None)
    sys.stderr.flush()
    os._exit(1)


def _watch_signals(holder: dict) -> None:
    """Route SIGTERM/SIGINT/SIGHUP on rank 0 to a thread of their own.

    CPython's C-level handler writes the signal number to the wakeup fd from whichever thread
    the kernel picked, so the clients hear about the end even while the main thread sits in a
    C call (an NCCL wait, a CUDA synchronize) where a Python handler would never run."""
    r, w = os.pipe()
    os.set_blocking(w, False)
    signal.set_wakeup_fd(w, warn_on_full_buffer=False)
    for sig in _TERMINATING_SIGNALS:
        signal.signal(sig, lambda signum, frame: None)
    wanted = {int(s) for s in _TERMINATING_SIGNALS}

    def run() -> None:
        while (data := os.read(r, 1)) and data[0] not in wanted:
            pass
        name = signal.Signals(data[0]).name if data else "wakeup pipe closed"
        _die_rank0(holder.get("state"), holder.get("server"),
                   f"the pool was terminated ({name}); torchrun stops every rank when one of them died, "
                   "or when it is stopped")

    threading.Thread(target=run, name="signals", daemon=True).start()


def _die_other(state: Rank, exc: BaseException) -> None:
    text = f"rank {state.rank} failed: {type(exc).__name__}: {exc}"
    with contextlib.suppress(BaseException):
        rendezvous.write_private(state.dir / f"rank{state.rank}.error", text.encode())
    traceback.print_exception(exc, file=sys.stderr)
    sys.stderr.flush()
    os._exit(1)


def _create_time(pid: int) -> float | None:
    try:
        return rendezvous.process_start(pid)
    except psutil.Error:
        return None


def describe(state: Rank) -> dict:
    """The pool description answered to ``hello`` (and inside ``status``)."""
    info = state.info
    return {"version": ltx_mgpu.__version__, "protocol": wire.PROTOCOL_VERSION,
            "world_size": state.world_size, "device": state.device.type, "gpus": info.gpus if info else [],
            "lifetime": state.args.lifetime, "owner_pid": state.args.owner_pid,
            "torchrun_pid": os.getppid(), "torchrun_create_time": _create_time(os.getppid()),
            "ranks": state.peers, "instance": info.instance if info else None,
            "start_time": info.start_time if info else None, "dir": str(state.dir),
            "jobs": sorted(wire.job_types())}


def _status_records(state: Rank) -> list:
    records = {r["rank"]: r for r in rendezvous.rank_records(state.dir)}
    records[0] = state.record()
    return [records[r] for r in sorted(records)]


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    holder: dict = {}
    if int(os.environ.get("RANK", "0")) == 0:
        _watch_signals(holder)
    state = setup(args)
    if state.rank != 0:
        threading.Thread(target=_watchdog, args=(state, None), name="watchdog", daemon=True).start()
        try:
            _other_loop(state)
        except BaseException as e:
            _die_other(state, e)
        with contextlib.suppress(OSError):
            os.unlink(state.record_path)
        dist.destroy_process_group()
        return 0

    holder["state"] = state
    server = Server(state.dir / rendezvous.SOCKET_NAME, rendezvous.read_token(state.dir), lambda: describe(state),
                    lambda: _status_records(state),
                    owner=args.owner_pid if args.lifetime == "with-owner" else None)
    try:
        server.start()
        holder["server"] = server
        threading.Thread(target=_watchdog, args=(state, server), name="watchdog", daemon=True).start()
        print(f"[rank 0] ltx_mgpu pool ready: {state.world_size} rank(s) on {state.device.type}, "
              f"socket {server.socket_path}", flush=True)
        _rank0_loop(state, server)
    except BaseException as e:
        traceback.print_exception(e, file=sys.stderr)
        _die_rank0(state, server, f"rank 0 failed: {type(e).__name__}: {e}")
    server.close()
    rendezvous.remove_pool_files(state.dir, state.info.instance if state.info else None)
    dist.destroy_process_group()
    print("[rank 0] ltx_mgpu pool stopped", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
