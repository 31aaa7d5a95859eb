"""The audio-decode path of ``python -m ltx_mgpu generate``, end to end, on the embedded tiny
LTX-2.3 checkpoint (its tiny audio VAE + 24 kHz vocoder, :mod:`ltx_mgpu.assets.audio`).

ltx-core's audio VAE imports torchaudio, which the dev venv must not have; these tests run where it
is installed, e.g. ComfyUI's environment of "Testing against a real ComfyUI" in docs/testing.md:
``~/comfy-venv/bin/python -m pytest tests/integration/test_generate_audio.py``.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("torchaudio") is None,
    reason="torchaudio is not installed: ltx-core's audio VAE (ltx_core.model.audio_vae) imports it; "
    "run with a Python that has torchaudio (docs/testing.md: 'Testing against a real ComfyUI' sets one up)",
)

ROOT = Path(__file__).resolve().parents[2]
FRAMES, FPS = 25, 25


def test_audio_shapes_match_ltx_core_configurators():
    """The hand-derived key -> shape table equals ltx-core's own modules built from the config."""
    from ltx_core.model.audio_vae import AudioDecoderConfigurator, VocoderConfigurator

    from ltx_mgpu.assets.audio import TINY_AUDIO_OUTPUT_RATE, tiny_audio_config, tiny_audio_shapes

    config = tiny_audio_config()
    with torch.device("meta"):
        decoder = AudioDecoderConfigurator.from_config(config)
        vocoder = VocoderConfigurator.from_config(config)
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
         "--out", str(out)],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=600,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    log = proc.stdout + proc.stderr
    assert "with audio" in log and "video only" not in log, log[-3000:]

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
