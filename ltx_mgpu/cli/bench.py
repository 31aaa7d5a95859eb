"""``python -m ltx_mgpu bench``: run the benchmarks this machine can run and print one table of ratios.

* everywhere: ``socket`` (``benchmarks/bench_socket.py``: a pool of 2 CPU ranks; round trips and
  the throughput of a 100 MB result next to a memcpy) and ``cache`` (here, on the CPU: one
  LTX-length prompt encoded by the embedded Gemma — the real Gemma 3 270M when its package is
  installed, else the tiny one — against a hit in the embedding cache);
* with a CUDA GPU also ``text`` (``bench_text.py``: our Gemma 3 12B-shaped encode vs plain
  transformers, compiled variants, cache hit), ``sp`` (``bench_sp.py``: the sequence-parallel
  wrapper on one GPU vs the plain LTX-2 19B-shaped transformer) and ``nf4`` (``bench_nf4.py``:
  NF4 vs bf16 Gemma, memory and latency), each with its defaults (minutes each, tens of GB).

The scripts run as subprocesses (each in a fresh process, so one's GPU memory is gone before the
next starts) with their own output shown as it comes; the scripts that can write JSON do so into
``--out-dir`` (a temporary directory by default), which is where the ratios are read from, and
the socket script's printed table is kept there as ``socket.txt``. Every ratio compares numbers
measured in the same run of one script. After the table come the goals missed (marked
``MISSED`` in the table too) and the directory of the raw results.
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Callable

from ltx_mgpu.cli.wording import plural

__all__ = ["BENCHMARKS", "Row", "cache_rows", "closing_lines", "format_table", "nf4_rows", "register", "run",
           "socket_rows", "sp_rows", "text_rows"]

BENCHMARKS = ("socket", "cache", "text", "sp", "nf4")
GPU_ONLY = ("text", "sp", "nf4")
Row = tuple[str, str, str, str]  # (benchmark, measure, value, ratio)
#: An LTX-2-style prompt (about 70 Gemma tokens) for the cache comparison.
PROMPT = ("A red fox trots through fresh snow at dawn, its breath visible in the cold air. The camera tracks "
          "alongside at ground level as low golden sunlight rakes across the drifts, throwing long blue shadows. "
          "Snow crystals glitter; in the distance pine trees stand dark against a pale pink sky. Soft crunching "
          "footsteps and a faint wind are heard.")


def benchmarks_dir() -> Path:
    """``benchmarks/`` of the checkout this package runs from."""
    return Path(__file__).resolve().parents[2] / "benchmarks"  # ltx_mgpu/cli/bench.py -> the checkout


# --------------------------------------------------------------------------- parsing the scripts' results


#: One line of ``bench_socket.py``'s table: ``<measure, maybe indented>  <value> ms|s  [<rate> GB/s | <goal>]``.
_SOCKET_LINE = re.compile(r"^(?P<name>\s*\S.*?)\s{2,}(?P<value>\d+(?:\.\d+)?) (?P<unit>ms|s)"
                          r"(?:\s+(?P<extra>\S.*?))?\s*$")
_RATE = re.compile(r"^(?P<rate>\d+(?:\.\d+)?) GB/s$")
_GOAL = re.compile(r"^(?P<op><=|>=|<|>) ?(?P<limit>\d+(?:\.\d+)?) ?(?P<unit>ms|s)$")
_SECONDS = {"ms": 1e-3, "s": 1.0}
#: The reference of each size group's ratios: the memcpy of the same bytes into a fresh buffer.
_MEMCPY = "memcpy into a fresh buffer"


def _goal_cell(seconds: float, goal: re.Match) -> str:
    limit = float(goal["limit"]) * _SECONDS[goal["unit"]]
    met = {"<=": seconds <= limit, "<": seconds < limit, ">=": seconds >= limit, ">": seconds > limit}[goal["op"]]
    text = f"goal {goal['op']} {goal['limit']} {goal['unit']}"
    return f"{text}: met" if met else f"MISSED {text}"


def socket_rows(stdout: str) -> list[Row]:
    """Rows from ``bench_socket.py``'s printed table, in its order and indentation.

    Its lines are ``<measure>  <value> ms|s  <extra>``: an indented measure belongs to the size
    (``12.5 MB``, ``100 MB``) of the unindented rows above it, and ``<extra>`` is a rate
    (``3.04 GB/s``) or a goal (``<= 5 ms``). The ratio cell says, for a goal, whether it was met
    (``MISSED goal <= 5 ms`` when not); for a timed transfer, its rate and its time over the
    memcpy of the same bytes into a fresh buffer (``4.1x the fresh memcpy``, from the same run).
    Lines that are no table row (the ``pool:`` line, the header) are skipped."""
    parsed: list[tuple[str, float, str, str, str]] = []  # (measure, value, unit, extra, size group)
    group = ""
    for line in stdout.splitlines():
        m = _SOCKET_LINE.match(line)
        if not m:
            continue
        name = m["name"].rstrip()
        if not name[:1].isspace():
            size = re.match(r"^(\d+(?:\.\d+)?) MB\b", name)
            group = size[1] if size else ""
        parsed.append((name, float(m["value"]), m["unit"], m["extra"] or "", group))
    memcpy = {g: v * _SECONDS[u] for name, v, u, _, g in parsed if g and name.strip().endswith(_MEMCPY)}
    rows: list[Row] = []
    for name, value, unit, extra, group in parsed:
        seconds = value * _SECONDS[unit]
        goal, rate = _GOAL.match(extra), _RATE.match(extra)
        if goal:
            ratio = _goal_cell(seconds, goal)
        elif group and group in memcpy:
            what = ("the reference" if name.strip().endswith(_MEMCPY)
                    else f"{seconds / memcpy[group]:.1f}x the fresh memcpy")
            ratio = f"{rate['rate']} GB/s, {what}" if rate else what
        elif rate:
            ratio = f"{rate['rate']} GB/s"
        else:
            ratio = extra or "no goal"
        rows.append(("socket", name, f"{value:.2f} {unit}", ratio))
    return rows


def text_rows(results: dict) -> list[Row]:
    """Rows from ``bench_text.py --out``: each variant vs plain transformers, and the cache hit."""
    variants = results.get("variants", {})
    rows = []
    shapes = sorted({k.split("/", 1)[1] for k in variants if "/" in k and not k.startswith("parity")},
                    key=lambda s: int(s.split("x")[0]))
    for shape in shapes:
        plain = variants.get(f"plain/{shape}", {}).get("median_ms")
        for key, v in variants.items():
            name, _, s = key.partition("/")
            if s != shape or name in ("plain", "parity") or "median_ms" not in v or not plain:
                continue
            rows.append(("text", f"{name} {shape} (Gemma 3 12B shape)", f"{v['median_ms']:.1f} ms",
                         f"{v['median_ms'] / plain:.2f}x plain transformers"))
    hit = results.get("cache_hit_ms_1024_tokens")
    encodes = [v["median_ms"] for k, v in variants.items()
               if k.endswith(f"/1x{results.get('tokens', 1024)}") and not k.startswith(("plain", "parity"))]
    if hit and encodes:
        rows.append(("text", f"cache hit, 1x{results.get('tokens', 1024)} tokens", f"{hit:.2f} ms",
                     f"{min(encodes) / hit:.0f}x faster than the fastest encode"))
    return rows


def sp_rows(results: dict) -> list[Row]:
    """Rows from ``bench_sp.py --out``: the SP wrapper's overhead at world size 1, per size."""
    rows = []
    for tokens, size in results.get("sizes", {}).items():
        v = size.get("variants", {})
        plain = v.get("plain", {}).get("median_ms")
        for name in ("sp-ws1", "sp-forced-1rank"):
            if name in v and plain:
                rows.append(("sp", f"{name} vs plain, {tokens} video tokens", f"{v[name]['median_ms']:.1f} ms",
                             f"{v[name]['median_ms'] / plain:.3f}x plain"))
        if "sampler-step-cfg" in v and "plain-b2" in v:
            rows.append(("sp", f"sampler step (cfg) vs batch-2 forward, {tokens} tokens",
                         f"{v['sampler-step-cfg']['median_ms']:.1f} ms",
                         f"{v['sampler-step-cfg']['median_ms'] / v['plain-b2']['median_ms']:.3f}x"))
    return rows


def nf4_rows(results: dict) -> list[Row]:
    """Rows from ``bench_nf4.py --out``: resident memory and encode latency, NF4 vs bf16."""
    rows = []
    bf16, nf4 = results.get("bf16", {}), results.get("nf4", {})
    if bf16.get("resident_bytes") and nf4.get("resident_bytes"):
        rows.append(("nf4", "resident Gemma 3 12B-shaped text tower", f"{nf4['resident_bytes'] / 1e9:.2f} GB",
                     f"{nf4['resident_bytes'] / bf16['resident_bytes']:.2f}x bf16"))
    for variant, v in nf4.items():
        if not isinstance(v, dict):
            continue
        if v.get("resident_bytes") and bf16.get("resident_bytes"):  # a variant loaded on its own (the loader)
            rows.append(("nf4", f"resident, {variant}", f"{v['resident_bytes'] / 1e9:.2f} GB",
                         f"{v['resident_bytes'] / bf16['resident_bytes']:.2f}x bf16"))
        for shape, m in v.items():
            if isinstance(m, dict) and "ratio_vs_bf16" in m:
                rows.append(("nf4", f"encode {shape}, {variant}", f"{m['median_ms']:.1f} ms",
                             f"{m['ratio_vs_bf16']:.2f}x bf16"))
    for shape, m in results.get("head_to_head", {}).items():  # bf16 and the loader's NF4 timed in turn
        rows.append(("nf4", f"encode {shape}, bf16 vs loader NF4 interleaved", f"{m['nf4_ms']:.1f} ms",
                     f"{m['ratio']:.2f}x bf16 ({m['bf16_ms']:.1f} ms)"))
    return rows


# --------------------------------------------------------------------------- the cache comparison (CPU)


def _median_ms(fn: Callable[[], object], runs: int) -> float:
    times = []
    for _ in range(runs):
        t = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t) * 1e3)
    return statistics.median(times)


def cache_rows(runs: int = 5) -> list[Row]:
    """Encode :data:`PROMPT` with the embedded Gemma on the CPU (median of ``runs`` after one
    warm-up) vs reading it back from an :class:`~ltx_mgpu.text.cache.store.EmbeddingCache` (median of 20)."""
    from ltx_mgpu.cli.request import GenerateRequest, resolve_models
    from ltx_mgpu.text.cache.keys import cache_key_parts
    from ltx_mgpu.text.cache.store import EmbeddingCache
    from ltx_mgpu.text.config import TextEncoderConfig
    from ltx_mgpu.text.encoder.local import LocalTextEncoder

    models = resolve_models(GenerateRequest(prompt=PROMPT))
    config = TextEncoderConfig(gemma=models.gemma(), projection=models.projection)
    encoder = LocalTextEncoder(config, "cpu").build()
    encoder.encode([PROMPT])
    encode_ms = _median_ms(lambda: encoder.encode([PROMPT]), runs)
    embedding = encoder.encode([PROMPT])[0]
    parts = cache_key_parts(config)
    with tempfile.TemporaryDirectory() as tmp:
        cache = EmbeddingCache(tmp)
        cache.put(PROMPT, parts, embedding)
        hit_ms = _median_ms(lambda: cache.get(PROMPT, parts), 20)
    what = f"{embedding.num_tokens} tokens, {models.gemma_name}, CPU"
    return [("cache", f"encode 1 prompt ({what})", f"{encode_ms:.1f} ms", ""),
            ("cache", "cache hit of the same prompt", f"{hit_ms:.2f} ms",
             f"{encode_ms / hit_ms:.0f}x faster than encoding")]


# --------------------------------------------------------------------------- running


def _run_script(script: Path, args: list[str]) -> tuple[int, str]:
    """Run a benchmark script, echoing its output; ``(returncode, stdout)``."""
    print(f"\n$ python {script.relative_to(script.parent.parent)} {' '.join(args)}", flush=True)
    proc = subprocess.Popen([sys.executable, str(script), *args], cwd=script.parent.parent, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, bufsize=1)
    lines = []
    for line in proc.stdout:
        sys.stdout.write(line)
        lines.append(line)
    return proc.wait(), "".join(lines)


def format_table(rows: list[Row]) -> str:
    """The rows as an aligned text table."""
    head = ("benchmark", "measure", "value", "ratio")
    widths = [max(len(r[i]) for r in [head, *rows]) for i in range(4)]
    fmt = lambda r: f"{r[0]:<{widths[0]}}  {r[1]:<{widths[1]}}  {r[2]:>{widths[2]}}  {r[3]}"  # noqa: E731
    return "\n".join([fmt(head), "  ".join("-" * w for w in widths), *map(fmt, rows)])


def run(only: list[str] | None = None, out_dir: str | None = None, gpu: bool | None = None) -> list[Row]:
    """Run the selected benchmarks (default: all this machine can run) and return the rows.
    A benchmark that fails or is skipped gets a row that says so. Into ``out_dir`` (a new
    temporary directory when None) go the JSON of the scripts that write it (``text.json``,
    ``sp.json``, ``nf4.json``) and the socket script's printed table (``socket.txt``)."""
    import torch

    gpu = torch.cuda.is_available() if gpu is None else gpu
    names = [n for n in (only or BENCHMARKS) if gpu or n not in GPU_ONLY]
    skipped = [n for n in (only or BENCHMARKS) if n not in names]
    out = Path(out_dir or tempfile.mkdtemp(prefix="ltx_mgpu-bench-"))
    out.mkdir(parents=True, exist_ok=True)
    scripts = benchmarks_dir()
    rows: list[Row] = []
    parsers = {"text": text_rows, "sp": sp_rows, "nf4": nf4_rows}
    for name in names:
        try:
            if name == "cache":
                print("\n$ (in process) embedded Gemma encode vs embedding-cache hit, CPU", flush=True)
                rows += cache_rows()
                continue
            script = scripts / f"bench_{name}.py"
            if not script.is_file():
                rows.append((name, f"skipped: {script} not found (run from a clone of the repository)", "", ""))
                continue
            args = [] if name == "socket" else ["--out", str(out / f"{name}.json")]
            rc, stdout = _run_script(script, args)
            if rc != 0:
                rows.append((name, f"failed (exit status {rc}; its output is above)", "", ""))
                continue
            if name == "socket":
                (out / "socket.txt").write_text(stdout, encoding="utf-8")
                rows += socket_rows(stdout)
            else:
                rows += parsers[name](json.loads((out / f"{name}.json").read_text()))
        except Exception as e:  # noqa: BLE001 - one broken benchmark must not hide the others
            rows.append((name, f"failed: {type(e).__name__}: {e}", "", ""))
    rows += [(n, "skipped: needs a CUDA GPU", "", "") for n in skipped]
    return rows


def closing_lines(rows: list[Row], out: Path) -> list[str]:
    """What follows the table: the goals missed, and where the raw results are (the files in
    ``out``) or that none was written."""
    lines = []
    missed = [r for r in rows if r[3].startswith("MISSED")]
    if missed:
        lines.append(f"{plural(len(missed), 'goal')} missed: "
                     + "; ".join(f"{r[1].strip()} took {r[2]} ({r[3][len('MISSED '):]})" for r in missed))
    files = sorted(p.name for p in out.glob("*") if p.suffix in (".json", ".txt")) if out.is_dir() else []
    if files:
        lines.append(f"raw results in {out}: {', '.join(files)}")
    else:
        lines.append("no raw results were written: the numbers are in the output above")
    return lines


def _cmd_bench(args: argparse.Namespace) -> int:
    only = [s.strip() for s in args.only.split(",")] if args.only else None
    unknown = sorted(set(only or ()) - set(BENCHMARKS))
    if unknown:
        raise ValueError(f"--only: unknown benchmark(s) {unknown}; choose from {', '.join(BENCHMARKS)}")
    if not benchmarks_dir().is_dir():
        raise FileNotFoundError(f"no benchmark scripts at {benchmarks_dir()}: they ship with the repository, not the "
                                "node pack's registry package; run bench from a clone (git clone ... && cd ... && "
                                "python -m ltx_mgpu bench)")
    out = Path(args.out_dir) if args.out_dir else Path(tempfile.mkdtemp(prefix="ltx_mgpu-bench-"))
    rows = run(only, str(out))
    if not args.out_dir and out.is_dir() and not any(out.iterdir()):
        out.rmdir()  # our own temporary directory, left empty
    print("\n" + format_table(rows))
    for line in closing_lines(rows, out):
        print(line)
    return 1 if any("failed" in r[1] for r in rows) else 0


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add ``bench`` to the CLI's subparsers."""
    p = subparsers.add_parser(
        "bench", help="run the benchmarks this machine can run; print their times and ratios in one table",
        description="Run the benchmarks this machine can run (socket and cache everywhere; text, sp and nf4 on a "
                    "CUDA GPU) and print their times and ratios in one table.")
    p.add_argument("--only", default=None, help=f"comma-separated subset of {', '.join(BENCHMARKS)}")
    p.add_argument("--out-dir", default=None,
                   help="where the scripts' raw results go: text/sp/nf4 JSON and the socket table (default: a new "
                        "temporary directory; the closing line names it)")
    p.set_defaults(func=_cmd_bench)
