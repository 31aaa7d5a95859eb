"""Sharded transformer weights (FSDP2) against replicated ones, and what they would give on
consumer GPUs.

Run on one GPU (the issue's numbers come from one H200)::

    python benchmarks/bench_sharded.py --out benchmarks/results/sharded_h200.json

1. **Measured**: the 19B-shaped header-only checkpoint of ``bench_model_path`` (zero weights,
   bf16) is loaded by a pool on ``--gpus`` with ``weights`` ``replicated`` and then ``sharded``
   (world size 1: the FSDP machinery without the gathers' traffic), and one MODEL-path forward
   (cond + uncond batch of 2, 126 audio and 1,024 text tokens) is timed per size (``--shapes``:
   6,144 and 24,576 video tokens): median of ``--runs`` after ``--warmup``; the pool's GPU memory
   after each load (its status). ``overhead = sharded / replicated - 1``.
2. **Measured**: the GPU's host link (pinned ``copy_`` of 1 GiB host -> device and back): the
   path NCCL takes between consumer GPUs without peer-to-peer (through host memory).
3. **On paper**: seconds per step of LTX-2.3 22B (bf16 weights in the pool; fp8 files are upcast
   at load) at 6,144 and 24,576 video tokens on 2 and 4 PCIe 4.0 x16 cards of 24 GB, from the
   measured step (scaled to 22B by the parameter count and to the card by its dense bf16 tensor
   rate), the per-step weight gathers (the whole model once per forward, ring all-gather:
   ``(N - 1) / N x bytes / link``) and Ulysses' all-to-alls (per block q, k, v and the output of
   video self-attention, k and v of video->audio attention: ``(N - 1) / N x bytes / link``),
   communication not overlapped with compute (an upper bound), and which configurations fit
   24 GB (the fit check's arithmetic, ``ltx_mgpu.denoise.parallel.fsdp.WeightPlan``). The constants
   and their sources are in :data:`CARDS` and :data:`PCIE4_X16`. With ``--on-paper-from`` the
   table is recomputed from a saved result without a GPU, and ``--fp8-from`` (``bench_fp8``'s
   result) adds the rows of a sharded **fp8 file** (every block linear e4m3: one byte held and
   gathered, plus the per-call upcast ``bench_fp8`` measured, scaled by memory bandwidth)::

       python benchmarks/bench_sharded.py --on-paper-from benchmarks/results/sharded_h200.json \
           --fp8-from benchmarks/results/fp8_h200_6k_static.json --out benchmarks/results/sharded_on_paper_fp8.json

``--device cpu`` with small sizes is the smoke test (no on-paper part).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
from ltx_core.model.transformer import LTXModelConfigurator

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.bench_model_path import time_forward, write_shaped_checkpoint  # noqa: E402
from benchmarks.bench_sp import add_model_arguments, transformer_config  # noqa: E402
from benchmarks.timing import write_json  # noqa: E402
from ltx_mgpu.client.denoise import remote_load_transformer  # noqa: E402
from ltx_mgpu.client.model import PoolModel  # noqa: E402
from ltx_mgpu.client.pool_client import PoolClient  # noqa: E402
from ltx_mgpu.denoise.checkpoint import CONNECTORS, inspect_checkpoint  # noqa: E402
from ltx_mgpu.denoise.fp8 import fp8_weight  # noqa: E402
from ltx_mgpu.denoise.parallel.fsdp import HEADROOM, weight_plan  # noqa: E402
from ltx_mgpu.denoise.plan import TransformerPlan

#: Dense bf16 tensor-core rates (FP32 accumulate), TFLOP/s, memory, GiB, and memory bandwidth, GB/s.
#: Sources: NVIDIA H200 Tensor Core GPU datasheet (989 dense, "1,979 with sparsity"; 4.8 TB/s); NVIDIA
#: Ada GPU architecture whitepaper, Table "RTX 4090" (165.2 FP16/BF16 with FP32 accumulate, dense;
#: 1,008 GB/s); NVIDIA Ampere GA102 GPU architecture whitepaper, RTX 3090 (71 dense; 936 GB/s).
CARDS = {"H200": (989.0, 141, 4800.0), "RTX 4090": (165.2, 24, 1008.0), "RTX 3090": (71.0, 24, 936.0)}
#: PCIe 4.0 x16: 16 GT/s x 16 lanes x 128b/130b = 31.5 GB/s per direction (PCI-SIG PCIe 4.0 base
#: specification); the achieved share is taken from the host link measured here.
PCIE4_X16 = 31.5e9
#: LTX-2.3 22B / the 19B-shaped model: scale of parameters (and so of linear FLOPs and bytes).
SCALE_22B = 22.0 / 19.0


def host_link(device: torch.device, nbytes: int = 1 << 30, runs: int = 5) -> dict:
    """Pinned host <-> device copy bandwidth (bytes/s), median of ``runs``."""
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    dev = torch.empty(nbytes, dtype=torch.uint8, device=device)
    out = {}
    for name, (dst, src) in {"host_to_device": (dev, host), "device_to_host": (host, dev)}.items():
        dst.copy_(src, non_blocking=True)
        torch.cuda.synchronize(device)
        times = []
        for _ in range(runs):
            t0 = time.perf_counter()
            dst.copy_(src, non_blocking=True)
            torch.cuda.synchronize(device)
            times.append(time.perf_counter() - t0)
        out[name] = nbytes / statistics.median(times)
    return out


def on_paper(results: dict, plans: dict, link_share: float, a, upcast_s: float | None = None) -> list[dict]:
    """The table of part 3 (module doc), from the measured replicated step times.

    ``plans``: ``{"bf16": WeightPlan, "fp8": WeightPlan}`` (fp8: the block linears at one byte, as
    a sharded fp8 file is held); ``upcast_s``: the H200's measured cost of upcasting the e4m3
    weights once per forward (``bench_fp8``'s ``fp8-storage`` minus ``bf16``), scaled to a card by
    the parameter count and its memory bandwidth (the upcast is memory-bound); without it only
    bf16 rows."""
    rows = []
    hidden = a.video_heads * a.video_head_dim
    for card, (tflops, mem_gib, bandwidth) in CARDS.items():
        if card == "H200":
            continue
        link = PCIE4_X16 * link_share
        for fmt, plan in plans.items():
            if fmt == "fp8" and upcast_s is None:
                continue
            weights_22b = (plan.blocks + plan.root) * SCALE_22B
            upcast = 0.0 if fmt == "bf16" else upcast_s * SCALE_22B * CARDS["H200"][2] / bandwidth
            for world in (2, 4):
                scaled = dataclasses.replace(plan, world=world)
                need_rep = scaled.per_rank("replicated") * SCALE_22B
                need_sh = scaled.per_rank("sharded") * SCALE_22B
                room = mem_gib * 2**30 * (1 - HEADROOM)
                for tokens, row in results["sizes"].items():
                    compute = row["replicated_ms"] / 1e3 * SCALE_22B * (CARDS["H200"][0] / tflops) / world
                    gather = (world - 1) / world * weights_22b / link
                    a2a = (world - 1) / world * int(tokens) * 2 * hidden * 2 * 6 * a.layers / link
                    rows.append({"card": card, "gpus": world, "video_tokens": int(tokens), "weights_file": fmt,
                                 "fits_replicated": need_rep <= room if fmt == "bf16" else None,
                                 "fits_sharded": need_sh <= room,
                                 "gib_per_gpu_replicated": need_rep / 2**30 if fmt == "bf16" else None,
                                 "gib_per_gpu_sharded": need_sh / 2**30,
                                 "compute_s": compute, "upcast_s": upcast, "gather_s": gather, "all_to_all_s": a2a,
                                 "sharded_s_per_step": compute + upcast + gather + a2a,
                                 "replicated_s_per_step": compute + a2a if fmt == "bf16" else None})
    return rows


def plans_of(shapes: dict) -> dict:
    """The bf16 and the sharded-fp8-file :class:`WeightPlan` of a checkpoint's DiT ``shapes``
    (every block linear stored e4m3 in the latter, ``ltx_mgpu.denoise.fp8.fp8_weight``)."""
    def e4m3(key: str) -> int | None:
        return math.prod(shapes[key]) if fp8_weight(key, shapes[key], compute=False) else None

    return {"bf16": weight_plan(shapes, 2, 1, CONNECTORS), "fp8": weight_plan(shapes, 2, 1, CONNECTORS, e4m3)}


def print_on_paper(rows: list[dict]) -> None:
    for r in rows:
        rep = (f"fits replicated {r['fits_replicated']} ({r['gib_per_gpu_replicated']:.1f} GiB), "
               if r["weights_file"] == "bf16" else "")
        print(f"{r['card']} x{r['gpus']} {r['weights_file']} file {r['video_tokens']:>6} tokens: {rep}sharded "
              f"{r['fits_sharded']} ({r['gib_per_gpu_sharded']:.1f} GiB); sharded {r['sharded_s_per_step']:.2f} s/step "
              f"(compute {r['compute_s']:.2f}, upcast {r['upcast_s']:.2f}, gathers {r['gather_s']:.2f}, all-to-all "
              f"{r['all_to_all_s']:.2f})", flush=True)


def recompute(a) -> int:
    """``--on-paper-from``: the on-paper table again from a saved run (no GPU), with the fp8 rows
    when ``--fp8-from`` gives ``bench_fp8``'s result (its ``fp8-storage`` and ``bf16`` at 6,144)."""
    results = json.loads(Path(a.on_paper_from).read_text())
    upcast_s = None
    if a.fp8_from:
        fp8 = json.loads(Path(a.fp8_from).read_text())
        size = fp8["sizes"]["16x16x24"]
        upcast_s = (size["variants"]["fp8-storage"]["ms"] - size["bf16_ms"]) / 1e3
    with torch.device("meta"):  # the shapes from the config alone (the shaped file needs a 38 GB map)
        model = LTXModelConfigurator.from_config({"transformer": results["config"]})
    plans = plans_of({k: tuple(v.shape) for k, v in model.state_dict().items()})
    results["on_paper"] = on_paper(results, plans, results["link_share_of_theoretical"], a, upcast_s)
    results["fp8_upcast_s_per_forward_h200"] = upcast_s
    print_on_paper(results["on_paper"])
    if a.out:
        write_json(a.out, results)
    return 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_model_arguments(ap)
    ap.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    ap.add_argument("--gpus", default="0")
    ap.add_argument("--nproc", type=int, default=1, help="CPU ranks (--device cpu)")
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--runs", type=int, default=7)
    ap.add_argument("--on-paper-from", help="recompute the on-paper table from this saved result (no GPU)")
    ap.add_argument("--fp8-from", help="with --on-paper-from: bench_fp8's result, for the fp8-file rows")
    ap.add_argument("--out")
    a = ap.parse_args(argv)
    if a.on_paper_from:
        return recompute(a)
    device = torch.device("cuda:0" if a.device == "cuda" else "cpu")
    dtype = torch.bfloat16 if a.device == "cuda" else torch.float32
    work = Path(tempfile.mkdtemp(prefix="lm-shard-", dir="/tmp"))
    config = transformer_config(a)
    checkpoint = str(work / "ltx2-19b-shaped.safetensors")
    results: dict = {"config": config["transformer"], "sizes": {},
                     "device": torch.cuda.get_device_name(0) if a.device == "cuda" else "cpu",
                     "checkpoint_bytes": write_shaped_checkpoint(checkpoint, config, dtype)}
    info = inspect_checkpoint(checkpoint)
    plan = weight_plan(info.shapes, dtype.itemsize, 1, CONNECTORS)
    results["weights_bytes"] = plan.blocks + plan.root + plan.connectors
    client = PoolClient.connect(gpus=a.gpus if a.device == "cuda" else "cpu",
                                nproc=a.nproc if a.device == "cpu" else None, runtime_dir=work / "rt",
                                lifetime="with-owner", startup_timeout=300)
    try:
        for weights in ("replicated", "sharded"):
            t0 = time.perf_counter()
            plan = TransformerPlan(checkpoint, dtype="bf16" if a.device == "cuda" else "fp32", max_tokens=1 << 17,
                                   weights=weights)
            loaded = remote_load_transformer(client, plan, name=weights, timeout=1800)
            results[f"{weights}_load_s"] = time.perf_counter() - t0
            results[f"{weights}_bytes_per_rank"] = loaded["bytes"]
            results[f"{weights}_pool_memory"] = [r.get("memory") for r in client.status().get("ranks", [])]
            print(f"{weights}: loaded in {results[f'{weights}_load_s']:.1f} s, "
                  f"{loaded['bytes'] / 2**30:.2f} GiB per rank", flush=True)
            width = sum(loaded["context_widths"])
            pm = PoolModel(lambda: client, lambda: None, weights, key=loaded["key"])
            for text in a.shapes.split(","):
                tokens, median, times, out = time_forward(pm, text, a, width, device, dtype)
                row = results["sizes"].setdefault(str(tokens), {})
                row[f"{weights}_ms"], row[f"{weights}_runs_ms"] = median, times
                print(f"{weights}: {tokens:>6} video tokens {median:8.1f} ms per forward", flush=True)
            client.request("unload", {"names": [weights]}, timeout=300)
        for row in results["sizes"].values():
            row["overhead"] = row["sharded_ms"] / row["replicated_ms"] - 1.0
            print(f"sharded vs replicated: {100 * row['overhead']:+.2f} %", flush=True)
        if a.device == "cuda":
            results["host_link"] = host_link(device)
            share = min(results["host_link"].values()) / 64e9  # the H200's PCIe 5.0 x16: 64 GB/s per direction
            results["link_share_of_theoretical"] = share
            results["on_paper"] = on_paper(results, plans_of(info.shapes), share, a)
            print_on_paper(results["on_paper"])
        if a.out:
            write_json(a.out, results)
    finally:
        client.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
