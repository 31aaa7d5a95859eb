"""``python -m ltx_mgpu make-assets``: build the embedded tiny models (idempotent)."""

from __future__ import annotations

import argparse

__all__ = ["register"]


def _cmd_make_assets(args: argparse.Namespace) -> int:
    from ltx_mgpu.assets import make_assets

    for name, path in make_assets(args.root).items():
        print(f"{name}: {path}")
    return 0


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add the subcommand to the ``python -m ltx_mgpu`` parser."""
    p = subparsers.add_parser("make-assets", help="build the embedded tiny models (idempotent)")
    p.add_argument("--root", help="directory to build into (default: the ltx_mgpu cache)")
    p.set_defaults(func=_cmd_make_assets)
