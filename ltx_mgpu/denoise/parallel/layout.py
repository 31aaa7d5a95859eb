"""How one model call is split over the pool's ranks: :func:`call_layout`, a pure decision from the
plan's ``layout`` (:data:`ltx_mgpu.choices.SP_LAYOUTS`), the call's batch and the world size.

A call's batch holds the guidance passes ComfyUI batched into it (cond + uncond for CFG; three for
``DualCFGGuider`` or CFG with a perturbed pass; more with batched latents). The pool runs it in
one of two ways (:class:`~ltx_mgpu.denoise.parallel.ulysses.SequenceParallelTransformer` does it):

* **Ulysses over every rank**: each sample's video tokens split over all ``W`` ranks; each
  transformer block exchanges Q/K/V and the attention output with all-to-alls over ``W`` ranks.
* **The batch over groups of ranks**: ``G`` groups of ``W / G`` consecutive ranks, group ``i``
  running the next ``samples[i]`` samples (in batch order), Ulysses over its own ranks (the plain
  model when a group is one rank), then every rank all-gathers the groups' outputs.

The rules:

* ``ulysses``: always Ulysses over every rank.
* ``auto`` (the default): ``G = gcd(B, W)`` groups of ``B / G`` samples each when that is more
  than one group, else Ulysses. So a cond + uncond batch on an even pool runs on two halves;
  4 passes on 4 GPUs one per GPU (no all-to-all at all); 3 passes on 3 ranks one per rank (a
  model whose heads 3 divides; LTX-2's 32 heads take 1, 2, 4 or 8 GPUs); an odd batch on a
  power-of-two pool (3 passes on 2, 4 or 8 GPUs) runs Ulysses.
* ``cfg_ulysses``: on an even pool, any batch of 2 or more on two halves of the ranks, the first
  ``ceil(B / 2)`` samples on the first half (uneven for an odd batch); on an odd pool as ``auto``.

Why ``auto`` splits only evenly (the cost on paper, per rank and per transformer block; ``T`` video
tokens per sample, ``D`` the hidden width, ``B`` samples, ``W`` ranks, ``g = W / G`` ranks per
group; sources: the Ulysses exchange in :mod:`~ltx_mgpu.denoise.parallel.ulysses`):

* compute (linears ~ tokens, attention ~ tokens x sequence / heads-per-rank): Ulysses gives each
  rank ``B T / W`` tokens' worth; a split gives the busiest rank ``max(samples) T / g``. With
  ``G`` dividing ``B`` that is ``B T / W`` again: the same compute, the same weights read.
* all-to-all bytes per rank: Ulysses moves ``(W - 1) / W`` of its ``B T / W`` tokens' Q/K/V and
  outputs (six ``[tokens, D]`` tensors per block); a split moves ``(g - 1) / g`` of them, over
  ``g`` peers instead of ``W`` (fewer, nearer links), and nothing at all when ``g = 1``.
* the split's one extra exchange, the all-gather of the outputs, carries ``C_out`` (128) channels
  per token once per call, against Ulysses's six ``D``-wide (4096 for LTX-2) tensors in each of 48
  blocks: well under a thousandth of the Ulysses traffic.

So an even split is never slower than Ulysses and moves fewer bytes over fewer links. An uneven one
(``G`` not dividing ``B``) makes the busiest group's ranks compute ``max(samples) G / B`` times as
much (4/3 for 3 passes on two halves) to save at most the exchange: it pays only where the
exchange costs more than that extra compute (a third of it for 3 passes on two halves), which
NVLink's bandwidth rules out and only slow links (PCIe through the host) reach; ``cfg_ulysses``
asks for it. A leaf module (no torch).
"""

from __future__ import annotations

import dataclasses
import math

from ltx_mgpu.choices import SP_LAYOUTS, check_choice

__all__ = ["CallLayout", "call_layout"]


@dataclasses.dataclass(frozen=True)
class CallLayout:
    """How one call runs: ``samples[i]`` samples (in batch order) on the ``i``-th group of
    ``ranks_per_group`` consecutive ranks; one group: Ulysses over every rank."""

    samples: tuple[int, ...]
    ranks_per_group: int

    @property
    def groups(self) -> int:
        """How many groups the batch is split over (1: not split)."""
        return len(self.samples)

    def part(self, group: int) -> slice:
        """The samples of the batch group ``group`` runs."""
        start = sum(self.samples[:group])
        return slice(start, start + self.samples[group])


def call_layout(layout: str, batch: int, world: int) -> CallLayout:
    """The layout of a call of ``batch`` samples on ``world`` ranks under the plan's ``layout``
    (module doc for the rules and why).

    Raises:
        ValueError: a layout that is not one of :data:`ltx_mgpu.choices.SP_LAYOUTS`; a batch or
            world size below 1.
    """
    check_choice(layout, SP_LAYOUTS, "layout")
    if batch < 1 or world < 1:
        raise ValueError(f"a call needs a batch and a world size of at least 1, got {batch} and {world}")
    whole = CallLayout((batch,), world)
    if layout == "ulysses" or batch == 1 or world == 1:
        return whole
    if layout == "cfg_ulysses" and world % 2 == 0:
        return CallLayout((batch - batch // 2, batch // 2), world // 2)
    groups = math.gcd(batch, world)
    return whole if groups == 1 else CallLayout((batch // groups,) * groups, world // groups)
