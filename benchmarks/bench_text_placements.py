"""Gemma 3 across the GPUs of a pool: the three placements, bf16 and NF4, timed and weighed.

On a machine with several GPUs (the multi-GPU issue's numbers; ~5 minutes on 2 GPUs)::

    python benchmarks/bench_text_placements.py --gpus 0,1 --out benchmarks/results/text_placements_h200x2.json

CPU smoke test (two gloo ranks, the tiny test assets; what ``tests/integration/test_bench_ranks.py``
runs)::

    python benchmarks/bench_text_placements.py --gpus cpu --nproc 2 --source tiny --tokens 64 --runs 2

It builds (``--source random``, default) the Gemma 3 12B-shaped random snapshot and LTX-2.3
projection of ``bench_pool_text`` (``pool_text_setup``), starts one pool on ``--gpus`` and, for
each ``--weights`` x ``--placements`` (``single``: rank 0 holds Gemma; ``accelerate``: one
copy spread over every GPU by an Accelerate ``device_map``; ``batch_parallel``: a replica per
GPU, the prompts split across them), loads the encoder and times the ``encode`` request for
each prompt set (``--batches`` x ``--tokens`` tokens, ``batch_size`` = the set, so
``batch_parallel`` gives each rank its share): ``--warmup`` untimed then the median of
``--runs``. From each result it keeps the pool's own split (``seconds.encode``: the Gemma
forwards + features, ``seconds.broadcast``: the replication of every embedding to every rank,
which sequence parallelism needs) and from ``status`` each rank's allocated and reserved GPU
memory after the encode (bytes; the balance of an Accelerate split). Printed: a table with the
speed-up of each placement over ``single`` for the same weights and prompt set. Wall-clock
milliseconds (``perf_counter`` around the request; results come back as CPU tensors).
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.pool_text_setup import GEMMA_12B, build_snapshot, exact_prompts, write_projection  # noqa: E402
from benchmarks.timing import write_json  # noqa: E402
from ltx_mgpu.choices import PLACEMENTS  # noqa: E402
from ltx_mgpu.text.config import TextEncoderConfig  # noqa: E402


def _memory(client) -> list[dict]:
    """Each rank's GPU memory (bytes) from ``status``."""
    out = []
    for r in client.status()["ranks"]:
        m = r.get("memory") or {}
        out.append({"rank": r["rank"], "device": r["device"], "allocated": m.get("allocated"),
                    "reserved": m.get("reserved")})
    return out


def bench(client, gemma: Path, projection: Path, weights: str, placement: str, prompt_sets: dict, a) -> dict:
    """Load one configuration and time its prompt sets; returns its row."""
    from ltx_mgpu.client.text import ensure_text_encoder, pool_key

    encoder = TextEncoderConfig(str(gemma), str(projection), weights=weights, placement=placement, dtype="bfloat16")
    key = pool_key(encoder)
    t0 = time.perf_counter()
    loaded = ensure_text_encoder(client, encoder, key, timeout=1800) or {}
    row: dict = {"load_seconds": time.perf_counter() - t0, "layers": loaded.get("layers"),
                 "holders": loaded.get("holders"), "sets": {}}
    for batch, prompts in prompt_sets.items():
        params = {"prompts": prompts, "batch_size": batch, "expect": key, "keep": False}
        times, split = [], []
        for i in range(a.warmup + a.runs):
            t0 = time.perf_counter()
            result, _ = client.request("encode", params, timeout=1800)
            if i >= a.warmup:
                times.append((time.perf_counter() - t0) * 1e3)
                split.append(result["seconds"])
        label = f"{batch}x{a.tokens}"
        cell = row["sets"][label] = {
            "median_ms": statistics.median(times), "times_ms": times,
            "encode_ms": statistics.median(s["encode"] for s in split) * 1e3,
            "broadcast_ms": statistics.median(s["broadcast"] for s in split) * 1e3,
            "broadcast_bytes": result["broadcast_bytes"], "owners": result["owners"], "memory": _memory(client)}
        print(f"{weights} {placement} {label}: {cell['median_ms']:.1f} ms (encode {cell['encode_ms']:.1f}, "
              f"broadcast {cell['broadcast_ms']:.1f})", flush=True)
    client.request("unload", {"names": None}, timeout=600)
    return row


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--gpus", default="all", help="the pool's GPUs (0,1 / all) or cpu (with --nproc)")
    ap.add_argument("--nproc", type=int, default=None, help="CPU ranks with --gpus cpu")
    ap.add_argument("--source", choices=["random", "tiny"], default="random")
    ap.add_argument("--layers", type=int, default=GEMMA_12B["layers"])
    ap.add_argument("--tokens", type=int, default=1024)
    ap.add_argument("--batches", default="2,8", help="prompt-set sizes (default 2,8)")
    ap.add_argument("--weights", default="bf16,nf4")
    ap.add_argument("--placements", default=",".join(PLACEMENTS))
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--tmp", default=tempfile.gettempdir())
    ap.add_argument("--out", default=None)
    a = ap.parse_args(argv)
    placements = a.placements.split(",")
    if unknown := sorted(set(placements) - set(PLACEMENTS)):
        ap.error(f"unknown placement(s) {unknown}; choose from {list(PLACEMENTS)}")

    from ltx_mgpu.assets import tiny_gemma_dir, tiny_ltx_checkpoint
    from ltx_mgpu.client.pool_client import PoolClient
    from ltx_mgpu.text.gemma.sources import find_tokenizer_files
    from ltx_mgpu.text.gemma.tokenizer import check_tokenizer, load_tokenizer

    work = Path(tempfile.mkdtemp(prefix="bench-text-placements-", dir=a.tmp))
    runtime = None
    os.environ.setdefault("LTX_MGPU_HOME", str(work / "home"))
    client = None
    results: dict = {"args": vars(a), "torch": torch.__version__, "rows": {}}
    try:
        tok_dir = tiny_gemma_dir(work / "assets")
        if a.source == "tiny":
            gemma, projection = tok_dir, tiny_ltx_checkpoint("2.3", work / "assets")
        else:
            device = torch.device("cuda", 0)
            projection = work / "ltx23-projection-random.safetensors"
            write_projection(projection, a.layers, GEMMA_12B["hidden"], device)
            gemma = work / "gemma3-12b-shaped-random"
            build_snapshot(gemma, a.layers, device, tok_dir)
            torch.cuda.empty_cache()
        tokenizer = check_tokenizer(load_tokenizer(find_tokenizer_files(tok_dir)), tok_dir)
        prompt_sets = {b: exact_prompts(tokenizer, b, a.tokens, seed=b) for b in map(int, a.batches.split(","))}
        # the runtime directory apart from --tmp: the socket's path must stay under 108 bytes
        runtime = Path(tempfile.mkdtemp(prefix="ltx-rt-"))
        client = PoolClient.connect(gpus=a.gpus, nproc=a.nproc, runtime_dir=runtime, startup_timeout=600)
        results["pool"] = {"world_size": client.spec.nproc, "device": client.pool.get("device")}
        print(f"pool: {client.spec.nproc} ranks on {client.pool.get('device')}", flush=True)
        for weights in a.weights.split(","):
            for placement in placements:
                results["rows"][f"{weights}/{placement}"] = bench(client, gemma, projection, weights, placement,
                                                                  prompt_sets, a)
                if a.out:
                    write_json(a.out, results)
    finally:
        if client is not None:
            client.shutdown()
            client.close()
        shutil.rmtree(work, ignore_errors=True)
        if runtime is not None:
            shutil.rmtree(runtime, ignore_errors=True)

    print(f"\n{'weights/placement':<22}{'prompts':>9}{'ms':>10}{'x single':>10}{'encode':>9}{'bcast':>8}"
          f"  GPU memory allocated per rank (GB)")
    for name, row in results["rows"].items():
        single = results["rows"].get(name.split("/")[0] + "/single")
        for label, s in row["sets"].items():
            base = single["sets"][label]["median_ms"] if single else float("nan")
            mem = ", ".join(f"{m['allocated'] / 1e9:.2f}" if m["allocated"] is not None else "-" for m in s["memory"])
            print(f"{name:<22}{label:>9}{s['median_ms']:>10.1f}{base / s['median_ms']:>10.2f}{s['encode_ms']:>9.1f}"
                  f"{s['broadcast_ms']:>8.1f}  {mem}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
