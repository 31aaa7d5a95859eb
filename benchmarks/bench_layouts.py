"""The call layouts against pure Ulysses: one model call of a batch of guidance passes.

A pool of ``--nproc`` CPU ranks (or ``--gpus``) loads a header-only LTX-2-shaped checkpoint
(``bench_model_path.write_shaped_checkpoint``; the shape from ``bench_sp``'s options, zero
weights) once per layout of ``--layouts`` (``ltx_mgpu.choices.SP_LAYOUTS``; ``ulysses`` first, the
baseline) and times ``PoolModel.forward`` on a batch of ``--batch`` passes (2: the cond + uncond
call per step of ComfyUI's sampler; 3: DualCFGGuider or CFG with a perturbed pass; 4: a batch of
two latents with CFG): median of ``--runs`` after ``--warmup``, per size (``--shapes``). Which
layout each call takes is ``ltx_mgpu.denoise.parallel.layout.call_layout``'s::

    python benchmarks/bench_layouts.py --device cpu --nproc 2 --layers 4 --video-heads 8 --video-head-dim 64 \\
        --audio-heads 8 --audio-head-dim 32 --caption-channels 512 --shapes 4x8x12 --text-tokens 128 \\
        --out benchmarks/results/layouts_cpu.json
    python benchmarks/bench_layouts.py --device cuda --gpus 0,1,2,3 --batch 4 --layouts ulysses,auto

The JSON keeps ``<layout>_ms`` per size, ``speedup`` (ulysses over cfg_ulysses, when both ran) and
``<layout>_speedup`` (ulysses over each other layout).
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.bench_model_path import time_forward, write_shaped_checkpoint  # noqa: E402
from benchmarks.bench_sp import add_model_arguments, transformer_config  # noqa: E402
from benchmarks.timing import write_json  # noqa: E402
from ltx_mgpu.client.denoise import remote_load_transformer  # noqa: E402
from ltx_mgpu.client.model import PoolModel  # noqa: E402
from ltx_mgpu.client.pool_client import PoolClient  # noqa: E402
from ltx_mgpu.denoise.plan import TransformerPlan


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_model_arguments(ap)
    ap.add_argument("--device", default="cpu", choices=("cuda", "cpu"))
    ap.add_argument("--gpus", default="0,1")
    ap.add_argument("--nproc", type=int, default=2)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--runs", type=int, default=7)
    ap.add_argument("--batch", type=int, default=2, help="guidance passes in the call")
    ap.add_argument("--layouts", default="ulysses,cfg_ulysses", help="comma-separated; ulysses is the baseline")
    ap.add_argument("--out")
    a = ap.parse_args(argv)
    device = torch.device("cuda:0" if a.device == "cuda" else "cpu")
    dtype = torch.bfloat16 if a.device == "cuda" else torch.float32
    work = Path(tempfile.mkdtemp(prefix="lm-layout-", dir="/tmp"))
    config = transformer_config(a)
    checkpoint = str(work / "shaped.safetensors")
    write_shaped_checkpoint(checkpoint, config, dtype)
    layouts = list(dict.fromkeys(["ulysses", *a.layouts.split(",")]))
    results: dict = {"config": config["transformer"], "sizes": {}, "batch": a.batch,
                     "ranks": a.nproc if a.device == "cpu" else a.gpus}
    client = PoolClient.connect(gpus=a.gpus if a.device == "cuda" else "cpu",
                                nproc=a.nproc if a.device == "cpu" else None, runtime_dir=work / "rt",
                                lifetime="with-owner", startup_timeout=300)
    try:
        for layout in layouts:
            plan = TransformerPlan(checkpoint, dtype="bf16" if a.device == "cuda" else "fp32", max_tokens=1 << 17,
                                   layout=layout)
            loaded = remote_load_transformer(client, plan, name=layout, timeout=1800)
            width = sum(loaded["context_widths"])
            pm = PoolModel(lambda: client, lambda: None, layout, key=loaded["key"])
            for text in a.shapes.split(","):
                tokens, median, times, out = time_forward(pm, text, a, width, device, dtype)
                row = results["sizes"].setdefault(str(tokens), {})
                row[f"{layout}_ms"], row[f"{layout}_runs_ms"] = median, times
                row.setdefault("outputs", {})[layout] = out
                print(f"{layout:>11}: {tokens:>6} video tokens {median:8.1f} ms per call", flush=True)
            client.request("unload", {"names": [layout]}, timeout=300)
        for row in results["sizes"].values():
            outs = row.pop("outputs")
            for layout in layouts[1:]:
                # zero weights: the outputs carry no signal (parity is tests/integration/test_cfg_parallel.py's)
                diff = max(float((p - q).abs().max()) for p, q in zip(outs[layout], outs["ulysses"]))
                row[f"{layout}_max_abs_diff"] = diff
                row[f"{layout}_speedup"] = row["ulysses_ms"] / row[f"{layout}_ms"]
                print(f"{layout} vs ulysses: {row[f'{layout}_speedup']:.2f}x (outputs within {diff:.1e})", flush=True)
            if "cfg_ulysses_speedup" in row:
                row["speedup"], row["max_abs_diff"] = row["cfg_ulysses_speedup"], row["cfg_ulysses_max_abs_diff"]
        if a.out:
            write_json(a.out, results)
    finally:
        client.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
