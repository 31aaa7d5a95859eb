"""One model call of ComfyUI's own LTX-2.3 model against the pool's, in one process on one device:
where the time of the MODEL path's transformer differs from ComfyUI's (the pool's round trip is
``bench_model_path``'s; the two together are ``bench_easycache``'s ``none`` rows).

Run with ComfyUI's Python (or the slice of ``docs/benchmarks.md``, "EasyCache on a GPU"),
``COMFYUI_DIR`` = the checkout, from the repository root::

    COMFYUI_DIR=... python benchmarks/profile_comfy_model.py --device cuda --random-layers 8 \\
        --random-heads 32 --random-head-dim 128 --random-audio-heads 32 --random-audio-head-dim 64 \\
        --latent 16x16x24 --audio-tokens 126 --text-tokens 1024 --out benchmarks/results/comfy_model_h200.json

Both load the same checkpoint (``bench_easycache.write_random_checkpoint``'s random LTX-2.3 weights
in ``--dtype``, deleted at exit): ComfyUI's through ``comfy.sd.load_checkpoint_guess_config`` on the
device, ours through ``load_ltx_model`` (what a pool rank loads; world size 1). One call each on
the same inputs, as ComfyUI's sampler makes it for CFG: ``[video, audio]`` of the cond + uncond
batch (2) in the model dtype, one sigma per sample, the processed text context. Variants:

* ``comfy``: ``LTXAVModel.forward(x, (t, t), context, None, frame_rate=25)``;
* ``ours``: :func:`~ltx_mgpu.denoise.comfyui.forward.comfy_forward` on the velocity model a pool
  rank calls (``velocity_model()``), the sigmas as ComfyUI gives them (``[B]``);
* ``ours_per_token``: the same with the sigmas given per token (``[B, T]``, all equal), which makes
  ltx-core compute the AdaLN modulation per token (what every call did before one timestep per
  sample was passed as ``[B, 1]``);
* ``ours_compiled`` (``--compile``): ``ours`` with the blocks under ``torch.compile`` (as
  ``dtype: fp8`` runs them), after one compiling call.

Per variant: the median of ``--runs`` (device events, after ``--warmup``) and, with ``--profile``,
the kernel time by kernel (``torch.profiler``, one call; operators on a CPU), the top ``--top``. ``rel_to_comfy``:
the max relative difference of each velocity to ComfyUI's (``|a - b|.norm() / |b|.norm()``).
"""

from __future__ import annotations

import argparse
import atexit
import os
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def kernel_table(fn, device, top: int) -> list[dict]:
    """The kernels (GPU) or operators (CPU) of one call of ``fn`` by self time
    (``bench_sp.profiled_self_times``), the largest ``top`` first, after a ``(total)`` row; ms."""
    from benchmarks.bench_sp import profiled_self_times

    times = sorted(profiled_self_times(fn, device), key=lambda kv: -kv[1])
    total = sum(t for _, t in times) / 1e3
    return [{"kernel": "(total)", "ms": round(total, 3)}] + [{"kernel": k[:110], "ms": round(t / 1e3, 3)}
                                                          for k, t in times[:top]]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--dtype", default="bf16", choices=("fp32", "bf16"))
    ap.add_argument("--random-layers", type=int, default=2)
    ap.add_argument("--random-heads", type=int, default=8)
    ap.add_argument("--random-head-dim", type=int, default=64)
    ap.add_argument("--random-audio-heads", type=int, default=8)
    ap.add_argument("--random-audio-head-dim", type=int, default=32)
    ap.add_argument("--latent", default="2x4x4", help="video latent FxHxW")
    ap.add_argument("--audio-tokens", type=int, default=8)
    ap.add_argument("--text-tokens", type=int, default=16)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--runs", type=int, default=10)
    ap.add_argument("--compile", action="store_true", help="add ours_compiled")
    ap.add_argument("--profile", action="store_true", help="the kernel table of one call per variant")
    ap.add_argument("--top", type=int, default=25)
    ap.add_argument("--out")
    a = ap.parse_args(argv)

    comfyui = os.environ.get("COMFYUI_DIR")
    if not comfyui or not (Path(comfyui) / "comfy" / "sd.py").is_file():
        raise SystemExit(f"COMFYUI_DIR must point at a ComfyUI checkout (the folder with comfy/); got {comfyui!r}")
    sys.path.insert(0, comfyui)
    sys.path.insert(0, str(REPO))
    from comfy.cli_args import args as comfy_args

    comfy_args.cpu = a.device == "cpu"
    import comfy.model_management as mm
    import comfy.sd
    import torch

    from benchmarks.bench_easycache import latent_shape, random_config, remove_file, write_random_checkpoint
    from benchmarks.comfy_pack import load_pack
    from benchmarks.timing import sync, time_ms, write_json
    from ltx_mgpu.denoise.comfyui.forward import av_timestep_convention, comfy_forward
    from ltx_mgpu.denoise.fp8 import compile_blocks
    from ltx_mgpu.denoise.model import load_ltx_model
    from ltx_mgpu.denoise.plan import TransformerPlan

    load_pack()
    convention = sys.modules["ltx_mgpu_pack.nodes._model"].av_timestep_convention()
    device = torch.device(a.device)
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[a.dtype]
    work = Path(tempfile.mkdtemp(prefix="lm-comfy-model-", dir="/tmp"))
    checkpoint = str(work / "random-ltx-2.3.safetensors")
    atexit.register(remove_file, checkpoint)
    config = random_config(a.random_layers, a.random_heads, a.random_head_dim, a.random_audio_heads,
                           a.random_audio_head_dim)
    t0 = time.perf_counter()
    size = write_random_checkpoint(checkpoint, config, a.dtype)
    print(f"wrote {checkpoint} ({size / 2**20:.0f} MiB) in {time.perf_counter() - t0:.1f} s", flush=True)

    patcher = comfy.sd.load_checkpoint_guess_config(checkpoint, output_vae=False, output_clip=False)[0]
    mm.load_models_gpu([patcher])
    dm = patcher.model.diffusion_model
    ours = load_ltx_model(TransformerPlan(checkpoint, dtype=a.dtype, max_tokens=1 << 20), device)
    velocity = ours.velocity_model()

    g = torch.Generator().manual_seed(1)
    t = config["transformer"]
    width = t["num_attention_heads"] * t["attention_head_dim"] + \
        t["audio_num_attention_heads"] * t["audio_attention_head_dim"]
    f, h, w = latent_shape(a.latent)
    x = [torch.randn(2, 128, f, h, w, generator=g).to(device, dtype),
         torch.randn(2, 8, a.audio_tokens, 16, generator=g).to(device, dtype)]
    text = torch.randn(2, a.text_tokens, width, generator=g).to(device, dtype)
    sigma = torch.full((2,), 0.7, device=device)
    per_token = tuple(sigma[:, None].expand(2, n).contiguous() for n in (f * h * w, a.audio_tokens))
    with torch.no_grad():
        ctx = torch.cat([dm.preprocess_text_embeds(text[i:i + 1], unprocessed=True) for i in range(2)])

    def comfy_call():
        return dm([p.clone() for p in x], (sigma, sigma), ctx, None, frame_rate=25.0, transformer_options={})

    def ours_call(timestep):
        def run():
            with av_timestep_convention(ours.transformer, convention):
                return comfy_forward(ours, velocity, [p.clone() for p in x], timestep, ctx, frame_rate=25.0)
        return run

    variants = {"comfy": comfy_call, "ours": ours_call((sigma, sigma)), "ours_per_token": ours_call(per_token)}
    result: dict = {"argv": sys.argv[1:] if argv is None else list(argv), "device": str(device),
                    "gpu": torch.cuda.get_device_name(device) if device.type == "cuda" else None,
                    "torch": torch.__version__, "dtype": a.dtype, "video_tokens": f * h * w,
                    "audio_tokens": a.audio_tokens, "text_tokens": a.text_tokens, "layers": a.random_layers,
                    "av_timestep_convention": convention, "variants": {}}
    with torch.no_grad():
        want = comfy_call()
        if a.compile:
            variants["ours_compiled"] = ours_call((sigma, sigma))
        for name, fn in variants.items():
            if name == "ours_compiled":
                compile_blocks(ours.transformer, dynamic=False)
                t0 = time.perf_counter()
                fn()
                sync(device)
                result["compile_s"] = time.perf_counter() - t0
            got = fn()
            median, times = time_ms(device, fn, a.warmup, a.runs)
            row = result["variants"][name] = {"median_ms": median, "times_ms": times}
            if name != "comfy":
                row["rel_to_comfy"] = {k: float((o.float() - c.float()).norm() / c.float().norm())
                                       for k, o, c in zip(("video", "audio"), got, want)}
            if a.profile:
                row["kernels"] = kernel_table(fn, device, a.top)
            print(f"{name:15s} {median:9.2f} ms" + (f"  rel to comfy {row['rel_to_comfy']}" if "rel_to_comfy" in row
                                                   else ""), flush=True)
            if a.out:
                write_json(a.out, result)
    if a.profile:
        for name, row in result["variants"].items():
            print(f"--- {name}")
            for k in row.get("kernels", []):
                print(f"{k['ms']:9.3f} ms  {k['kernel']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
