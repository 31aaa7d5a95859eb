"""The one transformer call both samplers make: the SP Sampler's steps
(:mod:`ltx_mgpu.denoise.comfyui.sampler`) and the MODEL's forward (:mod:`ltx_mgpu.denoise.comfyui.forward`),
so the two cannot drift.

A call is one :class:`ModalityInput` per modality present, turned into ltx-core 1.0.0
``Modality`` objects (``ltx_core/model/transformer/modality.py``) and given to the velocity
model (``LTXModel.forward``'s contract, or the
:class:`~ltx_mgpu.denoise.parallel.ulysses.SequenceParallelTransformer` around it).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping

import torch
from ltx_core.model.transformer.modality import Modality

__all__ = ["ModalityInput", "transformer_call"]


@dataclasses.dataclass(frozen=True)
class ModalityInput:
    """One modality of a transformer call (the fields of ltx-core's ``Modality``).

    Attributes:
        tokens: patchified latent ``[B, T, C]`` in the model dtype on its device.
        timesteps: per-token sigmas ``[B, T]`` float32 (ComfyUI's timestep: the sigma itself for
            LTX-2's flow matching; ltx-core scales them by ``timestep_scale_multiplier``), or
            ``[B, 1]`` when every token of a sample has the same one: ltx-core's AdaLN then runs
            once per sample and its modulation broadcasts over the tokens (the same values, none of
            the per-token ``[B, T, 6 x D]`` tensors each block would otherwise read).
        positions: ltx-core positions ``[B, 3, T, 2]`` (video) / ``[B, 1, T, 2]`` (audio).
        context: this modality's text context ``[B, L, D]`` in the model dtype.
        self_attention: optional self-attention weights ``[B or 1, T, T]`` in ``[0, 1]`` (1 =
            full attention, 0 = none), in the model dtype; ltx-core turns them into the additive
            log-space bias ComfyUI builds for guide attention (``Modality.attention_mask``).
        context_mask: optional text mask ``[B or 1, L]`` (1 = attend, 0 = padding), ComfyUI's
            ``attention_mask`` (``Modality.context_mask``: bias ``(mask - 1) * finfo.max``).
    """

    tokens: torch.Tensor
    timesteps: torch.Tensor
    positions: torch.Tensor
    context: torch.Tensor
    self_attention: torch.Tensor | None = None
    context_mask: torch.Tensor | None = None


def transformer_call(velocity: Callable, inputs: Mapping[str, ModalityInput]) -> dict[str, torch.Tensor]:
    """ltx-core ``Modality`` per entry of ``inputs`` (``"video"`` / ``"audio"``), with ``sigma``
    the per-sample maximum of its timesteps (the cross-modal and prompt AdaLN input; ComfyUI
    takes ``timestep.max()``, the same whenever the samples of a batch share their sigma), through
    ``velocity(video, audio, perturbations)``.

    Returns:
        ``{name: velocity [B, T, C_out]}`` for each modality given.
    """
    mods = {k: Modality(latent=m.tokens, sigma=m.timesteps.amax(dim=1), timesteps=m.timesteps,
                        positions=m.positions, context=m.context, context_mask=m.context_mask,
                        attention_mask=m.self_attention) for k, m in inputs.items()}
    vx, ax = velocity(mods.get("video"), mods.get("audio"), None)
    return {k: v for k, v in (("video", vx), ("audio", ax)) if k in inputs}
