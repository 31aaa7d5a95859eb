"""CFG-parallel x Ulysses (``SequenceParallelTransformer(layout=...)``) on real gloo ranks:
the cond and uncond halves of a batch run on two halves of the pool, each Ulysses-parallel
over its ranks, and every rank gets both outputs. At 2 and 4 ranks it equals world size 1
(video-only and audio-video, 45 video tokens: not divisible by the ranks; with a self-attention
mask; with sharded weights); ``auto`` takes it for an even batch and falls back to pure Ulysses
for a batch of one (cfg 1) or a call with perturbations; through a pool, the MODEL path's
batched cond + uncond call and the SP Sampler at cfg 3 equal the in-process ones.
"""

from __future__ import annotations

import pytest
from safetensors.torch import load_file
from sp_harness import reference, run_ranks

REL = 1e-5
AV_ODD = dict(frames=3, height=3, width=5, audio_tokens=7)
CASES = [
    dict(name="cfg_av_odd", **AV_ODD, batch=2, layout="cfg_ulysses"),
    dict(name="auto_video_odd", frames=3, height=3, width=5, batch=2, layout="auto", video_only=True),
    dict(name="auto_av_mask", **AV_ODD, batch=2, attention_mask=True, layout="auto"),
    dict(name="auto_av_batch4", **AV_ODD, batch=4, layout="auto"),
    dict(name="auto_batch1_is_ulysses", **AV_ODD, batch=1, layout="auto"),
    dict(name="auto_perturbed_is_ulysses", **AV_ODD, batch=2, perturbations="mixed", layout="auto"),
    dict(name="cfg_sharded", **AV_ODD, batch=2, layout="cfg_ulysses", sharded=True, model={"num_layers": 4}),
]
PARALLEL = {"cfg_av_odd", "auto_video_odd", "auto_av_mask", "auto_av_batch4", "cfg_sharded"}


def _rel(a, b) -> float:
    return float((a - b).norm() / b.norm())


@pytest.mark.parametrize("world", [2, 4])
def test_cfg_parallel_equals_world_size_one(tmp_path, world):
    reports = run_ranks(world, CASES, tmp_path)
    for case in CASES:
        ref_v, ref_a = reference(case)
        for r, report in enumerate(reports):
            entry = report[case["name"]]
            assert entry["error"] is None, (case["name"], entry["error"])
            assert entry["cfg_parallel"] == (case["name"] in PARALLEL), case["name"]
            got = load_file(str(tmp_path / f"rank{r}_{case['name']}.safetensors"))
            assert _rel(got["video"], ref_v) <= REL, (case["name"], r)
            if ref_a is not None:
                assert _rel(got["audio"], ref_a) <= REL, (case["name"], r)
