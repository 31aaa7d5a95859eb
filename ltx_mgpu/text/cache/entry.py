"""One embedding-cache entry: its bytes, and their validation.

An entry is a safetensors file holding one CPU tensor ``"embedding"`` (``[T, D]``) and string
metadata: format version, key, key parts, LTX version, dropped tokens, the embedding's dtype
and ``crc32``, a CRC-32 over *every other metadata field* and the stored tensor's dtype, shape
and bytes (a bit flipped anywhere in the entry, ``dropped_tokens`` included, is a mismatch;
a field the cache does not write makes the entry foreign). A float32 embedding that is exactly
a bf16 upcast (every embedding computed in bf16) is stored as bf16 and upcast on read, bit for
bit: half the bytes to read and checksum on a hit. The directory, atomic writes, eviction and
what may be read at all (regular files under a size bound) are
:mod:`ltx_mgpu.text.cache.store`'s.
"""

from __future__ import annotations

import json
import zlib

import torch
from safetensors.torch import load as _st_load
from safetensors.torch import save as _st_save

from ltx_mgpu.finite import is_finite
from ltx_mgpu.text.cache.keys import FORMAT_VERSION, CacheKeyParts
from ltx_mgpu.text.features import PromptEmbedding

_TENSOR_NAME = "embedding"

#: The metadata fields of an entry (format 4), all of them covered by ``crc32``.
_FIELDS = frozenset({"format", "key", "key_parts", "version", "dropped_tokens", "dtype", "crc32"})


class DamagedEntry(Exception):
    """An entry failed validation (the message says why); the cache deletes it and re-encodes."""


def encode_entry(key: str, parts: CacheKeyParts, embedding: PromptEmbedding) -> bytes:
    """The bytes of the entry for ``embedding`` under ``key``.

    The tensor is copied to a contiguous CPU tensor of its own first (never a view into a batch
    tensor: a serializer once wrote row 1 for every row of a batch view), and stored as bf16
    when that is exact.

    Raises:
        ValueError: the tensor has no data (a ``meta`` tensor), or holds NaN or infinite values
            (never cached: every later hit would return them).
    """
    tensor = embedding.tensor.detach()
    if tensor.device.type == "meta":
        raise ValueError("cannot cache a 'meta' tensor (it has no data); encode on a real device")
    if not is_finite(tensor):
        raise ValueError("the embedding holds NaN or infinite values; it is not cached (the text encoder's weights are "
                         "damaged or overflow in its dtype)")
    tensor = tensor.to("cpu").clone(memory_format=torch.contiguous_format)  # own storage, offset 0
    stored = _compact(tensor)
    metadata = {
        "format": str(FORMAT_VERSION),
        "key": key,
        "key_parts": parts.to_json(),
        "version": embedding.version,
        "dropped_tokens": str(int(embedding.dropped_tokens)),
        "dtype": str(tensor.dtype).removeprefix("torch."),
    }
    metadata["crc32"] = _checksum(metadata, stored)
    return _st_save({_TENSOR_NAME: stored}, metadata=metadata)


def decode_entry(data: bytes, key: str, parts: CacheKeyParts) -> PromptEmbedding:
    """Parse and validate one entry's bytes.

    Args:
        data: the file's bytes (the store reads at most its per-entry limit).
        key, parts: what the entry must have been written for.

    Returns:
        The embedding: ``[T, D]`` float32 on CPU owning its memory (a bf16-stored entry is
        upcast, exactly).

    Raises:
        DamagedEntry: unreadable, foreign (another format, a metadata field missing or one the
            cache does not write), for another key, checksum mismatch (metadata or tensor),
            bad metadata, values that are not finite.
    """
    try:
        tensors = _st_load(data)
        header_len = int.from_bytes(data[:8], "little")
        metadata = json.loads(data[8 : 8 + header_len]).get("__metadata__") or {}
    except Exception as exc:  # noqa: BLE001 - any parse failure means a damaged file
        raise DamagedEntry(f"not a readable safetensors file: {exc}") from None
    if set(tensors) != {_TENSOR_NAME}:
        raise DamagedEntry(f"expected one tensor {_TENSOR_NAME!r}, found {sorted(tensors)}")
    if not isinstance(metadata, dict):
        raise DamagedEntry("its metadata is not a mapping")
    if metadata.get("format") != str(FORMAT_VERSION):
        raise DamagedEntry(f"format {metadata.get('format')!r}, expected {FORMAT_VERSION}")
    if set(metadata) != _FIELDS or not all(isinstance(v, str) for v in metadata.values()):
        raise DamagedEntry(f"metadata fields {sorted(metadata)}, expected {sorted(_FIELDS)}")
    if metadata["key"] != key or metadata["key_parts"] != parts.to_json():
        raise DamagedEntry("its metadata does not match the cache key")
    tensor = tensors[_TENSOR_NAME]
    if tensor.storage_offset() or tensor.untyped_storage().nbytes() != tensor.numel() * tensor.element_size():
        tensor = tensor.clone()  # own compact storage, never a view into a larger buffer
    if metadata["crc32"] != _checksum({k: v for k, v in metadata.items() if k != "crc32"}, tensor):
        raise DamagedEntry("checksum mismatch (metadata or tensor)")
    want = metadata["dtype"]
    if want != str(tensor.dtype).removeprefix("torch."):
        if want != "float32" or tensor.dtype != torch.bfloat16:
            raise DamagedEntry(f"stored as {tensor.dtype}, metadata says {want}")
        tensor = tensor.float()  # exact: it was stored because the upcast round-trips
    if not is_finite(tensor):
        raise DamagedEntry("its embedding holds NaN or infinite values (written by an older version)")
    try:
        dropped = int(metadata["dropped_tokens"])
        if dropped < 0 or str(dropped) != metadata["dropped_tokens"]:
            raise ValueError(f"dropped_tokens {metadata['dropped_tokens']!r} is not a count")
        return PromptEmbedding(tensor=tensor, version=metadata["version"], dropped_tokens=dropped)
    except (KeyError, ValueError) as exc:
        raise DamagedEntry(f"bad metadata: {exc}") from None


def _compact(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor`` as bf16 when that is exact (a float32 tensor whose values are all bf16
    values: what an encoder computing in bf16 returns), else ``tensor`` itself."""
    if tensor.dtype != torch.float32 or not tensor.numel():
        return tensor
    half = tensor.to(torch.bfloat16)
    return half if torch.equal(half.float(), tensor) else tensor


def _checksum(metadata: dict[str, str], tensor: torch.Tensor) -> str:
    """CRC-32 (hex) of ``metadata`` (every field but ``crc32`` itself, as canonical JSON) and of a
    contiguous CPU tensor's dtype, shape and bytes: an integrity check against truncation and
    bit rot, not an authentication (the cache directory is private and only regular files of
    ours are read, :mod:`ltx_mgpu.text.cache.store`); about 3x faster than SHA-256 on a 25 MB
    entry, which keeps a cache hit well under an encode."""
    crc = zlib.crc32(json.dumps(metadata, sort_keys=True, separators=(",", ":")).encode())
    crc = zlib.crc32(f"|{tensor.dtype}|{tuple(tensor.shape)}|".encode(), crc)
    if tensor.numel():
        crc = zlib.crc32(tensor.reshape(-1).view(torch.uint8).numpy(), crc)
    return f"{crc:08x}"
