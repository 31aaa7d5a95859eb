"""The cost of the load-time finite checks (``ltx_mgpu.finite``, run by ``StateDictLoader`` on every
tensor it reads): against reading the tensors, and against the naive ``torch.isfinite(t).all()``.

Run on one GPU (the lead's command; the whole 19B-shaped model, bf16 and fp8)::

    python benchmarks/bench_finite_checks.py --device cuda --out benchmarks/results/finite_checks_h200.json

On the CPU the whole model does not fit a small machine's memory: ``--layers`` keeps the 19B
widths and takes fewer of its 48 blocks (every block costs the same)::

    python benchmarks/bench_finite_checks.py --device cpu --layers 2 --out benchmarks/results/finite_checks_cpu.json

Model: the LTX-2 **19B-shaped** transformer of ``bench_sp`` (48 blocks, video 32 x 128, audio
32 x 64, the LTX-2.0 layout), stored as a **header-only** ``.safetensors`` file
(``bench_model_path.write_shaped_checkpoint``: the real key names, shapes and ``config``
metadata, the data a sparse hole that reads as zeros), in bf16 and, with ``--fp8`` (default on),
again with its 2-D block weights stored as float8 e4m3 (what an fp8 file holds; a plain cast, no
scales). Per tensor, as the loader reads it: safetensors' memory-mapped tensor copied to the
device (``read``), then the shipped check (``check``: ``ltx_mgpu.finite.nonfinite``, its flag read
back) and the naive one (``isfinite``: ``torch.isfinite(t).all()``; torch has none for float8:
there the float32 upcast's, as a loader without the byte test would do), each timed alone with
a synchronize. The check's cost does not depend on the values (a reduction over every element),
so zeros time as real weights do; a sparse hole reads faster than a real file (no disk, no page
cache), so ``check / read`` is an upper bound of the check's share of a real load. Also timed:
one ``load_ltx_model`` of the bf16 file as shipped (its checks included), for scale.

Reported per file: the seconds of ``read``, ``check`` and ``isfinite`` summed over the tensors,
``check / read`` and ``isfinite / check``, the bytes read.
"""

from __future__ import annotations

import argparse
import json
import struct
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.bench_model_path import PREFIX, write_shaped_checkpoint  # noqa: E402
from benchmarks.bench_sp import add_model_arguments, transformer_config  # noqa: E402
from benchmarks.timing import sync, write_json  # noqa: E402
from ltx_mgpu.denoise.model import load_ltx_model  # noqa: E402
from ltx_mgpu.denoise.plan import TransformerPlan  # noqa: E402
from ltx_mgpu.finite import nonfinite  # noqa: E402


def fp8_blocks_copy(src: Path, dst: Path) -> int:
    """``src`` (a header-only file) with its 2-D ``transformer_blocks`` weights stored as F8_E4M3,
    the data again a sparse hole. Returns the file size in bytes."""
    raw = src.read_bytes()[: 8 + struct.unpack("<Q", src.read_bytes()[:8])[0]]
    header = json.loads(raw[8:])
    offset, out = 0, {"__metadata__": header.pop("__metadata__")}
    for key, entry in header.items():
        e4m3 = (key.startswith(PREFIX + "transformer_blocks.") and key.endswith(".weight")
                and len(entry["shape"]) == 2)
        size = 1 if e4m3 else {"BF16": 2, "F16": 2, "F32": 4}[entry["dtype"]]
        n = 1
        for d in entry["shape"]:
            n *= d
        out[key] = {"dtype": "F8_E4M3" if e4m3 else entry["dtype"], "shape": entry["shape"],
                    "data_offsets": [offset, offset + n * size]}
        offset += n * size
    text = json.dumps(out).encode()
    text += b" " * (-len(text) % 8)
    with open(dst, "wb") as f:
        f.write(struct.pack("<Q", len(text)) + text)
        f.truncate(8 + len(text) + offset)
    return 8 + len(text) + offset


def timed(device: torch.device, fn):
    sync(device)
    t0 = time.perf_counter()
    out = fn()
    sync(device)
    return out, time.perf_counter() - t0


def measure(path: Path, device: torch.device) -> dict:
    """Read every tensor of ``path`` onto ``device`` and time the read, the shipped check and the naive one."""
    from safetensors import safe_open

    read = check = naive = 0.0
    nbytes = tensors = 0
    with safe_open(str(path), framework="pt", device="cpu") as f:
        for key in f.keys():  # noqa: SIM118 - safe_open is not iterable
            # on the CPU the memory-mapped tensor is copied, as StateDictLoader copies it (a tensor of
            # its own): the read pages the file in, not the check
            t, seconds = timed(device, lambda key=key: f.get_tensor(key).to(device, copy=True))
            read += seconds
            flag, seconds = timed(device, lambda t=t: nonfinite(t))
            check += seconds
            if flag is not None:
                assert not bool(flag), key  # zeros
            x = t.float() if t.dtype.itemsize == 1 else t
            _, seconds = timed(device, lambda x=x: bool(torch.isfinite(x).all()))
            naive += seconds
            nbytes += t.numel() * t.element_size()
            tensors += 1
            del t, x
    return {"tensors": tensors, "bytes": nbytes, "read_s": read, "check_s": check, "isfinite_s": naive,
            "check_over_read": check / read, "isfinite_over_check": naive / check}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_model_arguments(ap)
    ap.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    ap.add_argument("--no-fp8", dest="fp8", action="store_false", help="skip the fp8 copy")
    ap.add_argument("--no-load", dest="load", action="store_false", help="skip the whole load_ltx_model")
    ap.add_argument("--out", default=None, help="write raw results as JSON here")
    a = ap.parse_args(argv)
    device = torch.device("cuda", torch.cuda.current_device()) if a.device == "cuda" else torch.device("cpu")
    results: dict = {"device": str(torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"),
                     "threads": torch.get_num_threads(), "layers": a.layers, "files": {}}
    with tempfile.TemporaryDirectory(prefix="finite-") as work:
        bf16 = Path(work) / "ltx2-19b-shaped.safetensors"
        files = {"bf16": (bf16, write_shaped_checkpoint(bf16, transformer_config(a)))}
        if a.fp8:
            fp8 = Path(work) / "ltx2-19b-shaped-fp8.safetensors"
            files["fp8_blocks"] = (fp8, fp8_blocks_copy(bf16, fp8))
        for name, (path, size) in files.items():
            r = {"file_bytes": size, **measure(path, device)}
            results["files"][name] = r
            print(f"{name}: {r['tensors']} tensors, {r['bytes'] / 2**30:.2f} GiB read in {r['read_s']:.2f} s; check "
                  f"{r['check_s']:.3f} s ({100 * r['check_over_read']:.1f} % of the read); torch.isfinite "
                  f"{r['isfinite_s']:.2f} s ({r['isfinite_over_check']:.0f}x the check)", flush=True)
            if a.out:
                write_json(a.out, results)
        if a.load:
            _, seconds = timed(device, lambda: load_ltx_model(TransformerPlan(str(bf16), dtype="bf16"), device))
            results["load_ltx_model_bf16_s"] = seconds
            print(f"load_ltx_model (bf16, checks included): {seconds:.2f} s", flush=True)
    if a.out:
        write_json(a.out, results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
