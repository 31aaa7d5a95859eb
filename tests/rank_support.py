"""Multi-rank tests as real processes: start one Python process per rank and wait for all."""

from __future__ import annotations

import os
import subprocess
import sys


def run_rank_processes(script: str, arg: str, world: int, timeout: float) -> list[str]:
    """Run ``python script arg r`` for every rank ``r`` in ``range(world)`` (one thread each, this
    interpreter's import path) and wait for all of them; ranks still alive after ``timeout``
    seconds, or when waiting fails, are killed.

    Returns:
        Each rank's combined stdout/stderr.

    Raises:
        AssertionError: a rank exited non-zero (names the first such rank, with its output).
        subprocess.TimeoutExpired: a rank ran past ``timeout`` seconds.
    """
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": os.pathsep.join(sys.path)}
    procs = [subprocess.Popen([sys.executable, script, arg, str(r)], env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True) for r in range(world)]
    logs = []
    try:
        for p in procs:
            logs.append(p.communicate(timeout=timeout)[0])
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    for r, p in enumerate(procs):
        assert p.returncode == 0, f"rank {r} exited with {p.returncode}:\n{logs[r]}"
    return logs
