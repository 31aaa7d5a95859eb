"""One timestep per sample (``[B, 1]``, what ComfyUI's ``[B]`` timesteps reach ltx-core as) through
sequence parallelism on real gloo ranks equals the same sigmas given per token (``[B, T]``) on the
plain ltx-core model (world size 1): Ulysses with padding, a single video token (``T == 1``, one
real token and padding), a video-only model, a CFG batch with skip-layer perturbations and a
self-attention mask, ``cfg_ulysses`` with an uneven batch of 3, ``auto`` over one-rank groups and
token buckets. ``shard_video`` leaves a ``[B, 1]`` timestep unsliced and ``_batch_slice`` cuts it
per sample (:mod:`ltx_mgpu.denoise.parallel.ulysses`).
"""

from __future__ import annotations

import pytest
from safetensors.torch import load_file
from sp_harness import reference, run_ranks

TOL = 1e-5

AV_ODD = dict(frames=3, height=3, width=5, audio_tokens=7, timesteps="per_sample")

CASES_2 = [
    dict(name="av_odd", **AV_ODD),
    dict(name="one_video_token", frames=1, height=1, width=1, audio_tokens=3, timesteps="per_sample"),
    dict(name="video_only_model", frames=3, height=3, width=5, video_only=True, timesteps="per_sample"),
    dict(name="cfg_batch_stg_attention_mask", **AV_ODD, batch=2, perturbations="mixed", attention_mask=True),
    dict(name="cfg_ulysses_batch3", **AV_ODD, batch=3, perturbations="mixed", layout="cfg_ulysses"),
    dict(name="auto_one_rank_groups_bucket", **AV_ODD, batch=2, layout="auto", buckets=[32, 16]),
    dict(name="bucket_batch2", **AV_ODD, batch=2, buckets=[32, 64]),
]


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory):
    out = tmp_path_factory.mktemp("per_sample2")
    return run_ranks(2, CASES_2, out), out


@pytest.mark.parametrize("case", CASES_2, ids=[c["name"] for c in CASES_2])
def test_two_ranks_with_one_timestep_per_sample_equal_the_per_token_sigmas(two_ranks, case):
    reports, out = two_ranks
    ref_v, ref_a = reference({**case, "timesteps": "uniform"})
    for r, report in enumerate(reports):
        assert report[case["name"]]["error"] is None, report[case["name"]]["error"]
        got = load_file(str(out / f"rank{r}_{case['name']}.safetensors"))
        assert got["video"].shape == ref_v.shape
        assert (got["video"] - ref_v).abs().max().item() <= TOL
        if ref_a is not None:
            assert got["audio"].shape == ref_a.shape
            assert (got["audio"] - ref_a).abs().max().item() <= TOL
