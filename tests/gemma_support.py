"""Helpers shared by the Gemma tests: the prompts, a tower's hidden states and a bit-for-bit
comparison of two sets of them (the ``gemma`` fixture is in conftest.py)."""

from __future__ import annotations

import torch

from ltx_mgpu.text.gemma.forward import encode_hidden_states
from ltx_mgpu.text.gemma.tokenizer import tokenize

LONG = "a red camera walks slowly through the city at night while the rain falls and music plays"
PROMPTS = ["the cat", LONG, LONG + " " + LONG, "日本 x\ty\n  é", ""]  # 2..~90 tokens: sliding window 16 exercised


def hidden(tower, prompts=PROMPTS):
    ids, mask, _ = tokenize(tower, prompts)
    return encode_hidden_states(tower, ids, mask), mask


def assert_identical(a, b):
    assert len(a) == len(b)
    assert all(torch.equal(x, y) for x, y in zip(a, b)), [float((x.float() - y.float()).abs().max())
                                                          for x, y in zip(a, b)]
