"""``python -m ltx_mgpu``: the engine's command line, one module per subcommand.

Subcommands: ``make-assets`` (build the embedded tiny models; :mod:`ltx_mgpu.cli.assets`),
``encode`` (prompts -> LTX-2 embeddings through the cache; :mod:`ltx_mgpu.cli.encode`),
``quantize-nf4`` (a Gemma 3 source -> an NF4 artifact directory; :mod:`ltx_mgpu.cli.quantize`),
``pool`` (start/stop/status of the sidecar pool, when available; :mod:`ltx_mgpu.cli.pool`),
``generate`` (prompt -> MP4 through the pool; :mod:`ltx_mgpu.cli.generate`) and ``bench`` (the
benchmarks this machine can run; :mod:`ltx_mgpu.cli.bench`). Every subcommand prints what it
did and exits non-zero with a one-line message on bad input. Building the parser imports no
torch: the command modules import torch and the engine inside their functions, so ``--help`` and
argument errors stay fast (``tests/integration/test_cli_newcomer.py`` checks).
"""

from __future__ import annotations

import argparse
import importlib.util
import logging
import os
import sys
from typing import Sequence

from ltx_mgpu.cli import assets, bench, encode, generate, pool, quantize
from ltx_mgpu.client.errors import PoolError  # dependency-free: --help stays light

__all__ = ["build_parser", "main", "pool_can_run"]


def pool_can_run() -> bool:
    """Whether this platform has what the pool's runtime imports (POSIX ``fcntl`` locks); the pool,
    ``generate`` and ``bench`` commands are offered only then. Imports nothing itself."""
    return importlib.util.find_spec("fcntl") is not None


def build_parser() -> argparse.ArgumentParser:
    """The ``python -m ltx_mgpu`` parser with every subcommand this platform can run."""
    parser = argparse.ArgumentParser(prog="python -m ltx_mgpu",
                                     description="LTX-2 multi-GPU engine: prompt encoding with Gemma 3, the sidecar "
                                                 "GPU pool, and video generation through it.")
    parser.add_argument("-v", "--verbose", action="store_true", help="log more")
    sub = parser.add_subparsers(dest="command", required=True)
    assets.register(sub)
    encode.register(sub)
    quantize.register(sub)
    if not pool_can_run():  # the pool is optional on platforms without it
        return parser
    pool.register(sub)
    generate.register(sub)
    bench.register(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING,
                        format="%(levelname)s %(name)s: %(message)s")
    if not args.verbose:  # transformers' per-load tqdm bars ("Loading weights") are noise here; through the
        # environment, read when transformers is first imported (importing it here would cost every
        # command, a bad argument's answer included, its import time)
        os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    try:
        return int(args.func(args) or 0)
    except (FileNotFoundError, PermissionError, ValueError) as e:  # bad input, or a place that cannot be trusted
        print(f"error: {e}", file=sys.stderr)  # (a runtime directory that is a link, another user's, an impostor)
        return 2
    except PoolError as e:  # the pool failed or refused: its message (and log tail), not a traceback
        print(f"error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:  # a second Ctrl-C (generate) or one outside a pool job: one line, no traceback
        print("\naborted", file=sys.stderr)
        return 130
    except BrokenPipeError:  # the reader went away (``| head``): stop quietly, as Unix tools do
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0
