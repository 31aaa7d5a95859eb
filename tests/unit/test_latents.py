"""ComfyUI LTX-2 LATENT <-> ltx-core tokens: exact round trips, shapes, positions that equal
ltx-core's own latent tools, ComfyUI's noise_mask semantics, and clear errors."""

from __future__ import annotations

import pytest
import torch
from ltx_core.components.patchifiers import AudioPatchifier, VideoLatentPatchifier
from ltx_core.tools import AudioLatentTools, VideoLatentTools
from ltx_core.types import AudioLatentShape, VideoLatentShape

from ltx_mgpu.denoise.comfyui.latents import (
    DEFAULT_FRAME_RATE,
    LatentFormatError,
    frame_rate_from_conditioning,
    latent_to_tokens,
    tokens_to_latent,
)
from ltx_mgpu.nested import NestedTensorLike


def _video(b=2, f=3, h=4, w=5, seed=0, dtype=torch.float32):
    return torch.randn(b, 128, f, h, w, generator=torch.Generator().manual_seed(seed)).to(dtype)


def _audio(b=2, n=11, seed=1):
    return torch.randn(b, 8, n, 16, generator=torch.Generator().manual_seed(seed))


class ForeignNested:
    """Another NestedTensor implementation (as ComfyUI's is, to us): duck-typed."""

    is_nested = True

    def __init__(self, tensors):
        self.tensors = list(tensors)

    def unbind(self):
        return self.tensors


def test_video_round_trip_is_exact_with_token_and_position_shapes():
    v = _video()
    latent = {"samples": v, "batch_index": [0, 1]}
    st = latent_to_tokens(latent, frame_rate=24)
    assert st.audio is None and st.nested_type is None
    assert st.video.tokens.shape == (2, 3 * 4 * 5, 128)
    assert st.video.positions.shape == (2, 3, 60, 2) and st.video.positions.dtype == torch.float32
    assert torch.equal(st.video.denoise_mask, torch.ones(2, 60))
    out = tokens_to_latent(st)
    assert set(out) == {"samples", "batch_index"} and out["batch_index"] == [0, 1]
    assert torch.equal(out["samples"], v)
    # token t is frame-major, then height, then width (ltx-core's patchify order)
    assert torch.equal(st.video.tokens[1, 1 * 20 + 2 * 5 + 3], v[1, :, 1, 2, 3])


def test_audio_round_trip_is_exact():
    a = _audio()
    st = latent_to_tokens({"samples": a, "type": "audio"})
    assert st.video is None
    assert st.audio.tokens.shape == (2, 11, 128) and st.audio.positions.shape == (2, 1, 11, 2)
    out = tokens_to_latent(st)
    assert out["type"] == "audio" and torch.equal(out["samples"], a)
    assert torch.equal(st.audio.tokens[0, 4], a[0, :, 4, :].reshape(-1))  # (channel, mel) per token


@pytest.mark.parametrize("nested_cls", [NestedTensorLike, ForeignNested])
def test_nested_round_trip_returns_the_same_kind(nested_cls):
    v, a = _video(), _audio()
    vm, am = torch.rand(2, 1, 3, 1, 1), torch.ones_like(a)
    latent = {"samples": nested_cls((v, a)), "noise_mask": nested_cls((vm, am)), "type": "audio"}
    st = latent_to_tokens(latent, frame_rate=25)
    assert st.nested_type is nested_cls
    new_v, new_a = st.video.tokens * 2, st.audio.tokens - 1
    out = tokens_to_latent(st, new_v, new_a)
    assert type(out["samples"]) is nested_cls and out["samples"].is_nested
    ov, oa = out["samples"].tensors
    assert torch.equal(ov, v * 2) and torch.equal(oa, a - 1)
    assert out["noise_mask"] is latent["noise_mask"] and out["type"] == "audio"
    back = tokens_to_latent(st)
    assert torch.equal(back["samples"].tensors[0], v) and torch.equal(back["samples"].tensors[1], a)


def test_dtype_and_device_are_restored():
    v = _video(dtype=torch.bfloat16)
    st = latent_to_tokens({"samples": v})
    assert st.video.tokens.dtype == torch.bfloat16
    out = tokens_to_latent(st, st.video.tokens.float())
    assert out["samples"].dtype == torch.bfloat16 and torch.equal(out["samples"], v)


@pytest.mark.parametrize("fps", [24.0, 25.0, 30.0])
def test_positions_equal_ltx_core_latent_tools(fps):
    v, a = _video(f=4, h=3, w=2), _audio(n=13)
    st = latent_to_tokens({"samples": NestedTensorLike((v, a))}, frame_rate=fps)
    ref_v = VideoLatentTools(VideoLatentPatchifier(1), VideoLatentShape.from_torch_shape(v.shape), fps=fps)
    ref_v = ref_v.create_initial_state("cpu", torch.float32, initial_latent=v)
    ref_a = AudioLatentTools(AudioPatchifier(1), AudioLatentShape.from_torch_shape(a.shape))
    ref_a = ref_a.create_initial_state("cpu", torch.float32, initial_latent=a)
    assert torch.equal(st.video.positions, ref_v.positions)
    assert torch.equal(st.video.tokens, ref_v.latent)
    assert torch.equal(st.audio.positions, ref_a.positions)
    assert torch.equal(st.audio.tokens, ref_a.latent)
    # causal first frame: latent frame 0 covers pixel frame [0, 1), frame 1 covers [1, 9)
    hw = 3 * 2
    assert st.video.positions[0, 0, 0].tolist() == [0.0, pytest.approx(1 / fps)]
    assert st.video.positions[0, 0, hw].tolist() == [pytest.approx(1 / fps), pytest.approx(9 / fps)]
    # token 2 of a 3x2 grid is row 1, column 0: pixels [32, 64) high, [0, 32) wide
    assert st.video.positions[0, 1, 2].tolist() == [32.0, 64.0]
    assert st.video.positions[0, 2, 2].tolist() == [0.0, 32.0]
    # audio latent i covers mel frames from 4i + 1 - 4 (causal, clamped at 0), hop 160 at 16 kHz
    assert st.audio.positions[0, 0, 1].tolist() == [pytest.approx(0.01), pytest.approx(0.05)]


def test_image_to_video_noise_mask_gives_per_token_denoise_strength():
    v = _video(b=1, f=3, h=2, w=2)
    mask = torch.ones(1, 1, 3, 1, 1)
    mask[:, :, 0] = 0.25  # LTXVImgToVideo: 1 - strength on the first latent frame
    st = latent_to_tokens({"samples": v, "noise_mask": mask})
    expected = torch.tensor([[0.25] * 4 + [1.0] * 8])
    assert torch.equal(st.video.denoise_mask, expected)


def test_full_shape_masks_read_channel_zero_like_comfyui():
    v, a = _video(b=1), _audio(b=1)
    gen = torch.Generator().manual_seed(3)
    vm, am = torch.rand(v.shape, generator=gen), torch.rand(a.shape, generator=gen)
    st = latent_to_tokens({"samples": NestedTensorLike((v, a)), "noise_mask": NestedTensorLike((vm, am))})
    assert torch.equal(st.video.denoise_mask, vm[:, 0].reshape(1, -1))
    assert torch.equal(st.audio.denoise_mask, am[:, 0, :, 0])


def test_spatial_mask_applies_to_every_frame_and_missing_audio_mask_is_ones():
    v, a = _video(b=2, f=3, h=2, w=3), _audio(b=2)
    hw = torch.tensor([[0.0, 1.0, 0.5], [1.0, 0.0, 1.0]])
    st = latent_to_tokens({"samples": NestedTensorLike((v, a)), "noise_mask": hw})
    assert torch.equal(st.video.denoise_mask, hw.reshape(-1).repeat(3).expand(2, -1))
    assert torch.equal(st.audio.denoise_mask, torch.ones(2, 11))


def test_frame_rate_from_conditioning():
    cond = [[torch.zeros(1, 4, 8), {"frame_rate": 24, "attention_mask": None}]]
    assert frame_rate_from_conditioning(cond) == 24.0
    assert frame_rate_from_conditioning([[torch.zeros(1, 4, 8), {}]]) == DEFAULT_FRAME_RATE == 25.0
    assert frame_rate_from_conditioning({"frame_rate": 30.0}) == 30.0
    with pytest.raises(ValueError, match="positive"):
        frame_rate_from_conditioning([[None, {"frame_rate": 0}]])


def test_bad_latents_get_clear_errors():
    with pytest.raises(LatentFormatError, match=r"\[B, 128, F, H, W\]"):
        latent_to_tokens({"samples": torch.zeros(1, 128, 4, 4)})
    with pytest.raises(LatentFormatError, match=r"\[B, 8, N, 16\]"):
        latent_to_tokens({"samples": torch.zeros(1, 8, 4), "type": "audio"})
    with pytest.raises(LatentFormatError, match="LTXVConcatAVLatent"):
        latent_to_tokens({"samples": NestedTensorLike((_video(), _audio(), _audio()))})
    with pytest.raises(LatentFormatError, match="batch"):
        latent_to_tokens({"samples": NestedTensorLike((_video(b=1), _audio(b=2)))})
    with pytest.raises(LatentFormatError, match="LATENT"):
        latent_to_tokens(torch.zeros(1))
    with pytest.raises(ValueError, match="frame_rate"):
        latent_to_tokens({"samples": _video()}, frame_rate=0)
    st = latent_to_tokens({"samples": _video()})
    with pytest.raises(ValueError, match="do not fit"):
        tokens_to_latent(st, torch.zeros(2, 59, 128))
