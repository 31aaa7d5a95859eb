"""The LTX-2 transformer's weights sharded across the pool's ranks with FSDP2 (PyTorch's
``torch.distributed.fsdp.fully_shard``), together with Ulysses sequence parallelism on the same
ranks.

Layout: every transformer block is its own FSDP unit, and the root ``LTXModel`` one more (its
own parameters: the patchify projections, the AdaLN timestep embedders, the caption
projections, the output norms and projections). Each parameter is split along dim 0 across the
ranks (FSDP2's ``Shard(0)``: rank r holds rows ``[r * ceil(n / W), ...)``, the last ranks fewer
or none). A unit's parameters are all-gathered just before it runs and freed right after
(``reshard_after_forward=True``), and each block prefetches the next one's gather
(``set_modules_to_forward_prefetch``), so communication overlaps the previous block's compute.
Between calls a rank holds about 1/W of the weights; during a call, one or two blocks more.

Sequence parallelism is unchanged: its attention wrappers run inside the blocks, after FSDP has
gathered their weights; every rank runs the same blocks in the same order, so the gathers and
the all-to-alls are issued alike on every rank of the one process group.

Loading never materialises the whole model on a rank: the model is built on the meta device,
sharded, given empty local storage, and each rank reads from the memory-mapped checkpoint only
its own rows of each weight (:func:`ltx_mgpu.shards.local_rows`; ``StateDictLoader(rows=...)``).

Inference only (no gradients); the connectors (text) stay whole on every rank.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Mapping, Sequence

import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor

from ltx_mgpu.shards import local_tensor

__all__ = ["HEADROOM", "WeightPlan", "fit_error", "gathered_blocks", "held_bytes", "shard_transformer",
           "weight_plan"]

#: The share of a GPU's memory kept free for activations when checking that the weights fit.
HEADROOM = 0.15
_GIB = 1 << 30


def shard_transformer(model: torch.nn.Module, group, device: torch.device) -> None:
    """Shard ``model`` (an ltx-core ``LTXModel``, on the meta device or materialised) over the
    ranks of ``group`` in place (module doc). Every rank of ``group`` must call it.

    Raises:
        RuntimeError: torch.distributed is not initialised (a pool runs it).
    """
    mesh = DeviceMesh.from_group(group, device.type)
    blocks = list(model.transformer_blocks)
    for block in blocks:
        fully_shard(block, mesh=mesh, reshard_after_forward=True)
    fully_shard(model, mesh=mesh, reshard_after_forward=True)
    for block, following in zip(blocks, blocks[1:]):
        block.set_modules_to_forward_prefetch([following])


def held_bytes(module: torch.nn.Module) -> int:
    """Bytes of parameters and buffers this rank holds now (sharded ones: the local shard)."""
    return int(sum(local_tensor(t).numel() * local_tensor(t).element_size()
                   for t in [*module.parameters(), *module.buffers()]))


def gathered_blocks(model: torch.nn.Module) -> int:
    """How many of ``model``'s transformer blocks hold their whole weights at this moment: in
    place (FSDP swaps a unit's registered parameters for plain tensors while it is gathered) or
    being gathered (a prefetch in flight: FSDP2's param group holds an all-gather result; read
    with ``getattr`` defaults, so a torch without that attribute counts only the former)."""
    def whole(block) -> bool:
        if any(not isinstance(p, DTensor) for p in block.parameters(recurse=True)):
            return True
        state = block._get_fsdp_state() if hasattr(block, "_get_fsdp_state") else None
        group = getattr(state, "_fsdp_param_group", None)
        return getattr(group, "_all_gather_result", None) is not None

    return sum(1 for block in model.transformer_blocks if whole(block))


@dataclasses.dataclass(frozen=True)
class WeightPlan:
    """The bytes of an LTX-2 DiT's weights in its compute dtype, from the checkpoint's header.

    Attributes:
        blocks: the transformer blocks together; largest_block: the largest one.
        root: the transformer's other weights (embeddings, AdaLN, projections, norms).
        connectors: the two text connectors (whole on every rank).
        world: the ranks the weights would be sharded over.
    """

    blocks: int
    largest_block: int
    root: int
    connectors: int
    world: int

    def per_rank(self, weights: str) -> int:
        """Bytes one rank holds at its peak: the whole DiT when replicated; when sharded, its
        shard of everything, the root while a call runs, and two whole blocks (the one running
        and the one being prefetched)."""
        if weights == "replicated":
            return self.blocks + self.root + self.connectors
        shard = math.ceil((self.blocks + self.root) / self.world)
        return shard + self.root + 2 * self.largest_block + self.connectors


def weight_plan(shapes: Mapping[str, Sequence[int]], element_size: int, world: int,
                connectors: Sequence[str], stored: Callable[[str], int | None] | None = None) -> WeightPlan:
    """A :class:`WeightPlan` of the DiT keys ``shapes`` (as in ``CheckpointInfo.shapes``: no
    prefix, no fp8 scales) at ``element_size`` bytes per weight (the compute dtype's), except the
    keys for which ``stored(key)`` gives the bytes they are held in (an e4m3 weight's one byte per
    value, :mod:`ltx_mgpu.denoise.fp8`; a GGML-packed weight's blocks, :mod:`ltx_mgpu.quantized.packed`)."""
    blocks: dict[str, int] = {}
    root = conn = 0
    for key, shape in shapes.items():
        held = stored(key) if stored is not None else None
        n = math.prod(shape) * element_size if held is None else held
        if key.startswith(tuple(c + "." for c in connectors)):
            conn += n
        elif key.startswith("transformer_blocks."):
            block = key.split(".", 2)[1]
            blocks[block] = blocks.get(block, 0) + n
        else:
            root += n
    return WeightPlan(sum(blocks.values()), max(blocks.values(), default=0), root, conn, int(world))


def fit_error(plan: WeightPlan, weights: str, free: int, total: int, name: str,
              other_plan: WeightPlan | None = None) -> str | None:
    """None when ``weights`` fits ``free`` bytes of a GPU of ``total`` bytes (keeping
    :data:`HEADROOM` of it for activations); else the message: what it needs, what is free,
    whether the other choice (its bytes from ``other_plan``, default ``plan``) would fit, and
    what to do."""
    room = free - HEADROOM * total
    need = plan.per_rank(weights)
    if need <= room:
        return None
    other = "sharded" if weights == "replicated" else "replicated"
    other_need = (other_plan or plan).per_rank(other)
    head = (f"{name} needs {need / _GIB:.1f} GiB per GPU with weights '{weights}', and this GPU has "
            f"{free / _GIB:.1f} GiB free ({HEADROOM:.0%} of its {total / _GIB:.1f} GiB kept for activations)")
    if other_need <= room:
        return (f"{head}. With weights '{other}' each of the {plan.world} GPUs would hold about "
                f"{other_need / _GIB:.1f} GiB: choose weights '{other}' on the Model Loader (--transformer-weights)")
    return (f"{head}; with weights '{other}' it would need {other_need / _GIB:.1f} GiB: neither fits. Free "
            "memory (unload the text encoder), or use more GPUs with weights 'sharded'")
