"""Decode speed of prompt enhancement (``generate``) through the pool vs transformers' own ``generate``
on the same weights (issue 28: >= 0.9x transformers in bf16; NF4 stated).

On one GPU (an H200; the 12B-shaped snapshot is built and saved first, 23.5 GB)::

    python benchmarks/bench_generate.py --out benchmarks/results/generate_h200.json

CPU smoke test with the tiny assets (seconds)::

    python benchmarks/bench_generate.py --source tiny --device cpu --weights bf16 --tokens 16 --runs 2

What it does, in one process and one pool (every ratio is within this run):

1. ``--source random`` (default): the Gemma 3 12B-shaped random snapshot of
   ``bench_pool_text.py`` (``pool_text_setup.build_snapshot``: 48 layers, hidden 3840, vocab
   262208, bf16, with the tiny Gemma's tokenizer) and a random LTX-2.3 projection (the text
   encoder's config needs one; generation does not use it); ``--snapshot`` / ``--projection``
   reuse an earlier ``--keep`` run's. ``--source tiny``: the tiny test assets.
2. starts a one-rank pool on the device.
3. the prompt: ComfyUI's ids for a short prompt left-padded to 1024 (what
   ``TextGenerateLTX2Prompt`` sends; ``ltx_mgpu.text.generate.tokens``), the same ids for
   every path. Greedy decoding, no stop token (every run makes exactly its tokens).
4. for each ``--weights`` (``bf16``; ``nf4``: NF4 made at load from the same snapshot), the paths,
   alternated run by run:

   * ``pool``: ``ltx_mgpu.client.text.generate_text`` (what the Gemma Loader's CLIP does: the
     ``generate`` request, the job, the result), eager on transformers' dynamic cache: the
     Gemma Loader as shipped (``compile`` off);
   * ``pool compiled`` (bf16): the same with the loader's ``compile`` on: transformers' static
     cache and ``torch.compile`` (CUDA graphs);
   * ``transformers``: ``Gemma3ForCausalLM.from_pretrained(snapshot)`` (NF4: with transformers'
     ``BitsAndBytesConfig``, NF4 + double quantization, bf16 compute: bitsandbytes'
     ``Linear4bit``, as the pool decodes) and its ``generate``, dynamic cache, eager;
   * ``transformers compiled`` (bf16): the same with ``cache_implementation="static"``
     (its auto-compile).

   Each path runs ``--tokens`` new tokens and 1 new token (the prompt's forward alone); decode
   tokens/s = ``(tokens - 1) / (t(tokens) - t(1))`` of the medians over ``--runs`` (after
   ``--warmup`` rounds, which also take the compilations). ``pool / transformers`` is the
   target's ratio (eager vs eager; compiled vs compiled). The tokens of every path are compared
   with transformers' (random weights: bf16 near-ties may differ; the count of equal leading
   tokens is reported).

Wall-clock times (``perf_counter`` around synchronous calls). JSON after every cell (``--out``).
"""

from __future__ import annotations

import argparse
import gc
import os
import statistics
import sys
import tempfile
import time
import types
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.bench_text import GEMMA_12B  # noqa: E402
from benchmarks.pool_text_setup import build_snapshot, finish, start_pool, write_projection  # noqa: E402
from benchmarks.timing import write_json  # noqa: E402

#: The target: the pool's decode speed over transformers' own (bf16).
GOAL_RATIO = 0.9
PROMPT = "a red fox walks slowly through the snow at night, camera light"
_T0 = time.perf_counter()


def log(message: str) -> None:
    print(f"[{time.perf_counter() - _T0:7.1f} s] {message}", flush=True)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _leading_equal(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def transformers_model(gemma: Path, weights: str, device: torch.device):
    """``Gemma3ForCausalLM`` from the snapshot (its tied head; the tiny assets' multimodal snapshot:
    ``Gemma3ForConditionalGeneration``, text only), bf16 or bitsandbytes NF4."""
    from transformers import (
        AutoConfig,
        BitsAndBytesConfig,
        Gemma3ForCausalLM,
        Gemma3ForConditionalGeneration,
        GenerationConfig,
    )

    multimodal = AutoConfig.from_pretrained(str(gemma)).model_type == "gemma3"  # the tiny assets' snapshot
    kwargs: dict = {"dtype": torch.bfloat16 if device.type == "cuda" or weights == "nf4" else torch.float32}
    if weights == "nf4":
        kwargs["quantization_config"] = BitsAndBytesConfig(
            load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True,
            bnb_4bit_compute_dtype=torch.bfloat16)
    cls = Gemma3ForConditionalGeneration if multimodal else Gemma3ForCausalLM
    model = cls.from_pretrained(str(gemma), device_map={"": device}, **kwargs).eval()
    model.generation_config = GenerationConfig()
    return model


def bench_weights(weights: str, args, gemma: Path, projection: Path, device: torch.device, client, ids: list[int],
                  results: dict) -> None:
    from transformers import GenerationConfig

    from ltx_mgpu.client.text import generate_text
    from ltx_mgpu.text.config import TextEncoderConfig

    dtype = "bfloat16" if device.type == "cuda" or weights == "nf4" else "float32"  # NF4 computes in bf16
    prompt_text = args.prompt_text
    paths: dict = {}
    for compiled in ((False, True) if weights == "bf16" and device.type == "cuda" else (False,)):
        config = TextEncoderConfig(str(gemma), str(projection), weights=weights, dtype=dtype, compile=compiled)

        def pool(n: int, config=config) -> list[int]:
            options = {"do_sample": False, "max_length": n, "stop_tokens": []}
            return generate_text(client, config, prompt_text, options, timeout=3600)["tokens"]

        paths["pool compiled" if compiled else "pool"] = pool
    model = transformers_model(gemma, weights, device)
    x = torch.tensor([ids], device=device)
    for compiled in ((False, True) if weights == "bf16" and device.type == "cuda" else (False,)):

        def hf(n: int, compiled=compiled) -> list[int]:
            config = GenerationConfig(max_new_tokens=n, min_new_tokens=n, do_sample=False, eos_token_id=None,
                                      pad_token_id=0, cache_implementation="static" if compiled else None)
            out = model.generate(input_ids=x, attention_mask=torch.ones_like(x), generation_config=config)
            _sync(device)
            return out[0, len(ids):].tolist()

        paths["transformers compiled" if compiled else "transformers"] = hf
    counts = (1, args.tokens)
    times: dict = {(name, n): [] for name in paths for n in counts}
    tokens: dict = {}
    # one pool configuration at a time (a switch reloads Gemma in the pool), alternating with its
    # transformers counterpart run by run
    pairs = [(ours, ours.replace("pool", "transformers")) for ours in paths if ours.startswith("pool")]
    for pair in pairs:
        for r in range(args.warmup + args.runs):
            for name in pair:
                for n in counts:
                    t0 = time.perf_counter()
                    out = paths[name](n)
                    _sync(device)
                    if r >= args.warmup:
                        times[(name, n)].append(time.perf_counter() - t0)
                    if n == args.tokens:
                        tokens[name] = out
            log(f"{weights} {' vs '.join(pair)}: round {r + 1} of {args.warmup + args.runs} done")
    row: dict = {}
    for name in paths:
        t1, tn = (statistics.median(times[(name, n)]) for n in counts)
        row[name] = {"first_token_ms": t1 * 1e3, f"{args.tokens}_tokens_ms": tn * 1e3,
                     "decode_tokens_per_second": (args.tokens - 1) / (tn - t1),
                     "times_s": {str(n): times[(name, n)] for n in counts},
                     "tokens_equal_to_transformers": _leading_equal(tokens[name], tokens["transformers"])}
    for ours, theirs in (("pool", "transformers"), ("pool compiled", "transformers compiled"),
                         ("pool compiled", "transformers")):
        if ours in row and theirs in row:
            ratio = row[ours]["decode_tokens_per_second"] / row[theirs]["decode_tokens_per_second"]
            row[f"{ours} / {theirs}"] = ratio
            log(f"{weights}: {ours} {row[ours]['decode_tokens_per_second']:.1f} tok/s vs {theirs} "
                f"{row[theirs]['decode_tokens_per_second']:.1f} tok/s: {ratio:.3f}x"
                + (f" (goal >= {GOAL_RATIO})" if weights == "bf16" else ""))
    results["weights"][weights] = row
    if args.out:
        write_json(args.out, results)  # before the unload: a run cut short keeps its numbers
    paths.clear()  # the transformers model goes with its closures
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    t0 = time.perf_counter()
    client.request("unload", {"names": None}, timeout=300)
    log(f"{weights}: pool unloaded in {time.perf_counter() - t0:.1f} s")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--source", choices=["random", "tiny"], default="random")
    ap.add_argument("--device", default="cuda", help="cuda[:i] (default) or cpu")
    ap.add_argument("--layers", type=int, default=GEMMA_12B["layers"], help="decoder layers of the random model")
    ap.add_argument("--tokens", type=int, default=256, help="new tokens per timed generation (default 256)")
    ap.add_argument("--weights", default="bf16,nf4", help="weights modes to time (default bf16,nf4)")
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--tmp", default=tempfile.gettempdir(), help="where the snapshot and projection go")
    ap.add_argument("--snapshot", default=None, help="reuse this snapshot directory (with --projection)")
    ap.add_argument("--projection", default=None, help="reuse this projection file (with --snapshot)")
    ap.add_argument("--keep", action="store_true", help="keep the snapshot and projection for a later run")
    ap.add_argument("--out", default=None, help="write raw results as JSON here")
    args = ap.parse_args(argv)
    if bool(args.snapshot) != bool(args.projection):
        ap.error("--snapshot and --projection go together")
    if "nf4" in args.weights.split(",") and not args.device.startswith("cuda"):
        ap.error("--weights nf4 needs a CUDA device (transformers' NF4 model runs bitsandbytes' CUDA kernels)")
    if args.tokens < 2:
        ap.error("--tokens must be >= 2 (decode speed is (tokens - 1) / (t(tokens) - t(1)))")
    device = torch.device(args.device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", 0)

    import transformers

    from ltx_mgpu.assets import tiny_gemma_dir, tiny_ltx_checkpoint
    from ltx_mgpu.text.gemma.sources import find_tokenizer_files
    from ltx_mgpu.text.gemma.tokenizer import check_tokenizer, load_tokenizer
    from ltx_mgpu.text.generate.tokens import GenerationTokenizer

    work = Path(tempfile.mkdtemp(prefix="bench-generate-", dir=args.tmp))
    os.environ.setdefault("LTX_MGPU_HOME", str(work / "home"))
    results: dict = {"device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
                     "torch": torch.__version__, "transformers": transformers.__version__, "source": args.source,
                     "layers": args.layers, "new_tokens": args.tokens, "weights": {}}
    client = None
    try:
        tok_dir = tiny_gemma_dir(work / "assets")
        if args.source == "tiny":
            gemma, projection = tok_dir, tiny_ltx_checkpoint("2.3", work / "assets")
        elif args.snapshot:
            gemma, projection = Path(args.snapshot).resolve(), Path(args.projection).resolve()
        else:
            projection = work / "ltx23-projection-random.safetensors"
            write_projection(projection, args.layers, GEMMA_12B["hidden"], device)
            gemma = work / f"gemma3-12b-shaped-{args.layers}l-random"
            info = build_snapshot(gemma, args.layers, device, tok_dir)
            results["snapshot"] = info
            log(f"snapshot: {info['bytes'] / 1e9:.1f} GB, built {info['build_seconds']:.0f} s, saved "
                f"{info['save_seconds']:.0f} s")
        tokenizer = check_tokenizer(load_tokenizer(find_tokenizer_files(tok_dir)), tok_dir)
        spm = (tok_dir / "tokenizer.model").read_bytes()
        # ComfyUI's ids for the LTX-2 enhancer's shape of prompt: a chat turn, left-padded to 1024
        args.prompt_text = (f"<start_of_turn>user\nUser Raw Input Prompt: {PROMPT}.<end_of_turn>\n"
                            "<start_of_turn>model\n")
        ids = GenerationTokenizer(types.SimpleNamespace(tokenizer=tokenizer), spm).prompt_ids(args.prompt_text, 1024)
        results["prompt_tokens"] = len(ids)
        t0 = time.perf_counter()
        client = start_pool(device, work)
        log(f"pool: 1 rank on {client.pool['device']} started in {time.perf_counter() - t0:.1f} s")
        for weights in args.weights.split(","):
            bench_weights(weights, args, gemma, projection, device, client, ids, results)
            if args.out:
                write_json(args.out, results)
    finally:
        finish(client, args, work, log)

    print(f"\n{'weights':<8}{'path':<24}{'first token ms':>16}{'decode tok/s':>14}{'equal tokens':>14}")
    for weights, row in results["weights"].items():
        for name, r in row.items():
            if isinstance(r, dict):
                print(f"{weights:<8}{name:<24}{r['first_token_ms']:>16.1f}{r['decode_tokens_per_second']:>14.1f}"
                      f"{r['tokens_equal_to_transformers']:>14}")
        for name, ratio in row.items():
            if not isinstance(ratio, dict):
                print(f"{weights:<8}{name}: {ratio:.3f}x")
    print(f"total wall time {time.perf_counter() - _T0:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
