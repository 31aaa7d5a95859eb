"""The LTX-2 sampler against an independent loop written straight from ComfyUI's formulas
(prepare_noise, pack_latents, CONST noise_scaling, sample_euler, KSamplerX0Inpaint,
sampling_function / cfg_function with one forward per prompt, LTXAV.process_timestep); seeds,
cfg 1 / > 1, noise masks, the LTX-2 scheduler, progress and cancel, CONDITIONING forms. On 2
gloo ranks: ``tests/integration/test_sampler_ranks.py``.
"""

from __future__ import annotations

import math

import pytest
import torch
from ltx_core.components.patchifiers import AudioPatchifier, VideoLatentPatchifier
from ltx_core.model.transformer import Modality
from ltx_core.tools import AudioLatentTools, VideoLatentTools
from ltx_core.types import AudioLatentShape, VideoLatentShape
from sampler_support import SIGMAS, av_latent, cond, latent_parts

from ltx_mgpu.denoise.comfyui.conditioning import ConditioningError, text_contexts
from ltx_mgpu.denoise.comfyui.extra_conds import ExtraCondsError
from ltx_mgpu.denoise.comfyui.sampler import SamplingCancelled, comfy_noise, ltx2_sigmas, sample
from ltx_mgpu.denoise.model import load_ltx_model
from ltx_mgpu.denoise.plan import TransformerPlan
from ltx_mgpu.nested import NestedTensorLike

F32 = torch.float32


# --------------------------------------------------------------------------- inputs


# --------------------------------------------------------------------------- ComfyUI reference


def _comfy_reference(model, positive, negative, latent, sigmas, cfg, seed, fps=25.0):
    """ComfyUI's SamplerCustomAdvanced + CFGGuider + euler for an LTXAV latent, written from its
    formulas on the packed ``[B, 1, N]`` latent, with each prompt in its own forward."""
    samples = latent["samples"]
    tensors = list(samples.tensors) if hasattr(samples, "tensors") else [samples]
    with torch.random.fork_rng():
        g = torch.manual_seed(seed)  # comfy.sample.prepare_noise
        noises = [torch.randn(t.size(), dtype=torch.float32, generator=g, device="cpu").to(t.dtype) for t in tensors]
    shapes = [t.shape for t in tensors]

    def pack(ts):  # comfy.utils.pack_latents
        return torch.cat([t.reshape(t.shape[0], 1, -1) for t in ts], dim=-1)

    def unpack(flat):
        out, at = [], 0
        for s in shapes:
            n = math.prod(s[1:])
            out.append(flat[:, :, at : at + n].reshape(s))
            at += n
        return out

    lat, noise = pack(tensors).float(), pack(noises).float()
    mask = None
    if latent.get("noise_mask") is not None:
        masks = latent["noise_mask"].tensors if hasattr(latent["noise_mask"], "tensors") else [latent["noise_mask"]]
        mask = pack([m.expand(s) for m, s in zip(masks, shapes, strict=True)]).float()
    video = tensors[0] if len(tensors) == 2 or latent.get("type") != "audio" else None
    vpos = apos = None
    if video is not None:
        vpos = VideoLatentTools(VideoLatentPatchifier(1), VideoLatentShape(*shapes[0]),
                                fps=fps).create_initial_state("cpu", F32).positions
    if len(tensors) == 2 or video is None:
        apos = AudioLatentTools(AudioPatchifier(1),
                                AudioLatentShape(*shapes[-1])).create_initial_state("cpu", F32).positions
    contexts = {name: text_contexts(model, c[0][0], True) for name, c in (("pos", positive), ("neg", negative)) if c}

    def denoise(x, sigma, ctx):  # BaseModel.apply_model for CONST: x - sigma * model(x, sigma)
        parts = unpack(x)
        tmask = unpack(mask) if mask is not None else [torch.ones_like(p) for p in parts]
        mods = []
        if vpos is not None:
            v = parts[0]
            ts = tmask[0][:, :1].flatten(2)[:, 0] * sigma  # LTXAV.process_timestep, video
            mods.append(Modality(v.flatten(2).transpose(1, 2), ts.amax().expand(1), ts, vpos, ctx[0]))
        else:
            mods.append(None)
        if apos is not None:
            a = parts[-1]
            ts = tmask[-1][:, :1, :, :1].flatten(1) * sigma  # LTXAV.process_timestep, audio
            mods.append(Modality(a.permute(0, 2, 1, 3).reshape(a.shape[0], a.shape[2], -1), ts.amax().expand(1), ts,
                                 apos, ctx[1]))
        else:
            mods.append(None)
        vx, ax = model.transformer(mods[0], mods[1], None)
        outs = []
        if vx is not None:
            outs.append(vx.transpose(1, 2).reshape(shapes[0]))
        if ax is not None:
            s = shapes[-1]
            outs.append(ax.reshape(s[0], s[2], s[1], s[3]).permute(0, 2, 1, 3))
        return x - pack(outs).float() * sigma

    x = sigmas[0] * noise + (1.0 - sigmas[0]) * lat  # CONST.noise_scaling
    with torch.no_grad():
        for i in range(len(sigmas) - 1):  # k_diffusion sample_euler
            sigma = sigmas[i]
            xin = x * mask + lat * (1.0 - mask) if mask is not None else x  # KSamplerX0Inpaint (LTXAV)
            cond = denoise(xin, sigma, contexts["pos"])
            uncond = denoise(xin, sigma, contexts["neg"]) if not math.isclose(cfg, 1.0) else torch.zeros_like(cond)
            den = uncond + (cond - uncond) * cfg  # cfg_function
            if mask is not None:
                den = den * mask + lat * (1.0 - mask)
            d = (x - den) / sigma
            x = x + d * (sigmas[i + 1] - sigma)
    return unpack(x / (1.0 - sigmas[-1]))  # CONST.inverse_noise_scaling


@pytest.fixture(scope="module")
def model23(tiny_ltx_23):
    return load_ltx_model(TransformerPlan(tiny_ltx_23, dtype="fp32"))


@pytest.fixture(scope="module")
def model20(tiny_ltx_20):
    return load_ltx_model(TransformerPlan(tiny_ltx_20, dtype="fp32"))


# --------------------------------------------------------------------------- parity with ComfyUI


@pytest.mark.parametrize("cfg", [1.0, 3.0])
@pytest.mark.parametrize("masked", [False, True])
def test_three_steps_equal_the_comfyui_reference(model23, cfg, masked):
    pos, neg = cond(48, 9, 1), cond(48, 5, 2)
    latent = av_latent(masked=masked)
    got = sample(model23, pos, neg if cfg != 1 else None, latent, sigmas=SIGMAS, cfg=cfg, seed=42)
    ref = _comfy_reference(model23, pos, neg, latent, SIGMAS, cfg, seed=42)
    for g, r in zip(latent_parts(got), ref, strict=True):
        torch.testing.assert_close(g, r, rtol=0, atol=2e-5)
    assert got["samples"].__class__ is NestedTensorLike and got["type"] == "audio"
    if masked:  # kept tokens come back as the input latent (up to the Euler steps' rounding, as in ComfyUI)
        assert got["noise_mask"] is latent["noise_mask"]
        torch.testing.assert_close(latent_parts(got)[0][:, :, 0], latent_parts(latent)[0][:, :, 0], rtol=0, atol=1e-6)
        assert not torch.allclose(latent_parts(got)[0][:, :, 1:], latent_parts(latent)[0][:, :, 1:], atol=1e-2)


@pytest.mark.parametrize("video_mask, audio_mask", [(0.6, None), (None, 0.3), (1.0, 1.0)])
def test_a_uniform_noise_mask_equals_the_comfyui_reference(model23, video_mask, audio_mask):
    """A LATENT noise mask of one value per modality (the SP Sampler then passes ltx-core one
    timestep per sample, ``[B, 1]``) beside a per-token one of the other modality (frame 0 / the
    first audio frames kept): ComfyUI's per-token timesteps give the same samples."""
    latent = av_latent()
    vm, am = torch.ones(1, 1, 3, 1, 1), torch.ones(1, 1, 7, 1)
    vm[:, :, 0], am[:, :, :2] = 0.0, 0.25
    if video_mask is not None:
        vm = torch.full_like(vm, video_mask)
    if audio_mask is not None:
        am = torch.full_like(am, audio_mask)
    latent["noise_mask"] = NestedTensorLike([vm, am])
    pos, neg = cond(48, 9, 1), cond(48, 5, 2)
    got = sample(model23, pos, neg, latent, sigmas=SIGMAS, cfg=3.0, seed=42)
    ref = _comfy_reference(model23, pos, neg, latent, SIGMAS, 3.0, seed=42)
    for g, r in zip(latent_parts(got), ref, strict=True):
        torch.testing.assert_close(g, r, rtol=0, atol=2e-5)


def test_video_only_latent_with_the_20_model_equals_reference(model20):
    pos, neg = cond(64, 6, 3), cond(64, 4, 4)
    latent = {"samples": torch.randn(1, 128, 2, 3, 4, generator=torch.Generator().manual_seed(5))}
    got = sample(model20, pos, neg, latent, sigmas=SIGMAS, cfg=2.5, seed=7)
    torch.testing.assert_close(got["samples"], _comfy_reference(model20, pos, neg, latent, SIGMAS, 2.5, 7)[0],
                               rtol=0, atol=2e-5)


def test_seed_determines_the_noise(model23):
    pos = cond(48, 9, 1)
    run = lambda seed: latent_parts(sample(model23, pos, None, av_latent(), sigmas=SIGMAS, seed=seed))  # noqa: E731
    a, b, c = run(1), run(1), run(2)
    assert all(torch.equal(x, y) for x, y in zip(a, b, strict=True))
    assert all(not torch.allclose(x, y) for x, y in zip(a, c, strict=True))


def test_comfy_noise_matches_prepare_noise_including_batch_index():
    lat = {"samples": NestedTensorLike([torch.zeros(3, 128, 2, 2, 2), torch.zeros(3, 8, 4, 16)]),
           "batch_index": [2, 0, 2]}
    with torch.random.fork_rng():
        g = torch.manual_seed(123)
        draws = [[torch.randn([1, *t.shape[1:]], generator=g) for _ in range(3)] for t in lat["samples"].tensors]
    got = comfy_noise(lat, 123)
    for noise, d in zip(got, draws, strict=True):
        assert torch.equal(noise, torch.cat([d[2], d[0], d[2]]))


def test_ltx2_scheduler_matches_ltxvscheduler():
    assert torch.allclose(ltx2_sigmas(3), torch.tensor([1.0, 0.7342, 0.1, 0.0]), atol=1e-4)
    latent = {"samples": NestedTensorLike([torch.zeros(1, 128, 4, 8, 16), torch.zeros(1, 8, 9, 16)])}
    tokens, steps = 4 * 8 * 16, 4
    shift = tokens * (2.05 - 0.95) / 3072 + (0.95 - (2.05 - 0.95) / 3072 * 1024)
    t = torch.linspace(1.0, 0.0, steps + 1)
    s = torch.where(t != 0, math.exp(shift) / (math.exp(shift) + (1 / t - 1)), 0)
    one_minus = 1.0 - s[:-1]
    s[:-1] = 1.0 - one_minus / (one_minus[-1] / 0.9)
    torch.testing.assert_close(ltx2_sigmas(steps, latent), s)


def test_progress_every_step_and_cancel_at_a_step_boundary(model23):
    seen, calls = [], []
    sample(model23, cond(48, 9, 1), None, av_latent(), steps=3, on_step=lambda s, t: seen.append((s, t)))
    assert seen == [(1, 3), (2, 3), (3, 3)]

    def stop():
        calls.append(1)
        return len(calls) == 3

    with pytest.raises(SamplingCancelled) as e:
        sample(model23, cond(48, 9, 1), None, av_latent(), sigmas=SIGMAS, should_stop=stop)
    assert (e.value.step, e.value.total) == (2, 3)


# --------------------------------------------------------------------------- conditioning


def test_processed_20_form_is_passed_through(model20):
    processed = torch.randn(1, 1024, 128, generator=torch.Generator().manual_seed(9))  # 2 x caption_channels
    v, a = text_contexts(model20, processed, False)
    assert torch.equal(v, processed[..., :64]) and torch.equal(a, processed[..., 64:])
    latent = {"samples": torch.randn(1, 128, 2, 3, 4, generator=torch.Generator().manual_seed(5))}
    out = sample(model20, [[processed, {"pooled_output": None}]], None, latent, sigmas=SIGMAS)
    assert out["samples"].shape == latent["samples"].shape and torch.isfinite(out["samples"]).all()


@pytest.mark.parametrize("key", ["generated_keyframes", "my_custom_key"])
def test_unsupported_conditioning_key_is_rejected_by_name(model23, key):
    pos = cond(48, 9, 1, **{key: torch.zeros(1)})
    with pytest.raises(ConditioningError, match=f"'{key}'"):
        sample(model23, pos, None, av_latent(), sigmas=SIGMAS)


@pytest.mark.parametrize("key", ["keyframe_idxs", "ref_audio"])
def test_guides_and_reference_audio_of_the_wrong_layout_are_refused_naming_them(model23, key):
    pos = cond(48, 9, 1, **{key: torch.zeros(1)})
    with pytest.raises(ExtraCondsError, match=key):
        sample(model23, pos, None, av_latent(), sigmas=SIGMAS)


def test_attention_mask_only_if_all_ones(model23):
    ok = cond(48, 9, 1, attention_mask=torch.ones(1, 9))
    ref = latent_parts(sample(model23, cond(48, 9, 1), None, av_latent(), sigmas=SIGMAS))
    assert all(torch.equal(x, y)
               for x, y in zip(latent_parts(sample(model23, ok, None, av_latent(), sigmas=SIGMAS)), ref, strict=True))
    bad = torch.ones(1, 9)
    bad[0, 0] = 0
    with pytest.raises(ConditioningError, match="attention_mask"):
        sample(model23, cond(48, 9, 1, attention_mask=bad), None, av_latent(), sigmas=SIGMAS)


def test_frame_rate_comes_from_the_conditioning(model23):
    def run(fps, neg_fps=None):
        pos = cond(48, 9, 1, frame_rate=fps)
        neg = cond(48, 5, 2, frame_rate=neg_fps if neg_fps is not None else fps)
        return latent_parts(sample(model23, pos, neg, av_latent(), sigmas=SIGMAS, cfg=2.0, seed=3))

    at24 = run(24.0)
    ref = _comfy_reference(model23, cond(48, 9, 1), cond(48, 5, 2), av_latent(), SIGMAS, 2.0, 3, fps=24.0)
    torch.testing.assert_close(at24[0], ref[0], rtol=0, atol=2e-5)
    assert not torch.allclose(at24[0], run(25.0)[0])
    with pytest.raises(ConditioningError, match="frame_rate"):
        run(24.0, neg_fps=30.0)


def test_cfg_needs_a_negative_and_only_euler_is_offered(model23):
    with pytest.raises(ConditioningError, match="negative"):
        sample(model23, cond(48, 9, 1), None, av_latent(), sigmas=SIGMAS, cfg=4.0)
    with pytest.raises(ValueError, match="euler"):
        sample(model23, cond(48, 9, 1), None, av_latent(), sigmas=SIGMAS, sampler="dpmpp_2m")
    with pytest.raises(ValueError, match="either sigmas"):
        sample(model23, cond(48, 9, 1), None, av_latent(), sigmas=SIGMAS, steps=3)


# --------------------------------------------------------------------------- sequence parallelism


def test_sampler_applies_guides_and_reference_audio_as_the_model_call_does(model23):
    """One euler step at cfg 1 with keyframe guides (one strength 0.5, one dropped row) and
    reference audio: ``x1 = x0 + (x0 - denoised) / sigma * dt`` with the velocity of
    :func:`comfy_forward` given the same conditions (the MODEL path's call, which equals ComfyUI's
    own model: tests/comfyui/test_comfyui_model.py)."""
    from ltx_mgpu.denoise.comfyui.extra_conds import extra_conds, grid_mask
    from ltx_mgpu.denoise.comfyui.forward import comfy_forward, processed_context
    from ltx_mgpu.denoise.comfyui.sampler import comfy_noise

    g = torch.Generator().manual_seed(7)
    v, a = torch.randn(1, 128, 3, 3, 5, generator=g), torch.randn(1, 8, 7, 16, generator=g)
    vm = torch.ones(1, 1, 3, 3, 5)
    vm[:, :, 2] = 0.5
    vm[:, :, 2, 0] = -1.0  # LTXVAddGuide with a guide mask: these guide tokens leave the call
    hh, ww = torch.meshgrid(torch.arange(3) * 32.0, torch.arange(5) * 32.0, indexing="ij")
    start = torch.stack([torch.zeros(3, 5), hh, ww]).reshape(3, -1)
    kf = torch.stack([start, start + torch.tensor([1.0, 32.0, 32.0]).view(3, 1)], dim=-1).unsqueeze(0)
    entries = [{"pre_filter_count": 15, "strength": 0.5, "pixel_mask": None, "latent_shape": [1, 3, 5]}]
    ref = {"tokens": torch.randn(1, 3, 128, generator=g)}
    latent = {"samples": NestedTensorLike([v, a]), "noise_mask": NestedTensorLike([vm, torch.ones(1, 1, 7, 1)])}
    pos = cond(48, 9, 1, keyframe_idxs=kf, guide_attention_entries=entries, ref_audio=ref)
    sigmas = torch.tensor([0.8, 0.5])
    out = latent_parts(sample(model23, pos, None, latent, sigmas=sigmas, seed=3))
    noise = comfy_noise(latent, 3)
    x0 = [0.8 * n + 0.2 * lat for n, lat in zip(noise, (v, a))]
    m = [vm.expand_as(v), torch.ones_like(a)]
    x_in = [x * mm + lat * (1 - mm) for x, mm, lat in zip(x0, m, (v, a))]
    t_v = (vm * 0.8).permute(0, 2, 3, 4, 1).reshape(1, -1)
    conds = extra_conds(keyframe_idxs=kf, keep=grid_mask(vm), guide_attention_entries=entries, ref_audio=ref)
    ctx = processed_context(model23, pos[0][0], True)
    with torch.no_grad():
        vel = comfy_forward(model23, model23.transformer, x_in, (t_v, torch.full((1,), 0.8)), ctx, conds=conds)
    for got, x, xi, vv, mm, lat in zip(out, x0, x_in, vel, m, (v, a)):
        denoised = (xi - 0.8 * vv) * mm + lat * (1 - mm)
        want = (x + (x - denoised) / 0.8 * (0.5 - 0.8)) / (1 - 0.5)  # CONST's inverse noise scaling
        assert (got - want).abs().max() <= 1e-5
    plain = latent_parts(sample(model23, cond(48, 9, 1), None, latent, sigmas=sigmas, seed=3))
    assert max((p - q).abs().max() for p, q in zip(plain, out)) > 1e-3
