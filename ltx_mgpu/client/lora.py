"""ComfyUI's weight patches for the pool's text encoder (``LoraLoader``'s CLIP strength on the Gemma
Loader's CLIP), on the client's side: :class:`TextPatches` and :func:`sync_text_patches`.

A patch set is named by its content: each adapter (a LoRA's factor pair and alpha, a diff) by a
SHA-256 of its tensors' bytes, shapes and dtypes (computed once per adapter object), the set by a
SHA-256 of every key's patch list (adapter ids and strengths, in ComfyUI's order). That name is
both the pool's ``patches`` id and the embedding cache's LoRA key part
(``ltx_mgpu.text.cache.keys.CacheKeyParts.lora``): two CLIPs with the same LoRAs at the same
strengths share entries, and a LoRA'd CLIP never gets a plain one's embedding.

The wire form is the MODEL path's (:func:`ltx_mgpu.client.model.wire_patches`): only plain LoRAs
and diffs, no offsets or functions; anything else raises
:class:`~ltx_mgpu.client.model.PatchFormatError` naming the key.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import weakref
from dataclasses import dataclass
from typing import Any, Callable, Mapping, Sequence

import torch

from ltx_mgpu.client.errors import BadInputError
from ltx_mgpu.client.model import wire_patches
from ltx_mgpu.wire.messages import NO_PATCHES

__all__ = ["TextPatches", "text_patches", "sync_text_patches", "adapter_digest"]

_DIGESTS: dict[int, tuple[Any, str]] = {}


def _tensor_digest(h: Any, t: Any) -> None:
    if not isinstance(t, torch.Tensor):
        h.update(json.dumps(None if t is None else float(t)).encode())
        return
    data = t.detach().to("cpu").contiguous()
    h.update(f"{data.dtype}{tuple(data.shape)}".encode())
    h.update(data.reshape(-1).view(torch.uint8).numpy().tobytes())


def adapter_digest(obj: Any) -> str:
    """A content id (32 hex) of a patch's adapter: a ComfyUI ``WeightAdapterBase`` (its name and
    weights: up, down, alpha...) or a diff tensor. Memoised per object (a weak reference tells a
    reused ``id()`` apart), so a LoRA's tensors are hashed once per process."""
    entry = _DIGESTS.get(id(obj))
    if entry is not None and entry[0]() is obj:
        return entry[1]
    h = hashlib.sha256()
    weights = getattr(obj, "weights", None)
    if weights is not None:
        h.update(str(getattr(obj, "name", "")).encode())
        for w in weights:
            _tensor_digest(h, w)
    else:
        _tensor_digest(h, obj)
    digest = h.hexdigest()[:32]
    key = id(obj)
    with contextlib.suppress(TypeError):  # an object without weak references: hashed again next time
        _DIGESTS[key] = (weakref.ref(obj, lambda _r, k=key: _DIGESTS.pop(k, None)), digest)
    return digest


@dataclass(frozen=True)
class TextPatches:
    """A patch set for the pool's text encoder.

    Attributes:
        identity: the set's content id (``"lora:"`` + 64 hex).
        entries: the ``text_patches`` request's entries.
        adapters: adapter id -> (description, tensors) (``WirePatches.adapters``).
    """

    identity: str
    entries: list
    adapters: dict


def text_patches(patches: Mapping[str, Sequence] | None) -> TextPatches | None:
    """ComfyUI's patches (key -> ``[(strength, adapter, strength_model, offset, function)]``, as
    ``ModelPatcher.patches``) as a :class:`TextPatches`; None when there are none.

    Raises:
        PatchFormatError: a patch the pool cannot merge (names the key and the kind).
    """
    wire = wire_patches(patches or {}, adapter_digest)
    if not wire.entries:
        return None
    record = json.dumps(wire.entries, sort_keys=True, separators=(",", ":"))
    return TextPatches("lora:" + hashlib.sha256(record.encode()).hexdigest(), wire.entries, wire.adapters)


def sync_text_patches(client: Any, key: str, patches: TextPatches | None,
                      should_cancel: Callable[[], bool] | None = None, timeout: float | None = None) -> dict:
    """Have the pool's text encoder ``key`` merge ``patches`` (None: its loaded weights). The
    adapters' tensors go only when the pool does not hold them (it says ``unknown_adapter``).

    Returns:
        The ``text_patches`` result.

    Raises:
        BadInputError (a key the Gemma does not have, a factor that does not fit; another text
            encoder resident), PoolError and subclasses.
    """
    if patches is None:
        params = {"expect": key, "patches": NO_PATCHES, "entries": []}
        return client.request("text_patches", params, should_cancel=should_cancel, timeout=timeout)[0]
    params = {"expect": key, "patches": patches.identity, "entries": patches.entries}
    try:
        return client.request("text_patches", params, should_cancel=should_cancel, timeout=timeout)[0]
    except BadInputError as e:
        if e.reason != "unknown_adapter":
            raise
    tensors = {name: t for _, ts in patches.adapters.values() for name, t in ts.items()}
    params["adapters"] = [desc for desc, _ in patches.adapters.values()]
    return client.request("text_patches", params, tensors, should_cancel=should_cancel, timeout=timeout)[0]
