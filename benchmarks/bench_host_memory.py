"""Host memory per rank when a CPU pool loads a GGUF transformer: flat in the world size?

Run on the dev machine (CPU ranks)::

    python benchmarks/bench_host_memory.py --out benchmarks/results/host_memory_cpu.json

A transformer of the LTX-2.3 layout (``--layers`` blocks, ``--heads`` x 64 wide video and audio
streams; random weights) is written as a float32 file and exported as Q8_0 GGUF (the blocks'
linears Q8_0, ``ltx_mgpu.assets.ggml_export``). A pool of 1, 2 and 4 CPU ranks loads it
replicated and sharded (``TransformerPlan(..., dtype="fp32")``); each rank's resident set size
(``/proc/<pid>/status``: ``RssAnon``, the rank's own memory, and ``RssFile``, the file pages it has
mapped, shared with the page cache and the other ranks) is read before and after the load, one
fresh pool per case: the growth is what the load costs the host per rank (the first import of
ltx-core's model code included). Every rank memory-maps the file and reads only its own rows of a
sharded weight, so sharded growth should shrink as 1/W and replicated growth stay the packed
model's size, whatever W (a rank that dequantized the file would show the float32 size).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import torch
from safetensors.torch import save_file

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.bench_sp import build_model  # noqa: E402
from benchmarks.timing import write_json  # noqa: E402
from ltx_mgpu.assets.geometry import tiny_transformer_config  # noqa: E402
from ltx_mgpu.assets.ggml_export import block_linear_types, export_gguf  # noqa: E402
from ltx_mgpu.client.denoise import remote_load_transformer  # noqa: E402
from ltx_mgpu.client.pool_client import PoolClient  # noqa: E402
from ltx_mgpu.denoise.plan import TransformerPlan  # noqa: E402


def write_model(directory: Path, layers: int, heads: int) -> tuple[Path, int]:
    """The float32 file and its Q8_0 GGUF export; returns (gguf path, float32 bytes)."""
    cfg = tiny_transformer_config("2.3")
    for k in [k for k in cfg if k.startswith("connector_")] + ["use_embeddings_connector"]:
        cfg.pop(k, None)
    width = heads * 64
    cfg.update(num_layers=layers, num_attention_heads=heads, attention_head_dim=64, cross_attention_dim=width,
               audio_num_attention_heads=heads, audio_attention_head_dim=64, audio_cross_attention_dim=width,
               caption_channels=width)
    model = build_model({"transformer": cfg}, torch.device("cpu"), torch.float32)
    f32 = directory / "model_f32.safetensors"
    sd = {k: v.contiguous() for k, v in model.state_dict().items()}
    save_file(sd, str(f32), metadata={"config": json.dumps({"transformer": cfg})})
    size = sum(v.numel() * 4 for v in sd.values())
    del model, sd
    return export_gguf(f32, directory / "model-Q8_0.gguf", block_linear_types("Q8_0")), size


def resident(pool) -> list[dict[str, int]]:
    """Each rank's ``RssAnon`` and ``RssFile`` (bytes), by the pids in its status."""
    out = []
    for r in pool.status()["ranks"]:
        fields = dict(line.split(":", 1) for line in Path(f"/proc/{r['pid']}/status").read_text().splitlines())
        out.append({k: int(fields[k].split()[0]) * 1024 for k in ("RssAnon", "RssFile")})
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--world-sizes", default="1,2,4")
    ap.add_argument("--out", default=None)
    a = ap.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="ltx-host-mem-") as tmp:
        t0 = time.perf_counter()
        path, f32_bytes = write_model(Path(tmp), a.layers, a.heads)
        res = {"file_bytes": path.stat().st_size, "float32_bytes": f32_bytes, "layers": a.layers, "heads": a.heads,
               "export_s": time.perf_counter() - t0, "runs": []}
        print(f"GGUF {res['file_bytes'] / 2**20:.0f} MiB (float32 {f32_bytes / 2**20:.0f} MiB)", flush=True)
        for world in (int(w) for w in a.world_sizes.split(",")):
            for weights in ("replicated", "sharded"):
                pool = PoolClient.connect(gpus="cpu", nproc=world, runtime_dir=Path(tmp) / f"rt{world}{weights}",
                                          lifetime="with-owner", startup_timeout=180)
                try:
                    before = resident(pool)
                    t0 = time.perf_counter()
                    loaded = remote_load_transformer(pool, TransformerPlan(str(path), dtype="fp32", weights=weights),
                                                     name="m", timeout=900)
                    seconds = time.perf_counter() - t0
                    after = resident(pool)
                finally:
                    pool.shutdown()
                growth = {k: [b[k] - a_[k] for a_, b in zip(before, after)] for k in ("RssAnon", "RssFile")}
                res["runs"].append({"world": world, "weights": weights, "growth": growth, "seconds": seconds,
                                    "held_bytes": loaded["bytes"], "linears": loaded["plan"]["linears"]})
                print(f"world {world} {weights}: per rank own memory +"
                      + ", ".join(f"{g / 2**20:.0f}" for g in growth["RssAnon"]) + " MiB, file pages +"
                      + ", ".join(f"{g / 2**20:.0f}" for g in growth["RssFile"])
                      + f" MiB (held {loaded['bytes'] / 2**20:.0f} MiB), {seconds:.1f} s", flush=True)
    if a.out:
        write_json(a.out, res)
    return 0


if __name__ == "__main__":
    sys.exit(main())
