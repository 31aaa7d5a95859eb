"""``compile_blocks`` (``ltx_mgpu.denoise.fp8``): identical ltx-core blocks share their compiled
graphs. A tiny AV transformer (fp32, video and audio, a CFG batch of 2) is compiled with 4 and
with 8 blocks (Dynamo's caches reset in between): the graphs Dynamo makes
(``counters["stats"]["unique_graphs"]``) and the frames it compiles do not grow with the
number of blocks, with no perturbations and with STG perturbations of blocks 0 and 1 (those
two blocks get their own graphs, all others share), and the compiled output equals the eager
one within float32 rounding."""

from __future__ import annotations

import pytest
import torch
from ltx_core.model.transformer.attention import AttentionFunction
from sp_harness import build_tiny_model, make_inputs, make_perturbations
from torch._dynamo.utils import counters

from ltx_mgpu.denoise.fp8 import compile_blocks


def compiled_run(layers: int, perturbations: str | None) -> tuple[dict, list, list]:
    """``(counts, eager, compiled)``: Dynamo's counts of one first compiled call of a fresh
    ``layers``-block model, and the (video, audio) outputs eager and compiled."""
    torch._dynamo.reset()
    counters.clear()
    model = build_tiny_model(num_layers=layers)
    video, audio = make_inputs(2, 2, 3, audio_tokens=5, batch=2)
    p = make_perturbations(perturbations, 2)
    with torch.no_grad():
        eager = model(video, audio, p)
        compile_blocks(model, dynamic=False)
        got = model(video, audio, p)
        again = model(video, audio, p)
    counts = {"graphs": counters["stats"]["unique_graphs"], "frames": counters["frames"]["ok"],
              "breaks": sum(counters["graph_break"].values())}
    # ltx-core's enum attention functions, replaced by the same call Dynamo traces (no break)
    functions = [m.attention_function for m in model.modules() if hasattr(m, "attention_function")]
    assert functions and not any(isinstance(f, AttentionFunction) for f in functions)
    assert counters["stats"]["unique_graphs"] == counts["graphs"]
    for a, b in zip(got, again, strict=True):
        assert torch.equal(a, b)
    return counts, list(eager), list(got)


@pytest.mark.parametrize("perturbations", [None, "mixed"])
def test_identical_blocks_compile_their_graphs_once_and_equal_eager(perturbations):
    few, eager, got = compiled_run(4, perturbations)
    many, eager8, got8 = compiled_run(8, perturbations)
    assert few == many, (few, many)
    assert few["breaks"] == 0, dict(counters["graph_break"])
    for e, g in zip(eager + eager8, got + got8, strict=True):
        assert g.dtype == e.dtype == torch.float32
        assert torch.allclose(g, e, rtol=1e-4, atol=1e-5), float((g - e).abs().max())
