"""ComfyUI's weight patches on the pool's whole text encoder (``LoraLoader``'s CLIP strength): the
Gemma text tower, the LTX-2 text projection and Gemma's vision tower and projector
(:class:`EncoderPatches`), with the projection's part (:class:`ProjectionPatches`), the vision
part (:class:`VisionPatches`) and their key names (:func:`comfy_projection_keys`,
:func:`comfy_vision_keys`). The tower's part is ``ltx_mgpu.text.gemma.lora.TowerPatches``.

ComfyUI's LTX-2 text encoder (``LTXAVTEModel``, ``comfy/text_encoders/lt.py``, 0.20.1) holds the
projection as ``text_embedding_projection``: one ``Linear(D*L, 3840, bias=False)`` for LTX-2.0
(``single_linear``; its state-dict key ``text_embedding_projection.weight``, the checkpoint's
``aggregate_embed.weight`` renamed by ``load_sd``) or ``DualLinearProjection`` for LTX-2.3
(``text_embedding_projection.{video,audio}_aggregate_embed.{weight,bias}``).
``comfy.lora.model_lora_keys_clip`` maps a LoRA's ``text_encoders.<key minus .weight>`` onto each
``.weight`` key of that state dict, and ``comfy.lora.load_lora`` a ``.diff_b`` onto the ``.bias``
beside it, so a LoRA patches the projection as it patches the tower.

The projection is always a dense module in the compute dtype (``ltx_mgpu.text.features.Projection``,
whatever the Gemma's weights mode). A patched projection weight is merged as ComfyUI merges it
(``ModelPatcher.patch_weight_to_device``; the float32 arithmetic of
``ltx_mgpu.denoise.patches.WeightPatch.apply``): the loaded value in float32, each patch in order,
rounded to the dtype the projection *file* stores the weight in when that is narrower than the
compute dtype (ComfyUI keeps a bf16 projection in bf16 and merges into it: ``comfy.float.
stochastic_rounding`` is a plain cast for bf16 / fp16 / fp32), then written into the parameter in
place. The projection stores its weights with the features permuted (``Projection.from_file_layout``);
the patches, made for the checkpoint's layout, merge in that layout, block of rows by block of rows
(each row permuted on its own), and the result is permuted back. The loaded value is kept in host
memory the first time a weight is patched and put back (and the host copy freed) when a later set
no longer patches it, as ``TowerPatches`` does for the tower (``ltx_mgpu.text.gemma.lora``), which
keeps its copies.

The vision tower: ComfyUI's ``Gemma3_12B`` (``comfy/text_encoders/llama.py``) holds SigLIP as
``vision_model`` (``comfy.clip_model.CLIPVision``, whose parameter names for a SigLIP config --
``embeddings.patch_embedding``, ``embeddings.position_embedding``, ``encoder.layers.N.{layer_norm1,
self_attn.{q,k,v,out}_proj, layer_norm2, mlp.fc1, mlp.fc2}``, ``post_layernorm`` -- are
transformers' ``SiglipVisionModel``'s) and ``multi_modal_projector`` (``mm_input_projection_weight``,
``mm_soft_emb_norm.weight``: transformers' ``Gemma3MultiModalProjector``'s names), so its keys are
``gemma3_12b.transformer.vision_model.<name>`` / ``gemma3_12b.transformer.multi_modal_projector.
<name>`` with ``<name>`` the pool's ``GemmaVision`` parameter under ``tower.`` / ``projector.``
(:func:`comfy_vision_key`). ComfyUI runs it only for an image, so the pool merges the vision part
only into rank 0's ``GemmaVision``, which loads with the first image: the part is checked against
the source's headers when set (on every holder) and kept; the loaded tower takes it when it loads
(:meth:`VisionPatches.attach`) and whenever the set changes after. The merge is the projection's:
float32 from the loaded value, rounded to the dtype the file stores the weight in (bf16 / fp16),
written in place; a quantized vision layer (a ``comfy_quant`` marker) keeps the float32 merge of
its dequantized weight (ComfyUI re-quantizes it), as ``TowerPatches`` does for quantized tower layers.
"""

from __future__ import annotations

import os
from typing import Any, Mapping, Sequence

import torch
from safetensors import safe_open
from torch import nn

from ltx_mgpu.text.features import Projection, detect_projection_version
from ltx_mgpu.text.gemma.lora import COMFY_TOWER_PREFIX, FLOAT_DTYPES, TowerPatches, merged_weight
from ltx_mgpu.text.gemma.vision import VisionSource, find_vision, vision_weights

__all__ = ["COMFY_PROJECTION_PREFIX", "EncoderPatches", "ProjectionPatches", "VisionPatches", "comfy_projection_keys",
           "comfy_vision_key", "comfy_vision_keys", "projection_file_weights"]

#: The prefix of the projection's keys in ComfyUI's LTX-2 text encoder state dict.
COMFY_PROJECTION_PREFIX = "text_embedding_projection."
#: ComfyUI key (minus the prefix) -> (``Projection`` submodule, parameter, the file's name minus its prefix).
_LAYOUTS = {
    "2.0": {"weight": ("aggregate_embed", "weight", "aggregate_embed.weight")},
    "2.3": {f"{side}_aggregate_embed.{p}": (f"{side}_aggregate_embed", p, f"{side}_aggregate_embed.{p}")
            for side in ("video", "audio") for p in ("weight", "bias")},
}
#: ``GemmaVision``'s parameter prefix -> ComfyUI's (``Gemma3_12B.vision_model`` / ``.multi_modal_projector``).
_VISION_PREFIXES = (("tower.", "gemma3_12b.transformer.vision_model."),
                    ("projector.", "gemma3_12b.transformer.multi_modal_projector."))
#: Rows of a projection weight merged at a time (bounds the float32 copies on the device).
_ROWS = 256


def projection_file_weights(path: str | os.PathLike) -> dict[str, tuple[tuple[int, ...], torch.dtype | None]]:
    """ComfyUI's key -> (shape, the dtype the file stores it in; None for a non-float kind) of
    each projection weight in an LTX-2 checkpoint or projection file (headers only).

    Raises:
        ProjectionFormatError: the file has no LTX-2 text projection. OSError / safetensors'
            errors: an unreadable file (the pool's load has checked it before).
    """
    with safe_open(os.fspath(path), framework="pt", device="cpu") as f:
        version, prefix = detect_projection_version(list(f.keys()))
        out = {}
        for comfy, (_, _, name) in _LAYOUTS[version].items():
            sl = f.get_slice(prefix + name)
            out[COMFY_PROJECTION_PREFIX + comfy] = (tuple(int(n) for n in sl.get_shape()),
                                                    FLOAT_DTYPES.get(sl.get_dtype()))
    return out


def comfy_projection_keys(path: str | os.PathLike) -> dict[str, tuple[int, ...]]:
    """ComfyUI's state-dict key -> shape of the projection in ``path`` (module doc): what
    ``comfy.lora.model_lora_keys_clip`` maps a LoRA's projection keys onto.

    Raises:
        As :func:`projection_file_weights`.
    """
    return {k: shape for k, (shape, _) in projection_file_weights(path).items()}


class ProjectionPatches:
    """The patch set merged into one loaded :class:`~ltx_mgpu.text.features.Projection` (module doc).

    Args:
        projection: the loaded projection (changed in place; keep one per projection).
    """

    def __init__(self, projection: Projection):
        self.projection = projection
        self.keys: set[str] = set()
        self._backup: dict[str, torch.Tensor] = {}
        self._file: dict[str, tuple[tuple[int, ...], torch.dtype | None]] | None = None

    def _files(self) -> dict[str, tuple[tuple[int, ...], torch.dtype | None]]:
        if self._file is None:
            self._file = projection_file_weights(self.projection.source) if self.projection.source else {}
        return self._file

    def _target(self, key: str) -> tuple[nn.Parameter, str, tuple[int, ...]]:
        """``(parameter, its name, the file's shape)`` of ComfyUI ``key``.

        Raises:
            ValueError: a key this LTX-2 version's projection does not have.
        """
        layout = _LAYOUTS[self.projection.version]
        entry = layout.get(key[len(COMFY_PROJECTION_PREFIX):]) if key.startswith(COMFY_PROJECTION_PREFIX) else None
        if entry is None:
            have = ", ".join(COMFY_PROJECTION_PREFIX + k for k in layout)
            raise ValueError(f"{key}: the LTX-{self.projection.version} text projection has no such weight (it has "
                             f"{have}); the LoRA was made for another LTX-2 version's text encoder")
        module, name, _ = entry
        param = getattr(getattr(self.projection, module), name)
        shape = tuple(param.shape)
        return param, name, shape

    def check(self, patches: Mapping[str, Sequence[Any]]) -> None:
        """Raise unless every patch of ``patches`` fits its projection weight (nothing changes).

        Raises:
            ValueError: a key the projection does not have, a patch that does not fit (names the key).
        """
        for key, plist in patches.items():
            _, _, shape = self._target(key)
            for p in plist:
                p.check(key, shape)

    def set(self, patches: Mapping[str, Sequence[Any]]) -> set[str]:
        """Make the projection's weights the loaded ones with ``patches`` (ComfyUI key -> its
        patches, in ComfyUI's order) merged; keys patched before and absent now are restored.
        Returns the patched keys.

        Raises:
            ValueError: as :meth:`check`, before any weight changes. Device memory may fail
                midway (``torch.OutOfMemoryError``): then call ``set({})`` to restore.
        """
        wanted = {k: list(v) for k, v in patches.items() if v}
        self.check(wanted)
        with torch.no_grad():
            for key in sorted(self.keys - set(wanted)):
                param, _, _ = self._target(key)
                param.copy_(self._backup.pop(key))  # the host copy is freed; copy_ crosses devices
            for key in sorted(wanted):
                self._merge(key, wanted[key])
        self.keys = set(wanted)
        return set(self.keys)

    def _merge(self, key: str, plist: list) -> None:
        param, name, _ = self._target(key)
        if key not in self._backup:
            self._backup[key] = param.detach().to("cpu", copy=True)
        stored = self._files().get(key, ((), None))[1]
        backup = self._backup[key]
        if name != "weight":  # a bias: no feature order
            param.copy_(merged_weight(backup, stored, param.dtype, param.device, plist))
            return
        proj = self.projection
        for r0 in range(0, backup.shape[0], _ROWS):  # the file's feature order, a block of rows at a time
            rows = slice(r0, min(r0 + _ROWS, backup.shape[0]))
            block = proj.to_file_layout(backup[rows].to(param.device))
            merged = merged_weight(block, stored, param.dtype, param.device, plist, rows)
            param[rows].copy_(proj.from_file_layout(merged))


def comfy_vision_keys(source: VisionSource) -> dict[str, tuple[int, ...]]:
    """ComfyUI's state-dict key -> shape of each vision weight of ``source`` (module doc):
    ``gemma3_12b.transformer.vision_model.<name>`` / ``gemma3_12b.transformer.multi_modal_projector.<name>``.

    Raises:
        GemmaFormatError: as :func:`~ltx_mgpu.text.gemma.vision.vision_weights`.
    """
    return {comfy_vision_key(ours): shape for ours, (shape, _) in vision_weights(source).items()}


def comfy_vision_key(ours: str) -> str:
    """ComfyUI's key of a vision weight named as ``GemmaVision``'s parameter (``tower.<name>`` ->
    ``gemma3_12b.transformer.vision_model.<name>``, ``projector.<name>`` ->
    ``gemma3_12b.transformer.multi_modal_projector.<name>``; the names after the prefix are the
    same on both sides, module doc).

    Raises:
        ValueError: a name of neither part.
    """
    for mine, comfy in _VISION_PREFIXES:
        if ours.startswith(mine):
            return comfy + ours[len(mine):]
    raise ValueError(f"{ours}: not a vision tower or projector parameter (tower.* / projector.*)")


class VisionPatches:
    """The vision part of a patch set (module doc): checked against the source's vision weights
    when set, merged into the loaded :class:`~ltx_mgpu.text.gemma.vision.GemmaVision` when one
    is attached (:meth:`attach`, when rank 0 loads it) and whenever the set changes after.

    Args:
        gemma: the Gemma source (its vision tower is found from its headers when a patch names it).
    """

    def __init__(self, gemma: str | os.PathLike):
        self.gemma = gemma
        self.keys: set[str] = set()
        self.model: nn.Module | None = None
        self._wanted: dict[str, list] = {}
        self._backup: dict[str, torch.Tensor] = {}
        self._weights: dict[str, tuple[str, tuple[int, ...], torch.dtype | None]] | None = None

    def _known(self) -> dict[str, tuple[str, tuple[int, ...], torch.dtype | None]]:
        """ComfyUI key -> (our name, shape, stored dtype or None) of the source's vision weights."""
        if self._weights is None:
            source = find_vision(self.gemma)
            if source is None:
                raise ValueError(f"the Gemma source {self.gemma} has no vision tower, so the LoRA's vision tower keys "
                                 "cannot be merged (they act only on an image, which this Gemma cannot read); load a "
                                 "Gemma 3 file with the vision tower, or use a LoRA without those keys")
            self._weights = {comfy_vision_key(ours): (ours, shape, FLOAT_DTYPES.get(code))
                             for ours, (shape, code) in vision_weights(source).items()}
        return self._weights

    def check(self, patches: Mapping[str, Sequence[Any]]) -> None:
        """Raise unless every patch of ``patches`` fits its vision weight (nothing changes).

        Raises:
            ValueError: no vision tower in the source, a key it does not have, a patch that does
                not fit (names the key).
        """
        if not patches:
            return
        known = self._known()
        for key, plist in patches.items():
            if key not in known:
                raise ValueError(f"{key}: the Gemma's vision tower has no such weight; the LoRA was made for another "
                                 "model")
            for p in plist:
                p.check(key, known[key][1])

    def set(self, patches: Mapping[str, Sequence[Any]]) -> set[str]:
        """Keep ``patches`` as the vision part and merge them into the attached model, if any
        (keys patched before and absent now restored). Returns the patched keys.

        Raises:
            ValueError: as :meth:`check`, before any weight changes.
        """
        wanted = {k: list(v) for k, v in patches.items() if v}
        self.check(wanted)
        self._wanted = wanted
        if self.model is not None:
            self._apply()
        self.keys = set(wanted)
        return set(self.keys)

    def attach(self, model: nn.Module) -> None:
        """``model`` (a freshly loaded ``GemmaVision`` of this source) takes the kept patches."""
        self.model, self._backup = model, {}
        self._apply()

    def _apply(self) -> None:
        known = self._known() if (self._wanted or self._backup) else {}
        with torch.no_grad():
            for key in sorted(set(self._backup) - set(self._wanted)):
                self.model.get_parameter(known[key][0]).copy_(self._backup.pop(key))  # copy_ crosses devices
            for key in sorted(self._wanted):
                ours, _, stored = known[key]
                param = self.model.get_parameter(ours)
                if key not in self._backup:
                    self._backup[key] = param.detach().to("cpu", copy=True)
                param.copy_(merged_weight(self._backup[key], stored, param.dtype, param.device, self._wanted[key]))


class EncoderPatches:
    """The patch set merged into one loaded text encoder: keys under ``gemma3_12b.transformer.model.``
    go to the tower (``ltx_mgpu.text.gemma.lora.TowerPatches``), keys under
    ``text_embedding_projection.`` to the projection (:class:`ProjectionPatches`).

    Args:
        tower: the loaded Gemma text tower (``GemmaTextTower``).
        projection: the loaded projection.
    """

    def __init__(self, tower: Any, projection: Projection):
        self.tower = TowerPatches(tower)
        self.projection = ProjectionPatches(projection)
        self.vision = VisionPatches(tower.path)

    def set(self, patches: Mapping[str, Sequence[Any]]) -> set[str]:
        """Both parts' :meth:`~ProjectionPatches.set` with their keys of ``patches``; returns the
        patched keys. Every key and patch is checked before any weight changes.

        Raises:
            ValueError: a key of neither part (names the key and what the pool patches), one the
                part does not have, or a patch that does not fit. Device memory may fail midway:
                then call ``set({})`` to restore.
        """
        tower, projection, vision = {}, {}, {}
        for key, plist in patches.items():
            if key.startswith(COMFY_PROJECTION_PREFIX):
                projection[key] = plist
            elif key.startswith(COMFY_TOWER_PREFIX):
                tower[key] = plist
            elif key.startswith(tuple(comfy for _, comfy in _VISION_PREFIXES)):
                vision[key] = plist
            else:
                raise ValueError(f"{key}: the pool's text encoder patches the Gemma text tower's weights "
                                 f"({COMFY_TOWER_PREFIX}...), its vision tower's and projector's "
                                 f"({', '.join(comfy + '...' for _, comfy in _VISION_PREFIXES)}) and the text "
                                 f"projection's ({COMFY_PROJECTION_PREFIX}...); the LoRA patches something else")
        self.projection.check({k: v for k, v in projection.items() if v})
        self.vision.check({k: v for k, v in vision.items() if v})
        keys = self.tower.set(tower)
        return keys | self.projection.set(projection) | self.vision.set(vision)
