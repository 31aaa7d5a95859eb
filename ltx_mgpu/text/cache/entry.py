"""One embedding-cache entry: its bytes, and their validation.

An entry is a safetensors file holding one CPU tensor ``"embedding"`` (``[T, D]``) and string
metadata: format version, key, key parts, LTX version, dropped tokens, the embedding's dtype
and the CRC-32 of the stored tensor bytes. A float32 embedding that is exactly a bf16 upcast
(every embedding computed in bf16) is stored as bf16 and upcast on read, bit for bit: half the
bytes to read and checksum on a hit. The directory, atomic writes and eviction are
:mod:`ltx_mgpu.text.cache.store`'s.
"""

from __future__ import annotations

import json
import zlib

import torch
from safetensors.torch import load as _st_load
from safetensors.torch import save as _st_save

from ltx_mgpu.text.cache.keys import FORMAT_VERSION, CacheKeyParts
from ltx_mgpu.text.features import PromptEmbedding

_TENSOR_NAME = "embedding"


class DamagedEntry(Exception):
    """An entry failed validation (the message says why); the cache deletes it and re-encodes."""


def encode_entry(key: str, parts: CacheKeyParts, embedding: PromptEmbedding) -> bytes:
    """The bytes of the entry for ``embedding`` under ``key``.

    The tensor is copied to a contiguous CPU tensor of its own first (never a view into a batch
    tensor: a serializer once wrote row 1 for every row of a batch view), and stored as bf16
    when that is exact.

    Raises:
        ValueError: the tensor has no data (a ``meta`` tensor).
    """
    tensor = embedding.tensor.detach()
    if tensor.device.type == "meta":
        raise ValueError("cannot cache a 'meta' tensor (it has no data); encode on a real device")
    tensor = tensor.to("cpu").clone(memory_format=torch.contiguous_format)  # own storage, offset 0
    stored = _compact(tensor)
    metadata = {
        "format": str(FORMAT_VERSION),
        "key": key,
        "key_parts": parts.to_json(),
        "version": embedding.version,
        "dropped_tokens": str(int(embedding.dropped_tokens)),
        "crc32": _tensor_crc32(stored),
        "dtype": str(tensor.dtype).removeprefix("torch."),
    }
    return _st_save({_TENSOR_NAME: stored}, metadata=metadata)


def decode_entry(data: bytes, key: str, parts: CacheKeyParts) -> PromptEmbedding:
    """Parse and validate one entry's bytes.

    Args:
        data: the file's bytes.
        key, parts: what the entry must have been written for.

    Returns:
        The embedding: ``[T, D]`` float32 on CPU owning its memory (a bf16-stored entry is
        upcast, exactly).

    Raises:
        DamagedEntry: unreadable, foreign, for another key, checksum mismatch, bad metadata.
    """
    try:
        tensors = _st_load(data)
        header_len = int.from_bytes(data[:8], "little")
        metadata = json.loads(data[8 : 8 + header_len]).get("__metadata__") or {}
    except Exception as exc:  # noqa: BLE001 - any parse failure means a damaged file
        raise DamagedEntry(f"not a readable safetensors file: {exc}") from None
    if set(tensors) != {_TENSOR_NAME}:
        raise DamagedEntry(f"expected one tensor {_TENSOR_NAME!r}, found {sorted(tensors)}")
    if metadata.get("format") != str(FORMAT_VERSION):
        raise DamagedEntry(f"format {metadata.get('format')!r}, expected {FORMAT_VERSION}")
    if metadata.get("key") != key or metadata.get("key_parts") != parts.to_json():
        raise DamagedEntry("its metadata does not match the cache key")
    tensor = tensors[_TENSOR_NAME]
    if tensor.storage_offset() or tensor.untyped_storage().nbytes() != tensor.numel() * tensor.element_size():
        tensor = tensor.clone()  # own compact storage, never a view into a larger buffer
    if metadata.get("crc32") != _tensor_crc32(tensor):
        raise DamagedEntry("tensor checksum mismatch")
    want = metadata.get("dtype", str(tensor.dtype).removeprefix("torch."))
    if want != str(tensor.dtype).removeprefix("torch."):
        if want != "float32" or tensor.dtype != torch.bfloat16:
            raise DamagedEntry(f"stored as {tensor.dtype}, metadata says {want}")
        tensor = tensor.float()  # exact: it was stored because the upcast round-trips
    try:
        dropped = int(metadata["dropped_tokens"])
        if dropped < 0:
            raise ValueError(f"negative dropped_tokens {dropped}")
        return PromptEmbedding(tensor=tensor, version=metadata.get("version"), dropped_tokens=dropped)
    except (KeyError, ValueError) as exc:
        raise DamagedEntry(f"bad metadata: {exc}") from None


def _compact(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor`` as bf16 when that is exact (a float32 tensor whose values are all bf16
    values: what an encoder computing in bf16 returns), else ``tensor`` itself."""
    if tensor.dtype != torch.float32 or not tensor.numel():
        return tensor
    half = tensor.to(torch.bfloat16)
    return half if torch.equal(half.float(), tensor) else tensor


def _tensor_crc32(tensor: torch.Tensor) -> str:
    """CRC-32 (hex) of a contiguous CPU tensor's dtype, shape and bytes: an integrity check
    against truncation and bit rot (the cache directory is private, so no adversary), about
    3x faster than SHA-256 on a 25 MB entry, which keeps a cache hit well under an encode."""
    crc = zlib.crc32(f"{tensor.dtype}|{tuple(tensor.shape)}|".encode())
    if tensor.numel():
        crc = zlib.crc32(tensor.reshape(-1).view(torch.uint8).numpy(), crc)
    return f"{crc:08x}"
