"""NF4 Gemma 3 benchmark: quantize, artifact size, resident memory, encode latency vs our bf16.

Run on a GPU (the issue's numbers come from an H200)::

    python benchmarks/bench_nf4.py --out benchmarks/results/nf4.json

Smoke run on CPU (minutes, a few GB of RAM)::

    python benchmarks/bench_nf4.py --device cpu --layers 1 --tokens 64 --batches 1 --warmup 0 --runs 1

What it does, in one process (every ratio is within this run):

1. builds a Gemma 3 12B-shaped ``Gemma3TextModel`` (48 layers, hidden 3840, 16/8 heads, head_dim
   256, vocab 262208; ``gemma3_text_config``) with random bf16 weights on the device, a random
   LTX-2.3 projection (188160 -> 4096 + 2048) and the tiny Gemma's tokenizer, and times **our
   bf16 encode** (``PromptEncoder.encode_tokens``: Gemma forward + LTX-2.3 feature extraction +
   copy to host) for each ``--batches`` x ``--tokens``, with CUDA events (median of ``--runs``
   after ``--warmup``), and its peak memory;
2. **quantizes** it to an NF4 artifact under ``--tmp``. ``--quantize-from memory`` (default):
   the in-memory GPU model, tensor by tensor (``quantize_nf4_model``; the time includes
   moving the NF4 tensors to the host and writing the shards), and separately the time of
   ``quantize_4bit`` alone over all 336 weights. ``--quantize-from disk``: the bf16 model is
   first saved as a snapshot under ``--tmp`` (23.5 GB written), then ``python -m ltx_mgpu
   quantize-nf4`` runs in a subprocess, which reports its own time and peak RSS (streaming);
3. frees the bf16 model, **loads the artifact** (``load_nf4``: time, resident device memory);
4. times each **variant** of the NF4 forward (``--variants``), with the same encode:

   * ``bnb``: bitsandbytes ``Linear4bit`` as loaded (per-Linear dequant + cuBLAS on H200);
   * ``layer-<m>``: idea (a), each decoder layer's 7 weights dequantized once per forward into
     one reused bf16 buffer, then ``F.linear``; ``<m>`` is the dequant kernel: ``bnb``
     (bitsandbytes' CUDA kernel), ``lut`` (idea (b), the byte-LUT, eager PyTorch) or
     ``lut-compiled`` (the byte-LUT through ``torch.compile``, one compiled call per layer);
     ``-prefetch`` dequantizes the next layer on a side stream into a second buffer;
   * ``linear-<m>[-prefetch]``: the same per projection: each weight dequantized just before its
     GEMM into one reused buffer sized for the largest weight (118 MB; two with prefetch);

   and, per variant, the peak memory of our encode (total, and without the projection's
   weights, which are not Gemma's) and of a plain forward (``model(..., output_hidden_states=True)``,
   the "plain transformers + bitsandbytes" measure of the issue), the largest difference of its
   features from the ``bnb`` variant's, and the cosine of its features to the bf16 ones;
4b. times our bf16 encode and the loader's NF4 encode in turn (interleaved), as the encoders
   run by default (batches of up to 1024 tokens replayed as CUDA graphs,
   ``ltx_mgpu.text.gemma.graphs``) and without CUDA graphs (the same towers);
5. times the dequantization alone of one layer's 7 weights with each kernel (GB/s counts the
   packed bytes + scales read and the bf16 written).

Memory is printed in GB (1e9 B) and GiB (2^30 B). Goals (issue 3): peak <= 8.2 GB at 1x1024,
time <= 1.2x our bf16 at 1x1024 and <= 1.05x at 8x1024.
"""

from __future__ import annotations

import argparse
import gc
import math
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.bench_text import GEMMA_12B  # noqa: E402
from benchmarks.nf4_probes import LOADER, dequant_one_layer, print_summary, with_gpu_embeddings  # noqa: E402
from benchmarks.timing import peak_bytes as _peak  # noqa: E402
from benchmarks.timing import sync as _sync  # noqa: E402
from benchmarks.timing import time_interleaved, warm_gpu, write_json  # noqa: E402
from benchmarks.timing import time_ms as _time  # noqa: E402
from ltx_mgpu.text.encoder.prompt import PromptEncoder  # noqa: E402
from ltx_mgpu.text.features import Projection  # noqa: E402
from ltx_mgpu.text.gemma.sources import gemma3_text_config  # noqa: E402
from ltx_mgpu.text.gemma.tower import GemmaTextTower  # noqa: E402

#: variant name -> (FastDequant method, scope, prefetch), None for bitsandbytes' Linear4bit; the
#: ``lut`` methods are ``benchmarks/nf4_lut.py``'s byte LUT, plugged in as FastDequant's ``fill``.
VARIANTS = {
    "bnb": None,
    "layer-bnb": ("bnb", "layer", False),
    "layer-triton": ("triton", "layer", False),
    "layer-triton-prefetch": ("triton", "layer", True),
    "layer-lut": ("lut", "layer", False),
    "layer-lut-compiled": ("lut_compiled", "layer", False),
    "layer-bnb-prefetch": ("bnb", "layer", True),
    "layer-lut-compiled-prefetch": ("lut_compiled", "layer", True),
    "linear-bnb": ("bnb", "linear", False),
    "linear-lut-compiled": ("lut_compiled", "linear", False),
    "linear-bnb-prefetch": ("bnb", "linear", True),
    "linear-lut-compiled-prefetch": ("lut_compiled", "linear", True),
}


def _allocated(device):
    if device.type != "cuda":
        return None
    _sync(device)
    return torch.cuda.memory_allocated(device)


def _gb(n):
    return "n/a" if n is None else f"{n / 1e9:.2f} GB / {n / 2**30:.2f} GiB"


def _token_cosine(a, b):
    return torch.nn.functional.cosine_similarity(a.float().reshape(-1, a.shape[-1]), b.float().reshape(-1, b.shape[-1]),
                                                 dim=-1).mean().item()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--layers", type=int, default=GEMMA_12B["layers"])
    ap.add_argument("--tokens", type=int, default=1024)
    ap.add_argument("--batches", default="1,8")
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--runs", type=int, default=7)
    ap.add_argument("--variants", default=",".join([*VARIANTS, LOADER]),
                    help=f"comma-separated, from {[*VARIANTS, LOADER]} ({LOADER} runs last)")
    ap.add_argument("--quantize-from", choices=["memory", "disk"], default="memory")
    ap.add_argument("--tmp", default=tempfile.gettempdir(), help="where the artifact (and snapshot) go")
    ap.add_argument("--keep", action="store_true", help="keep the artifact directory")
    ap.add_argument("--dequant-sweep", action="store_true",
                    help="also time the Triton layer dequant for each blocks-per-program x warps setting")
    ap.add_argument("--sm-carveouts", default="",
                    help="comma-separated SM counts: the head to head also times the loader's NF4 encode with "
                         "cuBLAS leaving that many SMs to the side stream's dequant (torch's experimental carveout)")
    ap.add_argument("--gpu-embeddings", action="store_true",
                    help="the head to head also times the loader's NF4 tower with its embedding table on the GPU")
    ap.add_argument("--profile", action="store_true",
                    help="after the head to head, profile one encode of each (GPU busy time, host operators)")
    ap.add_argument("--out", default=None, help="write raw results as JSON here (updated as it goes)")
    args = ap.parse_args(argv)
    carveouts = [int(k) for k in args.sm_carveouts.split(",") if k]
    variants = [v for v in args.variants.split(",") if v]
    unknown = [v for v in variants if v not in VARIANTS and v != LOADER]
    if unknown:
        ap.error(f"unknown variant(s) {unknown}; choose from {[*VARIANTS, LOADER]}")
    variants = [v for v in variants if v != LOADER] + [LOADER] * (LOADER in variants)

    import bitsandbytes
    import transformers
    from transformers import Gemma3TextModel

    from benchmarks.nf4_lut import lut_fill
    from ltx_mgpu.assets import tiny_gemma_dir
    from ltx_mgpu.text.encoder.loading import load_gemma_text_tower
    from ltx_mgpu.text.gemma.forward import use_causal_skip
    from ltx_mgpu.text.nf4.artifact import artifact_bytes, read_manifest
    from ltx_mgpu.text.nf4.dequant import FastDequant
    from ltx_mgpu.text.nf4.load import load_nf4
    from ltx_mgpu.text.nf4.quantize import quantize_nf4_model

    device = torch.device(args.device)
    work = Path(tempfile.mkdtemp(prefix="bench-nf4-", dir=args.tmp))
    results = {"device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
               "torch": torch.__version__, "transformers": transformers.__version__,
               "bitsandbytes": bitsandbytes.__version__, "layers": args.layers, "tokens": args.tokens,
               "bf16": {}, "nf4": {}, "dequant_ms": {}}

    def save():
        if args.out:
            write_json(args.out, results)

    try:
        # ---- 1. bf16 model, projection, inputs
        torch.manual_seed(0)
        dims = dict(GEMMA_12B, layers=args.layers)
        config = gemma3_text_config(**dims)
        t0 = time.perf_counter()
        with torch.device(device):
            model = Gemma3TextModel._from_config(config, dtype=torch.bfloat16, attn_implementation="sdpa").eval()
        use_causal_skip(model)  # the loaders' attention implementation, for bf16 and every NF4 variant
        results["bf16_build_seconds"] = time.perf_counter() - t0
        n_states, d = dims["layers"] + 1, dims["hidden"]
        gen = torch.Generator(device="cpu").manual_seed(1)
        proj_w = {
            "video_aggregate_embed.weight": torch.randn(4096, d * n_states, generator=gen) * 0.002,
            "video_aggregate_embed.bias": torch.zeros(4096),
            "audio_aggregate_embed.weight": torch.randn(2048, d * n_states, generator=gen) * 0.002,
            "audio_aggregate_embed.bias": torch.zeros(2048),
        }
        proj_dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
        projection = Projection("2.3", d, n_states, {k: v.to(device, proj_dtype) for k, v in proj_w.items()})
        del proj_w
        proj_bytes = sum(p.numel() * p.element_size() for p in projection.parameters())
        tok_dir = tiny_gemma_dir(work / "assets")
        batches = [int(b) for b in args.batches.split(",")]
        inputs = {}
        for b in batches:
            ids = torch.randint(4, dims["vocab"], (b, args.tokens), generator=gen)
            ids[:, 0] = 2
            inputs[b] = (ids, torch.ones_like(ids))

        tower = GemmaTextTower(model, None, config, "random", Path("random-12b"))
        encoder = PromptEncoder(tower, projection)
        resident_bf16 = sum(p.numel() * p.element_size() for p in model.parameters())
        results["bf16"]["resident_bytes"] = resident_bf16
        ref_features = {}
        warm_gpu(device)
        for b in batches:
            ids, mask = inputs[b]
            med, times = _time(device, lambda: encoder.encode_tokens(ids, mask), args.warmup, args.runs)
            peak = _peak(device, lambda: encoder.encode_tokens(ids, mask))
            results["bf16"][f"{b}x{args.tokens}"] = {"median_ms": med, "times_ms": times, "peak_bytes": peak}
            print(f"bf16 {b}x{args.tokens}: {med:.2f} ms, peak {_gb(peak)}", flush=True)
            if b == batches[0]:
                ref_features[b] = torch.stack([e.tensor for e in encoder.encode_tokens(ids, mask)])
        save()

        # ---- 2. quantize
        artifact = work / "gemma3-12b-shaped-nf4"
        if args.quantize_from == "memory":
            import bitsandbytes.functional as bf

            _sync(device)
            t0 = time.perf_counter()
            quantize_nf4_model(model, artifact, tok_dir, device, name="random-12b")
            _sync(device)
            results["quantize_and_write_seconds"] = time.perf_counter() - t0
            q_only = 0.0
            for m_name, p in model.named_parameters():
                if p.ndim == 2 and "layers." in m_name:
                    _sync(device)
                    t0 = time.perf_counter()
                    bf.quantize_4bit(p.data, blocksize=64, compress_statistics=True, quant_type="nf4")
                    _sync(device)
                    q_only += time.perf_counter() - t0
            results["quantize_only_seconds"] = q_only
            print(f"quantize (from the in-memory bf16 model on {device.type}) + write: "
                  f"{results['quantize_and_write_seconds']:.1f} s; quantize_4bit alone: {q_only:.2f} s", flush=True)
        else:
            snap = work / "bf16-snapshot"
            model.save_pretrained(snap, max_shard_size="5GB")
            for f in tok_dir.glob("tokenizer*"):
                shutil.copy(f, snap)
            cmd = [sys.executable, "-m", "ltx_mgpu", "quantize-nf4", str(snap), str(artifact), "--device", str(device)]
            t0 = time.perf_counter()
            proc = subprocess.run(cmd, capture_output=True, text=True,
                                  env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])})
            results["quantize_from_disk_seconds"] = time.perf_counter() - t0
            results["quantize_from_disk_output"] = proc.stdout
            print(proc.stdout + proc.stderr[-2000:], flush=True)
            shutil.rmtree(snap, ignore_errors=True)
            if proc.returncode:
                raise RuntimeError("quantize-nf4 failed")
        size = artifact_bytes(artifact)
        expected = 0.0
        for p in read_manifest(artifact)["parameters"].values():
            n = math.prod(p["shape"])
            expected += n / 2 + n / 64 + 4 * math.ceil(n / 64 / 256) if p["dtype"] == "nf4" else 2 * n
        results.update(artifact_bytes=size, artifact_expected_bytes=expected)
        print(f"artifact: {_gb(size)} (from parameter counts: {_gb(expected)}, {size / expected - 1:+.2%})", flush=True)
        save()

        # ---- 3. free bf16, load NF4
        del encoder, tower, model
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
        before = _allocated(device)
        t0 = time.perf_counter()
        nf4 = load_nf4(artifact, device)
        use_causal_skip(nf4.model)
        _sync(device)
        results["nf4"]["load_seconds"] = time.perf_counter() - t0
        resident = None if before is None else _allocated(device) - before
        results["nf4"]["resident_bytes"] = resident
        print(f"load_nf4: {results['nf4']['load_seconds']:.1f} s, resident {_gb(resident)} "
              f"(bf16 was {_gb(resident_bf16)})", flush=True)
        # the variants swap the model's Linear modules under one encoder: eager, since CUDA graphs
        # bake in the kernels and weight addresses of the model they captured
        encoder = PromptEncoder(nf4, projection, cuda_graphs=False)

        # ---- 4. variants
        base_features = None
        for name in variants:
            spec = VARIANTS.get(name)
            fast = None
            row = results["nf4"][name] = {}
            try:
                if name == LOADER:  # a fresh tower as load_gemma_text_tower makes it; the others go first
                    del encoder, nf4
                    gc.collect()
                    if device.type == "cuda":
                        torch.cuda.empty_cache()
                    before = _allocated(device)
                    t0 = time.perf_counter()
                    nf4 = load_gemma_text_tower(artifact, device=device)
                    _sync(device)
                    row["load_seconds"] = time.perf_counter() - t0
                    row["resident_bytes"] = None if before is None else _allocated(device) - before
                    print(f"{LOADER}: load {row['load_seconds']:.1f} s, resident {_gb(row['resident_bytes'])}",
                          flush=True)
                    encoder = PromptEncoder(nf4, projection)
                elif spec is not None:
                    method, scope, prefetch = spec
                    lut = {"lut": lut_fill(compiled=False), "lut_compiled": lut_fill(compiled=True)}.get(method)
                    fast = FastDequant(nf4.model, "bnb" if lut else method, scope, prefetch, fill=lut)
                ids, mask = inputs[batches[0]]
                t0 = time.perf_counter()
                feats = torch.stack([e.tensor for e in encoder.encode_tokens(ids, mask)])
                _sync(device)
                row["first_call_seconds"] = time.perf_counter() - t0  # includes torch.compile
                if base_features is None and name == "bnb":
                    base_features = feats
                row["max_abs_diff_vs_bnb"] = (None if base_features is None
                                              else (feats - base_features).abs().max().item())
                row["feature_cosine_vs_bf16"] = _token_cosine(feats, ref_features[batches[0]])
                for b in batches:
                    ids, mask = inputs[b]
                    med, times = _time(device, lambda: encoder.encode_tokens(ids, mask), args.warmup, args.runs)
                    peak = _peak(device, lambda: encoder.encode_tokens(ids, mask))

                    def plain():
                        with torch.inference_mode():
                            nf4.model(input_ids=ids.to(nf4.model.get_input_embeddings().weight.device),
                                      attention_mask=mask.to(device), output_hidden_states=True, use_cache=False)

                    plain_peak = _peak(device, plain)
                    bf16_ms = results["bf16"][f"{b}x{args.tokens}"]["median_ms"]
                    row[f"{b}x{args.tokens}"] = {
                        "median_ms": med, "times_ms": times, "ratio_vs_bf16": med / bf16_ms, "peak_bytes": peak,
                        "peak_without_projection_bytes": None if peak is None else peak - proj_bytes,
                        "plain_forward_peak_bytes": plain_peak}
                    print(f"nf4 {name} {b}x{args.tokens}: {med:.2f} ms = {med / bf16_ms:.3f}x bf16; encode peak "
                          f"{_gb(peak)} (without the projection's weights "
                          f"{_gb(None if peak is None else peak - proj_bytes)}); "
                          f"plain forward peak {_gb(plain_peak)}", flush=True)
            except Exception as exc:  # one failing variant (e.g. no Triton) must not stop the others
                row["error"] = repr(exc)
                print(f"nf4 {name}: FAILED {exc!r}", flush=True)
            finally:
                if fast is not None:
                    fast.remove()
                gc.collect()
                if device.type == "cuda":
                    torch.cuda.empty_cache()
            save()

        # ---- 4b. head to head: bf16 (rebuilt) and the loader's NF4 timed in turn, both resident
        if LOADER in variants and "error" not in results["nf4"][LOADER]:
            torch.manual_seed(0)
            with torch.device(device):
                bf = Gemma3TextModel._from_config(config, dtype=torch.bfloat16, attn_implementation="sdpa").eval()
            use_causal_skip(bf)
            bf_tower = GemmaTextTower(bf, None, config, "random", Path("random-12b"))
            bf_encoder = PromptEncoder(bf_tower, projection)
            bf_eager = PromptEncoder(bf_tower, projection, cuda_graphs=False)
            nf4_eager = PromptEncoder(nf4, projection, cuda_graphs=False)
            results["head_to_head"] = {}
            def carved(k, ids, mask):
                def run():
                    torch._C._set_sm_carveout_experimental(k)
                    try:  # eager: a graph replays the kernels it captured, without the carve-out
                        return nf4_eager.encode_tokens(ids, mask)
                    finally:
                        torch._C._set_sm_carveout_experimental(None)
                return run

            for b in batches:
                ids, mask = inputs[b]
                fns = {"bf16": lambda: bf_encoder.encode_tokens(ids, mask),
                       LOADER: lambda: encoder.encode_tokens(ids, mask)}
                fns.update({f"{LOADER}-carveout{k}": carved(k, ids, mask) for k in carveouts})
                if args.gpu_embeddings and device.type == "cuda":
                    fns[f"{LOADER}-gpu-embeddings"] = with_gpu_embeddings(encoder, ids, mask)
                if encoder.graphs is not None:  # the same towers without CUDA graphs (ltx_mgpu.text.gemma.graphs)
                    fns["bf16-eager"] = lambda: bf_eager.encode_tokens(ids, mask)
                    fns[f"{LOADER}-eager"] = lambda: nf4_eager.encode_tokens(ids, mask)
                r = time_interleaved(device, fns, args.warmup, 2 * args.runs)
                ratio = r[LOADER][0] / r["bf16"][0]
                results["head_to_head"][f"{b}x{args.tokens}"] = {
                    "bf16_ms": r["bf16"][0], "nf4_ms": r[LOADER][0], "ratio": ratio,
                    "bf16_times_ms": r["bf16"][1], "nf4_times_ms": r[LOADER][1],
                    "carveouts": {k: r[f"{LOADER}-carveout{k}"][0] for k in carveouts}}
                graphed = encoder.graphs is not None and bool(encoder.graphs.shapes) and bf_encoder.graphs.shapes
                print(f"head to head {b}x{args.tokens} (interleaved{', CUDA graphs' if graphed else ''}): bf16 "
                      f"{r['bf16'][0]:.2f} ms, {LOADER} NF4 {r[LOADER][0]:.2f} ms = {ratio:.3f}x", flush=True)
                if "bf16-eager" in r:
                    e_bf, e_nf = r["bf16-eager"][0], r[f"{LOADER}-eager"][0]
                    results["head_to_head"][f"{b}x{args.tokens}"].update(
                        eager_bf16_ms=e_bf, eager_nf4_ms=e_nf, graphed=bool(graphed),
                        graph_shapes={"bf16": bf_encoder.graphs.shapes, "nf4": encoder.graphs.shapes})
                    print(f"  without CUDA graphs: bf16 {e_bf:.2f} ms, NF4 {e_nf:.2f} ms = {e_nf / e_bf:.3f}x; "
                          f"graphs took bf16 to {r['bf16'][0] / e_bf:.3f}x and NF4 to {r[LOADER][0] / e_nf:.3f}x of "
                          f"their eager time", flush=True)
                for k in carveouts:
                    ms = r[f"{LOADER}-carveout{k}"][0]
                    print(f"  with {k} SMs carved out of cuBLAS: {ms:.2f} ms = {ms / r['bf16'][0]:.3f}x", flush=True)
                if args.gpu_embeddings and device.type == "cuda":
                    ms = r[f"{LOADER}-gpu-embeddings"][0]
                    results["head_to_head"][f"{b}x{args.tokens}"]["gpu_embeddings_ms"] = ms
                    print(f"  with the embedding table on the GPU: {ms:.2f} ms = {ms / r['bf16'][0]:.3f}x", flush=True)
                if args.profile and b == batches[0] and device.type == "cuda":
                    from benchmarks.profile_text import busy_and_host

                    busy_and_host(f"bf16 {b}x{args.tokens}", lambda: bf_encoder.encode_tokens(ids, mask))
                    busy_and_host(f"{LOADER} NF4 {b}x{args.tokens}", lambda: encoder.encode_tokens(ids, mask))
            del bf_encoder, bf_eager, nf4_eager, bf_tower, bf
            gc.collect()
            if device.type == "cuda":
                torch.cuda.empty_cache()
            save()

        # ---- 5. dequant alone, one layer
        dequant_one_layer(nf4.model, device, max(args.warmup, 1), args.runs, args.dequant_sweep, results["dequant_ms"])
        save()

        # ---- summary
        print_summary(results, variants, batches, args.tokens)
    finally:
        if args.keep:
            print(f"kept {work}")
        else:
            shutil.rmtree(work, ignore_errors=True)
        save()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
