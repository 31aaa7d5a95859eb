"""Text-encoding benchmark: our LTX-2 prompt encode vs plain transformers, Gemma 3 12B shape.

Run on a GPU (the numbers in the issues come from an H200)::

    python benchmarks/bench_text.py --out benchmarks/results/text.json

It builds a Gemma 3 12B-shaped ``Gemma3TextModel`` (48 layers, hidden 3840, 16/8 heads,
head_dim 256, vocab 262208; the google/gemma-3-12b-it text config) with random bf16
weights on the GPU and a random LTX-2.3 projection (188160 -> 4096 + 2048), then times,
with CUDA events (median of ``--runs`` after ``--warmup``; the variants are timed in turn, one
run each per round, so that a drift of the GPU's speed affects them alike), for 1x1024 and
8x1024 tokens:

* ``plain``: ``Gemma3TextModel(input_ids, attention_mask, output_hidden_states=True)`` —
  the transformers baseline (no feature extraction);
* ``ours-eager`` / ``compiled-<mode>``: :meth:`PromptEncoder.encode_tokens` — Gemma forward +
  LTX-2.3 feature extraction + the copy of the result to the host — without and with
  ``torch.compile`` of the text tower in each of ``--compile-modes``; the tower uses the
  loaders' attention implementation (``ltx_mgpu.text.gemma.forward.ATTENTION``);
* ``ours-eager-stock-sdpa``: the same encode on transformers' stock SDPA (what the causal-skip
  attention gives);
* ``compiled-<mode>+host-isfinite``: the compiled encode followed by ``torch.isfinite(row).all()``
  on each returned row, the finite check as fa442e1 ran it (on the host, after the encode); the
  encode's own check is now a reduction on the GPU (``PromptEncoder._project_rows``).

It checks that our hidden states equal the plain path's (bf16 tolerance) and prints the
peak memory of each variant. Then, for each batch, the breakdown of the ``ours-eager`` and
compiled encodes (``--no-breakdown`` skips it): the GPU's kernel time of one encode
(torch.profiler) against its time, the stages (Gemma forward, feature normalisation, projection,
projection with the rows to the host) and how long the host takes to enqueue the Gemma forward
(``launch_ms``: when it is close to the forward's time, the host's launch speed bounds it); and
Dynamo's graph breaks and graph count. Last, the host itself (``benchmarks.host``: CPU, load,
versions, and the host's part of an encode timed alone) and the cache-hit latency of a
1024-token entry next to the encode latency. The plain variant is all GPU work; ours also writes
the result on the host, so its ratio to plain depends on the host as well as on the GPU, which
``host`` and the breakdown record.
``--layers``, ``--shape tiny`` and ``--device cpu`` make a quick smoke run possible.
Every number is measured in this one run; only ratios within it are meaningful.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.host import host_info, host_probes  # noqa: E402
from benchmarks.timing import peak_bytes, time_interleaved, time_ms, warm_gpu, write_json  # noqa: E402
from ltx_mgpu.text.encoder.prompt import PromptEncoder  # noqa: E402
from ltx_mgpu.text.features import Projection  # noqa: E402
from ltx_mgpu.text.gemma.forward import (  # noqa: E402
    compile_text_tower,
    copy_sharing_weights,
    run_tower,
    use_causal_skip,
)
from ltx_mgpu.text.gemma.sources import gemma3_text_config  # noqa: E402
from ltx_mgpu.text.gemma.tower import GemmaTextTower  # noqa: E402

#: Gemma 3 12B's text dimensions (google/gemma-3-12b-it config.json; the defaults of
#: ``gemma3_text_config``), shared by the text, NF4, pool and profile benchmarks.
GEMMA_12B = dict(vocab=262208, hidden=3840, intermediate=15360, layers=48, heads=16, kv_heads=8, head_dim=256)
#: A small Gemma 3 for a CPU smoke run of this benchmark (``--shape tiny``).
TINY = dict(vocab=4096, hidden=64, intermediate=128, layers=4, heads=2, kv_heads=1, head_dim=32)


def gpu_busy_ms(device: torch.device, fn) -> float | None:
    """The GPU's kernel time (ms) of one call of ``fn``: the sum of every kernel's and copy's own
    time in a torch.profiler trace (None off CUDA)."""
    if device.type != "cuda":
        return None
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize(device)
    return sum(e.self_device_time_total for e in prof.key_averages()) / 1e3


def breakdown(device: torch.device, encoder: PromptEncoder, ids: torch.Tensor, mask: torch.Tensor,
              runs: int) -> dict:
    """Where one ``encoder.encode_tokens(ids, mask)`` spends its time (median ms of ``runs``):
    ``encode`` and its GPU kernel time ``gpu_busy``; the stages ``forward`` (``run_tower``),
    ``features`` (normalisation), ``projection``, ``rows`` (projection pipelined with the rows to
    the host, and their finite check); ``launch``: the host's time to enqueue the forward (wall
    time until ``run_tower`` returns, before any synchronisation)."""
    lengths = [int(n) for n in mask.sum(dim=1).tolist()]
    with torch.inference_mode():
        def launch():
            t0 = time.perf_counter()
            run_tower(encoder.tower, ids, mask)
            ms = (time.perf_counter() - t0) * 1e3
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            return ms

        launch()
        launch_ms = statistics.median(launch() for _ in range(runs))
        forward = time_ms(device, lambda: run_tower(encoder.tower, ids, mask), 1, runs)[0]
        st = run_tower(encoder.tower, ids, mask)
        features = time_ms(device, lambda st=st: encoder.projection.normalised(st.hidden_states, st.attention_mask),
                           1, runs)[0]
        feats = encoder.projection.normalised(st.hidden_states, st.attention_mask)
        del st
        projection = time_ms(device, lambda f=feats: encoder.projection.project(f), 1, runs)[0]
        rows = time_ms(device, lambda f=feats: encoder._project_rows(f, lengths), 1, runs)[0]
        del feats
    encode = time_ms(device, lambda: encoder.encode_tokens(ids, mask), 1, runs)[0]
    busy = gpu_busy_ms(device, lambda: encoder.encode_tokens(ids, mask))
    return {"encode_ms": encode, "gpu_busy_ms": busy, "launch_ms": launch_ms, "forward_ms": forward,
            "features_ms": features, "projection_ms": projection, "rows_ms": rows}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--shape", choices=("12b", "tiny"), default="12b",
                    help="12b: Gemma 3 12B's dimensions (default); tiny: a small Gemma for a smoke run")
    ap.add_argument("--layers", type=int, default=None, help="decoder layers (default: the shape's)")
    ap.add_argument("--tokens", type=int, default=1024)
    ap.add_argument("--batches", default="1,8")
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--runs", type=int, default=7)
    ap.add_argument("--no-compile", action="store_true")
    ap.add_argument("--compile-modes", default="default",
                    help="comma-separated torch.compile variants MODE[@SCOPE] to time, e.g. "
                         "default@model,reduce-overhead@model,default@layers (scope: see compile_text_tower)")
    ap.add_argument("--no-breakdown", action="store_true", help="skip the per-stage breakdown of our encodes")
    ap.add_argument("--out", default=None, help="write raw results as JSON here")
    args = ap.parse_args(argv)

    device = torch.device(args.device)
    torch.manual_seed(0)
    shape = GEMMA_12B if args.shape == "12b" else TINY
    dims = dict(shape, layers=args.layers or shape["layers"])
    config = gemma3_text_config(**dims)
    from transformers import Gemma3TextModel

    t0 = time.perf_counter()
    with torch.device(device):
        model = Gemma3TextModel._from_config(config, dtype=torch.bfloat16, attn_implementation="sdpa").eval()
    build_s = time.perf_counter() - t0
    n_states = dims["layers"] + 1
    d = dims["hidden"]
    gen = torch.Generator(device="cpu").manual_seed(1)
    weights = {
        "video_aggregate_embed.weight": (torch.randn(4096, d * n_states, generator=gen) * 0.002).to(torch.bfloat16),
        "video_aggregate_embed.bias": torch.zeros(4096, dtype=torch.bfloat16),
        "audio_aggregate_embed.weight": (torch.randn(2048, d * n_states, generator=gen) * 0.002).to(torch.bfloat16),
        "audio_aggregate_embed.bias": torch.zeros(2048, dtype=torch.bfloat16),
    }
    proj_dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    projection = Projection("2.3", d, n_states, {k: v.to(device, proj_dtype) for k, v in weights.items()})
    # ours: the same weights with the loaders' attention implementation (own config, so the plain
    # baseline keeps transformers' stock SDPA); "ours-stock-sdpa" isolates what that choice gives
    ours_model = copy_sharing_weights(model, own_config=True)
    use_causal_skip(ours_model)
    tower = GemmaTextTower(model=ours_model, tokenizer=None, config=ours_model.config, format="random",
                           path=Path("random-12b"))
    # eager forwards (CUDA graphs, ltx_mgpu.text.gemma.graphs, are timed by bench_nf4's head to head)
    encoder = PromptEncoder(tower, projection, cuda_graphs=False)
    stock = PromptEncoder(GemmaTextTower(model=model, tokenizer=None, config=config, format="random",
                                         path=Path("random-12b")), projection, cuda_graphs=False)
    results = {"device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
               "torch": torch.__version__, "layers": dims["layers"], "tokens": args.tokens,
               "model_build_seconds": build_s, "variants": {}}
    import transformers

    results["transformers"] = transformers.__version__
    rows = []
    warm_gpu(device)
    compiled: dict[str, PromptEncoder] = {}
    failed: dict[str, str] = {}
    for batch in [int(b) for b in args.batches.split(",")]:
        ids = torch.randint(4, dims["vocab"], (batch, args.tokens), generator=gen)
        ids[:, 0] = 2
        mask = torch.ones_like(ids)
        ids_d, mask_d = ids.to(device), mask.to(device)

        def plain():
            with torch.inference_mode():
                return model(input_ids=ids_d, attention_mask=mask_d, output_hidden_states=True, use_cache=False)

        def ours():
            return encoder.encode_tokens(ids, mask)

        variants = [("plain", plain), ("ours-eager", ours),
                    ("ours-eager-stock-sdpa", lambda: stock.encode_tokens(ids, mask))]
        # parity: our hidden states equal plain transformers'
        ref = plain().hidden_states
        ours_out = ours()
        with torch.inference_mode():
            ref_feat = projection(ref, mask_d).float().cpu()
        err = max((ours_out[i].tensor - ref_feat[i]).abs().max().item() for i in range(batch))
        scale = ref_feat.abs().max().item()
        del ref
        c_err = {}
        if not args.no_compile:
            for mode in args.compile_modes.split(","):
                if mode in failed:
                    continue
                if mode not in compiled:
                    t0 = time.perf_counter()
                    m, _, scope = mode.partition("@")
                    try:
                        enc = PromptEncoder(compile_text_tower(tower, scope=scope or "model", mode=m,
                                                               dynamic=False), projection)
                        enc.encode_tokens(ids, mask)
                        enc.encode_tokens(ids, mask)
                    except Exception as exc:  # one failing mode must not cost the other numbers
                        failed[mode] = results[f"compile_error/{mode}"] = f"{type(exc).__name__}: {str(exc)[:300]}"
                        print(f"compiled-{mode}: FAILED {failed[mode]}", flush=True)
                        continue
                    compiled[mode] = enc
                    results[f"compile_seconds/{mode}"] = time.perf_counter() - t0
                enc = compiled[mode]
                c_out = enc.encode_tokens(ids, mask)
                c_err[mode] = max((c_out[i].tensor - ref_feat[i]).abs().max().item() for i in range(batch))
                variants.append((f"compiled-{mode}", (lambda e: lambda: e.encode_tokens(ids, mask))(enc)))
                variants.append((f"compiled-{mode}+host-isfinite", (lambda e: lambda: [
                    bool(torch.isfinite(r.tensor).all()) for r in e.encode_tokens(ids, mask)])(enc)))
        # timed in turn (interleaved rounds), so a drift of the GPU's speed hits every variant alike
        timed = time_interleaved(device, dict(variants), args.warmup, args.runs)
        for name, fn in variants:
            med, times = timed[name]
            peak = peak_bytes(device, fn)
            peak = None if peak is None else peak / 1e9
            results["variants"][f"{name}/{batch}x{args.tokens}"] = {"median_ms": med, "times_ms": times,
                                                                     "peak_gb": peak}
            rows.append((name, batch, med, peak))
            print(f"{name} {batch}x{args.tokens}: {med:.2f} ms (peak {peak} GB)", flush=True)
            if args.out:
                write_json(args.out, results)
        results["variants"][f"parity/{batch}x{args.tokens}"] = {
            "eager_max_abs_err": err, "compiled_max_abs_err": c_err, "feature_max_abs": scale}
        if not args.no_breakdown:
            for name, enc in [("ours-eager", encoder)] + [(f"compiled-{m}", e) for m, e in compiled.items()]:
                parts = breakdown(device, enc, ids, mask, args.runs)
                results.setdefault("breakdown", {})[f"{name}/{batch}x{args.tokens}"] = parts
                print(f"{name} {batch}x{args.tokens} breakdown: " + ", ".join(
                    f"{k.removesuffix('_ms')} {v:.2f}" for k, v in parts.items() if v is not None) + " ms",
                    flush=True)
            plain_busy = gpu_busy_ms(device, plain)
            results.setdefault("breakdown", {})[f"plain/{batch}x{args.tokens}"] = {"gpu_busy_ms": plain_busy}
            if plain_busy is not None:
                print(f"plain {batch}x{args.tokens}: GPU kernel time {plain_busy:.2f} ms", flush=True)
            if args.out:
                write_json(args.out, results)

    # Dynamo's record of the process (the compiled layers and the features function): a graph break
    # inside a layer splits each of the 48 layers' graphs, and adds their launches to the host's work
    from torch._dynamo.utils import counters

    results["dynamo"] = {"graph_breaks": dict(counters["graph_break"]),
                         "unique_graphs": counters["stats"]["unique_graphs"]}
    print(f"dynamo: {results['dynamo']}", flush=True)
    results["host"] = host_info(device)
    results["host_probes"] = host_probes(device, args.tokens, projection.out_features,
                                         tuple(int(b) for b in args.batches.split(",")))
    print(f"host: {results['host']}", flush=True)
    print("host probes: " + ", ".join(f"{k} {v:.3f}" for k, v in results["host_probes"].items()), flush=True)

    # cache hit vs encode, one 1024-token LTX-2.3 entry (CPU)
    from ltx_mgpu.text.cache.keys import CacheKeyParts
    from ltx_mgpu.text.cache.store import EmbeddingCache
    from ltx_mgpu.text.features import PromptEmbedding

    emb = PromptEmbedding(torch.randn(args.tokens, 6144), "2.3")
    parts = CacheKeyParts("g" * 64, "p" * 64, "bf16", 1024, "bfloat16")
    with tempfile.TemporaryDirectory() as tmp:
        cache = EmbeddingCache(tmp)
        cache.put("bench prompt", parts, emb)
        hit_ms = statistics.median(
            [(lambda t0: (cache.get("bench prompt", parts), (time.perf_counter() - t0) * 1e3)[1])(time.perf_counter())
             for _ in range(20)])
    results["cache_hit_ms_1024_tokens"] = hit_ms

    base = {b: m for (n, b, m, _) in rows if n == "plain"}
    print(f"\n{'variant':<40}{'batch':>6}{'median ms':>12}{'vs plain':>10}{'peak GB':>10}")
    for name, batch, med, peak in rows:
        print(f"{name:<40}{batch:>6}{med:>12.2f}{med / base[batch]:>10.2f}{(peak or float('nan')):>10.2f}")
    enc1 = min(m for (n, b, m, _) in rows if b == 1 and n != "plain")
    print(f"cache hit (1x{args.tokens}, CPU): {hit_ms:.2f} ms  vs encode {enc1:.2f} ms  ({enc1 / hit_ms:.0f}x)")
    for k, v in results["variants"].items():
        if k.startswith("parity"):
            print(f"{k}: {v}")
    if args.out:
        write_json(args.out, results)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
