"""The audio-decode path of ``python -m ltx_mgpu generate``, end to end, on the embedded tiny
LTX-2.3 checkpoint (its tiny audio VAE + 24 kHz vocoder, :mod:`ltx_mgpu.assets.audio`).

ltx-core's audio VAE package imports torchaudio, which the dev venv does not have (no PyPI build
loads beside its CPU torch); ``ltx_mgpu.assets.audio.ltx_core_audio_vae`` imports it without, since
decoding never calls torchaudio. These tests run in any environment, with or without torchaudio
(ComfyUI's has it: ``/path/to/comfy-venv/bin/python -m pytest tests/integration/test_generate_audio.py``).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
FRAMES, FPS = 25, 25


def test_audio_shapes_match_ltx_core_configurators():
    """The hand-derived key -> shape table equals ltx-core's own modules built from the config."""
    from ltx_mgpu.assets.audio import TINY_AUDIO_OUTPUT_RATE, ltx_core_audio_vae, tiny_audio_config, tiny_audio_shapes

    audio_vae = ltx_core_audio_vae()
    config = tiny_audio_config()
    with torch.device("meta"):
        decoder = audio_vae.AudioDecoderConfigurator.from_config(config)
        vocoder = audio_vae.VocoderConfigurator.from_config(config)
    built = {}
    for name, t in decoder.state_dict().items():
        key = name.replace("per_channel_statistics.", "audio_vae.per_channel_statistics.", 1) \
            if name.startswith("per_channel_statistics.") else "audio_vae.decoder." + name
        built[key] = tuple(t.shape)
    built.update({"vocoder." + k: tuple(t.shape) for k, t in vocoder.state_dict().items()})
    assert tiny_audio_shapes() == built
    assert vocoder.output_sampling_rate == TINY_AUDIO_OUTPUT_RATE >= 16000


def test_generate_writes_video_and_aac_audio(tmp_path):
    av = pytest.importorskip("av")
    out = tmp_path / "av.mp4"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "LTX_MGPU_HOME": str(tmp_path / "home")}
    proc = subprocess.run(
        [sys.executable, "-m", "ltx_mgpu", "generate", "--prompt", "A red fox", "--gpus", "2", "--steps", "2",
         "--embedded-gemma", "tiny", "--out", str(out)],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=600,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    log = proc.stdout + proc.stderr
    assert "with audio: AAC 24 kHz stereo" in proc.stdout and "video only" not in log, log[-3000:]

    with av.open(str(out)) as container:
        video = [s for s in container.streams if s.type == "video"]
        audio = [s for s in container.streams if s.type == "audio"]
        assert len(video) == 1 and len(audio) == 1
        assert video[0].frames == FRAMES
        a = audio[0]
        assert a.codec_context.name == "aac"
        assert a.rate == 24000 and a.channels == 2
        samples, peak = 0, 0.0
        for frame in container.decode(a):
            data = torch.from_numpy(frame.to_ndarray())
            assert torch.isfinite(data).all()
            samples += frame.samples
            peak = max(peak, float(data.abs().max()))
    # 25 audio latents -> 4 * 25 - 3 = 97 mel frames x 240 samples = 23280 samples (0.97 s) from the
    # vocoder; AAC adds up to two 1024-sample frames of priming / padding.
    decoded = 97 * 240
    assert decoded <= samples <= decoded + 2 * 1024, samples
    assert abs(samples / a.rate - FRAMES / FPS) < 0.1
    assert 0.0 < peak <= 1.0, "the track is silent or clipped"


def test_the_audio_package_imports_without_torchaudio_and_its_encoder_says_what_it_needs(tiny_ltx_23):
    """Where torchaudio is missing (or does not load), ltx-core's audio VAE package still imports,
    decoding runs, torchaudio stays absent for every other library, and the one part that needs it
    (``AudioProcessor``, the encoder's mel spectrogram) says so by name. Run in a fresh interpreter
    with torchaudio hidden, so the result does not depend on this environment."""
    script = """
import importlib.abc, importlib.util, sys, torch
class Hide(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name == "torchaudio" or name.startswith("torchaudio."):
            raise ImportError("hidden by the test")
sys.meta_path.insert(0, Hide())
from ltx_mgpu.assets.audio import ltx_core_audio_vae
from ltx_mgpu.cli.decode import decode_audio
waveform, rate = decode_audio(torch.zeros(1, 8, 5, 16), sys.argv[1])
assert rate == 24000 and waveform.shape == (2, (4 * 5 - 3) * 240) and torch.isfinite(waveform).all()
assert "torchaudio" not in sys.modules
try:
    ltx_core_audio_vae().AudioProcessor(16000, 64, 160, 1024)
except ModuleNotFoundError as e:
    print("refused:", e)
"""
    proc = subprocess.run([sys.executable, "-c", script, str(tiny_ltx_23)],
                          cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.startswith("refused: torchaudio.transforms: ltx-core's audio encoder (AudioProcessor: "
                                  "resampling, mel spectrogram) needs torchaudio"), proc.stdout
