"""What ``bench_text.py``'s ``compiled-default@layers`` encode runs, counted on the CPU, for any commit.

    git archive COMMIT ltx_mgpu benchmarks | tar -x -C /tmp/COMMIT
    python benchmarks/compiled_path_ops.py /tmp/COMMIT [--tokens 1024] [--layers 6]

Imports ``benchmarks/bench_text.py`` of the tree given (so the names it imports, at that commit),
builds a small Gemma 3 with 12B's layer pattern (``--layers``; 5 sliding + 1 full per 6) and the
random LTX-2.3 projection as the bench does, compiles its layers as the bench's compiled variant
does (``compile_text_tower(scope="layers", dynamic=False)``) with a backend that records each graph
and runs it as traced, and encodes ``batch x tokens`` ones (batches 1 and 8, as the bench). It
prints, per batch: the graphs compiled, the compiled-graph calls per encode (one per layer when no
graph break splits a layer) and the aten operators of one ``encode_tokens`` (torch.profiler,
top-level operators: the forward's, the features', the projection's and the host's); then Dynamo's
graph breaks and each graph's operator and input counts. Two trees' outputs side by side show
whether the compiled encode changed between them. The transformers it runs with is the
environment's (put another version first on ``PYTHONPATH`` to compare with the GPU machine's).
"""

from __future__ import annotations

import argparse
import collections
import sys
from pathlib import Path

import torch


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("tree", help="a checkout (or git archive) holding ltx_mgpu/ and benchmarks/")
    ap.add_argument("--tokens", type=int, default=1024)
    ap.add_argument("--layers", type=int, default=6)
    args = ap.parse_args(argv)
    sys.path.insert(0, str(Path(args.tree).resolve()))
    for name in [m for m in sys.modules if m == "benchmarks" or m.startswith(("benchmarks.", "ltx_mgpu"))]:
        del sys.modules[name]  # this script's own package must not shadow the tree's
    import transformers
    from torch._dynamo.utils import counters
    from torch.profiler import ProfilerActivity, profile

    import benchmarks.bench_text as bt  # the tree's

    graphs: list = []
    calls: list[int] = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        calls.append(0)
        i = len(calls) - 1

        def run(*a):
            calls[i] += 1
            return gm.forward(*a)
        return run

    torch.manual_seed(0)
    d = 64
    cfg = bt.gemma3_text_config(vocab=512, hidden=d, intermediate=128, layers=args.layers, heads=2, kv_heads=1,
                                head_dim=32)
    from transformers import Gemma3TextModel

    model = Gemma3TextModel._from_config(cfg, dtype=torch.float32, attn_implementation="sdpa").eval()
    ours = bt.copy_sharing_weights(model, own_config=True)
    bt.use_causal_skip(ours)
    tower = bt.GemmaTextTower(model=ours, tokenizer=None, config=ours.config, format="random", path=Path("x"))
    n = args.layers + 1
    weights = {"video_aggregate_embed.weight": torch.randn(96, d * n) * 0.02,
               "video_aggregate_embed.bias": torch.zeros(96),
               "audio_aggregate_embed.weight": torch.randn(48, d * n) * 0.02,
               "audio_aggregate_embed.bias": torch.zeros(48)}
    enc = bt.PromptEncoder(bt.compile_text_tower(tower, scope="layers", backend=backend, dynamic=False),
                           bt.Projection("2.3", d, n, weights))
    print(f"tree {args.tree}: torch {torch.__version__}, transformers {transformers.__version__}, "
          f"{args.layers} layers ({', '.join(cfg.layer_types)}), {args.tokens} tokens")
    for batch in (1, 8):
        ids = torch.randint(4, 512, (batch, args.tokens))
        ids[:, 0] = 2
        mask = torch.ones_like(ids)
        before = len(graphs)
        for _ in range(2):
            enc.encode_tokens(ids, mask)
        done = sum(calls)
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            enc.encode_tokens(ids, mask)
        ops = collections.Counter(
            e.name for e in prof.events()
            if e.name.startswith("aten::") and (e.cpu_parent is None or not e.cpu_parent.name.startswith("aten::")))
        print(f"{batch}x{args.tokens}: {len(graphs) - before} graph(s) compiled, {sum(calls) - done} compiled-graph "
              f"calls per encode, {sum(ops.values())} aten ops per encode_tokens")
        print("    " + ", ".join(f"{k.removeprefix('aten::')} {v}" for k, v in sorted(ops.items())))
    print(f"graph breaks: {dict(counters['graph_break'])}")
    for i, gm in enumerate(graphs):
        nodes = [x for x in gm.graph.nodes if x.op in ("call_function", "call_method")]
        inputs = [x for x in gm.graph.nodes if x.op == "placeholder"]
        print(f"graph {i}: {len(nodes)} ops, {len(inputs)} inputs")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
