"""Named tensors <-> safetensors bytes for the socket protocol, without extra copies.

The payload of a frame (``ltx_mgpu.wire``) is a standard safetensors blob
(https://github.com/huggingface/safetensors, "Format")::

    u64 little-endian N | N bytes of UTF-8 JSON header | data
    header = {name: {"dtype": code, "shape": [d0, ...], "data_offsets": [begin, end]}, ...,
              optionally "__metadata__": {str: str}}

Sending (:func:`tensors_to_payload`) writes the header and then each tensor's own memory (no
copy of contiguous CPU tensors). Receiving (:func:`parse_payload`) validates the header strictly
and returns tensors that are *views into the received buffer* (``torch.frombuffer`` /
slicing), so a 100 MB result is written once by the kernel and never copied in user space.
Nothing is unpickled. Both directions interoperate with ``safetensors.torch.save`` / ``load``.

Lifetime of received tensors: every tensor of one payload is a view into that payload's
buffer (the ``bytearray`` the frame was received into, or the caller's writable buffer; torch
holds a reference to it). They are ordinary writable CPU tensors; the buffer is freed when the
last of them is dropped, so keeping one small tensor keeps the whole payload's memory alive:
``.clone()`` it to keep it alone. Writing to a caller's buffer afterwards changes the tensors.
"""

from __future__ import annotations

import json
import math
import struct
import sys
from typing import Any, Mapping, Sequence

import torch

#: safetensors dtype codes we carry (the allow-list: the codes ``safetensors.torch`` maps to
#: torch dtypes; https://github.com/huggingface/safetensors/blob/main/bindings/python/py_src/safetensors/torch.py).
DTYPES: dict[str, torch.dtype] = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
    "BOOL": torch.bool, "C64": torch.complex64,
}
for _code, _name in (("F8_E4M3", "float8_e4m3fn"), ("F8_E5M2", "float8_e5m2"), ("F8_E4M3FNUZ", "float8_e4m3fnuz"),
                     ("F8_E5M2FNUZ", "float8_e5m2fnuz"), ("U16", "uint16"), ("U32", "uint32"), ("U64", "uint64")):
    if hasattr(torch, _name):
        DTYPES[_code] = getattr(torch, _name)
CODES: dict[torch.dtype, str] = {v: k for k, v in DTYPES.items()}

#: The safetensors library's own bound on the JSON header (``MAX_HEADER_SIZE``, 100 MB).
MAX_HEADER_BYTES = 100_000_000
#: More dimensions than any tensor we exchange; bounds the work a hostile header can cause.
MAX_DIMS = 64
#: The largest byte extent a tensor's shape may describe (its dims, zeros counted as one, times
#: the element size): torch's strides are int64.
MAX_TENSOR_EXTENT = (1 << 62) - 1
_FIELDS = {"dtype", "shape", "data_offsets"}


class PayloadError(ValueError):
    """A payload that is not a valid safetensors blob (the message says which rule it breaks)."""


class Payload:
    """Named tensors laid out in the safetensors format, ready to send without a copy.

    ``parts`` are the buffers to write in order (the safetensors length + header, then each
    tensor's bytes); ``nbytes`` is their total length. Built by :func:`tensors_to_payload`."""

    __slots__ = ("parts", "nbytes", "_keep")

    def __init__(self, parts: list, keep: list):
        self.parts = parts
        self.nbytes = sum(memoryview(p).nbytes for p in parts)
        self._keep = keep

    def tobytes(self) -> bytes:
        """The whole safetensors blob as one ``bytes`` (a copy)."""
        return b"".join(self.parts)


def _prepare(name: str, t: Any) -> torch.Tensor:
    if not isinstance(name, str) or not name:
        raise TypeError(f"tensor names must be non-empty strings, got {name!r}")
    if name == "__metadata__":
        raise TypeError("'__metadata__' is reserved by safetensors; rename the tensor")
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name!r} is a {type(t).__name__}, not a torch.Tensor")
    if t.dtype not in CODES:
        raise TypeError(f"{name!r} has dtype {t.dtype}, which safetensors cannot carry; "
                        f"supported: {sorted(map(str, CODES))}")
    t = t.detach()
    if t.device.type != "cpu":
        t = t.to("cpu")
    return t.contiguous()


def payload_layout(specs: Sequence[tuple[str, torch.dtype, Sequence[int]]]) -> tuple[bytes, dict[str, tuple[int, int]]]:
    """Where the tensors of ``specs`` (name, dtype, shape) lie in their safetensors blob, known
    before they exist (``ltx_mgpu.pool`` writes a result straight into shared memory there).

    Returns:
        ``(head, spans)``: the blob's first bytes (u64 header length + JSON header, padded to 8
        bytes, as :func:`tensors_to_payload` writes it) and each tensor's ``(begin, end)`` byte
        range in the blob; the blob is ``len(head)`` + the tensors' bytes in name order.

    Raises:
        TypeError: as :func:`tensors_to_payload` (a bad name or a dtype safetensors cannot carry).
    """
    if sys.byteorder != "little":
        raise TypeError("safetensors is little-endian; this big-endian host is not supported")
    header: dict[str, Any] = {}
    spans: dict[str, tuple[int, int]] = {}
    offset = 0
    for name, dtype, shape in sorted(specs, key=lambda s: s[0]):
        if not isinstance(name, str) or not name or name == "__metadata__":
            raise TypeError(f"tensor names must be non-empty strings other than '__metadata__', got {name!r}")
        if dtype not in CODES:
            raise TypeError(f"{name!r} has dtype {dtype}, which safetensors cannot carry; "
                            f"supported: {sorted(map(str, CODES))}")
        nbytes = math.prod(shape) * dtype.itemsize
        header[name] = {"dtype": CODES[dtype], "shape": [int(d) for d in shape],
                        "data_offsets": [offset, offset + nbytes]}
        spans[name] = (offset, offset + nbytes)
        offset += nbytes
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)  # safetensors aligns the data start to 8 bytes
    head = struct.pack("<Q", len(raw)) + raw
    return head, {name: (len(head) + a, len(head) + b) for name, (a, b) in spans.items()}


def tensors_to_payload(tensors: Mapping[str, torch.Tensor] | None) -> Payload | None:
    """Lay named tensors out as a safetensors blob (header + raw bytes), without copying data
    that already is contiguous CPU memory.

    Tensors are detached, moved to CPU and made contiguous (a copy only when they are not);
    tensors sharing memory (views of one another, ComfyUI's inference tensors) are fine. The
    payload *refers* to the tensors' memory until it is sent: do not modify them meanwhile.
    ``None`` or ``{}`` gives ``None`` (no payload). The output parses with
    ``safetensors.torch.load`` and :func:`parse_payload`; the layout is :func:`payload_layout`'s.

    Raises:
        TypeError: a name is not a non-empty string (or is ``__metadata__``), a value is not a
            tensor, or its dtype is not one safetensors supports.
    """
    if not tensors:
        return None
    prepared = {name: _prepare(name, tensors[name]) for name in sorted(tensors)}
    head, _ = payload_layout([(name, t.dtype, t.shape) for name, t in prepared.items()])
    keep = list(prepared.values())
    data = [t.reshape(-1).view(torch.uint8).numpy() for t in keep if t.numel()]
    return Payload([head, *data], keep)


def _no_duplicates(pairs: list) -> dict:
    out = {}
    for k, v in pairs:
        if k in out:
            raise PayloadError(f"the header names {k!r} twice")
        out[k] = v
    return out


def _reject_constant(name: str) -> Any:
    raise PayloadError(f"{name} is not valid JSON")


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def parse_header(blob: memoryview) -> tuple[int, list[tuple[str, torch.dtype, list[int], int, int]]]:
    """Validate a safetensors header against the blob it heads.

    Rules (the format's, checked strictly): at least 8 bytes; the JSON length ``N`` fits the
    blob and ``MAX_HEADER_BYTES``; the header is UTF-8 JSON starting with ``{`` (trailing
    spaces allowed), an object without duplicate names; ``__metadata__``, when present, maps
    strings to strings; each tensor has exactly ``dtype`` (a code of :data:`DTYPES`),
    ``shape`` (at most ``MAX_DIMS`` non-negative ints) and ``data_offsets`` ``[begin, end]``
    with ``end - begin = numel x itemsize``; sorted by offset, the tensors tile the data exactly
    (the first begins at 0, each begins where the previous ends: no gap, no overlap) and the
    last ends at the blob's end.

    Returns ``(data_start, [(name, dtype, shape, begin, end), ...])`` sorted by offset, with
    offsets relative to ``data_start`` (bytes).

    Raises:
        PayloadError: naming the rule broken.
    """
    size = blob.nbytes
    if size < 8:
        raise PayloadError(f"{size} bytes cannot hold a safetensors header length (8 bytes)")
    n = int.from_bytes(blob[:8], "little")
    if n > min(size - 8, MAX_HEADER_BYTES):
        raise PayloadError(f"header length {n} exceeds the {size - 8} bytes that follow it "
                           f"(or the {MAX_HEADER_BYTES}-byte limit)")
    raw = bytes(blob[8:8 + n])
    if not raw.startswith(b"{"):
        raise PayloadError("the header must be a JSON object starting with '{'")
    try:
        header = json.loads(raw.decode("utf-8"), object_pairs_hook=_no_duplicates, parse_constant=_reject_constant)
    except (UnicodeDecodeError, ValueError, RecursionError) as e:  # PayloadError is a ValueError
        raise PayloadError(f"the header is not UTF-8 JSON: {e!s:.200}") from None
    if not isinstance(header, dict):
        raise PayloadError("the header must be a JSON object")
    meta = header.pop("__metadata__", {})
    if not isinstance(meta, dict) or not all(isinstance(v, str) for v in meta.values()):
        raise PayloadError("__metadata__ must map strings to strings")
    entries = []
    for name, info in header.items():
        if not isinstance(info, dict) or set(info) != _FIELDS:
            raise PayloadError(f"tensor {name!r:.80} must have exactly the fields {sorted(_FIELDS)}, got {info!r:.120}")
        code, shape, offsets = info["dtype"], info["shape"], info["data_offsets"]
        if not isinstance(code, str) or code not in DTYPES:
            raise PayloadError(f"tensor {name!r:.80} has dtype {code!r:.40}; allowed: {sorted(DTYPES)}")
        if not (isinstance(shape, list) and len(shape) <= MAX_DIMS and all(_is_int(d) and d >= 0 for d in shape)):
            raise PayloadError(f"tensor {name!r:.80} has shape {shape!r:.120}: want a list of at most {MAX_DIMS} "
                               "non-negative ints")
        if not (isinstance(offsets, list) and len(offsets) == 2 and all(_is_int(o) for o in offsets)
                and 0 <= offsets[0] <= offsets[1]):
            raise PayloadError(f"tensor {name!r:.80} has data_offsets {offsets!r:.120}: want [begin, end], "
                               "0 <= begin <= end")
        dtype = DTYPES[code]
        numel, extent = 1, 1
        for d in shape:
            numel *= d
            extent *= max(d, 1)
        if extent * dtype.itemsize > MAX_TENSOR_EXTENT:  # torch could not even describe an empty one
            raise PayloadError(f"tensor {name!r:.80} has shape {shape!r:.120}: its strides would pass "
                               f"{MAX_TENSOR_EXTENT} bytes")
        want = numel * dtype.itemsize
        if offsets[1] - offsets[0] != want:
            raise PayloadError(f"tensor {name!r:.80} spans {offsets[1] - offsets[0]} bytes, but {code} x {shape} "
                               f"needs {want}")
        entries.append((name, dtype, shape, offsets[0], offsets[1]))
    entries.sort(key=lambda e: (e[3], e[4]))
    end = 0
    for name, _, _, begin, stop in entries:
        if begin != end:
            raise PayloadError(f"tensor {name!r:.80} begins at byte {begin} of the data, not at {end}: "
                               f"{'a gap' if begin > end else 'an overlap'} in the data")
        end = stop
    data_start = 8 + n
    if end != size - data_start:
        raise PayloadError(f"the tensors cover {end} data bytes, but the blob holds {size - data_start}")
    return data_start, entries


def parse_payload(buffer: bytes | bytearray | memoryview | torch.Tensor) -> dict[str, torch.Tensor]:
    """Parse a safetensors blob into named CPU tensors, without copying when it can.

    ``buffer``: a 1-D uint8 CPU tensor or any writable buffer (``bytearray``, writable
    ``memoryview``): the tensors are views into it (no copy) and keep it alive; a read-only
    buffer (``bytes``) is copied once. A tensor whose bytes are not aligned to its element size
    (possible in a blob from another writer) is copied alone. See the module docstring for the
    lifetime of the results.

    Raises:
        PayloadError: the blob breaks a rule of :func:`parse_header`, or a BOOL tensor holds a
            byte other than 0 or 1.
    """
    if isinstance(buffer, torch.Tensor):
        if (buffer.dtype != torch.uint8 or buffer.dim() != 1 or buffer.device.type != "cpu"
                or not buffer.is_contiguous()):
            raise TypeError("a payload tensor must be a contiguous 1-D uint8 CPU tensor")
        u8 = buffer
    else:
        view = memoryview(buffer).cast("B")
        if view.nbytes == 0:
            return {}
        u8 = torch.frombuffer(view if not view.readonly else bytearray(view), dtype=torch.uint8)
    if u8.numel() == 0:
        return {}
    if u8.data_ptr() % 8 or u8.storage_offset() % 8:  # a misaligned caller buffer: one copy, aligned
        u8 = u8.clone()
    data_start, entries = parse_header(memoryview(u8.numpy()))
    if sys.byteorder != "little":
        raise PayloadError("safetensors is little-endian; this big-endian host is not supported")
    out: dict[str, torch.Tensor] = {}
    for name, dtype, shape, begin, end in entries:
        if begin == end:
            out[name] = torch.empty(shape, dtype=dtype)
            continue
        raw = u8[data_start + begin:data_start + end]
        if dtype == torch.bool and bool((raw > 1).any()):
            raise PayloadError(f"BOOL tensor {name!r:.80} holds bytes other than 0 and 1")
        if (data_start + begin) % dtype.itemsize:
            raw = raw.clone()  # fresh memory is aligned for every dtype
        out[name] = raw.view(dtype).view(shape)
    return out
