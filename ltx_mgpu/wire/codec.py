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
  The pool refuses part counts over ``MAX_LATENT_PARTS`` and ``batch_index`` values from
  ``MAX_BATCH`` on (:mod:`ltx_mgpu.wire.messages`), before building anything.
* CONDITIONING: ``params["positive"]`` (and ``"negative"``) = one ``{"options": {...},
  "tensor_options": [key, ...]}`` per entry; tensors ``positive.{i}`` (the ``[B, T, D]``
  embedding) and ``positive.{i}.{key}`` for tensor-valued options (``attention_mask``,
  ``keyframe_idxs``); tensors inside dict / list options (``ref_audio["tokens"]``, a guide
  entry's ``pixel_mask``) as ``positive.{i}.{key}.{path}``, ``{"$tensor": name}`` in the JSON.
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
from ltx_mgpu.wire.messages import MAX_BATCH, MAX_LATENT_PARTS

__all__ = [
    "DEFAULT_MODEL",
    "TENSOR_REF",
    "RequestFormatError",
    "conditioning_from_request",
    "conditioning_to_request",
    "json_option",
    "latent_from_request",
    "latent_from_result",
    "latent_to_request",
    "latent_to_result",
    "sample_tensor_names",
]

#: The resident-model name ``load_transformer`` / ``sample`` use when none is given.
DEFAULT_MODEL = "ltx"
#: The fields of ``params["latent"]``.
LATENT_FIELDS = ("samples", "parts", "noise_mask", "mask_parts", "type", "batch_index")


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


def _is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _part_names(tag: Any, parts: Any, name: str, count_field: str) -> list[str]:
    """The tensor names a ``tag`` / part count describes, checked before any is looked up:
    ``[name]`` for ``"tensor"``, ``[name.0 .. name.{parts-1}]`` for ``"nested"`` (at most
    :data:`~ltx_mgpu.wire.messages.MAX_LATENT_PARTS` parts)."""
    if tag == "tensor":
        return [name]
    if tag == "nested":
        if not _is_int(parts) or not 1 <= parts <= MAX_LATENT_PARTS:
            raise RequestFormatError(f"latent.{count_field} must be 1..{MAX_LATENT_PARTS} for a nested {name} "
                                     f"(LTX-2 nests video and audio), got {parts!r:.40}")
        return [f"{name}.{i}" for i in range(parts)]
    raise RequestFormatError(f"{name} must be tagged 'tensor' or 'nested', got {tag!r:.40}")


def _unpack(tag: Any, parts: Any, name: str, count_field: str, tensors: Mapping[str, torch.Tensor], nested_type) -> Any:
    names = _part_names(tag, parts, name, count_field)
    missing = [n for n in names if n not in tensors]
    if missing:
        raise RequestFormatError(f"the request lacks the tensor(s) {missing}")
    if tag == "tensor":
        return tensors[name]
    return nested_type([tensors[n] for n in names])


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

    Every field is checked before anything is built: the part counts against
    :data:`~ltx_mgpu.wire.messages.MAX_LATENT_PARTS`, the ``batch_index`` values against
    :data:`~ltx_mgpu.wire.messages.MAX_BATCH` (a noise index is a draw the sampler makes first).

    Raises:
        RequestFormatError: a malformed spec (unknown field, bad tag or part count, a
            ``batch_index`` that is not a list of 0..MAX_BATCH-1, a ``type`` that is not a
            string) or missing tensors.
    """
    if not isinstance(spec, Mapping):
        raise RequestFormatError("params.latent must be an object")
    unknown = sorted(set(spec) - set(LATENT_FIELDS))
    if unknown:
        raise RequestFormatError(f"params.latent has unknown field(s) {unknown}; known: {list(LATENT_FIELDS)}")
    index = spec.get("batch_index")
    if index is not None:
        if not isinstance(index, list) or not all(_is_int(i) for i in index):
            raise RequestFormatError(f"latent.batch_index must be a list of ints (ComfyUI's noise indices), "
                                     f"got {index!r:.80}")
        bad = next((i for i in index if not 0 <= i < MAX_BATCH), None)
        if bad is not None:
            raise RequestFormatError(f"latent.batch_index values must be in 0..{MAX_BATCH - 1} (ComfyUI's largest "
                                     f"batch is {MAX_BATCH}), got {bad}; number the batch from 0")
        if len(index) > MAX_BATCH:
            raise RequestFormatError(f"latent.batch_index holds {len(index)} values, at most {MAX_BATCH} (ComfyUI's "
                                     "largest batch); one per sample of the latent")
    if spec.get("type") is not None and not isinstance(spec["type"], str):
        raise RequestFormatError(f"latent.type must be a string or null, got {spec['type']!r:.40}")
    for count in ("parts", "mask_parts"):
        value = spec.get(count)
        if value is not None and not (_is_int(value) and 0 <= value <= MAX_LATENT_PARTS):
            raise RequestFormatError(f"latent.{count} must be a part count of at most {MAX_LATENT_PARTS} (LTX-2 "
                                     f"nests video and audio), got {value!r:.40}")
    out = {"samples": _unpack(spec.get("samples"), spec.get("parts"), "latent", "parts", tensors, nested_type)}
    if spec.get("noise_mask") is not None:
        out["noise_mask"] = _unpack(spec["noise_mask"], spec.get("mask_parts"), "noise_mask", "mask_parts", tensors,
                                    nested_type)
    if spec.get("type") is not None:
        out["type"] = spec["type"]
    if index is not None:
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


#: The JSON stand-in for a tensor inside a nested option value (``{"$tensor": name}``).
TENSOR_REF = "$tensor"


def _nested_to_request(value: Any, name: str, tensors: dict) -> Any:
    """``value`` with every tensor inside dicts / lists (``ref_audio["tokens"]``, a guide entry's
    ``pixel_mask``) replaced by ``{"$tensor": name.<path>}`` and put in ``tensors``."""
    if isinstance(value, torch.Tensor):
        tensors[name] = value.detach()
        return {TENSOR_REF: name}
    if isinstance(value, Mapping):
        return {str(k): _nested_to_request(v, f"{name}.{k}", tensors) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_nested_to_request(v, f"{name}.{j}", tensors) for j, v in enumerate(value)]
    return json_option(value)


def _nested_from_request(value: Any, prefix: str, tensors: Mapping[str, torch.Tensor], refs: set) -> Any:
    if isinstance(value, Mapping):
        if set(value) == {TENSOR_REF}:
            ref = value[TENSOR_REF]
            if not isinstance(ref, str) or not ref.startswith(prefix) or ref not in tensors:
                raise RequestFormatError(f"an option of {prefix[:-1]} references the tensor {ref!r:.60}, which the "
                                         "request does not carry under that entry")
            refs.add(ref)
            return tensors[ref]
        return {k: _nested_from_request(v, prefix, tensors, refs) for k, v in value.items()}
    if isinstance(value, list):
        return [_nested_from_request(v, prefix, tensors, refs) for v in value]
    return value


def conditioning_to_request(conditioning: Any, name: str) -> tuple[list[dict], dict[str, torch.Tensor]]:
    """A ComfyUI CONDITIONING -> ``(entries, tensors)`` under ``name`` ("positive"/"negative").

    Tensor options travel as tensors ``name.<i>.<key>``; tensors inside dict or list options as
    ``name.<i>.<key>.<path>``, referenced from the JSON as ``{"$tensor": name}``.

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
                options[str(key)] = _nested_to_request(value, f"{name}.{i}.{key}", tensors)
        entries.append({"options": options, "tensor_options": tensor_keys})
    return entries, tensors


def conditioning_from_request(entries: Any, tensors: Mapping[str, torch.Tensor], name: str) -> list:
    """The CONDITIONING a :func:`conditioning_to_request` layout describes (pool side).

    Raises:
        RequestFormatError: a malformed entry, missing tensors, or a tensor reference outside
            its entry.
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
            raise RequestFormatError(f"the request lacks the tensor(s) {missing}")
        options = {k: _nested_from_request(v, f"{name}.{i}.", tensors, set())
                   for k, v in dict(entry.get("options", {})).items()}
        options.update({k: tensors[f"{name}.{i}.{k}"] for k in keys})
        out.append([tensors[f"{name}.{i}"], options])
    return out


def _tensor_refs(value: Any) -> set[str]:
    if isinstance(value, Mapping):
        if set(value) == {TENSOR_REF} and isinstance(value[TENSOR_REF], str):
            return {value[TENSOR_REF]}
        return set().union(*(_tensor_refs(v) for v in value.values())) if value else set()
    if isinstance(value, list):
        return set().union(*(_tensor_refs(v) for v in value)) if value else set()
    return set()


def sample_tensor_names(params: Mapping[str, Any]) -> set[str]:
    """The tensor names a ``sample`` request's ``params`` describe (``latent``, ``noise_mask``,
    ``positive`` / ``negative`` and their tensor options, ``sigmas``), so the pool can refuse
    any other. Call it after :func:`latent_from_request` and :func:`conditioning_from_request`
    accepted the params."""
    spec = params["latent"]
    names = set(_part_names(spec.get("samples"), spec.get("parts"), "latent", "parts"))
    if spec.get("noise_mask") is not None:
        names.update(_part_names(spec["noise_mask"], spec.get("mask_parts"), "noise_mask", "mask_parts"))
    for side in ("positive", "negative"):
        for i, entry in enumerate(params.get(side) or []):
            names.add(f"{side}.{i}")
            names.update(f"{side}.{i}.{k}" for k in entry.get("tensor_options", []))
            names.update(_tensor_refs(entry.get("options", {})))
    names.add("sigmas")
    return names
