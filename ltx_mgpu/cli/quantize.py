"""``python -m ltx_mgpu quantize-nf4``: a Gemma 3 source -> an NF4 artifact directory (which
``encode --gemma`` and the Gemma Loader then load)."""

from __future__ import annotations

import argparse
import errno
import sys
from pathlib import Path

from ltx_mgpu.cli.checks import check_device

__all__ = ["register"]


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
    from ltx_mgpu.text.nf4.artifact import artifact_bytes, read_manifest
    from ltx_mgpu.text.nf4.quantize import quantize_nf4

    def size(n: float) -> str:
        return f"{n / 1e9:.2f} GB" if n >= 1e8 else f"{n / 1e6:.2f} MB"

    check_device(args.device)
    check_directory_setting(args.out_dir, "OUT_DIR")  # no file in its path (an existing one: quantize_nf4 says)
    rss_before = _peak_rss()
    t0 = time.perf_counter()
    try:
        out = quantize_nf4(args.source, args.out_dir, device=args.device)
    except FileExistsError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except OSError as e:
        if e.errno != errno.ENOSPC:
            raise
        print(f"error: {e.strerror}", file=sys.stderr)  # where, and how much is needed; nothing is left behind
        return 1
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


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add the subcommand to the ``python -m ltx_mgpu`` parser."""
    p = subparsers.add_parser("quantize-nf4", help="quantize a Gemma 3 text tower to an NF4 artifact directory")
    p.add_argument("source", help="Gemma 3: HF snapshot dir or ComfyUI single file (bf16, fp16 or fp8)")
    p.add_argument("out_dir", help="the artifact directory to create (must not exist)")
    p.add_argument("--device", default=None,
                   help="where to quantize: the device that will run it (default: cuda if available, else cpu)")
    p.set_defaults(func=_cmd_quantize_nf4)
