"""FP8 transformer compute against bf16: the step, each step of the way, and the error.

Run on one FP8 GPU (the issue's numbers come from one H200)::

    python benchmarks/bench_fp8.py --out benchmarks/results/fp8_h200.json

Model: the **19B-shaped** LTX-2 transformer of ``bench_sp`` (48 layers, video 32 x 128, audio
32 x 64, LTX-2.0 layout), random weights (``bench_sp.build_model``: seeded, N(0, 1/fan_in)),
bf16. Per size (``--shapes``: 6,144 and 24,576 video tokens; 126 audio and 1,024 text tokens)
one forward of the cond + uncond batch (2), timed with CUDA events, median of ``--runs`` after
``--warmup`` (the first calls of a compiled variant compile and are not timed), the variants in
turn on the same model (its linears swapped in place, :mod:`ltx_mgpu.denoise.fp8`):

* ``bf16``: ltx-core's eager forward (timed first and again last: the spread of a repeat);
* ``bf16-compiled``: the same with every block's forward under ``torch.compile``
  (:func:`~ltx_mgpu.denoise.fp8.compile_blocks`);
* ``fp8-naive``: the block linears as e4m3 GEMMs (``torch._scaled_mm``, rowwise scales: per
  token x per output channel), eager: the activation quantisation as separate kernels, the
  bias added after the GEMM;
* ``fp8-fused``: the same under ``torch.compile``: the quantisation fused into the kernels that
  produce the activations, bias still separate;
* ``fp8-row``: + the bias in the GEMM's epilogue (the shipped ``dtype: fp8``);
* ``fp8-row-exact-accum``: without cuBLASLt's fast accumulation;
* ``fp8-tensor``: per-tensor scales (cuBLASLt's tensorwise kernel), compiled, bias in the epilogue;
* ``fp8-storage``: fp8 weights upcast to bf16 per call (``compute="upcast"``, eager): what an fp8
  checkpoint computed in bf16 gives (its error is the weights' rounding alone).
* ``<variant>+triton_8bit``: the variant with our 8-bit Triton attention
  (``attention_type triton_8bit``, :mod:`ltx_mgpu.denoise.attention`) in every attention module
  instead of SDPA; ``bf16+triton_8bit``: the bf16 eager forward with it (the attention's own
  share of speed and error); ``<variant>+triton_8bit:<qk>-<pv>``: with the kernel's other formats
  (``int8-16bit``, ``e4m3-e4m3``, ``e4m3-16bit``; the default is ``int8-e4m3``).

Attention runs in bf16 (SDPA) in every variant but the ``+triton_8bit`` ones. Per variant: the
median, ``speedup = bf16 / variant``, and the relative error ``|v - v_bf16| / |v_bf16|`` (Frobenius, video and audio
velocities, float32) against the bf16 eager forward on the same inputs. ``--sample-shape``: a
20-step Euler sample with CFG 3 from the same noise, each of ``--sample-variants`` (default
fp8-row and fp8-row+triton_8bit, eager) vs bf16, relative error of the final latent.
``--profile``: the kernel-time breakdown (GEMMs, attention, the rest) of fp8-row and of
fp8-row+triton_8bit at the last size. The GEMM shapes alone (``--gemms``): bf16 ``mm`` vs ``_scaled_mm`` (row / tensor)
at LTX-2's linear shapes. Quality on real weights is not measured here.

``--device cpu`` is refused (FP8 needs FP8 tensor cores): ``ltx_mgpu.denoise.fp8.fp8_support_error``.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.bench_sp import (  # noqa: E402
    ATTENTION_KERNELS,
    add_model_arguments,
    build_model,
    make_inputs,
    modalities,
    profiled_self_times,
    transformer_config,
)
from benchmarks.timing import time_ms, warm_gpu, write_json  # noqa: E402
from ltx_mgpu.denoise.attention.function import (  # noqa: E402
    TRITON_8BIT,
    TritonAttention,
    attention_function,
    install,
    support_error,
)
from ltx_mgpu.denoise.fp8 import Float8Linear, compile_blocks, fp8_support_error, swap_linears  # noqa: E402
from ltx_mgpu.denoise.plan import Fp8Config  # noqa: E402

VARIANTS = {
    "fp8-naive": (Fp8Config("fp8", "row", bias_epilogue=False), False),
    "fp8-fused": (Fp8Config("fp8", "row", bias_epilogue=False), True),
    "fp8-row": (Fp8Config("fp8", "row"), True),
    "fp8-row-exact-accum": (Fp8Config("fp8", "row", fast_accum=False), True),
    "fp8-tensor": (Fp8Config("fp8", "tensor"), True),
    "fp8-storage": (Fp8Config("upcast"), False),
}
#: The suffix of a variant run with our 8-bit attention (``<variant>+triton_8bit``; ``bf16+...``: eager bf16).
WITH_8BIT = "+" + TRITON_8BIT
DEFAULT_VARIANTS = ("bf16-compiled", *VARIANTS, "bf16" + WITH_8BIT, "fp8-row" + WITH_8BIT)


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.float(), b.float()
    return float((a - b).norm() / b.norm())


def uncompile(model) -> None:
    for block in model.transformer_blocks:
        block.__dict__.pop("forward", None)
    torch._dynamo.reset()


def set_fp8(model, originals: dict, config: Fp8Config) -> None:
    """Install the model's fp8 linears (swapped on the first call, the bf16 ones kept in
    ``originals``: name -> (bf16 module, fp8 module)) configured for ``config``."""
    if not originals:
        bf16 = {n: m for n, m in model.named_modules() if type(m) is torch.nn.Linear}
        for name in swap_linears(model, config):
            originals[name] = (bf16[name], model.get_submodule(name))
        return
    for name, (old, new) in originals.items():
        parent, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent), child, new)
        tensor_changed = (new.config.scaling == "tensor") != (config.scaling == "tensor")
        new.config = config  # before set_weight: the scaling decides the weight's scales
        if tensor_changed:
            new.set_weight(old.weight)


def restore_bf16(model, originals: dict) -> None:
    for name, (old, _) in originals.items():
        parent, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent), child, old)


def gemm_table(device, dtype) -> list[dict]:
    """bf16 ``mm`` vs FP8 ``_scaled_mm`` (without activation quantisation) at LTX-2's shapes."""
    rows = []
    for m, k, n in [(12288, 4096, 4096), (12288, 4096, 16384), (12288, 16384, 4096),
                    (49152, 4096, 4096), (49152, 4096, 16384), (49152, 16384, 4096)]:
        a = torch.randn(m, k, device=device, dtype=dtype)
        w = torch.randn(n, k, device=device, dtype=dtype) / k ** 0.5
        bias = torch.randn(n, device=device, dtype=dtype)
        aq, wq = a.to(torch.float8_e4m3fn), w.to(torch.float8_e4m3fn)
        one = torch.ones((), device=device)
        sa, sb = torch.ones(m, 1, device=device), torch.ones(1, n, device=device)
        fns = {
            "bf16": lambda: torch.nn.functional.linear(a, w, bias),
            "fp8_tensor": lambda: torch._scaled_mm(aq, wq.t(), one, one, bias=bias, out_dtype=dtype,
                                                   use_fast_accum=True),
            "fp8_row": lambda: torch._scaled_mm(aq, wq.t(), sa, sb, bias=bias, out_dtype=dtype, use_fast_accum=True),
            "fp8_row_no_bias": lambda: torch._scaled_mm(aq, wq.t(), sa, sb, out_dtype=dtype, use_fast_accum=True),
        }
        row = {"m": m, "k": k, "n": n}
        for name, fn in fns.items():
            row[name + "_ms"] = time_ms(device, fn, 5, 20)[0]
        row["tflops_bf16"] = 2 * m * k * n / row["bf16_ms"] / 1e9
        rows.append(row)
        print(f"gemm {m}x{k}x{n}: " + ", ".join(f"{k_}={v:.3f}" for k_, v in row.items() if k_.endswith("_ms")),
              flush=True)
    return rows


def kernel_breakdown(fn, device) -> dict:
    """Milliseconds of GPU kernel time of one call of ``fn`` by kind: GEMMs, attention, the rest."""
    out = {"gemm": 0.0, "attention": 0.0, "other": 0.0}
    top = []
    for k, t in profiled_self_times(fn, device):
        low = k.lower()
        kind = ("attention" if any(x in low for x in ATTENTION_KERNELS) else
                "gemm" if any(x in low for x in ("gemm", "cutlass", "sm90", "nvjet", "scaled_mm", "xmma")) else "other")
        out[kind] += t / 1e3
        top.append((round(t / 1e3, 2), k[:90]))
    out["top"] = sorted(top, reverse=True)[:12]
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cuda")
    add_model_arguments(ap)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--variants", default=",".join(DEFAULT_VARIANTS),
                    help=f"comma-separated; any of {', '.join(VARIANTS)} or bf16-compiled, '{WITH_8BIT}' appended "
                         "for our 8-bit attention (bf16+triton_8bit: eager bf16 with it), ':<qk>-<pv>' after it "
                         "for its other formats (int8-16bit, e4m3-e4m3, e4m3-16bit)")
    ap.add_argument("--gemms", action="store_true", help="also time the GEMM shapes alone")
    ap.add_argument("--sample-shape", default="8x12x16", help="latent FxHxW of the 20-step sample ('' to skip)")
    ap.add_argument("--sample-steps", type=int, default=20)
    ap.add_argument("--sample-variants", default="fp8-row,fp8-row" + WITH_8BIT,
                    help="the variants sampled against bf16 (eager)")
    ap.add_argument("--static", action="store_true", help="compile one graph per token count (dynamic=False)")
    ap.add_argument("--profile", action="store_true", help="kernel-time breakdown of fp8-row at the last size")
    ap.add_argument("--out", default=None)
    a = ap.parse_args(argv)
    device = torch.device(a.device)
    if (err := fp8_support_error(device)) is not None:
        print(err, file=sys.stderr)
        return 2
    device = torch.device("cuda", device.index if device.index is not None else torch.cuda.current_device())
    torch.cuda.set_device(device)
    wants_8bit = WITH_8BIT in a.variants + a.sample_variants
    if wants_8bit and (err := support_error(device)) is not None:
        print(err, file=sys.stderr)
        return 2
    dtype = torch.bfloat16
    config = transformer_config(a)
    model = build_model(config, device, dtype)
    res = {"device": torch.cuda.get_device_name(device), "torch": torch.__version__, "config": config["transformer"],
           "params": sum(p.numel() for p in model.parameters()), "sizes": {}, "compile_seconds": {}}
    warm_gpu(device)
    if a.gemms:
        res["gemms"] = gemm_table(device, dtype)
    shapes = [tuple(int(x) for x in s.split("x")) for s in a.shapes.split(",")]
    inputs = {}
    for shape in shapes:
        _, state, ctxs = make_inputs(shape, a.audio_tokens, a.text_tokens, a.caption_channels, device, dtype)
        inputs[shape] = modalities(state, torch.cat(ctxs), device, dtype)

    def forward(shape):
        v, au = inputs[shape]
        with torch.no_grad():
            return model(video=v, audio=au, perturbations=None)

    refs = {}
    for shape in shapes:
        key = "x".join(map(str, shape))
        ms = time_ms(device, lambda: forward(shape), a.warmup, a.runs)[0]
        refs[shape] = [t.float() for t in forward(shape)]
        res["sizes"][key] = {"tokens": shape[0] * shape[1] * shape[2], "bf16_ms": ms, "variants": {}}
        print(f"{key}: bf16 {ms:.1f} ms", flush=True)

    def run_variant(name: str) -> None:
        for shape in shapes:
            key = "x".join(map(str, shape))
            t0 = time.perf_counter()
            out = forward(shape)
            torch.cuda.synchronize(device)
            first = time.perf_counter() - t0
            ms = time_ms(device, lambda: forward(shape), a.warmup, a.runs)[0]
            errs = [rel(o, r) for o, r in zip(out, refs[shape])]
            s = res["sizes"][key]
            s["variants"][name] = {"ms": ms, "speedup": s["bf16_ms"] / ms, "rel_error_video": errs[0],
                                   "rel_error_audio": errs[1], "first_call_s": first}
            print(f"{key}: {name} {ms:.1f} ms ({s['bf16_ms'] / ms:.3f}x), error video {errs[0]:.4f} audio "
                  f"{errs[1]:.4f}, first call {first:.1f} s", flush=True)
        if a.profile and name.startswith("fp8-row") and name.removeprefix("fp8-row")[:1] in ("", "+"):
            key = "profile_" + name.replace("-", "_").replace("+", "_").replace(":", "_")
            res[key] = kernel_breakdown(lambda: forward(shapes[-1]), device)
            print(f"profile {name} {shapes[-1]}: {res[key]}", flush=True)

    originals: dict = {}
    sdpa = attention_function(config["transformer"]["attention_type"])

    def set_variant(name: str) -> bool:
        """Install variant ``name`` (linears and attention); whether it runs compiled."""
        base, _, formats = name.partition(WITH_8BIT)
        if base == name:
            install(model, sdpa)
        else:
            install(model, TritonAttention(*formats.removeprefix(":").split("-")) if formats else
                    attention_function(TRITON_8BIT))
        if base in ("bf16-compiled", "bf16"):
            restore_bf16(model, originals)
            return base == "bf16-compiled"
        cfg, compile_on = VARIANTS[base]
        set_fp8(model, originals, cfg)
        res["fp8_linears"] = sum(isinstance(m, Float8Linear) for m in model.modules())
        return compile_on

    for name in [v for v in a.variants.split(",") if v]:
        compile_on = set_variant(name)
        if compile_on:
            compile_blocks(model, dynamic=False if a.static else None)
        try:
            run_variant(name)
        except Exception as e:  # noqa: BLE001 - report and go on with the next variant
            print(f"{name} failed: {type(e).__name__}: {str(e).splitlines()[0][:300]}", flush=True)
            res.setdefault("failed", {})[name] = f"{type(e).__name__}: {str(e)[:2000]}"
        if compile_on:
            uncompile(model)
        if a.out:
            write_json(a.out, res)

    restore_bf16(model, originals)
    install(model, sdpa)
    for shape in shapes:  # bf16 again: the spread of a repeat
        key = "x".join(map(str, shape))
        res["sizes"][key]["bf16_again_ms"] = time_ms(device, lambda: forward(shape), a.warmup, a.runs)[0]
        print(f"{key}: bf16 again {res['sizes'][key]['bf16_again_ms']:.1f} ms", flush=True)

    if a.sample_shape:
        shape = tuple(int(x) for x in a.sample_shape.split("x"))
        _, state, ctxs = make_inputs(shape, a.audio_tokens, a.text_tokens, a.caption_channels, device, dtype)
        v0, a0 = modalities(state, torch.cat(ctxs), device, dtype)
        sigmas = torch.linspace(1.0, 0.0, a.sample_steps + 1, device=device)

        def sample() -> list[torch.Tensor]:
            import dataclasses as dc
            xs = [v0.latent[:1].float(), a0.latent[:1].float()]
            for i in range(a.sample_steps):
                s0, s1 = sigmas[i], sigmas[i + 1]
                mods = []
                for m, x in zip((v0, a0), xs):
                    ts = torch.full_like(m.timesteps, float(s0))
                    mods.append(dc.replace(m, latent=x.to(dtype).repeat(2, 1, 1), timesteps=ts, sigma=ts[:, 0]))
                with torch.no_grad():
                    outs = model(video=mods[0], audio=mods[1], perturbations=None)
                xs = [x + (s1 - s0) * (o[1:].float() + 3.0 * (o[:1].float() - o[1:].float()))
                      for x, o in zip(xs, outs)]
            return xs

        ref = sample()
        for name in [v for v in a.sample_variants.split(",") if v]:
            try:
                set_variant(name)  # eager: the blocks were uncompiled after the timed variants
                got = sample()
            except Exception as e:  # noqa: BLE001 - report and go on with the next variant
                print(f"sample {name} failed: {type(e).__name__}: {str(e).splitlines()[0][:300]}", flush=True)
                res.setdefault("failed", {})["sample " + name] = f"{type(e).__name__}: {str(e)[:2000]}"
                continue
            row = {"shape": a.sample_shape, "steps": a.sample_steps, "cfg": 3.0,
                   "rel_error_video": rel(got[0], ref[0]), "rel_error_audio": rel(got[1], ref[1])}
            if name == "fp8-row":
                res["sample"] = row  # the key of the earlier results
            res.setdefault("samples", {})[name] = row
            print(f"sample {a.sample_shape}, {a.sample_steps} steps: {name} vs bf16 relative error video "
                  f"{row['rel_error_video']:.4f} audio {row['rel_error_audio']:.4f}", flush=True)
    if a.out:
        write_json(a.out, res)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
