"""ComfyUI LATENT / CONDITIONING <-> named tensors: the codec both sides of a ``sample`` job use.

The nodes hold ComfyUI's own types: a LATENT dict whose ``samples`` is a tensor or ComfyUI's
``NestedTensor`` (video, audio), and CONDITIONING lists of ``[tensor, options]``. Neither may
cross the socket as an object (``comfy.nested_tensor.NestedTensor`` would need ``comfy`` to
unpickle, and nothing is ever unpickled), so this module lays them out as named tensors
(safetensors) plus a small JSON description, and back. It imports only torch (no ltx-core, no
ComfyUI): the client (:mod:`ltx_mgpu.client.denoise`) encodes with it and the pool's ``sample``
job (:mod:`ltx_mgpu.pool.denoise_jobs`) decodes with the same functions.

Wire layout of a ``sample`` request (``params`` JSON + tensors):

* LATENT: ``params["latent"] = {"samples": "tensor" | "nested", "parts": n, "noise_mask":
  null | "tensor" | "nested", "mask_parts": m, "type": str | null, "batch_index": [int] | null}``;
  tensors ``latent`` (plain) or ``latent.0`` .. ``latent.{n-1}`` (nested: video, audio), and
  ``noise_mask`` or ``noise_mask.0`` ... Other LATENT keys do not affect sampling and stay
  on the client, which copies them into the result (as ComfyUI's samplers copy the input).
* CONDITIONING: ``params["positive"]`` (and ``"negative"``) = one ``{"options": {...},
  "tensor_options": [key, ...]}`` per entry; tensors ``positive.{i}`` (the ``[B, T, D]``
  embedding) and ``positive.{i}.{key}`` for tensor-valued options (``attention_mask``).
  Options that are neither JSON nor a tensor are sent as a ``"<Type object>"`` placeholder:
  the pool still sees the key and rejects unsupported keys by name (never silently).
* SIGMAS: tensor ``sigmas`` (float32 ``[steps + 1]``), or ``params["steps"]`` for the LTX-2
  scheduler.

A ``sample`` result carries ``result["latent"] = {"samples": ..., "parts": n}`` and the
denoised ``latent`` / ``latent.{i}`` tensors (the input dtype).
"""

from __future__ import annotations

import json
import numbers
from collections.abc import Mapping
from typing import Any

import torch

from ltx_mgpu.nested import is_nested

__all__ = [
    "DEFAULT_MODEL",
    "RequestFormatError",
    "conditioning_from_request",
    "conditioning_to_request",
    "json_option",
    "latent_from_request",
    "latent_from_result",
    "latent_to_request",
    "latent_to_result",
]

#: The resident-model name ``load_transformer`` / ``sample`` use when none is given.
DEFAULT_MODEL = "ltx"


class RequestFormatError(ValueError):
    """Request tensors / params that do not form a LATENT, CONDITIONING or SIGMAS."""


def _tensor(x: Any, what: str) -> torch.Tensor:
    if not isinstance(x, torch.Tensor):
        raise RequestFormatError(f"{what} must be a tensor, got {type(x).__name__}")
    return x.detach()


# --------------------------------------------------------------------------- LATENT


def _pack(value: Any, name: str, tensors: dict) -> tuple[str, int]:
    """Put a tensor or NestedTensor into ``tensors`` under ``name`` / ``name.i``; its tag."""
    if is_nested(value):
        parts = list(value.tensors)
        for i, t in enumerate(parts):
            tensors[f"{name}.{i}"] = _tensor(t, f"{name} part {i}")
        return "nested", len(parts)
    tensors[name] = _tensor(value, name)
    return "tensor", 1


def _unpack(tag: Any, parts: Any, name: str, tensors: Mapping[str, torch.Tensor], nested_type) -> Any:
    if tag == "tensor":
        if name not in tensors:
            raise RequestFormatError(f"the request has no '{name}' tensor")
        return tensors[name]
    if tag == "nested":
        if not isinstance(parts, int) or parts < 1:
            raise RequestFormatError(f"{name}: a nested tensor needs a positive part count, got {parts!r}")
        missing = [f"{name}.{i}" for i in range(parts) if f"{name}.{i}" not in tensors]
        if missing:
            raise RequestFormatError(f"the request lacks the tensors {missing}")
        return nested_type([tensors[f"{name}.{i}"] for i in range(parts)])
    raise RequestFormatError(f"{name} must be tagged 'tensor' or 'nested', got {tag!r}")


def latent_to_request(latent: Mapping) -> tuple[dict, dict[str, torch.Tensor]]:
    """A ComfyUI LATENT -> ``(spec, tensors)`` (see the module docstring).

    Raises:
        RequestFormatError: not a dict with ``samples``, or a part that is not a tensor.
    """
    if not isinstance(latent, Mapping) or "samples" not in latent:
        raise RequestFormatError("expected a ComfyUI LATENT: a dict with a 'samples' entry")
    tensors: dict[str, torch.Tensor] = {}
    tag, parts = _pack(latent["samples"], "latent", tensors)
    spec: dict[str, Any] = {"samples": tag, "parts": parts, "noise_mask": None, "mask_parts": 0,
                            "type": latent.get("type"), "batch_index": None}
    if latent.get("noise_mask") is not None:
        spec["noise_mask"], spec["mask_parts"] = _pack(latent["noise_mask"], "noise_mask", tensors)
    if latent.get("batch_index") is not None:
        spec["batch_index"] = [int(i) for i in latent["batch_index"]]
    if spec["type"] is not None and not isinstance(spec["type"], str):
        raise RequestFormatError(f"LATENT 'type' must be a string, got {type(spec['type']).__name__}")
    return spec, tensors


def latent_from_request(spec: Mapping, tensors: Mapping[str, torch.Tensor], nested_type) -> dict:
    """The LATENT a :func:`latent_to_request` spec describes, nested parts in ``nested_type``.

    Raises:
        RequestFormatError: a malformed spec or missing tensors.
    """
    if not isinstance(spec, Mapping):
        raise RequestFormatError("params.latent must be an object")
    out = {"samples": _unpack(spec.get("samples"), spec.get("parts"), "latent", tensors, nested_type)}
    if spec.get("noise_mask") is not None:
        out["noise_mask"] = _unpack(spec["noise_mask"], spec.get("mask_parts"), "noise_mask", tensors, nested_type)
    if spec.get("type") is not None:
        out["type"] = spec["type"]
    index = spec.get("batch_index")
    if index is not None:
        if not isinstance(index, list) or not all(isinstance(i, int) and not isinstance(i, bool) and i >= 0
                                                  for i in index):
            raise RequestFormatError(f"latent batch_index must be a list of non-negative ints, got {index!r:.80}")
        out["batch_index"] = index
    return out


def latent_to_result(latent: Mapping) -> tuple[dict, dict[str, torch.Tensor]]:
    """The denoised LATENT's samples -> ``({"samples": tag, "parts": n}, tensors)`` (pool side)."""
    tensors: dict[str, torch.Tensor] = {}
    tag, parts = _pack(latent["samples"], "latent", tensors)
    return {"samples": tag, "parts": parts}, tensors


def latent_from_result(template: Mapping, spec: Mapping, tensors: Mapping[str, torch.Tensor]) -> dict:
    """The output LATENT: a copy of the input ``template`` with the denoised ``samples``.

    Nested samples are rebuilt with the template's own NestedTensor class (ComfyUI's), on the
    template's device.

    Raises:
        RequestFormatError: the result does not have the template's structure.
    """
    src = template["samples"]
    nested = is_nested(src)
    if (spec.get("samples") == "nested") != nested or (nested and spec.get("parts") != len(src.tensors)):
        raise RequestFormatError(f"the pool returned a {spec.get('samples')} latent of {spec.get('parts')} part(s) "
                                 "for a different input structure")
    if nested:
        parts = [tensors[f"latent.{i}"].to(t.device) for i, t in enumerate(src.tensors)]
        samples = type(src)(parts)
    else:
        samples = tensors["latent"].to(src.device)
    out = dict(template)
    out["samples"] = samples
    return out


# --------------------------------------------------------------------------- CONDITIONING


def json_option(value: Any) -> Any:
    """A conditioning (or scheduler) option as JSON: numpy scalars become Python numbers; a
    value JSON cannot carry becomes the placeholder ``"<Type object>"`` (the pool then refuses
    the key by name)."""
    if type(value).__module__ == "numpy" and type(value).__name__ in ("bool", "bool_"):  # numpy.bool_
        value = bool(value)
    elif isinstance(value, numbers.Number) and not isinstance(value, (bool, complex)):  # numpy scalars too
        value = int(value) if isinstance(value, numbers.Integral) else float(value)
    try:
        json.dumps(value, allow_nan=False)
        return value
    except (TypeError, ValueError):
        return f"<{type(value).__name__} object>"


def conditioning_to_request(conditioning: Any, name: str) -> tuple[list[dict], dict[str, torch.Tensor]]:
    """A ComfyUI CONDITIONING -> ``(entries, tensors)`` under ``name`` ("positive"/"negative").

    Raises:
        RequestFormatError: not a list of ``[tensor, dict]`` entries.
    """
    if not isinstance(conditioning, (list, tuple)) or not conditioning:
        raise RequestFormatError(f"{name} must be a ComfyUI CONDITIONING: a list of [tensor, dict] entries")
    entries, tensors = [], {}
    for i, entry in enumerate(conditioning):
        if not isinstance(entry, (list, tuple)) or len(entry) != 2 or not isinstance(entry[1], Mapping):
            raise RequestFormatError(f"{name} conditioning entry {i} must be [tensor, dict]")
        tensors[f"{name}.{i}"] = _tensor(entry[0], f"{name} conditioning entry {i}")
        options, tensor_keys = {}, []
        for key, value in entry[1].items():
            if isinstance(value, torch.Tensor):
                tensors[f"{name}.{i}.{key}"] = value.detach()
                tensor_keys.append(str(key))
            else:
                options[str(key)] = json_option(value)
        entries.append({"options": options, "tensor_options": tensor_keys})
    return entries, tensors


def conditioning_from_request(entries: Any, tensors: Mapping[str, torch.Tensor], name: str) -> list:
    """The CONDITIONING a :func:`conditioning_to_request` layout describes (pool side).

    Raises:
        RequestFormatError: a malformed entry or missing tensors.
    """
    if not isinstance(entries, list) or not entries:
        raise RequestFormatError(f"params.{name} must be a non-empty list of conditioning entries")
    out = []
    for i, entry in enumerate(entries):
        if not isinstance(entry, Mapping) or not isinstance(entry.get("options", {}), Mapping):
            raise RequestFormatError(f"params.{name}[{i}] must be an object with an 'options' object")
        keys = entry.get("tensor_options", [])
        if not isinstance(keys, list) or not all(isinstance(k, str) for k in keys):
            raise RequestFormatError(f"params.{name}[{i}].tensor_options must be a list of strings")
        names = [f"{name}.{i}"] + [f"{name}.{i}.{k}" for k in keys]
        missing = [n for n in names if n not in tensors]
        if missing:
            raise RequestFormatError(f"the request lacks the tensors {missing}")
        options = dict(entry.get("options", {}))
        options.update({k: tensors[f"{name}.{i}.{k}"] for k in keys})
        out.append([tensors[f"{name}.{i}"], options])
    return out
