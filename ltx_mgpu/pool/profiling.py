"""Opt-in profiling of the pool's jobs (:data:`ltx_mgpu.settings.PROFILE_JOBS`), kept out of the worker loop."""

from __future__ import annotations

import contextlib
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

from ltx_mgpu import settings

# What :data:`ltx_mgpu.settings.PROFILE_JOBS` = N does: profile the pool's first N jobs on every
# rank (torch.profiler, CPU + CUDA activity) and write each as a Chrome trace,
# ``profile-<job type>-<job id>-rank<r>.json`` in the runtime directory (beside ``pool.log``; open
# in Perfetto or chrome://tracing): where a request's time goes inside the pool, host gaps
# included. Read when the pool starts (checked by the launcher first, so a bad value is one clear
# error).


class JobProfiler:
    """Counts the jobs it profiled; every rank runs every job, so all ranks profile the same ones."""

    def __init__(self, limit: int | None = None):
        self.limit = settings.PROFILE_JOBS.get() if limit is None else int(limit)
        self.done = 0

    @contextlib.contextmanager
    def job(self, spec: dict, rank: int, device: torch.device, out_dir: Path):
        """Profile the body into ``out_dir`` while fewer than :attr:`limit` jobs have been; a
        trace that cannot be written is reported in ``pool.log``, never the job's failure."""
        if self.done >= self.limit:
            yield
            return
        self.done += 1

        acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
        prof = profile(activities=acts)
        prof.__enter__()
        try:
            yield
        finally:
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            prof.__exit__(None, None, None)
            path = Path(out_dir) / f"profile-{spec['type']}-{spec['id']}-rank{rank}.json"
            try:
                prof.export_chrome_trace(str(path))
                print(f"[rank {rank}] profile of {spec['type']} job {spec['id']}: {path}", flush=True)
            except OSError as e:
                print(f"[rank {rank}] could not write the profile {path}: {e}", flush=True)
