"""Tiny, deterministic LTX-2 monolith checkpoints built with ltx-core 1.0.0's own classes.

One ``.safetensors`` file in the single-file layout ComfyUI users have in
``models/checkpoints/`` (``ltx-2-19b-*.safetensors`` / ``ltx-2.3-22b-*.safetensors``), with
the same tensor key names and metadata, at toy sizes:

* ``model.diffusion_model.*``: the audio-video ``LTXModel`` (``LTXModelConfigurator``): video
  4 heads x 8 (inner 32), audio 4 heads x 4 (inner 16), 2 layers, 128 latent channels in and
  out (ComfyUI's LTX-2 LATENT has 128 video channels; the audio token is 8 channels x 16 mel
  bins = 128), split float64 RoPE. 4 heads so sequence-parallel tests can run world sizes 1, 2
  and 4 and must reject 3.
* ``model.diffusion_model.{video,audio}_embeddings_connector.*``: the two
  ``Embeddings1DConnector`` (1 layer, 128 learnable registers as in production, registers
  stored float32).
* ``text_embedding_projection.*``: the Gemma feature-extractor projection sized for the tiny
  Gemma of :mod:`ltx_mgpu.assets` (hidden 64, 7 hidden states -> 448 input features), or, with
  ``gemma_hidden`` / ``gemma_hidden_states``, for another Gemma (the real Gemma 3 270M: 640 x 19
  -> 12160; ``assets.tiny_ltx_checkpoint_gemma270m``).
* ``vae.{encoder,decoder,per_channel_statistics}.*``: a tiny ltx-core video VAE with the real
  compression (32x spatial, 8x temporal; ``(1 + 8k)`` frames <-> ``1 + k`` latent frames),
  stored bfloat16 like the production VAE.
* ``__metadata__``: ``config`` (JSON with ``"transformer"`` and ``"vae"``) and
  ``model_version`` (``"2.0.0"`` / ``"2.3.0"``).

The two layouts differ the way the real checkpoints do (ltx-core 1.0.0's
``ltx_core/model/transformer/model_configurator.py`` and
``ltx_core/text_encoders/gemma/feature_extractor.py``):

* **2.0** (19B layout): ``caption_channels`` = connector width = Gemma hidden (64 here, 3840
  in production); the connectors are 4 heads x 16 = 64 wide, and the transformer's
  ``caption_projection`` / ``audio_caption_projection`` map 64 -> 32 / 16. The feature
  extractor is ltx-core's ``FeatureExtractorV1`` (``aggregate_embed`` 448 -> 64, no bias).
* **2.3** (22B layout): ``caption_proj_before_connector`` (and the other three ``caption_*``
  keys ``FeatureExtractorV2`` requires); the connectors run at the transformer inner dims (32 /
  16), gated attention and cross-attention AdaLN are on; the feature extractor is
  ``FeatureExtractorV2`` (``video_aggregate_embed`` 448 -> 32, ``audio_aggregate_embed``
  448 -> 16, with bias).

2.3 only: ``audio_vae.{decoder,per_channel_statistics}.*`` + ``vocoder.*`` (and ``config``
``"audio_vae"`` / ``"vocoder"``), a tiny ltx-core audio VAE decoder and 24 kHz vocoder built
without torchaudio (:mod:`ltx_mgpu.assets.audio`). 2.0 has none; neither has an audio encoder.

The geometry and the ``config`` metadata are :mod:`ltx_mgpu.assets.geometry`'s; this module
makes the weights and writes the file.

Weights are random: every tensor is drawn from its own ``torch.Generator`` seeded from
``sha256(f"{seed}/{key}")``, so the same seed gives a byte-identical file, and a tensor's value
depends only on the seed and its key (the 2.0 and 2.3 files share the values of shared keys).
The scale keeps a forward numerically sane: matrices ``N(0, 1/fan_in)``, biases ``N(0, 0.05^2)``,
RMS-norm gains ``1 + N(0, 0.1^2)``, registers ``U(-1, 1)`` (ltx-core's own register init).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch
from safetensors.torch import save as save_to_bytes
from torch import nn

from ltx_mgpu.assets.audio import tiny_audio_state_dict
from ltx_mgpu.assets.gemma import TINY_GEMMA_HIDDEN, TINY_GEMMA_HIDDEN_STATES
from ltx_mgpu.assets.geometry import (
    MODEL_VERSIONS,
    TINY_AUDIO_HEAD_DIM,
    TINY_AUDIO_HEADS,
    TINY_VIDEO_HEAD_DIM,
    TINY_VIDEO_HEADS,
    Version,
    check_gemma,
    check_version,
    tiny_ltx_config,
)
from ltx_mgpu.assets.weights import init_tensor
from ltx_mgpu.files import write_atomically


def tiny_feature_extractor(
    version: Version, gemma_hidden: int = TINY_GEMMA_HIDDEN, gemma_hidden_states: int = TINY_GEMMA_HIDDEN_STATES
) -> nn.Module:
    """ltx-core's feature extractor sized for a Gemma with ``gemma_hidden_states`` hidden states of
    width ``gemma_hidden`` (default: the tiny Gemma, 7 x 64; meta-free, uninitialised weights).

    2.0: ``FeatureExtractorV1(Linear(448 -> 64, bias=False), is_av=True)``; 2.3:
    ``FeatureExtractorV2(Linear(448 -> 32), embedding_dim=64, Linear(448 -> 16))``. Input: the
    tiny Gemma's 7 hidden states ``[B, T, 64]`` and a ``[B, T]`` mask. For the real Gemma 3 270M
    (19 x 640) the input width is 12160 and the 2.0 output width 640.

    ltx-core 1.0.0's ``EmbeddingsProcessorConfigurator`` hard-codes the Gemma-3-12B input width
    (3840 x 49 = 188160); use :func:`tiny_embeddings_processor_ops` to swap this module in.
    """
    from ltx_core.text_encoders.gemma.feature_extractor import FeatureExtractorV1, FeatureExtractorV2

    version = check_version(version)
    check_gemma(gemma_hidden, gemma_hidden_states)
    feature_in = gemma_hidden * gemma_hidden_states
    if version == "2.0":
        return FeatureExtractorV1(nn.Linear(feature_in, gemma_hidden, bias=False), is_av=True)
    return FeatureExtractorV2(
        video_aggregate_embed=nn.Linear(feature_in, TINY_VIDEO_HEADS * TINY_VIDEO_HEAD_DIM, bias=True),
        embedding_dim=gemma_hidden,
        audio_aggregate_embed=nn.Linear(feature_in, TINY_AUDIO_HEADS * TINY_AUDIO_HEAD_DIM, bias=True),
    )


def tiny_embeddings_processor_ops(version: Version):
    """A ``ModuleOps`` that resizes ``EmbeddingsProcessor.feature_extractor`` to the tiny Gemma.

    Append it to ``SingleGPUModelBuilder(EmbeddingsProcessorConfigurator, path,
    model_sd_ops=EMBEDDINGS_PROCESSOR_KEY_OPS, module_ops=(op,))`` to load the tiny checkpoint's
    connectors and projection through ltx-core's production builder path; the op runs on the
    meta model before the weights are assigned.
    """
    from ltx_core.loader.module_ops import ModuleOps
    from ltx_core.text_encoders.gemma.embeddings_processor import EmbeddingsProcessor

    version = check_version(version)

    def mutate(processor: nn.Module) -> nn.Module:
        with torch.device("meta"):
            processor.feature_extractor = tiny_feature_extractor(version)
        return processor

    return ModuleOps(
        name=f"tiny_gemma_feature_extractor_{version}",
        matcher=lambda m: isinstance(m, EmbeddingsProcessor),
        mutator=mutate,
    )


def materialise(
    module: nn.Module, prefix: str, seed: int, dtype: torch.dtype, skip: str | None = None
) -> dict[str, torch.Tensor]:
    """The state dict of a meta-built ``module`` with keys ``prefix + name`` and fresh values
    (:func:`ltx_mgpu.assets.weights.init_tensor` of each key, in ``dtype``, contiguous; names
    starting with ``skip`` left out)."""
    out: dict[str, torch.Tensor] = {}
    for name, t in module.state_dict(keep_vars=True).items():
        if skip is not None and name.startswith(skip):
            continue
        key = prefix + name
        out[key] = init_tensor(key, t.shape, seed).to(dtype).contiguous()
    return out


def tiny_ltx_state_dict(
    version: Version,
    seed: int = 0,
    gemma_hidden: int = TINY_GEMMA_HIDDEN,
    gemma_hidden_states: int = TINY_GEMMA_HIDDEN_STATES,
) -> dict[str, torch.Tensor]:
    """Every tensor of the tiny monolith, keyed as in a real ComfyUI / ltx-core checkpoint.

    Transformer, connectors and projection are float32; ``vae.*`` (and, for 2.3, ``audio_vae.*`` /
    ``vocoder.*``) bfloat16. Modules are built by ltx-core's configurators under
    ``torch.device("meta")`` (nothing is allocated for ltx-core's hard-coded 12B feature-extractor
    width) and every tensor is drawn afresh.
    ``gemma_hidden`` / ``gemma_hidden_states`` size the text side (:func:`tiny_feature_extractor`,
    :func:`tiny_transformer_config`); a tensor whose shape does not depend on them has the same
    value whatever they are.

    Raises:
        ValueError: bad ``version`` or Gemma dims.
    """
    from ltx_core.model.transformer import LTXModelConfigurator
    from ltx_core.model.video_vae import VideoDecoderConfigurator, VideoEncoderConfigurator
    from ltx_core.text_encoders.gemma.encoders.encoder_configurator import EmbeddingsProcessorConfigurator

    version = check_version(version)
    config = tiny_ltx_config(version, gemma_hidden)
    with torch.device("meta"):
        transformer = LTXModelConfigurator.from_config(config)
        processor = EmbeddingsProcessorConfigurator.from_config(config)
        processor.feature_extractor = tiny_feature_extractor(version, gemma_hidden, gemma_hidden_states)
        encoder = VideoEncoderConfigurator.from_config(config)
        decoder = VideoDecoderConfigurator.from_config(config)

    dit, f32 = "model.diffusion_model.", torch.float32
    sd: dict[str, torch.Tensor] = {}
    sd.update(materialise(transformer, dit, seed, f32))
    # Inverse of ltx-core's EMBEDDINGS_PROCESSOR_KEY_OPS.
    sd.update(materialise(processor.video_connector, dit + "video_embeddings_connector.", seed, f32))
    sd.update(materialise(processor.audio_connector, dit + "audio_embeddings_connector.", seed, f32))
    sd.update(materialise(processor.feature_extractor, "text_embedding_projection.", seed, f32))
    # Inverse of VAE_{ENCODER,DECODER}_COMFY_KEYS_FILTER: one shared per_channel_statistics.
    for part, module in (("encoder", encoder), ("decoder", decoder)):
        sd.update(materialise(module, f"vae.{part}.", seed, torch.bfloat16, skip="per_channel_statistics."))
    sd.update(materialise(encoder.per_channel_statistics, "vae.per_channel_statistics.", seed, torch.bfloat16))
    if version == "2.3":
        sd.update(tiny_audio_state_dict(seed))
    return sd


def build_tiny_ltx_checkpoint(
    out_path: str | os.PathLike,
    version: Version,
    seed: int = 0,
    gemma_hidden: int = TINY_GEMMA_HIDDEN,
    gemma_hidden_states: int = TINY_GEMMA_HIDDEN_STATES,
) -> None:
    """Write the tiny LTX-2 monolith to ``out_path`` (atomically: temp file + rename).

    Same ``(version, seed)`` -> byte-identical file (about 3 MB; 6.6 MB for 2.3, with its audio
    VAE). Metadata: ``config`` (JSON string of :func:`tiny_ltx_config`) and ``model_version``
    (``"2.0.0"`` / ``"2.3.0"``), the two keys ltx-core 1.0.0 and ComfyUI read. ``gemma_hidden`` /
    ``gemma_hidden_states`` size ``text_embedding_projection`` (and, for 2.0, the connectors) for
    another Gemma than the tiny one, e.g. 640 / 19 for the real Gemma 3 270M
    (``assets.tiny_ltx_checkpoint_gemma270m``); the defaults give the tiny Gemma's file, unchanged.

    Raises:
        ValueError: ``version`` is not ``"2.0"`` or ``"2.3"``; Gemma dims as :func:`tiny_feature_extractor`.
        OSError: the parent directory of ``out_path`` does not exist or is not writable.
    """
    version = check_version(version)
    out_path = Path(out_path)
    sd = tiny_ltx_state_dict(version, seed, gemma_hidden, gemma_hidden_states)
    metadata = {
        "config": json.dumps(tiny_ltx_config(version, gemma_hidden), sort_keys=True),
        "model_version": MODEL_VERSIONS[version],
    }
    data = _sort_metadata(save_to_bytes(sd, metadata=metadata))
    write_atomically(out_path, data)


def _sort_metadata(data: bytes) -> bytes:
    """``data`` (a safetensors file) with its ``__metadata__`` entries in sorted key order.

    safetensors writes ``__metadata__`` from a Rust ``HashMap``, whose order changes from run to
    run; the tensor entries are already in a fixed order. Reordering keeps the header's length, so
    the header (space-padded, as safetensors pads it) is replaced in place.
    """
    n = int.from_bytes(data[:8], "little")
    header = json.loads(data[8 : 8 + n])
    header["__metadata__"] = dict(sorted(header["__metadata__"].items()))
    ordered = {"__metadata__": header.pop("__metadata__"), **header}
    text = json.dumps(ordered, separators=(",", ":")).encode()
    if len(text) > n:  # cannot happen for a pure reordering; refuse rather than corrupt
        raise RuntimeError(f"safetensors header grew from {n} to {len(text)} bytes while sorting metadata")
    return data[:8] + text.ljust(n, b" ") + data[8 + n :]

