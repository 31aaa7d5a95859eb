"""The on-disk format of an ltx_mgpu NF4 Gemma 3 artifact: manifest, weight shards, tokenizer.

An artifact directory holds:

* ``nf4-00000.safetensors``, ``nf4-00001.safetensors``, ...: the text tower's tensors under
  ``Gemma3TextModel`` state-dict names. A quantized projection ``<p>.weight`` is stored as
  bitsandbytes serializes a ``Linear4bit`` (``Linear4bit._save_to_state_dict`` /
  ``QuantState.as_dict(packed=True)``, bitsandbytes 0.50): ``<p>.weight`` uint8 ``[N*K/2, 1]``
  (two 4-bit codes per byte, element 2i in the high nibble), ``<p>.weight.absmax`` uint8
  ``[N*K/64]`` (double-quantized block scales), ``<p>.weight.nested_absmax`` float32
  ``[ceil(N*K/64/256)]``, ``<p>.weight.quant_map`` float32 ``[16]`` (the NF4 code),
  ``<p>.weight.nested_quant_map`` float32 ``[256]`` and ``<p>.weight.quant_state.bitsandbytes__nf4``
  (uint8 JSON: quant type, blocksize, dtype, shape, nested offset). Every other tensor
  (embedding, RMSNorm weights, biases if any) is bf16. All pieces of one parameter sit in one shard.
* the tokenizer files (copied from the source, or ComfyUI's embedded ``spiece_model`` written
  as ``tokenizer.model``);
* ``ltx_mgpu_nf4.json``, the manifest (:data:`MANIFEST_FORMAT`), written **last**: the whole
  directory is built under a temporary sibling name and renamed into place, so an interrupted
  run leaves nothing with a manifest, and detection requires the manifest.

Nothing here is pickled: safetensors and JSON only.
"""

from __future__ import annotations

import errno
import json
import math
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator, Mapping

import safetensors
import torch
from safetensors import safe_open
from safetensors.torch import save_file

import ltx_mgpu
from ltx_mgpu.text.gemma.sources import NF4_MANIFEST, NF4_PARTIAL_PREFIX, GemmaWeightsError

__all__ = [
    "PROJECTIONS",
    "QUANT_SETTINGS",
    "MANIFEST_FORMAT",
    "MANIFEST_VERSION",
    "NF4ArtifactError",
    "QUANT_KEYS",
    "ShardWriter",
    "read_manifest",
    "check_artifact_files",
    "iter_artifact_tensors",
    "write_manifest",
    "write_artifact",
    "artifact_bytes",
    "estimated_bytes",
    "partial_dir_for",
]

#: The projections of each decoder layer that are stored in NF4 (``Gemma3DecoderLayer``).
PROJECTIONS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
               "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")
#: The quantization every artifact uses (recorded in its manifest and checked on load).
QUANT_SETTINGS = {"library": "bitsandbytes", "quant_type": "nf4", "blocksize": 64, "double_quant": True,
                  "nested_blocksize": 256, "quant_storage": "uint8", "compute_dtype": "bfloat16",
                  "resident_dtype": "bfloat16", "quantized_modules": list(PROJECTIONS)}
MANIFEST_FORMAT = "ltx_mgpu.gemma3_nf4"
MANIFEST_VERSION = 1
#: The tensors besides ``weight`` that bitsandbytes stores per double-quantized NF4 weight
#: (``QuantState.as_dict(packed=True)``, bitsandbytes 0.50.2).
QUANT_KEYS = ("absmax", "quant_map", "nested_absmax", "nested_quant_map", "quant_state.bitsandbytes__nf4")
#: Prefix of the temporary directory an artifact is built in (a sibling of the target).
PARTIAL_PREFIX = NF4_PARTIAL_PREFIX
_SHARD_NAME = "nf4-{:05d}.safetensors"
_DTYPE_NAMES = {torch.bfloat16: "bfloat16", torch.float32: "float32", torch.uint8: "uint8", torch.float16: "float16"}


class NF4ArtifactError(GemmaWeightsError):
    """An NF4 artifact is incomplete, damaged or from an unknown format version (the message
    names what is wrong and says to re-run ``python -m ltx_mgpu quantize-nf4``)."""


def partial_dir_for(out_dir: Path) -> str:
    """The name prefix of the temporary sibling ``out_dir`` is built in."""
    return f"{PARTIAL_PREFIX}{out_dir.name}."


def _fix(artifact: Path) -> str:
    return (f"delete {artifact} and quantize again: python -m ltx_mgpu quantize-nf4 SOURCE {artifact}")


class ShardWriter:
    """Collects CPU tensors and writes them into ``nf4-NNNNN.safetensors`` shards of at most
    ``shard_bytes`` (a group, i.e. all pieces of one parameter, never straddles two shards; a
    group larger than ``shard_bytes``, e.g. the 2 GB embedding of 12B, is a shard of its own).

    Host memory held: the pending shard, at most ``max(shard_bytes, one group)``.

    Args:
        directory: where the shards go (the temporary artifact directory).
        shard_bytes: flush once the pending tensors reach this many bytes (default 1 GiB).
    """

    def __init__(self, directory: Path, shard_bytes: int = 1 << 30) -> None:
        self.directory = directory
        self.shard_bytes = shard_bytes
        self.files: dict[str, dict[str, Any]] = {}
        self._pending: dict[str, torch.Tensor] = {}
        self._pending_bytes = 0
        self._ptrs: set[int] = set()

    def add_group(self, tensors: Mapping[str, torch.Tensor]) -> None:
        """Add the tensors of one parameter (moved to CPU; copied only when storage is shared,
        which safetensors refuses). The pending shard is written first if this group would take
        it past ``shard_bytes``, so host memory holds at most ``max(shard_bytes, one group)``."""
        size = sum(t.numel() * t.element_size() for t in tensors.values())
        if self._pending and self._pending_bytes + size > self.shard_bytes:
            self.flush()
        for name, t in tensors.items():
            t = t.detach()
            if t.device.type != "cpu":
                t = t.cpu()
            elif t.untyped_storage().data_ptr() in self._ptrs or not t.is_contiguous():
                t = t.clone(memory_format=torch.contiguous_format)
            self._ptrs.add(t.untyped_storage().data_ptr())
            self._pending[name] = t
            self._pending_bytes += t.numel() * t.element_size()

    def flush(self) -> None:
        """Write the pending tensors as the next shard."""
        if not self._pending:
            return
        name = _SHARD_NAME.format(len(self.files))
        path = self.directory / name
        # one metadata key: safetensors writes the metadata map in hash order, so several keys
        # would make the bytes of identical shards differ from run to run
        save_file(self._pending, str(path), metadata={"format": "pt"})
        self.files[name] = {
            "bytes": path.stat().st_size,
            "tensors": {k: {"shape": list(v.shape), "dtype": _DTYPE_NAMES.get(v.dtype, str(v.dtype))}
                        for k, v in self._pending.items()},
        }
        self._pending, self._pending_bytes, self._ptrs = {}, 0, set()


def write_manifest(directory: Path, manifest: dict[str, Any]) -> None:
    """Write ``ltx_mgpu_nf4.json`` (sorted keys, UTF-8) into ``directory``."""
    text = json.dumps(manifest, indent=1, sort_keys=True)
    (directory / NF4_MANIFEST).write_text(text + "\n", encoding="utf-8")


def read_manifest(artifact: Path) -> dict[str, Any]:
    """Read and check the manifest of an artifact directory.

    Returns:
        The manifest as a dict (see :func:`ltx_mgpu.text.nf4.quantize.quantize_nf4` for its fields).

    Raises:
        NF4ArtifactError: unreadable JSON, another format, an unknown version, or required
            fields missing.
    """
    path = artifact / NF4_MANIFEST
    try:
        manifest = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise NF4ArtifactError(f"{path}: unreadable NF4 manifest ({exc}); {_fix(artifact)}") from exc
    if not isinstance(manifest, dict) or manifest.get("format") != MANIFEST_FORMAT:
        raise NF4ArtifactError(
            f"{path}: not an ltx_mgpu NF4 manifest "
            f"(format {manifest.get('format') if isinstance(manifest, dict) else None!r},"
            f" expected {MANIFEST_FORMAT!r}); {_fix(artifact)}"
        )
    if manifest.get("format_version") != MANIFEST_VERSION:
        raise NF4ArtifactError(
            f"{path}: NF4 artifact format version {manifest.get('format_version')!r}; this ltx_mgpu reads version "
            f"{MANIFEST_VERSION}. {_fix(artifact)}"
        )
    missing = [k for k in ("config", "parameters", "files", "quantization", "tokenizer") if k not in manifest]
    if missing:
        raise NF4ArtifactError(f"{path}: manifest lacks {missing}; {_fix(artifact)}")
    return manifest


def check_artifact_files(artifact: Path, manifest: dict[str, Any]) -> None:
    """Check every shard the manifest lists exists with its recorded size and holds exactly
    the recorded tensors (header only, no tensor data read).

    Raises:
        NF4ArtifactError: naming every missing or truncated shard and every missing or
            unexpected tensor.
    """
    problems: list[str] = []
    for name, info in sorted(manifest["files"].items()):
        path = artifact / name
        if not path.is_file():
            problems.append(f"shard {name} is missing")
            continue
        if path.stat().st_size != info["bytes"]:
            problems.append(f"shard {name} has {path.stat().st_size} bytes, the manifest says {info['bytes']}")
        try:
            with safe_open(str(path), framework="pt", device="cpu") as f:
                keys = set(f.keys())
        except Exception as exc:  # safetensors raises its own types for damaged headers
            problems.append(f"shard {name} is unreadable ({exc})")
            continue
        listed = set(info["tensors"])
        if listed - keys:
            problems.append(f"shard {name} lacks tensor(s) {sorted(listed - keys)}")
        if keys - listed:
            problems.append(f"shard {name} has tensor(s) the manifest does not list: {sorted(keys - listed)}")
    if problems:
        raise NF4ArtifactError(f"{artifact}: damaged NF4 artifact: " + "; ".join(problems) + f". {_fix(artifact)}")


def iter_artifact_tensors(artifact: Path, manifest: dict[str, Any],
                          device: torch.device) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield ``(name, tensor)`` for every tensor of every shard, read straight onto ``device``
    (safetensors ``safe_open(device=...)``), one tensor at a time."""
    dev = str(device) if device.type != "cuda" or device.index is not None else f"cuda:{torch.cuda.current_device()}"
    for name in sorted(manifest["files"]):
        with safe_open(str(artifact / name), framework="pt", device=dev) as f:
            for key in f.keys():  # noqa: SIM118 - safe_open is not iterable
                yield key, f.get_tensor(key)


def artifact_bytes(artifact: str | os.PathLike) -> int:
    """Total size in bytes of every file in an artifact directory (shards, tokenizer, manifest)."""
    return sum(f.stat().st_size for f in Path(artifact).rglob("*") if f.is_file())


def versions() -> dict[str, str]:
    import bitsandbytes
    import transformers

    return {"ltx_mgpu": ltx_mgpu.__version__, "torch": torch.__version__, "transformers": transformers.__version__,
            "bitsandbytes": bitsandbytes.__version__, "safetensors": safetensors.__version__}


#: Bytes :func:`estimated_bytes` adds for the tokenizer files, the manifest and the shards' headers
#: (Gemma 3's ``tokenizer.json`` and ``tokenizer.model`` together are about 38 MB).
OVERHEAD_BYTES = 64 << 20


def estimated_bytes(expected: Mapping[str, tuple]) -> int:
    """The bytes an artifact of the parameters ``expected`` (name -> ``(shape, "nf4" |
    "bfloat16")``) takes: per NF4 weight of n elements the packed codes (n/2), the block
    scales (n/64 uint8) and their nested scales (4 bytes per 256 blocks), per bf16 tensor 2n,
    plus :data:`OVERHEAD_BYTES`."""
    total = OVERHEAD_BYTES
    blocksize, nested = QUANT_SETTINGS["blocksize"], QUANT_SETTINGS["nested_blocksize"]
    for shape, kind in expected.values():
        n = math.prod(shape)
        if kind == "nf4":
            blocks = -(-n // blocksize)
            total += -(-n // 2) + blocks + 4 * -(-blocks // nested) + 4 * (16 + 256) + 1024
        else:
            total += 2 * n
    return total


def _no_space(directory: Path, need: int, free: int | None = None) -> OSError:
    """The error a full disk gets: where, and how much the artifact needs."""
    more = "" if free is None else f", {free / 1e9:.2f} GB free"
    return OSError(errno.ENOSPC, f"no space left on {directory}: the NF4 artifact needs {need / 1e9:.2f} GB{more}; "
                                 "free some space or give an OUT_DIR on another disk")


def _is_no_space(exc: BaseException) -> bool:
    """Whether ``exc`` says the disk is full: an ``OSError`` ENOSPC, or safetensors' own error
    (``SafetensorError``: "IoError(Os { code: 28, kind: StorageFull ... })")."""
    if isinstance(exc, OSError):
        return exc.errno == errno.ENOSPC
    text = str(exc)
    return "StorageFull" in text or f"code: {errno.ENOSPC}," in text or "No space left on device" in text


def write_artifact(out_dir: Path, groups: Iterable[Mapping[str, torch.Tensor]], config: Any, expected: dict,
                   source_info: dict, write_tokenizer: Callable[[Path], dict], device: torch.device,
                   shard_bytes: int = 1 << 30) -> Path:
    """Build an artifact in a temporary sibling of ``out_dir``, write the manifest last, rename.

    Args:
        out_dir: the artifact directory to create.
        groups: the stored tensors of each parameter, in module order (one mapping per parameter).
        config: the ``Gemma3TextConfig`` (recorded as JSON).
        expected: parameter name -> ``(shape, "nf4" | "bfloat16")`` (``ltx_mgpu.text.nf4.model.skeleton``).
        source_info: ``{"format", "name", "identity"}`` of the source, and ``"stored_as"``: the
            quantized formats of a ComfyUI file that has any.
        write_tokenizer: puts the tokenizer files into a directory, returns their manifest entry.
        device: where the tensors were quantized (its type is recorded).
        shard_bytes: target shard size (bytes).

    Raises:
        FileExistsError: ``out_dir`` exists. OSError (``errno.ENOSPC``): ``"no space left on
            <dir>: the NF4 artifact needs N GB"``, before anything is written when the disk has
            less free space than :func:`estimated_bytes`, or when it fills up meanwhile. Any
            error while writing removes the temporary directory and propagates; nothing is left
            at ``out_dir``.
    """
    if out_dir.exists():
        raise FileExistsError(f"{out_dir} already exists; pass a new directory (or delete it first)")
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    need = estimated_bytes(expected)
    free = shutil.disk_usage(out_dir.parent).free
    if free < need:
        raise _no_space(out_dir.parent, need, free)
    tmp = Path(tempfile.mkdtemp(prefix=partial_dir_for(out_dir), dir=out_dir.parent))
    try:
        writer = ShardWriter(tmp, shard_bytes)
        for group in groups:
            writer.add_group(group)
        writer.flush()
        manifest = {
            "format": MANIFEST_FORMAT,
            "format_version": MANIFEST_VERSION,
            "source": source_info,
            "versions": versions(),
            "quantization": {**QUANT_SETTINGS, "device": device.type},
            "config": {**json.loads(config.to_json_string(use_diff=False)), "dtype": "bfloat16"},
            "parameters": {n: {"shape": list(s), "dtype": k} for n, (s, k) in expected.items()},
            "files": writer.files,
            "tokenizer": write_tokenizer(tmp),
        }
        write_manifest(tmp, manifest)  # last: only a complete artifact has a manifest
        os.rename(tmp, out_dir)
    except BaseException as e:
        shutil.rmtree(tmp, ignore_errors=True)
        if _is_no_space(e):
            raise _no_space(out_dir.parent, need) from None
        raise
    return out_dir
