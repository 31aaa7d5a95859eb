"""The tiny LTX-2 monolith checkpoints load through ltx-core 1.0.0's own builders and run.

Each checkpoint is built twice into the session's temp dir (byte identity), then loaded the way
production loads a real ComfyUI monolith: the transformer with ``LTXV_MODEL_COMFY_RENAMING_MAP``,
the connectors + projection with ``EMBEDDINGS_PROCESSOR_KEY_OPS``, the VAE with the ComfyUI key
filters.
"""

from __future__ import annotations

import json
import os

os.environ.setdefault("OMP_NUM_THREADS", "1")

import pytest
import torch
from ltx_core.components.patchifiers import AudioPatchifier, VideoLatentPatchifier
from ltx_core.guidance.perturbations import BatchedPerturbationConfig
from ltx_core.loader.sft_loader import SafetensorsModelStateDictLoader
from ltx_core.loader.single_gpu_model_builder import SingleGPUModelBuilder
from ltx_core.model.transformer import LTXV_MODEL_COMFY_RENAMING_MAP, LTXModelConfigurator, Modality, X0Model
from ltx_core.model.video_vae import (
    VAE_DECODER_COMFY_KEYS_FILTER,
    VAE_ENCODER_COMFY_KEYS_FILTER,
    VideoDecoderConfigurator,
    VideoEncoderConfigurator,
)
from ltx_core.text_encoders.gemma.encoders.encoder_configurator import (
    EMBEDDINGS_PROCESSOR_KEY_OPS,
    EmbeddingsProcessorConfigurator,
)
from ltx_core.tools import AudioLatentTools, VideoLatentTools
from ltx_core.types import AudioLatentShape, VideoLatentShape
from safetensors import safe_open
from safetensors.torch import load_file

from ltx_mgpu.assets.gemma import TINY_GEMMA_HIDDEN, TINY_GEMMA_HIDDEN_STATES
from ltx_mgpu.assets.geometry import tiny_ltx_config, tiny_transformer_config
from ltx_mgpu.assets.ltx import build_tiny_ltx_checkpoint, tiny_embeddings_processor_ops

VERSIONS = ("2.0", "2.3")
CPU = torch.device("cpu")
DIT = "model.diffusion_model."
CONNECTORS = (DIT + "video_embeddings_connector.", DIT + "audio_embeddings_connector.")

torch.set_num_threads(1)


@pytest.fixture(scope="session")
def checkpoints(tmp_path_factory) -> dict[str, object]:
    """Each version built twice (``a`` and ``b``) with seed 0, and 2.3 once with seed 1."""
    root = tmp_path_factory.mktemp("tiny_ltx")
    out: dict[str, object] = {}
    for v in VERSIONS:
        a, b = root / f"{v}-a.safetensors", root / f"{v}-b.safetensors"
        build_tiny_ltx_checkpoint(a, v, seed=0)
        build_tiny_ltx_checkpoint(b, v, seed=0)
        out[v] = a
        out[v + "/again"] = b
    out["2.3/seed1"] = root / "2.3-seed1.safetensors"
    build_tiny_ltx_checkpoint(out["2.3/seed1"], "2.3", seed=1)
    return out


def _no_meta(module: torch.nn.Module) -> list[str]:
    return [n for n, t in [*module.named_parameters(), *module.named_buffers()] if t.device.type == "meta"]


@pytest.mark.parametrize("version", VERSIONS)
def test_same_seed_gives_identical_bytes(checkpoints, version):
    a, b = checkpoints[version], checkpoints[version + "/again"]
    assert a.read_bytes() == b.read_bytes()
    # 2.0 about 3.3 MB; 2.3 about 6.6 MB (its audio VAE decoder is 128 wide, as ltx-core requires).
    assert a.stat().st_size < {"2.0": 4_000_000, "2.3": 7_000_000}[version]
    assert not list(a.parent.glob("*.tmp")), "the atomic write left a temp file behind"


def test_other_seed_gives_other_weights(checkpoints):
    a, c = load_file(checkpoints["2.3"]), load_file(checkpoints["2.3/seed1"])
    assert a.keys() == c.keys()
    key = DIT + "transformer_blocks.0.attn1.to_q.weight"
    assert not torch.equal(a[key], c[key])


@pytest.mark.parametrize("version", VERSIONS)
def test_metadata(checkpoints, version):
    with safe_open(checkpoints[version], framework="pt") as f:
        meta = f.metadata()
    assert set(meta) == {"config", "model_version"}
    assert all(isinstance(v, str) for v in meta.values())
    assert meta["model_version"] == {"2.0": "2.0.0", "2.3": "2.3.0"}[version]
    config = json.loads(meta["config"])
    assert config == tiny_ltx_config(version)
    assert config["transformer"] == tiny_transformer_config(version)
    # 2.3 carries the tiny audio VAE decoder + vocoder (assets/audio.py); 2.0 has none.
    audio = {"audio_vae", "vocoder"} if version == "2.3" else set()
    assert set(config) == {"transformer", "vae"} | audio
    # What ltx-core's builders see: the parsed config.
    assert SafetensorsModelStateDictLoader().metadata(str(checkpoints[version])) == config


@pytest.mark.parametrize("version", VERSIONS)
def test_key_layout_matches_comfyui_detection(checkpoints, version):
    sd = load_file(checkpoints[version])
    keys = set(sd)
    # comfy/model_detection.py: LTX family, audio-video ("ltxav"), layer count, attn2 shapes.
    assert DIT + "adaln_single.emb.timestep_embedder.linear_1.bias" in keys
    assert DIT + "pos_embed.proj.bias" not in keys
    assert DIT + "audio_adaln_single.linear.weight" in keys
    assert DIT + "transformer_blocks.0.attn2.to_k.weight" in keys
    assert {k.split(".")[3] for k in keys if k.startswith(DIT + "transformer_blocks.")} == {"0", "1"}
    assert sum(k.startswith(DIT) for k in keys) > 5
    # comfy/sd.py's VAE detection key; no text-encoder weights in an LTX monolith.
    assert "vae.decoder.up_blocks.0.res_blocks.0.conv1.conv.weight" in keys
    assert {"vae.per_channel_statistics.mean-of-means", "vae.per_channel_statistics.std-of-means"} <= keys
    assert not any(k.startswith("text_encoders.") for k in keys)
    for prefix in CONNECTORS:
        assert sd[prefix + "learnable_registers"].dtype == torch.float32
        assert sd[prefix + "learnable_registers"].shape[0] == 128
    vaes = ("vae.", "audio_vae.", "vocoder.")
    assert all(t.dtype == torch.bfloat16 for k, t in sd.items() if k.startswith(vaes))
    assert all(t.dtype == torch.float32 for k, t in sd.items() if not k.startswith(vaes))

    feat_in = TINY_GEMMA_HIDDEN * TINY_GEMMA_HIDDEN_STATES
    proj = {k: tuple(t.shape) for k, t in sd.items() if k.startswith("text_embedding_projection.")}
    if version == "2.0":
        assert proj == {"text_embedding_projection.aggregate_embed.weight": (64, feat_in)}
        assert DIT + "caption_projection.linear_1.weight" in keys
        assert sd[CONNECTORS[0] + "learnable_registers"].shape[1] == 64
        assert sd[CONNECTORS[1] + "learnable_registers"].shape[1] == 64
    else:
        assert proj == {
            "text_embedding_projection.video_aggregate_embed.weight": (32, feat_in),
            "text_embedding_projection.video_aggregate_embed.bias": (32,),
            "text_embedding_projection.audio_aggregate_embed.weight": (16, feat_in),
            "text_embedding_projection.audio_aggregate_embed.bias": (16,),
        }
        assert not any("caption_projection" in k for k in keys)
        assert DIT + "transformer_blocks.0.attn1.to_gate_logits.weight" in keys
        assert DIT + "prompt_adaln_single.linear.weight" in keys
        assert sd[CONNECTORS[0] + "learnable_registers"].shape[1] == 32
        assert sd[CONNECTORS[1] + "learnable_registers"].shape[1] == 16


def _transformer_inputs(version: str, context_seed: int) -> tuple[Modality, Modality]:
    """A 2x3x5-token video and a 7-token audio at sigma 0.7, with a 12-token context."""
    g = torch.Generator().manual_seed(123)
    video_shape = VideoLatentShape(batch=1, channels=128, frames=2, height=3, width=5)
    audio_shape = AudioLatentShape(batch=1, channels=8, frames=7, mel_bins=16)
    vs = VideoLatentTools(VideoLatentPatchifier(1), video_shape, fps=24.0).create_initial_state(
        CPU, torch.float32, torch.randn(video_shape.to_torch_shape(), generator=g)
    )
    aus = AudioLatentTools(AudioPatchifier(1), audio_shape).create_initial_state(
        CPU, torch.float32, torch.randn(audio_shape.to_torch_shape(), generator=g)
    )
    cfg = tiny_transformer_config(version)
    if version == "2.0":
        v_ctx_dim = a_ctx_dim = cfg["caption_channels"]
    else:
        v_ctx_dim, a_ctx_dim = cfg["cross_attention_dim"], cfg["audio_cross_attention_dim"]
    cg = torch.Generator().manual_seed(context_seed)
    sigma = torch.tensor([0.7])
    video = Modality(
        latent=vs.latent,
        sigma=sigma,
        timesteps=vs.denoise_mask * sigma,
        positions=vs.positions,
        context=torch.randn(1, 12, v_ctx_dim, generator=cg),
    )
    audio = Modality(
        latent=aus.latent,
        sigma=sigma,
        timesteps=aus.denoise_mask * sigma,
        positions=aus.positions,
        context=torch.randn(1, 12, a_ctx_dim, generator=cg),
    )
    return video, audio


@pytest.mark.parametrize("version", VERSIONS)
def test_transformer_loads_with_ltx_core_builder_and_runs(checkpoints, version):
    path = str(checkpoints[version])
    model = SingleGPUModelBuilder(LTXModelConfigurator, path, LTXV_MODEL_COMFY_RENAMING_MAP).build(
        device=CPU, dtype=torch.float32
    )
    assert _no_meta(model) == []
    saved = load_file(path)
    expected = {k[len(DIT) :]: t for k, t in saved.items() if k.startswith(DIT) and not k.startswith(CONNECTORS)}
    got = model.state_dict()
    assert got.keys() == expected.keys()
    for k, t in expected.items():
        assert torch.equal(got[k], t), k

    x0 = X0Model(model).eval()
    video, audio = _transformer_inputs(version, context_seed=0)
    with torch.inference_mode():
        vx, ax = x0(video, audio, BatchedPerturbationConfig.empty(1))
        vx_other_ctx, _ = x0(*_transformer_inputs(version, context_seed=1), BatchedPerturbationConfig.empty(1))
    assert vx.shape == (1, 30, 128) and ax.shape == (1, 7, 128)
    assert torch.isfinite(vx).all() and torch.isfinite(ax).all()
    assert vx.abs().max() > 0 and ax.abs().max() > 0
    assert not torch.allclose(vx, video.latent) and not torch.allclose(ax, audio.latent)
    assert not torch.allclose(vx, vx_other_ctx), "the text context does not reach the video stream"


@pytest.mark.parametrize("version", VERSIONS)
def test_embeddings_processor_loads_with_ltx_core_builder_and_runs(checkpoints, version):
    path = str(checkpoints[version])
    builder = SingleGPUModelBuilder(
        EmbeddingsProcessorConfigurator,
        path,
        EMBEDDINGS_PROCESSOR_KEY_OPS,
        module_ops=(tiny_embeddings_processor_ops(version),),
    )
    processor = builder.build(device=CPU, dtype=torch.float32)
    assert _no_meta(processor) == []
    saved = load_file(path)
    expected = {}
    for k, t in saved.items():
        new = EMBEDDINGS_PROCESSOR_KEY_OPS.apply_to_key(k)
        if new is not None:
            expected[new] = t
    got = processor.state_dict()
    assert got.keys() == expected.keys()
    for k, t in expected.items():
        assert torch.equal(got[k], t), k

    g = torch.Generator().manual_seed(7)
    seq, valid = 128, 100  # the sequence must be a multiple of the 128 registers
    hidden = tuple(torch.randn(1, seq, TINY_GEMMA_HIDDEN, generator=g) for _ in range(TINY_GEMMA_HIDDEN_STATES))
    mask = torch.zeros(1, seq, dtype=torch.int64)
    mask[:, seq - valid :] = 1  # left padding, as the Gemma tokenizer pads
    with torch.inference_mode():
        out = processor.process_hidden_states(hidden, mask, padding_side="left")
    cfg = tiny_transformer_config(version)
    if version == "2.0":  # connectors at caption_channels; the transformer projects afterwards
        widths = (cfg["caption_channels"], cfg["caption_channels"])
    else:  # already at the transformer's cross-attention widths
        widths = (cfg["cross_attention_dim"], cfg["audio_cross_attention_dim"])
    assert out.video_encoding.shape == (1, seq, widths[0])
    assert out.audio_encoding.shape == (1, seq, widths[1])
    assert torch.isfinite(out.video_encoding).all() and torch.isfinite(out.audio_encoding).all()
    assert out.video_encoding.abs().max() > 0 and out.audio_encoding.abs().max() > 0


@pytest.mark.parametrize("version", VERSIONS)
def test_vae_round_trips_shapes_through_ltx_core_builders(checkpoints, version):
    path = str(checkpoints[version])
    decoder = SingleGPUModelBuilder(VideoDecoderConfigurator, path, VAE_DECODER_COMFY_KEYS_FILTER).build(
        device=CPU, dtype=torch.float32
    )
    encoder = SingleGPUModelBuilder(VideoEncoderConfigurator, path, VAE_ENCODER_COMFY_KEYS_FILTER).build(
        device=CPU, dtype=torch.float32
    )
    assert _no_meta(decoder) == [] and _no_meta(encoder) == []
    latent = torch.randn(1, 128, 2, 2, 3, generator=torch.Generator().manual_seed(3))
    with torch.inference_mode():
        frames = decoder(latent)
        # 8x temporal (first frame kept), 32x spatial: 2 latent frames -> 9 frames.
        assert frames.shape == (1, 3, 9, 64, 96)
        assert torch.isfinite(frames).all() and frames.std() > 0
        assert encoder(frames.clamp(-1, 1)).shape == latent.shape


def test_bad_version_is_rejected_with_the_choices(tmp_path):
    with pytest.raises(ValueError, match="'2.0' or '2.3'"):
        build_tiny_ltx_checkpoint(tmp_path / "x.safetensors", "2.1")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="'2.0' or '2.3'"):
        tiny_transformer_config("2")  # type: ignore[arg-type]
    assert not list(tmp_path.iterdir())


def test_audio_tensors_only_in_23_and_other_tensors_shared(checkpoints):
    """2.3 adds exactly the audio keys (bfloat16, as audio.tiny_audio_shapes says) and keeps the
    values of every tensor it shares with 2.0 (each tensor depends only on seed and key)."""
    from ltx_mgpu.assets.audio import tiny_audio_shapes

    a20, a23 = load_file(checkpoints["2.0"]), load_file(checkpoints["2.3"])
    audio = {k for k in a23 if k.startswith(("audio_vae.", "vocoder."))}
    assert not any(k.startswith(("audio_vae.", "vocoder.")) for k in a20)
    assert {k: tuple(a23[k].shape) for k in audio} == tiny_audio_shapes()
    assert all(a23[k].dtype == torch.bfloat16 and torch.isfinite(a23[k].float()).all() for k in audio)
    shared = set(a20) & set(a23)
    assert DIT + "transformer_blocks.0.attn1.to_q.weight" in shared and "vae.decoder.conv_in.conv.weight" in shared
    assert all(torch.equal(a20[k], a23[k]) for k in shared if a20[k].shape == a23[k].shape)
