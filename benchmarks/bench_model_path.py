"""The MODEL path's cost per step: ComfyUI's sampler calling the pool, against the pool's own sampler.

Run on one GPU (the issue's numbers come from one H200)::

    python benchmarks/bench_model_path.py --out benchmarks/results/model_path_h200.json

Model: the LTX-2 **19B-shaped** transformer of ``bench_sp`` (48 layers, video 32 x 128, audio
32 x 64, the LTX-2.0 layout, no connectors), stored as a **header-only** ``.safetensors`` file
(:func:`write_shaped_checkpoint`: the real key names, shapes and ``config`` metadata, bf16, the
data a sparse hole, so it costs no disk and reads as zeros). A pool on ``--gpus`` loads it with
``load_transformer`` (every weight zero: the kernels, and so the times, are those of real
weights). Per size (``--shapes``: 6,144 and 24,576 video tokens, 126 audio tokens, 1,024 text
tokens) the same inputs go two ways:

* ``model_path_step``: one ``PoolModel.forward`` (``ltx_mgpu.client.model``), the call our
  ``MODEL``'s ``diffusion_model`` makes once per step of ComfyUI's sampler, with what ComfyUI's
  ``BaseModel._apply_model`` passes: ``[video, audio]`` of the cond + uncond batch (2) in bf16 on
  the client's GPU, the ``(video, audio)`` sigmas, the processed text context (sent on the first
  call only). Timed from the call to the velocities on the client's GPU (``perf_counter`` after a
  synchronize); median of ``--runs`` after ``--warmup``. ComfyUI itself is not installed on the
  GPU machine: its own per-step Python (``calc_cond_batch``, the sampler update) is not counted
  here, and is the same whichever model it calls.
* ``pool_sampler_step``: our SP Sampler's step inside the pool (``sample`` with cfg 3: the same
  batch-2 forward, guidance and Euler update, no round trip per step), as
  ``(T(1 + n steps) - T(1 step)) / n`` of whole ``sample`` jobs, so its per-call set-up cancels.

Reported: both medians, ``overhead = model_path_step / pool_sampler_step - 1`` (goal of the
issue: <= 2 % at 6,144 tokens on one GPU), the bytes one forward sends and receives and how
(socket or shared memory), and the pool's GPU memory. ``--device cpu`` with small sizes is the
CPU smoke test (``tests/integration/test_bench_model_path.py``)::

    python benchmarks/bench_model_path.py --device cpu --layers 1 --video-heads 4 --video-head-dim 8 \\
        --audio-heads 4 --audio-head-dim 4 --caption-channels 64 --text-tokens 16 --audio-tokens 5 \\
        --shapes 2x3x4 --warmup 1 --runs 2 --steps 2
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import struct
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.bench_sp import add_model_arguments, transformer_config  # noqa: E402
from benchmarks.timing import sync, wall_ms, write_json  # noqa: E402
from ltx_mgpu.client.denoise import SampleRequest, remote_load_transformer, remote_sample  # noqa: E402
from ltx_mgpu.client.model import PoolModel  # noqa: E402
from ltx_mgpu.client.pool_client import PoolClient  # noqa: E402
from ltx_mgpu.denoise.plan import TransformerPlan
from ltx_mgpu.nested import NestedTensorLike  # noqa: E402

#: safetensors' dtype names (the format's header, https://github.com/huggingface/safetensors).
_ST_NAMES = {torch.bfloat16: "BF16", torch.float32: "F32", torch.float16: "F16"}
PREFIX = "model.diffusion_model."
#: The legs of one MODEL-path call, between ``PoolModel.last_clock`` marks (the client's
#: ``Job.clock`` and the pool's ``timeline``, one host clock): the client's preparation, the
#: request to the pool, its queue, the job (the transformer), the result back, the client's
#: hand-off and the copy to its GPU.
LEGS = {"client_prepare": ("call", "sent"), "to_pool": ("sent", "received"), "queue": ("received", "started"),
        "job": ("started", "finished"), "to_client": ("finished", "arrived"), "handoff": ("arrived", "queued"),
        "return_and_sync": ("queued", "end")}


def write_shaped_checkpoint(path: str | os.PathLike, config: dict, dtype: torch.dtype = torch.bfloat16) -> int:
    """Write a header-only LTX-2 checkpoint: every key and shape of ltx-core's ``LTXModel`` for
    ``config`` under ``model.diffusion_model.``, the ``config`` metadata, and the tensor data a
    sparse hole (zeros, no disk blocks). Returns the file size in bytes."""
    from ltx_core.model.transformer import LTXModelConfigurator

    with torch.device("meta"):
        model = LTXModelConfigurator.from_config(config)
    header, offset = {"__metadata__": {"config": json.dumps(config)}}, 0
    for name, t in model.state_dict().items():
        nbytes = t.numel() * dtype.itemsize
        header[PREFIX + name] = {"dtype": _ST_NAMES[dtype], "shape": list(t.shape), "data_offsets": [offset,
                                                                                                      offset + nbytes]}
        offset += nbytes
    raw = json.dumps(header).encode()
    raw += b" " * (-len(raw) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(raw)) + raw)
        f.truncate(8 + len(raw) + offset)
    return 8 + len(raw) + offset


def forward_inputs(shape: str, audio_tokens: int, text_tokens: int, width: int, device: torch.device,
                   dtype: torch.dtype, batch: int = 2) -> tuple[list, tuple, torch.Tensor]:
    """``(x, timesteps, context)`` of one MODEL-path call for a latent ``"FxHxW"``: a batch of
    ``batch`` guidance passes (2: cond + uncond; video ``[B, 128, F, H, W]``, audio
    ``[B, 8, N, 16]``), sigma 0.9 for all, a processed text context ``[B, L, width]``; seeded, on
    ``device`` in ``dtype``."""
    f, h, w = _shape(shape)
    g = torch.Generator().manual_seed(1)
    x = [torch.randn(batch, 128, f, h, w, generator=g).to(device, dtype),
         torch.randn(batch, 8, audio_tokens, 16, generator=g).to(device, dtype)]
    t = (torch.full((batch,), 0.9, device=device), torch.full((batch,), 0.9, device=device))
    return x, t, torch.randn(batch, text_tokens, width, generator=g).to(device, dtype)


def time_forward(pm: PoolModel, shape: str, args, width: int, device: torch.device, dtype: torch.dtype):
    """``(video tokens, median ms, every run's ms, the last output)`` of ``pm.forward`` on
    :func:`forward_inputs` of ``shape`` (``args``: ``audio_tokens``, ``text_tokens``, ``warmup``,
    ``runs``, and ``batch`` where it has one: 2 otherwise), wall clock (``timing.wall_ms``: the
    call waits on the pool)."""
    x, t, context = forward_inputs(shape, args.audio_tokens, args.text_tokens, width, device, dtype,
                                   getattr(args, "batch", 2))
    box = {}

    def call():
        box["out"] = pm.forward(x, t, context, frame_rate=24.0)

    median, times = wall_ms(device, call, args.warmup, args.runs)
    f, h, w = _shape(shape)
    return f * h * w, median, times, box["out"]


def _shape(text: str) -> tuple[int, int, int]:
    f, h, w = (int(x) for x in text.lower().split("x"))
    return f, h, w


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_model_arguments(ap)
    ap.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    ap.add_argument("--gpus", default="0", help="the pool's GPUs (--device cuda)")
    ap.add_argument("--nproc", type=int, default=1, help="CPU ranks (--device cpu)")
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--runs", type=int, default=7)
    ap.add_argument("--steps", type=int, default=6, help="n of the in-pool step estimate")
    ap.add_argument("--checkpoint", help="an LTX-2 file to use instead of the header-only one")
    ap.add_argument("--out", help="JSON results")
    a = ap.parse_args(argv)
    device = torch.device("cuda:0" if a.device == "cuda" else "cpu")
    dtype = torch.bfloat16 if a.device == "cuda" else torch.float32
    work = Path(tempfile.mkdtemp(prefix="lm-bench-", dir="/tmp"))
    config = transformer_config(a)
    checkpoint = a.checkpoint or str(work / "ltx2-19b-shaped.safetensors")
    results: dict = {"config": config["transformer"], "device": torch.cuda.get_device_name(0)
                     if a.device == "cuda" else "cpu", "sizes": {}}
    if not a.checkpoint:
        t0 = time.perf_counter()
        results["checkpoint_bytes"] = write_shaped_checkpoint(checkpoint, config, dtype)
        print(f"header-only checkpoint: {results['checkpoint_bytes'] / 2**30:.1f} GiB in "
              f"{time.perf_counter() - t0:.1f} s", flush=True)
    gpus = a.gpus if a.device == "cuda" else "cpu"
    client = PoolClient.connect(gpus=gpus, nproc=a.nproc if a.device == "cpu" else None, runtime_dir=work / "rt",
                                lifetime="with-owner", startup_timeout=300)
    try:
        t0 = time.perf_counter()
        name = {"cuda": "bf16", "cpu": "fp32"}[a.device]
        loaded = remote_load_transformer(client, TransformerPlan(checkpoint, dtype=name, max_tokens=1 << 17))
        results["load_s"] = time.perf_counter() - t0
        results["pool_bytes"] = loaded["bytes"]
        print(f"loaded in {results['load_s']:.1f} s ({loaded['bytes'] / 2**30:.1f} GiB per rank)", flush=True)
        width = sum(loaded["context_widths"])
        pm = PoolModel(lambda: client, lambda: None, loaded["model"])
        for text in a.shapes.split(","):
            f, h, w = _shape(text)
            g = torch.Generator().manual_seed(1)
            video = torch.randn(1, 128, f, h, w, generator=g)
            audio = torch.randn(1, 8, a.audio_tokens, 16, generator=g)
            ctx = [torch.randn(1, a.text_tokens, width, generator=g) for _ in range(2)]
            x = [video.repeat(2, 1, 1, 1, 1).to(device, dtype), audio.repeat(2, 1, 1, 1).to(device, dtype)]
            t = (torch.full((2,), 0.9, device=device), torch.full((2,), 0.9, device=device))
            context = torch.cat(ctx).to(device, dtype)

            legs: dict[str, list[float]] = {k: [] for k in LEGS}

            def model_step():
                start = time.monotonic()
                out = pm.forward(x, t, context, frame_rate=24.0)
                sync(device)
                marks = {"call": start, **pm.last_clock, "end": time.monotonic()}
                for (name, (a0, a1)) in LEGS.items():
                    legs[name].append((marks[a1] - marks[a0]) * 1e3)
                return out

            for _ in range(a.warmup):
                model_step()
            legs = {k: [] for k in LEGS}
            times = []
            for _ in range(a.runs):
                t0 = time.perf_counter()
                model_step()
                times.append((time.perf_counter() - t0) * 1e3)
            model_ms = statistics.median(times)

            cond = [[[c, {"pooled_output": None}]] for c in ctx]  # processed 2.0 context, as ComfyUI's compat form
            latent = {"samples": NestedTensorLike([video, audio]), "type": "audio"}

            def sample_ms(steps: int) -> float:
                sigmas = torch.linspace(0.9, 0.0, steps + 1)
                t0 = time.perf_counter()
                remote_sample(client, SampleRequest(cond[0], cond[1], latent, sigmas=sigmas, cfg=3.0, seed=1))
                return (time.perf_counter() - t0) * 1e3

            sample_ms(1)  # warm
            one = statistics.median(sample_ms(1) for _ in range(max(1, a.runs // 2)))
            many = statistics.median(sample_ms(1 + a.steps) for _ in range(max(1, a.runs // 2)))
            pool_ms = (many - one) / a.steps
            sent = sum(v.numel() * v.element_size() for v in x) + 2 * 2 * 4
            got = sent - 2 * 2 * 4
            row = {"video_tokens": f * h * w, "model_path_step_ms": model_ms, "model_path_runs_ms": times,
                   "model_path_legs_ms": {k: statistics.median(v) for k, v in legs.items()},
                   "pool_sampler_step_ms": pool_ms, "sample_1_step_ms": one, f"sample_{1 + a.steps}_steps_ms": many,
                   "overhead": model_ms / pool_ms - 1.0, "bytes_sent_per_step": sent,
                   "bytes_received_per_step": got, "context_bytes_once": context.numel() * context.element_size(),
                   "transport": "shared memory" if client.shm_stats["enabled"] else "socket",
                   "shm": client.shm_stats}
            results["sizes"][str(f * h * w)] = row
            print(f"{f * h * w:>6} video tokens: MODEL path {model_ms:8.1f} ms/step, in-pool sampler "
                  f"{pool_ms:8.1f} ms/step, overhead {100 * row['overhead']:+.2f} % "
                  f"({sent / 2**20:.1f} MiB sent, {got / 2**20:.1f} MiB received per step)", flush=True)
            print("        legs (ms): " + ", ".join(f"{k} {v:.2f}" for k, v in row["model_path_legs_ms"].items()),
                  flush=True)
            if a.out:
                write_json(a.out, results)
        results["pool_status"] = client.status()
        if a.out:
            write_json(a.out, results)
    finally:
        client.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
