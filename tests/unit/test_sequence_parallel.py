"""Sequence parallelism in one process: at world size 1 the wrapper is the plain model (and
checks the token budget), the attention wrappers install idempotently and come off, the head
split lists the world sizes that work, and wrapping the wrong module names the fix. On real
ranks: ``tests/integration/test_sequence_parallel_ranks.py``.
"""

from __future__ import annotations

import pytest
import torch
from sp_harness import build_tiny_model, run_case

from ltx_mgpu.denoise.parallel.split import (
    SequenceParallelConfigError,
    check_sequence_parallel_config,
    valid_world_sizes,
)
from ltx_mgpu.denoise.parallel.ulysses import (
    SequenceParallelTransformer,
    UlyssesSelfAttention,
    UlyssesVideoToAudioAttention,
    _ShardState,
    install_attention_wrappers,
    remove_attention_wrappers,
)

# 45 = 3x3x5 tokens (not divisible by 2 or 4); 24 = 2x3x4 (divisible by 2 and 4)
AV_ODD = dict(frames=3, height=3, width=5, audio_tokens=7)


# --------------------------------------------------------------------------- in-process


def test_world_size_one_is_the_plain_model():
    model = build_tiny_model()
    originals = [(b.attn1.attention_function, b.video_to_audio_attn.attention_function)
                 for b in model.transformer_blocks]
    sp = SequenceParallelTransformer(model, None, max_tokens=64)
    assert sp.world_size == 1
    after = [(b.attn1.attention_function, b.video_to_audio_attn.attention_function) for b in model.transformer_blocks]
    assert after == originals
    case = dict(name="av_odd", **AV_ODD)
    with torch.no_grad():
        ref_v, ref_a = run_case(model, case)
        got_v, got_a = run_case(sp, case)
    assert torch.equal(got_v, ref_v) and torch.equal(got_a, ref_a)
    with pytest.raises(SequenceParallelConfigError, match="max_tokens=40"):
        run_case(SequenceParallelTransformer(model, None, max_tokens=40), case)


def test_wrappers_are_idempotent_and_removable():
    model = build_tiny_model()
    original = [(b.attn1.attention_function, b.video_to_audio_attn.attention_function)
                for b in model.transformer_blocks]
    state = _ShardState(group=None, world=2, rank=0)
    assert install_attention_wrappers(model, state) == 2 * len(model.transformer_blocks)
    install_attention_wrappers(model, _ShardState(group=None, world=2, rank=1))
    for block, (a1, v2a) in zip(model.transformer_blocks, original):
        assert isinstance(block.attn1.attention_function, UlyssesSelfAttention)
        assert isinstance(block.video_to_audio_attn.attention_function, UlyssesVideoToAudioAttention)
        assert block.attn1.attention_function.inner is a1  # not a wrapper around a wrapper
        assert block.video_to_audio_attn.attention_function.inner is v2a
        assert block.attn1.attention_function.state.rank == 1
    assert remove_attention_wrappers(model) == 2 * len(model.transformer_blocks)
    assert remove_attention_wrappers(model) == 0
    restored = [(b.attn1.attention_function, b.video_to_audio_attn.attention_function)
                for b in model.transformer_blocks]
    assert restored == original


def test_head_divisibility_lists_the_world_sizes_that_work():
    model = build_tiny_model(num_attention_heads=6, audio_num_attention_heads=4, cross_attention_dim=48)
    assert valid_world_sizes(model) == [1, 2]
    check_sequence_parallel_config(model, 2)
    with pytest.raises(SequenceParallelConfigError,
                       match=("6 video attention heads and 4 audio attention heads.*4 ranks do not divide them"
                              ".*: 1, 2")):
        check_sequence_parallel_config(model, 4)
    assert valid_world_sizes(build_tiny_model(video_only=True, num_attention_heads=6,
                                              cross_attention_dim=48)) == [1, 2, 3, 6]


def test_wrapping_an_x0_model_names_the_fix():
    from ltx_core.model.transformer import X0Model

    with pytest.raises(TypeError, match="velocity_model"):
        SequenceParallelTransformer(X0Model(build_tiny_model()), None, 64)
