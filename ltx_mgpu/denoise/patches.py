"""ComfyUI weight patches (what ComfyUI's LoRA loaders build) merged into a loaded denoiser.

ComfyUI's ``LoraLoader`` / ``LoraLoaderModelOnly`` give a MODEL, for each weight of the model
named by its key in ComfyUI's state dict (``"diffusion_model." + <checkpoint key>``), a list
of patches ``(strength, adapter, strength_model, offset, function)``
(``ModelPatcher.add_patches``, ``comfy/model_patcher.py``). ComfyUI merges them when it loads
the model (``patch_weight_to_device`` -> ``comfy.lora.calculate_weight``): the weight as
float32, then for each patch in order ``weight *= strength_model`` (when it is not 1) and
``weight += (strength * scale) * (up @ down)`` for a LoRA (``scale = alpha / rank``, 1 without
alpha; ``comfy/weight_adapter/lora.py``) or ``weight += strength * diff`` for a ``"diff"`` patch,
then a plain cast back to the weight dtype (``comfy/float.py``'s ``stochastic_rounding`` only
rounds stochastically for fp8). :func:`merge` is that, on the model's device.

:func:`apply_patches` puts a new patch set into a resident :class:`LTXDenoiser`: every weight
the old or the new set touches is re-read from the memory-mapped checkpoint (with the LoRAs
fused at load, :class:`~ltx_mgpu.denoise.checkpoint.StateDictLoader`) and merged again, a
few weights at a time, so no backup copy of the model is kept and removing a patch restores
the loaded weights exactly. A sharded transformer (:mod:`ltx_mgpu.denoise.parallel.fsdp`) merges
the same way on each rank's rows: its shard of the original, of the LoRA up-matrix and of a
diff.

Differences from ComfyUI, said once: for an fp8 checkpoint ComfyUI re-quantises the merged
weight to fp8 (stochastic rounding); here the weights are kept in the model's compute dtype
(fp8 is upcast at load), so the merged weight is not rounded to fp8 — except in the layers
:mod:`ltx_mgpu.denoise.fp8` holds as e4m3 (``dtype: fp8``, or a sharded fp8 file): there the
merged float32 weight is quantised per row with stochastic rounding (as ComfyUI's; the noise
seeded by the key, ``ltx_mgpu.denoise.fp8.rounding_noise``), and an unpatched one goes back to
the file's e4m3 values. A GGUF file's packed layers (:class:`~ltx_mgpu.quantized.packed.PackedLinear`)
read nothing: their patch list is replaced and merged into the dequantized weight at each call,
in float32 and the same order, so their bytes stay the file's (ComfyUI-GGUF patches at dequant
time too).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterable, Mapping, Sequence

import torch

from ltx_mgpu.denoise.checkpoint import CONNECTORS, CheckpointInfo, StateDictLoader, inspect_checkpoint, load_loras
from ltx_mgpu.denoise.fp8 import Float8Linear
from ltx_mgpu.denoise.model import transformer_key
from ltx_mgpu.quantized.packed import PackedLinear
from ltx_mgpu.shards import local_rows, local_tensor

__all__ = ["COMFY_PREFIX", "PATCH_KINDS", "PatchError", "WeightPatch", "apply_patches", "merge", "resolve_key"]

#: The prefix of the diffusion model's keys in ComfyUI's model state dict (``BaseModel``).
COMFY_PREFIX = "diffusion_model."
#: The adapters merged here: ComfyUI's plain LoRA (``LoRAAdapter`` without mid / DoRA / reshape),
#: the ``"diff"`` patch, and ``"scale"``: a diff patch without a tensor, ``(None,)`` at strength 0,
#: which only multiplies the weight by ``strength_model`` (the attention multiplier nodes',
#: ``comfy_extras/nodes_attention_multiply.py``).
PATCH_KINDS = ("lora", "diff", "scale")
#: Weights re-read and merged at a time (bounds the extra device memory of a merge).
_CHUNK = 32


class PatchError(ValueError):
    """A patch that cannot be merged exactly (names the key and the fix)."""


@dataclasses.dataclass(frozen=True)
class WeightPatch:
    """One entry of a weight's patch list.

    Attributes:
        kind: ``"lora"`` (``up [out, r]``, ``down [r, in...]``, ``alpha`` or None), ``"diff"``
            (``diff``, the weight's shape) or ``"scale"`` (no tensor, ``strength`` 0).
        strength / strength_model: ComfyUI's ``strength_patch`` / ``strength_model``.
    """

    kind: str
    strength: float
    strength_model: float = 1.0
    up: torch.Tensor | None = None
    down: torch.Tensor | None = None
    alpha: float | None = None
    diff: torch.Tensor | None = None

    def check(self, key: str, shape: Sequence[int]) -> None:
        """Raise :class:`PatchError` unless this patch fits a weight of ``shape``."""
        if self.kind not in PATCH_KINDS:
            raise PatchError(f"{key}: patch kind {self.kind!r} is not one of {PATCH_KINDS}")
        for name, value in (("strength", self.strength), ("strength_model", self.strength_model),
                            ("alpha", 1.0 if self.alpha is None else self.alpha)):
            if not math.isfinite(value):
                raise PatchError(f"{key}: the patch's {name} is {value}; give a finite number")
        numel = math.prod(shape)
        if self.kind == "lora":
            if self.up is None or self.down is None or self.up.ndim < 2 or self.down.ndim < 2:
                raise PatchError(f"{key}: a LoRA patch needs 2-D up and down matrices")
            up, down = self.up.flatten(1), self.down.flatten(1)
            if up.shape[1] != down.shape[0] or up.shape[0] * down.shape[1] != numel:
                raise PatchError(f"{key}: LoRA factors {tuple(self.up.shape)} x {tuple(self.down.shape)} do not make "
                                 f"the weight's {tuple(shape)}; the LoRA was made for another model")
        elif self.kind == "scale":
            if self.strength != 0.0:
                raise PatchError(f"{key}: a diff patch without a tensor needs strength 0 (it only scales the weight by "
                                 f"strength_model), got {self.strength}")
        elif self.diff is None or tuple(self.diff.shape) != tuple(shape):
            got = None if self.diff is None else tuple(self.diff.shape)
            raise PatchError(f"{key}: a diff patch of shape {got} does not fit the weight's {tuple(shape)}")

    def apply(self, weight: torch.Tensor, rows: slice | None = None) -> None:
        """``weight`` (float32) += this patch, in place, as ComfyUI computes it (module doc);
        with ``rows``, ``weight`` is those rows (dim 0) of the whole weight (a shard)."""
        if self.strength_model != 1.0:
            weight *= self.strength_model
        if self.kind == "lora":
            up = self.up.to(device=weight.device, dtype=torch.float32).flatten(1)
            up = up if rows is None else up[rows]
            down = self.down.to(device=weight.device, dtype=torch.float32).flatten(1)
            alpha = self.alpha / down.shape[0] if self.alpha is not None else 1.0
            weight += ((self.strength * alpha) * torch.mm(up, down).reshape(weight.shape)).type(weight.dtype)
        elif self.kind == "diff" and self.strength != 0.0:
            diff = self.diff if rows is None else self.diff[rows]
            weight += self.strength * diff.to(device=weight.device, dtype=weight.dtype)


def merge(original: torch.Tensor, patches: Iterable[WeightPatch], rows: slice | None = None) -> torch.Tensor:
    """``original`` (or its ``rows`` of the whole weight) with ``patches`` merged in order
    (float32 arithmetic), in its dtype."""
    weight = original.to(torch.float32, copy=True)
    for p in patches:
        p.apply(weight, rows)
    return weight.to(original.dtype)


@dataclasses.dataclass(frozen=True)
class _Target:
    """Where a ComfyUI key lives: the checkpoint key, and the module + parameter name."""

    file_key: str
    module: str  # "transformer" | "video_connector" | "audio_connector"
    param: str


def resolve_key(model, info: CheckpointInfo, key: str) -> tuple[_Target, torch.nn.Parameter]:
    """The parameter of ``model`` (an :class:`~ltx_mgpu.denoise.model.LTXDenoiser`) that ComfyUI's
    state-dict ``key`` names.

    Raises:
        PatchError: a key outside the diffusion model, not in the checkpoint, or not a
            parameter of the loaded model (the message names it).
    """
    if not key.startswith(COMFY_PREFIX):
        raise PatchError(f"{key}: only the diffusion model's weights ({COMFY_PREFIX}...) can be patched in the pool")
    rest = key[len(COMFY_PREFIX):]
    if rest not in info.shapes:
        raise PatchError(f"{key}: no such weight in {info.path}; the LoRA was made for another model")
    connector = next((c for c in CONNECTORS if rest.startswith(c + ".")), None)
    if connector is not None:
        module_name = "video_connector" if connector.startswith("video") else "audio_connector"
        param = rest[len(connector) + 1:]
    else:
        module_name = "transformer"
        param = transformer_key(info, rest)
    module = getattr(model, module_name)
    try:
        tensor = module.get_parameter(param) if module is not None and param else None
    except AttributeError:
        tensor = None
    if tensor is None:
        raise PatchError(f"{key}: the loaded LTX-2 model has no parameter for it")
    return _Target(info.prefix + rest, module_name, param), tensor


class _Select:
    """An ``sd_ops`` for :class:`StateDictLoader`: keeps the checkpoint keys it maps."""

    def __init__(self, names: Mapping[str, str]):
        self.names = names

    def apply_to_key(self, key: str) -> str | None:
        return self.names.get(key)


def apply_patches(model, patches: Mapping[str, Sequence[WeightPatch]], previous: Iterable[str] = ()) -> set[str]:
    """Make ``model``'s weights the loaded ones with ``patches`` merged; returns the patched keys.

    Args:
        model: the :class:`~ltx_mgpu.denoise.model.LTXDenoiser` (its ``source`` checkpoint and
            ``loras`` fused at load are re-read).
        patches: ComfyUI key -> its patch list (in ComfyUI's order); an empty list leaves the
            loaded weight.
        previous: the keys patched before, restored when ``patches`` no longer patches them.
    Raises:
        PatchError: an unknown key or a patch that does not fit its weight, before any weight
            changes. Reading the checkpoint (``CheckpointError``, ``OSError``) or device memory
            (``torch.OutOfMemoryError``) may fail midway: weights are then partly merged, and
            the caller must restore them (``apply_patches(model, {}, keys)``) or drop the model.
    """
    info = inspect_checkpoint(model.source)
    wanted = {k: list(v) for k, v in patches.items() if v}
    keys = sorted(set(wanted) | set(previous))
    targets, packed = {}, {}
    for key in keys:
        target, tensor = resolve_key(model, info, key)
        layer = _layer(model, target)
        shape = layer.weight_shape if isinstance(layer, PackedLinear) else tensor.shape
        for p in wanted.get(key, ()):
            p.check(key, shape)
        if isinstance(layer, PackedLinear):
            packed[key] = layer
        else:
            targets[key] = (target, tensor)
    for key, layer in packed.items():  # merged per call: nothing to read
        layer.patches = tuple(wanted.get(key, ()))
    keys = sorted(targets)
    deltas = load_loras(model.loras, [k for k in info.shapes if k.endswith(".weight")]) if model.loras else {}
    rows = {k: r for k, (_, tensor) in targets.items() if (r := local_rows(tensor)) is not None}
    layers = {k: layer for k, (target, _) in targets.items()
              if isinstance(layer := _layer(model, target), Float8Linear)}
    loader = StateDictLoader(info, model.dtype, deltas, rows=rows, keep_e4m3=set(layers))
    for start in range(0, len(keys), _CHUNK):
        chunk = keys[start:start + _CHUNK]
        names = {targets[k][0].file_key: k for k in chunk}
        originals = loader.load(info.path, _Select(names), model.device).sd
        with torch.no_grad():
            for key in chunk:
                original, todo = originals.pop(key), wanted.get(key, ())
                if key not in layers:
                    local_tensor(targets[key][1]).copy_(merge(original, todo, rows.get(key)))  # a shard: its rows
                    continue
                scale = loader.scales.pop(key, None)
                if todo:  # merged in float32, then quantised per row
                    if original.dtype == torch.float8_e4m3fn:
                        original = original.float() * (1.0 if scale is None else scale.reshape(-1, 1))
                    layers[key].set_weight(merge(original.float(), todo, rows.get(key)), stochastic_key=key)
                else:
                    layers[key].set_weight(original, scale)
        del originals
    return set(wanted)


def _layer(model, target: _Target) -> torch.nn.Module | None:
    """The module whose ``weight`` ``target`` is, or None (a bias, a scale table)."""
    if not target.param.endswith(".weight"):
        return None
    return getattr(model, target.module).get_submodule(target.param[: -len(".weight")])
