"""Deterministic weights for the embedded models: every tensor a pure function of its key.

The tiny checkpoints (:mod:`ltx_mgpu.assets.ltx`, :mod:`ltx_mgpu.assets.audio`) draw each
tensor from its own generator, seeded by a digest of ``(seed, key)``, so the same seed gives
byte-identical files whatever order the tensors are built in.
"""

from __future__ import annotations

import hashlib

import torch

__all__ = ["init_tensor"]


def _generator(seed: int, key: str) -> torch.Generator:
    digest = hashlib.sha256(f"{seed}/{key}".encode()).digest()
    return torch.Generator().manual_seed(int.from_bytes(digest[:8], "little") & (2**63 - 1))


def init_tensor(key: str, shape: torch.Size, seed: int) -> torch.Tensor:
    """A float32 tensor for checkpoint ``key``, a pure function of ``(seed, key, shape)``."""
    g = _generator(seed, key)
    leaf = key.rsplit(".", 1)[-1]
    if leaf == "learnable_registers":
        return torch.rand(shape, generator=g) * 2.0 - 1.0
    if leaf == "std-of-means":
        return 0.5 + torch.rand(shape, generator=g)
    if leaf == "mean-of-means":
        return 0.1 * torch.randn(shape, generator=g)
    if len(shape) >= 2:
        fan_in = max(1, shape.numel() // shape[0])
        return torch.randn(shape, generator=g) / fan_in**0.5
    if key.endswith("norm.weight"):
        return 1.0 + 0.1 * torch.randn(shape, generator=g)
    return 0.05 * torch.randn(shape, generator=g)
