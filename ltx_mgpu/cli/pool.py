"""``python -m ltx_mgpu pool start|stop|status``: the pool from the command line.

* ``pool start [--gpus 0,1|cpu|all] [--nproc N] [--detach] [--runtime-dir D]``: start a pool
  (or report the one already running). ``--detach`` leaves it running after the command exits
  (lifetime ``detached``); without it the command stays in the foreground and the pool stops
  when the command ends (Ctrl-C).
* ``pool stop``: shut the pool down (gracefully, then by signal) and remove its files.
* ``pool status [--json]``: per-rank devices, memory and models, the queue and current job.

``stop`` and ``status`` without ``--gpus``/``--nproc`` act on every pool under the runtime
base directory. Importing this module loads neither torch nor the client (``--help`` stays
fast); the commands import them.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from ltx_mgpu.client.spec import PoolSpec
    from ltx_mgpu.wire.rendezvous import PoolInfo

__all__ = ["register", "cli_gpus"]


def cli_gpus(gpus: str | None, nproc: int | None) -> tuple[str | None, int | None]:
    """``--gpus`` as every command reads it: a bare count ``N`` is N ranks (GPUs 0..N-1 when torch
    sees GPUs, else N CPU ranks), as ``generate --gpus N`` takes it, so the same ``--gpus``
    attaches to the same pool; indices need a comma (``0,1``; ``3,`` for GPU 3 alone); ``all``
    and ``cpu`` are unchanged. Returns the ``(gpus, nproc)`` that ``ltx_mgpu.client.spec.resolve_spec`` takes.

    Raises:
        ValueError: a count below 1, or ``--nproc`` disagreeing with the count.
    """
    if gpus is None or not gpus.strip().isdigit():
        return gpus, nproc
    n = int(gpus)
    if n < 1:
        raise ValueError(f"--gpus {gpus}: give a rank count of at least 1, or GPU indices with a comma (--gpus 0, "
                         "for GPU 0 alone)")
    if nproc is not None and nproc != n:
        raise ValueError(f"--gpus {gpus} --nproc {nproc}: a bare --gpus is the rank count already; give one of them")
    import torch  # deferred: --help and argument errors stay fast

    if not torch.cuda.is_available():
        return "cpu", n
    return ",".join(map(str, range(n))), None


def _add_common(p: argparse.ArgumentParser) -> None:
    p.add_argument("--gpus", default=None,
                   help="a rank count N (GPUs 0..N-1; N CPU ranks without a GPU), GPU indices like 0,1 (3, for "
                        "GPU 3 alone), 'all' (default: every visible GPU, or one CPU rank when there is none) or "
                        "'cpu' (CPU ranks on gloo, with --nproc)")
    p.add_argument("--nproc", type=int, default=None, help="number of ranks (CPU pools; one per GPU otherwise)")
    p.add_argument("--runtime-dir", default=None,
                   help="base of the pool's private directory (default $LTX_MGPU_RUNTIME_DIR, $XDG_RUNTIME_DIR/"
                        "ltx_mgpu, else <ltx_mgpu home>/run: $LTX_MGPU_HOME or ~/.cache/ltx_mgpu)")


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add the ``pool`` command (with ``start``, ``stop``, ``status``) to a subparsers object."""
    pool = subparsers.add_parser("pool", help="start, stop or inspect the sidecar GPU pool")
    sub = pool.add_subparsers(dest="pool_command", required=True)
    p = sub.add_parser("start", help="start a pool (or report the running one)")
    _add_common(p)
    p.add_argument("--detach", action="store_true", help="keep the pool running after this command exits")
    p.add_argument("--timeout", type=float, default=300.0, help="start-up timeout in seconds (default 300)")
    p.add_argument("--master-port", type=int, default=None, help="rendezvous port to try first (default: a free one)")
    p.set_defaults(func=cmd_start)
    p = sub.add_parser("stop", help="stop the pool (every pool under the base dir without --gpus/--nproc)")
    _add_common(p)
    p.set_defaults(func=cmd_stop)
    p = sub.add_parser("status", help="show ranks, memory, models and jobs (of every pool without --gpus/--nproc); "
                                      "exits 1 when no pool runs, so scripts can test for one")
    _add_common(p)
    p.add_argument("--json", action="store_true", help="print the raw status as JSON")
    p.set_defaults(func=cmd_status)


def _spec(args: argparse.Namespace, lifetime: str = "detached") -> PoolSpec:
    from ltx_mgpu.client.spec import resolve_spec

    args.gpus, args.nproc = cli_gpus(args.gpus, args.nproc)
    return resolve_spec(args.gpus, args.nproc, lifetime, args.runtime_dir)


def cmd_start(args: argparse.Namespace) -> int:
    from ltx_mgpu.client import launch
    from ltx_mgpu.client.pool_client import PoolClient
    from ltx_mgpu.wire.rendezvous import LOG_NAME, SOCKET_NAME

    lifetime = "detached" if args.detach else "with-owner"
    spec = _spec(args, lifetime)
    live = launch.find_live_pool(spec.dir) if spec.dir.is_dir() else None
    if live is not None:
        print(f"a pool is already running: pid {live.pid}, {live.nproc} rank(s) on {live.device}, "
              f"lifetime {live.lifetime}, dir {spec.dir}")
        return 0
    client = PoolClient.connect(gpus=args.gpus, nproc=args.nproc, lifetime=lifetime,
                                runtime_dir=args.runtime_dir, startup_timeout=args.timeout,
                                master_port=args.master_port)
    print(f"started pool pid {client.pid}: {spec.nproc} rank(s) on {spec.device}, lifetime {lifetime}, "
          f"socket {spec.dir / SOCKET_NAME}, log {spec.dir / LOG_NAME}", flush=True)
    if args.detach:
        client.close()
        return 0
    print("running in the foreground; Ctrl-C stops the pool", flush=True)
    try:
        while launch.find_live_pool(spec.dir) is not None:
            time.sleep(1.0)
        print("the pool exited", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        client.shutdown()
        print("pool stopped")
        return 0


def _live_pools(args: argparse.Namespace) -> list[PoolInfo]:
    """The live pool of ``--gpus``/``--nproc``, or, when neither is given, every live pool
    under the runtime base directory."""
    from ltx_mgpu.client import launch
    from ltx_mgpu.client.discovery import live_pools

    if args.gpus is None and args.nproc is None:
        return live_pools(args.runtime_dir)
    d = _spec(args).dir
    info = launch.find_live_pool(d) if d.is_dir() else None
    return [info] if info is not None else []


def _none_running(args: argparse.Namespace) -> str:
    """What to say when no pool matched: which set was asked for, and the pools that do run."""
    from ltx_mgpu.client.spec import runtime_base

    base = runtime_base(args.runtime_dir)
    if args.gpus is None and args.nproc is None:
        return f"no pool is running under {base}"
    others = _live_pools(argparse.Namespace(**{**vars(args), "gpus": None, "nproc": None}))
    asked = " ".join(f"--{k} {v}" for k, v in (("gpus", args.gpus), ("nproc", args.nproc)) if v is not None)
    running = ", ".join(Path(i.dir).name for i in others)
    return (f"no pool for {asked} is running under {base}"
            + (f"; running: {running} (leave out --gpus/--nproc to act on every pool)" if others else ""))


def cmd_stop(args: argparse.Namespace) -> int:
    from ltx_mgpu.client import launch

    pools = _live_pools(args)
    if not pools:
        print(_none_running(args))
        return 0
    for info in pools:
        launch.stop(Path(info.dir))
        print(f"stopped pool pid {info.pid} ({info.dir})")
    return 0


def cmd_status(args: argparse.Namespace) -> int:
    from ltx_mgpu.client.discovery import format_status, spec_of
    from ltx_mgpu.client.errors import PoolError
    from ltx_mgpu.client.pool_client import PoolClient

    pools = _live_pools(args)
    if not pools:
        print(_none_running(args))
        return 1
    code = 0
    for info in pools:
        client = PoolClient(spec_of(info), start=False)
        try:
            status = client.status()
        except PoolError as e:
            print(f"error: the pool in {info.dir} (pid {info.pid}) does not answer: {e}", file=sys.stderr)
            code = 1
            continue
        finally:
            client.close()
        print(json.dumps(status, indent=1) if args.json else format_status(status))
    return code
