"""Where the time of a Gemma 3 12B-shaped encode goes (GPU profiler tables).

    python benchmarks/profile_text.py --batch 8

Builds the same random 12B-shaped text tower as ``bench_text.py`` and prints, for one
forward of ``batch x tokens``: the top CUDA kernels (torch.profiler) of the plain forward
with an attention mask and without one, and the time of each stage of our encode (Gemma
forward, feature extraction + projection, device->host copy of the result).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.bench_text import GEMMA_12B  # noqa: E402
from benchmarks.timing import time_ms  # noqa: E402
from ltx_mgpu.text.features import Projection  # noqa: E402
from ltx_mgpu.text.gemma import gemma3_text_config  # noqa: E402


def _time(fn, runs=5):
    return time_ms(torch.device("cuda"), fn, warmup=2, runs=runs)[0]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=1024)
    ap.add_argument("--layers", type=int, default=48)
    ap.add_argument("--rows", type=int, default=18)
    args = ap.parse_args(argv)
    from transformers import Gemma3TextModel

    dev = torch.device("cuda")
    config = gemma3_text_config(**dict(GEMMA_12B, layers=args.layers))
    with dev:
        model = Gemma3TextModel._from_config(config, dtype=torch.bfloat16, attn_implementation="sdpa").eval()
    d, n = GEMMA_12B["hidden"], args.layers + 1
    proj = Projection("2.3", d, n, {
        "video_aggregate_embed.weight": torch.randn(4096, d * n, device=dev, dtype=torch.bfloat16) * 0.002,
        "video_aggregate_embed.bias": torch.zeros(4096, device=dev, dtype=torch.bfloat16),
        "audio_aggregate_embed.weight": torch.randn(2048, d * n, device=dev, dtype=torch.bfloat16) * 0.002,
        "audio_aggregate_embed.bias": torch.zeros(2048, device=dev, dtype=torch.bfloat16),
    })
    ids = torch.randint(4, GEMMA_12B["vocab"], (args.batch, args.tokens), device=dev)
    mask = torch.ones_like(ids)

    def fwd(m):
        with torch.inference_mode():
            return model(input_ids=ids, attention_mask=m, output_hidden_states=True, use_cache=False)

    print(f"attention implementation: {model.config._attn_implementation}")
    t_mask = _time(lambda: fwd(mask))
    t_nomask = _time(lambda: fwd(None))
    hs = fwd(mask).hidden_states
    with torch.inference_mode():
        t_feat = _time(lambda: proj(hs, mask))
        feats = proj(hs, mask)
        t_d2h = _time(lambda: feats.float().cpu())
        t_d2h_rows = _time(lambda: [feats[j].float().cpu() for j in range(args.batch)])
    print(f"{args.batch}x{args.tokens}: forward with mask {t_mask:.1f} ms, without mask {t_nomask:.1f} ms, "
          f"features+projection {t_feat:.1f} ms, D2H fp32 {t_d2h:.1f} ms (per-row {t_d2h_rows:.1f} ms)")
    from torch.profiler import ProfilerActivity, profile

    for label, m in (("with mask", mask), ("without mask", None)):
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            fwd(m)
            torch.cuda.synchronize()
        print(f"\n=== plain forward {label} ===")
        print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=args.rows, max_name_column_width=70))
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        with torch.inference_mode():
            proj(hs, mask)
        torch.cuda.synchronize()
    print("\n=== features + projection ===")
    print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=10, max_name_column_width=70))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
