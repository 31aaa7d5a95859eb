"""Token buckets with compiled blocks (``ltx_mgpu.denoise.parallel.buckets``): two nearby token
counts of one bucket run one compiled graph (Dynamo's counters: one graph for all the blocks,
the SP attention wrappers inside it as operators, no graph break; no new graph for the second
count, one compile announced), a count in the next bucket compiles once more, and every call equals the eager,
unpadded model to float32 rounding. A tiny LTX-2 transformer compiled by the product's
``compile_blocks`` (Inductor on CPU), world size 1; the padding on ranks is
``test_sequence_parallel_ranks.py``, the rule ``tests/unit/test_buckets.py``."""

from __future__ import annotations

import torch
from sp_harness import build_tiny_model, run_case

from ltx_mgpu.denoise.compiling import CompileWatch, compile_message
from ltx_mgpu.denoise.fp8 import compile_blocks
from ltx_mgpu.denoise.parallel.buckets import TokenBuckets
from ltx_mgpu.denoise.parallel.ulysses import SequenceParallelTransformer

TOL = 1e-4  # Inductor's fused float32 kernels against eager float32


def test_nearby_sizes_share_one_compiled_graph_and_equal_the_eager_model():
    from torch._dynamo.utils import counters  # noqa: PLC0415 - torch's compiler stack, only for compile

    eager = build_tiny_model()
    compiled = build_tiny_model()
    compile_blocks(compiled, dynamic=False)
    watch = CompileWatch(compiled, None, bucketed=True)
    said = []
    watch.on_compile = lambda text, cached: said.append(text)
    sp = SequenceParallelTransformer(compiled, None, max_tokens=4096, buckets=TokenBuckets(32, 16))
    graphs, breaks = [counters["stats"]["unique_graphs"]], sum(counters["graph_break"].values())
    # 45 and 42 tokens share the bucket of 48; 60 is in the bucket of 64
    for frames, height, width in ((3, 3, 5), (2, 3, 7), (3, 4, 5)):
        case = dict(frames=frames, height=height, width=width, audio_tokens=7)
        with torch.no_grad():
            got_v, got_a = run_case(sp, case)
            ref_v, ref_a = run_case(eager, case)
        graphs.append(counters["stats"]["unique_graphs"])
        assert got_v.shape == ref_v.shape and (got_v - ref_v).abs().max().item() <= TOL, (frames, height, width)
        assert (got_a - ref_a).abs().max().item() <= TOL, (frames, height, width)
    # the wrappers are one operator each: one graph per bucket for all blocks, no graph break
    assert sum(counters["graph_break"].values()) == breaks, dict(counters["graph_break"])
    assert graphs[1] == graphs[0] + 1  # 48 tokens' bucket: one graph
    assert graphs[2] == graphs[1]  # 42 tokens: the graph 45 tokens compiled, no new one
    assert graphs[3] == graphs[2] + 1  # the next bucket compiles its one graph
    assert said == [compile_message(48, False, bucketed=True), compile_message(64, False, bucketed=True)]
    assert said[0] == ("compiling the transformer blocks for up to 48 video tokens, first time at this size: "
                       "up to a minute")
