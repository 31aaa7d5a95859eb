"""Sequence parallelism (Ulysses all-to-all) on real gloo ranks equals the plain ltx-core
model (world size 1), for video-only and audio-video inputs, with token counts divisible
and not divisible by the world size, and padded to a token bucket (Ulysses, and a batch split
over one-rank groups), on both outputs; leaving the padded keys out of the video->audio
attention is shown to matter; bad configurations fail identically on every rank before any
collective.

Each multi-rank fixture launches its ranks once (separate processes, like torchrun) and
runs every case of that world size in them; the tests then compare per case. The in-process
checks of the wrappers are tests/unit/test_sequence_parallel.py.
"""

from __future__ import annotations

import pytest
from safetensors.torch import load_file
from sp_harness import AUDIO_HEADS, VIDEO_HEADS, reference, run_ranks

TOL = 1e-5


# 45 = 3x3x5 tokens (not divisible by 2 or 4); 24 = 2x3x4 (divisible by 2 and 4)
AV_ODD = dict(frames=3, height=3, width=5, audio_tokens=7)


CASES_2 = [
    dict(name="av_odd", **AV_ODD),
    dict(name="av_even", frames=2, height=3, width=4, audio_tokens=5),
    dict(name="video_odd", frames=3, height=3, width=5),
    dict(name="video_only_model_odd", frames=3, height=3, width=5, video_only=True),
    dict(name="av_odd_cfg_batch_stg_attention_mask", **AV_ODD, batch=2, perturbations="mixed", attention_mask=True),
    dict(name="av_odd_without_v2a_mask", **AV_ODD, mask_v2a=False),
    dict(name="too_many_tokens", **AV_ODD, max_tokens=44),
    # token buckets: 45 tokens run as 64 (default rule) or 48 (steps of 16), one padding for the bucket and the ranks
    dict(name="av_odd_bucket", **AV_ODD, buckets=[32, 64]),
    dict(name="av_odd_bucket_cfg_batch_stg_attention_mask", **AV_ODD, batch=2, perturbations="mixed",
         attention_mask=True, buckets=[32, 16]),
    dict(name="av_odd_bucket_one_rank_groups", **AV_ODD, batch=2, layout="auto", buckets=[32, 16]),
]


CASES_4 = [
    dict(name="av_odd", **AV_ODD),
    dict(name="av_even", frames=2, height=3, width=4, audio_tokens=5),
    dict(name="video_only_model_odd", frames=3, height=3, width=5, video_only=True),
]


CASE_BY_NAME = {c["name"]: c for c in CASES_2 + CASES_4}


NOT_PARITY = ("av_odd_without_v2a_mask", "too_many_tokens")

#: The video tokens each rank's blocks see in a bucketed case: the bucket, split over the ranks or not.
BUCKET_TOKENS = {"av_odd_bucket": 32, "av_odd_bucket_cfg_batch_stg_attention_mask": 24,
                 "av_odd_bucket_one_rank_groups": 48}


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory):
    out = tmp_path_factory.mktemp("sp2")
    return run_ranks(2, CASES_2, out), out


@pytest.fixture(scope="module")
def four_ranks(tmp_path_factory):
    out = tmp_path_factory.mktemp("sp4")
    return run_ranks(4, CASES_4, out), out


def _max_diffs(run, name):
    """Per rank: (max |SP - ref| video, max |SP - ref| audio or None)."""
    reports, out = run
    ref_v, ref_a = reference(CASE_BY_NAME[name])
    diffs = []
    for r, report in enumerate(reports):
        assert report[name]["error"] is None, report[name]["error"]
        got = load_file(str(out / f"rank{r}_{name}.safetensors"))
        assert got["video"].shape == ref_v.shape
        dv = (got["video"] - ref_v).abs().max().item()
        da = None
        if ref_a is not None:
            assert got["audio"].shape == ref_a.shape
            da = (got["audio"] - ref_a).abs().max().item()
        diffs.append((dv, da))
    return diffs


@pytest.mark.parametrize("name", [c["name"] for c in CASES_2 if c["name"] not in NOT_PARITY])
def test_two_ranks_equal_world_size_one(two_ranks, name):
    for dv, da in _max_diffs(two_ranks, name):
        assert dv <= TOL
        assert da is None or da <= TOL


@pytest.mark.parametrize("name", [c["name"] for c in CASES_4])
def test_four_ranks_equal_world_size_one(four_ranks, name):
    for dv, da in _max_diffs(four_ranks, name):
        assert dv <= TOL
        assert da is None or da <= TOL


def test_audio_diverges_without_the_video_to_audio_padding_mask(two_ranks):
    """The reference's flaw (padded video keys visible to audio queries) is real: with the
    V2A mask off, the audio output moves far beyond the tolerance; with it on, it does not."""
    masked = _max_diffs(two_ranks, "av_odd")
    unmasked = _max_diffs(two_ranks, "av_odd_without_v2a_mask")
    for (_, da_ok), (_, da_bad) in zip(masked, unmasked):
        assert da_ok <= TOL
        assert da_bad > 10 * TOL


def test_too_many_tokens_fails_on_every_rank_and_the_group_survives(two_ranks):
    reports, _ = two_ranks
    errors = {report["too_many_tokens"]["error"] for report in reports}
    assert len(errors) == 1
    (error,) = errors
    assert error.startswith("SequenceParallelConfigError")
    assert "45 tokens" in error and "max_tokens=44" in error and "Lower the resolution or the number of frames" in error
    assert all(report["_all_reduce"] == 2.0 for report in reports)


@pytest.mark.parametrize("name", sorted(BUCKET_TOKENS))
def test_a_bucketed_call_runs_at_its_bucket_on_every_rank(two_ranks, name):
    """The parity above is of padded calls: each rank's blocks saw the bucket's tokens (45 -> 64
    over 2 ranks, 45 -> 48 over 2 ranks, or 48 on each one-rank group of a split batch)."""
    reports, _ = two_ranks
    for report in reports:
        assert report[name]["block_tokens"] == [BUCKET_TOKENS[name]]
    assert reports[0]["av_odd_bucket_one_rank_groups"]["samples"] == [1, 1]


def test_heads_not_divisible_fail_identically_on_every_rank_before_any_collective(tmp_path):
    reports = run_ranks(3, [dict(name="av", frames=2, height=3, width=4, audio_tokens=5)], tmp_path)
    errors = {report["av"]["error"] for report in reports}
    assert len(errors) == 1
    (error,) = errors
    assert error.startswith("SequenceParallelConfigError")
    assert f"{VIDEO_HEADS} video attention heads" in error and f"{AUDIO_HEADS} audio attention heads" in error
    assert "3 ranks do not divide them" in error and "1, 2, 4" in error
    # no rank was left inside a collective: a later all_reduce completes on all three
    assert all(report["_all_reduce"] == 3.0 for report in reports)
