"""Sequence parallelism in one process: at world size 1 the wrapper is the plain model (and
checks the token budget), or with token buckets the model padded to a bucket, which equals it to
float32 rounding and hands the attention the real keys without a mask; the attention wrappers
install idempotently and come off, the head split lists the world sizes that work, and wrapping
the wrong module names the fix. On real ranks: ``tests/integration/test_sequence_parallel_ranks.py``.
"""

from __future__ import annotations

import pytest
import torch
from sp_harness import build_tiny_model, run_case

from ltx_mgpu.denoise.parallel.buckets import TokenBuckets
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


def _block_tokens(model) -> list[int]:
    """The video token counts the first block sees, call by call (filled by a hook)."""
    seen: list[int] = []
    model.transformer_blocks[0].register_forward_pre_hook(
        lambda _m, args, kwargs: seen.append(kwargs["video"].x.shape[1]), with_kwargs=True)
    return seen


@pytest.mark.parametrize("case", [
    dict(name="av_odd", **AV_ODD),
    dict(name="cfg_batch_stg_attention_mask", **AV_ODD, batch=2, perturbations="mixed", attention_mask=True),
    dict(name="video_only", frames=3, height=3, width=5, video_only=True),
    dict(name="a_count_on_a_bucket_is_not_padded", frames=2, height=4, width=8, audio_tokens=5),
], ids=lambda c: c["name"])
@pytest.mark.parametrize("buckets", [TokenBuckets(), TokenBuckets(32, 16)], ids=["default", "steps_of_16"])
def test_a_call_padded_to_its_bucket_equals_the_unpadded_call(case, buckets):
    """45 video tokens run as 64 (default) or 48 (64 tokens, a bucket, as 64): the padded keys left
    out of the self- and video->audio attention (the first latent frame's timesteps are 0, the
    rest sigma: per token; positions padded with the last token's), the padded rows dropped; both
    outputs equal the plain model to float32 rounding."""
    video_only = case.get("video_only", False)
    plain, padded = build_tiny_model(video_only=video_only), build_tiny_model(video_only=video_only)
    sp = SequenceParallelTransformer(padded, None, max_tokens=4096, layout="auto", buckets=buckets)
    seen = _block_tokens(padded)
    tokens = case["frames"] * case["height"] * case["width"]
    with torch.no_grad():
        ref_v, ref_a = run_case(plain, case)
        got_v, got_a = run_case(sp, case)
    assert seen == [buckets.padded(tokens)] and seen[0] >= tokens
    assert got_v.shape == ref_v.shape and (got_v - ref_v).abs().max().item() <= 1e-5
    assert ref_a is None or (got_a.shape == ref_a.shape and (got_a - ref_a).abs().max().item() <= 1e-5)


def test_the_padded_keys_are_left_out_not_masked():
    """Both attentions that see the whole video get the real keys and values only, and no mask
    (so SDPA keeps its mask-less flash / cuDNN kernels, and FlashAttention3 runs), while the
    queries of the self-attention are all the padded rows."""
    model = build_tiny_model()
    sp = SequenceParallelTransformer(model, None, max_tokens=4096, buckets=TokenBuckets())
    calls = []
    for block in model.transformer_blocks:
        for name in ("attn1", "video_to_audio_attn"):
            wrapper = getattr(block, name).attention_function
            inner = wrapper.inner

            def record(q, k, v, heads, mask=None, _inner=inner, _name=name):
                calls.append((_name, q.shape[1], k.shape[1], v.shape[1], mask))
                return _inner(q, k, v, heads, mask)

            wrapper.inner = record
    with torch.no_grad():
        run_case(sp, dict(**AV_ODD))
    assert sorted({c[:4] for c in calls}) == [("attn1", 64, 45, 45), ("video_to_audio_attn", 7, 45, 45)]
    assert len(calls) == 2 * len(model.transformer_blocks) and all(c[4] is None for c in calls)


def test_a_bucket_never_passes_the_token_budget():
    model = build_tiny_model()
    sp = SequenceParallelTransformer(model, None, max_tokens=50, buckets=TokenBuckets())
    seen = _block_tokens(model)
    with torch.no_grad():
        run_case(sp, dict(**AV_ODD))
    assert seen == [50]  # 45 tokens: the bucket is 64, the budget 50


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


def test_the_wrappers_operator_runs_only_inside_a_sequence_parallel_forward():
    """``torch.ops.ltx_mgpu.ulysses_attention`` (what a compiled block calls for a wrapper) runs
    the wrapper installed for the forward under way; called outside one it refuses, naming where
    it runs, instead of running some other model's wrapper."""
    q = torch.randn(1, 4, 8)
    with pytest.raises(RuntimeError, match="only inside SequenceParallelTransformer.forward"):
        torch.ops.ltx_mgpu.ulysses_attention(q, q, q, 2, None, "self")
