"""The single bridge between the pack's nodes and ComfyUI's internals.

Every access to ComfyUI goes through here, and each has a fallback so the nodes import and run
without ComfyUI (tests, the CLI, a broken install):

* **interrupt**: ``processing_interrupted()`` (a non-clearing peek), ``raise_interrupt()``
  and ``InterruptProcessingException`` come from ``comfy.model_management``; the fallback
  keeps the same global flag under an RLock and its exception derives from ``BaseException``
  exactly as ComfyUI's does (``comfy/model_management.py``), so a handler that catches only
  ``Exception`` lets it through in tests as it would in ComfyUI.
* **progress**: ``progress_bar(total, node_id)`` is ``comfy.utils.ProgressBar(total,
  node_id=...)`` (``node_id`` explicit, as ComfyUI needs when updates come from outside its
  executing context); the fallback forwards updates to :data:`PROGRESS_HOOK`.
  ``executing_node_id()`` is the node ComfyUI is executing (its ``comfy_execution.utils``
  context), or None.
* **memory**: ``unload_comfy_models()`` = ``comfy.model_management.unload_all_models()`` then
  ``soft_empty_cache()``; ``comfy_cuda_index()`` is the physical GPU ComfyUI computes on.
* **latents**: ``NestedTensor`` is ``comfy.nested_tensor.NestedTensor`` (video, audio), or a
  minimal stand-in with the same surface (``tensors``, ``is_nested``, ``unbind``, ``shape``...).
* **model files**: ``filename_list`` / ``directory_list`` / ``full_path`` use ``folder_paths``;
  without ComfyUI they read ``$LTX_MGPU_MODELS_DIR/<folder>/`` and accept absolute paths.
* **server**: ``prompt_server()`` is ``server.PromptServer.instance`` or None.
* **node schema**: :data:`io` and :data:`ComfyExtension` are ComfyUI's typed node schema
  (``comfy_api.latest``, which ComfyUI has imported before it loads custom nodes), or the
  stand-ins of :mod:`nodes._schema` (declarations held as data) without ComfyUI.

A ComfyUI module is used only when ComfyUI itself has imported it (``sys.modules``) or, for
submodules of ``comfy``, when the ``comfy`` package is loaded: importing ComfyUI modules from a
plain Python process would initialise its device logic, so this never does.
"""

from __future__ import annotations

import importlib
import os
import sys
import threading
from pathlib import Path
from typing import Any, Callable, NoReturn, Sequence

import torch

from ltx_mgpu import settings
from ltx_mgpu.nested import NestedTensorLike, is_nested

from . import _schema

__all__ = [
    "ComfyExtension", "io", "MODEL_EXTENSIONS", "MODELS_DIR_ENV", "PROGRESS_HOOK", "InterruptProcessingException",
    "comfy_cuda_index", "comfy_module", "directory_list", "executing_node_id", "filename_list", "full_path",
    "interrupt_current_processing",
    "interrupt_exception", "is_nested", "make_nested", "nested_tensor_type", "processing_interrupted", "progress_bar",
    "prompt_server", "raise_interrupt", "set_progress_hook", "to_comfy_latent", "unload_comfy_models",
]

#: Without ComfyUI: the directory holding one sub-directory per folder name (like ComfyUI's ``models/``).
MODELS_DIR_ENV = settings.MODELS_DIR.name
#: File extensions the fallback pickers list (the safetensors ones of ComfyUI's
#: ``supported_pt_extensions``; the pool reads nothing else, and never unpickles).
MODEL_EXTENSIONS = (".safetensors", ".sft")


def _module(name: str):
    """``name`` when ComfyUI has loaded it (or its top package ``comfy``), else None."""
    mod = sys.modules.get(name)
    if mod is not None:
        return mod
    top = name.split(".", 1)[0]
    if top == name or top not in sys.modules:
        return None
    try:
        return importlib.import_module(name)
    except Exception:  # noqa: BLE001 - a partial or broken ComfyUI: use the fallback
        return None


def comfy_module(name: str):
    """ComfyUI's module ``name`` (e.g. ``"comfy.model_patcher"``) when ComfyUI is loaded in this
    process, else None (never imported from a plain Python process: see the module doc)."""
    return _module(name)


# --------------------------------------------------------------------------- node schema

_latest = _module("comfy_api.latest")
#: ComfyUI's ``comfy_api.latest.io`` (the typed node schema), or :mod:`nodes._schema` without ComfyUI.
io = getattr(_latest, "io", None) or _schema
#: ComfyUI's ``comfy_api.latest.ComfyExtension``, or the stand-in's.
ComfyExtension = getattr(_latest, "ComfyExtension", None) or _schema.ComfyExtension


# --------------------------------------------------------------------------- interrupt


class InterruptProcessingException(BaseException):
    """Fallback of ComfyUI's ``comfy.model_management.InterruptProcessingException``: a
    ``BaseException`` (not an ``Exception``) so ``except Exception`` does not swallow a Stop."""


_interrupt_lock = threading.RLock()
_interrupt_flag = False


def interrupt_exception() -> type[BaseException]:
    """The exception class ComfyUI raises on Stop (the fallback class without ComfyUI)."""
    mm = _module("comfy.model_management")
    return getattr(mm, "InterruptProcessingException", InterruptProcessingException)


def interrupt_current_processing(value: bool = True) -> None:
    """Set (or clear) the Stop flag, as ComfyUI's ``POST /interrupt`` does."""
    global _interrupt_flag
    mm = _module("comfy.model_management")
    if mm is not None and hasattr(mm, "interrupt_current_processing"):
        mm.interrupt_current_processing(value)
        return
    with _interrupt_lock:
        _interrupt_flag = bool(value)


def processing_interrupted() -> bool:
    """Whether Stop was pressed (peek; the flag stays set)."""
    mm = _module("comfy.model_management")
    if mm is not None and hasattr(mm, "processing_interrupted"):
        return bool(mm.processing_interrupted())
    with _interrupt_lock:
        return _interrupt_flag


def raise_interrupt() -> NoReturn:
    """Raise ComfyUI's interrupt exception and clear the flag (``throw_exception_if_processing_
    interrupted`` semantics); raises it even when the flag was cleared in between."""
    global _interrupt_flag
    mm = _module("comfy.model_management")
    if mm is not None and hasattr(mm, "throw_exception_if_processing_interrupted"):
        mm.throw_exception_if_processing_interrupted()
    else:
        with _interrupt_lock:
            _interrupt_flag = False
    raise interrupt_exception()


# --------------------------------------------------------------------------- progress

#: Fallback progress hook ``hook(node_id, value, total)`` (ComfyUI's ``PROGRESS_BAR_HOOK`` twin).
PROGRESS_HOOK: Callable[[str | None, float, float], Any] | None = None


def set_progress_hook(hook: Callable[[str | None, float, float], Any] | None) -> None:
    """Install the fallback progress hook (None removes it); used when ComfyUI is absent."""
    global PROGRESS_HOOK
    PROGRESS_HOOK = hook


class _FallbackProgressBar:
    """``comfy.utils.ProgressBar``'s surface, forwarding to :data:`PROGRESS_HOOK`."""

    def __init__(self, total: float, node_id: str | None = None):
        self.total, self.current, self.node_id = float(total), 0.0, node_id

    def update_absolute(self, value: float, total: float | None = None, preview: Any = None) -> None:
        if total is not None:
            self.total = float(total)
        self.current = min(float(value), self.total)
        if PROGRESS_HOOK is not None:
            PROGRESS_HOOK(self.node_id, self.current, self.total)

    def update(self, value: float) -> None:
        self.update_absolute(self.current + value)


def progress_bar(total: float, node_id: str | None):
    """A progress bar for node ``node_id`` (``update_absolute(value, total)``); ComfyUI's
    ``ProgressBar`` when present (``node_id`` passed explicitly; versions without that
    argument fall back to ComfyUI's executing-context lookup)."""
    utils = _module("comfy.utils")
    cls = getattr(utils, "ProgressBar", None)
    if cls is None:
        return _FallbackProgressBar(total, node_id)
    try:
        return cls(total, node_id=node_id)
    except TypeError:  # ComfyUI before ProgressBar(node_id=...)
        return cls(total)


#: Fallback text hook ``hook(node_id, text)`` (``progress_text``'s twin without ComfyUI's server).
PROGRESS_TEXT_HOOK: Callable[[str | None, str], Any] | None = None


def set_progress_text_hook(hook: Callable[[str | None, str], Any] | None) -> None:
    """Install the fallback text hook (None removes it); used when ComfyUI's server is absent."""
    global PROGRESS_TEXT_HOOK
    PROGRESS_TEXT_HOOK = hook


def progress_text(text: str, node_id: str | None) -> None:
    """Show ``text`` on node ``node_id`` as ComfyUI's own API nodes show their status and elapsed
    time (``PromptServer.send_progress_text``; the frontend draws it on the node); the fallback
    hook without ComfyUI's server; nothing without a node id."""
    if node_id is None:
        return
    server = prompt_server()
    send = getattr(server, "send_progress_text", None)
    if send is not None:
        send(text, node_id)
    elif PROGRESS_TEXT_HOOK is not None:
        PROGRESS_TEXT_HOOK(node_id, text)


def executing_node_id() -> str | None:
    """The id of the node ComfyUI is executing in this thread (``comfy_execution.utils.
    get_executing_context()``), for code that runs inside another node's call (the CLIP's encode
    inside ``CLIPTextEncode``); None without ComfyUI or outside a node's execution."""
    utils = _module("comfy_execution.utils")
    get = getattr(utils, "get_executing_context", None)
    context = get() if get is not None else None
    return getattr(context, "node_id", None)


# --------------------------------------------------------------------------- memory


def unload_comfy_models() -> bool:
    """Ask ComfyUI to unload its own models and release cached memory (before a pool job on
    ComfyUI's GPU). Returns False when ComfyUI is absent."""
    mm = _module("comfy.model_management")
    if mm is None or not hasattr(mm, "unload_all_models"):
        return False
    mm.unload_all_models()
    if hasattr(mm, "soft_empty_cache"):
        mm.soft_empty_cache()
    return True


def comfy_cuda_index() -> int | None:
    """The physical CUDA index of ComfyUI's compute device (mapped through its
    ``CUDA_VISIBLE_DEVICES``); None when ComfyUI is absent or computes on the CPU; -1 when it
    computes on CUDA but the physical index cannot be told (``CUDA_VISIBLE_DEVICES`` holding
    UUIDs)."""
    mm = _module("comfy.model_management")
    get = getattr(mm, "get_torch_device", None)
    if get is None:
        return None
    try:
        dev = torch.device(get())
    except Exception:  # noqa: BLE001 - a ComfyUI without a usable device
        return None
    if dev.type != "cuda":
        return None
    index = dev.index if dev.index is not None else 0
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is None:
        return index
    ids = [x.strip() for x in visible.split(",") if x.strip()]
    return int(ids[index]) if index < len(ids) and ids[index].isdigit() else -1


# --------------------------------------------------------------------------- latents


def nested_tensor_type() -> type:
    """ComfyUI's ``NestedTensor`` class, or the stand-in without ComfyUI."""
    mod = _module("comfy.nested_tensor")
    return getattr(mod, "NestedTensor", NestedTensorLike)


def make_nested(tensors: Sequence[torch.Tensor]):
    """A NestedTensor (ComfyUI's class when loaded) of ``tensors`` (video first, then audio)."""
    return nested_tensor_type()(tuple(tensors))


def to_comfy_latent(latent: dict) -> dict:
    """``latent`` with nested ``samples`` / ``noise_mask`` rebuilt as ComfyUI's NestedTensor
    class (a copy; plain tensors and other keys unchanged)."""
    cls = nested_tensor_type()
    out = dict(latent)
    for key in ("samples", "noise_mask"):
        value = out.get(key)
        if is_nested(value) and type(value) is not cls:
            out[key] = cls(tuple(value.tensors))
    return out


# --------------------------------------------------------------------------- model files


def _fallback_roots(folder: str) -> list[Path]:
    base = settings.MODELS_DIR.get()
    return [base / folder] if base is not None else []


def _roots(folder: str) -> list[Path]:
    fp = _module("folder_paths")
    if fp is not None:
        try:
            return [Path(p) for p in fp.get_folder_paths(folder)]
        except Exception:  # noqa: BLE001 - folder unknown to this ComfyUI version
            return []
    return _fallback_roots(folder)


def filename_list(folder: str, extensions: Sequence[str] | None = None) -> list[str]:
    """Model files in a ComfyUI folder (relative names, ``/``-separated, sorted).

    With ComfyUI: ``folder_paths.get_filename_list``. Without: files with a model extension
    under ``$LTX_MGPU_MODELS_DIR/<folder>`` (empty when unset). With ``extensions`` (e.g.
    ``(".gguf",)``, which ComfyUI's own folders do not list): the files with those suffixes under
    the folder's directories, with or without ComfyUI.
    """
    fp = _module("folder_paths")
    if fp is not None and extensions is None:
        try:
            return sorted(fp.get_filename_list(folder))
        except Exception:  # noqa: BLE001 - folder unknown to this ComfyUI version
            return []
    suffixes = tuple(e.lower() for e in (extensions or MODEL_EXTENSIONS))
    out = []
    for root in (_roots(folder) if extensions is not None else _fallback_roots(folder)):
        if root.is_dir():
            out += [p.relative_to(root).as_posix() for p in root.rglob("*")
                    if p.is_file() and p.suffix.lower() in suffixes]
    return sorted(set(out))


def directory_list(folder: str, markers: Sequence[str], depth: int = 2) -> list[str]:
    """Sub-directories (up to ``depth`` levels) of a model folder holding one of ``markers``
    (e.g. ``config.json`` of a Hugging Face snapshot), as relative names ending in ``/``."""
    out = set()
    for root in _roots(folder):
        if not root.is_dir():
            continue
        level = [root]
        for _ in range(depth):
            nxt = []
            for d in level:
                try:
                    subs = [s for s in d.iterdir() if s.is_dir() and not s.name.startswith(".")]
                except OSError:
                    continue
                for s in subs:
                    if any((s / m).is_file() for m in markers):
                        out.add(s.relative_to(root).as_posix() + "/")
                    else:
                        nxt.append(s)
            level = nxt
    return sorted(out)


def full_path(folder: str, name: str) -> str:
    """The absolute path of ``name`` (a file or a ``dir/`` from the pickers, or an absolute
    path) in the ComfyUI model folder ``folder``.

    Raises:
        FileNotFoundError: nothing by that name; the message names the folders searched.
    """
    if not isinstance(name, str) or not name.strip():
        raise FileNotFoundError(f"no {folder} file chosen; pick one from the list (models/{folder}/)")
    name = name.strip()
    if os.path.isabs(name):
        if os.path.exists(name):
            return os.path.abspath(name)
        raise FileNotFoundError(f"{name} does not exist")
    rel = name.rstrip("/")
    fp = _module("folder_paths")
    if fp is not None and not name.endswith("/"):
        found = fp.get_full_path(folder, rel)
        if found:
            return os.path.abspath(found)
    roots = _roots(folder)
    for root in roots:
        candidate = root / rel
        if candidate.exists():
            return str(candidate.absolute())
    where = ", ".join(str(r) for r in roots) or (
        f"no {folder} folder is configured (inside ComfyUI: models/{folder}/; without ComfyUI set "
        f"${MODELS_DIR_ENV} or give an absolute path)")
    raise FileNotFoundError(f"{name!r} was not found in the {folder} folder ({where})")


# --------------------------------------------------------------------------- server


def prompt_server():
    """ComfyUI's ``PromptServer.instance`` (its aiohttp ``routes`` table), or None."""
    server = _module("server")
    cls = getattr(server, "PromptServer", None)
    return getattr(cls, "instance", None)
