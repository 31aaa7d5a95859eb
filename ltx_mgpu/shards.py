"""A parameter's part on this rank: the local shard of an FSDP2-sharded (``DTensor``) parameter
and the rows of the whole it holds, or the whole parameter when it is not sharded.

Used wherever a weight is read, merged or dequantized by rows (the transformer's loader, its
patches, the fp8 and the packed GGML layers), apart from the FSDP layout itself
(:mod:`ltx_mgpu.denoise.parallel.fsdp`).
"""

from __future__ import annotations

import torch
from torch.distributed.tensor import DTensor

__all__ = ["local_rows", "local_tensor"]


def local_tensor(t: torch.Tensor) -> torch.Tensor:
    """This rank's part of ``t``: the local shard of a sharded parameter, else ``t`` itself."""
    return t.to_local() if isinstance(t, DTensor) else t


def local_rows(t: torch.Tensor) -> slice | None:
    """The rows (dim 0) of the full parameter this rank holds, or None for a whole one.

    FSDP2's ``Shard(0)`` follows ``torch.chunk``: chunks of ``ceil(n / W)`` rows, rank r's from
    row ``r * ceil(n / W)``; its local tensor has as many rows as it holds (possibly none).
    """
    if not isinstance(t, DTensor):
        return None
    mesh = t.device_mesh
    world, rank = mesh.size(), mesh.get_local_rank()
    n = t.shape[0]
    chunk = -(-n // world)
    start = min(rank * chunk, n)
    return slice(start, start + t.to_local().shape[0])
