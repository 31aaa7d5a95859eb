"""Attention kernels at LTX-2's shapes against cuDNN bf16 SDPA: speed and error, one run.

Run on one GPU (the lead's command)::

    python benchmarks/bench_attention.py --out benchmarks/results/attention_h200.json

Shapes (LTX-2 19B, ltx-core 1.0.0's ``LTXModelConfig``): video self-attention 32 heads x 128 over
6,144 and 24,576 tokens, audio self-attention 32 x 64 over 126 tokens (a 5 s clip), video
cross-attention to 1,024 text tokens, audio-to-video cross-attention (126 queries, 24,576 keys,
32 x 64), all at batch 2 (a CFG pair). Inputs: q and k are RMS-normalized (as ltx-core's
``q_norm`` / ``k_norm`` leave them, times a gain of 1.5 so that the softmax is peaked as in
a trained model), v standard normal.

Kernels, each where it imports and runs (a failure is recorded with its message, not fatal):

- ``sdpa``: ``torch.nn.functional.scaled_dot_product_attention`` in bf16 with torch's own choice
  of backend (what ltx-core's ``PytorchAttention`` calls).
- ``sdpa-cudnn`` / ``sdpa-flash``: the same, its backend forced.
- ``sage``: ``sageattention.sageattn`` 1.0.6 (Triton; INT8 Q and K per block, fp16 P V).
- ``fa4``: ``flash_attn.cute.flash_attn_func`` (flash-attn-4), where the package is present.
- ``triton-8bit``: ours, ``ltx_mgpu.denoise.attention.kernel.attend_heads`` (what ``attention_type
  triton_8bit`` runs: int8 Q K^T, e4m3 P V, the configuration of ``CONFIGS``), its K / V
  quantization included; ``triton-8bit-<qk>-<pv>``: its other formats (e4m3 Q K^T, 16-bit P V);
  ``triton-8bit-tma``: K and V tiles read through TMA descriptors (the head dim 128 configuration
  otherwise; ``Config.tma``); ``...-fastacc``: the e4m3 P V accumulated on the tensor cores across
  key blocks (``Config.fast_accum``: fewer instructions; the MMA's truncations can add up over
  many keys). ``--sweep``: also every configuration of ``SWEEP`` with the default formats
  (``triton-8bit@<block_m>x<block_n>w<warps>s<stages>[tma]``), to choose ``CONFIGS`` from.

Per kernel and shape: the median ms of ``--runs`` timed calls (CUDA events), TFLOP/s counted as
4 x B x H x Tq x Tk x D, and the max and mean relative error of its output against float32 SDPA
on the same inputs (``|out - ref| / mean(|ref|)``), beside bf16 SDPA's own error for scale.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from benchmarks.timing import time_ms, warm_gpu, write_json  # noqa: E402

#: (name, batch, heads, query tokens, key tokens, head dim)
SHAPES = (
    ("video self 6144", 2, 32, 6144, 6144, 128),
    ("video self 24576", 2, 32, 24576, 24576, 128),
    ("video cross text", 2, 32, 24576, 1024, 128),
    ("audio self", 2, 32, 126, 126, 64),
    ("audio to video", 2, 32, 126, 24576, 64),
)


def _inputs(b: int, h: int, tq: int, tk: int, d: int, device: torch.device, seed: int = 0):
    g = torch.Generator(device=device).manual_seed(seed)

    def normed(t: int) -> torch.Tensor:
        x = torch.randn(b, h, t, d, device=device, generator=g)
        return 1.5 * x / x.pow(2).mean(-1, keepdim=True).sqrt()

    q, k = normed(tq), normed(tk)
    v = torch.randn(b, h, tk, d, device=device, generator=g)
    return q, k, v


#: Launch configurations ``--sweep`` times: (block_m, block_n, warps, stages).
#: (block_m, block_n, warps, stages, tma).
SWEEP = ((128, 128, 8, 2, False), (128, 128, 8, 3, False), (128, 128, 8, 4, False), (128, 64, 8, 3, False),
         (128, 64, 4, 3, False), (64, 128, 4, 3, False), (64, 64, 4, 3, False), (128, 128, 4, 2, False),
         (128, 128, 8, 2, True), (128, 128, 8, 3, True), (128, 128, 8, 4, True), (128, 64, 8, 3, True),
         (64, 128, 4, 3, True))


def ours(sweep: bool = False) -> dict:
    """Our 8-bit kernel's candidates (name -> fn(q, k, v) on [B, H, T, D]), or the reason it cannot run."""
    from ltx_mgpu.denoise.attention import kernel

    if not kernel.available("cuda"):
        return {"triton-8bit": "Triton or a CUDA device is missing"}

    def make(qk, pv, config=None):
        def fn(q, k, v):
            return kernel.attend_heads(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), qk=qk, pv=pv,
                                       config=config).transpose(1, 2)
        return fn

    out = {"triton-8bit": make("int8", "e4m3"),
           "triton-8bit-tma": make("int8", "e4m3", kernel.CONFIGS[128]._replace(tma=True)),
           "triton-8bit-fastacc": make("int8", "e4m3", kernel.CONFIGS[128]._replace(fast_accum=True)),
           "triton-8bit-tma-fastacc": make("int8", "e4m3", kernel.CONFIGS[128]._replace(tma=True, fast_accum=True))}
    for qk in kernel.QK_FORMATS:
        for pv in kernel.PV_FORMATS:
            if (qk, pv) != ("int8", "e4m3"):
                out[f"triton-8bit-{qk}-{pv}"] = make(qk, pv)
    if sweep:
        for m, n, w, st, tma in SWEEP:
            out[f"triton-8bit@{m}x{n}w{w}s{st}{'tma' if tma else ''}"] = make("int8", "e4m3",
                                                                             kernel.Config(m, n, w, st, tma))
    return out


def kernels(sweep: bool = False) -> dict:
    """name -> fn(q, k, v) on [B, H, T, D] bf16, or name -> the reason it cannot run."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    sdpa = torch.nn.functional.scaled_dot_product_attention
    out: dict = {"sdpa": sdpa}

    def forced(backend):
        def fn(q, k, v):
            with sdpa_kernel([backend]):
                return sdpa(q, k, v)
        return fn

    out["sdpa-cudnn"] = forced(SDPBackend.CUDNN_ATTENTION)
    out["sdpa-flash"] = forced(SDPBackend.FLASH_ATTENTION)
    try:
        from sageattention import sageattn

        out["sage"] = lambda q, k, v: sageattn(q, k, v, tensor_layout="HND", is_causal=False)
    except Exception as e:  # noqa: BLE001 - recorded, not fatal
        out["sage"] = f"{type(e).__name__}: {e}"
    try:
        from flash_attn.cute import flash_attn_func

        def fa4(q, k, v):
            o = flash_attn_func(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2))
            o = o[0] if isinstance(o, tuple) else o
            return o.transpose(1, 2)

        out["fa4"] = fa4
    except Exception as e:  # noqa: BLE001 - recorded, not fatal
        out["fa4"] = f"{type(e).__name__}: {e}"
    out.update(ours(sweep))
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--runs", type=int, default=20)
    ap.add_argument("--sweep", action="store_true", help="also time our kernel's launch configurations (SWEEP)")
    ap.add_argument("--only", default="", help="comma-separated kernel names to time (default: all)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    device = torch.device(args.device)
    fns = kernels(args.sweep)
    if args.only:
        fns = {k: v for k, v in fns.items() if k in args.only.split(",") or k == "sdpa"}
    results: dict = {"device": torch.cuda.get_device_name(device), "torch": torch.__version__, "shapes": {},
                     "unavailable": {k: v for k, v in fns.items() if isinstance(v, str)}}
    for k, v in results["unavailable"].items():
        print(f"{k}: unavailable ({v})", flush=True)
    warm_gpu(device)
    for name, b, h, tq, tk, d in SHAPES:
        q32, k32, v32 = _inputs(b, h, tq, tk, d, device)
        ref = torch.nn.functional.scaled_dot_product_attention(q32, k32, v32)
        scale = ref.abs().mean()
        q, k, v = (t.to(torch.bfloat16).contiguous() for t in (q32, k32, v32))
        row: dict = {"batch": b, "heads": h, "query_tokens": tq, "key_tokens": tk, "head_dim": d}
        flops = 4 * b * h * tq * tk * d
        for kname, fn in fns.items():
            if isinstance(fn, str):
                continue
            try:
                out = fn(q, k, v)
                err = (out.float() - ref).abs()
                ms, times = time_ms(device, lambda fn=fn, q=q, k=k, v=v: fn(q, k, v), args.warmup, args.runs)
                row[kname] = {"ms": ms, "tflops": flops / ms / 1e9, "max_rel_error": float(err.max() / scale),
                              "mean_rel_error": float(err.mean() / scale), "times_ms": times}
                print(f"{name:>18} {kname:>11}: {ms:8.3f} ms {flops / ms / 1e9:7.1f} TFLOP/s "
                      f"err max {row[kname]['max_rel_error']:.2e} mean {row[kname]['mean_rel_error']:.2e}",
                      flush=True)
            except Exception as e:  # noqa: BLE001 - recorded, not fatal
                row[kname] = {"error": f"{type(e).__name__}: {str(e)[:300]}"}
                print(f"{name:>18} {kname:>11}: failed ({row[kname]['error']})", flush=True)
        base = row.get("sdpa", {}).get("ms")
        if base:
            row["speedup_vs_sdpa"] = {k: base / r["ms"] for k, r in row.items()
                                      if isinstance(r, dict) and "ms" in r}
        results["shapes"][name] = row
        del q32, k32, v32, ref, q, k, v
        torch.cuda.empty_cache()
    if args.out:
        write_json(args.out, results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
