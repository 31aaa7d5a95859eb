"""The video token bucket rule (``ltx_mgpu.denoise.parallel.buckets``): the padding stays under the
promised fraction, buckets are multiples of every power-of-two GPU count, padding to a bucket and
to a multiple of the ranks is one padding, the token budget caps it, and the setting turns it on,
off or names the fix. That a padded call equals the unpadded one: ``test_sequence_parallel.py``
(one process) and ``tests/integration/test_token_buckets.py`` (ranks, compiled graphs)."""

from __future__ import annotations

import pytest

from ltx_mgpu.denoise.parallel.buckets import DEFAULT_PER_OCTAVE, MIN_STEP, TokenBuckets, token_buckets


def test_padding_is_under_one_step_and_a_step_under_the_promised_fraction():
    rule = TokenBuckets()
    assert (rule.per_octave, rule.min_step) == (DEFAULT_PER_OCTAVE, MIN_STEP) == (32, 64)
    previous = 0
    for t in range(1, 70_000):
        b = rule.bucket(t)
        assert t <= b < t + rule.step(t)
        assert b % rule.step(t) == 0 and b >= previous  # a grid, never decreasing
        previous = b
        if t >= rule.per_octave * rule.min_step:
            assert b - t < t / 32 and b % 64 == 0


def test_each_doubling_holds_per_octave_buckets():
    for per_octave in (8, 16, 32):
        rule = TokenBuckets(per_octave)
        assert len({rule.bucket(t) for t in range(8193, 16385)}) == per_octave  # (2^13, 2^14]
    assert len({TokenBuckets().bucket(t) for t in range(1, 2049)}) == 2048 // 64  # below: steps of min_step


def test_ltx2_sizes_nearby_share_a_bucket():
    rule = TokenBuckets()
    assert rule.bucket(16 * 16 * 24) == 6144  # a bucket of its own: no padding
    assert rule.bucket(16 * 20 * 19) == 6144  # 6,080 pads 64 tokens and runs 6,144's graph
    assert rule.bucket(6145) == 6144 + 128
    assert rule.bucket(24_576) == 24_576 and rule.bucket(24_000) == 24_064


def test_one_padding_for_the_bucket_and_the_ranks():
    rule = TokenBuckets()
    for world in (1, 2, 4, 8):
        assert rule.padded(6080, world) == 6144  # a bucket is already a multiple: nothing added
    assert rule.padded(6080, 3) == 6144 and rule.padded(6200, 3) == 6273  # 6,272 -> next multiple of 3
    assert rule.padded(45, 2) == 64
    for t in range(1, 3000, 7):
        for world in (1, 2, 3, 4, 6):
            p = rule.padded(t, world)
            assert p % world == 0 and p >= t and p == rule.padded(t, world, limit=None)


def test_the_token_budget_caps_the_bucket():
    rule = TokenBuckets()
    assert rule.bucket(32_700) == 32_768
    assert rule.padded(32_700, 1, limit=32_710) == 32_710  # the budget, not the bucket above it
    assert rule.padded(32_700, 4, limit=32_710) == 32_712  # the budget rounded up to the ranks
    assert rule.padded(32_700, 1, limit=32_700) == 32_700


@pytest.mark.parametrize("kwargs", [dict(per_octave=24), dict(per_octave=0), dict(min_step=48), dict(min_step=True)])
def test_a_rule_that_is_not_a_power_of_two_is_refused(kwargs):
    with pytest.raises(ValueError, match="must be a power of two"):
        TokenBuckets(**kwargs)


def test_bad_counts_are_refused():
    with pytest.raises(ValueError, match="at least 1 token"):
        TokenBuckets().bucket(0)
    with pytest.raises(ValueError, match="world size is at least 1"):
        TokenBuckets().padded(10, 0)


def test_the_setting_turns_buckets_on_off_or_names_the_fix():
    assert token_buckets({}) == TokenBuckets()
    assert token_buckets({"LTX_MGPU_TOKEN_BUCKETS": "16"}) == TokenBuckets(16)
    assert token_buckets({"LTX_MGPU_TOKEN_BUCKETS": "0"}) is None
    with pytest.raises(ValueError, match=r"\$LTX_MGPU_TOKEN_BUCKETS=24: give a power of two .* or 0"):
        token_buckets({"LTX_MGPU_TOKEN_BUCKETS": "24"})
    with pytest.raises(ValueError, match=r"\$LTX_MGPU_TOKEN_BUCKETS='many'"):
        token_buckets({"LTX_MGPU_TOKEN_BUCKETS": "many"})
