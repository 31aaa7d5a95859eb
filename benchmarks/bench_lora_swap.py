"""How long the pool takes to swap LoRA sets between the stages of a two-stage template.

ComfyUI's LTX-2.0 templates sample stage 1 on the base model and stage 2, after the latent
upsampler, on the same model with the distilled LoRA (``LoraLoaderModelOnly``); the next run's
stage 1 is the base model again. On our MODEL the first model call of a stage whose LoRA set
differs sends ComfyUI's patches to the pool (``model_patches``), which merges them on every rank:
each weight the old or the new set touches is re-read from the memory-mapped checkpoint and
merged again (``ltx_mgpu.denoise.patches``); the base weights are never loaded again. This
measures that call, ``PoolModel.sync_patches`` (``ltx_mgpu.client.model``), from the client: the
factors sent (once per adapter), the merge on every rank, the ranks' agreement.

Run on one GPU (bf16, the pool's first GPU; ``--gpus 0,1`` for a pool of two)::

    python benchmarks/bench_lora_swap.py --out benchmarks/results/lora_swap_h200.json

On the CPU (fp32; the whole 19B-shaped model does not fit a small machine's memory, so
``--layers`` keeps the 19B widths and takes fewer of its 48 blocks; the swap scales with the
blocks a LoRA touches)::

    python benchmarks/bench_lora_swap.py --device cpu --layers 4 --out benchmarks/results/lora_swap_cpu.json

Model: the LTX-2 **19B-shaped** transformer of ``bench_sp`` (48 blocks, video 32 x 128, audio
32 x 64), stored as a **header-only** ``.safetensors`` file
(``bench_model_path.write_shaped_checkpoint``: real key names and shapes, the data a sparse hole
that reads as zeros, so the merges re-read as much as with real weights). LoRAs, in ComfyUI's
patch form (bf16 factors, as LoRA files hold them): *distilled*, rank ``--rank`` (384, as
``ltx-2-19b-distilled-lora-384``) on every 2-D weight of the transformer blocks; *style*, rank
``--style-rank`` on the video self-attention's q, k, v and out (a camera or style LoRA). The
swaps, in the order a user meets them:

* ``stage2_distilled``: stage 1 base -> stage 2 base + distilled (factors sent);
* ``next_stage1_base``: -> base again (the touched weights re-read, nothing merged);
* ``stage2_distilled_again``: the distilled LoRA again (the pool keeps only the adapters the
  current set uses, so its factors are sent again);
* ``distilled_strength_0.5``: the same factors at another strength (no tensors sent);
* ``stage1_style`` and ``stage2_style_plus_distilled``: a template with a LoRA on both stages
  (``video_ltx2_i2v_lora``): style, then style + distilled (only the distilled factors sent).

Reported per swap: seconds (median of ``--runs`` after a first, untimed run of the whole
sequence), the weights the new set patches and its factors' bytes; and the base load's
seconds, which a swap saves.
"""

from __future__ import annotations

import argparse
import re
import shutil
import statistics
import sys
import tempfile
import time
import uuid
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.bench_model_path import PREFIX, write_shaped_checkpoint  # noqa: E402
from benchmarks.bench_sp import add_model_arguments, transformer_config  # noqa: E402
from benchmarks.timing import write_json  # noqa: E402
from ltx_mgpu.client.denoise import remote_load_transformer  # noqa: E402
from ltx_mgpu.client.model import PoolModel  # noqa: E402
from ltx_mgpu.client.pool_client import PoolClient  # noqa: E402
from ltx_mgpu.denoise.plan import TransformerPlan

#: ComfyUI's key prefix of the diffusion model's weights (``ModelPatcher.patches`` keys).
COMFY_PREFIX = "diffusion_model."
STYLE_TARGETS = r"transformer_blocks\.\d+\.attn1\.to_(q|k|v|out\.0)\.weight$"


class LoraAdapter:
    """A LoRA as ComfyUI's ``LoRAAdapter`` is read by the client (``name``, ``weights``: up, down,
    alpha, mid, DoRA scale, reshape)."""

    name = "lora"

    def __init__(self, up: torch.Tensor, down: torch.Tensor):
        self.weights = (up, down, None, None, None, None)


def lora(shapes: dict[str, list[int]], pattern: str, rank: int, seed: int) -> dict[str, LoraAdapter]:
    """``{ComfyUI key: adapter}``: rank-``rank`` bf16 factors for every 2-D weight whose checkpoint
    key (without the prefix) matches ``pattern``."""
    g = torch.Generator().manual_seed(seed)
    out = {}
    for key, shape in sorted(shapes.items()):
        rest = key[len(PREFIX):]
        if len(shape) == 2 and re.search(pattern, rest):
            up = (torch.randn(shape[0], rank, generator=g) * rank ** -0.5).to(torch.bfloat16)
            down = (torch.randn(rank, shape[1], generator=g) * shape[1] ** -0.5).to(torch.bfloat16)
            out[COMFY_PREFIX + rest] = LoraAdapter(up, down)
    return out


def patch_set(*loras: tuple[dict[str, LoraAdapter], float]) -> dict[str, list]:
    """ComfyUI's ``ModelPatcher.patches`` for these LoRAs at these strengths, in order."""
    patches: dict[str, list] = {}
    for adapters, strength in loras:
        for key, adapter in adapters.items():
            patches.setdefault(key, []).append((strength, adapter, 1.0, None, None))
    return patches


def nbytes(adapters: dict[str, LoraAdapter]) -> int:
    """The bytes of the adapters' factors (what sending them costs)."""
    return sum(t.numel() * t.element_size() for a in adapters.values() for t in a.weights[:2])


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_model_arguments(ap)
    ap.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    ap.add_argument("--gpus", default="0", help="the pool's GPUs (--device cuda)")
    ap.add_argument("--nproc", type=int, default=1, help="CPU ranks (--device cpu)")
    ap.add_argument("--rank", type=int, default=384, help="the distilled LoRA's rank")
    ap.add_argument("--style-rank", type=int, default=32)
    ap.add_argument("--targets", default=r"^transformer_blocks\.\d+\..*\.weight$",
                    help="regex of the checkpoint keys (without the prefix) the distilled LoRA patches")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--out", help="JSON results")
    a = ap.parse_args(argv)
    work = Path(tempfile.mkdtemp(prefix="lm-bench-", dir="/tmp"))
    config = transformer_config(a)
    checkpoint = str(work / "ltx2-19b-shaped.safetensors")
    dtype = torch.bfloat16 if a.device == "cuda" else torch.float32
    results: dict = {"config": config["transformer"], "device": torch.cuda.get_device_name(0)
                     if a.device == "cuda" else "cpu", "ranks": len(a.gpus.split(",")) if a.device == "cuda"
                     else a.nproc, "checkpoint_bytes": write_shaped_checkpoint(checkpoint, config, dtype)}
    from safetensors import safe_open

    with safe_open(checkpoint, "pt") as f:
        names = f.keys()
        shapes = {k: f.get_slice(k).get_shape() for k in names}
    distilled = lora(shapes, a.targets, a.rank, seed=1)
    style = lora(shapes, STYLE_TARGETS, a.style_rank, seed=2)
    results["loras"] = {"distilled": {"rank": a.rank, "weights": len(distilled), "bytes": nbytes(distilled)},
                        "style": {"rank": a.style_rank, "weights": len(style), "bytes": nbytes(style)}}
    print(f"19B-shaped, {a.layers} blocks: {results['checkpoint_bytes'] / 2**30:.1f} GiB header-only; distilled "
          f"LoRA rank {a.rank} on {len(distilled)} weights ({nbytes(distilled) / 2**30:.2f} GiB), style rank "
          f"{a.style_rank} on {len(style)}", flush=True)
    swaps = [("stage2_distilled", patch_set((distilled, 1.0))), ("next_stage1_base", {}),
             ("stage2_distilled_again", patch_set((distilled, 1.0))),
             ("distilled_strength_0.5", patch_set((distilled, 0.5))),
             ("stage1_style", patch_set((style, 1.0))),
             ("stage2_style_plus_distilled", patch_set((style, 1.0), (distilled, 1.0))), ("back_to_base", {})]
    client = PoolClient.connect(gpus=a.gpus if a.device == "cuda" else "cpu",
                                nproc=a.nproc if a.device == "cpu" else None, runtime_dir=work / "rt",
                                lifetime="with-owner", startup_timeout=300)
    try:
        t0 = time.perf_counter()
        loaded = remote_load_transformer(client, TransformerPlan(checkpoint, dtype={"cuda": "bf16",
                                                                 "cpu": "fp32"}[a.device], max_tokens=1 << 17))
        results["load_s"] = time.perf_counter() - t0
        print(f"base load: {results['load_s']:.1f} s ({loaded['bytes'] / 2**30:.1f} GiB per rank)", flush=True)
        model = PoolModel(lambda: client, lambda: None, loaded["model"], key=loaded.get("key"))
        times: dict[str, list[float]] = {name: [] for name, _ in swaps}
        for run in range(a.runs + 1):
            for name, patches in swaps:
                t0 = time.perf_counter()
                model.sync_patches(uuid.uuid4().hex, patches)
                if run:
                    times[name].append(time.perf_counter() - t0)
            if not run:
                continue
            print(f"run {run}: " + ", ".join(f"{n} {times[n][-1]:.2f} s" for n, _ in swaps), flush=True)
            results["swaps"] = {name: {"seconds": statistics.median(times[name]), "runs_s": times[name],
                                       "weights": len(patches),
                                       "factor_bytes": sum(t.numel() * t.element_size() for ps in patches.values()
                                                           for p in ps for t in p[1].weights[:2])}
                                for name, patches in swaps}
            if a.out:
                write_json(a.out, results)  # after every pass: a run cut short keeps what it measured
        results["pool_status"] = client.status()
        if a.out:
            write_json(a.out, results)
        for name, row in results["swaps"].items():
            print(f"{name:>28}: {row['seconds']:7.2f} s  ({row['weights']} weights)", flush=True)
    finally:
        client.shutdown()
        shutil.rmtree(work, ignore_errors=True)  # the header-only checkpoint and the pool's runtime files
    return 0


if __name__ == "__main__":
    sys.exit(main())
