"""What our pool MODEL costs ComfyUI's process: RSS (and CUDA memory, on a GPU) before and after
building it, and the size ComfyUI's model management sees.

Run with ComfyUI's Python (``COMFYUI_DIR`` = the checkout)::

    COMFYUI_DIR=... $COMFYUI_PYTHON benchmarks/comfy_model_memory.py CHECKPOINT... --shaped \\
        --out benchmarks/results/comfy_model_memory.json

Each checkpoint (the tiny one, and ``bench_model_path.write_shaped_checkpoint``'s header-only
19B-shaped file: ``--shaped``) goes through ``nodes._model.pool_model_patcher`` with a
``PoolModel`` that is never called (no pool: the pool's side is measured by
``bench_model_path.py``), in a fresh process each, so one does not hide the other's growth.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def measure(checkpoint: str) -> dict:
    """In this process: ComfyUI imported, then our MODEL built for ``checkpoint``."""
    sys.path.insert(0, os.environ["COMFYUI_DIR"])
    from comfy.cli_args import args

    args.cpu = not os.environ.get("CUDA_VISIBLE_DEVICES") and not Path("/dev/nvidia0").exists()
    import comfy.model_management  # noqa: F401 - ComfyUI's device set-up, before the measure
    import torch

    sys.path.insert(0, str(REPO))
    from benchmarks.comfy_pack import load_pack

    load_pack()
    from ltx_mgpu.client.model import PoolModel

    model_mod = sys.modules["ltx_mgpu_pack.nodes._model"]
    cuda = torch.cuda.is_available()
    rss0, cuda0 = _rss(), torch.cuda.memory_allocated() if cuda else None
    t0 = time.perf_counter()
    patcher = model_mod.pool_model_patcher(PoolModel(lambda: None, lambda: None), checkpoint, "bfloat16")
    seconds = time.perf_counter() - t0
    keys = len(patcher.model_state_dict())
    return {"checkpoint": checkpoint, "file_bytes": os.path.getsize(checkpoint), "build_s": seconds,
            "rss_growth_bytes": _rss() - rss0, "cuda_growth_bytes": (torch.cuda.memory_allocated() - cuda0) if cuda
            else None, "model_size_seen_by_comfyui": patcher.model_size(), "state_dict_keys": keys}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("checkpoints", nargs="*")
    ap.add_argument("--shaped", action="store_true", help="also a header-only 19B-shaped file")
    ap.add_argument("--one", help=argparse.SUPPRESS)  # the child: measure this file, print JSON
    ap.add_argument("--out")
    a = ap.parse_args(argv)
    if a.one:
        print(json.dumps(measure(a.one)))
        return 0
    files = list(a.checkpoints)
    if a.shaped:
        sys.path.insert(0, str(REPO))
        from benchmarks.bench_model_path import write_shaped_checkpoint
        from benchmarks.bench_sp import add_model_arguments, transformer_config

        p = argparse.ArgumentParser()
        add_model_arguments(p)
        config = transformer_config(p.parse_args([]))
        path = Path(tempfile.mkdtemp(prefix="lm-mem-", dir="/tmp")) / "ltx2-19b-shaped.safetensors"
        write_shaped_checkpoint(path, config)
        files.append(str(path))
    rows = []
    for f in files:
        out = subprocess.run([sys.executable, __file__, "--one", f], capture_output=True, text=True, check=True)
        rows.append(json.loads(out.stdout.strip().splitlines()[-1]))
        r = rows[-1]
        print(f"{Path(f).name}: {r['file_bytes'] / 2**30:.2f} GiB file, built in {r['build_s']:.2f} s, RSS "
              f"+{r['rss_growth_bytes'] / 2**20:.1f} MiB, ComfyUI sees {r['model_size_seen_by_comfyui']} byte(s), "
              f"{r['state_dict_keys']} keys")
    if a.out:
        sys.path.insert(0, str(REPO))
        from benchmarks.timing import write_json

        write_json(a.out, {"rows": rows})
    return 0


if __name__ == "__main__":
    sys.exit(main())
