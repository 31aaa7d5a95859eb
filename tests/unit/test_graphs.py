"""The CUDA-graph runner's layout on the CPU (``TowerGraphs(capture=False)`` runs the static-buffer
forward a graph holds, eagerly): left-aligned rows with filler after them, positions, length
buckets and the way back to left padding must give what ``run_tower`` gives. Capture and replay
themselves are tested on a GPU (tests/test_cuda.py)."""

from __future__ import annotations

import pytest
import torch

from ltx_mgpu.assets import tiny_gemma_dir, tiny_ltx_checkpoint
from ltx_mgpu.text.encoder.loading import load_gemma_text_tower
from ltx_mgpu.text.encoder.prompt import PromptEncoder
from ltx_mgpu.text.features import load_projection
from ltx_mgpu.text.gemma import graphs
from ltx_mgpu.text.gemma.forward import copy_sharing_weights, run_tower
from ltx_mgpu.text.gemma.tokenizer import tokenize
from ltx_mgpu.text.gemma.tower import GemmaTextTower

# the tiny Gemma's sliding window is 16 tokens: every prompt here fits in it
PROMPTS = ["a cat", "a red fox", "x", "two words"]


@pytest.fixture(scope="module")
def tower():
    return load_gemma_text_tower(tiny_gemma_dir(), dtype=torch.float32)


def _runner(tower, **kw):
    return graphs.TowerGraphs(tower, capture=False, **{"bucket": 4, "max_tokens": 64, **kw})


def _assert_real_tokens_equal(got, want, mask):
    m = mask.shape[1]
    assert got.offset == want.offset and torch.equal(got.attention_mask, want.attention_mask)
    assert len(got.hidden_states) == len(want.hidden_states)
    for j, n in enumerate(mask.sum(1).tolist()):
        for g, w in zip(got.hidden_states, want.hidden_states):
            assert g.shape == w.shape
            torch.testing.assert_close(g[j, m - n:], w[j, m - n:], rtol=0, atol=2e-5)


@pytest.mark.parametrize("prompts", [PROMPTS[1:2], PROMPTS, ["a cat", "a dog"]], ids=["one", "unequal", "equal"])
def test_graph_layout_gives_the_eager_hidden_states(tower, prompts):
    ids, mask, _ = tokenize(tower, prompts)
    runner = _runner(tower)
    got = runner.run(ids, mask)
    assert got is not None
    _assert_real_tokens_equal(got, run_tower(tower, ids, mask), got.attention_mask)
    m = got.attention_mask.shape[1]
    assert runner.shapes == [(len(prompts), runner.width(m))]


def test_rows_keep_their_left_padded_positions(tower):
    """A prompt inside a wider padded batch runs at the positions run_tower gives it there (RoPE
    is relative, so a shift shows in rounding only: the positions are checked directly)."""
    ids, mask, _ = tokenize(tower, PROMPTS[:1])
    pad = 5
    ids = torch.cat([torch.zeros((1, pad), dtype=ids.dtype), ids], dim=1)
    mask = torch.cat([torch.zeros((1, pad), dtype=mask.dtype), mask], dim=1)
    runner = _runner(tower)
    got = runner.run(ids, mask)
    assert got.offset == pad
    _assert_real_tokens_equal(got, run_tower(tower, ids, mask), got.attention_mask)
    (shape, g), = runner._graphs.items()
    n, t = int(mask.sum()), mask.shape[1]
    assert torch.equal(g.positions, torch.arange(t - n, t - n + shape[1])[None])


def test_filler_tokens_change_nothing(tower):
    ids, mask, _ = tokenize(tower, PROMPTS)
    a = _runner(tower).run(ids, mask)
    other = _runner(tower)
    other.pad_id = 7  # a real word as filler
    b = other.run(ids, mask)
    for x, y in zip(a.hidden_states, b.hidden_states):
        assert torch.equal(x, y)


def test_shapes_are_bucketed_and_reused(tower):
    runner = _runner(tower)
    for p in ["x", "a cat", "two words", "a dog"]:
        ids, mask, _ = tokenize(tower, [p])
        assert runner.run(ids, mask) is not None
    assert runner.shapes == sorted({(1, runner.width(int(tokenize(tower, [p])[1].sum()))) for p in
                                    ["x", "a cat", "two words", "a dog"]})
    assert runner.width(1) == 4 and runner.width(4) == 4 and runner.width(5) == 8


def test_batches_it_does_not_graph_are_left_to_the_eager_path(tower):
    ids, mask, _ = tokenize(tower, PROMPTS)
    assert _runner(tower, max_tokens=8).run(ids, mask) is None  # 4 rows x 12 > 8 tokens
    long_ids, long_mask, _ = tokenize(tower, ["one two three four five six seven eight nine ten eleven twelve"])
    assert long_mask.shape[1] > 16 and _runner(tower).run(long_ids, long_mask) is None  # beyond the window
    ids, mask, _ = tokenize(tower, PROMPTS[:1])  # padded on the right: eager raises, the runner passes
    ids, mask = (torch.cat([ids, torch.zeros((1, 3), dtype=ids.dtype)], 1),
                 torch.cat([mask, torch.zeros((1, 3), dtype=mask.dtype)], 1))
    assert _runner(tower).run(ids, mask) is None
    with pytest.raises(ValueError, match="left padding"):
        run_tower(tower, ids, mask)


def test_prompt_encoder_with_graph_layout_equals_eager(tower):
    proj = load_projection(tiny_ltx_checkpoint("2.3"), num_layers=tower.num_hidden_states)
    eager = PromptEncoder(tower, proj, cuda_graphs=False)
    graphed = PromptEncoder(tower, proj, cuda_graphs=False)
    graphed.graphs = _runner(tower)
    for batch in (1, 8):
        for e, g in zip(eager.encode(PROMPTS, batch_size=batch), graphed.encode(PROMPTS, batch_size=batch)):
            torch.testing.assert_close(g.tensor, e.tensor, rtol=0, atol=1e-4)
    assert len(graphed.graphs.shapes) >= 2


def test_which_towers_are_graphed(tower, monkeypatch, caplog):
    assert graphs.ineligible(tower) == "the layers are not on a CUDA device"
    assert graphs.ineligible(tower, capture=False) is None
    proj = load_projection(tiny_ltx_checkpoint("2.3"), num_layers=tower.num_hidden_states)
    assert PromptEncoder(tower, proj).graphs is None  # a CPU tower runs eagerly
    with pytest.raises(ValueError, match="not on a CUDA device"):
        graphs.TowerGraphs(tower)

    model = copy_sharing_weights(tower.model, own_config=True)
    other = GemmaTextTower(model, tower.tokenizer, model.config, tower.format, tower.path, tower.files)
    model.hf_device_map = {"layers.0": 0, "layers.1": 1}
    assert "several devices" in graphs.ineligible(other, capture=False)
    model.hf_device_map = {"": 0}
    assert graphs.ineligible(other, capture=False) is None
    model.config.use_bidirectional_attention = True
    assert "bidirectional" in graphs.ineligible(other, capture=False)
    model.config.use_bidirectional_attention = False
    model.layers[0].forward = torch.compile(model.layers[0].forward)
    assert "compile" in graphs.ineligible(other, capture=False)

    for value, on in (("0", False), ("off", False), ("1", True), ("", True)):
        monkeypatch.setenv(graphs.ENV, value)
        assert graphs.graphs_enabled() is on
    monkeypatch.setenv(graphs.ENV, "bogus")
    with caplog.at_level("WARNING", logger="ltx_mgpu.text.gemma.graphs"):
        assert graphs.graphs_enabled() is True
    assert ("$LTX_MGPU_CUDA_GRAPHS='bogus': give one of 1, on, true, yes, 0, off, false, no: CUDA graphs stay on"
            in caplog.text)


def test_the_graphed_forward_runs_causal_kernels_without_a_mask_even_while_capturing(tower, monkeypatch):
    """During a CUDA-graph capture transformers' is_tracing() is true and its mask builder would
    make a [B, 1, W, W] mask; the graphed forward passes "no mask" for every layer type instead."""
    import torch.nn.functional as F
    import transformers.masking_utils as masking

    calls, sdpa = [], F.scaled_dot_product_attention

    def spy(*args, **kwargs):
        calls.append((kwargs.get("attn_mask") is None, kwargs.get("is_causal")))
        return sdpa(*args, **kwargs)

    monkeypatch.setattr(F, "scaled_dot_product_attention", spy)
    monkeypatch.setattr(masking, "is_tracing", lambda *a, **k: True)
    ids, mask, _ = tokenize(tower, PROMPTS)
    got = _runner(tower).run(ids, mask)
    assert calls and set(calls) == {(True, True)}
    monkeypatch.undo()
    _assert_real_tokens_equal(got, run_tower(tower, ids, mask), got.attention_mask)


def test_clear_drops_the_graphs_and_the_buffer(tower):
    runner = _runner(tower)
    ids, mask, _ = tokenize(tower, PROMPTS)
    runner.run(ids, mask)
    assert runner.shapes and runner._buffer is not None
    runner.clear()
    assert runner.shapes == [] and runner._buffer is None
    assert runner.run(ids, mask) is not None and runner.shapes
