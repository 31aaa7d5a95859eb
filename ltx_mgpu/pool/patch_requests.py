"""The weight patches a request carries (``model_patches``, ``text_patches``), read and checked:
:func:`parse_adapters` and :func:`parse_entries`.

Both requests carry ComfyUI's patch set in one form (``ltx_mgpu.client.model.wire_patches``):
``entries`` ``[{"key", "patches": [{"adapter": id, "strength", "strength_model"}]}]`` in
ComfyUI's order, and the adapters the pool does not hold yet, ``adapters`` ``[{"id", "kind":
"lora" | "diff" | "scale", "alpha"}]`` with tensors ``<id>.up`` / ``<id>.down`` (a LoRA),
``<id>.diff``, or none (``scale``).
Adapters are kept by the resident model under their ids, on the CPU, so a set sent before is
referenced, not resent. Every check runs on every rank alike (the same request reaches each)
and raises :class:`~ltx_mgpu.pool.engines.BadInput` naming the field.
"""

from __future__ import annotations

import math
from typing import Any, Mapping

import torch

from ltx_mgpu.denoise.patches import PATCH_KINDS, WeightPatch
from ltx_mgpu.pool.engines import BadInput

__all__ = ["Adapter", "parse_adapters", "parse_entries", "used_adapters"]

#: A held adapter: ``(kind, alpha or None, {"up", "down"} or {"diff"} tensors)``.
Adapter = tuple[str, float | None, dict[str, torch.Tensor]]


def _number(value: Any, what: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise BadInput(f"{what} must be a finite number, got {value!r:.40}")
    return float(value)


def parse_adapters(raw: list | None, tensors: Mapping[str, torch.Tensor]) -> dict[str, Adapter]:
    """The adapters a request brings, checked: id -> :data:`Adapter`.

    Raises:
        BadInput: an item without a string ``id`` or a known ``kind``; a missing tensor, one that
            is not floating point or has too few dimensions, or one holding NaN / inf.
    """
    new = {}
    for i, item in enumerate(raw or []):
        if not isinstance(item.get("id"), str) or item.get("kind") not in PATCH_KINDS:
            raise BadInput(f"adapters[{i}] must be {{\"id\": str, \"kind\": one of {list(PATCH_KINDS)}, ...}}")
        aid, kind = item["id"], item["kind"]
        alpha = None if item.get("alpha") is None else _number(item["alpha"], f"adapters[{i}].alpha")
        names = {"lora": ("up", "down"), "diff": ("diff",), "scale": ()}[kind]
        parts = {}
        for n in names:
            t = tensors.get(f"{aid}.{n}")
            least = 2 if kind == "lora" else 1
            if not isinstance(t, torch.Tensor) or not t.dtype.is_floating_point or t.ndim < least:
                raise BadInput(f"adapter {aid!r} ({kind}) needs tensor '{aid}.{n}'")
            if not bool(torch.isfinite(t).all()):
                raise BadInput(f"adapter {aid!r}: tensor '{aid}.{n}' holds NaN or infinite values; the LoRA file is "
                               "damaged")
            parts[n] = t
        new[aid] = (kind, alpha, parts)
    return new


def parse_entries(entries: list, held: Mapping[str, Adapter]) -> dict[str, list[WeightPatch]]:
    """``entries`` as ComfyUI key -> its :class:`~ltx_mgpu.denoise.patches.WeightPatch` list, the
    adapters taken from ``held``.

    Raises:
        BadInput: a malformed entry or a key given twice; an adapter id not in ``held`` (reason
            ``unknown_adapter``: the client sends it and retries); a strength that is not a
            finite number.
    """
    patches: dict[str, list[WeightPatch]] = {}
    for i, entry in enumerate(entries):
        key = entry.get("key") if isinstance(entry, dict) else None
        plist = entry.get("patches") if isinstance(entry, dict) else None
        if not isinstance(key, str) or not isinstance(plist, list) or key in patches:
            raise BadInput(f"entries[{i}] must be {{\"key\": str, \"patches\": [...]}}, one per key")
        out = []
        for j, p in enumerate(plist):
            aid = p.get("adapter") if isinstance(p, dict) else None
            if aid not in held:
                raise BadInput(f"entries[{i}].patches[{j}] references adapter {aid!r} the pool does not hold",
                               reason="unknown_adapter")
            kind, alpha, parts = held[aid]
            strength = _number(p.get("strength", 1.0), f"entries[{i}].patches[{j}].strength")
            strength_model = _number(p.get("strength_model", 1.0), f"entries[{i}].patches[{j}].strength_model")
            out.append(WeightPatch(kind, strength, strength_model, up=parts.get("up"), down=parts.get("down"),
                                   alpha=alpha, diff=parts.get("diff")))
        patches[key] = out
    return patches


def used_adapters(entries: list) -> set[str]:
    """The adapter ids ``entries`` (checked by :func:`parse_entries`) reference."""
    return {p.get("adapter") for e in entries for p in e["patches"]}
