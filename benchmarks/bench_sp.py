"""Sequence-parallel denoising at world size 1: what does our wrapper cost on one GPU?

Run on one GPU (the issue's numbers come from one H200; about 3 minutes, ~45 GB)::

    python benchmarks/bench_sp.py --out benchmarks/results/sp_h200.json

Model: an LTX-2 **19B-shaped** audio-video transformer (ltx-core 1.0.0 ``LTXModel`` via
``LTXModelConfigurator``): 48 layers, video 32 heads x 128, audio 32 heads x 64, **LTX-2.0
layout** (the caption projections live inside the DiT: ``caption_channels`` 3840 -> 4096 /
2048; no gated attention, no cross-attention AdaLN), 18.9 B parameters. It is built on the meta
device and materialised on the GPU directly in bf16 (37.8 GB), then filled from one seeded CUDA
generator in parameter-name order (deterministic; matrices N(0, 1/fan_in), biases N(0, 0.02^2),
norm gains 1, AdaLN tables N(0, 1/dim)). Inputs per size: a ComfyUI LATENT ``[1, 128, F, H, W]``
(default 16x16x24 = 6,144 and 16x32x48 = 24,576 video tokens) with a ``[1, 8, 126, 16]`` audio
latent (126 tokens: 121 frames at 24 fps), tokenised by ``ltx_mgpu.denoise.comfyui.latents`` (float32
positions, as our sampler passes them), and 1,024 text tokens of processed 2.0 context
(``[1, 1024, 3840]`` per modality).

Variants, timed with CUDA events, interleaved round by round (so clock drift hits all alike),
median of ``--runs`` (``--runs-large`` at the largest size) after ``--warmup``:

* ``plain``: ltx-core ``LTXModel.forward(video, audio, None)``, batch 1;
* ``sp-ws1``: our ``SequenceParallelTransformer`` with ``group=None`` (world size 1: the token
  budget check, then the plain call — the path a 1-GPU pool takes);
* ``sp-forced-1rank``: the full Ulysses machinery forced on at world size 1 over a real 1-rank
  process group (NCCL; gloo on CPU): the attention wrappers on ``attn1`` and
  ``video_to_audio_attn`` with their ``all_to_all_single`` / ``all_gather`` and layout copies, and
  the output gather. The wrapper itself never takes this path at world size 1; it is forced here
  (through its private shard state) to show the cost of the exchange code minus the wire;
* ``plain-b2``: ``LTXModel.forward`` at batch 2 (the CFG forward's size);
* ``sampler-step-cfg``: one step of our sampler's loop with cfg 3: the batched cond+uncond
  forward (batch 2) through ``sp-ws1`` + guidance + the Euler update, in float32 state — exactly
  ``ltx_mgpu.denoise.comfyui.sampler.sample``'s loop body;
* ``sample-call-1step``: a whole ``sample()`` call with one CFG step (adds the per-call set-up:
  ComfyUI noise drawn on the CPU, tokenisation, host-to-device copies, the final unpatchify).

It checks that ``sp-ws1`` and ``sp-forced-1rank`` return the plain output (max |delta|), and
profiles one plain forward with ``torch.profiler`` to report attention's share of the GPU kernel
time (kernels whose names contain flash / fmha / attention / sdpa). Every ratio comes from this
one run. ``--device cpu`` with the small sizes below is the CPU smoke test::

    python benchmarks/bench_sp.py --device cpu --layers 1 --video-heads 4 --video-head-dim 8 \\
        --audio-heads 4 --audio-head-dim 4 --caption-channels 64 --text-tokens 16 \\
        --audio-tokens 5 --shapes 2x3x4 --warmup 1 --runs 2
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from ltx_core.model.transformer import LTXModelConfigurator, Modality  # noqa: E402

from benchmarks.timing import time_ms, write_json  # noqa: E402
from ltx_mgpu.assets.geometry import tiny_transformer_config  # noqa: E402
from ltx_mgpu.choices import ATTENTION_TYPES  # noqa: E402
from ltx_mgpu.denoise.attention.function import attention_function, core_attention_type, install  # noqa: E402
from ltx_mgpu.denoise.comfyui.latents import latent_to_tokens
from ltx_mgpu.denoise.comfyui.sampler import _predict, _Stream, sample  # noqa: E402
from ltx_mgpu.denoise.model import LTXDenoiser  # noqa: E402
from ltx_mgpu.denoise.parallel.ulysses import (  # noqa: E402
    SequenceParallelTransformer,
    _ShardState,
    install_attention_wrappers,
    remove_attention_wrappers,
)
from ltx_mgpu.denoise.plan import TransformerPlan  # noqa: E402
from ltx_mgpu.nested import NestedTensorLike  # noqa: E402

#: LTX-2 19B (LTX-2.0 layout) transformer geometry.
LTX2_19B = dict(layers=48, video_heads=32, video_head_dim=128, audio_heads=32, audio_head_dim=64, caption_channels=3840)
CFG = 3.0
SIGMA, SIGMA_NEXT = 0.9, 0.8
ATTENTION_KERNELS = ("flash", "fmha", "attention", "sdpa", "_attend", "_quantize_kv")  # the last two: ours


def transformer_config(a: argparse.Namespace) -> dict:
    """The ``{"transformer": ...}`` config: the LTX-2.0 key set with the requested sizes (and
    ``"attention"``: the requested attention type, which :func:`build_model` installs where it is
    not ltx-core's own)."""
    cfg = tiny_transformer_config("2.0")
    for k in [k for k in cfg if k.startswith("connector_")] + ["use_embeddings_connector"]:
        cfg.pop(k, None)  # the DiT alone: the connectors are not part of a step
    cfg.update(num_layers=a.layers, num_attention_heads=a.video_heads, attention_head_dim=a.video_head_dim,
               cross_attention_dim=a.video_heads * a.video_head_dim, audio_num_attention_heads=a.audio_heads,
               audio_attention_head_dim=a.audio_head_dim, audio_cross_attention_dim=a.audio_heads * a.audio_head_dim,
               caption_channels=a.caption_channels, attention_type=core_attention_type(a.attention_type))
    return {"transformer": cfg} if cfg["attention_type"] == a.attention_type else \
        {"transformer": cfg, "attention": a.attention_type}


@torch.no_grad()
def build_model(config: dict, device: torch.device, dtype: torch.dtype, seed: int = 0):
    """Meta build -> ``to_empty`` on ``device`` in ``dtype`` -> deterministic random fill; the
    config's ``"attention"`` installed where ltx-core has no such backend (``triton_8bit``)."""
    with torch.device("meta"):
        model = LTXModelConfigurator.from_config(config)
    attention = config.get("attention")
    if attention is not None and core_attention_type(attention) != attention:
        install(model, attention_function(attention))
    model = model.to(dtype=dtype).to_empty(device=device).eval()
    gen = torch.Generator(device=device).manual_seed(seed)
    for name, p in sorted(model.named_parameters()):
        if p.ndim >= 2 and "scale_shift_table" in name:
            p.normal_(0.0, p.shape[-1] ** -0.5, generator=gen)
        elif p.ndim >= 2:
            p.normal_(0.0, p.shape[1] ** -0.5, generator=gen)
        elif "norm" in name:
            p.fill_(1.0)
        else:
            p.normal_(0.0, 0.02, generator=gen)
    return model


def make_inputs(shape: tuple[int, int, int], audio_tokens: int, text_tokens: int, width: int, device, dtype, seed=1):
    """(LATENT, token state, [pos, neg] contexts): ComfyUI-format inputs and their tokens."""
    g = torch.Generator().manual_seed(seed)
    f, h, w = shape
    latent = {"samples": NestedTensorLike([torch.randn(1, 128, f, h, w, generator=g),
                                           torch.randn(1, 8, audio_tokens, 16, generator=g)]), "type": "audio"}
    state = latent_to_tokens(latent, 24.0)
    ctxs = [torch.randn(1, text_tokens, width, generator=g).to(device, dtype) for _ in range(2)]
    return latent, state, ctxs


def modalities(state, ctx: torch.Tensor, device, dtype) -> tuple[Modality, Modality]:
    """ltx-core (video, audio) Modalities at sigma 0.9 (every token denoised), one sample per
    context row (``ctx`` ``[B, L, D]``: B = 2 is the batched cond + uncond forward)."""
    batch, out = ctx.shape[0], []
    for m in (state.video, state.audio):
        t = m.tokens.shape[1]
        ts = torch.full((batch, t), SIGMA, device=device)
        out.append(Modality(latent=m.tokens.to(device, dtype).repeat(batch, 1, 1), sigma=ts[:, 0], timesteps=ts,
                            positions=m.positions.to(device).repeat(batch, 1, 1, 1), context=ctx))
    return out[0], out[1]


def profiled_self_times(fn, device: torch.device) -> list[tuple[str, float]]:
    """``(name, self time in microseconds)`` of every GPU kernel (CUDA) or op (CPU) one call of
    ``fn`` ran, via torch.profiler (the device synchronised before the profile closes)."""
    from torch.profiler import ProfilerActivity, profile

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=acts) as prof:
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
    events = prof.key_averages()
    if device.type != "cuda":
        return [(e.key, e.self_cpu_time_total) for e in events]
    return [(e.key, getattr(e, "self_device_time_total", None) or getattr(e, "self_cuda_time_total", 0))
            for e in events if getattr(e, "device_type", None) == torch.autograd.DeviceType.CUDA]


def attention_share(fn, device: torch.device) -> dict:
    """Attention's share of one call's kernel time (GPU) or op time (CPU), via torch.profiler."""
    times = profiled_self_times(fn, device)
    if device.type == "cuda":
        is_attention = lambda k: any(s in k.lower() for s in ATTENTION_KERNELS)  # noqa: E731
    else:
        is_attention = lambda k: "scaled_dot_product" in k or "attention" in k.lower()  # noqa: E731
    total = sum(t for _, t in times)
    attn = sum(t for k, t in times if is_attention(k))
    top = sorted(((k[:80], t / 1e3) for k, t in times), key=lambda x: -x[1])[:8]
    return {"attention_ms": attn / 1e3, "total_ms": total / 1e3, "share": attn / total if total else None,
            "top_ms": top}


def one_rank_group(device: torch.device):
    """A real 1-rank process group (NCCL on CUDA, gloo on CPU) on a free local port."""
    from ltx_mgpu.client.launch import free_port

    port = free_port()
    kw = {"device_id": device} if device.type == "cuda" else {}
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo", init_method=f"tcp://127.0.0.1:{port}",
                            rank=0, world_size=1, **kw)
    return dist.group.WORLD


def add_model_arguments(ap: argparse.ArgumentParser) -> None:
    """The model and input options of ``bench_sp`` and ``bench_sp_ranks``: the transformer's
    shape (default :data:`LTX2_19B`), the ltx-core attention backend, the latent sizes (FxHxW,
    tokens = F*H*W) and the audio and text token counts."""
    ap.add_argument("--layers", type=int, default=LTX2_19B["layers"])
    ap.add_argument("--video-heads", type=int, default=LTX2_19B["video_heads"])
    ap.add_argument("--video-head-dim", type=int, default=LTX2_19B["video_head_dim"])
    ap.add_argument("--audio-heads", type=int, default=LTX2_19B["audio_heads"])
    ap.add_argument("--audio-head-dim", type=int, default=LTX2_19B["audio_head_dim"])
    ap.add_argument("--caption-channels", type=int, default=LTX2_19B["caption_channels"])
    ap.add_argument("--attention-type", default="pytorch", choices=ATTENTION_TYPES,
                    help="attention backend (pytorch = SDPA; triton_8bit: ours)")
    ap.add_argument("--shapes", default="16x16x24,16x32x48", help="latent FxHxW per size (tokens = F*H*W)")
    ap.add_argument("--audio-tokens", type=int, default=126)
    ap.add_argument("--text-tokens", type=int, default=1024)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cuda")
    add_model_arguments(ap)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--runs", type=int, default=7)
    ap.add_argument("--runs-large", type=int, default=5, help="runs at the largest size")
    ap.add_argument("--no-profile", action="store_true")
    ap.add_argument("--out", default=None, help="write raw results as JSON here")
    a = ap.parse_args(argv)

    device = torch.device(a.device)
    if device.type == "cuda":
        device = torch.device("cuda", device.index if device.index is not None else torch.cuda.current_device())
        torch.cuda.set_device(device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    config = transformer_config(a)
    t0 = time.perf_counter()
    model = build_model(config, device, dtype)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    results = {"device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
               "torch": torch.__version__, "dtype": str(dtype),
               "layout": "LTX-2.0 (19B: caption projection in the DiT)",
               "config": config["transformer"], "params": sum(p.numel() for p in model.parameters()),
               "build_seconds": time.perf_counter() - t0, "sizes": {}}
    print(f"model: {results['params'] / 1e9:.2f} B params, {dtype}, built in {results['build_seconds']:.1f} s "
          f"on {results['device']}", flush=True)
    group = one_rank_group(device)

    def time_one(fn) -> float:  # one call, in milliseconds
        return time_ms(device, fn, 0, 1)[0]

    shapes = [tuple(int(x) for x in s.split("x")) for s in a.shapes.split(",")]
    max_tokens = max(f * h * w for f, h, w in shapes)
    sp_ws1 = SequenceParallelTransformer(model, None, max_tokens)
    forced_state = _ShardState(group, 1, 0)
    plan = TransformerPlan("random-weights", dtype="bf16" if dtype == torch.bfloat16 else "fp32", max_tokens=max_tokens)
    denoiser = LTXDenoiser(model, None, None, config, "2.0", dtype, device, plan)
    rows = []
    for shape in shapes:
        tokens = shape[0] * shape[1] * shape[2]
        runs = a.runs_large if tokens == max_tokens and len(shapes) > 1 else a.runs
        latent, state, ctxs = make_inputs(shape, a.audio_tokens, a.text_tokens, a.caption_channels, device, dtype)
        v1, a1 = modalities(state, ctxs[0], device, dtype)
        v2, a2 = modalities(state, torch.cat(ctxs), device, dtype)
        sig = torch.tensor([SIGMA, SIGMA_NEXT], device=device)

        def streams():
            out = {}
            for k, m in (("video", state.video), ("audio", state.audio)):
                lat = m.tokens.to(device, torch.float32)
                out[k] = _Stream(x=lat.clone(), latent=lat, timestep_mask=m.denoise_mask.to(device), mask=None,
                                 positions=m.positions.to(device), contexts=[ctxs[0], ctxs[1]])
            return out

        step_streams = streams()

        def sampler_step():  # ltx_mgpu.denoise.comfyui.sampler.sample's loop body, one step
            den = _predict(step_streams, sig[0], CFG, dtype, sp_ws1)
            for k, s in step_streams.items():
                s.x = s.x + (s.x - den[k]) / sig[0] * (sig[1] - sig[0])

        processed = [[[torch.cat([c, c], dim=-1).cpu(), {}]] for c in ctxs]  # 2.0 compat form [1, L, 2 * 3840]

        def sample_call():
            return sample(denoiser, processed[0], processed[1], latent, sigmas=sig.cpu(), cfg=CFG, seed=0,
                          velocity_model=sp_ws1)

        def force_on():
            install_attention_wrappers(model, forced_state)
            sp_ws1._state = forced_state  # the multi-rank branch of forward, with one rank

        def force_off():
            sp_ws1._state = None
            remove_attention_wrappers(model)

        variants = [
            ("plain", lambda: model(v1, a1, None), None, None),
            ("sp-ws1", lambda: sp_ws1(v1, a1, None), None, None),
            ("sp-forced-1rank", lambda: sp_ws1(v1, a1, None), force_on, force_off),
            ("plain-b2", lambda: model(v2, a2, None), None, None),
            ("sampler-step-cfg", sampler_step, None, None),
            ("sample-call-1step", sample_call, None, None),
        ]
        size = results["sizes"][str(tokens)] = {"latent": list(shape), "audio_tokens": a.audio_tokens,
                                                "text_tokens": a.text_tokens, "variants": {}}
        with torch.inference_mode():
            ref_v, ref_a = model(v1, a1, None)
            parity = {}
            for name, fn, on, off in variants[1:3]:
                on and on()
                got_v, got_a = fn()
                off and off()
                parity[name] = max((got_v - ref_v).abs().max().item(), (got_a - ref_a).abs().max().item())
            size["max_abs_diff_vs_plain"] = parity
            del ref_v, ref_a, got_v, got_a
            times: dict[str, list[float]] = {name: [] for name, *_ in variants}
            peaks: dict[str, float | None] = {}
            for name, fn, on, off in variants:
                on and on()
                if device.type == "cuda":
                    torch.cuda.synchronize(device)
                    torch.cuda.reset_peak_memory_stats(device)
                for _ in range(a.warmup):
                    fn()
                peaks[name] = torch.cuda.max_memory_allocated(device) / 1e9 if device.type == "cuda" else None
                off and off()
            for r in range(runs):  # interleaved rounds, rotating the order
                for name, fn, on, off in variants[r % len(variants):] + variants[: r % len(variants)]:
                    on and on()
                    times[name].append(time_one(fn))
                    off and off()
            for name, *_ in variants:
                med = statistics.median(times[name])
                size["variants"][name] = {"median_ms": med, "times_ms": times[name], "peak_gb": peaks[name]}
            base = size["variants"]["plain"]["median_ms"]
            base2 = size["variants"]["plain-b2"]["median_ms"]
            size["sp_overhead_pct"] = {n: 100 * (size["variants"][n]["median_ms"] / base - 1)
                                       for n in ("sp-ws1", "sp-forced-1rank")}
            size["sampler_step_vs_plain_b2_pct"] = 100 * (size["variants"]["sampler-step-cfg"]["median_ms"] / base2 - 1)
            if not a.no_profile:
                size["attention"] = attention_share(lambda: model(v1, a1, None), device)
        for name, *_ in variants:
            v = size["variants"][name]
            rows.append((tokens, name, v["median_ms"],
                         v["median_ms"] / (base2 if name.startswith(("sampler", "sample-")) else base),
                         v["peak_gb"]))
            print(f"{tokens} tokens {name}: {v['median_ms']:.2f} ms (runs {len(v['times_ms'])}, "
                  f"peak {v['peak_gb']} GB)", flush=True)
        if a.out:
            write_json(a.out, results)
    print(f"\n{'tokens':>7} {'variant':<19}{'median ms':>11}{'ratio':>8}{'peak GB':>9}   (ratio: vs plain; "
          "sampler rows vs plain-b2)")
    for tokens, name, med, ratio, peak in rows:
        print(f"{tokens:>7} {name:<19}{med:>11.2f}{ratio:>8.3f}{(peak if peak is not None else float('nan')):>9.2f}")
    for tokens, size in results["sizes"].items():
        att = size.get("attention") or {}
        share = f"{100 * att['share']:.1f} %" if att.get("share") is not None else "n/a"
        print(f"{tokens} tokens: SP overhead at world size 1 "
              + ", ".join(f"{k} {v:+.2f} %" for k, v in size["sp_overhead_pct"].items())
              + f" (goal <= 2 %); sampler step vs plain batch-2 forward {size['sampler_step_vs_plain_b2_pct']:+.2f} %; "
              f"attention {share} of the plain forward; max |delta| vs plain {size['max_abs_diff_vs_plain']}")
    if a.out:
        write_json(a.out, results)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
