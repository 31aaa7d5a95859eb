"""Where the time of a Gemma 3 12B-shaped encode goes (GPU profiler tables).

    python benchmarks/profile_text.py --batch 8 [--compile default@layers] [--attention]

Builds the same random 12B-shaped text tower as ``bench_text.py`` and prints, for one
``batch x tokens`` encode: the time of each stage of our encode (Gemma forward, feature
normalisation, projection, projection pipelined with the copy to the host, the whole
``encode_tokens``) and how much of it the GPU is busy, for
the eager tower and, with ``--compile MODE@SCOPE``, the compiled one; then the top CUDA
kernels (torch.profiler) of the whole encode. ``--attention`` adds a micro-benchmark of the
attention call alone (``[B, 16, T, 256]`` bf16, causal) for each SDPA backend, with and
without an explicit mask, and for ``flex_attention``.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.bench_text import GEMMA_12B  # noqa: E402
from benchmarks.timing import time_ms  # noqa: E402
from ltx_mgpu.text.encoder.prompt import PromptEncoder  # noqa: E402
from ltx_mgpu.text.features import Projection  # noqa: E402
from ltx_mgpu.text.gemma.forward import (
    compile_text_tower,
    encode_hidden_states,
    use_causal_skip,  # noqa: E402
)
from ltx_mgpu.text.gemma.sources import gemma3_text_config  # noqa: E402
from ltx_mgpu.text.gemma.tower import GemmaTextTower  # noqa: E402

DEV = torch.device("cuda")


def _time(fn, runs=5):
    return time_ms(DEV, fn, warmup=2, runs=runs)[0]


def stages(label: str, encoder: PromptEncoder, ids: torch.Tensor, mask: torch.Tensor, rows: int) -> None:
    """Print the stage times and the kernel table of one encode."""
    with torch.inference_mode():
        t_fwd = _time(lambda: encode_hidden_states(encoder.tower, ids, mask))
        hs = encode_hidden_states(encoder.tower, ids, mask)
        md = mask.to(DEV)
        t_norm = _time(lambda: encoder.projection.normalised(hs, md))
        feats = encoder.projection.normalised(hs, md)
        t_proj = _time(lambda: encoder.projection.project(feats))
        lengths = [int(n) for n in mask.sum(1).tolist()]
        t_rows = _time(lambda: encoder._project_rows(feats, lengths))
        t_all = _time(lambda: encoder.encode_tokens(ids, mask))
    b, t = ids.shape
    print(f"[{label}] {b}x{t}: forward {t_fwd:.1f} ms, feature normalisation {t_norm:.1f} ms, projection "
          f"{t_proj:.1f} ms, projection pipelined with the rows to the host {t_rows:.1f} ms, whole "
          f"encode_tokens {t_all:.1f} ms (sum of the stages {t_fwd + t_norm + t_rows:.1f} ms)", flush=True)
    busy_and_host(label, lambda: encoder.encode_tokens(ids, mask), rows, wall=t_all, sort_by="cuda_time_total",
                  gaps=12, host=10, title=f"{label} {b}x{t}: kernels of one encode_tokens")


def busy_and_host(label: str, fn, rows: int = 15, *, wall: float | None = None, sort_by: str = "self_cpu_time_total",
                  gaps: int = 5, host: int = 3, title: str | None = None) -> None:
    """For any encode ``fn``: wall time (``wall`` ms if already timed), GPU kernel time, the
    ``gaps`` longest idle gaps, the host time around the kernels (``host`` longest calls before
    the first), and the ``rows`` top operators by ``sort_by`` (default: host CPU time, the
    question being whether the encode is bound by the GPU or by the host's launches)."""
    from torch.profiler import ProfilerActivity, profile

    wall = _time(fn) if wall is None else wall
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    busy = sum(e.self_device_time_total for e in prof.key_averages()) / 1e3
    print(f"[{label}] wall {wall:.1f} ms, GPU kernel time {busy:.1f} ms ({wall - busy:.1f} ms without a kernel "
          f"running)", flush=True)
    idle_gaps(label, prof, top=gaps)
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    host_around_gpu(label, prof, top=host)
    if title:
        print(f"\n=== {title} ===")
    print(prof.key_averages().table(sort_by=sort_by, row_limit=rows, max_name_column_width=80), flush=True)


def idle_gaps(label: str, prof, top: int = 12, min_us: float = 20.0) -> None:
    """Print where the GPU sat idle inside the profiled encode: the total of the gaps between
    consecutive kernels (and copies) longer than ``min_us``, and the ``top`` longest with the
    kernels on either side."""
    from torch.autograd import DeviceType

    spans = sorted((e.time_range.start, e.time_range.end, e.name) for e in prof.events()
                   if e.device_type == DeviceType.CUDA)
    if not spans:
        return
    gaps, end, before = [], spans[0][1], spans[0][2]
    for start, stop, name in spans[1:]:
        if start - end > min_us:
            gaps.append((start - end, before, name))
        if stop > end:
            end, before = stop, name
    gaps.sort(reverse=True)
    print(f"[{label}] {len(gaps)} GPU idle gaps over {min_us:.0f} us, {sum(g for g, _, _ in gaps) / 1e3:.1f} ms "
          f"in all (first kernel to last: {(end - spans[0][0]) / 1e3:.1f} ms); longest:", flush=True)
    for gap, a, b in gaps[:top]:
        print(f"    {gap / 1e3:7.2f} ms  after {a[:60]}  before {b[:60]}")


def host_around_gpu(label: str, prof, top: int = 10) -> None:
    """Print how long the host works before the first kernel starts and after the last one ends
    (profiler clock, so the profiler's own overhead is included), and the longest top-level
    host calls that started before the first kernel."""
    from torch.autograd import DeviceType

    events = prof.events()
    kernels = [e for e in events if e.device_type == DeviceType.CUDA]
    host = [e for e in events if e.device_type == DeviceType.CPU]
    if not kernels or not host:
        return
    t0 = min(e.time_range.start for e in host)
    first = min(e.time_range.start for e in kernels)
    last = max(e.time_range.end for e in kernels)
    done = max(e.time_range.end for e in host)
    print(f"[{label}] with host profiling: first kernel at {(first - t0) / 1e3:.1f} ms, last kernel ends at "
          f"{(last - t0) / 1e3:.1f} ms, last host call ends at {(done - t0) / 1e3:.1f} ms", flush=True)
    early = sorted((e for e in host if e.cpu_parent is None and e.time_range.start < first),
                   key=lambda e: e.time_range.start - e.time_range.end)
    for e in early[:top]:
        print(f"    host before the first kernel: {e.name[:70]:70s} at {(e.time_range.start - t0) / 1e3:7.2f} ms for "
              f"{(e.time_range.end - e.time_range.start) / 1e3:7.2f} ms")


def attention(batch: int, tokens: int) -> None:
    """SDPA backends and flex_attention on Gemma 3 12B's attention shape."""
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    q = torch.randn(batch, 16, tokens, 256, device=DEV, dtype=torch.bfloat16)
    k = torch.randn(batch, 8, tokens, 256, device=DEV, dtype=torch.bfloat16).repeat_interleave(2, dim=1)
    v = torch.randn_like(k)
    causal = torch.ones(tokens, tokens, device=DEV, dtype=torch.bool).tril()
    mask = causal.expand(batch, 1, tokens, tokens)
    flops = 4 * batch * 16 * tokens * tokens * 256 / 2
    for name, backend in (("flash", SDPBackend.FLASH_ATTENTION), ("cudnn", SDPBackend.CUDNN_ATTENTION),
                          ("efficient", SDPBackend.EFFICIENT_ATTENTION)):
        for with_mask in (False, True):
            try:
                with sdpa_kernel(backend):
                    fn = ((lambda: F.scaled_dot_product_attention(q, k, v, attn_mask=mask)) if with_mask else
                          (lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True)))
                    ms = _time(fn, runs=10)
                print(f"attention {batch}x{tokens} {name:9s} {'mask' if with_mask else 'is_causal'}: {ms:.3f} ms "
                      f"({flops / ms / 1e9:.0f} TFLOPS causal-equivalent)", flush=True)
            except RuntimeError as e:
                print(f"attention {batch}x{tokens} {name:9s} {'mask' if with_mask else 'is_causal'}: "
                      f"n/a ({str(e)[:80]})")
    try:
        from torch.nn.attention.flex_attention import create_block_mask, flex_attention

        bm = create_block_mask(lambda b, h, qi, ki: ki <= qi, batch, None, tokens, tokens, device=DEV)
        flex = torch.compile(flex_attention)
        ms = _time(lambda: flex(q, k, v, block_mask=bm), runs=10)
        print(f"attention {batch}x{tokens} flex      block-causal: {ms:.3f} ms ({flops / ms / 1e9:.0f} TFLOPS)")
    except Exception as e:  # a report line, not a failure: flex may not support head_dim 256 here
        print(f"attention {batch}x{tokens} flex: n/a ({type(e).__name__}: {str(e)[:120]})")


def gemm_floor(model, proj: Projection, batch: int, tokens: int) -> None:
    """Time the encode's GEMMs alone (same shapes and weights, outputs preallocated, nothing
    between them): the floor the rest of the encode sits on at this GPU's matmul rate. Also the
    same with q/k/v and gate/up each as one GEMM on concatenated weights (made for the probe)."""
    m = batch * tokens
    x = {n: torch.randn(m, n, device=DEV, dtype=torch.bfloat16) for n in {lin.in_features for lin in _linears(model)}}
    feats = torch.randn(m, proj.in_features, device=DEV, dtype=torch.bfloat16)
    proj_w = [w.detach() for k, w in proj.named_parameters() if k.endswith("weight")]
    outs: dict[tuple, torch.Tensor] = {}

    def mm(a, w):
        key = (a.shape[0], w.shape[0])
        if key not in outs:
            outs[key] = torch.empty(key, device=DEV, dtype=torch.bfloat16)
        torch.mm(a, w.t(), out=outs[key])

    def run(weights):
        for w in weights:
            mm(x[w.shape[1]], w)
        for w in proj_w:
            mm(feats, w)

    layer_w = [lin.weight.detach() for lin in _linears(model)]
    flops = 2 * m * (sum(w.numel() for w in layer_w) + sum(w.numel() for w in proj_w))
    ms = _time(lambda: run(layer_w))
    print(f"[gemm floor] {batch}x{tokens}: the encode's {len(layer_w) + len(proj_w)} GEMMs alone {ms:.1f} ms "
          f"({flops / ms / 1e9:.0f} TFLOPS)", flush=True)
    fused = []
    for layer in model.layers.requires_grad_(False):
        a, f = layer.self_attn, layer.mlp
        fused += [torch.cat([a.q_proj.weight, a.k_proj.weight, a.v_proj.weight]), a.o_proj.weight,
                  torch.cat([f.gate_proj.weight, f.up_proj.weight]), f.down_proj.weight]
    ms_f = _time(lambda: run(fused))
    print(f"[gemm floor] {batch}x{tokens}: with q/k/v and gate/up fused: {ms_f:.1f} ms "
          f"({flops / ms_f / 1e9:.0f} TFLOPS)", flush=True)
    fused.clear()  # 21.5 GB of concatenated weights


def _linears(model):
    return [m for m in model.layers.modules() if isinstance(m, torch.nn.Linear)]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=1024)
    ap.add_argument("--layers", type=int, default=48)
    ap.add_argument("--rows", type=int, default=22)
    ap.add_argument("--compile", default=None, help="also profile the tower compiled as MODE@SCOPE")
    ap.add_argument("--no-eager", action="store_true")
    ap.add_argument("--attention", action="store_true")
    ap.add_argument("--gemm-floor", action="store_true", help="also time the encode's GEMMs alone")
    args = ap.parse_args(argv)
    from transformers import Gemma3TextModel

    if args.attention:
        attention(args.batch, args.tokens)
    config = gemma3_text_config(**dict(GEMMA_12B, layers=args.layers))
    with DEV:
        model = Gemma3TextModel._from_config(config, dtype=torch.bfloat16, attn_implementation="sdpa").eval()
    use_causal_skip(model)
    d, n = GEMMA_12B["hidden"], args.layers + 1
    proj = Projection("2.3", d, n, {
        "video_aggregate_embed.weight": torch.randn(4096, d * n, device=DEV, dtype=torch.bfloat16) * 0.002,
        "video_aggregate_embed.bias": torch.zeros(4096, device=DEV, dtype=torch.bfloat16),
        "audio_aggregate_embed.weight": torch.randn(2048, d * n, device=DEV, dtype=torch.bfloat16) * 0.002,
        "audio_aggregate_embed.bias": torch.zeros(2048, device=DEV, dtype=torch.bfloat16),
    })
    tower = GemmaTextTower(model=model, tokenizer=None, config=config, format="random", path=Path("random-12b"))
    if args.gemm_floor:
        gemm_floor(model, proj, args.batch, args.tokens)
    ids = torch.randint(4, GEMMA_12B["vocab"], (args.batch, args.tokens))
    mask = torch.ones_like(ids)
    if not args.no_eager:
        stages("eager", PromptEncoder(tower, proj, cuda_graphs=False), ids, mask, args.rows)
    if args.compile:
        mode, _, scope = args.compile.partition("@")
        enc = PromptEncoder(compile_text_tower(tower, scope=scope or "layers", mode=mode, dynamic=False), proj)
        enc.encode_tokens(ids, mask)
        stages(f"compiled {args.compile}", enc, ids, mask, args.rows)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
