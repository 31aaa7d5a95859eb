"""Helpers shared by the Gemma tests: the prompts, a tower's hidden states and a bit-for-bit
comparison of two sets of them, a batch left-padded to a width, the same tower under transformers'
stock SDPA (the ``gemma`` fixture is in conftest.py)."""

from __future__ import annotations

import torch

from ltx_mgpu.text.gemma.forward import copy_sharing_weights, encode_hidden_states
from ltx_mgpu.text.gemma.tokenizer import tokenize
from ltx_mgpu.text.gemma.tower import GemmaTextTower

LONG = "a red camera walks slowly through the city at night while the rain falls and music plays"
PROMPTS = ["the cat", LONG, LONG + " " + LONG, "日本 x\ty\n  é", ""]  # 2..~90 tokens: sliding window 16 exercised


def hidden(tower, prompts=PROMPTS):
    ids, mask, _ = tokenize(tower, prompts)
    return encode_hidden_states(tower, ids, mask), mask


def assert_identical(a, b):
    assert len(a) == len(b)
    assert all(torch.equal(x, y) for x, y in zip(a, b)), [float((x.float() - y.float()).abs().max())
                                                          for x, y in zip(a, b)]


def padded(tower, prompts, width=64):
    """Token ids and mask left-padded to ``width`` (``tokenize`` pads to the longest prompt only)."""
    ids, mask, _ = tokenize(tower, prompts, max_length=width)
    pad = width - ids.shape[1]
    pad_id = tower.tokenizer.pad_token_id
    return (torch.cat([torch.full((len(prompts), pad), pad_id, dtype=ids.dtype), ids], dim=1),
            torch.cat([torch.zeros((len(prompts), pad), dtype=mask.dtype), mask], dim=1))


def stock_sdpa(tower: GemmaTextTower) -> GemmaTextTower:
    """The same weights under transformers' own SDPA implementation (own config)."""
    model = copy_sharing_weights(tower.model, own_config=True)
    model.set_attn_implementation("sdpa")
    return GemmaTextTower(model, tower.tokenizer, model.config, tower.format, tower.path, tower.files, tower.weights)
