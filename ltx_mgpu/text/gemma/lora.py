"""ComfyUI's weight patches on a loaded Gemma 3 text tower (``LoraLoader``'s CLIP strength):
:class:`TowerPatches`, and the key names ComfyUI gives the tower's weights (:func:`comfy_clip_keys`).

ComfyUI's ``LoraLoader`` maps a LoRA's text-encoder keys onto its LTX-2 text encoder's state-dict
keys (``comfy.lora.model_lora_keys_clip``): ``gemma3_12b.transformer.model.<name>``, ``<name>``
being the ``Gemma3TextModel`` parameter (``layers.3.self_attn.q_proj.weight``...), and hands the
CLIP, for each key, a list of patches ``(strength, adapter, strength_model, offset, function)``
that its ``ModelPatcher`` merges when the model loads (``patch_weight_to_device``: the weight as
float32, each patch in order ``weight *= strength_model`` then ``+= strength * alpha / rank * up @
down`` (a LoRA) or ``+= strength * diff``, then rounded to the weight's stored dtype:
``comfy.float.stochastic_rounding``, a plain cast for bf16 / fp16 / fp32).

:meth:`TowerPatches.set` makes the tower's weights the loaded ones with a patch set merged, by
the kind of layer:

* a dense weight (bf16 / fp16 / fp32 loads, ComfyUI's quantized files dequantized at load; the
  norms and the embedding table of every tower): merged as ComfyUI merges it, into the
  parameter in place (so every view of it, the tied LM head and captured CUDA graphs included,
  sees it). The merged weight is rounded to the dtype the *file* stores the weight in when that
  is narrower than the compute dtype (a bf16 file computed in float32: ComfyUI keeps the file's
  bf16 and merges into it), so the result is ComfyUI's; the loaded value is kept in host memory
  the first time a weight is patched (as ComfyUI's ``backup``) and put back when a later set no
  longer patches it. ComfyUI re-quantizes a merged weight of a quantized file layer (nvfp4, fp8:
  stochastic rounding) and merges in float16 on GPUs that prefer it; here the merge is float32
  and the dequantized layer keeps it exactly;
* a GGUF file's packed linear (``ltx_mgpu.quantized.packed.PackedLinear``): the patches merge into
  the dequantized weight at every call, in float32 (as ComfyUI-GGUF patches at dequant time);
  the file's bytes never change;
* an NF4 projection (bitsandbytes ``Linear4bit``, or the encoder's dequantizing stand-in): its
  4-bit weight cannot take a merge, so the patch computes beside it, in float32 on the layer's
  input (a LoRA as its two thin products, ``x @ down.T @ up.T``; ``strength_model`` scales the
  layer's own output): the same weight ``(W * s) + delta`` as a merge, applied as low-rank terms.

A GGUF file's packed embedding table takes no patch (refused by key). The patches are the pool's
``WeightPatch`` objects (``ltx_mgpu.denoise.patches``), taken by duck typing: ``kind``
(``"lora"`` / ``"diff"``), ``strength``, ``strength_model``, ``up``, ``down``, ``alpha``,
``diff``, ``check(key, shape)`` and ``apply(weight)`` (in place on a float32 weight).
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any, Mapping, Sequence

import torch
from safetensors import safe_open
from torch import nn

from ltx_mgpu.quantized.packed import PackedEmbedding, PackedLinear
from ltx_mgpu.text.gemma.comfy_file import open_comfy_file
from ltx_mgpu.text.gemma.keys import SNAPSHOT_KEY_MAPPING
from ltx_mgpu.text.gemma.tower import GemmaTextTower

__all__ = ["COMFY_TOWER_PREFIX", "FLOAT_DTYPES", "TowerPatches", "comfy_clip_keys", "merged_weight",
           "tower_parameter_shapes"]

#: The prefix of the Gemma text tower's keys in ComfyUI's LTX-2 text encoder state dict
#: (``LTXAVTEModel.gemma3_12b`` -> ``Gemma3_12BModel.transformer`` -> ``Gemma3_12B.model``).
COMFY_TOWER_PREFIX = "gemma3_12b.transformer.model."
#: safetensors' dtype names -> torch dtypes, for the float kinds a weight a patch merges into is
#: stored as (any other kind has no entry).
FLOAT_DTYPES = {"BF16": torch.bfloat16, "F16": torch.float16, "F32": torch.float32}


def tower_parameter_shapes(config: Any) -> dict[str, tuple[int, ...]]:
    """``Gemma3TextModel`` parameter name -> shape for a ``Gemma3TextConfig`` (built on the meta
    device: no memory, no weights)."""
    from transformers import Gemma3TextModel  # deferred: transformers takes seconds to import

    with torch.device("meta"):
        model = Gemma3TextModel(config)
    return {name: tuple(p.shape) for name, p in model.named_parameters()}


def comfy_clip_keys(shapes: Mapping[str, Sequence[int]]) -> dict[str, tuple[int, ...]]:
    """ComfyUI's key -> shape for each tower parameter of ``shapes``
    (:func:`tower_parameter_shapes`): what ``comfy.lora.model_lora_keys_clip`` maps a LoRA onto."""
    return {COMFY_TOWER_PREFIX + name: tuple(shape) for name, shape in shapes.items()}


def merged_weight(loaded: torch.Tensor, stored: torch.dtype | None, dtype: torch.dtype, device: torch.device | str,
                  patches: Sequence[Any], rows: slice | None = None) -> torch.Tensor:
    """ComfyUI's merge of ``patches`` (in order) into a loaded weight (module doc): ``loaded`` (the
    loaded value, or its ``rows`` of the whole weight, any device) in the narrower of ``stored``
    (the dtype the file stores the weight in; None: not known) and ``dtype`` (the parameter's),
    upcast to float32, each patch's ``apply(weight, rows)``, rounded back to that narrower dtype.
    Returns it in ``dtype`` on ``device``, shaped like ``loaded``."""
    narrow = stored if stored is not None and stored.itemsize < dtype.itemsize else dtype
    merged = loaded.to(device=device, dtype=narrow).to(torch.float32)
    for p in patches:
        p.apply(merged, rows)
    return merged.to(narrow).to(dtype)


def _file_dtypes(tower: GemmaTextTower) -> dict[str, torch.dtype]:
    """Tower parameter name -> the float dtype its source file stores it in (headers only), for
    the dense layers of a ComfyUI file or a snapshot; quantized layers, GGUF and NF4 have none."""
    path = Path(tower.path)
    out: dict[str, torch.dtype] = {}
    if tower.format == "comfy_file":
        src = open_comfy_file(path)
        with safe_open(str(path), framework="pt") as f:
            for name in src.shapes:
                key = "model." + name
                if src.quant.of(key) is None:
                    dtype = FLOAT_DTYPES.get(f.get_slice(key).get_dtype())
                    if dtype is not None:
                        out[name] = dtype
    elif tower.format == "hf_snapshot":
        (pattern, repl), = SNAPSHOT_KEY_MAPPING.items()
        for file in sorted(path.glob("*.safetensors")):
            with safe_open(str(file), framework="pt") as f:
                names = f.keys()  # a safe_open handle is not iterable
                for key in names:
                    dtype = FLOAT_DTYPES.get(f.get_slice(key).get_dtype())
                    if dtype is not None:
                        out[re.sub(pattern, repl, key)] = dtype
    return out


class TowerPatches:
    """The patch set merged into one loaded tower (module doc).

    Args:
        tower: the loaded tower (changed in place; keep one :class:`TowerPatches` per tower).
    """

    def __init__(self, tower: GemmaTextTower):
        self.tower = tower
        self.model: nn.Module = tower.model
        self.keys: set[str] = set()
        self._backup: dict[str, torch.Tensor] = {}
        self._hooks: dict[str, Any] = {}
        self._file_dtypes: dict[str, torch.dtype] | None = None

    # ---- where a key lives

    def _target(self, key: str) -> tuple[str, nn.Module, str]:
        """``(parameter name, owning module, kind)`` of ComfyUI ``key``; kind is ``"dense"``,
        ``"packed"`` or ``"nf4"``.

        Raises:
            ValueError: a key outside the text tower, without a parameter, or a packed table.
        """
        if not key.startswith(COMFY_TOWER_PREFIX) or not key.endswith(".weight"):
            raise ValueError(f"{key}: only the Gemma text tower's weights ({COMFY_TOWER_PREFIX}...weight) can be "
                             "patched in the pool; the LoRA patches something the pool's Gemma does not have")
        name = key[len(COMFY_TOWER_PREFIX):]
        owner_name = name[: -len(".weight")]
        try:
            module = self.model.get_submodule(owner_name)
        except AttributeError:
            module = None
        if module is None or not isinstance(getattr(module, "weight", None), torch.Tensor):
            raise ValueError(f"{key}: the pool's Gemma has no such weight; the LoRA was made for another model")
        if isinstance(module, PackedEmbedding):
            raise ValueError(f"{key}: a GGUF file's packed embedding table cannot be patched; load a safetensors "
                             "Gemma to apply this LoRA")
        if isinstance(module, PackedLinear):
            return name, module, "packed"
        if type(module.weight).__name__ == "Params4bit":
            return name, module, "nf4"
        return name, module, "dense"

    @staticmethod
    def _shape(module: nn.Module, kind: str) -> tuple[int, ...]:
        if kind == "packed":
            return tuple(module.weight_shape)
        if kind == "nf4":
            return (int(module.out_features), int(module.in_features))
        return tuple(module.weight.shape)

    # ---- setting a patch set

    def set(self, patches: Mapping[str, Sequence[Any]]) -> set[str]:
        """Make the tower's weights the loaded ones with ``patches`` (ComfyUI key -> its patches,
        in ComfyUI's order) merged; keys patched before and absent now are restored. Returns
        the patched keys.

        Raises:
            ValueError: a key the tower does not have, or a patch that does not fit its weight
                (before any weight changes). Device memory may fail midway
                (``torch.OutOfMemoryError``): then call ``set({})`` to restore, or drop the tower.
        """
        wanted = {k: list(v) for k, v in patches.items() if v}
        targets = {key: self._target(key) for key in sorted(set(wanted) | self.keys)}
        for key, plist in wanted.items():
            _, module, kind = targets[key]
            for p in plist:
                p.check(key, self._shape(module, kind))
        for key in sorted(self.keys - set(wanted)):
            self._restore(key, *targets[key])
        with torch.no_grad():
            for key in sorted(wanted):
                name, module, kind = targets[key]
                self._restore(key, name, module, kind)
                if kind == "packed":
                    module.patches = tuple(wanted[key])
                elif kind == "nf4":
                    self._hooks[key] = module.register_forward_hook(_LowRank(wanted[key]))
                else:
                    self._merge(key, name, module, wanted[key])
        self.keys = set(wanted)
        return set(self.keys)

    def _restore(self, key: str, name: str, module: nn.Module, kind: str) -> None:
        """Put ``key``'s loaded weight back (no-op for a weight never patched)."""
        if kind == "packed":
            module.patches = ()
        elif kind == "nf4":
            hook = self._hooks.pop(key, None)
            if hook is not None:
                hook.remove()
        elif key in self._backup:
            with torch.no_grad():
                module.weight.copy_(self._backup[key])

    def _merge(self, key: str, name: str, module: nn.Module, plist: list) -> None:
        weight = module.weight
        if key not in self._backup:
            self._backup[key] = weight.detach().to("cpu", copy=True)
        if self._file_dtypes is None:
            self._file_dtypes = _file_dtypes(self.tower)
        weight.copy_(merged_weight(self._backup[key], self._file_dtypes.get(name), weight.dtype, weight.device, plist))


class _LowRank:
    """A forward hook adding a patch list to an NF4 projection's output (module doc): ``y``
    becomes ``(W * s) x + sum_p c_p * delta_p x`` for the merge ``W <- W * s_p + delta_p`` in
    order (``s`` the product of every ``strength_model``, ``c_p`` that of the later ones), in
    float32, cast back to ``y``'s dtype."""

    def __init__(self, patches: Sequence[Any]):
        self.patches = list(patches)

    def __call__(self, module: nn.Module, args: tuple, out: torch.Tensor) -> torch.Tensor:
        x = args[0].to(torch.float32)
        later, scale = [], 1.0  # later[p]: the product of the strength_model of the patches after p
        for p in reversed(self.patches):
            later.append(scale)
            scale *= p.strength_model
        later.reverse()
        y = out.to(torch.float32) * scale
        bias = getattr(module, "bias", None)
        if bias is not None and scale != 1.0:
            y = y + (1.0 - scale) * bias.to(torch.float32)
        for p, coef in zip(self.patches, later):
            if p.kind == "lora":
                down = p.down.to(device=x.device, dtype=torch.float32).flatten(1)
                up = p.up.to(device=x.device, dtype=torch.float32).flatten(1)
                alpha = p.alpha / down.shape[0] if p.alpha is not None else 1.0
                y = y + (coef * p.strength * alpha) * ((x @ down.T) @ up.T)
            elif p.strength != 0.0:
                y = y + (coef * p.strength) * (x @ p.diff.to(device=x.device, dtype=torch.float32).T)
        return y.to(out.dtype)
