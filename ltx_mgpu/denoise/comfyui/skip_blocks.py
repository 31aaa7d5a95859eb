"""Whole transformer blocks skipped for one call: ComfyUI's skip-layer guidance on LTX-2.

ComfyUI's skip-layer guidance nodes (``SkipLayerGuidanceDiT``, ``SkipLayerGuidanceDiTSimple``,
``SkipLayerGuidanceSD3``; ``comfy_extras/nodes_slg.py``, ``nodes_sd3.py``) make a model call
whose ``transformer_options["patches_replace"]["dit"][("double_block", i)]`` is a function that
returns its input; ComfyUI's LTX-2 model (``LTXAVModel._process_transformer_blocks``,
``comfy/ldm/lightricks/av_model.py``) then passes block ``i``'s video and audio hidden states
through unchanged. :func:`skipped_blocks` does the same to ltx-core's ``LTXModel`` for the
duration of a call, by giving those blocks (per instance) a ``forward`` that returns its inputs;
ltx-core's code is not changed. The module call and its hooks stay, so a sharded transformer
still gathers and frees the block (FSDP2) and every rank, skipping alike, stays in step with the
others' collectives.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator

import torch

__all__ = ["SkipBlocksError", "skipped_blocks"]


class SkipBlocksError(ValueError):
    """Block indices that are not the model's (names them and the model's block count)."""


def _passthrough(video, audio, perturbations=None):  # noqa: ARG001 - ltx-core's block signature
    return video, audio


@contextlib.contextmanager
def skipped_blocks(transformer: torch.nn.Module, indices: Iterable[int]) -> Iterator[None]:
    """Within the block, the blocks ``indices`` of ``transformer`` (an ltx-core ``LTXModel``:
    ``transformer_blocks``) return their ``(video, audio)`` inputs unchanged; on leaving, each
    gets its own ``forward`` back (a compiled one too: ``ltx_mgpu.denoise.fp8.compile_blocks``).

    Raises:
        SkipBlocksError: an index outside ``[0, len(transformer_blocks))``, before any block
            changes.
    """
    blocks = transformer.transformer_blocks
    wanted = sorted(set(int(i) for i in indices))
    bad = [i for i in wanted if not 0 <= i < len(blocks)]
    if bad:
        raise SkipBlocksError(f"blocks {bad} to skip are not among this model's {len(blocks)} transformer blocks")
    saved = {i: blocks[i].__dict__.get("forward") for i in wanted}
    for i in wanted:
        blocks[i].forward = _passthrough
    try:
        yield
    finally:
        for i, forward in saved.items():
            if forward is None:
                del blocks[i].__dict__["forward"]
            else:
                blocks[i].forward = forward
