"""``python -m ltx_mgpu generate`` end to end on the embedded default through a real pool of 2 CPU
ranks: a decodable MP4 with the requested frame count and size plus the latents file; a second
run served from the embedding cache never loads Gemma (the pool holds only the transformer) and
gives the same latents; bad ``--gpus`` / frames / sizes fail with the fix named before any pool
starts. Also the pieces on their own: the empty audio-video latent (ComfyUI's audio-latent
count), the MP4 writer with an audio track, and the tiny checkpoint sized for the real Gemma 3
270M."""

from __future__ import annotations

import math

import av
import pytest
import torch
from pool_support import cleanup, short_dir
from safetensors import safe_open
from safetensors.torch import load_file

from ltx_mgpu.cli.decode import AudioGeometry, Mp4Writer, audio_geometry, inspect_vae_source, num_audio_latents
from ltx_mgpu.cli.main import main
from ltx_mgpu.cli.pipeline import GenerateCancelled, generate
from ltx_mgpu.cli.request import GenerateRequest, empty_av_latent
from ltx_mgpu.client.pool_client import PoolClient

FRAMES, HEIGHT, WIDTH, STEPS = 17, 64, 96, 2
PROMPT = "A red fox running through fresh snow at dawn"


@pytest.fixture(scope="module")
def runtime():
    base = short_dir()
    yield base
    cleanup(base)


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    return tmp_path_factory.mktemp("embedding-cache")


def _generate(capsys, out, runtime, cache, *extra: str) -> tuple[int, str, str]:
    argv = ["generate", "--prompt", PROMPT, "--gpus", "2",
            "--frames", str(FRAMES), "--height", str(HEIGHT), "--width", str(WIDTH), "--steps", str(STEPS),
            "--seed", "7", "--out", str(out), "--runtime-dir", str(runtime), "--cache", str(cache), *extra]
    rc = main(argv)
    captured = capsys.readouterr()
    return rc, captured.out, captured.err


def _video_frames(path) -> tuple[int, int, int]:
    with av.open(str(path)) as f:
        stream = f.streams.video[0]
        frames = [fr for fr in f.decode(stream)]
    return len(frames), frames[0].width, frames[0].height


def test_generate_writes_the_video_and_a_second_run_is_served_by_the_cache(tmp_path, runtime, cache, capsys):
    rc, out, err = _generate(capsys, tmp_path / "fox.mp4", runtime, cache)
    assert rc == 0, err
    assert "output is noise" in err  # the embedded default says so
    assert "denoise" in err and f"{STEPS}/{STEPS}" in err  # the per-step bar, fed by the pool
    assert _video_frames(tmp_path / "fox.mp4") == (FRAMES, WIDTH, HEIGHT)
    with av.open(str(tmp_path / "fox.mp4")) as f:  # the set-up's venv has no torchaudio, and the file has sound
        (audio,) = f.streams.audio
        assert (audio.codec_context.name, audio.rate, audio.channels) == ("aac", 24000, 2)
    assert "with audio: AAC 24 kHz stereo" in out and "video only" not in out + err
    first = load_file(tmp_path / "fox.latents.safetensors")
    n_audio = math.ceil(FRAMES / 25 * 25)
    assert first["video"].shape == (1, 128, (FRAMES - 1) // 8 + 1, HEIGHT // 32, WIDTH // 32)
    assert first["audio"].shape == (1, 8, n_audio, 16)
    assert first["video"].abs().max() > 0.1  # denoised, not the empty latent
    with safe_open(tmp_path / "fox.latents.safetensors", "pt") as f:
        assert f.metadata()["seed"] == "7" and f.metadata()["steps"] == str(STEPS)
    assert f"tokens: video {3 * 2 * 3}, audio {n_audio}" in out
    assert f"{STEPS} steps" in out and "world size 2 (cpu ranks)" in out
    assert "prompts: 2 (prompt + negative), cache hits 0, encoded 2; text encoder loaded" in out
    assert "started for this run and stopped" in out

    rc, out, err = _generate(capsys, tmp_path / "again.mp4", runtime, cache)
    assert rc == 0, err
    assert "prompts: 2 (prompt + negative), cache hits 2, encoded 0; text encoder not loaded" in out
    assert "(models loaded when sampling ended: ltx)\n" in out  # the pool's own view: no text_encoder
    assert "load Gemma" not in err and "encode" not in err.replace("encoded", "")
    assert _video_frames(tmp_path / "again.mp4") == (FRAMES, WIDTH, HEIGHT)
    second = load_file(tmp_path / "again.latents.safetensors")
    assert all(torch.equal(first[k], second[k]) for k in ("video", "audio"))  # same conditioning from the cache


def test_stop_mid_denoise_writes_nothing_and_the_attached_pool_keeps_serving(tmp_path, cache):
    runtime = short_dir()
    pool = PoolClient.connect(gpus="cpu", nproc=2, runtime_dir=runtime, startup_timeout=120)
    try:
        steps = []
        req = GenerateRequest(prompt=PROMPT, gpus=2, frames=FRAMES, height=HEIGHT, width=WIDTH, steps=400, seed=7,
                              out=str(tmp_path / "stopped.mp4"), runtime_dir=str(runtime), cache_dir=str(cache))
        with pytest.raises(GenerateCancelled, match="stopped at its next step boundary"):
            generate(req, on_progress=lambda phase, step, total: steps.append(step) if phase == "denoise" else None,
                     notify=lambda message: None, should_cancel=lambda: bool(steps))
        assert 1 <= max(steps) < 400  # stopped early, at a step boundary
        assert not any(tmp_path.iterdir())  # neither the MP4 nor the latents
        result, _ = pool.request("selftest", {"steps": 1}, timeout=60)  # attached: the pool lives on and serves
        assert result["allreduce_ok"] and "ltx" in pool.status()["ranks"][0]["models"]
    finally:
        pool.shutdown()
        cleanup(runtime)


@pytest.mark.parametrize("args, message", [
    (["--gpus", "3"], "--gpus 3: sequence parallelism splits attention heads"),
    (["--frames", "24"], "--frames 24: LTX-2 takes 8k+1 frames (1, 9, 17, 25, ...); use 17 or 25"),
    (["--height", "250"], "--height 250: LTX-2 takes multiples of 32 pixels; use 224 or 256"),
    (["--width", "16"], "--width 16: LTX-2 takes multiples of 32 pixels; use 32"),
    (["--checkpoint", "x.safetensors"], "--checkpoint was given without --gemma"),
    (["--gpus", "0,1"], "--gpus 0,1: no GPU is visible; use --cpu --gpus N for N CPU ranks"),
    (["--gpus", "0,0"], "--gpus 0,0: give distinct GPU indices"),
    (["--gpus", "two"], "'two': give a rank count (--gpus 2) or GPU indices (--gpus 0,1 or --gpus 3,)"),
    (["--out", "x.avi"], "--out x.avi: the video is written as MP4 (H.264); give a name ending in .mp4"),
    (["--out", "{tmp}/afile/x.mp4"], "afile is a file, not a directory"),
], ids=["gpus3", "frames", "height", "width", "checkpoint-only", "gpu-ids-without-gpus", "gpu-ids-repeated",
        "gpus-word", "out-not-mp4", "out-under-a-file"])
def test_bad_requests_fail_before_any_pool_starts(tmp_path, capsys, args, message):
    runtime = short_dir()
    if any("{tmp}" in a for a in args):
        (tmp_path / "afile").write_text("")
    args = [a.format(tmp=tmp_path) for a in args]
    try:
        try:
            rc = main(["generate", "--prompt", "x", "--out", str(tmp_path / "x.mp4"), "--runtime-dir", str(runtime),
                       *args])
        except SystemExit as exc:  # argparse rejects a malformed value itself (exit status 2)
            rc = exc.code
        err = capsys.readouterr().err
        assert rc == 2 and message in err
        if args == ["--gpus", "3"]:
            assert "Start the pool on one of these rank (GPU) counts instead: 1, 2, 4." in err
        assert not any(runtime.iterdir())  # no pool directory: nothing was started
        assert not any(p.name != "afile" for p in tmp_path.iterdir())
    finally:
        cleanup(runtime)


# --------------------------------------------------------------------------- the pieces


def test_empty_latent_follows_comfyui_shapes_and_audio_count():
    latent = empty_av_latent(121, 704, 1280, 24.0)
    video, audio = latent["samples"].tensors
    assert latent["type"] == "audio"
    assert video.shape == (1, 128, 16, 22, 40) and not video.any()
    assert audio.shape == (1, 8, 127, 16) and not audio.any()  # ceil(121 / 24 * 25) = 127 (ltx-core rounds: 126)
    assert num_audio_latents(25, 25.0) == 25 and num_audio_latents(97, 25.0) == 97
    geometry = AudioGeometry(channels=8, freq_bins=16, sample_rate=48000, hop_length=480)
    assert num_audio_latents(10, 10.0, geometry) == 25
    assert audio_geometry({"audio_vae": {"model": {"params": {"sampling_rate": 48000, "ddconfig": {
        "z_channels": 8, "mel_bins": 64}}}, "preprocessing": {"stft": {"hop_length": 480}}}}) == geometry
    assert audio_geometry({}) == AudioGeometry()
    assert GenerateRequest(prompt="p", out="/a/b.mp4").latents_path.name == "b.latents.safetensors"
    assert GenerateRequest(prompt="p", out="/a/b.mov").latents_path.name == "b.mov.latents.safetensors"


def test_mp4_writer_round_trips_frames_and_an_audio_track(tmp_path):
    frames = torch.randint(0, 256, (9, 64, 96, 3), dtype=torch.uint8, generator=torch.Generator().manual_seed(0))
    t = torch.arange(16000) / 16000
    wave = torch.stack([torch.sin(2 * math.pi * 440 * t), torch.sin(2 * math.pi * 220 * t)]) * 0.5
    path = tmp_path / "clip.mp4"
    with Mp4Writer(path, 96, 64, 24.0, audio_rate=16000, audio_channels=2) as w:
        w.write_frames(frames)
        w.write_audio(wave, 16000)
    with av.open(str(path)) as f:
        assert {s.type for s in f.streams} == {"video", "audio"}
        assert float(f.streams.video[0].average_rate) == 24.0
        assert f.streams.audio[0].channels == 2 and f.streams.audio[0].rate == 16000
    assert _video_frames(path) == (9, 96, 64)
    with av.open(str(path)) as f:
        assert sum(fr.samples for fr in f.decode(audio=0)) >= 16000
    with pytest.raises(RuntimeError), Mp4Writer(tmp_path / "broken.mp4", 96, 64, 24.0) as w:
        w.write_frames(frames)
        raise RuntimeError("interrupted")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["clip.mp4"]  # no partial file left


def test_gemma_270m_variant_differs_from_the_tiny_checkpoint_only_in_its_text_side(tmp_path):
    from ltx_mgpu.assets import tiny_ltx_checkpoint, tiny_ltx_checkpoint_gemma270m
    from ltx_mgpu.assets.gemma270m import GEMMA_270M_HIDDEN, GEMMA_270M_HIDDEN_STATES
    from ltx_mgpu.text.features import load_projection

    tiny = load_file(tiny_ltx_checkpoint("2.3", tmp_path))
    variant_path = tiny_ltx_checkpoint_gemma270m("2.3", tmp_path)
    variant = load_file(variant_path)
    assert tiny.keys() == variant.keys()
    reshaped = sorted(k for k in tiny if tiny[k].shape != variant[k].shape)
    assert all(torch.equal(tiny[k], variant[k]) for k in tiny if k not in reshaped)  # values are keyed by name
    assert reshaped == ["text_embedding_projection.audio_aggregate_embed.weight",
                        "text_embedding_projection.video_aggregate_embed.weight"]
    projection = load_projection(variant_path, num_layers=GEMMA_270M_HIDDEN_STATES)
    assert projection.embedding_dim == GEMMA_270M_HIDDEN and projection.in_features == 640 * 19
    assert inspect_vae_source(variant_path).has_video


# --------------------------------------------------------------------------- bench


def test_bench_reads_ratios_from_the_scripts_results():
    import json
    from pathlib import Path

    from ltx_mgpu.cli.bench import format_table, nf4_rows, sp_rows, text_rows

    # the socket rows: tests/integration/test_cli_newcomer.py (the script prints one table per payload size)
    results = Path(__file__).resolve().parents[2] / "benchmarks" / "results"
    sp = json.loads((results / "sp_h200.json").read_text())
    v = sp["sizes"]["6144"]["variants"]
    assert ("sp", "sp-ws1 vs plain, 6144 video tokens", f"{v['sp-ws1']['median_ms']:.1f} ms",
            f"{v['sp-ws1']['median_ms'] / v['plain']['median_ms']:.3f}x plain") in sp_rows(sp)
    text = json.loads((results / "text_h200.json").read_text())
    t = text["variants"]
    assert ("text", "ours-eager 8x1024 (Gemma 3 12B shape)", f"{t['ours-eager/8x1024']['median_ms']:.1f} ms",
            f"{t['ours-eager/8x1024']['median_ms'] / t['plain/8x1024']['median_ms']:.2f}x plain transformers") \
        in text_rows(text)
    nf4 = json.loads((results / "nf4_h200.json").read_text())
    rows = nf4_rows(nf4)
    assert rows[0][3] == f"{nf4['nf4']['resident_bytes'] / nf4['bf16']['resident_bytes']:.2f}x bf16"
    assert len(format_table(rows).splitlines()) == len(rows) + 2


def test_a_checkpoint_that_is_not_safetensors_is_named_before_any_pool_starts(tmp_path, capsys, tiny_gemma_dir):
    broken = tmp_path / "broken.safetensors"
    broken.write_bytes(b"\x00" * 4)  # shorter than a safetensors header
    runtime = short_dir()
    try:
        rc = main(["generate", "--prompt", "x", "--out", str(tmp_path / "x.mp4"), "--runtime-dir", str(runtime),
                   "--checkpoint", str(broken), "--gemma", str(tiny_gemma_dir)])
        err = capsys.readouterr().err
        assert rc == 2 and "broken.safetensors: not a readable .safetensors file" in err and "Traceback" not in err
        assert not any(runtime.iterdir())
        # --checkpoint and --gemma swapped: the directory is named as one
        rc = main(["generate", "--prompt", "x", "--out", str(tmp_path / "x.mp4"), "--runtime-dir", str(runtime),
                   "--checkpoint", str(tiny_gemma_dir), "--gemma", str(broken)])
        err = capsys.readouterr().err
        assert rc == 2 and f"{tiny_gemma_dir} is a directory (a Gemma snapshot?)" in err and "Traceback" not in err
        assert not any(runtime.iterdir())
    finally:
        cleanup(runtime)


def test_a_second_ctrl_c_aborts_with_one_line_not_a_traceback(monkeypatch, capsys):
    """KeyboardInterrupt out of a command (generate's second Ctrl-C) ends the CLI with "aborted"
    and status 130 (found by a newcomer: it printed a 40-line traceback)."""
    import ltx_mgpu.cli.pool as commands

    def interrupted(args):
        raise KeyboardInterrupt

    monkeypatch.setattr(commands, "cmd_status", interrupted)
    assert main(["pool", "status"]) == 130
    err = capsys.readouterr().err
    assert err.strip() == "aborted" and "Traceback" not in err


def test_ctrl_c_while_gemma_is_being_prepared_sends_no_pool_job(tmp_path, monkeypatch):
    """The embedded Gemma's one-time conversion runs before the encode: a Ctrl-C during it stops
    the run there (found by a newcomer: the encode job was still sent afterwards)."""
    import dataclasses

    import ltx_mgpu.cli.pipeline as gen
    from ltx_mgpu.client.pool_client import PoolClient as Client

    stop = []
    real = gen.resolve_models

    def resolving(req):
        models = real(req)
        return dataclasses.replace(models, gemma=lambda: stop.append(1) or models.gemma())

    sent = []
    real_request = Client.request
    monkeypatch.setattr(gen, "resolve_models", resolving)
    monkeypatch.setattr(Client, "request", lambda self, mtype, *a, **k: sent.append(mtype) or real_request(
        self, mtype, *a, **k))
    runtime = short_dir()
    try:
        req = GenerateRequest(prompt=PROMPT, gpus=1, frames=FRAMES, height=HEIGHT, width=WIDTH, steps=2,
                              out=str(tmp_path / "x.mp4"), runtime_dir=str(runtime), no_cache=True)
        with pytest.raises(GenerateCancelled, match="nothing was written"):
            generate(req, notify=lambda message: None, should_cancel=lambda: bool(stop))
    finally:
        cleanup(runtime)
    assert stop and not any(m in sent for m in ("load_text_encoder", "encode")) and not any(tmp_path.iterdir())


def test_out_in_a_missing_directory_is_accepted_and_made_when_written(tmp_path):
    """generate, like encode, makes a missing output directory (checked up front: not a file)."""
    from ltx_mgpu.cli.request import GenerateRequest, validate_request
    from ltx_mgpu.files import make_parent

    out = tmp_path / "renders" / "today" / "fox.mp4"
    req = GenerateRequest(prompt="x", out=str(out))
    validate_request(req)
    assert not out.parent.exists()
    make_parent(req.out)  # what the writer does first
    assert out.parent.is_dir() and req.latents_path.parent == out.parent


def test_directory_settings_that_name_a_file_are_refused_with_the_setting_named(tmp_path, monkeypatch, capsys):
    """A cache, home or runtime directory given as a regular file: one line naming the setting,
    before any work (a newcomer got NotADirectoryError tracebacks)."""
    from ltx_mgpu.client.spec import runtime_base
    from ltx_mgpu.files import check_directory_setting
    from ltx_mgpu.identity import home_dir
    from ltx_mgpu.text.cache.keys import default_cache_dir
    from ltx_mgpu.text.cache.store import EmbeddingCache

    afile = tmp_path / "afile"
    afile.write_text("")
    assert check_directory_setting(tmp_path / "new" / "dir", "--cache") == tmp_path / "new" / "dir"
    for what, call in [
        ("$LTX_MGPU_HOME", lambda: (monkeypatch.setenv("LTX_MGPU_HOME", str(afile)), home_dir())),
        ("$LTX_MGPU_CACHE_DIR", lambda: (monkeypatch.setenv("LTX_MGPU_CACHE_DIR", str(afile / "sub")),
                                         default_cache_dir())),
        ("$LTX_MGPU_RUNTIME_DIR", lambda: (monkeypatch.setenv("LTX_MGPU_RUNTIME_DIR", str(afile)), runtime_base())),
        ("runtime directory", lambda: runtime_base(afile)),
        ("cache directory", lambda: EmbeddingCache(afile)),
    ]:
        with pytest.raises(ValueError, match=f"{what.replace('$', '[$]')} .*afile is a file, not a directory"):
            call()
        monkeypatch.delenv("LTX_MGPU_HOME", raising=False)
        monkeypatch.delenv("LTX_MGPU_CACHE_DIR", raising=False)
        monkeypatch.delenv("LTX_MGPU_RUNTIME_DIR", raising=False)
    for flag in ("--cache", "--runtime-dir"):
        rc = main(["generate", "--prompt", "x", "--out", str(tmp_path / "x.mp4"), flag, str(afile)])
        err = capsys.readouterr().err
        assert rc == 2 and f"{flag} {afile}: {afile} is a file, not a directory" in err and "Traceback" not in err
    rc = main(["encode", "--prompt", "x", "--out", str(tmp_path / "e.safetensors"), "--cache", str(afile)])
    err = capsys.readouterr().err
    assert rc == 2 and f"--cache {afile}: {afile} is a file" in err


@pytest.mark.parametrize("args, message", [
    (["--compile", "on"], "its quantized blocks run eagerly (dequantized per call); set compile to auto"),
    (["--dtype", "fp8"], "its quantized blocks run with dtype bf16, fp16 or fp32"),
], ids=["compile-on", "dtype-fp8"])
def test_a_gguf_transformer_with_compile_on_or_fp8_is_refused_before_any_pool_starts(tmp_path, capsys,
                                                                                     tiny_gemma_dir, tiny_ltx_23,
                                                                                     args, message):
    """``generate --compile on`` (or ``--dtype fp8``) with a GGUF transformer: refused from the
    file's header, naming the fix, before a pool starts (no weight is read)."""
    from gguf_support import gguf_pair, wide_file

    gguf, _ = gguf_pair(wide_file(tmp_path), tmp_path, "Q8_0")
    runtime = short_dir()
    try:
        rc = main(["generate", "--prompt", "x", "--out", str(tmp_path / "x.mp4"), "--runtime-dir", str(runtime),
                   "--checkpoint", str(gguf), "--gemma", str(tiny_gemma_dir), "--vae", str(tiny_ltx_23), "--cpu",
                   *args])
        err = capsys.readouterr().err
        assert rc == 2 and f"{gguf.name} is a GGUF file: {message}" in err and "Traceback" not in err, err
        assert not any(runtime.iterdir())  # no pool directory: nothing was started
    finally:
        cleanup(runtime)
