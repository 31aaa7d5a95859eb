"""The compiled transformer blocks across pool restarts: PyTorch's persistent compile caches,
and a first compile at a size shown as its own phase.

Under ``dtype: fp8`` every block's forward runs under ``torch.compile``
(:func:`ltx_mgpu.denoise.fp8.compile_blocks`), one static graph per set of input shapes (token
counts, batch, text length). The first call at a size compiles before it runs. This module
keeps what that compile produced, with PyTorch's own machinery only:

* Inductor's FX graph cache and the AOTAutograd cache (``torch._inductor.config.fx_graph_cache``,
  ``torch._functorch.config.enable_autograd_cache``) in ``<dir>/inductor``
  (``TORCHINDUCTOR_CACHE_DIR``; Triton's kernel cache lies inside it), a directory that outlives
  the pool instead of Inductor's default under ``/tmp``;
* the "mega-cache" (``torch.compiler.save_cache_artifacts`` / ``load_cache_artifacts``: every
  artifact of the compiles so far, in one blob, Triton kernels and autotuning results included):
  saved after the first call at a size as ``<dir>/artifacts/<graph key>-<size key>.bin``,
  loaded for the model's graph key when the model is loaded (:meth:`CompileCache.load_all`).

``<dir>`` is ``$LTX_MGPU_COMPILE_CACHE_DIR``, default ``<home>/compile`` beside the embedding
cache's default ``<home>/embeddings`` (:func:`ltx_mgpu.identity.home_dir`);
``$LTX_MGPU_COMPILE_CACHE=off`` keeps nothing (torch's defaults then apply).

Keys (:func:`graph_key`): the graph key is a SHA-256 over what changes the compiled graph and its
kernels: the torch, CUDA and Triton versions, :data:`GRAPHS_REVISION`, the GPU's name and compute
capability, the block's structure and sizes (its ``repr``: the linears' sizes and fp8 compute /
scaling) and parameter dtypes, the number of blocks, the layout and world size; the size key one over the shapes,
dtypes and strides of a block's inputs (:func:`size_key`). A key that differs only misses.

Security: Inductor's artifacts are code that is executed, and the mega-cache blob is read by
torch's own deserialiser, so the directory is trusted only when it is private: made 0700,
refused (with a warning, and no persistent cache) when it is a link, not a directory or another
user's, tightened to 0700 when it is ours and looser (:func:`private_dir`). An artifact file is
read only when it is a regular file of ours (``O_NOFOLLOW``, ``fstat``), no larger than
:data:`MAX_ARTIFACT_BYTES`. Files are written atomically (0600). A damaged file (wrong header,
digest or content torch refuses) is a :class:`CompileCacheWarning`, removed, and the size
compiles again.

Token counts are bucketed (:mod:`ltx_mgpu.denoise.parallel.buckets`, ``$LTX_MGPU_TOKEN_BUCKETS``): the
sequence-parallel wrapper pads a call's video up to its bucket, exactly (the padded keys left out
of the two attentions that see the whole video, not masked, so SDPA keeps its mask-less kernels;
:mod:`ltx_mgpu.denoise.parallel.ulysses`), so the counts of a bucket share one graph and one
artifact file, at the price of computing the padded rows (under a bucket's width) at every step.
``dynamic=True`` would give one symbolic graph for all sizes at the price of the static graph's
per-shape kernel choices (``bench_fp8 --dynamic`` measures it). Persistence makes the compile at a
bucket a once-per-machine cost.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import stat
import time
import warnings
from pathlib import Path
from typing import Any, Callable

import torch

from ltx_mgpu import settings
from ltx_mgpu.files import write_atomically
from ltx_mgpu.identity import home_dir

__all__ = ["ARTIFACT_MAGIC", "GRAPHS_REVISION", "MAX_ARTIFACT_BYTES", "CompileCache", "CompileCacheWarning",
           "CompileWatch",
           "compile_cache_dir", "compile_message", "compiled_message", "graph_key", "private_dir", "size_key"]

#: The first bytes of an artifact file; a SHA-256 of the payload follows, then the payload.
ARTIFACT_MAGIC = b"ltx_mgpu compile artifacts 1\n"
#: An artifact file larger than this is not read (no blob of the blocks' compiles comes near it).
MAX_ARTIFACT_BYTES = 4 << 30
#: The revision of how this package makes the blocks' graphs (what it installs in them before
#: compiling: attention calls, wrappers as operators), part of every graph key: a new revision
#: makes other graphs, so an earlier revision's artifact files are not taken for this one's.
GRAPHS_REVISION = 2
_DIGEST = 32
_OPEN = os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_CLOEXEC", 0)

Log = Callable[[str, str], None]


class CompileCacheWarning(UserWarning):
    """The compile cache directory or one of its files could not be used; it was ignored (a
    damaged file removed) and the blocks compile as without a cache."""


def _print_log(message: str, level: str = "info") -> None:
    print(f"{level}: {message}", flush=True)


def compile_cache_dir(environ=None) -> Path | None:
    """The compile cache's directory (module doc), or None when ``$LTX_MGPU_COMPILE_CACHE`` is off.

    Raises:
        ValueError: a setting that cannot be read (the message names the variable).
    """
    if not settings.COMPILE_CACHE.get(environ):
        return None
    configured = settings.COMPILE_CACHE_DIR.get(environ)
    return configured if configured is not None else home_dir() / "compile"


def private_dir(path: Path) -> Path:
    """Create ``path`` (parents too) mode 0700 and check that it can hold executed code: a real
    directory (not a link, ``lstat``) of this user; a looser mode of ours is made 0700.

    Raises:
        PermissionError: ``"compile cache <path> is ...; <fix>"``. OSError: it cannot be made.
    """
    path = Path(path)
    path.mkdir(mode=0o700, parents=True, exist_ok=True)
    st = os.lstat(path)
    fix = "remove it or set $LTX_MGPU_COMPILE_CACHE_DIR to a private directory of yours"
    if stat.S_ISLNK(st.st_mode):
        raise PermissionError(f"compile cache {path} is a symbolic link; {fix}")
    if not stat.S_ISDIR(st.st_mode):
        raise PermissionError(f"compile cache {path} is not a directory; {fix}")
    if st.st_uid != os.getuid():
        raise PermissionError(f"compile cache {path} belongs to uid {st.st_uid}, not to you; {fix}")
    if st.st_mode & 0o077:
        os.chmod(path, 0o700)
    return path


def graph_key(model: torch.nn.Module, device: torch.device, *, layout: str = "", world_size: int = 1,
              attention: str = "") -> str:
    """The SHA-256 (hex) of what changes ``model``'s compiled blocks (module doc: versions, GPU,
    the block's structure, sizes and parameter dtypes, block count, ``layout``, ``world_size``, and
    ``attention``: the name of an attention function of ours installed in the blocks, "" for
    ltx-core's own)."""
    device = torch.device(device)
    blocks = list(model.transformer_blocks)
    gpu: Any = None
    if device.type == "cuda":
        gpu = [torch.cuda.get_device_name(device), list(torch.cuda.get_device_capability(device))]
    try:  # Triton generates the kernels; absent on some CPU installs
        import triton  # noqa: PLC0415 - optional, only its version is read
        triton_version = triton.__version__
    except ImportError:
        triton_version = None
    parts = {
        "torch": torch.__version__, "cuda": torch.version.cuda, "triton": triton_version, "device": device.type,
        "gpu": gpu, "blocks": len(blocks), "block": repr(blocks[0]),
        "params": [[n, str(p.dtype), list(p.shape)] for n, p in blocks[0].named_parameters()],
        "layout": layout, "world_size": world_size, "revision": GRAPHS_REVISION,
    }
    if attention:  # none for ltx-core's own backends: their keys stay as before
        parts["attention"] = attention
    return hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()


def _shapes(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return [list(value.shape), list(value.stride()), str(value.dtype), value.device.type]
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: _shapes(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if isinstance(value, (list, tuple)):
        return [_shapes(v) for v in value]
    if isinstance(value, dict):
        return {str(k): _shapes(v) for k, v in value.items()}
    return value if isinstance(value, (bool, int, float, str, type(None))) else type(value).__name__


def size_key(args: tuple, kwargs: dict) -> str:
    """A short SHA-256 (hex, 16 digits) of the shapes, strides, dtypes and devices of a block
    call's tensor inputs (inside dataclasses such as ltx-core's ``TransformerArgs``, lists,
    dicts), and its other plain values: two calls with the same key run the same graph."""
    return hashlib.sha256(json.dumps(_shapes([args, kwargs]), sort_keys=True, default=str).encode()).hexdigest()[:16]


def video_tokens(args: tuple, kwargs: dict) -> int | None:
    """The video token count a block call sees: ``video.x.shape[1]`` of ltx-core's
    ``(video, audio, ...)`` arguments, else the first tensor argument's dim 1 (None: neither)."""
    first = args[0] if args else kwargs.get("video")
    x = getattr(first, "x", first)
    return int(x.shape[1]) if isinstance(x, torch.Tensor) and x.dim() >= 2 else None


def _what(tokens: int | None, world_size: int, bucketed: bool) -> str:
    if tokens is None:
        return "this size"
    return (("up to " if bucketed else "") + f"{tokens:,} video tokens" + (" per GPU" if world_size > 1 else ""))


def compile_message(tokens: int | None, cached: bool, world_size: int = 1, bucketed: bool = False) -> str:
    """What a person reads when a block call compiles: ``"compiling the transformer blocks for
    6,144 video tokens, first time at this size: up to a minute"`` (``cached``: ``"..., from the
    compile cache: a few seconds"``); with ``world_size`` > 1 the tokens are each GPU's; with
    ``bucketed`` (token buckets, :mod:`ltx_mgpu.denoise.parallel.buckets`) they are the bucket's, which
    every smaller count down to the previous bucket shares: ``"for up to 6,144 video tokens"``."""
    what = _what(tokens, world_size, bucketed)
    if cached:
        return f"compiling the transformer blocks for {what}, from the compile cache: a few seconds"
    return f"compiling the transformer blocks for {what}, first time at this size: up to a minute"


def compiled_message(tokens: int | None, seconds: float, world_size: int = 1, bucketed: bool = False) -> str:
    """What a person reads when that compile is done (the first pass through the blocks at the
    size, compile included, took ``seconds``): ``"compiled the transformer blocks for 6,144 video
    tokens in 39 s"``."""
    return f"compiled the transformer blocks for {_what(tokens, world_size, bucketed)} in {seconds:.0f} s"


class CompileCache:
    """The persistent compile artifacts of one model's graph key (module doc).

    ``open`` makes the directory (:func:`private_dir`) and points Inductor at it; the other
    methods never raise for a cache problem: they report it through ``log`` (level
    ``"warning"``, and a :class:`CompileCacheWarning`) and go on as without a cache.
    """

    def __init__(self, root: Path, key: str, log: Log = _print_log):
        self.root, self.key, self.log = Path(root), key, log
        self.artifacts = self.root / "artifacts"

    @classmethod
    def open(cls, key: str, log: Log = _print_log, environ=None) -> CompileCache | None:
        """The cache for graph ``key`` in :func:`compile_cache_dir`, Inductor's FX graph and
        AOTAutograd caches turned on and ``TORCHINDUCTOR_CACHE_DIR`` set to ``<dir>/inductor``
        for this process; None when the setting is off or the directory is refused (a warning).

        Raises:
            ValueError: a setting that cannot be read.
        """
        root = compile_cache_dir(environ)
        if root is None:
            return None
        try:
            private_dir(root)
            inductor = private_dir(root / "inductor")
            private_dir(root / "artifacts")
        except OSError as e:
            _warn(log, f"compile cache not used: {e}")
            return None
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(inductor)
        torch._inductor.config.fx_graph_cache = True
        torch._functorch.config.enable_autograd_cache = True
        return cls(root, key, log)

    def path(self, size: str) -> Path:
        """The artifact file of ``size`` (a :func:`size_key`)."""
        return self.artifacts / f"{self.key[:32]}-{size}.bin"

    def has(self, size: str) -> bool:
        """Whether an earlier run saved the artifacts of ``size``."""
        return self.path(size).is_file()

    def load_all(self) -> int:
        """Load every saved artifact file of this graph key into torch's caches
        (``torch.compiler.load_cache_artifacts``); a damaged one is removed with a warning.
        Returns how many were loaded."""
        n = 0
        for path in sorted(self.artifacts.glob(f"{self.key[:32]}-*.bin")):
            try:
                payload = self._read(path)
                if torch.compiler.load_cache_artifacts(payload) is None:  # torch logs why, and returns None
                    raise ValueError("torch could not read it")
            except Exception as e:  # noqa: BLE001 - any damage means: ignore it and compile
                _warn(self.log, f"compile cache file {path} ignored and removed ({str(e)[:200]}); "
                                "that size compiles again")
                path.unlink(missing_ok=True)
                continue
            n += 1
            self.log(f"compile cache: loaded {path} ({len(payload) / 2**20:.1f} MiB)", "info")
        return n

    def save(self, size: str) -> Path | None:
        """Write every artifact compiled in this process so far (``save_cache_artifacts``) as
        ``size``'s file, atomically; None when there is nothing to save or the write failed
        (a warning)."""
        saved = torch.compiler.save_cache_artifacts()
        if saved is None or not saved[0]:
            return None
        payload = saved[0]
        path = self.path(size)
        try:
            write_atomically(path, ARTIFACT_MAGIC + hashlib.sha256(payload).digest() + payload, mode=0o600)
        except OSError as e:
            _warn(self.log, f"compile cache: could not save {path} ({e})")
            return None
        self.log(f"compile cache: saved {path} ({len(payload) / 2**20:.1f} MiB)", "info")
        return path

    @staticmethod
    def _read(path: Path) -> bytes:
        fd = os.open(path, _OPEN)
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode) or st.st_uid != os.getuid():
                raise PermissionError("not a regular file of yours")
            if st.st_size > MAX_ARTIFACT_BYTES:
                raise ValueError(f"larger than {MAX_ARTIFACT_BYTES} bytes")
            with os.fdopen(os.dup(fd), "rb") as f:
                data = f.read()
        finally:
            os.close(fd)
        head = len(ARTIFACT_MAGIC)
        if not data.startswith(ARTIFACT_MAGIC) or len(data) < head + _DIGEST:
            raise ValueError("not an artifact file of ltx_mgpu")
        payload = data[head + _DIGEST:]
        if hashlib.sha256(payload).digest() != data[head:head + _DIGEST]:
            raise ValueError("damaged: its digest does not match")
        return payload


def _warn(log: Log, message: str) -> None:
    warnings.warn(message, CompileCacheWarning, stacklevel=3)
    log(message, "warning")


class CompileWatch:
    """Announces and persists the compiles of ``model``'s compiled blocks.

    Hooks on the first block (before) and the last block (after): a call whose inputs have a
    :func:`size_key` this process has not run yet is announced through :attr:`on_compile`
    (:func:`compile_message`: first time, or from ``cache`` when an artifact file of the size
    exists) before it compiles; after the whole pass its end through :attr:`on_compiled`
    (:func:`compiled_message`, with the seconds the pass took) and the artifacts are saved
    (``cache``, when the size had no file). ``on_compile(text, cached)`` and
    ``on_compiled(text)`` are set by whoever reports progress (the pool's job: a log line each,
    and the ``compile`` phase begun and ended); default: none. ``bucketed``: the calls are padded
    to token buckets (the messages say "up to").
    """

    def __init__(self, model: torch.nn.Module, cache: CompileCache | None, world_size: int = 1,
                 bucketed: bool = False):
        self.cache, self.world_size, self.bucketed = cache, world_size, bucketed
        self.seen: set[str] = set()
        self.on_compile: Callable[[str, bool], None] | None = None
        self.on_compiled: Callable[[str], None] | None = None
        self._pending: str | None = None
        self._started: tuple[int | None, float] | None = None
        blocks = list(model.transformer_blocks)
        blocks[0].register_forward_pre_hook(self._before, with_kwargs=True)
        blocks[-1].register_forward_hook(self._after)

    def _before(self, module, args, kwargs) -> None:
        size = size_key(args, kwargs)
        if size in self.seen:
            return
        self.seen.add(size)
        cached = self.cache is not None and self.cache.has(size)
        self._pending = None if cached or self.cache is None else size
        tokens = video_tokens(args, kwargs)
        self._started = (tokens, time.monotonic())
        if self.on_compile is not None:
            self.on_compile(compile_message(tokens, cached, self.world_size, self.bucketed), cached)

    def _after(self, module, args, output) -> None:
        if self._started is not None:
            (tokens, began), self._started = self._started, None
            if self.on_compiled is not None:
                self.on_compiled(compiled_message(tokens, time.monotonic() - began, self.world_size, self.bucketed))
        if self._pending is not None:
            size, self._pending = self._pending, None
            self.cache.save(size)
