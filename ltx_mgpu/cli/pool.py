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
import os
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING

from ltx_mgpu.cli.checks import cpu_ranks_instead

if TYPE_CHECKING:
    from ltx_mgpu.client.spec import PoolSpec
    from ltx_mgpu.wire.rendezvous import PoolInfo

__all__ = ["register", "cli_gpus"]


def cli_gpus(gpus: str | None, nproc: int | None, starting: bool = False) -> tuple[str | None, int | None]:
    """``--gpus`` as every command reads it: a bare count ``N`` is N ranks (GPUs 0..N-1 when torch
    sees GPUs, else N CPU ranks), as ``generate --gpus N`` takes it, so the same ``--gpus``
    attaches to the same pool; indices need a comma (``0,1``; ``3,`` for GPU 3 alone); ``all``
    and ``cpu`` are unchanged. Returns the ``(gpus, nproc)`` that ``ltx_mgpu.client.spec.resolve_spec`` takes.

    ``starting`` (``pool start``, ``encode --pool``): a count that becomes CPU ranks because torch
    sees no GPU prints one warning line on stderr, or is refused where the machine has NVIDIA GPUs
    torch cannot see, as is the default (every GPU) then
    (:func:`ltx_mgpu.cli.checks.cpu_ranks_instead`).

    Raises:
        ValueError: a count below 1, ``--nproc`` disagreeing with the count, or (``starting``)
            GPUs present that torch does not see.
    """
    if gpus is not None and not gpus.strip().isdigit():
        return gpus, nproc
    n = None if gpus is None else int(gpus)
    if n is not None and n < 1:
        raise ValueError(f"--gpus {gpus}: give a rank count of at least 1, or GPU indices with a comma (--gpus 0, "
                         "for GPU 0 alone)")
    if n is not None and nproc is not None and nproc != n:
        raise ValueError(f"--gpus {gpus} --nproc {nproc}: a bare --gpus is the rank count already; give one of them")
    if n is None and not (starting and nproc is None):
        return gpus, nproc
    import torch  # deferred: --help and argument errors stay fast

    if n is None:  # the default, every GPU: CPU ranks when torch sees none
        if not torch.cuda.is_available():  # raises where the machine has GPUs torch cannot see; else nothing
            cpu_ranks_instead("the default (every GPU)", 1, "--gpus cpu --nproc N")  # was asked: no warning
        return gpus, nproc
    if not torch.cuda.is_available():
        if starting:
            print(cpu_ranks_instead(f"--gpus {gpus}", n, f"--gpus cpu --nproc {n}"), file=sys.stderr)
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


def _spec(args: argparse.Namespace, lifetime: str = "detached", starting: bool = False) -> PoolSpec:
    from ltx_mgpu.client.spec import resolve_spec

    args.gpus, args.nproc = cli_gpus(args.gpus, args.nproc, starting)
    return resolve_spec(args.gpus, args.nproc, lifetime, args.runtime_dir)


def cmd_start(args: argparse.Namespace) -> int:
    from ltx_mgpu.client import launch
    from ltx_mgpu.client.pool_client import PoolClient
    from ltx_mgpu.wire.rendezvous import LOG_NAME, SOCKET_NAME, PoolInfo

    lifetime = "detached" if args.detach else "with-owner"
    spec = _spec(args, lifetime, starting=True)
    live = launch.find_live_pool(spec.dir) if spec.dir.is_dir() else None
    if live is not None:
        print(_already_running(live))
        return 0
    client = PoolClient.connect(gpus=args.gpus, nproc=args.nproc, lifetime=lifetime,
                                runtime_dir=args.runtime_dir, startup_timeout=args.timeout,
                                master_port=args.master_port)
    if not client.launched:  # another process started it meanwhile (it held the launch lock): attached
        info = PoolInfo.read(spec.dir)
        client.close()
        print(_already_running(info, meanwhile=True) if info is not None else
              f"a pool is already running: pid {client.pid}, dir {spec.dir} (another process started it "
              "meanwhile); not started again")
        return 0
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


def _already_running(info: PoolInfo, meanwhile: bool = False) -> str:
    """What ``pool start`` says when it found a pool running and started none (``meanwhile``:
    another process started it while this one waited for the launch lock)."""
    until = (f" (it stops when its owner, pid {info.owner_pid}, is done and no client uses it)"
             if info.lifetime == "with-owner" else "")
    return (f"a pool is already running{' (another process started it meanwhile)' if meanwhile else ''}: "
            f"pid {info.pid}, {info.nproc} rank(s) on {info.device}, lifetime {info.lifetime}{until}, "
            f"dir {info.dir}; not started again")


def _live_pools(args: argparse.Namespace) -> list[PoolInfo]:
    """The live pool of ``--gpus``/``--nproc``, or, when neither is given, every live pool
    under the runtime base directory."""
    from ltx_mgpu.client import launch
    from ltx_mgpu.client.discovery import live_pools
    from ltx_mgpu.client.spec import runtime_base
    from ltx_mgpu.wire.rendezvous import check_private_dir

    base = runtime_base(args.runtime_dir)
    if os.path.lexists(base):  # a link or another user's: refused, never read or signalled through
        check_private_dir(base)
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
        if launch.stop(Path(info.dir)):
            print(f"stopped pool pid {info.pid} ({info.dir})")
        else:  # it ended meanwhile: nothing of it was signalled
            print(f"pool pid {info.pid} ({info.dir}) had already exited; removed its files")
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
        except PermissionError:  # an impostor serves the socket: refused, one line (exit 2)
            raise
        except PoolError as e:
            print(f"error: the pool in {info.dir} (pid {info.pid}) does not answer: {e}", file=sys.stderr)
            code = 1
            continue
        finally:
            client.close()
        print(json.dumps(status, indent=1) if args.json else format_status(status))
    return code
