"""``python -m ltx_mgpu``: the engine's command line.

Subcommands: ``make-assets`` (build the embedded tiny models), ``encode`` (prompts ->
LTX-2 embeddings through the cache), ``pool`` (start/stop/status of the sidecar pool,
when available). Every subcommand prints what it did and exits non-zero with a one-line
message on bad input.
"""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path
from typing import Sequence

EMBEDDED_NOTICE = (
    "note: no model paths given, using the embedded default (a tiny random Gemma 3 and a tiny "
    "LTX-{version} projection): the numbers exercise the pipeline, they carry no meaning"
)


def _cmd_make_assets(args: argparse.Namespace) -> int:
    from ltx_mgpu.assets import make_assets

    for name, path in make_assets(args.root).items():
        print(f"{name}: {path}")
    return 0


def _read_prompts(args: argparse.Namespace) -> list[str]:
    prompts = list(args.prompt or [])
    if args.prompts_file:
        text = Path(args.prompts_file).read_text(encoding="utf-8")
        prompts += [line for line in text.splitlines() if line.strip()]
    if not prompts:
        raise SystemExit("error: give --prompt TEXT (repeatable) or --prompts-file FILE (one prompt per line)")
    return prompts


def _cmd_encode(args: argparse.Namespace) -> int:
    from ltx_mgpu.text.cache import EmbeddingCache, default_cache_dir
    from ltx_mgpu.text.encoder import TextEncoderSpec, encode_prompts, save_embeddings

    prompts = _read_prompts(args)
    gemma, projection = args.gemma, args.projection
    if gemma is None or projection is None:
        from ltx_mgpu import assets

        if gemma is None and projection is None:
            print(EMBEDDED_NOTICE.format(version=args.embedded_version), file=sys.stderr)
        if gemma is None:
            gemma = assets.tiny_gemma_dir()
        if projection is None:
            projection = assets.tiny_ltx_checkpoint(args.embedded_version)
    spec = TextEncoderSpec(gemma=gemma, projection=projection, weights=args.weights, device=args.device,
                           dtype=args.dtype, truncate=not args.no_truncate)
    cache = None if args.no_cache else EmbeddingCache(args.cache or default_cache_dir())
    embeddings, report = encode_prompts(spec, prompts, batch_size=args.batch_size, cache=cache)
    out = save_embeddings(args.out, prompts, embeddings)
    for p, e in zip(prompts, embeddings):
        short = p if len(p) <= 60 else p[:57] + "..."
        print(f"  {e.num_tokens:5d} tokens x {e.tensor.shape[1]} (LTX-{e.version})  {short!r}")
    print(f"{report}")
    print(f"wrote {len(embeddings)} embedding(s) to {out}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m ltx_mgpu", description=__doc__.split("\n\n")[0])
    parser.add_argument("-v", "--verbose", action="store_true", help="log more")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("make-assets", help="build the embedded tiny models (idempotent)")
    p.add_argument("--root", help="directory to build into (default: the ltx_mgpu cache)")
    p.set_defaults(func=_cmd_make_assets)

    p = sub.add_parser("encode", help="encode prompts to LTX-2 embeddings (safetensors)")
    p.add_argument("--gemma", help="Gemma 3: HF snapshot dir, ComfyUI single file, or NF4 artifact dir")
    p.add_argument("--projection", help="LTX-2 checkpoint or text projection file (text_embedding_projection.*)")
    p.add_argument("--prompt", action="append", help="a prompt (repeatable)")
    p.add_argument("--prompts-file", help="a text file, one prompt per line")
    p.add_argument("--out", required=True, help="output .safetensors file")
    p.add_argument("--cache", help="embedding cache directory (default: see README)")
    p.add_argument("--no-cache", action="store_true", help="do not read or write the cache")
    p.add_argument("--batch-size", type=int, default=8, help="prompts per Gemma forward (default 8)")
    p.add_argument("--weights", choices=["bf16", "nf4"], default="bf16", help="Gemma weights mode")
    p.add_argument("--device", default="cpu", help="torch device for Gemma (default cpu)")
    p.add_argument("--dtype", default="bfloat16", help="compute dtype: bfloat16 (default) or float32")
    p.add_argument("--no-truncate", action="store_true", help="fail on prompts over 1024 tokens")
    p.add_argument("--embedded-version", choices=["2.0", "2.3"], default="2.3",
                   help="layout of the embedded tiny checkpoint when --projection is not given")
    p.set_defaults(func=_cmd_encode)

    try:
        from ltx_mgpu.pool import commands as pool_commands
    except ImportError:  # the pool is optional on platforms without torch.distributed
        pool_commands = None
    if pool_commands is not None and hasattr(pool_commands, "register"):
        pool_commands.register(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING,
                        format="%(levelname)s %(name)s: %(message)s")
    try:
        return int(args.func(args) or 0)
    except (FileNotFoundError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
