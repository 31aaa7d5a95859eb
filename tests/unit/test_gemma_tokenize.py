"""Tokenizing like ComfyUI (BOS, no EOS, left padding, truncation and the token budget) and encoding
padded batches.

Uses the tiny deterministic Gemma (ltx_mgpu.assets), built once per session by tests/conftest.py.
"""

from __future__ import annotations

import pytest
import torch
from gemma_support import LONG

from ltx_mgpu.assets.gemma import BOS_ID, EOS_ID, PAD_ID
from ltx_mgpu.text.encoder.loading import load_gemma_text_tower
from ltx_mgpu.text.gemma.forward import encode_hidden_states
from ltx_mgpu.text.gemma.tokenizer import PromptTooLongError, check_prompts, tokenize

# --------------------------------------------------------------------------- tokenize / encode


def test_tokenize_bos_no_eos_left_padding(gemma):
    tower = gemma["tower"]
    ids, mask, dropped = tokenize(tower, ["the cat walks slowly", "x", ""])
    assert ids.dtype == mask.dtype == torch.long and dropped == [0, 0, 0]
    lengths = mask.sum(1).tolist()
    assert lengths[1] == 2 and lengths[2] == 1 and ids.shape[1] == lengths[0]  # padded to the longest, not 1024
    for row, n in zip(range(3), lengths):
        assert mask[row, : ids.shape[1] - n].eq(0).all() and mask[row, ids.shape[1] - n :].eq(1).all()
        assert ids[row, : ids.shape[1] - n].eq(PAD_ID).all()
        assert ids[row, ids.shape[1] - n] == BOS_ID and EOS_ID not in ids[row].tolist()
    assert ids[0].tolist() == tower.tokenizer("the cat walks slowly")["input_ids"]
    # ComfyUI's escape_important/unescape_important round trip drops the backslash of \( and \)
    assert torch.equal(tokenize(tower, ["a \\(red\\) cat"])[0], tokenize(tower, ["a (red) cat"])[0])


def test_tokenize_truncation_and_budget_error(gemma):
    tower = gemma["tower"]
    n = len(tower.tokenizer(LONG)["input_ids"])
    ids, mask, dropped = tokenize(tower, ["the cat", LONG], max_length=10)
    assert ids.shape == (2, 10) and dropped == [0, n - 10]
    assert ids[1].tolist() == tower.tokenizer(LONG)["input_ids"][:10]  # the first tokens, BOS included
    with pytest.raises(PromptTooLongError, match=rf"prompt 1 has {n} tokens .* budget of 10"):
        tokenize(tower, ["the cat", LONG], max_length=10, truncate=False)
    # what a prompt must be is checked where prompts come in (check_prompts), not per tokenize call
    for bad, match in (([None], r"prompts\[0\] is NoneType, expected str"),
                       (["ok", "\ud800"], r"prompts\[1\] is not valid Unicode text")):
        with pytest.raises(ValueError, match=match):
            check_prompts(bad)


def test_left_padding_keeps_valid_states_up_to_rounding(gemma):
    """Position ids are arange over the padded length (as in ComfyUI), so padding shifts the RoPE
    positions of the real tokens; RoPE is relative, so in fp32 the real tokens' hidden states
    are unchanged to ~1e-6 (bf16: a few bf16 ulps of rounding, documented in tokenize())."""
    tower = load_gemma_text_tower(gemma["comfy"], dtype=torch.float32)
    alone_ids, alone_mask, _ = tokenize(tower, ["the cat walks"])
    batch_ids, batch_mask, _ = tokenize(tower, [LONG + LONG, "the cat walks"])
    n = alone_ids.shape[1]
    assert batch_ids.shape[1] > 3 * n
    alone = encode_hidden_states(tower, alone_ids, alone_mask)
    batch = encode_hidden_states(tower, batch_ids, batch_mask)
    for a, b in zip(alone, batch):
        torch.testing.assert_close(b[1, -n:], a[0], atol=1e-4, rtol=1e-4)


def test_encode_rejects_bad_shapes(gemma):
    with pytest.raises(ValueError, match=r"\[B, T\]"):
        encode_hidden_states(gemma["tower"], torch.ones(4, dtype=torch.long), torch.ones(4, dtype=torch.long))
