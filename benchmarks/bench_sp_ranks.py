"""Sequence-parallel denoising across N ranks: step latency, scaling efficiency and parity.

On a machine with several GPUs (one process per GPU, NCCL; the multi-GPU issue's numbers)::

    python benchmarks/bench_sp_ranks.py --world-sizes 1,2,4,8 --out benchmarks/results/sp_ranks_h200.json

CPU smoke test (gloo ranks, a tiny model; what ``tests/integration/test_bench_ranks.py`` runs)::

    python benchmarks/bench_sp_ranks.py --device cpu --world-sizes 1,2 --layers 1 --video-heads 4 \\
        --video-head-dim 8 --audio-heads 4 --audio-head-dim 4 --caption-channels 64 --text-tokens 16 \\
        --audio-tokens 5 --shapes 2x3x4,1x3x5 --warmup 1 --runs 2

For each world size N (``--world-sizes``) it starts N processes (``torch.multiprocessing``,
spawn; a TCP rendezvous on a free local port), each building the same LTX-2 19B-shaped
transformer (``bench_sp.build_model``: meta build, deterministic random fill from one seed, so
the replicas are equal) on its own GPU in bf16 (float32 on CPU) and wrapping it in our
``SequenceParallelTransformer`` over the world group. Per size (``--shapes``, latent FxHxW;
default 6,144 and 24,576 video tokens, with 126 audio and 1,024 text tokens as in
``bench_sp``) it times **one sampler step's forward**: the batched cond + uncond call (batch
2) at sigma 0.9, ``--warmup`` untimed then ``--runs`` timed, every rank starting each run
together (a barrier) and the run's time being the slowest rank's (an all-reduce of max);
the median is reported. Rank 0 also profiles one call (``torch.profiler``) to split the GPU
kernel time into communication (NCCL / gloo kernels and ops) and compute.

Printed and written (``--out``, JSON): per size and world size the median step time T_N, the
speed-up T_1 / T_N and the efficiency T_1 / (N * T_N) (goals of the multi-GPU issue at 8 GPUs:
>= 0.88 at 24,576 tokens, >= 0.75 at 6,144), the communication share of kernel time, and the
largest |difference| of the velocities from world size 1 (the collectives move bytes, so only
the reduction order differs; bf16 on GPU). Times are CUDA events (GPU) or perf_counter (CPU),
milliseconds.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.bench_sp import (  # noqa: E402
    add_model_arguments,
    build_model,
    make_inputs,
    modalities,
    profiled_self_times,
    transformer_config,
)
from benchmarks.timing import write_json  # noqa: E402
from ltx_mgpu.client.launch import free_port  # noqa: E402

COMM_KERNELS = ("nccl", "gloo", "all_to_all", "allgather", "all_gather", "alltoall")
#: efficiency goals of the multi-GPU issue at 8 GPUs, by video tokens
GOALS = {24576: 0.88, 6144: 0.75}


def _comm_share(fn, device: torch.device) -> dict:
    """Communication's share of one call's GPU kernel time (CPU: op time), via torch.profiler."""
    times = profiled_self_times(fn, device)
    total = sum(t for _, t in times)
    comm = sum(t for k, t in times if any(s in k.lower() for s in COMM_KERNELS))
    return {"comm_ms": comm / 1e3, "total_ms": total / 1e3, "comm_share": comm / total if total else None}


def _rank_main(rank: int, world: int, port: int, a: argparse.Namespace, out_dir: str) -> None:
    """One rank: build, wrap, time every size; rank 0 writes its timings and velocities."""
    from safetensors.torch import save_file

    from ltx_mgpu.denoise.parallel.ulysses import SequenceParallelTransformer

    cuda = a.device == "cuda"
    device = torch.device("cuda", rank) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    kw = {"device_id": device} if cuda else {}
    dist.init_process_group("nccl" if cuda else "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world, **kw)
    try:
        dtype = torch.bfloat16 if cuda else torch.float32
        config = transformer_config(a)
        model = build_model(config, device, dtype)
        shapes = [tuple(int(x) for x in s.split("x")) for s in a.shapes.split(",")]
        sp = SequenceParallelTransformer(model, None, max(f * h * w for f, h, w in shapes))
        report: dict = {"world_size": world, "sizes": {}}
        outputs = {}
        for shape in shapes:
            tokens = shape[0] * shape[1] * shape[2]
            _, state, ctxs = make_inputs(shape, a.audio_tokens, a.text_tokens, a.caption_channels, device, dtype)
            video, audio = modalities(state, torch.cat(ctxs), device, dtype)  # batch 2: cond + uncond

            def step():
                return sp(video, audio, None)

            times = []
            with torch.inference_mode():
                vx, ax = step()
                outputs[f"video_{tokens}"] = vx.float().cpu().contiguous()
                outputs[f"audio_{tokens}"] = ax.float().cpu().contiguous()
                for i in range(a.warmup + a.runs):
                    dist.barrier()
                    if cuda:
                        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                        start.record()
                        step()
                        end.record()
                        end.synchronize()
                        ms = start.elapsed_time(end)
                    else:
                        t0 = time.perf_counter()
                        step()
                        ms = (time.perf_counter() - t0) * 1e3
                    slowest = torch.tensor([ms], dtype=torch.float64, device=device if cuda else "cpu")
                    dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
                    if i >= a.warmup:
                        times.append(float(slowest))
                comm = _comm_share(step, device) if a.profile else None
            report["sizes"][str(tokens)] = {"latent": list(shape), "times_ms": times,
                                            "median_ms": statistics.median(times), "profile": comm,
                                            "peak_gb": torch.cuda.max_memory_allocated(device) / 1e9 if cuda else None}
            if rank == 0:
                print(f"world size {world}, {tokens} video tokens: {statistics.median(times):.2f} ms per step"
                      + (f" (communication {comm['comm_share']:.1%} of kernel time)" if comm and comm["comm_share"]
                         is not None else ""), flush=True)
        if rank == 0:
            save_file(outputs, os.path.join(out_dir, f"velocities_ws{world}.safetensors"))
            Path(out_dir, f"report_ws{world}.json").write_text(json.dumps(report))
    finally:
        dist.destroy_process_group()


def run_world(world: int, a: argparse.Namespace, out_dir: str) -> dict:
    """Start ``world`` ranks and return rank 0's report (raises if any rank failed)."""
    if a.device == "cuda" and world > torch.cuda.device_count():
        raise SystemExit(f"world size {world} needs {world} GPUs; {torch.cuda.device_count()} visible")
    mp.start_processes(_rank_main, args=(world, free_port(), a, out_dir), nprocs=world, start_method="spawn")
    return json.loads(Path(out_dir, f"report_ws{world}.json").read_text())


def summarise(reports: dict[int, dict], out_dir: str) -> dict:
    """Speed-up, efficiency and parity vs world size 1, per size and world size."""
    from safetensors.torch import load_file

    base = reports[min(reports)]
    ref = load_file(os.path.join(out_dir, f"velocities_ws{min(reports)}.safetensors"))
    summary: dict = {}
    for world, rep in sorted(reports.items()):
        got = load_file(os.path.join(out_dir, f"velocities_ws{world}.safetensors"))
        for tokens, size in rep["sizes"].items():
            t1 = base["sizes"][tokens]["median_ms"] * min(reports)  # T_1 (or the smallest world's time x its size)
            tn = size["median_ms"]
            diff = max((got[f"{k}_{tokens}"] - ref[f"{k}_{tokens}"]).abs().max().item() for k in ("video", "audio"))
            summary.setdefault(tokens, {})[world] = {
                "median_ms": tn, "speedup": t1 / tn, "efficiency": t1 / (world * tn),
                "max_abs_diff_vs_ws1": diff, "comm_share": (size["profile"] or {}).get("comm_share")}
    return summary


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    ap.add_argument("--world-sizes", default="1,2,4,8")
    add_model_arguments(ap)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--no-profile", dest="profile", action="store_false")
    ap.add_argument("--out", default=None, help="write raw results as JSON here")
    a = ap.parse_args(argv)
    worlds = sorted({int(w) for w in a.world_sizes.split(",")})
    if worlds[0] < 1:
        ap.error("world sizes must be >= 1")
    results: dict = {"device": torch.cuda.get_device_name(0) if a.device == "cuda" else "cpu",
                     "torch": torch.__version__, "args": vars(a), "worlds": {}}
    with tempfile.TemporaryDirectory(prefix="bench-sp-ranks-") as out_dir:
        reports = {}
        for world in worlds:
            reports[world] = run_world(world, a, out_dir)
            results["worlds"][str(world)] = reports[world]
        summary = summarise(reports, out_dir)
    results["summary"] = {str(t): {str(w): v for w, v in row.items()} for t, row in summary.items()}
    if a.out:
        write_json(a.out, results)
    print(f"\n{'tokens':>7}{'world':>6}{'step ms':>10}{'speed-up':>10}{'efficiency':>11}{'comm':>7}{'max |diff|':>12}")
    for tokens, row in summary.items():
        for world, v in row.items():
            comm = f"{v['comm_share']:.0%}" if v["comm_share"] is not None else "-"
            print(f"{tokens:>7}{world:>6}{v['median_ms']:>10.2f}{v['speedup']:>10.2f}{v['efficiency']:>11.3f}"
                  f"{comm:>7}{v['max_abs_diff_vs_ws1']:>12.3g}")
    for tokens, goal in GOALS.items():
        row = summary.get(str(tokens), {})
        if 8 in row:
            verdict = "ok" if row[8]["efficiency"] >= goal else "MISS"
            print(f"goal at 8 ranks, {tokens} tokens: efficiency >= {goal}: {row[8]['efficiency']:.3f} ({verdict})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
