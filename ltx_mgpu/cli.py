"""``python -m ltx_mgpu``: the engine's command line.

Subcommands: ``make-assets`` (build the embedded tiny models), ``encode`` (prompts ->
LTX-2 embeddings through the cache), ``quantize-nf4`` (a Gemma 3 source -> an NF4 artifact
directory, which ``encode --gemma`` then loads), ``pool`` (start/stop/status of the sidecar
pool, when available), ``generate`` (prompt -> MP4 through the pool; ``ltx_mgpu.generate_cli``)
and ``bench`` (the benchmarks this machine can run; ``ltx_mgpu.bench_cli``). Every subcommand
prints what it did and exits non-zero with a one-line message on bad input.
"""

from __future__ import annotations

import argparse
import logging
import sys
import warnings
from pathlib import Path
from typing import Sequence

EMBEDDED_NOTICE = (
    "note: no model paths given, using the embedded default ({gemma} and a tiny LTX-2 projection): "
    "the numbers exercise the pipeline, they carry no meaning"
)


def _cmd_make_assets(args: argparse.Namespace) -> int:
    from ltx_mgpu.assets import make_assets

    for name, path in make_assets(args.root).items():
        print(f"{name}: {path}")
    return 0


def _read_prompts(args: argparse.Namespace) -> list[str]:
    """``--prompt`` s, then ``--prompts-file`` 's non-empty lines.

    Raises:
        ValueError: the file is missing, not a file, unreadable or not UTF-8, or holds no prompt;
            no prompt at all. Each names the flag and the fix (the CLI exits 2).
    """
    prompts = list(args.prompt or [])
    if args.prompts_file:
        path = Path(args.prompts_file)
        if not path.is_file():
            what = "a directory" if path.is_dir() else "not a regular file" if path.exists() else "no such file"
            raise ValueError(f"--prompts-file {path}: {what}; give a text file with one prompt per line")
        try:
            text = path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as e:
            raise ValueError(f"--prompts-file {path}: cannot be read as UTF-8 text ({e})") from None
        found = [line for line in text.splitlines() if line.strip()]
        if not found:
            raise ValueError(f"--prompts-file {path} holds no prompt: write one prompt per line")
        prompts += found
    if not prompts:
        raise ValueError("give --prompt TEXT (repeatable) or --prompts-file FILE (one prompt per line)")
    return prompts


def _encode(args: argparse.Namespace, spec, prompts: list[str], cache):
    """``encode``'s work: in the pool (``--pool``) or in this process; ``(embeddings, report)``."""
    from ltx_mgpu.text.spec import encode_prompts

    if args.pool:
        from ltx_mgpu.pool.commands import cli_gpus
        from ltx_mgpu.remote_text import encode_with_pool

        gpus, nproc = cli_gpus(args.gpus, args.nproc)
        embeddings, report, pool = encode_with_pool(spec, prompts, placement=args.placement, gpus=gpus,
                                                    nproc=nproc, runtime_dir=args.runtime_dir, cache=cache,
                                                    batch_size=args.batch_size)
        print("pool: not contacted (every prompt cached)" if pool["pid"] is None else
              f"pool: pid {pool['pid']}, {pool['world_size']} rank(s), placement {args.placement}, "
              f"{'started for this run and stopped' if pool['started'] else 'attached'}")
        if pool["pid"] is not None and args.placement != "single" and pool["world_size"] == 1:
            print(f"note: placement {args.placement} on a 1-rank pool is the same as 'single'; it spreads "
                  "Gemma over several ranks (--gpus 0,1 or --gpus cpu --nproc 2)")
    else:
        embeddings, report = encode_prompts(spec, prompts, batch_size=args.batch_size, cache=cache)
    return embeddings, report


def _cmd_encode(args: argparse.Namespace) -> int:
    from ltx_mgpu.text.cache import EmbeddingCache, default_cache_dir
    from ltx_mgpu.text.spec import TextEncoderSpec
    from ltx_mgpu.files import check_directory_setting, check_output_path
    from ltx_mgpu.text.embedding_files import save_embeddings

    prompts = _read_prompts(args)
    gemma, projection = args.gemma, args.projection
    if (gemma is None) != (projection is None):
        raise ValueError(f"--{'gemma' if gemma is not None else 'projection'} was given without "
                         f"--{'projection' if gemma is not None else 'gemma'}: pass both (a Gemma 3 and the LTX-2 "
                         "checkpoint or projection file made for it), or neither for the embedded default")
    _check_device(args.device)
    check_output_path(args.out)  # before any encode; missing directories are made when it is written
    if Path(args.out).suffix.lower() != ".safetensors":
        raise ValueError(f"--out {args.out}: embeddings are written as safetensors; give a name ending in "
                         ".safetensors")
    if args.cache:
        check_directory_setting(args.cache, "--cache")
    if not args.pool and (args.gpus is not None or args.nproc is not None or args.placement != "single"):
        raise ValueError("--gpus, --nproc and --placement choose the pool's ranks: add --pool (without it, "
                         "encode runs in this process on --device)")
    if gemma is None or projection is None:
        from ltx_mgpu.assets import embedded_default

        ckpt, gemma_thunk, label = embedded_default(args.embedded_gemma, args.embedded_version)
        if gemma is None and projection is None:
            print(EMBEDDED_NOTICE.format(gemma=label), file=sys.stderr)
        gemma = gemma if gemma is not None else gemma_thunk()
        projection = projection if projection is not None else ckpt
    spec = TextEncoderSpec(gemma=gemma, projection=projection, weights=args.weights, device=args.device,
                           dtype=args.dtype, truncate=not args.no_truncate, compile=args.compile)
    cache = None if args.no_cache else EmbeddingCache(args.cache or default_cache_dir())
    with warnings.catch_warnings():  # reported below, once per prompt, without a warning's source line
        warnings.filterwarnings("ignore", message=r"prompt \d+ is longer than the")
        embeddings, report = _encode(args, spec, prompts, cache)
    for i, e in enumerate(embeddings):
        if e.dropped_tokens:
            print(f"note: prompt {i} is longer than the {spec.token_budget}-token budget: its last "
                  f"{e.dropped_tokens} tokens were dropped (--no-truncate makes that an error)", file=sys.stderr)
    out = save_embeddings(args.out, prompts, embeddings)
    for p, e in zip(prompts, embeddings):
        short = p if len(p) <= 60 else p[:57] + "..."
        print(f"  {e.num_tokens:5d} tokens x {e.tensor.shape[1]} (LTX-{e.version})  {short!r}")
    print(f"{report}")
    print(f"wrote {len(embeddings)} embedding(s) to {out}")
    return 0


def _peak_rss() -> int:
    """Peak resident set size of this process in bytes: ``VmHWM`` from ``/proc/self/status`` (Linux;
    reset at exec, unlike ``ru_maxrss``, which a child inherits from a large parent), else
    ``getrusage`` (KiB on Linux, bytes on macOS)."""
    import resource

    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return rss if sys.platform == "darwin" else rss * 1024


def _cmd_quantize_nf4(args: argparse.Namespace) -> int:
    import time

    from ltx_mgpu.files import check_directory_setting
    from ltx_mgpu.text.nf4 import quantize_nf4
    from ltx_mgpu.text.nf4_artifact import artifact_bytes, read_manifest

    def size(n: float) -> str:
        return f"{n / 1e9:.2f} GB" if n >= 1e8 else f"{n / 1e6:.2f} MB"

    _check_device(args.device)
    check_directory_setting(args.out_dir, "OUT_DIR")  # no file in its path (an existing one: quantize_nf4 says)
    rss_before = _peak_rss()
    t0 = time.perf_counter()
    try:
        out = quantize_nf4(args.source, args.out_dir, device=args.device)
    except FileExistsError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    seconds = time.perf_counter() - t0
    peak = _peak_rss()
    manifest = read_manifest(out)
    n_nf4 = sum(1 for p in manifest["parameters"].values() if p["dtype"] == "nf4")
    print(f"wrote NF4 artifact {out}: {size(artifact_bytes(out))} in {len(manifest['files'])} shard(s), "
          f"{n_nf4} NF4 projection weights, quantized on {manifest['quantization']['device']} in {seconds:.1f} s")
    print(f"peak RSS of this process: {size(peak)} (before quantizing: {size(rss_before)})")
    print(f"use it with: python -m ltx_mgpu encode --gemma {out} --projection <LTX-2 checkpoint or projection "
          "file> --prompt ...  (or generate --gemma ... --checkpoint ...)")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m ltx_mgpu",
                                     description="LTX-2 multi-GPU engine: prompt encoding with Gemma 3, the sidecar "
                                                 "GPU pool, and video generation through it.")
    parser.add_argument("-v", "--verbose", action="store_true", help="log more")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("make-assets", help="build the embedded tiny models (idempotent)")
    p.add_argument("--root", help="directory to build into (default: the ltx_mgpu cache)")
    p.set_defaults(func=_cmd_make_assets)

    p = sub.add_parser("encode", help="encode prompts to LTX-2 embeddings (safetensors); --pool: in the GPU pool",
                       description="Encode prompts to LTX-2 prompt embeddings (one safetensors file), taking what "
                                   "the embedding cache already holds. Without --gemma/--projection the embedded "
                                   "default is used (a real Gemma 3 270M when its package is installed).")
    p.add_argument("--gemma", help="Gemma 3: HF snapshot dir, ComfyUI single file, or NF4 artifact dir "
                                   "(with --projection)")
    p.add_argument("--projection", help="LTX-2 checkpoint or text projection file (text_embedding_projection.*; "
                                        "with --gemma)")
    p.add_argument("--prompt", action="append", help="a prompt (repeatable)")
    p.add_argument("--prompts-file", help="a text file, one prompt per line")
    p.add_argument("--out", required=True, help="output .safetensors file (missing directories are made)")
    p.add_argument("--cache", help="embedding cache directory (default: see README)")
    p.add_argument("--no-cache", action="store_true", help="do not read or write the cache")
    p.add_argument("--batch-size", type=int, default=8, help="prompts per Gemma forward (default 8)")
    p.add_argument("--weights", choices=["bf16", "nf4"], default="bf16", help="Gemma weights mode")
    p.add_argument("--device", default="cpu", help="torch device for Gemma (default cpu)")
    p.add_argument("--dtype", default="bfloat16", help="compute dtype: bfloat16 (default) or float32")
    p.add_argument("--no-truncate", action="store_true", help="fail on prompts over 1024 tokens")
    p.add_argument("--compile", action="store_true",
                   help="run Gemma's layers through torch.compile (bf16 weights; compiled when Gemma loads and for "
                        "new kinds of batch). Measured with one static 1024-token shape of Gemma 3 12B: 42 vs 73 ms "
                        "eager on an H200; the shape-generic graphs prompts of varying length run on are not yet timed")
    p.add_argument("--embedded-version", choices=["2.0", "2.3"], default="2.3",
                   help="layout of the embedded tiny checkpoint (2.0 uses the tiny Gemma: the 270M pairs with 2.3)")
    p.add_argument("--embedded-gemma", choices=["auto", "gemma-270m", "tiny"], default="auto",
                   help="Gemma of the embedded default: the real Gemma 3 270M when its package is installed "
                        "(auto), or the tiny random one")
    p.add_argument("--pool", action="store_true",
                   help="encode in the sidecar pool: attach to the one started with the same --gpus/--nproc, "
                        "else start one for this run")
    p.add_argument("--gpus", default=None, help="with --pool: a rank count N (GPUs 0..N-1; N CPU ranks without a "
                                                "GPU), GPU indices like 0,1 (3, for GPU 3 alone), 'all' (default) or "
                                                "'cpu' (with --nproc)")
    p.add_argument("--nproc", type=int, default=None, help="with --pool: number of ranks (CPU pools)")
    p.add_argument("--placement", choices=["single", "accelerate", "batch_parallel"], default="single",
                   help="with --pool: where Gemma runs (default single: rank 0)")
    p.add_argument("--runtime-dir", default=None, help="with --pool: base of the pool's private directory")
    p.set_defaults(func=_cmd_encode)

    p = sub.add_parser("quantize-nf4", help="quantize a Gemma 3 text tower to an NF4 artifact directory")
    p.add_argument("source", help="Gemma 3: HF snapshot dir or ComfyUI single file (bf16, fp16 or fp8)")
    p.add_argument("out_dir", help="the artifact directory to create (must not exist)")
    p.add_argument("--device", default=None,
                   help="where to quantize: the device that will run it (default: cuda if available, else cpu)")
    p.set_defaults(func=_cmd_quantize_nf4)

    try:
        from ltx_mgpu.pool import commands as pool_commands
    except ImportError:  # the pool is optional on platforms without torch.distributed
        pool_commands = None
    if pool_commands is not None and hasattr(pool_commands, "register"):
        pool_commands.register(sub)
        from ltx_mgpu import bench_cli, generate_cli

        generate_cli.register(sub)
        bench_cli.register(sub)
    return parser


def _check_device(name: str | None) -> None:
    """Refuse a device torch cannot use here, before any loading.

    Raises:
        ValueError: not a device name, or a CUDA device without a CUDA GPU (the message says what to pass).
    """
    if name is None:
        return
    import torch

    try:
        device = torch.device(name)
    except RuntimeError:
        raise ValueError(f"--device {name}: not a device; use cpu, cuda or cuda:N") from None
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"--device {name}: torch sees no CUDA GPU here (a CPU-only build, or no driver); "
                         "use --device cpu")


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING,
                        format="%(levelname)s %(name)s: %(message)s")
    if not args.verbose:  # transformers' per-load tqdm bars ("Loading weights") are noise here
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()
    try:
        return int(args.func(args) or 0)
    except (FileNotFoundError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:  # a second Ctrl-C (generate) or one outside a pool job: one line, no traceback
        print("\naborted", file=sys.stderr)
        return 130
    except BrokenPipeError:  # the reader went away (``| head``): stop quietly, as Unix tools do
        import os

        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0
