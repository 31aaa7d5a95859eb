"""The tower forward of ``ltx_mgpu.text.gemma.forward``: trimmed padding, the causal-skip attention
implementation and the host embedding table give the same results as the plain computation."""

from __future__ import annotations

import pytest
import torch
from gemma_support import padded, stock_sdpa

from ltx_mgpu.assets import tiny_gemma_dir, tiny_ltx_checkpoint
from ltx_mgpu.text.encoder.loading import load_gemma_text_tower
from ltx_mgpu.text.encoder.prompt import PromptEncoder
from ltx_mgpu.text.features import load_projection
from ltx_mgpu.text.gemma.forward import (
    ATTENTION,
    HostEmbedding,
    copy_sharing_weights,
    offload_embeddings,
    register_attention,
    run_tower,
)
from ltx_mgpu.text.gemma.tokenizer import tokenize

PROMPTS = ["a cat", "A red fox running through fresh snow at dawn, cinematic, slow motion, 35 mm film.", "x",
           "two words"]


@pytest.fixture(scope="module")
def tower():
    return load_gemma_text_tower(tiny_gemma_dir(), dtype=torch.float32)


def test_loaded_towers_use_the_causal_skip_implementation(tower):
    assert tower.model.config._attn_implementation == ATTENTION


def test_trimmed_batch_equals_the_padded_batch_at_real_tokens(tower):
    ids, mask = padded(tower, PROMPTS)
    full = run_tower(tower, ids, mask, trim=False)
    trimmed = run_tower(tower, ids, mask, trim=True)
    m = int(mask.sum(1).max())
    assert trimmed.offset == 64 - m and full.offset == 0
    assert trimmed.hidden_states[0].shape[1] == m and torch.equal(trimmed.attention_mask, mask[:, 64 - m:])
    for j, n in enumerate(mask.sum(1).tolist()):
        for hf, ht in zip(full.hidden_states, trimmed.hidden_states):
            torch.testing.assert_close(ht[j, m - n:], hf[j, 64 - n:], rtol=0, atol=1e-5)


def test_trimmed_rows_keep_their_padded_positions(tower):
    """A trimmed single prompt keeps the positions it has at the end of the 64-token window."""
    ids, mask = padded(tower, PROMPTS[1:2])
    trimmed = run_tower(tower, ids, mask).hidden_states[-1]
    full = run_tower(tower, ids, mask, trim=False).hidden_states[-1]
    n = int(mask.sum())
    torch.testing.assert_close(trimmed[0], full[0, -n:], rtol=0, atol=1e-5)


def test_right_padding_is_refused_when_trimming(tower):
    ids = torch.tensor([[2, 5, 6, 0]])
    mask = torch.tensor([[1, 1, 1, 0]])
    with pytest.raises(ValueError, match="left padding"):
        run_tower(tower, ids, mask)
    assert len(run_tower(tower, ids, mask, trim=False).hidden_states) == tower.num_hidden_states


def test_causal_skip_equalsstock_sdpa(tower):
    stock = stock_sdpa(tower)
    assert stock.model.config._attn_implementation == "sdpa" and tower.model.config._attn_implementation == ATTENTION
    for prompts in (PROMPTS, PROMPTS[1:2]):  # with padding (mask kept) and without (no mask at all)
        ids, mask, _ = tokenize(tower, prompts, max_length=64)
        ours = run_tower(tower, ids, mask, trim=False).hidden_states
        ref = run_tower(stock, ids, mask, trim=False).hidden_states
        for a, b in zip(ours, ref):
            keep = mask.bool()
            torch.testing.assert_close(a[keep], b[keep], rtol=0, atol=1e-5)


def test_mask_function_drops_the_window_only_when_it_covers_every_key():
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, sliding_window_causal_mask_function

    mask_fn = ALL_MASK_ATTENTION_FUNCTIONS[register_attention()]
    common = dict(batch_size=1, q_length=8, q_offset=0, kv_offset=0, allow_is_causal_skip=True,
                  mask_function=sliding_window_causal_mask_function(8), device="cpu")
    assert mask_fn(kv_length=8, local_size=8, **common) is None  # window 8 covers 8 keys: plain causal
    common.update(q_length=9, mask_function=sliding_window_causal_mask_function(8))
    narrow = mask_fn(kv_length=9, local_size=8, **common)  # key 0 is outside query 8's window
    assert narrow is not None and not bool(narrow[0, 0, 8, 0]) and bool(narrow[0, 0, 8, 1])
    padded = mask_fn(kv_length=9, local_size=16, attention_mask=torch.tensor([[0] + [1] * 8]), **common)
    assert padded is not None and not bool(padded[0, 0, 5, 0])  # a pad key stays masked


def test_host_embedding_is_bit_identical(tower):
    emb = tower.model.get_input_embeddings()
    host = HostEmbedding(emb, torch.device("cpu"))
    assert host.weight.data_ptr() == emb.weight.data_ptr() or torch.equal(host.weight, emb.weight)
    ids = torch.tensor([[2, 7, 9, 11], [0, 0, 2, 5]])
    assert torch.equal(host(ids), emb(ids))
    # the parameter keeps its name, so state dicts (and NF4 saving) are unchanged
    model = copy_sharing_weights(tower.model)
    model.set_input_embeddings(host)
    assert set(model.state_dict()) == set(tower.model.state_dict())
    # a model on the CPU is left alone
    assert offload_embeddings(copy_sharing_weights(tower.model)) is False


def test_encoder_trim_equals_full_width_encode(tower):
    proj = load_projection(tiny_ltx_checkpoint("2.0"), num_layers=tower.num_hidden_states)
    ids, mask = padded(tower, PROMPTS)
    trimmed = PromptEncoder(tower, proj).encode_tokens(ids, mask)
    full = PromptEncoder(tower, proj, trim=False).encode_tokens(ids, mask)
    for a, b, n in zip(trimmed, full, mask.sum(1).tolist()):
        assert a.num_tokens == n
        assert a.tensor.shape == b.tensor.shape and a.tensor.dtype == torch.float32
        torch.testing.assert_close(a.tensor, b.tensor, rtol=0, atol=1e-5)


