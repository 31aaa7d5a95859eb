"""Timing and memory probes shared by the benchmarks (one definition, so every table is
measured the same way; see /work/.library/device/METHOD.md: warm up, device events, medians),
and the writer of their raw results."""

from __future__ import annotations

import json
import os
import statistics
import time
from typing import Callable

import torch

from ltx_mgpu.files import make_parent, umask_mode, write_atomically


def write_json(path: str | os.PathLike, data: dict) -> None:
    """Write a benchmark's raw results as indented JSON, atomically (``ltx_mgpu.files``: a
    reader, or a run cut short by a time limit, never leaves a partial file), making its
    directory. Called after every cell, so a run that is stopped keeps what it measured."""
    write_atomically(make_parent(path), json.dumps(data, indent=1).encode(), mode=umask_mode())


def sync(device: torch.device) -> None:
    """Wait for ``device``'s queued work (no-op off CUDA)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_ms(device: torch.device, fn: Callable[[], object], warmup: int, runs: int) -> tuple[float, list[float]]:
    """``(median, all times)`` of ``fn`` in milliseconds after ``warmup`` untimed calls: CUDA
    events on a GPU (each run synchronised on its end event), ``time.perf_counter`` elsewhere."""
    for _ in range(warmup):
        fn()
    sync(device)
    times = []
    for _ in range(runs):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        else:
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times), times


def wall_ms(device: torch.device, fn: Callable[[], object], warmup: int, runs: int) -> tuple[float, list[float]]:
    """``(median, all times)`` of ``fn`` in wall-clock milliseconds (``time.perf_counter``, each
    run synchronised with ``device``) after ``warmup`` untimed calls: for calls that wait on
    another process, such as a pool round trip."""
    for _ in range(warmup):
        fn()
    sync(device)
    times = []
    for _ in range(runs):
        t0 = time.perf_counter()
        fn()
        sync(device)
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times), times


def peak_bytes(device: torch.device, fn: Callable[[], object]) -> int | None:
    """Peak allocated device memory in bytes while ``fn`` runs (``None`` off CUDA, where ``fn``
    still runs once)."""
    if device.type != "cuda":
        fn()
        return None
    sync(device)
    torch.cuda.reset_peak_memory_stats(device)
    fn()
    sync(device)
    return torch.cuda.max_memory_allocated(device)


def warm_gpu(device: torch.device, seconds: float = 3.0) -> None:
    """Keep ``device`` busy with bf16 GEMMs for ``seconds`` before the first timed variant, so that
    it does not pay for the clocks ramping up (on the H200 the first-timed variant of a run came
    out 30-50 % slower than the same work timed later). No-op off CUDA."""
    if device.type != "cuda":
        return
    a = torch.randn(8192, 8192, device=device, dtype=torch.bfloat16)
    t0 = time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        for _ in range(10):
            a @ a
        sync(device)


def time_interleaved(device: torch.device, fns: dict[str, Callable[[], object]], warmup: int,
                     runs: int) -> dict[str, tuple[float, list[float]]]:
    """Like :func:`time_ms` for several functions timed in turn (round ``r`` runs each once), so
    that a drift of the device's speed during the run (clocks, power, a neighbour) affects all of
    them alike: ``{name: (median ms, all times)}``."""
    for _ in range(warmup):
        for fn in fns.values():
            fn()
    sync(device)
    times: dict[str, list[float]] = {k: [] for k in fns}
    for _ in range(runs):
        for k, fn in fns.items():
            times[k].append(time_ms(device, fn, 0, 1)[0])
    return {k: (statistics.median(v), v) for k, v in times.items()}
