"""Packed weights (GGUF's GGML blocks, an fp8 file's e4m3) against bf16: the forward step, the
dequant kernels' bandwidth, the memory, and what they would give on consumer GPUs.

Run on one GPU (the issue's numbers come from one H200)::

    python benchmarks/bench_packed.py --out benchmarks/results/packed_h200.json

1. **Measured**, the 19B-shaped LTX-2 transformer of ``bench_sp`` (random bf16 weights,
   ``bench_sp.build_model``), one cond + uncond forward (batch 2, 126 audio and 1,024 text tokens)
   per size (``--shapes``: 6,144 and 24,576 video tokens), median of ``--runs`` after
   ``--warmup``, the variants in turn on the same model, its block linears swapped in place:

   * ``bf16``: ltx-core's eager forward (timed first and again last: the spread of a repeat);
   * ``Q8_0``: every block linear quantized to Q8_0 on the GPU (an fp16 scale per 32 values,
     ``round(w / d)`` with ``d = max|w| / 127``: llama.cpp's quantizer), held as
     :class:`~ltx_mgpu.quantized.packed.PackedLinear` (what a GGUF file loads as), dequantized
     per call by the kernel (:mod:`ltx_mgpu.quantized.kernels`);
   * ``Q4_K``: the same layers as random valid Q4_K blocks (no quantizer at hand: the timing does
     not depend on the values; no error is reported for it);
   * ``nvfp4``, ``mxfp8``, ``int8``, ``int8_convrot``: every block linear in ComfyUI's nvfp4, mxfp8, int8 (a scale
     per tensor) or int8 with ConvRot (group 256, a scale per row: Kijai's ``int8_convrot``
     files), quantized on the GPU by comfy-kitchen (``ltx_mgpu.quantized.encode``) and held as
     packed rows (``ltx_mgpu.quantized.rows``), dequantized per call by the kernels;
   * ``fp8-upcast``: the block linears as e4m3 with a scale per row, upcast per call
     (``Float8Linear``, ``compute="upcast"``: a sharded fp8 file), by the kernel;
   * ``Q8_0-lora384``: ``Q8_0`` with a rank-384 LoRA on every block linear (the size of LTX-2's
     distilled LoRA), added in float32 to each dequantized weight per call
     (:class:`~ltx_mgpu.quantized.packed.LoraDelta`, what a LoRA on a GGUF file costs).

   Per variant: the median, ``ratio = variant / bf16``, the relative error of the velocities
   against bf16 (all but the random Q4_K), the weights' bytes and the peak GPU memory of the
   forward, and what one rank of 2 and of 4 would hold sharded (FSDP2: a 1/N shard of every
   weight and two blocks gathered whole; ``ltx_mgpu.denoise.parallel.fsdp.weight_plan``).
2. **Measured**: one dequant launch on the largest block linear (``ff.net.2``: 4,096 x 16,384),
   median of 50, and its effective bandwidth (packed bytes read + bf16 bytes written per second)
   as a share of the GPU's (``bench_sharded.CARDS``); the eager torch dequant of the same weight
   for comparison.
3. **On paper**, as ``bench_sharded`` does: LTX-2.3 22B in Q4_K_S (taken as Q4_K's 4.5 bits per
   value), Q8_0, int8 ConvRot, nvfp4 and bf16 on 2 x 16 GB, 2 x 24 GB and 4 x 16 GB PCIe 4.0
   cards, replicated and
   sharded: fits?, GiB per card, seconds per step at both sizes, from the measured bf16 step
   (scaled to the card's bf16 rate), the dequant time per forward (every block linear's packed
   bytes read and bf16 written at the kernel's measured bandwidth of part 2, scaled by the card's
   memory bandwidth, or, for ConvRot, by the card's tensor rate where that is slower: its
   ``q @ H`` is 512 FLOP per value; the step differences of part 1 are within the run's noise), the gathers of
   the packed bytes and Ulysses' all-to-alls over the link (``--link-share``: the share of PCIe
   4.0 x16 the host link achieved in ``sharded_h200.json``), not overlapped (an upper bound).
   ``--on-paper-from`` recomputes it from a saved result without a GPU.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.bench_sharded import CARDS, PCIE4_X16, SCALE_22B  # noqa: E402
from benchmarks.bench_sp import add_model_arguments, build_model, make_inputs, modalities, transformer_config  # noqa: E402
from benchmarks.timing import time_ms, warm_gpu, write_json  # noqa: E402
from ltx_mgpu.denoise.checkpoint import CONNECTORS  # noqa: E402
from ltx_mgpu.denoise.fp8 import Float8Linear, fp8_weight  # noqa: E402
from ltx_mgpu.denoise.parallel.fsdp import HEADROOM, weight_plan  # noqa: E402
from ltx_mgpu.denoise.plan import Fp8Config  # noqa: E402
from ltx_mgpu.quantized import kernels, rows  # noqa: E402
from ltx_mgpu.quantized.encode import quantize_layer  # noqa: E402
from ltx_mgpu.quantized.ggml import BLOCK_SHAPES, dequantize  # noqa: E402
from ltx_mgpu.quantized.layers import LayerQuant  # noqa: E402
from ltx_mgpu.quantized.packed import LoraDelta, PackedLinear, dequantize_rows  # noqa: E402

#: Consumer cards of 16 GB for the on-paper part, as ``bench_sharded.CARDS``: dense bf16 tensor
#: TFLOP/s with FP32 accumulate, GiB, GB/s. Source: NVIDIA Ada GPU architecture whitepaper, RTX 4080
#: (97.5 with FP32 accumulate, dense; 716.8 GB/s) and RTX 4060 Ti 16 GB (44.1; 288 GB/s).
CARDS_16GB = {"RTX 4080": (97.5, 16, 716.8), "RTX 4060 Ti 16GB": (44.1, 16, 288.0)}
#: Bytes per value held for each format of the on-paper part (GGML block sizes; Q4_K_S is mostly Q4_K;
#: int8: a byte and a float32 scale per row of 4,096 or more; nvfp4: half a byte and an e4m3 scale per 16).
BYTES_PER_VALUE = {"bf16": 2.0, "Q8_0": 34 / 32, "Q4_K_S": 144 / 256, "int8_convrot": 1 + 4 / 4096, "nvfp4": 9 / 16}
#: The kernel of part 2 each on-paper format dequantizes with.
PAPER_KERNELS = {"bf16": None, "Q8_0": "Q8_0", "Q4_K_S": "Q4_K", "int8_convrot": "int8_convrot", "nvfp4": "nvfp4"}
#: ComfyUI's formats the bench holds as packed rows: name -> the layer's ``LayerQuant``.
COMFY_FORMATS = {"nvfp4": LayerQuant("nvfp4"), "mxfp8": LayerQuant("mxfp8"), "int8": LayerQuant("int8_tensorwise"),
                 "int8_convrot": LayerQuant("int8_tensorwise", 256)}
#: ConvRot's group and the FLOP its ``q @ H`` costs per value (a multiply-add per group column).
CONVROT_GROUP = 256
CONVROT_FLOP_PER_VALUE = 2 * CONVROT_GROUP
#: The setups of the on-paper part: (card, GPUs).
SETUPS = (("RTX 4080", 2), ("RTX 4090", 2), ("RTX 4080", 4), ("RTX 4060 Ti 16GB", 4))


def q8_0_blocks(w: torch.Tensor) -> torch.Tensor:
    """``w`` ``[out, in]`` as Q8_0 bytes ``[out, in / 32 * 34]`` (llama.cpp's ``quantize_row_q8_0``:
    ``d = max|x| / 127`` per 32 values, ``q = round(x / d)``), computed on ``w``'s device."""
    out, cols = w.shape
    x = w.float().reshape(out, cols // 32, 32)
    d = x.abs().amax(-1, keepdim=True) / 127.0
    q = torch.where(d > 0, x / d, torch.zeros_like(x)).round().clamp(-127, 127).to(torch.int8)
    head = d.to(torch.float16).view(torch.uint8).reshape(out, cols // 32, 2)
    return torch.cat([head, q.view(torch.uint8)], dim=-1).reshape(out, -1).contiguous()


def random_k_blocks(qtype: str, out: int, cols: int, device, seed: int) -> torch.Tensor:
    """Random ``qtype`` K-quant blocks on ``device``; for Q4_K / Q5_K valid ones whose fp16 ``d``
    and ``dmin`` (bytes 0-3) keep the values within about 0.06, as a trained weight's."""
    block, size = BLOCK_SHAPES[qtype]
    g = torch.Generator(device=device).manual_seed(seed)
    raw = torch.randint(0, 256, (out * (cols // block), size), generator=g, device=device, dtype=torch.uint8)
    scale = torch.full((raw.shape[0], 1), 4e-6, device=device).to(torch.float16).view(torch.uint8)
    raw[:, 0:2] = scale.reshape(-1, 2)
    raw[:, 2:4] = scale.reshape(-1, 2)
    return raw.reshape(out, -1)


def block_linears(model) -> list[str]:
    """The names of the blocks' 2-D linears (what a GGUF converter quantizes)."""
    return [n for n, m in model.named_modules() if type(m) is torch.nn.Linear and n.startswith("transformer_blocks.")]


def swap(model, names, make, originals: dict) -> None:
    """Replace each linear ``names`` by ``make(linear, i)``, keeping the originals to restore."""
    for i, name in enumerate(names):
        parent, _, child = name.rpartition(".")
        holder = model.get_submodule(parent)
        old = originals.setdefault(name, getattr(holder, child))
        setattr(holder, child, make(old, i))


def restore(model, originals: dict) -> None:
    for name, old in originals.items():
        parent, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent), child, old)


def packed_linear(qtype: str, device):
    def make(old: torch.nn.Linear, i: int) -> PackedLinear:
        layer = PackedLinear(old.in_features, old.out_features, old.bias is not None, old.weight.dtype, qtype,
                             device=device)
        data = (q8_0_blocks(old.weight) if qtype == "Q8_0" else
                random_k_blocks(qtype, old.out_features, old.in_features, device, i))
        with torch.no_grad():
            layer.packed().copy_(data)
            if old.bias is not None:
                layer.bias.copy_(old.bias)
        return layer
    return make


def comfy_rows(weight: torch.Tensor, quant: LayerQuant):
    """``weight`` in ComfyUI's ``quant`` (comfy-kitchen's quantizer, on its device) as packed rows:
    ``(rows, tensor_scale, column_scale)`` (:func:`ltx_mgpu.quantized.rows.pack_rows`). comfy-kitchen's
    Triton backend is turned off first: its nvfp4 quantizer emits Blackwell's e2m1 conversion, which
    ptxas refuses for Hopper; the eager one computes the same format with torch's operations."""
    import comfy_kitchen  # deferred: only the ComfyUI formats need it

    comfy_kitchen.disable_backend("triton")
    parts = quantize_layer(weight.float(), quant)
    return rows.pack_rows(quant, parts, tuple(weight.shape))


def comfy_linear(fmt: str, device):
    quant = COMFY_FORMATS[fmt]

    def make(old: torch.nn.Linear, i: int) -> PackedLinear:  # noqa: ARG001 - swap's signature
        layer = PackedLinear(old.in_features, old.out_features, old.bias is not None, old.weight.dtype,
                             quant.describe(), device=device)
        with torch.no_grad():
            layer.set_packed(*comfy_rows(old.weight, quant))
            if old.bias is not None:
                layer.bias.copy_(old.bias)
        return layer
    return make


def fp8_linear(old: torch.nn.Linear, i: int) -> Float8Linear:  # noqa: ARG001 - swap's signature
    layer = Float8Linear(old.in_features, old.out_features, old.bias is not None, old.weight.dtype,
                         Fp8Config("upcast"), device=old.weight.device)
    with torch.no_grad():
        layer.set_weight(old.weight)
        if old.bias is not None:
            layer.bias.copy_(old.bias)
    return layer


def sharded_per_rank(model, world: int) -> int:
    """What one of ``world`` ranks would hold of ``model`` as it is now, sharded: FSDP2's 1/N of every
    weight plus two blocks gathered whole (``weight_plan``, each parameter at its held bytes)."""
    held = {n: p.numel() * p.element_size() for n, p in model.named_parameters()}
    shapes = {n: tuple(p.shape) for n, p in model.named_parameters()}
    plan = weight_plan(shapes, 2, world, CONNECTORS, lambda key: held[key])
    return int(plan.per_rank("sharded"))


def weight_bytes(model) -> int:
    return int(sum(t.numel() * t.element_size() for t in [*model.parameters(), *model.buffers()]))


def kernel_bandwidth(device, dtype, peak_gb_per_s: float) -> dict:
    """Part 2 (module doc); ``peak_gb_per_s``: the GPU's memory bandwidth."""
    out, cols = 4096, 16384
    w = torch.randn(out, cols, device=device, dtype=dtype) * cols ** -0.5
    rows_ = {}
    for qtype in ("Q8_0", "Q4_K", "Q6_K", "Q5_K"):
        data = q8_0_blocks(w) if qtype == "Q8_0" else random_k_blocks(qtype, out, cols, device, 0)
        dst = torch.empty(out, cols, dtype=dtype, device=device)
        ms = time_ms(device, lambda d=data, q=qtype, o=dst: kernels.dequantize_ggml(d, q, o), 5, 50)[0]
        eager = time_ms(device, lambda d=data, q=qtype: dequantize(d, q, (out, cols)).to(dtype), 2, 10)[0]
        moved = data.numel() + dst.numel() * dst.element_size()
        rows_[qtype] = {"kernel_ms": ms, "eager_torch_ms": eager, "bytes": moved, "gb_per_s": moved / ms / 1e6,
                       "share_of_peak": moved / ms / 1e6 / peak_gb_per_s}
    for fmt, quant in COMFY_FORMATS.items():
        packed, tensor_scale, column_scale = comfy_rows(w, quant)
        qtype = quant.describe()
        ms = time_ms(device, lambda p=packed, q=qtype, t=tensor_scale: dequantize_rows(p, q, cols, dtype, (), None, t),
                     5, 50)[0]
        eager = time_ms(device, lambda p=packed, q=qtype, t=tensor_scale: rows.dequantize(p, q, cols, dtype, t), 2,
                        10)[0]
        moved = packed.numel() + out * cols * 2
        rows_[fmt] = {"kernel_ms": ms, "eager_torch_ms": eager, "bytes": moved, "gb_per_s": moved / ms / 1e6,
                      "share_of_peak": moved / ms / 1e6 / peak_gb_per_s}
        if fmt == "int8_convrot":
            rows_[fmt]["tflops"] = out * cols * CONVROT_FLOP_PER_VALUE / ms / 1e9
    e4m3 = (w.float() / 2).to(torch.float8_e4m3fn)
    s = torch.ones(out, device=device)
    ms = time_ms(device, lambda: kernels.upcast_e4m3(e4m3, s, dtype), 5, 50)[0]
    eager = time_ms(device, lambda: (e4m3.float() * s[:, None]).to(dtype), 2, 10)[0]
    moved = e4m3.numel() + s.numel() * 4 + out * cols * 2
    rows_["e4m3"] = {"kernel_ms": ms, "eager_torch_ms": eager, "bytes": moved, "gb_per_s": moved / ms / 1e6,
                    "share_of_peak": moved / ms / 1e6 / peak_gb_per_s}
    return rows_


def on_paper(res: dict, link_share: float) -> list[dict]:
    """Part 3 (module doc), from a result of parts 1 and 2."""
    cards = {**CARDS, **CARDS_16GB}
    shapes = {k: tuple(v) for k, v in res["shapes"].items()}
    a = res["geometry"]
    hidden = a["video_heads"] * a["video_head_dim"]
    rows = []
    for fmt, per_value in BYTES_PER_VALUE.items():
        def stored(key: str, pv=per_value) -> int | None:
            return int(math.prod(shapes[key]) * pv) if fp8_weight(key, shapes[key], compute=False) else None

        plan = weight_plan(shapes, 2, 1, CONNECTORS, stored)
        kernel = PAPER_KERNELS[fmt]
        if kernel is not None and kernel not in res["kernels"]:
            continue  # a saved result from before the format was measured
        values = sum(math.prod(v) for k, v in shapes.items() if fp8_weight(k, v, compute=False))
        dequant_h200 = (0.0 if kernel is None else
                        values * (per_value + 2) * SCALE_22B / (res["kernels"][kernel]["gb_per_s"] * 1e9))
        for card, world in SETUPS:
            tflops, mem_gib, bandwidth = cards[card]
            scaled = dataclasses.replace(plan, world=world)
            room = mem_gib * 2**30 * (1 - HEADROOM)
            link = PCIE4_X16 * link_share
            for size in res["sizes"].values():
                compute = size["bf16_ms"] / 1e3 * SCALE_22B * (CARDS["H200"][0] / tflops) / world
                dequant = dequant_h200 * CARDS["H200"][2] / bandwidth
                if kernel == "int8_convrot":  # q @ H on the tensor cores: the card's rate where it is slower
                    dequant = max(dequant, dequant_h200 * CARDS["H200"][0] / tflops)
                a2a = (world - 1) / world * size["tokens"] * 2 * hidden * 2 * 6 * a["layers"] / link
                gather = (world - 1) / world * (plan.blocks + plan.root) * SCALE_22B / link
                for weights in ("replicated", "sharded"):
                    need = scaled.per_rank(weights) * SCALE_22B
                    step = compute + dequant + a2a + (gather if weights == "sharded" else 0.0)
                    rows.append({"format": fmt, "card": card, "gpus": world, "weights": weights,
                                 "video_tokens": size["tokens"], "fits": need <= room, "gib_per_gpu": need / 2**30,
                                 "compute_s": compute, "dequant_s": dequant, "gather_s": gather if weights == "sharded"
                                 else 0.0, "all_to_all_s": a2a, "s_per_step": step})
    return rows


def print_kernels(rows: dict) -> None:
    for q, r in rows.items():
        print(f"dequant {q} 4096x16384: {r['kernel_ms']:.3f} ms ({r['gb_per_s']:.0f} GB/s, "
              f"{r['share_of_peak']:.0%} of the H200's peak); eager torch {r['eager_torch_ms']:.3f} ms", flush=True)


def print_on_paper(rows: list[dict]) -> None:
    for r in rows:
        print(f"{r['format']:7s} {r['gpus']} x {r['card']:17s} {r['weights']:10s} {r['video_tokens']:6d} tokens: "
              f"{'fits' if r['fits'] else 'does not fit'} ({r['gib_per_gpu']:.1f} GiB/GPU), ~{r['s_per_step']:.2f} "
              f"s/step (compute {r['compute_s']:.2f}, dequant {r['dequant_s']:.2f}, gathers {r['gather_s']:.2f}, "
              f"all-to-all {r['all_to_all_s']:.2f})")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cuda")
    add_model_arguments(ap)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--variants", default="Q8_0,Q4_K,nvfp4,mxfp8,int8,int8_convrot,fp8-upcast,Q8_0-lora384")
    ap.add_argument("--link-share", type=float, default=None,
                    help="share of PCIe 4.0 x16 the host link achieves (default: from sharded_h200.json)")
    ap.add_argument("--on-paper-from", default=None, help="recompute part 3 from a saved result, without a GPU")
    ap.add_argument("--kernels-only", action="store_true", help="part 2 alone: the dequant kernels' bandwidth")
    ap.add_argument("--out", default=None)
    a = ap.parse_args(argv)
    share = a.link_share
    if share is None:
        saved = Path(__file__).resolve().parent / "results" / "sharded_h200.json"
        link = json.loads(saved.read_text())["host_link"]
        share = min(link.values()) / 64e9  # measured on PCIe 5.0 x16 (64 GB/s), applied to PCIe 4.0's rate
    if a.on_paper_from:
        res = json.loads(Path(a.on_paper_from).read_text())
        res["on_paper"] = on_paper(res, share)
        print_on_paper(res["on_paper"])
        if a.out:
            write_json(a.out, res)
        return 0
    device = torch.device(a.device)
    if device.type != "cuda" or not kernels.available(device):
        print("bench_packed needs a CUDA GPU with Triton (the packed kernels)", file=sys.stderr)
        return 2
    device = torch.device("cuda", device.index if device.index is not None else torch.cuda.current_device())
    torch.cuda.set_device(device)
    dtype = torch.bfloat16
    if a.kernels_only:
        warm_gpu(device)
        res = {"device": torch.cuda.get_device_name(device), "torch": torch.__version__,
               "kernels": kernel_bandwidth(device, dtype, CARDS["H200"][2])}
        print_kernels(res["kernels"])
        if a.out:
            write_json(a.out, res)
        return 0
    config = transformer_config(a)
    model = build_model(config, device, dtype)
    shapes = {n: tuple(p.shape) for n, p in model.named_parameters()}
    res = {"device": torch.cuda.get_device_name(device), "torch": torch.__version__, "config": config["transformer"],
           "geometry": {"layers": a.layers, "video_heads": a.video_heads, "video_head_dim": a.video_head_dim},
           "shapes": {k: list(v) for k, v in shapes.items()}, "bf16_bytes": weight_bytes(model), "sizes": {},
           "link_share": share}
    warm_gpu(device)
    sizes = [tuple(int(x) for x in s.split("x")) for s in a.shapes.split(",")]
    inputs = {}
    for shape in sizes:
        _, state, ctxs = make_inputs(shape, a.audio_tokens, a.text_tokens, a.caption_channels, device, dtype)
        inputs[shape] = modalities(state, torch.cat(ctxs), device, dtype)

    def forward(shape):
        v, au = inputs[shape]
        with torch.no_grad():
            return model(video=v, audio=au, perturbations=None)

    def rel(x, y):
        return float((x.float() - y.float()).norm() / y.float().norm())

    refs = {}
    for shape in sizes:
        key = "x".join(map(str, shape))
        torch.cuda.reset_peak_memory_stats(device)
        ms = time_ms(device, lambda s=shape: forward(s), a.warmup, a.runs)[0]
        refs[shape] = [t.float() for t in forward(shape)]
        res["sizes"][key] = {"tokens": math.prod(shape), "bf16_ms": ms, "bf16_peak_bytes":
                             torch.cuda.max_memory_allocated(device), "variants": {}}
        print(f"{key}: bf16 {ms:.1f} ms", flush=True)
    names = block_linears(model)
    for variant in [v for v in a.variants.split(",") if v]:
        originals: dict = {}
        make = (fp8_linear if variant == "fp8-upcast" else comfy_linear(variant, device) if variant in COMFY_FORMATS
                else packed_linear(variant.split("-")[0], device))
        swap(model, names, make, originals)
        if variant.endswith("-lora384"):
            g = torch.Generator(device=device).manual_seed(7)
            for name in names:
                layer = model.get_submodule(name)
                up = torch.randn(layer.out_features, 384, device=device, dtype=dtype, generator=g) * 1e-3
                down = torch.randn(384, layer.in_features, device=device, dtype=dtype, generator=g) * 1e-3
                layer.loras = (LoraDelta(up, down, 1.0),)
        held = weight_bytes(model)  # the originals are out of the model, kept aside to restore
        for shape in sizes:
            key = "x".join(map(str, shape))
            torch.cuda.reset_peak_memory_stats(device)
            ms = time_ms(device, lambda s=shape: forward(s), a.warmup, a.runs)[0]
            out = forward(shape)
            row = {"ms": ms, "ratio": ms / res["sizes"][key]["bf16_ms"], "weight_bytes": held,
                   "peak_bytes": torch.cuda.max_memory_allocated(device),
                   "sharded_bytes_per_rank": {str(w): sharded_per_rank(model, w) for w in (2, 4)}}
            if variant != "Q4_K":
                row["rel_error_video"], row["rel_error_audio"] = (rel(o, r) for o, r in zip(out, refs[shape]))
            res["sizes"][key]["variants"][variant] = row
            print(f"{key}: {variant} {ms:.1f} ms ({row['ratio']:.3f}x bf16), weights {held / 2**30:.1f} GiB",
                  flush=True)
        restore(model, originals)
        del originals
        torch.cuda.empty_cache()
        if a.out:
            write_json(a.out, res)
    for shape in sizes:
        key = "x".join(map(str, shape))
        res["sizes"][key]["bf16_again_ms"] = time_ms(device, lambda s=shape: forward(s), a.warmup, a.runs)[0]
        print(f"{key}: bf16 again {res['sizes'][key]['bf16_again_ms']:.1f} ms", flush=True)
    res["kernels"] = kernel_bandwidth(device, dtype, CARDS["H200"][2])
    print_kernels(res["kernels"])
    res["on_paper"] = on_paper(res, share)
    print_on_paper(res["on_paper"])
    if a.out:
        write_json(a.out, res)
    return 0


if __name__ == "__main__":
    sys.exit(main())
