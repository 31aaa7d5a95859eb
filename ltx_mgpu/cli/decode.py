"""LTX-2 latents -> media: the audio latent geometry, ltx-core's video (and audio) VAE decoders
read from a checkpoint's ``vae.*`` (``audio_vae.*`` + ``vocoder.*``), an MP4 writer (PyAV) and
the latents file. Used by ``python -m ltx_mgpu generate`` in its own process (decoding is not
multi-GPU work).

* Video: ltx-core 1.0.0's ``VideoDecoderConfigurator`` + ``VAE_DECODER_COMFY_KEYS_FILTER`` build
  the decoder from a ComfyUI-layout checkpoint (``vae.decoder.*``, ``vae.per_channel_statistics.*``,
  ``config`` metadata with a ``"vae"`` section); ``ltx_core.model.video_vae.decode_video`` turns
  a latent ``[1, 128, F', H', W']`` into uint8 frames ``[8(F'-1)+1, 32H', 32W', 3]``, tiled when
  the video is larger than one of ltx-core's default tiles.
* Audio: ltx-core's ``AudioDecoderConfigurator`` / ``VocoderConfigurator`` and ``decode_audio``,
  when the checkpoint holds ``audio_vae.decoder.*`` and ``vocoder.*`` (:func:`audio_decode_unavailable`
  says why not otherwise). ``ltx_core.model.audio_vae`` imports torchaudio at module level, for
  its audio *encoder* only; decoding never calls it, so ``assets.audio.ltx_core_audio_vae`` imports the
  package without torchaudio where it is missing or does not load (PyPI's torchaudio wheels are
  CUDA builds pinned to one torch release: none loads beside the CPU torch of
  ``scripts/bootstrap.sh``).
* MP4: H.264 (libx264, yuv420p: even sizes, which multiples of 32 are), or MPEG-4 Part 2 when
  this FFmpeg build has no H.264 encoder; AAC audio when there is audio. Written to a temporary
  file in the target directory and renamed into place.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import tempfile
from collections.abc import Iterator, Mapping
from fractions import Fraction
from pathlib import Path

import torch
from safetensors.torch import save as _st_save

from ltx_mgpu.assets.audio import ltx_core_audio_vae
from ltx_mgpu.files import safetensors_header, umask_mode, write_atomically

__all__ = [
    "AudioGeometry",
    "MediaError",
    "Mp4Writer",
    "VaeSource",
    "audio_decode_unavailable",
    "audio_geometry",
    "decode_audio",
    "decode_video",
    "inspect_vae_source",
    "load_video_decoder",
    "num_audio_latents",
    "save_latents",
    "video_codec",
]

#: The audio VAE's time downsampling (mel frames per latent) in LTX-2. Source: ComfyUI
#: ``comfy/ldm/lightricks/vae/audio_vae.py`` (``LATENT_DOWNSAMPLE_FACTOR``), ltx-core
#: ``AudioLatentShape.from_duration`` (``audio_latent_downsample_factor=4``).
AUDIO_LATENT_DOWNSAMPLE = 4
#: Video encoders tried in order (PyAV / FFmpeg names).
VIDEO_CODECS = ("libx264", "h264", "mpeg4")


class MediaError(ValueError):
    """A checkpoint that cannot be decoded, or an output that cannot be written; says what to fix."""


# --------------------------------------------------------------------------- the source file


@dataclasses.dataclass(frozen=True)
class VaeSource:
    """What a checkpoint's header says about its VAEs (no tensor is read).

    Attributes:
        path: the file.
        config: its parsed ``config`` metadata (``{}`` when absent).
        has_video: ``vae.decoder.*`` and ``vae.per_channel_statistics.*`` present, and a
            ``"vae"`` config section.
        has_audio: ``audio_vae.decoder.*`` and ``vocoder.*`` present, and ``"audio_vae"`` and
            ``"vocoder"`` config sections (what ltx-core's configurators and ComfyUI read).
    """

    path: str
    config: dict
    has_video: bool
    has_audio: bool


def inspect_vae_source(path: str | os.PathLike) -> VaeSource:
    """Read a checkpoint's header for its video / audio VAE.

    Raises:
        FileNotFoundError: no such file. MediaError: not a safetensors file, or unreadable
        ``config`` metadata.
    """
    path = os.fspath(path)
    if not os.path.isfile(path):
        raise FileNotFoundError(f"no checkpoint at {path}")
    keys, meta = safetensors_header(path, MediaError)
    try:
        config = json.loads(meta["config"]) if "config" in meta else {}
    except json.JSONDecodeError as e:
        raise MediaError(f"{path}: its 'config' metadata is not JSON ({e})") from None
    if not isinstance(config, dict):
        raise MediaError(f"{path}: its 'config' metadata is not a JSON object")

    def has(prefix: str) -> bool:
        return any(k.startswith(prefix) for k in keys)

    has_video = has("vae.decoder.") and has("vae.per_channel_statistics.") and "vae" in config
    has_audio = has("audio_vae.decoder.") and has("vocoder.") and "audio_vae" in config and "vocoder" in config
    return VaeSource(path, config, has_video, has_audio)


# --------------------------------------------------------------------------- audio geometry


@dataclasses.dataclass(frozen=True)
class AudioGeometry:
    """The LTX-2 audio latent layout ``[B, channels, N, freq_bins]``.

    Attributes:
        channels: latent channels (``z_channels``, 8 in LTX-2).
        freq_bins: mel bins / 4 (64 / 4 = 16 in LTX-2).
        sample_rate: the audio VAE's input rate, Hz (16000); hop_length: mel hop, samples (160).
    """

    channels: int = 8
    freq_bins: int = 16
    sample_rate: int = 16000
    hop_length: int = 160

    @property
    def latents_per_second(self) -> float:
        """``sample_rate / hop_length / 4`` (25 for LTX-2)."""
        return self.sample_rate / self.hop_length / AUDIO_LATENT_DOWNSAMPLE


def audio_geometry(config: Mapping) -> AudioGeometry:
    """The audio latent geometry from a checkpoint's ``config`` metadata, read where ltx-core's
    ``AudioDecoderConfigurator`` reads it (``audio_vae.model.params.ddconfig.z_channels`` /
    ``mel_bins``, ``audio_vae.model.params.sampling_rate``, ``audio_vae.preprocessing.stft.hop_length``),
    with LTX-2's values (8, 64 mel bins, 16 kHz, hop 160) for whatever is missing (a checkpoint
    without an audio VAE, like the tiny ones)."""
    vae = config.get("audio_vae") or {}
    params = (vae.get("model") or {}).get("params") or {}
    dd = params.get("ddconfig") or {}
    pre = vae.get("preprocessing") or {}
    mel_bins = dd.get("mel_bins") or (pre.get("mel") or {}).get("n_mel_channels") or \
        (vae.get("variables") or {}).get("mel_bins") or 64
    return AudioGeometry(channels=int(dd.get("z_channels", 8)), freq_bins=int(mel_bins) // AUDIO_LATENT_DOWNSAMPLE,
                         sample_rate=int(params.get("sampling_rate", 16000)),
                         hop_length=int((pre.get("stft") or {}).get("hop_length", 160)))


def num_audio_latents(frames: int, fps: float, geometry: AudioGeometry = AudioGeometry()) -> int:
    """Audio latents for ``frames`` video frames at ``fps``: ``ceil(frames / fps * latents_per_second)``.

    Source: ComfyUI ``LTXVEmptyLatentAudio`` -> ``AudioVAE.num_of_latents_from_frames`` (``ceil``;
    ltx-core's ``AudioLatentShape.from_duration`` rounds instead; they differ at some frame rates,
    e.g. 121 frames at 24 fps: 127 here, 126 there). 25 frames at 25 fps -> 25.
    """
    return math.ceil(float(frames) / float(fps) * geometry.latents_per_second)


# --------------------------------------------------------------------------- decoders


def _check_built(model: torch.nn.Module, what: str, path: str) -> torch.nn.Module:
    meta = [n for n, t in [*model.named_parameters(), *model.named_buffers()] if t.device.type == "meta"]
    if meta:
        raise MediaError(f"{path}: its {what} weights do not fit its config (missing {meta[:3]}); use a checkpoint "
                         "with matching 'config' metadata")
    return model.eval()


def load_video_decoder(path: str | os.PathLike, device: torch.device | str = "cpu",
                       dtype: torch.dtype = torch.float32) -> torch.nn.Module:
    """ltx-core's ``VideoDecoder`` from a checkpoint's ``vae.*`` (the ComfyUI monolith layout).

    Raises:
        MediaError: no video VAE in the file, or weights that do not fit its config.
    """
    from ltx_core.loader.single_gpu_model_builder import SingleGPUModelBuilder
    from ltx_core.model.video_vae import VAE_DECODER_COMFY_KEYS_FILTER, VideoDecoderConfigurator

    source = inspect_vae_source(path)
    if not source.has_video:
        raise MediaError(f"{source.path} holds no LTX-2 video VAE (vae.decoder.*, vae.per_channel_statistics.* and a "
                         "'vae' config); pass --vae with an LTX-2 monolith checkpoint")
    builder = SingleGPUModelBuilder(VideoDecoderConfigurator, source.path, VAE_DECODER_COMFY_KEYS_FILTER)
    return _check_built(builder.build(device=torch.device(device), dtype=dtype), "video VAE", source.path)


def _tiling_for(latent: torch.Tensor):
    """ltx-core's default tiling when the video exceeds one default tile (512 px, 64 frames), else None."""
    from ltx_core.model.video_vae import TilingConfig

    tiling = TilingConfig.default()
    frames = 8 * (latent.shape[2] - 1) + 1
    height, width = 32 * latent.shape[3], 32 * latent.shape[4]
    size = tiling.spatial_config.tile_size_in_pixels
    if max(height, width) <= size and frames <= tiling.temporal_config.tile_size_in_frames:
        return None
    return tiling


def decode_video(latent: torch.Tensor, decoder: torch.nn.Module, seed: int = 0) -> Iterator[torch.Tensor]:
    """Decode a video latent ``[1, 128, F', H', W']`` into uint8 RGB frame chunks ``[f, H, W, 3]``
    (``8(F'-1)+1`` frames in total, ``H = 32H'``, ``W = 32W'``), in time order.

    ltx-core's ``decode_video``: ``(x + 1) / 2`` clamped to [0, 1], times 255; tiled with its
    default tiling for videos larger than one tile. ``seed`` drives the decoder's noise
    injection when its config has any.
    """
    from ltx_core.model.video_vae import decode_video as ltx_decode_video

    param = next(decoder.parameters())
    latent = latent.to(device=param.device, dtype=param.dtype)
    generator = torch.Generator(device=param.device).manual_seed(int(seed))
    with torch.inference_mode():
        for chunk in ltx_decode_video(latent, decoder, _tiling_for(latent), generator=generator):
            yield chunk.cpu()


def audio_decode_unavailable(source: VaeSource) -> str | None:
    """Why the audio of ``source`` cannot be decoded here, or None when it can."""
    if not source.has_audio:
        return (f"{Path(source.path).name} has no audio VAE (audio_vae.decoder.* + vocoder.* and their "
                "'audio_vae' / 'vocoder' config)")
    return None


def decode_audio(latent: torch.Tensor, path: str | os.PathLike, device: torch.device | str = "cpu",
                 dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, int]:
    """Decode an audio latent ``[1, 8, N, 16]`` with the checkpoint's audio VAE and vocoder.

    Returns:
        ``(waveform float32 [channels, samples] on CPU, sample rate in Hz)`` (ltx-core's
        ``decode_audio``).
    Raises:
        MediaError: see :func:`audio_decode_unavailable`, or weights that do not fit the config.
    """
    source = inspect_vae_source(path)
    reason = audio_decode_unavailable(source)
    if reason is not None:
        raise MediaError(f"cannot decode audio: {reason}")
    from ltx_core.loader.single_gpu_model_builder import SingleGPUModelBuilder

    audio_vae = ltx_core_audio_vae()
    device = torch.device(device)
    decoder = _check_built(SingleGPUModelBuilder(audio_vae.AudioDecoderConfigurator, source.path,
                                                 audio_vae.AUDIO_VAE_DECODER_COMFY_KEYS_FILTER
                                                 ).build(device=device, dtype=dtype),
                           "audio VAE", source.path)
    vocoder = _check_built(SingleGPUModelBuilder(audio_vae.VocoderConfigurator, source.path,
                                                 audio_vae.VOCODER_COMFY_KEYS_FILTER).build(device=device, dtype=dtype),
                           "vocoder", source.path)
    with torch.inference_mode():
        audio = audio_vae.decode_audio(latent.to(device=device, dtype=dtype), decoder, vocoder)
    waveform = audio.waveform.float().cpu()
    if waveform.ndim == 1:
        waveform = waveform.unsqueeze(0)
    return waveform.reshape(-1, waveform.shape[-1]), int(audio.sampling_rate)


# --------------------------------------------------------------------------- MP4


def video_codec() -> str:
    """The first video encoder this PyAV / FFmpeg build has among :data:`VIDEO_CODECS`.

    Raises:
        MediaError: none of them (install an FFmpeg build with libx264, e.g. PyAV's wheels).
    """
    import av

    for name in VIDEO_CODECS:
        try:
            av.codec.Codec(name, "w")
            return name
        except Exception:  # noqa: BLE001 - PyAV raises UnknownCodecError / ValueError by version
            continue
    raise MediaError(f"this PyAV/FFmpeg build has none of the video encoders {list(VIDEO_CODECS)}; "
                     "pip install av (its wheels bundle libx264)")


class Mp4Writer:
    """Write RGB frames (and optionally audio) to an MP4, atomically.

    Use as a context manager: frames go to a temporary file beside ``path``, which replaces
    ``path`` only when the block exits without an error (otherwise it is deleted).

    Args:
        path: the ``.mp4`` to create (its directory must exist).
        width, height: frame size in pixels (even: yuv420p).
        fps: frames per second (a float; stored as a fraction, e.g. 23.976 -> 24000/1001).
        audio_rate, audio_channels: sample rate (Hz) and channel count (1 or 2) of the audio
            to add with :meth:`write_audio`, or None for video only.
    Raises:
        MediaError: odd sizes, more than 2 audio channels, no video encoder.
    """

    def __init__(self, path: str | os.PathLike, width: int, height: int, fps: float,
                 audio_rate: int | None = None, audio_channels: int | None = None):
        import av

        if width % 2 or height % 2 or width < 2 or height < 2:
            raise MediaError(f"MP4 (yuv420p) needs even, positive sizes; got {width}x{height}")
        if audio_rate is not None and audio_channels not in (1, 2):
            raise MediaError(f"audio must be mono or stereo, got {audio_channels} channels")
        self.path = Path(path)
        fd, tmp = tempfile.mkstemp(prefix=f".{self.path.name}.", suffix=".mp4", dir=self.path.parent)
        os.fchmod(fd, umask_mode())  # mkstemp makes 0600; an output file gets the usual mode
        os.close(fd)
        self._tmp = Path(tmp)
        self.codec = video_codec()
        self.frames = 0
        try:
            self._container = av.open(str(self._tmp), mode="w", format="mp4")
            self._video = self._container.add_stream(self.codec, rate=Fraction(fps).limit_denominator(1001))
            self._video.width, self._video.height, self._video.pix_fmt = width, height, "yuv420p"
            if self.codec != "mpeg4":
                self._video.options = {"crf": "18"}
            else:
                self._video.bit_rate = 8_000_000
            self._audio = None
            if audio_rate is not None:
                self._audio = self._container.add_stream("aac", rate=int(audio_rate))
                self._audio.layout = "stereo" if audio_channels == 2 else "mono"
        except BaseException:
            self._tmp.unlink(missing_ok=True)
            raise

    def write_frames(self, frames: torch.Tensor) -> None:
        """Append uint8 RGB frames ``[f, H, W, 3]``."""
        import av

        for frame in frames.cpu().numpy():
            for packet in self._video.encode(av.VideoFrame.from_ndarray(frame, format="rgb24")):
                self._container.mux(packet)
            self.frames += 1

    def write_audio(self, waveform: torch.Tensor, sample_rate: int) -> None:
        """Add the whole audio track: float ``[channels, samples]`` in [-1, 1] at ``sample_rate``."""
        import av

        if self._audio is None:
            raise MediaError("this writer was opened without audio (pass audio_rate / audio_channels)")
        data = waveform.detach().float().clamp(-1, 1).contiguous().cpu().numpy()
        frame = av.AudioFrame.from_ndarray(data, format="fltp", layout=self._audio.layout.name)
        frame.sample_rate = int(sample_rate)
        for packet in self._audio.encode(frame):
            self._container.mux(packet)

    def __enter__(self) -> Mp4Writer:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        try:
            if exc_type is None:
                for stream in (self._video, self._audio):
                    if stream is not None:
                        for packet in stream.encode(None):
                            self._container.mux(packet)
            self._container.close()
            if exc_type is None:
                os.replace(self._tmp, self.path)
        finally:
            self._tmp.unlink(missing_ok=True)


# --------------------------------------------------------------------------- latents


def save_latents(path: str | os.PathLike, tensors: Mapping[str, torch.Tensor], metadata: Mapping[str, object]) -> Path:
    """Write named latents (``"video"`` ``[1, 128, F', H', W']``, ``"audio"`` ``[1, 8, N, 16]``)
    as a safetensors file, atomically (temp file + rename). ``metadata`` values are stored as
    strings (JSON for non-strings). Nothing in it is ever unpickled: load it with
    ``safetensors.torch.load_file``."""
    path = Path(path)
    data = _st_save({k: v.detach().contiguous().cpu() for k, v in tensors.items()},
                    metadata={k: v if isinstance(v, str) else json.dumps(v) for k, v in metadata.items()})
    return write_atomically(path, data, mode=umask_mode())
