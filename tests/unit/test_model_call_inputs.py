"""The inputs of one MODEL-path transformer call (:func:`ltx_mgpu.denoise.comfyui.forward.comfy_forward`)
checked against the resident model before any work: a latent of another width, timesteps outside
LTX-2's flow-matching range, more audio (and reference-audio) tokens than the load's ``max_tokens``,
keyframe guides whose batch, coordinates, pixel masks or latent shapes do not fit the latent, and a
denoise mask that drops every token are refused naming the input; what ComfyUI's own nodes make
(guide tokens with a negative mask and so negative timesteps, which the grid mask drops) still runs.

The same refusals through a 2-rank pool, which must keep serving: ``tests/integration/test_hostile.py``.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from ltx_mgpu.denoise.comfyui.extra_conds import ExtraCondsError, extra_conds, grid_mask
from ltx_mgpu.denoise.comfyui.forward import ForwardError, check_call, comfy_forward, processed_context
from ltx_mgpu.denoise.model import load_ltx_model
from ltx_mgpu.denoise.parallel.split import SequenceParallelConfigError
from ltx_mgpu.denoise.plan import TransformerPlan


@pytest.fixture(scope="module")
def model(tiny_ltx_23):
    return load_ltx_model(TransformerPlan(tiny_ltx_23, dtype="fp32", max_tokens=50))


@pytest.fixture(scope="module")
def context(model):
    return processed_context(model, torch.randn(1, 9, 48, generator=torch.Generator().manual_seed(1)), True)


def _x(video=(1, 128, 3, 3, 5), audio=(1, 8, 7, 16)):
    g = torch.Generator().manual_seed(11)
    return [torch.randn(*video, generator=g), torch.randn(*audio, generator=g)]


T = (torch.full((1,), 0.7), torch.full((1,), 0.7))


def _guides(**entry):
    """One keyframe guide on the last latent frame (``LTXVAddGuide`` at strength 0.5, its first row
    masked out: those tokens leave the call), as ComfyUI's nodes make it."""
    hh, ww = torch.meshgrid(torch.arange(3) * 32, torch.arange(5) * 32, indexing="ij")
    start = torch.stack([torch.full((3, 5), 8), hh, ww]).reshape(3, -1)  # a one-frame guide at pixel frame 8
    kf = torch.stack([start, start + torch.tensor([1, 32, 32]).view(3, 1)], dim=-1).unsqueeze(0)
    mask = torch.ones(1, 1, 3, 3, 5)
    mask[:, :, 2] = 0.5
    mask[:, :, 2, 0] = -1.0
    return kf, mask, [{"pre_filter_count": 15, "strength": 0.5, "pixel_mask": None, "latent_shape": [1, 3, 5],
                       **entry}]


def _call(model, context, x=None, t=T, conds=None):
    x = _x() if x is None else x
    check_call(model, x, t, conds)  # what the pool runs before any work
    with torch.no_grad():
        return comfy_forward(model, model.transformer, x, t, context, conds=conds)


def test_comfyuis_own_guides_run(model, context):
    kf, mask, entries = _guides()
    timesteps = (mask.permute(0, 2, 3, 4, 1).reshape(1, -1) * 0.7, T[1])  # -0.7 at the dropped guide row
    conds = extra_conds(keyframe_idxs=kf, keep=grid_mask(mask), guide_attention_entries=entries)
    out = _call(model, context, t=timesteps, conds=conds)
    assert all(bool(torch.isfinite(o).all()) for o in out)


@pytest.mark.parametrize("x, match", [
    (_x(video=(1, 7, 3, 3, 5)), r"x\[0\] \(the video latent\) has 7 channels; this model takes 128"),
    (_x(audio=(1, 3, 7, 16)), r"x\[1\] \(the audio latent\) is \[1, 3, 7, 16\]: 3 channels x 16 mel bins = 48 "
                              r"values per token; this model takes 128"),
    (_x(audio=(1, 8, 7, 7)), r"x\[1\] \(the audio latent\) is \[1, 8, 7, 7\]: 8 channels x 7 mel bins = 56"),
], ids=["video_channels", "audio_channels", "audio_width"])
def test_a_latent_of_another_width_than_the_models_is_refused(model, context, x, match):
    with pytest.raises(ForwardError, match=match):
        _call(model, context, x=x)


@pytest.mark.parametrize("t, match", [
    ((torch.full((1,), -1.0), T[1]), r"timestep\[0\] \(video\) .*-1"),
    ((torch.full((1,), 1e30), T[1]), r"timestep\[0\] \(video\) .*1e\+30"),
    ((torch.full((1,), -1e30), T[1]), r"timestep\[0\] \(video\) .*-1e\+30"),
    ((torch.full((1,), float("nan")), T[1]), r"timestep\[0\] \(video\) .*nan"),
    ((T[0], torch.full((1,), -5.0)), r"timestep\[1\] \(audio\) .*-5"),
    ((torch.full((1, 45), 0.5).index_fill(1, torch.tensor([3]), 2.0), T[1]), r"timestep\[0\] \(video\) .*2"),
], ids=["video_minus_1", "video_1e30", "video_minus_1e30", "video_nan", "audio_minus_5", "per_token_2"])
def test_timesteps_outside_the_flow_matching_range_are_refused(model, context, t, match):
    with pytest.raises(ForwardError, match=match) as e:
        _call(model, context, t=t)
    assert "0..1" in str(e.value)


def test_a_call_may_declare_the_timestep_range_of_its_model_sampling(model, context):
    """ComfyUI's ModelSamplingContinuousEDM gives 0.25 ln(sigma): 1.197 at sigma 120, negative
    below sigma 1. The MODEL sends that range with the call; outside it is still refused."""
    edm = (-1.6, 1.2)
    t = (torch.full((1,), 1.19687), torch.full((1,), -1.5))
    check_call(model, _x(), t, None, edm)
    with torch.no_grad():
        out = comfy_forward(model, model.transformer, _x(), t, context, timestep_range=edm)
    assert all(bool(torch.isfinite(o).all()) for o in out)
    with pytest.raises(ForwardError, match=r"timestep\[0\] \(video\) holds from 1.19687.* 0\.\.1"):
        check_call(model, _x(), t, None)
    with pytest.raises(ForwardError, match=r"timestep\[1\] \(audio\) .*-5.*-1.6\.\.1.2"):
        check_call(model, _x(), (t[0], torch.full((1,), -5.0)), None, edm)


def test_audio_and_reference_audio_tokens_are_bounded_by_max_tokens(model, context):
    with pytest.raises(SequenceParallelConfigError, match=r"audio .* 51 tokens.*max_tokens=50"):
        _call(model, context, x=_x(audio=(1, 8, 51, 16)))
    ref = torch.randn(1, 44, 128)
    with pytest.raises(SequenceParallelConfigError, match=r"audio .* 51 tokens \(7 \+ 44 of the reference audio\)"):
        _call(model, context, conds=extra_conds(ref_audio={"tokens": ref}))
    _call(model, context, conds=extra_conds(ref_audio={"tokens": ref[:, :43]}))


def test_keyframe_idxs_of_another_batch_than_the_latent_are_refused(model, context):
    kf, mask, entries = _guides()
    conds = extra_conds(keyframe_idxs=kf.expand(7, -1, -1, -1), keep=grid_mask(mask), guide_attention_entries=entries)
    with pytest.raises(ExtraCondsError, match=r"keyframe_idxs .*batch 7.*latent's batch is 1"):
        _call(model, context, conds=conds)


def test_a_denoise_mask_that_drops_every_token_is_refused(model, context):
    kf, _, entries = _guides()
    with pytest.raises(ExtraCondsError, match=r"denoise_mask .*every video token"):
        extra_conds(keyframe_idxs=kf, keep=grid_mask(-torch.ones(1, 1, 3, 3, 5)), guide_attention_entries=entries)


@pytest.mark.parametrize("shift, match", [
    (torch.tensor([1e9, 0, 0]), r"time coordinates from 1000000000"),
    (torch.tensor([-1e6, 0, 0]), r"time .*-999992"),
    (torch.tensor([0, 0, -1e9]), r"width .*-1000000000"),
], ids=["time_plus_1e9", "time_minus_1e6", "width_minus_1e9"])
def test_keyframe_coordinates_outside_the_latent_are_refused(model, context, shift, match):
    kf, mask, entries = _guides()
    conds = extra_conds(keyframe_idxs=kf + shift.view(1, 3, 1, 1).to(kf.dtype), keep=grid_mask(mask),
                        guide_attention_entries=entries)
    with pytest.raises(ExtraCondsError, match=r"keyframe_idxs .*" + match) as e:
        _call(model, context, conds=conds)
    assert "0..24 pixel frames, 0..96 x 0..160 pixels" in str(e.value)


@pytest.mark.parametrize("mask, match", [
    (torch.ones(1, 3, 1, 96, 160), r"pixel_mask is \[1, 3, 1, 96, 160\]; .*\[B, 1, F, H, W\]"),
    (torch.ones(1, 1, 1, 2, 2), r"pixel_mask is \[1, 1, 1, 2, 2\]; .*at least the guide latent's 3 x 5"),
    (torch.full((1, 1, 1, 96, 160), 5.0), r"pixel_mask holds values outside 0\.\.1"),
], ids=["channels", "smaller_than_latent", "values"])
def test_a_guide_pixel_mask_that_does_not_fit_is_refused(mask, match):
    kf, keep, entries = _guides(pixel_mask=mask)
    with pytest.raises(ExtraCondsError, match=r"guide_attention_entries\[0\] .*" + match):
        extra_conds(keyframe_idxs=kf, keep=grid_mask(keep), guide_attention_entries=entries)


def test_a_guide_latent_shape_larger_than_its_tokens_is_refused():
    kf, keep, entries = _guides(latent_shape=[1, 2 ** 40, 2 ** 40])
    with pytest.raises(ExtraCondsError, match=r"guide_attention_entries\[0\] .*latent_shape \[1, 1099511627776, "
                                              r"1099511627776\] .*more than its pre_filter_count 15"):
        extra_conds(keyframe_idxs=kf, keep=grid_mask(keep), guide_attention_entries=entries)


def test_a_call_stops_between_blocks_when_asked_and_the_blocks_are_restored(model, context):
    """``LTXDenoiser.stoppable``: asked before every block (the tiny model has 2, fewer than
    ``STOP_CHECKS``), a stop after block 0 skips block 1; the blocks' own forwards are back after."""
    x = _x()
    with torch.no_grad():
        want = comfy_forward(model, model.transformer, x, T, context)
    blocks = list(model.transformer.transformer_blocks)
    own = blocks[1].forward  # an instance attribute, as compile_blocks sets one

    def counted(*args, **kwargs):
        ran.append(1)
        return type(blocks[1]).forward(blocks[1], *args, **kwargs)

    blocks[1].forward = counted
    asked, ran = [], []
    try:
        with torch.no_grad(), model.stoppable(lambda: asked.append(1) or len(asked) == 2) as stopped:
            cut = comfy_forward(model, model.transformer, x, T, context)
        assert stopped() and len(asked) == 2 and ran == []
        assert blocks[1].forward is counted and "forward" not in blocks[0].__dict__
        assert max((a - b).abs().max() for a, b in zip(cut, want)) > 1e-3
        with torch.no_grad(), model.stoppable(lambda: False) as stopped:
            again = comfy_forward(model, model.transformer, x, T, context)
        assert not stopped() and ran == [1]
        assert all(torch.equal(a, b) for a, b in zip(again, want))
    finally:
        blocks[1].__dict__.pop("forward", None)
    assert blocks[1].forward.__func__ is type(blocks[1]).forward and own.__func__ is type(blocks[1]).forward


@pytest.mark.parametrize("conds", ["none", "guides", "ref_audio"])
def test_one_timestep_per_sample_runs_the_adaln_once_per_sample_with_the_per_token_result(model, context, conds):
    """ComfyUI's ``[B]`` timesteps reach ltx-core as ``[B, 1]`` (its AdaLN once per sample, as
    ComfyUI's model computes it), with the result of the same sigma given per token (``[B, T]``):
    also with keyframe guides (which keep a subset of the tokens) and reference audio (whose
    tokens are prepended at timestep 0)."""
    kf, mask, entries = _guides(strength=1.0)
    ref = torch.randn(1, 5, 128, generator=torch.Generator().manual_seed(3))
    c = {"none": None,
         "guides": extra_conds(keyframe_idxs=kf, keep=grid_mask(torch.ones_like(mask)),
                               guide_attention_entries=entries),
         "ref_audio": extra_conds(ref_audio={"tokens": ref})}[conds]
    seen = []
    velocity = _own(model, seen)
    with torch.no_grad():
        per_sample = comfy_forward(model, velocity, _x(), T, context, conds=c)
        per_token = comfy_forward(model, velocity, _x(), (torch.full((1, 45), 0.7), torch.full((1, 7), 0.7)), context,
                                  conds=c)
    audio = (1, 12) if conds == "ref_audio" else (1, 1)
    assert seen[0] == ((1, 1), audio)
    assert seen[1] == ((1, 45), (1, 12) if conds == "ref_audio" else (1, 7))
    for a, b in zip(per_sample, per_token):
        assert float((a - b).abs().max() / b.abs().max()) < 1e-6


def _per_token(model, seen):
    """A velocity that records the timestep shapes it gets and expands ``[B, 1]`` timesteps to
    ``[B, T]`` (the same values per token) before ltx-core: the per-token result to compare with."""
    def velocity(video, audio, perturbations):
        def expand(m):
            if m is None:
                return None
            t = m.timesteps.expand(m.latent.shape[0], m.latent.shape[1]).contiguous()
            return dataclasses.replace(m, timesteps=t)
        seen.append(tuple(tuple(m.timesteps.shape) if m is not None else None for m in (video, audio)))
        return model.transformer(expand(video), expand(audio), perturbations)
    return velocity


def _own(model, seen):
    def velocity(video, audio, perturbations):
        seen.append(tuple(tuple(m.timesteps.shape) if m is not None else None for m in (video, audio)))
        return model.transformer(video, audio, perturbations)
    return velocity


@pytest.mark.parametrize("case", ["guides_drop_tokens", "batch2_context1", "video_only", "per_token_b_t_1", "scalar",
                                  "batch2_one_value", "text_mask", "one_video_token"])
def test_one_timestep_per_sample_equals_the_same_sigma_per_token(model, context, case):
    """Every way a ``[B]`` (or scalar) timestep reaches ltx-core as ``[B, 1]`` gives the result of
    the same sigmas per token: keyframe guides whose grid mask drops tokens, a batch of 2 with a
    context of batch 1 and a different sigma per sample, a video-only latent, a single video
    token, a text mask; a ``[B, T, 1]`` timestep stays per token."""
    x, conds, batch = _x(), None, 1
    t = (torch.full((1,), 0.7), torch.full((1,), 0.4))
    if case == "guides_drop_tokens":
        kf, mask, entries = _guides()
        conds = extra_conds(keyframe_idxs=kf, keep=grid_mask(mask), guide_attention_entries=entries)
    elif case in ("batch2_context1", "batch2_one_value"):
        batch = 2
        x = _x(video=(2, 128, 3, 3, 5), audio=(2, 8, 7, 16))
        if case == "batch2_context1":
            t = (torch.tensor([0.3, 0.7]), torch.tensor([0.9, 0.2]))
    elif case == "video_only":
        x = _x()[0]
        t = torch.full((1,), 0.7)
    elif case == "per_token_b_t_1":
        t = (torch.full((1, 45, 1), 0.7), torch.full((1, 7, 1), 0.4))
    elif case == "scalar":
        t = torch.tensor(0.6)
    elif case == "text_mask":
        tm = torch.ones(1, context.shape[1])
        tm[:, -3:] = 0
        conds = extra_conds(attention_mask=tm)
    elif case == "one_video_token":
        x = _x(video=(1, 128, 1, 1, 1))
    seen_own, seen_tok = [], []
    check_call(model, x, t, conds)
    with torch.no_grad():
        own = comfy_forward(model, _own(model, seen_own), x, t, context, conds=conds)
        tok = comfy_forward(model, _per_token(model, seen_tok), x, t, context, conds=conds)
    own, tok = (own, tok) if isinstance(own, list) else ([own], [tok])
    if case == "per_token_b_t_1":
        assert seen_own[0] == ((1, 45), (1, 7))
    else:
        assert seen_own[0][0] == (batch, 1)
    for a, b in zip(own, tok, strict=True):
        assert a.shape == b.shape and bool(torch.isfinite(a).all())
        assert float((a - b).abs().max() / b.abs().max()) < 1e-6
