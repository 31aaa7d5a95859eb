"""LTX-2 denoising through the real pool (torchrun, CPU gloo ranks): ``load_transformer`` and
``sample`` equal the in-process sampler at world size 1, for cfg 1 and cfg > 1, audio-video
latents whose 45 video tokens divide by neither 2 nor 4, with a noise mask and with a LoRA;
seeds; progress and cancel; bad requests (heads the world size does not divide, too many
tokens, unsupported conditioning) answered ``bad_input`` while the pool keeps serving. Also
the LATENT / CONDITIONING wire layout of :mod:`ltx_mgpu.wire.codec` on its own.

Checkpoint layouts (monolith vs transformer-only) are compared in-process by
``test_denoise_model.py``; the pool job calls the same loader."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import save_file

from ltx_mgpu.client.denoise import SampleRequest, remote_load_transformer, remote_sample
from ltx_mgpu.client.errors import BadInputError, JobCancelledError
from ltx_mgpu.client.pool_client import PoolClient
from ltx_mgpu.denoise.comfyui.sampler import sample
from ltx_mgpu.denoise.model import load_ltx_model
from ltx_mgpu.denoise.plan import TransformerPlan
from ltx_mgpu.nested import NestedTensorLike
from ltx_mgpu.wire.codec import (
    conditioning_from_request,
    conditioning_to_request,
    latent_from_request,
    latent_from_result,
    latent_to_request,
    latent_to_result,
)

F32 = torch.float32
SIGMAS = torch.tensor([1.0, 0.725, 0.421875, 0.0])  # 3 steps (ManualSigmas-style)
TOL = 1e-5


# --------------------------------------------------------------------------- inputs


def _cond(tokens: int, seed: int, **extra):
    """An unprocessed LTX-2.3 CONDITIONING for the tiny checkpoint (width 32 + 16)."""
    t = torch.randn(1, tokens, 48, generator=torch.Generator().manual_seed(seed))
    return [[t, {"pooled_output": None, "unprocessed_ltxav_embeds": True, **extra}]]


def _av_latent(f=3, h=3, w=5, n=7, seed=11, masked=False, **keys):
    """An audio-video LATENT as LTXVConcatAVLatent makes it (f*h*w video tokens)."""
    g = torch.Generator().manual_seed(seed)
    out = {"samples": NestedTensorLike([torch.randn(1, 128, f, h, w, generator=g),
                                        torch.randn(1, 8, n, 16, generator=g)]),
           "type": "audio", **keys}
    if masked:  # image-to-video: frame 0 kept, the first audio latents partly kept
        vm, am = torch.ones(1, 1, f, 1, 1), torch.ones(1, 1, n, 1)
        vm[:, :, 0], am[:, :, :2] = 0.0, 0.25
        out["noise_mask"] = NestedTensorLike([vm, am])
    return out


def _parts(latent):
    s = latent["samples"]
    return list(s.tensors) if hasattr(s, "tensors") else [s]


def _max_diff(a, b) -> float:
    return max((x - y).abs().max().item() for x, y in zip(_parts(a), _parts(b), strict=True))


def _serving(client, world: int) -> None:
    result, _ = client.request("selftest", {"steps": 1}, timeout=60)
    assert result["allreduce_ok"] and result["world_size"] == world


def _write_lora(path) -> None:
    g = torch.Generator().manual_seed(8)
    sd = {}
    for m, (o, i) in {"transformer_blocks.0.attn1.to_q": (32, 32),
                      "transformer_blocks.1.video_to_audio_attn.to_k": (16, 32)}.items():
        sd[f"diffusion_model.{m}.lora_A.weight"] = torch.randn(2, i, generator=g)
        sd[f"diffusion_model.{m}.lora_B.weight"] = 0.5 * torch.randn(o, 2, generator=g)
    save_file(sd, str(path))


# --------------------------------------------------------------------------- fixtures


@pytest.fixture(scope="module")
def lora(base):
    path = base / "lora.safetensors"
    _write_lora(path)
    return str(path)


def _pool(base, nproc: int) -> PoolClient:
    return PoolClient.connect(gpus="cpu", nproc=nproc, runtime_dir=base, lifetime="with-owner", startup_timeout=120)


@pytest.fixture(scope="module")
def pool2(base, tiny_ltx_23):
    client = _pool(base, 2)
    try:
        loaded = remote_load_transformer(client, TransformerPlan(str(tiny_ltx_23), dtype="fp32"))
        assert loaded["reused"] is False and loaded["world_size"] == 2 and loaded["version"] == "2.3"
        yield client
    finally:
        client.shutdown()


@pytest.fixture(scope="module")
def model23(tiny_ltx_23):
    return load_ltx_model(TransformerPlan(tiny_ltx_23, dtype="fp32"))


def _guides(f=2, h=3, w=5, seed=11):
    """What ``LTXVAddGuide`` (twice: frame 0 at strength 1, the last frame at 0.7) and
    ``LTXVReferenceAudio`` leave: a video latent with the two guide frames appended and its noise
    mask (75 tokens: not divisible by the 2 ranks), and the conditioning options (keyframe pixel
    coordinates, guide entries, reference audio tokens)."""
    g = torch.Generator().manual_seed(seed)
    v, a = torch.randn(1, 128, f + 2, h, w, generator=g), torch.randn(1, 8, 7, 16, generator=g)
    vm = torch.ones(1, 1, f + 2, h, w)
    vm[:, :, f], vm[:, :, f + 1] = 0.0, 0.3
    coords = []
    for frame in (0, (f - 1) * 8):
        hh, ww = torch.meshgrid(torch.arange(h) * 32.0, torch.arange(w) * 32.0, indexing="ij")
        start = torch.stack([torch.full((h, w), float(frame)), hh, ww]).reshape(3, -1)
        coords.append(torch.stack([start, start + torch.tensor([1.0, 32.0, 32.0]).view(3, 1)], dim=-1))
    options = {"keyframe_idxs": torch.cat(coords, dim=1).unsqueeze(0),
               "guide_attention_entries": [{"pre_filter_count": h * w, "strength": s, "pixel_mask": None,
                                            "latent_shape": [1, h, w]} for s in (1.0, 0.7)],
               "ref_audio": {"tokens": torch.randn(1, 4, 128, generator=g)}}
    latent = {"samples": NestedTensorLike([v, a]), "type": "audio",
              "noise_mask": NestedTensorLike([vm, torch.ones(1, 1, 7, 1)])}
    return latent, options


# --------------------------------------------------------------------------- parity and seeds


def test_guides_and_reference_audio_through_two_ranks_equal_the_in_process_sampler(pool2, model23):
    latent, options = _guides()
    pos, neg = _cond(9, 1, frame_rate=24.0, **options), _cond(5, 2, frame_rate=24.0, **options)
    got = remote_sample(pool2, SampleRequest(pos, neg, latent, cfg=3.0, seed=42, sigmas=SIGMAS), timeout=120)
    ref = sample(model23, pos, neg, latent, cfg=3.0, seed=42, sigmas=SIGMAS)
    assert _max_diff(got, ref) <= TOL
    plain = sample(model23, _cond(9, 1, frame_rate=24.0), _cond(5, 2, frame_rate=24.0), latent, cfg=3.0, seed=42,
                   sigmas=SIGMAS)
    assert _max_diff(got, plain) > 1e-3


@pytest.mark.parametrize("cfg, masked, sigmas", [(1.0, False, True), (3.0, True, False)],
                         ids=["cfg1_sigmas", "cfg3_masked_scheduler"])
def test_sample_through_two_ranks_equals_the_in_process_sampler(pool2, model23, cfg, masked, sigmas):
    pos, neg = _cond(9, 1, frame_rate=24.0), _cond(5, 2, frame_rate=24.0)
    latent = _av_latent(masked=masked, my_key="kept")
    timing = {"sigmas": SIGMAS} if sigmas else {"steps": 3}
    seen = []
    got = remote_sample(pool2, SampleRequest(pos, neg if cfg != 1 else None, latent, cfg=cfg, seed=42, **timing),
                        timeout=120, on_progress=lambda *p: seen.append(p))
    ref = sample(model23, pos, neg if cfg != 1 else None, latent, cfg=cfg, seed=42, **timing)
    assert type(got["samples"]) is NestedTensorLike
    assert [p.shape for p in _parts(got)] == [p.shape for p in _parts(latent)]
    assert _max_diff(got, ref) <= TOL
    assert _max_diff(got, latent) > 0.1  # it did denoise
    assert seen == [("denoise", 1, 3), ("denoise", 2, 3), ("denoise", 3, 3)]
    assert got["my_key"] == "kept" and got["type"] == "audio"
    assert (got.get("noise_mask") is latent.get("noise_mask"))


def test_same_seed_same_output_different_seed_different(pool2):
    run = lambda seed: remote_sample(  # noqa: E731
        pool2, SampleRequest(_cond(9, 1), None, _av_latent(), sigmas=SIGMAS, seed=seed), timeout=120)
    a, b, c = run(5), run(5), run(6)
    assert all(torch.equal(x, y) for x, y in zip(_parts(a), _parts(b), strict=True))
    assert all(not torch.allclose(x, y, atol=1e-3) for x, y in zip(_parts(a), _parts(c), strict=True))


def test_loading_the_same_files_again_keeps_the_resident_model(pool2, tiny_ltx_23):
    again = remote_load_transformer(pool2, TransformerPlan(str(tiny_ltx_23), dtype="fp32"))
    assert again["reused"] is True and again["valid_world_sizes"] == [1, 2, 4]
    rank0 = pool2.status()["ranks"][0]  # the other ranks' records refresh once a second
    assert rank0["models"]["ltx"]["kind"] == "ltx_transformer" and rank0["models"]["ltx"]["bytes"] == again["bytes"]


def test_lora_changes_the_output_and_two_ranks_still_equal_world_size_one(pool2, tiny_ltx_23, lora):
    loaded = remote_load_transformer(pool2, TransformerPlan(str(tiny_ltx_23), dtype="fp32", loras=[(lora, 1.0)]),
                                     name="with_lora")
    assert loaded["loras"] == [{"path": lora, "strength": 1.0}]
    pos, neg, latent = _cond(9, 1), _cond(5, 2), _av_latent()
    got = remote_sample(pool2, SampleRequest(pos, neg, latent, model="with_lora", sigmas=SIGMAS, cfg=2.0, seed=3),
                        timeout=120)
    plain = remote_sample(pool2, SampleRequest(pos, neg, latent, sigmas=SIGMAS, cfg=2.0, seed=3), timeout=120)
    ref = sample(load_ltx_model(TransformerPlan(tiny_ltx_23, dtype="fp32", loras=[(lora, 1.0)])), pos, neg, latent,
                                                sigmas=SIGMAS,
                 cfg=2.0, seed=3)
    assert _max_diff(got, ref) <= TOL
    assert all(_max_diff({"samples": x}, {"samples": y}) > 1e-3
               for x, y in zip(_parts(got), _parts(plain), strict=True))
    pool2.request("unload", {"names": ["with_lora"]}, timeout=30)


def test_four_ranks_equal_world_size_one(base, tiny_ltx_23, model23):
    client = _pool(base, 4)
    try:
        assert remote_load_transformer(client, TransformerPlan(str(tiny_ltx_23), dtype="fp32"))["world_size"] == 4
        pos, neg, latent = _cond(9, 1), _cond(5, 2), _av_latent(masked=True)
        got = remote_sample(client, SampleRequest(pos, neg, latent, sigmas=SIGMAS, cfg=3.0, seed=9), timeout=120)
        ref = sample(model23, pos, neg, latent, sigmas=SIGMAS, cfg=3.0, seed=9)
        assert _max_diff(got, ref) <= TOL
    finally:
        client.shutdown()


# --------------------------------------------------------------------------- bad input, cancel


def test_heads_not_divisible_by_three_ranks_is_bad_input_and_the_pool_keeps_serving(base, tiny_ltx_23):
    client = _pool(base, 3)
    try:
        for _ in range(2):  # the same message each time, and the pool stays up
            with pytest.raises(BadInputError) as e:
                remote_load_transformer(client, TransformerPlan(str(tiny_ltx_23), dtype="fp32"))
            message = str(e.value)
            assert "4 video attention heads and 4 audio attention heads" in message
            assert "3 ranks do not divide them" in message and "rank (GPU) counts instead: 1, 2, 4" in message
            _serving(client, 3)
        assert all(not r["models"] for r in client.status()["ranks"])  # refused before loading weights
    finally:
        client.shutdown()


def test_too_many_tokens_is_bad_input_and_a_fitting_latent_still_samples(pool2, tiny_ltx_23):
    remote_load_transformer(pool2, TransformerPlan(str(tiny_ltx_23), dtype="fp32", max_tokens=44), name="small")
    with pytest.raises(BadInputError, match=r"45 tokens .*max_tokens=44.*Lower the resolution or the number of frames"):
        remote_sample(pool2, SampleRequest(_cond(9, 1), None, _av_latent(), model="small", sigmas=SIGMAS), timeout=60)
    out = remote_sample(pool2, SampleRequest(_cond(9, 1), None, _av_latent(f=2, h=3, w=4), model="small",
                                             sigmas=SIGMAS), timeout=60)
    assert _parts(out)[0].shape == (1, 128, 2, 3, 4)
    pool2.request("unload", {"names": ["small"]}, timeout=30)


def test_bad_requests_name_the_fix_and_the_pool_keeps_serving(pool2, tmp_path, tiny_ltx_23):
    with pytest.raises(BadInputError, match=r"keyframe_idxs \(from LTXVAddGuide\) must be"):
        remote_sample(pool2, SampleRequest(_cond(9, 1, keyframe_idxs=torch.zeros(1, 3)), None, _av_latent(),
                                           sigmas=SIGMAS))
    with pytest.raises(BadInputError, match="'my_hook'; .*refuses to ignore"):
        remote_sample(pool2, SampleRequest(_cond(9, 1, my_hook=object()), None, _av_latent(), sigmas=SIGMAS))
    with pytest.raises(BadInputError, match="no LTX-2 transformer named 'nope'.*load one first"):
        remote_sample(pool2, SampleRequest(_cond(9, 1), None, _av_latent(), model="nope", sigmas=SIGMAS))
    with pytest.raises(BadInputError, match="LTX-2 video latent is"):
        remote_sample(pool2, SampleRequest(_cond(9, 1), None, {"samples": torch.zeros(1, 128, 4, 4)}, sigmas=SIGMAS))
    with pytest.raises(BadInputError, match="no checkpoint at"):
        remote_load_transformer(pool2, TransformerPlan(str(tmp_path / "missing.safetensors")), name="x")
    with pytest.raises(BadInputError, match="no LoRA file"):
        remote_load_transformer(pool2, TransformerPlan(str(tiny_ltx_23), loras=[(str(tmp_path / "l.safetensors"),
                                                       1.0)]), name="x")
    _serving(pool2, 2)


def test_cancel_stops_at_a_step_boundary_and_the_pool_keeps_serving(pool2):
    seen = []
    with pytest.raises(JobCancelledError):
        remote_sample(pool2, SampleRequest(_cond(9, 1), None, _av_latent(), steps=400),
                      on_progress=lambda *p: seen.append(p), should_cancel=lambda: bool(seen), timeout=120)
    assert seen and seen[0] == ("denoise", 1, 400) and len(seen) < 400
    _serving(pool2, 2)


# --------------------------------------------------------------------------- wire layout (no pool)


def test_latent_layout_round_trips_every_comfyui_form():
    g = torch.Generator().manual_seed(0)
    video = {"samples": torch.randn(2, 128, 2, 3, 4, generator=g), "noise_mask": torch.rand(1, 1, 2, 3, 4),
             "batch_index": [3, 1]}
    audio = {"samples": torch.randn(1, 8, 5, 16, generator=g).bfloat16(), "type": "audio"}
    av = _av_latent(masked=True)
    for latent in (video, audio, av):
        spec, tensors = latent_to_request(latent)
        back = latent_from_request(spec, tensors, NestedTensorLike)
        assert set(back) == set(latent) & {"samples", "noise_mask", "type", "batch_index"}
        for key in ("samples", "noise_mask"):
            if key in latent:
                assert all(torch.equal(x, y) for x, y in zip(_parts({"samples": back[key]}),
                                                             _parts({"samples": latent[key]}), strict=True))
        assert back.get("batch_index") == latent.get("batch_index") and back.get("type") == latent.get("type")
        result, out = latent_to_result(back)
        rebuilt = latent_from_result(latent, result, out)
        assert type(rebuilt["samples"]) is type(latent["samples"]) and rebuilt.keys() == latent.keys()


def test_conditioning_layout_keeps_tensor_options_and_names_unsendable_ones():
    cond = _cond(4, 0, frame_rate=24.0, attention_mask=torch.ones(1, 4), hooks=object())
    entries, tensors = conditioning_to_request(cond, "positive")
    assert set(tensors) == {"positive.0", "positive.0.attention_mask"}
    back = conditioning_from_request(entries, tensors, "positive")
    assert torch.equal(back[0][0], cond[0][0]) and torch.equal(back[0][1]["attention_mask"], torch.ones(1, 4))
    assert back[0][1]["frame_rate"] == 24.0 and back[0][1]["hooks"] == "<object object>"
