"""ComfyUI's ``EasyCache`` node on our pool MODEL: wall time of a whole sampling run without it, at
its default threshold and at a higher one, and the transformer calls it saves, beside ComfyUI's own
model for the same checkpoint.

Run with ComfyUI's Python, ``COMFYUI_DIR`` = the checkout, from the repository root::

    COMFYUI_DIR=... $COMFYUI_PYTHON benchmarks/bench_easycache.py --out benchmarks/results/easycache_cpu.json
    # a transformer whose steps cost more than the pool's round trip (random weights, real keys):
    ... --random-layers 4 --latent 4x8x8 --audio-tokens 32 --runs 5   # easycache_cpu.json
    # on a GPU (one rank on GPU 0; ComfyUI's own model on the same GPU), 8 blocks of LTX-2 19B's width
    # (a machine without ComfyUI: docs/benchmarks.md, "EasyCache on a GPU", carries a slice of it):
    ... --gpus 0 --dtype bf16 --random-dtype bf16 --random-layers 8 --random-heads 32 --random-head-dim 128 \
        --random-audio-heads 32 --random-audio-head-dim 64 --latent 16x16x24 --audio-tokens 126 --text-tokens 1024

It imports only the parts of ComfyUI the run needs (``comfy.model_management``, ``comfy.sd``,
``comfy_extras.nodes_custom_sampler`` and ``comfy_extras.nodes_easycache``, not ``nodes.py``'s
extras), loads this pack as ComfyUI loads a custom node, starts a pool through ``LTXMGPU_Pool``
(``--gpus cpu`` with ``--cpu-ranks`` ranks, or GPU indices) and loads the transformer through
``LTXMGPU_ModelLoader`` from ``--checkpoint`` (default: the pack's tiny LTX-2.3 checkpoint), or from
a checkpoint it writes with random weights of the ``--random-*`` sizes (the LTX-2.3 key names and
``config`` metadata; random, because a header-only file reads as zeros and EasyCache would then
skip every step it may; deleted when the process exits). ComfyUI loads its own model from the same file.

Each variant samples ``CFGGuider`` (``--cfg``, cond + uncond in one call) + ``euler``,
``BasicScheduler`` ``--steps`` on an audio-video latent (``--latent`` FxHxW video, ``--audio-tokens``)
with a fixed noise seed: ``none`` (the MODEL as loaded), ``default`` (``EasyCache`` with every
input at its default) and ``high`` (``reuse_threshold`` = ``--high-threshold``), on our MODEL and on
ComfyUI's. All six are timed in interleaved rounds (``timing.time_interleaved``, wall clock:
``--warmup`` untimed rounds, then the median of ``--runs``). Per variant the JSON has the median
and every time in ms, ``forwards`` (transformer calls of one run: the pool's ``forward`` requests,
``pool_model.sent["forward"]``, or ComfyUI's ``_forward`` runs), ``skipped`` (the steps EasyCache
logged as skipped, ``None`` without it) and, for ``default`` / ``high``, ``speedup`` = the
``none`` median / its median. ``rel_to_comfy``: the max relative difference of our latent to
ComfyUI's, per variant (the same model, so small; large for ``bf16`` on a GPU).

Raises ``SystemExit`` with the fix when ``COMFYUI_DIR`` is not a ComfyUI checkout.
"""

from __future__ import annotations

import argparse
import atexit
import contextlib
import json
import logging
import os
import re
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
#: The variants, in the order they are timed each round.
VARIANTS = ("none", "default", "high")


def random_config(layers: int, heads: int, head_dim: int, audio_heads: int, audio_head_dim: int) -> dict:
    """The tiny LTX-2.3 ``config`` metadata (``ltx_mgpu.assets.geometry.tiny_ltx_config``) with the
    transformer and its connectors resized: ``layers`` blocks, video ``heads`` x ``head_dim``,
    audio ``audio_heads`` x ``audio_head_dim``."""
    from ltx_mgpu.assets.geometry import tiny_ltx_config

    config = tiny_ltx_config("2.3")
    t = config["transformer"]
    t.update(num_layers=layers, num_attention_heads=heads, attention_head_dim=head_dim,
             cross_attention_dim=heads * head_dim, audio_num_attention_heads=audio_heads,
             audio_attention_head_dim=audio_head_dim, audio_cross_attention_dim=audio_heads * audio_head_dim,
             connector_num_attention_heads=heads, connector_attention_head_dim=head_dim,
             audio_connector_num_attention_heads=audio_heads, audio_connector_attention_head_dim=audio_head_dim)
    return config


def write_random_checkpoint(path: str | os.PathLike, config: dict, dtype: str = "fp32", seed: int = 0) -> int:
    """Write an LTX-2.3 transformer checkpoint for ``config`` (:func:`random_config`): the
    ``model.diffusion_model.*`` keys of ltx-core's ``LTXModel`` and of the two embeddings
    connectors, in ``dtype`` (``"fp32"`` / ``"bf16"`` / ``"fp16"``), each tensor
    ``ltx_mgpu.assets.ltx.materialise``'s (``init_tensor`` of its key) (random, scaled by fan-in), and the
    ``config`` / ``model_version`` metadata. No VAE, no text projection (neither is read to
    sample). Returns the file size in bytes."""
    import torch  # deferred, as everything here: ComfyUI's python imports this module first
    from ltx_core.model.transformer import LTXModelConfigurator
    from ltx_core.text_encoders.gemma.encoders.encoder_configurator import EmbeddingsProcessorConfigurator
    from safetensors.torch import save_file

    from ltx_mgpu.assets.geometry import MODEL_VERSIONS
    from ltx_mgpu.assets.ltx import materialise

    with torch.device("meta"):
        transformer = LTXModelConfigurator.from_config(config)
        processor = EmbeddingsProcessorConfigurator.from_config(config)
    dit = "model.diffusion_model."
    modules = {dit: transformer, dit + "video_embeddings_connector.": processor.video_connector,
               dit + "audio_embeddings_connector.": processor.audio_connector}
    to = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[dtype]
    sd = {}
    for prefix, module in modules.items():
        sd.update(materialise(module, prefix, seed, to))
    save_file(sd, str(path), metadata={"config": json.dumps(config, sort_keys=True),
                                       "model_version": MODEL_VERSIONS["2.3"]})
    return os.path.getsize(path)


def remove_file(path: str) -> None:
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)


def latent_shape(text: str) -> tuple[int, int, int]:
    try:
        f, h, w = (int(v) for v in text.lower().split("x"))
    except ValueError:
        raise SystemExit(f"--latent must be FxHxW (three integers, e.g. 2x2x3), got {text!r}") from None
    return f, h, w


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--gpus", default="cpu", help="the pool's GPUs (LTXMGPU_Pool 'gpus': 'cpu', '0', '0,1')")
    ap.add_argument("--cpu-ranks", type=int, default=2)
    ap.add_argument("--dtype", default="fp32", choices=("fp32", "bf16", "fp16"), help="the Model Loader's dtype")
    ap.add_argument("--checkpoint", help="an LTX-2 checkpoint (default: the tiny LTX-2.3 one)")
    ap.add_argument("--random-layers", type=int, help="write a random-weights checkpoint with this many blocks")
    ap.add_argument("--random-heads", type=int, default=8)
    ap.add_argument("--random-head-dim", type=int, default=64)
    ap.add_argument("--random-audio-heads", type=int, default=8)
    ap.add_argument("--random-audio-head-dim", type=int, default=32)
    ap.add_argument("--random-dtype", default="fp32", choices=("fp32", "bf16", "fp16"),
                    help="the random checkpoint's dtype (bf16 halves its size)")
    ap.add_argument("--latent", default="2x2x3", help="video latent FxHxW (tokens = F*H*W)")
    ap.add_argument("--audio-tokens", type=int, default=5)
    ap.add_argument("--text-tokens", type=int, default=9)
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--cfg", type=float, default=3.0)
    ap.add_argument("--high-threshold", type=float, default=1.5, help="the 'high' variant's reuse_threshold")
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--no-comfy", action="store_true", help="leave out ComfyUI's own model")
    ap.add_argument("--out", help="write the results as JSON here")
    a = ap.parse_args(argv)
    if a.checkpoint and a.random_layers:
        raise SystemExit("give --checkpoint or --random-layers (a checkpoint this run writes), not both")

    comfyui = os.environ.get("COMFYUI_DIR")
    if not comfyui or not (Path(comfyui) / "comfy" / "sd.py").is_file():
        raise SystemExit("COMFYUI_DIR must point at a ComfyUI checkout (the folder with comfy/ and comfy_extras/); "
                         f"got {comfyui!r}")
    sys.path.insert(0, comfyui)
    sys.path.insert(0, str(REPO))
    work = Path(tempfile.mkdtemp(prefix="lm-easycache-", dir="/tmp"))
    os.environ.setdefault("LTX_MGPU_RUNTIME_DIR", str(work / "rt"))
    # ComfyUI's modules and this repository's import only now that they are on sys.path
    from comfy.cli_args import args as comfy_args

    comfy_args.cpu = a.gpus == "cpu"
    import comfy.model_management  # noqa: F401 - ComfyUI's device set-up, before its models
    import comfy.nested_tensor
    import comfy.sd
    import torch
    from comfy_extras import nodes_custom_sampler as ncs
    from comfy_extras.nodes_easycache import EasyCacheNode

    from benchmarks.comfy_pack import load_pack
    from benchmarks.timing import time_interleaved, write_json

    nodes = load_pack()
    result: dict = {"argv": sys.argv[1:] if argv is None else list(argv), "gpus": a.gpus, "dtype": a.dtype,
                    "steps": a.steps, "cfg": a.cfg, "latent": a.latent, "audio_tokens": a.audio_tokens,
                    "torch": torch.__version__, "host_threads": torch.get_num_threads()}
    if a.random_layers:
        config = random_config(a.random_layers, a.random_heads, a.random_head_dim, a.random_audio_heads,
                               a.random_audio_head_dim)
        checkpoint = str(work / "random-ltx-2.3.safetensors")
        atexit.register(remove_file, checkpoint)  # gigabytes at a GPU run's sizes: gone when the run ends, however
        t0 = time.perf_counter()
        result["checkpoint_bytes"] = write_random_checkpoint(checkpoint, config, a.random_dtype)
        print(f"wrote {checkpoint} ({result['checkpoint_bytes'] / 2**20:.0f} MiB) in {time.perf_counter() - t0:.1f} s",
              flush=True)
    else:
        from ltx_mgpu.assets import tiny_ltx_checkpoint

        checkpoint = a.checkpoint or str(tiny_ltx_checkpoint("2.3"))
    from safetensors import safe_open

    with safe_open(checkpoint, "pt") as f:
        t = json.loads(f.metadata()["config"])["transformer"]
    width = t["num_attention_heads"] * t["attention_head_dim"] + \
        t["audio_num_attention_heads"] * t["audio_attention_head_dim"]
    result.update(checkpoint=checkpoint, layers=t["num_layers"], video_inner=t["num_attention_heads"] *
                  t["attention_head_dim"], audio_inner=t["audio_num_attention_heads"] * t["audio_attention_head_dim"])

    log: list[str] = []

    class Collect(logging.Handler):
        def emit(self, record):
            log.append(record.getMessage())

    logging.getLogger().setLevel(logging.INFO)
    logging.getLogger().addHandler(Collect(level=logging.INFO))

    (pool,) = nodes["LTXMGPU_Pool"].execute(gpus=a.gpus, cpu_ranks=a.cpu_ranks, lifetime="with-owner",
                                            free_comfy_vram=False)
    ours = nodes["LTXMGPU_ModelLoader"].execute(pool, checkpoint, a.dtype, "", 32768)[1]
    pool_model = ours.model.diffusion_model.pool_model
    models = {"ours": ours}
    calls = {"comfy": 0}
    if not a.no_comfy:
        theirs = comfy.sd.load_checkpoint_guess_config(checkpoint, output_vae=False, output_clip=False)[0]
        dm = theirs.model.diffusion_model
        forward = dm._forward

        def counted(*args, **kwargs):
            calls["comfy"] += 1
            return forward(*args, **kwargs)

        dm._forward = counted  # ComfyUI's transformer runs (EasyCache's wrapper may skip them)
        models["comfy"] = theirs

    def forwards(who: str) -> int:
        return calls["comfy"] if who == "comfy" else pool_model.sent.get("forward", 0)

    g = torch.Generator().manual_seed(1)

    def conditioning():
        return [[torch.randn(1, a.text_tokens, width, generator=g),
                 {"pooled_output": None, "unprocessed_ltxav_embeds": True, "frame_rate": 25.0}]]

    positive, negative = conditioning(), conditioning()
    f, h, w = latent_shape(a.latent)
    latent = {"samples": comfy.nested_tensor.NestedTensor((torch.zeros(1, 128, f, h, w),
                                                           torch.zeros(1, 8, a.audio_tokens, 16)))}
    inputs = EasyCacheNode.INPUT_TYPES()["required"]
    defaults = {k: v[1]["default"] for k, v in inputs.items() if k != "model"}
    result["easycache_defaults"] = defaults

    def patched(model, variant: str):
        if variant == "none":
            return model
        kw = dict(defaults, **({"reuse_threshold": a.high_threshold} if variant == "high" else {}))
        return EasyCacheNode.execute(model=model, **kw).result[0]

    cells: dict = {}
    outs: dict = {}

    def sampler(who: str, variant: str):
        model = patched(models[who], variant)
        cell = cells.setdefault(f"{who}/{variant}", {"forwards": [], "skipped": []})

        def run():
            del log[:]
            before = forwards(who)
            guider = ncs.CFGGuider.execute(model, positive, negative, a.cfg).result[0]
            sampler_ = ncs.KSamplerSelect.execute("euler").result[0]
            sigmas = ncs.BasicScheduler.execute(model, "simple", a.steps, 1.0).result[0]
            noise = ncs.RandomNoise.execute(42).result[0]
            out = ncs.SamplerCustomAdvanced.execute(noise, guider, sampler_, sigmas, latent).result[0]["samples"]
            cell["forwards"].append(forwards(who) - before)
            said = [re.search(r"skipped (\d+)/(\d+) steps", m) for m in log]
            said = [int(s.group(1)) for s in said if s]
            cell["skipped"].append(said[-1] if said else None)
            outs[(who, variant)] = [p.float().clone() for p in out.unbind()]
        return run

    fns = {f"{who}/{v}": sampler(who, v) for who in models for v in VARIANTS}
    print(f"timing {len(fns)} variants: {a.warmup} warm-up round(s), {a.runs} timed", flush=True)
    timed = time_interleaved(torch.device("cpu"), fns, a.warmup, a.runs)  # wall clock: the pool is another process
    for name, (median, times) in timed.items():
        who, variant = name.split("/")
        cell = cells[name]
        if len(set(cell["forwards"])) != 1 or len(set(cell["skipped"])) != 1:
            raise RuntimeError(f"{name}: the runs differ in transformer calls {cell['forwards']} or skipped steps "
                               f"{cell['skipped']}")
        row = result.setdefault(who, {})[variant] = {"median_ms": median, "times_ms": times,
                                                      "forwards": cell["forwards"][0], "skipped": cell["skipped"][0]}
        if variant != "none":
            row["speedup"] = timed[f"{who}/none"][0] / median
        if who == "ours" and ("comfy", variant) in outs:
            rel = [float((x - y).norm() / x.norm()) for x, y in zip(outs[("comfy", variant)], outs[("ours", variant)])]
            row["rel_to_comfy"] = max(rel)
    for who in models:
        for v in VARIANTS:
            r = result[who][v]
            print(f"{who:5s} {v:7s} {r['median_ms']:9.1f} ms  calls {r['forwards']:3d}  skipped {r['skipped']}"
                  + (f"  speed-up {r['speedup']:.2f}x" if "speedup" in r else "")
                  + (f"  rel to comfy {r['rel_to_comfy']:.1e}" if "rel_to_comfy" in r else ""), flush=True)
    if a.out:
        write_json(a.out, result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
