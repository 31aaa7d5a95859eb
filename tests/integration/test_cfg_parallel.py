"""The batch of a model call over groups of ranks x Ulysses (``SequenceParallelTransformer(layout=...)``,
``ltx_mgpu.denoise.parallel.layout``) on real gloo ranks: each group of ranks runs its samples
(and their perturbation configs), Ulysses-parallel over its ranks, and every rank gets every
output. At 2, 3 and 4 ranks each case equals world size 1 (video-only and audio-video, 45 video
tokens: not divisible by the ranks; with a self-attention mask; with sharded weights; with
perturbations that skip different attentions in different samples), and takes the layout the
rules give: ``auto`` splits a batch of B on W ranks into gcd(B, W) groups (cond + uncond on two
halves, three passes on three ranks, four on four ranks one each, six on four ranks in two
halves), runs Ulysses for a batch of one or an odd batch on an even pool; ``cfg_ulysses`` splits
any batch over two halves, unevenly for three passes. Through a pool, the MODEL path's batched
cond + uncond call and the SP Sampler at cfg 3 equal the in-process ones (test_model_path*).
"""

from __future__ import annotations

import pytest
from safetensors.torch import load_file
from sp_harness import reference, run_ranks

REL = 1e-5
AV_ODD = dict(frames=3, height=3, width=5, audio_tokens=7)
#: name -> (case, {world: samples per group})
CASES = {
    "cfg_av_odd": (dict(**AV_ODD, batch=2, layout="cfg_ulysses"), {2: [1, 1], 4: [1, 1]}),
    "auto_video_odd": (dict(frames=3, height=3, width=5, batch=2, layout="auto", video_only=True),
                       {2: [1, 1], 4: [1, 1]}),
    "auto_av_mask": (dict(**AV_ODD, batch=2, attention_mask=True, layout="auto"), {2: [1, 1], 4: [1, 1]}),
    "auto_av_batch4": (dict(**AV_ODD, batch=4, layout="auto"), {2: [2, 2], 4: [1, 1, 1, 1]}),
    "auto_batch1_is_ulysses": (dict(**AV_ODD, batch=1, layout="auto"), {2: [1], 4: [1]}),
    "auto_perturbed": (dict(**AV_ODD, batch=2, perturbations="mixed", layout="auto"), {2: [1, 1], 4: [1, 1]}),
    # CFG + a perturbed pass (or DualCFGGuider): three passes; an even pool runs them Ulysses under auto
    "auto_batch3_is_ulysses": (dict(**AV_ODD, batch=3, perturbations="mixed", layout="auto"), {2: [3], 4: [3]}),
    "auto_batch6": (dict(**AV_ODD, batch=6, layout="auto"), {2: [3, 3], 4: [3, 3]}),
    "cfg_batch3_uneven": (dict(**AV_ODD, batch=3, perturbations="mixed", layout="cfg_ulysses"),
                          {2: [2, 1], 4: [2, 1]}),
    "cfg_sharded": (dict(**AV_ODD, batch=2, layout="cfg_ulysses", sharded=True, model={"num_layers": 4}),
                    {2: [1, 1], 4: [1, 1]}),
    "cfg_batch3_sharded": (dict(**AV_ODD, batch=3, layout="cfg_ulysses", sharded=True, model={"num_layers": 4}),
                           {2: [2, 1], 4: [2, 1]}),
}
#: A tiny model with 6 video and 6 audio heads, so that 3 ranks divide them.
SIX_HEADS = {"num_attention_heads": 6, "cross_attention_dim": 48, "audio_num_attention_heads": 6,
             "audio_cross_attention_dim": 24}
SIX = dict(**AV_ODD, model=SIX_HEADS, context_widths=[48, 24])
CASES_3 = {
    "auto_batch3": (dict(**SIX, batch=3, layout="auto"), [1, 1, 1]),
    "auto_batch3_perturbed": (dict(**SIX, batch=3, perturbations="mixed", layout="auto"), [1, 1, 1]),
    "auto_batch6": (dict(**SIX, batch=6, layout="auto"), [2, 2, 2]),
    "auto_batch2_is_ulysses": (dict(**SIX, batch=2, layout="auto"), [2]),
    "auto_batch1_is_ulysses": (dict(**SIX, batch=1, layout="auto"), [1]),
    "cfg_odd_pool_is_auto": (dict(**SIX, batch=3, layout="cfg_ulysses"), [1, 1, 1]),
    "auto_batch3_sharded": (dict(**SIX, batch=3, layout="auto", sharded=True), [1, 1, 1]),
}


def _rel(a, b) -> float:
    return float((a - b).norm() / b.norm())


def _check(reports, cases, tmp_path):
    for case, want in cases:
        ref_v, ref_a = reference(case)
        for r, report in enumerate(reports):
            entry = report[case["name"]]
            assert entry["error"] is None, (case["name"], entry["error"])
            assert entry["samples"] == want, (case["name"], entry["samples"])
            got = load_file(str(tmp_path / f"rank{r}_{case['name']}.safetensors"))
            assert _rel(got["video"], ref_v) <= REL, (case["name"], r, _rel(got["video"], ref_v))
            if ref_a is not None:
                assert _rel(got["audio"], ref_a) <= REL, (case["name"], r, _rel(got["audio"], ref_a))


@pytest.mark.parametrize("world", [2, 4])
def test_the_batch_over_groups_equals_world_size_one(tmp_path, world):
    cases = [(dict(name=name, **case), samples[world]) for name, (case, samples) in CASES.items()]
    _check(run_ranks(world, [c for c, _ in cases], tmp_path, timeout=300), cases, tmp_path)


def test_three_passes_on_three_ranks_run_one_per_rank_and_equal_world_size_one(tmp_path):
    cases = [(dict(name=name, **case), samples) for name, (case, samples) in CASES_3.items()]
    _check(run_ranks(3, [c for c, _ in cases], tmp_path, timeout=300), cases, tmp_path)
