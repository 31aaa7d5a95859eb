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
   24 GB (the fit check's arithmetic, ``ltx_mgpu.denoise.sharding.WeightPlan``). The constants
   and their sources are in :data:`CARDS` and :data:`PCIE4_X16`.

``--device cpu`` with small sizes is the smoke test (no on-paper part).
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.bench_model_path import time_forward, write_shaped_checkpoint  # noqa: E402
from benchmarks.bench_sp import add_model_arguments, transformer_config  # noqa: E402
from benchmarks.timing import write_json  # noqa: E402
from ltx_mgpu.client.denoise import remote_load_transformer  # noqa: E402
from ltx_mgpu.client.model import PoolModel  # noqa: E402
from ltx_mgpu.client.pool_client import PoolClient  # noqa: E402
from ltx_mgpu.denoise.checkpoint import CONNECTORS, inspect_checkpoint  # noqa: E402
from ltx_mgpu.denoise.sharding import HEADROOM, weight_plan  # noqa: E402

#: Dense bf16 tensor-core rates (FP32 accumulate), TFLOP/s, and memory, GiB. Sources: NVIDIA H200
#: Tensor Core GPU datasheet (989 dense, "1,979 with sparsity"); NVIDIA Ada GPU architecture
#: whitepaper, Table "RTX 4090" (165.2 FP16/BF16 with FP32 accumulate, dense); NVIDIA Ampere GA102
#: GPU architecture whitepaper, RTX 3090 (71 dense).
CARDS = {"H200": (989.0, 141), "RTX 4090": (165.2, 24), "RTX 3090": (71.0, 24)}
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


def on_paper(results: dict, plan, link_share: float, a) -> list[dict]:
    """The table of part 3 (module doc), from the measured replicated step times."""
    rows = []
    hidden = a.video_heads * a.video_head_dim
    weights_22b = (plan.blocks + plan.root) * SCALE_22B
    for card, (tflops, mem_gib) in CARDS.items():
        if card == "H200":
            continue
        link = PCIE4_X16 * link_share
        for world in (2, 4):
            scaled = dataclasses.replace(plan, world=world)
            need_rep = scaled.per_rank("replicated") * SCALE_22B
            need_sh = scaled.per_rank("sharded") * SCALE_22B
            room = mem_gib * 2**30 * (1 - HEADROOM)
            for tokens, row in results["sizes"].items():
                compute = row["replicated_ms"] / 1e3 * SCALE_22B * (CARDS["H200"][0] / tflops) / world
                gather = (world - 1) / world * weights_22b / link
                a2a = (world - 1) / world * int(tokens) * 2 * hidden * 2 * 6 * a.layers / link
                rows.append({"card": card, "gpus": world, "video_tokens": int(tokens),
                             "fits_replicated": need_rep <= room, "fits_sharded": need_sh <= room,
                             "gib_per_gpu_replicated": need_rep / 2**30, "gib_per_gpu_sharded": need_sh / 2**30,
                             "compute_s": compute, "gather_s": gather, "all_to_all_s": a2a,
                             "sharded_s_per_step": compute + gather + a2a,
                             "replicated_s_per_step": compute + a2a})
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_model_arguments(ap)
    ap.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    ap.add_argument("--gpus", default="0")
    ap.add_argument("--nproc", type=int, default=1, help="CPU ranks (--device cpu)")
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--runs", type=int, default=7)
    ap.add_argument("--out")
    a = ap.parse_args(argv)
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
            loaded = remote_load_transformer(client, checkpoint, dtype="bf16" if a.device == "cuda" else "fp32",
                                             max_tokens=1 << 17, weights=weights, name=weights, timeout=1800)
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
            results["on_paper"] = on_paper(results, plan, share, a)
            for r in results["on_paper"]:
                print(f"{r['card']} x{r['gpus']} {r['video_tokens']:>6} tokens: fits replicated "
                      f"{r['fits_replicated']} ({r['gib_per_gpu_replicated']:.1f} GiB), sharded {r['fits_sharded']} "
                      f"({r['gib_per_gpu_sharded']:.1f} GiB); sharded {r['sharded_s_per_step']:.2f} s/step "
                      f"(compute {r['compute_s']:.2f}, gathers {r['gather_s']:.2f}, all-to-all "
                      f"{r['all_to_all_s']:.2f})", flush=True)
        if a.out:
            write_json(a.out, results)
    finally:
        client.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
