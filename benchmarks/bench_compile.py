"""The first call at a size under ``dtype: fp8``: cold, from the compile cache, a nearby size
sharing the token bucket, and what the bucket's padding costs per step.

Run on one FP8 GPU (the issue's numbers come from one H200)::

    python3 benchmarks/bench_compile.py --out benchmarks/results/compile_h200.json

``--device cpu`` runs the same processes with Inductor's C++ on the CPU (the CPU's e4m3 GEMM),
with a small model (``--layers``, the widths): where the warm first call's seconds go in Dynamo
(its graphs, breaks and traces are the GPU's), not the goals (the kernels' loading differs).

Model: the **19B-shaped** LTX-2 transformer of ``bench_sp`` (48 layers unless ``--layers``;
random weights, ``bench_sp.build_model``), its block linears swapped to the shipped fp8 layers
(``Fp8Config("fp8", "row")``: e4m3 GEMMs, rowwise scales, bias in the epilogue) and compiled
as the loader does (:func:`~ltx_mgpu.denoise.fp8.compile_blocks` ``dynamic=False``, then
:class:`~ltx_mgpu.denoise.compiling.CompileCache` opened, its artifacts loaded, and
:class:`~ltx_mgpu.denoise.compiling.CompileWatch` installed), called through the pool's
sequence-parallel wrapper at world size 1 with the product's token buckets
(``$LTX_MGPU_TOKEN_BUCKETS``, default 32 per doubling; ``--buckets N`` sets them, 0 turns them
off), as ``LTXDenoiser.velocity_model`` does. Inputs: the cond + uncond batch (2), 126 audio and
1,024 text tokens, as ``bench_fp8``.

Each run is a fresh process sharing one compile cache directory (``--cache-dir``, default a new
empty temporary one, so the first run is cold; ``LTX_MGPU_COMPILE_CACHE_DIR`` points the product
at it):

1. ``cold``: the first call at ``--size`` (default 16x16x24: 6,144 video tokens, a bucket of its
   own) with an empty cache; the artifacts are saved after it;
2. ``warm``: a fresh process, the saved artifacts loaded (``load_s``), the first call at the same
   size; then ``nearby``: the first call at ``--nearby`` (default 16x20x19: 6,080 tokens, which
   pads to 6,144's bucket and so runs its graph; with ``--buckets 0`` its own graph: a first time
   at that size);
3. ``unbucketed`` (unless ``--no-unbucketed``, or buckets are off): a fresh process with buckets
   off at both sizes (each compiles its own graph): the steady time of the same calls unpadded,
   without the attention wrappers (operators in the graph) that one rank needs only with buckets.

Per call: ``first_s`` (wall time of the first forward, synchronised), ``steady_s`` (the median of
``--repeats`` later forwards at the size) and ``compile_s = first_s - steady_s``; ``dynamo``: what
the first call added to the compiler's counts and timed phases (graphs, graph breaks, frames,
seconds per phase: where ``compile_s`` goes; what did not grow is left out); the tokens and the
padded tokens the blocks ran; the Inductor / AOTAutograd cache counters of the process
(``torch._dynamo.utils.counters``) and what the product said (the compile messages and the
cache's log lines). Summary: the compile times, and the cost of buckets per step:
``bucket_overhead`` (steady at ``--size`` bucketed / unbucketed - 1: no padding, the wrappers
alone) and ``padding_cost`` (at ``--nearby``: padding plus wrappers) beside
``padded_fraction`` (padded tokens / tokens - 1). Goals (issue 30): ``warm`` <= 10 s, ``cold``
<= 45 s (``compile_s``); with buckets the nearby size compiles nothing.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.bench_sp import add_model_arguments, build_model, make_inputs, modalities, transformer_config  # noqa: E402
from benchmarks.timing import sync, write_json  # noqa: E402
from ltx_mgpu.denoise.compiling import CompileCache, CompileWatch, graph_key  # noqa: E402
from ltx_mgpu.denoise.fp8 import compile_blocks, fp8_support_error, swap_linears  # noqa: E402
from ltx_mgpu.denoise.parallel.buckets import TokenBuckets, token_buckets  # noqa: E402
from ltx_mgpu.denoise.parallel.ulysses import SequenceParallelTransformer  # noqa: E402
from ltx_mgpu.denoise.plan import Fp8Config  # noqa: E402

GOALS_S = {"cold": 45.0, "warm": 10.0}


def child(a: argparse.Namespace) -> dict:
    """One fresh process: build, swap, compile, load the cache; the first and later calls at each size."""
    from torch._dynamo.utils import counters  # noqa: PLC0415 - read after the compiles of this process
    device = torch.device(a.device) if a.device != "cuda" else torch.device("cuda", torch.cuda.current_device())
    dtype = torch.bfloat16
    buckets = token_buckets() if a.buckets is None else (TokenBuckets(a.buckets) if a.buckets else None)
    shapes = [tuple(int(x) for x in size.split("x")) for size in a.child_sizes.split(",")]
    t0 = time.perf_counter()
    model = build_model(transformer_config(a), device, dtype)
    swap_linears(model, Fp8Config("fp8", "row"))
    sync(device)
    out: dict = {"build_s": time.perf_counter() - t0, "said": [], "calls": {},
                 "buckets": buckets.per_octave if buckets is not None else 0}
    compile_blocks(model, dynamic=False)
    t0 = time.perf_counter()
    cache = CompileCache.open(graph_key(model, device), log=lambda text, level: out["said"].append(f"{level}: {text}"))
    out["loaded"] = cache.load_all() if cache is not None else 0
    out["load_s"] = time.perf_counter() - t0
    watch = CompileWatch(model, cache, bucketed=buckets is not None)
    watch.on_compile = lambda text, cached: out["said"].append(f"phase compile: {text}")
    watch.on_compiled = lambda text: out["said"].append(f"phase compile done: {text}")
    sp = SequenceParallelTransformer(model, None, max(f * h * w for f, h, w in shapes), buckets=buckets)
    for size, shape in zip(a.child_sizes.split(","), shapes):
        _, state, ctxs = make_inputs(shape, a.audio_tokens, a.text_tokens, a.caption_channels, device, dtype)
        v, au = modalities(state, torch.cat(ctxs), device, dtype)
        times, before = [], _dynamo_totals()
        for _ in range(1 + a.repeats):
            sync(device)
            t0 = time.perf_counter()
            with torch.no_grad():
                sp(v, au, None)
            sync(device)
            times.append(time.perf_counter() - t0)
            if len(times) == 1:
                first = _dynamo_totals()
        steady = statistics.median(times[1:])
        tokens = shape[0] * shape[1] * shape[2]
        out["calls"][size] = {"tokens": tokens, "padded_tokens": sp.padded_tokens(tokens), "first_s": times[0],
                              "steady_s": steady, "steady_runs_s": times[1:], "compile_s": times[0] - steady,
                              "dynamo": {k: first[k] - before.get(k, 0) for k in first
                                         if first[k] - before.get(k, 0) > 1e-3}}
        print(f"{size}: first call {times[0]:.1f} s, then {steady * 1e3:.1f} ms "
              f"({tokens} tokens run as {sp.padded_tokens(tokens)})", flush=True)
    out["counters"] = {k: dict(counters[k]) for k in ("inductor", "aot_autograd", "stats") if k in counters}
    return out


def _dynamo_totals() -> dict:
    """The compiler's counts and seconds so far in this process: graphs, graph breaks, frames
    compiled, and the seconds of each phase torch times (``dynamo_timed``:
    ``compile_attempt_N`` the traces of a frame, a second one after a graph break;
    ``bytecode_tracing``; ``OutputGraph.call_user_compiler`` the backend, here the cache lookups
    and loads; ``build_guards``...; nested phases overlap)."""
    from torch._dynamo.utils import compilation_time_metrics, counters  # noqa: PLC0415 - the compiler's own record
    totals = {f"{k}_s": sum(v) for k, v in compilation_time_metrics.items()}
    totals.update(graphs=counters["stats"]["unique_graphs"], graph_breaks=sum(counters["graph_break"].values()),
                  frames=counters["frames"]["ok"])
    return totals


def run_child(argv: list[str], sizes: str, cache_dir: Path, timeout: float, extra: tuple[str, ...] = ()) -> dict:
    env = {**os.environ, "LTX_MGPU_COMPILE_CACHE_DIR": str(cache_dir)}
    env.pop("TORCHINDUCTOR_CACHE_DIR", None)
    env.pop("TRITON_CACHE_DIR", None)  # Triton's kernels then live in the compile cache (cold is cold)
    proc = subprocess.run([sys.executable, __file__, *argv, *extra, "--child-sizes", sizes], env=env,
                          capture_output=True, text=True, timeout=timeout)
    sys.stdout.write(proc.stdout.replace("RESULT ", "result: ")[-3000:])
    if proc.returncode != 0:
        raise RuntimeError(f"child failed ({proc.returncode}): {proc.stderr[-3000:]}")
    line = next(li for li in proc.stdout.splitlines() if li.startswith("RESULT "))
    return json.loads(line[len("RESULT "):])


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_model_arguments(ap)
    ap.add_argument("--size", default="16x16x24", help="latent FxHxW of the cold and warm first calls")
    ap.add_argument("--nearby", default="16x20x19", help="latent FxHxW of a nearby size ('' to skip)")
    ap.add_argument("--buckets", type=int, default=None,
                    help="token buckets per doubling (default: $LTX_MGPU_TOKEN_BUCKETS, the product's; 0: off)")
    ap.add_argument("--repeats", type=int, default=5, help="calls after the first at each size (median: steady_s)")
    ap.add_argument("--no-unbucketed", action="store_true", help="skip the unbucketed run (the step cost)")
    ap.add_argument("--cache-dir", default=None, help="the compile cache (default: a new empty temporary one)")
    ap.add_argument("--timeout", type=float, default=300.0, help="seconds one process may take")
    ap.add_argument("--out", default=None)
    ap.add_argument("--child-sizes", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--device", default="cuda", choices=("cuda", "cpu"),
                    help="cpu: Inductor's C++ on the CPU, for where Dynamo's time goes (the CPU's e4m3 GEMM; "
                         "with a small --layers / widths), not for the goals")
    raw = list(sys.argv[1:] if argv is None else argv)
    a = ap.parse_args(raw)
    if a.device == "cuda" and not torch.cuda.is_available():
        print("bench_compile needs a CUDA GPU with FP8 tensor cores (no CUDA device here; --device cpu for "
              "Dynamo's share on a small model)", file=sys.stderr)
        return 2
    if a.device == "cuda" and (err := fp8_support_error(torch.device("cuda"))) is not None:
        print(err, file=sys.stderr)
        return 2
    if a.child_sizes:
        print("RESULT " + json.dumps(child(a)), flush=True)
        return 0
    buckets = token_buckets() if a.buckets is None else (TokenBuckets(a.buckets) if a.buckets else None)
    cache_dir = Path(a.cache_dir) if a.cache_dir else Path(tempfile.mkdtemp(prefix="ltx_compile_bench_")) / "c"
    print(f"19B-shaped blocks: {a.layers} layers; token buckets "
          f"{buckets.per_octave if buckets else 'off'}; compile cache {cache_dir}", flush=True)
    res = {"device": torch.cuda.get_device_name() if a.device == "cuda" else "cpu", "torch": torch.__version__,
           "layers": a.layers,
           "size": a.size, "nearby": a.nearby, "buckets": buckets.per_octave if buckets else 0, "goals_s": GOALS_S,
           "runs": {}}
    res["runs"]["cold"] = run_child(raw, a.size, cache_dir, a.timeout)
    if a.out:
        write_json(a.out, res)
    sizes = ",".join(s for s in (a.size, a.nearby) if s)
    res["runs"]["warm"] = run_child(raw, sizes, cache_dir, a.timeout)
    if a.out:
        write_json(a.out, res)
    if buckets is not None and not a.no_unbucketed:
        res["runs"]["unbucketed"] = run_child(raw, sizes, cache_dir, 2 * a.timeout, ("--buckets", "0"))
    warm = res["runs"]["warm"]["calls"]
    cold_s, warm_s = res["runs"]["cold"]["calls"][a.size]["compile_s"], warm[a.size]["compile_s"]
    res["summary"] = {"cold_compile_s": cold_s, "warm_compile_s": warm_s, "warm_load_s": res["runs"]["warm"]["load_s"],
                      "cold_goal_met": cold_s <= GOALS_S["cold"] if a.device == "cuda" else None,
                      "warm_goal_met": warm_s <= GOALS_S["warm"] if a.device == "cuda" else None}
    if a.nearby:
        near = warm[a.nearby]
        res["summary"].update({"nearby_compile_s": near["compile_s"], "nearby_first_s": near["first_s"],
                               "nearby_padded_tokens": near["padded_tokens"],
                               "padded_fraction": near["padded_tokens"] / near["tokens"] - 1})
    if "unbucketed" in res["runs"]:
        plain = res["runs"]["unbucketed"]["calls"]
        res["summary"]["bucket_overhead"] = warm[a.size]["steady_s"] / plain[a.size]["steady_s"] - 1
        if a.nearby:
            res["summary"]["padding_cost"] = warm[a.nearby]["steady_s"] / plain[a.nearby]["steady_s"] - 1
            res["summary"]["nearby_compile_s_unbucketed_process"] = plain[a.nearby]["compile_s"]
    print(json.dumps(res["summary"], indent=1), flush=True)
    if a.out:
        write_json(a.out, res)
    return 0


if __name__ == "__main__":
    sys.exit(main())
