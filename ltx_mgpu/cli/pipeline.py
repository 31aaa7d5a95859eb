"""``python -m ltx_mgpu generate``: a prompt to an MP4 through the pool, end to end.

    report = generate(GenerateRequest(prompt="A red fox in fresh snow", gpus=2))
    print(report.summary())

Order of work (each step fails early with a message that names the fix):

1. validate the request (frames ``8k+1``, height/width multiples of 32, steps, cfg, fps, the
   output directory) and read the checkpoint's *header*: the head split for the requested
   world size (``check_world_size``, whose message lists the GPU counts that work), the video
   token budget, the VAE. No pool is started and no weight is read before this passes;
2. start the pool of the requested world size (with-owner: it stops when this run ends), or
   attach to the one running for the same GPU set (``python -m ltx_mgpu pool start --detach``);
3. encode the positive and negative prompts through the embedding cache
   (:func:`ltx_mgpu.client.text.encode_prompts`: the lookups happen here, so a fully cached
   pair sends no text request and never loads Gemma); only the misses go to the pool;
4. load the transformer on every rank (``remote_load_transformer``; a pool this run started has
   its text encoder unloaded first, to give the transformer the memory) and denoise an empty
   audio-video LATENT (video ``[1, 128, (F-1)//8+1, H/32, W/32]`` zeros, audio ``[1, 8, N, 16]``
   zeros with N as ComfyUI's ``LTXVEmptyLatentAudio`` computes it) sequence-parallel over the
   pool's ranks (``remote_sample``, LTX-2 scheduler sigmas from ``steps``);
5. release the pool if this run started it (it stops, unless a client that attached meanwhile
   still uses it: it is handed over to them), then decode in this process: the video with ltx-core's
   video VAE from the checkpoint's ``vae.*``, the audio with its audio VAE and vocoder when the
   checkpoint has them (ltx-core's decoder, no torchaudio needed: ``assets.audio.ltx_core_audio_vae``;
   otherwise video only, with a notice); write the MP4 (H.264 + AAC) and
   ``<out>.latents.safetensors`` beside it.

Without model paths the embedded default runs: the tiny LTX-2.3 checkpoint and the real Gemma 3
270M when its package is installed (with the tiny checkpoint variant whose text projection fits
the 270M), otherwise the tiny Gemma. The tiny transformer's weights are random: its video is noise.
"""

from __future__ import annotations

import dataclasses
import sys
import time
from pathlib import Path
from typing import Callable

import torch

from ltx_mgpu.cancellation import Cancelled
from ltx_mgpu.cli.checks import cpu_ranks_instead, nvidia_gpus_present
from ltx_mgpu.cli.request import (
    TINY_NOTICE,
    GenerateRequest,
    ResolvedModels,
    empty_av_latent,
    pool_spec_for,
    resolve_models,
    validate_request,
    world_size_for,
)
from ltx_mgpu.cli.wording import plural

__all__ = ["GenerateCancelled", "GenerateReport", "GenerateRequest", "generate"]

ProgressCallback = Callable[[str, int, int], object]


class GenerateCancelled(RuntimeError, Cancelled):
    """``should_cancel()`` turned true: the pool's job stopped at its next step boundary (or the
    run stopped between phases); nothing was written."""


def _stderr(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


# --------------------------------------------------------------------------- the run


@dataclasses.dataclass
class GenerateReport:
    """What a run did (``summary()`` prints it).

    Attributes:
        video_path, latents_path: the outputs. frames, width, height, fps: the video.
        video_tokens: latent frames x height x width; audio_tokens: audio latents N.
        steps, cfg, seed; seconds_per_step: the ``sample`` request's wall time / steps (seconds).
        world_size, device: the pool's ranks and their device type.
        cache_hits, cache_misses: distinct prompts served from / missing in the cache.
        text_encoder_loaded: this run loaded Gemma into the pool.
        pool_pid, pool_started: the pool (torchrun's pid) and whether this run started it.
        pool_stopped: a pool this run started stopped at the end (False: a client that attached
            meanwhile still uses it; it stops when they are done). pool_models: the models
            resident in the pool after sampling (rank 0's view).
        audio: whether the MP4 has an audio track; audio_note: why not. audio_rate (Hz) and
            audio_channels: the track's, when there is one.
        seconds: wall time per phase (``validate``, ``pool`` (start or attach), ``encode``, ``load``,
            ``denoise``, ``decode``).
        embedded: the embedded default ran (its output is noise).
    """

    video_path: Path
    latents_path: Path
    frames: int
    width: int
    height: int
    fps: float
    video_tokens: int
    audio_tokens: int
    steps: int
    cfg: float
    seed: int
    seconds_per_step: float
    world_size: int
    device: str
    cache_hits: int
    cache_misses: int
    text_encoder_loaded: bool
    pool_pid: int | None
    pool_started: bool
    pool_stopped: bool
    pool_models: list[str]
    audio: bool
    audio_note: str | None
    codec: str
    seconds: dict[str, float]
    embedded: bool
    audio_rate: int | None = None
    audio_channels: int = 0

    def _text_encoder_state(self) -> str:
        if self.text_encoder_loaded:
            return "loaded"
        return "already resident in the pool" if self.cache_misses else "not loaded"

    def _track(self) -> str:
        if not self.audio:
            return "video only"
        layout = {1: "mono", 2: "stereo"}.get(self.audio_channels, f"{self.audio_channels} channels")
        rate = f"{self.audio_rate / 1000:g} kHz " if self.audio_rate else ""
        return f"with audio: AAC {rate}{layout}"

    def _pool_state(self) -> str:
        models = ", ".join(self.pool_models)
        if not self.pool_started:
            return f"attached; it keeps {models or 'nothing'} resident"
        if self.pool_stopped:
            return f"started for this run and stopped (models loaded when sampling ended: {models or 'none'})"
        return "started for this run; left running for another client that uses it (it stops when they are done)"

    def summary(self) -> str:
        """A few lines for the terminal."""
        prompts = self.cache_hits + self.cache_misses
        times = ", ".join(f"{k} {v:.1f} s" for k, v in self.seconds.items())
        lines = [
            f"wrote {self.video_path} ({plural(self.frames, 'frame')}, {self.width}x{self.height} @ "
            f"{self.fps:g} fps, {self.codec} {self._track()}) and {self.latents_path}",
            f"  tokens: video {self.video_tokens}, audio {self.audio_tokens}",
            f"  denoise: {plural(self.steps, 'step')}, cfg {self.cfg:g}, seed {self.seed}, "
            f"{self.seconds_per_step:.3f} s/step, world size {self.world_size} "
            f"({self.device} {'rank' if self.world_size == 1 else 'ranks'})",
            f"  prompts: {prompts}{' (prompt + negative)' if prompts == 2 else ''}, cache hits {self.cache_hits}, "
            f"encoded {self.cache_misses}; "
            f"text encoder {self._text_encoder_state()}",
            f"  pool: pid {self.pool_pid}, " + self._pool_state(),
            f"  times: {times}",
        ]
        if self.audio_note:
            lines.append(f"  audio: {self.audio_note}")
        if self.embedded:
            lines.append("  (embedded tiny model: the video is noise by design)")
        return "\n".join(lines)


def generate(req: GenerateRequest, on_progress: ProgressCallback | None = None,
             notify: Callable[[str], None] = _stderr,
             should_cancel: Callable[[], bool] | None = None) -> GenerateReport:
    """Run ``req`` end to end (see the module docstring) and return the report.

    Args:
        on_progress: ``(phase, step, total)`` for ``pool`` (start/attach), ``load_text_encoder``
            and ``encode`` (the pool's events; only when Gemma runs), ``load_transformer``,
            ``denoise`` (one per step, from the pool) and ``decode`` (frames written).
        notify: receives the notices (embedded default, video only); default: stderr.
        should_cancel: polled while the pool works and between phases; when it returns True the
            pool's job is cancelled at its next step boundary and :class:`GenerateCancelled` raised.
    Raises:
        GenerateCancelled: see ``should_cancel``.
        ValueError (incl. ``SequenceParallelConfigError``, ``CheckpointError``, ``MediaError``,
        ``ProjectionFormatError``): bad input, before any pool is started or weight is read.
        FileNotFoundError: a model path does not exist.
        ltx_mgpu.client.errors.PoolError and subclasses: the pool failed or rejected a request.
    """
    from ltx_mgpu.cli.decode import audio_decode_unavailable, audio_geometry, inspect_vae_source
    from ltx_mgpu.client.denoise import SampleRequest, remote_load_transformer, remote_sample
    from ltx_mgpu.client.errors import JobCancelledError
    from ltx_mgpu.client.pool_client import PoolClient
    from ltx_mgpu.client.text import encode_prompts
    from ltx_mgpu.denoise.checkpoint import inspect_checkpoint
    from ltx_mgpu.denoise.model import checkpoint_storage
    from ltx_mgpu.denoise.parallel.split import check_token_budget
    from ltx_mgpu.denoise.plan import TransformerPlan
    from ltx_mgpu.text.cache.keys import default_cache_dir
    from ltx_mgpu.text.cache.store import EmbeddingCache
    from ltx_mgpu.text.config import TextEncoderConfig
    from ltx_mgpu.text.gemma.sources import detect_gemma_format

    seen: set[str] = set()
    wanted = should_cancel or (lambda: False)

    def check() -> None:
        if wanted():
            raise GenerateCancelled("cancelled; nothing was written")

    def progress(phase: str, step: int, total: int) -> None:
        seen.add(phase)
        if on_progress is not None:
            on_progress(phase, step, total)

    seconds: dict[str, float] = {}
    t = time.perf_counter()
    validate_request(req)
    models = resolve_models(req)
    info = inspect_checkpoint(models.checkpoint)  # the header only
    if not models.embedded:  # the Gemma source too, from its names and headers, before any pool starts
        detect_gemma_format(models.gemma())
    world, on_gpus = world_size_for(req, info)
    if not on_gpus and not req.cpu:  # GPUs were meant (asked for, or the default) and torch sees none
        if req.gpus is not None:
            notify(cpu_ranks_instead(f"--gpus {req.gpus}", world, f"--cpu --gpus {world}"))
        elif nvidia_gpus_present():
            cpu_ranks_instead("the default (every GPU)", world, "--cpu")  # raises: GPUs torch cannot see
    plan = TransformerPlan(models.checkpoint, dtype=req.dtype or ("bf16" if on_gpus else "fp32"),
                           weights=req.transformer_weights, layout=req.layout, max_tokens=req.max_tokens,
                           connectors=req.connectors, compile=req.compile)
    plan.with_storage(checkpoint_storage(info))  # dtype / compile against the file's storage, before any pool
    vae = inspect_vae_source(models.vae)
    if not vae.has_video:
        raise ValueError(f"{models.vae} holds no LTX-2 video VAE (vae.decoder.* and a 'vae' config); pass --vae with "
                         "an LTX-2 monolith checkpoint")
    geometry = audio_geometry(vae.config)
    audio_in = int(info.config["transformer"].get("audio_in_channels", 128))
    if geometry.channels * geometry.freq_bins != audio_in:
        raise ValueError(f"{models.vae}: its audio latent ({geometry.channels} x {geometry.freq_bins}) does not fit "
                         f"the transformer's {audio_in} audio channels; use the VAE of the same LTX-2 release")
    latent = empty_av_latent(req.frames, req.height, req.width, req.fps, geometry)
    video, audio = latent["samples"].tensors
    video_tokens = int(video.shape[2] * video.shape[3] * video.shape[4])
    check_token_budget(video_tokens, plan.max_tokens)
    spec = pool_spec_for(req, world, on_gpus)
    if req.gpus is None and on_gpus and world < torch.cuda.device_count():
        notify(f"note: using {world} of {torch.cuda.device_count()} GPUs: the model's attention heads split over "
               f"{world}, not {torch.cuda.device_count()} (pass --gpus to choose)")
    if models.embedded:
        notify(TINY_NOTICE.format(gemma=models.gemma_name))
    audio_note = audio_decode_unavailable(vae)
    if audio_note is not None:
        notify(f"note: video only: {audio_note}")
    seconds["validate"] = time.perf_counter() - t

    client = PoolClient(spec, startup_timeout=300.0)
    try:
        t = time.perf_counter()
        check()
        progress("pool", 0, 1)
        client.status(timeout=60.0)  # starts the pool of `spec`, or attaches to the one running
        progress("pool", 1, 1)
        seconds["pool"] = time.perf_counter() - t

        t = time.perf_counter()
        gemma = models.gemma()  # the embedded default's one-time conversion runs here (slow, once)
        check()  # a Ctrl-C meanwhile: no new pool job
        encoder = TextEncoderConfig(gemma, models.projection, weights=req.weights, placement=req.placement)
        cache = None if req.no_cache else EmbeddingCache(req.cache_dir or default_cache_dir())
        prompts = [req.prompt] if req.cfg == 1 else [req.prompt, req.negative]
        embeddings, cache_report = encode_prompts(client, encoder, prompts, cache=cache, on_progress=progress,
                                                  should_cancel=wanted)
        text_loaded = "load_text_encoder" in seen
        for what, e in zip(("prompt", "negative prompt"), embeddings):
            if e.dropped_tokens:
                notify(f"note: the {what} is longer than Gemma's {encoder.token_budget}-token budget: its last "
                       f"{e.dropped_tokens} tokens were dropped")
        conds = [e.to_conditioning() for e in embeddings]
        for c in conds:  # LTXVConditioning's frame rate: video positions are in seconds
            c[0][1]["frame_rate"] = float(req.fps)
        seconds["encode"] = time.perf_counter() - t

        t = time.perf_counter()
        check()
        progress("load_transformer", 0, 1)
        if text_loaded and client.launched:  # our own pool: free Gemma's memory for the transformer
            client.request("unload", {"names": ["text_encoder", "text_embeddings"]}, timeout=120)
        remote_load_transformer(client, plan, should_cancel=wanted)
        progress("load_transformer", 1, 1)
        seconds["load"] = time.perf_counter() - t

        t = time.perf_counter()
        check()
        denoised = remote_sample(client, SampleRequest(conds[0], conds[1] if len(conds) > 1 else None, latent,
                                                       steps=req.steps, cfg=req.cfg, seed=req.seed),
                                 on_progress=progress, should_cancel=wanted)
        seconds["denoise"] = time.perf_counter() - t
        pool_models = sorted(client.status()["ranks"][0].get("models", {}))
        pool_pid, started = client.pid, client.launched
    except JobCancelledError:
        if wanted():
            raise GenerateCancelled("cancelled: the pool's job stopped at its next step boundary (a model load or "
                                    "an encode finishes first); nothing was written") from None
        raise
    finally:
        stopped = client.release()  # a pool started here stops, unless another client uses it now

    check()
    t = time.perf_counter()
    video_out, audio_out = denoised["samples"].tensors
    codec, track, audio_note = _write_outputs(req, models, video_out, audio_out, audio_note, progress, notify)
    seconds["decode"] = time.perf_counter() - t
    return GenerateReport(
        video_path=Path(req.out), latents_path=req.latents_path, frames=req.frames, width=req.width,
        height=req.height, fps=req.fps, video_tokens=video_tokens, audio_tokens=int(audio.shape[2]), steps=req.steps,
        cfg=req.cfg, seed=req.seed, seconds_per_step=seconds["denoise"] / req.steps, world_size=world,
        device="cuda" if on_gpus else "cpu", cache_hits=cache_report.hits, cache_misses=cache_report.misses,
        text_encoder_loaded=text_loaded, pool_pid=pool_pid, pool_started=started, pool_stopped=stopped,
        pool_models=pool_models, audio=track is not None, audio_note=audio_note, codec=codec, seconds=seconds,
        embedded=models.embedded, audio_rate=track[0] if track else None, audio_channels=track[1] if track else 0)


def _write_outputs(req: GenerateRequest, models: ResolvedModels, video: torch.Tensor, audio: torch.Tensor,
                   audio_note: str | None, progress: ProgressCallback,
                   notify: Callable[[str], None]) -> tuple[str, tuple[int, int] | None, str | None]:
    """Save the latents, decode (audio first, when possible), write the MP4: ``(codec, (audio rate Hz,
    channels) or None, note)``."""
    from ltx_mgpu.cli.decode import Mp4Writer, decode_audio, decode_video, load_video_decoder, save_latents
    from ltx_mgpu.files import make_parent

    make_parent(req.out)  # the latents go beside the video
    save_latents(req.latents_path, {"video": video, "audio": audio},
                 {"prompt": req.prompt, "negative": req.negative if req.cfg != 1 else "", "seed": str(req.seed),
                  "steps": str(req.steps), "cfg": str(req.cfg), "fps": str(req.fps), "frames": str(req.frames),
                  "checkpoint": models.checkpoint, "format": "ltx_mgpu.cli.pipeline/1"})
    cuda = torch.cuda.is_available() and not req.cpu
    device, dtype = (torch.device("cuda"), torch.bfloat16) if cuda else (torch.device("cpu"), torch.float32)
    progress("decode", 0, req.frames)
    waveform = rate = None
    if audio_note is None:
        try:
            waveform, rate = decode_audio(audio, models.vae, device, dtype)
        except Exception as e:  # noqa: BLE001 - the video is still worth writing
            audio_note = f"audio decoding failed ({type(e).__name__}: {e}); wrote video only"
            notify(f"warning: {audio_note}")
    decoder = load_video_decoder(models.vae, device, dtype)
    with Mp4Writer(req.out, req.width, req.height, req.fps, audio_rate=rate,
                   audio_channels=None if waveform is None else waveform.shape[0]) as writer:
        for chunk in decode_video(video, decoder, seed=req.seed):
            writer.write_frames(chunk)
            progress("decode", writer.frames, req.frames)
        if writer.frames != req.frames:  # raised inside: the writer discards the file
            raise RuntimeError(f"the VAE decoded {plural(writer.frames, 'frame')} for {req.frames} requested "
                               "(a bug in ltx_mgpu)")
        if waveform is not None:
            writer.write_audio(waveform, rate)
    return writer.codec, None if waveform is None else (int(rate), int(waveform.shape[0])), audio_note
