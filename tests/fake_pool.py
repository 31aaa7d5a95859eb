"""A fake pool for the client's fast lifecycle tests: the real rank-0 socket server
(``ltx_mgpu.pool.server.Server``: the handshake, the queue, cancel, status, shutdown) driven by a
stub job loop instead of torchrun, torch.distributed and the engines. It starts in well under a
second, so attach, restart after a fatal error, the cancel timeout and the sweep of a lost
pool's processes can be tested in seconds (``tests/integration/test_client_lifecycle.py``); the same
behaviour against real pools is the integration tier's (``tests/integration/test_pool_lifecycle.py``).

    python tests/fake_pool.py --runtime-dir D [--ranks N] [--behaviour B] [--owner-pid P]

It plays torchrun and rank 0 in one process (``torchrun_pid`` is its own pid) and starts
``N - 1`` idle child processes as the other ranks, recorded in ``rank<r>.json`` as real ranks
are. The behaviour of each job (any job type; ``selftest``'s ``steps`` and ``step_seconds`` are
honoured) is read from ``D/fake_behaviour`` when that file exists, else ``--behaviour``:

* ``serve``: one ``progress`` per step, a cancel stops it at the next step (``cancelled``), then
  a result ``{"steps_done", "pid"}``;
* ``fatal``: ``error{fatal}`` to the job, then the pool exits (a rank failed);
* ``die``: the process exits at once, without a word (``kill -9``; its ranks are left behind as
  orphans, which the client that sees the loss must sweep);
* ``hang``: the job is accepted and never answered; cancels are ignored.

A ``with-owner`` fake stops when its owner has left and no other client uses it, as the real
pool does (``ltx_mgpu.pool.server``).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import psutil

import ltx_mgpu
from ltx_mgpu import wire
from ltx_mgpu.pool.server import Server
from ltx_mgpu.wire import rendezvous

BEHAVIOURS = ("serve", "fatal", "die", "hang")
BEHAVIOUR_FILE = "fake_behaviour"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="fake_pool")
    ap.add_argument("--runtime-dir", required=True)
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--behaviour", choices=BEHAVIOURS, default="serve")
    ap.add_argument("--lifetime", default="detached")
    ap.add_argument("--owner-pid", type=int, default=None)
    ap.add_argument("--owner-create-time", type=float, default=None)
    args, _ = ap.parse_known_args(argv)
    d = Path(args.runtime_dir)
    me = psutil.Process()
    # idle "ranks", started with the runtime directory on their command line as real ranks are
    children = [subprocess.Popen([sys.executable, "-c", "import time; time.sleep(3600)", "--runtime-dir", str(d)])
                for _ in range(args.ranks - 1)]
    ranks = [{"rank": 0, "pid": me.pid, "create_time": rendezvous.process_start(me.pid)}]
    for r, c in enumerate(children, start=1):
        ranks.append({"rank": r, "pid": c.pid, "create_time": rendezvous.process_start(c.pid)})
        rendezvous.write_private(d / f"rank{r}.json", json.dumps(ranks[-1]).encode())
    info = rendezvous.PoolInfo.read(d)

    def describe() -> dict:
        return {"version": ltx_mgpu.__version__, "protocol": wire.PROTOCOL_VERSION, "world_size": args.ranks,
                "device": "cpu", "gpus": [], "lifetime": args.lifetime, "owner_pid": args.owner_pid,
                "torchrun_pid": me.pid, "torchrun_create_time": rendezvous.process_start(me.pid), "ranks": ranks,
                "instance": info.instance if info else None, "start_time": time.time(), "dir": str(d),
                "jobs": sorted(wire.job_types())}

    def end(code: int) -> None:
        for c in children:
            c.kill()
        rendezvous.remove_pool_files(d, info.instance if info else None)
        os._exit(code)

    owned = args.lifetime == "with-owner" and args.owner_pid
    server = Server(d / rendezvous.SOCKET_NAME, rendezvous.read_token(d), describe, lambda: ranks,
                    owner=args.owner_pid if owned else None)
    server.start()
    if owned:
        def watch_owner() -> None:  # as the real pool's watchdog
            while rendezvous.same_process(args.owner_pid, args.owner_create_time):
                time.sleep(0.2)
            server.owner_gone(f"its owner process {args.owner_pid} exited")

        threading.Thread(target=watch_owner, daemon=True).start()
    print(f"fake pool ready: {args.ranks} rank(s), socket {server.socket_path}", flush=True)
    while True:
        job = server.next_job(0.2)
        if job is None:
            if server.stopping:
                server.close()
                end(0)
            continue
        behaviour = args.behaviour
        if (d / BEHAVIOUR_FILE).exists():
            behaviour = (d / BEHAVIOUR_FILE).read_text().strip()
        if behaviour == "die":
            os._exit(9)  # no cleanup: its ranks and files stay behind, as after kill -9
        if behaviour == "fatal":
            server.fail_all("rank 1 failed: RuntimeError: a deliberate fault of the fake pool")
            end(1)
        if behaviour == "hang":
            while True:
                time.sleep(3600)
        steps = int(job.request.params.get("steps", 3))
        pause = float(job.request.params.get("step_seconds", 0.0))
        done = 0
        for step in range(steps):
            if server.cancel_requested(job):
                break
            time.sleep(pause)
            done = step + 1
            server.emit_progress(job, job.type, done, steps)
        if done < steps:
            server.fail(job, "cancelled", f"job {job.id} cancelled after {done} of {steps} steps")
        else:
            server.finish(job, {"steps_done": done, "pid": me.pid}, None)


if __name__ == "__main__":
    sys.exit(main())
