"""``python -m ltx_mgpu generate``: the command line of :func:`ltx_mgpu.cli.pipeline.generate`, with
tqdm progress bars on stderr (pool start, Gemma load and encode, transformer load, denoising
steps from the pool's progress events, decode), the closing summary on stdout, and Ctrl-C
stopping the pool's work at its next step boundary (exit status 130).
"""

from __future__ import annotations

import argparse
import dataclasses
import signal
import sys
import threading

from ltx_mgpu.assets import EMBEDDED_GEMMA
from ltx_mgpu.choices import (
    PLACEMENTS,
    SP_LAYOUTS,
    TRANSFORMER_COMPILE,
    TRANSFORMER_DTYPES,
    TRANSFORMER_WEIGHTS,
    WEIGHTS,
)
from ltx_mgpu.cli.request import DEFAULT_NEGATIVE, GenerateRequest, validate_request
from ltx_mgpu.heartbeat import HEARTBEAT_S, Heartbeat

__all__ = ["ProgressBars", "StopOnInterrupt", "register"]


class ProgressBars:
    """A ``(phase, step, total)`` callback drawing one tqdm bar per phase on stderr; a bar closes
    when its phase reaches ``total``. ``enabled=False`` draws nothing.

    An open bar is redrawn every ``refresh`` seconds by a heartbeat thread, so its elapsed time
    moves while its phase reports nothing (a pool start, a model load: one step in all).
    """

    LABELS = {"pool": "pool", "load_text_encoder": "load Gemma", "encode": "encode",
              "load_transformer": "load LTX-2", "compile": "compile", "denoise": "denoise", "decode": "decode"}
    UNITS = {"denoise": "step", "decode": "frame"}

    def __init__(self, enabled: bool = True, refresh: float = HEARTBEAT_S):
        self.enabled = enabled
        self.bars: dict = {}
        self._lock = threading.Lock()
        self._heartbeat = Heartbeat(self._redraw, refresh) if enabled else None
        self.redraws = 0

    def _redraw(self, _elapsed: float) -> None:
        with self._lock:
            for bar in self.bars.values():
                bar.refresh()
                self.redraws += 1

    def __call__(self, phase: str, step: int, total: int) -> None:
        with self._lock:
            self._update(phase, step, total)
        if self._heartbeat is not None and not self._heartbeat.started_once:
            self._heartbeat.start()

    def _update(self, phase: str, step: int, total: int) -> None:
        from tqdm import tqdm

        bar = self.bars.get(phase)
        if bar is None or bar.total != total or step < bar.n:
            self._close(phase)
            unit = self.UNITS.get(phase)
            # a rate only where there is one (steps, frames): "1/1 34663 it/s" for a load said nothing
            fmt = None if unit else "{desc}: {n_fmt}/{total_fmt} [{elapsed}]"
            bar = self.bars[phase] = tqdm(total=total, desc=f"{self.LABELS.get(phase, phase):<10}",
                                          unit=unit or "it", file=sys.stderr, bar_format=fmt,
                                          disable=not self.enabled, dynamic_ncols=True)
        bar.update(step - bar.n)
        if step >= total:
            self._close(phase)

    def close(self, phase: str | None = None) -> None:
        """Close ``phase``'s bar, or every bar (and then stop redrawing)."""
        with self._lock:
            self._close(phase)
        if phase is None and self._heartbeat is not None:
            self._heartbeat.stop()

    def _close(self, phase: str | None) -> None:
        for name in [phase] if phase is not None else list(self.bars):
            bar = self.bars.pop(name, None)
            if bar is not None:
                bar.close()


class StopOnInterrupt:
    """A ``should_cancel`` for :func:`~ltx_mgpu.cli.pipeline.generate`: the first Ctrl-C (SIGINT) asks
    the run to stop at the pool's next step boundary; a second one raises ``KeyboardInterrupt``.
    The handler is installed only on the main thread (signals are delivered there)."""

    def __init__(self) -> None:
        self.requested = False
        self._previous = None

    def __enter__(self) -> StopOnInterrupt:
        if threading.current_thread() is threading.main_thread():
            self._previous = signal.signal(signal.SIGINT, self._handle)
        return self

    def _handle(self, signum, frame) -> None:
        if self.requested:
            raise KeyboardInterrupt
        self.requested = True
        print("\nstopping at the next step boundary (Ctrl-C again to abort at once)", file=sys.stderr, flush=True)

    def __exit__(self, *exc) -> None:
        if self._previous is not None:
            signal.signal(signal.SIGINT, self._previous)

    def __call__(self) -> bool:
        return self.requested


def _cmd_generate(args: argparse.Namespace) -> int:
    from ltx_mgpu.client.errors import PoolError  # dependency-free

    fields = {f.name for f in dataclasses.fields(GenerateRequest)}
    values = {k: v for k, v in vars(args).items() if k in fields}
    if isinstance(values.get("gpus"), tuple):  # GPU indices
        values["gpu_ids"], values["gpus"] = values["gpus"], None
    req = GenerateRequest(**values)
    validate_request(req)  # before torch is imported: a bad number or path answers at once
    from ltx_mgpu.cli.pipeline import GenerateCancelled, generate  # deferred: imports torch

    bars = ProgressBars(args.progress)
    try:
        with StopOnInterrupt() as stop:
            report = generate(req, on_progress=bars, should_cancel=stop)
    except GenerateCancelled as e:
        bars.close()
        print(e, file=sys.stderr)
        return 130
    except PermissionError:  # a runtime directory or socket that cannot be trusted: bad input (exit 2, main)
        bars.close()
        raise
    except (PoolError, ModuleNotFoundError) as e:
        bars.close()
        print(f"error: {e}", file=sys.stderr)
        return 1
    finally:
        bars.close()
    print(report.summary())
    return 0


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add ``generate`` to the CLI's subparsers."""
    d = GenerateRequest
    p = subparsers.add_parser(
        "generate", help="prompt -> MP4 through the pool (embedded tiny model by default)",
        description="Prompt -> MP4 through the sidecar pool: encode (cache first), sequence-parallel denoise at "
                    "world size --gpus, VAE decode. Without --checkpoint/--gemma: the embedded tiny models, whose "
                    "output is noise.")
    p.add_argument("--prompt", required=True, help="what the video shows")
    p.add_argument("--negative", default=DEFAULT_NEGATIVE, help=f"negative prompt (default: {DEFAULT_NEGATIVE!r})")
    p.add_argument("--gpus", "--nproc", dest="gpus", type=_gpus_arg, default=None,
                   help="a rank count N (GPUs 0..N-1; CPU ranks without GPUs) or GPU indices as pool start takes "
                        "them (0,1 or 3,). Default: as many GPUs as visible that the model's attention heads divide "
                        "(CPU: up to 2)")
    p.add_argument("--cpu", action="store_true", help="CPU ranks (gloo) even when GPUs are visible")
    p.add_argument("--frames", type=int, default=d.frames, help=f"8k+1 frames (default {d.frames})")
    p.add_argument("--height", type=int, default=d.height, help=f"pixels, multiple of 32 (default {d.height})")
    p.add_argument("--width", type=int, default=d.width, help=f"pixels, multiple of 32 (default {d.width})")
    p.add_argument("--fps", type=float, default=d.fps, help=f"frames per second (default {d.fps:g})")
    p.add_argument("--steps", type=int, default=d.steps, help=f"denoising steps (default {d.steps})")
    p.add_argument("--cfg", type=float, default=d.cfg, help=f"guidance scale; 1 = no negative pass (default {d.cfg:g})")
    p.add_argument("--seed", type=int, default=d.seed, help=f"noise seed, as ComfyUI's (default {d.seed})")
    p.add_argument("--out", default=d.out, help="output MP4 (default %(default)s); latents go to "
                                                "<out>.latents.safetensors beside it; missing directories are made")
    p.add_argument("--checkpoint", help="LTX-2 checkpoint (models/checkpoints/ltx-2*.safetensors)")
    p.add_argument("--gemma", help="Gemma 3 12B: HF snapshot dir, ComfyUI single file or NF4 artifact dir")
    p.add_argument("--projection", help="text projection file when --checkpoint has none (transformer-only files)")
    p.add_argument("--vae", help="file with the LTX-2 VAE (vae.*) when --checkpoint has none")
    p.add_argument("--connectors", help="file with the text connectors when --checkpoint has none (an LTX-2.0 GGUF "
                                        "transformer: the embeddings-connector file, or the full checkpoint)")
    p.add_argument("--weights", choices=WEIGHTS, default=d.weights, help="Gemma weights (default bf16)")
    p.add_argument("--placement", choices=PLACEMENTS, default=d.placement,
                   help="where Gemma runs in the pool (default single: rank 0)")
    p.add_argument("--dtype", choices=TRANSFORMER_DTYPES, default=None,
                   help="transformer dtype (default bf16 on GPUs, fp32 on CPU ranks; fp8: e4m3 GEMMs on Ada / Hopper "
                        "GPUs, the rest bf16, the first call at each size compiles)")
    p.add_argument("--transformer-weights", choices=TRANSFORMER_WEIGHTS, default=d.transformer_weights,
                   help="replicated: a whole transformer on every GPU (default); sharded: each GPU holds 1/N of "
                        "every weight (FSDP), for GPUs too small for a whole copy")
    p.add_argument("--layout", choices=SP_LAYOUTS, default=d.layout,
                   help="how a model call is split over the GPUs (default auto: the cond and uncond halves of "
                        "CFG on two halves of the GPUs when both counts are even, else the tokens over all)")
    p.add_argument("--compile", choices=TRANSFORMER_COMPILE, default=d.compile,
                   help="auto: the transformer blocks compiled for --dtype fp8 only (default); on: compiled in "
                        "every dtype (faster steps on a GPU; the first call at each size compiles first)")
    p.add_argument("--max-tokens", type=int, default=d.max_tokens, help="video-token budget (default 32768)")
    cache = p.add_mutually_exclusive_group()
    cache.add_argument("--cache", dest="cache_dir", help="embedding cache directory (default: $LTX_MGPU_CACHE_DIR, "
                                                         "else <ltx_mgpu home>/embeddings; docs/operations.md)")
    cache.add_argument("--no-cache", action="store_true", help="neither read nor write the embedding cache")
    p.add_argument("--runtime-dir", default=None, help="base of the pool's private directory (as `pool start`)")
    p.add_argument("--embedded-gemma", choices=EMBEDDED_GEMMA, default="auto",
                   help="Gemma of the embedded default: auto (the real Gemma 3 270M when its package is installed, "
                        "else tiny), gemma-270m or tiny")
    p.add_argument("--no-progress", dest="progress", action="store_false", help="no progress bars")
    p.set_defaults(func=_cmd_generate)


def _gpus_arg(value: str) -> int | tuple[int, ...]:
    """``--gpus``: ``"2"`` is a rank count, ``"0,1"`` / ``"3,"`` are GPU indices.

    Raises:
        argparse.ArgumentTypeError: neither form (the message shows both).
    """
    parts = [p.strip() for p in value.split(",")]
    if "," not in value and value.strip().isdigit():
        return int(value)
    if "," in value and all(p.isdigit() for p in parts if p) and any(parts):
        return tuple(int(p) for p in parts if p)
    hint = "; CPU ranks: --cpu --gpus N" if value.strip().lower() == "cpu" else ""
    raise argparse.ArgumentTypeError(f"{value!r}: give a rank count (--gpus 2) or GPU indices (--gpus 0,1 or --gpus 3,)"
                                     + hint)
