"""Dequantizing ComfyUI's quantized layers on a GPU and on the CPU (``ltx_mgpu.quantized.dequant``).

One Gemma 3 12B decoder layer's seven projections (q 4096x3840, k/v 2048x3840, o 3840x4096,
gate/up 15360x3840, down 3840x15360; random weights, std 0.02) are written in each readable format
(``ltx_mgpu.quantized.encode``), then dequantized into bf16 and fp32 on the CPU and on the GPU:

* ``equal``: the GPU's weights equal the CPU's bit for bit (the same eager code on both devices);
* ``gpu_ms`` / ``cpu_ms``: the median time to dequantize the whole layer (bf16 out), so a 48-layer
  12B file takes about 48 times that at load.

Usage: ``python benchmarks/quant_dequant_device.py [--out FILE.json] [--runs 5]`` (needs CUDA for
the GPU columns; without it only the CPU is timed).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from ltx_mgpu.quantized.dequant import dequantize  # noqa: E402
from ltx_mgpu.quantized.encode import quantize_layer  # noqa: E402
from ltx_mgpu.quantized.layers import LayerQuant  # noqa: E402

SHAPES = {"q_proj": (4096, 3840), "k_proj": (2048, 3840), "v_proj": (2048, 3840), "o_proj": (3840, 4096),
          "gate_proj": (15360, 3840), "up_proj": (15360, 3840), "down_proj": (3840, 15360)}
FORMATS = {"nvfp4": LayerQuant("nvfp4"), "float8_e4m3fn": LayerQuant("float8_e4m3fn"),
           "int8_tensorwise": LayerQuant("int8_tensorwise"),
           "int8_tensorwise+convrot256": LayerQuant("int8_tensorwise", convrot_groupsize=256)}


def _time(fn, runs: int, cuda: bool) -> float:
    times = []
    for _ in range(runs):
        if cuda:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        if cuda:
            torch.cuda.synchronize()
        times.append((time.perf_counter() - t0) * 1e3)
    return round(statistics.median(times), 2)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--runs", type=int, default=5)
    args = parser.parse_args()
    cuda = torch.cuda.is_available()
    g = torch.Generator().manual_seed(0)
    weights = {n: (torch.randn(s, generator=g) * 0.02).to(torch.bfloat16) for n, s in SHAPES.items()}
    rows = []
    for fmt, quant in FORMATS.items():
        stored = {n: quantize_layer(w, quant) for n, w in weights.items()}
        row = {"format": fmt, "layer_mb": round(sum(t.numel() * t.element_size() for p in stored.values()
                                                   for t in p.values()) / 2**20, 1)}
        if cuda:
            on_gpu = {n: {k: v.cuda() for k, v in p.items()} for n, p in stored.items()}
            row["equal"] = all(
                torch.equal(dequantize(quant, stored[n], dt, SHAPES[n]),
                            dequantize(quant, on_gpu[n], dt, SHAPES[n]).cpu())
                for n in SHAPES for dt in (torch.bfloat16, torch.float32))
            row["gpu_ms"] = _time(lambda: [dequantize(quant, on_gpu[n], torch.bfloat16, SHAPES[n]) for n in SHAPES],
                                  args.runs, True)
        row["cpu_ms"] = _time(lambda: [dequantize(quant, stored[n], torch.bfloat16, SHAPES[n]) for n in SHAPES],
                              max(1, args.runs // 2), False)
        rows.append(row)
        print(json.dumps(row), flush=True)
    result = {"device": torch.cuda.get_device_name(0) if cuda else "cpu", "cpu_threads": torch.get_num_threads(),
              "torch": torch.__version__, "rows": rows}
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
