"""The first call at a size under ``dtype: fp8``: cold, from the compile cache, and a nearby size.

Run on one FP8 GPU (the issue's numbers come from one H200)::

    python3 benchmarks/bench_compile.py --out benchmarks/results/compile_h200.json

Model: the **19B-shaped** LTX-2 transformer of ``bench_sp`` (48 layers unless ``--layers``;
random weights, ``bench_sp.build_model``), its block linears swapped to the shipped fp8 layers
(``Fp8Config("fp8", "row")``: e4m3 GEMMs, rowwise scales, bias in the epilogue) and compiled
as the loader does (:func:`~ltx_mgpu.denoise.fp8.compile_blocks` ``dynamic=False``, then
:class:`~ltx_mgpu.denoise.compiling.CompileCache` opened, its artifacts loaded, and
:class:`~ltx_mgpu.denoise.compiling.CompileWatch` installed). Inputs: the cond + uncond batch
(2), 126 audio and 1,024 text tokens, as ``bench_fp8``.

Each run is a fresh process sharing one compile cache directory (``--cache-dir``, default a new
empty temporary one, so the first run is cold; ``LTX_MGPU_COMPILE_CACHE_DIR`` points the product
at it):

1. ``cold``: the first call at ``--size`` (default 16x16x24: 6,144 video tokens) with an empty
   cache; the artifacts are saved after it;
2. ``warm``: a fresh process, the saved artifacts loaded (``load_s``), the first call at the same
   size; then ``nearby``: the first call at ``--nearby`` (default 16x20x20: 6,400 tokens) in the
   same process (its own graph: a first time at that size).

Per call: ``first_s`` (wall time of the first forward, synchronised), ``steady_s`` (the
second forward at the size) and ``compile_s = first_s - steady_s``; the Inductor / AOTAutograd
cache counters of the process (``torch._dynamo.utils.counters``) and what the product said
(the compile messages and the cache's log lines). Goals (issue 30): ``warm`` <= 10 s,
``cold`` <= 45 s (``compile_s``).
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

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.bench_sp import add_model_arguments, build_model, make_inputs, modalities, transformer_config  # noqa: E402
from benchmarks.timing import write_json  # noqa: E402
from ltx_mgpu.denoise.compiling import CompileCache, CompileWatch, graph_key  # noqa: E402
from ltx_mgpu.denoise.fp8 import compile_blocks, fp8_support_error, swap_linears  # noqa: E402
from ltx_mgpu.denoise.plan import Fp8Config  # noqa: E402

GOALS_S = {"cold": 45.0, "warm": 10.0}


def child(a: argparse.Namespace) -> dict:
    """One fresh process: build, swap, compile, load the cache; the first and second call at each size."""
    from torch._dynamo.utils import counters  # noqa: PLC0415 - read after the compiles of this process
    device = torch.device("cuda", torch.cuda.current_device())
    dtype = torch.bfloat16
    t0 = time.perf_counter()
    model = build_model(transformer_config(a), device, dtype)
    swap_linears(model, Fp8Config("fp8", "row"))
    torch.cuda.synchronize(device)
    out: dict = {"build_s": time.perf_counter() - t0, "said": [], "calls": {}}
    compile_blocks(model, dynamic=False)
    t0 = time.perf_counter()
    cache = CompileCache.open(graph_key(model, device), log=lambda text, level: out["said"].append(f"{level}: {text}"))
    out["loaded"] = cache.load_all() if cache is not None else 0
    out["load_s"] = time.perf_counter() - t0
    watch = CompileWatch(model, cache)
    watch.on_compile = lambda text, cached: out["said"].append(f"phase compile: {text}")
    for size in a.child_sizes.split(","):
        shape = tuple(int(x) for x in size.split("x"))
        _, state, ctxs = make_inputs(shape, a.audio_tokens, a.text_tokens, a.caption_channels, device, dtype)
        v, au = modalities(state, torch.cat(ctxs), device, dtype)
        times = []
        for _ in range(2):
            torch.cuda.synchronize(device)
            t0 = time.perf_counter()
            with torch.no_grad():
                model(video=v, audio=au, perturbations=None)
            torch.cuda.synchronize(device)
            times.append(time.perf_counter() - t0)
        out["calls"][size] = {"tokens": shape[0] * shape[1] * shape[2], "first_s": times[0], "steady_s": times[1],
                              "compile_s": times[0] - times[1]}
        print(f"{size}: first call {times[0]:.1f} s, second {times[1]:.2f} s", flush=True)
    out["counters"] = {k: dict(counters[k]) for k in ("inductor", "aot_autograd") if k in counters}
    return out


def run_child(argv: list[str], sizes: str, cache_dir: Path, timeout: float) -> dict:
    env = {**os.environ, "LTX_MGPU_COMPILE_CACHE_DIR": str(cache_dir)}
    env.pop("TORCHINDUCTOR_CACHE_DIR", None)
    env.pop("TRITON_CACHE_DIR", None)  # Triton's kernels then live in the compile cache (cold is cold)
    proc = subprocess.run([sys.executable, __file__, *argv, "--child-sizes", sizes], env=env, capture_output=True,
                          text=True, timeout=timeout)
    sys.stdout.write(proc.stdout.replace("RESULT ", "result: ")[-3000:])
    if proc.returncode != 0:
        raise RuntimeError(f"child failed ({proc.returncode}): {proc.stderr[-3000:]}")
    line = next(li for li in proc.stdout.splitlines() if li.startswith("RESULT "))
    return json.loads(line[len("RESULT "):])


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_model_arguments(ap)
    ap.add_argument("--size", default="16x16x24", help="latent FxHxW of the cold and warm first calls")
    ap.add_argument("--nearby", default="16x20x20", help="latent FxHxW of a nearby size ('' to skip)")
    ap.add_argument("--cache-dir", default=None, help="the compile cache (default: a new empty temporary one)")
    ap.add_argument("--timeout", type=float, default=300.0, help="seconds one process may take")
    ap.add_argument("--out", default=None)
    ap.add_argument("--child-sizes", default=None, help=argparse.SUPPRESS)
    raw = list(sys.argv[1:] if argv is None else argv)
    a = ap.parse_args(raw)
    if not torch.cuda.is_available():
        print("bench_compile needs a CUDA GPU with FP8 tensor cores (no CUDA device here)", file=sys.stderr)
        return 2
    if (err := fp8_support_error(torch.device("cuda"))) is not None:
        print(err, file=sys.stderr)
        return 2
    if a.child_sizes:
        print("RESULT " + json.dumps(child(a)), flush=True)
        return 0
    cache_dir = Path(a.cache_dir) if a.cache_dir else Path(tempfile.mkdtemp(prefix="ltx_compile_bench_")) / "c"
    print(f"19B-shaped blocks: {a.layers} layers; compile cache {cache_dir}", flush=True)
    res = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "layers": a.layers,
           "size": a.size, "nearby": a.nearby, "goals_s": GOALS_S, "runs": {}}
    res["runs"]["cold"] = run_child(raw, a.size, cache_dir, a.timeout)
    if a.out:
        write_json(a.out, res)
    res["runs"]["warm"] = run_child(raw, ",".join(s for s in (a.size, a.nearby) if s), cache_dir, a.timeout)
    cold = res["runs"]["cold"]["calls"][a.size]["compile_s"]
    warm = res["runs"]["warm"]["calls"][a.size]["compile_s"]
    res["summary"] = {"cold_compile_s": cold, "warm_compile_s": warm, "warm_load_s": res["runs"]["warm"]["load_s"],
                      "cold_goal_met": cold <= GOALS_S["cold"], "warm_goal_met": warm <= GOALS_S["warm"]}
    if a.nearby:
        res["summary"]["nearby_compile_s"] = res["runs"]["warm"]["calls"][a.nearby]["compile_s"]
    print(json.dumps(res["summary"], indent=1), flush=True)
    if a.out:
        write_json(a.out, res)
    return 0


if __name__ == "__main__":
    sys.exit(main())
