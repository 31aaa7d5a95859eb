"""The real tokens of a prompt run at the RoPE positions LTX-2's tokenizers give them: left-padded to
``min(max_length, 1024)`` (ltx-core pads to its 1024-token ``max_length``, ComfyUI to
``max(1024, T)``), the pad columns not computed. In fp32 the encoder then equals ltx-core's full
1024-token forward to summation order, where positions counted from 0 differ by far more (the
rounding of the RoPE angles of other positions)."""

from __future__ import annotations

import pytest
import torch

from ltx_mgpu.text.encoder.loading import load_gemma_text_tower
from ltx_mgpu.text.encoder.prompt import PromptEncoder
from ltx_mgpu.text.features import load_projection
from ltx_mgpu.text.gemma.tokenizer import tokenize

PROMPT = "A cinematic shot of a red fox running through fresh snow at dawn, breath steaming, soft golden light."


@pytest.fixture(scope="module")
def encoders(tiny_gemma_dir, tiny_ltx_23):
    tower = load_gemma_text_tower(tiny_gemma_dir, dtype=torch.float32)
    projection = load_projection(tiny_ltx_23, dtype=torch.float32, num_layers=tower.num_hidden_states)
    return (PromptEncoder(tower, projection, cuda_graphs=False),
            PromptEncoder(tower, projection, trim=False, cuda_graphs=False))  # every column computed


def _left_pad(tower, ids, mask, width):
    n = width - ids.shape[1]
    pad = torch.full((ids.shape[0], n), int(tower.tokenizer.pad_token_id))
    return torch.cat([pad, ids], 1), torch.cat([torch.zeros((mask.shape[0], n), dtype=mask.dtype), mask], 1)


def _rel(a, b) -> float:
    return float((a - b).abs().max() / b.abs().max())


def test_a_prompt_runs_at_its_positions_in_the_1024_token_padded_sequence(encoders):
    trimmed, full = encoders
    ids, mask, _ = tokenize(full.tower, [PROMPT])
    ltx_core = full.encode_tokens(*_left_pad(full.tower, ids, mask, 1024))[0].tensor
    from_zero = full.encode_tokens(ids, mask)[0].tensor
    for max_tokens in (None, 8192):  # Prompt Encode's budget, and whole (the CLIP output, as ComfyUI pads)
        ours = trimmed.encode([PROMPT], max_tokens=max_tokens)[0].tensor
        assert ours.shape == ltx_core.shape
        assert _rel(ours, ltx_core) <= 1e-6
    assert _rel(from_zero, ltx_core) > 1e-6  # the check tells the positions apart


def test_a_budget_under_1024_pads_to_the_budget_and_a_longer_prompt_is_not_padded(encoders):
    trimmed, full = encoders
    ids, mask, _ = tokenize(full.tower, [PROMPT])
    small = PromptEncoder(trimmed.tower, trimmed.projection, token_budget=96, cuda_graphs=False)
    padded = full.encode_tokens(*_left_pad(full.tower, ids, mask, 96))[0].tensor
    assert _rel(small.encode([PROMPT])[0].tensor, padded) <= 1e-6  # ltx-core pads to its max_length
    long = " ".join([PROMPT] * 60)
    n = trimmed.token_counts([long], max_tokens=8192)[0]
    assert n > 1024
    ids, mask, _ = tokenize(full.tower, [long], max_length=8192, truncate=False)
    assert _rel(trimmed.encode([long], max_tokens=8192)[0].tensor, full.encode_tokens(ids, mask)[0].tensor) <= 1e-6
