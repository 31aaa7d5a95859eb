"""``python -m ltx_mgpu encode``: prompts -> LTX-2 embeddings (one safetensors file) through the
embedding cache, in this process or in the sidecar pool (``--pool``), with progress bars on stderr
(pool start or attach, Gemma load, encode batches) as ``generate`` draws them."""

from __future__ import annotations

import argparse
import sys
import warnings
from pathlib import Path

from ltx_mgpu.assets import EMBEDDED_GEMMA
from ltx_mgpu.choices import PLACEMENTS, WEIGHTS
from ltx_mgpu.cli.checks import check_device, check_paths_exist
from ltx_mgpu.cli.wording import plural

__all__ = ["register", "read_prompts", "EMBEDDED_NOTICE"]

EMBEDDED_NOTICE = (
    "note: no model paths given, using the embedded default ({gemma} and a tiny LTX-2 projection): "
    "the numbers exercise the pipeline, they carry no meaning"
)


def read_prompts(args: argparse.Namespace) -> list[str]:
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


def _expected_misses(cache, config, prompts: list[str]) -> int:
    """How many prompts the encode will likely run Gemma for: the distinct ones without a cache
    file (an unreadable entry turns out a miss later), or every prompt without a cache."""
    from ltx_mgpu.text.cache.keys import cache_key_parts  # deferred: loads torch

    if cache is None:
        return len(prompts)
    parts = cache_key_parts(config)
    return sum(not cache.path_for(p, parts).is_file() for p in dict.fromkeys(prompts))


def _encode_here(args: argparse.Namespace, config, prompts: list[str], cache, progress):
    """The in-process encode (:meth:`ltx_mgpu.text.encoder.local.LocalTextEncoder.encode`), its
    ``load_text_encoder`` and ``encode`` phases reported to ``progress``."""
    from ltx_mgpu.text.encoder.local import LocalTextEncoder

    return LocalTextEncoder(config, args.device).encode(prompts, args.batch_size, cache, progress)


def _pool_fate(pool: dict) -> str:
    """What became of the pool: attached, or started here and stopped, or handed over."""
    if not pool["started"]:
        return "attached"
    if pool.get("stopped", True):
        return "started for this run and stopped"
    return "started for this run; left running for another client that uses it (it stops when they are done)"


def _encode(args: argparse.Namespace, config, prompts: list[str], cache, progress):
    """``encode``'s work: in the pool (``--pool``) or in this process; ``(embeddings, report)``.
    ``progress(phase, step, total)`` receives ``pool`` (0/1 before the pool is started or
    attached, only when some prompt is not cached; 1/1 at its first event), ``load_text_encoder``
    and ``encode``."""
    if not args.pool:
        return _encode_here(args, config, prompts, cache, progress)
    from ltx_mgpu.cli.pool import cli_gpus  # deferred: the pool needs torch.distributed
    from ltx_mgpu.client.text import encode_with_pool

    pending = [_expected_misses(cache, config, prompts) > 0]
    if pending[0]:
        progress("pool", 0, 1)

    def pool_progress(phase: str, step: int, total: int) -> None:
        if pending[0]:  # the pool answers: it runs
            pending[0] = False
            progress("pool", 1, 1)
        progress(phase, step, total)

    gpus, nproc = cli_gpus(args.gpus, args.nproc, starting=True)
    embeddings, report, pool = encode_with_pool(config, prompts, gpus=gpus, nproc=nproc,
                                                runtime_dir=args.runtime_dir, cache=cache,
                                                batch_size=args.batch_size, on_progress=pool_progress)
    if pending[0]:
        progress("pool", 1, 1)
    print("pool: not contacted (every prompt cached)" if pool["pid"] is None else
          f"pool: pid {pool['pid']}, {pool['world_size']} rank(s), placement {args.placement}, "
          f"{_pool_fate(pool)}")
    if pool["pid"] is not None and args.placement != "single" and pool["world_size"] == 1:
        print(f"note: placement {args.placement} on a 1-rank pool is the same as 'single'; it spreads "
              "Gemma over several ranks (--gpus 0,1 or --gpus cpu --nproc 2)")
    return embeddings, report


def _check_arguments(args: argparse.Namespace) -> list[str]:
    """Every check of ``encode``'s arguments that needs no torch (the prompts, flags that go
    together, numbers, the paths' existence, the output place); returns the prompts.

    Raises:
        ValueError, FileNotFoundError: naming the flag and the fix (the CLI exits 2).
    """
    from ltx_mgpu.files import check_directory_setting, check_output_path  # deferred: loads safetensors

    prompts = read_prompts(args)
    gemma, projection = args.gemma, args.projection
    if (gemma is None) != (projection is None):
        raise ValueError(f"--{'gemma' if gemma is not None else 'projection'} was given without "
                         f"--{'projection' if gemma is not None else 'gemma'}: pass both (a Gemma 3 and the LTX-2 "
                         "checkpoint or projection file made for it), or neither for the embedded default")
    check_paths_exist(gemma=gemma, projection=projection)
    if args.batch_size < 1:
        raise ValueError(f"--batch-size {args.batch_size}: give at least 1 prompt per Gemma forward")
    check_output_path(args.out)  # before any encode; missing directories are made when it is written
    if Path(args.out).suffix.lower() != ".safetensors":
        raise ValueError(f"--out {args.out}: embeddings are written as safetensors; give a name ending in "
                         ".safetensors")
    if args.cache:
        check_directory_setting(args.cache, "--cache")
    if args.runtime_dir:
        check_directory_setting(args.runtime_dir, "--runtime-dir")
    if not args.pool and (args.gpus is not None or args.nproc is not None or args.placement != "single"):
        raise ValueError("--gpus, --nproc and --placement choose the pool's ranks: add --pool (without it, "
                         "encode runs in this process on --device)")
    return prompts


def _cmd_encode(args: argparse.Namespace) -> int:
    prompts = _check_arguments(args)  # before torch is imported: a bad argument answers at once
    from ltx_mgpu.cli.generate import ProgressBars  # deferred, as everything below: imports torch
    from ltx_mgpu.text.cache.keys import default_cache_dir
    from ltx_mgpu.text.cache.store import EmbeddingCache
    from ltx_mgpu.text.config import TextEncoderConfig
    from ltx_mgpu.text.embedding_files import save_embeddings

    gemma, projection = args.gemma, args.projection
    check_device(args.device)
    if gemma is None or projection is None:
        from ltx_mgpu.assets import embedded_default

        ckpt, gemma_thunk, label = embedded_default(args.embedded_gemma, args.embedded_version)
        if gemma is None and projection is None:
            print(EMBEDDED_NOTICE.format(gemma=label), file=sys.stderr)
        gemma = gemma if gemma is not None else gemma_thunk()
        projection = projection if projection is not None else ckpt
    config = TextEncoderConfig(gemma=gemma, projection=projection, weights=args.weights, placement=args.placement,
                               dtype=args.dtype, truncate=not args.no_truncate, compile=args.compile)
    cache = None if args.no_cache else EmbeddingCache(args.cache or default_cache_dir())
    if args.compile:
        print("note: --compile: Gemma's layers compile during the first batches (once per kind of batch), "
              "so the first encode ticks come late", file=sys.stderr)
    bars = ProgressBars(args.progress)
    try:
        with warnings.catch_warnings():  # reported below, once per prompt, without a warning's source line
            warnings.filterwarnings("ignore", message=r"prompt \d+ is longer than the")
            embeddings, report = _encode(args, config, prompts, cache, bars)
    finally:
        bars.close()
    for i, e in enumerate(embeddings):
        if e.dropped_tokens:
            print(f"note: prompt {i} is longer than the {config.token_budget}-token budget: its last "
                  f"{e.dropped_tokens} tokens were dropped (--no-truncate makes that an error)", file=sys.stderr)
    out = save_embeddings(args.out, prompts, embeddings)
    for p, e in zip(prompts, embeddings):
        short = p if len(p) <= 60 else p[:57] + "..."
        print(f"  {plural(e.num_tokens, 'token'):>12} x {e.tensor.shape[1]} (LTX-{e.version})  {short!r}")
    print(f"{report}")
    print(f"wrote {plural(len(embeddings), 'embedding')} to {out}")
    return 0


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add the subcommand to the ``python -m ltx_mgpu`` parser."""
    p = subparsers.add_parser("encode", help="encode prompts to LTX-2 embeddings (safetensors); "
                                             "--pool: in the GPU pool",
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
    p.add_argument("--cache", help="embedding cache directory (default: $LTX_MGPU_CACHE_DIR, else "
                                   "<ltx_mgpu home>/embeddings; docs/operations.md)")
    p.add_argument("--no-cache", action="store_true", help="do not read or write the cache")
    p.add_argument("--batch-size", type=int, default=8, help="prompts per Gemma forward (default 8)")
    p.add_argument("--weights", choices=WEIGHTS, default="bf16", help="Gemma weights mode")
    p.add_argument("--device", default="cpu", help="torch device for Gemma (default cpu)")
    p.add_argument("--dtype", default="bfloat16", help="compute dtype: bfloat16 (default) or float32")
    p.add_argument("--no-truncate", action="store_true", help="fail on prompts over 1024 tokens")
    p.add_argument("--compile", action="store_true",
                   help="run Gemma's layers through torch.compile (bf16 weights; compiled when Gemma loads and for "
                        "new kinds of batch; faster encodes after that)")
    p.add_argument("--embedded-version", choices=["2.0", "2.3"], default="2.3",
                   help="layout of the embedded tiny checkpoint (2.0 uses the tiny Gemma: the 270M pairs with 2.3)")
    p.add_argument("--embedded-gemma", choices=EMBEDDED_GEMMA, default="auto",
                   help="Gemma of the embedded default: the real Gemma 3 270M when its package is installed "
                        "(auto), or the tiny random one")
    p.add_argument("--pool", action="store_true",
                   help="encode in the sidecar pool: attach to the one started with the same --gpus/--nproc, "
                        "else start one for this run")
    p.add_argument("--gpus", default=None, help="with --pool: a rank count N (GPUs 0..N-1; N CPU ranks without a "
                                                "GPU), GPU indices like 0,1 (3, for GPU 3 alone), 'all' (default) or "
                                                "'cpu' (with --nproc)")
    p.add_argument("--nproc", type=int, default=None, help="with --pool: number of ranks (CPU pools)")
    p.add_argument("--placement", choices=PLACEMENTS, default="single",
                   help="with --pool: where Gemma runs (default single: rank 0)")
    p.add_argument("--runtime-dir", default=None, help="with --pool: base of the pool's private directory")
    p.add_argument("--no-progress", dest="progress", action="store_false",
                   help="no progress bars (by default they go to stderr: pool, Gemma load, encode)")
    p.set_defaults(func=_cmd_encode)
