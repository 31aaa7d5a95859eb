"""Prompt encode through the pool vs in-process: the pool's overhead (issue 4, goal <= 5 %).

On one GPU (the issue's numbers come from an H200; the whole run takes about 5 minutes)::

    python benchmarks/bench_pool_text.py --out benchmarks/results/pool_text_h200.json

CPU smoke test with the tiny assets (seconds)::

    python benchmarks/bench_pool_text.py --source tiny --device cpu

Save cost only (builds and saves a ``--layers`` model, prints GB/s and the estimate for 48;
on the 2-core CPU dev box: 0.28-0.42 GB/s, i.e. 55-84 s for the 23.5 GB snapshot)::

    python benchmarks/bench_pool_text.py --device cpu --layers 1 --save-only

What it does, in one process (every ratio is within this run):

1. ``--source random`` (default): builds a Gemma 3 12B-shaped ``Gemma3TextModel``
   (``gemma3_text_config``; 48 layers, hidden 3840, vocab 262208; ``--layers`` shrinks it)
   with random bf16 weights on the device and saves it as a Hugging Face snapshot under
   ``--tmp`` (23.5 GB at 48 layers, safetensors shards) with the tiny Gemma's SentencePiece
   tokenizer (its ids, < 512, are valid ids of the 12B vocabulary), plus a random LTX-2.3
   projection file (188160 -> 4096 + 2048, bf16, 2.3 GB). The projection is written first;
   its write speed gives the printed estimate of the snapshot's save time. ``--snapshot`` /
   ``--projection`` reuse files from an earlier ``--keep`` run. ``--source tiny``: the tiny
   test assets (``ltx_mgpu.assets``), nothing is built.
2. starts a one-rank pool on the device (``PoolClient.connect``, CPU: one gloo rank).
3. for each ``--weights`` (``bf16``, ``nf4``: NF4 made at load from the same bf16 snapshot,
   ``ltx_mgpu.text.nf4.load.load_nf4_on_the_fly``): loads it in-process
   (``LocalTextEncoder(...).build()``) and in the pool (placement ``single``), times each
   prompt set (``--batches`` x ``--tokens``-token prompts, every prompt exactly that many
   tokens, BOS included), alternating the two paths run by run (``--warmup`` untimed rounds,
   then the median of ``--runs``):

   * ``in-process``: ``LocalTextEncoder.build().encode(prompts, batch_size)``;
   * ``pool``: ``ltx_mgpu.client.text.encode_prompts(client, config, prompts, cache=None, keep=False)`` - what
     the ComfyUI encode node does: the ``encode`` job with the resident encoder's key (a pool
     without it rejects the request and the client loads, then retries), the job (Gemma
     forward, the replication to every rank, not kept resident), the result (float32 from a
     one-rank pool) in shared memory (``ltx_mgpu.wire.arena``: handed over in a spare the pool made
     ahead, the encoder's rows written straight into it, else copied out of the connection's
     arena; the socket under 1 MiB; each row reports ``wire_bytes`` and ``transport``);
   * ``pool request``: the ``encode`` request alone, whose result gives the pool-side split
     (``seconds.encode``: Gemma + features on rank 0; ``seconds.broadcast``: the replication);
     the rest is the job's framing, the socket and the client.

   It checks that the pool's embeddings equal the in-process ones (same kernels on the same
   device: bitwise expected) and prints the overhead ``pool / in-process - 1`` (of the medians;
   also of each round's pair, median and quartiles), and the time of
   a first read of a fresh result from each path (a handed-over result's pages are mapped on
   first touch, so its first reader pays what the in-process encode paid while writing).

First it prints the host-memory probe (:func:`host_copy_probe`): the float32 upcast of an
8x1024-token result into fresh ``torch.empty`` memory, a fresh ``bytearray`` and reused memory.

Wall-clock times (``perf_counter``, each call returns CPU tensors, so it is synchronised).
GB are 10^9 bytes.
"""

from __future__ import annotations

import argparse
import gc
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import dataclasses

from benchmarks.bench_text import GEMMA_12B  # noqa: E402
from benchmarks.pool_text_setup import (  # noqa: E402
    build_snapshot,
    exact_prompts,
    finish,
    host_copy_probe,
    snapshot_bytes,
    start_pool,
    write_projection,
)
from benchmarks.timing import sync as _sync  # noqa: E402
from benchmarks.timing import write_json  # noqa: E402
from ltx_mgpu.text.config import TextEncoderConfig

GOAL_OVERHEAD = 0.05
_T0 = time.perf_counter()


def log(message: str) -> None:
    print(f"[{time.perf_counter() - _T0:7.1f} s] {message}", flush=True)


# --------------------------------------------------------------------------- timing

def alternate(fns: dict, warmup: int, runs: int) -> dict[str, list[float]]:
    """Run each of ``fns`` in turn, ``warmup`` untimed rounds then ``runs`` timed rounds, so
    slow drifts (clocks, other load) hit every variant alike. Returns name -> seconds."""
    for _ in range(warmup):
        for fn in fns.values():
            fn()
    times: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(runs):
        for name, fn in fns.items():
            t0 = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - t0)
    return times


def _max_diff(a, b) -> float:
    return max(float((x.tensor.float() - y.tensor.float()).abs().max()) for x, y in zip(a, b))


def bench_weights(weights: str, args, gemma: Path, projection: Path, device: torch.device, client,
                  prompt_sets: dict[int, list[str]], results: dict) -> None:
    from ltx_mgpu.client.text import embeddings_from_result, encode_prompts, ensure_text_encoder, pool_key, upcast
    from ltx_mgpu.text.encoder.local import LocalTextEncoder

    row = results["weights"][weights] = {}
    spec = LocalTextEncoder(TextEncoderConfig(str(gemma), str(projection), weights=weights, dtype="bfloat16"),
                            str(device))
    t0 = time.perf_counter()
    encoder = spec.build()
    _sync(device)
    row["in_process_load_seconds"] = time.perf_counter() - t0
    log(f"{weights}: in-process load {row['in_process_load_seconds']:.1f} s")
    remote = dataclasses.replace(spec.config, placement="single")
    t0 = time.perf_counter()
    key = pool_key(remote)  # content digests of the files: hashed once, then memoised by stat
    row["digest_seconds"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    loaded = ensure_text_encoder(client, remote, key, timeout=1800)
    row["pool_load_seconds"] = time.perf_counter() - t0
    log(f"{weights}: file digests {row['digest_seconds']:.1f} s (first use only); pool load "
        f"{row['pool_load_seconds']:.1f} s ({(loaded or {}).get('weights', weights)})")

    for batch, prompts in prompt_sets.items():
        split: list[dict] = []

        def in_process():
            return encoder.encode(prompts, batch_size=batch)

        def pool():
            return encode_prompts(client, remote, prompts, cache=None, batch_size=batch, timeout=600, keep=False)[0]

        def pool_request():  # as encode_prompts sends it (receive=upcast: a float32 result is kept as it is)
            job = client.submit("encode", {"prompts": prompts, "batch_size": batch, "expect": key, "keep": False},
                                receive=upcast)
            result, tensors = job.wait(timeout=600)
            split.append({**result["seconds"], "wire_dtype": result["wire_dtype"],
                          "in_place": result.get("rows_in_place", False),
                          "legs": request_legs(job.clock, result.get("timeline", {}), result["seconds"])})
            return embeddings_from_result(result, tensors)

        reference = in_process()
        diff = _max_diff(reference, pool())
        result_bytes = sum(e.tensor.numel() * e.tensor.element_size() for e in reference)
        shm_before, owned_before = client.shm_stats["frames"], client.shm_stats["owned"]
        rounds = max(args.runs, args.small_rounds // batch)  # small sets are fast and noisy: more rounds
        times = alternate({"in-process": in_process, "pool": pool, "pool request": pool_request},
                          args.warmup, rounds)
        split = split[args.warmup:]
        wire = getattr(torch, split[-1]["wire_dtype"])
        shm_frames = client.shm_stats["frames"] - shm_before
        owned = client.shm_stats["owned"] - owned_before
        med = {name: statistics.median(ts) * 1e3 for name, ts in times.items()}
        pool_encode = statistics.median(s["encode"] for s in split) * 1e3
        pool_broadcast = statistics.median(s["broadcast"] for s in split) * 1e3
        legs = {leg: statistics.median(s["legs"][leg] for s in split) for leg in split[-1]["legs"]}
        overhead = med["pool"] / med["in-process"] - 1
        # the same from each round's pair (in-process then pool, back to back): robust to a host
        # whose speed drifts between rounds; quartiles show the spread
        paired = statistics.quantiles([p / i for p, i in zip(times["pool"], times["in-process"])], n=4)
        label = f"{batch}x{args.tokens}"
        read = {name: _first_read(fn()) for name, fn in (("in-process", in_process), ("pool", pool))}
        row[label] = {"first_read_ms": read,
                      "median_ms": med, "times_ms": {k: [t * 1e3 for t in v] for k, v in times.items()},
                      "overhead": overhead, "pool_encode_ms": pool_encode, "pool_broadcast_ms": pool_broadcast,
                      "request_legs_ms": legs, "rounds": rounds,
                      "paired_overhead_quartiles": [q - 1 for q in paired],
                      "max_abs_diff_pool_vs_in_process": diff,
                      "result_bytes": result_bytes, "wire_dtype": str(wire).removeprefix("torch."),
                      "wire_bytes": result_bytes // 4 * wire.itemsize,
                      "transport": (f"shared memory ({shm_frames} frames, {owned} handed over, "
                                    f"{sum(s['in_place'] for s in split)} of {len(split)} requests written in place)"
                                    if shm_frames else "socket")}
        log(f"{weights} {label}: in-process {med['in-process']:.2f} ms, pool {med['pool']:.2f} ms "
            f"({overhead:+.1%}; paired by round {paired[1] - 1:+.1%}, quartiles {paired[0] - 1:+.1%} to "
            f"{paired[2] - 1:+.1%}, {rounds} rounds), pool request {med['pool request']:.2f} ms = "
            f"encode {pool_encode:.2f} + "
            f"broadcast {pool_broadcast:.2f} + rest {med['pool request'] - pool_encode - pool_broadcast:.2f}; "
            f"max |pool - in-process| = {diff:.3g}; result {row[label]['wire_bytes'] / 1e6:.1f} MB "
            f"{row[label]['wire_dtype']} via {row[label]['transport']}; first read of a fresh result (a sum): "
            f"in-process {read['in-process']:.2f} ms, pool {read['pool']:.2f} ms")
        log(f"{weights} {label}: a pool request's legs (medians, ms): "
            + ", ".join(f"{leg} {ms:.3f}" for leg, ms in legs.items()))
    encoder = spec._encoder = None  # free the in-process model before the next weights mode
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    client.request("unload", {"names": None}, timeout=300)


def request_legs(clock: dict, timeline: dict, seconds: dict) -> dict[str, float]:
    """Where a pool request's time goes, in ms, from the client's ``Job.clock`` and the result's
    ``timeline`` (both ``time.monotonic()``, one host): ``to pool`` (sent -> the server read
    it), ``queue`` (-> the job loop took it), ``job`` (-> the result went to the writer) of
    which ``encode`` and ``broadcast`` are the job's own ``seconds`` and ``job other`` the
    rest (control broadcast, checks, outcome agreement), ``to client`` (-> the client read the
    frame and mapped its payload), ``receive`` (the ``receive`` callback) and ``wake`` (->
    ``wait`` returned on the caller's thread)."""
    c, t = clock, timeline
    if not t or not {"sent", "arrived", "queued", "returned"} <= set(c):
        return {}
    job = t["finished"] - t["started"]
    legs = {"to pool": t["received"] - c["sent"], "queue": t["started"] - t["received"], "job": job,
            "job other": job - seconds["encode"] - seconds["broadcast"], "to client": c["arrived"] - t["finished"],
            "receive": c["queued"] - c["arrived"], "wake": c["returned"] - c["queued"]}
    return {k: v * 1e3 for k, v in legs.items()}


def _first_read(embeddings) -> float:
    """Milliseconds to read every element of a fresh result once (a sum): a handed-over result
    is mapped without populating its pages, so its first reader takes the page faults that the
    in-process encode took while writing its rows; this shows what that costs."""
    t0 = time.perf_counter()
    for e in embeddings:
        e.tensor.sum()
    return (time.perf_counter() - t0) * 1e3


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--source", choices=["random", "tiny"], default="random",
                    help="random: the 12B-shaped model saved as a snapshot (default); tiny: the test assets")
    ap.add_argument("--device", default="cuda", help="cuda[:i] (default) or cpu")
    ap.add_argument("--layers", type=int, default=GEMMA_12B["layers"], help="decoder layers of the random model")
    ap.add_argument("--tokens", type=int, default=1024, help="tokens per prompt, BOS included (default 1024)")
    ap.add_argument("--batches", default="1,8", help="prompt-set sizes, one Gemma forward each (default 1,8)")
    ap.add_argument("--weights", default="bf16,nf4", help="weights modes to time (default bf16,nf4)")
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--runs", type=int, default=7)
    ap.add_argument("--small-rounds", type=int, default=40,
                    help="timed rounds for a set of B prompts: max(--runs, this // B) (default 40: 40 for 1x1024, "
                         "whose encode is host-bound and spread 68-116 ms on one host)")
    ap.add_argument("--tmp", default=tempfile.gettempdir(), help="where the snapshot and projection go")
    ap.add_argument("--snapshot", default=None, help="reuse this snapshot directory (with --projection)")
    ap.add_argument("--projection", default=None, help="reuse this projection file (with --snapshot)")
    ap.add_argument("--keep", action="store_true", help="keep the snapshot and projection for a later run")
    ap.add_argument("--save-only", action="store_true", help="build and save the random model, print the cost, exit")
    ap.add_argument("--out", default=None, help="write raw results as JSON here")
    args = ap.parse_args(argv)
    if args.runs < 5 and not args.save_only and args.source == "random":
        ap.error("--runs must be >= 5 for a median worth reporting")
    if bool(args.snapshot) != bool(args.projection):
        ap.error("--snapshot and --projection go together")
    device = torch.device(args.device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", 0)

    import transformers

    from ltx_mgpu.assets import tiny_gemma_dir, tiny_ltx_checkpoint

    work = Path(tempfile.mkdtemp(prefix="bench-pool-text-", dir=args.tmp))
    os.environ.setdefault("LTX_MGPU_HOME", str(work / "home"))  # the digest memo stays in the run's directory
    results: dict = {"device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
                     "torch": torch.__version__, "transformers": transformers.__version__, "source": args.source,
                     "layers": args.layers, "tokens": args.tokens, "weights": {}}
    client = None
    results["host_copy_ms"] = probe = host_copy_probe()
    log("host: bf16 -> float32 copy of an 8x1024 result into " + ", ".join(f"{k} {v:.1f} ms" for k, v in probe.items()))
    try:
        tok_dir = tiny_gemma_dir(work / "assets")
        if args.source == "tiny":
            gemma, projection = tok_dir, tiny_ltx_checkpoint("2.3", work / "assets")
        elif args.snapshot:
            gemma, projection = Path(args.snapshot).resolve(), Path(args.projection).resolve()
        else:
            projection = work / "ltx23-projection-random.safetensors"
            seconds, nbytes = write_projection(projection, args.layers, GEMMA_12B["hidden"], device)
            rate = nbytes / seconds / 1e9
            snap_bytes = snapshot_bytes(args.layers)
            log(f"projection: {nbytes / 1e9:.2f} GB written in {seconds:.1f} s ({rate:.2f} GB/s); the "
                f"{args.layers}-layer snapshot ({snap_bytes / 1e9:.1f} GB) should take "
                f"~{snap_bytes / 1e9 / rate:.0f} s "
                "to save at that rate")
            gemma = work / f"gemma3-12b-shaped-{args.layers}l-random"
            info = build_snapshot(gemma, args.layers, device, tok_dir)
            save_rate = info["bytes"] / info["save_seconds"] / 1e9
            results["snapshot"] = {**info, "projection_bytes": nbytes, "projection_save_seconds": seconds}
            log(f"snapshot: built in {info['build_seconds']:.1f} s, {info['bytes'] / 1e9:.2f} GB saved in "
                f"{info['save_seconds']:.1f} s ({save_rate:.2f} GB/s, {1 / save_rate:.2f} s per GB); the 48-layer "
                f"snapshot ({snapshot_bytes() / 1e9:.1f} GB) would take ~{snapshot_bytes() / 1e9 / save_rate:.0f} s")
            if args.save_only:
                return 0

        from ltx_mgpu.text.gemma.sources import find_tokenizer_files
        from ltx_mgpu.text.gemma.tokenizer import check_tokenizer, load_tokenizer

        tokenizer = check_tokenizer(load_tokenizer(find_tokenizer_files(tok_dir)), tok_dir)
        prompt_sets = {b: exact_prompts(tokenizer, b, args.tokens, seed=b) for b in map(int, args.batches.split(","))}

        t0 = time.perf_counter()
        client = start_pool(device, work)
        results["pool_start_seconds"] = time.perf_counter() - t0
        results["threads"] = {"in-process": torch.get_num_threads(),
                              "pool": client.status()["ranks"][0].get("threads")}
        log(f"pool: 1 rank on {client.pool['device']} started in {results['pool_start_seconds']:.1f} s; CPU threads "
            f"in-process {results['threads']['in-process']}, pool {results['threads']['pool']}")
        for weights in args.weights.split(","):
            bench_weights(weights, args, gemma, projection, device, client, prompt_sets, results)
            if args.out:
                write_json(args.out, results)
    finally:
        finish(client, args, work, log)

    print(f"\n{'weights':<8}{'prompts':>10}{'in-process ms':>15}{'pool ms':>10}{'overhead':>10}{'paired':>9}"
          f"{'pool encode':>13}{'broadcast':>11}{'rest':>8}  goal <= {GOAL_OVERHEAD:.0%}")
    for weights, row in results["weights"].items():
        for label, r in row.items():
            if not isinstance(r, dict):
                continue
            med = r["median_ms"]
            rest = med["pool request"] - r["pool_encode_ms"] - r["pool_broadcast_ms"]
            verdict = "ok" if r["overhead"] <= GOAL_OVERHEAD else "MISS"
            print(f"{weights:<8}{label:>10}{med['in-process']:>15.2f}{med['pool']:>10.2f}{r['overhead']:>+10.1%}"
                  f"{r['paired_overhead_quartiles'][1]:>+9.1%}"
                  f"{r['pool_encode_ms']:>13.2f}{r['pool_broadcast_ms']:>11.2f}{rest:>8.2f}  {verdict}")
    print(f"total wall time {time.perf_counter() - _T0:.0f} s")
    if args.out:
        write_json(args.out, results)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
