"""Every ``LTX_MGPU_*`` environment setting, declared once: its name, what it means, its default
and how its value is read.

A leaf module without torch, so the ComfyUI nodes, the client and the pool's processes read the
same declarations. Each setting is read where it takes effect, with :meth:`Setting.get` (most
when a process starts, some on every use: the docs of each say which process reads it). A value
that cannot be read is an error naming the variable and what it takes, never silently the
default. ``docs/operations.md`` lists them all, one :meth:`Setting.doc_row` each (a unit test
checks that the table and :data:`SETTINGS` agree).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, Callable, Mapping

from ltx_mgpu.files import check_directory_setting

__all__ = [
    "SETTINGS", "Setting",
    "HOME", "CACHE_DIR", "RUNTIME_DIR", "MODELS_DIR",
    "TICK_SECONDS", "COLLECTIVE_TIMEOUT", "HELLO_TIMEOUT", "MAX_PAYLOAD_BYTES", "MASTER_PORT", "CUDA_ALLOC_CONF",
    "PROFILE_JOBS", "SHM", "SHM_MIN_BYTES", "SHM_MAX_BYTES", "SHM_IDLE_SECONDS", "SHM_OWN_MIN_BYTES",
    "CUDA_GRAPHS", "NO_COMPILE", "COMPILE_CACHE", "COMPILE_CACHE_DIR", "TOKEN_BUCKETS",
]

_OFF = ("0", "off", "false", "no")
_ON = ("1", "on", "true", "yes")


def _flag(raw: str) -> bool:
    value = raw.strip().lower()
    if value in _OFF:
        return False
    if value in _ON:
        return True
    raise ValueError


def _whole(raw: str) -> int:
    n = int(raw)
    if n < 0:
        raise ValueError
    return n


def _port(raw: str) -> int:
    n = int(raw)
    if not 1 <= n <= 65535:
        raise ValueError
    return n


def _seconds(raw: str) -> float:
    s = float(raw)
    if not 0 < s < float("inf"):
        raise ValueError
    return s


_KINDS: dict[str, tuple[Callable[[str], Any], str]] = {
    "flag": (_flag, f"one of {', '.join(_ON + _OFF)}"),
    "bytes": (_whole, "a whole number of bytes"),
    "count": (_whole, "a whole number (0: off)"),
    "seconds": (_seconds, "a positive number of seconds"),
    "port": (_port, "a TCP port, 1..65535"),
    "directory": (str, "a directory (made on first use)"),
    "text": (str, "text"),
}


@dataclass(frozen=True)
class Setting:
    """One environment setting.

    Attributes:
        name: the variable (``LTX_MGPU_...``).
        kind: how the value is read: ``flag`` (on / off), ``bytes`` / ``count`` (whole numbers
            >= 0), ``seconds`` (> 0), ``port``, ``directory`` (a ``Path``, ``~`` expanded, which
            must not name a file) or ``text``.
        default: the value when the variable is unset or empty (None: the reader decides).
        read_by: which process reads it (``pool``: the pool's environment, which the process
            that starts the pool passes on; ``client``; ``encoding process``...).
        doc: what it does, one sentence.
    """

    name: str
    kind: str
    default: Any
    read_by: str
    doc: str

    def __post_init__(self) -> None:
        if self.kind not in _KINDS:
            raise ValueError(f"{self.name}: kind must be one of {sorted(_KINDS)}, got {self.kind!r}")

    def get(self, environ: Mapping[str, str] | None = None) -> Any:
        """The value in ``environ`` (default ``os.environ``), or :attr:`default` when unset or empty.

        Raises:
            ValueError: ``"$NAME='value': give <what the kind takes>"`` (or, for a directory,
                ``check_directory_setting``'s message).
        """
        raw = (os.environ if environ is None else environ).get(self.name, "")
        if not raw.strip():
            return self.default
        if self.kind == "directory":
            return check_directory_setting(raw, f"${self.name}")
        parse, what = _KINDS[self.kind]
        try:
            return parse(raw.strip())
        except ValueError:
            raise ValueError(f"${self.name}={raw!r}: give {what}") from None

    def is_set(self, environ: Mapping[str, str] | None = None) -> bool:
        """Whether the variable holds a value (a non-empty one)."""
        return bool((os.environ if environ is None else environ).get(self.name, "").strip())

    def describe_default(self) -> str:
        """The default as the docs write it (``1 MiB``, ``60 s``, ``on``; ``—`` when the reader decides)."""
        d = self.default
        if d is None:
            return "—"
        if self.kind == "flag":
            return "on" if d else "off"
        if self.kind == "bytes":
            for unit, n in (("GiB", 1 << 30), ("MiB", 1 << 20)):
                if d >= n and d % n == 0:
                    return f"{d // n} {unit}"
        if self.kind == "seconds":
            return f"{d:g} s"
        return f"`{d}`" if isinstance(d, str) else str(d)

    def doc_row(self) -> str:
        """The setting's row of the table in ``docs/operations.md``."""
        return f"| `{self.name}` | {self.doc} | {self.describe_default()} | {self.read_by} |"


# --------------------------------------------------------------------------- where things are kept
HOME = Setting("LTX_MGPU_HOME", "directory", None, "every process",
               "the ltx_mgpu home: embedded models, file digests; default `$XDG_CACHE_HOME/ltx_mgpu` or "
               "`~/.cache/ltx_mgpu`")
CACHE_DIR = Setting("LTX_MGPU_CACHE_DIR", "directory", None, "client",
                    "the embedding cache; default `<ComfyUI user dir>/ltx_mgpu/embeddings` inside ComfyUI, "
                    "else `<home>/embeddings`")
RUNTIME_DIR = Setting("LTX_MGPU_RUNTIME_DIR", "directory", None, "client",
                      "the base of the pools' runtime directories; default `$XDG_RUNTIME_DIR/ltx_mgpu`, else "
                      "`<home>/run`")
MODELS_DIR = Setting("LTX_MGPU_MODELS_DIR", "directory", None, "nodes without ComfyUI",
                     "the model folders (`checkpoints/`, `text_encoders/`, `diffusion_models/`, `loras/`) the "
                     "nodes' pickers read when ComfyUI is not loaded")
# --------------------------------------------------------------------------- the pool
TICK_SECONDS = Setting("LTX_MGPU_TICK_SECONDS", "seconds", 1.0, "pool",
                       "how often an idle rank 0 tells the other ranks it is alive")
COLLECTIVE_TIMEOUT = Setting("LTX_MGPU_COLLECTIVE_TIMEOUT", "seconds", 3600.0, "pool",
                             "how long a collective may wait for a rank before the pool is declared dead")
HELLO_TIMEOUT = Setting("LTX_MGPU_HELLO_TIMEOUT", "seconds", 10.0, "pool",
                        "seconds a new connection has, in all, to authenticate")
MAX_PAYLOAD_BYTES = Setting("LTX_MGPU_MAX_PAYLOAD_BYTES", "bytes", 8 << 30, "pool and client",
                            "the largest payload one frame may carry")
MASTER_PORT = Setting("LTX_MGPU_MASTER_PORT", "port", None, "client (starting a pool)",
                      "torchrun's rendezvous port for a pool's first start attempt; default a free port")
CUDA_ALLOC_CONF = Setting("LTX_MGPU_CUDA_ALLOC_CONF", "text", "expandable_segments:True", "client (starting a pool)",
                          "`PYTORCH_CUDA_ALLOC_CONF` of a GPU pool's ranks")
PROFILE_JOBS = Setting("LTX_MGPU_PROFILE_JOBS", "count", 0, "pool",
                       "profile the pool's first N jobs on every rank as Chrome traces in its runtime directory")
# --------------------------------------------------------------------------- shared memory
SHM = Setting("LTX_MGPU_SHM", "flag", True, "pool and client",
              "results through a shared-memory arena (off: everything through the socket)")
SHM_MIN_BYTES = Setting("LTX_MGPU_SHM_MIN_BYTES", "bytes", 1 << 20, "pool",
                        "the smallest payload sent through the arena")
SHM_MAX_BYTES = Setting("LTX_MGPU_SHM_MAX_BYTES", "bytes", 2 << 30, "pool",
                        "the most memory all arenas and spares of a pool hold together")
SHM_IDLE_SECONDS = Setting("LTX_MGPU_SHM_IDLE_SECONDS", "seconds", 60.0, "pool",
                           "an arena idle this long is released")
SHM_OWN_MIN_BYTES = Setting("LTX_MGPU_SHM_OWN_MIN_BYTES", "bytes", 4 << 20, "pool",
                            "the smallest payload handed over to the client as its own memory")
# --------------------------------------------------------------------------- text encoding
CUDA_GRAPHS = Setting("LTX_MGPU_CUDA_GRAPHS", "flag", True, "the encoding process (the pool's ranks)",
                      "replay Gemma batches of up to 1024 tokens as CUDA graphs")
NO_COMPILE = Setting("LTX_MGPU_NO_COMPILE", "flag", False, "the encoding process (the pool's ranks)",
                     "run the LTX-2 feature extractor eagerly on a GPU (on: no torch.compile)")
# --------------------------------------------------------------------------- compiling the transformer
COMPILE_CACHE = Setting("LTX_MGPU_COMPILE_CACHE", "flag", True, "pool",
                        "keep the compiled transformer blocks' (dtype fp8, or compile on) torch.compile artifacts "
                        "across pool restarts (off: every pool compiles each size again)")
COMPILE_CACHE_DIR = Setting("LTX_MGPU_COMPILE_CACHE_DIR", "directory", None, "pool",
                            "where the compile artifacts are kept (a private directory: they are executed code); "
                            "default `<home>/compile`")
TOKEN_BUCKETS = Setting("LTX_MGPU_TOKEN_BUCKETS", "count", 32, "pool",
                        "video token buckets per doubling of the token count for compiled blocks (dtype fp8, or the "
                        "Model Loader's compile on): a call is padded (exactly) up to its bucket, so nearby sizes "
                        "share one compiled graph; a power of two (32: under 3.1 % padding), 0: off (one compile per "
                        "size)")

#: Every setting, by variable name.
SETTINGS: dict[str, Setting] = {s.name: s for s in (
    HOME, CACHE_DIR, RUNTIME_DIR, MODELS_DIR, TICK_SECONDS, COLLECTIVE_TIMEOUT, HELLO_TIMEOUT, MAX_PAYLOAD_BYTES,
    MASTER_PORT, CUDA_ALLOC_CONF, PROFILE_JOBS, SHM, SHM_MIN_BYTES, SHM_MAX_BYTES, SHM_IDLE_SECONDS,
    SHM_OWN_MIN_BYTES, CUDA_GRAPHS, NO_COMPILE, COMPILE_CACHE, COMPILE_CACHE_DIR, TOKEN_BUCKETS)}

