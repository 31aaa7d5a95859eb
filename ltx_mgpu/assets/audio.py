"""The tiny audio VAE decoder + vocoder of the tiny LTX-2.3 monolith (:mod:`ltx_mgpu.assets.ltx`).

The real LTX-2 monolith checkpoints carry ``audio_vae.*`` and ``vocoder.*`` next to the
transformer and the video VAE; so does the tiny LTX-2.3 file, at toy sizes, so that
``python -m ltx_mgpu generate`` can decode its audio latent and write it into the MP4:

* ``audio_vae.decoder.*`` + ``audio_vae.per_channel_statistics.*``: ltx-core's ``AudioDecoder``
  (``AudioDecoderConfigurator``): ``ch`` 128 (it must be 128: the decoder's per-channel
  statistics act on the patchified latent, 8 channels x 16 bins), ``ch_mult`` (1, 1, 1), no
  extra res blocks, no attention, pixel norm, causal on the time axis. So a latent
  ``[B, 8, N, 16]`` decodes to a stereo mel spectrogram ``[B, 2, 4N - 3, 64]`` at 16 kHz / hop
  160 (100 mel frames per second), the production geometry. About 1.8 M parameters, bfloat16.
* ``vocoder.*``: ltx-core's plain (pre-BWE) ``Vocoder`` (``resblock`` "1", stereo), width 16,
  upsample rates 8 x 6 x 5 = 240 samples per mel frame -> **24 kHz** stereo output (a rate AAC
  accepts), as the production LTX-2 vocoder. bfloat16.
* ``__metadata__`` ``config`` gains ``"audio_vae"`` and ``"vocoder"`` sections, in the shapes
  ltx-core's configurators read.

Why the state dict is computed here, not by building the modules: every submodule of
``ltx_core.model.audio_vae`` runs that package's ``__init__``, which imports torchaudio at module
level, and the generators must not depend on how that import is got past (:func:`ltx_core_audio_vae`,
for the decode path and the ComfyUI install's audio encoder). So :func:`tiny_audio_shapes` derives
the key -> shape table from the config
with the same rules ltx-core 1.0.0's ``AudioDecoder`` / ``Vocoder`` constructors follow;
``tests/integration/test_generate_audio.py`` checks it against ltx-core's configurators built on
the meta device, and the decode path's builder refuses weights that leave a parameter unset.

Every tensor is drawn by :func:`ltx_mgpu.assets.weights.init_tensor`, a pure function of
``(seed, key, shape)``, so adding these keys leaves every other tensor of the file unchanged.
"""

from __future__ import annotations

import importlib
import sys
import types

import torch

from ltx_mgpu.assets.weights import init_tensor

#: Audio latent geometry (must match the transformer's ``audio_in_channels`` = 8 x 16 = 128).
TINY_AUDIO_Z_CHANNELS = 8
TINY_AUDIO_MEL_BINS = 64
#: Audio VAE width. ltx-core's ``PerChannelStatistics(latent_channels=ch)`` normalises the
#: patchified latent (z_channels x mel_bins / 4 = 128 features), so ``ch`` must be 128.
TINY_AUDIO_VAE_CH = 128
TINY_AUDIO_VAE_CH_MULT = (1, 1, 1)
#: Vocoder: conv_pre 128 -> 16, three transposed-conv upsamples (x8, x6, x5 = 240 = 24000 / 100).
TINY_VOCODER_CHANNELS = 16
TINY_VOCODER_RATES = (8, 6, 5)
TINY_VOCODER_KERNELS = (16, 12, 11)
TINY_VOCODER_RESBLOCK_KERNELS = (3,)
TINY_VOCODER_DILATIONS = ((1, 3, 5),)
#: Output sample rate of the vocoder, Hz (production LTX-2: 24000; AAC needs >= 8 kHz, and
#: ComfyUI's SaveVideo failed on a 400 Hz track).
TINY_AUDIO_OUTPUT_RATE = 24000
TINY_AUDIO_INPUT_RATE = 16000
TINY_AUDIO_HOP = 160


def tiny_audio_config() -> dict:
    """The ``"audio_vae"`` and ``"vocoder"`` sections of the tiny LTX-2.3 ``config`` metadata.

    Read by ltx-core 1.0.0's ``AudioDecoderConfigurator`` (``audio_vae.model.params.ddconfig``,
    ``.sampling_rate``, ``audio_vae.preprocessing.stft``) and ``VocoderConfigurator`` (a flat
    ``vocoder`` section: the plain ``Vocoder``, whose ``check_config_value`` wants ``resblock``
    "1" and ``stereo`` true). A fresh dict on every call.
    """
    return {
        "audio_vae": {
            "model": {
                "params": {
                    "sampling_rate": TINY_AUDIO_INPUT_RATE,
                    "ddconfig": {
                        "ch": TINY_AUDIO_VAE_CH,
                        "out_ch": 2,
                        "ch_mult": list(TINY_AUDIO_VAE_CH_MULT),
                        "num_res_blocks": 0,
                        "attn_resolutions": [],
                        "resolution": 256,
                        "z_channels": TINY_AUDIO_Z_CHANNELS,
                        "double_z": True,
                        "in_channels": 2,
                        "norm_type": "pixel",
                        "causality_axis": "height",
                        "dropout": 0.0,
                        "mid_block_add_attention": False,
                        "mel_bins": TINY_AUDIO_MEL_BINS,
                    },
                }
            },
            "preprocessing": {
                "stft": {"filter_length": 1024, "hop_length": TINY_AUDIO_HOP, "causal": True},
                "mel": {"n_mel_channels": TINY_AUDIO_MEL_BINS},
            },
        },
        "vocoder": {
            "resblock": "1",
            "stereo": True,
            "resblock_kernel_sizes": list(TINY_VOCODER_RESBLOCK_KERNELS),
            "resblock_dilation_sizes": [list(d) for d in TINY_VOCODER_DILATIONS],
            "upsample_rates": list(TINY_VOCODER_RATES),
            "upsample_kernel_sizes": list(TINY_VOCODER_KERNELS),
            "upsample_initial_channel": TINY_VOCODER_CHANNELS,
            "output_sampling_rate": TINY_AUDIO_OUTPUT_RATE,
            "activation": "snake",
            "use_tanh_at_final": True,
            "use_bias_at_final": True,
        },
    }


def _conv(shapes: dict, key: str, c_out: int, c_in: int, *kernel: int) -> None:
    shapes[key + ".weight"] = (c_out, c_in, *kernel)
    shapes[key + ".bias"] = (c_out,)


def tiny_audio_shapes() -> dict[str, tuple[int, ...]]:
    """Checkpoint key -> shape of the tiny audio VAE decoder and vocoder (ComfyUI monolith keys).

    Mirrors ltx-core 1.0.0: ``AudioDecoder`` = ``conv_in`` (causal ``CausalConv2d``: ``.conv.``),
    ``mid.block_{1,2}`` (``ResnetBlock``: ``conv1`` / ``conv2``, no shortcut at equal widths),
    ``up.<level>.block.<i>`` and ``up.<level>.upsample.conv`` for levels > 0, ``conv_out``; pixel
    norms have no weights. The statistics live at ``audio_vae.per_channel_statistics.`` (ltx-core's
    ``AUDIO_VAE_DECODER_COMFY_KEYS_FILTER`` maps them in). ``Vocoder`` = ``conv_pre`` (128 in),
    ``ups.<i>`` (``ConvTranspose1d``: ``[in, out, k]``), ``resblocks.<level * kernels + j>``
    (``ResBlock1``: ``convs1.0-2`` / ``convs2.0-2``), ``conv_post`` (2 out).
    """
    shapes: dict[str, tuple[int, ...]] = {}
    ch = TINY_AUDIO_VAE_CH
    for stat in ("std-of-means", "mean-of-means"):
        shapes[f"audio_vae.per_channel_statistics.{stat}"] = (ch,)
    dec = "audio_vae.decoder."
    widths = [ch * m for m in TINY_AUDIO_VAE_CH_MULT]
    block_in = widths[-1]
    _conv(shapes, dec + "conv_in.conv", block_in, TINY_AUDIO_Z_CHANNELS, 3, 3)
    for mid in ("block_1", "block_2"):
        _conv(shapes, f"{dec}mid.{mid}.conv1.conv", block_in, block_in, 3, 3)
        _conv(shapes, f"{dec}mid.{mid}.conv2.conv", block_in, block_in, 3, 3)
    for level in reversed(range(len(widths))):
        block_out = widths[level]
        stage = f"{dec}up.{level}."
        _conv(shapes, stage + "block.0.conv1.conv", block_out, block_in, 3, 3)
        _conv(shapes, stage + "block.0.conv2.conv", block_out, block_out, 3, 3)
        if block_in != block_out:
            _conv(shapes, stage + "block.0.nin_shortcut.conv", block_out, block_in, 1, 1)
        block_in = block_out
        if level != 0:
            _conv(shapes, stage + "upsample.conv.conv", block_in, block_in, 3, 3)
    _conv(shapes, dec + "conv_out.conv", 2, block_in, 3, 3)

    c = TINY_VOCODER_CHANNELS
    _conv(shapes, "vocoder.conv_pre", c, 2 * TINY_AUDIO_MEL_BINS, 7)
    for i, k in enumerate(TINY_VOCODER_KERNELS):
        shapes[f"vocoder.ups.{i}.weight"] = (c >> i, c >> (i + 1), k)
        shapes[f"vocoder.ups.{i}.bias"] = (c >> (i + 1),)
    n_kernels = len(TINY_VOCODER_RESBLOCK_KERNELS)
    for i in range(len(TINY_VOCODER_RATES)):
        width = c >> (i + 1)
        for j, k in enumerate(TINY_VOCODER_RESBLOCK_KERNELS):
            for convs in ("convs1", "convs2"):
                for n in range(3):
                    _conv(shapes, f"vocoder.resblocks.{i * n_kernels + j}.{convs}.{n}", width, width, k)
    _conv(shapes, "vocoder.conv_post", 2, c >> len(TINY_VOCODER_RATES), 7)
    return shapes


def tiny_audio_state_dict(seed: int = 0) -> dict[str, torch.Tensor]:
    """The tiny audio VAE decoder + vocoder tensors (bfloat16), keyed as :func:`tiny_audio_shapes`.

    Each tensor is ``weights.init_tensor(key, shape, seed)``: conv weights ``N(0, 1/fan_in)``, biases
    ``N(0, 0.05^2)``, ``std-of-means`` ``U(0.5, 1.5)``, ``mean-of-means`` ``N(0, 0.1^2)``.
    """
    return {
        key: init_tensor(key, torch.Size(shape), seed).to(torch.bfloat16).contiguous()
        for key, shape in tiny_audio_shapes().items()
    }


class _TorchaudioMissing(types.ModuleType):
    """Stands in for torchaudio while ltx-core's audio VAE package is imported without it: any use
    (only ``AudioProcessor``, the audio encoder's resampling and mel spectrogram) raises."""

    def __getattr__(self, name: str):
        if name.startswith("__"):
            raise AttributeError(name)
        raise ModuleNotFoundError(f"torchaudio.{name}: ltx-core's audio encoder (AudioProcessor: resampling, mel "
                                  "spectrogram) needs torchaudio, which is not installed or does not load beside this "
                                  "torch; decoding audio does not need it")


def ltx_core_audio_vae() -> types.ModuleType:
    """``ltx_core.model.audio_vae``, imported even where torchaudio is missing or does not load.

    ltx-core 1.0.0 uses torchaudio in one module, ``audio_vae/ops.py``, which imports it at module
    level for ``AudioProcessor`` (``torchaudio.transforms.MelSpectrogram`` and
    ``torchaudio.functional.resample``, the audio *encoder*'s input). The decoder path
    (``AudioDecoder``, ``Vocoder``, ``VocoderWithBWE`` with its own ``MelSTFT``, ``decode_audio``)
    never touches it. When ``import torchaudio`` fails, the package is imported with a placeholder
    in ``sys.modules["torchaudio"]`` for the duration of that import only (removed afterwards, so
    other libraries still see torchaudio as absent); ``ops.py`` keeps the placeholder, whose every
    attribute raises a ``ModuleNotFoundError`` naming torchaudio. With torchaudio importable this is
    a plain import.
    """
    name = "ltx_core.model.audio_vae"
    if name in sys.modules:
        return sys.modules[name]
    try:
        import torchaudio  # noqa: F401 - deferred: optional, and heavy when present
    except (ImportError, OSError):  # OSError: a wheel whose C++ extension does not fit this torch
        for partial in [m for m in sys.modules if m == "torchaudio" or m.startswith("torchaudio.")]:
            del sys.modules[partial]
        placeholder = _TorchaudioMissing("torchaudio")
        sys.modules["torchaudio"] = placeholder
        try:
            return importlib.import_module(name)
        finally:
            if sys.modules.get("torchaudio") is placeholder:
                del sys.modules["torchaudio"]
    return importlib.import_module(name)
