"""Inputs shared by the sampler tests (in process and on ranks): ComfyUI LTX-2 CONDITIONING and
audio-video LATENTs of the tiny models, the sigmas, a LATENT's parts.
"""

from __future__ import annotations

import torch

from ltx_mgpu.nested import NestedTensorLike

SIGMAS = torch.tensor([1.0, 0.725, 0.421875, 0.0])  # 3 steps (ManualSigmas-style)


def cond(width: int, tokens: int, seed: int, **extra):
    """A one-entry CONDITIONING in the unprocessed LTX-2 form: float32 ``[1, tokens, width]`` of a
    seeded normal, ``extra`` added to its options."""
    t = torch.randn(1, tokens, width, generator=torch.Generator().manual_seed(seed))
    return [[t, {"pooled_output": None, "unprocessed_ltxav_embeds": True, **extra}]]


def av_latent(f=3, h=3, w=5, n=7, seed=11, masked=False):
    """An audio-video LATENT (``NestedTensorLike`` of video ``[1, 128, f, h, w]`` and audio
    ``[1, 8, n, 16]``, seeded), with an image-to-video noise mask when ``masked``."""
    g = torch.Generator().manual_seed(seed)
    v, a = torch.randn(1, 128, f, h, w, generator=g), torch.randn(1, 8, n, 16, generator=g)
    out = {"samples": NestedTensorLike([v, a]), "type": "audio"}
    if masked:  # image-to-video: frame 0 kept (LTXVImgToVideo strength 1), audio partly kept
        vm, am = torch.ones(1, 1, f, 1, 1), torch.ones(1, 1, n, 1)
        vm[:, :, 0] = 0.0
        am[:, :, :2] = 0.25
        out["noise_mask"] = NestedTensorLike([vm, am])
    return out


def latent_parts(latent):
    s = latent["samples"]
    return list(s.tensors) if hasattr(s, "tensors") else [s]
