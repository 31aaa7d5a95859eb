"""The geometry and ``config`` metadata of the tiny LTX-2 checkpoints (:mod:`ltx_mgpu.assets.ltx`
builds their weights and files): sizes chosen so that sequence-parallel tests can run world
sizes 1, 2 and 4 and must reject 3, and the key sets of the production 19B (2.0) / 22B (2.3)
configs that ltx-core 1.0.0's configurators check."""

from __future__ import annotations

from typing import Literal

from ltx_mgpu.assets.audio import tiny_audio_config
from ltx_mgpu.assets.gemma import TINY_GEMMA_HIDDEN, TINY_GEMMA_HIDDEN_STATES

Version = Literal["2.0", "2.3"]

#: Transformer geometry. Heads divide 1, 2 and 4 ranks, not 3.
TINY_VIDEO_HEADS = 4
TINY_VIDEO_HEAD_DIM = 8
TINY_AUDIO_HEADS = 4
TINY_AUDIO_HEAD_DIM = 4
TINY_LAYERS = 2
#: Video latent channels (ComfyUI's LTX-2 LATENT) and audio channels per token (8 x 16 mel bins).
TINY_LATENT_CHANNELS = 128
TINY_AUDIO_CHANNELS = 128
#: LTX-2.0 connector width = ``caption_channels`` = the (tiny) Gemma hidden size, as 3840 is in
#: production (4 heads x 16).
TINY_V1_CONNECTOR_HEADS = 4
TINY_V1_CONNECTOR_HEAD_DIM = 16
#: Learnable registers per connector (production value); the connector's input length must be
#: a multiple of it.
TINY_CONNECTOR_REGISTERS = 128
#: Feature-extractor input width: Gemma hidden x number of hidden states (64 x 7).
TINY_FEATURE_IN = TINY_GEMMA_HIDDEN * TINY_GEMMA_HIDDEN_STATES
#: ``decoder_base_channels`` of the tiny VAE (the decoder starts at 8x this).
TINY_VAE_DECODER_BASE = 4

MODEL_VERSIONS = {"2.0": "2.0.0", "2.3": "2.3.0"}

# Values ``LTXModelConfigurator`` checks with ``check_config_value`` (a missing key fails).
_SENTINELS: dict = {
    "dropout": 0.0,
    "attention_bias": True,
    "num_vector_embeds": None,
    "activation_fn": "gelu-approximate",
    "num_embeds_ada_norm": 1000,
    "use_linear_projection": False,
    "only_cross_attention": False,
    "cross_attention_norm": True,
    "double_self_attention": False,
    "upcast_attention": False,
    "standardization_norm": "rms_norm",
    "norm_elementwise_affine": False,
    "qk_norm": "rms_norm",
    "positional_embedding_type": "rope",
    "use_audio_video_cross_attention": True,
    "share_ff": False,
    "av_cross_ada_norm": True,
    "use_middle_indices_grid": True,
}


def check_version(version: str) -> Version:
    if version not in MODEL_VERSIONS:
        raise ValueError(f"version must be '2.0' or '2.3', got {version!r}")
    return version  # type: ignore[return-value]


def check_gemma(gemma_hidden: int, gemma_hidden_states: int = TINY_GEMMA_HIDDEN_STATES) -> None:
    if gemma_hidden < TINY_V1_CONNECTOR_HEADS or gemma_hidden % TINY_V1_CONNECTOR_HEADS or gemma_hidden_states < 2:
        raise ValueError(
            f"gemma_hidden must be a positive multiple of {TINY_V1_CONNECTOR_HEADS} (the LTX-2.0 connector heads) "
            f"and gemma_hidden_states >= 2; got {gemma_hidden} and {gemma_hidden_states}"
        )


def tiny_transformer_config(version: Version, gemma_hidden: int = TINY_GEMMA_HIDDEN) -> dict:
    """The ``"transformer"`` section of the tiny checkpoint's ``config`` metadata.

    The key set mirrors the production 19B (2.0) / 22B (2.3) configs, with toy sizes; pass
    ``{"transformer": tiny_transformer_config(v)}`` to ``LTXModelConfigurator.from_config`` (under
    ``torch.device("meta")``) or to ltx-core's connector configurators to build the same modules
    in memory. A fresh dict is returned on every call.

    ``gemma_hidden`` (default: the tiny Gemma's 64) is ``caption_channels``, the Gemma hidden size
    the text side is built for: for 2.0 it is also the connector width (4 heads x
    ``gemma_hidden / 4``) and the caption projections' input; for 2.3 only the config value
    changes (its connectors run at the transformer's inner dims).

    Raises:
        ValueError: ``version`` is not ``"2.0"`` or ``"2.3"``; ``gemma_hidden`` not a multiple of 4.
    """
    version = check_version(version)
    check_gemma(gemma_hidden)
    video_inner = TINY_VIDEO_HEADS * TINY_VIDEO_HEAD_DIM
    audio_inner = TINY_AUDIO_HEADS * TINY_AUDIO_HEAD_DIM
    cfg: dict = {
        "_class_name": "AVTransformer3DModel",
        **_SENTINELS,
        "attention_type": "default",
        "norm_eps": 1e-06,
        "norm_num_groups": 32,
        "num_attention_heads": TINY_VIDEO_HEADS,
        "attention_head_dim": TINY_VIDEO_HEAD_DIM,
        "in_channels": TINY_LATENT_CHANNELS,
        "out_channels": TINY_LATENT_CHANNELS,
        "num_layers": TINY_LAYERS,
        "cross_attention_dim": video_inner,
        "audio_num_attention_heads": TINY_AUDIO_HEADS,
        "audio_attention_head_dim": TINY_AUDIO_HEAD_DIM,
        "audio_in_channels": TINY_AUDIO_CHANNELS,
        "audio_out_channels": TINY_AUDIO_CHANNELS,
        "audio_cross_attention_dim": audio_inner,
        "caption_channels": gemma_hidden,
        "positional_embedding_theta": 10000.0,
        "positional_embedding_max_pos": [20, 2048, 2048],
        "audio_positional_embedding_max_pos": [20],
        "timestep_scale_multiplier": 1000,
        "av_ca_timestep_scale_multiplier": 1000.0,
        "causal_temporal_positioning": True,
        "rope_type": "split",
        "frequencies_precision": "float64",
        "use_embeddings_connector": True,
        "connector_num_layers": 1,
        "connector_positional_embedding_max_pos": [4096],
        "connector_num_learnable_registers": TINY_CONNECTOR_REGISTERS,
        "connector_norm_output": True,
    }
    if version == "2.0":
        cfg.update(
            connector_num_attention_heads=TINY_V1_CONNECTOR_HEADS,
            connector_attention_head_dim=gemma_hidden // TINY_V1_CONNECTOR_HEADS,
        )
    else:
        cfg.update(
            apply_gated_attention=True,
            cross_attention_adaln=True,
            caption_proj_before_connector=True,
            caption_projection_first_linear=False,
            caption_projection_second_linear=False,
            caption_proj_input_norm=False,
            connector_apply_gated_attention=True,
            connector_learnable_registers_std=1,
            connector_num_attention_heads=TINY_VIDEO_HEADS,
            connector_attention_head_dim=TINY_VIDEO_HEAD_DIM,
            audio_connector_num_attention_heads=TINY_AUDIO_HEADS,
            audio_connector_attention_head_dim=TINY_AUDIO_HEAD_DIM,
        )
    return cfg


def tiny_vae_config() -> dict:
    """The ``"vae"`` section: an ltx-core ``CausalVideoAutoencoder`` config at toy width.

    Real compression: patch 4 x three 2x2x2 stages = 32x spatial, 8x temporal, so a latent
    ``[B, 128, F', H', W']`` decodes to ``[B, 3, 8(F'-1)+1, 32H', 32W']``. The encoder keeps
    128 channels throughout (ltx-core's encoder width starts at ``latent_channels``); the
    decoder starts at ``8 * decoder_base_channels`` = 32 channels. ``spatial_padding_mode``
    "zeros" (as the production 2.3 VAE), no timestep conditioning, non-causal decoder.
    """
    return {
        "_class_name": "CausalVideoAutoencoder",
        "dims": 3,
        "in_channels": 3,
        "out_channels": 3,
        "latent_channels": TINY_LATENT_CHANNELS,
        "encoder_blocks": [["compress_all_res", {"multiplier": 1}]] * 3,
        "decoder_blocks": [
            ["res_x", {"num_layers": 1}],
            ["compress_all", {"multiplier": 2, "residual": True}],
            ["compress_all", {"multiplier": 2, "residual": True}],
            ["compress_all", {"multiplier": 2, "residual": True}],
            ["res_x", {"num_layers": 1}],
        ],
        "scaling_factor": 1.0,
        "norm_layer": "pixel_norm",
        "patch_size": 4,
        "latent_log_var": "uniform",
        "use_quant_conv": False,
        "causal_decoder": False,
        "timestep_conditioning": False,
        "normalize_latent_channels": False,
        "decoder_base_channels": TINY_VAE_DECODER_BASE,
        "spatial_padding_mode": "zeros",
    }


def tiny_ltx_config(version: Version, gemma_hidden: int = TINY_GEMMA_HIDDEN) -> dict:
    """The full parsed ``config`` metadata: ``{"transformer": ..., "vae": ...}``, plus
    ``"audio_vae"`` and ``"vocoder"`` for 2.3 (:func:`ltx_mgpu.assets.audio.tiny_audio_config`)."""
    config = {"transformer": tiny_transformer_config(version, gemma_hidden), "vae": tiny_vae_config()}
    return {**config, **tiny_audio_config()} if version == "2.3" else config
