"""The machine a benchmark ran on, and how fast its host does the host's part of an encode.

Lent GPU machines differ in their hosts (CPU model, load, memory), and an encode whose result is
written on the host, or whose kernels are launched faster than the GPU runs them only with some
margin, measures the host as well as the GPU. :func:`host_info` records what the machine is;
:func:`host_probes` times the host work of one encode in isolation, so that two runs' numbers can
be told apart by their hosts."""

from __future__ import annotations

import importlib.metadata
import os
import platform
import statistics
import time
from typing import Callable

import torch


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def _version(package: str) -> str | None:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return None


def host_info(device: torch.device) -> dict:
    """CPU model, logical CPUs (all / usable by this process), load average, torch's CPU threads,
    the versions of torch, Triton, transformers and CUDA, and the GPU's name."""
    usable = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return {
        "cpu": _cpu_model(), "cpus": os.cpu_count(), "cpus_usable": usable,
        "loadavg_1_5_15": list(os.getloadavg()) if hasattr(os, "getloadavg") else None,
        "torch_threads": torch.get_num_threads(), "python": platform.python_version(),
        "torch": torch.__version__, "triton": _version("triton"), "transformers": _version("transformers"),
        "cuda": torch.version.cuda,
        "gpu": torch.cuda.get_device_name(device) if device.type == "cuda" else None,
    }


def _median_ms(fn: Callable[[], object], runs: int) -> float:
    fn()
    times = []
    for _ in range(runs):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def host_probes(device: torch.device, tokens: int = 1024, width: int = 6144, batches: tuple[int, ...] = (1, 8),
                runs: int = 7) -> dict:
    """Host times (median ms of ``runs``) of the host's part of an encode of ``batch x tokens``
    LTX-2.3 rows of ``width`` (``PromptEncoder._project_rows``):

    * ``upcast_rows_ms/<b>``: ``b`` bf16 rows (pinned on a GPU machine) made float32 CPU tensors of
      their own, all kept until the last is made (as the encode returns them: fresh memory);
    * ``upcast_into_ms/<b>``: the same upcasts into float32 tensors made (and touched) beforehand:
      the conversion alone, so ``upcast_rows - upcast_into`` is the host's first touch of fresh
      memory (page faults, zeroing), which differs between hosts;
    * ``isfinite_rows_ms/<b>``: ``torch.isfinite(row).all()`` on each float32 row (the finite
      check of fa442e1); ``aminmax_rows_ms/<b>``: ``torch.aminmax`` on each (the same answer in
      one pass);
    * ``launch_us``: enqueueing one small CUDA kernel (a host's launch speed; GPU only).
    """
    pin = device.type == "cuda"
    row = torch.empty(tokens, width, dtype=torch.bfloat16, pin_memory=pin)
    row.copy_(torch.randn(tokens, width))
    rows32 = [row.float() for _ in range(max(batches))]
    dest = [torch.zeros(tokens, width) for _ in range(max(batches))]
    out: dict = {}
    for b in batches:
        out[f"upcast_rows_ms/{b}"] = _median_ms(lambda b=b: [row.to(torch.float32, copy=True) for _ in range(b)], runs)
        out[f"upcast_into_ms/{b}"] = _median_ms(lambda b=b: [d.copy_(row) for d in dest[:b]], runs)
        out[f"isfinite_rows_ms/{b}"] = _median_ms(lambda b=b: [bool(torch.isfinite(r).all()) for r in rows32[:b]],
                                                  runs)
        out[f"aminmax_rows_ms/{b}"] = _median_ms(lambda b=b: [torch.aminmax(r) for r in rows32[:b]], runs)
    if device.type == "cuda":
        x = torch.zeros(1, device=device)
        n = 2000

        def launches():
            for _ in range(n):
                x.add_(1)
            torch.cuda.synchronize(device)

        out["launch_us"] = _median_ms(launches, 5) * 1e3 / n
    return out
